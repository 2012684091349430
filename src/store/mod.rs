//! Persistence: the [`Store`] contract, its request types, and [`Db`], the
//! handle the rest of Ballast holds, dispatching to SQLite or PostgreSQL.
//!
//! Handlers and workers never touch `sqlx`; they call these methods. Every
//! state change is written with its event and its counter deltas in one
//! transaction.

mod backend;
mod batch;
mod cluster;
mod counts;
mod filter;
mod history;
mod housekeeping;
pub mod migrate;
mod notices;
mod people;
mod postgres;
mod records;
mod reseal;
mod rows;
mod sql;
mod sqlite;
mod work;

use std::time::Duration;

use serde_json::Value;

use crate::domain::account::AccountRefusal;
pub use crate::domain::account::UserChange;
pub use crate::domain::action::{ActionRequest, InputEdit, Took};
use crate::domain::{
    Outcome, Record, RecordState, Role, StepState, TransitionError, UnixMs, WorkResult,
};

pub use cluster::Cluster;
pub use history::History;
pub use housekeeping::Housekeeping;
pub use notices::{
    Notice, NoticeFilter, NoticeOutcome, NoticeRound, NoticeSettle, Notices, Settled,
    SubscriptionState,
};
pub use people::People;
pub use postgres::{PgStore, Wakeup};
pub use records::Records;
pub use reseal::{DataKeyRow, Resealed, SealedColumn, admit_keys, check_keys, note_current};
pub(crate) use rows::NO_TIME;
pub use sqlite::{SqliteStore, create_private, partial_beside, place_new};
pub use work::Work;

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
    /// An operator's action the domain refused, with its stable code.
    #[error("invalid request: {message}")]
    Declined { code: &'static str, message: String },
    /// An account change that would leave no enabled admin.
    #[error(transparent)]
    Refused(#[from] AccountRefusal),
    /// A stored value the code does not understand (a newer binary wrote it,
    /// or someone edited the database by hand).
    #[error("unreadable stored value: {0}")]
    Corrupt(String),
    /// A value sealed at rest that this node cannot open (`auth::seal`).
    #[error(transparent)]
    Sealed(#[from] crate::auth::seal::SealError),
    /// The data keys configured cannot read what the database holds.
    #[error("{0}")]
    Keys(String),
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

impl From<crate::domain::action::Refused> for StoreError {
    fn from(r: crate::domain::action::Refused) -> Self {
        match r {
            crate::domain::action::Refused::Transition(e) => StoreError::Transition(e),
            crate::domain::action::Refused::Invalid { code, message } => {
                StoreError::Declined { code, message }
            }
        }
    }
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
            StoreError::Declined { code, .. } => code,
            StoreError::Refused(r) => r.code(),
            StoreError::Corrupt(_) => "corrupt_row",
            StoreError::Sealed(_) => "sealed_value",
            StoreError::Keys(_) => "data_keys",
            StoreError::NotNow(_) => "not_now",
            StoreError::Database(_) => "database_error",
            StoreError::Migrate(_) => "migration_error",
            StoreError::NewerSchema { .. } => "schema_too_new",
        }
    }

    /// Whether the database refused a row whose key is taken (a unique
    /// constraint).
    pub fn is_key_taken(&self) -> bool {
        matches!(self, StoreError::Database(sqlx::Error::Database(d)) if d.is_unique_violation())
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// A schedule's watermark moved from what a node read to what it dealt
/// with ([`Housekeeping::advance_schedule`]).
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

/// One delivery to a trigger (`POST /triggers/NAME`), with its verdict
/// (`domain::trigger::Verdict` by code).
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct TriggerDelivery {
    pub id: i64,
    pub trigger: String,
    /// The pipeline the trigger enqueued into then (who may see it).
    pub pipeline: String,
    pub received_at: UnixMs,
    /// Its verdict's code: `enqueued`, `duplicate`, `ignored`,
    /// `bad_signature`, `stale_signature`, `bad_signature_header`,
    /// `body_not_json`, `no_event_id`, `unmapped_event`, `event_refused`,
    /// `unavailable`.
    pub verdict: String,
    /// The HTTP status it was answered.
    pub status: u16,
    pub event_id: Option<String>,
    pub event_type: Option<String>,
    /// The record it made or named.
    pub record_id: Option<i64>,
    /// Why it was refused, when it was.
    pub detail: Option<String>,
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
    /// 0 to 9: within its queue, higher is claimed first.
    pub priority: u8,
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
    /// Only records of these pipelines (a caller limited to them); `None`:
    /// any.
    pub pipelines: Option<Vec<String>>,
    pub state: Option<RecordState>,
    pub provider: Option<String>,
    pub step: Option<String>,
    pub error_code: Option<String>,
    /// Only records of this group (the fair-share group given at enqueue).
    pub group: Option<String>,
    /// Only records of this priority.
    pub priority: Option<u8>,
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
    /// Only actions on records of these pipelines (a caller limited to
    /// them); `None`: every action.
    pub pipelines: Option<Vec<String>>,
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
/// queues, each queue's in due order), and what each was taken from.
pub(crate) type Claimed = (Vec<Record>, std::collections::HashMap<i64, Taken>);

/// What a claimed record was taken from: its state, and, for a lapsed
/// lease (taken from `running`), who had claimed that pass and when
/// (none for a pass an older version claimed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    pub state: String,
    pub owner: Option<String>,
    pub at: Option<UnixMs>,
}

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
    /// `now` when not given, except for `waiting`: none then means a wait
    /// only a decision or a signal ends.
    pub next_run_at: Option<UnixMs>,
    pub step: Option<String>,
    pub provider: Option<String>,
    pub error_code: Option<String>,
    pub reason: Option<String>,
    pub steps: Vec<StepWrite>,
    /// Steps among `steps` whose run is not stored (the pass read none
    /// under its lease and has written none since): on PostgreSQL inserted
    /// as new rows, not upserted (no speculative insertion; SQLite's upsert
    /// costs what its insert does, and upserts them). Naming none is
    /// always right. A step named here whose run is stored fails the
    /// group's transaction on the run's key; the committer then writes the
    /// group again naming none (and logs an error: a run was written that
    /// the pass did not know of), so no pass loses its replies.
    pub new_steps: Vec<String>,
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
    /// A record to make due now if it is waiting (the parent of a child
    /// this commit brings to rest), locked with the group's records.
    pub wake: Option<i64>,
    /// The record waits on child records: committed `waiting`, it is made
    /// due at once if one of them is already at rest (it came to rest
    /// while this pass ran, and could not wake it then).
    pub awaits_children: bool,
    /// Steps to run again as a new generation, their results kept as
    /// versions, with the cause (an undo's steps, started by a failure).
    pub rerun: Option<(Vec<String>, String)>,
}

impl Commit {
    /// What it says of its record, for [`crate::domain::pass::after_commit`].
    pub fn committed(&self) -> crate::domain::pass::Committed<'_> {
        crate::domain::pass::Committed {
            now: self.now,
            result: self.result,
            next_run_at: self.next_run_at,
            step: self.step.as_deref(),
            provider: self.provider.as_deref(),
            error_code: self.error_code.as_deref(),
            reason: self.reason.as_deref(),
            park_until: self.park_until.as_ref(),
        }
    }

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
            new_steps: Vec::new(),
            attempts: Vec::new(),
            callbacks_done: Vec::new(),
            confirms: Vec::new(),
            park_until: None,
            intents_done: Vec::new(),
            wake: None,
            awaits_children: false,
            rerun: None,
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
    /// The pipelines the user may see.
    pub pipelines: crate::domain::scope::Scope,
    /// Sees sensitive fields in clear.
    pub unmask: bool,
}

/// A sign-in at an OpenID provider under way (`sign_ons`), kept until its
/// person comes back, and then taken (once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingSignOn {
    /// The hash of the `state` the provider returns (the browser's cookie
    /// holds the state itself).
    pub state_key: String,
    pub nonce: String,
    /// The PKCE code verifier.
    pub verifier: String,
    /// Where to go once signed in.
    pub next: String,
    pub created_at: UnixMs,
}

