//! What an operator's action does to a record, decided as a value. Each
//! action is one module here (its options, whether it is offered, what it
//! does to the steps, its audit detail), answering [`Rules`]; [`rules`] is
//! the registry, one line each. The shared frame (the transition table,
//! options an action does not take, the input an operator edited) is
//! [`plan`]. The store locks the record, asks [`plan`], and applies the
//! answer; the pages, the API and the CLI ask [`offered`], [`check_command`]
//! and [`bulk::takes`] what they may offer and send. Every refusal carries a
//! stable code.

mod bulk;
mod cancel;
mod decide;
mod park;
mod replay;
mod resume;
mod retry;
mod signal;
mod took_effect;
mod undo;
mod wake;

use serde_json::{Value, json};

use super::park::ParkUntil;
use super::{
    OperatorAction, Record, RecordState, StepRun, TransitionError, Trigger, UnixMs, json_has_nul,
    transition,
};

pub use bulk::{BULK_NEEDS_REASON, in_bulk};
pub use resume::resume_due;
pub use signal::Signalled;
pub use took_effect::{Took, open_uncertain, uncertain_call};

/// What one action decides: one implementation per module.
trait Rules: Sync {
    /// How the action's refusals name it ("a retry", "parking").
    fn noun(&self) -> &'static str;

    /// The options a request of it may carry besides a reason.
    fn takes(&self) -> Takes {
        Takes::default()
    }

    /// Whether an operator must say why.
    fn needs_reason(&self) -> bool {
        false
    }

    /// Refused through the plain action command (it has one of its own),
    /// with why.
    fn own_command(&self) -> Option<&'static str> {
        None
    }

    /// Checked before the record is read.
    fn check(&self, _req: &ActionRequest) -> Result<(), Refused> {
        Ok(())
    }

    /// Offered on `rec` (which the transition table lets it leave by this
    /// action), given what else is known of it.
    fn offered(&self, _rec: &Record, _facts: &Facts) -> bool {
        true
    }

    /// Taken on `rec` as one of many (a bulk action).
    fn in_bulk(&self, _rec: &Record) -> bool {
        true
    }

    /// What it does to the record's steps (`runs`: as they stand, under
    /// the record's lock; `new_input`: the request changes the input):
    /// nothing, unless it says.
    fn steps(
        &self,
        _rec: &Record,
        _runs: &[StepRun],
        _req: &ActionRequest,
        _new_input: bool,
    ) -> Result<StepChange, Refused> {
        Ok(StepChange::Keep)
    }

    /// The audit entry's detail, before any input change; `condition`:
    /// the one that held, for the system's resume.
    fn detail(
        &self,
        _rec: &Record,
        _req: &ActionRequest,
        _condition: Option<&ParkUntil>,
    ) -> Option<Value> {
        None
    }

    /// The audit entry's step.
    fn event_step(&self, _req: &ActionRequest) -> Option<String> {
        None
    }
}

/// The registry: every action's rules, one line each.
fn rules(action: OperatorAction) -> &'static dyn Rules {
    match action {
        OperatorAction::Retry => &retry::Retry,
        OperatorAction::Park => &park::Park,
        OperatorAction::Resume => &resume::Resume,
        OperatorAction::Cancel => &cancel::Cancel,
        OperatorAction::ReplayFrom => &replay::Replay,
        OperatorAction::TookEffect => &took_effect::TookEffect,
        OperatorAction::Wake => &wake::Wake,
        OperatorAction::Approve => &decide::Decide(super::awaiting::Decision::Approved),
        OperatorAction::Reject => &decide::Decide(super::awaiting::Decision::Rejected),
        OperatorAction::Signal => &signal::Signal,
        OperatorAction::Undo => &undo::Undo,
    }
}

/// Options of a request beyond its reason.
#[derive(Debug, Clone, Copy, Default)]
struct Takes {
    /// A new input (`ActionRequest::input`).
    input: bool,
    /// A resume condition (`ActionRequest::until`).
    until: bool,
    /// Another pipeline version (`ActionRequest::repin`).
    repin: bool,
    /// Only the items of a step for each item that did not succeed
    /// (`ActionRequest::failed_items`).
    failed_items: bool,
}

/// "a retry or a replay": the actions that take an option.
fn takers(takes: impl Fn(Takes) -> bool) -> String {
    let nouns: Vec<&str> = OperatorAction::ALL
        .into_iter()
        .map(rules)
        .filter(|r| takes(r.takes()))
        .map(|r| r.noun())
        .collect();
    nouns.join(" or ")
}

