//! Workflows beyond one call per step: steps whose kind calls no provider
//! (a durable sleep, woken early by an operator), on both backends, on a
//! clock the test moves.

use std::path::Path;
use std::sync::Arc;

use ballast::config::Config;
use ballast::domain::{OperatorAction, RecordState, StepState};
use ballast::engine::Enqueue;
use ballast::sim::{Profile, SimHandle};
use ballast::store::Backend;
use serde_json::json;

use crate::engine::{drain, manual_engine_at};
use crate::helpers::TestDb;

const DAY_MS: i64 = 24 * 3600 * 1000;

/// Charge, sleep a day, then a second call that reads when the sleep
/// ended.
fn charge_sleep_email(base_url: &str) -> Arc<Config> {
    charge_sleep_then_email(base_url, r#"for = "24h""#)
}

/// [`charge_sleep_email`] with the sleep's own setting (`for` or `until`).
fn charge_sleep_then_email(base_url: &str, sleep: &str) -> Arc<Config> {
    let text = format!(
        r#"
[providers.sim]
base_url = "{base_url}"
timeout = "30s"
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.ship.steps]]
name = "charge"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "c-{{{{ record.id }}}}", "amount": 1}}' }}

[[pipelines.ship.steps]]
name = "wait"
kind = "sleep"
{sleep}
needs = ["charge"]

