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

    fn offered(&self, _rec: &Record, facts: &Facts) -> bool {
        facts.undoable
    }

    /// One record at a time: an undo makes calls of its own.
    fn in_bulk(&self, _rec: &Record) -> bool {
        false
    }

    /// The steps the caller worked out, less those undone meanwhile (read
    /// again under the record's lock).
    fn steps(
        &self,
        _: &Record,
        runs: &[StepRun],
        req: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
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
        })
    }

    /// The undo steps, in the order they run.
    fn detail(&self, _: &Record, req: &ActionRequest, _: Option<&ParkUntil>) -> Option<Value> {
        Some(json!({ "steps": req.steps }))
    }
}
