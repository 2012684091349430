//! What a step pass decides, as pure functions over plain data: before the
//! call (wait, give up, apply deliveries, or call and whether that call is
//! a poll or a retry), after a reply (the step's new state, the attempt's
//! verdict, whether an attempt was spent, the next run, park or fail), and
//! for webhook deliveries. The engine gathers the inputs, calls these, and
//! carries the decision out; it decides nothing itself.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};

use super::backoff::Backoff;
use super::kind::Ready;
use super::pipeline::{Fallback, Step};
use super::rules::{Reply, Rule, classify};
use super::{Outcome, StepState, StepWrite, UnixMs};

/// How long past its deadline a job's last poll may still be made (it
/// waits for a provider pause, an open breaker, a free slot).
pub const LAST_POLL_GRACE_MS: i64 = 60_000;

/// A provider's retry settings, as the decisions need them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Calls per step (the first one included) before parking.
    pub max_attempts: u32,
    /// Replies no rule understood (calls and polls) before parking.
    pub unknown_attempts: u32,
    pub backoff: Backoff,
    /// Overall time for one step, from its first attempt.
    pub deadline: Duration,
}

/// A step's own retry settings; each one given replaces its provider's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RetryOverride {
    pub max_attempts: Option<u32>,
    pub unknown_attempts: Option<u32>,
    pub base: Option<Duration>,
    pub cap: Option<Duration>,
    pub deadline: Option<Duration>,
}

impl RetryOverride {
    /// `provider`'s policy with these settings in place.
    pub fn over(&self, provider: RetryPolicy) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.max_attempts.unwrap_or(provider.max_attempts),
            unknown_attempts: self.unknown_attempts.unwrap_or(provider.unknown_attempts),
            backoff: Backoff {
                base: self.base.unwrap_or(provider.backoff.base),
                cap: self.cap.unwrap_or(provider.backoff.cap),
            },
            deadline: self.deadline.unwrap_or(provider.deadline),
        }
    }
}

/// Why a required step parks its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Park {
    pub code: String,
    pub reason: String,
    /// When the record resumes by itself; `None`: a human decides.
    pub until: Option<super::park::ParkUntil>,
}

/// Whether a side-effecting call's reply leaves open whether it took
/// effect: the request went out and nothing says what became of it (a
/// timeout or a reset after it was sent, or a reply no rule understood).
/// A refused connection or a TLS failure sent nothing; a reply the rules
/// understood says what happened.
pub fn uncertain(reply: &Reply, outcome: Outcome) -> bool {
    use super::rules::ReplyError;
    matches!(
        reply,
        Reply::Failed(ReplyError::Timeout | ReplyError::Reset)
    ) || outcome == Outcome::Unknown
}

/// The step of an `at_most_once` call whose outcome is not known: never
/// sent again blindly. With a `lookup` it asks the provider at `ask_at`
/// (callers give a request the provider may still be working on a call's
/// timeout first); otherwise, at `now`, a required step parks its record
/// `outcome_uncertain` for a person, with `evidence` in the reason, and an
/// optional one fails alone.
pub fn uncertain_outcome(
    step: &Step,
    mut write: StepWrite,
    evidence: &str,
    (now, ask_at): (UnixMs, UnixMs),
) -> Decision {
    if step.lookup.is_some() && write.job_id.is_none() {
        write.state = StepState::Retrying;
        write.error_code = Some(super::OUTCOME_UNCERTAIN.into());
        write.reason = Some(format!(
            "the provider may have taken the call ({evidence}): asking it (lookup) instead of sending it again"
        ));
        write.next_run_at = Some(ask_at.max(now));
        return Decision::keep(write);
    }
    let reason = format!(
        "the provider may have taken the call ({evidence}); it is not sent again \
         (at_most_once): ask the provider, then mark it done or send it again"
    );
    park_or_fail(step, write, super::OUTCOME_UNCERTAIN, reason, now)
}

/// A call an earlier pass left open (its node stopped between writing it
/// down and keeping its reply), as attempt `attempt_no`: spent, and for an
/// `at_most_once` step (`guarded`) an outcome not known
/// ([`uncertain_outcome`]). A step no longer `at_most_once` (turned off
/// since) goes on as configured, sending its call again; the call stays in
/// its history either way.
pub fn left_open(
    step: &Step,
    mut write: StepWrite,
    attempt_no: i32,
    guarded: bool,
    evidence: &str,
    times: (UnixMs, UnixMs),
) -> Decision {
    write.attempts = write.attempts.max(attempt_no);
    if guarded {
        uncertain_outcome(step, write, evidence, times)
    } else {
        Decision::keep(write)
    }
}

/// The outputs an operator gives for a request step whose call took
/// effect (read at the provider): an object with exactly the step's
/// output names (`outputs`: name → pointer), none of them null or empty,
/// so the steps after it find what they read. None needed when the step
/// declares none.
pub fn took_outputs(
    outputs: &std::collections::BTreeMap<String, String>,
    given: Option<serde_json::Value>,
) -> Result<serde_json::Value, String> {
    let given = given.unwrap_or_else(|| serde_json::json!({}));
    let Some(object) = given.as_object() else {
        return Err(r#"give the outputs as a JSON object, e.g. {"charge_id": "ch_123"}"#.into());
    };
    let names = || outputs.keys().cloned().collect::<Vec<_>>().join(", ");
    if let Some(extra) = object.keys().find(|k| !outputs.contains_key(*k)) {
        return Err(format!("`{extra}` is not one of its outputs [{}]", names()));
    }
    let blank = |v: &serde_json::Value| match v {
        serde_json::Value::Null => true,
        serde_json::Value::String(s) => s.trim().is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.is_empty(),
        _ => false,
    };
    if let Some(missing) = outputs.keys().find(|k| object.get(*k).is_none_or(blank)) {
        return Err(format!(
            "give every output [{}] as the provider has it: `{missing}` is missing or empty",
            names()
        ));
    }
    if super::json_has_nul(&given) {
        return Err("the outputs contain a NUL character".into());
    }
    Ok(given)
}

/// The error code of a record parked while its provider's breaker is open
/// (`on_outage = "park_until_healthy"`).
pub const PROVIDER_OUTAGE: &str = "provider_outage";

/// A step its provider's open breaker stops until `until`: deferred to
/// then (`defer`), or, with `park_until_healthy`, its record parked until
/// the provider takes calls again (the step due at `until`, so that it
/// runs as soon as the record resumes). No attempt is spent either way.
pub fn outage(
    write: StepWrite,
    policy: super::park::OutagePolicy,
    provider: &str,
    until: UnixMs,
    why: &str,
    now: UnixMs,
) -> Decision {
    let write = defer(write, until, why, now);
    let park = match policy {
        super::park::OutagePolicy::Defer => None,
        super::park::OutagePolicy::ParkUntilHealthy => Some(Park {
            code: PROVIDER_OUTAGE.into(),
            reason: format!("{why}: parked until provider `{provider}` is healthy"),
            until: Some(super::park::ParkUntil::Provider {
                provider: provider.to_owned(),
            }),
        }),
    };
    Decision { write, park }
}

/// A step's new state, and whether it parks the record.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub write: StepWrite,
    pub park: Option<Park>,
}

impl Decision {
    pub fn keep(write: StepWrite) -> Self {
        Decision { write, park: None }
    }
}

