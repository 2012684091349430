//! Per-(pipeline, state) counter deltas, gathered during a transaction and
//! applied at its end, so dashboards never `COUNT(*)` the records table.

use std::collections::BTreeMap;

use crate::domain::RecordState;

/// Net changes to the counters made by one transaction. Kept sorted so
/// every transaction touches counter rows in the same order (no deadlocks
/// between concurrent writers on PostgreSQL).
#[derive(Debug, Default)]
pub(crate) struct CountDeltas(BTreeMap<(String, RecordState), i64>);

impl CountDeltas {
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
    }
}
