//! Where PostgreSQL spends its time per record (`-- --pg-profile`): the
//! statistics PostgreSQL keeps, reset before the measured phase and read
//! after it, divided by the records processed. Needs `pg_stat_statements`
//! in `shared_preload_libraries` (the figures say so when it is missing).
//!
//! - statements: calls, rows, execution and planning time, WAL bytes and
//!   buffers per statement (`pg_stat_statements`, top level only; planning
//!   is counted only with `pg_stat_statements.track_planning = on`, and
//!   the report says when it is off);
//! - tables: rows inserted, updated (and how many of those were HOT: no
//!   index touched), deleted (`pg_stat_user_tables`), and index entries
//!   written: each insert and each non-HOT update writes one entry in every
//!   index of its table (an upper bound where an index is partial);
//! - WAL: records, full-page images and bytes for the whole cluster
//!   (`pg_stat_wal`; nothing else should run meanwhile).
//!
//! The same report is made for graphile-worker's database when the
//! benchmark runs its peer (`-- --peer --pg-profile`), so the two read
//! side by side; the peer's script enqueues and sets up after the reset,
//! so its table rows and cluster WAL include that (its statements do not).

use sqlx::{Connection, PgConnection, Row};

/// Lets the enqueue's statistics land before a reset: a backend that
/// reported less than a second ago may hold its table and WAL counters for
/// up to 10 s (PostgreSQL 15's idle interval), and autovacuum's and a
/// checkpoint's work after a bulk insert would otherwise count as the
/// processing's. Vacuums, checkpoints, then waits those 10 s out.
pub async fn settle(url: &str) -> Result<(), sqlx::Error> {
    let mut c = PgConnection::connect(url).await?;
    sqlx::query("VACUUM ANALYZE").execute(&mut c).await?;
    sqlx::query("CHECKPOINT").execute(&mut c).await?;
    c.close().await?;
    tokio::time::sleep(std::time::Duration::from_secs(11)).await;
    Ok(())
}

/// Zeroes the statistics: statements and WAL for the cluster, tables for
/// the database at `url`.
pub async fn reset(url: &str) -> Result<(), sqlx::Error> {
    let mut c = PgConnection::connect(url).await?;
    sqlx::query("SELECT pg_stat_reset()")
        .execute(&mut c)
        .await?;
    sqlx::query("SELECT pg_stat_reset_shared('wal')")
        .execute(&mut c)
        .await?;
    let statements = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&mut c)
        .await;
    let statements = match statements {
        Ok(_) => sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&mut c)
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    if let Err(e) = statements {
        eprintln!(
            "pg-profile: no pg_stat_statements ({e}): add it to shared_preload_libraries; \
             statements not profiled"
        );
    }
    c.close().await
}