/// What a step pass does, decided before any gate or call.
#[derive(Debug, Clone, PartialEq)]
pub enum Before {
    /// No call: the step's new state is decided (a wait, or giving up).
    Settled(Decision),
    /// Deliveries wait for this callback step: apply them, no call.
    Deliveries,
    /// Call the provider.
    Call(Planned),
}

/// A call to make, once the gates let it through.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// The step's state before the call (its clock started).
    pub write: StepWrite,
    /// The call asks about a submitted job (spends no attempt).
    pub polling: bool,
    /// The call repeats a failed one (it draws on the retry budget).
    pub is_retry: bool,
    /// The call asks whether an earlier call whose outcome is not known
    /// took effect (`lookup`; spends no attempt, as a poll).
    pub lookup: bool,
}

/// What the reply said, as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplyFacts<'a> {
    pub outcome: Outcome,
    pub error_code: Option<&'a str>,
    pub json: Option<&'a Value>,
    pub http_status: Option<u16>,
    pub retry_after: Option<Duration>,
}

/// How the reply moves the provider's retry budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetMove {
    None,
    RetrySucceeded,
    RetryFailed,
}

/// The decision on a reply, and the attempt's verdict for the history.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    pub decision: Decision,
    /// The attempt's outcome: the rules' verdict, or `unknown` when a
    /// success lacked what the step needs (`job_id_missing`, `output_missing`).
    pub outcome: Outcome,
    pub error_code: Option<String>,
    pub budget: BudgetMove,
}

pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// Records a step that cannot go on: a required step parks its record with
/// `code` and `reason`; an optional one fails alone and the record goes on.
pub fn park_or_fail(
    step: &Step,
    mut write: StepWrite,
    code: &str,
    reason: String,
    now: UnixMs,
) -> Decision {
    write.error_code = Some(code.to_owned());
    write.reason = Some(reason.clone());
    write.next_run_at = None;
    let park = if step.required {
        Some(Park {
            code: code.to_owned(),
            reason,
            until: None,
        })
    } else {
        write.state = StepState::Failed;
        write.finished_at = Some(now);
        None
    };
    Decision { write, park }
}

/// Defers the step to `at` (never before `now + 1`, never past a deadline
/// still ahead, where the step gives up or makes its last poll) without
/// spending an attempt: the provider is paused, busy, limited or open, or
/// the node is stopping.
pub fn defer(mut write: StepWrite, at: UnixMs, why: &str, now: UnixMs) -> StepWrite {
    let at = match write.deadline_at {
        Some(d) if d > now => at.min(d),
        _ => at,
    };
    write.next_run_at = Some(at.max(now + 1));
    write.reason = Some(why.to_owned());
    write
}

/// When a callback step stops waiting for deliveries: its deadline, less
/// the polling time that follows it when the fallback is to poll.
pub fn callback_due(step: &Step, write: &StepWrite) -> Option<UnixMs> {
    let cb = step.callback()?;
    let poll_extra = match &cb.fallback {
        Fallback::Poll(p) => ms(p.deadline),
        Fallback::Park => 0,
    };
    write.deadline_at.map(|d| d - poll_extra)
}

/// Decides what a pass over a ready step does before any gate: a callback
/// step with a job waits for its deliveries (or applies them, or gives up
/// at its deadline); a step's clock starts on its first pass; a step past
/// its deadline gives up, except a job, which gets one last poll within
/// [`LAST_POLL_GRACE_MS`] that then decides.
pub fn before_call(
    step: &Step,
    write: &StepWrite,
    provider: &str,
    has_deliveries: bool,
    policy: &RetryPolicy,
    now: UnixMs,
) -> Before {
    let polling = match step.kind.ready(step, write, has_deliveries, now) {
        Ready::Call { polling } => polling,
        Ready::Done(before) => return *before,
    };
    let mut w = write.clone();
    w.provider = Some(provider.to_owned());
    if w.started_at.is_none() {
        w.started_at = Some(now);
    }
    // A step's time starts on its first pass, and again after an operator's
    // retry (which clears the deadline): no step runs without a deadline.
    if w.deadline_at.is_none() {
        w.deadline_at = Some(now + ms(policy.deadline));
    }
    // A job may have finished while the node could not ask (a pause, an
    // open breaker, the database away): its last poll decides. Only when
    // that poll cannot be made within the grace does the step give up.
    if let Some(d) = w.deadline_at.filter(|d| now >= *d) {
        // A lookup that could not tell in time leaves the call uncertain:
        // a person decides, never a blind resend.
        if looking_up(step, &w) {
            let reason =
                "deadline passed: no lookup could tell whether the call took effect".into();
            return Before::Settled(park_or_fail(step, w, super::OUTCOME_UNCERTAIN, reason, now));
        }
        if !polling || now >= d + LAST_POLL_GRACE_MS {
            let what = if polling {
                "the job did not finish within its deadline, and no last poll could be made"
            } else {
                "the step did not succeed within its deadline"
            };
            let reason = format!("deadline passed: {what}");
            return Before::Settled(park_or_fail(step, w, "deadline_passed", reason, now));
        }
    }
    // A call whose outcome is not known is looked up, not sent again.
    let lookup = looking_up(step, &w);
    let polling = polling || lookup;
    let is_retry = !polling && w.attempts > 0;
    Before::Call(Planned {
        write: w,
        polling,
        is_retry,
        lookup,
    })
}

/// Whether the step's next call asks the provider, by its `lookup`,
/// whether an earlier call took effect: its outcome is not known and no
/// job was seen.
pub fn looking_up(step: &Step, w: &StepWrite) -> bool {
    step.lookup.is_some()
        && w.job_id.is_none()
        && w.error_code.as_deref() == Some(super::OUTCOME_UNCERTAIN)
}

/// What a lookup's reply says: the job it found (the call took effect:
/// the step follows that job, nothing sent again), that there is none (a
/// 2xx without it: the call did not take effect, so it is sent again now),
/// or nothing clear (asked again after the backoff; the step's deadline
/// bounds it).
pub fn after_lookup(
    step: &Step,
    plan: Planned,
    reply: &ReplyFacts<'_>,
    policy: &RetryPolicy,
    after: UnixMs,
    jitter: f64,
) -> Judged {
    let mut w = plan.write;
    // A 2xx the rules do not call a throttle, a retry or a refusal.
    let answered = reply.http_status.is_some_and(|s| (200..300).contains(&s))
        && reply.json.is_some()
        && !matches!(
            reply.outcome,
            Outcome::Throttled | Outcome::Retry | Outcome::Fail
        );
    let looked = match (step.lookup.as_ref(), reply.json) {
        (Some(l), Some(json)) if answered => look_up(json, &l.job_id),
        _ => Looked::Unclear,
    };
    match looked {
        Looked::Found(id) => {
            let mut w = submitted(step, w, id.clone(), after);
            w.reason = Some(format!(
                "the call took effect: the provider has job {id} (lookup)"
            ));
            judged(
                Decision::keep(w),
                Outcome::Success,
                Some("lookup_found".into()),
                BudgetMove::None,
            )
        }
        Looked::Absent if w.attempts >= i32::try_from(policy.max_attempts).unwrap_or(i32::MAX) => {
            // Not taken, but the attempts are spent: bounded as any retry.
            let reason = format!(
                "attempts exhausted ({} of {}); the last call did not take effect (lookup found nothing)",
                w.attempts, policy.max_attempts
            );
            let d = park_or_fail(step, w, "attempts_exhausted", reason, after);
            judged(
                d,
                Outcome::Success,
                Some("lookup_not_found".into()),
                BudgetMove::None,
            )
        }
        Looked::Absent => {
            w.state = StepState::Retrying;
            w.error_code = None;
            w.reason = Some(
                "the call did not take effect (lookup found nothing): sending it again".into(),
            );
            w.next_run_at = Some(after);
            judged(
                Decision::keep(w),
                Outcome::Success,
                Some("lookup_not_found".into()),
                BudgetMove::None,
            )
        }
        Looked::Unclear => {
            w.unknowns += 1;
            let wait = policy.backoff.delay(w.unknowns.max(1) as u32, jitter);
            w.next_run_at = Some(after + ms(wait));
            w.reason = Some(format!(
                "asking the provider whether the call took effect: the lookup got no clear answer ({})",
                reply
                    .error_code
                    .map(str::to_owned)
                    .or_else(|| reply.http_status.map(|s| format!("HTTP {s}")))
                    .unwrap_or_else(|| "no status".into())
            ));
            let outcome = if reply.outcome == Outcome::Throttled {
                Outcome::Throttled
            } else {
                Outcome::Retry
            };
            judged(
                Decision::keep(w),
                outcome,
                reply.error_code.map(str::to_owned),
                BudgetMove::None,
            )
        }
    }
}

