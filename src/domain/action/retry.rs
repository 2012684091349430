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

    fn steps(
        &self,
        _rec: &Record,
        _runs: &[StepRun],
        req: &ActionRequest,
        new_input: bool,
    ) -> Result<StepChange, Refused> {
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
