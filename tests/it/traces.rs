//! Traces (issue 20 item 6): a `ballast serve` process with `[traces]`
//! exports a span per pass, per step run and per provider call over
//! OTLP/HTTP to a collector in the test, and each call carries its span's
//! `traceparent` to the provider; without `[traces]` nothing is sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use ballast::domain::RecordState;
use ballast::store::{Backend, NewRecord};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{
    Span, span::SpanKind, status::StatusCode as OtelStatus,
};
use prost::Message;
use serde_json::{Value, json};

use crate::engine::single_step_toml;
use crate::faults::Serve;
use crate::helpers::{TestDb, poll_until, serve_router, wall_ms};

/// A call as the provider saw it: the record id from its body, and its
/// `traceparent`.
type Seen = (i64, Option<String>);

/// A provider that answers each record's first call 503 and its second
/// 200, noting the `traceparent` each call came with.
#[derive(Clone, Default)]
struct Provider {
    /// Every call, in arrival order.
    calls: Arc<Mutex<Vec<Seen>>>,
}

async fn charge(
    State(p): State<Provider>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let id: i64 = body["ref"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or(-1);
    let tp = headers
        .get("traceparent")
        .map(|v| v.to_str().unwrap().to_owned());
    let mut calls = p.calls.lock().unwrap();
    let first = !calls.iter().any(|(r, _)| *r == id);
    calls.push((id, tp));
    if first {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "busy"})),
        )
    } else {
        let reply = json!({"status": "succeeded", "id": format!("ch_{id}")});
        (StatusCode::OK, Json(reply))
    }
}

/// An OTLP/HTTP collector: keeps every export's body.
async fn collect(State(bodies): State<Arc<Mutex<Vec<Bytes>>>>, body: Bytes) -> StatusCode {
    bodies.lock().unwrap().push(body);
    StatusCode::OK
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn text<'a>(s: &'a Span, key: &str) -> &'a str {
    match attr(&s.attributes, key) {
        Some(any_value::Value::StringValue(v)) => v,
        other => panic!("span {} {key}: {other:?}", s.name),
    }
}

fn int(s: &Span, key: &str) -> i64 {
    match attr(&s.attributes, key) {
        Some(any_value::Value::IntValue(v)) => *v,
        other => panic!("span {} {key}: {other:?}", s.name),
    }
}

/// Enqueues `n` records of `pay` and waits until they succeed; their ids.
async fn run_records(t: &TestDb, n: usize, tag: &str) -> Vec<i64> {
    let now = wall_ms();
    let batch = (0..n)
        .map(|i| NewRecord {
            pipeline: "pay".into(),
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            pipeline_version: None,
            external_key: Some(format!("{tag}-{i}")),
            input: json!({}),
            run_at: now,
        })
        .collect();
    let ids: Vec<i64> = (t.db.create_records(batch, now).await.unwrap())
        .iter()
        .map(|c| c.record.id)
        .collect();
    poll_until("the records succeed", Duration::from_secs(60), || async {
        for id in &ids {
            let r = t.db.get_record(*id).await.unwrap()?;
            if r.state != RecordState::Succeeded {
                return None;
            }
        }
        Some(())
    })
    .await;
    ids
}

