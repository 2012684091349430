//! `/api/v1`: the JSON API, for bearer API tokens with the same roles and
//! the same action rules as the dashboard. Rate-limited per token. Errors
//! are `{"error": code, "message": text}` with stable codes.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

use crate::config::WebLimits;
use crate::web::AppState;

use super::auth::{Admin, ApiKey, Bearer, Operator, Viewer};
use super::error::{WebError, WebResult};
use super::query::ListQuery;
use super::scope;
use crate::engine::{Ops, Selection};

/// The API's routes with two limits: per token (`api_per_second`, bursts of
/// twice that) and, outside it, per client address (four times as much), so
/// that inventing tokens does not buy more requests.
pub fn router(state: &AppState) -> Router<AppState> {
    let limits: &WebLimits = &state.config.get().server.limits;
    let trusted: Arc<[std::net::IpAddr]> = state.web.keys.trusted_proxies.clone();
    let per_second = u64::from(limits.api_per_second.max(1));
    let mut routes = Router::new()
        .route("/records", post(enqueue).get(list))
        .route("/records/export", get(export))
        .route("/records/bulk", post(bulk))
        .route("/records/{id}", get(get_one))
        .route("/records/{id}/actions", post(act))
        .route("/records/{id}/items/{step}", get(items))
        .route("/records/{id}/signals/{step}", post(signal))
        .route("/providers", get(providers))
        .route("/providers/{name}/pause", post(pause_provider))
        .route("/providers/{name}/resume", post(resume_provider))
        .route("/providers/{name}/reset-breaker", post(reset_breaker))
        .route("/audit", get(audit))
        .route("/search", get(search))
        .route("/users", get(users))
        .route("/tokens", get(tokens))
        .route("/reload", post(reload));
    let refuse = |_| {
        let mut r = WebError::TooManyRequests("API rate limit exceeded".into()).into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    };
    let per_token = GovernorConfigBuilder::default()
        .key_extractor(ApiKey {
            trusted: trusted.clone(),
        })
        .per_millisecond((1000 / per_second).max(1))
        .burst_size(u32::try_from(per_second * 2).unwrap_or(u32::MAX))
        .finish();
    if let Some(config) = per_token {
        let limiter = config.limiter().clone();
        super::clean_every_minute(state.shutdown.clone(), move || limiter.retain_recent());
        routes = routes.layer(GovernorLayer::new(Arc::new(config)).error_handler(refuse));
    }
    super::per_address(routes, state, per_second * 4, "API rate limit exceeded")
}

/// `Json` whose rejections are API errors with stable codes.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = WebError;

    async fn from_request(req: Request, state: &S) -> Result<Self, WebError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(WebError::bad(
                "unsupported_media_type",
                "send the body as application/json",
            )),
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(WebError::bad("malformed_json", e.body_text()))
            }
            Err(JsonRejection::JsonDataError(e)) => {
                Err(WebError::bad("invalid_body", e.body_text()))
            }
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(WebError::TooLarge),
            Err(e) => Err(WebError::bad("invalid_body", e.body_text())),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnqueueBody {
    pipeline: String,
    /// Makes the call idempotent: the same key returns the same record.
    key: Option<String>,
    /// The record's group (a tenant, say): see `Enqueue::group`.
    group: Option<String>,
    #[serde(default)]
    input: Value,
    /// Due at this UTC moment (`2026-12-02T09:00Z`), not now.
    run_at: Option<String>,
    /// Due this long from now (`90s`, `2h`), not now.
    delay: Option<String>,
}

/// `GET /api/v1/providers`: every provider the caller may see, as the
/// providers page shows it (`web::providers::ProviderStatus`).
async fn providers(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
) -> WebResult<Json<Value>> {
    let items = super::providers::statuses(&state, &caller).await?;
    Ok(Json(json!({ "items": items })))
}

/// The provider `name` as the caller sees it after a change.
async fn provider_after(
    state: &AppState,
    caller: &super::auth::Caller,
    name: &str,
) -> WebResult<Json<Value>> {
    let all = super::providers::statuses(state, caller).await?;
    let found = all.into_iter().find(|p| p.name == name);
    let found = found.ok_or_else(|| WebError::NotFound(format!("no provider {name}")))?;
    Ok(Json(json!(found)))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    reason: Option<String>,
}

