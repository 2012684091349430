//! `/audit`: every operator action, newest first, filterable by actor and
//! action, keyset-paginated.

use askama::Template;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use serde::Deserialize;

use crate::store::AuditFilter;
use crate::web::AppState;
use crate::web::auth::{Authed, Viewer};
use crate::web::error::WebResult;
use crate::web::htmx::is_htmx;

use super::{Nav, html, when};

pub fn router() -> Router<AppState> {
    Router::new().route("/audit", get(list))
}

#[derive(Deserialize)]
struct AuditQuery {
    actor: Option<String>,
    kind: Option<String>,
    before: Option<i64>,
}

struct EventView {
    at: String,
    actor: String,
    kind: String,
    record_id: Option<i64>,
    change: String,
    reason: String,
    detail: String,
}

#[derive(Template)]
#[template(path = "pages/audit.html", blocks = ["list"])]
struct AuditPage {
    nav: Nav,
    actor: String,
    kind: String,
    kinds: Vec<&'static str>,
    filters: String,
    events: Vec<EventView>,
    next: Option<i64>,
    /// The newest page, which follows new entries (older pages stay).
    first: bool,
}

const KINDS: [&str; 15] = [
    "retry",
    "park",
    "resume",
    "cancel",
    "replay",
    "provider_paused",
    "provider_resumed",
    "breaker_reset",
    "user_added",
    "user_changed",
    "token_created",
    "token_revoked",
    "sign_on_refused",
    "reversed",
    "config_reload",
];

async fn list(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<AuditQuery>,
) -> WebResult<Response> {
    let clean = |v: &Option<String>| {
        v.as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    let filter = AuditFilter {
        actor: clean(&q.actor),
        kind: clean(&q.kind),
        before: q.before,
        limit: 100,
        pipelines: None,
    };
    let page = crate::web::query::audit_log(&state, &caller, filter.clone()).await?;
    let mut filters = form_urlencoded::Serializer::new(String::new());
    if let Some(a) = &filter.actor {
        filters.append_pair("actor", a);
    }
    if let Some(k) = &filter.kind {
        filters.append_pair("kind", k);
    }
    let t = AuditPage {
        nav: Nav::new(&caller, "audit"),
        actor: filter.actor.clone().unwrap_or_default(),
        kind: filter.kind.clone().unwrap_or_default(),
        kinds: KINDS.to_vec(),
        filters: filters.finish(),
        events: page
            .items
            .iter()
            .map(|e| EventView {
                at: when(e.at),
                actor: e.actor.clone(),
                kind: e.kind.clone(),
                record_id: e.record_id,
                change: match (e.from_state, e.to_state) {
                    (Some(f), Some(t)) => format!("{f} → {t}"),
                    _ => String::new(),
                },
                reason: e.reason.clone().unwrap_or_default(),
                detail: e.detail.as_ref().map(|d| d.to_string()).unwrap_or_default(),
            })
            .collect(),
        next: page.next,
        first: filter.before.is_none(),
    };
    if is_htmx(&headers) {
        return html(&t.as_list());
    }
    html(&t)
}
