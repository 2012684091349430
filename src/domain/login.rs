//! Failed logins on one account name, decided: how long the name must wait
//! before its next password check. The wait grows with the failures and is
//! capped, so an attacker can slow a name's logins but never hold it shut,
//! and a client that logged in to that name before (a device cookie) does
//! not wait at all: see `web::pages::login`.

use super::UnixMs;

/// The first wait, once a name has reached its failure threshold.
pub const FIRST_DELAY_MS: i64 = 1_000;
/// The longest wait, however many failures come.
pub const MAX_DELAY_MS: i64 = 30_000;

/// A name's failed logins as the store keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginFailures {
    /// Failures since the count last started.
    pub failures: i64,
    /// When the latest of them was counted.
    pub last_failure_at: UnixMs,
}

/// How failures slow a name's logins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginPolicy {
    /// Failures after which each check of the name waits.
    pub threshold: i64,
    /// A failure this long after the previous one starts the count again.
    pub forget_after_ms: i64,
}

impl LoginPolicy {
    /// The `since` for [`count_login_failure`](crate::store::People::count_login_failure):
    /// a count whose latest failure is older starts again.
    pub fn forget_before(&self, now: UnixMs) -> UnixMs {
        now.saturating_sub(self.forget_after_ms)
    }

    /// The wait that `failures` impose after the latest of them: none
    /// below the threshold, then one second doubling with each failure, up
    /// to [`MAX_DELAY_MS`].
    pub fn delay_ms(&self, failures: i64) -> i64 {
        let past = failures.saturating_sub(self.threshold);
        if past < 0 {
            return 0;
        }
        // 2^5 seconds is past the cap already: no need to shift further.
        let doublings = u32::try_from(past.min(5)).unwrap_or(5);
        (FIRST_DELAY_MS << doublings).min(MAX_DELAY_MS)
    }

    /// Whether a check of the name at `now` must take its turn (it has
    /// reached its threshold within the window): one check at a time per
    /// wait, whichever node makes it, so guesses sent at once cannot all
    /// pass the same turn.
    pub fn takes_turns(&self, seen: Option<LoginFailures>, now: UnixMs) -> bool {
        seen.is_some_and(|s| {
            s.last_failure_at >= self.forget_before(now) && s.failures >= self.threshold
        })
    }

    /// How long a login on the name must still wait at `now`, if at all.
    pub fn wait_ms(&self, seen: Option<LoginFailures>, now: UnixMs) -> Option<i64> {
        let seen = seen?;
        if seen.last_failure_at < self.forget_before(now) {
            return None;
        }
        let until = seen
            .last_failure_at
            .saturating_add(self.delay_ms(seen.failures));
        (until > now).then(|| until - now)
    }
}

/// Whole seconds for `Retry-After`, rounded up so a client that waits them
/// is not turned away again.
pub fn retry_after_secs(wait_ms: i64) -> i64 {
    (wait_ms.max(1) + 999) / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: LoginPolicy = LoginPolicy {
        threshold: 3,
        forget_after_ms: 15 * 60_000,
    };

    fn seen(failures: i64, at: UnixMs) -> Option<LoginFailures> {
        Some(LoginFailures {
            failures,
            last_failure_at: at,
        })
    }

    #[test]
    fn the_delay_starts_at_the_threshold_doubles_and_is_capped() {
        let delays: Vec<i64> = (0..=12).map(|f| POLICY.delay_ms(f)).collect();
        assert_eq!(
            delays,
            [
                0, 0, 0, 1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 30_000, 30_000, 30_000, 30_000
            ]
        );
        assert_eq!(POLICY.delay_ms(i64::MAX), MAX_DELAY_MS, "no overflow");
    }

    #[test]
    fn a_name_waits_after_its_latest_failure_and_never_longer_than_the_cap() {
        assert_eq!(POLICY.wait_ms(None, 1_000), None);
        assert_eq!(POLICY.wait_ms(seen(2, 1_000), 1_000), None, "below");
        assert_eq!(POLICY.wait_ms(seen(3, 1_000), 1_200), Some(800));
        assert_eq!(POLICY.wait_ms(seen(3, 1_000), 2_000), None, "waited");
        assert_eq!(POLICY.wait_ms(seen(4, 1_000), 2_000), Some(1_000));
        // However many failures an attacker piles up, the wait after the
        // latest is at most the cap.
        assert_eq!(POLICY.wait_ms(seen(10_000, 0), 0), Some(MAX_DELAY_MS));
        assert_eq!(POLICY.wait_ms(seen(10_000, 0), MAX_DELAY_MS), None);
        // A count last touched past the forget window waits for nothing.
        assert_eq!(
            POLICY.wait_ms(seen(10, 0), POLICY.forget_after_ms + 1),
            None
        );
    }

    #[test]
    fn a_name_at_its_threshold_takes_turns() {
        assert!(!POLICY.takes_turns(None, 1_000));
        assert!(!POLICY.takes_turns(seen(2, 1_000), 1_000));
        assert!(POLICY.takes_turns(seen(3, 1_000), 5_000));
        assert!(
            !POLICY.takes_turns(seen(9, 0), POLICY.forget_after_ms + 1),
            "forgotten"
        );
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1_000), 1);
        assert_eq!(retry_after_secs(1_001), 2);
        assert_eq!(retry_after_secs(30_000), 30);
        assert_eq!(retry_after_secs(0), 1);
    }
}
