//! What happened at the simulated provider: effects per idempotency key and
//! per client reference, the charges it made, and every mutating request
//! that reached it, in arrival order, whatever its fate.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A route with a side effect.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum Route {
    #[serde(rename = "POST /v1/charge")]
    Charge,
    #[serde(rename = "POST /v1/jobs")]
    Jobs,
}

/// One mutating request that reached the simulator, whatever its fate: a
/// row of [`SimHandle::arrivals`](super::SimHandle::arrivals), to compare
/// call for call with what a client says it sent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Arrival {
    pub route: Route,
    /// Its `Idempotency-Key` header.
    pub key: Option<String>,
    /// Its body's `client_reference` (or `ref`).
    pub client_reference: Option<String>,
    /// Whether it applied an effect: made a charge or created a job. A key
    /// the provider already knows applies none (unless the profile ignores
    /// keys), nor does a fault answered before the work (a 429, a 5xx, a
    /// redirect), nor a plain hang or reset that came first.
    pub effect: bool,
    /// The fault it drew ([`Fault::name`](super::Fault::name)), or
    /// `unauthorized` when it was refused for its token before any chaos.
    pub fault: String,
}

/// An arrival's place in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ArrivalId(usize);

/// A charge the provider made.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Charge {
    pub id: String,
    pub reference: Option<String>,
    pub amount: Value,
}

/// Ledger figures.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LedgerFigures {
    pub keys: usize,
    pub refs: usize,
    pub effects: u64,
    /// Business references charged more than once.
    pub double_charges: usize,
}

/// What happened at the provider, for tests to count.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// Effects applied per idempotency key.
    by_key: HashMap<String, u32>,
    /// Effects applied per client reference: more than one is a double
    /// charge, whatever keys were sent.
    by_ref: HashMap<String, u32>,
    effects: u64,
    /// Charges made, oldest first.
    charges: Vec<Charge>,
    /// Each key's first charge (its place in `charges`): what a replay of
    /// the key gets back.
    charge_by_key: HashMap<String, usize>,
    /// Each client reference's charges, oldest first.
    charges_by_ref: HashMap<String, Vec<usize>>,
    /// Every mutating request that reached the provider, in arrival order.
    arrivals: Vec<Arrival>,
}

impl Ledger {
    pub fn figures(&self) -> LedgerFigures {
        LedgerFigures {
            keys: self.by_key.len(),
            refs: self.by_ref.len(),
            effects: self.effects,
            double_charges: self.by_ref.values().filter(|n| **n > 1).count(),
        }
    }

    /// Lists a mutating request that drew `fault`, before it does anything.
    pub fn arrive(
        &mut self,
        route: Route,
        key: Option<String>,
        client_reference: Option<String>,
        fault: &str,
    ) -> ArrivalId {
        self.arrivals.push(Arrival {
            route,
            key,
            client_reference,
            effect: false,
            fault: fault.to_owned(),
        });
        ArrivalId(self.arrivals.len() - 1)
    }

    pub fn arrivals(&self) -> &[Arrival] {
        &self.arrivals
    }

    /// Counts an effect applied by `arrival` for `key` and `reference`.
    pub fn count(
        &mut self,
        arrival: Option<ArrivalId>,
        key: Option<&str>,
        reference: Option<&str>,
    ) {
        self.effects += 1;
        if let Some(k) = key {
            *self.by_key.entry(k.to_owned()).or_default() += 1;
        }
        if let Some(r) = reference {
            *self.by_ref.entry(r.to_owned()).or_default() += 1;
        }
        if let Some(row) = arrival.and_then(|a| self.arrivals.get_mut(a.0)) {
            row.effect = true;
        }
    }

    /// Makes `charge` for `arrival`, unless `key` was charged before and
    /// keys are honoured: then the key's first charge is given back, and
    /// `true` (a replay).
    pub fn charge(
        &mut self,
        honour_keys: bool,
        arrival: Option<ArrivalId>,
        key: Option<String>,
        charge: Charge,
    ) -> (Charge, bool) {
        let known = key
            .as_deref()
            .filter(|_| honour_keys)
            .and_then(|k| self.charge_by_key.get(k))
            .and_then(|at| self.charges.get(*at));
        if let Some(first) = known {
            return (first.clone(), true);
        }
        self.count(arrival, key.as_deref(), charge.reference.as_deref());
        let at = self.charges.len();
        if let Some(k) = key {
            self.charge_by_key.entry(k).or_insert(at);
        }
        if let Some(r) = &charge.reference {
            self.charges_by_ref.entry(r.clone()).or_default().push(at);
        }
        self.charges.push(charge.clone());
        (charge, false)
    }

    /// The charges made for `reference`, newest first.
    pub fn charges_for(&self, reference: &str) -> impl Iterator<Item = &Charge> {
        self.charges_by_ref
            .get(reference)
            .into_iter()
            .flat_map(|at| at.iter().rev())
            .filter_map(|at| self.charges.get(*at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(id: &str, reference: &str) -> Charge {
        Charge {
            id: id.to_owned(),
            reference: Some(reference.to_owned()),
            amount: Value::from(5),
        }
    }

    /// Two charges for `r1` under one key, the keys honoured or not.
    fn twice(honour_keys: bool) -> Ledger {
        let mut l = Ledger::default();
        for id in ["ch_1", "ch_2"] {
            let at = l.arrive(Route::Charge, Some("k".into()), Some("r1".into()), "none");
            l.charge(honour_keys, Some(at), Some("k".into()), charge(id, "r1"));
        }
        l
    }

    #[test]
    fn a_known_key_gets_its_first_charge_back_and_applies_nothing() {
        let mut l = twice(true);
        let at = l.arrive(Route::Charge, Some("k".into()), None, "none");
        let (again, replayed) = l.charge(true, Some(at), Some("k".into()), charge("ch_3", "r1"));
        assert_eq!((again.id.as_str(), replayed), ("ch_1", true));
        let effects: Vec<bool> = l.arrivals().iter().map(|a| a.effect).collect();
        assert_eq!(effects, [true, false, false]);
        assert_eq!(
            l.figures(),
            LedgerFigures {
                keys: 1,
                refs: 1,
                effects: 1,
                double_charges: 0
            }
        );
        let ids: Vec<&str> = l.charges_for("r1").map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["ch_1"]);
    }

    #[test]
    fn ignoring_keys_charges_again_and_counts_a_double_charge() {
        let l = twice(false);
        assert!(l.arrivals().iter().all(|a| a.effect));
        assert_eq!(
            l.figures(),
            LedgerFigures {
                keys: 1,
                refs: 1,
                effects: 2,
                double_charges: 1
            }
        );
        let ids: Vec<&str> = l.charges_for("r1").map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["ch_2", "ch_1"], "newest first");
        assert_eq!(l.charges_for("r2").count(), 0);
    }
}
