//! Reloading a running node's configuration (SIGHUP, `POST /api/v1/reload`,
//! `ballast reload`): the file is read and checked exactly as
//! `check-config` checks it; a bad one is refused and the running
//! configuration kept. Providers and pipelines change in place
//! (`Engine::reconfigure`); the other sections (server, database, engine,
//! traces) are read at start only, and a reload says which of them changed.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{Config, Live};
use crate::domain::Clock;
use crate::engine::{Engine, fingerprint};
use crate::store::{Db, NewEvent};

/// Where a node's configuration came from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `Config::load` of this file (none: defaults and the environment),
    /// and the `--bind` it was started with.
    File {
        file: Option<PathBuf>,
        bind: Option<std::net::SocketAddr>,
    },
    /// Made by the program (the demo, tests): nothing to read again.
    Built(&'static str),
}

/// What a reload did.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct Reloaded {
    /// The version now running (`Config::version`).
    pub version: String,
    /// What changed, in words; empty when the file said what runs already.
    pub changes: Vec<String>,
    /// Sections that changed in the file but take effect at a restart.
    pub at_restart: Vec<String>,
}

/// Why a reload was refused; the running configuration is kept.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Reloads one node's configuration, one reload at a time.
pub struct Reloader {
    source: Source,
    live: Live,
    engine: Option<Engine>,
    db: Db,
    node_id: Arc<str>,
    clock: Arc<dyn Clock>,
    one: tokio::sync::Mutex<()>,
}

impl Reloader {
    pub fn new(
        source: Source,
        live: Live,
        engine: Option<Engine>,
        db: Db,
        node_id: Arc<str>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Reloader {
            source,
            live,
            engine,
            db,
            node_id,
            clock,
            one: tokio::sync::Mutex::new(()),
        }
    }

    /// Reads the configuration again and applies it, or refuses it (the
    /// reason logged at `error`, the running configuration kept); either
    /// way audited as `config_reload` by `actor`.
    pub async fn reload(&self, actor: &str) -> Result<Reloaded, Refused> {
        let _one = self.one.lock().await;
        let result = self.apply().await;
        let detail = match &result {
            Ok(r) => serde_json::json!({
                "node": &*self.node_id,
                "version": r.version,
                "changes": r.changes,
                "at_restart": r.at_restart,
            }),
            Err(e) => serde_json::json!({ "node": &*self.node_id, "refused": e.0 }),
        };
        let audit = NewEvent {
            record_id: None,
            at: self.clock.now_ms(),
            kind: "config_reload".into(),
            actor: actor.to_owned(),
            audit: true,
            step: None,
            reason: None,
            detail: Some(detail),
        };
        if let Err(e) = self.db.append_event(&audit).await {
            tracing::warn!(error = %e, "could not audit the reload");
        }
        match &result {
            Ok(r) => tracing::info!(
                config.version = %r.version,
                changes = %r.changes.join("; "),
                at_restart = %r.at_restart.join(", "),
                "configuration reloaded"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "configuration reload refused; the running configuration is kept"
            ),
        }
        result
    }

    async fn apply(&self) -> Result<Reloaded, Refused> {
        let (file, bind) = match &self.source {
            Source::File { file, bind } => (file.clone(), *bind),
            Source::Built(what) => {
                return Err(Refused(format!(
                    "this node's configuration is {what}, not read from a file: nothing to reload"
                )));
            }
        };
        // As `check-config` reads and checks it.
        let running = self.live.get();
        let loaded =
            tokio::task::spawn_blocking(move || Config::load_for_reload(file.as_deref(), &running))
                .await
                .map_err(|e| Refused(format!("cannot read the configuration: {e}")))?
                .map_err(|e| Refused(e.to_string()))?;
        let mut new = loaded.config;
        if let Some(bind) = bind {
            new.server.bind = bind;
        }
        crate::pipeline::compile(&new).map_err(|e| Refused(e.to_string()))?;
        let old = self.live.get();
        // The data keys are read again and applied (a new current key, a
        // rotated file), once the database shows they read what it holds.
        let encryption = new.database.encryption.clone();
        let ring = encryption.keyring.clone();
        let listed = self
            .db
            .data_keys()
            .await
            .map_err(|e| Refused(e.to_string()))?;
        crate::store::check_keys(&ring, &listed).map_err(Refused)?;
        // Listed before anything is applied (harmless if the rest is
        // refused) and before any value is sealed with it.
        crate::store::note_current(&self.db, &ring, self.clock.now_ms())
            .await
            .map_err(|e| Refused(e.to_string()))?;
        let at_restart = keep_start_only(&old, &mut new);
        new.database.encryption = encryption;
        let changes = match &self.engine {
            Some(engine) => {
                let done = engine
                    .reconfigure(new)
                    .await
                    .map_err(|e| Refused(e.to_string()))?;
                self.live
                    .set(engine.config(), engine.versions().config_version());
                done.changes
            }
            None if !new.pipelines.is_empty() => {
                return Err(Refused(
                    "pipelines were added to a node started without any: restart it to start the workers"
                        .into(),
                ));
            }
            None => {
                let changes = provider_changes(&old, &new);
                let version = new.version();
                self.live.set(Arc::new(new), version);
                changes
            }
        };
        self.db.set_keyring(ring);
        let filters = self.live.get().notify.iter().map(|n| n.filter()).collect();
        self.db.set_notify_filters(filters);
        Ok(Reloaded {
            version: self.live.version(),
            changes,
            at_restart,
        })
    }
}

/// Puts back in `new` the sections read only at start (what runs), and
/// names those the file changed.
fn keep_start_only(old: &Config, new: &mut Config) -> Vec<String> {
    // (The server's secrets were not read again: `load_for_reload` kept
    // the running ones.)
    let mut changed = Vec::new();
    if fingerprint(&old.server) != fingerprint(&new.server) {
        changed.push("server".to_owned());
    }
    let without_keys = |c: &Config| {
        let mut d = c.database.clone();
        d.encryption = Default::default();
        fingerprint(&d)
    };
    if without_keys(old) != without_keys(new) {
        changed.push("database".to_owned());
    }
    if fingerprint(&old.engine) != fingerprint(&new.engine) {
        changed.push("engine".to_owned());
    }
    if fingerprint(&old.traces) != fingerprint(&new.traces) {
        changed.push("traces".to_owned());
    }
    new.server = old.server.clone();
    new.database = old.database.clone();
    new.engine = old.engine.clone();
    new.traces = old.traces.clone();
    changed
}

/// Providers added, changed or removed (a node without workers only shows
/// them).
fn provider_changes(old: &Config, new: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for (name, p) in &new.providers {
        match old.providers.get(name) {
            None => out.push(format!("provider {name}: added")),
            Some(o) if fingerprint(o) != fingerprint(p) => {
                out.push(format!("provider {name}: new settings"));
            }
            Some(_) => {}
        }
    }
    for name in old.providers.keys() {
        if !new.providers.contains_key(name) {
            out.push(format!("provider {name}: removed"));
        }
    }
    out
}
