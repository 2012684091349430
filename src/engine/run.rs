//! The run loop: claims due records while slots are free, keeps their
//! leases alive, flushes statistics and syncs shared provider state, and
//! hands back what it holds at shutdown.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::limits::ProviderRuntime;
use super::step::BreakerNews;
use super::{ClaimFuture, Engine, Stopping, lock, stats};
use crate::domain::breaker::{SharedBreaker, SharedOp};
use crate::domain::{ProviderState, Record, StepRun, UnixMs};
use crate::store::{ClaimRequest, Db, Lease, NodeBeat, Notice, StoreError};

/// How stale a SQLite node's view of other processes' provider changes
/// may be when it claims.
const PROVIDERS_READ_EVERY_MS: i64 = 100;

/// How long an idle engine waits before claiming again when work is due
/// that its last claim could not take (see `idle_sleep`).
const DUE_BUT_TAKEN: Duration = Duration::from_millis(200);

/// The most records one claim takes when more slots than a batch are free.
const CLAIM_MAX: usize = 1_000;

/// The longest the dispatch loop waits without turning.
pub const PULSE_EVERY: Duration = Duration::from_secs(1);

impl Engine {
    /// Wakes the loop (new work arrived).
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// Claims one batch and processes it to completion; returns how many
    /// records it handled. Tests drive the engine with this until it is idle.
    pub async fn execute_next(&self) -> Result<usize, StoreError> {
        let claimed = self.claim(self.inner.opts.batch).await?;
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

    /// Claims up to `limit` due records and reads their step runs in one
    /// query (a record whose runs could not be read reads them in its pass).
    async fn claim(&self, limit: u32) -> Result<Vec<(Record, Option<Vec<StepRun>>)>, StoreError> {
        let i = &self.inner;
        // Another process on the same SQLite file cannot notify this one:
        // its pauses and breaker changes are read here, at most every
        // PROVIDERS_READ_EVERY.
        if matches!(i.db, Db::Sqlite(_)) {
            let read_at = i
                .providers_read_at
                .load(std::sync::atomic::Ordering::Relaxed);
            if i.clock.now_ms() - read_at >= PROVIDERS_READ_EVERY_MS {
                self.read_provider_states().await;
            }
        }
        let req = ClaimRequest {
            owner: i.opts.node_id.clone(),
            now: i.clock.now_ms(),
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

    /// Notes that the dispatch loop turned.
    fn beat(&self) {
        let i = &self.inner;
        let at = i.clock.instant().saturating_duration_since(i.born);
        i.pulse.store(
            u64::try_from(at.as_millis()).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
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
        let i = &self.inner;
        let tasks = TaskTracker::new();
        // Know pauses, open breakers and peers before the first claim.
        self.sync_providers_once().await;
        let keeper = tokio::spawn(self.clone().keep_leases(shutdown.clone()));
        let sync = tokio::spawn(self.clone().sync_providers(shutdown.clone()));
        let flusher = tokio::spawn(self.clone().flush_stats(shutdown.clone()));
        let confirms = tokio::spawn(self.clone().confirm_loop(shutdown.clone()));
        let resumer = tokio::spawn(self.clone().resume_loop(shutdown.clone()));
        let scheduler = tokio::spawn(self.clone().schedule_loop(shutdown.clone()));
        let purger = tokio::spawn(self.clone().purge_loop(shutdown.clone()));
        let indexer = tokio::spawn(self.clone().search_loop(shutdown.clone()));
        let listen = match &i.db {
            Db::Postgres(pg) => {
                let (pg, engine, stop) = (pg.clone(), self.clone(), shutdown.clone());
                Some(tokio::spawn(async move {
                    let on = |n| match n {
                        Notice::Work => engine.wake(),
                        Notice::Providers => engine.providers_changed(),
                    };
                    pg.listen(on, stop).await
                }))
            }
            Db::Sqlite(_) => None,
        };
        // Claimed records waiting for a slot. Claims run ahead of the slots
        // by up to one batch, so a freed slot is refilled at once and claims
        // stay large; buffered records are leased (the keeper extends them,
        // shutdown releases them). A claim runs beside the dispatch, not in
        // its way: slots freed while it waits for the database (behind a
        // group commit, on SQLite's one writer) are refilled from the
        // buffer at once.
        let batch = i.opts.batch.max(1) as usize;
        let stopping = Arc::new(Stopping::default());
        let mut ready: VecDeque<(Record, Option<Vec<StepRun>>)> = VecDeque::new();
        let mut claiming: Option<ClaimFuture<'_>> = None;
        // Set after a claim that leaves nothing to start: the next claim
        // waits for a wake-up, a freed slot (a pass started) or this instant.
        let mut waiting: Option<tokio::time::Instant> = None;
        while !shutdown.is_cancelled() {
            self.beat();
            let mut started = false;
            while !ready.is_empty() {
                let Ok(permit) = i.slots.clone().try_acquire_owned() else {
                    break;
                };
                let Some((rec, runs)) = ready.pop_front() else {
                    break;
                };
                // The keeper drops leases it could not extend (a database
                // outage while the record waited): another node may own it.
                if !lock(&i.held).contains_key(&rec.id) {
                    continue;
                }
                let (engine, stopping) = (self.clone(), stopping.clone());
                tasks
                    .spawn(async move { engine.process(rec, runs, &stopping, Some(permit)).await });
                started = true;
            }
            if started {
                waiting = None;
            }
            // A claim takes at least a batch, and as many as there are free
            // slots (up to CLAIM_MAX): with many calls in flight, one round
            // trip refills what finished meanwhile (claiming a fixed batch,
            // a node with a thousand calls in flight waited on its claims).
            let target = batch.max(i.slots.available_permits().min(CLAIM_MAX));
            if claiming.is_none() && waiting.is_none() && ready.len() < target.div_ceil(2) {
                let want = (target - ready.len()) as u32;
                claiming = Some(Box::pin(self.claim(want)));
            }
            let busy = !ready.is_empty();
            let until = waiting.unwrap_or_else(|| i.clock.instant());
            tokio::select! {
                () = shutdown.cancelled() => break,
                claimed = async {
                    match claiming.as_mut() {
                        Some(claim) => claim.await,
                        None => std::future::pending().await,
                    }
                }, if claiming.is_some() => {
                    claiming = None;
                    let mut claimed_any = false;
                    match claimed {
                        Ok(records) => {
                            claimed_any = !records.is_empty();
                            ready.extend(records);
                        }
                        Err(e) => tracing::warn!(error = %e, "claim failed; retrying shortly"),
                    }
                    if !(claimed_any && i.slots.available_permits() > 0) {
                        // With work buffered, a freed slot is the signal: no
                        // need to ask the database when work is due.
                        let sleep = if ready.is_empty() {
                            self.idle_sleep().await
                        } else {
                            i.opts.idle_max
                        };
                        waiting = Some(i.clock.instant() + sleep);
                    }
                }
                () = i.wake.notified(), if waiting.is_some() && !busy => waiting = None,
                () = tokio::time::sleep_until(until), if waiting.is_some() => waiting = None,
                // A freed slot: the next pass refills it at the loop's top.
                Ok(_) = i.slots.acquire(), if busy => waiting = None,
                // The loop turns at least this often, all slots busy or
                // not, so that a loop that stops turning is seen (`beat`).
                () = tokio::time::sleep(PULSE_EVERY) => {}
            }
        }
        // A claim in flight at shutdown is let finish: records it took are
        // given back with the rest, not left leased.
        if let Some(claim) = claiming.take() {
            if let Ok(records) = claim.await {
                ready.extend(records);
            }
        }
        // Calls in flight finish; passes waiting for a slot, the rate limit
        // or their next step start no call and give their records back.
        stopping.stop();
        tasks.close();
        let finished = tokio::time::timeout(grace, tasks.wait()).await.is_ok();
        // Records never started go back, due now, with no attempt spent. A
        // pass still running past the grace period may have a call on the
        // wire: its record is not given back early (another node would call
        // again while this call may still land); its lease expires.
        let leases: Vec<Lease> = {
            let mut held = lock(&i.held);
            if finished {
                held.drain().map(|(_, l)| l).collect()
            } else {
                let unstarted: Vec<Lease> = ready
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
        };
        // No provider sync may run after the release below: a sync (one in
        // progress, or one a notification starts) would ask for slots
        // again, with headroom, for a node that is leaving.
        sync.abort();
        let _ = sync.await;
        // A confirmation poll cut short keeps its hold; another node (or
        // this one, restarted) asks when the hold ends.
        confirms.abort();
        let _ = confirms.await;
        resumer.abort();
        let _ = resumer.await;
        // The scheduler stops by itself between passes: a pass under way
        // finishes (its records and its watermark go together).
        finish_within(scheduler, "the scheduler's pass").await;
        // A purge cut short rolls its batch back; its lease goes back so
        // another node need not wait the lease out.
        purger.abort();
        let _ = purger.await;
        self.release_purge_lease().await;
        // The indexer gives its lease back when it sees the shutdown.
        finish_within(indexer, "the search indexer's batch").await;
        if let Some(l) = listen {
            l.abort();
            let _ = l.await;
        }
        // This node's share of the providers' limits goes back.
        self.release_permits().await;
        if !leases.is_empty() {
            match i.db.release(&leases, i.clock.now_ms()).await {
                Ok(n) => tracing::info!(released = n, "released leases"),
                Err(e) => tracing::warn!(error = %e, "could not release leases; they will expire"),
            }
        }
        keeper.abort();
        flusher.abort();
        // The last seconds' figures.
        i.stats.flush(&i.db, i.clock.now_ms()).await;
        if let Err(e) = i.db.remove_node(&i.opts.node_id).await {
            tracing::warn!(error = %e, "could not deregister the node");
        }
    }

    /// Writes this node's statistics now (tests, shutdown).
    pub async fn flush_stats_now(&self) {
        let i = &self.inner;
        i.stats.flush(&i.db, i.clock.now_ms()).await;
    }

    /// Writes this node's statistics every few seconds (the control plane
    /// purges old ones).
    async fn flush_stats(self, shutdown: CancellationToken) {
        let i = &self.inner;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(stats::FLUSH_EVERY) => {}
            }
            i.stats.flush(&i.db, i.clock.now_ms()).await;
        }
    }

    /// Until the earliest due record, within `[10ms, idle_max]`, after a
    /// claim that found nothing to take. A record already due then is one
    /// the claim could not take: its group is at its cap (a lease of the
    /// group ending on this node wakes the engine; on another node, this
    /// wait bounds how late it is seen) or another node's claim holds it
    /// this moment. Either way asking again at once would only spin.
    async fn idle_sleep(&self) -> Duration {
        let i = &self.inner;
        let max = i.opts.idle_max;
        match i.db.next_due_at().await {
            Ok(Some(at)) if at <= i.clock.now_ms() => DUE_BUT_TAKEN.min(max),
            Ok(Some(at)) => {
                let wait = (at - i.clock.now_ms()).max(10);
                Duration::from_millis(wait as u64).min(max)
            }
            Ok(None) => max,
            Err(_) => max,
        }
    }

    /// Extends every held lease well before it expires; cancels the work of
    /// any lease that was lost.
    async fn keep_leases(self, shutdown: CancellationToken) {
        let i = &self.inner;
        let every = i.opts.lease / 3;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            let leases: Vec<Lease> = lock(&i.held).values().cloned().collect();
            if leases.is_empty() {
                continue;
            }
            let until = i.clock.now_ms() + i.opts.lease.as_millis() as i64;
            match i.db.extend_leases(&leases, until).await {
                Ok(kept) => {
                    for l in leases.iter().filter(|l| !kept.contains(&l.record_id)) {
                        tracing::warn!(
                            record.id = l.record_id,
                            "lease lost; the pass's result will be dropped"
                        );
                        self.forget_lease(l);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "lease extension failed"),
            }
        }
    }

    /// Gives back this node's grants and slots of every provider (at
    /// shutdown; what fails lapses).
    async fn release_permits(&self) {
        let i = &self.inner;
        for rt in i
            .setup()
            .providers
            .values()
            .filter(|rt| !rt.cluster.is_empty())
        {
            let released =
                rt.cluster
                    .release(&i.db, &rt.name, &i.opts.node_id, &*i.clock, &rt.concurrency);
            if let Err(e) = released.await {
                tracing::warn!(provider.name = %rt.name, error = %e, "could not give permits back; they lapse");
            }
        }
    }

    /// Reads shared provider state (operator pauses, throttle pauses,
    /// breakers) every `provider_sync`, and at once when another node
    /// announces a change (PostgreSQL).
    async fn sync_providers(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.inner.opts.provider_sync) => {}
                () = self.inner.providers_changed.notified() => {}
            }
            self.sync_providers_once().await;
        }
    }

