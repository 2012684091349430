//! Migrations go up, down to zero and up again on both backends, and a
//! database migrated by a newer binary is refused.

use ballast::store::{Backend, NewRecord, StoreError, migrate};

use crate::helpers::TestDb;

/// Runs one statement on `t` outside the store: `sqlite` or `postgres`.
async fn execute(t: &TestDb, sqlite: &'static str, postgres: &'static str) {
    match &t.db {
        ballast::store::Db::Sqlite(_) => t.execute(sqlite).await,
        ballast::store::Db::Postgres(_) => t.execute(postgres).await,
    };
}

async fn up_down_up(backend: Backend) {
    let Some(t) = TestDb::new(backend, "up_down_up").await else {
        return;
    };
    let db = &t.db;
    let latest = migrate::latest_version(backend);
    assert!(latest >= 1);
    let status = migrate::status(db).await.unwrap();
    assert!(status.iter().all(|m| !m.applied), "{status:?}");

    let applied = migrate::up(db, None).await.unwrap();
    assert_eq!(applied.last(), Some(&latest));
    assert!(
        migrate::up(db, None).await.unwrap().is_empty(),
        "up is idempotent"
    );
    let rec = NewRecord {
        pipeline: "p".into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: None,
        input: serde_json::json!({}),
        run_at: 0,
    };
    db.create_record(rec.clone(), 0).await.unwrap();

    let reverted = migrate::down(db, 0).await.unwrap();
    assert_eq!(reverted.first(), Some(&latest), "newest first");
    assert!(
        migrate::status(db)
            .await
            .unwrap()
            .iter()
            .all(|m| !m.applied)
    );
    let gone = db.create_record(rec.clone(), 0).await;
    assert!(
        matches!(gone, Err(StoreError::Database(_))),
        "tables are gone: {gone:?}"
    );

    assert_eq!(migrate::up(db, None).await.unwrap().last(), Some(&latest));
    let again = db.create_record(rec, 0).await.unwrap();
    assert_eq!(again.record.id, 1, "a clean schema starts ids over");
    assert!(migrate::status(db).await.unwrap().iter().all(|m| m.applied));
}

async fn newer_database_is_refused(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "newer_database_is_refused").await else {
        return;
    };
    // Pretend a newer ballast applied version 9999.
    let sql = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
               VALUES (9999, 'from the future', TRUE, X'00', 0)";
    let sql_pg = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
               VALUES (9999, 'from the future', TRUE, '\\x00', 0)";
    execute(&t, sql, sql_pg).await;
    let status = migrate::status(&t.db).await.unwrap();
    let future = status.iter().find(|m| m.version == 9999).unwrap();
    assert!(future.applied && future.description.is_none());
    let err = migrate::up(&t.db, None).await.unwrap_err();
    assert_eq!(err.code(), "schema_too_new");
    assert!(err.to_string().contains("schema version 9999"), "{err}");
}

/// Migration 15 fills `step_counts` from the records already there.
async fn step_counts_are_backfilled(backend: Backend) {
    let Some(t) = TestDb::new(backend, "step_backfill").await else {
        return;
    };
    migrate::up(&t.db, Some(14)).await.unwrap();
    let rows = "INSERT INTO records (pipeline, external_key, state, input, step, next_run_at, created_at, updated_at) VALUES \
                ('p', 'k1', 'succeeded', '{}', 'b', NULL, 1, 1), ('p', 'k2', 'succeeded', '{}', 'b', NULL, 1, 1), \
                ('p', 'k3', 'parked', '{}', 'a', NULL, 1, 1), ('p', 'k4', 'pending', '{}', NULL, 1, 1, 1), \
                ('q', 'k5', 'failed', '{}', 'x', NULL, 1, 1)";
    execute(&t, rows, rows).await;
    migrate::up(&t.db, None).await.unwrap();
    let mut counted = t.db.step_counts().await.unwrap();
    counted.sort();
    let mut recounted = t.db.recount_steps().await.unwrap();
    recounted.sort();
    assert_eq!(counted, recounted);
    let n = |p: &str, step: &str, state: &str| {
        counted
            .iter()
            .find(|c| c.pipeline == p && c.step == step && c.state.as_str() == state)
            .map_or(0, |c| c.count)
    };
    assert_eq!(
        (
            n("p", "b", "succeeded"),
            n("p", "", "pending"),
            n("q", "x", "failed")
        ),
        (2, 1, 1)
    );
}

/// Going down past migration 17 keeps the folded hours' figures: each
/// hour row goes back as one minute row, beside a minute row of the same
/// hour written after the fold.
async fn hours_survive_going_down(backend: Backend) {
    use ballast::store::{HOUR_MS, StepRollup};
    let Some(t) = TestDb::new(backend, "hours_down").await else {
        return;
    };
    migrate::up(&t.db, None).await.unwrap();
    let row = |minute: i64, calls: i64| StepRollup {
        minute,
        node: "n".into(),
        pipeline: "p".into(),
        step: "s".into(),
        provider: "x".into(),
        calls,
        latency: vec![calls],
        run_latency: vec![0, calls],
        ..StepRollup::default()
    };
    t.db.save_rollups(&[
        row(HOUR_MS, 2),
        row(HOUR_MS + 60_000, 3),
        row(3 * HOUR_MS, 4),
    ])
    .await
    .unwrap();
    assert_eq!(t.db.compact_rollups(2 * HOUR_MS).await.unwrap(), 2);
    // A late minute at the hour's very start, not folded yet.
    t.db.save_rollups(&[row(HOUR_MS, 7)]).await.unwrap();
    migrate::down(&t.db, 16).await.unwrap();
    // Read back by the store (its hour table is gone: the statement
    // fails), so through the minute table alone.
    let table = "SELECT COUNT(*) FROM step_rollups WHERE minute = 3600001 AND calls = 5 \
                 AND latency = '[5]' AND run_latency = '[0,5]'";
    let found: i64 = match &t.db {
        ballast::store::Db::Sqlite(_) => {
            let pool = sqlx::SqlitePool::connect(&t.url).await.unwrap();
            sqlx::query_scalar(table).fetch_one(&pool).await.unwrap()
        }
        ballast::store::Db::Postgres(_) => {
            let pool = sqlx::PgPool::connect(&t.url).await.unwrap();
            sqlx::query_scalar(table).fetch_one(&pool).await.unwrap()
        }
    };
    assert_eq!(found, 1, "the hour as one minute row");
    migrate::up(&t.db, None).await.unwrap();
    let back = t.db.rollups_since(0).await.unwrap();
    assert_eq!(
        back.iter().map(|r| r.calls).sum::<i64>(),
        16,
        "2 + 3 + 4 + 7"
    );
}

#[tokio::test]
async fn sqlite_hours_survive_going_down() {
    hours_survive_going_down(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_hours_survive_going_down() {
    hours_survive_going_down(Backend::Postgres).await;
}

#[tokio::test]
async fn sqlite_step_counts_are_backfilled() {
    step_counts_are_backfilled(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_step_counts_are_backfilled() {
    step_counts_are_backfilled(Backend::Postgres).await;
}

#[tokio::test]
async fn sqlite_up_down_up() {
    up_down_up(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_up_down_up() {
    up_down_up(Backend::Postgres).await;
}

#[tokio::test]
async fn sqlite_newer_database_is_refused() {
    newer_database_is_refused(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_newer_database_is_refused() {
    newer_database_is_refused(Backend::Postgres).await;
}