/// An operator's action on one record.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionRequest {
    pub record_id: i64,
    pub action: OperatorAction,
    pub actor: String,
    pub reason: Option<String>,
    pub now: UnixMs,
    /// For `ReplayFrom`: the chosen step followed by every step downstream of
    /// it (the caller knows the pipeline graph). For `TookEffect`: the step.
    /// Ignored otherwise.
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
    /// For `Signal`: its body and id (the step is the one `steps` names).
    pub signal: Option<Signalled>,
    /// For `ReplayFrom`: the pipeline version the record runs on from now
    /// (an operator replaying it on the current one; the audit entry keeps
    /// the old and the new); `None` keeps its own. Refused with any other
    /// action.
    pub repin: Option<i64>,
    /// For `ReplayFrom`: the step it starts from (a step for each item)
    /// keeps its items that succeeded, and runs again only the others,
    /// each a new generation. Refused with any other action.
    pub failed_items: bool,
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
            signal: None,
            repin: None,
            failed_items: false,
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

/// Why an action was refused: always with a stable code.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The transition table does not allow it from the record's state.
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// The request does not fit the action or the record.
    #[error("{message}")]
    Invalid { code: &'static str, message: String },
}

impl Refused {
    /// The stable code the API and the pages show.
    pub fn code(&self) -> &'static str {
        match self {
            Refused::Transition(t) => t.code(),
            Refused::Invalid { code, .. } => code,
        }
    }
}

fn invalid<T>(code: &'static str, message: impl Into<String>) -> Result<T, Refused> {
    Err(Refused::Invalid {
        code,
        message: message.into(),
    })
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
    /// These steps run again, a new generation; with `keep_items`, the
    /// first (a step for each item) keeps its items that succeeded and
    /// only the others run again.
    RunAgain {
        steps: Vec<String>,
        cause: String,
        keep_items: bool,
    },
    /// Reversed results are accepted: no longer marked to run again.
    AcceptReversed,
    /// The uncertain call of `step` made this job: the step follows it.
    TookJob {
        step: String,
        job: String,
        reason: String,
    },
    /// These steps, waiting on time alone, are due now: their wait ends
    /// (the kind decides at the next pass what that means).
    EndWait { steps: Vec<String>, reason: String },
    /// A step waiting for a decision or a signal has it: it succeeds with
    /// `output`, keeping `job_id` (a signal's id).
    Decide {
        step: String,
        output: Value,
        job_id: Option<String>,
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

/// What is known of a record beside its row when its page offers actions.
#[derive(Debug, Clone, Copy, Default)]
pub struct Facts<'a> {
    /// Its step runs.
    pub runs: &'a [StepRun],
    /// It waits on one call whose outcome is uncertain, which an operator
    /// may settle ([`uncertain_call`] found it).
    pub uncertain: bool,
    /// A step of it that succeeded has an undo call (`domain::undo`).
    pub undoable: bool,
}

/// The actions offered on `rec` as it stands: those the transition table
/// allows from its state and the action's own rules offer.
pub fn offered(rec: &Record, facts: &Facts) -> Vec<OperatorAction> {
    OperatorAction::ALL
        .into_iter()
        .filter(|a| transition(rec.state, Trigger::Operator(*a)).is_ok())
        .filter(|a| rules(*a).offered(rec, facts))
        .collect()
}

/// An action command as a page, the API or the CLI sends it, before the
/// record is read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Command {
    /// It gives a reason.
    pub reason: bool,
    /// It names a resume condition.
    pub until: bool,
    /// It asks to run on the current pipeline version.
    pub on_current: bool,
    /// It asks to run only the failed items of a step for each item.
    pub failed_items: bool,
}

/// Refuses a command whose options do not fit its action, or that lacks
/// what the action needs.
pub fn check_command(action: OperatorAction, c: &Command) -> Result<(), Refused> {
    let r = rules(action);
    if c.on_current && !r.takes().repin {
        let who = takers(|t| t.repin);
        return invalid(
            "current_needs_replay",
            format!("only {who} runs a record on the current version, not {action}"),
        );
    }
    if c.failed_items && !r.takes().failed_items {
        return items_need_replay(action);
    }
    if let Some(why) = r.own_command() {
        return invalid("details_required", why);
    }
    if r.needs_reason() && !c.reason {
        return invalid("reason_required", format!("{} needs a reason", r.noun()));
    }
    if c.until && !r.takes().until {
        let who = takers(|t| t.until);
        return invalid(
            "until_needs_park",
            format!("only {who} takes a resume condition (`until`), not {action}"),
        );
    }
    Ok(())
}

