//! Outgoing requests signed for a provider that asks for it: an HMAC over
//! the request's timestamp, method, path (with its query) and body, sent
//! in a header as `t=<unix seconds>,v1=<hex>` (the shape of the webhook
//! signatures Ballast verifies, `webhook.rs`).

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Sha256, Sha512};

/// The HMAC's hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
pub enum HmacHash {
    #[default]
    #[serde(rename = "hmac-sha256")]
    Sha256,
    #[serde(rename = "hmac-sha512")]
    Sha512,
}

/// What is signed: the timestamp, the method, the path with its query and
/// the body, each on its own line (the body last, as sent; empty when
/// there is none).
pub fn message(at_s: i64, method: &str, path_and_query: &str, body: &str) -> String {
    format!("{at_s}\n{method}\n{path_and_query}\n{body}")
}

/// The header value for a request at `at_s` (unix seconds) signed with
/// `secret`: `t=<at_s>,v1=<hex of the HMAC of [`message`]>`.
pub fn sign(
    hash: HmacHash,
    secret: &[u8],
    at_s: i64,
    (method, path_and_query, body): (&str, &str, &str),
) -> String {
    let text = message(at_s, method, path_and_query, body);
    let hex = match hash {
        HmacHash::Sha256 => hex_mac::<Hmac<Sha256>>(secret, &text),
        HmacHash::Sha512 => hex_mac::<Hmac<Sha512>>(secret, &text),
    };
    format!("t={at_s},v1={hex}")
}

/// The hex HMAC `M` of `text` under `secret`.
fn hex_mac<M: Mac + KeyInit>(secret: &[u8], text: &str) -> String {
    // HMAC takes a key of any length: this cannot fail.
    <M as KeyInit>::new_from_slice(secret)
        .map(|mut m| {
            m.update(text.as_bytes());
            hex::encode(m.finalize().into_bytes())
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checked against `openssl dgst -sha256 -hmac`: printf
    /// '1700000000\nPOST\n/v1/charge?x=1\n{"a":1}' | openssl dgst -sha256 -hmac key
    #[test]
    fn a_signature_is_the_hmac_of_the_request_lines() {
        let s = sign(
            HmacHash::Sha256,
            b"key",
            1_700_000_000,
            ("POST", "/v1/charge?x=1", r#"{"a":1}"#),
        );
        assert_eq!(s, format!("t=1700000000,v1={}", OPENSSL_SHA256));
        // printf '1\nGET\n/\n' | openssl dgst -sha512 -hmac key
        let long = sign(HmacHash::Sha512, b"key", 1, ("GET", "/", ""));
        assert_eq!(long, format!("t=1,v1={OPENSSL_SHA512}"));
    }

    const OPENSSL_SHA512: &str = "db4cc8c0a49f737cd0bf3f38078da36582de06b7acb54f08448b72ee470b96931f039ce1827168b943ea9c3f23acf210dfa092638a106c221c42ba59487aa3bf";
    const OPENSSL_SHA256: &str = "2e90f1a6315feb393e887faf902b6711e4b017de03b902b16d6986371a8472fe";
}
