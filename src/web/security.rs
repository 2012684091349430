//! Layers every response passes through: security headers (errors
//! included), CSRF and origin checks on state-changing dashboard requests,
//! and the rendering of errors as pages, htmx fragments or redirects.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::web::AppState;
use crate::web::htmx::is_htmx;

use super::auth::{self, CSRF_FIELD, CSRF_HEADER};
use super::error::{ErrorInfo, WebError};

/// No inline script or style, no eval: htmx runs from `/static` with
/// `allowEval` off and its indicator styles in our stylesheet.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Adds the security headers to every response.
pub async fn headers(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let mut response = next.run(req).await;
    let h = response.headers_mut();
    // Cookies marked Secure mean the dashboard is reached over HTTPS:
    // browsers are told to come back only that way for a year.
    if state.web.keys.secure {
        h.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        );
    }
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Not `no-referrer`: under it browsers send `Origin: null` with form
    // posts, and the CSRF check needs the real origin.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// The origin this dashboard is served from: `public_url`'s, or the `Host`
/// the browser used.
fn expected_host(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase)
}

/// Checks `Origin` against the dashboard's own origin.
pub fn origin_ok(headers: &HeaderMap, state: &AppState) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let origin = origin.to_ascii_lowercase();
    match state.config.get().server.public_origin() {
        Some(expected) => origin == expected,
        None => {
            let host = origin
                .strip_prefix("https://")
                .or_else(|| origin.strip_prefix("http://"));
            host.is_some() && host.map(str::to_owned) == expected_host(headers)
        }
    }
}

/// Refuses state-changing dashboard requests that do not carry the
/// session's CSRF token (header or form field) and a matching `Origin`.
/// Applies to every method but GET and HEAD; the login form, which has no
/// session yet, needs the origin only.
pub async fn csrf(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if matches!(*req.method(), Method::GET | Method::HEAD) {
        return next.run(req).await;
    }
    if !origin_ok(req.headers(), &state) {
        return WebError::Csrf.into_response();
    }
    if req.uri().path() == "/login" {
        return next.run(req).await;
    }
    let caller = match auth::session_caller(req.headers(), &state).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let session_id = caller.session_id.clone().unwrap_or_default();
    let from_header = req
        .headers()
        .get(CSRF_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let (req, presented) = match from_header {
        Some(token) => (req, Some(token)),
        None => {
            // A plain form: read the body (bounded) to find the field, then
            // hand the same bytes on.
            let limit = state.config.get().server.limits.max_body_bytes;
            let (parts, body) = req.into_parts();
            let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
                return WebError::TooLarge.into_response();
            };
            let token = form_urlencoded::parse(&bytes)
                .find(|(k, _)| k == CSRF_FIELD)
                .map(|(_, v)| v.into_owned());
            (Request::from_parts(parts, Body::from(bytes)), token)
        }
    };
    match presented {
        Some(token) if state.web.keys.csrf_ok(&session_id, &token) => {
            let mut req = req;
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        _ => WebError::Csrf.into_response(),
    }
}

/// Turns dashboard errors into something a person reads: a login redirect
/// when the session is missing or expired, a message fragment for htmx, a
/// whole page otherwise.
pub async fn page_errors(req: Request, next: Next) -> Response {
    let htmx = is_htmx(req.headers());
    let request_id = req
        .extensions()
        .get::<super::requests::RequestId>()
        .map(|r| r.0.clone());
    let response = next.run(req).await;
    let status = response.status();
    let info = match response.extensions().get::<ErrorInfo>().cloned() {
        Some(info) => info,
        // axum's own rejections (a form or path that does not parse, a
        // method not allowed) carry no ErrorInfo: give them a message.
        None if (status.is_client_error() || status.is_server_error())
            && !response
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|t| t.starts_with("text/html")) =>
        {
            ErrorInfo {
                code: match status {
                    StatusCode::NOT_FOUND => "not_found",
                    StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
                    StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
                    s if s.is_server_error() => "internal_error",
                    _ => "invalid_request",
                },
                message: match status {
                    StatusCode::NOT_FOUND => "There is nothing here.".to_owned(),
                    StatusCode::METHOD_NOT_ALLOWED => {
                        "This address does not take that kind of request.".to_owned()
                    }
                    StatusCode::PAYLOAD_TOO_LARGE => "The request is too large.".to_owned(),
                    s if s.is_server_error() => "Something went wrong on the server.".to_owned(),
                    _ => "The request was not filled in as expected.".to_owned(),
                },
            }
        }
        None => return response,
    };
    if status == StatusCode::UNAUTHORIZED {
        if htmx {
            let mut r = StatusCode::UNAUTHORIZED.into_response();
            r.headers_mut()
                .insert("hx-redirect", HeaderValue::from_static("/login"));
            return r;
        }
        return axum::response::Redirect::to("/login").into_response();
    }
    let html = if htmx {
        super::pages::render_flash(status, &info)
    } else {
        super::pages::render_error_page(status, &info, request_id.as_deref())
    };
    let mut r = (status, html).into_response();
    if let Some(retry) = response.headers().get(header::RETRY_AFTER) {
        r.headers_mut().insert(header::RETRY_AFTER, retry.clone());
    }
    // What an internal error was, for the request's log line.
    if let Some(failure) = response.extensions().get::<super::error::Failure>() {
        r.extensions_mut().insert(failure.clone());
    }
    if htmx {
        // Errors go to the page's message area, whatever the target was.
        r.headers_mut()
            .insert("hx-retarget", HeaderValue::from_static("#flash"));
        r.headers_mut()
            .insert("hx-reswap", HeaderValue::from_static("innerHTML"));
    }
    r
}
