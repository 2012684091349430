//! Password hashing with argon2id (the crate's default parameters), run off
//! the async threads because each hash costs tens of milliseconds, and
//! checks of presented passwords bounded in number ([`Checks`]), because
//! each also takes about 19 MiB.

use std::sync::Arc;

use argon2::Argon2;
use argon2::password_hash::phc::PasswordHash;
use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Shortest password accepted for a new account or a change.
pub const MIN_LEN: usize = 10;
/// Longest password accepted (argon2 input is bounded to keep cost bounded).
pub const MAX_LEN: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum PasswordError {
    #[error("password must be at least {MIN_LEN} characters")]
    TooShort,
    #[error("password must be at most {MAX_LEN} bytes")]
    TooLong,
    #[error("password hashing failed: {0}")]
    Hash(String),
}

/// Checks a new password against the policy.
pub fn check_policy(password: &str) -> Result<(), PasswordError> {
    if password.chars().count() < MIN_LEN {
        return Err(PasswordError::TooShort);
    }
    if password.len() > MAX_LEN {
        return Err(PasswordError::TooLong);
    }
    Ok(())
}

/// Hashes a password to a PHC string (`$argon2id$v=19$…`) with a fresh salt.
pub fn hash(password: &str) -> Result<String, PasswordError> {
    let hash: PasswordHash = Argon2::default()
        .hash_password(password.as_bytes())
        .map_err(|e| PasswordError::Hash(e.to_string()))?;
    Ok(hash.to_string())
}

/// True when `password` matches the PHC string `hash`. A malformed hash
/// never matches.
pub fn verify(password: &str, hash: &str) -> bool {
    match PasswordHash::new(hash) {
        Ok(parsed) => Argon2::default()
            .verify_password(password.as_bytes(), &parsed)
            .is_ok(),
        Err(_) => false,
    }
}

/// [`hash`] on the blocking pool.
pub async fn hash_blocking(password: String) -> Result<String, PasswordError> {
    tokio::task::spawn_blocking(move || hash(&password))
        .await
        .map_err(|e| PasswordError::Hash(e.to_string()))?
}

/// At most so many password checks at once on this node: past that, a
/// caller is told to come back rather than queued, so a flood of logins
/// costs neither memory nor blocking threads beyond the cap.
#[derive(Clone)]
pub struct Checks {
    permits: Arc<Semaphore>,
}

impl Checks {
    pub fn new(at_once: usize) -> Checks {
        Checks {
            permits: Arc::new(Semaphore::new(at_once.max(1))),
        }
    }

    /// A check's place, if one is free now.
    pub fn try_slot(&self) -> Option<Slot> {
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(Slot { _permit: permit })
    }
}

/// One place among the [`Checks`], held until its check ends.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    /// [`verify`] on the blocking pool. The place moves with the work, so
    /// it is held until the hash is computed even if the caller stops
    /// waiting (a client that hangs up frees nothing early).
    pub async fn verify(self, password: String, hash: String) -> bool {
        tokio::task::spawn_blocking(move || {
            let _slot = self;
            verify(&password, &hash)
        })
        .await
        .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_argon2id_salted_and_verify() {
        let a = hash("correct horse battery").unwrap_or_default();
        let b = hash("correct horse battery").unwrap_or_default();
        assert!(a.starts_with("$argon2id$"), "{a}");
        assert_ne!(a, b, "each hash has its own salt");
        assert!(verify("correct horse battery", &a));
        assert!(!verify("correct horse batterx", &a));
        assert!(!verify("anything", "not a phc string"));
    }

    #[tokio::test]
    async fn checks_past_the_cap_are_refused_until_a_slot_frees() {
        let checks = Checks::new(1);
        let held = checks.try_slot().expect("a free slot");
        assert!(checks.try_slot().is_none(), "the one slot is held");
        let hash = hash("correct horse battery").unwrap_or_default();
        assert!(held.verify("correct horse battery".into(), hash).await);
        assert!(checks.try_slot().is_some(), "freed when the check ended");
    }

    #[test]
    fn policy_bounds_length() {
        assert!(matches!(
            check_policy("short"),
            Err(PasswordError::TooShort)
        ));
        assert!(check_policy("long enough pw").is_ok());
        assert!(matches!(
            check_policy(&"x".repeat(MAX_LEN + 1)),
            Err(PasswordError::TooLong)
        ));
    }
}
