//! Parked until a condition: a record parked by an operator (or by its
//! provider's outage policy) may name when it resumes by itself: at a
//! moment, or once its provider takes calls again. A record parked with no
//! condition waits for a human, as before. Pure: the engine reads the
//! providers' states and asks [`provider_ready`] how many may go.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::model::{BreakerState, ProviderState};
use super::time::{UnixMs, format_ms};

/// When a parked record resumes by itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ParkUntil {
    /// At this moment.
    Time { at: UnixMs },
    /// Once this provider takes calls again: its breaker no longer open,
    /// no operator pause, no "slow down" pause.
    Provider { provider: String },
}

/// What a record does while its provider's breaker is open (a provider's
/// `on_outage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutagePolicy {
    /// Wait, due again when the breaker lets a probe through (no attempt
    /// spent): the record stays scheduled.
    #[default]
    Defer,
    /// Park, until the provider takes calls again; then it resumes by
    /// itself. The records page shows who waits on what.
    ParkUntilHealthy,
}

/// The condition a records filter asks for, `Never` being none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UntilKind {
    Time,
    Provider,
    Never,
}

impl UntilKind {
    pub const ALL: [UntilKind; 3] = [UntilKind::Time, UntilKind::Provider, UntilKind::Never];

    pub fn as_str(self) -> &'static str {
        match self {
            UntilKind::Time => "time",
            UntilKind::Provider => "provider",
            UntilKind::Never => "never",
        }
    }

    pub fn parse(text: &str) -> Option<UntilKind> {
        UntilKind::ALL.into_iter().find(|k| k.as_str() == text)
    }
}

impl ParkUntil {
    /// As stored: `(park_until_at, park_until_provider)`.
    pub fn columns(until: Option<&ParkUntil>) -> (Option<UnixMs>, Option<&str>) {
        match until {
            Some(ParkUntil::Time { at }) => (Some(*at), None),
            Some(ParkUntil::Provider { provider }) => (None, Some(provider)),
            None => (None, None),
        }
    }

    /// From the stored columns (a time wins, though both are never set).
    pub fn from_columns(at: Option<UnixMs>, provider: Option<String>) -> Option<ParkUntil> {
        match (at, provider) {
            (Some(at), _) => Some(ParkUntil::Time { at }),
            (None, Some(provider)) => Some(ParkUntil::Provider { provider }),
            (None, None) => None,
        }
    }

    pub fn kind(&self) -> UntilKind {
        match self {
            ParkUntil::Time { .. } => UntilKind::Time,
            ParkUntil::Provider { .. } => UntilKind::Provider,
        }
    }

    /// The event detail naming the condition.
    pub fn detail(&self) -> serde_json::Value {
        serde_json::json!({ "until": self, "condition": self.to_string() })
    }
}

impl fmt::Display for ParkUntil {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParkUntil::Time { at } => write!(f, "until {}", format_ms(*at)),
            ParkUntil::Provider { provider } => {
                write!(f, "until provider `{provider}` is healthy")
            }
        }
    }
}

/// How many records parked for a provider may resume now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// It takes calls: every one.
    All,
    /// Its breaker's open interval is over (or it is half-open): a few,
    /// to make the probes that close it; the rest follow once it closes.
    Few(u32),
    /// Still open, or paused.
    No,
}

/// Whether a provider takes calls again, from the cluster's view of it
/// (`None`: never touched, so healthy). `probes` is its breaker's probe
/// count: that many may resume to probe a breaker due to close.
pub fn provider_ready(p: Option<&ProviderState>, probes: u32, now: UnixMs) -> Ready {
    let Some(p) = p else {
        return Ready::All;
    };
    if p.paused || p.throttled_until.is_some_and(|t| t > now) {
        return Ready::No;
    }
    match p.breaker {
        BreakerState::Closed => Ready::All,
        // (An open breaker with no end is due, as the breaker reads it.)
        BreakerState::Open if p.open_until.is_some_and(|t| t > now) => Ready::No,
        BreakerState::Open | BreakerState::HalfOpen => Ready::Few(probes.max(1)),
    }
}

