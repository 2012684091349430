//! `GET /metrics`: Prometheus text, for the configured metrics token or any
//! API token. The recorder is process-wide (the `metrics` crate's design),
//! installed once on first use.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use subtle::ConstantTimeEq;

use crate::web::AppState;

use super::auth;
use super::error::WebError;

/// The buckets of `ballast_attempt_duration_seconds`, in seconds: a
/// histogram (`_bucket` series, for `histogram_quantile` over any set of
/// nodes) rather than a summary computed per process.
const ATTEMPT_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The process's Prometheus recorder, installed on first call. `None` when
/// another recorder was installed first.
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let matcher = Matcher::Full("ballast_attempt_duration_seconds".into());
            let installed = PrometheusBuilder::new()
                .set_buckets_for_metric(matcher, &ATTEMPT_BUCKETS)
                .map_err(|e| e.to_string())
                .and_then(|b| b.install_recorder().map_err(|e| e.to_string()));
            match installed {
                Ok(h) => {
                    describe();
                    Some(h)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "metrics recorder not installed");
                    None
                }
            }
        })
        .as_ref()
}

/// The HELP text of every family this process reports (`promtool check
/// metrics` is clean over a scrape: `web::metrics_explain_themselves`).
/// Units are in the names (`_seconds`); counters end in `_total`.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "ballast_records",
        "Records by pipeline and state, cluster-wide (every node reports the same: aggregate with max)."
    );
    describe_gauge!(
        "ballast_oldest_due_seconds",
        "How long the oldest record due has waited for a worker, by pipeline (0 when none is due)."
    );
    describe_gauge!(
        "ballast_provider_breaker",
        "1 for the state the provider's circuit breaker is in (closed, open, half_open), 0 for the others."
    );
    describe_gauge!(
        "ballast_provider_paused",
        "1 while an operator pauses the provider, else 0."
    );
    describe_gauge!(
        "ballast_provider_throttled_seconds",
        "What is left of the pause the provider asked for (Retry-After, a 429), in seconds."
    );
    describe_counter!(
        "ballast_attempts_total",
        "Provider calls made by this node, by provider, step and outcome."
    );
    describe_histogram!(
        "ballast_attempt_duration_seconds",
        "How long this node's provider calls took, in seconds, by provider and step."
    );
    describe_counter!(
        "ballast_deferrals_total",
        "Steps this node held back without spending an attempt, by provider and reason."
    );
    describe_counter!(
        "ballast_records_finished_total",
        "Records this node brought to a final state, by pipeline and state."
    );
    describe_counter!(
        "ballast_records_resumed_total",
        "Parked records this node resumed because their condition came to hold."
    );
    describe_counter!(
        "ballast_trigger_deliveries_total",
        "Deliveries to this node's triggers, by trigger and verdict (enqueued, duplicate, ignored, or why it was refused)."
    );
    describe_counter!(
        "ballast_notices_total",
        "Notifications this node sent or held back, by subscription and outcome (delivered, failed, given_up, throttled, held)."
    );
    describe_counter!(
        "ballast_schedule_fired_total",
        "Cron ticks this node fired (one node per tick), by pipeline."
    );
    describe_counter!(
        "ballast_oauth2_tokens_total",
        "OAuth2 client-credentials tokens this node asked for, by result."
    );
}

