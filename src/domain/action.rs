//! What an operator's action does to a record, decided as a value: the
//! checks an action must pass against the record as it stands (under its
//! lock), the state it moves to, the audit entry's detail, and the change
//! to its steps. The store locks the record, asks [`plan`], and applies
//! the answer.

use serde_json::{Value, json};

use super::park::ParkUntil;
use super::{
    OUTCOME_UNCERTAIN, OperatorAction, Record, RecordState, StepRun, StepState, TransitionError,
    Trigger, UnixMs, json_has_nul, transition,
};

/// An operator's action on one record.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionRequest {
    pub record_id: i64,
    pub action: OperatorAction,
    pub actor: String,
    pub reason: Option<String>,
    pub now: UnixMs,
    /// For `ReplayFrom`: the chosen step followed by every step downstream of
    /// it (the caller knows the pipeline graph). Ignored otherwise.
    pub steps: Vec<String>,
    /// For `Park`: when the record resumes by itself (`None`: a human
    /// decides). Refused with any other action.
    pub until: Option<ParkUntil>,
    /// For `TookEffect`: what the call of the step named in `steps` did,
    /// as the operator found it at the provider.
    pub took: Option<Took>,
    /// For `Retry` and `ReplayFrom`: the record's input from now on (the
    /// audit entry keeps the old and the new). Refused with any other
    /// action.
    pub input: Option<InputEdit>,
    /// For `ReplayFrom`: the pipeline version the record runs on from now
    /// (an operator replaying it on the current one; the audit entry keeps
    /// the old and the new); `None` keeps its own. Refused with any other
    /// action.
    pub repin: Option<i64>,
}

impl ActionRequest {
    /// `action` on record `record_id` by `actor` at `now`, with nothing
    /// else (no steps, condition, outputs, input or version).
    pub fn new(
        record_id: i64,
        action: OperatorAction,
        actor: &str,
        reason: Option<String>,
        now: UnixMs,
    ) -> Self {
        ActionRequest {
            record_id,
            action,
            actor: actor.to_owned(),
            reason,
            now,
            steps: Vec::new(),
            until: None,
            took: None,
            input: None,
            repin: None,
        }
    }
}

/// A record's input replaced by an operator's retry or replay.
#[derive(Debug, Clone, PartialEq)]
pub struct InputEdit {
    pub new: serde_json::Value,
    /// The input the operator saw and edited: refused when the record's
    /// is no longer that (someone else changed it meanwhile). `None`: no
    /// check (the API, which names the new input outright).
    pub was: Option<serde_json::Value>,
}

/// What a call whose outcome was not known did, as an operator found it at
/// the provider (`TookEffect`).
#[derive(Debug, Clone, PartialEq)]
pub enum Took {
    /// A job step's submit made this job: the step follows it.
    Job(String),
    /// A request step's call took effect: the step succeeds with these
    /// outputs (an object of the step's output names), its confirmation
    /// scheduled if it has one.
    Output {
        output: serde_json::Value,
        confirm: Option<super::confirm::Pending>,
    },
}

/// Why an action was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The transition table does not allow it from the record's state.
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// The request does not fit the action or the record.
    #[error("{0}")]
    Invalid(String),
}

/// What an action does to a record's steps.
#[derive(Debug, Clone, PartialEq)]
pub enum StepChange {
    /// None.
    Keep,
    /// A fresh attempt budget for every unfinished step; reversed results
    /// (with the steps after them the request names), and with a new
    /// input every unfinished step, run again under a new generation.
    FreshStart { new_input: bool, cause: String },
    /// These steps run again, a new generation.
    RunAgain { steps: Vec<String>, cause: String },
    /// Reversed results are accepted: no longer marked to run again.
    AcceptReversed,
    /// The uncertain call of `step` made this job: the step follows it.
    TookJob {
        step: String,
        job: String,
        reason: String,
    },
    /// The uncertain call of `step` took effect with these outputs.
    TookOutput {
        step: String,
        output: Value,
        confirm: Option<super::confirm::Pending>,
        reason: String,
    },
}

