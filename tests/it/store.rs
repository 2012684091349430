//! The store conformance suite: every test runs against SQLite
//! (`store::sqlite::*`) and PostgreSQL (`store::postgres::*`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use ballast::domain::breaker::SharedOp;
use ballast::domain::{
    OperatorAction, Outcome, ProviderState, RecordState, Role, Session, StepState, TransitionError,
    WorkResult, idempotency_key,
};
use ballast::store::{
    ActionRequest, AuditFilter, ClaimRequest, Commit, Db, NewAttempt, NewEvent, NewRecord, NewUser,
    NodeBeat, RecordFilter, StepWrite, StoreError, UserChange,
};
use serde_json::json;

/// Generates `sqlite::$name` and `postgres::$name` for each test function.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let t = crate::helpers::TestDb::migrated(ballast::store::Backend::Sqlite, stringify!($name)).await.unwrap();
                    super::$name(&t.db).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(t) = crate::helpers::TestDb::migrated(ballast::store::Backend::Postgres, stringify!($name)).await else { return };
                    super::$name(&t.db).await;
                }
            )*
        }
    };
}

conformance!(
    create_and_read_back,
    create_is_idempotent_on_external_key,
    claim_takes_due_records_in_order,
    concurrent_claimers_never_share_a_record,
    expired_lease_is_reclaimable_and_unexpired_is_not,
    commit_writes_steps_attempts_and_transition,
    a_commit_in_place_writes_what_it_returns,
    new_step_runs_are_inserted_and_a_stored_one_named_new_fails_the_group,
    checkpoint_keeps_the_lease,
    release_gives_work_back_without_spending_attempts,
    extend_leases_reports_what_is_held,
    operator_actions_follow_the_table_and_are_audited,
    parked_records_resume_when_their_condition_holds,
    counters_match_a_recount_after_random_operations,
    list_filters_and_keyset_pagination,
    users_and_sessions,
    the_first_user_is_made_only_while_there_is_none,
    nodes_providers_and_pipelines,
    api_tokens_are_stored_hashed_and_revocable,
    login_failures_are_counted_per_name_and_forgotten,
    a_login_turn_is_claimed_once,
    the_last_enabled_admin_stays_one,
    delivery_ids_are_taken_once,
    rollups_are_replaced_per_node_and_purged,
    rollups_fold_into_hours,
    meta_values_are_set_once,
    batch_enqueue_is_one_transaction_and_idempotent,
    group_commit_writes_each_pass_and_refuses_only_stale_ones,
    a_throttle_pause_is_kept_for_every_node,
    the_cluster_breaker_hands_out_one_probe,
    permits_are_leased_within_the_limit,
    claims_share_the_batch_between_queues,
    priority_orders_a_queue_not_the_share,
    a_group_cap_holds_for_concurrent_claimers,
    replaced_results_are_kept_as_versions,
    confirmations_are_held_and_settled,
    intents_are_written_before_and_closed_with_their_attempts,
    the_oldest_due_record_per_pipeline,
    running_records_are_listed_by_every_filter,
);

/// Confirmations after success (issue 19 item 6): written with a commit,
/// taken when due by one claimer at a time (held until the hold ends),
/// rescheduled or ended only for their own generation.
/// `at_most_once`: calls written down before they leave, in one batch;
/// listed while open; closed by the commit that keeps their attempts, or
/// by `append_attempts` for attempts kept outside one.
async fn intents_are_written_before_and_closed_with_their_attempts(db: &Db) {
    use ballast::store::NewIntent;
    let mut recs = Vec::new();
    for k in ["a", "b"] {
        recs.push(
            db.create_record(new_record("p", Some(k), T0), T0)
                .await
                .unwrap()
                .record,
        );
    }
    let held = db.claim_due(&claim("w", T0, 2)).await.unwrap();
    let lease = |rec: i64| held.iter().find(|x| x.id == rec).unwrap().lease().unwrap();
    let intent = |rec: i64, n: i32| NewIntent {
        lease: lease(rec),
        record_id: rec,
        step: "charge".into(),
        provider: Some("acme".into()),
        attempt_no: n,
        node: Some("n1".into()),
        sent_at: T0 + i64::from(n),
        request: Some(ballast::domain::request::SentRequest {
            method: "POST".into(),
            url: "https://acme.example/v1/charge".into(),
            headers: vec![("Idempotency-Key".into(), format!("k-{rec}-{n}"))],
            body: Some(format!(r#"{{"n": {n}}}"#)),
        }),
    };
    // A worker that no longer holds the lease writes nothing (and so must
    // not call): one with a stale token in the same batch.
    // What a watching page asks: a call written down changes it, though
    // the record's row is untouched.
    let before = db.record_version(recs[0].id).await.unwrap().unwrap();
    assert_eq!(db.record_version(i64::MAX).await.unwrap(), None);
    let mut stale = intent(recs[1].id, 2);
    stale.lease.token -= 1;
    let batch = vec![
        intent(recs[0].id, 1),
        intent(recs[1].id, 1),
        intent(recs[0].id, 2),
        stale,
    ];
    let written = db.record_intents(&batch).await.unwrap();
    assert!(
        matches!(written[3], Err(StoreError::LeaseLost { .. })),
        "{:?}",
        written[3]
    );
    let ids: Vec<i64> = written[..3].iter().map(|r| *r.as_ref().unwrap()).collect();
    assert_eq!(ids.len(), 3);
    let after = db.record_version(recs[0].id).await.unwrap().unwrap();
    assert_eq!(after[..2], before[..2], "the row is as it was");
    assert_eq!(after[4], ids[0].max(ids[2]), "{before:?} {after:?}");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 3);
    let open = db.open_intents(recs[0].id).await.unwrap();
    assert_eq!(
        open.iter()
            .map(|i| (i.id, i.attempt_no))
            .collect::<Vec<_>>(),
        vec![(ids[0], 1), (ids[2], 2)]
    );
    assert_eq!(open[1].request, batch[2].request, "the request is kept");
    // Which providers have calls left open (a node reads them whatever its
    // own configuration says).
    assert_eq!(db.intent_providers().await.unwrap(), ["acme"]);
    assert_eq!(
        (open[1].sent_at, open[1].node.as_deref()),
        (T0 + 2, Some("n1"))
    );
    // Two passes of one record asking for the same call in one batch (the
    // first's lease ran out and the record was claimed again): only the
    // holder of the lease gets the row, in either order.
    for fresh_first in [true, false] {
        let n = if fresh_first { 3 } else { 4 };
        let fresh = intent(recs[1].id, n);
        let mut stale = intent(recs[1].id, n);
        stale.lease.token -= 1;
        let batch = if fresh_first {
            vec![fresh, stale]
        } else {
            vec![stale, fresh]
        };
        let written = db.record_intents(&batch).await.unwrap();
        let (f, st) = if fresh_first { (0, 1) } else { (1, 0) };
        assert!(
            matches!(written[st], Err(StoreError::LeaseLost { .. })),
            "{written:?}"
        );
        let id = *written[f].as_ref().unwrap();
        db.append_attempts(recs[1].id, &[], &[id]).await.unwrap();
    }
    // A commit keeps the attempt and closes its intent, in one transaction.
    let mut c = Commit::new(lease(recs[0].id), T0 + 5, None);
    c.intents_done = vec![ids[0]];
    db.commit(&c).await.unwrap();
    let open = db.open_intents(recs[0].id).await.unwrap();
    assert_eq!(open.iter().map(|i| i.id).collect::<Vec<_>>(), vec![ids[2]]);
    // Attempts kept outside a commit (a pass that lost its lease) close
    // theirs with them.
    db.append_attempts(recs[0].id, &[], &[ids[2], ids[1]])
        .await
        .unwrap();
    assert!(db.open_intents(recs[0].id).await.unwrap().is_empty());
    assert!(db.open_intents(recs[1].id).await.unwrap().is_empty());
    assert!(db.intent_providers().await.unwrap().is_empty());
    assert!(db.record_intents(&[]).await.unwrap().is_empty());
}

async fn confirmations_are_held_and_settled(db: &Db) {
    use ballast::domain::confirm::Pending;
    let rec = db
        .create_record(new_record("p", Some("c"), T0), T0)
        .await
        .unwrap()
        .record;
    let r = db.claim_due(&claim("w", T0, 1)).await.unwrap().remove(0);
    let mut step = StepWrite::pending("render");
    step.state = StepState::Succeeded;
    step.output = Some(json!({ "ok": true }));
    let mut c = Commit::new(r.lease().unwrap(), T0, Some(WorkResult::Completed));
    c.steps = vec![step];
    let first = Pending {
        record_id: rec.id,
        step: "render".into(),
        generation: 0,
        due_at: T0 + 30_000,
        remaining: 2,
        tries: 0,
    };
    c.confirms = vec![first.clone()];
    db.commit(&c).await.unwrap();
    assert!(
        db.claim_confirmations(T0 + 29_999, 10, T0 + 99_000)
            .await
            .unwrap()
            .is_empty()
    );
    // Six claimers at once: one gets it.
    let claims = (0..6).map(|_| db.claim_confirmations(T0 + 30_000, 10, T0 + 90_000));
    let got: Vec<Vec<Pending>> = futures_util::future::join_all(claims)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got.iter().map(Vec::len).sum::<usize>(), 1, "{got:?}");
    assert_eq!(got.concat()[0], first);
    // Held until the hold ends, then due again (a node that died asking).
    assert!(
        db.claim_confirmations(T0 + 89_999, 10, T0 + 99_000)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        db.claim_confirmations(T0 + 90_000, 10, T0 + 95_000)
            .await
            .unwrap()
            .len(),
        1
    );
    // Settling another generation's confirmation changes nothing.
    db.settle_confirmation(rec.id, "render", 1, None)
        .await
        .unwrap();
    let next = Pending {
        due_at: T0 + 120_000,
        remaining: 1,
        ..first.clone()
    };
    db.settle_confirmation(rec.id, "render", 0, Some(&next))
        .await
        .unwrap();
    assert!(
        db.claim_confirmations(T0 + 119_999, 10, T0 + 200_000)
            .await
            .unwrap()
            .is_empty()
    );
    let again = db
        .claim_confirmations(T0 + 120_000, 10, T0 + 200_000)
        .await
        .unwrap();
    assert_eq!((again[0].remaining, again[0].due_at), (1, T0 + 120_000));
    db.settle_confirmation(rec.id, "render", 0, None)
        .await
        .unwrap();
    assert!(
        db.claim_confirmations(T0 + 999_999, 10, T0 + 1_999_999)
            .await
            .unwrap()
            .is_empty()
    );
}

/// Results keep their history (issue 19 item 5): a replay, an operator's
/// retry of a step whose result its provider reversed, and a rerun after a
/// reversal each start a new generation, and the result they replace is
/// kept with what made it and what replaced it; a resume keeps the result.
async fn replaced_results_are_kept_as_versions(db: &Db) {
    use ballast::domain::ReversalPolicy;
    use ballast::store::ReverseRequest;
    let rec = db
        .create_record(new_record("p", Some("v"), T0), T0)
        .await
        .unwrap()
        .record;
    // Runs the record to success with `render` giving `output`.
    let succeed = |now: i64, generation: i32, output: serde_json::Value| async move {
        let r = db.claim_due(&claim("w", now, 1)).await.unwrap().remove(0);
        let mut step = StepWrite::pending("render");
        step.state = StepState::Succeeded;
        step.generation = generation;
        step.output = Some(output);
        step.finished_at = Some(now);
        let mut c = Commit::new(r.lease().unwrap(), now, Some(WorkResult::Completed));
        c.steps = vec![step];
        assert_eq!(db.commit(&c).await.unwrap().state, RecordState::Succeeded);
    };
    let reverse = |now: i64, policy: ReversalPolicy| ReverseRequest {
        record_id: rec.id,
        step: "render".into(),
        policy,
        reason: "provider reversed".into(),
        detail: None,
        now,
        steps: vec!["render".into()],
        generation: None,
    };
    succeed(T0, 0, json!({ "url": "a" })).await;
    assert!(
        db.step_versions(rec.id).await.unwrap().is_empty(),
        "nothing replaced yet"
    );
    let mut replay = action(rec.id, OperatorAction::ReplayFrom, T0 + 1);
    replay.steps = vec!["render".into()];
    db.act(&replay).await.unwrap();
    let step = db.step_runs(rec.id).await.unwrap().remove(0);
    assert_eq!(
        (step.generation, step.output.clone(), step.cause.as_deref()),
        (1, None, Some("replay by alice"))
    );
    succeed(T0 + 2, 1, json!({ "url": "b" })).await;
    // Reversed and parked: the result stays (marked); a resume would keep
    // it, a retry runs the step again.
    assert_eq!(
        db.reverse(&reverse(T0 + 3, ReversalPolicy::Park))
            .await
            .unwrap()
            .state,
        RecordState::Parked
    );
    let step = db.step_runs(rec.id).await.unwrap().remove(0);
    assert_eq!(
        (step.state, step.error_code.as_deref(), step.output.clone()),
        (
            StepState::Succeeded,
            Some(ballast::domain::REVERSED),
            Some(json!({ "url": "b" }))
        )
    );
    let mut retry = action(rec.id, OperatorAction::Retry, T0 + 4);
    retry.actor = "bob".into();
    db.act(&retry).await.unwrap();
    let step = db.step_runs(rec.id).await.unwrap().remove(0);
    assert_eq!(
        (step.generation, step.state, step.cause.as_deref()),
        (2, StepState::Pending, Some("retry by bob"))
    );
    succeed(T0 + 5, 2, json!({ "url": "c" })).await;
    assert_eq!(
        db.reverse(&reverse(T0 + 6, ReversalPolicy::Rerun))
            .await
            .unwrap()
            .state,
        RecordState::Pending
    );
    succeed(T0 + 7, 3, json!({ "url": "d" })).await;
    // A reversal of a generation since replaced changes nothing.
    let mut stale = reverse(T0 + 8, ReversalPolicy::Rerun);
    stale.generation = Some(2);
    assert_eq!(
        db.reverse(&stale).await.unwrap().state,
        RecordState::Succeeded
    );
    assert_eq!(db.step_runs(rec.id).await.unwrap()[0].generation, 3);

    let kept = db.step_versions(rec.id).await.unwrap();
    let seen: Vec<_> = kept
        .iter()
        .map(|v| {
            (
                v.generation,
                v.output.clone(),
                v.cause.clone(),
                v.replaced_at,
                v.replaced_by.as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                0,
                Some(json!({ "url": "a" })),
                None,
                T0 + 1,
                "replay by alice"
            ),
            (
                1,
                Some(json!({ "url": "b" })),
                Some("replay by alice".into()),
                T0 + 4,
                "retry by bob"
            ),
            (
                2,
                Some(json!({ "url": "c" })),
                Some("retry by bob".into()),
                T0 + 6,
                "rerun after reversal"
            ),
        ]
    );
    assert!(kept.iter().all(|v| v.state == StepState::Succeeded));
    let step = db.step_runs(rec.id).await.unwrap().remove(0);
    assert_eq!(
        (step.generation, step.output, step.cause.as_deref()),
        (3, Some(json!({ "url": "d" })), Some("rerun after reversal"))
    );
    assert_counts_consistent(db).await;
}

