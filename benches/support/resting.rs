//! W0 (`-- --only W0`): what records asleep or waiting cost while they
//! wait. `n` records are taken by the engine itself to where they wait (a
//! fifth each asleep for 30 days, waiting for an approval, waiting for a
//! signal, and parents waiting on a child that waits for an approval), and
//! the search indexer catches up (and on PostgreSQL a `VACUUM ANALYZE`
//! does what autovacuum would soon do). Then a `ballast serve` process (every
//! background loop on, as in production) is measured over a window on that
//! database and on an empty one with the same configuration, interleaved:
//! the node's CPU, records touched and events written in the window (both
//! must be 0 with the records waiting), and on PostgreSQL the database's
//! transactions, rows read and buffers per second (`pg_stat_database`), its
//! statements per second (`pg_stat_statements`, when preloaded) and the
//! CPU of the server's processes. The ideal: the figures with the records
//! waiting equal the empty database's.

use std::time::{Duration, Instant};

use ballast::config::Config;
use ballast::domain::RecordState;
use ballast::engine::{Engine, EngineOptions, Enqueue};
use ballast::store::Backend;
use serde_json::json;
use sqlx::{Connection, Row};
use tokio_util::sync::CancellationToken;

/// How often W's submitted jobs are polled.
pub const POLL_EVERY_S: u64 = 30;

/// The pipelines the records wait in; with `jobs` (W), a provider there
/// and a pipeline whose one step submits a job that never finishes and
/// polls it every [`POLL_EVERY_S`] seconds.
fn pipelines(jobs: Option<&str>) -> String {
    let mut text = String::from(
        r#"
[[pipelines.nap.steps]]
name = "later"
kind = "sleep"
for = "720h"

[[pipelines.review.steps]]
name = "decide"
kind = "approval"
timeout = "720h"
on_timeout = "park"

[[pipelines.hook.steps]]
name = "paid"
kind = "signal"

[[pipelines.family.steps]]
name = "kyc"
kind = "pipeline"
pipeline = "review"
"#,
    );
    if let Some(url) = jobs {
        text.push_str(&format!(
            r#"
[providers.jobs]
base_url = "{url}"
timeout = "10s"
[[providers.jobs.rules]]
when = {{ status = "2xx", field = "/status", equals = "running" }}
outcome = "pending"

[[pipelines.poll.steps]]
name = "render"
provider = "jobs"
kind = "submit_poll"
request = {{ method = "POST", path = "/v1/jobs", body = '{{"ref": "{{{{ record.id }}}}"}}' }}
job_id = "/id"
poll = {{ path = "/v1/jobs/{{{{ job_id }}}}", every = "{POLL_EVERY_S}s", deadline = "720h" }}
"#
        ));
    }
    text
}

/// W's provider: every job it is given runs for ever; it counts the polls.
/// It runs in the bench process, whose CPU is reported apart from the
/// node's.
pub struct Jobs {
    pub url: String,
    /// Polls answered.
    polls: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Jobs submitted.
    made: std::sync::Arc<std::sync::atomic::AtomicU64>,
    _server: tokio::task::JoinHandle<()>,
}

