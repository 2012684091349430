//! `resume`: a parked record continues where it stopped (accepting a
//! reversed result); the system resumes one whose condition holds.

use super::{ActionRequest, Record, Refused, Rules, StepChange, StepRun};
use crate::domain::park::ParkUntil;
use crate::domain::{OperatorAction, RecordState, SYSTEM_ACTOR, UnixMs};
use serde_json::Value;

pub(super) struct Resume;

impl Rules for Resume {
    fn noun(&self) -> &'static str {
        "a resume"
    }

    /// Not where an undo call failed: a resume would park it again at
    /// once (a retry makes the call again).
    fn offered(&self, rec: &Record, facts: &super::Facts) -> bool {
        !undo_call_failed(rec, facts.runs)
    }

    /// A resume accepts a reversed result: it is no longer marked for a
    /// retry to run again.
    fn steps(
        &self,
        rec: &Record,
        runs: &[StepRun],
        _: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        if undo_call_failed(rec, runs) {
            return super::invalid(
                "undo_call_failed",
                "an undo call failed: retry it (a resume would park the record again)",
            );
        }
        Ok(StepChange::AcceptReversed)
    }

    /// The condition that held, for the system's resume.
    fn detail(
        &self,
        _: &Record,
        _: &ActionRequest,
        condition: Option<&ParkUntil>,
    ) -> Option<Value> {
        condition.map(ParkUntil::detail)
    }
}

/// The system's resume of `rec` when the condition it is parked until
/// holds at `now` (`free`: the providers taking calls again), with that
/// condition; `None` when it does not, or the record is no longer parked.
pub fn resume_due<'a>(
    rec: &Record,
    now: UnixMs,
    mut free: impl Iterator<Item = &'a str>,
) -> Option<(ActionRequest, ParkUntil)> {
    let until = rec.park_until.clone()?;
    let holds = match &until {
        ParkUntil::Time { at } => *at <= now,
        ParkUntil::Provider { provider } => free.any(|p| p == provider),
    };
    if !holds || rec.state != RecordState::Parked {
        return None;
    }
    let reason = match &until {
        ParkUntil::Time { .. } => format!("parked {until}: the time came"),
        ParkUntil::Provider { provider } => {
            format!("parked {until}: provider `{provider}` takes calls again")
        }
    };
    let request = ActionRequest::new(
        rec.id,
        OperatorAction::Resume,
        SYSTEM_ACTOR,
        Some(reason),
        now,
    );
    Some((request, until))
}

/// Whether `rec` is parked on an undo call that could not complete (its
/// attempts spent, or failed): a resume, which gives it no fresh budget,
/// would park it again.
fn undo_call_failed(rec: &Record, _runs: &[StepRun]) -> bool {
    rec.state == RecordState::Parked && rec.error_code.as_deref() == Some("undo_failed")
}
