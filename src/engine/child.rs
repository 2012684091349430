//! The engine's side of a `pipeline` step (`domain::child` decides): the
//! child record enqueued under a key from its parent and linked to it,
//! and read again when it wakes its parent (the wake itself is the
//! store's, in the commit that brings the child to rest or leaves the
//! parent waiting); a child whose parent was cancelled while it ran is
//! cancelled after its pass.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};

use super::Inner;
use super::enqueue::Enqueue;
use super::step::{StepCall, StepOutput};
use crate::domain::child::{self, ChildSpec};
use crate::domain::pipeline::Pipeline;
use crate::domain::step::park_or_fail;
use crate::domain::{Record, RecordState, StepState, StepWrite};

/// How long a step waits before trying again to start or read its child
/// after the database refused.
const AGAIN_MS: i64 = 1_000;

impl StepCall<'_> {
    /// A pass over a `pipeline` step: starts its child on its first pass
    /// (or finds the one a crashed pass started: the key is the same),
    /// else reads its child and follows it.
    pub(super) async fn run_child(&self, spec: &ChildSpec) -> StepOutput {
        if let Some(d) = self.judged() {
            return StepOutput::new(d);
        }
        match child::child_of(&self.write) {
            None => self.start_child(spec).await,
            Some(id) => self.follow_child(id).await,
        }
    }

    async fn start_child(&self, spec: &ChildSpec) -> StepOutput {
        let input = match &spec.input {
            // For each item: the item; otherwise the parent's input.
            None => match &self.item {
                Some((item, _)) => item.clone(),
                None => self.record.input.clone(),
            },
            Some(id) => {
                let rendered = self.render(id, &self.write);
                match rendered.and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string())) {
                    Ok(v) => v,
                    Err(why) => {
                        let reason = format!("the child's `input` gives no JSON: {why}");
                        let d = park_or_fail(
                            self.step,
                            self.write.clone(),
                            "input_invalid",
                            reason,
                            self.now,
                        );
                        return StepOutput::new(d);
                    }
                }
            }
        };
        let key = child::key(self.record.id, &self.step.name, self.write.generation);
        // Enqueued due at no time, so that no worker claims it before it
        // names its parent (a child that cannot wake its parent); linking
        // it makes it due.
        let e = Enqueue::new(spec.pipeline.clone(), Some(&key), input)
            .in_group(self.record.group.as_deref())
            .with_priority(Some(spec.priority.unwrap_or(self.record.priority)))
            .at(crate::store::NO_TIME);
        let created = match super::enqueue::enqueue_in(self.engine, e).await {
            Ok(c) => c.record,
            Err(crate::store::StoreError::Invalid(why)) => {
                // The pipeline is gone from this node's configuration.
                let reason = format!("cannot start a `{}` record: {why}", spec.pipeline);
                let d = park_or_fail(
                    self.step,
                    self.write.clone(),
                    "child_not_started",
                    reason,
                    self.now,
                );
                return StepOutput::new(d);
            }
            Err(e) => {
                return self.deferred(self.now + AGAIN_MS, &format!("child not started: {e}"));
            }
        };
        let linked = self
            .db
            .link_child(created.id, self.record.id, &self.step.name, self.now)
            .await;
        if let Err(e) = linked {
            return self.deferred(self.now + AGAIN_MS, &format!("child not linked: {e}"));
        }
        self.engine.wake.notify_one();
        StepOutput::new(child::started(
            &self.write,
            created.id,
            &spec.pipeline,
            self.now,
        ))
    }

    async fn follow_child(&self, id: i64) -> StepOutput {
        let child = match self.db.get_record(id).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                let reason = format!("child record {id} no longer exists");
                let d = park_or_fail(
                    self.step,
                    self.write.clone(),
                    "child_missing",
                    reason,
                    self.now,
                );
                return StepOutput::new(d);
            }
            Err(e) => return self.deferred(self.now + AGAIN_MS, &format!("child not read: {e}")),
        };
        let outputs = if child.state == RecordState::Succeeded {
            match self.db.step_runs(id).await {
                Ok(runs) => outputs_of(&runs),
                Err(e) => {
                    return self.deferred(self.now + AGAIN_MS, &format!("child not read: {e}"));
                }
            }
        } else {
            Value::Null
        };
        StepOutput::new(child::followed(
            self.step,
            &self.write,
            &child,
            outputs,
            self.now,
        ))
    }
}

