//! The stored shapes: records, step runs, attempts, events, users, sessions,
//! nodes and provider state. Plain data; the store reads and writes them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::state::RecordState;
use super::time::UnixMs;

/// Declares a closed set of snake_case names with `as_str`, `Display`,
/// `FromStr` and `ALL`, so that every stored enum parses the same way.
macro_rules! named_enum {
    ($(#[$meta:meta])* pub enum $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($(#[$vmeta])* $variant,)+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(format!(concat!("unknown ", stringify!($name), " `{}`"), other)),
                }
            }
        }
    };
}

named_enum! {
    /// Where one step of one record is.
    pub enum StepState {
        Pending => "pending",
        Running => "running",
        /// A provider job is in flight.
        Waiting => "waiting",
        Retrying => "retrying",
        Succeeded => "succeeded",
        Failed => "failed",
        /// Not run: an upstream optional step failed or the record ended.
        Skipped => "skipped",
    }
}

named_enum! {
    /// What a provider reply means, after the provider's rules.
    pub enum Outcome {
        Success => "success",
        /// A half-state: poll again.
        Pending => "pending",
        Retry => "retry",
        Fail => "fail",
        /// Nothing matched: bounded retries, then parked with the evidence.
        Unknown => "unknown",
        /// The provider said "slow down" (a 429, a 503 with `Retry-After`,
        /// or what an operator's rule says): try again after its pause,
        /// spending no attempt, within the step's deadline.
        Throttled => "throttled",
    }
}

named_enum! {
    /// What a user may do. Each role includes the ones before it.
    pub enum Role {
        Viewer => "viewer",
        Operator => "operator",
        Admin => "admin",
    }
}

named_enum! {
    /// A provider's circuit breaker.
    pub enum BreakerState {
        Closed => "closed",
        Open => "open",
        HalfOpen => "half_open",
    }
}

/// The priority of a record enqueued without one.
pub const DEFAULT_PRIORITY: u8 = 5;
/// The highest priority (claimed first within its queue); 0 is the lowest.
pub const MAX_PRIORITY: u8 = 9;

/// A priority is 0 to 9, where it is given (enqueue, configuration,
/// store): the one rule and its one message.
pub fn check_priority(priority: Option<u8>) -> Result<(), String> {
    match priority {
        Some(p) if p > MAX_PRIORITY => Err(format!(
            "priority {p} is out of range (0 to {MAX_PRIORITY}, 9 first)"
        )),
        _ => Ok(()),
    }
}

/// One unit of work travelling through one pipeline.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Record {
    pub id: i64,
    pub pipeline: String,
    /// The pipeline definition this record was started with.
    pub pipeline_version: Option<i64>,
    /// The caller's key; unique per pipeline, makes enqueue idempotent.
    pub external_key: Option<String>,
    /// The group given at enqueue (a tenant, say): claims share the
    /// workers fairly between (pipeline, group) queues (`domain::fair`).
    pub group: Option<String>,
    /// 0 to 9, given at enqueue (5 when none was): within its queue a
    /// claim takes the highest first, then the oldest due.
    #[schema(minimum = 0, maximum = 9)]
    pub priority: u8,
    pub state: RecordState,
    pub input: Value,
    /// When the record next needs a worker: due time, or lease expiry while
    /// running. `None` exactly when the record is at rest.
    pub next_run_at: Option<UnixMs>,
    pub lease_owner: Option<String>,
    pub lease_until: Option<UnixMs>,
    /// Incremented by every claim; a worker's writes must carry the token it
    /// claimed with, so a stale worker cannot overwrite a newer claim.
    pub lease_token: i64,
    /// The step the record is at (last worked on), for filters and display.
    pub step: Option<String>,
    pub provider: Option<String>,
    /// Stable code of the last failure, if any.
    pub error_code: Option<String>,
    /// Human-readable reason for parking, failing or cancelling.
    pub reason: Option<String>,
    pub created_at: UnixMs,
    pub updated_at: UnixMs,
    pub finished_at: Option<UnixMs>,
    /// When a parked record resumes by itself; `None` (always, unless
    /// parked) waits for a human.
    pub park_until: Option<super::park::ParkUntil>,
    /// The record whose step (`parent_step`) started this one (a step of
    /// kind `pipeline`); `None` for a record enqueued otherwise.
    pub parent_id: Option<i64>,
    pub parent_step: Option<String>,
    /// When its latest pass was claimed (none before the first): the
    /// claim writes no event of its own (see `domain::claimed`).
    pub claimed_at: Option<UnixMs>,
}

