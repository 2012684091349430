//! `[[notify]]`: a subscription to Ballast's own events, delivered to a
//! subscriber that is configured as a provider (its base URL, TLS,
//! timeouts, concurrency, rate limits, breaker and backoff govern the
//! deliveries as they govern calls):
//!
//! ```toml
//! [[notify]]
//! name = "ops"
//! provider = "crm"                     # [providers.crm]
//! path = "/hooks/ballast"              # under its base_url
//! events = ["record.parked", "record.failed", "provider.*"]
//! pipelines = ["payments"]             # optional; groups, providers too
//! secret_env = "OPS_WEBHOOK_SECRET"    # whsec_… (Standard Webhooks)
//! ```
//!
//! Checked at start and at every reload; the secret is read when a
//! delivery is signed.

use std::path::PathBuf;

use serde::Deserialize;

use super::secret::{SecretRef, SecretsDir};
use super::{ConfigError, HumanDuration, Secret, invalid};
use crate::domain::notify::{Filter, Topic};

/// The body a subscription is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `{"type", "timestamp", "data"}`, signed per Standard Webhooks.
    #[default]
    StandardWebhooks,
    /// `{"text"}` for a Slack-compatible incoming webhook.
    Slack,
}

/// `[[notify]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotifyConfig {
    /// Names the subscription (its deliveries, its state, its metrics).
    pub name: String,
    /// The `[providers.NAME]` the deliveries go to and are governed by.
    pub provider: String,
    /// Appended to the provider's `base_url`.
    #[serde(default)]
    pub path: String,
    /// Event types (`record.parked`; a trailing `*` matches any rest).
    pub events: Vec<String>,
    /// Only records of these pipelines (all when empty).
    #[serde(default)]
    pub pipelines: Vec<String>,
    /// Only records of these groups (all when empty).
    #[serde(default)]
    pub groups: Vec<String>,
    /// Only provider events of these providers (all when empty).
    #[serde(default)]
    pub providers: Vec<String>,
    #[serde(default)]
    pub format: Format,
    /// The variable holding the signing secret (`whsec_` + base64 of at
    /// least 16 bytes). Required for `standard_webhooks`.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// Or a file holding it.
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// A notice not delivered this long after its change is given up
    /// (`failed`, kept, redeliverable); the subject's next one goes.
    #[serde(default = "default_retry_for")]
    pub retry_for: HumanDuration,
    /// A subscription whose every delivery has failed this long is turned
    /// off (audited) until an operator turns it on again.
    #[serde(default = "default_disable_after")]
    pub disable_after: HumanDuration,
    /// Where a relative secret file is read (set at load).
    #[serde(skip)]
    pub secrets_dir: SecretsDir,
}

fn default_retry_for() -> HumanDuration {
    HumanDuration(std::time::Duration::from_secs(3 * 86_400))
}

fn default_disable_after() -> HumanDuration {
    HumanDuration(std::time::Duration::from_secs(5 * 86_400))
}

impl NotifyConfig {
    /// What the store matches changes against.
    pub fn filter(&self) -> Filter {
        Filter {
            name: self.name.clone(),
            events: self.events.clone(),
            pipelines: self.pipelines.clone(),
            groups: self.groups.clone(),
            providers: self.providers.clone(),
        }
    }

