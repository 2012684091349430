//! The part of the [`Store`](super::Store) implementation both backends share.
//!
//! SQLite and PostgreSQL accept the same SQL for almost everything Ballast
//! does (`$n` placeholders, `ON CONFLICT`, `RETURNING`, partial indexes), so
//! the logic is written once here and instantiated per backend by
//! `common_store!`. What really differs stays in `sqlite.rs` and
//! `postgres.rs`: connecting, how a write transaction begins (a single
//! writer with `BEGIN IMMEDIATE` against row locks), the row-lock clause,
//! counter sharding, and claiming (`FOR UPDATE SKIP LOCKED`).
//!
//! Each backend provides, as inherent items:
//! - `async fn begin_write(&self) -> Result<Transaction<'static, DB>, sqlx::Error>`
//! - `fn reader(&self) -> &Pool<DB>`
//! - `fn counter_shard() -> i32`
//! - `async fn claim_in(tx: &mut Transaction<'static, DB>, req: &ClaimRequest) -> StoreResult<Claimed>`:
//!   leases due records inside the caller's transaction, in due order, with
//!   the state each was taken from

/// A statement text built once per call site (and so once per backend:
/// `common_store!` expands every call site for each), then reused.
macro_rules! cached_sql {
    ($build:expr) => {{
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        SQL.get_or_init(|| $build).as_str()
    }};
}