/// A record of pipeline `p` in `state` and nothing else, for unit tests
/// to change what they test.
#[cfg(test)]
impl Record {
    pub(crate) fn sample(state: RecordState) -> Record {
        Record {
            id: 1,
            pipeline: "p".into(),
            pipeline_version: None,
            external_key: None,
            group: None,
            priority: crate::domain::DEFAULT_PRIORITY,
            state,
            input: serde_json::Value::Null,
            next_run_at: None,
            lease_owner: None,
            lease_until: None,
            lease_token: 0,
            step: None,
            provider: None,
            error_code: None,
            reason: None,
            created_at: 0,
            updated_at: 0,
            finished_at: None,
            park_until: None,
            parent_id: None,
            parent_step: None,
            claimed_at: None,
        }
    }
}

/// One step of one record.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepRun {
    pub record_id: i64,
    pub step: String,
    pub provider: Option<String>,
    pub state: StepState,
    /// Bumped by replay, so a replayed call gets a new idempotency key.
    pub generation: i32,
    pub attempts: i32,
    /// Replies (calls or polls) that no rule understood.
    pub unknowns: i32,
    pub idempotency_key: String,
    /// The provider's job id, committed before the first poll.
    pub job_id: Option<String>,
    pub output: Option<Value>,
    pub error_code: Option<String>,
    pub reason: Option<String>,
    pub next_run_at: Option<UnixMs>,
    pub deadline_at: Option<UnixMs>,
    pub started_at: Option<UnixMs>,
    pub finished_at: Option<UnixMs>,
    pub updated_at: UnixMs,
    /// What started this generation: `None` for the first run, else
    /// `replay by alice`, `retry by bob`, `rerun after reversal`.
    pub cause: Option<String>,
}

/// A step's result replaced by a later generation, kept as it was.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct StepVersion {
    pub record_id: i64,
    pub step: String,
    pub generation: i32,
    pub state: StepState,
    pub output: Option<Value>,
    pub job_id: Option<String>,
    pub error_code: Option<String>,
    /// What started its generation (`None`: the first run).
    pub cause: Option<String>,
    pub started_at: Option<UnixMs>,
    pub finished_at: Option<UnixMs>,
    /// When it was replaced, and by what (the next generation's cause).
    pub replaced_at: UnixMs,
    pub replaced_by: String,
}

/// The error code a step keeps when its provider reversed its success and
/// the record was parked: an operator's retry then runs it again (a new
/// generation), where a resume keeps the result.
pub const REVERSED: &str = "provider_reversed";

/// The full new state of one step run; the store derives its idempotency
/// key from (record, step, generation).
#[derive(Debug, Clone, PartialEq)]
pub struct StepWrite {
    pub step: String,
    pub provider: Option<String>,
    pub state: StepState,
    pub generation: i32,
    pub attempts: i32,
    pub unknowns: i32,
    pub job_id: Option<String>,
    pub output: Option<Value>,
    pub error_code: Option<String>,
    pub reason: Option<String>,
    pub next_run_at: Option<UnixMs>,
    pub deadline_at: Option<UnixMs>,
    pub started_at: Option<UnixMs>,
    pub finished_at: Option<UnixMs>,
}

