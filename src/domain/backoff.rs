//! Retry timing: capped exponential backoff with full jitter, `Retry-After`
//! honoured when it asks for longer, and a retry budget that keeps retries a
//! bounded fraction of calls so they never multiply an outage.

use std::time::Duration;

/// Capped exponential backoff with full jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The ceiling of the first retry's delay.
    pub base: Duration,
    /// No delay ever exceeds this (Retry-After aside).
    pub cap: Duration,
}

impl Backoff {
    /// The largest delay before retry number `retry` (1 for the first
    /// retry): `min(cap, base · 2^(retry-1))`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(63);
        let factor = 1u128 << exp;
        let ms = self.base.as_millis().saturating_mul(factor);
        Duration::from_millis(u64::try_from(ms.min(self.cap.as_millis())).unwrap_or(u64::MAX))
    }

    /// Full jitter: uniform in `[0, ceiling(retry)]`, drawn with `unit`, a
    /// random number in `[0, 1)` (passed in so the rule stays pure).
    pub fn delay(&self, retry: u32, unit: f64) -> Duration {
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let ceiling = self.ceiling(retry).as_millis() as f64;
        Duration::from_millis((ceiling * unit).round() as u64)
    }

    /// The wait before retry number `retry`: the jittered backoff, or the
    /// provider's `Retry-After` when that is later.
    pub fn wait(&self, retry: u32, unit: f64, retry_after: Option<Duration>) -> Duration {
        let jittered = self.delay(retry, unit);
        match retry_after {
            Some(ra) if ra > jittered => ra,
            _ => jittered,
        }
    }
}

/// A retry budget in the style of a token bucket: every first attempt
/// deposits `ratio` tokens, every retry withdraws one, and `floor_per_sec`
/// tokens trickle in so a quiet provider can still be retried. The balance
/// is capped so a long calm spell cannot bank an avalanche.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryBudget {
    pub ratio: f64,
    pub floor_per_sec: f64,
    max_balance: f64,
    balance: f64,
    last_ms: i64,
}