/// A child's outputs: each succeeded step's, by its name.
fn outputs_of(runs: &[crate::domain::StepRun]) -> Value {
    let done = runs.iter().filter(|r| r.state == StepState::Succeeded);
    let outputs: Map<String, Value> = done
        .map(|r| (r.step.clone(), r.output.clone().unwrap_or(Value::Null)))
        .collect();
    Value::Object(outputs)
}

/// The `pipeline` steps of a record waiting on a child that has news for
/// them (it came to rest): they are ready in this pass. A step for each
/// item waiting on its items' children is ready whenever its record runs
/// (its pass reads them: `engine::each`).
pub(super) async fn with_news(
    i: &Inner,
    pipeline: &Pipeline,
    states: &HashMap<String, StepWrite>,
) -> HashSet<String> {
    let mut ready = HashSet::new();
    for s in pipeline.steps.iter().filter(|s| s.kind.child().is_some()) {
        let Some(w) = states.get(&s.name) else {
            continue;
        };
        if s.each.is_some() {
            if child::holds(w.state, w.error_code.as_deref()) {
                ready.insert(s.name.clone());
            }
            continue;
        }
        if let Some(state) = news_of(i, w).await {
            if child::has_news(w, state) {
                ready.insert(s.name.clone());
            }
        }
    }
    ready
}

/// The state of the child `w` waits on, when it waits on one.
async fn news_of(i: &Inner, w: &StepWrite) -> Option<RecordState> {
    if !child::holds(w.state, w.error_code.as_deref()) {
        return None;
    }
    let id = child::child_of(w)?;
    match i.db.get_record(id).await {
        Ok(found) => found.map(|r| r.state),
        Err(e) => {
            tracing::warn!(child.id = id, error = %e, "cannot read a child record");
            None
        }
    }
}

/// The parent a commit bringing `rec` to `result` wakes: a child at rest.
pub(super) fn parent_to_wake(rec: &Record, result: crate::domain::WorkResult) -> Option<i64> {
    use crate::domain::WorkResult as W;
    matches!(result, W::Completed | W::Failed | W::Parked)
        .then_some(rec.parent_id)
        .flatten()
}

/// After a child's commit: a child whose parent was cancelled while it
/// ran (the cancel could not touch it then) is cancelled now, with its
/// own children.
pub(super) async fn parent_cancelled(i: &Inner, after: &Record) {
    let Some(parent) = after.parent_id else {
        return;
    };
    if finished(after.state) {
        return;
    }
    match i.db.get_record(parent).await {
        Ok(Some(p)) if p.state == RecordState::Cancelled => {
            let reason = format!("cancelled with its parent record {parent}");
            cancel_family(&i.db, after.id, "system", &reason, i.clock.now_ms()).await;
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(record.id = parent, error = %e, "cannot read a parent"),
    }
}

/// Whether a record in `state` is done with for good: a cancel leaves it
/// alone (a parked one is not: it may still go on).
pub(crate) fn finished(state: RecordState) -> bool {
    matches!(
        state,
        RecordState::Succeeded | RecordState::Failed | RecordState::Cancelled
    )
}

/// Cancels record `id` (when not finished) and, depth first, every
/// unfinished record it started, each audited with `reason`. A record
/// running now refuses (its pass is under way): it is cancelled when
/// that pass commits ([`parent_cancelled`]).
pub(crate) async fn cancel_family(
    db: &crate::store::Db,
    id: i64,
    actor: &str,
    reason: &str,
    now: crate::domain::UnixMs,
) {
    let mut stack = vec![id];
    while let Some(id) = stack.pop() {
        let req = crate::domain::action::ActionRequest::new(
            id,
            crate::domain::OperatorAction::Cancel,
            actor,
            Some(reason.to_owned()),
            now,
        );
        match db.get_record(id).await {
            Ok(Some(r)) if !finished(r.state) => {
                if let Err(e) = db.act(&req).await {
                    tracing::warn!(record.id = id, error = %e, "cannot cancel a child yet");
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(record.id = id, error = %e, "cannot read a child"),
        }
        match db.children(id).await {
            Ok(children) => {
                stack.extend(children.iter().filter(|c| !finished(c.state)).map(|c| c.id))
            }
            Err(e) => tracing::warn!(record.id = id, error = %e, "cannot read the children"),
        }
    }
}
