//! What a pass means for its record, as pure functions over the steps'
//! states: which steps are blocked (skipped), which are ready, and the
//! record's verdict (advance, wait, retry, succeed, fail, park, defer) with
//! when it is due again and the reason kept on it.

use std::collections::HashMap;

use super::pipeline::Step;
use super::step::Park;
use super::{
    Record, RecordState, StepState, StepWrite, TransitionError, Trigger, UnixMs, WorkResult,
    transition,
};

/// A step that will not run again in this generation.
pub fn is_done(state: StepState) -> bool {
    matches!(
        state,
        StepState::Succeeded | StepState::Failed | StepState::Skipped
    )
}

/// Every step `s` needs has succeeded, its join (`needs_any`) is met, and
/// `s` itself is not finished.
pub fn unblocked(s: &Step, states: &HashMap<String, StepWrite>) -> bool {
    let state = |n: &String| states.get(n).map(|w| w.state);
    states.get(&s.name).is_some_and(|w| !is_done(w.state))
        && s.needs
            .iter()
            .all(|n| state(n) == Some(StepState::Succeeded))
        && join(s, states) != Join::Waiting
}

/// Where a step's `needs_any` stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Join {
    /// None given, or every one ended and one succeeded.
    Met,
    /// Every one ended and none succeeded.
    Lost,
    /// Some have not ended.
    Waiting,
}

fn join(s: &Step, states: &HashMap<String, StepWrite>) -> Join {
    let state = |n: &String| states.get(n).map(|w| w.state);
    if s.needs_any.iter().any(|n| !state(n).is_some_and(is_done)) {
        Join::Waiting
    } else if s.needs_any.is_empty()
        || s.needs_any
            .iter()
            .any(|n| state(n) == Some(StepState::Succeeded))
    {
        Join::Met
    } else {
        Join::Lost
    }
}

/// [`unblocked`], and due by `now`: at its next run, or now when it has
/// none, unless it waits for a person, a signal or a child (only their
/// coming, or its timeout, ends that wait).
pub fn is_runnable(s: &Step, states: &HashMap<String, StepWrite>, now: UnixMs) -> bool {
    let due = |w: &StepWrite| match w.next_run_at {
        Some(t) => t <= now,
        None => {
            let code = w.error_code.as_deref();
            !super::awaiting::holds(w.state, code) && !super::child::holds(w.state, code)
        }
    };
    unblocked(s, states) && states.get(&s.name).is_some_and(due)
}

/// Skips every unfinished step behind a failed or skipped step it needs,
/// or whose join (`needs_any`) ended with none succeeded (steps come in
/// dependency order, so a skip propagates downstream); returns the names
/// of the steps it changed.
pub fn skip_blocked(
    steps: &[Step],
    states: &mut HashMap<String, StepWrite>,
    now: UnixMs,
) -> Vec<String> {
    let mut changed = Vec::new();
    for s in steps {
        let lost = s.needs.iter().find(|n| {
            states
                .get(*n)
                .is_some_and(|w| matches!(w.state, StepState::Failed | StepState::Skipped))
        });
        let why = match (lost, join(s, states)) {
            (Some(n), _) => format!("`{n}`, which it needs, did not succeed"),
            (None, Join::Lost) => format!(
                "none of `{}` (it needs any one) succeeded",
                s.needs_any.join("`, `")
            ),
            (None, _) => continue,
        };
        let Some(st) = states.get_mut(&s.name) else {
            continue;
        };
        if !is_done(st.state) {
            st.state = StepState::Skipped;
            st.reason = Some(why);
            st.finished_at = Some(now);
            changed.push(s.name.clone());
        }
    }
    changed
}

/// The steps to start now, in pipeline order: those runnable, and callback
/// steps with deliveries waiting (they apply them at once), leaving out
/// the ones `started` already.
pub fn ready<'p>(
    steps: &'p [Step],
    states: &HashMap<String, StepWrite>,
    now: UnixMs,
    has_deliveries: &dyn Fn(&str) -> bool,
    started: &dyn Fn(&str) -> bool,
) -> Vec<&'p Step> {
    // Once a required step failed, only jobs already out are followed
    // (an undo waits for them); nothing new starts.
    let failed = required_failed(steps, states).is_some();
    steps
        .iter()
        .filter(|s| !started(&s.name))
        .filter(|s| !failed || states.get(&s.name).is_some_and(job_out))
        .filter(|s| {
            is_runnable(s, states, now) || (has_deliveries(&s.name) && unblocked(s, states))
        })
        .collect()
}

