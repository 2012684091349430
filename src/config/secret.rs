//! Where a secret comes from: an environment variable (a setting's
//! `*_env`) or a file (its `*_file` twin: a systemd credential, a mounted
//! Kubernetes or Docker secret). Read when the configuration is loaded
//! and again at every reload, so a rotated file is applied without a
//! restart; never printed (messages name the variable or the file).

use std::io::Read;
use std::path::{Path, PathBuf};

use super::Secret;

/// The most a secret file may hold: a key, a token or a certificate's
/// password, not a file named by mistake (`/dev/zero`, a log).
pub const MAX_SECRET_FILE: u64 = 64 * 1024;

/// The variable systemd sets to the unit's credentials directory
/// (`LoadCredential=`): a relative secret file is read there.
pub const CREDENTIALS_DIRECTORY: &str = "CREDENTIALS_DIRECTORY";

/// A secret's source, as a setting names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretRef {
    Env(String),
    File(PathBuf),
}

impl SecretRef {
    /// The one of `env` and `file` that is set; `names` are the two
    /// settings, for the message when neither or both are.
    pub fn one_of(
        env: Option<&String>,
        file: Option<&PathBuf>,
        names: (&str, &str),
    ) -> Result<SecretRef, String> {
        match (env, file) {
            (Some(var), None) => Ok(SecretRef::Env(var.clone())),
            (None, Some(path)) => Ok(SecretRef::File(path.clone())),
            (None, None) => Err(format!("set `{}` or `{}`", names.0, names.1)),
            (Some(_), Some(_)) => Err(format!("set `{}` or `{}`, not both", names.0, names.1)),
        }
    }

    /// Reads the secret: at least `min` bytes, not blank (an env file's
    /// `KEY=` sets a variable to nothing). A file's one trailing newline
    /// (`echo key > file`) is not part of it. The message names the
    /// variable or the file, never the value.
    pub fn read(&self, env: &dyn Fn(&str) -> Option<String>, min: usize) -> Result<Secret, String> {
        let (what, value) = match self {
            SecretRef::Env(var) => (
                format!("environment variable {var}"),
                env(var).ok_or_else(|| format!("environment variable {var} is not set"))?,
            ),
            SecretRef::File(path) => (format!("file {}", path.display()), read_file(path)?),
        };
        if value.trim().is_empty() {
            return Err(format!("{what} is set but empty"));
        }
        if value.len() < min {
            return Err(format!(
                "{what} holds {} bytes; this secret must be at least {min}",
                value.len()
            ));
        }
        Ok(Secret::new(value))
    }
}

/// A secret file's text without its one trailing newline (at most
/// [`MAX_SECRET_FILE`] bytes).
fn read_file(path: &Path) -> Result<String, String> {
    read_text(path, MAX_SECRET_FILE)
}

/// The most a certificate file (a CA bundle) may hold.
pub const MAX_CERTIFICATE_FILE: u64 = 4 * 1024 * 1024;

/// A file's text without its one trailing newline, at most `max` bytes.
/// Only a regular file (symbolic links followed: Kubernetes mounts
/// secrets so) of text is read: opening a FIFO would wait for a writer
/// forever.
pub fn read_text(path: &Path, max: u64) -> Result<String, String> {
    let cannot = |e: std::io::Error| format!("cannot read file {}: {e}", path.display());
    let meta = std::fs::metadata(path).map_err(cannot)?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let too_big = || format!("file {} holds more than {max} bytes", path.display());
    if meta.len() > max {
        return Err(too_big());
    }
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(cannot)?;
    if bytes.len() as u64 > max {
        return Err(too_big());
    }
    let mut text = String::from_utf8(bytes)
        .map_err(|_| format!("file {} does not hold UTF-8 text", path.display()))?;
    let end = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .map_or(text.len(), str::len);
    text.truncate(end);
    Ok(text)
}

/// The directory relative secret files are read in (set when the
/// configuration is loaded; none: the working directory). Not one of a
/// provider's settings: `Debug` prints none of it, so nodes whose files
/// say the same agree on the configuration's version wherever their files
/// are.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretsDir(pub Option<PathBuf>);

