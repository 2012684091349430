//! What Ballast sent, as the attempt history keeps it beside the reply: the
//! method, the URL, the headers and the start of the body, with every
//! credential taken out. Decided purely from the call and the secrets; the
//! engine stores the result.
//!
//! Taken out:
//! - the provider's secrets (its key, its current OAuth2 token) wherever
//!   they appear, spelt plainly or with JSON escapes ([`super::redact`]);
//! - the value of every header that carries a credential by its name
//!   (the provider's configured auth header, `Authorization`, `Cookie`,
//!   `X-Api-Key`, any name with `token`, `secret`, `password`, `session`
//!   or `signature` in it; never `Idempotency-Key`, which operators need);
//! - the value of every query parameter that carries one by its name
//!   (`api_key`, `access_token`, `sig`, `X-Amz-Signature`…);
//! - a password in the URL's user information.

use serde::{Deserialize, Serialize};

use super::{EXCERPT_MAX_BYTES, excerpt};

/// What stands in for a value taken out.
pub const REDACTED: &str = "[redacted]";

/// One request as it left, credentials removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SentRequest {
    pub method: String,
    pub url: String,
    /// Each header as `[name, value]`.
    #[schema(value_type = Vec<Vec<String>>)]
    pub headers: Vec<(String, String)>,
    /// At most [`EXCERPT_MAX_BYTES`] of the body, `None` when there was none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
}

/// The parts of a request, before anything is removed: its headers and
/// body owned (taken over from a call sent, or copied from one about to
/// be), so that what needs no change is kept without a copy.
pub struct Outgoing<'a> {
    pub method: &'a str,
    pub url: &'a str,
    pub headers: Vec<(String, String)>,
    pub body: Option<String>,
}

impl SentRequest {
    /// `out` as the history keeps it: `credential_headers` names the
    /// provider's credential headers (compared without case), `secrets`
    /// its current credentials. A header value, the URL or the body with
    /// something to remove is replaced by a cleaned copy; the body, cleaned
    /// whole first, is then cut to its excerpt.
    pub fn of(out: Outgoing<'_>, credential_headers: &[&str], secrets: &[&str]) -> SentRequest {
        let mut headers = out.headers;
        for (name, value) in &mut headers {
            let credential = credential_headers
                .iter()
                .any(|h| h.eq_ignore_ascii_case(name))
                || is_credential_header(name);
            if credential {
                *value = REDACTED.to_owned();
            } else {
                clean(value, secrets);
            }
        }
        let mut url = redact_url(out.url);
        clean(&mut url, secrets);
        let body = out.body.map(|mut b| {
            clean(&mut b, secrets);
            let cut = excerpt(&b, EXCERPT_MAX_BYTES).len();
            if cut < b.len() {
                b.truncate(cut);
                b.shrink_to_fit();
            }
            b
        });
        SentRequest {
            method: out.method.to_owned(),
            url,
            headers,
            body,
        }
    }

    /// The request as one stored text (JSON).
    pub fn to_stored(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A stored text read back; `None` for one that is not a request (a
    /// row written by hand, say), which the pages then do not show.
    pub fn from_stored(text: &str) -> Option<SentRequest> {
        serde_json::from_str(text).ok()
    }
}

/// Replaces secrets and NUL characters in `text` (as in replies); a text
/// with none is left as it is.
fn clean(text: &mut String, secrets: &[&str]) {
    if let Some(cleaned) = super::storable_text(text, secrets) {
        *text = cleaned;
    }
}

/// Header names that carry a credential, whole (any case).
const CREDENTIAL_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
    "apikey",
    "x-apikey",
];

/// Parts of a header name that say it carries a credential.
const CREDENTIAL_HEADER_PARTS: &[&str] = &[
    "token",
    "secret",
    "password",
    "session",
    "signature",
    "api-key",
    "apikey",
    "subscription-key",
];

/// Whether a header's name says it carries a credential.
pub fn is_credential_header(name: &str) -> bool {
    // Any case, compared in place: asked of every header of every call.
    if name.eq_ignore_ascii_case("idempotency-key") {
        return false;
    }
    CREDENTIAL_HEADERS
        .iter()
        .any(|e| name.eq_ignore_ascii_case(e))
        || CREDENTIAL_HEADER_PARTS
            .iter()
            .any(|p| contains_ignore_ascii_case(name, p))
}

/// Whether `hay` holds `needle` (lower case ASCII) in any case.
fn contains_ignore_ascii_case(hay: &str, needle: &str) -> bool {
    hay.as_bytes()
        .windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle.as_bytes()))
}

