//! `POST /triggers/{name}`: an incoming event starts a record
//! (`[triggers.NAME]`, `config::trigger`). Open without login by design:
//! the sender's signature is the authentication. Each delivery gets a
//! verdict (`domain::trigger::Verdict`): its status and stable code in the
//! answer (an RFC 9457 problem when refused), a row on the triggers page
//! and a count in `ballast_trigger_deliveries_total`.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Serialize;
use serde_json::Value;

use crate::auth::presets::{self, Encoding, StandardHeaders};
use crate::auth::webhook::{self, SignatureError};
use crate::config::trigger::TriggerConfig;
use crate::domain::trigger::{self, Preset, Verdict};
use crate::store::{StoreError, TriggerDelivery};
use crate::web::AppState;
use crate::web::error::Problem;

pub fn router(state: &AppState) -> Router<AppState> {
    let per_second = u64::from(state.config.get().server.limits.hooks_per_second);
    let routes = Router::new()
        .route("/triggers/{name}", post(receive))
        .layer(DefaultBodyLimit::max(super::hooks::MAX_BODY));
    super::per_address(
        routes,
        state,
        per_second,
        "too many trigger deliveries from your address",
    )
}

/// A delivery taken: what became of it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Taken {
    /// `enqueued`, `duplicate` (the sender's retry: its id named a record
    /// already made) or `ignored` (a type the trigger is told to ignore).
    pub verdict: &'static str,
    /// The record made or named (none when ignored).
    pub record_id: Option<i64>,
}

/// What a delivery came to, before it is answered and kept.
struct Outcome {
    verdict: Verdict,
    event_id: Option<String>,
    event_type: Option<String>,
    record_id: Option<i64>,
    detail: Option<String>,
}

impl Outcome {
    fn refused(verdict: Verdict, detail: impl Into<String>) -> Outcome {
        Outcome {
            verdict,
            event_id: None,
            event_type: None,
            record_id: None,
            detail: Some(detail.into()),
        }
    }
}

/// Deliver an event to a trigger.
///
/// Verified by the trigger's preset (`Stripe-Signature`;
/// `X-Hub-Signature-256`; Standard Webhooks' `webhook-id`,
/// `webhook-timestamp` and `webhook-signature`; or a named HMAC header),
/// then routed by its type and enqueued into the trigger's pipeline under
/// the key `NAME:EVENT_ID`: a sender's retry enqueues nothing new.
#[utoipa::path(
    post,
    path = "/triggers/{name}",
    tag = "triggers",
    operation_id = "deliver_trigger",
    params(("name" = String, Path, description = "The trigger, as configured")),
    request_body(content = Value, description = "The sender's event, as it signed it", content_type = "application/json"),
    responses(
        (status = 201, description = "A new record", body = Taken),
        (status = 200, description = "A duplicate (the record it named) or an ignored type", body = Taken),
        (status = 400, description = "The body is not JSON, or the event has no id", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "The signature is missing, stale or wrong", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such trigger", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The body is over 1 MiB", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A type the trigger neither accepts nor ignores, or an event no record can be made of", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "Too many deliveries from this address: see `Retry-After`", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database failed: send it again (after `Retry-After` seconds)", body = Problem, content_type = "application/problem+json"),
    ),
    security(())
)]
pub async fn receive(
    State(state): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            let code = match e.status() {
                StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
                _ => "unreadable_body",
            };
            return Problem::new(e.status(), code, &e.body_text()).into_response();
        }
    };
    let config = state.config.get();
    let Some(t) = config.triggers.get(&name) else {
        let p = Problem::new(StatusCode::NOT_FOUND, "unknown_trigger", "no such trigger");
        return p.into_response();
    };
    let received_at = state.clock.now_ms();
    let outcome = take(&state, &name, t, &headers, &body, received_at).await;
    let code = outcome.verdict.code();
    metrics::counter!("ballast_trigger_deliveries_total", "trigger" => name.clone(), "verdict" => code)
        .increment(1);
    if outcome.verdict.status() >= 400 {
        tracing::warn!(trigger = %name, verdict = code, detail = outcome.detail.as_deref().unwrap_or(""), "trigger delivery refused");
    }
    // A refused signature is counted, not kept: anyone can send one, and a
    // row for each would let them fill the table and busy the writer.
    if outcome.verdict.status() != 401 {
        let cut = |v: &Option<String>| v.as_deref().map(|t| trigger::cut(t, trigger::MAX_KEY));
        let kept = TriggerDelivery {
            id: 0,
            trigger: name.clone(),
            pipeline: t.pipeline.clone(),
            received_at,
            verdict: code.to_owned(),
            status: outcome.verdict.status(),
            event_id: cut(&outcome.event_id),
            event_type: cut(&outcome.event_type),
            record_id: outcome.record_id,
            detail: cut(&outcome.detail),
        };
        if let Err(e) = state.db.record_trigger_delivery(&kept).await {
            tracing::warn!(trigger = %name, error = %e, "could not keep a trigger delivery");
        }
    }
    answer(&outcome)
}

