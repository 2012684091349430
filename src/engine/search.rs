//! The search indexer: keeps each record's search document (migration 14)
//! up to date behind the commits, so claims and commits never wait for
//! it. One node at a time (the `search-index` task lease) reads `events`
//! in id order; every record that had an event gets its document made
//! anew and written when it changed, a batch per transaction. Events are
//! read once they are five seconds old (`domain::search::LAG_MS`), so a
//! record that comes and goes within seconds is indexed once: it is
//! searchable by its words about six seconds after it changed.

use std::collections::BTreeSet;

use tokio_util::sync::CancellationToken;

use super::Engine;
use super::supervisor::{Loop, Stop};
use crate::domain::UnixMs;
use crate::domain::search::{self, Progress, SeenEvent};
use crate::store::StoreError;

const LEASE: &str = "search-index";
/// How long the lease lasts; the holder renews it when half is left.
const LEASE_MS: i64 = 60_000;
/// How often an indexer that has caught up looks for new events.
const EVERY_MS: i64 = 1_000;
/// How often a node without the lease asks for it.
const ASK_EVERY_MS: i64 = 15_000;
/// Events read per batch (one transaction of documents).
pub const BATCH_EVENTS: u32 = 2_000;
/// Batches in one turn, at most, and for at most `TURN_MS`: the lease is
/// renewed well inside its term, a shutdown waits for one batch at most.
const TURN_BATCHES: usize = 50;
const TURN_MS: i64 = 2_000;

/// The indexer's state on the node that runs it.
#[derive(Debug, Default)]
pub(super) struct Indexer {
    /// Where reading stands (`None`: not read from the database yet).
    progress: Option<Progress>,
    /// The progress last stored.
    stored: i64,
    /// Until when this node holds the lease (0: it does not).
    held_until: UnixMs,
    /// The new event the indexer waits to be old enough, since when.
    waiting: Option<(i64, UnixMs)>,
}

/// What a turn of the indexer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Indexed {
    /// Documents written.
    pub records: u64,
    /// Whether events remain to be read (the turn ran out of batches).
    pub more: bool,
}

/// The search indexer's loop: keeps the search documents up to date on
/// whichever node holds the indexer's lease; gives the lease back on the
/// way out so another node takes over at once.
pub struct SearchIndexer {
    engine: Engine,
}

impl Loop for SearchIndexer {
    /// It gives its lease back when it sees the shutdown.
    const STOP: Stop = Stop::Finish("the search indexer's batch");

    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        if !i.opts.search_index {
            return;
        }
        loop {
            let now = i.clock.now_ms();
            let wait = match self.index_search_once(now).await {
                Ok(Some(turn)) if turn.more => 0,
                Ok(Some(_)) => EVERY_MS,
                Ok(None) => ASK_EVERY_MS,
                Err(e) => {
                    tracing::warn!(error = %e, "search indexing failed; trying again later");
                    EVERY_MS
                }
            };
            if wait == 0 {
                tokio::task::yield_now().await;
                if shutdown.is_cancelled() {
                    break;
                }
                continue;
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = i.clock.sleep_until(now + wait) => {}
            }
        }
        let mut state = i.search.lock().await;
        if state.held_until > 0 {
            if let Err(e) = i.db.release_task_lease(LEASE, &i.opts.node_id).await {
                tracing::warn!(error = %e, "could not give the search indexer's lease back; it lapses");
            }
            state.held_until = 0;
        }
    }
}

impl SearchIndexer {
    /// Of `records`, those of pipelines with sensitive fields (or that
    /// this node does not run): their documents leave out input and output
    /// values (read only when some pipeline here has such fields).
    async fn bare(&self, records: &[i64]) -> Result<Vec<i64>, StoreError> {
        let config = self.engine.inner.config();
        let sensitive: BTreeSet<&String> = config
            .pipelines
            .keys()
            .filter(|p| !config.sensitive_rules(p).is_empty())
            .collect();
        if sensitive.is_empty() || records.is_empty() {
            return Ok(Vec::new());
        }
        let found = self.engine.inner.db.get_records(records).await?;
        // A pipeline this node does not run has fields it cannot know.
        let bare = |p: &String| sensitive.contains(p) || !config.pipelines.contains_key(p);
        Ok(found
            .into_iter()
            .filter(|r| bare(&r.pipeline))
            .map(|r| r.id)
            .collect())
    }

    /// The search indexer of `engine` (its state is the engine's: one per
    /// node).
    pub fn of(engine: &Engine) -> SearchIndexer {
        SearchIndexer {
            engine: engine.clone(),
        }
    }

    /// One turn of the search indexer at `now`, if this node holds its
    /// lease (or gets it): up to 50 batches of events read and their
    /// records' documents written. `None`: another node holds the lease.
    pub async fn index_search_once(&self, now: UnixMs) -> Result<Option<Indexed>, StoreError> {
        let i = &self.engine.inner;
        let mut state = i.search.lock().await;
        if now >= state.held_until - LEASE_MS / 2 {
            let node = &i.opts.node_id;
            if !i
                .db
                .take_task_lease(LEASE, node, now + LEASE_MS, now)
                .await?
            {
                *state = Indexer::default();
                return Ok(None);
            }
            state.held_until = now + LEASE_MS;
        }
        // Worked on as a copy and kept after each batch that committed: a
        // failed batch is read again, not the ten minutes of events the
        // gaps may hold `settled` back by.
        let mut progress = match state.progress.clone() {
            Some(p) => p,
            None => {
                let settled = i.db.search_progress().await?;
                state.stored = settled;
                Progress::from_settled(settled)
            }
        };
        let mut turn = Indexed::default();
        for batch in 0..TURN_BATCHES {
            let seen = progress.seen();
            // Gaps are looked for once a turn.
            let gaps = if batch == 0 {
                progress.gaps()
            } else {
                Vec::new()
            };
            let events = i.db.search_events(seen, &gaps, BATCH_EVENTS).await?;
            // New events in id order, then those of the gaps (late already).
            let (fresh, late): (Vec<SeenEvent>, Vec<SeenEvent>) =
                events.into_iter().partition(|e| e.id > seen);
            let ready = search::ripe(&fresh, now, &mut state.waiting);
            let events: Vec<SeenEvent> = fresh[..ready].iter().chain(&late).copied().collect();
            progress.observe(&events, now);
            let records: Vec<i64> = events
                .iter()
                .filter_map(|e| e.record)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let settled = progress.settled();
            if !records.is_empty() || settled != state.stored {
                let bare = self.bare(&records).await?;
                turn.records += i.db.index_records(&records, &bare, settled).await?;
                state.stored = settled;
            }
            state.progress = Some(progress.clone());
            turn.more = ready == fresh.len() && ready >= BATCH_EVENTS as usize;
            // A turn ends within TURN_MS, so the lease is renewed in time
            // and a shutdown does not wait on a long catch-up.
            if !turn.more || i.clock.now_ms() - now >= TURN_MS {
                break;
            }
            tokio::task::yield_now().await;
        }
        Ok(Some(turn))
    }
}
