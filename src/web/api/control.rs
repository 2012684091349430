//! The API's other resources, as the dashboard shows them: providers (and
//! their pause and breaker), the audit log, search, users, tokens and a
//! configuration reload.

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiPath, ApiQuery};
use crate::domain::{ApiToken, Event, Record, User};
use crate::reload::Reloaded;
use crate::web::AppState;
use crate::web::auth::{Admin, Bearer, Caller, Viewer};
use crate::web::error::{WebError, WebResult};
use crate::web::providers::ProviderStatus;

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(providers))
        .routes(routes!(pause_provider))
        .routes(routes!(resume_provider))
        .routes(routes!(reset_breaker))
        .routes(routes!(audit))
        .routes(routes!(search))
        .routes(routes!(users))
        .routes(routes!(tokens))
        .routes(routes!(reload))
}

/// A list of everything asked for (it has no pages).
#[derive(Serialize, ToSchema)]
struct Items<T> {
    items: Vec<T>,
}

/// Every provider.
///
/// Each provider the token may see (those its pipelines call, for a token
/// limited to pipelines), as the providers page shows it: breaker, pause,
/// throttle, limits and this node's use.
#[utoipa::path(
    get,
    path = "/providers",
    tag = "providers",
    operation_id = "list_providers",
    responses((status = 200, description = "Every provider the token may see", body = Items<ProviderStatus>)),
    security(("bearer" = ["viewer"]))
)]
async fn providers(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
) -> WebResult<Json<Items<ProviderStatus>>> {
    let items = crate::web::providers::statuses(&state, &caller).await?;
    Ok(Json(Items { items }))
}

/// The provider `name` as the caller sees it after a change.
async fn provider_after(
    state: &AppState,
    caller: &Caller,
    name: &str,
) -> WebResult<Json<ProviderStatus>> {
    let all = crate::web::providers::statuses(state, caller).await?;
    let found = all.into_iter().find(|p| p.name == name);
    let found = found.ok_or_else(|| WebError::NotFound(format!("no provider {name}")))?;
    Ok(Json(found))
}

/// Why a provider is paused.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    /// Shown on the providers page and kept in the audit log.
    reason: Option<String>,
}

/// Pause a provider.
///
/// Every node holds its calls until it is resumed; audited. Admins.
#[utoipa::path(
    post,
    path = "/providers/{name}/pause",
    tag = "providers",
    operation_id = "pause_provider",
    params(("name" = String, Path, description = "The provider's name")),
    request_body(content = Option<PauseBody>, description = "Optional: none, or a reason"),
    responses((status = 200, description = "The provider, paused", body = ProviderStatus)),
    security(("bearer" = ["admin"]))
)]
async fn pause_provider(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(name): ApiPath<String>,
    body: axum::body::Bytes,
) -> WebResult<Json<ProviderStatus>> {
    // The body is optional: none (or `null`), or `{"reason": "…"}`.
    let body: PauseBody = match body.is_empty() {
        true => PauseBody::default(),
        false => serde_json::from_slice::<Option<PauseBody>>(&body)
            .map_err(|e| WebError::bad("invalid_body", format!("the body: {e}")))?
            .unwrap_or_default(),
    };
    let reason = body.reason.filter(|r| !r.trim().is_empty());
    state
        .ops()
        .pause_provider(&name, true, &caller.actor, reason)
        .await?;
    provider_after(&state, &caller, &name).await
}

/// Resume a paused provider.
///
/// Audited. Admins.
#[utoipa::path(
    post,
    path = "/providers/{name}/resume",
    tag = "providers",
    operation_id = "resume_provider",
    params(("name" = String, Path, description = "The provider's name")),
    responses((status = 200, description = "The provider, taking calls again", body = ProviderStatus)),
    security(("bearer" = ["admin"]))
)]
async fn resume_provider(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> WebResult<Json<ProviderStatus>> {
    state
        .ops()
        .pause_provider(&name, false, &caller.actor, None)
        .await?;
    provider_after(&state, &caller, &name).await
}

/// Reset a provider's breaker.
///
/// Closes the breaker on this node and in the state the nodes share;
/// audited. Admins.
#[utoipa::path(
    post,
    path = "/providers/{name}/reset-breaker",
    tag = "providers",
    operation_id = "reset_breaker",
    params(("name" = String, Path, description = "The provider's name")),
    responses((status = 200, description = "The provider, its breaker closed", body = ProviderStatus)),
    security(("bearer" = ["admin"]))
)]
async fn reset_breaker(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> WebResult<Json<ProviderStatus>> {
    state.ops().reset_breaker(&name, &caller.actor).await?;
    provider_after(&state, &caller, &name).await
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct AuditQuery {
    /// Only the actions of this user or token (`token:NAME`).
    actor: Option<String>,
    /// Only actions of this kind (`retry`, `provider_paused`, …).
    kind: Option<String>,
    /// The page after this entry: the last page's `next`.
    before: Option<i64>,
    /// How many (100 when unset or 0; more than 500 are taken as 500).
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295_i64)]
    limit: Option<u32>,
}

