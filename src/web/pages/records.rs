//! Records: the filtered list with bulk actions, one record's detail with
//! its timeline and attempts, and the operator actions.

use askama::Template;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use crate::domain::awaiting::Awaits;
use crate::domain::{OperatorAction, Record, RecordState};
use crate::engine::{Ops, Selection};
use crate::web::AppState;
use crate::web::auth::{Authed, Operator, Viewer};
use crate::web::error::{WebError, WebResult};
use crate::web::htmx::is_htmx;
use crate::web::query::{ListQuery, non_empty};
use crate::web::scope;

use super::{Nav, html, when, when_opt};
use crate::web::fmt::millis;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/records", get(list))
        .route("/records/bulk", post(bulk))
        .route("/records/enqueue", post(enqueue))
        .route("/records/export", get(export))
        .route("/search", get(search))
        .route("/records/{id}", get(detail))
        .route("/records/{id}/actions", post(act))
        .route("/records/{id}/live", get(live))
}

pub struct RecordRow {
    pub id: i64,
    pub pipeline: String,
    pub key: String,
    pub group: String,
    pub priority: u8,
    pub state: &'static str,
    pub step: String,
    pub provider: String,
    pub error_code: String,
    pub reason: String,
    pub updated: String,
    /// For a parked record: when it resumes by itself, or that a human
    /// decides; empty otherwise.
    pub until: String,
    /// Its condition's kind (`time`, `provider`, `never`; empty unless
    /// parked), and a time condition as a `datetime-local` value.
    pub until_kind: &'static str,
    pub until_time: String,
}

impl From<&Record> for RecordRow {
    fn from(r: &Record) -> Self {
        RecordRow {
            id: r.id,
            pipeline: r.pipeline.clone(),
            key: r.external_key.clone().unwrap_or_default(),
            group: r.group.clone().unwrap_or_default(),
            priority: r.priority,
            state: r.state.as_str(),
            step: r.step.clone().unwrap_or_default(),
            provider: r.provider.clone().unwrap_or_default(),
            error_code: r.error_code.clone().unwrap_or_default(),
            reason: crate::domain::excerpt(r.reason.as_deref().unwrap_or(""), 160).to_owned(),
            updated: when(r.updated_at),
            until: match (&r.park_until, r.state) {
                (Some(u), _) => u.to_string(),
                (None, crate::domain::RecordState::Parked) => "never: a human decides".into(),
                (None, _) => String::new(),
            },
            until_kind: match (&r.park_until, r.state) {
                (Some(u), _) => u.kind().as_str(),
                (None, crate::domain::RecordState::Parked) => "never",
                (None, _) => "",
            },
            until_time: match &r.park_until {
                Some(crate::domain::park::ParkUntil::Time { at }) => {
                    crate::domain::time::format_ms(*at)
                        .chars()
                        .take(16)
                        .collect()
                }
                _ => String::new(),
            },
        }
    }
}

#[derive(Template)]
#[template(path = "pages/records.html", blocks = ["list"])]
struct RecordsPage {
    nav: Nav,
    f: ListQuery,
    filters: String,
    pipelines: Vec<String>,
    providers: Vec<String>,
    states: Vec<&'static str>,
    untils: Vec<&'static str>,
    rows: Vec<RecordRow>,
    next: Option<i64>,
    /// The search stopped at its budget before filling the page.
    partial: bool,
    bulk_max: u32,
}

impl RecordsPage {
    fn sel(&self, field: &Option<String>, value: &str) -> bool {
        field.as_deref() == Some(value)
    }

    fn val(&self, field: &Option<String>) -> String {
        field.clone().unwrap_or_default()
    }

    /// The priorities, highest first, for the filter and the enqueue form.
    fn priorities(&self) -> Vec<u8> {
        (0..=crate::domain::MAX_PRIORITY).rev().collect()
    }

    fn is_default_priority(&self, p: impl std::borrow::Borrow<u8>) -> bool {
        *p.borrow() == crate::domain::DEFAULT_PRIORITY
    }
}

