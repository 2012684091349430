//! The `ballast` binary as an operator uses it.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use ballast::store::Backend;

use crate::helpers::{TestDb, free_port, http_get};
use crate::wait;

const PASSWORD: &str = "correct horse battery staple";

/// Runs `ballast ARGS` in `dir` with only the given BALLAST_* variables.
pub(crate) fn ballast(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ballast"));
    cmd.args(args);
    run(cmd, dir, env)
}

/// Runs `cmd` in `dir` with only the given BALLAST_* variables.
fn run(mut cmd: Command, dir: &Path, env: &[(&str, &str)]) -> Output {
    cmd.current_dir(dir).stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("BALLAST_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("BALLAST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// [`ballast`] on a blocking thread, so that the test's own tasks (a
/// writer under load, say) go on while the command runs.
pub(crate) async fn ballast_off_runtime(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (dir, args) = (dir.to_owned(), owned(args));
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ballast(&dir, &env, &args)
    })
    .await
    .unwrap()
}

pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A file's permission bits.
fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A database URL for the CLI on `backend`, and the guard keeping it alive.
async fn database(backend: Backend, test: &str) -> Option<TestDb> {
    TestDb::new(backend, test).await
}

#[test]
fn help_explains_each_command() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--help"], "Durable workflows"),
        (&["serve", "--help"], "stops gracefully on SIGINT/SIGTERM"),
        (&["migrate", "--help"], "embedded in this binary"),
        (&["migrate", "down", "--help"], "--to 0"),
        (&["user", "--help"], "Manage control-plane users"),
        (&["user", "add", "--help"], "BALLAST_PASSWORD"),
        (&["check-config", "--help"], "Validate the configuration"),
        (&["backup", "--help"], "VACUUM INTO"),
        (&["export", "--help"], "--key-prefix"),
        (&["purge", "--help"], "--dry-run"),
    ];
    for (args, phrase) in cases {
        let out = ballast(dir.path(), &[], args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert!(
            stdout(&out).contains(phrase),
            "{args:?} should mention {phrase:?}:\n{}",
            stdout(&out)
        );
    }
}

async fn user_add_stores_only_an_argon2id_hash(backend: Backend) {
    let Some(t) = database(backend, "user_add_stores_only_an_argon2id_hash").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("BALLAST_DATABASE_URL", t.url.as_str()),
        ("BALLAST_PASSWORD", PASSWORD),
    ];
    let out = ballast(
        dir.path(),
        &env,
        &["user", "add", "alice", "--role", "operator"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("added user alice with role operator"),
        "{}",
        stdout(&out)
    );

    let list = ballast(dir.path(), &env, &["user", "list"]);
    assert!(list.status.success(), "{}", stderr(&list));
    let line = stdout(&list)
        .lines()
        .find(|l| l.starts_with("alice"))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(
        line.contains("operator") && line.contains("active"),
        "{}",
        stdout(&list)
    );

    let user = t.db.user_by_name("alice").await.unwrap().unwrap();
    assert!(
        user.password_hash.starts_with("$argon2id$"),
        "{}",
        user.password_hash
    );
    assert!(!user.password_hash.contains(PASSWORD));
    assert!(ballast::auth::password::verify(
        PASSWORD,
        &user.password_hash
    ));

    let dup = ballast(dir.path(), &env, &["user", "add", "alice"]);
    assert!(!dup.status.success());
    assert!(stderr(&dup).contains("already exists"), "{}", stderr(&dup));

    let short = ballast(
        dir.path(),
        &[env[0], ("BALLAST_PASSWORD", "short")],
        &["user", "add", "bob"],
    );
    assert!(!short.status.success());
    assert!(stderr(&short).contains("at least 12"), "{}", stderr(&short));
    let common = ballast(
        dir.path(),
        &[env[0], ("BALLAST_PASSWORD", "Password1234!")],
        &["user", "add", "bob"],
    );
    assert!(!common.status.success());
    assert!(
        stderr(&common).contains("most common"),
        "{}",
        stderr(&common)
    );

    let no_tty = ballast(dir.path(), &env[..1], &["user", "add", "carol"]);
    assert!(!no_tty.status.success());
    assert!(
        stderr(&no_tty).contains("BALLAST_PASSWORD"),
        "{}",
        stderr(&no_tty)
    );

    let disabled = ballast(dir.path(), &env, &["user", "disable", "alice"]);
    assert!(disabled.status.success(), "{}", stderr(&disabled));
    let root = ballast(
        dir.path(),
        &env,
        &["user", "add", "root", "--role", "admin"],
    );
    assert!(root.status.success(), "{}", stderr(&root));
    let last = ballast(dir.path(), &env, &["user", "disable", "root"]);
    assert!(!last.status.success());
    assert!(
        stderr(&last).contains("last enabled admin"),
        "{}",
        stderr(&last)
    );
    assert!(stdout(&ballast(dir.path(), &env, &["user", "list"])).contains("disabled"));
    let missing = ballast(dir.path(), &env, &["user", "passwd", "nobody"]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("user `nobody` not found"),
        "{}",
        stderr(&missing)
    );
    // Limited to pipelines: made so, listed so, widened again; never an
    // admin.
    let support = ["user", "add", "support", "--pipelines", "lead-*, kyc"];
    let made = ballast(dir.path(), &env, &support);
    assert!(made.status.success(), "{}", stderr(&made));
    assert!(
        stdout(&made).contains("on lead-*, kyc"),
        "{}",
        stdout(&made)
    );
    let listed = stdout(&ballast(dir.path(), &env, &["user", "list"]));
    let line = listed
        .lines()
        .find(|l| l.starts_with("support"))
        .unwrap_or_default();
    assert!(line.ends_with("lead-*, kyc"), "{listed}");
    let admin = [
        "user",
        "add",
        "boss",
        "--role",
        "admin",
        "--pipelines",
        "kyc",
    ];
    let refused = ballast(dir.path(), &env, &admin);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("an admin sees every pipeline"),
        "{}",
        stderr(&refused)
    );
    let widened = ballast(dir.path(), &env, &["user", "pipelines", "support", "*"]);
    assert!(widened.status.success(), "{}", stderr(&widened));
    assert!(
        stdout(&widened).contains("now sees all pipelines"),
        "{}",
        stdout(&widened)
    );
    let user = t.db.user_by_name("support").await.unwrap().unwrap();
    assert!(user.pipelines.is_all());
}

