//! The outbox of notifications (`[[notify]]`): a notice is written per
//! subscription that wants a change, in the transaction that makes the
//! change (`SqlStore::notice_events`, `notice_provider`), and leased,
//! settled and listed here. Which changes are news and who wants them is
//! `domain::notify`'s to say.

use std::collections::HashMap;

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Type};

use super::backend::{BindJson, RowsAffected, SqlDb};
use super::batch::{self, Dialect, NoticeJson};
use super::rows::MapRow;
use super::sql::{SqlStore, Tx};
use super::{EventRow, Page, StoreError, StoreResult, into_page, page_limit};
use crate::domain::UnixMs;
use crate::domain::notify::{self, Change, Subject, Topic};

/// A notice as stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Notice {
    pub id: i64,
    pub subscription: String,
    /// Its `webhook-id`, the same on every delivery (random: no restore
    /// or other installation repeats one).
    pub message_id: String,
    /// Its event type (`record.parked`).
    pub topic: String,
    /// `record:ID` or `provider:NAME`: notices of one subject go out in
    /// order.
    pub subject: String,
    pub record_id: Option<i64>,
    pub pipeline: Option<String>,
    pub group: Option<String>,
    pub provider: Option<String>,
    /// When the change happened.
    pub at: UnixMs,
    /// When its `retry_for` began, where not at `at`: its last
    /// redelivery, or its subscription turned on again.
    pub since: Option<UnixMs>,
    /// The body's `data`.
    pub data: Value,
    /// `pending`, `delivered` or `failed` (given up).
    pub state: String,
    /// Deliveries sent (not those held back by the subscriber's limits).
    pub attempts: i32,
    #[serde(skip)]
    pub lease_token: i64,
    /// When a pending notice is due.
    pub next_at: Option<UnixMs>,
    /// The last delivery's time, status and reply (or why it failed).
    pub last_at: Option<UnixMs>,
    pub status: Option<i32>,
    pub reply: Option<String>,
}

/// What became of a leased notice.
#[derive(Debug, Clone, PartialEq)]
pub enum NoticeOutcome {
    /// The subscriber took it (2xx).
    Delivered { status: u16, reply: String },
    /// Not sent (paused, breaker open, limits, shutdown): due at `at`,
    /// no attempt spent.
    Deferred { at: UnixMs },
    /// Sent, and the subscriber said "slow down": due at `at`, no
    /// attempt spent, its answer kept.
    Throttled {
        at: UnixMs,
        status: Option<u16>,
        reply: String,
    },
    /// Sent and refused or lost: due again at `retry_at`, or given up.
    Failed {
        status: Option<u16>,
        reply: String,
        retry_at: Option<UnixMs>,
    },
}

/// Settles notice `id` under the lease it was claimed with.
#[derive(Debug, Clone)]
pub struct NoticeSettle {
    pub id: i64,
    pub lease_token: i64,
    pub outcome: NoticeOutcome,
}

/// One round of a subscription's deliveries, settled at `now`.
#[derive(Debug, Clone)]
pub struct NoticeRound {
    pub subscription: String,
    pub now: UnixMs,
    /// The subscription's `disable_after`, in ms.
    pub disable_after_ms: i64,
    pub settles: Vec<NoticeSettle>,
}

/// What a settle did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Notices whose lease was lost (another node took them): not written.
    pub lost: usize,
    /// The subscription has failed for `disable_after` and was turned off.
    pub disabled: bool,
}

/// A subscription's shared state.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct SubscriptionState {
    pub name: String,
    /// Since when every delivery has failed.
    pub failing_since: Option<UnixMs>,
    /// Turned off then (after failing, or by an operator).
    pub disabled_at: Option<UnixMs>,
    pub disabled_reason: Option<String>,
}

/// Which notices to list, newest first.
#[derive(Debug, Clone, Default)]
pub struct NoticeFilter {
    pub id: Option<i64>,
    pub subscription: Option<String>,
    pub record_id: Option<i64>,
    pub state: Option<String>,
    /// Only pipelines in this list (`None`: any), for a scoped caller.
    pub pipelines: Option<Vec<String>>,
    pub before: Option<i64>,
    pub limit: u32,
}

const NOTICE_COLUMNS: &str = "id, subscription, message_id, topic, subject, record_id, pipeline, group_key, \
     provider, at, since, data, state, attempts, lease_token, next_at, last_at, status, reply";

