//! End-to-end tests in a real headless Chromium, driven over WebDriver
//! (chromedriver + fantoccini): log in, read a parked record's history, retry
//! it, bulk-park with a reason and find it in the audit log, a viewer's view
//! and a forged action, an XSS payload that must not run, and the overview
//! refreshing itself. Screenshots go to `target/screenshots/`.
//!
//! Without `chromium` and `chromedriver` the test prints a SKIP line; under
//! `CI=true` their absence is a failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ballast::domain::{OperatorAction, Outcome, Role};
use ballast::engine::{Enqueue, Resumer};
use ballast::store::{ActionRequest, Backend, NewAttempt};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

use crate::wait;
use crate::web::{WebApp, password_of};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

struct Driver {
    child: Child,
    _profile: tempfile::TempDir,
    client: Client,
}

impl Drop for Driver {
    /// Whether the test ended, passed, failed or panicked: chromedriver and
    /// every browser it started (one process group, chromedriver's) are
    /// killed, and chromedriver reaped.
    fn drop(&mut self) {
        kill_group(self.child.id());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Kills process group `pgid` (the group of chromedriver, which the
/// browsers it starts join).
fn kill_group(pgid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

/// The live (not zombie) processes in process group `pgid`, from `/proc`.
fn live_in_group(pgid: u32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let stat = std::fs::read_to_string(e.ok()?.path().join("stat")).ok()?;
        // `pid (comm) state ppid pgrp …`: the fields after the last `)`.
        let (head, rest) = stat.rsplit_once(')')?;
        let mut fields = rest.split_whitespace();
        let state = fields.next()?;
        let pgrp: u32 = fields.nth(1)?.parse().ok()?;
        (pgrp == pgid && state != "Z").then(|| head.to_owned())
    })
    .collect()
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

async fn driver(test: &str) -> Option<Driver> {
    if !(std::path::Path::new(CHROMIUM).exists() && std::path::Path::new(CHROMEDRIVER).exists()) {
        assert!(
            !in_ci(),
            "CI=true and {CHROMIUM} or {CHROMEDRIVER} is missing"
        );
        crate::helpers::skip(&format!(
            "{test}: no {CHROMIUM} / {CHROMEDRIVER} (apt-get install chromium chromium-driver)"
        ));
        return None;
    }
    let port = crate::helpers::free_port();
    // A process group of its own: the browsers it starts are in it too,
    // and go with it (Driver's drop).
    let mut child = std::os::unix::process::CommandExt::process_group(
        Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
        0,
    )
    .spawn()
    .expect("chromedriver starts");
    // chromedriver says so on its stdout once it listens.
    wait::Lines::read(child.stdout.take().unwrap())
        .until("chromedriver starts", Duration::from_secs(30), |l| {
            l.contains("started successfully")
        })
        .await;
    let profile = tempfile::tempdir().unwrap();
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-quic",
                "--window-size=1400,1000",
                format!("--user-data-dir={}", profile.path().display()),
            ]
        }),
    );
    let client = ClientBuilder::rustls()
        .unwrap()
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .unwrap_or_else(|e| panic!("cannot start a browser session: {e:?}"));
    Some(Driver {
        child,
        _profile: profile,
        client,
    })
}

fn screenshots() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    assert!(png.len() > 1000, "a real picture");
    std::fs::write(screenshots().join(format!("{name}.png")), png).unwrap();
}

/// With `BALLAST_SCREENSHOTS=publish`, copies the screenshots `names`
/// into `docs/screenshots/`, which the README shows: how they are
/// regenerated.
fn publish_screenshots(names: &[&str]) {
    if std::env::var("BALLAST_SCREENSHOTS").as_deref() != Ok("publish") {
        return;
    }
    let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/screenshots");
    for name in names {
        let file = format!("{name}.png");
        std::fs::copy(screenshots().join(&file), docs.join(&file)).unwrap();
    }
}