async fn list(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> WebResult<Response> {
    let filter = scope::filter(&state, &caller, &q).await?;
    let mut page = state.db.list_records(&filter).await?;
    crate::web::mask::list(&state, &caller, &mut page.items);
    let t = RecordsPage {
        nav: Nav::new(&caller, "records"),
        filters: q.query_string(),
        f: q,
        pipelines: state
            .config
            .get()
            .pipelines
            .keys()
            .filter(|p| caller.sees(p))
            .cloned()
            .collect(),
        providers: {
            let config = state.config.get();
            let shown = scope::providers(&config, &caller);
            let shown = |p: &String| shown.as_ref().is_none_or(|s| s.contains(p));
            config
                .providers
                .keys()
                .filter(|p| shown(p))
                .cloned()
                .collect()
        },
        states: RecordState::ALL.iter().map(|s| s.as_str()).collect(),
        untils: crate::domain::park::UntilKind::ALL
            .iter()
            .map(|u| u.as_str())
            .collect(),
        partial: page.next.is_some() && (page.items.len() as u32) < filter.limit.max(1),
        rows: page.items.iter().map(RecordRow::from).collect(),
        next: page.next,
        bulk_max: state.config.get().server.limits.bulk_max,
    };
    if is_htmx(&headers) {
        return html(&t.as_list());
    }
    html(&t)
}

#[derive(Deserialize)]
struct SearchQuery {
    q: Option<String>,
}

#[derive(Template)]
#[template(path = "pages/search.html", blocks = ["results"])]
struct SearchPage {
    nav: Nav,
    q: String,
    /// Named by id, key or job id.
    named: Vec<RecordRow>,
    /// Holding the words.
    worded: Vec<RecordRow>,
}

/// The header's search box: the record a query names by id, key or
/// provider job id (straight to it when it is one), and the newest
/// records holding its words.
async fn search(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    Query(sq): Query<SearchQuery>,
) -> WebResult<Response> {
    let q = sq.q.unwrap_or_default().trim().to_owned();
    if q.is_empty() {
        return Ok(Redirect::to("/records").into_response());
    }
    let (named, worded) = crate::web::query::search(&state, &caller, &q).await?;
    // The results' own refresh (htmx) stays on this page.
    let live = crate::web::htmx::is_htmx(&headers);
    if let ([one], false) = (named.as_slice(), live) {
        return Ok(Redirect::to(&format!("/records/{}", one.id)).into_response());
    }
    let page = SearchPage {
        nav: Nav::new(&caller, "records"),
        q,
        named: named.iter().map(RecordRow::from).collect(),
        worded: worded.iter().map(RecordRow::from).collect(),
    };
    if live {
        return html(&page.as_results());
    }
    html(&page)
}

/// The list's records, as its filters select them, downloaded as JSON
/// Lines or CSV (operators: inputs and outputs in bulk).
async fn export(
    caller: Authed<Operator>,
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
    Query(x): Query<crate::web::query::ExportQuery>,
) -> WebResult<Response> {
    let filter = scope::filter(&state, &caller, &q).await?;
    x.respond(&state, &caller, (&q, filter)).await
}

/// The records page's enqueue form (operators): one record, due now or
/// later.
#[derive(Deserialize)]
struct EnqueueForm {
    pipeline: String,
    key: Option<String>,
    group: Option<String>,
    /// 0 to 9; empty: the default.
    priority: Option<String>,
    input: Option<String>,
    /// A `datetime-local` value, read as UTC.
    run_at: Option<String>,
    /// `90s`, `2h`, `1d`.
    delay: Option<String>,
}

async fn enqueue(
    caller: Authed<Operator>,
    State(state): State<AppState>,
    axum::Form(form): axum::Form<EnqueueForm>,
) -> WebResult<Response> {
    let bad = |code: &'static str, message: String| WebError::bad(code, message);
    let engine = state
        .engine
        .as_ref()
        .ok_or_else(|| bad("no_workers", "this node has no pipelines configured".into()))?;
    if !state.config.get().pipelines.contains_key(&form.pipeline) || !caller.sees(&form.pipeline) {
        return Err(bad(
            "unknown_pipeline",
            format!("unknown pipeline `{}`", form.pipeline),
        ));
    }
    let input = match non_empty(&form.input) {
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| bad("invalid_input", format!("the input is not JSON: {e}")))?,
        None => serde_json::json!({}),
    };
    let delay = non_empty(&form.delay)
        .map(|d| crate::config::parse_duration(&d))
        .transpose()
        .map_err(|e| bad("invalid_delay", e))?;
    let run_at = non_empty(&form.run_at);
    let due = crate::domain::schedule::due_at(run_at.as_deref(), delay, engine.now_ms())
        .map_err(|e| bad("invalid_run_at", e))?;
    let key = non_empty(&form.key);
    if let Some(k) = &key {
        crate::domain::schedule::check_key(k).map_err(|e| bad("invalid_key", e))?;
    }
    let group = non_empty(&form.group);
    crate::engine::check_group(group.as_deref())
        .map_err(|e| bad("invalid_group", e.to_string()))?;
    let priority = match non_empty(&form.priority) {
        Some(p) => Some(
            p.parse::<u8>()
                .map_err(|_| bad("invalid_priority", format!("priority `{p}` is not 0 to 9")))?,
        ),
        None => None,
    };
    crate::engine::check_priority(priority).map_err(|e| bad("invalid_priority", e.to_string()))?;
    let created = engine
        .enqueue(
            crate::engine::Enqueue::new(&form.pipeline, key.as_deref(), input)
                .in_group(group.as_deref())
                .with_priority(priority)
                .at(due),
        )
        .await?;
    tracing::info!(record.id = created.record.id, actor = %caller.actor, created = created.created, "enqueued on the dashboard");
    Ok(Redirect::to(&format!("/records/{}", created.record.id)).into_response())
}

struct StepView {
    name: String,
    state: &'static str,
    provider: String,
    attempts: i32,
    job_id: String,
    output: String,
    error_code: String,
    reason: String,
    started: String,
    finished: String,
}

struct AttemptView {
    at: String,
    step: String,
    attempt_no: i32,
    duration: String,
    status: String,
    outcome: &'static str,
    error_code: String,
    /// What was sent, as text; empty when nothing was kept (a webhook
    /// delivery, which nothing was sent for, or an attempt from before
    /// requests were kept).
    request: String,
    excerpt: String,
}

/// A kept request as an HTTP message reads: the request line, one line
/// per header, a blank line and the start of the body.
fn request_text(r: &crate::domain::request::SentRequest) -> String {
    let mut out = format!("{} {}", r.method, r.url);
    for (name, value) in &r.headers {
        out.push_str(&format!("\n{name}: {value}"));
    }
    if let Some(body) = &r.body {
        out.push_str("\n\n");
        out.push_str(body);
    }
    out
}

