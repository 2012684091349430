//! `wake`: an operator ends a record's sleep now, before its wake time
//! (audited, with a reason): its sleeping steps are due at once, and each
//! ends at its next pass as it would have at its wake time.

use super::{ActionRequest, Facts, Record, Refused, Rules, StepChange, StepRun, invalid};
use crate::domain::StepState;
use crate::domain::awaiting::Awaits;

pub(super) struct Wake;

/// The steps of `runs` asleep: waiting on time alone (no job, no
/// provider, not for a person or a signal), which only a sleep does.
fn asleep(runs: &[StepRun]) -> Vec<String> {
    runs.iter()
        .filter(|r| r.state == StepState::Waiting && r.job_id.is_none() && r.provider.is_none())
        .filter(|r| Awaits::of(r).is_none())
        .map(|r| r.step.clone())
        .collect()
}

impl Rules for Wake {
    fn noun(&self) -> &'static str {
        "a wake"
    }

    fn offered(&self, _rec: &Record, facts: &Facts) -> bool {
        !asleep(facts.runs).is_empty()
    }

    fn steps(
        &self,
        _rec: &Record,
        runs: &[StepRun],
        req: &ActionRequest,
        _: bool,
    ) -> Result<StepChange, Refused> {
        let steps = asleep(runs);
        if steps.is_empty() {
            return invalid("nothing_asleep", "no step of this record is asleep");
        }
        Ok(StepChange::EndWait {
            steps,
            reason: format!("woken by {}", req.actor),
        })
    }
}
