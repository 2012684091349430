//! `took_effect`: an operator checked with the provider, and a call whose
//! outcome was not known did take effect: the step follows the job it
//! made, or succeeds with the outputs read there; nothing is sent again.
//! Which call that is is decided here only ([`uncertain_call`]).

use super::{ActionRequest, Facts, Record, Refused, Rules, StepChange, invalid};
use crate::domain::park::ParkUntil;
use crate::domain::{OUTCOME_UNCERTAIN, StepRun, StepState, json_has_nul};
use serde_json::{Value, json};

pub(super) struct TookEffect;

/// What a call whose outcome was not known did, as an operator found it at
/// the provider.
#[derive(Debug, Clone, PartialEq)]
pub enum Took {
    /// A job step's submit made this job: the step follows it.
    Job(String),
    /// A request step's call took effect: the step succeeds with these
    /// outputs (an object of the step's output names), its confirmation
    /// scheduled if it has one.
    Output {
        output: Value,
        confirm: Option<crate::domain::confirm::Pending>,
    },
}

impl Rules for TookEffect {
    fn noun(&self) -> &'static str {
        "`took_effect`"
    }

    fn own_command(&self) -> Option<&'static str> {
        Some(
            "`took_effect` says what the provider made: `job_id` for a job step, \
             `output` for a request step",
        )
    }

    fn offered(&self, _rec: &Record, facts: &Facts) -> bool {
        facts.uncertain
    }

    /// It names one record's job or outputs.
    fn in_bulk(&self, _rec: &Record) -> bool {
        false
    }

    fn steps(
        &self,
        rec: &Record,
        _: &[StepRun],
        req: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        let (Some(step), Some(took)) = (req.steps.first(), req.took.as_ref()) else {
            return invalid(
                "details_required",
                "`took_effect` needs the step and what the provider made",
            );
        };
        // The record is at the step, or at the step an item is of.
        if rec.step.as_deref() != Some(super::super::each::step_of(step))
            || rec.error_code.as_deref() != Some(OUTCOME_UNCERTAIN)
        {
            return invalid(
                "nothing_uncertain",
                format!("the record does not wait on step `{step}`'s uncertain call"),
            );
        }
        let step = step.clone();
        match took {
            Took::Job(job) => {
                if job.contains('\0') {
                    return invalid("invalid_request", "a NUL character (\\u0000) in the job id");
                }
                if job.trim().is_empty() || job.len() > 200 {
                    return invalid(
                        "bad_job_id",
                        "give the provider's job id (1 to 200 characters)",
                    );
                }
                let job = job.trim().to_owned();
                let reason = format!("the call took effect: job {job} (by {})", req.actor);
                Ok(StepChange::TookJob { step, job, reason })
            }
            Took::Output { output, confirm } => {
                if !output.is_object() {
                    return invalid("bad_output", "give the step's outputs as a JSON object");
                }
                if json_has_nul(output) {
                    return invalid("invalid_request", "the outputs contain a NUL character");
                }
                Ok(StepChange::TookOutput {
                    step,
                    output: output.clone(),
                    confirm: confirm.clone(),
                    reason: format!("the call took effect, outputs given by {}", req.actor),
                })
            }
        }
    }

    /// The step and what the operator said it made.
    fn detail(&self, _: &Record, req: &ActionRequest, _: Option<&ParkUntil>) -> Option<Value> {
        let first = req.steps.first();
        Some(match &req.took {
            Some(Took::Output { output, .. }) => json!({ "step": first, "output": output }),
            Some(Took::Job(job)) => json!({ "step": first, "job_id": job }),
            None => json!({ "step": first }),
        })
    }
}

/// The one call of `rec` whose outcome is uncertain and that an operator
/// may settle ("it took effect"): the step it parked at, still open (a
/// step already ended, or one an optional failure left behind, is not the
/// operator's to settle). A step that looks its call up (`looks_up`) sends
/// nothing again when the record resumes, so it does not block settling
/// another. Refused, with a stable code, when there is none or several
/// (resuming would send the others again).
pub fn uncertain_call<'r>(
    rec: &Record,
    runs: &'r [StepRun],
    looks_up: impl Fn(&str) -> bool,
) -> Result<&'r StepRun, (&'static str, &'static str)> {
    if rec.error_code.as_deref() != Some(OUTCOME_UNCERTAIN) {
        return Err((
            "nothing_uncertain",
            "this record does not wait on a call whose outcome is uncertain",
        ));
    }
    // The record's step, or an item of it (a record is at an item's step).
    let parked_on = |r: &StepRun| rec.step.as_deref() == Some(super::super::each::step_of(&r.step));
    let uncertain: Vec<&StepRun> = runs
        .iter()
        .filter(|r| open_uncertain(r))
        .filter(|r| !looks_up(&r.step) || parked_on(r))
        .collect();
    match uncertain.as_slice() {
        [run] if parked_on(run) => Ok(run),
        [_, _, ..] => Err((
            "several_uncertain",
            "several of this record's calls are uncertain: retry (sends them again) or cancel",
        )),
        _ => Err((
            "nothing_uncertain",
            "this record's step has no call whose outcome is uncertain",
        )),
    }
}

/// Whether `run` still waits on a call whose outcome is uncertain (no job
/// came of it, and the step has not ended).
pub fn open_uncertain(run: &StepRun) -> bool {
    run.job_id.is_none()
        && run.error_code.as_deref() == Some(OUTCOME_UNCERTAIN)
        && !matches!(
            run.state,
            StepState::Succeeded | StepState::Failed | StepState::Skipped
        )
}