/// Whether `w`'s call may still take effect: a job submitted whose end is
/// not yet known (the next poll, a poll retried, or its callback tells),
/// or a call whose outcome is not known, waiting for its lookup.
pub fn job_out(w: &StepWrite) -> bool {
    let uncertain = w.error_code.as_deref() == Some(super::OUTCOME_UNCERTAIN);
    !is_done(w.state) && (w.job_id.is_some() || uncertain)
}

/// Whether a pass may start more steps after one finished: not once the
/// record is to be parked or has failed (calls already out finish; no new
/// ones start).
pub fn may_start_more(
    steps: &[Step],
    states: &HashMap<String, StepWrite>,
    park: Option<&Park>,
) -> bool {
    park.is_none() && required_failed(steps, states).is_none()
}

fn required_failed<'p>(steps: &'p [Step], states: &HashMap<String, StepWrite>) -> Option<&'p Step> {
    steps.iter().find(|s| {
        s.required
            && states
                .get(&s.name)
                .is_some_and(|w| w.state == StepState::Failed)
    })
}

/// What the pass did, as the verdict needs it.
#[derive(Debug, Clone, Copy)]
pub struct PassFacts<'a> {
    /// The first park any step asked for.
    pub park: Option<&'a Park>,
    /// A step was given back because the node is stopping.
    pub stopped: bool,
    /// The error code of the pass's last attempt.
    pub last_error: Option<&'a str>,
    pub now: UnixMs,
}

/// The record's verdict after a pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub result: WorkResult,
    /// When the record is due again (scheduled results only).
    pub next_run_at: Option<UnixMs>,
    /// The step the verdict is about, when a required step failed.
    pub step: Option<String>,
    pub error_code: Option<String>,
    pub reason: Option<String>,
    /// For a park: when the record resumes by itself.
    pub park_until: Option<super::park::ParkUntil>,
}

/// Decides what the steps' states mean for the record: park (a step asked
/// to), fail (a required step failed), succeed (every step done), or stay
/// scheduled: advance (a step is runnable now), wait (a job is out),
/// retry (backing off), or defer (given back without a call), due at the
/// earliest step's next run.
pub fn verdict(
    steps: &[Step],
    states: &HashMap<String, StepWrite>,
    facts: &PassFacts<'_>,
) -> Verdict {
    let now = facts.now;
    let failed = required_failed(steps, states);
    let state_of = |s: &Step| states.get(&s.name).map(|w| w.state);
    let all_done = steps.iter().all(|s| state_of(s).is_some_and(is_done));
    let (result, next_run_at) = if facts.park.is_some() {
        (WorkResult::Parked, None)
    } else if failed.is_some() {
        (WorkResult::Failed, None)
    } else if all_done {
        (WorkResult::Completed, None)
    } else {
        scheduled(steps, states, facts.stopped, now)
    };
    let mut v = Verdict {
        result,
        next_run_at,
        step: None,
        error_code: None,
        reason: None,
        park_until: None,
    };
    match (facts.park, failed) {
        (Some(park), _) => {
            v.error_code = Some(park.code.clone());
            v.reason = Some(park.reason.clone());
            v.park_until = park.until.clone();
        }
        (None, Some(s)) => {
            let w = states.get(&s.name);
            v.step = Some(s.name.clone());
            v.error_code = w.and_then(|w| w.error_code.clone());
            v.reason = w
                .and_then(|w| w.reason.clone())
                .or_else(|| Some(format!("step `{}` failed", s.name)));
        }
        (None, None) => {
            v.error_code = facts.last_error.map(str::to_owned);
            // A record waiting for a person, a signal or a child says so
            // (the records list filters on it), unless a call said more
            // and the record is due again to say it once more.
            let at_rest = v.next_run_at.is_none();
            if v.result == WorkResult::Waiting && (v.error_code.is_none() || at_rest) {
                let person = steps.iter().filter_map(|s| states.get(&s.name)).find(|w| {
                    let code = w.error_code.as_deref();
                    super::awaiting::Awaits::waiting(w.state, code).is_some()
                        || super::child::holds(w.state, code)
                });
                if let Some(w) = person {
                    v.step = Some(w.step.clone());
                    v.error_code = w.error_code.clone();
                    v.reason = w.reason.clone();
                }
            }
            if facts.stopped && result == WorkResult::Deferred {
                v.reason = Some(super::SHUTDOWN_REASON.into());
            }
        }
    }
    v
}

