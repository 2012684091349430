//! Webhook signatures: HMAC-SHA256 over `"{timestamp}.{raw body}"`, sent as
//! `t=<unix seconds>,v1=<hex>` (several `v1=` entries may be present while a
//! provider rotates). A signature outside the tolerance window is refused,
//! so a captured delivery cannot be replayed later; several secrets may be
//! valid at once, so a secret can be rotated without dropping deliveries.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The fewest bytes a secret must have to verify anything: configuration
/// refuses shorter ones, and [`verify`] ignores them, so an empty or short
/// key that got past configuration still accepts no delivery.
pub const MIN_SECRET: usize = 16;

/// Why a signature was refused; each has a stable code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the signature header is missing or malformed (expected t=<unix seconds>,v1=<hex>)")]
    Malformed,
    #[error("the signature's timestamp is outside the tolerance window")]
    Stale,
    #[error("the signature does not match")]
    Mismatch,
}

impl SignatureError {
    pub fn code(self) -> &'static str {
        match self {
            SignatureError::Malformed => "bad_signature_header",
            SignatureError::Stale => "stale_signature",
            SignatureError::Mismatch => "bad_signature",
        }
    }
}

fn mac(secret: &[u8], timestamp: i64, body: &[u8]) -> Option<Hmac<Sha256>> {
    // HMAC accepts keys of any length; this fails for none.
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).ok()?;
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Some(mac)
}

/// The signature header value for `body` under `secret` at `timestamp`
/// (unix seconds).
pub fn sign(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    match mac(secret, timestamp, body) {
        Some(m) => format!(
            "t={timestamp},v1={}",
            hex::encode(m.finalize().into_bytes())
        ),
        None => String::new(),
    }
}

/// Checks `header` against `body` under any of `secrets` of at least
/// [`MIN_SECRET`] bytes: the timestamp within `tolerance_s` of `now_s`,
/// then a constant-time comparison.
pub fn verify(
    secrets: &[Vec<u8>],
    header: &str,
    body: &[u8],
    now_s: i64,
    tolerance_s: i64,
) -> Result<(), SignatureError> {
    let (timestamp, signatures) = parse(header);
    let Some(timestamp) = timestamp else {
        return Err(SignatureError::Malformed);
    };
    check_window(signatures.len(), timestamp, now_s, tolerance_s)?;
    let macs = secrets
        .iter()
        .filter(|s| s.len() >= MIN_SECRET)
        .filter_map(|secret| mac(secret, timestamp, body));
    matches_any(macs, &signatures)
}

/// Whether any of `macs` (one per secret, each over the signed content
/// once, however many signatures were sent) equals any of `signatures`,
/// compared in constant time.
pub(crate) fn matches_any(
    macs: impl Iterator<Item = Hmac<Sha256>>,
    signatures: &[Vec<u8>],
) -> Result<(), SignatureError> {
    use subtle::ConstantTimeEq;
    for m in macs {
        let tag = m.finalize().into_bytes();
        let hit = signatures
            .iter()
            .any(|sig| sig.len() == tag.len() && bool::from(sig.as_slice().ct_eq(tag.as_slice())));
        if hit {
            return Ok(());
        }
    }
    Err(SignatureError::Mismatch)
}

/// A signed delivery's first checks, before any MAC: one to eight
/// signatures, and a timestamp within `tolerance_s` of `now_s`.
pub(crate) fn check_window(
    signatures: usize,
    timestamp: i64,
    now_s: i64,
    tolerance_s: i64,
) -> Result<(), SignatureError> {
    if signatures == 0 || signatures > 8 {
        return Err(SignatureError::Malformed);
    }
    if now_s.abs_diff(timestamp) > tolerance_s.unsigned_abs() {
        return Err(SignatureError::Stale);
    }
    Ok(())
}

/// The header's timestamp and signatures.
fn parse(header: &str) -> (Option<i64>, Vec<Vec<u8>>) {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => timestamp = v.parse::<i64>().ok(),
            Some(("v1", v)) => {
                if let Ok(sig) = hex::decode(v) {
                    signatures.push(sig);
                }
            }
            _ => {}
        }
    }
    (timestamp, signatures)
}