#[tokio::test]
async fn sqlite_user_add_stores_only_an_argon2id_hash() {
    user_add_stores_only_an_argon2id_hash(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_user_add_stores_only_an_argon2id_hash() {
    user_add_stores_only_an_argon2id_hash(Backend::Postgres).await;
}

async fn migrate_round_trip(backend: Backend) {
    let Some(t) = database(backend, "migrate_round_trip").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let env = [("BALLAST_DATABASE_URL", t.url.as_str())];
    let run = |args: &[&str]| {
        let out = ballast(dir.path(), &env, args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stdout(&out)
    };
    let pending = run(&["migrate", "status"]);
    assert!(pending.contains("0001     pending    core"), "{pending}");
    assert!(
        pending.contains("0002     pending    control_plane")
            && pending.contains("0003     pending    throttled")
            && pending.contains("0004     pending    cluster_breaker")
            && pending.contains("0005     pending    provider_grants")
            && pending.contains("0006     pending    fair_queues")
            && pending.contains("0007     pending    attempt_requests")
            && pending.contains("0008     pending    step_versions")
            && pending.contains("0009     pending    step_confirmations")
            && pending.contains("0010     pending    park_until")
            && pending.contains("0011     pending    attempt_intents")
            && pending.contains("0012     pending    schedules")
            && pending.contains("0013     pending    retention"),
        "{pending}"
    );
    let up = run(&["migrate", "up"]);
    // Every shipped migration, whatever their number.
    let n = ballast::store::migrate::latest_version(backend);
    assert!(
        up.contains(&format!("[1/{n}] applying 0001 core"))
            && up.contains("applied 0001")
            && up.contains(&format!("[2/{n}] applied 0002"))
            && up.contains(&format!("[{n}/{n}] applied {n:04}")),
        "{up}"
    );
    assert!(
        up.contains(&format!(
            "{}: {n} applied; schema at version {n}",
            backend.as_str()
        )),
        "{up}"
    );
    assert!(run(&["migrate", "up"]).contains("0 applied"));
    let down = run(&["migrate", "down", "--to", "0"]);
    assert!(
        down.contains("reverted 0001") && down.contains("schema at version 0"),
        "{down}"
    );
    assert!(run(&["migrate", "up"]).contains("applied 0001"));
    let status = run(&["migrate", "status"]);
    assert!(status.contains("0001     applied    core"), "{status}");
    // Without --to, down reverts the latest migration only.
    let down = run(&["migrate", "down"]);
    assert!(
        down.contains(&format!("reverted {n:04}"))
            && !down.contains(&format!("reverted {:04}", n - 1)),
        "{down}"
    );
}

#[tokio::test]
async fn sqlite_migrate_round_trip() {
    migrate_round_trip(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_migrate_round_trip() {
    migrate_round_trip(Backend::Postgres).await;
}

#[test]
fn bad_config_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "unknown.toml",
            "[server]\nbind = \"127.0.0.1:9000\"\nbnd = \"oops\"\n",
            "unknown.toml:3:1: key `server.bnd`",
        ),
        (
            "syntax.toml",
            "[database]\nurl = \"sqlite://x.db\n",
            "syntax.toml:2:",
        ),
        (
            "type.toml",
            "[database]\nmax_connections = -3\n",
            "type.toml:2:19: key `database.max_connections`",
        ),
        ("table.toml", "[databse]\nurl = \"x\"\n", "table.toml:1:"),
        (
            "scheme.toml",
            "[database]\nurl = \"mysql://x\"\n",
            "config `database.url`",
        ),
    ];
    for (file, text, expected) in cases {
        std::fs::write(dir.path().join(file), text).unwrap();
        let out = ballast(dir.path(), &[], &["--config", file, "check-config"]);
        assert!(!out.status.success(), "{file} was accepted");
        let err = stderr(&out);
        assert_eq!(
            err.trim().lines().count(),
            1,
            "{file}: one line expected:\n{err}"
        );
        assert!(err.starts_with("error: "), "{file}: {err}");
        assert!(
            err.contains(expected),
            "{file}: expected {expected:?} in {err}"
        );
    }
    let missing = ballast(
        dir.path(),
        &[],
        &["--config", "absent.toml", "check-config"],
    );
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("config file absent.toml"),
        "{}",
        stderr(&missing)
    );
    let env = ballast(
        dir.path(),
        &[("BALLAST_SERVER_BIND", "everywhere")],
        &["check-config"],
    );
    assert!(
        stderr(&env).contains("environment variable BALLAST_SERVER_BIND"),
        "{}",
        stderr(&env)
    );
}

#[test]
fn check_config_reports_sources() {
    let dir = tempfile::tempdir().unwrap();
    let out = ballast(dir.path(), &[], &["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("config file: none (defaults)"));
    assert!(stdout(&out).contains("database.url: sqlite://ballast.db?mode=rwc"));
    assert!(stdout(&out).contains("traces: off"), "{}", stdout(&out));
    std::fs::write(
        dir.path().join("ballast.toml"),
        "[database]\nurl = \"postgres://u:s3cret@db/x\"\n",
    )
    .unwrap();
    let out = ballast(
        dir.path(),
        &[("BALLAST_SERVER_BIND", "127.0.0.1:9999")],
        &["check-config"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("config file: ballast.toml"), "{text}");
    assert!(
        text.contains("overridden by: BALLAST_SERVER_BIND"),
        "{text}"
    );
    assert!(text.contains("server.bind: 127.0.0.1:9999"), "{text}");
    assert!(
        !text.contains("s3cret") && text.contains("postgres://u:***@db/x"),
        "{text}"
    );
    // A provider's base URL is said without its password or key.
    std::fs::write(
        dir.path().join("ballast.toml"),
        "[providers.p]\nbase_url = \"https://u:pw-s3cret@api.example/v1?key=k-s3cret&page=2\"\n",
    )
    .unwrap();
    let out = ballast(dir.path(), &[], &["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(!text.contains("s3cret"), "{text}");
    assert!(
        text.contains("provider p: https://u:[redacted]@api.example/v1?key=[redacted]&page=2"),
        "{text}"
    );
}

#[tokio::test]
async fn serve_answers_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let (child, log) = start_serve(dir.path(), addr, &[]).await;
    assert_eq!(http_get(addr, "/readyz").await.0, 200);
    assert!(
        dir.path().join("ballast.db").exists(),
        "the default database is a file in the working directory"
    );
    // The first start created one admin; `user list` sees it.
    let users = ballast(dir.path(), &[], &["user", "list"]);
    assert_eq!(
        stdout(&users).matches("admin").count(),
        2,
        "{}",
        stdout(&users)
    );

    // The port is taken now: a second server says so in one line.
    let taken = ballast(dir.path(), &[], &["serve", "--bind", &addr.to_string()]);
    assert!(!taken.status.success());
    assert!(
        stderr(&taken).contains(&format!("cannot listen on {addr}")),
        "{}",
        stderr(&taken)
    );

    // A failed login's name is logged with its control characters
    // escaped: a line break in it cannot forge a line.
    let forged = reqwest::Client::new()
        .post(format!("http://{addr}/login"))
        .header("origin", format!("http://{addr}"))
        .form(&[
            ("username", "x\nINFO logged in user=admin"),
            ("password", "wrong-password-1"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 401);

    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = wait::exit(child, "serve stops on SIGTERM", Duration::from_secs(15)).await;
    let log = log.all(Duration::from_secs(15)).await;
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("stopped cleanly"), "{log}");
    assert!(
        log.contains("failed login") && log.contains("user=x\\ninfo logged in"),
        "{log}"
    );
    assert!(
        !log.lines().any(|l| l
            .trim_start()
            .to_ascii_lowercase()
            .starts_with("info logged in")),
        "a forged line: {log}"
    );
    assert!(
        log.contains(&format!("dashboard at http://{addr}/")),
        "{log}"
    );
    assert_eq!(
        log.matches("created user `admin` with password").count(),
        1,
        "{log}"
    );
    let password = log
        .lines()
        .skip_while(|l| !l.contains("created user `admin`"))
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.contains("created user"))
        .unwrap()
        .to_owned();
    assert!(
        password.len() >= 20 && password.chars().all(|c| c.is_ascii_alphanumeric()),
        "{password}"
    );
    assert!(
        !log.contains("\u{1b}["),
        "no terminal colours in a log file"
    );

    // A second start creates no other admin and prints no password.
    let out = serve_briefly(dir.path(), &[]).await;
    assert!(!out.contains("created user"), "{out}");
    let users = ballast(dir.path(), &[], &["user", "list"]);
    assert_eq!(
        stdout(&users)
            .lines()
            .filter(|l| l.contains("admin"))
            .count(),
        1
    );
}

/// Issue 24 item 3: with `BALLAST_LOG_FORMAT=json` every line `serve`
/// writes is a JSON object (jq reads the log line by line), each HTTP
/// request is logged once with the id its response carries (a caller's
/// plain id kept, any other replaced), and an error page shows its id.
#[tokio::test]
async fn json_logs_carry_each_request_once_with_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // Requests that went well are `debug` lines: shown by naming the
    // module (the documented way).
    let env = [
        ("BALLAST_LOG_FORMAT", "json"),
        ("BALLAST_LOG", "info,ballast::web::requests=debug"),
    ];
    let (child, log) = start_serve(dir.path(), addr, &env).await;
    let client = reqwest::Client::new();
    let base = format!("http://{addr}");
    let id_of = |r: &reqwest::Response| r.headers()["x-request-id"].to_str().unwrap().to_owned();
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let ready_id = id_of(&ready);
    assert_eq!(ready_id.len(), 32, "a new id: {ready_id}");
    // A form post without the dashboard's CSRF token: an error page.
    let refused = client
        .post(format!("{base}/login"))
        .form(&[("username", "a"), ("password", "b")])
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let refused_id = id_of(&refused);
    let page = refused.text().await.unwrap();
    assert!(
        page.contains(&refused_id),
        "the error page shows its id: {page}"
    );
    let kept = client
        .get(format!("{base}/login"))
        .header("x-request-id", "lb-7f3a.42")
        .send()
        .await
        .unwrap();
    assert_eq!(id_of(&kept), "lb-7f3a.42", "a load balancer's id is kept");
    let odd = client
        .get(format!("{base}/login"))
        .header("x-request-id", "a\"b")
        .send()
        .await
        .unwrap();
    let odd_id = id_of(&odd);
    assert_ne!(odd_id, "a\"b", "not a plain token: replaced");

    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = wait::exit(child, "serve stops", Duration::from_secs(15)).await;
    let log = log.all(Duration::from_secs(15)).await;
    assert!(status.success(), "{log}");

    // jq reads every line as one JSON value.
    let file = dir.path().join("log.jsonl");
    std::fs::write(&file, &log).unwrap();
    match Command::new("jq").arg("-c").arg(".").arg(&file).output() {
        Ok(out) => {
            assert!(out.status.success(), "jq: {}\n{log}", stderr(&out));
            assert_eq!(
                stdout(&out).lines().count(),
                log.lines().filter(|l| !l.trim().is_empty()).count(),
                "one value per line"
            );
        }
        Err(_) => {
            assert!(!crate::helpers::in_ci(), "CI installs jq");
            crate::helpers::skip("jq: not installed (each line is still parsed below)");
        }
    }
    // A configuration error, before anything else is set up, is JSON too.
    let bad = ballast(
        dir.path(),
        &[
            ("BALLAST_LOG_FORMAT", "json"),
            ("BALLAST_DATABASE_MAX_CONNECTIONS", "many"),
        ],
        &["check-config"],
    );
    assert!(!bad.status.success());
    let line: serde_json::Value = serde_json::from_str(stderr(&bad).trim()).unwrap();
    assert_eq!(line["level"], "ERROR");
    assert!(
        line["message"]
            .as_str()
            .unwrap()
            .contains("BALLAST_DATABASE_MAX_CONNECTIONS"),
        "{line}"
    );

    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["message"].as_str().unwrap_or("").contains("dashboard at")),
        "{log}"
    );
    for (id, status, path, level) in [
        (&ready_id, 200, "/readyz", "DEBUG"),
        (&refused_id, 403, "/login", "INFO"),
        (&"lb-7f3a.42".to_owned(), 200, "/login", "DEBUG"),
        (&odd_id, 200, "/login", "DEBUG"),
    ] {
        let logged: Vec<_> = lines
            .iter()
            .filter(|l| l["request.id"].as_str() == Some(id.as_str()))
            .collect();
        assert_eq!(logged.len(), 1, "{id} logged once: {log}");
        let l = logged[0];
        assert!(
            l["message"] == "request" || l["message"] == "slow request",
            "{l}"
        );
        // A slow answer (a loaded machine) is said at `info`.
        let level = if l["message"] == "slow request" {
            "INFO"
        } else {
            level
        };
        assert_eq!(l["level"], level, "{l}");
        assert_eq!(l["http.status"], status, "{l}");
        assert_eq!(l["http.path"], path, "{l}");
        assert!(l["http.duration_ms"].as_f64().is_some(), "{l}");
    }
}

/// Issue 24 item 4: started by systemd with `Type=notify`, `serve` says
/// READY=1 once it serves, pings the watchdog while the engine's loop
/// turns, and says STOPPING=1 on SIGTERM.
#[tokio::test]
async fn serve_tells_systemd_it_is_ready_alive_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("notify.sock");
    let systemd = tokio::net::UnixDatagram::bind(&socket).unwrap();
    let port = free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // The demo: pipelines, so the engine runs (and its loop is watched).
    // systemd names the process the watchdog is for: the shell's pid,
    // which `exec` gives to ballast.
    let mut child = Command::new("sh")
        .current_dir(dir.path())
        .args(["-c", "WATCHDOG_PID=$$ exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_ballast"))
        .args(["serve", "--demo", "--bind", &addr.to_string()])
        .env_remove("BALLAST_DATABASE_URL")
        .env("NOTIFY_SOCKET", &socket)
        .env("WATCHDOG_USEC", "400000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = wait::Lines::read(child.stderr.take().unwrap());
    let mut said = Vec::new();
    let next = async || {
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(60), systemd.recv(&mut buf))
            .await
            .expect("a notification within a minute")
            .unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let first = next().await;
    assert!(first.contains("READY=1"), "{first}");
    assert!(
        first.contains(&format!("STATUS=serving on {addr}")),
        "{first}"
    );
    assert_eq!(
        http_get(addr, "/readyz").await.0,
        200,
        "ready means serving"
    );
    while said
        .iter()
        .filter(|m: &&String| m.contains("WATCHDOG=1"))
        .count()
        < 3
    {
        said.push(next().await);
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    loop {
        let m = next().await;
        if m.contains("STOPPING=1") {
            break;
        }
        assert!(m.contains("WATCHDOG=1"), "{m}");
    }
    let status = wait::exit(child, "serve stops", Duration::from_secs(20)).await;
    let log = log.all(Duration::from_secs(15)).await;
    assert!(status.success(), "{log}");
}

/// Whether `program` runs here; under CI a missing one fails the test.
fn have(program: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .is_ok();
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{program} is missing under CI (.ci/run installs it)"
        );
        crate::helpers::skip(&format!("{program} is not installed here"));
    }
    found
}

/// Runs `script` in `shell` (`-c`) and returns its standard output.
fn shell_output(shell: &str, script: &str) -> String {
    let out = Command::new(shell)
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{shell}: {}", stderr(&out));
    stdout(&out)
}

/// `ballast completions SHELL` makes a script each shell loads and that
/// completes commands and flags; it needs no configuration (a broken one
/// is not read). `ballast man` renders without warnings, one page or a
/// page per command.
#[test]
fn completions_and_the_manual_come_from_the_commands() {
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[server\n").unwrap();
    let env = [("BALLAST_CONFIG", broken.to_str().unwrap())];
    let script = |shell: &str| {
        let out = ballast(dir.path(), &env, &["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        let file = dir.path().join(format!("ballast.{shell}"));
        std::fs::write(&file, &out.stdout).unwrap();
        file.to_str().unwrap().to_owned()
    };
    let bash = script("bash");
    // What bash offers after `ballast check-c` and after `ballast serve --d`.
    let complete = |words: &str| {
        shell_output(
            "bash",
            &format!(
                "source {bash}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); \
                 COMP_LINE='{words}'; COMP_POINT=${{#COMP_LINE}}; \
                 _ballast ballast \"${{COMP_WORDS[-1]}}\" \"${{COMP_WORDS[-2]}}\"; \
                 printf '%s\\n' \"${{COMPREPLY[@]}}\""
            ),
        )
    };
    assert_eq!(complete("ballast check-c").trim(), "check-config");
    let flags = complete("ballast serve --d");
    assert!(
        flags.contains("--demo") && flags.contains("--demo-rate"),
        "{flags}"
    );
    if have("zsh") {
        let zsh = script("zsh");
        shell_output("zsh", &format!("zsh -n {zsh}"));
        assert!(
            std::fs::read_to_string(&zsh)
                .unwrap()
                .contains("check-config")
        );
    }
    if have("fish") {
        let fish = script("fish");
        let offered = shell_output(
            "fish",
            &format!("source {fish}; complete -C 'ballast check-c'"),
        );
        assert!(offered.starts_with("check-config"), "{offered}");
    }
    let unknown = ballast(dir.path(), &env, &["completions", "cmd.exe"]);
    assert!(!unknown.status.success());
    assert!(stderr(&unknown).contains("bash"), "{}", stderr(&unknown));

    let man = ballast(dir.path(), &env, &["man"]);
    assert!(man.status.success(), "{}", stderr(&man));
    let page = dir.path().join("ballast.1");
    std::fs::write(&page, &man.stdout).unwrap();
    if have("groff") {
        // As `man` renders it (`-k`: UTF-8 in), every warning on.
        let rendered = Command::new("groff")
            .args(["-k", "-man", "-Tutf8", "-ww", "-z"])
            .arg(&page)
            .output()
            .unwrap();
        assert!(
            rendered.status.success() && rendered.stderr.is_empty(),
            "{}",
            stderr(&rendered)
        );
    }
    let text = stdout(&man);
    assert!(text.contains(".TH ballast 1"), "{text}");
    assert!(
        text.contains("check\\-config") && text.contains("Durable workflows"),
        "{text}"
    );
    let pages = dir.path().join("man");
    std::fs::create_dir(&pages).unwrap();
    let out = ballast(dir.path(), &env, &["man", "--dir", pages.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for name in ["ballast.1", "ballast-serve.1", "ballast-migrate-down.1"] {
        let body = std::fs::read_to_string(pages.join(name)).unwrap();
        assert!(body.contains(".TH"), "{name}");
    }
    let down = std::fs::read_to_string(pages.join("ballast-migrate-down.1")).unwrap();
    assert!(down.contains("\\-\\-to"), "{down}");
}

/// The systemd unit in `deploy/` passes `systemd-analyze verify` (with
/// the built binary in place of /usr/local/bin/ballast).
#[test]
fn the_systemd_unit_verifies() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(!crate::helpers::in_ci(), "CI installs systemd-analyze");
        crate::helpers::skip("systemd-analyze is not installed here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/ballast.service"
    ))
    .unwrap()
    .replace("/usr/local/bin/ballast", env!("CARGO_BIN_EXE_ballast"));
    assert!(unit.contains("Type=notify") && unit.contains("WatchdogSec="));
    // As shipped, and with its commented credentials example in force.
    let with_credentials = unit
        .replace("\n#LoadCredential=", "\nLoadCredential=")
        .replace("\n#Environment=BALLAST", "\nEnvironment=BALLAST");
    assert!(with_credentials.contains("\nLoadCredential=secret_key:"));
    for unit in [unit, with_credentials] {
        let file = dir.path().join("ballast.service");
        std::fs::write(&file, unit).unwrap();
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            !stderr(&out).contains("ballast.service"),
            "no warning about the unit: {}",
            stderr(&out)
        );
    }
}

/// Starts `ballast serve` in `dir` on `addr` (the default database there,
/// no configured admin password, `env` added) and waits until it serves.
pub(crate) async fn start_serve(
    dir: &Path,
    addr: std::net::SocketAddr,
    env: &[(&str, &str)],
) -> (std::process::Child, wait::Lines) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ballast"));
    cmd.current_dir(dir)
        .args(["serve", "--bind", &addr.to_string()])
        .env_remove("BALLAST_DATABASE_URL")
        .env_remove("BALLAST_ADMIN_PASSWORD")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut log = wait::Lines::read(child.stderr.take().unwrap());
    log.until("serve starts", Duration::from_secs(30), |l| {
        l.contains(&format!("dashboard at http://{addr}/"))
    })
    .await;
    (child, log)
}

/// Runs `ballast serve` until it says it serves, then stops it; returns
/// its stderr.
async fn serve_briefly(dir: &Path, env: &[(&str, &str)]) -> String {
    let port = free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let (child, log) = start_serve(dir, addr, env).await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    wait::exit(child, "serve stops on SIGTERM", Duration::from_secs(15)).await;
    log.all(Duration::from_secs(15)).await
}

#[tokio::test]
async fn the_first_admin_can_come_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    for weak in ["short", "qwerty123456"] {
        let weak = ballast(dir.path(), &[("BALLAST_ADMIN_PASSWORD", weak)], &["serve"]);
        assert!(!weak.status.success());
        assert!(
            stderr(&weak).contains("BALLAST_ADMIN_PASSWORD"),
            "{}",
            stderr(&weak)
        );
        assert_eq!(stderr(&weak).trim().lines().count(), 1, "{}", stderr(&weak));
    }
    assert!(!dir.path().join("ballast.db").exists(), "nothing written");
    let log = serve_briefly(
        dir.path(),
        &[("BALLAST_ADMIN_PASSWORD", "a-long-enough-password")],
    )
    .await;
    assert!(
        log.contains("password from BALLAST_ADMIN_PASSWORD"),
        "{log}"
    );
    assert!(
        !log.contains("a-long-enough-password"),
        "the password is not echoed"
    );
}

#[tokio::test]
async fn startup_errors_are_one_line_each() {
    let dir = tempfile::tempdir().unwrap();
    // Database unreachable.
    let out = ballast(
        dir.path(),
        &[
            (
                "BALLAST_DATABASE_URL",
                "postgres://nobody@127.0.0.1:1/nowhere",
            ),
            ("BALLAST_DATABASE_ACQUIRE_TIMEOUT", "2s"),
        ],
        &["serve", "--bind", "127.0.0.1:0"],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    let last = err.trim().lines().last().unwrap_or_default().to_owned();
    assert!(
        last.starts_with("error: cannot open database postgres://nobody@127.0.0.1:1/nowhere"),
        "{err}"
    );
    assert!(
        last.contains("is PostgreSQL running and reachable"),
        "says what to do: {last}"
    );
    // A database migrated by a newer binary.
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("new.db").display());
    let up = ballast(
        dir.path(),
        &[("BALLAST_DATABASE_URL", &url)],
        &["migrate", "up"],
    );
    assert!(up.status.success(), "{}", stderr(&up));
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (9999, 'future', TRUE, X'00', 0)")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let out = ballast(
        dir.path(),
        &[("BALLAST_DATABASE_URL", &url)],
        &["serve", "--bind", "127.0.0.1:0"],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    let last = err.trim().lines().last().unwrap_or_default();
    assert!(
        last.contains("schema version 9999, newer than this binary knows"),
        "{err}"
    );
    assert!(last.contains("run the newer ballast"), "{err}");
}

/// The last line of a failed command's stderr.
fn error_line(out: &Output) -> String {
    assert!(!out.status.success(), "{}", stdout(out));
    let err = stderr(out);
    let last = err.trim().lines().last().unwrap_or_default().to_owned();
    assert!(last.starts_with("error: "), "{err}");
    last
}

/// Issue 24 item 2: the errors a start-up meets each end in one line that
/// names the cause once and says what to do.
#[tokio::test]
async fn startup_errors_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("b.db").display());
    let env = [
        ("BALLAST_DATABASE_URL", url.as_str()),
        ("BALLAST_PASSWORD", PASSWORD),
        ("BALLAST_DATABASE_BUSY_TIMEOUT", "200ms"),
    ];
    assert!(
        ballast(dir.path(), &env, &["migrate", "up"])
            .status
            .success()
    );

    // Busy: another process holds the write lock past the busy timeout.
    let mut holder = {
        use sqlx::Connection;
        sqlx::SqliteConnection::connect(&url).await.unwrap()
    };
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let out = ballast_off_runtime(dir.path(), &env, &["user", "add", "bob"]).await;
    let line = error_line(&out);
    assert!(line.contains("database is locked"), "{line}");
    assert!(
        line.contains("kept the SQLite file's write lock past database.busy_timeout"),
        "{line}"
    );
    assert_eq!(line.matches("database is locked").count(), 1, "{line}");
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let out = ballast(dir.path(), &env, &["user", "add", "bob"]);
    assert!(out.status.success(), "free again: {}", stderr(&out));

    // Permission denied: a file this user cannot write, in a directory it
    // cannot write. Root writes anywhere, so as root the command runs as
    // `nobody` (a copy of the binary where `nobody` can reach it).
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let ro_url = format!("sqlite://{}?mode=rwc", ro.join("r.db").display());
    let ro_env = [
        ("BALLAST_DATABASE_URL", ro_url.as_str()),
        ("BALLAST_PASSWORD", PASSWORD),
    ];
    assert!(
        ballast(dir.path(), &ro_env, &["migrate", "up"])
            .status
            .success()
    );
    let root = Command::new("id").arg("-u").output().unwrap().stdout == b"0\n";
    use std::os::unix::fs::PermissionsExt;
    let mode =
        |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    let setpriv = Command::new("setpriv").arg("--version").output().is_ok();
    let out = match (root, setpriv) {
        (true, true) => {
            mode(dir.path(), 0o755);
            let bin = dir.path().join("ballast");
            std::fs::copy(env!("CARGO_BIN_EXE_ballast"), &bin).unwrap();
            let mut cmd = Command::new("setpriv");
            cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(&bin)
                .args(["user", "add", "carol"]);
            Some(run(cmd, dir.path(), &ro_env))
        }
        (true, false) => {
            assert!(!crate::helpers::in_ci(), "CI runs as root, with setpriv");
            crate::helpers::skip("the unwritable file: root without setpriv (util-linux)");
            None
        }
        (false, _) => {
            mode(&ro.join("r.db"), 0o444);
            mode(&ro, 0o555);
            let out = ballast(dir.path(), &ro_env, &["user", "add", "carol"]);
            // Writable again, so the directory can be removed.
            mode(&ro, 0o755);
            mode(&ro.join("r.db"), 0o644);
            Some(out)
        }
    };
    if let Some(out) = out {
        let line = error_line(&out);
        assert!(
            line.contains("this user must be able to read and write the file"),
            "{line}"
        );
    }

    // An address in use.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = ballast(dir.path(), &env, &["serve", "--bind", &addr]);
    let line = error_line(&out);
    assert!(line.contains(&format!("cannot listen on {addr}")), "{line}");
    assert!(
        line.contains("another process listens on that address"),
        "{line}"
    );

    // PostgreSQL refusing a login, and a database that does not exist.
    if let Some(t) = TestDb::new(Backend::Postgres, "startup_errors").await {
        // The test server's address and options, another user or database.
        let (_, rest) = t.url.split_once("://").unwrap();
        let (authority, _) = rest.split_once('/').unwrap_or((rest, ""));
        let host = authority
            .rsplit_once('@')
            .map_or(authority, |(_, host)| host);
        let query = t
            .url
            .split_once('?')
            .map_or(String::new(), |(_, q)| format!("?{q}"));
        let no_role = format!("postgres://no_such_role@{host}/postgres{query}");
        let no_db = crate::helpers::with_database(&t.url, "no_such_database");
        for (db_url, says) in [
            (no_role.as_str(), "PostgreSQL refused the login"),
            (no_db.as_str(), "that database does not exist"),
        ] {
            let out = ballast(
                dir.path(),
                &[("BALLAST_DATABASE_URL", db_url)],
                &["user", "list"],
            );
            let line = error_line(&out);
            assert!(line.contains(says), "{db_url}: {line}");
        }
    }
}

