//! Persistence: the [`Store`] contract, its request types, and [`Db`], the
//! handle the rest of Ballast holds, dispatching to SQLite or PostgreSQL.
//!
//! Handlers and workers never touch `sqlx`; they call these methods. Every
//! state change is written with its event and its counter deltas in one
//! transaction.

mod backend;
mod batch;
mod common;
mod counts;
mod filter;
pub mod migrate;
mod postgres;
mod rows;
mod sql;
mod sqlite;

use std::future::Future;
use std::time::Duration;

use serde_json::Value;

use crate::domain::account::AccountRefusal;
pub use crate::domain::account::UserChange;
use crate::domain::breaker::{ProbeGrant, SharedBreaker, SharedOp};
use crate::domain::login::LoginFailures;
use crate::domain::{
    ApiToken, Attempt, Event, Node, OperatorAction, Outcome, PipelineVersion, ProviderState,
    Record, RecordState, Role, ScheduleRow, Session, StateCount, StepCount, StepRun, StepState,
    StepVersion, TransitionError, UnixMs, User, WorkResult,
};

pub use postgres::{Notice, PgStore};
pub use sqlite::{SqliteStore, create_private, partial_beside, place_new};

/// Why a store call failed. Each variant has a stable [`code`](Self::code).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{what} `{key}` not found")]
    NotFound { what: &'static str, key: String },
    #[error("{what} `{key}` already exists")]
    Conflict { what: &'static str, key: String },
    #[error(transparent)]
    Transition(#[from] TransitionError),
    /// The worker's lease was taken over (expired and reclaimed) or released;
    /// its write is refused so that no work is committed twice.
    #[error("lease on record {record_id} is no longer held by this worker")]
    LeaseLost { record_id: i64 },
    #[error("invalid request: {0}")]
    Invalid(String),
    /// An account change that would leave no enabled admin.
    #[error(transparent)]
    Refused(#[from] AccountRefusal),
    /// A stored value the code does not understand (a newer binary wrote it,
    /// or someone edited the database by hand).
    #[error("unreadable stored value: {0}")]
    Corrupt(String),
    /// What is asked for cannot be done here now (another node may, or
    /// this one later): ask again.
    #[error("not now: {0}")]
    NotNow(String),
    #[error("database error: {0}")]
    Database(sqlx::Error),
    #[error("migration error: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The database was migrated by a newer binary.
    #[error(
        "the database has schema version {version}, newer than this binary knows ({known}): \
         run the newer ballast that migrated it, or restore a backup taken before that upgrade"
    )]
    NewerSchema { version: i64, known: i64 },
}

impl From<sqlx::Error> for StoreError {
    /// Text the database cannot hold (PostgreSQL refuses NUL characters in
    /// text and JSON: SQLSTATE 22P05, 22021) is the request's fault: it
    /// becomes `Invalid`, a 4xx at the API, not an internal error.
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(d) = &e {
            if matches!(d.code().as_deref(), Some("22P05" | "22021")) {
                return StoreError::Invalid(format!(
                    "text the database cannot store: {}",
                    d.message()
                ));
            }
        }
        StoreError::Database(e)
    }
}

impl StoreError {
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::NotFound { .. } => "not_found",
            StoreError::Conflict { .. } => "conflict",
            StoreError::Transition(e) => e.code(),
            StoreError::LeaseLost { .. } => "lease_lost",
            StoreError::Invalid(_) => "invalid_request",
            StoreError::Refused(r) => r.code(),
            StoreError::Corrupt(_) => "corrupt_row",
            StoreError::NotNow(_) => "not_now",
            StoreError::Database(_) => "database_error",
            StoreError::Migrate(_) => "migration_error",
            StoreError::NewerSchema { .. } => "schema_too_new",
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// A schedule's watermark moved from what a node read to what it dealt
/// with ([`Store::advance_schedule`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleAdvance {
    pub pipeline: String,
    pub cron: String,
    /// The watermark read (none: no row yet).
    pub from: Option<UnixMs>,
    pub to: UnixMs,
    /// The last tick fired in this pass, and its record.
    pub fired: Option<(UnixMs, i64)>,
    pub now: UnixMs,
}

/// What retention removed from one pipeline, or would (a dry run).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Purged {
    pub records: i64,
    /// Their attempts (gone with them).
    pub attempts: i64,
    /// Their own events (transitions, workers' notes); audit entries stay.
    pub events: i64,
    /// Records by the state they finished in.
    pub by_state: std::collections::BTreeMap<String, i64>,
    /// Attempts of records kept whose excerpt and request were blanked.
    pub stripped: i64,
}

impl Purged {
    pub fn add(&mut self, other: &Purged) {
        self.records += other.records;
        self.attempts += other.attempts;
        self.events += other.events;
        self.stripped += other.stripped;
        for (state, n) in &other.by_state {
            *self.by_state.entry(state.clone()).or_default() += n;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.records == 0 && self.stripped == 0
    }

    /// Several pipelines' figures added up.
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a Purged>) -> Purged {
        let mut total = Purged::default();
        for p in all {
            total.add(p);
        }
        total
    }
}

/// A purge run as its audit entry says it: written (then updated) in the
/// transaction of each batch, so the entry counts exactly what went, even
/// of a run cut short.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PurgeRun {
    /// The run's audit entry, once its first batch removed something.
    pub event: Option<i64>,
    pub actor: String,
    pub at: UnixMs,
    /// What the run removed so far, by pipeline.
    pub report: std::collections::BTreeMap<String, Purged>,
}

impl PurgeRun {
    /// Adds a batch of `pipeline`, written as `event`.
    pub fn record(&mut self, pipeline: &str, batch: &Purged, event: Option<i64>) {
        if batch.is_empty() {
            return;
        }
        self.report
            .entry(pipeline.to_owned())
            .or_default()
            .add(batch);
        self.event = event.or(self.event);
    }

    /// The run's total over every pipeline.
    pub fn total(&self) -> Purged {
        Purged::sum(self.report.values())
    }
}

/// A record to enqueue.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRecord {
    pub pipeline: String,
    pub pipeline_version: Option<i64>,
    /// Idempotency key of the enqueue: a second create with the same
    /// (pipeline, external_key) returns the first record.
    pub external_key: Option<String>,
    /// Its group (a tenant, say), or none: the queue it is claimed from
    /// is (pipeline, group).
    pub group: Option<String>,
    pub input: Value,
    /// When the record becomes due.
    pub run_at: UnixMs,
}

/// The answer to an enqueue.
#[derive(Debug, Clone, PartialEq)]
pub struct Created {
    pub record: Record,
    /// False when the external key already existed.
    pub created: bool,
}

/// Filters for the records list. Newest first, keyset-paginated on `id`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordFilter {
    pub pipeline: Option<String>,
    pub state: Option<RecordState>,
    pub provider: Option<String>,
    pub step: Option<String>,
    pub error_code: Option<String>,
    /// Prefix of the external key.
    pub key_prefix: Option<String>,
    /// Parked records by their resume condition (`Never`: parked with
    /// none, waiting for a human).
    pub until: Option<crate::domain::park::UntilKind>,
    /// Created in this span (`created_at`).
    pub created: TimeRange,
    /// Last changed in this span (`updated_at`).
    pub updated: TimeRange,
    /// Only records with an id below this (the previous page's `next`).
    pub before: Option<i64>,
    pub limit: u32,
}

