//! The engine's side of a `pipeline` step (`domain::child` decides): the
//! child record enqueued under a key from its parent and linked to it,
//! read again when it wakes its parent, and the parent woken when its
//! child came to rest while the parent's own pass was under way.

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
            None => self.record.input.clone(),
            Some(id) => {
                let (ctx, _) = self.context_of(&self.write);
                let rendered = self.templates.render(id, &ctx).map_err(|e| e.to_string());
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
        let e = Enqueue::new(spec.pipeline.clone(), Some(&key), input)
            .in_group(self.record.group.as_deref());
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
            .link_child(created.id, self.record.id, &self.step.name)
            .await;
        if let Err(e) = linked {
            return self.deferred(self.now + AGAIN_MS, &format!("child not linked: {e}"));
        }
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
/// them (it came to rest): they are ready in this pass.
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

/// After a parent's commit that left it waiting on children: a child that
/// came to rest before the commit landed found the parent still running
/// and could not wake it; the parent wakes itself instead.
pub(super) async fn follow_up(i: &Inner, after: &Record, steps: &[StepWrite]) {
    if after.state != RecordState::Waiting {
        return;
    }
    for w in steps {
        let news = news_of(i, w).await.is_some_and(|s| child::has_news(w, s));
        if news {
            let woke = i.db.wake_waiting(after.id, i.clock.now_ms()).await;
            if let Err(e) = woke {
                tracing::warn!(record.id = after.id, error = %e, "cannot wake a parent");
            }
            return;
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
