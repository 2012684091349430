//! Test databases (a fresh one per test, on either backend) and the app.

use std::net::SocketAddr;
use std::time::Duration;

use ballast::store::{Backend, ConnectOptions, Db, migrate};
use sqlx::Connection;
use tempfile::TempDir;

/// The admin URL of the PostgreSQL used by tests.
pub fn pg_admin_url() -> String {
    std::env::var("BALLAST_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Says that a part of a test did not run here, and why: straight to the
/// process's stderr, since libtest captures `println!` and `eprintln!` of
/// passing tests and a skip must be seen.
pub fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIP {why}");
}

/// `admin` with its database name replaced by `name`.
pub fn with_database(admin: &str, name: &str) -> String {
    let (base, query) = match admin.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (admin, String::new()),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    format!("{host_part}/{name}{query}")
}

/// A fresh, empty database that disappears with the value.
pub struct TestDb {
    pub db: Db,
    pub url: String,
    _dir: Option<TempDir>,
    pg_name: Option<String>,
}

impl TestDb {
    /// A new SQLite file in a temporary directory.
    pub async fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("test.db").display());
        let db = Db::connect(&url, &ConnectOptions::default()).await.unwrap();
        TestDb {
            db,
            url,
            _dir: Some(dir),
            pg_name: None,
        }
    }

    /// A new PostgreSQL database, or `None` (with a printed SKIP line) when
    /// PostgreSQL is unreachable outside CI. In CI, unreachable is a failure.
    pub async fn postgres(test: &str) -> Option<TestDb> {
        let admin = pg_admin_url();
        let mut conn = match sqlx::PgConnection::connect(&admin).await {
            Ok(c) => c,
            Err(e) if !in_ci() => {
                skip(&format!("{test}: PostgreSQL unreachable at {admin}: {e}"));
                return None;
            }
            Err(e) => panic!("CI=true and PostgreSQL is unreachable at {admin}: {e}"),
        };
        let name = format!("ballast_it_{}", uuid::Uuid::new_v4().simple());
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.ok();
        let url = with_database(&admin, &name);
        let db = Db::connect(&url, &ConnectOptions::default()).await.unwrap();
        Some(TestDb {
            db,
            url,
            _dir: None,
            pg_name: Some(name),
        })
    }

    /// A fresh database of `backend`, see [`sqlite`](Self::sqlite) and
    /// [`postgres`](Self::postgres).
    pub async fn new(backend: Backend, test: &str) -> Option<TestDb> {
        match backend {
            Backend::Sqlite => Some(TestDb::sqlite().await),
            Backend::Postgres => TestDb::postgres(test).await,
        }
    }

    /// The PostgreSQL database's name (`None` on SQLite).
    pub fn pg_name(&self) -> Option<&str> {
        self.pg_name.as_deref()
    }

    /// The same, migrated to the latest schema.
    pub async fn migrated(backend: Backend, test: &str) -> Option<TestDb> {
        let t = TestDb::new(backend, test).await?;
        migrate::up(&t.db, None).await.unwrap();
        Some(t)
    }

    /// Runs `sql` on this database outside the store, on a connection of
    /// its own; the rows it changed.
    pub async fn execute(&self, sql: &str) -> u64 {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        match &self.db {
            Db::Sqlite(_) => {
                let pool = sqlx::SqlitePool::connect(&self.url).await.unwrap();
                let done = sqlx::raw_sql(sql).execute(&pool).await.unwrap();
                pool.close().await;
                done.rows_affected()
            }
            Db::Postgres(_) => {
                let pool = sqlx::PgPool::connect(&self.url).await.unwrap();
                let done = sqlx::raw_sql(sql).execute(&pool).await.unwrap();
                pool.close().await;
                done.rows_affected()
            }
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some(name) = self.pg_name.take() else {
            return;
        };
        // Drop runs inside the test's runtime, which this blocks: clean up on
        // a thread with its own runtime, and let FORCE end the pool's
        // connections (closing the pool from here would wait on the blocked
        // runtime forever).
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&pg_admin_url()).await {
                    let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(&mut conn)
                        .await
                        .ok();
                }
            });
        });
        cleanup.join().ok();
    }
}

/// A port nobody listens on (yet), for a child process to bind later.
/// Taken below the kernel's ephemeral range (32768 and up here), where no
/// outgoing connection's source port or `bind(0)` lands: the tests make
/// thousands of connections (the API tester), and a port picked from that
/// range could be a connection's by the time the child binds it. Each
/// call of this process tries the next port from a random start.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    const LOW: u16 = 20_000;
    const SPAN: u16 = 12_000;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let start = fastrand::u16(0..SPAN);
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = LOW + (start.wrapping_add(n) % SPAN);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// Minimal HTTP/1.1 GET on loopback: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await
            .expect("connect timed out")
            .expect("connect failed");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .expect("read timed out")
        .unwrap();
    parse_response(&response)
}

