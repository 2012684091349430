//! Many rows in one statement whose text never changes: the rows travel as
//! one JSON array parameter and the statement reads them back as a table
//! (`jsonb_each` on SQLite, `jsonb_array_elements` on PostgreSQL). A
//! `VALUES` list with one placeholder per cell has a different text for
//! every row count, so it cannot be a cached prepared statement and is
//! parsed and planned on every call; profiles of the engine showed SQLite
//! spending a quarter of its instructions doing exactly that.
//!
//! Each row is a JSON array of its cells in column order: the statement
//! reads cell `i` by position (`value->>i`). On SQLite, `jsonb_each` hands
//! each row over in SQLite's binary JSON, so reading a cell neither renders
//! the row back to text nor parses it again, as `json_each` rows did
//! (`jsonb_each` needs SQLite 3.45 or later: sqlx's bundled SQLite is).
//! Measured on a step-run upsert, µs per row written: 14.5 with objects
//! read by key through `json_each`, 9.2 with arrays, 5.5 with arrays
//! through `jsonb_each`.
//!
//! [`select`] writes the expressions that read the cells: integers and
//! booleans are cast (PostgreSQL's `->>` yields text), text columns are
//! taken as text. A JSON column's cell is `null` (SQL `NULL`) or a
//! one-element array holding the value, so that a JSON `null` value stays
//! distinct from no value.

use std::borrow::Cow;

use serde::Serialize;
use serde_json::Value;

use crate::auth::seal::{Field, Keyring, SealError};
use crate::domain::park::ParkUntil;
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

/// Where the SQL runs: the table the rows are read from, and a JSON
/// cell's path, are spelt differently.
#[derive(Clone, Copy)]
pub enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// The table of JSON rows read from parameter `$1`: columns `value`
    /// and `key` (the position).
    pub(crate) const fn rows(self) -> &'static str {
        match self {
            Dialect::Sqlite => "jsonb_each($1)",
            Dialect::Postgres => "jsonb_array_elements($1) WITH ORDINALITY AS j(value, key)",
        }
    }

    /// An enqueue's conflict target, a repeated key inserting nothing:
    /// PostgreSQL's key index holds keyed records only (migration 36, whose
    /// `ballast_insert_records` says the same), SQLite's constraint every
    /// record.
    pub(crate) const fn on_key_conflict(self) -> &'static str {
        match self {
            Dialect::Sqlite => "ON CONFLICT (pipeline, external_key) DO NOTHING",
            Dialect::Postgres => {
                "ON CONFLICT (pipeline, external_key) WHERE external_key IS NOT NULL DO NOTHING"
            }
        }
    }
}

fn expr(i: usize, ty: Ty, dialect: Dialect) -> String {
    match (ty, dialect) {
        (Ty::Int, _) => format!("CAST(value->>{i} AS BIGINT)"),
        (Ty::Text, _) => format!("value->>{i}"),
        (Ty::Bool, _) => format!("CAST(value->>{i} AS BOOLEAN)"),
        (Ty::Json, Dialect::Sqlite) => format!("value->'$[{i}][0]'"),
        (Ty::Json, Dialect::Postgres) => format!("value #> '{{{i},0}}'"),
    }
}

/// The expressions reading `cols` out of the JSON rows, comma-separated.
pub(crate) fn select(cols: &[(&str, Ty)], dialect: Dialect) -> String {
    let exprs: Vec<String> = cols
        .iter()
        .enumerate()
        .map(|(i, (_, ty))| expr(i, *ty, dialect))
        .collect();
    exprs.join(", ")
}

