//! `/api/v1`: the JSON API, for bearer API tokens with the same roles and
//! the same action rules as the dashboard. Rate-limited per token. Every
//! route is registered from its `#[utoipa::path]` annotation, so the OpenAPI
//! document served at `/api/v1/openapi.json` is the routing itself; errors
//! are RFC 9457 problem details ([`Problem`](super::error::Problem)) with
//! stable codes.

mod control;
mod doc;
mod notify;
mod people;
mod pipelines;
mod records;

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use utoipa_axum::router::OpenApiRouter;

use crate::config::WebLimits;
use crate::web::AppState;

use super::auth::ApiKey;
use super::error::WebError;

pub use doc::served;

/// Every route of the API with what it takes and answers: the one list
/// the router and the document are both made from.
fn routes() -> OpenApiRouter<AppState> {
    records::routes()
        .merge(control::routes())
        .merge(pipelines::routes())
        .merge(people::routes())
        .merge(notify::routes())
}

/// The API's routes with two limits: per token (`api_per_second`, bursts of
/// twice that) and, outside it, per client address (four times as much), so
/// that inventing tokens does not buy more requests.
pub fn router(state: &AppState) -> Router<AppState> {
    let limits: &WebLimits = &state.config.get().server.limits;
    let trusted: Arc<[std::net::IpAddr]> = state.web.keys.trusted_proxies.clone();
    let per_second = u64::from(limits.api_per_second.max(1));
    // The router and its document from one list of routes, built once.
    let (routes, paths) = routes().split_for_parts();
    let served = doc::render(paths).map_err(|e| e.to_string());
    let mut routes = routes
        .route(
            "/openapi.json",
            get(move || async move {
                match served {
                    Ok(doc) => Ok((
                        [(header::CONTENT_TYPE, "application/json")],
                        doc.to_string(),
                    )),
                    Err(e) => Err(WebError::Internal(format!("the OpenAPI document: {e}"))),
                }
            }),
        )
        .fallback(|| async { WebError::NotFound("no such API route".into()) })
        .method_not_allowed_fallback(|| async { WebError::MethodNotAllowed });
    let refuse = |_| {
        let mut r = WebError::TooManyRequests("API rate limit exceeded".into()).into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    };
    let per_token = GovernorConfigBuilder::default()
        .key_extractor(ApiKey {
            trusted: trusted.clone(),
        })
        .per_millisecond((1000 / per_second).max(1))
        .burst_size(u32::try_from(per_second * 2).unwrap_or(u32::MAX))
        .finish();
    if let Some(config) = per_token {
        let limiter = config.limiter().clone();
        super::clean_every_minute(state.shutdown.clone(), move || limiter.retain_recent());
        routes = routes.layer(GovernorLayer::new(Arc::new(config)).error_handler(refuse));
    }
    super::per_address(routes, state, per_second * 4, "API rate limit exceeded")
}

/// `Json` whose rejections are API errors with stable codes.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = WebError;

    async fn from_request(req: Request, state: &S) -> Result<Self, WebError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(WebError::bad(
                "unsupported_media_type",
                "send the body as application/json",
            )),
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(WebError::bad("malformed_json", e.body_text()))
            }
            Err(JsonRejection::JsonDataError(e)) => {
                Err(WebError::bad("invalid_body", e.body_text()))
            }
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(WebError::TooLarge),
            Err(e) => Err(WebError::bad("invalid_body", e.body_text())),
        }
    }
}

/// `Query` whose rejections are API errors (`invalid_query`).
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = WebError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, WebError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| ApiQuery(v))
            .map_err(|e: QueryRejection| WebError::bad("invalid_query", e.body_text()))
    }
}

/// `Path` whose rejections are API errors: a segment that is not what the
/// route takes (an id that is not a number) names nothing here, so 404; a
/// route without the parameters its handler reads is a bug here, so 500.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = WebError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, WebError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| ApiPath(v))
            .map_err(|e: PathRejection| match e {
                PathRejection::FailedToDeserializePathParams(e) => {
                    WebError::NotFound(format!("no such API route: {}", e.body_text()))
                }
                other => WebError::Internal(other.body_text()),
            })
    }
}
