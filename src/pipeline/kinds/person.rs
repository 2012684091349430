//! What `approval` and `signal` share: the step calls nothing and waits,
//! holding no worker (its record is due again only at its timeout, or
//! when a decision or a signal arrives), its run marked with what it waits
//! for; past its timeout it parks, fails or goes on, as the step says.

use std::time::Duration;

use serde_json::{Value, json};

use crate::config::ConfigError;
use crate::config::pipeline::{OnTimeout, StepConfig};
use crate::domain::awaiting::Awaits;
use crate::domain::kind::{Confirms, Kind, Made, Render};
use crate::domain::pipeline::Step;
use crate::domain::step::{Decision, Park, ms};
use crate::domain::time::format_ms;
use crate::domain::{StepState, StepWrite, UnixMs};
use crate::pipeline::{StepTemplates, invalid};

/// The settings both kinds read.
pub(super) const FIELDS: &[&str] = &["timeout", "on_timeout", "timeout_output"];

/// A wait for a person or a signal.
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    pub awaits: Awaits,
    pub timeout: Option<Timeout>,
}

/// How long the wait lasts and what its end does.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeout {
    pub after: Duration,
    pub then: OnTimeout,
    /// The step's output when it goes on (`continue`).
    pub output: Value,
}

impl Wait {
    /// A pass over the waiting step: from its first pass (or a retry's)
    /// it waits until its timeout, holding that as its deadline; at or
    /// after it, the timeout's course.
    pub fn settle(&self, write: &StepWrite, now: UnixMs) -> Decision {
        let mut w = write.clone();
        w.started_at.get_or_insert(now);
        // A retry resets the run to pending, and a resume after the
        // timeout finds it timed out: a new window from then.
        let waiting = crate::domain::awaiting::holds(w.state, w.error_code.as_deref());
        let deadline = match &self.timeout {
            None => None,
            Some(_) if waiting && w.deadline_at.is_some() => w.deadline_at,
            Some(t) => Some(now.saturating_add(ms(t.after))),
        };
        if let (Some(t), Some(at)) = (&self.timeout, deadline) {
            if now >= at {
                return self.timed_out(w, t, now);
            }
        }
        let what = self.awaits.what();
        w.state = StepState::Waiting;
        w.deadline_at = deadline;
        w.next_run_at = deadline;
        w.error_code = Some(self.awaits.code().to_owned());
        w.reason = Some(match deadline {
            Some(at) => format!("waiting for {what} until {}", format_ms(at)),
            None => format!("waiting for {what}"),
        });
        Decision::keep(w)
    }

    fn timed_out(&self, mut w: StepWrite, t: &Timeout, now: UnixMs) -> Decision {
        let code = self.awaits.timed_out_code();
        let reason = format!(
            "no {} came within {}",
            self.awaits.noun(),
            crate::config::HumanDuration(t.after)
        );
        w.next_run_at = None;
        w.reason = Some(reason.clone());
        match t.then {
            OnTimeout::Park => {
                // Still waiting: a decision or a signal can still end it.
                w.error_code = Some(code.to_owned());
                let park = Park {
                    code: code.to_owned(),
                    reason,
                    until: None,
                };
                Decision {
                    write: w,
                    park: Some(park),
                }
            }
            OnTimeout::Fail => {
                w.state = StepState::Failed;
                w.error_code = Some(code.to_owned());
                w.finished_at = Some(now);
                Decision::keep(w)
            }
            OnTimeout::Continue => {
                w.state = StepState::Succeeded;
                w.error_code = None;
                w.output = Some(t.output.clone());
                w.finished_at = Some(now);
                Decision::keep(w)
            }
        }
    }
}

/// Both kinds are this wait; which one, its `awaits` says.
impl Kind for Wait {
    fn name(&self) -> &'static str {
        self.awaits.noun()
    }

    fn calls(&self) -> bool {
        false
    }

    fn settle(
        &self,
        _step: &Step,
        write: &StepWrite,
        now: UnixMs,
        _render: &Render<'_>,
    ) -> Option<Decision> {
        Some(Wait::settle(self, write, now))
    }

    fn made(&self) -> Made {
        Made::Neither(match self.awaits {
            Awaits::Approval => "waits for a decision: approve or reject it",
            Awaits::Signal => "waits for a signal: send it through the API",
        })
    }

    fn confirms(&self) -> Confirms {
        Confirms::Never("it has no provider's result to confirm")
    }
}

/// The step's wait for `awaits`, its `timeout` checked; `default` is the
/// output a `continue` gives when the step names none.
pub(super) fn compile(
    s: &StepConfig,
    t: &StepTemplates<'_>,
    awaits: Awaits,
    default: Value,
) -> Result<Wait, ConfigError> {
    let timeout = match (s.timeout.map(|d| d.0), s.on_timeout) {
        (None, None) if s.timeout_output.is_none() => None,
        (None, _) => {
            return Err(invalid(
                t.key("timeout"),
                "`on_timeout` and `timeout_output` need `timeout`, how long the step waits".into(),
            ));
        }
        (Some(d), _) if d.is_zero() => {
            return Err(invalid(t.key("timeout"), "must be more than 0".into()));
        }
        (Some(after), then) => {
            let then = then.unwrap_or_default();
            if s.timeout_output.is_some() && then != OnTimeout::Continue {
                return Err(invalid(
                    t.key("timeout_output"),
                    "is the output of `on_timeout = \"continue\"` only".into(),
                ));
            }
            Some(Timeout {
                after,
                then,
                output: s.timeout_output.clone().unwrap_or(default),
            })
        }
    };
    Ok(Wait { awaits, timeout })
}

/// The output a timed-out wait goes on with, unless the step names one.
pub(super) fn timed_out_output(extra: Option<(&str, &str)>) -> Value {
    let mut v = json!({ "timed_out": true });
    if let (Some((k, val)), Some(o)) = (extra, v.as_object_mut()) {
        o.insert(k.to_owned(), json!(val));
    }
    v
}
