//! What protects one provider from us on this node: a concurrency cap, rate
//! limits as sliding windows, the circuit breaker and the retry budget.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Semaphore;

use crate::config::provider::{ProviderConfig, RateLimit};
use crate::domain::UnixMs;
use crate::domain::backoff::RetryBudget;
use crate::domain::breaker::Breaker;
use crate::domain::rules::Rule;

/// A sliding-log limiter over several windows at once, exact at the
/// provider whatever the network does.
///
/// A call occupies every window from the moment it is granted until one
/// window length after it *completed*. Its arrival at the provider lies
/// somewhere between the two, so for any two calls where the later one was
/// granted after the earlier one's window ran out, their arrivals are at
/// least a window apart: no interval of a window's length at the provider
/// ever holds more than the window's count. (Logging grant times instead
/// lets jitter between grant and arrival bunch calls up.) The price is the
/// provider's latency per window, small beside the window itself.
#[derive(Debug)]
pub struct Limiter {
    /// (limit, window in ms, completion times still inside the window).
    windows: Vec<(RateLimit, i64, VecDeque<UnixMs>)>,
    /// Granted calls that have not completed: inside every window.
    in_flight: usize,
    paused_until: UnixMs,
    /// This node's share of the cluster's limits (1 / live nodes).
    share: f64,
}

impl Limiter {
    pub fn new(limits: &[RateLimit]) -> Self {
        let windows = limits
            .iter()
            .map(|l| {
                let per = i64::try_from(l.per.as_millis()).unwrap_or(i64::MAX / 4);
                (
                    *l,
                    per,
                    VecDeque::with_capacity(l.count.min(100_000) as usize),
                )
            })
            .collect();
        Limiter {
            windows,
            in_flight: 0,
            paused_until: 0,
            share: 1.0,
        }
    }

    /// Calls in flight, and per limit its text and the calls it counts now.
    pub fn usage(&self, now: UnixMs) -> (usize, Vec<(String, usize, u32)>) {
        let used = self
            .windows
            .iter()
            .map(|(limit, per, log)| {
                let recent = log.iter().filter(|t| **t > now - per).count();
                (format!("{limit:?}"), recent + self.in_flight, limit.count)
            })
            .collect();
        (self.in_flight, used)
    }

    /// Takes `share` of every window's count (at least one call), so the
    /// nodes together stay within the provider's limits.
    pub fn set_share(&mut self, share: f64) {
        self.share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            1.0
        };
    }

    /// Grants a call now, or says when to ask again. A granted call must be
    /// followed by [`complete`](Self::complete) or [`abandon`](Self::abandon).
    pub fn try_acquire(&mut self, now: UnixMs) -> Result<(), UnixMs> {
        if now < self.paused_until {
            return Err(self.paused_until);
        }
        let mut wait_until = None;
        let share = self.share;
        for (limit, per, log) in &mut self.windows {
            while log.front().is_some_and(|t| *t <= now - *per) {
                log.pop_front();
            }
            let count = ((f64::from(limit.count) * share).floor() as usize).max(1);
            if log.len() + self.in_flight >= count {
                // The oldest completion leaves first; with only calls in
                // flight, look again shortly.
                let free_at = log.front().map_or(now + 5, |t| t + *per + 1);
                wait_until = Some(wait_until.map_or(free_at, |w: UnixMs| w.max(free_at)));
            }
        }
        if let Some(w) = wait_until {
            return Err(w);
        }
        self.in_flight += 1;
        Ok(())
    }

    /// A granted call finished (whatever its outcome) at `now`.
    pub fn complete(&mut self, now: UnixMs) {
        self.in_flight = self.in_flight.saturating_sub(1);
        for (_, _, log) in &mut self.windows {
            log.push_back(now);
        }
    }

    /// A granted call was never sent.
    pub fn abandon(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// The provider asked us to slow down (429 with Retry-After).
    pub fn pause_until(&mut self, until: UnixMs) {
        self.paused_until = self.paused_until.max(until);
    }
}

