//! A pass's claim has no row of its own (migration 34): the event that
//! ends the pass (worked, released, or the `lease_expired` the next
//! claimer writes) keeps when the pass was claimed, and by which node
//! when that is not its actor. A record's history still reads claim by
//! claim: [`unfold`] puts a `claimed` event back before each such event,
//! and one at the end for the pass under way.

use crate::domain::{Event, RecordState, UnixMs};

/// The kind of the events put back.
pub const KIND: &str = "claimed";

/// The actor name of a worker's events, from its lease owner (node id).
pub fn node_actor(owner: &str) -> String {
    format!("node:{owner}")
}

/// A claim folded into the event that ended its pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Folded {
    pub at: UnixMs,
    /// The node that claimed, when not the event's actor.
    pub by: Option<String>,
}

/// A record's events in id order, with the claims folded into them put
/// back as `claimed` events, and the claim of the pass under way
/// (`under_way`: the lease owner and when it claimed; left out when an
/// event read already ends that pass). Each claim goes where its time
/// falls within its pass: after the event that ended the pass before, and
/// before any event written while it ran (a recorded reversal, an
/// unconfirmed result); it carries the id of the event it was folded
/// into (of the last event, for the pass under way). A claim already
/// stored as a `claimed` row (by a version before migration 34) is not
/// put back twice.
pub fn unfold(
    record_id: i64,
    events: Vec<(Event, Option<Folded>)>,
    under_way: Option<(&str, UnixMs)>,
) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::with_capacity(events.len() * 2 + 1);
    let mut last_folded = None;
    for (event, folded) in events {
        if let Some(f) = folded {
            let actor =
                f.by.as_deref()
                    .map_or_else(|| event.actor.clone(), node_actor);
            put_back(&mut out, (event.id, event.record_id), f.at, actor);
            last_folded = Some(f.at);
        }
        out.push(event);
    }
    // The lease is read first: a pass that ended before the events were
    // read has its claim folded into the last event that carries one.
    if let Some((owner, at)) = under_way.filter(|(_, at)| last_folded != Some(*at)) {
        let id = out.last().map_or(0, |e| e.id);
        put_back(&mut out, (id, Some(record_id)), at, node_actor(owner));
    }
    out
}

/// Whether `e` may have been written while a pass ran: it moves no
/// state (an unconfirmed result) or keeps the record running (a recorded
/// reversal). Every other event comes before the claim after it.
fn within_a_pass(e: &Event) -> bool {
    e.kind != KIND && (e.to_state.is_none() || e.to_state == Some(RecordState::Running))
}

fn put_back(out: &mut Vec<Event>, (id, record_id): (i64, Option<i64>), at: UnixMs, actor: String) {
    let mut place = out.len();
    while place > 0 {
        let before = &out[place - 1];
        if before.at <= at || !within_a_pass(before) {
            break;
        }
        place -= 1;
    }
    if place > 0 && out[place - 1].kind == KIND {
        return;
    }
    // The state it was claimed from: where the last move before it left it.
    let from = out[..place]
        .iter()
        .rev()
        .find(|e| e.to_state.is_some() && e.from_state != e.to_state)
        .and_then(|e| e.to_state)
        .unwrap_or(RecordState::Pending);
    let claim = Event {
        id,
        record_id,
        at,
        kind: KIND.to_owned(),
        actor,
        audit: false,
        from_state: Some(from),
        to_state: Some(RecordState::Running),
        step: None,
        reason: None,
        detail: None,
    };
    out.insert(place, claim);
}

#[cfg(test)]
mod tests {
    use super::*;
    use RecordState::*;
    use proptest::prelude::*;

    fn ev(id: i64, kind: &str, actor: &str, from: Option<RecordState>, to: RecordState) -> Event {
        Event {
            id,
            ..row(kind, actor.to_owned(), id * 10, from, Some(to))
        }
    }

    fn claimed(at: UnixMs) -> Option<Folded> {
        Some(Folded { at, by: None })
    }

    fn line(events: &[Event]) -> Vec<(i64, String, String, Option<RecordState>, UnixMs)> {
        events
            .iter()
            .map(|e| (e.id, e.kind.clone(), e.actor.clone(), e.from_state, e.at))
            .collect()
    }

