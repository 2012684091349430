//! Issue 49 item 5: secrets from files. Every `*_env` setting has a
//! `*_file` twin (a relative path read in systemd's
//! `$CREDENTIALS_DIRECTORY`, else beside the configuration file), the
//! server's secret variables a `_FILE` twin, and a reload reads every
//! secret again and applies a changed one without a restart.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ballast::domain::RecordState;
use ballast::store::Backend;
use serde_json::json;

use crate::cli::{ballast, start_serve, stderr, stdout};
use crate::helpers::{TestDb, free_port};

/// A provider that answers every `POST /v1/charge` `succeeded` and keeps
/// the `Authorization` header of each call.
async fn provider() -> (String, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = axum::Router::new().route(
        "/v1/charge",
        axum::routing::post({
            let seen = seen.clone();
            move |headers: axum::http::HeaderMap| {
                let seen = seen.clone();
                async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    seen.lock().unwrap().push(auth);
                    axum::Json(json!({ "status": "succeeded", "id": "c1" }))
                }
            }
        }),
    );
    (crate::helpers::serve_router(app).await, seen)
}

/// Provider `acme` authenticated by the key in file `key` (as written),
/// and pipeline `pay` calling it once.
fn config(base: &str, key: &str) -> String {
    format!(
        r#"
[providers.acme]
base_url = "{base}"
auth = {{ header = "Authorization", value_file = "{key}", scheme = "Bearer" }}
webhook_secrets_file = ["hook_secret"]

[[providers.acme.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.pay.steps]]
name = "charge"
provider = "acme"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "{{{{ key }}}}"}}' }}
"#
    )
}

/// Tells node `pid` to reload (SIGHUP): the line its log says of it.
async fn reload(pid: &str, log: &mut crate::wait::Lines) -> String {
    assert!(
        Command::new("kill")
            .args(["-HUP", pid])
            .status()
            .unwrap()
            .success()
    );
    log.until("the reload", Duration::from_secs(30), |l| {
        l.contains("configuration reloaded") || l.contains("reload refused")
    })
    .await
}

