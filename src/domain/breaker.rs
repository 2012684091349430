//! Circuit-breaker arithmetic: a sliding window of the last N calls, a
//! minimum number of calls before judging, failure-rate and slow-call
//! thresholds, an open interval, and a few half-open probes before closing.
//! Time is passed in; the engine persists the state so every node sees it.

use std::collections::VecDeque;
use std::time::Duration;

use super::model::BreakerState;
use super::time::UnixMs;

/// How a provider's breaker judges it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerPolicy {
    /// Calls remembered.
    pub window: u32,
    /// Calls needed in the window before the breaker may open.
    pub min_calls: u32,
    /// Open when this fraction of the window failed.
    pub failure_rate: f64,
    /// A call at least this long counts as slow.
    pub slow_call: Duration,
    /// Open when this fraction of the window was slow.
    pub slow_rate: f64,
    /// How long to stay open before probing.
    pub open_for: Duration,
    /// Successful probes needed to close again.
    pub probes: u32,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy {
            window: 50,
            min_calls: 20,
            failure_rate: 0.5,
            slow_call: Duration::from_secs(5),
            slow_rate: 1.0,
            open_for: Duration::from_secs(30),
            probes: 3,
        }
    }
}

/// Permission to make one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permit {
    /// A half-open probe: its result decides whether the breaker closes.
    pub probe: bool,
}

/// A refusal: the provider is being protected until `until`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected {
    pub until: UnixMs,
}

/// One provider's breaker.
#[derive(Debug, Clone, PartialEq)]
pub struct Breaker {
    policy: BreakerPolicy,
    state: BreakerState,
    /// (failed, slow) of the most recent calls, oldest first.
    calls: VecDeque<(bool, bool)>,
    open_until: UnixMs,
    probes_out: u32,
    probes_ok: u32,
    changed_at: UnixMs,
}

impl Breaker {
    pub fn new(policy: BreakerPolicy, now: UnixMs) -> Self {
        Breaker {
            policy,
            state: BreakerState::Closed,
            calls: VecDeque::with_capacity(policy.window as usize),
            open_until: 0,
            probes_out: 0,
            probes_ok: 0,
            changed_at: now,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    pub fn changed_at(&self) -> UnixMs {
        self.changed_at
    }

    /// When an open breaker lets probes through.
    pub fn open_until(&self) -> Option<UnixMs> {
        (self.state == BreakerState::Open).then_some(self.open_until)
    }

    /// (calls, failures, slow calls) in the window, for the dashboard.
    pub fn window_figures(&self) -> (usize, usize, usize) {
        let failed = self.calls.iter().filter(|c| c.0).count();
        let slow = self.calls.iter().filter(|c| c.1).count();
        (self.calls.len(), failed, slow)
    }

    fn set(&mut self, state: BreakerState, now: UnixMs) {
        if self.state != state {
            self.state = state;
            self.changed_at = now;
        }
    }

    fn open(&mut self, now: UnixMs) {
        self.set(BreakerState::Open, now);
        let open_ms = i64::try_from(self.policy.open_for.as_millis()).unwrap_or(i64::MAX / 2);
        self.open_until = now.saturating_add(open_ms);
        self.calls.clear();
        self.probes_out = 0;
        self.probes_ok = 0;
    }

    /// Opens the breaker as another node reported (shared state).
    pub fn force_open(&mut self, until: UnixMs, now: UnixMs) {
        self.open(now);
        self.open_until = until;
    }

    /// Closes the breaker (operator reset).
    pub fn reset(&mut self, now: UnixMs) {
        self.set(BreakerState::Closed, now);
        self.calls.clear();
        self.probes_out = 0;
        self.probes_ok = 0;
    }

    /// May a call go out now?
    pub fn try_acquire(&mut self, now: UnixMs) -> Result<Permit, Rejected> {
        if self.state == BreakerState::Open {
            if now < self.open_until {
                return Err(Rejected {
                    until: self.open_until,
                });
            }
            self.set(BreakerState::HalfOpen, now);
            self.probes_out = 0;
            self.probes_ok = 0;
        }
        match self.state {
            BreakerState::Closed => Ok(Permit { probe: false }),
            BreakerState::HalfOpen if self.probes_out < self.policy.probes.max(1) => {
                self.probes_out += 1;
                Ok(Permit { probe: true })
            }
            // All probes are out: wait for their answers.
            _ => Err(Rejected {
                until: now.saturating_add(1000),
            }),
        }
    }

    /// Gives back a permit with no verdict either way: its call was never
    /// made, or the provider only said "slow down" (throttled).
    pub fn release(&mut self, permit: Permit) {
        if permit.probe && self.state == BreakerState::HalfOpen {
            self.probes_out = self.probes_out.saturating_sub(1);
        }
    }

    /// Records the result of a call made under `permit`.
    pub fn record(&mut self, permit: Permit, failed: bool, took: Duration, now: UnixMs) {
        let slow = took >= self.policy.slow_call;
        match self.state {
            BreakerState::HalfOpen if permit.probe => {
                if failed || slow {
                    self.open(now);
                } else {
                    self.probes_ok += 1;
                    if self.probes_ok >= self.policy.probes.max(1) {
                        self.reset(now);
                    }
                }
            }
            BreakerState::Closed => {
                if self.calls.len() >= self.policy.window.max(1) as usize {
                    self.calls.pop_front();
                }
                self.calls.push_back((failed, slow));
                let (n, failures, slows) = self.window_figures();
                if n >= self.policy.min_calls.max(1) as usize {
                    let n = n as f64;
                    if failures as f64 / n >= self.policy.failure_rate
                        || slows as f64 / n >= self.policy.slow_rate
                    {
                        self.open(now);
                    }
                }
            }
            // A late answer to a call made before the breaker opened.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy() -> BreakerPolicy {
        BreakerPolicy {
            window: 10,
            min_calls: 5,
            failure_rate: 0.5,
            slow_call: Duration::from_secs(2),
            slow_rate: 0.8,
            open_for: Duration::from_secs(30),
            probes: 2,
        }
    }

    fn call(b: &mut Breaker, failed: bool, now: UnixMs) -> bool {
        match b.try_acquire(now) {
            Ok(p) => {
                b.record(p, failed, Duration::from_millis(10), now);
                true
            }
            Err(_) => false,
        }
    }

    #[test]
    fn opens_after_min_calls_at_the_failure_rate_and_probes_to_close() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..4 {
            assert!(call(&mut b, true, i));
        }
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "fewer than min_calls: no judgement"
        );
        assert!(call(&mut b, true, 5));
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.open_until(), Some(30_005));
        assert!(!call(&mut b, false, 10_000), "open: calls are refused");
        // After the open interval, exactly `probes` calls go out.
        let p1 = b.try_acquire(30_005).unwrap();
        let p2 = b.try_acquire(30_006).unwrap();
        assert!(p1.probe && p2.probe);
        assert!(b.try_acquire(30_007).is_err(), "no third probe");
        b.record(p1, false, Duration::from_millis(5), 30_010);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        b.record(p2, false, Duration::from_millis(5), 30_011);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_failed_probe_reopens() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..5 {
            call(&mut b, true, i);
        }
        let p = b.try_acquire(40_000).unwrap();
        b.record(p, true, Duration::from_millis(5), 40_001);
        assert_eq!(b.open_until(), Some(70_001));
    }

