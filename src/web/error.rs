//! `WebError`: every way a control-plane request can fail, with a status
//! and a stable snake_case code. Handlers return it; the page layer turns it
//! into an HTML page or an htmx fragment, the API layer into JSON.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::store::StoreError;

/// A failed request. Internal errors keep their detail for the log only.
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    /// No valid session or token.
    #[error("log in to continue")]
    Unauthenticated,
    /// An API token past its expiry.
    #[error("this API token has expired")]
    TokenExpired,
    /// Authenticated, but the role does not allow it.
    #[error("your role does not allow this")]
    Forbidden,
    /// A state-changing request without a matching CSRF token or origin.
    #[error("the request did not come from this dashboard (CSRF check failed)")]
    Csrf,
    #[error("{0}")]
    NotFound(String),
    /// Bad input, with a stable code and a message for people.
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    /// The request is valid but the record's state does not allow it.
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    #[error("{0}")]
    TooManyRequests(String),
    #[error("the request body is too large")]
    TooLarge,
    /// A route that does not take this method.
    #[error("this route does not take that method")]
    MethodNotAllowed,
    /// Could not be done now; the same request may be sent again.
    #[error("{0}")]
    NotNow(String),
    #[error("internal error")]
    Internal(String),
}

/// What the page and API layers need to render an error, attached to the
/// response as an extension.
#[derive(Debug, Clone)]
pub struct ErrorInfo {
    pub code: &'static str,
    pub message: String,
}

impl WebError {
    pub fn bad(code: &'static str, message: impl Into<String>) -> Self {
        WebError::BadRequest {
            code,
            message: message.into(),
        }
    }

    /// The same error with `prefix` before a bad request's message (which
    /// item of a list it was about).
    pub fn prefixed(self, prefix: &str) -> Self {
        match self {
            WebError::BadRequest { code, message } => WebError::BadRequest {
                code,
                message: format!("{prefix}{message}"),
            },
            other => other,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            WebError::Unauthenticated | WebError::TokenExpired => StatusCode::UNAUTHORIZED,
            WebError::Forbidden | WebError::Csrf => StatusCode::FORBIDDEN,
            WebError::NotFound(_) => StatusCode::NOT_FOUND,
            WebError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            WebError::Conflict { .. } => StatusCode::CONFLICT,
            WebError::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            WebError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            WebError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            WebError::NotNow(_) => StatusCode::SERVICE_UNAVAILABLE,
            WebError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            WebError::Unauthenticated => "unauthenticated",
            WebError::TokenExpired => "token_expired",
            WebError::Forbidden => "forbidden",
            WebError::Csrf => "csrf_failed",
            WebError::NotFound(_) => "not_found",
            WebError::BadRequest { code, .. } | WebError::Conflict { code, .. } => code,
            WebError::TooManyRequests(_) => "rate_limited",
            WebError::TooLarge => "body_too_large",
            WebError::MethodNotAllowed => "method_not_allowed",
            WebError::NotNow(_) => "not_now",
            WebError::Internal(_) => "internal_error",
        }
    }
}

impl From<StoreError> for WebError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound { what, key } => {
                WebError::NotFound(format!("{what} `{key}` not found"))
            }
            StoreError::Conflict { what, key } => WebError::Conflict {
                code: "conflict",
                message: format!("{what} `{key}` already exists"),
            },
            StoreError::Transition(t) => WebError::Conflict {
                code: t.code(),
                message: t.to_string(),
            },
            StoreError::Invalid(m) => WebError::bad("invalid_request", m),
            StoreError::Declined { code, message } => WebError::bad(code, message),
            StoreError::Refused(r) => WebError::Conflict {
                code: r.code(),
                message: r.to_string(),
            },
            StoreError::NotNow(m) => WebError::NotNow(m),
            other => WebError::Internal(other.to_string()),
        }
    }
}

impl From<crate::engine::OpsError> for WebError {
    fn from(e: crate::engine::OpsError) -> Self {
        use crate::engine::OpsError;
        match e {
            // A node without workers cannot do it; another node may: the
            // request itself is sound.
            OpsError::Refused {
                code: code @ "no_workers",
                message,
            } => WebError::Conflict { code, message },
            OpsError::Refused { code, message } => WebError::bad(code, message),
            OpsError::UnknownProvider { name, .. } => {
                WebError::NotFound(format!("provider `{name}` not found"))
            }
            OpsError::Store(e) => e.into(),
        }
    }
}

impl From<askama::Error> for WebError {
    fn from(e: askama::Error) -> Self {
        WebError::Internal(format!("template: {e}"))
    }
}

impl IntoResponse for WebError {
    fn into_response(self) -> Response {
        let status = self.status();
        let info = ErrorInfo {
            code: self.code(),
            message: self.to_string(),
        };
        let mut response = Problem::new(status, info.code, &info.message).into_response();
        response.extensions_mut().insert(info);
        if let WebError::Internal(detail) = self {
            // The client sees an opaque message; the detail goes into the
            // request's log line (`web::requests`), with its id.
            response.extensions_mut().insert(Failure(detail));
        }
        response
    }
}

pub type WebResult<T> = Result<T, WebError>;

/// The media type of an error's body (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An error as RFC 9457 problem details: every refusal of `/api/v1` has
/// this shape (the dashboard turns it into a page, `security::page_errors`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// `about:blank`: the problem is what `status` and `code` say.
    #[serde(rename = "type")]
    #[schema(example = "about:blank")]
    pub kind: &'static str,
    /// The status's reason phrase (`Conflict`).
    pub title: &'static str,
    /// The HTTP status, as sent.
    #[schema(minimum = 400, maximum = 599)]
    pub status: u16,
    /// What went wrong, for people; may change between releases.
    pub detail: String,
    /// What went wrong, for programs: a stable snake_case code
    /// (`invalid_group`, `record_busy`, `rate_limited`).
    #[schema(example = "invalid_group")]
    pub code: &'static str,
    /// The same as `code`, as API version 1 has always named it.
    #[schema(deprecated)]
    pub error: &'static str,
    /// The same as `detail`, as API version 1 has always named it.
    #[schema(deprecated)]
    pub message: String,
}

impl Problem {
    pub fn new(status: StatusCode, code: &'static str, detail: &str) -> Self {
        Problem {
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail: detail.to_owned(),
            code,
            error: code,
            message: detail.to_owned(),
        }
    }
}

/// A problem as sent: its status, `application/problem+json`, the body.
impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))],
            Json(self),
        )
            .into_response()
    }
}

/// What an internal error really was, for the log only: attached to the
/// response, logged with the request's line.
#[derive(Debug, Clone)]
pub struct Failure(pub String);