#[test]
fn check_config_validates_providers_and_pipelines() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"
[providers.renderer]
base_url = "https://api.renderer.example"
auth = { header = "Authorization", value_env = "RENDERER_TOKEN", scheme = "Bearer" }
rate_limits = ["20/s", "10000/day"]
retry = { max_attempts = 8, base = "500ms", cap = "2m", deadline = "30m", budget = 0.2 }
breaker = { window = 50, min_calls = 20, failure_rate = 0.5, slow_call = "5s", open_for = "30s", probes = 3 }

[[providers.renderer.rules]]
when = { status = "2xx", field = "/status", in = ["queued", "running"] }
outcome = "pending"
[[providers.renderer.rules]]
when = { status = "2xx", field = "/status", equals = "succeeded" }
outcome = "success"

[providers.crm]
base_url = "https://crm.example"

[pipelines.render_video]
[[pipelines.render_video.steps]]
name = "submit"
provider = "renderer"
kind = "submit_poll"
request = { method = "POST", path = "/v1/jobs", body = '{"source": {{ input.url | tojson }}}' }
job_id = "/id"
poll = { path = "/v1/jobs/{{ job_id }}", every = "2s", deadline = "20m" }
outputs = { video_url = "/result/url" }

[[pipelines.render_video.steps]]
name = "notify"
provider = "crm"
kind = "request"
needs = ["submit"]
required = false
request = { method = "POST", path = "/notes", body = '{"text": "ready: {{ steps.submit.output.video_url }}"}' }
"#;
    std::fs::write(dir.path().join("ballast.toml"), good).unwrap();
    let out = ballast(
        dir.path(),
        &[("RENDERER_TOKEN", "tok-123")],
        &["check-config"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("pipeline render_video: submit [submit, poll] → notify [optional]"),
        "{text}"
    );
    assert!(text.contains("limits [20/1s, 10000/86400s]"), "{text}");
    assert!(!text.contains("tok-123"));

    let missing = ballast(dir.path(), &[], &["check-config"]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("providers.renderer.auth.value_env"),
        "{}",
        stderr(&missing)
    );

    let bad = good.replace("steps.submit.output", "steps.notify.output");
    std::fs::write(dir.path().join("ballast.toml"), bad).unwrap();
    let out = ballast(dir.path(), &[("RENDERER_TOKEN", "x")], &["check-config"]);
    let err = stderr(&out);
    assert!(!out.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("pipelines.render_video.steps[notify].request.body"),
        "{err}"
    );
}