/// Only a replay runs only the failed items, not `action`.
fn items_need_replay<T>(action: OperatorAction) -> Result<T, Refused> {
    let who = takers(|t| t.failed_items);
    invalid(
        "items_need_replay",
        format!("only {who} runs only the failed items of a step, not {action}"),
    )
}

/// What can be refused before the record is read: a reason the database
/// cannot store, a request its action cannot read.
pub fn check_request(req: &ActionRequest) -> Result<(), Refused> {
    if req.reason.as_deref().is_some_and(|r| r.contains('\0')) {
        return invalid("invalid_request", "a NUL character (\\u0000) in the reason");
    }
    rules(req.action).check(req)
}

/// Decides `req` on `rec` (locked by the caller); `condition`: the one
/// that held, when the system resumes a record parked until it.
pub fn plan(
    rec: &Record,
    runs: &[StepRun],
    req: &ActionRequest,
    condition: Option<&ParkUntil>,
) -> Result<Plan, Refused> {
    let action = req.action;
    let r = rules(action);
    if req.repin.is_some() && !r.takes().repin {
        let who = takers(|t| t.repin);
        return invalid(
            "current_needs_replay",
            format!("only {who} moves a record to another pipeline version, not {action}"),
        );
    }
    if req.failed_items && !r.takes().failed_items {
        return items_need_replay(action);
    }
    if let Some(until) = &req.until {
        if !r.takes().until {
            let who = takers(|t| t.until);
            return invalid(
                "until_needs_park",
                format!("only {who} takes a condition, not {action}"),
            );
        }
        super::park::check(until, req.now).map_err(|e| Refused::Invalid {
            code: "bad_until",
            message: e,
        })?;
    }
    let to = transition(rec.state, Trigger::Operator(action))?;
    let input = new_input(rec, req, r)?;
    if req.failed_items && (input.is_some() || req.repin.is_some()) {
        // The items kept are those of the list as it was.
        return invalid(
            "items_need_same_list",
            "only the failed items of the same list: replay every item to run it with a new \
             input or on another version",
        );
    }
    let steps = r.steps(rec, runs, req, input.is_some())?;
    let detail = with_input(r.detail(rec, req, condition), input.as_ref(), rec);
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
        event_step: r.event_step(req),
        detail,
    })
}

