//! `/notifications`: each `[[notify]]` subscription with its state (an
//! admin turns it on or off), and the newest notices the caller may see,
//! each with its state, deliveries sent, last status and reply (an
//! operator sends one again).

use askama::Template;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use crate::store::NoticeFilter;
use crate::web::AppState;
use crate::web::auth::{Admin, Authed, Caller, Operator, Viewer};
use crate::web::error::WebResult;
use crate::web::htmx::is_htmx;
use crate::web::notices::SubscriptionStatus;

use super::{Nav, html, when, when_opt};

/// Notices shown per page.
const SHOWN: u32 = 50;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/notifications", get(list))
        .route("/notifications/{id}/redeliver", post(redeliver))
        .route("/notifications/subscriptions/{name}/enable", post(enable))
        .route("/notifications/subscriptions/{name}/disable", post(disable))
}

struct NoticeView {
    id: i64,
    message_id: String,
    at: String,
    subscription: String,
    topic: String,
    record_id: Option<i64>,
    provider: String,
    state: String,
    attempts: i32,
    last_at: String,
    status: String,
    reply: String,
    next_at: String,
}

#[derive(Template)]
#[template(path = "pages/notifications.html", blocks = ["list"])]
struct NotificationsPage {
    nav: Nav,
    subscriptions: Vec<SubscriptionView>,
    notices: Vec<NoticeView>,
    /// The filters shown and kept in links.
    subscription: String,
    state: String,
    /// The next page's `before`.
    next: Option<i64>,
    /// This page's `before`: an older page does not refresh itself.
    before: Option<i64>,
    /// This page's query (its filters and `before`), which its actions
    /// carry, so that what they render is this page again.
    query: String,
}

struct SubscriptionView {
    s: SubscriptionStatus,
    events: String,
    only: String,
    failing_since: String,
    disabled_at: String,
}

#[derive(Debug, Default, Deserialize)]
struct ListQuery {
    subscription: Option<String>,
    state: Option<String>,
    before: Option<i64>,
}

impl ListQuery {
    /// The query string that asks for this page again.
    fn encoded(&self) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair("subscription", self.subscription.as_deref().unwrap_or(""));
        q.append_pair("state", self.state.as_deref().unwrap_or(""));
        if let Some(b) = self.before {
            q.append_pair("before", &b.to_string());
        }
        q.finish()
    }
}

async fn page(state: &AppState, caller: &Caller, q: &ListQuery) -> WebResult<NotificationsPage> {
    let subscriptions = crate::web::notices::subscriptions(state, caller)
        .await?
        .into_iter()
        .map(|s| {
            let mut only = Vec::new();
            for (what, list) in [
                ("pipelines", &s.pipelines),
                ("groups", &s.groups),
                ("providers", &s.providers),
            ] {
                if !list.is_empty() {
                    only.push(format!("{what} {}", list.join(", ")));
                }
            }
            SubscriptionView {
                events: s.events.join(", "),
                only: only.join("; "),
                failing_since: when_opt(s.failing_since),
                disabled_at: when_opt(s.disabled_at),
                s,
            }
        })
        .collect();
    let subscription = crate::web::query::non_empty(&q.subscription);
    let wanted = crate::web::query::non_empty(&q.state)
        .filter(|s| matches!(s.as_str(), "pending" | "delivered" | "failed"));
    let f = NoticeFilter {
        subscription: subscription.clone(),
        state: wanted.clone(),
        before: q.before,
        limit: SHOWN,
        ..NoticeFilter::default()
    };
    let found = crate::web::notices::list(state, caller, f).await?;
    let notices = found
        .items
        .into_iter()
        .map(|n| NoticeView {
            id: n.id,
            message_id: n.message_id,
            at: when(n.at),
            subscription: n.subscription,
            topic: n.topic,
            record_id: n.record_id,
            provider: n.provider.unwrap_or_default(),
            next_at: match n.state.as_str() {
                "pending" => when_opt(n.next_at),
                _ => String::new(),
            },
            state: n.state,
            attempts: n.attempts,
            last_at: when_opt(n.last_at),
            status: n.status.map(|s| s.to_string()).unwrap_or_default(),
            reply: n.reply.unwrap_or_default(),
        })
        .collect();
    Ok(NotificationsPage {
        nav: Nav::new(caller, "notifications"),
        subscriptions,
        notices,
        subscription: subscription.unwrap_or_default(),
        state: wanted.unwrap_or_default(),
        next: found.next,
        before: q.before,
        query: q.encoded(),
    })
}

async fn list(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> WebResult<Response> {
    let t = page(&state, &caller, &q).await?;
    if is_htmx(&headers) {
        return html(&t.as_list());
    }
    html(&t)
}

/// The page an action was taken on, again: its list for htmx, else a
/// redirect to it.
async fn after_change(
    state: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    q: &ListQuery,
) -> WebResult<Response> {
    if is_htmx(headers) {
        let t = page(state, caller, q).await?;
        return html(&t.as_list());
    }
    Ok(Redirect::to(&format!("/notifications?{}", q.encoded())).into_response())
}

async fn redeliver(
    caller: Authed<Operator>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    Query(q): Query<ListQuery>,
) -> WebResult<Response> {
    crate::web::notices::redeliver(&state, &caller, id).await?;
    after_change(&state, &caller, &headers, &q).await
}

async fn enable(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> WebResult<Response> {
    crate::web::notices::turn(&state, &caller, &name, true).await?;
    after_change(&state, &caller, &headers, &q).await
}

async fn disable(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> WebResult<Response> {
    crate::web::notices::turn(&state, &caller, &name, false).await?;
    after_change(&state, &caller, &headers, &q).await
}