/// A span of time: from `from` (inclusive) to `to` (exclusive), either
/// end open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeRange {
    pub from: Option<UnixMs>,
    pub to: Option<UnixMs>,
}

impl TimeRange {
    pub fn is_set(&self) -> bool {
        self.from.is_some() || self.to.is_some()
    }
}

/// Filters for the audit log (operator actions only).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuditFilter {
    pub actor: Option<String>,
    pub kind: Option<String>,
    pub before: Option<i64>,
    pub limit: u32,
}

/// One page of a keyset-paginated list.
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Pass as `before` to get the next page; `None` on the last page. A
    /// records page with several filters may hold fewer items than asked
    /// and still have a `next`: the search stopped at its budget there.
    pub next: Option<i64>,
}

/// Refuses free text holding a NUL character, alike on both backends
/// (PostgreSQL cannot store it in text; SQLite could, and would then
/// disagree).
pub(crate) fn refuse_nul(what: &str, text: Option<&str>) -> StoreResult<()> {
    if text.is_some_and(|t| t.contains('\0')) {
        return Err(StoreError::Invalid(format!(
            "a NUL character (\\u0000) in the {what}"
        )));
    }
    Ok(())
}

/// The most records one batch enqueue takes.
pub const MAX_BATCH: usize = 1000;

/// The largest page any list returns.
pub const MAX_PAGE: u32 = 500;

/// How many ids one records-list call searches at most when its filters
/// have no common index; the page then ends early with a `next` cursor.
/// (At 100,000 a filter matching nothing took 35 ms at the median and up
/// to 60 ms on a busy two-core machine, E: over the pages' 50 ms.)
pub const LIST_SCAN_IDS: i64 = 50_000;
/// The id window searched per query within that budget.
pub const LIST_WINDOW_IDS: i64 = 25_000;

/// Ask for up to `limit` due records, leased to `owner` for `lease`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimRequest {
    pub owner: String,
    pub now: UnixMs,
    pub lease: Duration,
    pub limit: u32,
    /// Pipelines whose groups are capped: at most this many records of one
    /// (pipeline, group) queue leased at once, across every node.
    pub group_caps: Vec<(String, u32)>,
}

/// Records a claim leased, in hand-out order (round robin over their
/// queues, each queue's in due order), and the state each was taken from.
pub(crate) type Claimed = (Vec<Record>, std::collections::HashMap<i64, String>);

/// Proof that a worker holds a record: its writes are refused without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub record_id: i64,
    pub owner: String,
    pub token: i64,
}

impl Record {
    /// The lease this record carries, if it is running.
    pub fn lease(&self) -> Option<Lease> {
        self.lease_owner.as_ref().map(|owner| Lease {
            record_id: self.id,
            owner: owner.clone(),
            token: self.lease_token,
        })
    }
}

pub use crate::domain::StepWrite;

/// One attempt to append to the failure history.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAttempt {
    pub step: String,
    pub provider: Option<String>,
    pub attempt_no: i32,
    pub node: Option<String>,
    pub started_at: UnixMs,
    pub duration_ms: i64,
    pub http_status: Option<i32>,
    pub outcome: Outcome,
    pub error_code: Option<String>,
    pub excerpt: Option<String>,
    /// What was sent, credentials removed; `None` for a webhook delivery.
    pub request: Option<crate::domain::request::SentRequest>,
}

/// A side-effecting call to write down before it leaves (`at_most_once`),
/// by the worker holding `lease`: written only while it still holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct NewIntent {
    pub lease: Lease,
    pub record_id: i64,
    pub step: String,
    pub provider: Option<String>,
    pub attempt_no: i32,
    pub node: Option<String>,
    pub sent_at: UnixMs,
    pub request: Option<crate::domain::request::SentRequest>,
}

/// What a worker writes about a record it holds, in one transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    pub lease: Lease,
    pub now: UnixMs,
    /// `None` is a checkpoint: steps and attempts are saved (a provider job
    /// id before its first poll, say) and the worker keeps the lease.
    pub result: Option<WorkResult>,
    /// When the record is due again, for results that keep it scheduled;
    /// `now` when not given.
    pub next_run_at: Option<UnixMs>,
    pub step: Option<String>,
    pub provider: Option<String>,
    pub error_code: Option<String>,
    pub reason: Option<String>,
    pub steps: Vec<StepWrite>,
    pub attempts: Vec<NewAttempt>,
    /// Webhook deliveries this pass applied, marked processed with it.
    pub callbacks_done: Vec<i64>,
    /// Confirmations to schedule for steps that succeeded (`confirm`).
    pub confirms: Vec<crate::domain::confirm::Pending>,
    /// For a `Parked` result: when the record resumes by itself.
    pub park_until: Option<crate::domain::park::ParkUntil>,
    /// Intents this pass's attempts complete (or found open and judged),
    /// deleted with them.
    pub intents_done: Vec<i64>,
}

impl Commit {
    /// A commit with nothing but the result.
    pub fn new(lease: Lease, now: UnixMs, result: Option<WorkResult>) -> Self {
        Commit {
            lease,
            now,
            result,
            next_run_at: None,
            step: None,
            provider: None,
            error_code: None,
            reason: None,
            steps: Vec::new(),
            attempts: Vec::new(),
            callbacks_done: Vec::new(),
            confirms: Vec::new(),
            park_until: None,
            intents_done: Vec::new(),
        }
    }
}

/// A webhook delivery for a `callback` step.
#[derive(Debug, Clone, PartialEq)]
pub struct NewCallback {
    pub provider: String,
    pub job_id: String,
    pub body: Value,
    pub now: UnixMs,
    /// The ids naming this delivery (the provider's delivery id, the
    /// signature's replay key), taken in the same transaction as the
    /// delivery is stored: a second delivery with any of them is
    /// `Conflict`.
    pub delivery_ids: Vec<String>,
}

/// A stored delivery not yet applied to its step.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingCallback {
    pub id: i64,
    pub body: Value,
    pub received_at: UnixMs,
}

/// The step a delivery belongs to, as it stood when the delivery arrived.
#[derive(Debug, Clone, PartialEq)]
pub struct CallbackMatch {
    /// The stored delivery.
    pub callback_id: i64,
    pub record_id: i64,
    pub step: String,
    pub step_state: StepState,
    pub record_state: RecordState,
}

/// A provider contradicted a result already handled.
#[derive(Debug, Clone, PartialEq)]
pub struct ReverseRequest {
    pub record_id: i64,
    pub step: String,
    pub policy: crate::domain::ReversalPolicy,
    pub reason: String,
    pub detail: Option<Value>,
    pub now: UnixMs,
    /// For `Rerun`: the reversed step and every step downstream of it.
    pub steps: Vec<String>,
    /// The generation whose result was contradicted, when known (a
    /// confirmation poll): a reversal of a generation since replaced, or
    /// of a step no longer succeeded, changes nothing.
    pub generation: Option<i32>,
}

