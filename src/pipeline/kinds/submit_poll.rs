//! `kind = "submit_poll"`: submit a job, keep its id, poll until it ends.

use std::sync::Arc;

use super::Registered;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::kind::{Confirms, Kind, Made, Ready};
use crate::domain::pipeline::{PollSpec, Step};
use crate::domain::step::ms;
use crate::domain::{StepWrite, UnixMs};
use crate::pipeline::{StepTemplates, invalid};

pub(super) const REGISTERED: Registered = Registered {
    name: "submit_poll",
    // A `callback` table on a `submit_poll` step has always been ignored:
    // definitions pinned with one must still compile.
    fields: &["job_id", "poll", "callback", "timeout", "retry", "undo"],
    label: "submit, poll",
    compile,
};

/// A submitted job, followed by polls.
#[derive(Debug, Clone)]
pub struct SubmitPoll {
    /// JSON pointer to the job id in the submit reply.
    pub job_id: String,
    pub poll: PollSpec,
}

impl Kind for SubmitPoll {
    fn name(&self) -> &'static str {
        "submit_poll"
    }

    fn for_each(&self) -> bool {
        true
    }

    fn job_pointer(&self) -> Option<&str> {
        Some(&self.job_id)
    }

    fn poll(&self) -> Option<&PollSpec> {
        Some(&self.poll)
    }

    /// With a job, the call is a poll; without, the submit.
    fn ready(&self, _step: &Step, write: &StepWrite, _deliveries: bool, _now: UnixMs) -> Ready {
        Ready::Call {
            polling: write.job_id.is_some(),
        }
    }

    /// The first poll comes `every` after the submit, and no later than the
    /// deadline (the last poll).
    fn submitted(&self, mut w: StepWrite, after: UnixMs) -> StepWrite {
        let deadline = after + ms(self.poll.deadline);
        w.next_run_at = Some((after + ms(self.poll.every)).min(deadline));
        w.deadline_at = Some(deadline);
        w
    }

    fn made(&self) -> Made {
        Made::Job
    }

    fn confirms(&self) -> Confirms {
        Confirms::PollOrOwn
    }
}

fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let job_id = super::job_id(s, t, "submit_poll")?;
    let Some(poll) = super::poll(s, t)? else {
        return Err(invalid(
            t.key("poll"),
            "a `submit_poll` step needs `poll = { path = ... }`".into(),
        ));
    };
    Ok(Arc::new(SubmitPoll { job_id, poll }))
}