    #[test]
    fn slow_calls_open_it_too() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..5 {
            let p = b.try_acquire(i).unwrap();
            b.record(p, false, Duration::from_secs(3), i);
        }
        assert_eq!(b.state(), BreakerState::Open);
    }

    proptest! {
        /// A closed breaker opens exactly when its window (at most `window`
        /// calls) holds `min_calls` and a threshold is met; an open breaker
        /// refuses everything before `open_until`.
        #[test]
        fn window_rules_hold(outcomes in proptest::collection::vec(any::<(bool, bool)>(), 0..200)) {
            let p = policy();
            let mut b = Breaker::new(p, 0);
            let mut shadow: VecDeque<(bool, bool)> = VecDeque::new();
            for (i, (failed, slow)) in outcomes.into_iter().enumerate() {
                let now = i as i64 * 1000;
                let before = b.state();
                match b.try_acquire(now) {
                    Ok(permit) => {
                        let took = if slow { Duration::from_secs(3) } else { Duration::from_millis(1) };
                        b.record(permit, failed, took, now);
                        if before == BreakerState::Closed {
                            if shadow.len() == p.window as usize {
                                shadow.pop_front();
                            }
                            shadow.push_back((failed, slow));
                            let n = shadow.len();
                            let f = shadow.iter().filter(|c| c.0).count() as f64;
                            let sl = shadow.iter().filter(|c| c.1).count() as f64;
                            let trips = n >= p.min_calls as usize
                                && (f / n as f64 >= p.failure_rate || sl / n as f64 >= p.slow_rate);
                            prop_assert_eq!(b.state() == BreakerState::Open, trips);
                        }
                    }
                    Err(r) => {
                        prop_assert!(before != BreakerState::Closed);
                        if b.state() == BreakerState::Open {
                            prop_assert!(r.until > now);
                        }
                    }
                }
                if b.state() != BreakerState::Closed {
                    shadow.clear();
                }
                prop_assert!(b.window_figures().0 <= p.window as usize);
            }
        }
    }
}
