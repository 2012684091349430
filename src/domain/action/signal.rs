//! `signal`: a caller ends a step that waits for a signal
//! (`POST /api/v1/records/{id}/signals/{step}`); the signal's JSON body
//! is the step's output, its id (when given) kept as the run's job id so
//! that a resent signal changes nothing. Audited like any action, its
//! actor the caller's token.

use super::decide::{awaited, awaits_now};
use super::{ActionRequest, Facts, Record, Refused, Rules, StepChange, StepRun, invalid};
use crate::domain::awaiting::Awaits;
use crate::domain::json_has_nul;
use serde_json::{Value, json};

pub(super) struct Signal;

/// A signal as it came: its body and its id.
#[derive(Debug, Clone, PartialEq)]
pub struct Signalled {
    pub body: Value,
    /// The caller's signal id (`Idempotency-Key`), if it gave one.
    pub id: Option<String>,
}

/// The longest signal id kept.
const ID_MAX: usize = 200;

impl Rules for Signal {
    fn noun(&self) -> &'static str {
        "a signal"
    }

    fn own_command(&self) -> Option<&'static str> {
        Some(
            "a signal comes through `POST /api/v1/records/{id}/signals/{step}`, its body the output",
        )
    }

    fn check(&self, req: &ActionRequest) -> Result<(), Refused> {
        let Some(s) = &req.signal else {
            return invalid("details_required", "a signal needs its body");
        };
        if json_has_nul(&s.body) || s.id.as_deref().is_some_and(|i| i.contains('\0')) {
            return invalid("invalid_request", "a NUL character (\\u0000) in the signal");
        }
        if s.id
            .as_deref()
            .is_some_and(|i| i.trim().is_empty() || i.len() > ID_MAX)
        {
            return invalid("bad_signal_id", "a signal id is 1 to 200 characters");
        }
        Ok(())
    }

    fn offered(&self, rec: &Record, facts: &Facts) -> bool {
        awaits_now(rec, facts.runs, Awaits::Signal)
    }

    fn in_bulk(&self, _rec: &Record) -> bool {
        false
    }

    fn steps(
        &self,
        rec: &Record,
        runs: &[StepRun],
        req: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        let Some(s) = &req.signal else {
            return invalid("details_required", "a signal needs its body");
        };
        let run = awaited(rec, runs, req, Awaits::Signal)?;
        Ok(StepChange::Decide {
            step: run.step.clone(),
            output: s.body.clone(),
            job_id: s.id.clone(),
            reason: format!("signalled by {}", req.actor),
        })
    }

    fn detail(
        &self,
        _rec: &Record,
        req: &ActionRequest,
        _: Option<&crate::domain::park::ParkUntil>,
    ) -> Option<Value> {
        let id = req.signal.as_ref().and_then(|s| s.id.clone());
        Some(json!({ "step": req.steps.first(), "signal_id": id }))
    }

    fn event_step(&self, req: &ActionRequest) -> Option<String> {
        req.steps.first().cloned()
    }
}
