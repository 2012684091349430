//! `cancel`: stop for good; the steps stay as they are.

use super::{ActionRequest, Record, Refused, Rules, StepChange, StepRun};

pub(super) struct Cancel;

impl Rules for Cancel {
    fn noun(&self) -> &'static str {
        "a cancel"
    }

    fn steps(
        &self,
        _: &Record,
        _: &[StepRun],
        _: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        Ok(StepChange::Keep)
    }
}
