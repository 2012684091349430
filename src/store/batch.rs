//! Many rows in one statement whose text never changes: the rows travel as
//! one JSON array parameter and the statement reads them back as a table
//! (`json_each` on SQLite, `jsonb_array_elements` on PostgreSQL). A
//! `VALUES` list with one placeholder per cell has a different text for
//! every row count, so it cannot be a cached prepared statement and is
//! parsed and planned on every call; profiles of the engine showed SQLite
//! spending a quarter of its instructions doing exactly that.
//!
//! Each row is a JSON object keyed by column name. [`select`] writes the
//! matching column list and the expressions that read them: integers and
//! booleans are cast (PostgreSQL's `->>` yields text), text columns are
//! taken as text, JSON columns as JSON (a missing key is SQL `NULL`, so
//! optional JSON fields are skipped rather than written as JSON `null`).

use serde::Serialize;
use serde_json::Value;

use crate::domain::{Record, UnixMs};
use crate::store::{EventRow, NewAttempt, NewRecord, StepWrite};

/// How a column is read out of its JSON row.
#[derive(Clone, Copy)]
pub(crate) enum Ty {
    Int,
    Text,
    Bool,
    Json,
}

fn expr(c: &str, ty: Ty) -> String {
    match ty {
        Ty::Int => format!("CAST(value->>'{c}' AS BIGINT)"),
        Ty::Text => format!("value->>'{c}'"),
        Ty::Bool => format!("CAST(value->>'{c}' AS BOOLEAN)"),
        Ty::Json => format!("value->'{c}'"),
    }
}

/// `(column list, select list)` reading `cols` out of the JSON rows, for
/// `INSERT INTO t (<columns>) SELECT <select> FROM <rows>`.
pub(crate) fn select(cols: &[(&str, Ty)]) -> (String, String) {
    let names: Vec<&str> = cols.iter().map(|(c, _)| *c).collect();
    let exprs: Vec<String> = cols.iter().map(|(c, ty)| expr(c, *ty)).collect();
    (names.join(", "), exprs.join(", "))
}

/// The select list with each expression named after its column, for a
/// `WITH v AS (SELECT …)` table.
pub(crate) fn select_as(cols: &[(&str, Ty)]) -> String {
    cols.iter()
        .map(|(c, ty)| format!("{} AS {c}", expr(c, *ty)))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) const EVENT_COLS: &[(&str, Ty)] = &[
    ("record_id", Ty::Int),
    ("at", Ty::Int),
    ("kind", Ty::Text),
    ("actor", Ty::Text),
    ("audit", Ty::Bool),
    ("from_state", Ty::Text),
    ("to_state", Ty::Text),
    ("step", Ty::Text),
    ("reason", Ty::Text),
    ("detail", Ty::Json),
];

#[derive(Serialize)]
pub(crate) struct EventJson<'a> {
    record_id: Option<i64>,
    at: UnixMs,
    kind: &'a str,
    actor: &'a str,
    audit: bool,
    from_state: Option<&'static str>,
    to_state: Option<&'static str>,
    step: Option<&'a str>,
    reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a Value>,
}

impl<'a> From<&EventRow<'a>> for EventJson<'a> {
    fn from(e: &EventRow<'a>) -> Self {
        EventJson {
            record_id: e.record_id,
            at: e.at,
            kind: e.kind,
            actor: e.actor,
            audit: e.audit,
            from_state: e.from.map(|s| s.as_str()),
            to_state: e.to.map(|s| s.as_str()),
            step: e.step,
            reason: e.reason,
            detail: e.detail,
        }
    }
}

pub(crate) const STEP_COLS: &[(&str, Ty)] = &[
    ("record_id", Ty::Int),
    ("step", Ty::Text),
    ("state", Ty::Text),
    ("generation", Ty::Int),
    ("attempts", Ty::Int),
    ("idempotency_key", Ty::Text),
    ("job_id", Ty::Text),
    ("output", Ty::Json),
    ("error_code", Ty::Text),
    ("reason", Ty::Text),
    ("next_run_at", Ty::Int),
    ("deadline_at", Ty::Int),
    ("started_at", Ty::Int),
    ("finished_at", Ty::Int),
    ("updated_at", Ty::Int),
    ("provider", Ty::Text),
    ("unknowns", Ty::Int),
];

#[derive(Serialize)]
pub(crate) struct StepJson<'a> {
    record_id: i64,
    step: &'a str,
    state: &'static str,
    generation: i32,
    attempts: i32,
    idempotency_key: String,
    job_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<&'a Value>,
    error_code: Option<&'a str>,
    reason: Option<&'a str>,
    next_run_at: Option<UnixMs>,
    deadline_at: Option<UnixMs>,
    started_at: Option<UnixMs>,
    finished_at: Option<UnixMs>,
    updated_at: UnixMs,
    provider: Option<&'a str>,
    unknowns: i32,
}

