//! `replay`: run a chosen step and every step after it again (which may
//! pay again), optionally with a new input or on the current pipeline
//! version.

use super::{ActionRequest, Record, Refused, Rules, StepChange, StepRun, Takes, invalid};
use crate::domain::park::ParkUntil;
use serde_json::{Value, json};

pub(super) struct Replay;

impl Rules for Replay {
    fn noun(&self) -> &'static str {
        "a replay"
    }

    fn takes(&self) -> Takes {
        Takes {
            input: true,
            repin: true,
            until: false,
            failed_items: true,
        }
    }

    fn check(&self, req: &ActionRequest) -> Result<(), Refused> {
        if req.steps.is_empty() {
            return invalid("step_required", "replay needs the step to replay from");
        }
        Ok(())
    }

    fn steps(
        &self,
        _: &Record,
        _: &[StepRun],
        req: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        Ok(StepChange::RunAgain {
            steps: req.steps.clone(),
            cause: format!("replay by {}", req.actor),
            keep_items: req.failed_items,
        })
    }

    /// The steps run again, the versions when it moves the record, and
    /// `"items": "failed"` when the first keeps its items that succeeded.
    fn detail(&self, rec: &Record, req: &ActionRequest, _: Option<&ParkUntil>) -> Option<Value> {
        let mut detail = json!({ "steps": req.steps });
        if let Some(to) = req.repin {
            detail["version"] = json!({ "from": rec.pipeline_version, "to": to });
        }
        if req.failed_items {
            detail["items"] = json!("failed");
        }
        Some(detail)
    }

    /// The step it replays from.
    fn event_step(&self, req: &ActionRequest) -> Option<String> {
        req.steps.first().cloned()
    }
}
