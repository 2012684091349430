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
    let shared = state.db.provider_states().await?;
    let now = state.clock.now_ms();
    let config = state.config.get();
    // A caller limited to pipelines sees the providers they call.
    let shown = crate::web::scope::providers(&config, caller);
    let providers = config
        .providers
        .iter()
        .filter(|(name, _)| shown.as_ref().is_none_or(|s| s.contains(*name)))
        .map(|(name, cfg)| {
            let ps = shared.iter().find(|p| &p.provider == name);
            let live = state.engine.as_ref().and_then(|e| e.provider_live(name));
            ProviderView {
                name: name.clone(),
                base_url: crate::domain::request::redact_url(&cfg.base_url),
                breaker: ps.map_or("closed", |p| p.breaker.as_str()),
                breaker_since: ps.map(|p| when(p.breaker_changed_at)).unwrap_or_default(),
                open_until: when_opt(ps.and_then(|p| p.open_until)),
                paused: ps.is_some_and(|p| p.paused),
                paused_by: ps.and_then(|p| p.paused_by.clone()).unwrap_or_default(),
                paused_reason: ps.and_then(|p| p.paused_reason.clone()).unwrap_or_default(),
                throttled_until: when_opt(ps.and_then(|p| p.throttled_until).filter(|u| *u > now)),
                limits: if cfg.rate_limits.is_empty() {
                    "none".into()
                } else {
                    cfg.rate_limits
                        .iter()
                        .map(|l| format!("{l:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
                concurrency: cfg.concurrency,
                in_flight: live.as_ref().map_or(0, |l| l.in_flight),
                recent_calls: live.as_ref().map(|l| l.limit_use()).unwrap_or_default(),
                window: live
                    .as_ref()
                    .map(|l| {
                        format!(
                            "{} calls, {} failed, {} slow",
                            l.window_calls, l.window_failed, l.window_slow
                        )
                    })
                    .unwrap_or_default(),
            }
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
