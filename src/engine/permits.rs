//! A provider's limits as this node draws on the cluster's budget: rate
//! permits leased in small grants, and concurrency slots held, from the
//! database (`Cluster::lease_permits`, decided by `domain::permits`), so the
//! calls of every node together stay within each window and the cap.
//!
//! Calls take permits from the grants in memory; a lease request (one
//! transaction, one at a time per provider on this node) is made when a
//! window has no usable grant or more slots are wanted, when a node over
//! its share reports slots it gave up (once per ending call while another
//! node is short), and by the provider sync, which closes spent grants and
//! renews the holding.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Semaphore;

use crate::config::provider::RateLimit;
use crate::domain::permits::{Granted, SlotAsk, headroom};
use crate::domain::{Clock, UnixMs};
use crate::store::{Db, PermitRequest, Permits, SlotRequest, StoreResult};

/// How long a holding of slots lasts unless renewed (the provider sync
/// renews it every few seconds).
const SLOT_HOLD_MS: i64 = 15_000;

/// After a request got no more slots, calls arriving for one wait this long
/// for a slot to come back before one of them asks the cluster again.
pub const SLOTS_ASK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);
const SLOTS_ASK_EVERY_MS: i64 = SLOTS_ASK_EVERY.as_millis() as i64;

/// One grant this node draws on.
#[derive(Debug, Clone)]
struct Lot {
    id: i64,
    window: usize,
    left: i64,
    used: i64,
    in_flight: i64,
    granted_at: UnixMs,
    last_done: UnixMs,
    expires_at: UnixMs,
    /// Its limit changed (a reload): no more calls; closed once its calls
    /// end.
    retired: bool,
}

impl Lot {
    fn usable(&self, now: UnixMs) -> bool {
        !self.retired && self.left > 0 && now < self.expires_at
    }

    fn spent(&self, now: UnixMs) -> bool {
        !self.usable(now) && self.in_flight == 0
    }

    /// How the store closes it: (id, permits used, its last call's end).
    fn closing(&self) -> (i64, i64, UnixMs) {
        (
            self.id,
            self.used.max(0),
            self.last_done.max(self.granted_at),
        )
    }
}

impl Lots {
    /// Whether window `w` has a grant a call can draw on now.
    fn usable(&self, w: usize, now: UnixMs) -> bool {
        self.lots
            .iter()
            .any(|lot| lot.window == w && lot.usable(now))
    }
}

#[derive(Debug, Default)]
struct Lots {
    /// The provider's rate limits and their windows' lengths in ms (a
    /// grant's `window` is an index here).
    windows: Vec<(RateLimit, i64)>,
    lots: Vec<Lot>,
    /// Closes a failed or abandoned request did not deliver: sent again
    /// with the next one.
    unclosed: Vec<(i64, i64, UnixMs)>,
    /// Per window: when a refused request may be made again.
    full_until: Vec<UnixMs>,
    /// Moved by each reload: an answer to a request made before one is
    /// for limits no longer in force (its grants are closed unused).
    generation: u64,
}

/// The permits one call holds, one per window; give them back with
/// [`ClusterLimits::complete`].
#[derive(Debug, Default)]
pub struct Taken {
    ids: Vec<i64>,
}

/// Why a call cannot take its permits now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Short {
    /// A window has no usable grant: lease more, then try again.
    Lease,
    /// A window is full for the cluster until then.
    Until(UnixMs),
}

/// A cluster-wide concurrency cap as this node holds it: a semaphore whose
/// permits are the slots held.
struct Slots {
    cap: u32,
    /// Slots held (the target), and permits issued to the semaphore
    /// (available plus checked out), which follows the target as calls end.
    held: i64,
    issued: i64,
    until: UnixMs,
    /// The cluster had no more slots for this node: ask again after this.
    full_until: UnixMs,
    /// What the cluster last recorded for this node, and whether another
    /// node was short of its share then.
    recorded: i64,
    contended: bool,
    /// The most calls holding or waiting for a slot since this node last
    /// asked (its need: a sample at the moment of asking would miss the
    /// calls between two of their slots), and the need it last sent.
    peak: i64,
    asked: i64,
}

