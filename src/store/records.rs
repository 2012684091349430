//! Records as the pages, the API and the operators see them: enqueue,
//! read, list and find; and the changes the domain decides for them (an
//! operator's action, a provider's reversal, the system's resume of a
//! parked record) applied under the record's lock.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Row, Type};

use super::backend::{BindJson, RowsAffected, SqlDb};
use super::counts::CountDeltas;
use super::filter::push_record_filter;
use super::rows::{MapRow, RECORD_COLUMNS, STEP_COLUMNS, map_sealed};
use super::sql::SqlStore;
use super::{
    ActionRequest, Created, EventRow, NewRecord, Page, RecordFilter, StoreError, StoreResult,
    into_page, page_limit,
};
use super::{Cluster, ResumeDue, ReverseRequest};
use crate::domain::action;
use crate::domain::each::Tally;
use crate::domain::reversal;
use crate::domain::{Record, StepRun, Trigger, UnixMs};

/// Records: enqueued, read, listed, found, and changed by an operator.
#[async_trait::async_trait]
pub trait Records: Send + Sync {
    async fn create_record(&self, new: NewRecord, now: UnixMs) -> StoreResult<Created>;
    /// Enqueues many records in one transaction (one commit, one wake-up):
    /// the same per record as [`create_record`](Self::create_record), in
    /// order; at most [`MAX_BATCH`].
    async fn create_records(&self, batch: Vec<NewRecord>, now: UnixMs)
    -> StoreResult<Vec<Created>>;
    async fn get_record(&self, id: i64) -> StoreResult<Option<Record>>;
    /// The records of `ids` that exist, in one statement.
    async fn get_records(&self, ids: &[i64]) -> StoreResult<Vec<Record>>;
    /// What a record's page shows has changed when this has: the record's
    /// row (`updated_at`, `next_run_at`) and its newest attempt, event and
    /// intent (a confirmation poll, a reversal keeping the state, a call
    /// written down before it leaves touch no `updated_at`). One statement
    /// of indexed probes, for a page watching the record; `None` when there
    /// is no such record.
    async fn record_version(&self, id: i64) -> StoreResult<Option<[i64; 5]>>;
    /// The records `q` names exactly: by id, by external key (any
    /// pipeline), or by a provider's job id (`providers`: whose jobs to
    /// look in), each an indexed probe; at most 50, newest first.
    async fn find_records(&self, q: &str, providers: &[String]) -> StoreResult<Vec<Record>>;
    async fn list_records(&self, filter: &RecordFilter) -> StoreResult<Page<Record>>;
    async fn step_runs(&self, record_id: i64) -> StoreResult<Vec<StepRun>>;
    /// The step runs of many records in one query (a claimed batch).
    async fn step_runs_of(&self, record_ids: &[i64]) -> StoreResult<Vec<StepRun>>;
    /// An operator action through the transition table, audited.
    async fn act(&self, req: &ActionRequest) -> StoreResult<Record>;
    /// Resumes parked records whose condition holds: a time come, or a
    /// provider named in `req.providers` (lowest id first, up to its
    /// count). Each is audited as a `resume` by `system` naming the
    /// condition. A record acted on meanwhile (no longer parked, or parked
    /// on another condition) is left alone. Returns those resumed.
    async fn resume_parked(&self, req: &ResumeDue) -> StoreResult<Vec<Record>>;
    /// Applies a provider's reversal through the transition table, audited
    /// as a `reversed` event.
    async fn reverse(&self, req: &ReverseRequest) -> StoreResult<Record>;
    /// Makes a waiting record due now (a delivery arrived for it).
    async fn wake_record(&self, record_id: i64, now: UnixMs) -> StoreResult<()>;
    /// Where the items of a record's step for each item stand: counted
    /// (its `total` left for the caller), and the unfinished ones due by
    /// `now`, at most `limit`, lowest index first. The tally counts those
    /// due beyond `limit` as unfinished and due; the ones returned are the
    /// caller's to count.
    async fn items(
        &self,
        record_id: i64,
        step: &str,
        now: UnixMs,
        limit: i64,
    ) -> StoreResult<(Tally, Vec<StepRun>)>;
    /// A step's unfinished items that wait with no time (each on its
    /// child record), in order, at most `limit`.
    async fn held_items(&self, record_id: i64, step: &str, limit: i64)
    -> StoreResult<Vec<StepRun>>;
    /// The outputs of a step's succeeded items, by index.
    async fn item_outputs(&self, record_id: i64, step: &str) -> StoreResult<Vec<(i64, Value)>>;
    /// A record's unfinished items stopped on a call whose outcome is not
    /// known, with no lookup pending (at most 10): what "it took effect"
    /// answers for.
    async fn uncertain_items(&self, record_id: i64) -> StoreResult<Vec<StepRun>>;
    /// A step's item runs from index `from`, at most `limit`, in order.
    async fn item_runs(
        &self,
        record_id: i64,
        step: &str,
        from: i64,
        limit: i64,
    ) -> StoreResult<Vec<StepRun>>;
}

