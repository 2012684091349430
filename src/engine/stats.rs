//! Per-minute step statistics for the overview: attempts by outcome, a
//! latency histogram, and records finished, kept in memory per node and
//! written to `step_rollups` every few seconds. Each node writes only its
//! own rows (absolute values, so a rewrite is harmless), and the dashboard
//! sums them: no hot rows, no scans of the attempts table.
//!
//! Because a row is written whole, the recorder never starts a row for a
//! minute it has forgotten (that would overwrite the written row with a
//! part of it): an attempt counts in the minute it ended, and anything
//! dated before the minutes still held counts in the oldest held. Rows a
//! failed write left unsaved are given up after [`GIVE_UP_MS`], well
//! before the housekeeping folds their minute into its hour.

use std::sync::Mutex;
use std::time::Duration;

use indexmap::IndexMap;

use crate::domain::{Outcome, RecordState, UnixMs};
use crate::store::{Db, NewAttempt, StepRollup};

/// Upper bounds of the latency buckets, in milliseconds; the last bucket
/// holds everything slower.
pub const LATENCY_BUCKETS_MS: [i64; 14] = [
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    30_000,
    60_000,
    i64::MAX,
];

/// Upper bounds of the buckets of whole step runs (first call to end, polls
/// and backoff included), in milliseconds; the last holds everything slower.
pub const RUN_BUCKETS_MS: [i64; 15] = [
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    30_000,
    60_000,
    300_000,
    900_000,
    3_600_000,
    21_600_000,
    86_400_000,
    i64::MAX,
];

/// How often a node writes its figures.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);
/// How long rollups are kept.
pub const KEEP_MS: i64 = 8 * 24 * 3600 * 1000;

type Key = (UnixMs, String, String, String);

/// A [`Key`] borrowed (minute, pipeline, step, provider): a row is found
/// without building its key (it hashes as the key does).
#[derive(Hash)]
struct KeyRef<'a>(UnixMs, &'a str, &'a str, &'a str);

impl indexmap::Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, k: &Key) -> bool {
        self.0 == k.0 && self.1 == k.1 && self.2 == k.2 && self.3 == k.3
    }
}

/// How long rows whose writes failed are retried before they are given
/// up (minute rows are folded into hours 61 minutes at the earliest).
pub const GIVE_UP_MS: i64 = 30 * 60_000;

/// How long rows are held after their minute (and written again if they
/// change): a step that ends a few minutes after its minute began.
const HOLD_MS: i64 = 2 * 60_000;

/// This node's figures for the current and recent minutes.
pub struct StatsRecorder {
    node: String,
    held: Mutex<Held>,
}

/// The rows held, each with whether it changed since it was written.
#[derive(Default)]
struct Held {
    rows: IndexMap<Key, (StepRollup, bool)>,
    /// Every minute from this one on has its row held (if it has one); an
    /// older minute's row may have been written and forgotten.
    from: UnixMs,
}

fn minute(ms: UnixMs) -> UnixMs {
    ms - ms.rem_euclid(60_000)
}

/// The bucket index of a latency.
pub fn bucket(ms: i64) -> usize {
    bucket_in(&LATENCY_BUCKETS_MS, ms)
}

/// The index of the first of `bounds` at or above `ms` (the last if none).
pub fn bucket_in(bounds: &[i64], ms: i64) -> usize {
    bounds
        .iter()
        .position(|b| ms <= *b)
        .unwrap_or(bounds.len().saturating_sub(1))
}

/// How a step run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    Succeeded,
    Failed,
    /// It parked its record (counted with `records_parked`).
    Parked,
}

impl StatsRecorder {
    pub fn new(node: &str) -> Self {
        StatsRecorder {
            node: node.to_owned(),
            held: Mutex::new(Held {
                rows: IndexMap::new(),
                from: UnixMs::MIN,
            }),
        }
    }

