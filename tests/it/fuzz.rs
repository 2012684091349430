//! Item 5 of the fault battery: time-boxed fuzzing of everything that reads
//! input Ballast does not control — provider replies and the rules that
//! classify them, `Retry-After`, webhook signature headers, the
//! configuration file, request templates. Each target runs proptest cases
//! for `BALLAST_FUZZ_SECS` seconds (default 2, the smoke run CI does;
//! `scripts/faults/run fuzz` gives each 600) and prints its figures. A panic
//! fails the target with the smallest input that shows it; a case slower
//! than 1 s fails it too, and a case that never returns is reported and
//! aborts the process after 10 s (the only way to end a hang; other tests
//! running in the same process lose their clean-up, which on a hang found
//! is the lesser harm). Oversized request bodies are refused with
//! 413 in `api::api_round_trip_*` (enqueue) and
//! `http::callbacks_complete_steps_and_reversals_park_records` (webhooks).

use std::fmt::Debug;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use ballast::domain::rules::{Reply, ReplyError, classify};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};

/// A case slower than this fails its target.
const SLOW: Duration = Duration::from_secs(1);
/// A case running longer than this is a hang: reported, then abort.
const HANG: Duration = Duration::from_secs(10);

fn budget() -> Duration {
    let secs = std::env::var("BALLAST_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

/// Runs `check` on values of `strategy` until the budget is spent, in
/// rounds of fresh random seeds; panics (with the shrunk input) on the
/// first failure.
fn fuzz<S>(name: &str, strategy: S, check: impl Fn(&S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: Debug,
{
    let epoch = Instant::now();
    // Watchdog: when the running case started (ms since `epoch`, 0: none).
    let running_since = Arc::new(AtomicU64::new(0));
    let current = Arc::new(Mutex::new(String::new()));
    let done = Arc::new(AtomicU64::new(0));
    let watchdog = {
        let (running_since, current, done) = (running_since.clone(), current.clone(), done.clone());
        let name = name.to_owned();
        std::thread::spawn(move || {
            while done.load(Ordering::Relaxed) == 0 {
                let since = running_since.load(Ordering::Relaxed);
                let now = epoch.elapsed().as_millis() as u64;
                if since > 0 && now.saturating_sub(since) > HANG.as_millis() as u64 {
                    eprintln!(
                        "fuzz {name}: a case ran over {HANG:?}, aborting: {}",
                        current.lock().unwrap()
                    );
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let (cases, slowest) = (AtomicU64::new(0), AtomicU64::new(0));
    let until = epoch + budget();
    let mut rounds = 0;
    while Instant::now() < until {
        rounds += 1;
        let mut runner = TestRunner::new(Config {
            cases: 256,
            failure_persistence: None,
            ..Config::default()
        });
        let result = runner.run(&strategy, |value| {
            *current.lock().unwrap() = format!("{value:?}");
            let started = Instant::now();
            running_since.store(epoch.elapsed().as_millis() as u64 + 1, Ordering::Relaxed);
            let outcome = check(&value);
            running_since.store(0, Ordering::Relaxed);
            let took = started.elapsed();
            cases.fetch_add(1, Ordering::Relaxed);
            slowest.fetch_max(took.as_micros() as u64, Ordering::Relaxed);
            outcome?;
            prop_assert!(took < SLOW, "a case took {took:?}");
            Ok(())
        });
        if let Err(e) = result {
            done.store(1, Ordering::Relaxed);
            panic!("fuzz {name}: {e}");
        }
    }
    done.store(1, Ordering::Relaxed);
    watchdog.join().unwrap();
    println!(
        "fuzz {name}: {} cases in {:.1?} ({rounds} rounds), 0 panics, slowest case {:.1?}",
        cases.load(Ordering::Relaxed),
        epoch.elapsed(),
        Duration::from_micros(slowest.load(Ordering::Relaxed)),
    );
}

/// Arbitrary JSON, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        prop::sample::select(vec![
            "queued",
            "running",
            "succeeded",
            "failed",
            "sk-fuzz-secret"
        ])
        .prop_map(Value::from),
        ".{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    prop::sample::select(vec!["status", "id", "result", "error"])
                        .prop_map(str::to_owned),
                    ".{0,12}"
                ],
                inner,
                0..8
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Bytes a provider might send: JSON, JSON damaged by a few byte edits, or
/// anything at all.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        json_value().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        (
            json_value(),
            prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4)
        )
            .prop_map(|(v, edits)| {
                let mut b = serde_json::to_vec(&v).unwrap();
                for (at, byte) in edits {
                    let i = at.index(b.len() + 1);
                    if i < b.len() {
                        b[i] = byte;
                    } else {
                        b.push(byte);
                    }
                }
                b
            }),
        prop::collection::vec(any::<u8>(), 0..512),
        prop::collection::vec(any::<u8>(), 0..12_000),
        // The key echoed after up to 6,000 bytes, so that the excerpt's cut
        // (4,096 bytes; 512 for a body over the limit) may land inside it,
        // plainly or spelt with JSON escapes.
        (0usize..6000, any::<bool>(), json_value()).prop_map(|(pad, escaped, v)| {
            let key = if escaped {
                escaped_secret()
            } else {
                SECRET.to_owned()
            };
            let pad = "x".repeat(pad);
            format!(r#"{{"pad": "{pad}", "error": "bad key {key}", "rest": {v}}}"#).into_bytes()
        }),
    ]
}

/// The provider key the reply targets plant.
const SECRET: &str = "sk-fuzz-secret";

/// [`SECRET`] spelt with JSON `\uXXXX` escapes.
fn escaped_secret() -> String {
    crate::faults::json_escaped(SECRET)
}

/// The chain pipeline's provider rules, with the defaults after them.
fn chain_rules() -> Vec<ballast::domain::rules::Rule> {
    let text = crate::engine::chain_toml("http://127.0.0.1:9");
    let config = ballast::config::Config::parse(&text, Path::new("fuzz.toml")).unwrap();
    config.providers["sim"].compile_rules("sim").unwrap()
}

#[test]
fn fuzz_provider_replies_and_rules() {
    let rules = chain_rules();
    let strategy = (100u16..1000, body(), any::<bool>());
    fuzz("provider replies", strategy, |(status, body, cut)| {
        let error = cut.then_some(ReplyError::BodyTooLarge);
        let (reply, excerpt) =
            ballast::engine::http::read_reply(*status, body, error, 1 << 20, &[SECRET]);
        prop_assert!(excerpt.len() <= ballast::domain::EXCERPT_MAX_BYTES);
        prop_assert!(!excerpt.contains('\0'), "NUL kept in the excerpt");
        // Not the key, nor its start (a cut through it), plain or escaped.
        let escaped = escaped_secret();
        for spelling in [SECRET, escaped.as_str()] {
            let cut_through = (7..spelling.len()).any(|k| excerpt.ends_with(&spelling[..k]));
            prop_assert!(
                !excerpt.contains(spelling) && !cut_through,
                "key kept: {excerpt}"
            );
        }
        if let Reply::Http {
            json, body_error, ..
        } = &reply
        {
            let parses = serde_json::from_slice::<Value>(body).is_ok();
            prop_assert_eq!(json.is_some(), parses && !cut);
            prop_assert_eq!(body_error.is_some(), !parses || *cut);
            if let Some(j) = json {
                prop_assert!(!ballast::domain::json_has_nul(j), "NUL kept in the body");
                prop_assert!(!j.to_string().contains(SECRET), "secret kept");
            }
        } else {
            prop_assert!(false, "an HTTP reply became {:?}", reply);
        }
        let verdict = classify(&rules, &reply);
        // Anything but success and half-states carries a stable code.
        prop_assert_eq!(
            verdict.error_code.is_none(),
            matches!(
                verdict.outcome,
                ballast::domain::Outcome::Success | ballast::domain::Outcome::Pending
            )
        );
        Ok(())
    });
}

#[test]
fn fuzz_retry_after() {
    let now = SystemTime::now();
    let strategy = prop_oneof![
        ".{0,40}",
        "[0-9]{0,25}",
        "[ ]{0,2}-?[0-9]{1,6}(\\.[0-9]{0,3})?[ ]{0,2}",
        "(Mon|Sun|Xyz), [0-9]{1,2} (Jan|Feb|Dec|Foo) [0-9]{1,5} [0-9]{1,2}:[0-9]{1,2}:[0-9]{1,2} (GMT|UTC|)",
    ];
    fuzz("Retry-After", strategy, |v| {
        if let Some(wait) = ballast::domain::backoff::parse_retry_after(v, now) {
            // A number is seconds; anything else parsed is a date.
            if let Ok(secs) = v.trim().parse::<u64>() {
                prop_assert_eq!(wait, Duration::from_secs(secs));
            }
        }
        Ok(())
    });
}

#[test]
fn fuzz_webhook_signatures() {
    use ballast::auth::webhook::{sign, verify};
    const NOW: i64 = 1_800_000_000;
    let secret = b"fuzz-webhook-secret".to_vec();
    let part = prop_oneof![
        "t=-?[0-9]{0,12}",
        "v1=[0-9a-f]{0,70}",
        "v0=[0-9a-fA-F]{0,64}",
        ".{0,20}",
        Just(String::new()),
    ];
    // The body, then a header for it: junk parts, or the body's genuine
    // signature damaged by one character.
    let strategy = prop::collection::vec(any::<u8>(), 0..64).prop_flat_map(move |body| {
        let genuine = sign(b"fuzz-webhook-secret", NOW, &body);
        let junk = prop::collection::vec(part.clone(), 0..12).prop_map(|p| p.join(","));
        let damaged = (any::<prop::sample::Index>(), any::<char>()).prop_map(move |(at, c)| {
            let mut chars: Vec<char> = genuine.chars().collect();
            let i = at.index(chars.len());
            chars[i] = if chars[i] == c { '!' } else { c };
            chars.into_iter().collect::<String>()
        });
        (prop_oneof![junk, damaged], Just(body))
    });
    fuzz("webhook signatures", strategy, |(header, body)| {
        let verdict = verify(std::slice::from_ref(&secret), header, body, NOW, 300);
        // Only a header carrying the body's genuine MAC verifies (hex in
        // either case: a digit changed to its capital is the same MAC).
        if verdict.is_ok() {
            let good = sign(&secret, NOW, body);
            let mac = good.split_once("v1=").unwrap().1;
            prop_assert!(
                header.to_lowercase().contains(mac),
                "a forged header verified: {}",
                header
            );
        }
        Ok(())
    });
}

#[test]
fn fuzz_config_files() {
    let base = crate::engine::chain_toml("http://127.0.0.1:9");
    let fragments = prop::sample::select(vec![
        "\"",
        "'",
        "[",
        "]",
        "{",
        "}",
        "=",
        ",",
        "\n",
        "#",
        "[[",
        "]]",
        "0",
        "-1",
        "1e99",
        "\"1ms\"",
        "\"0s\"",
        "\"999999999d\"",
        "true",
        "\u{0}",
        "{{",
        "}}",
        "{%",
        "%}",
        "needs = [\"notify\"]",
        "kind = \"callback\"",
        "required = false",
        "[[pipelines.chain.steps]]\nname = \"charge\"\nprovider = \"sim\"\n",
    ]);
    let edit = (
        any::<prop::sample::Index>(),
        0usize..3,
        fragments,
        0usize..8,
    );
    let strategy = prop::collection::vec(edit, 1..6);
    fuzz("config files", strategy, |edits| {
        let mut text = base.clone();
        for (at, op, fragment, len) in edits {
            let mut i = at.index(text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            let mut end = (i + len).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            match op {
                0 => text.insert_str(i, fragment),
                1 => text.replace_range(i..end, ""),
                _ => text.replace_range(i..end, fragment),
            }
        }
        // Accepted or refused with an error naming the problem; never a panic.
        match ballast::config::Config::parse(&text, Path::new("fuzz.toml")) {
            Ok(config) => {
                let checked = config
                    .validate(&|_| None)
                    .and_then(|()| ballast::pipeline::compile(&config).map(drop));
                if let Err(e) = checked {
                    prop_assert!(!e.to_string().is_empty());
                }
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    });
}

#[test]
fn fuzz_templates() {
    use ballast::pipeline::template::{Quoting, Scope, Templates};
    let fragments = prop::sample::select(vec![
        "{{ ",
        " }}",
        "{% ",
        " %}",
        "{# ",
        " #}",
        "input",
        "record.id",
        "steps.a.output",
        "steps.b.output",
        "job_id",
        ".x",
        "[0]",
        "['k']",
        " | tojson",
        " | upper",
        " | length",
        " ~ ",
        " * ",
        " + ",
        " if ",
        " else ",
        "for i in range(",
        ")",
        "endfor",
        "(",
        "9999999",
        "\"s\"",
        "'",
        "\\",
        "\n",
        "{{",
        "}}",
        "\u{0}",
    ]);
    let strategy = (
        prop::collection::vec(
            prop_oneof![fragments.prop_map(str::to_owned), ".{0,4}"],
            0..16,
        ),
        json_value(),
    );
    let upstream: std::collections::BTreeSet<String> = ["a".to_owned()].into();
    fuzz("templates", strategy, |(parts, input)| {
        let source = parts.concat();
        for quoting in [Quoting::Url, Quoting::Json, Quoting::Text] {
            let mut t = Templates::new();
            let scope = Scope {
                upstream: &upstream,
                job_id: true,
                output: true,
                quoting,
                item: false,
            };
            if t.add("x", &source, &scope).is_ok() {
                let ctx = json!({
                    "input": input,
                    "steps": { "a": { "output": input } },
                    "record": { "id": 1 },
                    "job_id": "j",
                });
                let _ = t.render("x", &ctx);
            }
        }
        Ok(())
    });
}
