//! Seeding a store with many records for measurements: shared by the
//! engine benchmark (scenario E) and the integration tests (`#[path]`
//! modules, so neither depends on the other's helpers).

use ballast::store::Backend;
use sqlx::Connection;

fn seed_sql(backend: Backend, n: i64) -> Vec<String> {
    let state = "CASE n % 10 WHEN 0 THEN 'succeeded' WHEN 1 THEN 'succeeded' WHEN 2 THEN 'succeeded' \
                 WHEN 3 THEN 'succeeded' WHEN 4 THEN 'failed' WHEN 5 THEN 'parked' WHEN 6 THEN 'cancelled' \
                 WHEN 7 THEN 'pending' WHEN 8 THEN 'retrying' ELSE 'waiting' END";
    let cols = "pipeline, external_key, state, input, next_run_at, step, provider, error_code, reason, created_at, updated_at";
    // Words to search for: a city shared by a fifth of the records, an
    // email address each of its own.
    let city = "CASE n % 5 WHEN 0 THEN 'Lisbon' WHEN 1 THEN 'Oslo' WHEN 2 THEN 'Nairobi' \
                WHEN 3 THEN 'Quito' ELSE 'Tromsø' END";
    let (source, input) = match backend {
        Backend::Sqlite => (
            format!(
                "(WITH RECURSIVE seq(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < {n}) SELECT n FROM seq)"
            ),
            format!("json_object('n', n, 'email', 'user' || n || '@example.com', 'city', {city})"),
        ),
        Backend::Postgres => (
            format!("(SELECT generate_series(1, {n}) AS n)"),
            format!(
                "jsonb_build_object('n', n, 'email', 'user' || n || '@example.com', 'city', {city})"
            ),
        ),
    };
    let records = format!(
        "INSERT INTO records ({cols}) SELECT 'p' || (n % 3), 'key-' || n, {state}, {input}, \
         CASE WHEN n % 10 IN (7, 8, 9) THEN 4000000000000 + n END, 'step' || (n % 2), 'prov' || (n % 4), \
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
    let steps = "INSERT INTO step_counts (pipeline, step, state, shard, n) SELECT pipeline, COALESCE(step, ''), state, 0, COUNT(*) FROM records GROUP BY pipeline, COALESCE(step, ''), state".to_owned();
    let mut all = vec![records, attempts];
    all.extend(events);
    all.push(counts);
    all.push(steps);
    all.push("ANALYZE".into());
    all
}

/// Seeds `n` records (a tenth in each state, those scheduled due in 2096, an input with a city and an
/// email address, three failed attempts each, a created event each, a
/// park event for the parked) and the counters, with a few set-based
/// statements; then `ANALYZE`. Not indexed for word search.
pub async fn seed(url: &str, backend: Backend, n: i64) -> Result<(), sqlx::Error> {
    let sqls = seed_sql(backend, n);
    match backend {
        Backend::Sqlite => run_all::<sqlx::SqliteConnection>(url, sqls).await,
        Backend::Postgres => run_all::<sqlx::PgConnection>(url, sqls).await,
    }
}

/// Runs `sqls` in order on one new connection to `url`.
async fn run_all<C>(url: &str, sqls: Vec<String>) -> Result<(), sqlx::Error>
where
    C: Connection,
    for<'c> &'c mut C: sqlx::Executor<'c, Database = C::Database>,
{
    let mut c = C::connect(url).await?;
    for s in sqls {
        sqlx::raw_sql(sqlx::AssertSqlSafe(s))
            .execute(&mut c)
            .await?;
    }
    c.close().await
}