    /// One round of [`sync_providers`](Self::sync_providers): heartbeat,
    /// count the live nodes (grants are sized by it), give spent grants
    /// back and renew the slots held, and read pauses and breakers.
    pub async fn sync_providers_once(&self) {
        let i = &self.inner;
        let now = i.clock.now_ms();
        let beat = NodeBeat::this_process(&i.opts.node_id, i.started_at)
            .running(i.setup().version.clone());
        if let Err(e) = i.db.heartbeat(&beat, now).await {
            tracing::warn!(error = %e, "heartbeat failed");
        }
        if let Ok(nodes) = i.db.list_nodes().await {
            // Live: seen within three sync rounds (and never less than 6 s).
            let horizon = (3 * i.opts.provider_sync.as_millis() as i64).max(6_000);
            let live = nodes
                .iter()
                .filter(|n| n.heartbeat_at >= now - horizon && !n.draining)
                .count()
                .max(1);
            for rt in i.setup().providers.values() {
                rt.cluster.set_live_nodes(live);
            }
        }
        // Spent grants go back, the slots held are renewed (or given back
        // when idle).
        for rt in i
            .setup()
            .providers
            .values()
            .filter(|rt| !rt.cluster.is_empty())
        {
            let lease = rt.cluster.lease(
                &i.db,
                &rt.name,
                &i.opts.node_id,
                &*i.clock,
                super::permits::Why::Sync,
                &rt.concurrency,
            );
            if let Err(e) = lease.await {
                tracing::warn!(provider.name = %rt.name, error = %e, "cannot renew provider permits");
            }
        }
        self.read_provider_states().await;
    }

