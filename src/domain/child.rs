//! A step of kind `pipeline`: it starts one record of another pipeline
//! (its child), keyed from the parent so that a retry never starts a
//! second, and waits for it holding no worker. The child at rest wakes
//! its parent; the parent's pass reads the child and decides here.

use serde_json::Value;

use super::pipeline::Step;
use super::step::{Decision, park_or_fail};
use super::{Record, RecordState, StepState, StepWrite, UnixMs};

/// The code a step run waiting for its child carries.
pub const AWAITING: &str = "awaiting_child";
/// The code of a step whose child is parked: it waits on, and its record
/// says so ("waiting on a parked child").
pub const PARKED: &str = "child_parked";

/// A `pipeline` step as compiled: the pipeline its child runs, the id
/// of the template giving the child's input (`None`: the parent's input)
/// and the child's priority (`None`: the parent's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildSpec {
    pub pipeline: String,
    pub input: Option<String>,
    pub priority: Option<u8>,
}

/// The key a step's child is enqueued under: the same for every pass and
/// retry of one generation of the step, a new one for a replay.
pub fn key(parent: i64, step: &str, generation: i32) -> String {
    format!("child-of-{parent}/{step}/{generation}")
}

/// Whether a step run in `state` with `code` waits on its child (only the
/// child, by waking its parent, makes it due).
pub fn holds(state: StepState, code: Option<&str>) -> bool {
    state == StepState::Waiting && matches!(code, Some(AWAITING | PARKED))
}

/// The child of a step run, by the id its run keeps as its job id.
pub fn child_of(write: &StepWrite) -> Option<i64> {
    write.job_id.as_deref().and_then(|j| j.parse().ok())
}

/// Whether a child in `state` tells its waiting parent's step something
/// new: it came to rest, and is not the parked child the step already
/// waits on.
pub fn has_news(write: &StepWrite, state: RecordState) -> bool {
    holds(write.state, write.error_code.as_deref())
        && state.is_at_rest()
        && !(state == RecordState::Parked && write.error_code.as_deref() == Some(PARKED))
}

/// The step started (or found, on a pass after a crash) its child `id`
/// of `pipeline`: it waits for it.
pub fn started(write: &StepWrite, id: i64, pipeline: &str, now: UnixMs) -> Decision {
    let mut w = write.clone();
    w.started_at.get_or_insert(now);
    w.job_id = Some(id.to_string());
    waiting(
        w,
        AWAITING,
        format!("waiting for child record {id} ({pipeline})"),
    )
}

/// What the step's child, as read now, makes of the step: its outputs
/// (each succeeded step's, by name) when it succeeded; a failure (a
/// required step parks its record) when it failed or was cancelled; a
/// wait otherwise, saying so when the child is parked.
pub fn followed(
    step: &Step,
    write: &StepWrite,
    child: &Record,
    outputs: Value,
    now: UnixMs,
) -> Decision {
    let mut w = write.clone();
    let (id, pipeline) = (child.id, &child.pipeline);
    let why = || {
        let code = child.error_code.as_deref().unwrap_or("no code");
        let reason = child.reason.as_deref().unwrap_or("no reason given");
        format!("{code}: {reason}")
    };
    match child.state {
        RecordState::Succeeded => {
            w.state = StepState::Succeeded;
            w.output = Some(outputs);
            w.error_code = None;
            w.reason = None;
            w.next_run_at = None;
            w.finished_at = Some(now);
            Decision::keep(w)
        }
        RecordState::Failed | RecordState::Cancelled => {
            let (code, ended) = match child.state {
                RecordState::Failed => ("child_failed", "failed"),
                _ => ("child_cancelled", "was cancelled"),
            };
            let reason = format!("child record {id} ({pipeline}) {ended}: {}", why());
            park_or_fail(step, w, code, reason, now)
        }
        RecordState::Parked => {
            let reason = format!(
                "waiting on a parked child: record {id} ({pipeline}), {}",
                why()
            );
            waiting(w, PARKED, reason)
        }
        _ => waiting(
            w,
            AWAITING,
            format!("waiting for child record {id} ({pipeline})"),
        ),
    }
}

fn waiting(mut w: StepWrite, code: &str, reason: String) -> Decision {
    w.state = StepState::Waiting;
    w.next_run_at = None;
    w.deadline_at = None;
    w.error_code = Some(code.to_owned());
    w.reason = Some(reason);
    Decision::keep(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting_on(code: &str) -> StepWrite {
        let mut w = StepWrite::pending("kyc");
        w.state = StepState::Waiting;
        w.error_code = Some(code.into());
        w.job_id = Some("7".into());
        w
    }

    #[test]
    fn a_parked_child_is_news_once() {
        let w = waiting_on(AWAITING);
        assert!(has_news(&w, RecordState::Parked));
        assert!(has_news(&w, RecordState::Succeeded));
        assert!(!has_news(&w, RecordState::Running));
        let parked = waiting_on(PARKED);
        assert!(!has_news(&parked, RecordState::Parked));
        assert!(has_news(&parked, RecordState::Failed));
        assert_eq!(child_of(&parked), Some(7));
        assert!(!has_news(&StepWrite::pending("x"), RecordState::Succeeded));
    }

    #[test]
    fn keys_differ_by_generation_only() {
        assert_eq!(key(5, "kyc", 0), key(5, "kyc", 0));
        assert_ne!(key(5, "kyc", 0), key(5, "kyc", 1));
        assert_ne!(key(5, "kyc", 0), key(6, "kyc", 0));
    }
}
