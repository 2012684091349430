//! A step's `when`: judged once, when the step is first ready, over what
//! its templates see. False, the step is skipped and keeps the evidence:
//! the expression and each value it read, in its output and its reason.

use serde_json::{Map, Value, json};

use super::pipeline::Step;
use super::step::{Decision, park_or_fail};
use super::{StepState, StepWrite, UnixMs};

/// Longest a skipped step's reason quotes what its condition read (the
/// output keeps it whole).
const REASON_MAX: usize = 300;

/// Whether a step's `when` is still to be judged: it has not started
/// (no attempt, no job, not waiting). A step whose condition held and
/// that was then given back without a call is judged again, over the same
/// values.
pub fn to_judge(step: &Step, write: &StepWrite) -> bool {
    step.when.is_some()
        && write.state == StepState::Pending
        && write.attempts == 0
        && write.job_id.is_none()
}

/// The step as its condition leaves it: `None` when it holds (the step
/// goes on), else skipped with `source` and what it `read` as its output
/// (`{"when": ..., "read": {...}}`) and its reason.
pub fn judged(
    write: &StepWrite,
    source: &str,
    holds: bool,
    read: &[(String, Value)],
    now: UnixMs,
) -> Option<Decision> {
    if holds {
        return None;
    }
    let mut w = write.clone();
    let values: Vec<String> = read.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    let mut reason = format!("`when` is false: {source}");
    if !values.is_empty() {
        reason = format!("{reason} (read {})", values.join(", "));
    }
    if reason.len() > REASON_MAX {
        let cut = super::model::excerpt(&reason, REASON_MAX - 1).len();
        reason.truncate(cut);
        reason.push('…');
    }
    let read: Map<String, Value> = read.iter().cloned().collect();
    w.state = StepState::Skipped;
    w.output = Some(json!({ "when": source, "read": read }));
    w.reason = Some(reason);
    w.error_code = None;
    w.next_run_at = None;
    w.finished_at = Some(now);
    Some(Decision::keep(w))
}

/// A condition that cannot be judged (it reads a value that is not
/// there, or fails): the step cannot go on, as any such step
/// (`when_invalid`).
pub fn unjudgeable(step: &Step, write: &StepWrite, why: &str, now: UnixMs) -> Decision {
    let reason = format!("`when` cannot be judged: {why}");
    park_or_fail(step, write.clone(), "when_invalid", reason, now)
}