/// Every pipeline this process has reported a gauge for: each scrape
/// reports them all again (0 where nothing is left), so a series never
/// keeps a value that is no longer true (a parked count after the last
/// one was resumed, a pipeline whose records were all purged).
static REPORTED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// What people alert on, read from the store at each scrape (the same
/// cluster-wide figures from every node: aggregate with `max`):
/// - `ballast_records{pipeline, state}`: records by state (parked now is
///   `state="parked"`), from the maintained counters;
/// - `ballast_oldest_due_seconds{pipeline}`: how long the oldest record due
///   has waited for a worker (0 with nothing due);
/// - `ballast_provider_breaker{provider, state}`: 1 for the breaker's state
///   (`closed`, `open`, `half_open`), 0 for the others; an open breaker
///   whose time is up shows `half_open` (its next call is a probe);
/// - `ballast_provider_paused{provider}`: 1 while an operator pauses it;
/// - `ballast_provider_throttled_seconds{provider}`: what is left of a
///   "slow down" pause.
///
/// Throttled calls and retry-budget exhaustion are counters kept as they
/// happen: `ballast_attempts_total{outcome="throttled"}` and
/// `ballast_deferrals_total{reason="provider retry budget exhausted"}`.
async fn cluster_gauges(state: &AppState) -> Result<Vec<Gauge>, WebError> {
    let now = state.clock.now_ms();
    let secs = |ms: i64| ms.max(0) as f64 / 1000.0;
    // Every pipeline configured here, and every one with records at work
    // (another node's, or one no longer configured).
    let mut pipelines: BTreeSet<String> = state.config.get().pipelines.keys().cloned().collect();
    let counts = state.db.state_counts().await?;
    pipelines.extend(counts.iter().map(|c| c.pipeline.clone()));
    {
        let mut reported = REPORTED.lock().unwrap_or_else(|e| e.into_inner());
        pipelines.extend(reported.iter().cloned());
        reported.extend(pipelines.iter().cloned());
    }
    let mut gauges = Vec::new();
    for p in &pipelines {
        for st in crate::domain::RecordState::ALL {
            let n = counts
                .iter()
                .find(|c| c.pipeline == *p && c.state == st)
                .map_or(0, |c| c.count);
            let labels = vec![("pipeline", p.clone()), ("state", st.as_str().to_owned())];
            gauges.push(("ballast_records", labels, n as f64));
        }
    }
    let pipelines: Vec<String> = pipelines.into_iter().collect();
    let oldest: std::collections::HashMap<String, i64> = state
        .db
        .oldest_due(&pipelines, now)
        .await?
        .into_iter()
        .collect();
    for p in &pipelines {
        let waited = oldest.get(p).map_or(0.0, |at| secs(now - at));
        gauges.push((
            "ballast_oldest_due_seconds",
            vec![("pipeline", p.clone())],
            waited,
        ));
    }
    for s in state.db.provider_states().await? {
        let shown = match s.breaker {
            crate::domain::BreakerState::Open if s.open_until.is_some_and(|u| u <= now) => {
                crate::domain::BreakerState::HalfOpen
            }
            b => b,
        };
        for b in [
            crate::domain::BreakerState::Closed,
            crate::domain::BreakerState::Open,
            crate::domain::BreakerState::HalfOpen,
        ] {
            let on = if shown == b { 1.0 } else { 0.0 };
            let labels = vec![
                ("provider", s.provider.clone()),
                ("state", b.as_str().to_owned()),
            ];
            gauges.push(("ballast_provider_breaker", labels, on));
        }
        let provider = || vec![("provider", s.provider.clone())];
        let paused = if s.paused { 1.0 } else { 0.0 };
        gauges.push(("ballast_provider_paused", provider(), paused));
        let left = s.throttled_until.map_or(0.0, |u| secs(u - now));
        gauges.push(("ballast_provider_throttled_seconds", provider(), left));
    }
    Ok(gauges)
}

/// `ballast_group_records{pipeline, group, state}`: records of a group in
/// each state not final, for the `server.metrics_groups` groups of each
/// pipeline with the most such records; the rest summed per pipeline in
/// `ballast_group_records_other{pipeline, state}` (a family of its own: no
/// group's name can be taken for the sum). Rendered here rather than by
/// the recorder, which keeps every series it was ever given: a group that
/// leaves the top, or finishes its work, is gone from the next scrape.
/// Without the database, the last figures read.
async fn group_family(state: &AppState) -> String {
    static LAST: Mutex<String> = Mutex::new(String::new());
    let limit = state.config.get().server.metrics_groups as usize;
    if limit == 0 {
        return String::new();
    }
    let text = match state.db.group_counts().await {
        Ok(counts) => render_groups(&top_groups(counts, limit)),
        Err(e) => {
            tracing::warn!(error = %e, "metrics: the groups' figures could not be read");
            return LAST.lock().unwrap_or_else(|e| e.into_inner()).clone();
        }
    };
    text.clone_into(&mut LAST.lock().unwrap_or_else(|e| e.into_inner()));
    text
}

