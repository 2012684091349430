//! What happened, kept: attempts, events and the audit log, step versions,
//! pinned pipeline versions, and the state counters the overview reads.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Type};

use super::backend::{BindJson, SqlDb};
use super::filter::push_audit_filter;
use super::rows::{
    ATTEMPT_COLUMNS, EVENT_COLUMNS, MapRow, STEP_VERSION_COLUMNS, map_all, map_sealed,
};
use super::sql::SqlStore;
use super::{AuditFilter, EventRow, NewEvent, Page, StoreResult, into_page, page_limit};
use crate::domain::{
    Attempt, Event, GroupCount, PipelineVersion, Record, StateCount, StepCount, StepVersion, UnixMs,
};

/// History: attempts, events, the audit log, pinned pipeline versions and
/// the counters.
#[async_trait::async_trait]
pub trait History: Send + Sync {
    /// The results of a record's steps that later generations replaced,
    /// by step and generation (the current ones are in `step_runs`).
    async fn step_versions(&self, record_id: i64) -> StoreResult<Vec<StepVersion>>;
    async fn attempts(&self, record_id: i64) -> StoreResult<Vec<Attempt>>;
    /// The attempts of several records, by record then in order.
    async fn attempts_of(&self, record_ids: &[i64]) -> StoreResult<Vec<Attempt>>;
    async fn record_events(&self, record_id: i64) -> StoreResult<Vec<Event>>;
    async fn audit_log(&self, filter: &AuditFilter) -> StoreResult<Page<Event>>;
    async fn append_event(&self, event: &NewEvent) -> StoreResult<Event>;
    /// Stores a pipeline definition once per (name, hash) and returns its id.
    async fn pin_pipeline(
        &self,
        pipeline: &str,
        hash: &str,
        definition: &Value,
        now: UnixMs,
    ) -> StoreResult<i64>;
    async fn pipeline_version(&self, id: i64) -> StoreResult<Option<PipelineVersion>>;
    /// Pipeline `pipeline`'s (or, `None`, every pipeline's) newest
    /// `limit` versions, newest first.
    async fn pipeline_versions(
        &self,
        pipeline: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<PipelineVersion>>;
    /// Records per (pipeline, state) from the maintained counters; cheap at
    /// any table size.
    async fn state_counts(&self) -> StoreResult<Vec<StateCount>>;
    /// The same figures by scanning the records table. For repair and tests
    /// only: slow on big tables.
    async fn recount_states(&self) -> StoreResult<Vec<StateCount>>;
    /// Records per (provider of their current step, state), from maintained
    /// counters; `StateCount::pipeline` holds the provider name.
    async fn provider_counts(&self) -> StoreResult<Vec<StateCount>>;
    /// The same by scanning; for repair and tests only.
    async fn recount_providers(&self) -> StoreResult<Vec<StateCount>>;
    /// Records per (pipeline, step they are at, state), from maintained
    /// counters, non-zero ones only.
    async fn step_counts(&self) -> StoreResult<Vec<StepCount>>;
    /// The same by scanning; for repair and tests only.
    async fn recount_steps(&self) -> StoreResult<Vec<StepCount>>;
    /// Records of a group per (pipeline, group, state not final), from
    /// maintained counters, non-zero ones only.
    async fn group_counts(&self) -> StoreResult<Vec<GroupCount>>;
    /// The same by scanning; for repair and tests only.
    async fn recount_groups(&self) -> StoreResult<Vec<GroupCount>>;
    /// Records holding every word of `q` (see `domain::search`), newest
    /// first, at most `limit`: as far as the search indexer has come.
    async fn search_records(&self, q: &str, limit: u32) -> StoreResult<Vec<Record>>;
}

#[async_trait::async_trait]
impl<DB> History for SqlStore<DB>
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
    async fn step_versions(&self, record_id: i64) -> StoreResult<Vec<StepVersion>> {
        let sql = format!(
            "SELECT {STEP_VERSION_COLUMNS} FROM step_versions WHERE record_id = $1 \
             ORDER BY step, generation"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::step_version)
    }

