//! Circuit-breaker arithmetic: a sliding window of the last N calls, a
//! minimum number of calls before judging, failure-rate and slow-call
//! thresholds, an open interval, and a few half-open probes before closing.
//!
//! A breaker is one for the whole cluster. Each node judges the calls it
//! makes in its own window ([`Breaker`]); when that window trips, the node
//! opens the cluster's breaker ([`SharedBreaker`], kept with the provider
//! in the database), and every node adopts what is stored there. After the
//! open interval, half-open probes are claimed from the shared breaker, so
//! `probes` counts probes in the whole cluster, and their answers close or
//! reopen it for everyone. Time is passed in.

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
    /// Successful probes needed to close again (at most this many are out
    /// at once, in the whole cluster).
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

impl BreakerPolicy {
    pub fn open_for_ms(&self) -> i64 {
        i64::try_from(self.open_for.as_millis()).unwrap_or(i64::MAX / 2)
    }
}

/// What this node's breaker says of a call now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Closed: make the call and record its verdict here.
    Call,
    /// Open until then: defer.
    Wait(UnixMs),
    /// Half-open (or open and due to be): ask the cluster for a probe.
    Probe,
}

/// One provider's breaker on this node: the judge of its own calls while
/// closed, and a copy of the cluster's state otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct Breaker {
    policy: BreakerPolicy,
    state: BreakerState,
    /// (failed, slow) of the most recent calls, oldest first.
    calls: VecDeque<(bool, bool)>,
    open_until: UnixMs,
    changed_at: UnixMs,
}

impl Breaker {
    pub fn new(policy: BreakerPolicy, now: UnixMs) -> Self {
        Breaker {
            policy,
            state: BreakerState::Closed,
            calls: VecDeque::with_capacity(policy.window as usize),
            open_until: 0,
            changed_at: now,
        }
    }

    pub fn policy(&self) -> &BreakerPolicy {
        &self.policy
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
        if state != BreakerState::Closed {
            self.calls.clear();
        }
    }

    /// Closes the breaker (an operator reset, or the cluster's probes
    /// succeeded).
    pub fn reset(&mut self, now: UnixMs) {
        self.set(BreakerState::Closed, now);
        self.calls.clear();
    }

    /// New settings (a configuration reload): the state and the calls
    /// judged so far are kept, the oldest dropped past the new window; an
    /// open breaker keeps the interval it was given.
    pub fn set_policy(&mut self, policy: BreakerPolicy) {
        self.policy = policy;
        while self.calls.len() > self.policy.window.max(1) as usize {
            self.calls.pop_front();
        }
    }

    /// May a call go out now?
    pub fn admit(&self, now: UnixMs) -> Admit {
        match self.state {
            BreakerState::Closed => Admit::Call,
            BreakerState::Open if now < self.open_until => Admit::Wait(self.open_until),
            _ => Admit::Probe,
        }
    }

    /// Records the verdict of a call made while closed; true when it opened
    /// the breaker (the node then opens the cluster's until
    /// [`open_until`](Self::open_until)). A late answer to a call made
    /// before the breaker left `closed` changes nothing.
    pub fn record(&mut self, failed: bool, took: Duration, now: UnixMs) -> bool {
        if self.state != BreakerState::Closed {
            return false;
        }
        let slow = took >= self.policy.slow_call;
        if self.calls.len() >= self.policy.window.max(1) as usize {
            self.calls.pop_front();
        }
        self.calls.push_back((failed, slow));
        let (n, failures, slows) = self.window_figures();
        if n < self.policy.min_calls.max(1) as usize {
            return false;
        }
        let n = n as f64;
        if failures as f64 / n >= self.policy.failure_rate
            || slows as f64 / n >= self.policy.slow_rate
        {
            self.set(BreakerState::Open, now);
            self.open_until = now.saturating_add(self.policy.open_for_ms());
            return true;
        }
        false
    }

