//! Triggers (issue 50 item 2): `POST /triggers/NAME` verifies its sender
//! by a preset (Stripe, GitHub, Standard Webhooks, a generic HMAC), maps
//! the event to a record of the trigger's pipeline (its id the key, so a
//! sender's retry enqueues nothing new), acknowledges the types it is
//! told to ignore, refuses the rest with clear statuses, counts every
//! verdict in `/metrics` and keeps each delivery for the triggers page.

use std::path::Path;

use ballast::auth::presets::{self, Encoding};
use ballast::auth::webhook;
use ballast::domain::Role;
use ballast::store::Backend;
use serde_json::{Value, json};

use crate::web::WebApp;

const OLD: &str = "old-trigger-secret-0123456789";
const NEW: &str = "new-trigger-secret-0123456789";
/// A Standard Webhooks secret: `whsec_` and base64 (of 24 bytes).
const WHSEC: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The configuration: a pipeline whose records sleep (nothing is called)
/// and a trigger of each preset, the secrets in files under `dir`.
fn config(dir: &Path) -> String {
    let file = |name: &str, secret: &str| {
        let path = dir.join(name);
        std::fs::write(&path, secret).unwrap();
        format!("{:?}", path.display().to_string())
    };
    let (old, new, whsec) = (file("old", OLD), file("new", NEW), file("whsec", WHSEC));
    format!(
        r#"
[[pipelines.fulfil.steps]]
name = "wait"
kind = "sleep"
for = "1h"

[triggers.stripe]
preset = "stripe"
secrets_file = [{old}, {new}]
pipeline = "fulfil"
accept = ["checkout.session.*"]
ignore = ["checkout.session.expired", "invoice.*"]
input = "/data/object"
priority = 8

[triggers.gh]
preset = "github"
secrets_file = [{new}]
pipeline = "fulfil"
accept = ["push"]
group = "/repository/name"

[triggers.std]
preset = "standard_webhooks"
secrets_file = [{whsec}]
pipeline = "fulfil"

[triggers.custom]
preset = "hmac"
header = "X-Signature"
encoding = "base64"
id = "/event_id"
secrets_file = [{new}]
pipeline = "fulfil"
"#
    )
}

