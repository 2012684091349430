//! A step's own call timeout and retries, over its provider's: a slow
//! call and a fast check on one provider need not share them. Both
//! backends, on a clock the test moves.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ballast::config::Config;
use ballast::domain::RecordState;
use ballast::engine::Enqueue;
use ballast::store::Backend;
use serde_json::json;

use crate::engine::{drive_at_rest, manual_engine};
use crate::helpers::TestDb;

/// A provider that fails every `/v1/fail` with a 500 (counted) and never
/// answers `/v1/hang`.
async fn failing_provider() -> (String, Arc<AtomicUsize>) {
    let failed = Arc::new(AtomicUsize::new(0));
    let f = failed.clone();
    let app = axum::Router::new()
        .route(
            "/v1/fail",
            axum::routing::post(move || {
                let f = f.clone();
                async move {
                    f.fetch_add(1, Ordering::SeqCst);
                    (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "down")
                }
            }),
        )
        .route(
            "/v1/hang",
            axum::routing::post(std::future::pending::<&'static str>),
        );
    (crate::helpers::serve_router(app).await, failed)
}

/// One provider with a long timeout and five attempts; pipeline `own`
/// gives its step two attempts, `shared` keeps the provider's, `quick`
/// gives its call 50 ms and one attempt.
fn config(base_url: &str) -> Arc<Config> {
    let text = format!(
        r#"
[providers.p]
base_url = "{base_url}"
timeout = "10m"
retry = {{ max_attempts = 5, base = "1s", cap = "1s", deadline = "1h" }}

[[pipelines.own.steps]]
name = "charge"
provider = "p"
retry = {{ max_attempts = 2 }}
request = {{ method = "POST", path = "/v1/fail" }}

[[pipelines.shared.steps]]
name = "charge"
provider = "p"
request = {{ method = "POST", path = "/v1/fail" }}

[[pipelines.quick.steps]]
name = "status"
provider = "p"
timeout = "50ms"
retry = {{ max_attempts = 1 }}
request = {{ method = "POST", path = "/v1/hang" }}
"#
    );
    let config = Config::parse(&text, Path::new("per-step.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    ballast::pipeline::compile(&config).unwrap();
    Arc::new(config)
}

async fn a_steps_own_timeout_and_retries_hold(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "per_step").await else {
        return;
    };
    let (url, failed) = failing_provider().await;
    let config = config(&url);
    assert_eq!(
        config.providers["p"].longest_step_timeout, None,
        "a step timeout shorter than the provider's leaves its lapse alone"
    );
    let (engine, clock) = manual_engine(&t.db, config, "n1").await;
    let mut ids = Vec::new();
    for pipeline in ["own", "shared", "quick"] {
        let e = Enqueue::new(pipeline, Some("r1"), json!({}));
        ids.push(engine.enqueue(e).await.unwrap().record.id);
    }
    // If the quick step's 50 ms were ignored, its call would hang for the
    // provider's ten minutes and the drain's bound would fail the test.
    drive_at_rest(&engine, &clock, 3, 1_000, 60_000).await;

    let attempts = |id| {
        let db = t.db.clone();
        async move { db.attempts(id).await.unwrap() }
    };
    let own = attempts(ids[0]).await;
    let shared = attempts(ids[1]).await;
    assert_eq!(own.len(), 2, "the step's two attempts: {own:?}");
    assert_eq!(shared.len(), 5, "the provider's five attempts: {shared:?}");
    assert_eq!(failed.load(Ordering::SeqCst), 7, "each attempt one request");
    let quick = attempts(ids[2]).await;
    assert_eq!(quick.len(), 1, "{quick:?}");
    let excerpt = quick[0].excerpt.as_deref().unwrap_or_default();
    assert!(excerpt.contains("within 50ms"), "{excerpt}");
    for id in ids {
        let r = t.db.get_record(id).await.unwrap().unwrap();
        assert_eq!(r.state, RecordState::Parked, "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_steps_own_timeout_and_retries_hold() {
    a_steps_own_timeout_and_retries_hold(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_steps_own_timeout_and_retries_hold() {
    a_steps_own_timeout_and_retries_hold(Backend::Postgres).await;
}

/// A step timeout longer than its provider's is how long that
/// provider's calls may be under way: its grants lapse no sooner.
#[test]
fn a_longer_step_timeout_is_the_providers_longest_call() {
    let text = r#"
[providers.p]
base_url = "http://127.0.0.1:9"
timeout = "10s"
[[pipelines.gen.steps]]
name = "generate"
provider = "p"
timeout = "2m"
request = { method = "POST", path = "/v1/gen" }
[[pipelines.gen.steps]]
name = "check"
provider = "p"
timeout = "1m"
request = { method = "GET", path = "/v1/status" }
"#;
    let config = Config::parse(text, Path::new("gen.toml")).unwrap();
    let p = &config.providers["p"];
    assert_eq!(
        p.longest_step_timeout.map(|t| t.0),
        Some(std::time::Duration::from_secs(120))
    );
    assert_eq!(ballast::engine::limits::lapse_ms(p), 2 * 120_000 + 5_000);
}

#[test]
fn check_config_refuses_step_retries_that_do_not_hold() {
    let cases = [
        (
            r#"retry = { cap = "1ms" }"#,
            "steps[charge].retry.cap",
            "at least `retry.base`",
        ),
        (
            r#"retry = { max_attempts = 0 }"#,
            "steps[charge].retry.max_attempts",
            "at least 1",
        ),
        (r#"timeout = "0s""#, "steps[charge].timeout", "more than 0"),
        (r#"retry = { budget = 0.5 }"#, "", "unknown field `budget`"),
    ];
    let whole = |extra: &str, kind: &str| {
        let text = format!(
            r#"
[providers.p]
base_url = "http://127.0.0.1:9"
retry = {{ base = "500ms" }}
[[pipelines.pay.steps]]
name = "charge"
{kind}
{extra}
"#
        );
        Config::parse(&text, Path::new("pay.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let calls = "provider = \"p\"\nrequest = { method = \"POST\", path = \"/v1/pay\" }";
    assert_eq!(whole("", calls), "", "the step without overrides is valid");
    for (extra, key, expected) in cases {
        let err = whole(extra, calls);
        assert!(err.contains(expected), "{extra}: {err}");
        assert!(err.contains(key), "{extra}: {err}");
    }
    let err = whole(r#"retry = { max_attempts = 2 }"#, "kind = \"approval\"");
    assert!(err.contains("takes no `retry`"), "{err}");
}
