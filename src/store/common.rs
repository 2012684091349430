//! The [`Store`] implementation both backends share, written once over the
//! backend's [`SqlDb`]: each method is the same SQL on SQLite and
//! PostgreSQL, with the few spellings that differ taken from the backend.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Row, Type};

use super::backend::{BindJson, RowsAffected, SqlDb};
use super::counts::CountDeltas;
use super::filter::{push_audit_filter, push_record_filter};
use super::rows::{
    API_TOKEN_COLUMNS, ATTEMPT_COLUMNS, BREAKER_COLUMNS, EVENT_COLUMNS, MapRow, PROVIDER_COLUMNS,
    RECORD_COLUMNS, ROLLUP_COLUMNS, STEP_COLUMNS, STEP_VERSION_COLUMNS, USER_COLUMNS, map_all,
};
use super::sql::{Rollups, SqlStore, conflict_or};
use super::{
    ActionRequest, AuditFilter, ClaimRequest, Commit, Created, EventRow, HOUR_MS, Lease, NewEvent,
    NewRecord, NewUser, NodeBeat, Page, PermitRequest, Permits, PurgeRun, Purged, RecordFilter,
    ScheduleAdvance, Store, StoreError, StoreResult, UserChange, into_page, node_actor, page_limit,
    worked_state,
};
use crate::domain::breaker::{ProbeGrant, SharedBreaker, SharedOp};
use crate::domain::login::LoginFailures;
use crate::domain::{
    Attempt, Event, Node, OperatorAction, PipelineVersion, ProviderState, Record, RecordState,
    ScheduleRow, Session, StateCount, StepCount, StepRun, StepVersion, Trigger, UnixMs, User,
    transition,
};

