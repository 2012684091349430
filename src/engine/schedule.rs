//! Cron schedules: a background task on every node fires each configured
//! schedule's ticks (`domain::schedule::plan` decides which, from the
//! watermark the cluster shares). A fired record is keyed by its tick, so
//! two nodes firing one tick make one record; the watermark moves only
//! from the value a node read, so the cluster deals with each tick once.

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::supervisor::{Loop, Stop};
use super::{Engine, EngineError, Enqueue};
use crate::config::Config;
use crate::domain::UnixMs;
use crate::domain::schedule::{Cron, Missed, plan, tick_key};
use crate::store::{ScheduleAdvance, StoreError};

/// The longest a node sleeps between passes: a clock set forward, or a
/// watermark another node moved, is seen within it.
const MAX_SLEEP_MS: i64 = 30_000;

/// One pipeline's schedule, read from the configuration at start.
#[derive(Debug, Clone)]
pub(super) struct Scheduled {
    pipeline: String,
    cron: Cron,
    input: Value,
    missed: Missed,
    priority: Option<u8>,
}

/// The configuration's schedules (already checked by `pipeline::compile`).
pub(super) fn scheduled(config: &Config) -> Result<Vec<Scheduled>, EngineError> {
    let mut out = Vec::new();
    for (name, p) in &config.pipelines {
        if let Some(s) = &p.schedule {
            out.push(Scheduled {
                pipeline: name.clone(),
                cron: Cron::parse(&s.cron)
                    .map_err(|e| EngineError::Config(format!("pipelines.{name}.schedule: {e}")))?,
                input: s.input.clone(),
                missed: s.missed,
                priority: s.priority,
            });
        }
    }
    Ok(out)
}

/// What one pass over the schedules did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fired {
    /// Records this pass created (a tick another node had fired already
    /// names its record and is not counted).
    pub created: usize,
    /// The next tick of any schedule after the pass.
    pub next: Option<UnixMs>,
}

/// The schedule loop: on every node, fires the schedules' ticks as they
/// come.
pub struct Scheduler {
    engine: Engine,
}

impl Loop for Scheduler {
    /// It stops by itself between passes: a pass under way finishes (its
    /// records and its watermark go together).
    const STOP: Stop = Stop::Finish("the scheduler's pass");

    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        loop {
            let now = i.clock.now_ms();
            let next = match self.fire_schedules(now).await {
                Ok(f) => f.next.unwrap_or(now + MAX_SLEEP_MS),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot fire schedules; retrying shortly");
                    now + 1_000
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = i.clock.sleep_until(next.clamp(now + 1, now + MAX_SLEEP_MS)) => {}
                () = i.schedules_changed.notified() => {}
            }
        }
    }
}

impl Scheduler {
    /// The schedule loop of `engine`.
    pub fn of(engine: &Engine) -> Scheduler {
        Scheduler {
            engine: engine.clone(),
        }
    }

    /// Fires every schedule's ticks due at `now` and moves its watermark.
    pub async fn fire_schedules(&self, now: UnixMs) -> Result<Fired, StoreError> {
        let i = &self.engine.inner;
        let mut fired = Fired::default();
        let setup = i.setup();
        if setup.schedules.is_empty() {
            return Ok(fired);
        }
        let rows = i.db.schedules().await?;
        for s in &setup.schedules {
            let row = rows.iter().find(|r| r.pipeline == s.pipeline);
            // A changed expression is a new schedule: it begins now rather
            // than firing the new expression's past.
            let same = row.filter(|r| r.cron == s.cron.as_str());
            let p = plan(&s.cron, same.map(|r| r.watermark), now, s.missed);
            if let Some(t) = p.skipped {
                tracing::info!(
                    pipeline = %s.pipeline,
                    tick = %crate::domain::time::format_ms(t),
                    "missed ticks skipped (missed = \"skip\")"
                );
            }
            let last = p.fire.last().copied();
            let mut last_record = None;
            for &t in &p.fire {
                // Due at its tick: a node whose clock runs ahead fires
                // early, but the record waits for its time.
                let item = Enqueue::new(&s.pipeline, Some(&tick_key(t)), s.input.clone())
                    .with_priority(s.priority)
                    .at(t);
                let c = self.engine.enqueue(item).await?;
                if c.created {
                    fired.created += 1;
                    metrics::counter!("ballast_schedule_fired_total", "pipeline" => s.pipeline.clone())
                        .increment(1);
                    tracing::info!(
                        pipeline = %s.pipeline,
                        record.id = c.record.id,
                        tick = %crate::domain::time::format_ms(t),
                        "schedule fired"
                    );
                }
                last_record = Some(c.record.id);
            }
            // A pass that fired and skipped nothing leaves a current row
            // alone: with no tick between the stored watermark and now,
            // the next pass plans the same from either, and the database
            // (SQLite's one writer) is spared a write per pass and node.
            let idle = same.is_some() && p.fire.is_empty() && p.skipped.is_none();
            if !idle {
                let moved =
                    i.db.advance_schedule(&ScheduleAdvance {
                        pipeline: s.pipeline.clone(),
                        cron: s.cron.as_str().to_owned(),
                        from: row.map(|r| r.watermark),
                        to: p.watermark,
                        fired: last.zip(last_record),
                        now,
                    })
                    .await?;
                if !moved {
                    tracing::debug!(pipeline = %s.pipeline, "another node moved the schedule first");
                }
            }
            let next = s.cron.next_after(p.watermark.max(now));
            fired.next = match (fired.next, next) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(fired)
    }
}
