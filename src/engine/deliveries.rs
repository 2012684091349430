//! Webhook deliveries and reversals: a provider's callback is matched to the
//! step waiting on its job, kept when no step knows the job yet, and judged
//! against a step already settled (the step's reversal policy applies).

use std::time::Duration;

use serde_json::{Value, json};

use super::limits::ProviderRuntime;
use super::{Engine, Inner, Setup, WebhookSettings};
use crate::domain::{Record, StepState, UnixMs};
use crate::store::{CallbackMatch, StepWrite, StoreError};

/// What became of a webhook delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// Attached to the step waiting on the job.
    Accepted { record_id: i64 },
    /// It contradicted a finished step; the step's reversal policy applied.
    Reversed {
        record_id: i64,
        state: crate::domain::RecordState,
    },
    /// No step knows this job yet; kept, and applied once the job id is committed.
    Unmatched { job_id: String },
    /// The body names no job id where the provider's callback steps look.
    NoJobId,
    /// This delivery id was applied before; nothing changed.
    Duplicate,
}

impl Engine {
    /// How `provider`'s webhooks are verified (its secrets as last read).
    pub fn webhook_settings(&self, provider: &str) -> Option<WebhookSettings> {
        let rt = self.inner.provider(provider)?;
        let secrets = rt
            .secrets
            .webhooks
            .iter()
            .map(|s| s.expose().as_bytes().to_vec())
            .collect();
        Some(WebhookSettings {
            signature_header: rt.config.webhook_signature_header.clone(),
            delivery_header: rt.config.webhook_delivery_header.clone(),
            tolerance_s: i64::try_from(rt.config.webhook_tolerance.0.as_secs()).unwrap_or(300),
            secrets,
            credential: rt.secrets.credential().cloned(),
        })
    }

    /// Takes a verified webhook delivery from `provider`: finds the job it
    /// names, stores it, wakes the record, and applies a reversal when it
    /// contradicts a step already succeeded.
    pub async fn deliver(
        &self,
        provider: &str,
        body: Value,
        delivery_ids: &[String],
    ) -> Result<Delivery, StoreError> {
        let i = &self.inner;
        let setup = i.setup();
        let Some(rt) = setup.providers.get(provider) else {
            return Err(StoreError::NotFound {
                what: "provider",
                key: provider.to_owned(),
            });
        };
        let Some(job_id) = job_id_of(i, &setup, provider, &body).await? else {
            return Ok(Delivery::NoJobId);
        };
        let now = i.clock.now_ms();
        let cb = crate::store::NewCallback {
            provider: provider.to_owned(),
            job_id: job_id.clone(),
            body: body.clone(),
            now,
            delivery_ids: delivery_ids.to_vec(),
        };
        let found = match i.db.record_callback(&cb).await {
            Err(StoreError::Conflict { .. }) if !delivery_ids.is_empty() => {
                return Ok(Delivery::Duplicate);
            }
            other => other?,
        };
        let Some(found) = found else {
            return Ok(Delivery::Unmatched { job_id });
        };
        if matches!(
            found.step_state,
            StepState::Succeeded | StepState::Failed | StepState::Skipped
        ) {
            return settled_delivery(i, rt, &found, &job_id, &body, now).await;
        }
        self.wake();
        Ok(Delivery::Accepted {
            record_id: found.record_id,
        })
    }
}

/// Where the job id is in a delivery from `provider`, by the current
/// pipelines' callback steps, then by those of every version this node has
/// run, then by those of every version any node pinned (a record waiting
/// on a step a reload removed or changed still hears of its job).
async fn job_id_of(
    i: &Inner,
    setup: &Setup,
    provider: &str,
    body: &Value,
) -> Result<Option<String>, StoreError> {
    let find = || {
        let older = i.versions().pinned_pipelines();
        setup
            .pipelines
            .pipelines
            .values()
            .chain(older.iter())
            .flat_map(|p| p.steps.iter())
            .find_map(|s| {
                let cb = s.callback().filter(|_| s.provider == provider)?;
                match body.pointer(&cb.delivery_job_id)? {
                    Value::String(j) => Some(j.clone()),
                    Value::Null => None,
                    other => Some(other.to_string()),
                }
            })
    };
    match find() {
        Some(j) => Ok(Some(j)),
        None => {
            i.versions().learn().await?;
            Ok(find())
        }
    }
}

/// A delivery for a step already settled: a duplicate, a stale progress
/// report, or a contradiction (judged under the step's reversal policy).
async fn settled_delivery(
    i: &Inner,
    rt: &ProviderRuntime,
    found: &CallbackMatch,
    job_id: &str,
    body: &Value,
    now: UnixMs,
) -> Result<Delivery, StoreError> {
    let reversed = judge_late_delivery(
        i,
        rt,
        found.record_id,
        &found.step,
        found.step_state,
        job_id,
        body,
        now,
    )
    .await;
    // Judged or not, this row is done: on failure the provider is told to
    // retry (503), and its retry is a new delivery.
    i.db.mark_callbacks(&[found.callback_id], now).await?;
    let reversed = reversed?;
    if let Some(state) = reversed {
        return Ok(Delivery::Reversed {
            record_id: found.record_id,
            state,
        });
    }
    Ok(Delivery::Accepted {
        record_id: found.record_id,
    })
}