/// The input a retry or replay gives, checked against the one the
/// operator saw; `None` when there is no change.
fn new_input(rec: &Record, req: &ActionRequest, r: &dyn Rules) -> Result<Option<Value>, Refused> {
    let Some(edit) = &req.input else {
        return Ok(None);
    };
    if !r.takes().input {
        let who = takers(|t| t.input);
        return invalid(
            "input_not_taken",
            format!("only {who} takes a new input, not {}", req.action),
        );
    }
    if json_has_nul(&edit.new) {
        return invalid("invalid_request", "a NUL character (\\u0000) in the input");
    }
    if edit.was.as_ref().is_some_and(|was| *was != rec.input) {
        return invalid(
            "input_changed",
            "the record's input changed since the page showed it (another operator's \
             edit?): nothing was done; reload the record and edit again",
        );
    }
    Ok((edit.new != rec.input).then(|| edit.new.clone()))
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
    use crate::domain::{OUTCOME_UNCERTAIN, StepState};

    fn record(state: RecordState) -> Record {
        Record {
            id: 7,
            pipeline_version: Some(1),
            input: json!({ "a": 1 }),
            step: Some("charge".into()),
            error_code: Some(OUTCOME_UNCERTAIN.into()),
            ..Record::sample(state)
        }
    }

    fn request(action: OperatorAction) -> ActionRequest {
        ActionRequest::new(7, action, "ann", None, 1_000)
    }

    fn refusal(r: Result<Plan, Refused>) -> String {
        match r {
            Err(Refused::Invalid { message, .. }) => message,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn parking_keeps_the_error_code_and_moving_on_clears_it() {
        let parked = plan(
            &record(RecordState::Retrying),
            &[],
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
            &[],
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
        let why = refusal(plan(&record(RecordState::Parked), &[], &req, None));
        assert!(why.contains("only a replay"), "{why}");
        let mut req = request(OperatorAction::Cancel);
        req.input = Some(InputEdit {
            new: json!({}),
            was: None,
        });
        let why = refusal(plan(&record(RecordState::Parked), &[], &req, None));
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
        assert!(refusal(plan(&rec, &[], &req, None)).contains("changed since the page"));
        req.input = Some(InputEdit {
            new: json!({ "a": 2 }),
            was: Some(json!({ "a": 1 })),
        });
        let p = plan(&rec, &[], &req, None).unwrap();
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
        let same = plan(&rec, &[], &req, None).unwrap();
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
        assert!(refusal(plan(&rec, &[], &req, None)).contains("does not wait on step `ship`"));
        req.steps = vec!["charge".into()];
        req.took = Some(Took::Job("  ".into()));
        assert!(refusal(plan(&rec, &[], &req, None)).contains("1 to 200"));
        req.took = Some(Took::Output {
            output: json!([1]),
            confirm: None,
        });
        assert!(refusal(plan(&rec, &[], &req, None)).contains("JSON object"));
        req.took = Some(Took::Job(" j-1 ".into()));
        let p = plan(&rec, &[], &req, None).unwrap();
        assert_eq!(p.to, RecordState::Pending);
        assert!(matches!(&p.steps, StepChange::TookJob { job, .. } if job == "j-1"));
    }

    #[test]
    fn what_is_offered_is_what_the_table_and_the_actions_allow() {
        let sleeping = StepRun {
            record_id: 7,
            step: "nap".into(),
            provider: None,
            state: StepState::Waiting,
            generation: 0,
            attempts: 0,
            unknowns: 0,
            idempotency_key: "k".into(),
            job_id: None,
            output: None,
            error_code: None,
            reason: Some("asleep until later".into()),
            next_run_at: Some(5_000),
            deadline_at: Some(5_000),
            started_at: Some(0),
            finished_at: None,
            updated_at: 0,
            cause: None,
        };
        let awaiting = |code: &str| StepRun {
            step: "review".into(),
            error_code: Some(code.into()),
            next_run_at: None,
            deadline_at: None,
            ..sleeping.clone()
        };
        use crate::domain::awaiting::Awaits;
        let cases = [
            (false, vec![], None),
            (true, vec![sleeping.clone()], None),
            (
                false,
                vec![awaiting("awaiting_approval")],
                Some(Awaits::Approval),
            ),
            (
                false,
                vec![awaiting("approval_timed_out")],
                Some(Awaits::Approval),
            ),
            (
                false,
                vec![awaiting("awaiting_signal")],
                Some(Awaits::Signal),
            ),
        ];
        for state in RecordState::ALL {
            let rec = record(state);
            for (uncertain, runs, awaits) in &cases {
                let (uncertain, runs) = (*uncertain, runs.as_slice());
                let offered = offered(
                    &rec,
                    &Facts {
                        runs,
                        uncertain,
                        undoable: false,
                    },
                );
                for action in OperatorAction::ALL {
                    use OperatorAction as A;
                    let by_table = transition(state, Trigger::Operator(action)).is_ok();
                    let own = match action {
                        A::TookEffect => uncertain,
                        A::Wake => !runs.is_empty() && awaits.is_none(),
                        // Not on a record parked for another reason.
                        A::Approve | A::Reject => {
                            *awaits == Some(Awaits::Approval) && state != RecordState::Parked
                        }
                        A::Signal => {
                            *awaits == Some(Awaits::Signal) && state != RecordState::Parked
                        }
                        // Offered only where a succeeded step has an undo.
                        A::Undo => false,
                        _ => true,
                    };
                    assert_eq!(
                        offered.contains(&action),
                        by_table && own,
                        "{action} from {state}, uncertain: {uncertain}, {awaits:?}"
                    );
                    let one_records = matches!(
                        action,
                        A::TookEffect | A::Approve | A::Reject | A::Signal | A::Undo
                    );
                    let parked_park = action == A::Park && state == RecordState::Parked;
                    assert_eq!(
                        in_bulk(action, &rec),
                        by_table && !one_records && !parked_park
                    );
                }
            }
        }
        // A wake ends the sleeping steps' wait, and nothing else's.
        let mut runs = vec![sleeping.clone()];
        runs.push(StepRun {
            job_id: Some("j-1".into()),
            ..sleeping.clone()
        });
        runs[1].step = "render".into();
        let req = request(OperatorAction::Wake);
        let p = plan(&record(RecordState::Waiting), &runs, &req, None).unwrap();
        assert_eq!(p.to, RecordState::Pending);
        assert!(matches!(&p.steps, StepChange::EndWait { steps, .. } if steps == &["nap"]));
        let none = plan(&record(RecordState::Waiting), &runs[1..], &req, None);
        assert_eq!(none.unwrap_err().code(), "nothing_asleep");
    }

    #[test]
    fn commands_are_refused_with_stable_codes() {
        let code = |action, c: Command| check_command(action, &c).map_err(|r| r.code());
        let none = Command::default();
        assert_eq!(code(OperatorAction::Park, none), Err("reason_required"));
        let reason = Command {
            reason: true,
            ..none
        };
        assert_eq!(code(OperatorAction::Park, reason), Ok(()));
        let until = Command {
            until: true,
            ..reason
        };
        assert_eq!(code(OperatorAction::Park, until), Ok(()));
        assert_eq!(code(OperatorAction::Retry, until), Err("until_needs_park"));
        let current = Command {
            on_current: true,
            ..none
        };
        assert_eq!(code(OperatorAction::ReplayFrom, current), Ok(()));
        assert_eq!(
            code(OperatorAction::Cancel, current),
            Err("current_needs_replay")
        );
        let failed_items = Command {
            failed_items: true,
            ..none
        };
        assert_eq!(code(OperatorAction::ReplayFrom, failed_items), Ok(()));
        assert_eq!(
            code(OperatorAction::Retry, failed_items),
            Err("items_need_replay")
        );
        assert_eq!(
            code(OperatorAction::TookEffect, reason),
            Err("details_required")
        );
        let refused = check_command(OperatorAction::Retry, &until).unwrap_err();
        assert!(
            refused.to_string().contains("only parking takes"),
            "{refused}"
        );
        let mut req = request(OperatorAction::Cancel);
        req.input = Some(InputEdit {
            new: json!({}),
            was: None,
        });
        let r = plan(&record(RecordState::Parked), &[], &req, None).unwrap_err();
        assert_eq!(r.code(), "input_not_taken");
        let r = plan(
            &record(RecordState::Succeeded),
            &[],
            &request(OperatorAction::Park),
            None,
        );
        assert_eq!(r.unwrap_err().code(), "transition_not_allowed");
    }

    #[test]
    fn an_undo_waits_for_an_uncertain_call_to_be_settled() {
        let mut rec = record(RecordState::Parked);
        rec.error_code = Some(crate::domain::OUTCOME_UNCERTAIN.into());
        let facts = Facts {
            runs: &[],
            uncertain: true,
            undoable: true,
        };
        assert!(!offered(&rec, &facts).contains(&OperatorAction::Undo));
        let mut req = request(OperatorAction::Undo);
        req.steps = vec!["undo:charge".into()];
        let refused = plan(&rec, &[], &req, None).unwrap_err();
        assert_eq!(refused.code(), "outcome_uncertain");
        rec.error_code = Some("attempts_exhausted".into());
        assert!(plan(&rec, &[], &req, None).is_ok());
        // Parked for another reason, with a call still uncertain: the
        // same; cancelled, the call can no longer be settled.
        let open = StepRun {
            record_id: 7,
            step: "render".into(),
            provider: Some("p".into()),
            state: StepState::Retrying,
            generation: 0,
            attempts: 1,
            unknowns: 0,
            idempotency_key: "k".into(),
            job_id: None,
            output: None,
            error_code: Some(crate::domain::OUTCOME_UNCERTAIN.into()),
            reason: None,
            next_run_at: Some(5_000),
            deadline_at: None,
            started_at: Some(0),
            finished_at: None,
            updated_at: 0,
            cause: None,
        };
        assert!(!offered(&rec, &facts).contains(&OperatorAction::Undo));
        let refused = plan(&rec, std::slice::from_ref(&open), &req, None).unwrap_err();
        assert_eq!(refused.code(), "outcome_uncertain");
        rec.state = RecordState::Cancelled;
        assert!(plan(&rec, &[open], &req, None).is_ok());
        let settled = Facts {
            uncertain: false,
            ..facts
        };
        rec.state = RecordState::Parked;
        assert!(offered(&rec, &settled).contains(&OperatorAction::Undo));
    }

    #[test]
    fn an_undo_is_offered_where_a_succeeded_step_has_one() {
        let facts = |undoable| Facts {
            runs: &[],
            uncertain: false,
            undoable,
        };
        for state in RecordState::ALL {
            let by_table = transition(state, Trigger::Operator(OperatorAction::Undo)).is_ok();
            // Parked for a reason other than an uncertain call.
            let mut rec = record(state);
            rec.error_code = Some("attempts_exhausted".into());
            let offered_with = offered(&rec, &facts(true));
            assert_eq!(
                offered_with.contains(&OperatorAction::Undo),
                by_table,
                "{state}"
            );
            let offered_without = offered(&record(state), &facts(false));
            assert!(!offered_without.contains(&OperatorAction::Undo));
        }
        assert!(
            transition(
                RecordState::Cancelled,
                Trigger::Operator(OperatorAction::Undo)
            )
            .is_ok()
        );
        assert!(
            transition(
                RecordState::Succeeded,
                Trigger::Operator(OperatorAction::Undo)
            )
            .is_err()
        );
    }
}
