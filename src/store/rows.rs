//! Row → domain mapping, written once and instantiated for each backend's
//! row type (the column names and Rust types are the same on both).

/// Parses a stored enum name, turning an unknown one into `Corrupt`.
pub(crate) fn parse<T: std::str::FromStr>(text: &str, what: &str) -> Result<T, super::StoreError> {
    text.parse()
        .map_err(|_| super::StoreError::Corrupt(format!("{what} `{text}`")))
}

/// The column lists the mappers below expect, in one place.
pub(crate) const RECORD_COLUMNS: &str = "id, pipeline, pipeline_version, external_key, state, input, \
     next_run_at, lease_owner, lease_until, lease_token, step, provider, error_code, reason, \
     created_at, updated_at, finished_at";
pub(crate) const STEP_COLUMNS: &str = "record_id, step, provider, state, generation, attempts, unknowns, idempotency_key, \
     job_id, output, error_code, reason, next_run_at, deadline_at, started_at, finished_at, updated_at";
pub(crate) const ATTEMPT_COLUMNS: &str = "id, record_id, step, provider, attempt_no, node, started_at, \
     duration_ms, http_status, outcome, error_code, excerpt";
pub(crate) const EVENT_COLUMNS: &str =
    "id, record_id, at, kind, actor, audit, from_state, to_state, step, reason, detail";
pub(crate) const USER_COLUMNS: &str =
    "id, username, password_hash, role, disabled, created_at, updated_at";
pub(crate) const API_TOKEN_COLUMNS: &str =
    "id, name, prefix, role, created_by, created_at, last_used_at, revoked_at";
pub(crate) const ROLLUP_COLUMNS: &str = "minute, node, pipeline, step, provider, calls, succeeded, \
     failed, retried, unknown, records_succeeded, records_failed, records_parked, latency";
pub(crate) const PROVIDER_COLUMNS: &str = "provider, breaker, breaker_changed_at, open_until, paused, \
     paused_by, paused_reason, stats, updated_at";

