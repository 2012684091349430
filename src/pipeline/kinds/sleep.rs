//! `kind = "sleep"`: a durable timer. The step calls nothing; from its
//! first pass it waits `for` a duration, then succeeds. It holds no
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
use crate::domain::kind::{Confirms, Kind, Made};
use crate::domain::pipeline::Step;
use crate::domain::step::{Decision, ms};
use crate::domain::time::format_ms;
use crate::domain::{StepState, StepWrite, UnixMs};
use crate::pipeline::{StepTemplates, invalid};

pub(super) const REGISTERED: Registered = Registered {
    name: "sleep",
    fields: &["for"],
    label: "sleep",
    compile,
};

/// A step that sleeps `duration` from its first pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sleep {
    pub duration: Duration,
}

impl Kind for Sleep {
    fn name(&self) -> &'static str {
        "sleep"
    }

    fn calls(&self) -> bool {
        false
    }

    /// The wake time is the step's start (its first pass, kept by a retry)
    /// plus `for`, unless an operator's wake set an earlier one (the
    /// deadline). A pass before it waits, holding the wake time as the
    /// step's deadline; one at or after it ends the sleep, with the wake
    /// time as the step's output (`steps.NAME.output.woke_at`).
    fn settle(&self, _step: &Step, write: &StepWrite, now: UnixMs) -> Option<Decision> {
        let mut w = write.clone();
        let started = *w.started_at.get_or_insert(now);
        let wake = w.deadline_at.unwrap_or(started + ms(self.duration));
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

/// `for`, more than nothing.
fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let Some(duration) = s.sleep_for.map(|d| d.0) else {
        return Err(invalid(
            t.key("for"),
            "a `sleep` step needs `for`, how long it sleeps (e.g. \"24h\")".into(),
        ));
    };
    if duration.is_zero() {
        return Err(invalid(t.key("for"), "must be more than 0".into()));
    }
    Ok(Arc::new(Sleep { duration }))
}