impl Jobs {
    pub async fn start() -> Option<Jobs> {
        use axum::routing::{get, post};
        use std::sync::atomic::{AtomicU64, Ordering};
        let polls = std::sync::Arc::new(AtomicU64::new(0));
        let made = std::sync::Arc::new(AtomicU64::new(0));
        let app = axum::Router::new()
            .route(
                "/v1/jobs",
                post({
                    let made = made.clone();
                    move || async move {
                        let id = made.fetch_add(1, Ordering::Relaxed);
                        axum::Json(json!({ "id": format!("j{id}"), "status": "running" }))
                    }
                }),
            )
            .route(
                "/v1/jobs/{id}",
                get({
                    let polls = polls.clone();
                    move |axum::extract::Path(id): axum::extract::Path<String>| async move {
                        polls.fetch_add(1, Ordering::Relaxed);
                        axum::Json(json!({ "id": id, "status": "running" }))
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
        let url = format!("http://{}", listener.local_addr().ok()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Some(Jobs {
            url,
            polls,
            made,
            _server: server,
        })
    }

    fn polls(&self) -> u64 {
        self.polls.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn made(&self) -> u64 {
        self.made.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One measured window of a serve node.
pub struct Window {
    /// The node's CPU, seconds per second.
    pub node_cpu: f64,
    /// PostgreSQL's processes' CPU (the whole server), seconds per second.
    pub db_cpu: Option<f64>,
    /// Transactions committed or rolled back per second (PostgreSQL).
    pub xacts: Option<f64>,
    /// Rows read per second, by scans and by index (PostgreSQL).
    pub rows: Option<f64>,
    /// Shared buffers hit or read per second (PostgreSQL).
    pub blocks: Option<f64>,
    /// Statements per second, when `pg_stat_statements` is preloaded.
    pub statements: Option<f64>,
    /// Records updated and events written in the window, of the records
    /// at rest (W's polling records left out).
    pub touched: i64,
    /// W: polls the provider answered per second.
    pub polls: Option<f64>,
    /// The bench process's CPU, seconds per second (W: the provider's).
    pub bench_cpu: f64,
    /// The statements that read the most buffers in the window (calls,
    /// rows, buffers, text), when `pg_stat_statements` is preloaded.
    pub top: Vec<String>,
}

/// Takes `n` records of the four pipelines to where they wait, and with
/// `pollers` (W) that many records to polling `jobs`, with the engine
/// tuned for throughput; then waits for the search indexer. The seconds
/// it took.
pub async fn seed_waiting(
    fresh: &super::Fresh,
    n: usize,
    pollers: Option<(&Jobs, usize)>,
) -> Option<f64> {
    let text = format!(
        "[database]\nurl = \"{}\"\n{}",
        fresh.url,
        pipelines(pollers.map(|(j, _)| j.url.as_str()))
    );
    let config = Config::parse(&text, std::path::Path::new("w0.toml")).ok()?;
    let mut opts = EngineOptions::new("w0-seed");
    opts.max_in_flight = 1_000;
    opts.batch = 500;
    let engine = Engine::new(fresh.db.clone(), std::sync::Arc::new(config), opts)
        .await
        .ok()?;
    let started = Instant::now();
    let per_kind = n / 5;
    let resting = [
        ("nap", per_kind),
        ("review", per_kind),
        ("hook", per_kind),
        ("family", per_kind),
    ];
    for (k, (pipeline, count)) in resting.iter().enumerate() {
        enqueue_n(&engine, pipeline, k, *count).await?;
    }
    let stop = CancellationToken::new();
    let runner = tokio::spawn({
        let (engine, stop) = (engine.clone(), stop.clone());
        async move { engine.run(stop, Duration::from_secs(5)).await }
    });
    // Every parent has a child: `n` records in all, at rest. Then W's
    // pollers: once each has its job, some are being polled at any
    // moment (the seeding engine polls them too), so they are counted
    // waiting or running.
    let at_rest = (per_kind * 5) as i64;
    let count = |counts: &[ballast::domain::StateCount], states: &[RecordState]| -> i64 {
        counts
            .iter()
            .filter(|c| states.contains(&c.state))
            .map(|c| c.count)
            .sum()
    };
    let mut polling = false;
    loop {
        let counts = fresh.db.state_counts().await.ok()?;
        let waiting = count(&counts, &[RecordState::Waiting]);
        let busy = count(&counts, &[RecordState::Waiting, RecordState::Running]);
        match pollers {
            Some((_, m)) if waiting >= at_rest && !polling && indexed(fresh).await? => {
                enqueue_n(&engine, "poll", resting.len(), m).await?;
                engine.wake();
                polling = true;
            }
            // The indexer reads events 5 s old, and the pollers write
            // events without a pause: it has caught up with those at
            // rest (before the pollers), and keeps up with the polls.
            Some((jobs, m)) if polling && jobs.made() >= m as u64 && busy >= at_rest + m as i64 => {
                break;
            }
            None if waiting >= at_rest && indexed(fresh).await? => break,
            _ => {}
        }
        if started.elapsed() > Duration::from_secs(3_600) {
            eprintln!("W/W0: gave up seeding: {counts:?}");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    let _ = runner.await;
    let took = started.elapsed().as_secs_f64();
    if fresh.pg_name.is_some() {
        // What autovacuum does within a minute of so many updates: until
        // then the claim's probes visit the dead index entries the
        // seeding's updates left (3,187 buffers a claim at 100,000).
        let mut c = sqlx::PgConnection::connect(&fresh.url).await.ok()?;
        sqlx::query("VACUUM ANALYZE").execute(&mut c).await.ok()?;
    }
    Some(took)
}

/// Enqueues `count` records of `pipeline` in batches (keys `w{k}-{j}`).
async fn enqueue_n(engine: &Engine, pipeline: &str, k: usize, count: usize) -> Option<()> {
    let mut i = 0;
    while i < count {
        let end = (i + ballast::store::MAX_BATCH).min(count);
        let items = (i..end)
            .map(|j| Enqueue::new(pipeline, Some(&format!("w{k}-{j}")), json!({ "n": j })))
            .collect();
        engine.enqueue_batch(items).await.ok()?;
        i = end;
    }
    Some(())
}

/// Whether the search indexer has read every event.
async fn indexed(fresh: &super::Fresh) -> Option<bool> {
    let sql = "SELECT (SELECT event_id FROM search_progress WHERE id = 1) >= \
               (SELECT COALESCE(MAX(id), 0) FROM events)";
    let done: bool = match fresh.db.backend() {
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&fresh.url).await.ok()?;
            sqlx::query_scalar(sql).fetch_one(&mut c).await.ok()?
        }
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&fresh.url).await.ok()?;
            sqlx::query_scalar(sql).fetch_one(&mut c).await.ok()?
        }
    };
    Some(done)
}

/// A `ballast serve` node on `fresh`'s database, measured over `window`
/// after `warm_up` (its start-up: statistics, the first rollups).
pub async fn serve_window(
    fresh: &super::Fresh,
    warm_up: Duration,
    window: Duration,
    jobs: Option<&Jobs>,
) -> Option<Window> {
    let dir = tempfile::tempdir().ok()?;
    let text = format!(
        "[database]\nurl = \"{}\"\n{}",
        fresh.url,
        pipelines(jobs.map(|j| j.url.as_str()))
    );
    std::fs::write(dir.path().join("ballast.toml"), text).ok()?;
    let Some(node) = super::serve_node(dir.path()).await else {
        eprintln!("W0: the node did not come up");
        return None;
    };
    let pid = node.0.id();
    tokio::time::sleep(warm_up).await;
    let pg = fresh.pg_name.is_some();
    // Reset before the first sample: the statements counted are the
    // window's (a reset after it made the difference negative).
    if pg {
        let mut c = sqlx::PgConnection::connect(&super::pg_admin()).await.ok()?;
        // The view is read through the admin database: it needs the
        // extension there (it counts every database's statements).
        let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut c)
            .await;
        let _ = sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&mut c)
            .await;
    }
    let before = if pg {
        Some(pg_sample(fresh).await?)
    } else {
        None
    };
    let (node0, db0) = (cpu_of(pid), pg.then(postgres_cpu));
    let bench0 = cpu_of(std::process::id());
    let polls0 = jobs.map(Jobs::polls);
    let from = super::now_ms();
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let secs = started.elapsed().as_secs_f64();
    let (node1, db1) = (cpu_of(pid), pg.then(postgres_cpu));
    let bench_cpu = (cpu_of(std::process::id()) - bench0) / secs;
    let polls = jobs
        .map(Jobs::polls)
        .zip(polls0)
        .map(|(b, a)| (b - a) as f64 / secs);
    let after = if pg {
        Some(pg_sample(fresh).await?)
    } else {
        None
    };
    drop(node);
    let touched = touched_since(fresh, from).await?;
    let top = if pg {
        top_statements(fresh).await
    } else {
        Vec::new()
    };
    let per_s = |f: fn(&PgSample) -> Option<f64>| match (&before, &after) {
        (Some(b), Some(a)) => Some((f(a)? - f(b)?) / secs),
        _ => None,
    };
    Some(Window {
        node_cpu: (node1 - node0) / secs,
        db_cpu: db0.zip(db1).map(|(a, b)| (b - a) / secs),
        xacts: per_s(|s| Some(s.xacts)),
        rows: per_s(|s| Some(s.rows)),
        blocks: per_s(|s| Some(s.blocks)),
        statements: per_s(|s| s.statements),
        touched,
        polls,
        bench_cpu,
        top,
    })
}

/// The five statements on `fresh`'s database that read the most buffers
/// since the last reset.
async fn top_statements(fresh: &super::Fresh) -> Vec<String> {
    let Ok(mut c) = sqlx::PgConnection::connect(&super::pg_admin()).await else {
        return Vec::new();
    };
    let rows = sqlx::query(
        "SELECT s.calls, s.rows, s.shared_blks_hit + s.shared_blks_read AS blks, s.query
           FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
          WHERE d.datname = $1 ORDER BY blks DESC LIMIT 5",
    )
    .bind(fresh.pg_name.as_deref().unwrap_or(""))
    .fetch_all(&mut c)
    .await
    .unwrap_or_default();
    rows.iter()
        .map(|r| {
            let query: String = r.get("query");
            let query: String = query.split_whitespace().collect::<Vec<_>>().join(" ");
            format!(
                "{} calls, {} rows, {} buffers: {}",
                r.get::<i64, _>("calls"),
                r.get::<i64, _>("rows"),
                r.get::<i64, _>("blks"),
                query.chars().take(160).collect::<String>()
            )
        })
        .collect()
}

/// PostgreSQL's counters for one database.
struct PgSample {
    xacts: f64,
    rows: f64,
    blocks: f64,
    statements: Option<f64>,
}

async fn pg_sample(fresh: &super::Fresh) -> Option<PgSample> {
    // The counters of a backend reach the statistics when its transaction
    // ends, at most once a second: let them land.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut c = sqlx::PgConnection::connect(&super::pg_admin()).await.ok()?;
    let name = fresh.pg_name.as_deref()?;
    let row = sqlx::query(
        "SELECT (xact_commit + xact_rollback)::float8 AS xacts,
                (tup_returned + tup_fetched)::float8 AS rows,
                (blks_hit + blks_read)::float8 AS blocks
           FROM pg_stat_database WHERE datname = $1",
    )
    .bind(name)
    .fetch_one(&mut c)
    .await
    .ok()?;
    let statements = sqlx::query_scalar::<_, f64>(
        "SELECT COALESCE(SUM(s.calls), 0)::float8 FROM pg_stat_statements s
           JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1",
    )
    .bind(name)
    .fetch_one(&mut c)
    .await
    .ok();
    Some(PgSample {
        xacts: row.get("xacts"),
        rows: row.get("rows"),
        blocks: row.get("blocks"),
        statements,
    })
}

/// Records updated and events written at or after `from`, but for W's
/// polling records (pipeline `poll`), which are at work.
async fn touched_since(fresh: &super::Fresh, from: i64) -> Option<i64> {
    let sql = "SELECT (SELECT COUNT(*) FROM records WHERE updated_at >= $1 AND pipeline <> 'poll') + \
               (SELECT COUNT(*) FROM events WHERE at >= $1 AND (record_id IS NULL OR record_id NOT IN \
                  (SELECT id FROM records WHERE pipeline = 'poll')))";
    match fresh.db.backend() {
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&fresh.url).await.ok()?;
            sqlx::query_scalar(sql)
                .bind(from)
                .fetch_one(&mut c)
                .await
                .ok()
        }
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&fresh.url).await.ok()?;
            sqlx::query_scalar(sql)
                .bind(from)
                .fetch_one(&mut c)
                .await
                .ok()
        }
    }
}

