//! Notifications out (issue 50 item 1): `[[notify]]` subscriptions get a
//! notice for each change they want, written with the change (an
//! outbox), delivered in order per record, signed per Standard Webhooks
//! with the same id on every attempt, retried with the subscriber's
//! provider's backoff, given up after `retry_for`, and the subscription
//! turned off (audited) after `disable_after` of failing. Both backends;
//! the engine's clock is the test's, the subscriber a small server.

use std::path::Path;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use ballast::auth::presets::{self, StandardHeaders};
use ballast::config::Config;
use ballast::domain::{OperatorAction, RecordState, Role};
use ballast::engine::notify::Notifier;
use ballast::engine::{Enqueue, Ops, Stopping};
use ballast::store::{Backend, NoticeFilter};
use serde_json::{Value, json};

use crate::engine::{drain, manual_engine};
use crate::helpers::TestDb;

const WHSEC: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const MINUTE: u64 = 60_000;

/// One request the subscriber took.
#[derive(Debug, Clone)]
struct Got {
    path: String,
    id: String,
    timestamp: String,
    signature: String,
    body: Value,
    raw: Vec<u8>,
}

/// A subscriber (`/hooks`, `/slack`) answering with `status`, and a
/// provider for the records' calls (`/v1/charge`, always succeeding).
struct Subscriber {
    url: String,
    got: Arc<Mutex<Vec<Got>>>,
    status: Arc<AtomicU16>,
}

impl Subscriber {
    async fn spawn() -> Subscriber {
        use axum::routing::post;
        let got = Arc::new(Mutex::new(Vec::new()));
        let status = Arc::new(AtomicU16::new(200));
        let hook = {
            let (got, status) = (got.clone(), status.clone());
            move |uri: axum::http::Uri, headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let (got, status) = (got.clone(), status.clone());
                async move {
                    let h = |n: &str| {
                        headers
                            .get(n)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned()
                    };
                    got.lock().unwrap().push(Got {
                        path: uri.path().to_owned(),
                        id: h("webhook-id"),
                        timestamp: h("webhook-timestamp"),
                        signature: h("webhook-signature"),
                        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
                        raw: body.to_vec(),
                    });
                    // `/watch` always takes what it is sent.
                    let code = match uri.path() {
                        "/watch" => 200,
                        _ => status.load(Ordering::SeqCst),
                    };
                    (axum::http::StatusCode::from_u16(code).unwrap(), "ok")
                }
            }
        };
        let charge = || async { axum::Json(json!({ "id": "ch_1", "status": "succeeded" })) };
        let app = axum::Router::new()
            .route("/hooks", post(hook.clone()))
            .route("/slack", post(hook.clone()))
            .route("/watch", post(hook))
            .route("/v1/charge", post(charge));
        let url = crate::helpers::serve_router(app).await;
        Subscriber { url, got, status }
    }

    fn taken(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }
}

/// A provider `sim` at `url` whose `/v1/charge` succeeds, and a pipeline
/// `pay` calling it: records whose notices the tests want.
fn paid_via_sim(url: &str) -> String {
    format!(
        r#"
[providers.sim]
base_url = "{url}"
timeout = "30s"

[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.pay.steps]]
name = "charge"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "{{{{ record.id }}}}"}}' }}
"#
    )
}

/// The first test's configuration: two subscriptions to `url`, one
/// signed with a secret written under `dir`.
fn config(url: &str, dir: &Path) -> String {
    let secret = dir.join("whsec");
    std::fs::write(&secret, WHSEC).unwrap();
    let paid = paid_via_sim(url);
    format!(
        r#"
{paid}

[providers.hooks]
base_url = "{url}"
timeout = "30s"
retry = {{ base = "1s", cap = "1s", budget = 1.0, budget_floor = 1000.0 }}
# Failing on purpose here: its breaker is a test of its own.
breaker = {{ window = 500, min_calls = 500 }}


[[pipelines.hold.steps]]
name = "wait"
kind = "sleep"
for = "1h"

[[notify]]
name = "ops"
provider = "hooks"
path = "/hooks"
events = ["record.*", "provider.paused", "provider.resumed"]
secret_file = {secret:?}
retry_for = "1h"
disable_after = "10m"

[[notify]]
name = "chat"
provider = "hooks"
path = "/slack"
format = "slack"
events = ["record.parked"]
pipelines = ["hold"]
retry_for = "1h"
"#
    )
}

