//! A step for each item (`for_each`): one call per item, each with its
//! own attempts and idempotency key, at most `max_parallel` of a record
//! at once, the outputs in item order; `items_required` lets some fail;
//! a retry runs only the failed items. Both backends, on a clock the
//! test moves, against a real HTTP provider.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use ballast::config::Config;
use ballast::domain::{OperatorAction, RecordState, StepState};
use ballast::engine::{ActExtra, Enqueue, Ops};
use ballast::store::Backend;
use serde_json::{Value, json};

use crate::engine::{drive_at_rest, manual_engine};
use crate::helpers::TestDb;

/// Enqueues one record of `pipeline`; its id.
async fn enqueue(
    engine: &ballast::engine::Engine,
    pipeline: &str,
    key: Option<&str>,
    input: Value,
) -> i64 {
    let e = Enqueue::new(pipeline, key, input);
    engine.enqueue(e).await.unwrap().record.id
}

/// What the provider saw.
#[derive(Default)]
struct Seen {
    /// Item calls now under way, and the most at once.
    in_flight: usize,
    most: usize,
    /// Each item's calls: the idempotency keys sent, in order.
    calls: BTreeMap<u64, Vec<String>>,
    /// Items that answer 500 once, then succeed.
    flaky: HashSet<u64>,
    /// Items that answer 400 (a failure) while listed.
    failing: HashSet<u64>,
    /// Items that never answer while listed.
    hanging: HashSet<u64>,
    /// What the merge was sent.
    merged: Option<Value>,
}

#[derive(Clone)]
struct Provider {
    seen: Arc<Mutex<Seen>>,
    /// How many item calls have started: the first three wait until all
    /// three are under way, so the most at once is seen, not guessed.
    started: Arc<tokio::sync::watch::Sender<usize>>,
}

async fn item(
    State(p): State<Provider>,
    UrlPath(n): UrlPath<u64>,
    headers: HeaderMap,
) -> (StatusCode, axum::Json<Value>) {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let first_three = {
        let mut s = p.seen.lock().unwrap();
        s.in_flight += 1;
        s.most = s.most.max(s.in_flight);
        s.calls.entry(n).or_default().push(key);
        let mut started = 0;
        p.started.send_modify(|c| {
            *c += 1;
            started = *c;
        });
        started <= 3
    };
    if first_three {
        let mut rx = p.started.subscribe();
        let _ = rx.wait_for(|c| *c >= 3).await;
    }
    let hangs = p.seen.lock().unwrap().hanging.contains(&n);
    if hangs {
        p.seen.lock().unwrap().in_flight -= 1;
        std::future::pending::<()>().await;
    }
    let mut s = p.seen.lock().unwrap();
    s.in_flight -= 1;
    if s.flaky.remove(&n) {
        return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(json!({})));
    }
    if s.failing.contains(&n) {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({ "error": "no" })),
        );
    }
    (StatusCode::OK, axum::Json(json!({ "double": n * 2 })))
}

async fn provider() -> (String, Provider) {
    let p = Provider {
        seen: Arc::default(),
        started: Arc::new(tokio::sync::watch::channel(0).0),
    };
    let app = axum::Router::new()
        .route(
            "/v1/split",
            axum::routing::post(|| async {
                let parts: Vec<Value> = (0..10).map(|n| json!({ "n": n })).collect();
                axum::Json(json!({ "parts": parts }))
            }),
        )
        .route("/v1/item/{n}", axum::routing::post(item))
        .route(
            "/v1/merge",
            axum::routing::post(
                |State(p): State<Provider>, axum::Json(body): axum::Json<Value>| async move {
                    let count = body.as_array().map_or(0, Vec::len);
                    p.seen.lock().unwrap().merged = Some(body);
                    axum::Json(json!({ "count": count }))
                },
            ),
        )
        .with_state(p.clone());
    (crate::helpers::serve_router(app).await, p)
}

