//! Reply classification: a provider's ordered rules turn any reply (a status,
//! a JSON body, or a transport failure) into an [`Outcome`] and a stable
//! error code. First match wins; nothing matched is `unknown`. Total: there
//! is no reply this function cannot classify.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use super::model::Outcome;

/// A failure before a usable HTTP reply, or a reply body we cannot read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplyError {
    /// No answer within the attempt's timeout.
    Timeout,
    /// Could not connect (refused, DNS, unreachable).
    Connect,
    /// The connection broke mid-exchange.
    Reset,
    /// TLS handshake or certificate failure.
    Tls,
    /// The body exceeded the size limit.
    BodyTooLarge,
    /// The body is not JSON (an HTML error page, a truncated document).
    BodyNotJson,
    /// The body is empty (where a document was expected).
    BodyEmpty,
    /// The body is not UTF-8 text, so it cannot be JSON either.
    BodyNotUtf8,
    /// The body does not decode in its `Content-Encoding` (a corrupt or
    /// truncated gzip stream).
    BodyBadEncoding,
}

impl ReplyError {
    pub const ALL: [ReplyError; 9] = [
        ReplyError::Timeout,
        ReplyError::Connect,
        ReplyError::Reset,
        ReplyError::Tls,
        ReplyError::BodyTooLarge,
        ReplyError::BodyNotJson,
        ReplyError::BodyEmpty,
        ReplyError::BodyNotUtf8,
        ReplyError::BodyBadEncoding,
    ];

    /// Whether a rule naming `self` matches `actual`: a rule written for
    /// `body_not_json` (before empty and non-UTF-8 bodies had their own
    /// names) still matches them, as none of them is JSON.
    pub fn covers(self, actual: ReplyError) -> bool {
        self == actual
            || (self == ReplyError::BodyNotJson
                && matches!(actual, ReplyError::BodyEmpty | ReplyError::BodyNotUtf8))
    }

    /// The name used in rules (`when = { error = "timeout" }`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReplyError::Timeout => "timeout",
            ReplyError::Connect => "connect",
            ReplyError::Reset => "reset",
            ReplyError::Tls => "tls",
            ReplyError::BodyTooLarge => "body_too_large",
            ReplyError::BodyNotJson => "body_not_json",
            ReplyError::BodyEmpty => "body_empty",
            ReplyError::BodyNotUtf8 => "body_not_utf8",
            ReplyError::BodyBadEncoding => "body_bad_encoding",
        }
    }

    /// The stable error code stored with the attempt.
    pub fn code(self) -> &'static str {
        match self {
            ReplyError::Timeout => "provider_timeout",
            ReplyError::Connect => "connect_failed",
            ReplyError::Reset => "connection_reset",
            ReplyError::Tls => "tls_error",
            ReplyError::BodyTooLarge => "body_too_large",
            ReplyError::BodyNotJson => "body_not_json",
            ReplyError::BodyEmpty => "body_empty",
            ReplyError::BodyNotUtf8 => "body_not_utf8",
            ReplyError::BodyBadEncoding => "body_bad_encoding",
        }
    }
}

impl FromStr for ReplyError {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReplyError::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<_> = ReplyError::ALL.iter().map(|e| e.as_str()).collect();
                format!(
                    "unknown error class `{s}`, expected one of {}",
                    names.join(", ")
                )
            })
    }
}

/// What came back from one attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// An HTTP reply. `json` is the parsed body when it is JSON; `body_error`
    /// says why the body is unusable (too large, not JSON) when it is.
    Http {
        status: u16,
        json: Option<Value>,
        body_error: Option<ReplyError>,
        /// The reply named a pause (a `Retry-After` that parses).
        retry_after: bool,
    },
    /// No usable HTTP reply at all.
    Failed(ReplyError),
}

/// `"2xx"`, `"429"` or `404`: a status class or one code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    Class(u8),
    Code(u16),
}

impl StatusMatch {
    pub fn matches(self, status: u16) -> bool {
        match self {
            StatusMatch::Class(c) => status / 100 == u16::from(c),
            StatusMatch::Code(code) => status == code,
        }
    }
}