/// Whether a query parameter's name says it carries a credential.
pub fn is_credential_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase().replace(['-', '_'], "");
    const EXACT: &[&str] = &["key", "apikey", "sig", "code", "auth", "pass", "pwd"];
    const PARTS: &[&str] = &[
        "token",
        "secret",
        "password",
        "signature",
        "credential",
        "apikey",
        "accesskey",
        "session",
    ];
    EXACT.contains(&n.as_str()) || PARTS.iter().any(|p| n.contains(p))
}

/// `url` with a password in its user information and the values of its
/// credential query parameters replaced by [`REDACTED`]; the rest as sent.
pub fn redact_url(url: &str) -> String {
    let (before_fragment, fragment) = match url.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (url, None),
    };
    let (base, query) = match before_fragment.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (before_fragment, None),
    };
    let mut out = redact_userinfo(base);
    if let Some(q) = query {
        out.push('?');
        let parts: Vec<String> = q
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _)) if is_credential_param(&decoded(name)) => {
                    format!("{name}={REDACTED}")
                }
                _ => pair.to_owned(),
            })
            .collect();
        out.push_str(&parts.join("&"));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    out
}

/// A query parameter's name, percent- and plus-decoded.
fn decoded(name: &str) -> String {
    form_urlencoded::parse(name.as_bytes())
        .next()
        .map(|(k, _)| k.into_owned())
        .unwrap_or_default()
}

/// `scheme://user:password@host/…` with the password replaced.
fn redact_userinfo(base: &str) -> String {
    let Some((scheme, rest)) = base.split_once("://") else {
        return base.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let hidden = if userinfo.contains(':') {
                format!("{user}:{REDACTED}")
            } else {
                REDACTED.to_owned()
            };
            format!("{scheme}://{hidden}@{host}{path}")
        }
        None => base.to_owned(),
    }
}

