//! On PostgreSQL, a background task listens for the cluster's
//! notifications: new work wakes the dispatch loop, a provider's changed
//! shared state runs the provider sync at once. (SQLite has none: another
//! process on the same file cannot notify this one.)

use tokio_util::sync::CancellationToken;

use super::Engine;
use super::supervisor::Loop;
use crate::store::{Db, PgStore, Wakeup};

/// The listener of a node on PostgreSQL.
pub(super) struct Listener {
    engine: Engine,
    pg: PgStore,
}

impl Listener {
    /// `engine`'s listener, if its database notifies.
    pub(super) fn of(engine: &Engine) -> Option<Listener> {
        match &engine.inner.db {
            Db::Postgres(pg) => Some(Listener {
                engine: engine.clone(),
                pg: pg.clone(),
            }),
            Db::Sqlite(_) => None,
        }
    }
}

impl Loop for Listener {
    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        let on = |n| match n {
            Wakeup::Work => i.wake.notify_one(),
            // Another node changed a provider's shared state.
            Wakeup::Providers => i.providers_changed.notify_one(),
        };
        self.pg.listen(on, shutdown).await
    }
}