/// Instantiates the shared store logic. `lock` is appended to row reads made
/// inside a write transaction; `audit` is the spelling of "audit is true"
/// that matches the backend's partial indexes; `dialect` names the
/// backend's [`batch::Dialect`](super::batch::Dialect), whose `rows()` is the
/// table of JSON rows read from parameter `$1` (see `batch.rs`); `any_of` is how `column <any_of.0>subquery<any_of.1>`
/// matches a key against a subquery's values through the key's index
/// whatever the statistics say (see `postgres.rs`); `update_key` is added
/// to the batched record update's join for the same reason (empty on
/// SQLite, whose planner would then scan the JSON rows once per record).
macro_rules! common_store {
    ($store:ty, $db:ty, lock = $lock:literal, audit = $audit:literal, dialect = $dialect:ident,
     any_of = ($any_open:literal, $any_close:literal), update_key = $update_key:literal) => {
        use serde_json::Value as JsonValue;
        use sqlx::types::Json;
        use sqlx::Transaction;

        use $crate::domain::{
            transition, Attempt, Event, Node, OperatorAction, PipelineVersion,
            ProviderState, Record, RecordState, Session, StateCount, StepRun, Trigger,
            UnixMs, User,
        };
        use $crate::store::batch;

        /// This backend's spelling of batched rows.
        const DIALECT: batch::Dialect = batch::Dialect::$dialect;
        use $crate::store::counts::CountDeltas;
        use $crate::store::rows::{map_all, MapRow};
        use $crate::store::filter::{push_audit_filter, push_record_filter};
        use $crate::store::rows::{
            API_TOKEN_COLUMNS, ATTEMPT_COLUMNS, EVENT_COLUMNS, ROLLUP_COLUMNS, PROVIDER_COLUMNS, RECORD_COLUMNS, STEP_COLUMNS,
            USER_COLUMNS,
        };
        use $crate::store::{
            into_page, node_actor, page_limit, validate_username, worked_state, ActionRequest,
            AuditFilter, ClaimRequest, Commit, Created, EventRow, Lease, NewEvent, NewRecord,
            NewUser, NodeBeat, Page, RecordFilter, Store, StoreError, StoreResult, UserChange,
        };

        type Tx = Transaction<'static, $db>;

        /// Maps a unique-constraint violation to `Conflict`.
        fn conflict_or(e: sqlx::Error, what: &'static str, key: &str) -> StoreError {
            match &e {
                sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict {
                    what,
                    key: key.to_owned(),
                },
                _ => StoreError::Database(e),
            }
        }

        impl $store {
            /// Adds counter deltas inside the caller's transaction: one
            /// upsert per counter table (the deltas are unique per key, so
            /// no row is touched twice by one statement).
            pub(crate) async fn apply_counts(tx: &mut Tx, deltas: &CountDeltas) -> StoreResult<()> {
                let shard = Self::counter_shard();
                let tables = [
                    (cached_sql!(Self::counts_sql("record_counts", "pipeline")), deltas.nonzero().collect::<Vec<_>>()),
                    (cached_sql!(Self::counts_sql("provider_counts", "provider")), deltas.provider_nonzero().collect::<Vec<_>>()),
                ];
                for (sql, rows) in tables {
                    if rows.is_empty() {
                        continue;
                    }
                    let rows: Vec<batch::CountJson<'_>> = rows
                        .iter()
                        .map(|(name, state, n)| batch::CountJson { name, state: state.as_str(), shard, n: *n })
                        .collect();
                    sqlx::query(sql).bind(Json(&rows)).execute(&mut **tx).await?;
                }
                Ok(())
            }

            /// The counter upsert into `table`, whose key column is `key`.
            fn counts_sql(table: &str, key: &str) -> String {
                format!(
                    "INSERT INTO {table} ({key}, state, shard, n) SELECT {} FROM {} WHERE true ORDER BY key \
                     ON CONFLICT ({key}, state, shard) DO UPDATE SET n = {table}.n + excluded.n",
                    batch::select(batch::COUNT_COLS, DIALECT),
                    DIALECT.rows()
                )
            }

            /// Appends one event inside the caller's transaction and
            /// returns it as stored.
            pub(crate) async fn insert_event(tx: &mut Tx, e: &EventRow<'_>) -> StoreResult<Event> {
                let sql = cached_sql!(batch::insert("events", batch::EVENT_COLS, DIALECT,
                    "RETURNING id, record_id, at, kind, actor, audit, from_state, to_state, step, reason, detail"
                ));
                let row = sqlx::query(sql)
                    .bind(Json([batch::EventJson::from(e)]))
                    .fetch_one(&mut **tx)
                    .await?;
                row.event()
            }

            async fn lock_record(tx: &mut Tx, id: i64) -> StoreResult<Option<Record>> {
                let sql = format!("SELECT {RECORD_COLUMNS} FROM records WHERE id = $1{}", $lock);
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id)
                    .fetch_optional(&mut **tx)
                    .await?;
                row.as_ref().map(MapRow::record).transpose()
            }

            async fn upsert_step(
                tx: &mut Tx,
                installation: &str,
                record_id: i64,
                s: &$crate::store::StepWrite,
                now: UnixMs,
            ) -> StoreResult<()> {
                Self::upsert_steps(tx, installation, &[(record_id, s, now)]).await
            }

            /// Writes step runs in one upsert; one row per (record, step) in
            /// `steps`.
            async fn upsert_steps(
                tx: &mut Tx,
                installation: &str,
                steps: &[(i64, &$crate::store::StepWrite, UnixMs)],
            ) -> StoreResult<()> {
                if steps.is_empty() {
                    return Ok(());
                }
                let rows: Vec<batch::StepJson<'_>> = steps
                    .iter()
                    .map(|(record_id, s, now)| batch::StepJson::new(installation, *record_id, s, *now))
                    .collect();
                let sql = cached_sql!(batch::insert("step_runs", batch::STEP_COLS, DIALECT,
                    "ON CONFLICT (record_id, step) DO UPDATE SET state = excluded.state, provider = excluded.provider, \
                       unknowns = excluded.unknowns, \
                       generation = excluded.generation, attempts = excluded.attempts, \
                       idempotency_key = excluded.idempotency_key, job_id = excluded.job_id, \
                       output = excluded.output, error_code = excluded.error_code, reason = excluded.reason, \
                       next_run_at = excluded.next_run_at, deadline_at = excluded.deadline_at, \
                       started_at = excluded.started_at, finished_at = excluded.finished_at, \
                       updated_at = excluded.updated_at"
                ));
                sqlx::query(sql).bind(Json(&rows)).execute(&mut **tx).await?;
                Ok(())
            }

            /// Appends attempts in one insert.
            async fn insert_attempts(tx: &mut Tx, attempts: &[(i64, &$crate::store::NewAttempt)]) -> StoreResult<()> {
                if attempts.is_empty() {
                    return Ok(());
                }
                let rows: Vec<batch::AttemptJson<'_>> =
                    attempts.iter().map(|(record_id, a)| batch::AttemptJson::new(*record_id, a)).collect();
                let sql = cached_sql!(batch::insert("attempts", batch::ATTEMPT_COLS, DIALECT, ""));
                sqlx::query(sql).bind(Json(&rows)).execute(&mut **tx).await?;
                Ok(())
            }

            /// Appends events in one insert (callers that need the stored
            /// event back use `insert_event`).
            pub(crate) async fn insert_events(tx: &mut Tx, events: &[EventRow<'_>]) -> StoreResult<()> {
                if events.is_empty() {
                    return Ok(());
                }
                let rows: Vec<batch::EventJson<'_>> = events.iter().map(batch::EventJson::from).collect();
                let sql = cached_sql!(batch::insert("events", batch::EVENT_COLS, DIALECT, ""));
                sqlx::query(sql).bind(Json(&rows)).execute(&mut **tx).await?;
                Ok(())
            }

            /// Reads and (on PostgreSQL) locks records, in id order, so that
            /// two multi-row writers can never deadlock.
            async fn lock_records(tx: &mut Tx, ids: &[i64]) -> StoreResult<std::collections::HashMap<i64, Record>> {
                let sql = cached_sql!(format!(
                    "SELECT {RECORD_COLUMNS} FROM records WHERE id {}SELECT CAST(value AS BIGINT) FROM {}{} ORDER BY id{}",
                    $any_open, DIALECT.rows(), $any_close, $lock
                ));
                let rows = sqlx::query(sql).bind(Json(ids)).fetch_all(&mut **tx).await?;
                let mut out = std::collections::HashMap::with_capacity(ids.len());
                for row in &rows {
                    let rec = MapRow::record(row)?;
                    out.insert(rec.id, rec);
                }
                Ok(out)
            }

            /// Writes the worker-owned columns of records whose rows the
            /// transaction holds, in one statement.
            async fn update_records(tx: &mut Tx, records: &[Record]) -> StoreResult<()> {
                if records.is_empty() {
                    return Ok(());
                }
                let rows: Vec<batch::RecordUpdateJson<'_>> = records.iter().map(batch::RecordUpdateJson::from).collect();
                let sql = cached_sql!(format!(
                    "WITH v AS (SELECT {} FROM {}) \
                     UPDATE records SET state = v.state, next_run_at = v.next_run_at, \
                       lease_owner = v.lease_owner, lease_until = v.lease_until, step = v.step, \
                       provider = v.provider, error_code = v.error_code, reason = v.reason, \
                       updated_at = v.updated_at, finished_at = v.finished_at \
                     FROM v WHERE records.id = v.id{}",
                    batch::select_as(batch::RECORD_UPDATE_COLS, DIALECT),
                    DIALECT.rows(),
                    $update_key
                ));
                sqlx::query(sql).bind(Json(&rows)).execute(&mut **tx).await?;
                Ok(())
            }

            /// The events and counter moves of a claim: `old_states` maps
            /// each claimed id to the state it was taken from. A record
            /// taken from `running` had an expired lease, recorded first.
            fn claim_moves<'e>(
                claimed: &[Record],
                old_states: &std::collections::HashMap<i64, String>,
                now: UnixMs,
                actor: &'e str,
            ) -> StoreResult<(Vec<EventRow<'e>>, CountDeltas)> {
                let mut events = Vec::with_capacity(claimed.len());
                let mut deltas = CountDeltas::default();
                for rec in claimed {
                    let old = old_states.get(&rec.id).map_or("", String::as_str);
                    let old: RecordState = $crate::store::rows::parse(old, "record state")?;
                    let mut from = old;
                    let mut steps = vec![Trigger::Claim];
                    if old == RecordState::Running {
                        steps.insert(0, Trigger::LeaseExpired);
                    }
                    for trigger in steps {
                        let to = transition(from, trigger)?;
                        events.push(EventRow {
                            record_id: Some(rec.id),
                            at: now,
                            kind: trigger.kind(),
                            actor,
                            audit: false,
                            from: Some(from),
                            to: Some(to),
                            step: None,
                            reason: None,
                            detail: None,
                        });
                        from = to;
                    }
                    deltas.moved(&rec.pipeline, Some(old), from);
                    deltas.provider_moved(
                        rec.provider.as_deref().map(|p| (p, old)),
                        rec.provider.as_deref().map(|p| (p, from)),
                    );
                }
                Ok((events, deltas))
            }

            /// Resets `steps` to run again from scratch, each under a new
            /// generation (so a new idempotency key): replays and reruns.
            async fn rerun_steps(tx: &mut Tx, installation: &str, record_id: i64, steps: &[String], now: UnixMs) -> StoreResult<()> {
                for step in steps {
                    let generation: Option<i32> =
                        sqlx::query_scalar("SELECT generation FROM step_runs WHERE record_id = $1 AND step = $2")
                            .bind(record_id)
                            .bind(step.clone())
                            .fetch_optional(&mut **tx)
                            .await?;
                    let mut write = $crate::store::StepWrite::pending(step);
                    write.generation = generation.map_or(0, |g| g + 1);
                    Self::upsert_step(tx, installation, record_id, &write, now).await?;
                }
                Ok(())
            }

            /// Inserts a batch of records with multi-row statements and
            /// their `created` events (or finds the record with the same
            /// external key) inside the caller's transaction; the caller
            /// applies `deltas`. Results are in the order of `batch`.
            async fn insert_records(tx: &mut Tx, batch: &[NewRecord], now: UnixMs, deltas: &mut CountDeltas) -> StoreResult<Vec<Created>> {
                let mut out: Vec<Option<Created>> = batch.iter().map(|_| None).collect();
                let rows: Vec<batch::NewRecordJson<'_>> = batch.iter().map(|r| batch::NewRecordJson::new(r, now)).collect();
                let sql = cached_sql!(batch::insert("records", batch::NEW_RECORD_COLS, DIALECT,
                    &format!("ON CONFLICT (pipeline, external_key) DO NOTHING RETURNING {RECORD_COLUMNS}")
                ));
                let inserted = sqlx::query(sql).bind(Json(&rows)).fetch_all(&mut **tx).await?;
                let mut inserted = map_all(&inserted, MapRow::record)?;
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
                            deltas.moved(&record.pipeline, None, RecordState::Pending);
                            *slot = Some(Created { record, created: true });
                        }
                    }
                }
                if inserted.next().is_some() {
                    return Err(StoreError::Invalid("inserted records did not match the batch".into()));
                }
                let events: Vec<EventRow<'_>> = out
                    .iter()
                    .flatten()
                    .map(|c| EventRow {
                        record_id: Some(c.record.id),
                        at: now,
                        kind: "created",
                        actor: "system",
                        audit: false,
                        from: None,
                        to: Some(RecordState::Pending),
                        step: None,
                        reason: None,
                        detail: None,
                    })
                    .collect();
                Self::insert_events(tx, &events).await?;
                // Repeats: the record with that key, from before or from
                // earlier in this batch.
                let sql = format!("SELECT {RECORD_COLUMNS} FROM records WHERE pipeline = $1 AND external_key = $2");
                let mut done = Vec::with_capacity(batch.len());
                for (slot, new) in out.into_iter().zip(batch) {
                    let created = match slot {
                        Some(c) => c,
                        None => {
                            let row = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                                .bind(new.pipeline.clone())
                                .bind(new.external_key.clone())
                                .fetch_one(&mut **tx)
                                .await?;
                            Created { record: row.record()?, created: false }
                        }
                    };
                    done.push(created);
                }
                Ok(done)
            }

            /// Moves one record whose row the transaction holds and writes
            /// the event; the caller applies `deltas`.
            #[allow(clippy::too_many_arguments)]
            async fn move_record(
                tx: &mut Tx,
                rec: &Record,
                to: RecordState,
                next_run_at: Option<UnixMs>,
                now: UnixMs,
                event: EventRow<'_>,
                error_code: Option<&str>,
                deltas: &mut CountDeltas,
            ) -> StoreResult<Record> {
                let finished_at = if to.is_terminal() { Some(now) } else { None };
                let sql = format!(
                    "UPDATE records SET state = $1, next_run_at = $2, lease_owner = NULL, lease_until = NULL, \
                     error_code = $3, reason = $4, step = COALESCE($5, step), updated_at = $6, finished_at = $7 \
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
                    .fetch_one(&mut **tx)
                    .await?;
                Self::insert_event(tx, &event).await?;
                let after = row.record()?;
                deltas.record_moved(rec, &after);
                Ok(after)
            }
        }

        impl Store for $store {
            async fn ping(&self) -> StoreResult<()> {
                sqlx::query("SELECT 1").execute(self.reader()).await?;
                Ok(())
            }

            async fn installation_id(&self) -> StoreResult<String> {
                let id = self
                    .installation
                    .get_or_try_init(|| async {
                        sqlx::query_scalar::<_, String>("SELECT value FROM meta WHERE key = 'installation_id'")
                            .fetch_one(self.reader())
                            .await
                    })
                    .await?;
                Ok(id.clone())
            }

            async fn create_record(&self, new: NewRecord, now: UnixMs) -> StoreResult<Created> {
                let mut created = self.create_records(vec![new], now).await?;
                created.pop().ok_or_else(|| StoreError::Invalid("nothing enqueued".into()))
            }

            async fn create_records(&self, batch: Vec<NewRecord>, now: UnixMs) -> StoreResult<Vec<Created>> {
                if batch.iter().any(|n| n.pipeline.is_empty()) {
                    return Err(StoreError::Invalid("pipeline name is empty".into()));
                }
                // Refused on both backends alike (PostgreSQL cannot store it).
                let nul = |s: &str| s.contains('\0');
                if batch.iter().any(|n| {
                    nul(&n.pipeline) || n.external_key.as_deref().is_some_and(nul) || $crate::domain::json_has_nul(&n.input)
                }) {
                    return Err(StoreError::Invalid("a NUL character (\\u0000) in the pipeline, key or input".into()));
                }
                if batch.len() > $crate::store::MAX_BATCH {
                    return Err(StoreError::Invalid(format!(
                        "at most {} records per batch",
                        $crate::store::MAX_BATCH
                    )));
                }
                let mut tx = self.begin_write().await?;
                let mut deltas = CountDeltas::default();
                let out = Self::insert_records(&mut tx, &batch, now, &mut deltas).await?;
                Self::apply_counts(&mut tx, &deltas).await?;
                if out.iter().any(|c| c.created) {
                    Self::notify_work(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(out)
            }

            async fn get_record(&self, id: i64) -> StoreResult<Option<Record>> {
                let sql = format!("SELECT {RECORD_COLUMNS} FROM records WHERE id = $1");
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id)
                    .fetch_optional(self.reader())
                    .await?;
                row.as_ref().map(MapRow::record).transpose()
            }

            async fn list_records(&self, filter: &RecordFilter) -> StoreResult<Page<Record>> {
                let limit = page_limit(filter.limit);
                let query = |f: &RecordFilter, floor: Option<i64>, n: i64| {
                    let mut qb = sqlx::QueryBuilder::<$db>::new(format!("SELECT {RECORD_COLUMNS} FROM records"));
                    push_record_filter(&mut qb, f, floor);
                    qb.push(" ORDER BY id DESC LIMIT ").push_bind(n);
                    qb
                };
                if !$crate::store::filter::needs_windows(filter) {
                    let rows = query(filter, None, i64::from(limit) + 1).build().fetch_all(self.reader()).await?;
                    return Ok(into_page(map_all(&rows, MapRow::record)?, limit, |r| r.id));
                }
                // Several filters and no index for them together: search
                // windows of ids from the top down, at most LIST_SCAN_IDS ids
                // per call, so a search that matches little stays bounded.
                // A short page with a `next` says "keep searching from here".
                use $crate::store::{LIST_SCAN_IDS, LIST_WINDOW_IDS};
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
                    let rows = query(&f, Some(lower), want).build().fetch_all(self.reader()).await?;
                    items.extend(map_all(&rows, MapRow::record)?);
                    if items.len() > limit as usize {
                        return Ok(into_page(items, limit, |r| r.id));
                    }
                    if lower <= 1 {
                        return Ok(Page { items, next: None });
                    }
                    if lower <= stop {
                        return Ok(Page { items, next: Some(lower) });
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
                Ok(sqlx::query_scalar("SELECT MIN(next_run_at) FROM records WHERE next_run_at IS NOT NULL")
                    .fetch_one(self.reader())
                    .await?)
            }

            async fn claim_due(&self, req: &ClaimRequest) -> StoreResult<Vec<Record>> {
                if req.owner.is_empty() {
                    return Err(StoreError::Invalid("lease owner is empty".into()));
                }
                let mut tx = self.begin_write().await?;
                let (claimed, old_states) = Self::claim_in(&mut tx, req).await?;
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
                    let Some(rec) = Self::lock_record(&mut tx, lease.record_id).await? else { continue };
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
                        reason: Some($crate::domain::SHUTDOWN_REASON),
                        detail: None,
                    };
                    Self::move_record(&mut tx, &rec, to, Some(now), now, event, rec.error_code.as_deref(), &mut deltas).await?;
                    released += 1;
                }
                Self::apply_counts(&mut tx, &deltas).await?;
                if released > 0 {
                    Self::notify_work(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(released)
            }

            async fn commit(&self, c: &Commit) -> StoreResult<Record> {
                let mut results = self.commit_many(std::slice::from_ref(c)).await?;
                results.pop().unwrap_or(Err(StoreError::LeaseLost { record_id: c.lease.record_id }))
            }

            async fn commit_many(&self, commits: &[Commit]) -> StoreResult<Vec<StoreResult<Record>>> {
                if commits.is_empty() {
                    return Ok(Vec::new());
                }
                let mut ids: Vec<i64> = commits.iter().map(|c| c.lease.record_id).collect();
                ids.sort_unstable();
                ids.dedup();
                if ids.len() != commits.len() {
                    return Err(StoreError::Invalid("a group of commits names one record twice".into()));
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
                let mut events = Vec::with_capacity(commits.len());
                let mut deltas = CountDeltas::default();
                for (c, actor) in commits.iter().zip(&actors) {
                    let Some(rec) = held.get(&c.lease.record_id).filter(|r| r.lease().as_ref() == Some(&c.lease)) else {
                        results.push(Err(StoreError::LeaseLost { record_id: c.lease.record_id }));
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
                Self::insert_events(&mut tx, &events).await?;
                Self::apply_counts(&mut tx, &deltas).await?;
                tx.commit().await?;
                Ok(results)
            }

            async fn act(&self, req: &ActionRequest) -> StoreResult<Record> {
                $crate::store::refuse_nul("reason", req.reason.as_deref())?;
                if req.action == OperatorAction::ReplayFrom && req.steps.is_empty() {
                    return Err(StoreError::Invalid("replay needs the step to replay from".into()));
                }
                let installation = self.installation_id().await?;
                let mut tx = self.begin_write().await?;
                let rec = Self::lock_record(&mut tx, req.record_id).await?.ok_or_else(|| {
                    StoreError::NotFound { what: "record", key: req.record_id.to_string() }
                })?;
                let to = transition(rec.state, Trigger::Operator(req.action))?;
                match req.action {
                    OperatorAction::Retry => {
                        // A fresh attempt budget (and deadline) for every
                        // step that has not finished; a submitted job keeps
                        // its id, so it is polled, not paid for again.
                        sqlx::query(
                            "UPDATE step_runs SET attempts = 0, unknowns = 0, deadline_at = NULL, next_run_at = NULL, \
                             error_code = NULL, reason = NULL, updated_at = $1, \
                             state = CASE WHEN job_id IS NULL THEN 'pending' ELSE 'waiting' END \
                             WHERE record_id = $2 AND state NOT IN ('succeeded', 'skipped')",
                        )
                        .bind(req.now)
                        .bind(rec.id)
                        .execute(&mut *tx)
                        .await?;
                    }
                    OperatorAction::ReplayFrom => {
                        Self::rerun_steps(&mut tx, &installation, rec.id, &req.steps, req.now).await?;
                    }
                    OperatorAction::Park | OperatorAction::Resume | OperatorAction::Cancel => {}
                }
                let next = to.is_scheduled().then_some(req.now);
                let detail = (req.action == OperatorAction::ReplayFrom)
                    .then(|| serde_json::json!({ "steps": req.steps }));
                // Parking and cancelling keep the last error code for
                // filtering; moving on clears it.
                let error_code = match to {
                    RecordState::Parked | RecordState::Cancelled => rec.error_code.clone(),
                    _ => None,
                };
                let event = EventRow {
                    record_id: Some(rec.id),
                    at: req.now,
                    kind: req.action.as_str(),
                    actor: &req.actor,
                    audit: true,
                    from: Some(rec.state),
                    to: Some(to),
                    step: (req.action == OperatorAction::ReplayFrom)
                        .then(|| req.steps.first().map(String::as_str))
                        .flatten(),
                    reason: req.reason.as_deref(),
                    detail: detail.as_ref(),
                };
                let mut deltas = CountDeltas::default();
                let moved = Self::move_record(&mut tx, &rec, to, next, req.now, event, error_code.as_deref(), &mut deltas).await?;
                Self::apply_counts(&mut tx, &deltas).await?;
                if next.is_some() {
                    Self::notify_work(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(moved)
            }

            async fn record_callback(&self, cb: &$crate::store::NewCallback) -> StoreResult<Option<$crate::store::CallbackMatch>> {
                let mut tx = self.begin_write().await?;
                if let Some(id) = &cb.delivery_id {
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
                        return Err(StoreError::Conflict { what: "webhook delivery", key: id.clone() });
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
                let rec = Self::lock_record(&mut tx, record_id).await?.ok_or_else(|| StoreError::NotFound {
                    what: "record",
                    key: record_id.to_string(),
                })?;
                if rec.state == RecordState::Waiting {
                    sqlx::query("UPDATE records SET next_run_at = $1 WHERE id = $2 AND state = 'waiting'")
                        .bind(cb.now)
                        .bind(record_id)
                        .execute(&mut *tx)
                        .await?;
                    Self::notify_work(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(Some($crate::store::CallbackMatch {
                    callback_id,
                    record_id,
                    step,
                    step_state: $crate::store::rows::parse(&step_state, "step state")?,
                    record_state: rec.state,
                }))
            }

            async fn pending_callbacks(&self, provider: &str, job_id: &str) -> StoreResult<Vec<$crate::store::PendingCallback>> {
                let rows: Vec<(i64, Json<JsonValue>, i64)> = sqlx::query_as(
                    "SELECT id, body, received_at FROM callbacks \
                     WHERE provider = $1 AND job_id = $2 AND processed_at IS NULL ORDER BY id LIMIT 100",
                )
                .bind(provider.to_owned())
                .bind(job_id.to_owned())
                .fetch_all(self.reader())
                .await?;
                Ok(rows
                    .into_iter()
                    .map(|(id, body, received_at)| $crate::store::PendingCallback { id, body: body.0, received_at })
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
                    Self::notify_work(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(())
            }

            async fn mark_callbacks(&self, ids: &[i64], now: UnixMs) -> StoreResult<()> {
                let mut tx = self.begin_write().await?;
                for id in ids {
                    sqlx::query("UPDATE callbacks SET processed_at = COALESCE(processed_at, $1) WHERE id = $2")
                        .bind(now)
                        .bind(*id)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(())
            }

            async fn reverse(&self, req: &$crate::store::ReverseRequest) -> StoreResult<Record> {
                let installation = self.installation_id().await?;
                let mut tx = self.begin_write().await?;
                let rec = Self::lock_record(&mut tx, req.record_id).await?.ok_or_else(|| {
                    StoreError::NotFound { what: "record", key: req.record_id.to_string() }
                })?;
                let trigger = Trigger::Reversed(req.policy);
                let to = transition(rec.state, trigger)?;
                let mut detail = req.detail.clone().unwrap_or(serde_json::json!({}));
                if let Some(obj) = detail.as_object_mut() {
                    obj.insert("policy".into(), serde_json::to_value(req.policy).unwrap_or_default());
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
                if to == rec.state {
                    Self::insert_event(&mut tx, &event).await?;
                    tx.commit().await?;
                    return Ok(rec);
                }
                if req.policy == $crate::domain::ReversalPolicy::Rerun {
                    Self::rerun_steps(&mut tx, &installation, rec.id, &req.steps, req.now).await?;
                }
                let next = to.is_scheduled().then_some(req.now);
                let mut deltas = CountDeltas::default();
                let moved = Self::move_record(&mut tx, &rec, to, next, req.now, event, Some("provider_reversed"), &mut deltas).await?;
                Self::apply_counts(&mut tx, &deltas).await?;
                if next.is_some() {
                    Self::notify_work(&mut tx).await?;
                }
                tx.commit().await?;
                Ok(moved)
            }

            async fn append_attempts(&self, record_id: i64, attempts: &[$crate::store::NewAttempt]) -> StoreResult<()> {
                if attempts.is_empty() {
                    return Ok(());
                }
                let mut tx = self.begin_write().await?;
                let rows: Vec<_> = attempts.iter().map(|a| (record_id, a)).collect();
                Self::insert_attempts(&mut tx, &rows).await?;
                tx.commit().await?;
                Ok(())
            }

            async fn step_runs(&self, record_id: i64) -> StoreResult<Vec<StepRun>> {
                let sql = format!("SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id = $1 ORDER BY step");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(record_id).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::step_run)
            }

            async fn step_runs_of(&self, record_ids: &[i64]) -> StoreResult<Vec<StepRun>> {
                let sql = cached_sql!(format!(
                    "SELECT {STEP_COLUMNS} FROM step_runs WHERE record_id {}SELECT CAST(value AS BIGINT) FROM {}{} \
                     ORDER BY record_id, step",
                    $any_open,
                    DIALECT.rows(),
                    $any_close
                ));
                let rows = sqlx::query(sql).bind(Json(record_ids)).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::step_run)
            }

            async fn attempts(&self, record_id: i64) -> StoreResult<Vec<Attempt>> {
                let sql = format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE record_id = $1 ORDER BY id");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(record_id).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::attempt)
            }

            async fn record_events(&self, record_id: i64) -> StoreResult<Vec<Event>> {
                let sql = format!("SELECT {EVENT_COLUMNS} FROM events WHERE record_id = $1 ORDER BY id");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(record_id).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::event)
            }

            async fn audit_log(&self, filter: &AuditFilter) -> StoreResult<Page<Event>> {
                let limit = page_limit(filter.limit);
                let mut qb = sqlx::QueryBuilder::<$db>::new(format!("SELECT {EVENT_COLUMNS} FROM events"));
                push_audit_filter(&mut qb, filter, $audit);
                qb.push(" ORDER BY id DESC LIMIT ").push_bind(i64::from(limit) + 1);
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

            async fn pin_pipeline(&self, pipeline: &str, hash: &str, definition: &JsonValue, now: UnixMs) -> StoreResult<i64> {
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
                let id: i64 = sqlx::query_scalar("SELECT id FROM pipeline_versions WHERE pipeline = $1 AND hash = $2")
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

            async fn create_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<User> {
                validate_username(&user.username)?;
                let mut tx = self.begin_write().await?;
                let sql = format!(
                    "INSERT INTO users (username, password_hash, role, disabled, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $5) RETURNING {USER_COLUMNS}"
                );
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(user.username.clone())
                    .bind(user.password_hash.clone())
                    .bind(user.role.as_str())
                    .bind(false)
                    .bind(now)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|e| conflict_or(e, "user", &user.username))?;
                let created = row.user()?;
                tx.commit().await?;
                Ok(created)
            }

            async fn user_by_name(&self, username: &str) -> StoreResult<Option<User>> {
                let sql = format!("SELECT {USER_COLUMNS} FROM users WHERE username = $1");
                let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(username.to_owned()).fetch_optional(self.reader()).await?;
                row.as_ref().map(MapRow::user).transpose()
            }

            async fn user_by_id(&self, id: i64) -> StoreResult<Option<User>> {
                let sql = format!("SELECT {USER_COLUMNS} FROM users WHERE id = $1");
                let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).fetch_optional(self.reader()).await?;
                row.as_ref().map(MapRow::user).transpose()
            }

            async fn list_users(&self) -> StoreResult<Vec<User>> {
                let sql = format!("SELECT {USER_COLUMNS} FROM users ORDER BY username");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::user)
            }

            async fn update_user(&self, id: i64, change: &UserChange, now: UnixMs) -> StoreResult<User> {
                let mut tx = self.begin_write().await?;
                let set = match change {
                    UserChange::Password(_) => "password_hash",
                    UserChange::Role(_) => "role",
                    UserChange::Disabled(_) => "disabled",
                };
                let sql = format!("UPDATE users SET {set} = $1, updated_at = $2 WHERE id = $3 RETURNING {USER_COLUMNS}");
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
                    .ok_or_else(|| StoreError::NotFound { what: "user", key: id.to_string() })?;
                let user = row.user()?;
                sqlx::query("UPDATE sessions SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL")
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

            async fn create_session(&self, s: &Session) -> StoreResult<()> {
                let mut tx = self.begin_write().await?;
                sqlx::query("INSERT INTO sessions (id, user_id, created_at, expires_at, revoked_at) VALUES ($1, $2, $3, $4, $5)")
                    .bind(s.id.clone())
                    .bind(s.user_id)
                    .bind(s.created_at)
                    .bind(s.expires_at)
                    .bind(s.revoked_at)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| conflict_or(e, "session", &s.id))?;
                tx.commit().await?;
                Ok(())
            }

            async fn session(&self, id: &str) -> StoreResult<Option<Session>> {
                let row = sqlx::query("SELECT id, user_id, created_at, expires_at, revoked_at FROM sessions WHERE id = $1")
                    .bind(id.to_owned())
                    .fetch_optional(self.reader())
                    .await?;
                row.as_ref().map(MapRow::session).transpose()
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
                    "INSERT INTO nodes (id, hostname, pid, version, started_at, heartbeat_at, draining) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     ON CONFLICT (id) DO UPDATE SET hostname = excluded.hostname, pid = excluded.pid, \
                       version = excluded.version, heartbeat_at = excluded.heartbeat_at, draining = excluded.draining",
                )
                .bind(b.id.clone())
                .bind(b.hostname.clone())
                .bind(b.pid)
                .bind(b.version.clone())
                .bind(b.started_at)
                .bind(now)
                .bind(b.draining)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(())
            }

            async fn list_nodes(&self) -> StoreResult<Vec<Node>> {
                let rows = sqlx::query(
                    "SELECT id, hostname, pid, version, started_at, heartbeat_at, draining FROM nodes ORDER BY id",
                )
                .fetch_all(self.reader())
                .await?;
                map_all(&rows, MapRow::node)
            }

            async fn remove_node(&self, id: &str) -> StoreResult<()> {
                let mut tx = self.begin_write().await?;
                sqlx::query("DELETE FROM nodes WHERE id = $1").bind(id.to_owned()).execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(())
            }

            async fn provider_state(&self, provider: &str) -> StoreResult<Option<ProviderState>> {
                let sql = format!("SELECT {PROVIDER_COLUMNS} FROM providers WHERE provider = $1");
                let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(provider.to_owned()).fetch_optional(self.reader()).await?;
                row.as_ref().map(MapRow::provider_state).transpose()
            }

            async fn provider_states(&self) -> StoreResult<Vec<ProviderState>> {
                let sql = format!("SELECT {PROVIDER_COLUMNS} FROM providers ORDER BY provider");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_all(self.reader()).await?;
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
                $crate::store::refuse_nul("reason", reason)?;
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
                        kind: if paused { "provider_paused" } else { "provider_resumed" },
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
                tx.commit().await?;
                Ok(state)
            }

            async fn save_breaker(&self, p: &ProviderState) -> StoreResult<()> {
                let mut tx = self.begin_write().await?;
                sqlx::query(
                    "INSERT INTO providers (provider, breaker, breaker_changed_at, open_until, stats, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6) \
                     ON CONFLICT (provider) DO UPDATE SET breaker = excluded.breaker, \
                       breaker_changed_at = excluded.breaker_changed_at, open_until = excluded.open_until, \
                       stats = excluded.stats, updated_at = excluded.updated_at",
                )
                .bind(p.provider.clone())
                .bind(p.breaker.as_str())
                .bind(p.breaker_changed_at)
                .bind(p.open_until)
                .bind(p.stats.clone().map(Json))
                .bind(p.updated_at)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(())
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

            async fn create_api_token(&self, t: &$crate::store::NewApiToken, now: UnixMs) -> StoreResult<$crate::domain::ApiToken> {
                if t.name.trim().is_empty() || t.name.len() > 100 {
                    return Err(StoreError::Invalid("a token needs a name of 1-100 characters".into()));
                }
                $crate::store::refuse_nul("token name", Some(&t.name))?;
                let mut tx = self.begin_write().await?;
                let sql = format!(
                    "INSERT INTO api_tokens (name, token_hash, prefix, role, created_by, created_at) \
                     VALUES ($1, $2, $3, $4, $5, $6) RETURNING {API_TOKEN_COLUMNS}"
                );
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(t.name.clone())
                    .bind(t.token_hash.clone())
                    .bind(t.prefix.clone())
                    .bind(t.role.as_str())
                    .bind(t.created_by.clone())
                    .bind(now)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|e| conflict_or(e, "api token", &t.prefix))?;
                let token = row.api_token()?;
                let detail = serde_json::json!({ "token_id": token.id, "name": token.name, "role": token.role.as_str() });
                Self::insert_event(&mut tx, &EventRow {
                    record_id: None, at: now, kind: "token_created", actor: &t.created_by, audit: true,
                    from: None, to: None, step: None, reason: None, detail: Some(&detail),
                }).await?;
                tx.commit().await?;
                Ok(token)
            }

            async fn api_token_by_hash(&self, hash: &str) -> StoreResult<Option<$crate::domain::ApiToken>> {
                let sql = format!("SELECT {API_TOKEN_COLUMNS} FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL");
                let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(hash.to_owned()).fetch_optional(self.reader()).await?;
                row.as_ref().map(MapRow::api_token).transpose()
            }

            async fn list_api_tokens(&self) -> StoreResult<Vec<$crate::domain::ApiToken>> {
                let sql = format!("SELECT {API_TOKEN_COLUMNS} FROM api_tokens ORDER BY id DESC");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::api_token)
            }

            async fn revoke_api_token(&self, id: i64, actor: &str, now: UnixMs) -> StoreResult<$crate::domain::ApiToken> {
                let mut tx = self.begin_write().await?;
                let sql = format!(
                    "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2 RETURNING {API_TOKEN_COLUMNS}"
                );
                let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(now)
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await?
                    .ok_or_else(|| StoreError::NotFound { what: "api token", key: id.to_string() })?;
                let token = row.api_token()?;
                let detail = serde_json::json!({ "token_id": token.id, "name": token.name });
                Self::insert_event(&mut tx, &EventRow {
                    record_id: None, at: now, kind: "token_revoked", actor, audit: true,
                    from: None, to: None, step: None, reason: None, detail: Some(&detail),
                }).await?;
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

            async fn login_locked_until(&self, username: &str, now: UnixMs) -> StoreResult<Option<UnixMs>> {
                let until: Option<Option<i64>> = sqlx::query_scalar("SELECT locked_until FROM login_throttle WHERE username = $1")
                    .bind(username.to_owned())
                    .fetch_optional(self.reader())
                    .await?;
                Ok(until.flatten().filter(|u| *u > now))
            }

            async fn count_login_attempt(&self, username: &str, now: UnixMs, policy: $crate::store::LoginPolicy) -> StoreResult<i64> {
                let mut tx = self.begin_write().await?;
                // One statement, so concurrent attempts on several nodes all count.
                let count: i64 = sqlx::query_scalar(
                    "INSERT INTO login_throttle (username, failures, window_start, locked_until) \
                     VALUES ($1, 1, $2, CASE WHEN $4 <= 1 THEN $2 + $5 END) \
                     ON CONFLICT (username) DO UPDATE SET \
                       failures = CASE WHEN login_throttle.window_start < $3 THEN 1 ELSE login_throttle.failures + 1 END, \
                       window_start = CASE WHEN login_throttle.window_start < $3 THEN $2 ELSE login_throttle.window_start END, \
                       locked_until = CASE \
                         WHEN (CASE WHEN login_throttle.window_start < $3 THEN 1 ELSE login_throttle.failures + 1 END) >= $4 \
                         THEN $2 + $5 ELSE login_throttle.locked_until END \
                     RETURNING failures",
                )
                .bind(username.to_owned())
                .bind(now)
                .bind(now - policy.window_ms)
                .bind(policy.max_failures)
                .bind(policy.lock_ms)
                .fetch_one(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(count)
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

            async fn save_rollups(&self, rows: &[$crate::store::StepRollup]) -> StoreResult<()> {
                if rows.is_empty() {
                    return Ok(());
                }
                let mut tx = self.begin_write().await?;
                for r in rows {
                    let latency = serde_json::to_string(&r.latency).map_err(|e| StoreError::Invalid(e.to_string()))?;
                    let sql = format!(
                        "INSERT INTO step_rollups ({ROLLUP_COLUMNS}) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
                         ON CONFLICT (minute, node, pipeline, step, provider) DO UPDATE SET \
                           calls = excluded.calls, succeeded = excluded.succeeded, failed = excluded.failed, \
                           retried = excluded.retried, unknown = excluded.unknown, \
                           records_succeeded = excluded.records_succeeded, records_failed = excluded.records_failed, \
                           records_parked = excluded.records_parked, latency = excluded.latency"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(sql))
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
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(())
            }

            async fn rollups_since(&self, since: UnixMs) -> StoreResult<Vec<$crate::store::StepRollup>> {
                let sql = format!("SELECT {ROLLUP_COLUMNS} FROM step_rollups WHERE minute >= $1 ORDER BY minute");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(since).fetch_all(self.reader()).await?;
                map_all(&rows, MapRow::rollup)
            }

            async fn purge_stats(&self, before: UnixMs) -> StoreResult<u64> {
                let mut tx = self.begin_write().await?;
                let a = sqlx::query("DELETE FROM step_rollups WHERE minute < $1").bind(before).execute(&mut *tx).await?;
                let b = sqlx::query("DELETE FROM webhook_deliveries WHERE received_at < $1").bind(before).execute(&mut *tx).await?;
                let c = sqlx::query(
                    "DELETE FROM login_throttle WHERE window_start < $1 AND (locked_until IS NULL OR locked_until < $1)",
                )
                .bind(before)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(a.rows_affected() + b.rows_affected() + c.rows_affected())
            }
        }
    };
}

pub(crate) use {cached_sql, common_store};
