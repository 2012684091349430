//! The workers' side: claiming due records under a lease, committing what
//! a pass decided, callbacks, intents of calls that must not repeat, and
//! confirmations of uncertain outcomes.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Type};

use super::backend::{RowsAffected, SqlDb, Writes};
use super::counts::CountDeltas;
use super::rows::{MapRow, RECORD_COLUMNS, map_all, map_sealed};
use super::sql::SqlStore;
use super::{CallbackMatch, Cluster, NewAttempt, NewCallback, NewIntent, PendingCallback};
use super::{ClaimRequest, Commit, EventRow, Lease, StoreError, StoreResult, node_actor};
use crate::auth::seal::Field;
use crate::domain::{Record, RecordState, Trigger, UnixMs, transition};

/// Work: claims, leases, commits, callbacks, intents and confirmations.
#[async_trait::async_trait]
pub trait Work: Send + Sync {
    /// The earliest `next_run_at` of any record (due work or a lease
    /// expiry), so workers can sleep exactly until then.
    async fn next_due_at(&self) -> StoreResult<Option<UnixMs>>;
    /// For each of `pipelines` with work due at `now` (waiting for a
    /// worker, or a lease run out), when its oldest due record fell due: a
    /// backlog's age, for alerts.
    async fn oldest_due(
        &self,
        pipelines: &[String],
        now: UnixMs,
    ) -> StoreResult<Vec<(String, UnixMs)>>;
    /// Leases up to `limit` due records (and records whose lease expired),
    /// an even share from each (pipeline, group) queue with due work, each
    /// queue's highest priority first and then its oldest due, within the
    /// request's group caps. Two
    /// claimers never get the same record.
    async fn claim_due(&self, req: &ClaimRequest) -> StoreResult<Vec<Record>>;
    /// Pushes the expiry of held leases to `until`; returns the ids still held.
    async fn extend_leases(&self, leases: &[Lease], until: UnixMs) -> StoreResult<Vec<i64>>;
    /// Gives leases back (graceful shutdown): due now, no attempt spent.
    /// Returns how many were still held.
    async fn release(&self, leases: &[Lease], now: UnixMs) -> StoreResult<u64>;
    /// Writes a worker's pass: steps, attempts, and the transition with its
    /// event. Refused with `LeaseLost` when the lease is not held.
    async fn commit(&self, commit: &Commit) -> StoreResult<Record>;
    /// Group commit: many workers' passes in one transaction, their rows
    /// written by multi-row statements. Each commit gets its own result (a
    /// lost lease refuses that one commit, not the group); an error of the
    /// whole group (the database) comes back as `Err`, nothing written. The
    /// commits must name distinct records.
    async fn commit_many(&self, commits: &[Commit]) -> StoreResult<Vec<StoreResult<Record>>>;
    /// Names `parent`'s `step` as what started record `child` (a record
    /// that has a parent keeps it), and makes the child due at `now` if it
    /// was enqueued due at no time (to be claimed only once linked).
    async fn link_child(&self, child: i64, parent: i64, step: &str, now: UnixMs)
    -> StoreResult<()>;
    /// The records `parent` started, oldest first.
    async fn children(&self, parent: i64) -> StoreResult<Vec<Record>>;
    /// Stores a delivery (and takes its delivery id: a repeated id is
    /// `Conflict`, nothing stored), attaches it to the step waiting on that
    /// job (if any) and makes a waiting record due now. Deliveries that arrive
    /// before the job id is committed are kept and found later by job id.
    async fn record_callback(&self, cb: &NewCallback) -> StoreResult<Option<CallbackMatch>>;
    /// Marks deliveries applied (or judged irrelevant) without a commit.
    async fn mark_callbacks(&self, ids: &[i64], now: UnixMs) -> StoreResult<()>;
    /// Deliveries for a job not yet applied, oldest first.
    async fn pending_callbacks(
        &self,
        provider: &str,
        job_id: &str,
    ) -> StoreResult<Vec<PendingCallback>>;
    /// Writes calls down before they leave, in one transaction (one
    /// durable commit for the batch), each only while its worker still
    /// holds the record's lease (its row locked against a claim meanwhile);
    /// per intent, its id, or `LeaseLost` (then the call must not be made).
    async fn record_intents(&self, intents: &[NewIntent]) -> StoreResult<Vec<StoreResult<i64>>>;
    /// The intents of a record still open, oldest first.
    async fn open_intents(&self, record_id: i64) -> StoreResult<Vec<crate::domain::Intent>>;
    /// The providers with intents still open (calls left by stopped
    /// nodes), whatever their configuration says now.
    async fn intent_providers(&self) -> StoreResult<Vec<String>>;
    /// Appends attempts outside any lease: the history of exchanges made by
    /// a worker that lost its lease before committing; deletes the intents
    /// of those calls (`intents_done`) in the same transaction.
    async fn append_attempts(
        &self,
        record_id: i64,
        attempts: &[NewAttempt],
        intents_done: &[i64],
    ) -> StoreResult<()>;
    /// Takes up to `limit` confirmations due at `now`, each held (its
    /// `due_at` moved to `hold_until`) so that no other node asks too.
    async fn claim_confirmations(
        &self,
        now: UnixMs,
        limit: u32,
        hold_until: UnixMs,
    ) -> StoreResult<Vec<crate::domain::confirm::Pending>>;
    /// Reschedules a confirmation (`Some`), or ends it (`None`); only if it
    /// is still for `generation`.
    async fn settle_confirmation(
        &self,
        record_id: i64,
        step: &str,
        generation: i32,
        next: Option<&crate::domain::confirm::Pending>,
    ) -> StoreResult<()>;
}