/// A provider's limits leased for the cluster: the permits granted in a
/// window never exceed its count, however many requests arrive at once; a
/// closed grant shrinks to what it used (an unused one frees its permits at
/// once) and frees its window a window after its last call; a grant whose
/// node died lapses; slots are shared out, and a node that waits gets its
/// share as the holder's calls finish.
async fn permits_are_leased_within_the_limit(db: &Db) {
    use ballast::domain::permits::Granted;
    use ballast::domain::permits::SlotAsk;
    use ballast::store::{PermitRequest, SlotRequest};
    let ask = |node: &str, now: i64| PermitRequest {
        provider: "acme".into(),
        node: node.into(),
        now,
        lapse_ms: 1_000,
        live_nodes: 1,
        windows: vec![(1_000, 10, 100)],
        ..Default::default()
    };
    let granted = |p: &ballast::store::Permits| match p.windows[0] {
        (_, Some(id), Granted::Permits { count, .. }) => Some((id, count)),
        _ => None,
    };
    let requests: Vec<PermitRequest> = (0..8)
        .map(|i| ask(if i % 2 == 0 { "a" } else { "b" }, T0))
        .collect();
    let asks = requests.iter().map(|r| db.lease_permits(r));
    let answers: Vec<_> = futures_util::future::join_all(asks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let grants: Vec<(i64, i64)> = answers.iter().filter_map(granted).collect();
    assert_eq!(
        grants.iter().map(|g| g.1).sum::<i64>(),
        10,
        "the window's count, in batches of a quarter: {answers:?}"
    );
    assert!(grants.iter().all(|g| g.1 == 2));
    for full in answers.iter().filter(|p| granted(p).is_none()) {
        assert!(matches!(full.windows[0].2, Granted::Full { retry_at } if retry_at > T0));
    }
    let owner = |id: i64| {
        let i = answers
            .iter()
            .position(|p| granted(p).map(|g| g.0) == Some(id))
            .unwrap();
        if i % 2 == 0 { "a" } else { "b" }
    };
    let (unused, half) = (grants[0].0, grants[1].0);
    let mut close = ask(owner(unused), T0 + 10);
    close.close = vec![(unused, 0, T0)];
    let p = db.lease_permits(&close).await.unwrap();
    assert_eq!(
        granted(&p).map(|g| g.1),
        Some(2),
        "an unused grant frees its permits at once"
    );
    let mut close = ask(owner(half), T0 + 60);
    close.close = vec![(half, 1, T0 + 50)];
    let p = db.lease_permits(&close).await.unwrap();
    assert_eq!(
        granted(&p).map(|g| g.1),
        Some(1),
        "a grant closed with one used frees the other"
    );
    let p = db.lease_permits(&ask("a", T0 + 1_049)).await.unwrap();
    assert!(
        granted(&p).is_none(),
        "its used permit occupies the window until a window after its call"
    );
    let p = db.lease_permits(&ask("a", T0 + 1_050)).await.unwrap();
    assert_eq!(granted(&p).map(|g| g.1), Some(1));
    // Nobody closes the rest (their nodes died): they lapse after their
    // life (100 ms), the longest call (1 s) and a window.
    let p = db.lease_permits(&ask("c", T0 + 2_099)).await.unwrap();
    assert!(granted(&p).is_none());
    let p = db.lease_permits(&ask("c", T0 + 3_200)).await.unwrap();
    assert_eq!(granted(&p).map(|g| g.1), Some(2));

    let slots = |node: &str, need: i64, in_use: i64, now: i64| PermitRequest {
        provider: "acme".into(),
        node: node.into(),
        now,
        lapse_ms: 1_000,
        live_nodes: 2,
        slots: Some(SlotRequest {
            ask: SlotAsk {
                cap: 4,
                need,
                in_use,
                headroom: true,
            },
            hold_ms: 10_000,
        }),
        ..Default::default()
    };
    let held = async |r: PermitRequest| db.lease_permits(&r).await.unwrap().slots.unwrap().0.target;
    assert_eq!(held(slots("a", 4, 0, T0)).await, 4, "a takes the cap");
    assert_eq!(held(slots("b", 4, 0, T0 + 1)).await, 0, "b waits");
    assert_eq!(
        held(slots("a", 4, 4, T0 + 2)).await,
        2,
        "b waits: a is told to come down to half (its four calls in flight stay counted)"
    );
    assert_eq!(
        held(slots("b", 4, 0, T0 + 2)).await,
        0,
        "nothing for b until a's calls end"
    );
    assert_eq!(
        held(slots("a", 4, 1, T0 + 3)).await,
        2,
        "b is waiting: a comes down to half as its calls end"
    );
    assert_eq!(held(slots("b", 4, 0, T0 + 4)).await, 2, "b gets its half");
    // a's holding lapses unrenewed (its node died): b may take the cap.
    assert_eq!(held(slots("b", 4, 2, T0 + 11_004)).await, 4);
}

/// The cluster's breaker, changed under its row's lock: nodes asking for
/// probes at once get exactly `probes` of them; a probe's answer closes it
/// for everyone; the pause and throttle columns are left alone; the window
/// figures are kept with a trip.
async fn the_cluster_breaker_hands_out_one_probe(db: &Db) {
    use ballast::domain::BreakerState;
    use ballast::domain::breaker::ProbeGrant;
    db.set_provider_pause("acme", true, "alice", None, T0)
        .await
        .unwrap();
    db.throttle_provider("acme", T0 + 500, T0).await.unwrap();
    let figures = json!({ "calls": 20, "failures": 12, "slow": 0 });
    let (s, grant) = db
        .breaker_op(
            "acme",
            SharedOp::Open { until: T0 + 1_000 },
            Some(&figures),
            T0,
        )
        .await
        .unwrap();
    assert_eq!(
        (s.state, s.open_until, grant),
        (BreakerState::Open, Some(T0 + 1_000), None)
    );
    let claim = SharedOp::ClaimProbe {
        probes: 1,
        lost_after: 10_000,
    };
    let (_, early) = db.breaker_op("acme", claim, None, T0 + 999).await.unwrap();
    assert_eq!(early, Some(ProbeGrant::Wait(T0 + 1_000)));
    // Eight nodes ask at once: one probe in the cluster.
    let asks = (0..8).map(|_| db.breaker_op("acme", claim, None, T0 + 1_000));
    let grants: Vec<_> = futures_util::future::join_all(asks)
        .await
        .into_iter()
        .map(|r| r.unwrap().1.unwrap())
        .collect();
    let probes: Vec<_> = grants
        .iter()
        .filter_map(|g| match g {
            ProbeGrant::Probe { round } => Some(*round),
            _ => None,
        })
        .collect();
    assert_eq!(probes.len(), 1, "{grants:?}");
    let stored = db.provider_state("acme").await.unwrap().unwrap();
    assert_eq!(stored.breaker, BreakerState::HalfOpen);
    assert_eq!(stored.stats, Some(figures), "the trip's figures are shown");
    assert!(stored.paused, "the operator's pause stays");
    assert_eq!(stored.throttled_until, Some(T0 + 500));
    let answer = SharedOp::Probed {
        ok: true,
        probes: 1,
        open_for: 1_000,
        round: probes[0],
    };
    let (s, _) = db
        .breaker_op("acme", answer, None, T0 + 1_100)
        .await
        .unwrap();
    assert_eq!((s.state, s.changed_at), (BreakerState::Closed, T0 + 1_100));
    let (_, after) = db
        .breaker_op("acme", claim, None, T0 + 1_101)
        .await
        .unwrap();
    assert_eq!(after, Some(ProbeGrant::Closed));
    let kept = db.provider_state("acme").await.unwrap().unwrap();
    assert_eq!(
        (kept.breaker, kept.open_until),
        (BreakerState::Closed, None)
    );
}

/// A provider's "slow down" pause is kept for every node: the later of two
/// wins whatever the order they are published in, and neither an operator's
/// pause nor a breaker update undoes it.
async fn a_throttle_pause_is_kept_for_every_node(db: &Db) {
    db.throttle_provider("acme", T0 + 5_000, T0).await.unwrap();
    let s = db.provider_state("acme").await.unwrap().unwrap();
    assert_eq!(s.throttled_until, Some(T0 + 5_000));
    assert_eq!(s.breaker, ballast::domain::BreakerState::Closed);
    assert!(!s.paused);
    db.throttle_provider("acme", T0 + 2_000, T0 + 1)
        .await
        .unwrap();
    let s = db.provider_state("acme").await.unwrap().unwrap();
    assert_eq!(
        s.throttled_until,
        Some(T0 + 5_000),
        "an earlier end does not shorten it"
    );
    db.throttle_provider("acme", T0 + 9_000, T0 + 2)
        .await
        .unwrap();
    db.set_provider_pause("acme", true, "alice", Some("maintenance"), T0 + 3)
        .await
        .unwrap();
    db.breaker_op("acme", SharedOp::Open { until: T0 + 60_000 }, None, T0 + 4)
        .await
        .unwrap();
    let s = db.provider_state("acme").await.unwrap().unwrap();
    assert_eq!(
        s.throttled_until,
        Some(T0 + 9_000),
        "a later one extends it"
    );
    assert!(s.paused, "the pause columns are apart");
    let all = db.provider_states().await.unwrap();
    assert_eq!(
        all.iter().map(|p| p.throttled_until).collect::<Vec<_>>(),
        [Some(T0 + 9_000)]
    );
}

const T0: i64 = 1_800_000_000_000;

fn new_record(pipeline: &str, key: Option<&str>, run_at: i64) -> NewRecord {
    NewRecord {
        pipeline: pipeline.to_owned(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: key.map(str::to_owned),
        input: json!({ "key": key, "n": 1 }),
        run_at,
    }
}

fn claim(owner: &str, now: i64, limit: u32) -> ClaimRequest {
    ClaimRequest {
        owner: owner.to_owned(),
        now,
        lease: Duration::from_secs(30),
        limit,
        group_caps: Vec::new(),
    }
}

async fn assert_counts_consistent(db: &Db) {
    assert_eq!(
        db.state_counts().await.unwrap(),
        db.recount_states().await.unwrap()
    );
    assert_eq!(
        db.provider_counts().await.unwrap(),
        db.recount_providers().await.unwrap(),
        "per-provider counters"
    );
    let sorted = |mut v: Vec<ballast::domain::GroupCount>| {
        v.sort();
        v
    };
    assert_eq!(
        sorted(db.group_counts().await.unwrap()),
        sorted(db.recount_groups().await.unwrap()),
        "per-group counters"
    );
}

async fn create_and_read_back(db: &Db) {
    let c = db
        .create_record(new_record("p", Some("k1"), T0), T0)
        .await
        .unwrap();
    assert!(c.created);
    let r = db.get_record(c.record.id).await.unwrap().unwrap();
    assert_eq!(r, c.record);
    assert_eq!(r.state, RecordState::Pending);
    assert_eq!(r.input, json!({ "key": "k1", "n": 1 }));
    assert_eq!(r.next_run_at, Some(T0));
    assert!(db.get_record(r.id + 1000).await.unwrap().is_none());
    let events = db.record_events(r.id).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(
        (events[0].kind.as_str(), events[0].to_state),
        ("created", Some(RecordState::Pending))
    );
    let counts = db.state_counts().await.unwrap();
    assert_eq!(counts.len(), 1);
    assert_eq!(
        (
            counts[0].pipeline.as_str(),
            counts[0].state,
            counts[0].count
        ),
        ("p", RecordState::Pending, 1)
    );
    db.ping().await.unwrap();
}

async fn create_is_idempotent_on_external_key(db: &Db) {
    let a = db
        .create_record(new_record("p", Some("same"), T0), T0)
        .await
        .unwrap();
    let mut again = new_record("p", Some("same"), T0 + 5);
    again.input = json!({ "different": true });
    let b = db.create_record(again, T0 + 5).await.unwrap();
    assert!(a.created && !b.created);
    assert_eq!(
        a.record, b.record,
        "the repeat returns the first record unchanged"
    );
    // The key is per pipeline, and records without a key never collide.
    let other = db
        .create_record(new_record("q", Some("same"), T0), T0)
        .await
        .unwrap();
    assert!(other.created);
    let n1 = db
        .create_record(new_record("p", None, T0), T0)
        .await
        .unwrap();
    let n2 = db
        .create_record(new_record("p", None, T0), T0)
        .await
        .unwrap();
    assert!(n1.created && n2.created && n1.record.id != n2.record.id);
    assert_eq!(db.record_events(a.record.id).await.unwrap().len(), 1);
    assert_counts_consistent(db).await;
    let total: i64 = db
        .state_counts()
        .await
        .unwrap()
        .iter()
        .map(|c| c.count)
        .sum();
    assert_eq!(total, 4);
}

async fn claim_takes_due_records_in_order(db: &Db) {
    let late = db
        .create_record(new_record("p", Some("late"), T0 + 20), T0)
        .await
        .unwrap()
        .record;
    let early = db
        .create_record(new_record("p", Some("early"), T0 + 10), T0)
        .await
        .unwrap()
        .record;
    let future = db
        .create_record(new_record("p", Some("future"), T0 + 10_000), T0)
        .await
        .unwrap()
        .record;
    let got = db.claim_due(&claim("w1", T0 + 100, 10)).await.unwrap();
    assert_eq!(
        got.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![early.id, late.id]
    );
    for r in &got {
        assert_eq!(r.state, RecordState::Running);
        assert_eq!(r.lease_owner.as_deref(), Some("w1"));
        assert_eq!(r.lease_until, Some(T0 + 100 + 30_000));
        assert_eq!(r.lease_token, 1);
    }
    assert!(
        db.claim_due(&claim("w2", T0 + 100, 10))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        db.get_record(future.id).await.unwrap().unwrap().state,
        RecordState::Pending
    );
    // The limit is honoured.
    for i in 0..5 {
        db.create_record(new_record("p", Some(&format!("b{i}")), T0), T0)
            .await
            .unwrap();
    }
    assert_eq!(
        db.claim_due(&claim("w3", T0 + 100, 3)).await.unwrap().len(),
        3
    );
    let kinds = crate::helpers::event_kinds(db, early.id).await;
    assert_eq!(kinds, vec!["created", "claimed"]);
    assert_counts_consistent(db).await;
}

fn grouped(pipeline: &str, group: Option<&str>, key: String, run_at: i64) -> NewRecord {
    NewRecord {
        group: group.map(str::to_owned),
        ..new_record(pipeline, Some(&key), run_at)
    }
}

/// Claims share their batch between the (pipeline, group) queues with due
/// work: a backlog enqueued first in one queue does not hold back records
/// of another, and each queue hands out its oldest first.
async fn claims_share_the_batch_between_queues(db: &Db) {
    let x: Vec<NewRecord> = (0..200)
        .map(|i| grouped("p", Some("x"), format!("x{i}"), T0))
        .collect();
    db.create_records(x, T0).await.unwrap();
    let y: Vec<NewRecord> = (0..10)
        .map(|i| grouped("p", Some("y"), format!("y{i}"), T0 + 1))
        .collect();
    db.create_records(y, T0).await.unwrap();
    let q: Vec<NewRecord> = (0..6)
        .map(|i| grouped("q", None, format!("q{i}"), T0 + 2))
        .collect();
    db.create_records(q, T0).await.unwrap();
    // A fourth group whose only record is finished: no queue, no share.
    let done = db
        .create_record(grouped("p", Some("z"), "z0".into(), T0), T0)
        .await
        .unwrap()
        .record;
    db.act(&ActionRequest {
        record_id: done.id,
        action: OperatorAction::Cancel,
        actor: "test".into(),
        reason: Some("done".into()),
        now: T0,
        steps: Vec::new(),
        until: None,
        took: None,
        input: None,
        repin: None,
        failed_items: false,
        signal: None,
    })
    .await
    .unwrap();
    let queue = |r: &ballast::domain::Record| {
        format!("{}/{}", r.pipeline, r.group.as_deref().unwrap_or(""))
    };
    let got = db.claim_due(&claim("w1", T0 + 100, 12)).await.unwrap();
    let names: Vec<String> = got.iter().map(queue).collect();
    for name in ["p/x", "p/y", "q/"] {
        assert_eq!(
            names.iter().filter(|n| *n == name).count(),
            4,
            "an even share for {name}: {names:?}"
        );
    }
    // Handed out round robin, each queue oldest first.
    let first: HashSet<&String> = names[..3].iter().collect();
    assert_eq!(first.len(), 3, "one of each queue first: {names:?}");
    let xs: Vec<&str> = got
        .iter()
        .filter(|r| r.group.as_deref() == Some("x"))
        .map(|r| r.external_key.as_deref().unwrap())
        .collect();
    assert_eq!(xs, vec!["x0", "x1", "x2", "x3"]);
    // The short queues give all they have; the backlog gives its share at least.
    let got = db.claim_due(&claim("w1", T0 + 100, 30)).await.unwrap();
    let names: Vec<String> = got.iter().map(queue).collect();
    assert_eq!(names.iter().filter(|n| *n == "p/y").count(), 6, "{names:?}");
    assert_eq!(names.iter().filter(|n| *n == "q/").count(), 2, "{names:?}");
    assert!(
        names.iter().filter(|n| *n == "p/x").count() >= 10,
        "{names:?}"
    );
    // Nothing due before its time, whatever its queue.
    db.create_record(grouped("q", Some("later"), "l0".into(), T0 + 10_000), T0)
        .await
        .unwrap();
    let next = db.claim_due(&claim("w1", T0 + 100, 500)).await.unwrap();
    assert!(next.iter().all(|r| r.group.as_deref() == Some("x")));
    assert!(!next.is_empty());
    assert!(
        db.claim_due(&claim("w1", T0 + 100, 500))
            .await
            .unwrap()
            .is_empty(),
        "the rest of the backlog went in one claim"
    );
    assert_eq!(db.next_due_at().await.unwrap(), Some(T0 + 10_000));
    assert_counts_consistent(db).await;
}

/// Priority (issue 50 item 6): within a (pipeline, group) queue a claim
/// takes the highest priority first, then the oldest due; the share
/// between queues does not change (a queue of urgent records takes no
/// more than its share from another); records not yet due wait whatever
/// their priority; a filter finds a priority.
async fn priority_orders_a_queue_not_the_share(db: &Db) {
    let at = |group: &str, key: String, run_at: i64, priority: u8| NewRecord {
        priority,
        ..grouped("p", Some(group), key, run_at)
    };
    // Queue p/x: an old backlog at the default, newer urgent records, a
    // few at the lowest, and urgent ones not yet due.
    let mut x: Vec<NewRecord> = (0..40).map(|i| at("x", format!("x{i}"), T0, 5)).collect();
    x.extend((0..5).map(|i| at("x", format!("hi{i}"), T0 + 50 - i, 9)));
    x.extend((0..3).map(|i| at("x", format!("lo{i}"), T0, 0)));
    x.extend((0..30).map(|i| at("x", format!("later{i}"), T0 + 10_000, 9)));
    db.create_records(x, T0).await.unwrap();
    // Queue p/y: its own work, all at the lowest priority.
    let y: Vec<NewRecord> = (0..10)
        .map(|i| at("y", format!("y{i}"), T0 + 1, 0))
        .collect();
    db.create_records(y, T0).await.unwrap();
    let key = |r: &ballast::domain::Record| r.external_key.clone().unwrap();
    let of = |got: &[ballast::domain::Record], g: &str| -> Vec<String> {
        got.iter()
            .filter(|r| r.group.as_deref() == Some(g))
            .map(key)
            .collect()
    };
    let got = db.claim_due(&claim("w1", T0 + 100, 10)).await.unwrap();
    // Half the batch each: x's urgent records first (due order among
    // them), and y's share, low as it is.
    assert_eq!(of(&got, "x"), vec!["hi4", "hi3", "hi2", "hi1", "hi0"]);
    assert_eq!(
        of(&got, "y").len(),
        5,
        "{:?}",
        got.iter().map(key).collect::<Vec<_>>()
    );
    assert!(
        got.iter()
            .filter(|r| r.group.as_deref() == Some("x"))
            .all(|r| r.priority == 9)
    );
    // Then x's backlog at the default, oldest first, before its lowest.
    let got = db.claim_due(&claim("w1", T0 + 100, 10)).await.unwrap();
    assert_eq!(of(&got, "x"), vec!["x0", "x1", "x2", "x3", "x4"]);
    assert_eq!(of(&got, "y").len(), 5);
    let got = db.claim_due(&claim("w1", T0 + 100, 36)).await.unwrap();
    let xs = of(&got, "x");
    assert_eq!(xs.len(), 36);
    assert_eq!(xs[34], "x39");
    assert_eq!(xs[35], "lo0", "the lowest after the rest: {xs:?}");
    let rest = db.claim_due(&claim("w1", T0 + 100, 100)).await.unwrap();
    assert_eq!(rest.iter().map(key).collect::<Vec<_>>(), vec!["lo1", "lo2"]);
    assert!(rest.iter().all(|r| r.priority == 0));
    // Urgent but not due: nothing until its time, then it goes.
    assert!(
        db.claim_due(&claim("w1", T0 + 9_999, 100))
            .await
            .unwrap()
            .is_empty()
    );
    let later = db.claim_due(&claim("w1", T0 + 10_000, 100)).await.unwrap();
    assert_eq!(later.len(), 30);
    // The priority is kept and filtered on.
    let page = db
        .list_records(&ballast::store::RecordFilter {
            priority: Some(0),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut low: Vec<String> = page.items.iter().map(key).collect();
    low.sort();
    let mut want: Vec<String> = (0..3).map(|i| format!("lo{i}")).collect();
    want.extend((0..10).map(|i| format!("y{i}")));
    want.sort();
    assert_eq!(low, want);
    assert_counts_consistent(db).await;
}

/// A pipeline's `group_concurrency`: claims never lease more than the cap
/// of one group at once, however many claimers ask together; a lease that
/// ran out no longer counts (its record is claimed again), and a record
/// given back makes room.
async fn a_group_cap_holds_for_concurrent_claimers(db: &Db) {
    for g in ["x", "y"] {
        let batch: Vec<NewRecord> = (0..40)
            .map(|i| grouped("p", Some(g), format!("{g}{i}"), T0))
            .collect();
        db.create_records(batch, T0).await.unwrap();
    }
    let capped = |owner: &str, now: i64| ClaimRequest {
        group_caps: vec![("p".to_owned(), 3)],
        ..claim(owner, now, 64)
    };
    let mut tasks = Vec::new();
    for w in 0..6 {
        let db = db.clone();
        let req = capped(&format!("w{w}"), T0 + 100);
        tasks.push(tokio::spawn(
            async move { db.claim_due(&req).await.unwrap() },
        ));
    }
    let mut held: Vec<ballast::domain::Record> = Vec::new();
    for t in tasks {
        held.extend(t.await.unwrap());
    }
    for g in ["x", "y"] {
        let n = held
            .iter()
            .filter(|r| r.group.as_deref() == Some(g))
            .count();
        assert_eq!(n, 3, "group {g}: {n} leased at once by 6 claimers");
    }
    assert!(
        db.claim_due(&capped("w9", T0 + 200))
            .await
            .unwrap()
            .is_empty()
    );
    // A record given back makes room for one more of its group.
    let back = held
        .iter()
        .find(|r| r.group.as_deref() == Some("x"))
        .unwrap();
    db.release(&[back.lease().unwrap()], T0 + 300)
        .await
        .unwrap();
    let again = db.claim_due(&capped("w9", T0 + 300)).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].group.as_deref(), Some("x"));
    // Leases that ran out (their node died) do not hold the cap. Every
    // record is leased first (the cap is the request's: uncapped claims
    // take the rest), so what is claimed at `late` can only be a record
    // whose lease ran out.
    let rest = db.claim_due(&claim("w9", T0 + 300, 500)).await.unwrap();
    assert_eq!(rest.len(), 80 - 6);
    let late = T0 + 300 + 30_001;
    let reclaimed = db.claim_due(&capped("w10", late)).await.unwrap();
    for g in ["x", "y"] {
        let n = reclaimed
            .iter()
            .filter(|r| r.group.as_deref() == Some(g))
            .count();
        assert_eq!(n, 3, "group {g} after the leases ran out");
    }
    assert!(
        reclaimed.iter().all(|r| r.lease_token >= 2),
        "each claimed before"
    );
    assert_counts_consistent(db).await;
}

async fn concurrent_claimers_never_share_a_record(db: &Db) {
    const N: usize = 300;
    for i in 0..N {
        db.create_record(new_record("p", Some(&format!("r{i}")), T0), T0)
            .await
            .unwrap();
    }
    let mut tasks = Vec::new();
    for w in 0..4 {
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = db
                    .claim_due(&claim(&format!("w{w}"), T0 + 1, 7))
                    .await
                    .unwrap();
                if got.is_empty() {
                    break;
                }
                mine.extend(got.into_iter().map(|r| (r.id, r.lease_owner)));
                tokio::task::yield_now().await;
            }
            mine
        }));
    }
    let mut seen = HashSet::new();
    let mut per_worker = Vec::new();
    for t in tasks {
        let mine = t.await.unwrap();
        per_worker.push(mine.len());
        for (id, owner) in mine {
            assert!(seen.insert(id), "record {id} claimed twice");
            let stored = db.get_record(id).await.unwrap().unwrap();
            assert_eq!(stored.lease_owner, owner, "the stored owner is the claimer");
        }
    }
    assert_eq!(
        seen.len(),
        N,
        "every record claimed once; per worker: {per_worker:?}"
    );
    assert_counts_consistent(db).await;
}