[[pipelines.ship.steps]]
name = "email"
provider = "sim"
needs = ["wait"]
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "e-{{{{ steps.wait.output.woke_at }}}}", "amount": 1}}' }}
"#
    );
    let config = Config::parse(&text, Path::new("sleep.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    Arc::new(config)
}

/// One record of `ship` on a fresh engine whose clock the test moves.
struct Shipping {
    t: TestDb,
    sim: SimHandle,
    config: Arc<Config>,
    engine: ballast::engine::Engine,
    clock: ballast::domain::ManualClock,
    /// The clock's start.
    start: i64,
    id: i64,
}

async fn shipping(backend: Backend, test: &str) -> Option<Shipping> {
    let t = TestDb::migrated(backend, test).await?;
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let config = charge_sleep_email(&sim.base_url());
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
    let id = engine
        .enqueue(Enqueue::new("ship", Some(test), json!({})))
        .await
        .unwrap()
        .record
        .id;
    Some(Shipping {
        t,
        sim,
        config,
        engine,
        clock,
        start,
        id,
    })
}

async fn a_sleep_holds_no_worker_and_wakes_after_a_restart(backend: Backend) {
    let Some(Shipping {
        t,
        sim,
        config,
        engine,
        clock,
        start,
        id,
    }) = shipping(backend, "sleep").await
    else {
        return;
    };
    drain(&engine).await;
    // Charged; asleep until a day from the sleep's first pass, the record
    // due then and held by no worker.
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    let wake = start + DAY_MS;
    assert_eq!(rec.state, RecordState::Waiting, "{:?}", rec.reason);
    assert_eq!(
        (rec.next_run_at, rec.lease_owner.as_deref()),
        (Some(wake), None)
    );
    let runs = t.db.step_runs(id).await.unwrap();
    let sleep = runs.iter().find(|r| r.step == "wait").unwrap();
    assert_eq!(
        (sleep.state, sleep.deadline_at),
        (StepState::Waiting, Some(wake))
    );
    assert_eq!(
        (sleep.attempts, sleep.provider.as_deref()),
        (0, None),
        "a sleep calls nothing"
    );
    let said = sleep.reason.clone().unwrap_or_default();
    let until = ballast::domain::time::format_ms(wake);
    assert!(said == format!("asleep until {until}"), "{said}");
    assert_eq!(sim.arrivals().len(), 1);
    // Nothing is due before the wake time: no pass runs.
    clock.advance((DAY_MS - 1) as u64);
    assert_eq!(drain(&engine).await, 0);
    drop(engine);
    // A restart: another node, its clock at the wake time, ends the sleep
    // and makes the call after it, which reads when the sleep ended.
    let (engine, _clock) = manual_engine_at(&t.db, config, "n2", wake).await;
    drain(&engine).await;
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
    let runs = t.db.step_runs(id).await.unwrap();
    let sleep = runs.iter().find(|r| r.step == "wait").unwrap();
    assert_eq!(sleep.state, StepState::Succeeded);
    assert_eq!(sleep.output, Some(json!({ "woke_at": wake })));
    let arrivals = sim.arrivals();
    assert_eq!(arrivals.len(), 2, "one charge, one email: {arrivals:?}");
    let kinds = crate::helpers::event_kinds(&t.db, id).await;
    let waited = kinds.iter().position(|k| k == "waiting");
    assert!(
        waited.is_some() && kinds.last().map(String::as_str) == Some("completed"),
        "{kinds:?}"
    );
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_sleep_holds_no_worker_and_wakes_after_a_restart() {
    a_sleep_holds_no_worker_and_wakes_after_a_restart(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_sleep_holds_no_worker_and_wakes_after_a_restart() {
    a_sleep_holds_no_worker_and_wakes_after_a_restart(Backend::Postgres).await;
}

async fn an_operator_wakes_a_sleep_early(backend: Backend) {
    let Some(Shipping {
        t,
        sim,
        config,
        engine,
        clock,
        start,
        id,
    }) = shipping(backend, "wake").await
    else {
        return;
    };
    let ops = ballast::engine::Ops::new(&t.db, &config, Some(&engine), &clock);
    let wake = OperatorAction::Wake;
    // Nothing sleeps yet: a pending record cannot be woken.
    let early = ops
        .act(id, wake, "ann", None, None, None)
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(early).code(),
        "transition_not_allowed"
    );
    drain(&engine).await;
    assert_eq!(sim.arrivals().len(), 1);
    // An hour into the sleep, an operator wakes it: due now, audited.
    clock.advance(3_600_000);
    let woken_at = start + 3_600_000;
    let reason = Some("the customer asked".to_owned());
    let rec = ops.act(id, wake, "ann", reason, None, None).await.unwrap();
    assert_eq!(
        (rec.state, rec.next_run_at),
        (RecordState::Pending, Some(woken_at))
    );
    drain(&engine).await;
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
    let runs = t.db.step_runs(id).await.unwrap();
    let sleep = runs.iter().find(|r| r.step == "wait").unwrap();
    assert_eq!(sleep.output, Some(json!({ "woke_at": woken_at })));
    assert_eq!(sim.arrivals().len(), 2, "the email went out a day early");
    let events = t.db.record_events(id).await.unwrap();
    let audited = events.iter().find(|e| e.kind == "wake").unwrap();
    assert!(audited.audit);
    assert_eq!(
        (audited.actor.as_str(), audited.reason.as_deref()),
        ("ann", Some("the customer asked"))
    );
    // Woken once, it cannot be woken again.
    let again = ops
        .act(id, wake, "ann", None, None, None)
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(again).code(),
        "transition_not_allowed"
    );
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_operator_wakes_a_sleep_early() {
    an_operator_wakes_a_sleep_early(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_operator_wakes_a_sleep_early() {
    an_operator_wakes_a_sleep_early(Backend::Postgres).await;
}

/// A record parked while it sleeps and then retried sleeps on to the
/// wake time it had: the sleep is not started again.
async fn a_retry_keeps_a_sleeps_wake_time(backend: Backend) {
    let Some(Shipping {
        t,
        sim,
        config,
        engine,
        clock,
        start,
        id,
    }) = shipping(backend, "retry-sleep").await
    else {
        return;
    };
    drain(&engine).await;
    let ops = ballast::engine::Ops::new(&t.db, &config, Some(&engine), &clock);
    clock.advance(23 * 3_600_000);
    let why = || Some("hold it".to_owned());
    ops.act(id, OperatorAction::Park, "ann", why(), None, None)
        .await
        .unwrap();
    let rec = ops
        .act(id, OperatorAction::Retry, "ann", why(), None, None)
        .await
        .unwrap();
    assert_eq!(rec.state, RecordState::Pending);
    drain(&engine).await;
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.next_run_at),
        (RecordState::Waiting, Some(start + DAY_MS)),
        "{:?}",
        rec.reason
    );
    clock.advance(3_600_000);
    drain(&engine).await;
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
    assert_eq!(sim.arrivals().len(), 2);
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_retry_keeps_a_sleeps_wake_time() {
    a_retry_keeps_a_sleeps_wake_time(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_retry_keeps_a_sleeps_wake_time() {
    a_retry_keeps_a_sleeps_wake_time(Backend::Postgres).await;
}

/// `until`: each record sleeps to the time its input gives; one already
/// past does not sleep; one that gives no time parks its record.
async fn a_sleep_until_a_time_the_input_gives(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "until").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let config = charge_sleep_then_email(&sim.base_url(), r#"until = "{{ input.ship_at }}""#);
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config, "n1", start).await;
    let at = start + 2 * 3_600_000;
    let format = ballast::domain::time::format_ms;
    let mut ids = Vec::new();
    for (key, ship_at) in [
        ("later", format(at)),
        ("past", format(start - 60_000)),
        ("bad", "soon".to_owned()),
    ] {
        let e = Enqueue::new("ship", Some(key), json!({ "ship_at": ship_at }));
        ids.push(engine.enqueue(e).await.unwrap().record.id);
    }
    drain(&engine).await;
    let rec = |i: usize| {
        let db = t.db.clone();
        let id = ids[i];
        async move { db.get_record(id).await.unwrap().unwrap() }
    };
    let later = rec(0).await;
    assert_eq!(
        (later.state, later.next_run_at),
        (RecordState::Waiting, Some(at))
    );
    assert_eq!(
        rec(1).await.state,
        RecordState::Succeeded,
        "a time past: no sleep"
    );
    let past = t.db.step_runs(ids[1]).await.unwrap();
    let slept = past.iter().find(|r| r.step == "wait").unwrap();
    assert_eq!(slept.output, Some(json!({ "woke_at": start - 60_000 })));
    let bad = rec(2).await;
    assert_eq!(
        (bad.state, bad.error_code.as_deref()),
        (RecordState::Parked, Some("until_invalid"))
    );
    assert!(
        bad.reason.as_deref().unwrap_or("").contains("soon"),
        "{:?}",
        bad.reason
    );
    clock.advance(2 * 3_600_000);
    drain(&engine).await;
    assert_eq!(rec(0).await.state, RecordState::Succeeded);
    // Three charges and two emails: the unreadable one charged only.
    assert_eq!(sim.arrivals().len(), 5);
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_sleep_until_a_time_the_input_gives() {
    a_sleep_until_a_time_the_input_gives(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_sleep_until_a_time_the_input_gives() {
    a_sleep_until_a_time_the_input_gives(Backend::Postgres).await;
}

#[test]
fn check_config_refuses_a_sleep_that_calls_or_has_no_length() {
    let base = "http://127.0.0.1:9";
    let good = {
        let c = charge_sleep_email(base);
        assert!(ballast::pipeline::compile(&c).is_ok());
        r#"name = "wait"
kind = "sleep"
for = "24h""#
    };
    let cases = [
        (good.replace("for = \"24h\"", ""), "needs `for`"),
        (
            format!("{good}\nuntil = \"{{{{ input.at }}}}\""),
            "not both",
        ),
        (
            good.replace("for = \"24h\"", "until = \"{{ steps.x.output.at }}\""),
            "`x`",
        ),
        (good.replace("24h", "0s"), "more than 0"),
        (format!("{good}\nprovider = \"sim\""), "takes no `provider`"),
        (format!("{good}\njob_id = \"/id\""), "takes no `job_id`"),
        (
            good.replace(
                "kind = \"sleep\"\nfor = \"24h\"",
                "for = \"24h\"\nprovider = \"sim\"\nrequest = { path = \"/x\" }",
            ),
            "a `request` step takes no `for`",
        ),
    ];
    let whole = |wait: &str| {
        let text = format!(
            r#"
[providers.sim]
base_url = "{base}"
[[pipelines.ship.steps]]
{wait}
"#
        );
        Config::parse(&text, Path::new("sleep.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    for (wait, expected) in cases {
        let err = whole(&wait);
        assert!(
            err.contains(expected),
            "expected {expected:?} for {wait:?}: {err}"
        );
        assert!(err.contains("pipelines.ship.steps[wait]"), "{err}");
    }
}
