//! OAuth2 client-credentials tokens, decided purely: what a token
//! endpoint's reply means, when a cached token is renewed, and how long a
//! failing endpoint is left alone. The engine (`engine::token`) fetches,
//! caches and shares the token; nothing here does I/O.

use std::time::Duration;

use super::UnixMs;

/// A token as the endpoint granted it.
#[derive(Clone, PartialEq, Eq)]
pub struct Grant {
    pub access_token: String,
    /// When the endpoint said it expires (`expires_in`); `None` when it
    /// did not say.
    pub expires_at: Option<UnixMs>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("access_token", &"[redacted]")
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Why no token could be had. Each kind is a stable error code, and each
/// defers the work that needed the token (no attempt spent) instead of
/// failing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    /// The endpoint did not answer usefully: transport failure, timeout,
    /// a 5xx or 429, or a reply that holds no token.
    Down(String),
    /// The endpoint refused the client (a 4xx such as `invalid_client`):
    /// the credentials or scopes need a human, but the records wait.
    Refused(String),
}

impl TokenError {
    pub fn code(&self) -> &'static str {
        match self {
            TokenError::Down(_) => "token_endpoint_down",
            TokenError::Refused(_) => "token_refused",
        }
    }

    pub fn detail(&self) -> &str {
        match self {
            TokenError::Down(d) | TokenError::Refused(d) => d,
        }
    }
}

/// A token's lifetime when the endpoint does not state one.
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(3600);

/// What a token endpoint's reply (`status`, `body`) means at `now`.
/// `excerpt` describes the reply for an error (already cleaned of
/// secrets by the caller).
pub fn parse_grant(
    status: u16,
    body: &[u8],
    now: UnixMs,
    excerpt: &str,
) -> Result<Grant, TokenError> {
    if status == 429 || status >= 500 {
        return Err(TokenError::Down(format!(
            "token endpoint answered {status}: {excerpt}"
        )));
    }
    if !(200..300).contains(&status) {
        return Err(TokenError::Refused(format!(
            "token endpoint answered {status}: {excerpt}"
        )));
    }
    let json: serde_json::Value = serde_json::from_slice(body)
        .map_err(|_| TokenError::Down(format!("token endpoint reply is not JSON: {excerpt}")))?;
    let token = json
        .get("access_token")
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            TokenError::Down(format!(
                "token endpoint reply has no access_token: {excerpt}"
            ))
        })?;
    let kind = json.get("token_type").and_then(|t| t.as_str());
    if let Some(kind) = kind.filter(|k| !k.eq_ignore_ascii_case("bearer")) {
        return Err(TokenError::Refused(format!(
            "token endpoint granted a `{kind}` token; only bearer tokens are sent"
        )));
    }
    // `expires_in` is a number of seconds; some servers send it as a string.
    let expires_in = match json.get("expires_in") {
        Some(serde_json::Value::Number(n)) => n.as_f64(),
        Some(serde_json::Value::String(s)) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    let expires_at = expires_in
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| now + (s.min(10.0 * 365.0 * 86_400.0) * 1000.0) as i64);
    Ok(Grant {
        access_token: token.to_owned(),
        expires_at,
    })
}

/// When a grant made at `granted_at` is renewed: `renew_before` ahead of
/// its expiry, but never earlier than half its lifetime (a short-lived
/// token is not renewed on every call); an hour after the grant when the
/// endpoint did not say.
pub fn renew_at(grant: &Grant, granted_at: UnixMs, renew_before: Duration) -> UnixMs {
    let expires = grant
        .expires_at
        .unwrap_or(granted_at + DEFAULT_LIFETIME.as_millis() as i64);
    let lifetime = (expires - granted_at).max(0);
    let ahead = (renew_before.as_millis() as i64).min(lifetime / 2);
    expires - ahead
}

/// How long a failing endpoint is left alone after its `failures`-th
/// failure in a row (1 s, 2 s, 4 s … at most 60 s): the calls waiting on
/// it are deferred that long, instead of every call asking again.
pub fn pause_after(failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(6);
    Duration::from_secs(1u64 << exp).min(Duration::from_secs(60))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMs = 1_000_000;

    #[test]
    fn a_grant_is_read_with_its_expiry() {
        let body = br#"{"access_token":"abc","token_type":"Bearer","expires_in":30}"#;
        let g = parse_grant(200, body, NOW, "").unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(g.access_token, "abc");
        assert_eq!(g.expires_at, Some(NOW + 30_000));
        let g = parse_grant(200, br#"{"access_token":"abc","expires_in":"60"}"#, NOW, "")
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(g.expires_at, Some(NOW + 60_000));
        let g = parse_grant(200, br#"{"access_token":"abc"}"#, NOW, "")
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(g.expires_at, None);
        assert!(
            !format!("{g:?}").contains("abc"),
            "a grant never prints its token"
        );
    }

    #[test]
    fn failures_are_down_or_refused() {
        let code = |status, body: &[u8]| parse_grant(status, body, NOW, "x").map_err(|e| e.code());
        assert_eq!(code(503, b"").err(), Some("token_endpoint_down"));
        assert_eq!(code(429, b"").err(), Some("token_endpoint_down"));
        assert_eq!(code(200, b"<html>").err(), Some("token_endpoint_down"));
        assert_eq!(
            code(200, br#"{"access_token":""}"#).err(),
            Some("token_endpoint_down")
        );
        assert_eq!(
            code(200, br#"{"error":"x"}"#).err(),
            Some("token_endpoint_down")
        );
        assert_eq!(
            code(401, br#"{"error":"invalid_client"}"#).err(),
            Some("token_refused")
        );
        assert_eq!(code(400, b"").err(), Some("token_refused"));
        assert_eq!(
            code(200, br#"{"access_token":"a","token_type":"mac"}"#).err(),
            Some("token_refused")
        );
    }

    #[test]
    fn renewal_comes_before_expiry_and_not_before_half_life() {
        let g = |secs: Option<i64>| Grant {
            access_token: "t".into(),
            expires_at: secs.map(|s| NOW + s * 1000),
        };
        let before = Duration::from_secs(60);
        assert_eq!(renew_at(&g(Some(3600)), NOW, before), NOW + 3_540_000);
        assert_eq!(renew_at(&g(Some(30)), NOW, before), NOW + 15_000);
        assert_eq!(renew_at(&g(Some(0)), NOW, before), NOW);
        assert_eq!(renew_at(&g(None), NOW, before), NOW + 3_540_000);
    }

    #[test]
    fn a_failing_endpoint_is_left_alone_longer_each_time() {
        let secs: Vec<u64> = (1..=9).map(|n| pause_after(n).as_secs()).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(pause_after(0).as_secs(), 1);
    }
}
