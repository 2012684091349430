//! How a request asks for a fragment: htmx marks its requests.

use axum::http::HeaderMap;

/// True for requests htmx made.
pub fn is_htmx(headers: &HeaderMap) -> bool {
    headers.get("hx-request").is_some_and(|v| v == "true")
}
