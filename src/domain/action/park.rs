//! `park`: stop and wait for a person, with a reason, optionally until a
//! condition holds (a time, a provider taking calls again).

use super::{ActionRequest, Record, Rules, Takes};
use crate::domain::RecordState;
use crate::domain::park::ParkUntil;
use serde_json::Value;

pub(super) struct Park;

impl Rules for Park {
    fn noun(&self) -> &'static str {
        "parking"
    }

    fn takes(&self) -> Takes {
        Takes {
            until: true,
            ..Takes::default()
        }
    }

    fn needs_reason(&self) -> bool {
        true
    }

    /// Parking a parked record sets its condition: one record at a time,
    /// never in bulk (that would erase what each waits for).
    fn in_bulk(&self, rec: &Record) -> bool {
        rec.state != RecordState::Parked
    }

    fn detail(&self, _: &Record, req: &ActionRequest, _: Option<&ParkUntil>) -> Option<Value> {
        req.until.as_ref().map(ParkUntil::detail)
    }
}
