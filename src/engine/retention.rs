//! Retention: finished records deleted after their pipeline's `retain`,
//! their attempts' excerpts and requests blanked after `retain_excerpts`.
//! One node at a time runs it (a task lease), in batches of one short
//! transaction each, so claims and commits go on between them; each run
//! that removed something leaves an audit entry saying what. `ballast
//! purge` runs the same, or shows it (`--dry-run`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Engine;
use super::supervisor::{HandBack, Loop};
use crate::config::Config;
use crate::domain::UnixMs;
use crate::store::{Db, PurgeRun, Purged, StoreError};

/// How often a node asks for the purge lease: once a minute, or four
/// times per shortest retention period if that is shorter (at most once a
/// second), so a short period is kept close to.
fn every_ms(config: &Config) -> i64 {
    let shortest = config
        .pipelines
        .values()
        .flat_map(|p| [p.retain, p.retain_excerpts])
        .flatten()
        .map(|d| i64::try_from(d.0.as_millis()).unwrap_or(i64::MAX))
        .min()
        .unwrap_or(i64::MAX);
    (shortest / 4).clamp(1_000, 60_000)
}
/// How long a run may hold it before another node may take over.
const LEASE_MS: i64 = 10 * 60_000;
/// Records deleted (or whose attempts are blanked) per transaction.
pub const BATCH: u32 = 500;
/// Batches in one background run, all pipelines together (the next run
/// goes on): a run stays well inside its lease.
const RUN_BATCHES: usize = 200;
const LEASE: &str = "purge";

/// What to purge.
#[derive(Debug, Clone, Default)]
pub struct PurgeOptions {
    /// Only this pipeline (configured or not: a pipeline removed from the
    /// configuration still has records).
    pub pipeline: Option<String>,
    /// Records finished longer ago than this, instead of each pipeline's
    /// `retain`.
    pub older_than: Option<Duration>,
    /// Count, delete nothing.
    pub dry_run: bool,
    /// Who runs it, for the audit entry.
    pub actor: String,
    /// At most this many batches in all (none: until done).
    pub max_batches: Option<usize>,
}

/// What a purge removed (or would), by pipeline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PurgeReport {
    pub pipelines: BTreeMap<String, Purged>,
    pub dry_run: bool,
}

impl PurgeReport {
    pub fn total(&self) -> Purged {
        Purged::sum(self.pipelines.values())
    }
}

/// One pipeline's cut-offs at `now`: records finished before the first
/// go, attempts of records finished before the second are blanked.
fn cutoffs(
    config: &Config,
    pipeline: &str,
    opts: &PurgeOptions,
    now: UnixMs,
) -> (Option<UnixMs>, Option<UnixMs>) {
    let ago = |d: Duration| now.saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let configured = config.pipelines.get(pipeline);
    let records = opts
        .older_than
        .or(configured.and_then(|p| p.retain).map(|d| d.0))
        .map(ago);
    let strip = configured.and_then(|p| p.retain_excerpts).map(|d| ago(d.0));
    (records, strip)
}

/// Purges (or counts, on a dry run) what retention says has gone. A run
/// that removes something has one audit entry, written with its first
/// batch and brought up to date with each next one (in the batch's
/// transaction), so it says what went even of a run cut short.
pub async fn purge(
    db: &Db,
    config: &Config,
    now: UnixMs,
    opts: &PurgeOptions,
) -> Result<PurgeReport, StoreError> {
    let names: Vec<String> = match &opts.pipeline {
        Some(p) => {
            if !config.pipelines.contains_key(p) && opts.older_than.is_none() {
                return Err(StoreError::Invalid(format!(
                    "pipeline `{p}` is not configured, so it has no `retain`: give --older-than"
                )));
            }
            vec![p.clone()]
        }
        None => config.pipelines.keys().cloned().collect(),
    };
    let mut report = PurgeReport {
        pipelines: BTreeMap::new(),
        dry_run: opts.dry_run,
    };
    let mut run = PurgeRun {
        event: None,
        actor: opts.actor.clone(),
        at: now,
        report: BTreeMap::new(),
    };
    // The run's batches are shared out: every pipeline (and, in each, the
    // deletion and the blanking) gets its part, so a pipeline with a
    // large backlog does not starve the others.
    let share = opts
        .max_batches
        .map_or(usize::MAX, |total| (total / names.len().max(1)).max(2));
    for name in names {
        let (records, strip) = cutoffs(config, &name, opts, now);
        if records.is_none() && strip.is_none() {
            continue;
        }
        let done = if opts.dry_run {
            db.count_purgeable(&name, records, strip).await?
        } else {
            purge_one(db, &name, (records, strip), share, &mut run).await?;
            run.report.get(&name).cloned().unwrap_or_default()
        };
        report.pipelines.insert(name, done);
    }
    if !run.total().is_empty() {
        if let Db::Sqlite(s) = db {
            // Freed pages go back to the file system (databases created
            // with incremental auto-vacuum); otherwise they are reused.
            s.reclaim_space().await?;
        }
    }
    Ok(report)
}

