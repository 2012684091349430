//! `GET /metrics`: Prometheus text, for the configured metrics token or any
//! API token. The recorder is process-wide (the `metrics` crate's design),
//! installed once on first use.

use std::sync::OnceLock;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use subtle::ConstantTimeEq;

use crate::store::Store;
use crate::web::AppState;

use super::auth;
use super::error::WebError;

/// The process's Prometheus recorder, installed on first call. `None` when
/// another recorder was installed first.
pub fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| match PrometheusBuilder::new().install_recorder() {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "metrics recorder not installed");
                None
            }
        })
        .as_ref()
}

/// What people alert on, read from the store at each scrape (the same
/// cluster-wide figures from every node: aggregate with `max`):
/// - `ballast_records{pipeline, state}`: records by state (parked now is
///   `state="parked"`), from the maintained counters;
/// - `ballast_oldest_due_seconds{pipeline}`: how long the oldest record due
///   has waited for a worker (0 with nothing due);
/// - `ballast_provider_breaker{provider, state}`: 1 for the breaker's state
///   (`closed`, `open`, `half_open`), 0 for the others;
/// - `ballast_provider_paused{provider}`: 1 while an operator pauses it;
/// - `ballast_provider_throttled_seconds{provider}`: what is left of a
///   "slow down" pause.
///
/// Throttled calls and retry-budget exhaustion are counters kept as they
/// happen: `ballast_attempts_total{outcome="throttled"}` and
/// `ballast_deferrals_total{reason="provider retry budget exhausted"}`.
async fn cluster_gauges(state: &AppState) -> Result<(), WebError> {
    let now = state.clock.now_ms();
    let secs = |ms: i64| ms.max(0) as f64 / 1000.0;
    // Every pipeline configured here, and every one with records at work
    // (another node's, or one no longer configured).
    let mut pipelines: std::collections::BTreeSet<String> =
        state.config.pipelines.keys().cloned().collect();
    for c in state.db.state_counts().await? {
        metrics::gauge!(
            "ballast_records",
            "pipeline" => c.pipeline.clone(),
            "state" => c.state.as_str()
        )
        .set(c.count as f64);
        if c.count > 0 && !c.state.is_at_rest() {
            pipelines.insert(c.pipeline);
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
        metrics::gauge!("ballast_oldest_due_seconds", "pipeline" => p.clone()).set(waited);
    }
    for s in state.db.provider_states().await? {
        for b in [
            crate::domain::BreakerState::Closed,
            crate::domain::BreakerState::Open,
            crate::domain::BreakerState::HalfOpen,
        ] {
            let on = if s.breaker == b { 1.0 } else { 0.0 };
            metrics::gauge!(
                "ballast_provider_breaker",
                "provider" => s.provider.clone(),
                "state" => b.as_str()
            )
            .set(on);
        }
        let paused = if s.paused { 1.0 } else { 0.0 };
        metrics::gauge!("ballast_provider_paused", "provider" => s.provider.clone()).set(paused);
        let left = s.throttled_until.map_or(0.0, |u| secs(u - now));
        metrics::gauge!("ballast_provider_throttled_seconds", "provider" => s.provider.clone())
            .set(left);
    }
    Ok(())
}

pub fn router() -> Router<AppState> {
    Router::new().route("/metrics", get(metrics))
}

async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, WebError> {
    let presented = auth::bearer(&headers).ok_or(WebError::Unauthenticated)?;
    let by_config = state
        .web
        .keys
        .metrics_token
        .as_deref()
        .is_some_and(|t| bool::from(t.as_bytes().ct_eq(presented.as_bytes())));
    if !by_config {
        auth::token_caller(&headers, &state).await?;
    }
    let handle = handle().ok_or_else(|| WebError::Internal("no metrics recorder".into()))?;
    cluster_gauges(&state).await?;
    let mut r = handle.render().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    Ok(r)
}