/// `text` as a node's configuration (its variables read from the test's
/// environment), checked; the store told its subscriptions' filters; an
/// engine on the test's clock.
async fn engine_of(
    db: &ballast::store::Db,
    text: &str,
) -> (
    Arc<Config>,
    ballast::engine::Engine,
    ballast::domain::ManualClock,
) {
    let config = Config::parse(text, Path::new("notify.toml")).unwrap();
    config.validate(&|v| std::env::var(v).ok()).unwrap();
    let config = Arc::new(config);
    db.set_notify_filters(config.notify.iter().map(|n| n.filter()).collect());
    let (engine, clock) = manual_engine(db, config.clone(), "n1").await;
    (config, engine, clock)
}

/// Runs the notifier round after round: each sends the oldest pending
/// notice of every subject, so a record's next one goes in the next.
async fn deliver_all(n: &Notifier) {
    for _ in 0..5 {
        n.deliver_due(&Stopping::default()).await.unwrap();
    }
}

async fn notices(db: &ballast::store::Db, sub: &str) -> Vec<ballast::store::Notice> {
    let f = NoticeFilter {
        subscription: Some(sub.into()),
        limit: 100,
        ..NoticeFilter::default()
    };
    let mut items = db.notices(&f).await.unwrap().items;
    items.reverse();
    items
}

fn verified(g: &Got, now_s: i64) {
    let h = StandardHeaders {
        id: &g.id,
        timestamp: &g.timestamp,
        signature: &g.signature,
    };
    presets::standard_verify(&[WHSEC.as_bytes().to_vec()], &h, &g.raw, now_s, 300)
        .unwrap_or_else(|e| panic!("{g:?}: {e:?}"));
}

