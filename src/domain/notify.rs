//! Notifications out (`[[notify]]`): which changes are news, which
//! subscription wants each, the body sent, and when a failing subscription
//! is turned off. The store writes a notice per wanting subscription in the
//! transaction of the change it reports (an outbox); the notifier
//! (`engine::notify`) delivers them.

use std::fmt;
use std::str::FromStr;

use serde_json::{Value, json};

use super::{BreakerState, RecordState, UnixMs};

/// What a notice reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topic {
    RecordSucceeded,
    RecordFailed,
    RecordCancelled,
    RecordParked,
    /// Parked because a call's outcome is not known (`outcome_uncertain`):
    /// said instead of `record.parked`.
    RecordOutcomeUncertain,
    /// A provider contradicted a result already handled (whatever its
    /// reversal policy did).
    RecordReversed,
    /// Left a resting state (an operator's retry, resume, replay …, or a
    /// parked record's condition held).
    RecordResumed,
    ProviderBreakerOpened,
    ProviderBreakerClosed,
    ProviderPaused,
    ProviderResumed,
}

impl Topic {
    pub const ALL: [Topic; 11] = [
        Topic::RecordSucceeded,
        Topic::RecordFailed,
        Topic::RecordCancelled,
        Topic::RecordParked,
        Topic::RecordOutcomeUncertain,
        Topic::RecordReversed,
        Topic::RecordResumed,
        Topic::ProviderBreakerOpened,
        Topic::ProviderBreakerClosed,
        Topic::ProviderPaused,
        Topic::ProviderResumed,
    ];

    /// The event type sent (`type` in the body).
    pub fn as_str(self) -> &'static str {
        match self {
            Topic::RecordSucceeded => "record.succeeded",
            Topic::RecordFailed => "record.failed",
            Topic::RecordCancelled => "record.cancelled",
            Topic::RecordParked => "record.parked",
            Topic::RecordOutcomeUncertain => "record.outcome_uncertain",
            Topic::RecordReversed => "record.reversed",
            Topic::RecordResumed => "record.resumed",
            Topic::ProviderBreakerOpened => "provider.breaker_opened",
            Topic::ProviderBreakerClosed => "provider.breaker_closed",
            Topic::ProviderPaused => "provider.paused",
            Topic::ProviderResumed => "provider.resumed",
        }
    }

    /// Whether it is about a provider (else a record).
    pub fn is_provider(self) -> bool {
        self.as_str().starts_with("provider.")
    }
}

impl fmt::Display for Topic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Topic {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Topic::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| format!("unknown event type `{s}`"))
    }
}

/// What a record's change (an event of `kind`, from one state to another)
/// reports, if anything; `error_code` is the record's after the change.
pub fn record_topic(
    kind: &str,
    from: Option<RecordState>,
    to: Option<RecordState>,
    error_code: Option<&str>,
) -> Option<Topic> {
    if kind == crate::domain::Trigger::Reversed(crate::domain::ReversalPolicy::Record).kind() {
        return Some(Topic::RecordReversed);
    }
    let (from, to) = (from?, to?);
    if from == to {
        return None;
    }
    match to {
        RecordState::Succeeded => Some(Topic::RecordSucceeded),
        RecordState::Failed => Some(Topic::RecordFailed),
        RecordState::Cancelled => Some(Topic::RecordCancelled),
        RecordState::Parked if error_code == Some(super::OUTCOME_UNCERTAIN) => {
            Some(Topic::RecordOutcomeUncertain)
        }
        RecordState::Parked => Some(Topic::RecordParked),
        _ if from.is_at_rest() => Some(Topic::RecordResumed),
        _ => None,
    }
}