/// One version of a step's result: a replaced one, or the current one.
struct VersionView {
    step: String,
    generation: i32,
    made_by: String,
    finished: String,
    /// When and by what it was replaced; empty for the current one.
    replaced: String,
    output: String,
    /// The generation before it (for a "compare" link), if any.
    before: Option<i32>,
}

/// The difference between two versions of one step's output.
struct DiffView {
    step: String,
    from: i32,
    to: i32,
    changes: Vec<ChangeView>,
    more: usize,
}

struct ChangeView {
    op: &'static str,
    path: String,
    old: String,
    new: String,
}

/// `?diff=STEP&from=G&to=G`: the versions compared on a record page; by
/// default the last two of the first step that has several.
#[derive(Debug, Default, Deserialize)]
pub struct DiffQuery {
    diff: Option<String>,
    from: Option<i32>,
    to: Option<i32>,
    /// The first item shown of each step for each item.
    items_from: Option<i64>,
}

/// How many items of a step for each item the record page shows at once.
const ITEMS_SHOWN: i64 = 100;

/// A page of the items of one step for each item.
struct ItemsView {
    step: String,
    /// Each item runs a child record (its job id), linked.
    children: bool,
    /// How far they are (`7 of 10 items done: …`).
    said: String,
    rows: Vec<StepView>,
    /// The first item of the next page, when there is one.
    next: Option<i64>,
}

/// The items of the record's steps for each item (its pipeline's
/// `shape` says which), a page of each from item `from`.
async fn item_views(
    state: &AppState,
    shown: Option<&crate::web::mask::Shown>,
    rec: &crate::domain::Record,
    (shape, steps): (&[crate::domain::pipeline::Shape], &[crate::domain::StepRun]),
    from: i64,
) -> WebResult<Vec<ItemsView>> {
    let mut out = Vec::new();
    for s in shape.iter().filter(|s| s.each.is_some()) {
        let Some(run) = steps.iter().find(|r| r.step == s.name) else {
            continue;
        };
        let from = from.clamp(0, crate::domain::each::MAX_ITEMS as i64);
        let mut rows = state
            .db
            .item_runs(rec.id, &s.name, from, ITEMS_SHOWN + 1)
            .await?;
        if let Some(shown) = shown {
            shown.items(&mut rows);
        }
        let shown = rows.iter().take(ITEMS_SHOWN as usize);
        out.push(ItemsView {
            step: s.name.clone(),
            children: s.children,
            said: run.reason.clone().unwrap_or_default(),
            rows: shown.map(|r| StepView::of(rec, r)).collect(),
            next: (rows.len() as i64 > ITEMS_SHOWN).then_some(from + ITEMS_SHOWN),
        });
    }
    Ok(out)
}

/// Every version of each step (replaced ones, then the current one), in
/// step order then generation.
fn versions(
    steps: &[crate::domain::StepRun],
    old: &[crate::domain::StepVersion],
) -> Vec<(String, i32, Option<serde_json::Value>, VersionView)> {
    let mut out = Vec::new();
    for s in steps {
        let kept: Vec<_> = old.iter().filter(|v| v.step == s.step).collect();
        if kept.is_empty() {
            continue;
        }
        let mut before = None;
        for v in kept {
            let view = VersionView {
                before,
                step: v.step.clone(),
                generation: v.generation,
                made_by: v.cause.clone().unwrap_or_else(|| "first run".into()),
                finished: when_opt(v.finished_at),
                replaced: format!("{} ({})", when(v.replaced_at), v.replaced_by),
                output: v.output.as_ref().map(pretty).unwrap_or_default(),
            };
            out.push((v.step.clone(), v.generation, v.output.clone(), view));
            before = Some(v.generation);
        }
        let view = VersionView {
            before,
            step: s.step.clone(),
            generation: s.generation,
            made_by: s.cause.clone().unwrap_or_else(|| "first run".into()),
            finished: when_opt(s.finished_at),
            replaced: String::new(),
            output: s.output.as_ref().map(pretty).unwrap_or_default(),
        };
        out.push((s.step.clone(), s.generation, s.output.clone(), view));
    }
    out
}

/// The difference `q` asks for among `all` versions, or the default one.
fn version_diff(
    all: &[(String, i32, Option<serde_json::Value>, VersionView)],
    q: &DiffQuery,
) -> Option<DiffView> {
    let step = q
        .diff
        .clone()
        .or_else(|| all.first().map(|v| v.0.clone()))?;
    let of_step: Vec<_> = all.iter().filter(|v| v.0 == step).collect();
    if of_step.len() < 2 {
        return None;
    }
    let pick = |g: Option<i32>, default: usize| {
        g.and_then(|g| of_step.iter().find(|v| v.1 == g))
            .or_else(|| of_step.get(default))
            .copied()
    };
    let to = pick(q.to, of_step.len() - 1)?;
    let from = pick(q.from, of_step.len() - 2)?;
    let null = serde_json::Value::Null;
    let (changes, more) = crate::domain::diff::diff(
        from.2.as_ref().unwrap_or(&null),
        to.2.as_ref().unwrap_or(&null),
        200,
    );
    let text = |v: &serde_json::Value| crate::domain::excerpt(&v.to_string(), 500).to_owned();
    Some(DiffView {
        step,
        from: from.1,
        to: to.1,
        changes: changes
            .iter()
            .map(|c| match c {
                crate::domain::diff::Change::Added { path, new } => ChangeView {
                    op: "added",
                    path: path.clone(),
                    old: String::new(),
                    new: text(new),
                },
                crate::domain::diff::Change::Removed { path, old } => ChangeView {
                    op: "removed",
                    path: path.clone(),
                    old: text(old),
                    new: String::new(),
                },
                crate::domain::diff::Change::Changed { path, old, new } => ChangeView {
                    op: "changed",
                    path: path.clone(),
                    old: text(old),
                    new: text(new),
                },
            })
            .collect(),
        more,
    })
}