fn answer(o: &Outcome) -> Response {
    let status = StatusCode::from_u16(o.verdict.status()).unwrap_or(StatusCode::OK);
    if status.is_success() {
        let taken = Taken {
            verdict: o.verdict.code(),
            record_id: o.record_id,
        };
        return (status, Json(taken)).into_response();
    }
    let detail = o.detail.as_deref().unwrap_or("");
    let mut r = Problem::new(status, o.verdict.code(), detail).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        // The sender's retry will get through: soon, not at once.
        let after = axum::http::HeaderValue::from_static("5");
        r.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, after);
    }
    r
}

/// Verifies, reads and routes a delivery, and enqueues its record.
async fn take(
    state: &AppState,
    name: &str,
    t: &TriggerConfig,
    headers: &HeaderMap,
    body: &[u8],
    now: crate::domain::UnixMs,
) -> Outcome {
    let h = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Err(refused) = authentic(name, t, &h, body, now / 1000).await {
        return refused;
    }
    let Ok(mut event) = serde_json::from_slice::<Value>(body) else {
        return Outcome::refused(Verdict::NotJson, "the body is not JSON");
    };
    // Kept like a reply's body: NUL characters (which PostgreSQL cannot
    // store) become U+FFFD.
    crate::domain::scrub_json(&mut event, &[]);
    let event_type = t.type_source().and_then(|s| s.read(&event, &h));
    let id_source = t.id_source();
    let event_id = id_source.as_ref().and_then(|s| s.read(&event, &h));
    let mut o = Outcome {
        verdict: trigger::route(&t.accept, &t.ignore, event_type.as_deref().unwrap_or("")),
        event_id,
        event_type,
        record_id: None,
        detail: None,
    };
    match o.verdict {
        Verdict::Ignored => return o,
        Verdict::Unmapped => {
            let ty = o.event_type.as_deref().unwrap_or("");
            o.detail = Some(format!("event type `{ty}` is neither accepted nor ignored"));
            return o;
        }
        _ => {}
    }
    let Some(id) = o.event_id.clone() else {
        o.verdict = Verdict::NoId;
        o.detail = Some("the event has no id where the trigger reads it".into());
        return o;
    };
    let pointer = t.input_pointer();
    let Some(input) = event.pointer(pointer).cloned() else {
        o.verdict = Verdict::Refused;
        o.detail = Some(format!(
            "the event has no `{pointer}` (the trigger's input)"
        ));
        return o;
    };
    let group = t
        .group
        .as_deref()
        .and_then(|g| trigger::Source::parse(g).ok());
    let group = group.and_then(|g| g.read(&event, &h));
    // Named by what the sender signed: an id from an unsigned header
    // could be changed on a captured delivery sent again.
    let signed = id_source.is_some_and(|s| trigger::signs(t.preset, &s));
    let key = if signed {
        trigger::record_key(name, &id)
    } else {
        trigger::record_key(name, &body_digest(body))
    };
    let made = enqueue(state, t, &key, group, input).await;
    match made {
        Ok((record, created)) => {
            o.record_id = Some(record);
            o.verdict = if created {
                Verdict::Enqueued
            } else {
                Verdict::Duplicate
            };
        }
        Err((verdict, why)) => {
            o.verdict = verdict;
            o.detail = Some(why);
        }
    }
    o
}

