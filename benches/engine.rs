//! The engine benchmark: `cargo bench --bench engine` (add `-- --quick` for
//! a short run). Starts the engine on SQLite and on PostgreSQL (when
//! reachable: `BALLAST_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable`, no TLS, as
//! graphile-worker connects) and prints a table:
//!
//! - A: overhead. A one-step pipeline whose provider answers in-process
//!   (no socket), full attempt history and events written: records/s, CPU
//!   seconds of this process per 1,000 records; enqueue rates, one by one
//!   (half the records) and in batches of 1,000 (the other half, as many as
//!   one call takes). The engine
//!   is set for throughput here and in the backlog runs: claims of 500,
//!   1,000 records in flight (elsewhere claims of 100).
//! - A': the same against the built-in simulator over loopback, no latency.
//! - B: latency-bound. Simulator latency 50 ms, 100 in flight: records/s
//!   and the ratio to the ideal 2,000/s, and to a bare client's (below).
//! - A with 2,000 and with 200,000 records queued (all batch-enqueued):
//!   the rate must not fall as the backlog grows.
//! - B1000: the same latency, 1,000 in flight, 20,000 records: the ratio to
//!   the ideal 20,000/s, and to its ceiling here: a bare reqwest client (no
//!   engine, no database) sending the same calls, 1,000 at once, to the
//!   same kind of simulator. `-- --sim-process` runs B's simulator as
//!   `ballast sim` in its own process (for B, B1000 and the bare client).
//! - I: one record whose step runs for each of 1,000 items against 1,000
//!   one-step records making the same calls (rate, CPU), and one record of
//!   10,000 items: peak RSS of this process for each (memory flat in the
//!   number of items).
//! - C: rate-limit fidelity. A provider limited to 200/s: calls per whole
//!   second of the run as a fraction of the limit, and the most calls the
//!   simulator saw in any one second.
//!
//! - D: a three-step pipeline (charge, render submit + poll, optional
//!   notify) against the simulator's chaos profile, latency scaled to 1%:
//!   records/s to rest (jobs that never finish park at a 2 s poll deadline)
//!   and simulator calls per record.
//! - E: the control plane over 1,000,000 seeded records (100,000 with
//!   --quick): p50 / p99 of each page over 200 requests (50) one at a time
//!   from a client on loopback, with the seeding time.
//! - F: memory. Records whose one step submits a job that never finishes
//!   (in-process provider; polls every 10 minutes): peak RSS of this process
//!   while 100,000 are taken to `waiting`.
//!
//! - W0 (only when named in `--only`): 1,000,000 records (100,000 with
//!   --quick) asleep or waiting, and what a `ballast serve` node and the
//!   database spend per second while they wait, against an empty database
//!   (`support/resting.rs`).
//! - W (only when named): the same records at rest and 100,000 more
//!   (10,000 with --quick) whose submitted jobs never finish, polled
//!   every 30 s by a `ballast serve` node: polls per second against the
//!   ideal (100,000 / 30 s), the node's and the database's CPU,
//!   statements per second and per poll, and the records at rest touched
//!   (0 is the target).
//!
//! `-- --only A,backlog,I,B,B1000,C,D,E,F,W0,W` and `-- --backend sqlite|postgres` run a
//! part (to profile one figure), `-- --runs N` N runs per figure;
//! `-- --pg-profile` prints, for each A run on PostgreSQL, where PostgreSQL
//! spent its time per record in its batch enqueue and in its processing
//! (`support/pgprofile.rs`), and `-- --peer
//! --pg-profile` the same for graphile-worker's A
//! (`../shared/peers/graphile/run`); `-- --traces` exports every pass's spans
//! over OTLP to a collector in the process (measure A with and without);
//! `-- --encrypt` seals every value at rest with a data key; `-- --groups N`
//! spreads the one-step runs' records over N groups. Each figure is the median of the runs (3, or 1 with --quick) with the
//! spread. Durable commits throughout (SQLite WAL + synchronous=FULL,
//! PostgreSQL defaults). The machine is shared: compare ratios in one run.
// A benchmark measures real time: the clock rule of `src/` is not for it.
#![allow(clippy::disallowed_methods)]
// A measuring tool: a broken set-up should stop it loudly.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ballast::config::Config;
use ballast::domain::RecordState;
use ballast::engine::http::{Call, InProcess, InProcessProvider};
use ballast::engine::{Engine, EngineOptions, Enqueue, SearchIndexer};
use ballast::sim::{Profile, SimHandle};
use ballast::store::{Backend, ConnectOptions, Db, NewRecord, migrate};
use serde_json::{Value, json};
use sqlx::Connection;
use tokio_util::sync::CancellationToken;

#[path = "support/seed.rs"]
mod seed;

#[path = "support/pgprofile.rs"]
mod pgprofile;

#[path = "support/resting.rs"]
mod resting;

