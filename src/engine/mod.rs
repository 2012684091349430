//! The durable engine: workers claim due records with leases, run their
//! ready steps against providers (independent steps in parallel), and
//! commit every attempt and transition. Retries are scheduled in the
//! database, never looped; a lost lease means the result is dropped, not
//! committed twice.
//!
//! The unit of work is [`Engine::execute_next`]: claim a batch, process it,
//! return how many records were handled. [`Engine::run`] repeats it,
//! sleeping until new work is signalled or the earliest record is due.

mod call_metrics;
mod child;
mod committer;
mod confirm;
pub mod datakeys;
mod deliveries;
mod each;
pub use each::uncertain_items_of;
mod enqueue;
pub mod export;
mod gate;
pub mod http;
mod intents;
mod leases;
pub mod limits;
mod listen;
pub mod notify;
mod ops;
mod pass;
mod permits;
mod reconfigure;
pub mod redirect;
mod resume;
pub mod retention;
mod run;
pub mod schedule;
pub mod search;
mod sensitive;
pub mod stats;
mod step;
mod supervisor;
mod sync;
pub mod token;
mod versions;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::domain::{Clock, SystemClock, UnixMs};
use crate::pipeline::{Pipeline, Pipelines, Templates};
use crate::store::{Db, Lease, StoreError};

use limits::ProviderRuntime;

pub use confirm::Confirmations;
pub use deliveries::Delivery;
pub use enqueue::{Enqueue, MAX_GROUP_LEN, check_group, check_priority};
pub use ops::{ActExtra, BulkOutcome, Ops, OpsError, Selection, SignalTaken, uncertain_run};
pub use reconfigure::{Reconfigured, fingerprint};
pub use resume::Resumer;
pub use retention::Purger;
pub use schedule::Scheduler;
pub use search::SearchIndexer;
pub use stats::StatsFlusher;
pub use sync::ProviderSync;
pub use versions::Versions;

/// How the engine runs on this node.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Appears as `lease_owner` and in events as `node:<id>`.
    pub node_id: String,
    /// Records claimed per round trip, at least (as many as there are free
    /// slots, up to 1,000, when that is more).
    pub batch: u32,
    /// Records processed at once on this node.
    pub max_in_flight: usize,
    /// How long a claim holds; the keeper extends it while work runs.
    pub lease: Duration,
    /// The longest the loop sleeps without a signal (other nodes' work).
    pub idle_max: Duration,
    /// How often shared provider state (breakers, pauses) is re-read.
    pub provider_sync: Duration,
    /// Every provider answered in-process instead of over HTTP: for
    /// benchmarks of the engine's own cost.
    pub in_process: Option<http::InProcess>,
    /// Whether this node may keep the search index (one node at a time
    /// does); off only to measure what it costs.
    pub search_index: bool,
}

impl EngineOptions {
    pub fn new(node_id: impl Into<String>) -> Self {
        EngineOptions {
            node_id: node_id.into(),
            batch: 50,
            max_in_flight: 256,
            lease: Duration::from_secs(30),
            idle_max: Duration::from_secs(2),
            provider_sync: Duration::from_secs(2),
            in_process: None,
            search_index: true,
        }
    }
}

/// Why a record's pipeline cannot run on this node.
enum NotHere {
    /// Not configured, and no pinned version names it.
    Unknown,
    /// Its pinned version could not be read now.
    Unread(String),
    /// Its pinned version (the id) needs what this node's configuration
    /// lacks (a provider another node's reload added, or one a restart
    /// dropped): why.
    Mismatch(String, i64),
}

impl NotHere {
    /// Why, in words.
    fn why(self) -> String {
        match self {
            NotHere::Unknown => "its pipeline is not configured".into(),
            NotHere::Unread(why) | NotHere::Mismatch(why, _) => why,
        }
    }
}

/// Errors that stop the engine from starting.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

type Compiled = (Arc<Pipeline>, Arc<Templates>);

/// What the configuration sets up on this node, replaced whole by a reload
/// ([`Engine::reconfigure`]); a pass reads the one current when it looks.
struct Setup {
    config: Arc<Config>,
    /// `config.version()`, said in each heartbeat.
    version: String,
    /// Pipelines that cap their groups (`group_concurrency`): every claim
    /// sends them.
    group_caps: Vec<(String, u32)>,
    /// Pipelines enqueued on a cron schedule.
    schedules: Vec<schedule::Scheduled>,
    pipelines: Pipelines,
    providers: HashMap<String, Arc<ProviderRuntime>>,
}

