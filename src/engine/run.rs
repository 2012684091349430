//! The run loop: claims due records while slots are free and starts their
//! passes, beside the background loops (`supervisor`), and hands back what
//! it holds at shutdown.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::supervisor::Supervisor;
use super::{Engine, Inner, Stopping, lock};
use crate::domain::{Record, StepRun, UnixMs};
use crate::store::{ClaimRequest, Db, Lease, StoreError};

/// How stale a SQLite node's view of other processes' provider changes
/// may be when it claims.
const PROVIDERS_READ_EVERY_MS: i64 = 100;

/// How long an idle engine waits before claiming again when work is due
/// that its last claim could not take (see `idle_wait`).
const DUE_BUT_TAKEN: Duration = Duration::from_millis(200);

/// The most records one claim takes when more slots than a batch are free.
const CLAIM_MAX: usize = 1_000;

/// The longest the dispatch loop waits without turning.
pub const PULSE_EVERY: Duration = Duration::from_secs(1);

/// A claimed record, with its step runs when the claim could read them.
type Claimed = (Record, Option<Vec<StepRun>>);

/// A claim in flight beside the run loop's dispatch.
type ClaimFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Vec<Claimed>, StoreError>> + Send + 'a>,
>;

impl Engine {
    /// Wakes the loop (new work arrived).
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Claims one batch and processes it to completion; returns how many
    /// records it handled. Tests drive the engine with this until it is idle.
    pub async fn execute_next(&self) -> Result<usize, StoreError> {
        let now = self.inner.clock.now_ms();
        let claimed = self.claim(self.inner.opts.batch, now).await?;
        let n = claimed.len();
        let mut tasks = tokio::task::JoinSet::new();
        let running = Arc::new(Stopping::default());
        for (rec, runs) in claimed {
            let (engine, running) = (self.clone(), running.clone());
            tasks.spawn(async move { engine.process(rec, runs, &running, None).await });
        }
        while tasks.join_next().await.is_some() {}
        Ok(n)
    }

    /// Claims up to `limit` records due at `now` and reads their step
    /// runs in one query (a record whose runs could not be read reads them
    /// in its pass).
    async fn claim(&self, limit: u32, now: UnixMs) -> Result<Vec<Claimed>, StoreError> {
        let i = &self.inner;
        // Another process on the same SQLite file cannot notify this one:
        // its pauses and breaker changes are read here, at most every
        // PROVIDERS_READ_EVERY.
        if matches!(i.db, Db::Sqlite(_)) {
            let read_at = i
                .providers_read_at
                .load(std::sync::atomic::Ordering::Relaxed);
            if i.clock.now_ms() - read_at >= PROVIDERS_READ_EVERY_MS {
                super::sync::read_provider_states(i).await;
            }
        }
        let req = ClaimRequest {
            owner: i.opts.node_id.clone(),
            now,
            lease: i.opts.lease,
            limit,
            group_caps: i.setup().group_caps.clone(),
        };
        let started = i.clock.instant();
        let claimed = i.db.claim_due(&req).await?;
        tracing::debug!(
            want = limit,
            claimed = claimed.len(),
            took_us = (i.clock.instant() - started).as_micros() as u64,
            "claimed"
        );
        {
            let mut held = lock(&i.held);
            for rec in &claimed {
                if let Some(lease) = rec.lease() {
                    held.insert(rec.id, lease);
                }
            }
        }
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        // Which providers have calls left open, read after the claim: an
        // intent is written under its node's lease, so any left on these
        // records is seen here, whatever this node's `at_most_once` says.
        match i.db.intent_providers().await {
            Ok(open) => *lock(&i.left_open) = open.into_iter().collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read which providers have calls left open");
            }
        }
        let ids: Vec<i64> = claimed.iter().map(|r| r.id).collect();
        let mut runs: Option<HashMap<i64, Vec<StepRun>>> = match i.db.step_runs_of(&ids).await {
            Ok(all) => {
                let mut by_record: HashMap<i64, Vec<StepRun>> = HashMap::with_capacity(ids.len());
                for run in all {
                    by_record.entry(run.record_id).or_default().push(run);
                }
                Some(by_record)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the claimed records' steps; each pass reads its own");
                None
            }
        };
        Ok(claimed
            .into_iter()
            .map(|rec| {
                let r = runs.as_mut().map(|m| m.remove(&rec.id).unwrap_or_default());
                (rec, r)
            })
            .collect())
    }

    /// Whether the dispatch loop turned within `limit` (it turns at least
    /// every [`PULSE_EVERY`] while it runs, so a limit under three of
    /// those counts as three): what systemd's watchdog asks.
    pub fn turned_within(&self, limit: Duration) -> bool {
        let i = &self.inner;
        let now = i.clock.instant().saturating_duration_since(i.born);
        let last = Duration::from_millis(i.pulse.load(std::sync::atomic::Ordering::Relaxed));
        turned(now, last, limit)
    }

    /// Runs until `shutdown`: claims while there are free slots, sleeps
    /// until signalled or the earliest record is due, keeps leases alive,
    /// and on shutdown stops claiming, lets in-flight work finish within
    /// `grace`, and gives back what is left without spending attempts.
    pub async fn run(&self, shutdown: CancellationToken, grace: Duration) {
        let loops = Supervisor::start(self, &shutdown).await;
        let mut dispatch = Dispatch::new(self);
        while !shutdown.is_cancelled() {
            beat(&self.inner);
            dispatch.start_ready();
            dispatch.claim_more();
            if !dispatch.turn(&shutdown).await {
                break;
            }
        }
        let leases = dispatch.wind_down(grace).await;
        // The background loops stop (in their order) before this node's
        // share of the providers' limits and its records go back; the
        // keeper and the flusher after.
        loops.stop(hand_back(&self.inner, leases)).await;
        let i = &self.inner;
        if let Err(e) = i.db.remove_node(&i.opts.node_id).await {
            tracing::warn!(error = %e, "could not deregister the node");
        }
    }
}