impl Slots {
    /// The cluster records more than this node may now have in flight
    /// while another node is short: it should hear of it now.
    fn report_due(&self) -> bool {
        self.contended && self.issued < self.recorded
    }

    fn renewal_due(&self, now: UnixMs) -> bool {
        self.held > 0 && now + SLOT_HOLD_MS / 3 >= self.until
    }
}

/// A provider's cluster-wide limits on this node.
pub struct ClusterLimits {
    lots: Mutex<Lots>,
    slots: Option<Mutex<Slots>>,
    /// One lease request at a time.
    leasing: tokio::sync::Mutex<()>,
    live_nodes: AtomicUsize,
    /// Calls on this node waiting for a slot.
    waiting: AtomicUsize,
    lapse_ms: AtomicI64,
}

/// Why a lease request is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// A call found no slot or no usable grant: lease more.
    More,
    /// A call found the holding due for renewal.
    Renew,
    /// The provider sync: close spent grants, renew or trim the holding.
    Sync,
}

/// A lease request not yet answered; dropped unanswered, its closes are
/// kept for the next one.
struct Unanswered<'a> {
    limits: &'a ClusterLimits,
    req: Option<&'a PermitRequest>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(req) = self.req {
            self.limits.keep(req);
        }
    }
}

/// A call counted as waiting for a slot.
pub struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn window_ms(l: &RateLimit) -> i64 {
    i64::try_from(l.per.as_millis())
        .unwrap_or(i64::MAX / 4)
        .max(1)
}

impl ClusterLimits {
    /// `cap`: a concurrency cap for the cluster (no slots are held until
    /// leased; the provider's semaphore starts empty).
    pub fn new(limits: &[RateLimit], cap: Option<u32>, lapse_ms: i64) -> Self {
        ClusterLimits {
            lots: Mutex::new(Lots {
                windows: limits.iter().map(|l| (*l, window_ms(l))).collect(),
                lots: Vec::new(),
                unclosed: Vec::new(),
                full_until: vec![0; limits.len()],
                generation: 0,
            }),
            slots: cap.map(|cap| {
                Mutex::new(Slots {
                    cap,
                    held: 0,
                    issued: 0,
                    until: 0,
                    full_until: 0,
                    recorded: 0,
                    contended: false,
                    peak: 0,
                    asked: 0,
                })
            }),
            leasing: tokio::sync::Mutex::new(()),
            live_nodes: AtomicUsize::new(1),
            waiting: AtomicUsize::new(0),
            lapse_ms: AtomicI64::new(lapse_ms),
        }
    }

    /// New limits (a configuration reload), the cap's scope unchanged.
    /// Grants in a window whose length and count are unchanged go on being
    /// drawn on; the others take no more calls and are closed once their
    /// calls end, so the next call leases under the new limit. A smaller
    /// cap trims the slots held as calls end (`slot_request`).
    pub fn reconfigure(&self, limits: &[RateLimit], cap: Option<u32>, lapse_ms: i64) {
        self.lapse_ms.store(lapse_ms, Ordering::Relaxed);
        {
            let mut l = lock(&self.lots);
            let Lots {
                windows,
                lots,
                full_until,
                ..
            } = &mut *l;
            let new: Vec<(RateLimit, i64)> = limits.iter().map(|l| (*l, window_ms(l))).collect();
            let same = |w: usize| new.iter().position(|n| Some(n) == windows.get(w));
            for lot in lots.iter_mut() {
                match same(lot.window) {
                    Some(w) => lot.window = w,
                    None => {
                        lot.window = usize::MAX;
                        lot.retired = true;
                    }
                }
            }
            *full_until = (0..new.len())
                .map(|w| {
                    let old = windows.iter().position(|o| *o == new[w]);
                    old.map_or(0, |o| full_until[o])
                })
                .collect();
            *windows = new;
            l.generation += 1;
        }
        if let (Some(slots), Some(cap)) = (&self.slots, cap) {
            lock(slots).cap = cap;
        }
    }

