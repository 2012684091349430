//! Single sign-on with OpenID Connect: `/auth/oidc/start` sends the
//! browser to the provider, `/auth/oidc/callback` receives it back
//! (`web::oidc` speaks the protocol; `[oidc]` configures it).
//!
//! A sign-in's state, nonce and PKCE verifier are kept in the store under
//! the hash of its state and taken once; the browser holds the state in a
//! short cookie (`SameSite=Lax`, so the provider's redirect carries it),
//! which binds the answer to the browser that asked. Every refusal after
//! that binding is audited (`sign_on_refused`).

use askama::Template;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum_extra::extract::cookie::{Cookie, SameSite};
use serde::Deserialize;
use serde_json::json;

use crate::config::Config;
use crate::config::oidc::OidcConfig;
use crate::domain::{UnixMs, User};
use crate::store::{PendingSignOn, SignOnUser, StoreError};
use crate::web::AppState;
use crate::web::error::{WebError, WebResult};
use crate::web::oidc::{self, Fresh, OidcError};

use super::login::{LoginPage, like_logins, set_cookie, start_session};
use super::{html, safe_next};

/// How long a sign-in may take at the provider.
const SIGN_ON_TTL_MS: i64 = 10 * 60_000;
/// The cookie holding a sign-in's state, with and without `Secure`.
const SECURE_COOKIE: &str = "__Host-ballast_sign_on";
const PLAIN_COOKIE: &str = "ballast_sign_on";

pub fn router(state: &AppState) -> Router<AppState> {
    // Each start writes a row: limited per client address as logins are.
    let begin = like_logins(
        state,
        get(start),
        None,
        "too many sign-ins from your address; wait a minute",
    );
    // Each answer may take a row and write an audit entry: limited alike.
    let answer = like_logins(
        state,
        get(callback),
        None,
        "too many sign-ins from your address; wait a minute",
    );
    Router::new()
        .route("/auth/oidc/start", begin)
        .route(crate::config::oidc::CALLBACK_PATH, answer)
}

#[derive(Deserialize)]
struct StartQuery {
    next: Option<String>,
}

/// The configured sign-on, or 404.
fn configured(config: &Config) -> WebResult<&OidcConfig> {
    config
        .oidc
        .as_ref()
        .ok_or_else(|| WebError::NotFound("single sign-on is not set up here".into()))
}

fn cookie_name(state: &AppState) -> &'static str {
    match state.web.keys.secure {
        true => SECURE_COOKIE,
        false => PLAIN_COOKIE,
    }
}

/// The state cookie: `value` for ten minutes, or (empty) deleted.
fn state_cookie(state: &AppState, value: &str) -> Cookie<'static> {
    let age = if value.is_empty() { 0 } else { SIGN_ON_TTL_MS };
    Cookie::build((cookie_name(state), value.to_owned()))
        .path("/")
        .http_only(true)
        .secure(state.web.keys.secure)
        .same_site(SameSite::Lax)
        .max_age(time::Duration::milliseconds(age))
        .build()
}