struct EventView {
    at: String,
    kind: String,
    actor: String,
    audit: bool,
    change: String,
    step: String,
    reason: String,
}

impl EventView {
    fn of(e: &crate::domain::Event) -> Self {
        EventView {
            at: when(e.at),
            kind: e.kind.clone(),
            actor: e.actor.clone(),
            audit: e.audit,
            change: match (e.from_state, e.to_state) {
                (Some(f), Some(t)) if f != t => format!("{f} → {t}"),
                (_, Some(t)) => t.to_string(),
                _ => String::new(),
            },
            step: e.step.clone().unwrap_or_default(),
            reason: e.reason.clone().unwrap_or_default(),
        }
    }
}

#[derive(Template)]
#[template(
    path = "pages/record.html",
    blocks = ["detail", "head", "actions_part", "history", "ticker"]
)]
struct RecordPage {
    nav: Nav,
    /// Its sensitive fields are shown masked (the input cannot be edited
    /// here then).
    masked: bool,
    /// The pipeline version the record runs on, and how it stands to the
    /// one new records get.
    pinned: String,
    /// The version new records get, when it is not the record's (a replay
    /// may move the record onto it); empty otherwise.
    newer: String,
    r: RecordRow,
    created: String,
    finished: String,
    next_run: String,
    input: String,
    /// The items of its steps for each item, a page of each.
    items: Vec<ItemsView>,
    steps: Vec<StepView>,
    attempts: Vec<AttemptView>,
    events: Vec<EventView>,
    actions: Vec<&'static str>,
    /// The steps waiting for an approval (the decision form's).
    awaiting: Vec<String>,
    /// The record and step that started this one (a child record's).
    parent: Option<(i64, String)>,
    /// The records this one's `pipeline` steps started.
    children: Vec<ChildView>,
    replay_steps: Vec<String>,
    /// The record's steps drawn as its pipeline, each in its state.
    graph: crate::web::graph::Graph,
    /// The attempts in a lane per step, over the record's life so far.
    lanes: crate::web::lanes::Lanes,
    /// For "it took effect" on a request step: its outputs to fill in (a
    /// JSON object); empty for a job step, which names its job.
    took_outputs: String,
    versions: Vec<VersionView>,
    diff: Option<DiffView>,
    /// What the page shows of the record, as [`version_of`] names it: the
    /// live poll asks whether it is still current.
    version: String,
    /// Rendered for the live poll: the parts swap themselves in (htmx's
    /// out-of-band swap).
    oob: bool,
}

/// A child record, as its parent's page lists it.
struct ChildView {
    id: i64,
    pipeline: String,
    state: &'static str,
    /// The parent's step that started it.
    step: String,
    reason: String,
}

impl ChildView {
    fn of(c: &Record) -> Self {
        ChildView {
            id: c.id,
            pipeline: c.pipeline.clone(),
            state: c.state.as_str(),
            step: c.parent_step.clone().unwrap_or_default(),
            reason: c.reason.clone().unwrap_or_default(),
        }
    }
}

/// The version a record runs on (`pipeline_versions.id`), said against
/// the version new records get on this node.
fn pinned_version(pinned: Option<i64>, current: Option<i64>) -> String {
    match (pinned, current) {
        (Some(v), Some(c)) if v == c => format!("version {v} (current)"),
        (Some(v), Some(c)) => format!("version {v} (new records get version {c})"),
        (Some(v), None) => format!("version {v} (the pipeline is not configured here)"),
        (None, _) => "the current version (not pinned)".to_owned(),
    }
}

/// Whether step `name` (in `state`) is where `rec` is parked: the step
/// that parked it, unless it had finished (an operator parked the record
/// after it). Such a step reads `parked`, not what it was about to do.
fn parked_at(
    rec: &crate::domain::Record,
    name: &str,
    state: Option<crate::domain::StepState>,
) -> bool {
    use crate::domain::StepState;
    let finished = matches!(
        state,
        Some(StepState::Succeeded | StepState::Failed | StepState::Skipped)
    );
    rec.state == RecordState::Parked && rec.step.as_deref() == Some(name) && !finished
}

