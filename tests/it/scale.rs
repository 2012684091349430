//! Page response times on a store of many records. A measurement, not a
//! test of speed: it prints figures and is ignored by default. Run with
//! `cargo test --test it -- --ignored --nocapture pages_at_scale`
//! (`BALLAST_SCALE_RECORDS`, default 100000).

use std::time::{Duration, Instant};

use ballast::domain::Role;
use ballast::store::{Backend, Store};
use sqlx::Connection;

use crate::helpers::TestDb;
use crate::web::WebApp;

fn seed_sql(backend: Backend, n: i64) -> Vec<String> {
    let state = "CASE n % 10 WHEN 0 THEN 'succeeded' WHEN 1 THEN 'succeeded' WHEN 2 THEN 'succeeded' \
                 WHEN 3 THEN 'succeeded' WHEN 4 THEN 'failed' WHEN 5 THEN 'parked' WHEN 6 THEN 'cancelled' \
                 WHEN 7 THEN 'pending' WHEN 8 THEN 'retrying' ELSE 'waiting' END";
    let cols = "pipeline, external_key, state, input, next_run_at, step, provider, error_code, reason, created_at, updated_at";
    let (source, input) = match backend {
        Backend::Sqlite => (
            format!(
                "(WITH RECURSIVE seq(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < {n}) SELECT n FROM seq)"
            ),
            "json_object('n', n)",
        ),
        Backend::Postgres => (
            format!("(SELECT generate_series(1, {n}) AS n)"),
            "jsonb_build_object('n', n)",
        ),
    };
    let records = format!(
        "INSERT INTO records ({cols}) SELECT 'p' || (n % 3), 'key-' || n, {state}, {input}, \
         CASE WHEN n % 10 IN (7, 8, 9) THEN 1800000000000 + n END, 'step' || (n % 2), 'prov' || (n % 4), \
         CASE WHEN n % 10 IN (4, 5) THEN 'http_5xx' END, CASE WHEN n % 10 = 5 THEN 'attempts exhausted' END, \
         1700000000000 + n, 1700000000000 + n FROM {source} AS s"
    );
    let attempts = "INSERT INTO attempts (record_id, step, provider, attempt_no, started_at, duration_ms, http_status, outcome, error_code, excerpt) \
         SELECT r.id, r.step, r.provider, k.k, r.created_at + k.k, 40 * k.k, 503, 'retry', 'http_5xx', '{\"error\": \"upstream unavailable\"}' \
         FROM records r CROSS JOIN (SELECT 1 AS k UNION ALL SELECT 2 UNION ALL SELECT 3) k"
        .to_owned();
    let audit = if backend == Backend::Sqlite {
        "1"
    } else {
        "TRUE"
    };
    let plain = if backend == Backend::Sqlite {
        "0"
    } else {
        "FALSE"
    };
    let events = vec![
        format!(
            "INSERT INTO events (record_id, at, kind, actor, audit, to_state) SELECT id, created_at, 'created', 'system', {plain}, 'pending' FROM records"
        ),
        format!(
            "INSERT INTO events (record_id, at, kind, actor, audit, from_state, to_state, reason) SELECT id, updated_at, 'park', 'ops', {audit}, 'retrying', 'parked', 'vendor outage' FROM records WHERE state = 'parked'"
        ),
    ];
    let counts = "INSERT INTO record_counts (pipeline, state, shard, n) SELECT pipeline, state, 0, COUNT(*) FROM records GROUP BY pipeline, state".to_owned();
    let mut all = vec![records, attempts];
    all.extend(events);
    all.push(counts);
    all.push("ANALYZE".into());
    all
}

async fn seed(t: &TestDb, backend: Backend, n: i64) {
    let sqls = seed_sql(backend, n);
    match backend {
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&t.url).await.unwrap();
            for s in sqls {
                sqlx::raw_sql(sqlx::AssertSqlSafe(s))
                    .execute(&mut c)
                    .await
                    .unwrap();
            }
            c.close().await.ok();
        }
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&t.url).await.unwrap();
            for s in sqls {
                sqlx::raw_sql(sqlx::AssertSqlSafe(s))
                    .execute(&mut c)
                    .await
                    .unwrap();
            }
            c.close().await.ok();
        }
    }
}

