//! What every handler and background task of the control plane shares.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::domain::Clock;
use crate::store::Db;

/// What every handler and background task shares; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    /// The configuration now (a reload replaces its providers and pipelines).
    pub config: crate::config::Live,
    /// Reads the configuration again (`POST /api/v1/reload`, SIGHUP).
    pub reloader: Arc<crate::reload::Reloader>,
    /// This process's id among the nodes sharing the database.
    pub node_id: Arc<str>,
    /// Cancelled when the process starts shutting down.
    pub shutdown: CancellationToken,
    /// The workers, when the configuration has pipelines.
    pub engine: Option<crate::engine::Engine>,
    /// The control plane's keys and per-user limits.
    pub web: Arc<super::WebContext>,
    /// The one source of `now` for the control plane (the engine's own).
    pub clock: Arc<dyn Clock>,
}

impl AppState {
    /// Operator commands, as every page and API route gives them.
    pub fn ops(&self) -> crate::engine::Ops<'_> {
        crate::engine::Ops::new(
            &self.db,
            &self.config.get(),
            self.engine.as_ref(),
            self.clock.as_ref(),
        )
    }
}
