//! The gates a provider call passes before it leaves, whoever makes it (a
//! step's call, a confirmation poll, a notification to a subscriber): an
//! operator pause, a concurrency slot, the rate limits, the breaker (a
//! half-open probe claimed from the cluster), shutdown and the retry
//! budget; each place taken is given back on drop. And what a reply tells
//! every call to its provider ([`heard`]).

use std::time::Duration;

use super::Stopping;
use super::http::Exchange;
use super::limits::ProviderRuntime;
use super::permits::{Short, Taken, Why};
use crate::domain::breaker::{Admit, ProbeGrant, SharedOp};
use crate::domain::{Clock, Outcome, UnixMs};
use crate::store::Db;

/// Why the gates held a call back (no attempt spent).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Held {
    /// The node is stopping.
    Stopping,
    /// Not before `at`, for this reason.
    Deferred(UnixMs, &'static str),
    /// The provider's breaker is open until then.
    Outage(UnixMs),
}

/// The gates, as one caller passes them.
pub(super) struct Gate<'a> {
    pub(super) clock: &'a dyn Clock,
    /// For the cluster's breaker (half-open probes are claimed there) and
    /// the provider's cluster permits.
    pub(super) db: &'a Db,
    pub(super) node: &'a str,
    pub(super) stopping: &'a Stopping,
    /// The longest the call may wait for a slot or the rate limit.
    pub(super) max_wait: Duration,
    /// When the caller started (a pause defers from then).
    pub(super) now: UnixMs,
    /// The record the call is for (logs).
    pub(super) record: Option<i64>,
}

pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// A call's place in the provider's limits: its rate permits and its
/// count in flight, given back on drop, whether it finished, failed
/// before sending, or its pass was dropped mid-call.
pub(super) struct Flight<'a> {
    pub(super) rt: &'a ProviderRuntime,
    pub(super) clock: &'a dyn Clock,
    pub(super) taken: Taken,
    pub(super) sent: bool,
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        self.rt.limiter().complete();
        let now = self.clock.now_ms();
        self.rt.cluster.complete(&self.taken, self.sent, now);
    }
}

/// A concurrency slot; given back on drop, down to the slots this node
/// holds of the cluster's cap.
pub(super) struct Slot<'a> {
    rt: &'a ProviderRuntime,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.rt.cluster.give_back(permit);
        }
    }
}

/// What a call may tell the breaker, and, for a half-open probe of the
/// cluster's, the claim to give back if it never gets a verdict.
pub(super) struct Probe<'a> {
    rt: &'a ProviderRuntime,
    /// `Some(round)` for a cluster probe not yet answered.
    round: Option<UnixMs>,
    db: &'a Db,
    clock: &'a dyn Clock,
    judged: bool,
}

/// What a call taught the cluster's breaker, published by the pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BreakerNews {
    /// This node's window tripped: open the cluster's breaker until then.
    Tripped { until: UnixMs },
    /// A half-open probe's answer.
    Probed { ok: bool, round: UnixMs },
}

impl<'a> Probe<'a> {
    fn new(
        rt: &'a ProviderRuntime,
        db: &'a Db,
        clock: &'a dyn Clock,
        round: Option<UnixMs>,
    ) -> Self {
        Probe {
            rt,
            round,
            db,
            clock,
            judged: false,
        }
    }

    /// Records the call's verdict: news for the cluster when this node's
    /// window tripped or the call was a probe.
    pub(super) fn record(
        mut self,
        failed: bool,
        took: Duration,
        now: UnixMs,
    ) -> Option<BreakerNews> {
        self.judged = true;
        if let Some(round) = self.round {
            // A slow answer is no proof of health either.
            let slow = took >= self.rt.breaker().policy().slow_call;
            let ok = !failed && !slow;
            return Some(BreakerNews::Probed { ok, round });
        }
        let mut b = self.rt.breaker();
        let tripped = b.record(failed, took, now);
        tripped.then(|| BreakerNews::Tripped {
            until: b.open_until().unwrap_or(now),
        })
    }
}

impl Drop for Probe<'_> {
    /// A probe never made (or only throttled) goes back to the cluster at
    /// once, instead of holding its place until it is given up for lost.
    fn drop(&mut self) {
        let Some(round) = self.round.filter(|_| !self.judged) else {
            return;
        };
        let (db, name, now) = (self.db.clone(), self.rt.name.clone(), self.clock.now_ms());
        tokio::spawn(async move {
            let op = crate::domain::breaker::SharedOp::Release { round };
            if let Err(e) = db.breaker_op(&name, op, None, now).await {
                tracing::warn!(provider.name = %name, error = %e, "could not give a probe back; it lapses");
            }
        });
    }
}

/// What the gates granted a call: its concurrency slot, its place in the
/// rate limits, and its breaker permit, each given back on drop.
pub(super) struct Granted<'a> {
    pub(super) _slot: Slot<'a>,
    pub(super) flight: Flight<'a>,
    pub(super) probe: Probe<'a>,
}

