//! `kind = "sleep"`: a durable timer. The step calls nothing; from its
//! first pass it waits `for` a duration (or `until` the time a template
//! gives), then succeeds. It holds no
//! worker meanwhile (its record is due again at the wake time, like any
//! wait), and the wake time follows from what is stored with the step
//! (its start, or an operator's earlier wake), so a restart, a reload or
//! an operator's retry of the record changes nothing.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::Registered;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::kind::{Confirms, Kind, Made, Render};
use crate::domain::pipeline::Step;
use crate::domain::step::{Decision, ms, park_or_fail};
use crate::domain::time::{format_ms, parse_utc};
use crate::domain::{StepState, StepWrite, UnixMs};
use crate::pipeline::{StepTemplates, invalid};

pub(super) const REGISTERED: Registered = Registered {
    name: "sleep",
    fields: &["for", "until"],
    label: "sleep",
    compile,
};

/// A step that sleeps from its first pass until its wake time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sleep {
    pub wake: Wake,
}

/// When a sleep ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// This long after the step's start (`for`).
    After(Duration),
    /// At the UTC time this template gives (`until`, by its id), read at
    /// the step's first pass; a time already past ends the sleep at once.
    At(String),
}

impl Kind for Sleep {
    fn name(&self) -> &'static str {
        "sleep"
    }

    fn calls(&self) -> bool {
        false
    }

    /// The wake time is the step's start (its first pass, kept by a retry)
    /// plus `for`, or the time `until` gives, unless an operator's wake set
    /// an earlier one (the deadline). A pass before it waits, holding the
    /// wake time as the step's deadline; one at or after it ends the
    /// sleep, with the wake time as the step's output
    /// (`steps.NAME.output.woke_at`). An `until` that gives no time ends
    /// the step as any step that cannot go on: `until_invalid`.
    fn settle(
        &self,
        step: &Step,
        write: &StepWrite,
        now: UnixMs,
        render: &Render<'_>,
    ) -> Option<Decision> {
        let mut w = write.clone();
        let started = *w.started_at.get_or_insert(now);
        let wake = match (w.deadline_at, &self.wake) {
            (Some(at), _) => at,
            (None, Wake::After(d)) => started + ms(*d),
            (None, Wake::At(id)) => match render(id).and_then(|t| parse_utc(&t)) {
                Ok(at) => at,
                Err(why) => {
                    let reason = format!("`until` gives no time: {why}");
                    return Some(park_or_fail(step, w, "until_invalid", reason, now));
                }
            },
        };
        if now >= wake {
            w.state = StepState::Succeeded;
            w.output = Some(json!({ "woke_at": wake }));
            w.finished_at = Some(now);
            w.next_run_at = None;
            w.reason = None;
        } else {
            w.state = StepState::Waiting;
            w.deadline_at = Some(wake);
            w.next_run_at = Some(wake);
            w.reason = Some(format!("asleep until {}", format_ms(wake)));
        }
        w.error_code = None;
        Some(Decision::keep(w))
    }

    fn made(&self) -> Made {
        Made::Neither("sleeps: it makes no call to settle")
    }

    fn confirms(&self) -> Confirms {
        Confirms::Never("a sleep step has no result to confirm")
    }
}

/// `for`, more than nothing, or `until`, a template; one of them.
fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let wake = match (s.sleep_for.map(|d| d.0), &s.until) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                t.key("until"),
                "give `for` or `until`, not both".into(),
            ));
        }
        (None, None) => {
            return Err(invalid(
                t.key("for"),
                "a `sleep` step needs `for`, how long it sleeps (e.g. \"24h\"), or \
                 `until`, a template giving a UTC time"
                    .into(),
            ));
        }
        (Some(d), None) if d.is_zero() => {
            return Err(invalid(t.key("for"), "must be more than 0".into()));
        }
        (Some(d), None) => Wake::After(d),
        (None, Some(source)) => Wake::At(t.add("until", source, false, false)?),
    };
    Ok(Arc::new(Sleep { wake }))
}
