//! The store both backends share: [`SqlStore`], generic over the backend's
//! [`SqlDb`], and the writes it makes inside a transaction (the pieces the
//! aggregates' implementations, `records.rs` to `housekeeping.rs`, are
//! built from).

use std::sync::Arc;

use serde_json::Value;

use crate::auth::seal::{Field, Keyring};
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Pool, Transaction, Type};

use super::backend::{BindJson, RowsAffected, SqlDb, Writes};
use super::batch;
use super::counts::CountDeltas;
use super::rows::{MapRow, RECORD_COLUMNS, ROLLUP_COLUMNS, STEP_COLUMNS, map_all, map_sealed};
use super::{ActionRequest, Created, EventRow, NewRecord, StepRollup, StoreError, StoreResult};
use crate::domain::action::{self, Plan, StepChange};
use crate::domain::park::ParkUntil;
use crate::domain::reversal::ReversedSteps;
use crate::domain::{Event, Record, RecordState, StepRun, Trigger, UnixMs, transition};

/// A write transaction.
pub(crate) type Tx<DB> = Transaction<'static, DB>;

/// Records and everything else, in the database `DB` reaches
/// ([`SqliteStore`](super::SqliteStore) or [`PgStore`](super::PgStore)).
pub struct SqlStore<DB: SqlDb> {
    pub(crate) pools: DB::Pools,
    /// This installation's id, read once.
    pub(crate) installation: Arc<tokio::sync::OnceCell<String>>,
    /// The data keys values are sealed with at rest (`auth::seal`).
    pub(crate) keys: Keys,
    /// What the `[[notify]]` subscriptions want: changes they want are
    /// written to the outbox in their own transaction.
    pub(crate) filters: Filters,
}

/// A value the store reads on every use and a reload replaces whole
/// (the data keys, the subscriptions' filters).
pub(crate) struct Swap<T>(Arc<std::sync::RwLock<Arc<T>>>);

impl<T> Clone for Swap<T> {
    fn clone(&self) -> Self {
        Swap(self.0.clone())
    }
}

impl<T: Default> Default for Swap<T> {
    fn default() -> Self {
        Swap::new(Arc::default())
    }
}

impl<T> Swap<T> {
    pub(crate) fn new(value: Arc<T>) -> Self {
        Swap(Arc::new(std::sync::RwLock::new(value)))
    }

    pub(crate) fn get(&self) -> Arc<T> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set(&self, value: Arc<T>) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = value;
    }
}

/// The data keys a store seals and opens values with.
pub(crate) type Keys = Swap<Keyring>;

/// What the `[[notify]]` subscriptions want.
pub(crate) type Filters = Swap<Vec<crate::domain::notify::Filter>>;

impl<DB: SqlDb> SqlStore<DB> {
    /// A store over `pools`, sealing with `keys`.
    pub(crate) fn new(pools: DB::Pools, keys: Arc<Keyring>) -> Self {
        SqlStore {
            pools,
            installation: Arc::default(),
            keys: Keys::new(keys),
            filters: Filters::default(),
        }
    }

    /// The data keys as they are now.
    pub(crate) fn keyring(&self) -> Arc<Keyring> {
        self.keys.get()
    }

    pub(crate) fn reader(&self) -> &Pool<DB> {
        DB::reader(&self.pools)
    }

    pub(crate) async fn begin_write(&self) -> Result<Tx<DB>, sqlx::Error> {
        DB::begin_write(&self.pools).await
    }
}

// Written out rather than derived: a derive would ask `DB` itself (the
// `sqlx::Sqlite` marker) to be `Clone` and `Debug`.
impl<DB: SqlDb> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        SqlStore {
            pools: self.pools.clone(),
            installation: self.installation.clone(),
            keys: self.keys.clone(),
            filters: self.filters.clone(),
        }
    }
}

impl<DB: SqlDb> std::fmt::Debug for SqlStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("pools", &self.pools)
            .field("installation", &self.installation)
            .finish()
    }
}

/// The two tables of step statistics: per node and minute, as the nodes
/// write them, and per node and hour, as the minutes are folded.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rollups {
    Minutes,
    Hours,
}

impl Rollups {
    fn table(self) -> &'static str {
        match self {
            Rollups::Minutes => "step_rollups",
            Rollups::Hours => "step_rollup_hours",
        }
    }

    /// The column of the rows' time (a minute's or an hour's start).
    fn time(self) -> &'static str {
        match self {
            Rollups::Minutes => "minute",
            Rollups::Hours => "hour",
        }
    }

    /// The table's columns, in the order [`ROLLUP_COLUMNS`] names them.
    fn columns(self) -> String {
        ROLLUP_COLUMNS.replacen("minute", self.time(), 1)
    }

    /// Its columns read as [`MapRow::rollup`] reads them.
    pub(crate) fn select(self) -> String {
        ROLLUP_COLUMNS.replacen("minute", &format!("{} AS minute", self.time()), 1)
    }
}

/// Maps a unique-constraint violation to `Conflict`.
pub(crate) fn conflict_or(e: sqlx::Error, what: &'static str, key: &str) -> StoreError {
    match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict {
            what,
            key: key.to_owned(),
        },
        _ => StoreError::Database(e),
    }
}

