//! `/api/v1/records`: enqueue, list, export, inspect and act on records.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiJson, ApiPath, ApiQuery};
use crate::domain::{
    Attempt, Event, Intent, OperatorAction, Record, RecordState, StepRun, StepVersion,
};
use crate::engine::{Ops, Selection};
use crate::web::AppState;
use crate::web::auth::{Bearer, Caller, Operator, Viewer};
use crate::web::error::{WebError, WebResult};
use crate::web::query::{ExportQuery, ListQuery};
use crate::web::scope;

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(enqueue, list))
        .routes(routes!(export))
        .routes(routes!(bulk))
        .routes(routes!(get_one))
        .routes(routes!(act))
        .routes(routes!(items))
        .routes(routes!(signal))
}

/// One record to enqueue.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct EnqueueBody {
    /// A configured pipeline the token may see.
    pipeline: String,
    /// Makes the call idempotent: the same key in the same pipeline
    /// returns the record it made.
    key: Option<String>,
    /// The record's group (a tenant, say): claims share the workers fairly
    /// between groups.
    group: Option<String>,
    /// 0 to 9, 5 when left out: within its pipeline and group, a record of
    /// higher priority is claimed first (other groups keep their share).
    #[schema(minimum = 0, maximum = 9)]
    priority: Option<u8>,
    /// The pipeline's input.
    #[serde(default)]
    input: Value,
    /// Due at this UTC moment (`2026-12-02T09:00Z`), not now.
    run_at: Option<String>,
    /// Due this long from now (`90s`, `2h`), not now.
    delay: Option<String>,
}

/// One record, or a batch of them (all or none).
#[derive(Deserialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // Described, not read: the handler reads a `Value`
// so that a bad item's error names the item and what is wrong with it.
enum EnqueueRequest {
    One(EnqueueBody),
    Many(EnqueueBatch),
}

/// 1 to 1,000 records, enqueued all or none.
#[derive(Deserialize, ToSchema)]
#[allow(dead_code)] // As `EnqueueRequest`.
#[schema(min_items = 1, max_items = 1000)]
struct EnqueueBatch(Vec<EnqueueBody>);

/// Operator actions by the names the API takes and answers
/// ([`OperatorAction::as_str`]: `replay`, where the stored trigger's serde
/// name is `replay_from`). The API never serialises the enum itself.
impl utoipa::PartialSchema for OperatorAction {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some("An operator action on a record."))
            .enum_values(Some(OperatorAction::ALL.map(OperatorAction::as_str)))
            .into()
    }
}

impl ToSchema for OperatorAction {}

/// A record enqueued, or found by its key.
#[derive(Serialize, ToSchema)]
struct Enqueued {
    /// False when the key named a record already stored.
    created: bool,
    record: Record,
}

/// A batch enqueued: each item in the order sent.
#[derive(Serialize, ToSchema)]
struct EnqueuedBatch {
    /// How many records were new.
    created: usize,
    items: Vec<Enqueued>,
}

/// What `POST /records` answers: one or a batch, as sent.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
enum EnqueueAnswer {
    One(Box<Enqueued>),
    Batch(EnqueuedBatch),
}

/// Enqueue records.
///
/// One record (an object), or up to 1,000 at once (a list of the same
/// objects: all or none). 201 when a record was created, 200 when every key
/// named a record already stored; a bad item of a list is named by its
/// position. Operators.
#[utoipa::path(
    post,
    path = "/records",
    tag = "records",
    operation_id = "enqueue",
    request_body(content = EnqueueRequest, description = "One record, or a list of 1 to 1,000"),
    responses(
        (status = 201, description = "At least one record was created", body = EnqueueAnswer),
        (status = 200, description = "Every key named a record already stored", body = EnqueueAnswer),
    ),
    security(("bearer" = ["operator"]))
)]
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
    let one = !body.is_array();
    let items = match body {
        Value::Array(items) => items,
        one => vec![one],
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
        let at = if one {
            String::new()
        } else {
            format!("item {i}: ")
        };
        let body: EnqueueBody = serde_json::from_value(item)
            .map_err(|e| WebError::bad("invalid_body", format!("{at}{e}")))?;
        batch.push(to_enqueue(&state, &caller, body, now).map_err(|e| e.prefixed(&at))?);
    }
    let created = engine.enqueue_batch(batch).await?;
    let mut items: Vec<Enqueued> = created
        .into_iter()
        .map(|c| Enqueued {
            created: c.created,
            record: c.record,
        })
        .collect();
    for c in &mut items {
        crate::web::mask::list(&state, &caller, std::slice::from_mut(&mut c.record));
    }
    let new = items.iter().filter(|c| c.created).count();
    tracing::info!(records = items.len(), created = new, actor = %caller.actor, "enqueued via API");
    let status = if new > 0 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let answer = match (one, items.pop()) {
        (true, Some(item)) => EnqueueAnswer::One(Box::new(item)),
        (_, last) => {
            items.extend(last);
            EnqueueAnswer::Batch(EnqueuedBatch {
                created: new,
                items,
            })
        }
    };
    Ok((status, Json(answer)).into_response())
}

