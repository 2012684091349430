//! Row → domain mapping, written once for both backends' row types (the
//! column names and Rust types are the same on both).

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::auth::seal::{Field, Keyring};
use crate::domain::breaker::SharedBreaker;
use crate::domain::claimed::Folded;
use crate::domain::permits::GrantRow;
use crate::domain::{
    ApiToken, Attempt, Event, Node, PipelineVersion, ProviderState, Record, RecordState,
    ScheduleRow, Session, StateCount, StepCount, StepRun, StepVersion, User,
};
use crate::store::{StepRollup, StoreError, StoreResult};

/// The `next_run_at` stored for a record waiting with no time (for a
/// person or a signal, with no timeout): 9999-12-31T23:59:59.999Z, which
/// no claim reaches; read back as none. The schema wants a time for every
/// scheduled state.
pub(crate) const NO_TIME: crate::domain::UnixMs = 253_402_300_799_999;

/// Parses a stored enum name, turning an unknown one into `Corrupt`.
pub(crate) fn parse<T: std::str::FromStr>(text: &str, what: &str) -> StoreResult<T> {
    text.parse()
        .map_err(|_| StoreError::Corrupt(format!("{what} `{text}`")))
}

/// The column lists the mappers below expect, in one place.
pub(crate) const RECORD_COLUMNS: &str = "id, pipeline, pipeline_version, external_key, group_key, priority, state, input, \
     next_run_at, lease_owner, lease_until, lease_token, step, provider, error_code, reason, \
     created_at, updated_at, finished_at, park_until_at, park_until_provider, parent_id, parent_step, claimed_at";
pub(crate) const STEP_COLUMNS: &str = "record_id, step, provider, state, generation, attempts, unknowns, idempotency_key, \
     job_id, output, error_code, reason, next_run_at, deadline_at, started_at, finished_at, updated_at, cause";
pub(crate) const STEP_VERSION_COLUMNS: &str = "record_id, step, generation, state, output, job_id, error_code, cause, \
     started_at, finished_at, replaced_at, replaced_by";
pub(crate) const ATTEMPT_COLUMNS: &str = "id, record_id, step, provider, attempt_no, node, started_at, \
     duration_ms, http_status, outcome, error_code, excerpt, request";
pub(crate) const INTENT_COLUMNS: &str =
    "id, record_id, step, provider, attempt_no, node, sent_at, request";
pub(crate) const EVENT_COLUMNS: &str =
    "id, record_id, at, kind, actor, audit, from_state, to_state, step, reason, detail";
pub(crate) const USER_COLUMNS: &str = "id, username, password_hash, role, disabled, created_at, updated_at, theme, pipelines, unmask, oidc_subject";
pub(crate) const API_TOKEN_COLUMNS: &str = "id, name, prefix, role, created_by, created_at, last_used_at, revoked_at, expires_at, pipelines, unmask";
pub(crate) const BREAKER_COLUMNS: &str =
    "breaker, breaker_changed_at, open_until, probes_out, probes_ok, probe_until";
pub(crate) const ROLLUP_COLUMNS: &str = "minute, node, pipeline, step, provider, calls, succeeded, \
     failed, retried, unknown, records_succeeded, records_failed, records_parked, latency, \
     runs_succeeded, runs_failed, run_latency";
pub(crate) const PROVIDER_COLUMNS: &str = "provider, breaker, breaker_changed_at, open_until, paused, \
     paused_by, paused_reason, throttled_until, stats, updated_at";