// The bounds below say that sqlx can run statements on `DB`'s connections
// and bind and read the Rust types the store uses; both backends meet them.
// They are repeated on each aggregate's implementation (`records.rs`,
// `history.rs`, `work.rs`, `cluster.rs`, `people.rs`, `housekeeping.rs`;
// see `SqlDb` for why they cannot live in one trait).
impl<DB> SqlStore<DB>
where
    DB: SqlDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    usize: ColumnIndex<DB::Row>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB>,
    for<'q> i32: Decode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Json<Value>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<Json<Value>>: Encode<'q, DB>,
{
    /// Asks `domain::account` whether `change` of user `id` may be made,
    /// inside the transaction that makes it, with the user and the enabled
    /// admins locked (PostgreSQL): of two admins demoting each other at
    /// once, the second finds one admin left and is refused. SQLite's one
    /// writer already excludes the other change.
    pub(crate) async fn check_user_change(
        tx: &mut Tx<DB>,
        id: i64,
        change: &super::UserChange,
    ) -> StoreResult<()> {
        let (admins, user) = Self::lock_admins_and(tx, id).await?;
        crate::domain::account::check_change(&admins, &user, change)?;
        Ok(())
    }

    /// Locks the enabled admins (their ids returned) and then user `id`
    /// (returned as it is now), in the caller's transaction.
    pub(crate) async fn lock_admins_and(
        tx: &mut Tx<DB>,
        id: i64,
    ) -> StoreResult<(Vec<i64>, crate::domain::User)> {
        // The admins first, in id order, then the user: every change locks
        // in that order, so two of them wait for each other rather than
        // deadlock (a waiting one then reads the other's change).
        let sql = format!(
            "SELECT id FROM users WHERE role = 'admin' AND disabled = $1 ORDER BY id{}",
            DB::LOCK
        );
        let admins: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(false)
            .fetch_all(&mut **tx)
            .await?;
        let sql = format!(
            "SELECT {} FROM users WHERE id = $1{}",
            super::rows::USER_COLUMNS,
            DB::LOCK
        );
        let user = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "user",
                key: id.to_string(),
            })?
            .user()?;
        Ok((admins, user))
    }

    /// Creates `user`; with `first_only`, only while there is no user at
    /// all, atomically with that check (`People::create_first_user`).
    pub(crate) async fn insert_user(
        &self,
        user: &super::NewUser,
        now: crate::domain::UnixMs,
        first_only: bool,
    ) -> StoreResult<Option<crate::domain::User>> {
        super::validate_username(&user.username)?;
        if let Err(m) = user.pipelines.check_role(user.role) {
            return Err(StoreError::Invalid(m));
        }
        let mut tx = self.begin_write().await?;
        // SQLite's write transaction already excludes every other writer;
        // PostgreSQL's would not see an insert not yet committed.
        if let (true, Some(lock)) = (first_only, DB::LOCK_USERS) {
            sqlx::query(lock).execute(&mut *tx).await?;
        }
        let sql = format!(
            "INSERT INTO users (username, password_hash, role, disabled, created_at, updated_at, pipelines, unmask) \
             SELECT $1, $2, $3, $4, $5, $5, $7, $8 WHERE $6 OR NOT EXISTS (SELECT 1 FROM users) \
             RETURNING {}",
            super::rows::USER_COLUMNS
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(user.username.clone())
            .bind(user.password_hash.clone())
            .bind(user.role.as_str())
            .bind(false)
            .bind(now)
            .bind(!first_only)
            .bind(user.pipelines.stored())
            .bind(user.unmask)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| conflict_or(e, "user", &user.username))?;
        let created = row.as_ref().map(MapRow::user).transpose()?;
        tx.commit().await?;
        Ok(created)
    }

    /// A user for `person`'s first sign-in, with a password no hash
    /// matches (`!`: not a PHC string), in the caller's transaction.
    pub(crate) async fn insert_signed_on(
        tx: &mut Tx<DB>,
        person: &super::SignOnUser,
        now: crate::domain::UnixMs,
    ) -> StoreResult<crate::domain::User> {
        super::validate_username(&person.username)?;
        let sql = format!(
            "INSERT INTO users (username, password_hash, role, disabled, created_at, updated_at, \
             pipelines, unmask, oidc_issuer, oidc_subject) \
             VALUES ($1, '!', $2, $3, $4, $4, $5, $6, $7, $8) RETURNING {}",
            super::rows::USER_COLUMNS
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(person.username.clone())
            .bind(person.role.as_str())
            .bind(false)
            .bind(now)
            .bind(person.pipelines.stored())
            .bind(person.unmask)
            .bind(person.issuer.clone())
            .bind(person.subject.clone())
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| conflict_or(e, "user", &person.username))?;
        row.user()
    }

    /// Gives `user` what `person`'s groups grant now, in the caller's
    /// transaction: their sessions are revoked, and, if the role changed,
    /// the tokens they made. Refused (`LastAdmin`) when it would leave no
    /// enabled admin.
    pub(crate) async fn regrant(
        tx: &mut Tx<DB>,
        user: &crate::domain::User,
        person: &super::SignOnUser,
        now: crate::domain::UnixMs,
    ) -> StoreResult<crate::domain::User> {
        // The last enabled admin stays one, whatever the provider says.
        let (admins, mut locked) = Self::lock_admins_and(tx, user.id).await?;
        let role_changes = locked.role != person.role;
        locked.pipelines = person.pipelines.clone();
        let change = super::UserChange::Role(person.role);
        crate::domain::account::check_change(&admins, &locked, &change)?;
        let sql = format!(
            "UPDATE users SET role = $1, pipelines = $2, unmask = $3, updated_at = $4 \
             WHERE id = $5 RETURNING {}",
            super::rows::USER_COLUMNS
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(person.role.as_str())
            .bind(person.pipelines.stored())
            .bind(person.unmask)
            .bind(now)
            .bind(user.id)
            .fetch_one(&mut **tx)
            .await?;
        sqlx::query(
            "UPDATE sessions SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL",
        )
        .bind(now)
        .bind(user.id)
        .execute(&mut **tx)
        .await?;
        if role_changes {
            sqlx::query(
                "UPDATE api_tokens SET revoked_at = $1 WHERE created_by = $2 AND revoked_at IS NULL",
            )
            .bind(now)
            .bind(user.username.clone())
            .execute(&mut **tx)
            .await?;
        }
        row.user()
    }

    /// Writes a purge run's audit entry with `batch` of `pipeline` added,
    /// or updates the run's entry: in the batch's transaction, so the
    /// entry says exactly what went. Nothing when the batch is empty.
    pub(crate) async fn audit_purge(
        &self,
        tx: &mut Tx<DB>,
        run: &super::PurgeRun,
        pipeline: &str,
        batch: &super::Purged,
    ) -> StoreResult<Option<i64>> {
        if batch.is_empty() {
            return Ok(run.event);
        }
        let mut after = run.clone();
        after.record(pipeline, batch, None);
        let total = after.total();
        let reason = format!(
            "retention: {} finished records, {} attempts and {} events deleted; {} attempts' excerpts blanked",
            total.records, total.attempts, total.events, total.stripped
        );
        let detail = serde_json::to_value(&after.report)
            .map_err(|e| StoreError::Invalid(format!("purge report: {e}")))?;
        match run.event {
            Some(id) => {
                let detail = self
                    .keyring()
                    .seal_json(Field::Detail, &detail)?
                    .into_owned();
                sqlx::query("UPDATE events SET reason = $1, detail = $2 WHERE id = $3")
                    .bind(reason)
                    .bind(Json(detail))
                    .bind(id)
                    .execute(&mut **tx)
                    .await?;
                Ok(Some(id))
            }
            None => {
                let e = self
                    .insert_event(
                        tx,
                        &super::EventRow {
                            record_id: None,
                            at: run.at,
                            kind: "purge",
                            actor: &run.actor,
                            audit: true,
                            from: None,
                            to: None,
                            step: None,
                            reason: Some(&reason),
                            detail: Some(&detail),
                            claimed_at: None,
                            claimed_by: None,
                        },
                    )
                    .await?;
                Ok(Some(e.id))
            }
        }
    }

    /// Writes rollup rows into `into`, replacing the rows of the same key.
    pub(crate) async fn put_rollups(
        tx: &mut Tx<DB>,
        into: Rollups,
        rows: &[StepRollup],
    ) -> StoreResult<()> {
        let sql = format!(
            "INSERT INTO {} ({}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) \
             ON CONFLICT ({}, node, pipeline, step, provider) DO UPDATE SET \
               calls = excluded.calls, succeeded = excluded.succeeded, failed = excluded.failed, \
               retried = excluded.retried, unknown = excluded.unknown, \
               records_succeeded = excluded.records_succeeded, records_failed = excluded.records_failed, \
               records_parked = excluded.records_parked, latency = excluded.latency, \
               runs_succeeded = excluded.runs_succeeded, runs_failed = excluded.runs_failed, \
               run_latency = excluded.run_latency",
            into.table(),
            into.columns(),
            into.time()
        );
        for r in rows {
            let latency = serde_json::to_string(&r.latency)
                .map_err(|e| StoreError::Invalid(e.to_string()))?;
            let run_latency = serde_json::to_string(&r.run_latency)
                .map_err(|e| StoreError::Invalid(e.to_string()))?;
            sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                .bind(r.minute)
                .bind(r.node.clone())
                .bind(r.pipeline.clone())
                .bind(r.step.clone())
                .bind(r.provider.clone())
                .bind(r.calls)
                .bind(r.succeeded)
                .bind(r.failed)
                .bind(r.retried)
                .bind(r.unknown)
                .bind(r.records_succeeded)
                .bind(r.records_failed)
                .bind(r.records_parked)
                .bind(latency)
                .bind(r.runs_succeeded)
                .bind(r.runs_failed)
                .bind(run_latency)
                .execute(&mut **tx)
                .await?;
        }
        Ok(())
    }

    /// Folds the minute rows in `[hour, end)` (all in the hour starting at
    /// `hour`) into that hour's rows, in one transaction; returns how many
    /// minute rows. The minute rows folded are exactly those the DELETE
    /// took (a row written meanwhile is folded next time, never deleted
    /// unread), and its row locks order compactions running at once on
    /// several nodes: the second waits, skips the rows the first deleted,
    /// and reads the hour rows after the first has written them.
    pub(crate) async fn compact_hour(&self, hour: UnixMs, end: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "DELETE FROM step_rollups WHERE minute >= $1 AND minute < $2 RETURNING {}",
            Rollups::Minutes.select()
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(hour)
            .bind(end)
            .fetch_all(&mut *tx)
            .await?;
        let minutes = map_all(&rows, MapRow::rollup)?;
        if minutes.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "SELECT {} FROM step_rollup_hours WHERE hour = $1{}",
            Rollups::Hours.select(),
            DB::LOCK
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(hour)
            .fetch_all(&mut *tx)
            .await?;
        type Key = (String, String, String, String);
        let key = |r: &StepRollup| {
            (
                r.node.clone(),
                r.pipeline.clone(),
                r.step.clone(),
                r.provider.clone(),
            )
        };
        let mut hours: std::collections::BTreeMap<Key, StepRollup> =
            map_all(&rows, MapRow::rollup)?
                .into_iter()
                .map(|r| (key(&r), r))
                .collect();
        for m in &minutes {
            hours
                .entry(key(m))
                .or_insert_with(|| StepRollup {
                    minute: hour,
                    node: m.node.clone(),
                    pipeline: m.pipeline.clone(),
                    step: m.step.clone(),
                    provider: m.provider.clone(),
                    ..StepRollup::default()
                })
                .add(m);
        }
        let hours: Vec<StepRollup> = hours.into_values().collect();
        Self::put_rollups(&mut tx, Rollups::Hours, &hours).await?;
        tx.commit().await?;
        Ok(minutes.len() as u64)
    }

    /// The records of `ids` (those that exist), newest first, in one
    /// statement.
    pub(crate) async fn records_by_ids(&self, ids: &[i64]) -> StoreResult<Vec<Record>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM records WHERE id {} ORDER BY id DESC",
            Self::in_ids()
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind_json(ids)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::record)
    }

    /// `IN` a JSON array of ids bound as `$1`, through the key's index
    /// (see [`SqlDb::ANY_OF`]).
    pub(crate) fn in_ids() -> String {
        format!(
            "{}SELECT CAST(value AS BIGINT) FROM {}{}",
            DB::ANY_OF.0,
            DB::DIALECT.rows(),
            DB::ANY_OF.1
        )
    }

    /// Adds counter deltas inside the caller's transaction: one
    /// upsert per counter table (the deltas are unique per key, so
    /// no row is touched twice by one statement), the tables always in
    /// this order, as in `ballast_insert_records` (no deadlock between
    /// two writers taking counter rows in opposite orders).
    pub(crate) async fn apply_counts(tx: &mut Tx<DB>, deltas: &CountDeltas) -> StoreResult<()> {
        let mut writes = Writes::default();
        Self::counts_write(deltas, &mut writes)?;
        DB::run_writes(tx, &writes).await
    }

    /// [`apply_counts`](Self::apply_counts)' statements, added to `writes`.
    pub(crate) fn counts_write(deltas: &CountDeltas, writes: &mut Writes) -> StoreResult<()> {
        let shard = DB::counter_shard();
        fn named<'a>(
            rows: impl Iterator<Item = (&'a str, RecordState, i64)>,
            shard: i32,
        ) -> Vec<batch::CountJson<'a>> {
            rows.map(|(name, state, n)| batch::CountJson {
                name,
                state: state.as_str(),
                shard,
                n,
            })
            .collect()
        }
        let statements = DB::statements();
        let sql = statements
            .record_counts
            .get(|| Self::counts_sql("record_counts", "pipeline"));
        writes.add(sql, &named(deltas.nonzero(), shard))?;
        let sql = statements
            .provider_counts
            .get(|| Self::counts_sql("provider_counts", "provider"));
        writes.add(sql, &named(deltas.provider_nonzero(), shard))?;
        let steps: Vec<batch::StepCountJson<'_>> = deltas
            .step_nonzero()
            .map(|(pipeline, step, state, n)| batch::StepCountJson {
                pipeline,
                step,
                state: state.as_str(),
                shard,
                n,
            })
            .collect();
        let sql = statements.step_counts.get(|| {
            batch::insert(
                "step_counts",
                batch::STEP_COUNT_COLS,
                DB::DIALECT,
                "ON CONFLICT (pipeline, step, state, shard) DO UPDATE SET n = step_counts.n + excluded.n",
            )
        });
        writes.add(sql, &steps)?;
        let groups: Vec<batch::GroupCountJson<'_>> = deltas
            .group_nonzero()
            .map(|(pipeline, group_key, state, n)| batch::GroupCountJson {
                pipeline,
                group_key,
                state: state.as_str(),
                shard,
                n,
            })
            .collect();
        let sql = statements.group_counts.get(|| {
            batch::insert(
                "group_counts",
                batch::GROUP_COUNT_COLS,
                DB::DIALECT,
                "ON CONFLICT (pipeline, group_key, state, shard) DO UPDATE SET n = group_counts.n + excluded.n",
            )
        });
        writes.add(sql, &groups)
    }

    /// The counter upsert into `table`, whose key column is `key`.
    pub(crate) fn counts_sql(table: &str, key: &str) -> String {
        format!(
            "INSERT INTO {table} ({key}, state, shard, n) SELECT {} FROM {} WHERE true ORDER BY key \
             ON CONFLICT ({key}, state, shard) DO UPDATE SET n = {table}.n + excluded.n",
            batch::select(batch::COUNT_COLS, DB::DIALECT),
            DB::DIALECT.rows()
        )
    }

    /// Appends one event inside the caller's transaction and
    /// returns it as stored; the notices it makes with it.
    pub(crate) async fn insert_event(
        &self,
        tx: &mut Tx<DB>,
        e: &EventRow<'_>,
    ) -> StoreResult<Event> {
        let sql = DB::statements().insert_event.get(|| batch::insert("events", batch::EVENT_COLS, DB::DIALECT,
            "RETURNING id, record_id, at, kind, actor, audit, from_state, to_state, step, reason, detail"
        ));
        let row = sqlx::query(sql)
            .bind_json([batch::EventJson::new(e, &self.keyring())?])
            .fetch_one(&mut **tx)
            .await?;
        self.notice_events(tx, std::slice::from_ref(e)).await?;
        row.event(&self.keyring())
    }

    /// Makes sure `provider` has a row and locks it until the caller's
    /// transaction ends: changes to a provider's shared state (breaker,
    /// grants) are made one at a time.
    pub(crate) async fn lock_provider(
        tx: &mut Tx<DB>,
        provider: &str,
        now: UnixMs,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO providers (provider, breaker, breaker_changed_at, updated_at) \
             VALUES ($1, 'closed', $2, $2) ON CONFLICT (provider) DO NOTHING",
        )
        .bind(provider.to_owned())
        .bind(now)
        .execute(&mut **tx)
        .await?;
        let sql = format!(
            "SELECT provider FROM providers WHERE provider = $1{}",
            DB::LOCK
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(provider.to_owned())
            .fetch_one(&mut **tx)
            .await?;
        Ok(())
    }

    /// A provider's grants in one window (`domain::permits`).
    pub(crate) async fn grant_rows(
        tx: &mut Tx<DB>,
        provider: &str,
        window_ms: i64,
    ) -> StoreResult<Vec<crate::domain::permits::GrantRow>> {
        let rows = sqlx::query(
            "SELECT id, node, window_ms, count, wanted, granted_at, expires_at, done_at \
             FROM provider_grants WHERE provider = $1 AND window_ms = $2",
        )
        .bind(provider.to_owned())
        .bind(window_ms)
        .fetch_all(&mut **tx)
        .await?;
        map_all(&rows, MapRow::grant_row)
    }

    pub(crate) async fn lock_record(
        &self,
        tx: &mut Tx<DB>,
        id: i64,
    ) -> StoreResult<Option<Record>> {
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM records WHERE id = $1{}",
            DB::LOCK
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?;
        row.as_ref().map(|r| r.record(&self.keyring())).transpose()
    }

    /// [`lock_record`](Self::lock_record), a missing record `NotFound`.
    pub(crate) async fn lock_found(&self, tx: &mut Tx<DB>, id: i64) -> StoreResult<Record> {
        self.lock_record(tx, id)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "record",
                key: id.to_string(),
            })
    }

    pub(crate) async fn upsert_step(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        record_id: i64,
        s: &crate::store::StepWrite,
        now: UnixMs,
    ) -> StoreResult<()> {
        self.upsert_steps(tx, installation, &[(record_id, s, now)])
            .await
    }

    /// Writes step runs in one upsert; one row per (record, step) in
    /// `steps`.
    pub(crate) async fn upsert_steps(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        steps: &[(i64, &crate::store::StepWrite, UnixMs)],
    ) -> StoreResult<()> {
        let mut writes = Writes::default();
        self.steps_write(installation, steps, false, &mut writes)?;
        DB::run_writes(tx, &writes).await
    }

    /// Step runs in one statement, added to `writes`: an upsert, or for
    /// runs not stored yet (`new`, `Commit::new_steps`) a plain insert,
    /// with no conflict to look for (on PostgreSQL an upsert's speculative
    /// insertion costs more).
    pub(crate) fn steps_write(
        &self,
        installation: &str,
        steps: &[(i64, &crate::store::StepWrite, UnixMs)],
        new: bool,
        writes: &mut Writes,
    ) -> StoreResult<()> {
        let keys = self.keyring();
        let rows: Vec<batch::StepJson<'_>> = steps
            .iter()
            .map(|(record_id, s, now)| {
                batch::StepJson::new(installation, *record_id, s, *now, &keys)
            })
            .collect::<Result<_, _>>()?;
        let statements = DB::statements();
        if new {
            let sql = (statements.insert_steps)
                .get(|| batch::insert("step_runs", batch::STEP_COLS, DB::DIALECT, ""));
            return writes.add(sql, &rows);
        }
        let sql = statements.upsert_steps.get(|| batch::insert("step_runs", batch::STEP_COLS, DB::DIALECT,
            "ON CONFLICT (record_id, step) DO UPDATE SET state = excluded.state, provider = excluded.provider, \
               unknowns = excluded.unknowns, \
               generation = excluded.generation, attempts = excluded.attempts, \
               idempotency_key = excluded.idempotency_key, job_id = excluded.job_id, \
               output = excluded.output, error_code = excluded.error_code, reason = excluded.reason, \
               next_run_at = excluded.next_run_at, deadline_at = excluded.deadline_at, \
               started_at = excluded.started_at, finished_at = excluded.finished_at, \
               updated_at = excluded.updated_at"
        ));
        writes.add(sql, &rows)
    }

    /// Appends attempts in one insert, added to `writes`.
    pub(crate) fn attempts_write(
        &self,
        attempts: &[(i64, &crate::store::NewAttempt)],
        writes: &mut Writes,
    ) -> StoreResult<()> {
        let keys = self.keyring();
        let rows: Vec<batch::AttemptJson<'_>> = attempts
            .iter()
            .map(|(record_id, a)| batch::AttemptJson::new(*record_id, a, &keys))
            .collect::<Result<_, _>>()?;
        let sql = DB::statements()
            .insert_attempts
            .get(|| batch::insert("attempts", batch::ATTEMPT_COLS, DB::DIALECT, ""));
        writes.add(sql, &rows)
    }

    /// Appends events in one insert (callers that need the stored
    /// event back use `insert_event`), and the notices they make.
    pub(crate) async fn insert_events(
        &self,
        tx: &mut Tx<DB>,
        events: &[EventRow<'_>],
    ) -> StoreResult<()> {
        let mut writes = Writes::default();
        self.events_write(events, &mut writes)?;
        DB::run_writes(tx, &writes).await?;
        self.notice_events(tx, events).await
    }

    /// [`insert_events`](Self::insert_events)' statement (not the notices
    /// they make), added to `writes`.
    pub(crate) fn events_write(
        &self,
        events: &[EventRow<'_>],
        writes: &mut Writes,
    ) -> StoreResult<()> {
        let keys = self.keyring();
        let rows: Vec<batch::EventJson<'_>> = events
            .iter()
            .map(|e| batch::EventJson::new(e, &keys))
            .collect::<Result<_, _>>()?;
        let sql = DB::statements()
            .insert_events
            .get(|| batch::insert("events", batch::EVENT_COLS, DB::DIALECT, ""));
        writes.add(sql, &rows)
    }

    /// Reads and (on PostgreSQL) locks records, in id order, so that
    /// two multi-row writers can never deadlock.
    pub(crate) async fn lock_records(
        &self,
        tx: &mut Tx<DB>,
        ids: &[i64],
    ) -> StoreResult<std::collections::HashMap<i64, Record>> {
        let sql = DB::statements()
            .lock_records
            .get(|| Self::lock_sql(RECORD_COLUMNS));
        let rows = sqlx::query(sql).bind_json(ids).fetch_all(&mut **tx).await?;
        let mut out = std::collections::HashMap::with_capacity(ids.len());
        for row in &rows {
            let rec = MapRow::record(row, &self.keyring())?;
            out.insert(rec.id, rec);
        }
        Ok(out)
    }

    /// Locks the records of `ids` in id order and reads nothing back: a
    /// lock taken for its order alone, where [`Self::lock_records`] would
    /// decode (and open the sealed input of) every row.
    pub(crate) async fn lock_ids(tx: &mut Tx<DB>, ids: &[i64]) -> StoreResult<()> {
        let sql = DB::statements().lock_ids.get(|| Self::lock_sql("id"));
        sqlx::query(sql).bind_json(ids).fetch_all(&mut **tx).await?;
        Ok(())
    }

    /// `columns` of the records of the ids in `$1` (a JSON array), their
    /// rows locked in id order.
    fn lock_sql(columns: &str) -> String {
        format!(
            "SELECT {columns} FROM records WHERE id {}SELECT CAST(value AS BIGINT) FROM {}{} ORDER BY id{}",
            DB::ANY_OF.0,
            DB::DIALECT.rows(),
            DB::ANY_OF.1,
            DB::LOCK
        )
    }

    /// Makes the records of `ids` that are waiting due at `now`, and tells
    /// the workers when any was.
    pub(crate) async fn wake_all(tx: &mut Tx<DB>, ids: &[i64], now: UnixMs) -> StoreResult<()> {
        let mut woke = false;
        for id in ids {
            let done = sqlx::query(
                "UPDATE records SET next_run_at = $1 WHERE id = $2 AND state = 'waiting'",
            )
            .bind(now)
            .bind(*id)
            .execute(&mut **tx)
            .await?;
            woke |= done.rows_affected() > 0;
        }
        if woke {
            DB::notify_work(tx).await?;
        }
        Ok(())
    }

    /// Makes each record of `ids` (committed waiting) due at `now` when a
    /// step of it waits on a child (its job id) that came to rest since:
    /// any end for a step `awaiting_child`, an end other than parked for
    /// one already `child_parked`.
    pub(crate) async fn wake_for_children(
        tx: &mut Tx<DB>,
        ids: &[i64],
        now: UnixMs,
    ) -> StoreResult<()> {
        use crate::domain::child::{AWAITING, PARKED};
        let mut woke = false;
        for id in ids {
            let done = sqlx::query(
                "UPDATE records SET next_run_at = $1 WHERE id = $2 AND state = 'waiting' AND EXISTS (\
                   SELECT 1 FROM records c JOIN step_runs s \
                     ON s.record_id = $2 AND s.job_id = CAST(c.id AS TEXT) \
                   WHERE c.parent_id = $2 AND s.state = 'waiting' AND (\
                     (s.error_code = $3 AND c.state IN ('succeeded', 'failed', 'parked', 'cancelled')) \
                     OR (s.error_code = $4 AND c.state IN ('succeeded', 'failed', 'cancelled'))))",
            )
            .bind(now)
            .bind(*id)
            .bind(AWAITING)
            .bind(PARKED)
            .execute(&mut **tx)
            .await?;
            woke |= done.rows_affected() > 0;
        }
        if woke {
            DB::notify_work(tx).await?;
        }
        Ok(())
    }

    /// Writes `intents` (no two with the same record, step and attempt),
    /// each only if its worker still holds the record's lease: its id, or
    /// `LeaseLost`.
    pub(crate) async fn insert_intents(
        &self,
        tx: &mut Tx<DB>,
        intents: &[&crate::store::NewIntent],
    ) -> StoreResult<Vec<StoreResult<i64>>> {
        let keys = self.keyring();
        let rows: Vec<super::batch::IntentJson<'_>> = intents
            .iter()
            .map(|i| super::batch::IntentJson::new(i, &keys))
            .collect::<Result<_, _>>()?;
        // Fenced by the lease: a worker that lost it (a stalled node whose
        // record another claimed) writes nothing and so calls nothing; the
        // record's row is locked so that no claim moves it meanwhile.
        let sql = format!(
            "WITH v AS (SELECT {} FROM {}) \
             INSERT INTO attempt_intents (record_id, step, provider, attempt_no, node, sent_at, request) \
             SELECT v.record_id, v.step, v.provider, v.attempt_no, v.node, v.sent_at, v.request FROM v \
             WHERE EXISTS (SELECT 1 FROM records r WHERE r.id = v.record_id AND r.state = 'running' \
               AND r.lease_owner = v.lease_owner AND r.lease_token = v.lease_token{}) \
             RETURNING id, record_id, step, attempt_no",
            super::batch::select_as(super::batch::INTENT_COLS, DB::DIALECT),
            DB::DIALECT.rows(),
            DB::LOCK
        );
        let returned = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind_json(&rows)
            .fetch_all(&mut **tx)
            .await?;
        // Each row by what it is: (record, step, attempt) → its id.
        let written = returned
            .iter()
            .map(|r| {
                use sqlx::Row;
                let key = (
                    r.try_get::<i64, _>(1)?,
                    r.try_get::<String, _>(2)?,
                    r.try_get::<i32, _>(3)?,
                );
                Ok((key, r.try_get::<i64, _>(0)?))
            })
            .collect::<Result<std::collections::HashMap<_, _>, sqlx::Error>>()?;
        Ok(intents
            .iter()
            .map(|i| {
                written
                    .get(&(i.record_id, i.step.clone(), i.attempt_no))
                    .copied()
                    .ok_or(StoreError::LeaseLost {
                        record_id: i.record_id,
                    })
            })
            .collect())
    }

    /// Deletes intents (their attempts are kept in the same transaction):
    /// one statement added to `writes`.
    pub(crate) fn intents_write(ids: &[i64], writes: &mut Writes) -> StoreResult<()> {
        let sql = DB::statements().delete_intents.get(|| {
            format!(
                "DELETE FROM attempt_intents WHERE id {}SELECT CAST(value AS BIGINT) FROM {}{}",
                DB::ANY_OF.0,
                DB::DIALECT.rows(),
                DB::ANY_OF.1
            )
        });
        writes.add(sql, ids)
    }

    /// Marks webhook deliveries `(record, delivery, at)` processed, as
    /// applied to their record, added to `writes`.
    pub(crate) fn callbacks_write(
        done: &[(i64, i64, UnixMs)],
        writes: &mut Writes,
    ) -> StoreResult<()> {
        let sql = DB::statements().callbacks_done.get(|| {
            format!(
                "WITH v AS (SELECT CAST(value->>0 AS BIGINT) AS record_id, \
                   CAST(value->>1 AS BIGINT) AS id, CAST(value->>2 AS BIGINT) AS at FROM {}) \
                 UPDATE callbacks SET processed_at = v.at, record_id = v.record_id \
                 FROM v WHERE callbacks.id = v.id{}",
                DB::DIALECT.rows(),
                // As `UPDATE_KEY` does for records.
                match DB::DIALECT {
                    batch::Dialect::Postgres => " AND callbacks.id = ANY(ARRAY(SELECT id FROM v))",
                    batch::Dialect::Sqlite => "",
                }
            )
        });
        writes.add(sql, done)
    }

    /// Writes the worker-owned columns of records whose rows the
    /// transaction holds, each `(before, after)`, in statements added to
    /// `writes`. On SQLite, a record whose step, provider, error code,
    /// finish and park are unchanged (a poll, a wait) has only its other
    /// columns set: SQLite rewrites the entries of every index on a column
    /// a statement sets, changed or not (about a third of such an update's
    /// cost, with its step and provider indexed); a PostgreSQL update
    /// writes every index anyway, so there one statement takes all.
    pub(crate) fn records_write(
        records: &[(&Record, &Record)],
        writes: &mut Writes,
    ) -> StoreResult<()> {
        let split = matches!(DB::DIALECT, batch::Dialect::Sqlite);
        let (mut in_place, mut moved) = (Vec::new(), Vec::with_capacity(records.len()));
        for (before, after) in records {
            let row = batch::RecordUpdateJson::from(*after);
            match split && batch::in_place(before, after) {
                true => in_place.push(row),
                false => moved.push(row),
            }
        }
        let statements = DB::statements();
        let sql = statements.update_records.get(|| {
            Self::update_sql(
                "step = v.step, provider = v.provider, error_code = v.error_code, \
                 finished_at = v.finished_at, park_until_at = v.park_until_at, \
                 park_until_provider = v.park_until_provider, ",
            )
        });
        writes.add(sql, &moved)?;
        if split {
            let sql = statements
                .update_records_in_place
                .get(|| Self::update_sql(""));
            writes.add(sql, &in_place)?;
        }
        Ok(())
    }

    /// The batched record update, setting `more` beside the columns every
    /// pass's commit changes.
    fn update_sql(more: &str) -> String {
        format!(
            "WITH v AS (SELECT {} FROM {}) \
             UPDATE records SET {more}state = v.state, next_run_at = v.next_run_at, \
               lease_owner = v.lease_owner, lease_until = v.lease_until, reason = v.reason, \
               updated_at = v.updated_at \
             FROM v WHERE records.id = v.id{}",
            batch::select_as(batch::RECORD_UPDATE_COLS, DB::DIALECT),
            DB::DIALECT.rows(),
            DB::UPDATE_KEY
        )
    }

    /// The events and counter moves of a claim: `taken` maps each
    /// claimed id to what it was taken from. A claim writes no event of
    /// its own: the event that ends the pass keeps when it was claimed
    /// (migration 34). A record taken from `running` had a lease that ran
    /// out: its `lease_expired` keeps that lapsed pass's claim.
    pub(crate) fn claim_moves<'e>(
        claimed: &[Record],
        taken: &'e std::collections::HashMap<i64, crate::store::Taken>,
        now: UnixMs,
        actor: &'e str,
    ) -> StoreResult<(Vec<EventRow<'e>>, CountDeltas)> {
        let mut events = Vec::new();
        let mut deltas = CountDeltas::default();
        for rec in claimed {
            let Some(was) = taken.get(&rec.id) else {
                return Err(StoreError::Invalid(format!(
                    "record {} was claimed from no known state",
                    rec.id
                )));
            };
            let old: RecordState = crate::store::rows::parse(&was.state, "record state")?;
            let mut from = old;
            if old == RecordState::Running {
                let to = transition(from, Trigger::LeaseExpired)?;
                events.push(EventRow {
                    record_id: Some(rec.id),
                    at: now,
                    kind: Trigger::LeaseExpired.kind(),
                    actor,
                    audit: false,
                    from: Some(from),
                    to: Some(to),
                    step: None,
                    reason: None,
                    detail: None,
                    claimed_at: was.at,
                    claimed_by: was.owner.as_deref(),
                });
                from = to;
            }
            let to = transition(from, Trigger::Claim)?;
            deltas.state_moved(rec, old, to);
        }
        Ok((events, deltas))
    }

    /// Resets `steps` to run again from scratch, each under a new
    /// generation (so a new idempotency key): replays and reruns.
    /// Schedules a confirmation (replacing one of an earlier generation).
    pub(crate) async fn put_confirmation(
        tx: &mut Tx<DB>,
        p: &crate::domain::confirm::Pending,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO step_confirmations (record_id, step, generation, due_at, remaining, tries) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (record_id, step) DO UPDATE SET \
             generation = excluded.generation, due_at = excluded.due_at, \
             remaining = excluded.remaining, tries = excluded.tries",
        )
        .bind(p.record_id)
        .bind(p.step.clone())
        .bind(i64::from(p.generation))
        .bind(p.due_at)
        .bind(i64::from(p.remaining))
        .bind(i64::from(p.tries))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Starts a new generation of each of `steps` (a new idempotency key),
    /// `cause` saying what started it. A run with a result is kept in
    /// `step_versions` first, so a result is never overwritten.
    /// [`rerun_steps`](Self::rerun_steps); an undo that starts (undo
    /// steps among `steps`) also ends the record's confirmations: a
    /// result asked about again after its undo would look reversed.
    /// `keep_items`: the first step keeps its items that succeeded.
    pub(crate) async fn run_again(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        record_id: i64,
        (steps, keep_items): (&[String], bool),
        now: UnixMs,
        cause: &str,
    ) -> StoreResult<()> {
        if steps
            .iter()
            .any(|s| crate::domain::undo::undone_step(s).is_some())
        {
            sqlx::query("DELETE FROM step_confirmations WHERE record_id = $1")
                .bind(record_id)
                .execute(&mut **tx)
                .await?;
        }
        let first = steps.first().filter(|_| keep_items).map(String::as_str);
        self.rerun_steps(tx, installation, record_id, (steps, first), now, cause)
            .await
    }

    /// Keeps step `step`'s result as a version, replaced at `now` by
    /// `cause`: when it has one, or (`any`) whatever it has (a retired
    /// run, whose generation must not be used again).
    async fn keep_version(
        tx: &mut Tx<DB>,
        record_id: i64,
        step: &str,
        (now, cause, any): (UnixMs, &str, bool),
    ) -> StoreResult<()> {
        Self::keep_versions(tx, record_id, ("step", step), (now, cause, any)).await
    }

    /// [`keep_version`](Self::keep_version) of the runs whose `column`
    /// (`step`, or `item_of`: a step's items) is `name`.
    async fn keep_versions(
        tx: &mut Tx<DB>,
        record_id: i64,
        (column, name): (&'static str, &str),
        (now, cause, any): (UnixMs, &str, bool),
    ) -> StoreResult<()> {
        let sql = format!(
            "INSERT INTO step_versions (record_id, step, generation, state, output, job_id, \
               error_code, cause, started_at, finished_at, replaced_at, replaced_by) \
             SELECT record_id, step, generation, state, output, job_id, error_code, cause, \
               started_at, finished_at, $3, $4 \
             FROM step_runs WHERE record_id = $1 AND {column} = $2 AND ($5 OR output IS NOT NULL) \
             ON CONFLICT DO NOTHING"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .bind(name.to_owned())
            .bind(now)
            .bind(cause)
            .bind(any)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Runs `steps` again, each a new generation (its result kept as a
    /// version). A step run again loses the run of its undo step (kept as
    /// a version too): its new effect is not undone yet. A step for each
    /// item starts its items afresh, but the one `keeps` names (a replay
    /// of only the failed items) keeps those that succeeded.
    pub(crate) async fn rerun_steps(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        record_id: i64,
        (steps, keeps): (&[String], Option<&str>),
        now: UnixMs,
        cause: &str,
    ) -> StoreResult<()> {
        use crate::domain::each::item_of;
        use crate::domain::undo::{name_of, undone_step};
        for step in steps.iter().filter(|s| undone_step(s).is_none()) {
            let undo = name_of(step);
            Self::keep_version(tx, record_id, &undo, (now, cause, true)).await?;
            sqlx::query("DELETE FROM step_runs WHERE record_id = $1 AND step = $2")
                .bind(record_id)
                .bind(undo)
                .execute(&mut **tx)
                .await?;
        }
        // A step for each item starts its items afresh: their results kept
        // as versions; an item's run is never run again on its own.
        let steps = steps.iter().filter(|s| item_of(s).is_none());
        for step in steps {
            let keep_items = keeps == Some(step.as_str());
            if !keep_items {
                Self::keep_versions(tx, record_id, ("item_of", step), (now, cause, false)).await?;
                sqlx::query("DELETE FROM step_runs WHERE record_id = $1 AND item_of = $2")
                    .bind(record_id)
                    .bind(step.clone())
                    .execute(&mut **tx)
                    .await?;
            }
            Self::keep_version(tx, record_id, step, (now, cause, false)).await?;
            // The latest generation, kept as a run or (a retired undo run)
            // only as a version: a new one never takes an old one's key.
            let generation: Option<i32> = sqlx::query_scalar(
                "SELECT MAX(g) FROM (SELECT generation AS g FROM step_runs \
                   WHERE record_id = $1 AND step = $2 \
                 UNION ALL SELECT generation AS g FROM step_versions \
                   WHERE record_id = $1 AND step = $2) AS known",
            )
            .bind(record_id)
            .bind(step.clone())
            .fetch_one(&mut **tx)
            .await?;
            let mut write = crate::store::StepWrite::pending(step);
            write.generation = generation.map_or(0, |g| g + 1);
            self.upsert_step(tx, installation, record_id, &write, now)
                .await?;
            sqlx::query("UPDATE step_runs SET cause = $1 WHERE record_id = $2 AND step = $3")
                .bind(cause)
                .bind(record_id)
                .bind(step.clone())
                .execute(&mut **tx)
                .await?;
            if keep_items {
                let gen_cause = (write.generation, cause);
                self.rerun_failed_items(tx, installation, record_id, step, gen_cause, now)
                    .await?;
            }
        }
        Ok(())
    }

    /// The items of `step` that ended without succeeding (failed or
    /// skipped) or stopped with nothing more to wait for (no time, no
    /// child: what parked the record) start again, each a fresh run of
    /// `generation` (a new idempotency key; the old run kept as a
    /// version, its evidence included); those that succeeded stay, and
    /// those unfinished go on following their call, job or child (a new
    /// key would send them again). The step's output is built again from
    /// them all. (An uncertain call was refused before: settled first.)
    async fn rerun_failed_items(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        record_id: i64,
        step: &str,
        (generation, cause): (i32, &str),
        now: UnixMs,
    ) -> StoreResult<()> {
        let not_succeeded = format!(
            "record_id = $1 AND item_of = $2 AND (state IN ('failed', 'skipped') \
             OR ({} AND next_run_at IS NULL AND NOT {}))",
            super::records::OPEN,
            super::records::held()
        );
        let keep = format!(
            "INSERT INTO step_versions (record_id, step, generation, state, output, job_id, \
               error_code, cause, started_at, finished_at, replaced_at, replaced_by) \
             SELECT record_id, step, generation, state, output, job_id, error_code, cause, \
               started_at, finished_at, $3, $4 \
             FROM step_runs WHERE {not_succeeded} ON CONFLICT DO NOTHING"
        );
        sqlx::query(sqlx::AssertSqlSafe(keep))
            .bind(record_id)
            .bind(step.to_owned())
            .bind(now)
            .bind(cause)
            .execute(&mut **tx)
            .await?;
        let read = format!("SELECT step, provider FROM step_runs WHERE {not_succeeded}");
        let runs: Vec<(String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(read))
            .bind(record_id)
            .bind(step.to_owned())
            .fetch_all(&mut **tx)
            .await?;
        let fresh: Vec<crate::store::StepWrite> = runs
            .into_iter()
            .map(|(name, provider)| crate::store::StepWrite {
                provider,
                generation,
                ..crate::store::StepWrite::pending(&name)
            })
            .collect();
        for chunk in fresh.chunks(1_000) {
            let rows: Vec<(i64, &crate::store::StepWrite, UnixMs)> =
                chunk.iter().map(|w| (record_id, w, now)).collect();
            self.upsert_steps(tx, installation, &rows).await?;
        }
        sqlx::query(
            "UPDATE step_runs SET cause = $1 \
             WHERE record_id = $2 AND item_of = $3 AND generation = $4 AND state = 'pending'",
        )
        .bind(cause)
        .bind(record_id)
        .bind(step.to_owned())
        .bind(i64::from(generation))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// `slots` filled: each empty one (a repeated key, of a record stored
    /// before or earlier in the batch) with the stored record its key
    /// names, all read in one statement after the insert committed (it
    /// waited for each conflicting row's transaction).
    pub(crate) async fn fill_repeats(
        &self,
        batch: &[NewRecord],
        slots: Vec<Option<Created>>,
    ) -> StoreResult<Vec<Created>> {
        let keys: Vec<(&str, Option<&str>)> = slots
            .iter()
            .zip(batch)
            .filter(|(slot, _)| slot.is_none())
            .map(|(_, new)| (new.pipeline.as_str(), new.external_key.as_deref()))
            .collect();
        let mut stored = std::collections::HashMap::new();
        if !keys.is_empty() {
            // A repeat has a key; saying so lets PostgreSQL read its key
            // index, which holds keyed records only (migration 36).
            let sql = format!(
                "SELECT {RECORD_COLUMNS} FROM records WHERE external_key IS NOT NULL \
                 AND (pipeline, external_key) IN (SELECT value->>0, value->>1 FROM {})",
                DB::DIALECT.rows()
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind_json(&keys)
                .fetch_all(self.reader())
                .await?;
            for row in &rows {
                let rec = row.record(&self.keyring())?;
                stored.insert((rec.pipeline.clone(), rec.external_key.clone()), rec);
            }
        }
        let mut out = Vec::with_capacity(slots.len());
        for (slot, new) in slots.into_iter().zip(batch) {
            let created = match slot {
                Some(c) => c,
                None => {
                    let key = (new.pipeline.clone(), new.external_key.clone());
                    // Gone only if retention purged it in between.
                    let record = stored.get(&key).cloned().ok_or_else(|| {
                        StoreError::NotNow(format!(
                            "the record with key `{}` was purged while this enqueue ran; \
                             the others are stored: send the same request again (keys \
                             make that safe)",
                            new.external_key.as_deref().unwrap_or_default()
                        ))
                    })?;
                    Created {
                        record,
                        created: false,
                    }
                }
            };
            out.push(created);
        }
        Ok(out)
    }

    /// Each of `batch`'s rows with the record `inserted` for it, `None`
    /// for a repeat (of a key already stored or earlier in the batch);
    /// the inserted records counted in `deltas`.
    pub(crate) fn match_inserted(
        batch: &[NewRecord],
        mut inserted: Vec<Record>,
        mut deltas: Option<&mut CountDeltas>,
    ) -> StoreResult<Vec<Option<Created>>> {
        let mut out: Vec<Option<Created>> = batch.iter().map(|_| None).collect();
        // Ids are taken in the order of the rows (ORDER BY their
        // position), so the inserted rows, by id, are the batch minus
        // its repeats (a repeated key can never match a later
        // inserted row: its key already exists).
        inserted.sort_unstable_by_key(|r| r.id);
        let mut inserted = inserted.into_iter().peekable();
        for (slot, new) in out.iter_mut().zip(batch) {
            let next_is_this = inserted
                .peek()
                .is_some_and(|r| r.pipeline == new.pipeline && r.external_key == new.external_key);
            if next_is_this {
                if let Some(record) = inserted.next() {
                    if let Some(d) = deltas.as_deref_mut() {
                        d.inserted(&record.pipeline, record.group.as_deref());
                    }
                    *slot = Some(Created {
                        record,
                        created: true,
                    });
                }
            }
        }
        if inserted.next().is_some() {
            return Err(StoreError::Invalid(
                "inserted records did not match the batch".into(),
            ));
        }
        Ok(out)
    }

    /// Inserts `batch`'s records (ON CONFLICT DO NOTHING on the external
    /// key) and their `created` events inside the caller's transaction;
    /// the caller applies `deltas`, then fills the repeats
    /// ([`fill_repeats`](Self::fill_repeats)). In the order of `batch`.
    pub(crate) async fn insert_records(
        &self,
        tx: &mut Tx<DB>,
        batch: &[NewRecord],
        now: UnixMs,
        deltas: &mut CountDeltas,
    ) -> StoreResult<Vec<Option<Created>>> {
        let keys = self.keyring();
        let rows: Vec<batch::NewRecordJson<'_>> = batch
            .iter()
            .map(|r| batch::NewRecordJson::new(r, now, &keys))
            .collect::<Result<_, _>>()?;
        let sql = DB::statements().insert_records.get(|| {
            batch::insert(
                "records",
                batch::NEW_RECORD_COLS,
                DB::DIALECT,
                &format!(
                    "{} RETURNING {RECORD_COLUMNS}",
                    DB::DIALECT.on_key_conflict()
                ),
            )
        });
        let inserted = sqlx::query(sql)
            .bind_json(&rows)
            .fetch_all(&mut **tx)
            .await?;
        let inserted = map_sealed(&inserted, &self.keyring(), MapRow::record)?;
        let out = Self::match_inserted(batch, inserted, Some(deltas))?;
        let events: Vec<EventRow<'_>> = out
            .iter()
            .flatten()
            .map(|c| EventRow {
                record_id: Some(c.record.id),
                at: now,
                kind: "created",
                actor: crate::domain::SYSTEM_ACTOR,
                audit: false,
                from: None,
                to: Some(RecordState::Pending),
                step: None,
                reason: None,
                detail: None,
                claimed_at: None,
                claimed_by: None,
            })
            .collect();
        self.insert_events(tx, &events).await?;
        Ok(out)
    }

    /// Whether a reversal of `req.step` still applies to `rec`: always,
    /// unless it names the generation it contradicts and the step has
    /// since run again or no longer succeeded.
    pub(crate) async fn reversal_applies(
        tx: &mut Tx<DB>,
        rec: &Record,
        req: &crate::store::ReverseRequest,
    ) -> StoreResult<bool> {
        let Some(g) = req.generation else {
            return Ok(true);
        };
        let current: Option<(i64, String)> = sqlx::query_as(
            "SELECT CAST(generation AS BIGINT), state FROM step_runs WHERE record_id = $1 AND step = $2",
        )
        .bind(rec.id)
        .bind(req.step.clone())
        .fetch_optional(&mut **tx)
        .await?;
        Ok(current == Some((i64::from(g), "succeeded".to_owned())))
    }

    /// Applies a reversal's decision to the record's steps.
    pub(crate) async fn reverse_steps(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        record_id: i64,
        req: &crate::store::ReverseRequest,
        steps: ReversedSteps,
    ) -> StoreResult<()> {
        match steps {
            ReversedSteps::RunAgain => {
                let cause = "rerun after reversal";
                let steps = (req.steps.as_slice(), None);
                self.rerun_steps(tx, installation, record_id, steps, req.now, cause)
                    .await
            }
            ReversedSteps::Mark => {
                sqlx::query(
                    "UPDATE step_runs SET error_code = $1, updated_at = $2 \
                     WHERE record_id = $3 AND step = $4 AND state = 'succeeded'",
                )
                .bind(crate::domain::REVERSED)
                .bind(req.now)
                .bind(record_id)
                .bind(req.step.clone())
                .execute(&mut **tx)
                .await?;
                Ok(())
            }
            ReversedSteps::Keep => Ok(()),
        }
    }

    /// A record parked until a condition and parked again by a reversal:
    /// it no longer resumes by itself, and says why it is parked now.
    pub(crate) async fn park_for_a_human(
        &self,
        tx: &mut Tx<DB>,
        record_id: i64,
        reason: &str,
        now: UnixMs,
    ) -> StoreResult<Record> {
        let sql = format!(
            "UPDATE records SET park_until_at = NULL, park_until_provider = NULL, \
             error_code = $1, reason = $2, updated_at = $3 WHERE id = $4 \
             RETURNING {RECORD_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(crate::domain::REVERSED)
            .bind(reason.to_owned())
            .bind(now)
            .bind(record_id)
            .fetch_one(&mut **tx)
            .await?;
        row.record(&self.keyring())
    }

    /// A fresh attempt budget (and deadline) for every step of `rec` that
    /// has not succeeded (a submitted job keeps its id, so it is polled, not
    /// paid for again; a step skipped behind one that did not succeed runs
    /// if that one now does, while a step its own `when` skipped stays so,
    /// its evidence kept: its branch's join may have run); reversed results run again, a new generation, with
    /// the steps after them that `after` names (read here, under the
    /// record's lock: `after` counts only when a step is reversed, and never
    /// leaves one out); with a new input, every unfinished step runs again
    /// too (a new request: a new idempotency key, a job made from the old
    /// input left behind).
    async fn fresh_start(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        rec: &Record,
        (after, new_input, cause): (&[String], bool, &str),
        now: UnixMs,
    ) -> StoreResult<()> {
        let mut unfinished: Vec<String> = sqlx::query_scalar(
            "UPDATE step_runs SET attempts = 0, unknowns = 0, deadline_at = NULL, next_run_at = NULL, \
             error_code = NULL, reason = NULL, updated_at = $1, \
             finished_at = CASE WHEN state = 'skipped' THEN NULL ELSE finished_at END, \
             state = CASE WHEN job_id IS NULL THEN 'pending' ELSE 'waiting' END \
             WHERE record_id = $2 AND state <> 'succeeded' \
             AND NOT (state = 'skipped' AND output IS NOT NULL) \
             AND (item_of IS NULL OR EXISTS (SELECT 1 FROM step_runs a \
               WHERE a.record_id = step_runs.record_id AND a.step = step_runs.item_of \
               AND a.state <> 'succeeded')) RETURNING step",
        )
        .bind(now)
        .bind(rec.id)
        .fetch_all(&mut **tx)
        .await?;
        // An item runs again with its step, never on its own.
        unfinished.retain(|s| crate::domain::each::item_of(s).is_none());
        unfinished.sort();
        let mut again: Vec<String> = sqlx::query_scalar(
            "SELECT step FROM step_runs WHERE record_id = $1 AND state = 'succeeded' \
             AND error_code = $2 ORDER BY step",
        )
        .bind(rec.id)
        .bind(crate::domain::REVERSED)
        .fetch_all(&mut **tx)
        .await?;
        if !again.is_empty() && !after.is_empty() {
            let missing: Vec<String> = again
                .iter()
                .filter(|r| !after.contains(r))
                .cloned()
                .collect();
            again = after.iter().cloned().chain(missing).collect();
        }
        if new_input {
            for step in unfinished {
                if !again.contains(&step) {
                    again.push(step);
                }
            }
        }
        self.rerun_steps(tx, installation, rec.id, (&again, None), now, cause)
            .await
    }

    /// Writes what an uncertain call of `step` did, as an operator found
    /// it at the provider: the job it made (the step follows it) or the
    /// outputs it took effect with (the step succeeds). Refused when the
    /// step has no such call any more.
    async fn took_effect_locked(
        &self,
        tx: &mut Tx<DB>,
        rec: &Record,
        change: &StepChange,
        now: UnixMs,
    ) -> StoreResult<()> {
        let (set, step) =
            match change {
                StepChange::TookJob { step, job, reason } => (
                    sqlx::query(
                        "UPDATE step_runs SET job_id = $1, state = 'waiting', error_code = NULL, \
                     reason = $2, next_run_at = NULL, deadline_at = NULL, updated_at = $3 \
                     WHERE record_id = $4 AND step = $5 AND job_id IS NULL AND error_code = $6 \
                     AND state NOT IN ('succeeded', 'failed', 'skipped')",
                    )
                    .bind(job.clone())
                    .bind(reason.clone()),
                    step,
                ),
                StepChange::TookOutput {
                    step,
                    output,
                    confirm,
                    reason,
                } => {
                    if let Some(p) = confirm {
                        Self::put_confirmation(tx, p).await?;
                    }
                    (
                    sqlx::query(
                        "UPDATE step_runs SET output = $1, state = 'succeeded', error_code = NULL, \
                         reason = $2, next_run_at = NULL, deadline_at = NULL, finished_at = $3, \
                         updated_at = $3 \
                         WHERE record_id = $4 AND step = $5 AND job_id IS NULL AND error_code = $6 \
                         AND state NOT IN ('succeeded', 'failed', 'skipped')",
                    )
                    .bind(Json(
                        self.keyring().seal_json(Field::Output, output)?.into_owned(),
                    ))
                    .bind(reason.clone()),
                    step,
                )
                }
                _ => return Ok(()),
            };
        let done = set
            .bind(now)
            .bind(rec.id)
            .bind(step.clone())
            .bind(crate::domain::OUTCOME_UNCERTAIN)
            .execute(&mut **tx)
            .await?;
        if done.rows_affected() != 1 {
            return Err(StoreError::Invalid(format!(
                "step `{step}` has no call whose outcome is uncertain"
            )));
        }
        Ok(())
    }

    /// Applies `plan`'s change to the steps of `rec`.
    async fn change_steps(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        rec: &Record,
        req: &ActionRequest,
        plan: &Plan,
    ) -> StoreResult<()> {
        match &plan.steps {
            StepChange::Keep => Ok(()),
            StepChange::FreshStart { new_input, cause } => {
                let how = (req.steps.as_slice(), *new_input, cause.as_str());
                self.fresh_start(tx, installation, rec, how, req.now).await
            }
            StepChange::RunAgain {
                steps,
                cause,
                keep_items,
            } => {
                let steps = (steps.as_slice(), *keep_items);
                self.run_again(tx, installation, rec.id, steps, req.now, cause)
                    .await
            }
            StepChange::AcceptReversed => {
                sqlx::query(
                    "UPDATE step_runs SET error_code = NULL, updated_at = $1 \
                     WHERE record_id = $2 AND state = 'succeeded' AND error_code = $3",
                )
                .bind(req.now)
                .bind(rec.id)
                .bind(crate::domain::REVERSED)
                .execute(&mut **tx)
                .await?;
                Ok(())
            }
            change @ (StepChange::TookJob { .. } | StepChange::TookOutput { .. }) => {
                self.took_effect_locked(tx, rec, change, req.now).await
            }
            StepChange::Decide {
                step,
                output,
                job_id,
                reason,
            } => {
                // The domain found the step waiting under this lock.
                let done = sqlx::query(
                    "UPDATE step_runs SET state = 'succeeded', output = $1, job_id = $2, \
                     error_code = NULL, reason = $3, next_run_at = NULL, deadline_at = NULL, \
                     finished_at = $4, updated_at = $4 \
                     WHERE record_id = $5 AND step = $6 AND state = 'waiting'",
                )
                .bind(Json(
                    self.keyring()
                        .seal_json(Field::Output, output)?
                        .into_owned(),
                ))
                .bind(job_id.clone())
                .bind(reason.clone())
                .bind(req.now)
                .bind(rec.id)
                .bind(step.clone())
                .execute(&mut **tx)
                .await?;
                if done.rows_affected() != 1 {
                    return Err(StoreError::Declined {
                        code: "nothing_awaited",
                        message: format!("step `{step}` no longer waits"),
                    });
                }
                Ok(())
            }
            StepChange::EndWait { steps, reason } => {
                for step in steps {
                    sqlx::query(
                        "UPDATE step_runs SET deadline_at = $1, next_run_at = $1, reason = $2, \
                         updated_at = $1 WHERE record_id = $3 AND step = $4 AND state = 'waiting'",
                    )
                    .bind(req.now)
                    .bind(reason.clone())
                    .bind(rec.id)
                    .bind(step.clone())
                    .execute(&mut **tx)
                    .await?;
                }
                Ok(())
            }
        }
    }

    /// The step runs of a record whose row `tx` holds, as they stand (its
    /// steps', not its items').
    async fn step_runs_locked(&self, tx: &mut Tx<DB>, record_id: i64) -> StoreResult<Vec<StepRun>> {
        let sql = format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 \
             AND item_of IS NULL ORDER BY step"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(&mut **tx)
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_run)
    }

    /// An action on a record locked in `tx`: an operator's (`act`), or the
    /// system's resume of a record whose condition held (`resume_parked`,
    /// `condition` naming it). The domain decides it (`action::plan`);
    /// this writes its input, step changes, version and audited event; its
    /// counter moves go into `deltas`, which the caller applies (once,
    /// after every record it locks: counter rows are taken last), before it
    /// wakes the workers and commits.
    pub(crate) async fn act_locked(
        &self,
        tx: &mut Tx<DB>,
        installation: &str,
        rec: &Record,
        req: &ActionRequest,
        condition: Option<&ParkUntil>,
        deltas: &mut CountDeltas,
    ) -> StoreResult<Record> {
        let runs = self.step_runs_locked(tx, rec.id).await?;
        let plan = action::plan(rec, &runs, req, condition)?;
        if let Some(new) = &plan.input {
            sqlx::query("UPDATE records SET input = $1 WHERE id = $2")
                .bind(Json(
                    self.keyring().seal_json(Field::Input, new)?.into_owned(),
                ))
                .bind(rec.id)
                .execute(&mut **tx)
                .await?;
        }
        self.change_steps(tx, installation, rec, req, &plan).await?;
        if let Some(version) = plan.repin {
            sqlx::query("UPDATE records SET pipeline_version = $1 WHERE id = $2")
                .bind(version)
                .bind(rec.id)
                .execute(&mut **tx)
                .await?;
        }
        let event = EventRow {
            record_id: Some(rec.id),
            at: req.now,
            kind: req.action.as_str(),
            actor: &req.actor,
            audit: true,
            from: Some(rec.state),
            to: Some(plan.to),
            step: plan.event_step.as_deref(),
            reason: req.reason.as_deref(),
            detail: plan.detail.as_ref(),
            claimed_at: None,
            claimed_by: None,
        };
        let mut moved = self
            .move_record(
                tx,
                rec,
                (plan.to, plan.until.as_ref()),
                plan.next_run_at,
                req.now,
                event,
                plan.error_code.as_deref(),
                deltas,
            )
            .await?;
        if plan.repin.is_some() {
            moved.pipeline_version = plan.repin;
        }
        Ok(moved)
    }

    /// Moves one record whose row the transaction holds and writes
    /// the event; the caller applies `deltas`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn move_record(
        &self,
        tx: &mut Tx<DB>,
        rec: &Record,
        (to, until): (RecordState, Option<&ParkUntil>),
        next_run_at: Option<UnixMs>,
        now: UnixMs,
        event: EventRow<'_>,
        error_code: Option<&str>,
        deltas: &mut CountDeltas,
    ) -> StoreResult<Record> {
        let finished_at = if to.is_terminal() { Some(now) } else { None };
        let (until_at, until_provider) = ParkUntil::columns(until);
        let sql = format!(
            "UPDATE records SET state = $1, next_run_at = $2, lease_owner = NULL, lease_until = NULL, \
             error_code = $3, reason = $4, step = COALESCE($5, step), updated_at = $6, finished_at = $7, \
             park_until_at = $9, park_until_provider = $10 \
             WHERE id = $8 RETURNING {RECORD_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(to.as_str())
            .bind(next_run_at)
            .bind(error_code.map(str::to_owned))
            .bind(event.reason.map(str::to_owned))
            .bind(event.step.map(str::to_owned))
            .bind(now)
            .bind(finished_at)
            .bind(rec.id)
            .bind(until_at)
            .bind(until_provider.map(str::to_owned))
            .fetch_one(&mut **tx)
            .await?;
        self.insert_event(tx, &event).await?;
        let after = row.record(&self.keyring())?;
        deltas.record_moved(rec, &after);
        Ok(after)
    }
}