/// An operator's action on one record.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionRequest {
    pub record_id: i64,
    pub action: OperatorAction,
    pub actor: String,
    pub reason: Option<String>,
    pub now: UnixMs,
    /// For `ReplayFrom`: the chosen step followed by every step downstream of
    /// it (the caller knows the pipeline graph). Ignored otherwise.
    pub steps: Vec<String>,
    /// For `Park`: when the record resumes by itself (`None`: a human
    /// decides). Refused with any other action.
    pub until: Option<crate::domain::park::ParkUntil>,
    /// For `TookEffect`: what the call of the step named in `steps` did,
    /// as the operator found it at the provider.
    pub took: Option<Took>,
    /// For `Retry` and `ReplayFrom`: the record's input from now on (the
    /// audit entry keeps the old and the new). Refused with any other
    /// action.
    pub input: Option<InputEdit>,
    /// For `ReplayFrom`: the pipeline version the record runs on from now
    /// (an operator replaying it on the current one; the audit entry keeps
    /// the old and the new); `None` keeps its own. Refused with any other
    /// action.
    pub repin: Option<i64>,
}

/// A record's input replaced by an operator's retry or replay.
#[derive(Debug, Clone, PartialEq)]
pub struct InputEdit {
    pub new: serde_json::Value,
    /// The input the operator saw and edited: refused when the record's
    /// is no longer that (someone else changed it meanwhile). `None`: no
    /// check (the API, which names the new input outright).
    pub was: Option<serde_json::Value>,
}

/// What a call whose outcome was not known did, as an operator found it at
/// the provider (`TookEffect`).
#[derive(Debug, Clone, PartialEq)]
pub enum Took {
    /// A job step's submit made this job: the step follows it.
    Job(String),
    /// A request step's call took effect: the step succeeds with these
    /// outputs (an object of the step's output names), its confirmation
    /// scheduled if it has one.
    Output {
        output: serde_json::Value,
        confirm: Option<crate::domain::confirm::Pending>,
    },
}

/// Parked records whose condition holds, to resume (as the system).
#[derive(Debug, Clone, PartialEq)]
pub struct ResumeDue {
    pub now: UnixMs,
    /// At most this many records parked until a time.
    pub limit: u32,
    /// Providers taking calls again, each with how many of the records
    /// waiting for it may resume now.
    pub providers: Vec<(String, u32)>,
}

/// An event that is not a record transition (provider paused, user added…).
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub record_id: Option<i64>,
    pub at: UnixMs,
    pub kind: String,
    pub actor: String,
    pub audit: bool,
    pub step: Option<String>,
    pub reason: Option<String>,
    pub detail: Option<Value>,
}

/// A user to create; the password is already hashed.
#[derive(Clone, PartialEq)]
pub struct NewUser {
    pub username: String,
    pub password_hash: String,
    pub role: Role,
}

/// A node's heartbeat.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeBeat {
    pub id: String,
    pub hostname: String,
    pub pid: i64,
    pub version: String,
    pub started_at: UnixMs,
    pub draining: bool,
    /// The configuration it runs (`Config::version`).
    pub config_version: Option<String>,
}

impl NodeBeat {
    /// This process, as node `id`, running since `started_at`.
    pub fn this_process(id: &str, started_at: UnixMs) -> NodeBeat {
        NodeBeat {
            id: id.to_owned(),
            hostname: crate::domain::host::hostname(),
            pid: i64::from(std::process::id()),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at,
            draining: false,
            config_version: None,
        }
    }

    /// The same beat, saying which configuration the node runs.
    pub fn running(mut self, config_version: String) -> NodeBeat {
        self.config_version = Some(config_version);
        self
    }
}

/// An API token to store; the caller made the token and hashed it.
#[derive(Clone, PartialEq)]
pub struct NewApiToken {
    pub name: String,
    /// Hex SHA-256 of the token.
    pub token_hash: String,
    pub prefix: String,
    pub role: Role,
    pub created_by: String,
    /// When it stops working, if ever.
    pub expires_at: Option<UnixMs>,
}

/// An hour in unix ms.
pub const HOUR_MS: i64 = 3_600_000;

/// One node's step statistics for one minute. Nodes write only their own
/// rows, so writers never contend; the overview sums over nodes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepRollup {
    /// Start of the minute, unix ms.
    pub minute: UnixMs,
    pub node: String,
    pub pipeline: String,
    pub step: String,
    pub provider: String,
    /// Attempts (HTTP exchanges) made.
    pub calls: i64,
    /// Attempts by outcome.
    pub succeeded: i64,
    pub failed: i64,
    pub retried: i64,
    pub unknown: i64,
    /// Records that finished at this step in this minute, by result.
    pub records_succeeded: i64,
    pub records_failed: i64,
    pub records_parked: i64,
    /// Attempt counts per latency bucket (`engine::stats::LATENCY_BUCKETS_MS`).
    pub latency: Vec<i64>,
    /// Step runs (all the attempts and polls of one step of one record)
    /// that ended in this minute, by result; those that parked their
    /// record are `records_parked`.
    pub runs_succeeded: i64,
    pub runs_failed: i64,
    /// Ended step runs per duration bucket (`engine::stats::RUN_BUCKETS_MS`),
    /// from the run's first call to its end; parked runs included.
    pub run_latency: Vec<i64>,
}

impl StepRollup {
    /// Adds `other`'s figures to this row's (its key is left as it is).
    pub fn add(&mut self, other: &StepRollup) {
        self.calls += other.calls;
        self.succeeded += other.succeeded;
        self.failed += other.failed;
        self.retried += other.retried;
        self.unknown += other.unknown;
        self.records_succeeded += other.records_succeeded;
        self.records_failed += other.records_failed;
        self.records_parked += other.records_parked;
        add_counts(&mut self.latency, &other.latency);
        self.runs_succeeded += other.runs_succeeded;
        self.runs_failed += other.runs_failed;
        add_counts(&mut self.run_latency, &other.run_latency);
    }
}

/// Adds histogram `from` into `into`, bucket by bucket (growing `into`).
pub fn add_counts(into: &mut Vec<i64>, from: &[i64]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a += b;
    }
}

