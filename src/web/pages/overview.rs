//! `/`: the overview. Counts come from maintained counters, statistics from
//! per-minute rollups, never from scans; the live part refreshes itself.

use std::collections::BTreeMap;

use askama::Template;
use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;

use crate::domain::RecordState;
use crate::web::AppState;
use crate::web::auth::{Authed, Viewer};
use crate::web::error::WebResult;
use crate::web::htmx::is_htmx;
use crate::web::scope;

use super::{Nav, html, when};

pub fn router() -> Router<AppState> {
    Router::new().route("/", get(overview))
}

pub struct PipelineCounts {
    pub name: String,
    /// Counts in `RecordState::ALL` order.
    pub counts: Vec<(&'static str, i64)>,
    pub total: i64,
}

pub struct ProviderRow {
    pub name: String,
    pub breaker: &'static str,
    pub paused: bool,
    /// Rate-limit use as this node sees it ("12 of 20/1s").
    pub limit_use: String,
}

pub struct ScheduleLine {
    pub pipeline: String,
    pub cron: String,
    pub missed: &'static str,
    pub next: String,
    pub last: String,
    pub last_record: Option<i64>,
}

/// The configured schedules, each with its next tick and the last the
/// cluster fired.
fn schedule_lines(
    config: &crate::config::Config,
    rows: &[crate::domain::ScheduleRow],
    now: crate::domain::UnixMs,
) -> Vec<ScheduleLine> {
    use crate::domain::schedule::{Cron, Missed};
    config
        .pipelines
        .iter()
        .filter_map(|(name, p)| {
            let s = p.schedule.as_ref()?;
            let cron = Cron::parse(&s.cron).ok()?;
            let row = rows.iter().find(|r| &r.pipeline == name);
            Some(ScheduleLine {
                pipeline: name.clone(),
                cron: cron.as_str().to_owned(),
                missed: match s.missed {
                    Missed::FireOnce => "fire once",
                    Missed::Skip => "skip",
                },
                next: cron
                    .next_after(row.map_or(now, |r| r.watermark.max(now)))
                    .map(when)
                    .unwrap_or_default(),
                last: row
                    .and_then(|r| r.last_tick)
                    .map_or_else(|| "not yet".into(), when),
                last_record: row.and_then(|r| r.last_record_id),
            })
        })
        .collect()
}

#[derive(Template)]
#[template(path = "pages/overview.html", blocks = ["live"])]
struct OverviewPage {
    nav: Nav,
    updated: String,
    states: Vec<&'static str>,
    pipelines: Vec<PipelineCounts>,
    /// Records by the provider of their current step.
    by_provider: Vec<PipelineCounts>,
    providers: Vec<ProviderRow>,
    schedules: Vec<ScheduleLine>,
    nodes: usize,
    /// The configuration this node runs (`Config::version`).
    config_version: String,
    /// Each live node and the configuration it runs, when they differ.
    config_split: Vec<(String, String)>,
    stats: super::super::stats_view::Stats,
}

/// Counts by state for each name (configured ones always, others when they
/// have records), in `RecordState::ALL` order.
fn table<'a>(
    configured: impl Iterator<Item = &'a String>,
    counts: Vec<crate::domain::StateCount>,
) -> Vec<PipelineCounts> {
    let mut by_name: BTreeMap<String, BTreeMap<RecordState, i64>> =
        configured.map(|p| (p.clone(), BTreeMap::new())).collect();
    for c in counts {
        *by_name
            .entry(c.pipeline)
            .or_default()
            .entry(c.state)
            .or_default() += c.count;
    }
    by_name
        .into_iter()
        .map(|(name, m)| {
            let counts: Vec<_> = RecordState::ALL
                .iter()
                .map(|s| (s.as_str(), m.get(s).copied().unwrap_or(0)))
                .collect();
            PipelineCounts {
                total: counts.iter().map(|c| c.1).sum(),
                name,
                counts,
            }
        })
        .collect()
}

async fn overview(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
) -> WebResult<Response> {
    let now = state.clock.now_ms();
    let (mut counts, per_provider, provider_states, nodes, mut rollups, schedule_rows) = tokio::try_join!(
        state.db.state_counts(),
        state.db.provider_counts(),
        state.db.provider_states(),
        state.db.list_nodes(),
        state.db.rollups_since(now - 24 * 3600 * 1000),
        state.db.schedules(),
    )?;
    let config = state.config.get();
    // A caller limited to pipelines counts theirs only: by provider
    // through the steps they are at.
    let step_counts = match caller.sees_all() {
        true => Vec::new(),
        false => state.db.step_counts().await?,
    };
    let per_provider = scope::provider_counts(&config, &caller, per_provider, &step_counts);
    counts.retain(|c| caller.sees(&c.pipeline));
    rollups.retain(|r| caller.sees(&r.pipeline));
    let shown = scope::providers(&config, &caller);
    let shown = |name: &String| shown.as_ref().is_none_or(|s| s.contains(name));
    // Nodes heard from lately; a crashed node's row stays until it ages out.
    let horizon = now - 3 * crate::domain::host::HEARTBEAT_EVERY.as_millis() as i64;
    let live = nodes.iter().filter(|n| n.heartbeat_at > horizon).count();
    let pipelines = table(config.pipelines.keys().filter(|p| caller.sees(p)), counts);
    let by_provider = table(config.providers.keys().filter(|p| shown(p)), per_provider);
    let providers = config
        .providers
        .keys()
        .filter(|p| shown(p))
        .map(|name| {
            let ps = provider_states.iter().find(|p| &p.provider == name);
            let live = state.engine.as_ref().and_then(|e| e.provider_live(name));
            ProviderRow {
                name: name.clone(),
                breaker: ps.map_or("closed", |p| p.breaker.as_str()),
                paused: ps.is_some_and(|p| p.paused),
                limit_use: live.map(|l| l.limit_use()).unwrap_or_default(),
            }
        })
        .collect();
    let stats = super::super::stats_view::Stats::build(&rollups, now);
    let t = OverviewPage {
        nav: Nav::new(&caller, "overview"),
        updated: when(now),
        states: RecordState::ALL.iter().map(|s| s.as_str()).collect(),
        pipelines,
        by_provider,
        providers,
        schedules: schedule_lines(&config, &schedule_rows, now)
            .into_iter()
            .filter(|s| caller.sees(&s.pipeline))
            .collect(),
        nodes: live,
        config_version: state.config.version(),
        config_split: crate::domain::host::config_split(&nodes, now),
        stats,
    };
    if is_htmx(&headers) {
        return html(&t.as_live());
    }
    html(&t)
}
