//! Confirmations after success (`confirm` on a job step): a background
//! task on every node takes due confirmations (each held, so one node
//! asks), polls the job through the provider's gates, keeps the exchange
//! as an attempt, and carries out what `domain::confirm` decides: ask
//! again, done, or a reversal under the step's `on_reversal` policy.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::pass::step_call;
use super::step::{self, Asked};
use super::supervisor::Loop;
use super::{Compiled, Engine, Inner};
use crate::domain::confirm::{Next, Pending, next, said};
use crate::domain::{Outcome, Record, StepState, UnixMs};
use crate::pipeline::{Step, Templates};
use crate::store::{NewAttempt, StepWrite, StoreError};

/// How often a node looks for due confirmations, when a configured step
/// confirms.
const EVERY_MS: i64 = 250;
/// How often when none does: records pinned to an older definition that
/// confirmed may still have some due.
const IDLE_EVERY_MS: i64 = 5_000;
/// How many it takes at once.
const BATCH: u32 = 16;

/// The confirmations loop: on every node, takes the confirmations due
/// and asks each.
#[derive(Clone)]
pub struct Confirmations {
    engine: Engine,
}

impl Loop for Confirmations {
    /// A confirmation poll cut short keeps its hold; another node (or this
    /// one, restarted) asks when the hold ends.
    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        loop {
            // Read each time: a reload may add or remove a confirmation.
            let confirms = i
                .setup()
                .pipelines
                .pipelines
                .values()
                .any(|p| p.steps.iter().any(|s| s.confirm.is_some()));
            let every = if confirms { EVERY_MS } else { IDLE_EVERY_MS };
            let now = i.clock.now_ms();
            if let Err(e) = self.confirm_due(now).await {
                tracing::warn!(error = %e, "confirmations failed; retrying shortly");
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = i.clock.sleep_until(now + every) => {}
            }
        }
    }
}

impl Confirmations {
    /// The confirmations of `engine`.
    pub fn of(engine: &Engine) -> Confirmations {
        Confirmations {
            engine: engine.clone(),
        }
    }

    /// Takes and makes the confirmations due at `now`; how many. (A poll
    /// under way when the node stops is let finish: it is one call.)
    pub async fn confirm_due(&self, now: UnixMs) -> Result<usize, StoreError> {
        let i = &self.engine.inner;
        let stopping = &super::Stopping::default();
        // Held for as long as a poll may take (its gates and its timeout),
        // then another node may ask.
        let hold = now + 2 * i.opts.lease.as_millis() as i64;
        let due = i.db.claim_confirmations(now, BATCH, hold).await?;
        let n = due.len();
        let asks = due.into_iter().map(|p| async move {
            let (record_id, step) = (p.record_id, p.step.clone());
            if let Err(e) = self.confirm_one(p, stopping).await {
                tracing::warn!(record.id = record_id, step = %step, error = %e, "confirmation failed");
            }
        });
        futures_util::future::join_all(asks).await;
        Ok(n)
    }

    async fn confirm_one(&self, p: Pending, stopping: &super::Stopping) -> Result<(), StoreError> {
        let i = &self.engine.inner;
        let Some((rec, states, compiled)) = self.target(&p).await? else {
            return Ok(());
        };
        let Some(step_def) = compiled.0.step(&p.step) else {
            return settle(i, &p, None).await;
        };
        let Some(spec) = step_def.confirm else {
            return settle(i, &p, None).await;
        };
        let asked = self.poll(&p, &rec, &states, (step_def, &compiled.1), stopping);
        let Some((outcome, attempt)) = asked.await? else {
            return Ok(());
        };
        let evidence = attempt.excerpt.clone().unwrap_or_default();
        let status = attempt.http_status;
        i.db.append_attempts(rec.id, std::slice::from_ref(&attempt), &[])
            .await?;
        let after = i.clock.now_ms();
        let said_now = json!({ "http_status": status, "reply": evidence });
        match next(&p, said(outcome, status), spec, after) {
            Next::Again(q) => settle(i, &p, Some(&q)).await,
            Next::Done => settle(i, &p, None).await,
            Next::GaveUp => {
                i.db.append_event(&crate::store::NewEvent {
                    record_id: Some(rec.id),
                    at: after,
                    kind: "unconfirmed".into(),
                    actor: crate::domain::SYSTEM_ACTOR.into(),
                    audit: false,
                    step: Some(p.step.clone()),
                    reason: Some("the provider gave no clear answer to a confirmation poll".into()),
                    detail: Some(said_now),
                })
                .await?;
                settle(i, &p, None).await
            }
            Next::Reverse => {
                let req = crate::store::ReverseRequest {
                    record_id: rec.id,
                    step: p.step.clone(),
                    policy: step_def.on_reversal,
                    reason: format!(
                        "provider reversed step `{}`: a confirmation poll no longer says success ({})",
                        p.step,
                        outcome.as_str()
                    ),
                    detail: Some(json!({
                        "job_id": states.get(&p.step).and_then(|s| s.job_id.clone()),
                        "confirmation": said_now,
                    })),
                    now: after,
                    steps: compiled.0.from_step(&p.step).unwrap_or_default(),
                    generation: Some(p.generation),
                };
                self.reverse(&p, &req).await
            }
        }
    }

