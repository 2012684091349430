//! `/api/v1/users` and `/api/v1/tokens` changed as the admin pages change
//! them (`web::people`): add a user, change its role, pipelines, unmask or
//! password, disable and enable it; create a token (its secret answered
//! once) and revoke one. Admins; every change audited.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{ApiJson, ApiPath};
use crate::domain::{ApiToken, User};
use crate::store::UserChange;
use crate::web::AppState;
use crate::web::auth::{Admin, Bearer};
use crate::web::error::WebResult;
use crate::web::people;

/// A list of pipelines as `web::people` reads them (comma-separated),
/// each a name or pattern: a blank one (which would read as "every
/// pipeline") or one with a comma in it is refused, not widened.
fn pipelines(list: Vec<String>) -> WebResult<String> {
    if let Some(bad) = list.iter().find(|p| p.trim().is_empty() || p.contains(',')) {
        return Err(crate::web::error::WebError::bad(
            "bad_pipelines",
            format!("{bad:?} is not a pipeline name or pattern"),
        ));
    }
    Ok(list.join(","))
}

pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(add_user))
        .routes(routes!(set_role))
        .routes(routes!(set_pipelines))
        .routes(routes!(set_unmask))
        .routes(routes!(set_password))
        .routes(routes!(disable))
        .routes(routes!(enable))
        .routes(routes!(create_token))
        .routes(routes!(revoke_token))
}

/// A user to add.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewUserBody {
    username: String,
    /// Within the password policy (12 characters or more, not a common
    /// one).
    #[schema(min_length = 12)]
    password: String,
    #[schema(value_type = crate::domain::Role)]
    role: String,
    /// The pipelines it may see, by name or pattern (none: every one).
    #[serde(default)]
    pipelines: Vec<String>,
    /// Sees sensitive fields in clear.
    #[serde(default)]
    unmask: bool,
}