#[async_trait::async_trait]
impl<DB> Work for SqlStore<DB>
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
        let (claimed, taken) = DB::claim_in(&mut tx, req, &self.keyring()).await?;
        if !claimed.is_empty() {
            let actor = node_actor(&req.owner);
            let (events, deltas) = Self::claim_moves(&claimed, &taken, req.now, &actor)?;
            let mut writes = Writes::default();
            self.events_write(&events, &mut writes)?;
            Self::counts_write(&deltas, &mut writes)?;
            DB::run_writes(&mut tx, &writes).await?;
            self.notice_events(&mut tx, &events).await?;
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
            let Some(rec) = self.lock_record(&mut tx, lease.record_id).await? else {
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
                claimed_at: rec.claimed_at,
                claimed_by: None,
            };
            self.move_record(
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
        let locked = lock_set(&ids, commits);
        let mut then = Then::default();
        let mut tx = self.begin_write().await?;
        let held = self.lock_records(&mut tx, &locked).await?;
        let mut results = Vec::with_capacity(commits.len());
        // New step runs go in plainly where an upsert costs more
        // (PostgreSQL's speculative insertion), upserted on SQLite.
        let plain_new_steps = matches!(DB::DIALECT, super::batch::Dialect::Postgres);
        let (mut steps, mut new_steps) = (Vec::new(), Vec::new());
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
            let (after, to) = match crate::domain::pass::after_commit(rec, c.committed()) {
                Ok(done) => done,
                Err(e) => {
                    results.push(Err(e.into()));
                    continue;
                }
            };
            if let (Some(result), Some(to)) = (c.result, to) {
                events.push(worked(c, rec, (result, to), actor));
            }
            // The step (and so the provider) may have changed too.
            deltas.record_moved(rec, &after);
            for s in &c.steps {
                match plain_new_steps && c.new_steps.contains(&s.step) {
                    true => new_steps.push((rec.id, s, c.now)),
                    false => steps.push((rec.id, s, c.now)),
                }
            }
            attempts.extend(c.attempts.iter().map(|a| (rec.id, a)));
            callbacks.extend(c.callbacks_done.iter().map(|id| (rec.id, *id, c.now)));
            confirms.extend(c.confirms.iter());
            intents.extend(c.intents_done.iter().copied());
            then.note(c, &after);
            results.push(Ok(after));
        }
        // Every record a commit moved is an `Ok` among the results.
        let moved: Vec<(&Record, &Record)> = (results.iter())
            .filter_map(|r| r.as_ref().ok())
            .filter_map(|after| Some((held.get(&after.id)?, after)))
            .collect();
        // The group's writes in one go (one request on SQLite), the
        // counter rows last.
        let mut writes = Writes::default();
        if !new_steps.is_empty() {
            self.steps_write(&installation, &new_steps, true, &mut writes)?;
        }
        self.steps_write(&installation, &steps, false, &mut writes)?;
        self.attempts_write(&attempts, &mut writes)?;
        Self::callbacks_write(&callbacks, &mut writes)?;
        Self::records_write(&moved, &mut writes)?;
        Self::intents_write(&intents, &mut writes)?;
        self.events_write(&events, &mut writes)?;
        Self::counts_write(&deltas, &mut writes)?;
        DB::run_writes(&mut tx, &writes).await?;
        self.notice_events(&mut tx, &events).await?;
        for p in confirms {
            Self::put_confirmation(&mut tx, p).await?;
        }
        // After the confirmations: an undo that starts ends them.
        for (id, names, cause, now) in &then.reruns {
            let steps = (*names, false);
            self.run_again(&mut tx, &installation, *id, steps, *now, cause)
                .await?;
        }
        then.wakes.sort_unstable();
        then.wakes.dedup();
        Self::wake_all(&mut tx, &then.wakes, commits[0].now).await?;
        Self::wake_for_children(&mut tx, &then.parents, commits[0].now).await?;
        tx.commit().await?;
        Ok(results)
    }

    async fn link_child(
        &self,
        child: i64,
        parent: i64,
        step: &str,
        now: UnixMs,
    ) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "UPDATE records SET parent_id = COALESCE(parent_id, $1), \
               parent_step = COALESCE(parent_step, $2), \
               next_run_at = CASE WHEN state = 'pending' AND next_run_at = $3 THEN $4 \
                 ELSE next_run_at END \
             WHERE id = $5",
        )
        .bind(parent)
        .bind(step.to_owned())
        .bind(super::rows::NO_TIME)
        .bind(now)
        .bind(child)
        .execute(&mut *tx)
        .await?;
        DB::notify_work(&mut tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn children(&self, parent: i64) -> StoreResult<Vec<Record>> {
        let sql = format!("SELECT {RECORD_COLUMNS} FROM records WHERE parent_id = $1 ORDER BY id");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(parent)
            .fetch_all(self.reader())
            .await?;
        map_sealed(&rows, &self.keyring(), MapRow::record)
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
        .bind(Json(
            self.keyring()
                .seal_json(Field::Callback, &cb.body)?
                .into_owned(),
        ))
        .fetch_one(&mut *tx)
        .await?;
        let Some((record_id, step, step_state)) = found else {
            tx.commit().await?;
            return Ok(None);
        };
        let rec = self.lock_found(&mut tx, record_id).await?;
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
        let keys = self.keyring();
        rows.into_iter()
            .map(|(id, body, received_at)| {
                Ok(crate::store::PendingCallback {
                    id,
                    body: keys.open_json(Field::Callback, body.0)?,
                    received_at,
                })
            })
            .collect()
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
        if rounds.len() > 1 {
            // A round locks only the rows whose lease it finds held, so
            // rounds in turn could lock a lower id after a higher one:
            // every row first, in id order (as a group commit does).
            let mut held: Vec<i64> = intents.iter().map(|i| i.record_id).collect();
            held.sort_unstable();
            held.dedup();
            Self::lock_ids(&mut tx, &held).await?;
        }
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
            let written = self.insert_intents(&mut tx, &part).await?;
            for (&at, id) in round.iter().zip(written) {
                ids[at] = id;
            }
        }
        tx.commit().await?;
        Ok(ids)
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
        map_sealed(&rows, &self.keyring(), MapRow::intent)
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
        if self.lock_record(&mut tx, record_id).await?.is_none() {
            return Err(StoreError::NotFound {
                what: "record",
                key: record_id.to_string(),
            });
        }
        let rows: Vec<_> = attempts.iter().map(|a| (record_id, a)).collect();
        let mut writes = Writes::default();
        self.attempts_write(&rows, &mut writes)?;
        Self::intents_write(intents_done, &mut writes)?;
        DB::run_writes(&mut tx, &writes).await?;
        tx.commit().await?;
        Ok(())
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
}

