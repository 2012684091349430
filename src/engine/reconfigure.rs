//! A new configuration on a running engine (a reload): providers retuned
//! in place (their state goes on, calls in flight finish on the settings
//! they started with), changed pipelines pinned as new versions (records
//! already under way keep the version they started with), the claims'
//! group caps and the cron schedules replaced.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use super::limits::{Prepared, ProviderRuntime};
use super::{Engine, EngineError, Setup, lock};
use crate::config::Config;

/// What a reconfiguration changed on this node, in words (one line each).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reconfigured {
    pub changes: Vec<String>,
}

/// A provider's settings as one comparable text: the configuration's
/// `Debug` is derived (every field) and holds no secret (credentials are
/// named by their variables and files, read apart and compared apart;
/// `Secret` prints redacted).
pub fn fingerprint<T: std::fmt::Debug>(settings: &T) -> String {
    format!("{settings:?}")
}

/// A provider's runtime after the reload: the same one, one retuned to new
/// settings (built, not yet applied), or a new one.
enum Next {
    Same(Arc<ProviderRuntime>),
    Retuned(Arc<ProviderRuntime>, Prepared),
    New(ProviderRuntime),
}

impl Engine {
    /// Applies `config`'s providers and pipelines (its other sections are
    /// the caller's to keep). Everything that can fail is done first (each
    /// provider's settings built, the pipelines compiled and pinned); only
    /// then are providers retuned and the setup swapped, so on an error
    /// the running setup is untouched. A provider no longer in `config` is
    /// kept as it was until a restart (records pinned to an older version
    /// may still call it) and said so. The version said in heartbeats is
    /// `config`'s own (as a node started on the same file says).
    pub async fn reconfigure(&self, config: Config) -> Result<Reconfigured, EngineError> {
        let i = &self.inner;
        let _one = i.reconfiguring.lock().await;
        let old = i.setup();
        let now = i.clock.now_ms();
        let version = config.version();
        let mut config = config;
        let mut changes = Vec::new();
        let mut kept = std::collections::HashSet::new();
        for (name, p) in &old.config.providers {
            if !config.providers.contains_key(name) {
                changes.push(format!(
                    "provider {name}: no longer in the file; kept until a restart"
                ));
                config.providers.insert(name.clone(), p.clone());
                kept.insert(name.clone());
            }
        }
        let mut next = Vec::with_capacity(config.providers.len());
        for (name, p) in &config.providers {
            let n = match old.providers.get(name) {
                // Kept as it runs: its secrets not read again (their files
                // may have gone with it).
                Some(rt) if kept.contains(name) => Next::Same(rt.clone()),
                Some(rt) => {
                    // Its secrets read again, once: a rotated one is
                    // applied (calls in flight keep the old).
                    let secrets =
                        ProviderRuntime::read_secrets(name, p).map_err(EngineError::Config)?;
                    let what = match fingerprint(&rt.config) == fingerprint(p) {
                        false => Some("new settings"),
                        true if secrets.same(&rt.secrets) => None,
                        true => Some("new secrets"),
                    };
                    match what {
                        None => Next::Same(rt.clone()),
                        Some(what) => {
                            changes.push(format!("provider {name}: {what}"));
                            let prepared = rt.prepare(p, secrets).map_err(EngineError::Config)?;
                            Next::Retuned(rt.clone(), prepared)
                        }
                    }
                }
                None => {
                    changes.push(format!("provider {name}: added"));
                    let mut rt = ProviderRuntime::new(name, p, now).map_err(EngineError::Config)?;
                    rt.in_process = i.opts.in_process.clone();
                    Next::New(rt)
                }
            };
            next.push((name.clone(), n));
        }
        let (mut setup, current, pinned) =
            Setup::pin(&i.db, Arc::new(config), HashMap::new(), now).await?;
        setup.version = version;
        {
            let before = lock(&i.current);
            for (name, id) in &current {
                match before.get(name) {
                    Some(was) if was == id => {}
                    Some(was) => changes.push(format!(
                        "pipeline {name}: version {was} → {id} (records under way finish on {was})"
                    )),
                    None => changes.push(format!("pipeline {name}: added (version {id})")),
                }
            }
            for name in before.keys().filter(|n| !current.contains_key(*n)) {
                changes.push(format!(
                    "pipeline {name}: removed (no new records; those under way finish)"
                ));
            }
        }
        // Nothing can fail from here on.
        for (name, n) in next {
            let rt = match n {
                Next::Same(rt) => rt,
                Next::Retuned(rt, prepared) => Arc::new(rt.retuned(prepared, now)),
                Next::New(rt) => Arc::new(rt),
            };
            setup.providers.insert(name, rt);
        }
        // The versions first, then what names them current (a replay on
        // the current version reads the one, then the other).
        lock(&i.pinned).extend(pinned);
        *i.setup.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(setup);
        *lock(&i.current) = current;
        // The loops look again now: claims (group caps), the provider sync
        // (a new provider's shared state and live nodes; the heartbeat
        // says the new version), and the cron schedules.
        i.wake.notify_one();
        i.providers_changed.notify_one();
        i.schedules_changed.notify_one();
        Ok(Reconfigured { changes })
    }

    /// The configuration this engine runs now.
    pub fn config(&self) -> Arc<Config> {
        self.inner.config()
    }
}
