//! `/pipelines`: each configured pipeline drawn as the graph of its steps,
//! with per step: the provider it calls, its step runs over the last hour
//! and day (success per run, p50/p95 of the whole run: every attempt,
//! backoff and poll), and the records at it now by state. Figures come
//! from the per-minute rollups and the maintained counters, never from
//! scans; the figures refresh themselves.

use std::collections::BTreeMap;

use askama::Template;
use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;

use crate::config::pipeline::PipelineConfig;
use crate::domain::{RecordState, StepCount};
use crate::web::AppState;
use crate::web::auth::{Authed, Viewer};
use crate::web::error::WebResult;
use crate::web::graph::{self, Graph, Spec};
use crate::web::htmx::is_htmx;
use crate::web::stats_view::{Runs, step_runs};

use super::{Nav, html, when};

pub fn router() -> Router<AppState> {
    Router::new().route("/pipelines", get(pipelines))
}

/// Records at one step in one state, linking to the list of them.
pub struct Here {
    pub state: &'static str,
    pub at_rest: bool,
    pub count: i64,
    pub href: String,
}

pub struct StepRow {
    pub name: String,
    pub provider: String,
    /// The pipeline its child record runs (`kind = "pipeline"`); empty
    /// for another kind.
    pub child: String,
    /// A step for each item: `for each ×N` (N at once).
    pub each: Option<String>,
    /// It has an undo call.
    pub undo: bool,
    pub kind: &'static str,
    /// What it needs: all of `needs`, then any one of `needs_any`.
    pub needs: String,
    /// Its condition (`when`); empty for none.
    pub when: String,
    pub required: bool,
    pub hour: Runs,
    pub day: Runs,
    /// Attempts per ended run over the last hour, as text.
    pub calls_per_run: String,
    pub here: Vec<Here>,
}

pub struct PipelineView {
    pub name: String,
    pub description: String,
    pub graph: Graph,
    pub steps: Vec<StepRow>,
    /// Records not at any step yet (enqueued, never claimed), by state.
    pub unstarted: Vec<Here>,
    /// Records at steps this configuration no longer has (an older
    /// version's), by step.
    pub elsewhere: Vec<(String, Vec<Here>)>,
    /// Its newest definitions (records keep the one they started with):
    /// id, hash, since when, whether new records get it here.
    pub versions: Vec<VersionRow>,
}

/// One pinned definition of a pipeline.
pub struct VersionRow {
    pub id: i64,
    pub hash: String,
    pub since: String,
    pub current: bool,
}

/// How many of a pipeline's versions the page lists.
const VERSIONS_SHOWN: i64 = 5;

#[derive(Template)]
#[template(path = "pages/pipelines.html", blocks = ["live"])]
struct PipelinesPage {
    nav: Nav,
    updated: String,
    pipelines: Vec<PipelineView>,
}

/// The link to the records of `pipeline` at `step` in `state`.
fn records_href(pipeline: &str, step: &str, state: &str) -> String {
    let q = crate::web::query::ListQuery {
        pipeline: Some(pipeline.to_owned()),
        state: Some(state.to_owned()),
        step: Some(step.to_owned()),
        ..Default::default()
    };
    format!("/records?{}", q.query_string())
}

/// The records at each step of `pipeline`, by state, in `RecordState::ALL`
/// order.
fn here_by_step(pipeline: &str, counts: &[StepCount]) -> BTreeMap<String, Vec<Here>> {
    let mut out: BTreeMap<String, Vec<Here>> = BTreeMap::new();
    for state in RecordState::ALL {
        for c in counts
            .iter()
            .filter(|c| c.pipeline == pipeline && c.state == state && c.count != 0)
        {
            out.entry(c.step.clone()).or_default().push(Here {
                state: state.as_str(),
                at_rest: state.is_at_rest(),
                count: c.count,
                href: records_href(pipeline, &c.step, state.as_str()),
            });
        }
    }
    out
}

/// The short line a graph box gives of the records at a step now.
fn here_line(here: &[Here]) -> String {
    let active: i64 = here.iter().filter(|h| !h.at_rest).map(|h| h.count).sum();
    let parked: i64 = here
        .iter()
        .filter(|h| h.state == "parked")
        .map(|h| h.count)
        .sum();
    match parked {
        0 => format!("now: {active} at work"),
        p => format!("now: {active} at work, {p} parked"),
    }
}

