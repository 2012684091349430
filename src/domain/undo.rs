//! Undo: the undo calls of a record's succeeded steps (each step's
//! `undo`, compiled as a step `undo:NAME` of `Pipeline::undo`), run one
//! after another in reverse order of the steps' completion, after a
//! failure (`on_failure = "undo"`) or at an operator's word. While an
//! undo step run is unfinished the record is undoing: its passes run the
//! undo chain and nothing else. All done, the record ends failed
//! `undone`; one that cannot complete parks it `undo_failed`.

use std::collections::HashMap;

use super::pass::Verdict;
use super::pipeline::{Pipeline, Step};
use super::{StepState, StepWrite, WorkResult};

/// The code of a park on a call whose outcome is not known.
const UNCERTAIN: &str = "outcome_uncertain";

/// What an undo step's name starts with (no step name has a colon).
pub const PREFIX: &str = "undo:";

/// The undo step of step `step`.
pub fn name_of(step: &str) -> String {
    format!("{PREFIX}{step}")
}

/// The step an undo step's name undoes, when it is one.
pub fn undone_step(name: &str) -> Option<&str> {
    name.strip_prefix(PREFIX)
}

/// Whether an undo is under way: a run of an undo step that has not
/// succeeded (one that failed keeps the record undoing: a retry runs it
/// again). The runs of an earlier undo are retired when another undo or
/// a replay starts, so every undo run belongs to the latest undo.
pub fn under_way(states: &HashMap<String, StepWrite>) -> bool {
    states
        .values()
        .any(|w| undone_step(&w.step).is_some() && w.state != StepState::Succeeded)
}

/// The undo steps an undo runs, by name: those of the steps that
/// succeeded and were neither reversed by their provider nor undone
/// already (a step run again loses its undo run, so an undo run that
/// succeeded undid the step's current effect), the last finished first.
pub fn to_run(pipeline: &Pipeline, states: &HashMap<String, StepWrite>) -> Vec<String> {
    let mut done: Vec<(&Step, i64)> = pipeline
        .undo
        .iter()
        .filter_map(|u| {
            let w = states.get(u.undoes.as_deref()?)?;
            let reversed = w.error_code.as_deref() == Some(super::REVERSED);
            let undone = states
                .get(&u.name)
                .is_some_and(|r| r.state == StepState::Succeeded);
            let finished = w.finished_at.unwrap_or(0);
            (w.state == StepState::Succeeded && !reversed && !undone).then_some((u, finished))
        })
        .collect();
    // Stable: steps finished at one instant are undone in reverse
    // pipeline order.
    done.reverse();
    done.sort_by_key(|(_, at)| std::cmp::Reverse(*at));
    done.into_iter().map(|(u, _)| u.name.clone()).collect()
}

/// The steps with an undo call whose job is still out: an undo after a
/// failure waits for them, so that one that then succeeds is undone too.
pub fn still_out<'s>(
    pipeline: &Pipeline,
    states: &'s HashMap<String, StepWrite>,
) -> Vec<&'s StepWrite> {
    pipeline
        .undo
        .iter()
        .filter_map(|u| states.get(u.undoes.as_deref()?))
        .filter(|w| super::pass::job_out(w))
        .collect()
}

/// After required step `v.step` failed: the record waits (`undo_waits`)
/// while a step with an undo call still has a call out, due at the
/// earliest of every call it follows meanwhile; `None` to undo now.
pub fn waits(
    pipeline: &Pipeline,
    v: &Verdict,
    states: &HashMap<String, StepWrite>,
) -> Option<Verdict> {
    let out = still_out(pipeline, states);
    if out.is_empty() {
        return None;
    }
    let jobs: Vec<String> = out.iter().map(|w| format!("`{}`", w.step)).collect();
    let failed = v.step.clone().unwrap_or_default();
    let why = v.reason.clone().unwrap_or_default();
    Some(Verdict {
        result: WorkResult::Waiting,
        next_run_at: states
            .values()
            .filter(|w| super::pass::job_out(w))
            .filter_map(|w| w.next_run_at)
            .min(),
        step: v.step.clone(),
        error_code: Some("undo_waits".into()),
        reason: Some(format!(
            "`{failed}` failed ({why}); the undo waits for the call of {} to end, so that \
             its effect is undone too",
            jobs.join(", ")
        )),
        park_until: None,
    })
}

