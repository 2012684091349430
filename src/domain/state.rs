//! The record state machine: states, the triggers that move records, and the
//! one pure function, [`transition`], that owns the table.
//!
//! Every component that changes a record's state (the store when it claims,
//! the engine when it finishes a pass, the control plane when an operator
//! acts) asks this function first, so the table below is the whole truth.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a record is in its life (docs/operations.md, "Record states").
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// Due at `next_run_at`, waiting for a worker.
    Pending,
    /// Leased by a worker until `lease_until`.
    Running,
    /// A provider job is in flight; due again at the next poll or the
    /// callback deadline.
    Waiting,
    /// Backing off after a failed attempt; due at `next_run_at`.
    Retrying,
    /// Every required step succeeded.
    Succeeded,
    /// A required step failed permanently.
    Failed,
    /// Needs a human: attempts or deadline exhausted, unknown reply,
    /// provider reversal, or an operator parked it.
    Parked,
    /// An operator cancelled it.
    Cancelled,
}

impl RecordState {
    pub const ALL: [RecordState; 8] = [
        RecordState::Pending,
        RecordState::Running,
        RecordState::Waiting,
        RecordState::Retrying,
        RecordState::Succeeded,
        RecordState::Failed,
        RecordState::Parked,
        RecordState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::Pending => "pending",
            RecordState::Running => "running",
            RecordState::Waiting => "waiting",
            RecordState::Retrying => "retrying",
            RecordState::Succeeded => "succeeded",
            RecordState::Failed => "failed",
            RecordState::Parked => "parked",
            RecordState::Cancelled => "cancelled",
        }
    }

    /// Finished for good unless an operator acts (or a provider reverses a
    /// result it already gave).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RecordState::Succeeded | RecordState::Failed | RecordState::Cancelled
        )
    }

    /// Resting states that only an operator (or a reversal) moves: the
    /// terminal ones and `parked`.
    pub fn is_at_rest(self) -> bool {
        self.is_terminal() || self == RecordState::Parked
    }

    /// States that carry a `next_run_at`: the ones a worker will pick up
    /// (a `running` record's `next_run_at` is its lease expiry).
    pub fn is_scheduled(self) -> bool {
        !self.is_at_rest()
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state name that is not one of [`RecordState::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown record state `{0}`")]
pub struct UnknownState(pub String);

impl FromStr for RecordState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RecordState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// What a worker concluded after one pass over a record it had leased.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkResult {
    /// Every required step is done.
    Completed,
    /// Some steps finished and others are ready now.
    Advanced,
    /// A provider job is in flight (poll or callback pending).
    Waiting,
    /// An attempt failed and the next one is scheduled.
    RetryScheduled,
    /// Nothing was attempted (breaker open, provider paused, rate limit):
    /// due again later, no attempt spent.
    Deferred,
    /// A required step failed permanently.
    Failed,
    /// Attempts or deadline exhausted, or an unknown reply: a human decides.
    Parked,
}

impl WorkResult {
    pub const ALL: [WorkResult; 7] = [
        WorkResult::Completed,
        WorkResult::Advanced,
        WorkResult::Waiting,
        WorkResult::RetryScheduled,
        WorkResult::Deferred,
        WorkResult::Failed,
        WorkResult::Parked,
    ];
}

/// What happens when a provider contradicts a result already handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReversalPolicy {
    /// Park the record for a human.
    Park,
    /// Re-run from the reversed step.
    Rerun,
    /// Keep an event and change nothing.
    Record,
}

impl ReversalPolicy {
    pub const ALL: [ReversalPolicy; 3] = [
        ReversalPolicy::Park,
        ReversalPolicy::Rerun,
        ReversalPolicy::Record,
    ];
}

/// The actions an operator can take on a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OperatorAction {
    /// Due now, with a fresh attempt budget for the current step.
    Retry,
    /// Stop and wait for a human.
    Park,
    /// Continue a parked record where it stopped.
    Resume,
    /// Stop for good.
    Cancel,
    /// Re-run a chosen step and everything after it (may pay again).
    ReplayFrom,
    /// A call whose outcome was not known did take effect: continue with
    /// the job the provider made (an operator checked), nothing sent again.
    TookEffect,
    /// End a sleep now, before its wake time.
    Wake,
    /// Approve a step that waits for an approval.
    Approve,
    /// Reject a step that waits for an approval.
    Reject,
    /// End a step that waits for a signal (through the API).
    Signal,
    /// Run the undo calls of the succeeded steps, last finished first.
    Undo,
}

impl OperatorAction {
    pub const ALL: [OperatorAction; 11] = [
        OperatorAction::Retry,
        OperatorAction::Park,
        OperatorAction::Resume,
        OperatorAction::Cancel,
        OperatorAction::ReplayFrom,
        OperatorAction::TookEffect,
        OperatorAction::Wake,
        OperatorAction::Approve,
        OperatorAction::Reject,
        OperatorAction::Signal,
        OperatorAction::Undo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OperatorAction::Retry => "retry",
            OperatorAction::Park => "park",
            OperatorAction::Resume => "resume",
            OperatorAction::Cancel => "cancel",
            OperatorAction::ReplayFrom => "replay",
            OperatorAction::TookEffect => "took_effect",
            OperatorAction::Wake => "wake",
            OperatorAction::Approve => "approve",
            OperatorAction::Reject => "reject",
            OperatorAction::Signal => "signal",
            OperatorAction::Undo => "undo",
        }
    }
}

impl fmt::Display for OperatorAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OperatorAction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OperatorAction::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| format!("unknown action `{s}`"))
    }
}

/// Everything that can move a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// A worker leases a due record.
    Claim,
    /// A worker's lease ran out without a result (crash, freeze, partition).
    LeaseExpired,
    /// A worker gives its lease back on graceful shutdown; no attempt spent.
    Release,
    /// A worker finished a pass over a record it holds.
    Worked(WorkResult),
    /// A provider changed its mind about a result already handled.
    Reversed(ReversalPolicy),
    /// A human acted.
    Operator(OperatorAction),
}

impl Trigger {
    /// Every trigger, for exhaustive tests.
    pub fn all() -> Vec<Trigger> {
        let mut all = vec![Trigger::Claim, Trigger::LeaseExpired, Trigger::Release];
        all.extend(WorkResult::ALL.map(Trigger::Worked));
        all.extend(ReversalPolicy::ALL.map(Trigger::Reversed));
        all.extend(OperatorAction::ALL.map(Trigger::Operator));
        all
    }

    /// The stable event kind written for this trigger.
    pub fn kind(self) -> &'static str {
        match self {
            Trigger::Claim => "claimed",
            Trigger::LeaseExpired => "lease_expired",
            Trigger::Release => "released",
            Trigger::Worked(r) => match r {
                WorkResult::Completed => "completed",
                WorkResult::Advanced => "advanced",
                WorkResult::Waiting => "waiting",
                WorkResult::RetryScheduled => "retry_scheduled",
                WorkResult::Deferred => "deferred",
                WorkResult::Failed => "failed",
                WorkResult::Parked => "parked",
            },
            Trigger::Reversed(_) => "reversed",
            Trigger::Operator(a) => a.as_str(),
        }
    }

    pub fn is_operator(self) -> bool {
        matches!(self, Trigger::Operator(_))
    }
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

/// Why a trigger was refused. The record is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The trigger has no meaning in this state.
    #[error("`{trigger}` is not allowed while the record is {from}")]
    NotAllowed { from: RecordState, trigger: Trigger },
    /// A worker holds the record; acting now could lose the attempt's result.
    #[error("the record is running; try again when its current attempt ends")]
    Busy { trigger: Trigger },
}

impl TransitionError {
    /// Stable error code for APIs and the dashboard.
    pub fn code(&self) -> &'static str {
        match self {
            TransitionError::NotAllowed { .. } => "transition_not_allowed",
            TransitionError::Busy { .. } => "record_busy",
        }
    }
}

/// The transition table. Pure and total: every (state, trigger) pair is
/// either a new state or a typed refusal.
pub fn transition(from: RecordState, trigger: Trigger) -> Result<RecordState, TransitionError> {
    use OperatorAction as A;
    use RecordState as S;

    let not_allowed = Err(TransitionError::NotAllowed { from, trigger });
    let busy = Err(TransitionError::Busy { trigger });

    match trigger {
        Trigger::Claim => match from {
            S::Pending | S::Retrying | S::Waiting => Ok(S::Running),
            _ => not_allowed,
        },
        Trigger::LeaseExpired | Trigger::Release => match from {
            S::Running => Ok(S::Pending),
            _ => not_allowed,
        },
        Trigger::Worked(result) => match from {
            S::Running => Ok(match result {
                WorkResult::Completed => S::Succeeded,
                WorkResult::Advanced | WorkResult::Deferred => S::Pending,
                WorkResult::Waiting => S::Waiting,
                WorkResult::RetryScheduled => S::Retrying,
                WorkResult::Failed => S::Failed,
                WorkResult::Parked => S::Parked,
            }),
            _ => not_allowed,
        },
        Trigger::Reversed(policy) => match (from, policy) {
            // Recording never moves anything, and a cancelled record stays
            // cancelled: the operator's decision outranks the provider's.
            (_, ReversalPolicy::Record) | (S::Cancelled, _) => Ok(from),
            (S::Running, _) => busy,
            (_, ReversalPolicy::Park) => Ok(S::Parked),
            (_, ReversalPolicy::Rerun) => Ok(S::Pending),
        },
        Trigger::Operator(action) => {
            if from == S::Running {
                return busy;
            }
            match (action, from) {
                (A::Retry, S::Parked | S::Failed | S::Retrying) => Ok(S::Pending),
                // Parking a parked record sets (or clears) its condition.
                (A::Park, S::Pending | S::Retrying | S::Waiting | S::Parked) => Ok(S::Parked),
                (A::Resume | A::TookEffect, S::Parked) => Ok(S::Pending),
                (A::Cancel, S::Pending | S::Retrying | S::Waiting | S::Parked) => Ok(S::Cancelled),
                (A::Wake, S::Waiting) => Ok(S::Pending),
                // A decision or a signal may also come once the wait ran
                // past its timeout (parked), or while another step is due.
                (
                    A::Approve | A::Reject | A::Signal,
                    S::Waiting | S::Pending | S::Retrying | S::Parked,
                ) => Ok(S::Pending),
                (A::Undo, S::Failed | S::Parked | S::Cancelled) => Ok(S::Pending),
                (A::ReplayFrom, S::Succeeded | S::Failed | S::Parked | S::Cancelled) => {
                    Ok(S::Pending)
                }
                _ => not_allowed,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn any_trigger() -> impl Strategy<Value = Trigger> {
        proptest::sample::select(Trigger::all())
    }

    fn any_state() -> impl Strategy<Value = RecordState> {
        proptest::sample::select(RecordState::ALL.to_vec())
    }

    #[test]
    fn state_names_round_trip() {
        for s in RecordState::ALL {
            assert_eq!(s.as_str().parse::<RecordState>(), Ok(s));
            assert_eq!(
                serde_json::to_value(s).ok(),
                Some(serde_json::json!(s.as_str()))
            );
        }
        assert!("done".parse::<RecordState>().is_err());
    }

    #[test]
    fn every_state_is_reachable_from_pending() {
        let mut seen = BTreeSet::from([RecordState::Pending]);
        let mut frontier = vec![RecordState::Pending];
        while let Some(s) = frontier.pop() {
            for t in Trigger::all() {
                if let Ok(next) = transition(s, t) {
                    if seen.insert(next) {
                        frontier.push(next);
                    }
                }
            }
        }
        assert_eq!(seen.len(), RecordState::ALL.len(), "reached only {seen:?}");
    }

    #[test]
    fn every_operator_action_on_every_state_is_defined_or_refused() {
        let mut allowed = 0;
        for from in RecordState::ALL {
            for action in OperatorAction::ALL {
                match transition(from, Trigger::Operator(action)) {
                    Ok(to) => {
                        allowed += 1;
                        assert_ne!(to, RecordState::Running, "{action} on {from}");
                        assert_ne!(to, RecordState::Succeeded, "{action} on {from}");
                    }
                    Err(TransitionError::Busy { .. }) => assert_eq!(from, RecordState::Running),
                    Err(TransitionError::NotAllowed { from: f, trigger }) => {
                        assert_eq!(f, from);
                        assert_eq!(trigger, Trigger::Operator(action));
                        assert_ne!(from, RecordState::Running, "running must answer busy");
                    }
                }
            }
        }
        // The table is not degenerate: operators can do real work.
        assert!(allowed >= 12, "only {allowed} operator transitions allowed");
    }

    #[test]
    fn the_documented_operator_moves_hold() {
        use OperatorAction as A;
        use RecordState as S;
        let op = |s, a| transition(s, Trigger::Operator(a));
        assert_eq!(op(S::Parked, A::Retry), Ok(S::Pending));
        assert_eq!(op(S::Failed, A::Retry), Ok(S::Pending));
        assert_eq!(op(S::Waiting, A::Park), Ok(S::Parked));
        assert_eq!(op(S::Parked, A::Resume), Ok(S::Pending));
        assert_eq!(op(S::Parked, A::Park), Ok(S::Parked), "a new condition");
        assert_eq!(op(S::Pending, A::Cancel), Ok(S::Cancelled));
        assert_eq!(op(S::Succeeded, A::ReplayFrom), Ok(S::Pending));
        assert!(op(S::Succeeded, A::Cancel).is_err());
        assert!(op(S::Cancelled, A::Resume).is_err());
        assert!(matches!(
            op(S::Running, A::Park),
            Err(TransitionError::Busy { .. })
        ));
    }

    proptest! {
        /// Any sequence of triggers from a fresh record: each step is either a
        /// defined move or a refusal that leaves the state unchanged; running
        /// is only entered by a claim; success only comes from a worker.
        /// (Found by this test: `Reversed(Record)` is a self-loop on every
        /// state, running included.)
        #[test]
        fn sequences_stay_inside_the_table(triggers in proptest::collection::vec(any_trigger(), 0..64)) {
            let mut state = RecordState::Pending;
            for t in triggers {
                match transition(state, t) {
                    Ok(next) => {
                        if next == RecordState::Running && state != RecordState::Running {
                            prop_assert_eq!(t, Trigger::Claim);
                        }
                        if next == RecordState::Succeeded && state != RecordState::Succeeded {
                            prop_assert_eq!(t, Trigger::Worked(WorkResult::Completed));
                        }
                        state = next;
                    }
                    Err(e) => {
                        // Refusals are typed and name what was refused.
                        match e {
                            TransitionError::NotAllowed { from, trigger } => {
                                prop_assert_eq!(from, state);
                                prop_assert_eq!(trigger, t);
                            }
                            TransitionError::Busy { trigger } => {
                                prop_assert_eq!(state, RecordState::Running);
                                prop_assert_eq!(trigger, t);
                            }
                        }
                    }
                }
            }
        }

        /// Terminal and parked records only leave through an operator action
        /// (or a provider reversal, which the step's policy governs).
        #[test]
        fn resting_states_only_leave_through_operators(from in any_state(), t in any_trigger()) {
            if from.is_at_rest() {
                if let Ok(to) = transition(from, t) {
                    if to != from {
                        prop_assert!(
                            t.is_operator() || matches!(t, Trigger::Reversed(_)),
                            "{} left {} via {}", from, to, t
                        );
                    }
                }
            }
        }

        /// Scheduled states always have somewhere to go without a human.
        #[test]
        fn scheduled_states_progress_without_humans(from in any_state()) {
            if from.is_scheduled() {
                let moves = Trigger::all()
                    .into_iter()
                    .filter(|t| !t.is_operator())
                    .filter(|t| transition(from, *t).is_ok_and(|to| to != from))
                    .count();
                prop_assert!(moves > 0, "{} is stuck without an operator", from);
            }
        }
    }
}