/// What a group commit does after its records' own writes: the parents
/// to wake (of children its accepted commits bring to rest), the records
/// committed waiting on children, and the steps to run again.
#[derive(Default)]
struct Then<'c> {
    wakes: Vec<i64>,
    parents: Vec<i64>,
    reruns: Vec<(i64, &'c [String], &'c str, UnixMs)>,
}

impl<'c> Then<'c> {
    /// Notes what accepted commit `c` (its record now `after`) asks for.
    fn note(&mut self, c: &'c Commit, after: &Record) {
        self.wakes.extend(c.wake);
        if c.awaits_children && after.state == RecordState::Waiting {
            self.parents.push(after.id);
        }
        if let Some((names, cause)) = &c.rerun {
            self.reruns.push((after.id, names, cause, c.now));
        }
    }
}

/// The event of a pass's result, with the pass's claim folded in (the
/// claim's time is in the record's `claimed_at`).
fn worked<'c>(
    c: &'c Commit,
    rec: &Record,
    (result, to): (crate::domain::WorkResult, RecordState),
    actor: &'c str,
) -> EventRow<'c> {
    EventRow {
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
        claimed_at: rec.claimed_at,
        claimed_by: None,
    }
}

/// The records a group commit locks, in one order before anything is
/// written: its own, and the parents its children's commits may wake. A
/// child's commit and its parent's then take turns on the parent's row:
/// the child's wakes a parent already waiting, the parent's finds a child
/// already at rest (`wake_for_children`), so one of the two sees the other.
fn lock_set(ids: &[i64], commits: &[Commit]) -> Vec<i64> {
    let mut locked = ids.to_vec();
    locked.extend(commits.iter().filter_map(|c| c.wake));
    locked.sort_unstable();
    locked.dedup();
    locked
}
