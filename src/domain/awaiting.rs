//! Steps that wait for a person (`approval`) or a caller (`signal`): the
//! code a waiting step run carries, so that the records list, the pages
//! and the actions know what it waits for from the run alone, and what a
//! decision writes.

use serde_json::{Value, json};

use super::{StepRun, StepState, UnixMs};

/// What a step waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Awaits {
    /// An operator's approval or rejection.
    Approval,
    /// A signal through the API.
    Signal,
}

impl Awaits {
    pub const ALL: [Awaits; 2] = [Awaits::Approval, Awaits::Signal];

    /// The code its waiting step run (and its record) carries.
    pub fn code(self) -> &'static str {
        match self {
            Awaits::Approval => "awaiting_approval",
            Awaits::Signal => "awaiting_signal",
        }
    }

    /// The code of a wait that ran past its timeout.
    pub fn timed_out_code(self) -> &'static str {
        match self {
            Awaits::Approval => "approval_timed_out",
            Awaits::Signal => "signal_timed_out",
        }
    }

    /// What it waits for, as a noun.
    pub fn noun(self) -> &'static str {
        match self {
            Awaits::Approval => "approval",
            Awaits::Signal => "signal",
        }
    }

    /// What it waits for, in words.
    pub fn what(self) -> &'static str {
        match self {
            Awaits::Approval => "an approval",
            Awaits::Signal => "a signal",
        }
    }

    /// What `run` waits for, if it waits for a person or a signal (still,
    /// or past its timeout with its record parked).
    pub fn of(run: &StepRun) -> Option<Awaits> {
        Awaits::waiting(run.state, run.error_code.as_deref())
    }

    /// What a step run in `state` with `code` waits for, if anything.
    pub fn waiting(state: StepState, code: Option<&str>) -> Option<Awaits> {
        let code = code?;
        if state != StepState::Waiting {
            return None;
        }
        Awaits::ALL
            .into_iter()
            .find(|a| a.code() == code || a.timed_out_code() == code)
    }
}

/// Whether a step run in `state` with `code` is held by its wait: only
/// a decision, a signal or its timeout makes it due (not one parked past
/// its timeout and then resumed, which waits again).
pub fn holds(state: StepState, code: Option<&str>) -> bool {
    state == StepState::Waiting && Awaits::ALL.iter().any(|a| Some(a.code()) == code)
}

/// The step runs of `runs` waiting for `what`.
pub fn waiting_for(runs: &[StepRun], what: Awaits) -> Vec<&StepRun> {
    runs.iter()
        .filter(|r| Awaits::of(r) == Some(what))
        .collect()
}

/// An operator's decision on an approval step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Approved,
    Rejected,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Approved => "approved",
            Decision::Rejected => "rejected",
        }
    }
}

/// An approval step's output: the decision, its comment, who and when
/// (`steps.NAME.output.decision` in conditions).
pub fn decided(decision: Decision, comment: &str, by: &str, at: UnixMs) -> Value {
    json!({ "decision": decision.as_str(), "comment": comment, "by": by, "at": at })
}