async fn measure(backend: Backend, n: i64) {
    let Some(t) = TestDb::migrated(backend, "scale").await else {
        return;
    };
    let started = Instant::now();
    seed(&t, backend, n).await;
    println!(
        "{}: seeded {n} records, {} attempts in {:.1} s",
        backend.as_str(),
        n * 3,
        started.elapsed().as_secs_f64()
    );
    let app = WebApp::spawn_on(t, "").await;
    app.user("ops", Role::Admin).await;
    let login = app.login("ops").await;
    let token = app.token(Role::Viewer).await;
    let parked = app
        .t
        .db
        .list_records(&ballast::store::RecordFilter {
            state: Some(ballast::domain::RecordState::Parked),
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .items[0]
        .id;
    let pages = [
        ("overview", "/".to_owned()),
        ("records, first page", "/records".to_owned()),
        (
            "records, state + pipeline",
            "/records?state=parked&pipeline=p1".to_owned(),
        ),
        (
            "records, provider + error code",
            "/records?provider=prov2&error_code=http_5xx".to_owned(),
        ),
        ("records, key prefix", "/records?q=key-4242".to_owned()),
        (
            "records, deep keyset page",
            "/records?before=1000".to_owned(),
        ),
        // No record is both succeeded and carrying an error code: the worst
        // case, an index walk that finds nothing to stop at.
        (
            "records, filter matching nothing",
            "/records?state=succeeded&error_code=http_5xx".to_owned(),
        ),
        ("record detail", format!("/records/{parked}")),
        ("audit log", "/audit".to_owned()),
        ("API list", "/api/v1/records?limit=50".to_owned()),
    ];
    println!("{:<34} {:>9} {:>9}", "page", "p50 ms", "p99 ms");
    for (name, path) in pages {
        let mut times = Vec::new();
        for _ in 0..60 {
            let req = if path.starts_with("/api") {
                app.client.get(app.url(&path)).bearer_auth(&token)
            } else {
                app.client
                    .get(app.url(&path))
                    .header("cookie", &login.cookie)
            };
            let start = Instant::now();
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}");
            r.bytes().await.unwrap();
            times.push(start.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        let p = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        println!("{name:<34} {:>9.1} {:>9.1}", p(0.5), p(0.99));
    }
    app.stop().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run on demand with --ignored --nocapture"]
async fn pages_at_scale() {
    let n = std::env::var("BALLAST_SCALE_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    measure(Backend::Sqlite, n).await;
    measure(Backend::Postgres, n).await;
}

/// Lists whose filters share no index search a bounded id range per call:
/// a filter matching nothing returns short pages with a cursor instead of
/// walking a whole index, and following the cursors finds every match once.
async fn sparse_filters_page_through(backend: Backend) {
    use ballast::domain::RecordState;
    use ballast::store::{LIST_SCAN_IDS, RecordFilter};
    let Some(t) = TestDb::migrated(backend, "sparse").await else {
        return;
    };
    let n = 150_000;
    seed(&t, backend, n).await;
    let nothing = RecordFilter {
        state: Some(RecordState::Succeeded),
        error_code: Some("http_5xx".into()),
        limit: 50,
        ..Default::default()
    };
    let first = t.db.list_records(&nothing).await.unwrap();
    assert!(first.items.is_empty());
    assert_eq!(
        first.next,
        Some(n + 1 - LIST_SCAN_IDS),
        "stopped at the budget"
    );
    let second =
        t.db.list_records(&RecordFilter {
            before: first.next,
            ..nothing.clone()
        })
        .await
        .unwrap();
    assert_eq!(
        (second.items.len(), second.next),
        (0, None),
        "the rest, then the end"
    );

    let sparse = RecordFilter {
        state: Some(RecordState::Parked),
        provider: Some("prov1".into()),
        limit: 500,
        ..Default::default()
    };
    let mut seen = Vec::new();
    let mut before = None;
    loop {
        let page =
            t.db.list_records(&RecordFilter {
                before,
                ..sparse.clone()
            })
            .await
            .unwrap();
        seen.extend(page.items.iter().map(|r| r.id));
        match page.next {
            Some(next) => before = Some(next),
            None => break,
        }
    }
    // Parked is n % 10 == 5 and prov1 is n % 4 == 1: one id in twenty.
    assert_eq!(seen.len() as i64, n / 20);
    assert!(
        seen.windows(2).all(|w| w[0] > w[1]),
        "newest first, each once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_filters_page_through_sqlite() {
    sparse_filters_page_through(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_filters_page_through_postgres() {
    sparse_filters_page_through(Backend::Postgres).await;
}