/// `POST /api/v1/providers/{name}/pause` (admins, as on the page):
/// every node holds its calls until resumed; audited.
async fn pause_provider(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> WebResult<Json<Value>> {
    // The body is optional: none, or `{"reason": "…"}`.
    let body: PauseBody = match body.is_empty() {
        true => PauseBody::default(),
        false => serde_json::from_slice(&body)
            .map_err(|e| WebError::bad("invalid_body", format!("the body: {e}")))?,
    };
    let reason = body.reason.filter(|r| !r.trim().is_empty());
    state
        .ops()
        .pause_provider(&name, true, &caller.actor, reason)
        .await?;
    provider_after(&state, &caller, &name).await
}

/// `POST /api/v1/providers/{name}/resume` (admins); audited.
async fn resume_provider(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> WebResult<Json<Value>> {
    state
        .ops()
        .pause_provider(&name, false, &caller.actor, None)
        .await?;
    provider_after(&state, &caller, &name).await
}

/// `POST /api/v1/providers/{name}/reset-breaker` (admins): closes the
/// breaker here and in the shared state; audited.
async fn reset_breaker(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> WebResult<Json<Value>> {
    state.ops().reset_breaker(&name, &caller.actor).await?;
    provider_after(&state, &caller, &name).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    actor: Option<String>,
    kind: Option<String>,
    before: Option<i64>,
    limit: Option<u32>,
}

/// `GET /api/v1/audit?actor=&kind=&before=&limit=`: the audit log, newest
/// first, keyset-paged (`next` is the next page's `before`); a caller
/// limited to pipelines reads the actions on their records only.
async fn audit(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    Query(q): Query<AuditQuery>,
) -> WebResult<Json<Value>> {
    let filter = crate::store::AuditFilter {
        actor: super::query::non_empty(&q.actor),
        kind: super::query::non_empty(&q.kind),
        before: q.before,
        limit: q
            .limit
            .filter(|l| *l > 0)
            .unwrap_or(100)
            .min(crate::store::MAX_PAGE),
        pipelines: None,
    };
    let page = super::query::audit_log(&state, &caller, filter).await?;
    Ok(Json(json!({ "items": page.items, "next": page.next })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchQuery {
    q: String,
}

/// `GET /api/v1/search?q=`: what the search box finds: `named`, the
/// records `q` names (an id, a key in any pipeline, a provider's job
/// id), and `matches`, the newest 50 holding every word of it.
async fn search(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    Query(q): Query<SearchQuery>,
) -> WebResult<Json<Value>> {
    let q = q.q.trim();
    if q.is_empty() {
        return Err(WebError::bad(
            "bad_query",
            "`q` is empty: say what to look for",
        ));
    }
    let (named, matches) = super::query::search(&state, &caller, q).await?;
    Ok(Json(json!({ "named": named, "matches": matches })))
}

/// `GET /api/v1/users` (admins): every user, as the users page lists them
/// (never a password hash).
async fn users(_caller: Bearer<Admin>, State(state): State<AppState>) -> WebResult<Json<Value>> {
    Ok(Json(json!({ "items": state.db.list_users().await? })))
}

/// `GET /api/v1/tokens` (admins): every API token, as the tokens page
/// lists them: its prefix, never its secret or hash; when last used.
async fn tokens(_caller: Bearer<Admin>, State(state): State<AppState>) -> WebResult<Json<Value>> {
    Ok(Json(json!({ "items": state.db.list_api_tokens().await? })))
}

/// `POST /api/v1/reload` (admins): this node reads its configuration file
/// again, as SIGHUP makes it. 200 with what changed, or 409
/// `config_refused` with why (the running configuration kept).
async fn reload(caller: Bearer<Admin>, State(state): State<AppState>) -> WebResult<Json<Value>> {
    // Its own task: a caller that hangs up does not stop a reload half
    // way (between the swap and its log line and audit entry).
    let reloader = state.reloader.clone();
    let actor = caller.actor.clone();
    let done = tokio::spawn(async move { reloader.reload(&actor).await })
        .await
        .map_err(|e| WebError::Internal(format!("the reload task failed: {e}")))?;
    match done {
        Ok(done) => Ok(Json(json!(done))),
        Err(refused) => Err(WebError::Conflict {
            code: "config_refused",
            message: refused.0,
        }),
    }
}

/// `POST /api/v1/records`: one record (an object), or up to
/// [`MAX_BATCH`](crate::store::MAX_BATCH) at once (a list of the same
/// objects: all or none, in one statement on PostgreSQL). 201 when a
/// record was created, 200 when every key named one already stored.
async fn enqueue(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> WebResult<Response> {
    let engine = state
        .engine
        .as_ref()
        .ok_or_else(|| WebError::bad("no_workers", "this node has no pipelines configured"))?;
    let now = engine.now_ms();
    let Value::Array(items) = body else {
        let body: EnqueueBody = serde_json::from_value(body)
            .map_err(|e| WebError::bad("invalid_body", e.to_string()))?;
        let item = to_enqueue(&state, &caller, body, now)?;
        let mut created = engine.enqueue_batch(vec![item]).await?;
        let mut created = created
            .pop()
            .ok_or_else(|| WebError::Internal("nothing enqueued".into()))?;
        super::mask::list(&state, &caller, std::slice::from_mut(&mut created.record));
        tracing::info!(record.id = created.record.id, actor = %caller.actor, created = created.created, "enqueued via API");
        let status = if created.created {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        };
        return Ok((
            status,
            Json(json!({ "created": created.created, "record": created.record })),
        )
            .into_response());
    };
    if items.is_empty() || items.len() > crate::store::MAX_BATCH {
        return Err(WebError::bad(
            "invalid_batch",
            format!(
                "a list of 1 to {} records, not {}",
                crate::store::MAX_BATCH,
                items.len()
            ),
        ));
    }
    let mut batch = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let body: EnqueueBody = serde_json::from_value(item)
            .map_err(|e| WebError::bad("invalid_body", format!("item {i}: {e}")))?;
        let item = to_enqueue(&state, &caller, body, now);
        batch.push(item.map_err(|e| e.prefixed(&format!("item {i}: ")))?);
    }
    let mut created = engine.enqueue_batch(batch).await?;
    for c in &mut created {
        super::mask::list(&state, &caller, std::slice::from_mut(&mut c.record));
    }
    let new = created.iter().filter(|c| c.created).count();
    tracing::info!(records = created.len(), created = new, actor = %caller.actor, "enqueued a batch via API");
    let status = if new > 0 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let items: Vec<Value> = created
        .iter()
        .map(|c| json!({ "created": c.created, "record": c.record }))
        .collect();
    Ok((status, Json(json!({ "created": new, "items": items }))).into_response())
}

/// One enqueue request checked: a configured pipeline the caller sees (one
/// it does not is unknown to it), a key and group that are allowed, a due
/// time that parses.
fn to_enqueue(
    state: &AppState,
    caller: &super::auth::Caller,
    body: EnqueueBody,
    now: crate::domain::UnixMs,
) -> WebResult<crate::engine::Enqueue> {
    if !state.config.get().pipelines.contains_key(&body.pipeline) || !caller.sees(&body.pipeline) {
        return Err(WebError::bad(
            "unknown_pipeline",
            format!("unknown pipeline `{}`", body.pipeline),
        ));
    }
    if let Some(k) = &body.key {
        crate::domain::schedule::check_key(k).map_err(|e| WebError::bad("invalid_key", e))?;
    }
    crate::engine::check_group(body.group.as_deref())
        .map_err(|e| WebError::bad("invalid_group", e.to_string()))?;
    let delay = body
        .delay
        .as_deref()
        .map(crate::config::parse_duration)
        .transpose()
        .map_err(|e| WebError::bad("invalid_delay", e))?;
    let run_at = crate::domain::schedule::due_at(body.run_at.as_deref(), delay, now)
        .map_err(|e| WebError::bad("invalid_run_at", e))?;
    Ok(crate::engine::Enqueue {
        pipeline: body.pipeline,
        group: body.group,
        key: body.key,
        input: body.input,
        run_at: Some(run_at),
    })
}

async fn list(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
) -> WebResult<Json<Value>> {
    let filter = scope::filter(&state, &caller, &q).await?;
    let mut page = state.db.list_records(&filter).await?;
    super::mask::list(&state, &caller, &mut page.items);
    Ok(Json(json!({ "items": page.items, "next": page.next })))
}

/// `GET /api/v1/records/export?format=jsonl|csv&attempts=1&<filters>`:
/// every record the filters select, streamed (operators).
async fn export(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
    Query(x): Query<crate::web::query::ExportQuery>,
) -> WebResult<Response> {
    let filter = scope::filter(&state, &caller, &q).await?;
    x.respond(&state, &caller, (&q, filter)).await
}

async fn get_one(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> WebResult<Json<Value>> {
    let mut record = scope::record(&state, &caller, id).await?;
    let (mut steps, mut attempts, mut events, mut versions, mut sent, children) = tokio::try_join!(
        state.db.step_runs(id),
        state.db.attempts(id),
        state.db.record_events(id),
        state.db.step_versions(id),
        state.db.open_intents(id),
        state.db.children(id)
    )?;
    // The records its `pipeline` steps started (its parent is in the
    // record: `parent_id`, `parent_step`).
    let children: Vec<Value> = children
        .iter()
        .filter(|c| caller.sees(&c.pipeline))
        .map(|c| json!({ "id": c.id, "pipeline": c.pipeline, "state": c.state, "step": c.parent_step }))
        .collect();
    // By the names the act endpoint takes.
    let (offered, _) = crate::web::query::offered(&state, &record, &steps).await;
    let actions: Vec<&str> = offered.iter().map(|a| a.as_str()).collect();
    // Sensitive fields masked for a caller without `unmask`.
    if let Some(mut shown) = super::mask::Shown::of(&state, &caller, &record.pipeline) {
        shown.record(&mut record, &mut steps, &mut versions);
        shown.attempts(&mut attempts);
        shown.intents(&mut sent);
        shown.events(&mut events);
    }
    Ok(Json(json!({
        "record": record,
        "actions": actions,
        "steps": steps,
        "versions": versions,
        "attempts": attempts,
        "sent": sent,
        "events": events,
        "children": children,
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ItemsQuery {
    /// The first item's index (0 when unset).
    from: Option<i64>,
    /// How many (100 when unset, at most 1,000).
    limit: Option<i64>,
}

/// The items of a record's step for each item, in order: each item's run
/// (state, attempts, error, output) from index `from`; `next` is the
/// index to ask from for more.
async fn items(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    Path((id, step)): Path<(i64, String)>,
    Query(q): Query<ItemsQuery>,
) -> WebResult<Json<Value>> {
    let record = scope::record(&state, &caller, id).await?;
    let from = q
        .from
        .unwrap_or(0)
        .clamp(0, crate::domain::each::MAX_ITEMS as i64);
    let limit = q.limit.unwrap_or(100).clamp(1, 1_000);
    let mut items = state.db.item_runs(id, &step, from, limit + 1).await?;
    if let Some(mut shown) = super::mask::Shown::of(&state, &caller, &record.pipeline) {
        let (mut record, mut runs) = (record, state.db.step_runs(id).await?);
        shown.record(&mut record, &mut runs, &mut []);
        shown.items(&mut items);
    }
    let next = (items.len() as i64 > limit).then_some(from + limit);
    items.truncate(limit as usize);
    Ok(Json(json!({ "items": items, "next": next })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActBody {
    action: String,
    reason: Option<String>,
    step: Option<String>,
    /// For `park`: `never`, `provider`, a duration (`2h`) or a UTC time.
    until: Option<String>,
    /// For `took_effect`: the job the provider made (a job step).
    job_id: Option<String>,
    /// For `took_effect`: the step's outputs as the provider has them (a
    /// request step).
    output: Option<Value>,
    /// For `retry` and `replay_from`: the record's input from now on (the
    /// audit entry keeps the old and the new).
    input: Option<Value>,
    /// For `replay_from`: on the pipeline's current version, the record
    /// pinned to it from now (otherwise on the one it started with).
    #[serde(default)]
    on_current_version: bool,
    /// For `replay` from a step for each item: `"failed"` runs again only
    /// its items that did not succeed; `"all"` (the default) every item.
    items: Option<String>,
}

async fn act(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
    ApiJson(body): ApiJson<ActBody>,
) -> WebResult<Json<Value>> {
    let rec = scope::record(&state, &caller, id).await?;
    if body.input.is_some() {
        super::mask::may_edit(&state, &caller, &rec.pipeline)?;
    }
    let action = Ops::parse_action(&body.action)?;
    let reason = body.reason.filter(|r| !r.trim().is_empty());
    if action == crate::domain::OperatorAction::TookEffect {
        if body.on_current_version {
            return Err(WebError::bad(
                "current_needs_replay",
                "only a replay runs a record on the current version",
            ));
        }
        let mut record = state
            .ops()
            .took_effect(
                id,
                &caller.actor,
                reason,
                body.job_id.as_deref(),
                body.output,
            )
            .await?;
        super::mask::list(&state, &caller, std::slice::from_mut(&mut record));
        return Ok(Json(json!({ "record": record })));
    }
    let extra = crate::engine::ActExtra {
        step: body.step.as_deref(),
        until: body.until.as_deref(),
        input: body
            .input
            .map(|new| crate::store::InputEdit { new, was: None }),
        on_current: body.on_current_version,
        failed_items: match body.items.as_deref() {
            None | Some("all") => false,
            Some("failed") => true,
            Some(other) => {
                return Err(WebError::bad(
                    "bad_items",
                    format!("`items` is \"all\" or \"failed\", not {other:?}"),
                ));
            }
        },
    };
    let mut record = state
        .ops()
        .act_with(id, action, &caller.actor, reason, extra)
        .await?;
    super::mask::list(&state, &caller, std::slice::from_mut(&mut record));
    Ok(Json(json!({ "record": record })))
}

/// `POST /api/v1/records/{id}/signals/{step}` (operators): ends the
/// step's wait for a signal, its JSON body the step's output. An
/// `Idempotency-Key` header names the signal: sent again once taken, it
/// changes nothing and answers 200 with `"again": true`.
async fn signal(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    Path((id, step)): Path<(i64, String)>,
    headers: axum::http::HeaderMap,
    ApiJson(body): ApiJson<Value>,
) -> WebResult<Json<Value>> {
    scope::record(&state, &caller, id).await?;
    let signal_id = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(v.to_str().map(str::to_owned).map_err(|_| {
            WebError::bad("bad_signal_id", "the Idempotency-Key header is not text")
        })?),
    };
    let mut taken = state
        .ops()
        .signal(id, &step, &caller.actor, body, signal_id)
        .await
        .map_err(|e| match WebError::from(e) {
            // A pass is working the record: the same signal may be sent
            // again in a moment.
            e if e.code() == "record_busy" => WebError::NotNow(e.to_string()),
            // Not waiting (yet, or any more): the record's state decides.
            e if e.code() == "nothing_awaited" => WebError::Conflict {
                code: "nothing_awaited",
                message: e.to_string(),
            },
            e => e,
        })?;
    super::mask::list(&state, &caller, std::slice::from_mut(&mut taken.record));
    Ok(Json(
        json!({ "record": taken.record, "again": taken.again }),
    ))
}

/// `POST /api/v1/records/bulk`: the records page's bulk action. The
/// records are `ids`, or every record `filter` matches (the list's
/// filters; `{}` is every record), at most `bulk_max`; a `reason` is
/// required; it is a dry run (what would be done, nothing changed) unless
/// `"apply": true`, which counts against the caller's bulk actions per
/// minute. Each record acted on is audited as a single action is.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    action: String,
    reason: Option<String>,
    /// The step a replay starts from.
    step: Option<String>,
    #[serde(default)]
    ids: Vec<i64>,
    filter: Option<BulkFilter>,
    #[serde(default)]
    apply: bool,
}

/// The records list's filters, strictly: a misspelled key is refused
/// rather than read as "any" (which would widen the action to every
/// record), and there is no page or cursor (a bulk action takes every
/// record matching, up to the cap).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkFilter {
    pipeline: Option<String>,
    state: Option<String>,
    provider: Option<String>,
    step: Option<String>,
    error_code: Option<String>,
    group: Option<String>,
    q: Option<String>,
    until: Option<String>,
    created_from: Option<String>,
    created_to: Option<String>,
    updated_from: Option<String>,
    updated_to: Option<String>,
}

impl From<BulkFilter> for ListQuery {
    fn from(f: BulkFilter) -> ListQuery {
        ListQuery {
            pipeline: f.pipeline,
            state: f.state,
            provider: f.provider,
            step: f.step,
            error_code: f.error_code,
            group: f.group,
            q: f.q,
            until: f.until,
            created_from: f.created_from,
            created_to: f.created_to,
            updated_from: f.updated_from,
            updated_to: f.updated_to,
            before: None,
            limit: None,
        }
    }
}

async fn bulk(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiJson(body): ApiJson<BulkBody>,
) -> WebResult<Json<Value>> {
    let action = Ops::parse_action(&body.action)?;
    let reason = body
        .reason
        .filter(|r| !r.trim().is_empty())
        .ok_or_else(|| {
            WebError::bad("reason_required", crate::domain::action::BULK_NEEDS_REASON)
        })?;
    let selection = match (body.filter, body.ids.is_empty()) {
        (Some(f), true) => Selection::Matching(Box::new(ListQuery::from(f).to_filter()?)),
        (None, false) => Selection::Ids(body.ids),
        (Some(_), false) => {
            return Err(WebError::bad(
                "bad_selection",
                "give `ids` or a `filter`, not both",
            ));
        }
        (None, true) => {
            return Err(WebError::bad(
                "bad_selection",
                "give `ids`, or a `filter` (`{}` for every record)",
            ));
        }
    };
    let step = body.step.filter(|s| !s.is_empty());
    let what = (action, reason.as_str(), step.as_deref());
    let outcome = super::query::bulk(&state, &caller, selection, what, body.apply).await?;
    let failed: Vec<Value> = outcome
        .failed
        .into_iter()
        .map(|(id, e)| json!({ "id": id, "error": WebError::from(e).to_string() }))
        .collect();
    Ok(Json(json!({
        "action": action.as_str(),
        "applied": body.apply,
        "matched": outcome.matched,
        "allowed_ids": outcome.allowed_ids,
        "refused": outcome.refused,
        "failed": failed,
    })))
}