/// `GET /auth/oidc/start`: a new sign-in, kept, and the browser sent to
/// the provider's authorization endpoint.
async fn start(State(state): State<AppState>, Query(q): Query<StartQuery>) -> WebResult<Response> {
    let config = state.config.get();
    let cfg = configured(&config)?;
    let next = safe_next(q.next.as_deref(), "/");
    let now = state.clock.now_ms();
    let metadata = match state.web.sign_on.metadata(cfg).await {
        Ok(m) => m,
        Err(e) => {
            // The details are for the log, not for whoever asks.
            tracing::warn!(error = %e, "sign-on unavailable");
            let message = "Single sign-on is unavailable right now. Try again in a minute.";
            return LoginPage::new(&state, &next)
                .refusing(StatusCode::SERVICE_UNAVAILABLE, message);
        }
    };
    let fresh = Fresh::new().map_err(|e| WebError::Internal(e.to_string()))?;
    let pending = PendingSignOn {
        state_key: oidc::state_key(&fresh.state),
        nonce: fresh.nonce.clone(),
        verifier: fresh.verifier.clone(),
        next,
        created_at: now,
    };
    state
        .db
        .begin_sign_on(&pending, now - SIGN_ON_TTL_MS)
        .await?;
    let redirect = redirect_url(&config, cfg)?;
    let mut url = reqwest::Url::parse(&metadata.authorization_endpoint)
        .map_err(|e| WebError::Internal(format!("authorization endpoint: {e}")))?;
    let scopes: Vec<&str> = std::iter::once("openid")
        .chain(
            cfg.scopes
                .iter()
                .map(String::as_str)
                .filter(|s| *s != "openid"),
        )
        .collect();
    url.query_pairs_mut()
        .append_pair("response_type", "code")
        .append_pair("client_id", &cfg.client_id)
        .append_pair("redirect_uri", &redirect)
        .append_pair("scope", &scopes.join(" "))
        .append_pair("state", &fresh.state)
        .append_pair("nonce", &fresh.nonce)
        .append_pair("code_challenge", &oidc::challenge(&fresh.verifier))
        .append_pair("code_challenge_method", "S256");
    let mut r = Redirect::to(url.as_str()).into_response();
    set_cookie(&mut r, &state_cookie(&state, &fresh.state))?;
    Ok(r)
}

fn redirect_url(config: &Config, cfg: &OidcConfig) -> WebResult<String> {
    cfg.redirect_url(&config.server)
        .ok_or_else(|| WebError::Internal("no redirect URL (checked at start)".into()))
}

#[derive(Deserialize)]
struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    iss: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

/// Why a sign-in was refused: its status, what the person reads, and
/// whether it is audited.
struct Refusal {
    status: StatusCode,
    message: String,
    /// What the audit entry says (none: not audited).
    audit: Option<serde_json::Value>,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
            audit: None,
        }
    }

    fn audited(mut self, detail: serde_json::Value) -> Refusal {
        self.audit = Some(detail);
        self
    }
}

impl From<OidcError> for Refusal {
    fn from(e: OidcError) -> Refusal {
        let status = match &e {
            OidcError::Unreachable(_) | OidcError::Discovery(_) => StatusCode::BAD_GATEWAY,
            OidcError::Refused(_) | OidcError::Token(_) => StatusCode::UNAUTHORIZED,
        };
        let reason = e.to_string();
        // A provider's addresses and words are for the log and the audit;
        // the person reads what Ballast itself found.
        let message = match &e {
            OidcError::Unreachable(_) | OidcError::Discovery(_) => {
                "Single sign-on is unavailable right now. Try again in a minute.".to_owned()
            }
            OidcError::Refused(_) => "Sign-in refused by the provider. Sign in again.".to_owned(),
            OidcError::Token(found) => {
                format!("Sign-in refused: the ID token is not valid: {found}.")
            }
        };
        Refusal::new(status, message).audited(json!({ "reason": reason }))
    }
}

impl From<WebError> for Refusal {
    fn from(e: WebError) -> Refusal {
        tracing::error!(error = %e, "sign-on failed");
        Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Sign-in failed; see the server's log.",
        )
    }
}

impl From<StoreError> for Refusal {
    fn from(e: StoreError) -> Refusal {
        WebError::from(e).into()
    }
}

/// `GET /auth/oidc/callback`: the provider's answer.
async fn callback(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<CallbackQuery>,
) -> WebResult<Response> {
    let config = state.config.get();
    let cfg = configured(&config)?;
    let now = state.clock.now_ms();
    let (result, next) = match take_pending(&state, &headers, &q).await {
        Ok(pending) => {
            let next = pending.next.clone();
            (finish(&state, (&config, cfg), &q, pending, now).await, next)
        }
        Err(refusal) => (Err(refusal), "/".to_owned()),
    };
    let mut r = match result {
        Ok(user) => signed_in(&state, &user, now, &next).await?,
        Err(refusal) => {
            tracing::warn!(reason = %refusal.message, "sign-in refused");
            if let Some(detail) = refusal.audit {
                super::audit(&state, "sign-on", "sign_on_refused", detail).await?;
            }
            LoginPage::new(&state, &next).refusing(refusal.status, &refusal.message)?
        }
    };
    set_cookie(&mut r, &state_cookie(&state, ""))?;
    Ok(r)
}