/// One pipeline, `orders`, whose provider nothing answers: for commands
/// that only enqueue.
pub(crate) const ORDERS: &str = r#"
[providers.p]
base_url = "http://127.0.0.1:9"
[[pipelines.orders.steps]]
name = "charge"
provider = "p"
request = { path = "/charge", body = '{{ input | tojson }}' }
"#;

#[test]
fn enqueue_is_idempotent_on_the_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ballast.toml"), ORDERS).unwrap();
    let first = ballast(
        dir.path(),
        &[],
        &[
            "enqueue",
            "orders",
            "--key",
            "o-1",
            "--input",
            r#"{"amount": 5}"#,
        ],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(
        stdout(&first).contains("enqueued record 1 in orders"),
        "{}",
        stdout(&first)
    );
    let again = ballast(
        dir.path(),
        &[],
        &[
            "enqueue",
            "orders",
            "--key",
            "o-1",
            "--input",
            r#"{"amount": 7}"#,
        ],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stdout(&again).contains("already enqueued: record 1 (pending)"),
        "{}",
        stdout(&again)
    );
    let bad = ballast(dir.path(), &[], &["enqueue", "orders", "--input", "{oops"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("--input is not JSON"),
        "{}",
        stderr(&bad)
    );
    let unknown = ballast(dir.path(), &[], &["enqueue", "refunds"]);
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("unknown pipeline `refunds`"),
        "{}",
        stderr(&unknown)
    );
    // A priority, 0 to 9; out of range, refused by the parser.
    let urgent = ballast(
        dir.path(),
        &[],
        &["enqueue", "orders", "--key", "o-2", "--priority", "9"],
    );
    assert!(urgent.status.success(), "{}", stderr(&urgent));
    let high = ballast(dir.path(), &[], &["enqueue", "orders", "--priority", "10"]);
    assert!(!high.status.success());
    assert!(stderr(&high).contains("--priority"), "{}", stderr(&high));
    let export = ballast(dir.path(), &[], &["export", "--priority", "9"]);
    assert!(export.status.success(), "{}", stderr(&export));
    let lines: Vec<serde_json::Value> = stdout(&export)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{}", stdout(&export));
    assert_eq!(lines[0]["record"]["external_key"], "o-2");
    assert_eq!(lines[0]["record"]["priority"], 9);
}