    #[test]
    fn each_folded_claim_comes_back_before_the_event_that_ended_its_pass() {
        let out = unfold(
            7,
            vec![
                (ev(1, "created", "system", None, Pending), None),
                (
                    ev(2, "retry_scheduled", "node:a", Some(Running), Retrying),
                    claimed(15),
                ),
                (
                    ev(3, "lease_expired", "node:b", Some(Running), Pending),
                    Some(Folded {
                        at: 25,
                        by: Some("a".into()),
                    }),
                ),
                (
                    ev(4, "completed", "node:b", Some(Running), Succeeded),
                    claimed(35),
                ),
            ],
            None,
        );
        let s = |v: &str| v.to_owned();
        assert_eq!(
            line(&out),
            vec![
                (1, s("created"), s("system"), None, 10),
                (2, s("claimed"), s("node:a"), Some(Pending), 15),
                (2, s("retry_scheduled"), s("node:a"), Some(Running), 20),
                (3, s("claimed"), s("node:a"), Some(Retrying), 25),
                (3, s("lease_expired"), s("node:b"), Some(Running), 30),
                (4, s("claimed"), s("node:b"), Some(Pending), 35),
                (4, s("completed"), s("node:b"), Some(Running), 40),
            ]
        );
        assert!(
            out.iter()
                .filter(|e| e.kind == KIND)
                .all(|e| e.to_state == Some(Running))
        );
    }