    fn with_row(
        &self,
        at: UnixMs,
        pipeline: &str,
        step: &str,
        provider: &str,
        f: impl FnOnce(&mut StepRollup),
    ) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = minute(at).max(held.from);
        if let Some((row, dirty)) = held.rows.get_mut(&KeyRef(at, pipeline, step, provider)) {
            f(row);
            *dirty = true;
            return;
        }
        let key = (
            at,
            pipeline.to_owned(),
            step.to_owned(),
            provider.to_owned(),
        );
        let (row, dirty) = held.rows.entry(key).or_insert_with(|| {
            (
                StepRollup {
                    minute: at,
                    node: self.node.clone(),
                    pipeline: pipeline.to_owned(),
                    step: step.to_owned(),
                    provider: provider.to_owned(),
                    latency: vec![0; LATENCY_BUCKETS_MS.len()],
                    run_latency: vec![0; RUN_BUCKETS_MS.len()],
                    ..StepRollup::default()
                },
                true,
            )
        });
        f(row);
        *dirty = true;
    }

    /// Counts the attempts a commit wrote.
    pub fn attempts(&self, pipeline: &str, attempts: &[NewAttempt]) {
        for a in attempts {
            let provider = a.provider.as_deref().unwrap_or("");
            let ended = a.started_at.saturating_add(a.duration_ms.max(0));
            // An item's call counts for its step.
            let step = crate::domain::each::step_of(&a.step);
            self.with_row(ended, pipeline, step, provider, |r| {
                r.calls += 1;
                match a.outcome {
                    Outcome::Success | Outcome::Pending => r.succeeded += 1,
                    Outcome::Fail => r.failed += 1,
                    // Throttled calls are counted with the retried ones
                    // until the rollups have a column of their own.
                    Outcome::Retry | Outcome::Throttled => r.retried += 1,
                    Outcome::Unknown => r.unknown += 1,
                }
                if let Some(slot) = r.latency.get_mut(bucket(a.duration_ms)) {
                    *slot += 1;
                }
            });
        }
    }

    /// Counts a step run that ended at `at` after `duration_ms` (from its
    /// first call).
    pub fn run_ended(
        &self,
        at: UnixMs,
        pipeline: &str,
        step: &str,
        provider: &str,
        end: RunEnd,
        duration_ms: i64,
    ) {
        self.with_row(at, pipeline, step, provider, |r| {
            match end {
                RunEnd::Succeeded => r.runs_succeeded += 1,
                RunEnd::Failed => r.runs_failed += 1,
                RunEnd::Parked => {}
            }
            if let Some(slot) = r
                .run_latency
                .get_mut(bucket_in(&RUN_BUCKETS_MS, duration_ms))
            {
                *slot += 1;
            }
        });
    }

    /// Counts a record that came to rest at `step`.
    pub fn finished(
        &self,
        at: UnixMs,
        pipeline: &str,
        step: &str,
        provider: &str,
        state: RecordState,
    ) {
        self.with_row(at, pipeline, step, provider, |r| match state {
            RecordState::Succeeded => r.records_succeeded += 1,
            RecordState::Failed => r.records_failed += 1,
            RecordState::Parked => r.records_parked += 1,
            _ => {}
        });
    }

    /// Writes changed rows; forgets rows of minutes long past, and unsaved
    /// rows older than [`GIVE_UP_MS`].
    pub async fn flush(&self, db: &Db, now: UnixMs) {
        let dirty = self.take_dirty(now);
        if let Err(e) = db.save_rollups(&dirty).await {
            tracing::warn!(error = %e, rows = dirty.len(), "could not save statistics; retrying");
            self.unsaved(&dirty);
        }
    }

    /// Marks `rows` (taken by [`take_dirty`](Self::take_dirty)) to be
    /// written again: their write failed.
    fn unsaved(&self, rows: &[StepRollup]) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for r in rows {
            let key = KeyRef(r.minute, &r.pipeline, &r.step, &r.provider);
            if let Some((_, d)) = held.rows.get_mut(&key) {
                *d = true;
            }
        }
    }

    /// The rows changed since they were written (marked written), after
    /// forgetting rows of minutes long past and unsaved rows older than
    /// [`GIVE_UP_MS`].
    fn take_dirty(&self, now: UnixMs) -> Vec<StepRollup> {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let from = held.from.max(minute(now) - HOLD_MS);
        held.from = from;
        let mut given_up = 0;
        held.rows.retain(|k, (_, dirty)| {
            let keep = k.0 >= from || (*dirty && k.0 >= now - GIVE_UP_MS);
            given_up += usize::from(!keep && *dirty);
            keep
        });
        if given_up > 0 {
            tracing::warn!(rows = given_up, "gave up writing statistics rows");
        }
        held.rows
            .values_mut()
            .filter(|(_, d)| *d)
            .map(|(r, d)| {
                *d = false;
                r.clone()
            })
            .collect()
    }
}

/// The statistics flusher: writes this node's figures every
/// [`FLUSH_EVERY`] (the control plane purges old ones), and the last
/// seconds' figures once it has stopped.
pub struct StatsFlusher {
    engine: super::Engine,
}

impl StatsFlusher {
    /// The flusher of `engine`.
    pub fn of(engine: &super::Engine) -> StatsFlusher {
        StatsFlusher {
            engine: engine.clone(),
        }
    }

    /// Writes this node's statistics now (tests, shutdown).
    pub async fn flush(&self) {
        let i = &self.engine.inner;
        i.stats.flush(&i.db, i.clock.now_ms()).await;
    }
}

