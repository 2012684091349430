//! Steps that wait for a person (`approval`) or a caller (`signal`):
//! no worker held, a decision audited and branched on, a timeout that
//! parks, fails or goes on, and a signal through the API that is taken
//! once. Both backends; the engine's on a clock the test moves, the API's
//! on a live server.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ballast::config::Config;
use ballast::domain::{OperatorAction, RecordState, Role, StepRun, StepState};
use ballast::engine::{ActExtra, Enqueue, Ops};
use ballast::sim::{Profile, SimHandle};
use ballast::store::Backend;
use serde_json::{Value, json};

use crate::engine::{drain, manual_engine_at};
use crate::helpers::TestDb;
use crate::wait;
use crate::web::WebApp;

const HOUR_MS: i64 = 3_600_000;

/// Check, then a review (`review`, its own settings), then `open` if it
/// was approved or `close` if not.
fn kyc(base_url: &str, review: &str) -> String {
    format!(
        r#"
[providers.sim]
base_url = "{base_url}"
timeout = "30s"
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.kyc.steps]]
name = "check"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "check-{{{{ record.id }}}}", "amount": 1}}' }}

[[pipelines.kyc.steps]]
name = "review"
needs = ["check"]
{review}

[[pipelines.kyc.steps]]
name = "open"
provider = "sim"
needs = ["review"]
when = "steps.review.output.decision == 'approved'"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "open-{{{{ record.id }}}}", "amount": 1}}' }}

[[pipelines.kyc.steps]]
name = "close"
provider = "sim"
needs = ["review"]
when = "steps.review.output.decision != 'approved'"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "close-{{{{ record.id }}}}", "amount": 1}}' }}
"#
    )
}

fn config(text: &str) -> Arc<Config> {
    let config = Config::parse(text, Path::new("kyc.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    Arc::new(config)
}

fn run<'r>(runs: &'r [StepRun], step: &str) -> &'r StepRun {
    runs.iter().find(|r| r.step == step).unwrap()
}

