//! Pure types and rules of Ballast: record states, the transition table,
//! the stored shapes of records, steps, attempts and events. No I/O here but
//! the clock and the host's name (`time`, `host`), which every layer shares.

pub mod account;
pub mod action;
pub mod awaiting;
pub mod backoff;
pub mod breaker;
pub mod child;
pub mod claimed;
pub mod condition;
pub mod confirm;
pub mod diff;
pub mod each;
pub mod fair;
pub mod host;
pub mod kind;
pub mod login;
pub mod mask;
pub mod model;
pub mod notify;
pub mod park;
pub mod pass;
pub mod permits;
pub mod pipeline;
pub mod pointer;
pub mod request;
pub mod reversal;
pub mod rules;
pub mod schedule;
pub mod scope;
pub mod search;
pub mod state;
pub mod step;
pub mod time;
pub mod token;
pub mod trigger;
pub mod undo;

pub use model::*;
pub use state::{
    OperatorAction, RecordState, ReversalPolicy, TransitionError, Trigger, WorkResult, transition,
};
pub use time::{Clock, ManualClock, SystemClock, UnixMs};