impl super::supervisor::Loop for StatsFlusher {
    /// It runs while the node hands back what it holds.
    const STOP: super::supervisor::Stop = super::supervisor::Stop::Last;

    async fn run(self, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(FLUSH_EVERY) => {}
            }
            self.flush().await;
        }
    }

    /// The last seconds' figures.
    fn hand_back(&self) -> Option<super::supervisor::HandBack> {
        let flusher = StatsFlusher::of(&self.engine);
        Some(Box::pin(async move { flusher.flush().await }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row is found by its borrowed key (no key built per count): the
    /// two hash alike and compare field by field.
    #[test]
    fn a_row_is_found_by_its_borrowed_key() {
        let mut rows: IndexMap<Key, u32> = IndexMap::new();
        rows.insert((60_000, "p".into(), "s".into(), "v".into()), 1);
        rows.insert((60_000, "p".into(), "sv".into(), "".into()), 2);
        assert_eq!(rows.get(&KeyRef(60_000, "p", "s", "v")), Some(&1));
        assert_eq!(rows.get(&KeyRef(60_000, "p", "sv", "")), Some(&2));
        assert_eq!(rows.get(&KeyRef(60_000, "p", "s", "")), None);
        assert_eq!(rows.get(&KeyRef(0, "p", "s", "v")), None);
    }

    #[test]
    fn buckets_cover_every_latency() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(5), 0);
        assert_eq!(bucket(6), 1);
        assert_eq!(bucket(999_999), LATENCY_BUCKETS_MS.len() - 1);
        assert_eq!(bucket(-1), 0);
    }

    fn attempt(at: UnixMs, outcome: Outcome, ms: i64) -> NewAttempt {
        NewAttempt {
            step: "fetch".into(),
            provider: Some("p".into()),
            attempt_no: 1,
            node: None,
            started_at: at,
            duration_ms: ms,
            http_status: Some(200),
            outcome,
            error_code: None,
            excerpt: None,
            request: None,
        }
    }

    #[test]
    fn forgotten_minutes_are_never_started_again() {
        let s = StatsRecorder::new("n1");
        s.attempts("pl", &[attempt(60_000, Outcome::Success, 5)]);
        let written = s.take_dirty(10 * 60_000);
        assert_eq!(written.len(), 1);
        assert_eq!(s.take_dirty(10 * 60_000), vec![], "nothing changed");
        // Minute 1 was written and forgotten: an attempt that started in
        // it and ran 30 s counts in the oldest minute still held (8),
        // never in a new row for minute 1 (which would overwrite the
        // written one with a part of it).
        s.attempts("pl", &[attempt(60_000, Outcome::Fail, 30_000)]);
        let rows = s.take_dirty(10 * 60_000);
        assert_eq!(rows.len(), 1);
        assert_eq!(
            (rows[0].minute, rows[0].calls, rows[0].failed),
            (8 * 60_000, 1, 1)
        );
        // A long call counts in the minute it ended.
        s.attempts("pl", &[attempt(9 * 60_000, Outcome::Success, 70_000)]);
        let rows = s.take_dirty(10 * 60_000);
        assert_eq!(rows[0].minute, 10 * 60_000);
    }

    #[test]
    fn unsaved_rows_are_given_up_after_a_while() {
        let s = StatsRecorder::new("n1");
        s.attempts("pl", &[attempt(0, Outcome::Success, 5)]);
        // Its writes fail: still held, and still offered, until it is
        // older than GIVE_UP_MS.
        let rows = s.take_dirty(60_000);
        s.unsaved(&rows);
        let rows = s.take_dirty(GIVE_UP_MS);
        assert_eq!(rows.len(), 1);
        s.unsaved(&rows);
        assert_eq!(s.take_dirty(GIVE_UP_MS + 60_000), vec![]);
        assert!(s.held.lock().unwrap().rows.is_empty());
    }

    #[test]
    fn attempts_fold_into_minute_rows() {
        let s = StatsRecorder::new("n1");
        let a = attempt;
        s.attempts(
            "pl",
            &[
                a(60_000, Outcome::Success, 7),
                a(60_500, Outcome::Retry, 300),
                a(120_000, Outcome::Success, 1),
            ],
        );
        let held = s.held.lock().unwrap();
        let rows = &held.rows;
        let first = &rows[&(60_000, "pl".to_owned(), "fetch".to_owned(), "p".to_owned())].0;
        assert_eq!((first.calls, first.succeeded, first.retried), (2, 1, 1));
        assert_eq!(first.latency[bucket(7)], 1);
        assert_eq!(first.latency[bucket(300)], 1);
        assert_eq!(rows.len(), 2);
    }
}
