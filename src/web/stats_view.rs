//! The overview's figures, summed from every node's rollups (per minute for
//! the last hour or two, per hour before): success rate and p50/p95 latency
//! per step and per provider over the last hour and the last day (to the
//! hour: the day's first hour row is counted whole), and records finished
//! per minute as small server-side SVG bar charts.

use std::collections::BTreeMap;

use crate::domain::UnixMs;
use crate::engine::stats::{LATENCY_BUCKETS_MS, RUN_BUCKETS_MS};
use crate::store::{StepRollup, add_counts};

const HOUR: i64 = crate::store::HOUR_MS;

/// The minute rows folded into hours at `now`: those before the last 61
/// minutes, which the hour figures and the per-minute bars read one minute
/// at a time. (An hour's row may so hold part of its hour for a while: the
/// day figures read both kinds of row.)
pub fn compaction_cutoff(now: UnixMs) -> UnixMs {
    let keep_from = now - HOUR - 60_000;
    keep_from - keep_from.rem_euclid(60_000)
}

/// Figures over one window.
#[derive(Debug, Clone, Default)]
pub struct Window {
    pub calls: i64,
    pub ok: i64,
    pub latency: Vec<i64>,
}

impl Window {
    fn add(&mut self, r: &StepRollup) {
        self.calls += r.calls;
        self.ok += r.succeeded;
        add_counts(&mut self.latency, &r.latency);
    }

    /// Share of attempts that succeeded (or reported progress), as text.
    pub fn success_rate(&self) -> String {
        if self.calls == 0 {
            return "—".into();
        }
        format!("{:.1}%", 100.0 * self.ok as f64 / self.calls as f64)
    }

    /// The latency bucket holding quantile `q`, as "≤ N ms".
    pub fn quantile(&self, q: f64) -> String {
        quantile(&self.latency, &LATENCY_BUCKETS_MS, q)
    }

    pub fn p50(&self) -> String {
        self.quantile(0.5)
    }

    pub fn p95(&self) -> String {
        self.quantile(0.95)
    }
}

/// The index of the bucket holding quantile `q` of `counts`, `None` for
/// no counts (the pages' labels and the API's figures alike).
pub fn quantile_bucket(counts: &[i64], q: f64) -> Option<usize> {
    let total: i64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let want = (q * total as f64).ceil() as i64;
    let mut seen = 0;
    counts.iter().position(|n| {
        seen += n;
        seen >= want
    })
}

/// The bucket of `bounds` holding quantile `q` of `counts`, as "≤ N ms"
/// ("> N" past the last bound, "—" for no counts).
fn quantile(counts: &[i64], bounds: &[i64], q: f64) -> String {
    match quantile_bucket(counts, q).and_then(|i| bounds.get(i)) {
        Some(&b) if b == i64::MAX => match bounds.len().checked_sub(2).map(|j| bounds[j]) {
            Some(last) => format!("> {}", super::fmt::millis(last)),
            None => "—".into(),
        },
        Some(&b) => format!("≤ {}", super::fmt::millis(b)),
        None => "—".into(),
    }
}

/// Step runs (every attempt and poll of one step of one record) that
/// ended in one window: how they ended and how long they took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Runs {
    pub succeeded: i64,
    pub failed: i64,
    /// Runs that parked their record.
    pub parked: i64,
    /// Attempts made (calls and polls), for attempts per run.
    pub calls: i64,
    pub latency: Vec<i64>,
}

impl Runs {
    fn add(&mut self, r: &StepRollup) {
        self.succeeded += r.runs_succeeded;
        self.failed += r.runs_failed;
        self.parked += r.records_parked;
        self.calls += r.calls;
        add_counts(&mut self.latency, &r.run_latency);
    }

    pub fn ended(&self) -> i64 {
        self.succeeded + self.failed + self.parked
    }

    /// Share of ended runs that succeeded, as text.
    pub fn success_rate(&self) -> String {
        match self.ended() {
            0 => "—".into(),
            n => format!("{:.1}%", 100.0 * self.succeeded as f64 / n as f64),
        }
    }

    /// Whole-run length at quantile `q` (first call to end), as text.
    pub fn quantile(&self, q: f64) -> String {
        quantile(&self.latency, &RUN_BUCKETS_MS, q)
    }

    pub fn p50(&self) -> String {
        self.quantile(0.5)
    }

    pub fn p95(&self) -> String {
        self.quantile(0.95)
    }
}

/// Step-run figures per (pipeline, step), summed over providers and nodes:
/// (last hour, last day).
pub fn step_runs(rollups: &[StepRollup], now: UnixMs) -> BTreeMap<(String, String), (Runs, Runs)> {
    let hour_start = now - HOUR;
    let mut out: BTreeMap<(String, String), (Runs, Runs)> = BTreeMap::new();
    for r in rollups {
        let (hour, day) = out.entry((r.pipeline.clone(), r.step.clone())).or_default();
        day.add(r);
        if r.minute >= hour_start - 60_000 {
            hour.add(r);
        }
    }
    out
}

/// One row of the step or provider table.
#[derive(Debug, Clone)]
pub struct Row {
    pub label: String,
    pub hour: Window,
    pub day: Window,
}

/// One bar of a chart, in SVG user units.
#[derive(Debug, Clone)]
pub struct Bar {
    pub x: i64,
    pub y: i64,
    pub h: i64,
    pub title: String,
}

/// Records finished per minute over the last hour, for one pipeline.
#[derive(Debug, Clone)]
pub struct Chart {
    pub pipeline: String,
    pub bars: Vec<Bar>,
    pub max: i64,
    pub parked_hour: i64,
    pub finished_hour: i64,
}

/// Chart geometry: 60 bars of 4 units in a 240 × 40 box.
pub const CHART_H: i64 = 40;