/// A request that cannot be built (a template that does not render, a
/// path leaving the provider's base URL, a header value with a line
/// break) will not build next time: the step fails with `code`
/// (`template_error`, `request_invalid`) and the reason (a required step
/// fails its record). Nothing was sent, so no attempt is spent.
pub fn unbuildable(mut write: StepWrite, code: &str, error: String, now: UnixMs) -> Decision {
    write.state = StepState::Failed;
    write.finished_at = Some(now);
    write.error_code = Some(code.into());
    write.reason = Some(error);
    write.next_run_at = None;
    Decision::keep(write)
}

/// The call is about to leave: a call (not a poll) spends an attempt.
pub fn spend_attempt(plan: &mut Planned) {
    if !plan.polling {
        plan.write.attempts += 1;
    }
}

/// Takes every declared output from `json`; `Err` names the first missing.
pub fn extract_outputs(
    outputs: &BTreeMap<String, String>,
    json: Option<&Value>,
) -> Result<Value, String> {
    let mut out = Map::new();
    for (name, pointer) in outputs {
        let v = json
            .and_then(|j| super::pointer::get(j, pointer))
            .ok_or_else(|| name.clone())?;
        out.insert(name.clone(), v.clone());
    }
    Ok(Value::Object(out))
}

/// The job id at `pointer` in a submit reply, as text.
pub fn job_id_in(json: Option<&Value>, pointer: &str) -> Option<String> {
    json.and_then(|j| super::pointer::get(j, pointer))
        .map(|id| match id {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
}

/// What a lookup's reply says at its `job_id` pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Looked {
    /// The provider has this job for the call.
    Found(String),
    /// Clearly none: the pointer runs past the end of a list (`/data/0/id`
    /// in `{"data": []}`), or reaches a null or an empty id by the keys of
    /// the reply's object (`/job/id` in `{"job": null}`).
    Absent,
    /// The reply lacks the shape the pointer expects (a key it names is
    /// missing: a typo, or the provider changed its replies), is null as a
    /// whole, or has a row for the reference whose id is null or empty (a
    /// job not yet numbered?): no answer, so the call is not sent again on
    /// it.
    Unclear,
}

/// Reads `pointer` (RFC 6901) in a lookup's reply.
fn look_up(json: &Value, pointer: &str) -> Looked {
    // A null says "none" only where the reply's own keys lead to it: not
    // the whole reply, and not inside a row of a list (a row exists).
    let none = |depth: usize, in_row: bool| {
        if depth == 0 || in_row {
            Looked::Unclear
        } else {
            Looked::Absent
        }
    };
    let (mut at, mut depth, mut in_row) = (json, 0, false);
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        at = match at {
            Value::Null => return none(depth, in_row),
            Value::Object(map) => match map.get(&token) {
                Some(v) => v,
                None => return Looked::Unclear,
            },
            Value::Array(items) => match token.parse::<usize>() {
                Ok(i) if i < items.len() => {
                    in_row = true;
                    &items[i]
                }
                Ok(_) => return Looked::Absent,
                Err(_) => return Looked::Unclear,
            },
            _ => return Looked::Unclear,
        };
        depth += 1;
    }
    match at {
        Value::Null => none(depth, in_row),
        Value::String(s) if s.trim().is_empty() => none(depth, in_row),
        Value::String(s) => Looked::Found(s.clone()),
        Value::Number(n) => Looked::Found(n.to_string()),
        _ => Looked::Unclear,
    }
}

/// Decides what a reply means for the step. `plan` is the state the call
/// left with (its attempt counted), `now` the pass's start, `after` when the
/// reply was read, `jitter` a random number in `[0, 1)` for the backoff.
pub fn after_reply(
    step: &Step,
    plan: Planned,
    reply: &ReplyFacts<'_>,
    policy: &RetryPolicy,
    now: UnixMs,
    after: UnixMs,
    jitter: f64,
) -> Judged {
    let Planned {
        write: mut w,
        polling,
        is_retry,
        ..
    } = plan;
    let mut outcome = reply.outcome;
    let mut code = reply.error_code.map(str::to_owned);
    let submitting = step.job_pointer().is_some() && !polling;
    // A submit is accepted when the provider says done or "queued": either
    // way there must be a job id to follow.
    if outcome == Outcome::Success || (submitting && outcome == Outcome::Pending) {
        match accepted(step, w, submitting, reply.json, after) {
            Accepted::Taken(w) => {
                let budget = retry_settled(is_retry, true);
                return judged(Decision::keep(w), outcome, code, budget);
            }
            Accepted::Missing(back, missing) => {
                w = back;
                outcome = Outcome::Unknown;
                code = Some(missing.into());
            }
        }
    }
    match outcome {
        Outcome::Success => judged(Decision::keep(w), outcome, code, BudgetMove::None),
        Outcome::Pending => {
            let d = half_state(step, w, polling, policy, now, after);
            judged(d, outcome, code, BudgetMove::None)
        }
        Outcome::Fail => {
            let d = refused(w, code.clone(), reply.http_status, after);
            judged(d, outcome, code, BudgetMove::None)
        }
        Outcome::Throttled => {
            // A retry's token, taken at the gate, goes back: being told to
            // slow down is not a failed retry.
            let budget = retry_settled(is_retry, true);
            let d = throttled(step, w, polling, reply, policy, (now, after), jitter);
            judged(d, outcome, code, budget)
        }
        Outcome::Retry | Outcome::Unknown => {
            let budget = retry_settled(is_retry, false);
            let failure = Failure {
                outcome,
                code: code.as_deref(),
                retry_after: reply.retry_after,
            };
            let d = failed_try(step, w, polling, &failure, policy, (now, after), jitter);
            judged(d, outcome, code, budget)
        }
    }
}