// The bounds are those of the store's inherent methods (`sql.rs`).
impl<DB> Store for SqlStore<DB>
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
    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(self.reader()).await?;
        Ok(())
    }

    async fn installation_id(&self) -> StoreResult<String> {
        let id = self
            .installation
            .get_or_try_init(|| async {
                sqlx::query_scalar::<_, String>(
                    "SELECT value FROM meta WHERE key = 'installation_id'",
                )
                .fetch_one(self.reader())
                .await
            })
            .await?;
        Ok(id.clone())
    }

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
        if let Some(inserted) = DB::insert_records_at_once(&self.pools, &batch, now).await? {
            let slots = Self::match_inserted(&batch, inserted, None)?;
            return self.fill_repeats(&batch, slots).await;
        }
        let mut tx = self.begin_write().await?;
        let mut deltas = CountDeltas::default();
        let slots = Self::insert_records(&mut tx, &batch, now, &mut deltas).await?;
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
        row.as_ref().map(MapRow::record).transpose()
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

    async fn search_records(&self, q: &str, limit: u32) -> StoreResult<Vec<Record>> {
        let limit = i64::from(limit.clamp(1, super::MAX_PAGE));
        let ids = DB::search_ids(&self.pools, q, limit).await?;
        self.records_by_ids(&ids).await
    }

    async fn list_records(&self, filter: &RecordFilter) -> StoreResult<Page<Record>> {
        use crate::store::filter::{Part, needs_parts, needs_windows};
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
            return Ok(into_page(map_all(&rows, MapRow::record)?, limit, |r| r.id));
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
        let stop = (top - LIST_SCAN_IDS).max(1);
        let mut upper = top;
        let mut items: Vec<Record> = Vec::new();
        loop {
            let lower = (upper - LIST_WINDOW_IDS).max(stop);
            let mut f = filter.clone();
            f.before = Some(upper);
            let want = i64::from(limit) + 1 - items.len() as i64;
            let rows = query(&f, Some(lower), want)
                .build()
                .fetch_all(self.reader())
                .await?;
            items.extend(map_all(&rows, MapRow::record)?);
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

    async fn next_due_at(&self) -> StoreResult<Option<UnixMs>> {
        let heads = DB::queue_heads_in(&self.pools).await?;
        Ok(heads.into_iter().map(|(_, _, first)| first).min())
    }

    async fn oldest_due(
        &self,
        pipelines: &[String],
        now: UnixMs,
    ) -> StoreResult<Vec<(String, UnixMs)>> {
        // The queues' heads (one probe per queue, not a scan of the
        // backlog), the earliest per pipeline asked for.
        let heads = DB::queue_heads_in(&self.pools).await?;
        Ok(pipelines
            .iter()
            .filter_map(|p| {
                heads
                    .iter()
                    .filter(|(pipeline, _, first)| pipeline == p && *first <= now)
                    .map(|(_, _, first)| *first)
                    .min()
                    .map(|at| (p.clone(), at))
            })
            .collect())
    }

    async fn claim_due(&self, req: &ClaimRequest) -> StoreResult<Vec<Record>> {
        if req.owner.is_empty() {
            return Err(StoreError::Invalid("lease owner is empty".into()));
        }
        let mut tx = self.begin_write().await?;
        let (claimed, old_states) = DB::claim_in(&mut tx, req).await?;
        if !claimed.is_empty() {
            let actor = node_actor(&req.owner);
            let (events, deltas) = Self::claim_moves(&claimed, &old_states, req.now, &actor)?;
            Self::insert_events(&mut tx, &events).await?;
            Self::apply_counts(&mut tx, &deltas).await?;
        }
        tx.commit().await?;
        Ok(claimed)
    }

    async fn extend_leases(&self, leases: &[Lease], until: UnixMs) -> StoreResult<Vec<i64>> {
        let mut tx = self.begin_write().await?;
        let mut held = Vec::with_capacity(leases.len());
        // Rows are locked in id order in every multi-row write, so two
        // of them can never deadlock on PostgreSQL.
        let mut leases: Vec<&Lease> = leases.iter().collect();
        leases.sort_by_key(|l| l.record_id);
        for lease in leases {
            let done = sqlx::query(
                "UPDATE records SET lease_until = $1, next_run_at = $1 \
                 WHERE id = $2 AND state = 'running' AND lease_owner = $3 AND lease_token = $4",
            )
            .bind(until)
            .bind(lease.record_id)
            .bind(lease.owner.clone())
            .bind(lease.token)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 1 {
                held.push(lease.record_id);
            }
        }
        tx.commit().await?;
        Ok(held)
    }

    async fn release(&self, leases: &[Lease], now: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let mut deltas = CountDeltas::default();
        let mut released = 0;
        let mut leases: Vec<&Lease> = leases.iter().collect();
        leases.sort_by_key(|l| l.record_id);
        for lease in leases {
            let Some(rec) = Self::lock_record(&mut tx, lease.record_id).await? else {
                continue;
            };
            if rec.lease().as_ref() != Some(lease) {
                continue;
            }
            let to = transition(rec.state, Trigger::Release)?;
            let actor = node_actor(&lease.owner);
            let event = EventRow {
                record_id: Some(rec.id),
                at: now,
                kind: Trigger::Release.kind(),
                actor: &actor,
                audit: false,
                from: Some(rec.state),
                to: Some(to),
                step: None,
                reason: Some(crate::domain::SHUTDOWN_REASON),
                detail: None,
            };
            Self::move_record(
                &mut tx,
                &rec,
                (to, None),
                Some(now),
                now,
                event,
                rec.error_code.as_deref(),
                &mut deltas,
            )
            .await?;
            released += 1;
        }
        Self::apply_counts(&mut tx, &deltas).await?;
        if released > 0 {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(released)
    }

    async fn commit(&self, c: &Commit) -> StoreResult<Record> {
        let mut results = self.commit_many(std::slice::from_ref(c)).await?;
        results.pop().unwrap_or(Err(StoreError::LeaseLost {
            record_id: c.lease.record_id,
        }))
    }

    async fn commit_many(&self, commits: &[Commit]) -> StoreResult<Vec<StoreResult<Record>>> {
        if commits.is_empty() {
            return Ok(Vec::new());
        }
        let mut ids: Vec<i64> = commits.iter().map(|c| c.lease.record_id).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != commits.len() {
            return Err(StoreError::Invalid(
                "a group of commits names one record twice".into(),
            ));
        }
        let installation = self.installation_id().await?;
        let actors: Vec<String> = commits.iter().map(|c| node_actor(&c.lease.owner)).collect();
        let mut tx = self.begin_write().await?;
        let held = Self::lock_records(&mut tx, &ids).await?;
        let mut results = Vec::with_capacity(commits.len());
        let mut moved = Vec::with_capacity(commits.len());
        let mut steps = Vec::new();
        let mut attempts = Vec::new();
        let mut callbacks = Vec::new();
        let mut confirms = Vec::new();
        let mut intents = Vec::new();
        let mut events = Vec::with_capacity(commits.len());
        let mut deltas = CountDeltas::default();
        for (c, actor) in commits.iter().zip(&actors) {
            let Some(rec) = held
                .get(&c.lease.record_id)
                .filter(|r| r.lease().as_ref() == Some(&c.lease))
            else {
                results.push(Err(StoreError::LeaseLost {
                    record_id: c.lease.record_id,
                }));
                continue;
            };
            let mut after = rec.clone();
            after.updated_at = c.now;
            after.error_code = c.error_code.clone();
            after.reason = c.reason.clone();
            if c.step.is_some() {
                after.step = c.step.clone();
            }
            if c.provider.is_some() {
                after.provider = c.provider.clone();
            }
            // `None` is a checkpoint: the record stays leased.
            if let Some(result) = c.result {
                let to = match worked_state(result) {
                    Ok(to) => to,
                    Err(e) => {
                        results.push(Err(e));
                        continue;
                    }
                };
                after.state = to;
                after.next_run_at = to.is_scheduled().then(|| c.next_run_at.unwrap_or(c.now));
                after.lease_owner = None;
                after.lease_until = None;
                after.finished_at = to.is_terminal().then_some(c.now);
                after.park_until = c.park_until.clone().filter(|_| to == RecordState::Parked);
                events.push(EventRow {
                    record_id: Some(rec.id),
                    at: c.now,
                    kind: Trigger::Worked(result).kind(),
                    actor,
                    audit: false,
                    from: Some(rec.state),
                    to: Some(to),
                    step: c.step.as_deref(),
                    reason: c.reason.as_deref(),
                    detail: None,
                });
            }
            // The step (and so the provider) may have changed too.
            deltas.record_moved(rec, &after);
            steps.extend(c.steps.iter().map(|s| (rec.id, s, c.now)));
            attempts.extend(c.attempts.iter().map(|a| (rec.id, a)));
            callbacks.extend(c.callbacks_done.iter().map(|id| (rec.id, *id, c.now)));
            confirms.extend(c.confirms.iter());
            intents.extend(c.intents_done.iter().copied());
            moved.push(after.clone());
            results.push(Ok(after));
        }
        Self::upsert_steps(&mut tx, &installation, &steps).await?;
        Self::insert_attempts(&mut tx, &attempts).await?;
        for (record_id, id, now) in callbacks {
            sqlx::query("UPDATE callbacks SET processed_at = $1, record_id = $2 WHERE id = $3")
                .bind(now)
                .bind(record_id)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        Self::update_records(&mut tx, &moved).await?;
        Self::delete_intents(&mut tx, &intents).await?;
        Self::insert_events(&mut tx, &events).await?;
        Self::apply_counts(&mut tx, &deltas).await?;
        for p in confirms {
            Self::put_confirmation(&mut tx, p).await?;
        }
        tx.commit().await?;
        Ok(results)
    }

    async fn act(&self, req: &ActionRequest) -> StoreResult<Record> {
        crate::store::refuse_nul("reason", req.reason.as_deref())?;
        if req.action == OperatorAction::ReplayFrom && req.steps.is_empty() {
            return Err(StoreError::Invalid(
                "replay needs the step to replay from".into(),
            ));
        }
        let installation = self.installation_id().await?;
        let mut tx = self.begin_write().await?;
        let rec = Self::lock_record(&mut tx, req.record_id)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "record",
                key: req.record_id.to_string(),
            })?;
        let mut deltas = CountDeltas::default();
        let moved = Self::act_locked(&mut tx, &installation, &rec, req, None, &mut deltas).await?;
        Self::apply_counts(&mut tx, &deltas).await?;
        if moved.next_run_at.is_some() {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(moved)
    }

    async fn resume_parked(&self, req: &crate::store::ResumeDue) -> StoreResult<Vec<Record>> {
        use crate::domain::park::ParkUntil;
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
        let held = Self::lock_records(&mut tx, &ids).await?;
        let mut deltas = CountDeltas::default();
        let mut resumed = Vec::new();
        for id in ids {
            let Some(rec) = held.get(&id) else {
                continue;
            };
            let holds = match &rec.park_until {
                Some(ParkUntil::Time { at }) => *at <= req.now,
                Some(ParkUntil::Provider { provider }) => {
                    req.providers.iter().any(|(p, _)| p == provider)
                }
                None => false,
            };
            let Some(until) = rec.park_until.clone().filter(|_| holds) else {
                continue;
            };
            if rec.state != RecordState::Parked {
                continue;
            }
            let action = ActionRequest {
                record_id: rec.id,
                action: OperatorAction::Resume,
                actor: crate::domain::SYSTEM_ACTOR.into(),
                reason: Some(match &until {
                    ParkUntil::Time { .. } => format!("parked {until}: the time came"),
                    ParkUntil::Provider { provider } => {
                        format!("parked {until}: provider `{provider}` takes calls again")
                    }
                }),
                now: req.now,
                steps: Vec::new(),
                until: None,
                took: None,
                input: None,
                repin: None,
            };
            let moved = Self::act_locked(
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

    async fn record_callback(
        &self,
        cb: &crate::store::NewCallback,
    ) -> StoreResult<Option<crate::store::CallbackMatch>> {
        let mut tx = self.begin_write().await?;
        for id in &cb.delivery_ids {
            let taken = sqlx::query(
                "INSERT INTO webhook_deliveries (provider, delivery_id, received_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (provider, delivery_id) DO NOTHING",
            )
            .bind(cb.provider.clone())
            .bind(id.clone())
            .bind(cb.now)
            .execute(&mut *tx)
            .await?;
            if taken.rows_affected() == 0 {
                return Err(StoreError::Conflict {
                    what: "webhook delivery",
                    key: id.clone(),
                });
            }
        }
        let found: Option<(i64, String, String)> = sqlx::query_as(
            "SELECT record_id, step, state FROM step_runs WHERE provider = $1 AND job_id = $2 \
             ORDER BY updated_at DESC LIMIT 1",
        )
        .bind(cb.provider.clone())
        .bind(cb.job_id.clone())
        .fetch_optional(&mut *tx)
        .await?;
        let callback_id: i64 = sqlx::query_scalar(
            "INSERT INTO callbacks (provider, job_id, record_id, step, received_at, body) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
        )
        .bind(cb.provider.clone())
        .bind(cb.job_id.clone())
        .bind(found.as_ref().map(|f| f.0))
        .bind(found.as_ref().map(|f| f.1.clone()))
        .bind(cb.now)
        .bind(Json(cb.body.clone()))
        .fetch_one(&mut *tx)
        .await?;
        let Some((record_id, step, step_state)) = found else {
            tx.commit().await?;
            return Ok(None);
        };
        let rec = Self::lock_record(&mut tx, record_id)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "record",
                key: record_id.to_string(),
            })?;
        if rec.state == RecordState::Waiting {
            sqlx::query("UPDATE records SET next_run_at = $1 WHERE id = $2 AND state = 'waiting'")
                .bind(cb.now)
                .bind(record_id)
                .execute(&mut *tx)
                .await?;
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(Some(crate::store::CallbackMatch {
            callback_id,
            record_id,
            step,
            step_state: crate::store::rows::parse(&step_state, "step state")?,
            record_state: rec.state,
        }))
    }

    async fn pending_callbacks(
        &self,
        provider: &str,
        job_id: &str,
    ) -> StoreResult<Vec<crate::store::PendingCallback>> {
        let rows: Vec<(i64, Json<Value>, i64)> = sqlx::query_as(
            "SELECT id, body, received_at FROM callbacks \
             WHERE provider = $1 AND job_id = $2 AND processed_at IS NULL ORDER BY id LIMIT 100",
        )
        .bind(provider.to_owned())
        .bind(job_id.to_owned())
        .fetch_all(self.reader())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, body, received_at)| crate::store::PendingCallback {
                id,
                body: body.0,
                received_at,
            })
            .collect())
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

    async fn mark_callbacks(&self, ids: &[i64], now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        for id in ids {
            sqlx::query(
                "UPDATE callbacks SET processed_at = COALESCE(processed_at, $1) WHERE id = $2",
            )
            .bind(now)
            .bind(*id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn reverse(&self, req: &crate::store::ReverseRequest) -> StoreResult<Record> {
        let installation = self.installation_id().await?;
        let mut tx = self.begin_write().await?;
        let rec = Self::lock_record(&mut tx, req.record_id)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "record",
                key: req.record_id.to_string(),
            })?;
        if let Some(g) = req.generation {
            let current: Option<(i64, String)> = sqlx::query_as(
                "SELECT CAST(generation AS BIGINT), state FROM step_runs WHERE record_id = $1 AND step = $2",
            )
            .bind(rec.id)
            .bind(req.step.clone())
            .fetch_optional(&mut *tx)
            .await?;
            if current != Some((i64::from(g), "succeeded".to_owned())) {
                return Ok(rec);
            }
        }
        let trigger = Trigger::Reversed(req.policy);
        let to = transition(rec.state, trigger)?;
        let mut detail = req.detail.clone().unwrap_or(serde_json::json!({}));
        if let Some(obj) = detail.as_object_mut() {
            obj.insert(
                "policy".into(),
                serde_json::to_value(req.policy).unwrap_or_default(),
            );
        }
        let event = EventRow {
            record_id: Some(rec.id),
            at: req.now,
            kind: trigger.kind(),
            actor: "provider",
            audit: false,
            from: Some(rec.state),
            to: Some(to),
            step: Some(&req.step),
            reason: Some(&req.reason),
            detail: Some(&detail),
        };
        match req.policy {
            crate::domain::ReversalPolicy::Rerun => {
                let cause = "rerun after reversal";
                Self::rerun_steps(&mut tx, &installation, rec.id, &req.steps, req.now, cause)
                    .await?;
            }
            // The result stays (a resume keeps it), marked so that a retry
            // runs the step again.
            crate::domain::ReversalPolicy::Park => {
                sqlx::query(
                    "UPDATE step_runs SET error_code = $1, updated_at = $2 \
                     WHERE record_id = $3 AND step = $4 AND state = 'succeeded'",
                )
                .bind(crate::domain::REVERSED)
                .bind(req.now)
                .bind(rec.id)
                .bind(req.step.clone())
                .execute(&mut *tx)
                .await?;
            }
            crate::domain::ReversalPolicy::Record => {}
        }
        // The policy applies whatever the record's state; a state the
        // reversal does not move (a pending record rerun, a parked one
        // parked) keeps its place, with the event.
        if to == rec.state {
            Self::insert_event(&mut tx, &event).await?;
            // A record parked until a condition and now parked by a
            // reversal needs a human: it no longer resumes by itself, and
            // says why it is parked now.
            let mut rec = rec;
            if to == RecordState::Parked
                && req.policy == crate::domain::ReversalPolicy::Park
                && rec.park_until.is_some()
            {
                let sql = format!(
                    "UPDATE records SET park_until_at = NULL, park_until_provider = NULL, \
                     error_code = $1, reason = $2, updated_at = $3 WHERE id = $4 \
                     RETURNING {RECORD_COLUMNS}"
                );
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(crate::domain::REVERSED)
                    .bind(req.reason.clone())
                    .bind(req.now)
                    .bind(rec.id)
                    .fetch_one(&mut *tx)
                    .await?;
                rec = row.record()?;
            }
            if req.policy == crate::domain::ReversalPolicy::Rerun && rec.state.is_scheduled() {
                DB::notify_work(&mut tx).await?;
            }
            tx.commit().await?;
            return Ok(rec);
        }
        let next = to.is_scheduled().then_some(req.now);
        let mut deltas = CountDeltas::default();
        let moved = Self::move_record(
            &mut tx,
            &rec,
            (to, None),
            next,
            req.now,
            event,
            Some("provider_reversed"),
            &mut deltas,
        )
        .await?;
        Self::apply_counts(&mut tx, &deltas).await?;
        if next.is_some() {
            DB::notify_work(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(moved)
    }

    async fn record_intents(
        &self,
        intents: &[crate::store::NewIntent],
    ) -> StoreResult<Vec<StoreResult<i64>>> {
        if intents.is_empty() {
            return Ok(Vec::new());
        }
        // Rows are matched to intents by what they are (record, step,
        // attempt): one call per step at a time. Two passes of one record
        // (a lease that ran out and was claimed again while the first
        // still waited to write) ask with the same key, and only the
        // holder of the lease gets a row; in one statement both would take
        // that row as theirs. So a key met again goes to the next
        // statement, in the same transaction.
        type Keys<'k> = std::collections::HashSet<(i64, &'k str, i32)>;
        let mut rounds: Vec<(Keys<'_>, Vec<usize>)> = Vec::new();
        for (at, i) in intents.iter().enumerate() {
            let key = (i.record_id, i.step.as_str(), i.attempt_no);
            match rounds.iter_mut().find(|(keys, _)| !keys.contains(&key)) {
                Some((keys, round)) => {
                    keys.insert(key);
                    round.push(at);
                }
                None => rounds.push(([key].into(), vec![at])),
            }
        }
        let mut tx = self.begin_write().await?;
        let mut ids: Vec<StoreResult<i64>> = intents
            .iter()
            .map(|i| {
                Err(StoreError::LeaseLost {
                    record_id: i.record_id,
                })
            })
            .collect();
        for (_, round) in &rounds {
            let part: Vec<&crate::store::NewIntent> =
                round.iter().map(|&at| &intents[at]).collect();
            let written = Self::insert_intents(&mut tx, &part).await?;
            for (&at, id) in round.iter().zip(written) {
                ids[at] = id;
            }
        }
        tx.commit().await?;
        Ok(ids)
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

    async fn open_intents(&self, record_id: i64) -> StoreResult<Vec<crate::domain::Intent>> {
        let sql = format!(
            "SELECT {} FROM attempt_intents WHERE record_id = $1 ORDER BY id",
            super::rows::INTENT_COLUMNS
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::intent)
    }

    async fn intent_providers(&self) -> StoreResult<Vec<String>> {
        Ok(sqlx::query_scalar(
            "SELECT DISTINCT provider FROM attempt_intents WHERE provider IS NOT NULL",
        )
        .fetch_all(self.reader())
        .await?)
    }

    async fn append_attempts(
        &self,
        record_id: i64,
        attempts: &[crate::store::NewAttempt],
        intents_done: &[i64],
    ) -> StoreResult<()> {
        if attempts.is_empty() && intents_done.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        // The record's row held while its attempts are written (attempts
        // have no foreign key on PostgreSQL: migration 19): none for a
        // record that is gone.
        if Self::lock_record(&mut tx, record_id).await?.is_none() {
            return Err(StoreError::NotFound {
                what: "record",
                key: record_id.to_string(),
            });
        }
        let rows: Vec<_> = attempts.iter().map(|a| (record_id, a)).collect();
        Self::insert_attempts(&mut tx, &rows).await?;
        Self::delete_intents(&mut tx, intents_done).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn step_runs(&self, record_id: i64) -> StoreResult<Vec<StepRun>> {
        let sql =
            format!("SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 ORDER BY step");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::step_run)
    }

    async fn step_runs_of(&self, record_ids: &[i64]) -> StoreResult<Vec<StepRun>> {
        let sql = DB::statements().step_runs_of.get(|| format!(
            "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id {}SELECT CAST(value AS BIGINT) FROM {}{} \
             ORDER BY record_id, step",
            DB::ANY_OF.0,
            DB::DIALECT.rows(),
            DB::ANY_OF.1
        ));
        let rows = sqlx::query(sql)
            .bind_json(record_ids)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::step_run)
    }

    async fn claim_confirmations(
        &self,
        now: UnixMs,
        limit: u32,
        hold_until: UnixMs,
    ) -> StoreResult<Vec<crate::domain::confirm::Pending>> {
        // Most looks find nothing: asked on a reader first, so that an idle
        // node takes no write lock (SQLite's single writer) to find out.
        let any: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(1 AS BIGINT) FROM step_confirmations WHERE due_at <= $1 LIMIT 1",
        )
        .bind(now)
        .fetch_optional(self.reader())
        .await?;
        if any.is_none() {
            return Ok(Vec::new());
        }
        let mut tx = self.begin_write().await?;
        // PostgreSQL re-reads a row locked meanwhile by another node's
        // claim, and then finds it no longer due.
        let sql = format!(
            "SELECT record_id, step, generation, due_at, remaining, tries FROM step_confirmations \
             WHERE due_at <= $1 ORDER BY due_at LIMIT $2 {}",
            DB::LOCK
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        let out = map_all(&rows, MapRow::confirmation)?;
        for p in &out {
            sqlx::query(
                "UPDATE step_confirmations SET due_at = $1 WHERE record_id = $2 AND step = $3",
            )
            .bind(hold_until)
            .bind(p.record_id)
            .bind(p.step.clone())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn settle_confirmation(
        &self,
        record_id: i64,
        step: &str,
        generation: i32,
        next: Option<&crate::domain::confirm::Pending>,
    ) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        match next {
            Some(p) => {
                sqlx::query(
                    "UPDATE step_confirmations SET due_at = $1, remaining = $2, tries = $3 \
                     WHERE record_id = $4 AND step = $5 AND generation = $6",
                )
                .bind(p.due_at)
                .bind(i64::from(p.remaining))
                .bind(i64::from(p.tries))
                .bind(record_id)
                .bind(step.to_owned())
                .bind(i64::from(generation))
                .execute(&mut *tx)
                .await?;
            }
            None => {
                sqlx::query(
                    "DELETE FROM step_confirmations WHERE record_id = $1 AND step = $2 \
                     AND generation = $3",
                )
                .bind(record_id)
                .bind(step.to_owned())
                .bind(i64::from(generation))
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn step_versions(&self, record_id: i64) -> StoreResult<Vec<StepVersion>> {
        let sql = format!(
            "SELECT {STEP_VERSION_COLUMNS} FROM step_versions WHERE record_id = $1 \
             ORDER BY step, generation"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::step_version)
    }

    async fn attempts(&self, record_id: i64) -> StoreResult<Vec<Attempt>> {
        let sql =
            format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE record_id = $1 ORDER BY id");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::attempt)
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
        map_all(&rows, MapRow::attempt)
    }

    async fn record_events(&self, record_id: i64) -> StoreResult<Vec<Event>> {
        let sql = format!("SELECT {EVENT_COLUMNS} FROM events WHERE record_id = $1 ORDER BY id");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(record_id)
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::event)
    }

    async fn audit_log(&self, filter: &AuditFilter) -> StoreResult<Page<Event>> {
        let limit = page_limit(filter.limit);
        let mut qb = sqlx::QueryBuilder::<DB>::new(format!("SELECT {EVENT_COLUMNS} FROM events"));
        push_audit_filter(&mut qb, filter, DB::AUDIT);
        qb.push(" ORDER BY id DESC LIMIT ")
            .push_bind(i64::from(limit) + 1);
        let rows = qb.build().fetch_all(self.reader()).await?;
        Ok(into_page(map_all(&rows, MapRow::event)?, limit, |e| e.id))
    }

    async fn append_event(&self, e: &NewEvent) -> StoreResult<Event> {
        let mut tx = self.begin_write().await?;
        let event = Self::insert_event(
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

    async fn create_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<User> {
        self.insert_user(user, now, false)
            .await?
            .ok_or_else(|| StoreError::Invalid("the user was not created".into()))
    }

    async fn create_first_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<Option<User>> {
        self.insert_user(user, now, true).await
    }

    async fn user_by_name(&self, username: &str) -> StoreResult<Option<User>> {
        let sql = format!("SELECT {USER_COLUMNS} FROM users WHERE username = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(username.to_owned())
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::user).transpose()
    }

    async fn user_by_id(&self, id: i64) -> StoreResult<Option<User>> {
        let sql = format!("SELECT {USER_COLUMNS} FROM users WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::user).transpose()
    }

    async fn list_users(&self) -> StoreResult<Vec<User>> {
        let sql = format!("SELECT {USER_COLUMNS} FROM users ORDER BY username");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::user)
    }

    async fn update_user(&self, id: i64, change: &UserChange, now: UnixMs) -> StoreResult<User> {
        let mut tx = self.begin_write().await?;
        Self::check_user_change(&mut tx, id, change).await?;
        let set = match change {
            UserChange::Password(_) => "password_hash",
            UserChange::Role(_) => "role",
            UserChange::Disabled(_) => "disabled",
        };
        let sql = format!(
            "UPDATE users SET {set} = $1, updated_at = $2 WHERE id = $3 RETURNING {USER_COLUMNS}"
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(sql));
        let query = match change {
            UserChange::Password(hash) => query.bind(hash.clone()),
            UserChange::Role(role) => query.bind(role.as_str()),
            UserChange::Disabled(disabled) => query.bind(*disabled),
        };
        let row = query
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "user",
                key: id.to_string(),
            })?;
        let user = row.user()?;
        sqlx::query(
            "UPDATE sessions SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL",
        )
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        // Tokens a user made carry at most the access they had: a
        // user disabled or given another role loses them too.
        if matches!(change, UserChange::Role(_) | UserChange::Disabled(true)) {
            sqlx::query("UPDATE api_tokens SET revoked_at = $1 WHERE created_by = $2 AND revoked_at IS NULL")
                .bind(now)
                .bind(user.username.clone())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(user)
    }

    async fn set_theme(&self, id: i64, theme: Option<&str>) -> StoreResult<()> {
        if theme.is_some_and(|t| t != "light" && t != "dark") {
            return Err(StoreError::Invalid(
                "a theme is `light` or `dark` (none: the system's)".into(),
            ));
        }
        let mut tx = self.begin_write().await?;
        let done = sqlx::query("UPDATE users SET theme = $1 WHERE id = $2")
            .bind(theme.map(str::to_owned))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() != 1 {
            return Err(StoreError::NotFound {
                what: "user",
                key: id.to_string(),
            });
        }
        tx.commit().await?;
        Ok(())
    }

    async fn create_session(&self, s: &Session) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("INSERT INTO sessions (id, user_id, created_at, expires_at, revoked_at, last_seen_at) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(s.id.clone())
            .bind(s.user_id)
            .bind(s.created_at)
            .bind(s.expires_at)
            .bind(s.revoked_at)
            .bind(s.last_seen_at)
            .execute(&mut *tx)
            .await
            .map_err(|e| conflict_or(e, "session", &s.id))?;
        tx.commit().await?;
        Ok(())
    }

    async fn session(&self, id: &str) -> StoreResult<Option<Session>> {
        let row = sqlx::query(
            "SELECT id, user_id, created_at, expires_at, revoked_at, last_seen_at FROM sessions WHERE id = $1",
        )
        .bind(id.to_owned())
        .fetch_optional(self.reader())
        .await?;
        row.as_ref().map(MapRow::session).transpose()
    }

    async fn touch_session(&self, id: &str, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE sessions SET last_seen_at = $1 WHERE id = $2 AND last_seen_at < $1")
            .bind(now)
            .bind(id.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn revoke_session(&self, id: &str, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE sessions SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2")
            .bind(now)
            .bind(id.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn purge_sessions(&self, before: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query("DELETE FROM sessions WHERE expires_at < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn heartbeat(&self, b: &NodeBeat, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO nodes (id, hostname, pid, version, started_at, heartbeat_at, draining, \
               config_version) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (id) DO UPDATE SET hostname = excluded.hostname, pid = excluded.pid, \
               version = excluded.version, heartbeat_at = excluded.heartbeat_at, \
               draining = excluded.draining, config_version = excluded.config_version",
        )
        .bind(b.id.clone())
        .bind(b.hostname.clone())
        .bind(b.pid)
        .bind(b.version.clone())
        .bind(b.started_at)
        .bind(now)
        .bind(b.draining)
        .bind(b.config_version.clone())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn list_nodes(&self) -> StoreResult<Vec<Node>> {
        let rows = sqlx::query(
            "SELECT id, hostname, pid, version, started_at, heartbeat_at, draining, config_version \
             FROM nodes ORDER BY id",
        )
        .fetch_all(self.reader())
        .await?;
        map_all(&rows, MapRow::node)
    }

    async fn remove_node(&self, id: &str) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM nodes WHERE id = $1")
            .bind(id.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn provider_state(&self, provider: &str) -> StoreResult<Option<ProviderState>> {
        let sql = format!("SELECT {PROVIDER_COLUMNS} FROM providers WHERE provider = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(provider.to_owned())
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::provider_state).transpose()
    }

    async fn provider_states(&self) -> StoreResult<Vec<ProviderState>> {
        let sql = format!("SELECT {PROVIDER_COLUMNS} FROM providers ORDER BY provider");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::provider_state)
    }

    async fn set_provider_pause(
        &self,
        provider: &str,
        paused: bool,
        actor: &str,
        reason: Option<&str>,
        now: UnixMs,
    ) -> StoreResult<ProviderState> {
        crate::store::refuse_nul("reason", reason)?;
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "INSERT INTO providers (provider, breaker, breaker_changed_at, paused, paused_by, paused_reason, updated_at) \
             VALUES ($1, 'closed', $5, $2, $3, $4, $5) \
             ON CONFLICT (provider) DO UPDATE SET paused = excluded.paused, paused_by = excluded.paused_by, \
               paused_reason = excluded.paused_reason, updated_at = excluded.updated_at \
             RETURNING {PROVIDER_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(provider.to_owned())
            .bind(paused)
            .bind(paused.then(|| actor.to_owned()))
            .bind(reason.filter(|_| paused).map(str::to_owned))
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
        let state = row.provider_state()?;
        let detail = serde_json::json!({ "provider": provider });
        Self::insert_event(
            &mut tx,
            &EventRow {
                record_id: None,
                at: now,
                kind: if paused {
                    "provider_paused"
                } else {
                    "provider_resumed"
                },
                actor,
                audit: true,
                from: None,
                to: None,
                step: None,
                reason,
                detail: Some(&detail),
            },
        )
        .await?;
        DB::notify_providers(&mut tx).await?;
        tx.commit().await?;
        Ok(state)
    }

    async fn throttle_provider(
        &self,
        provider: &str,
        until: UnixMs,
        now: UnixMs,
    ) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "INSERT INTO providers (provider, breaker, breaker_changed_at, throttled_until, updated_at) \
             VALUES ($1, 'closed', $3, $2, $3) \
             ON CONFLICT (provider) DO UPDATE SET \
               throttled_until = excluded.throttled_until, updated_at = excluded.updated_at \
             WHERE providers.throttled_until IS NULL \
               OR providers.throttled_until < excluded.throttled_until",
        )
        .bind(provider.to_owned())
        .bind(until)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        // Only a longer pause is news.
        if done.rows_affected() > 0 {
            DB::notify_providers(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn lease_permits(&self, req: &PermitRequest) -> StoreResult<Permits> {
        use crate::domain::permits::{self, Granted, SLOTS};
        let mut tx = self.begin_write().await?;
        let (provider, node, now) = (req.provider.as_str(), req.node.as_str(), req.now);
        Self::lock_provider(&mut tx, provider, now).await?;
        for &(id, used, done_at) in &req.close {
            // A grant that was never drawn on occupied nothing.
            let q = if used == 0 {
                sqlx::query("DELETE FROM provider_grants WHERE id = $1 AND node = $2")
            } else {
                sqlx::query(
                    "UPDATE provider_grants SET count = $3, done_at = $4 \
                     WHERE id = $1 AND node = $2 AND done_at IS NULL",
                )
            };
            let q = q.bind(id).bind(node.to_owned());
            let q = if used == 0 {
                q
            } else {
                q.bind(used).bind(done_at)
            };
            q.execute(&mut *tx).await?;
        }
        // What occupies nothing any more (`GrantRow::occupies_until`).
        sqlx::query(
            "DELETE FROM provider_grants WHERE provider = $1 AND ( \
               (done_at IS NOT NULL AND done_at + window_ms <= $2) \
               OR (done_at IS NULL AND expires_at + $3 + window_ms <= $2))",
        )
        .bind(provider.to_owned())
        .bind(now)
        .bind(req.lapse_ms)
        .execute(&mut *tx)
        .await?;
        let mut out = Permits::default();
        for &(window_ms, limit, want) in &req.windows {
            let rows = Self::grant_rows(&mut tx, provider, window_ms).await?;
            let answer = permits::grant(
                &rows,
                window_ms,
                limit,
                want,
                req.live_nodes,
                now,
                req.lapse_ms,
            );
            let id = match answer {
                Granted::Permits { count, expires_at } => {
                    let id: i64 = sqlx::query_scalar(
                        "INSERT INTO provider_grants (provider, node, window_ms, count, wanted, \
                           granted_at, expires_at) VALUES ($1, $2, $3, $4, $4, $5, $6) RETURNING id",
                    )
                    .bind(provider.to_owned())
                    .bind(node.to_owned())
                    .bind(window_ms)
                    .bind(count)
                    .bind(now)
                    .bind(expires_at)
                    .fetch_one(&mut *tx)
                    .await?;
                    Some(id)
                }
                Granted::Full { .. } => None,
            };
            out.windows.push((window_ms, id, answer));
        }
        if let Some(slots) = req.slots {
            let rows = Self::grant_rows(&mut tx, provider, SLOTS).await?;
            let share = permits::slots(&rows, node, &slots.ask, now, req.lapse_ms);
            let until = now.saturating_add(slots.hold_ms);
            sqlx::query(
                "INSERT INTO provider_grants (provider, node, window_ms, count, wanted, granted_at, expires_at) \
                 VALUES ($1, $2, 0, $3, $4, $5, $6) \
                 ON CONFLICT (provider, node) WHERE window_ms = 0 DO UPDATE SET \
                   count = excluded.count, wanted = excluded.wanted, expires_at = excluded.expires_at",
            )
            .bind(provider.to_owned())
            .bind(node.to_owned())
            .bind(share.holding)
            .bind(slots.ask.need)
            .bind(now)
            .bind(until)
            .execute(&mut *tx)
            .await?;
            // The others come down to their shares at once, not at their
            // next renewal (PostgreSQL: their listeners run a provider sync).
            if share.announce {
                DB::notify_providers(&mut tx).await?;
            }
            out.slots = Some((share, until));
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn breaker_op(
        &self,
        provider: &str,
        op: SharedOp,
        stats: Option<&Value>,
        now: UnixMs,
    ) -> StoreResult<(SharedBreaker, Option<ProbeGrant>)> {
        let mut tx = self.begin_write().await?;
        Self::lock_provider(&mut tx, provider, now).await?;
        let sql = format!("SELECT {BREAKER_COLUMNS} FROM providers WHERE provider = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(provider.to_owned())
            .fetch_one(&mut *tx)
            .await?;
        let before = row.shared_breaker()?;
        let mut after = before.clone();
        let grant = after.apply(op, now);
        if after != before || stats.is_some() {
            sqlx::query(
                "UPDATE providers SET breaker = $2, breaker_changed_at = $3, open_until = $4, \
                   probes_out = $5, probes_ok = $6, probe_until = $7, \
                   stats = COALESCE($8, stats), updated_at = $9 \
                 WHERE provider = $1",
            )
            .bind(provider.to_owned())
            .bind(after.state.as_str())
            .bind(after.changed_at)
            .bind(after.open_until)
            .bind(i64::from(after.probes_out))
            .bind(i64::from(after.probes_ok))
            .bind(after.probe_until)
            .bind(stats.cloned().map(Json))
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        if after.state != before.state || after.open_until != before.open_until {
            DB::notify_providers(&mut tx).await?;
        }
        tx.commit().await?;
        Ok((after, grant))
    }

    async fn save_provider_state(&self, p: &ProviderState) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO providers (provider, breaker, breaker_changed_at, open_until, paused, paused_by, \
               paused_reason, stats, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (provider) DO UPDATE SET breaker = excluded.breaker, \
               breaker_changed_at = excluded.breaker_changed_at, open_until = excluded.open_until, \
               paused = excluded.paused, paused_by = excluded.paused_by, \
               paused_reason = excluded.paused_reason, stats = excluded.stats, updated_at = excluded.updated_at",
        )
        .bind(p.provider.clone())
        .bind(p.breaker.as_str())
        .bind(p.breaker_changed_at)
        .bind(p.open_until)
        .bind(p.paused)
        .bind(p.paused_by.clone())
        .bind(p.paused_reason.clone())
        .bind(p.stats.clone().map(Json))
        .bind(p.updated_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
    async fn ensure_meta(&self, key: &str, value: &str) -> StoreResult<String> {
        let mut tx = self.begin_write().await?;
        sqlx::query("INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING")
            .bind(key.to_owned())
            .bind(value.to_owned())
            .execute(&mut *tx)
            .await?;
        let stored: String = sqlx::query_scalar("SELECT value FROM meta WHERE key = $1")
            .bind(key.to_owned())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(stored)
    }

    async fn rotate_meta_secret(&self, key: &str, value: &str, now: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        sqlx::query("INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value")
            .bind(key.to_owned())
            .bind(value.to_owned())
            .execute(&mut *tx)
            .await?;
        let revoked = sqlx::query("UPDATE sessions SET revoked_at = $1 WHERE revoked_at IS NULL")
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(revoked.rows_affected())
    }

    async fn create_api_token(
        &self,
        t: &crate::store::NewApiToken,
        now: UnixMs,
    ) -> StoreResult<crate::domain::ApiToken> {
        if t.name.trim().is_empty() || t.name.len() > 100 {
            return Err(StoreError::Invalid(
                "a token needs a name of 1-100 characters".into(),
            ));
        }
        crate::store::refuse_nul("token name", Some(&t.name))?;
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "INSERT INTO api_tokens (name, token_hash, prefix, role, created_by, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {API_TOKEN_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(t.name.clone())
            .bind(t.token_hash.clone())
            .bind(t.prefix.clone())
            .bind(t.role.as_str())
            .bind(t.created_by.clone())
            .bind(now)
            .bind(t.expires_at)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| conflict_or(e, "api token", &t.prefix))?;
        let token = row.api_token()?;
        let detail = serde_json::json!({
            "token_id": token.id, "name": token.name, "role": token.role.as_str(),
            "expires_at": token.expires_at,
        });
        Self::insert_event(
            &mut tx,
            &EventRow {
                record_id: None,
                at: now,
                kind: "token_created",
                actor: &t.created_by,
                audit: true,
                from: None,
                to: None,
                step: None,
                reason: None,
                detail: Some(&detail),
            },
        )
        .await?;
        tx.commit().await?;
        Ok(token)
    }

    async fn api_token_by_hash(&self, hash: &str) -> StoreResult<Option<crate::domain::ApiToken>> {
        let sql = format!(
            "SELECT {API_TOKEN_COLUMNS} FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(hash.to_owned())
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::api_token).transpose()
    }

    async fn list_api_tokens(&self) -> StoreResult<Vec<crate::domain::ApiToken>> {
        let sql = format!("SELECT {API_TOKEN_COLUMNS} FROM api_tokens ORDER BY id DESC");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::api_token)
    }

    async fn revoke_api_token(
        &self,
        id: i64,
        actor: &str,
        now: UnixMs,
    ) -> StoreResult<crate::domain::ApiToken> {
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2 RETURNING {API_TOKEN_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "api token",
                key: id.to_string(),
            })?;
        let token = row.api_token()?;
        let detail = serde_json::json!({ "token_id": token.id, "name": token.name });
        Self::insert_event(
            &mut tx,
            &EventRow {
                record_id: None,
                at: now,
                kind: "token_revoked",
                actor,
                audit: true,
                from: None,
                to: None,
                step: None,
                reason: None,
                detail: Some(&detail),
            },
        )
        .await?;
        tx.commit().await?;
        Ok(token)
    }

    async fn touch_api_token(&self, id: i64, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE api_tokens SET last_used_at = $1 WHERE id = $2 AND (last_used_at IS NULL OR last_used_at < $3)")
            .bind(now)
            .bind(id)
            .bind(now - 60_000)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn login_failures(&self, username: &str) -> StoreResult<Option<LoginFailures>> {
        let row: Option<(i64, i64)> = sqlx::query_as(
            "SELECT failures, last_failure_at FROM login_throttle WHERE username = $1",
        )
        .bind(username.to_owned())
        .fetch_optional(self.reader())
        .await?;
        Ok(row.map(|(failures, last_failure_at)| LoginFailures {
            failures,
            last_failure_at,
        }))
    }

    async fn count_login_failure(
        &self,
        username: &str,
        now: UnixMs,
        forget_before: UnixMs,
    ) -> StoreResult<LoginFailures> {
        let mut tx = self.begin_write().await?;
        // One statement, so concurrent failures on several nodes all count.
        let (failures, last_failure_at): (i64, i64) = sqlx::query_as(
            "INSERT INTO login_throttle (username, failures, last_failure_at) VALUES ($1, 1, $2) \
             ON CONFLICT (username) DO UPDATE SET \
               failures = CASE WHEN login_throttle.last_failure_at < $3 THEN 1 \
                 ELSE login_throttle.failures + 1 END, \
               last_failure_at = $2 \
             RETURNING failures, last_failure_at",
        )
        .bind(username.to_owned())
        .bind(now)
        .bind(forget_before)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(LoginFailures {
            failures,
            last_failure_at,
        })
    }

    async fn claim_login_check(
        &self,
        username: &str,
        seen: LoginFailures,
        now: UnixMs,
    ) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let taken = sqlx::query(
            "UPDATE login_throttle SET failures = failures + 1, last_failure_at = $4 \
             WHERE username = $1 AND failures = $2 AND last_failure_at = $3",
        )
        .bind(username.to_owned())
        .bind(seen.failures)
        .bind(seen.last_failure_at)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(taken.rows_affected() == 1)
    }

    async fn login_succeeded(&self, username: &str) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM login_throttle WHERE username = $1")
            .bind(username.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
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
            "SELECT id, state, provider, step FROM records r \
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
            let parsed: RecordState = state
                .parse()
                .map_err(|_| StoreError::Corrupt(format!("record {id} has state `{state}`")))?;
            deltas.removed(pipeline, parsed, provider.as_deref(), step.as_deref());
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
        let event = Self::audit_purge(&mut tx, run, pipeline, &purged).await?;
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
        let event = Self::audit_purge(&mut tx, run, pipeline, &batch).await?;
        tx.commit().await?;
        Ok((n, rows.len() >= limit as usize, event))
    }

    async fn take_task_lease(
        &self,
        name: &str,
        owner: &str,
        until: UnixMs,
        now: UnixMs,
    ) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "INSERT INTO task_leases (name, owner, until) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, until = excluded.until \
             WHERE task_leases.until <= $4 OR task_leases.owner = excluded.owner",
        )
        .bind(name.to_owned())
        .bind(owner.to_owned())
        .bind(until)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release_task_lease(&self, name: &str, owner: &str) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM task_leases WHERE name = $1 AND owner = $2")
            .bind(name.to_owned())
            .bind(owner.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
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

    async fn index_records(&self, records: &[i64], settled: i64) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let indexed = if records.is_empty() {
            0
        } else {
            DB::index_in(&mut tx, records).await?
        };
        // Only forward: a node that lost the lease mid-turn never moves it back.
        sqlx::query("UPDATE search_progress SET event_id = $1 WHERE id = 1 AND event_id < $1")
            .bind(settled)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(indexed)
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
        tx.commit().await?;
        Ok(a.rows_affected() + hours.rows_affected() + b.rows_affected() + c.rows_affected())
    }
}

/// An event's record, for the search indexer: none for those that change
/// nothing a record is searched by (a claim, a lease given back or run
/// out), so they cost the indexer no document.
const SEARCH_RECORD: &str =
    "CASE WHEN kind IN ('claimed', 'released', 'lease_expired') THEN NULL ELSE record_id END";