/// A step run's state that has not ended, in SQL.
pub(super) const OPEN: &str = "state NOT IN ('succeeded', 'failed', 'skipped')";

/// An item's run that has started (`domain::each::started`), in SQL.
const STARTED: &str = "(attempts > 0 OR job_id IS NOT NULL)";

/// An item held on its child record (`domain::each::held`), in SQL: no
/// time, and only the child, coming to rest, tells it something new.
pub(super) fn held() -> String {
    use crate::domain::child::{AWAITING, PARKED};
    format!(
        "(state = 'waiting' AND next_run_at IS NULL \
         AND COALESCE(error_code, '') IN ('{AWAITING}', '{PARKED}'))"
    )
}

#[async_trait::async_trait]
impl<DB> Records for SqlStore<DB>
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
    async fn create_record(&self, new: NewRecord, now: UnixMs) -> StoreResult<Created> {
        let mut created = self.create_records(vec![new], now).await?;
        created
            .pop()
            .ok_or_else(|| StoreError::Invalid("nothing enqueued".into()))
    }

    async fn create_records(
        &self,
        batch: Vec<NewRecord>,
        now: UnixMs,
    ) -> StoreResult<Vec<Created>> {
        if batch.iter().any(|n| n.pipeline.is_empty()) {
            return Err(StoreError::Invalid("pipeline name is empty".into()));
        }
        for n in &batch {
            crate::domain::check_priority(Some(n.priority)).map_err(StoreError::Invalid)?;
        }
        // Refused on both backends alike (PostgreSQL cannot store it).
        let nul = |s: &str| s.contains('\0');
        if batch.iter().any(|n| {
            nul(&n.pipeline)
                || n.external_key.as_deref().is_some_and(nul)
                || n.group.as_deref().is_some_and(nul)
                || crate::domain::json_has_nul(&n.input)
        }) {
            return Err(StoreError::Invalid(
                "a NUL character (\\u0000) in the pipeline, key, group or input".into(),
            ));
        }
        if batch.len() > crate::store::MAX_BATCH {
            return Err(StoreError::Invalid(format!(
                "at most {} records per batch",
                crate::store::MAX_BATCH
            )));
        }
        if let Some(inserted) =
            DB::insert_records_at_once(&self.pools, &batch, now, &self.keyring()).await?
        {
            let slots = Self::match_inserted(&batch, inserted, None)?;
            return self.fill_repeats(&batch, slots).await;
        }
        let mut tx = self.begin_write().await?;
        let mut deltas = CountDeltas::default();
        let slots = self
            .insert_records(&mut tx, &batch, now, &mut deltas)
            .await?;
        Self::apply_counts(&mut tx, &deltas).await?;
        if slots.iter().any(Option::is_some) {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        self.fill_repeats(&batch, slots).await
    }

    async fn get_record(&self, id: i64) -> StoreResult<Option<Record>> {
        let sql = format!("SELECT {RECORD_COLUMNS} FROM records WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(|r| r.record(&self.keyring())).transpose()
    }

    async fn get_records(&self, ids: &[i64]) -> StoreResult<Vec<Record>> {
        self.records_by_ids(ids).await
    }

    async fn record_version(&self, id: i64) -> StoreResult<Option<[i64; 5]>> {
        let row = sqlx::query(
            "SELECT r.updated_at, COALESCE(r.next_run_at, 0), \
                    COALESCE((SELECT MAX(a.id) FROM attempts a WHERE a.record_id = r.id), 0), \
                    COALESCE((SELECT MAX(e.id) FROM events e WHERE e.record_id = r.id), 0), \
                    COALESCE((SELECT MAX(i.id) FROM attempt_intents i WHERE i.record_id = r.id), 0) \
             FROM records r WHERE r.id = $1",
        )
        .bind(id)
        .fetch_optional(self.reader())
        .await?;
        row.map(|r| {
            let mut v = [0i64; 5];
            for (i, slot) in v.iter_mut().enumerate() {
                *slot = r.try_get::<i64, _>(i)?;
            }
            Ok(v)
        })
        .transpose()
    }

    async fn find_records(&self, q: &str, providers: &[String]) -> StoreResult<Vec<Record>> {
        let q = q.trim();
        let mut ids = std::collections::BTreeSet::new();
        if q.is_empty() || q.contains('\0') {
            return Ok(Vec::new());
        }
        let digits = q.strip_prefix('#').unwrap_or(q);
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(id) = digits.parse::<i64>() {
                ids.insert(id);
            }
        }
        // Resting and running records apart, each through its index
        // (migration 20).
        let keyed: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM records WHERE external_key = $1 AND state <> 'running' \
             UNION ALL SELECT id FROM records WHERE external_key = $1 AND state = 'running' \
             LIMIT 50",
        )
        .bind(q.to_owned())
        .fetch_all(self.reader())
        .await?;
        ids.extend(keyed);
        for p in providers {
            let jobs: Vec<i64> = sqlx::query_scalar(
                "SELECT record_id FROM step_runs WHERE provider = $1 AND job_id = $2 LIMIT 50",
            )
            .bind(p.clone())
            .bind(q.to_owned())
            .fetch_all(self.reader())
            .await?;
            ids.extend(jobs);
        }
        // The newest 50, read in one statement.
        let ids: Vec<i64> = ids.into_iter().rev().take(50).collect();
        self.records_by_ids(&ids).await
    }

    async fn list_records(&self, filter: &RecordFilter) -> StoreResult<Page<Record>> {
        use crate::store::filter::{MAX_MERGED, Part, list_within, needs_parts, needs_windows};
        if let Some(within) = &filter.pipelines {
            if filter.pipeline.is_some() || within.len() <= MAX_MERGED {
                return list_within(self, filter, within).await;
            }
        }
        let limit = page_limit(filter.limit);
        let query = |f: &RecordFilter, floor: Option<i64>, n: i64| {
            let mut qb = sqlx::QueryBuilder::<DB>::new("");
            let one = |qb: &mut sqlx::QueryBuilder<DB>, part: Part| {
                qb.push(format_args!("SELECT {RECORD_COLUMNS} FROM records"));
                push_record_filter(qb, f, floor, part);
                qb.push(" ORDER BY id DESC LIMIT ").push_bind(n);
            };
            if DB::LISTS_IN_PARTS && needs_parts(f) {
                // The newest `n` resting and the newest `n` running,
                // each through its index, merged.
                qb.push("SELECT * FROM (");
                one(&mut qb, Part::Resting);
                qb.push(") resting UNION ALL SELECT * FROM (");
                one(&mut qb, Part::Running);
                qb.push(") running ORDER BY id DESC LIMIT ").push_bind(n);
            } else {
                one(&mut qb, Part::All);
            }
            qb
        };
        if !needs_windows(filter, DB::LISTS_IN_PARTS) {
            let rows = query(filter, None, i64::from(limit) + 1)
                .build()
                .fetch_all(self.reader())
                .await?;
            return Ok(into_page(
                map_sealed(&rows, &self.keyring(), MapRow::record)?,
                limit,
                |r| r.id,
            ));
        }
        // Several filters and no index for them together: search
        // windows of ids from the top down, at most LIST_SCAN_IDS ids
        // per call, so a search that matches little stays bounded.
        // A short page with a `next` says "keep searching from here".
        use crate::store::{LIST_SCAN_IDS, LIST_WINDOW_IDS};
        let top = match filter.before {
            Some(b) => b,
            None => {
                let max: Option<i64> = sqlx::query_scalar("SELECT MAX(id) FROM records")
                    .fetch_one(self.reader())
                    .await?;
                max.unwrap_or(0) + 1
            }
        };
        // Saturating: `before` is the caller's, any i64 (one at or below
        // 1 finds nothing: the loop's first window is its last).
        let stop = top.saturating_sub(LIST_SCAN_IDS).max(1);
        let mut upper = top;
        let mut items: Vec<Record> = Vec::new();
        loop {
            let lower = upper.saturating_sub(LIST_WINDOW_IDS).max(stop);
            let mut f = filter.clone();
            f.before = Some(upper);
            let want = i64::from(limit) + 1 - items.len() as i64;
            let rows = query(&f, Some(lower), want)
                .build()
                .fetch_all(self.reader())
                .await?;
            items.extend(map_sealed(&rows, &self.keyring(), MapRow::record)?);
            if items.len() > limit as usize {
                return Ok(into_page(items, limit, |r| r.id));
            }
            if lower <= 1 {
                return Ok(Page { items, next: None });
            }
            if lower <= stop {
                return Ok(Page {
                    items,
                    next: Some(lower),
                });
            }
            upper = lower;
        }
    }

    async fn step_runs(&self, record_id: i64) -> StoreResult<Vec<StepRun>> {
        let sql = format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 AND item_of IS NULL ORDER BY step"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_run)
    }

    async fn step_runs_of(&self, record_ids: &[i64]) -> StoreResult<Vec<StepRun>> {
        let sql = DB::statements().step_runs_of.get(|| format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id {}SELECT CAST(value AS BIGINT) FROM {}{} \
             AND item_of IS NULL ORDER BY record_id, step",
            DB::ANY_OF.0,
            DB::DIALECT.rows(),
            DB::ANY_OF.1
        ));
        let rows = sqlx::query(sql)
            .bind_json(record_ids)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_run)
    }

    async fn act(&self, req: &ActionRequest) -> StoreResult<Record> {
        crate::domain::action::check_request(req)?;
        let installation = self.installation_id().await?;
        let mut tx = self.begin_write().await?;
        // A child's parent is locked first (its id is the lower, as a
        // group commit locks them): an action that brings the child to
        // rest wakes it in this transaction.
        let parent: Option<i64> = sqlx::query_scalar("SELECT parent_id FROM records WHERE id = $1")
            .bind(req.record_id)
            .fetch_optional(&mut *tx)
            .await?
            .flatten();
        if let Some(p) = parent {
            Self::lock_ids(&mut tx, &[p]).await?;
        }
        let rec = self.lock_found(&mut tx, req.record_id).await?;
        let mut deltas = CountDeltas::default();
        let moved = match self
            .act_locked(&mut tx, &installation, &rec, req, None, &mut deltas)
            .await
        {
            Ok(moved) => moved,
            Err(refused) => {
                // Let go of the record's row now, not when the
                // connection is next used: a claim skips a locked row.
                let _ = tx.rollback().await;
                return Err(refused);
            }
        };
        Self::apply_counts(&mut tx, &deltas).await?;
        if moved.next_run_at.is_some() {
            DB::notify_work(&mut tx).await?;
        }
        if let (Some(p), true) = (parent, moved.state.is_at_rest()) {
            Self::wake_all(&mut tx, &[p], req.now).await?;
        }
        tx.commit().await?;
        Ok(moved)
    }

    async fn resume_parked(&self, req: &crate::store::ResumeDue) -> StoreResult<Vec<Record>> {
        // Candidates first (through the partial indexes), then each one
        // locked and checked again: an operator may have acted meanwhile,
        // or another node resumed it.
        let mut ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM records WHERE park_until_at IS NOT NULL AND park_until_at <= $1 \
             ORDER BY park_until_at, id LIMIT $2",
        )
        .bind(req.now)
        .bind(i64::from(req.limit))
        .fetch_all(self.reader())
        .await?;
        for (provider, n) in &req.providers {
            let waiting: Vec<i64> = sqlx::query_scalar(
                "SELECT id FROM records WHERE park_until_provider = $1 ORDER BY id LIMIT $2",
            )
            .bind(provider.clone())
            .bind(i64::from(*n))
            .fetch_all(self.reader())
            .await?;
            ids.extend(waiting);
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        ids.sort_unstable();
        ids.dedup();
        let installation = self.installation_id().await?;
        let mut tx = self.begin_write().await?;
        // Every candidate locked at once, in id order, then the counters
        // once at the end: the same order as every multi-row write.
        let held = self.lock_records(&mut tx, &ids).await?;
        let mut deltas = CountDeltas::default();
        let mut resumed = Vec::new();
        for id in ids {
            let Some(rec) = held.get(&id) else {
                continue;
            };
            let providers = req.providers.iter().map(|(p, _)| p.as_str());
            let Some((action, until)) = action::resume_due(rec, req.now, providers) else {
                continue;
            };
            let moved = self
                .act_locked(
                    &mut tx,
                    &installation,
                    rec,
                    &action,
                    Some(&until),
                    &mut deltas,
                )
                .await?;
            resumed.push(moved);
        }
        Self::apply_counts(&mut tx, &deltas).await?;
        if !resumed.is_empty() {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(resumed)
    }

    async fn reverse(&self, req: &crate::store::ReverseRequest) -> StoreResult<Record> {
        let installation = self.installation_id().await?;
        let mut tx = self.begin_write().await?;
        let rec = self.lock_found(&mut tx, req.record_id).await?;
        if !Self::reversal_applies(&mut tx, &rec, req).await? {
            return Ok(rec);
        }
        let decided = reversal::decide(rec.state, req.policy, rec.park_until.is_some())?;
        let detail = reversal::detail(req.detail.clone(), req.policy);
        let event = EventRow {
            record_id: Some(rec.id),
            at: req.now,
            kind: Trigger::Reversed(req.policy).kind(),
            actor: "provider",
            audit: false,
            from: Some(rec.state),
            to: Some(decided.to),
            step: Some(&req.step),
            reason: Some(&req.reason),
            detail: Some(&detail),
            claimed_at: None,
            claimed_by: None,
        };
        self.reverse_steps(&mut tx, &installation, rec.id, req, decided.steps)
            .await?;
        let rec = if decided.to == rec.state {
            self.insert_event(&mut tx, &event).await?;
            if decided.needs_human {
                self.park_for_a_human(&mut tx, rec.id, &req.reason, req.now)
                    .await?
            } else {
                rec
            }
        } else {
            let next = decided.wake.then_some(req.now);
            let mut deltas = CountDeltas::default();
            let moved = self
                .move_record(
                    &mut tx,
                    &rec,
                    (decided.to, None),
                    next,
                    req.now,
                    event,
                    Some(crate::domain::REVERSED),
                    &mut deltas,
                )
                .await?;
            Self::apply_counts(&mut tx, &deltas).await?;
            moved
        };
        if decided.wake {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(rec)
    }

    async fn wake_record(&self, record_id: i64, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE records SET next_run_at = $1 WHERE id = $2 AND state = 'waiting' AND next_run_at > $1",
        )
        .bind(now)
        .bind(record_id)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() > 0 {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn items(
        &self,
        record_id: i64,
        step: &str,
        now: UnixMs,
        limit: i64,
    ) -> StoreResult<(Tally, Vec<StepRun>)> {
        // An item held on its child record is not due (the engine reads
        // those with `held_items`).
        let due = format!(
            "(next_run_at <= $3 OR (next_run_at IS NULL AND NOT {}))",
            held()
        );
        let count = |cond: &str| {
            format!("CAST(COALESCE(SUM(CASE WHEN {cond} THEN 1 ELSE 0 END), 0) AS BIGINT)")
        };
        let sql = format!(
            "SELECT CAST(COALESCE(MAX(item_no) + 1, 0) AS BIGINT), {}, {}, {}, {}, \
               MIN(CASE WHEN {OPEN} AND next_run_at > $3 THEN next_run_at END), {}, {}, {}, {} \
             FROM step_runs WHERE record_id = $1 AND item_of = $2",
            count("state = 'succeeded'"),
            count("state IN ('failed', 'skipped')"),
            count(OPEN),
            count(&format!("{OPEN} AND {due} AND {STARTED}")),
            count("state = 'waiting' AND next_run_at > $3"),
            count("state = 'retrying' AND next_run_at > $3"),
            count(&format!("{OPEN} AND {STARTED}")),
            count(&format!("{OPEN} AND {due} AND NOT {STARTED}")),
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .bind(step.to_owned())
            .bind(now)
            .fetch_one(self.reader())
            .await?;
        let sql = format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 AND item_of = $2 \
             AND {OPEN} AND {due} ORDER BY item_no LIMIT $4"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .bind(step.to_owned())
            .bind(now)
            .bind(limit)
            .fetch_all(self.reader())
            .await?;
        let runs = map_sealed(&rows, &self.keyring(), MapRow::step_run)?;
        let loaded = i64::try_from(runs.len()).unwrap_or(i64::MAX);
        let loaded_started = runs
            .iter()
            .filter(|r| crate::domain::each::started(r.attempts, r.job_id.as_deref()))
            .count();
        let loaded_started = i64::try_from(loaded_started).unwrap_or(0);
        let (open, due): (i64, i64) = (row.try_get(3)?, row.try_get(4)?);
        let (started, due_fresh): (i64, i64) = (row.try_get(8)?, row.try_get(9)?);
        let tally = Tally {
            total: 0,
            next: row.try_get(0)?,
            succeeded: row.try_get(1)?,
            failed: row.try_get(2)?,
            open: open - loaded,
            started: started - loaded_started,
            due_now: due > loaded_started,
            fresh_due: due_fresh > loaded - loaded_started,
            later_at: row.try_get(5)?,
            waiting: row.try_get::<i64, _>(6)? > 0,
            retrying: row.try_get::<i64, _>(7)? > 0,
            // Counted as they are read (`held_items`).
            held: false,
            child_parked: false,
        };
        Ok((tally, runs))
    }

    async fn held_items(
        &self,
        record_id: i64,
        step: &str,
        limit: i64,
    ) -> StoreResult<Vec<StepRun>> {
        let sql = format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 AND item_of = $2 \
             AND {} ORDER BY item_no LIMIT $3",
            held()
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .bind(step.to_owned())
            .bind(limit)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_run)
    }

    async fn item_outputs(&self, record_id: i64, step: &str) -> StoreResult<Vec<(i64, Value)>> {
        let rows = sqlx::query(
            "SELECT item_no, output FROM step_runs WHERE record_id = $1 AND item_of = $2 \
             AND state = 'succeeded' ORDER BY item_no",
        )
        .bind(record_id)
        .bind(step.to_owned())
        .fetch_all(self.reader())
        .await?;
        let keys = self.keyring();
        rows.iter()
            .map(|r| {
                let output = r.sealed_json("output", crate::auth::seal::Field::Output, &keys)?;
                Ok((r.try_get(0)?, output.unwrap_or(Value::Null)))
            })
            .collect()
    }

    async fn uncertain_items(&self, record_id: i64) -> StoreResult<Vec<StepRun>> {
        let sql = format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 AND item_of IS NOT NULL \
             AND {OPEN} AND error_code = $2 AND next_run_at IS NULL AND job_id IS NULL \
             ORDER BY item_of, item_no LIMIT 10"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .bind(crate::domain::OUTCOME_UNCERTAIN)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_run)
    }

    async fn item_runs(
        &self,
        record_id: i64,
        step: &str,
        from: i64,
        limit: i64,
    ) -> StoreResult<Vec<StepRun>> {
        let sql = format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 AND item_of = $2 \
             AND item_no >= $3 ORDER BY item_no LIMIT $4"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .bind(step.to_owned())
            .bind(from)
            .bind(limit)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_run)
    }
}
