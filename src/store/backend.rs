//! What differs between the two backends, as the one trait the shared store
//! is generic over: [`SqlDb`], implemented for `sqlx::Sqlite` in `sqlite.rs`
//! and for `sqlx::Postgres` in `postgres.rs`.
//!
//! SQLite and PostgreSQL accept the same SQL for almost everything Ballast
//! does (`$n` placeholders, `ON CONFLICT`, `RETURNING`, partial indexes), so
//! the store's logic is written once, in [`SqlStore`](super::sql::SqlStore)
//! and the aggregates' implementations of [`Store`](super::Store). What really
//! differs is this trait: how a write transaction begins (a single writer
//! with `BEGIN IMMEDIATE` against row locks), a few spellings in the SQL,
//! counter sharding, waking other nodes, and claiming (`FOR NO KEY UPDATE
//! SKIP LOCKED`).

use std::fmt::Debug;
use std::future::Future;
use std::sync::OnceLock;

use serde::Serialize;
use sqlx::query::Query;
use sqlx::{Database, IntoArguments, Pool, Transaction};

use super::batch::Dialect;
use super::rows::MapRow;
use super::{ClaimRequest, Claimed, StoreResult};

/// A database the shared store runs on: the backend's connections, its
/// spellings of the few statements that differ, and the operations whose
/// semantics differ.
///
/// The bounds sqlx needs to run and bind statements generically (an
/// executor for a connection, `Encode` for each bound type) are not
/// supertraits of this trait: Rust does not carry where-clauses about other
/// types to a trait's users (rust-lang/rust#20671), so they are stated once
/// on each generic `impl` of the store instead. Those the language does
/// carry, bounds on the database's own associated types, are here.
pub trait SqlDb:
    Database<Row: MapRow, Arguments: IntoArguments<Self>, QueryResult: RowsAffected>
{
    /// What the store holds to reach the database (its connection pools).
    type Pools: Clone + Debug + Send + Sync + 'static;

    /// Appended to row reads made inside a write transaction: a row lock
    /// on PostgreSQL; nothing on SQLite, whose single writer already
    /// excludes every other writer (see `postgres.rs` for which lock).
    const LOCK: &'static str;

    /// Taken in a write transaction before it asks whether there is any
    /// user and creates the first: PostgreSQL's `users` table lock, which
    /// waits for an insert not yet committed and makes the next wait;
    /// none on SQLite (one writer).
    const LOCK_USERS: Option<&'static str>;

    /// The spelling of "audit is true" that matches the backend's partial
    /// indexes on `events`.
    const AUDIT: &'static str;

    /// The backend's spelling of batched rows: its `rows()` is the table of
    /// JSON rows read from parameter `$1` (see `batch.rs`).
    const DIALECT: Dialect;

    /// How `column <ANY_OF.0>subquery<ANY_OF.1>` matches a key against a
    /// subquery's values through the key's index whatever the statistics
    /// say (see `postgres.rs` for why that needs care).
    const ANY_OF: (&'static str, &'static str);

    /// Added to the batched record update's join, for the same reason as
    /// [`ANY_OF`](Self::ANY_OF); empty on SQLite, whose planner would then
    /// scan the JSON rows once per record.
    const UPDATE_KEY: &'static str;

    /// Whether the listing indexes leave running records out (PostgreSQL,
    /// migration 20), so that a list with no state asked reads resting and
    /// running records apart (`store/filter.rs`). SQLite's are whole.
    const LISTS_IN_PARTS: bool;

    /// The pool for reads outside a write transaction.
    fn reader(pools: &Self::Pools) -> &Pool<Self>;

    /// Begins a write transaction. Every write of the store goes through
    /// one of these, so the backend decides how writers are ordered.
    fn begin_write(
        pools: &Self::Pools,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;

    /// Tells idle workers, on every node the backend can reach, that there
    /// is due work; delivered when `tx` commits.
    fn notify_work(
        tx: &mut Transaction<'static, Self>,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Tells every node the backend can reach that a provider's shared
    /// state changed (a pause, a breaker); delivered when `tx` commits.
    fn notify_providers(
        tx: &mut Transaction<'static, Self>,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// The counter row this transaction adds its deltas to, out of the
    /// rows each (pipeline, state) counter is spread over.
    fn counter_shard() -> i32;

    /// Inserts `batch`'s records (as `insert_records` would), their
    /// `created` events and counter moves, and wakes the workers, in one
    /// statement: one round trip and one commit. Returns the records
    /// inserted (a repeated key's row is not), or `None` where the backend
    /// does it in a transaction instead (SQLite: in the process, where a
    /// statement costs no round trip and there is one writer).
    fn insert_records_at_once(
        _pools: &Self::Pools,
        _batch: &[crate::store::NewRecord],
        _now: crate::domain::UnixMs,
        _keys: &crate::auth::seal::Keyring,
    ) -> impl Future<Output = StoreResult<Option<Vec<crate::domain::Record>>>> + Send {
        async { Ok(None) }
    }

    /// Leases due records inside the caller's transaction, a fair share
    /// from each (pipeline, group) queue (`domain::fair`): returns them in
    /// hand-out order, with what each was taken from ([`Taken`](super::Taken)),
    /// and sets each one's `claimed_at`. The caller writes the counter moves
    /// and the `lease_expired` events of lapsed leases (a claim writes no
    /// event of its own).
    fn claim_in(
        tx: &mut Transaction<'static, Self>,
        req: &ClaimRequest,
        keys: &crate::auth::seal::Keyring,
    ) -> impl Future<Output = StoreResult<Claimed>> + Send;

    /// Each (pipeline, group) queue with records needing a worker, and when
    /// its earliest is due, found through `records_queue_levels` one level
    /// (pipeline, group, priority) at a time (the idle engine's wake-up,
    /// the oldest-due metric).
    fn queue_heads_in(
        pools: &Self::Pools,
    ) -> impl Future<Output = StoreResult<Vec<(String, String, crate::domain::UnixMs)>>> + Send;

    /// Word search: the ids of the newest `limit` records whose search
    /// documents hold every word of `q` (`domain::search`), newest first.
    fn search_ids(
        pools: &Self::Pools,
        q: &str,
        limit: i64,
    ) -> impl Future<Output = StoreResult<Vec<i64>>> + Send;

    /// Writes the search documents of `records` anew inside `tx` where
    /// they changed (PostgreSQL compares the words, SQLite the text's
    /// digest; those purged meanwhile are skipped): the words of the key,
    /// reason, error code and input values, and of each step's output
    /// values, reason, error code and job id, the first 64 KiB of them
    /// (JSON keys are not a record's words); of `bare` records (of
    /// pipelines with sensitive fields) without input or output values.
    /// Returns the documents written.
    fn index_in(
        tx: &mut Transaction<'static, Self>,
        records: &[i64],
        bare: &[i64],
    ) -> impl Future<Output = StoreResult<u64>> + Send;

    /// Removes the search documents of records deleted in `tx`.
    fn unindex_in(
        tx: &mut Transaction<'static, Self>,
        records: &[i64],
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// This backend's statement texts, built once each (a `static` in a
    /// generic function would be shared by both backends).
    fn statements() -> &'static Statements;

    /// Runs `writes` inside `tx`, in the order they were added.
    fn run_writes(
        tx: &mut Transaction<'static, Self>,
        writes: &Writes,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Binds `value` as a JSON parameter. `Json<T>` is encodable for every
    /// serialisable `T` on each backend, which a where-clause cannot say
    /// for all `T` at once; each backend binds it in its own terms.
    fn bind_json<'q, T: Serialize>(
        query: Query<'q, Self, Self::Arguments>,
        value: T,
    ) -> Query<'q, Self, Self::Arguments>;
}

/// A statement's result: how many rows it changed. (Each backend's result
/// type has this as an inherent method, which generic code cannot see.)
pub trait RowsAffected {
    fn rows_affected(&self) -> u64;
}

impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        sqlx::sqlite::SqliteQueryResult::rows_affected(self)
    }
}

impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows_affected(&self) -> u64 {
        sqlx::postgres::PgQueryResult::rows_affected(self)
    }
}

/// Binds a JSON parameter on a generic query (see [`SqlDb::bind_json`]).
pub(crate) trait BindJson {
    fn bind_json<T: Serialize>(self, value: T) -> Self;
}

impl<'q, DB: SqlDb> BindJson for Query<'q, DB, DB::Arguments> {
    fn bind_json<T: Serialize>(self, value: T) -> Self {
        DB::bind_json(self, value)
    }
}

/// Statements of one transaction that return nothing, each reading its
/// rows from one JSON parameter, `$1` (`batch.rs`): gathered, then run in
/// the order added by [`SqlDb::run_writes`]. SQLite gets them as one
/// request to its writer's thread, where one statement at a time cost a
/// request and a reply each: one text of several statements, each part's
/// `$1` renumbered, a part with no rows run over none, so that a caller's
/// text is always the same and its statements are prepared once and kept
/// (sqlx runs several statements of one query on SQLite only, a use it
/// calls deprecated: `store::*_x` tests fail should it stop). PostgreSQL
/// runs them one by one, skipping those with no rows.
#[derive(Default)]
pub struct Writes(Vec<(&'static str, Option<Box<serde_json::value::RawValue>>)>);

impl Writes {
    /// Adds `sql` over `rows` (none: a part run over none on SQLite).
    pub(crate) fn add<T: Serialize>(&mut self, sql: &'static str, rows: &[T]) -> StoreResult<()> {
        let rows = match rows.is_empty() {
            true => None,
            false => Some(
                serde_json::value::to_raw_value(rows)
                    .map_err(|e| super::StoreError::Database(sqlx::Error::Encode(Box::new(e))))?,
            ),
        };
        self.0.push((sql, rows));
        Ok(())
    }

    /// Each statement with its rows (`None`: none), in order.
    pub(crate) fn parts(
        &self,
    ) -> impl Iterator<Item = (&'static str, Option<&serde_json::value::RawValue>)> {
        self.0.iter().map(|(sql, rows)| (*sql, rows.as_deref()))
    }

    /// Whether no part has rows.
    pub(crate) fn is_idle(&self) -> bool {
        self.0.iter().all(|(_, rows)| rows.is_none())
    }

    /// The statements as one text, the `k`th (from 1) reading `$k`.
    pub(crate) fn joined(&self) -> String {
        let mut text = String::new();
        for (k, (sql, _)) in self.0.iter().enumerate() {
            if k > 0 {
                text.push_str(";\n");
            }
            renumbered(sql, k + 1, &mut text);
        }
        text
    }
}

/// `sql` with its parameter `$1` written `$k` (a `$1` followed by a digit
/// is another parameter, kept).
fn renumbered(sql: &str, k: usize, out: &mut String) {
    use std::fmt::Write;
    let mut rest = sql;
    let mut found = false;
    while let Some(at) = rest.find("$1") {
        out.push_str(&rest[..at]);
        rest = &rest[at + 2..];
        if rest.starts_with(|c: char| c.is_ascii_digit()) {
            out.push_str("$1");
        } else {
            found = true;
            let _ = write!(out, "${k}");
        }
    }
    // A part that read no `$1` would leave the next one's rows unread.
    debug_assert!(found, "a write reads no `$1`: {sql}");
    out.push_str(rest);
}

/// A statement text built on first use, then reused: the hot statements
/// (batches, counters, claims) are not formatted again on every call.
pub struct Cached(OnceLock<String>);

impl Cached {
    const fn new() -> Self {
        Cached(OnceLock::new())
    }

    /// The text, built by `build` the first time.
    pub(crate) fn get(&'static self, build: impl FnOnce() -> String) -> &'static str {
        self.0.get_or_init(build).as_str()
    }
}

/// One backend's cached statement texts, one slot per statement.
pub struct Statements {
    pub(crate) record_counts: Cached,
    pub(crate) provider_counts: Cached,
    pub(crate) step_counts: Cached,
    pub(crate) group_counts: Cached,
    pub(crate) insert_event: Cached,
    pub(crate) insert_events: Cached,
    pub(crate) insert_records_at_once: Cached,
    pub(crate) upsert_steps: Cached,
    pub(crate) insert_steps: Cached,
    pub(crate) insert_attempts: Cached,
    pub(crate) lock_records: Cached,
    pub(crate) lock_ids: Cached,
    pub(crate) update_records: Cached,
    pub(crate) update_records_in_place: Cached,
    pub(crate) insert_records: Cached,
    pub(crate) step_runs_of: Cached,
    pub(crate) claim: Cached,
    pub(crate) index_records: Cached,
    pub(crate) insert_notices: Cached,
    pub(crate) delete_intents: Cached,
    pub(crate) callbacks_done: Cached,
}

impl Statements {
    /// Empty slots, for a backend's `static`.
    pub(crate) const fn new() -> Self {
        Statements {
            record_counts: Cached::new(),
            provider_counts: Cached::new(),
            step_counts: Cached::new(),
            group_counts: Cached::new(),
            insert_event: Cached::new(),
            insert_events: Cached::new(),
            insert_records_at_once: Cached::new(),
            upsert_steps: Cached::new(),
            insert_steps: Cached::new(),
            insert_attempts: Cached::new(),
            lock_records: Cached::new(),
            lock_ids: Cached::new(),
            update_records: Cached::new(),
            update_records_in_place: Cached::new(),
            insert_records: Cached::new(),
            step_runs_of: Cached::new(),
            claim: Cached::new(),
            index_records: Cached::new(),
            insert_notices: Cached::new(),
            delete_intents: Cached::new(),
            callbacks_done: Cached::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Writes;

    /// Each statement reads its own parameter in the joined text; a part
    /// with no rows keeps its place (and its number), with no rows.
    #[test]
    fn writes_join_with_each_part_on_its_own_parameter() {
        let mut w = Writes::default();
        w.add("INSERT INTO a SELECT value->>0 FROM jsonb_each($1)", &[1])
            .unwrap();
        assert!(!w.is_idle());
        w.add::<i64>(
            "DELETE FROM b WHERE id IN (SELECT value FROM jsonb_each($1))",
            &[],
        )
        .unwrap();
        w.add(
            "UPDATE c SET x = value->'$[0]' FROM jsonb_each($1) WHERE $12 = $1",
            &["x"],
        )
        .unwrap();
        assert_eq!(
            w.joined(),
            "INSERT INTO a SELECT value->>0 FROM jsonb_each($1);\n\
             DELETE FROM b WHERE id IN (SELECT value FROM jsonb_each($2));\n\
             UPDATE c SET x = value->'$[0]' FROM jsonb_each($3) WHERE $12 = $3"
        );
        let rows: Vec<Option<&str>> = w.parts().map(|(_, rows)| rows.map(|r| r.get())).collect();
        assert_eq!(rows, [Some("[1]"), None, Some("[\"x\"]")]);
        let mut idle = Writes::default();
        idle.add::<i64>(
            "DELETE FROM b WHERE id IN (SELECT value FROM jsonb_each($1))",
            &[],
        )
        .unwrap();
        assert!(idle.is_idle());
    }
}