/// A record with steps left: advanced, waiting, retrying or deferred, due
/// at the earliest unfinished step's next run (now for a runnable step).
fn scheduled(
    steps: &[Step],
    states: &HashMap<String, StepWrite>,
    stopped: bool,
    now: UnixMs,
) -> (WorkResult, Option<UnixMs>) {
    let runnable_now = steps.iter().any(|s| is_runnable(s, states, now));
    let pending: Vec<&StepWrite> = steps
        .iter()
        .filter_map(|s| states.get(&s.name))
        .filter(|w| !is_done(w.state))
        .collect();
    let next = pending.iter().filter_map(|w| w.next_run_at).min();
    if stopped {
        // Given back by a stopping node: no step moved on.
        (WorkResult::Deferred, next.or(Some(now)))
    } else if runnable_now {
        (WorkResult::Advanced, Some(now))
    } else if pending.iter().any(|w| w.state == StepState::Waiting) {
        (WorkResult::Waiting, next)
    } else if pending.iter().any(|w| w.state == StepState::Retrying) {
        (WorkResult::RetryScheduled, next)
    } else {
        (WorkResult::Deferred, next)
    }
}

/// What a pass's commit says of its record.
#[derive(Debug, Clone, Copy)]
pub struct Committed<'a> {
    pub now: UnixMs,
    /// `None`: a checkpoint; the record stays leased.
    pub result: Option<WorkResult>,
    /// When a scheduled record is due again (`now` when not given).
    pub next_run_at: Option<UnixMs>,
    /// The step and provider it is at, when they changed.
    pub step: Option<&'a str>,
    pub provider: Option<&'a str>,
    pub error_code: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub park_until: Option<&'a super::park::ParkUntil>,
}