/// What an accepting reply makes of the step.
enum Accepted {
    /// Taken: the step waits on its job, or succeeded.
    Taken(StepWrite),
    /// The job id or an output is missing: the step (with the reason, for
    /// an output) and the code that makes the reply `unknown`.
    Missing(StepWrite, &'static str),
}

/// An accepting reply taken: a submit's job id kept (the step waits on
/// the job), or a call's outputs (the step succeeded); or what is missing.
fn accepted(
    step: &Step,
    mut w: StepWrite,
    submitting: bool,
    json: Option<&Value>,
    after: UnixMs,
) -> Accepted {
    match (submitting, step.job_pointer()) {
        (true, Some(pointer)) => match job_id_in(json, pointer) {
            Some(id) => Accepted::Taken(submitted(step, w, id, after)),
            None => Accepted::Missing(w, "job_id_missing"),
        },
        _ => match extract_outputs(&step.outputs, json) {
            Ok(output) => {
                w.state = StepState::Succeeded;
                w.output = Some(output);
                w.finished_at = Some(after);
                w.next_run_at = None;
                w.error_code = None;
                w.reason = None;
                Accepted::Taken(w)
            }
            Err(name) => {
                w.reason = Some(format!("output `{name}` not found in the reply"));
                Accepted::Missing(w, "output_missing")
            }
        },
    }
}

/// The provider refused the call: the step fails, with the code and the
/// HTTP status (if any) as its reason.
fn refused(
    mut w: StepWrite,
    code: Option<String>,
    http_status: Option<u16>,
    after: UnixMs,
) -> Decision {
    w.state = StepState::Failed;
    w.finished_at = Some(after);
    w.next_run_at = None;
    w.error_code = code;
    w.reason = Some(format!(
        "provider refused the call ({})",
        http_status.map_or_else(|| "no status".to_owned(), |s| format!("HTTP {s}"))
    ));
    Decision::keep(w)
}

/// How a reply moves the retry budget: a retry's token goes back when the
/// retry was `answered` (taken, or only told to slow down) and stays spent
/// when it failed again; a first call took none.
fn retry_settled(is_retry: bool, answered: bool) -> BudgetMove {
    match (is_retry, answered) {
        (false, _) => BudgetMove::None,
        (true, true) => BudgetMove::RetrySucceeded,
        (true, false) => BudgetMove::RetryFailed,
    }
}

fn judged(
    decision: Decision,
    outcome: Outcome,
    code: Option<String>,
    budget: BudgetMove,
) -> Judged {
    Judged {
        decision,
        outcome,
        error_code: code,
        budget,
    }
}

/// A job was accepted: its id is kept (committed before any poll) and the
/// step waits, for a poll or for a delivery.
fn submitted(step: &Step, mut w: StepWrite, job_id: String, after: UnixMs) -> StepWrite {
    w.job_id = Some(job_id);
    w.state = StepState::Waiting;
    w.error_code = None;
    w.reason = None;
    step.kind.submitted(w, after)
}

/// A half-state: ask again later, without spending an attempt, and never
/// past the deadline; a job's last poll is made at its deadline, and one
/// still running then parks.
fn half_state(
    step: &Step,
    mut w: StepWrite,
    polling: bool,
    policy: &RetryPolicy,
    now: UnixMs,
    after: UnixMs,
) -> Decision {
    let every = step.poll().map_or(policy.backoff.base, |p| p.every);
    w.state = StepState::Waiting;
    w.next_run_at = Some(after + ms(every));
    if !polling {
        w.attempts -= 1;
    }
    match w.deadline_at {
        Some(d) if polling && after >= d => {
            let reason = "deadline passed: the job had not finished when last polled".into();
            park_or_fail(step, w, "deadline_passed", reason, now)
        }
        Some(d) => {
            w.next_run_at = w.next_run_at.map(|n| n.min(d));
            Decision::keep(w)
        }
        None => Decision::keep(w),
    }
}

/// The provider said "slow down": not the record's fault, so the attempt
/// the call counted is given back and nothing is drawn from the retry
/// budget. The step asks again after the provider's pause (its
/// `Retry-After`, or the backoff when it names none), and parks with
/// `throttled_past_deadline` when that would pass the step's deadline: a
/// provider that throttles forever cannot hold a record forever.
fn throttled(
    step: &Step,
    mut w: StepWrite,
    polling: bool,
    reply: &ReplyFacts<'_>,
    policy: &RetryPolicy,
    (now, after): (UnixMs, UnixMs),
    jitter: f64,
) -> Decision {
    if !polling {
        w.attempts -= 1;
    }
    let code = reply.error_code.unwrap_or("throttled");
    w.error_code = Some(code.to_owned());
    // Never sooner than the provider is paused for (its Retry-After, or
    // the backoff's base when it names none).
    let pause = reply.retry_after.unwrap_or(policy.backoff.base);
    let wait = policy
        .backoff
        .wait(w.attempts.max(1) as u32, jitter, Some(pause));
    let next = after + ms(wait);
    // A call keeps the state it had (pending, or retrying after a
    // failure); a job's poll keeps waiting.
    if polling {
        w.state = StepState::Waiting;
    }
    match w.deadline_at {
        // A job's last poll may wait out the provider's pause within the
        // grace: the job may have finished meanwhile.
        Some(d) if polling && next > d && next < d + LAST_POLL_GRACE_MS => {
            w.reason = Some(format!("throttled by the provider ({code})"));
            w.next_run_at = Some(next);
            Decision::keep(w)
        }
        Some(d) if next > d => {
            let pause = reply.retry_after.map_or_else(
                || "no Retry-After".to_owned(),
                |r| format!("Retry-After {r:?}"),
            );
            let status = reply
                .http_status
                .map_or_else(|| "no status".to_owned(), |s| format!("HTTP {s}"));
            let reason = format!(
                "the provider throttled past the step's deadline; last: {code} ({status}, {pause})"
            );
            park_or_fail(step, w, "throttled_past_deadline", reason, now)
        }
        _ => {
            w.reason = Some(format!("throttled by the provider ({code})"));
            w.next_run_at = Some(next);
            Decision::keep(w)
        }
    }
}

/// A failed try, as [`failed_try`] needs it.
struct Failure<'a> {
    outcome: Outcome,
    code: Option<&'a str>,
    retry_after: Option<Duration>,
}

/// A retryable failure or a reply nobody understands: try again after the
/// backoff, or park when the attempts, the unknowns or the deadline are
/// spent. `times` is (the pass's start, when the reply was read).
fn failed_try(
    step: &Step,
    mut w: StepWrite,
    polling: bool,
    failure: &Failure<'_>,
    policy: &RetryPolicy,
    (now, after): (UnixMs, UnixMs),
    jitter: f64,
) -> Decision {
    w.error_code = failure.code.map(str::to_owned);
    let code = failure.code.unwrap_or("unknown_reply");
    // Replies nobody understands are counted apart (calls and polls alike)
    // and park sooner; every call, understood or not, spends the attempt
    // budget of calls, so no step makes more calls than `max_attempts`.
    if failure.outcome == Outcome::Unknown {
        w.unknowns += 1;
    }
    let exhausted = if failure.outcome == Outcome::Unknown
        && w.unknowns as u32 >= policy.unknown_attempts.max(1)
    {
        Some(format!(
            "{} replies no rule understood; last: {code}",
            w.unknowns
        ))
    } else if !polling && w.attempts as u32 >= policy.max_attempts {
        Some(format!(
            "attempts exhausted ({} of {}); last error: {code}",
            w.attempts, policy.max_attempts
        ))
    } else {
        None
    };
    let wait = policy
        .backoff
        .wait(w.attempts.max(1) as u32, jitter, failure.retry_after);
    let next = after + ms(wait);
    w.state = if polling {
        StepState::Waiting
    } else {
        StepState::Retrying
    };
    if let Some(reason) = exhausted {
        return park_or_fail(step, w, code, reason, now);
    }
    let deadline = w.deadline_at;
    match deadline {
        // A poll that failed near the deadline: the last poll is made at
        // the deadline, and tried again within the grace until the
        // provider answers it.
        Some(d) if polling && next > d && next < d + LAST_POLL_GRACE_MS => {
            w.next_run_at = Some(if after < d { d } else { next });
            Decision::keep(w)
        }
        Some(d) if next > d => {
            let reason = format!("next try would pass the step deadline; last: {code}");
            park_or_fail(step, w, "deadline_passed", reason, now)
        }
        // A failed poll asks again later: the job is still out there.
        _ => {
            w.next_run_at = Some(next);
            Decision::keep(w)
        }
    }
}