/// The sign-in this answer belongs to: its state is the one this
/// browser's cookie holds, and it is still kept (taken now, so never
/// twice) and fresh.
async fn take_pending(
    state: &AppState,
    headers: &HeaderMap,
    q: &CallbackQuery,
) -> Result<PendingSignOn, Refusal> {
    use subtle::ConstantTimeEq;
    let not_here = || {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "This sign-in did not start in this browser, or took too long. Sign in again.",
        )
    };
    let presented = q.state.as_deref().ok_or_else(not_here)?;
    let held = crate::web::auth::cookie_value(headers, cookie_name(state)).ok_or_else(not_here)?;
    if !bool::from(held.as_bytes().ct_eq(presented.as_bytes())) {
        return Err(not_here());
    }
    let pending = state.db.take_sign_on(&oidc::state_key(presented)).await?;
    let Some(pending) = pending else {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "This sign-in was used already or has expired. Sign in again.",
        )
        .audited(
            json!({ "reason": "the state was used already (a replayed answer) or has expired" }),
        ));
    };
    if state.clock.now_ms() - pending.created_at > SIGN_ON_TTL_MS {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "This sign-in took too long. Sign in again.",
        ));
    }
    Ok(pending)
}

/// The rest of the answer: the provider's verdict, its issuer, the code
/// exchanged, the ID token checked, the groups mapped, the user.
async fn finish(
    state: &AppState,
    (config, cfg): (&Config, &OidcConfig),
    q: &CallbackQuery,
    pending: PendingSignOn,
    now: UnixMs,
) -> Result<User, Refusal> {
    let client = &state.web.sign_on;
    let metadata = client.metadata(cfg).await?;
    let code = check_answer(q, cfg, &metadata)?;
    let redirect = redirect_url(config, cfg)?;
    let id_token = client
        .exchange((cfg, &metadata), &redirect, code, &pending.verifier)
        .await?;
    let person = client.verify(cfg, &id_token, &pending.nonce, now).await?;
    let who =
        json!({ "subject": person.subject, "user": person.username, "groups": person.groups });
    let refused = |status, message: &str, reason: &str| {
        let mut detail = who.clone();
        detail["reason"] = json!(reason);
        Refusal::new(status, message).audited(detail)
    };
    let Some(granted) = cfg.grant(&person.groups) else {
        // Access taken away at the provider ends what it left here (but
        // the last enabled admin stays one).
        let why = match state
            .db
            .revoke_signed_on(&cfg.issuer, &person.subject, now)
            .await
        {
            Ok(_) => "no group of theirs is mapped to a role",
            Err(StoreError::Refused(_)) => {
                "no group of theirs is mapped to a role; kept as the last enabled admin"
            }
            Err(e) => return Err(e.into()),
        };
        return Err(refused(
            StatusCode::FORBIDDEN,
            "Your groups grant no access to Ballast. Ask an administrator.",
            why,
        ));
    };
    let signing_on = SignOnUser {
        issuer: cfg.issuer.clone(),
        subject: person.subject.clone(),
        username: person.username.clone(),
        role: granted.role,
        pipelines: granted.pipelines,
        unmask: granted.unmask,
    };
    let user = match signed_on(state, signing_on, now).await {
        Ok(u) => u,
        Err(StoreError::Refused(r)) => {
            let message = format!("Sign-in refused: {r}.");
            return Err(refused(StatusCode::FORBIDDEN, &message, &r.to_string()));
        }
        Err(StoreError::Conflict { .. }) => {
            let message = "Sign-in refused: every name made from yours is taken here.";
            return Err(refused(StatusCode::CONFLICT, message, "no free name"));
        }
        Err(e) => return Err(e.into()),
    };
    if user.disabled {
        let message = "Your user is disabled here.";
        return Err(refused(
            StatusCode::FORBIDDEN,
            message,
            "the user is disabled",
        ));
    }
    Ok(user)
}

