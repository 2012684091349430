//! The `BALLAST_*` environment layer: which variable sets which setting,
//! how its text is read, and which variables were applied.

use std::str::FromStr;

use super::{Config, ConfigError, DatabaseUrl, HumanDuration, Secret, parse_duration};

/// Reads a variable's text into one setting, or says why it cannot.
type Setter = fn(&mut Config, &str) -> Result<(), String>;

/// Every variable, in the order applied (the first that does not parse is
/// the one reported, and `check-config` lists them in this order). Each
/// reads its text, then places it.
const VARS: [(&str, Setter); 18] = [
    ("BALLAST_ADMIN_PASSWORD", |c, v| {
        admin_password(v).map(|p| c.server.admin_password = Some(p))
    }),
    ("BALLAST_SERVER_SECURE_COOKIES", |c, v| {
        parsed(v, "boolean", ", expected true or false").map(|b| c.server.secure_cookies = b)
    }),
    ("BALLAST_SERVER_SESSION_TTL", |c, v| {
        duration(v).map(|d| c.server.session_ttl = d)
    }),
    ("BALLAST_SERVER_SESSION_IDLE", |c, v| {
        duration(v).map(|d| c.server.session_idle = d)
    }),
    ("BALLAST_SERVER_TRUSTED_PROXIES", |c, v| {
        ip_list(v).map(|l| c.server.trusted_proxies = l)
    }),
    ("BALLAST_SECRET_KEY", |c, v| {
        c.server.secret_key = Some(Secret::new(v));
        Ok(())
    }),
    ("BALLAST_METRICS_TOKEN", |c, v| {
        c.server.metrics_token = Some(Secret::new(v));
        Ok(())
    }),
    ("BALLAST_SERVER_BIND", |c, v| {
        parsed(v, "address", ", expected e.g. 127.0.0.1:8080").map(|a| c.server.bind = a)
    }),
    ("BALLAST_SERVER_PUBLIC_URL", |c, v| {
        c.server.public_url = Some(v.to_owned());
        Ok(())
    }),
    ("BALLAST_SERVER_SHUTDOWN_GRACE", |c, v| {
        duration(v).map(|d| c.server.shutdown_grace = d)
    }),
    ("BALLAST_SERVER_METRICS_GROUPS", |c, v| {
        parsed(v, "number", "").map(|n| c.server.metrics_groups = n)
    }),
    ("BALLAST_DATABASE_URL", |c, v| {
        c.database.url = DatabaseUrl::new(v);
        Ok(())
    }),
    ("BALLAST_DATABASE_MAX_CONNECTIONS", |c, v| {
        parsed(v, "number", "").map(|n| c.database.max_connections = n)
    }),
    ("BALLAST_DATABASE_ACQUIRE_TIMEOUT", |c, v| {
        duration(v).map(|d| c.database.acquire_timeout = d)
    }),
    ("BALLAST_DATABASE_BUSY_TIMEOUT", |c, v| {
        duration(v).map(|d| c.database.busy_timeout = d)
    }),
    // Empty turns traces off, as an absent `endpoint` does in the file.
    ("BALLAST_TRACES_ENDPOINT", |c, v| {
        c.traces.endpoint = Some(v.to_owned()).filter(|v| !v.is_empty());
        Ok(())
    }),
    ("BALLAST_TRACES_SERVICE_NAME", |c, v| {
        c.traces.service_name = Some(v.to_owned());
        Ok(())
    }),
    ("BALLAST_TRACES_SAMPLE", |c, v| {
        parsed(v, "number", ", expected 0 to 1").map(|s| c.traces.sample = s)
    }),
];

/// The variables holding secrets, each of which may instead name a file
/// holding it in its `_FILE` twin (`BALLAST_SECRET_KEY_FILE`): a relative
/// path is read in systemd's `$CREDENTIALS_DIRECTORY` when set.
const FILE_TWINS: [&str; 4] = [
    "BALLAST_ADMIN_PASSWORD",
    "BALLAST_SECRET_KEY",
    "BALLAST_METRICS_TOKEN",
    "BALLAST_DATABASE_URL",
];

/// Whether `var` is one of the server's secrets (or its `_FILE` twin),
/// read at start only: a reload does not read them again (a file removed
/// after the start, such as the first admin's password, refuses nothing).
pub(super) fn start_only(var: &str) -> bool {
    let var = var.strip_suffix("_FILE").unwrap_or(var);
    FILE_TWINS.contains(&var)
}

