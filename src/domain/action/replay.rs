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
        })
    }

    /// The steps run again, and the versions when it moves the record.
    fn detail(&self, rec: &Record, req: &ActionRequest, _: Option<&ParkUntil>) -> Option<Value> {
        Some(match req.repin {
            Some(to) => json!({
                "steps": req.steps,
                "version": { "from": rec.pipeline_version, "to": to },
            }),
            None => json!({ "steps": req.steps }),
        })
    }

    /// The step it replays from.
    fn event_step(&self, req: &ActionRequest) -> Option<String> {
        req.steps.first().cloned()
    }
}