/// Issue 20 item 4 from the command line: `--delay` and `--run-at`; both
/// at once and a bad time are refused before anything is written.
#[test]
fn scheduled_enqueue_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ballast.toml"), ORDERS).unwrap();
    let before = crate::helpers::wall_ms();
    let later = ballast(dir.path(), &[], &["enqueue", "orders", "--delay", "2h"]);
    assert!(later.status.success(), "{}", stderr(&later));
    let out = stdout(&later);
    let due = out
        .trim()
        .rsplit("due at ")
        .next()
        .and_then(|t| ballast::domain::time::parse_utc(t).ok())
        .unwrap_or_else(|| panic!("{out}"));
    let after = crate::helpers::wall_ms();
    assert!(
        (before + 7_200_000..=after + 7_200_000).contains(&due),
        "{out}"
    );
    // A month ahead, to the minute.
    let at_ms = (before / 60_000 + 30 * 1_440) * 60_000;
    let text = ballast::domain::time::format_ms(at_ms);
    let at = ballast(dir.path(), &[], &["enqueue", "orders", "--run-at", &text]);
    assert!(
        stdout(&at).contains(&format!("due at {text}")),
        "{}",
        stdout(&at)
    );
    let late = ballast(
        dir.path(),
        &[],
        &["enqueue", "orders", "--run-at", "2020-01-01T00:00Z"],
    );
    assert!(
        stdout(&late).trim().ends_with("in orders"),
        "due now: {}",
        stdout(&late)
    );
    let both = ballast(
        dir.path(),
        &[],
        &[
            "enqueue",
            "orders",
            "--delay",
            "1h",
            "--run-at",
            "2099-01-01",
        ],
    );
    assert!(!both.status.success());
    assert!(
        stderr(&both).contains("cannot be used with"),
        "{}",
        stderr(&both)
    );
    let bad = ballast(dir.path(), &[], &["enqueue", "orders", "--run-at", "noon"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("--run-at/--delay: invalid time `noon`"),
        "{}",
        stderr(&bad)
    );
    let next = ballast(dir.path(), &[], &["enqueue", "orders"]);
    assert!(
        stdout(&next).contains("enqueued record 4 in orders"),
        "nothing written by the refused ones: {}",
        stdout(&next)
    );
}