/// Clicks the element `css` selects.
async fn click(c: &Client, css: &str) {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn login(c: &Client, app: &WebApp, user: &str) {
    c.goto(&app.url("/login")).await.unwrap();
    c.find(Locator::Css("input[name=username]"))
        .await
        .unwrap()
        .send_keys(user)
        .await
        .unwrap();
    c.find(Locator::Css("input[name=password]"))
        .await
        .unwrap()
        .send_keys(&password_of(user))
        .await
        .unwrap();
    c.find(Locator::Css("form button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    if c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#live"))
        .await
        .is_err()
    {
        let url = c.current_url().await.unwrap();
        let src = c.source().await.unwrap_or_default();
        panic!(
            "no overview after login: at {url}: {}",
            &src[..src.len().min(1500)]
        );
    }
}

/// The text of the element `css` selects. The overview replaces its live
/// part every 5 s, so an element found may go stale before it is read:
/// find it again then.
async fn text_of(c: &Client, css: &str) -> String {
    wait::until(
        &format!("reading `{css}`"),
        Duration::from_secs(10),
        async || c.find(Locator::Css(css)).await?.text().await,
    )
    .await
}

/// Waits until the element `css` selects shows `want` (the page changes
/// it after an htmx request of its own).
async fn wait_text(c: &Client, css: &str, want: &str) {
    let what = format!("`{css}` shows `{want}`");
    wait::until(&what, Duration::from_secs(20), async || {
        match c.find(Locator::Css(css)).await {
            Ok(e) => match e.text().await {
                Ok(text) if text.contains(want) => Ok(()),
                seen => Err(seen),
            },
            Err(e) => Err(Err(e)),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_works_in_a_real_browser() {
    let Some(d) = driver("browser").await else {
        return;
    };
    let c = &d.client;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "browser", "").await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    app.user("viewer", Role::Viewer).await;

    // A parked record whose provider answered with a script.
    let parked = app.record("lead-xss").await;
    let payload = r#"<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b hx-get="/admin/users" hx-trigger="load">boom</b>"#;
    let now = crate::helpers::wall_ms();
    let attempts: Vec<NewAttempt> = (1..=3)
        .map(|n| NewAttempt {
            step: "enrich".into(),
            provider: Some("crm".into()),
            attempt_no: n,
            node: None,
            started_at: now - 60_000 + i64::from(n) * 1000,
            duration_ms: 120 * i64::from(n),
            http_status: Some(503),
            outcome: Outcome::Retry,
            error_code: Some("http_5xx".into()),
            excerpt: Some(payload.into()),
            request: Some(ballast::domain::request::SentRequest {
                method: "POST".into(),
                url: format!("https://crm.example/{payload}"),
                headers: vec![("X-Test".into(), payload.into())],
                body: Some(payload.into()),
            }),
        })
        .collect();
    app.t
        .db
        .append_attempts(parked, &attempts, &[])
        .await
        .unwrap();
    app.t
        .db
        .act(&ActionRequest {
            record_id: parked,
            action: OperatorAction::Park,
            actor: "system".into(),
            reason: Some("attempts exhausted: provider kept answering 503".into()),
            now,
            steps: Vec::new(),
            until: None,
            took: None,
            input: None,
            repin: None,
            failed_items: false,
            signal: None,
        })
        .await
        .unwrap();
    let versioned = two_versions(&app).await;
    let mut pending = Vec::new();
    for k in 0..4 {
        pending.push(app.record(&format!("lead-{k}")).await);
    }

    // Log in; the overview shows the counts.
    login(c, &app, "admin").await;
    shot(c, "overview").await;
    assert!(text_of(c, "#counts").await.contains("manual"));

    // The records list, filtered to parked ones.
    c.goto(&app.url("/records?state=parked")).await.unwrap();
    wait_text(c, "#records-list", "lead-xss").await;
    shot(c, "records").await;

    // The parked record's failure history, with the payload as text.
    c.goto(&app.url(&format!("/records/{parked}")))
        .await
        .unwrap();
    wait_text(c, "#attempts", "http_5xx").await;
    let attempts_text = text_of(c, "#attempts").await;
    assert!(
        attempts_text.contains("<script>window.__pwned = 1</script>"),
        "the payload shows as text"
    );
    assert!(text_of(c, ".facts").await.contains("attempts exhausted"));
    // Each attempt shows the status number it was answered with, in the
    // HTTP column.
    let statuses = c
        .execute(
            "const head = [...document.querySelectorAll('#attempts thead th')].map(h => h.textContent.trim());
             const col = head.indexOf('HTTP');
             return [...document.querySelectorAll('#attempts tbody tr')]
               .map(r => r.children[col] ? r.children[col].textContent.trim() : null);",
            vec![],
        )
        .await
        .unwrap();
    let statuses: Vec<&str> = statuses
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        statuses,
        ["503", "503", "503"],
        "each attempt's status number"
    );
    // Each attempt shows the request sent beside the reply (issue 19
    // item 4): in one row, the request to the left of the reply.
    let beside = c
        .execute(
            "const row = document.querySelector('#attempts tbody tr');
             const q = row && row.querySelector('pre.request');
             const p = row && row.querySelector('pre.reply');
             if (!q || !p) return null;
             const a = q.getBoundingClientRect(), b = p.getBoundingClientRect();
             return { request: q.textContent, reply: p.textContent,
                      beside: a.right <= b.left && a.top < b.bottom && b.top < a.bottom };",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(beside["beside"], json!(true), "{beside}");
    let request = beside["request"].as_str().unwrap_or("");
    assert!(
        request.starts_with("POST https://crm.example/<script>")
            && request.contains("\nX-Test: <script>"),
        "{request}"
    );
    assert!(
        beside["reply"]
            .as_str()
            .unwrap_or("")
            .starts_with("<script>"),
        "{beside}"
    );
    shot(c, "record-detail").await;
    // Were the payload live, it would run while the page loads: a script
    // as it is parsed, the image's error handler before the load event.
    // Wait for that event and one turn of the event loop after it.
    c.execute_async(
        "const done = arguments[arguments.length - 1];
         const after = () => setTimeout(done, 0);
         if (document.readyState === 'complete') after();
         else window.addEventListener('load', after);",
        vec![],
    )
    .await
    .unwrap();
    let pwned = c
        .execute(
            "return window.__pwned === undefined ? null : window.__pwned;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(pwned, serde_json::Value::Null, "the payload did not run");
    assert!(
        c.find_all(Locator::Css("#attempts img, #attempts script, #attempts b"))
            .await
            .unwrap()
            .is_empty()
    );

    // A step run twice (a replay between): both versions of its output
    // are listed, with what made each, and their difference.
    c.goto(&app.url(&format!("/records/{versioned}")))
        .await
        .unwrap();
    wait_text(c, "#versions", "replay by admin").await;
    let versions = text_of(c, "#versions").await;
    assert!(
        versions.contains("first run") && versions.contains("current"),
        "{versions}"
    );
    let diff = text_of(c, "#diff").await;
    let diff = diff.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(diff.contains("changed /score 1 2"), "{diff}");
    assert!(diff.contains("added /tier \"gold\""), "{diff}");
    assert!(diff.contains("removed /draft true"), "{diff}");
    assert!(
        !diff.contains("/name"),
        "unchanged leaves are not listed: {diff}"
    );
    shot(c, "record-versions").await;
    c.goto(&app.url(&format!("/records/{parked}")))
        .await
        .unwrap();
    wait_text(c, "#attempts", "http_5xx").await;

    // Retry it and watch the state change in place (htmx).
    c.execute("window.__marker = 'same page';", vec![])
        .await
        .unwrap();
    c.find(Locator::Css("button[data-action=retry]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_text(c, "#record-state", "pending").await;
    let marker = c
        .execute("return window.__marker || null;", vec![])
        .await
        .unwrap();
    assert_eq!(marker, json!("same page"), "swapped without a reload");
    assert_eq!(
        app.t
            .db
            .get_record(parked)
            .await
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "pending"
    );
    // Someone else cancels it meanwhile; the page's own cancel is then
    // refused, with a readable message in the page.
    app.t
        .db
        .act(&ActionRequest {
            record_id: parked,
            action: OperatorAction::Cancel,
            actor: "someone-else".into(),
            reason: None,
            now: crate::helpers::wall_ms(),
            steps: Vec::new(),
            until: None,
            took: None,
            input: None,
            repin: None,
            failed_items: false,
            signal: None,
        })
        .await
        .unwrap();
    c.find(Locator::Css("button[data-action=cancel]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let flash = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#flash .flash.error"))
        .await
        .expect("an error message in the page");
    assert!(flash.text().await.unwrap().len() > 10);
    assert_eq!(
        app.t
            .db
            .get_record(parked)
            .await
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "cancelled"
    );

    // Bulk-park two records with a reason: dry run, then apply.
    c.goto(&app.url("/records?state=pending")).await.unwrap();
    wait_text(c, "#records-list", "lead-0").await;
    for id in &pending[..2] {
        c.find(Locator::Css(&format!("input[name=ids][value='{id}']")))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
    }
    c.find(Locator::Css("#bulk select[name=action]"))
        .await
        .unwrap()
        .select_by_value("park")
        .await
        .unwrap();
    c.find(Locator::Css("#bulk input[name=reason]"))
        .await
        .unwrap()
        .send_keys("vendor outage INC-42")
        .await
        .unwrap();
    c.find(Locator::Css("#bulk button[value=preview]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_text(c, "#bulk-count", "2").await;
    assert_eq!(
        app.t
            .db
            .get_record(pending[0])
            .await
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "pending",
        "dry run"
    );
    c.find(Locator::Css("#bulk-result button[value=apply]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_text(c, "#bulk-result", "Applied").await;
    for id in &pending[..2] {
        assert_eq!(
            app.t
                .db
                .get_record(*id)
                .await
                .unwrap()
                .unwrap()
                .state
                .as_str(),
            "parked"
        );
    }
    c.goto(&app.url("/audit?actor=admin&kind=park"))
        .await
        .unwrap();
    let audit = text_of(c, "#audit-list").await;
    assert_eq!(audit.matches("vendor outage INC-42").count(), 2, "{audit}");

    // Log out; a viewer sees no action buttons, and a forged action is refused.
    c.goto(&app.url("/")).await.unwrap();
    c.find(Locator::Css("form.whoami button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("input[name=username]"))
        .await
        .unwrap();
    login(c, &app, "viewer").await;
    c.goto(&app.url(&format!("/records/{}", pending[2])))
        .await
        .unwrap();
    wait_text(c, "#record-state", "pending").await;
    assert!(
        c.find_all(Locator::Css("button[data-action]"))
            .await
            .unwrap()
            .is_empty(),
        "no action buttons"
    );
    let status = c
        .execute(
            &format!(
                "const token = JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token'];
                 return fetch('/records/{}/actions', {{method: 'POST', headers: {{'X-CSRF-Token': token, 'Content-Type': 'application/x-www-form-urlencoded'}}, body: 'action=cancel'}}).then(r => r.status);",
                pending[2]
            ),
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(status, json!(403), "a viewer's forged action");
    assert_eq!(
        app.t
            .db
            .get_record(pending[2])
            .await
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "pending"
    );

    // The overview refreshes itself.
    c.goto(&app.url("/")).await.unwrap();
    c.execute("window.__marker = 'still here';", vec![])
        .await
        .unwrap();
    let before = text_of(c, "#counts").await;
    app.record("lead-live").await;
    // The page refreshes its live part every 5 s.
    wait::until(
        "the counts change without a reload",
        Duration::from_secs(30),
        async || {
            let after = text_of(c, "#counts").await;
            if after != before { Ok(()) } else { Err(after) }
        },
    )
    .await;
    let marker = c
        .execute("return window.__marker || null;", vec![])
        .await
        .unwrap();
    assert_eq!(marker, json!("still here"));

    // An expired session sends the browser to the login page.
    app.t
        .db
        .update_user(
            app.t.db.user_by_name("viewer").await.unwrap().unwrap().id,
            &ballast::store::UserChange::Role(Role::Viewer),
            crate::helpers::wall_ms(),
        )
        .await
        .unwrap();
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("input[name=username]"))
        .await
        .expect("the live refresh found the session gone");

    let Driver { client, .. } = &d;
    client.clone().close().await.unwrap();
    app.stop().await;
}

/// The README's run command: `serve --demo` prints the dashboard's address
/// and the admin's password, and within a minute or so the dashboard shows
/// records succeeded, failed, parked and in flight, and the render
/// provider's breaker open during its scheduled outage. Screenshots of it
/// go to `target/screenshots/demo-*.png`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_every_outcome() {
    let Some(d) = driver("demo").await else {
        return;
    };
    let c = &d.client;
    let dir = tempfile::tempdir().unwrap();
    let port = crate::helpers::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ballast"))
        .current_dir(dir.path())
        .args([
            "serve",
            "--demo",
            "--demo-rate",
            "4",
            "--bind",
            &format!("127.0.0.1:{port}"),
        ])
        .env_remove("BALLAST_DATABASE_URL")
        .env_remove("BALLAST_ADMIN_PASSWORD")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = wait::Lines::read(child.stderr.take().unwrap());
    let base = format!("http://127.0.0.1:{port}");
    // The password is printed before the dashboard's address, which comes
    // once the demo serves.
    log.until("the demo starts", Duration::from_secs(60), |l| {
        l.contains(&format!("dashboard at {base}/"))
    })
    .await;
    let password = log
        .seen()
        .lines()
        .skip_while(|l| !l.contains("created user `admin` with password"))
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.contains("created user"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no password printed: {}", log.seen()));
    assert!(password.len() >= 20, "{password}");
    assert!(dir.path().join("ballast-demo.db").exists());

    c.goto(&format!("{base}/login")).await.unwrap();
    c.find(Locator::Css("input[name=username]"))
        .await
        .unwrap()
        .send_keys("admin")
        .await
        .unwrap();
    c.find(Locator::Css("input[name=password]"))
        .await
        .unwrap()
        .send_keys(&password)
        .await
        .unwrap();
    c.find(Locator::Css("form button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#live"))
        .await
        .expect("logged in");

    // Wait for every kind of outcome.
    let started = std::time::Instant::now();
    let mut seen_open = false;
    let outcomes = async || {
        c.goto(&format!("{base}/")).await.unwrap();
        let mut totals = std::collections::BTreeMap::new();
        for cell in c
            .find_all(Locator::Css("#counts a[data-state]"))
            .await
            .unwrap()
        {
            // A cell swapped out by the live refresh reads as nothing; the
            // next round reads it again.
            let state = cell
                .attr("data-state")
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
            let n: i64 = cell
                .text()
                .await
                .unwrap_or_default()
                .trim()
                .parse()
                .unwrap_or(0);
            *totals.entry(state).or_insert(0) += n;
        }
        let breaker = text_of(c, "#provider-stats").await;
        seen_open |= breaker.contains("open");
        let has = |s: &str| totals.get(s).copied().unwrap_or(0) > 0;
        let in_flight = ["pending", "running", "waiting", "retrying"]
            .iter()
            .any(|s| has(s));
        if has("succeeded") && has("failed") && has("parked") && in_flight && seen_open {
            Ok(totals)
        } else {
            Err(format!("{totals:?}, breaker opened: {seen_open}"))
        }
    };
    let totals = wait::until(
        "the demo shows every outcome",
        Duration::from_secs(120),
        outcomes,
    )
    .await;
    println!(
        "demo: every outcome after {:.0} s: {totals:?}",
        started.elapsed().as_secs_f64()
    );
    shot(c, "demo-overview").await;
    // The onboarding pipeline's workflow features within a few minutes: a
    // record waiting for an analyst, one for its funding signal, and an
    // account closed again by its undo after a declined card.
    for (filter, says) in [
        (
            "state=waiting&error_code=awaiting_approval",
            "awaiting_approval",
        ),
        (
            "state=waiting&error_code=awaiting_signal",
            "awaiting_signal",
        ),
        (
            "state=failed&error_code=undone",
            "undo of open-account made",
        ),
    ] {
        let url = format!("{base}/records?pipeline=onboarding&{filter}");
        // Generous: each needs an applicant of its kind (an undo one in
        // eight, some ten seconds apart) to get through a chaotic provider
        // on a machine busy with the other tests. Not yet so, it shows
        // where the onboardings are instead.
        wait::until(says, Duration::from_secs(240), async || {
            c.goto(&url).await.unwrap();
            let listed = text_of(c, "#records-list").await;
            if listed.contains(says) {
                return Ok(());
            }
            c.goto(&format!("{base}/records?pipeline=onboarding"))
                .await
                .unwrap();
            Err(text_of(c, "#records-list").await)
        })
        .await;
    }
    println!(
        "demo: an approval, a signal and an undo after {:.0} s",
        started.elapsed().as_secs_f64()
    );
    c.goto(&format!("{base}/")).await.unwrap();
    // The demo's schedule, listed with its next run.
    let schedules = text_of(c, "#schedules").await;
    assert!(
        schedules.contains("lead-enrichment") && schedules.contains("*/30 * * * * *"),
        "{schedules}"
    );
    c.goto(&format!("{base}/records?state=parked"))
        .await
        .unwrap();
    shot(c, "demo-records").await;
    let first = c.find(Locator::Css("#records-list tbody a")).await.unwrap();
    first.click().await.unwrap();
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#attempts"))
        .await
        .unwrap();
    let reason = text_of(c, ".facts").await;
    assert!(reason.contains("Reason"), "{reason}");
    shot(c, "demo-record").await;
    let record = c.current_url().await.unwrap();
    c.goto(&format!("{base}/providers")).await.unwrap();
    shot(c, "demo-providers").await;
    // The demo's pipelines drawn, each step with its figures.
    c.goto(&format!("{base}/pipelines")).await.unwrap();
    let graphs = c.find_all(Locator::Css("svg.graph")).await.unwrap();
    assert!(!graphs.is_empty(), "the demo's pipelines as graphs");
    shot(c, "demo-pipelines").await;
    // Dark, as the admin chose it (kept with the user), then a phone.
    click(c, "#theme-toggle").await;
    wait::until("the page turns dark", Duration::from_secs(10), async || {
        let theme = c
            .execute(
                "return document.documentElement.dataset.theme || '';",
                vec![],
            )
            .await
            .unwrap();
        if theme == "dark" { Ok(()) } else { Err(theme) }
    })
    .await;
    shot(c, "demo-pipelines-dark").await;
    c.goto(record.as_str()).await.unwrap();
    shot(c, "demo-record-dark").await;
    c.goto(&format!("{base}/")).await.unwrap();
    shot(c, "demo-overview-dark").await;
    c.set_window_size(375, 812).await.unwrap();
    c.goto(&format!("{base}/records?state=parked"))
        .await
        .unwrap();
    shot(c, "demo-phone-records-dark").await;
    click(c, "#theme-toggle").await;
    c.goto(record.as_str()).await.unwrap();
    shot(c, "demo-phone-record").await;
    c.set_window_size(1400, 1000).await.unwrap();
    // Desktop light and dark, and a phone.
    publish_screenshots(&[
        "demo-overview",
        "demo-records",
        "demo-record",
        "demo-pipelines",
        "demo-providers",
        "demo-record-dark",
        "demo-pipelines-dark",
        "demo-phone-record",
        "demo-phone-records-dark",
    ]);

    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = wait::exit(child, "the demo stops on SIGTERM", Duration::from_secs(30)).await;
    let log = log.all(Duration::from_secs(30)).await;
    assert!(status.success(), "{log}");
    d.client.clone().close().await.unwrap();
}

/// A record whose step `enrich` succeeded, was replayed by `admin`, and
/// succeeded again with another output.
async fn two_versions(app: &WebApp) -> i64 {
    use ballast::domain::{OperatorAction, StepState, WorkResult};
    use ballast::store::{ClaimRequest, Commit, StepWrite};
    let id = app.record("lead-versions").await;
    let later = crate::helpers::wall_ms() + 3_600_000;
    for (generation, output) in [
        (0, json!({ "score": 1, "draft": true, "name": "Ada" })),
        (1, json!({ "score": 2, "tier": "gold", "name": "Ada" })),
    ] {
        let claim = ClaimRequest {
            owner: "w".into(),
            now: later,
            lease: Duration::from_secs(30),
            limit: 1,
            group_caps: Vec::new(),
        };
        let r = app.t.db.claim_due(&claim).await.unwrap().remove(0);
        let mut step = StepWrite::pending("enrich");
        step.state = StepState::Succeeded;
        step.generation = generation;
        step.output = Some(output);
        step.finished_at = Some(later);
        let mut c = Commit::new(r.lease().unwrap(), later, Some(WorkResult::Completed));
        c.steps = vec![step];
        app.t.db.commit(&c).await.unwrap();
        if generation == 0 {
            let replay = ActionRequest {
                record_id: id,
                action: OperatorAction::ReplayFrom,
                actor: "admin".into(),
                reason: Some("enrichment changed".into()),
                now: later,
                steps: vec!["enrich".into()],
                until: None,
                took: None,
                input: None,
                repin: None,
                failed_items: false,
                signal: None,
            };
            app.t.db.act(&replay).await.unwrap();
        }
    }
    id
}

/// Issue 19 item 7 in the browser: records parked while their provider's
/// breaker is open show what they wait for and are found by that filter;
/// an operator parks another until a time through the form; once the
/// provider recovers, the records resume by themselves and the record page
/// tells it: a `resume` by `system` naming the condition, then success.
/// (The work is done by an engine on a clock the test moves, beside the
/// app, on the same database.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_record_resumes_by_itself_when_its_provider_recovers() {
    use ballast::domain::Clock;
    use ballast::sim::{Profile, SimHandle};
    let Some(d) = driver("browser_resume").await else {
        return;
    };
    let c = &d.client;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "browser_resume", "").await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let sim = SimHandle::spawn(Profile::clean(5)).await.unwrap();
    let text = crate::engine::single_step_toml(
        &sim.base_url(),
        r#"on_outage = "park_until_healthy"
retry = { max_attempts = 100, base = "10ms", cap = "50ms", deadline = "10m", budget = 1.0, budget_floor = 1000.0 }
breaker = { window = 10, min_calls = 4, failure_rate = 0.5, open_for = "1s", probes = 1 }"#,
    );
    let config =
        ballast::config::Config::parse(&text, std::path::Path::new("resume.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let config = std::sync::Arc::new(config);
    let (engine, clock) = crate::engine::manual_engine(&app.t.db, config, "br").await;
    crate::engine::enqueue_n(&engine, "pay", 6).await;
    sim.outage(600_000, 1.0);
    for _ in 0..10 {
        crate::engine::drain(&engine).await;
        clock.advance(50);
    }
    let waiting = app
        .t
        .db
        .list_records(&ballast::store::RecordFilter {
            until: Some(ballast::domain::park::UntilKind::Provider),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap()
        .items;
    assert_eq!(waiting.len(), 6, "every record waits for its provider");
    let watched = waiting[0].id;
    let by_hand = app.record("lead-later").await;

    login(c, &app, "admin").await;
    // The records page filters parked records by what they wait for.
    c.goto(&app.url("/records?until=provider")).await.unwrap();
    wait_text(c, "#records-list", "until provider `sim` is healthy").await;
    let rows = c
        .find_all(Locator::Css("#records-list tbody tr"))
        .await
        .unwrap();
    assert_eq!(rows.len(), 6);
    shot(c, "records-parked-until-provider").await;

    // An operator parks another record until a time, through the form.
    c.goto(&app.url(&format!("/records/{by_hand}")))
        .await
        .unwrap();
    let parked_by_hand = c
        .execute(
            "const f = document.querySelector('button[data-action=park]').form;
             f.querySelector('input[name=reason]').value = 'wait for the morning batch';
             f.querySelector('select[name=until]').value = 'time';
             f.querySelector('input[name=until_time]').value = '2030-01-02T09:00';
             f.querySelector('button[data-action=park]').click();
             return true;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(parked_by_hand, json!(true));
    wait_text(c, "#record-until", "until 2030-01-02T09:00:00.000Z").await;

    // The watched record says what it waits for.
    c.goto(&app.url(&format!("/records/{watched}")))
        .await
        .unwrap();
    wait_text(c, "#record-until", "until provider `sim` is healthy").await;
    assert!(text_of(c, ".facts").await.contains("provider_outage"));
    shot(c, "record-parked-until-provider").await;

    // The provider recovers: past its breaker's open interval one record
    // resumes to probe, then the rest, each by itself.
    sim.outage(0, 1.0);
    for _ in 0..200 {
        Resumer::of(&engine)
            .resume_due(clock.now_ms())
            .await
            .unwrap();
        crate::engine::drain(&engine).await;
        let done = app.t.db.get_record(watched).await.unwrap().unwrap();
        if done.state == ballast::domain::RecordState::Succeeded {
            break;
        }
        clock.advance(50);
    }
    c.goto(&app.url(&format!("/records/{watched}")))
        .await
        .unwrap();
    wait_text(c, "#timeline", "takes calls again").await;
    let timeline = text_of(c, "#timeline").await;
    assert!(timeline.contains("system"), "{timeline}");
    assert_eq!(text_of(c, "#record-state").await, "succeeded");
    assert!(
        c.find(Locator::Css("#record-until")).await.is_err(),
        "no condition once resumed"
    );
    shot(c, "record-resumed-by-itself").await;
    // The record parked by hand still waits for its time.
    let later = app.t.db.get_record(by_hand).await.unwrap().unwrap();
    assert_eq!(later.state, ballast::domain::RecordState::Parked);
    sim.stop();
    d.client.clone().close().await.unwrap();
}

/// Issue 23 in the browser: an `at_most_once` submit that timed out after
/// the provider took it parks `outcome_uncertain`; the record page shows
/// the ambiguous attempt with its request and offers the two choices:
/// "it took effect" with the provider's job id (then the step follows that
/// job: nothing sent again) and a retry warned that it may charge twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_call_offers_the_operator_its_two_choices() {
    let Some(d) = driver("browser_uncertain").await else {
        return;
    };
    let c = &d.client;
    let (base, jobs) = crate::engine::lookup_provider().await;
    let text = format!(
        r#"
[providers.p]
base_url = "{base}"
timeout = "500ms"
at_most_once = true
[[providers.p.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[pipelines.render.steps]]
name = "render"
provider = "p"
kind = "submit_poll"
request = {{ method = "POST", path = "/v1/jobs", body = '{{"client_reference": "{{{{ key }}}}", "mode": "took"}}' }}
job_id = "/id"
poll = {{ path = "/v1/jobs/{{{{ job_id }}}}", every = "1s", deadline = "10m" }}
"#
    );
    // The app runs the pipeline too (an operator's "it took effect" needs
    // a node that knows its steps); the test's engine works ten days
    // ahead of the wall clock, so the app's workers, on the wall clock,
    // leave the record to it until the operator acts.
    let Some(app) = WebApp::spawn(Backend::Sqlite, "browser_uncertain", &text).await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let config = ballast::config::Config::parse(&text, std::path::Path::new("u.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let ahead = crate::helpers::wall_ms() + 10 * 86_400_000;
    let (engine, clock) =
        crate::engine::manual_engine_at(&app.t.db, std::sync::Arc::new(config), "bu", ahead).await;
    let id = engine
        .enqueue(Enqueue::new("render", Some("u-1"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    crate::engine::drain(&engine).await;
    let job = jobs.lock().unwrap()[0].0.clone();

    login(c, &app, "admin").await;
    c.goto(&app.url(&format!("/records/{id}"))).await.unwrap();
    wait_text(c, "#record-state", "parked").await;
    assert!(text_of(c, ".facts").await.contains("outcome_uncertain"));
    let attempts = text_of(c, "#attempts").await;
    assert!(attempts.contains("provider_timeout"), "{attempts}");
    assert!(
        attempts.contains("POST") && attempts.contains("/v1/jobs"),
        "the request: {attempts}"
    );
    assert!(
        text_of(c, "#resend-warning").await.contains("charge twice"),
        "a retry is warned"
    );
    shot(c, "record-outcome-uncertain").await;
    // The operator checked with the provider: it took effect.
    c.find(Locator::Css("#took-effect input[name=job_id]"))
        .await
        .unwrap()
        .send_keys(&job)
        .await
        .unwrap();
    c.find(Locator::Css("#took-effect button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // Pending (or already taken by a worker: the app's, on the wall
    // clock, may poll the job first; the test's engine otherwise).
    wait::until(
        "the record leaves `parked`",
        Duration::from_secs(20),
        async || match app.t.db.get_record(id).await {
            Ok(Some(r)) if r.state != ballast::domain::RecordState::Parked => Ok(()),
            other => Err(other.map(|r| r.map(|r| r.state))),
        },
    )
    .await;
    clock.advance(1_000);
    crate::engine::drain(&engine).await;
    c.goto(&app.url(&format!("/records/{id}"))).await.unwrap();
    wait_text(c, "#record-state", "succeeded").await;
    wait_text(c, "#timeline", "took_effect").await;
    assert_eq!(jobs.lock().unwrap().len(), 1, "nothing sent again");
    let e = app
        .t
        .db
        .record_events(id)
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.kind == "took_effect")
        .unwrap();
    assert_eq!((e.actor.as_str(), e.audit), ("admin", true));
    assert_eq!(e.detail.unwrap()["job_id"], json!(job));
    d.client.clone().close().await.unwrap();
}

/// A record waiting for a person: found through the records list's
/// "waiting for a person", its graph saying so, approved on its page with
/// a comment (required), the decision audited and branched on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_approves_a_waiting_record_on_its_page() {
    let Some(d) = driver("browser_approval").await else {
        return;
    };
    let c = &d.client;
    let text = r#"
[[pipelines.onboard.steps]]
name = "review"
kind = "approval"
[[pipelines.onboard.steps]]
name = "welcome"
kind = "sleep"
for = "1ms"
needs = ["review"]
when = "steps.review.output.decision == 'approved'"
"#;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "browser_approval", text).await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let engine = app.state.engine.clone().expect("the app runs workers");
    let id = engine
        .enqueue(Enqueue::new(
            "onboard",
            Some("o-1"),
            json!({ "name": "Ada" }),
        ))
        .await
        .unwrap()
        .record
        .id;
    wait::until(
        "the record waits for a person",
        Duration::from_secs(20),
        async || match app.t.db.get_record(id).await {
            Ok(Some(r)) if r.error_code.as_deref() == Some("awaiting_approval") => Ok(()),
            other => Err(other.map(|r| r.map(|r| (r.state, r.error_code)))),
        },
    )
    .await;
    login(c, &app, "admin").await;
    c.goto(&app.url("/records")).await.unwrap();
    click(c, "#waiting-for-a-person").await;
    wait_text(c, "#records-list", "o-1").await;
    c.goto(&app.url(&format!("/records/{id}"))).await.unwrap();
    wait_text(c, "#record-state", "waiting").await;
    assert!(text_of(c, ".graph").await.contains("awaits approval"));
    shot(c, "record-awaiting-approval").await;
    // No comment, no decision: the browser holds the form back (the
    // comment is required and missing, so the click sends nothing).
    click(c, "#decide button[data-action=approve]").await;
    let missing = c
        .execute(
            "return document.querySelector('#decide input[name=reason]').validity.valueMissing;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(missing, json!(true), "the comment is required");
    assert_eq!(
        app.t.db.get_record(id).await.unwrap().unwrap().state,
        ballast::domain::RecordState::Waiting
    );
    c.find(Locator::Css("#decide input[name=reason]"))
        .await
        .unwrap()
        .send_keys("passport checked by phone")
        .await
        .unwrap();
    click(c, "#decide button[data-action=approve]").await;
    wait_text(c, "#record-state", "succeeded").await;
    wait_text(c, "#timeline", "approve").await;
    let runs = app.t.db.step_runs(id).await.unwrap();
    let review = runs.iter().find(|r| r.step == "review").unwrap();
    let output = review.output.clone().unwrap_or_default();
    assert_eq!(
        (&output["decision"], &output["comment"], &output["by"]),
        (
            &json!("approved"),
            &json!("passport checked by phone"),
            &json!("admin")
        )
    );
    let welcome = runs.iter().find(|r| r.step == "welcome").unwrap();
    assert_eq!(welcome.state, ballast::domain::StepState::Succeeded);
    let e = app
        .t
        .db
        .record_events(id)
        .await
        .unwrap()
        .into_iter()
        .find(|e| e.kind == "approve")
        .unwrap();
    assert_eq!(
        (e.actor.as_str(), e.audit, e.reason.as_deref()),
        ("admin", true, Some("passport checked by phone"))
    );
    d.client.clone().close().await.unwrap();
}

/// The `value` of the field `css` selects, as the page has it now.
async fn value_of(c: &Client, css: &str) -> Option<String> {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .prop("value")
        .await
        .unwrap()
}

/// Moves the keyboard's focus off any field (a click on the heading).
async fn blur(c: &Client) {
    c.find(Locator::Css("h1"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// The element that has the keyboard's focus, as `css` would name it: its
/// tag and name (or id).
async fn focused(c: &Client) -> String {
    let v = c
        .execute(
            "var e = document.activeElement; return e.tagName.toLowerCase() + ':' + (e.name || e.id || '');",
            vec![],
        )
        .await
        .unwrap();
    v.as_str().unwrap_or_default().to_owned()
}

/// Issue 21 item 4: the records list by keyboard. `/` goes to the search
/// box; `j`/`k` move along the rows (the current one marked and focused),
/// `x` selects it, `?` lists the shortcuts (`Esc` closes the list), `p`
/// readies the bulk form to park the selection, asking for the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_list_works_by_keyboard() {
    let Some(d) = driver("keyboard").await else {
        return;
    };
    let c = &d.client;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "keyboard", "").await else {
        return;
    };
    app.user("op", Role::Operator).await;
    let mut ids = Vec::new();
    for k in 0..3 {
        ids.push(app.record(&format!("kb-{k}")).await);
    }
    login(c, &app, "op").await;
    c.goto(&app.url("/records")).await.unwrap();
    let keys = async |k: &str| {
        c.active_element()
            .await
            .unwrap()
            .send_keys(k)
            .await
            .unwrap();
    };
    keys("/").await;
    assert_eq!(focused(c).await, "input:q");
    blur(c).await;
    assert_eq!(focused(c).await, "body:");

    // Newest first: the second row is the second newest record.
    keys("j").await;
    keys("j").await;
    keys("k").await;
    keys("j").await;
    let current = c
        .find(Locator::Css(
            "#records-list tbody tr.current[aria-current=true] input[name=ids]",
        ))
        .await
        .unwrap();
    assert_eq!(
        current.attr("value").await.unwrap(),
        Some(ids[1].to_string())
    );
    assert_eq!(focused(c).await, "a:");
    keys("x").await;
    let ticked = |id: i64| {
        let css = format!("input[name=ids][value='{id}']");
        async move {
            c.find(Locator::Css(&css))
                .await
                .unwrap()
                .is_selected()
                .await
                .unwrap()
        }
    };
    assert!(ticked(ids[1]).await);
    assert!(!ticked(ids[0]).await && !ticked(ids[2]).await);

    keys("?").await;
    let help = c.find(Locator::Css("dialog#shortcuts")).await.unwrap();
    assert!(help.attr("open").await.unwrap().is_some(), "the list opens");
    assert!(help.text().await.unwrap().contains("next / previous row"));
    keys("\u{e00c}").await; // Escape
    assert!(help.attr("open").await.unwrap().is_none(), "Esc closes it");

    keys("p").await;
    let action = value_of(c, "#bulk select[name=action]").await;
    assert_eq!(action.as_deref(), Some("park"));
    assert_eq!(focused(c).await, "input:reason");
    // Typing goes to the reason now, not to the shortcuts.
    keys("jx").await;
    assert!(!ticked(ids[2]).await);
    let reason = value_of(c, "#bulk input[name=reason]").await;
    assert_eq!(reason.as_deref(), Some("jx"));
    app.stop().await;
}

/// Issue 21 item 1: a record's page follows the record. An operator has
/// a parked record open and is typing a reason to park it again; meanwhile
/// someone else resumes it and the engine calls its provider (held, then
/// answered): the page shows it running, then succeeded, its attempt and
/// timeline rows, and the actions a succeeded record allows, without a
/// reload, and the reason being typed is still there (a form being filled
/// in is never replaced). The pause toggle says it is paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_page_follows_the_record_without_a_reload() {
    let Some(d) = driver("live record").await else {
        return;
    };
    let c = &d.client;
    // The provider accepts a job and calls back when it is done: the
    // record waits (`waiting`) until the test delivers the callback.
    let mut gate = crate::helpers::Gate::spawn_replying("queued").await;
    let toml = format!(
        r#"
[providers.gate]
base_url = "{}"
timeout = "30s"
webhook_secrets_env = ["TEST_HOOK_SECRET"]
[[providers.gate.rules]]
when = {{ status = "2xx", field = "/status", equals = "queued" }}
outcome = "pending"
[[providers.gate.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[pipelines.manual.steps]]
name = "charge"
provider = "gate"
kind = "callback"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "{{{{ record.id }}}}"}}' }}
job_id = "/id"
callback = {{ job_id = "/job_id", deadline = "10m" }}
"#,
        gate.url
    );
    let Some(app) = WebApp::spawn(Backend::Sqlite, "live_record", &toml).await else {
        return;
    };
    app.user("op", Role::Operator).await;
    let id = app.record("live-1").await;
    app.park(id).await;
    login(c, &app, "op").await;
    c.goto(&app.url(&format!("/records/{id}"))).await.unwrap();
    wait_text(c, "#record-state", "parked").await;
    let park_reason = "#record-actions form:has(button[data-action=park]) input[name=reason]";
    c.find(Locator::Css(park_reason))
        .await
        .unwrap()
        .send_keys("typed while it moved")
        .await
        .unwrap();

    app.act(id, OperatorAction::Resume).await;
    let held = gate
        .next(Duration::from_secs(30), "the resumed record's call")
        .await;
    wait_text(c, "#record-state", "running").await;
    held.release();
    // The job accepted: the record waits for its callback, its step drawn
    // waiting on the job and its first attempt on the step's lane.
    wait_text(c, "#record-state", "waiting").await;
    wait_text(c, "#record-graph", "waiting on its job").await;
    wait_text(c, "#record-lanes", "1 attempt: 1 pending").await;
    let body = format!(r#"{{"job_id": "ch_{id}", "status": "succeeded"}}"#);
    let secret = crate::helpers::HOOK_SECRET;
    let now_s = crate::helpers::wall_ms() / 1000;
    let signature = ballast::auth::webhook::sign(secret.as_bytes(), now_s, body.as_bytes());
    let (status, reply) = crate::helpers::http_post(
        app.addr,
        "/hooks/gate",
        &[("x-signature", &signature)],
        body.as_bytes(),
    )
    .await;
    assert_eq!(status, 202, "{reply}");
    wait_text(c, "#record-state", "succeeded").await;
    wait_text(c, "#record-history #attempts", "success").await;
    wait_text(c, "#record-history #timeline", "succeeded").await;
    wait_text(c, "#record-lanes", "2 attempts: 1 pending, 1 success").await;
    wait_text(c, "#record-graph", "done").await;
    // The actions being filled in stayed as they were.
    let typed = value_of(c, park_reason).await;
    assert_eq!(typed.as_deref(), Some("typed while it moved"));
    assert!(text_of(c, "#live-note").await.contains("succeeded"));
    // Left alone again, the actions catch up with the record: a
    // succeeded record is not resumed.
    let field = c.find(Locator::Css(park_reason)).await.unwrap();
    field.clear().await.unwrap();
    blur(c).await;
    let resume = "#record-actions button[data-action=resume]";
    wait::until(
        "the actions of a succeeded record",
        Duration::from_secs(20),
        async || match c.find(Locator::Css(resume)).await {
            Ok(_) => Err("resume still offered"),
            Err(_) => Ok(()),
        },
    )
    .await;

    let toggle = c.find(Locator::Css("#live-toggle")).await.unwrap();
    toggle.click().await.unwrap();
    assert_eq!(
        toggle.attr("aria-pressed").await.unwrap().as_deref(),
        Some("true")
    );
    assert!(text_of(c, "#live-note").await.contains("paused"));
    app.stop().await;
}

/// Issue 21 item 1: the providers page updates itself. An admin has it
/// open; another pauses a provider: the page shows it paused without a
/// reload. The admin pauses one from the page: it lands (an action is
/// never held). While a pause reason is being typed, the list waits (the
/// reason is kept, the page says so), and updates once the field is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_page_updates_itself() {
    let Some(d) = driver("live providers").await else {
        return;
    };
    let c = &d.client;
    let mut toml = String::new();
    for p in ["crm", "erp", "pay"] {
        toml.push_str(&format!(
            "[providers.{p}]\nbase_url = \"http://127.0.0.1:9\"\n"
        ));
    }
    let Some(app) = WebApp::spawn(Backend::Sqlite, "live_providers", &toml).await else {
        return;
    };
    login(c, &app, "admin").await;
    c.goto(&app.url("/providers")).await.unwrap();
    let db = &app.t.db;
    let set = |name: &'static str, paused: bool| async move {
        let now = crate::helpers::wall_ms();
        db.set_provider_pause(name, paused, "other-admin", Some("maintenance"), now)
            .await
            .unwrap();
    };
    set("crm", true).await;
    wait_text(c, "section#crm h2", "paused").await;

    let reason = |p: &str| format!("section#{p} input[name=reason]");
    c.find(Locator::Css(&reason("erp")))
        .await
        .unwrap()
        .send_keys("erp upgrade")
        .await
        .unwrap();
    c.find(Locator::Css("section#erp button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_text(c, "section#erp h2", "paused").await;

    c.find(Locator::Css(&reason("pay")))
        .await
        .unwrap()
        .send_keys("pay window")
        .await
        .unwrap();
    set("crm", false).await;
    wait_text(c, "#live-note", "wait while a form").await;
    let typed = c.find(Locator::Css(&reason("pay"))).await.unwrap();
    assert_eq!(
        value_of(c, &reason("pay")).await.as_deref(),
        Some("pay window")
    );
    assert!(text_of(c, "section#crm h2").await.contains("paused"));
    typed.clear().await.unwrap();
    blur(c).await;
    wait::until("crm shown resumed", Duration::from_secs(20), async || {
        let h = text_of(c, "section#crm h2").await;
        if h.contains("paused") { Err(h) } else { Ok(()) }
    })
    .await;
    wait_text(c, "#live-note", "Updated every 5 s").await;
    app.stop().await;
}

/// Issue 21 item 1: the records list's first page updates itself: a new
/// record appears without a reload; while a box is ticked the list waits
/// (the tick is kept, the page says so), and it updates once unticked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_records_list_updates_itself_and_keeps_a_tick() {
    let Some(d) = driver("live list").await else {
        return;
    };
    let c = &d.client;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "live_list", "").await else {
        return;
    };
    app.user("op", Role::Operator).await;
    let first = app.record("list-1").await;
    login(c, &app, "op").await;
    c.goto(&app.url("/records")).await.unwrap();
    wait_text(c, "#records-list", "list-1").await;
    app.record("list-2").await;
    wait_text(c, "#records-list", "list-2").await;

    let tick = format!("input[name=ids][value='{first}']");
    c.find(Locator::Css(&tick))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    blur(c).await;
    app.record("list-3").await;
    wait_text(c, "#live-note", "wait while a form").await;
    let ticked = c.find(Locator::Css(&tick)).await.unwrap();
    assert!(ticked.is_selected().await.unwrap(), "the tick is kept");
    assert!(!text_of(c, "#records-list").await.contains("list-3"));
    ticked.click().await.unwrap();
    blur(c).await;
    wait_text(c, "#records-list", "list-3").await;
    wait_text(c, "#live-note", "updates itself").await;
    app.stop().await;
}

/// Search results and the audit log follow what they show, as every other
/// page of changing state does: a record found by search is parked and its
/// row says so; an action taken meanwhile appears in the audit log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_and_audit_update_themselves() {
    let Some(d) = driver("live search and audit").await else {
        return;
    };
    let c = &d.client;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "live_search", "").await else {
        return;
    };
    app.user("op", Role::Operator).await;
    // One key in two pipelines: the search lists both (one would be
    // opened straight away).
    let one = app.record("zebra").await;
    let other = ballast::store::NewRecord {
        pipeline: "other".into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some("zebra".into()),
        input: json!({}),
        run_at: crate::helpers::wall_ms() + 3_600_000,
    };
    let now = crate::helpers::wall_ms();
    let two = app.t.db.create_record(other, now).await.unwrap().record.id;
    login(c, &app, "op").await;
    c.goto(&app.url("/search?q=zebra")).await.unwrap();
    wait_text(c, "#search-named", "other").await;
    assert!(!text_of(c, "#search-named").await.contains("parked"));
    app.park(one).await;
    wait_text(c, "#search-named", "parked").await;

    c.goto(&app.url("/audit")).await.unwrap();
    wait_text(c, "#audit-list", "park").await;
    assert!(!text_of(c, "#audit-list").await.contains("cancel"));
    app.act(two, OperatorAction::Cancel).await;
    wait_text(c, "#audit-list", "cancel").await;
    app.stop().await;
}

/// Issue 21 item 6: at home on a phone. At 375 px wide no page scrolls
/// sideways, the records list is cards with its bulk action and links on
/// the page, and the phone screenshot is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_fits_a_phone() {
    let Some(d) = driver("phone").await else {
        return;
    };
    let c = &d.client;
    let Some(app) = WebApp::spawn(
        Backend::Sqlite,
        "phone",
        "[providers.crm]\nbase_url = \"http://127.0.0.1:9\"\n",
    )
    .await
    else {
        return;
    };
    let id = app
        .record("a-rather-long-key-for-a-narrow-screen-0001")
        .await;
    app.park(id).await;
    login(c, &app, "admin").await;
    c.set_window_size(375, 812).await.unwrap();
    let width = async || {
        let v = c
            .execute(
                "return [document.documentElement.scrollWidth, window.innerWidth];",
                vec![],
            )
            .await
            .unwrap();
        (v[0].as_i64().unwrap(), v[1].as_i64().unwrap())
    };
    for path in [
        "/".to_owned(),
        "/records".to_owned(),
        format!("/records/{id}"),
        "/providers".to_owned(),
        "/audit".to_owned(),
        "/admin/users".to_owned(),
    ] {
        c.goto(&app.url(&path)).await.unwrap();
        let (scroll, inner) = width().await;
        assert!(inner <= 400, "a phone's width: {inner}");
        assert!(
            scroll <= inner,
            "{path} scrolls sideways: {scroll} > {inner}"
        );
    }
    // At 390 px the filters fold behind a disclosure (the list starts on
    // the first screen), open when a filter is set, and open on a wide
    // screen.
    c.set_window_size(390, 844).await.unwrap();
    let filters_open = async |path: &str| {
        c.goto(&app.url(path)).await.unwrap();
        let v = c
            .execute(
                "return document.querySelector('details.filter-box').open;",
                vec![],
            )
            .await
            .unwrap();
        v.as_bool().unwrap()
    };
    assert!(!filters_open("/records").await, "folded on a phone");
    assert!(
        filters_open("/records?state=parked").await,
        "open: a filter is set"
    );
    let list_top = c
        .execute(
            "return document.querySelector('#records-list').getBoundingClientRect().top < window.innerHeight;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        list_top.as_bool(),
        Some(true),
        "the list starts on the first screen"
    );
    c.set_window_size(1400, 1000).await.unwrap();
    assert!(filters_open("/records").await, "open on a wide screen");
    c.set_window_size(375, 812).await.unwrap();
    c.goto(&app.url("/records")).await.unwrap();
    let button = c
        .find(Locator::Css("#bulk button[type=submit]"))
        .await
        .unwrap();
    assert!(button.is_displayed().await.unwrap());
    let label = c
        .execute(
            "return getComputedStyle(document.querySelector('#records-list td[data-label=Key]'), '::before').content;",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(label.as_str(), Some("\"Key: \""), "cards label their cells");
    shot(c, "phone-records").await;
    c.goto(&app.url(&format!("/records/{id}"))).await.unwrap();
    shot(c, "phone-record").await;
    app.stop().await;
}

/// axe-core as published on npm (`tests/fixtures/axe/README.md`).
const AXE: &str = include_str!("../fixtures/axe/axe.min.js");

/// The violations axe rates serious or critical on the page `c` shows,
/// one line each (rule, impact, help, where).
async fn axe_violations(c: &Client) -> Vec<String> {
    c.execute(AXE, vec![]).await.unwrap();
    let found = c
        .execute_async(
            r#"const done = arguments[arguments.length - 1];
axe.run(document, { resultTypes: ["violations"] })
  .then(r => done({ passed: r.passes.length, bad: r.violations
    .filter(v => v.impact === "serious" || v.impact === "critical")
    .map(v => v.id + " (" + v.impact + "): " + v.help + " at "
      + v.nodes.slice(0, 4).map(n => n.target.join(" ")).join(", ")) }))
  .catch(e => done({ passed: 0, bad: ["axe could not run: " + e] }));"#,
            vec![],
        )
        .await
        .unwrap();
    // A run that checked nothing would find nothing.
    assert!(
        found["passed"].as_u64() > Some(10),
        "axe ran its rules: {found}"
    );
    found["bad"]
        .as_array()
        .expect("a list of violations")
        .iter()
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Issue 21 item 5: axe-core finds no serious or critical violation on
/// any page, logged out and logged in as each role, light and dark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_passes_axe_for_every_role() {
    let Some(d) = driver("axe").await else {
        return;
    };
    let c = &d.client;
    // A provider nobody answers: records retry, then park, so pages have
    // attempts, lanes and a drawn pipeline to check.
    let config = r#"
[providers.crm]
base_url = "http://127.0.0.1:9"
timeout = "2s"
retry = { max_attempts = 2, base = "10ms", cap = "20ms", deadline = "30s" }
[[pipelines.leads.steps]]
name = "lookup"
provider = "crm"
request = { path = "/lookup" }
[[pipelines.leads.steps]]
name = "sync"
provider = "crm"
needs = ["lookup"]
required = false
request = { path = "/sync" }
[providers.hooks]
base_url = "http://127.0.0.1:9"
[[notify]]
name = "ops"
provider = "hooks"
path = "/hooks"
format = "slack"
events = ["record.*"]
"#;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "axe", config).await else {
        return;
    };
    app.user("viewer", Role::Viewer).await;
    app.user("operator", Role::Operator).await;
    let token = app.token(Role::Operator).await;
    for key in ["lead-1", "lead-2"] {
        let r = app
            .client
            .post(app.url("/api/v1/records"))
            .bearer_auth(&token)
            .json(&json!({"pipeline": "leads", "key": key, "input": {"email": "a@example.com"}}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
    }
    let parked = wait::until("a record parks", Duration::from_secs(60), async || {
        let page = app
            .t
            .db
            .list_records(&ballast::store::RecordFilter {
                state: Some(ballast::domain::RecordState::Parked),
                limit: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        page.items.first().map(|r| r.id).ok_or(())
    })
    .await;
    let other = app.record("a-manual-record").await;
    let mut failures = Vec::new();
    let check = async |path: &str, who: &str| -> Vec<String> {
        c.goto(&app.url(path)).await.unwrap();
        axe_violations(c)
            .await
            .into_iter()
            .map(|v| format!("{path} as {who}: {v}"))
            .collect()
    };
    failures.extend(check("/login", "nobody").await);
    for user in ["viewer", "operator", "admin"] {
        login(c, &app, user).await;
        let mut pages = vec![
            "/".to_owned(),
            "/records".to_owned(),
            "/records?state=parked&pipeline=leads".to_owned(),
            format!("/records/{parked}"),
            format!("/records/{other}"),
            "/pipelines".to_owned(),
            "/providers".to_owned(),
            "/audit".to_owned(),
            "/triggers".to_owned(),
            "/notifications".to_owned(),
            "/search?q=lead".to_owned(),
            "/records/999999999".to_owned(),
        ];
        if user == "admin" {
            pages.extend(["/admin/users".to_owned(), "/admin/tokens".to_owned()]);
        }
        for p in &pages {
            failures.extend(check(p, user).await);
        }
        if user == "admin" {
            // Dark, as chosen with the header's button: kept with the user,
            // so a new login has it too.
            click(c, "#theme-toggle").await;
            c.wait()
                .at_most(Duration::from_secs(10))
                .for_element(Locator::Css("html[data-theme=dark]"))
                .await
                .unwrap();
            c.delete_all_cookies().await.unwrap();
            login(c, &app, user).await;
            for p in &pages {
                c.goto(&app.url(p)).await.unwrap();
                // Error pages are drawn before anyone is known: the system's.
                let dark = c.find(Locator::Css("html[data-theme=dark]")).await;
                assert!(
                    dark.is_ok() || p.contains("999999999"),
                    "{p} is dark for its user"
                );
                for v in axe_violations(c).await {
                    failures.push(format!("{p} as {user}, dark: {v}"));
                }
            }
        }
        c.delete_all_cookies().await.unwrap();
    }
    assert!(failures.is_empty(), "axe:\n{}", failures.join("\n"));
    app.stop().await;
}

/// Single sign-on in a real browser, the provider on another site
/// (`localhost`) than Ballast (`127.0.0.1`), as a company's is: its
/// redirect back carries the sign-in's `SameSite=Lax` cookie, and the
/// session's `SameSite=Strict` cookie reaches the page asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_sign_on_works_in_a_real_browser() {
    let Some(d) = driver("sign-on").await else {
        return;
    };
    let c = &d.client;
    let accounts = json!({ "alice": ["ops"] });
    let Some(idp) = crate::sign_on::Provider::start_on("localhost", accounts).await else {
        return;
    };
    let Some(t) = crate::helpers::TestDb::new(Backend::Sqlite, "browser_sign_on").await else {
        return;
    };
    let settings = crate::sign_on::settings(&idp.issuer, "label = \"Acme ID\"");
    let app = WebApp::spawn_edited(t, &settings, true, crate::sign_on::with_secret).await;
    c.goto(&app.url("/login?next=/records")).await.unwrap();
    c.find(Locator::LinkText("Sign in with Acme ID"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The provider's own login form, then its consent.
    let login = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("input[name=login]"))
        .await
        .unwrap();
    assert!(
        c.current_url()
            .await
            .unwrap()
            .as_str()
            .starts_with(&idp.issuer)
    );
    login.send_keys("alice").await.unwrap();
    c.find(Locator::Css("input[name=password]"))
        .await
        .unwrap()
        .send_keys("any")
        .await
        .unwrap();
    click(c, "button[type=submit]").await;
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("input[name=prompt][value=consent]"))
        .await
        .unwrap();
    click(c, "button[type=submit]").await;
    let found = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::XPath("//h1[text()='Records']"))
        .await;
    let url = c.current_url().await.unwrap();
    if found.is_err() {
        let src = c.source().await.unwrap_or_default();
        panic!(
            "no records page after signing in: at {url}: {}",
            &src[..src.len().min(1500)]
        );
    }
    assert_eq!(url.as_str(), app.url("/records"));
    assert!(text_of(c, "header.top").await.contains("alice"));
    let alice = app.t.db.user_by_name("alice").await.unwrap().unwrap();
    assert_eq!((alice.role, alice.signs_on), (Role::Operator, true));
    app.stop().await;
}

/// No browser outlives its test: a session opened and a page loaded, then
/// the driver dropped (as at the end of every browser test, passed,
/// failed or panicked): no process of chromedriver's group, Chromium and
/// its helpers included, is left running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_browser_outlives_its_test() {
    let Some(d) = driver("no browser left").await else {
        return;
    };
    d.client.goto("about:blank").await.unwrap();
    let group = d.child.id();
    let running = live_in_group(group);
    assert!(
        running.iter().any(|p| p.contains("chrom")),
        "the browser runs in chromedriver's group: {running:?}"
    );
    drop(d);
    let left = wait::until(
        "the browsers are gone",
        Duration::from_secs(30),
        async || {
            let left = live_in_group(group);
            if left.is_empty() { Ok(()) } else { Err(left) }
        },
    )
    .await;
    println!(
        "no browser left: {} processes were in the group, none is now {left:?}",
        running.len()
    );
}