/// `--pg-profile`: A on PostgreSQL prints where PostgreSQL spent its time
/// per record, enqueueing in batches and processing (see
/// `support/pgprofile.rs`).
static PG_PROFILE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// `--peer` (with `--pg-profile`): graphile-worker's workload A through
/// `../shared/peers/graphile/run` (its own enqueue, then its tuned worker),
/// with the same PostgreSQL report over its processing statements.
async fn peer_profile(n: usize) {
    let run = std::env::var("BALLAST_PEER_GRAPHILE").unwrap_or_else(|_| {
        format!(
            "{}/../shared/peers/graphile/run",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    let admin = pg_admin();
    let url = pg_url("peer_graphile");
    let mut conn = sqlx::PgConnection::connect(&admin).await.expect("postgres");
    let exists: Option<i32> =
        sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = 'peer_graphile'")
            .fetch_optional(&mut conn)
            .await
            .expect("pg_database");
    if exists.is_none() {
        sqlx::raw_sql("CREATE DATABASE peer_graphile")
            .execute(&mut conn)
            .await
            .expect("create database");
    }
    let profiling = PG_PROFILE.get().copied().unwrap_or(false);
    if profiling {
        pgprofile::reset(&url).await.expect("pg-profile reset");
    }
    let out = std::process::Command::new("bash")
        .args([run.as_str(), "A", &n.to_string()])
        .env("PG", pg_parts().0)
        // The same transport as Ballast's: node-postgres reads PGSSLMODE,
        // and its `no-verify` encrypts without checking the certificate,
        // as sqlx's `prefer` and `require` do.
        .env(
            "PGSSLMODE",
            if pg_sslmode() == "disable" {
                "disable"
            } else {
                "no-verify"
            },
        )
        .output()
        .expect("the graphile-worker peer runs");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if profiling {
        // Its enqueue (single and batch), its set-up and the peer script's
        // own polling and clean-up are left out: what remains is processing.
        let skip = [
            "add_job",
            "count(*)::int as c",
            "vacuum",
            "checkpoint",
            "migrations",
            "delete from graphile_worker._private_jobs$",
        ];
        match pgprofile::report(&url, n, &skip).await {
            Ok(r) => println!(
                "PostgreSQL per job, graphile-worker processing {n} (A; its statements \
                 only, but table rows and cluster WAL include its enqueue and set-up):\n{r}"
            ),
            Err(e) => eprintln!("pg-profile: {e}"),
        }
    }
}

/// Profiled: A on PostgreSQL (one step, in-process provider, half the
/// records enqueued one by one), with or without the search indexer.
fn pg_profiling(setup: &Setup) -> bool {
    PG_PROFILE.get().copied().unwrap_or(false)
        && matches!(setup.backend, Backend::Postgres)
        && setup.kind == Kind::One
        && matches!(setup.provider, Provider::InProcess)
        && setup.single_enqueue
}

struct Ok200;

/// Every call answers "still running": submitted jobs wait on polls.
struct StillRunning;

impl InProcessProvider for StillRunning {
    fn answer(&self, _call: &Call) -> (u16, Value) {
        (200, json!({ "id": "j1", "status": "running" }))
    }
}

impl InProcessProvider for Ok200 {
    fn answer(&self, _call: &Call) -> (u16, Value) {
        (200, json!({ "id": "x1", "status": "succeeded" }))
    }
}

/// A fresh database; dropped (PostgreSQL) when the guard goes.
struct Fresh {
    db: Db,
    url: String,
    pg_name: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

/// The PostgreSQL server's admin URL. By default without TLS, as
/// graphile-worker (node-postgres) connects unless told otherwise: both
/// sides of a comparison pay the same transport. sqlx's default,
/// `sslmode=prefer`, encrypts on a server with TLS on (Debian's is):
/// measured in session 24, rustls was a quarter of this process's
/// samples in A on PostgreSQL. Set the variable to measure over TLS.
fn pg_admin() -> String {
    std::env::var("BALLAST_TEST_POSTGRES_URL").unwrap_or_else(|_| {
        "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable".to_owned()
    })
}

/// The server's settings that move the figures, printed above them: a
/// server without autovacuum (a CI image's setting) keeps every dead row
/// and index entry a benchmark leaves, which no production server does.
async fn pg_server() -> String {
    const SETTINGS: &str = "SELECT string_agg(name || ' ' || current_setting(name), ', ' \
         ORDER BY name) FROM pg_settings WHERE name IN ('server_version', 'autovacuum', \
         'autovacuum_naptime', 'shared_buffers', 'synchronous_commit', 'shared_preload_libraries')";
    let settings = async {
        let mut conn = sqlx::PgConnection::connect(&pg_admin()).await?;
        sqlx::query_scalar::<_, String>(SETTINGS)
            .fetch_one(&mut conn)
            .await
    };
    match settings.await {
        Ok(s) => format!("server: {s}"),
        Err(e) => format!("server: settings unreadable: {e}"),
    }
}

/// The admin URL split: the server without a database, and the
/// parameters after `?` (empty when none).
fn pg_parts() -> (String, String) {
    let admin = pg_admin();
    let (path, params) = admin.split_once('?').unwrap_or((admin.as_str(), ""));
    let server = path.rsplit_once('/').map_or(path, |(b, _)| b);
    (server.to_owned(), params.to_owned())
}

/// The URL of database `name` on the admin URL's server, with its
/// parameters (`sslmode`).
fn pg_url(name: &str) -> String {
    match pg_parts() {
        (server, params) if params.is_empty() => format!("{server}/{name}"),
        (server, params) => format!("{server}/{name}?{params}"),
    }
}

/// The admin URL's `sslmode` (sqlx's default, `prefer`, when it names none).
fn pg_sslmode() -> String {
    let (_, params) = pg_parts();
    params
        .split('&')
        .find_map(|kv| kv.strip_prefix("sslmode="))
        .unwrap_or("prefer")
        .to_owned()
}

/// `--encrypt`: the values records carry are sealed at rest with a data
/// key (`[database.encryption]`), to measure what sealing costs.
static ENCRYPT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// `-- --groups N`: the one-step runs' records spread over N groups (record
/// k in `g{k % N}`), as tenants' would be; none by default.
static GROUPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Record `k`'s enqueue in the one-step runs (grouped with `--groups`).
fn one_step(pipeline: &str, k: usize) -> Enqueue {
    let group = match GROUPS.get().copied().unwrap_or(0) {
        0 => None,
        n => Some(format!("g{}", k % n)),
    };
    Enqueue::new(pipeline, Some(&format!("k{k}")), json!({ "amount": k }))
        .in_group(group.as_deref())
}

/// The bench database's data keys: one current key with `--encrypt`.
fn bench_keyring() -> std::sync::Arc<ballast::auth::seal::Keyring> {
    let ring = if ENCRYPT.get().copied().unwrap_or(false) {
        ballast::auth::seal::Keyring::new(Some("bench"), [("bench".to_owned(), [7u8; 32])])
            .expect("a bench key")
    } else {
        ballast::auth::seal::Keyring::default()
    };
    std::sync::Arc::new(ring)
}

async fn fresh(backend: Backend) -> Option<Fresh> {
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().ok()?;
            let url = format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("bench.db").display()
            );
            let opts = ConnectOptions {
                keyring: bench_keyring(),
                ..ConnectOptions::default()
            };
            let db = Db::connect(&url, &opts).await.ok()?;
            migrate::up(&db, None).await.ok()?;
            Some(Fresh {
                db,
                url,
                pg_name: None,
                _dir: Some(dir),
            })
        }
        Backend::Postgres => {
            let admin = pg_admin();
            let mut conn = sqlx::PgConnection::connect(&admin).await.ok()?;
            let name = format!("ballast_bench_{}", uuid::Uuid::new_v4().simple());
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&mut conn)
                .await
                .ok()?;
            let url = pg_url(&name);
            let opts = ConnectOptions {
                max_connections: 20,
                keyring: bench_keyring(),
                ..ConnectOptions::default()
            };
            let db = Db::connect(&url, &opts).await.ok()?;
            migrate::up(&db, None).await.ok()?;
            Some(Fresh {
                db,
                url,
                pg_name: Some(name),
                _dir: None,
            })
        }
    }
}

impl Fresh {
    async fn drop_now(self) {
        self.db.close().await;
        if let Some(name) = self.pg_name {
            if let Ok(mut conn) = sqlx::PgConnection::connect(&pg_admin()).await {
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .execute(&mut conn)
                .await;
            }
        }
    }
}

/// What the records go through.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// One request step (`one`).
    One,
    /// Charge, render (submit + poll), optional notify (`chain`).
    Chain,
    /// One submit-and-poll step whose job never finishes (`wait`).
    Waiting,
    /// One request step for each item of one record's input (`items`):
    /// `n` items, `max_parallel` the engine's calls in flight.
    Items,
}

impl Kind {
    fn pipeline(self) -> &'static str {
        match self {
            Kind::One => "one",
            Kind::Chain => "chain",
            Kind::Waiting => "wait",
            Kind::Items => "items",
        }
    }
}

fn config(
    url: &str,
    base_url: &str,
    concurrency: u32,
    rate_limit: Option<&str>,
    kind: Kind,
    at_most_once: bool,
) -> Config {
    let mut limits = rate_limit
        .map(|l| format!("rate_limits = [\"{l}\"]"))
        .unwrap_or_default();
    if at_most_once {
        limits.push_str("\nat_most_once = true");
    }
    let pipeline = match kind {
        Kind::One => {
            r#"
[[pipelines.one.steps]]
name = "call"
provider = "p"
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}", "amount": 1}' }
"#
        }
        Kind::Chain => {
            r#"
[[pipelines.chain.steps]]
name = "charge"
provider = "p"
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-charge", "amount": {{ input.amount }}}' }
outputs = { charge_id = "/id" }
[[pipelines.chain.steps]]
name = "render"
provider = "p"
kind = "submit_poll"
needs = ["charge"]
request = { method = "POST", path = "/v1/jobs", body = '{"ref": "{{ record.id }}-render", "charge": {{ steps.charge.output.charge_id | tojson }}}' }
job_id = "/id"
poll = { path = "/v1/jobs/{{ job_id }}", every = "50ms", deadline = "2s" }
{lookup}
outputs = { url = "/result/url" }
[[pipelines.chain.steps]]
name = "notify"
provider = "p"
needs = ["render"]
required = false
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-notify", "amount": 0}' }
"#
        }
        Kind::Items => {
            r#"
[[pipelines.items.steps]]
name = "call"
provider = "p"
for_each = "/input/items"
max_parallel = {concurrency}
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-{{ item_index }}", "amount": {{ item }}}' }
"#
        }
        Kind::Waiting => {
            r#"
[[pipelines.wait.steps]]
name = "render"
provider = "p"
kind = "submit_poll"
request = { method = "POST", path = "/v1/jobs", body = '{"ref": "{{ record.id }}"}' }
job_id = "/id"
poll = { path = "/v1/jobs/{{ job_id }}", every = "10m", deadline = "1h" }
"#
        }
    };
    // With `at_most_once`, the render step asks for its job by reference
    // when unsure; the charges have no lookup and park instead.
    let lookup = if at_most_once {
        r#"lookup = { path = "/v1/jobs?client_reference={{ record.id }}-render", job_id = "/data/0/id" }"#
    } else {
        ""
    };
    let pipeline = pipeline
        .replace("{lookup}", lookup)
        .replace("{concurrency}", &concurrency.to_string());
    let text = config_text(url, base_url, concurrency, &limits, &pipeline);
    let config = Config::parse(&text, std::path::Path::new("bench.toml")).expect("bench config");
    config.validate(&|_| None).expect("bench config is valid");
    config
}