/// An error and its causes on one line (reqwest's errors say what went
/// wrong underneath only in their sources).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn credential_headers_are_redacted_and_others_kept() {
        let headers = h(&[
            ("X-Provider-Auth", "Bearer sk-live-123456"),
            ("Authorization", "Basic dXNlcjpwYXNz"),
            ("X-Session-Id", "abcdef"),
            ("Idempotency-Key", "ballast-i-1-submit-0"),
            ("Content-Type", "application/json"),
            ("X-Echo", "key is sk-live-123456"),
        ]);
        let out = Outgoing {
            method: "POST",
            url: "https://api.example.com/v1/jobs",
            headers,
            body: Some(r#"{"prompt":"hi","key":"sk-live-123456"}"#.to_owned()),
        };
        let sent = SentRequest::of(out, &["x-provider-auth"], &["sk-live-123456"]);
        assert_eq!(
            sent.headers,
            h(&[
                ("X-Provider-Auth", REDACTED),
                ("Authorization", REDACTED),
                ("X-Session-Id", REDACTED),
                ("Idempotency-Key", "ballast-i-1-submit-0"),
                ("Content-Type", "application/json"),
                ("X-Echo", "key is [redacted]"),
            ])
        );
        assert_eq!(
            sent.body.as_deref(),
            Some(r#"{"prompt":"hi","key":"[redacted]"}"#)
        );
        assert_eq!(sent.method, "POST");
        let back = SentRequest::from_stored(&sent.to_stored());
        assert_eq!(back.as_ref(), Some(&sent));
    }

    #[test]
    fn urls_lose_their_credentials_only() {
        assert_eq!(
            redact_url(
                "https://u:pw@api.example.com/v1/jobs?api_key=abc&page=2&X-Amz-Signature=ff#top"
            ),
            "https://u:[redacted]@api.example.com/v1/jobs?api_key=[redacted]&page=2&X-Amz-Signature=[redacted]#top"
        );
        assert_eq!(
            redact_url("https://api.example.com/v1/jobs/7?access%5Ftoken=t&flag&sig=1"),
            "https://api.example.com/v1/jobs/7?access%5Ftoken=[redacted]&flag&sig=[redacted]"
        );
        assert_eq!(
            redact_url("http://127.0.0.1:8080/jobs?id=5"),
            "http://127.0.0.1:8080/jobs?id=5"
        );
        assert_eq!(
            redact_url("https://tok@api.example.com/x"),
            "https://[redacted]@api.example.com/x"
        );
    }

    #[test]
    fn a_secret_anywhere_in_the_url_or_body_is_removed_and_the_body_is_cut() {
        let long = format!("{}sk-live-123456", "a".repeat(EXCERPT_MAX_BYTES));
        let out = Outgoing {
            method: "GET",
            url: "https://api.example.com/v1/sk-live-123456/jobs",
            headers: Vec::new(),
            body: Some(long),
        };
        let sent = SentRequest::of(out, &[], &["sk-live-123456"]);
        assert_eq!(sent.url, "https://api.example.com/v1/[redacted]/jobs");
        let body = sent.body.unwrap_or_default();
        assert_eq!(body.len(), EXCERPT_MAX_BYTES);
        assert!(!body.contains("sk-live"));
    }

    /// The body is cleaned whole before it is cut: a secret across the cut
    /// leaves no piece of it, and the cut falls on a character's boundary.
    /// A NUL becomes U+FFFD in a header, the URL and the body.
    #[test]
    fn a_body_is_cleaned_before_it_is_cut() {
        let key = "sk-live-123456";
        let across = format!("{}{key}", "a".repeat(EXCERPT_MAX_BYTES - 7));
        let kept = |body: String, headers: Vec<(String, String)>| {
            let out = Outgoing {
                method: "POST",
                url: "https://api.example.com/v1/\0",
                headers,
                body: Some(body),
            };
            SentRequest::of(out, &[], &[key])
        };
        let body = kept(across, Vec::new()).body.unwrap_or_default();
        assert_eq!(body.len(), EXCERPT_MAX_BYTES);
        assert!(!body.contains("sk-live"), "{}", &body[body.len() - 12..]);
        let wide = format!("a{}", "é".repeat(EXCERPT_MAX_BYTES));
        let body = kept(wide.clone(), Vec::new()).body.unwrap_or_default();
        assert_eq!(body.len(), EXCERPT_MAX_BYTES - 1);
        assert!(wide.starts_with(&body));
        let sent = kept("x\0y".into(), h(&[("X-Note", "a\0b")]));
        assert_eq!(sent.headers, h(&[("X-Note", "a\u{FFFD}b")]));
        assert_eq!(sent.url, "https://api.example.com/v1/\u{FFFD}");
        assert_eq!(sent.body.as_deref(), Some("x\u{FFFD}y"));
    }

    proptest::proptest! {
        /// Compared in place, a name is read as it was lower-cased first.
        #[test]
        fn header_names_read_in_place_as_lower_cased(
            name in "(?i)(x-|idempotency-key|api-?key|token|secret|cookie|[a-zA-Zé_-]){0,5}",
        ) {
            let n = name.to_ascii_lowercase();
            let was = n != "idempotency-key"
                && (CREDENTIAL_HEADERS.contains(&n.as_str())
                    || CREDENTIAL_HEADER_PARTS.iter().any(|p| n.contains(p)));
            proptest::prop_assert_eq!(is_credential_header(&name), was, "{}", name);
        }
    }

    #[test]
    fn names_are_matched_without_case_or_separators() {
        for n in [
            "Cookie",
            "X-API-KEY",
            "x-auth-token",
            "X-Client-Secret",
            "X-Goog-Api-Key",
            "Ocp-Apim-Subscription-Key",
        ] {
            assert!(is_credential_header(n), "{n}");
        }
        for n in ["Accept", "Content-Type", "Idempotency-Key", "X-Request-Id"] {
            assert!(!is_credential_header(n), "{n}");
        }
        for n in ["key", "API-Key", "apiKey", "client_secret", "Signature"] {
            assert!(is_credential_param(n), "{n}");
        }
        for n in ["id", "page", "monkey_count", "job_id"] {
            assert!(!is_credential_param(n), "{n}");
        }
    }
}