    /// Takes the cluster's state as this node's. A trip of this node's own
    /// that is newer than what is stored (not yet published, or its
    /// publication failed) stays for its open interval, no longer.
    pub fn adopt(&mut self, shared: &SharedBreaker, now: UnixMs) {
        let own_trip = self.state == BreakerState::Open
            && shared.changed_at < self.changed_at
            && now < self.open_until;
        if own_trip {
            return;
        }
        match shared.state {
            BreakerState::Closed => {
                if self.state != BreakerState::Closed {
                    self.reset(now);
                }
            }
            BreakerState::Open => {
                self.set(BreakerState::Open, now);
                self.open_until = shared.open_until.unwrap_or(now);
            }
            BreakerState::HalfOpen => self.set(BreakerState::HalfOpen, now),
        }
        // The cluster's moment, not this node's: a later change anywhere is
        // adopted in turn.
        if self.state == shared.state {
            self.changed_at = shared.changed_at;
        }
    }
}

/// The answer to a request for a half-open probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeGrant {
    /// This call is a probe of the half-open round that began at `round`:
    /// its verdict goes back to the cluster with it.
    Probe { round: UnixMs },
    /// Open, or every probe is out: ask again then.
    Wait(UnixMs),
    /// The breaker closed meanwhile: call as usual.
    Closed,
}

/// A change asked of the cluster's breaker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SharedOp {
    /// A node's window tripped: open until then (a later end wins).
    Open { until: UnixMs },
    /// A node asks for a half-open probe; a probe not answered within
    /// `lost_after` ms (its node died) is given up and may be claimed again.
    ClaimProbe { probes: u32, lost_after: i64 },
    /// A probe's verdict (a verdict from an earlier round is late).
    Probed {
        ok: bool,
        probes: u32,
        open_for: i64,
        round: UnixMs,
    },
    /// A claimed probe was not made (or only throttled): no verdict.
    Release { round: UnixMs },
    /// An operator closed it.
    Reset,
}

/// The cluster's breaker for one provider, as stored with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedBreaker {
    pub state: BreakerState,
    pub changed_at: UnixMs,
    pub open_until: Option<UnixMs>,
    /// Probes claimed and not answered.
    pub probes_out: u32,
    /// Probes answered well since it went half-open.
    pub probes_ok: u32,
    /// When the latest claimed probe is given up for lost.
    pub probe_until: Option<UnixMs>,
}

impl SharedBreaker {
    pub fn closed(now: UnixMs) -> Self {
        SharedBreaker {
            state: BreakerState::Closed,
            changed_at: now,
            open_until: None,
            probes_out: 0,
            probes_ok: 0,
            probe_until: None,
        }
    }

    fn set(&mut self, state: BreakerState, now: UnixMs) {
        if self.state != state {
            self.state = state;
            self.changed_at = now;
        }
        self.probes_out = 0;
        self.probes_ok = 0;
        self.probe_until = None;
        if state != BreakerState::Open {
            self.open_until = None;
        }
    }

    /// Applies `op` at `now`; `Some` for a probe request, with the answer.
    pub fn apply(&mut self, op: SharedOp, now: UnixMs) -> Option<ProbeGrant> {
        match op {
            SharedOp::Open { until } => {
                let later = self.open_until.is_none_or(|u| u < until);
                if self.state != BreakerState::Open || later {
                    self.set(BreakerState::Open, now);
                    self.open_until = Some(until);
                }
                None
            }
            SharedOp::ClaimProbe { probes, lost_after } => {
                Some(self.claim(probes, lost_after, now))
            }
            SharedOp::Probed {
                ok,
                probes,
                open_for,
                round,
            } => {
                if !self.in_round(round) {
                    return None;
                }
                self.probes_out = self.probes_out.saturating_sub(1);
                if !ok {
                    self.set(BreakerState::Open, now);
                    self.open_until = Some(now.saturating_add(open_for));
                } else {
                    self.probes_ok += 1;
                    if self.probes_ok >= probes.max(1) {
                        self.set(BreakerState::Closed, now);
                    }
                }
                None
            }
            SharedOp::Release { round } => {
                if self.in_round(round) {
                    self.probes_out = self.probes_out.saturating_sub(1);
                }
                None
            }
            SharedOp::Reset => {
                self.set(BreakerState::Closed, now);
                None
            }
        }
    }

