//! The SQLite backend: one file, WAL mode, a single writer connection.
//!
//! All writes go through one pooled connection and begin with
//! `BEGIN IMMEDIATE`, so writers in this process queue in order instead of
//! failing with `SQLITE_BUSY`, and a second process (a CLI command next to a
//! running server) waits on the busy timeout. Reads use their own pool and
//! never block the writer under WAL.

use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;
use sqlx::query::Query;
use sqlx::sqlite::{
    SqliteArguments, SqliteAutoVacuum, SqliteConnectOptions, SqliteConnection, SqliteJournalMode,
    SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::types::Json;
use sqlx::{Pool, Row, Sqlite, Transaction};

use super::backend::{SqlDb, Statements};
use super::batch::Dialect;
use super::rows::{MapRow, RECORD_COLUMNS, map_sealed};
use super::sql::SqlStore;
use super::{ClaimRequest, Claimed, ConnectOptions, StoreError, StoreResult, Taken};
use crate::domain::{UnixMs, fair};

/// The unexpired leases of each group of the pipelines that cap their
/// groups, counted once over their running records (which are few).
async fn capped_leases(
    tx: &mut SqliteConnection,
    req: &ClaimRequest,
) -> StoreResult<std::collections::HashMap<(String, String), i64>> {
    if req.group_caps.is_empty() {
        return Ok(Default::default());
    }
    let capped: Vec<&str> = req.group_caps.iter().map(|(p, _)| p.as_str()).collect();
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT pipeline, group_key, count(*) FROM records WHERE state = 'running' \
         AND lease_until > $1 AND pipeline IN (SELECT value FROM json_each($2)) \
         GROUP BY pipeline, group_key",
    )
    .bind(req.now)
    .bind(Json(&capped))
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.into_iter().map(|(p, g, n)| ((p, g), n)).collect())
}

/// The due levels of one queue, highest first.
type Levels = Vec<i64>;

/// Up to `take` of a queue's due records with their states: from its due
/// `levels` in turn (highest priority first), each oldest first, reading
/// no level below the one that fills the take.
async fn due_in_queue(
    conn: &mut SqliteConnection,
    (pipeline, group, levels): (&str, &str, &[i64]),
    now: UnixMs,
    take: u32,
) -> StoreResult<Vec<(i64, Taken)>> {
    let mut due: Vec<(i64, Taken)> = Vec::new();
    for level in levels {
        let left = i64::from(take) - i64::try_from(due.len()).unwrap_or(i64::MAX);
        if left <= 0 {
            break;
        }
        let rows: Vec<(i64, String, Option<String>, Option<i64>)> = sqlx::query_as(
            "SELECT id, state, lease_owner, claimed_at FROM records WHERE pipeline = $1 AND group_key = $2 AND priority = $3 \
             AND next_run_at IS NOT NULL AND next_run_at <= $4 ORDER BY next_run_at, id LIMIT $5",
        )
        .bind(pipeline)
        .bind(group)
        .bind(level)
        .bind(now)
        .bind(left)
        .fetch_all(&mut *conn)
        .await?;
        due.extend(
            rows.into_iter()
                .map(|(id, state, owner, at)| (id, Taken { state, owner, at })),
        );
    }
    Ok(due)
}

/// Each level of the (pipeline, group) queues with records needing a
/// worker, (pipeline, group, priority), and when its earliest is due: a
/// loose scan of `records_queue_levels`, one probe per level (finished
/// records are not in the index), in index order.
async fn queue_levels(
    conn: &mut SqliteConnection,
) -> StoreResult<Vec<(String, String, i64, UnixMs)>> {
    let mut levels: Vec<(String, String, i64, UnixMs)> = Vec::new();
    // Pipeline names are never empty, so ('', '', 0) comes before every
    // level.
    let (mut pipeline, mut group, mut priority) = (String::new(), String::new(), 0);
    loop {
        // Past the whole level in one seek: SQLite seeks `(a, b, c, d) >
        // (x, y, z, w)` to the first (x, y, z) entry and steps over every
        // record of that level; with the due time at its greatest it seeks
        // past them (a waiting million cost a claim a scan of the index
        // otherwise).
        let next: Option<(String, String, i64, UnixMs)> = sqlx::query_as(
            "SELECT pipeline, group_key, priority, next_run_at FROM records \
             WHERE next_run_at IS NOT NULL \
               AND (pipeline, group_key, priority, next_run_at) > ($1, $2, $3, $4) \
             ORDER BY pipeline, group_key, priority, next_run_at LIMIT 1",
        )
        .bind(&pipeline)
        .bind(&group)
        .bind(priority)
        .bind(i64::MAX)
        .fetch_optional(&mut *conn)
        .await?;
        match next {
            Some(level) => {
                (pipeline, group, priority) = (level.0.clone(), level.1.clone(), level.2);
                levels.push(level);
            }
            None => return Ok(levels),
        }
    }
}

