//! Undo: after a failure (`on_failure = "undo"`) or at an operator's
//! word, the undo calls of the succeeded steps run, last finished first,
//! each seeing its step's output, with the retries and history of any
//! call; one that cannot complete parks the record `undo_failed`. Both
//! backends, on a clock the test moves.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ballast::config::Config;
use ballast::domain::{OperatorAction, Record, RecordState, StepState};
use ballast::engine::{ActExtra, Enqueue, Ops};
use ballast::store::{Backend, Db};
use serde_json::{Value, json};

use crate::engine::{drain, drive_at_rest, manual_engine_at};
use crate::helpers::TestDb;

/// A shop's provider: `/charge` and `/reserve` succeed, `/ship` refuses
/// (422), `/refund` and `/release` undo; every request is kept, in order.
struct Shop {
    url: String,
    calls: Arc<Mutex<Vec<(String, Value)>>>,
    refunds_fail: Arc<AtomicBool>,
    /// `/book` makes a job; `GET /jobs/ID` says it runs until this is set.
    jobs_done: Arc<AtomicBool>,
}

impl Shop {
    async fn spawn() -> Shop {
        let calls: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let refunds_fail = Arc::new(AtomicBool::new(false));
        let jobs_done = Arc::new(AtomicBool::new(false));
        let (c, f) = (calls.clone(), refunds_fail.clone());
        let (jc, done) = (calls.clone(), jobs_done.clone());
        let app = axum::Router::new().route(
            "/jobs/{id}",
            axum::routing::get(move |axum::extract::Path(id): axum::extract::Path<String>| {
                let (c, done) = (jc.clone(), done.clone());
                async move {
                    c.lock().unwrap().push(("poll".into(), json!({ "id": id })));
                    let status = if done.load(Ordering::SeqCst) { "succeeded" } else { "running" };
                    axum::Json(json!({ "status": status, "id": id }))
                }
            }),
        ).route(
            "/{route}",
            axum::routing::post(
                move |axum::extract::Path(route): axum::extract::Path<String>,
                      axum::Json(body): axum::Json<Value>| {
                    let (c, f) = (c.clone(), f.clone());
                    async move {
                        c.lock().unwrap().push((route.clone(), body.clone()));
                        let ok = json!({ "status": "succeeded", "id": format!("{route}-{}", body["ref"].as_str().unwrap_or("")) });
                        match route.as_str() {
                            "book" => (axum::http::StatusCode::OK, axum::Json(json!({ "status": "running", "id": "job-1" }))),
                            "ship" => (axum::http::StatusCode::UNPROCESSABLE_ENTITY, axum::Json(json!({ "status": "refused" }))),
                            "refund" if f.load(Ordering::SeqCst) => {
                                (axum::http::StatusCode::INTERNAL_SERVER_ERROR, axum::Json(json!({ "status": "down" })))
                            }
                            _ => (axum::http::StatusCode::OK, axum::Json(ok)),
                        }
                    }
                },
            ),
        );
        Shop {
            url: crate::helpers::serve_router(app).await,
            calls,
            refunds_fail,
            jobs_done,
        }
    }

    /// The routes called, in order.
    fn routes(&self) -> Vec<String> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .map(|(r, _)| r.clone())
            .collect()
    }

    fn bodies(&self, route: &str) -> Vec<Value> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(r, _)| r == route)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