/// Two calls per record (a 503, then a 200), each its own pass. With
/// traces off no call carries a `traceparent`. With them on, every call
/// does, and it names a `call` span exported to the collector: a client
/// span with the record, step, provider, attempt and outcome, below a
/// `step` span below the pass's root `pass` span; the history keeps the
/// header with the rest of the request. Sampled out, calls carry a
/// `traceparent` flagged so and nothing is exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_process_exports_passes_and_calls_and_sends_traceparent() {
    let t = TestDb::migrated(Backend::Sqlite, "traces").await.unwrap();
    let provider = Provider::default();
    let provider_url = serve_router(
        axum::Router::new()
            .route("/v1/charge", post(charge))
            .with_state(provider.clone()),
    )
    .await;
    let bodies: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let collector = serve_router(
        axum::Router::new()
            .route("/v1/traces", post(collect))
            .with_state(bodies.clone()),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let pipeline = single_step_toml(&provider_url, "retry = { base = \"20ms\", cap = \"40ms\" }");
    let toml = format!("[database]\nurl = \"{}\"\n{pipeline}", t.url);
    let env = [("BALLAST_ADMIN_PASSWORD", "traces-admin-pw-1")];

    // Off (the default): no traceparent, nothing exported.
    std::fs::write(dir.path().join("ballast.toml"), &toml).unwrap();
    let node = Serve::start(dir.path(), &env).await;
    let off = run_records(&t, 1, "off").await;
    node.stop().await;
    let calls = provider.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|(_, tp)| tp.is_none()), "{calls:?}");
    assert!(bodies.lock().unwrap().is_empty());

    // On.
    let traced = format!("[traces]\nendpoint = \"{collector}\"\n{toml}");
    std::fs::write(dir.path().join("ballast.toml"), traced).unwrap();
    let node = Serve::start(dir.path(), &env).await;
    let ids = run_records(&t, 3, "on").await;
    // Stopping sends what is still queued.
    node.stop().await;

    let mut spans: Vec<Span> = Vec::new();
    for body in bodies.lock().unwrap().iter() {
        let req = ExportTraceServiceRequest::decode(body.clone()).unwrap();
        for rs in req.resource_spans {
            let resource = rs.resource.unwrap_or_default();
            match attr(&resource.attributes, "service.name") {
                Some(any_value::Value::StringValue(name)) => assert_eq!(name, "ballast"),
                other => panic!("service.name: {other:?}"),
            }
            spans.extend(rs.scope_spans.into_iter().flat_map(|s| s.spans));
        }
    }
    let by_id: HashMap<Vec<u8>, &Span> = spans.iter().map(|s| (s.span_id.clone(), s)).collect();
    let calls: Vec<Seen> = provider.calls.lock().unwrap()[2..].to_vec();
    println!("{} spans exported; {} calls", spans.len(), calls.len());
    assert_eq!(calls.len(), 6, "{calls:?}");
    let mut traces = std::collections::HashSet::new();
    for (record, tp) in &calls {
        assert!(ids.contains(record), "{record} not among {ids:?}");
        let tp = tp.as_deref().expect("every call carries a traceparent");
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4, "{tp}");
        assert_eq!((parts[0], parts[3]), ("00", "01"), "version, sampled: {tp}");
        let (trace, span_id) = (
            hex::decode(parts[1]).unwrap(),
            hex::decode(parts[2]).unwrap(),
        );
        // The provider's parent is our call span.
        let call = by_id
            .get(&span_id)
            .unwrap_or_else(|| panic!("no span {tp}"));
        assert_eq!((call.name.as_str(), &call.trace_id), ("call", &trace));
        assert_eq!(call.kind, SpanKind::Client as i32);
        assert_eq!(int(call, "record.id"), *record);
        assert_eq!(text(call, "step"), "charge");
        assert_eq!(text(call, "provider"), "sim");
        assert_eq!(text(call, "http.request.method"), "POST");
        let first = int(call, "attempt") == 1;
        let (outcome, status) = if first {
            ("retry", 503)
        } else {
            ("success", 200)
        };
        assert_eq!(text(call, "outcome"), outcome);
        assert_eq!(int(call, "http.response.status_code"), status);
        let error = call.status.as_ref().map(|s| s.code) == Some(OtelStatus::Error as i32);
        assert_eq!(error, first, "{:?}", call.status);
        // call → step → pass, the pass the root of its own trace.
        let step = by_id[&call.parent_span_id];
        assert_eq!((step.name.as_str(), text(step, "step")), ("step", "charge"));
        let pass = by_id[&step.parent_span_id];
        assert_eq!(pass.name, "pass");
        assert!(pass.parent_span_id.is_empty());
        assert_eq!(int(pass, "record.id"), *record);
        assert_eq!(text(pass, "pipeline"), "pay");
        // After the 503 the record waits out its backoff (`retrying`), or
        // is due again at once (`pending`) when the jittered backoff
        // comes out at nothing.
        let states: &[&str] = if first {
            &["retrying", "pending"]
        } else {
            &["succeeded"]
        };
        assert!(
            states.contains(&text(pass, "outcome")),
            "{:?}",
            text(pass, "outcome")
        );
        if first {
            assert_eq!(text(call, "error.type"), "provider_5xx");
        }
        assert!(traces.insert(trace), "one trace per pass");
        // The request kept is the request that left.
        let attempts = t.db.attempts(*record).await.unwrap();
        let kept = attempts
            .iter()
            .find(|a| {
                i64::from(a.attempt_no) == int(call, "attempt") && a.outcome.as_str() == outcome
            })
            .and_then(|a| a.request.as_ref())
            .unwrap();
        assert!(
            kept.headers
                .iter()
                .any(|(k, v)| k == "traceparent" && v == tp),
            "{kept:?}"
        );
    }
    // The record run with traces off has none kept either.
    for a in t.db.attempts(off[0]).await.unwrap() {
        let request = a.request.unwrap();
        assert!(!request.headers.iter().any(|(k, _)| k == "traceparent"));
    }

    // Sampled out: the provider still gets a traceparent (flagged not
    // sampled), and nothing is exported.
    let exports = bodies.lock().unwrap().len();
    let unsampled = format!("[traces]\nendpoint = \"{collector}\"\nsample = 0.0\n{toml}");
    std::fs::write(dir.path().join("ballast.toml"), unsampled).unwrap();
    let node = Serve::start(dir.path(), &env).await;
    run_records(&t, 1, "sampled-out").await;
    node.stop().await;
    let calls: Vec<Seen> = provider.calls.lock().unwrap()[8..].to_vec();
    assert_eq!(calls.len(), 2, "{calls:?}");
    for (_, tp) in &calls {
        let tp = tp.as_deref().expect("a traceparent when sampled out too");
        assert!(tp.starts_with("00-") && tp.ends_with("-00"), "{tp}");
    }
    let spans = bodies.lock().unwrap()[exports..]
        .iter()
        .map(|b| ExportTraceServiceRequest::decode(b.clone()).unwrap())
        .flat_map(|r| r.resource_spans)
        .flat_map(|r| r.scope_spans)
        .map(|s| s.spans.len())
        .sum::<usize>();
    assert_eq!(spans, 0);
}
