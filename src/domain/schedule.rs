//! When scheduled work falls due: a record enqueued for later (`run_at`,
//! `delay`).

use std::time::Duration;

use super::UnixMs;

/// The furthest ahead a record may be enqueued: a year and a month.
pub const MAX_AHEAD: Duration = Duration::from_secs(400 * 86_400);

/// When a record enqueued at `now` falls due: at `run_at` (a UTC moment as
/// [`parse_utc`](super::time::parse_utc) reads it), or `delay` after `now`,
/// or now. Not both; at most [`MAX_AHEAD`] ahead. A moment already past is
/// due now (a late enqueue runs at once, as a queue would).
pub fn due_at(
    run_at: Option<&str>,
    delay: Option<Duration>,
    now: UnixMs,
) -> Result<UnixMs, String> {
    let max = i64::try_from(MAX_AHEAD.as_millis()).unwrap_or(i64::MAX);
    let at = match (run_at.map(str::trim).filter(|t| !t.is_empty()), delay) {
        (Some(_), Some(_)) => {
            return Err("give `run_at` or `delay`, not both".into());
        }
        (Some(text), None) => super::time::parse_utc(text)?,
        (None, Some(d)) => now.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        (None, None) => now,
    };
    if at > now.saturating_add(max) {
        return Err(format!(
            "`{}` is more than {} days ahead",
            super::time::format_ms(at),
            MAX_AHEAD.as_secs() / 86_400
        ));
    }
    Ok(at.max(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMs = 1_764_662_400_000; // 2025-12-02T08:00:00Z

    #[test]
    fn a_record_falls_due_at_its_time_after_its_delay_or_now() {
        assert_eq!(due_at(None, None, NOW), Ok(NOW));
        assert_eq!(
            due_at(None, Some(Duration::from_secs(7_200)), NOW),
            Ok(NOW + 7_200_000)
        );
        assert_eq!(
            due_at(Some("2025-12-02T09:30Z"), None, NOW),
            Ok(NOW + 90 * 60_000)
        );
        // Late: due now. Blank: no time given.
        assert_eq!(due_at(Some("2025-12-01T09:30Z"), None, NOW), Ok(NOW));
        assert_eq!(due_at(Some("  "), None, NOW), Ok(NOW));
    }

    #[test]
    fn both_a_bad_time_or_too_far_ahead_is_refused() {
        let both = due_at(Some("2025-12-02T09:30Z"), Some(Duration::from_secs(1)), NOW);
        assert!(both.is_err_and(|e| e.contains("not both")));
        assert!(due_at(Some("tomorrow"), None, NOW).is_err_and(|e| e.contains("invalid time")));
        let far = due_at(None, Some(MAX_AHEAD + Duration::from_secs(86_400)), NOW);
        assert!(far.is_err_and(|e| e.contains("400 days")));
        assert!(due_at(None, Some(MAX_AHEAD), NOW).is_ok());
    }
}