/// Defines `record`, `step_run`, `attempt`, `event`, `user`, `session`,
/// `node`, `provider_state`, `pipeline_version` and `state_count` mappers
/// over the row type `$row`.
macro_rules! row_mappers {
    ($row:ty) => {
        #[allow(dead_code)]
        mod map {
            use serde_json::Value;
            use sqlx::Row;
            use sqlx::types::Json;

            use $crate::domain::*;
            use $crate::store::StoreResult;
            use $crate::store::rows::parse;

            type R = $row;

            fn json(r: &R, col: &str) -> StoreResult<Option<Value>> {
                Ok(r.try_get::<Option<Json<Value>>, _>(col)?.map(|j| j.0))
            }

            fn opt_state(r: &R, col: &str) -> StoreResult<Option<RecordState>> {
                r.try_get::<Option<String>, _>(col)?
                    .map(|s: String| parse::<RecordState>(&s, "record state"))
                    .transpose()
            }

            pub(crate) fn record(r: &R) -> StoreResult<Record> {
                Ok(Record {
                    id: r.try_get("id")?,
                    pipeline: r.try_get("pipeline")?,
                    pipeline_version: r.try_get("pipeline_version")?,
                    external_key: r.try_get("external_key")?,
                    state: parse(&r.try_get::<String, _>("state")?, "record state")?,
                    input: json(r, "input")?.unwrap_or(Value::Null),
                    next_run_at: r.try_get("next_run_at")?,
                    lease_owner: r.try_get("lease_owner")?,
                    lease_until: r.try_get("lease_until")?,
                    lease_token: r.try_get("lease_token")?,
                    step: r.try_get("step")?,
                    provider: r.try_get("provider")?,
                    error_code: r.try_get("error_code")?,
                    reason: r.try_get("reason")?,
                    created_at: r.try_get("created_at")?,
                    updated_at: r.try_get("updated_at")?,
                    finished_at: r.try_get("finished_at")?,
                })
            }

            pub(crate) fn step_run(r: &R) -> StoreResult<StepRun> {
                Ok(StepRun {
                    record_id: r.try_get("record_id")?,
                    step: r.try_get("step")?,
                    provider: r.try_get("provider")?,
                    state: parse(&r.try_get::<String, _>("state")?, "step state")?,
                    generation: r.try_get("generation")?,
                    attempts: r.try_get("attempts")?,
                    unknowns: r.try_get("unknowns")?,
                    idempotency_key: r.try_get("idempotency_key")?,
                    job_id: r.try_get("job_id")?,
                    output: json(r, "output")?,
                    error_code: r.try_get("error_code")?,
                    reason: r.try_get("reason")?,
                    next_run_at: r.try_get("next_run_at")?,
                    deadline_at: r.try_get("deadline_at")?,
                    started_at: r.try_get("started_at")?,
                    finished_at: r.try_get("finished_at")?,
                    updated_at: r.try_get("updated_at")?,
                })
            }

            pub(crate) fn attempt(r: &R) -> StoreResult<Attempt> {
                Ok(Attempt {
                    id: r.try_get("id")?,
                    record_id: r.try_get("record_id")?,
                    step: r.try_get("step")?,
                    provider: r.try_get("provider")?,
                    attempt_no: r.try_get("attempt_no")?,
                    node: r.try_get("node")?,
                    started_at: r.try_get("started_at")?,
                    duration_ms: r.try_get("duration_ms")?,
                    http_status: r.try_get("http_status")?,
                    outcome: parse(&r.try_get::<String, _>("outcome")?, "outcome")?,
                    error_code: r.try_get("error_code")?,
                    excerpt: r.try_get("excerpt")?,
                })
            }

            pub(crate) fn event(r: &R) -> StoreResult<Event> {
                Ok(Event {
                    id: r.try_get("id")?,
                    record_id: r.try_get("record_id")?,
                    at: r.try_get("at")?,
                    kind: r.try_get("kind")?,
                    actor: r.try_get("actor")?,
                    audit: r.try_get("audit")?,
                    from_state: opt_state(r, "from_state")?,
                    to_state: opt_state(r, "to_state")?,
                    step: r.try_get("step")?,
                    reason: r.try_get("reason")?,
                    detail: json(r, "detail")?,
                })
            }

            pub(crate) fn user(r: &R) -> StoreResult<User> {
                Ok(User {
                    id: r.try_get("id")?,
                    username: r.try_get("username")?,
                    password_hash: r.try_get("password_hash")?,
                    role: parse(&r.try_get::<String, _>("role")?, "role")?,
                    disabled: r.try_get("disabled")?,
                    created_at: r.try_get("created_at")?,
                    updated_at: r.try_get("updated_at")?,
                })
            }

            pub(crate) fn api_token(r: &R) -> StoreResult<ApiToken> {
                Ok(ApiToken {
                    id: r.try_get("id")?,
                    name: r.try_get("name")?,
                    prefix: r.try_get("prefix")?,
                    role: parse(&r.try_get::<String, _>("role")?, "role")?,
                    created_by: r.try_get("created_by")?,
                    created_at: r.try_get("created_at")?,
                    last_used_at: r.try_get("last_used_at")?,
                    revoked_at: r.try_get("revoked_at")?,
                })
            }

            pub(crate) fn rollup(r: &R) -> StoreResult<$crate::store::StepRollup> {
                let latency: String = r.try_get("latency")?;
                Ok($crate::store::StepRollup {
                    minute: r.try_get("minute")?,
                    node: r.try_get("node")?,
                    pipeline: r.try_get("pipeline")?,
                    step: r.try_get("step")?,
                    provider: r.try_get("provider")?,
                    calls: r.try_get("calls")?,
                    succeeded: r.try_get("succeeded")?,
                    failed: r.try_get("failed")?,
                    retried: r.try_get("retried")?,
                    unknown: r.try_get("unknown")?,
                    records_succeeded: r.try_get("records_succeeded")?,
                    records_failed: r.try_get("records_failed")?,
                    records_parked: r.try_get("records_parked")?,
                    latency: serde_json::from_str(&latency).map_err(|e| {
                        $crate::store::StoreError::Corrupt(format!("rollup latency: {e}"))
                    })?,
                })
            }

            pub(crate) fn session(r: &R) -> StoreResult<Session> {
                Ok(Session {
                    id: r.try_get("id")?,
                    user_id: r.try_get("user_id")?,
                    created_at: r.try_get("created_at")?,
                    expires_at: r.try_get("expires_at")?,
                    revoked_at: r.try_get("revoked_at")?,
                })
            }

            pub(crate) fn node(r: &R) -> StoreResult<Node> {
                Ok(Node {
                    id: r.try_get("id")?,
                    hostname: r.try_get("hostname")?,
                    pid: r.try_get("pid")?,
                    version: r.try_get("version")?,
                    started_at: r.try_get("started_at")?,
                    heartbeat_at: r.try_get("heartbeat_at")?,
                    draining: r.try_get("draining")?,
                })
            }

            pub(crate) fn provider_state(r: &R) -> StoreResult<ProviderState> {
                Ok(ProviderState {
                    provider: r.try_get("provider")?,
                    breaker: parse(&r.try_get::<String, _>("breaker")?, "breaker state")?,
                    breaker_changed_at: r.try_get("breaker_changed_at")?,
                    open_until: r.try_get("open_until")?,
                    paused: r.try_get("paused")?,
                    paused_by: r.try_get("paused_by")?,
                    paused_reason: r.try_get("paused_reason")?,
                    stats: json(r, "stats")?,
                    updated_at: r.try_get("updated_at")?,
                })
            }

            pub(crate) fn pipeline_version(r: &R) -> StoreResult<PipelineVersion> {
                Ok(PipelineVersion {
                    id: r.try_get("id")?,
                    pipeline: r.try_get("pipeline")?,
                    hash: r.try_get("hash")?,
                    definition: json(r, "definition")?.unwrap_or(Value::Null),
                    created_at: r.try_get("created_at")?,
                })
            }

            /// Rows of `(pipeline, state, n)`.
            pub(crate) fn state_count(r: &R) -> StoreResult<StateCount> {
                Ok(StateCount {
                    pipeline: r.try_get("pipeline")?,
                    state: parse(&r.try_get::<String, _>("state")?, "record state")?,
                    count: r.try_get("n")?,
                })
            }

            /// Maps every row with `f`.
            pub(crate) fn all<T>(rows: &[R], f: fn(&R) -> StoreResult<T>) -> StoreResult<Vec<T>> {
                rows.iter().map(f).collect()
            }
        }
    };
}

pub(crate) use row_mappers;
