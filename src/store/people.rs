//! The people who use the control plane: users, sessions, API tokens and
//! the login throttle.

use serde_json::Value;
use sqlx::types::Json;
use sqlx::{ColumnIndex, Decode, Encode, Executor, Type};

use super::NewApiToken;
use super::backend::{RowsAffected, SqlDb};
use super::rows::{API_TOKEN_COLUMNS, MapRow, USER_COLUMNS, map_all};
use super::sql::{SqlStore, conflict_or};
use super::{EventRow, NewUser, PendingSignOn, SignOnUser, StoreError, StoreResult, UserChange};
use crate::domain::ApiToken;
use crate::domain::login::LoginFailures;
use crate::domain::{Session, UnixMs, User};

/// People: users, sessions, API tokens and the login throttle.
#[async_trait::async_trait]
pub trait People: Send + Sync {
    async fn create_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<User>;
    /// Creates `user` only while there is no user at all, atomically with
    /// that check (start-up's first admin: a `user add` at the same moment
    /// waits, or comes first and this creates nothing): the user, or `None`.
    async fn create_first_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<Option<User>>;
    async fn user_by_name(&self, username: &str) -> StoreResult<Option<User>>;
    async fn user_by_id(&self, id: i64) -> StoreResult<Option<User>>;
    async fn list_users(&self) -> StoreResult<Vec<User>>;
    /// Changes a user and revokes all their sessions (and, for a role change
    /// or disabling, the API tokens they created), in one transaction, so
    /// the change takes effect on the next request.
    async fn update_user(&self, id: i64, change: &UserChange, now: UnixMs) -> StoreResult<User>;
    /// Sets the dashboard colour scheme user `id` chose (`light`, `dark`;
    /// `None`: the system's). Sessions stay: it is a preference.
    async fn set_theme(&self, id: i64, theme: Option<&str>) -> StoreResult<()>;
    async fn create_session(&self, session: &Session) -> StoreResult<()>;
    async fn session(&self, id: &str) -> StoreResult<Option<Session>>;
    /// Notes a use of session `id` at `now` (never moving it back).
    async fn touch_session(&self, id: &str, now: UnixMs) -> StoreResult<()>;
    async fn revoke_session(&self, id: &str, now: UnixMs) -> StoreResult<()>;
    /// Deletes sessions that expired before `before`; returns how many.
    async fn purge_sessions(&self, before: UnixMs) -> StoreResult<u64>;
    /// Stores a token and its audit event (`token_created`) in one transaction.
    async fn create_api_token(&self, token: &NewApiToken, now: UnixMs) -> StoreResult<ApiToken>;
    /// A token that is not revoked, by the hash of its secret.
    async fn api_token_by_hash(&self, hash: &str) -> StoreResult<Option<ApiToken>>;
    async fn list_api_tokens(&self) -> StoreResult<Vec<ApiToken>>;
    /// Revokes a token with its audit event (`token_revoked`).
    async fn revoke_api_token(&self, id: i64, actor: &str, now: UnixMs) -> StoreResult<ApiToken>;
    /// Notes a use; writes at most once a minute per token.
    async fn touch_api_token(&self, id: i64, now: UnixMs) -> StoreResult<()>;
    /// The failed logins counted on `username`, if any.
    async fn login_failures(&self, username: &str) -> StoreResult<Option<LoginFailures>>;
    /// Counts a failed login on `username` in one statement, so that
    /// failures on several nodes at once all count; a count whose latest
    /// failure is older than `forget_before` starts again at one. Returns
    /// the count with this failure.
    async fn count_login_failure(
        &self,
        username: &str,
        now: UnixMs,
        forget_before: UnixMs,
    ) -> StoreResult<LoginFailures>;
    /// Counts the check about to be made on `username` as a failure in
    /// advance, at `now`, if its count is still `seen` (compare and set,
    /// one statement): true when this caller took it, false when another
    /// check took it first (on any node).
    async fn claim_login_check(
        &self,
        username: &str,
        seen: LoginFailures,
        now: UnixMs,
    ) -> StoreResult<bool>;
    /// Forgets the failures of `username` (it logged in).
    async fn login_succeeded(&self, username: &str) -> StoreResult<()>;
    /// Keeps a sign-in under way at an OpenID provider, and forgets those
    /// begun before `forget_before` (never finished).
    async fn begin_sign_on(
        &self,
        pending: &PendingSignOn,
        forget_before: UnixMs,
    ) -> StoreResult<()>;
    /// Takes the sign-in whose state hashes to `state_key`: it is gone
    /// after, so a second answer with the same state finds nothing.
    async fn take_sign_on(&self, state_key: &str) -> StoreResult<Option<PendingSignOn>>;
    /// The user `person` is, in one transaction: created on their first
    /// sign-in (`user_added`, by `sign-on`), or given what their groups
    /// grant now if that changed (`user_changed`; their sessions revoked,
    /// and their tokens too if the role changed; refused, `LastAdmin`,
    /// when that would leave no enabled admin). A disabled user is
    /// returned as it is. A name another user has is a `Conflict`.
    async fn sign_on(&self, person: &SignOnUser, now: UnixMs) -> StoreResult<User>;
    /// Takes every access from the user `issuer` and `subject` name (their
    /// groups grant nothing now): a viewer of no pipeline, their sessions
    /// ended and, if they were more than a viewer, the API tokens they
    /// made revoked (`user_changed`); refused, `LastAdmin`, for the last
    /// enabled admin. The user, if any.
    async fn revoke_signed_on(
        &self,
        issuer: &str,
        subject: &str,
        now: UnixMs,
    ) -> StoreResult<Option<User>>;
}

