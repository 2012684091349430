//! What the nodes share: the installation's facts, the nodes themselves,
//! providers' shared state (pauses, breakers, throttles, permits) and the
//! task leases that let one node at a time run a chore.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Type};

use super::backend::{RowsAffected, SqlDb};
use super::rows::{BREAKER_COLUMNS, MapRow, PROVIDER_COLUMNS, map_all};
use super::sql::SqlStore;
use super::{EventRow, NodeBeat, PermitRequest, Permits, StoreResult};
use crate::domain::breaker::{ProbeGrant, SharedBreaker, SharedOp};
use crate::domain::notify;
use crate::domain::{Node, ProviderState, UnixMs};

/// The cluster: installation facts, nodes, providers' shared state and
/// task leases.
#[async_trait::async_trait]
pub trait Cluster: Send + Sync {
    /// A cheap round trip, for readiness checks.
    async fn ping(&self) -> StoreResult<()>;
    /// This installation's id (made by the first migration), part of every
    /// idempotency key.
    async fn installation_id(&self) -> StoreResult<String>;
    /// The stored value of `key`, storing `value` first if there is none
    /// (so concurrent first starts agree on one value).
    async fn ensure_meta(&self, key: &str, value: &str) -> StoreResult<String>;
    /// Replaces the stored value of `key` and revokes every session, in one
    /// transaction (a new session signing key makes them all invalid).
    async fn rotate_meta_secret(&self, key: &str, value: &str, now: UnixMs) -> StoreResult<u64>;
    async fn heartbeat(&self, beat: &NodeBeat, now: UnixMs) -> StoreResult<()>;
    async fn list_nodes(&self) -> StoreResult<Vec<Node>>;
    async fn remove_node(&self, id: &str) -> StoreResult<()>;
    async fn provider_state(&self, provider: &str) -> StoreResult<Option<ProviderState>>;
    async fn provider_states(&self) -> StoreResult<Vec<ProviderState>>;
    async fn save_provider_state(&self, state: &ProviderState) -> StoreResult<()>;
    /// Sets only the pause columns (so a concurrent breaker update cannot
    /// undo an operator's pause, nor the reverse).
    /// Writes the audit event (`provider_paused` / `provider_resumed`, by
    /// `actor`) in the same transaction.
    async fn set_provider_pause(
        &self,
        provider: &str,
        paused: bool,
        actor: &str,
        reason: Option<&str>,
        now: UnixMs,
    ) -> StoreResult<ProviderState>;
    /// Leases a provider's limits for one node, under the provider row's
    /// lock (`domain::permits`): closes the grants the node is done with,
    /// removes grants that occupy nothing any more, grants permits in each
    /// window asked for, and sets the node's holding of concurrency slots.
    async fn lease_permits(&self, req: &PermitRequest) -> StoreResult<Permits>;
    /// Changes the cluster's breaker for `provider` under its row's lock
    /// (`domain::breaker::SharedBreaker::apply`): returns the breaker as
    /// stored after, and the answer to a probe request. A change of state
    /// is announced to every node (PostgreSQL: `NOTIFY`, at commit).
    /// `stats`, when given, replaces the window figures shown with it.
    async fn breaker_op(
        &self,
        provider: &str,
        op: SharedOp,
        stats: Option<&Value>,
        now: UnixMs,
    ) -> StoreResult<(SharedBreaker, Option<ProbeGrant>)>;
    /// Holds every node's calls to `provider` until `until` (a "slow down"
    /// it said); a later pause already kept wins, so nodes that publish
    /// the same storm in any order agree on its end.
    async fn throttle_provider(
        &self,
        provider: &str,
        until: UnixMs,
        now: UnixMs,
    ) -> StoreResult<()>;
    /// Takes the lease on a task one node does at a time, until `until`:
    /// true if this owner holds it now (taken, or already its own).
    async fn take_task_lease(
        &self,
        name: &str,
        owner: &str,
        until: UnixMs,
        now: UnixMs,
    ) -> StoreResult<bool>;
    async fn release_task_lease(&self, name: &str, owner: &str) -> StoreResult<()>;
}

#[async_trait::async_trait]
impl<DB> Cluster for SqlStore<DB>
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

    async fn heartbeat(&self, b: &NodeBeat, now: UnixMs) -> StoreResult<()> {
        let keys = self.keyring();
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO nodes (id, hostname, pid, version, started_at, heartbeat_at, draining, \
               config_version, data_key) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (id) DO UPDATE SET hostname = excluded.hostname, pid = excluded.pid, \
               version = excluded.version, heartbeat_at = excluded.heartbeat_at, \
               draining = excluded.draining, config_version = excluded.config_version, \
               data_key = excluded.data_key",
        )
        .bind(b.id.clone())
        .bind(b.hostname.clone())
        .bind(b.pid)
        .bind(b.version.clone())
        .bind(b.started_at)
        .bind(now)
        .bind(b.draining)
        .bind(b.config_version.clone())
        // The key this node's store seals with: said by the store itself,
        // so that it is the one in use, reloads included.
        .bind(keys.current().unwrap_or_default().to_owned())
        .execute(&mut *tx)
        .await?;
        // A key a node seals with is in use, whatever a rotation retired
        // meanwhile (a node that reloaded late says so here).
        if let Some(key) = keys.current() {
            sqlx::query(
                "UPDATE data_keys SET retired_at = NULL WHERE id = $1 AND retired_at IS NOT NULL",
            )
            .bind(key.to_owned())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn list_nodes(&self) -> StoreResult<Vec<Node>> {
        let rows = sqlx::query(
            "SELECT id, hostname, pid, version, started_at, heartbeat_at, draining, config_version, \
             data_key FROM nodes ORDER BY id",
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
        Self::lock_provider(&mut tx, provider, now).await?;
        let sql = format!("SELECT {PROVIDER_COLUMNS} FROM providers WHERE provider = $1");
        let was = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(provider.to_owned())
            .fetch_one(&mut *tx)
            .await?
            .provider_state()?
            .paused;
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
        let change = notify::Change {
            kind: if paused {
                "provider_paused"
            } else {
                "provider_resumed"
            },
            actor,
            from: None,
            to: None,
            step: None,
            reason,
        };
        // A pause of a paused provider (a new reason) is no news.
        if was != paused {
            let topic = notify::pause_topic(paused);
            self.notice_provider(&mut tx, topic, provider, &change, now)
                .await?;
        }
        self.insert_event(
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
                claimed_at: None,
                claimed_by: None,
            },
        )
        .await?;
        DB::notify_providers(&mut tx).await?;
        tx.commit().await?;
        Ok(state)
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
        if let Some(topic) = notify::breaker_topic(before.state, after.state) {
            let change = notify::Change {
                kind: topic.as_str(),
                actor: "system",
                from: None,
                to: None,
                step: None,
                reason: None,
            };
            self.notice_provider(&mut tx, topic, provider, &change, now)
                .await?;
        }
        tx.commit().await?;
        Ok((after, grant))
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
}
