//! `[database.encryption]`: the data keys values are sealed with at rest
//! (`auth::seal`). Read at start and at every reload, from a file (a
//! relative one in systemd's credentials directory, else beside the
//! configuration) or a variable:
//!
//! ```toml
//! [database.encryption]
//! key = "2026-12"                       # new values are sealed with this one
//! [database.encryption.keys]
//! 2026-12 = { key_file = "data-key-2026-12" }
//! 2026-01 = { key_env = "BALLAST_DATA_KEY_2026_01" }  # still opens old values
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use super::secret::{SecretRef, SecretsDir};
use super::{ConfigError, invalid};
use crate::auth::seal::{self, Keyring};

/// `[database.encryption]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EncryptionConfig {
    /// The id of the key new values are sealed with; none: new values are
    /// kept in clear (the keys still open old ones).
    pub key: Option<String>,
    /// Every key values may be sealed with, by id.
    pub keys: BTreeMap<String, DataKeyConfig>,
    /// The keys as read (`load`).
    #[serde(skip)]
    pub keyring: Arc<Keyring>,
}

/// One data key: 32 bytes in base64, from a variable or a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataKeyConfig {
    pub key_env: Option<String>,
    pub key_file: Option<PathBuf>,
}

impl EncryptionConfig {
    /// Reads the keys into [`keyring`](Self::keyring); a relative file is
    /// read in `dir`.
    pub(super) fn load(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        dir: &SecretsDir,
    ) -> Result<(), ConfigError> {
        let mut keys = Vec::new();
        for (id, k) in &self.keys {
            let at = format!("database.encryption.keys.{id}");
            if !seal::valid_key_id(id) {
                return Err(invalid(
                    &at,
                    "a key id is 1-32 characters of A-Z, a-z, 0-9, `.`, `_` or `-`".into(),
                ));
            }
            let source = SecretRef::one_of(
                k.key_env.as_ref(),
                k.key_file.as_ref(),
                ("key_env", "key_file"),
            )
            .map_err(|m| invalid(&at, m))?;
            let source = match source {
                SecretRef::File(path) => SecretRef::File(dir.file(&path)),
                env => env,
            };
            let text = source.read(env, 1).map_err(|m| invalid(&at, m))?;
            let bytes = seal::parse_key(text.expose()).map_err(|m| {
                let what = match &source {
                    SecretRef::Env(var) => format!("environment variable {var}"),
                    SecretRef::File(path) => format!("file {}", path.display()),
                };
                invalid(&at, format!("{what} {m}"))
            })?;
            keys.push((id.clone(), bytes));
        }
        if let Some(current) = &self.key {
            if !self.keys.contains_key(current) {
                return Err(invalid(
                    "database.encryption.key",
                    format!("`{current}` is not among database.encryption.keys"),
                ));
            }
        }
        let ring = Keyring::new(self.key.as_deref(), keys)
            .map_err(|m| invalid("database.encryption", m))?;
        self.keyring = Arc::new(ring);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(toml: &str, env: &[(&str, &str)]) -> Result<EncryptionConfig, String> {
        let mut c: EncryptionConfig = toml::from_str(toml).map_err(|e| e.to_string())?;
        let env: std::collections::HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        c.load(&|v| env.get(v).cloned(), &SecretsDir::default())
            .map_err(|e| e.to_string())?;
        Ok(c)
    }

    const KEY: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";

    #[test]
    fn keys_come_from_variables_and_the_current_one_must_be_listed() {
        let c = load(
            "key = \"k1\"\nkeys.k1 = { key_env = \"K1\" }",
            &[("K1", KEY)],
        )
        .unwrap();
        assert_eq!(c.keyring.current(), Some("k1"));
        let missing = load(
            "key = \"k2\"\nkeys.k1 = { key_env = \"K1\" }",
            &[("K1", KEY)],
        );
        assert!(missing.unwrap_err().contains("`k2` is not among"));
        let unset = load("keys.k1 = { key_env = \"K1\" }", &[]).unwrap_err();
        assert!(unset.contains("K1 is not set"), "{unset}");
        let short = load("keys.k1 = { key_env = \"K1\" }", &[("K1", "AAAA")]).unwrap_err();
        assert!(
            short.contains("holds 3 bytes") && !short.contains("AAAA"),
            "{short}"
        );
        let both = "keys.k1 = { key_env = \"K1\", key_file = \"f\" }";
        assert!(load(both, &[("K1", KEY)]).unwrap_err().contains("not both"));
        let bad_id = load("keys.\"a b\" = { key_env = \"K1\" }", &[("K1", KEY)]);
        assert!(bad_id.unwrap_err().contains("key id"));
        assert!(load("", &[]).unwrap().keyring.is_empty());
    }
}