async fn notifications_reach_subscribers(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "notify").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let sub = Subscriber::spawn().await;
    let (config, engine, clock) = engine_of(&t.db, &config(&sub.url, dir.path())).await;
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let notifier = Notifier::of(&engine);

    // A record that succeeds; one parked, resumed and cancelled by an
    // operator; a provider paused and resumed.
    let paid = engine
        .enqueue(Enqueue::new("pay", Some("p1"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    let held = engine
        .enqueue(Enqueue::new("hold", Some("h1"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drain(&engine).await;
    let act = |id, action, why: &str| {
        let ops = &ops;
        let why = Some(why.to_owned());
        async move { ops.act(id, action, "ann", why, None, None).await.unwrap() }
    };
    act(held, OperatorAction::Park, "checking the address").await;
    act(held, OperatorAction::Resume, "address fine").await;
    act(held, OperatorAction::Cancel, "customer left").await;
    ops.pause_provider("sim", true, "ann", Some("maintenance".into()))
        .await
        .unwrap();
    ops.pause_provider("sim", false, "ann", None).await.unwrap();
    assert_eq!(
        t.db.get_record(paid).await.unwrap().unwrap().state,
        RecordState::Succeeded
    );

    // Each wanted change wrote one notice per subscription, nothing else
    // (claims, advances, the sleep's wait are no news).
    let topics = |ns: &[ballast::store::Notice]| {
        ns.iter()
            .map(|n| (n.subject.clone(), n.topic.clone()))
            .collect::<Vec<_>>()
    };
    let (p, h) = (format!("record:{paid}"), format!("record:{held}"));
    let ops_notices = notices(&t.db, "ops").await;
    assert_eq!(
        topics(&ops_notices),
        [
            (p.clone(), "record.succeeded".into()),
            (h.clone(), "record.parked".into()),
            (h.clone(), "record.resumed".into()),
            (h.clone(), "record.cancelled".into()),
            ("provider:sim".into(), "provider.paused".into()),
            ("provider:sim".into(), "provider.resumed".into()),
        ]
    );
    assert_eq!(
        topics(&notices(&t.db, "chat").await),
        [(h.clone(), "record.parked".into())]
    );

    // Delivered: signed, in order per subject, each with its own id.
    deliver_all(&notifier).await;
    let now_s = clock_s(&clock);
    let got = sub.taken();
    let hooks: Vec<&Got> = got.iter().filter(|g| g.path == "/hooks").collect();
    assert_eq!(hooks.len(), 6, "{got:?}");
    for g in &hooks {
        verified(g, now_s);
    }
    let held_types: Vec<&str> = hooks
        .iter()
        .filter(|g| g.body["data"]["record"]["id"] == json!(held))
        .map(|g| g.body["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        held_types,
        ["record.parked", "record.resumed", "record.cancelled"]
    );
    let parked = hooks
        .iter()
        .find(|g| g.body["type"] == "record.parked")
        .unwrap();
    assert_eq!(parked.body["data"]["record"]["key"], "h1");
    assert_eq!(parked.body["data"]["record"]["pipeline"], "hold");
    assert_eq!(parked.body["data"]["record"]["state"], "parked");
    assert_eq!(parked.body["data"]["reason"], "checking the address");
    assert_eq!(parked.body["data"]["actor"], "ann");
    let ids: std::collections::BTreeSet<&str> = hooks.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(ids.len(), 6);
    // The Slack-compatible one: a line of text, no signature asked.
    let slack: Vec<&Got> = got.iter().filter(|g| g.path == "/slack").collect();
    assert_eq!(slack.len(), 1);
    let text = slack[0].body["text"].as_str().unwrap();
    assert!(
        text.starts_with(&format!(
            "Record {held} (`h1`, pipeline `hold`): record.parked"
        )),
        "{text}"
    );
    assert!(slack[0].signature.is_empty());
    for n in notices(&t.db, "ops").await {
        assert_eq!((n.state.as_str(), n.attempts), ("delivered", 1), "{n:?}");
    }

    // A subscriber failing: the notice is tried again after the backoff,
    // with the same id and body; delivered once the subscriber is back.
    sub.status.store(503, Ordering::SeqCst);
    let again = enqueue_paid(&engine, "p2").await;
    deliver_all(&notifier).await;
    let sent = |id: &str| sub.taken().iter().filter(|g| g.id == id).count();
    let last = notices(&t.db, "ops").await.pop().unwrap();
    assert_eq!(last.record_id, Some(again));
    assert_eq!((last.state.as_str(), last.attempts), ("pending", 1));
    assert_eq!(last.status, Some(503));
    let id = last.message_id.clone();
    assert!(id.starts_with("msg_"), "{id}");
    assert_eq!(sent(&id), 1);
    // Not before its backoff.
    deliver_all(&notifier).await;
    assert_eq!(sent(&id), 1);
    sub.status.store(200, Ordering::SeqCst);
    clock.advance(2_000);
    deliver_all(&notifier).await;
    assert_eq!(sent(&id), 2);
    let tries: Vec<Got> = sub.taken().into_iter().filter(|g| g.id == id).collect();
    assert_eq!(tries[0].raw, tries[1].raw);
    let last = notices(&t.db, "ops").await.pop().unwrap();
    assert_eq!((last.state.as_str(), last.attempts), ("delivered", 2));

    // In order per record: while a record's first notice fails, its next
    // waits; a throttle ("slow down") holds the notice without spending
    // an attempt.
    let h2 = engine
        .enqueue(Enqueue::new("hold", Some("h2"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drain(&engine).await;
    sub.status.store(500, Ordering::SeqCst);
    act(h2, OperatorAction::Park, "look").await;
    act(h2, OperatorAction::Resume, "fine").await;
    deliver_all(&notifier).await;
    let of_h2 = || {
        sub.taken()
            .iter()
            .filter(|g| g.path == "/hooks" && g.body["data"]["record"]["id"] == json!(h2))
            .map(|g| g.body["type"].as_str().unwrap().to_owned())
            .collect::<Vec<String>>()
    };
    assert_eq!(of_h2(), ["record.parked"]);
    // "Slow down" (either this notice's own answer, or the chat
    // subscription's to the same provider, holding this one back).
    sub.status.store(429, Ordering::SeqCst);
    clock.advance(2_000);
    deliver_all(&notifier).await;
    let head = notices(&t.db, "ops")
        .await
        .into_iter()
        .find(|n| n.record_id == Some(h2))
        .unwrap();
    assert_eq!(
        (head.state.as_str(), head.attempts),
        ("pending", 1),
        "{head:?}"
    );
    sub.status.store(200, Ordering::SeqCst);
    clock.advance(2_000);
    deliver_all(&notifier).await;
    let got = of_h2();
    assert_eq!(
        got.last().map(String::as_str),
        Some("record.resumed"),
        "{got:?}"
    );
    assert!(
        got[..got.len() - 1].iter().all(|t| t == "record.parked") && got.len() >= 3,
        "{got:?}"
    );
    // Sent again only while nothing of its record is pending: it could
    // overtake, or be overtaken by, the one under way.
    sub.status.store(500, Ordering::SeqCst);
    act(h2, OperatorAction::Park, "again").await;
    let refused =
        t.db.redeliver_notice(head.id, "ann", clock_ms(&clock))
            .await;
    assert_eq!(refused.unwrap_err().code(), "conflict");

    // Failing for `disable_after`: turned off, audited; nothing more is
    // sent until an operator turns it on again.
    sub.status.store(500, Ordering::SeqCst);
    let third = enqueue_paid(&engine, "p3").await;
    deliver_all(&notifier).await;
    clock.advance(10 * MINUTE);
    deliver_all(&notifier).await;
    let states = t.db.subscription_states().await.unwrap();
    let ops_state = states.iter().find(|s| s.name == "ops").unwrap();
    assert!(ops_state.disabled_at.is_some(), "{states:?}");
    let audit =
        t.db.audit_log(&ballast::store::AuditFilter {
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        audit.items.iter().any(|e| e.kind == "notify_disabled"),
        "{:?}",
        audit.items
    );
    let hooks_now = || sub.taken().iter().filter(|g| g.path == "/hooks").count();
    let before = hooks_now();
    sub.status.store(200, Ordering::SeqCst);
    clock.advance(MINUTE);
    deliver_all(&notifier).await;
    assert_eq!(
        hooks_now(),
        before,
        "a subscription turned off sends nothing"
    );
    t.db.turn_subscription("ops", true, "ann", clock_ms(&clock))
        .await
        .unwrap();
    deliver_all(&notifier).await;
    let last = notices(&t.db, "ops").await.pop().unwrap();
    assert_eq!(
        (last.record_id, last.state.as_str()),
        (Some(third), "delivered")
    );

    // Given up after `retry_for` (the chat subscription's hour, failing
    // all along: its `disable_after` is days); an operator sends it again.
    sub.status.store(500, Ordering::SeqCst);
    let h3 = engine
        .enqueue(Enqueue::new("hold", Some("h3"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drain(&engine).await;
    act(h3, OperatorAction::Park, "stuck").await;
    for _ in 0..7 {
        deliver_all(&notifier).await;
        clock.advance(10 * MINUTE);
    }
    let last = notices(&t.db, "chat").await.pop().unwrap();
    assert_eq!(
        (last.record_id, last.state.as_str()),
        (Some(h3), "failed"),
        "{last:?}"
    );
    let chat = t.db.subscription_states().await.unwrap();
    let chat = chat.iter().find(|s| s.name == "chat").unwrap();
    assert!(chat.disabled_at.is_none() && chat.failing_since.is_some());
    let redone =
        t.db.redeliver_notice(last.id, "ann", clock_ms(&clock))
            .await
            .unwrap();
    assert_eq!(redone.state, "pending");
    // Sent again, it has a `retry_for` of its own: a failure now is
    // retried, not given up at once.
    sub.status.store(500, Ordering::SeqCst);
    deliver_all(&notifier).await;
    let last = notices(&t.db, "chat").await.pop().unwrap();
    assert_eq!(
        (last.state.as_str(), last.since),
        ("pending", redone.since),
        "{last:?}"
    );
    sub.status.store(200, Ordering::SeqCst);
    clock.advance(2_000);
    deliver_all(&notifier).await;
    let last = notices(&t.db, "chat").await.pop().unwrap();
    assert_eq!(last.state, "delivered");

    // A secret the subscription cannot read holds its notices, nothing
    // sent and no attempt counted, and is looked for again 30 s later.
    // (`ops` was turned off again by the hour of failures above.)
    t.db.turn_subscription("ops", true, "ann", clock_ms(&clock))
        .await
        .unwrap();
    let secret = dir.path().join("whsec");
    std::fs::remove_file(&secret).unwrap();
    let before = sub.taken().len();
    enqueue_paid(&engine, "p-unsigned").await;
    deliver_all(&notifier).await;
    assert_eq!(sub.taken().len(), before);
    let held = notices(&t.db, "ops").await.pop().unwrap();
    assert_eq!(
        (held.state.as_str(), held.attempts),
        ("pending", 0),
        "{held:?}"
    );
    std::fs::write(&secret, WHSEC).unwrap();
    clock.advance(20_000);
    deliver_all(&notifier).await;
    assert_eq!(sub.taken().len(), before);
    clock.advance(11_000);
    deliver_all(&notifier).await;
    let sent = notices(&t.db, "ops").await.pop().unwrap();
    assert_eq!((sent.id, sent.state.as_str()), (held.id, "delivered"));
    let signed = sub.taken().into_iter().rfind(|g| g.path == "/hooks");
    verified(&signed.unwrap(), clock_s(&clock));
    assert_eq!(
        t.db.redeliver_notice(i64::MAX, "ann", 0)
            .await
            .unwrap_err()
            .code(),
        "not_found"
    );
}

async fn enqueue_paid(engine: &ballast::engine::Engine, key: &str) -> i64 {
    let id = engine
        .enqueue(Enqueue::new("pay", Some(key), json!({})))
        .await
        .unwrap()
        .record
        .id;
    drain(engine).await;
    id
}

fn clock_ms(clock: &ballast::domain::ManualClock) -> i64 {
    use ballast::domain::Clock;
    clock.now_ms()
}

fn clock_s(clock: &ballast::domain::ManualClock) -> i64 {
    clock_ms(clock) / 1000
}

/// A subscriber that fails is a provider with a breaker: its failures
/// open it (news to another subscription), nothing is sent while it is
/// open, a probe goes once it half-opens, and its success closes it and
/// lets the rest through.
async fn a_failing_subscriber_opens_its_breaker(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "notify_breaker").await else {
        return;
    };
    let sub = Subscriber::spawn().await;
    let url = &sub.url;
    let paid = paid_via_sim(url);
    let text = format!(
        r#"
{paid}

[providers.strict]
base_url = "{url}"
timeout = "30s"
retry = {{ base = "1s", cap = "1s", budget = 1.0, budget_floor = 1000.0 }}
breaker = {{ window = 4, min_calls = 2, failure_rate = 0.5, open_for = "1m", probes = 1 }}


[[notify]]
name = "strict"
provider = "strict"
path = "/hooks"
format = "slack"
events = ["record.succeeded"]

[[notify]]
name = "watch"
provider = "sim"
path = "/watch"
format = "slack"
events = ["provider.breaker_*"]
providers = ["strict"]
"#
    );
    let (_, engine, clock) = engine_of(&t.db, &text).await;
    let notifier = Notifier::of(&engine);
    sub.status.store(500, Ordering::SeqCst);
    for key in ["b1", "b2", "b3"] {
        enqueue_paid(&engine, key).await;
    }
    let at = |path: &str| {
        sub.taken()
            .into_iter()
            .filter(|g| g.path == path)
            .map(|g| g.body["text"].as_str().unwrap_or("").to_owned())
            .collect::<Vec<String>>()
    };
    deliver_all(&notifier).await;
    let failed = at("/hooks").len();
    assert!(failed >= 2, "{failed}");
    let watched = at("/watch");
    assert_eq!(watched.len(), 1, "{watched:?}");
    assert!(watched[0].starts_with("Provider `strict`: provider.breaker_opened"));
    // Open: nothing goes, however long the notices have been due.
    clock.advance(30_000);
    deliver_all(&notifier).await;
    assert_eq!(at("/hooks").len(), failed);
    // Half-open after `open_for`: a probe; its success closes it.
    sub.status.store(200, Ordering::SeqCst);
    clock.advance(31_000);
    for _ in 0..10 {
        deliver_all(&notifier).await;
        let pending = notices(&t.db, "strict")
            .await
            .iter()
            .filter(|n| n.state != "delivered")
            .count();
        if pending == 0 {
            break;
        }
        clock.advance(5_000);
    }
    for n in notices(&t.db, "strict").await {
        assert_eq!(n.state, "delivered", "{n:?}");
    }
    let watched = at("/watch");
    assert_eq!(watched.len(), 2, "{watched:?}");
    assert!(watched[1].starts_with("Provider `strict`: provider.breaker_closed"));
}

/// A subscriber that takes OAuth2 client-credentials tokens gets one on
/// every delivery, as a step's call would: a `401` drops it and the
/// delivery is sent again at once with a new one (the refusal not
/// counted); the reply kept has it scrubbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oauth2_subscriber_gets_its_token() {
    use crate::engine::{TokenProvider, client_basic, oauth2_provider};
    let Some(t) = TestDb::migrated(Backend::Sqlite, "notify_oauth2").await else {
        return;
    };
    let sub = Subscriber::spawn().await;
    let state = Arc::new(Mutex::new(TokenProvider::default()));
    let basic = client_basic("ballast", env!("CARGO_MANIFEST_DIR"));
    let base = oauth2_provider(state.clone(), basic).await;
    let url = &sub.url;
    let paid = paid_via_sim(url);
    let text = format!(
        r#"
{paid}

[providers.crm]
base_url = "{base}"
timeout = "30s"
oauth2 = {{ token_url = "{base}/oauth/token", client_id_env = "CARGO_PKG_NAME", client_secret_env = "CARGO_MANIFEST_DIR" }}
retry = {{ base = "1s", cap = "1s", budget = 1.0, budget_floor = 1000.0 }}


[[notify]]
name = "crm"
provider = "crm"
path = "/v1/charge"
format = "slack"
events = ["record.succeeded"]
"#
    );
    let (_, engine, _) = engine_of(&t.db, &text).await;
    let notifier = Notifier::of(&engine);
    enqueue_paid(&engine, "o1").await;
    deliver_all(&notifier).await;
    let sent = notices(&t.db, "crm").await;
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].state, "delivered", "{:?}", sent[0]);
    assert_eq!(state.lock().unwrap().granted.len(), 1);
    assert_eq!(state.lock().unwrap().charges, 1);
    // The token dies: the delivery refused is sent again at once with a
    // new one, the refusal not counted against the notice.
    state.lock().unwrap().valid.clear();
    enqueue_paid(&engine, "o2").await;
    deliver_all(&notifier).await;
    let second = notices(&t.db, "crm").await.pop().unwrap();
    assert_eq!(
        (second.state.as_str(), second.attempts),
        ("delivered", 1),
        "{second:?}"
    );
    {
        let s = state.lock().unwrap();
        assert_eq!((s.granted.len(), s.charges, s.refused), (2, 2, 1));
    }
    // A subscriber that refuses every token: refused again after the
    // renewal, the delivery fails (and is retried), the token scrubbed
    // from the reply kept.
    state.lock().unwrap().refuse_all = true;
    enqueue_paid(&engine, "o3").await;
    deliver_all(&notifier).await;
    let third = notices(&t.db, "crm").await.pop().unwrap();
    assert_eq!(
        (third.state.as_str(), third.attempts, third.status),
        ("pending", 1, Some(401)),
        "{third:?}"
    );
    let reply = third.reply.clone().unwrap_or_default();
    let s = state.lock().unwrap();
    assert!(reply.contains("invalid_token"), "{reply}");
    for token in &s.granted {
        assert!(!reply.contains(token.as_str()), "{reply}");
    }
    assert_eq!((s.granted.len(), s.refused), (3, 3));
}

/// A subscriber slow to answer holds up its own subscription only: while
/// one delivery to it waits for a reply, the node's notifier (its real
/// loop, on the test's clock) keeps delivering another subscription's
/// notices, a full round's next at once; once the slow one answers, its
/// backlog goes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_subscriber_holds_up_no_other() {
    use axum::routing::post;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;
    let Some(t) = TestDb::migrated(Backend::Sqlite, "notify_slow").await else {
        return;
    };
    let sub = Subscriber::spawn().await;
    // The slow subscriber answers only once the test lets it.
    let (held, answer) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(tokio::sync::Semaphore::new(0)),
    );
    let slow = {
        let (held, answer) = (held.clone(), answer.clone());
        move || {
            let (held, answer) = (held.clone(), answer.clone());
            async move {
                held.fetch_add(1, Ordering::SeqCst);
                let _ = answer.acquire().await;
                "ok"
            }
        }
    };
    let slow_url =
        crate::helpers::serve_router(axum::Router::new().route("/slow", post(slow))).await;
    let url = &sub.url;
    let paid = paid_via_sim(url);
    let text = format!(
        r#"
{paid}

[providers.quick]
base_url = "{url}"
timeout = "60s"
concurrency = 1

[providers.sluggish]
base_url = "{slow_url}"
timeout = "60s"

[[notify]]
name = "quick"
provider = "quick"
path = "/watch"
format = "slack"
events = ["record.succeeded"]

[[notify]]
name = "sluggish"
provider = "sluggish"
path = "/slow"
format = "slack"
events = ["record.succeeded"]
"#
    );
    let (_, engine, clock) = engine_of(&t.db, &text).await;
    let (stop, running) = crate::engine::run_in_background(&engine);
    let quick_got = || sub.taken().iter().filter(|g| g.path == "/watch").count();
    // Each check moves the clock a second: the notifier's next round.
    let tick = || clock.advance(1_000);
    enqueue_paid(&engine, "s1").await;
    crate::helpers::poll_until(
        "both subscribers sent s1",
        Duration::from_secs(30),
        async || {
            tick();
            (quick_got() == 1 && held.load(Ordering::SeqCst) == 1).then_some(())
        },
    )
    .await;
    // The slow one still holds s1's delivery: s2 and s3 reach the quick
    // one all the same, in one second of the clock (its concurrency is
    // one: a full round starts its next at once).
    enqueue_paid(&engine, "s2").await;
    enqueue_paid(&engine, "s3").await;
    // Their notices queued first (the passes run on the engine's own
    // time): a round that began before them would leave them to the next.
    crate::helpers::poll_until(
        "s2 and s3 succeeded, their notices queued",
        Duration::from_secs(30),
        async || (notices(&t.db, "quick").await.len() == 3).then_some(()),
    )
    .await;
    tick();
    crate::helpers::poll_until(
        "the quick subscriber sent s2 and s3",
        Duration::from_secs(30),
        async || (quick_got() == 3).then_some(()),
    )
    .await;
    assert_eq!(
        held.load(Ordering::SeqCst),
        1,
        "the slow subscription's next round waits for its reply"
    );
    // It answers: its backlog goes.
    answer.add_permits(100);
    crate::helpers::poll_until(
        "the slow subscriber's backlog delivered",
        Duration::from_secs(30),
        async || {
            tick();
            let sent = notices(&t.db, "sluggish").await;
            (sent.len() == 3 && sent.iter().all(|n| n.state == "delivered")).then_some(())
        },
    )
    .await;
    stop.cancel();
    running.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failing_subscriber_opens_its_breaker() {
    a_failing_subscriber_opens_its_breaker(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failing_subscriber_opens_its_breaker() {
    a_failing_subscriber_opens_its_breaker(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_notifications_reach_subscribers() {
    notifications_reach_subscribers(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_notifications_reach_subscribers() {
    notifications_reach_subscribers(Backend::Postgres).await;
}

/// The control plane's side, on a live node (its notifier on the system
/// clock): the notices and subscriptions through the API and the page,
/// a redelivery by an operator (the same `webhook-id` again), a
/// subscription turned off and on by an admin, each audited; a viewer
/// limited to another pipeline sees none of these notices.
async fn operators_see_and_steer_notifications(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let sub = Subscriber::spawn().await;
    let secret = dir.path().join("whsec");
    std::fs::write(&secret, WHSEC).unwrap();
    let extra = format!(
        r#"
[providers.hooks]
base_url = "{}"

[[pipelines.hold.steps]]
name = "wait"
kind = "sleep"
for = "1h"

[[pipelines.other.steps]]
name = "wait"
kind = "sleep"
for = "1h"

[[notify]]
name = "ops"
provider = "hooks"
path = "/hooks"
events = ["record.parked"]
secret_file = {:?}
"#,
        sub.url,
        secret.display().to_string()
    );
    let Some(app) = crate::web::WebApp::spawn(backend, "notify_web", &extra).await else {
        return;
    };
    let (viewer, operator, admin) = (
        app.token(Role::Viewer).await,
        app.token(Role::Operator).await,
        app.token(Role::Admin).await,
    );
    let api = |method: &str, path: &str, token: &str| {
        let url = app.url(&format!("/api/v1{path}"));
        let req = match method {
            "get" => app.client.get(url),
            _ => app.client.post(url),
        };
        let req = req.bearer_auth(token);
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (s, made) = api_enqueue(&app, &operator).await;
    assert!(matches!(s, 200 | 201), "{made}");
    let id = made["id"]
        .as_i64()
        .or(made["record"]["id"].as_i64())
        .unwrap();
    let asleep = async || {
        let rec = app.t.db.get_record(id).await.unwrap()?;
        (rec.state == RecordState::Waiting).then_some(())
    };
    crate::helpers::poll_until("asleep", std::time::Duration::from_secs(30), asleep).await;
    let (s, parked) = api_act(&app, &operator, id, "park").await;
    assert_eq!(s, 200, "{parked}");
    // Delivered by the node's notifier.
    let delivered = async || {
        let (_, page) = api("get", "/notifications?state=delivered", &viewer).await;
        page["items"].as_array().filter(|i| !i.is_empty()).cloned()
    };
    let items = crate::helpers::poll_until(
        "the park delivered",
        std::time::Duration::from_secs(30),
        delivered,
    )
    .await;
    let notice = &items[0];
    assert_eq!(notice["topic"], "record.parked");
    assert_eq!(notice["record_id"], json!(id));
    assert_eq!(notice["attempts"], 1);
    assert_eq!(notice["status"], 200);
    let nid = notice["id"].as_i64().unwrap();
    let (_, subs) = api("get", "/notifications/subscriptions", &viewer).await;
    assert_eq!(subs["items"][0]["name"], "ops");
    assert_eq!(subs["items"][0]["on"], true);

    // Sent again by an operator (a viewer may not), same id.
    let path = format!("/notifications/{nid}/redeliver");
    assert_eq!(api("post", &path, &viewer).await.0, 403);
    let (s, again) = api("post", &path, &operator).await;
    assert_eq!((s, &again["state"]), (200, &json!("pending")), "{again}");
    let mid = notice["message_id"].as_str().unwrap().to_owned();
    let twice = async || {
        let n = sub.taken().iter().filter(|g| g.id == mid).count();
        (n == 2).then_some(())
    };
    crate::helpers::poll_until("sent again", std::time::Duration::from_secs(30), twice).await;
    assert_eq!(
        api("post", "/notifications/999999/redeliver", &operator)
            .await
            .0,
        404
    );

    // Turned off and on by an admin (an operator may not); audited.
    let off = "/notifications/subscriptions/ops/disable";
    assert_eq!(api("post", off, &operator).await.0, 403);
    let (s, state) = api("post", off, &admin).await;
    assert_eq!((s, &state["on"]), (200, &json!(false)), "{state}");
    let (s, state) = api("post", "/notifications/subscriptions/ops/enable", &admin).await;
    assert_eq!((s, &state["on"]), (200, &json!(true)), "{state}");
    assert_eq!(
        api("post", "/notifications/subscriptions/nope/enable", &admin)
            .await
            .0,
        404
    );
    let (_, audit) = api("get", "/audit", &viewer).await;
    let kinds: Vec<&str> = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    for kind in ["notice_redelivered", "notify_disabled", "notify_enabled"] {
        assert!(kinds.contains(&kind), "{kind}: {kinds:?}");
    }

    // The page: the subscription and the notice; a viewer of another
    // pipeline sees neither (the subscription is not limited to hers).
    app.user("vera", Role::Viewer).await;
    let vera = app.login("vera").await;
    let page = app.text("/notifications", Some(&vera)).await;
    assert!(page.contains("subscription-ops"), "{page}");
    assert!(page.contains(&format!("notice-{nid}")), "{page}");
    // The page's own buttons: an operator sends again, an admin turns
    // off and on (a viewer may do neither).
    let form = |l: &crate::web::Login| vec![("csrf", l.csrf.clone())];
    let post = |path: String, l: crate::web::Login| {
        let app = &app;
        async move {
            let f = form(&l);
            let f: Vec<(&str, &str)> = f.iter().map(|(k, v)| (*k, v.as_str())).collect();
            app.post(&path, Some(&l), &f).await.status().as_u16()
        }
    };
    app.user("olga", Role::Operator).await;
    let redo = format!("/notifications/{nid}/redeliver");
    assert_eq!(post(redo.clone(), app.login("vera").await).await, 403);
    let olga = app.login("olga").await;
    let sent = async || {
        let (_, n) = api("get", &format!("/notifications?record_id={id}"), &viewer).await;
        (n["items"][0]["state"] == "delivered").then_some(())
    };
    crate::helpers::poll_until("delivered again", std::time::Duration::from_secs(30), sent).await;
    assert_eq!(post(redo, olga).await, 303);
    let off = "/notifications/subscriptions/ops/disable".to_owned();
    assert_eq!(post(off.clone(), app.login("olga").await).await, 403);
    assert_eq!(post(off, app.login("admin").await).await, 303);
    let (_, subs) = api("get", "/notifications/subscriptions", &viewer).await;
    assert_eq!(subs["items"][0]["on"], false);
    // An action keeps the page it was taken on: its forms carry the
    // page's filters, and it comes back to them.
    let admin = app.login("admin").await;
    let filtered = "subscription=ops&state=delivered";
    let page = app
        .text(&format!("/notifications?{filtered}"), Some(&admin))
        .await;
    let on = format!("/notifications/subscriptions/ops/enable?{filtered}");
    assert!(page.contains(&on.replace('&', "&#38;")), "{page}");
    let r = app.post(&on, Some(&admin), &[("csrf", &admin.csrf)]).await;
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers()["location"],
        format!("/notifications?{filtered}").as_str()
    );
    crate::scopes::user(&app, "otto", Role::Viewer, "other").await;
    let otto = app.login("otto").await;
    let page = app.text("/notifications", Some(&otto)).await;
    assert!(!page.contains("subscription-ops"), "{page}");
    assert!(!page.contains(&format!("notice-{nid}")), "{page}");
    app.stop().await;
}

async fn api_enqueue(app: &crate::web::WebApp, token: &str) -> (u16, Value) {
    let r = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(token)
        .json(&json!({ "pipeline": "hold", "key": "h1", "input": {} }))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn api_act(app: &crate::web::WebApp, token: &str, id: i64, action: &str) -> (u16, Value) {
    let r = app
        .client
        .post(app.url(&format!("/api/v1/records/{id}/actions")))
        .bearer_auth(token)
        .json(&json!({ "action": action, "reason": "checking" }))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_operators_see_and_steer_notifications() {
    operators_see_and_steer_notifications(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_operators_see_and_steer_notifications() {
    operators_see_and_steer_notifications(Backend::Postgres).await;
}
