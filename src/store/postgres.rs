//! The PostgreSQL backend, for several nodes sharing one database.
//!
//! Claims lock due rows with `FOR UPDATE SKIP LOCKED`, so concurrent
//! claimers on any number of nodes take disjoint batches without waiting on
//! each other; every other write locks the record row it changes.

use std::collections::HashMap;
use std::str::FromStr;

use serde::Serialize;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::query::Query;
use sqlx::types::Json;
use sqlx::{Pool, Postgres, Row, Transaction};

use super::backend::{SqlDb, Statements};
use super::batch::Dialect;
use super::rows::{MapRow, RECORD_COLUMNS, map_sealed};
use super::sql::SqlStore;
use super::{ClaimRequest, Claimed, ConnectOptions, StoreResult, Taken};
use crate::domain::{UnixMs, fair};
/// The LISTEN/NOTIFY channel that says "there is due work".
const WORK_CHANNEL: &str = "ballast_work";
/// The channel that says "a provider's shared state changed".
const PROVIDERS_CHANNEL: &str = "ballast_providers";

/// What a notification on one of Ballast's channels says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wakeup {
    /// There is due work.
    Work,
    /// A provider was paused or resumed, throttled, or its breaker moved.
    Providers,
}

/// Set on each session (see `PgStore::connect`): the limit on sitting
/// inside a transaction waiting for Ballast, after which the server ends
/// it; and a plan per execution instead of a generic plan kept until the
/// table's statistics next change (PostgreSQL 12 and later; behind a pooler
/// in transaction mode, set both on the role instead: docs/operations.md).
const SESSION_SETTINGS: &str = "SET idle_in_transaction_session_timeout = '10s'; \
                                SET plan_cache_mode = force_custom_plan";

/// How many rows each (pipeline, state) counter is spread over, so that
/// concurrent transactions rarely wait on the same counter row.
const COUNTER_SHARDS: i32 = 16;

/// Records and everything else, in one PostgreSQL database.
pub type PgStore = SqlStore<Postgres>;

impl PgStore {
    pub async fn connect(url: &str, opts: &ConnectOptions) -> Result<Self, sqlx::Error> {
        let options = PgConnectOptions::from_str(url)?.application_name("ballast");
        let pool = PgPoolOptions::new()
            // A Ballast process that stops mid-transaction (frozen, swapped
            // out, a VM paused) would hold its row locks for as long as it
            // stays stopped: claims skip locked rows, so records it was
            // claiming would wait for it. The server ends such a session
            // instead; the locks go and another node claims the records.
            // Set per connection with `SET`, not as a startup parameter,
            // which connection poolers such as PgBouncer refuse; Ballast's
            // own transactions never wait on the client for long.
            //
            // Statements stay prepared (parsed once per connection), but are
            // planned on each execution. A generic plan is made once, with
            // the statistics of that moment, and kept until they change:
            // made while the tables were small (a new installation; a table
            // autoanalyze has not reached yet), the batched reads became sequential scans that
            // every claim repeated as the tables grew — 158 M rows read in
            // one 200,000-record benchmark run, the throughput falling with
            // the backlog. A custom plan sees the tables' current size. The
            // planning costs tens of microseconds per batched statement.
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    sqlx::raw_sql(SESSION_SETTINGS)
                        .execute(conn)
                        .await
                        .map(|_| ())
                })
            })
            .max_connections(opts.max_connections.max(1))
            .acquire_timeout(opts.acquire_timeout)
            .connect_with(options)
            .await?;
        Ok(SqlStore::new(pool, opts.keyring.clone()))
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pools
    }

    /// Waits for notifications from any node (work, provider changes);
    /// each one calls `on`. Reconnects after errors until `stop`. Once
    /// listening (at first and after each reconnect) it calls
    /// `on(Wakeup::Work)` and `on(Wakeup::Providers)`: what changed before
    /// it listened is looked at again.
    pub async fn listen(
        &self,
        on: impl Fn(Wakeup) + Send,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            let listener = async {
                let mut l = sqlx::postgres::PgListener::connect_with(&self.pools).await?;
                l.listen_all([WORK_CHANNEL, PROVIDERS_CHANNEL]).await?;
                Ok::<_, sqlx::Error>(l)
            };
            let mut listener = match listener.await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for work; retrying");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
                    }
                }
            };
            on(Wakeup::Providers);
            on(Wakeup::Work);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    n = listener.recv() => match n {
                        Ok(n) if n.channel() == PROVIDERS_CHANNEL => on(Wakeup::Providers),
                        Ok(_) => on(Wakeup::Work),
                        Err(e) => {
                            tracing::warn!(error = %e, "work notifications interrupted");
                            break;
                        }
                    },
                }
            }
        }
    }

    pub async fn close(&self) {
        self.pools.close().await;
    }
}