/// The select list with each expression named after its column, for a
/// `WITH v AS (SELECT …)` table.
pub(crate) fn select_as(cols: &[(&str, Ty)], dialect: Dialect) -> String {
    cols.iter()
        .enumerate()
        .map(|(i, (c, ty))| format!("{} AS {c}", expr(i, *ty, dialect)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `INSERT INTO table (<cols>) SELECT … FROM <rows> WHERE true ORDER BY key
/// <tail>`: rows in their array order (ids follow it), `WHERE true` so that
/// SQLite parses a following `ON CONFLICT`.
pub(crate) fn insert(table: &str, cols: &[(&str, Ty)], dialect: Dialect, tail: &str) -> String {
    let names: Vec<&str> = cols.iter().map(|(c, _)| *c).collect();
    format!(
        "INSERT INTO {table} ({}) SELECT {} FROM {} WHERE true ORDER BY key {tail}",
        names.join(", "),
        select(cols, dialect),
        dialect.rows()
    )
}

/// One cell as it is serialised: a JSON column (`Option<&Value>`) as
/// `null` for none or `[value]`, others as they are.
macro_rules! cell {
    (Json, $v:expr) => {
        $v.as_ref().map(|v| [v])
    };
    ($other:ident, $v:expr) => {
        $v
    };
}

/// A row and the columns it fills, from one list: each field is a column
/// of the same name, read as the given [`Ty`], serialised as a JSON array
/// of its cells in this order.
macro_rules! json_row {
    ($(#[$m:meta])* $name:ident, $cols:ident { $($field:ident: $ty:ty => $kind:ident,)* }) => {
        $(#[$m])*
        pub(crate) struct $name<'a> {
            $(pub(crate) $field: $ty,)*
        }

        pub(crate) const $cols: &[(&str, Ty)] = &[$((stringify!($field), Ty::$kind)),*];

        impl Serialize for $name<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeTuple;
                let mut row = s.serialize_tuple($cols.len())?;
                $(row.serialize_element(&cell!($kind, &self.$field))?;)*
                row.end()
            }
        }
    };
}

json_row!(EventJson, EVENT_COLS {
    record_id: Option<i64> => Int,
    at: UnixMs => Int,
    kind: &'a str => Text,
    actor: &'a str => Text,
    audit: bool => Bool,
    from_state: Option<&'static str> => Text,
    to_state: Option<&'static str> => Text,
    step: Option<&'a str> => Text,
    reason: Option<&'a str> => Text,
    detail: Option<Cow<'a, Value>> => Json,
    claimed_at: Option<UnixMs> => Int,
    claimed_by: Option<&'a str> => Text,
});

impl<'a> EventJson<'a> {
    pub(crate) fn new(e: &EventRow<'a>, k: &Keyring) -> Result<Self, SealError> {
        Ok(EventJson {
            record_id: e.record_id,
            at: e.at,
            kind: e.kind,
            actor: e.actor,
            audit: e.audit,
            from_state: e.from.map(|s| s.as_str()),
            to_state: e.to.map(|s| s.as_str()),
            step: e.step,
            reason: e.reason,
            detail: e
                .detail
                .map(|d| k.seal_json(Field::Detail, d))
                .transpose()?,
            claimed_at: e.claimed_at,
            claimed_by: e.claimed_by,
        })
    }
}

json_row!(
    /// A notice for the outbox (`store::notices`).
    NoticeJson, NOTICE_COLS {
    subscription: &'a str => Text,
    message_id: String => Text,
    topic: &'static str => Text,
    subject: String => Text,
    record_id: Option<i64> => Int,
    pipeline: Option<&'a str> => Text,
    group_key: Option<&'a str> => Text,
    provider: Option<&'a str> => Text,
    at: UnixMs => Int,
    data: Option<Value> => Json,
    next_at: Option<UnixMs> => Int,
});

json_row!(StepJson, STEP_COLS {
    record_id: i64 => Int,
    step: &'a str => Text,
    state: &'static str => Text,
    generation: i32 => Int,
    attempts: i32 => Int,
    idempotency_key: String => Text,
    job_id: Option<&'a str> => Text,
    output: Option<Cow<'a, Value>> => Json,
    error_code: Option<&'a str> => Text,
    reason: Option<&'a str> => Text,
    next_run_at: Option<UnixMs> => Int,
    deadline_at: Option<UnixMs> => Int,
    started_at: Option<UnixMs> => Int,
    finished_at: Option<UnixMs> => Int,
    updated_at: UnixMs => Int,
    provider: Option<&'a str> => Text,
    unknowns: i32 => Int,
    item_of: Option<&'a str> => Text,
    item_no: Option<i64> => Int,
});

impl<'a> StepJson<'a> {
    pub(crate) fn new(
        installation: &str,
        record_id: i64,
        s: &'a StepWrite,
        now: UnixMs,
        k: &Keyring,
    ) -> Result<Self, SealError> {
        let item = crate::domain::each::item_of(&s.step);
        Ok(StepJson {
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
            output: s
                .output
                .as_ref()
                .map(|o| k.seal_json(Field::Output, o))
                .transpose()?,
            error_code: s.error_code.as_deref(),
            reason: s.reason.as_deref(),
            next_run_at: s.next_run_at,
            deadline_at: s.deadline_at,
            started_at: s.started_at,
            finished_at: s.finished_at,
            updated_at: now,
            provider: s.provider.as_deref(),
            unknowns: s.unknowns,
            item_of: item.map(|(of, _)| of),
            item_no: item.map(|(_, no)| no),
        })
    }
}

/// A request as stored: sealed when a key is current.
fn seal_request(k: &Keyring, stored: String) -> Result<String, SealError> {
    Ok(match k.seal_text(Field::Request, &stored)? {
        Cow::Borrowed(_) => stored,
        Cow::Owned(sealed) => sealed,
    })
}

json_row!(AttemptJson, ATTEMPT_COLS {
    record_id: i64 => Int,
    step: &'a str => Text,
    provider: Option<&'a str> => Text,
    attempt_no: i32 => Int,
    node: Option<&'a str> => Text,
    started_at: UnixMs => Int,
    duration_ms: i64 => Int,
    http_status: Option<i32> => Int,
    outcome: &'static str => Text,
    error_code: Option<&'a str> => Text,
    excerpt: Option<Cow<'a, str>> => Text,
    request: Option<String> => Text,
});

impl<'a> AttemptJson<'a> {
    pub(crate) fn new(record_id: i64, a: &'a NewAttempt, k: &Keyring) -> Result<Self, SealError> {
        Ok(AttemptJson {
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
                .map(|e| crate::domain::excerpt(e, crate::domain::EXCERPT_MAX_BYTES))
                .map(|e| k.seal_text(Field::Excerpt, e))
                .transpose()?,
            request: a
                .request
                .as_ref()
                .map(|r| seal_request(k, r.to_stored()))
                .transpose()?,
        })
    }
}

json_row!(IntentJson, INTENT_COLS {
    record_id: i64 => Int,
    step: &'a str => Text,
    provider: Option<&'a str> => Text,
    attempt_no: i32 => Int,
    node: Option<&'a str> => Text,
    sent_at: UnixMs => Int,
    request: Option<String> => Text,
    lease_owner: &'a str => Text,
    lease_token: i64 => Int,
});

impl<'a> IntentJson<'a> {
    pub(crate) fn new(i: &'a crate::store::NewIntent, k: &Keyring) -> Result<Self, SealError> {
        Ok(IntentJson {
            record_id: i.record_id,
            step: &i.step,
            provider: i.provider.as_deref(),
            attempt_no: i.attempt_no,
            node: i.node.as_deref(),
            sent_at: i.sent_at,
            request: i
                .request
                .as_ref()
                .map(|r| seal_request(k, r.to_stored()))
                .transpose()?,
            lease_owner: &i.lease.owner,
            lease_token: i.lease.token,
        })
    }
}

json_row!(
    /// The worker-owned columns of a record, as `records_write` writes them.
    RecordUpdateJson, RECORD_UPDATE_COLS {
    id: i64 => Int,
    state: &'static str => Text,
    next_run_at: Option<UnixMs> => Int,
    lease_owner: Option<&'a str> => Text,
    lease_until: Option<UnixMs> => Int,
    step: Option<&'a str> => Text,
    provider: Option<&'a str> => Text,
    error_code: Option<&'a str> => Text,
    reason: Option<&'a str> => Text,
    updated_at: UnixMs => Int,
    finished_at: Option<UnixMs> => Int,
    park_until_at: Option<UnixMs> => Int,
    park_until_provider: Option<&'a str> => Text,
});

/// Whether a commit moving a record from `before` to `after` leaves its
/// step, provider, error code, finish and park as they were: the columns
/// of the records' indexes that only some moves change.
pub(crate) fn in_place(before: &Record, after: &Record) -> bool {
    before.step == after.step
        && before.provider == after.provider
        && before.error_code == after.error_code
        && before.finished_at == after.finished_at
        && before.park_until == after.park_until
}

impl<'a> From<&'a Record> for RecordUpdateJson<'a> {
    fn from(r: &'a Record) -> Self {
        RecordUpdateJson {
            id: r.id,
            state: r.state.as_str(),
            // A record waiting with no time (for a person) keeps a time
            // no clock reaches: the schema wants one for a scheduled state.
            next_run_at: match (r.state, r.next_run_at) {
                (crate::domain::RecordState::Waiting, None) => Some(super::rows::NO_TIME),
                (_, at) => at,
            },
            lease_owner: r.lease_owner.as_deref(),
            lease_until: r.lease_until,
            step: r.step.as_deref(),
            provider: r.provider.as_deref(),
            error_code: r.error_code.as_deref(),
            reason: r.reason.as_deref(),
            updated_at: r.updated_at,
            finished_at: r.finished_at,
            park_until_at: ParkUntil::columns(r.park_until.as_ref()).0,
            park_until_provider: ParkUntil::columns(r.park_until.as_ref()).1,
        }
    }
}

json_row!(NewRecordJson, NEW_RECORD_COLS {
    pipeline: &'a str => Text,
    pipeline_version: Option<i64> => Int,
    external_key: Option<&'a str> => Text,
    group_key: &'a str => Text,
    state: &'static str => Text,
    input: Option<Cow<'a, Value>> => Json,
    next_run_at: UnixMs => Int,
    created_at: UnixMs => Int,
    updated_at: UnixMs => Int,
    priority: i64 => Int,
});

impl<'a> NewRecordJson<'a> {
    pub(crate) fn new(r: &'a NewRecord, now: UnixMs, k: &Keyring) -> Result<Self, SealError> {
        Ok(NewRecordJson {
            pipeline: &r.pipeline,
            pipeline_version: r.pipeline_version,
            external_key: r.external_key.as_deref(),
            group_key: r.group.as_deref().unwrap_or(""),
            state: "pending",
            input: Some(k.seal_json(Field::Input, &r.input)?),
            next_run_at: r.run_at,
            created_at: now,
            updated_at: now,
            priority: i64::from(r.priority),
        })
    }
}

json_row!(
    /// A counter delta; `name` fills the table's key column (pipeline or
    /// provider), so `apply_counts` names the columns itself.
    CountJson, COUNT_COLS {
    name: &'a str => Text,
    state: &'static str => Text,
    shard: i32 => Int,
    n: i64 => Int,
});

json_row!(
    /// A per-group counter delta (records of a group in a state not final).
    GroupCountJson, GROUP_COUNT_COLS {
    pipeline: &'a str => Text,
    group_key: &'a str => Text,
    state: &'a str => Text,
    shard: i32 => Int,
    n: i64 => Int,
});

json_row!(
    /// A per-step counter delta.
    StepCountJson, STEP_COUNT_COLS {
    pipeline: &'a str => Text,
    step: &'a str => Text,
    state: &'static str => Text,
    shard: i32 => Int,
    n: i64 => Int,
});