/// One enqueue request checked: a configured pipeline the caller sees (one
/// it does not is unknown to it), a key and group that are allowed, a due
/// time that parses.
fn to_enqueue(
    state: &AppState,
    caller: &Caller,
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
    crate::engine::check_priority(body.priority)
        .map_err(|e| WebError::bad("invalid_priority", e.to_string()))?;
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
        priority: body.priority,
        key: body.key,
        input: body.input,
        run_at: Some(run_at),
    })
}

/// A page of records, newest first.
#[derive(Serialize, ToSchema)]
struct RecordPage {
    items: Vec<Record>,
    /// Pass as `before` for the next page; null on the last. A page may
    /// hold fewer items than asked and still have a `next`.
    next: Option<i64>,
}

/// List records.
///
/// The records the filters select that the token may see, newest first,
/// keyset-paged (`next` is the next page's `before`).
#[utoipa::path(
    get,
    path = "/records",
    tag = "records",
    operation_id = "list_records",
    params(ListQuery),
    responses((status = 200, description = "A page of records", body = RecordPage)),
    security(("bearer" = ["viewer"]))
)]
async fn list(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> WebResult<Json<RecordPage>> {
    let filter = scope::filter(&state, &caller, &q).await?;
    let mut page = state.db.list_records(&filter).await?;
    crate::web::mask::list(&state, &caller, &mut page.items);
    Ok(Json(RecordPage {
        items: page.items,
        next: page.next,
    }))
}

/// Export records.
///
/// Every record the filters select, streamed as JSON lines (`format=jsonl`,
/// the default) or CSV, with each record's attempts when `attempts=1`.
/// Operators.
#[utoipa::path(
    get,
    path = "/records/export",
    tag = "records",
    operation_id = "export_records",
    params(ListQuery, ExportQuery),
    responses((status = 200, description = "Every record selected, streamed: a JSON object a line, or CSV",
        content(("application/x-ndjson"), ("text/csv")))),
    security(("bearer" = ["operator"]))
)]
async fn export(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<ListQuery>,
    ApiQuery(x): ApiQuery<ExportQuery>,
) -> WebResult<Response> {
    let filter = scope::filter(&state, &caller, &q).await?;
    x.respond(&state, &caller, (&q, filter)).await
}

/// A record started by one of this record's steps.
#[derive(Serialize, ToSchema)]
struct Child {
    id: i64,
    pipeline: String,
    state: RecordState,
    /// The step that started it.
    step: Option<String>,
}

/// One record with its history.
#[derive(Serialize, ToSchema)]
struct RecordView {
    record: Record,
    /// The actions its state allows, by the names `actions` takes.
    #[schema(value_type = Vec<OperatorAction>)]
    actions: Vec<&'static str>,
    steps: Vec<StepRun>,
    /// Step results replaced by a later generation.
    versions: Vec<StepVersion>,
    attempts: Vec<Attempt>,
    /// Calls written down before they left and not yet settled.
    sent: Vec<Intent>,
    events: Vec<Event>,
    /// The records its `pipeline` steps started (its parent is in the
    /// record: `parent_id`, `parent_step`).
    children: Vec<Child>,
}