/// CPU seconds (user + system) of process `pid`.
pub fn cpu_of(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds of every PostgreSQL process on this machine (the server,
/// its backends and background workers).
fn postgres_cpu() -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim_end().starts_with("postgres"))
        })
        .map(cpu_of)
        .sum()
}

/// W0 on `backend`: `n` records seeded waiting, then `runs` windows of a
/// node on an empty database and on the seeded one, interleaved; prints
/// each pair's medians.
pub async fn report(backend: Backend, n: usize, runs: usize, window: Duration) {
    let (Some(empty), Some(full)) = (super::fresh(backend).await, super::fresh(backend).await)
    else {
        println!("W0 failed: no database");
        return;
    };
    let Some(seeded) = seed_waiting(&full, n, None).await else {
        println!("W0 failed: not seeded");
        return;
    };
    println!(
        "{:<44} {:>22}",
        format!("W0 {n} records taken to wait"),
        format!("in {seeded:.0} s")
    );
    let warm_up = Duration::from_secs(15);
    let (mut idle, mut waiting) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        idle.extend(serve_window(&empty, warm_up, window, None).await);
        waiting.extend(serve_window(&full, warm_up, window, None).await);
    }
    for (name, ws) in [
        ("empty database", &idle),
        (&*format!("{n} waiting"), &waiting),
    ] {
        if ws.is_empty() {
            println!("W0 {name}: no window measured");
            continue;
        }
        let of = |f: fn(&Window) -> Option<f64>| median_of(ws, f);
        let touched: i64 = ws.iter().map(|w| w.touched).sum();
        println!(
            "{:<44} node CPU {} s/s; records and events touched {touched}",
            format!("W0 {name}, {} window(s) of {}s", ws.len(), window.as_secs()),
            of(|w| Some(w.node_cpu)).unwrap_or_default(),
        );
        if let Some(xacts) = of(|w| w.xacts) {
            println!(
                "{:<44} transactions {xacts}/s; statements {}/s; rows read {}/s; buffers {}/s; \
                 server CPU {} s/s",
                "",
                of(|w| w.statements).unwrap_or_else(|| "(no pg_stat_statements)".into()),
                of(|w| w.rows).unwrap_or_default(),
                of(|w| w.blocks).unwrap_or_default(),
                of(|w| w.db_cpu).unwrap_or_default(),
            );
        }
        print_top(ws);
    }
    empty.drop_now().await;
    full.drop_now().await;
}

