//! Changes to user accounts, decided: which would leave the control plane
//! with no enabled admin to manage it. The store asks with the admins it
//! has locked, so two admins demoting each other at once cannot both pass.

use super::scope::Scope;
use super::{Role, User};

/// A change of one user.
#[derive(Clone, PartialEq)]
pub enum UserChange {
    Password(String),
    Role(Role),
    Disabled(bool),
    /// The pipelines the user may see.
    Pipelines(Scope),
    /// Whether the user sees sensitive fields in clear.
    Unmask(bool),
}

/// A change refused whatever who asks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccountRefusal {
    #[error("`{0}` is the last enabled admin: make another user an admin first")]
    LastAdmin(String),
    /// A role with a scope it cannot have (`Scope::check_role`).
    #[error("`{0}`: {1}")]
    Scope(String, String),
    /// A password for a user who signs on through the provider.
    #[error("`{0}` signs on through the OpenID provider: it has no password here")]
    SignsOn(String),
}

impl AccountRefusal {
    /// The stable code shown by the pages and the API.
    pub fn code(&self) -> &'static str {
        match self {
            AccountRefusal::LastAdmin(_) => "last_admin",
            AccountRefusal::Scope(..) => "admin_scoped",
            AccountRefusal::SignsOn(_) => "signs_on",
        }
    }
}

/// Refuses a change of `user` that would leave no enabled admin;
/// `enabled_admins` are the ids of the enabled admins now.
pub fn check_change(
    enabled_admins: &[i64],
    user: &User,
    change: &UserChange,
) -> Result<(), AccountRefusal> {
    if user.signs_on && matches!(change, UserChange::Password(_)) {
        return Err(AccountRefusal::SignsOn(user.username.clone()));
    }
    let (role, scope) = match change {
        UserChange::Role(role) => (*role, &user.pipelines),
        UserChange::Pipelines(scope) => (user.role, scope),
        _ => (user.role, &user.pipelines),
    };
    if let Err(m) = scope.check_role(role) {
        return Err(AccountRefusal::Scope(user.username.clone(), m));
    }
    let admin_now = user.role == Role::Admin && !user.disabled;
    let admin_after = match change {
        UserChange::Role(role) => *role == Role::Admin && !user.disabled,
        UserChange::Disabled(disabled) => user.role == Role::Admin && !disabled,
        UserChange::Password(_) | UserChange::Pipelines(_) | UserChange::Unmask(_) => admin_now,
    };
    let others = enabled_admins.iter().any(|id| *id != user.id);
    if admin_now && !admin_after && !others {
        return Err(AccountRefusal::LastAdmin(user.username.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(id: i64, role: Role, disabled: bool) -> User {
        User {
            id,
            username: format!("u{id}"),
            password_hash: String::new(),
            role,
            disabled,
            created_at: 0,
            updated_at: 0,
            theme: None,
            pipelines: Scope::all(),
            unmask: false,
            signs_on: false,
        }
    }

    #[test]
    fn the_last_enabled_admin_keeps_the_role_and_stays_enabled() {
        let last = user(1, Role::Admin, false);
        for change in [
            UserChange::Role(Role::Operator),
            UserChange::Role(Role::Viewer),
            UserChange::Disabled(true),
        ] {
            assert_eq!(
                check_change(&[1], &last, &change),
                Err(AccountRefusal::LastAdmin("u1".into()))
            );
        }
        for change in [
            UserChange::Role(Role::Admin),
            UserChange::Disabled(false),
            UserChange::Password("h".into()),
        ] {
            assert_eq!(check_change(&[1], &last, &change), Ok(()));
        }
        // With another enabled admin, either may go.
        let change = UserChange::Disabled(true);
        assert_eq!(check_change(&[1, 2], &last, &change), Ok(()));
        // Users who are not enabled admins change freely.
        let viewer = user(3, Role::Viewer, false);
        assert_eq!(check_change(&[1], &viewer, &change), Ok(()));
        let disabled_admin = user(4, Role::Admin, true);
        let demote = UserChange::Role(Role::Viewer);
        assert_eq!(check_change(&[1], &disabled_admin, &demote), Ok(()));
        assert_eq!(AccountRefusal::LastAdmin("x".into()).code(), "last_admin");
    }

    #[test]
    fn an_admin_is_never_limited_to_pipelines() {
        let only_a = UserChange::Pipelines(Scope::parse("a").unwrap());
        let admin = user(1, Role::Admin, false);
        let refused = check_change(&[1, 2], &admin, &only_a).unwrap_err();
        assert_eq!(refused.code(), "admin_scoped");
        let mut scoped = user(3, Role::Viewer, false);
        assert_eq!(check_change(&[1], &scoped, &only_a), Ok(()));
        scoped.pipelines = Scope::parse("a").unwrap();
        let promote = UserChange::Role(Role::Admin);
        assert!(check_change(&[1], &scoped, &promote).is_err());
        assert_eq!(
            check_change(&[1], &scoped, &UserChange::Role(Role::Operator)),
            Ok(())
        );
        let widen = UserChange::Pipelines(Scope::all());
        assert_eq!(check_change(&[1], &scoped, &widen), Ok(()));
    }
}