struct Inner {
    db: Db,
    setup: std::sync::RwLock<Arc<Setup>>,
    /// One reconfiguration at a time.
    reconfiguring: tokio::sync::Mutex<()>,
    opts: EngineOptions,
    clock: Arc<dyn Clock>,
    /// Pinned version id of each current pipeline.
    current: Mutex<HashMap<String, i64>>,
    /// Compiled pipelines by pinned version id.
    pinned: Mutex<HashMap<i64, Compiled>>,
    installation: String,
    started_at: UnixMs,
    wake: Notify,
    /// Another node changed a provider's shared state.
    providers_changed: Notify,
    /// A reload changed the cron schedules.
    schedules_changed: Notify,
    /// When this node last compiled every pinned version (to match a
    /// webhook by an older version's callback step), and whether some did
    /// not compile here; one learning at a time.
    versions_learned: tokio::sync::Mutex<(UnixMs, bool)>,
    /// Pipeline versions this node's configuration cannot run, and when
    /// it first met each.
    mismatched: Mutex<HashMap<i64, UnixMs>>,
    /// When this node last read providers' shared state.
    providers_read_at: std::sync::atomic::AtomicI64,
    /// When the dispatch loop last turned, in ms since `born` (systemd's
    /// watchdog is pinged only while it turns).
    pulse: std::sync::atomic::AtomicU64,
    born: tokio::time::Instant,
    /// Leases this node holds, kept alive by the keeper.
    held: Mutex<HashMap<i64, Lease>>,
    slots: Arc<Semaphore>,
    /// Passes done with their calls, committing and following up, bounded
    /// apart from `slots` (as many again): a slow database holds about
    /// twice `max_in_flight` records in memory, plus one claim's records
    /// (a batch, or the free slots up to 1,000).
    committing: Semaphore,
    stats: stats::StatsRecorder,
    /// Group commit of finished passes.
    committer: committer::Committer,
    /// Intents of `at_most_once` calls, written in groups.
    intents: intents::IntentWriter,
    /// Providers with calls left open, read after each claim (an intent is
    /// written under its node's lease, so one left on a claimed record is
    /// seen), whatever their `at_most_once` says here (it may be off here,
    /// or turned off since): their records' passes read those calls into
    /// the history.
    left_open: Mutex<std::collections::HashSet<String>>,
    /// The search indexer, on the node holding its lease.
    search: tokio::sync::Mutex<search::Indexer>,
}

/// Set when [`Engine::run`] stops claiming: passes already running finish
/// the calls they have in flight but start no new ones. One per `run`;
/// [`Engine::execute_next`] passes one that is never set. Every pass reads
/// the flag (no lock); only a pass that waits listens to the token.
#[derive(Debug, Default)]
pub struct Stopping {
    flag: std::sync::atomic::AtomicBool,
    token: CancellationToken,
}

impl Stopping {
    fn stop(&self) {
        self.flag.store(true, std::sync::atomic::Ordering::Release);
        self.token.cancel();
    }