/// W on `backend`: `n` records at rest as in W0 and `m` records whose job
/// never finishes, polled every [`POLL_EVERY_S`] seconds by a `ballast
/// serve` node (default settings, every loop on); `runs` windows, each of
/// a node started afresh and measured after a warm-up longer than one
/// polling period (a node's start finds the polls that fell due while
/// none ran). Prints the polls per second against the ideal (`m` / the
/// period), the node's and (PostgreSQL) the server's CPU, statements per
/// second and per poll, and what the records at rest cost (0 touched).
pub async fn report_w(backend: Backend, n: usize, m: usize, runs: usize, window: Duration) {
    let (Some(jobs), Some(fresh)) = (Jobs::start().await, super::fresh(backend).await) else {
        println!("W failed: no provider or no database");
        return;
    };
    let Some(seeded) = seed_waiting(&fresh, n, Some((&jobs, m))).await else {
        println!("W failed: not seeded");
        return;
    };
    println!(
        "{:<44} {:>22}",
        format!("W  {n} at rest, {m} polling every {POLL_EVERY_S} s"),
        format!("taken to wait in {seeded:.0} s")
    );
    let warm_up = Duration::from_secs(POLL_EVERY_S + 15);
    let mut ws = Vec::new();
    for _ in 0..runs {
        ws.extend(serve_window(&fresh, warm_up, window, Some(&jobs)).await);
    }
    if ws.is_empty() {
        println!("W failed: no window measured");
        fresh.drop_now().await;
        return;
    }
    let of = |f: &dyn Fn(&Window) -> Option<f64>| median_of(&ws, f);
    let ideal = m as f64 / POLL_EVERY_S as f64;
    let touched: i64 = ws.iter().map(|w| w.touched).sum();
    let label = format!(
        "W  {}, {} window(s) of {}s",
        backend.as_str(),
        ws.len(),
        window.as_secs()
    );
    println!(
        "{label:<44} polls {}/s, {} of the ideal {ideal:.0}/s; node CPU {} s/s; \
         bench process (the provider) {} s/s; records at rest touched {touched}",
        of(&|w| w.polls).unwrap_or_default(),
        of(&|w| w.polls.map(|p| p / ideal)).unwrap_or_default(),
        of(&|w| Some(w.node_cpu)).unwrap_or_default(),
        of(&|w| Some(w.bench_cpu)).unwrap_or_default(),
    );
    if let Some(statements) = of(&|w| w.statements) {
        println!(
            "{:<44} statements {statements}/s, {} a poll; transactions {}/s; server CPU {} s/s",
            "",
            of(&|w| w.statements.zip(w.polls).map(|(s, p)| s / p.max(1.0))).unwrap_or_default(),
            of(&|w| w.xacts).unwrap_or_default(),
            of(&|w| w.db_cpu).unwrap_or_default(),
        );
    }
    print_top(&ws);
    fresh.drop_now().await;
}

/// The median of a figure over the windows that have it, with its spread.
fn median_of(ws: &[Window], f: impl Fn(&Window) -> Option<f64>) -> Option<String> {
    let v: Vec<f64> = ws.iter().filter_map(f).collect();
    (!v.is_empty()).then(|| super::median_spread_f(v, 3))
}

/// The last window's statements that read the most.
fn print_top(ws: &[Window]) {
    for line in ws.last().map(|w| w.top.as_slice()).unwrap_or_default() {
        println!("{:<44}   {line}", "");
    }
}
