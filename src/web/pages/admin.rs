//! Admin pages: users (add, change role or pipelines, disable, reset
//! password) and API tokens (create — shown once —, list, revoke), each
//! change made by `web::people` as the API makes it.

use askama::Template;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use serde_json::json;

use crate::domain::scope::Scope;
use crate::store::UserChange;

use crate::web::AppState;
use crate::web::auth::{Admin, Authed};
use crate::web::error::{WebError, WebResult};
use crate::web::people;

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
    let spec = people::UserSpec {
        username: f.username,
        password: f.password,
        role: f.role,
        pipelines: f.pipelines,
        unmask: f.unmask.as_deref() == Some("on"),
    };
    people::add_user(&state, &caller.actor, spec).await?;
    Ok(Redirect::to("/admin/users").into_response())
}

async fn change(
    state: &AppState,
    actor: &str,
    id: i64,
    change: UserChange,
    what: serde_json::Value,
) -> WebResult<Response> {
    people::change_user(state, actor, id, change, what).await?;
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
    let role = people::parse_role(&f.role)?;
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
    people::set_password(&state, &caller.actor, id, f.password).await?;
    Ok(Redirect::to("/admin/users").into_response())
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

async fn create_token(
    caller: Authed<Admin>,
    State(state): State<AppState>,
    Form(f): Form<TokenForm>,
) -> WebResult<Response> {
    let spec = people::TokenSpec {
        name: f.name,
        role: f.role,
        expires_in_days: f.expires_in_days,
        pipelines: f.pipelines,
        unmask: f.unmask.as_deref() == Some("on"),
    };
    let (secret, token) = people::create_token(&state, &caller, spec).await?;
    let mut r = tokens_page(&state, &caller, Some((token.name, secret))).await?;
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
