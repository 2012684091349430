//! Per-(pipeline, state) and per-(provider, state) counter deltas, gathered
//! during a transaction and applied at its end, so dashboards never
//! `COUNT(*)` the records table.

use std::collections::BTreeMap;

use crate::domain::{Record, RecordState};

/// Net changes to the counters made by one transaction. Kept sorted so
/// every transaction touches counter rows in the same order (no deadlocks
/// between concurrent writers on PostgreSQL).
#[derive(Debug, Default)]
pub(crate) struct CountDeltas(
    BTreeMap<(String, RecordState), i64>,
    BTreeMap<(String, RecordState), i64>,
);

impl CountDeltas {
    /// A record at provider `provider` (the provider of its current step)
    /// moved from `from` to `to`; records with no provider yet are not
    /// counted per provider.
    pub(crate) fn provider_moved(
        &mut self,
        from: Option<(&str, RecordState)>,
        to: Option<(&str, RecordState)>,
    ) {
        if from == to {
            return;
        }
        if let Some((p, s)) = from {
            *self.1.entry((p.to_owned(), s)).or_default() -= 1;
        }
        if let Some((p, s)) = to {
            *self.1.entry((p.to_owned(), s)).or_default() += 1;
        }
    }

    /// `before` became `after` (same record): both counters.
    pub(crate) fn record_moved(&mut self, before: &Record, after: &Record) {
        self.moved(&after.pipeline, Some(before.state), after.state);
        self.provider_moved(
            before.provider.as_deref().map(|p| (p, before.state)),
            after.provider.as_deref().map(|p| (p, after.state)),
        );
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

    /// A record of `pipeline` in `state` (at `provider`, if it has one)
    /// was deleted.
    pub(crate) fn removed(&mut self, pipeline: &str, state: RecordState, provider: Option<&str>) {
        *self.0.entry((pipeline.to_owned(), state)).or_default() -= 1;
        if let Some(p) = provider {
            *self.1.entry((p.to_owned(), state)).or_default() -= 1;
        }
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
}
