//! The server starts, answers its probes, registers as a node, and stops
//! gracefully when told to.

use std::time::Duration;

use ballast::config::{Config, DatabaseUrl};
use ballast::store::Store;
use tokio_util::sync::CancellationToken;

use crate::helpers::{TestDb, http_get};

#[tokio::test]
async fn serves_probes_and_shuts_down_gracefully() {
    let t = TestDb::sqlite().await;
    let mut config = Config::default();
    config.database.url = DatabaseUrl::new(t.url.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(config, listener, shutdown.clone()));

    let (status, body) = http_get(addr, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (status, body) = http_get(addr, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = http_get(addr, "/no-such-page").await;
    assert_eq!(status, 404);

    // The server migrated the database and registered itself.
    let mut nodes = Vec::new();
    for _ in 0..50 {
        nodes = t.db.list_nodes().await.unwrap();
        if !nodes.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].pid, i64::from(std::process::id()));

    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
    assert!(
        t.db.list_nodes().await.unwrap().is_empty(),
        "the node deregistered"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the port is closed"
    );
}

#[tokio::test]
async fn readiness_reports_a_lost_database() {
    let Some(t) = TestDb::postgres("readiness_reports_a_lost_database").await else {
        return;
    };
    let mut config = Config::default();
    config.database.url = DatabaseUrl::new(t.url.clone());
    config.database.acquire_timeout = ballast::config::HumanDuration(Duration::from_millis(500));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(config, listener, shutdown.clone()));
    assert_eq!(http_get(addr, "/readyz").await.0, 200);

    // The database disappears under the running server.
    let name = t.url.rsplit('/').next().unwrap().to_owned();
    let admin = sqlx::PgPool::connect(&crate::helpers::pg_admin_url())
        .await
        .unwrap();
    let sql = format!("DROP DATABASE {name} WITH (FORCE)");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;

    let (status, body) = http_get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("database_"), "{body}");
    assert_eq!(
        http_get(addr, "/healthz").await.0,
        200,
        "the process itself is healthy"
    );
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
    assert!(stopped.is_ok(), "shutdown completes without the database");
}

/// `serve` with pipelines configured runs the workers: a record enqueued
/// while it runs is processed against a provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_the_workers() {
    use ballast::store::Store;
    let t = TestDb::sqlite().await;
    let sim = ballast::sim::SimHandle::spawn(ballast::sim::Profile::clean(1))
        .await
        .unwrap();
    let text = format!(
        r#"
[database]
url = "{}"
[providers.sim]
base_url = "{}"
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[pipelines.pay.steps]]
name = "charge"
provider = "sim"
request = {{ path = "/v1/charge", body = '{{"ref": "{{{{ record.id }}}}", "amount": 3}}' }}
outputs = {{ id = "/id", amount = "/amount" }}
"#,
        t.url,
        sim.base_url()
    );
    let config = Config::parse(&text, std::path::Path::new("serve.toml")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(
        config.clone(),
        listener,
        shutdown.clone(),
    ));
    // Wait for the server to have migrated, then enqueue from "another process".
    let mut enqueued = None;
    for _ in 0..100 {
        if let Ok(e) = ballast::engine::Engine::new(
            t.db.clone(),
            std::sync::Arc::new(config.clone()),
            ballast::engine::EngineOptions::new("test"),
        )
        .await
        {
            enqueued = Some(
                e.enqueue("pay", Some("p-1"), serde_json::json!({}))
                    .await
                    .unwrap()
                    .record
                    .id,
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let id = enqueued.expect("the server never migrated the database");
    let mut state = None;
    for _ in 0..100 {
        state = t.db.get_record(id).await.unwrap().map(|r| r.state);
        if state == Some(ballast::domain::RecordState::Succeeded) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state, Some(ballast::domain::RecordState::Succeeded));
    let steps = t.db.step_runs(id).await.unwrap();
    assert_eq!(
        steps[0].output.as_ref().and_then(|o| o.get("amount")),
        Some(&serde_json::json!(3))
    );
    assert_eq!(sim.ledger().effects, 1);
    shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(15), server).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}