/// A person an OpenID provider vouched for, with what their groups grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignOnUser {
    pub issuer: String,
    pub subject: String,
    /// The name a new user is given.
    pub username: String,
    pub role: Role,
    pub pipelines: crate::domain::scope::Scope,
    pub unmask: bool,
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
    /// The user it belongs to: a change to that user (a role, disabled,
    /// pipelines) revokes it.
    pub created_by: String,
    /// Who made it, for the audit log: that user, or a token of theirs
    /// (`token:NAME`).
    pub actor: String,
    /// When it stops working, if ever.
    pub expires_at: Option<UnixMs>,
    /// The pipelines it may see.
    pub pipelines: crate::domain::scope::Scope,
    /// Sees sensitive fields in clear.
    pub unmask: bool,
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

/// The storage contract, by aggregate, each trait implemented once over
/// both backends ([`SqlStore`](sql::SqlStore) over [`SqlDb`](backend::SqlDb))
/// and checked by one conformance suite against both. [`Db`] derefs to it,
/// so `db.claim_due(..)` needs no import.
pub trait Store: Records + History + Work + Cluster + People + Housekeeping + Notices {}

impl<T> Store for T where T: Records + History + Work + Cluster + People + Housekeeping + Notices {}

/// Connection settings shared by both backends.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// SQLite: how long a statement waits for another process's write lock.
    pub busy_timeout: Duration,
    /// The data keys values are sealed with at rest (none: kept in clear).
    pub keyring: std::sync::Arc<crate::auth::seal::Keyring>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(10),
            keyring: Default::default(),
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