/// Whether a time condition holds at `now`.
pub fn time_reached(until: &ParkUntil, now: UnixMs) -> bool {
    matches!(until, ParkUntil::Time { at } if *at <= now)
}

/// Why a park-until request is refused, said for the operator.
pub fn check(until: &ParkUntil, now: UnixMs) -> Result<(), String> {
    match until {
        ParkUntil::Time { at } if *at <= now => Err(format!(
            "the resume time {} has already passed",
            format_ms(*at)
        )),
        ParkUntil::Provider { provider } if provider.trim().is_empty() => {
            Err("the record has not called a provider yet: park it until a time instead".into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(breaker: BreakerState, open_until: Option<UnixMs>) -> ProviderState {
        ProviderState {
            breaker,
            open_until,
            ..ProviderState::new("p", 0)
        }
    }

    #[test]
    fn a_provider_is_ready_when_its_breaker_and_pauses_let_calls_through() {
        let now = 10_000;
        assert_eq!(provider_ready(None, 3, now), Ready::All);
        let closed = state(BreakerState::Closed, None);
        assert_eq!(provider_ready(Some(&closed), 3, now), Ready::All);
        let open = state(BreakerState::Open, Some(now + 1));
        assert_eq!(provider_ready(Some(&open), 3, now), Ready::No);
        let cooled = state(BreakerState::Open, Some(now));
        assert_eq!(provider_ready(Some(&cooled), 3, now), Ready::Few(3));
        let half = state(BreakerState::HalfOpen, None);
        assert_eq!(provider_ready(Some(&half), 0, now), Ready::Few(1));
        let paused = ProviderState {
            paused: true,
            ..closed.clone()
        };
        assert_eq!(provider_ready(Some(&paused), 3, now), Ready::No);
        let slowed = ProviderState {
            throttled_until: Some(now + 5),
            ..closed.clone()
        };
        assert_eq!(provider_ready(Some(&slowed), 3, now), Ready::No);
        let slowed_before = ProviderState {
            throttled_until: Some(now),
            ..closed
        };
        assert_eq!(provider_ready(Some(&slowed_before), 3, now), Ready::All);
    }

    #[test]
    fn a_condition_round_trips_through_its_columns_and_names_itself() {
        for until in [
            ParkUntil::Time {
                at: 1_764_666_000_000,
            },
            ParkUntil::Provider {
                provider: "sim".into(),
            },
        ] {
            let (at, p) = ParkUntil::columns(Some(&until));
            assert_eq!(
                ParkUntil::from_columns(at, p.map(str::to_owned)),
                Some(until.clone())
            );
            let json = serde_json::to_value(&until).unwrap();
            assert_eq!(serde_json::from_value::<ParkUntil>(json).unwrap(), until);
        }
        assert_eq!(ParkUntil::columns(None), (None, None));
        assert_eq!(ParkUntil::from_columns(None, None), None);
        let t = ParkUntil::Time {
            at: 1_764_666_000_000,
        };
        assert_eq!(t.to_string(), "until 2025-12-02T09:00:00.000Z");
        assert!(time_reached(&t, 1_764_666_000_000));
        assert!(!time_reached(&t, 1_764_665_999_999));
        assert!(check(&t, 1_764_666_000_000).is_err());
        assert!(check(&t, 1_764_665_999_999).is_ok());
        let p = ParkUntil::Provider {
            provider: "sim".into(),
        };
        assert_eq!(p.to_string(), "until provider `sim` is healthy");
        assert!(!time_reached(&p, i64::MAX));
        for k in UntilKind::ALL {
            assert_eq!(UntilKind::parse(k.as_str()), Some(k));
        }
    }
}
