//! The fault battery's CI part (docs/reliability.md): a real `ballast
//! serve` fed hostile input, each case printing its figures.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use ballast::domain::Role;
use ballast::store::{ConnectOptions, Db, Store};
use serde_json::{Value, json};

use crate::helpers::{free_port, lease_holders, records_in};

/// A `ballast serve` child in `dir` (its `ballast.toml`, its `ballast.db`),
/// logging to `dir/serve.log`; killed when dropped.
struct Serve {
    child: Child,
    base: String,
}

impl Serve {
    async fn start(dir: &Path, env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let log = std::fs::File::create(dir.join("serve.log")).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ballast"));
        cmd.current_dir(dir)
            .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        for (k, _) in std::env::vars() {
            if k.starts_with("BALLAST_") {
                cmd.env_remove(k);
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        loop {
            if let Ok(r) = reqwest::get(format!("{base}/readyz")).await {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(
                child.try_wait().unwrap().is_none(),
                "serve exited early: {}",
                std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default()
            );
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "serve did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Serve { child, base }
    }

    /// SIGTERM, then waits for the exit.
    async fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let started = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "serve ignored SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` records of `pipeline` due now, keyed `k-0`…, with `input(i)`.
fn due_now(pipeline: &str, n: i64, input: impl Fn(i64) -> Value) -> Vec<ballast::store::NewRecord> {
    (0..n)
        .map(|i| ballast::store::NewRecord {
            pipeline: pipeline.into(),
            pipeline_version: None,
            external_key: Some(format!("k-{i}")),
            input: input(i),
            run_at: ballast::engine::now_ms(),
        })
        .collect()
}

/// Counts `needle` in `haystack` (bytes).
fn occurrences(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

/// A provider that echoes the credential it is sent, as careless real ones
/// do: in a success body (into a step output), in a 401 error, in a plain
/// text 500.
async fn leaky_provider(seen_key: Arc<AtomicUsize>) -> String {
    let app = axum::Router::new().route(
        "/v1/echo",
        axum::routing::post(move |headers: HeaderMap, body: String| {
            let seen_key = seen_key.clone();
            async move {
                let auth = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                if auth.starts_with("Bearer sk_live_") {
                    seen_key.fetch_add(1, Ordering::Relaxed);
                }
                let key = auth.trim_start_matches("Bearer ").to_owned();
                let n = serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v["n"].as_i64())
                    .unwrap_or(0);
                match n % 3 {
                    0 => axum::Json(json!({
                        "status": "succeeded",
                        "id": format!("job-{n}"),
                        "echo": auth,
                        "detail": { "note": format!("called with key={key}") },
                    }))
                    .into_response(),
                    1 => (
                        StatusCode::UNAUTHORIZED,
                        axum::Json(json!({ "error": format!("invalid api key: {key}") })),
                    )
                        .into_response(),
                    _ => (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("upstream failure for {auth}"),
                    )
                        .into_response(),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A provider key planted in every reply is found nowhere Ballast writes:
/// not in the database file, the logs (at debug), any dashboard page or
/// fragment, or the JSON API, while the evidence around it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_provider_key_is_found_nowhere() {
    let key = format!("sk_live_{}", uuid::Uuid::new_v4().simple());
    let seen = Arc::new(AtomicUsize::new(0));
    let provider = leaky_provider(seen.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        r#"
[providers.leaky]
base_url = "{provider}"
auth = {{ header = "Authorization", value_env = "LEAKY_API_KEY", scheme = "Bearer" }}
timeout = "2s"
retry = {{ max_attempts = 2, base = "10ms", cap = "20ms", deadline = "10s", budget_floor = 100.0 }}
[[providers.leaky.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[providers.leaky.rules]]
when = {{ status = 401 }}
outcome = "fail"

[[pipelines.leak.steps]]
name = "call"
provider = "leaky"
request = {{ method = "POST", path = "/v1/echo", body = '{{{{ input | tojson }}}}' }}
outputs = {{ echo = "/echo", detail = "/detail" }}
"#
    );
    std::fs::write(dir.path().join("ballast.toml"), config).unwrap();
    let password = "planted-key-admin-pw";
    let env = [
        ("LEAKY_API_KEY", key.as_str()),
        ("BALLAST_ADMIN_PASSWORD", password),
        ("BALLAST_LOG", "debug"),
    ];
    let serve = Serve::start(dir.path(), &env).await;
    let db_url = format!("sqlite://{}", dir.path().join("ballast.db").display());
    let db = Db::connect(&db_url, &ConnectOptions::default())
        .await
        .unwrap();
    const N: i64 = 30;
    db.create_records(
        due_now("leak", N, |n| json!({ "n": n })),
        ballast::engine::now_ms(),
    )
    .await
    .unwrap();
    crate::engine::wait_at_rest(&db, N, Duration::from_secs(60)).await;

    // Every page, fragment and API answer an admin can reach.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = client
        .post(format!("{}/login", serve.base))
        .header("origin", &serve.base)
        .form(&[("username", "admin"), ("password", password), ("next", "/")])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303);
    let cookie = crate::web::session_cookie(login.headers()).unwrap();
    let (token, hash, prefix) = ballast::web::auth::new_api_token();
    db.create_api_token(
        &ballast::store::NewApiToken {
            name: "sweep".into(),
            token_hash: hash,
            prefix,
            role: Role::Admin,
            created_by: "test".into(),
        },
        ballast::engine::now_ms(),
    )
    .await
    .unwrap();
    let ids: Vec<i64> = records_in(&db, None).await.iter().map(|r| r.id).collect();
    let mut html_paths: Vec<String> = [
        "/",
        "/records",
        "/records?state=failed",
        "/records?state=succeeded",
        "/records?state=parked",
        "/providers",
        "/audit",
        "/admin/users",
        "/admin/tokens",
    ]
    .iter()
    .map(|p| (*p).to_owned())
    .collect();
    html_paths.extend(ids.iter().map(|id| format!("/records/{id}")));
    let mut api_paths = vec!["/api/v1/records?limit=500".to_owned()];
    api_paths.extend(ids.iter().map(|id| format!("/api/v1/records/{id}")));
    let (mut html_hits, mut html_bytes, mut fragments) = (0, 0, 0);
    for path in &html_paths {
        for htmx in [false, true] {
            let mut req = client
                .get(format!("{}{path}", serve.base))
                .header("cookie", &cookie);
            if htmx {
                // The same routes answer htmx with fragments.
                req = req.header("hx-request", "true");
                fragments += 1;
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}");
            let body = r.bytes().await.unwrap();
            html_bytes += body.len();
            html_hits += occurrences(&body, key.as_bytes());
        }
    }
    let (mut json_hits, mut json_bytes) = (0, 0);
    for path in &api_paths {
        let r = client
            .get(format!("{}{path}", serve.base))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let body = r.bytes().await.unwrap();
        json_bytes += body.len();
        json_hits += occurrences(&body, key.as_bytes());
    }
    // The evidence is kept, with the key cut out of it.
    let redacted = {
        let mut n = 0;
        for id in &ids {
            n += db
                .attempts(*id)
                .await
                .unwrap()
                .iter()
                .filter(|a| {
                    a.excerpt
                        .as_deref()
                        .is_some_and(|e| e.contains("[redacted]"))
                })
                .count();
        }
        n
    };
    db.close().await;
    serve.stop().await;

    let log = std::fs::read(dir.path().join("serve.log")).unwrap();
    let mut db_bytes = 0;
    let mut db_hits = 0;
    for file in ["ballast.db", "ballast.db-wal", "ballast.db-shm"] {
        if let Ok(bytes) = std::fs::read(dir.path().join(file)) {
            db_bytes += bytes.len();
            db_hits += occurrences(&bytes, key.as_bytes());
        }
    }
    let log_hits = occurrences(&log, key.as_bytes());
    println!(
        "planted key: {} calls carried it, {redacted} attempts kept evidence with it cut out; found \
         {db_hits}× in {db_bytes} database bytes, {log_hits}× in {} log bytes (debug), \
         {html_hits}× in {} pages + {fragments} fragments ({html_bytes} bytes), \
         {json_hits}× in {} API answers ({json_bytes} bytes)",
        seen.load(Ordering::Relaxed),
        log.len(),
        html_paths.len(),
        api_paths.len(),
    );
    assert!(
        seen.load(Ordering::Relaxed) >= N as usize,
        "the key was sent"
    );
    assert!(redacted > 0, "echoed keys were cut out of kept evidence");
    assert_eq!(
        (db_hits, log_hits, html_hits, json_hits),
        (0, 0, 0, 0),
        "the key leaked"
    );
}

/// A provider answering garbage: NUL characters in JSON strings and in raw
/// bytes, invalid UTF-8, an empty body, a body over the size limit, a
/// truncated JSON document, deeply nested JSON, a reset connection.
async fn garbage_provider() -> String {
    let app = axum::Router::new().route(
        "/v1/garbage",
        axum::routing::post(|body: String| async move {
            let n = serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| v["n"].as_i64())
                .unwrap_or(0);
            let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
            match n % 8 {
                0 => (
                    json,
                    r#"{"status": "succeeded", "id": "a\u0000b", "note": "nul \u0000 inside", "output": {}}"#
                        .to_owned(),
                )
                    .into_response(),
                1 => (StatusCode::BAD_GATEWAY, b"raw\x00nul\x00bytes".to_vec()).into_response(),
                2 => (
                    json,
                    b"{\"status\": \"succeeded\", \"id\": \"\xff\xfe\"}".to_vec(),
                )
                    .into_response(),
                3 => (StatusCode::OK, Vec::<u8>::new()).into_response(),
                4 => (json, "x".repeat(3 * 1024 * 1024)).into_response(),
                5 => (json, r#"{"status": "succ"#.to_owned()).into_response(),
                6 => (json, format!("{}1{}", "[".repeat(5_000), "]".repeat(5_000))).into_response(),
                _ => (
                    json,
                    r#"{"status": "succeeded", "id": "ok", "output": {"k\u0000ey": "v"}}"#
                        .to_owned(),
                )
                    .into_response(),
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// Every garbage reply becomes a defined state with its evidence kept, on
/// both backends (PostgreSQL refuses NUL characters in text and JSON, so
/// what a provider sends must not reach it as is), and nothing is stuck.
async fn garbage_replies_become_states(backend: ballast::store::Backend) {
    let Some(t) = crate::helpers::TestDb::migrated(backend, "garbage").await else {
        return;
    };
    let base = garbage_provider().await;
    let text = format!(
        r#"
[providers.junk]
base_url = "{base}"
timeout = "2s"
retry = {{ max_attempts = 2, base = "10ms", cap = "20ms", deadline = "30s", budget_floor = 100.0, unknown_attempts = 2 }}
# Garbage is the point here: keep the breaker out of the way.
breaker = {{ window = 1000, min_calls = 1000 }}
[[providers.junk.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.junk.steps]]
name = "call"
provider = "junk"
request = {{ method = "POST", path = "/v1/garbage", body = '{{{{ input | tojson }}}}' }}
outputs = {{ id = "/id", output = "/output" }}
"#
    );
    let config = ballast::config::Config::parse(&text, Path::new("garbage.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let mut opts = ballast::engine::EngineOptions::new("garbage");
    opts.lease = Duration::from_secs(2);
    opts.idle_max = Duration::from_millis(50);
    let engine = ballast::engine::Engine::new(t.db.clone(), Arc::new(config), opts)
        .await
        .unwrap();
    const N: i64 = 32;
    for n in 0..N {
        engine
            .enqueue("junk", Some(&format!("g-{n}")), json!({ "n": n }))
            .await
            .unwrap();
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn({
        let (engine, stop) = (engine.clone(), stop.clone());
        async move { engine.run(stop, Duration::from_secs(1)).await }
    });
    crate::engine::wait_at_rest(&t.db, N, Duration::from_secs(60)).await;
    stop.cancel();
    run.await.unwrap();
    let mut by_outcome = std::collections::BTreeMap::<String, usize>::new();
    let records = records_in(&t.db, None).await;
    for r in &records {
        let attempts = t.db.attempts(r.id).await.unwrap();
        assert!(!attempts.is_empty(), "record {} has its attempts", r.id);
        assert!(
            attempts.iter().all(|a| a.excerpt.is_some()),
            "evidence kept for record {}",
            r.id
        );
        *by_outcome
            .entry(format!(
                "{} {}",
                r.state.as_str(),
                r.error_code.as_deref().unwrap_or("-")
            ))
            .or_default() += 1;
    }
    println!(
        "{} garbage: {N} records at rest: {by_outcome:?}",
        backend.as_str()
    );
    // The two replies with NUL characters in their JSON succeeded, their
    // output kept with U+FFFD in place of NUL; everything else failed or
    // parked with the reason classified.
    assert_eq!(by_outcome.get("succeeded -"), Some(&8), "{by_outcome:?}");
    for r in &records {
        let n: i64 = r.external_key.as_deref().unwrap()[2..].parse().unwrap();
        let expected = match n % 8 {
            0 | 7 => None,
            1 => Some("provider_5xx"),
            4 => Some("body_too_large"),
            _ => Some("body_not_json"),
        };
        let attempts = t.db.attempts(r.id).await.unwrap();
        let codes: Vec<Option<&str>> = attempts.iter().map(|a| a.error_code.as_deref()).collect();
        assert!(
            codes.iter().all(|c| *c == expected),
            "record {n}: {codes:?}, expected {expected:?}"
        );
        if n % 8 == 0 {
            let steps = t.db.step_runs(r.id).await.unwrap();
            assert_eq!(
                steps[0].output,
                Some(json!({ "id": "a\u{FFFD}b", "output": {} }))
            );
        }
        if n % 8 == 7 {
            let steps = t.db.step_runs(r.id).await.unwrap();
            assert_eq!(
                steps[0].output,
                Some(json!({ "id": "ok", "output": { "k\u{FFFD}ey": "v" } }))
            );
        }
        if n % 8 == 1 {
            assert!(
                attempts[0]
                    .excerpt
                    .as_deref()
                    .unwrap()
                    .contains("raw\u{FFFD}nul")
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_garbage_replies_become_states() {
    garbage_replies_become_states(ballast::store::Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_garbage_replies_become_states() {
    garbage_replies_become_states(ballast::store::Backend::Postgres).await;
}

/// NUL characters in a request (which PostgreSQL cannot store) get a 4xx
/// with a stable code, never a 500, and store nothing.
async fn nul_characters_in_requests_are_refused(backend: ballast::store::Backend) {
    let Some(app) = crate::web::WebApp::spawn(
        backend,
        "nulapi",
        "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\n[[pipelines.orders.steps]]\nname = \"a\"\nprovider = \"p\"\nrequest = { path = \"/x\" }\n",
    )
    .await
    else {
        return;
    };
    let token = app.token(Role::Operator).await;
    let post = |path: &str, body: &'static str| {
        app.client
            .post(app.url(path))
            .bearer_auth(&token)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for body in [
        r#"{"pipeline": "orders", "key": "k1", "input": {"a": "x\u0000y"}}"#,
        r#"{"pipeline": "orders", "key": "k\u0000", "input": {}}"#,
        r#"{"pipeline": "orders", "key": "k2", "input": {"\u0000": 1}}"#,
    ] {
        let r = post("/api/v1/records", body).await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"], "invalid_request", "{v}");
    }
    let counts = app.t.db.state_counts().await.unwrap();
    assert!(
        counts.iter().all(|c| c.count == 0),
        "nothing stored: {counts:?}"
    );
    // An operator's reason with a NUL: stored as is on SQLite, refused as
    // a bad request (not an internal error) on PostgreSQL.
    let id = app.record("k3").await;
    let r = post(
        &format!("/api/v1/records/{id}/actions"),
        r#"{"action": "cancel", "reason": "nul \u0000 here"}"#,
    )
    .await
    .unwrap();
    let expected = match backend {
        ballast::store::Backend::Sqlite => 200,
        ballast::store::Backend::Postgres => 400,
    };
    assert_eq!(r.status(), expected);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_nul_characters_in_requests_are_refused() {
    nul_characters_in_requests_are_refused(ballast::store::Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_nul_characters_in_requests_are_refused() {
    nul_characters_in_requests_are_refused(ballast::store::Backend::Postgres).await;
}

/// Sends `signal` (`STOP`, `CONT`, `TERM`) to a child.
fn signal(child: &Child, signal: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill -{signal}");
}

/// Item 3, stale worker: a `ballast serve` frozen (SIGSTOP) past its lease
/// while its calls are in flight; a second node takes its records over and
/// finishes them; the first, resumed, has every late write refused. Each
/// record is completed once, and the simulator sees no double charge. A
/// freeze inside a claim's transaction holds row locks that claims skip:
/// the server ends such a session (`idle_in_transaction_session_timeout`),
/// or those records would wait for the frozen node forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_cannot_commit_stale_work() {
    let Some(t) = crate::helpers::TestDb::new(ballast::store::Backend::Postgres, "stale").await
    else {
        return;
    };
    let mut profile = ballast::sim::Profile::clean(3);
    profile.latency_scale = 1.0;
    profile.latency_median = Duration::from_millis(400);
    profile.latency_sigma = 0.0;
    let sim = ballast::sim::SimHandle::spawn(profile).await.unwrap();
    let config = format!(
        r#"
[database]
url = "{}"
[engine]
lease = "2s"
[providers.sim]
base_url = "{}"
timeout = "5s"
[[providers.sim.rules]]
when = {{ status = "2xx" }}
outcome = "success"
[[pipelines.pay.steps]]
name = "charge"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "{{{{ record.id }}}}", "amount": 1}}' }}
"#,
        t.url,
        sim.base_url()
    );
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    for d in &dirs {
        std::fs::write(d.path().join("ballast.toml"), &config).unwrap();
    }
    let env = [("BALLAST_ADMIN_PASSWORD", "stale-worker-admin-pw")];
    let a = Serve::start(dirs[0].path(), &env).await;
    let db = Db::connect(&t.url, &ConnectOptions::default())
        .await
        .unwrap();
    const N: i64 = 120;
    db.create_records(due_now("pay", N, |_| json!({})), ballast::engine::now_ms())
        .await
        .unwrap();
    // Freeze A while it holds records with calls in flight.
    let started = Instant::now();
    let holder = loop {
        if let Some(h) = lease_holders(&db).await.into_iter().next() {
            break h;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "A took no work"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    signal(&a.child, "STOP");
    let frozen_with = records_in(&db, Some(ballast::domain::RecordState::Running))
        .await
        .len();
    let frozen_at = Instant::now();
    let b = Serve::start(dirs[1].path(), &env).await;
    crate::engine::wait_at_rest(&db, N, Duration::from_secs(60)).await;
    let b_done = frozen_at.elapsed();
    // Resume A: whatever it finishes now was taken over long ago.
    signal(&a.child, "CONT");
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.stop().await;
    b.stop().await;

    let mut completed = std::collections::BTreeMap::<i64, usize>::new();
    let mut taken_over = 0;
    for r in records_in(&db, None).await {
        assert_eq!(r.state, ballast::domain::RecordState::Succeeded, "{}", r.id);
        for e in db.record_events(r.id).await.unwrap() {
            if e.kind == "completed" {
                *completed.entry(r.id).or_default() += 1;
            }
            taken_over += usize::from(e.kind == "lease_expired");
        }
    }
    let a_log = std::fs::read_to_string(dirs[0].path().join("serve.log")).unwrap();
    let refused = a_log.matches("lease lost before commit").count();
    let ledger = sim.ledger();
    println!(
        "stale worker: A ({holder}) frozen holding {frozen_with} records; B finished all {N} \
         {b_done:?} after the freeze, taking over {taken_over}; A resumed: {refused} stale \
         writes refused; completions per record max {}; {} double charges",
        completed.values().max().copied().unwrap_or(0),
        ledger.double_charges
    );
    db.close().await;
    assert_eq!(completed.len() as i64, N, "every record completed");
    assert!(completed.values().all(|n| *n == 1), "0 double commits");
    assert!(taken_over > 0, "B took A's records over");
    assert!(refused > 0, "A's stale writes were refused");
    assert_eq!(ledger.double_charges, 0);
}

/// Item 6, brute force from many addresses: without a trusted proxy a
/// spoofed `X-Forwarded-For` per attempt buys nothing (the peer address is
/// limited); behind a trusted proxy, attempts really from many addresses
/// still lock the account after its failure budget, so the right password
/// is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brute_force_from_many_addresses_is_limited() {
    const TRIES: usize = 200;
    let attempt = |app: &crate::web::WebApp, ip: String, password: &str| {
        app.client
            .post(app.url("/login"))
            .header("origin", app.origin())
            .header("x-forwarded-for", ip)
            .form(&[("username", "alice"), ("password", password)])
            .send()
    };
    let mut figures = Vec::new();
    for (trusted, extra) in [
        (
            false,
            "[server.limits]\nlogins_per_minute = 10\naccount_failures = 1000\n",
        ),
        (
            true,
            "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[server.limits]\nlogins_per_minute = 10\naccount_failures = 5\n",
        ),
    ] {
        let Some(app) =
            crate::web::WebApp::spawn(ballast::store::Backend::Sqlite, "bruteforce", extra).await
        else {
            return;
        };
        app.user("alice", Role::Viewer).await;
        let (mut checked, mut limited) = (0, 0);
        let started = Instant::now();
        for i in 0..TRIES {
            let ip = format!("198.51.{}.{}", i / 250, i % 250 + 1);
            let r = attempt(&app, ip, "guess-123456").await.unwrap();
            match r.status().as_u16() {
                401 => checked += 1,
                429 => limited += 1,
                s => panic!("unexpected status {s}"),
            }
        }
        let right = attempt(
            &app,
            "203.0.113.77".into(),
            &crate::web::password_of("alice"),
        )
        .await
        .unwrap()
        .status()
        .as_u16();
        figures.push(format!(
            "{}: {TRIES} guesses from {TRIES} addresses, {checked} checked, {limited} refused; \
             then the right password: {right}",
            if trusted {
                "behind a trusted proxy"
            } else {
                "spoofed X-Forwarded-For"
            }
        ));
        if trusted {
            assert_eq!(checked, 5, "the account's failure budget");
            assert_eq!(right, 429, "locked out, right password or not");
        } else {
            // 10 a minute: one more per 6 s the loop took (a loaded machine).
            let refilled = (started.elapsed().as_secs() / 6) as usize;
            assert!(
                (10..=10 + refilled).contains(&checked),
                "the peer address's budget: {checked} checked, {refilled} refilled"
            );
        }
        assert_eq!(checked + limited, TRIES);
        app.stop().await;
    }
    println!("brute force: {}", figures.join("; "));
}

/// A signed webhook whose JSON carries NUL characters is kept (NUL as
/// U+FFFD), on both backends: refusing it with a 5xx would have the
/// provider redeliver it forever.
async fn webhooks_with_nul_characters_are_kept(backend: ballast::store::Backend) {
    let Some(t) = crate::helpers::TestDb::migrated(backend, "nulhook").await else {
        return;
    };
    // The secret comes from a variable every environment has (tests may
    // not set variables: `unsafe` is forbidden).
    let secret = std::env::var("HOME").expect("HOME is set");
    let text = format!(
        r#"
[database]
url = "{}"
[providers.sim]
base_url = "http://127.0.0.1:9"
webhook_secrets_env = ["HOME"]
[[pipelines.render.steps]]
name = "render"
provider = "sim"
kind = "callback"
request = {{ method = "POST", path = "/v1/jobs" }}
job_id = "/id"
callback = {{ job_id = "/job_id", deadline = "2s" }}
"#,
        t.url
    );
    let config = ballast::config::Config::parse(&text, Path::new("nulhook.toml")).unwrap();
    config.validate(&|v| std::env::var(v).ok()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(config, listener, shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let body =
        br#"{"job_id": "job\u0000x", "status": "succeeded", "note": {"a\u0000": "b\u0000"}}"#;
    let now_s = ballast::engine::now_ms() / 1000;
    let signature = ballast::auth::webhook::sign(secret.as_bytes(), now_s, body);
    let (status, reply) =
        crate::helpers::http_post(addr, "/hooks/sim", &[("x-signature", &signature)], body).await;
    shutdown.cancel();
    let _ = server.await;
    println!("{} webhook with NUL: {status} {reply}", backend.as_str());
    assert_eq!(status, 202, "{reply}");
    assert!(reply.contains("job\u{FFFD}x"), "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_webhooks_with_nul_characters_are_kept() {
    webhooks_with_nul_characters_are_kept(ballast::store::Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_webhooks_with_nul_characters_are_kept() {
    webhooks_with_nul_characters_are_kept(ballast::store::Backend::Postgres).await;
}
