//! Issue 24 item 5: a running node reads its configuration again (SIGHUP,
//! `ballast reload`) under load: a provider's rate limit and a pipeline's
//! steps change with no call lost and no record failed, records under way
//! finish on the version they started with, and a bad file is refused with
//! the running configuration kept.

use std::process::Command;
use std::time::Duration;

use ballast::domain::{Outcome, RecordState};
use ballast::sim::{Profile, SimHandle};
use ballast::store::{AuditFilter, Backend, Db};
use serde_json::json;

use crate::cli::{ballast, start_serve, stderr, stdout};
use crate::helpers::{TestDb, free_port};

/// Provider `sim` with `limit`, and pipeline `pay`: `charge`, then (with
/// `notify`) a second call that needs it.
fn config(sim: &str, limit: &str, notify: bool) -> String {
    let mut text = format!(
        r#"
[server.limits]
api_per_second = 1000

[providers.sim]
base_url = "{sim}"
timeout = "10s"
concurrency = 16
rate_limits = ["{limit}"]

[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.pay.steps]]
name = "charge"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "c-{{{{ record.id }}}}", "amount": 1}}' }}
outputs = {{ id = "/id" }}
"#
    );
    if notify {
        text.push_str(
            r#"
[[pipelines.pay.steps]]
name = "notify"
provider = "sim"
needs = ["charge"]
request = { method = "POST", path = "/v1/charge", body = '{"ref": "n-{{ record.id }}", "amount": 0}' }
"#,
        );
    }
    text
}

/// Enqueues `n` records through the API; their ids.
async fn enqueue(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    from: usize,
    n: usize,
) -> Vec<i64> {
    let mut ids = Vec::with_capacity(n);
    for i in from..from + n {
        let reply = client
            .post(format!("{base}/api/v1/records"))
            .bearer_auth(token)
            .json(&json!({ "pipeline": "pay", "key": format!("r-{i}"), "input": {} }))
            .send()
            .await
            .unwrap();
        assert!(reply.status().is_success(), "{}", reply.status());
        let body: serde_json::Value = reply.json().await.unwrap();
        ids.push(
            body["record"]["id"]
                .as_i64()
                .unwrap_or_else(|| panic!("{body}")),
        );
    }
    ids
}

/// An admin's API token, made through the store.
pub(crate) async fn admin_token(db: &Db) -> String {
    let (token, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
    db.create_api_token(
        &ballast::store::NewApiToken {
            unmask: false,
            pipelines: ballast::domain::scope::Scope::all(),
            name: "reload".into(),
            token_hash: hash,
            prefix,
            role: ballast::domain::Role::Admin,
            created_by: "test".into(),
            actor: "test".into(),
            expires_at: None,
        },
        crate::helpers::wall_ms(),
    )
    .await
    .unwrap();
    token
}

/// The steps a record has run (or is running), in order.
async fn step_names(db: &Db, id: i64) -> Vec<String> {
    let runs = db.step_runs(id).await.unwrap();
    runs.into_iter().map(|s| s.step).collect()
}

/// The moments of the node's reloads, from the audit log.
async fn reloads(db: &Db) -> Vec<(i64, serde_json::Value)> {
    let filter = AuditFilter {
        kind: Some("config_reload".into()),
        limit: 100,
        ..AuditFilter::default()
    };
    let mut out: Vec<(i64, serde_json::Value)> = db
        .audit_log(&filter)
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| (e.at, e.detail.unwrap_or_default()))
        .collect();
    out.sort_by_key(|r| r.0);
    out
}

