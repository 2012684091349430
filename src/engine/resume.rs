//! Parked records that resume by themselves: a background task on every
//! node finds the parked records whose condition holds (a time come, or a
//! provider taking calls again, as `domain::park` judges it from the
//! cluster's view of the provider) and resumes them through the store,
//! each audited as a `resume` by `system` naming the condition. Two nodes
//! asking at once resume each record once (the store checks it again
//! under its lock).

use tokio_util::sync::CancellationToken;

use super::Engine;
use super::supervisor::Loop;
use crate::domain::UnixMs;
use crate::domain::park::{Ready, provider_ready};
use crate::store::{ResumeDue, StoreError};

/// How often a node looks for records to resume.
const EVERY_MS: i64 = 1_000;
/// How many it resumes at once (parked until a time; and per provider).
const BATCH: u32 = 200;

/// The resume loop: on every node, resumes the parked records whose
/// condition holds.
pub struct Resumer {
    engine: Engine,
}

impl Loop for Resumer {
    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        loop {
            let now = i.clock.now_ms();
            let again = match self.resume_due(now).await {
                Ok(n) => n >= BATCH as usize,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot resume parked records; retrying shortly");
                    false
                }
            };
            if again {
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = i.clock.sleep_until(now + EVERY_MS) => {}
            }
        }
    }
}

impl Resumer {
    /// The resume loop of `engine`.
    pub fn of(engine: &Engine) -> Resumer {
        Resumer {
            engine: engine.clone(),
        }
    }

    /// Resumes the parked records whose condition holds at `now`: those
    /// parked until a time now past, and those waiting for a configured
    /// provider that takes calls again: all of them once its breaker is
    /// closed; while it is due to close, only enough that the provider's
    /// records at work in the cluster (pending, running, retrying,
    /// waiting) are no more than its breaker's probes. Returns how many.
    pub async fn resume_due(&self, now: UnixMs) -> Result<usize, StoreError> {
        let i = &self.engine.inner;
        let states = i.db.provider_states().await?;
        let mut providers = Vec::new();
        let mut at_work = None;
        for (name, rt) in &i.setup().providers {
            let probes = rt.breaker().policy().probes;
            let state = states.iter().find(|s| &s.provider == name);
            match provider_ready(state, probes, now) {
                Ready::All => providers.push((name.clone(), BATCH)),
                Ready::Few(n) => {
                    if at_work.is_none() {
                        at_work = Some(i.db.provider_counts().await?);
                    }
                    let busy: i64 = at_work
                        .iter()
                        .flatten()
                        .filter(|c| &c.pipeline == name && c.state.is_scheduled())
                        .map(|c| c.count)
                        .sum();
                    let room = i64::from(n.min(BATCH)) - busy;
                    if room > 0 {
                        providers.push((name.clone(), room as u32));
                    }
                }
                Ready::No => {}
            }
        }
        let req = ResumeDue {
            now,
            limit: BATCH,
            providers,
        };
        let resumed = i.db.resume_parked(&req).await?;
        for r in &resumed {
            tracing::info!(
                record.id = r.id,
                "parked record resumed: its condition held"
            );
        }
        if !resumed.is_empty() {
            metrics::counter!("ballast_records_resumed_total").increment(resumed.len() as u64);
            i.wake.notify_one();
        }
        Ok(resumed.len())
    }
}
