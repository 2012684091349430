//! Every HTTP request's id and its one log line.
//!
//! The id is the caller's `x-request-id` when it is a plain token (a load
//! balancer's id then joins ours), or a new random one; it goes back in the
//! response's `x-request-id`, onto error pages (to quote when reporting
//! one), and into the request's log line: method, path (never the query,
//! which may hold what someone searched for), status and duration, under
//! this module's target at the level [`level_of`] gives it: a request that
//! went well at `debug` (every webhook and live page's poll would drown the
//! lines an operator must see), a refused one (4xx) or a slow one at
//! `info`, a 5xx at `warn`, an internal error at `error` with what went
//! wrong. `BALLAST_LOG=info,ballast::web::requests=debug` shows them all.

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
    let slow = took >= SLOW;
    // One line; `tracing`'s levels are fixed per call site, hence an arm each.
    macro_rules! line {
        ($level:expr, $message:literal) => {
            tracing::event!(
                $level,
                request.id = %id,
                http.method = %method,
                http.path = %path,
                http.status = status,
                http.duration_ms = ms,
                $message
            )
        };
    }
    use tracing::Level;
    match (
        response.extensions().get::<Failure>(),
        level_of(status, slow),
    ) {
        (Some(Failure(detail)), _) => tracing::error!(
            request.id = %id,
            http.method = %method,
            http.path = %path,
            http.status = status,
            http.duration_ms = ms,
            error = %detail,
            "request failed"
        ),
        (None, Level::WARN) => line!(Level::WARN, "request"),
        (None, Level::INFO) if slow => line!(Level::INFO, "slow request"),
        (None, Level::INFO) => line!(Level::INFO, "request"),
        (None, _) => line!(Level::DEBUG, "request"),
    }
    response
}

/// A request taking this long is logged at `info` whatever its status.
pub const SLOW: std::time::Duration = std::time::Duration::from_secs(1);

/// The level of a request's line: `warn` for a 5xx, `info` for a refused
/// (4xx) or slow one, `debug` for the rest (they went well).
pub fn level_of(status: u16, slow: bool) -> tracing::Level {
    match status {
        500.. => tracing::Level::WARN,
        400..=499 => tracing::Level::INFO,
        _ if slow => tracing::Level::INFO,
        _ => tracing::Level::DEBUG,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_that_went_well_are_debug_lines() {
        use tracing::Level;
        assert_eq!(level_of(200, false), Level::DEBUG);
        assert_eq!(level_of(202, false), Level::DEBUG);
        assert_eq!(level_of(303, false), Level::DEBUG);
        assert_eq!(level_of(200, true), Level::INFO, "slow");
        assert_eq!(level_of(403, false), Level::INFO);
        assert_eq!(level_of(429, false), Level::INFO);
        assert_eq!(level_of(503, false), Level::WARN);
        assert_eq!(level_of(500, true), Level::WARN);
    }

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
