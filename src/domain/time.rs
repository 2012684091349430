//! Time as the domain sees it: unix milliseconds, passed in through a `Clock`
//! so rules can be tested without sleeping. This module is the one place
//! that reads the system's clocks (clippy's `disallowed-methods` refuses
//! them anywhere else): the wall clock in [`SystemClock`], the monotonic
//! clock in [`Clock::instant`] (tokio's, which `tokio::time::pause` drives).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the unix epoch, UTC. Stored as a 64-bit integer on both
/// backends so that ordering and arithmetic are identical everywhere.
pub type UnixMs = i64;

/// A future that a [`Clock`] resolves.
pub type ClockSleep<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// Wall time: what is stored, scheduled and compared with other nodes.
    fn now_ms(&self) -> UnixMs;

    /// [`now_ms`](Self::now_ms) as a `SystemTime` (for HTTP dates).
    fn now_system(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(u64::try_from(self.now_ms()).unwrap_or(0))
    }

    /// A monotonic reading, for how long something took in this process
    /// and for deadlines of its own waits (tokio's clock, so a test with
    /// paused time drives it too).
    fn instant(&self) -> tokio::time::Instant {
        #[allow(clippy::disallowed_methods)]
        tokio::time::Instant::now()
    }

    /// Resolves once [`now_ms`](Self::now_ms) has reached `at`: a wait
    /// whose end is a wall-clock time (a rate limit's next free place), so
    /// that a manual clock ends it when it is moved past `at`.
    fn sleep_until(&self, at: UnixMs) -> ClockSleep<'_> {
        let wait = u64::try_from(at.saturating_sub(self.now_ms())).unwrap_or(0);
        Box::pin(tokio::time::sleep(Duration::from_millis(wait)))
    }
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> UnixMs {
        #[allow(clippy::disallowed_methods)]
        let now = SystemTime::now();
        now.duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that moves only when told to: tests stop time, then advance it
/// past a backoff, a breaker's open interval or a deadline, and see what
/// the engine does then, without sleeping. Clones share one time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<tokio::sync::watch::Sender<UnixMs>>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: UnixMs) -> ManualClock {
        ManualClock {
            now: Arc::new(tokio::sync::watch::Sender::new(start)),
        }
    }

    /// Moves the clock forward by `ms` (never back), ending the waits that
    /// it passes.
    pub fn advance(&self, ms: u64) {
        let ms = i64::try_from(ms).unwrap_or(i64::MAX);
        self.now.send_modify(|t| *t = t.saturating_add(ms));
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> UnixMs {
        *self.now.borrow()
    }

    fn sleep_until(&self, at: UnixMs) -> ClockSleep<'_> {
        let mut moved = self.now.subscribe();
        Box::pin(async move {
            // The sender lives as long as `self`, so the wait ends only by
            // the clock reaching `at`.
            let _ = moved.wait_for(|t| *t >= at).await;
        })
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

/// Parses a UTC moment as people type it: RFC 3339 (`2026-12-02T09:00:00Z`,
/// any offset), or to the minute with or without the `Z`
/// (`2026-12-02T09:00Z`, `2026-12-02T09:00`, as a browser's
/// `datetime-local` input sends it, read as UTC), or a date (midnight UTC).
pub fn parse_utc(text: &str) -> Result<UnixMs, String> {
    use time::format_description::well_known::Rfc3339;
    use time::macros::format_description;
    let t = text.trim();
    let bad = || {
        format!(
            "invalid time `{t}`: expected UTC like `2026-12-02T09:00Z` or `2026-12-02T09:00:00Z`"
        )
    };
    let to_ms = |dt: time::OffsetDateTime| {
        i64::try_from(dt.unix_timestamp_nanos() / 1_000_000).map_err(|_| bad())
    };
    if let Ok(dt) = time::OffsetDateTime::parse(t, &Rfc3339) {
        return to_ms(dt);
    }
    let bare = t.strip_suffix('Z').unwrap_or(t).replacen(' ', "T", 1);
    let minute = format_description!("[year]-[month]-[day]T[hour]:[minute]");
    let second = format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]");
    let day = format_description!("[year]-[month]-[day]");
    if let Ok(dt) = time::PrimitiveDateTime::parse(&bare, &minute)
        .or_else(|_| time::PrimitiveDateTime::parse(&bare, &second))
    {
        return to_ms(dt.assume_utc());
    }
    if let Ok(d) = time::Date::parse(&bare, &day) {
        return to_ms(d.midnight().assume_utc());
    }
    Err(bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_utc_as_people_type_it() {
        let nine = 1_764_666_000_000;
        for t in [
            "2025-12-02T09:00:00Z",
            "2025-12-02T09:00:00.000Z",
            "2025-12-02T10:00:00+01:00",
            "2025-12-02T09:00Z",
            "2025-12-02T09:00",
            " 2025-12-02 09:00 ",
            "2025-12-02T09:00:00",
        ] {
            assert_eq!(parse_utc(t), Ok(nine), "{t}");
        }
        assert_eq!(parse_utc("2025-12-02"), Ok(nine - 9 * 3_600_000));
        for bad in ["", "tomorrow", "2025-13-02T09:00Z", "09:00"] {
            assert!(
                parse_utc(bad).unwrap_err().contains("invalid time"),
                "{bad}"
            );
        }
    }

    #[test]
    fn formats_epoch_and_millis() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }

    #[test]
    fn system_clock_is_after_2024() {
        assert!(SystemClock.now_ms() > 1_704_067_200_000);
    }

    fn ready(f: &mut ClockSleep<'_>) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        f.as_mut().poll(&mut cx).is_ready()
    }

    #[test]
    fn a_manual_clock_ends_waits_when_moved_past_them() {
        let clock = ManualClock::new(1_000);
        let mut wait = clock.sleep_until(1_500);
        assert!(!ready(&mut wait));
        clock.advance(499);
        assert!(!ready(&mut wait), "not yet at 1,500");
        clock.advance(1);
        assert!(ready(&mut wait));
        assert_eq!(clock.clone().now_ms(), 1_500, "clones share one time");
        // A wait already due ends at once.
        assert!(ready(&mut clock.sleep_until(1_200)));
    }
}