/// Add a user.
///
/// Audited as `user_added`. Admins.
#[utoipa::path(
    post,
    path = "/users",
    tag = "admin",
    operation_id = "add_user",
    request_body = NewUserBody,
    responses((status = 201, description = "The user added", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn add_user(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiJson(b): ApiJson<NewUserBody>,
) -> WebResult<(StatusCode, Json<User>)> {
    let spec = people::UserSpec {
        username: b.username,
        password: b.password,
        role: b.role,
        pipelines: pipelines(b.pipelines)?,
        unmask: b.unmask,
    };
    let user = people::add_user(&state, &caller.actor, spec).await?;
    Ok((StatusCode::CREATED, Json(user)))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct RoleBody {
    #[schema(value_type = crate::domain::Role)]
    role: String,
}

/// Change a user's role.
///
/// Its sessions end and the tokens it made are revoked; the last enabled
/// admin stays one. Audited. Admins.
#[utoipa::path(
    post,
    path = "/users/{id}/role",
    tag = "admin",
    operation_id = "set_user_role",
    params(("id" = i64, Path, description = "The user's id")),
    request_body = RoleBody,
    responses((status = 200, description = "The user changed", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn set_role(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
    ApiJson(b): ApiJson<RoleBody>,
) -> WebResult<Json<User>> {
    let role = people::parse_role(&b.role)?;
    let what = json!({ "role": role.as_str() });
    let user = people::change_user(&state, &caller.actor, id, UserChange::Role(role), what);
    Ok(Json(user.await?))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct PipelinesBody {
    /// Names or patterns (none: every pipeline).
    pipelines: Vec<String>,
}

/// Limit a user to pipelines.
///
/// Its sessions end (its tokens keep their own pipelines). Audited.
/// Admins.
#[utoipa::path(
    post,
    path = "/users/{id}/pipelines",
    tag = "admin",
    operation_id = "set_user_pipelines",
    params(("id" = i64, Path, description = "The user's id")),
    request_body = PipelinesBody,
    responses((status = 200, description = "The user changed", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn set_pipelines(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
    ApiJson(b): ApiJson<PipelinesBody>,
) -> WebResult<Json<User>> {
    let scope = crate::domain::scope::Scope::parse(&pipelines(b.pipelines)?)
        .map_err(|m| crate::web::error::WebError::bad("bad_pipelines", m))?;
    let what = json!({ "pipelines": scope.patterns() });
    let change = UserChange::Pipelines(scope);
    Ok(Json(
        people::change_user(&state, &caller.actor, id, change, what).await?,
    ))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct UnmaskBody {
    /// Sees sensitive fields in clear.
    unmask: bool,
}

/// Let a user see sensitive fields, or not.
///
/// Its sessions end. Audited. Admins.
#[utoipa::path(
    post,
    path = "/users/{id}/unmask",
    tag = "admin",
    operation_id = "set_user_unmask",
    params(("id" = i64, Path, description = "The user's id")),
    request_body = UnmaskBody,
    responses((status = 200, description = "The user changed", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn set_unmask(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
    ApiJson(b): ApiJson<UnmaskBody>,
) -> WebResult<Json<User>> {
    let what = json!({ "unmask": b.unmask });
    let change = UserChange::Unmask(b.unmask);
    Ok(Json(
        people::change_user(&state, &caller.actor, id, change, what).await?,
    ))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct PasswordBody {
    /// Within the password policy (12 characters or more, not a common
    /// one).
    #[schema(min_length = 12)]
    password: String,
}

/// Set a user's password.
///
/// Not for a user who signs on through an OpenID provider. Its sessions
/// end. Audited (without the password). Admins.
#[utoipa::path(
    post,
    path = "/users/{id}/password",
    tag = "admin",
    operation_id = "set_user_password",
    params(("id" = i64, Path, description = "The user's id")),
    request_body = PasswordBody,
    responses((status = 200, description = "The user changed", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn set_password(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
    ApiJson(b): ApiJson<PasswordBody>,
) -> WebResult<Json<User>> {
    Ok(Json(
        people::set_password(&state, &caller.actor, id, b.password).await?,
    ))
}

/// Disable a user.
///
/// Its sessions end and the tokens it made are revoked; the last enabled
/// admin stays one. Audited. Admins.
#[utoipa::path(
    post,
    path = "/users/{id}/disable",
    tag = "admin",
    operation_id = "disable_user",
    params(("id" = i64, Path, description = "The user's id")),
    responses((status = 200, description = "The user disabled", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn disable(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
) -> WebResult<Json<User>> {
    let what = json!({ "disabled": true });
    let change = UserChange::Disabled(true);
    Ok(Json(
        people::change_user(&state, &caller.actor, id, change, what).await?,
    ))
}

/// Enable a user.
///
/// Audited. Admins.
#[utoipa::path(
    post,
    path = "/users/{id}/enable",
    tag = "admin",
    operation_id = "enable_user",
    params(("id" = i64, Path, description = "The user's id")),
    responses((status = 200, description = "The user enabled", body = User)),
    security(("bearer" = ["admin"]))
)]
async fn enable(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
) -> WebResult<Json<User>> {
    let what = json!({ "disabled": false });
    let change = UserChange::Disabled(false);
    Ok(Json(
        people::change_user(&state, &caller.actor, id, change, what).await?,
    ))
}

/// An API token to create.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewTokenBody {
    name: String,
    #[schema(value_type = crate::domain::Role)]
    role: String,
    /// Days until it expires (none: never).
    #[schema(minimum = 1, maximum = 3650)]
    expires_in_days: Option<u32>,
    /// The pipelines it may see, by name or pattern (none: every one).
    #[serde(default)]
    pipelines: Vec<String>,
    /// Sees sensitive fields in clear.
    #[serde(default)]
    unmask: bool,
}

/// A token made: its secret, answered this once.
#[derive(Serialize, ToSchema)]
struct CreatedToken {
    /// The bearer token itself; only its hash is kept.
    token: String,
    item: ApiToken,
}

/// Create an API token.
///
/// Its secret is in this answer only. It belongs to the user the calling
/// token belongs to (a change to that user revokes both). Audited. Admins.
#[utoipa::path(
    post,
    path = "/tokens",
    tag = "admin",
    operation_id = "create_token",
    request_body = NewTokenBody,
    responses((status = 201, description = "The token, with its secret", body = CreatedToken)),
    security(("bearer" = ["admin"]))
)]
async fn create_token(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiJson(b): ApiJson<NewTokenBody>,
) -> WebResult<(StatusCode, Json<CreatedToken>)> {
    let spec = people::TokenSpec {
        name: b.name,
        role: b.role,
        expires_in_days: b.expires_in_days.map(|d| d.to_string()).unwrap_or_default(),
        pipelines: pipelines(b.pipelines)?,
        unmask: b.unmask,
    };
    let (token, item) = people::create_token(&state, &caller, spec).await?;
    Ok((StatusCode::CREATED, Json(CreatedToken { token, item })))
}

/// Revoke an API token.
///
/// It stops working at once. Audited. Admins.
#[utoipa::path(
    post,
    path = "/tokens/{id}/revoke",
    tag = "admin",
    operation_id = "revoke_token",
    params(("id" = i64, Path, description = "The token's id")),
    responses((status = 200, description = "The token, revoked", body = ApiToken)),
    security(("bearer" = ["admin"]))
)]
async fn revoke_token(
    caller: Bearer<Admin>,
    State(state): State<AppState>,
    ApiPath(id): ApiPath<i64>,
) -> WebResult<Json<ApiToken>> {
    let now = state.clock.now_ms();
    Ok(Json(
        state.db.revoke_api_token(id, &caller.actor, now).await?,
    ))
}