/// Sends a notification on `channel`, delivered when `tx` commits.
async fn notify(tx: &mut Transaction<'static, Postgres>, channel: &str) -> StoreResult<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(channel.to_owned())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The advisory lock claims take while some pipeline caps its groups.
const GROUP_CAPS_LOCK: i64 = 0x6261_6c6c_6173_7401;

/// The levels of the (pipeline, group) queues with records needing a
/// worker, each (pipeline, group, priority) present with its earliest due
/// time (`first`): a loose scan of `records_queue_levels`, one index probe
/// per level (finished records are not in the index, so queues of finished
/// work cost nothing; a queue whose records all have one priority costs
/// one probe).
const LEVELS: &str = "WITH RECURSIVE levels(pipeline, group_key, priority, first) AS ( \
       (SELECT pipeline, group_key, priority, next_run_at FROM records WHERE next_run_at IS NOT NULL \
        ORDER BY pipeline, group_key, priority, next_run_at LIMIT 1) \
     UNION ALL \
       SELECT n.pipeline, n.group_key, n.priority, n.next_run_at FROM levels q CROSS JOIN LATERAL ( \
         SELECT r.pipeline, r.group_key, r.priority, r.next_run_at FROM records r \
         WHERE r.next_run_at IS NOT NULL \
           AND (r.pipeline, r.group_key, r.priority) > (q.pipeline, q.group_key, q.priority) \
         ORDER BY r.pipeline, r.group_key, r.priority, r.next_run_at LIMIT 1) n)";

/// The claim. `ready`: the queues with due work, each with its due
/// levels, highest first, and its `room` when its pipeline caps groups
/// (the cap less the group's unexpired leases, counted once over the
/// capped pipelines' running records, which are few). `cut`: the open
/// queues in a random turn, no more of them than the batch, each with its
/// `quota`: `batch / n`, one more for the first `batch mod n` in turn,
/// never past its room. Each gives its quota of due records, highest
/// priority first and oldest due within a level: its due levels are read
/// in turn, each in due order, skipping rows other claims hold, and the
/// reading stops at the quota, so the statement locks only rows it takes
/// and reads no level below the one that fills it. Priority orders work
/// within a queue only: the share between queues is the same whatever
/// their priorities. (A queue with less than its quota leaves the rest of
/// the batch unclaimed; the engine claims again at once.)
/// $1 now, $2 batch, $3 owner, $4 lease end, $5/$6 capped pipelines and caps.
const CLAIM_DUE: &str = "\
     caps AS (SELECT * FROM unnest($5::text[], $6::bigint[]) AS c(pipeline, cap)), \
     running AS ( \
       SELECT r.pipeline, r.group_key, count(*) AS n FROM records r \
       WHERE r.state = 'running' AND r.lease_until > $1 AND r.pipeline = ANY($5::text[]) \
       GROUP BY r.pipeline, r.group_key), \
     ready AS ( \
       SELECT q.pipeline, q.group_key, q.levels, c.cap - COALESCE(u.n, 0) AS room \
       FROM ( \
         SELECT pipeline, group_key, array_agg(priority ORDER BY priority DESC) AS levels \
         FROM levels WHERE first <= $1 GROUP BY pipeline, group_key) q \
       LEFT JOIN caps c ON c.pipeline = q.pipeline \
       LEFT JOIN running u ON u.pipeline = q.pipeline AND u.group_key = q.group_key), \
     open AS ( \
       SELECT * FROM ( \
         SELECT pipeline, group_key, levels, room, row_number() OVER (ORDER BY random()) AS turn \
         FROM ready WHERE room IS NULL OR room > 0) o \
       WHERE turn <= $2), \
     share AS (SELECT GREATEST(count(*), 1) AS n FROM open), \
     cut AS ( \
       SELECT q.pipeline, q.group_key, q.levels, \
         LEAST(COALESCE(q.room, $2), $2 / s.n + CASE WHEN q.turn <= $2 % s.n THEN 1 ELSE 0 END) AS quota \
       FROM open q CROSS JOIN share s), \
     due AS ( \
       SELECT d.due_id, d.old_state, d.old_due, d.old_owner, d.old_at FROM cut q CROSS JOIN LATERAL ( \
         SELECT x.* FROM ( \
           SELECT l.priority FROM unnest(q.levels) WITH ORDINALITY AS l(priority, turn) \
           ORDER BY l.turn) lv \
         CROSS JOIN LATERAL ( \
           SELECT r.id AS due_id, r.state AS old_state, r.next_run_at AS old_due, \
             r.lease_owner AS old_owner, r.claimed_at AS old_at FROM records r \
           WHERE r.pipeline = q.pipeline AND r.group_key = q.group_key AND r.priority = lv.priority \
             AND r.next_run_at IS NOT NULL AND r.next_run_at <= $1 \
           ORDER BY r.next_run_at, r.id \
           LIMIT q.quota \
           FOR NO KEY UPDATE SKIP LOCKED) x \
         LIMIT q.quota) d) \
     UPDATE records SET state = 'running', lease_owner = $3, lease_until = $4, next_run_at = $4, \
       lease_token = records.lease_token + 1, updated_at = $1, claimed_at = $1 \
     FROM due WHERE records.id = due.due_id AND records.id = ANY(ARRAY(SELECT due_id FROM due))";

// `FOR NO KEY UPDATE`, not `FOR UPDATE`: inserting an event, attempt or step
// run that references a record must not wait behind a lock on that record.
//
// `= ANY(ARRAY(subquery))`, not `IN (subquery)`: a key array is matched
// through the primary key's index (a bitmap scan for a batch), where the
// planner would hash a subquery of unknown size against a scan of the
// table. The claim joins `records` to its own CTE the same way.
impl SqlDb for Postgres {
    type Pools = PgPool;

    const LOCK: &'static str = " FOR NO KEY UPDATE";
    // Conflicts with the row-exclusive lock of any insert and with itself.
    const LOCK_USERS: Option<&'static str> = Some("LOCK TABLE users IN SHARE ROW EXCLUSIVE MODE");
    const AUDIT: &'static str = "audit";
    const DIALECT: Dialect = Dialect::Postgres;
    const ANY_OF: (&'static str, &'static str) = ("= ANY(ARRAY(", "))");
    const UPDATE_KEY: &'static str = " AND records.id = ANY(ARRAY(SELECT id FROM v))";
    const LISTS_IN_PARTS: bool = true;

    fn reader(pool: &PgPool) -> &Pool<Postgres> {
        pool
    }

    async fn begin_write(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        pool.begin().await
    }

    /// Wakes idle workers on every node (delivered at commit).
    async fn notify_work(tx: &mut Transaction<'static, Postgres>) -> StoreResult<()> {
        notify(tx, WORK_CHANNEL).await
    }

    async fn notify_providers(tx: &mut Transaction<'static, Postgres>) -> StoreResult<()> {
        notify(tx, PROVIDERS_CHANNEL).await
    }

    fn counter_shard() -> i32 {
        fastrand::i32(0..COUNTER_SHARDS)
    }

    /// One statement whose data-modifying `WITH` parts share its snapshot:
    /// the records, then an event and the counters for each row the
    /// `INSERT … ON CONFLICT DO NOTHING` returned, and the wake-up (only
    /// when one was): one round trip, where a transaction of its parts
    /// was six (begin, records, events, counters, notify, commit). The statement
    /// is the function `ballast_insert_records` (migration 21), whose plan
    /// each connection keeps: planned on every execution, as this
    /// backend's sessions plan statements, it cost a third of a single
    /// enqueue.
    async fn insert_records_at_once(
        pool: &PgPool,
        batch: &[crate::store::NewRecord],
        now: crate::domain::UnixMs,
        keys: &crate::auth::seal::Keyring,
    ) -> StoreResult<Option<Vec<crate::domain::Record>>> {
        use super::batch;
        let rows: Vec<batch::NewRecordJson<'_>> = batch
            .iter()
            .map(|r| batch::NewRecordJson::new(r, now, keys))
            .collect::<Result<_, _>>()?;
        // Its columns named, not `*`: a later migration that adds a column
        // to `records` (and so to the function's rows) then leaves this
        // version's prepared statement valid (with `*`, PostgreSQL refuses
        // to run it again: "cached plan must not change result type").
        let sql = Self::statements()
            .insert_records_at_once
            .get(|| format!("SELECT {RECORD_COLUMNS} FROM ballast_insert_records($1, $2, $3, $4)"));
        let inserted = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(sqlx::types::Json(&rows))
            .bind(crate::domain::SYSTEM_ACTOR)
            .bind(Self::counter_shard())
            .bind(WORK_CHANNEL)
            .fetch_all(pool)
            .await?;
        let records = inserted
            .iter()
            .map(|r| r.record(keys))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(records))
    }

    async fn claim_in(
        tx: &mut Transaction<'static, Postgres>,
        req: &ClaimRequest,
        keys: &crate::auth::seal::Keyring,
    ) -> StoreResult<Claimed> {
        let lease_until = req.now + i64::try_from(req.lease.as_millis()).unwrap_or(i64::MAX / 2);
        if !req.group_caps.is_empty() {
            // Capped groups count the leases other nodes' claims hold: one
            // claim at a time counts and takes (its statement's snapshot is
            // taken after this lock, so it sees the claim before it).
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(GROUP_CAPS_LOCK)
                .execute(&mut **tx)
                .await?;
        }
        let (capped, caps): (Vec<String>, Vec<i64>) = req
            .group_caps
            .iter()
            .map(|(p, cap)| (p.clone(), i64::from(*cap)))
            .unzip();
        let sql = Self::statements().claim.get(|| {
            format!("{LEVELS}, {CLAIM_DUE} RETURNING {RECORD_COLUMNS}, old_state, old_due, old_owner, old_at")
        });
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(req.now)
            .bind(i64::from(req.limit))
            .bind(req.owner.clone())
            .bind(lease_until)
            .bind(capped)
            .bind(caps)
            .fetch_all(&mut **tx)
            .await?;
        let mut taken_from = HashMap::with_capacity(rows.len());
        let mut due_at = HashMap::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.try_get("id")?;
            let taken = Taken {
                state: row.try_get("old_state")?,
                owner: row.try_get("old_owner")?,
                at: row.try_get("old_at")?,
            };
            taken_from.insert(id, taken);
            due_at.insert(id, row.try_get::<i64, _>("old_due")?);
        }
        let mut claimed = map_sealed(&rows, keys, MapRow::record)?;
        // Priority then due order within each queue, then round robin
        // over the queues.
        claimed.sort_by_key(|r| {
            let due = due_at.get(&r.id).copied();
            (std::cmp::Reverse(r.priority), due, r.id)
        });
        let claimed = fair::interleave(claimed, |r| (r.pipeline.clone(), r.group.clone()));
        Ok((claimed, taken_from))
    }

    async fn queue_heads_in(pool: &PgPool) -> StoreResult<Vec<(String, String, UnixMs)>> {
        let sql = format!(
            "{LEVELS} SELECT pipeline, group_key, min(first) FROM levels GROUP BY pipeline, group_key"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(pool)
            .await?)
    }

    /// A GIN index has no order: read through it, every match is read
    /// before the newest are known (fast for a rare word, not for one in
    /// a fifth of the records); read newest first with the words as a
    /// filter, a word that matches nothing reads every document. So: the
    /// newest documents first, a bounded number of them (enough for any
    /// word in more than one document in 200); then, if the page is not
    /// full, every match below those through the index. Each statement is
    /// planned for its values (`plan_cache_mode`).
    async fn search_ids(pool: &PgPool, q: &str, limit: i64) -> StoreResult<Vec<i64>> {
        use crate::domain::search;
        let Some(query) = search::tsquery(q) else {
            return Ok(Vec::new());
        };
        let top: Option<i64> = sqlx::query_scalar("SELECT MAX(record_id) FROM record_search")
            .fetch_one(pool)
            .await?;
        let floor = top.unwrap_or(0) - search::NEWEST_FIRST;
        let mut ids: Vec<i64> = sqlx::query_scalar(
            "SELECT record_id FROM record_search \
             WHERE record_id > $3 AND doc @@ to_tsquery('simple', $1) \
             ORDER BY record_id DESC LIMIT $2",
        )
        .bind(&query)
        .bind(limit)
        .bind(floor)
        .fetch_all(pool)
        .await?;
        if (ids.len() as i64) < limit {
            // Materialised: every match, found through the index, then
            // the newest of them (not a walk down the ids the planner may
            // prefer for a word it thinks common).
            let older: Vec<i64> = sqlx::query_scalar(
                "WITH hits AS MATERIALIZED (SELECT record_id FROM record_search \
                 WHERE doc @@ to_tsquery('simple', $1)) \
                 SELECT record_id FROM hits WHERE record_id <= $3 \
                 ORDER BY record_id DESC LIMIT $2",
            )
            .bind(&query)
            .bind(limit - ids.len() as i64)
            .bind(floor)
            .fetch_all(pool)
            .await?;
            ids.extend(older);
        }
        Ok(ids)
    }

    /// Each record's document is worked out first, and only those that
    /// differ from the stored one are written: an unchanged document (a
    /// record indexed again after an event that changed none of its words,
    /// as when it finished with no output words) costs no row lock and no
    /// WAL (an upsert would lock the record and the stored document for
    /// each: two WAL records per unchanged document). Records written are
    /// locked in id order, and one purged meanwhile is skipped (the lock
    /// waits for the purge, then finds no row).
    async fn index_in(
        tx: &mut Transaction<'static, Postgres>,
        records: &[i64],
        bare: &[i64],
    ) -> StoreResult<u64> {
        let sql = Self::statements().index_records.get(|| {
            // A value sealed at rest (`auth::seal`, text beginning with
            // U+0001) gives no words: its text is ciphertext.
            let values = |doc: &str| {
                format!(
                    "(SELECT string_agg(v #>> '{{}}', ' ') FROM jsonb_path_query({doc}, \
                     'strict $.** ? (@.type() == \"string\" || @.type() == \"number\")') v \
                     WHERE left(v #>> '{{}}', 1) <> chr(1))"
                )
            };
            format!(
                "WITH d AS MATERIALIZED ( \
                   SELECT r.id, to_tsvector('simple', left(concat_ws(' ', r.external_key, r.reason, \
                     r.error_code, {input}, \
                     (SELECT string_agg(concat_ws(' ', s.reason, s.error_code, s.job_id, {output}), ' ') \
                      FROM step_runs s WHERE s.record_id = r.id AND s.item_of IS NULL)), 65536)) AS doc \
                   FROM records r WHERE r.id {in_ids}) \
                 INSERT INTO record_search (record_id, doc) \
                 SELECT r.id, d.doc FROM d JOIN records r ON r.id = d.id \
                 WHERE NOT EXISTS (SELECT 1 FROM record_search s WHERE s.record_id = d.id AND s.doc = d.doc) \
                 ORDER BY r.id FOR KEY SHARE OF r \
                 ON CONFLICT (record_id) DO UPDATE SET doc = excluded.doc \
                 WHERE record_search.doc IS DISTINCT FROM excluded.doc",
                input = bared(&values("r.input"), "r.id"),
                output = bared(&values("s.output"), "r.id"),
                in_ids = SqlStore::<Postgres>::in_ids(),
            )
        });
        let done = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(Json(records))
            .bind(Json(bare))
            .execute(&mut **tx)
            .await?;
        Ok(done.rows_affected())
    }

    /// A purged record's document goes with it (a foreign key).
    async fn unindex_in(
        _tx: &mut Transaction<'static, Postgres>,
        _records: &[i64],
    ) -> StoreResult<()> {
        Ok(())
    }

    fn statements() -> &'static Statements {
        static STATEMENTS: Statements = Statements::new();
        &STATEMENTS
    }

    fn bind_json<'q, T: Serialize>(
        query: Query<'q, Postgres, PgArguments>,
        value: T,
    ) -> Query<'q, Postgres, PgArguments> {
        query.bind(Json(value))
    }

    /// One statement after another (a prepared statement holds one),
    /// those with no rows skipped.
    async fn run_writes(
        tx: &mut Transaction<'static, Postgres>,
        writes: &super::backend::Writes,
    ) -> StoreResult<()> {
        for (sql, rows) in writes.parts() {
            if let Some(rows) = rows {
                sqlx::query(sql).bind(rows).execute(&mut **tx).await?;
            }
        }
        Ok(())
    }
}