/// The webhook secret the configuration's `webhook_secrets_file` names.
const HOOK_SECRET: &str = "a-webhook-secret-of-32-bytes!!!!\n";

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// `check-config` reads a provider's key from a file beside the
/// configuration, or in `$CREDENTIALS_DIRECTORY` when systemd sets it,
/// and the server's secrets from their `_FILE` twins; a missing file,
/// both twins set, or an empty file is refused naming the setting, never
/// printing a value.
#[test]
fn check_config_reads_secrets_from_files() {
    let dir = tempfile::tempdir().unwrap();
    let creds = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "ballast.toml",
        &config("https://acme.example", "acme_key"),
    );
    write(dir.path(), "acme_key", "key-beside\n");
    write(dir.path(), "hook_secret", HOOK_SECRET);
    let out = ballast(dir.path(), &[], &["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains("key-beside"), "{}", stdout(&out));

    // Under systemd a relative file is the unit's credential.
    let creds_dir = creds.path().to_str().unwrap();
    let under_systemd = [("CREDENTIALS_DIRECTORY", creds_dir)];
    let out = ballast(dir.path(), &under_systemd, &["check-config"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    let said = stderr(&out);
    assert!(
        said.contains("providers.acme.auth.value_file")
            && said.contains(&format!("cannot read file {creds_dir}/acme_key")),
        "{said}"
    );
    write(creds.path(), "acme_key", "key-credential");
    write(creds.path(), "hook_secret", HOOK_SECRET);
    write(
        creds.path(),
        "secret_key",
        "a-session-signing-key-of-enough-bytes-0123456789",
    );
    write(
        creds.path(),
        "metrics_token",
        "a-metrics-token-of-enough-bytes!",
    );
    let server = [
        ("CREDENTIALS_DIRECTORY", creds_dir),
        ("BALLAST_SECRET_KEY_FILE", "secret_key"),
        ("BALLAST_METRICS_TOKEN_FILE", "metrics_token"),
    ];
    let out = ballast(dir.path(), &server, &["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("overridden by: BALLAST_SECRET_KEY_FILE, BALLAST_METRICS_TOKEN_FILE"),
        "{text}"
    );
    for secret in ["key-credential", "session-signing", "metrics-token"] {
        assert!(!text.contains(secret), "{text}");
    }

    // One of a pair, a file that holds something.
    let both = [
        ("CREDENTIALS_DIRECTORY", creds_dir),
        ("BALLAST_METRICS_TOKEN", "a-metrics-token-of-enough-bytes!"),
        ("BALLAST_METRICS_TOKEN_FILE", "metrics_token"),
    ];
    let out = ballast(dir.path(), &both, &["check-config"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("set BALLAST_METRICS_TOKEN or BALLAST_METRICS_TOKEN_FILE, not both"),
        "{}",
        stderr(&out)
    );
    write(creds.path(), "metrics_token", "\n");
    let out = ballast(dir.path(), &server, &["check-config"]);
    assert!(!out.status.success());
    let said = stderr(&out);
    assert!(
        said.contains("BALLAST_METRICS_TOKEN_FILE") && said.contains("is set but empty"),
        "{said}"
    );
    let text = config("https://acme.example", "acme_key").replace(
        "value_file = \"acme_key\"",
        "value_env = \"K\", value_file = \"acme_key\"",
    );
    write(dir.path(), "ballast.toml", &text);
    let out = ballast(dir.path(), &[("K", "x")], &["check-config"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("set `auth.value_env` or `auth.value_file`, not both"),
        "{}",
        stderr(&out)
    );
}

/// A node reads its provider key from a file; the file rotated and the
/// node told to reload (SIGHUP), the next call carries the new key, with
/// no restart; the log says a provider's secrets changed, never which
/// value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_a_rotated_secret_file() {
    let (base, seen) = provider().await;
    let t = TestDb::new(Backend::Sqlite, "secrets_reload")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let creds = tempfile::tempdir().unwrap();
    write(dir.path(), "ballast.toml", &config(&base, "acme_key"));
    write(creds.path(), "acme_key", "key-one\n");
    write(creds.path(), "hook_secret", HOOK_SECRET);
    write(
        creds.path(),
        "admin_password",
        &crate::web::password_of("admin"),
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let env = [
        ("BALLAST_DATABASE_URL", t.url.as_str()),
        ("BALLAST_ADMIN_PASSWORD_FILE", "admin_password"),
        ("CREDENTIALS_DIRECTORY", creds.path().to_str().unwrap()),
    ];
    let (child, mut log) = start_serve(dir.path(), addr, &env).await;
    let token = crate::reload::admin_token(&t.db).await;
    let client = reqwest::Client::new();
    let enqueue_and_finish = async |key: &str| {
        let reply = client
            .post(format!("http://{addr}/api/v1/records"))
            .bearer_auth(&token)
            .json(&json!({ "pipeline": "pay", "key": key, "input": {} }))
            .send()
            .await
            .unwrap();
        assert!(reply.status().is_success(), "{}", reply.status());
        let body: serde_json::Value = reply.json().await.unwrap();
        let id = body["record"]["id"].as_i64().unwrap();
        crate::wait::until(key, Duration::from_secs(60), async || {
            let r = t.db.get_record(id).await.unwrap().unwrap();
            match r.state {
                RecordState::Succeeded => Ok(()),
                _ => Err(r),
            }
        })
        .await;
    };
    enqueue_and_finish("r1").await;
    assert_eq!(*seen.lock().unwrap(), ["Bearer key-one"]);

    write(creds.path(), "acme_key", "key-two\n");
    // The first admin's password, read at start only, may be gone.
    std::fs::remove_file(creds.path().join("admin_password")).unwrap();
    let pid = child.id().to_string();
    let line = reload(&pid, &mut log).await;
    assert!(line.contains("provider acme: new secrets"), "{line}");
    assert!(
        !line.contains("key-two") && !line.contains("key-one"),
        "{line}"
    );
    enqueue_and_finish("r2").await;
    assert_eq!(*seen.lock().unwrap(), ["Bearer key-one", "Bearer key-two"]);

    // A secret file that cannot be read refuses the reload; the node
    // runs on with the key it has.
    std::fs::remove_file(creds.path().join("acme_key")).unwrap();
    let line = reload(&pid, &mut log).await;
    assert!(
        line.contains("reload refused") && line.contains("auth.value_file"),
        "{line}"
    );
    enqueue_and_finish("r3").await;
    assert_eq!(
        *seen.lock().unwrap(),
        ["Bearer key-one", "Bearer key-two", "Bearer key-two"]
    );
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    crate::wait::exit(child, "the node stops", Duration::from_secs(30)).await;
}
