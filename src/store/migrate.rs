//! Versioned, reversible schema migrations, embedded in the binary: one
//! folder per backend under `migrations/`, the same version numbers in both.

use std::borrow::Cow;
use std::collections::BTreeMap;

use sqlx::SqlSafeStr;
use sqlx::migrate::{Migrate, Migration, MigrationType, Migrator};

use super::{Backend, Db, StoreError, StoreResult};

/// One migration as shipped: (version, description, up SQL, down SQL).
type Shipped = (i64, &'static str, &'static str, &'static str);

// `SQLITE` and `POSTGRES`, one entry per file pair under `migrations/`
// (made by `build.rs`). A new migration is a new pair of files in each
// folder, never an edit of a file that has landed.
include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

fn shipped(backend: Backend) -> &'static [Shipped] {
    match backend {
        Backend::Sqlite => SQLITE,
        Backend::Postgres => POSTGRES,
    }
}

/// The sqlx migrator for one backend.
pub fn migrator(backend: Backend) -> Migrator {
    let mut migrations = Vec::new();
    for (version, name, up, down) in shipped(backend) {
        for (kind, sql) in [
            (MigrationType::ReversibleUp, up),
            (MigrationType::ReversibleDown, down),
        ] {
            migrations.push(Migration::new(
                *version,
                Cow::Borrowed(*name),
                kind,
                sqlx::AssertSqlSafe(*sql).into_sql_str(),
                false,
            ));
        }
    }
    Migrator::with_migrations(migrations)
}

/// The newest schema version this binary knows.
pub fn latest_version(backend: Backend) -> i64 {
    shipped(backend).iter().map(|m| m.0).max().unwrap_or(0)
}

/// One line of `ballast migrate status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationStatus {
    pub version: i64,
    /// `None` for a version applied by a newer binary.
    pub description: Option<String>,
    pub applied: bool,
}

/// Every known and every applied migration, in version order.
pub async fn status(db: &Db) -> StoreResult<Vec<MigrationStatus>> {
    let applied: Vec<i64> = match db {
        Db::Sqlite(s) => {
            let mut conn = s.writer().acquire().await?;
            let exists: Option<String> = sqlx::query_scalar(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
            )
            .fetch_optional(&mut *conn)
            .await?;
            applied_versions(&mut *conn, exists.is_some()).await?
        }
        Db::Postgres(s) => {
            let mut conn = s.pool().acquire().await?;
            let exists: bool =
                sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
                    .fetch_one(&mut *conn)
                    .await?;
            applied_versions(&mut *conn, exists).await?
        }
    };
    let mut all: BTreeMap<i64, MigrationStatus> = shipped(db.backend())
        .iter()
        .map(|(v, name, _, _)| {
            (
                *v,
                MigrationStatus {
                    version: *v,
                    description: Some((*name).to_owned()),
                    applied: false,
                },
            )
        })
        .collect();
    for v in applied {
        all.entry(v)
            .or_insert(MigrationStatus {
                version: v,
                description: None,
                applied: true,
            })
            .applied = true;
    }
    Ok(all.into_values().collect())
}

/// Reads applied versions without creating the migrations table: creating it
/// here, outside sqlx's migration lock, would race two nodes starting at once.
async fn applied_versions<C: Migrate>(conn: &mut C, exists: bool) -> StoreResult<Vec<i64>> {
    if !exists {
        return Ok(Vec::new());
    }
    Ok(conn
        .list_applied_migrations("_sqlx_migrations")
        .await?
        .into_iter()
        .map(|m| m.version)
        .collect())
}

fn applied_set(status: &[MigrationStatus]) -> Vec<i64> {
    status
        .iter()
        .filter(|m| m.applied)
        .map(|m| m.version)
        .collect()
}

/// Applies pending migrations up to `to` (all when `None`); returns the
/// versions applied. Fails, changing nothing, when the database has a
/// migration this binary does not know (it is newer than the binary).
/// Migrated to the latest, the data keys are checked against the
/// database (`admit_keys`): a node that could not read its values, or
/// would seal with a key the database does not list, stops here.
pub async fn up(db: &Db, to: Option<i64>) -> StoreResult<Vec<i64>> {
    let applied = up_to(db, to).await?;
    if to.is_none_or(|t| t >= latest_version(db.backend())) {
        use crate::domain::Clock;
        super::admit_keys(db, &db.keyring(), crate::domain::SystemClock.now_ms()).await?;
    }
    Ok(applied)
}

async fn up_to(db: &Db, to: Option<i64>) -> StoreResult<Vec<i64>> {
    let now = status(db).await?;
    if let Some(unknown) = now.iter().find(|m| m.applied && m.description.is_none()) {
        return Err(StoreError::NewerSchema {
            version: unknown.version,
            known: latest_version(db.backend()),
        });
    }
    if let Db::Sqlite(s) = db {
        // Nothing pending: no write lock to wait for (a node restarting
        // beside a long write goes on; it meets the lock only if it writes).
        if !now
            .iter()
            .any(|m| !m.applied && to.is_none_or(|t| m.version <= t))
        {
            return Ok(Vec::new());
        }
        return up_sqlite(s.writer(), to).await;
    }
    let before = applied_set(&now);
    let m = migrator(db.backend());
    match (db, to) {
        (Db::Sqlite(s), None) => m.run(s.writer()).await?,
        (Db::Sqlite(s), Some(t)) => m.run_to(t, s.writer()).await?,
        (Db::Postgres(s), _) => pg_migrate(s.pool(), m, Run::Up(to)).await?,
    }
    let after = applied_set(&status(db).await?);
    Ok(after.into_iter().filter(|v| !before.contains(v)).collect())
}

