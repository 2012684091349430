//! Per-(pipeline, state), per-(provider, state), per-(pipeline, step,
//! state) and per-(pipeline, group, open state) counter deltas, gathered
//! during a transaction and applied at its end, so dashboards and
//! `/metrics` never `COUNT(*)` the records table.

use std::collections::BTreeMap;

use crate::domain::{Record, RecordState};

/// Net changes to the counters made by one transaction. Kept sorted so
/// every transaction touches counter rows in the same order (no deadlocks
/// between concurrent writers on PostgreSQL).
#[derive(Debug, Default)]
pub(crate) struct CountDeltas(
    BTreeMap<(String, RecordState), i64>,
    BTreeMap<(String, RecordState), i64>,
    BTreeMap<(String, String, RecordState), i64>,
    BTreeMap<(String, String, RecordState), i64>,
);

/// The key of a group counter: records of a group in a state not final.
/// Records without a group, and finished ones, have none: a pipeline that
/// uses no groups writes no group counter, and the table holds the groups
/// with work rather than every group that ever had a record.
fn group_key(
    pipeline: &str,
    group: Option<&str>,
    state: RecordState,
) -> Option<(String, String, RecordState)> {
    match group {
        Some(g) if !state.is_terminal() => Some((pipeline.to_owned(), g.to_owned(), state)),
        _ => None,
    }
}

/// Where a deleted record was: its group, provider and step, if any.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Where<'a> {
    pub group: Option<&'a str>,
    pub provider: Option<&'a str>,
    pub step: Option<&'a str>,
}

/// The step a record counts under: the one it is at, or `''` before any.
pub(crate) fn step_key(step: Option<&str>) -> &str {
    step.unwrap_or("")
}

/// One record leaves counter `from` and joins `to` (`None`: no counter);
/// nothing when they are the same.
fn shift<K: Ord>(counts: &mut BTreeMap<K, i64>, from: Option<K>, to: Option<K>) {
    if from == to {
        return;
    }
    if let Some(k) = from {
        *counts.entry(k).or_default() -= 1;
    }
    if let Some(k) = to {
        *counts.entry(k).or_default() += 1;
    }
}

impl CountDeltas {
    /// A record at provider `provider` (the provider of its current step)
    /// moved from `from` to `to`; records with no provider yet are not
    /// counted per provider.
    pub(crate) fn provider_moved(
        &mut self,
        from: Option<(&str, RecordState)>,
        to: Option<(&str, RecordState)>,
    ) {
        shift(
            &mut self.1,
            from.map(|(p, s)| (p.to_owned(), s)),
            to.map(|(p, s)| (p.to_owned(), s)),
        );
    }

    /// A record of `pipeline` moved from (`step`, `state`) to the other
    /// pair; `None`: it is new, or deleted.
    pub(crate) fn step_moved(
        &mut self,
        pipeline: &str,
        from: Option<(&str, RecordState)>,
        to: Option<(&str, RecordState)>,
    ) {
        let key = |(step, s): (&str, RecordState)| (pipeline.to_owned(), step.to_owned(), s);
        shift(&mut self.2, from.map(key), to.map(key));
    }

    /// A record of `pipeline` and `group` moved from `from` (`None`: it is
    /// new, or deleted) to `to`.
    fn group_moved(
        &mut self,
        pipeline: &str,
        group: Option<&str>,
        from: Option<RecordState>,
        to: Option<RecordState>,
    ) {
        let key = |s| group_key(pipeline, group, s);
        shift(&mut self.3, from.and_then(key), to.and_then(key));
    }

    /// `before` became `after` (same record): every counter.
    pub(crate) fn record_moved(&mut self, before: &Record, after: &Record) {
        self.moved(&after.pipeline, Some(before.state), after.state);
        self.group_moved(
            &after.pipeline,
            after.group.as_deref(),
            Some(before.state),
            Some(after.state),
        );
        self.provider_moved(
            before.provider.as_deref().map(|p| (p, before.state)),
            after.provider.as_deref().map(|p| (p, after.state)),
        );
        self.step_moved(
            &after.pipeline,
            Some((step_key(before.step.as_deref()), before.state)),
            Some((step_key(after.step.as_deref()), after.state)),
        );
    }

    /// A record left where it was (step, provider) moved from `from` to
    /// `to`: every counter.
    pub(crate) fn state_moved(&mut self, rec: &Record, from: RecordState, to: RecordState) {
        self.moved(&rec.pipeline, Some(from), to);
        self.group_moved(&rec.pipeline, rec.group.as_deref(), Some(from), Some(to));
        self.provider_moved(
            rec.provider.as_deref().map(|p| (p, from)),
            rec.provider.as_deref().map(|p| (p, to)),
        );
        let step = step_key(rec.step.as_deref());
        self.step_moved(&rec.pipeline, Some((step, from)), Some((step, to)));
    }

    /// A new record of `pipeline` and `group`, pending at no step yet.
    pub(crate) fn inserted(&mut self, pipeline: &str, group: Option<&str>) {
        self.moved(pipeline, None, RecordState::Pending);
        self.group_moved(pipeline, group, None, Some(RecordState::Pending));
        self.step_moved(pipeline, None, Some(("", RecordState::Pending)));
    }

