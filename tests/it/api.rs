//! The JSON API and the overview against a real engine and the simulator:
//! idempotent enqueue, lists with filters, actions with the page's rules,
//! stable error codes, body limits, and live statistics.

use std::time::Duration;

use ballast::domain::{RecordState, Role};
use ballast::sim::{Profile, SimHandle};
use ballast::store::Backend;
use serde_json::{Value, json};

use crate::wait;
use crate::web::WebApp;

pub(crate) fn pipeline(base_url: &str) -> String {
    format!(
        r#"
[providers.sim]
base_url = "{base_url}"
timeout = "2s"
retry = {{ max_attempts = 3, base = "20ms", cap = "100ms", deadline = "20s" }}
[[providers.sim.rules]]
when = {{ status = "2xx" }}
outcome = "success"
[[providers.sim.rules]]
when = {{ status = ["400", "404", "422"] }}
outcome = "fail"
[[pipelines.leads.steps]]
name = "charge"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "{{{{ record.id }}}}", "amount": 1}}' }}
outputs = {{ charge_id = "/id" }}
"#
    )
}

async fn api_round_trip(backend: Backend) {
    let sim = SimHandle::spawn(Profile::clean(3)).await.unwrap();
    let Some(app) = WebApp::spawn(backend, "api", &pipeline(&sim.base_url())).await else {
        sim.stop();
        return;
    };
    let op = app.token(Role::Operator).await;
    let viewer = app.token(Role::Viewer).await;
    let post = |path: &str, body: Value, token: &str| {
        app.client
            .post(app.url(path))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    // Enqueue is idempotent on the external key.
    let first = post(
        "/api/v1/records",
        json!({"pipeline": "leads", "key": "lead-1", "input": {"email": "a@b.c"}}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    let again = post(
        "/api/v1/records",
        json!({"pipeline": "leads", "key": "lead-1", "input": {"email": "other"}}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(first["record"]["id"], again["record"]["id"]);
    assert_eq!(again["created"], false);
    assert_eq!(
        again["record"]["input"]["email"], "a@b.c",
        "the first input stands"
    );
    assert_eq!(first["record"]["group"], Value::Null);
    let id = first["record"]["id"].as_i64().unwrap();
    for k in 2..=5 {
        let grouped = post(
            "/api/v1/records",
            json!({"pipeline": "leads", "key": format!("lead-{k}"), "group": "tenant-7"}),
            &op,
        )
        .await
        .unwrap();
        let grouped: Value = grouped.json().await.unwrap();
        assert_eq!(grouped["record"]["group"], "tenant-7");
    }
    // A group is named or left out.
    let empty = post(
        "/api/v1/records",
        json!({"pipeline": "leads", "key": "lead-x", "group": ""}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(empty.status(), 400);
    let empty: Value = empty.json().await.unwrap();
    assert_eq!(empty["error"], "invalid_group", "{empty}");
    // The workers finish them.
    wait::until(
        "the API lists five records succeeded",
        Duration::from_secs(30),
        async || {
            let r: Value = app
                .client
                .get(app.url("/api/v1/records?state=succeeded&limit=10"))
                .bearer_auth(&viewer)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            match r["items"].as_array().unwrap().len() {
                5 => Ok(()),
                done => Err(done),
            }
        },
    )
    .await;
    // Keyset pages.
    let page: Value = app
        .client
        .get(app.url("/api/v1/records?limit=2&q=lead-"))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), 2);
    let next = page["next"].as_i64().unwrap();
    let page2: Value = app
        .client
        .get(app.url(&format!("/api/v1/records?limit=2&q=lead-&before={next}")))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(page2["items"][0]["id"].as_i64().unwrap() < next);
    // Detail carries the history.
    let detail: Value = app
        .client
        .get(app.url(&format!("/api/v1/records/{id}")))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(detail["record"]["state"], "succeeded");
    assert_eq!(detail["attempts"][0]["http_status"], 200);
    assert!(detail["events"].as_array().unwrap().len() >= 2);
    // It lists what may be done to it, as the page offers it: a finished
    // record is replayed, nothing else.
    assert_eq!(
        detail["actions"],
        json!(["replay"]),
        "{}",
        detail["actions"]
    );
    // Actions follow the same rules as the page.
    let r = post(
        &format!("/api/v1/records/{id}/actions"),
        json!({"action": "resume"}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 409);
    let e: Value = r.json().await.unwrap();
    assert!(e["error"].as_str().unwrap().len() > 3, "{e}");
    let r = post(
        &format!("/api/v1/records/{id}/actions"),
        json!({"action": "replay", "step": "charge", "reason": "re-run"}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let r = post(
        &format!("/api/v1/records/{id}/actions"),
        json!({"action": "replay", "step": "nope"}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400);
    // Parking until a condition: what cannot be is refused with a clear
    // error and changes nothing; then a time an hour on, found by the
    // list's filter.
    let held = app.record("held").await;
    let act = |body: Value| post(&format!("/api/v1/records/{held}/actions"), body, &op);
    for (action, until, code) in [
        ("park", "yesterday", "bad_until"),
        ("park", "2001-01-01T00:00Z", "bad_until"),
        ("park", "provider", "bad_until"),
        ("park", "time", "bad_until"),
        ("retry", "2h", "until_needs_park"),
    ] {
        let r = act(json!({"action": action, "reason": "r", "until": until}))
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{until}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"], code, "{until}: {e}");
        assert!(e["message"].as_str().unwrap_or("").len() > 10, "{e}");
    }
    let untouched = app.t.db.get_record(held).await.unwrap().unwrap();
    assert_eq!(
        (untouched.state, untouched.park_until),
        (RecordState::Pending, None)
    );
    let r = act(json!({"action": "park", "reason": "after the batch", "until": "2h"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let parked: Value = r.json().await.unwrap();
    assert_eq!(parked["record"]["park_until"]["kind"], "time");
    let listed: Value = app
        .client
        .get(app.url("/api/v1/records?until=time"))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["items"][0]["id"], held, "{listed}");
    let bad = app
        .client
        .get(app.url("/api/v1/records?until=tomorrow"))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // Parked again without a condition named, it keeps its own.
    let again = act(json!({"action": "park", "reason": "still after the batch"}))
        .await
        .unwrap();
    let again: Value = again.json().await.unwrap();
    assert_eq!(
        again["record"]["park_until"],
        parked["record"]["park_until"]
    );
    // Stable error codes for bad input.
    let bad = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(
        bad.json::<Value>().await.unwrap()["error"],
        "malformed_json"
    );
    let bad = post(
        "/api/v1/records",
        json!({"pipeline": "leads", "surprise": 1}),
        &op,
    )
    .await
    .unwrap();
    assert_eq!(bad.json::<Value>().await.unwrap()["error"], "invalid_body");
    let bad = post("/api/v1/records", json!({"pipeline": "nope"}), &op)
        .await
        .unwrap();
    assert_eq!(
        bad.json::<Value>().await.unwrap()["error"],
        "unknown_pipeline"
    );
    let bad = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        bad.json::<Value>().await.unwrap()["error"],
        "unsupported_media_type"
    );
    let huge = json!({"pipeline": "leads", "input": {"blob": "x".repeat(300 * 1024)}});
    let r = post("/api/v1/records", huge, &op).await.unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "body_too_large");
    let bad = app
        .client
        .get(app.url("/api/v1/records?state=sleeping"))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.json::<Value>().await.unwrap()["error"], "bad_filter");

    // The overview shows counts and, once the node has flushed its
    // statistics to the database, those too.
    wait::until(
        "the node flushes its statistics",
        Duration::from_secs(30),
        async || {
            let rows = app.t.db.rollups_since(0).await.unwrap();
            if rows.iter().any(|r| r.calls > 0) {
                Ok(())
            } else {
                Err(rows)
            }
        },
    )
    .await;
    app.user("v", Role::Viewer).await;
    let login = app.login("v").await;
    let html = wait::until(
        "the overview shows the step's statistics",
        Duration::from_secs(30),
        async || {
            let html = app.get("/", Some(&login)).await.text().await.unwrap();
            if html.contains("leads / charge (sim)") {
                Ok(html)
            } else {
                Err(html)
            }
        },
    )
    .await;
    assert!(html.contains("100.0%"), "success rate");
    assert!(html.contains("<rect"), "a throughput chart");
    let live = app.fragment("/", &login).await;
    assert!(
        live.starts_with("\n<div id=\"live\"") || live.trim_start().starts_with("<div id=\"live\""),
        "the live fragment alone: {}",
        &live[..80.min(live.len())]
    );
    app.stop().await;
    sim.stop();
}

/// Issue 20 item 4: a record enqueued through the API for later (`delay`
/// or `run_at`) waits `pending` until then; a time already past is now;
/// both at once, a bad time or one too far ahead are refused with a clear
/// error and create nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_enqueued_for_later() {
    let Some(app) = WebApp::spawn(
        Backend::Sqlite,
        "api_later",
        &pipeline("http://127.0.0.1:9"),
    )
    .await
    else {
        return;
    };
    let op = app.token(Role::Operator).await;
    let post = |body: Value| {
        app.client
            .post(app.url("/api/v1/records"))
            .bearer_auth(&op)
            .json(&body)
            .send()
    };
    let before = crate::helpers::wall_ms();
    let r = post(json!({"pipeline": "leads", "key": "later", "delay": "2h"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let after = crate::helpers::wall_ms();
    let r: Value = r.json().await.unwrap();
    let due = r["record"]["next_run_at"].as_i64().unwrap();
    let two_hours = 7_200_000;
    assert!(
        (before + two_hours..=after + two_hours).contains(&due),
        "due {due}, enqueued between {before} and {after}"
    );
    assert_eq!(r["record"]["state"], "pending");
    // A month ahead, to the minute.
    let at_ms = (before / 60_000 + 30 * 1_440) * 60_000;
    let text = ballast::domain::time::format_ms(at_ms);
    let at = json!({"pipeline": "leads", "key": "at", "run_at": text});
    let r: Value = post(at).await.unwrap().json().await.unwrap();
    assert_eq!(r["record"]["next_run_at"], json!(at_ms), "{r}");
    let late = json!({"pipeline": "leads", "key": "late", "run_at": "2020-01-01T00:00Z"});
    let r: Value = post(late).await.unwrap().json().await.unwrap();
    assert!(r["record"]["next_run_at"].as_i64().unwrap() >= before);
    for (body, code) in [
        (
            json!({"pipeline": "leads", "key": "x1", "delay": "1h", "run_at": "2099-01-01T00:00Z"}),
            "invalid_run_at",
        ),
        (
            json!({"pipeline": "leads", "key": "x2", "delay": "soon"}),
            "invalid_delay",
        ),
        (
            json!({"pipeline": "leads", "key": "x3", "run_at": "noon"}),
            "invalid_run_at",
        ),
        (
            json!({"pipeline": "leads", "key": "x4", "delay": "500d"}),
            "invalid_run_at",
        ),
        (
            json!({"pipeline": "leads", "key": "schedule:2026-12-24T09:00:00.000Z"}),
            "invalid_key",
        ),
    ] {
        let r = post(body.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"], code, "{body}: {e}");
    }
    let all = app.t.db.state_counts().await.unwrap();
    assert_eq!(
        all.iter().map(|c| c.count).sum::<i64>(),
        3,
        "nothing created by a refused enqueue"
    );
    app.stop().await;
}

/// Issue 22 item 3: a list of up to 1,000 records is enqueued at once,
/// all or none (one statement on PostgreSQL): keys repeat as for one
/// record (within the list too), a bad item refuses the list naming it and
/// creates nothing, and the maintained counters agree with a recount.
async fn a_list_is_enqueued_at_once(backend: Backend) {
    let Some(app) = WebApp::spawn(backend, "api_list", &pipeline("http://127.0.0.1:9")).await
    else {
        return;
    };
    let op = app.token(Role::Operator).await;
    let post = |body: Value| {
        app.client
            .post(app.url("/api/v1/records"))
            .bearer_auth(&op)
            .json(&body)
            .send()
    };
    let list = json!([
        {"pipeline": "leads", "key": "a", "group": "t1", "input": {"n": 1}},
        {"pipeline": "leads", "delay": "1h"},
        {"pipeline": "leads", "key": "a", "input": {"n": 2}},
        {"pipeline": "leads", "input": {"n": 3}},
    ]);
    let r = post(list).await.unwrap();
    assert_eq!(r.status(), 201);
    let r: Value = r.json().await.unwrap();
    assert_eq!(r["created"], 3, "{r}");
    let items = r["items"].as_array().unwrap();
    assert_eq!(items.len(), 4);
    let created: Vec<bool> = items.iter().map(|i| i["created"] == true).collect();
    assert_eq!(created, [true, true, false, true]);
    assert_eq!(
        items[2]["record"]["id"], items[0]["record"]["id"],
        "a repeat in the list"
    );
    assert_eq!(items[0]["record"]["group"], "t1");
    assert_eq!(items[0]["record"]["input"], json!({"n": 1}));
    let later = items[1]["record"]["next_run_at"].as_i64().unwrap();
    assert!(
        later > crate::helpers::wall_ms() + 3_000_000,
        "delayed an hour"
    );
    for item in items {
        let id = item["record"]["id"].as_i64().unwrap();
        let events = app.t.db.record_events(id).await.unwrap();
        let made: Vec<_> = events.iter().filter(|e| e.kind == "created").collect();
        assert_eq!(made.len(), 1, "one created event for {id}: {events:?}");
        assert_eq!(made[0].to_state, Some(RecordState::Pending));
        assert_eq!(made[0].actor, "system");
    }
    // All repeats: 200, nothing new.
    let again = json!([{"pipeline": "leads", "key": "a"}]);
    let r = post(again).await.unwrap();
    assert_eq!(r.status(), 200);
    // A bad item refuses the list, naming it; nothing is created.
    let total = |c: Vec<ballast::domain::StateCount>| c.iter().map(|c| c.count).sum::<i64>();
    let before = total(app.t.db.state_counts().await.unwrap());
    for (list, code, says) in [
        (
            json!([{"pipeline": "leads", "key": "b"}, {"pipeline": "nope"}]),
            "unknown_pipeline",
            "item 1: unknown pipeline",
        ),
        (
            json!([{"pipeline": "leads", "key": "c"}, {"pipeline": "leads", "delay": "soon"}]),
            "invalid_delay",
            "item 1:",
        ),
        (
            json!([{"pipeline": "leads"}, {"pipeline": "leads", "colour": "red"}]),
            "invalid_body",
            "item 1: unknown field",
        ),
        (json!([]), "invalid_batch", "not 0"),
    ] {
        let r = post(list.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{list}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"], code, "{list}: {e}");
        assert!(e["message"].as_str().unwrap().contains(says), "{e}");
    }
    let too_many: Vec<Value> = (0..1_001).map(|_| json!({"pipeline": "leads"})).collect();
    let r = post(Value::Array(too_many)).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(total(app.t.db.state_counts().await.unwrap()), before);
    // The most a call takes, at once.
    let full: Vec<Value> = (0..1_000)
        .map(|i| json!({"pipeline": "leads", "key": format!("full-{i}"), "input": {"i": i}}))
        .collect();
    let r = post(Value::Array(full)).await.unwrap();
    assert_eq!(r.status(), 201);
    let r: Value = r.json().await.unwrap();
    assert_eq!(r["created"], 1_000);
    let ids: std::collections::BTreeSet<i64> = r["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["record"]["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids.len(), 1_000);
    assert_eq!(
        r["items"][999]["record"]["external_key"], "full-999",
        "items in the list's order"
    );
    assert_eq!(
        total(app.t.db.state_counts().await.unwrap()),
        before + 1_000
    );
    // The engine stopped (its claims would move records between the two
    // reads), the counters agree with a count of the rows.
    let t = app.stop_keeping_db().await;
    assert_eq!(
        t.db.state_counts().await.unwrap(),
        t.db.recount_states().await.unwrap()
    );
    assert_eq!(
        t.db.step_counts().await.unwrap(),
        t.db.recount_steps().await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_list_is_enqueued_at_once() {
    a_list_is_enqueued_at_once(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_list_is_enqueued_at_once() {
    a_list_is_enqueued_at_once(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_round_trip_sqlite() {
    api_round_trip(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_round_trip_postgres() {
    api_round_trip(Backend::Postgres).await;
}

/// A provider that echoes the credential it was sent in its error body, as
/// some do. The key must not reach the database, the pages or the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_keys_are_never_stored_or_shown() {
    use axum::http::HeaderMap;
    // The planted key: an environment variable every `cargo test` run has
    // (tests may not set variables; `unsafe` is forbidden).
    let key = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it");
    assert!(key.len() >= 6);
    let echo = axum::Router::new().fallback(|headers: HeaderMap| async move {
        let got = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "error": format!("key {got} is over quota") })),
        )
    });
    let echo_base = crate::helpers::serve_router(echo).await;
    let extra = format!(
        r#"
[providers.echo]
base_url = "{echo_base}"
auth = {{ header = "Authorization", value_env = "CARGO_MANIFEST_DIR", scheme = "Bearer" }}
retry = {{ max_attempts = 2, base = "10ms", cap = "20ms", deadline = "20s" }}
[[pipelines.leaky.steps]]
name = "call"
provider = "echo"
request = {{ method = "POST", path = "/v1/x", body = '{{"ref": "{{{{ record.id }}}}"}}' }}
"#
    );
    let Some(app) = WebApp::spawn(Backend::Sqlite, "secrets", &extra).await else {
        return;
    };
    let op = app.token(Role::Admin).await;
    let created: Value = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .json(&json!({"pipeline": "leaky", "key": "k1"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["record"]["id"].as_i64().unwrap();
    wait::until(
        "the record is parked",
        Duration::from_secs(30),
        async || match app.t.db.get_record(id).await.unwrap().unwrap().state {
            ballast::domain::RecordState::Parked => Ok(()),
            other => Err(other),
        },
    )
    .await;
    let attempts = app.t.db.attempts(id).await.unwrap();
    assert_eq!(attempts.len(), 2);
    for a in &attempts {
        let e = a.excerpt.as_deref().unwrap_or("");
        assert!(e.contains("key Bearer [redacted] is over quota"), "{e}");
    }
    app.user("admin", Role::Admin).await;
    let login = app.login("admin").await;
    let mut checked = 0;
    for path in [
        format!("/records/{id}"),
        "/records".into(),
        "/providers".into(),
        "/".into(),
        "/audit".into(),
    ] {
        let html = app.get(&path, Some(&login)).await.text().await.unwrap();
        assert!(!html.contains(&key), "{path} shows the key");
        checked += 1;
    }
    let api = app
        .client
        .get(app.url(&format!("/api/v1/records/{id}")))
        .bearer_auth(&op)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!api.contains(&key) && api.contains("[redacted]"));
    // Not in any file of the database (main file and WAL).
    app.t.db.ping().await.unwrap();
    let path = app
        .t
        .url
        .trim_start_matches("sqlite://")
        .split('?')
        .next()
        .unwrap()
        .to_owned();
    let dir = std::path::Path::new(&path).parent().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        assert!(
            !bytes.windows(key.len()).any(|w| w == key.as_bytes()),
            "the key is in the database files"
        );
        checked += 1;
    }
    println!(
        "planted provider key: searched {checked} pages, API answers and database files; found 0 times"
    );
    app.stop().await;
}

/// `group` selects records in the list, a bulk action's filter and an
/// export, through the API, beside another filter and alone (searched in
/// id windows: no index orders a group by id).
async fn records_are_selected_by_group(backend: Backend) {
    // A pipeline for the API's enqueue (its records come due in an hour).
    let manual = "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\n\
                  [[pipelines.manual.steps]]\nname = \"s\"\nprovider = \"p\"\n\
                  request = { method = \"POST\", path = \"/v1\" }\n";
    let Some(app) = WebApp::spawn(backend, "api_groups", manual).await else {
        return;
    };
    let op = app.token(Role::Operator).await;
    let mut ids = std::collections::BTreeMap::<&str, Vec<i64>>::new();
    for k in 0..9 {
        let group = ["tenant-a", "tenant-b", ""][k % 3];
        let key = format!("g-{k}");
        let id = app
            .record_in(&key, Some(group).filter(|g| !g.is_empty()))
            .await;
        if k < 6 {
            app.park(id).await;
        }
        ids.entry(group).or_default().push(id);
    }
    let get = |path: String| {
        let req = app.client.get(app.url(&path)).bearer_auth(&op);
        async move { req.send().await.unwrap() }
    };
    let listed = |v: &Value| -> Vec<i64> {
        let mut got: Vec<i64> = v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_i64().unwrap())
            .collect();
        got.sort();
        got
    };
    let page: Value = get("/api/v1/records?group=tenant-a&limit=100".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(listed(&page), ids["tenant-a"], "{page}");
    assert!(
        page["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["group"] == "tenant-a"),
        "{page}"
    );
    let parked_b: Value = get("/api/v1/records?group=tenant-b&state=parked".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(listed(&parked_b), ids["tenant-b"][..2].to_vec());
    // A bulk action over a group: the dry run names its records alone.
    let r: Value = app
        .client
        .post(app.url("/api/v1/records/bulk"))
        .bearer_auth(&op)
        .json(&json!({"action": "resume", "reason": "r", "filter": {"group": "tenant-b", "state": "parked"}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["matched"], 2, "{r}");
    let mut allowed: Vec<i64> = serde_json::from_value(r["allowed_ids"].clone()).unwrap();
    allowed.sort();
    assert_eq!(allowed, ids["tenant-b"][..2], "{r}");
    // A group is matched exactly: one with spaces around it is refused at
    // enqueue, and a filter that is only spaces selects nothing rather
    // than every group.
    let padded = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .json(&json!({"pipeline": "manual", "key": "g-pad", "group": " ", "input": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(padded.status(), 400);
    let said = padded.text().await.unwrap();
    assert!(said.contains("begins or ends with a space"), "{said}");
    let spaces: Value = app
        .client
        .post(app.url("/api/v1/records/bulk"))
        .bearer_auth(&op)
        .json(&json!({"action": "resume", "reason": "r", "filter": {"group": " ", "state": "parked"}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(spaces["matched"], 0, "{spaces}");
    // An export of a group.
    let text = get("/api/v1/records/export?group=tenant-a".into())
        .await
        .text()
        .await
        .unwrap();
    let mut exported: Vec<i64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["record"]["id"]
                .as_i64()
                .unwrap()
        })
        .collect();
    exported.sort();
    assert_eq!(exported, ids["tenant-a"]);
    // The records page filters alike, and shows each record's group.
    app.user("vera", Role::Viewer).await;
    let login = app.login("vera").await;
    let page = app
        .get("/records?group=tenant-a", Some(&login))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(">g-0<") && page.contains(">g-3<") && !page.contains(">g-1<"),
        "{page}"
    );
    assert!(page.contains(r#"<small class="muted" title="group">tenant-a</small>"#));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_records_are_selected_by_group() {
    records_are_selected_by_group(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_are_selected_by_group() {
    records_are_selected_by_group(Backend::Postgres).await;
}

/// Priority through the API (issue 50 item 6): given at enqueue (one or
/// a batch), 5 when left out, refused out of 0 to 9 with nothing made;
/// a filter of the list, a bulk action and an export.
async fn records_are_enqueued_and_selected_by_priority(backend: Backend) {
    let manual = "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\n\
                  [[pipelines.manual.steps]]\nname = \"s\"\nprovider = \"p\"\n\
                  request = { method = \"POST\", path = \"/v1\" }\n";
    let Some(app) = WebApp::spawn(backend, "api_priority", manual).await else {
        return;
    };
    let op = app.token(Role::Operator).await;
    let post = |path: &str, body: Value| {
        let req = app.client.post(app.url(path)).bearer_auth(&op).json(&body);
        async move { req.send().await.unwrap() }
    };
    let get = |path: String| {
        let req = app.client.get(app.url(&path)).bearer_auth(&op);
        async move { req.send().await.unwrap() }
    };
    // Due in an hour: nothing runs them meanwhile.
    let one = |key: &str, priority: Value| json!({"pipeline": "manual", "key": key, "priority": priority, "delay": "1h"});
    let r = post("/api/v1/records", one("urgent", json!(8))).await;
    assert_eq!(r.status(), 201);
    let urgent: Value = r.json().await.unwrap();
    assert_eq!(urgent["record"]["priority"], 8, "{urgent}");
    let r = post(
        "/api/v1/records",
        json!({"pipeline": "manual", "key": "plain", "delay": "1h"}),
    )
    .await;
    let plain: Value = r.json().await.unwrap();
    assert_eq!(plain["record"]["priority"], 5, "{plain}");
    let r = post(
        "/api/v1/records",
        json!([one("b-0", json!(0)), one("b-1", json!(8))]),
    )
    .await;
    assert_eq!(r.status(), 201);
    for (body, says) in [
        (one("bad", json!(10)), "out of range"),
        (one("bad", json!(-1)), ""),
        (one("bad", json!("high")), ""),
        (
            json!([one("bad-0", json!(1)), one("bad-1", json!(12))]),
            "item 1",
        ),
    ] {
        let r = post("/api/v1/records", body.clone()).await;
        assert_eq!(r.status(), 400, "{body}");
        let text = r.text().await.unwrap();
        assert!(text.contains(says), "{body}: {text}");
    }
    let made = crate::helpers::record_total(&app.t.db).await;
    assert_eq!(made, 4, "nothing made by a refused enqueue");
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["external_key"].as_str().unwrap().to_owned())
            .collect();
        k.sort();
        k
    };
    let page: Value = get("/api/v1/records?priority=8".into())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(keys(&page), vec!["b-1", "urgent"], "{page}");
    let r = get("/api/v1/records?priority=10".into()).await;
    assert_eq!(r.status(), 400);
    let problem: Value = r.json().await.unwrap();
    assert_eq!(problem["code"], "bad_filter", "{problem}");
    let r: Value = post(
        "/api/v1/records/bulk",
        json!({"action": "park", "reason": "r", "filter": {"priority": "0"}}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(r["matched"], 1, "{r}");
    let text = get("/api/v1/records/export?priority=5".into())
        .await
        .text()
        .await
        .unwrap();
    let exported: Vec<String> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["record"]["external_key"].to_string())
        .collect();
    assert_eq!(exported, vec!["\"plain\""]);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_records_are_enqueued_and_selected_by_priority() {
    records_are_enqueued_and_selected_by_priority(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_are_enqueued_and_selected_by_priority() {
    records_are_enqueued_and_selected_by_priority(Backend::Postgres).await;
}

/// The providers and the audit log through the API, as the dashboard
/// shows them: a provider paused and resumed by an admin token, each
/// change in the audit log, which pages by `before`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn providers_and_the_audit_log_through_the_api() {
    let extra = "[providers.acme]\nbase_url = \"http://user:pw-s3cret@127.0.0.1:9\"\nrate_limits = [\"5/s\"]\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "api_providers", extra).await else {
        return;
    };
    let admin = app.token(Role::Admin).await;
    let viewer = app.token(Role::Viewer).await;
    let call = |method: reqwest::Method, path: &str, token: &str, body: Option<Value>| {
        let mut req = app.client.request(method, app.url(path)).bearer_auth(token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move { req.send().await.unwrap() }
    };
    let list: Value = call(reqwest::Method::GET, "/api/v1/providers", &viewer, None)
        .await
        .json()
        .await
        .unwrap();
    let acme = &list["items"][0];
    assert_eq!(
        (acme["name"].as_str(), acme["breaker"].as_str()),
        (Some("acme"), Some("closed"))
    );
    assert_eq!(acme["paused"], false);
    assert_eq!(acme["rate_limits"], json!(["5/1s"]), "{acme}");
    assert!(!list.to_string().contains("s3cret"), "{list}");
    let pause = "/api/v1/providers/acme/pause";
    let r = call(reqwest::Method::POST, pause, &viewer, Some(json!({}))).await;
    assert_eq!(r.status(), 403);
    let r = call(
        reqwest::Method::POST,
        pause,
        &admin,
        Some(json!({"reason": "maintenance"})),
    )
    .await;
    assert_eq!(r.status(), 200);
    let paused: Value = r.json().await.unwrap();
    assert_eq!(
        (paused["paused"].clone(), paused["paused_reason"].clone()),
        (json!(true), json!("maintenance"))
    );
    assert!(
        app.t
            .db
            .provider_states()
            .await
            .unwrap()
            .iter()
            .any(|p| p.provider == "acme" && p.paused)
    );
    let r = call(
        reqwest::Method::POST,
        "/api/v1/providers/acme/resume",
        &admin,
        None,
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["paused"], false);
    let r = call(
        reqwest::Method::POST,
        "/api/v1/providers/nope/pause",
        &admin,
        None,
    )
    .await;
    assert_eq!(r.status(), 404, "an unknown provider");
    // The audit log: both changes, newest first, one per page.
    let page: Value = call(
        reqwest::Method::GET,
        "/api/v1/audit?kind=provider_resumed",
        &viewer,
        None,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
    let first: Value = call(reqwest::Method::GET, "/api/v1/audit?limit=1", &viewer, None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["items"][0]["kind"], "provider_resumed", "{first}");
    let before = first["next"].as_i64().expect("a next page");
    let second: Value = call(
        reqwest::Method::GET,
        &format!("/api/v1/audit?limit=1&before={before}"),
        &viewer,
        None,
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(second["items"][0]["kind"], "provider_paused", "{second}");
    assert_eq!(second["items"][0]["reason"], "maintenance", "{second}");
    // Users and tokens, for admins: no hash, no secret.
    let users: Value = call(reqwest::Method::GET, "/api/v1/users", &admin, None)
        .await
        .json()
        .await
        .unwrap();
    assert!(
        users["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|u| u["username"] == "admin"),
        "{users}"
    );
    assert!(!users.to_string().contains("argon2"), "{users}");
    let tokens: Value = call(reqwest::Method::GET, "/api/v1/tokens", &admin, None)
        .await
        .json()
        .await
        .unwrap();
    let listed = tokens["items"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{tokens}");
    assert!(
        listed.iter().all(|t| t["last_used_at"].is_number()),
        "both were used: {tokens}"
    );
    assert!(
        !tokens.to_string().contains(&admin[8..]),
        "no secret: {tokens}"
    );
    assert!(!tokens.to_string().contains("token_hash"), "{tokens}");
    let r = call(
        reqwest::Method::GET,
        "/api/v1/audit?kind=x&sort=up",
        &viewer,
        None,
    )
    .await;
    assert_eq!(r.status(), 400, "an unknown parameter is refused");
    app.stop().await;
}

/// Users and tokens are changed through the API as on the admin pages
/// (`web::people`): a user added, its role, pipelines and unmask changed,
/// a weak password refused, disabled and enabled; the last admin kept; a
/// token made (its secret answered once), used and revoked; all audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_and_tokens_are_managed_through_the_api() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "api_people", "").await else {
        return;
    };
    let admin = app.token(Role::Admin).await;
    let call = |method: reqwest::Method, path: &str, token: &str, body: Option<Value>| {
        let mut req = app.client.request(method, app.url(path)).bearer_auth(token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let post = reqwest::Method::POST;
    let (s, user) = call(
        post.clone(),
        "/api/v1/users",
        &admin,
        Some(json!({"username": "support", "password": crate::web::password_of("support"), "role": "viewer", "pipelines": ["leads"]})),
    )
    .await;
    assert_eq!(s, 201, "{user}");
    assert_eq!(user["pipelines"], json!(["leads"]), "{user}");
    let id = user["id"].as_i64().unwrap();
    let at = |what: &str| format!("/api/v1/users/{id}/{what}");
    let (s, changed) = call(
        post.clone(),
        &at("role"),
        &admin,
        Some(json!({"role": "operator"})),
    )
    .await;
    assert_eq!(
        (s, &changed["role"]),
        (200, &json!("operator")),
        "{changed}"
    );
    let (s, changed) = call(
        post.clone(),
        &at("pipelines"),
        &admin,
        Some(json!({"pipelines": []})),
    )
    .await;
    assert_eq!((s, &changed["pipelines"]), (200, &json!([])), "{changed}");
    let (s, changed) = call(
        post.clone(),
        &at("unmask"),
        &admin,
        Some(json!({"unmask": true})),
    )
    .await;
    assert_eq!((s, &changed["unmask"]), (200, &json!(true)), "{changed}");
    let (s, blank) = call(
        post.clone(),
        &at("pipelines"),
        &admin,
        Some(json!({"pipelines": [" "]})),
    )
    .await;
    assert_eq!(
        (s, &blank["code"]),
        (400, &json!("bad_pipelines")),
        "a blank is not every pipeline: {blank}"
    );
    let (s, _) = call(
        post.clone(),
        &at("password"),
        &admin,
        Some(json!({"password": crate::web::password_of("new")})),
    )
    .await;
    assert_eq!(s, 200);
    let (s, weak) = call(
        post.clone(),
        &at("password"),
        &admin,
        Some(json!({"password": "short"})),
    )
    .await;
    assert_eq!((s, &weak["code"]), (400, &json!("weak_password")), "{weak}");
    let (s, off) = call(post.clone(), &at("disable"), &admin, None).await;
    assert_eq!((s, &off["disabled"]), (200, &json!(true)), "{off}");
    let (s, on) = call(post.clone(), &at("enable"), &admin, None).await;
    assert_eq!((s, &on["disabled"]), (200, &json!(false)), "{on}");
    // The last enabled admin stays one, whoever asks.
    let first = app.t.db.user_by_name("admin").await.unwrap().unwrap();
    let (s, kept) = call(
        post.clone(),
        &format!("/api/v1/users/{}/disable", first.id),
        &admin,
        None,
    )
    .await;
    assert_eq!(s, 409, "{kept}");
    // A token: its secret once, then only its prefix; it works until revoked.
    let (s, made) = call(
        post.clone(),
        "/api/v1/tokens",
        &admin,
        Some(json!({"name": "ci", "role": "viewer", "expires_in_days": 30})),
    )
    .await;
    assert_eq!(s, 201, "{made}");
    let secret = made["token"].as_str().unwrap().to_owned();
    assert!(made["item"]["expires_at"].is_number(), "{made}");
    let (s, _) = call(reqwest::Method::GET, "/api/v1/records", &secret, None).await;
    assert_eq!(s, 200);
    let (_, listed) = call(reqwest::Method::GET, "/api/v1/tokens", &admin, None).await;
    assert!(!listed.to_string().contains(&secret), "{listed}");
    let revoke = format!("/api/v1/tokens/{}/revoke", made["item"]["id"]);
    let (s, revoked) = call(post.clone(), &revoke, &admin, None).await;
    assert_eq!(s, 200, "{revoked}");
    assert!(revoked["revoked_at"].is_number(), "{revoked}");
    let (s, _) = call(reqwest::Method::GET, "/api/v1/records", &secret, None).await;
    assert_eq!(s, 401);
    let (s, bad) = call(
        post.clone(),
        "/api/v1/tokens",
        &admin,
        Some(json!({"name": "x", "role": "admin", "pipelines": ["leads"]})),
    )
    .await;
    assert_eq!((s, &bad["code"]), (400, &json!("admin_scoped")), "{bad}");
    // A token made by a token belongs to the user the first belongs to: a
    // change to that user revokes both.
    let (s, _) = call(
        post.clone(),
        &at("role"),
        &admin,
        Some(json!({"role": "admin"})),
    )
    .await;
    assert_eq!(s, 200);
    let (parent, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
    let spec = ballast::store::NewApiToken {
        name: "support-ci".into(),
        token_hash: hash,
        prefix,
        role: Role::Admin,
        created_by: "support".into(),
        actor: "support".into(),
        expires_at: None,
        pipelines: ballast::domain::scope::Scope::all(),
        unmask: false,
    };
    app.t
        .db
        .create_api_token(&spec, crate::helpers::wall_ms())
        .await
        .unwrap();
    let (s, child) = call(
        post.clone(),
        "/api/v1/tokens",
        &parent,
        Some(json!({"name": "child", "role": "viewer"})),
    )
    .await;
    assert_eq!(s, 201, "{child}");
    assert_eq!(child["item"]["created_by"], "support", "{child}");
    let child = child["token"].as_str().unwrap().to_owned();
    let (s, _) = call(post.clone(), &at("disable"), &admin, None).await;
    assert_eq!(s, 200);
    for (who, token) in [("parent", &parent), ("child", &child)] {
        let (s, _) = call(reqwest::Method::GET, "/api/v1/records", token, None).await;
        assert_eq!(s, 401, "{who} revoked with its user");
    }
    // Each change is in the audit log, by the token that made it.
    let (_, audit) = call(reqwest::Method::GET, "/api/v1/audit?limit=50", &admin, None).await;
    let kinds: Vec<&str> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    for kind in [
        "user_added",
        "user_changed",
        "token_created",
        "token_revoked",
    ] {
        assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
    }
    let changes = kinds.iter().filter(|k| **k == "user_changed").count();
    assert_eq!(
        changes, 8,
        "role, pipelines, unmask, password, disable, enable, role, disable: {kinds:?}"
    );
    let by = |kind: &str| -> Vec<String> {
        let items = audit["items"].as_array().unwrap().iter();
        items
            .filter(|e| e["kind"] == kind)
            .map(|e| e["actor"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(
        by("user_added").iter().all(|a| a == "token:t-admin"),
        "{audit}"
    );
    assert!(
        by("token_created").contains(&"token:support-ci".to_owned()),
        "the token that made it: {audit}"
    );
    app.stop().await;
}

/// Issue 21 item 4: bulk actions through the API, with the page's rules: a
/// dry run unless asked to apply, a reason, ids or a filter (not both, not
/// neither), the cap, the per-user limit, operators only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_actions_through_the_api() {
    let Some(app) = WebApp::spawn(
        Backend::Sqlite,
        "api_bulk",
        "[server.limits]\nbulk_max = 5\nbulk_per_minute = 2\n",
    )
    .await
    else {
        return;
    };
    let op = app.token(Role::Operator).await;
    let viewer = app.token(Role::Viewer).await;
    let mut parked = Vec::new();
    for k in 0..3 {
        let id = app.record(&format!("b-{k}")).await;
        app.park(id).await;
        parked.push(id);
    }
    let waiting = app.record("b-pending").await;
    let bulk = |body: Value, token: &str| {
        app.client
            .post(app.url("/api/v1/records/bulk"))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let db = &app.t.db;
    let state = |id: i64| async move { db.get_record(id).await.unwrap().unwrap().state };
    let mut all = parked.clone();
    all.push(waiting);

    assert_eq!(
        bulk(
            json!({"action": "resume", "reason": "r", "ids": all}),
            &viewer
        )
        .await
        .unwrap()
        .status(),
        403
    );
    for (body, code) in [
        (json!({"action": "resume", "ids": all}), "reason_required"),
        (json!({"action": "resume", "reason": "r"}), "bad_selection"),
        (
            json!({"action": "resume", "reason": "r", "ids": all, "filter": {}}),
            "bad_selection",
        ),
        (
            json!({"action": "fly", "reason": "r", "ids": all}),
            "unknown_action",
        ),
        (
            json!({"action": "resume", "reason": "r", "filter": {"state": "asleep"}}),
            "bad_filter",
        ),
        // A misspelled filter would mean "any": refused.
        (
            json!({"action": "resume", "reason": "r", "filter": {"stat": "parked"}}),
            "invalid_body",
        ),
        (
            json!({"action": "resume", "reason": "r", "filter": {"limit": 1}}),
            "invalid_body",
        ),
    ] {
        let r = bulk(body.clone(), &op).await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"], code, "{body}: {e}");
    }

    // A dry run: what would happen, nothing changed.
    let r: Value = bulk(json!({"action": "resume", "reason": "r", "ids": all}), &op)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["applied"], false);
    assert_eq!(r["matched"], 4);
    assert_eq!(r["allowed_ids"], json!(parked));
    assert_eq!(r["refused"], 1);
    for id in &parked {
        assert_eq!(state(*id).await, RecordState::Parked);
    }

    // Applied over a filter: every parked record resumed, each audited.
    let body = json!({"action": "resume", "reason": "provider back", "filter": {"state": "parked"}, "apply": true});
    let r: Value = bulk(body, &op).await.unwrap().json().await.unwrap();
    assert_eq!(
        (r["applied"].clone(), r["matched"].clone()),
        (json!(true), json!(3))
    );
    assert_eq!(r["failed"], json!([]));
    for id in &parked {
        assert_eq!(state(*id).await, RecordState::Pending);
        let kinds = crate::helpers::event_kinds(&app.t.db, *id).await;
        assert!(kinds.iter().any(|k| k == "resume"), "{kinds:?}");
    }

    // More than the cap is refused whole.
    for k in 0..2 {
        app.record(&format!("c-{k}")).await;
    }
    let r = bulk(
        json!({"action": "cancel", "reason": "r", "filter": {}}),
        &op,
    )
    .await
    .unwrap();
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"], "bulk_too_large", "{e}");

    // Two applied actions a minute per user; dry runs do not count.
    let cancel = json!({"action": "cancel", "reason": "r", "ids": [waiting], "apply": true});
    assert_eq!(bulk(cancel.clone(), &op).await.unwrap().status(), 200);
    assert_eq!(state(waiting).await, RecordState::Cancelled);
    assert_eq!(bulk(cancel, &op).await.unwrap().status(), 429);
    app.stop().await;
}
