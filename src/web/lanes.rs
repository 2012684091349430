//! A record's attempts as a timeline with a lane per step, for
//! server-rendered SVG: each attempt a mark where and as long as it ran
//! (at least a few units wide), its class its outcome; the space between
//! marks is the wait (backoff, a job's polls apart, a pause). Pure: the
//! attempts in, geometry out; `pages/record.html` draws it, and each lane
//! says its attempts by outcome in words beside the marks.

use std::collections::BTreeMap;

use crate::domain::{Attempt, UnixMs};

/// Geometry, in SVG user units.
const LABEL_W: i64 = 120;
const PLOT_W: i64 = 600;
const SUMMARY_W: i64 = 260;
const LANE_H: i64 = 28;
const TOP: i64 = 8;
const AXIS_H: i64 = 22;
const MIN_MARK: i64 = 3;

#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    pub x: i64,
    pub w: i64,
    /// The attempt's outcome (`success`, `retry`, …), its CSS class.
    pub class: &'static str,
    pub title: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lane {
    pub step: String,
    /// Top of the lane.
    pub y: i64,
    pub marks: Vec<Mark>,
    /// From the first mark's start to the last mark's end: the lane's
    /// baseline, on which waits show as gaps between marks.
    pub from_x: i64,
    pub to_x: i64,
    /// The lane's attempts by outcome, in words.
    pub summary: String,
}

impl Lane {
    pub fn mid_y(&self) -> i64 {
        self.y + LANE_H / 2
    }

    pub fn mark_y(&self) -> i64 {
        self.y + 6
    }