    /// The signing secret, if one is set.
    pub fn read_secret(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Secret>, String> {
        let r = match (&self.secret_env, &self.secret_file) {
            (Some(var), None) => SecretRef::Env(var.clone()),
            (None, Some(path)) => SecretRef::File(self.secrets_dir.file(path)),
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => return Err("set `secret_env` or `secret_file`, not both".into()),
        };
        let s = r.read(env, 16)?;
        crate::auth::presets::check_standard_secret(s.expose())
            .map_err(|m| format!("the secret {m}"))?;
        Ok(Some(s))
    }

    /// Checks the settings against the providers configured, and that the
    /// secret can be read.
    pub fn validate(
        &self,
        providers: &std::collections::BTreeMap<String, super::provider::ProviderConfig>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let key = |field: &str| format!("notify.{}.{field}", self.name);
        if !crate::domain::trigger::is_name(&self.name) {
            let m = "subscription names are a-z, 0-9, `_`, `-`".to_owned();
            return Err(invalid(&format!("notify.{}", self.name), m));
        }
        if !providers.contains_key(&self.provider) {
            let m = format!("unknown provider `{}`", self.provider);
            return Err(invalid(&key("provider"), m));
        }
        if !self.path.is_empty() && !self.path.starts_with('/') {
            return Err(invalid(&key("path"), "starts with `/`".into()));
        }
        if self.events.is_empty() {
            let m = "name the event types wanted (`record.parked`, `provider.*`)".to_owned();
            return Err(invalid(&key("events"), m));
        }
        for e in &self.events {
            let known = Topic::ALL
                .iter()
                .any(|t| crate::domain::trigger::matches(e, t.as_str()));
            if !known {
                return Err(invalid(
                    &key("events"),
                    format!("`{e}` names no event type"),
                ));
            }
        }
        let secret = self
            .read_secret(env)
            .map_err(|m| invalid(&key("secret"), m))?;
        if secret.is_none() && self.format == Format::StandardWebhooks {
            let m = "a standard_webhooks subscription is signed: set `secret_env` or `secret_file`";
            return Err(invalid(&key("secret_env"), m.into()));
        }
        for (field, d) in [
            ("retry_for", self.retry_for),
            ("disable_after", self.disable_after),
        ] {
            if d.0 < std::time::Duration::from_secs(1) {
                return Err(invalid(&key(field), "must be at least 1s".into()));
            }
        }
        Ok(())
    }
}

/// Checks every subscription, and that no two share a name.
pub fn validate_all(
    all: &[NotifyConfig],
    providers: &std::collections::BTreeMap<String, super::provider::ProviderConfig>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    let mut seen = std::collections::HashSet::new();
    for n in all {
        if !seen.insert(n.name.as_str()) {
            let m = "two subscriptions have this name".to_owned();
            return Err(invalid(&format!("notify.{}", n.name), m));
        }
        n.validate(providers, env)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    fn check(extra: &str) -> String {
        let text = format!(
            "[providers.crm]\nbase_url = \"http://127.0.0.1:9\"\n[[notify]]\nname = \"ops\"\n{extra}\n"
        );
        let config = crate::config::Config::parse(&text, std::path::Path::new("t.toml"));
        let env = |v: &str| match v {
            "N_SECRET" => Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned()),
            "N_PLAIN" => Some("not-a-whsec-secret-at-all".to_owned()),
            _ => None,
        };
        match config {
            Err(e) => e.to_string(),
            Ok(c) => super::validate_all(&c.notify, &c.providers, &env)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default(),
        }
    }

    #[test]
    fn a_subscription_is_checked_before_it_is_used() {
        let ok = "provider = \"crm\"\nevents = [\"record.*\"]\nsecret_env = \"N_SECRET\"";
        assert_eq!(check(ok), "");
        let slack = "provider = \"crm\"\nevents = [\"record.parked\"]\nformat = \"slack\"";
        assert_eq!(check(slack), "");
        let cases = [
            (
                "provider = \"nope\"\nevents = [\"*\"]",
                "unknown provider `nope`",
            ),
            (
                "provider = \"crm\"\nevents = []\nformat = \"slack\"",
                "notify.ops.events",
            ),
            (
                "provider = \"crm\"\nevents = [\"record.done\"]\nformat = \"slack\"",
                "names no event type",
            ),
            ("provider = \"crm\"\nevents = [\"*\"]", "is signed"),
            (
                "provider = \"crm\"\nevents = [\"*\"]\nsecret_env = \"N_PLAIN\"",
                "notify.ops.secret",
            ),
            (
                "provider = \"crm\"\nevents = [\"*\"]\nformat = \"slack\"\npath = \"x\"",
                "starts with `/`",
            ),
            (
                "provider = \"crm\"\nevents = [\"*\"]\nformat = \"slack\"\ndisable_after = \"0s\"",
                "at least 1s",
            ),
            (
                "provider = \"crm\"\nevents = [\"*\"]\nformat = \"teams\"",
                "teams",
            ),
        ];
        for (extra, says) in cases {
            let e = check(extra);
            assert!(e.contains(says), "{extra}: {e}");
        }
        let twice = format!("{slack}\n[[notify]]\nname = \"ops\"\n{slack}");
        assert!(check(&twice).contains("two subscriptions"));
    }
}