/// An action, decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub to: RecordState,
    /// When the record is due next (`None`: not scheduled).
    pub next_run_at: Option<UnixMs>,
    /// The error code it keeps (parking and cancelling keep the last one
    /// for filtering; moving on clears it).
    pub error_code: Option<String>,
    /// The condition it is parked until.
    pub until: Option<ParkUntil>,
    /// Its new input, when the action replaces it.
    pub input: Option<Value>,
    pub steps: StepChange,
    /// The pipeline version it runs on from now.
    pub repin: Option<i64>,
    /// The audit entry's step and detail.
    pub event_step: Option<String>,
    pub detail: Option<Value>,
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
        super::SYSTEM_ACTOR,
        Some(reason),
        now,
    );
    Some((request, until))
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
    let parked_on = |r: &StepRun| rec.step.as_deref() == Some(r.step.as_str());
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

/// What can be refused before the record is read: a reason the database
/// cannot store, a replay that names no step.
pub fn check_request(req: &ActionRequest) -> Result<(), Refused> {
    if req.reason.as_deref().is_some_and(|r| r.contains('\0')) {
        return invalid("a NUL character (\\u0000) in the reason".into());
    }
    if req.action == OperatorAction::ReplayFrom && req.steps.is_empty() {
        return invalid("replay needs the step to replay from".into());
    }
    Ok(())
}

/// Decides `req` on `rec` (locked by the caller); `condition`: the one
/// that held, when the system resumes a record parked until it.
pub fn plan(
    rec: &Record,
    req: &ActionRequest,
    condition: Option<&ParkUntil>,
) -> Result<Plan, Refused> {
    let action = req.action;
    if req.repin.is_some() && action != OperatorAction::ReplayFrom {
        return invalid(format!(
            "only a replay moves a record to another pipeline version, not {action}"
        ));
    }
    if let Some(until) = &req.until {
        if action != OperatorAction::Park {
            return invalid(format!("only parking takes a condition, not {action}"));
        }
        super::park::check(until, req.now).map_err(Refused::Invalid)?;
    }
    let to = transition(rec.state, Trigger::Operator(action))?;
    let input = new_input(rec, req)?;
    let steps = step_change(rec, req, input.is_some())?;
    let detail = with_input(detail(rec, req, condition), input.as_ref(), rec);
    Ok(Plan {
        to,
        next_run_at: to.is_scheduled().then_some(req.now),
        error_code: match to {
            RecordState::Parked | RecordState::Cancelled => rec.error_code.clone(),
            _ => None,
        },
        until: req.until.clone().filter(|_| to == RecordState::Parked),
        input,
        steps,
        repin: req.repin,
        event_step: (action == OperatorAction::ReplayFrom)
            .then(|| req.steps.first().cloned())
            .flatten(),
        detail,
    })
}

fn invalid<T>(why: String) -> Result<T, Refused> {
    Err(Refused::Invalid(why))
}

/// The input a retry or replay gives, checked against the one the
/// operator saw; `None` when there is no change.
fn new_input(rec: &Record, req: &ActionRequest) -> Result<Option<Value>, Refused> {
    let Some(edit) = &req.input else {
        return Ok(None);
    };
    if !matches!(
        req.action,
        OperatorAction::Retry | OperatorAction::ReplayFrom
    ) {
        return invalid(format!(
            "only a retry or a replay takes a new input, not {}",
            req.action
        ));
    }
    if json_has_nul(&edit.new) {
        return invalid("a NUL character (\\u0000) in the input".into());
    }
    if edit.was.as_ref().is_some_and(|was| *was != rec.input) {
        return invalid(
            "the record's input changed since the page showed it (another operator's \
             edit?): nothing was done; reload the record and edit again"
                .into(),
        );
    }
    Ok((edit.new != rec.input).then(|| edit.new.clone()))
}

