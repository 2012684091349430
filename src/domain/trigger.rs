//! Triggers (`[triggers.NAME]`, `POST /triggers/NAME`): what an incoming
//! event is (its id and type, read from the body or a header), which
//! events start a record, and the verdict each delivery gets, with its
//! status and stable code. The signatures are `auth::webhook` and
//! `auth::presets`; the endpoint is `web::triggers`.

use serde::Deserialize;
use serde_json::Value;

/// How a sender signs, and where its events keep their id and type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// `Stripe-Signature: t=<unix>,v1=<hex>`; the event's `/id` and `/type`.
    Stripe,
    /// `X-Hub-Signature-256: sha256=<hex>`; `X-GitHub-Delivery` and
    /// `X-GitHub-Event`.
    Github,
    /// `webhook-id`, `webhook-timestamp`, `webhook-signature`; the id is
    /// `webhook-id`, the type the body's `/type`.
    StandardWebhooks,
    /// A hex or base64 HMAC-SHA256 of the body in a named header.
    Hmac,
}

impl Preset {
    pub fn as_str(self) -> &'static str {
        match self {
            Preset::Stripe => "stripe",
            Preset::Github => "github",
            Preset::StandardWebhooks => "standard_webhooks",
            Preset::Hmac => "hmac",
        }
    }

    /// What its signature header looks like, for a refusal's message.
    pub fn expects(self) -> &'static str {
        match self {
            Preset::Stripe => "Stripe-Signature: t=<unix seconds>,v1=<hex>",
            Preset::Github => "X-Hub-Signature-256: sha256=<hex>",
            Preset::StandardWebhooks => {
                "webhook-id, webhook-timestamp (unix seconds) and webhook-signature: v1,<base64>"
            }
            Preset::Hmac => "the configured header: the HMAC-SHA256 of the body",
        }
    }

    /// Where its events' ids are, unless configured.
    pub fn id_source(self) -> Option<Source> {
        match self {
            Preset::Stripe => Some(Source::Pointer("/id".into())),
            Preset::Github => Some(Source::Header("x-github-delivery".into())),
            Preset::StandardWebhooks => Some(Source::Header("webhook-id".into())),
            Preset::Hmac => None,
        }
    }

    /// Where its events' types are, unless configured.
    pub fn type_source(self) -> Option<Source> {
        match self {
            Preset::Stripe | Preset::StandardWebhooks => Some(Source::Pointer("/type".into())),
            Preset::Github => Some(Source::Header("x-github-event".into())),
            Preset::Hmac => None,
        }
    }
}

/// Where a value of an event is: a JSON pointer into its body, or a
/// header (`header:NAME`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Pointer(String),
    Header(String),
}

impl Source {
    /// `/a/b` or `header:NAME`.
    pub fn parse(text: &str) -> Result<Source, String> {
        if let Some(h) = text.strip_prefix("header:") {
            let h = h.trim();
            if h.is_empty()
                || !h
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(format!(
                    "`{text}`: `header:` names a header (`header:X-Event-Id`)"
                ));
            }
            return Ok(Source::Header(h.to_ascii_lowercase()));
        }
        if text.starts_with('/') {
            return Ok(Source::Pointer(text.to_owned()));
        }
        Err(format!(
            "`{text}` is neither a JSON pointer (`/id`) nor `header:NAME`"
        ))
    }

    /// The value there, as text: a string as it is, a number or a boolean
    /// written out; nothing for anything else, or an empty string.
    pub fn read(&self, body: &Value, header: &dyn Fn(&str) -> Option<String>) -> Option<String> {
        let text = match self {
            Source::Header(name) => header(name),
            Source::Pointer(p) => match body.pointer(p)? {
                Value::String(s) => Some(s.clone()),
                v @ (Value::Number(_) | Value::Bool(_)) => Some(v.to_string()),
                _ => None,
            },
        };
        text.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty())
    }
}

/// Whether a trigger's name can be a path segment as it is.
pub fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Whether event type `ty` is one `pattern` names: the same, or its
/// start when the pattern ends in `*`.
pub fn matches(pattern: &str, ty: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(start) => ty.starts_with(start),
        None => pattern == ty,
    }
}

/// What a verified event of type `ty` does: ignored when `ignore` names
/// it (first, so that `ignore` can carve out of a wide `accept`), enqueued
/// when `accept` names it or is empty, else unmapped.
pub fn route(accept: &[String], ignore: &[String], ty: &str) -> Verdict {
    if ignore.iter().any(|p| matches(p, ty)) {
        Verdict::Ignored
    } else if accept.is_empty() || accept.iter().any(|p| matches(p, ty)) {
        Verdict::Enqueued
    } else {
        Verdict::Unmapped
    }
}

/// The start of every trigger's record keys (refused to other callers,
/// so nobody can take an event's record first).
pub const KEY_PREFIX: &str = "trigger:";

/// The longest record key: an event id that would make it longer is
/// refused.
pub const MAX_KEY: usize = 200;

/// The record key of event `id` of trigger `name`: triggers into one
/// pipeline never share keys, and a sender's retry names the same record.
pub fn record_key(name: &str, id: &str) -> String {
    format!("{KEY_PREFIX}{name}:{id}")
}

