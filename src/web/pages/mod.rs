//! Dashboard pages: server-rendered Askama templates, htmx for the live and
//! partial parts. A handler answers an htmx request with its fragment (a
//! named block of the page's template) and a plain request with the page.

mod admin;
mod audit;
mod login;
mod notify;
mod overview;
mod pipelines;
mod providers;
pub mod records;
mod sign_on;
mod triggers;

use askama::Template;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use crate::domain::{Role, UnixMs, time::format_ms};
use crate::web::AppState;

use super::auth::Caller;
use super::error::{ErrorInfo, WebResult};

pub fn router(state: &AppState) -> Router<AppState> {
    Router::new()
        .merge(login::router(state))
        .merge(sign_on::router(state))
        .merge(overview::router())
        .merge(records::router())
        .merge(providers::router())
        .merge(pipelines::router())
        .merge(audit::router())
        .merge(triggers::router())
        .merge(notify::router())
        .merge(admin::router())
}

/// What the layout needs about the caller: the menu and the CSRF token.
pub struct Nav {
    pub username: String,
    pub role: &'static str,
    pub csrf: String,
    pub operator: bool,
    pub admin: bool,
    /// The menu entry to highlight.
    pub active: &'static str,
    /// The colour scheme the user chose (`light`, `dark`), or `""` for
    /// the system's.
    pub theme: &'static str,
}

impl Nav {
    /// The scheme the theme button offers next: system → dark → light.
    pub fn next_theme(&self) -> &'static str {
        match self.theme {
            "dark" => "light",
            "light" => "system",
            _ => "dark",
        }
    }

    /// The scheme in use, as the button says it.
    pub fn theme_label(&self) -> &'static str {
        match self.theme {
            "dark" => "dark",
            "light" => "light",
            _ => "as the system",
        }
    }
}

impl Nav {
    pub fn new(caller: &Caller, active: &'static str) -> Nav {
        Nav {
            username: caller.actor.clone(),
            role: caller.role.as_str(),
            csrf: caller.csrf.clone(),
            operator: caller.can(Role::Operator),
            admin: caller.can(Role::Admin),
            active,
            theme: match caller.user.as_ref().and_then(|u| u.theme.as_deref()) {
                Some("dark") => "dark",
                Some("light") => "light",
                _ => "",
            },
        }
    }
}

pub(super) use crate::web::people::audit;

/// A rendered template as an HTML response.
pub fn html<T: Template>(t: &T) -> WebResult<Response> {
    Ok(Html(t.render()?).into_response())
}

/// A timestamp for people (UTC).
pub fn when(ms: UnixMs) -> String {
    format_ms(ms)
        .replace('T', " ")
        .trim_end_matches('Z')
        .to_owned()
}

/// An optional timestamp for people.
pub fn when_opt(ms: Option<UnixMs>) -> String {
    ms.map(when).unwrap_or_default()
}

#[derive(Template)]
#[template(path = "partials/flash.html")]
struct Flash<'a> {
    kind: &'a str,
    message: &'a str,
}

#[derive(Template)]
#[template(path = "pages/error.html")]
struct ErrorPage<'a> {
    status: u16,
    code: &'a str,
    message: &'a str,
    request_id: Option<&'a str>,
}

/// An error as a message for the page's flash area (htmx requests).
pub fn render_flash(_status: StatusCode, info: &ErrorInfo) -> Html<String> {
    let t = Flash {
        kind: "error",
        message: &info.message,
    };
    Html(t.render().unwrap_or_else(|_| "error".to_owned()))
}

/// An error as a whole page (plain requests), with the request's id to
/// quote when reporting it.
pub fn render_error_page(
    status: StatusCode,
    info: &ErrorInfo,
    request_id: Option<&str>,
) -> Html<String> {
    let t = ErrorPage {
        status: status.as_u16(),
        code: info.code,
        message: &info.message,
        request_id,
    };
    Html(t.render().unwrap_or_else(|_| "error".to_owned()))
}

/// A success message for the flash area.
pub fn flash_ok(message: &str) -> WebResult<Html<String>> {
    Ok(Html(
        Flash {
            kind: "ok",
            message,
        }
        .render()?,
    ))
}

/// Where to send a browser after a plain form post: back where it was,
/// when that is a path on this site.
pub fn safe_next(next: Option<&str>, fallback: &str) -> String {
    match next {
        // Browsers drop tabs and newlines from URLs and read `\` as `/`, so
        // any of those could turn a path into `//elsewhere`: refuse them.
        Some(n)
            if n.starts_with('/')
                && !n.starts_with("//")
                && !n.bytes().any(|b| b <= b' ' || b == 0x7f || b == b'\\') =>
        {
            n.to_owned()
        }
        _ => fallback.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::safe_next;

    #[test]
    fn next_stays_on_this_site() {
        for ok in ["/", "/records?state=parked", "/records/12"] {
            assert_eq!(safe_next(Some(ok), "/"), ok);
        }
        for bad in [
            "//evil.example",
            "/\t/evil.example",
            "/\\evil.example",
            "/\n/evil.example",
            "https://evil.example",
            "evil",
            "/ /x",
            "",
        ] {
            assert_eq!(safe_next(Some(bad), "/"), "/", "{bad:?}");
        }
        assert_eq!(safe_next(None, "/x"), "/x");
    }
}