/// A record's steps as a graph of its pipeline (`shape`: each step and
/// what it needs; when the pipeline is not known here, the step runs
/// alone), each box saying where its step run is.
fn step_graph(
    rec: &crate::domain::Record,
    shape: &[crate::domain::pipeline::Shape],
    runs: &[crate::domain::StepRun],
) -> crate::web::graph::Graph {
    use crate::domain::StepState;
    use crate::web::graph::{Spec, layout};
    let mut specs: Vec<Spec<'_>> = shape.iter().map(Spec::of).collect();
    for r in runs {
        if !shape.iter().any(|s| s.name == r.step) {
            specs.push(Spec::new(&r.step, &[]));
        }
    }
    let title = format!("The steps of record {}, each in its state", rec.id);
    layout("record-steps", &title, &specs, |_, n| {
        let run = runs.iter().find(|r| r.step == n.name);
        let parked_here = parked_at(rec, &n.name, run.map(|r| r.state));
        let (class, word) = match run.map(|r| r.state) {
            _ if parked_here => ("parked", "parked"),
            None => ("unstarted", "not started"),
            Some(StepState::Pending) if run.is_some_and(|r| r.attempts == 0) => {
                ("unstarted", "not started")
            }
            Some(StepState::Pending) => ("pending", "due"),
            Some(StepState::Running) => ("running", "running"),
            Some(StepState::Waiting) => match run.and_then(Awaits::of) {
                Some(Awaits::Approval) => ("waiting", "awaits approval"),
                Some(Awaits::Signal) => ("waiting", "awaits a signal"),
                None if run.is_some_and(|r| {
                    r.error_code.as_deref() == Some(crate::domain::child::PARKED)
                }) =>
                {
                    ("parked", "child parked")
                }
                None if run.is_some_and(|r| {
                    r.error_code.as_deref() == Some(crate::domain::child::AWAITING)
                }) =>
                {
                    ("waiting", "awaits its child")
                }
                None if run.is_some_and(|r| r.job_id.is_none() && r.provider.is_none()) => {
                    ("waiting", "asleep")
                }
                None => ("waiting", "waiting on its job"),
            },
            Some(StepState::Retrying) => ("retrying", "retrying"),
            Some(StepState::Succeeded) => ("succeeded", "done"),
            Some(StepState::Failed) => ("failed", "failed"),
            Some(StepState::Skipped) => ("skipped", "skipped"),
        };
        n.class = class;
        n.state = word.to_owned();
        // A step for each item says how far its items are (its items
        // have the attempts); one that calls nothing (a sleep, an
        // approval) has no attempts to count.
        let items = run.filter(|_| n.stacked).and_then(|r| r.reason.as_deref());
        if let Some(done) = items.and_then(|why| why.split(':').next()) {
            n.lines.push(done.to_owned());
        } else if let Some(r) = run.filter(|r| r.provider.is_some() || r.attempts > 0) {
            n.lines.push(format!(
                "{} · {} attempt{}",
                r.provider.as_deref().unwrap_or("—"),
                r.attempts,
                if r.attempts == 1 { "" } else { "s" }
            ));
        }
        if let Some(r) = run {
            if let (Some(s), Some(f)) = (r.started_at, r.finished_at) {
                n.lines.push(format!("took {}", millis(f - s)));
            }
            if let Some(code) = &r.error_code {
                n.lines.push(code.clone());
            }
        }
    })
}

