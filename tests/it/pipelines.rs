//! Issue 21 item 2: the pipelines page draws each pipeline as the graph of
//! its steps, with figures per step run (success, p50/p95 of the whole
//! run) and the records at each step now, all matching a recount from the
//! database; a record's page draws its steps in their states.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use ballast::config::Config;
use ballast::domain::{RecordState, Role, StepState};
use ballast::engine::stats::RUN_BUCKETS_MS;
use ballast::engine::{Enqueue, StatsFlusher};
use ballast::store::Backend;
use serde_json::{Value, json};

use crate::web::WebApp;

/// `a` and `b` (no needs) then `c` (needs both). `b` fails outright for
/// every third record (`n % 3 == 0`: the record fails); `c` answers 500
/// to `n % 4 == 1`, so those records park when its two attempts are spent.
async fn provider() -> String {
    let n = |body: &Value| body["n"].as_i64().unwrap_or(-1);
    let ok = || Json(json!({"status": "succeeded"})).into_response();
    let app = axum::Router::new()
        .route("/a", post(move || async move { ok() }))
        .route(
            "/b",
            post(move |Json(body): Json<Value>| async move {
                if n(&body) % 3 == 0 {
                    (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({}))).into_response()
                } else {
                    ok()
                }
            }),
        )
        .route(
            "/c",
            post(move |Json(body): Json<Value>| async move {
                if n(&body) % 4 == 1 {
                    (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({}))).into_response()
                } else {
                    ok()
                }
            }),
        );
    crate::helpers::serve_router(app).await
}