    #[test]
    fn the_pass_under_way_shows_its_claim_and_stored_claims_are_not_doubled() {
        // An older version wrote its claims as rows; a pass it claimed
        // and the next one lapsed.
        let out = unfold(
            7,
            vec![
                (ev(1, "created", "system", None, Pending), None),
                (ev(2, "claimed", "node:old", Some(Pending), Running), None),
                (
                    ev(3, "lease_expired", "node:new", Some(Running), Pending),
                    Some(Folded {
                        at: 20,
                        by: Some("old".into()),
                    }),
                ),
            ],
            Some(("new", 33)),
        );
        let kinds: Vec<(&str, &str)> = out
            .iter()
            .map(|e| (e.kind.as_str(), e.actor.as_str()))
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("created", "system"),
                ("claimed", "node:old"),
                ("lease_expired", "node:new"),
                ("claimed", "node:new"),
            ]
        );
        assert_eq!(out[3].at, 33);
        assert_eq!(out[3].from_state, Some(Pending));
        // Nothing under way and nothing folded: the events as stored.
        let plain = vec![(ev(1, "created", "system", None, Pending), None)];
        assert_eq!(unfold(7, plain, None).len(), 1);
    }

    #[test]
    fn a_claim_goes_before_what_its_pass_wrote_and_is_shown_once() {
        let mut unconfirmed = ev(3, "unconfirmed", "system", None, Pending);
        unconfirmed.to_state = None;
        let out = unfold(
            7,
            vec![
                (ev(1, "created", "system", None, Pending), None),
                // Written while the pass claimed at 15 ran.
                (ev(2, "reversed", "system", Some(Running), Running), None),
                (unconfirmed, None),
                (
                    ev(4, "completed", "node:a", Some(Running), Succeeded),
                    claimed(15),
                ),
            ],
            // Read before the pass ended: the lease is that same pass's.
            Some(("a", 15)),
        );
        let got: Vec<(&str, i64, Option<RecordState>)> = out
            .iter()
            .map(|e| (e.kind.as_str(), e.at, e.from_state))
            .collect();
        assert_eq!(
            got,
            vec![
                ("created", 10, None),
                ("claimed", 15, Some(Pending)),
                ("reversed", 20, Some(Running)),
                ("unconfirmed", 30, None),
                ("completed", 40, Some(Running)),
            ]
        );
        // A pass whose end came before the claim by the clock (nodes'
        // clocks differ) still stays within its own pass.
        let out = unfold(
            7,
            vec![
                (ev(1, "created", "system", None, Pending), None),
                (
                    ev(2, "retry_scheduled", "node:a", Some(Running), Retrying),
                    claimed(5),
                ),
                (
                    ev(3, "completed", "node:b", Some(Running), Succeeded),
                    claimed(12),
                ),
            ],
            None,
        );
        let kinds: Vec<&str> = out.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(
            kinds,
            vec![
                "created",
                "claimed",
                "retry_scheduled",
                "claimed",
                "completed"
            ]
        );
        assert_eq!(out[3].from_state, Some(Retrying));
        // No event read at all: the pass under way still shows.
        let alone = unfold(7, Vec::new(), Some(("a", 3)));
        assert_eq!(alone.len(), 1);
        assert_eq!(
            (alone[0].record_id, alone[0].actor.as_str()),
            (Some(7), "node:a")
        );
    }

    /// How a generated pass ends.
    #[derive(Debug, Clone, Copy)]
    enum End {
        Worked(RecordState),
        Released,
        /// Its lease runs out; the next pass's claim finds it.
        Lapsed,
    }

    fn any_pass() -> impl Strategy<Value = Pass> {
        let end = prop_oneof![
            proptest::sample::select(vec![Pending, Retrying, Waiting, Succeeded, Failed, Parked])
                .prop_map(End::Worked),
            Just(End::Released),
            Just(End::Lapsed),
        ];
        (
            0u8..3,
            0i64..50,
            any::<bool>(),
            any::<bool>(),
            end,
            1i64..50,
        )
    }

    fn row(
        kind: &str,
        actor: String,
        at: i64,
        from: Option<RecordState>,
        to: Option<RecordState>,
    ) -> Event {
        Event {
            id: 0,
            record_id: Some(7),
            at,
            kind: kind.to_owned(),
            actor,
            audit: false,
            from_state: from,
            to_state: to,
            step: None,
            reason: None,
            detail: None,
        }
    }

    type Shown = Vec<(
        String,
        String,
        i64,
        Option<RecordState>,
        Option<RecordState>,
    )>;

    fn shown(events: &[Event]) -> Shown {
        events
            .iter()
            .map(|e| {
                (
                    e.kind.clone(),
                    e.actor.clone(),
                    e.at,
                    e.from_state,
                    e.to_state,
                )
            })
            .collect()
    }

    /// A generated pass: node, gap before its claim, a recorded reversal,
    /// an unconfirmed result, its end, its length.
    type Pass = (u8, i64, bool, bool, End, i64);

    /// The history as stored with claim rows, the same with each claim
    /// folded, and the pass under way (its node and claim time).
    type BothWays = (
        Vec<Event>,
        Vec<(Event, Option<Folded>)>,
        Option<(String, UnixMs)>,
    );

    /// A record's passes written both ways: with a `claimed` row per
    /// claim (as before migration 34) and with each claim folded.
    fn both_ways(passes: &[Pass], under_way: bool) -> BothWays {
        let mut stored = vec![row("created", "system".into(), 0, None, Some(Pending))];
        let mut folded = vec![(stored[0].clone(), None)];
        let (mut now, mut state) = (0, Pending);
        let mut lapsed: Option<(String, i64)> = None;
        let mut current = None;
        for (i, &(node, gap, reversal, unconfirmed, end, length)) in passes.iter().enumerate() {
            let node = format!("n{node}");
            now += gap;
            if let Some((owner, claimed)) = lapsed.take() {
                let expired = row(
                    "lease_expired",
                    node_actor(&node),
                    now,
                    Some(Running),
                    Some(Pending),
                );
                stored.push(expired.clone());
                folded.push((
                    expired,
                    Some(Folded {
                        at: claimed,
                        by: Some(owner),
                    }),
                ));
                state = Pending;
            }
            let claimed = now;
            stored.push(row(
                KIND,
                node_actor(&node),
                claimed,
                Some(state),
                Some(Running),
            ));
            let mut during = Vec::new();
            if reversal {
                now += 1;
                during.push(row(
                    "reversed",
                    "system".into(),
                    now,
                    Some(Running),
                    Some(Running),
                ));
            }
            if unconfirmed {
                now += 1;
                during.push(row("unconfirmed", "system".into(), now, None, None));
            }
            for e in during {
                stored.push(e.clone());
                folded.push((e, None));
            }
            now += length;
            let last = i + 1 == passes.len();
            if last && under_way {
                current = Some((node, claimed));
                break;
            }
            let done = |kind: &str, to| row(kind, node_actor(&node), now, Some(Running), Some(to));
            let ended = match end {
                End::Worked(to) if !last || matches!(to, Succeeded | Failed | Parked) => {
                    done("worked", to)
                }
                End::Worked(_) | End::Released => done("released", Pending),
                End::Lapsed if last => done("released", Pending),
                End::Lapsed => {
                    lapsed = Some((node, claimed));
                    continue;
                }
            };
            state = ended.to_state.unwrap_or(Pending);
            stored.push(ended.clone());
            folded.push((
                ended,
                Some(Folded {
                    at: claimed,
                    by: None,
                }),
            ));
        }
        (stored, folded, current)
    }

    proptest! {
        /// Folding each claim into the event that ended its pass and
        /// unfolding gives back the history as an older version stored it.
        #[test]
        fn unfolding_gives_back_every_claim_where_it_was(
            passes in proptest::collection::vec(any_pass(), 1..8),
            under_way in any::<bool>(),
        ) {
            let (stored, folded, current) = both_ways(&passes, under_way);
            let lease = current.as_ref().map(|(o, at)| (o.as_str(), *at));
            prop_assert_eq!(shown(&unfold(7, folded, lease)), shown(&stored));
        }
    }
}
