//! Every HTTP request's id and its one log line.
//!
//! The id is the caller's `x-request-id` when it is a plain token (a load
//! balancer's id then joins ours), or a new random one; it goes back in the
//! response's `x-request-id`, onto error pages (to quote when reporting
//! one), and into the request's log line: method, path (never the query,
//! which may hold what someone searched for), status and duration, at
//! `info` (`error`, with what went wrong, for an internal error) under this module's target (`BALLAST_LOG=info,ballast::web::requests=warn`
//! keeps them out).

use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;

use crate::web::AppState;
use crate::web::error::Failure;

/// The header that carries the id, both ways.
pub const HEADER: &str = "x-request-id";

/// One request's id, in the request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub String);

/// A caller's id is kept if it is 1 to 128 characters of letters, digits
/// and `-_.:` (nothing that could break a log line or a header).
fn acceptable(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

/// Gives the request its id, runs it, returns the id and logs the line.
pub async fn request_id(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| acceptable(v))
        .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_owned);
    req.extensions_mut().insert(RequestId(id.clone()));
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let started = state.clock.instant();
    let mut response = next.run(req).await;
    let took = state.clock.instant().saturating_duration_since(started);
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(HEADER, v);
    }
    let status = response.status().as_u16();
    let ms = took.as_secs_f64() * 1000.0;
    match response.extensions().get::<Failure>() {
        Some(Failure(detail)) => tracing::error!(
            request.id = %id,
            http.method = %method,
            http.path = %path,
            http.status = status,
            http.duration_ms = ms,
            error = %detail,
            "request failed"
        ),
        None => tracing::info!(
            request.id = %id,
            http.method = %method,
            http.path = %path,
            http.status = status,
            http.duration_ms = ms,
            "request"
        ),
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_ids_are_taken_from_callers() {
        assert!(acceptable("0f9e-lb.7:abc_1"));
        assert!(!acceptable(""));
        assert!(!acceptable("a b"));
        assert!(!acceptable("x\ny"));
        assert!(!acceptable("é"));
        assert!(!acceptable(&"a".repeat(129)));
    }
}