async fn expired_lease_is_reclaimable_and_unexpired_is_not(db: &Db) {
    let rec = db
        .create_record(new_record("p", Some("x"), T0), T0)
        .await
        .unwrap()
        .record;
    let a = db.claim_due(&claim("a", T0, 10)).await.unwrap().remove(0);
    let lease_a = a.lease().unwrap();
    // Not yet expired: nobody else gets it.
    assert!(
        db.claim_due(&claim("b", T0 + 29_999, 10))
            .await
            .unwrap()
            .is_empty()
    );
    // Expired: b takes it over, with a new token.
    let b = db.claim_due(&claim("b", T0 + 30_000, 10)).await.unwrap();
    assert_eq!(b.len(), 1);
    let lease_b = b[0].lease().unwrap();
    assert_eq!(lease_b.record_id, rec.id);
    assert_eq!(lease_b.token, lease_a.token + 1);
    // a wakes up late: its write is refused, b's goes through.
    let stale = db
        .commit(&Commit::new(
            lease_a.clone(),
            T0 + 31_000,
            Some(WorkResult::Completed),
        ))
        .await;
    assert!(
        matches!(stale, Err(StoreError::LeaseLost { record_id }) if record_id == rec.id),
        "{stale:?}"
    );
    let done = db
        .commit(&Commit::new(
            lease_b,
            T0 + 31_000,
            Some(WorkResult::Completed),
        ))
        .await
        .unwrap();
    assert_eq!(done.state, RecordState::Succeeded);
    let kinds = crate::helpers::event_kinds(db, rec.id).await;
    assert_eq!(
        kinds,
        vec![
            "created",
            "claimed",
            "lease_expired",
            "claimed",
            "completed"
        ]
    );
    assert_counts_consistent(db).await;
}

fn attempt(step: &str, no: i32, status: i32, outcome: Outcome, excerpt: &str) -> NewAttempt {
    NewAttempt {
        step: step.to_owned(),
        provider: Some("prov".into()),
        attempt_no: no,
        node: Some("w1".into()),
        started_at: T0,
        duration_ms: 42,
        http_status: Some(status),
        outcome,
        error_code: (outcome != Outcome::Success).then(|| "provider_5xx".to_owned()),
        excerpt: Some(excerpt.to_owned()),
        request: Some(sent_request(step, no)),
    }
}

/// A request as an attempt keeps it (quotes and non-ASCII included, to
/// show the stored text round-trips).
fn sent_request(step: &str, no: i32) -> ballast::domain::request::SentRequest {
    ballast::domain::request::SentRequest {
        method: "POST".into(),
        url: format!("https://api.example.com/v1/{step}?try={no}&api_key=[redacted]"),
        headers: vec![
            ("Idempotency-Key".into(), format!("ballast-i-1-{step}-0")),
            ("X-Note".into(), "\"é\"".into()),
        ],
        body: Some(format!("{{\"attempt\": {no}}}")),
    }
}