/// A backend's row, mapped to the domain's types. Implemented once, for
/// every row type whose columns decode to the Rust types below (both
/// backends' rows do); the methods read columns by name.
pub trait MapRow {
    /// A nullable JSON column.
    fn json(&self, col: &str) -> StoreResult<Option<Value>>;
    /// A nullable JSON column of values sealed at rest, opened with `k`.
    fn sealed_json(&self, col: &str, field: Field, k: &Keyring) -> StoreResult<Option<Value>>;
    /// A nullable text column of values sealed at rest, opened with `k`.
    fn sealed_text(&self, col: &str, field: Field, k: &Keyring) -> StoreResult<Option<String>>;
    /// A nullable record-state column.
    fn opt_state(&self, col: &str) -> StoreResult<Option<RecordState>>;
    /// A `records` row, read with [`RECORD_COLUMNS`].
    fn record(&self, k: &Keyring) -> StoreResult<Record>;
    /// A `step_runs` row, read with [`STEP_COLUMNS`].
    fn step_run(&self, k: &Keyring) -> StoreResult<StepRun>;
    /// A `step_versions` row, read with [`STEP_VERSION_COLUMNS`].
    fn step_version(&self, k: &Keyring) -> StoreResult<StepVersion>;
    /// A `step_confirmations` row.
    fn confirmation(&self) -> StoreResult<crate::domain::confirm::Pending>;
    /// An `attempts` row, read with [`ATTEMPT_COLUMNS`].
    fn attempt(&self, k: &Keyring) -> StoreResult<Attempt>;
    /// An `attempt_intents` row, read with [`INTENT_COLUMNS`].
    fn intent(&self, k: &Keyring) -> StoreResult<crate::domain::Intent>;
    /// An `events` row, read with [`EVENT_COLUMNS`].
    fn event(&self, k: &Keyring) -> StoreResult<Event>;
    /// An `events` row read with [`EVENT_COLUMNS`], `claimed_at` and
    /// `claimed_by`, with the claim folded into it (migration 34).
    fn folded_event(&self, k: &Keyring) -> StoreResult<(Event, Option<Folded>)>;
    /// A `users` row, read with [`USER_COLUMNS`].
    fn user(&self) -> StoreResult<User>;
    /// An `api_tokens` row, read with [`API_TOKEN_COLUMNS`].
    fn api_token(&self) -> StoreResult<ApiToken>;
    /// A `step_rollups` row, read with [`ROLLUP_COLUMNS`].
    fn rollup(&self) -> StoreResult<StepRollup>;
    /// A `sessions` row.
    fn session(&self) -> StoreResult<Session>;
    /// A `nodes` row.
    fn node(&self) -> StoreResult<Node>;
    /// A `schedules` row.
    fn schedule(&self) -> StoreResult<ScheduleRow>;
    /// A `providers` row, read with [`PROVIDER_COLUMNS`].
    fn provider_state(&self) -> StoreResult<ProviderState>;
    /// A `provider_grants` row.
    fn grant_row(&self) -> StoreResult<GrantRow>;
    /// A `providers` row's breaker, read with [`BREAKER_COLUMNS`].
    fn shared_breaker(&self) -> StoreResult<SharedBreaker>;
    /// A `pipeline_versions` row.
    fn pipeline_version(&self) -> StoreResult<PipelineVersion>;
    /// A row of `(pipeline, state, n)`.
    fn state_count(&self) -> StoreResult<StateCount>;
    fn step_count(&self) -> StoreResult<StepCount>;
    /// A `group_counts` sum (`pipeline, group_key, state, n`).
    fn group_count(&self) -> StoreResult<crate::domain::GroupCount>;
    fn trigger_delivery(&self) -> StoreResult<crate::store::TriggerDelivery>;
    /// A `notices` row.
    fn notice(&self) -> StoreResult<crate::store::Notice>;
    /// A `notify_subscriptions` row.
    fn subscription_state(&self) -> StoreResult<crate::store::SubscriptionState>;
    /// A record as a notice's subject (`id, external_key, pipeline,
    /// group_key, priority`), with its `error_code`.
    fn notice_subject(&self) -> StoreResult<(crate::domain::notify::Subject, Option<String>)>;
}

