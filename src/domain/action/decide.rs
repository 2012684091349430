//! `approve` and `reject`: an operator decides a step that waits for an
//! approval (a comment required, audited). The decision, its comment, who
//! and when become the step's output, and the record goes on at once.
//! Offered while a step awaits one, or waited past its timeout (its record
//! parked): a late decision still counts.

use super::{ActionRequest, Facts, Record, Refused, Rules, StepChange, StepRun, invalid};
use crate::domain::awaiting::{Awaits, Decision, decided, waiting_for};
use serde_json::{Value, json};

/// `approve` (`Decide(Decision::Approved)`) or `reject`.
pub(super) struct Decide(pub Decision);

/// Whether `rec` may take a decision or a signal for `what`: not while
/// it is parked for another reason than that wait's timeout (a reversal,
/// an operator's park), which a person resumes or retries first.
pub(super) fn open_to(rec: &Record, what: Awaits) -> bool {
    rec.state != crate::domain::RecordState::Parked
        || rec.error_code.as_deref() == Some(what.timed_out_code())
}

/// Whether `rec` takes a decision or a signal for `what` now: open to
/// one, with a step waiting for it (what the actions offer).
pub(super) fn awaits_now(rec: &Record, runs: &[StepRun], what: Awaits) -> bool {
    open_to(rec, what) && !waiting_for(runs, what).is_empty()
}

/// The step `req` decides on `rec`: the one it names, or the only one
/// awaiting `what`.
pub(super) fn awaited<'r>(
    rec: &Record,
    runs: &'r [StepRun],
    req: &ActionRequest,
    what: Awaits,
) -> Result<&'r StepRun, Refused> {
    if !open_to(rec, what) {
        return invalid(
            "record_parked",
            format!(
                "the record is parked ({}): resume or retry it first, then decide",
                rec.error_code.as_deref().unwrap_or("by an operator")
            ),
        );
    }
    let waiting = waiting_for(runs, what);
    let noun = what.noun();
    match (req.steps.first(), waiting.as_slice()) {
        (Some(step), _) => match waiting.iter().find(|r| &r.step == step) {
            Some(run) => Ok(run),
            None => invalid(
                "nothing_awaited",
                format!("step `{step}` does not wait for {}", what.what()),
            ),
        },
        (None, [only]) => Ok(only),
        (None, []) => invalid(
            "nothing_awaited",
            format!("no step of this record waits for {}", what.what()),
        ),
        (None, _) => invalid(
            "step_required",
            format!("several steps wait for {noun}: name one (`step`)"),
        ),
    }
}

impl Rules for Decide {
    fn noun(&self) -> &'static str {
        match self.0 {
            Decision::Approved => "an approval",
            Decision::Rejected => "a rejection",
        }
    }

    /// The comment.
    fn needs_reason(&self) -> bool {
        true
    }

    fn offered(&self, rec: &Record, facts: &Facts) -> bool {
        awaits_now(rec, facts.runs, Awaits::Approval)
    }

    /// A decision is one record's, read on its page.
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
        let run = awaited(rec, runs, req, Awaits::Approval)?;
        let comment = req.reason.as_deref().unwrap_or_default();
        Ok(StepChange::Decide {
            step: run.step.clone(),
            output: decided(self.0, comment, &req.actor, req.now),
            job_id: None,
            reason: format!("{} by {}", self.0.as_str(), req.actor),
        })
    }

    fn detail(
        &self,
        _rec: &Record,
        req: &ActionRequest,
        _: Option<&crate::domain::park::ParkUntil>,
    ) -> Option<Value> {
        req.steps.first().map(|s| json!({ "step": s }))
    }

    fn event_step(&self, req: &ActionRequest) -> Option<String> {
        req.steps.first().cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::StepState;

    fn run(step: &str, code: Option<&str>) -> StepRun {
        StepRun {
            record_id: 1,
            step: step.into(),
            provider: None,
            state: StepState::Waiting,
            generation: 0,
            attempts: 0,
            unknowns: 0,
            idempotency_key: "k".into(),
            job_id: None,
            output: None,
            error_code: code.map(str::to_owned),
            reason: None,
            next_run_at: None,
            deadline_at: None,
            started_at: Some(0),
            finished_at: None,
            updated_at: 0,
            cause: None,
        }
    }

    #[test]
    fn a_decision_finds_its_step_or_says_which_to_name() {
        use crate::domain::OperatorAction;
        let mut req = ActionRequest::new(1, OperatorAction::Approve, "ann", Some("ok".into()), 9);
        let code = |r: Result<&StepRun, Refused>| r.err().map(|e| e.code());
        let one = [run("review", Some("awaiting_approval")), run("nap", None)];
        assert_eq!(
            awaited(&record(), &one, &req, Awaits::Approval)
                .map(|r| r.step.as_str())
                .ok(),
            Some("review")
        );
        assert_eq!(
            code(awaited(&record(), &one, &req, Awaits::Signal)),
            Some("nothing_awaited")
        );
        let two = [
            run("legal", Some("awaiting_approval")),
            run("finance", Some("approval_timed_out")),
        ];
        assert_eq!(
            code(awaited(&record(), &two, &req, Awaits::Approval)),
            Some("step_required")
        );
        req.steps = vec!["finance".into()];
        assert_eq!(
            awaited(&record(), &two, &req, Awaits::Approval)
                .map(|r| r.step.as_str())
                .ok(),
            Some("finance")
        );
        req.steps = vec!["nap".into()];
        assert_eq!(
            code(awaited(&record(), &one, &req, Awaits::Approval)),
            Some("nothing_awaited")
        );
        // The decision, its comment, who and when, as the step's output.
        req.steps = vec!["review".into()];
        let change = Decide(Decision::Rejected).steps(&record(), &one, &req, false);
        let Ok(StepChange::Decide { step, output, .. }) = change else {
            panic!("{change:?}");
        };
        assert_eq!(step, "review");
        assert_eq!(
            output,
            json!({ "decision": "rejected", "comment": "ok", "by": "ann", "at": 9 })
        );
    }

    fn record() -> Record {
        Record {
            pipeline_version: Some(1),
            input: json!({}),
            ..Record::sample(crate::domain::RecordState::Waiting)
        }
    }
}