/// One provider's runtime on this node.
pub struct ProviderRuntime {
    pub name: String,
    pub config: ProviderConfig,
    pub rules: Vec<Rule>,
    pub client: reqwest::Client,
    pub concurrency: Arc<Semaphore>,
    limiter: Mutex<Limiter>,
    breaker: Mutex<Breaker>,
    budget: Mutex<RetryBudget>,
    /// Paused by an operator (read from the shared provider state).
    paused: Mutex<bool>,
    /// The latest "slow down" pause this node has published to the others.
    published_throttle: std::sync::atomic::AtomicI64,
    /// Answers calls in-process instead of over HTTP (benchmarks).
    pub in_process: Option<super::http::InProcess>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ProviderRuntime {
    pub fn new(name: &str, config: &ProviderConfig, now: UnixMs) -> Result<Self, String> {
        let rules = config.compile_rules(name).map_err(|e| e.to_string())?;
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout.0)
            .user_agent(concat!("ballast/", env!("CARGO_PKG_VERSION")))
            .pool_max_idle_per_host(config.concurrency as usize)
            .build()
            .map_err(|e| format!("provider {name}: cannot build HTTP client: {e}"))?;
        Ok(ProviderRuntime {
            name: name.to_owned(),
            rules,
            client,
            concurrency: Arc::new(Semaphore::new(config.concurrency as usize)),
            limiter: Mutex::new(Limiter::new(&config.rate_limits)),
            breaker: Mutex::new(Breaker::new(config.breaker.policy(), now)),
            budget: Mutex::new(RetryBudget::new(
                config.retry.budget,
                config.retry.budget_floor,
                now,
            )),
            paused: Mutex::new(false),
            published_throttle: std::sync::atomic::AtomicI64::new(0),
            config: config.clone(),
            in_process: None,
        })
    }

    /// Notes a pause to publish; false when one lasting as long or longer
    /// was published already (a storm of 429s costs one write per longer
    /// pause, not one per reply).
    pub fn note_throttle(&self, until: UnixMs) -> bool {
        use std::sync::atomic::Ordering;
        self.published_throttle.fetch_max(until, Ordering::Relaxed) < until
    }

    pub fn limiter(&self) -> MutexGuard<'_, Limiter> {
        lock(&self.limiter)
    }

    pub fn breaker(&self) -> MutexGuard<'_, Breaker> {
        lock(&self.breaker)
    }

    pub fn budget(&self) -> MutexGuard<'_, RetryBudget> {
        lock(&self.budget)
    }

    pub fn is_paused(&self) -> bool {
        *lock(&self.paused)
    }

    pub fn set_paused(&self, paused: bool) {
        *lock(&self.paused) = paused;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    proptest! {
        /// Whatever the arrival pattern and however long calls take, no
        /// window at the provider (calls arrive anywhere between grant and
        /// completion) ever holds more than the configured count.
        #[test]
        fn no_window_exceeds_its_limit(
            calls in proptest::collection::vec((0i64..40, 0i64..300, 0.0f64..1.0), 1..1500),
        ) {
            let limit = RateLimit { count: 20, per: Duration::from_secs(1) };
            let mut l = Limiter::new(&[limit]);
            let mut now = 0;
            let mut arrivals = Vec::new();
            let mut pending: Vec<i64> = Vec::new(); // completion times
            for (gap, latency, frac) in calls {
                now += gap;
                pending.sort_unstable();
                while pending.first().is_some_and(|c| *c <= now) {
                    let c = pending.remove(0);
                    l.complete(c);
                }
                if l.try_acquire(now).is_ok() {
                    arrivals.push(now + (latency as f64 * frac) as i64);
                    pending.push(now + latency);
                }
            }
            arrivals.sort_unstable();
            for (i, t) in arrivals.iter().enumerate() {
                let in_window = arrivals[i..].iter().take_while(|u| **u < t + 1000).count();
                prop_assert!(in_window <= 20, "{} arrivals in [{}, {})", in_window, t, t + 1000);
            }
        }
    }

    #[test]
    fn sustained_rate_is_close_to_the_limit_and_waits_are_exact() {
        let limit = RateLimit {
            count: 200,
            per: Duration::from_secs(1),
        };
        let mut l = Limiter::new(&[limit]);
        let mut now = 0;
        let mut granted = 0;
        while now < 30_000 {
            match l.try_acquire(now) {
                Ok(()) => {
                    // An instant provider: each call completes at once.
                    l.complete(now);
                    granted += 1;
                }
                Err(at) => {
                    assert!(at > now);
                    now = at;
                }
            }
        }
        let rate = f64::from(granted) / 30.0;
        assert!((0.97 * 200.0..=200.0).contains(&rate), "{rate}/s");
        l.pause_until(now + 5_000);
        assert_eq!(l.try_acquire(now + 1), Err(now + 5_000));
    }
}