/// The most calls started in any `window_ms` from `from` on.
fn busiest(starts: &[i64], from: i64, window_ms: i64) -> usize {
    let mut after: Vec<i64> = starts.iter().copied().filter(|s| *s >= from).collect();
    after.sort_unstable();
    (0..after.len())
        .map(|i| {
            after[i..]
                .iter()
                .take_while(|s| **s < after[i] + window_ms)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_under_load_changes_limits_and_steps_and_refuses_a_bad_file() {
    let sim = SimHandle::spawn(Profile {
        latency_scale: 0.5,
        ..Profile::clean(11)
    })
    .await
    .unwrap();
    let t = TestDb::new(Backend::Sqlite, "reload").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ballast.toml");
    std::fs::write(&file, config(&sim.base_url(), "40/s", false)).unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let url = t.url.clone();
    let password = crate::web::password_of("admin");
    let env = [
        ("BALLAST_DATABASE_URL", url.as_str()),
        ("BALLAST_ADMIN_PASSWORD", password.as_str()),
    ];
    let (child, mut log) = start_serve(dir.path(), addr, &env).await;
    let db = t.db.clone();
    let token = admin_token(&db).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();

    // 200 records at 40 calls a second: about 5 s of work.
    let before = enqueue(&client, &base, &token, 0, 200).await;
    crate::helpers::wait_for_requests(&sim, 60, Duration::from_secs(60)).await;
    std::fs::write(&file, config(&sim.base_url(), "20/s", true)).unwrap();
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let line = log
        .until("the reload", Duration::from_secs(30), |l| {
            l.contains("configuration reloaded") || l.contains("reload refused")
        })
        .await;
    assert!(line.contains("configuration reloaded"), "{line}");
    assert!(line.contains("provider sim: new settings"), "{line}");
    assert!(line.contains("pipeline pay: version"), "{line}");
    let after = enqueue(&client, &base, &token, 200, 20).await;

    // A file that does not pass check-config: refused, said, kept.
    let good = std::fs::read_to_string(&file).unwrap();
    std::fs::write(
        &file,
        good.replace("provider = \"sim\"\nneeds", "provider = \"nope\"\nneeds"),
    )
    .unwrap();
    let api = [
        ("BALLAST_API_TOKEN", token.as_str()),
        ("BALLAST_DATABASE_URL", url.as_str()),
    ];
    let refused = ballast(dir.path(), &api, &["reload", "--url", &base]);
    assert!(!refused.status.success(), "{}", stdout(&refused));
    let said = stderr(&refused);
    assert!(
        said.contains("the node refused") && said.contains("nope"),
        "{said}"
    );
    let line = log
        .until("the refusal", Duration::from_secs(30), |l| {
            l.contains("reload refused")
        })
        .await;
    assert!(line.contains("nope"), "{line}");
    // A misspelt key, asked without --url (the address from the
    // environment): the file is the node's to check, not this shell's.
    std::fs::write(
        &file,
        good.replace("timeout = \"10s\"", "timeout = \"10s\"\nratee = 1"),
    )
    .unwrap();
    let bind = addr.to_string();
    let by_env = [
        ("BALLAST_API_TOKEN", token.as_str()),
        ("BALLAST_SERVER_BIND", bind.as_str()),
    ];
    let refused = ballast(dir.path(), &by_env, &["reload"]);
    assert!(!refused.status.success(), "{}", stdout(&refused));
    let said = stderr(&refused);
    assert!(
        said.contains("the node refused") && said.contains("ratee"),
        "{said}"
    );
    std::fs::write(&file, &good).unwrap();
    let late = enqueue(&client, &base, &token, 220, 5).await;

    // Every record ends; none failed or was parked by the reload.
    let all: Vec<i64> = before.iter().chain(&after).chain(&late).copied().collect();
    crate::helpers::poll_until("every record done", Duration::from_secs(180), || {
        let db = db.clone();
        let all = all.clone();
        async move {
            let done = crate::helpers::all_records(&db, Some(RecordState::Succeeded)).await;
            (done.len() == all.len()).then_some(())
        }
    })
    .await;
    let records = crate::helpers::all_records(&db, None).await;
    assert!(records.iter().all(|r| r.state == RecordState::Succeeded));
    let version = |id: i64| {
        records
            .iter()
            .find(|r| r.id == id)
            .unwrap()
            .pipeline_version
    };
    let (v1, v2) = (version(before[0]), version(after[0]));
    assert!(v1.is_some() && v2.is_some() && v1 != v2, "{v1:?} {v2:?}");
    assert!(
        before.iter().all(|id| version(*id) == v1),
        "records enqueued before keep v1"
    );
    assert!(after.iter().chain(&late).all(|id| version(*id) == v2));

    // Each record ran its own version's steps; every call made was kept
    // as an attempt that succeeded, and reached the provider once.
    let mut starts = Vec::new();
    let mut attempts = 0;
    for r in &records {
        let steps = step_names(&db, r.id).await;
        let want: &[&str] = if r.pipeline_version == v1 {
            &["charge"]
        } else {
            &["charge", "notify"]
        };
        assert_eq!(steps, want, "record {}", r.id);
        for a in db.attempts(r.id).await.unwrap() {
            assert_eq!(a.outcome, Outcome::Success, "{a:?}");
            starts.push(a.started_at);
            attempts += 1;
        }
    }
    assert_eq!(
        sim.arrivals().len(),
        attempts,
        "every call reached the provider and was kept"
    );
    assert_eq!(attempts, 200 + 2 * 25);

    // The new limit holds from a window after the reload; it did not before.
    let done = reloads(&db).await;
    assert_eq!(done.len(), 3, "{done:?}");
    assert!(
        done[2].1["refused"]
            .as_str()
            .unwrap_or("")
            .contains("ratee"),
        "{:?}",
        done[2]
    );
    let at = done[0].0;
    assert!(
        done[1].1["refused"].as_str().unwrap_or("").contains("nope"),
        "{:?}",
        done[1]
    );
    let before_most = busiest(
        &starts
            .iter()
            .copied()
            .filter(|s| *s < at)
            .collect::<Vec<_>>(),
        0,
        1_000,
    );
    let after_most = busiest(&starts, at + 1_000, 1_000);
    println!("calls in the busiest second: {before_most} at 40/s, {after_most} at 20/s");
    assert!(before_most > 20, "{before_most}");
    assert!(
        after_most <= 20,
        "{after_most} calls in one second after the reload"
    );

    // The record page says which version a record runs on; the pipelines
    // page lists both, the new one as the one new records get.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = client
        .post(format!("{base}/login"))
        .header("origin", &base)
        .form(&[
            ("username", "admin"),
            ("password", &password),
            ("next", "/"),
        ])
        .send()
        .await
        .unwrap();
    let cookie = crate::web::session_cookie(login.headers()).expect("a session");
    let page = |path: String| {
        let (client, cookie) = (client.clone(), cookie.clone());
        async move {
            let r = client
                .get(path)
                .header("cookie", cookie)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.text().await.unwrap()
        }
    };
    let (v1, v2) = (v1.unwrap(), v2.unwrap());
    let old = page(format!("{base}/records/{}", before[0])).await;
    assert!(
        old.contains(&format!("version {v1} (new records get version {v2})")),
        "{old}"
    );
    let new = page(format!("{base}/records/{}", after[0])).await;
    assert!(new.contains(&format!("version {v2} (current)")), "{new}");
    let list = page(format!("{base}/pipelines")).await;
    assert!(list.contains(&format!(r#"data-version="{v1}">"#)), "{list}");
    assert!(
        list.contains(&format!(r#"data-version="{v2}" class="current">"#)),
        "{list}"
    );

    // The node says which configuration it runs, and ran the new one.
    let nodes = db.list_nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(
        nodes[0].config_version.as_deref(),
        done[0].1["version"].as_str(),
        "{nodes:?}"
    );

    // A provider added, then taken out of the file again: kept until a
    // restart, said so, and the version the node says is the file's.
    let reload = || {
        let client = client.clone();
        let (url, token) = (format!("{base}/api/v1/reload"), token.clone());
        async move {
            let r = client.post(url).bearer_auth(token).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<serde_json::Value>().await.unwrap()
        }
    };
    let extra = format!("{good}\n[providers.extra]\nbase_url = \"http://127.0.0.1:9\"\n");
    std::fs::write(&file, extra).unwrap();
    let added = reload().await;
    assert!(
        added["changes"]
            .to_string()
            .contains("provider extra: added"),
        "{added}"
    );
    std::fs::write(&file, &good).unwrap();
    let kept = reload().await;
    assert!(
        kept["changes"]
            .to_string()
            .contains("provider extra: no longer in the file; kept until a restart"),
        "{kept}"
    );
    assert_eq!(kept["version"], done[0].1["version"], "the file's version");

    // An operator moves a finished record onto the new version: a replay
    // on the current one runs its steps as they are now.
    let act = |id: i64, body: serde_json::Value| {
        let client = client.clone();
        let url = format!("{base}/api/v1/records/{id}/actions");
        let token = token.clone();
        async move {
            let r = client
                .post(url)
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let moved = before[1];
    let (status, body) = act(
        moved,
        json!({ "action": "retry", "reason": "x", "on_current_version": true }),
    )
    .await;
    assert!(
        status >= 400 && body.contains("current_needs_replay"),
        "{status} {body}"
    );
    let (status, body) = act(
        moved,
        json!({ "action": "replay", "step": "charge", "reason": "onto v2",
                "on_current_version": true }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    crate::helpers::poll_until("the replay done", Duration::from_secs(60), || {
        let db = db.clone();
        async move {
            let r = db.get_record(moved).await.unwrap().unwrap();
            (r.state == RecordState::Succeeded).then_some(r)
        }
    })
    .await;
    let r = db.get_record(moved).await.unwrap().unwrap();
    assert_eq!(r.pipeline_version, Some(v2));
    assert_eq!(step_names(&db, moved).await, ["charge", "notify"]);
    let events = db.record_events(moved).await.unwrap();
    let replay = events.iter().find(|e| e.kind == "replay").expect("audited");
    assert_eq!(
        replay.detail.as_ref().unwrap()["version"],
        json!({ "from": v1, "to": v2 })
    );

    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    crate::wait::exit(child, "serve stops", Duration::from_secs(30)).await;
    sim.stop();
}

/// On PostgreSQL each node says which configuration it runs, and a
/// reload rolls across nodes: node A reloads a file that adds a provider
/// and a step on it, records enqueued there are pinned to that version,
/// A stops, and node B (not yet reloaded: it lacks the provider) defers
/// them, saying why, instead of parking them; reloaded, B runs them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_reload_rolls_across_nodes() {
    let Some(t) = TestDb::new(Backend::Postgres, "config_versions").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile {
        latency_scale: 0.5,
        ..Profile::clean(12)
    })
    .await
    .unwrap();
    ballast::store::migrate::up(&t.db, None).await.unwrap();
    let token = admin_token(&t.db).await;
    let v1 = config(&sim.base_url(), "40/s", false);
    // A second provider, slow to take calls, and a step on it.
    let v2 = format!(
        "{v1}\n[providers.sim2]\nbase_url = \"{}\"\nrate_limits = [\"2/s\"]\n\
         [[providers.sim2.rules]]\nwhen = {{ status = \"2xx\" }}\noutcome = \"success\"\n\
         [[pipelines.pay.steps]]\nname = \"notify\"\nprovider = \"sim2\"\nneeds = [\"charge\"]\n\
         request = {{ method = \"POST\", path = \"/v1/charge\", body = '{{\"ref\": \"n-{{{{ record.id }}}}\", \"amount\": 0}}' }}\n",
        sim.base_url()
    );
    let env = [("BALLAST_DATABASE_URL", t.url.as_str())];
    let mut nodes = Vec::new();
    for _ in 0..2 {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ballast.toml"), &v1).unwrap();
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let (child, log) = start_serve(dir.path(), addr, &env).await;
        nodes.push((dir, addr, child, log));
    }
    let versions = |want: usize| {
        let db = t.db.clone();
        async move {
            crate::helpers::poll_until("the nodes' versions", Duration::from_secs(30), || {
                let db = db.clone();
                async move {
                    let v: std::collections::BTreeSet<String> = db
                        .list_nodes()
                        .await
                        .unwrap()
                        .into_iter()
                        .filter_map(|n| n.config_version)
                        .collect();
                    (v.len() == want).then_some(v)
                }
            })
            .await
        }
    };
    let first = versions(1).await;
    let api = [("BALLAST_API_TOKEN", token.as_str())];
    let (b_dir, b_addr, b_child, _) = nodes.pop().unwrap();
    let (a_dir, a_addr, a_child, _) = nodes.pop().unwrap();
    std::fs::write(a_dir.path().join("ballast.toml"), &v2).unwrap();
    let a_url = format!("http://{a_addr}");
    let out = ballast(a_dir.path(), &api, &["reload", "--url", &a_url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(said.contains("provider sim2: added"), "{said}");
    assert!(said.contains("pipeline pay: version"), "{said}");
    let split = versions(2).await;
    assert!(split.is_superset(&first), "{split:?} {first:?}");

    let client = reqwest::Client::new();
    let ids = enqueue(&client, &a_url, &token, 0, 10).await;
    let _ = Command::new("kill")
        .args(["-TERM", &a_child.id().to_string()])
        .status();
    crate::wait::exit(a_child, "node A stops", Duration::from_secs(30)).await;
    // B cannot run version 2 yet: it says so on a record, and waits.
    let db = t.db.clone();
    let why = crate::helpers::poll_until("B defers one", Duration::from_secs(60), || {
        let (db, ids) = (db.clone(), ids.clone());
        async move {
            for id in ids {
                let r = db.get_record(id).await.unwrap().unwrap();
                if let Some(reason) = r
                    .reason
                    .filter(|w| w.contains("waiting for this node's reload"))
                {
                    return Some(reason);
                }
            }
            None
        }
    })
    .await;
    assert!(why.contains("sim2"), "{why}");
    // B's address from the environment, as a script on its host would.
    std::fs::write(b_dir.path().join("ballast.toml"), &v2).unwrap();
    let b_env = [
        ("BALLAST_API_TOKEN", token.as_str()),
        ("BALLAST_SERVER_BIND", &b_addr.to_string()),
    ];
    let out = ballast(b_dir.path(), &b_env, &["reload"]);
    assert!(out.status.success(), "{}", stderr(&out));
    crate::helpers::poll_until("B runs them", Duration::from_secs(60), || {
        let (db, ids) = (db.clone(), ids.clone());
        async move {
            for id in ids {
                let r = db.get_record(id).await.unwrap().unwrap();
                if r.state != RecordState::Succeeded {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    for id in &ids {
        let events = t.db.record_events(*id).await.unwrap();
        assert!(
            events
                .iter()
                .all(|e| e.to_state != Some(RecordState::Parked)),
            "record {id} was never parked: {events:?}"
        );
        assert_eq!(step_names(&t.db, *id).await, ["charge", "notify"]);
    }
    let last = versions(1).await;
    assert_ne!(last, first);
    // Nothing changed: said so.
    let out = ballast(b_dir.path(), &b_env, &["reload"]);
    assert!(stdout(&out).contains("nothing changed"), "{}", stdout(&out));
    let _ = Command::new("kill")
        .args(["-TERM", &b_child.id().to_string()])
        .status();
    crate::wait::exit(b_child, "node B stops", Duration::from_secs(30)).await;
    sim.stop();
}
