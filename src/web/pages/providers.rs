//! `/providers`: health, breaker, limits and use, with pause, resume and
//! breaker reset for admins.

use askama::Template;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;

use crate::web::AppState;
use crate::web::auth::{Admin, Authed, Viewer};
use crate::web::error::WebResult;
use crate::web::htmx::is_htmx;

use super::{Nav, html, when, when_opt};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/providers", get(list))
        .route("/providers/{name}/pause", post(pause))
        .route("/providers/{name}/resume", post(resume))
        .route("/providers/{name}/reset-breaker", post(reset_breaker))
}

struct ProviderView {
    name: String,
    base_url: String,
    breaker: &'static str,
    breaker_since: String,
    open_until: String,
    paused: bool,
    paused_by: String,
    paused_reason: String,
    /// When the provider's last "slow down" ends, while it holds.
    throttled_until: String,
    limits: String,
    concurrency: u32,
    in_flight: usize,
    recent_calls: String,
    window: String,
}

#[derive(Template)]
#[template(path = "pages/providers.html", blocks = ["list"])]
struct ProvidersPage {
    nav: Nav,
    providers: Vec<ProviderView>,
}

async fn page(state: &AppState, caller: &crate::web::auth::Caller) -> WebResult<ProvidersPage> {
    let providers = crate::web::providers::statuses(state, caller)
        .await?
        .into_iter()
        .map(|p| ProviderView {
            breaker_since: p.breaker_since.map(when).unwrap_or_default(),
            open_until: when_opt(p.open_until),
            paused_by: p.paused_by.unwrap_or_default(),
            paused_reason: p.paused_reason.unwrap_or_default(),
            throttled_until: when_opt(p.throttled_until),
            limits: match p.rate_limits.is_empty() {
                true => "none".into(),
                false => p.rate_limits.join(", "),
            },
            in_flight: p.node.as_ref().map_or(0, |l| l.in_flight),
            recent_calls: p
                .node
                .as_ref()
                .map(|l| {
                    l.limits
                        .iter()
                        .map(|u| format!("{} of {}", u.used, u.limit))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default(),
            window: p
                .node
                .as_ref()
                .map(|l| {
                    format!(
                        "{} calls, {} failed, {} slow",
                        l.window_calls, l.window_failed, l.window_slow
                    )
                })
                .unwrap_or_default(),
            name: p.name,
            base_url: p.base_url,
            breaker: p.breaker,
            paused: p.paused,
            concurrency: p.concurrency,
        })
        .collect();
    Ok(ProvidersPage {
        nav: Nav::new(caller, "providers"),
        providers,
    })
}

async fn list(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
) -> WebResult<Response> {
    let t = page(&state, &caller).await?;
    if is_htmx(&headers) {
        return html(&t.as_list());
    }
    html(&t)
}

#[derive(Deserialize)]
struct PauseForm {
    reason: Option<String>,
}

async fn after_change(
    state: &AppState,
    caller: &crate::web::auth::Caller,
    headers: &HeaderMap,
) -> WebResult<Response> {
    if is_htmx(headers) {
        return html(&page(state, caller).await?.as_list());
    }
    Ok(Redirect::to("/providers").into_response())
}

async fn pause(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Form(form): Form<PauseForm>,
) -> WebResult<Response> {
    let reason = form.reason.filter(|r| !r.trim().is_empty());
    state
        .ops()
        .pause_provider(&name, true, &caller.actor, reason)
        .await?;
    after_change(&state, &caller, &headers).await
}

async fn resume(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> WebResult<Response> {
    state
        .ops()
        .pause_provider(&name, false, &caller.actor, None)
        .await?;
    after_change(&state, &caller, &headers).await
}

async fn reset_breaker(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> WebResult<Response> {
    state.ops().reset_breaker(&name, &caller.actor).await?;
    after_change(&state, &caller, &headers).await
}