#[async_trait::async_trait]
impl<DB> People for SqlStore<DB>
where
    DB: SqlDb,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    usize: ColumnIndex<DB::Row>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB>,
    for<'q> i32: Decode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> Json<Value>: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Option<Json<Value>>: Encode<'q, DB>,
{
    async fn create_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<User> {
        self.insert_user(user, now, false)
            .await?
            .ok_or_else(|| StoreError::Invalid("the user was not created".into()))
    }

    async fn create_first_user(&self, user: &NewUser, now: UnixMs) -> StoreResult<Option<User>> {
        self.insert_user(user, now, true).await
    }

    async fn user_by_name(&self, username: &str) -> StoreResult<Option<User>> {
        let sql = format!("SELECT {USER_COLUMNS} FROM users WHERE username = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(username.to_owned())
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::user).transpose()
    }

    async fn user_by_id(&self, id: i64) -> StoreResult<Option<User>> {
        let sql = format!("SELECT {USER_COLUMNS} FROM users WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::user).transpose()
    }

    async fn list_users(&self) -> StoreResult<Vec<User>> {
        let sql = format!("SELECT {USER_COLUMNS} FROM users ORDER BY username");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::user)
    }

    async fn update_user(&self, id: i64, change: &UserChange, now: UnixMs) -> StoreResult<User> {
        let mut tx = self.begin_write().await?;
        Self::check_user_change(&mut tx, id, change).await?;
        let set = match change {
            UserChange::Password(_) => "password_hash",
            UserChange::Role(_) => "role",
            UserChange::Disabled(_) => "disabled",
            UserChange::Pipelines(_) => "pipelines",
            UserChange::Unmask(_) => "unmask",
        };
        let sql = format!(
            "UPDATE users SET {set} = $1, updated_at = $2 WHERE id = $3 RETURNING {USER_COLUMNS}"
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(sql));
        let query = match change {
            UserChange::Password(hash) => query.bind(hash.clone()),
            UserChange::Role(role) => query.bind(role.as_str()),
            UserChange::Disabled(disabled) => query.bind(*disabled),
            UserChange::Pipelines(scope) => query.bind(scope.stored()),
            UserChange::Unmask(unmask) => query.bind(*unmask),
        };
        let row = query
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "user",
                key: id.to_string(),
            })?;
        let user = row.user()?;
        sqlx::query(
            "UPDATE sessions SET revoked_at = $1 WHERE user_id = $2 AND revoked_at IS NULL",
        )
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        // Tokens a user made carry at most the access they had: a
        // user disabled or given another role loses them too. (Tokens
        // carry their own pipelines, and only admins, who see every
        // pipeline, make them.)
        if matches!(change, UserChange::Role(_) | UserChange::Disabled(true)) {
            sqlx::query("UPDATE api_tokens SET revoked_at = $1 WHERE created_by = $2 AND revoked_at IS NULL")
                .bind(now)
                .bind(user.username.clone())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(user)
    }

    async fn set_theme(&self, id: i64, theme: Option<&str>) -> StoreResult<()> {
        if theme.is_some_and(|t| t != "light" && t != "dark") {
            return Err(StoreError::Invalid(
                "a theme is `light` or `dark` (none: the system's)".into(),
            ));
        }
        let mut tx = self.begin_write().await?;
        let done = sqlx::query("UPDATE users SET theme = $1 WHERE id = $2")
            .bind(theme.map(str::to_owned))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() != 1 {
            return Err(StoreError::NotFound {
                what: "user",
                key: id.to_string(),
            });
        }
        tx.commit().await?;
        Ok(())
    }

    async fn create_session(&self, s: &Session) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("INSERT INTO sessions (id, user_id, created_at, expires_at, revoked_at, last_seen_at) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(s.id.clone())
            .bind(s.user_id)
            .bind(s.created_at)
            .bind(s.expires_at)
            .bind(s.revoked_at)
            .bind(s.last_seen_at)
            .execute(&mut *tx)
            .await
            .map_err(|e| conflict_or(e, "session", &s.id))?;
        tx.commit().await?;
        Ok(())
    }

    async fn session(&self, id: &str) -> StoreResult<Option<Session>> {
        let row = sqlx::query(
            "SELECT id, user_id, created_at, expires_at, revoked_at, last_seen_at FROM sessions WHERE id = $1",
        )
        .bind(id.to_owned())
        .fetch_optional(self.reader())
        .await?;
        row.as_ref().map(MapRow::session).transpose()
    }

    async fn touch_session(&self, id: &str, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE sessions SET last_seen_at = $1 WHERE id = $2 AND last_seen_at < $1")
            .bind(now)
            .bind(id.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn revoke_session(&self, id: &str, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE sessions SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2")
            .bind(now)
            .bind(id.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn purge_sessions(&self, before: UnixMs) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query("DELETE FROM sessions WHERE expires_at < $1")
            .bind(before)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn create_api_token(
        &self,
        t: &crate::store::NewApiToken,
        now: UnixMs,
    ) -> StoreResult<crate::domain::ApiToken> {
        if t.name.trim().is_empty() || t.name.len() > 100 {
            return Err(StoreError::Invalid(
                "a token needs a name of 1-100 characters".into(),
            ));
        }
        crate::store::refuse_nul("token name", Some(&t.name))?;
        if let Err(m) = t.pipelines.check_role(t.role) {
            return Err(StoreError::Invalid(m));
        }
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "INSERT INTO api_tokens (name, token_hash, prefix, role, created_by, created_at, expires_at, pipelines, unmask) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {API_TOKEN_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(t.name.clone())
            .bind(t.token_hash.clone())
            .bind(t.prefix.clone())
            .bind(t.role.as_str())
            .bind(t.created_by.clone())
            .bind(now)
            .bind(t.expires_at)
            .bind(t.pipelines.stored())
            .bind(t.unmask)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| conflict_or(e, "api token", &t.prefix))?;
        let token = row.api_token()?;
        let detail = serde_json::json!({
            "token_id": token.id, "name": token.name, "role": token.role.as_str(),
            "expires_at": token.expires_at, "pipelines": token.pipelines.patterns(),
            "unmask": token.unmask,
        });
        let event = EventRow::audit("token_created", &t.actor, now, &detail);
        self.insert_event(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(token)
    }

    async fn api_token_by_hash(&self, hash: &str) -> StoreResult<Option<crate::domain::ApiToken>> {
        let sql = format!(
            "SELECT {API_TOKEN_COLUMNS} FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(hash.to_owned())
            .fetch_optional(self.reader())
            .await?;
        row.as_ref().map(MapRow::api_token).transpose()
    }

    async fn list_api_tokens(&self) -> StoreResult<Vec<crate::domain::ApiToken>> {
        let sql = format!("SELECT {API_TOKEN_COLUMNS} FROM api_tokens ORDER BY id DESC");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.reader())
            .await?;
        map_all(&rows, MapRow::api_token)
    }

    async fn revoke_api_token(
        &self,
        id: i64,
        actor: &str,
        now: UnixMs,
    ) -> StoreResult<crate::domain::ApiToken> {
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $1) WHERE id = $2 RETURNING {API_TOKEN_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                what: "api token",
                key: id.to_string(),
            })?;
        let token = row.api_token()?;
        let detail = serde_json::json!({ "token_id": token.id, "name": token.name });
        let event = EventRow::audit("token_revoked", actor, now, &detail);
        self.insert_event(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(token)
    }

    async fn touch_api_token(&self, id: i64, now: UnixMs) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE api_tokens SET last_used_at = $1 WHERE id = $2 AND (last_used_at IS NULL OR last_used_at < $3)")
            .bind(now)
            .bind(id)
            .bind(now - 60_000)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn login_failures(&self, username: &str) -> StoreResult<Option<LoginFailures>> {
        let row: Option<(i64, i64)> = sqlx::query_as(
            "SELECT failures, last_failure_at FROM login_throttle WHERE username = $1",
        )
        .bind(username.to_owned())
        .fetch_optional(self.reader())
        .await?;
        Ok(row.map(|(failures, last_failure_at)| LoginFailures {
            failures,
            last_failure_at,
        }))
    }

    async fn count_login_failure(
        &self,
        username: &str,
        now: UnixMs,
        forget_before: UnixMs,
    ) -> StoreResult<LoginFailures> {
        let mut tx = self.begin_write().await?;
        // One statement, so concurrent failures on several nodes all count.
        let (failures, last_failure_at): (i64, i64) = sqlx::query_as(
            "INSERT INTO login_throttle (username, failures, last_failure_at) VALUES ($1, 1, $2) \
             ON CONFLICT (username) DO UPDATE SET \
               failures = CASE WHEN login_throttle.last_failure_at < $3 THEN 1 \
                 ELSE login_throttle.failures + 1 END, \
               last_failure_at = $2 \
             RETURNING failures, last_failure_at",
        )
        .bind(username.to_owned())
        .bind(now)
        .bind(forget_before)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(LoginFailures {
            failures,
            last_failure_at,
        })
    }

    async fn claim_login_check(
        &self,
        username: &str,
        seen: LoginFailures,
        now: UnixMs,
    ) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let taken = sqlx::query(
            "UPDATE login_throttle SET failures = failures + 1, last_failure_at = $4 \
             WHERE username = $1 AND failures = $2 AND last_failure_at = $3",
        )
        .bind(username.to_owned())
        .bind(seen.failures)
        .bind(seen.last_failure_at)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(taken.rows_affected() == 1)
    }

    async fn begin_sign_on(
        &self,
        pending: &PendingSignOn,
        forget_before: UnixMs,
    ) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM sign_ons WHERE created_at < $1")
            .bind(forget_before)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO sign_ons (state_key, nonce, verifier, next, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(pending.state_key.clone())
        .bind(pending.nonce.clone())
        .bind(pending.verifier.clone())
        .bind(pending.next.clone())
        .bind(pending.created_at)
        .execute(&mut *tx)
        .await
        .map_err(|e| conflict_or(e, "sign-in", "state"))?;
        tx.commit().await?;
        Ok(())
    }

    async fn take_sign_on(&self, state_key: &str) -> StoreResult<Option<PendingSignOn>> {
        let mut tx = self.begin_write().await?;
        let row = sqlx::query(
            "DELETE FROM sign_ons WHERE state_key = $1 \
             RETURNING state_key, nonce, verifier, next, created_at",
        )
        .bind(state_key.to_owned())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        let Some(row) = row else {
            return Ok(None);
        };
        use sqlx::Row;
        Ok(Some(PendingSignOn {
            state_key: row.try_get(0)?,
            nonce: row.try_get(1)?,
            verifier: row.try_get(2)?,
            next: row.try_get(3)?,
            created_at: row.try_get(4)?,
        }))
    }

    async fn sign_on(&self, person: &SignOnUser, now: UnixMs) -> StoreResult<User> {
        if let Err(m) = person.pipelines.check_role(person.role) {
            return Err(StoreError::Invalid(m));
        }
        let mut tx = self.begin_write().await?;
        // Not locked here: a change locks the admins, then the user
        // (`regrant`), in the order every user change takes.
        let sql = format!(
            "SELECT {USER_COLUMNS} FROM users WHERE oidc_issuer = $1 AND oidc_subject = $2"
        );
        let found = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(person.issuer.clone())
            .bind(person.subject.clone())
            .fetch_optional(&mut *tx)
            .await?;
        let found = found.as_ref().map(MapRow::user).transpose()?;
        let (user, kind) = match found {
            None => (
                Self::insert_signed_on(&mut tx, person, now).await?,
                "user_added",
            ),
            Some(u) if u.disabled => return Ok(u),
            Some(u)
                if (u.role, &u.pipelines, u.unmask)
                    == (person.role, &person.pipelines, person.unmask) =>
            {
                return Ok(u);
            }
            Some(u) => (
                Self::regrant(&mut tx, &u, person, now).await?,
                "user_changed",
            ),
        };
        let detail = serde_json::json!({
            "user": user.username, "role": user.role.as_str(),
            "pipelines": user.pipelines.patterns(), "unmask": user.unmask,
            "issuer": person.issuer, "subject": person.subject,
        });
        let event = EventRow::audit(kind, "sign-on", now, &detail);
        self.insert_event(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(user)
    }

    async fn revoke_signed_on(
        &self,
        issuer: &str,
        subject: &str,
        now: UnixMs,
    ) -> StoreResult<Option<User>> {
        let mut tx = self.begin_write().await?;
        let sql = format!(
            "SELECT {USER_COLUMNS} FROM users WHERE oidc_issuer = $1 AND oidc_subject = $2"
        );
        let found = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(issuer.to_owned())
            .bind(subject.to_owned())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(user) = found.as_ref().map(MapRow::user).transpose()? else {
            return Ok(None);
        };
        let nothing = SignOnUser {
            issuer: issuer.to_owned(),
            subject: subject.to_owned(),
            username: user.username.clone(),
            role: crate::domain::Role::Viewer,
            pipelines: crate::domain::scope::Scope::none(),
            unmask: false,
        };
        if (user.role, &user.pipelines, user.unmask) == (nothing.role, &nothing.pipelines, false) {
            return Ok(Some(user));
        }
        let user = Self::regrant(&mut tx, &user, &nothing, now).await?;
        let detail = serde_json::json!({
            "user": user.username, "role": user.role.as_str(), "pipelines": "none",
            "why": "no group of theirs is mapped to a role", "issuer": issuer, "subject": subject,
        });
        let event = EventRow::audit("user_changed", "sign-on", now, &detail);
        self.insert_event(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(Some(user))
    }

    async fn login_succeeded(&self, username: &str) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM login_throttle WHERE username = $1")
            .bind(username.to_owned())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}