    pub fn text_y(&self) -> i64 {
        self.y + LANE_H / 2 + 4
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lanes {
    pub lanes: Vec<Lane>,
    pub width: i64,
    pub height: i64,
    pub plot_x: i64,
    pub plot_end: i64,
    pub summary_x: i64,
    pub mark_h: i64,
    pub axis_y: i64,
    /// What the axis spans, in words: its start and its length.
    pub from: String,
    pub span: String,
}

/// Lays out `attempts` (any order) from `start` to `end` (both clamped to
/// take in every attempt), a lane per step in `order` first, then any
/// other step met, in the order first met.
pub fn lanes(
    order: &[String],
    attempts: &[Attempt],
    start: UnixMs,
    end: UnixMs,
    when: impl Fn(UnixMs) -> String,
) -> Lanes {
    let first = attempts.iter().map(|a| a.started_at).min().unwrap_or(start);
    let last = attempts
        .iter()
        .map(|a| a.started_at + a.duration_ms.max(0))
        .max()
        .unwrap_or(end);
    let (start, end) = (start.min(first), end.max(last));
    let span = (end - start).max(1);
    let at = |t: UnixMs| LABEL_W + ((t - start) as i128 * PLOT_W as i128 / span as i128) as i64;
    // An item's calls go in its step's lane.
    let lane = |a: &Attempt| crate::domain::each::step_of(&a.step).to_owned();
    let mut steps: Vec<String> = order.to_vec();
    for a in attempts {
        if !steps.contains(&lane(a)) {
            steps.push(lane(a));
        }
    }
    steps.retain(|s| attempts.iter().any(|a| &lane(a) == s));
    let lanes: Vec<Lane> = steps
        .iter()
        .enumerate()
        .map(|(i, step)| {
            let mut mine: Vec<&Attempt> = attempts.iter().filter(|a| &lane(a) == step).collect();
            mine.sort_by_key(|a| (a.started_at, a.attempt_no));
            let marks: Vec<Mark> = mine
                .iter()
                .map(|a| {
                    let x = at(a.started_at);
                    let w = (at(a.started_at + a.duration_ms.max(0)) - x).max(MIN_MARK);
                    let status = a
                        .http_status
                        .map_or_else(|| "no HTTP reply".to_owned(), |s| format!("HTTP {s}"));
                    Mark {
                        x: x.min(LABEL_W + PLOT_W - MIN_MARK),
                        w,
                        class: a.outcome.as_str(),
                        title: format!(
                            "{step} attempt {} at {}: {}, {status}, {}",
                            a.attempt_no,
                            when(a.started_at),
                            a.outcome.as_str(),
                            super::fmt::millis(a.duration_ms)
                        ),
                    }
                })
                .collect();
            let mut by: BTreeMap<&str, usize> = BTreeMap::new();
            for a in &mine {
                *by.entry(a.outcome.as_str()).or_default() += 1;
            }
            let words: Vec<String> = by.iter().map(|(o, n)| format!("{n} {o}")).collect();
            let from_x = marks.first().map_or(LABEL_W, |m| m.x);
            let to_x = marks.iter().map(|m| m.x + m.w).max().unwrap_or(LABEL_W);
            Lane {
                step: step.clone(),
                y: TOP + i as i64 * LANE_H,
                marks,
                from_x,
                to_x,
                summary: format!(
                    "{} attempt{}: {}",
                    mine.len(),
                    if mine.len() == 1 { "" } else { "s" },
                    words.join(", ")
                ),
            }
        })
        .collect();
    let axis_y = TOP + lanes.len() as i64 * LANE_H + 14;
    Lanes {
        width: LABEL_W + PLOT_W + SUMMARY_W,
        height: TOP + lanes.len() as i64 * LANE_H + AXIS_H,
        plot_x: LABEL_W,
        plot_end: LABEL_W + PLOT_W,
        summary_x: LABEL_W + PLOT_W + 12,
        mark_h: LANE_H - 12,
        axis_y,
        from: when(start),
        span: format!("+{}", super::fmt::millis(end - start)),
        lanes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Outcome;

    fn attempt(step: &str, no: i32, at: i64, ms: i64, outcome: Outcome) -> Attempt {
        Attempt {
            id: 0,
            record_id: 1,
            step: step.into(),
            provider: Some("p".into()),
            attempt_no: no,
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
    fn a_lane_per_step_marks_where_each_attempt_ran() {
        let attempts = [
            attempt("b", 1, 1_000, 100, Outcome::Success),
            attempt("a", 2, 600, 0, Outcome::Success),
            attempt("a", 1, 0, 100, Outcome::Retry),
        ];
        let l = lanes(
            &["a".into(), "b".into(), "c".into()],
            &attempts,
            0,
            1_100,
            |t| format!("t{t}"),
        );
        assert_eq!(l.lanes.len(), 2, "no lane for a step never tried");
        let a = &l.lanes[0];
        assert_eq!(a.step, "a");
        assert_eq!(a.summary, "2 attempts: 1 retry, 1 success");
        assert_eq!(a.marks[0].x, LABEL_W);
        assert_eq!(a.marks[0].class, "retry");
        // 100 ms of 1,100 across 600 units.
        assert_eq!(a.marks[0].w, 54);
        assert_eq!(a.marks[1].w, MIN_MARK, "an instant still shows");
        assert!(
            a.marks[1].x > a.marks[0].x + a.marks[0].w,
            "the wait is a gap"
        );
        assert!(
            a.marks[1]
                .title
                .contains("attempt 2 at t600: success, HTTP 200, 0 ms")
        );
        assert_eq!(
            l.lanes[1].marks[0].x + l.lanes[1].marks[0].w,
            LABEL_W + PLOT_W
        );
        assert_eq!((l.from.as_str(), l.span.as_str()), ("t0", "+1.1 s"));
    }

    #[test]
    fn attempts_outside_the_span_widen_it() {
        let attempts = [attempt("a", 1, -500, 10, Outcome::Fail)];
        let l = lanes(&[], &attempts, 0, 0, |t| t.to_string());
        assert_eq!(l.lanes[0].marks[0].x, LABEL_W);
        assert_eq!(l.from, "-500");
        assert_eq!(l.lanes[0].summary, "1 attempt: 1 fail");
    }
}