/// Notes that the dispatch loop turned.
fn beat(i: &Inner) {
    let at = i.clock.instant().saturating_duration_since(i.born);
    i.pulse.store(
        u64::try_from(at.as_millis()).unwrap_or(u64::MAX),
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// At shutdown, once the background loops that could use them have
/// stopped: this node's share of the providers' limits goes back, then
/// the leases of its records not started (or all, when every pass
/// finished).
async fn hand_back(i: &Inner, leases: Vec<Lease>) {
    super::sync::release_permits(i).await;
    if !leases.is_empty() {
        match i.db.release(&leases, i.clock.now_ms()).await {
            Ok(n) => tracing::info!(released = n, "released leases"),
            Err(e) => tracing::warn!(error = %e, "could not release leases; they will expire"),
        }
    }
}

/// The dispatch loop's state over one [`Engine::run`].
struct Dispatch<'a> {
    engine: &'a Engine,
    tasks: TaskTracker,
    stopping: Arc<Stopping>,
    batch: usize,
    /// Claimed records waiting for a slot. Claims run ahead of the slots
    /// by up to one batch, so a freed slot is refilled at once and claims
    /// stay large; buffered records are leased (the keeper extends them,
    /// shutdown releases them). A claim runs beside the dispatch, not in
    /// its way: slots freed while it waits for the database (behind a
    /// group commit, on SQLite's one writer) are refilled from the buffer
    /// at once.
    ready: VecDeque<Claimed>,
    claiming: Option<ClaimFuture<'a>>,
    /// The time the claim under way (or the last) took records due at.
    claimed_from: UnixMs,
    /// Set after a claim that leaves nothing to start: the next claim
    /// waits for a wake-up, a freed slot (a pass started) or this instant.
    waiting: Option<tokio::time::Instant>,
}

impl<'a> Dispatch<'a> {
    fn new(engine: &'a Engine) -> Dispatch<'a> {
        Dispatch {
            engine,
            tasks: TaskTracker::new(),
            stopping: Arc::new(Stopping::default()),
            batch: engine.inner.opts.batch.max(1) as usize,
            ready: VecDeque::new(),
            claiming: None,
            claimed_from: 0,
            waiting: None,
        }
    }

    /// Starts a pass for each buffered record there is a free slot for.
    fn start_ready(&mut self) {
        let i = &self.engine.inner;
        let mut started = false;
        while !self.ready.is_empty() {
            let Ok(permit) = i.slots.clone().try_acquire_owned() else {
                break;
            };
            let Some((rec, runs)) = self.ready.pop_front() else {
                break;
            };
            // The keeper drops leases it could not extend (a database
            // outage while the record waited): another node may own it.
            if !lock(&i.held).contains_key(&rec.id) {
                continue;
            }
            let (engine, stopping) = (self.engine.clone(), self.stopping.clone());
            self.tasks
                .spawn(async move { engine.process(rec, runs, &stopping, Some(permit)).await });
            started = true;
        }
        if started {
            self.waiting = None;
        }
    }

    /// Starts a claim when none is under way or waited for and the buffer
    /// runs low. A claim takes at least a batch, and as many as there are
    /// free slots (up to CLAIM_MAX): with many calls in flight, one round
    /// trip refills what finished meanwhile (claiming a fixed batch, a
    /// node with a thousand calls in flight waited on its claims).
    fn claim_more(&mut self) {
        let i = &self.engine.inner;
        let target = self.batch.max(i.slots.available_permits().min(CLAIM_MAX));
        if self.claiming.is_none()
            && self.waiting.is_none()
            && self.ready.len() < target.div_ceil(2)
        {
            let want = (target - self.ready.len()) as u32;
            self.claimed_from = i.clock.now_ms();
            let claim = self.engine.claim(want, self.claimed_from);
            self.claiming = Some(Box::pin(claim));
        }
    }

    /// Waits for what turns the loop next: a claim's records, a wake-up,
    /// the end of a wait, a freed slot, or the pulse. False at shutdown.
    async fn turn(&mut self, shutdown: &CancellationToken) -> bool {
        let engine = self.engine;
        let i = &engine.inner;
        let busy = !self.ready.is_empty();
        let waits = self.waiting.is_some();
        let until = self.waiting.unwrap_or_else(|| i.clock.instant());
        let claiming = &mut self.claiming;
        let claim_out = claiming.is_some();
        let claimed = tokio::select! {
            () = shutdown.cancelled() => return false,
            claimed = async {
                match claiming.as_mut() {
                    Some(claim) => claim.await,
                    None => std::future::pending().await,
                }
            }, if claim_out => Some(claimed),
            () = i.wake.notified(), if waits && !busy => None,
            () = tokio::time::sleep_until(until), if waits => None,
            // A freed slot: the next pass refills it at the loop's top.
            Ok(_) = i.slots.acquire(), if busy => None,
            // The loop turns at least this often, all slots busy or not,
            // so that a loop that stops turning is seen (`beat`).
            () = tokio::time::sleep(PULSE_EVERY) => return true,
        };
        match claimed {
            Some(claimed) => self.claimed(claimed).await,
            None => self.waiting = None,
        }
        true
    }

    /// Buffers what a claim took; after one that leaves nothing to start,
    /// waits before the next.
    async fn claimed(&mut self, claimed: Result<Vec<Claimed>, StoreError>) {
        let i = &self.engine.inner;
        self.claiming = None;
        let mut claimed_any = false;
        match claimed {
            Ok(records) => {
                claimed_any = !records.is_empty();
                self.ready.extend(records);
            }
            Err(e) => tracing::warn!(error = %e, "claim failed; retrying shortly"),
        }
        if !(claimed_any && i.slots.available_permits() > 0) {
            // With work buffered, a freed slot is the signal: no need to
            // ask the database when work is due.
            let sleep = if self.ready.is_empty() {
                let next_due = i.db.next_due_at().await.ok().flatten();
                idle_wait(
                    next_due,
                    self.claimed_from,
                    i.clock.now_ms(),
                    i.opts.idle_max,
                )
            } else {
                i.opts.idle_max
            };
            self.waiting = Some(i.clock.instant() + sleep);
        }
    }

    /// Stops claiming and lets the passes under way finish within `grace`;
    /// returns the leases to give back.
    async fn wind_down(mut self, grace: Duration) -> Vec<Lease> {
        let i = &self.engine.inner;
        // A claim in flight at shutdown is let finish: records it took are
        // given back with the rest, not left leased.
        if let Some(claim) = self.claiming.take() {
            if let Ok(records) = claim.await {
                self.ready.extend(records);
            }
        }
        // Calls in flight finish; passes waiting for a slot, the rate limit
        // or their next step start no call and give their records back.
        self.stopping.stop();
        self.tasks.close();
        let finished = tokio::time::timeout(grace, self.tasks.wait()).await.is_ok();
        // Records never started go back, due now, with no attempt spent. A
        // pass still running past the grace period may have a call on the
        // wire: its record is not given back early (another node would call
        // again while this call may still land); its lease expires.
        let mut held = lock(&i.held);
        if finished {
            return held.drain().map(|(_, l)| l).collect();
        }
        let unstarted: Vec<Lease> = self
            .ready
            .iter()
            .filter_map(|(r, _)| held.remove(&r.id))
            .collect();
        tracing::warn!(
            in_flight = held.len(),
            lease_ms = i.opts.lease.as_millis() as u64,
            "grace period over with calls in flight; their leases will expire"
        );
        held.clear();
        unstarted
    }
}

/// How long to wait after a claim of the records due at `claimed_from`
/// that found nothing to take, given the earliest due time the store
/// knows (`next_due`, none when it cannot say) and the clock now: until
/// that record is due, within `[10ms, max]`. A record due at
/// `claimed_from` is one the claim could not take: its group is at its cap (a lease of
/// the group ending on this node wakes the engine; on another node, this
/// wait bounds how late it is seen) or another node's claim holds it this
/// moment; asking again at once would only spin. One that fell due while
/// the claim ran (a claim behind SQLite's writer takes tens of
/// milliseconds) was not there to take: it waits 10 ms, not that longer
/// wait.
fn idle_wait(
    next_due: Option<UnixMs>,
    claimed_from: UnixMs,
    now: UnixMs,
    max: Duration,
) -> Duration {
    match next_due {
        Some(at) if at <= claimed_from => DUE_BUT_TAKEN.min(max),
        Some(at) => {
            let wait = u64::try_from((at - now).max(10)).unwrap_or(10);
            Duration::from_millis(wait).min(max)
        }
        None => max,
    }
}

/// Whether a loop last seen turning at `last` (since its start) has turned
/// within `limit` of `now`; a limit under three of its turns counts as
/// three (it turns at least every [`PULSE_EVERY`]).
fn turned(now: Duration, last: Duration, limit: Duration) -> bool {
    now.saturating_sub(last) < limit.max(3 * PULSE_EVERY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_stops_turning_is_seen_once_the_limit_passes() {
        let s = Duration::from_secs;
        // Turning: seen within any limit.
        assert!(turned(s(100), s(100), s(10)));
        assert!(turned(s(109), s(100), s(10)));
        // Wedged past the limit: no (systemd then gets no ping).
        assert!(!turned(s(110), s(100), s(10)));
        assert!(!turned(s(500), s(100), s(10)));
        // A limit shorter than three turns waits for three.
        assert!(turned(s(102), s(100), Duration::from_millis(500)));
        assert!(!turned(s(103), s(100), Duration::from_millis(500)));
    }

    const MAX: Duration = Duration::from_secs(2);

    #[test]
    fn after_an_empty_claim_what_falls_due_is_awaited_and_what_was_left_is_not_spun_on() {
        let ms = Duration::from_millis;
        // Due when the claim started, and not taken: the longer wait.
        assert_eq!(idle_wait(Some(990), 1_000, 1_040, MAX), DUE_BUT_TAKEN);
        assert_eq!(idle_wait(Some(1_000), 1_000, 1_040, MAX), DUE_BUT_TAKEN);
        // Fell due while the claim ran (40 ms here): 10 ms, not 200.
        assert_eq!(idle_wait(Some(1_001), 1_000, 1_040, MAX), ms(10));
        assert_eq!(idle_wait(Some(1_039), 1_000, 1_040, MAX), ms(10));
        // Due later: until then, at least 10 ms.
        assert_eq!(idle_wait(Some(1_045), 1_000, 1_040, MAX), ms(10));
        assert_eq!(idle_wait(Some(1_540), 1_000, 1_040, MAX), ms(500));
        // Nothing due (or no answer), or due past the longest wait.
        assert_eq!(idle_wait(None, 1_000, 1_040, MAX), MAX);
        assert_eq!(idle_wait(Some(60_000), 1_000, 1_040, MAX), MAX);
        // A shorter longest wait bounds the others.
        assert_eq!(idle_wait(Some(990), 1_000, 1_040, ms(50)), ms(50));
    }

    proptest::proptest! {
        /// After an empty claim, a record that was not due when the claim
        /// started is asked for again by the later of its due time and 10
        /// ms from now (within the longest wait), never before it is due;
        /// one that was due and not taken is not asked for again sooner
        /// than DUE_BUT_TAKEN (within the longest wait).
        #[test]
        fn an_empty_claim_waits_for_the_next_due_record_and_never_spins(
            claimed_from in 0i64..10_000,
            took in 0i64..300,
            due in proptest::option::of(-300i64..900),
            max_ms in 10u64..5_000,
        ) {
            let (now, max) = (claimed_from + took, Duration::from_millis(max_ms));
            // Around the claim: before it, while it ran, and after.
            let due = due.map(|d| claimed_from + d);
            let wait = idle_wait(due, claimed_from, now, max);
            proptest::prop_assert!(wait <= max);
            let asked_at = now + i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
            match due {
                Some(at) if at > claimed_from => {
                    proptest::prop_assert!(asked_at <= at.max(now + 10));
                    proptest::prop_assert!(asked_at >= at.min(now + max_ms as i64));
                    // Never sooner than 10 ms: a claim at once would find
                    // what fell due meanwhile, or spin on it.
                    proptest::prop_assert!(wait >= Duration::from_millis(10));
                }
                Some(_) => proptest::prop_assert_eq!(wait, DUE_BUT_TAKEN.min(max)),
                None => proptest::prop_assert_eq!(wait, max),
            }
        }
    }
}
