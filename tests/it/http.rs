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
