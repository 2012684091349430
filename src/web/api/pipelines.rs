//! `GET /api/v1/pipelines`: each pipeline as the pipelines page shows it,
//! as figures: its steps, how their runs ended over the last hour and day
//! with their run lengths, the records at each step now, and its pinned
//! versions. The page draws the same store figures
//! (`web::stats_view::step_runs`, `step_counts`).

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::pipeline::{PipelineConfig, StepConfig};
use crate::domain::{RecordState, StepCount, UnixMs};
use crate::engine::stats::RUN_BUCKETS_MS;
use crate::web::AppState;
use crate::web::auth::{Bearer, Viewer};
use crate::web::error::WebResult;
use crate::web::stats_view::{Runs, step_runs};

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(pipelines))
}

/// How many of a pipeline's versions are listed, newest first.
const VERSIONS_LISTED: i64 = 5;

/// How many records are in each state (states with none left out).
type ByState = BTreeMap<RecordState, i64>;

/// One pipeline: its steps with their figures, and where its records are.
#[derive(Serialize, ToSchema)]
struct Pipeline {
    name: String,
    description: Option<String>,
    steps: Vec<Step>,
    /// Records not at any step yet (enqueued, never claimed), by state.
    #[schema(value_type = BTreeMap<String, i64>)]
    unstarted: ByState,
    /// Records at steps this configuration no longer has (an older
    /// version's).
    elsewhere: Vec<Elsewhere>,
    /// Its newest pinned definitions (records keep the one they started
    /// with).
    versions: Vec<Version>,
}

/// One step: what it is, how its runs ended, and the records at it now.
#[derive(Serialize, ToSchema)]
struct Step {
    name: String,
    /// Its kind (`request`, `job`, `sleep`, `approval`, …).
    kind: &'static str,
    /// The provider it calls (null for a kind that calls none).
    provider: Option<String>,
    /// The pipeline its child record runs (a `pipeline` step).
    pipeline: Option<String>,
    /// Once for each item of a list.
    for_each: bool,
    /// It has an undo call.
    undo: bool,
    required: bool,
    /// Steps it needs, every one of them.
    needs: Vec<String>,
    /// Steps it needs, any one of them.
    needs_any: Vec<String>,
    /// Its condition (`when`).
    when: Option<String>,
    /// Its runs that ended in the last hour.
    last_hour: Figures,
    /// Its runs that ended in the last 24 hours.
    last_day: Figures,
    /// Records at this step now, by state.
    #[schema(value_type = BTreeMap<String, i64>)]
    records: ByState,
}

/// How a step's runs ended in a window, and how long they took (first
/// call to end).
#[derive(Serialize, ToSchema)]
struct Figures {
    succeeded: i64,
    failed: i64,
    /// Runs that parked their record.
    parked: i64,
    /// Attempts made (calls and polls).
    calls: i64,
    /// The run length below which half the ended runs fall: the upper
    /// bound of its bucket in `lengths`; null when none ended or when it
    /// is past the last bound.
    p50_ms: Option<i64>,
    /// Likewise for 95 in 100.
    p95_ms: Option<i64>,
    /// Ended runs by length: each bucket's upper bound (null: longer than
    /// every bound) and how many; empty buckets left out.
    lengths: Vec<Bucket>,
}

#[derive(Serialize, ToSchema)]
struct Bucket {
    le_ms: Option<i64>,
    runs: i64,
}

/// Records at a step the configuration no longer has.
#[derive(Serialize, ToSchema)]
struct Elsewhere {
    step: String,
    #[schema(value_type = BTreeMap<String, i64>)]
    records: ByState,
}

/// One pinned definition.
#[derive(Serialize, ToSchema)]
struct Version {
    id: i64,
    /// The definition's hash.
    hash: String,
    created_at: UnixMs,
    /// New records of this pipeline start on it.
    current: bool,
}

