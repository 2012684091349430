//! `kind = "callback"`: submit a job (its id at `job_id` in the reply) and
//! wait for a signed webhook naming it; by its deadline, park or poll.

use std::sync::Arc;

use super::Registered;
use crate::config::ConfigError;
use crate::config::pipeline::{CallbackFallback, StepConfig};
use crate::config::provider::check_pointer;
use crate::domain::kind::{Confirms, Kind, Made, Ready};
use crate::domain::pipeline::{CallbackSpec, Fallback, PollSpec, Step};
use crate::domain::step::{Before, Decision, callback_due, ms, park_or_fail};
use crate::domain::{StepWrite, UnixMs};
use crate::pipeline::{StepTemplates, invalid};

pub(super) const REGISTERED: Registered = Registered {
    name: "callback",
    fields: &["job_id", "poll", "callback", "timeout", "retry", "undo"],
    label: "callback",
    compile,
};

/// A submitted job whose end a webhook reports.
#[derive(Debug, Clone)]
pub struct Callback {
    /// JSON pointer to the job id in the submit reply.
    pub job_id: String,
    pub callback: CallbackSpec,
}

impl Kind for Callback {
    fn name(&self) -> &'static str {
        "callback"
    }

    fn job_pointer(&self) -> Option<&str> {
        Some(&self.job_id)
    }

    fn poll(&self) -> Option<&PollSpec> {
        match &self.callback.fallback {
            Fallback::Poll(poll) => Some(poll),
            Fallback::Park => None,
        }
    }

    fn callback(&self) -> Option<&CallbackSpec> {
        Some(&self.callback)
    }

    /// With a job: deliveries are applied; before the callback deadline
    /// the step waits for one; after it, it parks or polls (its fallback).
    fn ready(&self, step: &Step, write: &StepWrite, deliveries: bool, now: UnixMs) -> Ready {
        if write.job_id.is_none() {
            return Ready::Call { polling: false };
        }
        let due = callback_due(step, write).unwrap_or(now);
        if deliveries {
            return Ready::Done(Box::new(Before::Deliveries));
        }
        if now < due {
            let mut w = write.clone();
            w.next_run_at = Some(due);
            return Ready::Done(Box::new(Before::Settled(Decision::keep(w))));
        }
        if matches!(self.callback.fallback, Fallback::Park) {
            let reason = "no callback arrived before the callback deadline".into();
            let d = park_or_fail(step, write.clone(), "callback_timeout", reason, now);
            return Ready::Done(Box::new(Before::Settled(d)));
        }
        Ready::Call { polling: true }
    }

    /// Wakes at the callback deadline (a delivery before then wakes the
    /// record earlier); the step's deadline adds the polling time of a
    /// `poll` fallback.
    fn submitted(&self, mut w: StepWrite, after: UnixMs) -> StepWrite {
        let extra = self.poll().map_or(0, |p| ms(p.deadline));
        w.next_run_at = Some(after + ms(self.callback.deadline));
        w.deadline_at = Some(after + ms(self.callback.deadline) + extra);
        w
    }

    /// The wait for a webhook is not rebuilt from an operator's word.
    fn made(&self) -> Made {
        Made::Neither("waits for a callback: retry it (it may charge again) or cancel")
    }

    fn confirms(&self) -> Confirms {
        Confirms::Never(
            "a callback step is told of changes by its webhooks; confirm a \
             `request` or `submit_poll` step",
        )
    }
}

fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let job_id = super::job_id(s, t, "callback")?;
    let poll = super::poll(s, t)?;
    let Some(cb) = &s.callback else {
        return Err(invalid(
            t.key("callback"),
            "a `callback` step needs `callback = { job_id = ... }`".into(),
        ));
    };
    check_pointer(&cb.job_id).map_err(|m| invalid(t.key("callback.job_id"), m))?;
    let fallback = match (cb.fallback, poll) {
        (CallbackFallback::Park, _) => Fallback::Park,
        (CallbackFallback::Poll, Some(poll)) => Fallback::Poll(poll),
        (CallbackFallback::Poll, None) => {
            return Err(invalid(
                t.key("callback.fallback"),
                "`fallback = \"poll\"` needs a `poll` request".into(),
            ));
        }
    };
    let callback = CallbackSpec {
        delivery_job_id: cb.job_id.clone(),
        deadline: cb.deadline.0,
        fallback,
    };
    Ok(Arc::new(Callback { job_id, callback }))
}
