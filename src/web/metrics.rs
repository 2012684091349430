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
    let mut r = handle.render().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    Ok(r)
}
