//! The durable engine: workers claim due records with leases, run their
//! ready steps against providers (independent steps in parallel), and
//! commit every attempt and transition. Retries are scheduled in the
//! database, never looped; a lost lease means the result is dropped, not
//! committed twice.
//!
//! The unit of work is [`Engine::execute_next`]: claim a batch, process it,
//! return how many records were handled. [`Engine::run`] repeats it,
//! sleeping until new work is signalled or the earliest record is due.

mod committer;
pub mod http;
pub mod limits;
mod pass;
pub mod stats;
mod step;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::domain::{
    BreakerState, Clock, ProviderState, Record, StepRun, StepState, SystemClock, UnixMs,
};
use crate::pipeline::{Pipeline, Pipelines, Templates};
use crate::store::{
    ClaimRequest, Created, Db, Lease, NewRecord, NodeBeat, StepWrite, Store, StoreError,
};

use limits::ProviderRuntime;

/// How the engine runs on this node.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Appears as `lease_owner` and in events as `node:<id>`.
    pub node_id: String,
    /// Records claimed per round trip.
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
        }
    }
}

/// What became of a webhook delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// Attached to the step waiting on the job.
    Accepted { record_id: i64 },
    /// It contradicted a finished step; the step's reversal policy applied.
    Reversed {
        record_id: i64,
        state: crate::domain::RecordState,
    },
    /// No step knows this job yet; kept, and applied once the job id is committed.
    Unmatched { job_id: String },
    /// The body names no job id where the provider's callback steps look.
    NoJobId,
    /// This delivery id was applied before; nothing changed.
    Duplicate,
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