impl FromStr for StatusMatch {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad =
            || format!("invalid status `{s}`: expected a code like `429` or a class like `5xx`");
        let b = s.as_bytes();
        if b.len() == 3 && b[1..].eq_ignore_ascii_case(b"xx") && (b'1'..=b'5').contains(&b[0]) {
            return Ok(StatusMatch::Class(b[0] - b'0'));
        }
        let code: u16 = s.parse().map_err(|_| bad())?;
        if (100..=599).contains(&code) {
            Ok(StatusMatch::Code(code))
        } else {
            Err(bad())
        }
    }
}

impl fmt::Display for StatusMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusMatch::Class(c) => write!(f, "{c}xx"),
            StatusMatch::Code(c) => write!(f, "{c}"),
        }
    }
}

impl<'de> Deserialize<'de> for StatusMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Int(i) => i.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A test on one JSON field of the body.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldTest {
    Equals(Value),
    In(Vec<Value>),
    Exists(bool),
}

/// When a rule applies: every condition given must hold.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct When {
    pub status: Vec<StatusMatch>,
    pub error: Vec<ReplyError>,
    /// A JSON pointer into the body and its test.
    pub field: Option<(String, FieldTest)>,
    /// Whether the reply must (or must not) name a pause.
    pub retry_after: Option<bool>,
}

/// One reply rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub when: When,
    pub outcome: Outcome,
}

impl When {
    fn matches(&self, reply: &Reply) -> bool {
        let (status, json, error, paused) = match reply {
            Reply::Http {
                status,
                json,
                body_error,
                retry_after,
            } => (
                Some(*status),
                json.as_ref(),
                *body_error,
                Some(*retry_after),
            ),
            Reply::Failed(e) => (None, None, Some(*e), None),
        };
        if self.retry_after.is_some() && paused != self.retry_after {
            return false;
        }
        if !self.status.is_empty()
            && !status.is_some_and(|s| self.status.iter().any(|m| m.matches(s)))
        {
            return false;
        }
        if !self.error.is_empty() && !error.is_some_and(|e| self.error.iter().any(|w| w.covers(e)))
        {
            return false;
        }
        if let Some((pointer, test)) = &self.field {
            let found = json.and_then(|j| super::pointer::get(j, pointer));
            let ok = match test {
                FieldTest::Exists(want) => found.is_some() == *want,
                FieldTest::Equals(v) => found == Some(v),
                FieldTest::In(vs) => found.is_some_and(|f| vs.contains(f)),
            };
            if !ok {
                return false;
            }
        }
        true
    }
}

/// The rules every provider gets after its own (unless it opts out): a
/// 429, and a 503 that names a pause, are the provider saying "slow down"
/// (throttled: no attempt spent); transport failures and overload are
/// worth retrying; anything else the operator did not describe stays
/// `unknown`.
pub fn default_rules() -> Vec<Rule> {
    let retry = |when| Rule {
        when,
        outcome: Outcome::Retry,
    };
    vec![
        Rule {
            when: When {
                status: vec![StatusMatch::Code(429)],
                ..When::default()
            },
            outcome: Outcome::Throttled,
        },
        Rule {
            when: When {
                status: vec![StatusMatch::Code(503)],
                retry_after: Some(true),
                ..When::default()
            },
            outcome: Outcome::Throttled,
        },
        retry(When {
            error: vec![ReplyError::Timeout, ReplyError::Connect, ReplyError::Reset],
            ..When::default()
        }),
        retry(When {
            status: vec![StatusMatch::Code(408)],
            ..When::default()
        }),
        retry(When {
            status: vec![StatusMatch::Class(5)],
            ..When::default()
        }),
    ]
}

/// The verdict on one reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    pub outcome: Outcome,
    /// Index of the rule that matched (`None`: nothing did).
    pub rule: Option<usize>,
    /// Stable code for anything but success and half-states.
    pub error_code: Option<&'static str>,
}