/// The bench configuration's text: provider `p` at `base_url` and
/// `pipeline`.
fn config_text(
    url: &str,
    base_url: &str,
    concurrency: u32,
    limits: &str,
    pipeline: &str,
) -> String {
    format!(
        r#"
[database]
url = "{url}"
[providers.p]
base_url = "{base_url}"
timeout = "10s"
concurrency = {concurrency}
{limits}
retry = {{ max_attempts = 8, base = "20ms", cap = "300ms", deadline = "10m", unknown_attempts = 4, budget = 0.5, budget_floor = 100.0 }}
[[providers.p.rules]]
when = {{ status = "2xx", field = "/status", in = ["queued", "running"] }}
outcome = "pending"
[[providers.p.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[providers.p.rules]]
when = {{ status = "2xx", field = "/status", equals = "failed" }}
outcome = "fail"
[[providers.p.rules]]
when = {{ status = ["400", "404", "422"] }}
outcome = "fail"
{pipeline}"#
    )
}

/// N: `nodes` separate `ballast serve` processes on one fresh PostgreSQL
/// database share `n` one-step records against the simulator (`profile`),
/// each node with 20 calls in flight, the provider capped at 20 per node
/// for the whole cluster and limited to 2,000 calls a second. Returns
/// records per second (from the moment they all fall due to the last at
/// rest), and the most calls the simulator saw in one second and in
/// flight at once.
async fn nodes_run(nodes: usize, n: usize, profile: &Profile) -> Option<(f64, u32, u32)> {
    let fresh = fresh(Backend::Postgres).await?;
    let sim = SimHandle::spawn(profile.clone()).await.ok()?;
    let dir = tempfile::tempdir().ok()?;
    let pipeline = r#"
[[pipelines.one.steps]]
name = "call"
provider = "p"
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}", "amount": 1}' }
"#;
    let text = format!(
        "[engine]\nmax_in_flight = 20\nbatch = 20\n{}",
        config_text(
            &fresh.url,
            &sim.base_url(),
            N_CAP_PER_NODE * nodes as u32,
            &format!("rate_limits = [\"{N_LIMIT}/s\"]"),
            pipeline
        )
    );
    std::fs::write(dir.path().join("ballast.toml"), text).ok()?;
    // Enqueued for later: they fall due at once when every node is up.
    let later = now_ms() + 3_600_000;
    let records: Vec<NewRecord> = (0..n)
        .map(|i| NewRecord {
            pipeline: "one".into(),
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            pipeline_version: None,
            external_key: Some(format!("n-{i}")),
            input: json!({}),
            run_at: later,
        })
        .collect();
    for chunk in records.chunks(1_000) {
        fresh
            .db
            .create_records(chunk.to_vec(), now_ms())
            .await
            .ok()?;
    }
    let mut children = Vec::new();
    for i in 0..nodes {
        match serve_node(dir.path()).await {
            Some(node) => children.push(node),
            None => {
                println!("N  node {i} did not come up");
                return None;
            }
        }
    }
    let mut conn = sqlx::PgConnection::connect(&fresh.url).await.ok()?;
    let started = Instant::now();
    sqlx::query("UPDATE records SET next_run_at = $1 WHERE state = 'pending'")
        .bind(now_ms())
        .execute(&mut conn)
        .await
        .ok()?;
    sqlx::query("SELECT pg_notify('ballast_work', '')")
        .execute(&mut conn)
        .await
        .ok()?;
    loop {
        let counts = fresh.db.state_counts().await.ok()?;
        let done: i64 = counts
            .iter()
            .filter(|c| c.state.is_at_rest())
            .map(|c| c.count)
            .sum();
        if done >= n as i64 {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            println!("N  not at rest after 600 s: {counts:?}");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed().as_secs_f64();
    drop(children);
    let stats = sim.stats();
    sim.stop();
    drop(conn);
    fresh.drop_now().await;
    Some((n as f64 / took, stats.max_per_second, stats.max_in_flight))
}

/// A `ballast serve` process on the configuration in `dir`, once it
/// answers `/readyz` (within 30 s); killed when dropped.
async fn serve_node(dir: &std::path::Path) -> Option<KillOnDrop> {
    let port = free_port()?;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_ballast"))
        .current_dir(dir)
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .env("BALLAST_ADMIN_PASSWORD", "bench-nodes-admin-pw")
        .env("BALLAST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let node = KillOnDrop(child);
    let ready = format!("http://127.0.0.1:{port}/readyz");
    for _ in 0..300 {
        if reqwest::get(&ready).await.is_ok_and(|r| r.status() == 200) {
            return Some(node);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// N's concurrency cap per node (the cluster's is this times the nodes,
/// exactly their need) and its rate limit per second (for the cluster).
const N_CAP_PER_NODE: u32 = 20;
const N_LIMIT: u32 = 2_000;

/// A child process killed when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn now_ms() -> i64 {
    use ballast::domain::Clock;
    ballast::domain::SystemClock.now_ms()
}

/// This process's CPU time (user + system), in seconds.
fn cpu_seconds() -> f64 {
    resting::cpu_of(std::process::id())
}

struct Run {
    processed_per_s: f64,
    cpu_per_1000: f64,
    enqueue_per_s: f64,
    batch_enqueue_per_s: f64,
    /// Calls per second over whole seconds: a sliding one-second window may
    /// hold `limit` calls in any second, so over `t` seconds at most
    /// `limit × ceil(t)` calls are allowed.
    calls_per_whole_s: f64,
    max_per_second: u32,
    /// Simulator requests per record (every exchange is an attempt).
    requests_per_record: f64,
    /// This process's peak RSS during the run, MiB (reset at its start).
    peak_rss_mib: f64,
    /// Records parked at the end, as a share of all.
    parked_share: f64,
}

/// The engine's claim batch in A, A' and the backlog runs.
const A_BATCH: u32 = 500;
/// Records per batch enqueue in A: the most one call takes
/// (`store::MAX_BATCH`), as graphile-worker's figure is taken with 1,000
/// jobs per `addJobs`.
const ENQUEUE_BATCH: usize = ballast::store::MAX_BATCH;
/// Records in flight in A, A' and the backlog runs.
const A_IN_FLIGHT: usize = 1_000;

/// One measured run's set-up.
#[derive(Clone)]
struct Setup {
    backend: Backend,
    n: usize,
    provider: Provider,
    in_flight: usize,
    /// Records claimed per round trip (`engine.batch`).
    batch: u32,
    rate_limit: Option<&'static str>,
    /// Half the records enqueued one by one (measured), the rest in batches;
    /// otherwise all in batches.
    single_enqueue: bool,
    kind: Kind,
    /// The provider declared `at_most_once` (an intent written before each
    /// call; the chain's render step looks its job up when unsure).
    at_most_once: bool,
    /// The search indexer runs beside the engine (as it does by default).
    search_index: bool,
}

/// Resets this process's peak RSS (`VmHWM`) to its current RSS.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak RSS since the last reset, MiB.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Enqueues the records, runs the engine until all succeeded.
async fn run_once(setup: &Setup) -> Option<Run> {
    let Setup {
        backend,
        n,
        ref provider,
        in_flight,
        batch,
        rate_limit,
        single_enqueue,
        kind,
        at_most_once,
        search_index,
    } = *setup;
    let fresh = fresh(backend).await?;
    let sim = match provider {
        Provider::InProcess => None,
        p => Some(Running::start(p).await?),
    };
    let base = sim
        .as_ref()
        .map_or("http://in-process.invalid".to_owned(), Running::base_url);
    let cfg = Arc::new(config(
        &fresh.url,
        &base,
        in_flight as u32,
        rate_limit,
        kind,
        at_most_once,
    ));
    let pipeline = kind.pipeline();
    let mut opts = EngineOptions::new(format!("bench-{}", uuid::Uuid::new_v4().simple()));
    opts.max_in_flight = in_flight;
    opts.batch = batch;
    opts.search_index = search_index;
    if matches!(provider, Provider::InProcess) {
        opts.in_process = Some(match kind {
            Kind::Waiting => InProcess(Arc::new(StillRunning)),
            _ => InProcess(Arc::new(Ok200)),
        });
    }
    let engine = Engine::new(fresh.db.clone(), cfg, opts).await.ok()?;
    // Half the records one by one, half in batches of ENQUEUE_BATCH.
    let half = if single_enqueue { n / 2 } else { 0 };
    let started = Instant::now();
    for i in 0..half {
        engine.enqueue(one_step(pipeline, i)).await.ok()?;
    }
    let enqueue_per_s = half as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let profiling = pg_profiling(setup);
    if profiling {
        // The batch enqueue profiled on its own, then the processing.
        pgprofile::settle(&fresh.url)
            .await
            .expect("pg-profile settle");
        pgprofile::reset(&fresh.url)
            .await
            .expect("pg-profile reset");
    }
    let started = Instant::now();
    // One record of `n` items.
    let mut i = if kind == Kind::Items {
        let items: Vec<usize> = (0..n).collect();
        let one = Enqueue::new(pipeline, Some("items"), json!({ "items": items }));
        engine.enqueue(one).await.ok()?;
        n
    } else {
        half
    };
    while i < n {
        let end = (i + ENQUEUE_BATCH).min(n);
        let items = (i..end).map(|k| one_step(pipeline, k)).collect();
        engine.enqueue_batch(items).await.ok()?;
        i = end;
    }
    let batch_enqueue_per_s = (n - half) as f64 / started.elapsed().as_secs_f64();
    if profiling {
        // Idle connections hand in their table counters up to 10 s late.
        tokio::time::sleep(Duration::from_secs(11)).await;
        match pgprofile::report(&fresh.url, n - half, &[]).await {
            Ok(r) => println!(
                "PostgreSQL per record, batch enqueue of {} ({ENQUEUE_BATCH} per call, this run):\n{r}",
                n - half
            ),
            Err(e) => eprintln!("pg-profile: {e}"),
        }
        pgprofile::settle(&fresh.url)
            .await
            .expect("pg-profile settle");
        pgprofile::reset(&fresh.url)
            .await
            .expect("pg-profile reset");
    }
    let stop = CancellationToken::new();
    let cpu0 = cpu_seconds();
    reset_peak_rss();
    let started = Instant::now();
    let runner = tokio::spawn({
        let (engine, stop) = (engine.clone(), stop.clone());
        async move { engine.run(stop, Duration::from_secs(5)).await }
    });
    loop {
        let done: i64 = fresh
            .db
            .state_counts()
            .await
            .ok()?
            .iter()
            .filter(|c| match kind {
                Kind::One => c.state == RecordState::Succeeded,
                Kind::Items => c.state == RecordState::Succeeded,
                Kind::Chain => c.state.is_at_rest(),
                Kind::Waiting => c.state == RecordState::Waiting,
            })
            .map(|c| c.count)
            .sum();
        // The one record of items stands for its `n` items.
        let done = if kind == Kind::Items {
            done * n as i64
        } else {
            done
        };
        if done as usize >= n {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            eprintln!("bench: gave up after 10 minutes with {done}/{n} done");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let peak_rss_mib = peak_rss_mib();
    let parked: i64 = fresh
        .db
        .state_counts()
        .await
        .ok()?
        .iter()
        .filter(|c| c.state == RecordState::Parked)
        .map(|c| c.count)
        .sum();
    stop.cancel();
    let _ = runner.await;
    if profiling {
        fresh.db.close().await;
        // The benchmark's own polling of the counters is left out.
        let skip = ["FROM record_counts"];
        match pgprofile::report(&fresh.url, n, &skip).await {
            Ok(r) => println!(
                "PostgreSQL per record, processing {n} (A, search indexer {}, this run):\n{r}",
                if search_index { "on" } else { "off" }
            ),
            Err(e) => eprintln!("pg-profile: {e}"),
        }
    }
    let stats = sim.and_then(Running::stop);
    fresh.drop_now().await;
    Some(Run {
        processed_per_s: n as f64 / took,
        cpu_per_1000: cpu / n as f64 * 1000.0,
        enqueue_per_s,
        batch_enqueue_per_s,
        calls_per_whole_s: stats
            .as_ref()
            .map_or(0.0, |s| s.requests as f64 / took.ceil()),
        max_per_second: stats.as_ref().map_or(0, |s| s.max_per_second),
        requests_per_record: stats.map_or(0.0, |s| s.requests as f64 / n as f64),
        peak_rss_mib,
        parked_share: parked as f64 / n as f64,
    })
}

#[derive(Clone)]
enum Provider {
    InProcess,
    Sim(Box<Profile>),
    /// `ballast sim` in its own process, answering every call in 50 ms
    /// (B's simulator, `--sim-process`).
    SimProcess,
}

/// `--sim-process`: B and B1000 call `ballast sim` in its own process, so
/// the engine and the provider do not share one runtime (nor, with the
/// bare client, do the client and the provider).
static SIM_PROCESS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// A free port on 127.0.0.1 (free when asked: a child process binds it).
fn free_port() -> Option<u16> {
    Some(
        std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port(),
    )
}

/// The simulator a run calls: in this process, or B's as `ballast sim
/// --profile clean --seed 2 --latency 50ms` in its own (stopped when
/// dropped).
enum Running {
    Here(SimHandle),
    Apart { _child: KillOnDrop, base: String },
}

impl Running {
    /// `None` for the in-process provider (no simulator), or when one
    /// could not be started.
    async fn start(provider: &Provider) -> Option<Running> {
        match provider {
            Provider::InProcess => None,
            Provider::Sim(profile) => Some(Running::Here(
                SimHandle::spawn((**profile).clone()).await.ok()?,
            )),
            Provider::SimProcess => {
                let port = free_port()?;
                let child = std::process::Command::new(env!("CARGO_BIN_EXE_ballast"))
                    .args([
                        "sim",
                        "--profile",
                        "clean",
                        "--seed",
                        "2",
                        "--latency",
                        "50ms",
                    ])
                    .args(["--port", &port.to_string()])
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .ok()?;
                let child = KillOnDrop(child);
                for _ in 0..500 {
                    if tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .is_ok()
                    {
                        return Some(Running::Apart {
                            _child: child,
                            base: format!("http://127.0.0.1:{port}"),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                eprintln!("bench: `ballast sim` did not listen on {port}");
                None
            }
        }
    }

    fn base_url(&self) -> String {
        match self {
            Running::Here(s) => s.base_url(),
            Running::Apart { base, .. } => base.clone(),
        }
    }

    /// What the simulator counted (in this process only), then stopped.
    fn stop(self) -> Option<ballast::sim::StatsFigures> {
        match self {
            Running::Here(s) => {
                let stats = s.stats();
                s.stop();
                Some(stats)
            }
            Running::Apart { .. } => None,
        }
    }
}

/// B's and B1000's ceiling: a bare reqwest client (no engine, no database) sending
/// B's request (`POST /v1/charge`, a fresh idempotency key each) `n` times,
/// `in_flight` at once, to a simulator like B1000's (`provider`):
/// requests/s.
async fn bare_client(n: usize, in_flight: usize, provider: &Provider) -> Option<f64> {
    let sim = Running::start(provider).await?;
    let base = sim.base_url();
    let url = format!("{base}/v1/charge");
    let client = reqwest::Client::new();
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        let (client, next, url) = (client.clone(), next.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i as usize >= n {
                    break;
                }
                let sent = client
                    .post(&url)
                    .header("Idempotency-Key", format!("bare-{i}"))
                    .json(&json!({ "ref": format!("bare-{i}"), "amount": 1 }))
                    .send()
                    .await;
                if let Ok(r) = sent {
                    let _ = r.bytes().await;
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    sim.stop();
    Some(rate)
}

fn median_spread(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    let m = v[v.len() / 2];
    if v.len() == 1 {
        format!("{m:.0}")
    } else {
        format!("{m:.0} ({:.0}–{:.0})", v[0], v[v.len() - 1])
    }
}

fn median_spread_f(mut v: Vec<f64>, digits: usize) -> String {
    v.sort_by(f64::total_cmp);
    let m = v[v.len() / 2];
    if v.len() == 1 {
        format!("{m:.digits$}")
    } else {
        format!(
            "{m:.digits$} ({:.digits$}–{:.digits$})",
            v[0],
            v[v.len() - 1]
        )
    }
}

/// The value of `flag` in `args`: `--flag value` or `--flag=value`.
fn flag_value(args: &[String], flag: &str) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix(&format!("{flag}="))
            .map(str::to_owned)
            .or_else(|| (a == flag).then(|| args.get(i + 1).cloned()).flatten())
    })
}

/// Which scenarios and backends to run: `--only A,B1000` and
/// `--backend sqlite` narrow a run (for profiling one figure).
struct Filter {
    only: Option<Vec<String>>,
    backend: Option<String>,
}

impl Filter {
    fn from_args(args: &[String]) -> Filter {
        Filter {
            only: flag_value(args, "--only").map(|v| v.split(',').map(str::to_owned).collect()),
            backend: flag_value(args, "--backend"),
        }
    }

    fn wants(&self, scenario: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|s| s == scenario))
    }

    /// Named in `--only`: the scenarios too long for every run (W0, W).
    fn names(&self, scenario: &str) -> bool {
        self.only
            .as_ref()
            .is_some_and(|o| o.iter().any(|s| s == scenario))
    }

    fn wants_backend(&self, backend: Backend) -> bool {
        self.backend
            .as_deref()
            .is_none_or(|b| b == backend.as_str())
    }
}

/// The seed's pipelines (p0..p2, each `step0` then `step1`) and providers
/// (prov0..prov3), for the pipelines page. The node's engine finds nothing
/// due (the seed schedules its records in 2096) and idles beside the pages.
fn seeded_pipelines() -> String {
    let mut text = String::new();
    for p in 0..4 {
        text.push_str(&format!(
            "[providers.prov{p}]\nbase_url = \"http://127.0.0.1:9\"\n"
        ));
    }
    for p in 0..3 {
        text.push_str(&format!(
            "[[pipelines.p{p}.steps]]\nname = \"step0\"\nprovider = \"prov{p}\"\nrequest = {{ path = \"/a\" }}\n\
             [[pipelines.p{p}.steps]]\nname = \"step1\"\nprovider = \"prov{}\"\nneeds = [\"step0\"]\nrequest = {{ path = \"/b\" }}\n",
            p + 1
        ));
    }
    text
}

/// A day of `nodes` nodes' per-minute statistics for the seed's six
/// steps, as nodes that ran all day leave them (the minutes more than 61
/// minutes old folded into hours by their housekeeping): what the overview
/// and pipelines pages sum.
async fn seed_rollups(db: &Db, nodes: usize) {
    let now = ballast::domain::Clock::now_ms(&ballast::domain::SystemClock);
    let first = now - now.rem_euclid(60_000) - 24 * 3_600_000;
    let mut rows = Vec::new();
    for (m, node) in (0..=1440).flat_map(|m| (0..nodes).map(move |n| (m, n))) {
        for p in 0..3 {
            for step in 0..2 {
                let mut latency = vec![0; ballast::engine::stats::LATENCY_BUCKETS_MS.len()];
                latency[4] = 100;
                let mut run_latency = vec![0; ballast::engine::stats::RUN_BUCKETS_MS.len()];
                run_latency[3] = 80;
                rows.push(ballast::store::StepRollup {
                    minute: first + m * 60_000,
                    node: format!("bench-{node}"),
                    pipeline: format!("p{p}"),
                    step: format!("step{step}"),
                    provider: format!("prov{}", p + step),
                    calls: 100,
                    succeeded: 90,
                    retried: 10,
                    records_succeeded: 70,
                    records_parked: 2,
                    latency,
                    runs_succeeded: 75,
                    runs_failed: 3,
                    run_latency,
                    ..Default::default()
                });
            }
        }
    }
    for chunk in rows.chunks(1000) {
        db.save_rollups(chunk).await.unwrap();
    }
    db.compact_rollups(ballast::web::stats_view::compaction_cutoff(now))
        .await
        .unwrap();
}

/// E: the control plane over a store seeded with `n` records. Returns the
/// seeding time and, per page, p50 and p99 in ms over `requests` requests
/// from a client on loopback (one at a time, after one warm-up request).
async fn pages_at_scale(
    backend: Backend,
    n: i64,
    requests: usize,
) -> Option<(f64, Vec<(String, f64, f64)>)> {
    let fresh = fresh(backend).await?;
    let started = Instant::now();
    seed::seed(&fresh.url, backend, n).await.expect("seeding");
    let seeded = started.elapsed().as_secs_f64();
    let password = "bench-admin-password-0123";
    // Latency is measured here, not the API's rate limit.
    // SQLite runs one node; PostgreSQL is where several share the work.
    let nodes = match backend {
        Backend::Sqlite => 1,
        Backend::Postgres => 3,
    };
    seed_rollups(&fresh.db, nodes).await;
    let text = format!(
        "[database]\nurl = \"{}\"\n[server.limits]\napi_per_second = 100000\n{}",
        fresh.url,
        seeded_pipelines()
    );
    let mut config = Config::parse(&text, std::path::Path::new("bench.toml")).unwrap();
    config.server.admin_password = Some(ballast::config::Secret::new(password));
    config.validate(&|v| std::env::var(v).ok()).unwrap();
    // The search indexer reads every seeded event, as it would after an
    // upgrade, before the pages are timed (the serving node's own engine
    // then finds it caught up).
    let started = Instant::now();
    let indexer = Engine::new(
        fresh.db.clone(),
        Arc::new(config.clone()),
        EngineOptions::new("bench-indexer"),
    )
    .await
    .unwrap();
    let mut docs = 0;
    loop {
        let now = ballast::domain::Clock::now_ms(&ballast::domain::SystemClock);
        let turn = SearchIndexer::of(&indexer)
            .index_search_once(now)
            .await
            .unwrap()
            .unwrap();
        docs += turn.records;
        if !turn.more {
            break;
        }
    }
    drop(indexer);
    let indexed = started.elapsed().as_secs_f64();
    if backend == Backend::Postgres {
        // Autovacuum would analyse the new table; it is off here.
        sqlx::raw_sql("ANALYZE record_search")
            .execute(&sqlx::PgPool::connect(&fresh.url).await.unwrap())
            .await
            .unwrap();
    }
    eprintln!(
        "E {backend:?}: search index built in {indexed:.1} s ({docs} documents written, {:.0}/s)",
        docs as f64 / indexed
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(ballast::app::run(config, listener, shutdown.clone()));
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    for _ in 0..400 {
        if let Ok(r) = client.get(format!("{base}/readyz")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let login = client
        .post(format!("{base}/login"))
        .header("origin", &base)
        .form(&[("username", "admin"), ("password", password), ("next", "/")])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303, "bench login");
    let cookie = login
        .headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.contains("ballast_session="))
        .and_then(|v| v.split(';').next())
        .expect("a session cookie")
        .to_owned();
    let (token, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
    fresh
        .db
        .create_api_token(
            &ballast::store::NewApiToken {
                unmask: false,
                name: "bench".into(),
                token_hash: hash,
                prefix,
                role: ballast::domain::Role::Viewer,
                created_by: "bench".into(),
                actor: "bench".into(),
                expires_at: None,
                pipelines: ballast::domain::scope::Scope::all(),
            },
            ballast::domain::Clock::now_ms(&ballast::domain::SystemClock),
        )
        .await
        .unwrap();
    let parked = fresh
        .db
        .list_records(&ballast::store::RecordFilter {
            state: Some(RecordState::Parked),
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .items[0]
        .id;
    // The record page's live poll carries the version the page shows.
    let detail = client
        .get(format!("{base}/records/{parked}"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let version = detail
        .split("/live?v=")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the record page polls")
        .to_owned();
    // The seed's shape: a tenth of the records in each state, pipelines
    // p0..p2, providers prov0..prov3, error codes on failed and parked.
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
            format!("/records?before={}", n / 100),
        ),
        // No record is both succeeded and carrying an error code: an index
        // walk that finds nothing to stop at (bounded by the scan budget).
        (
            "records, filter matching nothing",
            "/records?state=succeeded&error_code=http_5xx".to_owned(),
        ),
        ("record detail", format!("/records/{parked}")),
        // Six steps' figures from a day of rollups, and the records at
        // each step now from the counters.
        ("pipelines", "/pipelines".to_owned()),
        // What an open record page costs while its record is quiet: one
        // of these every 3 s (204, nothing rendered).
        (
            "record page's live poll, unchanged",
            format!("/records/{parked}/live?v={version}"),
        ),
        // Word search: a word in a fifth of the records (the newest 50 of
        // 200,000), two words (held together by a tenth, or by none: each
        // word's every entry is read), a word of one record, a word of
        // none, a prefix.
        ("search, common word", "/search?q=Oslo".to_owned()),
        ("search, two words", "/search?q=Lisbon+exhausted".to_owned()),
        (
            "search, two words no record holds both",
            "/search?q=Oslo+exhausted".to_owned(),
        ),
        (
            "search, one record's word",
            format!("/search?q=user{}%40example.com", n / 3),
        ),
        ("search, no match", "/search?q=Reykjavik".to_owned()),
        ("search, prefix", "/search?q=Nair*".to_owned()),
        ("audit log", "/audit".to_owned()),
        ("API list", "/api/v1/records?limit=50".to_owned()),
    ];
    let mut out = Vec::new();
    for (name, path) in pages {
        let mut times = Vec::with_capacity(requests);
        for i in 0..=requests {
            let req = client.get(format!("{base}{path}"));
            let req = if path.starts_with("/api") {
                req.bearer_auth(&token)
            } else {
                req.header("cookie", &cookie)
            };
            let start = Instant::now();
            let r = req.send().await.unwrap();
            let want = if path.contains("/live?") { 204 } else { 200 };
            assert_eq!(r.status(), want, "{path}");
            r.bytes().await.unwrap();
            if i > 0 {
                times.push(start.elapsed().as_secs_f64() * 1000.0);
            }
        }
        times.sort_by(f64::total_cmp);
        let p = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        out.push((name.to_owned(), p(0.5), p(0.99)));
    }
    shutdown.cancel();
    let _ = server.await;
    fresh.drop_now().await;
    Some((seeded, out))
}

/// `runs` runs of `setup` and of `setup` with `at_most_once`, alternating,
/// so that both figures share the machine's moods.
async fn with_and_without_intents(runs: usize, setup: &Setup) -> (Vec<Run>, Vec<Run>) {
    let guarded = Setup {
        at_most_once: true,
        ..setup.clone()
    };
    let (mut plain, mut with) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        plain.extend(run_once(setup).await);
        with.extend(run_once(&guarded).await);
    }
    (plain, with)
}

async fn runs_of(runs: usize, setup: &Setup) -> Vec<Run> {
    let mut rs = Vec::new();
    for _ in 0..runs {
        if let Some(r) = run_once(setup).await {
            rs.push(r);
        }
    }
    rs
}

/// An OTLP/HTTP collector that takes every export and keeps only its
/// count, size and spans, on its own thread and runtime (as a collector
/// would be elsewhere): where `--traces` sends the spans.
fn trace_sink() -> (String, Arc<[AtomicU64; 3]>) {
    let seen: Arc<[AtomicU64; 3]> = Arc::default();
    let counted = seen.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("sink runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("sink listener");
            tx.send(listener.local_addr().expect("sink address"))
                .expect("sink address sent");
            let app = axum::Router::new().route(
                "/v1/traces",
                axum::routing::post(move |body: bytes::Bytes| async move {
                    use prost::Message as _;
                    counted[0].fetch_add(1, Ordering::Relaxed);
                    counted[1].fetch_add(body.len() as u64, Ordering::Relaxed);
                    let export = opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest::decode(body);
                    let spans: usize = export
                        .map(|e| e.resource_spans)
                        .unwrap_or_default()
                        .iter()
                        .flat_map(|r| &r.scope_spans)
                        .map(|s| s.spans.len())
                        .sum();
                    counted[2].fetch_add(spans as u64, Ordering::Relaxed);
                }),
            );
            axum::serve(listener, app).await.expect("sink serves");
        });
    });
    let addr = rx.recv().expect("sink started");
    (format!("http://{addr}"), seen)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // RUST_LOG=ballast::engine=debug shows claims and group commits.
    let log = std::env::var("RUST_LOG").ok();
    // `--traces`: every pass, step run and call exported over OTLP (all
    // sampled) to a collector in this process, as `[traces]` does.
    let traces = args.iter().any(|a| a == "--traces");
    let sink = traces.then(trace_sink);
    let telemetry = (log.is_some() || traces).then(|| {
        let config = sink.as_ref().map(|(url, _)| ballast::config::TracesConfig {
            endpoint: Some(url.clone()),
            ..Default::default()
        });
        let filter = tracing_subscriber::EnvFilter::new(log.as_deref().unwrap_or("warn"));
        let format = ballast::telemetry::LogFormat {
            filter,
            ansi: false,
            json: false,
        };
        ballast::telemetry::Telemetry::install(format, config.as_ref()).expect("logging")
    });
    let quick = args.iter().any(|a| a == "--quick");
    let _ = PG_PROFILE.set(args.iter().any(|a| a == "--pg-profile"));
    let _ = SIM_PROCESS.set(args.iter().any(|a| a == "--sim-process"));
    let _ = ENCRYPT.set(args.iter().any(|a| a == "--encrypt"));
    if let Some(n) = flag_value(&args, "--groups") {
        let _ = GROUPS.set(n.parse().expect("--groups N"));
    }
    let filter = Filter::from_args(&args);
    // `--runs N`: runs per figure (3, or 1 with --quick).
    let runs = flag_value(&args, "--runs")
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 3 });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if args.iter().any(|a| a == "--peer") {
        let n = if quick { 2_000 } else { 20_000 };
        rt.block_on(peer_profile(n));
        return;
    }
    rt.block_on(async move {
        println!(
            "ballast engine benchmark ({}; {} run(s) per figure; median (min–max))",
            if quick { "quick" } else { "full" },
            runs
        );
        println!(
            "machine: {} cores, {}; PostgreSQL {}",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            std::env::consts::ARCH,
            match pg_sslmode().as_str() {
                "disable" => "without TLS (sslmode=disable)".to_owned(),
                mode => format!("with sslmode={mode}"),
            }
        );
        let zero = {
            let mut p = Profile::clean(1);
            p.latency_scale = 0.0;
            p
        };
        let slow = {
            let mut p = Profile::clean(2);
            p.latency_scale = 1.0;
            p.latency_median = Duration::from_millis(50);
            p.latency_sigma = 0.0;
            p
        };
        let (n_a, n_b, n_b1000, n_c, backlog, n_d, n_f) = if quick {
            (2_000, 1_000, 4_000, 1_000, 20_000, 1_000, 10_000)
        } else {
            (20_000, 5_000, 20_000, 6_000, 200_000, 5_000, 100_000)
        };
        let (n_e, e_requests) = if quick {
            (100_000, 50)
        } else {
            (1_000_000, 200)
        };
        let chaos = Profile::chaos_scaled(42, 0.01);
        for backend in [Backend::Sqlite, Backend::Postgres] {
            if !filter.wants_backend(backend) {
                continue;
            }
            match fresh(backend).await {
                Some(probe) => probe.drop_now().await,
                None => {
                    println!("\n{}: SKIP (unreachable)", backend.as_str());
                    continue;
                }
            }
            println!("\n{} ", backend.as_str());
            if matches!(backend, Backend::Postgres) {
                println!("{}", pg_server().await);
            }
            println!(
                "{:<44} {:>22} {:>18} {:>18} {:>20}",
                "scenario", "records/s", "CPU s / 1000", "enqueue/s (single)", "enqueue/s (batch)"
            );
            let setup = |n, provider, in_flight, rate_limit, single_enqueue| Setup {
                backend,
                n,
                provider,
                in_flight,
                batch: 100,
                rate_limit,
                single_enqueue,
                kind: Kind::One,
                at_most_once: false,
                search_index: true,
            };
            // A and the backlog runs measure throughput: the engine tuned
            // for it (`engine.batch = 500`, `engine.max_in_flight = 1000`).
            let tuned = |mut s: Setup| {
                s.batch = A_BATCH;
                s
            };
            for (key, name, provider) in [
                (
                    "A",
                    format!("A  overhead, in-process, {n_a} records"),
                    Provider::InProcess,
                ),
                (
                    "A'",
                    format!("A' overhead, simulator on loopback, {n_a}"),
                    Provider::Sim(Box::new(zero.clone())),
                ),
            ] {
                if !filter.wants(key) {
                    continue;
                }
                let a = tuned(setup(n_a, provider, A_IN_FLIGHT, None, true));
                // A also without the search indexer beside it, interleaved:
                // what keeping the index costs.
                let (rs, unindexed) = if key == "A" {
                    let off = Setup {
                        search_index: false,
                        ..a.clone()
                    };
                    let (mut on, mut without) = (Vec::new(), Vec::new());
                    for _ in 0..runs {
                        on.extend(run_once(&a).await);
                        without.extend(run_once(&off).await);
                    }
                    (on, without)
                } else {
                    (runs_of(runs, &a).await, Vec::new())
                };
                for (rs, name) in [
                    (rs, name),
                    (unindexed, "   the same, search indexer off".to_owned()),
                ] {
                    if rs.is_empty() {
                        continue;
                    }
                    println!(
                        "{name:<44} {:>22} {:>18} {:>18} {:>20}",
                        median_spread(rs.iter().map(|r| r.processed_per_s).collect()),
                        median_spread_f(rs.iter().map(|r| r.cpu_per_1000).collect(), 2),
                        median_spread(rs.iter().map(|r| r.enqueue_per_s).collect()),
                        median_spread(rs.iter().map(|r| r.batch_enqueue_per_s).collect()),
                    );
                }
            }
            if filter.wants("backlog") {
                // The same work behind a small and a large queue: claims and
                // commits must not cost more with more records waiting.
                let mut rates = Vec::new();
                for n in [2_000, backlog] {
                    let rs = runs_of(
                        runs,
                        &tuned(setup(n, Provider::InProcess, A_IN_FLIGHT, None, false)),
                    )
                    .await;
                    let rate: Vec<f64> = rs.iter().map(|r| r.processed_per_s).collect();
                    if rate.is_empty() {
                        continue;
                    }
                    rates.push(median(&rate));
                    println!(
                        "{:<44} {:>22} {:>18}",
                        format!("A  with {n} queued (batch-enqueued)"),
                        median_spread(rate),
                        median_spread_f(rs.iter().map(|r| r.cpu_per_1000).collect(), 2),
                    );
                }
                if let [small, large] = rates[..] {
                    println!(
                        "{:<44} {:>22}",
                        "   large / small backlog",
                        format!("{:.2}", large / small)
                    );
                }
            }
            if filter.wants("I") {
                // A step for each of 1,000 items against 1,000 one-step
                // records, interleaved: the same calls, in-process, 100 at
                // once.
                let records = setup(1_000, Provider::InProcess, 100, None, false);
                let items = Setup {
                    kind: Kind::Items,
                    ..records.clone()
                };
                // And one record of 10,000 items: its peak RSS against the
                // 1,000 items' (memory flat in the number of items).
                let many = Setup {
                    n: 10_000,
                    ..items.clone()
                };
                let (mut r, mut it, mut it10k) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..runs {
                    r.extend(run_once(&records).await);
                    it.extend(run_once(&items).await);
                    it10k.extend(run_once(&many).await);
                }
                for (rs, name) in [
                    (&it, "I  1,000 items of one record, in-process"),
                    (&it10k, "   10,000 items of one record"),
                    (&r, "   1,000 one-step records, the same calls"),
                ] {
                    if rs.is_empty() {
                        continue;
                    }
                    println!(
                        "{name:<44} {:>22} {:>18} {:>18}",
                        median_spread(rs.iter().map(|r| r.processed_per_s).collect()),
                        median_spread_f(rs.iter().map(|r| r.cpu_per_1000).collect(), 2),
                        format!(
                            "{} MiB peak RSS",
                            median_spread(rs.iter().map(|r| r.peak_rss_mib).collect())
                        ),
                    );
                }
                if !r.is_empty() && !it.is_empty() {
                    let rate = |v: &[Run]| {
                        median(&v.iter().map(|r| r.processed_per_s).collect::<Vec<_>>())
                    };
                    let cpu =
                        |v: &[Run]| median(&v.iter().map(|r| r.cpu_per_1000).collect::<Vec<_>>());
                    println!(
                        "{:<44} {:>22} {:>18}",
                        "   items / records (medians)",
                        format!("{:.2}x the rate", rate(&it) / rate(&r)),
                        format!("{:.2}x the CPU", cpu(&it) / cpu(&r)),
                    );
                }
            }
            for (key, n, in_flight, ideal) in [
                ("B", n_b, 100, 2_000.0),
                ("B1000", n_b1000, 1_000, 20_000.0),
            ] {
                if !filter.wants(key) {
                    continue;
                }
                let simulator = if SIM_PROCESS.get().copied().unwrap_or(false) {
                    Provider::SimProcess
                } else {
                    Provider::Sim(Box::new(slow.clone()))
                };
                let b = setup(n, simulator, in_flight, None, key == "B");
                // B also with an intent written before each call.
                let (rs, guarded) = if key == "B" {
                    with_and_without_intents(runs, &b).await
                } else {
                    (runs_of(runs, &b).await, Vec::new())
                };
                for (plain, rs, name) in [
                    (
                        true,
                        rs,
                        format!("{key:<2} 50 ms latency, {in_flight} in flight, {n}"),
                    ),
                    (false, guarded, "   the same, at_most_once".to_owned()),
                ] {
                    if rs.is_empty() {
                        continue;
                    }
                    let rate: Vec<f64> = rs.iter().map(|r| r.processed_per_s).collect();
                    let ratio: Vec<f64> = rate.iter().map(|r| r / ideal * 100.0).collect();
                    println!(
                        "{name:<44} {:>22} {:>18}",
                        median_spread(rate.clone()),
                        format!("{}% of ideal", median_spread_f(ratio, 1)),
                    );
                    if plain && !rate.is_empty() {
                        // Its ceiling on this machine: the same calls
                        // without the engine or the database (for B, what
                        // the simulator's timer and loopback HTTP allow).
                        let mut bare = Vec::new();
                        for _ in 0..runs {
                            bare.extend(bare_client(n, in_flight, &b.provider).await);
                        }
                        if !bare.is_empty() {
                            let share = median(&rate) / median(&bare) * 100.0;
                            println!(
                                "{:<44} {:>22} {:>18}",
                                "   bare reqwest client, same simulator",
                                median_spread(bare.clone()),
                                format!(
                                    "{}% of ideal",
                                    median_spread_f(
                                        bare.iter().map(|b| b / ideal * 100.0).collect(),
                                        1
                                    )
                                ),
                            );
                            println!(
                                "{:<44} {:>22}",
                                "   Ballast / bare client (medians)",
                                format!("{share:.1}%")
                            );
                        }
                    }
                }
            }
            if filter.wants("C") {
                let rs = runs_of(
                    runs,
                    &setup(
                        n_c,
                        Provider::Sim(Box::new(zero.clone())),
                        256,
                        Some("200/s"),
                        true,
                    ),
                )
                .await;
                if !rs.is_empty() {
                    let frac: Vec<f64> = rs
                        .iter()
                        .map(|r| r.calls_per_whole_s / 200.0 * 100.0)
                        .collect();
                    let max = rs.iter().map(|r| r.max_per_second).max().unwrap_or(0);
                    println!(
                        "{:<44} {:>22} {:>18}",
                        format!("C  limit 200/s, {n_c} records"),
                        format!("{}% of limit", median_spread_f(frac, 1)),
                        format!("max {max} in 1 s"),
                    );
                }
            }
            if filter.wants("D") {
                let mut d = setup(
                    n_d,
                    Provider::Sim(Box::new(chaos.clone())),
                    256,
                    None,
                    false,
                );
                d.kind = Kind::Chain;
                // D also with `at_most_once`: uncertain charges park, an
                // uncertain render is looked up.
                let (rs, guarded) = with_and_without_intents(runs, &d).await;
                for (rs, name) in [
                    (rs, format!("D  3 steps under chaos, {n_d} records")),
                    (guarded, "   the same, at_most_once".to_owned()),
                ] {
                    if rs.is_empty() {
                        continue;
                    }
                    println!(
                        "{name:<44} {:>22} {:>18} {:>18}",
                        median_spread(rs.iter().map(|r| r.processed_per_s).collect()),
                        format!(
                            "{} calls/record",
                            median_spread_f(rs.iter().map(|r| r.requests_per_record).collect(), 2)
                        ),
                        format!(
                            "{}% parked",
                            median_spread_f(rs.iter().map(|r| r.parked_share * 100.0).collect(), 1)
                        ),
                    );
                }
            }
            if filter.wants("F") {
                let mut f = setup(n_f, Provider::InProcess, 256, None, false);
                f.kind = Kind::Waiting;
                let rs = runs_of(runs, &f).await;
                if !rs.is_empty() {
                    println!(
                        "{:<44} {:>22} {:>18}",
                        format!("F  {n_f} records waiting on polls"),
                        format!(
                            "{} MiB peak RSS",
                            median_spread(rs.iter().map(|r| r.peak_rss_mib).collect())
                        ),
                        format!(
                            "{} records/s",
                            median_spread(rs.iter().map(|r| r.processed_per_s).collect())
                        ),
                    );
                }
            }
            if filter.wants("N") && backend == Backend::Postgres {
                let n_n = if quick { 2_000 } else { 6_000 };
                let mut rates = Vec::new();
                for nodes in [1usize, 3] {
                    let mut rs = Vec::new();
                    let (mut busiest, mut most) = (0, 0);
                    for _ in 0..runs {
                        if let Some((rate, second, flying)) =
                            nodes_run(nodes, n_n * nodes, &slow).await
                        {
                            rs.push(rate);
                            busiest = busiest.max(second);
                            most = most.max(flying);
                        }
                    }
                    if rs.is_empty() {
                        println!("N  {nodes} node(s) failed");
                        continue;
                    }
                    rates.push(median(&rs));
                    let ideal = 400.0 * nodes as f64;
                    let cap = N_CAP_PER_NODE * nodes as u32;
                    println!(
                        "{:<44} {:>22} {:>18}",
                        format!("N  {nodes} serve process(es), 20 in flight each, 50 ms"),
                        median_spread(rs.clone()),
                        format!("{:.0}% of ideal", median(&rs) / ideal * 100.0),
                    );
                    println!(
                        "{:<44} {:>22} {:>18}",
                        "   at the simulator",
                        format!("most in flight {most} (cap {cap})"),
                        format!("max {busiest} in 1 s (limit {N_LIMIT})"),
                    );
                    // The limits are the point of the cluster's sharing: a
                    // figure bought by passing them is no figure.
                    assert!(most <= cap, "{most} calls in flight, cap {cap}");
                    assert!(
                        busiest <= N_LIMIT,
                        "{busiest} calls in 1 s, limit {N_LIMIT}"
                    );
                }
                if let [one, three] = rates[..] {
                    println!(
                        "{:<44} {:>22}",
                        "   three nodes / one node",
                        format!("{:.2}", three / one)
                    );
                }
            }
            if filter.wants("E") {
                match pages_at_scale(backend, n_e, e_requests).await {
                    Some((seeded, pages)) => {
                        println!(
                            "{:<44} {:>22}",
                            format!("E  {n_e} records seeded"),
                            format!("in {seeded:.1} s"),
                        );
                        for (name, p50, p99) in pages {
                            println!(
                                "{:<44} {:>22} {:>18}",
                                format!("E  {name}"),
                                format!("p50 {p50:.1} ms"),
                                format!("p99 {p99:.1} ms"),
                            );
                        }
                    }
                    None => println!("E  failed"),
                }
            }
            if filter.names("W0") {
                let window = Duration::from_secs(if quick { 20 } else { 60 });
                resting::report(backend, n_e as usize, runs, window).await;
            }
            if filter.names("W") {
                // Whole polling periods: each window sees every job polled.
                let window = Duration::from_secs(resting::POLL_EVERY_S * if quick { 1 } else { 2 });
                let pollers = n_e as usize / 10;
                resting::report_w(backend, n_e as usize, pollers, runs, window).await;
            }
        }
    });
    if let Some(t) = telemetry {
        t.shutdown();
    }
    if let Some((_, seen)) = sink {
        println!(
            "traces: {} spans received in {} exports ({} MiB); 3 a record (pass, step, call) \
             when none is dropped",
            seen[2].load(Ordering::Relaxed),
            seen[0].load(Ordering::Relaxed),
            seen[1].load(Ordering::Relaxed) >> 20
        );
    }
}
