//! `POST /hooks/{provider}`: signed webhook deliveries for `callback` steps.
//! Open without login by design; the signature is the authentication.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::app::AppState;
use crate::auth::webhook;
use crate::engine::Delivery;

/// The largest delivery accepted; larger is refused with 413.
pub const MAX_BODY: usize = 1024 * 1024;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/hooks/{provider}", post(receive))
        .layer(DefaultBodyLimit::max(MAX_BODY))
}

fn refuse(status: StatusCode, code: &str, message: &str) -> (StatusCode, Json<Value>) {
    (status, Json(json!({ "error": code, "message": message })))
}

async fn receive(
    State(state): State<AppState>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Json<Value>) {
    let Some(engine) = &state.engine else {
        return refuse(
            StatusCode::NOT_FOUND,
            "unknown_provider",
            "no such provider",
        );
    };
    let Some((header, secrets)) = engine.webhook_secrets(&provider) else {
        return refuse(
            StatusCode::NOT_FOUND,
            "unknown_provider",
            "no such provider",
        );
    };
    if secrets.is_empty() {
        return refuse(
            StatusCode::FORBIDDEN,
            "webhooks_not_configured",
            "this provider has no webhook secret",
        );
    }
    let signature = headers
        .get(header.as_str())
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !webhook::verify(&secrets, signature, &body) {
        tracing::warn!(provider.name = %provider, "webhook with a bad or missing signature refused");
        return refuse(
            StatusCode::UNAUTHORIZED,
            "bad_signature",
            "the signature does not match",
        );
    }
    let Ok(json) = serde_json::from_slice::<Value>(&body) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "body_not_json",
            "the body is not JSON",
        );
    };
    match engine.deliver(&provider, json).await {
        Ok(Delivery::Accepted { record_id }) => (
            StatusCode::ACCEPTED,
            Json(json!({ "status": "accepted", "record_id": record_id })),
        ),
        Ok(Delivery::Reversed { record_id, state }) => (
            StatusCode::OK,
            Json(json!({ "status": "reversed", "record_id": record_id, "record_state": state })),
        ),
        Ok(Delivery::Unmatched { job_id }) => (
            StatusCode::ACCEPTED,
            Json(json!({ "status": "stored", "job_id": job_id })),
        ),
        Ok(Delivery::NoJobId) => refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            "job_id_missing",
            "no job id in the body",
        ),
        Err(e) => {
            tracing::error!(provider.name = %provider, error = %e, "webhook delivery failed");
            // 503 so the provider retries the delivery later.
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                e.code(),
                "could not store the delivery; retry later",
            )
        }
    }
}