async fn purge_one(
    db: &Db,
    pipeline: &str,
    (records, strip): (Option<UnixMs>, Option<UnixMs>),
    share: usize,
    run: &mut PurgeRun,
) -> Result<(), StoreError> {
    let each = if records.is_some() && strip.is_some() {
        share.div_ceil(2)
    } else {
        share
    };
    if let Some(before) = records {
        for _ in 0..each {
            let (batch, event) = db.purge_finished(pipeline, before, BATCH, run).await?;
            run.record(pipeline, &batch, event);
            if batch.records == 0 {
                break;
            }
            // Claims and commits get the database between batches.
            tokio::task::yield_now().await;
        }
    }
    if let Some(before) = strip {
        for _ in 0..each {
            let (n, more, event) = db.strip_bodies(pipeline, before, BATCH, run).await?;
            let batch = Purged {
                stripped: n,
                ..Purged::default()
            };
            run.record(pipeline, &batch, event);
            if !more {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

/// The purge loop: runs the purge on whichever node holds its lease, once
/// a minute (or more often for short retention periods).
pub struct Purger {
    engine: Engine,
}

impl Loop for Purger {
    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        loop {
            // Read each time: a reload may set or clear a `retain`.
            let config = i.config();
            let retains = config
                .pipelines
                .values()
                .any(|p| p.retain.is_some() || p.retain_excerpts.is_some());
            let every = every_ms(&config);
            let now = i.clock.now_ms();
            let purged = if retains {
                self.purge_once(now).await.map(|_| ())
            } else {
                Ok(())
            };
            if let Err(e) = purged {
                tracing::warn!(error = %e, "retention purge failed; trying again later");
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = i.clock.sleep_until(now + every) => {}
            }
        }
    }

    /// A purge cut short rolls its batch back; its lease goes back so
    /// another node need not wait the lease out.
    fn hand_back(&self) -> Option<HandBack> {
        let engine = self.engine.clone();
        Some(Box::pin(async move {
            let i = &engine.inner;
            if let Err(e) = i.db.release_task_lease(LEASE, &i.opts.node_id).await {
                tracing::warn!(error = %e, "could not give the purge lease back; it lapses");
            }
        }))
    }
}

impl Purger {
    /// The purge loop of `engine`.
    pub fn of(engine: &Engine) -> Purger {
        Purger {
            engine: engine.clone(),
        }
    }

    /// One background purge at `now`, if this node gets the lease: returns
    /// what it removed (`None`: another node holds the lease).
    pub async fn purge_once(&self, now: UnixMs) -> Result<Option<PurgeReport>, StoreError> {
        let i = &self.engine.inner;
        let node = &i.opts.node_id;
        if !i
            .db
            .take_task_lease(LEASE, node, now + LEASE_MS, now)
            .await?
        {
            return Ok(None);
        }
        let opts = PurgeOptions {
            actor: "system".into(),
            max_batches: Some(RUN_BATCHES),
            ..PurgeOptions::default()
        };
        let report = purge(&i.db, &i.config(), now, &opts).await;
        let released = i.db.release_task_lease(LEASE, node).await;
        let report = report?;
        released?;
        let total = report.total();
        if !total.is_empty() {
            tracing::info!(
                records = total.records,
                attempts = total.attempts,
                events = total.events,
                stripped = total.stripped,
                "retention purge"
            );
        }
        Ok(Some(report))
    }
}