impl<R> MapRow for R
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i16: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Json<Value>: Decode<'r, R::Database> + Type<R::Database>,
{
    fn json(&self, col: &str) -> StoreResult<Option<Value>> {
        Ok(self.try_get::<Option<Json<Value>>, _>(col)?.map(|j| j.0))
    }

    fn sealed_json(&self, col: &str, field: Field, k: &Keyring) -> StoreResult<Option<Value>> {
        Ok(self.json(col)?.map(|v| k.open_json(field, v)).transpose()?)
    }

    fn sealed_text(&self, col: &str, field: Field, k: &Keyring) -> StoreResult<Option<String>> {
        Ok(self
            .try_get::<Option<String>, _>(col)?
            .map(|t| k.open_text(field, t))
            .transpose()?)
    }

    fn opt_state(&self, col: &str) -> StoreResult<Option<RecordState>> {
        self.try_get::<Option<String>, _>(col)?
            .map(|s: String| parse::<RecordState>(&s, "record state"))
            .transpose()
    }

    fn record(&self, k: &Keyring) -> StoreResult<Record> {
        Ok(Record {
            id: self.try_get("id")?,
            pipeline: self.try_get("pipeline")?,
            pipeline_version: self.try_get("pipeline_version")?,
            external_key: self.try_get("external_key")?,
            group: Some(self.try_get::<String, _>("group_key")?).filter(|g| !g.is_empty()),
            priority: u8::try_from(self.try_get::<i16, _>("priority")?)
                .map_err(|_| StoreError::Corrupt("record priority out of range".into()))?,
            state: parse(&self.try_get::<String, _>("state")?, "record state")?,
            input: self
                .sealed_json("input", Field::Input, k)?
                .unwrap_or(Value::Null),
            next_run_at: self
                .try_get::<Option<crate::domain::UnixMs>, _>("next_run_at")?
                .filter(|t| *t != NO_TIME),
            lease_owner: self.try_get("lease_owner")?,
            lease_until: self.try_get("lease_until")?,
            lease_token: self.try_get("lease_token")?,
            step: self.try_get("step")?,
            provider: self.try_get("provider")?,
            error_code: self.try_get("error_code")?,
            reason: self.try_get("reason")?,
            created_at: self.try_get("created_at")?,
            updated_at: self.try_get("updated_at")?,
            finished_at: self.try_get("finished_at")?,
            park_until: crate::domain::park::ParkUntil::from_columns(
                self.try_get("park_until_at")?,
                self.try_get("park_until_provider")?,
            ),
            parent_id: self.try_get("parent_id")?,
            parent_step: self.try_get("parent_step")?,
            claimed_at: self.try_get("claimed_at")?,
        })
    }

    fn step_run(&self, k: &Keyring) -> StoreResult<StepRun> {
        Ok(StepRun {
            record_id: self.try_get("record_id")?,
            step: self.try_get("step")?,
            provider: self.try_get("provider")?,
            state: parse(&self.try_get::<String, _>("state")?, "step state")?,
            generation: self.try_get("generation")?,
            attempts: self.try_get("attempts")?,
            unknowns: self.try_get("unknowns")?,
            idempotency_key: self.try_get("idempotency_key")?,
            job_id: self.try_get("job_id")?,
            output: self.sealed_json("output", Field::Output, k)?,
            error_code: self.try_get("error_code")?,
            reason: self.try_get("reason")?,
            next_run_at: self.try_get("next_run_at")?,
            deadline_at: self.try_get("deadline_at")?,
            started_at: self.try_get("started_at")?,
            finished_at: self.try_get("finished_at")?,
            updated_at: self.try_get("updated_at")?,
            cause: self.try_get("cause")?,
        })
    }

    fn confirmation(&self) -> StoreResult<crate::domain::confirm::Pending> {
        Ok(crate::domain::confirm::Pending {
            record_id: self.try_get("record_id")?,
            step: self.try_get("step")?,
            generation: self.try_get("generation")?,
            due_at: self.try_get("due_at")?,
            remaining: self.try_get("remaining")?,
            tries: self.try_get("tries")?,
        })
    }

    fn step_version(&self, k: &Keyring) -> StoreResult<StepVersion> {
        Ok(StepVersion {
            record_id: self.try_get("record_id")?,
            step: self.try_get("step")?,
            generation: self.try_get("generation")?,
            state: parse(&self.try_get::<String, _>("state")?, "step state")?,
            output: self.sealed_json("output", Field::Output, k)?,
            job_id: self.try_get("job_id")?,
            error_code: self.try_get("error_code")?,
            cause: self.try_get("cause")?,
            started_at: self.try_get("started_at")?,
            finished_at: self.try_get("finished_at")?,
            replaced_at: self.try_get("replaced_at")?,
            replaced_by: self.try_get("replaced_by")?,
        })
    }

    fn attempt(&self, k: &Keyring) -> StoreResult<Attempt> {
        Ok(Attempt {
            id: self.try_get("id")?,
            record_id: self.try_get("record_id")?,
            step: self.try_get("step")?,
            provider: self.try_get("provider")?,
            attempt_no: self.try_get("attempt_no")?,
            node: self.try_get("node")?,
            started_at: self.try_get("started_at")?,
            duration_ms: self.try_get("duration_ms")?,
            http_status: self.try_get("http_status")?,
            outcome: parse(&self.try_get::<String, _>("outcome")?, "outcome")?,
            error_code: self.try_get("error_code")?,
            excerpt: self.sealed_text("excerpt", Field::Excerpt, k)?,
            request: self
                .sealed_text("request", Field::Request, k)?
                .and_then(|t| crate::domain::request::SentRequest::from_stored(&t)),
        })
    }

    fn intent(&self, k: &Keyring) -> StoreResult<crate::domain::Intent> {
        Ok(crate::domain::Intent {
            id: self.try_get("id")?,
            record_id: self.try_get("record_id")?,
            step: self.try_get("step")?,
            provider: self.try_get("provider")?,
            attempt_no: self.try_get("attempt_no")?,
            node: self.try_get("node")?,
            sent_at: self.try_get("sent_at")?,
            request: self
                .sealed_text("request", Field::Request, k)?
                .and_then(|t| crate::domain::request::SentRequest::from_stored(&t)),
        })
    }

    fn event(&self, k: &Keyring) -> StoreResult<Event> {
        Ok(Event {
            id: self.try_get("id")?,
            record_id: self.try_get("record_id")?,
            at: self.try_get("at")?,
            kind: self.try_get("kind")?,
            actor: self.try_get("actor")?,
            audit: self.try_get("audit")?,
            from_state: self.opt_state("from_state")?,
            to_state: self.opt_state("to_state")?,
            step: self.try_get("step")?,
            reason: self.try_get("reason")?,
            detail: self.sealed_json("detail", Field::Detail, k)?,
        })
    }

    fn folded_event(&self, k: &Keyring) -> StoreResult<(Event, Option<Folded>)> {
        let at: Option<crate::domain::UnixMs> = self.try_get("claimed_at")?;
        let by: Option<String> = self.try_get("claimed_by")?;
        Ok((self.event(k)?, at.map(|at| Folded { at, by })))
    }

    fn user(&self) -> StoreResult<User> {
        Ok(User {
            id: self.try_get("id")?,
            username: self.try_get("username")?,
            password_hash: self.try_get("password_hash")?,
            role: parse(&self.try_get::<String, _>("role")?, "role")?,
            disabled: self.try_get("disabled")?,
            created_at: self.try_get("created_at")?,
            updated_at: self.try_get("updated_at")?,
            theme: self.try_get("theme")?,
            pipelines: scope(self.try_get("pipelines")?),
            unmask: self.try_get("unmask")?,
            signs_on: self.try_get::<Option<String>, _>("oidc_subject")?.is_some(),
        })
    }

    fn api_token(&self) -> StoreResult<ApiToken> {
        Ok(ApiToken {
            id: self.try_get("id")?,
            name: self.try_get("name")?,
            prefix: self.try_get("prefix")?,
            role: parse(&self.try_get::<String, _>("role")?, "role")?,
            created_by: self.try_get("created_by")?,
            created_at: self.try_get("created_at")?,
            last_used_at: self.try_get("last_used_at")?,
            revoked_at: self.try_get("revoked_at")?,
            expires_at: self.try_get("expires_at")?,
            pipelines: scope(self.try_get("pipelines")?),
            unmask: self.try_get("unmask")?,
        })
    }

    fn rollup(&self) -> StoreResult<StepRollup> {
        let latency: String = self.try_get("latency")?;
        let run_latency: String = self.try_get("run_latency")?;
        Ok(StepRollup {
            minute: self.try_get("minute")?,
            node: self.try_get("node")?,
            pipeline: self.try_get("pipeline")?,
            step: self.try_get("step")?,
            provider: self.try_get("provider")?,
            calls: self.try_get("calls")?,
            succeeded: self.try_get("succeeded")?,
            failed: self.try_get("failed")?,
            retried: self.try_get("retried")?,
            unknown: self.try_get("unknown")?,
            records_succeeded: self.try_get("records_succeeded")?,
            records_failed: self.try_get("records_failed")?,
            records_parked: self.try_get("records_parked")?,
            latency: serde_json::from_str(&latency)
                .map_err(|e| StoreError::Corrupt(format!("rollup latency: {e}")))?,
            runs_succeeded: self.try_get("runs_succeeded")?,
            runs_failed: self.try_get("runs_failed")?,
            run_latency: serde_json::from_str(&run_latency)
                .map_err(|e| StoreError::Corrupt(format!("rollup run latency: {e}")))?,
        })
    }

    fn session(&self) -> StoreResult<Session> {
        Ok(Session {
            id: self.try_get("id")?,
            user_id: self.try_get("user_id")?,
            created_at: self.try_get("created_at")?,
            expires_at: self.try_get("expires_at")?,
            revoked_at: self.try_get("revoked_at")?,
            last_seen_at: self.try_get("last_seen_at")?,
        })
    }

    fn node(&self) -> StoreResult<Node> {
        Ok(Node {
            id: self.try_get("id")?,
            hostname: self.try_get("hostname")?,
            pid: self.try_get("pid")?,
            version: self.try_get("version")?,
            started_at: self.try_get("started_at")?,
            heartbeat_at: self.try_get("heartbeat_at")?,
            draining: self.try_get("draining")?,
            config_version: self.try_get("config_version")?,
            data_key: self.try_get("data_key")?,
        })
    }

    fn schedule(&self) -> StoreResult<ScheduleRow> {
        Ok(ScheduleRow {
            pipeline: self.try_get("pipeline")?,
            cron: self.try_get("cron")?,
            watermark: self.try_get("watermark")?,
            last_tick: self.try_get("last_tick")?,
            last_record_id: self.try_get("last_record_id")?,
            updated_at: self.try_get("updated_at")?,
        })
    }

    fn provider_state(&self) -> StoreResult<ProviderState> {
        Ok(ProviderState {
            provider: self.try_get("provider")?,
            breaker: parse(&self.try_get::<String, _>("breaker")?, "breaker state")?,
            breaker_changed_at: self.try_get("breaker_changed_at")?,
            open_until: self.try_get("open_until")?,
            paused: self.try_get("paused")?,
            paused_by: self.try_get("paused_by")?,
            paused_reason: self.try_get("paused_reason")?,
            throttled_until: self.try_get("throttled_until")?,
            stats: self.json("stats")?,
            updated_at: self.try_get("updated_at")?,
        })
    }

    fn grant_row(&self) -> StoreResult<GrantRow> {
        Ok(GrantRow {
            id: self.try_get("id")?,
            node: self.try_get("node")?,
            window_ms: self.try_get("window_ms")?,
            count: self.try_get("count")?,
            wanted: self.try_get("wanted")?,
            granted_at: self.try_get("granted_at")?,
            expires_at: self.try_get("expires_at")?,
            done_at: self.try_get("done_at")?,
        })
    }

    fn shared_breaker(&self) -> StoreResult<SharedBreaker> {
        let count = |col: &str| -> StoreResult<u32> {
            Ok(u32::try_from(self.try_get::<i64, _>(col)?).unwrap_or(0))
        };
        Ok(SharedBreaker {
            state: parse(&self.try_get::<String, _>("breaker")?, "breaker state")?,
            changed_at: self.try_get("breaker_changed_at")?,
            open_until: self.try_get("open_until")?,
            probes_out: count("probes_out")?,
            probes_ok: count("probes_ok")?,
            probe_until: self.try_get("probe_until")?,
        })
    }

    fn pipeline_version(&self) -> StoreResult<PipelineVersion> {
        Ok(PipelineVersion {
            id: self.try_get("id")?,
            pipeline: self.try_get("pipeline")?,
            hash: self.try_get("hash")?,
            definition: self.json("definition")?.unwrap_or(Value::Null),
            created_at: self.try_get("created_at")?,
        })
    }

    fn state_count(&self) -> StoreResult<StateCount> {
        Ok(StateCount {
            pipeline: self.try_get("pipeline")?,
            state: parse(&self.try_get::<String, _>("state")?, "record state")?,
            count: self.try_get("n")?,
        })
    }

    fn step_count(&self) -> StoreResult<StepCount> {
        Ok(StepCount {
            pipeline: self.try_get("pipeline")?,
            step: self.try_get("step")?,
            state: parse(&self.try_get::<String, _>("state")?, "record state")?,
            count: self.try_get("n")?,
        })
    }

    fn group_count(&self) -> StoreResult<crate::domain::GroupCount> {
        Ok(crate::domain::GroupCount {
            pipeline: self.try_get("pipeline")?,
            group: self.try_get("group_key")?,
            state: parse(&self.try_get::<String, _>("state")?, "record state")?,
            count: self.try_get("n")?,
        })
    }

    fn trigger_delivery(&self) -> StoreResult<crate::store::TriggerDelivery> {
        Ok(crate::store::TriggerDelivery {
            id: self.try_get("id")?,
            trigger: self.try_get("trigger")?,
            pipeline: self.try_get("pipeline")?,
            received_at: self.try_get("received_at")?,
            verdict: self.try_get("verdict")?,
            status: u16::try_from(self.try_get::<i32, _>("status")?).unwrap_or(0),
            event_id: self.try_get("event_id")?,
            event_type: self.try_get("event_type")?,
            record_id: self.try_get("record_id")?,
            detail: self.try_get("detail")?,
        })
    }

    fn notice(&self) -> StoreResult<crate::store::Notice> {
        Ok(crate::store::Notice {
            id: self.try_get("id")?,
            subscription: self.try_get("subscription")?,
            message_id: self.try_get("message_id")?,
            topic: self.try_get("topic")?,
            subject: self.try_get("subject")?,
            record_id: self.try_get("record_id")?,
            pipeline: self.try_get("pipeline")?,
            group: self.try_get("group_key")?,
            provider: self.try_get("provider")?,
            at: self.try_get("at")?,
            since: self.try_get("since")?,
            data: self.try_get::<Json<Value>, _>("data")?.0,
            state: self.try_get("state")?,
            attempts: self.try_get("attempts")?,
            lease_token: self.try_get("lease_token")?,
            next_at: self.try_get("next_at")?,
            last_at: self.try_get("last_at")?,
            status: self.try_get("status")?,
            reply: self.try_get("reply")?,
        })
    }

    fn subscription_state(&self) -> StoreResult<crate::store::SubscriptionState> {
        Ok(crate::store::SubscriptionState {
            name: self.try_get("name")?,
            failing_since: self.try_get("failing_since")?,
            disabled_at: self.try_get("disabled_at")?,
            disabled_reason: self.try_get("disabled_reason")?,
        })
    }

    fn notice_subject(&self) -> StoreResult<(crate::domain::notify::Subject, Option<String>)> {
        let group: String = self.try_get("group_key")?;
        let subject = crate::domain::notify::Subject::Record {
            id: self.try_get("id")?,
            key: self.try_get("external_key")?,
            pipeline: self.try_get("pipeline")?,
            group: Some(group).filter(|g| !g.is_empty()),
            priority: u8::try_from(self.try_get::<i16, _>("priority")?)
                .map_err(|_| StoreError::Corrupt("record priority out of range".into()))?,
        };
        Ok((subject, self.try_get("error_code")?))
    }
}

/// Maps every row with `f`.
pub(crate) fn map_all<R, T>(rows: &[R], f: impl Fn(&R) -> StoreResult<T>) -> StoreResult<Vec<T>> {
    rows.iter().map(f).collect()
}

/// [`map_all`] for the rows whose values are sealed at rest, opened with `k`.
pub(crate) fn map_sealed<R, T>(
    rows: &[R],
    k: &Keyring,
    f: impl Fn(&R, &Keyring) -> StoreResult<T>,
) -> StoreResult<Vec<T>> {
    rows.iter().map(|r| f(r, k)).collect()
}

/// A `pipelines` column's scope (NULL: every pipeline).
fn scope(column: Option<String>) -> crate::domain::scope::Scope {
    crate::domain::scope::Scope::from_stored(column.as_deref())
}
