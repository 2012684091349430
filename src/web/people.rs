//! Users and API tokens changed as an admin asks, for the admin pages and
//! the API alike: checked (role, pipelines, password policy, expiry),
//! stored, audited. A user change revokes the user's sessions in the same
//! transaction (the store's); a token is shown once, at creation.

use serde_json::json;

use crate::auth::password;
use crate::domain::account::{AccountRefusal, UserChange};
use crate::domain::scope::Scope;
use crate::domain::{ApiToken, Role, UnixMs, User};
use crate::store::{NewApiToken, NewUser, StoreError};
use crate::web::AppState;
use crate::web::auth::Caller;
use crate::web::error::{WebError, WebResult};

/// Writes an audit entry about no record: `kind` by `actor`, now.
pub async fn audit(
    state: &AppState,
    actor: &str,
    kind: &str,
    detail: serde_json::Value,
) -> WebResult<()> {
    state
        .db
        .append_event(&crate::store::NewEvent {
            record_id: None,
            at: state.clock.now_ms(),
            kind: kind.to_owned(),
            actor: actor.to_owned(),
            audit: true,
            step: None,
            reason: None,
            detail: Some(detail),
        })
        .await?;
    Ok(())
}

pub fn parse_role(s: &str) -> WebResult<Role> {
    s.parse::<Role>()
        .map_err(|_| WebError::bad("unknown_role", format!("unknown role `{s}`")))
}

/// Pipelines (names or patterns separated by commas; empty: every
/// pipeline) for `role` (an admin sees every one).
pub fn parse_scope(text: &str, role: Role) -> WebResult<Scope> {
    let scope = Scope::parse(text).map_err(|m| WebError::bad("bad_pipelines", m))?;
    scope
        .check_role(role)
        .map_err(|m| WebError::bad("admin_scoped", m))?;
    Ok(scope)
}

/// A user to add, as a form or the API says it.
pub struct UserSpec {
    pub username: String,
    pub password: String,
    pub role: String,
    /// Names or patterns separated by commas; empty: every pipeline.
    pub pipelines: String,
    pub unmask: bool,
}

/// Adds a user (its password within the policy), audited.
pub async fn add_user(state: &AppState, actor: &str, spec: UserSpec) -> WebResult<User> {
    let role = parse_role(&spec.role)?;
    let pipelines = parse_scope(&spec.pipelines, role)?;
    let hash = policy_hash(spec.password).await?;
    let user = state
        .db
        .create_user(
            &NewUser {
                username: spec.username.trim().to_owned(),
                password_hash: hash,
                role,
                pipelines,
                unmask: spec.unmask,
            },
            state.clock.now_ms(),
        )
        .await?;
    let detail = json!({
        "user": user.username, "role": role.as_str(),
        "pipelines": user.pipelines.patterns(), "unmask": user.unmask,
    });
    audit(state, actor, "user_added", detail).await?;
    Ok(user)
}

/// A password within the policy, hashed off the runtime.
async fn policy_hash(password: String) -> WebResult<String> {
    password::check_policy(&password).map_err(|e| WebError::bad("weak_password", e.to_string()))?;
    password::hash_blocking(password)
        .await
        .map_err(|e| WebError::Internal(e.to_string()))
}

/// Changes user `id` (the store keeps the last enabled admin one),
/// audited as `what`.
pub async fn change_user(
    state: &AppState,
    actor: &str,
    id: i64,
    change: UserChange,
    what: serde_json::Value,
) -> WebResult<User> {
    let user = state
        .db
        .update_user(id, &change, state.clock.now_ms())
        .await?;
    let mut detail = what;
    detail["user"] = json!(user.username);
    audit(state, actor, "user_changed", detail).await?;
    Ok(user)
}

/// Sets user `id`'s password (not a user who signs on: its provider
/// vouches for it), audited without it.
pub async fn set_password(
    state: &AppState,
    actor: &str,
    id: i64,
    password: String,
) -> WebResult<User> {
    // Refused before any hash is made (the store refuses it too).
    if let Some(u) = state.db.user_by_id(id).await?.filter(|u| u.signs_on) {
        return Err(StoreError::from(AccountRefusal::SignsOn(u.username)).into());
    }
    let hash = policy_hash(password).await?;
    let what = json!({ "password": "reset" });
    change_user(state, actor, id, UserChange::Password(hash), what).await
}

/// A token to create, as a form or the API says it.
pub struct TokenSpec {
    pub name: String,
    pub role: String,
    /// Days until it expires (1 to 3650); empty or `never`: never.
    pub expires_in_days: String,
    /// Names or patterns separated by commas; empty: every pipeline.
    pub pipelines: String,
    pub unmask: bool,
}

/// When a token made at `now` to last `days` expires.
fn token_expiry(days: &str, now: UnixMs) -> WebResult<Option<i64>> {
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

/// Creates a token (audited by the store) for `caller`'s owner: its
/// secret, shown this once, and the token as lists show it.
pub async fn create_token(
    state: &AppState,
    caller: &Caller,
    spec: TokenSpec,
) -> WebResult<(String, ApiToken)> {
    let role = parse_role(&spec.role)?;
    let pipelines = parse_scope(&spec.pipelines, role)?;
    let now = state.clock.now_ms();
    let expires_at = token_expiry(&spec.expires_in_days, now)?;
    let (secret, hash, prefix) =
        crate::web::auth::new_api_token().map_err(|e| WebError::Internal(e.to_string()))?;
    let token = state
        .db
        .create_api_token(
            &NewApiToken {
                name: spec.name.trim().to_owned(),
                token_hash: hash,
                prefix,
                role,
                created_by: caller.owner.clone(),
                actor: caller.actor.clone(),
                expires_at,
                pipelines,
                unmask: spec.unmask,
            },
            now,
        )
        .await?;
    Ok((secret, token))
}