/// `fan`: split, a call for each part (three at once), then a merge of
/// the outputs. `some`: a call for each item of the input, three of
/// five required. `all`: the same, all required.
fn config(base_url: &str) -> Arc<Config> {
    let text = pipelines_toml(base_url);
    let config = Config::parse(&text, Path::new("for-each.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    ballast::pipeline::compile(&config).unwrap();
    Arc::new(config)
}

/// [`config`]'s text.
fn pipelines_toml(base_url: &str) -> String {
    format!(
        r#"
[providers.p]
base_url = "{base_url}"
timeout = "10s"
retry = {{ max_attempts = 3, base = "1s", cap = "1s", deadline = "1h" }}
[[providers.p.rules]]
when = {{ status = ["400"] }}
outcome = "fail"
[[providers.p.rules]]
when = {{ status = "2xx" }}
outcome = "success"

[[pipelines.fan.steps]]
name = "split"
provider = "p"
request = {{ method = "POST", path = "/v1/split" }}
outputs = {{ parts = "/parts" }}

[[pipelines.fan.steps]]
name = "each"
provider = "p"
needs = ["split"]
for_each = "/steps/split/output/parts"
max_parallel = 3
request = {{ method = "POST", path = "/v1/item/{{{{ item.n }}}}" }}
outputs = {{ doubled = "/double" }}

[[pipelines.fan.steps]]
name = "merge"
provider = "p"
needs = ["each"]
request = {{ method = "POST", path = "/v1/merge", body = '{{{{ steps.each.output | tojson }}}}', headers = {{ "Content-Type" = "application/json" }} }}

[[pipelines.some.steps]]
name = "each"
provider = "p"
for_each = "/input/items"
items_required = 3
request = {{ method = "POST", path = "/v1/item/{{{{ item }}}}" }}
outputs = {{ doubled = "/double" }}

[providers.q]
base_url = "{base_url}"
timeout = "300ms"
at_most_once = true
[[providers.q.rules]]
when = {{ status = "2xx" }}
outcome = "success"

[[pipelines.once.steps]]
name = "each"
provider = "q"
for_each = "/input/items"
request = {{ method = "POST", path = "/v1/item/{{{{ item }}}}" }}
outputs = {{ doubled = "/double" }}

[[pipelines.all.steps]]
name = "each"
provider = "p"
for_each = "/input/items"
max_parallel = 2
request = {{ method = "POST", path = "/v1/item/{{{{ item }}}}" }}
outputs = {{ at = "/double" }}
"#
    )
}

async fn items_fan_out_within_their_cap_and_come_back_in_order(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "for_each_fan").await else {
        return;
    };
    let (url, p) = provider().await;
    p.seen.lock().unwrap().flaky.insert(4);
    let (engine, clock) = manual_engine(&t.db, config(&url), "n1").await;
    let id = enqueue(&engine, "fan", Some("r1"), json!({})).await;
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;

    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    let expected: Vec<Value> = (0..10).map(|n| json!({ "doubled": n * 2 })).collect();
    {
        let seen = p.seen.lock().unwrap();
        assert_eq!(seen.most, 3, "three items at once, never more");
        assert_eq!(seen.calls.len(), 10, "{:?}", seen.calls);
        let mut keys = HashSet::new();
        for (n, sent) in &seen.calls {
            let calls = if *n == 4 { 2 } else { 1 };
            assert_eq!(sent.len(), calls, "item {n}: {sent:?}");
            assert!(
                sent.iter().all(|k| k == &sent[0]),
                "one key per item: {sent:?}"
            );
            assert!(sent[0].ends_with(&format!("-each#{n}-0")), "{}", sent[0]);
            keys.insert(sent[0].clone());
        }
        assert_eq!(keys.len(), 10, "a key of its own for each item");
        assert_eq!(seen.merged, Some(Value::Array(expected.clone())));
    }

    let runs = t.db.step_runs(id).await.unwrap();
    let each = runs.iter().find(|r| r.step == "each").unwrap();
    assert_eq!(each.output, Some(Value::Array(expected)));
    assert!(
        runs.iter().all(|r| !r.step.contains('#')),
        "items are not among the record's steps: {runs:?}"
    );
    let items = t.db.item_runs(id, "each", 0, 100).await.unwrap();
    assert_eq!(items.len(), 10);
    assert_eq!(items[4].attempts, 2, "{:?}", items[4]);
    let attempts = t.db.attempts(id).await.unwrap();
    let of_item4 = attempts.iter().filter(|a| a.step == "each#4").count();
    assert_eq!(of_item4, 2, "each item's attempts under its own name");

    // A replay from the step runs every item again, each with a new key;
    // the first results are kept as versions.
    let config = config(&url);
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let extra = ActExtra {
        step: Some("each"),
        ..ActExtra::default()
    };
    let reason = Some("the items changed".to_owned());
    ops.act_with(id, OperatorAction::ReplayFrom, "ann", reason, extra)
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    {
        let seen = p.seen.lock().unwrap();
        for (n, sent) in &seen.calls {
            let last = sent.last().unwrap();
            assert!(last.ends_with(&format!("-each#{n}-1")), "{n}: {sent:?}");
        }
    }
    let versions = t.db.step_versions(id).await.unwrap();
    let items = versions.iter().filter(|v| v.step.starts_with("each#"));
    assert_eq!(items.count(), 10, "{versions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_items_fan_out_within_their_cap_and_come_back_in_order() {
    items_fan_out_within_their_cap_and_come_back_in_order(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_items_fan_out_within_their_cap_and_come_back_in_order() {
    items_fan_out_within_their_cap_and_come_back_in_order(Backend::Postgres).await;
}

async fn some_items_may_fail_and_a_retry_runs_only_the_failed(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "for_each_some").await else {
        return;
    };
    let (url, p) = provider().await;
    p.seen.lock().unwrap().failing.extend([1, 2]);
    let config = config(&url);
    let (engine, clock) = manual_engine(&t.db, config.clone(), "n1").await;
    let items = json!({ "items": [0, 1, 2, 3, 4] });
    let some = enqueue(&engine, "some", Some("s1"), items.clone()).await;
    let all = enqueue(&engine, "all", Some("a1"), items).await;
    drive_at_rest(&engine, &clock, 2, 1_000, 60_000).await;

    // Three of five succeeded: enough; the failed ones are null.
    let r = t.db.get_record(some).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    let runs = t.db.step_runs(some).await.unwrap();
    assert_eq!(
        runs[0].output,
        Some(json!([{ "doubled": 0 }, null, null, { "doubled": 6 }, { "doubled": 8 }]))
    );
    assert_eq!(
        runs[0].reason.as_deref(),
        Some("5 of 5 items done: 3 succeeded, 2 failed")
    );

    // All required: item 1's failure fails the step, and no item starts
    // after it.
    let r = t.db.get_record(all).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Failed, "{r:?}");
    assert_eq!(r.error_code.as_deref(), Some("items_failed"), "{r:?}");
    let before: BTreeMap<String, StepState> =
        t.db.item_runs(all, "each", 0, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|r| (r.step, r.state))
            .collect();
    assert_eq!(before.get("each#1"), Some(&StepState::Failed), "{before:?}");

    // The provider mends; a retry runs the failed items and the rest,
    // never again the ones that succeeded.
    p.seen.lock().unwrap().failing.clear();
    let calls_before: BTreeMap<u64, usize> = p
        .seen
        .lock()
        .unwrap()
        .calls
        .iter()
        .map(|(n, k)| (*n, k.len()))
        .collect();
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    ops.act_with(all, OperatorAction::Retry, "ann", None, ActExtra::default())
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 2, 1_000, 60_000).await;
    let r = t.db.get_record(all).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    {
        let seen = p.seen.lock().unwrap();
        for (name, state) in &before {
            let n: u64 = name.trim_start_matches("each#").parse().unwrap();
            let again = seen.calls[&n].len() - calls_before[&n];
            let expected = usize::from(*state != StepState::Succeeded);
            assert_eq!(again, expected, "{name} was {state:?}");
        }
    }
    let runs = t.db.step_runs(all).await.unwrap();
    let at: Vec<Value> = [0, 1, 2, 3, 4]
        .iter()
        .map(|n| json!({ "at": n * 2 }))
        .collect();
    assert_eq!(runs[0].output, Some(Value::Array(at)));
}

/// A replay from a step for each item may take only its failed items:
/// those run again, each with a new idempotency key, those that
/// succeeded are not sent again and keep their outputs, and the step's
/// output is the whole list again; a plain replay runs every item.
async fn a_replay_can_take_only_the_failed_items(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "for_each_replay_failed").await else {
        return;
    };
    let (url, p) = provider().await;
    p.started.send_replace(3);
    p.seen.lock().unwrap().failing.extend([1, 2]);
    let config = config(&url);
    let (engine, clock) = manual_engine(&t.db, config.clone(), "n1").await;
    let items = json!({ "items": [0, 1, 2, 3, 4] });
    let id = enqueue(&engine, "some", Some("r1"), items).await;
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    let keys_before = p.seen.lock().unwrap().calls.clone();

    p.seen.lock().unwrap().failing.clear();
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let only_failed = ActExtra {
        step: Some("each"),
        failed_items: true,
        ..ActExtra::default()
    };
    let why = Some("provider mended".to_owned());
    ops.act_with(id, OperatorAction::ReplayFrom, "ann", why, only_failed)
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    {
        let seen = p.seen.lock().unwrap();
        for n in 0..5u64 {
            let (before, now) = (&keys_before[&n], &seen.calls[&n]);
            match n {
                1 | 2 => {
                    assert_eq!(now.len(), before.len() + 1, "item {n} sent again once");
                    assert!(!before.contains(now.last().unwrap()), "item {n}: a new key");
                }
                _ => assert_eq!(now, before, "item {n} not sent again"),
            }
        }
    }
    let runs = t.db.step_runs(id).await.unwrap();
    let all: Vec<Value> = (0..5).map(|n| json!({ "doubled": n * 2 })).collect();
    assert_eq!(runs[0].output, Some(Value::Array(all)));
    assert_eq!(
        runs[0].reason.as_deref(),
        Some("5 of 5 items done: 5 succeeded, 0 failed")
    );

    // Only the failed items of the same list: not with a new input.
    let new_list = ActExtra {
        step: Some("each"),
        failed_items: true,
        input: Some(ballast::store::InputEdit {
            new: json!({ "items": [7, 8] }),
            was: None,
        }),
        ..ActExtra::default()
    };
    let refused = ops
        .act_with(id, OperatorAction::ReplayFrom, "ann", None, new_list)
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(refused).code(),
        "items_need_same_list"
    );

    // A plain replay runs every item again.
    let whole = ActExtra {
        step: Some("each"),
        ..ActExtra::default()
    };
    ops.act_with(id, OperatorAction::ReplayFrom, "ann", None, whole)
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let seen = p.seen.lock().unwrap();
    let counts: Vec<usize> = (0..5u64).map(|n| seen.calls[&n].len()).collect();
    let expected: Vec<usize> = (0..5u64)
        .map(|n| keys_before[&n].len() + 1 + usize::from(n == 1 || n == 2))
        .collect();
    assert_eq!(counts, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_replay_can_take_only_the_failed_items() {
    a_replay_can_take_only_the_failed_items(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replay_can_take_only_the_failed_items() {
    a_replay_can_take_only_the_failed_items(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_some_items_may_fail_and_a_retry_runs_only_the_failed() {
    some_items_may_fail_and_a_retry_runs_only_the_failed(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_some_items_may_fail_and_a_retry_runs_only_the_failed() {
    some_items_may_fail_and_a_retry_runs_only_the_failed(Backend::Postgres).await;
}

/// Items of an `at_most_once` provider whose calls time out park the
/// record at the step with their outcome uncertain: "it took effect" is
/// refused while two are, and answers for the one left after a retry;
/// nothing is sent again on a guess.
async fn an_uncertain_item_is_settled_by_an_operator(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "for_each_uncertain").await else {
        return;
    };
    let (url, p) = provider().await;
    p.seen.lock().unwrap().hanging.extend([1, 2]);
    let config = config(&url);
    let (engine, clock) = manual_engine(&t.db, config.clone(), "n1").await;
    let id = enqueue(
        &engine,
        "once",
        Some("u1"),
        json!({ "items": [0, 1, 2, 3] }),
    )
    .await;
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.error_code.as_deref(), r.step.as_deref()),
        (RecordState::Parked, Some("outcome_uncertain"), Some("each")),
        "{r:?}"
    );
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let output = Some(json!({ "doubled": 2 }));
    let several = ops
        .took_effect(id, "olga", None, None, output.clone())
        .await
        .unwrap_err();
    assert!(several.to_string().contains("several"), "{several}");

    // A retry sends the two again (an operator's word); item 2 answers.
    p.seen.lock().unwrap().hanging.remove(&2);
    ops.act_with(id, OperatorAction::Retry, "olga", None, ActExtra::default())
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.error_code.as_deref(), Some("outcome_uncertain"), "{r:?}");
    let rec = ops
        .took_effect(id, "olga", Some("found it".into()), None, output)
        .await
        .unwrap();
    assert_eq!(rec.state, RecordState::Pending);
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    let runs = t.db.step_runs(id).await.unwrap();
    assert_eq!(
        runs[0].output,
        Some(json!([{ "doubled": 0 }, { "doubled": 2 }, { "doubled": 4 }, { "doubled": 6 }]))
    );
    let seen = p.seen.lock().unwrap();
    let calls: Vec<usize> = (0..4).map(|n| seen.calls[&n].len()).collect();
    assert_eq!(calls, [1, 2, 2, 1], "only the retry sent items again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_uncertain_item_is_settled_by_an_operator() {
    an_uncertain_item_is_settled_by_an_operator(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_uncertain_item_is_settled_by_an_operator() {
    an_uncertain_item_is_settled_by_an_operator(Backend::Postgres).await;
}

/// A node that died with item 2's call open and items 0 and 1 not yet
/// sent (they waited for a permit): the next pass finds item 2's call
/// uncertain and parks the record, and writes items 0 and 1 so they are
/// not lost; once an operator says item 2 took effect, 0, 1 and 3 are
/// called once each and 2 never again.
async fn items_a_dead_node_left_are_neither_lost_nor_resent(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "for_each_dead_node").await else {
        return;
    };
    let (url, p) = provider().await;
    let config = config(&url);
    let (engine, clock) = manual_engine(&t.db, config.clone(), "n1").await;
    let id = enqueue(
        &engine,
        "once",
        Some("d1"),
        json!({ "items": [0, 1, 2, 3] }),
    )
    .await;
    let now = ballast::domain::Clock::now_ms(&clock);
    let held =
        t.db.claim_due(&ballast::store::ClaimRequest {
            owner: "ghost".into(),
            now,
            lease: std::time::Duration::from_secs(1),
            limit: 1,
            group_caps: Vec::new(),
        })
        .await
        .unwrap()
        .remove(0);
    let written =
        t.db.record_intents(&[ballast::store::NewIntent {
            lease: held.lease().unwrap(),
            record_id: id,
            step: "each#2".into(),
            provider: Some("q".into()),
            attempt_no: 1,
            node: Some("ghost".into()),
            sent_at: now,
            request: None,
        }])
        .await
        .unwrap();
    assert!(written[0].is_ok(), "{written:?}");
    clock.advance(2_000);
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.error_code.as_deref(), r.step.as_deref()),
        (RecordState::Parked, Some("outcome_uncertain"), Some("each")),
        "{r:?}"
    );
    let items: Vec<String> =
        t.db.item_runs(id, "each", 0, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.step)
            .collect();
    assert_eq!(
        items,
        ["each#0", "each#1", "each#2"],
        "no hole below the open call"
    );
    assert!(
        p.seen.lock().unwrap().calls.is_empty(),
        "nothing sent on a guess"
    );

    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let output = Some(json!({ "doubled": 4 }));
    ops.took_effect(id, "olga", Some("found it".into()), None, output)
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    let seen = p.seen.lock().unwrap();
    let calls: BTreeMap<u64, usize> = seen.calls.iter().map(|(n, k)| (*n, k.len())).collect();
    assert_eq!(calls, BTreeMap::from([(0, 1), (1, 1), (3, 1)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_items_a_dead_node_left_are_neither_lost_nor_resent() {
    items_a_dead_node_left_are_neither_lost_nor_resent(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_items_a_dead_node_left_are_neither_lost_nor_resent() {
    items_a_dead_node_left_are_neither_lost_nor_resent(Backend::Postgres).await;
}

/// A dead node left more items started than `max_parallel` (twice the
/// cap: calls written down, no reply kept, each looked up a call's
/// timeout later, so all come due at once): the next passes run them
/// all, `max_parallel` at a time (a pass once counted the due ones it
/// had not loaded against the cap and ran none, again and again), and
/// every item is submitted once.
async fn more_items_left_started_than_the_cap_all_run(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "for_each_over_cap").await else {
        return;
    };
    let sim = ballast::sim::SimHandle::spawn(ballast::sim::Profile::clean(49))
        .await
        .unwrap();
    let provider = crate::engine::sim_provider_toml(&sim.base_url(), "at_most_once = true")
        .replace(r#"timeout = "300ms""#, r#"timeout = "10s""#);
    let text = format!(
        r#"{provider}
[[pipelines.jobs.steps]]
name = "render"
provider = "sim"
kind = "submit_poll"
for_each = "/input/items"
max_parallel = 2
request = {{ method = "POST", path = "/v1/jobs", body = '{{"client_reference": "{{{{ key }}}}"}}' }}
job_id = "/id"
poll = {{ path = "/v1/jobs/{{{{ job_id }}}}", every = "1s" }}
lookup = {{ path = "/v1/jobs?client_reference={{{{ key | urlencode }}}}", job_id = "/data/0/id" }}
"#
    );
    let config = Config::parse(&text, Path::new("over-cap.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let (engine, clock) = manual_engine(&t.db, Arc::new(config), "n1").await;
    let items = json!({ "items": [0, 1, 2, 3, 4, 5] });
    let id = enqueue(&engine, "jobs", Some("over"), items).await;
    let now = ballast::domain::Clock::now_ms(&clock);
    let held =
        t.db.claim_due(&ballast::store::ClaimRequest {
            owner: "ghost".into(),
            now,
            lease: std::time::Duration::from_secs(1),
            limit: 1,
            group_caps: Vec::new(),
        })
        .await
        .unwrap()
        .remove(0);
    let left: Vec<ballast::store::NewIntent> = (0..4)
        .map(|n| ballast::store::NewIntent {
            lease: held.lease().unwrap(),
            record_id: id,
            step: format!("render#{n}"),
            provider: Some("sim".into()),
            attempt_no: 1,
            node: Some("ghost".into()),
            sent_at: now,
            request: None,
        })
        .collect();
    let written = t.db.record_intents(&left).await.unwrap();
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    // The ghost's lease runs out; its calls are looked up 10 s after they
    // left, all four at once.
    clock.advance(2_000);
    drive_at_rest(&engine, &clock, 1, 1_000, 120_000).await;
    let r = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Succeeded, "{r:?}");
    let items = t.db.item_runs(id, "render", 0, 10).await.unwrap();
    assert_eq!(items.len(), 6, "{items:?}");
    assert!(items.iter().all(|i| i.state == StepState::Succeeded));
    let ledger = sim.ledger();
    assert_eq!((ledger.effects, ledger.double_charges), (6, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_more_items_left_started_than_the_cap_all_run() {
    more_items_left_started_than_the_cap_all_run(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_more_items_left_started_than_the_cap_all_run() {
    more_items_left_started_than_the_cap_all_run(Backend::Postgres).await;
}

/// The record page says how far the items are, lists each with its
/// attempts, and draws the step as a stack; so does the pipelines page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_show_the_items() {
    let (url, p) = provider().await;
    let text = pipelines_toml(&url);
    let Some(app) = crate::web::WebApp::spawn(Backend::Sqlite, "for_each_pages", &text).await
    else {
        return;
    };
    let op = app.token(ballast::domain::Role::Operator).await;
    let made: Value = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .json(&json!({ "pipeline": "fan", "key": "f1", "input": {} }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = made["record"]["id"].as_i64().unwrap();
    let db = app.t.db.clone();
    let succeeds = async |what: &str| {
        crate::wait::until(what, std::time::Duration::from_secs(60), async || {
            let r = db.get_record(id).await.unwrap().unwrap();
            match r.state {
                RecordState::Succeeded => Ok(()),
                _ => Err(r),
            }
        })
        .await;
    };
    succeeds("the record succeeds").await;
    app.user("v", ballast::domain::Role::Viewer).await;
    let login = app.login("v").await;
    let page = app.text(&format!("/records/{id}"), Some(&login)).await;
    for part in [
        "Items of each",
        "10 of 10 items done: 10 succeeded, 0 failed",
        "<td>each#0</td>",
        "<td>each#9</td>",
        "outline stack",
        "10 of 10 items done</text>",
    ] {
        assert!(page.contains(part), "{part:?} in {page}");
    }
    let items: Value = app
        .client
        .get(app.url(&format!("/api/v1/records/{id}/items/each?from=8&limit=1")))
        .bearer_auth(&op)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(items["items"][0]["step"], "each#8", "{items}");
    assert_eq!(items["items"][0]["output"], json!({ "doubled": 16 }));
    assert_eq!(items["next"], 9, "{items}");
    let page = app.text("/pipelines", Some(&login)).await;
    assert!(page.contains("p · for each ×3 · request"), "{page}");
    assert!(page.contains("outline stack"), "{page}");

    // An operator may replay only the failed items: offered on the page,
    // refused with a clear code for a step that is not one for each
    // item, or an `items` that is neither "all" nor "failed".
    app.user("o", ballast::domain::Role::Operator).await;
    let login = app.login("o").await;
    let page = app.text(&format!("/records/{id}"), Some(&login)).await;
    assert!(page.contains(r#"name="failed_items""#), "{page}");
    let replay = async |body: Value| {
        let reply = app
            .client
            .post(app.url(&format!("/api/v1/records/{id}/actions")))
            .bearer_auth(&op)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = reply.status().as_u16();
        (status, reply.json::<Value>().await.unwrap())
    };
    let base = json!({ "action": "replay", "reason": "again" });
    let with = |extra: Value| {
        let mut b = base.clone();
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, e) = replay(with(json!({ "step": "each", "items": "most" }))).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (400, Some("bad_items")),
        "{e}"
    );
    let (status, e) = replay(with(json!({ "step": "split", "items": "failed" }))).await;
    assert_eq!(e["error"].as_str(), Some("items_need_each"), "{status} {e}");
    let (status, e) = replay(json!({ "action": "retry", "items": "failed" })).await;
    assert_eq!(
        e["error"].as_str(),
        Some("items_need_replay"),
        "{status} {e}"
    );
    // Every item succeeded: none runs again, the merge after them does.
    let (status, made) = replay(with(json!({ "step": "each", "items": "failed" }))).await;
    assert_eq!(status, 200, "{made}");
    succeeds("the replayed record succeeds").await;
    let calls: Vec<usize> = p
        .seen
        .lock()
        .unwrap()
        .calls
        .values()
        .map(Vec::len)
        .collect();
    assert_eq!(calls, vec![1; 10], "no item sent again");
    let events = db.record_events(id).await.unwrap();
    let replayed = events.iter().rev().find(|e| e.audit).unwrap();
    assert_eq!(
        replayed.detail.as_ref().map(|d| &d["items"]),
        Some(&json!("failed")),
        "{replayed:?}"
    );
    app.stop().await;
}

#[test]
fn check_config_refuses_a_for_each_it_cannot_run() {
    let whole = |step: &str| {
        let text = format!(
            r#"
[providers.p]
base_url = "http://127.0.0.1:9"
[[pipelines.fan.steps]]
name = "split"
provider = "p"
request = {{ path = "/split" }}
[[pipelines.fan.steps]]
name = "other"
provider = "p"
request = {{ path = "/other" }}
[[pipelines.fan.steps]]
name = "each"
needs = ["split"]
{step}
"#
        );
        Config::parse(&text, Path::new("fan.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let call = "provider = \"p\"\nrequest = { path = \"/item/{{ item.id }}/{{ item_index }}\" }";
    assert_eq!(
        whole(&format!("{call}\nfor_each = \"/steps/split/output/parts\"")),
        ""
    );
    assert_eq!(
        whole(&format!(
            "{call}\nfor_each = \"/input/parts\"\nmax_parallel = 4\nitems_required = \"all\""
        )),
        ""
    );
    for (step, expected) in [
        (
            format!("{call}\nfor_each = \"/steps/other/output/parts\""),
            "reads step `other`, which this step does not need",
        ),
        (
            format!("{call}\nfor_each = \"/record/id\""),
            "a JSON pointer into the input",
        ),
        (
            format!("{call}\nfor_each = \"/input/x\"\nmax_parallel = 0"),
            "pipelines.fan.steps[each].max_parallel",
        ),
        (
            format!("{call}\nfor_each = \"/input/x\"\nitems_required = \"most\""),
            "`\"all\"` or how many items must succeed",
        ),
        (
            "provider = \"p\"\nrequest = { path = \"/x\" }\nmax_parallel = 3".to_owned(),
            "give `for_each` too",
        ),
        (
            "provider = \"p\"\nrequest = { path = \"/x/{{ item }}\" }".to_owned(),
            "item",
        ),
        (
            format!("{call}\nfor_each = \"/input/x\"\nundo = {{ request = {{ path = \"/u\" }} }}"),
            "takes no `undo`",
        ),
        (
            "kind = \"approval\"\nfor_each = \"/input/x\"".to_owned(),
            "a `approval` step cannot run once per item",
        ),
        (
            "provider = \"p\"\nkind = \"callback\"\njob_id = \"/id\"\n\
             request = { path = \"/x\" }\ncallback = { job_id = \"/job_id\" }\nfor_each = \"/input/x\""
                .to_owned(),
            "cannot run once per item",
        ),
    ] {
        let err = whole(&step);
        assert!(err.contains(expected), "expected {expected:?}: {err}");
    }
}

/// Issue 48's done-when for items: `ballast serve` killed with SIGKILL at
/// random points while it runs records of a 50-item step against a job
/// provider that ignores idempotency keys (`at_most_once`, with a lookup
/// by client reference), now and then charging and then resetting the
/// connection or stalling (and failing some jobs outright: 40 of 50 items
/// must succeed). Every item that succeeded is charged exactly once, none
/// twice, nothing is lost, and every submit that reached
/// the provider is an attempt of the item whose key it carried.
async fn a_step_for_each_item_survives_kills(backend: Backend) {
    use crate::faults::{Serve, due_now, full_run, kill_while_working};
    let (n, kills) = if full_run() { (40, 10) } else { (6, 3) };
    let Some(t) = TestDb::migrated(backend, "for_each_kills").await else {
        return;
    };
    let mut profile = ballast::sim::Profile::chaos_scaled(48, 0.02);
    profile.p_job_never = 0.0;
    profile.ignore_keys = true;
    profile.p_reset_after_effect = 0.03;
    profile.p_stall_after_effect = 0.01;
    let sim = ballast::sim::SimHandle::spawn(profile).await.unwrap();
    let pipeline = r#"
[[pipelines.pay.steps]]
name = "render"
provider = "sim"
kind = "submit_poll"
for_each = "/input/items"
max_parallel = 10
items_required = 40
request = { method = "POST", path = "/v1/jobs", body = '{"client_reference": "{{ key }}", "amount": {{ item }}}' }
job_id = "/id"
poll = { path = "/v1/jobs/{{ job_id }}", every = "50ms", deadline = "20s" }
lookup = { path = "/v1/jobs?client_reference={{ key | urlencode }}", job_id = "/data/0/id" }
outputs = { url = "/result/url" }
"#;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ballast.toml"),
        format!(
            "[database]\nurl = \"{}\"\n[engine]\nlease = \"2s\"\n{}{pipeline}",
            t.url,
            crate::engine::sim_provider_toml(&sim.base_url(), "at_most_once = true"),
        ),
    )
    .unwrap();
    let env = [("BALLAST_ADMIN_PASSWORD", "for-each-admin-pw")];
    let mut rng = fastrand::Rng::with_seed(48);
    let part = n / kills;
    for round in 0..kills {
        let records = due_now(
            "pay",
            "each-",
            round * part..(round + 1) * part,
            |_| json!({ "items": (1..=50).collect::<Vec<i64>>() }),
        );
        t.db.create_records(records, crate::helpers::wall_ms())
            .await
            .unwrap();
        let node = Serve::start(dir.path(), &env).await;
        kill_while_working(node, &t.db, &sim, &mut rng).await;
    }
    let last = Serve::start(dir.path(), &env).await;
    let limit = std::time::Duration::from_secs(if full_run() { 900 } else { 300 });
    // Each record not at rest, when they do not all come to rest: the
    // stall's evidence (the records, the database's sessions, the log).
    let at_rest = async || {
        let all = crate::helpers::all_records(&t.db, None).await;
        let busy: Vec<String> = all
            .iter()
            .filter(|r| !r.state.is_at_rest())
            .map(|r| {
                format!(
                    "{} {} {:?} next {:?}: {:?}",
                    r.id, r.state, r.error_code, r.next_run_at, r.reason
                )
            })
            .collect();
        if busy.is_empty() { Ok(()) } else { Err(busy) }
    };
    let settled = crate::wait::until("every record at rest", limit * 2, at_rest);
    if tokio::time::timeout(limit, settled).await.is_err() {
        crate::faults::stall_report(&t, dir.path()).await;
        let busy = at_rest().await.err().unwrap_or_default();
        panic!("not at rest after {limit:?}: {busy:#?}");
    }
    crate::engine::wait_at_rest(&t.db, n, std::time::Duration::from_secs(10)).await;
    last.stop().await;
    let audit = crate::helpers::audit_at_rest(&t.db).await;

    let mut ledger = crate::faults::KeyLedger::of(&sim);
    let (mut items_done, mut uncertain) = (0, 0);
    // Calls a kill caught in flight (read back from their intents), and
    // lookups that settled them.
    let (mut caught, mut lookups) = (0, 0);
    for r in crate::helpers::all_records(&t.db, None).await {
        assert!(
            t.db.open_intents(r.id).await.unwrap().is_empty(),
            "record {} at rest with a call left open",
            r.id
        );
        let attempts = t.db.attempts(r.id).await.unwrap();
        caught += attempts
            .iter()
            .filter(|a| {
                a.excerpt
                    .as_deref()
                    .is_some_and(|e| e.starts_with("no reply recorded"))
            })
            .count();
        lookups += attempts
            .iter()
            .filter(|a| {
                a.error_code
                    .as_deref()
                    .is_some_and(|c| c.starts_with("lookup_"))
            })
            .count();
        let items = t.db.item_runs(r.id, "render", 0, 100).await.unwrap();
        for item in &items {
            ledger.check(item, &attempts);
            items_done += usize::from(item.state == StepState::Succeeded);
        }
        match r.state {
            RecordState::Succeeded => {
                assert_eq!(items.len(), 50, "record {}: {items:?}", r.id);
                let run = t.db.step_runs(r.id).await.unwrap().remove(0);
                let output = run.output.unwrap_or_default();
                let urls = output
                    .as_array()
                    .map_or(0, |o| o.iter().filter(|u| !u.is_null()).count());
                let succeeded = items
                    .iter()
                    .filter(|i| i.state == StepState::Succeeded)
                    .count();
                assert!(urls >= 40 && urls == succeeded, "record {}: {output}", r.id);
            }
            RecordState::Parked => uncertain += 1,
            _ => {}
        }
    }
    println!(
        "{} for-each kill -9 loop: {n} records of 50 items, {kills} kills: {} succeeded + {} \
         failed + {} parked ({uncertain} parked records); {items_done} items done, {} submits \
         reached the provider, {} double charges, {} calls with no attempt; {caught} calls \
         read back after a kill, {lookups} lookups",
        backend.as_str(),
        audit.ok,
        audit.failed,
        audit.parked,
        ledger.calls(),
        sim.ledger().double_charges,
        ledger.holes,
    );
    assert_eq!(audit.ok + audit.failed + audit.parked, n, "0 lost");
    assert_eq!(sim.ledger().double_charges, 0, "0 double charges");
    ledger.assert_whole();
    assert!(audit.ok > 0, "some records succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_step_for_each_item_survives_kills() {
    a_step_for_each_item_survives_kills(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_step_for_each_item_survives_kills() {
    a_step_for_each_item_survives_kills(Backend::Postgres).await;
}
