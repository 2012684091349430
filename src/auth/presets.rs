//! Signatures of other senders, for triggers (`web::triggers`):
//!
//! - **Standard Webhooks** (standardwebhooks.com): `webhook-id`,
//!   `webhook-timestamp` (unix seconds) and `webhook-signature`
//!   (space-separated `v1,<base64>`), each an HMAC-SHA256 over
//!   `"{id}.{timestamp}.{body}"` keyed by the secret (base64, after an
//!   optional `whsec_`). [`standard_sign`] makes such a signature (tests
//!   and examples; outgoing notifications will use it).
//! - **A body HMAC**: GitHub's `X-Hub-Signature-256: sha256=<hex>` and
//!   any sender that puts a hex or base64 HMAC-SHA256 of the raw body in
//!   a header.
//!
//! Stripe's `Stripe-Signature` is [`super::webhook`]'s own format.
//! Secrets shorter than [`MIN_SECRET`](super::webhook::MIN_SECRET) verify
//! nothing, whatever the configuration let through.

use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use super::webhook::{MIN_SECRET, SignatureError};

/// The key a Standard Webhooks secret stands for: its base64 (after an
/// optional `whsec_`) decoded; `None` when it is not base64
/// ([`check_standard_secret`] refuses such a secret in the configuration).
pub fn decode_standard(secret: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(secret).ok()?;
    let b64 = text.strip_prefix("whsec_").unwrap_or(text);
    base64::engine::general_purpose::STANDARD.decode(b64).ok()
}

/// The key of a Standard Webhooks secret, or (not base64) its own bytes,
/// which then verify nothing a sender following the specification signs.
pub fn standard_key(secret: &[u8]) -> Vec<u8> {
    decode_standard(secret).unwrap_or_else(|| secret.to_vec())
}

/// Whether a Standard Webhooks secret is usable: base64 (after an optional
/// `whsec_`) of at least [`MIN_SECRET`] bytes.
pub fn check_standard_secret(secret: &str) -> Result<(), String> {
    match decode_standard(secret.as_bytes()) {
        None => Err("is not base64 (a Standard Webhooks secret is `whsec_` and base64)".into()),
        Some(k) if k.len() < MIN_SECRET => Err(format!(
            "decodes to {} bytes; a Standard Webhooks key must be at least {MIN_SECRET}",
            k.len()
        )),
        Some(_) => Ok(()),
    }
}

fn standard_mac(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> Option<Hmac<Sha256>> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).ok()?;
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Some(mac)
}

/// The `webhook-signature` value for `body` sent as message `id` at
/// `timestamp` (unix seconds) under `secret`.
pub fn standard_sign(secret: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    match standard_mac(&standard_key(secret), id, timestamp, body) {
        Some(m) => format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(m.finalize().into_bytes())
        ),
        None => String::new(),
    }
}

/// The three headers of a Standard Webhooks delivery, as received.
pub struct StandardHeaders<'a> {
    pub id: &'a str,
    pub timestamp: &'a str,
    pub signature: &'a str,
}

/// Checks a Standard Webhooks delivery: its timestamp within
/// `tolerance_s` of `now_s`, then any `v1` signature against any secret.
pub fn standard_verify(
    secrets: &[Vec<u8>],
    h: &StandardHeaders<'_>,
    body: &[u8],
    now_s: i64,
    tolerance_s: i64,
) -> Result<(), SignatureError> {
    let Ok(timestamp) = h.timestamp.trim().parse::<i64>() else {
        return Err(SignatureError::Malformed);
    };
    if h.id.is_empty() {
        return Err(SignatureError::Malformed);
    }
    let signatures: Vec<Vec<u8>> = h
        .signature
        .split_whitespace()
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .collect();
    super::webhook::check_window(signatures.len(), timestamp, now_s, tolerance_s)?;
    let macs = secrets
        .iter()
        .filter(|s| s.len() >= MIN_SECRET)
        .filter_map(|secret| standard_mac(&standard_key(secret), h.id, timestamp, body));
    super::webhook::matches_any(macs, &signatures)
}

/// How a body HMAC is written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Hex,
    Base64,
}