    async fn attempts(&self, record_id: i64) -> StoreResult<Vec<Attempt>> {
        let sql =
            format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE record_id = $1 ORDER BY id");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::attempt)
    }

    async fn attempts_of(&self, record_ids: &[i64]) -> StoreResult<Vec<Attempt>> {
        let sql = format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE record_id {} ORDER BY record_id, id",
            Self::in_ids()
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind_json(record_ids)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::attempt)
    }

    async fn record_events(&self, record_id: i64) -> StoreResult<Vec<Event>> {
        use crate::domain::claimed::unfold;
        // The pass under way, if any: its claim is in the record. Read
        // before the events, so that a pass ending in between shows its
        // end (with its claim) and not a claim with no end.
        let lease: Option<(String, UnixMs)> = sqlx::query_as(
            "SELECT lease_owner, claimed_at FROM records \
             WHERE id = $1 AND state = 'running' AND lease_owner IS NOT NULL \
               AND claimed_at IS NOT NULL",
        )
        .bind(record_id)
        .fetch_optional(self.reader())
        .await?;
        let sql = format!(
            "SELECT {EVENT_COLUMNS}, claimed_at, claimed_by FROM events WHERE record_id = $1 ORDER BY id"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        let folded = map_sealed(&rows, &self.keyring(), MapRow::folded_event)?;
        let under_way = lease.as_ref().map(|(o, at)| (o.as_str(), *at));
        Ok(unfold(record_id, folded, under_way))
    }

    async fn audit_log(&self, filter: &AuditFilter) -> StoreResult<Page<Event>> {
        let limit = page_limit(filter.limit);
        let mut qb = sqlx::QueryBuilder::<DB>::new(format!("SELECT {EVENT_COLUMNS} FROM events"));
        push_audit_filter(&mut qb, filter, DB::AUDIT);
        qb.push(" ORDER BY id DESC LIMIT ")
            .push_bind(i64::from(limit) + 1);
        let rows = qb.build().fetch_all(self.reader()).await?;
        Ok(into_page(
            map_sealed(&rows, &self.keyring(), MapRow::event)?,
            limit,
            |e| e.id,
        ))
    }

    async fn append_event(&self, e: &NewEvent) -> StoreResult<Event> {
        let mut tx = self.begin_write().await?;
        let event = self
            .insert_event(
                &mut tx,
                &EventRow {
                    record_id: e.record_id,
                    at: e.at,
                    kind: &e.kind,
                    actor: &e.actor,
                    audit: e.audit,
                    from: None,
                    to: None,
                    step: e.step.as_deref(),
                    reason: e.reason.as_deref(),
                    detail: e.detail.as_ref(),
                    claimed_at: None,
                    claimed_by: None,
                },
            )
            .await?;
        tx.commit().await?;
        Ok(event)
    }

    async fn pin_pipeline(
        &self,
        pipeline: &str,
        hash: &str,
        definition: &Value,
        now: UnixMs,
    ) -> StoreResult<i64> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO pipeline_versions (pipeline, hash, definition, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (pipeline, hash) DO NOTHING",
        )
        .bind(pipeline.to_owned())
        .bind(hash.to_owned())
        .bind(Json(definition.clone()))
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let id: i64 = sqlx::query_scalar(
            "SELECT id FROM pipeline_versions WHERE pipeline = $1 AND hash = $2",
        )
        .bind(pipeline.to_owned())
        .bind(hash.to_owned())
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(id)
    }

    async fn pipeline_version(&self, id: i64) -> StoreResult<Option<PipelineVersion>> {
        let row = sqlx::query("SELECT id, pipeline, hash, definition, created_at FROM pipeline_versions WHERE id = $1")
            .bind(id)
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::pipeline_version).transpose()
    }

    async fn pipeline_versions(
        &self,
        pipeline: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<PipelineVersion>> {
        let rows = sqlx::query(
            "SELECT id, pipeline, hash, definition, created_at FROM pipeline_versions \
             WHERE ($1 IS NULL OR pipeline = $1) ORDER BY id DESC LIMIT $2",
        )
        .bind(pipeline.map(str::to_owned))
        .bind(limit)
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::pipeline_version)
    }

    async fn state_counts(&self) -> StoreResult<Vec<StateCount>> {
        let rows = sqlx::query(
            "SELECT pipeline, state, CAST(SUM(n) AS BIGINT) AS n FROM record_counts \
             GROUP BY pipeline, state HAVING SUM(n) <> 0 ORDER BY pipeline, state",
        )
        .fetch_all(self.reader())
        .await?;
        let mut counts = map_all(&rows, MapRow::state_count)?;
        counts.sort();
        Ok(counts)
    }

    async fn recount_states(&self) -> StoreResult<Vec<StateCount>> {
        let rows = sqlx::query(
            "SELECT pipeline, state, COUNT(*) AS n FROM records GROUP BY pipeline, state",
        )
        .fetch_all(self.reader())
        .await?;
        let mut counts = map_all(&rows, MapRow::state_count)?;
        counts.sort();
        Ok(counts)
    }

    async fn provider_counts(&self) -> StoreResult<Vec<StateCount>> {
        let rows = sqlx::query(
            "SELECT provider AS pipeline, state, CAST(SUM(n) AS BIGINT) AS n FROM provider_counts \
             GROUP BY provider, state HAVING SUM(n) <> 0 ORDER BY provider, state",
        )
        .fetch_all(self.reader())
        .await?;
        let mut counts = map_all(&rows, MapRow::state_count)?;
        counts.sort();
        Ok(counts)
    }

    async fn recount_providers(&self) -> StoreResult<Vec<StateCount>> {
        let rows = sqlx::query(
            "SELECT provider AS pipeline, state, COUNT(*) AS n FROM records \
             WHERE provider IS NOT NULL GROUP BY provider, state",
        )
        .fetch_all(self.reader())
        .await?;
        let mut counts = map_all(&rows, MapRow::state_count)?;
        counts.sort();
        Ok(counts)
    }

    async fn step_counts(&self) -> StoreResult<Vec<StepCount>> {
        let rows = sqlx::query(
            "SELECT pipeline, step, state, CAST(SUM(n) AS BIGINT) AS n FROM step_counts \
             GROUP BY pipeline, step, state HAVING SUM(n) <> 0",
        )
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::step_count)
    }

    async fn recount_steps(&self) -> StoreResult<Vec<StepCount>> {
        let rows = sqlx::query(
            "SELECT pipeline, COALESCE(step, '') AS step, state, COUNT(*) AS n FROM records \
             GROUP BY pipeline, COALESCE(step, ''), state",
        )
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::step_count)
    }

    async fn group_counts(&self) -> StoreResult<Vec<GroupCount>> {
        let rows = sqlx::query(
            "SELECT pipeline, group_key, state, CAST(SUM(n) AS BIGINT) AS n FROM group_counts \
             GROUP BY pipeline, group_key, state HAVING SUM(n) <> 0",
        )
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::group_count)
    }

    async fn recount_groups(&self) -> StoreResult<Vec<GroupCount>> {
        let rows = sqlx::query(
            "SELECT pipeline, group_key, state, COUNT(*) AS n FROM records \
             WHERE group_key <> '' AND state IN ('pending', 'running', 'waiting', 'retrying', 'parked') \
             GROUP BY pipeline, group_key, state",
        )
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::group_count)
    }

    async fn search_records(&self, q: &str, limit: u32) -> StoreResult<Vec<Record>> {
        let limit = i64::from(limit.clamp(1, super::MAX_PAGE));
        let ids = DB::search_ids(&self.pools, q, limit).await?;
        self.records_by_ids(&ids).await
    }
}