/// A subscription's (`$1`) notices due at `$2` that are heads: the oldest
/// pending one of their subject (one leased by another node still is:
/// its subject waits). The head test is a probe of `notices_heads` per
/// row read in due order (a correlated subquery: PostgreSQL does not turn
/// it into a join over every pending notice, as it did `NOT EXISTS`),
/// so a claim reads about as many rows as it takes. None while the
/// subscription is turned off (a test made once per statement).
const HEADS_DUE: &str = "SELECT n.id FROM notices n WHERE n.subscription = $1 \
     AND n.state = 'pending' AND n.next_at <= $2 AND n.id = (SELECT min(o.id) FROM notices o \
       WHERE o.subscription = n.subscription AND o.subject = n.subject \
         AND o.state = 'pending') \
     AND NOT EXISTS (SELECT 1 FROM notify_subscriptions s WHERE s.name = $1 \
       AND s.disabled_at IS NOT NULL)";

/// The outbox of notifications.
#[async_trait::async_trait]
pub trait Notices: Send + Sync {
    /// Leases up to `limit` of `subscription`'s notices due at `now`, each
    /// the oldest pending one of its subject, until `until`: returned with
    /// their new lease tokens. None while the subscription is turned off.
    async fn claim_notices(
        &self,
        subscription: &str,
        now: UnixMs,
        until: UnixMs,
        limit: u32,
    ) -> StoreResult<Vec<Notice>>;
    /// Writes the outcomes of one subscription's deliveries, and its
    /// failing spell (ended by one taken, else carried on by one refused;
    /// turned off after `disable_after`, audited), in one transaction.
    async fn settle_notices(&self, round: &NoticeRound) -> StoreResult<Settled>;
    async fn notices(&self, f: &NoticeFilter) -> StoreResult<Page<Notice>>;
    async fn subscription_states(&self) -> StoreResult<Vec<SubscriptionState>>;
    /// Turns a subscription on (its failing spell forgotten) or off, by
    /// `actor`, audited.
    async fn turn_subscription(
        &self,
        name: &str,
        on: bool,
        actor: &str,
        now: UnixMs,
    ) -> StoreResult<SubscriptionState>;
    /// Sends a notice again (due now, after those of its subject before
    /// it), by `actor`, audited.
    async fn redeliver_notice(&self, id: i64, actor: &str, now: UnixMs) -> StoreResult<Notice>;
}

/// The most of a reply kept with a notice.
const REPLY_KEPT: usize = 500;