/// The report for the database at `url` over `n` records, leaving out the
/// statements whose text contains one of `skip` (the benchmark's own
/// polling, a peer's enqueue and set-up); a `skip` ending in `$` is a whole
/// statement's text.
pub async fn report(url: &str, n: usize, skip: &[&str]) -> Result<String, sqlx::Error> {
    use std::fmt::Write;
    let mut c = PgConnection::connect(url).await?;
    // Table counters reach the shared statistics when a backend's
    // transaction ends, at most once a second: wait them out.
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let n = n.max(1) as f64;
    let mut out = String::new();
    let statements = sqlx::query(
        "SELECT s.query, s.calls, s.rows, s.total_exec_time, s.wal_bytes::float8 AS wal,
                s.plans, s.total_plan_time,
                s.shared_blks_hit + s.shared_blks_read AS blks, s.shared_blks_dirtied AS dirtied
           FROM pg_stat_statements s
           JOIN pg_database d ON d.oid = s.dbid
          WHERE d.datname = current_database() AND s.toplevel
          ORDER BY s.total_exec_time DESC",
    )
    .fetch_all(&mut c)
    .await
    .unwrap_or_else(|e| {
        let _ = writeln!(out, "  (no statements: pg_stat_statements unreadable: {e})");
        Vec::new()
    });
    let kept: Vec<_> = statements
        .iter()
        .filter(|r| {
            let q: String = r.get("query");
            !skip.iter().any(|s| match s.strip_suffix('$') {
                Some(whole) => q.trim() == whole,
                None => q.contains(s),
            })
        })
        .collect();
    let (mut calls, mut rows, mut ms, mut wal, mut blks) = (0i64, 0i64, 0f64, 0f64, 0i64);
    let (mut plans, mut plan_ms) = (0i64, 0f64);
    for r in &kept {
        plans += r.get::<i64, _>("plans");
        plan_ms += r.get::<f64, _>("total_plan_time");
        calls += r.get::<i64, _>("calls");
        rows += r.get::<i64, _>("rows");
        ms += r.get::<f64, _>("total_exec_time");
        wal += r.get::<f64, _>("wal");
        blks += r.get::<i64, _>("blks");
    }
    let _ = writeln!(
        out,
        "  per record: {:.2} statements, {:.2} rows returned or written, {:.1} µs executing, \
         {:.0} B of WAL from statements, {:.1} buffers touched",
        calls as f64 / n,
        rows as f64 / n,
        ms * 1000.0 / n,
        wal / n,
        blks as f64 / n
    );
    let tracked: bool = sqlx::query_scalar(
        "SELECT coalesce(current_setting('pg_stat_statements.track_planning', true), 'off') = 'on'",
    )
    .fetch_one(&mut c)
    .await
    .unwrap_or(false);
    let _ = if tracked {
        writeln!(
            out,
            "  planning: {:.1} µs per record, {:.2} plans per statement executed",
            plan_ms * 1000.0 / n,
            plans as f64 / calls.max(1) as f64
        )
    } else {
        writeln!(
            out,
            "  planning: not counted (pg_stat_statements.track_planning is off)"
        )
    };
    let _ = writeln!(
        out,
        "  {:>8} {:>9} {:>8} {:>8} {:>9} {:>8}  statement (top 12 by time)",
        "calls/rec", "rows/call", "µs/rec", "plan µs", "WAL B/rec", "blk/call"
    );
    for r in kept.iter().take(12) {
        let q: String = r.get("query");
        let calls: i64 = r.get("calls");
        let one_line: String = q.split_whitespace().collect::<Vec<_>>().join(" ");
        let short: String = one_line.chars().take(110).collect();
        let _ = writeln!(
            out,
            "  {:>9.3} {:>9.1} {:>8.1} {:>8} {:>9.0} {:>8.1}  {short}",
            calls as f64 / n,
            r.get::<i64, _>("rows") as f64 / calls.max(1) as f64,
            r.get::<f64, _>("total_exec_time") * 1000.0 / n,
            if tracked {
                format!("{:.1}", r.get::<f64, _>("total_plan_time") * 1000.0 / n)
            } else {
                "-".to_owned()
            },
            r.get::<f64, _>("wal") / n,
            r.get::<i64, _>("blks") as f64 / calls.max(1) as f64,
        );
    }
    let tables = sqlx::query(
        "SELECT t.relname::text AS name, t.n_tup_ins, t.n_tup_upd, t.n_tup_hot_upd, t.n_tup_del,
                (SELECT count(*) FROM pg_index i WHERE i.indrelid = t.relid) AS indexes,
                (SELECT count(*) FROM pg_index i WHERE i.indrelid = t.relid
                    AND i.indpred IS NOT NULL) AS partial
           FROM pg_stat_user_tables t
          WHERE t.n_tup_ins + t.n_tup_upd + t.n_tup_del > 0
          ORDER BY t.n_tup_ins + t.n_tup_upd + t.n_tup_del DESC",
    )
    .fetch_all(&mut c)
    .await?;
    let _ = writeln!(
        out,
        "  {:<24} {:>8} {:>8} {:>6} {:>8} {:>8} {:>14}",
        "table", "ins/rec", "upd/rec", "HOT", "del/rec", "indexes", "index entries/rec"
    );
    let (mut written, mut entries) = (0f64, 0f64);
    for r in &tables {
        let ins = r.get::<i64, _>("n_tup_ins") as f64;
        let upd = r.get::<i64, _>("n_tup_upd") as f64;
        let hot = r.get::<i64, _>("n_tup_hot_upd") as f64;
        let del = r.get::<i64, _>("n_tup_del") as f64;
        let indexes = r.get::<i64, _>("indexes");
        let partial = r.get::<i64, _>("partial");
        let touched = (ins + upd - hot) * indexes as f64;
        written += ins + upd + del;
        entries += touched;
        let _ = writeln!(
            out,
            "  {:<24} {:>8.2} {:>8.2} {:>5.0}% {:>8.2} {:>8} {:>14.1}",
            r.get::<String, _>("name"),
            ins / n,
            upd / n,
            if upd > 0.0 { hot / upd * 100.0 } else { 0.0 },
            del / n,
            format!("{indexes} ({partial}p)"),
            touched / n,
        );
    }
    let wal_row =
        sqlx::query("SELECT wal_records, wal_fpi, wal_bytes::float8 AS bytes FROM pg_stat_wal")
            .fetch_one(&mut c)
            .await?;
    let _ = writeln!(
        out,
        "  rows written {:.2}/rec, index entries ≤ {:.1}/rec; cluster WAL {:.1} records, \
         {:.2} full pages, {:.0} B per record",
        written / n,
        entries / n,
        wal_row.get::<i64, _>("wal_records") as f64 / n,
        wal_row.get::<i64, _>("wal_fpi") as f64 / n,
        wal_row.get::<f64, _>("bytes") / n,
    );
    c.close().await?;
    Ok(out)
}
