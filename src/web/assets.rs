//! `/static/*`: the stylesheet, htmx and our small script, embedded in the
//! binary so it runs with no files beside it.

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::web::AppState;

/// (name, content type, bytes).
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "htmx.min.js",
        "text/javascript",
        include_bytes!("../../static/htmx.min.js"),
    ),
    (
        "app.js",
        "text/javascript",
        include_bytes!("../../static/app.js"),
    ),
    (
        "app.css",
        "text/css",
        include_bytes!("../../static/app.css"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_bytes!("../../static/favicon.svg"),
    ),
];

pub fn router() -> Router<AppState> {
    Router::new().route("/static/{name}", get(asset))
}

async fn asset(Path(name): Path<String>) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, content_type, bytes)) => {
            let mut r = bytes.into_response();
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            r.headers_mut().insert(
                header::CACHE_CONTROL,
                HeaderValue::from_static("public, max-age=3600"),
            );
            r
        }
        None => (StatusCode::NOT_FOUND, "not found").into_response(),
    }
}