/// A delivery for a settled step: when its outcome contradicts the
/// step's result, applies the step's reversal policy. Returns the
/// record's new state when it reversed.
#[allow(clippy::too_many_arguments)]
async fn judge_late_delivery(
    i: &Inner,
    rt: &ProviderRuntime,
    record_id: i64,
    step_name: &str,
    step_state: StepState,
    job_id: &str,
    body: &Value,
    now: UnixMs,
) -> Result<Option<crate::domain::RecordState>, StoreError> {
    let reply = crate::domain::rules::Reply::Http {
        status: 200,
        json: Some(body.clone()),
        body_error: None,
        retry_after: false,
    };
    let verdict = crate::domain::rules::classify(&rt.rules, &reply).outcome;
    let contradicts = match step_state {
        StepState::Succeeded => verdict == crate::domain::Outcome::Fail,
        StepState::Failed => verdict == crate::domain::Outcome::Success,
        _ => false,
    };
    if !contradicts {
        return Ok(None);
    }
    let rec = i.db.get_record(record_id).await?;
    let pipeline = match rec {
        Some(r) => match i.versions().compiled_for(&r).await {
            Ok(c) => Some(c.0),
            // Its version does not run here now (a reload under way):
            // the provider is told to deliver again (503), rather than
            // the reversal being judged without its steps. One no node
            // can run is judged without them (parked).
            Err(not) if i.versions().waits_for(&not).await => {
                return Err(StoreError::NotNow(not.why()));
            }
            Err(_) => None,
        },
        None => None,
    };
    let step = pipeline.as_ref().and_then(|p| p.step(step_name));
    let policy = step.map_or(crate::domain::ReversalPolicy::Park, |s| s.on_reversal);
    let steps = pipeline
        .as_ref()
        .and_then(|p| p.from_step(step_name))
        .unwrap_or_default();
    let req = crate::store::ReverseRequest {
        record_id,
        step: step_name.to_owned(),
        policy,
        reason: format!("provider reversed step `{step_name}` after it was {step_state}"),
        detail: Some(json!({ "job_id": job_id, "callback": body })),
        now,
        steps,
        generation: None,
    };
    let after = i.db.reverse(&req).await?;
    i.wake.notify_one();
    Ok(Some(after.state))
}

/// After a commit, the deliveries of its callback steps that the pass
/// could not see: those that arrived while it ran, or before the job id
/// was committed. Settled steps judge them (a contradiction is a
/// reversal); waiting steps get their record woken to apply them.
pub(super) async fn follow_up_deliveries(
    i: &Inner,
    rec: &Record,
    state: crate::domain::RecordState,
    steps: &[StepWrite],
) {
    let Some((pipeline, _)) = i.versions().compiled(rec).await else {
        return;
    };
    let is_callback = |name: &str| pipeline.step(name).is_some_and(|s| s.callback().is_some());
    let mut settled = Vec::new();
    for w in steps.iter().filter(|w| is_callback(&w.step)) {
        let (Some(provider), Some(job)) = (&w.provider, &w.job_id) else {
            continue;
        };
        if crate::domain::pass::is_done(w.state) {
            settled.push((w.step.clone(), provider.clone(), job.clone(), w.state));
        } else if w.state == StepState::Waiting
            && state == crate::domain::RecordState::Waiting
            && i.db
                .pending_callbacks(provider, job)
                .await
                .is_ok_and(|c| !c.is_empty())
        {
            let _ = i.db.wake_record(rec.id, i.clock.now_ms()).await;
            i.wake.notify_one();
        }
    }
    if !settled.is_empty() {
        reconcile_late_deliveries(i, rec.id, &settled).await;
    }
}

/// After a commit that settled callback steps, judges deliveries that
/// arrived while the pass ran (they found the step still waiting).
async fn reconcile_late_deliveries(
    i: &Inner,
    record_id: i64,
    settled: &[(String, String, String, StepState)],
) {
    for (step, provider, job, state) in settled {
        let Some(rt) = i.provider(provider) else {
            continue;
        };
        let Ok(pending) = i.db.pending_callbacks(provider, job).await else {
            continue;
        };
        for cb in pending {
            let now = i.clock.now_ms();
            // The record may be held by a worker for a moment (it moved
            // on to its next step): try again a few times.
            let mut judged = false;
            for attempt in 0..10u64 {
                match judge_late_delivery(i, &rt, record_id, step, *state, job, &cb.body, now).await
                {
                    Ok(_) => {
                        judged = true;
                        break;
                    }
                    Err(StoreError::Transition(_)) => {
                        tokio::time::sleep(Duration::from_millis(200 * (attempt + 1))).await;
                    }
                    Err(e) => {
                        tracing::warn!(record.id = record_id, error = %e, "late delivery not judged");
                        break;
                    }
                }
            }
            if !judged {
                tracing::warn!(
                    record.id = record_id,
                    "late delivery could not be judged; kept unprocessed"
                );
                continue;
            }
            let _ = i.db.mark_callbacks(&[cb.id], now).await;
        }
    }
}
