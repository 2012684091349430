//! Outgoing requests signed for a provider that asks for it: an HMAC over
//! the request's timestamp, method, path (with its query) and body, sent
//! in a header as `t=<unix seconds>,v1=<hex>` (the shape of the webhook
//! signatures Ballast verifies, `webhook.rs`); or AWS Signature Version 4
//! (the `aws-sigv4` crate, AWS's own).

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Sha256, Sha512};

/// How requests are signed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
pub enum Scheme {
    #[default]
    #[serde(rename = "hmac-sha256")]
    HmacSha256,
    #[serde(rename = "hmac-sha512")]
    HmacSha512,
    #[serde(rename = "aws-sigv4")]
    AwsSigV4,
}

impl Scheme {
    /// The HMAC's hash, for an HMAC scheme.
    pub fn hmac(self) -> Option<HmacHash> {
        match self {
            Scheme::HmacSha256 => Some(HmacHash::Sha256),
            Scheme::HmacSha512 => Some(HmacHash::Sha512),
            Scheme::AwsSigV4 => None,
        }
    }
}

/// The HMAC's hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HmacHash {
    Sha256,
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

/// An AWS identity: the access key id, its secret key and, for temporary
/// credentials, the session token.
pub struct AwsKeys<'a> {
    pub access_key_id: &'a str,
    pub secret_access_key: &'a str,
    pub session_token: Option<&'a str>,
}

/// A request to sign: its method, absolute URL, headers and body.
pub struct Request<'a> {
    pub method: &'a str,
    pub url: &'a str,
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

/// The headers that sign `request` by AWS Signature Version 4 for
/// `region` and `service` at `at_ms` (unix milliseconds): `x-amz-date`,
/// `authorization`, the session token's when there is one, and for S3
/// `x-amz-content-sha256` (S3 also takes its path as sent, encoded once
/// and not normalized; every other service as AWS's SDKs sign it).
/// `host` is signed as the URL gives it; `user-agent` is not.
pub fn aws_sigv4(
    keys: &AwsKeys<'_>,
    (region, service): (&str, &str),
    at_ms: i64,
    request: &Request<'_>,
) -> Result<Vec<(String, String)>, String> {
    use aws_sigv4::http_request::{
        PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
        UriPathNormalizationMode, sign,
    };
    let credentials = aws_credential_types::Credentials::new(
        keys.access_key_id,
        keys.secret_access_key,
        keys.session_token.map(str::to_owned),
        None,
        "ballast",
    );
    let identity = credentials.into();
    let mut settings = SigningSettings::default();
    if service == "s3" {
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
    }
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(at_ms.max(0) as u64);
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(at)
        .settings(settings)
        .build()
        .map_err(|e| format!("AWS signature: {e}"))?
        .into();
    let headers = request
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()));
    let signable = SignableRequest::new(
        request.method,
        request.url,
        headers,
        SignableBody::Bytes(request.body),
    )
    .map_err(|e| format!("AWS signature: {e}"))?;
    let (instructions, _) = sign(signable, &params)
        .map_err(|e| format!("AWS signature: {e}"))?
        .into_parts();
    Ok(instructions
        .headers()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
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

    /// AWS's published example (the SigV4 test suite's
    /// `get-vanilla-query-order-key-case`): the same signature.
    #[test]
    fn an_aws_signature_is_aws_s_own_example() {
        let keys = AwsKeys {
            access_key_id: "AKIDEXAMPLE",
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            session_token: None,
        };
        let request = Request {
            method: "GET",
            url: "https://example.amazonaws.com/?Param2=value2&Param1=value1",
            headers: &[],
            body: b"",
        };
        // 2015-08-30T12:36:00Z
        let at_ms = 1_440_938_160_000;
        let signed = aws_sigv4(&keys, ("us-east-1", "service"), at_ms, &request).unwrap();
        let header = |name: &str| {
            let found = signed.iter().find(|(k, _)| k.eq_ignore_ascii_case(name));
            found.map(|(_, v)| v.as_str())
        };
        assert_eq!(header("x-amz-date"), Some("20150830T123600Z"));
        assert_eq!(
            header("authorization"),
            Some(
                "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
                 SignedHeaders=host;x-amz-date, \
                 Signature=b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"
            )
        );
        // Temporary credentials: the token is sent and signed.
        let temporary = AwsKeys {
            session_token: Some("the-token"),
            ..keys
        };
        let signed = aws_sigv4(&temporary, ("us-east-1", "service"), at_ms, &request).unwrap();
        let names: Vec<&str> = signed.iter().map(|(k, _)| k.as_str()).collect();
        assert!(names.contains(&"x-amz-security-token"), "{names:?}");
        let auth = &signed.iter().find(|(k, _)| k == "authorization").unwrap().1;
        assert!(
            auth.contains("SignedHeaders=host;x-amz-date;x-amz-security-token"),
            "{auth}"
        );
    }

    const OPENSSL_SHA512: &str = "db4cc8c0a49f737cd0bf3f38078da36582de06b7acb54f08448b72ee470b96931f039ce1827168b943ea9c3f23acf210dfa092638a106c221c42ba59487aa3bf";
    const OPENSSL_SHA256: &str = "2e90f1a6315feb393e887faf902b6711e4b017de03b902b16d6986371a8472fe";
}
