//! Chores that keep the database in shape: retention, the search index,
//! step statistics, cron schedules and webhook deliveries no record claimed.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Row, Type};

use super::StepRollup;
use super::backend::{BindJson, RowsAffected, SqlDb};
use super::counts::{CountDeltas, Where};
use super::rows::{MapRow, ROLLUP_COLUMNS, map_all};
use super::sql::{Rollups, SqlStore};
use super::{
    DataKeyRow, HOUR_MS, PurgeRun, Purged, Resealed, ScheduleAdvance, SealedColumn, StoreError,
    StoreResult, TriggerDelivery,
};
use crate::domain::{RecordState, ScheduleRow, UnixMs};

/// Housekeeping: retention, the search index, statistics, schedules and
/// orphan webhook deliveries.
#[async_trait::async_trait]
pub trait Housekeeping: Send + Sync {
    /// Gives a delivery id back (its processing failed after the delivery
    /// was stored; the provider's retry must get through).
    async fn forget_delivery(&self, provider: &str, delivery_id: &str) -> StoreResult<()>;
    /// The data keys values were ever sealed with (migration 27).
    async fn data_keys(&self) -> StoreResult<Vec<DataKeyRow>>;
    /// Lists `id` (with its check value) as a key values are sealed with,
    /// no longer retired if it was.
    async fn note_data_key(&self, id: &str, check_value: &str, now: UnixMs) -> StoreResult<()>;
    /// Retires every listed key but `keep`: no value is sealed with them.
    async fn retire_data_keys(&self, keep: Option<&str>, now: UnixMs) -> StoreResult<Vec<String>>;
    /// Re-seals, with the current data key (or writes in clear, when there
    /// is none), the values of `column` in one batch after `after` that
    /// are not sealed with it; a value changed meanwhile is left.
    async fn reseal(&self, column: SealedColumn, after: i64, limit: u32) -> StoreResult<Resealed>;
    /// Deletes the deliveries received before `before` that no step ever
    /// took (their job id matched none); returns how many.
    async fn purge_orphan_deliveries(&self, before: UnixMs) -> StoreResult<u64>;
    /// Deletes the group counter rows of up to `limit` (pipeline, group,
    /// state) keys whose rows add up to nothing (a group whose records all
    /// finished), so that the table holds the groups with work. Rows
    /// another transaction is moving are left for the next call; returns
    /// the rows deleted.
    async fn forget_idle_groups(&self, limit: u32) -> StoreResult<u64>;
    /// Keeps a trigger's delivery and its verdict (its `id` is assigned).
    async fn record_trigger_delivery(&self, d: &TriggerDelivery) -> StoreResult<()>;
    /// The newest `limit` deliveries of `trigger` (of every trigger when
    /// `None`), newest first.
    async fn trigger_deliveries(
        &self,
        trigger: Option<&str>,
        limit: u32,
    ) -> StoreResult<Vec<TriggerDelivery>>;
    /// Writes (replaces) this node's rows for the given minutes.
    async fn save_rollups(&self, rows: &[StepRollup]) -> StoreResult<()>;
    /// Every node's rows from `since` on: minute rows, and hour rows (with
    /// `minute` the hour's start) of the hours that end after `since`.
    async fn rollups_since(&self, since: UnixMs) -> StoreResult<Vec<StepRollup>>;
    /// Folds every node's minute rows older than `before` into hour rows,
    /// one hour per transaction, oldest first; returns how many minute rows
    /// were folded. Nodes may run it at once: each hour's minute rows are
    /// locked as they are read, so a second compaction waits and then finds
    /// them gone.
    async fn compact_rollups(&self, before: UnixMs) -> StoreResult<u64>;
    /// Deletes rollups, delivery ids, trigger deliveries, notices (by
    /// their change and last delivery) and login counters older than
    /// `before`; returns how many rows.
    async fn purge_stats(&self, before: UnixMs) -> StoreResult<u64>;
    /// Every schedule's row, by pipeline.
    async fn schedules(&self) -> StoreResult<Vec<ScheduleRow>>;
    /// Moves a schedule's watermark from `from` (as read) to `to`: true if
    /// this call moved it, false if another node had moved it first (its
    /// pass stands; this one's fired records, keyed by tick, are the same
    /// records).
    async fn advance_schedule(&self, adv: &ScheduleAdvance) -> StoreResult<bool>;
    /// Deletes up to `limit` records of `pipeline` that finished
    /// (succeeded, failed, cancelled) before `finished_before`, oldest
    /// first, in one transaction: their attempts, steps, callbacks and own
    /// events with them (audit entries stay), the counters moved. Records
    /// another transaction holds are left for the next batch.
    /// Returns the batch and the run's audit entry (written or updated in
    /// the batch's transaction when it removed something).
    async fn purge_finished(
        &self,
        pipeline: &str,
        finished_before: UnixMs,
        limit: u32,
        run: &PurgeRun,
    ) -> StoreResult<(Purged, Option<i64>)>;
    /// What [`purge_finished`](Self::purge_finished) would delete, all
    /// batches together, and how many attempts
    /// [`strip_bodies`](Self::strip_bodies) would blank for `strip_before`.
    async fn count_purgeable(
        &self,
        pipeline: &str,
        finished_before: Option<UnixMs>,
        strip_before: Option<UnixMs>,
    ) -> StoreResult<Purged>;
    /// Blanks the excerpt and request of the attempts of up to `limit`
    /// records of `pipeline` that finished before `finished_before`, from
    /// where the last call stopped (kept per pipeline). Returns the
    /// attempts blanked, whether records remain, and the run's audit entry
    /// (as [`purge_finished`](Self::purge_finished)).
    async fn strip_bodies(
        &self,
        pipeline: &str,
        finished_before: UnixMs,
        limit: u32,
        run: &PurgeRun,
    ) -> StoreResult<(i64, bool, Option<i64>)>;
    /// Where the search indexer stopped: every event up to this id has
    /// been indexed or given up on (`domain::search::Progress`).
    async fn search_progress(&self) -> StoreResult<i64>;
    /// The events above `after` (the first `limit`, by id) and those of
    /// `gaps` that are there now.
    async fn search_events(
        &self,
        after: i64,
        gaps: &[i64],
        limit: u32,
    ) -> StoreResult<Vec<crate::domain::search::SeenEvent>>;
    /// Writes the search documents of `records` anew where they changed
    /// (those purged are skipped; those also in `bare` without their
    /// input and output values) and moves the stored progress up to
    /// `settled`, in one transaction; returns the documents written.
    async fn index_records(&self, records: &[i64], bare: &[i64], settled: i64) -> StoreResult<u64>;
}