    /// Whether there is anything to govern (or to close: grants left by
    /// limits a reload removed).
    pub fn is_empty(&self) -> bool {
        let l = lock(&self.lots);
        l.windows.is_empty() && l.lots.is_empty() && l.unclosed.is_empty() && self.slots.is_none()
    }

    pub fn set_live_nodes(&self, n: usize) {
        self.live_nodes.store(n.max(1), Ordering::Relaxed);
    }

    /// Takes one permit in every window, or says what is short.
    pub fn try_take(&self, now: UnixMs) -> Result<Taken, Short> {
        let mut l = lock(&self.lots);
        if l.windows.is_empty() {
            return Ok(Taken::default());
        }
        let mut at = Vec::with_capacity(l.windows.len());
        for w in 0..l.windows.len() {
            match l
                .lots
                .iter()
                .position(|lot| lot.window == w && lot.usable(now))
            {
                Some(i) => at.push(i),
                None if l.full_until[w] > now => return Err(Short::Until(l.full_until[w])),
                None => return Err(Short::Lease),
            }
        }
        let mut taken = Taken {
            ids: Vec::with_capacity(at.len()),
        };
        for i in at {
            let lot = &mut l.lots[i];
            lot.left -= 1;
            lot.used += 1;
            lot.in_flight += 1;
            taken.ids.push(lot.id);
        }
        Ok(taken)
    }

    /// A call's permits come back: it completed at `now` (`sent`), or was
    /// never sent (its permits can be drawn on again).
    pub fn complete(&self, taken: &Taken, sent: bool, now: UnixMs) {
        if taken.ids.is_empty() {
            return;
        }
        let mut l = lock(&self.lots);
        for lot in l.lots.iter_mut().filter(|lot| taken.ids.contains(&lot.id)) {
            lot.in_flight -= 1;
            if sent {
                lot.last_done = lot.last_done.max(now);
            } else {
                lot.used -= 1;
                lot.left += 1;
            }
        }
    }

    /// Calls in flight on this node's grants, and per window its text,
    /// the permits this node has drawn in it, and its count.
    pub fn usage(&self) -> Vec<(String, usize, u32)> {
        let l = lock(&self.lots);
        l.windows
            .iter()
            .enumerate()
            .map(|(w, (limit, _))| {
                let used: i64 = l
                    .lots
                    .iter()
                    .filter(|lot| lot.window == w)
                    .map(|lot| lot.used)
                    .sum();
                (format!("{limit:?}"), used.max(0) as usize, limit.count)
            })
            .collect()
    }

    /// The request this node makes now: close spent grants, lease in the
    /// windows that have no usable grant (for a call: `Why::More`), and
    /// say what slots it needs. `None` when there is nothing to say.
    /// Spent grants leave `lots` here; [`keep`](Self::keep) queues their
    /// closes again if the request fails.
    fn request(
        &self,
        provider: &str,
        node: &str,
        now: UnixMs,
        why: Why,
        sem: &Semaphore,
    ) -> Option<PermitRequest> {
        let mut req = PermitRequest {
            provider: provider.to_owned(),
            node: node.to_owned(),
            now,
            lapse_ms: self.lapse_ms.load(Ordering::Relaxed),
            live_nodes: self.live_nodes.load(Ordering::Relaxed),
            ..PermitRequest::default()
        };
        {
            let mut l = lock(&self.lots);
            let (spent, kept): (Vec<Lot>, Vec<Lot>) =
                l.lots.drain(..).partition(|lot| lot.spent(now));
            l.lots = kept;
            req.close = std::mem::take(&mut l.unclosed);
            req.close.extend(spent.iter().map(Lot::closing));
            if why == Why::More {
                for (w, (limit, ms)) in l.windows.iter().enumerate() {
                    if !l.usable(w, now) && l.full_until[w] <= now {
                        req.windows.push((*ms, limit.count, i64::MAX / 4));
                    }
                }
            }
        }
        if let Some(slots) = &self.slots {
            req.slots = self.slot_request(&mut lock(slots), now, why, sem);
        }
        (!req.close.is_empty() || !req.windows.is_empty() || req.slots.is_some()).then_some(req)
    }