/// What one reply tells every call to its provider, whichever call it
/// answered (a step's call, a poll, a lookup, a confirmation): the pause a
/// throttled reply asks for, and the breaker's news. The caller publishes
/// both to the cluster.
#[derive(Debug, Default)]
pub struct Heard {
    pub throttled: Option<(String, UnixMs)>,
    pub breaker: Option<(String, BreakerNews)>,
}

/// Hears a reply of `outcome` (`failed`: it counts against the provider's
/// health) to a call admitted as `probe`: a throttled reply pauses the
/// provider here at once (the other nodes once it is published) until its
/// `Retry-After`, or the provider's base backoff, and says nothing of its
/// health (a half-open probe goes back, still to be made); any other
/// reply is the breaker's to judge.
pub(super) fn heard(
    rt: &ProviderRuntime,
    (outcome, failed): (Outcome, bool),
    x: &Exchange,
    probe: Probe<'_>,
    after: UnixMs,
) -> Heard {
    if outcome == Outcome::Throttled {
        drop(probe);
        let base = rt.config.retry.policy().backoff.base;
        let until = after + ms(x.retry_after.unwrap_or(base));
        rt.limiter().pause_until(until);
        return Heard {
            throttled: Some((rt.name.clone(), until)),
            breaker: None,
        };
    }
    let news = probe.record(failed, x.took, after);
    Heard {
        throttled: None,
        breaker: news.map(|n| (rt.name.clone(), n)),
    }
}