/// Applies each of [`VARS`] that `env` sets (or its `_FILE` twin names),
/// in order: the names of those applied, or the first one that does not
/// parse (or cannot be read), named.
pub(super) fn apply(
    config: &mut Config,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<String>, ConfigError> {
    let mut applied = Vec::new();
    for (var, set) in &VARS {
        let Some((name, value)) = value_of(var, env)? else {
            continue;
        };
        set(config, &value).map_err(|message| ConfigError::Env {
            var: name.clone(),
            message,
        })?;
        applied.push(name);
    }
    Ok(applied)
}

/// `var`'s value and the variable that gave it: `var` itself, or the file
/// its `_FILE` twin names (one of the two).
fn value_of(
    var: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(String, String)>, ConfigError> {
    let twin = FILE_TWINS.contains(&var).then(|| format!("{var}_FILE"));
    let file = twin.as_deref().and_then(env);
    match (env(var), file) {
        (Some(_), Some(_)) => Err(ConfigError::Env {
            var: var.to_owned(),
            message: format!("set {var} or {var}_FILE, not both"),
        }),
        (Some(value), None) => Ok(Some((var.to_owned(), value))),
        (None, None) => Ok(None),
        (None, Some(path)) => {
            let twin = format!("{var}_FILE");
            let credentials = env(super::secret::CREDENTIALS_DIRECTORY);
            let dir = super::secret::SecretsDir::new(
                credentials.as_deref().map(std::path::Path::new),
                std::path::Path::new("."),
            );
            let path = dir.file(std::path::Path::new(&path));
            let value = super::secret::SecretRef::File(path)
                .read(env, 1)
                .map_err(|message| ConfigError::Env {
                    var: twin.clone(),
                    message,
                })?;
            Ok(Some((twin, value.expose().to_owned())))
        }
    }
}

/// `text` as a `T`, or "invalid WHAT `text`" and the `hint`.
fn parsed<T: FromStr>(text: &str, what: &str, hint: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("invalid {what} `{text}`{hint}"))
}

fn duration(text: &str) -> Result<HumanDuration, String> {
    parse_duration(text).map(HumanDuration)
}

/// Comma-separated IP addresses; blanks between commas are skipped.
fn ip_list(text: &str) -> Result<Vec<std::net::IpAddr>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| parsed(s, "IP address", ""))
        .collect()
}

/// The first admin's password, refused here when the policy would refuse
/// it later, so the mistake is named before anything starts.
fn admin_password(text: &str) -> Result<Secret, String> {
    crate::auth::password::check_policy(text).map_err(|e| e.to_string())?;
    Ok(Secret::new(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variables the field docs of `mod.rs` name (`Env: `BALLAST_…``
    /// and `Environment only: `BALLAST_…``) are exactly those applied.
    #[test]
    fn every_documented_variable_is_applied_and_no_other() {
        let docs = include_str!("mod.rs");
        let mut documented: Vec<&str> = docs
            .lines()
            .filter(|l| l.trim_start().starts_with("///"))
            .filter_map(|l| {
                let (_, rest) = l
                    .split_once("Env: `")
                    .or_else(|| l.split_once("Environment only: `"))?;
                rest.split('`').next()
            })
            .collect();
        let mut applied: Vec<&str> = VARS.iter().map(|(var, _)| *var).collect();
        documented.sort_unstable();
        applied.sort_unstable();
        assert_eq!(documented, applied);
    }

    /// A value of the wrong kind is named by its variable, in one line.
    #[test]
    fn wrong_kinds_are_one_line_naming_the_variable() {
        for (var, value, message) in [
            (
                "BALLAST_SERVER_SECURE_COOKIES",
                "yes",
                "invalid boolean `yes`, expected true or false",
            ),
            (
                "BALLAST_SERVER_BIND",
                "everywhere",
                "invalid address `everywhere`, expected e.g. 127.0.0.1:8080",
            ),
            (
                "BALLAST_SERVER_TRUSTED_PROXIES",
                "10.0.0.1, proxy",
                "invalid IP address `proxy`",
            ),
            (
                "BALLAST_TRACES_SAMPLE",
                "most",
                "invalid number `most`, expected 0 to 1",
            ),
        ] {
            let mut config = Config::default();
            let got = apply(&mut config, &|v| (v == var).then(|| value.to_owned()));
            let shown = got.err().map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(shown, format!("environment variable {var}: {message}"));
        }
        let mut config = Config::default();
        let lag = apply(&mut config, &|v| {
            (v == "BALLAST_SERVER_SESSION_TTL").then(|| "soon".to_owned())
        });
        let shown = lag.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            shown.starts_with("environment variable BALLAST_SERVER_SESSION_TTL: ")
                && !shown.contains('\n'),
            "{shown}"
        );
    }

    #[test]
    fn lists_skip_blanks_and_an_empty_endpoint_is_off() {
        let mut config = Config::default();
        let env = |v: &str| match v {
            "BALLAST_SERVER_TRUSTED_PROXIES" => Some(" 10.0.0.1, ,::1,".to_owned()),
            "BALLAST_TRACES_ENDPOINT" => Some(String::new()),
            _ => None,
        };
        let applied = apply(&mut config, &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            applied,
            ["BALLAST_SERVER_TRUSTED_PROXIES", "BALLAST_TRACES_ENDPOINT"]
        );
        let proxies: Vec<String> = config
            .server
            .trusted_proxies
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(proxies, ["10.0.0.1", "::1"]);
        assert_eq!(config.traces.endpoint, None);
    }
}