impl<'a> StepJson<'a> {
    pub(crate) fn new(installation: &str, record_id: i64, s: &'a StepWrite, now: UnixMs) -> Self {
        StepJson {
            record_id,
            step: &s.step,
            state: s.state.as_str(),
            generation: s.generation,
            attempts: s.attempts,
            idempotency_key: crate::domain::idempotency_key(
                installation,
                record_id,
                &s.step,
                s.generation,
            ),
            job_id: s.job_id.as_deref(),
            output: s.output.as_ref(),
            error_code: s.error_code.as_deref(),
            reason: s.reason.as_deref(),
            next_run_at: s.next_run_at,
            deadline_at: s.deadline_at,
            started_at: s.started_at,
            finished_at: s.finished_at,
            updated_at: now,
            provider: s.provider.as_deref(),
            unknowns: s.unknowns,
        }
    }
}

pub(crate) const ATTEMPT_COLS: &[(&str, Ty)] = &[
    ("record_id", Ty::Int),
    ("step", Ty::Text),
    ("provider", Ty::Text),
    ("attempt_no", Ty::Int),
    ("node", Ty::Text),
    ("started_at", Ty::Int),
    ("duration_ms", Ty::Int),
    ("http_status", Ty::Int),
    ("outcome", Ty::Text),
    ("error_code", Ty::Text),
    ("excerpt", Ty::Text),
];

#[derive(Serialize)]
pub(crate) struct AttemptJson<'a> {
    record_id: i64,
    step: &'a str,
    provider: Option<&'a str>,
    attempt_no: i32,
    node: Option<&'a str>,
    started_at: UnixMs,
    duration_ms: i64,
    http_status: Option<i32>,
    outcome: &'static str,
    error_code: Option<&'a str>,
    excerpt: Option<&'a str>,
}

impl<'a> AttemptJson<'a> {
    pub(crate) fn new(record_id: i64, a: &'a NewAttempt) -> Self {
        AttemptJson {
            record_id,
            step: &a.step,
            provider: a.provider.as_deref(),
            attempt_no: a.attempt_no,
            node: a.node.as_deref(),
            started_at: a.started_at,
            duration_ms: a.duration_ms,
            http_status: a.http_status,
            outcome: a.outcome.as_str(),
            error_code: a.error_code.as_deref(),
            excerpt: a
                .excerpt
                .as_deref()
                .map(|e| crate::domain::excerpt(e, crate::domain::EXCERPT_MAX_BYTES)),
        }
    }
}

/// The worker-owned columns of a record, as `update_records` writes them.
pub(crate) const RECORD_UPDATE_COLS: &[(&str, Ty)] = &[
    ("id", Ty::Int),
    ("state", Ty::Text),
    ("next_run_at", Ty::Int),
    ("lease_owner", Ty::Text),
    ("lease_until", Ty::Int),
    ("step", Ty::Text),
    ("provider", Ty::Text),
    ("error_code", Ty::Text),
    ("reason", Ty::Text),
    ("updated_at", Ty::Int),
    ("finished_at", Ty::Int),
];

#[derive(Serialize)]
pub(crate) struct RecordUpdateJson<'a> {
    id: i64,
    state: &'static str,
    next_run_at: Option<UnixMs>,
    lease_owner: Option<&'a str>,
    lease_until: Option<UnixMs>,
    step: Option<&'a str>,
    provider: Option<&'a str>,
    error_code: Option<&'a str>,
    reason: Option<&'a str>,
    updated_at: UnixMs,
    finished_at: Option<UnixMs>,
}

impl<'a> From<&'a Record> for RecordUpdateJson<'a> {
    fn from(r: &'a Record) -> Self {
        RecordUpdateJson {
            id: r.id,
            state: r.state.as_str(),
            next_run_at: r.next_run_at,
            lease_owner: r.lease_owner.as_deref(),
            lease_until: r.lease_until,
            step: r.step.as_deref(),
            provider: r.provider.as_deref(),
            error_code: r.error_code.as_deref(),
            reason: r.reason.as_deref(),
            updated_at: r.updated_at,
            finished_at: r.finished_at,
        }
    }
}

pub(crate) const NEW_RECORD_COLS: &[(&str, Ty)] = &[
    ("pipeline", Ty::Text),
    ("pipeline_version", Ty::Int),
    ("external_key", Ty::Text),
    ("state", Ty::Text),
    ("input", Ty::Json),
    ("next_run_at", Ty::Int),
    ("created_at", Ty::Int),
    ("updated_at", Ty::Int),
];

#[derive(Serialize)]
pub(crate) struct NewRecordJson<'a> {
    pipeline: &'a str,
    pipeline_version: Option<i64>,
    external_key: Option<&'a str>,
    state: &'static str,
    input: &'a Value,
    next_run_at: UnixMs,
    created_at: UnixMs,
    updated_at: UnixMs,
}

impl<'a> NewRecordJson<'a> {
    pub(crate) fn new(r: &'a NewRecord, now: UnixMs) -> Self {
        NewRecordJson {
            pipeline: &r.pipeline,
            pipeline_version: r.pipeline_version,
            external_key: r.external_key.as_deref(),
            state: "pending",
            input: &r.input,
            next_run_at: r.run_at,
            created_at: now,
            updated_at: now,
        }
    }
}

pub(crate) const COUNT_COLS: &[(&str, Ty)] = &[
    ("name", Ty::Text),
    ("state", Ty::Text),
    ("shard", Ty::Int),
    ("n", Ty::Int),
];

#[derive(Serialize)]
pub(crate) struct CountJson<'a> {
    pub name: &'a str,
    pub state: &'static str,
    pub shard: i32,
    pub n: i64,
}