/// What the action does to the record's steps.
fn step_change(rec: &Record, req: &ActionRequest, new_input: bool) -> Result<StepChange, Refused> {
    Ok(match req.action {
        OperatorAction::Retry => StepChange::FreshStart {
            new_input,
            cause: if new_input {
                format!("retry with a new input by {}", req.actor)
            } else {
                format!("retry by {}", req.actor)
            },
        },
        OperatorAction::ReplayFrom => StepChange::RunAgain {
            steps: req.steps.clone(),
            cause: format!("replay by {}", req.actor),
        },
        // A resume accepts a reversed result: it is no longer marked for
        // a retry to run again.
        OperatorAction::Resume => StepChange::AcceptReversed,
        OperatorAction::TookEffect => took_effect(rec, req)?,
        OperatorAction::Park | OperatorAction::Cancel => StepChange::Keep,
    })
}

/// `TookEffect`: an operator checked with the provider, and the call
/// whose outcome was not known made this job, or took effect with these
/// outputs.
fn took_effect(rec: &Record, req: &ActionRequest) -> Result<StepChange, Refused> {
    let (Some(step), Some(took)) = (req.steps.first(), req.took.as_ref()) else {
        return invalid("`took_effect` needs the step and what the provider made".into());
    };
    if rec.step.as_deref() != Some(step.as_str())
        || rec.error_code.as_deref() != Some(OUTCOME_UNCERTAIN)
    {
        return invalid(format!(
            "the record does not wait on step `{step}`'s uncertain call"
        ));
    }
    let step = step.clone();
    match took {
        Took::Job(job) => {
            if job.contains('\0') {
                return invalid("a NUL character (\\u0000) in the job id".into());
            }
            if job.trim().is_empty() || job.len() > 200 {
                return invalid("give the provider's job id (1 to 200 characters)".into());
            }
            let job = job.trim().to_owned();
            let reason = format!("the call took effect: job {job} (by {})", req.actor);
            Ok(StepChange::TookJob { step, job, reason })
        }
        Took::Output { output, confirm } => {
            if !output.is_object() {
                return invalid("give the step's outputs as a JSON object".into());
            }
            if json_has_nul(output) {
                return invalid("the outputs contain a NUL character".into());
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

/// The audit entry's detail, before any input change.
fn detail(rec: &Record, req: &ActionRequest, condition: Option<&ParkUntil>) -> Option<Value> {
    let first = req.steps.first();
    match (req.action, &req.until) {
        (OperatorAction::ReplayFrom, _) => Some(match req.repin {
            Some(to) => json!({
                "steps": req.steps,
                "version": { "from": rec.pipeline_version, "to": to },
            }),
            None => json!({ "steps": req.steps }),
        }),
        (OperatorAction::Retry, _) if !req.steps.is_empty() => Some(json!({ "steps": req.steps })),
        (OperatorAction::Park, Some(until)) => Some(until.detail()),
        (OperatorAction::Resume, _) => condition.map(ParkUntil::detail),
        (OperatorAction::TookEffect, _) => Some(match &req.took {
            Some(Took::Output { output, .. }) => json!({ "step": first, "output": output }),
            Some(Took::Job(job)) => json!({ "step": first, "job_id": job }),
            None => json!({ "step": first }),
        }),
        _ => None,
    }
}

/// The detail with the input an operator changed, old and new, beside
/// the rest.
fn with_input(detail: Option<Value>, input: Option<&Value>, rec: &Record) -> Option<Value> {
    let Some(new) = input else {
        return detail;
    };
    let change = json!({ "old": rec.input, "new": new });
    match detail {
        Some(Value::Object(mut d)) => {
            d.insert("input".into(), change);
            Some(Value::Object(d))
        }
        _ => Some(json!({ "input": change })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: RecordState) -> Record {
        Record {
            id: 7,
            pipeline: "p".into(),
            pipeline_version: Some(1),
            external_key: None,
            group: None,
            state,
            input: json!({ "a": 1 }),
            next_run_at: None,
            lease_owner: None,
            lease_until: None,
            lease_token: 0,
            step: Some("charge".into()),
            provider: None,
            error_code: Some(OUTCOME_UNCERTAIN.into()),
            reason: None,
            created_at: 0,
            updated_at: 0,
            finished_at: None,
            park_until: None,
        }
    }

    fn request(action: OperatorAction) -> ActionRequest {
        ActionRequest::new(7, action, "ann", None, 1_000)
    }

    fn refusal(r: Result<Plan, Refused>) -> String {
        match r {
            Err(Refused::Invalid(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn parking_keeps_the_error_code_and_moving_on_clears_it() {
        let parked = plan(
            &record(RecordState::Retrying),
            &request(OperatorAction::Park),
            None,
        );
        let parked = parked.unwrap();
        assert_eq!(parked.to, RecordState::Parked);
        assert_eq!(parked.error_code.as_deref(), Some(OUTCOME_UNCERTAIN));
        assert_eq!(
            (parked.next_run_at, &parked.steps),
            (None, &StepChange::Keep)
        );
        let retried = plan(
            &record(RecordState::Parked),
            &request(OperatorAction::Retry),
            None,
        );
        let retried = retried.unwrap();
        assert_eq!(
            (retried.to, retried.error_code),
            (RecordState::Pending, None)
        );
        assert_eq!(retried.next_run_at, Some(1_000));
    }

    #[test]
    fn options_that_belong_to_another_action_are_refused() {
        let mut req = request(OperatorAction::Retry);
        req.repin = Some(2);
        let why = refusal(plan(&record(RecordState::Parked), &req, None));
        assert!(why.contains("only a replay"), "{why}");
        let mut req = request(OperatorAction::Cancel);
        req.input = Some(InputEdit {
            new: json!({}),
            was: None,
        });
        let why = refusal(plan(&record(RecordState::Parked), &req, None));
        assert!(why.contains("only a retry or a replay"), "{why}");
        let mut req = request(OperatorAction::ReplayFrom);
        assert!(check_request(&req).is_err(), "a replay names its step");
        req.steps = vec!["charge".into()];
        assert!(check_request(&req).is_ok());
    }

    #[test]
    fn an_input_edited_from_a_stale_page_is_refused_and_a_new_one_is_audited() {
        let rec = record(RecordState::Parked);
        let mut req = request(OperatorAction::Retry);
        req.input = Some(InputEdit {
            new: json!({ "a": 2 }),
            was: Some(json!({ "a": 0 })),
        });
        assert!(refusal(plan(&rec, &req, None)).contains("changed since the page"));
        req.input = Some(InputEdit {
            new: json!({ "a": 2 }),
            was: Some(json!({ "a": 1 })),
        });
        let p = plan(&rec, &req, None).unwrap();
        assert_eq!(p.input, Some(json!({ "a": 2 })));
        assert_eq!(
            p.detail,
            Some(json!({ "input": { "old": { "a": 1 }, "new": { "a": 2 } } }))
        );
        assert!(matches!(
            p.steps,
            StepChange::FreshStart {
                new_input: true,
                ..
            }
        ));
        req.input = Some(InputEdit {
            new: json!({ "a": 1 }),
            was: None,
        });
        let same = plan(&rec, &req, None).unwrap();
        assert_eq!(
            (same.input, same.detail),
            (None, None),
            "the same input is no change"
        );
    }

    #[test]
    fn took_effect_needs_the_uncertain_step_and_a_sound_answer() {
        let rec = record(RecordState::Parked);
        let mut req = request(OperatorAction::TookEffect);
        req.steps = vec!["ship".into()];
        req.took = Some(Took::Job("j-1".into()));
        assert!(refusal(plan(&rec, &req, None)).contains("does not wait on step `ship`"));
        req.steps = vec!["charge".into()];
        req.took = Some(Took::Job("  ".into()));
        assert!(refusal(plan(&rec, &req, None)).contains("1 to 200"));
        req.took = Some(Took::Output {
            output: json!([1]),
            confirm: None,
        });
        assert!(refusal(plan(&rec, &req, None)).contains("JSON object"));
        req.took = Some(Took::Job(" j-1 ".into()));
        let p = plan(&rec, &req, None).unwrap();
        assert_eq!(p.to, RecordState::Pending);
        assert!(matches!(&p.steps, StepChange::TookJob { job, .. } if job == "j-1"));
    }
}
