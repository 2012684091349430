//! Time as the domain sees it: unix milliseconds, passed in through a `Clock`
//! so rules can be tested without sleeping.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the unix epoch, UTC. Stored as a 64-bit integer on both
/// backends so that ordering and arithmetic are identical everywhere.
pub type UnixMs = i64;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> UnixMs;

    /// [`now_ms`](Self::now_ms) as a `SystemTime` (for HTTP dates).
    fn now_system(&self) -> SystemTime {
        UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(self.now_ms()).unwrap_or(0))
    }
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> UnixMs {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0)
    }
}

/// Formats a timestamp as RFC 3339 (UTC, millisecond precision) for people.
pub fn format_ms(ms: UnixMs) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    match time::OffsetDateTime::from_unix_timestamp_nanos(nanos) {
        Ok(t) => {
            let fmt = time::macros::format_description!(
                "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
            );
            t.format(&fmt).unwrap_or_else(|_| ms.to_string())
        }
        Err(_) => ms.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_epoch_and_millis() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }

    #[test]
    fn system_clock_is_after_2024() {
        assert!(SystemClock.now_ms() > 1_704_067_200_000);
    }
}