/// The undo as a pipeline of its own: the undo steps that have runs,
/// in the order [`to_run`] gives them (their runs' order is kept by the
/// steps they undo), each needing the one before, so that a pass runs
/// them one after another with the machinery of any step.
pub fn chain(pipeline: &Pipeline, states: &HashMap<String, StepWrite>) -> Pipeline {
    let mut order: Vec<(&Step, i64)> = pipeline
        .undo
        .iter()
        .filter(|u| states.contains_key(&u.name))
        .map(|u| {
            let finished = u
                .undoes
                .as_deref()
                .and_then(|s| states.get(s))
                .and_then(|w| w.finished_at)
                .unwrap_or(0);
            (u, finished)
        })
        .collect();
    order.reverse();
    order.sort_by_key(|(_, at)| std::cmp::Reverse(*at));
    let mut steps: Vec<Step> = Vec::with_capacity(order.len());
    for (u, _) in order {
        let mut s = u.clone();
        s.needs = steps
            .last()
            .map(|p| vec![p.name.clone()])
            .unwrap_or_default();
        steps.push(s);
    }
    Pipeline {
        name: pipeline.name.clone(),
        steps,
        undo: Vec::new(),
        undo_on_failure: false,
        definition: serde_json::Value::Null,
        hash: pipeline.hash.clone(),
    }
}

/// What an undo pass's verdict means for the record: all undone, it
/// fails `undone`; an undo call that failed or parks its step (`parked_at`
/// names the step that parked), it parks `undo_failed`; otherwise it goes
/// on as the verdict says.
pub fn verdict_of(mut v: Verdict, chain: &Pipeline, parked_at: Option<&str>) -> Verdict {
    match v.result {
        WorkResult::Completed => {
            let names: Vec<&str> = chain
                .steps
                .iter()
                .filter_map(|s| s.undoes.as_deref())
                .collect();
            v.result = WorkResult::Failed;
            v.error_code = Some("undone".into());
            v.reason = Some(format!(
                "undone: the undo of {} made",
                names.join(", then ")
            ));
            v.step = chain.steps.last().map(|s| s.name.clone());
            v.next_run_at = None;
        }
        // A park that ends by itself (the provider's outage) stays one,
        // and so does a call whose outcome is not known (an operator
        // settles it with "it took effect").
        WorkResult::Parked
            if v.park_until.is_some() || v.error_code.as_deref() == Some(UNCERTAIN) => {}
        WorkResult::Failed | WorkResult::Parked => {
            let step = v.step.as_deref().or(parked_at);
            let which = step.and_then(undone_step).unwrap_or("a step");
            let why = v.reason.clone().unwrap_or_else(|| "no reason given".into());
            v.result = WorkResult::Parked;
            v.error_code = Some("undo_failed".into());
            v.reason = Some(format!("the undo of {which} could not complete: {why}"));
            v.park_until = None;
            v.next_run_at = None;
        }
        _ => {}
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(undone_step(&name_of("charge")), Some("charge"));
        assert_eq!(undone_step("charge"), None);
    }

    #[test]
    fn calls_that_may_still_take_effect_are_out() {
        use crate::domain::pass::job_out;
        let mut w = StepWrite::pending("book");
        assert!(!job_out(&w), "not sent");
        w.state = StepState::Waiting;
        w.job_id = Some("job-1".into());
        assert!(job_out(&w), "a job submitted, not ended");
        w.state = StepState::Retrying;
        assert!(job_out(&w), "its poll retried");
        w.state = StepState::Succeeded;
        assert!(!job_out(&w), "ended");
        let mut w = StepWrite::pending("book");
        w.state = StepState::Retrying;
        assert!(!job_out(&w), "a call that failed took no effect");
        w.error_code = Some(crate::domain::OUTCOME_UNCERTAIN.into());
        assert!(job_out(&w), "an uncertain call waiting for its lookup");
    }

    #[test]
    fn an_unfinished_undo_run_is_an_undo_under_way() {
        let mut states = HashMap::new();
        states.insert("charge".to_owned(), StepWrite::pending("charge"));
        assert!(!under_way(&states));
        let mut u = StepWrite::pending("undo:charge");
        states.insert(u.step.clone(), u.clone());
        assert!(under_way(&states));
        u.state = StepState::Failed;
        states.insert(u.step.clone(), u.clone());
        assert!(under_way(&states), "a failed undo call keeps it undoing");
        u.state = StepState::Succeeded;
        states.insert(u.step.clone(), u);
        assert!(!under_way(&states));
    }
}
