//! The seam between a step's kind and the decisions every step shares.
//! Each kind (a call, a job polled or called back, a sleep, …) is one
//! module of `crate::pipeline::kinds`: its settings checked, its compiled form, and
//! its answers to this trait. The shared decisions (`step.rs`) ask the
//! kind; nothing outside a kind's module matches on which kind it is.

use std::fmt::Debug;

use super::StepWrite;
use super::UnixMs;
use super::pipeline::{CallbackSpec, PollSpec, Step};
use super::step::{Before, Decision};

/// What a step kind answers. Every method but `name` has the answer of a
/// kind that makes one call whose reply is the result.
pub trait Kind: Debug + Send + Sync {
    /// The kind's name as configured (`kind = "..."`).
    fn name(&self) -> &'static str;

    /// Whether its steps call a provider (and so have a `provider` and a
    /// `request`).
    fn calls(&self) -> bool {
        true
    }

    /// For a kind that calls no provider: what a pass over its ready step
    /// decides (a wait, or its end); `render` renders one of the step's
    /// templates over what its pass sees. `None` for a kind that calls.
    fn settle(
        &self,
        _step: &Step,
        _write: &StepWrite,
        _now: UnixMs,
        _render: &Render<'_>,
    ) -> Option<Decision> {
        None
    }

    /// JSON pointer to the job id in the submit reply: set for a kind that
    /// submits a job and follows it; `None` when the call's reply is the
    /// result.
    fn job_pointer(&self) -> Option<&str> {
        None
    }

    /// The request that asks about a submitted job, if the step ever polls.
    fn poll(&self) -> Option<&PollSpec> {
        None
    }

    /// How the step waits for webhooks, if it does.
    fn callback(&self) -> Option<&CallbackSpec> {
        None
    }

    /// The record of another pipeline the step starts and waits for, if
    /// it does (`kind = "pipeline"`).
    fn child(&self) -> Option<&super::child::ChildSpec> {
        None
    }

    /// A ready step, before the checks every step shares (its clock, its
    /// deadline, a lookup): whether its call polls the job it has, or what
    /// it does without a call (waits, applies deliveries, gives up).
    fn ready(&self, _step: &Step, _write: &StepWrite, _deliveries: bool, _now: UnixMs) -> Ready {
        Ready::Call { polling: false }
    }

    /// A submit was accepted (its job id is kept, the step waits): when
    /// the step wakes next, and its deadline.
    fn submitted(&self, write: StepWrite, _after: UnixMs) -> StepWrite {
        write
    }

    /// What an operator gives when saying a call whose outcome was not
    /// known took effect.
    fn made(&self) -> Made {
        Made::Output
    }

    /// How a `confirm` of this kind asks the provider again.
    fn confirms(&self) -> Confirms {
        Confirms::OwnRequest
    }

    /// Whether a step of this kind may run once per item (`for_each`):
    /// one call or one job per item.
    fn for_each(&self) -> bool {
        false
    }
}

/// Renders the template of this id over what the step's pass sees (its
/// record, input and the outputs it needs), or says why it cannot.
pub type Render<'a> = dyn Fn(&str) -> Result<String, String> + 'a;

/// A ready step's course before the shared checks.
#[derive(Debug, Clone, PartialEq)]
pub enum Ready {
    /// Go on to call: a poll of the step's job, or its own call.
    Call { polling: bool },
    /// Decided without a call.
    Done(Box<Before>),
}

/// What a call that took effect made, as an operator says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Made {
    /// A job: the operator names its id and the step follows it.
    Job,
    /// A result: the operator gives the step's outputs.
    Output,
    /// Nothing an operator can give here; why, and what to do instead.
    Neither(&'static str),
}

/// How a kind's results are confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirms {
    /// Only by a request of the confirmation's own (`confirm.path`).
    OwnRequest,
    /// By the job's poll, or by a request of its own.
    PollOrOwn,
    /// Not at all; why.
    Never(&'static str),
}