/// What a verified delivery's signature covers, as a delivery id
/// (`sig:` and 32 hex digits of SHA-256 over timestamp and body): the same
/// signed delivery sent again within the tolerance, with or without the
/// provider's delivery-id header, has the same key and counts once.
pub fn replay_key(header: &str, body: &[u8]) -> Option<String> {
    use sha2::Digest;
    let timestamp = parse(header).0?;
    let mut h = Sha256::new();
    h.update(timestamp.to_string().as_bytes());
    h.update(b".");
    h.update(body);
    Some(format!("sig:{}", hex::encode(&h.finalize()[..16])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: i64 = 1_800_000_000;

    #[test]
    fn a_replay_key_names_the_signed_content() {
        let body = br#"{"id":"job_1"}"#;
        let sig = sign(b"old-secret-0123456789", NOW, body);
        let key = replay_key(&sig, body).unwrap();
        assert!(key.starts_with("sig:") && key.len() == 36, "{key}");
        // The same signed content, however the header is written.
        let resigned = sign(b"new-secret-0123456789", NOW, body);
        assert_eq!(
            replay_key(&format!("{resigned}, v1=00"), body),
            Some(key.clone())
        );
        assert_ne!(
            replay_key(&sign(b"old-secret-0123456789", NOW + 1, body), body),
            Some(key.clone())
        );
        assert_ne!(replay_key(&sig, b"{}"), Some(key));
        assert_eq!(replay_key("v1=00", body), None);
    }

    #[test]
    fn an_empty_or_short_secret_verifies_nothing() {
        let body = br#"{"id":"job_1","status":"succeeded"}"#;
        for short in [&b""[..], b"fifteen-bytes!!"] {
            let forged = sign(short, NOW, body);
            assert_eq!(
                verify(&[short.to_vec()], &forged, body, NOW, 300),
                Err(SignatureError::Mismatch),
                "{short:?}"
            );
        }
        let long = b"sixteen-bytes!!!";
        let sig = sign(long, NOW, body);
        assert_eq!(verify(&[long.to_vec()], &sig, body, NOW, 300), Ok(()));
    }

    #[test]
    fn signs_and_verifies_with_rotation_and_a_window() {
        let body = br#"{"id":"job_1","status":"succeeded"}"#;
        let sig = sign(b"old-secret-0123456789", NOW, body);
        assert!(
            sig.starts_with(&format!("t={NOW},v1=")) && sig.len() == 16 + 64,
            "{sig}"
        );
        let secrets = vec![
            b"new-secret-0123456789".to_vec(),
            b"old-secret-0123456789".to_vec(),
        ];
        assert_eq!(verify(&secrets, &sig, body, NOW, 300), Ok(()));
        assert_eq!(verify(&secrets, &sig, body, NOW + 300, 300), Ok(()));
        assert_eq!(
            verify(&secrets, &sig, body, NOW + 301, 300),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            verify(&secrets, &sig, body, NOW - 301, 300),
            Err(SignatureError::Stale)
        );
        assert_eq!(
            verify(&secrets, &sig, b"{}", NOW, 300),
            Err(SignatureError::Mismatch),
            "another body"
        );
        assert_eq!(
            verify(&[b"other".to_vec()], &sig, body, NOW, 300),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&[], &sig, body, NOW, 300),
            Err(SignatureError::Mismatch),
            "no secrets"
        );
        // Moving the timestamp breaks the signature: it is signed too.
        let moved = sig.replace(&format!("t={NOW}"), &format!("t={}", NOW + 1));
        assert_eq!(
            verify(&secrets, &moved, body, NOW, 300),
            Err(SignatureError::Mismatch)
        );
        // A provider signing with two secrets during rotation.
        let new = sign(b"new-secret-0123456789", NOW, body);
        let both = format!("{sig},v1={}", &new[new.find("v1=").unwrap() + 3..]);
        assert_eq!(
            verify(&[b"new-secret-0123456789".to_vec()], &both, body, NOW, 300),
            Ok(())
        );
        for bad in [
            "",
            "sha256=00",
            "v1=00",
            "t=1",
            "t=x,v1=00",
            &sig[sig.find(',').unwrap() + 1..],
        ] {
            assert_eq!(
                verify(&secrets, bad, body, NOW, 300),
                Err(SignatureError::Malformed),
                "{bad:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn garbage_headers_never_verify(header in ".{0,120}", body in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert!(verify(&[b"s".to_vec()], &header, &body, NOW, 300).is_err());
        }
    }
}