impl StepWrite {
    /// A fresh step run in `pending`.
    pub fn pending(step: &str) -> Self {
        StepWrite {
            step: step.to_owned(),
            provider: None,
            state: StepState::Pending,
            generation: 0,
            attempts: 0,
            unknowns: 0,
            job_id: None,
            output: None,
            error_code: None,
            reason: None,
            next_run_at: None,
            deadline_at: None,
            started_at: None,
            finished_at: None,
        }
    }
}

impl From<&StepRun> for StepWrite {
    fn from(s: &StepRun) -> Self {
        StepWrite {
            step: s.step.clone(),
            provider: s.provider.clone(),
            state: s.state,
            generation: s.generation,
            attempts: s.attempts,
            unknowns: s.unknowns,
            job_id: s.job_id.clone(),
            output: s.output.clone(),
            error_code: s.error_code.clone(),
            reason: s.reason.clone(),
            next_run_at: s.next_run_at,
            deadline_at: s.deadline_at,
            started_at: s.started_at,
            finished_at: s.finished_at,
        }
    }
}

/// The idempotency key sent with every mutating call of a step: stable across
/// retries and restarts, new only when an operator replays the step. The
/// installation id keeps two installations (staging and production on one
/// provider account, or a rebuilt database whose ids restart) apart.
pub fn idempotency_key(installation: &str, record_id: i64, step: &str, generation: i32) -> String {
    format!("ballast-{installation}-{record_id}-{step}-{generation}")
}

/// One HTTP exchange (or transport failure) for one step of one record.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Attempt {
    pub id: i64,
    pub record_id: i64,
    pub step: String,
    pub provider: Option<String>,
    pub attempt_no: i32,
    pub node: Option<String>,
    pub started_at: UnixMs,
    pub duration_ms: i64,
    pub http_status: Option<i32>,
    pub outcome: Outcome,
    pub error_code: Option<String>,
    /// At most [`EXCERPT_MAX_BYTES`] of the reply or error, for evidence.
    pub excerpt: Option<String>,
    /// What was sent, credentials removed; `None` for a webhook delivery
    /// and for attempts older than the column.
    pub request: Option<super::request::SentRequest>,
}

/// A side-effecting call written down before it left (a provider declared
/// `at_most_once`), until the commit that keeps its attempt. One still
/// open when its record's next pass starts went out from a node that
/// stopped before it recorded the reply: whether it took effect is not
/// known.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Intent {
    pub id: i64,
    pub record_id: i64,
    pub step: String,
    pub provider: Option<String>,
    pub attempt_no: i32,
    pub node: Option<String>,
    pub sent_at: UnixMs,
    pub request: Option<super::request::SentRequest>,
}

/// The error code of a side-effecting call whose outcome is not known (a
/// timeout or reset after it was sent, a reply nobody understood, a call
/// left open by a node that stopped) for a provider that must not be
/// paid twice (`at_most_once`): the record waits for a lookup or a person
/// instead of sending it again.
pub const OUTCOME_UNCERTAIN: &str = "outcome_uncertain";

/// The longest body excerpt kept with an attempt.
pub const EXCERPT_MAX_BYTES: usize = 4096;