/// What a change of a provider's shared breaker reports: opened from
/// closed (not again after each failed probe), and closed.
pub fn breaker_topic(before: BreakerState, after: BreakerState) -> Option<Topic> {
    match (before, after) {
        (BreakerState::Closed, BreakerState::Open) => Some(Topic::ProviderBreakerOpened),
        (BreakerState::Open | BreakerState::HalfOpen, BreakerState::Closed) => {
            Some(Topic::ProviderBreakerClosed)
        }
        _ => None,
    }
}

/// What an operator's pause or resume of a provider reports.
pub fn pause_topic(paused: bool) -> Topic {
    if paused {
        Topic::ProviderPaused
    } else {
        Topic::ProviderResumed
    }
}

/// What a subscription wants: event types (a trailing `*` matches any
/// rest), and, for records, pipelines and groups; for providers, provider
/// names. An empty list of names wants every one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub name: String,
    pub events: Vec<String>,
    pub pipelines: Vec<String>,
    pub groups: Vec<String>,
    pub providers: Vec<String>,
}

/// What a notice is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    Record {
        id: i64,
        key: String,
        pipeline: String,
        group: Option<String>,
        priority: u8,
    },
    Provider(String),
}

impl Subject {
    /// Its notices go out in order: one at a time per subscription and
    /// subject.
    pub fn key(&self) -> String {
        match self {
            Subject::Record { id, .. } => format!("record:{id}"),
            Subject::Provider(name) => format!("provider:{name}"),
        }
    }
}

impl Filter {
    /// Whether it wants notices of `topic` at all.
    pub fn wants_topic(&self, topic: Topic) -> bool {
        self.events
            .iter()
            .any(|p| super::trigger::matches(p, topic.as_str()))
    }

    /// Whether it wants this notice.
    pub fn wants(&self, topic: Topic, subject: &Subject) -> bool {
        let named = |list: &[String], name: Option<&str>| {
            list.is_empty() || name.is_some_and(|n| list.iter().any(|l| l == n))
        };
        self.wants_topic(topic)
            && match subject {
                Subject::Record {
                    pipeline, group, ..
                } => {
                    named(&self.pipelines, Some(pipeline)) && named(&self.groups, group.as_deref())
                }
                Subject::Provider(name) => named(&self.providers, Some(name)),
            }
    }
}

/// What a notice says beside its type: the record (id, key, pipeline,
/// group, priority, the state it left and the one it is in), or the
/// provider, and the change (its event kind, step, reason, who).
pub struct Change<'a> {
    pub kind: &'a str,
    pub actor: &'a str,
    pub from: Option<RecordState>,
    pub to: Option<RecordState>,
    pub step: Option<&'a str>,
    pub reason: Option<&'a str>,
}

/// The notice's `data`: thin on purpose (no input or output: a subscriber
/// that wants them reads the record through the API with its own token).
pub fn data(subject: &Subject, c: &Change<'_>) -> Value {
    let about = match subject {
        Subject::Record {
            id,
            key,
            pipeline,
            group,
            priority,
        } => json!({ "record": {
            "id": id, "key": key, "pipeline": pipeline, "group": group, "priority": priority,
            "state": c.to.map(RecordState::as_str),
            "previous_state": c.from.map(RecordState::as_str),
        }}),
        Subject::Provider(name) => json!({ "provider": { "name": name } }),
    };
    let mut v = about;
    if let Value::Object(m) = &mut v {
        m.insert("event".into(), json!(c.kind));
        m.insert("actor".into(), json!(c.actor));
        m.insert("step".into(), json!(c.step));
        m.insert("reason".into(), json!(c.reason));
    }
    v
}

/// A notice's body as Standard Webhooks recommends: its type, when the
/// change happened (RFC 3339), and its data.
pub fn body(topic: &str, at: UnixMs, data: &Value) -> Value {
    json!({ "type": topic, "timestamp": super::time::format_ms(at), "data": data })
}