/// The header value a body HMAC sender writes (for tests and examples).
pub fn body_sign(secret: &[u8], body: &[u8], prefix: &str, encoding: Encoding) -> String {
    let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(secret) else {
        return String::new();
    };
    mac.update(body);
    let bytes = mac.finalize().into_bytes();
    let sig = match encoding {
        Encoding::Hex => hex::encode(bytes),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
    };
    format!("{prefix}{sig}")
}

/// Checks a body HMAC: `header` is `prefix` then the signature in
/// `encoding`; any secret may have made it. No timestamp is signed, so a
/// captured delivery can be sent again: a trigger names its record by the
/// body's digest, so a repeat enqueues nothing new.
pub fn body_verify(
    secrets: &[Vec<u8>],
    header: &str,
    body: &[u8],
    prefix: &str,
    encoding: Encoding,
) -> Result<(), SignatureError> {
    let Some(sig) = header.trim().strip_prefix(prefix) else {
        return Err(SignatureError::Malformed);
    };
    let sig = match encoding {
        Encoding::Hex => hex::decode(sig).ok(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD.decode(sig).ok(),
    };
    let Some(sig) = sig.filter(|s| !s.is_empty()) else {
        return Err(SignatureError::Malformed);
    };
    let ok = secrets
        .iter()
        .filter(|s| s.len() >= MIN_SECRET)
        .any(|secret| {
            <Hmac<Sha256> as KeyInit>::new_from_slice(secret).is_ok_and(|mut m| {
                m.update(body);
                m.verify_slice(&sig).is_ok()
            })
        });
    if ok {
        Ok(())
    } else {
        Err(SignatureError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification's reference
    /// libraries: this secret, id, timestamp and body give this signature.
    #[test]
    fn standard_webhooks_match_the_specifications_example() {
        let secret = b"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
        let body = br#"{"test": 2432232314}"#;
        let sig = standard_sign(secret, id, 1614265330, body);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let h = StandardHeaders {
            id,
            timestamp: "1614265330",
            signature: &format!("v1,AAAA {sig}"),
        };
        let secrets = [secret.to_vec()];
        assert_eq!(
            standard_verify(&secrets, &h, body, 1614265330 + 10, 300),
            Ok(())
        );
        assert_eq!(
            standard_verify(&secrets, &h, body, 1614265330 + 301, 300),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            standard_verify(&secrets, &h, b"{}", 1614265330, 300),
            Err(SignatureError::Mismatch)
        );
        let other = StandardHeaders {
            id: "msg_other",
            ..h
        };
        assert_eq!(
            standard_verify(&secrets, &other, body, 1614265330, 300),
            Err(SignatureError::Mismatch),
            "the id is signed"
        );
    }

    #[test]
    fn a_body_hmac_is_checked_in_either_encoding_and_any_secret() {
        let body = br#"{"action":"opened"}"#;
        let old = b"old-secret-0123456789".to_vec();
        let new = b"new-secret-0123456789".to_vec();
        let gh = body_sign(&new, body, "sha256=", Encoding::Hex);
        let both = [old.clone(), new.clone()];
        assert_eq!(
            body_verify(&both, &gh, body, "sha256=", Encoding::Hex),
            Ok(())
        );
        assert_eq!(
            body_verify(
                std::slice::from_ref(&old),
                &gh,
                body,
                "sha256=",
                Encoding::Hex
            ),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            body_verify(&both, &gh, b"{}", "sha256=", Encoding::Hex),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            body_verify(&both, "sha1=00", body, "sha256=", Encoding::Hex),
            Err(SignatureError::Malformed)
        );
        let b64 = body_sign(&old, body, "", Encoding::Base64);
        assert_eq!(body_verify(&both, &b64, body, "", Encoding::Base64), Ok(()));
        // A short secret verifies nothing, even its own signature.
        let short = b"short".to_vec();
        let s = body_sign(&short, body, "", Encoding::Hex);
        assert_eq!(
            body_verify(&[short], &s, body, "", Encoding::Hex),
            Err(SignatureError::Mismatch)
        );
    }
}