/// Read a record.
///
/// The record with its steps, replaced step results, attempts, open
/// intents, events and children, and the actions its state allows now.
#[utoipa::path(
    get,
    path = "/records/{id}",
    tag = "records",
    operation_id = "get_record",
    params(("id" = i64, Path, description = "The record's id")),
    responses((status = 200, description = "The record and its history", body = RecordView)),
    security(("bearer" = ["viewer"]))
)]
async fn get_one(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
) -> WebResult<Json<RecordView>> {
    let mut record = scope::record(&state, &caller, id).await?;
    let (mut steps, mut attempts, mut events, mut versions, mut sent, children) = tokio::try_join!(
        state.db.step_runs(id),
        state.db.attempts(id),
        state.db.record_events(id),
        state.db.step_versions(id),
        state.db.open_intents(id),
        state.db.children(id)
    )?;
    let children = children
        .into_iter()
        .filter(|c| caller.sees(&c.pipeline))
        .map(|c| Child {
            id: c.id,
            pipeline: c.pipeline,
            state: c.state,
            step: c.parent_step,
        })
        .collect();
    let (offered, _) = crate::web::query::offered(&state, &record, &steps).await;
    let actions = offered.iter().map(|a| a.as_str()).collect();
    // Sensitive fields masked for a caller without `unmask`.
    if let Some(mut shown) = crate::web::mask::Shown::of(&state, &caller, &record.pipeline) {
        shown.record(&mut record, &mut steps, &mut versions);
        shown.attempts(&mut attempts);
        shown.intents(&mut sent);
        shown.events(&mut events);
    }
    Ok(Json(RecordView {
        record,
        actions,
        steps,
        versions,
        attempts,
        sent,
        events,
        children,
    }))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct ItemsQuery {
    /// The first item's index (0 when unset; taken into 0 to the most
    /// items a step may have).
    from: Option<i64>,
    /// How many (100 when unset; taken into 1 to 1,000).
    limit: Option<i64>,
}

/// A page of a step's items.
#[derive(Serialize, ToSchema)]
struct ItemPage {
    /// Each item's run, in order.
    items: Vec<StepRun>,
    /// The index to ask `from` for more; null after the last.
    next: Option<i64>,
}

/// Read a step's items.
///
/// The items of a record's step for each item, in order from index `from`:
/// each item's run (state, attempts, error, output).
#[utoipa::path(
    get,
    path = "/records/{id}/items/{step}",
    tag = "records",
    operation_id = "list_items",
    params(
        ("id" = i64, Path, description = "The record's id"),
        ("step" = String, Path, description = "A step for each item"),
        ItemsQuery,
    ),
    responses((status = 200, description = "A page of the step's items", body = ItemPage)),
    security(("bearer" = ["viewer"]))
)]
async fn items(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    ApiPath((id, step)): ApiPath<(i64, String)>,
    ApiQuery(q): ApiQuery<ItemsQuery>,
) -> WebResult<Json<ItemPage>> {
    let record = scope::record(&state, &caller, id).await?;
    let from = q
        .from
        .unwrap_or(0)
        .clamp(0, crate::domain::each::MAX_ITEMS as i64);
    let limit = q.limit.unwrap_or(100).clamp(1, 1_000);
    let mut items = state.db.item_runs(id, &step, from, limit + 1).await?;
    if let Some(mut shown) = crate::web::mask::Shown::of(&state, &caller, &record.pipeline) {
        let (mut record, mut runs) = (record, state.db.step_runs(id).await?);
        shown.record(&mut record, &mut runs, &mut []);
        shown.items(&mut items);
    }
    let next = (items.len() as i64 > limit).then_some(from + limit);
    items.truncate(limit as usize);
    Ok(Json(ItemPage { items, next }))
}

/// An operator's action on one record.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ActBody {
    #[schema(value_type = OperatorAction)]
    action: String,
    /// Why (kept in the audit log; required to park).
    reason: Option<String>,
    /// For `replay`: the step the replay starts from.
    step: Option<String>,
    /// For `park`: `never`, `provider`, a duration (`2h`) or a UTC time.
    until: Option<String>,
    /// For `took_effect`: the job the provider made (a job step).
    job_id: Option<String>,
    /// For `took_effect`: the step's outputs as the provider has them (a
    /// request step).
    output: Option<Value>,
    /// For `retry` and `replay`: the record's input from now on (the
    /// audit entry keeps the old and the new).
    input: Option<Value>,
    /// For `replay`: on the pipeline's current version, the record
    /// pinned to it from now (otherwise on the one it started with).
    #[serde(default)]
    on_current_version: bool,
    /// For `replay` a step for each item: `failed` runs again only
    /// its items that did not succeed; `all` (the default) every item.
    #[schema(pattern = "^(all|failed)$")]
    items: Option<String>,
}

/// The record after an action or a signal.
#[derive(Serialize, ToSchema)]
struct Acted {
    record: Record,
    /// For a signal: true when this signal (its `Idempotency-Key`) was
    /// taken before and this changed nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    again: Option<bool>,
}