/// Whether `preset` signs the place `source` reads: every preset signs
/// the body; of the headers, only Standard Webhooks' `webhook-id` (and
/// its timestamp) are signed. An id read from an unsigned header cannot
/// name the record (a captured delivery, sent again with another id, would
/// make another), so the body's digest does.
pub fn signs(preset: Preset, source: &Source) -> bool {
    match source {
        Source::Pointer(_) => true,
        Source::Header(h) => preset == Preset::StandardWebhooks && h == "webhook-id",
    }
}

/// `text` cut to its first `max` characters (what is kept and shown of a
/// value a sender chose).
pub fn cut(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// What became of a delivery: its answer's status and stable code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A new record (201).
    Enqueued,
    /// Its id named a record already made: the sender's retry (200).
    Duplicate,
    /// A type the trigger is told to ignore (200).
    Ignored,
    /// Signature header missing or unreadable (401).
    Malformed,
    /// Signed too long ago or ahead (401).
    Stale,
    /// No secret made the signature (401).
    BadSignature,
    /// The body is not JSON (400).
    NotJson,
    /// The event has no id where the trigger reads it (400).
    NoId,
    /// A type neither accepted nor ignored (422).
    Unmapped,
    /// The record could not be made from it: its key, group or input
    /// refused (422).
    Refused,
    /// The database failed; the sender should retry (503).
    Failed,
}

impl Verdict {
    pub const ALL: [Verdict; 11] = [
        Verdict::Enqueued,
        Verdict::Duplicate,
        Verdict::Ignored,
        Verdict::Malformed,
        Verdict::Stale,
        Verdict::BadSignature,
        Verdict::NotJson,
        Verdict::NoId,
        Verdict::Unmapped,
        Verdict::Refused,
        Verdict::Failed,
    ];

    pub fn code(self) -> &'static str {
        match self {
            Verdict::Enqueued => "enqueued",
            Verdict::Duplicate => "duplicate",
            Verdict::Ignored => "ignored",
            Verdict::Malformed => "bad_signature_header",
            Verdict::Stale => "stale_signature",
            Verdict::BadSignature => "bad_signature",
            Verdict::NotJson => "body_not_json",
            Verdict::NoId => "no_event_id",
            Verdict::Unmapped => "unmapped_event",
            Verdict::Refused => "event_refused",
            Verdict::Failed => "unavailable",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            Verdict::Enqueued => 201,
            Verdict::Duplicate | Verdict::Ignored => 200,
            Verdict::Malformed | Verdict::Stale | Verdict::BadSignature => 401,
            Verdict::NotJson | Verdict::NoId => 400,
            Verdict::Unmapped | Verdict::Refused => 422,
            Verdict::Failed => 503,
        }
    }

    pub fn parse(code: &str) -> Option<Verdict> {
        Verdict::ALL.into_iter().find(|v| v.code() == code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn types_route_ignore_first_then_accept() {
        let accept = vec!["checkout.*".to_owned(), "charge.refunded".to_owned()];
        let ignore = vec!["checkout.session.expired".to_owned()];
        assert_eq!(
            route(&accept, &ignore, "checkout.session.completed"),
            Verdict::Enqueued
        );
        assert_eq!(
            route(&accept, &ignore, "charge.refunded"),
            Verdict::Enqueued
        );
        assert_eq!(
            route(&accept, &ignore, "checkout.session.expired"),
            Verdict::Ignored
        );
        assert_eq!(
            route(&accept, &ignore, "charge.refunded.x"),
            Verdict::Unmapped
        );
        assert_eq!(route(&[], &ignore, "anything"), Verdict::Enqueued);
        assert_eq!(route(&[], &["*".to_owned()], "anything"), Verdict::Ignored);
    }

    #[test]
    fn sources_read_body_and_headers() {
        let body = json!({"id": "evt_1", "n": 7, "data": {"o": {"x": true}}, "blank": " "});
        let headers = |h: &str| (h == "x-id").then(|| " d-1 ".to_owned());
        let read = |s: &str| Source::parse(s).unwrap().read(&body, &headers);
        assert_eq!(read("/id").as_deref(), Some("evt_1"));
        assert_eq!(read("/n").as_deref(), Some("7"));
        assert_eq!(read("/data/o/x").as_deref(), Some("true"));
        assert_eq!(read("/data"), None, "an object is no id");
        assert_eq!(read("/blank"), None);
        assert_eq!(read("/missing"), None);
        assert_eq!(read("header:X-Id").as_deref(), Some("d-1"));
        assert!(Source::parse("id").is_err());
        assert!(Source::parse("header:").is_err());
        assert!(Source::parse("header:a b").is_err());
    }

    #[test]
    fn only_signed_places_name_records() {
        let id = |s: &str| Source::parse(s).unwrap();
        assert!(signs(Preset::Github, &id("/id")));
        assert!(!signs(Preset::Github, &id("header:X-GitHub-Delivery")));
        assert!(signs(Preset::StandardWebhooks, &id("header:webhook-id")));
        assert!(!signs(Preset::StandardWebhooks, &id("header:x-id")));
        assert!(!signs(Preset::Hmac, &id("header:x-id")));
        assert_eq!(record_key("gh", "d-1"), "trigger:gh:d-1");
        assert_eq!(cut("ééé", 2), "éé");
    }

    #[test]
    fn every_verdict_has_its_own_code() {
        for v in Verdict::ALL {
            assert_eq!(Verdict::parse(v.code()), Some(v));
        }
        assert!(is_name("stripe_paid-2") && !is_name("Stripe") && !is_name("a/b"));
    }
}