impl std::ops::Deref for Db {
    type Target = dyn Store;

    fn deref(&self) -> &(dyn Store + 'static) {
        match self {
            Db::Sqlite(s) => s,
            Db::Postgres(s) => s,
        }
    }
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

    /// The most connections the pool reads through (on PostgreSQL, every
    /// statement's; SQLite writes through one more of its own).
    pub fn max_connections(&self) -> u32 {
        match self {
            Db::Sqlite(s) => s.reader().options().get_max_connections(),
            Db::Postgres(s) => s.reader().options().get_max_connections(),
        }
    }

    /// The data keys values are sealed with from now on (a reload).
    pub fn set_keyring(&self, ring: std::sync::Arc<crate::auth::seal::Keyring>) {
        match self {
            Db::Sqlite(s) => s.keys.set(ring),
            Db::Postgres(s) => s.keys.set(ring),
        }
    }

    /// What the `[[notify]]` subscriptions want, from now on (start and
    /// reload).
    pub fn set_notify_filters(&self, filters: Vec<crate::domain::notify::Filter>) {
        match self {
            Db::Sqlite(s) => s.filters.set(std::sync::Arc::new(filters)),
            Db::Postgres(s) => s.filters.set(std::sync::Arc::new(filters)),
        }
    }

    /// The data keys as they are now.
    pub fn keyring(&self) -> std::sync::Arc<crate::auth::seal::Keyring> {
        match self {
            Db::Sqlite(s) => s.keyring(),
            Db::Postgres(s) => s.keyring(),
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

/// A node's request for a provider's permits ([`Cluster::lease_permits`]).
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

/// What [`Cluster::lease_permits`] granted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Permits {
    /// Per window asked for: (length in ms, grant id when granted, answer).
    pub windows: Vec<(i64, Option<i64>, crate::domain::permits::Granted)>,
    /// The node's place in the cap, and until when its holding lasts.
    pub slots: Option<(crate::domain::permits::SlotShare, UnixMs)>,
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
    /// On an event that ends a pass (it leaves `running`): when the pass
    /// was claimed, which has no row of its own (migration 34).
    pub claimed_at: Option<UnixMs>,
    /// The lease owner (node id) that claimed it, on a `lease_expired`
    /// (which the next claimer writes, as its actor); none elsewhere,
    /// where the event's actor claimed.
    pub claimed_by: Option<&'a str>,
}

impl<'a> EventRow<'a> {
    /// An audit entry about no record: `kind` by `actor` at `at`.
    pub(crate) fn audit(kind: &'a str, actor: &'a str, at: UnixMs, detail: &'a Value) -> Self {
        EventRow {
            record_id: None,
            at,
            kind,
            actor,
            audit: true,
            from: None,
            to: None,
            step: None,
            reason: None,
            detail: Some(detail),
            claimed_at: None,
            claimed_by: None,
        }
    }
}

pub(crate) use crate::domain::claimed::node_actor;

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

/// Usernames are lowercase ASCII letters, digits and `._-@`, 1 to 64 long.
pub fn validate_username(name: &str) -> StoreResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-@".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "username `{name}` must be 1-64 characters of a-z, 0-9, `.`, `_`, `-` or `@`"
        )))
    }
}