    fn in_round(&self, round: UnixMs) -> bool {
        self.state == BreakerState::HalfOpen && self.changed_at == round
    }

    fn claim(&mut self, probes: u32, lost_after: i64, now: UnixMs) -> ProbeGrant {
        match self.state {
            BreakerState::Closed => return ProbeGrant::Closed,
            BreakerState::Open => {
                let until = self.open_until.unwrap_or(now);
                if now < until {
                    return ProbeGrant::Wait(until);
                }
                self.set(BreakerState::HalfOpen, now);
            }
            BreakerState::HalfOpen => {}
        }
        if self.probe_until.is_some_and(|u| u <= now) {
            // The probes out were never answered: their nodes are gone.
            self.probes_out = 0;
            self.probe_until = None;
        }
        let wanted = probes.max(1).saturating_sub(self.probes_ok);
        if self.probes_out >= wanted {
            let answer_by = self.probe_until.unwrap_or(now + 1_000);
            return ProbeGrant::Wait(answer_by.min(now + 1_000).max(now + 1));
        }
        self.probes_out += 1;
        self.probe_until = Some(now.saturating_add(lost_after.max(1)));
        ProbeGrant::Probe {
            round: self.changed_at,
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

    #[test]
    fn a_new_policy_judges_the_calls_already_seen() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..8 {
            assert!(!b.record(i % 2 == 0 && i < 4, Duration::ZERO, i));
        }
        assert_eq!(b.window_figures(), (8, 2, 0));
        // A window of 4 keeps the newest four calls (none failed).
        b.set_policy(BreakerPolicy {
            window: 4,
            min_calls: 2,
            failure_rate: 0.5,
            ..policy()
        });
        assert_eq!(b.window_figures(), (4, 0, 0));
        assert!(!b.record(true, Duration::ZERO, 10));
        assert!(b.record(true, Duration::ZERO, 11), "2 of the last 4 failed");
        assert_eq!(b.open_until(), Some(11 + 30_000));
        b.set_policy(BreakerPolicy {
            open_for: Duration::from_secs(1),
            ..policy()
        });
        assert_eq!(
            b.open_until(),
            Some(11 + 30_000),
            "an open breaker keeps its interval"
        );
    }

    const FAST: Duration = Duration::from_millis(10);

    fn claim(s: &mut SharedBreaker, now: UnixMs) -> ProbeGrant {
        s.apply(
            SharedOp::ClaimProbe {
                probes: 2,
                lost_after: 5_000,
            },
            now,
        )
        .unwrap()
    }

    fn probe(s: &mut SharedBreaker, now: UnixMs) -> UnixMs {
        match claim(s, now) {
            ProbeGrant::Probe { round } => round,
            other => panic!("no probe at {now}: {other:?}"),
        }
    }

    fn probed(s: &mut SharedBreaker, round: UnixMs, ok: bool, now: UnixMs) {
        let op = SharedOp::Probed {
            ok,
            probes: 2,
            open_for: 30_000,
            round,
        };
        assert_eq!(s.apply(op, now), None);
    }

    #[test]
    fn opens_after_min_calls_at_the_failure_rate() {
        let mut b = Breaker::new(policy(), 0);
        for i in 0..4 {
            assert_eq!(b.admit(i), Admit::Call);
            assert!(!b.record(true, FAST, i));
        }
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "fewer than min_calls: no judgement"
        );
        assert!(b.record(true, FAST, 5), "the fifth failure trips it");
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.open_until(), Some(30_005));
        assert_eq!(b.admit(10_000), Admit::Wait(30_005), "open: calls wait");
        assert_eq!(b.admit(30_005), Admit::Probe, "then the cluster is asked");
        assert!(
            !b.record(true, FAST, 30_006),
            "a late answer changes nothing"
        );
    }

    #[test]
    fn slow_calls_open_it_too() {
        let mut b = Breaker::new(policy(), 0);
        let tripped: Vec<bool> = (0..5)
            .map(|i| b.record(false, Duration::from_secs(3), i))
            .collect();
        assert_eq!(tripped, [false, false, false, false, true]);
    }

    #[test]
    fn the_cluster_hands_out_probes_and_their_answers_close_it() {
        let mut s = SharedBreaker::closed(0);
        assert_eq!(claim(&mut s, 1), ProbeGrant::Closed);
        s.apply(SharedOp::Open { until: 30_000 }, 10);
        assert_eq!(s.state, BreakerState::Open);
        assert_eq!(claim(&mut s, 29_999), ProbeGrant::Wait(30_000));
        // Two probes in the whole cluster, whichever nodes ask.
        let round = probe(&mut s, 30_000);
        assert_eq!((s.state, round), (BreakerState::HalfOpen, 30_000));
        assert_eq!(probe(&mut s, 30_001), round);
        assert!(matches!(claim(&mut s, 30_002), ProbeGrant::Wait(_)));
        probed(&mut s, round, true, 30_010);
        assert_eq!(s.state, BreakerState::HalfOpen, "one of two is not enough");
        assert!(
            matches!(claim(&mut s, 30_011), ProbeGrant::Wait(_)),
            "one answered well and one out: two are accounted for"
        );
        probed(&mut s, round, true, 30_020);
        assert_eq!(s.state, BreakerState::Closed);
        assert_eq!(s.changed_at, 30_020);
        assert_eq!(claim(&mut s, 30_021), ProbeGrant::Closed);
    }

    #[test]
    fn a_failed_probe_reopens_and_a_lost_one_is_claimed_again() {
        let mut s = SharedBreaker::closed(0);
        s.apply(SharedOp::Open { until: 100 }, 0);
        let first = probe(&mut s, 100);
        probed(&mut s, first, false, 150);
        assert_eq!(
            (s.state, s.open_until, s.probes_out),
            (BreakerState::Open, Some(30_150), 0)
        );
        let round = probe(&mut s, 30_150);
        probe(&mut s, 30_151);
        // A verdict from the first round is late: it changes nothing.
        probed(&mut s, first, true, 30_152);
        assert_eq!((s.probes_out, s.probes_ok), (2, 0));
        // Both prober nodes die: after `lost_after`, the probes are free.
        assert!(matches!(claim(&mut s, 35_150), ProbeGrant::Wait(_)));
        probe(&mut s, 35_151);
        // A released probe (never sent) frees its place at once.
        probe(&mut s, 35_152);
        s.apply(SharedOp::Release { round }, 35_153);
        probe(&mut s, 35_154);
        // A late verdict after an operator reset changes nothing.
        s.apply(SharedOp::Reset, 35_200);
        probed(&mut s, round, false, 35_201);
        assert_eq!(s.state, BreakerState::Closed);
    }

    #[test]
    fn an_earlier_open_does_not_shorten_a_later_one() {
        let mut s = SharedBreaker::closed(0);
        s.apply(SharedOp::Open { until: 50_000 }, 10);
        s.apply(SharedOp::Open { until: 40_000 }, 20);
        assert_eq!((s.open_until, s.changed_at), (Some(50_000), 10));
    }

    #[test]
    fn a_node_adopts_the_cluster_state_but_keeps_a_newer_trip_of_its_own() {
        let mut b = Breaker::new(policy(), 0);
        let mut s = SharedBreaker::closed(0);
        s.apply(SharedOp::Open { until: 30_000 }, 1_000);
        b.adopt(&s, 1_500);
        assert_eq!(
            b.admit(2_000),
            Admit::Wait(30_000),
            "another node opened it"
        );
        s.apply(SharedOp::Reset, 2_000);
        b.adopt(&s, 2_100);
        assert_eq!(b.admit(2_200), Admit::Call, "and another closed it");
        // This node trips at 3 000; the store still says closed (at 2 000).
        for i in 0..5 {
            b.record(true, FAST, 3_000 + i);
        }
        b.adopt(&s, 3_010);
        assert_eq!(b.state(), BreakerState::Open, "its own newer trip stays");
        let mut unpublished = b.clone();
        unpublished.adopt(&s, 33_005);
        assert_eq!(
            unpublished.admit(33_005),
            Admit::Call,
            "an unpublished trip ends with its interval"
        );
        s.apply(SharedOp::Open { until: 33_004 }, 3_020);
        probe(&mut s, 33_004);
        b.adopt(&s, 33_005);
        assert_eq!(b.admit(33_006), Admit::Probe, "half-open: ask the cluster");
    }

    proptest! {
        /// A closed breaker opens exactly when its window (at most `window`
        /// calls) holds `min_calls` and a threshold is met.
        #[test]
        fn window_rules_hold(outcomes in proptest::collection::vec(any::<(bool, bool)>(), 0..200)) {
            let p = policy();
            let mut b = Breaker::new(p, 0);
            let mut shadow: VecDeque<(bool, bool)> = VecDeque::new();
            for (i, (failed, slow)) in outcomes.into_iter().enumerate() {
                let now = i as i64 * 1000;
                if b.admit(now) != Admit::Call {
                    b.reset(now);
                    shadow.clear();
                }
                let took = if slow { Duration::from_secs(3) } else { Duration::from_millis(1) };
                let tripped = b.record(failed, took, now);
                if shadow.len() == p.window as usize {
                    shadow.pop_front();
                }
                shadow.push_back((failed, slow));
                let n = shadow.len();
                let f = shadow.iter().filter(|c| c.0).count() as f64;
                let sl = shadow.iter().filter(|c| c.1).count() as f64;
                let trips = n >= p.min_calls as usize
                    && (f / n as f64 >= p.failure_rate || sl / n as f64 >= p.slow_rate);
                prop_assert_eq!(tripped, trips);
                prop_assert_eq!(b.state() == BreakerState::Open, trips);
                prop_assert!(b.window_figures().0 <= p.window as usize);
            }
        }

        /// However many nodes ask, in whatever order, no more than `probes`
        /// probes are ever out at once, and the breaker closes only after
        /// `probes` good answers in a row of half-open.
        #[test]
        fn probes_are_counted_for_the_whole_cluster(
            probes in 1u32..4,
            steps in proptest::collection::vec((0u8..4, 0i64..400), 1..300),
        ) {
            let mut s = SharedBreaker::closed(0);
            s.apply(SharedOp::Open { until: 1_000 }, 0);
            let mut now = 0;
            let mut out = 0u32; // granted, not answered or released
            let mut good = 0u32;
            let mut round = 0;
            for (action, gap) in steps {
                now += gap;
                let before = s.state;
                match action {
                    0 | 1 => {
                        let op = SharedOp::ClaimProbe { probes, lost_after: i64::MAX / 4 };
                        if let Some(ProbeGrant::Probe { round: r }) = s.apply(op, now) {
                            out += 1;
                            round = r;
                        }
                    }
                    2 if out > 0 => {
                        out -= 1;
                        let ok = gap % 5 != 0;
                        s.apply(SharedOp::Probed { ok, probes, open_for: 1_000, round }, now);
                        if s.state == BreakerState::Open {
                            out = 0; // answers still out are late now
                            good = 0;
                        } else if before == BreakerState::HalfOpen {
                            good += 1;
                        }
                        if s.state == BreakerState::Closed {
                            prop_assert_eq!(good, probes);
                            s.apply(SharedOp::Open { until: now + 1_000 }, now);
                            out = 0;
                            good = 0;
                        }
                    }
                    3 if out > 0 => {
                        out -= 1;
                        s.apply(SharedOp::Release { round }, now);
                    }
                    _ => {}
                }
                prop_assert!(out <= probes, "{out} probes out of {probes}");
                prop_assert!(s.probes_out + s.probes_ok <= probes);
            }
        }
    }
}