impl SecretsDir {
    /// `$CREDENTIALS_DIRECTORY` when systemd set it (`credentials`), else
    /// `beside` (the configuration file's directory).
    pub fn new(credentials: Option<&Path>, beside: &Path) -> Self {
        SecretsDir(Some(credentials.unwrap_or(beside).to_path_buf()))
    }

    /// Where file `path` (as a setting names it) is read.
    pub fn file(&self, path: &Path) -> PathBuf {
        match &self.0 {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_path_buf(),
        }
    }
}

impl std::fmt::Debug for SecretsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsDir")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_read_from_a_variable_or_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            SecretRef::File(p)
        };
        let env = |v: &str| (v == "KEY").then(|| "from-env".to_owned());
        let read = |r: &SecretRef, min| r.read(&env, min).map(|s| s.expose().to_owned());
        assert_eq!(read(&SecretRef::Env("KEY".into()), 1).unwrap(), "from-env");
        assert_eq!(read(&file("a", "from-file\n"), 1).unwrap(), "from-file");
        assert_eq!(read(&file("b", "crlf\r\n"), 1).unwrap(), "crlf");
        assert_eq!(read(&file("c", "two\n\n"), 1).unwrap(), "two\n");
        let err = |r: &SecretRef, min| read(r, min).unwrap_err();
        assert_eq!(
            err(&SecretRef::Env("NOPE".into()), 1),
            "environment variable NOPE is not set"
        );
        let blank = file("d", " \n");
        assert!(
            err(&blank, 1).ends_with("is set but empty"),
            "{}",
            err(&blank, 1)
        );
        let short = file("e", "short");
        assert!(
            err(&short, 32).ends_with("holds 5 bytes; this secret must be at least 32"),
            "{}",
            err(&short, 32)
        );
        let fifo = dir.path().join("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        let fifo = SecretRef::File(fifo);
        assert!(
            err(&fifo, 1).ends_with("is not a regular file"),
            "{}",
            err(&fifo, 1)
        );
        let missing = SecretRef::File(dir.path().join("missing"));
        assert!(
            err(&missing, 1).starts_with("cannot read file "),
            "{}",
            err(&missing, 1)
        );
        let big = file("f", &"x".repeat(MAX_SECRET_FILE as usize + 1));
        assert!(
            err(&big, 1).ends_with(&format!("holds more than {MAX_SECRET_FILE} bytes")),
            "{}",
            err(&big, 1)
        );
        // No message holds the value.
        for r in [&blank, &short] {
            assert!(!err(r, 32).contains("short"));
        }
    }

    #[test]
    fn one_of_two_settings_names_the_secret() {
        let (e, f) = (Some("V".to_owned()), Some(PathBuf::from("p")));
        let names = ("value_env", "value_file");
        assert_eq!(
            SecretRef::one_of(e.as_ref(), None, names),
            Ok(SecretRef::Env("V".into()))
        );
        assert_eq!(
            SecretRef::one_of(None, f.as_ref(), names),
            Ok(SecretRef::File("p".into()))
        );
        assert_eq!(
            SecretRef::one_of(None, None, names),
            Err("set `value_env` or `value_file`".into())
        );
        assert_eq!(
            SecretRef::one_of(e.as_ref(), f.as_ref(), names),
            Err("set `value_env` or `value_file`, not both".into())
        );
    }

    #[test]
    fn a_relative_file_is_read_in_the_credentials_directory_or_beside_the_file() {
        let (creds, conf) = (
            Path::new("/run/credentials/ballast"),
            Path::new("/etc/ballast"),
        );
        let anchored = |p: &str, credentials| SecretsDir::new(credentials, conf).file(Path::new(p));
        assert_eq!(anchored("acme", Some(creds)), creds.join("acme"));
        assert_eq!(anchored("acme", None), conf.join("acme"));
        assert_eq!(anchored("/srv/k", Some(creds)), PathBuf::from("/srv/k"));
    }
}