/// `order` charges, reserves, then ships (which the shop refuses), and
/// undoes on failure; `hold` charges and then waits for an approval, and
/// undoes only when an operator says so.
fn shop_config(url: &str) -> Arc<Config> {
    let text = shop_toml(url);
    let config = Config::parse(&text, Path::new("undo.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    ballast::pipeline::compile(&config).unwrap();
    Arc::new(config)
}

/// [`shop_config`]'s text, and a `nap` pipeline that sleeps a day.
fn shop_toml(url: &str) -> String {
    format!(
        r#"
[providers.shop]
base_url = "{url}"
timeout = "30s"
retry = {{ max_attempts = 2, base = "1s", cap = "1s", deadline = "1h" }}
[[providers.shop.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[providers.shop.rules]]
when = {{ status = "2xx", field = "/status", equals = "running" }}
outcome = "pending"
[[providers.shop.rules]]
when = {{ status = "422" }}
outcome = "fail"

[pipelines.trip]
on_failure = "undo"
[[pipelines.trip.steps]]
name = "book"
provider = "shop"
kind = "submit_poll"
request = {{ method = "POST", path = "/book", body = '{{"ref": "b{{{{ record.id }}}}"}}' }}
job_id = "/id"
poll = {{ path = "/jobs/{{{{ job_id }}}}", every = "1s", deadline = "1h" }}
outputs = {{ booking = "/id" }}
undo = {{ request = {{ method = "POST", path = "/unbook", body = '{{"ref": "u{{{{ record.id }}}}", "booking": {{{{ output.booking | tojson }}}}}}' }} }}
[[pipelines.trip.steps]]
name = "ship"
provider = "shop"
request = {{ method = "POST", path = "/ship", body = '{{"ref": "p{{{{ record.id }}}}"}}' }}
[[pipelines.trip.steps]]
name = "notify"
provider = "shop"
needs = ["book"]
request = {{ method = "POST", path = "/notify", body = '{{"ref": "n{{{{ record.id }}}}"}}' }}

[pipelines.order]
on_failure = "undo"
[[pipelines.order.steps]]
name = "charge"
provider = "shop"
request = {{ method = "POST", path = "/charge", body = '{{"ref": "c{{{{ record.id }}}}"}}' }}
outputs = {{ charge = "/id" }}
undo = {{ request = {{ method = "POST", path = "/refund", body = '{{"ref": "r{{{{ record.id }}}}", "charge": {{{{ output.charge | tojson }}}}}}' }} }}
[[pipelines.order.steps]]
name = "reserve"
provider = "shop"
needs = ["charge"]
request = {{ method = "POST", path = "/reserve", body = '{{"ref": "s{{{{ record.id }}}}"}}' }}
outputs = {{ reservation = "/id" }}
undo = {{ request = {{ method = "POST", path = "/release", body = '{{"ref": "l{{{{ record.id }}}}", "reservation": {{{{ output.reservation | tojson }}}}}}' }} }}
[[pipelines.order.steps]]
name = "ship"
provider = "shop"
needs = ["reserve"]
request = {{ method = "POST", path = "/ship", body = '{{"ref": "p{{{{ record.id }}}}"}}' }}

[[pipelines.hold.steps]]
name = "charge"
provider = "shop"
request = {{ method = "POST", path = "/charge", body = '{{"ref": "c{{{{ record.id }}}}"}}' }}
outputs = {{ charge = "/id" }}
undo = {{ request = {{ method = "POST", path = "/refund", body = '{{"ref": "r{{{{ record.id }}}}", "charge": {{{{ output.charge | tojson }}}}}}' }} }}
[[pipelines.hold.steps]]
name = "review"
kind = "approval"
needs = ["charge"]

[[pipelines.nap.steps]]
name = "later"
kind = "sleep"
for = "24h"
"#
    )
}

async fn record(db: &Db, id: i64) -> Record {
    db.get_record(id).await.unwrap().unwrap()
}

async fn a_failure_undoes_the_succeeded_steps_last_first(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "undo_failure").await else {
        return;
    };
    let shop = Shop::spawn().await;
    let config = shop_config(&shop.url);
    let start = crate::helpers::wall_ms();
    let (engine, _clock) = manual_engine_at(&t.db, config, "n1", start).await;
    let id = engine
        .enqueue(Enqueue::new("order", Some("o1"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drain(&engine).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.state, RecordState::Failed, "{:?}", r.reason);
    assert_eq!(r.error_code.as_deref(), Some("undone"));
    let said = r.reason.unwrap_or_default();
    assert!(said.contains("reserve, then charge"), "{said}");
    assert_eq!(
        shop.routes(),
        ["charge", "reserve", "ship", "release", "refund"],
        "each undo call made once, the last step first"
    );
    assert_eq!(
        shop.bodies("refund")[0]["charge"],
        json!(format!("charge-c{id}"))
    );
    assert_eq!(
        shop.bodies("release")[0]["reservation"],
        json!(format!("reserve-s{id}"))
    );
    // The undo calls are in the history as steps of their own.
    let attempts = t.db.attempts(id).await.unwrap();
    let undo: Vec<&str> = attempts
        .iter()
        .filter(|a| a.step.starts_with("undo:"))
        .map(|a| a.step.as_str())
        .collect();
    assert_eq!(undo, ["undo:reserve", "undo:charge"]);
    let runs = t.db.step_runs(id).await.unwrap();
    let ship = runs.iter().find(|r| r.step == "ship").unwrap();
    assert_eq!(ship.state, StepState::Failed);
    let events = t.db.record_events(id).await.unwrap();
    assert!(
        events.iter().any(|e| e
            .reason
            .as_deref()
            .unwrap_or("")
            .starts_with("undoing: `ship` failed")),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failure_undoes_the_succeeded_steps_last_first() {
    a_failure_undoes_the_succeeded_steps_last_first(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failure_undoes_the_succeeded_steps_last_first() {
    a_failure_undoes_the_succeeded_steps_last_first(Backend::Postgres).await;
}

/// A required step fails while a sibling's job is out: the undo waits
/// for that job to end (following it, starting nothing new), then undoes
/// it too, once.
async fn an_undo_waits_for_a_job_still_out(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "undo_waits").await else {
        return;
    };
    let shop = Shop::spawn().await;
    let config = shop_config(&shop.url);
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config, "n1", start).await;
    let e = Enqueue::new("trip", Some("t1"), json!({}));
    let id = engine.enqueue(e).await.unwrap().record.id;
    drain(&engine).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.state, RecordState::Waiting, "{:?}", r.reason);
    assert_eq!(r.error_code.as_deref(), Some("undo_waits"));
    let said = r.reason.clone().unwrap_or_default();
    assert!(
        said.contains("`ship` failed") && said.contains("`book`"),
        "{said}"
    );
    // The job runs on: it is followed, and nothing else starts.
    clock.advance(1_000);
    drain(&engine).await;
    assert_eq!(
        record(&t.db, id).await.error_code.as_deref(),
        Some("undo_waits")
    );
    shop.jobs_done.store(true, Ordering::SeqCst);
    clock.advance(1_000);
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.state, RecordState::Failed, "{:?}", r.reason);
    assert_eq!(r.error_code.as_deref(), Some("undone"));
    let routes = shop.routes();
    let calls = |route: &str| routes.iter().filter(|r| *r == route).count();
    assert_eq!(calls("unbook"), 1, "the booking undone once: {routes:?}");
    assert_eq!(
        calls("notify"),
        0,
        "nothing new after the failure: {routes:?}"
    );
    assert_eq!(shop.bodies("unbook")[0]["booking"], json!("job-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_undo_waits_for_a_job_still_out() {
    an_undo_waits_for_a_job_still_out(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_undo_waits_for_a_job_still_out() {
    an_undo_waits_for_a_job_still_out(Backend::Postgres).await;
}

/// Undo and wake through the API, as an operator's token sends them: a
/// cancelled record's charge refunded once (a second undo refused), a
/// day's sleep ended at once; each audited with its reason.
async fn undo_and_wake_through_the_api(backend: Backend) {
    let shop = Shop::spawn().await;
    let text = shop_toml(&shop.url);
    let Some(app) = crate::web::WebApp::spawn(backend, "undo_api", &text).await else {
        return;
    };
    let op = app.token(ballast::domain::Role::Operator).await;
    let post = |path: String, body: Value| {
        app.client
            .post(app.url(&path))
            .bearer_auth(&op)
            .json(&body)
            .send()
    };
    let enqueue = async |pipeline: &str| -> i64 {
        let made: Value = post(
            "/api/v1/records".into(),
            json!({ "pipeline": pipeline, "key": format!("{pipeline}-1") }),
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
        made["record"]["id"].as_i64().unwrap()
    };
    let settles = async |id: i64, code: Option<&str>, state: RecordState| {
        crate::wait::until(
            "the record settles",
            std::time::Duration::from_secs(20),
            async || {
                let r = record(&app.t.db, id).await;
                match r.state == state && r.error_code.as_deref() == code {
                    true => Ok(()),
                    false => Err((r.state, r.error_code)),
                }
            },
        )
        .await;
    };
    let act = |id: i64, action: &str| {
        let body = json!({ "action": action, "reason": format!("{action} through the API") });
        post(format!("/api/v1/records/{id}/actions"), body)
    };

    let held = enqueue("hold").await;
    settles(held, Some("awaiting_approval"), RecordState::Waiting).await;
    assert_eq!(act(held, "cancel").await.unwrap().status(), 200);
    let undone = act(held, "undo").await.unwrap();
    assert_eq!(undone.status(), 200, "{:?}", undone.text().await);
    settles(held, Some("undone"), RecordState::Failed).await;
    assert_eq!(shop.bodies("refund").len(), 1, "refunded once");
    let again = act(held, "undo").await.unwrap();
    assert_eq!(again.status(), 400, "nothing left to undo");
    let said: Value = again.json().await.unwrap();
    assert_eq!(said["error"], "nothing_to_undo", "{said}");

    let nap = enqueue("nap").await;
    settles(nap, None, RecordState::Waiting).await;
    let woken = act(nap, "wake").await.unwrap();
    assert_eq!(woken.status(), 200, "{:?}", woken.text().await);
    settles(nap, None, RecordState::Succeeded).await;
    for (id, kind) in [(held, "undo"), (nap, "wake")] {
        let events = app.t.db.record_events(id).await.unwrap();
        let e = events.iter().find(|e| e.kind == kind).unwrap();
        assert!(e.audit, "{kind} audited");
        assert_eq!(
            e.reason.as_deref(),
            Some(&*format!("{kind} through the API"))
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_undo_and_wake_through_the_api() {
    undo_and_wake_through_the_api(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_undo_and_wake_through_the_api() {
    undo_and_wake_through_the_api(Backend::Postgres).await;
}

/// An operator undoes a cancelled record (audited, with a reason); an
/// undo that cannot complete parks the record `undo_failed`, and a retry
/// once the provider is back finishes it.
async fn an_operator_undoes_a_cancelled_record(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "undo_operator").await else {
        return;
    };
    let shop = Shop::spawn().await;
    let config = shop_config(&shop.url);
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
    let id = engine
        .enqueue(Enqueue::new("hold", Some("h1"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drain(&engine).await;
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let act = |action: OperatorAction, reason: Option<&str>| {
        let reason = reason.map(str::to_owned);
        let ops = &ops;
        async move {
            ops.act_with(id, action, "ann", reason, ActExtra::default())
                .await
        }
    };
    act(OperatorAction::Cancel, Some("customer left"))
        .await
        .unwrap();
    let bare = act(OperatorAction::Undo, None).await.unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(bare).code(),
        "reason_required"
    );
    shop.refunds_fail.store(true, Ordering::SeqCst);
    act(OperatorAction::Undo, Some("refund the charge"))
        .await
        .unwrap();
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.state, RecordState::Parked, "{:?}", r.reason);
    assert_eq!(r.error_code.as_deref(), Some("undo_failed"));
    let said = r.reason.unwrap_or_default();
    assert!(
        said.contains("the undo of charge could not complete"),
        "{said}"
    );
    assert_eq!(
        shop.bodies("refund").len(),
        2,
        "the undo call's own two attempts"
    );
    shop.refunds_fail.store(false, Ordering::SeqCst);
    act(OperatorAction::Retry, Some("refunds are back"))
        .await
        .unwrap();
    drain(&engine).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.state, RecordState::Failed, "{:?}", r.reason);
    assert_eq!(r.error_code.as_deref(), Some("undone"));
    assert_eq!(shop.bodies("refund").len(), 3);
    let audited = t.db.record_events(id).await.unwrap();
    let undo = audited
        .iter()
        .find(|e| e.kind == "undo")
        .expect("the undo is audited");
    assert!(undo.audit && undo.actor == "ann", "{undo:?}");
    // Nothing is undone twice, and a retry would go on on top of the
    // undone effects: both are refused.
    let again = act(OperatorAction::Undo, Some("again")).await.unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(again).code(),
        "nothing_to_undo"
    );
    let retry = act(OperatorAction::Retry, Some("again")).await.unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(retry).code(),
        "record_undone"
    );
    assert_eq!(shop.bodies("refund").len(), 3);
    // A replay charges again; undone once more, the earlier undo's result
    // is kept as a version and the refund is a new call.
    let extra = ActExtra {
        step: Some("charge"),
        ..Default::default()
    };
    ops.act_with(
        id,
        OperatorAction::ReplayFrom,
        "ann",
        Some("again".into()),
        extra,
    )
    .await
    .unwrap();
    drain(&engine).await;
    assert_eq!(record(&t.db, id).await.state, RecordState::Waiting);
    act(OperatorAction::Cancel, Some("left again"))
        .await
        .unwrap();
    act(OperatorAction::Undo, Some("refund the second charge"))
        .await
        .unwrap();
    drain(&engine).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.error_code.as_deref(), Some("undone"), "{:?}", r.reason);
    assert_eq!(shop.bodies("refund").len(), 4);
    let versions = t.db.step_versions(id).await.unwrap();
    assert!(
        versions.iter().any(|v| v.step == "undo:charge"),
        "the first undo's result is kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_operator_undoes_a_cancelled_record() {
    an_operator_undoes_a_cancelled_record(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_operator_undoes_a_cancelled_record() {
    an_operator_undoes_a_cancelled_record(Backend::Postgres).await;
}

#[test]
fn check_config_refuses_undo_it_cannot_make() {
    let whole = |step: &str| {
        let text = format!(
            r#"
[providers.shop]
base_url = "http://127.0.0.1:9"
[[pipelines.order.steps]]
name = "charge"
{step}
"#
        );
        Config::parse(&text, Path::new("undo.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let call = "provider = \"shop\"\nrequest = { method = \"POST\", path = \"/charge\" }";
    assert_eq!(
        whole(&format!(
            "{call}\nundo = {{ request = {{ path = \"/refund/{{{{ output.id }}}}\" }} }}"
        )),
        ""
    );
    let job = "provider = \"shop\"\nkind = \"submit_poll\"\njob_id = \"/id\"\n\
               poll = { path = \"/jobs/{{ job_id }}\" }\n\
               request = { method = \"POST\", path = \"/jobs\" }";
    let undo = "undo = { request = { path = \"/jobs/{{ output.id }}/cancel\" } }";
    let nothing = Config::parse(
        "[providers.shop]\nbase_url = \"http://127.0.0.1:9\"\n[pipelines.order]\non_failure = \"undo\"\n\
         [[pipelines.order.steps]]\nname = \"charge\"\nprovider = \"shop\"\nrequest = { path = \"/c\" }\n",
        Path::new("undo.toml"),
    )
    .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
    .unwrap_err()
    .to_string();
    assert!(
        nothing.contains("pipelines.order.on_failure") && nothing.contains("no step says how"),
        "{nothing}"
    );
    assert_eq!(whole(&format!("{job}\n{undo}")), "", "a job step's undo");
    for (step, expected) in [
        (
            format!("{call}\nundo = {{ provider = \"shop\" }}"),
            "missing field `request`",
        ),
        (
            format!("{call}\nundo = {{ provider = \"bank\", request = {{ path = \"/r\" }} }}"),
            "unknown provider `bank`",
        ),
        (
            format!("{call}\nundo = {{ request = {{ path = \"/r/{{{{ steps.x.output }}}}\" }} }}"),
            "`x`",
        ),
        (
            "kind = \"approval\"\nundo = { request = { path = \"/r\" } }".to_owned(),
            "takes no `undo`",
        ),
    ] {
        let err = whole(&step);
        assert!(err.contains(expected), "expected {expected:?}: {err}");
    }
}

/// An undo stopped part-way (one call made, one failed) is finished by a
/// second undo, which makes only the call not made; a resume, which
/// would park it again, is refused; a replay must start no later than
/// the first step undone.
async fn a_partial_undo_is_finished_not_repeated(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "undo_partial").await else {
        return;
    };
    let shop = Shop::spawn().await;
    shop.refunds_fail.store(true, Ordering::SeqCst);
    let config = shop_config(&shop.url);
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
    let id = engine
        .enqueue(Enqueue::new("order", Some("o2"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drive_at_rest(&engine, &clock, 1, 1_000, 60_000).await;
    let r = record(&t.db, id).await;
    assert_eq!(
        r.error_code.as_deref(),
        Some("undo_failed"),
        "{:?}",
        r.reason
    );
    assert_eq!(
        (shop.bodies("release").len(), shop.bodies("refund").len()),
        (1, 2)
    );
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let act = |action: OperatorAction, step: Option<&'static str>| {
        let ops = &ops;
        let extra = ActExtra {
            step,
            ..Default::default()
        };
        async move {
            ops.act_with(id, action, "ann", Some("ops".into()), extra)
                .await
        }
    };
    let resumed = act(OperatorAction::Resume, None).await.unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(resumed).code(),
        "undo_call_failed"
    );
    shop.refunds_fail.store(false, Ordering::SeqCst);
    act(OperatorAction::Undo, None).await.unwrap();
    drain(&engine).await;
    let r = record(&t.db, id).await;
    assert_eq!(r.error_code.as_deref(), Some("undone"), "{:?}", r.reason);
    assert_eq!(
        (shop.bodies("release").len(), shop.bodies("refund").len()),
        (1, 3),
        "the release is not made twice"
    );
    let past = act(OperatorAction::ReplayFrom, Some("reserve"))
        .await
        .unwrap_err();
    assert_eq!(
        ballast::web::error::WebError::from(past).code(),
        "replay_past_undone"
    );
    act(OperatorAction::ReplayFrom, Some("charge"))
        .await
        .unwrap();
    drain(&engine).await;
    // Charged again, shipping refused again: both undone again, as new
    // calls (new idempotency keys).
    let r = record(&t.db, id).await;
    assert_eq!(r.error_code.as_deref(), Some("undone"), "{:?}", r.reason);
    assert_eq!(
        (shop.bodies("release").len(), shop.bodies("refund").len()),
        (2, 4)
    );
    let attempts = t.db.attempts(id).await.unwrap();
    let keys: std::collections::BTreeSet<String> = attempts
        .iter()
        .filter(|a| a.step == "undo:charge" && a.http_status == Some(200))
        .filter_map(|a| a.request.as_ref())
        .filter_map(|r| {
            r.headers
                .iter()
                .find(|(h, _)| h.eq_ignore_ascii_case("idempotency-key"))
                .map(|(_, v)| v.clone())
        })
        .collect();
    assert_eq!(keys.len(), 2, "each refund its own key: {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_partial_undo_is_finished_not_repeated() {
    a_partial_undo_is_finished_not_repeated(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_partial_undo_is_finished_not_repeated() {
    a_partial_undo_is_finished_not_repeated(Backend::Postgres).await;
}