/// Classifies `reply` with `rules`, first match wins.
pub fn classify(rules: &[Rule], reply: &Reply) -> Classification {
    let (rule, outcome) = rules
        .iter()
        .enumerate()
        .find(|(_, r)| r.when.matches(reply))
        .map_or((None, Outcome::Unknown), |(i, r)| (Some(i), r.outcome));
    let error_code = match outcome {
        Outcome::Success | Outcome::Pending => None,
        Outcome::Unknown if rule.is_none() => Some(match reply {
            Reply::Failed(e) => e.code(),
            Reply::Http { status, .. } if is_redirect(*status) => "redirect",
            Reply::Http {
                body_error: Some(e),
                ..
            } => e.code(),
            Reply::Http { .. } => "unknown_reply",
        }),
        _ => Some(reply_code(reply)),
    };
    Classification {
        outcome,
        rule,
        error_code,
    }
}

/// A status that sends the client elsewhere (`Location`): 301, 302, 303,
/// 307, 308. Not 300 (choices), 304 (not modified) nor 305.
pub fn is_redirect(status: u16) -> bool {
    matches!(status, 301 | 302 | 303 | 307 | 308)
}

/// The stable code describing a non-success reply.
pub fn reply_code(reply: &Reply) -> &'static str {
    match reply {
        Reply::Failed(e) => e.code(),
        Reply::Http {
            body_error: Some(e),
            status,
            ..
        } if (200..300).contains(status) => e.code(),
        Reply::Http { status: 429, .. } => "rate_limited",
        Reply::Http { status, .. } if is_redirect(*status) => "redirect",
        Reply::Http { status, .. } if (500..600).contains(status) => "provider_5xx",
        Reply::Http { status, .. } if (400..500).contains(status) => "provider_4xx",
        Reply::Http {
            body_error: Some(e),
            ..
        } => e.code(),
        Reply::Http { .. } => "provider_rejected",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn http(status: u16, body: Value) -> Reply {
        Reply::Http {
            status,
            json: Some(body),
            body_error: None,
            retry_after: false,
        }
    }

    fn renderer_rules() -> Vec<Rule> {
        let mut rules = vec![
            Rule {
                when: When {
                    status: vec![StatusMatch::Class(2)],
                    field: Some((
                        "/status".into(),
                        FieldTest::In(vec![json!("queued"), json!("running")]),
                    )),
                    ..When::default()
                },
                outcome: Outcome::Pending,
            },
            Rule {
                when: When {
                    status: vec![StatusMatch::Class(2)],
                    field: Some(("/status".into(), FieldTest::Equals(json!("succeeded")))),
                    ..When::default()
                },
                outcome: Outcome::Success,
            },
            Rule {
                when: When {
                    status: vec![StatusMatch::Class(4)],
                    ..When::default()
                },
                outcome: Outcome::Fail,
            },
        ];
        rules.extend(default_rules());
        rules
    }

    #[test]
    fn a_429_is_throttled_by_default_and_keeps_its_code() {
        let c = classify(&default_rules(), &http(429, json!({})));
        assert_eq!(
            (c.outcome, c.error_code),
            (Outcome::Throttled, Some("rate_limited"))
        );
        let c = classify(&default_rules(), &http(503, json!({})));
        assert_eq!(c.outcome, Outcome::Retry, "a 503 naming no pause");
        let paused = Reply::Http {
            status: 503,
            json: Some(json!({})),
            body_error: None,
            retry_after: true,
        };
        let c = classify(&default_rules(), &paused);
        assert_eq!(
            (c.outcome, c.error_code),
            (Outcome::Throttled, Some("provider_5xx"))
        );
        let c = classify(&default_rules(), &http(408, json!({})));
        assert_eq!(c.outcome, Outcome::Retry);
    }

    #[test]
    fn first_match_wins_and_the_rest_is_unknown() {
        let rules = renderer_rules();
        let c = |r: &Reply| classify(&rules, r);
        assert_eq!(
            c(&http(200, json!({"status": "queued"}))).outcome,
            Outcome::Pending
        );
        assert_eq!(
            c(&http(200, json!({"status": "succeeded"}))).outcome,
            Outcome::Success
        );
        assert_eq!(
            c(&http(200, json!({"status": "succeeded"}))).error_code,
            None
        );
        // 429 is a 4xx, but the fail rule comes first: order matters.
        assert_eq!(c(&http(429, json!({}))).outcome, Outcome::Fail);
        assert_eq!(c(&http(503, json!({}))).outcome, Outcome::Retry);
        assert_eq!(c(&http(503, json!({}))).error_code, Some("provider_5xx"));
        let weird = c(&http(200, json!({"status": "exploded"})));
        assert_eq!(
            (weird.outcome, weird.rule, weird.error_code),
            (Outcome::Unknown, None, Some("unknown_reply"))
        );
        let html = Reply::Http {
            status: 200,
            json: None,
            body_error: Some(ReplyError::BodyNotJson),
            retry_after: false,
        };
        assert_eq!(c(&html).error_code, Some("body_not_json"));
        // Empty and non-UTF-8 bodies have their own codes, and a rule for
        // `body_not_json` (written before they did) still matches them.
        let empty = Reply::Http {
            status: 200,
            json: None,
            body_error: Some(ReplyError::BodyEmpty),
            retry_after: false,
        };
        assert_eq!(c(&empty).error_code, Some("body_empty"));
        let not_json_rule = Rule {
            when: When {
                error: vec![ReplyError::BodyNotJson],
                ..When::default()
            },
            outcome: Outcome::Fail,
        };
        assert!(not_json_rule.when.matches(&empty));
        let utf8_rule = Rule {
            when: When {
                error: vec![ReplyError::BodyNotUtf8],
                ..When::default()
            },
            outcome: Outcome::Fail,
        };
        assert!(!utf8_rule.when.matches(&empty), "only its own error");
        assert_eq!(
            c(&Reply::Failed(ReplyError::Timeout)).outcome,
            Outcome::Retry
        );
        assert_eq!(
            c(&Reply::Failed(ReplyError::Timeout)).error_code,
            Some("provider_timeout")
        );
        assert_eq!(c(&Reply::Failed(ReplyError::Tls)).outcome, Outcome::Unknown);
    }

    #[test]
    fn status_patterns_parse() {
        assert_eq!("5xx".parse(), Ok(StatusMatch::Class(5)));
        assert_eq!("2XX".parse(), Ok(StatusMatch::Class(2)));
        assert_eq!("429".parse(), Ok(StatusMatch::Code(429)));
        for bad in ["6xx", "99", "600", "2x", "abc", ""] {
            assert!(bad.parse::<StatusMatch>().is_err(), "{bad}");
        }
    }

    fn any_reply() -> impl Strategy<Value = Reply> {
        let json = prop_oneof![
            Just(None),
            Just(Some(json!({"status": "queued"}))),
            Just(Some(json!({"status": "succeeded", "id": 3}))),
            Just(Some(json!([1, 2]))),
            Just(Some(json!(null))),
        ];
        let error = proptest::option::of(proptest::sample::select(ReplyError::ALL.to_vec()));
        prop_oneof![
            (0u16..1000, json, error, any::<bool>()).prop_map(
                |(status, json, body_error, retry_after)| Reply::Http {
                    status,
                    json,
                    body_error,
                    retry_after,
                }
            ),
            proptest::sample::select(ReplyError::ALL.to_vec()).prop_map(Reply::Failed),
        ]
    }

    proptest! {
        /// Every reply gets an outcome; failures always carry a code; a
        /// matched rule's outcome is the one returned.
        #[test]
        fn every_reply_is_classified(reply in any_reply(), with_rules in any::<bool>()) {
            let rules = if with_rules { renderer_rules() } else { Vec::new() };
            let c = classify(&rules, &reply);
            match c.rule {
                Some(i) => prop_assert_eq!(rules[i].outcome, c.outcome),
                None => prop_assert_eq!(c.outcome, Outcome::Unknown),
            }
            let failing = !matches!(c.outcome, Outcome::Success | Outcome::Pending);
            prop_assert_eq!(c.error_code.is_some(), failing);
        }
    }
}