fn config(base: &str) -> String {
    let step = |name: &str, needs: &str| {
        format!(
            r#"
[[pipelines.fan.steps]]
name = "{name}"
provider = "p"
needs = [{needs}]
request = {{ method = "POST", path = "/{name}", body = '{{"n": {{{{ input.n }}}}}}' }}
"#
        )
    };
    format!(
        r#"
[providers.p]
base_url = "{base}"
timeout = "30s"
retry = {{ max_attempts = 2, base = "1s", cap = "1s", deadline = "10m", budget = 1.0, budget_floor = 1000.0 }}
[[providers.p.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[providers.p.rules]]
when = {{ status = "422" }}
outcome = "fail"
{}{}{}"#,
        step("a", ""),
        step("b", ""),
        step("c", r#""a", "b""#)
    )
}

/// The table row of `step` on the pipelines page.
fn row<'a>(html: &'a str, step: &str) -> &'a str {
    let start = html
        .find(&format!(r#"data-step="{step}""#))
        .unwrap_or_else(|| panic!("no row for step {step}: {html}"));
    let rest = &html[start..];
    &rest[..rest.find("</tr>").unwrap()]
}

/// The text of the cell with `class` in a row.
fn cell(row: &str, class: &str) -> String {
    let at = row
        .find(&format!(r#"class="{class}">"#))
        .unwrap_or_else(|| panic!("no {class} cell in {row}"));
    let rest = &row[at + class.len() + 9..];
    rest[..rest.find("</td>").unwrap()].to_owned()
}

/// The records-here links of a row: state → count.
fn here(row: &str) -> BTreeMap<String, i64> {
    row.split(r#"data-state=""#)
        .skip(1)
        .map(|part| {
            let state = &part[..part.find('"').unwrap()];
            let count = part.split(r#"data-count=""#).nth(1).unwrap();
            let count = &count[..count.find('"').unwrap()];
            (state.to_owned(), count.parse().unwrap())
        })
        .collect()
}

/// The bucket bound the API gives quantile `q` of `took`, from the raw
/// durations.
fn quantile_bound(mut took: Vec<i64>, q: f64) -> i64 {
    took.sort_unstable();
    let want = (q * took.len() as f64).ceil() as usize;
    let ms = took[want.max(1) - 1];
    *RUN_BUCKETS_MS.iter().find(|b| ms <= **b).unwrap()
}

/// The bucket label the page gives quantile `q` of `took`, computed the
/// same way from the raw durations.
fn quantile_label(mut took: Vec<i64>, q: f64) -> String {
    took.sort_unstable();
    let want = (q * took.len() as f64).ceil() as usize;
    let ms = took[want.max(1) - 1];
    let bound = RUN_BUCKETS_MS.iter().find(|b| ms <= **b).unwrap();
    format!("≤ {}", ballast::web::fmt::millis(*bound))
}

/// The app (a viewer `v` logged in) and twelve records of `fan` driven to
/// rest by the test's own engine, ten days ahead of the wall clock (the
/// app's own workers leave them to it): 6 succeeded, 4 failed at `b`, 2
/// parked at `c` (`ids[n]` has input `{"n": n}`).
async fn twelve_at_rest(test: &str) -> Option<AtRest> {
    let base = provider().await;
    let text = config(&base);
    let app = WebApp::spawn(Backend::Sqlite, test, &text).await?;
    app.user("v", Role::Viewer).await;
    let login = app.login("v").await;
    let parsed = Config::parse(&text, std::path::Path::new("t.toml")).unwrap();
    parsed.validate(&|_| None).unwrap();
    let ahead = crate::helpers::wall_ms() + 10 * 86_400_000;
    let (engine, clock) =
        crate::engine::manual_engine_at(&app.t.db, Arc::new(parsed), "pl", ahead).await;
    let total = 12;
    let mut ids = Vec::new();
    for n in 0..total {
        let key = format!("k-{n}");
        let created = engine
            .enqueue(Enqueue::new("fan", Some(&key), json!({"n": n})))
            .await;
        ids.push(created.unwrap().record.id);
    }
    let before = app.text("/pipelines", Some(&login)).await;
    assert!(
        before.contains("Not at a step yet (no attempt recorded): <span class=\"badge pending\">pending</span> 12"),
        "{before}"
    );
    crate::engine::drive_at_rest(&engine, &clock, total, 500, 60_000).await;
    StatsFlusher::of(&engine).flush().await;
    Some(AtRest {
        app,
        login,
        ids,
        engine,
        clock,
    })
}

struct AtRest {
    app: WebApp,
    login: crate::web::Login,
    ids: Vec<i64>,
    engine: ballast::engine::Engine,
    clock: ballast::domain::ManualClock,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipelines_page_draws_steps_with_figures_matching_a_recount() {
    let Some(AtRest {
        app, login, ids, ..
    }) = twelve_at_rest("pipelines_page").await
    else {
        return;
    };

    // The recount: each step's runs by how they ended and how long each
    // took, from the step runs and records themselves.
    let db = &app.t.db;
    let mut ended: BTreeMap<String, [i64; 3]> = BTreeMap::new();
    let mut took: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for id in &ids {
        let rec = db.get_record(*id).await.unwrap().unwrap();
        for run in db.step_runs(*id).await.unwrap() {
            let parked = rec.state == RecordState::Parked && rec.step.as_deref() == Some(&run.step);
            let (slot, end) = match run.state {
                StepState::Succeeded => (0, run.finished_at.unwrap()),
                StepState::Failed => (1, run.finished_at.unwrap()),
                _ if parked => (2, rec.updated_at),
                _ => continue,
            };
            ended.entry(run.step.clone()).or_default()[slot] += 1;
            let started = run.started_at.unwrap_or(end);
            took.entry(run.step.clone())
                .or_default()
                .push(end - started);
        }
    }
    // The provider's answers give these; the page must agree with both.
    assert_eq!(ended["a"], [12, 0, 0]);
    assert_eq!(ended["b"], [8, 4, 0]);
    assert_eq!(ended["c"], [6, 0, 2]);
    let mut at_steps: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
    for c in db.recount_steps().await.unwrap() {
        if c.pipeline == "fan" && c.count != 0 {
            at_steps
                .entry(c.step.clone())
                .or_default()
                .insert(c.state.as_str().to_owned(), c.count);
        }
    }

    let html = app.text("/pipelines", Some(&login)).await;
    assert_eq!(
        html.matches(r##"<a class="node step" href="#step-0-"##)
            .count(),
        3,
        "{html}"
    );
    assert_eq!(
        html.matches(r#"<path class="edge""#).count(),
        2,
        "a → c, b → c"
    );
    assert!(
        html.contains("<title>a before c</title>") && html.contains("<title>b before c</title>")
    );
    assert!(
        !html.contains("Not at a step yet"),
        "every record reached a step"
    );
    for step in ["a", "b", "c"] {
        let r = row(&html, step);
        let [ok, failed, parked] = ended[step];
        assert_eq!(
            cell(r, "num runs"),
            format!("{ok} / {failed} / {parked}"),
            "{step}"
        );
        let rate = format!("{:.1}%", 100.0 * ok as f64 / (ok + failed + parked) as f64);
        assert!(cell(r, "num rate").starts_with(&rate), "{step}: {r}");
        let runs = took[step].clone();
        let want = format!(
            "{} / {}",
            quantile_label(runs.clone(), 0.5),
            quantile_label(runs, 0.95)
        );
        assert_eq!(cell(r, "num took"), want, "{step}");
        assert_eq!(
            here(r),
            at_steps.get(step).cloned().unwrap_or_default(),
            "records at {step} now"
        );
    }
    // The API gives the same figures as numbers.
    let token = app.token(Role::Viewer).await;
    let api: Value = app
        .client
        .get(app.url("/api/v1/pipelines"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let fan = api["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "fan")
        .unwrap();
    assert_eq!(fan["unstarted"], json!({}), "{fan}");
    for step in ["a", "b", "c"] {
        let s = fan["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == step)
            .unwrap();
        let [ok, failed, parked] = ended[step];
        for window in ["last_hour", "last_day"] {
            let f = &s[window];
            let got = json!([f["succeeded"], f["failed"], f["parked"]]);
            assert_eq!(got, json!([ok, failed, parked]), "{step} {window}: {f}");
            let lengths: i64 = f["lengths"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["runs"].as_i64().unwrap())
                .sum();
            assert_eq!(lengths, ok + failed + parked, "{step} {window}: {f}");
            for (q, key) in [(0.5, "p50_ms"), (0.95, "p95_ms")] {
                assert_eq!(
                    f[key],
                    json!(quantile_bound(took[step].clone(), q)),
                    "{step} {window} {key}"
                );
            }
        }
        assert_eq!(
            s["records"],
            json!(at_steps.get(step).cloned().unwrap_or_default()),
            "{step}"
        );
    }
    let versions = fan["versions"].as_array().unwrap();
    assert_eq!(
        versions.iter().filter(|v| v["current"] == true).count(),
        1,
        "{versions:?}"
    );

    // The clock moves 500 ms at a time, so a retried run lasts that at
    // least: a parked run's length counts from its first call.
    assert!(took["c"].iter().max() >= Some(&500), "{:?}", took["c"]);
    assert!(!cell(row(&html, "c"), "num took").ends_with("≤ 100 ms"));
    crate::helpers::assert_counters_match(db).await;

    // The live part alone, for the page's poll.
    let live = app.fragment("/pipelines", &login).await;
    assert!(
        live.trim_start()
            .starts_with(r#"<div id="pipelines" class="live""#),
        "{live}"
    );
    assert!(!live.contains("<html"));

    app.stop().await;
}

/// A record's page draws its steps in their states and its attempts in a
/// lane per step; an operator retries a parked record with its input
/// edited, and the unfinished step runs again on it under a new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_page_tells_its_story_and_a_retry_takes_a_new_input() {
    let Some(AtRest {
        app, login, ids, ..
    }) = twelve_at_rest("record_story").await
    else {
        return;
    };
    // A parked record's page draws its steps in their states.
    let parked = ids[1];
    let page = app.text(&format!("/records/{parked}"), Some(&login)).await;
    for (step, class, word) in [
        ("a", "succeeded", "done"),
        ("b", "succeeded", "done"),
        ("c", "parked", "parked"),
    ] {
        let drawn = format!(r#"<g class="node {class}">"#);
        assert!(page.contains(&drawn), "{step} drawn as {class}: {page}");
        let label = format!(r#">{step}<tspan class="state"> — {word}</tspan>"#);
        assert!(page.contains(&label), "{step} says {word}");
    }
    // Its timeline: a lane per step tried, each attempt a mark coloured
    // by outcome and said in words beside it.
    let lane = |html: &str, step: &str| -> String {
        let at = html
            .find(&format!(r#"<g class="lane" data-step="{step}">"#))
            .unwrap_or_else(|| panic!("no lane for {step}: {html}"));
        let rest = &html[at..];
        rest[..rest.find("</g>").unwrap()].to_owned()
    };
    let c = lane(&page, "c");
    assert_eq!(c.matches(r#"class="mark retry""#).count(), 2, "{c}");
    assert!(c.contains(">2 attempts: 2 retry</text>"), "{c}");
    assert!(lane(&page, "a").contains(">1 attempt: 1 success</text>"));

    let failed = ids[0];
    let page = app.text(&format!("/records/{failed}"), Some(&login)).await;
    assert!(page.contains(r#">b<tspan class="state"> — failed</tspan>"#));
    assert!(
        page.contains(r#">c<tspan class="state"> — skipped</tspan>"#)
            || page.contains(r#">c<tspan class="state"> — not started</tspan>"#),
        "{page}"
    );
    app.stop().await;
}

/// An operator retries a parked record with its input edited: a bad edit,
/// an edit to an input someone else changed meanwhile, and an input with
/// a park are refused and change nothing; a good one replaces the input
/// (the audit entry keeps both) and the unfinished step runs again on it
/// under a new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_takes_an_edited_input() {
    let Some(AtRest {
        app,
        ids,
        engine,
        clock,
        ..
    }) = twelve_at_rest("retry_input").await
    else {
        return;
    };
    let db = &app.t.db;
    let parked = ids[1];
    // An operator retries it with the input edited: a bad edit is refused
    // and changes nothing; a good one replaces the input, the audit entry
    // keeps both, and the record goes on (c now succeeds for it).
    app.user("op", Role::Operator).await;
    let op = app.login("op").await;
    let act = format!("/records/{parked}/actions");
    let bad = app
        .post(
            &act,
            Some(&op),
            &[("action", "retry"), ("input", "{\"n\": ")],
        )
        .await;
    assert!(bad.status().is_client_error(), "{}", bad.status());
    assert!(bad.text().await.unwrap().contains("the input is not JSON"));
    let rec = db.get_record(parked).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.input.clone()),
        (RecordState::Parked, json!({"n": 1}))
    );
    let parking = app
        .post(
            &act,
            Some(&op),
            &[("action", "park"), ("reason", "x"), ("input", "{}")],
        )
        .await;
    assert!(
        parking.status().is_client_error(),
        "only a retry or replay takes an input"
    );
    // A form shown before someone else changed the input is refused.
    let stale = app
        .post(
            &act,
            Some(&op),
            &[
                ("action", "retry"),
                ("input", "{\"n\": 2}"),
                ("input_was", "{\"n\": 7}"),
            ],
        )
        .await;
    assert!(stale.status().is_client_error(), "{}", stale.status());
    assert!(
        stale
            .text()
            .await
            .unwrap()
            .contains("changed since the page showed it")
    );
    let c_before = db.step_runs(parked).await.unwrap();
    let c_before = c_before.iter().find(|r| r.step == "c").unwrap().clone();
    let done = app
        .post(
            &act,
            Some(&op),
            &[
                ("action", "retry"),
                ("reason", "fixed n"),
                ("input", "{\"n\": 2}"),
                ("input_was", "{\"n\": 1}"),
            ],
        )
        .await;
    assert_eq!(done.status(), 303);
    let rec = db.get_record(parked).await.unwrap().unwrap();
    assert_eq!(rec.input, json!({"n": 2}));
    let events = db.record_events(parked).await.unwrap();
    let retry = events.iter().rfind(|e| e.kind == "retry").unwrap();
    assert!(retry.audit);
    assert_eq!(
        retry.detail.as_ref().map(|d| d["input"].clone()),
        Some(json!({"old": {"n": 1}, "new": {"n": 2}}))
    );
    // A new input is a new request: the unfinished step runs again under
    // a new generation (a new idempotency key); the done ones stay.
    let runs = db.step_runs(parked).await.unwrap();
    let c_after = runs.iter().find(|r| r.step == "c").unwrap();
    assert_eq!(c_after.generation, c_before.generation + 1);
    assert_ne!(c_after.idempotency_key, c_before.idempotency_key);
    assert_eq!(runs.iter().find(|r| r.step == "a").unwrap().generation, 0);
    // Due at once. The test's engine finishes it (c now succeeds for it):
    // its clock is ten days ahead, so a lease the app's own workers might
    // take meanwhile has run out for it, and their late commit is refused
    // (the lease token moved on).
    crate::engine::drive_at_rest(&engine, &clock, 12, 500, 60_000).await;
    let succeeded = db.get_record(parked).await.unwrap().unwrap();
    assert_eq!(succeeded.state, RecordState::Succeeded, "{succeeded:?}");
    assert_eq!(succeeded.input, json!({"n": 2}));
    // An unchanged input (the form sends back what it showed) is no edit.
    let other = ids[5];
    let shown = serde_json::to_string_pretty(&json!({"n": 5})).unwrap();
    let again = app
        .post(
            &format!("/records/{other}/actions"),
            Some(&op),
            &[
                ("action", "retry"),
                ("input", &shown),
                ("input_was", &shown),
            ],
        )
        .await;
    assert_eq!(again.status(), 303);
    let events = db.record_events(other).await.unwrap();
    let retry = events.iter().rfind(|e| e.kind == "retry").unwrap();
    assert!(
        retry
            .detail
            .as_ref()
            .is_none_or(|d| d.get("input").is_none()),
        "{retry:?}"
    );

    app.stop().await;
}