/// A delivery's status and body.
async fn post(app: &WebApp, name: &str, headers: &[(&str, String)], body: &[u8]) -> (u16, Value) {
    let mut req = app
        .client
        .post(app.url(&format!("/triggers/{name}")))
        .header("content-type", "application/json")
        .body(body.to_vec());
    for (h, v) in headers {
        req = req.header(*h, v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn triggers_start_records_from_signed_events(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let Some(app) = WebApp::spawn(backend, "triggers", &config(dir.path())).await else {
        return;
    };
    let now_s = crate::helpers::wall_ms() / 1000;
    let stripe = |body: &[u8], secret: &str, at: i64| {
        vec![(
            "Stripe-Signature",
            webhook::sign(secret.as_bytes(), at, body),
        )]
    };
    // A Stripe event: a record of the pipeline, keyed by the event's id,
    // its input the pointed part, at the trigger's priority.
    let paid =
        br#"{"id":"evt_1","type":"checkout.session.completed","data":{"object":{"amount":5}}}"#;
    let (s, first) = post(&app, "stripe", &stripe(paid, NEW, now_s), paid).await;
    assert_eq!(s, 201, "{first}");
    assert_eq!(first["verdict"], "enqueued");
    let id = first["record_id"].as_i64().unwrap();
    let rec = app.t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.pipeline, "fulfil");
    assert_eq!(rec.external_key.as_deref(), Some("trigger:stripe:evt_1"));
    assert_eq!(rec.input, json!({"amount": 5}));
    assert_eq!(rec.priority, 8);
    // The sender's retry, signed with the other secret (rotation): the
    // same record, nothing new.
    let (s, again) = post(&app, "stripe", &stripe(paid, OLD, now_s), paid).await;
    assert_eq!(
        (s, &again["verdict"]),
        (200, &json!("duplicate")),
        "{again}"
    );
    assert_eq!(again["record_id"].as_i64(), Some(id));
    // Types it ignores are acknowledged; types it does not know refused.
    for (ty, status, verdict) in [
        ("invoice.paid", 200, "ignored"),
        ("checkout.session.expired", 200, "ignored"),
        ("charge.failed", 422, "unmapped_event"),
    ] {
        let body = format!(r#"{{"id":"evt_{ty}","type":"{ty}","data":{{"object":{{}}}}}}"#);
        let (s, v) = post(
            &app,
            "stripe",
            &stripe(body.as_bytes(), NEW, now_s),
            body.as_bytes(),
        )
        .await;
        assert_eq!(s, status, "{ty}: {v}");
        let code = if s == 200 { &v["verdict"] } else { &v["code"] };
        assert_eq!(code, verdict, "{ty}: {v}");
    }
    // Refusals: a wrong secret, a stale timestamp, no signature, not JSON.
    let wrong = "wrong-trigger-secret-0123456789";
    for (headers, status, code) in [
        (stripe(paid, wrong, now_s), 401, "bad_signature"),
        (stripe(paid, NEW, now_s - 600), 401, "stale_signature"),
        (Vec::new(), 401, "bad_signature_header"),
    ] {
        let (s, v) = post(&app, "stripe", &headers, paid).await;
        assert_eq!((s, &v["code"]), (status, &json!(code)), "{v}");
    }
    let junk = b"not json";
    let (s, v) = post(&app, "stripe", &stripe(junk, NEW, now_s), junk).await;
    assert_eq!((s, &v["code"]), (400, &json!("body_not_json")), "{v}");
    // GitHub: its delivery header is the id, its event header the type; the
    // group read from the body.
    let push = br#"{"ref":"refs/heads/main","repository":{"name":"api"}}"#;
    let gh = |event: &str, delivery: &str| {
        vec![
            (
                "X-Hub-Signature-256",
                presets::body_sign(NEW.as_bytes(), push, "sha256=", Encoding::Hex),
            ),
            ("X-GitHub-Event", event.to_owned()),
            ("X-GitHub-Delivery", delivery.to_owned()),
        ]
    };
    let (s, v) = post(&app, "gh", &gh("push", "d-1"), push).await;
    assert_eq!(s, 201, "{v}");
    let rec = app
        .t
        .db
        .get_record(v["record_id"].as_i64().unwrap())
        .await
        .unwrap()
        .unwrap();
    // GitHub signs the body alone: the record is known by the body's
    // digest, so the same delivery sent again under another delivery id
    // (a replay) names the same record.
    assert!(
        rec.external_key
            .as_deref()
            .unwrap()
            .starts_with("trigger:gh:sha256:")
    );
    let (s, replay) = post(&app, "gh", &gh("push", "d-forged"), push).await;
    assert_eq!(
        (s, &replay["verdict"]),
        (200, &json!("duplicate")),
        "{replay}"
    );
    assert_eq!(replay["record_id"], v["record_id"]);
    assert_eq!(rec.group.as_deref(), Some("api"));
    assert_eq!(rec.priority, ballast::domain::DEFAULT_PRIORITY);
    let (s, v) = post(&app, "gh", &gh("issues", "d-2"), push).await;
    assert_eq!((s, &v["code"]), (422, &json!("unmapped_event")), "{v}");
    // Each preset refuses what its secrets did not sign: the body changed
    // under GitHub's signature; a Standard Webhooks id changed under its
    // signature; an HMAC by another secret. The message says what the
    // preset expects when the header is missing.
    let (s, v) = post(
        &app,
        "gh",
        &gh("push", "d-3"),
        br#"{"repository":{"name":"web"}}"#,
    )
    .await;
    assert_eq!((s, &v["code"]), (401, &json!("bad_signature")), "{v}");
    let (s, v) = post(&app, "gh", &[], push).await;
    assert_eq!(
        (s, &v["code"]),
        (401, &json!("bad_signature_header")),
        "{v}"
    );
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("X-Hub-Signature-256"),
        "{v}"
    );
    // Standard Webhooks.
    let body = br#"{"type":"user.created","data":{"id":7}}"#;
    let sent = |id: &str, at: i64| {
        vec![
            ("webhook-id", id.to_owned()),
            ("webhook-timestamp", at.to_string()),
            (
                "webhook-signature",
                presets::standard_sign(WHSEC.as_bytes(), id, at, body),
            ),
        ]
    };
    let (s, v) = post(&app, "std", &sent("msg_1", now_s), body).await;
    assert_eq!(s, 201, "{v}");
    let mut forged = sent("msg_1", now_s);
    forged[0].1 = "msg_9".into();
    let (s, v) = post(&app, "std", &forged, body).await;
    assert_eq!((s, &v["code"]), (401, &json!("bad_signature")), "{v}");
    let (s, v) = post(&app, "std", &sent("msg_2", now_s - 3_600), body).await;
    assert_eq!((s, &v["code"]), (401, &json!("stale_signature")), "{v}");
    // A generic HMAC in base64; an event without the id it names.
    let with_id = br#"{"event_id":"e-9","n":1}"#;
    let hmac = |b: &[u8]| {
        vec![(
            "X-Signature",
            presets::body_sign(NEW.as_bytes(), b, "", Encoding::Base64),
        )]
    };
    let (s, v) = post(&app, "custom", &hmac(with_id), with_id).await;
    assert_eq!(s, 201, "{v}");
    let no_id = br#"{"n":2}"#;
    let (s, v) = post(&app, "custom", &hmac(no_id), no_id).await;
    assert_eq!((s, &v["code"]), (400, &json!("no_event_id")), "{v}");
    let other = vec![(
        "X-Signature",
        presets::body_sign(OLD.as_bytes(), with_id, "", Encoding::Base64),
    )];
    let (s, v) = post(&app, "custom", &other, with_id).await;
    assert_eq!((s, &v["code"]), (401, &json!("bad_signature")), "{v}");
    // Nobody else may take a trigger's key.
    let op = app.token(Role::Operator).await;
    let r = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .json(&json!({"pipeline": "fulfil", "key": "trigger:stripe:evt_2"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("kept for triggers"));
    let (s, v) = post(&app, "nowhere", &[], b"{}").await;
    assert_eq!((s, &v["code"]), (404, &json!("unknown_trigger")), "{v}");
    // Four records, no more.
    assert_eq!(crate::helpers::record_total(&app.t.db).await, 4);
    // Each delivery kept with its verdict (the unknown trigger's is not:
    // there is no such trigger), newest first, and counted.
    let kept = app.t.db.trigger_deliveries(None, 100).await.unwrap();
    // Refused signatures are counted, never kept (anyone can send them).
    assert_eq!(kept.len(), 12, "{kept:?}");
    assert!(
        kept.iter()
            .all(|d| d.status != 401 && d.pipeline == "fulfil")
    );
    assert_eq!(kept[0].verdict, "no_event_id");
    let dup = kept
        .iter()
        .find(|d| d.verdict == "duplicate" && d.trigger == "stripe")
        .unwrap();
    assert_eq!(
        (dup.record_id, dup.event_id.as_deref()),
        (Some(id), Some("evt_1"))
    );
    assert_eq!(
        dup.event_type.as_deref(),
        Some("checkout.session.completed")
    );
    let gh_kept = app.t.db.trigger_deliveries(Some("gh"), 100).await.unwrap();
    assert_eq!(gh_kept.len(), 3);
    let metrics = app.metrics().await;
    // (Counted per process: the other backend's run may have added to
    // these.)
    let count = |series: &str| -> u64 {
        let line = metrics.lines().find(|l| l.starts_with(series));
        line.and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        count(r#"ballast_trigger_deliveries_total{trigger="stripe",verdict="duplicate"}"#) >= 1
    );
    assert!(count(r#"ballast_trigger_deliveries_total{trigger="stripe",verdict="ignored"}"#) >= 2);
    assert!(count(r#"ballast_trigger_deliveries_total{trigger="gh",verdict="enqueued"}"#) >= 1);
    assert!(
        metrics.contains("# HELP ballast_trigger_deliveries_total"),
        "{metrics}"
    );
    // The triggers page: each trigger with its deliveries and verdicts,
    // for a caller who sees its pipeline; none for one who does not.
    app.user("vera", Role::Viewer).await;
    let vera = app.login("vera").await;
    let page = app.text("/triggers", Some(&vera)).await;
    for part in [
        "id=\"trigger-stripe\"",
        ">duplicate<",
        ">evt_1<",
        ">body_not_json<",
        "checkout.session.*",
    ] {
        assert!(page.contains(part), "{part} in\n{page}");
    }
    crate::scopes::user(&app, "otto", Role::Viewer, "other-*").await;
    let otto = app.login("otto").await;
    let page = app.text("/triggers", Some(&otto)).await;
    assert!(
        page.contains("<h1>Triggers</h1>")
            && page.contains("No trigger enqueues into a pipeline you may see"),
        "{page}"
    );
    assert!(
        !page.contains("trigger-stripe") && !page.contains("evt_1"),
        "{page}"
    );
    // Its secret's file gone: unavailable, and when to send it again.
    std::fs::remove_file(dir.path().join("whsec")).unwrap();
    let body = br#"{"type":"user.created","data":{"id":8}}"#;
    let at = crate::helpers::wall_ms() / 1000;
    let mut req = app
        .client
        .post(app.url("/triggers/std"))
        .header("content-type", "application/json")
        .body(body.to_vec());
    for (h, v) in [
        ("webhook-id", "msg_3".to_owned()),
        ("webhook-timestamp", at.to_string()),
        (
            "webhook-signature",
            presets::standard_sign(WHSEC.as_bytes(), "msg_3", at, body),
        ),
    ] {
        req = req.header(h, v);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers()["retry-after"], "5");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_triggers_start_records_from_signed_events() {
    triggers_start_records_from_signed_events(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_triggers_start_records_from_signed_events() {
    triggers_start_records_from_signed_events(Backend::Postgres).await;
}
