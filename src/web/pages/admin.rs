//! Admin pages: users (add, change role or pipelines, disable, reset
//! password) and API tokens (create — shown once —, list, revoke). Every change is audited;
//! user changes revoke the user's sessions in the same transaction.

use askama::Template;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use serde_json::json;

use crate::auth::password;
use crate::domain::Role;
use crate::domain::scope::Scope;
use crate::store::{NewApiToken, NewUser, UserChange};

use super::audit;
use crate::web::AppState;
use crate::web::auth::{self, Admin, Authed};
use crate::web::error::{WebError, WebResult};

use super::{Nav, html, when, when_opt};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/admin/users", get(users).post(add_user))
        .route("/admin/users/{id}/role", post(set_role))
        .route("/admin/users/{id}/pipelines", post(set_pipelines))
        .route("/admin/users/{id}/unmask", post(set_unmask))
        .route("/admin/users/{id}/disable", post(disable))
        .route("/admin/users/{id}/enable", post(enable))
        .route("/admin/users/{id}/password", post(reset_password))
        .route("/admin/tokens", get(tokens).post(create_token))
        .route("/admin/tokens/{id}/revoke", post(revoke_token))
}

const ROLES: [&str; 3] = ["viewer", "operator", "admin"];

struct UserView {
    id: i64,
    username: String,
    role: &'static str,
    disabled: bool,
    /// Its pipelines as written (empty: every pipeline).
    pipelines: String,
    /// Sees sensitive fields in clear.
    unmask: bool,
    /// Made by single sign-on.
    signs_on: bool,
}