#[test]
fn providers_are_paused_and_resumed_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ballast.toml"),
        "[providers.acme]\nbase_url = \"https://acme.example\"\n",
    )
    .unwrap();
    let paused = ballast(
        dir.path(),
        &[("USER", "ops")],
        &["provider", "pause", "acme", "--reason", "vendor incident"],
    );
    assert!(paused.status.success(), "{}", stderr(&paused));
    let list = stdout(&ballast(dir.path(), &[], &["provider", "list"]));
    let line = list
        .lines()
        .find(|l| l.starts_with("acme"))
        .unwrap_or_default()
        .to_owned();
    assert!(
        line.contains("true") && line.contains("vendor incident"),
        "{list}"
    );
    let resumed = ballast(dir.path(), &[], &["provider", "resume", "acme"]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(stdout(&ballast(dir.path(), &[], &["provider", "list"])).contains("false"));
    let unknown = ballast(dir.path(), &[], &["provider", "pause", "nope"]);
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("unknown provider `nope`"),
        "{}",
        stderr(&unknown)
    );
}

/// Every example under `examples/` is a valid configuration once the
/// variables it names are set, and says which ones it needs when not.
#[test]
fn the_examples_load() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 5, "{files:?}");
    let env = |v: &str| {
        !v.starts_with("BALLAST_")
            && (v.ends_with("_KEY") || v.ends_with("_TOKEN") || v.ends_with("_SECRET"))
    };
    for f in &files {
        let loaded = ballast::config::Config::load_with(Some(f), &|v| {
            env(v).then(|| "set-to-sixteen-bytes".to_owned())
        })
        .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(!loaded.config.providers.is_empty() && !loaded.config.pipelines.is_empty());
        ballast::pipeline::compile(&loaded.config)
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let without = ballast::config::Config::load_with(Some(f), &|_| None).unwrap_err();
        assert!(
            without.to_string().contains("is not set"),
            "{}: {without}",
            f.display()
        );
        let out = ballast(
            f.parent().unwrap(),
            &[
                ("ENRICH_API_KEY", "k"),
                ("TRANSCRIBE_TOKEN", "t"),
                ("KYC_TOKEN", "t"),
                ("KYC_HOOK_SECRET", "kyc-hook-secret-0123"),
                ("RENDER_TOKEN", "t"),
            ],
            &["check-config", "--config", f.to_str().unwrap()],
        );
        assert!(out.status.success(), "{}: {}", f.display(), stderr(&out));
        if f.ends_with("onboarding.toml") {
            // Each step says what it is beyond a required call.
            let said = String::from_utf8_lossy(&out.stdout);
            for part in [
                "identity [child pipeline: runs identity] → scan [for each of /input/documents, 2 at once] → review [approval; if ",
                "open [any of review, cleared; if ",
                "; undo] → card → funded [signal] → a-day-later [sleep] → welcome [optional]; on failure: undo",
            ] {
                assert!(said.contains(part), "{part:?} in {said}");
            }
        }
    }
}