/// A commit's `new_steps` are inserted as new rows beside the others'
/// upsert. On PostgreSQL one naming a step whose run is stored fails the
/// group's transaction, a rightly named neighbour's writes with it, every
/// lease still held (`Commit::new_steps`); SQLite upserts them all.
async fn new_step_runs_are_inserted_and_a_stored_one_named_new_fails_the_group(db: &Db) {
    for key in ["a", "b"] {
        db.create_record(new_record("p", Some(key), T0), T0)
            .await
            .unwrap();
    }
    let claimed = db.claim_due(&claim("w1", T0, 2)).await.unwrap();
    let step = |name: &str, state| StepWrite {
        state,
        ..StepWrite::pending(name)
    };
    let checkpoint = |r: &ballast::domain::Record, now: i64, new: &[&str]| {
        let mut c = Commit::new(r.lease().unwrap(), now, None);
        c.steps = vec![
            step("fetch", StepState::Running),
            step("store", StepState::Pending),
        ];
        c.new_steps = new.iter().map(|n| n.to_string()).collect();
        c
    };
    let first: Vec<Commit> = (claimed.iter())
        .map(|r| checkpoint(r, T0 + 1, &["fetch", "store"]))
        .collect();
    for done in db.commit_many(&first).await.unwrap() {
        done.unwrap();
    }
    let runs = |r: &ballast::domain::Record| {
        let id = r.id;
        async move {
            let mut seen: Vec<(String, StepState)> = (db.step_runs(id).await.unwrap().iter())
                .map(|s| (s.step.clone(), s.state))
                .collect();
            seen.sort_by(|a, b| a.0.cmp(&b.0));
            seen
        }
    };
    let then = |fetch: StepState, notify: bool| {
        let mut want = vec![("fetch".to_owned(), fetch)];
        if notify {
            want.push(("notify".to_owned(), StepState::Pending));
        }
        want.push(("store".to_owned(), StepState::Pending));
        want
    };
    // The second names "fetch", stored now, as new; the first does not.
    let next = |r: &ballast::domain::Record, now: i64, new: &[&str]| {
        let mut c = checkpoint(r, now, new);
        c.steps[0].state = StepState::Succeeded;
        c.steps.push(step("notify", StepState::Pending));
        c
    };
    let group = vec![
        next(&claimed[0], T0 + 2, &["notify"]),
        next(&claimed[1], T0 + 2, &["fetch", "notify"]),
    ];
    let out = db.commit_many(&group).await;
    if db.backend() == ballast::store::Backend::Postgres {
        assert!(out.is_err());
        for r in &claimed {
            assert_eq!(runs(r).await, then(StepState::Running, false));
        }
    } else {
        for done in out.unwrap() {
            done.unwrap();
        }
    }
    // Named rightly, the group lands (again on SQLite): leases still held.
    let right = vec![
        next(&claimed[0], T0 + 3, &[]),
        next(&claimed[1], T0 + 3, &[]),
    ];
    for done in db.commit_many(&right).await.unwrap() {
        done.unwrap();
    }
    for r in &claimed {
        assert_eq!(runs(r).await, then(StepState::Succeeded, true));
    }
}

/// A commit that leaves the step, provider, error code, finish and park
/// as they were (a retry of the same step: on SQLite, the narrower
/// update) stores what it returns, and so does each commit in the same
/// group that changes exactly one of those (which must be written whole);
/// the lists and the queue find each record where it now is.
async fn a_commit_in_place_writes_what_it_returns(db: &Db) {
    use ballast::domain::park::ParkUntil;
    let keys = ["same", "error", "finish", "step", "provider", "park"];
    for key in keys {
        db.create_record(new_record("p", Some(key), T0), T0)
            .await
            .unwrap();
    }
    let retry = |r: &ballast::domain::Record, now: i64, reason: &str| {
        let mut c = Commit::new(r.lease().unwrap(), now, Some(WorkResult::RetryScheduled));
        c.next_run_at = Some(now + 1_000);
        c.step = Some("fetch".into());
        c.provider = Some("prov".into());
        c.error_code = Some("provider_5xx".into());
        c.reason = Some(reason.into());
        c
    };
    let claimed = db.claim_due(&claim("w1", T0, 6)).await.unwrap();
    let firsts: Vec<Commit> = claimed.iter().map(|r| retry(r, T0 + 10, "first")).collect();
    for done in db.commit_many(&firsts).await.unwrap() {
        assert_eq!(done.unwrap().step.as_deref(), Some("fetch"));
    }
    let now = T0 + 1_010;
    let mut again = db.claim_due(&claim("w1", now, 6)).await.unwrap();
    again.sort_by_key(|r| {
        keys.iter()
            .position(|k| r.external_key.as_deref() == Some(*k))
    });
    let mut commits: Vec<Commit> = again.iter().map(|r| retry(r, now + 5, "second")).collect();
    commits[1].error_code = Some("provider_429".into());
    commits[2].result = Some(WorkResult::Completed);
    commits[3].step = Some("store".into());
    commits[4].provider = Some("other".into());
    commits[5].result = Some(WorkResult::Parked);
    commits[5].park_until = Some(ParkUntil::Time { at: now + 60_000 });
    let results = db.commit_many(&commits).await.unwrap();
    for (returned, key) in results.into_iter().zip(keys) {
        let returned = returned.unwrap();
        let stored = db.get_record(returned.id).await.unwrap().unwrap();
        assert_eq!(stored, returned, "{key}");
    }
    let stored = db.get_record(again[0].id).await.unwrap().unwrap();
    assert_eq!(
        (
            stored.state,
            stored.next_run_at,
            stored.lease_owner.as_deref()
        ),
        (RecordState::Retrying, Some(now + 1_005), None)
    );
    assert_eq!(stored.reason.as_deref(), Some("second"));
    let finished = db.get_record(again[2].id).await.unwrap().unwrap();
    assert_eq!(
        (finished.state, finished.finished_at),
        (RecordState::Succeeded, Some(now + 5))
    );
    let listed = |f: RecordFilter| async move {
        let page = db.list_records(&f).await.unwrap();
        let mut ids: Vec<i64> = page.items.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        ids
    };
    let fetching = RecordFilter {
        state: Some(RecordState::Retrying),
        step: Some("fetch".into()),
        provider: Some("prov".into()),
        error_code: Some("provider_5xx".into()),
        ..Default::default()
    };
    assert_eq!(listed(fetching).await, [again[0].id]);
    let elsewhere = RecordFilter {
        state: Some(RecordState::Retrying),
        ..Default::default()
    };
    let mut moved: Vec<i64> = [0, 1, 3, 4].iter().map(|n| again[*n].id).collect();
    moved.sort_unstable();
    assert_eq!(listed(elsewhere).await, moved);
    let parked = RecordFilter {
        until: Some(ballast::domain::park::UntilKind::Time),
        ..Default::default()
    };
    assert_eq!(listed(parked).await, [again[5].id]);
    assert!(
        db.claim_due(&claim("w1", now + 1_004, 6))
            .await
            .unwrap()
            .is_empty()
    );
    let due = db.claim_due(&claim("w1", now + 1_005, 6)).await.unwrap();
    assert_eq!(due.len(), 4);
    assert_counts_consistent(db).await;
}

async fn commit_writes_steps_attempts_and_transition(db: &Db) {
    let rec = db
        .create_record(new_record("p", Some("x"), T0), T0)
        .await
        .unwrap()
        .record;
    let r = db.claim_due(&claim("w1", T0, 1)).await.unwrap().remove(0);
    let mut step = StepWrite::pending("fetch");
    step.state = StepState::Retrying;
    step.attempts = 1;
    step.error_code = Some("provider_5xx".into());
    step.started_at = Some(T0);
    let mut c = Commit::new(
        r.lease().unwrap(),
        T0 + 50,
        Some(WorkResult::RetryScheduled),
    );
    c.next_run_at = Some(T0 + 5_000);
    c.step = Some("fetch".into());
    c.provider = Some("prov".into());
    c.error_code = Some("provider_5xx".into());
    c.steps = vec![step.clone()];
    c.attempts = vec![attempt("fetch", 1, 503, Outcome::Retry, &"é".repeat(5000))];
    let after = db.commit(&c).await.unwrap();
    assert_eq!(after.state, RecordState::Retrying);
    assert_eq!(after.next_run_at, Some(T0 + 5_000));
    assert_eq!(after.lease_owner, None);
    assert_eq!(after.error_code.as_deref(), Some("provider_5xx"));
    assert_eq!(
        (after.step.as_deref(), after.provider.as_deref()),
        (Some("fetch"), Some("prov"))
    );

    let steps = db.step_runs(rec.id).await.unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].state, StepState::Retrying);
    assert_eq!(
        steps[0].idempotency_key,
        idempotency_key(&db.installation_id().await.unwrap(), rec.id, "fetch", 0)
    );
    let attempts = db.attempts(rec.id).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].http_status, Some(503));
    assert_eq!(attempts[0].outcome, Outcome::Retry);
    assert_eq!(attempts[0].request, Some(sent_request("fetch", 1)));
    let excerpt = attempts[0].excerpt.clone().unwrap();
    assert!(
        excerpt.len() <= 4096 && excerpt.len() >= 4094,
        "excerpt cut to 4 KiB: {}",
        excerpt.len()
    );

    // Not due before its time; due after.
    assert!(
        db.claim_due(&claim("w1", T0 + 4_999, 1))
            .await
            .unwrap()
            .is_empty()
    );
    let r = db
        .claim_due(&claim("w1", T0 + 5_000, 1))
        .await
        .unwrap()
        .remove(0);
    step.state = StepState::Succeeded;
    step.attempts = 2;
    step.output = Some(json!({ "email": "a@b.c" }));
    let mut c = Commit::new(r.lease().unwrap(), T0 + 5_100, Some(WorkResult::Completed));
    c.steps = vec![step];
    c.attempts = vec![attempt("fetch", 2, 200, Outcome::Success, "{}")];
    let done = db.commit(&c).await.unwrap();
    assert_eq!(done.state, RecordState::Succeeded);
    assert_eq!(done.next_run_at, None);
    assert_eq!(done.finished_at, Some(T0 + 5_100));
    assert_eq!(done.error_code, None);
    assert_eq!(
        db.step_runs(rec.id).await.unwrap()[0].output,
        Some(json!({ "email": "a@b.c" }))
    );
    assert_eq!(db.attempts(rec.id).await.unwrap().len(), 2);
    let events = db.record_events(rec.id).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (last.kind.as_str(), last.from_state, last.to_state),
        (
            "completed",
            Some(RecordState::Running),
            Some(RecordState::Succeeded)
        )
    );
    assert_eq!(last.actor, "node:w1");
    assert!(!last.audit);
    // A finished record cannot be committed again with the old lease.
    assert!(matches!(
        db.commit(&c).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_counts_consistent(db).await;
}

async fn checkpoint_keeps_the_lease(db: &Db) {
    let rec = db
        .create_record(new_record("p", Some("x"), T0), T0)
        .await
        .unwrap()
        .record;
    let r = db.claim_due(&claim("w1", T0, 1)).await.unwrap().remove(0);
    let mut step = StepWrite::pending("render");
    step.state = StepState::Waiting;
    step.job_id = Some("job-123".into());
    let mut c = Commit::new(r.lease().unwrap(), T0 + 10, None);
    c.steps = vec![step];
    let mid = db.commit(&c).await.unwrap();
    assert_eq!(mid.state, RecordState::Running);
    assert_eq!(mid.lease(), r.lease());
    assert_eq!(
        db.step_runs(rec.id).await.unwrap()[0].job_id.as_deref(),
        Some("job-123")
    );
    let mut c = Commit::new(r.lease().unwrap(), T0 + 20, Some(WorkResult::Waiting));
    c.next_run_at = Some(T0 + 2_000);
    let waiting = db.commit(&c).await.unwrap();
    assert_eq!(
        (waiting.state, waiting.next_run_at),
        (RecordState::Waiting, Some(T0 + 2_000))
    );
    assert_counts_consistent(db).await;
}

async fn release_gives_work_back_without_spending_attempts(db: &Db) {
    let rec = db
        .create_record(new_record("p", Some("x"), T0), T0)
        .await
        .unwrap()
        .record;
    let r = db.claim_due(&claim("w1", T0, 1)).await.unwrap().remove(0);
    let other = db
        .create_record(new_record("p", Some("y"), T0), T0)
        .await
        .unwrap()
        .record;
    let o = db.claim_due(&claim("w2", T0, 1)).await.unwrap().remove(0);
    assert_eq!(o.id, other.id);
    // w1 had made two attempts at a step before shutting down.
    let mut step = StepWrite::pending("fetch");
    step.state = StepState::Retrying;
    step.attempts = 2;
    let mut checkpoint = Commit::new(r.lease().unwrap(), T0 + 1, None);
    checkpoint.steps = vec![step];
    db.commit(&checkpoint).await.unwrap();
    // w1 releases its own lease and, wrongly, one it does not hold.
    let mut forged = o.lease().unwrap();
    forged.owner = "w1".into();
    let released = db
        .release(&[r.lease().unwrap(), forged], T0 + 5)
        .await
        .unwrap();
    assert_eq!(released, 1);
    let back = db.get_record(rec.id).await.unwrap().unwrap();
    assert_eq!(
        (back.state, back.next_run_at, back.lease_owner),
        (RecordState::Pending, Some(T0 + 5), None)
    );
    let steps = db.step_runs(rec.id).await.unwrap();
    assert_eq!(
        (steps[0].attempts, steps[0].state),
        (2, StepState::Retrying),
        "the release spent no attempt"
    );
    assert_eq!(
        db.get_record(other.id).await.unwrap().unwrap().state,
        RecordState::Running
    );
    let last = db.record_events(rec.id).await.unwrap().pop().unwrap();
    assert_eq!(last.kind, "released");
    // Released work is due at once for the next claimer.
    assert_eq!(
        db.claim_due(&claim("w3", T0 + 5, 5)).await.unwrap().len(),
        1
    );
    assert_counts_consistent(db).await;
}

async fn extend_leases_reports_what_is_held(db: &Db) {
    db.create_record(new_record("p", Some("x"), T0), T0)
        .await
        .unwrap();
    db.create_record(new_record("p", Some("y"), T0), T0)
        .await
        .unwrap();
    let got = db.claim_due(&claim("w1", T0, 2)).await.unwrap();
    let mut leases: Vec<_> = got.iter().map(|r| r.lease().unwrap()).collect();
    leases[1].token += 1; // a lease from a claim that never happened
    let held = db.extend_leases(&leases, T0 + 60_000).await.unwrap();
    assert_eq!(held, vec![got[0].id]);
    let r = db.get_record(got[0].id).await.unwrap().unwrap();
    assert_eq!(
        (r.lease_until, r.next_run_at),
        (Some(T0 + 60_000), Some(T0 + 60_000))
    );
    // The extension protects it past the old expiry.
    assert!(
        db.claim_due(&claim("w2", T0 + 45_000, 5))
            .await
            .unwrap()
            .iter()
            .all(|r| r.id != got[0].id)
    );
}

fn action(id: i64, a: OperatorAction, now: i64) -> ActionRequest {
    ActionRequest {
        record_id: id,
        action: a,
        actor: "alice".into(),
        reason: Some(format!("{a} by test")),
        now,
        steps: Vec::new(),
        until: None,
        took: None,
        input: None,
        repin: None,
        failed_items: false,
        signal: None,
    }
}

/// Parked until a time, until a provider is healthy, or for a human:
/// filtered by condition; resumed by the system only when the condition
/// holds and only if no one acted first; counters kept right.
async fn parked_records_resume_when_their_condition_holds(db: &Db) {
    use ballast::domain::park::{ParkUntil, UntilKind};
    use ballast::store::ResumeDue;
    let mut ids = HashMap::new();
    for k in ["time", "later", "provider", "other", "never"] {
        let r = db
            .create_record(new_record("p", Some(k), T0), T0)
            .await
            .unwrap()
            .record;
        ids.insert(k, r.id);
    }
    let park = |k: &str, until: Option<ParkUntil>| ActionRequest {
        until,
        ..action(ids[k], OperatorAction::Park, T0 + 1)
    };
    let at = |t: i64| Some(ParkUntil::Time { at: t });
    let provider = |p: &str| Some(ParkUntil::Provider { provider: p.into() });
    // A time already past, and a condition on anything but a park, are
    // refused with nothing changed.
    let past = db.act(&park("time", at(T0))).await.unwrap_err();
    assert_eq!(past.code(), "bad_until", "{past}");
    assert!(past.to_string().contains("already passed"), "{past}");
    let not_park = ActionRequest {
        until: at(T0 + 100),
        ..action(ids["time"], OperatorAction::Cancel, T0 + 1)
    };
    assert_eq!(
        db.act(&not_park).await.unwrap_err().code(),
        "until_needs_park"
    );
    assert_eq!(
        db.get_record(ids["time"]).await.unwrap().unwrap().state,
        RecordState::Pending
    );
    let p1 = db.act(&park("time", at(T0 + 100))).await.unwrap();
    assert_eq!(
        (p1.state, p1.park_until.clone()),
        (RecordState::Parked, at(T0 + 100))
    );
    db.act(&park("later", at(T0 + 500))).await.unwrap();
    db.act(&park("provider", provider("acme"))).await.unwrap();
    db.act(&park("other", provider("zeta"))).await.unwrap();
    db.act(&park("never", None)).await.unwrap();
    // The audit entry names the condition.
    let parked_event = db
        .record_events(ids["provider"])
        .await
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(parked_event.kind, "park");
    assert_eq!(
        parked_event
            .detail
            .as_ref()
            .and_then(|d| d.get("condition")),
        Some(&json!("until provider `acme` is healthy"))
    );

    // The list filters parked records by condition.
    let keys = |until: UntilKind| async move {
        let f = RecordFilter {
            until: Some(until),
            limit: 50,
            ..Default::default()
        };
        let mut k: Vec<String> = db
            .list_records(&f)
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|r| r.external_key.unwrap())
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys(UntilKind::Time).await, ["later", "time"]);
    assert_eq!(keys(UntilKind::Provider).await, ["other", "provider"]);
    assert_eq!(keys(UntilKind::Never).await, ["never"]);

    // Nothing holds yet.
    let none = ResumeDue {
        now: T0 + 99,
        limit: 10,
        providers: Vec::new(),
    };
    assert!(db.resume_parked(&none).await.unwrap().is_empty());
    // The time comes for one; one provider is healthy again.
    let due = ResumeDue {
        now: T0 + 100,
        limit: 10,
        providers: vec![("acme".into(), 5)],
    };
    let mut resumed: Vec<i64> = db
        .resume_parked(&due)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    resumed.sort_unstable();
    let mut want = vec![ids["time"], ids["provider"]];
    want.sort_unstable();
    assert_eq!(resumed, want);
    for k in ["time", "provider"] {
        let r = db.get_record(ids[k]).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.next_run_at, r.park_until),
            (RecordState::Pending, Some(T0 + 100), None)
        );
        let e = db.record_events(ids[k]).await.unwrap().pop().unwrap();
        assert_eq!(
            (e.kind.as_str(), e.actor.as_str(), e.audit),
            ("resume", "system", true)
        );
        assert!(e.detail.as_ref().and_then(|d| d.get("condition")).is_some());
    }
    // Asked again, nothing more: each record resumes once.
    assert!(db.resume_parked(&due).await.unwrap().is_empty());

    // An operator acts first: resumed by hand, then its time comes.
    db.act(&action(ids["later"], OperatorAction::Resume, T0 + 200))
        .await
        .unwrap();
    let later = ResumeDue {
        now: T0 + 600,
        limit: 10,
        providers: vec![("zeta".into(), 0)],
    };
    assert!(
        db.resume_parked(&later).await.unwrap().is_empty(),
        "a record resumed by hand is not resumed again; a provider's zero share resumes none"
    );
    // Parked again with a new condition: the last one set counts.
    db.act(&park("other", at(T0 + 700))).await.unwrap();
    let other = db.get_record(ids["other"]).await.unwrap().unwrap();
    assert_eq!(other.park_until, at(T0 + 700));
    let zeta = ResumeDue {
        now: T0 + 600,
        limit: 10,
        providers: vec![("zeta".into(), 5)],
    };
    assert!(db.resume_parked(&zeta).await.unwrap().is_empty());
    // Parked with no condition: the system never resumes it.
    let all = ResumeDue {
        now: i64::MAX / 2,
        limit: 10,
        providers: vec![("acme".into(), 5), ("zeta".into(), 5)],
    };
    let last: Vec<i64> = db
        .resume_parked(&all)
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(last, [ids["other"]]);
    assert_eq!(
        db.get_record(ids["never"]).await.unwrap().unwrap().state,
        RecordState::Parked
    );
    // A reversal that parks a record waiting on a condition leaves it to
    // a person, and says so.
    db.act(&park("never", provider("acme"))).await.unwrap();
    let reversed = db
        .reverse(&ballast::store::ReverseRequest {
            record_id: ids["never"],
            step: "charge".into(),
            policy: ballast::domain::ReversalPolicy::Park,
            reason: "the charge was refunded".into(),
            detail: None,
            now: T0 + 800,
            steps: Vec::new(),
            generation: None,
        })
        .await
        .unwrap();
    assert_eq!(
        (
            reversed.state,
            reversed.park_until.clone(),
            reversed.error_code.as_deref(),
            reversed.updated_at
        ),
        (
            RecordState::Parked,
            None,
            Some("provider_reversed"),
            T0 + 800
        )
    );
    assert_eq!(
        db.get_record(ids["never"]).await.unwrap().unwrap(),
        reversed
    );
    assert!(db.resume_parked(&all).await.unwrap().is_empty());
    let mut counted = db.state_counts().await.unwrap();
    let mut scanned = db.recount_states().await.unwrap();
    counted.sort_by_key(|c| (c.pipeline.clone(), c.state));
    scanned.sort_by_key(|c| (c.pipeline.clone(), c.state));
    assert_eq!(counted, scanned);
}

