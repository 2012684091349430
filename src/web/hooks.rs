//! `POST /hooks/{provider}`: signed webhook deliveries for `callback` steps.
//! Open without login by design; the signature (with a timestamp inside the
//! tolerance window) is the authentication, and each delivery id, and each
//! signed content, counts once.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::auth::webhook;
use crate::engine::{Delivery, WebhookSettings};
use crate::web::AppState;

/// The largest delivery accepted; larger is refused with 413.
pub const MAX_BODY: usize = 1024 * 1024;

pub fn router(state: &AppState) -> Router<AppState> {
    let per_second = u64::from(state.config.get().server.limits.hooks_per_second);
    let routes = Router::new()
        .route("/hooks/{provider}", post(receive))
        .layer(DefaultBodyLimit::max(MAX_BODY));
    super::per_address(
        routes,
        state,
        per_second,
        "too many webhook deliveries from your address",
    )
}

/// The ids a verified delivery is taken once by: the provider's delivery
/// id (its header, unsigned) and what the signature covers.
fn delivery_ids(headers: &HeaderMap, header: &str, signature: &str, body: &[u8]) -> Vec<String> {
    let delivery = headers
        .get(header)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|d| !d.is_empty() && d.len() <= 200)
        .map(str::to_owned);
    delivery
        .into_iter()
        .chain(webhook::replay_key(signature, body))
        .collect()
}

/// Gives a delivery's ids back (its processing failed after it was stored).
async fn release(state: &AppState, provider: &str, ids: &[String]) {
    for id in ids {
        if let Err(e) = state.db.forget_delivery(provider, id).await {
            tracing::warn!(provider.name = %provider, error = %e, "could not release a delivery id");
        }
    }
}

/// What a delivery is answered: a status and a JSON body.
type Answer = (StatusCode, Json<Value>);

/// A refusal: `status`, with the error's code and message.
fn refuse(status: StatusCode, code: &str, message: &str) -> Answer {
    (status, Json(json!({ "error": code, "message": message })))
}

async fn receive(
    State(state): State<AppState>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Answer {
    let (engine, settings) = match receiving(&state, &provider) {
        Ok(found) => found,
        Err(refused) => return refused,
    };
    let signature = headers
        .get(settings.signature_header.as_str())
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let now_s = state.clock.now_ms() / 1000;
    if let Err(e) = webhook::verify(
        &settings.secrets,
        signature,
        &body,
        now_s,
        settings.tolerance_s,
    ) {
        tracing::warn!(provider.name = %provider, error = e.code(), "webhook refused");
        return refuse(StatusCode::UNAUTHORIZED, e.code(), &e.to_string());
    }
    let Ok(mut json) = serde_json::from_slice::<Value>(&body) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "body_not_json",
            "the body is not JSON",
        );
    };
    // Kept like a reply's body: NUL characters (which PostgreSQL cannot
    // store, and a provider would redeliver forever) become U+FFFD, and the
    // provider's API key, if it echoes it, `[redacted]`.
    let key = settings.credential.as_ref().map(|k| k.expose());
    crate::domain::scrub_json(&mut json, key.as_slice());
    // Each delivery id is applied once (taken in the transaction that
    // stores the delivery): a redelivery changes nothing. So is each signed
    // content: the same signed body sent again without the (unsigned)
    // delivery-id header is a duplicate too.
    let ids = delivery_ids(&headers, &settings.delivery_header, signature, &body);
    let result = engine.deliver(&provider, json, &ids).await;
    if result.is_err() {
        // Processing failed after the delivery was stored: let the
        // provider's retry of it through.
        release(&state, &provider, &ids).await;
    }
    answer(&provider, result)
}

/// The engine and `provider`'s webhook settings when it takes deliveries:
/// refused when there is no such provider (or no engine), or when it has no
/// webhook secret.
fn receiving<'a>(
    state: &'a AppState,
    provider: &str,
) -> Result<(&'a crate::engine::Engine, WebhookSettings), Answer> {
    let Some(engine) = &state.engine else {
        return Err(refuse(
            StatusCode::NOT_FOUND,
            "unknown_provider",
            "no such provider",
        ));
    };
    let Some(settings) = engine.webhook_settings(provider) else {
        return Err(refuse(
            StatusCode::NOT_FOUND,
            "unknown_provider",
            "no such provider",
        ));
    };
    if settings.secrets.is_empty() {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "webhooks_not_configured",
            "this provider has no webhook secret",
        ));
    }
    Ok((engine, settings))
}

/// The answer a delivery's outcome gets: 2xx when it was taken (or was a
/// duplicate), 422 when sending it again cannot help, 503 when it can.
fn answer(provider: &str, result: Result<Delivery, crate::store::StoreError>) -> Answer {
    match result {
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
        Ok(Delivery::Duplicate) => (StatusCode::OK, Json(json!({ "status": "duplicate" }))),
        Ok(Delivery::NoJobId) => refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            "job_id_missing",
            "no job id in the body",
        ),
        // A delivery the store refuses as such: a redelivery cannot help.
        Err(crate::store::StoreError::Invalid(m)) => {
            tracing::warn!(provider.name = %provider, error = %m, "webhook refused by the store");
            refuse(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", &m)
        }
        // Not now (a reload under way on the nodes): delivered again later.
        Err(crate::store::StoreError::NotNow(why)) => {
            tracing::warn!(provider.name = %provider, reason = %why, "webhook delivery asked again later");
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_now",
                "cannot take this delivery now; retry later",
            )
        }
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