/// Each (pipeline, group) queue with records needing a worker: when its
/// earliest is due, and its levels due by `now`, highest first.
async fn queue_heads(
    conn: &mut SqliteConnection,
    now: UnixMs,
) -> StoreResult<Vec<(String, String, UnixMs, Levels)>> {
    let mut heads: Vec<(String, String, UnixMs, Levels)> = Vec::new();
    // In index order: a queue's levels are neighbours, lowest first.
    for (pipeline, group, priority, first) in queue_levels(conn).await? {
        let same = matches!(heads.last(), Some((p, g, _, _)) if *p == pipeline && *g == group);
        if !same {
            heads.push((pipeline, group, first, Vec::new()));
        }
        if let Some(head) = heads.last_mut() {
            head.2 = head.2.min(first);
            if first <= now {
                head.3.insert(0, priority);
            }
        }
    }
    Ok(heads)
}

/// Moves a finished file `from` to `to`, refusing to replace a file made
/// at `to` meanwhile: a hard link where the file system has them (it
/// fails if `to` exists), else a rename after checking.
pub fn place_new(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    match std::fs::hard_link(from, to) {
        Ok(()) => std::fs::remove_file(from)?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(e),
        Err(_) if to.exists() => return Err(std::io::ErrorKind::AlreadyExists.into()),
        Err(_) => std::fs::rename(from, to)?,
    }
    // The new name itself survives a power cut.
    let dir = match to.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// Creates `path`, which must not exist, readable and writable by its
/// owner only (0600 on Unix, whatever the umask): a backup holds the
/// session signing key, an export whatever records hold.
pub fn create_private(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::File::options();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)
}

/// A name beside `to` for the file being written before it is put in
/// place (`place_new`): `FILE.partial-<pid>-<random>`, so two writers of
/// one `FILE` (a scheduled backup and a manual one) never share, clear or
/// place each other's unfinished copy. `None` when `to` names no file.
pub fn partial_beside(to: &std::path::Path) -> Option<std::path::PathBuf> {
    let mut name = to.file_name()?.to_owned();
    name.push(format!(
        ".partial-{}-{:08x}",
        std::process::id(),
        fastrand::u32(..)
    ));
    Some(to.with_file_name(name))
}

/// Records and everything else, in one SQLite file.
pub type SqliteStore = SqlStore<Sqlite>;

/// The SQLite store's connections: the single writer, and the readers.
#[derive(Clone, Debug)]
pub struct SqlitePools {
    writer: SqlitePool,
    reader: SqlitePool,
}

/// How long a SQLite start-up waits while another process holds the
/// write lock (migrating a large file, say).
const START_WAIT: Duration = Duration::from_secs(600);

/// A start-up step tried again while another process holds SQLite's write
/// lock: each try has already waited the busy timeout (at least 100 ms).
pub(crate) struct BusyWait {
    why: &'static str,
    started: tokio::time::Instant,
    /// When the wait is next said in the log.
    say_at: Duration,
}

impl BusyWait {
    pub(crate) fn new(why: &'static str) -> Self {
        BusyWait {
            why,
            started: crate::domain::Clock::instant(&crate::domain::SystemClock),
            say_at: Duration::ZERO,
        }
    }

