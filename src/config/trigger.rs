//! `[triggers.NAME]`: an incoming event starts a record. `POST
//! /triggers/NAME` verifies its sender by a preset, reads the event's id
//! (the record's key: a sender's retry enqueues nothing new) and type,
//! and enqueues the event (or a part of it) into `pipeline`:
//!
//! ```toml
//! [triggers.stripe_paid]
//! preset = "stripe"                       # or github, standard_webhooks, hmac
//! secrets_env = ["STRIPE_WEBHOOK_SECRET"] # two while rotating
//! pipeline = "fulfil"
//! accept = ["checkout.session.completed"] # enqueued; empty: every type not ignored
//! ignore = ["invoice.*"]                  # acknowledged, nothing enqueued
//! input = "/data/object"                  # a JSON pointer into the event (default: all of it)
//! ```
//!
//! Checked at start and at every reload; the secrets are read at each
//! delivery.

use std::path::PathBuf;

use serde::Deserialize;

use super::secret::{SecretRef, SecretsDir};
use super::{ConfigError, HumanDuration, Secret, invalid};
use crate::domain::trigger::{Preset, Source};

/// `[triggers.NAME]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerConfig {
    /// How the sender signs: `stripe` (`Stripe-Signature`), `github`
    /// (`X-Hub-Signature-256`), `standard_webhooks` (`webhook-id`,
    /// `webhook-timestamp`, `webhook-signature`) or `hmac` (a hex or
    /// base64 HMAC-SHA256 of the body in `header`).
    pub preset: Preset,
    /// Environment variables holding the signing secrets (several while
    /// one is rotated).
    #[serde(default)]
    pub secrets_env: Vec<String>,
    /// Files holding signing secrets (beside those of `secrets_env`); a
    /// relative path is read in `$CREDENTIALS_DIRECTORY`, else beside the
    /// configuration file.
    #[serde(default)]
    pub secrets_file: Vec<PathBuf>,
    /// The pipeline an accepted event is enqueued into.
    pub pipeline: String,
    /// Event types enqueued (a trailing `*` matches any rest); empty:
    /// every type not ignored.
    #[serde(default)]
    pub accept: Vec<String>,
    /// Event types acknowledged (2xx) with nothing enqueued.
    #[serde(default)]
    pub ignore: Vec<String>,
    /// Where the event's id is: a JSON pointer into the body (`/id`) or
    /// `header:NAME`. Default: the preset's (Stripe `/id`, GitHub
    /// `header:X-GitHub-Delivery`, Standard Webhooks `header:webhook-id`;
    /// `hmac` has none and needs it).
    #[serde(default)]
    pub id: Option<String>,
    /// Where the event's type is, likewise. Default: the preset's (Stripe
    /// and Standard Webhooks `/type`, GitHub `header:X-GitHub-Event`);
    /// none for `hmac` (every event is of type ``, so `accept` and
    /// `ignore` must be empty).
    #[serde(default, rename = "type")]
    pub event_type: Option<String>,
    /// The record's input: a JSON pointer into the event (`/data/object`);
    /// the whole event when unset.
    #[serde(default)]
    pub input: Option<String>,
    /// The record's group: a JSON pointer into the event or `header:NAME`
    /// (none when unset, or when the event has no such value).
    #[serde(default)]
    pub group: Option<String>,
    /// The record's priority, 0 to 9 (5 when unset).
    #[serde(default)]
    pub priority: Option<u8>,
    /// How far a signed timestamp may be from now (`stripe`,
    /// `standard_webhooks`).
    #[serde(default = "default_tolerance")]
    pub tolerance: HumanDuration,
    /// `hmac`: the header holding the signature.
    #[serde(default)]
    pub header: Option<String>,
    /// `hmac`: `hex` (default) or `base64`.
    #[serde(default)]
    pub encoding: Option<String>,
    /// `hmac`: a prefix before the signature (`sha256=`).
    #[serde(default)]
    pub prefix: Option<String>,
    /// Where its relative secret files are read (set at load).
    #[serde(skip)]
    pub secrets_dir: SecretsDir,
}