    /// The non-zero per-step deltas, in a stable order.
    pub(crate) fn step_nonzero(&self) -> impl Iterator<Item = (&str, &str, RecordState, i64)> {
        self.2
            .iter()
            .filter(|(_, n)| **n != 0)
            .map(|((p, st, s), n)| (p.as_str(), st.as_str(), *s, *n))
    }

    /// The non-zero per-group deltas, in a stable order.
    pub(crate) fn group_nonzero(&self) -> impl Iterator<Item = (&str, &str, RecordState, i64)> {
        self.3
            .iter()
            .filter(|(_, n)| **n != 0)
            .map(|((p, g, s), n)| (p.as_str(), g.as_str(), *s, *n))
    }

    /// The non-zero per-provider deltas, in a stable order.
    pub(crate) fn provider_nonzero(&self) -> impl Iterator<Item = (&str, RecordState, i64)> {
        self.1
            .iter()
            .filter(|(_, n)| **n != 0)
            .map(|((p, s), n)| (p.as_str(), *s, *n))
    }

    /// A record of `pipeline` moved from `from` (`None`: it is new) to `to`.
    pub(crate) fn moved(&mut self, pipeline: &str, from: Option<RecordState>, to: RecordState) {
        if from == Some(to) {
            return;
        }
        if let Some(from) = from {
            *self.0.entry((pipeline.to_owned(), from)).or_default() -= 1;
        }
        *self.0.entry((pipeline.to_owned(), to)).or_default() += 1;
    }

    /// A record of `pipeline` in `state` (of `group`, at `provider` and
    /// `step`, if it has them) was deleted.
    pub(crate) fn removed(&mut self, pipeline: &str, state: RecordState, at: Where<'_>) {
        let Where {
            group,
            provider,
            step,
        } = at;
        *self.0.entry((pipeline.to_owned(), state)).or_default() -= 1;
        self.group_moved(pipeline, group, Some(state), None);
        if let Some(p) = provider {
            *self.1.entry((p.to_owned(), state)).or_default() -= 1;
        }
        self.step_moved(pipeline, Some((step_key(step), state)), None);
    }

    /// The non-zero deltas, in a stable order.
    pub(crate) fn nonzero(&self) -> impl Iterator<Item = (&str, RecordState, i64)> {
        self.0
            .iter()
            .filter(|(_, n)| **n != 0)
            .map(|((p, s), n)| (p.as_str(), *s, *n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(state: RecordState) -> Record {
        Record::sample(state)
    }

    #[test]
    fn moves_net_out() {
        let mut d = CountDeltas::default();
        d.moved("p", None, RecordState::Pending);
        d.moved("p", Some(RecordState::Pending), RecordState::Running);
        d.moved("p", Some(RecordState::Running), RecordState::Running);
        let v: Vec<_> = d.nonzero().collect();
        assert_eq!(v, vec![("p", RecordState::Running, 1)]);
        d.provider_moved(
            Some(("a", RecordState::Running)),
            Some(("b", RecordState::Running)),
        );
        d.provider_moved(None, Some(("a", RecordState::Running)));
        d.provider_moved(
            Some(("b", RecordState::Running)),
            Some(("b", RecordState::Running)),
        );
        let v: Vec<_> = d.provider_nonzero().collect();
        assert_eq!(v, vec![("b", RecordState::Running, 1)]);
    }

    #[test]
    fn steps_follow_the_record() {
        let rec = |step: Option<&str>, state| Record {
            step: step.map(str::to_owned),
            ..record(state)
        };
        let mut d = CountDeltas::default();
        d.inserted("p", None);
        let new = rec(None, RecordState::Pending);
        let at_a = rec(Some("a"), RecordState::Running);
        d.record_moved(&new, &at_a);
        let at_b = rec(Some("b"), RecordState::Pending);
        d.record_moved(&at_a, &at_b);
        d.state_moved(&at_b, RecordState::Pending, RecordState::Parked);
        let v: Vec<_> = d.step_nonzero().collect();
        assert_eq!(v, vec![("p", "b", RecordState::Parked, 1)]);
        let at = Where {
            step: Some("b"),
            ..Where::default()
        };
        d.removed("p", RecordState::Parked, at);
        assert_eq!(d.step_nonzero().count(), 0);
    }

    #[test]
    fn groups_count_open_records_only() {
        let rec = |group: Option<&str>, state| Record {
            group: group.map(str::to_owned),
            state,
            ..record(state)
        };
        let mut d = CountDeltas::default();
        d.inserted("p", Some("t1"));
        d.inserted("p", None);
        let pending = rec(Some("t1"), RecordState::Pending);
        let running = rec(Some("t1"), RecordState::Running);
        d.record_moved(&pending, &running);
        let v: Vec<_> = d.group_nonzero().collect();
        assert_eq!(v, vec![("p", "t1", RecordState::Running, 1)]);
        // Finishing leaves the group's counters: nothing is kept per group
        // for finished records.
        d.state_moved(&running, RecordState::Running, RecordState::Succeeded);
        assert_eq!(d.group_nonzero().count(), 0);
        d.removed(
            "p",
            RecordState::Parked,
            Where {
                group: Some("t2"),
                ..Where::default()
            },
        );
        d.removed(
            "p",
            RecordState::Succeeded,
            Where {
                group: Some("t2"),
                ..Where::default()
            },
        );
        let v: Vec<_> = d.group_nonzero().collect();
        assert_eq!(v, vec![("p", "t2", RecordState::Parked, -1)]);
    }
}