/// A group as `/metrics` shows it: by name, or among the pipeline's others.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Shown {
    Named(String),
    Others,
}

/// Records per (pipeline, group shown, state): the `limit` groups of each
/// pipeline with the most records at work by name, the others summed; every
/// state not final for each, 0 where none.
fn top_groups(
    counts: Vec<crate::domain::GroupCount>,
    limit: usize,
) -> BTreeMap<(String, Shown, crate::domain::RecordState), i64> {
    let mut totals: BTreeMap<(String, String), i64> = BTreeMap::new();
    for c in &counts {
        *totals
            .entry((c.pipeline.clone(), c.group.clone()))
            .or_default() += c.count;
    }
    let mut ranked: Vec<(&(String, String), &i64)> = totals.iter().collect();
    // Most records first, then by name: the same set from every node.
    ranked.sort_by(|(a, n), (b, m)| m.cmp(n).then_with(|| a.cmp(b)));
    let mut named: BTreeMap<&str, usize> = BTreeMap::new();
    let mut shown: BTreeMap<(String, String), Shown> = BTreeMap::new();
    for ((pipeline, group), _) in ranked {
        let seen = named.entry(pipeline).or_default();
        let as_shown = match *seen < limit {
            true => Shown::Named(group.clone()),
            false => Shown::Others,
        };
        *seen += 1;
        shown.insert((pipeline.clone(), group.clone()), as_shown);
    }
    let mut out = BTreeMap::new();
    for ((pipeline, _), as_shown) in &shown {
        for st in crate::domain::RecordState::ALL
            .into_iter()
            .filter(|s| !s.is_terminal())
        {
            out.insert((pipeline.clone(), as_shown.clone(), st), 0);
        }
    }
    for c in counts {
        if let Some(as_shown) = shown.get(&(c.pipeline.clone(), c.group)) {
            *out.entry((c.pipeline, as_shown.clone(), c.state))
                .or_default() += c.count;
        }
    }
    out
}

/// The two families in Prometheus' text format, each with its HELP and
/// TYPE; nothing of one without series.
fn render_groups(figures: &BTreeMap<(String, Shown, crate::domain::RecordState), i64>) -> String {
    use std::fmt::Write as _;
    let mut named = String::new();
    let mut others = String::new();
    for ((pipeline, as_shown, st), n) in figures {
        let (pipeline, state) = (escape_label(pipeline), st.as_str());
        let _ = match as_shown {
            Shown::Named(group) => writeln!(
                named,
                "ballast_group_records{{pipeline=\"{pipeline}\",group=\"{}\",state=\"{state}\"}} {n}",
                escape_label(group)
            ),
            Shown::Others => writeln!(
                others,
                "ballast_group_records_other{{pipeline=\"{pipeline}\",state=\"{state}\"}} {n}"
            ),
        };
    }
    let mut text = String::new();
    if !named.is_empty() {
        text.push_str(
            "# HELP ballast_group_records Records of a group not finished, by pipeline, group and state, cluster-wide (aggregate with max), for the server.metrics_groups groups of each pipeline with the most.\n\
             # TYPE ballast_group_records gauge\n",
        );
        text.push_str(&named);
    }
    if !others.is_empty() {
        text.push_str(
            "# HELP ballast_group_records_other Records not finished of a pipeline's groups past the server.metrics_groups it names, summed, by pipeline and state, cluster-wide (aggregate with max).\n\
             # TYPE ballast_group_records_other gauge\n",
        );
        text.push_str(&others);
    }
    text
}

/// A label value as the text format writes it: `\`, `"` and line feeds
/// escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One gauge's name, labels and value, read from the store.
type Gauge = (&'static str, Vec<(&'static str, String)>, f64);

/// Sets the gauges read and renders the recorder in one step, under a lock:
/// the recorder is the process's, so two scrapes at once (two Prometheus
/// servers; in tests, two apps of one process) must not render a mix of
/// each other's values.
fn set_and_render(handle: &PrometheusHandle, gauges: Option<Vec<Gauge>>) -> String {
    static SCRAPE: Mutex<()> = Mutex::new(());
    let _one = SCRAPE.lock().unwrap_or_else(|e| e.into_inner());
    for (name, labels, value) in gauges.into_iter().flatten() {
        let labels: Vec<metrics::Label> = labels
            .into_iter()
            .map(|(k, v)| metrics::Label::new(k, v))
            .collect();
        metrics::gauge!(name, labels).set(value);
    }
    handle.render()
}