/// `expr`, or NULL for a record (`id`) among the bare ones (`$2`): a
/// search document without its input and output values.
fn bared(expr: &str, id: &str) -> String {
    format!(
        "CASE WHEN {id} IN (SELECT CAST(value AS BIGINT) FROM jsonb_array_elements($2)) THEN NULL ELSE {expr} END"
    )
}

#[cfg(test)]
mod tests {
    use super::super::batch;

    /// `ballast_insert_records` (migration 36, which replaced migration
    /// 33's, 29's and 21's) reads the rows that `NewRecordJson` writes: the
    /// same columns, cells in the same order; the priority, which a node of
    /// an older version may not send, defaults.
    #[test]
    fn the_enqueue_function_reads_the_rows_rust_writes() {
        let up = include_str!("../../migrations/postgres/0036_keyless_records.up.sql");
        let last = batch::NEW_RECORD_COLS.len() - 1;
        assert_eq!(batch::NEW_RECORD_COLS[last].0, "priority");
        let cell = format!("CAST(value->>{last} AS BIGINT)");
        let insert = batch::insert(
            "records",
            batch::NEW_RECORD_COLS,
            batch::Dialect::Postgres,
            &format!("{} RETURNING *", batch::Dialect::Postgres.on_key_conflict()),
        )
        .replace("$1", "p_rows")
        .replace(
            &cell,
            &format!("COALESCE({cell}, {})", crate::domain::DEFAULT_PRIORITY),
        );
        assert!(
            up.contains(&insert),
            "migration 36 no longer matches batch::NEW_RECORD_COLS: a new migration must \
             replace ballast_insert_records with the statement below, and this test read \
             that migration\n{insert}"
        );
    }
}