    /// Whether the node has stopped claiming.
    pub fn is_set(&self) -> bool {
        self.flag.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Resolves once the node stops claiming.
    pub async fn wait(&self) {
        self.token.cancelled().await
    }
}

/// How a provider's webhooks are checked; secrets read from the environment.
pub struct WebhookSettings {
    pub signature_header: String,
    pub delivery_header: String,
    pub tolerance_s: i64,
    pub secrets: Vec<Vec<u8>>,
    /// The provider's API key, scrubbed from delivery bodies like replies.
    pub credential: Option<crate::config::Secret>,
}

/// A provider as one node sees it: limiter use and breaker window.
#[derive(Debug, Clone)]
pub struct ProviderLive {
    /// Paused by an operator, as this node last read it.
    pub paused: bool,
    pub breaker: crate::domain::BreakerState,
    pub in_flight: usize,
    /// (limit, calls it counts now, its count).
    pub limits: Vec<(String, usize, u32)>,
    pub window_calls: usize,
    pub window_failed: usize,
    pub window_slow: usize,
}

impl ProviderLive {
    /// Rate-limit use for people: "12 of 20/1s, 300 of 10000/1day".
    pub fn limit_use(&self) -> String {
        self.limits
            .iter()
            .map(|(limit, used, _)| format!("{used} of {limit}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A handle on the engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Inner {
    /// The configuration's setup as it is now.
    fn setup(&self) -> Arc<Setup> {
        self.setup
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A configured provider's runtime, as it is now.
    fn provider(&self, name: &str) -> Option<Arc<ProviderRuntime>> {
        self.setup().providers.get(name).cloned()
    }

    /// The configuration as it is now.
    fn config(&self) -> Arc<Config> {
        self.setup().config.clone()
    }

    /// The pipeline versions this node runs.
    fn versions(&self) -> versions::Versions<'_> {
        versions::Versions { i: self }
    }
}

impl Engine {
    /// Compiles the configuration's pipelines and providers and pins the
    /// current pipeline definitions.
    pub async fn new(
        db: Db,
        config: Arc<Config>,
        opts: EngineOptions,
    ) -> Result<Engine, EngineError> {
        Self::with_clock(db, config, opts, Arc::new(SystemClock)).await
    }

    pub async fn with_clock(
        db: Db,
        config: Arc<Config>,
        opts: EngineOptions,
        clock: Arc<dyn Clock>,
    ) -> Result<Engine, EngineError> {
        let now = clock.now_ms();
        let mut providers = HashMap::new();
        for (name, p) in &config.providers {
            let mut rt = ProviderRuntime::new(name, p, now).map_err(EngineError::Config)?;
            rt.in_process = opts.in_process.clone();
            providers.insert(name.clone(), Arc::new(rt));
        }
        let (setup, current, pinned) = Setup::pin(&db, config, providers, now).await?;
        let installation = db.installation_id().await?;
        let slots = Arc::new(Semaphore::new(opts.max_in_flight.max(1)));
        let committing = Semaphore::new(opts.max_in_flight.max(1));
        let opts_node = opts.node_id.clone();
        let committer = committer::Committer::spawn(db.clone(), clock.clone());
        let intents = intents::IntentWriter::spawn(db.clone(), clock.clone());
        let left_open = Mutex::new(db.intent_providers().await?.into_iter().collect());
        let born = clock.instant();
        Ok(Engine {
            inner: Arc::new(Inner {
                committer,
                intents,
                left_open,
                search: tokio::sync::Mutex::default(),
                db,
                setup: std::sync::RwLock::new(Arc::new(setup)),
                reconfiguring: tokio::sync::Mutex::new(()),
                opts,
                clock,
                current: Mutex::new(current),
                pinned: Mutex::new(pinned),
                installation,
                started_at: now,
                wake: Notify::new(),
                providers_changed: Notify::new(),
                schedules_changed: Notify::new(),
                versions_learned: tokio::sync::Mutex::new((i64::MIN / 2, false)),
                mismatched: Mutex::default(),
                providers_read_at: std::sync::atomic::AtomicI64::new(i64::MIN / 2),
                pulse: std::sync::atomic::AtomicU64::new(0),
                born,
                held: Mutex::default(),
                slots,
                committing,
                stats: stats::StatsRecorder::new(&opts_node),
            }),
        })
    }

    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    /// Now, by this engine's clock.
    pub fn now_ms(&self) -> UnixMs {
        self.inner.clock.now_ms()
    }

    /// The pipeline versions this node runs.
    pub fn versions(&self) -> versions::Versions<'_> {
        self.inner.versions()
    }

    /// What this node sees of a provider right now, for the dashboard.
    pub fn provider_live(&self, name: &str) -> Option<ProviderLive> {
        let rt = self.inner.provider(name)?;
        let in_flight = rt.limiter().in_flight();
        let limits = rt.cluster.usage();
        let (breaker, (calls, failed, slow)) = {
            let b = rt.breaker();
            (b.state(), b.window_figures())
        };
        Some(ProviderLive {
            paused: rt.is_paused(),
            breaker,
            in_flight,
            limits,
            window_calls: calls,
            window_failed: failed,
            window_slow: slow,
        })
    }
}

impl Setup {
    /// Compiles `config`'s pipelines and pins each one's definition (its
    /// version id: the one it had if unchanged), with the providers'
    /// runtimes made for it: the setup, the version id of each pipeline,
    /// and the compiled pipelines by version id.
    async fn pin(
        db: &Db,
        config: Arc<Config>,
        providers: HashMap<String, Arc<ProviderRuntime>>,
        now: UnixMs,
    ) -> Result<(Setup, HashMap<String, i64>, HashMap<i64, Compiled>), EngineError> {
        let pipelines =
            crate::pipeline::compile(&config).map_err(|e| EngineError::Config(e.to_string()))?;
        let mut current = HashMap::new();
        let mut pinned = HashMap::new();
        for (name, p) in &pipelines.pipelines {
            let id = db.pin_pipeline(name, &p.hash, &p.definition, now).await?;
            current.insert(name.clone(), id);
            pinned.insert(id, (p.clone(), pipelines.templates.clone()));
        }
        let group_caps = config
            .pipelines
            .iter()
            .filter_map(|(name, p)| p.group_concurrency.map(|cap| (name.clone(), cap)))
            .collect();
        let schedules = schedule::scheduled(&config)?;
        let setup = Setup {
            version: config.version(),
            config,
            group_caps,
            schedules,
            pipelines,
            providers,
        };
        Ok((setup, current, pinned))
    }
}