/// `text` as Slack shows it, not as markup: `&`, `<` and `>` escaped (a
/// key or reason holding `<!channel>` or `<url|label>` stays text).
fn slack_text(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A notice's body for a Slack-compatible incoming webhook: one line of
/// text, what came from records and providers escaped.
pub fn slack_body(topic: &str, at: UnixMs, data: &Value) -> Value {
    let s = |p: &str| data.pointer(p).and_then(Value::as_str).map(slack_text);
    let what = match data.pointer("/record/id").and_then(Value::as_i64) {
        Some(id) => {
            let mut t = format!(
                "Record {id} (`{}`, pipeline `{}`",
                s("/record/key").unwrap_or_default(),
                s("/record/pipeline").unwrap_or_default()
            );
            if let Some(g) = s("/record/group") {
                t.push_str(&format!(", group `{g}`"));
            }
            t.push(')');
            t
        }
        None => format!("Provider `{}`", s("/provider/name").unwrap_or_default()),
    };
    let mut text = format!("{what}: {topic}");
    if let Some(step) = s("/step") {
        text.push_str(&format!(" at step `{step}`"));
    }
    if let Some(reason) = s("/reason") {
        text.push_str(&format!(": {reason}"));
    }
    text.push_str(&format!(" ({})", super::time::format_ms(at)));
    json!({ "text": text })
}

/// A subscription's failing spell after a delivery: when it began (none
/// once a delivery succeeds), and whether it has now failed for
/// `disable_after_ms` and is turned off.
pub fn failing(
    since: Option<UnixMs>,
    ok: bool,
    now: UnixMs,
    disable_after_ms: i64,
) -> (Option<UnixMs>, bool) {
    if ok {
        return (None, false);
    }
    let since = since.unwrap_or(now);
    (Some(since), now - since >= disable_after_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use RecordState::*;

    fn rec(pipeline: &str, group: Option<&str>) -> Subject {
        Subject::Record {
            id: 7,
            key: "k".into(),
            pipeline: pipeline.into(),
            group: group.map(str::to_owned),
            priority: 5,
        }
    }

    #[test]
    fn changes_map_to_one_topic_each() {
        let t = |kind, from, to, code| record_topic(kind, Some(from), Some(to), code);
        assert_eq!(
            t("completed", Running, Succeeded, None),
            Some(Topic::RecordSucceeded)
        );
        assert_eq!(
            t("failed", Running, Failed, None),
            Some(Topic::RecordFailed)
        );
        assert_eq!(
            t("cancel", Parked, Cancelled, None),
            Some(Topic::RecordCancelled)
        );
        assert_eq!(
            t("parked", Running, Parked, None),
            Some(Topic::RecordParked)
        );
        let uncertain = Some(crate::domain::OUTCOME_UNCERTAIN);
        assert_eq!(
            t("parked", Running, Parked, uncertain),
            Some(Topic::RecordOutcomeUncertain)
        );
        assert_eq!(
            t("reversed", Succeeded, Succeeded, None),
            Some(Topic::RecordReversed)
        );
        assert_eq!(
            t("reversed", Succeeded, Parked, None),
            Some(Topic::RecordReversed)
        );
        assert_eq!(
            t("resume", Parked, Pending, None),
            Some(Topic::RecordResumed)
        );
        assert_eq!(
            t("retry", Failed, Pending, None),
            Some(Topic::RecordResumed)
        );
        // Work under way is no news.
        for (kind, from, to) in [
            ("claimed", Pending, Running),
            ("advanced", Running, Pending),
            ("retry_scheduled", Running, Retrying),
            ("waiting", Running, Waiting),
            ("park", Parked, Parked),
        ] {
            assert_eq!(t(kind, from, to, None), None, "{kind}");
        }
        assert_eq!(record_topic("token_created", None, None, None), None);
    }

    #[test]
    fn breakers_report_opening_and_closing_only() {
        use BreakerState::*;
        assert_eq!(
            breaker_topic(Closed, Open),
            Some(Topic::ProviderBreakerOpened)
        );
        assert_eq!(
            breaker_topic(HalfOpen, Open),
            None,
            "a failed probe is no news"
        );
        assert_eq!(
            breaker_topic(HalfOpen, Closed),
            Some(Topic::ProviderBreakerClosed)
        );
        assert_eq!(breaker_topic(Open, HalfOpen), None);
        assert_eq!(breaker_topic(Open, Open), None);
    }

    #[test]
    fn filters_want_types_pipelines_groups_and_providers() {
        let f = Filter {
            name: "ops".into(),
            events: vec!["record.parked".into(), "provider.*".into()],
            pipelines: vec!["pay".into()],
            groups: vec!["acme".into()],
            providers: vec!["stripe".into()],
        };
        assert!(f.wants(Topic::RecordParked, &rec("pay", Some("acme"))));
        assert!(!f.wants(Topic::RecordParked, &rec("pay", None)));
        assert!(!f.wants(Topic::RecordParked, &rec("ship", Some("acme"))));
        assert!(!f.wants(Topic::RecordFailed, &rec("pay", Some("acme"))));
        let stripe = Subject::Provider("stripe".into());
        assert!(f.wants(Topic::ProviderPaused, &stripe));
        assert!(!f.wants(Topic::ProviderPaused, &Subject::Provider("x".into())));
        let all = Filter {
            events: vec!["*".into()],
            pipelines: vec![],
            groups: vec![],
            providers: vec![],
            ..f
        };
        assert!(all.wants(Topic::RecordResumed, &rec("any", None)));
        assert_eq!(rec("p", None).key(), "record:7");
    }

    #[test]
    fn every_topic_parses_back() {
        for t in Topic::ALL {
            assert_eq!(t.as_str().parse::<Topic>(), Ok(t));
            assert_eq!(t.is_provider(), t.as_str().starts_with("provider."));
        }
        assert!("record.done".parse::<Topic>().is_err());
    }

    #[test]
    fn bodies_are_standard_and_slack_shaped() {
        let change = Change {
            kind: "parked",
            actor: "node:a",
            from: Some(Running),
            to: Some(Parked),
            step: Some("charge"),
            reason: Some("attempts exhausted"),
        };
        let d = data(&rec("pay", Some("acme")), &change);
        assert_eq!(d["record"]["state"], "parked");
        assert_eq!(d["record"]["previous_state"], "running");
        let b = body("record.parked", 0, &d);
        assert_eq!(b["type"], "record.parked");
        assert_eq!(b["timestamp"], "1970-01-01T00:00:00.000Z");
        let s = slack_body("record.parked", 0, &d);
        assert_eq!(
            s["text"],
            "Record 7 (`k`, pipeline `pay`, group `acme`): record.parked at step `charge`: attempts exhausted (1970-01-01T00:00:00.000Z)"
        );
        let loud = Change {
            reason: Some("<!channel> a & b"),
            ..change
        };
        let l = slack_body("record.parked", 0, &data(&rec("pay", None), &loud));
        let l = l["text"].as_str().unwrap_or_default();
        assert!(l.contains(": &lt;!channel&gt; a &amp; b ("), "{l}");
        let p = data(
            &Subject::Provider("stripe".into()),
            &Change {
                kind: "provider_paused",
                from: None,
                to: None,
                ..change
            },
        );
        assert!(
            slack_body("provider.paused", 0, &p)["text"]
                .as_str()
                .is_some_and(|t| t.starts_with("Provider `stripe`: provider.paused"))
        );
    }

    #[test]
    fn a_subscription_is_turned_off_after_failing_long_enough() {
        assert_eq!(failing(None, false, 100, 50), (Some(100), false));
        assert_eq!(failing(Some(100), false, 149, 50), (Some(100), false));
        assert_eq!(failing(Some(100), false, 150, 50), (Some(100), true));
        assert_eq!(failing(Some(100), true, 150, 50), (None, false));
    }
}
