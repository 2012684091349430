//! An action on many records at once: which of them it takes, and what a
//! bulk command always needs.

use super::{Record, rules};
use crate::domain::{OperatorAction, Trigger, transition};

/// A bulk action always says why: many records change at once.
pub const BULK_NEEDS_REASON: &str = "a bulk action needs a reason";

/// Whether `action` in bulk takes `rec`: its state allows it and the
/// action may be taken on it as one of many.
pub fn in_bulk(action: OperatorAction, rec: &Record) -> bool {
    transition(rec.state, Trigger::Operator(action)).is_ok() && rules(action).in_bulk(rec)
}