async fn an_approval_waits_for_a_decision_and_is_branched_on(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "approval").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let config = config(&kyc(&sim.base_url(), r#"kind = "approval""#));
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
    let mut ids = Vec::new();
    for key in ["alice", "bob"] {
        let e = Enqueue::new("kyc", Some(key), json!({}));
        ids.push(engine.enqueue(e).await.unwrap().record.id);
    }
    drain(&engine).await;
    // Both wait for a person: no time to wake at, held by no worker, and
    // the records list finds them.
    for id in &ids {
        let rec = t.db.get_record(*id).await.unwrap().unwrap();
        assert_eq!(
            (rec.state, rec.next_run_at, rec.lease_owner.as_deref()),
            (RecordState::Waiting, None, None),
            "{:?}",
            rec.reason
        );
        assert_eq!(rec.error_code.as_deref(), Some("awaiting_approval"));
        let runs = t.db.step_runs(*id).await.unwrap();
        assert_eq!(run(&runs, "review").state, StepState::Waiting);
    }
    let filter = ballast::store::RecordFilter {
        state: Some(RecordState::Waiting),
        error_code: Some("awaiting_approval".into()),
        limit: 10,
        ..Default::default()
    };
    assert_eq!(t.db.list_records(&filter).await.unwrap().items.len(), 2);
    // Days pass: nothing is due.
    clock.advance((30 * 24 * HOUR_MS) as u64);
    assert_eq!(drain(&engine).await, 0);
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let decide = |id: i64, action: OperatorAction, comment: Option<&str>| {
        let ops = &ops;
        let comment = comment.map(str::to_owned);
        let extra = ActExtra {
            step: Some("review"),
            ..Default::default()
        };
        async move { ops.act_with(id, action, "ann", comment, extra).await }
    };
    // A decision needs its comment; a sleep's wake is not offered.
    let bare = decide(ids[0], OperatorAction::Approve, None)
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(bare).code(),
        "reason_required"
    );
    let woken = decide(ids[0], OperatorAction::Wake, None)
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(woken).code(),
        "nothing_asleep"
    );
    let approved = decide(ids[0], OperatorAction::Approve, Some("documents match"))
        .await
        .unwrap();
    assert_eq!(approved.state, RecordState::Pending);
    decide(ids[1], OperatorAction::Reject, Some("address mismatch"))
        .await
        .unwrap();
    drain(&engine).await;
    let now = start + 30 * 24 * HOUR_MS;
    for (id, decision, comment, ran, skipped) in [
        (ids[0], "approved", "documents match", "open", "close"),
        (ids[1], "rejected", "address mismatch", "close", "open"),
    ] {
        let rec = t.db.get_record(id).await.unwrap().unwrap();
        assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
        let runs = t.db.step_runs(id).await.unwrap();
        assert_eq!(
            run(&runs, "review").output,
            Some(json!({ "decision": decision, "comment": comment, "by": "ann", "at": now }))
        );
        assert_eq!(run(&runs, ran).state, StepState::Succeeded);
        assert_eq!(run(&runs, skipped).state, StepState::Skipped);
        let events = t.db.record_events(id).await.unwrap();
        let kind = if decision == "approved" {
            "approve"
        } else {
            "reject"
        };
        let audited = events.iter().find(|e| e.kind == kind).unwrap();
        assert!(audited.audit);
        assert_eq!(
            (audited.actor.as_str(), audited.reason.as_deref()),
            ("ann", Some(comment))
        );
    }
    // Decided once: not again.
    let again = decide(ids[0], OperatorAction::Reject, Some("second thoughts"))
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(again).code(),
        "transition_not_allowed"
    );
    assert_eq!(sim.arrivals().len(), 4, "two checks, one open, one close");
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_approval_waits_for_a_decision_and_is_branched_on() {
    an_approval_waits_for_a_decision_and_is_branched_on(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_approval_waits_for_a_decision_and_is_branched_on() {
    an_approval_waits_for_a_decision_and_is_branched_on(Backend::Postgres).await;
}

/// Past its timeout an approval parks (a late decision still counts),
/// fails, or goes on with its timeout output.
async fn an_approval_past_its_timeout(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "approval-timeout").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let mut outcomes = Vec::new();
    for (i, on_timeout) in [
        r#"on_timeout = "park""#,
        r#"on_timeout = "fail""#,
        r#"on_timeout = "continue""#,
    ]
    .into_iter()
    .enumerate()
    {
        let review = format!("kind = \"approval\"\ntimeout = \"72h\"\n{on_timeout}");
        let config = config(&kyc(&sim.base_url(), &review));
        let start = crate::helpers::wall_ms() + i as i64;
        let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
        let key = format!("late-{i}");
        let id = engine
            .enqueue(Enqueue::new("kyc", Some(&key), json!({})))
            .await
            .unwrap()
            .record
            .id;
        drain(&engine).await;
        let rec = t.db.get_record(id).await.unwrap().unwrap();
        assert_eq!(
            (rec.state, rec.next_run_at),
            (RecordState::Waiting, Some(start + 72 * HOUR_MS))
        );
        clock.advance((72 * HOUR_MS) as u64);
        drain(&engine).await;
        let rec = t.db.get_record(id).await.unwrap().unwrap();
        let runs = t.db.step_runs(id).await.unwrap();
        outcomes.push((
            rec.state,
            rec.error_code.clone(),
            run(&runs, "review").output.clone(),
        ));
        if i == 0 {
            let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
            let act = |action: OperatorAction| {
                let ops = &ops;
                async move {
                    let why = Some("found it in the spam folder".to_owned());
                    ops.act_with(id, action, "ann", why, ActExtra::default())
                        .await
                }
            };
            // Resumed, it waits again, a new timeout from then.
            act(OperatorAction::Resume).await.unwrap();
            drain(&engine).await;
            let rec = t.db.get_record(id).await.unwrap().unwrap();
            assert_eq!(
                (rec.state, rec.next_run_at, rec.error_code.as_deref()),
                (
                    RecordState::Waiting,
                    Some(start + 144 * HOUR_MS),
                    Some("awaiting_approval")
                )
            );
            // Parked by an operator (not by its timeout), it takes no
            // decision until someone resumes it.
            act(OperatorAction::Park).await.unwrap();
            let held = act(OperatorAction::Approve).await.unwrap_err();
            assert_eq!(
                ballast::web::error::WebError::from(held).code(),
                "record_parked"
            );
            act(OperatorAction::Resume).await.unwrap();
            drain(&engine).await;
            // Past its timeout again and parked: a late approval still
            // counts, and the record goes on.
            clock.advance((72 * HOUR_MS) as u64);
            drain(&engine).await;
            let rec = t.db.get_record(id).await.unwrap().unwrap();
            assert_eq!(rec.error_code.as_deref(), Some("approval_timed_out"));
            act(OperatorAction::Approve).await.unwrap();
            drain(&engine).await;
            let rec = t.db.get_record(id).await.unwrap().unwrap();
            assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
            let runs = t.db.step_runs(id).await.unwrap();
            assert_eq!(run(&runs, "open").state, StepState::Succeeded);
        }
    }
    assert_eq!(
        outcomes,
        [
            (
                RecordState::Parked,
                Some("approval_timed_out".to_owned()),
                None
            ),
            (
                RecordState::Failed,
                Some("approval_timed_out".to_owned()),
                None
            ),
            (
                RecordState::Succeeded,
                None,
                Some(json!({ "decision": "timed_out", "timed_out": true }))
            ),
        ]
    );
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_approval_past_its_timeout() {
    an_approval_past_its_timeout(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_approval_past_its_timeout() {
    an_approval_past_its_timeout(Backend::Postgres).await;
}

/// Past its timeout a signal step parks, fails, or goes on with its
/// timeout output (which a condition then branches on); a signal that
/// came in time is its output, whatever the timeout.
async fn a_signal_past_its_timeout(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "signal-timeout").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let mut outcomes = Vec::new();
    for (i, on_timeout) in [
        r#"on_timeout = "park""#,
        r#"on_timeout = "fail""#,
        r#"on_timeout = "continue"
timeout_output = { decision = "approved", by = "timeout" }"#,
    ]
    .into_iter()
    .enumerate()
    {
        let review = format!("kind = \"signal\"\ntimeout = \"2h\"\n{on_timeout}");
        let config = config(&kyc(&sim.base_url(), &review));
        let start = crate::helpers::wall_ms() + i as i64;
        let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
        let id = engine
            .enqueue(Enqueue::new("kyc", Some(&format!("quiet-{i}")), json!({})))
            .await
            .unwrap()
            .record
            .id;
        drain(&engine).await;
        let rec = t.db.get_record(id).await.unwrap().unwrap();
        assert_eq!(
            (rec.state, rec.next_run_at, rec.error_code.as_deref()),
            (
                RecordState::Waiting,
                Some(start + 2 * HOUR_MS),
                Some("awaiting_signal")
            )
        );
        clock.advance((2 * HOUR_MS - 1) as u64);
        assert_eq!(drain(&engine).await, 0, "not due before its timeout");
        clock.advance(1);
        drain(&engine).await;
        let rec = t.db.get_record(id).await.unwrap().unwrap();
        let runs = t.db.step_runs(id).await.unwrap();
        let opened = runs
            .iter()
            .any(|r| r.step == "open" && r.state == StepState::Succeeded);
        outcomes.push((
            rec.state,
            rec.error_code.clone(),
            run(&runs, "review").output.clone(),
            opened,
        ));
    }
    assert_eq!(
        outcomes,
        [
            (
                RecordState::Parked,
                Some("signal_timed_out".to_owned()),
                None,
                false
            ),
            (
                RecordState::Failed,
                Some("signal_timed_out".to_owned()),
                None,
                false
            ),
            (
                RecordState::Succeeded,
                None,
                Some(json!({ "decision": "approved", "by": "timeout" })),
                true
            ),
        ]
    );
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_signal_past_its_timeout() {
    a_signal_past_its_timeout(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_signal_past_its_timeout() {
    a_signal_past_its_timeout(Backend::Postgres).await;
}

/// A signal and an approval through the API: the signal's body is the
/// step's output; sent again under its id it changes nothing; a second
/// signal is refused; a viewer may not signal.
async fn a_signal_and_a_decision_through_the_api(backend: Backend) {
    let sim = SimHandle::spawn(Profile::clean(3)).await.unwrap();
    let mut text = kyc(&sim.base_url(), r#"kind = "approval""#);
    text.push_str(
        r#"
[[pipelines.payout.steps]]
name = "confirmed"
kind = "signal"
[[pipelines.payout.steps]]
name = "pay"
provider = "sim"
needs = ["confirmed"]
request = { method = "POST", path = "/v1/charge", body = '{"ref": "pay-{{ record.id }}", "amount": {{ steps.confirmed.output.amount }}}' }
outputs = { amount = "/amount" }
"#,
    );
    let Some(app) = WebApp::spawn(backend, "signals", &text).await else {
        sim.stop();
        return;
    };
    let op = app.token(Role::Operator).await;
    let viewer = app.token(Role::Viewer).await;
    let post = |path: String, body: Value, token: &str, key: Option<&str>| {
        let mut r = app
            .client
            .post(app.url(&path))
            .bearer_auth(token)
            .json(&body);
        if let Some(k) = key {
            r = r.header("Idempotency-Key", k);
        }
        r.send()
    };
    let made: Value = post(
        "/api/v1/records".into(),
        json!({ "pipeline": "payout", "key": "p1" }),
        &op,
        None,
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let id = made["record"]["id"].as_i64().unwrap();
    let state_of = async |id: i64| {
        let r: Value = app
            .client
            .get(app.url(&format!("/api/v1/records/{id}")))
            .bearer_auth(&op)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r
    };
    // The record's detail once its `field` is `want`.
    let once = async |id: i64, field: &str, want: &str| {
        let what = format!("record {id}'s {field} is {want}");
        wait::until(&what, Duration::from_secs(30), async || {
            let r = state_of(id).await;
            if r["record"][field] == want {
                Ok(r)
            } else {
                Err(r)
            }
        })
        .await
    };
    let waiting = once(id, "error_code", "awaiting_signal").await;
    assert_eq!(waiting["record"]["next_run_at"], Value::Null);
    let actions = waiting["actions"].as_array().cloned().unwrap_or_default();
    assert!(actions.contains(&json!("signal")), "{actions:?}");
    let path = format!("/api/v1/records/{id}/signals/confirmed");
    let body = json!({ "amount": 42, "by": "treasury" });
    let refused = post(path.clone(), body.clone(), &viewer, Some("s-1"))
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    // Through the plain action command, a signal is refused: it has its own.
    let plain = post(
        format!("/api/v1/records/{id}/actions"),
        json!({ "action": "signal" }),
        &op,
        None,
    )
    .await
    .unwrap();
    assert_eq!(plain.status(), 400);
    let first = post(path.clone(), body.clone(), &op, Some("s-1"))
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["again"], false);
    let again = post(path.clone(), json!({ "amount": 1 }), &op, Some("s-1"))
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<Value>().await.unwrap()["again"], true);
    let done = once(id, "state", "succeeded").await;
    // Another signal once the step has one: refused, nothing changed.
    let other = post(path.clone(), json!({ "amount": 1 }), &op, Some("s-2"))
        .await
        .unwrap();
    assert_eq!(other.status(), 409);
    let steps = done["steps"].as_array().cloned().unwrap_or_default();
    let step = |name: &str| {
        steps
            .iter()
            .find(|s| s["step"] == name)
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(step("confirmed")["output"], body);
    assert_eq!(step("pay")["output"], json!({ "amount": 42 }));
    let events = app.t.db.record_events(id).await.unwrap();
    let signals: Vec<_> = events.iter().filter(|e| e.kind == "signal").collect();
    assert_eq!(signals.len(), 1, "{events:?}");
    assert_eq!(signals[0].actor, "token:t-operator");
    // An approval through the API.
    let made: Value = post(
        "/api/v1/records".into(),
        json!({ "pipeline": "kyc", "key": "k1" }),
        &op,
        None,
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let kyc_id = made["record"]["id"].as_i64().unwrap();
    once(kyc_id, "error_code", "awaiting_approval").await;
    let approve = post(
        format!("/api/v1/records/{kyc_id}/actions"),
        json!({ "action": "approve", "reason": "looks right", "step": "review" }),
        &op,
        None,
    )
    .await
    .unwrap();
    assert_eq!(approve.status(), 200, "{:?}", approve.text().await);
    once(kyc_id, "state", "succeeded").await;
    app.stop().await;
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_signal_and_a_decision_through_the_api() {
    a_signal_and_a_decision_through_the_api(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_signal_and_a_decision_through_the_api() {
    a_signal_and_a_decision_through_the_api(Backend::Postgres).await;
}

#[test]
fn check_config_refuses_a_wait_it_cannot_keep() {
    let base = "http://127.0.0.1:9";
    assert!(ballast::pipeline::compile(&config(&kyc(base, r#"kind = "approval""#))).is_ok());
    let cases = [
        (
            "kind = \"approval\"\non_timeout = \"fail\"",
            "need `timeout`",
        ),
        ("kind = \"signal\"\ntimeout = \"0s\"", "more than 0"),
        (
            "kind = \"approval\"\ntimeout = \"1h\"\ntimeout_output = { a = 1 }",
            "`on_timeout = \"continue\"` only",
        ),
        (
            "kind = \"approval\"\nprovider = \"sim\"",
            "takes no `provider`",
        ),
        ("kind = \"signal\"\nfor = \"1h\"", "takes no `for`"),
        (
            "kind = \"approval\"\non_timeout = \"later\"",
            "unknown variant",
        ),
    ];
    for (review, expected) in cases {
        let err = Config::parse(&kyc(base, review), Path::new("kyc.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains(expected),
            "expected {expected:?} for {review:?}: {err}"
        );
    }
}