fn default_tolerance() -> HumanDuration {
    HumanDuration(std::time::Duration::from_secs(300))
}

/// The fewest bytes of a trigger's secret.
pub const MIN_SECRET: usize = crate::auth::webhook::MIN_SECRET;

impl TriggerConfig {
    /// Reads the secrets (at every delivery, so a rotated file or a
    /// reload takes effect at once): at least one, each at least
    /// [`MIN_SECRET`] bytes; the message names the setting.
    pub fn read_secrets(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Vec<Secret>, (&'static str, String)> {
        let mut secrets = Vec::new();
        for var in &self.secrets_env {
            let s = SecretRef::Env(var.clone()).read(env, MIN_SECRET);
            secrets.push(s.map_err(|m| ("secrets_env", m))?);
        }
        for path in &self.secrets_file {
            let s = SecretRef::File(self.secrets_dir.file(path)).read(env, MIN_SECRET);
            secrets.push(s.map_err(|m| ("secrets_file", m))?);
        }
        if secrets.is_empty() {
            let m = "a trigger verifies its sender: set `secrets_env` or `secrets_file`";
            return Err(("secrets_env", m.into()));
        }
        Ok(secrets)
    }

    /// Where the event's id is read.
    pub fn id_source(&self) -> Option<Source> {
        match &self.id {
            Some(s) => Source::parse(s).ok(),
            None => self.preset.id_source(),
        }
    }

    /// Where the event's type is read (none: every event's type is ``).
    pub fn type_source(&self) -> Option<Source> {
        match &self.event_type {
            Some(s) => Source::parse(s).ok(),
            None => self.preset.type_source(),
        }
    }

    /// The record's input: a pointer into the event, or all of it.
    pub fn input_pointer(&self) -> &str {
        self.input.as_deref().unwrap_or("")
    }

    /// Checks the settings against the pipelines configured, and that
    /// the secrets can be read.
    pub fn validate(
        &self,
        name: &str,
        pipelines: &std::collections::BTreeMap<String, super::pipeline::PipelineConfig>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let key = |field: &str| format!("triggers.{name}.{field}");
        if !crate::domain::trigger::is_name(name) {
            let m = "trigger names are a-z, 0-9, `_`, `-`".to_owned();
            return Err(invalid(&format!("triggers.{name}"), m));
        }
        let secrets = self
            .read_secrets(env)
            .map_err(|(field, m)| invalid(&key(field), m))?;
        if self.preset == Preset::StandardWebhooks {
            for s in &secrets {
                crate::auth::presets::check_standard_secret(s.expose())
                    .map_err(|m| invalid(&key("secrets"), format!("a secret {m}")))?;
            }
        }
        if !pipelines.contains_key(&self.pipeline) {
            let m = format!("unknown pipeline `{}`", self.pipeline);
            return Err(invalid(&key("pipeline"), m));
        }
        for (field, value) in [
            ("id", &self.id),
            ("type", &self.event_type),
            ("group", &self.group),
        ] {
            if let Some(v) = value {
                Source::parse(v).map_err(|m| invalid(&key(field), m))?;
            }
        }
        if let Some(p) = &self.input {
            if !p.is_empty() && !p.starts_with('/') {
                let m = format!("`{p}` is not a JSON pointer (`/data/object`; empty: all)");
                return Err(invalid(&key("input"), m));
            }
        }
        if self.id_source().is_none() {
            let m = "this preset names no event id: set `id` (`/id` or `header:NAME`)";
            return Err(invalid(&key("id"), m.into()));
        }
        if self.type_source().is_none() && !(self.accept.is_empty() && self.ignore.is_empty()) {
            let m = "`accept` and `ignore` need the event's type: set `type`";
            return Err(invalid(&key("type"), m.into()));
        }
        if self.tolerance.0 < std::time::Duration::from_secs(1) {
            return Err(invalid(&key("tolerance"), "must be at least 1s".into()));
        }
        crate::domain::check_priority(self.priority).map_err(|m| invalid(&key("priority"), m))?;
        let hmac_only = [
            ("header", self.header.is_some()),
            ("encoding", self.encoding.is_some()),
            ("prefix", self.prefix.is_some()),
        ];
        match self.preset {
            Preset::Hmac => {
                let header = self.header.as_deref().unwrap_or("");
                if header.is_empty() || Source::parse(&format!("header:{header}")).is_err() {
                    let m = "an `hmac` trigger names its signature `header` (`X-Signature`)";
                    return Err(invalid(&key("header"), m.into()));
                }
                if let Some(e) = self
                    .encoding
                    .as_deref()
                    .filter(|e| !matches!(*e, "hex" | "base64"))
                {
                    return Err(invalid(&key("encoding"), format!("`{e}`: hex or base64")));
                }
            }
            _ => {
                if let Some((field, _)) = hmac_only.iter().find(|(_, set)| *set) {
                    let m = format!("only an `hmac` trigger takes `{field}`");
                    return Err(invalid(&key(field), m));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    fn check(extra: &str) -> String {
        let mut text = format!(
            "[pipelines.p]\n[[pipelines.p.steps]]\nname = \"w\"\nkind = \"sleep\"\nfor = \"1h\"\n\
             [triggers.t]\n{extra}\n"
        );
        if !extra.contains("pipeline =") {
            text.push_str("pipeline = \"p\"\n");
        }
        if !extra.contains("secrets_env =") {
            text.push_str("secrets_env = [\"T_SECRET\"]\n");
        }
        let config = crate::config::Config::parse(&text, std::path::Path::new("t.toml"));
        let env = |v: &str| match v {
            "T_SECRET" => Some("a-trigger-secret-0123".to_owned()),
            "T_SHORT" => Some("short".to_owned()),
            _ => None,
        };
        match config {
            Err(e) => e.to_string(),
            Ok(c) => c.triggers["t"]
                .validate("t", &c.pipelines, &env)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default(),
        }
    }

    #[test]
    fn a_trigger_is_checked_before_it_serves() {
        assert_eq!(check("preset = \"stripe\""), "");
        assert_eq!(check("preset = \"github\"\naccept = [\"push\"]"), "");
        let cases = [
            ("preset = \"paypal\"", "paypal"),
            (
                "preset = \"stripe\"\npipeline = \"nowhere\"",
                "unknown pipeline `nowhere`",
            ),
            ("preset = \"hmac\"", "triggers.t.id"),
            ("preset = \"hmac\"\nid = \"/id\"", "triggers.t.header"),
            (
                "preset = \"hmac\"\nid = \"/id\"\nheader = \"X-Sig\"\naccept = [\"a\"]",
                "triggers.t.type",
            ),
            (
                "preset = \"hmac\"\nid = \"/id\"\nheader = \"X-Sig\"\nencoding = \"b32\"",
                "hex or base64",
            ),
            (
                "preset = \"stripe\"\nheader = \"X-Sig\"",
                "only an `hmac` trigger",
            ),
            ("preset = \"stripe\"\nid = \"id\"", "neither a JSON pointer"),
            (
                "preset = \"stripe\"\ninput = \"data\"",
                "not a JSON pointer",
            ),
            ("preset = \"stripe\"\npriority = 10", "out of range"),
            ("preset = \"stripe\"\ntolerance = \"0s\"", "at least 1s"),
            (
                "preset = \"hmac\"\nid = \"/id\"\nheader = \"X Sig\"",
                "triggers.t.header",
            ),
            (
                "preset = \"stripe\"\nsecrets_env = [\"T_SHORT\"]",
                "at least 16",
            ),
        ];
        for (extra, says) in cases {
            let e = check(extra);
            assert!(e.contains(says), "{extra}: {e}");
        }
        let e = check("preset = \"stripe\"\nsecrets_env = []");
        assert!(e.contains("set `secrets_env` or `secrets_file`"), "{e}");
    }
}
