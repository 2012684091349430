//! What a provider's reversal of a result already handled does to a
//! record, decided from the record's state and the step's `on_reversal`
//! policy; the store applies the decision under the record's lock.

use super::{RecordState, ReversalPolicy, TransitionError, Trigger, transition};

/// What becomes of the reversed step's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReversedSteps {
    /// The reversed step and those after it run again, a new generation.
    RunAgain,
    /// The result stays (a resume keeps it), marked so that a retry runs
    /// the step again.
    Mark,
    /// Nothing but the event.
    Keep,
}

/// A reversal, decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reversal {
    /// The record's state after it (the same state: the record keeps its
    /// place and gets the event).
    pub to: RecordState,
    pub steps: ReversedSteps,
    /// A record parked until a condition, parked now by the reversal: it
    /// needs a human, no longer resumes by itself, and says why.
    pub needs_human: bool,
    /// The workers have something to do now.
    pub wake: bool,
}

/// The reversal event's detail: the provider's, with the policy applied.
pub fn detail(given: Option<serde_json::Value>, policy: ReversalPolicy) -> serde_json::Value {
    let mut detail = given.unwrap_or(serde_json::json!({}));
    if let Some(obj) = detail.as_object_mut() {
        obj.insert(
            "policy".into(),
            serde_json::to_value(policy).unwrap_or_default(),
        );
    }
    detail
}

/// Decides a reversal under `policy` of a record in `from` (`parked_until`:
/// it waits for a condition to resume by itself). The policy applies
/// whatever the state; a state the reversal does not move (a pending
/// record rerun, a parked one parked) keeps its place.
pub fn decide(
    from: RecordState,
    policy: ReversalPolicy,
    parked_until: bool,
) -> Result<Reversal, TransitionError> {
    let to = transition(from, Trigger::Reversed(policy))?;
    let steps = match policy {
        ReversalPolicy::Rerun => ReversedSteps::RunAgain,
        ReversalPolicy::Park => ReversedSteps::Mark,
        ReversalPolicy::Record => ReversedSteps::Keep,
    };
    let stays = to == from;
    Ok(Reversal {
        to,
        steps,
        needs_human: stays
            && to == RecordState::Parked
            && policy == ReversalPolicy::Park
            && parked_until,
        wake: if stays {
            policy == ReversalPolicy::Rerun && to.is_scheduled()
        } else {
            to.is_scheduled()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rerun_of_a_finished_record_wakes_the_workers() {
        let r = decide(RecordState::Succeeded, ReversalPolicy::Rerun, false).unwrap();
        assert_eq!(r.steps, ReversedSteps::RunAgain);
        assert!(r.to.is_scheduled() && r.wake && !r.needs_human);
    }

    #[test]
    fn a_park_of_a_record_parked_until_a_condition_needs_a_human() {
        let r = decide(RecordState::Parked, ReversalPolicy::Park, true).unwrap();
        assert_eq!((r.to, r.steps), (RecordState::Parked, ReversedSteps::Mark));
        assert!(r.needs_human && !r.wake);
        let plain = decide(RecordState::Parked, ReversalPolicy::Park, false).unwrap();
        assert!(!plain.needs_human);
    }

    #[test]
    fn recording_keeps_the_result_and_the_state() {
        for from in [RecordState::Succeeded, RecordState::Parked] {
            let r = decide(from, ReversalPolicy::Record, true).unwrap();
            assert_eq!((r.to, r.steps), (from, ReversedSteps::Keep));
            assert!(!r.needs_human && !r.wake);
        }
    }
}