/// The storage contract, implemented by [`SqliteStore`] and [`PgStore`] and
/// checked by one conformance suite against both.
pub trait Store: Clone + Send + Sync + 'static {
    /// A cheap round trip, for readiness checks.
    fn ping(&self) -> impl Future<Output = StoreResult<()>> + Send;
    /// This installation's id (made by the first migration), part of every
    /// idempotency key.
    fn installation_id(&self) -> impl Future<Output = StoreResult<String>> + Send;

    // --- records -------------------------------------------------------
    fn create_record(
        &self,
        new: NewRecord,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<Created>> + Send;
    /// Enqueues many records in one transaction (one commit, one wake-up):
    /// the same per record as [`create_record`](Self::create_record), in
    /// order; at most [`MAX_BATCH`].
    fn create_records(
        &self,
        batch: Vec<NewRecord>,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<Vec<Created>>> + Send;
    fn get_record(&self, id: i64) -> impl Future<Output = StoreResult<Option<Record>>> + Send;
    /// What a record's page shows has changed when this has: the record's
    /// row (`updated_at`, `next_run_at`) and its newest attempt, event and
    /// intent (a confirmation poll, a reversal keeping the state, a call
    /// written down before it leaves touch no `updated_at`). One statement
    /// of indexed probes, for a page watching the record; `None` when there
    /// is no such record.
    fn record_version(&self, id: i64)
    -> impl Future<Output = StoreResult<Option<[i64; 5]>>> + Send;
    /// The records `q` names exactly: by id, by external key (any
    /// pipeline), or by a provider's job id (`providers`: whose jobs to
    /// look in), each an indexed probe; at most 50, newest first.
    fn find_records(
        &self,
        q: &str,
        providers: &[String],
    ) -> impl Future<Output = StoreResult<Vec<Record>>> + Send;
    /// Records holding every word of `q` (see `domain::search`), newest
    /// first, at most `limit`: as far as the search indexer has come.
    fn search_records(
        &self,
        q: &str,
        limit: u32,
    ) -> impl Future<Output = StoreResult<Vec<Record>>> + Send;
    fn list_records(
        &self,
        filter: &RecordFilter,
    ) -> impl Future<Output = StoreResult<Page<Record>>> + Send;
    /// Records per (pipeline, state) from the maintained counters; cheap at
    /// any table size.
    fn state_counts(&self) -> impl Future<Output = StoreResult<Vec<StateCount>>> + Send;
    /// The same figures by scanning the records table. For repair and tests
    /// only: slow on big tables.
    fn recount_states(&self) -> impl Future<Output = StoreResult<Vec<StateCount>>> + Send;
    /// Records per (provider of their current step, state), from maintained
    /// counters; `StateCount::pipeline` holds the provider name.
    fn provider_counts(&self) -> impl Future<Output = StoreResult<Vec<StateCount>>> + Send;
    /// The same by scanning; for repair and tests only.
    fn recount_providers(&self) -> impl Future<Output = StoreResult<Vec<StateCount>>> + Send;
    /// Records per (pipeline, step they are at, state), from maintained
    /// counters, non-zero ones only.
    fn step_counts(&self) -> impl Future<Output = StoreResult<Vec<StepCount>>> + Send;
    /// The same by scanning; for repair and tests only.
    fn recount_steps(&self) -> impl Future<Output = StoreResult<Vec<StepCount>>> + Send;

    // --- work ----------------------------------------------------------
    /// The earliest `next_run_at` of any record (due work or a lease
    /// expiry), so workers can sleep exactly until then.
    fn next_due_at(&self) -> impl Future<Output = StoreResult<Option<UnixMs>>> + Send;
    /// For each of `pipelines` with work due at `now` (waiting for a
    /// worker, or a lease run out), when its oldest due record fell due: a
    /// backlog's age, for alerts.
    fn oldest_due(
        &self,
        pipelines: &[String],
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<Vec<(String, UnixMs)>>> + Send;
    /// Leases up to `limit` due records (and records whose lease expired),
    /// an even share from each (pipeline, group) queue with due work, each
    /// queue's oldest due first, within the request's group caps. Two
    /// claimers never get the same record.
    fn claim_due(
        &self,
        req: &ClaimRequest,
    ) -> impl Future<Output = StoreResult<Vec<Record>>> + Send;
    /// Pushes the expiry of held leases to `until`; returns the ids still held.
    fn extend_leases(
        &self,
        leases: &[Lease],
        until: UnixMs,
    ) -> impl Future<Output = StoreResult<Vec<i64>>> + Send;
    /// Gives leases back (graceful shutdown): due now, no attempt spent.
    /// Returns how many were still held.
    fn release(
        &self,
        leases: &[Lease],
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<u64>> + Send;
    /// Writes a worker's pass: steps, attempts, and the transition with its
    /// event. Refused with `LeaseLost` when the lease is not held.
    fn commit(&self, commit: &Commit) -> impl Future<Output = StoreResult<Record>> + Send;
    /// Group commit: many workers' passes in one transaction, their rows
    /// written by multi-row statements. Each commit gets its own result (a
    /// lost lease refuses that one commit, not the group); an error of the
    /// whole group (the database) comes back as `Err`, nothing written. The
    /// commits must name distinct records.
    fn commit_many(
        &self,
        commits: &[Commit],
    ) -> impl Future<Output = StoreResult<Vec<StoreResult<Record>>>> + Send;
    /// An operator action through the transition table, audited.
    fn act(&self, req: &ActionRequest) -> impl Future<Output = StoreResult<Record>> + Send;
    /// Resumes parked records whose condition holds: a time come, or a
    /// provider named in `req.providers` (lowest id first, up to its
    /// count). Each is audited as a `resume` by `system` naming the
    /// condition. A record acted on meanwhile (no longer parked, or parked
    /// on another condition) is left alone. Returns those resumed.
    fn resume_parked(
        &self,
        req: &ResumeDue,
    ) -> impl Future<Output = StoreResult<Vec<Record>>> + Send;

    // --- callbacks -----------------------------------------------------
    /// Stores a delivery (and takes its delivery id: a repeated id is
    /// `Conflict`, nothing stored), attaches it to the step waiting on that
    /// job (if any) and makes a waiting record due now. Deliveries that arrive
    /// before the job id is committed are kept and found later by job id.
    fn record_callback(
        &self,
        cb: &NewCallback,
    ) -> impl Future<Output = StoreResult<Option<CallbackMatch>>> + Send;
    /// Makes a waiting record due now (a delivery arrived for it).
    fn wake_record(
        &self,
        record_id: i64,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// Marks deliveries applied (or judged irrelevant) without a commit.
    fn mark_callbacks(
        &self,
        ids: &[i64],
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// Deliveries for a job not yet applied, oldest first.
    fn pending_callbacks(
        &self,
        provider: &str,
        job_id: &str,
    ) -> impl Future<Output = StoreResult<Vec<PendingCallback>>> + Send;
    /// Applies a provider's reversal through the transition table, audited
    /// as a `reversed` event.
    fn reverse(&self, req: &ReverseRequest) -> impl Future<Output = StoreResult<Record>> + Send;

    // --- intents (`at_most_once`) ----------------------------------------
    /// Writes calls down before they leave, in one transaction (one
    /// durable commit for the batch), each only while its worker still
    /// holds the record's lease (its row locked against a claim meanwhile);
    /// per intent, its id, or `LeaseLost` (then the call must not be made).
    fn record_intents(
        &self,
        intents: &[NewIntent],
    ) -> impl Future<Output = StoreResult<Vec<StoreResult<i64>>>> + Send;
    /// The intents of a record still open, oldest first.
    fn open_intents(
        &self,
        record_id: i64,
    ) -> impl Future<Output = StoreResult<Vec<crate::domain::Intent>>> + Send;
    /// The providers with intents still open (calls left by stopped
    /// nodes), whatever their configuration says now.
    fn intent_providers(&self) -> impl Future<Output = StoreResult<Vec<String>>> + Send;

    // --- history -------------------------------------------------------
    /// Appends attempts outside any lease: the history of exchanges made by
    /// a worker that lost its lease before committing; deletes the intents
    /// of those calls (`intents_done`) in the same transaction.
    fn append_attempts(
        &self,
        record_id: i64,
        attempts: &[NewAttempt],
        intents_done: &[i64],
    ) -> impl Future<Output = StoreResult<()>> + Send;
    fn step_runs(&self, record_id: i64) -> impl Future<Output = StoreResult<Vec<StepRun>>> + Send;
    /// The step runs of many records in one query (a claimed batch).
    fn step_runs_of(
        &self,
        record_ids: &[i64],
    ) -> impl Future<Output = StoreResult<Vec<StepRun>>> + Send;
    /// Takes up to `limit` confirmations due at `now`, each held (its
    /// `due_at` moved to `hold_until`) so that no other node asks too.
    fn claim_confirmations(
        &self,
        now: UnixMs,
        limit: u32,
        hold_until: UnixMs,
    ) -> impl Future<Output = StoreResult<Vec<crate::domain::confirm::Pending>>> + Send;
    /// Reschedules a confirmation (`Some`), or ends it (`None`); only if it
    /// is still for `generation`.
    fn settle_confirmation(
        &self,
        record_id: i64,
        step: &str,
        generation: i32,
        next: Option<&crate::domain::confirm::Pending>,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// The results of a record's steps that later generations replaced,
    /// by step and generation (the current ones are in `step_runs`).
    fn step_versions(
        &self,
        record_id: i64,
    ) -> impl Future<Output = StoreResult<Vec<StepVersion>>> + Send;
    fn attempts(&self, record_id: i64) -> impl Future<Output = StoreResult<Vec<Attempt>>> + Send;
    /// The attempts of several records, by record then in order.
    fn attempts_of(
        &self,
        record_ids: &[i64],
    ) -> impl Future<Output = StoreResult<Vec<Attempt>>> + Send;
    fn record_events(&self, record_id: i64)
    -> impl Future<Output = StoreResult<Vec<Event>>> + Send;
    fn audit_log(
        &self,
        filter: &AuditFilter,
    ) -> impl Future<Output = StoreResult<Page<Event>>> + Send;
    fn append_event(&self, event: &NewEvent) -> impl Future<Output = StoreResult<Event>> + Send;

    // --- pipelines -----------------------------------------------------
    /// Stores a pipeline definition once per (name, hash) and returns its id.
    fn pin_pipeline(
        &self,
        pipeline: &str,
        hash: &str,
        definition: &Value,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<i64>> + Send;
    fn pipeline_version(
        &self,
        id: i64,
    ) -> impl Future<Output = StoreResult<Option<PipelineVersion>>> + Send;
    /// Pipeline `pipeline`'s (or, `None`, every pipeline's) newest
    /// `limit` versions, newest first.
    fn pipeline_versions(
        &self,
        pipeline: Option<&str>,
        limit: i64,
    ) -> impl Future<Output = StoreResult<Vec<PipelineVersion>>> + Send;

    // --- users and sessions --------------------------------------------
    fn create_user(
        &self,
        user: &NewUser,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<User>> + Send;
    /// Creates `user` only while there is no user at all, atomically with
    /// that check (start-up's first admin: a `user add` at the same moment
    /// waits, or comes first and this creates nothing): the user, or `None`.
    fn create_first_user(
        &self,
        user: &NewUser,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<Option<User>>> + Send;
    fn user_by_name(
        &self,
        username: &str,
    ) -> impl Future<Output = StoreResult<Option<User>>> + Send;
    fn user_by_id(&self, id: i64) -> impl Future<Output = StoreResult<Option<User>>> + Send;
    fn list_users(&self) -> impl Future<Output = StoreResult<Vec<User>>> + Send;
    /// Changes a user and revokes all their sessions (and, for a role change
    /// or disabling, the API tokens they created), in one transaction, so
    /// the change takes effect on the next request.
    fn update_user(
        &self,
        id: i64,
        change: &UserChange,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<User>> + Send;
    /// Sets the dashboard colour scheme user `id` chose (`light`, `dark`;
    /// `None`: the system's). Sessions stay: it is a preference.
    fn set_theme(
        &self,
        id: i64,
        theme: Option<&str>,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    fn create_session(&self, session: &Session) -> impl Future<Output = StoreResult<()>> + Send;
    fn session(&self, id: &str) -> impl Future<Output = StoreResult<Option<Session>>> + Send;
    /// Notes a use of session `id` at `now` (never moving it back).
    fn touch_session(&self, id: &str, now: UnixMs) -> impl Future<Output = StoreResult<()>> + Send;
    fn revoke_session(&self, id: &str, now: UnixMs)
    -> impl Future<Output = StoreResult<()>> + Send;
    /// Deletes sessions that expired before `before`; returns how many.
    fn purge_sessions(&self, before: UnixMs) -> impl Future<Output = StoreResult<u64>> + Send;

    // --- nodes ---------------------------------------------------------
    fn heartbeat(
        &self,
        beat: &NodeBeat,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    fn list_nodes(&self) -> impl Future<Output = StoreResult<Vec<Node>>> + Send;
    fn remove_node(&self, id: &str) -> impl Future<Output = StoreResult<()>> + Send;

    // --- providers -----------------------------------------------------
    fn provider_state(
        &self,
        provider: &str,
    ) -> impl Future<Output = StoreResult<Option<ProviderState>>> + Send;
    fn provider_states(&self) -> impl Future<Output = StoreResult<Vec<ProviderState>>> + Send;
    fn save_provider_state(
        &self,
        state: &ProviderState,
    ) -> impl Future<Output = StoreResult<()>> + Send;
    /// Sets only the pause columns (so a concurrent breaker update cannot
    /// undo an operator's pause, nor the reverse).
    /// Writes the audit event (`provider_paused` / `provider_resumed`, by
    /// `actor`) in the same transaction.
    fn set_provider_pause(
        &self,
        provider: &str,
        paused: bool,
        actor: &str,
        reason: Option<&str>,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<ProviderState>> + Send;
    /// Leases a provider's limits for one node, under the provider row's
    /// lock (`domain::permits`): closes the grants the node is done with,
    /// removes grants that occupy nothing any more, grants permits in each
    /// window asked for, and sets the node's holding of concurrency slots.
    fn lease_permits(
        &self,
        req: &PermitRequest,
    ) -> impl Future<Output = StoreResult<Permits>> + Send;
    /// Changes the cluster's breaker for `provider` under its row's lock
    /// (`domain::breaker::SharedBreaker::apply`): returns the breaker as
    /// stored after, and the answer to a probe request. A change of state
    /// is announced to every node (PostgreSQL: `NOTIFY`, at commit).
    /// `stats`, when given, replaces the window figures shown with it.
    fn breaker_op(
        &self,
        provider: &str,
        op: SharedOp,
        stats: Option<&Value>,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<(SharedBreaker, Option<ProbeGrant>)>> + Send;
    /// Holds every node's calls to `provider` until `until` (a "slow down"
    /// it said); a later pause already kept wins, so nodes that publish
    /// the same storm in any order agree on its end.
    fn throttle_provider(
        &self,
        provider: &str,
        until: UnixMs,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    // --- installation facts ----------------------------------------------
    /// The stored value of `key`, storing `value` first if there is none
    /// (so concurrent first starts agree on one value).
    fn ensure_meta(
        &self,
        key: &str,
        value: &str,
    ) -> impl Future<Output = StoreResult<String>> + Send;

    /// Replaces the stored value of `key` and revokes every session, in one
    /// transaction (a new session signing key makes them all invalid).
    fn rotate_meta_secret(
        &self,
        key: &str,
        value: &str,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<u64>> + Send;

    // --- API tokens ----------------------------------------------------
    /// Stores a token and its audit event (`token_created`) in one transaction.
    fn create_api_token(
        &self,
        token: &NewApiToken,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<ApiToken>> + Send;
    /// A token that is not revoked, by the hash of its secret.
    fn api_token_by_hash(
        &self,
        hash: &str,
    ) -> impl Future<Output = StoreResult<Option<ApiToken>>> + Send;
    fn list_api_tokens(&self) -> impl Future<Output = StoreResult<Vec<ApiToken>>> + Send;
    /// Revokes a token with its audit event (`token_revoked`).
    fn revoke_api_token(
        &self,
        id: i64,
        actor: &str,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<ApiToken>> + Send;
    /// Notes a use; writes at most once a minute per token.
    fn touch_api_token(&self, id: i64, now: UnixMs)
    -> impl Future<Output = StoreResult<()>> + Send;

    // --- login throttling ----------------------------------------------
    /// The failed logins counted on `username`, if any.
    fn login_failures(
        &self,
        username: &str,
    ) -> impl Future<Output = StoreResult<Option<LoginFailures>>> + Send;
    /// Counts a failed login on `username` in one statement, so that
    /// failures on several nodes at once all count; a count whose latest
    /// failure is older than `forget_before` starts again at one. Returns
    /// the count with this failure.
    fn count_login_failure(
        &self,
        username: &str,
        now: UnixMs,
        forget_before: UnixMs,
    ) -> impl Future<Output = StoreResult<LoginFailures>> + Send;
    /// Counts the check about to be made on `username` as a failure in
    /// advance, at `now`, if its count is still `seen` (compare and set,
    /// one statement): true when this caller took it, false when another
    /// check took it first (on any node).
    fn claim_login_check(
        &self,
        username: &str,
        seen: LoginFailures,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<bool>> + Send;
    /// Forgets the failures of `username` (it logged in).
    fn login_succeeded(&self, username: &str) -> impl Future<Output = StoreResult<()>> + Send;

    // --- webhook deliveries --------------------------------------------
    /// Gives a delivery id back (its processing failed after the delivery
    /// was stored; the provider's retry must get through).
    fn forget_delivery(
        &self,
        provider: &str,
        delivery_id: &str,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Deletes the deliveries received before `before` that no step ever
    /// took (their job id matched none); returns how many.
    fn purge_orphan_deliveries(
        &self,
        before: UnixMs,
    ) -> impl Future<Output = StoreResult<u64>> + Send;

    // --- statistics ----------------------------------------------------
    /// Writes (replaces) this node's rows for the given minutes.
    fn save_rollups(&self, rows: &[StepRollup]) -> impl Future<Output = StoreResult<()>> + Send;
    /// Every node's rows from `since` on: minute rows, and hour rows (with
    /// `minute` the hour's start) of the hours that end after `since`.
    fn rollups_since(
        &self,
        since: UnixMs,
    ) -> impl Future<Output = StoreResult<Vec<StepRollup>>> + Send;
    /// Folds every node's minute rows older than `before` into hour rows,
    /// one hour per transaction, oldest first; returns how many minute rows
    /// were folded. Nodes may run it at once: each hour's minute rows are
    /// locked as they are read, so a second compaction waits and then finds
    /// them gone.
    fn compact_rollups(&self, before: UnixMs) -> impl Future<Output = StoreResult<u64>> + Send;
    /// Deletes rollups, delivery ids and login counters older than
    /// `before`; returns how many rows.
    fn purge_stats(&self, before: UnixMs) -> impl Future<Output = StoreResult<u64>> + Send;

    // --- schedules -----------------------------------------------------
    /// Every schedule's row, by pipeline.
    fn schedules(&self) -> impl Future<Output = StoreResult<Vec<ScheduleRow>>> + Send;
    /// Moves a schedule's watermark from `from` (as read) to `to`: true if
    /// this call moved it, false if another node had moved it first (its
    /// pass stands; this one's fired records, keyed by tick, are the same
    /// records).
    fn advance_schedule(
        &self,
        adv: &ScheduleAdvance,
    ) -> impl Future<Output = StoreResult<bool>> + Send;

    // --- retention -----------------------------------------------------
    /// Deletes up to `limit` records of `pipeline` that finished
    /// (succeeded, failed, cancelled) before `finished_before`, oldest
    /// first, in one transaction: their attempts, steps, callbacks and own
    /// events with them (audit entries stay), the counters moved. Records
    /// another transaction holds are left for the next batch.
    /// Returns the batch and the run's audit entry (written or updated in
    /// the batch's transaction when it removed something).
    fn purge_finished(
        &self,
        pipeline: &str,
        finished_before: UnixMs,
        limit: u32,
        run: &PurgeRun,
    ) -> impl Future<Output = StoreResult<(Purged, Option<i64>)>> + Send;
    /// What [`purge_finished`](Self::purge_finished) would delete, all
    /// batches together, and how many attempts
    /// [`strip_bodies`](Self::strip_bodies) would blank for `strip_before`.
    fn count_purgeable(
        &self,
        pipeline: &str,
        finished_before: Option<UnixMs>,
        strip_before: Option<UnixMs>,
    ) -> impl Future<Output = StoreResult<Purged>> + Send;
    /// Blanks the excerpt and request of the attempts of up to `limit`
    /// records of `pipeline` that finished before `finished_before`, from
    /// where the last call stopped (kept per pipeline). Returns the
    /// attempts blanked, whether records remain, and the run's audit entry
    /// (as [`purge_finished`](Self::purge_finished)).
    fn strip_bodies(
        &self,
        pipeline: &str,
        finished_before: UnixMs,
        limit: u32,
        run: &PurgeRun,
    ) -> impl Future<Output = StoreResult<(i64, bool, Option<i64>)>> + Send;
    /// Takes the lease on a task one node does at a time, until `until`:
    /// true if this owner holds it now (taken, or already its own).
    fn take_task_lease(
        &self,
        name: &str,
        owner: &str,
        until: UnixMs,
        now: UnixMs,
    ) -> impl Future<Output = StoreResult<bool>> + Send;
    fn release_task_lease(
        &self,
        name: &str,
        owner: &str,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    // --- word search -----------------------------------------------------
    /// Where the search indexer stopped: every event up to this id has
    /// been indexed or given up on (`domain::search::Progress`).
    fn search_progress(&self) -> impl Future<Output = StoreResult<i64>> + Send;
    /// The events above `after` (the first `limit`, by id) and those of
    /// `gaps` that are there now.
    fn search_events(
        &self,
        after: i64,
        gaps: &[i64],
        limit: u32,
    ) -> impl Future<Output = StoreResult<Vec<crate::domain::search::SeenEvent>>> + Send;
    /// Writes the search documents of `records` anew (those purged are
    /// skipped) and moves the stored progress up to `settled`, in one
    /// transaction; returns the documents written.
    fn index_records(
        &self,
        records: &[i64],
        settled: i64,
    ) -> impl Future<Output = StoreResult<u64>> + Send;
}

/// Connection settings shared by both backends.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// SQLite: how long a statement waits for another process's write lock.
    pub busy_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(10),
        }
    }
}

/// Which database a URL names (decided by the configuration, which checks
/// the URL when it loads).
pub use crate::config::Backend;

/// The store the application holds: one of the two backends.
#[derive(Clone, Debug)]
pub enum Db {
    Sqlite(SqliteStore),
    Postgres(PgStore),
}

impl Db {
    /// Connects to the database a URL names (`sqlite:…` or `postgres://…`).
    /// Does not migrate.
    pub async fn connect(url: &str, opts: &ConnectOptions) -> StoreResult<Db> {
        match Backend::of_url(url) {
            Some(Backend::Sqlite) => Ok(Db::Sqlite(SqliteStore::connect(url, opts).await?)),
            Some(Backend::Postgres) => Ok(Db::Postgres(PgStore::connect(url, opts).await?)),
            None => Err(StoreError::Invalid(
                "database url must start with `sqlite:` or `postgres://`".into(),
            )),
        }
    }

    pub fn backend(&self) -> Backend {
        match self {
            Db::Sqlite(_) => Backend::Sqlite,
            Db::Postgres(_) => Backend::Postgres,
        }
    }

    /// Closes every pooled connection; pending calls finish first.
    pub async fn close(&self) {
        match self {
            Db::Sqlite(s) => s.close().await,
            Db::Postgres(s) => s.close().await,
        }
    }
}

/// A node's request for a provider's permits ([`Store::lease_permits`]).
#[derive(Debug, Clone, Default)]
pub struct PermitRequest {
    pub provider: String,
    pub node: String,
    pub now: UnixMs,
    /// The longest a call started on a grant can outlast the grant.
    pub lapse_ms: i64,
    /// Live nodes (batch sizes are a quarter of a node's share).
    pub live_nodes: usize,
    /// Grants the node is done with: (id, permits used, when the last call
    /// on it completed).
    pub close: Vec<(i64, i64, UnixMs)>,
    /// Windows to draw on: (length in ms, limit, permits wanted).
    pub windows: Vec<(i64, u32, i64)>,
    /// The cluster's concurrency cap, for a node holding slots of it.
    pub slots: Option<SlotRequest>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRequest {
    /// The node's need and the calls it may have in flight.
    pub ask: crate::domain::permits::SlotAsk,
    /// How long the holding lasts unless renewed.
    pub hold_ms: i64,
}

/// What [`Store::lease_permits`] granted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Permits {
    /// Per window asked for: (length in ms, grant id when granted, answer).
    pub windows: Vec<(i64, Option<i64>, crate::domain::permits::Granted)>,
    /// The node's place in the cap, and until when its holding lasts.
    pub slots: Option<(crate::domain::permits::SlotShare, UnixMs)>,
}

/// Implements [`Store`] for [`Db`] by forwarding each call to the backend.
macro_rules! forward {
    ($( fn $name:ident(&self $(, $arg:ident : $ty:ty)*) -> $ret:ty; )*) => {
        impl Store for Db {
            $(
                async fn $name(&self $(, $arg: $ty)*) -> StoreResult<$ret> {
                    match self {
                        Db::Sqlite(s) => s.$name($($arg),*).await,
                        Db::Postgres(s) => s.$name($($arg),*).await,
                    }
                }
            )*
        }
    };
}

forward! {
    fn ping(&self) -> ();
    fn installation_id(&self) -> String;
    fn create_record(&self, new: NewRecord, now: UnixMs) -> Created;
    fn create_records(&self, batch: Vec<NewRecord>, now: UnixMs) -> Vec<Created>;
    fn get_record(&self, id: i64) -> Option<Record>;
    fn record_version(&self, id: i64) -> Option<[i64; 5]>;
    fn find_records(&self, q: &str, providers: &[String]) -> Vec<Record>;
    fn list_records(&self, filter: &RecordFilter) -> Page<Record>;
    fn state_counts(&self) -> Vec<StateCount>;
    fn recount_states(&self) -> Vec<StateCount>;
    fn provider_counts(&self) -> Vec<StateCount>;
    fn recount_providers(&self) -> Vec<StateCount>;
    fn step_counts(&self) -> Vec<StepCount>;
    fn recount_steps(&self) -> Vec<StepCount>;
    fn next_due_at(&self) -> Option<UnixMs>;
    fn oldest_due(&self, pipelines: &[String], now: UnixMs) -> Vec<(String, UnixMs)>;
    fn claim_due(&self, req: &ClaimRequest) -> Vec<Record>;
    fn extend_leases(&self, leases: &[Lease], until: UnixMs) -> Vec<i64>;
    fn release(&self, leases: &[Lease], now: UnixMs) -> u64;
    fn commit(&self, commit: &Commit) -> Record;
    fn commit_many(&self, commits: &[Commit]) -> Vec<StoreResult<Record>>;
    fn act(&self, req: &ActionRequest) -> Record;
    fn resume_parked(&self, req: &ResumeDue) -> Vec<Record>;
    fn record_callback(&self, cb: &NewCallback) -> Option<CallbackMatch>;
    fn pending_callbacks(&self, provider: &str, job_id: &str) -> Vec<PendingCallback>;
    fn mark_callbacks(&self, ids: &[i64], now: UnixMs) -> ();
    fn wake_record(&self, record_id: i64, now: UnixMs) -> ();
    fn reverse(&self, req: &ReverseRequest) -> Record;
    fn append_attempts(&self, record_id: i64, attempts: &[NewAttempt], intents_done: &[i64]) -> ();
    fn record_intents(&self, intents: &[NewIntent]) -> Vec<StoreResult<i64>>;
    fn open_intents(&self, record_id: i64) -> Vec<crate::domain::Intent>;
    fn intent_providers(&self) -> Vec<String>;
    fn step_runs(&self, record_id: i64) -> Vec<StepRun>;
    fn step_runs_of(&self, record_ids: &[i64]) -> Vec<StepRun>;
    fn claim_confirmations(&self, now: UnixMs, limit: u32, hold_until: UnixMs) -> Vec<crate::domain::confirm::Pending>;
    fn settle_confirmation(&self, record_id: i64, step: &str, generation: i32, next: Option<&crate::domain::confirm::Pending>) -> ();
    fn step_versions(&self, record_id: i64) -> Vec<StepVersion>;
    fn attempts(&self, record_id: i64) -> Vec<Attempt>;
    fn attempts_of(&self, record_ids: &[i64]) -> Vec<Attempt>;
    fn record_events(&self, record_id: i64) -> Vec<Event>;
    fn audit_log(&self, filter: &AuditFilter) -> Page<Event>;
    fn append_event(&self, event: &NewEvent) -> Event;
    fn pin_pipeline(&self, pipeline: &str, hash: &str, definition: &Value, now: UnixMs) -> i64;
    fn pipeline_version(&self, id: i64) -> Option<PipelineVersion>;
    fn pipeline_versions(&self, pipeline: Option<&str>, limit: i64) -> Vec<PipelineVersion>;
    fn create_user(&self, user: &NewUser, now: UnixMs) -> User;
    fn create_first_user(&self, user: &NewUser, now: UnixMs) -> Option<User>;
    fn user_by_name(&self, username: &str) -> Option<User>;
    fn user_by_id(&self, id: i64) -> Option<User>;
    fn list_users(&self) -> Vec<User>;
    fn update_user(&self, id: i64, change: &UserChange, now: UnixMs) -> User;
    fn set_theme(&self, id: i64, theme: Option<&str>) -> ();
    fn create_session(&self, session: &Session) -> ();
    fn session(&self, id: &str) -> Option<Session>;
    fn touch_session(&self, id: &str, now: UnixMs) -> ();
    fn revoke_session(&self, id: &str, now: UnixMs) -> ();
    fn purge_sessions(&self, before: UnixMs) -> u64;
    fn heartbeat(&self, beat: &NodeBeat, now: UnixMs) -> ();
    fn list_nodes(&self) -> Vec<Node>;
    fn remove_node(&self, id: &str) -> ();
    fn provider_state(&self, provider: &str) -> Option<ProviderState>;
    fn provider_states(&self) -> Vec<ProviderState>;
    fn save_provider_state(&self, state: &ProviderState) -> ();
    fn set_provider_pause(&self, provider: &str, paused: bool, actor: &str, reason: Option<&str>, now: UnixMs) -> ProviderState;
    fn breaker_op(&self, provider: &str, op: SharedOp, stats: Option<&Value>, now: UnixMs) -> (SharedBreaker, Option<ProbeGrant>);
    fn lease_permits(&self, req: &PermitRequest) -> Permits;
    fn throttle_provider(&self, provider: &str, until: UnixMs, now: UnixMs) -> ();
    fn ensure_meta(&self, key: &str, value: &str) -> String;
    fn rotate_meta_secret(&self, key: &str, value: &str, now: UnixMs) -> u64;
    fn create_api_token(&self, token: &NewApiToken, now: UnixMs) -> ApiToken;
    fn api_token_by_hash(&self, hash: &str) -> Option<ApiToken>;
    fn list_api_tokens(&self) -> Vec<ApiToken>;
    fn revoke_api_token(&self, id: i64, actor: &str, now: UnixMs) -> ApiToken;
    fn touch_api_token(&self, id: i64, now: UnixMs) -> ();
    fn login_failures(&self, username: &str) -> Option<LoginFailures>;
    fn count_login_failure(&self, username: &str, now: UnixMs, forget_before: UnixMs) -> LoginFailures;
    fn claim_login_check(&self, username: &str, seen: LoginFailures, now: UnixMs) -> bool;
    fn login_succeeded(&self, username: &str) -> ();
    fn forget_delivery(&self, provider: &str, delivery_id: &str) -> ();
    fn purge_orphan_deliveries(&self, before: UnixMs) -> u64;
    fn save_rollups(&self, rows: &[StepRollup]) -> ();
    fn rollups_since(&self, since: UnixMs) -> Vec<StepRollup>;
    fn compact_rollups(&self, before: UnixMs) -> u64;
    fn purge_stats(&self, before: UnixMs) -> u64;
    fn schedules(&self) -> Vec<ScheduleRow>;
    fn advance_schedule(&self, adv: &ScheduleAdvance) -> bool;
    fn purge_finished(&self, pipeline: &str, finished_before: UnixMs, limit: u32, run: &PurgeRun) -> (Purged, Option<i64>);
    fn count_purgeable(&self, pipeline: &str, finished_before: Option<UnixMs>, strip_before: Option<UnixMs>) -> Purged;
    fn strip_bodies(&self, pipeline: &str, finished_before: UnixMs, limit: u32, run: &PurgeRun) -> (i64, bool, Option<i64>);
    fn take_task_lease(&self, name: &str, owner: &str, until: UnixMs, now: UnixMs) -> bool;
    fn release_task_lease(&self, name: &str, owner: &str) -> ();
    fn search_records(&self, q: &str, limit: u32) -> Vec<Record>;
    fn search_progress(&self) -> i64;
    fn search_events(&self, after: i64, gaps: &[i64], limit: u32) -> Vec<crate::domain::search::SeenEvent>;
    fn index_records(&self, records: &[i64], settled: i64) -> u64;
}

/// An event row as the store writes it, transitions included.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EventRow<'a> {
    pub record_id: Option<i64>,
    pub at: UnixMs,
    pub kind: &'a str,
    pub actor: &'a str,
    pub audit: bool,
    pub from: Option<RecordState>,
    pub to: Option<RecordState>,
    pub step: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub detail: Option<&'a Value>,
}

/// The actor name written for a worker's events.
pub(crate) fn node_actor(owner: &str) -> String {
    format!("node:{owner}")
}

/// Clamps a requested page size to `1..=MAX_PAGE` (0 means the default, 50).
pub(crate) fn page_limit(limit: u32) -> u32 {
    match limit {
        0 => 50,
        n => n.min(MAX_PAGE),
    }
}

/// Splits a `limit + 1` fetch into a page and its cursor.
pub(crate) fn into_page<T>(mut items: Vec<T>, limit: u32, id: impl Fn(&T) -> i64) -> Page<T> {
    let limit = limit as usize;
    let next = if items.len() > limit {
        items.truncate(limit);
        items.last().map(&id)
    } else {
        None
    };
    Page { items, next }
}

/// The state a record takes when a worker commits `result`, checked against
/// the transition table (the record is `running` while leased).
pub(crate) fn worked_state(result: WorkResult) -> StoreResult<RecordState> {
    Ok(crate::domain::transition(
        RecordState::Running,
        crate::domain::Trigger::Worked(result),
    )?)
}

/// Usernames are lowercase ASCII letters, digits and `._-`, 1 to 64 long.
pub fn validate_username(name: &str) -> StoreResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "username `{name}` must be 1-64 characters of a-z, 0-9, `.`, `_` or `-`"
        )))
    }
}
