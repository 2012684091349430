//! The metric handles of a provider's calls (`ballast_attempts_total` by
//! outcome, `ballast_attempt_duration_seconds`), registered the first time
//! a step calls with each outcome and kept: a call then finds its step's
//! handles by name and adds to atomics, instead of building its labels and
//! looking them up in the recorder's registry again.
//!
//! A handle belongs to the recorder installed when it was registered: the
//! server installs its recorder before any engine is built
//! (`app::run_on_clock`), so every provider runtime's calls are counted.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use metrics::{Counter, Histogram};

use crate::domain::Outcome;

/// One provider's handles, by step.
#[derive(Default)]
pub(crate) struct CallMetrics {
    by_step: Mutex<HashMap<String, StepHandles>>,
}

struct StepHandles {
    /// By the outcome's place in [`Outcome::ALL`]; registered when first
    /// seen, so an outcome never met shows no series.
    outcomes: Vec<Option<Counter>>,
    duration: Histogram,
}

impl StepHandles {
    fn new(provider: &str, step: &str) -> Self {
        let labels = [("provider", provider.to_owned()), ("step", step.to_owned())];
        StepHandles {
            outcomes: vec![None; Outcome::ALL.len()],
            duration: metrics::histogram!("ballast_attempt_duration_seconds", &labels),
        }
    }

    fn record(&mut self, (provider, step): (&str, &str), outcome: Outcome, took: Duration) {
        self.duration.record(took.as_secs_f64());
        let at = Outcome::ALL.iter().position(|o| *o == outcome);
        if let Some(slot) = at.and_then(|i| self.outcomes.get_mut(i)) {
            slot.get_or_insert_with(|| {
                metrics::counter!(
                    "ballast_attempts_total",
                    &[
                        ("provider", provider.to_owned()),
                        ("step", step.to_owned()),
                        ("outcome", outcome.as_str().to_owned()),
                    ]
                )
            })
            .increment(1);
        }
    }
}

impl CallMetrics {
    /// Counts a call of `provider` by `step` that ended in `outcome` after
    /// `took`.
    pub(crate) fn count(&self, provider: &str, step: &str, outcome: Outcome, took: Duration) {
        let mut by_step = self.by_step.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = by_step.get_mut(step) {
            h.record((provider, step), outcome, took);
            return;
        }
        let mut h = StepHandles::new(provider, step);
        h.record((provider, step), outcome, took);
        by_step.insert(step.to_owned(), h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counted through kept handles as `metrics::counter!` would count:
    /// the same series, each outcome apart, none for an outcome never met.
    #[test]
    fn calls_are_counted_by_step_and_outcome() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let calls = CallMetrics::default();
        metrics::with_local_recorder(&recorder, || {
            for outcome in [Outcome::Success, Outcome::Success, Outcome::Fail] {
                calls.count("acme", "charge", outcome, Duration::from_millis(20));
            }
            calls.count("acme", "refund", Outcome::Success, Duration::from_millis(5));
        });
        let text = handle.render();
        for line in [
            r#"ballast_attempts_total{provider="acme",step="charge",outcome="success"} 2"#,
            r#"ballast_attempts_total{provider="acme",step="charge",outcome="fail"} 1"#,
            r#"ballast_attempts_total{provider="acme",step="refund",outcome="success"} 1"#,
            r#"ballast_attempt_duration_seconds_count{provider="acme",step="charge"} 3"#,
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains(r#"outcome="retry""#), "{text}");
    }
}
