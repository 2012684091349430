//! `/login` and `/logout`. Logins are limited per client address
//! (tower_governor); failed ones slow the account name's next check by a
//! delay that grows with them, capped (`domain::login`, a counter in the
//! store shared by all nodes), which a browser that logged in to the name
//! before skips (a device cookie); unknown names cost the same argon2 time
//! as known ones and are counted alike.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{MethodRouter, get, post};
use axum::{Form, Router};
use serde::Deserialize;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

use crate::auth::password;
use crate::domain::login::{self, LoginPolicy};
use crate::domain::{UnixMs, User};
use crate::web::AppState;

use crate::web::auth::{self, ClientIpKey};
use crate::web::error::{WebError, WebResult};

use super::{html, safe_next};

pub fn router(state: &AppState) -> Router<AppState> {
    let submit = like_logins(
        state,
        post(submit),
        Some(vec![axum::http::Method::POST]),
        "too many login attempts from your address; wait a minute",
    );
    Router::new()
        .route("/login", get(page).merge(submit))
        .route("/logout", post(logout))
        .route("/me/theme", post(theme))
}

/// `route` limited per client address (IPv6 by its /64) to
/// `server.limits.logins_per_minute`, a burst of that many refilled
/// evenly over the minute (for `methods` only, when given); past it 429
/// with `message` and `Retry-After: 60`.
pub(super) fn like_logins(
    state: &AppState,
    route: MethodRouter<AppState>,
    methods: Option<Vec<axum::http::Method>>,
    message: &'static str,
) -> MethodRouter<AppState> {
    let per_minute = u64::from(state.config.get().server.limits.logins_per_minute.max(1));
    let mut limit = GovernorConfigBuilder::default().key_extractor(ClientIpKey {
        trusted: state.web.keys.trusted_proxies.clone(),
    });
    limit
        .per_millisecond((60_000 / per_minute).max(1))
        .burst_size(u32::try_from(per_minute).unwrap_or(u32::MAX));
    if let Some(methods) = methods {
        limit.methods(methods);
    }
    let Some(limit) = limit.finish().map(Arc::new) else {
        return route;
    };
    let limiter = limit.limiter().clone();
    crate::web::clean_every_minute(state.shutdown.clone(), move || limiter.retain_recent());
    route.layer(GovernorLayer::new(limit).error_handler(move |_| {
        let mut r = WebError::TooManyRequests(message.into()).into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("60"));
        r
    }))
}

#[derive(Template)]
#[template(path = "pages/login.html")]
pub(super) struct LoginPage {
    pub error: Option<String>,
    pub next: String,
    pub username: String,
    /// The sign-on button's link and words, when sign-on is set.
    pub sign_on: Option<(String, String)>,
    /// Whether local passwords log in (the form is shown).
    pub passwords: bool,
}

impl LoginPage {
    /// The page for `next`, as the configuration sets it up now.
    pub(super) fn new(state: &AppState, next: &str) -> LoginPage {
        let config = state.config.get();
        let oidc = config.oidc.as_ref();
        let sign_on = oidc.map(|o| {
            let next = form_urlencoded::byte_serialize(next.as_bytes()).collect::<String>();
            (format!("/auth/oidc/start?next={next}"), o.label.clone())
        });
        LoginPage {
            error: None,
            next: next.to_owned(),
            username: String::new(),
            sign_on,
            passwords: oidc.is_none_or(|o| o.local_passwords),
        }
    }

    /// This page with `message`, answered with `status`.
    pub(super) fn refusing(mut self, status: StatusCode, message: &str) -> WebResult<Response> {
        self.error = Some(message.to_owned());
        let mut r = html(&self)?;
        *r.status_mut() = status;
        Ok(r)
    }
}

#[derive(Deserialize)]
struct NextQuery {
    next: Option<String>,
}

async fn page(State(state): State<AppState>, Query(q): Query<NextQuery>) -> WebResult<Response> {
    html(&LoginPage::new(&state, &safe_next(q.next.as_deref(), "/")))
}

#[derive(Deserialize)]
struct LoginForm {
    username: String,
    password: String,
    next: Option<String>,
}

