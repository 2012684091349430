//! The HTTP control plane. For now: health and readiness probes; the
//! dashboard, API, webhooks and metrics join here, one router per area.

mod health;
mod hooks;

use axum::Router;

use crate::app::AppState;

/// Every route of the control plane, with its layers.
pub fn router(state: AppState) -> Router {
    Router::new()
        .merge(health::router())
        .merge(hooks::router())
        .with_state(state)
}