    /// Polls the job of the confirmation `p` through the provider's gates:
    /// what is left to decide, as [`ask`](Self::ask) says (nothing when it
    /// is settled here, or when the provider is not configured here).
    async fn poll(
        &self,
        p: &Pending,
        rec: &Record,
        states: &HashMap<String, StepWrite>,
        (step_def, templates): (&Step, &Arc<Templates>),
        stopping: &super::Stopping,
    ) -> Result<Option<(Outcome, Box<NewAttempt>)>, StoreError> {
        let i = &self.engine.inner;
        let mut ctx = step::context(rec, states);
        // A confirmation's own request also sees the step's output.
        if let (Some(obj), Some(w)) = (ctx.as_object_mut(), states.get(&p.step)) {
            obj.insert("output".into(), w.output.clone().unwrap_or(json!({})));
        }
        let write = states
            .get(&p.step)
            .cloned()
            .unwrap_or_else(|| StepWrite::pending(&p.step));
        let mut pending = step_call(
            i,
            rec,
            step_def,
            write,
            &std::sync::Arc::new(crate::pipeline::PassContext::new(ctx)),
            templates,
            Vec::new(),
            stopping,
        );
        let Some(rt) = pending.rt.clone() else {
            settle(i, p, None).await?;
            return Ok(None);
        };
        let now = i.clock.now_ms();
        pending.call.now = now;
        self.ask(pending.call.confirm(&rt).await, p, now).await
    }

    /// The record, its steps and its pipeline version, when the
    /// confirmation `p` still stands and its version runs here. Otherwise
    /// `None`: settled when moot (the record gone, the step replayed or
    /// rerun since) or when no node can run its version; left to be asked
    /// again once its hold lapses when the version may yet run.
    async fn target(
        &self,
        p: &Pending,
    ) -> Result<Option<(Record, HashMap<String, StepWrite>, Compiled)>, StoreError> {
        let i = &self.engine.inner;
        let Some(rec) = i.db.get_record(p.record_id).await? else {
            settle(i, p, None).await?;
            return Ok(None);
        };
        let runs = i.db.step_runs(rec.id).await?;
        // A replay or rerun since (a new generation) makes it moot.
        let current = runs.iter().any(|r| {
            r.step == p.step && r.generation == p.generation && r.state == StepState::Succeeded
        });
        if !current {
            settle(i, p, None).await?;
            return Ok(None);
        }
        let compiled = match i.versions().compiled_for(&rec).await {
            Ok(c) => c,
            // Its version does not run here now (a reload under way, a
            // read that failed): asked again once its hold lapses, here or
            // on another node. One no node can run is given up.
            Err(not) if i.versions().waits_for(&not).await => {
                tracing::warn!(record.id = rec.id, step = %p.step, "its pipeline version does not run here now; the confirmation waits");
                return Ok(None);
            }
            Err(_) => {
                settle(i, p, None).await?;
                return Ok(None);
            }
        };
        let states = runs
            .iter()
            .map(|r| (r.step.clone(), StepWrite::from(r)))
            .collect();
        Ok(Some((rec, states, compiled)))
    }

    /// Reverses the confirmed step as `req` says, and settles the
    /// confirmation; a record leased by a pass this moment is asked again
    /// in a while (a poll each time: the answer may have changed back).
    async fn reverse(
        &self,
        p: &Pending,
        req: &crate::store::ReverseRequest,
    ) -> Result<(), StoreError> {
        let i = &self.engine.inner;
        match i.db.reverse(req).await {
            Ok(_) => {
                self.engine.wake();
                settle(i, p, None).await
            }
            Err(StoreError::Transition(_)) => {
                let again = Pending {
                    due_at: req.now + 5_000,
                    ..p.clone()
                };
                settle(i, p, Some(&again)).await
            }
            Err(e) => Err(e),
        }
    }

    /// What a confirmation poll's answer leaves to decide: the outcome and
    /// the attempt, or nothing when it is settled here. What the reply
    /// told every call is published first; a throttled answer is kept and
    /// asked again when the pause ends (no try spent), as is a poll a gate
    /// held back; one that cannot be built is given up.
    async fn ask(
        &self,
        asked: Asked,
        p: &Pending,
        now: UnixMs,
    ) -> Result<Option<(Outcome, Box<NewAttempt>)>, StoreError> {
        let db = &self.engine.inner.db;
        let again = |at: UnixMs| Pending {
            due_at: at.max(now + 1),
            ..p.clone()
        };
        let later = match asked {
            Asked::Said {
                outcome,
                attempt,
                heard,
            } => {
                let paused = heard.throttled.as_ref().map(|t| t.1);
                super::sync::publish_heard(&self.engine.inner, heard).await;
                let Some(until) = paused else {
                    return Ok(Some((outcome, attempt)));
                };
                db.append_attempts(p.record_id, std::slice::from_ref(&attempt), &[])
                    .await?;
                Some(until)
            }
            Asked::Later(at) => Some(at),
            Asked::Broken(e) => {
                tracing::warn!(record.id = p.record_id, step = %p.step, error = %e, "confirmation poll cannot be built; given up");
                None
            }
        };
        let next = later.map(again);
        db.settle_confirmation(p.record_id, &p.step, p.generation, next.as_ref())
            .await?;
        Ok(None)
    }
}

/// Settles the confirmation `p`: asked again as `next` says, or done.
async fn settle(i: &Inner, p: &Pending, next: Option<&Pending>) -> Result<(), StoreError> {
    i.db.settle_confirmation(p.record_id, &p.step, p.generation, next)
        .await
}