/// Cuts `text` to at most `max` bytes on a character boundary.
pub fn excerpt(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text` with every occurrence of a secret replaced by `[redacted]`, also
/// where the text spells it with JSON string escapes (`\/`, `\u0041`…), as
/// the raw body of a provider echoing the key in a JSON string may.
/// Secrets shorter than 6 bytes are left alone (they would match noise).
pub fn redact(text: &str, secrets: &[&str]) -> String {
    let secrets: Vec<&str> = secrets.iter().copied().filter(|s| s.len() >= 6).collect();
    let mut out = text.to_owned();
    for s in &secrets {
        if out.contains(s) {
            out = out.replace(s, "[redacted]");
        }
    }
    if out.contains('\\') {
        if let Some(clean) = redact_escaped(&out, &secrets) {
            out = clean;
        }
    }
    out
}

/// [`redact`] for secrets spelt with JSON escapes: decodes the escapes,
/// remembering where each decoded byte came from, finds the secrets in the
/// decoded text and cuts the raw spans that spell them. `None`: none found.
fn redact_escaped(text: &str, secrets: &[&str]) -> Option<String> {
    let mut decoded = String::with_capacity(text.len());
    // The raw offset each decoded byte came from, and the end.
    let mut origin = Vec::with_capacity(text.len() + 1);
    let mut i = 0;
    while i < text.len() {
        let (c, len) = json_char_at(text, i);
        origin.extend(std::iter::repeat_n(i, c.len_utf8()));
        decoded.push(c);
        i += len;
    }
    origin.push(text.len());
    let mut spans: Vec<(usize, usize)> = secrets
        .iter()
        .flat_map(|s| {
            decoded
                .match_indices(s)
                .map(|(at, m)| (origin[at], origin[at + m.len()]))
                .collect::<Vec<_>>()
        })
        .collect();
    if spans.is_empty() {
        return None;
    }
    spans.sort_unstable();
    let mut out = String::with_capacity(text.len());
    let mut done = 0;
    for (from, to) in spans {
        if to <= done {
            continue;
        }
        out.push_str(&text[done..from.max(done)]);
        out.push_str("[redacted]");
        done = to;
    }
    out.push_str(&text[done..]);
    Some(out)
}

/// The character at byte `i` of `text` read as the inside of a JSON string
/// (an escape decoded), and how many bytes it took.
pub(crate) fn json_char_at(text: &str, i: usize) -> (char, usize) {
    let rest = &text[i..];
    let hex = |at: usize| {
        rest.get(at..at + 4)
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|h| u32::from_str_radix(h, 16).ok())
    };
    if let Some(escaped) = rest.strip_prefix('\\') {
        let simple = match escaped.as_bytes().first() {
            Some(b'/') => Some('/'),
            Some(b'\\') => Some('\\'),
            Some(b'"') => Some('"'),
            Some(b'n') => Some('\n'),
            Some(b't') => Some('\t'),
            Some(b'r') => Some('\r'),
            Some(b'b') => Some('\u{8}'),
            Some(b'f') => Some('\u{c}'),
            _ => None,
        };
        if let Some(c) = simple {
            return (c, 2);
        }
        if escaped.starts_with('u') {
            if let Some(high) = hex(2) {
                // A surrogate pair: two escapes, one character.
                if (0xD800..0xDC00).contains(&high) && rest.get(6..8) == Some("\\u") {
                    if let Some(low) = hex(8).filter(|l| (0xDC00..0xE000).contains(l)) {
                        let cp = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
                        if let Some(c) = char::from_u32(cp) {
                            return (c, 12);
                        }
                    }
                }
                if let Some(c) = char::from_u32(high) {
                    return (c, 6);
                }
            }
        }
    }
    let c = rest.chars().next().unwrap_or('\0');
    (c, c.len_utf8().max(1))
}

/// Replaces every string and object key of `value` for which `f` gives a
/// replacement.
pub fn rewrite_json_strings(value: &mut serde_json::Value, f: &dyn Fn(&str) -> Option<String>) {
    use serde_json::Value;
    match value {
        Value::String(s) => {
            if let Some(new) = f(s) {
                *s = new;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rewrite_json_strings(v, f)),
        Value::Object(map) => {
            if map.keys().any(|k| f(k).is_some()) {
                *map = std::mem::take(map)
                    .into_iter()
                    .map(|(k, v)| (f(&k).unwrap_or(k), v))
                    .collect();
            }
            map.values_mut().for_each(|v| rewrite_json_strings(v, f));
        }
        _ => {}
    }
}

/// Makes a parsed provider body (a reply or a webhook delivery) storable:
/// [`storable_text`] for every string and object key (NUL to U+FFFD,
/// `secrets` to `[redacted]`), and a number that spells a secret becomes
/// the string `[redacted]`.
pub fn scrub_json(value: &mut serde_json::Value, secrets: &[&str]) {
    use serde_json::Value;
    fn numbers(v: &mut Value, secrets: &[&str]) {
        match v {
            Value::Number(n) if secrets.contains(&n.to_string().as_str()) => {
                *v = Value::String("[redacted]".into());
            }
            Value::Array(items) => items.iter_mut().for_each(|v| numbers(v, secrets)),
            Value::Object(map) => map.values_mut().for_each(|v| numbers(v, secrets)),
            _ => {}
        }
    }
    let secrets: Vec<&str> = secrets.iter().copied().filter(|s| s.len() >= 6).collect();
    rewrite_json_strings(value, &|s| storable_text(s, &secrets));
    if secrets
        .iter()
        .any(|k| k.bytes().all(|b| b.is_ascii_digit()))
    {
        numbers(value, &secrets);
    }
}

/// Whether any string or object key of `value` holds a NUL character.
pub fn json_has_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(json_has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || json_has_nul(v)),
        _ => false,
    }
}

/// `text` as it may be stored, when that differs: NUL characters replaced
/// by U+FFFD (PostgreSQL stores no NUL in text or JSON, and both backends
/// keep the same evidence) and `secrets` by `[redacted]` (see [`redact`]).
pub fn storable_text(text: &str, secrets: &[&str]) -> Option<String> {
    // A backslash may start an escaped spelling of a secret.
    let may_hold_secret = secrets
        .iter()
        .any(|k| k.len() >= 6 && (text.contains(k) || text.contains('\\')));
    if !may_hold_secret && !text.contains('\0') {
        return None;
    }
    let out = redact(&text.replace('\0', "\u{FFFD}"), secrets);
    (out != text).then_some(out)
}

/// The reason a stopping node gives work back with: a step it did not start
/// (a `deferred` event) or a record it never began (`released`).
pub const SHUTDOWN_REASON: &str = "node shutting down";

/// The actor of what Ballast does by itself: a record created, a parked
/// record resumed when its condition held, a confirmation given up.
pub const SYSTEM_ACTOR: &str = "system";

/// One state transition or operator action, kept forever.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Event {
    /// A `claimed` event put back from the event that ended its pass (or
    /// from the record, for the pass under way: `domain::claimed`) carries
    /// the id of that event (or of the record's last).
    pub id: i64,
    pub record_id: Option<i64>,
    pub at: UnixMs,
    /// Stable snake_case kind: a trigger kind (`claimed`, `parked`, `retry`…)
    /// or an action on something else (`provider_paused`, `user_added`…).
    pub kind: String,
    /// `system`, `node:<id>` or a username.
    pub actor: String,
    /// True for actions a person took; these form the audit log.
    pub audit: bool,
    pub from_state: Option<RecordState>,
    pub to_state: Option<RecordState>,
    pub step: Option<String>,
    pub reason: Option<String>,
    pub detail: Option<Value>,
}

/// A control-plane user. The hash never leaves the store except for
/// verification, and is never printed.
#[derive(Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct User {
    pub id: i64,
    pub username: String,
    #[serde(skip)]
    #[schema(ignore)]
    pub password_hash: String,
    pub role: Role,
    pub disabled: bool,
    pub created_at: UnixMs,
    pub updated_at: UnixMs,
    /// The dashboard's colour scheme this user chose (`light`, `dark`);
    /// `None` follows the system's.
    pub theme: Option<String>,
    /// The pipelines the user may see (`domain::scope`).
    #[serde(serialize_with = "scope_patterns")]
    #[schema(value_type = Vec<String>)]
    pub pipelines: super::scope::Scope,
    /// Sees sensitive fields in clear (`domain::mask`).
    pub unmask: bool,
    /// Made by single sign-on (an OpenID provider vouches for it; its
    /// role and pipelines follow its groups at each sign-in).
    pub signs_on: bool,
}

/// A scope as JSON: its patterns (empty: every pipeline).
fn scope_patterns<S: serde::Serializer>(
    scope: &super::scope::Scope,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_seq(scope.patterns())
}

impl fmt::Debug for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("User")
            .field("id", &self.id)
            .field("username", &self.username)
            .field("password_hash", &"[redacted]")
            .field("role", &self.role)
            .field("disabled", &self.disabled)
            .field("pipelines", &self.pipelines)
            .finish()
    }
}

/// A login session (the JWT's id), revocable server-side.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Session {
    pub id: String,
    pub user_id: i64,
    pub created_at: UnixMs,
    pub expires_at: UnixMs,
    pub revoked_at: Option<UnixMs>,
    /// When a request last used it, noted at most once a
    /// [`SESSION_TOUCH_EVERY_MS`].
    pub last_seen_at: UnixMs,
}

/// How often a session's use is written down: a request within this of
/// the last note writes nothing, so the idle timeout costs at most one
/// write a minute per session (and may end a session up to this early).
pub const SESSION_TOUCH_EVERY_MS: i64 = 60_000;

/// What a request at some moment makes of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionUse {
    /// Revoked, past its lifetime, or idle too long.
    Dead,
    /// Live; `touch`: note this use (the last note is a minute old).
    Live { touch: bool },
}

impl Session {
    /// Not revoked and within its absolute lifetime.
    pub fn is_live(&self, now: UnixMs) -> bool {
        self.revoked_at.is_none() && now < self.expires_at
    }

    /// A request at `now` on a session that ends after `idle_ms` unused.
    pub fn used(&self, now: UnixMs, idle_ms: i64) -> SessionUse {
        if !self.is_live(now) || now.saturating_sub(self.last_seen_at) >= idle_ms {
            return SessionUse::Dead;
        }
        SessionUse::Live {
            touch: now.saturating_sub(self.last_seen_at) >= SESSION_TOUCH_EVERY_MS,
        }
    }
}

/// A bearer token for the JSON API and metrics. The token itself is shown
/// once at creation; only its SHA-256 is stored.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ApiToken {
    pub id: i64,
    pub name: String,
    /// The token's first characters, to recognise it in lists.
    pub prefix: String,
    pub role: Role,
    pub created_by: String,
    pub created_at: UnixMs,
    pub last_used_at: Option<UnixMs>,
    pub revoked_at: Option<UnixMs>,
    /// When it stops working, if ever.
    pub expires_at: Option<UnixMs>,
    /// The pipelines it may see (`domain::scope`).
    #[serde(serialize_with = "scope_patterns")]
    #[schema(value_type = Vec<String>)]
    pub pipelines: super::scope::Scope,
    /// Sees sensitive fields in clear (`domain::mask`).
    pub unmask: bool,
}

impl ApiToken {
    /// True once `now` has reached its expiry.
    pub fn is_expired(&self, now: UnixMs) -> bool {
        self.expires_at.is_some_and(|at| now >= at)
    }
}

/// A running `ballast` process, seen through its heartbeats.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Node {
    pub id: String,
    pub hostname: String,
    pub pid: i64,
    pub version: String,
    pub started_at: UnixMs,
    pub heartbeat_at: UnixMs,
    /// Set when the node is shutting down and no longer claims work.
    pub draining: bool,
    /// The configuration it runs (`Config::version`), once it has said.
    pub config_version: Option<String>,
    /// The data key it seals new values with (`""`: none), once it has said.
    pub data_key: Option<String>,
}

/// A pipeline's cron schedule as the cluster has fired it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScheduleRow {
    pub pipeline: String,
    /// The expression it was last fired by.
    pub cron: String,
    /// Every tick at or before this moment has been dealt with.
    pub watermark: UnixMs,
    /// The last tick fired, and the record it made.
    pub last_tick: Option<UnixMs>,
    pub last_record_id: Option<i64>,
    pub updated_at: UnixMs,
}

/// Shared state of one provider: breaker and operator pause. Every node
/// reads it, so a breaker opened on one node defers work on all.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProviderState {
    pub provider: String,
    pub breaker: BreakerState,
    pub breaker_changed_at: UnixMs,
    pub open_until: Option<UnixMs>,
    pub paused: bool,
    pub paused_by: Option<String>,
    pub paused_reason: Option<String>,
    /// Until when the provider asked every node to hold its calls (its
    /// last `Retry-After`, or the backoff when it named none).
    pub throttled_until: Option<UnixMs>,
    /// Breaker window figures, as the engine keeps them.
    pub stats: Option<Value>,
    pub updated_at: UnixMs,
}

impl ProviderState {
    /// A provider nobody has touched yet: breaker closed, not paused.
    pub fn new(provider: &str, now: UnixMs) -> Self {
        ProviderState {
            provider: provider.to_owned(),
            breaker: BreakerState::Closed,
            breaker_changed_at: now,
            open_until: None,
            paused: false,
            paused_by: None,
            paused_reason: None,
            throttled_until: None,
            stats: None,
            updated_at: now,
        }
    }
}

/// A pinned pipeline definition; records keep the version they started with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PipelineVersion {
    pub id: i64,
    pub pipeline: String,
    pub hash: String,
    pub definition: Value,
    pub created_at: UnixMs,
}

/// How many records of one pipeline are in one state.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct StateCount {
    pub pipeline: String,
    pub state: RecordState,
    pub count: i64,
}

/// How many records of one pipeline are at one step in one state (`step`
/// empty: not at any step yet).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct StepCount {
    pub pipeline: String,
    pub step: String,
    pub state: RecordState,
    pub count: i64,
}

/// How many records of one group of a pipeline are in one state that is
/// not final (groups are counted while they have work).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct GroupCount {
    pub pipeline: String,
    pub group: String,
    pub state: RecordState,
    pub count: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_end_when_idle_and_are_touched_once_a_minute() {
        let s = Session {
            id: "k".into(),
            user_id: 1,
            created_at: 0,
            expires_at: 8 * 3_600_000,
            revoked_at: None,
            last_seen_at: 1_000_000,
        };
        let idle = 30 * 60_000;
        let at = |ms: i64| s.used(1_000_000 + ms, idle);
        assert_eq!(at(0), SessionUse::Live { touch: false });
        assert_eq!(at(59_999), SessionUse::Live { touch: false });
        assert_eq!(at(60_000), SessionUse::Live { touch: true });
        assert_eq!(at(idle - 1), SessionUse::Live { touch: true });
        assert_eq!(at(idle), SessionUse::Dead, "idle too long");
        assert_eq!(s.used(8 * 3_600_000, i64::MAX), SessionUse::Dead, "too old");
        let revoked = Session {
            revoked_at: Some(1),
            ..s.clone()
        };
        assert_eq!(revoked.used(1_000_000, idle), SessionUse::Dead);
    }

    #[test]
    fn redact_scrubs_secrets() {
        let text = r#"{"error": "invalid key sk_live_123456", "echo": "Bearer sk_live_123456"}"#;
        let out = redact(text, &["sk_live_123456", "abc"]);
        assert!(!out.contains("sk_live_123456"), "{out}");
        assert_eq!(out.matches("[redacted]").count(), 2);
        assert_eq!(
            redact("abc abc", &["abc"]),
            "abc abc",
            "too short to redact"
        );
    }

    #[test]
    fn storable_text_reaches_every_string_and_key() {
        let key = "sk_live_123456";
        let mut v = serde_json::json!({
            "echo": format!("Bearer {key}"),
            "nested": [{ "note": key, "n": 1 }],
            key: "as a key",
            "clean": "untouched",
        });
        rewrite_json_strings(&mut v, &|s| storable_text(s, &[key]));
        let text = v.to_string();
        assert!(!text.contains(key), "{text}");
        assert_eq!(text.matches("[redacted]").count(), 3, "{text}");
        assert_eq!(v["clean"], "untouched");
        assert_eq!(v["nested"][0]["n"], 1);
    }

    #[test]
    fn redact_sees_through_json_escapes() {
        let key = "sk/live\u{e9}\u{1F600}123";
        let raw = r#"{"error": "bad key sk\/live\u00e9\ud83d\ude00123!", "k": "sk\u002Flive\u00E9\uD83D\uDE00123"}"#;
        let out = redact(raw, &[key]);
        assert_eq!(
            out,
            r#"{"error": "bad key [redacted]!", "k": "[redacted]"}"#
        );
        // Escapes that spell nothing secret are left as they are.
        let clean = r#"{"a": "x\u0000y\/z\q"}"#;
        assert_eq!(redact(clean, &[key]), clean);
    }

    #[test]
    fn scrub_json_sees_through_escapes_and_numbers() {
        let key = "sk/live\u{e9}123";
        // The provider escaped the key: `\/` and `\u00e9` in the raw text.
        let raw = r#"{"error": "bad key sk\/live\u00e9123", "n": 1}"#;
        assert!(!raw.contains(key));
        let mut v: serde_json::Value = serde_json::from_str(raw).unwrap();
        scrub_json(&mut v, &[key]);
        assert_eq!(v["error"], "bad key [redacted]");
        assert_eq!(v["n"], 1);
        let mut v = serde_json::json!({ "pin": 12345678, "other": 1234567 });
        scrub_json(&mut v, &["12345678"]);
        assert_eq!(
            v,
            serde_json::json!({ "pin": "[redacted]", "other": 1234567 })
        );
        let mut v = serde_json::json!({ "clean": "a\u{0}b" });
        scrub_json(&mut v, &[key]);
        assert_eq!(v["clean"], "a\u{FFFD}b");
    }

    #[test]
    fn named_enums_round_trip() {
        for s in StepState::ALL {
            assert_eq!(s.as_str().parse::<StepState>().as_ref(), Ok(s));
        }
        for o in Outcome::ALL {
            assert_eq!(o.as_str().parse::<Outcome>().as_ref(), Ok(o));
        }
        assert_eq!("admin".parse::<Role>(), Ok(Role::Admin));
        assert!("root".parse::<Role>().is_err());
        assert!(Role::Admin > Role::Operator && Role::Operator > Role::Viewer);
    }

    #[test]
    fn excerpt_respects_char_boundaries() {
        assert_eq!(excerpt("héllo", 2), "h");
        assert_eq!(excerpt("héllo", 3), "hé");
        assert_eq!(excerpt("abc", 10), "abc");
    }

    #[test]
    fn idempotency_keys_are_stable_and_change_on_replay() {
        let k = |i, r, g| idempotency_key(i, r, "submit", g);
        assert_eq!(k("a1", 7, 0), k("a1", 7, 0));
        assert_ne!(k("a1", 7, 0), k("a1", 7, 1));
        assert_ne!(k("a1", 7, 0), k("a1", 8, 0));
        assert_ne!(k("a1", 7, 0), k("b2", 7, 0));
    }

    #[test]
    fn user_debug_hides_the_hash() {
        let u = User {
            id: 1,
            username: "a".into(),
            password_hash: "$argon2id$secret".into(),
            role: Role::Viewer,
            disabled: false,
            created_at: 0,
            updated_at: 0,
            theme: None,
            pipelines: super::super::scope::Scope::all(),
            unmask: false,
            signs_on: false,
        };
        assert!(!format!("{u:?}").contains("argon2id"));
    }
}
