//! `retry`: due now, with a fresh attempt budget for every unfinished
//! step, optionally with a new input.

use super::{ActionRequest, Record, Refused, Rules, StepChange, StepRun, Takes};
use serde_json::{Value, json};

pub(super) struct Retry;

impl Rules for Retry {
    fn noun(&self) -> &'static str {
        "a retry"
    }

    fn takes(&self) -> Takes {
        Takes {
            input: true,
            ..Takes::default()
        }
    }

    /// Not on a record whose effects were undone: it would go on from
    /// its failed step on top of them (a replay runs it again whole).
    fn offered(&self, rec: &Record, _facts: &super::Facts) -> bool {
        !undone(rec)
    }

    fn in_bulk(&self, rec: &Record) -> bool {
        !undone(rec)
    }

    fn steps(
        &self,
        rec: &Record,
        _runs: &[StepRun],
        req: &ActionRequest,
        new_input: bool,
    ) -> Result<StepChange, Refused> {
        if undone(rec) {
            return super::invalid(
                "record_undone",
                "its effects were undone: replay it from its first step to run it again",
            );
        }
        let cause = if new_input {
            format!("retry with a new input by {}", req.actor)
        } else {
            format!("retry by {}", req.actor)
        };
        Ok(StepChange::FreshStart { new_input, cause })
    }

    /// The reversed steps' successors it runs again, when it names them.
    fn detail(
        &self,
        _rec: &Record,
        req: &ActionRequest,
        _condition: Option<&crate::domain::park::ParkUntil>,
    ) -> Option<Value> {
        (!req.steps.is_empty()).then(|| json!({ "steps": req.steps }))
    }
}

/// Whether `rec` ended with its effects undone.
fn undone(rec: &Record) -> bool {
    rec.state == crate::domain::RecordState::Failed && rec.error_code.as_deref() == Some("undone")
}