/// The record as a commit leaves it, and the state it moved to (`None`
/// for a checkpoint), through the transition table: a record is leased
/// (`running`) while a pass works it.
pub fn after_commit(
    rec: &Record,
    c: Committed<'_>,
) -> Result<(Record, Option<RecordState>), TransitionError> {
    let mut after = rec.clone();
    after.updated_at = c.now;
    after.error_code = c.error_code.map(str::to_owned);
    after.reason = c.reason.map(str::to_owned);
    if let Some(step) = c.step {
        after.step = Some(step.to_owned());
    }
    if let Some(provider) = c.provider {
        after.provider = Some(provider.to_owned());
    }
    let Some(result) = c.result else {
        return Ok((after, None));
    };
    let to = transition(RecordState::Running, Trigger::Worked(result))?;
    after.state = to;
    after.next_run_at = match to {
        // A wait with no time (for a person, with no timeout) is due only
        // when something ends it.
        RecordState::Waiting => c.next_run_at,
        _ => to.is_scheduled().then(|| c.next_run_at.unwrap_or(c.now)),
    };
    after.lease_owner = None;
    after.lease_until = None;
    after.finished_at = to.is_terminal().then_some(c.now);
    after.park_until = c.park_until.filter(|_| to == RecordState::Parked).cloned();
    Ok((after, Some(to)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::pipeline::{HttpMethod, RequestSpec};
    use proptest::prelude::*;

    /// A fan-out and fan-in: `a` and `b` independent, `c` needs both, `d`
    /// needs `a`; `optional` says which are optional.
    fn steps(optional: [bool; 4]) -> Vec<Step> {
        let needs: [&[&str]; 4] = [&[], &[], &["a", "b"], &["a"]];
        ["a", "b", "c", "d"]
            .iter()
            .zip(needs)
            .zip(optional)
            .map(|((name, needs), optional)| Step {
                name: (*name).into(),
                provider: "p".into(),
                kind: std::sync::Arc::new(crate::pipeline::kinds::Request),
                needs: needs.iter().map(|n| (*n).to_owned()).collect(),
                needs_any: Vec::new(),
                when: None,
                upstream: needs.iter().map(|n| (*n).to_owned()).collect(),
                required: !optional,
                request: Some(RequestSpec {
                    method: HttpMethod::Get,
                    path: "p".into(),
                    headers: Vec::new(),
                    body: None,
                }),
                outputs: Default::default(),
                on_reversal: crate::domain::ReversalPolicy::Park,
                confirm: None,
                confirm_request: None,
                lookup: None,
                at_most_once: None,
                timeout: None,
                retry: crate::domain::step::RetryOverride::default(),
                undoes: None,
                each: None,
            })
            .collect()
    }

    fn state() -> impl Strategy<Value = StepState> {
        prop_oneof![
            Just(StepState::Pending),
            Just(StepState::Waiting),
            Just(StepState::Retrying),
            Just(StepState::Succeeded),
            Just(StepState::Failed),
            Just(StepState::Skipped),
        ]
    }

    fn states_of(steps: &[Step], s: &[(StepState, Option<i64>)]) -> HashMap<String, StepWrite> {
        steps
            .iter()
            .zip(s)
            .map(|(step, (state, next))| {
                let mut w = StepWrite::pending(&step.name);
                w.state = *state;
                w.next_run_at = if is_done(*state) { None } else { *next };
                (step.name.clone(), w)
            })
            .collect()
    }

    proptest! {
        #[test]
        fn a_verdict_follows_the_steps(
            optional in any::<[bool; 4]>(),
            raw in prop::collection::vec((state(), prop::option::of(0i64..2_000)), 4),
            park in any::<bool>(),
            stopped in any::<bool>(),
        ) {
            let steps = steps(optional);
            let mut states = states_of(&steps, &raw);
            skip_blocked(&steps, &mut states, 1_000);
            let park = park.then(|| Park { code: "c".into(), reason: "r".into(), until: None });
            let facts = PassFacts { park: park.as_ref(), stopped, last_error: None, now: 1_000 };
            let v = verdict(&steps, &states, &facts);
            let required_failed = steps.iter().any(|s| s.required && states[&s.name].state == StepState::Failed);
            // A park wins; an optional step's failure never fails the record.
            if park.is_some() {
                prop_assert_eq!(v.result, WorkResult::Parked);
            } else {
                prop_assert_eq!(v.result == WorkResult::Failed, required_failed);
            }
            // Nothing runs behind a step that did not succeed.
            for s in &steps {
                let blocked = s.needs.iter().any(|n| states[n].state != StepState::Succeeded);
                if blocked {
                    prop_assert!(!is_runnable(s, &states, 1_000));
                }
                if s.needs.iter().any(|n| matches!(states[n].state, StepState::Failed | StepState::Skipped)) {
                    prop_assert!(is_done(states[&s.name].state));
                }
            }
            // A record with steps left is scheduled, and never later than
            // its earliest step (now, when one is runnable).
            if matches!(v.result, WorkResult::Advanced | WorkResult::Waiting | WorkResult::RetryScheduled) {
                prop_assert!(v.next_run_at.is_some() || !steps.iter().any(|s| states[&s.name].next_run_at.is_some()));
            }
            if v.result == WorkResult::Advanced {
                prop_assert_eq!(v.next_run_at, Some(1_000));
            }
            if v.result == WorkResult::Completed {
                prop_assert!(steps.iter().all(|s| is_done(states[&s.name].state)));
            }
        }
    }

    #[test]
    fn a_join_waits_for_every_branch_and_runs_after_any_success() {
        // `c` joins `a` and `b` (any one), `d` needs `c`.
        let mut steps = steps([false; 4]);
        steps[2].needs = Vec::new();
        steps[2].needs_any = vec!["a".into(), "b".into()];
        steps[3].needs = vec!["c".into()];
        let none = |_: &str| false;
        let names = |v: Vec<&Step>| v.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        let at = |a: StepState, b: StepState| {
            let mut states = states_of(&steps, &[(StepState::Pending, None); 4]);
            states.get_mut("a").unwrap().state = a;
            states.get_mut("b").unwrap().state = b;
            states
        };
        // One branch skipped, the other still out: the join waits.
        let mut states = at(StepState::Skipped, StepState::Waiting);
        assert!(skip_blocked(&steps, &mut states, 0).is_empty());
        assert!(!unblocked(&steps[2], &states));
        // It succeeded: the join runs.
        let mut states = at(StepState::Skipped, StepState::Succeeded);
        assert!(skip_blocked(&steps, &mut states, 0).is_empty());
        assert_eq!(names(ready(&steps, &states, 0, &none, &none)), ["c"]);
        // Neither succeeded: the join is skipped, and what needs it.
        for (a, b) in [
            (StepState::Skipped, StepState::Failed),
            (StepState::Skipped, StepState::Skipped),
        ] {
            let mut states = at(a, b);
            assert_eq!(skip_blocked(&steps, &mut states, 0), ["c", "d"]);
            let why = states["c"].reason.clone().unwrap_or_default();
            assert!(why.contains("none of `a`, `b`"), "{why}");
            assert_eq!(states["c"].state, StepState::Skipped);
        }
    }

    #[test]
    fn a_step_is_ready_when_its_own_needs_are_met() {
        let steps = steps([false; 4]);
        let mut states = states_of(&steps, &[(StepState::Pending, None); 4]);
        let none = |_: &str| false;
        let names = |v: Vec<&Step>| v.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(ready(&steps, &states, 0, &none, &none)), ["a", "b"]);
        // `a` done, `b` still out: `d` (needs only `a`) is ready, `c` is not.
        states.get_mut("a").unwrap().state = StepState::Succeeded;
        let b_started = |n: &str| n == "b";
        assert_eq!(names(ready(&steps, &states, 0, &none, &b_started)), ["d"]);
        states.get_mut("b").unwrap().state = StepState::Succeeded;
        assert_eq!(names(ready(&steps, &states, 0, &none, &none)), ["c", "d"]);
    }
}
