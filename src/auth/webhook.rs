//! Webhook signatures: HMAC-SHA256 over the raw body, hex-encoded, sent as
//! `sha256=<hex>` (the bare hex is accepted too). Several secrets may be
//! valid at once, so a secret can be rotated without dropping deliveries.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The signature header value for `body` under `secret`.
pub fn sign(secret: &[u8], body: &[u8]) -> String {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => return String::new(),
    };
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// True when `header` is a valid signature of `body` under any of
/// `secrets`. Comparison is constant-time.
pub fn verify(secrets: &[Vec<u8>], header: &str, body: &[u8]) -> bool {
    let hex_sig = header.trim();
    let hex_sig = hex_sig.strip_prefix("sha256=").unwrap_or(hex_sig);
    let Ok(sig) = hex::decode(hex_sig) else {
        return false;
    };
    secrets.iter().any(|secret| {
        let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(secret) else {
            return false;
        };
        mac.update(body);
        mac.verify_slice(&sig).is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn signs_and_verifies_with_rotation() {
        let body = br#"{"id":"job_1","status":"succeeded"}"#;
        let sig = sign(b"old-secret", body);
        assert!(sig.starts_with("sha256=") && sig.len() == 7 + 64);
        let secrets = vec![b"new-secret".to_vec(), b"old-secret".to_vec()];
        assert!(verify(&secrets, &sig, body));
        assert!(
            verify(&secrets, sig.trim_start_matches("sha256="), body),
            "bare hex"
        );
        assert!(!verify(&secrets, &sig, b"{}"), "another body");
        assert!(!verify(&[b"other".to_vec()], &sig, body), "another secret");
        assert!(!verify(&secrets, "sha256=zz", body));
        assert!(!verify(&[], &sig, body), "no secrets, nothing verifies");
    }

    proptest! {
        #[test]
        fn garbage_headers_never_verify(header in ".{0,100}", body in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert!(!verify(&[b"s".to_vec()], &header, &body) || header.contains(&sign(b"s", &body)[7..]));
        }
    }
}