/// Whether the delivery is signed by one of the trigger's secrets (read
/// now, off the runtime's threads: files may have been rotated).
async fn authentic(
    name: &str,
    t: &TriggerConfig,
    h: &(dyn Fn(&str) -> Option<String> + Sync),
    body: &[u8],
    now_s: i64,
) -> Result<(), Outcome> {
    let reading = t.clone();
    let read =
        tokio::task::spawn_blocking(move || reading.read_secrets(&|v| std::env::var(v).ok()));
    let read = read
        .await
        .unwrap_or_else(|e| Err(("secrets_file", e.to_string())));
    let secrets = match read {
        Ok(s) => s,
        Err((field, why)) => {
            // Checked at start and reload: a file or variable gone since.
            tracing::error!(trigger = %name, setting = field, error = %why, "a trigger cannot read its secrets");
            return Err(Outcome::refused(
                Verdict::Failed,
                "the trigger cannot verify deliveries now",
            ));
        }
    };
    let secrets: Vec<Vec<u8>> = secrets
        .iter()
        .map(|s| s.expose().as_bytes().to_vec())
        .collect();
    verify(t, &secrets, h, body, now_s).map_err(|e| {
        let why = match e {
            SignatureError::Malformed => format!(
                "the signature is missing or malformed (expected {})",
                t.preset.expects()
            ),
            other => other.to_string(),
        };
        Outcome::refused(signature_verdict(e), why)
    })
}

/// Enqueues the record: its id and whether it is new; a refusal's verdict
/// and reason.
async fn enqueue(
    state: &AppState,
    t: &TriggerConfig,
    key: &str,
    group: Option<String>,
    input: Value,
) -> Result<(i64, bool), (Verdict, String)> {
    if key.chars().count() > trigger::MAX_KEY {
        let why = format!(
            "the event's id makes a key over {} characters",
            trigger::MAX_KEY
        );
        return Err((Verdict::Refused, why));
    }
    let Some(engine) = state.engine.as_ref() else {
        return Err((Verdict::Failed, "this node runs no pipelines".into()));
    };
    let item = crate::engine::Enqueue::new(&t.pipeline, Some(key), input)
        .in_group(group.as_deref())
        .with_priority(t.priority);
    match engine.enqueue(item).await {
        Ok(c) => Ok((c.record.id, c.created)),
        Err(StoreError::Invalid(why)) => Err((Verdict::Refused, why)),
        Err(e) => {
            tracing::error!(error = %e, "a trigger could not enqueue");
            Err((Verdict::Failed, "the database failed: send it again".into()))
        }
    }
}

/// Checks the sender's signature by the trigger's preset.
fn verify(
    t: &TriggerConfig,
    secrets: &[Vec<u8>],
    h: &dyn Fn(&str) -> Option<String>,
    body: &[u8],
    now_s: i64,
) -> Result<(), SignatureError> {
    let get = |n: &str| h(n).unwrap_or_default();
    let tolerance = i64::try_from(t.tolerance.0.as_secs()).unwrap_or(i64::MAX);
    match t.preset {
        Preset::Stripe => {
            webhook::verify(secrets, &get("stripe-signature"), body, now_s, tolerance)
        }
        Preset::Github => {
            let sig = get("x-hub-signature-256");
            presets::body_verify(secrets, &sig, body, "sha256=", Encoding::Hex)
        }
        Preset::StandardWebhooks => {
            let (id, timestamp, signature) = (
                get("webhook-id"),
                get("webhook-timestamp"),
                get("webhook-signature"),
            );
            let sent = StandardHeaders {
                id: &id,
                timestamp: &timestamp,
                signature: &signature,
            };
            presets::standard_verify(secrets, &sent, body, now_s, tolerance)
        }
        Preset::Hmac => {
            let sig = get(&t.header.clone().unwrap_or_default().to_ascii_lowercase());
            let encoding = match t.encoding.as_deref() {
                Some("base64") => Encoding::Base64,
                _ => Encoding::Hex,
            };
            let prefix = t.prefix.as_deref().unwrap_or("");
            presets::body_verify(secrets, &sig, body, prefix, encoding)
        }
    }
}

/// `sha256:` and 32 hex digits of the body's SHA-256: what a body-signing
/// sender's event is known by.
fn body_digest(body: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(&sha2::Sha256::digest(body)[..16]))
}

fn signature_verdict(e: SignatureError) -> Verdict {
    match e {
        SignatureError::Malformed => Verdict::Malformed,
        SignatureError::Stale => Verdict::Stale,
        SignatureError::Mismatch => Verdict::BadSignature,
    }
}
