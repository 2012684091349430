//! Provider sync: the providers' shared state between nodes. A background
//! loop on every node heartbeats, sizes its share of the providers' limits
//! by the live nodes, renews the permits it holds and reads the shared
//! pauses and breakers, every `provider_sync` and at once when another
//! node announces a change. What a call taught this node (a breaker that
//! tripped, a probe answered, a "slow down") is published from here too.

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::gate::{BreakerNews, Heard};
use super::limits::ProviderRuntime;
use super::supervisor::Loop;
use super::{Engine, Inner};
use crate::domain::breaker::{SharedBreaker, SharedOp};
use crate::domain::{ProviderState, UnixMs};
use crate::store::NodeBeat;

/// The provider sync loop of one node.
pub struct ProviderSync {
    engine: Engine,
}

impl Loop for ProviderSync {
    /// Aborted at shutdown before the node's permits are released: a sync
    /// (one in progress, or one a notification starts) would ask for slots
    /// again, with headroom, for a node that is leaving.
    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(i.opts.provider_sync) => {}
                () = i.providers_changed.notified() => {}
            }
            self.sync_providers_once().await;
        }
    }
}

impl ProviderSync {
    /// The provider sync of `engine`.
    pub fn of(engine: &Engine) -> ProviderSync {
        ProviderSync {
            engine: engine.clone(),
        }
    }

    /// One round: heartbeat, count the live nodes (grants are sized by
    /// it), give spent grants back and renew the slots held, and read
    /// pauses and breakers.
    pub async fn sync_providers_once(&self) {
        let i = &self.engine.inner;
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
        read_provider_states(i).await;
    }
}

/// Gives back this node's grants and slots of every provider (at
/// shutdown; what fails lapses).
pub(super) async fn release_permits(i: &Inner) {
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

/// Takes every provider's shared state as this node's: operator pauses,
/// "slow down" pauses, and the cluster's breaker.
pub(super) async fn read_provider_states(i: &Inner) {
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

/// Publishes what a call outside a pass heard (a confirmation's).
pub(super) async fn publish_heard(i: &Inner, heard: Heard) {
    if let Some((name, news)) = heard.breaker {
        if let Some(rt) = i.provider(&name) {
            publish_breaker(i, &rt, news).await;
        }
    }
    if let Some((name, until)) = heard.throttled {
        publish_throttle(i, &name, until).await;
    }
}

/// Publishes a provider's "slow down" pause so every node holds its
/// calls until it ends (they read it in their provider sync).
pub(super) async fn publish_throttle(i: &Inner, name: &str, until: UnixMs) {
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

/// Tells the cluster's breaker what a call taught this node (its window
/// tripped, or a probe was answered), and adopts the result; the store
/// announces a change of state to every node.
pub(super) async fn publish_breaker(i: &Inner, rt: &ProviderRuntime, news: BreakerNews) {
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
        // trip leaves this node's breaker open, the others to judge for
        // themselves.
        Err(e) => {
            tracing::warn!(provider.name = %rt.name, error = %e, "could not publish breaker news")
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