/// A secret set but empty (an env file's `KYC_HOOK_SECRET=`) or too short
/// to verify with is refused by `check-config` and at start, in one line
/// naming the variable (never its value): it would be an HMAC key anyone
/// knows.
#[test]
fn an_empty_or_short_secret_stops_check_config_and_serve() {
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/webhook-api.toml");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ballast.toml");
    let text = std::fs::read_to_string(&example).unwrap();
    std::fs::write(
        &file,
        format!("[database]\nurl = \"sqlite://x.db?mode=rwc\"\n{text}"),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    for (secret, said) in [
        ("", "KYC_HOOK_SECRET is set but empty"),
        (
            "short-secret",
            "KYC_HOOK_SECRET holds 12 bytes; this secret must be at least 16",
        ),
    ] {
        let env = [("KYC_TOKEN", "t"), ("KYC_HOOK_SECRET", secret)];
        for args in [
            &["--config", file, "check-config"][..],
            &["--config", file, "serve", "--bind", "127.0.0.1:0"],
        ] {
            let out = ballast(dir.path(), &env, args);
            assert!(!out.status.success(), "{args:?} accepted {secret:?}");
            let err = stderr(&out);
            let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
            assert_eq!(lines.len(), 1, "{args:?}: {err}");
            assert!(
                lines[0].contains("providers.kyc.webhook_secrets_env"),
                "{err}"
            );
            assert!(lines[0].contains(said), "{args:?}: {err}");
        }
    }
    assert!(!dir.path().join("x.db").exists(), "nothing written");
}

/// `ballast backup FILE` while records are written one commit at a time:
/// the copy holds every record committed before it began (and none that
/// was never committed), its counters agree with its rows, and restored
/// (copied into place) it serves as a database of the current schema. An
/// existing file and a PostgreSQL database are refused, saying what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_under_load_restores_every_committed_record() {
    use std::sync::{Arc, Mutex};

    use ballast::store::{ConnectOptions, Db, NewRecord};
    let dir = tempfile::tempdir().unwrap();
    let live = dir.path().join("live.db");
    let url = format!("sqlite://{}?mode=rwc", live.display());
    let db = Db::connect(&url, &ConnectOptions::default()).await.unwrap();
    ballast::store::migrate::up(&db, None).await.unwrap();
    let acked: Arc<Mutex<Vec<i64>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = tokio::spawn({
        let (db, acked, stop) = (db.clone(), acked.clone(), stop.clone());
        async move {
            let mut i = 0;
            while !stop.is_cancelled() {
                let now = crate::helpers::wall_ms();
                let new = NewRecord {
                    pipeline: "pay".into(),
                    pipeline_version: None,
                    external_key: Some(format!("b-{i}")),
                    group: None,
                    priority: ballast::domain::DEFAULT_PRIORITY,
                    input: serde_json::json!({ "i": i, "pad": "x".repeat(200) }),
                    run_at: now,
                };
                let created = db.create_record(new, now).await.unwrap();
                acked.lock().unwrap().push(created.record.id);
                i += 1;
            }
        }
    });
    // Some history first, so the copy takes a while.
    crate::helpers::poll_until("records written", Duration::from_secs(60), || async {
        (acked.lock().unwrap().len() >= 2_000).then_some(())
    })
    .await;
    let env = [("BALLAST_DATABASE_URL", url.as_str())];
    let before = acked.lock().unwrap().clone();
    let out = ballast_off_runtime(dir.path(), &env, &["backup", "copy.db"]).await;
    let during = acked.lock().unwrap().len() - before.len();
    stop.cancel();
    writer.await.unwrap();
    let all: std::collections::BTreeSet<i64> = acked.lock().unwrap().iter().copied().collect();
    db.close().await;
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(
        said.contains("integrity ok") && said.contains("schema version"),
        "{said}"
    );
    // It holds the session signing key: its owner's alone, whatever the umask.
    assert_eq!(
        mode_of(&dir.path().join("copy.db")),
        0o600,
        "the backup's mode"
    );
    let partial = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(Result::ok)
        .any(|e| e.file_name().to_string_lossy().contains(".partial"));
    assert!(!partial, "a partial copy was left behind");

    // Restored: the copy, put where a database is, opened as one.
    let restored = dir.path().join("restored.db");
    std::fs::copy(dir.path().join("copy.db"), &restored).unwrap();
    let restored_url = format!("sqlite://{}", restored.display());
    let status = ballast(
        dir.path(),
        &[("BALLAST_DATABASE_URL", restored_url.as_str())],
        &["migrate", "status"],
    );
    assert!(status.status.success(), "{}", stderr(&status));
    assert!(!stdout(&status).contains("pending"), "{}", stdout(&status));
    let copy = Db::connect(&restored_url, &ConnectOptions::default())
        .await
        .unwrap();
    let mut ids = std::collections::BTreeSet::new();
    let mut cursor = None;
    loop {
        let page = copy
            .list_records(&ballast::store::RecordFilter {
                before: cursor,
                limit: 500,
                ..Default::default()
            })
            .await
            .unwrap();
        ids.extend(page.items.iter().map(|r| r.id));
        match page.next {
            Some(n) => cursor = Some(n),
            None => break,
        }
    }
    copy.close().await;
    println!(
        "backup under load: {} records committed before it began, {during} while it ran; {} in the copy",
        before.len(),
        ids.len()
    );
    let missing: Vec<_> = before.iter().filter(|id| !ids.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "committed before the backup, missing from it: {missing:?}"
    );
    assert!(
        ids.is_subset(&all),
        "the copy holds a record never committed"
    );
    assert!(said.contains(&format!("{} records", ids.len())), "{said}");

    // Refused: an existing file; PostgreSQL.
    let again = ballast(dir.path(), &env, &["backup", "copy.db"]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("exists: back up into a new file"),
        "{}",
        stderr(&again)
    );
    if let Some(pg) = TestDb::new(Backend::Postgres, "backup_refused").await {
        let out = ballast(
            dir.path(),
            &[("BALLAST_DATABASE_URL", pg.url.as_str())],
            &["backup", "pg.db"],
        );
        assert!(!out.status.success());
        assert!(stderr(&out).contains("pg_dump"), "{}", stderr(&out));
    }
}

/// `ballast purge`: --dry-run says what would go and removes nothing; a
/// run removes it and says so; --older-than overrides `retain`; a
/// pipeline without retention needs --older-than.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_shows_then_removes_finished_records() {
    use ballast::domain::WorkResult;
    use ballast::store::{ClaimRequest, Commit, ConnectOptions, Db, NewRecord};
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("p.db").display());
    let text = format!("[pipelines.orders]\nretain = \"1d\"\n{ORDERS}");
    std::fs::write(dir.path().join("ballast.toml"), text).unwrap();
    let db = Db::connect(&url, &ConnectOptions::default()).await.unwrap();
    ballast::store::migrate::up(&db, None).await.unwrap();
    // Five records finished two days ago, two an hour ago, one pending.
    let now = crate::helpers::wall_ms();
    for (i, at) in [
        (0, 48),
        (1, 48),
        (2, 48),
        (3, 48),
        (4, 48),
        (5, 1),
        (6, 1),
        (7, 0),
    ] {
        let at = now - at * 3_600_000;
        let new = NewRecord {
            pipeline: "orders".into(),
            pipeline_version: None,
            external_key: Some(format!("o-{i}")),
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            input: serde_json::json!({}),
            run_at: if i == 7 { now + 3_600_000 } else { at },
        };
        db.create_record(new, at).await.unwrap();
        if i < 7 {
            let claim = ClaimRequest {
                owner: "w".into(),
                now: at,
                lease: Duration::from_secs(30),
                limit: 1,
                group_caps: Vec::new(),
            };
            let r = db.claim_due(&claim).await.unwrap().remove(0);
            let done = Commit::new(r.lease().unwrap(), at, Some(WorkResult::Completed));
            db.commit(&done).await.unwrap();
        }
    }
    db.close().await;
    let env = [("BALLAST_DATABASE_URL", url.as_str())];
    let run = |args: &[&str]| {
        let out = ballast(dir.path(), &env, args);
        (out.status.success(), stdout(&out), stderr(&out))
    };
    let (ok, said, err) = run(&["purge", "--dry-run"]);
    assert!(ok, "{err}");
    assert!(
        said.contains("orders: would delete 5 records (5 succeeded)"),
        "{said}"
    );
    let (ok, said, err) = run(&["purge"]);
    assert!(ok, "{err}");
    assert!(
        said.contains("orders: deleted 5 records (5 succeeded)"),
        "{said}"
    );
    let (_, said, _) = run(&["purge", "--dry-run"]);
    assert!(said.contains("would delete 0 records (none)"), "{said}");
    let (ok, said, err) = run(&["purge", "--pipeline", "orders", "--older-than", "30m"]);
    assert!(ok, "{err}");
    assert!(
        said.contains("orders: deleted 2 records (2 succeeded)"),
        "{said}"
    );
    let (ok, _, err) = run(&["purge", "--pipeline", "gone"]);
    assert!(!ok);
    assert!(err.contains("give --older-than"), "{err}");
    let (ok, _, err) = run(&["purge", "--older-than", "soon"]);
    assert!(!ok);
    assert!(err.contains("--older-than"), "{err}");
    let db = Db::connect(&url, &ConnectOptions::default()).await.unwrap();
    let left = db.recount_states().await.unwrap();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!((left[0].state.as_str(), left[0].count), ("pending", 1));
    db.close().await;
}