impl<'a> Gate<'a> {
    /// The gates a call passes, in order: an operator pause, a concurrency
    /// slot, the rate limit, the breaker, shutdown, the retry budget. A
    /// gate that says no holds the call back (no attempt spent).
    ///
    /// The slot comes first, so that everything after it is decided just
    /// before the call goes out, not while queued behind other calls.
    /// Waiting for a slot or the rate limit is bounded: a record that
    /// cannot be served soon goes back to the queue instead of sitting on
    /// a lease while others could take it.
    /// `retry`: a retry (the budget must allow it); `first`: a first
    /// call (it adds to the budget; polls and confirmations do neither).
    pub(super) async fn enter<'r>(
        &self,
        rt: &'r ProviderRuntime,
        (retry, first): (bool, bool),
    ) -> Result<Granted<'r>, Held>
    where
        'a: 'r,
    {
        if rt.is_paused() {
            return Err(Held::Deferred(
                self.now + 5_000,
                "provider paused by an operator",
            ));
        }
        let wait_until = self.clock.now_ms() + ms(self.max_wait);
        let slot = self.slot(rt).await?;
        let taken = self.rate_limit(rt, wait_until).await?;
        // From here on the call counts against the limits until its guard
        // drops, even if this pass is cancelled mid-call (lease lost).
        let flight = Flight {
            rt,
            clock: self.clock,
            taken,
            sent: false,
        };
        let admit = rt.breaker().admit(self.clock.now_ms());
        let probe = match admit {
            Admit::Call => Probe::new(rt, self.db, self.clock, None),
            Admit::Wait(until) => return Err(Held::Outage(until)),
            Admit::Probe => self.claim_probe(rt).await?,
        };
        if self.stopping.is_set() {
            return Err(Held::Stopping);
        }
        // The waits above may have outlasted the slots' holding (a slow
        // database): no call on a slot the cluster may have given away.
        if !rt.cluster.slot_valid(self.clock.now_ms()) {
            let at = self.clock.now_ms() + 50;
            return Err(Held::Deferred(at, "provider concurrency cap reached"));
        }
        if retry && !rt.budget().try_retry(self.clock.now_ms()) {
            let at = self.clock.now_ms() + 1_000;
            return Err(Held::Deferred(at, "provider retry budget exhausted"));
        }
        if first {
            rt.budget().on_call(self.now);
        }
        Ok(Granted {
            _slot: slot,
            flight,
            probe,
        })
    }

    /// Asks the cluster for a half-open probe: this call is one, or the
    /// breaker closed meanwhile (call as usual), or the step waits.
    async fn claim_probe<'r>(&self, rt: &'r ProviderRuntime) -> Result<Probe<'r>, Held>
    where
        'a: 'r,
    {
        let now = self.clock.now_ms();
        let policy = *rt.breaker().policy();
        // A probe unanswered this long was lost with its node.
        let lost_after = super::limits::lapse_ms(&rt.config);
        let op = SharedOp::ClaimProbe {
            probes: policy.probes,
            lost_after,
        };
        match self.db.breaker_op(&rt.name, op, None, now).await {
            Ok((shared, grant)) => {
                rt.breaker().adopt(&shared, now);
                match grant {
                    Some(ProbeGrant::Probe { round }) => {
                        Ok(Probe::new(rt, self.db, self.clock, Some(round)))
                    }
                    Some(ProbeGrant::Closed) => {
                        rt.breaker().reset(now);
                        Ok(Probe::new(rt, self.db, self.clock, None))
                    }
                    Some(ProbeGrant::Wait(until)) => Err(Held::Deferred(
                        until,
                        "provider circuit breaker half-open; probes out",
                    )),
                    None => Err(Held::Outage(now + 1_000)),
                }
            }
            Err(e) => {
                tracing::warn!(record.id = self.record, provider.name = %rt.name, error = %e, "cannot claim a breaker probe");
                Err(Held::Deferred(
                    now + 1_000,
                    "provider circuit breaker half-open",
                ))
            }
        }
    }

    /// A concurrency slot: taken at once if free; otherwise (asking the
    /// cluster for more slots, for a cluster-wide cap) waited for within
    /// `max_wait`, listening for shutdown; else the step is deferred.
    async fn slot<'r>(&self, rt: &'r ProviderRuntime) -> Result<Slot<'r>, Held> {
        let now = self.clock.now_ms();
        rt.cluster.lapse_slots(now, &rt.concurrency);
        if let Ok(permit) = rt.concurrency.clone().try_acquire_owned() {
            rt.cluster.took_slot(&rt.concurrency);
            let slot = Slot {
                rt,
                permit: Some(permit),
            };
            if rt.cluster.renewal_due(now) {
                self.lease(rt, Why::Renew).await?;
            }
            return Ok(slot);
        }
        let _waiting = rt.cluster.waiting_for_slot(&rt.concurrency);
        let give_up = self.clock.instant() + self.max_wait;
        loop {
            self.lease(rt, Why::More).await?;
            // Asks again every SLOTS_ASK_EVERY while it waits: slots another
            // node gives up are found without waiting for the sync.
            let step = self.clock.instant() + super::permits::SLOTS_ASK_EVERY;
            let acquire = rt.concurrency.clone().acquire_owned();
            let slot = tokio::select! {
                slot = tokio::time::timeout_at(step.min(give_up), acquire) => slot,
                () = self.stopping.wait() => return Err(Held::Stopping),
            };
            match slot {
                Ok(Ok(permit)) => {
                    return Ok(Slot {
                        rt,
                        permit: Some(permit),
                    });
                }
                _ if self.clock.instant() < give_up => {}
                _ => {
                    let at = self.clock.now_ms() + 50;
                    return Err(Held::Deferred(at, "provider concurrency cap reached"));
                }
            }
        }
    }

    /// One lease request to the cluster (`ClusterLimits::lease`), bounded
    /// like the other waits of the gate: by `max_wait`, and by shutdown
    /// (then the step goes back). False when it failed or took too long.
    async fn lease(&self, rt: &ProviderRuntime, why: Why) -> Result<bool, Held> {
        let leased = rt.cluster.lease(
            self.db,
            &rt.name,
            self.node,
            self.clock,
            why,
            &rt.concurrency,
        );
        tokio::select! {
            r = tokio::time::timeout(self.max_wait, leased) => match r {
                Ok(Ok(())) => Ok(true),
                Ok(Err(e)) => {
                    tracing::warn!(record.id = self.record, provider.name = %rt.name, error = %e, "cannot lease provider permits");
                    Ok(false)
                }
                Err(_) => Ok(false),
            },
            () = self.stopping.wait() => Err(Held::Stopping),
        }
    }

    /// Takes the call's rate permits (leasing more from the cluster when a
    /// window has none) outside the provider's "slow down" pause, waiting
    /// while that is possible before `wait_until` (the clock's
    /// milliseconds); otherwise defers the step to when it may be.
    pub(super) async fn rate_limit(
        &self,
        rt: &ProviderRuntime,
        wait_until: UnixMs,
    ) -> Result<Taken, Held> {
        let mut leases = 0;
        loop {
            let t = self.clock.now_ms();
            let at = match rt.cluster.try_take(t) {
                Ok(taken) => match rt.limiter().try_acquire(t) {
                    Ok(()) => return Ok(taken),
                    Err(at) => {
                        rt.cluster.complete(&taken, false, t);
                        at
                    }
                },
                // A few requests, then the step goes back to the queue (a
                // grant used up by this node's other calls at once).
                Err(Short::Lease) if leases < 3 => {
                    leases += 1;
                    if !self.lease(rt, Why::More).await? {
                        return Err(Held::Deferred(t + 1_000, "provider rate limit"));
                    }
                    continue;
                }
                Err(Short::Lease) => t + 10,
                Err(Short::Until(at)) => at,
            };
            let wait = (at - t).max(1);
            if t + wait > wait_until {
                return Err(Held::Deferred(at, "provider rate limit"));
            }
            // Time is the point here: the limit frees a place at `at`.
            tokio::select! {
                () = self.clock.sleep_until(t + wait) => {}
                () = self.stopping.wait() => return Err(Held::Stopping),
            }
            leases = 0;
        }
    }
}