#[test]
fn with_database_replaces_the_name() {
    assert_eq!(
        with_database("postgres://u@h:5432/postgres", "x"),
        "postgres://u@h:5432/x"
    );
    assert_eq!(
        with_database("postgres://u@h/db?sslmode=disable", "x"),
        "postgres://u@h/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
}

/// Minimal HTTP/1.1 POST on loopback: (status, body).
pub async fn http_post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect failed");
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    // A server may answer (413) before reading a large body; ignore write errors.
    let _ = stream.write_all(body).await;
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await;
    let response = String::from_utf8_lossy(&response).into_owned();
    parse_response(&response)
}

/// (status, body) of a raw HTTP/1.1 response; status 0 when unreadable.
fn parse_response(response: &str) -> (u16, String) {
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// How many records there are, by the state counters.
pub async fn record_total(db: &Db) -> i64 {
    db.state_counts()
        .await
        .unwrap()
        .iter()
        .map(|c| c.count)
        .sum()
}

/// Every record (in `state`, when given), newest first, all pages.
pub async fn all_records(
    db: &Db,
    state: Option<ballast::domain::RecordState>,
) -> Vec<ballast::domain::Record> {
    let f = ballast::store::RecordFilter {
        state,
        limit: 500,
        ..Default::default()
    };
    listed(db, &f).await
}

/// Every record `f` lists, page after page (`f.limit` a page), in list
/// order.
pub async fn listed(db: &Db, f: &ballast::store::RecordFilter) -> Vec<ballast::domain::Record> {
    let (mut out, mut before) = (Vec::new(), None);
    loop {
        let page = db
            .list_records(&ballast::store::RecordFilter {
                before,
                ..f.clone()
            })
            .await
            .unwrap();
        out.extend(page.items);
        match page.next {
            Some(next) => before = Some(next),
            None => return out,
        }
    }
}

/// The kinds of a record's events, oldest first.
pub async fn event_kinds(db: &Db, record_id: i64) -> Vec<String> {
    db.record_events(record_id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect()
}

/// Waits until `sim` has received at least `n` requests, failing after
/// `within`.
pub async fn wait_for_requests(sim: &ballast::sim::SimHandle, n: u64, within: Duration) {
    let what = format!("{n} request(s) at the simulator");
    poll_until(&what, within, || async {
        (sim.stats().requests >= n).then_some(())
    })
    .await;
}

/// Every running record's lease owner.
pub async fn running_leases(db: &Db) -> std::collections::BTreeMap<i64, String> {
    all_records(db, Some(ballast::domain::RecordState::Running))
        .await
        .into_iter()
        .filter_map(|r| Some((r.id, r.lease_owner?)))
        .collect()
}

/// The nodes holding leases of running records.
pub async fn lease_holders(db: &Db) -> std::collections::BTreeSet<String> {
    running_leases(db).await.into_values().collect()
}

/// How a run's records ended, each checked on the way: at rest, free of
/// leases, with attempts, and when not succeeded with a code and a reason.
pub struct Audit {
    pub ok: i64,
    pub failed: i64,
    pub parked: i64,
    pub attempts: usize,
    /// Attempts that got an HTTP reply: each surely reached the provider
    /// (one that timed out or was reset may not have).
    pub answered: usize,
    /// `lease_expired` events: leases another worker took over.
    pub taken_over: usize,
}

/// [`Audit`]s every record; prints why those not succeeded ended so.
pub async fn audit_at_rest(db: &Db) -> Audit {
    use ballast::domain::RecordState;
    let mut a = Audit {
        ok: 0,
        failed: 0,
        parked: 0,
        attempts: 0,
        answered: 0,
        taken_over: 0,
    };
    let mut why = std::collections::BTreeMap::<String, usize>::new();
    for r in all_records(db, None).await {
        match r.state {
            RecordState::Succeeded => a.ok += 1,
            RecordState::Failed => a.failed += 1,
            RecordState::Parked => a.parked += 1,
            other => panic!("record {} ended {other}", r.id),
        }
        assert!(r.lease_owner.is_none(), "record {} still leased", r.id);
        if r.state != RecordState::Succeeded {
            let code = r.error_code.clone().unwrap_or_default();
            *why.entry(format!("{} {code}", r.state)).or_default() += 1;
            assert!(
                !code.is_empty(),
                "record {} is {} without a code",
                r.id,
                r.state
            );
            assert!(
                r.reason.is_some(),
                "record {} is {} without a reason",
                r.id,
                r.state
            );
        }
        let history = db.attempts(r.id).await.unwrap();
        assert!(!history.is_empty(), "record {} has no attempts", r.id);
        a.attempts += history.len();
        a.answered += history.iter().filter(|h| h.http_status.is_some()).count();
        for e in db.record_events(r.id).await.unwrap() {
            a.taken_over += usize::from(e.kind == "lease_expired");
        }
    }
    println!("  not succeeded, by state and code: {why:?}");
    a
}

/// Serves `app` on a free loopback port in the background; its base URL.
pub async fn serve_router(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// The wall clock's `now`, for tests that seed rows beside a server running
/// on the system clock.
pub fn wall_ms() -> i64 {
    use ballast::domain::Clock;
    ballast::domain::SystemClock.now_ms()
}

/// A provider whose replies the test lets out one by one: each call to
/// `POST /v1/charge` arrives as a [`Held`] and answers `succeeded` only
/// when the test releases it. Tests then wait on calls arriving (events)
/// instead of timing them.
pub struct Gate {
    pub url: String,
    arrived: tokio::sync::mpsc::UnboundedReceiver<Held>,
}

/// One call held at the [`Gate`]; dropping it answers too.
pub struct Held {
    release: tokio::sync::oneshot::Sender<()>,
}

impl Held {
    pub fn release(self) {
        let _ = self.release.send(());
    }
}

impl Gate {
    pub async fn spawn() -> Gate {
        Self::spawn_replying("succeeded").await
    }

    /// A gate whose replies say `status` (`queued`: a job accepted, for
    /// a callback step to wait on).
    pub async fn spawn_replying(status: &'static str) -> Gate {
        use axum::routing::post;
        let (tx, arrived) = tokio::sync::mpsc::unbounded_channel::<Held>();
        let charge = move |axum::Json(body): axum::Json<serde_json::Value>| {
            let tx = tx.clone();
            async move {
                let id = format!("ch_{}", body["ref"].as_str().unwrap_or(""));
                let (release, released) = tokio::sync::oneshot::channel();
                let _ = tx.send(Held { release });
                let _ = released.await;
                axum::Json(serde_json::json!({ "id": id, "status": status }))
            }
        };
        let url = serve_router(axum::Router::new().route("/v1/charge", post(charge))).await;
        Gate { url, arrived }
    }

    /// The next call to arrive; fails the test if none does within
    /// `within` (a bound for a broken build, not a timing assertion).
    pub async fn next(&mut self, within: Duration, what: &str) -> Held {
        match tokio::time::timeout(within, self.arrived.recv()).await {
            Ok(Some(held)) => held,
            _ => panic!("no call arrived within {within:?}: {what}"),
        }
    }

    /// Whether a call has arrived that [`next`](Self::next) has not taken.
    pub fn has_waiting(&mut self) -> bool {
        !self.arrived.is_empty()
    }
}

/// [`crate::wait::until`] for a check that gives `None` until the state
/// waited on is there.
pub async fn poll_until<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    crate::wait::until(what, limit, async || check().await.ok_or("not yet")).await
}

/// The maintained counters (by pipeline and by provider) agree with a
/// recount of the rows.
pub async fn assert_counters_match(db: &Db) {
    let nonzero = |mut v: Vec<ballast::domain::StateCount>| {
        v.retain(|c| c.count != 0);
        v.sort();
        v
    };
    assert_eq!(
        nonzero(db.state_counts().await.unwrap()),
        nonzero(db.recount_states().await.unwrap()),
        "counters by pipeline against the rows"
    );
    assert_eq!(
        nonzero(db.provider_counts().await.unwrap()),
        nonzero(db.recount_providers().await.unwrap()),
        "counters by provider against the rows"
    );
    let mut steps = db.step_counts().await.unwrap();
    steps.sort();
    let mut recounted = db.recount_steps().await.unwrap();
    recounted.retain(|c| c.count != 0);
    recounted.sort();
    assert_eq!(steps, recounted, "counters by step against the rows");
    let mut groups = db.group_counts().await.unwrap();
    groups.sort();
    let mut recounted = db.recount_groups().await.unwrap();
    recounted.sort();
    assert_eq!(groups, recounted, "counters by group against the rows");
}

/// The webhook secret tests sign with. Tests may not set environment
/// variables (`unsafe` is forbidden), so a provider naming
/// [`HOOK_SECRET_VAR`] in `webhook_secrets_env` gets this value through
/// [`provide_hook_secret`], as the process's environment would give it.
pub const HOOK_SECRET: &str = "test-hook-secret-0123456789";

/// The variable name tests' configurations use for [`HOOK_SECRET`].
pub const HOOK_SECRET_VAR: &str = "TEST_HOOK_SECRET";

/// Stands in for the environment for [`HOOK_SECRET_VAR`]: every provider
/// naming it verifies with [`HOOK_SECRET`] instead.
pub fn provide_hook_secret(config: &mut ballast::config::Config) {
    for p in config.providers.values_mut() {
        let before = p.webhook_secrets_env.len();
        p.webhook_secrets_env.retain(|v| v != HOOK_SECRET_VAR);
        if p.webhook_secrets_env.len() < before {
            p.webhook_secrets_inline
                .push(ballast::config::Secret::new(HOOK_SECRET));
        }
    }
}