    /// This node's calls holding or waiting for a slot at this moment.
    fn wanted_now(&self, s: &Slots, sem: &Semaphore) -> i64 {
        let in_use = (s.issued - sem.available_permits() as i64).max(0);
        in_use + self.waiting.load(Ordering::Relaxed) as i64
    }

    /// The slots part of a request: this node's need (the cluster decides
    /// its share and any headroom), or `None` when the cluster knows it.
    fn slot_request(
        &self,
        s: &mut Slots,
        now: UnixMs,
        why: Why,
        sem: &Semaphore,
    ) -> Option<SlotRequest> {
        let now_wanted = self.wanted_now(s, sem);
        let need = s.peak.max(now_wanted).min(i64::from(s.cap));
        // Slots this node cannot be given (its need and the most headroom)
        // leave the semaphore before the cluster hears of it, so no call
        // starts on a slot another node may be granted meanwhile. What is
        // still issued (free or in use) is what this node may have in
        // flight: the cluster records at least that for it.
        let keep = (need + headroom(s.cap)).min(i64::from(s.cap));
        if keep < s.issued {
            let gone = sem.forget_permits((s.issued - keep) as usize);
            s.issued -= gone as i64;
            s.held = s.held.min(s.issued.max(keep));
        }
        // Ask when the need changed or is not met, the holding is due, the
        // cluster records more than this node may now have in flight, or
        // another node is short (this node's share is recomputed); and at
        // each provider sync while holding or needing any (another node
        // may have become short since: it announces it by running the
        // others' syncs at once).
        let sync = why == Why::Sync && (s.recorded > 0 || need > 0);
        let ask = sync
            || need != s.asked
            || s.held < need
            || s.renewal_due(now)
            || s.issued < s.recorded
            || s.contended;
        if !ask {
            return None;
        }
        s.peak = now_wanted;
        Some(SlotRequest {
            ask: SlotAsk {
                cap: s.cap,
                need,
                in_use: s.issued,
                headroom: true,
            },
            hold_ms: SLOT_HOLD_MS,
        })
    }

    /// Whether a call asking for a lease has what it needs without one: a
    /// usable grant in every window, and a free slot (or none to be had
    /// from the cluster just now).
    fn satisfied(&self, now: UnixMs, sem: &Semaphore) -> bool {
        let windows = {
            let l = lock(&self.lots);
            (0..l.windows.len()).all(|w| l.usable(w, now) || l.full_until[w] > now)
        };
        let slots = self
            .slots
            .as_ref()
            .is_none_or(|s| sem.available_permits() > 0 || now < lock(s).full_until);
        windows && slots
    }

    /// Queues again the closes a failed request did not deliver (those
    /// grants stay open in the database until the next request closes them).
    fn keep(&self, req: &PermitRequest) {
        lock(&self.lots).unclosed.extend_from_slice(&req.close);
    }

    fn apply(
        &self,
        req: &PermitRequest,
        permits: &Permits,
        (now, generation): (UnixMs, u64),
        sem: &Semaphore,
    ) {
        {
            let mut l = lock(&self.lots);
            for &(ms, id, answer) in &permits.windows {
                let w = l.windows.iter().position(|(_, m)| *m == ms);
                let Some(w) = w.filter(|_| l.generation == generation) else {
                    // Granted for limits a reload replaced meanwhile:
                    // closed unused with the next request.
                    if let (Granted::Permits { .. }, Some(id)) = (answer, id) {
                        l.unclosed.push((id, 0, now));
                    }
                    continue;
                };
                match (answer, id) {
                    (Granted::Permits { count, expires_at }, Some(id)) => l.lots.push(Lot {
                        id,
                        window: w,
                        left: count,
                        used: 0,
                        in_flight: 0,
                        granted_at: now,
                        last_done: now,
                        expires_at,
                        retired: false,
                    }),
                    (Granted::Full { retry_at }, _) => l.full_until[w] = retry_at,
                    _ => {}
                }
            }
        }
        if let (Some(slots), Some(asked), Some((share, until))) =
            (&self.slots, req.slots, permits.slots)
        {
            let mut s = lock(slots);
            s.asked = asked.ask.need;
            s.held = share.target;
            s.recorded = share.holding;
            s.contended = share.contended;
            s.until = until;
            reconcile(&mut s, sem);
        }
    }