impl RetryBudget {
    pub fn new(ratio: f64, floor_per_sec: f64, now_ms: i64) -> Self {
        let ratio = if ratio.is_finite() {
            ratio.max(0.0)
        } else {
            0.0
        };
        let floor = if floor_per_sec.is_finite() {
            floor_per_sec.max(0.0)
        } else {
            0.0
        };
        // Ten seconds of floor, or a hundred calls' worth, whichever is more.
        let max_balance = (floor * 10.0).max(ratio * 100.0).max(1.0);
        RetryBudget {
            ratio,
            floor_per_sec: floor,
            max_balance,
            balance: max_balance.min(floor * 10.0),
            last_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: i64) {
        let elapsed = (now_ms - self.last_ms).max(0) as f64 / 1000.0;
        self.balance = (self.balance + elapsed * self.floor_per_sec).min(self.max_balance);
        self.last_ms = self.last_ms.max(now_ms);
    }

    /// A first attempt was made.
    pub fn on_call(&mut self, now_ms: i64) {
        self.refill(now_ms);
        self.balance = (self.balance + self.ratio).min(self.max_balance);
    }

    /// A retry succeeded (the step's result, or an accepted submit): it
    /// returns its token. The budget exists so that retries cannot multiply
    /// the load on a failing provider; a retry that succeeds did no such
    /// harm. Without the refund, a backlog deferred during an outage came
    /// back at the floor rate (1/s by default: minutes for a few hundred
    /// records); with it, a token serves one retry per round trip while
    /// retries succeed, and the floor adds a token a second.
    pub fn on_retry_succeeded(&mut self, now_ms: i64) {
        self.refill(now_ms);
        self.balance = (self.balance + 1.0).min(self.max_balance);
    }

    /// A retry failed again (a failure or a reply nobody understands): the
    /// balance halves, on top of the token it cost. With every retry
    /// failing, retries stay within the ratio; with some succeeding, the
    /// halving keeps them near it (at worst 1.7 times, one in two
    /// succeeding).
    pub fn on_retry_failed(&mut self, now_ms: i64) {
        self.refill(now_ms);
        self.balance /= 2.0;
    }

    /// New settings (a configuration reload): the balance earned so far
    /// is kept, within the new cap, and earns at the new rates from now.
    pub fn retune(&mut self, ratio: f64, floor_per_sec: f64, now_ms: i64) {
        self.refill(now_ms);
        let fresh = RetryBudget::new(ratio, floor_per_sec, now_ms);
        self.ratio = fresh.ratio;
        self.floor_per_sec = fresh.floor_per_sec;
        self.max_balance = fresh.max_balance;
        self.balance = self.balance.min(self.max_balance);
    }

    /// Asks to spend one retry; false means "not now, defer instead".
    pub fn try_retry(&mut self, now_ms: i64) -> bool {
        self.refill(now_ms);
        if self.balance >= 1.0 {
            self.balance -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_retuned_budget_keeps_its_balance_within_the_new_cap() {
        let mut b = RetryBudget::new(0.1, 1.0, 0);
        assert_eq!(b.max_balance, 10.0);
        assert_eq!(b.balance, 10.0);
        b.retune(0.1, 0.2, 0);
        assert_eq!((b.floor_per_sec, b.max_balance), (0.2, 10.0));
        assert_eq!(b.balance, 10.0, "kept");
        for _ in 0..10 {
            assert!(b.try_retry(0));
        }
        assert!(!b.try_retry(0));
        // Earns at the new rate: 0.2 a second, a token in 5 s.
        assert!(!b.try_retry(4_000));
        assert!(b.try_retry(5_000));
        b.retune(0.0, 0.05, 5_000);
        assert_eq!(b.max_balance, 1.0);
        b.retune(5.0, 0.0, 5_000);
        assert_eq!(b.max_balance, 500.0);
        assert!(b.balance <= 1.0, "not raised by a bigger cap");
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn ceilings_double_then_cap() {
        let b = Backoff {
            base: ms(500),
            cap: ms(120_000),
        };
        let got: Vec<u64> = (1..=10).map(|n| b.ceiling(n).as_millis() as u64).collect();
        assert_eq!(
            got,
            vec![
                500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 120000, 120000
            ]
        );
        assert_eq!(b.ceiling(u32::MAX), ms(120_000));
        assert_eq!(b.ceiling(0), ms(500));
    }

    #[test]
    fn retry_after_wins_when_later() {
        let b = Backoff {
            base: ms(100),
            cap: ms(1000),
        };
        assert_eq!(b.wait(3, 0.5, Some(ms(30_000))), ms(30_000));
        assert_eq!(b.wait(3, 0.5, Some(ms(1))), ms(200));
        assert_eq!(b.wait(3, 0.5, None), ms(200));
    }

    #[test]
    fn budget_caps_retries_to_a_fraction_of_calls() {
        let mut budget = RetryBudget::new(0.2, 0.0, 0);
        let mut retries = 0;
        for _ in 0..1000 {
            budget.on_call(0);
            // Every call fails and wants a retry.
            if budget.try_retry(0) {
                retries += 1;
            }
        }
        assert!(
            (199..=201).contains(&retries),
            "{retries} retries for 1000 calls"
        );
    }

    #[test]
    fn budget_floor_trickles_in_over_time() {
        let mut budget = RetryBudget::new(0.0, 2.0, 0);
        let mut granted = 0;
        for t in 0..100 {
            while budget.try_retry(10_000 + t * 1000) {
                granted += 1;
            }
        }
        // 20 banked (10 s of floor) + 2 per second for ~99 s.
        assert!((210..=220).contains(&granted), "{granted}");
    }

    #[test]
    fn succeeding_retries_fund_the_next_after_an_outage() {
        // An outage spent the balance: only the floor (1/s) is left.
        let mut budget = RetryBudget::new(0.2, 1.0, 0);
        while budget.try_retry(0) {}
        // The provider is back; a backlog of 500 deferred retries. Each
        // round trip, every granted retry succeeds.
        let (mut done, mut rounds, mut t) = (0, 0, 1_000);
        while done < 500 {
            let mut granted = 0;
            while done + granted < 500 && budget.try_retry(t) {
                granted += 1;
            }
            for _ in 0..granted {
                budget.on_retry_succeeded(t);
            }
            done += granted;
            rounds += 1;
            t += 50;
        }
        // A token serves a retry per round trip and the floor adds one a
        // second: ~120 round trips (6 s at 50 ms); without refunds the
        // floor alone would take 500 s.
        assert!(rounds <= 200, "{rounds} round trips for 500 retries");
    }

    #[test]
    fn partial_failure_keeps_retries_near_the_ratio() {
        // Every call fails and wants a retry; one retry in `succeed_every`
        // succeeds. The ratio is 20%: at most 1.7 times that.
        for succeed_every in [2, 3, 10, 1000] {
            let mut budget = RetryBudget::new(0.2, 0.0, 0);
            let mut retries = 0;
            for call in 0..10_000 {
                budget.on_call(0);
                if budget.try_retry(0) {
                    retries += 1;
                    if retries % succeed_every == 0 {
                        budget.on_retry_succeeded(0);
                    } else {
                        budget.on_retry_failed(0);
                    }
                }
                let _ = call;
            }
            assert!(
                retries <= 3_400,
                "{retries} retries for 10,000 calls, one in {succeed_every} succeeding"
            );
        }
    }

    proptest! {
        #[test]
        fn delays_stay_within_the_full_jitter_bounds(
            base in 1u64..10_000, cap in 1u64..600_000, retry in 0u32..100, unit in 0.0f64..1.0,
        ) {
            let b = Backoff { base: ms(base), cap: ms(cap) };
            let upper = (u128::from(base) << retry.saturating_sub(1).min(63)).min(u128::from(cap));
            let d = b.delay(retry, unit).as_millis();
            prop_assert!(d <= upper, "{} > {}", d, upper);
        }

        #[test]
        fn waits_respect_retry_after(
            base in 1u64..10_000, cap in 1u64..600_000, retry in 0u32..40, unit in 0.0f64..1.0, ra in proptest::option::of(0u64..1_000_000),
        ) {
            let b = Backoff { base: ms(base), cap: ms(cap) };
            let w = b.wait(retry, unit, ra.map(ms));
            if let Some(ra) = ra {
                prop_assert!(w >= ms(ra));
            }
            prop_assert!(w <= b.ceiling(retry).max(ra.map(ms).unwrap_or_default()));
        }

        #[test]
        fn odd_units_never_escape_the_bounds(unit in proptest::num::f64::ANY) {
            let b = Backoff { base: ms(100), cap: ms(1000) };
            prop_assert!(b.delay(5, unit) <= ms(1000));
        }
    }
}

/// Parses a `Retry-After` value, delay-seconds or an HTTP date, into a wait
/// from `now`. A date in the past is no wait; nonsense is `None`.
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let v = value.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod retry_after_tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn seconds_and_dates() {
        let now = UNIX_EPOCH + Duration::from_secs(1_445_412_480); // Wed, 21 Oct 2015 07:28:00 GMT
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:27:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after("Wednesday, 21-Oct-15 07:28:10 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-5", now), None);
    }

    proptest! {
        #[test]
        fn never_panics(s in ".{0,40}") {
            let _ = parse_retry_after(&s, UNIX_EPOCH + Duration::from_secs(1_700_000_000));
        }

        #[test]
        fn formatted_dates_round_trip(secs in 0u64..100_000) {
            let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            let at = now + Duration::from_secs(secs);
            prop_assert_eq!(parse_retry_after(&httpdate::fmt_http_date(at), now), Some(Duration::from_secs(secs)));
        }
    }
}
