//! The leases this node holds on claimed records, and the keeper: a
//! background loop that extends every held lease well before it expires
//! and drops any that was lost (that pass's result will be dropped).

use tokio_util::sync::CancellationToken;

use super::supervisor::{Loop, Stop};
use super::{Engine, Inner, lock};
use crate::store::Lease;

/// The lease keeper of one node.
pub(super) struct LeaseKeeper {
    engine: Engine,
}

impl LeaseKeeper {
    pub(super) fn of(engine: &Engine) -> LeaseKeeper {
        LeaseKeeper {
            engine: engine.clone(),
        }
    }
}

impl Loop for LeaseKeeper {
    /// It keeps the leases alive until the node has given its records back.
    const STOP: Stop = Stop::Last;

    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        let every = i.opts.lease / 3;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            let leases: Vec<Lease> = lock(&i.held).values().cloned().collect();
            if leases.is_empty() {
                continue;
            }
            let until = i.clock.now_ms() + i.opts.lease.as_millis() as i64;
            match i.db.extend_leases(&leases, until).await {
                Ok(kept) => {
                    for l in leases.iter().filter(|l| !kept.contains(&l.record_id)) {
                        tracing::warn!(
                            record.id = l.record_id,
                            "lease lost; the pass's result will be dropped"
                        );
                        forget_lease(i, l);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "lease extension failed"),
            }
        }
    }
}

/// Stops keeping `lease` alive, unless the record was claimed again since
/// (then the newer lease stays).
pub(super) fn forget_lease(i: &Inner, lease: &Lease) {
    let mut held = lock(&i.held);
    if held
        .get(&lease.record_id)
        .is_some_and(|l| l.token == lease.token)
    {
        held.remove(&lease.record_id);
    }
}