impl Figures {
    fn of(runs: &Runs) -> Self {
        let bound = |i: usize| RUN_BUCKETS_MS.get(i).copied().filter(|b| *b != i64::MAX);
        let quantile = |q: f64| crate::web::stats_view::quantile_bucket(&runs.latency, q);
        Figures {
            succeeded: runs.succeeded,
            failed: runs.failed,
            parked: runs.parked,
            calls: runs.calls,
            p50_ms: quantile(0.5).and_then(bound),
            p95_ms: quantile(0.95).and_then(bound),
            lengths: runs
                .latency
                .iter()
                .enumerate()
                .filter(|(_, n)| **n != 0)
                .map(|(i, n)| Bucket {
                    le_ms: bound(i),
                    runs: *n,
                })
                .collect(),
        }
    }
}

/// The records of `pipeline` by step, each step's by state.
fn by_step(pipeline: &str, counts: &[StepCount]) -> BTreeMap<String, ByState> {
    let mut out: BTreeMap<String, ByState> = BTreeMap::new();
    for c in counts
        .iter()
        .filter(|c| c.pipeline == pipeline && c.count != 0)
    {
        *out.entry(c.step.clone())
            .or_default()
            .entry(c.state)
            .or_default() += c.count;
    }
    out
}

fn step(s: &StepConfig, runs: Option<&(Runs, Runs)>, records: ByState) -> Step {
    let (hour, day) = runs.cloned().unwrap_or_default();
    Step {
        name: s.name.clone(),
        kind: crate::pipeline::kinds::registered(s.kind).name,
        provider: Some(s.provider.clone()).filter(|p| !p.is_empty()),
        pipeline: s.pipeline.clone(),
        for_each: s.for_each.is_some(),
        undo: s.undo.is_some(),
        required: s.required,
        needs: s.needs.clone(),
        needs_any: s.needs_any.clone(),
        when: s.when.clone(),
        last_hour: Figures::of(&hour),
        last_day: Figures::of(&day),
        records,
    }
}

fn pipeline(
    name: &str,
    p: &PipelineConfig,
    runs: &BTreeMap<(String, String), (Runs, Runs)>,
    counts: &[StepCount],
) -> Pipeline {
    let mut here = by_step(name, counts);
    let unstarted = here.remove("").unwrap_or_default();
    let steps = p
        .steps
        .iter()
        .map(|s| {
            let at = here.remove(&s.name).unwrap_or_default();
            step(s, runs.get(&(name.to_owned(), s.name.clone())), at)
        })
        .collect();
    Pipeline {
        name: name.to_owned(),
        description: p.description.clone(),
        steps,
        unstarted,
        elsewhere: here
            .into_iter()
            .map(|(step, records)| Elsewhere { step, records })
            .collect(),
        versions: Vec::new(),
    }
}

/// A page of every pipeline the token may see.
#[derive(Serialize, ToSchema)]
struct PipelineList {
    items: Vec<Pipeline>,
}

/// Every pipeline, with its figures.
///
/// Each pipeline the token may see, as the pipelines page shows it: its
/// steps and how their runs ended over the last hour and day, the records
/// at each step now, and its newest pinned versions.
#[utoipa::path(
    get,
    path = "/pipelines",
    tag = "pipelines",
    operation_id = "list_pipelines",
    responses((status = 200, description = "Every pipeline the token may see", body = PipelineList)),
    security(("bearer" = ["viewer"]))
)]
async fn pipelines(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
) -> WebResult<Json<PipelineList>> {
    let now = state.clock.now_ms();
    let (rollups, counts) = tokio::try_join!(
        state.db.rollups_since(now - 24 * 3600 * 1000),
        state.db.step_counts(),
    )?;
    let runs = step_runs(&rollups, now);
    let config = state.config.get();
    let mut items = Vec::new();
    for (name, p) in config
        .pipelines
        .iter()
        .filter(|(name, _)| caller.sees(name))
    {
        let mut one = pipeline(name, p, &runs, &counts);
        one.versions = crate::web::query::pipeline_versions(&state, name, VERSIONS_LISTED)
            .await?
            .into_iter()
            .map(|(v, current)| Version {
                id: v.id,
                hash: v.hash,
                created_at: v.created_at,
                current,
            })
            .collect();
        items.push(one);
    }
    Ok(Json(PipelineList { items }))
}