    /// Whether the cluster should hear from this node now: its holding is
    /// due for renewal, or it has come down while another node is short
    /// (a busy node does both from its calls; the provider sync renews
    /// every few seconds).
    pub fn renewal_due(&self, now: UnixMs) -> bool {
        self.slots.as_ref().is_some_and(|s| {
            let s = lock(s);
            s.renewal_due(now) || s.report_due()
        })
    }

    /// Notes a call holding a slot of `sem` (its need counts it until
    /// this node next asks).
    pub fn took_slot(&self, sem: &Semaphore) {
        if let Some(slots) = &self.slots {
            let mut s = lock(slots);
            s.peak = s.peak.max(self.wanted_now(&s, sem));
        }
    }

    /// Counts a call waiting for a slot of `sem` until the guard drops
    /// (the leases made meanwhile ask for it).
    pub fn waiting_for_slot(&self, sem: &Semaphore) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        self.took_slot(sem);
        Waiting(&self.waiting)
    }

    /// A call's slot comes back: forgotten when this node is over the
    /// slots it may use (a returned permit would go straight to a waiting
    /// call, past the target), given back otherwise.
    pub fn give_back(&self, permit: tokio::sync::OwnedSemaphorePermit) {
        let Some(slots) = &self.slots else {
            return drop(permit);
        };
        let mut s = lock(slots);
        if s.issued > s.held {
            permit.forget();
            s.issued -= 1;
        } else {
            drop(permit);
        }
    }

    /// Whether this node may start a call on a slot now: its holding has
    /// not run out unrenewed.
    pub fn slot_valid(&self, now: UnixMs) -> bool {
        self.slots.as_ref().is_none_or(|s| now < lock(s).until)
    }

    /// Holds no slots once the holding has run out unrenewed (the database
    /// was out of reach or slow: other nodes may be granted them soon); a
    /// call then asks the cluster again before it starts.
    pub fn lapse_slots(&self, now: UnixMs, sem: &Semaphore) {
        if let Some(slots) = &self.slots {
            let mut s = lock(slots);
            if now >= s.until && s.held > 0 {
                s.held = 0;
                reconcile(&mut s, sem);
            }
        }
    }

    /// Makes one lease request (`lease`: for the windows short of a grant
    /// too), and applies the answer. Concurrent callers wait for the one
    /// in progress and then look again.
    pub async fn lease(
        &self,
        db: &Db,
        provider: &str,
        node: &str,
        clock: &dyn Clock,
        why: Why,
        sem: &Semaphore,
    ) -> StoreResult<()> {
        let _one = self.leasing.lock().await;
        // Read after waiting for the request ahead: grants live from now.
        let now = clock.now_ms();
        // Callers that queued behind one request may be answered by it:
        // they look at what it leased before asking again.
        let lease = why == Why::More;
        if (lease && self.satisfied(now, sem)) || (why == Why::Renew && !self.renewal_due(now)) {
            return Ok(());
        }
        self.ask(db, provider, node, now, why, sem).await?;
        // Told to come down while another node is short, this node forgot
        // its free slots over its share: the cluster hears of it at once,
        // so the other node finds them at its next ask (the slots still in
        // use follow as their calls end, from the next call here).
        if self.slots.as_ref().is_some_and(|s| lock(s).report_due()) {
            self.ask(db, provider, node, clock.now_ms(), Why::Renew, sem)
                .await?;
        }
        Ok(())
    }

    /// One lease request, if there is anything to say, and its answer
    /// applied.
    async fn ask(
        &self,
        db: &Db,
        provider: &str,
        node: &str,
        now: UnixMs,
        why: Why,
        sem: &Semaphore,
    ) -> StoreResult<()> {
        let generation = lock(&self.lots).generation;
        let Some(req) = self.request(provider, node, now, why, sem) else {
            return Ok(());
        };
        let held_before = self.slots.as_ref().map(|s| lock(s).held);
        // A caller that stops waiting (its pass gave up or the node is
        // stopping) drops this future: the grants it was closing are kept
        // for the next request. (Grants made by a request whose answer is
        // never read stay open in the database until they lapse.)
        let mut pending = Unanswered {
            limits: self,
            req: Some(&req),
        };
        let answer = db.lease_permits(&req).await;
        pending.req = None;
        match answer {
            Ok(permits) => {
                self.apply(&req, &permits, (now, generation), sem);
                // No more slots to be had: calls wait for their own to come
                // back instead of each asking again at once.
                if let (Some(slots), Some(before), Some((share, _))) =
                    (&self.slots, held_before, permits.slots)
                {
                    if share.target <= before && self.waiting.load(Ordering::Relaxed) > 0 {
                        lock(slots).full_until = now + SLOTS_ASK_EVERY_MS;
                    }
                }
                Ok(())
            }
            Err(e) => {
                self.keep(&req);
                self.lapse_slots(now, sem);
                Err(e)
            }
        }
    }

    /// What this node holds goes back (shutdown): grants with no call in
    /// flight close with what they used; the slots come down to the calls
    /// still in flight (a call past the grace period keeps its slot until
    /// its node's holding lapses).
    pub async fn release(
        &self,
        db: &Db,
        provider: &str,
        node: &str,
        clock: &dyn Clock,
        sem: &Semaphore,
    ) -> StoreResult<()> {
        let _one = self.leasing.lock().await;
        let now = clock.now_ms();
        let mut req = PermitRequest {
            provider: provider.to_owned(),
            node: node.to_owned(),
            now,
            lapse_ms: self.lapse_ms.load(Ordering::Relaxed),
            live_nodes: 1,
            ..PermitRequest::default()
        };
        {
            let mut l = lock(&self.lots);
            req.close = std::mem::take(&mut l.unclosed);
            let idle = l.lots.iter().filter(|lot| lot.in_flight == 0);
            req.close.extend(idle.map(Lot::closing));
        }
        if let Some(slots) = &self.slots {
            let mut s = lock(slots);
            s.held = 0;
            reconcile(&mut s, sem);
            // What is left issued is checked out: calls in flight.
            req.slots = Some(SlotRequest {
                ask: SlotAsk {
                    cap: s.cap,
                    need: 0,
                    in_use: s.issued,
                    headroom: false,
                },
                hold_ms: SLOT_HOLD_MS,
            });
        }
        if req.close.is_empty() && req.slots.is_none() {
            return Ok(());
        }
        db.lease_permits(&req).await.map(|_| ())
    }
}