/// `/metrics`, limited per address as the API is (a scraper asks every
/// few seconds; a guesser of tokens gets no more).
pub fn router(state: &AppState) -> Router<AppState> {
    let per_second = u64::from(state.config.get().server.limits.api_per_second) * 4;
    let routes = Router::new().route("/metrics", get(metrics));
    super::per_address(
        routes,
        state,
        per_second,
        "too many metrics requests from your address",
    )
}

async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, WebError> {
    let presented = auth::bearer(&headers).ok_or(WebError::Unauthenticated)?;
    let by_config = state
        .web
        .keys
        .metrics_token
        .as_deref()
        .filter(|t| t.len() >= crate::auth::webhook::MIN_SECRET)
        .is_some_and(|t| bool::from(t.as_bytes().ct_eq(presented.as_bytes())));
    // A token limited to pipelines gets no scrape: its breakdowns are by
    // every pipeline.
    if !by_config && !auth::token_caller(&headers, &state).await?.sees_all() {
        return Err(WebError::Forbidden);
    }
    let handle = handle().ok_or_else(|| WebError::Internal("no metrics recorder".into()))?;
    // Without the database the cluster's gauges keep their last values,
    // and the process's own counters are still served: an outage is when
    // they matter.
    let gauges = cluster_gauges(&state)
        .await
        .inspect_err(
            |e| tracing::warn!(error = %e, "metrics: the cluster's gauges could not be read"),
        )
        .ok();
    let groups = group_family(&state).await;
    let mut text = set_and_render(handle, gauges);
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&groups);
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{GroupCount, RecordState};

    fn count(pipeline: &str, group: &str, state: RecordState, n: i64) -> GroupCount {
        GroupCount {
            pipeline: pipeline.into(),
            group: group.into(),
            state,
            count: n,
        }
    }

    #[test]
    fn the_biggest_groups_are_named_per_pipeline() {
        let counts = vec![
            count("p", "b", RecordState::Pending, 2),
            count("p", "a", RecordState::Parked, 2),
            count("p", "c", RecordState::Running, 1),
            count("p", "d", RecordState::Pending, 1),
            count("q", "z", RecordState::Waiting, 1),
        ];
        let top = top_groups(counts, 1);
        let named = |g: &str| Shown::Named(g.to_owned());
        let shown: BTreeSet<(&str, Shown)> = top
            .keys()
            .map(|(p, g, _)| (p.as_str(), g.clone()))
            .collect();
        // A tie goes by name: every node names the same group.
        assert_eq!(
            shown,
            BTreeSet::from([("p", named("a")), ("p", Shown::Others), ("q", named("z"))])
        );
        let at = |p: &str, g: Shown, s| top[&(p.to_owned(), g, s)];
        assert_eq!(at("p", Shown::Others, RecordState::Pending), 3);
        assert_eq!(at("p", Shown::Others, RecordState::Running), 1);
        assert_eq!(at("p", named("a"), RecordState::Parked), 2);
        assert_eq!(at("p", named("a"), RecordState::Pending), 0);
        // Five states not final per group shown.
        assert_eq!(top.len(), 3 * 5);
        let text = render_groups(&top);
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(
            families,
            [
                "ballast_group_records gauge",
                "ballast_group_records_other gauge"
            ]
        );
        assert!(
            text.contains("\nballast_group_records_other{pipeline=\"p\",state=\"pending\"} 3\n"),
            "{text}"
        );
        // Each family's lines together, after its HELP and TYPE.
        let first_other = text.find("ballast_group_records_other{").unwrap();
        assert!(
            !text[first_other..].contains("ballast_group_records{"),
            "{text}"
        );
        assert!(render_groups(&BTreeMap::new()).is_empty());
        let only_named = top_groups(vec![count("q", "z", RecordState::Waiting, 1)], 1);
        assert!(!render_groups(&only_named).contains("_other"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