/// Act on a record.
///
/// One operator action, by the dashboard's rules; audited. Operators.
#[utoipa::path(
    post,
    path = "/records/{id}/actions",
    tag = "records",
    operation_id = "act_on_record",
    params(("id" = i64, Path, description = "The record's id")),
    request_body = ActBody,
    responses((status = 200, description = "The record after the action", body = Acted)),
    security(("bearer" = ["operator"]))
)]
async fn act(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
    ApiJson(body): ApiJson<ActBody>,
) -> WebResult<Json<Acted>> {
    let rec = scope::record(&state, &caller, id).await?;
    if body.input.is_some() {
        crate::web::mask::may_edit(&state, &caller, &rec.pipeline)?;
    }
    let action = Ops::parse_action(&body.action)?;
    let reason = body.reason.filter(|r| !r.trim().is_empty());
    let mut record = if action == OperatorAction::TookEffect {
        if body.on_current_version {
            return Err(WebError::bad(
                "current_needs_replay",
                "only a replay runs a record on the current version",
            ));
        }
        state
            .ops()
            .took_effect(
                id,
                &caller.actor,
                reason,
                body.job_id.as_deref(),
                body.output,
            )
            .await?
    } else {
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
        state
            .ops()
            .act_with(id, action, &caller.actor, reason, extra)
            .await?
    };
    crate::web::mask::list(&state, &caller, std::slice::from_mut(&mut record));
    Ok(Json(Acted {
        record,
        again: None,
    }))
}

/// Signal a waiting step.
///
/// Ends a step's wait for a signal; the JSON body becomes the step's
/// output. An `Idempotency-Key` header names the signal: sent again once
/// taken, it changes nothing and answers 200 with `again: true`. Operators.
#[utoipa::path(
    post,
    path = "/records/{id}/signals/{step}",
    tag = "records",
    operation_id = "signal_record",
    params(
        ("id" = i64, Path, description = "The record's id"),
        ("step" = String, Path, description = "A step that waits for a signal"),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200,
            description = "Names the signal: sent again, it changes nothing"),
    ),
    request_body(content = Value, description = "The step's output"),
    responses((status = 200, description = "The record after the signal", body = Acted)),
    security(("bearer" = ["operator"]))
)]
async fn signal(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiPath((id, step)): ApiPath<(i64, String)>,
    headers: axum::http::HeaderMap,
    ApiJson(body): ApiJson<Value>,
) -> WebResult<Json<Acted>> {
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
    crate::web::mask::list(&state, &caller, std::slice::from_mut(&mut taken.record));
    Ok(Json(Acted {
        record: taken.record,
        again: Some(taken.again),
    }))
}

/// The records page's bulk action. The records are `ids`, or every record
/// `filter` matches (the list's filters; `{}` is every record), at most
/// `bulk_max`; a `reason` is required; it is a dry run (what would be
/// done, nothing changed) unless `"apply": true`, which counts against the
/// caller's bulk actions per minute.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    #[schema(value_type = OperatorAction)]
    action: String,
    /// Why (kept in each record's audit entry).
    #[schema(required = true, value_type = String, pattern = r"\S")]
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
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct BulkFilter {
    pipeline: Option<String>,
    state: Option<String>,
    provider: Option<String>,
    step: Option<String>,
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

impl From<BulkFilter> for ListQuery {
    fn from(f: BulkFilter) -> ListQuery {
        ListQuery {
            pipeline: f.pipeline,
            state: f.state,
            provider: f.provider,
            step: f.step,
            error_code: f.error_code,
            group: f.group,
            priority: f.priority,
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

/// An allowed record the action still failed for.
#[derive(Serialize, ToSchema)]
struct BulkFailure {
    id: i64,
    /// Why, in words.
    error: String,
}

/// What a bulk action did, or would do.
#[derive(Serialize, ToSchema)]
struct BulkReport {
    #[schema(value_type = OperatorAction)]
    action: &'static str,
    /// False for a dry run.
    applied: bool,
    /// Records the selection named.
    matched: usize,
    /// Those whose state allows the action (acted on when applied).
    allowed_ids: Vec<i64>,
    /// How many records' state does not allow it.
    refused: usize,
    failed: Vec<BulkFailure>,
}

/// Act on many records.
///
/// The records are `ids`, or every record `filter` matches (`{}`: every
/// record), up to the configured cap; a dry run (what would be done) unless
/// `apply` is true. Each record acted on is audited as a single action is.
/// Operators.
#[utoipa::path(
    post,
    path = "/records/bulk",
    tag = "records",
    operation_id = "bulk_action",
    request_body = BulkBody,
    responses((status = 200, description = "What was done, or would be", body = BulkReport)),
    security(("bearer" = ["operator"]))
)]
async fn bulk(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiJson(body): ApiJson<BulkBody>,
) -> WebResult<Json<BulkReport>> {
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
    let outcome = crate::web::query::bulk(&state, &caller, selection, what, body.apply).await?;
    let failed = outcome
        .failed
        .into_iter()
        .map(|(id, e)| BulkFailure {
            id,
            error: WebError::from(e).to_string(),
        })
        .collect();
    Ok(Json(BulkReport {
        action: action.as_str(),
        applied: body.apply,
        matched: outcome.matched,
        allowed_ids: outcome.allowed_ids,
        refused: outcome.refused,
        failed,
    }))
}