/// Brings the semaphore's permits to the holding: adds what is missing,
/// forgets what is over (those checked out are forgotten as they return).
fn reconcile(s: &mut Slots, sem: &Semaphore) {
    if s.issued < s.held {
        sem.add_permits((s.held - s.issued) as usize);
        s.issued = s.held;
    } else if s.issued > s.held {
        let gone = sem.forget_permits((s.issued - s.held) as usize);
        s.issued -= gone as i64;
    }
}

/// A provider's semaphore for a cluster-wide cap: no slots until leased.
pub fn cluster_semaphore() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(text: &str) -> RateLimit {
        text.parse().unwrap()
    }

    fn lot(id: i64, window: usize, left: i64) -> Lot {
        Lot {
            id,
            window,
            left,
            used: 0,
            in_flight: 0,
            granted_at: 0,
            last_done: 0,
            expires_at: 10_000,
            retired: false,
        }
    }

    /// A reload keeps the grants of a window it leaves as it was (moved to
    /// its new place) and stops the others, which close once their calls
    /// end; a cap changes in place.
    #[test]
    fn new_limits_keep_only_the_grants_of_unchanged_windows() {
        let c = ClusterLimits::new(&[limit("40/s"), limit("1000/day")], Some(8), 5_000);
        {
            let mut l = lock(&c.lots);
            l.lots = vec![lot(1, 0, 5), lot(2, 1, 50)];
            l.full_until = vec![700, 900];
        }
        assert!(c.try_take(0).is_ok());
        c.reconfigure(&[limit("1000/day"), limit("20/s")], Some(4), 9_000);
        let l = lock(&c.lots);
        assert_eq!(l.windows.len(), 2);
        assert!(
            l.lots[0].retired && l.lots[0].window == usize::MAX && !l.lots[0].usable(0),
            "40/s is gone"
        );
        assert_eq!(
            (l.lots[1].window, l.lots[1].left),
            (0, 49),
            "1000/day moved, kept"
        );
        assert_eq!(l.full_until, vec![900, 0]);
        assert!(!l.usable(1, 0), "20/s has no grant yet: a call leases");
        assert!(
            l.lots[0].in_flight == 1 && !l.lots[0].spent(0),
            "its call is still out"
        );
        drop(l);
        assert_eq!(c.lapse_ms.load(Ordering::Relaxed), 9_000);
        assert_eq!(lock(c.slots.as_ref().unwrap()).cap, 4);
        assert_eq!(c.try_take(0).err(), Some(Short::Lease));
        // The retired grant's call comes back unsent: still closed, not
        // drawn on again.
        c.complete(&Taken { ids: vec![1] }, false, 5);
        assert!(lock(&c.lots).lots[0].spent(5));
    }

    /// A node-scope provider whose every rate limit a reload removed still
    /// has grants to close: the provider sync keeps going to it until
    /// they are closed.
    #[test]
    fn limits_all_removed_leave_their_grants_to_close() {
        let c = ClusterLimits::new(&[limit("40/s")], None, 5_000);
        assert!(!c.is_empty());
        lock(&c.lots).lots = vec![lot(1, 0, 5)];
        c.reconfigure(&[], None, 5_000);
        assert!(!c.is_empty(), "a grant to close");
        assert_eq!(
            c.try_take(0).map(|t| t.ids.len()),
            Ok(0),
            "calls are not held"
        );
        let sem = Semaphore::new(0);
        let req = c.request("p", "n", 0, Why::Sync, &sem).expect("a close");
        assert_eq!(req.close, vec![(1, 0, 0)]);
        assert!(c.is_empty(), "nothing left");
        let none = ClusterLimits::new(&[], None, 5_000);
        assert!(none.is_empty());
    }

    /// An answer to a request made before a reload is for limits no longer
    /// in force: its grants are queued to be closed, not drawn on.
    #[test]
    fn an_answer_from_before_a_reload_is_closed_unused() {
        let c = ClusterLimits::new(&[limit("40/s")], None, 5_000);
        let generation = lock(&c.lots).generation;
        c.reconfigure(&[limit("20/s")], None, 5_000);
        let answer = Permits {
            windows: vec![(
                1_000,
                Some(7),
                Granted::Permits {
                    count: 40,
                    expires_at: 9_000,
                },
            )],
            ..Permits::default()
        };
        let sem = Semaphore::new(0);
        c.apply(&PermitRequest::default(), &answer, (100, generation), &sem);
        {
            let l = lock(&c.lots);
            assert!(l.lots.is_empty());
            assert_eq!(l.unclosed, vec![(7, 0, 100)]);
        }
        // The same answer to a request made since is drawn on.
        let now = lock(&c.lots).generation;
        c.apply(&PermitRequest::default(), &answer, (100, now), &sem);
        let l = lock(&c.lots);
        assert_eq!((l.lots.len(), l.lots[0].id, l.lots[0].left), (1, 7, 40));
        assert!(l.usable(0, 100));
    }
}
