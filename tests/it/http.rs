//! The server starts, answers its probes, registers as a node, and stops
//! gracefully when told to.

use std::time::Duration;

use ballast::config::{Config, DatabaseUrl};
use ballast::engine::Enqueue;
use tokio_util::sync::CancellationToken;

use crate::helpers::{TestDb, http_get, http_post};
use crate::wait;

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

    // The server migrated the database and registered itself. Its
    // heartbeat task writes the node's row beside the serving, so the row
    // may land just after the first answer.
    let nodes = wait::until(
        "the server registers its node",
        Duration::from_secs(10),
        async || {
            let nodes = t.db.list_nodes().await.unwrap();
            if nodes.is_empty() {
                Err(nodes)
            } else {
                Ok(nodes)
            }
        },
    )
    .await;
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
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(
        config.clone(),
        listener,
        shutdown.clone(),
    ));
    // The server answers only once it has migrated the database (the
    // request waits in the listener's backlog until then); then enqueue
    // from "another process".
    assert_eq!(http_get(addr, "/readyz").await.0, 200);
    let id = ballast::engine::Engine::new(
        t.db.clone(),
        std::sync::Arc::new(config.clone()),
        ballast::engine::EngineOptions::new("test"),
    )
    .await
    .unwrap()
    .enqueue(Enqueue::new("pay", Some("p-1"), serde_json::json!({})))
    .await
    .unwrap()
    .record
    .id;
    wait::until(
        "the server's workers finish the record",
        Duration::from_secs(30),
        async || match t.db.get_record(id).await.unwrap().map(|r| r.state) {
            Some(ballast::domain::RecordState::Succeeded) => Ok(()),
            other => Err(other),
        },
    )
    .await;
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