#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub steps: Vec<Row>,
    pub providers: Vec<Row>,
    pub charts: Vec<Chart>,
}

impl Stats {
    pub fn build(rollups: &[StepRollup], now: UnixMs) -> Stats {
        let hour_start = now - HOUR;
        let mut steps: BTreeMap<(String, String, String), Row> = BTreeMap::new();
        let mut providers: BTreeMap<String, Row> = BTreeMap::new();
        let mut per_minute: BTreeMap<String, [i64; 60]> = BTreeMap::new();
        let mut parked: BTreeMap<String, i64> = BTreeMap::new();
        let this_minute = now - now.rem_euclid(60_000);
        for r in rollups {
            let in_hour = r.minute >= hour_start - 60_000;
            if r.calls > 0 {
                let key = (r.pipeline.clone(), r.step.clone(), r.provider.clone());
                let row = steps.entry(key).or_insert_with(|| Row {
                    label: format!("{} / {} ({})", r.pipeline, r.step, r.provider),
                    hour: Window::default(),
                    day: Window::default(),
                });
                row.day.add(r);
                if in_hour {
                    row.hour.add(r);
                }
                let p = providers.entry(r.provider.clone()).or_insert_with(|| Row {
                    label: r.provider.clone(),
                    hour: Window::default(),
                    day: Window::default(),
                });
                p.day.add(r);
                if in_hour {
                    p.hour.add(r);
                }
            }
            let finished = r.records_succeeded + r.records_failed + r.records_parked;
            let ago = (this_minute - r.minute) / 60_000;
            if (0..60).contains(&ago) {
                let bars = per_minute.entry(r.pipeline.clone()).or_insert([0; 60]);
                bars[(59 - ago) as usize] += finished;
                *parked.entry(r.pipeline.clone()).or_default() += r.records_parked;
            }
        }
        let charts = per_minute
            .into_iter()
            .map(|(pipeline, counts)| {
                let max = counts.iter().copied().max().unwrap_or(0).max(1);
                let bars = counts
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| {
                        let h = (n * CHART_H + max - 1) / max;
                        Bar {
                            x: i as i64 * 4,
                            y: CHART_H - h,
                            h,
                            title: format!("{} min ago: {n}", 59 - i),
                        }
                    })
                    .collect();
                Chart {
                    parked_hour: parked.get(&pipeline).copied().unwrap_or(0),
                    finished_hour: counts.iter().sum(),
                    pipeline,
                    bars,
                    max,
                }
            })
            .collect();
        Stats {
            steps: steps.into_values().collect(),
            providers: providers.into_values().collect(),
            charts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roll(minute: i64, calls: i64, ok: i64, fast: i64, parked: i64) -> StepRollup {
        let mut latency = vec![0; LATENCY_BUCKETS_MS.len()];
        latency[0] = fast;
        latency[7] = calls - fast;
        StepRollup {
            minute,
            node: "n".into(),
            pipeline: "p".into(),
            step: "s".into(),
            provider: "x".into(),
            calls,
            succeeded: ok,
            records_parked: parked,
            records_succeeded: ok,
            latency,
            ..StepRollup::default()
        }
    }

    #[test]
    fn the_last_61_minutes_stay_minutes() {
        let now = 10 * HOUR + 30_500;
        let cut = compaction_cutoff(now);
        assert_eq!(cut % 60_000, 0);
        assert!(cut <= now - HOUR - 60_000 && cut > now - HOUR - 120_000);
    }

    #[test]
    fn sums_nodes_and_windows() {
        let now = 10 * HOUR;
        let rows = [
            roll(now - 2 * HOUR, 100, 50, 100, 0),
            roll(now - 60_000, 10, 9, 8, 1),
            roll(now - 60_000, 10, 10, 10, 2),
        ];
        let s = Stats::build(&rows, now);
        assert_eq!(s.steps.len(), 1);
        let st = &s.steps[0];
        assert_eq!((st.hour.calls, st.hour.ok), (20, 19));
        assert_eq!((st.day.calls, st.day.ok), (120, 69));
        assert_eq!(st.hour.success_rate(), "95.0%");
        assert_eq!(st.hour.p50(), "≤ 5 ms");
        assert_eq!(st.hour.p95(), "≤ 1.0 s");
        assert_eq!(s.charts[0].parked_hour, 3);
        assert_eq!(s.charts[0].bars[58].h, CHART_H);
    }

    #[test]
    fn step_runs_sum_providers_and_nodes() {
        let now = 10 * HOUR;
        let run = |minute, ok, failed, parked, slow| {
            let mut r = roll(minute, 1, 1, 1, parked);
            r.runs_succeeded = ok;
            r.runs_failed = failed;
            r.run_latency = vec![0; RUN_BUCKETS_MS.len()];
            r.run_latency[3] = ok + failed + parked - slow;
            r.run_latency[RUN_BUCKETS_MS.len() - 1] = slow;
            r
        };
        let mut other = run(now - 60_000, 1, 0, 0, 1);
        other.provider = "y".into();
        let rows = [
            run(now - 2 * HOUR, 10, 0, 0, 0),
            run(now - 60_000, 6, 1, 1, 0),
            other,
        ];
        let m = step_runs(&rows, now);
        let (hour, day) = &m[&("p".to_owned(), "s".to_owned())];
        assert_eq!((hour.succeeded, hour.failed, hour.parked), (7, 1, 1));
        assert_eq!(hour.success_rate(), "77.8%");
        assert_eq!(hour.p50(), "≤ 1.0 s");
        assert_eq!(hour.p95(), "> 24.0 h");
        assert_eq!(day.ended(), 19);
        assert_eq!(Runs::default().p50(), "—");
        assert_eq!(Runs::default().success_rate(), "—");
    }
}