/// A record's [`Records::record_version`] as the page's live poll carries it.
fn version_of(v: [i64; 5]) -> String {
    v.map(|n| n.to_string()).join("-")
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

async fn record_page(
    state: &AppState,
    caller: &crate::web::auth::Caller,
    id: i64,
    q: &DiffQuery,
) -> WebResult<RecordPage> {
    // Read first: a change landing while the page is read shows at the
    // next poll rather than never.
    let version = state.db.record_version(id).await?.unwrap_or_default();
    record_page_at(state, caller, id, q, version).await
}

/// A record's attempts as its page lists them, newest first: calls
/// written down and sent with no reply kept yet (`at_most_once`) above
/// the attempts made.
fn attempt_views(
    open: &[crate::domain::Intent],
    attempts: &[crate::domain::Attempt],
) -> Vec<AttemptView> {
    let sent = open.iter().rev().map(|i| AttemptView {
        at: when(i.sent_at),
        step: i.step.clone(),
        attempt_no: i.attempt_no,
        duration: "—".into(),
        status: "—".into(),
        outcome: "sent",
        error_code: String::new(),
        request: i.request.as_ref().map(request_text).unwrap_or_default(),
        excerpt: format!(
            "sent by {}; no reply kept yet: in flight, or its node stopped (then whether it took effect is not known)",
            i.node.as_deref().unwrap_or("a node")
        ),
    });
    sent.chain(attempts.iter().rev().map(|a| {
        AttemptView {
            at: when(a.started_at),
            step: a.step.clone(),
            attempt_no: a.attempt_no,
            duration: millis(a.duration_ms),
            status: a
                .http_status
                .map(|s| s.to_string())
                .unwrap_or_else(|| "—".into()),
            outcome: a.outcome.as_str(),
            error_code: a.error_code.clone().unwrap_or_default(),
            request: a.request.as_ref().map(request_text).unwrap_or_default(),
            excerpt: a.excerpt.clone().unwrap_or_default(),
        }
    }))
    .collect()
}

/// [`record_page`] with its version already read (the live poll's).
/// The steps a replay may start from: the record's own version's (its
/// step runs when that version is not known here), then those only the
/// current version has, since a replay may run on it.
fn replay_steps(
    state: &AppState,
    rec: &crate::domain::Record,
    shape: Vec<crate::domain::pipeline::Shape>,
    steps: &[crate::domain::StepRun],
    current: Option<i64>,
) -> Vec<String> {
    let mut names: Vec<String> = match &state.engine {
        Some(_) if !shape.is_empty() => shape.into_iter().map(|s| s.name).collect(),
        _ => steps.iter().map(|s| s.step.clone()).collect(),
    };
    if current.is_none() || current == rec.pipeline_version {
        return names;
    }
    if let Some(p) = state
        .engine
        .as_ref()
        .and_then(|e| e.versions().pipeline(&rec.pipeline))
    {
        for s in &p.steps {
            if !names.contains(&s.name) {
                names.push(s.name.clone());
            }
        }
    }
    names
}

/// For a record whose uncertain call `run` is at a `request` step: the
/// step's outputs as a JSON object of empty strings, for the operator to
/// fill in ("it took effect"); none for a job step (it names its job).
async fn took_outputs(
    state: &AppState,
    rec: &crate::domain::Record,
    run: &crate::domain::StepRun,
) -> Option<String> {
    let step = state
        .engine
        .as_ref()?
        .versions()
        .step_of(rec, &run.step)
        .await?;
    if step.kind.made() != crate::domain::kind::Made::Output {
        return None;
    }
    let blank: serde_json::Map<String, serde_json::Value> = step
        .outputs
        .keys()
        .map(|k| (k.clone(), serde_json::Value::String(String::new())))
        .collect();
    Some(serde_json::Value::Object(blank).to_string())
}

impl StepView {
    /// A step run as the record page's Steps table shows it.
    fn of(rec: &crate::domain::Record, s: &crate::domain::StepRun) -> Self {
        StepView {
            name: s.step.clone(),
            state: if parked_at(rec, &s.step, Some(s.state)) {
                "parked"
            } else {
                s.state.as_str()
            },
            provider: s.provider.clone().unwrap_or_default(),
            attempts: s.attempts,
            job_id: s.job_id.clone().unwrap_or_default(),
            output: s.output.as_ref().map(pretty).unwrap_or_default(),
            error_code: s.error_code.clone().unwrap_or_default(),
            reason: s.reason.clone().unwrap_or_default(),
            started: when_opt(s.started_at),
            finished: when_opt(s.finished_at),
        }
    }
}

/// A record and its history as `caller` may see them (`shown_record`).
struct Seen {
    rec: Record,
    /// Its parent, when the caller sees it.
    parent: Option<i64>,
    steps: Vec<crate::domain::StepRun>,
    attempts: Vec<crate::domain::Attempt>,
    events: Vec<crate::domain::Event>,
    replaced: Vec<crate::domain::StepVersion>,
    open: Vec<crate::domain::Intent>,
    children: Vec<Record>,
    /// How its sensitive fields were masked, when they were.
    shown: Option<crate::web::mask::Shown>,
}

/// Record `id` and its history, read at once, within the caller's
/// pipelines, its sensitive fields masked for a caller without `unmask`
/// (who then cannot edit the input: the page shows it masked).
async fn shown_record(
    state: &AppState,
    caller: &crate::web::auth::Caller,
    id: i64,
) -> WebResult<Seen> {
    let mut rec = scope::record(state, caller, id).await?;
    // A parent in a pipeline the caller does not see is not named.
    let parent = match rec.parent_id {
        Some(p) if !caller.sees_all() => scope::record(state, caller, p).await.ok().map(|r| r.id),
        other => other,
    };
    let (mut steps, mut attempts, mut events, mut replaced, mut open, children) = tokio::try_join!(
        state.db.step_runs(id),
        state.db.attempts(id),
        state.db.record_events(id),
        state.db.step_versions(id),
        state.db.open_intents(id),
        state.db.children(id)
    )?;
    let mut shown = crate::web::mask::Shown::of(state, caller, &rec.pipeline);
    if let Some(s) = shown.as_mut() {
        s.record(&mut rec, &mut steps, &mut replaced);
        s.attempts(&mut attempts);
        s.intents(&mut open);
        s.events(&mut events);
    }
    Ok(Seen {
        rec,
        parent,
        steps,
        attempts,
        events,
        replaced,
        open,
        children,
        shown,
    })
}

async fn record_page_at(
    state: &AppState,
    caller: &crate::web::auth::Caller,
    id: i64,
    q: &DiffQuery,
    version: [i64; 5],
) -> WebResult<RecordPage> {
    let Seen {
        rec,
        parent,
        steps,
        attempts,
        events,
        replaced,
        open,
        children,
        shown,
    } = shown_record(state, caller, id).await?;
    let masked = shown.is_some();
    let all_versions = versions(&steps, &replaced);
    let diff = version_diff(&all_versions, q);
    let shape = match &state.engine {
        Some(e) => e.versions().graph_of(&rec).await,
        None => Vec::new(),
    };
    let graph = step_graph(&rec, &shape, &steps);
    let from = q.items_from.unwrap_or(0);
    let items = item_views(state, shown.as_ref(), &rec, (&shape, &steps), from).await?;
    let order: Vec<String> = shape.iter().map(|s| s.name.clone()).collect();
    let lanes = crate::web::lanes::lanes(
        &order,
        &attempts,
        rec.created_at,
        rec.finished_at.unwrap_or_else(|| state.clock.now_ms()),
        when,
    );
    let current = state
        .engine
        .as_ref()
        .and_then(|e| e.versions().current(&rec.pipeline));
    let replay_steps = replay_steps(state, &rec, shape, &steps, current);
    // "It took effect" only where one call's outcome is uncertain (the
    // same answer `took_effect` acts on): a job step names its job, a
    // request step its outputs (a JSON object with the step's output
    // names, offered empty).
    let (offered, uncertain) = crate::web::query::offered(state, &rec, &steps).await;
    let took_outputs = match &uncertain {
        Some(run) => took_outputs(state, &rec, run).await,
        None => None,
    };
    let actions = if caller.can(crate::domain::Role::Operator) {
        offered.into_iter().map(|a| a.as_str()).collect()
    } else {
        Vec::new()
    };
    let awaiting = crate::domain::awaiting::waiting_for(&steps, Awaits::Approval)
        .into_iter()
        .map(|r| r.step.clone())
        .collect();
    Ok(RecordPage {
        nav: Nav::new(caller, "records"),
        awaiting,
        parent: parent.map(|p| (p, rec.parent_step.clone().unwrap_or_default())),
        children: children
            .iter()
            .filter(|c| caller.sees(&c.pipeline))
            .map(ChildView::of)
            .collect(),
        pinned: pinned_version(rec.pipeline_version, current),
        newer: current
            .filter(|c| rec.pipeline_version.is_some_and(|v| v != *c))
            .map(|c| c.to_string())
            .unwrap_or_default(),
        r: RecordRow::from(&rec),
        created: when(rec.created_at),
        finished: when_opt(rec.finished_at),
        next_run: when_opt(rec.next_run_at),
        input: pretty(&rec.input),
        items,
        steps: steps.iter().map(|s| StepView::of(&rec, s)).collect(),
        attempts: attempt_views(&open, &attempts),
        events: events.iter().rev().map(EventView::of).collect(),
        actions,
        replay_steps,
        graph,
        lanes,
        took_outputs: took_outputs.unwrap_or_default(),
        versions: all_versions.into_iter().map(|v| v.3).collect(),
        diff,
        version: version_of(version),
        oob: false,
        masked,
    })
}

async fn detail(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    Query(q): Query<DiffQuery>,
) -> WebResult<Response> {
    let t = record_page(&state, &caller, id, &q).await?;
    if is_htmx(&headers) {
        return html(&t.as_detail());
    }
    html(&t)
}

#[derive(Deserialize)]
struct LiveQuery {
    /// The version the page shows.
    v: Option<String>,
}

/// The record page's poll (`#record-live`, every 3 s while the page is
/// open and not paused): `204 No Content` while the record and its
/// attempts are as the page shows them (one statement, two indexed
/// probes: the whole cost of a page that watches a quiet record); else
/// the page's head, actions and history, swapped in out of band (the
/// page keeps its actions while a field in them is being filled in), and
/// the next poll.
async fn live(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Query(q): Query<LiveQuery>,
) -> WebResult<Response> {
    if !caller.sees_all() {
        scope::record(&state, &caller, id).await?;
    }
    let now = state
        .db
        .record_version(id)
        .await?
        .ok_or_else(|| WebError::NotFound(format!("record {id} not found")))?;
    if q.v.as_deref() == Some(version_of(now).as_str()) {
        return Ok(axum::http::StatusCode::NO_CONTENT.into_response());
    }
    let mut t = record_page_at(&state, &caller, id, &DiffQuery::default(), now).await?;
    t.oob = true;
    let body = [
        t.as_head().render()?,
        t.as_actions_part().render()?,
        t.as_history().render()?,
        t.as_ticker().render()?,
    ]
    .concat();
    Ok(axum::response::Html(body).into_response())
}

#[derive(Deserialize)]
struct ActForm {
    action: String,
    reason: Option<String>,
    step: Option<String>,
    /// For `park`: `never`, `provider`, or `time` with `until_time`.
    until: Option<String>,
    /// A `datetime-local` value, read as UTC.
    until_time: Option<String>,
    /// For `took_effect`: the job the provider made (a job step).
    job_id: Option<String>,
    /// For `took_effect`: the step's outputs, a JSON object (a request
    /// step).
    output: Option<String>,
    /// For `retry` and `replay`: the input, as the page showed it or as
    /// the operator edited it (JSON); changed, it replaces the
    /// record's.
    input: Option<String>,
    /// The input as the page showed it: the textarea is an edit only when
    /// it says something else, and refused if the record's input is no
    /// longer this.
    input_was: Option<String>,
    /// For `replay`: a ticked box (`on`) replays on the pipeline's
    /// current version.
    on_current: Option<String>,
    /// For `replay` from a step for each item: a ticked box (`on`) runs
    /// again only its items that did not succeed.
    failed_items: Option<String>,
}

/// The input a retry or replay form gives: `None` when the textarea says
/// what the page showed (`was`), else the edit, checked against `was`.
fn edited_input(
    text: Option<&str>,
    was: Option<&str>,
) -> Result<Option<crate::store::InputEdit>, crate::engine::OpsError> {
    let parse = |t: &str| serde_json::from_str::<serde_json::Value>(t);
    let Some(text) = text.filter(|t| !t.trim().is_empty()) else {
        return Ok(None);
    };
    let new = parse(text).map_err(|e| crate::engine::OpsError::Refused {
        code: "bad_input",
        message: format!("the input is not JSON ({e}); nothing was done"),
    })?;
    let was = was.and_then(|w| parse(w).ok());
    if was.as_ref() == Some(&new) {
        return Ok(None);
    }
    Ok(Some(crate::store::InputEdit { new, was }))
}

async fn act(
    caller: Authed<Operator>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    axum::Form(form): axum::Form<ActForm>,
) -> WebResult<Response> {
    let rec = scope::record(&state, &caller, id).await?;
    let action = Ops::parse_action(&form.action)?;
    let reason = non_empty(&form.reason);
    let step = non_empty(&form.step);
    if action == OperatorAction::TookEffect {
        let output =
            match non_empty(&form.output) {
                Some(text) => Some(serde_json::from_str(&text).map_err(|e| {
                    crate::engine::OpsError::Refused {
                        code: "bad_output",
                        message: format!(
                            "the outputs are not JSON ({e}): write them as {{\"name\": value}}"
                        ),
                    }
                })?),
                None => None,
            };
        state
            .ops()
            .took_effect(
                id,
                &caller.actor,
                reason,
                non_empty(&form.job_id).as_deref(),
                output,
            )
            .await?;
        if is_htmx(&headers) {
            let t = record_page(&state, &caller, id, &DiffQuery::default()).await?;
            return html(&t.as_detail());
        }
        return Ok(Redirect::to(&format!("/records/{id}")).into_response());
    }
    // The form's choice of condition; a time is typed beside it.
    let until = match non_empty(&form.until).as_deref() {
        Some("time") => Some(non_empty(&form.until_time).unwrap_or_else(|| "time".into())),
        other => other.map(str::to_owned),
    };
    let input = edited_input(form.input.as_deref(), form.input_was.as_deref())?;
    if input.is_some() {
        crate::web::mask::may_edit(&state, &caller, &rec.pipeline)?;
    }
    let extra = crate::engine::ActExtra {
        step: step.as_deref(),
        until: until.as_deref(),
        input,
        on_current: form.on_current.as_deref() == Some("on"),
        failed_items: form.failed_items.as_deref() == Some("on"),
    };
    state
        .ops()
        .act_with(id, action, &caller.actor, reason, extra)
        .await?;
    if is_htmx(&headers) {
        let t = record_page(&state, &caller, id, &DiffQuery::default()).await?;
        return html(&t.as_detail());
    }
    Ok(Redirect::to(&format!("/records/{id}")).into_response())
}

/// A bulk request: explicit ids, or every record matching the filters.
#[derive(Debug, Deserialize)]
struct BulkForm {
    #[serde(default)]
    ids: Vec<i64>,
    #[serde(default)]
    all_matching: Option<String>,
    action: String,
    reason: Option<String>,
    step: Option<String>,
    /// `preview` (the default) counts; `apply` acts.
    mode: Option<String>,
    // The list's filters, for `all_matching` (the step filter is named
    // apart from the replay step).
    pipeline: Option<String>,
    state: Option<String>,
    provider: Option<String>,
    filter_step: Option<String>,
    error_code: Option<String>,
    group: Option<String>,
    priority: Option<String>,
    q: Option<String>,
    until: Option<String>,
    created_from: Option<String>,
    created_to: Option<String>,
    updated_from: Option<String>,
    updated_to: Option<String>,
}

impl BulkForm {
    fn filter(&self) -> ListQuery {
        ListQuery {
            pipeline: self.pipeline.clone(),
            state: self.state.clone(),
            provider: self.provider.clone(),
            step: self.filter_step.clone(),
            error_code: self.error_code.clone(),
            group: self.group.clone(),
            priority: self.priority.clone(),
            q: self.q.clone(),
            until: self.until.clone(),
            created_from: self.created_from.clone(),
            created_to: self.created_to.clone(),
            updated_from: self.updated_from.clone(),
            updated_to: self.updated_to.clone(),
            before: None,
            limit: None,
        }
    }
}

#[derive(Template)]
#[template(path = "pages/bulk.html", blocks = ["result"])]
struct BulkPage {
    nav: Nav,
    /// What the selection was: ids ticked, or the filter used.
    scope: String,
    action: &'static str,
    reason: String,
    step: String,
    applied: bool,
    matched: usize,
    allowed_ids: Vec<i64>,
    refused: usize,
    failed: Vec<String>,
}

async fn bulk(
    caller: Authed<Operator>,
    State(state): State<AppState>,
    headers: HeaderMap,
    axum_extra::extract::Form(form): axum_extra::extract::Form<BulkForm>,
) -> WebResult<Response> {
    let action = Ops::parse_action(&form.action)?;
    let reason = non_empty(&form.reason).ok_or_else(|| {
        WebError::bad("reason_required", crate::domain::action::BULK_NEEDS_REASON)
    })?;
    let step = non_empty(&form.step);
    let selection = if form.all_matching.is_some() {
        Selection::Matching(Box::new(form.filter().to_filter()?))
    } else {
        Selection::Ids(form.ids.clone())
    };
    let apply = form.mode.as_deref() == Some("apply");
    let what = (action, reason.as_str(), step.as_deref());
    let outcome = crate::web::query::bulk(&state, &caller, selection, what, apply).await?;
    let scope = if form.all_matching.is_some() {
        let q = form.filter().query_string();
        if q.is_empty() {
            "every record".to_owned()
        } else {
            format!("every record matching {}", q.replace('&', ", "))
        }
    } else {
        "the records ticked in the list".to_owned()
    };
    let t = BulkPage {
        nav: Nav::new(&caller, "records"),
        scope,
        action: action.as_str(),
        reason,
        step: step.unwrap_or_default(),
        applied: apply,
        matched: outcome.matched,
        allowed_ids: outcome.allowed_ids,
        refused: outcome.refused,
        // Through WebError, so a store error reads as it does anywhere
        // on the pages (an opaque "internal error", its detail logged).
        failed: outcome
            .failed
            .into_iter()
            .map(|(id, e)| format!("record {id}: {}", WebError::from(e)))
            .collect(),
    };
    if is_htmx(&headers) {
        return html(&t.as_result());
    }
    html(&t)
}