#[async_trait::async_trait]
impl<DB> Notices for SqlStore<DB>
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
    async fn claim_notices(
        &self,
        subscription: &str,
        now: UnixMs,
        until: UnixMs,
        limit: u32,
    ) -> StoreResult<Vec<Notice>> {
        let skip = match DB::DIALECT {
            Dialect::Sqlite => "",
            Dialect::Postgres => " FOR UPDATE SKIP LOCKED",
        };
        let sql = format!("{HEADS_DUE} ORDER BY n.next_at LIMIT $3{skip}");
        // Nothing due is found without a write (each node asks every
        // second): the same heads, read without locks.
        let probe = format!("{HEADS_DUE} LIMIT 1");
        let due: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(probe))
            .bind(subscription.to_owned())
            .bind(now)
            .fetch_optional(self.reader())
            .await?;
        if due.is_none() {
            return Ok(Vec::new());
        }
        let claim = format!(
            "UPDATE notices SET next_at = $4, lease_token = lease_token + 1 \
             WHERE id IN ({sql}) RETURNING {NOTICE_COLUMNS}"
        );
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(sqlx::AssertSqlSafe(claim))
            .bind(subscription.to_owned())
            .bind(now)
            .bind(i64::from(limit))
            .bind(until)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let mut out = rows
            .iter()
            .map(MapRow::notice)
            .collect::<StoreResult<Vec<_>>>()?;
        out.sort_by_key(|n| n.id);
        Ok(out)
    }

    async fn settle_notices(&self, round: &NoticeRound) -> StoreResult<Settled> {
        if round.settles.is_empty() {
            return Ok(Settled {
                lost: 0,
                disabled: false,
            });
        }
        let mut tx = self.begin_write().await?;
        let mut lost = 0;
        // Whether a delivery was taken, or only refused, in this round.
        let mut sent_ok = None;
        for s in &round.settles {
            if Self::settle_one(&mut tx, s, round.now).await? {
                match &s.outcome {
                    NoticeOutcome::Delivered { .. } => sent_ok = Some(true),
                    NoticeOutcome::Failed { .. } => sent_ok = Some(sent_ok.unwrap_or(false)),
                    _ => {}
                }
            } else {
                lost += 1;
            }
        }
        let disabled = match sent_ok {
            Some(ok) => self.note_spell(&mut tx, round, ok).await?,
            None => false,
        };
        tx.commit().await?;
        Ok(Settled { lost, disabled })
    }

    async fn notices(&self, f: &NoticeFilter) -> StoreResult<Page<Notice>> {
        let limit = page_limit(f.limit);
        let mut qb = sqlx::QueryBuilder::<DB>::new(format!(
            "SELECT {NOTICE_COLUMNS} FROM notices WHERE true"
        ));
        if let Some(id) = f.id {
            qb.push(" AND id = ").push_bind(id);
        }
        if let Some(s) = &f.subscription {
            qb.push(" AND subscription = ").push_bind(s.clone());
        }
        if let Some(r) = f.record_id {
            qb.push(" AND record_id = ").push_bind(r);
        }
        if let Some(st) = &f.state {
            qb.push(" AND state = ").push_bind(st.clone());
        }
        if let Some(ps) = &f.pipelines {
            // A scoped caller sees its pipelines' records' notices only.
            qb.push(" AND pipeline IN (");
            let mut sep = qb.separated(", ");
            sep.push_bind("");
            for p in ps {
                sep.push_bind(p.clone());
            }
            qb.push(")");
        }
        if let Some(b) = f.before {
            qb.push(" AND id < ").push_bind(b);
        }
        qb.push(" ORDER BY id DESC LIMIT ")
            .push_bind(i64::from(limit) + 1);
        let rows = qb.build().fetch_all(self.reader()).await?;
        let items = rows
            .iter()
            .map(MapRow::notice)
            .collect::<StoreResult<_>>()?;
        Ok(into_page(items, limit, |n: &Notice| n.id))
    }

    async fn subscription_states(&self) -> StoreResult<Vec<SubscriptionState>> {
        let rows = sqlx::query(
            "SELECT name, failing_since, disabled_at, disabled_reason FROM notify_subscriptions \
             ORDER BY name",
        )
        .fetch_all(self.reader())
        .await?;
        rows.iter().map(MapRow::subscription_state).collect()
    }

    async fn turn_subscription(
        &self,
        name: &str,
        on: bool,
        actor: &str,
        now: UnixMs,
    ) -> StoreResult<SubscriptionState> {
        let mut tx = self.begin_write().await?;
        let reason = (!on).then(|| format!("turned off by {actor}"));
        let row = sqlx::query(
            "INSERT INTO notify_subscriptions (name, failing_since, disabled_at, disabled_reason, updated_at) \
             VALUES ($1, NULL, $2, $3, $4) ON CONFLICT (name) DO UPDATE SET \
               failing_since = NULL, disabled_at = excluded.disabled_at, \
               disabled_reason = excluded.disabled_reason, updated_at = excluded.updated_at \
             RETURNING name, failing_since, disabled_at, disabled_reason",
        )
        .bind(name.to_owned())
        .bind((!on).then_some(now))
        .bind(reason)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        if on {
            // What it missed gets its whole `retry_for` from now.
            sqlx::query(
                "UPDATE notices SET since = $2 WHERE subscription = $1 AND state = 'pending'",
            )
            .bind(name.to_owned())
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        let detail = serde_json::json!({ "subscription": name });
        let kind = if on {
            "notify_enabled"
        } else {
            "notify_disabled"
        };
        self.insert_event(&mut tx, &EventRow::audit(kind, actor, now, &detail))
            .await?;
        tx.commit().await?;
        row.subscription_state()
    }

    async fn redeliver_notice(&self, id: i64, actor: &str, now: UnixMs) -> StoreResult<Notice> {
        let mut tx = self.begin_write().await?;
        // Sent again only while nothing of its subject is pending, so
        // that it cannot overtake, or be overtaken by, one under way.
        let busy: Option<i64> = sqlx::query_scalar(
            "SELECT o.id FROM notices n JOIN notices o ON o.subscription = n.subscription \
               AND o.subject = n.subject AND o.state = 'pending' WHERE n.id = $1 LIMIT 1",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(o) = busy {
            return Err(StoreError::Conflict {
                what: "pending notice of the same subject",
                key: o.to_string(),
            });
        }
        let sql = format!(
            "UPDATE notices SET state = 'pending', next_at = $1, since = $1, \
               lease_token = lease_token + 1 \
             WHERE id = $2 AND state <> 'pending' RETURNING {NOTICE_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            let found: Option<i64> = sqlx::query_scalar("SELECT id FROM notices WHERE id = $1")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            return Err(match found {
                None => StoreError::NotFound {
                    what: "notice",
                    key: id.to_string(),
                },
                Some(_) => StoreError::Invalid(format!("notice {id} is pending: it goes when due")),
            });
        };
        let notice = row.notice()?;
        let detail = serde_json::json!({
            "notice": id, "subscription": notice.subscription, "type": notice.topic,
        });
        let event = EventRow {
            record_id: notice.record_id,
            ..EventRow::audit("notice_redelivered", actor, now, &detail)
        };
        self.insert_event(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(notice)
    }
}

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
    /// The subscription's failing spell after a delivery sent: ended by
    /// one taken, begun (or carried on) by one failed; turned off, and
    /// audited, once it has lasted `disable_after`. True when turned off now.
    /// Writes one delivery's outcome under the lease it was claimed with:
    /// false when that lease was lost.
    async fn settle_one(tx: &mut Tx<DB>, s: &NoticeSettle, now: UnixMs) -> StoreResult<bool> {
        // (state, due, an attempt spent, what the subscriber answered)
        let (state, next_at, sent, heard) = match &s.outcome {
            NoticeOutcome::Delivered { status, reply } => {
                ("delivered", None, true, Some((Some(*status), reply)))
            }
            NoticeOutcome::Deferred { at } => ("pending", Some(*at), false, None),
            NoticeOutcome::Throttled { at, status, reply } => {
                ("pending", Some(*at), false, Some((*status, reply)))
            }
            NoticeOutcome::Failed {
                status,
                reply,
                retry_at,
            } => {
                let state = if retry_at.is_some() {
                    "pending"
                } else {
                    "failed"
                };
                (state, *retry_at, true, Some((*status, reply)))
            }
        };
        let (status, reply) = heard.map_or((None, None), |(s, r)| (s, Some(r)));
        let done = sqlx::query(
            "UPDATE notices SET state = $1, next_at = $2, attempts = attempts + $3, \
               last_at = CASE WHEN $9 = 1 THEN $4 ELSE last_at END, \
               status = CASE WHEN $9 = 1 THEN $5 ELSE status END, \
               reply = CASE WHEN $9 = 1 THEN $6 ELSE reply END \
             WHERE id = $7 AND lease_token = $8 AND state = 'pending'",
        )
        .bind(state)
        .bind(next_at)
        .bind(i64::from(sent))
        .bind(now)
        .bind(status.map(i64::from))
        .bind(reply.map(|r| crate::domain::trigger::cut(r, REPLY_KEPT)))
        .bind(s.id)
        .bind(s.lease_token)
        .bind(i64::from(heard.is_some()))
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn note_spell(&self, tx: &mut Tx<DB>, s: &NoticeRound, ok: bool) -> StoreResult<bool> {
        sqlx::query(
            "INSERT INTO notify_subscriptions (name, updated_at) VALUES ($1, $2) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(s.subscription.clone())
        .bind(s.now)
        .execute(&mut **tx)
        .await?;
        let sql = format!(
            "SELECT failing_since, disabled_at FROM notify_subscriptions WHERE name = $1{}",
            DB::LOCK
        );
        let (since, disabled_at): (Option<i64>, Option<i64>) =
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(s.subscription.clone())
                .fetch_one(&mut **tx)
                .await?;
        let (since_now, disable) = notify::failing(since, ok, s.now, s.disable_after_ms);
        let disable = disable && disabled_at.is_none();
        if since_now == since && !disable {
            return Ok(false);
        }
        let reason = disable.then(|| {
            format!(
                "every delivery failed since {}",
                crate::domain::time::format_ms(since_now.unwrap_or(s.now))
            )
        });
        sqlx::query(
            "UPDATE notify_subscriptions SET failing_since = $2, \
               disabled_at = COALESCE($3, disabled_at), \
               disabled_reason = COALESCE($4, disabled_reason), updated_at = $5 WHERE name = $1",
        )
        .bind(s.subscription.clone())
        .bind(since_now)
        .bind(disable.then_some(s.now))
        .bind(reason.clone())
        .bind(s.now)
        .execute(&mut **tx)
        .await?;
        if disable {
            let detail = serde_json::json!({ "subscription": s.subscription });
            let mut event = EventRow::audit("notify_disabled", "system", s.now, &detail);
            event.reason = reason.as_deref();
            self.insert_event(tx, &event).await?;
        }
        Ok(disable)
    }

    /// Writes the notices the subscriptions want of record events
    /// `events`, in the caller's transaction (each record's row read for
    /// its key, pipeline, group and error code, as the change left it).
    /// Nothing is read when no subscription could want any of them.
    pub(crate) async fn notice_events(
        &self,
        tx: &mut Tx<DB>,
        events: &[EventRow<'_>],
    ) -> StoreResult<()> {
        let filters = self.filters.get();
        if filters.is_empty() {
            return Ok(());
        }
        let uncertain = Some(crate::domain::OUTCOME_UNCERTAIN);
        let news: Vec<&EventRow<'_>> = events
            .iter()
            .filter(|e| e.record_id.is_some())
            .filter(|e| {
                [None, uncertain]
                    .into_iter()
                    .filter_map(|code| notify::record_topic(e.kind, e.from, e.to, code))
                    .any(|t| filters.iter().any(|f| f.wants_topic(t)))
            })
            .collect();
        if news.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = news.iter().filter_map(|e| e.record_id).collect();
        let subjects = Self::subjects(tx, &ids).await?;
        let mut rows = Vec::new();
        for e in news {
            let Some((subject, code)) = e.record_id.and_then(|id| subjects.get(&id)) else {
                continue;
            };
            let Some(topic) = notify::record_topic(e.kind, e.from, e.to, code.as_deref()) else {
                continue;
            };
            let change = Change {
                kind: e.kind,
                actor: e.actor,
                from: e.from,
                to: e.to,
                step: e.step,
                reason: e.reason,
            };
            rows.extend(Self::notice_rows(&filters, topic, subject, &change, e.at));
        }
        self.insert_notices(tx, &rows).await
    }

    /// Writes the notices the subscriptions want of a provider's change.
    pub(crate) async fn notice_provider(
        &self,
        tx: &mut Tx<DB>,
        topic: Topic,
        provider: &str,
        change: &Change<'_>,
        at: UnixMs,
    ) -> StoreResult<()> {
        let filters = self.filters.get();
        let subject = Subject::Provider(provider.to_owned());
        let rows = Self::notice_rows(&filters, topic, &subject, change, at);
        self.insert_notices(tx, &rows).await
    }

    fn notice_rows<'f>(
        filters: &'f [notify::Filter],
        topic: Topic,
        subject: &'f Subject,
        change: &Change<'_>,
        at: UnixMs,
    ) -> Vec<NoticeJson<'f>> {
        let wanting: Vec<&notify::Filter> =
            filters.iter().filter(|f| f.wants(topic, subject)).collect();
        if wanting.is_empty() {
            return Vec::new();
        }
        let data = notify::data(subject, change);
        let (record_id, pipeline, group, provider) = match subject {
            Subject::Record {
                id,
                pipeline,
                group,
                ..
            } => (Some(*id), Some(pipeline.as_str()), group.as_deref(), None),
            Subject::Provider(name) => (None, None, None, Some(name.as_str())),
        };
        wanting
            .into_iter()
            .map(|f| NoticeJson {
                subscription: &f.name,
                message_id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
                topic: topic.as_str(),
                subject: subject.key(),
                record_id,
                pipeline,
                group_key: group,
                provider,
                at,
                data: Some(data.clone()),
                next_at: Some(at),
            })
            .collect()
    }

    /// Each record's subject and error code, by id.
    async fn subjects(
        tx: &mut Tx<DB>,
        ids: &[i64],
    ) -> StoreResult<HashMap<i64, (Subject, Option<String>)>> {
        let sql = format!(
            "SELECT id, external_key, pipeline, group_key, priority, error_code FROM records \
             WHERE id {}SELECT CAST(value AS BIGINT) FROM {}{}",
            DB::ANY_OF.0,
            DB::DIALECT.rows(),
            DB::ANY_OF.1
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind_json(ids)
            .fetch_all(&mut **tx)
            .await?;
        let mut out = HashMap::with_capacity(rows.len());
        for r in &rows {
            let (subject, code) = r.notice_subject()?;
            if let Subject::Record { id, .. } = subject {
                out.insert(id, (subject, code));
            }
        }
        Ok(out)
    }

    async fn insert_notices(&self, tx: &mut Tx<DB>, rows: &[NoticeJson<'_>]) -> StoreResult<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let sql = DB::statements()
            .insert_notices
            .get(|| batch::insert("notices", batch::NOTICE_COLS, DB::DIALECT, ""));
        sqlx::query(sql).bind_json(rows).execute(&mut **tx).await?;
        Ok(())
    }
}