/// The code of an answer that is a success, from the configured issuer
/// (RFC 9207: an answer naming another is another provider's; one naming
/// none is refused when the provider says it names itself).
fn check_answer<'q>(
    q: &'q CallbackQuery,
    cfg: &OidcConfig,
    metadata: &oidc::Metadata,
) -> Result<&'q str, Refusal> {
    let refused = |status, reason: String| {
        let message = format!("Sign-in refused: {reason}.");
        Refusal::new(status, message).audited(json!({ "reason": reason }))
    };
    if let Some(error) = &q.error {
        let said = q.error_description.as_deref().unwrap_or_default();
        let reason = format!("the provider answered {error} {said}")
            .trim()
            .to_owned();
        let message = "Sign-in refused by the provider. Sign in again.";
        return Err(
            Refusal::new(StatusCode::UNAUTHORIZED, message).audited(json!({ "reason": reason }))
        );
    }
    match q.iss.as_deref() {
        Some(iss) if iss != cfg.issuer => {
            let reason = format!("the answer came from issuer `{iss}`, not `{}`", cfg.issuer);
            return Err(refused(StatusCode::BAD_REQUEST, reason));
        }
        None if metadata.authorization_response_iss_parameter_supported => {
            let reason = "the answer does not name its issuer, as the provider says it does";
            return Err(refused(StatusCode::BAD_REQUEST, reason.into()));
        }
        _ => {}
    }
    q.code.as_deref().ok_or_else(|| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "The provider's answer carries no code.",
        )
    })
}

/// The user `person` is. A name another user has is followed by `-2`,
/// `-3` …: users are known by issuer and subject, names are labels. (The
/// same person's first sign-in in two tabs: the second finds the first's
/// user.)
async fn signed_on(
    state: &AppState,
    mut person: SignOnUser,
    now: UnixMs,
) -> Result<User, StoreError> {
    let base = person.username.clone();
    let mut last = None;
    for n in 1..=20 {
        if n > 1 {
            let suffix = format!("-{n}");
            let keep = base.len().min(64 - suffix.len());
            person.username = format!("{}{suffix}", &base[..keep]);
        }
        match state.db.sign_on(&person, now).await {
            Err(e @ StoreError::Conflict { .. }) => last = Some(e),
            other => return other,
        }
    }
    Err(last.unwrap_or_else(|| StoreError::Invalid("no name left".into())))
}

#[derive(Template)]
#[template(path = "pages/signed_in.html")]
struct SignedIn<'a> {
    username: &'a str,
    next: &'a str,
}

/// The session for `user`, and a page that goes on to `next`. Not a
/// redirect: a browser does not send a `SameSite=Strict` cookie (the
/// session's) along a redirect chain a cross-site navigation began (the
/// provider's), so the page navigates again, from this site.
async fn signed_in(state: &AppState, user: &User, now: UnixMs, next: &str) -> WebResult<Response> {
    let mut r = html(&SignedIn {
        username: &user.username,
        next,
    })?;
    start_session(state, user, now, &mut r).await?;
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(r)
}

/// Where the browser goes after logging out `user`: the provider's end
/// of session when `[oidc] logout_at_provider` is set and it has one (the
/// person comes back to the login page), else the login page.
pub(super) async fn after_logout(state: &AppState, user: Option<&User>) -> String {
    let config = state.config.get();
    let Some(cfg) = config.oidc.as_ref().filter(|c| c.logout_at_provider) else {
        return "/login".into();
    };
    if !user.is_some_and(|u| u.signs_on) {
        return "/login".into();
    }
    let end = match state.web.sign_on.metadata(cfg).await {
        Ok(m) => m.end_session_endpoint.clone(),
        Err(e) => {
            tracing::warn!(error = %e, "logout: the provider's session is left as it is");
            None
        }
    };
    let (Some(end), Some(back)) = (end, cfg.redirect_url(&config.server)) else {
        return "/login".into();
    };
    let (Ok(mut url), Ok(mut back)) = (reqwest::Url::parse(&end), reqwest::Url::parse(&back))
    else {
        return "/login".into();
    };
    back.set_path("/login");
    url.query_pairs_mut()
        .append_pair("client_id", &cfg.client_id)
        .append_pair("post_logout_redirect_uri", back.as_str());
    url.into()
}