/// A page of the audit log, newest first.
#[derive(Serialize, ToSchema)]
struct AuditPage {
    items: Vec<Event>,
    /// Pass as `before` for the next page; null on the last.
    next: Option<i64>,
}

/// The audit log.
///
/// Operators' and admins' actions, newest first, keyset-paged (`next` is
/// the next page's `before`). A token limited to pipelines reads the
/// actions on their records only.
#[utoipa::path(
    get,
    path = "/audit",
    tag = "audit",
    operation_id = "audit_log",
    params(AuditQuery),
    responses((status = 200, description = "A page of the audit log", body = AuditPage)),
    security(("bearer" = ["viewer"]))
)]
async fn audit(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> WebResult<Json<AuditPage>> {
    let filter = crate::store::AuditFilter {
        actor: crate::web::query::non_empty(&q.actor),
        kind: crate::web::query::non_empty(&q.kind),
        before: q.before,
        limit: q
            .limit
            .filter(|l| *l > 0)
            .unwrap_or(100)
            .min(crate::store::MAX_PAGE),
        pipelines: None,
    };
    let page = crate::web::query::audit_log(&state, &caller, filter).await?;
    Ok(Json(AuditPage {
        items: page.items,
        next: page.next,
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct SearchQuery {
    /// An id, a key, a provider's job id, or words.
    #[param(pattern = r"\S")]
    q: String,
}

/// What the search box finds.
#[derive(Serialize, ToSchema)]
struct Found {
    /// The records `q` names: an id, a key in any pipeline, a provider's
    /// job id.
    named: Vec<Record>,
    /// The newest 50 records holding every word of `q`.
    matches: Vec<Record>,
}

/// Search records.
///
/// What the search box finds: `named`, the records `q` names (an id, a key
/// in any pipeline, a provider's job id), and `matches`, the newest 50
/// holding every word of it.
#[utoipa::path(
    get,
    path = "/search",
    tag = "records",
    operation_id = "search_records",
    params(SearchQuery),
    responses((status = 200, description = "The records found", body = Found)),
    security(("bearer" = ["viewer"]))
)]
async fn search(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<SearchQuery>,
) -> WebResult<Json<Found>> {
    let q = q.q.trim();
    if q.is_empty() {
        return Err(WebError::bad(
            "bad_query",
            "`q` is empty: say what to look for",
        ));
    }
    let (named, matches) = crate::web::query::search(&state, &caller, q).await?;
    Ok(Json(Found { named, matches }))
}

/// List users.
///
/// Every user, as the users page lists them (never a password hash).
/// Admins.
#[utoipa::path(
    get,
    path = "/users",
    tag = "admin",
    operation_id = "list_users",
    responses((status = 200, description = "Every user", body = Items<User>)),
    security(("bearer" = ["admin"]))
)]
async fn users(
    _caller: Bearer<Admin>,
    State(state): State<AppState>,
) -> WebResult<Json<Items<User>>> {
    Ok(Json(Items {
        items: state.db.list_users().await?,
    }))
}

/// List API tokens.
///
/// Every API token, as the tokens page lists them: its prefix, never its
/// secret or hash, and when it was last used. Admins.
#[utoipa::path(
    get,
    path = "/tokens",
    tag = "admin",
    operation_id = "list_tokens",
    responses((status = 200, description = "Every API token", body = Items<ApiToken>)),
    security(("bearer" = ["admin"]))
)]
async fn tokens(
    _caller: Bearer<Admin>,
    State(state): State<AppState>,
) -> WebResult<Json<Items<ApiToken>>> {
    Ok(Json(Items {
        items: state.db.list_api_tokens().await?,
    }))
}

/// Reload the configuration.
///
/// This node reads its configuration file again, as SIGHUP makes it: what
/// changed, or 409 `config_refused` and why (the running configuration is
/// kept). Admins.
#[utoipa::path(
    post,
    path = "/reload",
    tag = "admin",
    operation_id = "reload",
    responses((status = 200, description = "What the reload changed", body = Reloaded)),
    security(("bearer" = ["admin"]))
)]
async fn reload(caller: Bearer<Admin>, State(state): State<AppState>) -> WebResult<Json<Reloaded>> {
    // Its own task: a caller that hangs up does not stop a reload half
    // way (between the swap and its log line and audit entry).
    let reloader = state.reloader.clone();
    let actor = caller.actor.clone();
    let done = tokio::spawn(async move { reloader.reload(&actor).await })
        .await
        .map_err(|e| WebError::Internal(format!("the reload task failed: {e}")))?;
    done.map(Json).map_err(|refused| WebError::Conflict {
        code: "config_refused",
        message: refused.0,
    })
}
