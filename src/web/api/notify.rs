//! Notifications out (`[[notify]]`): the subscriptions with their state,
//! the notices (each delivery's state, attempts and last reply), a
//! redelivery, and turning a subscription on or off.

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiPath, ApiQuery};
use crate::store::{Notice, NoticeFilter};
use crate::web::AppState;
use crate::web::auth::{Admin, Bearer, Operator, Viewer};
use crate::web::error::{WebError, WebResult};
use crate::web::notices::SubscriptionStatus;

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(notifications))
        .routes(routes!(redeliver))
        .routes(routes!(subscriptions))
        .routes(routes!(enable))
        .routes(routes!(disable))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct NoticeQuery {
    /// Only this subscription's.
    subscription: Option<String>,
    /// Only those about this record.
    record_id: Option<i64>,
    /// Only those `pending`, `delivered` or `failed` (given up).
    #[param(pattern = "^(pending|delivered|failed)$")]
    state: Option<String>,
    /// The page after this notice: the last page's `next`.
    before: Option<i64>,
    /// How many (50 when unset or 0; more than 500 are taken as 500).
    #[param(value_type = Option<i64>, minimum = 0, maximum = 4294967295_i64)]
    limit: Option<u32>,
}

/// A page of notices, newest first.
#[derive(Serialize, ToSchema)]
struct NoticePage {
    items: Vec<Notice>,
    /// Pass as `before` for the next page; null on the last.
    next: Option<i64>,
}

/// Notifications sent and to send.
///
/// Each notice a subscription was written (with the change it reports,
/// in the same transaction), newest first, keyset-paged: its state
/// (`pending`, `delivered`, `failed`: given up after `retry_for`), the
/// deliveries sent, and the last one's status and reply. A token limited
/// to pipelines reads the notices of their records only.
#[utoipa::path(
    get,
    path = "/notifications",
    tag = "notifications",
    operation_id = "list_notifications",
    params(NoticeQuery),
    responses((status = 200, description = "A page of notices", body = NoticePage)),
    security(("bearer" = ["viewer"]))
)]
async fn notifications(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<NoticeQuery>,
) -> WebResult<Json<NoticePage>> {
    if let Some(s) = q
        .state
        .as_deref()
        .filter(|s| !matches!(*s, "pending" | "delivered" | "failed"))
    {
        return Err(WebError::bad(
            "invalid_state",
            format!("`{s}`: pending, delivered or failed"),
        ));
    }
    let f = NoticeFilter {
        id: None,
        subscription: crate::web::query::non_empty(&q.subscription),
        record_id: q.record_id,
        state: q.state,
        pipelines: None,
        before: q.before,
        limit: q.limit.unwrap_or(0),
    };
    let page = crate::web::notices::list(&state, &caller, f).await?;
    Ok(Json(NoticePage {
        items: page.items,
        next: page.next,
    }))
}

/// Send a notice again.
///
/// A notice delivered or given up goes again, due now, after any of its
/// subject before it still pending, under its own `webhook-id`; audited.
/// A pending one is refused (`invalid`): it goes when due. Operators.
#[utoipa::path(
    post,
    path = "/notifications/{id}/redeliver",
    tag = "notifications",
    operation_id = "redeliver_notification",
    params(("id" = i64, Path, description = "The notice's id")),
    responses((status = 200, description = "The notice, pending again", body = Notice)),
    security(("bearer" = ["operator"]))
)]
async fn redeliver(
    caller: Bearer<Operator>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
) -> WebResult<Json<Notice>> {
    Ok(Json(
        crate::web::notices::redeliver(&state, &caller, id).await?,
    ))
}

/// A list of everything asked for (it has no pages).
#[derive(Serialize, ToSchema)]
struct Subscriptions {
    items: Vec<SubscriptionStatus>,
}

/// Every subscription.
///
/// Each `[[notify]]` subscription as configured, and whether it is on
/// (a subscription failing for `disable_after` is turned off, audited).
#[utoipa::path(
    get,
    path = "/notifications/subscriptions",
    tag = "notifications",
    operation_id = "list_subscriptions",
    responses((status = 200, description = "Every subscription", body = Subscriptions)),
    security(("bearer" = ["viewer"]))
)]
async fn subscriptions(
    caller: Bearer<Viewer>,
    State(state): State<AppState>,
) -> WebResult<Json<Subscriptions>> {
    let items = crate::web::notices::subscriptions(&state, &caller).await?;
    Ok(Json(Subscriptions { items }))
}

/// Turn a subscription on.
///
/// Its failing spell is forgotten and what it missed is sent; audited.
/// Admins.
#[utoipa::path(
    post,
    path = "/notifications/subscriptions/{name}/enable",
    tag = "notifications",
    operation_id = "enable_subscription",
    params(("name" = String, Path, description = "The subscription's name")),
    responses((status = 200, description = "The subscription, on", body = SubscriptionStatus)),
    security(("bearer" = ["admin"]))
)]
async fn enable(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> WebResult<Json<SubscriptionStatus>> {
    Ok(Json(
        crate::web::notices::turn(&state, &caller, &name, true).await?,
    ))
}

/// Turn a subscription off.
///
/// Nothing is sent to it until it is turned on again (notices are still
/// written); audited. Admins.
#[utoipa::path(
    post,
    path = "/notifications/subscriptions/{name}/disable",
    tag = "notifications",
    operation_id = "disable_subscription",
    params(("name" = String, Path, description = "The subscription's name")),
    responses((status = 200, description = "The subscription, off", body = SubscriptionStatus)),
    security(("bearer" = ["admin"]))
)]
async fn disable(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> WebResult<Json<SubscriptionStatus>> {
    Ok(Json(
        crate::web::notices::turn(&state, &caller, &name, false).await?,
    ))
}
