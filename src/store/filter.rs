//! List filters as SQL, shared by both backends through `QueryBuilder`.

use sqlx::{Database, Encode, QueryBuilder, Type};

use super::{AuditFilter, RecordFilter};
use crate::domain::RecordState;
use crate::domain::park::UntilKind;

/// True when no single index serves the filter, so a search that matches
/// little could walk a whole index: such lists are searched in id windows.
/// `running_apart`: the backend keeps running records in an index of their
/// own (`SqlDb::LISTS_IN_PARTS`).
pub(crate) fn needs_windows(f: &RecordFilter, running_apart: bool) -> bool {
    // Running records are few (the calls in flight): where they have their
    // own index, any filter over them reads it whole. (SQLite's planner,
    // without statistics, could prefer a provider's index to the state's
    // and walk every record of the provider: there they are windowed.)
    if running_apart && f.state == Some(RecordState::Running) {
        return false;
    }
    // Many pipelines of a scope (`list_within`): no index serves them
    // together.
    if f.pipelines.is_some() {
        return true;
    }
    // "Parked with no condition" is a state.
    let state = f.state.is_some() || f.until == Some(UntilKind::Never);
    let set = [
        f.pipeline.is_some(),
        f.provider.is_some(),
        f.step.is_some(),
        f.error_code.is_some(),
        state,
        f.key_prefix.is_some(),
        matches!(f.until, Some(UntilKind::Time | UntilKind::Provider)),
    ];
    let n = set.iter().filter(|b| **b).count();
    // No index orders records by id among those with a condition, in a
    // span of time, of a group (its index is the queues', which orders by
    // priority and due time) or of a priority (no index leads with it).
    if matches!(f.until, Some(UntilKind::Time | UntilKind::Provider))
        || f.created.is_set()
        || f.updated.is_set()
        || f.group.is_some()
        || f.priority.is_some()
    {
        return true;
    }
    // (pipeline, state) has its own index.
    let pipeline_state = n == 2 && f.pipeline.is_some() && state;
    n >= 2 && !pipeline_state
}

/// Which records one of a list's queries reads. On PostgreSQL the listing
/// indexes leave running records out (migration 20) and `records_running`
/// holds them: a query says which side it reads in its text, so that any
/// plan, a generic one too, can use those indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// Every record (a query served by the primary key, or by a state).
    All,
    /// Records not running.
    Resting,
    /// Running records.
    Running,
}

/// Whether a list is read in two parts, resting and running records,
/// merged (where the backend's listing indexes leave running records out):
/// when one of those indexes serves it, whole or in id windows, and no
/// state is asked.
pub(crate) fn needs_parts(f: &RecordFilter) -> bool {
    let indexed = f.pipeline.is_some()
        || f.provider.is_some()
        || f.step.is_some()
        || f.error_code.is_some()
        || f.key_prefix.is_some();
    indexed && f.state.is_none() && f.until.is_none()
}

/// Appends ` WHERE …` for a records filter (no ORDER BY / LIMIT); `floor`
/// bounds the ids searched from below (inclusive); `part` says which
/// records the query reads.
pub(crate) fn push_record_filter<DB>(
    qb: &mut QueryBuilder<DB>,
    f: &RecordFilter,
    floor: Option<i64>,
    part: Part,
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
        ("group_key", &f.group),
    ];
    for (column, value) in eq {
        if let Some(v) = value {
            qb.push(format_args!(" AND {column} = "))
                .push_bind(v.clone());
        }
    }
    if let Some(p) = f.priority {
        qb.push(" AND priority = ").push_bind(i64::from(p));
    }
    match f.pipelines.as_deref() {
        None => {}
        Some([]) => {
            qb.push(" AND 1 = 0");
        }
        Some(names) => {
            qb.push(" AND pipeline IN (");
            let mut list = qb.separated(", ");
            for name in names {
                list.push_bind(name.clone());
            }
            qb.push(")");
        }
    }
    // A state is written out, not bound: a plan for `state = $1` could use
    // no index that leaves running records out. The states are the
    // domain's own words. "Parked with no condition" is a state (below).
    let part = match f.state {
        Some(RecordState::Running) => Part::Running,
        Some(state) => {
            qb.push(format_args!(" AND state = '{}'", state.as_str()));
            Part::Resting
        }
        None if f.until == Some(UntilKind::Never) => Part::Resting,
        None => part,
    };
    match part {
        Part::All => {}
        Part::Resting => {
            qb.push(" AND state <> 'running'");
        }
        Part::Running => {
            qb.push(" AND state = 'running'");
        }
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

/// The most pipelines of a scope listed one by one, each through its
/// index, the lists merged (`list_within`); more are searched together in
/// id windows.
pub(crate) const MAX_MERGED: usize = 16;

/// A list of the records `filter` selects among those of `within` (a
/// caller's pipelines): for one pipeline or a few, the newest of each
/// through its own index, merged in id order (each list's `next` bounds
/// how far down the merged page is complete). For at most [`MAX_MERGED`]
/// pipelines, or one asked for.
pub(crate) async fn list_within<R>(
    db: &R,
    filter: &RecordFilter,
    within: &[String],
) -> crate::store::StoreResult<crate::store::Page<crate::domain::Record>>
where
    R: super::Records + ?Sized,
{
    use crate::store::Page;
    let mut one = filter.clone();
    one.pipelines = None;
    if let Some(p) = &filter.pipeline {
        return match within.contains(p) {
            true => db.list_records(&one).await,
            false => Ok(Page {
                items: Vec::new(),
                next: None,
            }),
        };
    }
    let limit = crate::store::page_limit(filter.limit) as usize;
    let mut items = Vec::new();
    // Every list is complete down to its `next` (exclusive of nothing
    // below it): the merged page is complete down to the highest.
    let mut floor: Option<i64> = None;
    for p in within {
        one.pipeline = Some(p.clone());
        let page = db.list_records(&one).await?;
        if let Some(n) = page.next {
            floor = Some(floor.map_or(n, |f| f.max(n)));
        }
        items.extend(page.items);
    }
    items.retain(|r: &crate::domain::Record| floor.is_none_or(|f| r.id >= f));
    items.sort_unstable_by_key(|r| std::cmp::Reverse(r.id));
    if items.len() > limit {
        items.truncate(limit);
        let next = items.last().map(|r| r.id);
        return Ok(Page { items, next });
    }
    Ok(Page { items, next: floor })
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
    if let Some(names) = &f.pipelines {
        qb.push(" AND EXISTS (SELECT 1 FROM records r WHERE r.id = events.record_id AND r.pipeline IN (");
        let mut list = qb.separated(", ");
        list.push("NULL");
        for name in names {
            list.push_bind(name.clone());
        }
        qb.push("))");
    }
    if let Some(before) = f.before {
        qb.push(" AND id < ").push_bind(before);
    }
}
