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

use crate::helpers::free_port;

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
    let batch: Vec<ballast::store::NewRecord> = (0..N)
        .map(|n| ballast::store::NewRecord {
            pipeline: "leak".into(),
            pipeline_version: None,
            external_key: Some(format!("k-{n}")),
            input: json!({ "n": n }),
            run_at: ballast::engine::now_ms(),
        })
        .collect();
    db.create_records(batch, ballast::engine::now_ms())
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
    let ids: Vec<i64> = db
        .list_records(&ballast::store::RecordFilter {
            limit: 500,
            ..Default::default()
        })
        .await
        .unwrap()
        .items
        .iter()
        .map(|r| r.id)
        .collect();
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