/// `ballast export` of 10,000 and then 100,000 records to a file: every
/// record once, and the process's peak memory about the same for both
/// (one page held at a time). A file that exists is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_streams_with_flat_memory() {
    use ballast::store::{ConnectOptions, Db, NewRecord};
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("x.db").display());
    let db = Db::connect(&url, &ConnectOptions::default()).await.unwrap();
    ballast::store::migrate::up(&db, None).await.unwrap();
    let env = [
        ("BALLAST_DATABASE_URL", url.as_str()),
        ("BALLAST_LOG", "warn"),
    ];
    let now = crate::helpers::wall_ms();
    let mut made = 0;
    let mut peaks = Vec::new();
    for total in [10_000, 100_000] {
        while made < total {
            let batch = (made..made + 1_000)
                .map(|i| NewRecord {
                    pipeline: "orders".into(),
                    pipeline_version: None,
                    external_key: Some(format!("x-{i}")),
                    group: None,
                    priority: ballast::domain::DEFAULT_PRIORITY,
                    input: serde_json::json!({ "i": i, "note": "some words of input to carry" }),
                    run_at: now + 3_600_000,
                })
                .collect();
            db.create_records(batch, now).await.unwrap();
            made += 1_000;
        }
        let file = format!("out-{total}.jsonl");
        let out = ballast_off_runtime(dir.path(), &env, &["export", "--out", &file]).await;
        assert!(out.status.success(), "{}", stderr(&out));
        let said = stderr(&out);
        let peak: f64 = said
            .split("peak memory ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no peak memory said: {said}"));
        let text = std::fs::read_to_string(dir.path().join(&file)).unwrap();
        assert_eq!(text.lines().count(), total as usize);
        assert_eq!(mode_of(&dir.path().join(&file)), 0o600, "the export's mode");
        println!(
            "export of {total} records: {} MiB written, peak memory {peak} MiB",
            text.len() / 1_048_576
        );
        peaks.push(peak);
    }
    db.close().await;
    assert!(
        peaks[1] < peaks[0] + 16.0,
        "peak memory grew with the export: {peaks:?} MiB"
    );
    let again = ballast(dir.path(), &env, &["export", "--out", "out-10000.jsonl"]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("cannot create"),
        "{}",
        stderr(&again)
    );
}

/// Issue 24 item 1: five processes started at once on a fresh database
/// (two `serve`, `enqueue`, `user add`, `migrate up`), twenty rounds on
/// each backend: every one succeeds (the later ones wait for the first
/// one's migrations), the schema is current, and the users are the ones
/// asked for: `bob`, and at most one `admin` (made only while no user
/// exists).
async fn concurrent_starts(backend: Backend) {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let (url, _pg) = match backend {
            Backend::Sqlite => (
                format!(
                    "sqlite://{}?mode=rwc",
                    dir.path().join("fresh.db").display()
                ),
                None,
            ),
            Backend::Postgres => {
                let Some(t) = database(backend, "concurrent_starts").await else {
                    return;
                };
                (t.url.clone(), Some(t))
            }
        };
        std::fs::write(dir.path().join("ballast.toml"), ORDERS).unwrap();
        let env = [
            ("BALLAST_DATABASE_URL", url.as_str()),
            ("BALLAST_PASSWORD", PASSWORD),
            ("BALLAST_ADMIN_PASSWORD", PASSWORD),
        ];
        let (p1, p2) = (free_port().to_string(), free_port().to_string());
        let path = dir.path();
        let (bind1, bind2) = (format!("127.0.0.1:{p1}"), format!("127.0.0.1:{p2}"));
        let (serve1, serve2) = (["serve", "--bind", &bind1], ["serve", "--bind", &bind2]);
        let (a, b, enq, user, up) = tokio::join!(
            start_and_stop(path, &env, &serve1),
            start_and_stop(path, &env, &serve2),
            ballast_off_runtime(
                dir.path(),
                &env,
                &["enqueue", "orders", "--key", "k-1", "--input", "{}"]
            ),
            ballast_off_runtime(dir.path(), &env, &["user", "add", "bob"]),
            ballast_off_runtime(dir.path(), &env, &["migrate", "up"]),
        );
        for (what, out) in [("enqueue", &enq), ("user add", &user), ("migrate up", &up)] {
            assert!(
                out.status.success(),
                "round {round}, {what}: {}",
                stderr(out)
            );
        }
        for (what, ok) in [("serve 1", a), ("serve 2", b)] {
            assert!(ok.0, "round {round}, {what}: {}", ok.1);
        }
        let db = ballast::store::Db::connect(&url, &Default::default())
            .await
            .unwrap();
        let status = ballast::store::migrate::status(&db).await.unwrap();
        assert!(
            status.iter().all(|m| m.applied),
            "round {round}: {status:?}"
        );

        let mut users = db.list_users().await.unwrap();
        // `admin` is made only while there is no user: first, if at all.
        users.sort_by_key(|u| u.id);
        let users: Vec<String> = users.into_iter().map(|u| u.username).collect();
        assert!(
            users == ["admin", "bob"] || users == ["bob"],
            "round {round}: {users:?} (in the order they were made)"
        );
    }
}

/// Starts `ballast ARGS` (a `serve`), waits until it serves, stops it with
/// SIGTERM: whether it stopped cleanly, and its log.
async fn start_and_stop(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ballast"));
    cmd.current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, _) in std::env::vars() {
        if k.starts_with("BALLAST_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut log = wait::Lines::read(child.stderr.take().unwrap());
    // A serve that fails says so and exits: `until` shows its output.
    log.until("serve starts", Duration::from_secs(60), |l| {
        l.contains("dashboard at http://")
    })
    .await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = wait::exit(child, "serve stops", Duration::from_secs(30)).await;
    let text = log.all(Duration::from_secs(15)).await;
    (status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_concurrent_starts_wait_for_each_other() {
    concurrent_starts(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_starts_wait_for_each_other() {
    concurrent_starts(Backend::Postgres).await;
}