    /// `Ok` to try again after `e`, if it is SQLite's "database is locked"
    /// and the start-up has waited less than [`START_WAIT`]; `Err(e)`
    /// otherwise. Says every 10 s that it waits.
    pub(crate) fn again(&mut self, e: sqlx::Error) -> Result<(), sqlx::Error> {
        // Opening runs its pragmas within the pool's acquire timeout, which
        // may run out before the busy timeout does: the same wait.
        let busy = matches!(e, sqlx::Error::PoolTimedOut)
            || e.as_database_error()
                .and_then(|d| d.code())
                .and_then(|c| c.parse::<i32>().ok())
                .is_some_and(|c| c & 0xff == 5);
        let waited = crate::domain::Clock::instant(&crate::domain::SystemClock) - self.started;
        if !busy || waited > START_WAIT {
            return Err(e);
        }
        if waited >= self.say_at {
            tracing::info!(
                waited_s = waited.as_secs(),
                "waiting for another process to finish writing the database ({})",
                self.why
            );
            self.say_at = waited + Duration::from_secs(10);
        }
        Ok(())
    }
}

impl SqliteStore {
    /// Opens (creating if the URL says `mode=rwc`) the database file,
    /// waiting while another process holds its write lock (opening a new
    /// file sets it up, which a process creating or migrating the same
    /// file holds up).
    pub async fn connect(url: &str, opts: &ConnectOptions) -> Result<Self, sqlx::Error> {
        let mut wait = BusyWait::new("opening");
        loop {
            match Self::open(url, opts).await {
                Err(e) => wait.again(e)?,
                Ok(store) => return Ok(store),
            }
            // Not a tight loop should SQLite answer "busy" without waiting.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn open(url: &str, opts: &ConnectOptions) -> Result<Self, sqlx::Error> {
        let options = SqliteConnectOptions::from_str(url)?
            .journal_mode(SqliteJournalMode::Wal)
            // Durable commits: a transaction that returned is on disk.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(opts.busy_timeout)
            .foreign_keys(true);
        // Takes effect on a new file only (space freed by retention can
        // then be given back, `reclaim_space`), and setting it takes the
        // write lock: an existing file is opened without it, so a start
        // beside another process's long write meets the lock only if it
        // writes.
        let existing = std::fs::metadata(options.get_filename()).is_ok_and(|m| m.len() > 0);
        let options = if existing {
            options
        } else {
            options.auto_vacuum(SqliteAutoVacuum::Incremental)
        };
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(opts.acquire_timeout)
            .connect_with(options.clone())
            .await?;
        // An in-memory database exists once per connection: share the writer.
        let reader = if in_memory {
            writer.clone()
        } else {
            SqlitePoolOptions::new()
                .max_connections(opts.max_connections.max(1))
                .acquire_timeout(opts.acquire_timeout)
                .connect_with(options)
                .await?
        };
        Ok(SqlStore::new(
            SqlitePools { writer, reader },
            opts.keyring.clone(),
        ))
    }

    pub(crate) fn writer(&self) -> &SqlitePool {
        &self.pools.writer
    }

    /// Gives freed pages back to the file system, a bounded number per
    /// statement so the writer is not held long. A database created
    /// before incremental auto-vacuum was set keeps them (and reuses them).
    pub async fn reclaim_space(&self) -> Result<(), StoreError> {
        let mode: i64 = sqlx::query_scalar("PRAGMA auto_vacuum")
            .fetch_one(&self.pools.writer)
            .await?;
        // 2: incremental.
        if mode != 2 {
            return Ok(());
        }
        for _ in 0..16 {
            let free: i64 = sqlx::query_scalar("PRAGMA freelist_count")
                .fetch_one(&self.pools.writer)
                .await?;
            if free == 0 {
                break;
            }
            sqlx::query("PRAGMA incremental_vacuum(2000)")
                .execute(&self.pools.writer)
                .await?;
        }
        Ok(())
    }

    /// SQLite's `PRAGMA integrity_check`: `ok`, or what it found.
    pub async fn integrity_check(&self) -> Result<String, StoreError> {
        let rows: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
            .fetch_all(&self.pools.reader)
            .await?;
        Ok(rows.join("; "))
    }

    /// Copies the database, as one consistent moment of it, to a new file
    /// at `to` (SQLite's `VACUUM INTO`: a read transaction, so writers go
    /// on meanwhile). Written beside `to` and renamed into place once
    /// complete, so `to` is never a partial copy; an existing `to` is
    /// refused.
    pub async fn backup_into(&self, to: &std::path::Path) -> Result<(), StoreError> {
        if to.exists() {
            return Err(StoreError::Invalid(format!(
                "`{}` exists: back up into a new file",
                to.display()
            )));
        }
        let partial = partial_beside(to)
            .ok_or_else(|| StoreError::Invalid(format!("`{}` is not a file name", to.display())))?;
        let text = partial.to_str().ok_or_else(|| {
            StoreError::Invalid(format!("`{}` is not valid UTF-8", partial.display()))
        })?;
        // SQLite writes into an empty file that exists, keeping its mode:
        // made private first, so no moment of the copy is readable by others.
        create_private(&partial).map_err(|e| {
            StoreError::Invalid(format!("cannot create `{}`: {e}", partial.display()))
        })?;
        let copied = sqlx::query("VACUUM INTO $1")
            .bind(text.to_owned())
            .execute(&self.pools.reader)
            .await;
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&partial);
            return Err(e.into());
        }
        let placed = place_new(&partial, to);
        if placed.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        placed.map_err(|e| {
            StoreError::Invalid(format!("cannot move the copy to `{}`: {e}", to.display()))
        })
    }

    pub async fn close(&self) {
        self.pools.reader.close().await;
        self.pools.writer.close().await;
    }
}