/// The login page again, with `message` and `status`.
fn refused(
    state: &AppState,
    status: StatusCode,
    message: &str,
    username: &str,
    next: &str,
) -> WebResult<Response> {
    let mut page = LoginPage::new(state, next);
    page.username = username.to_owned();
    page.refusing(status, message)
}

/// 429 for a name that must wait `wait_ms` before its next check.
fn too_many(state: &AppState, wait_ms: i64, username: &str, next: &str) -> WebResult<Response> {
    let secs = login::retry_after_secs(wait_ms);
    let message = format!("Too many failed logins for this account. Try again in {secs} s.");
    let mut r = refused(
        state,
        StatusCode::TOO_MANY_REQUESTS,
        &message,
        username,
        next,
    )?;
    retry_after(&mut r, secs);
    Ok(r)
}

fn retry_after(r: &mut Response, secs: i64) {
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
}

fn login_policy(state: &AppState) -> LoginPolicy {
    let l = &state.config.get().server.limits;
    LoginPolicy {
        threshold: i64::from(l.account_failures),
        forget_after_ms: i64::try_from(l.account_window.0.as_millis()).unwrap_or(i64::MAX),
    }
}

async fn submit(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> WebResult<Response> {
    let username = form.username.trim().to_ascii_lowercase();
    let next = safe_next(form.next.as_deref(), "/");
    if state
        .config
        .get()
        .oidc
        .as_ref()
        .is_some_and(|o| !o.local_passwords)
    {
        return refused(&state, StatusCode::FORBIDDEN, NO_PASSWORDS, "", &next);
    }
    if username.is_empty() || username.len() > 64 || form.password.len() > password::MAX_LEN {
        return refused(&state, StatusCode::UNAUTHORIZED, WRONG, &username, &next);
    }
    let now = state.clock.now_ms();
    let policy = login_policy(&state);
    let seen = state.db.login_failures(&username).await?;
    // A browser that logged in to this name before skips the name's delay,
    // so failures from elsewhere cannot keep its owner out.
    let device = state.web.keys.device_ok(&headers, &username, now);
    let mut claimed = false;
    if !device {
        let wait = match policy.wait_ms(seen, now) {
            Some(wait) => Some(wait),
            // Past its threshold, a name is checked one guess at a time:
            // this check counts as a failure before it is made, if no
            // other (on any node) took the turn first.
            None if policy.takes_turns(seen, now) => {
                let seen = seen.ok_or_else(|| WebError::Internal("no count".into()))?;
                claimed = state.db.claim_login_check(&username, seen, now).await?;
                (!claimed).then(|| policy.delay_ms(seen.failures + 1).max(1))
            }
            None => None,
        };
        if let Some(wait) = wait {
            return too_many(&state, wait, &username, &next);
        }
    }
    let user = match check_password(&state, &username, form.password).await? {
        Checked::Matches(user) => user,
        Checked::Busy => {
            let mut r = refused(
                &state,
                StatusCode::SERVICE_UNAVAILABLE,
                BUSY,
                &username,
                &next,
            )?;
            retry_after(&mut r, 1);
            return Ok(r);
        }
        Checked::Wrong => {
            // Counted once the check is over and its place given back, so
            // no check waits on this write (a claimed turn counted already).
            let failures = if claimed {
                seen.map_or(1, |s| s.failures + 1)
            } else {
                let forget_before = policy.forget_before(now);
                let count = state.db.count_login_failure(&username, now, forget_before);
                count.await?.failures
            };
            tracing::warn!(user = %username.escape_debug(), failures, "failed login");
            return refused(&state, StatusCode::UNAUTHORIZED, WRONG, &username, &next);
        }
    };
    if seen.is_some() {
        state.db.login_succeeded(&username).await?;
    }
    let mut r = Redirect::to(&next).into_response();
    start_session(&state, &user, now, &mut r).await?;
    set_cookie(&mut r, &state.web.keys.device_cookie(&user.username, now)?)?;
    Ok(r)
}

const WRONG: &str = "Unknown user or wrong password.";
const NO_PASSWORDS: &str = "Password logins are turned off here: sign in with single sign-on.";
const BUSY: &str = "Too many logins are being checked right now. Try again in a second.";

/// What a password check found.
enum Checked {
    /// The enabled user whose password it is.
    Matches(User),
    /// An unknown or disabled user, or not their password.
    Wrong,
    /// Not checked: every place for a check is taken.
    Busy,
}

/// Checks `password` for `username`: always one argon2 verification,
/// against a dummy hash when the user is unknown, disabled or signs on
/// through the provider, so timing
/// does not tell which names exist; none when the node's checks are all
/// taken (`server.limits.password_checks`).
async fn check_password(state: &AppState, username: &str, password: String) -> WebResult<Checked> {
    let user = state.db.user_by_name(username).await?;
    let Some(slot) = state.web.password_checks.try_slot() else {
        return Ok(Checked::Busy);
    };
    // A user who signs on has no password: checked against the dummy
    // too, so its name costs what any other does.
    let usable = |u: &User| !u.disabled && !u.signs_on;
    let hash = match &user {
        Some(u) if usable(u) => u.password_hash.clone(),
        _ => state.web.keys.dummy_hash.clone(),
    };
    let matches = slot.verify(password, hash).await;
    Ok(match user {
        Some(u) if matches && usable(&u) => Checked::Matches(u),
        _ => Checked::Wrong,
    })
}

/// A new session for `user`, its cookie set on `r`.
pub(super) async fn start_session(
    state: &AppState,
    user: &User,
    now: UnixMs,
    r: &mut Response,
) -> WebResult<()> {
    let keys = &state.web.keys;
    let (sid, session) = auth::new_session(user, now, keys.session_ttl_ms)
        .map_err(|e| WebError::Internal(e.to_string()))?;
    state.db.create_session(&session).await?;
    let token = keys.issue(&sid, &session)?;
    tracing::info!(user = %user.username, "logged in");
    set_cookie(r, &keys.session_cookie(token))
}

/// Ends the session server-side, so the token is dead even if kept (and,
/// when set up so, the provider's too: `sign_on::after_logout`).
async fn logout(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
) -> WebResult<Response> {
    let mut user = None;
    if let Ok(caller) = auth::session_caller(&headers, &state).await {
        if let Some(sid) = caller.session_id {
            let key = auth::session_key(&sid);
            state.db.revoke_session(&key, state.clock.now_ms()).await?;
        }
        user = caller.user;
    }
    let to = super::sign_on::after_logout(&state, user.as_ref()).await;
    let mut r = Redirect::to(&to).into_response();
    set_cookie(&mut r, &state.web.keys.clear_cookie())?;
    Ok(r)
}

#[derive(Deserialize)]
struct ThemeForm {
    /// `light`, `dark`, or `system` (follow the system's scheme).
    theme: String,
}

/// The path of the page a form was posted from (its `Referer`, which the
/// dashboard's referrer policy sends to this site only), if on this site.
fn back_to(headers: &axum::http::HeaderMap) -> String {
    let referer = headers
        .get(header::REFERER)
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.split_once("://"))
        .and_then(|(_, rest)| rest.find('/').map(|i| &rest[i..]));
    safe_next(referer, "/")
}

/// `POST /me/theme`: the caller's colour scheme, kept with their user so
/// it follows them to every browser.
async fn theme(
    caller: auth::Authed<auth::Viewer>,
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    Form(form): Form<ThemeForm>,
) -> WebResult<Response> {
    let theme = match form.theme.as_str() {
        "light" => Some("light"),
        "dark" => Some("dark"),
        "system" => None,
        other => {
            return Err(WebError::BadRequest {
                code: "bad_theme",
                message: format!("unknown theme `{other}`: light, dark or system"),
            });
        }
    };
    let Some(user) = &caller.user else {
        return Err(WebError::Forbidden);
    };
    state.db.set_theme(user.id, theme).await?;
    Ok(Redirect::to(&back_to(&headers)).into_response())
}

pub(super) fn set_cookie(
    r: &mut Response,
    cookie: &axum_extra::extract::cookie::Cookie<'_>,
) -> WebResult<()> {
    let value = HeaderValue::from_str(&cookie.to_string())
        .map_err(|e| WebError::Internal(format!("cookie: {e}")))?;
    r.headers_mut().append(header::SET_COOKIE, value);
    Ok(())
}