/// `callback` steps end by signed webhooks: duplicates and stale progress
/// reports are harmless, lost callbacks fall back to polling, and a provider
/// that withdraws a result it gave parks the record with a `reversed` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_complete_steps_and_reversals_park_records() {
    use ballast::store::RecordFilter;
    let secret = crate::helpers::HOOK_SECRET;
    let mut profile = ballast::sim::Profile::clean(11);
    profile.job_time = (Duration::from_millis(50), Duration::from_millis(300));
    profile.p_job_flip = 0.5;
    profile.p_callback_duplicate = 0.3;
    profile.p_callback_late_progress = 0.3;
    profile.p_callback_lost = 0.2;
    profile.callback_secret = Some(secret.to_owned());
    let sim = ballast::sim::SimHandle::spawn(profile).await.unwrap();
    let t = TestDb::sqlite().await;
    let text = format!(
        r#"
[database]
url = "{}"
[providers.sim]
base_url = "{}"
webhook_secrets_env = ["TEST_HOOK_SECRET"]
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", in = ["queued", "running"] }}
outcome = "pending"
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "failed" }}
outcome = "fail"
[[pipelines.render.steps]]
name = "render"
provider = "sim"
kind = "callback"
request = {{ method = "POST", path = "/v1/jobs", body = '{{"ref": "{{{{ record.id }}}}", "callback_url": {{{{ input.hook | tojson }}}}}}' }}
job_id = "/id"
callback = {{ job_id = "/job_id", deadline = "2s", fallback = "poll" }}
poll = {{ path = "/v1/jobs/{{{{ job_id }}}}", every = "100ms", deadline = "10s" }}
outputs = {{ url = "/result/url" }}
on_reversal = "park"
"#,
        t.url,
        sim.base_url()
    );
    let mut config = Config::parse(&text, std::path::Path::new("callbacks.toml")).unwrap();
    crate::helpers::provide_hook_secret(&mut config);
    config.validate(&|v| std::env::var(v).ok()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(
        config.clone(),
        listener,
        shutdown.clone(),
    ));
    // The server answers once it is up (the request waits in the
    // listener's backlog until then).
    assert_eq!(http_get(addr, "/readyz").await.0, 200);
    let hook = format!("http://{addr}/hooks/sim");

    // The webhook refuses what it must.
    let body = br#"{"job_id": "job_x", "status": "succeeded"}"#;
    let now_s = crate::helpers::wall_ms() / 1000;
    let good = ballast::auth::webhook::sign(secret.as_bytes(), now_s, body);
    assert_eq!(
        http_post(addr, "/hooks/sim", &[], body).await.0,
        401,
        "unsigned"
    );
    assert_eq!(
        http_post(addr, "/hooks/sim", &[("x-signature", "sha256=00")], body)
            .await
            .0,
        401,
        "forged"
    );
    assert_eq!(
        http_post(addr, "/hooks/nope", &[("x-signature", &good)], body)
            .await
            .0,
        404,
        "unknown provider"
    );
    let not_json = b"<html>";
    let signed = ballast::auth::webhook::sign(secret.as_bytes(), now_s, not_json);
    assert_eq!(
        http_post(addr, "/hooks/sim", &[("x-signature", &signed)], not_json)
            .await
            .0,
        400
    );
    // A signature from outside the tolerance window (a replay) is refused.
    let old = ballast::auth::webhook::sign(secret.as_bytes(), now_s - 3600, body);
    let (status, text) = http_post(addr, "/hooks/sim", &[("x-signature", &old)], body).await;
    assert_eq!(status, 401);
    assert!(text.contains("stale_signature"), "{text}");
    // Each delivery id is applied once.
    let first = http_post(
        addr,
        "/hooks/sim",
        &[("x-signature", &good), ("x-delivery-id", "d-test-1")],
        body,
    )
    .await;
    assert_eq!(first.0, 202, "{}", first.1);
    let again = http_post(
        addr,
        "/hooks/sim",
        &[("x-signature", &good), ("x-delivery-id", "d-test-1")],
        body,
    )
    .await;
    assert_eq!(again.0, 200);
    assert!(again.1.contains("duplicate"), "{}", again.1);
    let big = vec![b'x'; 2 * 1024 * 1024];
    assert_eq!(
        http_post(addr, "/hooks/sim", &[], &big).await.0,
        413,
        "oversized"
    );
    // The same signed delivery without its id is a replay, not a new one.
    let (status, reply) = http_post(addr, "/hooks/sim", &[("x-signature", &good)], body).await;
    assert_eq!(
        (status, reply.contains("duplicate")),
        (200, true),
        "{reply}"
    );
    let other = br#"{"job_id": "job_y", "status": "succeeded"}"#;
    let signed = ballast::auth::webhook::sign(secret.as_bytes(), now_s, other);
    let (status, reply) = http_post(addr, "/hooks/sim", &[("x-signature", &signed)], other).await;
    assert_eq!(
        (status, reply.contains("stored")),
        (202, true),
        "an unknown job is kept: {reply}"
    );

    let enq = ballast::engine::Engine::new(
        t.db.clone(),
        std::sync::Arc::new(config),
        ballast::engine::EngineOptions::new("t"),
    )
    .await
    .unwrap();
    const N: i64 = 40;
    for i in 0..N {
        enq.enqueue(Enqueue::new(
            "render",
            Some(&format!("v-{i}")),
            serde_json::json!({ "hook": hook }),
        ))
        .await
        .unwrap();
    }
    wait::until(
        "every record comes to rest",
        Duration::from_secs(60),
        async || {
            let counts = t.db.state_counts().await.unwrap();
            if crate::engine::at_rest_in(&counts) == N {
                Ok(())
            } else {
                Err(counts)
            }
        },
    )
    .await;
    // Let late deliveries (flips, stale progress) arrive: until the
    // simulator has sent every callback it means to send.
    wait::until(
        "the simulator's callbacks all sent",
        Duration::from_secs(90),
        async || match sim.callbacks_pending() {
            0 => Ok(()),
            n => Err(n),
        },
    )
    .await;
    let page =
        t.db.list_records(&RecordFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    // A delivery that arrived while its record's pass ran is judged after
    // that pass commits (a contradiction becomes a reversal) and marked
    // applied after the judgement commits: once no job has an unapplied
    // delivery, every reversal is in the records read below.
    wait::until(
        "every delivery is applied",
        Duration::from_secs(60),
        async || {
            let mut unapplied = Vec::new();
            for r in &page.items {
                for s in t.db.step_runs(r.id).await.unwrap() {
                    let Some(job) = s.job_id else { continue };
                    if !t
                        .db
                        .pending_callbacks("sim", &job)
                        .await
                        .unwrap()
                        .is_empty()
                    {
                        unapplied.push(job);
                    }
                }
            }
            if unapplied.is_empty() {
                Ok(())
            } else {
                Err(unapplied)
            }
        },
    )
    .await;
    let page =
        t.db.list_records(&RecordFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    let (mut ok, mut reversed, mut by_poll) = (0, 0, 0);
    for r in &page.items {
        let events = t.db.record_events(r.id).await.unwrap();
        let attempts = t.db.attempts(r.id).await.unwrap();
        if attempts.iter().filter(|a| a.http_status.is_some()).count() > 1 {
            by_poll += 1;
        }
        match r.state {
            ballast::domain::RecordState::Succeeded => ok += 1,
            ballast::domain::RecordState::Parked => {
                assert_eq!(
                    r.error_code.as_deref(),
                    Some("provider_reversed"),
                    "record {}",
                    r.id
                );
                let rev = events
                    .iter()
                    .find(|e| e.kind == "reversed")
                    .expect("a reversed event");
                assert_eq!(rev.actor, "provider");
                assert_eq!(
                    rev.from_state,
                    Some(ballast::domain::RecordState::Succeeded)
                );
                reversed += 1;
            }
            other => panic!("record {} ended {other}: {:?}", r.id, r.reason),
        }
    }
    println!(
        "callbacks: {N} records, {ok} succeeded, {reversed} parked by a reversal, {by_poll} finished by polling after a lost callback; \
         {} callbacks sent; {} double charges",
        sim.callbacks_sent(),
        sim.ledger().double_charges
    );
    assert!(reversed > 0, "flips were reversed");
    assert!(by_poll > 0, "lost callbacks fell back to polling");
    assert_eq!(ok + reversed, N);
    assert_eq!(sim.ledger().double_charges, 0);
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(15), server).await;
}
