//! Password hashing with argon2id (the crate's default parameters), run off
//! the async threads because each hash costs tens of milliseconds, and
//! checks of presented passwords bounded in number ([`Checks`]), because
//! each also takes about 19 MiB.

use std::collections::HashSet;
use std::sync::{Arc, LazyLock};

use argon2::Argon2;
use argon2::password_hash::phc::PasswordHash;
use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Shortest password accepted for a new account or a change.
pub const MIN_LEN: usize = 12;
/// Longest password accepted (argon2 input is bounded to keep cost bounded).
pub const MAX_LEN: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum PasswordError {
    #[error("password must be at least {MIN_LEN} characters")]
    TooShort,
    #[error("password must be at most {MAX_LEN} bytes")]
    TooLong,
    #[error("that password is among the most common ones: choose another")]
    Common,
    #[error("password hashing failed: {0}")]
    Hash(String),
}

/// Checks a new password against the policy: at least [`MIN_LEN`]
/// characters, at most [`MAX_LEN`] bytes, and none of the most common
/// passwords ([`is_common`]).
pub fn check_policy(password: &str) -> Result<(), PasswordError> {
    if password.chars().count() < MIN_LEN {
        return Err(PasswordError::TooShort);
    }
    if password.len() > MAX_LEN {
        return Err(PasswordError::TooLong);
    }
    if is_common(password) {
        return Err(PasswordError::Common);
    }
    Ok(())
}

/// The list shipped in the binary, one password a line (`#` lines are
/// its notes).
const COMMON: &str = include_str!("common-passwords.txt");

static COMMON_SET: LazyLock<HashSet<&'static str>> = LazyLock::new(|| {
    COMMON
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
});

/// True for one of the most common passwords, whatever its case, alone or
/// followed by digits and punctuation only (`Password1234!`), which is how
/// such a password is most often stretched to a length rule.
pub fn is_common(password: &str) -> bool {
    let lower = password.to_lowercase();
    let stem = lower.trim_end_matches(|c: char| c.is_ascii_digit() || c.is_ascii_punctuation());
    COMMON_SET.contains(lower.as_str()) || (!stem.is_empty() && COMMON_SET.contains(stem))
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

    #[test]
    fn policy_refuses_the_most_common_passwords() {
        for common in [
            "qwerty123456",
            "1qaz2wsx3edc",
            "QWERTY123456",
            "password1234",
            "Password1234!",
            "monkey123456789",
            "iloveyou2024!!",
        ] {
            assert!(
                matches!(check_policy(common), Err(PasswordError::Common)),
                "{common}"
            );
        }
        for fine in [
            "correct horse battery staple",
            "pw-alice-0123456789",
            "1234password",
        ] {
            assert!(check_policy(fine).is_ok(), "{fine}");
        }
        assert!(COMMON_SET.len() >= 9_000, "the list is shipped whole");
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
        assert!(matches!(
            check_policy("eleven char"),
            Err(PasswordError::TooShort)
        ));
        assert!(check_policy("long enough pw").is_ok());
        assert!(matches!(
            check_policy(&"x".repeat(MAX_LEN + 1)),
            Err(PasswordError::TooLong)
        ));
    }
}
