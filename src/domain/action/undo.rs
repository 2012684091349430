//! `undo`: the undo calls of a failed, parked or cancelled record's
//! succeeded steps run, last finished first (`domain::undo`); the record
//! then ends failed `undone`, or parks `undo_failed`. The steps are
//! worked out from the pipeline by the caller (`ActionRequest::steps`).

use super::{ActionRequest, Facts, Record, Refused, Rules, StepChange, StepRun, invalid};
use crate::domain::park::ParkUntil;
use serde_json::{Value, json};

pub(super) struct Undo;

impl Rules for Undo {
    fn noun(&self) -> &'static str {
        "an undo"
    }

    fn needs_reason(&self) -> bool {
        true
    }

    fn check(&self, req: &ActionRequest) -> Result<(), Refused> {
        if req.steps.is_empty() {
            return invalid(
                "nothing_to_undo",
                "no step of it that succeeded has an undo call",
            );
        }
        Ok(())
    }

    fn offered(&self, rec: &Record, facts: &Facts) -> bool {
        facts.undoable && !held(rec, facts.uncertain)
    }

    /// One record at a time: an undo makes calls of its own.
    fn in_bulk(&self, _rec: &Record) -> bool {
        false
    }

    /// The steps the caller worked out, less those undone meanwhile (read
    /// again under the record's lock).
    fn steps(
        &self,
        rec: &Record,
        runs: &[StepRun],
        req: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        // A call whose outcome is not known may have taken effect: an
        // undo now would leave that effect in place. A parked record can
        // have it settled first ('it took effect' or a retry).
        if held(rec, runs.iter().any(super::took_effect::open_uncertain)) {
            return invalid(
                "outcome_uncertain",
                "a call's outcome is not known: settle it first ('it took effect' or retry), \
                 then undo",
            );
        }
        let done = |s: &String| {
            runs.iter()
                .any(|r| &r.step == s && r.state == crate::domain::StepState::Succeeded)
        };
        let steps: Vec<String> = req.steps.iter().filter(|s| !done(s)).cloned().collect();
        if steps.is_empty() {
            return invalid("nothing_to_undo", "every undo call was made meanwhile");
        }
        Ok(StepChange::RunAgain {
            steps,
            cause: format!("undo by {}", req.actor),
            keep_items: false,
        })
    }

    /// The undo steps, in the order they run.
    fn detail(&self, _: &Record, req: &ActionRequest, _: Option<&ParkUntil>) -> Option<Value> {
        Some(json!({ "steps": req.steps }))
    }
}

/// Whether `rec` is parked on a call whose outcome is not known (its own
/// code, or `open`: a run of it still uncertain), which an undo must wait
/// for until someone settles it.
fn held(rec: &Record, open: bool) -> bool {
    rec.state == crate::domain::RecordState::Parked
        && (open || rec.error_code.as_deref() == Some(crate::domain::OUTCOME_UNCERTAIN))
}