#[derive(Template)]
#[template(path = "pages/users.html")]
struct UsersPage {
    nav: Nav,
    users: Vec<UserView>,
    roles: [&'static str; 3],
}

async fn users(caller: Authed<Admin>, State(state): State<AppState>) -> WebResult<Response> {
    let users = state.db.list_users().await?;
    html(&UsersPage {
        nav: Nav::new(&caller, "users"),
        users: users
            .iter()
            .map(|u| UserView {
                id: u.id,
                username: u.username.clone(),
                role: u.role.as_str(),
                disabled: u.disabled,
                pipelines: u.pipelines.patterns().join(", "),
                unmask: u.unmask,
                signs_on: u.signs_on,
            })
            .collect(),
        roles: ROLES,
    })
}

fn parse_role(s: &str) -> WebResult<Role> {
    s.parse::<Role>()
        .map_err(|_| WebError::bad("unknown_role", format!("unknown role `{s}`")))
}

/// A form's pipelines (names or patterns separated by commas; empty:
/// every pipeline) for `role`.
fn parse_scope(text: &str, role: Role) -> WebResult<Scope> {
    let scope = Scope::parse(text).map_err(|m| WebError::bad("bad_pipelines", m))?;
    scope
        .check_role(role)
        .map_err(|m| WebError::bad("admin_scoped", m))?;
    Ok(scope)
}

#[derive(Deserialize)]
struct AddUser {
    username: String,
    role: String,
    password: String,
    /// Names or patterns separated by commas; empty: every pipeline.
    #[serde(default)]
    pipelines: String,
    /// `on`: sees sensitive fields in clear.
    #[serde(default)]
    unmask: Option<String>,
}

async fn add_user(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Form(f): Form<AddUser>,
) -> WebResult<Response> {
    let role = parse_role(&f.role)?;
    let pipelines = parse_scope(&f.pipelines, role)?;
    password::check_policy(&f.password)
        .map_err(|e| WebError::bad("weak_password", e.to_string()))?;
    let hash = password::hash_blocking(f.password)
        .await
        .map_err(|e| WebError::Internal(e.to_string()))?;
    let user = state
        .db
        .create_user(
            &NewUser {
                username: f.username.trim().to_owned(),
                password_hash: hash,
                role,
                pipelines,
                unmask: f.unmask.as_deref() == Some("on"),
            },
            state.clock.now_ms(),
        )
        .await?;
    audit(
        &state,
        &caller.actor,
        "user_added",
        json!({
            "user": user.username, "role": role.as_str(),
            "pipelines": user.pipelines.patterns(), "unmask": user.unmask,
        }),
    )
    .await?;
    Ok(Redirect::to("/admin/users").into_response())
}

async fn change(
    state: &AppState,
    actor: &str,
    id: i64,
    change: UserChange,
    what: serde_json::Value,
) -> WebResult<Response> {
    let user = state
        .db
        .update_user(id, &change, state.clock.now_ms())
        .await?;
    let mut detail = what;
    detail["user"] = json!(user.username);
    audit(state, actor, "user_changed", detail).await?;
    Ok(Redirect::to("/admin/users").into_response())
}

#[derive(Deserialize)]
struct RoleForm {
    role: String,
}

async fn set_role(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Form(f): Form<RoleForm>,
) -> WebResult<Response> {
    let role = parse_role(&f.role)?;
    change(
        &state,
        &caller.actor,
        id,
        UserChange::Role(role),
        json!({ "role": role.as_str() }),
    )
    .await
}

#[derive(Deserialize)]
struct PipelinesForm {
    #[serde(default)]
    pipelines: String,
}

async fn set_pipelines(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Form(f): Form<PipelinesForm>,
) -> WebResult<Response> {
    let scope = Scope::parse(&f.pipelines).map_err(|m| WebError::bad("bad_pipelines", m))?;
    let what = json!({ "pipelines": scope.patterns() });
    change(
        &state,
        &caller.actor,
        id,
        UserChange::Pipelines(scope),
        what,
    )
    .await
}

#[derive(Deserialize)]
struct UnmaskForm {
    /// `on` or `off`.
    unmask: String,
}

async fn set_unmask(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Form(f): Form<UnmaskForm>,
) -> WebResult<Response> {
    let on = match f.unmask.as_str() {
        "on" => true,
        "off" => false,
        other => {
            let m = format!("`unmask` is on or off, not `{other}`");
            return Err(WebError::bad("bad_unmask", m));
        }
    };
    let what = json!({ "unmask": on });
    change(&state, &caller.actor, id, UserChange::Unmask(on), what).await
}

async fn disable(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> WebResult<Response> {
    if caller.user.as_ref().is_some_and(|u| u.id == id) {
        return Err(WebError::bad(
            "cannot_disable_self",
            "you cannot disable your own account",
        ));
    }
    change(
        &state,
        &caller.actor,
        id,
        UserChange::Disabled(true),
        json!({ "disabled": true }),
    )
    .await
}

async fn enable(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> WebResult<Response> {
    change(
        &state,
        &caller.actor,
        id,
        UserChange::Disabled(false),
        json!({ "disabled": false }),
    )
    .await
}

#[derive(Deserialize)]
struct PasswordForm {
    password: String,
}

async fn reset_password(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Form(f): Form<PasswordForm>,
) -> WebResult<Response> {
    // Refused before any hash is made (the store refuses it too).
    if let Some(u) = state.db.user_by_id(id).await?.filter(|u| u.signs_on) {
        let refusal = crate::domain::account::AccountRefusal::SignsOn(u.username);
        return Err(crate::store::StoreError::from(refusal).into());
    }
    password::check_policy(&f.password)
        .map_err(|e| WebError::bad("weak_password", e.to_string()))?;
    let hash = password::hash_blocking(f.password)
        .await
        .map_err(|e| WebError::Internal(e.to_string()))?;
    change(
        &state,
        &caller.actor,
        id,
        UserChange::Password(hash),
        json!({ "password": "reset" }),
    )
    .await
}

struct TokenView {
    id: i64,
    name: String,
    prefix: String,
    role: &'static str,
    /// The pipelines it may see, or "all".
    pipelines: String,
    /// Sees sensitive fields in clear.
    unmask: bool,
    created: String,
    created_by: String,
    last_used: String,
    /// When it expires, or "never".
    expires: String,
    /// "active", "expired" or "revoked".
    status: &'static str,
}

/// The lifetimes the tokens page offers, in days (none: never expires).
const TOKEN_DAYS: [u32; 5] = [1, 7, 30, 90, 365];

#[derive(Template)]
#[template(path = "pages/tokens.html")]
struct TokensPage {
    nav: Nav,
    tokens: Vec<TokenView>,
    roles: [&'static str; 3],
    days: [u32; 5],
    /// (name, token) right after creation: the only time it is shown.
    created: Option<(String, String)>,
}

async fn tokens_page(
    state: &AppState,
    caller: &Authed<Admin>,
    created: Option<(String, String)>,
) -> WebResult<Response> {
    let tokens = state.db.list_api_tokens().await?;
    let now = state.clock.now_ms();
    html(&TokensPage {
        nav: Nav::new(caller, "tokens"),
        tokens: tokens
            .iter()
            .map(|t| TokenView {
                id: t.id,
                name: t.name.clone(),
                prefix: t.prefix.clone(),
                role: t.role.as_str(),
                pipelines: t.pipelines.to_string(),
                unmask: t.unmask,
                created: when(t.created_at),
                created_by: t.created_by.clone(),
                last_used: when_opt(t.last_used_at),
                expires: t.expires_at.map_or_else(|| "never".to_owned(), when),
                status: if t.revoked_at.is_some() {
                    "revoked"
                } else if t.is_expired(now) {
                    "expired"
                } else {
                    "active"
                },
            })
            .collect(),
        roles: ROLES,
        days: TOKEN_DAYS,
        created,
    })
}

async fn tokens(caller: Authed<Admin>, State(state): State<AppState>) -> WebResult<Response> {
    tokens_page(&state, &caller, None).await
}

#[derive(Deserialize)]
struct TokenForm {
    name: String,
    role: String,
    /// Days until it expires; empty or absent: never.
    #[serde(default)]
    expires_in_days: String,
    /// Names or patterns separated by commas; empty: every pipeline.
    #[serde(default)]
    pipelines: String,
    /// `on`: sees sensitive fields in clear.
    #[serde(default)]
    unmask: Option<String>,
}

/// When a token made at `now` to last `days` (a form's text) expires.
fn token_expiry(days: &str, now: crate::domain::UnixMs) -> WebResult<Option<i64>> {
    let days = days.trim();
    if days.is_empty() || days == "never" {
        return Ok(None);
    }
    match days.parse::<i64>() {
        Ok(d @ 1..=3650) => Ok(Some(now.saturating_add(d * 86_400_000))),
        _ => Err(WebError::bad(
            "bad_token_expiry",
            format!("a token lasts 1 to 3650 days, or never; not `{days}`"),
        )),
    }
}

async fn create_token(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Form(f): Form<TokenForm>,
) -> WebResult<Response> {
    let role = parse_role(&f.role)?;
    let pipelines = parse_scope(&f.pipelines, role)?;
    let now = state.clock.now_ms();
    let expires_at = token_expiry(&f.expires_in_days, now)?;
    let (token, hash, prefix) =
        auth::new_api_token().map_err(|e| WebError::Internal(e.to_string()))?;
    let name = f.name.trim().to_owned();
    state
        .db
        .create_api_token(
            &NewApiToken {
                name: name.clone(),
                token_hash: hash,
                prefix,
                role,
                created_by: caller.actor.clone(),
                expires_at,
                pipelines,
                unmask: f.unmask.as_deref() == Some("on"),
            },
            now,
        )
        .await?;
    let mut r = tokens_page(&state, &caller, Some((name, token))).await?;
    *r.status_mut() = axum::http::StatusCode::CREATED;
    Ok(r)
}

async fn revoke_token(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> WebResult<Response> {
    state
        .db
        .revoke_api_token(id, &caller.actor, state.clock.now_ms())
        .await?;
    Ok(Redirect::to("/admin/tokens").into_response())
}