struct Inner {
    db: Db,
    config: Arc<Config>,
    opts: EngineOptions,
    clock: Arc<dyn Clock>,
    pipelines: Pipelines,
    /// Pinned version id of each current pipeline.
    current: Mutex<HashMap<String, i64>>,
    /// Compiled pipelines by pinned version id.
    pinned: Mutex<HashMap<i64, Compiled>>,
    providers: HashMap<String, Arc<ProviderRuntime>>,
    installation: String,
    started_at: UnixMs,
    wake: Notify,
    /// Leases this node holds, kept alive by the keeper.
    held: Mutex<HashMap<i64, Lease>>,
    slots: Arc<Semaphore>,
    /// Passes done with their calls, committing and following up, bounded
    /// apart from `slots` (as many again): a slow database holds about
    /// twice `max_in_flight` records in memory, plus one claimed batch.
    committing: Semaphore,
    stats: stats::StatsRecorder,
    /// Group commit of finished passes.
    committer: committer::Committer,
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

/// A claim in flight beside the run loop's dispatch.
type ClaimFuture<'a> = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<Vec<(Record, Option<Vec<StepRun>>)>, StoreError>>
            + Send
            + 'a,
    >,
>;

/// A handle on the engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
        let pipelines =
            crate::pipeline::compile(&config).map_err(|e| EngineError::Config(e.to_string()))?;
        let now = clock.now_ms();
        let mut providers = HashMap::new();
        for (name, p) in &config.providers {
            let mut rt = ProviderRuntime::new(name, p, now).map_err(EngineError::Config)?;
            rt.in_process = opts.in_process.clone();
            providers.insert(name.clone(), Arc::new(rt));
        }
        let mut current = HashMap::new();
        let mut pinned = HashMap::new();
        for (name, p) in &pipelines.pipelines {
            let id = db.pin_pipeline(name, &p.hash, &p.definition, now).await?;
            current.insert(name.clone(), id);
            pinned.insert(id, (p.clone(), pipelines.templates.clone()));
        }
        let installation = db.installation_id().await?;
        let slots = Arc::new(Semaphore::new(opts.max_in_flight.max(1)));
        let committing = Semaphore::new(opts.max_in_flight.max(1));
        let opts_node = opts.node_id.clone();
        let committer = committer::Committer::spawn(db.clone());
        Ok(Engine {
            inner: Arc::new(Inner {
                committer,
                db,
                config,
                opts,
                clock,
                pipelines,
                current: Mutex::new(current),
                pinned: Mutex::new(pinned),
                providers,
                installation,
                started_at: now,
                wake: Notify::new(),
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

    pub fn node_id(&self) -> &str {
        &self.inner.opts.node_id
    }

    /// Enqueues a record, idempotent on (pipeline, external key), and wakes
    /// the workers.
    pub async fn enqueue(
        &self,
        pipeline: &str,
        key: Option<&str>,
        input: Value,
    ) -> Result<Created, StoreError> {
        self.enqueue_at(pipeline, key, input, self.inner.clock.now_ms())
            .await
    }

    /// [`enqueue`](Self::enqueue), due at `run_at` instead of now.
    pub async fn enqueue_at(
        &self,
        pipeline: &str,
        key: Option<&str>,
        input: Value,
        run_at: UnixMs,
    ) -> Result<Created, StoreError> {
        let mut created = self
            .create(pipeline, vec![(key.map(str::to_owned), input)], run_at)
            .await?;
        created
            .pop()
            .ok_or_else(|| StoreError::Invalid("nothing enqueued".into()))
    }

    /// Enqueues many records of one pipeline in one transaction (keys make
    /// each idempotent, as for [`enqueue`](Self::enqueue)).
    pub async fn enqueue_many(
        &self,
        pipeline: &str,
        items: Vec<(Option<String>, Value)>,
    ) -> Result<Vec<Created>, StoreError> {
        self.create(pipeline, items, self.inner.clock.now_ms())
            .await
    }

    /// Creates records pinned to the pipeline's current version, due at
    /// `run_at`, and wakes the workers if any is new.
    async fn create(
        &self,
        pipeline: &str,
        items: Vec<(Option<String>, Value)>,
        run_at: UnixMs,
    ) -> Result<Vec<Created>, StoreError> {
        let version = lock(&self.inner.current).get(pipeline).copied();
        let Some(version) = version else {
            return Err(StoreError::Invalid(format!(
                "unknown pipeline `{pipeline}`"
            )));
        };
        let now = self.inner.clock.now_ms();
        let batch = items
            .into_iter()
            .map(|(key, input)| NewRecord {
                pipeline: pipeline.to_owned(),
                pipeline_version: Some(version),
                external_key: key,
                input,
                run_at,
            })
            .collect();
        let created = self.inner.db.create_records(batch, now).await?;
        if created.iter().any(|c| c.created) {
            self.inner.wake.notify_one();
        }
        Ok(created)
    }

    /// The step names of the pipeline a record runs (its pinned version).
    pub async fn steps_of(&self, rec: &Record) -> Vec<String> {
        self.compiled(rec)
            .await
            .map(|c| c.0.steps.iter().map(|s| s.name.clone()).collect())
            .unwrap_or_default()
    }

    /// An operator action on one record, through the transition table and
    /// audited. For a replay, `step` names where to start; the steps
    /// downstream of it come from the record's pinned pipeline.
    pub async fn act(
        &self,
        record_id: i64,
        action: crate::domain::OperatorAction,
        actor: &str,
        reason: Option<String>,
        step: Option<&str>,
    ) -> Result<Record, StoreError> {
        let i = &self.inner;
        let mut steps = Vec::new();
        if action == crate::domain::OperatorAction::ReplayFrom {
            let rec =
                i.db.get_record(record_id)
                    .await?
                    .ok_or(StoreError::NotFound {
                        what: "record",
                        key: record_id.to_string(),
                    })?;
            let Some(step) = step else {
                return Err(StoreError::Invalid(
                    "replay needs a step to start from".into(),
                ));
            };
            let compiled = self.compiled(&rec).await;
            steps = compiled.and_then(|c| c.0.from_step(step)).ok_or_else(|| {
                StoreError::Invalid(format!("pipeline `{}` has no step `{step}`", rec.pipeline))
            })?;
        }
        let req = crate::store::ActionRequest {
            record_id,
            action,
            actor: actor.to_owned(),
            reason,
            now: i.clock.now_ms(),
            steps,
        };
        let after = i.db.act(&req).await?;
        if after.next_run_at.is_some() {
            i.wake.notify_one();
        }
        Ok(after)
    }

    /// What this node sees of a provider right now, for the dashboard.
    pub fn provider_live(&self, name: &str) -> Option<ProviderLive> {
        let rt = self.inner.providers.get(name)?;
        let now = self.inner.clock.now_ms();
        let (in_flight, limits) = rt.limiter().usage(now);
        let (calls, failed, slow) = rt.breaker().window_figures();
        Some(ProviderLive {
            in_flight,
            limits,
            window_calls: calls,
            window_failed: failed,
            window_slow: slow,
        })
    }

    /// Closes a provider's breaker on this node and in the shared state,
    /// audited as `breaker_reset`.
    pub async fn reset_breaker(&self, name: &str, actor: &str) -> Result<(), StoreError> {
        let i = &self.inner;
        let Some(rt) = i.providers.get(name) else {
            return Err(StoreError::NotFound {
                what: "provider",
                key: name.to_owned(),
            });
        };
        let now = i.clock.now_ms();
        rt.breaker().reset(now);
        self.publish_breaker(rt).await;
        i.db.append_event(&crate::store::NewEvent {
            record_id: None,
            at: now,
            kind: "breaker_reset".into(),
            actor: actor.to_owned(),
            audit: true,
            step: None,
            reason: None,
            detail: Some(json!({ "provider": name })),
        })
        .await?;
        self.wake();
        Ok(())
    }

    /// The current compiled pipeline called `name`.
    pub fn pipeline(&self, name: &str) -> Option<Arc<Pipeline>> {
        self.inner.pipelines.pipelines.get(name).cloned()
    }

    /// How `provider`'s webhooks are verified (secrets from the environment).
    pub fn webhook_settings(&self, provider: &str) -> Option<WebhookSettings> {
        let rt = self.inner.providers.get(provider)?;
        let secrets = rt
            .config
            .webhook_secrets_env
            .iter()
            .filter_map(|var| std::env::var(var).ok())
            .chain(
                rt.config
                    .webhook_secrets_inline
                    .iter()
                    .map(|s| s.expose().to_owned()),
            )
            .map(String::into_bytes)
            .collect();
        Some(WebhookSettings {
            signature_header: rt.config.webhook_signature_header.clone(),
            delivery_header: rt.config.webhook_delivery_header.clone(),
            tolerance_s: i64::try_from(rt.config.webhook_tolerance.0.as_secs()).unwrap_or(300),
            secrets,
            credential: rt.config.credential(&|var| std::env::var(var).ok()),
        })
    }

    /// Takes a verified webhook delivery from `provider`: finds the job it
    /// names, stores it, wakes the record, and applies a reversal when it
    /// contradicts a step already succeeded.
    pub async fn deliver(
        &self,
        provider: &str,
        body: Value,
        delivery_id: Option<&str>,
    ) -> Result<Delivery, StoreError> {
        let i = &self.inner;
        let Some(rt) = i.providers.get(provider) else {
            return Err(StoreError::NotFound {
                what: "provider",
                key: provider.to_owned(),
            });
        };
        let job_id = i
            .pipelines
            .pipelines
            .values()
            .flat_map(|p| p.steps.iter())
            .find_map(|s| {
                let cb = s.callback().filter(|_| s.provider == provider)?;
                match body.pointer(&cb.delivery_job_id)? {
                    Value::String(j) => Some(j.clone()),
                    Value::Null => None,
                    other => Some(other.to_string()),
                }
            });
        let Some(job_id) = job_id else {
            return Ok(Delivery::NoJobId);
        };
        let now = i.clock.now_ms();
        let cb = crate::store::NewCallback {
            provider: provider.to_owned(),
            job_id: job_id.clone(),
            body: body.clone(),
            now,
            delivery_id: delivery_id.map(str::to_owned),
        };
        let found = match i.db.record_callback(&cb).await {
            Err(StoreError::Conflict { .. }) if delivery_id.is_some() => {
                return Ok(Delivery::Duplicate);
            }
            other => other?,
        };
        let Some(found) = found else {
            return Ok(Delivery::Unmatched { job_id });
        };
        if matches!(
            found.step_state,
            StepState::Succeeded | StepState::Failed | StepState::Skipped
        ) {
            // The step is settled: this delivery is a duplicate, a stale
            // progress report, or a contradiction.
            let reversed = self
                .judge_late_delivery(
                    rt,
                    found.record_id,
                    &found.step,
                    found.step_state,
                    &job_id,
                    &body,
                    now,
                )
                .await;
            // Judged or not, this row is done: on failure the provider is
            // told to retry (503), and its retry is a new delivery.
            i.db.mark_callbacks(&[found.callback_id], now).await?;
            let reversed = reversed?;
            if let Some(state) = reversed {
                return Ok(Delivery::Reversed {
                    record_id: found.record_id,
                    state,
                });
            }
            return Ok(Delivery::Accepted {
                record_id: found.record_id,
            });
        }
        self.wake();
        Ok(Delivery::Accepted {
            record_id: found.record_id,
        })
    }

    /// A delivery for a settled step: when its outcome contradicts the
    /// step's result, applies the step's reversal policy. Returns the
    /// record's new state when it reversed.
    #[allow(clippy::too_many_arguments)]
    async fn judge_late_delivery(
        &self,
        rt: &ProviderRuntime,
        record_id: i64,
        step_name: &str,
        step_state: StepState,
        job_id: &str,
        body: &Value,
        now: UnixMs,
    ) -> Result<Option<crate::domain::RecordState>, StoreError> {
        let i = &self.inner;
        let reply = crate::domain::rules::Reply::Http {
            status: 200,
            json: Some(body.clone()),
            body_error: None,
        };
        let verdict = crate::domain::rules::classify(&rt.rules, &reply).outcome;
        let contradicts = match step_state {
            StepState::Succeeded => verdict == crate::domain::Outcome::Fail,
            StepState::Failed => verdict == crate::domain::Outcome::Success,
            _ => false,
        };
        if !contradicts {
            return Ok(None);
        }
        let rec = i.db.get_record(record_id).await?;
        let pipeline = match rec {
            Some(r) => self.compiled(&r).await.map(|c| c.0),
            None => None,
        };
        let step = pipeline.as_ref().and_then(|p| p.step(step_name));
        let policy = step.map_or(crate::domain::ReversalPolicy::Park, |s| s.on_reversal);
        let steps = pipeline
            .as_ref()
            .and_then(|p| p.from_step(step_name))
            .unwrap_or_default();
        let req = crate::store::ReverseRequest {
            record_id,
            step: step_name.to_owned(),
            policy,
            reason: format!("provider reversed step `{step_name}` after it was {step_state}"),
            detail: Some(json!({ "job_id": job_id, "callback": body })),
            now,
            steps,
        };
        let after = i.db.reverse(&req).await?;
        self.wake();
        Ok(Some(after.state))
    }

    /// Stops keeping `lease` alive, unless the record was claimed again
    /// since (then the newer lease stays).
    fn forget_lease(&self, lease: &Lease) {
        let mut held = lock(&self.inner.held);
        if held
            .get(&lease.record_id)
            .is_some_and(|l| l.token == lease.token)
        {
            held.remove(&lease.record_id);
        }
    }

    /// After a commit, the deliveries of its callback steps that the pass
    /// could not see: those that arrived while it ran, or before the job id
    /// was committed. Settled steps judge them (a contradiction is a
    /// reversal); waiting steps get their record woken to apply them.
    async fn follow_up_deliveries(
        &self,
        rec: &Record,
        state: crate::domain::RecordState,
        steps: &[StepWrite],
    ) {
        let i = &self.inner;
        let Some((pipeline, _)) = self.compiled(rec).await else {
            return;
        };
        let is_callback = |name: &str| pipeline.step(name).is_some_and(|s| s.callback().is_some());
        let mut settled = Vec::new();
        for w in steps.iter().filter(|w| is_callback(&w.step)) {
            let (Some(provider), Some(job)) = (&w.provider, &w.job_id) else {
                continue;
            };
            if crate::domain::pass::is_done(w.state) {
                settled.push((w.step.clone(), provider.clone(), job.clone(), w.state));
            } else if w.state == StepState::Waiting
                && state == crate::domain::RecordState::Waiting
                && i.db
                    .pending_callbacks(provider, job)
                    .await
                    .is_ok_and(|c| !c.is_empty())
            {
                let _ = i.db.wake_record(rec.id, i.clock.now_ms()).await;
                self.wake();
            }
        }
        if !settled.is_empty() {
            self.reconcile_late_deliveries(rec.id, &settled).await;
        }
    }

    /// After a commit that settled callback steps, judges deliveries that
    /// arrived while the pass ran (they found the step still waiting).
    async fn reconcile_late_deliveries(
        &self,
        record_id: i64,
        settled: &[(String, String, String, StepState)],
    ) {
        let i = &self.inner;
        for (step, provider, job, state) in settled {
            let Some(rt) = i.providers.get(provider) else {
                continue;
            };
            let Ok(pending) = i.db.pending_callbacks(provider, job).await else {
                continue;
            };
            for cb in pending {
                let now = i.clock.now_ms();
                // The record may be held by a worker for a moment (it moved
                // on to its next step): try again a few times.
                let mut judged = false;
                for attempt in 0..10u64 {
                    match self
                        .judge_late_delivery(rt, record_id, step, *state, job, &cb.body, now)
                        .await
                    {
                        Ok(_) => {
                            judged = true;
                            break;
                        }
                        Err(StoreError::Transition(_)) => {
                            tokio::time::sleep(Duration::from_millis(200 * (attempt + 1))).await;
                        }
                        Err(e) => {
                            tracing::warn!(record.id = record_id, error = %e, "late delivery not judged");
                            break;
                        }
                    }
                }
                if !judged {
                    tracing::warn!(
                        record.id = record_id,
                        "late delivery could not be judged; kept unprocessed"
                    );
                    continue;
                }
                let _ = i.db.mark_callbacks(&[cb.id], now).await;
            }
        }
    }

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
        let req = ClaimRequest {
            owner: i.opts.node_id.clone(),
            now: i.clock.now_ms(),
            lease: i.opts.lease,
            limit,
        };
        let started = std::time::Instant::now();
        let claimed = i.db.claim_due(&req).await?;
        tracing::debug!(
            want = limit,
            claimed = claimed.len(),
            took_us = started.elapsed().as_micros() as u64,
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
        let listen = match &i.db {
            Db::Postgres(pg) => {
                let (pg, engine, stop) = (pg.clone(), self.clone(), shutdown.clone());
                Some(tokio::spawn(async move {
                    pg.listen_for_work(|| engine.wake(), stop).await
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
            if claiming.is_none() && waiting.is_none() && ready.len() < batch.div_ceil(2) {
                let want = (batch - ready.len()) as u32;
                claiming = Some(Box::pin(self.claim(want)));
            }
            let busy = !ready.is_empty();
            let until = waiting.unwrap_or_else(tokio::time::Instant::now);
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
                        waiting = Some(tokio::time::Instant::now() + sleep);
                    }
                }
                () = i.wake.notified(), if waiting.is_some() && !busy => waiting = None,
                () = tokio::time::sleep_until(until), if waiting.is_some() => waiting = None,
                // A freed slot: the next pass refills it at the loop's top.
                Ok(_) = i.slots.acquire(), if busy => waiting = None,
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
        if !leases.is_empty() {
            match i.db.release(&leases, i.clock.now_ms()).await {
                Ok(n) => tracing::info!(released = n, "released leases"),
                Err(e) => tracing::warn!(error = %e, "could not release leases; they will expire"),
            }
        }
        keeper.abort();
        sync.abort();
        flusher.abort();
        // The last seconds' figures.
        i.stats.flush(&i.db, i.clock.now_ms()).await;
        if let Some(l) = listen {
            l.abort();
        }
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

    /// Until the earliest due record, within `[10ms, idle_max]`.
    async fn idle_sleep(&self) -> Duration {
        let i = &self.inner;
        let max = i.opts.idle_max;
        match i.db.next_due_at().await {
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

    /// Reads shared provider state (operator pauses, breakers opened by
    /// other nodes) and publishes this node's breaker changes.
    async fn sync_providers(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.inner.opts.provider_sync) => {}
            }
            self.sync_providers_once().await;
        }
    }

    /// One round of [`sync_providers`](Self::sync_providers): heartbeat,
    /// take this node's share of provider limits from the live node count,
    /// and read pauses and breakers.
    pub async fn sync_providers_once(&self) {
        let i = &self.inner;
        let now = i.clock.now_ms();
        let beat = NodeBeat::this_process(&i.opts.node_id, i.started_at);
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
            for rt in i.providers.values() {
                rt.limiter().set_share(1.0 / live as f64);
            }
        }
        let Ok(states) = i.db.provider_states().await else {
            return;
        };
        for s in states {
            if let Some(rt) = i.providers.get(&s.provider) {
                rt.set_paused(s.paused);
                if s.breaker == BreakerState::Open && s.open_until.is_some_and(|u| u > now) {
                    let mut b = rt.breaker();
                    if b.state() == BreakerState::Closed {
                        b.force_open(s.open_until.unwrap_or(now), now);
                    }
                }
            }
        }
    }

    /// Publishes a breaker change so every node and the dashboard see it.
    async fn publish_breaker(&self, rt: &ProviderRuntime) {
        let i = &self.inner;
        let now = i.clock.now_ms();
        let (state, changed, until, figures) = {
            let b = rt.breaker();
            (
                b.state(),
                b.changed_at(),
                b.open_until(),
                b.window_figures(),
            )
        };
        let mut ps = ProviderState::new(&rt.name, now);
        ps.breaker = state;
        ps.breaker_changed_at = changed;
        ps.open_until = until;
        ps.stats = Some(json!({ "calls": figures.0, "failures": figures.1, "slow": figures.2 }));
        ps.updated_at = now;
        if let Err(e) = i.db.save_breaker(&ps).await {
            tracing::warn!(provider.name = %rt.name, error = %e, "could not publish breaker state");
        }
    }

    async fn compiled(&self, rec: &Record) -> Option<Compiled> {
        let i = &self.inner;
        let version = match rec.pipeline_version {
            Some(v) => v,
            None => *lock(&i.current).get(&rec.pipeline)?,
        };
        if let Some(c) = lock(&i.pinned).get(&version).cloned() {
            return Some(c);
        }
        let pv = i.db.pipeline_version(version).await.ok()??;
        let compiled =
            crate::pipeline::compile_pinned(&pv.pipeline, &pv.definition, &i.config).ok()?;
        lock(&i.pinned).insert(version, compiled.clone());
        Some(compiled)
    }
}

/// Pauses or resumes a provider for every node (they see it within one
/// provider-sync round), audited as `provider_paused` / `provider_resumed`.
pub async fn set_provider_paused(
    db: &Db,
    provider: &str,
    paused: bool,
    actor: &str,
    reason: Option<String>,
    now: UnixMs,
) -> Result<ProviderState, StoreError> {
    db.set_provider_pause(provider, paused, actor, reason.as_deref(), now)
        .await
}

/// `now` for callers that have no clock of their own.
pub fn now_ms() -> UnixMs {
    SystemClock.now_ms()
}
