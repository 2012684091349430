//! List filters as SQL, shared by both backends through `QueryBuilder`.

use sqlx::{Database, Encode, QueryBuilder, Type};

use super::{AuditFilter, RecordFilter};
use crate::domain::park::UntilKind;

/// True when no single index serves the filter, so a search that matches
/// little could walk a whole index: such lists are searched in id windows.
pub(crate) fn needs_windows(f: &RecordFilter) -> bool {
    let set = [
        f.pipeline.is_some(),
        f.provider.is_some(),
        f.step.is_some(),
        f.error_code.is_some(),
        f.state.is_some(),
        f.key_prefix.is_some(),
        // "Parked with no condition" is served by the state index.
        f.until.is_some() && f.until != Some(UntilKind::Never),
    ];
    let n = set.iter().filter(|b| **b).count();
    // No index orders records by id among those with a condition, or
    // those in a span of time.
    if matches!(f.until, Some(UntilKind::Time | UntilKind::Provider))
        || f.created.is_set()
        || f.updated.is_set()
    {
        return true;
    }
    // (pipeline, state) has its own index.
    let pipeline_state = n == 2 && f.pipeline.is_some() && f.state.is_some();
    n >= 2 && !pipeline_state
}

/// Appends ` WHERE …` for a records filter (no ORDER BY / LIMIT); `floor`
/// bounds the ids searched from below (inclusive).
pub(crate) fn push_record_filter<DB>(
    qb: &mut QueryBuilder<DB>,
    f: &RecordFilter,
    floor: Option<i64>,
) where
    DB: Database,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    qb.push(" WHERE 1 = 1");
    let eq = [
        ("pipeline", &f.pipeline),
        ("provider", &f.provider),
        ("step", &f.step),
        ("error_code", &f.error_code),
    ];
    for (column, value) in eq {
        if let Some(v) = value {
            qb.push(format_args!(" AND {column} = "))
                .push_bind(v.clone());
        }
    }
    if let Some(state) = f.state {
        qb.push(" AND state = ")
            .push_bind(state.as_str().to_owned());
    }
    match f.until {
        Some(UntilKind::Time) => {
            qb.push(" AND park_until_at IS NOT NULL");
        }
        Some(UntilKind::Provider) => {
            qb.push(" AND park_until_provider IS NOT NULL");
        }
        Some(UntilKind::Never) => {
            qb.push(
                " AND state = 'parked' AND park_until_at IS NULL AND park_until_provider IS NULL",
            );
        }
        None => {}
    }
    if let Some(prefix) = &f.key_prefix {
        // A range on a byte-ordered column: uses the index, unlike LIKE.
        qb.push(" AND external_key >= ").push_bind(prefix.clone());
        qb.push(" AND external_key < ")
            .push_bind(format!("{prefix}\u{10FFFF}"));
    }
    for (column, range) in [("created_at", f.created), ("updated_at", f.updated)] {
        if let Some(from) = range.from {
            qb.push(format_args!(" AND {column} >= ")).push_bind(from);
        }
        if let Some(to) = range.to {
            qb.push(format_args!(" AND {column} < ")).push_bind(to);
        }
    }
    if let Some(before) = f.before {
        qb.push(" AND id < ").push_bind(before);
    }
    if let Some(floor) = floor {
        qb.push(" AND id >= ").push_bind(floor);
    }
}

/// Appends ` WHERE …` for the audit log (operator actions only).
/// `audit_predicate` is the backend's spelling of "audit is true" that its
/// partial indexes were declared with.
pub(crate) fn push_audit_filter<DB>(
    qb: &mut QueryBuilder<DB>,
    f: &AuditFilter,
    audit_predicate: &str,
) where
    DB: Database,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    qb.push(format_args!(" WHERE {audit_predicate}"));
    if let Some(actor) = &f.actor {
        qb.push(" AND actor = ").push_bind(actor.clone());
    }
    if let Some(kind) = &f.kind {
        qb.push(" AND kind = ").push_bind(kind.clone());
    }
    if let Some(before) = f.before {
        qb.push(" AND id < ").push_bind(before);
    }
}
