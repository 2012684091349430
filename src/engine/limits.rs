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

/// A sliding-log limiter over several windows at once. Any interval of a
/// window's length (plus a small guard for network jitter) holds at most
/// its count of calls, which a token bucket does not promise.
#[derive(Debug)]
pub struct Limiter {
    windows: Vec<(RateLimit, i64, VecDeque<UnixMs>)>,
    paused_until: UnixMs,
}

impl Limiter {
    pub fn new(limits: &[RateLimit]) -> Self {
        let windows = limits
            .iter()
            .map(|l| {
                let per = i64::try_from(l.per.as_millis()).unwrap_or(i64::MAX / 4);
                // 2% of the window (at least 5 ms): arrivals at the provider
                // can bunch up by a few milliseconds of jitter.
                let guard = (per / 50).max(5);
                (
                    *l,
                    per + guard,
                    VecDeque::with_capacity(l.count.min(100_000) as usize),
                )
            })
            .collect();
        Limiter {
            windows,
            paused_until: 0,
        }
    }

    /// Takes a slot now, or says when one frees up.
    pub fn try_acquire(&mut self, now: UnixMs) -> Result<(), UnixMs> {
        if now < self.paused_until {
            return Err(self.paused_until);
        }
        let mut wait_until = None;
        for (limit, span, log) in &mut self.windows {
            while log.front().is_some_and(|t| *t <= now - *span) {
                log.pop_front();
            }
            if log.len() >= limit.count as usize {
                let free_at = log.front().map_or(now, |t| t + *span + 1);
                wait_until = Some(wait_until.map_or(free_at, |w: UnixMs| w.max(free_at)));
            }
        }
        if let Some(w) = wait_until {
            return Err(w);
        }
        for (_, _, log) in &mut self.windows {
            log.push_back(now);
        }
        Ok(())
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
            config: config.clone(),
        })
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
        /// Whatever the arrival pattern, no window of the configured length
        /// ever holds more than the configured count of granted calls.
        #[test]
        fn no_window_exceeds_its_limit(gaps in proptest::collection::vec(0i64..40, 1..2000)) {
            let limit = RateLimit { count: 20, per: Duration::from_secs(1) };
            let mut l = Limiter::new(&[limit]);
            let mut now = 0;
            let mut granted = Vec::new();
            for g in gaps {
                now += g;
                if l.try_acquire(now).is_ok() {
                    granted.push(now);
                }
            }
            for (i, t) in granted.iter().enumerate() {
                let in_window = granted[i..].iter().take_while(|u| **u < t + 1000).count();
                prop_assert!(in_window <= 20, "{} calls in [{}, {})", in_window, t, t + 1000);
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
                Ok(()) => granted += 1,
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
