//! A new configuration on a running engine (a reload): providers retuned
//! in place (their state goes on, calls in flight finish on the settings
//! they started with), changed pipelines pinned as new versions (records
//! already under way keep the version they started with), the claims'
//! group caps and the cron schedules replaced.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use super::limits::ProviderRuntime;
use super::{Engine, EngineError, Setup, lock};
use crate::config::Config;

/// What a reconfiguration changed on this node, in words (one line each).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reconfigured {
    pub changes: Vec<String>,
}

/// A provider's settings as one comparable text: the configuration's
/// `Debug` is derived (every field) and holds no secret (credentials are
/// named by their environment variables; `Secret` prints redacted).
pub fn fingerprint<T: std::fmt::Debug>(settings: &T) -> String {
    format!("{settings:?}")
}

impl Engine {
    /// Applies `config`'s providers and pipelines (its other sections are
    /// the caller's to keep). Checked whole before anything changes: on an
    /// error the running setup is untouched. A provider no longer in
    /// `config` is kept as it was until a restart (records pinned to an
    /// older version may still call it) and said so.
    pub async fn reconfigure(&self, config: Config) -> Result<Reconfigured, EngineError> {
        let i = &self.inner;
        let _one = i.reconfiguring.lock().await;
        let old = i.setup();
        let now = i.clock.now_ms();
        let mut config = config;
        let mut changes = Vec::new();
        for (name, p) in &old.config.providers {
            if !config.providers.contains_key(name) {
                changes.push(format!(
                    "provider {name}: no longer in the file; kept until a restart"
                ));
                config.providers.insert(name.clone(), p.clone());
            }
        }
        // Checked first: a runtime made from each changed provider's
        // settings (rules, client, credentials), and its cap's scope.
        let mut changed = Vec::new();
        for (name, p) in &config.providers {
            match old.providers.get(name) {
                Some(rt) if fingerprint(&rt.config) == fingerprint(p) => {}
                Some(rt) => {
                    if p.concurrency_scope != rt.config.concurrency_scope {
                        return Err(EngineError::Config(format!(
                            "provider {name}: `concurrency_scope` changes only at a restart"
                        )));
                    }
                    ProviderRuntime::new(name, p, now).map_err(EngineError::Config)?;
                    changed.push(name.clone());
                }
                None => {
                    ProviderRuntime::new(name, p, now).map_err(EngineError::Config)?;
                    changed.push(name.clone());
                }
            }
        }
        // Pinned before any provider is retuned: a database error here
        // leaves the running setup as it was.
        let (mut setup, current, pinned) =
            Setup::pin(&i.db, Arc::new(config), HashMap::new(), now).await?;
        let mut providers: HashMap<String, Arc<ProviderRuntime>> = old.providers.clone();
        for name in &changed {
            let p = &setup.config.providers[name];
            let rt = match old.providers.get(name) {
                Some(rt) => {
                    changes.push(format!("provider {name}: new settings"));
                    rt.reconfigured(p, now)
                }
                None => {
                    changes.push(format!("provider {name}: added"));
                    ProviderRuntime::new(name, p, now).map(|mut rt| {
                        rt.in_process = i.opts.in_process.clone();
                        rt
                    })
                }
            }
            .map_err(EngineError::Config)?;
            providers.insert(name.clone(), Arc::new(rt));
        }
        setup.providers = providers;
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
        *i.setup.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(setup);
        *lock(&i.current) = current;
        lock(&i.pinned).extend(pinned);
        // New group caps or schedules: the loops look again now.
        i.wake.notify_one();
        Ok(Reconfigured { changes })
    }

    /// The configuration this engine runs now.
    pub fn config(&self) -> Arc<Config> {
        self.inner.config()
    }
}