/// Which way [`pg_migrate`] goes.
enum Run {
    Up(Option<i64>),
    Down(i64),
}

/// The migrator on PostgreSQL, on a connection of its own, closed after:
/// when a migration fails, sqlx's migrator returns without releasing its
/// advisory lock, which a connection given back to the pool would keep
/// held, every later migration waiting on it (a refused down migration,
/// such as 27's while a data key is in use, did).
async fn pg_migrate(pool: &sqlx::PgPool, m: Migrator, run: Run) -> StoreResult<()> {
    let own = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let done = match run {
        Run::Up(None) => m.run(&own).await,
        Run::Up(Some(t)) => m.run_to(t, &own).await,
        Run::Down(t) => m.undo(&own, t).await,
    };
    own.close().await;
    Ok(done?)
}

/// [`up`] on SQLite, whose sqlx migrator takes no lock: two processes
/// starting on a fresh file would both apply migration 1, and one would
/// fail. Here every pending migration is applied in one `BEGIN IMMEDIATE`
/// transaction (SQLite runs DDL in transactions), so a second process
/// waits for the first to finish, then finds the schema current. The
/// bookkeeping rows are sqlx's, so `status` and `down` read them as ever.
async fn up_sqlite(pool: &sqlx::SqlitePool, to: Option<i64>) -> StoreResult<Vec<i64>> {
    let mut conn = pool.acquire().await?;
    let mut wait = super::sqlite::BusyWait::new("migrating?");
    loop {
        match sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
            Ok(_) => break,
            Err(e) => wait.again(e)?,
        }
    }
    let applied = apply_sqlite(&mut conn, to).await;
    let done = match applied {
        Ok(v) => sqlx::query("COMMIT")
            .execute(&mut *conn)
            .await
            .map(|_| v)
            .map_err(StoreError::from),
        Err(e) => Err(e),
    };
    if done.is_err() {
        // Nothing half-applied stays: the whole run rolls back.
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
    }
    done
}

/// Inside the caller's write transaction: the pending migrations up to
/// `to`, applied with sqlx's bookkeeping; the versions applied.
async fn apply_sqlite(conn: &mut sqlx::SqliteConnection, to: Option<i64>) -> StoreResult<Vec<i64>> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
            version BIGINT PRIMARY KEY,
            description TEXT NOT NULL,
            installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
            success BOOLEAN NOT NULL,
            checksum BLOB NOT NULL,
            execution_time BIGINT NOT NULL
        )",
    )
    .execute(&mut *conn)
    .await?;
    let done: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations")
        .fetch_all(&mut *conn)
        .await?;
    let known = latest_version(Backend::Sqlite);
    if let Some(newer) = done.iter().copied().filter(|v| *v > known).max() {
        return Err(StoreError::NewerSchema {
            version: newer,
            known,
        });
    }
    let m = migrator(Backend::Sqlite);
    let mut applied = Vec::new();
    for migration in m.iter() {
        let wanted = to.is_none_or(|t| migration.version <= t);
        if !migration.migration_type.is_up_migration()
            || done.contains(&migration.version)
            || !wanted
        {
            continue;
        }
        sqlx::raw_sql(migration.sql.clone())
            .execute(&mut *conn)
            .await
            .map_err(|e| {
                StoreError::Migrate(sqlx::migrate::MigrateError::ExecuteMigration(
                    e,
                    migration.version,
                ))
            })?;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (?1, ?2, TRUE, ?3, -1)",
        )
        .bind(migration.version)
        .bind(migration.description.to_string())
        .bind(migration.checksum.to_vec())
        .execute(&mut *conn)
        .await?;
        applied.push(migration.version);
    }
    Ok(applied)
}

/// Reverts applied migrations newer than `to`; returns the versions reverted,
/// newest first.
pub async fn down(db: &Db, to: i64) -> StoreResult<Vec<i64>> {
    let before = applied_set(&status(db).await?);
    let m = migrator(db.backend());
    match db {
        Db::Sqlite(s) => m.undo(s.writer(), to).await?,
        Db::Postgres(s) => pg_migrate(s.pool(), m, Run::Down(to)).await?,
    }
    let after = applied_set(&status(db).await?);
    let mut reverted: Vec<i64> = before.into_iter().filter(|v| !after.contains(v)).collect();
    reverted.reverse();
    Ok(reverted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file in `migrations/<backend>` is embedded, with an up and a
    /// down, and both backends ship the same versions.
    #[test]
    fn every_migration_file_is_embedded() {
        for (backend, dir) in [(Backend::Sqlite, "sqlite"), (Backend::Postgres, "postgres")] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations")
                .join(dir);
            let mut files: Vec<String> = std::fs::read_dir(&path)
                .map(|d| {
                    d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            let mut expected: Vec<String> = shipped(backend)
                .iter()
                .flat_map(|(v, name, _, _)| {
                    [
                        format!("{v:04}_{name}.down.sql"),
                        format!("{v:04}_{name}.up.sql"),
                    ]
                })
                .collect();
            expected.sort();
            assert_eq!(files, expected, "migrations/{dir}");
        }
        let versions = |b| shipped(b).iter().map(|m| m.0).collect::<Vec<_>>();
        assert_eq!(versions(Backend::Sqlite), versions(Backend::Postgres));
    }
}