fn view(
    name: &str,
    p: &PipelineConfig,
    index: usize,
    runs: &BTreeMap<(String, String), (Runs, Runs)>,
    counts: &[StepCount],
) -> PipelineView {
    let mut here = here_by_step(name, counts);
    let unstarted = here.remove("").unwrap_or_default();
    let steps: Vec<StepRow> = p
        .steps
        .iter()
        .map(|s| {
            let (hour, day) = runs
                .get(&(name.to_owned(), s.name.clone()))
                .cloned()
                .unwrap_or_default();
            let calls_per_run = match hour.ended() {
                0 => "—".to_owned(),
                n => format!("{:.1}", hour.calls as f64 / n as f64),
            };
            StepRow {
                name: s.name.clone(),
                provider: s.provider.clone(),
                child: s.pipeline.clone().unwrap_or_default(),
                each: s
                    .for_each
                    .as_ref()
                    .map(|_| format!("for each ×{}", s.items_at_once())),
                undo: s.undo.is_some(),
                kind: crate::pipeline::kinds::registered(s.kind).label,
                needs: needs_text(&s.needs, &s.needs_any),
                when: s.when.clone().unwrap_or_default(),
                required: s.required,
                hour,
                day,
                calls_per_run,
                here: here.remove(&s.name).unwrap_or_default(),
            }
        })
        .collect();
    let specs: Vec<Spec<'_>> = p
        .steps
        .iter()
        .map(|s| Spec {
            name: &s.name,
            needs: &s.needs,
            needs_any: &s.needs_any,
            when: s.when.as_deref(),
            kind: crate::pipeline::kinds::registered(s.kind).name,
            stacked: s.for_each.is_some(),
            undo: s.undo.is_some(),
        })
        .collect();
    let title = format!("The steps of pipeline {name}, each after the steps it needs");
    let graph = graph::layout(&format!("pipeline-{index}"), &title, &specs, |i, n| {
        let row = &steps[i];
        n.class = if row.required {
            "step"
        } else {
            "step optional"
        };
        // A child's step links to the child's pipeline.
        n.href = match row.child.as_str() {
            "" => format!("#step-{index}-{i}"),
            child => format!("#pipeline-{child}"),
        };
        n.lines = vec![
            what_it_is(row),
            format!(
                "1 h: {} ok · p50 {}",
                row.hour.success_rate(),
                row.hour.p50()
            ),
            here_line(&row.here),
        ];
    });
    PipelineView {
        name: name.to_owned(),
        description: p.description.clone().unwrap_or_default(),
        graph,
        steps,
        unstarted,
        elsewhere: here.into_iter().collect(),
        versions: Vec::new(),
    }
}

/// A step's box's first line: its provider (a kind that calls none names
/// only itself), the child it runs, for each item, its undo, its kind,
/// optional.
fn what_it_is(row: &StepRow) -> String {
    let runs = match row.child.as_str() {
        "" => String::new(),
        child => format!("runs {child}"),
    };
    [
        row.provider.as_str(),
        runs.as_str(),
        row.each.as_deref().unwrap_or(""),
        if row.undo { "↶ undo" } else { "" },
        row.kind,
        if row.required { "" } else { "optional" },
    ]
    .into_iter()
    .filter(|part| !part.is_empty())
    .collect::<Vec<_>>()
    .join(" · ")
}

/// `a, b`, `any of c, d`, or both: what a step waits for, in words.
fn needs_text(all: &[String], any: &[String]) -> String {
    let any = (!any.is_empty()).then(|| format!("any of {}", any.join(", ")));
    let all = (!all.is_empty()).then(|| all.join(", "));
    [all, any]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("; ")
}

async fn pipelines(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
) -> WebResult<Response> {
    let now = state.clock.now_ms();
    let (rollups, counts) = tokio::try_join!(
        state.db.rollups_since(now - 24 * 3600 * 1000),
        state.db.step_counts(),
    )?;
    let runs = step_runs(&rollups, now);
    let config = state.config.get();
    let mut pipelines = Vec::with_capacity(config.pipelines.len());
    // A caller limited to pipelines sees theirs only.
    let seen = config
        .pipelines
        .iter()
        .filter(|(name, _)| caller.sees(name));
    for (i, (name, p)) in seen.enumerate() {
        let mut v = view(name, p, i, &runs, &counts);
        v.versions = crate::web::query::pipeline_versions(&state, name, VERSIONS_SHOWN)
            .await?
            .into_iter()
            .map(|(pv, current)| VersionRow {
                id: pv.id,
                hash: pv.hash.chars().take(12).collect(),
                since: when(pv.created_at),
                current,
            })
            .collect();
        pipelines.push(v);
    }
    let t = PipelinesPage {
        nav: Nav::new(&caller, "pipelines"),
        updated: when(now),
        pipelines,
    };
    if is_htmx(&headers) {
        return html(&t.as_live());
    }
    html(&t)
}