impl SqlDb for Sqlite {
    type Pools = SqlitePools;

    const LOCK: &'static str = "";
    const LOCK_USERS: Option<&'static str> = None;
    const AUDIT: &'static str = "audit = 1";
    const DIALECT: Dialect = Dialect::Sqlite;
    const ANY_OF: (&'static str, &'static str) = ("IN (", ")");
    const UPDATE_KEY: &'static str = "";
    const LISTS_IN_PARTS: bool = false;

    fn reader(pools: &SqlitePools) -> &Pool<Sqlite> {
        &pools.reader
    }

    async fn begin_write(pools: &SqlitePools) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        pools.writer.begin_with("BEGIN IMMEDIATE").await
    }

    /// In-process wake-ups are the engine's; other processes on the same
    /// file find work on their timer.
    async fn notify_work(_tx: &mut Transaction<'static, Sqlite>) -> StoreResult<()> {
        Ok(())
    }

    /// Other processes on the same file read providers' state at their
    /// next claim.
    async fn notify_providers(_tx: &mut Transaction<'static, Sqlite>) -> StoreResult<()> {
        Ok(())
    }

    /// One writer: no contention to spread.
    fn counter_shard() -> i32 {
        0
    }

    /// The single writer makes select-then-update atomic: no other claimer
    /// can run between the two statements.
    async fn claim_in(
        tx: &mut Transaction<'static, Sqlite>,
        req: &ClaimRequest,
        keys: &crate::auth::seal::Keyring,
    ) -> StoreResult<Claimed> {
        let lease_until = req.now + i64::try_from(req.lease.as_millis()).unwrap_or(i64::MAX / 2);
        // The single writer: nothing moves between these reads and the
        // update. Each queue with due work gives its records, oldest first,
        // and `fair::take` shares the batch between them.
        let leased = capped_leases(tx, req).await?;
        let mut open = Vec::new();
        for (pipeline, group, first, levels) in queue_heads(tx, req.now).await? {
            if first > req.now {
                continue;
            }
            let room = req
                .group_caps
                .iter()
                .find(|(p, _)| *p == pipeline)
                .map(|(_, cap)| {
                    let held = leased.get(&(pipeline.clone(), group.clone())).copied();
                    u32::try_from((i64::from(*cap) - held.unwrap_or(0)).max(0)).unwrap_or(0)
                });
            if room == Some(0) {
                continue;
            }
            open.push((pipeline, group, levels, room));
        }
        // Each queue's share of the batch first; then, if short queues
        // left part of it, the queues that gave their whole share give
        // as much again as is missing: as many rows as `fair::take` can
        // use, without reading the whole batch from every queue.
        let share = req
            .limit
            .div_ceil(u32::try_from(open.len()).unwrap_or(u32::MAX).max(1));
        let within = |room: Option<u32>, n: u32| room.map_or(n, |r| r.min(n));
        let mut queues = Vec::with_capacity(open.len());
        for (pipeline, group, levels, room) in &open {
            let queue = (pipeline.as_str(), group.as_str(), levels.as_slice());
            let due = due_in_queue(tx, queue, req.now, within(*room, share)).await?;
            queues.push(fair::Queue { due, room: *room });
        }
        let got: usize = queues.iter().map(|q| q.due.len()).sum();
        let missing = (req.limit as usize).saturating_sub(got);
        if missing > 0 {
            for ((pipeline, group, levels, room), q) in open.iter().zip(queues.iter_mut()) {
                let had = q.due.len();
                // A queue short of its share has given all it has.
                if had < within(*room, share) as usize {
                    continue;
                }
                let take = within(*room, u32::try_from(had + missing).unwrap_or(u32::MAX));
                if take as usize > had {
                    let queue = (pipeline.as_str(), group.as_str(), levels.as_slice());
                    q.due = due_in_queue(tx, queue, req.now, take).await?;
                }
            }
        }
        // The queue served first turns from claim to claim, so that with
        // more queues than the batch each is cut in turn.
        static TURN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let start = TURN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let due = fair::take(&queues, req.limit, start);
        if due.is_empty() {
            return Ok(Default::default());
        }
        let ids: Vec<i64> = due.iter().map(|(id, _)| *id).collect();
        let taken_from: std::collections::HashMap<i64, Taken> = due.into_iter().collect();
        let sql = Self::statements().claim.get(|| format!(
            "UPDATE records SET state = 'running', lease_owner = $1, lease_until = $2, next_run_at = $2, \
             lease_token = lease_token + 1, updated_at = $3, claimed_at = $3 \
             WHERE id IN (SELECT value FROM json_each($4)) RETURNING {RECORD_COLUMNS}"
        ));
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(req.owner.clone())
            .bind(lease_until)
            .bind(req.now)
            .bind(Json(&ids))
            .fetch_all(&mut **tx)
            .await?;
        let mut claimed = map_sealed(&rows, keys, MapRow::record)?;
        // Priority then due order within each queue (as selected), then
        // round robin over the queues.
        let order: std::collections::HashMap<i64, usize> =
            ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        claimed.sort_by_key(|r| order.get(&r.id).copied());
        let claimed = fair::interleave(claimed, |r| (r.pipeline.clone(), r.group.clone()));
        Ok((claimed, taken_from))
    }

    async fn queue_heads_in(pools: &SqlitePools) -> StoreResult<Vec<(String, String, UnixMs)>> {
        let mut conn = pools.reader.acquire().await?;
        let heads = queue_heads(&mut conn, i64::MIN).await?;
        Ok(heads
            .into_iter()
            .map(|(p, g, first, _)| (p, g, first))
            .collect())
    }

    /// FTS5 walks a word's entries newest first and stops at the limit,
    /// however common the word.
    async fn search_ids(pools: &SqlitePools, q: &str, limit: i64) -> StoreResult<Vec<i64>> {
        let Some(query) = crate::domain::search::fts5_query(q) else {
            return Ok(Vec::new());
        };
        Ok(sqlx::query_scalar(
            "SELECT rowid FROM record_search WHERE record_search MATCH $1 \
             ORDER BY rowid DESC LIMIT $2",
        )
        .bind(query)
        .bind(limit)
        .fetch_all(&pools.reader)
        .await?)
    }

    /// A contentless FTS5 table keeps no document to compare with, so
    /// each document's digest is kept beside it (`search_digests`): the
    /// documents are made and read back with their digests, and only
    /// those whose text changed, or that have no digest (indexed by an
    /// older version, or never), are written: the old one deleted by
    /// rowid, the new one inserted and its digest kept, in one request.
    /// A digest says what the index holds for its record: whatever clears
    /// `record_search` must clear `search_digests` with it.
    async fn index_in(
        tx: &mut Transaction<'static, Sqlite>,
        records: &[i64],
        bare: &[i64],
    ) -> StoreResult<u64> {
        let sql = Self::statements().index_records.get(|| {
            // A value sealed at rest (`auth::seal`, text beginning with
            // U+0001) gives no words: its text is ciphertext.
            let values = |doc: &str| {
                format!(
                    "(SELECT group_concat(t.value, ' ') FROM json_tree(CASE WHEN json_valid({doc}) THEN {doc} END) t \
                     WHERE t.type IN ('text', 'integer', 'real') \
                     AND NOT (t.type = 'text' AND substr(t.value, 1, 1) = char(1)))"
                )
            };
            format!(
                "SELECT r.id, substr(concat_ws(' ', r.external_key, r.reason, r.error_code, {input}, \
                     (SELECT group_concat(concat_ws(' ', s.reason, s.error_code, s.job_id, {output}), ' ') \
                      FROM step_runs s WHERE s.record_id = r.id AND s.item_of IS NULL)), 1, 65536), \
                   (SELECT d.digest FROM search_digests d WHERE d.record_id = r.id) \
                 FROM records r WHERE r.id {in_ids}",
                input = bared(&values("r.input"), "r.id"),
                output = bared(&values("s.output"), "r.id"),
                in_ids = SqlStore::<Sqlite>::in_ids(),
            )
        });
        let made = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(Json(records))
            .bind(Json(bare))
            .fetch_all(&mut **tx)
            .await?;
        let (mut ids, mut docs, mut digests) = (Vec::new(), Vec::new(), Vec::new());
        for row in &made {
            // Read as bytes: text that is not UTF-8 (written by hand) is
            // indexed as far as it reads, and stops no batch.
            let (id, doc, kept): (i64, Vec<u8>, Option<i64>) =
                (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
            let digest = crate::domain::search::digest(&doc);
            if kept != Some(digest) {
                let doc = String::from_utf8(doc)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
                ids.push(id);
                docs.push((id, doc));
                digests.push((id, digest));
            }
        }
        if ids.is_empty() {
            return Ok(0);
        }
        let mut writes = super::backend::Writes::default();
        writes.add(UNINDEX_DOCUMENTS, &ids)?;
        writes.add(
            "INSERT INTO record_search (rowid, body) SELECT value ->> 0, value ->> 1 FROM json_each($1)",
            &docs,
        )?;
        writes.add(
            "INSERT INTO search_digests (record_id, digest) \
             SELECT value ->> 0, value ->> 1 FROM json_each($1) WHERE true \
             ON CONFLICT (record_id) DO UPDATE SET digest = excluded.digest",
            &digests,
        )?;
        Self::run_writes(tx, &writes).await?;
        Ok(ids.len() as u64)
    }

    async fn unindex_in(tx: &mut Transaction<'static, Sqlite>, records: &[i64]) -> StoreResult<()> {
        let mut writes = super::backend::Writes::default();
        writes.add(UNINDEX_DOCUMENTS, records)?;
        writes.add(
            "DELETE FROM search_digests WHERE record_id IN (SELECT CAST(value AS BIGINT) FROM json_each($1))",
            records,
        )?;
        Self::run_writes(tx, &writes).await
    }

    fn statements() -> &'static Statements {
        static STATEMENTS: Statements = Statements::new();
        &STATEMENTS
    }

    fn bind_json<'q, T: Serialize>(
        query: Query<'q, Sqlite, SqliteArguments>,
        value: T,
    ) -> Query<'q, Sqlite, SqliteArguments> {
        query.bind(Json(value))
    }

    /// One request to the writer's thread for every statement (its rows
    /// bound as text, which SQLite's JSON functions read as such); none
    /// when no statement has rows.
    async fn run_writes(
        tx: &mut Transaction<'static, Sqlite>,
        writes: &super::backend::Writes,
    ) -> StoreResult<()> {
        if writes.is_idle() {
            return Ok(());
        }
        let mut query = sqlx::query(sqlx::AssertSqlSafe(writes.joined()));
        for (_, rows) in writes.parts() {
            query = query.bind(rows.map_or("[]", |r| r.get()));
        }
        query.execute(&mut **tx).await?;
        Ok(())
    }
}

/// Deletes the search documents of the records in `$1` (their digests
/// stay: a rewrite keeps its own, a purge deletes them beside).
const UNINDEX_DOCUMENTS: &str =
    "DELETE FROM record_search WHERE rowid IN (SELECT CAST(value AS BIGINT) FROM json_each($1))";

/// `expr`, or NULL for a record (`id`) among the bare ones (`$2`): a
/// search document without its input and output values.
fn bared(expr: &str, id: &str) -> String {
    format!(
        "CASE WHEN {id} IN (SELECT CAST(value AS BIGINT) FROM jsonb_each($2)) THEN NULL ELSE {expr} END"
    )
}