#[async_trait::async_trait]
impl<DB> Housekeeping for SqlStore<DB>
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
    async fn data_keys(&self) -> StoreResult<Vec<DataKeyRow>> {
        let rows: Vec<(String, String, i64, Option<i64>)> = sqlx::query_as(
            "SELECT id, check_value, added_at, retired_at FROM data_keys ORDER BY id",
        )
        .fetch_all(self.reader())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, check_value, added_at, retired_at)| DataKeyRow {
                id,
                check_value,
                added_at,
                retired_at,
            })
            .collect())
    }

    async fn note_data_key(&self, id: &str, check_value: &str, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO data_keys (id, check_value, added_at) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO UPDATE SET retired_at = NULL",
        )
        .bind(id.to_owned())
        .bind(check_value.to_owned())
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn retire_data_keys(&self, keep: Option<&str>, now: UnixMs) -> StoreResult<Vec<String>> {
        let mut tx = self.begin_write().await?;
        let gone: Vec<String> = sqlx::query_scalar(
            "UPDATE data_keys SET retired_at = $1 \
             WHERE retired_at IS NULL AND id <> COALESCE($2, '') RETURNING id",
        )
        .bind(now)
        .bind(keep.map(str::to_owned))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(gone)
    }

    async fn reseal(&self, column: SealedColumn, after: i64, limit: u32) -> StoreResult<Resealed> {
        self.reseal_batch(column, after, limit).await
    }

    async fn forget_delivery(&self, provider: &str, delivery_id: &str) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM webhook_deliveries WHERE provider = $1 AND delivery_id = $2")
            .bind(provider.to_owned())
            .bind(delivery_id.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record_trigger_delivery(&self, d: &TriggerDelivery) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO trigger_deliveries (trigger, pipeline, received_at, verdict, status, \
             event_id, event_type, record_id, detail) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(d.trigger.clone())
        .bind(d.pipeline.clone())
        .bind(d.received_at)
        .bind(d.verdict.clone())
        .bind(i64::from(d.status))
        .bind(d.event_id.clone())
        .bind(d.event_type.clone())
        .bind(d.record_id)
        .bind(d.detail.clone())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn trigger_deliveries(
        &self,
        trigger: Option<&str>,
        limit: u32,
    ) -> StoreResult<Vec<TriggerDelivery>> {
        const COLUMNS: &str = "id, trigger, pipeline, received_at, verdict, status, event_id, \
                               event_type, record_id, detail";
        // Two statements, so that a trigger's is read through its index.
        let rows = match trigger {
            Some(t) => {
                let sql = format!(
                    "SELECT {COLUMNS} FROM trigger_deliveries WHERE trigger = $1 \
                     ORDER BY id DESC LIMIT $2"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(t.to_owned())
                    .bind(i64::from(limit))
                    .fetch_all(self.reader())
                    .await?
            }
            None => {
                let sql =
                    format!("SELECT {COLUMNS} FROM trigger_deliveries ORDER BY id DESC LIMIT $1");
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(i64::from(limit))
                    .fetch_all(self.reader())
                    .await?
            }
        };
        map_all(&rows, MapRow::trigger_delivery)
    }

    async fn purge_orphan_deliveries(&self, before: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        // `callbacks_pending` leads with `record_id`: an orphan never had one.
        let gone = sqlx::query(
            "DELETE FROM callbacks WHERE record_id IS NULL AND processed_at IS NULL AND received_at < $1",
        )
        .bind(before)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(gone.rows_affected())
    }

    async fn forget_idle_groups(&self, limit: u32) -> StoreResult<u64> {
        use super::batch::{self, GROUP_COUNT_COLS, GroupCountJson};
        let mut tx = self.begin_write().await?;
        let idle = sqlx::query(
            "SELECT pipeline, group_key, state FROM group_counts \
             GROUP BY pipeline, group_key, state HAVING SUM(n) = 0 LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let idle: Vec<(String, String, String)> = idle
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect::<StoreResult<_>>()?;
        if idle.is_empty() {
            tx.rollback().await?;
            return Ok(0);
        }
        // Rows a writer holds are skipped, never waited for (no deadlock
        // with a writer taking its rows in another order): deleting any
        // set of rows whose values add up to nothing leaves every count
        // as it is, whatever the other rows of the key hold.
        let lock = match DB::DIALECT {
            batch::Dialect::Postgres => " FOR UPDATE OF g SKIP LOCKED",
            batch::Dialect::Sqlite => "",
        };
        let keys: Vec<GroupCountJson<'_>> = idle
            .iter()
            .map(|(pipeline, group_key, state)| GroupCountJson {
                pipeline,
                group_key,
                state,
                shard: 0,
                n: 0,
            })
            .collect();
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH v AS (SELECT {} FROM {}) \
             SELECT g.pipeline, g.group_key, g.state, CAST(g.shard AS BIGINT), g.n FROM group_counts g \
             JOIN v ON g.pipeline = v.pipeline AND g.group_key = v.group_key AND g.state = v.state{lock}",
            batch::select_as(GROUP_COUNT_COLS, DB::DIALECT),
            DB::DIALECT.rows()
        )))
        .bind_json(&keys)
        .fetch_all(&mut *tx)
        .await?;
        let mut held: std::collections::BTreeMap<(String, String, String), Vec<(i32, i64)>> =
            std::collections::BTreeMap::new();
        for r in &rows {
            let key = (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?);
            let shard: i64 = r.try_get(3)?;
            held.entry(key)
                .or_default()
                .push((i32::try_from(shard).unwrap_or_default(), r.try_get(4)?));
        }
        let gone: Vec<GroupCountJson<'_>> = held
            .iter()
            .filter(|(_, shards)| shards.iter().map(|(_, n)| n).sum::<i64>() == 0)
            .flat_map(|((pipeline, group_key, state), shards)| {
                shards.iter().map(move |(shard, _)| GroupCountJson {
                    pipeline,
                    group_key,
                    state,
                    shard: *shard,
                    n: 0,
                })
            })
            .collect();
        if gone.is_empty() {
            // Let go of the rows locked at once.
            tx.rollback().await?;
            return Ok(0);
        }
        let deleted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM group_counts WHERE (pipeline, group_key, state, shard) IN \
             (SELECT {} FROM {})",
            batch::select(&GROUP_COUNT_COLS[..4], DB::DIALECT),
            DB::DIALECT.rows()
        )))
        .bind_json(&gone)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(deleted.rows_affected())
    }

    async fn save_rollups(&self, rows: &[crate::store::StepRollup]) -> StoreResult<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        Self::put_rollups(&mut tx, Rollups::Minutes, rows).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn rollups_since(&self, since: UnixMs) -> StoreResult<Vec<crate::store::StepRollup>> {
        // One statement, so one snapshot: a compaction committing meanwhile
        // is seen wholly or not at all (never an hour both as minutes and
        // as its hour row).
        let sql = format!(
            "SELECT {} FROM step_rollup_hours WHERE hour > $2 \
             UNION ALL SELECT {ROLLUP_COLUMNS} FROM step_rollups WHERE minute >= $1 \
             ORDER BY minute",
            Rollups::Hours.select()
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(since)
            .bind(since - HOUR_MS)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::rollup)
    }

    async fn compact_rollups(&self, before: UnixMs) -> StoreResult<u64> {
        let mut folded = 0;
        let mut last = None;
        loop {
            let oldest: Option<i64> = sqlx::query_scalar("SELECT MIN(minute) FROM step_rollups")
                .fetch_one(self.reader())
                .await?;
            let Some(oldest) = oldest.filter(|m| *m < before) else {
                return Ok(folded);
            };
            // No row folded and the oldest unchanged would loop for ever.
            if last == Some(oldest) {
                return Ok(folded);
            }
            last = Some(oldest);
            let hour = oldest - oldest.rem_euclid(HOUR_MS);
            let end = (hour + HOUR_MS).min(before);
            folded += self.compact_hour(hour, end).await?;
        }
    }

    async fn purge_stats(&self, before: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let a = sqlx::query("DELETE FROM step_rollups WHERE minute < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        let hours = sqlx::query("DELETE FROM step_rollup_hours WHERE hour < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        let b = sqlx::query("DELETE FROM webhook_deliveries WHERE received_at < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        let c = sqlx::query("DELETE FROM login_throttle WHERE last_failure_at < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        let d = sqlx::query("DELETE FROM trigger_deliveries WHERE received_at < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        // Notices changed and last sent before then (one still pending
        // that long: its subscription is off or gone).
        let e = sqlx::query("DELETE FROM notices WHERE at < $1 AND COALESCE(last_at, at) < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let rows = [a, hours, b, c, d, e].map(|r| r.rows_affected());
        Ok(rows.iter().sum())
    }

    async fn schedules(&self) -> StoreResult<Vec<ScheduleRow>> {
        let rows = sqlx::query(
            "SELECT pipeline, cron, watermark, last_tick, last_record_id, updated_at \
             FROM schedules ORDER BY pipeline",
        )
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::schedule)
    }

    async fn advance_schedule(&self, a: &ScheduleAdvance) -> StoreResult<bool> {
        let (tick, record) = a.fired.unzip();
        let mut tx = self.begin_write().await?;
        let query = match a.from {
            None => sqlx::query(
                "INSERT INTO schedules \
                   (pipeline, cron, watermark, last_tick, last_record_id, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (pipeline) DO NOTHING",
            ),
            // Compare and set: only from the watermark this node read.
            Some(_) => sqlx::query(
                "UPDATE schedules SET cron = $2, watermark = $3, \
                   last_tick = COALESCE($4, last_tick), \
                   last_record_id = COALESCE($5, last_record_id), updated_at = $6 \
                 WHERE pipeline = $1 AND watermark = $7",
            ),
        }
        .bind(a.pipeline.clone())
        .bind(a.cron.clone())
        .bind(a.to)
        .bind(tick)
        .bind(record)
        .bind(a.now);
        let query = match a.from {
            Some(from) => query.bind(from),
            None => query,
        };
        let done = query.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_finished(
        &self,
        pipeline: &str,
        finished_before: UnixMs,
        limit: u32,
        run: &PurgeRun,
    ) -> StoreResult<(Purged, Option<i64>)> {
        let mut tx = self.begin_write().await?;
        // PostgreSQL: a record an operator is acting on right now is left
        // for the next batch rather than waited for.
        let lock = match DB::DIALECT {
            super::batch::Dialect::Postgres => " FOR UPDATE SKIP LOCKED",
            super::batch::Dialect::Sqlite => "",
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, state, provider, step, group_key FROM records r \
             WHERE pipeline = $1 AND finished_at IS NOT NULL AND finished_at < $2 \
             AND NOT EXISTS (SELECT 1 FROM step_confirmations c WHERE c.record_id = r.id) \
             ORDER BY finished_at, id LIMIT $3{lock}"
        )))
        .bind(pipeline.to_owned())
        .bind(finished_before)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut purged = Purged::default();
        if rows.is_empty() {
            return Ok((purged, run.event));
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut deltas = CountDeltas::default();
        for row in &rows {
            let id: i64 = row.try_get(0)?;
            let state: String = row.try_get(1)?;
            let provider: Option<String> = row.try_get(2)?;
            let step: Option<String> = row.try_get(3)?;
            let group: String = row.try_get(4)?;
            let parsed: RecordState = state
                .parse()
                .map_err(|_| StoreError::Corrupt(format!("record {id} has state `{state}`")))?;
            let at = Where {
                group: Some(group.as_str()).filter(|g| !g.is_empty()),
                provider: provider.as_deref(),
                step: step.as_deref(),
            };
            deltas.removed(pipeline, parsed, at);
            *purged.by_state.entry(state).or_default() += 1;
            ids.push(id);
        }
        let in_ids = Self::in_ids();
        purged.attempts = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM attempts WHERE record_id {in_ids}"
        )))
        .bind_json(&ids)
        .fetch_one(&mut *tx)
        .await?
        .try_get(0)?;
        let events = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM events WHERE record_id {in_ids} AND NOT audit"
        )))
        .bind_json(&ids)
        .execute(&mut *tx)
        .await?;
        purged.events = i64::try_from(events.rows_affected()).unwrap_or(i64::MAX);
        DB::unindex_in(&mut tx, &ids).await?;
        // Attempts and step runs have no foreign key on PostgreSQL (the hot
        // path's checks cost too much: migration 19): deleted here. Versions,
        // confirmations, intents and callbacks go with their record (ON
        // DELETE CASCADE).
        for table in ["attempts", "step_runs"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM {table} WHERE record_id {in_ids}"
            )))
            .bind_json(&ids)
            .execute(&mut *tx)
            .await?;
        }
        let deleted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM records WHERE id {in_ids}"
        )))
        .bind_json(&ids)
        .execute(&mut *tx)
        .await?;
        purged.records = i64::try_from(deleted.rows_affected()).unwrap_or(i64::MAX);
        Self::apply_counts(&mut tx, &deltas).await?;
        let event = self.audit_purge(&mut tx, run, pipeline, &purged).await?;
        tx.commit().await?;
        Ok((purged, event))
    }

    async fn count_purgeable(
        &self,
        pipeline: &str,
        finished_before: Option<UnixMs>,
        strip_before: Option<UnixMs>,
    ) -> StoreResult<Purged> {
        let mut out = Purged::default();
        if let Some(before) = finished_before {
            let finished = "SELECT id FROM records r WHERE pipeline = $1 \
                            AND finished_at IS NOT NULL AND finished_at < $2 \
                            AND NOT EXISTS (SELECT 1 FROM step_confirmations c WHERE c.record_id = r.id)";
            let rows = sqlx::query(
                "SELECT state, COUNT(*) AS n FROM records r WHERE pipeline = $1 \
                 AND finished_at IS NOT NULL AND finished_at < $2 \
                 AND NOT EXISTS (SELECT 1 FROM step_confirmations c WHERE c.record_id = r.id) \
                 GROUP BY state",
            )
            .bind(pipeline.to_owned())
            .bind(before)
            .fetch_all(self.reader())
            .await?;
            for row in &rows {
                let n: i64 = row.try_get(1)?;
                out.records += n;
                out.by_state.insert(row.try_get(0)?, n);
            }
            out.attempts = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM attempts WHERE record_id IN ({finished})"
            )))
            .bind(pipeline.to_owned())
            .bind(before)
            .fetch_one(self.reader())
            .await?;
            out.events = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM events WHERE record_id IN ({finished}) AND NOT audit"
            )))
            .bind(pipeline.to_owned())
            .bind(before)
            .fetch_one(self.reader())
            .await?;
        }
        if let Some(strip) = strip_before {
            // Those the purge takes are not stripped first.
            let kept_from = finished_before.unwrap_or(i64::MIN).min(strip);
            out.stripped = sqlx::query_scalar(
                "SELECT COUNT(*) FROM attempts WHERE record_id IN (\
                   SELECT id FROM records WHERE pipeline = $1 AND finished_at IS NOT NULL \
                   AND finished_at < $2 AND finished_at >= $3) \
                 AND (excerpt IS NOT NULL OR request IS NOT NULL)",
            )
            .bind(pipeline.to_owned())
            .bind(strip)
            .bind(kept_from)
            .fetch_one(self.reader())
            .await?;
        }
        Ok(out)
    }

    async fn strip_bodies(
        &self,
        pipeline: &str,
        finished_before: UnixMs,
        limit: u32,
        run: &PurgeRun,
    ) -> StoreResult<(i64, bool, Option<i64>)> {
        let mut tx = self.begin_write().await?;
        let from = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT finished_at, record_id FROM retention_progress WHERE pipeline = $1{}",
            DB::LOCK
        )))
        .bind(pipeline.to_owned())
        .fetch_optional(&mut *tx)
        .await?;
        let (at, id): (i64, i64) = match &from {
            Some(row) => (row.try_get(0)?, row.try_get(1)?),
            None => (i64::MIN, i64::MIN),
        };
        let rows = sqlx::query(
            "SELECT id, finished_at FROM records WHERE pipeline = $1 \
             AND finished_at IS NOT NULL AND finished_at < $2 \
             AND (finished_at, id) > ($3, $4) \
             ORDER BY finished_at, id LIMIT $5",
        )
        .bind(pipeline.to_owned())
        .bind(finished_before)
        .bind(at)
        .bind(id)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let Some(last) = rows.last() else {
            return Ok((0, false, run.event));
        };
        let (last_id, last_at): (i64, i64) = (last.try_get(0)?, last.try_get(1)?);
        let ids = rows
            .iter()
            .map(|r| r.try_get::<i64, _>(0))
            .collect::<Result<Vec<_>, _>>()?;
        let stripped = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE attempts SET excerpt = NULL, request = NULL WHERE record_id {} \
             AND (excerpt IS NOT NULL OR request IS NOT NULL)",
            Self::in_ids()
        )))
        .bind_json(&ids)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO retention_progress (pipeline, finished_at, record_id) VALUES ($1, $2, $3) \
             ON CONFLICT (pipeline) DO UPDATE SET finished_at = excluded.finished_at, \
               record_id = excluded.record_id",
        )
        .bind(pipeline.to_owned())
        .bind(last_at)
        .bind(last_id)
        .execute(&mut *tx)
        .await?;
        let n = i64::try_from(stripped.rows_affected()).unwrap_or(i64::MAX);
        let batch = Purged {
            stripped: n,
            ..Purged::default()
        };
        let event = self.audit_purge(&mut tx, run, pipeline, &batch).await?;
        tx.commit().await?;
        Ok((n, rows.len() >= limit as usize, event))
    }

    async fn search_progress(&self) -> StoreResult<i64> {
        let at: i64 = sqlx::query_scalar("SELECT event_id FROM search_progress WHERE id = 1")
            .fetch_one(self.reader())
            .await?;
        Ok(at)
    }

    async fn search_events(
        &self,
        after: i64,
        gaps: &[i64],
        limit: u32,
    ) -> StoreResult<Vec<crate::domain::search::SeenEvent>> {
        let read = |row: &DB::Row| -> StoreResult<crate::domain::search::SeenEvent> {
            Ok(crate::domain::search::SeenEvent {
                id: row.try_get(0)?,
                record: row.try_get(1)?,
                at: row.try_get(2)?,
            })
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, {SEARCH_RECORD}, at FROM events WHERE id > $1 ORDER BY id LIMIT $2"
        )))
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(self.reader())
        .await?;
        let mut out = map_all(&rows, read)?;
        if !gaps.is_empty() {
            let sql = format!(
                "SELECT id, {SEARCH_RECORD}, at FROM events WHERE id {}",
                Self::in_ids()
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind_json(gaps)
                .fetch_all(self.reader())
                .await?;
            out.extend(map_all(&rows, read)?);
        }
        Ok(out)
    }

    async fn index_records(&self, records: &[i64], bare: &[i64], settled: i64) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let indexed = if records.is_empty() {
            0
        } else {
            DB::index_in(&mut tx, records, bare).await?
        };
        // Only forward: a node that lost the lease mid-turn never moves it back.
        sqlx::query("UPDATE search_progress SET event_id = $1 WHERE id = 1 AND event_id < $1")
            .bind(settled)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(indexed)
    }
}

/// An event's record, for the search indexer: none for those that change
/// nothing a record is searched by (a claim, a lease given back or run
/// out), so they cost the indexer no document.
const SEARCH_RECORD: &str =
    "CASE WHEN kind IN ('claimed', 'released', 'lease_expired') THEN NULL ELSE record_id END";