/// A stored webhook delivery, as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Delivery<'a> {
    pub id: i64,
    pub body: &'a Value,
}

/// One delivery's verdict, kept in the attempt history as evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryVerdict {
    pub id: i64,
    pub outcome: Outcome,
    pub error_code: Option<String>,
}

/// Applies webhook deliveries in arrival order: the first terminal one
/// decides (later ones are judged after the commit: one may contradict the
/// result just reached, a reversal); progress reports and replies no rule
/// understands keep the step waiting until its callback deadline.
pub fn apply_deliveries(
    step: &Step,
    write: &StepWrite,
    deliveries: &[Delivery<'_>],
    rules: &[Rule],
    now: UnixMs,
) -> (StepWrite, Vec<DeliveryVerdict>) {
    let mut w = write.clone();
    let mut verdicts = Vec::new();
    let mut decided = false;
    for cb in deliveries {
        if decided {
            break;
        }
        let reply = Reply::Http {
            status: 200,
            json: Some(cb.body.clone()),
            body_error: None,
            retry_after: false,
        };
        let c = classify(rules, &reply);
        let mut outcome = c.outcome;
        let mut code = c.error_code.map(str::to_owned);
        match outcome {
            Outcome::Success => match extract_outputs(&step.outputs, Some(cb.body)) {
                Ok(output) => {
                    w.state = StepState::Succeeded;
                    w.output = Some(output);
                    w.finished_at = Some(now);
                    w.next_run_at = None;
                    w.error_code = None;
                    w.reason = None;
                    decided = true;
                }
                Err(name) => {
                    outcome = Outcome::Unknown;
                    code = Some("output_missing".into());
                    w.error_code = code.clone();
                    w.reason = Some(format!("callback lacks output `{name}`"));
                }
            },
            Outcome::Fail => {
                w.state = StepState::Failed;
                w.finished_at = Some(now);
                w.next_run_at = None;
                w.error_code = code.clone();
                w.reason = Some("the provider reported failure in its callback".into());
                decided = true;
            }
            // A progress report, or one we do not understand: keep
            // waiting; the evidence is in the history.
            _ => {}
        }
        verdicts.push(DeliveryVerdict {
            id: cb.id,
            outcome,
            error_code: code,
        });
    }
    if !decided {
        w.next_run_at = Some(callback_due(step, &w).unwrap_or(now).max(now + 1));
    }
    (w, verdicts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::kind::Kind;
    use crate::domain::pipeline::{CallbackSpec, HttpMethod, PollSpec, RequestSpec};
    use proptest::prelude::*;
    use serde_json::json;
    use std::sync::Arc;

    #[test]
    fn a_call_left_open_is_spent_and_judged_by_the_step_as_it_is_now() {
        let plain = step(1, true, &[], 1_000, 60_000);
        let mut w = StepWrite::pending("s");
        w.attempts = 1;
        let d = left_open(&plain, w.clone(), 2, true, "sent by n1", (5, 5));
        assert_eq!(d.write.attempts, 2, "the call that left is spent");
        assert_eq!(
            d.park.map(|p| p.code).as_deref(),
            Some(crate::domain::OUTCOME_UNCERTAIN)
        );
        // `at_most_once` turned off since: it goes on as configured.
        let d = left_open(&plain, w.clone(), 2, false, "sent by n1", (5, 5));
        assert_eq!(d.park, None);
        assert_eq!((d.write.attempts, d.write.state), (2, w.state));
        // An older intent never lowers the count.
        assert_eq!(left_open(&plain, w, 0, false, "", (5, 5)).write.attempts, 1);
    }

    #[test]
    fn an_uncertain_call_is_looked_up_or_parked_never_resent() {
        use crate::domain::pipeline::Lookup;
        use crate::domain::rules::ReplyError;
        assert!(uncertain(
            &Reply::Failed(ReplyError::Timeout),
            Outcome::Retry
        ));
        assert!(uncertain(&Reply::Failed(ReplyError::Reset), Outcome::Retry));
        assert!(!uncertain(
            &Reply::Failed(ReplyError::Connect),
            Outcome::Retry
        ));
        let said = Reply::Http {
            status: 503,
            json: None,
            body_error: None,
            retry_after: false,
        };
        assert!(
            !uncertain(&said, Outcome::Retry),
            "the provider said what happened"
        );
        assert!(uncertain(&said, Outcome::Unknown));
        // Without a lookup: parked for a person, nothing due.
        let plain = step(1, true, &[], 1_000, 60_000);
        let mut w = StepWrite::pending("s");
        w.attempts = 1;
        let d = uncertain_outcome(&plain, w.clone(), "provider_timeout", (5, 5));
        assert_eq!(
            d.park.as_ref().map(|p| p.code.as_str()),
            Some(crate::domain::OUTCOME_UNCERTAIN)
        );
        assert_eq!(d.write.next_run_at, None);
        // With one: asked next, as a lookup that spends no attempt.
        let mut looked = plain.clone();
        looked.lookup = Some(Lookup {
            request: request(),
            job_id: "/data/0/id".into(),
        });
        // (A call left open after a crash is asked about a call's
        // timeout after it left, never before now.)
        let later = left_open(&looked, w.clone(), 1, true, "sent by n1", (5, 400));
        assert_eq!(later.write.next_run_at, Some(400));
        let overdue = left_open(&looked, w.clone(), 1, true, "sent by n1", (500, 400));
        assert_eq!(overdue.write.next_run_at, Some(500));
        let d = uncertain_outcome(&looked, w, "provider_timeout", (5, 5));
        assert!(d.park.is_none());
        let p = policy(5, 3, 60_000);
        let Before::Call(plan) = before_call(&looked, &d.write, "p", false, &p, 6) else {
            panic!("a call")
        };
        assert!(plan.lookup && plan.polling && !plan.is_retry);
        let unclear_replies = [
            json!({ "items": [] }),
            json!({ "data": [{ "ref": "x" }] }),
            json!({ "data": "none" }),
            json!(null),
            json!({ "data": [null] }),
            json!({ "data": [{ "id": null }] }),
            json!({ "data": [{ "id": "" }] }),
        ];
        let absent_replies = [json!({ "data": null }), json!({ "data": [] })];
        let facts = |status, json| ReplyFacts {
            outcome: Outcome::Success,
            error_code: None,
            json,
            http_status: Some(status),
            retry_after: None,
        };
        // Found: the step follows that job.
        let found = json!({ "data": [{ "id": "job-7" }] });
        let j = after_lookup(
            &looked,
            plan.clone(),
            &facts(200, Some(&found)),
            &p,
            10,
            0.5,
        );
        assert_eq!(j.error_code.as_deref(), Some("lookup_found"));
        assert_eq!(
            (j.decision.write.state, j.decision.write.job_id.as_deref()),
            (StepState::Waiting, Some("job-7"))
        );
        // A 2xx without it: sent again now, as a retry.
        let none = json!({ "data": [] });
        let j = after_lookup(&looked, plan.clone(), &facts(200, Some(&none)), &p, 10, 0.5);
        assert_eq!(j.error_code.as_deref(), Some("lookup_not_found"));
        let w = &j.decision.write;
        assert_eq!(
            (w.state, w.error_code.as_deref(), w.next_run_at),
            (StepState::Retrying, None, Some(10))
        );
        assert!(!looking_up(&looked, w));
        // A reply without the shape the pointer expects (a typo, a changed
        // reply) is no answer: asked again, nothing sent.
        for unclear in &unclear_replies {
            let j = after_lookup(
                &looked,
                plan.clone(),
                &facts(200, Some(unclear)),
                &p,
                10,
                0.5,
            );
            assert_ne!(
                j.error_code.as_deref(),
                Some("lookup_not_found"),
                "{unclear}"
            );
            assert!(looking_up(&looked, &j.decision.write), "{unclear}");
        }
        for absent in &absent_replies {
            let j = after_lookup(
                &looked,
                plan.clone(),
                &facts(200, Some(absent)),
                &p,
                10,
                0.5,
            );
            assert_eq!(
                j.error_code.as_deref(),
                Some("lookup_not_found"),
                "{absent}"
            );
        }
        assert_eq!(
            look_up(&json!({ "a/b": { "n": 7 } }), "/a~1b/n"),
            Looked::Found("7".into())
        );
        assert_eq!(look_up(&json!({ "job": null }), "/job/id"), Looked::Absent);
        assert_eq!(
            look_up(&json!({ "job": { "id": "" } }), "/job/id"),
            Looked::Absent
        );
        // Not taken but the attempts spent: parked, not sent a sixth time.
        let mut spent = plan.clone();
        spent.write.attempts = 5;
        let j = after_lookup(&looked, spent, &facts(200, Some(&none)), &p, 10, 0.5);
        assert_eq!(
            j.decision.park.as_ref().map(|p| p.code.as_str()),
            Some("attempts_exhausted")
        );
        // Nothing clear: asked again later, still uncertain.
        let j = after_lookup(&looked, plan, &facts(503, None), &p, 10, 0.5);
        let w = &j.decision.write;
        assert_eq!(
            w.error_code.as_deref(),
            Some(crate::domain::OUTCOME_UNCERTAIN)
        );
        assert!(w.next_run_at.is_some_and(|t| t > 10) && looking_up(&looked, w));
        assert!(j.decision.park.is_none());
    }

    #[test]
    fn an_outage_defers_or_parks_until_the_provider_is_healthy_spending_nothing() {
        use crate::domain::park::{OutagePolicy, ParkUntil};
        let mut w = StepWrite::pending("s");
        w.attempts = 2;
        w.deadline_at = Some(5_000);
        let why = "provider circuit breaker open";
        let d = outage(w.clone(), OutagePolicy::Defer, "acme", 3_000, why, 1_000);
        assert_eq!(d.park, None);
        assert_eq!((d.write.next_run_at, d.write.attempts), (Some(3_000), 2));
        // Never past a deadline still ahead, where the step decides.
        let late = outage(w.clone(), OutagePolicy::Defer, "acme", 9_000, why, 1_000);
        assert_eq!(late.write.next_run_at, Some(5_000));
        let p = outage(w, OutagePolicy::ParkUntilHealthy, "acme", 3_000, why, 1_000);
        let park = p.park.expect("parked");
        assert_eq!(park.code, PROVIDER_OUTAGE);
        assert_eq!(
            park.until,
            Some(ParkUntil::Provider {
                provider: "acme".into()
            })
        );
        assert!(park.reason.contains("until provider `acme` is healthy"));
        // The step is unchanged but for when it is due: it runs once the
        // record resumes, its attempts unspent.
        assert_eq!(
            (p.write.state, p.write.attempts, p.write.next_run_at),
            (StepState::Pending, 2, Some(3_000))
        );
    }

    fn request() -> RequestSpec {
        RequestSpec {
            method: HttpMethod::Post,
            path: "p".into(),
            headers: Vec::new(),
            body: None,
        }
    }

    fn poll(every: u64, deadline: u64) -> PollSpec {
        PollSpec {
            request: request(),
            every: Duration::from_millis(every),
            deadline: Duration::from_millis(deadline),
        }
    }

    /// 0: request, 1: submit_poll, 2: callback parking, 3: callback polling.
    fn step(kind: u8, required: bool, outputs: &[&str], every: u64, deadline: u64) -> Step {
        use crate::pipeline::kinds::{Callback, Request, SubmitPoll};
        let callback = |fallback| -> Arc<dyn Kind> {
            Arc::new(Callback {
                job_id: "/id".into(),
                callback: CallbackSpec {
                    delivery_job_id: "/id".into(),
                    deadline: Duration::from_millis(deadline),
                    fallback,
                },
            })
        };
        Step {
            name: "s".into(),
            provider: "p".into(),
            kind: match kind {
                0 => Arc::new(Request),
                1 => Arc::new(SubmitPoll {
                    job_id: "/id".into(),
                    poll: poll(every, deadline),
                }),
                2 => callback(Fallback::Park),
                _ => callback(Fallback::Poll(poll(every, deadline))),
            },
            needs: Vec::new(),
            needs_any: Vec::new(),
            when: None,
            upstream: Default::default(),
            required,
            request: Some(request()),
            outputs: outputs
                .iter()
                .map(|o| ((*o).to_owned(), format!("/out/{o}")))
                .collect(),
            on_reversal: crate::domain::ReversalPolicy::Park,
            confirm: None,
            confirm_request: None,
            lookup: None,
            at_most_once: None,
            timeout: None,
            retry: RetryOverride::default(),
            undoes: None,
            each: None,
        }
    }

    fn policy(max_attempts: u32, unknown_attempts: u32, deadline: u64) -> RetryPolicy {
        RetryPolicy {
            max_attempts,
            unknown_attempts,
            backoff: Backoff {
                base: Duration::from_millis(500),
                cap: Duration::from_secs(60),
            },
            deadline: Duration::from_millis(deadline),
        }
    }

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            Just(Outcome::Success),
            Just(Outcome::Pending),
            Just(Outcome::Retry),
            Just(Outcome::Fail),
            Just(Outcome::Unknown),
            Just(Outcome::Throttled),
        ]
    }

    /// One provider reply: its verdict, and which of the step's outputs
    /// and job id its body carries.
    #[derive(Debug, Clone)]
    struct Said {
        outcome: Outcome,
        has_outputs: bool,
        has_job: bool,
        retry_after: Option<u64>,
        took: i64,
        jitter: f64,
    }

    fn said() -> impl Strategy<Value = Said> {
        (
            outcome(),
            any::<bool>(),
            prop::bool::weighted(0.8),
            prop::option::of(0u64..120_000),
            0i64..30_000,
            0.0f64..1.0,
        )
            .prop_map(
                |(outcome, has_outputs, has_job, retry_after, took, jitter)| Said {
                    outcome,
                    has_outputs,
                    has_job,
                    retry_after,
                    took,
                    jitter,
                },
            )
    }

    fn body(said: &Said) -> Value {
        let mut body = json!({ "status": "x" });
        if said.has_job {
            body["id"] = json!("job-1");
        }
        if said.has_outputs {
            body["out"] = json!({ "a": 1, "b": "two" });
        }
        body
    }

    /// Runs one pass of `s` at `now` with reply `said`; `None` when the
    /// pass made no call.
    fn pass(
        s: &Step,
        w: &StepWrite,
        said: &Said,
        p: &RetryPolicy,
        now: UnixMs,
    ) -> (Option<(Planned, Judged)>, Decision) {
        match before_call(s, w, "p", false, p, now) {
            Before::Settled(d) => (None, d),
            Before::Deliveries => unreachable!("no deliveries given"),
            Before::Call(mut plan) => {
                spend_attempt(&mut plan);
                let json = body(said);
                let facts = ReplyFacts {
                    outcome: said.outcome,
                    error_code: match said.outcome {
                        Outcome::Success | Outcome::Pending => None,
                        _ => Some("http_5xx"),
                    },
                    json: Some(&json),
                    http_status: Some(200),
                    retry_after: said.retry_after.map(Duration::from_millis),
                };
                let after = now + said.took;
                let j = after_reply(s, plan.clone(), &facts, p, now, after, said.jitter);
                let d = j.decision.clone();
                (Some((plan, j)), d)
            }
        }
    }

    fn is_done(w: &StepWrite) -> bool {
        matches!(
            w.state,
            StepState::Succeeded | StepState::Failed | StepState::Skipped
        )
    }

    /// An operator's retry clears a step's deadline (and its attempts): the
    /// next pass gives it a new one, so a retried step is bounded again.
    #[test]
    fn a_retried_step_gets_a_new_deadline() {
        let s = step(0, true, &["a"], 1_000, 60_000);
        let p = policy(3, 3, 30_000);
        let mut w = StepWrite::pending("s");
        w.started_at = Some(1_000);
        w.deadline_at = None;
        let Before::Call(plan) = before_call(&s, &w, "p", false, &p, 500_000) else {
            panic!("a retried step calls");
        };
        assert_eq!(
            plan.write.started_at,
            Some(1_000),
            "its first start is kept"
        );
        assert_eq!(plan.write.deadline_at, Some(530_000));
    }

    /// A provider that throttles forever: the one attempt a paid call
    /// allows is never spent, and the step parks at its deadline saying
    /// why, with the provider's code kept.
    #[test]
    fn throttled_forever_parks_at_the_deadline_with_no_attempt_spent() {
        let s = step(0, true, &["a"], 1_000, 60_000);
        let p = policy(1, 3, 30_000);
        let said = Said {
            outcome: Outcome::Throttled,
            has_outputs: false,
            has_job: false,
            retry_after: Some(4_000),
            took: 10,
            jitter: 0.5,
        };
        let (mut w, mut now) = (StepWrite::pending("s"), 1_000_000);
        for _ in 0..100 {
            let (call, d) = pass(&s, &w, &said, &p, now);
            assert!(call.is_some(), "every pass calls: {d:?}");
            assert_eq!(d.write.attempts, 0, "no attempt spent");
            if let Some(park) = d.park {
                assert_eq!(park.code, "throttled_past_deadline");
                assert!(park.reason.contains("http_5xx"), "{}", park.reason);
                assert!(now - 1_000_000 <= 30_000, "parked within the deadline");
                return;
            }
            assert_eq!(
                d.write.next_run_at,
                Some(now + 10 + 4_000),
                "after the pause"
            );
            w = d.write;
            now = w.next_run_at.unwrap_or(now);
        }
        panic!("never parked");
    }

    proptest! {
        /// Drives a step through a run of replies, each pass at the time
        /// the step asked to be run, and checks the rules operators rely
        /// on after every pass.
        #[test]
        fn a_step_keeps_its_rules_over_any_run_of_replies(
            kind in 0u8..4,
            required in any::<bool>(),
            max_attempts in 1u32..6,
            unknown_attempts in 1u32..4,
            deadline in 1_000u64..600_000,
            every in 100u64..120_000,
            poll_deadline in 1_000u64..600_000,
            replies in prop::collection::vec(said(), 1..25),
        ) {
            let s = step(kind, required, &["a", "b"], every, poll_deadline);
            let p = policy(max_attempts, unknown_attempts, deadline);
            let mut w = StepWrite::pending("s");
            let mut now: UnixMs = 1_000_000;
            for said in &replies {
                if is_done(&w) {
                    break;
                }
                let (call, d) = pass(&s, &w, said, &p, now);
                let nw = &d.write;
                // Attempts never exceed the bound.
                prop_assert!(nw.attempts as u32 <= p.max_attempts, "{nw:?}");
                prop_assert!(nw.attempts >= w.attempts);
                if let Some((plan, j)) = &call {
                    // A pending reply to a request or a poll spends no attempt.
                    if said.outcome == Outcome::Pending && (plan.polling || s.job_pointer().is_none()) {
                        prop_assert_eq!(nw.attempts, w.attempts);
                    }
                    // A poll never spends an attempt.
                    if plan.polling {
                        prop_assert_eq!(nw.attempts, w.attempts);
                    }
                    // A throttled reply never spends an attempt, never
                    // draws on the retry budget, and parks only at the
                    // deadline, saying so.
                    if j.outcome == Outcome::Throttled {
                        prop_assert_eq!(nw.attempts, w.attempts);
                        let refund = if plan.is_retry { BudgetMove::RetrySucceeded } else { BudgetMove::None };
                        prop_assert_eq!(j.budget, refund);
                        // A throttled call keeps the state it had: it is
                        // not made `waiting` (for a job) by being throttled.
                        if !plan.polling && d.park.is_none() && nw.state != StepState::Failed {
                            prop_assert_eq!(nw.state, w.state);
                        }
                        if let Some(park) = &d.park {
                            prop_assert_eq!(park.code.as_str(), "throttled_past_deadline");
                        }
                    }
                    // A success carries every declared output, or is
                    // `unknown` with the reason.
                    if nw.state == StepState::Succeeded {
                        let out = nw.output.clone().unwrap_or_default();
                        prop_assert!(s.outputs.keys().all(|k| out.get(k).is_some()), "{out}");
                    }
                    let submitting = !plan.polling && s.job_pointer().is_some();
                    if said.outcome == Outcome::Success && !submitting && !said.has_outputs {
                        prop_assert_eq!(j.outcome, Outcome::Unknown);
                        prop_assert_eq!(j.error_code.as_deref(), Some("output_missing"));
                    }
                }
                // An optional step never parks its record.
                if !s.required {
                    prop_assert!(d.park.is_none());
                }
                // A step that parks or fails is no longer scheduled.
                if d.park.is_some() || nw.state == StepState::Failed {
                    prop_assert_eq!(nw.next_run_at, None);
                }
                // Nothing is scheduled past the deadline, except the one
                // last poll of a job, within the grace.
                if let (Some(next), Some(dl)) = (nw.next_run_at, nw.deadline_at) {
                    let job = nw.job_id.is_some();
                    prop_assert!(
                        next <= dl || (job && next < dl + LAST_POLL_GRACE_MS),
                        "next {next} deadline {dl} job {job}: {nw:?}"
                    );
                }
                if d.park.is_some() {
                    break;
                }
                w = d.write;
                now = w.next_run_at.unwrap_or(now).max(now + 1);
            }
        }

        /// Deliveries: the first terminal one decides, later ones wait for
        /// the commit; a success carries every output or stays waiting.
        #[test]
        fn deliveries_decide_once(outcomes in prop::collection::vec((outcome(), any::<bool>()), 1..6)) {
            use crate::domain::rules::{StatusMatch, When, Rule, FieldTest};
            let rules: Vec<Rule> = ["success", "fail", "pending", "retry"]
                .iter()
                .zip([Outcome::Success, Outcome::Fail, Outcome::Pending, Outcome::Retry])
                .map(|(word, outcome)| Rule {
                    when: When {
                        status: vec![StatusMatch::Class(2)],
                        error: Vec::new(),
                        field: Some(("/status".into(), FieldTest::Equals(json!(word)))),
                        retry_after: None,
                    },
                    outcome,
                })
                .collect();
            let s = step(2, true, &["a"], 1_000, 60_000);
            let mut w = StepWrite::pending("s");
            w.state = StepState::Waiting;
            w.job_id = Some("job-1".into());
            w.deadline_at = Some(10_000_000);
            let bodies: Vec<Value> = outcomes
                .iter()
                .map(|(o, has_outputs)| {
                    let word = match o {
                        Outcome::Success => "success",
                        Outcome::Fail => "fail",
                        Outcome::Pending => "pending",
                        Outcome::Retry => "retry",
                        Outcome::Unknown | Outcome::Throttled => "what",
                    };
                    let mut b = json!({ "status": word, "id": "job-1" });
                    if *has_outputs {
                        b["out"] = json!({ "a": 1 });
                    }
                    b
                })
                .collect();
            let deliveries: Vec<Delivery<'_>> = bodies
                .iter()
                .enumerate()
                .map(|(i, body)| Delivery { id: i as i64, body })
                .collect();
            let (nw, verdicts) = apply_deliveries(&s, &w, &deliveries, &rules, 5_000_000);
            let decisive = outcomes.iter().position(|(o, has)| {
                *o == Outcome::Fail || (*o == Outcome::Success && *has)
            });
            match decisive {
                Some(k) => {
                    prop_assert_eq!(verdicts.len(), k + 1);
                    prop_assert!(matches!(nw.state, StepState::Succeeded | StepState::Failed));
                    prop_assert_eq!(nw.next_run_at, None);
                }
                None => {
                    prop_assert_eq!(verdicts.len(), outcomes.len());
                    prop_assert_eq!(nw.state, StepState::Waiting);
                    prop_assert!(nw.next_run_at.is_some());
                }
            }
            if nw.state == StepState::Succeeded {
                prop_assert!(nw.output.as_ref().is_some_and(|o| o.get("a").is_some()));
            }
        }
    }

    #[test]
    fn a_pending_submit_is_accepted_with_its_job_and_first_poll() {
        let s = step(1, true, &[], 2_000, 60_000);
        let p = policy(3, 3, 600_000);
        let said = Said {
            outcome: Outcome::Pending,
            has_outputs: false,
            has_job: true,
            retry_after: None,
            took: 10,
            jitter: 0.5,
        };
        let (_, d) = pass(&s, &StepWrite::pending("s"), &said, &p, 1_000);
        assert_eq!(d.write.state, StepState::Waiting);
        assert_eq!(d.write.job_id.as_deref(), Some("job-1"));
        assert_eq!(d.write.attempts, 1);
        assert_eq!(d.write.next_run_at, Some(1_010 + 2_000));
        assert_eq!(d.write.deadline_at, Some(1_010 + 60_000));
    }

    #[test]
    fn a_submit_without_a_job_id_is_unknown_and_counted() {
        let s = step(1, true, &[], 2_000, 60_000);
        let p = policy(3, 1, 600_000);
        let said = Said {
            outcome: Outcome::Success,
            has_outputs: true,
            has_job: false,
            retry_after: None,
            took: 10,
            jitter: 0.5,
        };
        let (call, d) = pass(&s, &StepWrite::pending("s"), &said, &p, 1_000);
        let (_, j) = call.unwrap();
        assert_eq!(j.outcome, Outcome::Unknown);
        assert_eq!(j.error_code.as_deref(), Some("job_id_missing"));
        assert_eq!(d.write.unknowns, 1);
        assert_eq!(
            d.park.map(|p| p.reason),
            Some("1 replies no rule understood; last: job_id_missing".into())
        );
    }

    #[test]
    fn attempts_run_out_into_a_park_with_the_last_error() {
        let s = step(0, true, &[], 0, 0);
        let p = policy(2, 3, 600_000);
        let said = Said {
            outcome: Outcome::Retry,
            has_outputs: false,
            has_job: false,
            retry_after: None,
            took: 10,
            jitter: 0.0,
        };
        let (_, d1) = pass(&s, &StepWrite::pending("s"), &said, &p, 1_000);
        assert_eq!(d1.write.state, StepState::Retrying);
        assert!(d1.park.is_none());
        let (_, d2) = pass(&s, &d1.write, &said, &p, 2_000);
        assert_eq!(
            d2.park,
            Some(Park {
                code: "http_5xx".into(),
                reason: "attempts exhausted (2 of 2); last error: http_5xx".into(),
                until: None,
            })
        );
        // The same failure on an optional step fails the step alone.
        let optional = step(0, false, &[], 0, 0);
        let (_, d3) = pass(&optional, &d1.write, &said, &p, 2_000);
        assert!(d3.park.is_none());
        assert_eq!(d3.write.state, StepState::Failed);
    }

    #[test]
    fn a_job_past_its_deadline_gets_one_last_poll_within_the_grace() {
        let s = step(1, true, &[], 2_000, 60_000);
        let p = policy(3, 3, 600_000);
        let mut w = StepWrite::pending("s");
        w.state = StepState::Waiting;
        w.job_id = Some("job-1".into());
        w.started_at = Some(0);
        w.deadline_at = Some(100_000);
        let polls = |now| matches!(before_call(&s, &w, "p", false, &p, now), Before::Call(ref c) if c.polling);
        assert!(polls(100_000));
        assert!(polls(100_000 + LAST_POLL_GRACE_MS - 1));
        assert!(!polls(100_000 + LAST_POLL_GRACE_MS));
        // A request step past its deadline gives up unasked.
        let r = step(0, true, &[], 0, 0);
        let mut rw = StepWrite::pending("s");
        rw.started_at = Some(0);
        rw.deadline_at = Some(100_000);
        let Before::Settled(d) = before_call(&r, &rw, "p", false, &p, 100_000) else {
            panic!("a request past its deadline must not call");
        };
        assert_eq!(d.park.map(|p| p.code), Some("deadline_passed".into()));
    }

    #[test]
    fn deferrals_stop_at_a_deadline_ahead() {
        let mut w = StepWrite::pending("s");
        w.deadline_at = Some(10_000);
        assert_eq!(
            defer(w.clone(), 50_000, "x", 1_000).next_run_at,
            Some(10_000)
        );
        assert_eq!(defer(w.clone(), 5_000, "x", 1_000).next_run_at, Some(5_000));
        assert_eq!(defer(w.clone(), 0, "x", 1_000).next_run_at, Some(1_001));
        // Past the deadline (a last poll waiting for a gate) it is not held.
        assert_eq!(defer(w, 50_000, "x", 20_000).next_run_at, Some(50_000));
    }
}