async fn operator_actions_follow_the_table_and_are_audited(db: &Db) {
    let rec = db
        .create_record(new_record("p", Some("x"), T0), T0)
        .await
        .unwrap()
        .record;
    // Refused: not allowed in this state, and nothing changes.
    let err = db
        .act(&action(rec.id, OperatorAction::Resume, T0))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Transition(TransitionError::NotAllowed { .. })
        ),
        "{err}"
    );
    assert_eq!(err.code(), "transition_not_allowed");
    assert_eq!(
        db.get_record(rec.id).await.unwrap().unwrap().state,
        RecordState::Pending
    );
    let parked = db
        .act(&action(rec.id, OperatorAction::Park, T0 + 1))
        .await
        .unwrap();
    assert_eq!(
        (parked.state, parked.next_run_at),
        (RecordState::Parked, None)
    );
    assert_eq!(parked.reason.as_deref(), Some("park by test"));
    // Parked records are not claimed.
    assert!(
        db.claim_due(&claim("w", T0 + 10, 5))
            .await
            .unwrap()
            .is_empty()
    );
    // Parking a parked record again keeps it parked, with the new reason.
    let again = db
        .act(&action(rec.id, OperatorAction::Park, T0 + 2))
        .await
        .unwrap();
    assert_eq!(
        (again.state, again.next_run_at, again.updated_at),
        (RecordState::Parked, None, T0 + 2)
    );

    // Retry gives the step a fresh attempt budget; a submitted job keeps its id.
    let resumed = db
        .act(&action(rec.id, OperatorAction::Resume, T0 + 3))
        .await
        .unwrap();
    assert_eq!(
        (resumed.state, resumed.next_run_at),
        (RecordState::Pending, Some(T0 + 3))
    );
    let r = db
        .claim_due(&claim("w", T0 + 3, 1))
        .await
        .unwrap()
        .remove(0);
    let busy = db
        .act(&action(rec.id, OperatorAction::Cancel, T0 + 4))
        .await
        .unwrap_err();
    assert_eq!(busy.code(), "record_busy");
    let mut step = StepWrite::pending("submit");
    step.state = StepState::Failed;
    step.attempts = 8;
    step.job_id = Some("job-9".into());
    let mut c = Commit::new(r.lease().unwrap(), T0 + 5, Some(WorkResult::Parked));
    c.steps = vec![step];
    c.reason = Some("attempts exhausted".into());
    c.error_code = Some("attempts_exhausted".into());
    db.commit(&c).await.unwrap();
    let retried = db
        .act(&action(rec.id, OperatorAction::Retry, T0 + 6))
        .await
        .unwrap();
    assert_eq!(
        (retried.state, retried.error_code.clone()),
        (RecordState::Pending, None)
    );
    let s = db.step_runs(rec.id).await.unwrap().remove(0);
    assert_eq!(
        (s.attempts, s.state, s.job_id.as_deref()),
        (0, StepState::Waiting, Some("job-9"))
    );

    // Replay re-runs a step under a new idempotency key.
    let r = db
        .claim_due(&claim("w", T0 + 6, 1))
        .await
        .unwrap()
        .remove(0);
    db.commit(&Commit::new(
        r.lease().unwrap(),
        T0 + 7,
        Some(WorkResult::Completed),
    ))
    .await
    .unwrap();
    let mut replay = action(rec.id, OperatorAction::ReplayFrom, T0 + 8);
    assert!(
        matches!(db.act(&replay).await, Err(e) if e.code() == "step_required"),
        "replay needs a step"
    );
    replay.steps = vec!["submit".into(), "notify".into()];
    let replayed = db.act(&replay).await.unwrap();
    let inst = db.installation_id().await.unwrap();
    assert_eq!(inst.len(), 16, "{inst}");
    assert_eq!(replayed.state, RecordState::Pending);
    let steps = db.step_runs(rec.id).await.unwrap();
    let submit = steps.iter().find(|s| s.step == "submit").unwrap();
    assert_eq!(
        (submit.generation, submit.job_id.clone(), submit.attempts),
        (1, None, 0)
    );
    assert_eq!(
        submit.idempotency_key,
        idempotency_key(&inst, rec.id, "submit", 1)
    );
    assert_ne!(
        submit.idempotency_key,
        idempotency_key(&inst, rec.id, "submit", 0)
    );
    assert!(
        steps
            .iter()
            .any(|s| s.step == "notify" && s.generation == 0)
    );

    let cancelled = db
        .act(&action(rec.id, OperatorAction::Cancel, T0 + 9))
        .await
        .unwrap();
    assert_eq!(
        (cancelled.state, cancelled.finished_at),
        (RecordState::Cancelled, Some(T0 + 9))
    );
    let missing = db
        .act(&action(rec.id + 999, OperatorAction::Cancel, T0))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), "not_found");

    // The audit log holds the operator actions, newest first, and filters.
    let audit = db
        .audit_log(&AuditFilter {
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    let kinds: Vec<&str> = audit.items.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        vec!["cancel", "replay", "retry", "resume", "park", "park"]
    );
    assert!(audit.items.iter().all(|e| e.audit && e.actor == "alice"));
    assert_eq!(
        audit.items[1].detail,
        Some(json!({ "steps": ["submit", "notify"] }))
    );
    let only = db
        .audit_log(&AuditFilter {
            kind: Some("retry".into()),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(only.items.len(), 1);
    let nobody = db
        .audit_log(&AuditFilter {
            actor: Some("mallory".into()),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(nobody.items.is_empty());
    let paged = db
        .audit_log(&AuditFilter {
            limit: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(paged.items.len(), 2);
    let rest = db
        .audit_log(&AuditFilter {
            limit: 50,
            before: paged.next,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(rest.items.len(), 4);
    assert_counts_consistent(db).await;
}

/// Random creates, claims, commits, releases, expiries and operator actions;
/// the maintained counters must equal a recount at every checkpoint.
async fn counters_match_a_recount_after_random_operations(db: &Db) {
    let seed = std::env::var("BALLAST_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_u64);
    let mut rng = fastrand::Rng::with_seed(seed);
    let pipelines = ["alpha", "beta", "gamma"];
    let mut now = T0;
    let mut held = Vec::new();
    for round in 0..400 {
        now += rng.i64(0..20_000);
        match rng.u8(0..10) {
            0..=2 => {
                let key = format!("k{}", rng.u32(0..150));
                let p = pipelines[rng.usize(0..pipelines.len())];
                let mut new = new_record(p, Some(&key), now + rng.i64(0..5_000));
                new.group = [None, Some("t1"), Some("t2")][rng.usize(0..3)].map(str::to_owned);
                db.create_record(new, now).await.unwrap();
            }
            3..=4 => {
                let got = db
                    .claim_due(&claim(&format!("w{}", rng.u8(0..3)), now, rng.u32(1..8)))
                    .await
                    .unwrap();
                held.extend(got.into_iter().map(|r| r.lease().unwrap()));
            }
            5..=6 if !held.is_empty() => {
                let lease = held.swap_remove(rng.usize(0..held.len()));
                let result = WorkResult::ALL[rng.usize(0..WorkResult::ALL.len())];
                let mut c = Commit::new(lease, now, Some(result));
                c.next_run_at = Some(now + rng.i64(0..10_000));
                match db.commit(&c).await {
                    Ok(_) | Err(StoreError::LeaseLost { .. }) => {}
                    Err(e) => panic!("round {round}: {e}"),
                }
            }
            7 if !held.is_empty() => {
                let n = rng.usize(1..=held.len());
                let leases: Vec<_> = held.drain(..n).collect();
                db.release(&leases, now).await.unwrap();
            }
            _ => {
                let page = db
                    .list_records(&RecordFilter {
                        limit: 500,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                if let Some(r) =
                    (!page.items.is_empty()).then(|| &page.items[rng.usize(0..page.items.len())])
                {
                    let a = OperatorAction::ALL[rng.usize(0..OperatorAction::ALL.len())];
                    let mut req = action(r.id, a, now);
                    req.steps = vec!["s1".into()];
                    match db.act(&req).await {
                        Ok(_) | Err(StoreError::Transition(_)) => {}
                        // (No step here has an uncertain call to take,
                        // sleeps, or waits for a decision or a signal; a
                        // signal carries its body, which this has not.)
                        Err(StoreError::Declined { code, .. })
                            if matches!(
                                (a, code),
                                (OperatorAction::TookEffect, _)
                                    | (OperatorAction::Wake, "nothing_asleep")
                                    | (
                                        OperatorAction::Approve | OperatorAction::Reject,
                                        "nothing_awaited" | "record_parked"
                                    )
                                    | (OperatorAction::Signal, "details_required")
                            ) => {}
                        Err(e) => panic!("round {round}: {e}"),
                    }
                }
            }
        }
        if round % 50 == 49 {
            assert_counts_consistent(db).await;
        }
    }
    assert_counts_consistent(db).await;
    let total: i64 = db
        .state_counts()
        .await
        .unwrap()
        .iter()
        .map(|c| c.count)
        .sum();
    assert!(
        total > 50,
        "the run exercised enough records: {total} (seed {seed})"
    );
}

async fn list_filters_and_keyset_pagination(db: &Db) {
    let mut ids = Vec::new();
    for i in 0..25 {
        let p = if i % 5 == 0 { "beta" } else { "alpha" };
        ids.push(
            db.create_record(new_record(p, Some(&format!("order-{i:03}")), T0), T0)
                .await
                .unwrap()
                .record
                .id,
        );
    }
    ids.reverse();
    let all = RecordFilter {
        limit: 10,
        ..Default::default()
    };
    assert_eq!(
        paged_ids(db, all).await,
        ids,
        "pages cover every record once, newest first"
    );

    let beta = db
        .list_records(&RecordFilter {
            pipeline: Some("beta".into()),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(beta.items.len(), 5);
    assert!(beta.items.iter().all(|r| r.pipeline == "beta"));
    // A cursor combined with a filter pages through the filtered set.
    let alpha = |before| RecordFilter {
        pipeline: Some("alpha".into()),
        before,
        limit: 7,
        ..Default::default()
    };
    let p1 = db.list_records(&alpha(None)).await.unwrap();
    let p2 = db.list_records(&alpha(p1.next)).await.unwrap();
    let p3 = db.list_records(&alpha(p2.next)).await.unwrap();
    let alpha_ids: Vec<i64> = [p1.items, p2.items, p3.items]
        .concat()
        .iter()
        .map(|r| r.id)
        .collect();
    let expected: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| (id - ids[ids.len() - 1]) % 5 != 0)
        .collect();
    assert_eq!(alpha_ids, expected);
    assert_eq!(p3.next, None);
    let prefix = db
        .list_records(&RecordFilter {
            key_prefix: Some("order-01".into()),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(prefix.items.len(), 10);
    let exact = db
        .list_records(&RecordFilter {
            key_prefix: Some("order-007".into()),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(exact.items.len(), 1);

    // State and error-code filters see a parked record.
    let r = db.claim_due(&claim("w", T0, 1)).await.unwrap().remove(0);
    let mut c = Commit::new(r.lease().unwrap(), T0, Some(WorkResult::Parked));
    c.error_code = Some("unknown_reply".into());
    c.step = Some("fetch".into());
    c.provider = Some("acme".into());
    db.commit(&c).await.unwrap();
    let filter = RecordFilter {
        state: Some(RecordState::Parked),
        error_code: Some("unknown_reply".into()),
        provider: Some("acme".into()),
        step: Some("fetch".into()),
        limit: 50,
        ..Default::default()
    };
    let parked = db.list_records(&filter).await.unwrap();
    assert_eq!(
        parked.items.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![r.id]
    );
    let none = db
        .list_records(&RecordFilter {
            state: Some(RecordState::Failed),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(none.items.is_empty() && none.next.is_none());
}

async fn users_and_sessions(db: &Db) {
    let u = db
        .create_user(
            &NewUser {
                unmask: false,
                pipelines: ballast::domain::scope::Scope::all(),
                username: "alice".into(),
                password_hash: "$argon2id$fake".into(),
                role: Role::Operator,
            },
            T0,
        )
        .await
        .unwrap();
    assert_eq!((u.role, u.disabled), (Role::Operator, false));
    let dup = db
        .create_user(
            &NewUser {
                unmask: false,
                pipelines: ballast::domain::scope::Scope::all(),
                username: "alice".into(),
                password_hash: "x".into(),
                role: Role::Viewer,
            },
            T0,
        )
        .await
        .unwrap_err();
    assert_eq!(dup.code(), "conflict");
    let bad = db
        .create_user(
            &NewUser {
                unmask: false,
                pipelines: ballast::domain::scope::Scope::all(),
                username: "Alice Smith".into(),
                password_hash: "x".into(),
                role: Role::Viewer,
            },
            T0,
        )
        .await
        .unwrap_err();
    assert_eq!(bad.code(), "invalid_request");
    assert_eq!(db.user_by_name("alice").await.unwrap().unwrap().id, u.id);
    assert_eq!(
        db.user_by_id(u.id).await.unwrap().unwrap().username,
        "alice"
    );
    assert!(db.user_by_name("bob").await.unwrap().is_none());

    let s = Session {
        id: "jti-1".into(),
        user_id: u.id,
        created_at: T0,
        expires_at: T0 + 3_600_000,
        revoked_at: None,
        last_seen_at: T0,
    };
    db.create_session(&s).await.unwrap();
    // A session's use is noted, never moved back.
    db.touch_session("jti-1", T0 + 60_000).await.unwrap();
    db.touch_session("jti-1", T0 + 1).await.unwrap();
    assert_eq!(
        db.session("jti-1").await.unwrap().unwrap().last_seen_at,
        T0 + 60_000
    );
    let s2 = Session {
        id: "jti-2".into(),
        ..s.clone()
    };
    db.create_session(&s2).await.unwrap();
    assert!(db.session("jti-1").await.unwrap().unwrap().is_live(T0 + 1));
    db.revoke_session("jti-1", T0 + 2).await.unwrap();
    assert!(!db.session("jti-1").await.unwrap().unwrap().is_live(T0 + 3));
    assert!(db.session("jti-2").await.unwrap().unwrap().is_live(T0 + 3));
    // A role change ends every session of the user.
    let changed = db
        .update_user(u.id, &UserChange::Role(Role::Operator), T0 + 4)
        .await
        .unwrap();
    assert_eq!(changed.role, Role::Operator);
    assert!(!db.session("jti-2").await.unwrap().unwrap().is_live(T0 + 5));
    let disabled = db
        .update_user(u.id, &UserChange::Disabled(true), T0 + 6)
        .await
        .unwrap();
    assert!(disabled.disabled);
    let pw = db
        .update_user(u.id, &UserChange::Password("$argon2id$new".into()), T0 + 7)
        .await
        .unwrap();
    assert_eq!(pw.password_hash, "$argon2id$new");
    assert_eq!(
        db.update_user(u.id + 50, &UserChange::Disabled(true), T0)
            .await
            .unwrap_err()
            .code(),
        "not_found"
    );
    assert_eq!(db.list_users().await.unwrap().len(), 1);
    assert_eq!(db.purge_sessions(T0 + 3_600_001).await.unwrap(), 2);
    assert!(db.session("jti-2").await.unwrap().is_none());
}

async fn the_last_enabled_admin_stays_one(db: &Db) {
    let add = async |name: &str, role: Role| {
        let u = NewUser {
            unmask: false,
            pipelines: ballast::domain::scope::Scope::all(),
            username: name.into(),
            password_hash: "$argon2id$fake".into(),
            role,
        };
        db.create_user(&u, T0).await.unwrap().id
    };
    let root = add("root", Role::Admin).await;
    let viewer = add("vera", Role::Viewer).await;
    for change in [UserChange::Role(Role::Operator), UserChange::Disabled(true)] {
        let refused = db.update_user(root, &change, T0).await.unwrap_err();
        assert_eq!(refused.code(), "last_admin");
    }
    let kept = db.user_by_id(root).await.unwrap().unwrap();
    assert_eq!(
        (kept.role, kept.disabled),
        (Role::Admin, false),
        "unchanged"
    );
    db.update_user(root, &UserChange::Password("$argon2id$new".into()), T0)
        .await
        .unwrap();
    // With a second admin, one of them may go; two demoted at once leave
    // exactly one (each change locks the admins it counts).
    db.update_user(viewer, &UserChange::Role(Role::Admin), T0)
        .await
        .unwrap();
    let demote = |id: i64| {
        let db = db.clone();
        tokio::spawn(async move {
            db.update_user(id, &UserChange::Role(Role::Viewer), T0)
                .await
                .map_err(|e| e.code())
        })
    };
    let (a, b) = (demote(root), demote(viewer));
    let results = [a.await.unwrap(), b.await.unwrap()];
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{:?}",
        results
            .iter()
            .map(|r| r.as_ref().map(|u| u.id))
            .collect::<Vec<_>>()
    );
    assert!(
        results
            .iter()
            .any(|r| r.as_ref().err() == Some(&"last_admin"))
    );
    let admins = db.list_users().await.unwrap();
    assert_eq!(
        admins
            .iter()
            .filter(|u| u.role == Role::Admin && !u.disabled)
            .count(),
        1
    );
}

async fn the_first_user_is_made_only_while_there_is_none(db: &Db) {
    let user = |name: &str| NewUser {
        unmask: false,
        pipelines: ballast::domain::scope::Scope::all(),
        username: name.into(),
        password_hash: "$argon2id$fake".into(),
        role: Role::Admin,
    };
    let first = db.create_first_user(&user("admin"), T0).await.unwrap();
    assert_eq!(first.map(|u| u.username).as_deref(), Some("admin"));
    assert!(
        db.create_first_user(&user("root"), T0)
            .await
            .unwrap()
            .is_none()
    );
    assert!(db.user_by_name("root").await.unwrap().is_none());
    assert_eq!(
        db.create_first_user(&user("Not A Name"), T0)
            .await
            .unwrap_err()
            .code(),
        "invalid_request"
    );
    assert_eq!(db.list_users().await.unwrap().len(), 1);
}

async fn nodes_providers_and_pipelines(db: &Db) {
    let beat = NodeBeat {
        id: "n1".into(),
        hostname: "h".into(),
        pid: 42,
        version: "0.1.0".into(),
        started_at: T0,
        draining: false,
        config_version: None,
    };
    db.heartbeat(&beat, T0).await.unwrap();
    assert_eq!(db.list_nodes().await.unwrap()[0].config_version, None);
    db.heartbeat(
        &NodeBeat {
            draining: true,
            config_version: Some("0123456789ab".into()),
            ..beat.clone()
        },
        T0 + 5_000,
    )
    .await
    .unwrap();
    let nodes = db.list_nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(
        (
            nodes[0].heartbeat_at,
            nodes[0].draining,
            nodes[0].started_at
        ),
        (T0 + 5_000, true, T0)
    );
    assert_eq!(nodes[0].config_version.as_deref(), Some("0123456789ab"));
    db.remove_node("n1").await.unwrap();
    assert!(db.list_nodes().await.unwrap().is_empty());

    assert!(db.provider_state("acme").await.unwrap().is_none());
    let mut p = ProviderState::new("acme", T0);
    db.save_provider_state(&p).await.unwrap();
    p.paused = true;
    p.paused_by = Some("alice".into());
    p.breaker = ballast::domain::BreakerState::Open;
    p.open_until = Some(T0 + 30_000);
    p.stats = Some(json!({ "calls": 50, "failures": 30 }));
    db.save_provider_state(&p).await.unwrap();
    assert_eq!(db.provider_state("acme").await.unwrap(), Some(p.clone()));
    assert_eq!(db.provider_states().await.unwrap(), vec![p]);

    let def = json!({ "steps": [{ "name": "fetch" }] });
    let v1 = db.pin_pipeline("enrich", "h1", &def, T0).await.unwrap();
    assert_eq!(
        db.pin_pipeline("enrich", "h1", &def, T0 + 1).await.unwrap(),
        v1
    );
    let v2 = db
        .pin_pipeline("enrich", "h2", &json!({}), T0)
        .await
        .unwrap();
    assert_ne!(v1, v2);
    let pv = db.pipeline_version(v1).await.unwrap().unwrap();
    assert_eq!(
        (pv.pipeline.as_str(), pv.definition.clone()),
        ("enrich", def)
    );
    let mut rec = new_record("enrich", Some("pinned"), T0);
    rec.pipeline_version = Some(v1);
    assert_eq!(
        db.create_record(rec, T0)
            .await
            .unwrap()
            .record
            .pipeline_version,
        Some(v1)
    );

    let e = db
        .append_event(&NewEvent {
            record_id: None,
            at: T0,
            kind: "provider_paused".into(),
            actor: "alice".into(),
            audit: true,
            step: None,
            reason: Some("maintenance".into()),
            detail: Some(json!({ "provider": "acme" })),
        })
        .await
        .unwrap();
    assert!(e.id > 0 && e.audit);
    let audit = db
        .audit_log(&AuditFilter {
            actor: Some("alice".into()),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(audit.items, vec![e]);
}

/// Two processes on one SQLite file (a CLI next to a server, or two
/// servers by mistake) each have their own writer connection; `BEGIN
/// IMMEDIATE` and the busy timeout must still keep their claims disjoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_two_handles_on_one_file_never_share_a_claim() {
    let t = crate::helpers::TestDb::migrated(ballast::store::Backend::Sqlite, "two_handles")
        .await
        .unwrap();
    let second = Db::connect(&t.url, &ballast::store::ConnectOptions::default())
        .await
        .unwrap();
    for i in 0..200 {
        t.db.create_record(new_record("p", Some(&format!("r{i}")), T0), T0)
            .await
            .unwrap();
    }
    let mut tasks = Vec::new();
    for (w, db) in [t.db.clone(), second.clone(), t.db.clone(), second.clone()]
        .into_iter()
        .enumerate()
    {
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = db
                    .claim_due(&claim(&format!("w{w}"), T0 + 1, 5))
                    .await
                    .unwrap();
                if got.is_empty() {
                    break mine;
                }
                mine.extend(got.into_iter().map(|r| r.id));
            }
        }));
    }
    let mut seen = HashSet::new();
    for task in tasks {
        for id in task.await.unwrap() {
            assert!(seen.insert(id), "record {id} claimed twice");
        }
    }
    assert_eq!(seen.len(), 200);
    assert_counts_consistent(&t.db).await;
    second.close().await;
}

/// Each installation has its own id, so idempotency keys never collide
/// between two databases whose record ids coincide.
#[tokio::test]
async fn installations_have_distinct_ids() {
    let a = crate::helpers::TestDb::migrated(ballast::store::Backend::Sqlite, "inst_a")
        .await
        .unwrap();
    let b = crate::helpers::TestDb::migrated(ballast::store::Backend::Sqlite, "inst_b")
        .await
        .unwrap();
    let (ia, ib) = (
        a.db.installation_id().await.unwrap(),
        b.db.installation_id().await.unwrap(),
    );
    assert_ne!(ia, ib);
    assert_eq!(ia, a.db.installation_id().await.unwrap(), "stable");
}

async fn api_tokens_are_stored_hashed_and_revocable(db: &Db) {
    use ballast::store::NewApiToken;
    let new = |name: &str, hash: &str| NewApiToken {
        unmask: false,
        pipelines: ballast::domain::scope::Scope::all(),
        name: name.into(),
        token_hash: hash.into(),
        prefix: "blt_abcd".into(),
        role: Role::Operator,
        created_by: "admin".into(),
        actor: "admin".into(),
        expires_at: None,
    };
    let t = db.create_api_token(&new("ci", "h1"), T0).await.unwrap();
    assert_eq!(
        (t.name.as_str(), t.role, t.revoked_at),
        ("ci", Role::Operator, None)
    );
    assert!(matches!(
        db.create_api_token(&new("again", "h1"), T0).await,
        Err(StoreError::Conflict { .. })
    ));
    assert!(matches!(
        db.create_api_token(&new(" ", "h2"), T0).await,
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(
        db.api_token_by_hash("h1").await.unwrap().map(|t| t.id),
        Some(t.id)
    );
    assert_eq!(db.api_token_by_hash("nope").await.unwrap(), None);
    db.touch_api_token(t.id, T0 + 1).await.unwrap();
    db.touch_api_token(t.id, T0 + 2).await.unwrap();
    let listed = db.list_api_tokens().await.unwrap();
    assert_eq!(
        listed[0].last_used_at,
        Some(T0 + 1),
        "touches are coalesced per minute"
    );
    let revoked = db.revoke_api_token(t.id, "admin", T0 + 5).await.unwrap();
    assert_eq!(revoked.revoked_at, Some(T0 + 5));
    assert_eq!(
        db.api_token_by_hash("h1").await.unwrap(),
        None,
        "revoked tokens do not authenticate"
    );
    assert!(matches!(
        db.revoke_api_token(999, "admin", T0).await,
        Err(StoreError::NotFound { .. })
    ));
    let audit = db.audit_log(&AuditFilter::default()).await.unwrap();
    let kinds: Vec<&str> = audit.items.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, vec!["token_revoked", "token_created"]);
    let expiring = NewApiToken {
        expires_at: Some(T0 + 86_400_000),
        ..new("nightly", "h3")
    };
    let e = db.create_api_token(&expiring, T0).await.unwrap();
    assert_eq!(e.expires_at, Some(T0 + 86_400_000));
    assert_eq!(
        db.api_token_by_hash("h3")
            .await
            .unwrap()
            .unwrap()
            .expires_at,
        Some(T0 + 86_400_000),
        "kept with its expiry"
    );
    assert_eq!(t.expires_at, None);
}

/// A name's turn for a password check is taken by one caller: the claim
/// is a compare-and-set on the count it read, counting the check as a
/// failure in advance; a claim on a count another caller changed since
/// takes nothing.
async fn a_login_turn_is_claimed_once(db: &Db) {
    for now in [T0, T0 + 1, T0 + 2] {
        db.count_login_failure("erin", now, now - 60_000)
            .await
            .unwrap();
    }
    let seen = db.login_failures("erin").await.unwrap().unwrap();
    assert!(db.claim_login_check("erin", seen, T0 + 10).await.unwrap());
    assert!(
        !db.claim_login_check("erin", seen, T0 + 11).await.unwrap(),
        "the same turn twice"
    );
    let now = db.login_failures("erin").await.unwrap().unwrap();
    assert_eq!(
        (now.failures, now.last_failure_at),
        (seen.failures + 1, T0 + 10)
    );
    assert!(
        db.claim_login_check("erin", now, T0 + 20).await.unwrap(),
        "the next turn"
    );
    assert!(
        !db.claim_login_check("nobody", now, T0 + 20).await.unwrap(),
        "no count, no turn to take"
    );
}

async fn login_failures_are_counted_per_name_and_forgotten(db: &Db) {
    use ballast::domain::login::LoginFailures;
    let seen = |failures, last_failure_at| LoginFailures {
        failures,
        last_failure_at,
    };
    // Failures older than the window given start the count again.
    let forget = |now: i64| now - 60_000;
    assert_eq!(db.login_failures("alice").await.unwrap(), None);
    for (i, now) in [T0, T0 + 1, T0 + 2].into_iter().enumerate() {
        assert_eq!(
            db.count_login_failure("alice", now, forget(now))
                .await
                .unwrap(),
            seen(i as i64 + 1, now)
        );
    }
    assert_eq!(
        db.login_failures("alice").await.unwrap(),
        Some(seen(3, T0 + 2))
    );
    assert_eq!(db.login_failures("bob").await.unwrap(), None, "per name");
    // A failure a window after the latest starts again.
    let late = T0 + 2 + 60_001;
    assert_eq!(
        db.count_login_failure("alice", late, forget(late))
            .await
            .unwrap(),
        seen(1, late)
    );
    db.login_succeeded("alice").await.unwrap();
    assert_eq!(
        db.login_failures("alice").await.unwrap(),
        None,
        "a success clears"
    );
    assert_eq!(
        db.count_login_failure("alice", late + 1, forget(late + 1))
            .await
            .unwrap(),
        seen(1, late + 1)
    );
    // Concurrent failures all count: exactly one sees each number.
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move {
                db.count_login_failure("carol", T0, forget(T0))
                    .await
                    .unwrap()
                    .failures
            })
        })
        .collect();
    let mut counted = Vec::new();
    for t in tasks {
        counted.push(t.await.unwrap());
    }
    counted.sort_unstable();
    assert_eq!(counted, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(
        db.purge_stats(T0 + 200_000).await.unwrap(),
        2,
        "old counters are purged"
    );
    assert_eq!(db.login_failures("carol").await.unwrap(), None);
}

async fn delivery_ids_are_taken_once(db: &Db) {
    use ballast::store::NewCallback;
    let cb = |provider: &str, id: &str, now: i64| NewCallback {
        provider: provider.into(),
        job_id: "job-1".into(),
        body: json!({ "job_id": "job-1", "status": "succeeded" }),
        now,
        delivery_ids: vec![id.into()],
    };
    assert_eq!(
        db.record_callback(&cb("p", "d1", T0)).await.unwrap(),
        None,
        "stored, no step yet"
    );
    assert!(
        matches!(
            db.record_callback(&cb("p", "d1", T0 + 1)).await,
            Err(StoreError::Conflict { .. })
        ),
        "a redelivery"
    );
    assert_eq!(
        db.pending_callbacks("p", "job-1").await.unwrap().len(),
        1,
        "stored once"
    );
    db.record_callback(&cb("q", "d1", T0)).await.unwrap();
    db.forget_delivery("p", "d1").await.unwrap();
    db.record_callback(&cb("p", "d1", T0 + 2)).await.unwrap();
    assert_eq!(
        db.pending_callbacks("p", "job-1").await.unwrap().len(),
        2,
        "given back after a failure"
    );
    let without = NewCallback {
        delivery_ids: Vec::new(),
        ..cb("p", "", T0 + 3)
    };
    db.record_callback(&without).await.unwrap();
    db.record_callback(&without).await.unwrap();
    assert_eq!(
        db.pending_callbacks("p", "job-1").await.unwrap().len(),
        4,
        "no id, no deduplication"
    );
    assert_eq!(
        db.purge_stats(T0 + 1).await.unwrap(),
        1,
        "old ids are purged"
    );
    assert!(db.record_callback(&cb("p", "d1", T0 + 3)).await.is_err());
    // Two ids (the provider's and the signature's): either seen before
    // makes a duplicate, and neither is taken then.
    let both = |ids: &[&str]| NewCallback {
        delivery_ids: ids.iter().map(|s| s.to_string()).collect(),
        ..cb("p", "", T0 + 4)
    };
    db.record_callback(&both(&["d2", "sig:a"])).await.unwrap();
    for replay in [&["sig:a"][..], &["d3", "sig:a"], &["d2", "sig:b"]] {
        assert!(
            matches!(
                db.record_callback(&both(replay)).await,
                Err(StoreError::Conflict { .. })
            ),
            "{replay:?} is a duplicate"
        );
    }
    db.record_callback(&both(&["d3", "sig:b"])).await.unwrap();
    // Deliveries no step took (no record) go once their window has passed.
    let pending = db.pending_callbacks("p", "job-1").await.unwrap().len() as u64;
    // Provider q's one goes too.
    assert_eq!(
        db.purge_orphan_deliveries(T0 + 4).await.unwrap(),
        pending - 2 + 1
    );
    assert_eq!(db.pending_callbacks("p", "job-1").await.unwrap().len(), 2);
    assert_eq!(db.purge_orphan_deliveries(T0 + 5).await.unwrap(), 2);
    assert!(db.pending_callbacks("p", "job-1").await.unwrap().is_empty());
}

async fn rollups_are_replaced_per_node_and_purged(db: &Db) {
    use ballast::store::StepRollup;
    let row = |node: &str, minute: i64, calls: i64| StepRollup {
        minute,
        node: node.into(),
        pipeline: "p".into(),
        step: "s".into(),
        provider: "x".into(),
        calls,
        succeeded: calls,
        latency: vec![calls, 0, 1],
        ..StepRollup::default()
    };
    db.save_rollups(&[row("n1", T0, 3), row("n2", T0, 4)])
        .await
        .unwrap();
    db.save_rollups(&[row("n1", T0, 5)]).await.unwrap();
    db.save_rollups(&[row("n1", T0 + 60_000, 1)]).await.unwrap();
    let all = db.rollups_since(T0).await.unwrap();
    assert_eq!(all.len(), 3);
    let n1: Vec<_> = all
        .iter()
        .filter(|r| r.node == "n1" && r.minute == T0)
        .collect();
    assert_eq!(
        (n1[0].calls, n1[0].latency.clone()),
        (5, vec![5, 0, 1]),
        "replaced, not added"
    );
    assert_eq!(db.rollups_since(T0 + 1).await.unwrap().len(), 1);
    assert_eq!(db.purge_stats(T0 + 1).await.unwrap(), 2);
    assert_eq!(db.rollups_since(0).await.unwrap().len(), 1);
}

/// Minute rows more than an hour past become hour rows (issue 21: a day's
/// figures read 24 rows per step and node, not 1,440): every figure and
/// histogram bucket summed the same before and after, a late minute row
/// added to its hour, compactions run at once folding each minute once,
/// and hour rows read and purged by the hour they cover.
async fn rollups_fold_into_hours(db: &Db) {
    use ballast::store::{HOUR_MS, StepRollup};
    let row = |node: &str, k: i64| StepRollup {
        minute: T0 + k * 60_000,
        node: node.into(),
        pipeline: "p".into(),
        step: "s".into(),
        provider: "x".into(),
        calls: k + 1,
        succeeded: k,
        failed: 1,
        records_parked: k % 2,
        latency: vec![1, k, 0],
        runs_succeeded: 1,
        run_latency: vec![0, k + 2],
        ..StepRollup::default()
    };
    let total = |rows: &[StepRollup]| {
        let mut sum = StepRollup::default();
        rows.iter().for_each(|r| sum.add(r));
        sum
    };
    // Three hours of two nodes' minutes.
    let minutes: Vec<StepRollup> = ["n1", "n2"]
        .iter()
        .flat_map(|n| (0..180).map(move |k| row(n, k)))
        .collect();
    db.save_rollups(&minutes).await.unwrap();
    let before = total(&db.rollups_since(T0).await.unwrap());
    assert_eq!(before, total(&minutes));

    // Folded three times at once (three nodes' housekeeping): each minute
    // once.
    let cut = T0 + 2 * HOUR_MS;
    let (a, b, c) = tokio::join!(
        db.compact_rollups(cut),
        db.compact_rollups(cut),
        db.compact_rollups(cut)
    );
    assert_eq!(a.unwrap() + b.unwrap() + c.unwrap(), 240);
    let after = db.rollups_since(T0).await.unwrap();
    assert_eq!(
        after.len(),
        2 * (2 + 60),
        "two hour rows and an hour of minutes per node"
    );
    assert_eq!(total(&after), before, "the same figures, bucket by bucket");
    let hours: Vec<_> = after.iter().filter(|r| r.minute < cut).collect();
    assert!(hours.iter().all(|r| r.minute % HOUR_MS == 0));
    let n1_first = hours
        .iter()
        .find(|r| r.node == "n1" && r.minute == T0)
        .unwrap();
    assert_eq!(n1_first.calls, (1..=60).sum::<i64>());
    assert_eq!(n1_first.latency, vec![60, (0..60).sum::<i64>(), 0]);
    assert_eq!(
        db.compact_rollups(cut).await.unwrap(),
        0,
        "nothing left to fold"
    );

    // A minute written late (a node that could not write for a while)
    // joins its hour's row.
    let late = row("n1", 7);
    db.save_rollups(std::slice::from_ref(&late)).await.unwrap();
    assert_eq!(db.compact_rollups(cut).await.unwrap(), 1);
    let mut want = before.clone();
    want.add(&late);
    assert_eq!(total(&db.rollups_since(T0).await.unwrap()), want);

    // An hour row is read while any of its hour is asked for, and purged
    // when all of it is past.
    let since = db.rollups_since(T0 + HOUR_MS + 1).await.unwrap();
    assert_eq!(
        since.iter().filter(|r| r.minute < cut).count(),
        2,
        "the second hour's rows, not the first's"
    );
    assert_eq!(db.purge_stats(T0 + HOUR_MS).await.unwrap(), 2);
    assert_eq!(db.rollups_since(0).await.unwrap().len(), 2 * (1 + 60));
}

/// The age of a backlog (`/metrics`): per pipeline asked for, when its
/// oldest record due fell due; a pipeline with nothing due, or a record
/// due later or held under a live lease, counts for nothing.
async fn the_oldest_due_record_per_pipeline(db: &Db) {
    for (p, k, at) in [
        ("a", "a1", T0 - 5_000),
        ("a", "a2", T0 - 9_000),
        ("b", "b1", T0 + 60_000),
        ("c", "c1", T0 - 1_000),
    ] {
        db.create_record(new_record(p, Some(k), at), T0 - 10_000)
            .await
            .unwrap();
    }
    // `c`'s one record is taken by a worker: not waiting any more.
    // (A claim shares its batch between the queues: claimed until all
    // three due are held.)
    let mut held = Vec::new();
    while held.len() < 3 {
        let more = db.claim_due(&claim("w", T0, 3)).await.unwrap();
        assert!(!more.is_empty(), "{held:?}");
        held.extend(more);
    }
    assert_eq!(held.len(), 3);
    let c = held.iter().find(|r| r.pipeline == "c").unwrap();
    db.release(&[c.lease().unwrap()], T0).await.unwrap();
    let others: Vec<_> = held.iter().filter(|r| r.pipeline == "a").collect();
    assert_eq!(others.len(), 2);
    let names: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
    // `a`'s two are running under live leases (due at their expiry);
    // `c` was given back, due again now.
    let due = db.oldest_due(&names, T0).await.unwrap();
    assert_eq!(due, [("c".to_owned(), T0)]);
    // Past the leases' expiry, `a`'s records are due again.
    let later = T0 + 600_000;
    let due = db.oldest_due(&names, later).await.unwrap();
    assert_eq!(due.len(), 3, "{due:?}");
    assert!(due.iter().all(|(_, at)| *at <= later));
}

/// Every id `f` lists, page after page (`f.limit` a page), in list order.
async fn paged_ids(db: &Db, f: RecordFilter) -> Vec<i64> {
    crate::helpers::listed(db, &f)
        .await
        .iter()
        .map(|r| r.id)
        .collect()
}

/// Every list filter finds running records beside resting ones (on
/// PostgreSQL the listing indexes leave running records out and a list
/// reads them apart, merged: migration 20), pages included; the oldest due
/// record of a pipeline is found across its groups.
async fn running_records_are_listed_by_every_filter(db: &Db) {
    let mk = |k: &str, at: i64| new_record("alpha", Some(k), at);
    let run = db.create_record(mk("run-1", T0), T0).await.unwrap().record;
    let parked = db
        .create_record(mk("rest-1", T0 + 1), T0)
        .await
        .unwrap()
        .record;
    let pending = db
        .create_record(mk("rest-2", T0 + 600_000), T0)
        .await
        .unwrap()
        .record;
    let failing = |lease, now, result| Commit {
        next_run_at: Some(T0 + 5),
        step: Some("fetch".into()),
        provider: Some("acme".into()),
        error_code: Some("http_5xx".into()),
        ..Commit::new(lease, now, Some(result))
    };
    // `run-1` fails once and is taken again: running, keeping its step,
    // provider and error code; `rest-1` is parked with the same.
    let r = db.claim_due(&claim("w", T0, 1)).await.unwrap().remove(0);
    assert_eq!(r.id, run.id);
    db.commit(&failing(r.lease().unwrap(), T0, WorkResult::RetryScheduled))
        .await
        .unwrap();
    let r = db
        .claim_due(&claim("w", T0 + 1, 1))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(r.id, parked.id);
    db.commit(&failing(r.lease().unwrap(), T0 + 1, WorkResult::Parked))
        .await
        .unwrap();
    let r = db
        .claim_due(&claim("w", T0 + 5, 1))
        .await
        .unwrap()
        .remove(0);
    assert_eq!((r.id, r.state), (run.id, RecordState::Running));
    assert_eq!(r.error_code.as_deref(), Some("http_5xx"));

    let ids = |f: RecordFilter| async move {
        let f = RecordFilter { limit: 50, ..f };
        let page = db.list_records(&f).await.unwrap();
        page.items.iter().map(|r| r.id).collect::<Vec<i64>>()
    };
    let all = vec![pending.id, parked.id, run.id];
    let two = vec![parked.id, run.id];
    let pipeline = || RecordFilter {
        pipeline: Some("alpha".into()),
        ..Default::default()
    };
    assert_eq!(ids(pipeline()).await, all);
    let provider = RecordFilter {
        provider: Some("acme".into()),
        ..Default::default()
    };
    assert_eq!(ids(provider).await, two);
    let step = RecordFilter {
        step: Some("fetch".into()),
        ..Default::default()
    };
    assert_eq!(ids(step).await, two);
    let code = RecordFilter {
        error_code: Some("http_5xx".into()),
        ..Default::default()
    };
    assert_eq!(ids(code).await, two);
    let key = |k: &str| RecordFilter {
        key_prefix: Some(k.into()),
        ..Default::default()
    };
    assert_eq!(ids(key("run-")).await, [run.id]);
    assert_eq!(ids(key("rest-")).await, [pending.id, parked.id]);
    let state = |s| RecordFilter {
        state: Some(s),
        ..Default::default()
    };
    assert_eq!(ids(state(RecordState::Running)).await, [run.id]);
    assert_eq!(ids(state(RecordState::Parked)).await, [parked.id]);
    // Two filters: in id windows, both parts; or a pipeline with a state
    // (its own index); or anything among running records.
    let acme_here = RecordFilter {
        provider: Some("acme".into()),
        ..pipeline()
    };
    assert_eq!(ids(acme_here.clone()).await, two);
    // Paged one by one, in windows and parts alike.
    let one_a_page = RecordFilter {
        limit: 1,
        ..acme_here
    };
    assert_eq!(paged_ids(db, one_a_page).await, two);
    let never_here = RecordFilter {
        until: Some(ballast::domain::park::UntilKind::Never),
        ..pipeline()
    };
    assert_eq!(ids(never_here).await, [parked.id]);
    let running_acme = RecordFilter {
        state: Some(RecordState::Running),
        provider: Some("acme".into()),
        ..pipeline()
    };
    assert_eq!(ids(running_acme).await, [run.id]);
    let running_here = RecordFilter {
        state: Some(RecordState::Running),
        ..pipeline()
    };
    assert_eq!(ids(running_here).await, [run.id]);
    let parked_here = RecordFilter {
        state: Some(RecordState::Parked),
        ..pipeline()
    };
    assert_eq!(ids(parked_here).await, [parked.id]);
    // One a page: the merged parts page like one list.
    let one_a_page = RecordFilter {
        limit: 1,
        ..pipeline()
    };
    assert_eq!(paged_ids(db, one_a_page).await, all);
    let found: Vec<i64> = db
        .find_records("run-1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(found, [run.id]);

    // The oldest due of a pipeline, whichever of its groups holds it.
    for (group, key, at) in [
        (Some("t1"), "g1", T0 - 3_000),
        (Some("t2"), "g2", T0 - 7_000),
        (None, "g0", T0 - 1_000),
    ] {
        db.create_record(grouped("gamma", group, key.into(), at), T0 - 10_000)
            .await
            .unwrap();
    }
    let gamma = ["gamma".to_owned()];
    assert_eq!(
        db.oldest_due(&gamma, T0).await.unwrap(),
        [("gamma".to_owned(), T0 - 7_000)]
    );
    assert!(db.oldest_due(&gamma, T0 - 8_000).await.unwrap().is_empty());
}

async fn meta_values_are_set_once(db: &Db) {
    let a = db.ensure_meta("session_secret", "first").await.unwrap();
    let b = db.ensure_meta("session_secret", "second").await.unwrap();
    assert_eq!((a.as_str(), b.as_str()), ("first", "first"));
}

async fn batch_enqueue_is_one_transaction_and_idempotent(db: &Db) {
    db.create_record(new_record("p", Some("old"), T0), T0)
        .await
        .unwrap();
    let batch = vec![
        new_record("p", Some("a"), T0),
        new_record("p", Some("old"), T0),
        new_record("p", Some("a"), T0),
        new_record("p", None, T0),
    ];
    let out = db.create_records(batch, T0).await.unwrap();
    let created: Vec<bool> = out.iter().map(|c| c.created).collect();
    assert_eq!(created, vec![true, false, false, true]);
    assert_eq!(
        out[0].record.id, out[2].record.id,
        "a repeat within the batch finds the first"
    );
    assert_eq!(out[1].record.external_key.as_deref(), Some("old"));
    assert_counts_consistent(db).await;
    assert_eq!(db.recount_states().await.unwrap()[0].count, 3);
    let too_many = (0..=ballast::store::MAX_BATCH)
        .map(|_| new_record("p", None, T0))
        .collect();
    assert!(matches!(
        db.create_records(too_many, T0).await,
        Err(StoreError::Invalid(_))
    ));
    let bad = vec![new_record("p", Some("z"), T0), new_record("", None, T0)];
    assert!(db.create_records(bad, T0).await.is_err());
    assert!(
        db.list_records(&RecordFilter {
            key_prefix: Some("z".into()),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .items
        .is_empty(),
        "a refused batch writes nothing"
    );
    let events = db.record_events(out[0].record.id).await.unwrap();
    assert_eq!(events.iter().filter(|e| e.kind == "created").count(), 1);
}

/// A step's output in the group-commit test: none, a JSON `null` (kept
/// apart from none), or an object.
fn output_of(i: usize) -> Option<serde_json::Value> {
    match i % 4 {
        0 => None,
        1 => Some(serde_json::Value::Null),
        _ => Some(json!({ "i": i, "s": "a \"quoted\" ✓" })),
    }
}

/// `commit_many` over more records than one multi-row statement holds:
/// every pass lands as `commit` would write it, a stale lease refuses only
/// its own pass, and a group naming a record twice is refused whole.
async fn group_commit_writes_each_pass_and_refuses_only_stale_ones(db: &Db) {
    let n = 300;
    let batch = (0..n)
        .map(|i| new_record("p", Some(&format!("g{i}")), T0))
        .collect();
    db.create_records(batch, T0).await.unwrap();
    let claimed = db.claim_due(&claim("w1", T0, n)).await.unwrap();
    assert_eq!(claimed.len(), n as usize);
    let results = [
        Some(WorkResult::Completed),
        Some(WorkResult::RetryScheduled),
        Some(WorkResult::Parked),
        Some(WorkResult::Waiting),
        None,
    ];
    let mut commits = Vec::new();
    for (i, r) in claimed.iter().enumerate() {
        let result = results[i % results.len()];
        let mut lease = r.lease().unwrap();
        if i == 7 {
            lease.token -= 1; // a stale worker's pass
        }
        let mut c = Commit::new(lease, T0 + 100 + i as i64, result);
        c.next_run_at = Some(T0 + 10_000);
        c.step = Some("fetch".into());
        c.provider = Some(format!("prov{}", i % 3));
        if result == Some(WorkResult::Parked) {
            c.error_code = Some("unknown_reply".into());
            // Cells travel inside a JSON array: quotes, escapes and
            // non-ASCII text come back as written.
            c.reason = Some(format!("parked \"{i}\" ✓\n\\ {{}}"));
        }
        let mut step = StepWrite::pending("fetch");
        step.state = StepState::Succeeded;
        step.attempts = 1;
        step.output = output_of(i);
        c.steps = vec![step];
        c.attempts = (0..1 + i % 2)
            .map(|k| attempt("fetch", k as i32 + 1, 200, Outcome::Success, "{}"))
            .collect();
        commits.push(c);
    }
    let twice = vec![commits[0].clone(), commits[0].clone()];
    assert!(matches!(
        db.commit_many(&twice).await,
        Err(StoreError::Invalid(_))
    ));
    assert!(db.attempts(claimed[0].id).await.unwrap().is_empty());

    let out = db.commit_many(&commits).await.unwrap();
    assert_eq!(out.len(), commits.len());
    for (i, (c, r)) in commits.iter().zip(&out).enumerate() {
        let id = c.lease.record_id;
        if i == 7 {
            assert!(matches!(r, Err(StoreError::LeaseLost { record_id }) if *record_id == id));
            assert!(db.attempts(id).await.unwrap().is_empty());
            assert_eq!(
                db.get_record(id).await.unwrap().unwrap().state,
                RecordState::Running
            );
            continue;
        }
        let after = r.as_ref().unwrap();
        assert_eq!(
            Some(after),
            db.get_record(id).await.unwrap().as_ref(),
            "the record returned is the record stored ({i})"
        );
        let expected = match c.result {
            None => RecordState::Running,
            Some(WorkResult::Completed) => RecordState::Succeeded,
            Some(WorkResult::RetryScheduled) => RecordState::Retrying,
            Some(WorkResult::Parked) => RecordState::Parked,
            Some(_) => RecordState::Waiting,
        };
        assert_eq!(after.state, expected);
        assert_eq!(after.provider, c.provider);
        assert_eq!(db.attempts(id).await.unwrap().len(), c.attempts.len());
        let steps = db.step_runs(id).await.unwrap();
        assert_eq!(steps[0].output, output_of(i), "output of {i}");
        assert_eq!(after.reason, c.reason);
        let events = db.record_events(id).await.unwrap();
        let worked = usize::from(c.result.is_some());
        assert_eq!(events.len(), 2 + worked, "created, claimed, and the result");
    }
    let parked = out
        .iter()
        .flatten()
        .find(|r| r.state == RecordState::Parked)
        .unwrap();
    assert_eq!(parked.error_code.as_deref(), Some("unknown_reply"));
    assert!(parked.next_run_at.is_none() && parked.finished_at.is_none());
    let done = out
        .iter()
        .flatten()
        .find(|r| r.state == RecordState::Succeeded)
        .unwrap();
    assert!(done.finished_at.is_some() && done.next_run_at.is_none());
    let step_runs = db
        .step_runs_of(&claimed.iter().map(|r| r.id).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(step_runs.len(), n as usize - 1);
    assert_counts_consistent(db).await;
}

/// A claim writes no event row (migration 34): the event that ends the
/// pass keeps when it was claimed, and a record's events put each claim
/// back, with its node and time, lapsed passes and the pass under way
/// included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_is_folded_into_its_pass_end() {
    for backend in [
        ballast::store::Backend::Sqlite,
        ballast::store::Backend::Postgres,
    ] {
        let Some(t) = crate::helpers::TestDb::migrated(backend, "claims_folded").await else {
            continue;
        };
        let db = &t.db;
        let rec = db
            .create_record(new_record("p", Some("x"), T0), T0)
            .await
            .unwrap()
            .record;
        let a = db.claim_due(&claim("a", T0 + 5, 10)).await.unwrap();
        // A checkpoint mid-pass (the record stays running) moves
        // `updated_at`, not the claim's time.
        let mid = db
            .commit(&Commit::new(a[0].lease().unwrap(), T0 + 10, None))
            .await
            .unwrap();
        assert_eq!(
            (mid.state, mid.updated_at, mid.claimed_at),
            (RecordState::Running, T0 + 10, Some(T0 + 5))
        );
        let seen = |events: Vec<ballast::domain::Event>| -> Vec<(String, String, i64)> {
            events
                .into_iter()
                .map(|e| (e.kind, e.actor, e.at))
                .collect()
        };
        let s = |v: &str| v.to_owned();
        assert_eq!(
            seen(db.record_events(rec.id).await.unwrap()),
            vec![
                (s("created"), s("system"), T0),
                (s("claimed"), s("node:a"), T0 + 5)
            ],
            "{backend:?}: the pass under way"
        );
        assert_eq!(
            stored_events(&t, rec.id).await,
            1,
            "{backend:?}: no row for the claim"
        );
        // a's lease runs out; b takes the record over and finishes it.
        let b = db.claim_due(&claim("b", T0 + 30_005, 10)).await.unwrap();
        assert_eq!(b[0].lease_token, a[0].lease_token + 1);
        db.commit(&Commit::new(b[0].lease().unwrap(), T0 + 30_050, None))
            .await
            .unwrap();
        db.commit(&Commit::new(
            b[0].lease().unwrap(),
            T0 + 30_100,
            Some(WorkResult::Completed),
        ))
        .await
        .unwrap();
        let events = db.record_events(rec.id).await.unwrap();
        let froms: Vec<Option<RecordState>> = events.iter().map(|e| e.from_state).collect();
        assert_eq!(
            seen(events),
            vec![
                (s("created"), s("system"), T0),
                (s("claimed"), s("node:a"), T0 + 5),
                (s("lease_expired"), s("node:b"), T0 + 30_005),
                (s("claimed"), s("node:b"), T0 + 30_005),
                (s("completed"), s("node:b"), T0 + 30_100),
            ],
            "{backend:?}"
        );
        use RecordState::*;
        assert_eq!(
            froms,
            vec![
                None,
                Some(Pending),
                Some(Running),
                Some(Pending),
                Some(Running)
            ]
        );
        assert_eq!(
            stored_events(&t, rec.id).await,
            3,
            "{backend:?}: created, lease_expired, completed"
        );
        assert_counts_consistent(db).await;
    }
}

/// The rows `events` holds for a record, read past the store.
async fn stored_events(t: &crate::helpers::TestDb, record_id: i64) -> i64 {
    use sqlx::Connection;
    let sql = "SELECT COUNT(*) FROM events WHERE record_id = $1";
    if t.pg_name().is_some() {
        let mut c = sqlx::PgConnection::connect(&t.url).await.unwrap();
        sqlx::query_scalar(sql)
            .bind(record_id)
            .fetch_one(&mut c)
            .await
            .unwrap()
    } else {
        let mut c = sqlx::SqliteConnection::connect(&t.url).await.unwrap();
        sqlx::query_scalar(sql)
            .bind(record_id)
            .fetch_one(&mut c)
            .await
            .unwrap()
    }
}