    /// Takes every provider's shared state as this node's: operator pauses,
    /// "slow down" pauses, and the cluster's breaker.
    pub(super) async fn read_provider_states(&self) {
        let i = &self.inner;
        let Ok(states) = i.db.provider_states().await else {
            return;
        };
        let now = i.clock.now_ms();
        i.providers_read_at
            .store(now, std::sync::atomic::Ordering::Relaxed);
        let setup = i.setup();
        for s in states {
            if let Some(rt) = setup.providers.get(&s.provider) {
                rt.set_paused(s.paused);
                // Another node was told to slow down: so is this one.
                if let Some(until) = s.throttled_until.filter(|u| *u > now) {
                    rt.limiter().pause_until(until);
                }
                rt.breaker().adopt(&shared_breaker(&s), now);
            }
        }
    }

    /// Publishes a provider's "slow down" pause so every node holds its
    /// calls until it ends (they read it in their provider sync).
    /// Publishes what a call outside a pass heard (a confirmation's).
    pub(super) async fn publish_heard(&self, heard: super::step::Heard) {
        if let Some((name, news)) = heard.breaker {
            if let Some(rt) = self.inner.provider(&name) {
                self.publish_breaker(&rt, news).await;
            }
        }
        if let Some((name, until)) = heard.throttled {
            self.publish_throttle(&name, until).await;
        }
    }

    pub(super) async fn publish_throttle(&self, name: &str, until: UnixMs) {
        let i = &self.inner;
        let Some(rt) = i.provider(name) else {
            return;
        };
        if !rt.note_throttle(until) {
            return;
        }
        if let Err(e) = i.db.throttle_provider(name, until, i.clock.now_ms()).await {
            tracing::warn!(provider.name = %name, error = %e, "could not publish a throttle pause");
        }
    }

    /// Tells the cluster's breaker what a call taught this node (its
    /// window tripped, or a probe was answered), and adopts the result; the
    /// store announces a change of state to every node.
    pub(super) async fn publish_breaker(&self, rt: &ProviderRuntime, news: BreakerNews) {
        let i = &self.inner;
        let now = i.clock.now_ms();
        let policy = *rt.breaker().policy();
        let (op, stats) = match news {
            BreakerNews::Tripped { until } => {
                let (calls, failures, slow) = rt.breaker().window_figures();
                let stats = json!({ "calls": calls, "failures": failures, "slow": slow });
                (SharedOp::Open { until }, Some(stats))
            }
            BreakerNews::Probed { ok, round } => {
                let op = SharedOp::Probed {
                    ok,
                    probes: policy.probes,
                    open_for: policy.open_for_ms(),
                    round,
                };
                (op, None)
            }
        };
        match i.db.breaker_op(&rt.name, op, stats.as_ref(), now).await {
            Ok((shared, _)) => rt.breaker().adopt(&shared, now),
            // A lost probe verdict lapses and another probe is made; a lost
            // trip leaves this node's breaker open, the others to judge
            // for themselves.
            Err(e) => {
                tracing::warn!(provider.name = %rt.name, error = %e, "could not publish breaker news")
            }
        }
    }

    /// Says a provider's shared state changed (another node's
    /// notification): the provider sync runs at once.
    pub(super) fn providers_changed(&self) {
        self.inner.providers_changed.notify_one();
    }

    /// Stops keeping `lease` alive, unless the record was claimed again
    /// since (then the newer lease stays).
    pub(super) fn forget_lease(&self, lease: &Lease) {
        let mut held = lock(&self.inner.held);
        if held
            .get(&lease.record_id)
            .is_some_and(|l| l.token == lease.token)
        {
            held.remove(&lease.record_id);
        }
    }
}

/// The breaker as a provider's stored state says (the probe counts are the
/// store's business: a node only adopts the state).
fn shared_breaker(s: &ProviderState) -> SharedBreaker {
    SharedBreaker {
        state: s.breaker,
        changed_at: s.breaker_changed_at,
        open_until: s.open_until,
        ..SharedBreaker::closed(s.breaker_changed_at)
    }
}

/// Lets a background task that stops by itself at shutdown finish its
/// step, for at most 5 s; then stops it, saying so.
async fn finish_within(mut task: tokio::task::JoinHandle<()>, what: &str) {
    if tokio::time::timeout(Duration::from_secs(5), &mut task)
        .await
        .is_err()
    {
        tracing::warn!("{what} outlasted 5 s of shutdown; stopped");
        task.abort();
        let _ = task.await;
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
}
