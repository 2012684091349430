//! The control plane over real HTTP: login and sessions, forged tokens,
//! CSRF, the route × role matrix, headers, inert provider data, rate
//! limits, actions and bulk actions, the API, API tokens and metrics.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ballast::config::Config;
use ballast::domain::{Clock, ManualClock, OperatorAction, Outcome, Role, SystemClock};
use ballast::engine::Enqueue;
use ballast::store::{ActionRequest, Backend, NewAttempt, NewRecord, NewUser};
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::helpers::TestDb;

/// The secret tests sign with, to forge tokens with the right key.
pub const SECRET: &str = "test-secret-key-that-is-long-enough-0123456789";

/// A running control plane on a fresh database.
pub struct WebApp {
    pub addr: SocketAddr,
    pub t: TestDb,
    pub client: reqwest::Client,
    /// The running node's state (its limits and keys, as handlers see them).
    pub state: ballast::web::AppState,
    shutdown: CancellationToken,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// A logged-in browser: its cookie header and CSRF token.
#[derive(Clone, Debug)]
pub struct Login {
    pub cookie: String,
    pub csrf: String,
}

pub fn password_of(user: &str) -> String {
    format!("pw-{user}-0123456789")
}

impl WebApp {
    /// Starts the app with `extra` TOML appended to the configuration.
    pub async fn spawn(backend: Backend, test: &str, extra: &str) -> Option<WebApp> {
        let t = TestDb::new(backend, test).await?;
        Some(Self::spawn_on(t, extra).await)
    }

    pub async fn spawn_on(t: TestDb, extra: &str) -> WebApp {
        Self::spawn_with(t, extra, true).await
    }

    /// `fixed_secret`: sign sessions with [`SECRET`]; otherwise the key is
    /// generated and kept in the database, as in production by default.
    pub async fn spawn_with(t: TestDb, extra: &str, fixed_secret: bool) -> WebApp {
        Self::spawn_on_clock(t, extra, fixed_secret, Arc::new(SystemClock), |_| {}).await
    }

    /// [`spawn_with`](Self::spawn_with), the configuration changed by
    /// `edit` after it is read (what a file cannot say, such as the
    /// secrets the program sets itself).
    pub async fn spawn_edited(
        t: TestDb,
        extra: &str,
        fixed_secret: bool,
        edit: impl FnOnce(&mut Config),
    ) -> WebApp {
        Self::spawn_on_clock(t, extra, fixed_secret, Arc::new(SystemClock), edit).await
    }

    /// [`WebApp::spawn`] on a clock the test moves. Session tokens are
    /// checked against the wall clock as well, so a test's clock should
    /// stay behind it (start it an hour or more back).
    pub async fn spawn_clocked(
        backend: Backend,
        test: &str,
        extra: &str,
        clock: &ManualClock,
    ) -> Option<WebApp> {
        let t = TestDb::new(backend, test).await?;
        let clock = Arc::new(clock.clone());
        Some(Self::spawn_on_clock(t, extra, true, clock, |_| {}).await)
    }

    /// [`spawn_clocked`](Self::spawn_clocked) with the configuration
    /// changed by `edit`, as [`spawn_edited`](Self::spawn_edited).
    pub async fn spawn_clocked_edited(
        t: TestDb,
        extra: &str,
        clock: &ManualClock,
        edit: impl FnOnce(&mut Config),
    ) -> WebApp {
        Self::spawn_on_clock(t, extra, true, Arc::new(clock.clone()), edit).await
    }

    async fn spawn_on_clock(
        t: TestDb,
        extra: &str,
        fixed_secret: bool,
        clock: Arc<dyn Clock>,
        edit: impl FnOnce(&mut Config),
    ) -> WebApp {
        // Bound first, so the configuration may name the address (`@ADDR@`).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let extra = extra.replace("@ADDR@", &addr.to_string());
        let text = format!("[database]\nurl = \"{}\"\n{extra}", t.url);
        let mut config = Config::parse(&text, std::path::Path::new("web.toml")).unwrap();
        edit(&mut config);
        if fixed_secret {
            config.server.secret_key = Some(ballast::config::Secret::new(SECRET));
        }
        // The first start creates `admin`; give it the tests' password.
        config.server.admin_password = Some(ballast::config::Secret::new(password_of("admin")));
        config.server.metrics_token =
            Some(ballast::config::Secret::new("metrics-token-0123456789"));
        crate::helpers::provide_hook_secret(&mut config);
        config.validate(&|v| std::env::var(v).ok()).unwrap();
        let shutdown = CancellationToken::new();
        let (started, state) = tokio::sync::oneshot::channel();
        let mut server = tokio::spawn(ballast::app::run_on_clock(
            config,
            ballast::reload::Source::Built("a test's"),
            listener,
            shutdown.clone(),
            clock,
            move |s| {
                let _ = started.send(s.clone());
            },
        ));
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        // The listener is bound already, so this request waits in its
        // backlog until the server has migrated and starts serving: its
        // answer is the sign that the app is up. A server that stops first
        // says why.
        let ready = tokio::select! {
            ready = client.get(format!("http://{addr}/readyz")).send() => ready,
            ended = &mut server => panic!("the server stopped before serving: {ended:?}"),
        };
        let ready = ready.expect("the server answers /readyz");
        assert_eq!(ready.status(), 200, "{:?}", ready.text().await);
        // Called before the server serves, so it has been by now.
        let state = state.await.expect("the app's state");
        WebApp {
            addr,
            t,
            client,
            state,
            shutdown,
            server: Some(server),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn user(&self, name: &str, role: Role) -> i64 {
        if let Some(existing) = self.t.db.user_by_name(name).await.unwrap() {
            // Only the bootstrap admin exists before a test makes users.
            assert_eq!((name, existing.role), ("admin", Role::Admin));
            if role == Role::Admin {
                return existing.id;
            }
        }
        let hash = ballast::auth::password::hash(&password_of(name)).unwrap();
        let u = NewUser {
            // Sees sensitive fields: these tests are not about masking.
            unmask: true,
            pipelines: ballast::domain::scope::Scope::all(),
            username: name.to_owned(),
            password_hash: hash,
            role,
        };
        self.t
            .db
            .create_user(&u, crate::helpers::wall_ms())
            .await
            .unwrap()
            .id
    }

    pub async fn try_login(&self, name: &str, password: &str) -> reqwest::Response {
        self.client
            .post(self.url("/login"))
            .header("origin", self.origin())
            .form(&[("username", name), ("password", password), ("next", "/")])
            .send()
            .await
            .unwrap()
    }

    /// Logs in and reads the CSRF token off the overview page.
    pub async fn login(&self, name: &str) -> Login {
        let r = self.try_login(name, &password_of(name)).await;
        assert_eq!(r.status(), 303, "login of {name}");
        let cookie = session_cookie(r.headers()).expect("a session cookie");
        let page = self
            .client
            .get(self.url("/"))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(page.status(), 200);
        let html = page.text().await.unwrap();
        Login {
            cookie,
            csrf: csrf_in(&html).expect("a CSRF token in the page"),
        }
    }

    pub async fn get(&self, path: &str, login: Option<&Login>) -> reqwest::Response {
        let mut req = self.client.get(self.url(path));
        if let Some(l) = login {
            req = req.header("cookie", &l.cookie);
        }
        req.send().await.unwrap()
    }

    /// `/metrics` as Prometheus scrapes it (with the metrics token).
    pub async fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .bearer_auth("metrics-token-0123456789")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The page at `path`, as text.
    pub async fn text(&self, path: &str, login: Option<&Login>) -> String {
        self.get(path, login).await.text().await.unwrap()
    }

    /// The fragment an htmx request for `path` gets (a live part's poll).
    pub async fn fragment(&self, path: &str, login: &Login) -> String {
        self.client
            .get(self.url(path))
            .header("cookie", &login.cookie)
            .header("hx-request", "true")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// A form post the way the dashboard sends it: cookie, CSRF header,
    /// and this site's origin.
    pub async fn post(
        &self,
        path: &str,
        login: Option<&Login>,
        form: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut req = self
            .client
            .post(self.url(path))
            .header("origin", self.origin())
            .form(form);
        if let Some(l) = login {
            req = req
                .header("cookie", &l.cookie)
                .header("x-csrf-token", &l.csrf);
        }
        req.send().await.unwrap()
    }

    /// The same post as htmx sends it (`HX-Request: true`).
    pub async fn htmx_post(
        &self,
        path: &str,
        login: &Login,
        form: &[(&str, &str)],
    ) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .header("cookie", &login.cookie)
            .header("x-csrf-token", &login.csrf)
            .header("origin", self.origin())
            .header("hx-request", "true")
            .form(form)
            .send()
            .await
            .unwrap()
    }

    /// An API token of `role`, made through the store.
    pub async fn token(&self, role: Role) -> String {
        let (token, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
        self.t
            .db
            .create_api_token(
                &ballast::store::NewApiToken {
                    // Sees sensitive fields: these tests are not about masking.
                    unmask: true,
                    pipelines: ballast::domain::scope::Scope::all(),
                    name: format!("t-{}", role.as_str()),
                    token_hash: hash,
                    prefix,
                    role,
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

    /// A record with no pipeline behind it, in `pending`.
    pub async fn record(&self, key: &str) -> i64 {
        self.record_in(key, None).await
    }

    /// [`record`](Self::record) in `group`.
    pub async fn record_in(&self, key: &str, group: Option<&str>) -> i64 {
        let new = NewRecord {
            pipeline: "manual".into(),
            group: group.map(str::to_owned),
            priority: ballast::domain::DEFAULT_PRIORITY,
            pipeline_version: None,
            external_key: Some(key.into()),
            input: json!({ "lead": key }),
            run_at: crate::helpers::wall_ms() + 3_600_000,
        };
        self.t
            .db
            .create_record(new, crate::helpers::wall_ms())
            .await
            .unwrap()
            .record
            .id
    }

    pub async fn park(&self, id: i64) {
        self.act(id, OperatorAction::Park).await;
    }

    /// `action` on record `id`, by `setup`, straight through the store.
    pub async fn act(&self, id: i64, action: OperatorAction) {
        let req = ActionRequest {
            record_id: id,
            action,
            actor: "setup".into(),
            reason: Some("setup".into()),
            now: crate::helpers::wall_ms(),
            steps: Vec::new(),
            until: None,
            took: None,
            input: None,
            repin: None,
            failed_items: false,
            signal: None,
        };
        self.t.db.act(&req).await.unwrap();
    }

    /// Stops the server and hands back its database.
    pub async fn stop_keeping_db(mut self) -> TestDb {
        self.shutdown.cancel();
        if let Some(s) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), s).await;
        }
        std::mem::replace(&mut self.t, TestDb::sqlite().await)
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(s) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), s).await;
        }
    }
}

impl Drop for WebApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// `name=value` of the session cookie a response sets.
pub fn session_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.contains("ballast_session="))
        .and_then(|v| v.split(';').next())
        .map(str::to_owned)
}

/// `name=value` of the device cookie a response sets.
pub fn device_cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.contains("ballast_device="))
        .and_then(|v| v.split(';').next())
        .map(str::to_owned)
}

/// The CSRF token a page embeds in its forms.
pub fn csrf_in(html: &str) -> Option<String> {
    let at = html.find(r#"name="csrf" value=""#)? + r#"name="csrf" value=""#.len();
    let end = html[at..].find('"')?;
    Some(html[at..at + end].to_owned())
}

async fn both(test: &str, f: impl AsyncFn(Backend, &str)) {
    f(Backend::Sqlite, test).await;
    f(Backend::Postgres, test).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_sets_a_hardened_cookie_and_logout_revokes_it() {
    both("login", async |backend, test| {
        let Some(app) = WebApp::spawn(backend, test, "").await else {
            return;
        };
        app.user("alice", Role::Operator).await;
        // Anonymous pages send the browser to the login page.
        let r = app.get("/", None).await;
        assert_eq!(r.status(), 303);
        assert_eq!(r.headers()["location"], "/login");
        // Wrong password and unknown user read the same.
        let wrong = app.try_login("alice", "not-the-password").await;
        assert_eq!(wrong.status(), 401);
        let wrong = wrong.text().await.unwrap();
        let unknown = app.try_login("mallory", "whatever-password").await;
        assert_eq!(unknown.status(), 401);
        assert!(wrong.contains("Unknown user or wrong password"));
        assert!(
            unknown
                .text()
                .await
                .unwrap()
                .contains("Unknown user or wrong password")
        );

        let r = app.try_login("alice", &password_of("alice")).await;
        assert_eq!(r.status(), 303);
        let set = r.headers()["set-cookie"].to_str().unwrap().to_owned();
        for attr in [
            "__Host-ballast_session=",
            "HttpOnly",
            "SameSite=Strict",
            "Secure",
            "Path=/",
            "Max-Age=",
        ] {
            assert!(set.contains(attr), "{attr} missing from {set}");
        }
        assert!(!set.contains("Domain"), "{set}");
        let login = app.login("alice").await;
        assert_eq!(app.get("/records", Some(&login)).await.status(), 200);

        // Logout kills the session server-side: the old cookie is useless.
        let out = app.post("/logout", Some(&login), &[]).await;
        assert_eq!(out.status(), 303);
        assert!(
            out.headers()["set-cookie"]
                .to_str()
                .unwrap()
                .contains("Max-Age=0")
        );
        let after = app.get("/records", Some(&login)).await;
        assert_eq!(after.status(), 303, "revoked session");
        // htmx requests get a redirect header instead.
        let hx = app
            .client
            .get(app.url("/records"))
            .header("cookie", &login.cookie)
            .header("hx-request", "true")
            .send()
            .await
            .unwrap();
        assert_eq!(hx.status(), 401);
        assert_eq!(hx.headers()["hx-redirect"], "/login");
        app.stop().await;
    })
    .await;
}

fn forge(claims: &Value, alg: jsonwebtoken::Algorithm, key: &[u8]) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(alg),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(key).unwrap(),
    )
    .unwrap()
}

fn b64(bytes: &[u8]) -> String {
    use std::fmt::Write;
    // URL-safe base64 without padding, by hand (no extra dependency).
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n =
            chunk.iter().fold(0u32, |acc, b| acc << 8 | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            let _ = out.write_char(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// A session ends after `session_idle` unused (30 minutes by default),
/// well within its 8-hour lifetime; each use within it keeps it going,
/// and uses are written down at most once a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_end_when_idle() {
    let clock = ManualClock::new(crate::helpers::wall_ms() - 3 * 3_600_000);
    let Some(app) = WebApp::spawn_clocked(Backend::Sqlite, "idle", "", &clock).await else {
        return;
    };
    app.user("alice", Role::Viewer).await;
    let login = app.login("alice").await;
    let sid = {
        let token = login.cookie.split_once('=').unwrap().1;
        let payload = token.split('.').nth(1).unwrap();
        let pad = "=".repeat((4 - payload.len() % 4) % 4);
        let std = format!("{payload}{pad}")
            .replace('-', "+")
            .replace('_', "/");
        let claims: Value = serde_json::from_slice(&base64_decode(&std)).unwrap();
        claims["sid"].as_str().unwrap().to_owned()
    };
    let stored = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(sid.as_bytes()));
    let seen = async || {
        let s = app.t.db.session(&stored).await.unwrap().unwrap();
        s.last_seen_at
    };
    let logged_in = seen().await;
    clock.advance(30_000);
    assert_eq!(app.get("/", Some(&login)).await.status(), 200);
    assert_eq!(seen().await, logged_in, "not noted within a minute");
    // Used every 20 minutes, it lasts past an hour.
    for _ in 0..4 {
        clock.advance(20 * 60_000);
        assert_eq!(app.get("/", Some(&login)).await.status(), 200);
    }
    assert_eq!(seen().await, clock.now_ms(), "noted");
    // A page left open refreshes itself (app.js marks those requests):
    // that is no one using the session, which ends 30 minutes after its
    // last real use all the same.
    for _ in 0..5 {
        clock.advance(5 * 60_000);
        let poll = app
            .client
            .get(app.url("/"))
            .header("cookie", &login.cookie)
            .header("hx-request", "true")
            .header("x-ballast-live", "1")
            .send()
            .await
            .unwrap();
        assert_eq!(poll.status(), 200, "a refresh within the idle time");
    }
    clock.advance(5 * 60_000);
    let r = app.get("/", Some(&login)).await;
    assert_eq!(r.status(), 303, "idle for 30 minutes");
    assert!(
        r.headers()["location"]
            .to_str()
            .unwrap()
            .starts_with("/login")
    );
    app.stop().await;
}

/// A session row keeps the SHA-256 of the id its cookie carries, never
/// the id: a copy of the database, signing key and all, opens no session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_stored_hashed() {
    both("hashed_sessions", async |backend, test| {
        let Some(app) = WebApp::spawn(backend, test, "").await else {
            return;
        };
        app.user("alice", Role::Admin).await;
        let login = app.login("alice").await;
        let token = login.cookie.split_once('=').unwrap().1.to_owned();
        let payload = token.split('.').nth(1).unwrap();
        let pad = "=".repeat((4 - payload.len() % 4) % 4);
        let std = format!("{payload}{pad}")
            .replace('-', "+")
            .replace('_', "/");
        let claims: Value = serde_json::from_slice(&base64_decode(&std)).unwrap();
        let sid = claims["sid"].as_str().unwrap().to_owned();
        let stored = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(sid.as_bytes()));
        assert_eq!(app.t.db.session(&sid).await.unwrap(), None, "{backend:?}");
        let row = app.t.db.session(&stored).await.unwrap().expect("its row");
        assert_ne!(row.id, sid);
        // What a copy of the database gives, signed with the right key,
        // names no session.
        let derived = {
            use hmac::{Hmac, KeyInit, Mac};
            let mut mac =
                <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(SECRET.as_bytes()).unwrap();
            mac.update(b"ballast session v1");
            mac.finalize().into_bytes().to_vec()
        };
        let mut from_copy = claims.clone();
        from_copy["sid"] = json!(stored);
        for (what, claims, status) in [
            ("the cookie's", &claims, 200),
            ("the row's", &from_copy, 303),
        ] {
            let forged = forge(claims, jsonwebtoken::Algorithm::HS256, &derived);
            let l = Login {
                cookie: format!("__Host-ballast_session={forged}"),
                csrf: String::new(),
            };
            assert_eq!(app.get("/", Some(&l)).await.status(), status, "{what} id");
        }
        // The session works as before: its pages, its CSRF token, logout.
        assert_eq!(app.get("/", Some(&login)).await.status(), 200);
        let out = app
            .client
            .post(app.url("/logout"))
            .header("origin", app.origin())
            .header("cookie", &login.cookie)
            .form(&[("csrf", login.csrf.as_str())])
            .send()
            .await
            .unwrap();
        assert_eq!(out.status(), 303);
        assert!(
            !app.t
                .db
                .session(&stored)
                .await
                .unwrap()
                .unwrap()
                .is_live(crate::helpers::wall_ms())
        );
        app.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_expired_and_confused_tokens_are_refused() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "jwt", "").await else {
        return;
    };
    app.user("alice", Role::Admin).await;
    let login = app.login("alice").await;
    let token = login.cookie.split_once('=').unwrap().1.to_owned();
    // Read the real claims to reuse the live session id.
    let payload = token.split('.').nth(1).unwrap();
    let claims: Value = {
        let pad = "=".repeat((4 - payload.len() % 4) % 4);
        let std = format!("{payload}{pad}")
            .replace('-', "+")
            .replace('_', "/");
        let bytes = base64_decode(&std);
        serde_json::from_slice(&bytes).unwrap()
    };
    // The session key is derived from the secret; forging with the raw
    // secret or another key must fail, and so must every variant below.
    let now = crate::helpers::wall_ms() / 1000;
    let with = |f: &dyn Fn(&mut Value)| {
        let mut c = claims.clone();
        f(&mut c);
        c
    };
    let derived = {
        use hmac::{Hmac, KeyInit, Mac};
        let mut mac = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(SECRET.as_bytes()).unwrap();
        mac.update(b"ballast session v1");
        mac.finalize().into_bytes().to_vec()
    };
    // Sanity: a token made with the derived key is accepted, so the
    // refusals below are about what they change, not about the key.
    let good = forge(&claims, jsonwebtoken::Algorithm::HS256, &derived);
    let ok = app
        .get(
            "/",
            Some(&Login {
                cookie: format!("__Host-ballast_session={good}"),
                csrf: String::new(),
            }),
        )
        .await;
    assert_eq!(ok.status(), 200, "a correctly signed token works");

    let header_none = b64(br#"{"alg":"none","typ":"JWT"}"#);
    let body = b64(claims.to_string().as_bytes());
    let cases: Vec<(&str, String)> = vec![
        ("alg none", format!("{header_none}.{body}.")),
        ("alg none, no dot", format!("{header_none}.{body}")),
        (
            "raw secret as key",
            forge(&claims, jsonwebtoken::Algorithm::HS256, SECRET.as_bytes()),
        ),
        (
            "other key",
            forge(
                &claims,
                jsonwebtoken::Algorithm::HS256,
                b"another-key-another-key-another-key",
            ),
        ),
        (
            "HS384 with the right key",
            forge(&claims, jsonwebtoken::Algorithm::HS384, &derived),
        ),
        (
            "HS512 with the right key",
            forge(&claims, jsonwebtoken::Algorithm::HS512, &derived),
        ),
        ("RS256 header, HMAC body", {
            let h = b64(br#"{"alg":"RS256","typ":"JWT"}"#);
            let sig = good.rsplit('.').next().unwrap();
            format!("{h}.{body}.{sig}")
        }),
        (
            "expired",
            forge(
                &with(&|c| c["exp"] = json!(now - 120)),
                jsonwebtoken::Algorithm::HS256,
                &derived,
            ),
        ),
        (
            "not yet valid",
            forge(
                &with(&|c| c["nbf"] = json!(now + 600)),
                jsonwebtoken::Algorithm::HS256,
                &derived,
            ),
        ),
        (
            "no exp",
            forge(
                &with(&|c| {
                    c.as_object_mut().unwrap().remove("exp");
                }),
                jsonwebtoken::Algorithm::HS256,
                &derived,
            ),
        ),
        (
            "other user, same session",
            forge(
                &with(&|c| c["sub"] = json!("999")),
                jsonwebtoken::Algorithm::HS256,
                &derived,
            ),
        ),
        (
            "unknown session",
            forge(
                &with(&|c| c["sid"] = json!("nope")),
                jsonwebtoken::Algorithm::HS256,
                &derived,
            ),
        ),
        ("tampered payload", {
            let mut parts: Vec<String> = token.split('.').map(str::to_owned).collect();
            parts[1] = b64(with(&|c| c["sub"] = json!("2")).to_string().as_bytes());
            parts.join(".")
        }),
        ("garbage", "not.a.jwt".to_owned()),
    ];
    let total = cases.len();
    for (name, forged) in cases {
        let l = Login {
            cookie: format!("__Host-ballast_session={forged}"),
            csrf: login.csrf.clone(),
        };
        let r = app.get("/", Some(&l)).await;
        assert_eq!(r.status(), 303, "{name} must be refused");
        let r = app
            .post(
                "/admin/tokens",
                Some(&l),
                &[("name", "x"), ("role", "admin")],
            )
            .await;
        assert!(
            r.status() == 401 || r.status() == 303,
            "{name} must not act: {}",
            r.status()
        );
    }
    println!("forged session tokens: {total} variants, all refused");
    app.stop().await;
}

fn base64_decode(s: &str) -> Vec<u8> {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let mut buf = 0u32;
    let mut bits = 0;
    for c in s.bytes().filter(|c| *c != b'=') {
        let v = T.iter().position(|t| *t == c).unwrap() as u32;
        buf = buf << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buf >> bits) as u8);
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Anonymous,
    As(Role),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_checks_the_role_server_side() {
    let Some(app) = WebApp::spawn(
        Backend::Sqlite,
        "matrix",
        "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\n",
    )
    .await
    else {
        return;
    };
    for (name, role) in [
        ("viewer", Role::Viewer),
        ("operator", Role::Operator),
        ("admin", Role::Admin),
    ] {
        app.user(name, role).await;
    }
    let victim = app.user("victim", Role::Viewer).await;
    let rec = app.record("m-1").await;
    app.park(rec).await;
    let logins = [
        (Role::Viewer, app.login("viewer").await),
        (Role::Operator, app.login("operator").await),
        (Role::Admin, app.login("admin").await),
    ];
    let tokens = [
        (Role::Viewer, app.token(Role::Viewer).await),
        (Role::Operator, app.token(Role::Operator).await),
        (Role::Admin, app.token(Role::Admin).await),
    ];
    let rank = |r: Role| match r {
        Role::Viewer => 0,
        Role::Operator => 1,
        Role::Admin => 2,
    };
    let r = rec.to_string();
    // (method, path, form, minimum role).
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a str)>, Role);
    let pages: Vec<Case> = vec![
        ("GET", "/".into(), vec![], Role::Viewer),
        ("GET", "/records".into(), vec![], Role::Viewer),
        ("GET", format!("/records/{r}"), vec![], Role::Viewer),
        (
            "GET",
            format!("/records/{r}/live?v=0"),
            vec![],
            Role::Viewer,
        ),
        ("GET", "/providers".into(), vec![], Role::Viewer),
        ("GET", "/pipelines".into(), vec![], Role::Viewer),
        ("GET", "/audit".into(), vec![], Role::Viewer),
        ("GET", "/triggers".into(), vec![], Role::Viewer),
        ("GET", "/notifications".into(), vec![], Role::Viewer),
        ("GET", "/search?q=m-1".into(), vec![], Role::Viewer),
        (
            "POST",
            "/notifications/999/redeliver".into(),
            vec![],
            Role::Operator,
        ),
        (
            "POST",
            "/notifications/subscriptions/none/disable".into(),
            vec![],
            Role::Admin,
        ),
        (
            "POST",
            "/notifications/subscriptions/none/enable".into(),
            vec![],
            Role::Admin,
        ),
        (
            "POST",
            format!("/records/{r}/actions"),
            vec![("action", "park"), ("reason", "matrix")],
            Role::Operator,
        ),
        (
            "POST",
            "/records/bulk".into(),
            vec![("action", "park"), ("reason", "matrix"), ("ids", &r)],
            Role::Operator,
        ),
        (
            "POST",
            "/records/enqueue".into(),
            vec![("pipeline", "none")],
            Role::Operator,
        ),
        (
            "GET",
            "/records/export?format=csv".into(),
            vec![],
            Role::Operator,
        ),
        (
            "POST",
            "/me/theme".into(),
            vec![("theme", "dark")],
            Role::Viewer,
        ),
        (
            "POST",
            "/providers/p/pause".into(),
            vec![("reason", "matrix")],
            Role::Admin,
        ),
        ("POST", "/providers/p/resume".into(), vec![], Role::Admin),
        (
            "POST",
            "/providers/p/reset-breaker".into(),
            vec![],
            Role::Admin,
        ),
        ("GET", "/admin/users".into(), vec![], Role::Admin),
        (
            "POST",
            "/admin/users".into(),
            vec![
                ("username", "new-user"),
                ("role", "viewer"),
                ("password", "long-enough-pw"),
            ],
            Role::Admin,
        ),
        (
            "POST",
            format!("/admin/users/{victim}/role"),
            vec![("role", "viewer")],
            Role::Admin,
        ),
        (
            "POST",
            format!("/admin/users/{victim}/pipelines"),
            vec![("pipelines", "")],
            Role::Admin,
        ),
        (
            "POST",
            format!("/admin/users/{victim}/unmask"),
            vec![("unmask", "off")],
            Role::Admin,
        ),
        (
            "POST",
            format!("/admin/users/{victim}/disable"),
            vec![],
            Role::Admin,
        ),
        (
            "POST",
            format!("/admin/users/{victim}/enable"),
            vec![],
            Role::Admin,
        ),
        (
            "POST",
            format!("/admin/users/{victim}/password"),
            vec![("password", "another-long-pw")],
            Role::Admin,
        ),
        ("GET", "/admin/tokens".into(), vec![], Role::Admin),
        (
            "POST",
            "/admin/tokens".into(),
            vec![("name", "matrix"), ("role", "viewer")],
            Role::Admin,
        ),
        (
            "POST",
            "/admin/tokens/999/revoke".into(),
            vec![],
            Role::Admin,
        ),
    ];
    let mut checked = 0;
    for (method, path, form, min) in &pages {
        for htmx in [false, true] {
            for who in [
                Who::Anonymous,
                Who::As(Role::Viewer),
                Who::As(Role::Operator),
                Who::As(Role::Admin),
            ] {
                let login = match who {
                    Who::Anonymous => None,
                    Who::As(role) => logins.iter().find(|l| l.0 == role).map(|l| &l.1),
                };
                let mut req = if *method == "GET" {
                    app.client.get(app.url(path))
                } else {
                    app.client
                        .post(app.url(path))
                        .header("origin", app.origin())
                        .form(form)
                };
                if let Some(l) = login {
                    req = req
                        .header("cookie", &l.cookie)
                        .header("x-csrf-token", &l.csrf);
                }
                if htmx {
                    req = req.header("hx-request", "true");
                }
                let status = req.send().await.unwrap().status().as_u16();
                let expected_ok = matches!(who, Who::As(role) if rank(role) >= rank(*min));
                match who {
                    Who::Anonymous => assert_eq!(
                        status,
                        if htmx { 401 } else { 303 },
                        "{method} {path} anonymous htmx={htmx}"
                    ),
                    _ if expected_ok => assert!(
                        !matches!(status, 401 | 403) && status < 500,
                        "{method} {path} as {who:?} htmx={htmx}: {status}"
                    ),
                    _ => assert_eq!(status, 403, "{method} {path} as {who:?} htmx={htmx}"),
                }
                checked += 1;
            }
        }
    }
    // The API: bearer tokens only, same roles.
    let api: Vec<(&str, String, Option<Value>, Role)> = vec![
        ("GET", "/api/v1/records".into(), None, Role::Viewer),
        ("GET", format!("/api/v1/records/{r}"), None, Role::Viewer),
        (
            "GET",
            format!("/api/v1/records/{r}/items/fetch"),
            None,
            Role::Viewer,
        ),
        ("GET", "/api/v1/records/export".into(), None, Role::Operator),
        (
            "POST",
            format!("/api/v1/records/{r}/actions"),
            Some(json!({"action": "retry"})),
            Role::Operator,
        ),
        (
            "POST",
            "/api/v1/records".into(),
            Some(json!({"pipeline": "none"})),
            Role::Operator,
        ),
        ("GET", "/metrics".into(), None, Role::Viewer),
        ("GET", "/api/v1/providers".into(), None, Role::Viewer),
        ("GET", "/api/v1/pipelines".into(), None, Role::Viewer),
        ("GET", "/api/v1/audit".into(), None, Role::Viewer),
        ("GET", "/api/v1/search?q=x".into(), None, Role::Viewer),
        ("GET", "/api/v1/notifications".into(), None, Role::Viewer),
        (
            "GET",
            "/api/v1/notifications/subscriptions".into(),
            None,
            Role::Viewer,
        ),
        (
            "POST",
            "/api/v1/notifications/999/redeliver".into(),
            Some(json!({})),
            Role::Operator,
        ),
        (
            "POST",
            "/api/v1/notifications/subscriptions/none/enable".into(),
            Some(json!({})),
            Role::Admin,
        ),
        ("GET", "/api/v1/users".into(), None, Role::Admin),
        ("GET", "/api/v1/tokens".into(), None, Role::Admin),
        (
            "POST",
            "/api/v1/providers/none/pause".into(),
            Some(json!({"reason": "r"})),
            Role::Admin,
        ),
        (
            "POST",
            "/api/v1/providers/none/resume".into(),
            Some(json!({})),
            Role::Admin,
        ),
        (
            "POST",
            "/api/v1/providers/none/reset-breaker".into(),
            Some(json!({})),
            Role::Admin,
        ),
    ];
    for (method, path, body, min) in &api {
        for who in [
            Who::Anonymous,
            Who::As(Role::Viewer),
            Who::As(Role::Operator),
            Who::As(Role::Admin),
        ] {
            let mut req = if *method == "GET" {
                app.client.get(app.url(path))
            } else {
                app.client.post(app.url(path)).json(body.as_ref().unwrap())
            };
            if let Who::As(role) = who {
                let t = &tokens.iter().find(|t| t.0 == role).unwrap().1;
                req = req.bearer_auth(t);
            }
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            match who {
                Who::Anonymous => assert_eq!(status, 401, "{method} {path} anonymous"),
                Who::As(role) if rank(role) >= rank(*min) => assert!(
                    !matches!(status, 401 | 403) && status < 500,
                    "{method} {path} as {role:?}: {status}"
                ),
                Who::As(role) => {
                    assert_eq!(status, 403, "{method} {path} as {role:?}");
                    let body: Value = resp.json().await.unwrap();
                    assert_eq!(body["error"], "forbidden");
                }
            }
            checked += 1;
        }
    }
    // A session cookie is not an API credential, and a token is not a session.
    let l = &logins[2].1;
    let r = app
        .client
        .get(app.url("/api/v1/records"))
        .header("cookie", &l.cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = app
        .client
        .get(app.url("/records"))
        .bearer_auth(&tokens[2].1)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    println!("route x role matrix: {checked} cases checked");
    assert!(checked > 150);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_need_the_csrf_token_and_this_origin() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "csrf", "").await else {
        return;
    };
    app.user("op", Role::Operator).await;
    let login = app.login("op").await;
    let rec = app.record("c-1").await;
    let path = format!("/records/{rec}/actions");
    let form = [("action", "park"), ("reason", "csrf test")];
    let send = |origin: Option<&str>, token: Option<&str>, in_form: bool| {
        let mut req = app
            .client
            .post(app.url(&path))
            .header("cookie", &login.cookie);
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        let mut fields: Vec<(&str, &str)> = form.to_vec();
        if let Some(t) = token {
            if in_form {
                fields.push(("csrf", t));
            } else {
                req = req.header("x-csrf-token", t);
            }
        }
        req.form(&fields).send()
    };
    let own = app.origin();
    // Another user's token does not work with this cookie.
    app.user("op2", Role::Operator).await;
    let other = app.login("op2").await;
    let forged: [(Option<&str>, Option<&str>, bool, &str); 6] = [
        (Some(&own), None, false, "no token"),
        (Some(&own), Some("0000"), false, "wrong token"),
        (None, Some(&login.csrf), false, "no origin"),
        (
            Some("https://evil.example"),
            Some(&login.csrf),
            false,
            "foreign origin",
        ),
        (Some("null"), Some(&login.csrf), true, "opaque origin"),
        (
            Some(&own),
            Some(&other.csrf),
            false,
            "another session's token",
        ),
    ];
    for (origin, token, in_form, what) in forged {
        let status = send(origin, token, in_form).await.unwrap().status();
        assert_eq!(status, 403, "{what}");
    }
    assert_eq!(
        app.t
            .db
            .get_record(rec)
            .await
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "pending",
        "nothing applied"
    );
    // The form field works for plain forms (JavaScript off).
    let ok = send(Some(&own), Some(&login.csrf), true).await.unwrap();
    assert_eq!(ok.status(), 303);
    assert_eq!(
        app.t
            .db
            .get_record(rec)
            .await
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "parked"
    );
    // A request axum itself rejects (the path does not parse) still gives
    // htmx a readable message for the page's message area.
    let r = app
        .client
        .post(app.url("/records/not-a-number/actions"))
        .header("cookie", &login.cookie)
        .header("x-csrf-token", &login.csrf)
        .header("origin", app.origin())
        .header("hx-request", "true")
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["hx-retarget"], "#flash");
    assert!(r.text().await.unwrap().contains("flash error"));
    // Actions refuse GET.
    let r = app.get(&path, Some(&login)).await;
    assert_eq!(r.status(), 405);
    // The login form checks the origin too (login CSRF).
    let r = app
        .client
        .post(app.url("/login"))
        .header("origin", "https://evil.example")
        .form(&[("username", "op"), ("password", &password_of("op"))])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    println!(
        "CSRF: {} forged writes and a cross-origin login refused (403), none applied",
        forged.len()
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_carries_the_security_headers() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "headers", "").await else {
        return;
    };
    app.user("v", Role::Viewer).await;
    let login = app.login("v").await;
    let token = app.token(Role::Viewer).await;
    let mut responses = vec![
        ("page", app.get("/", Some(&login)).await),
        ("login", app.get("/login", None).await),
        ("redirect", app.get("/records", None).await),
        ("404", app.get("/records/424242", Some(&login)).await),
        ("no route", app.get("/nope", None).await),
        ("health", app.get("/healthz", None).await),
        ("static", app.get("/static/htmx.min.js", None).await),
        ("api 401", app.get("/api/v1/records", None).await),
        ("anonymous post", app.post("/records/bulk", None, &[]).await),
    ];
    responses.push((
        "api",
        app.client
            .get(app.url("/api/v1/records"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap(),
    ));
    for (name, r) in &responses {
        let h = r.headers();
        let csp = h
            .get("content-security-policy")
            .map(|v| v.to_str().unwrap())
            .unwrap_or_else(|| panic!("{name}: no CSP"));
        assert!(
            !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"),
            "{name}: {csp}"
        );
        assert!(
            csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"),
            "{name}: {csp}"
        );
        assert_eq!(h["x-content-type-options"], "nosniff", "{name}");
        assert_eq!(h["referrer-policy"], "same-origin", "{name}");
        // Cookies marked Secure (the default) mean HTTPS: HSTS for a year.
        assert_eq!(h["strict-transport-security"], "max-age=31536000", "{name}");
    }
    assert_eq!(responses[0].1.headers()["cache-control"], "no-store");
    assert_eq!(responses[3].1.status(), 404);
    // Pages load nothing from elsewhere, and no inline script or style.
    let html = app.get("/", Some(&login)).await.text().await.unwrap();
    assert!(
        !html.contains("<script>") && !html.contains("style=") && !html.contains(" on"),
        "inline code in the page"
    );
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "external resources"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_data_renders_as_inert_text() {
    both("xss", async |backend, test| {
        let Some(app) = WebApp::spawn(backend, test, "").await else { return };
        app.user("v", Role::Viewer).await;
        let login = app.login("v").await;
        let id = app.record("<script>alert('key')</script>").await;
        let payload = r#"<script>alert(1)</script><img src=x onerror="alert(2)"><div hx-get="/admin/users" hx-trigger="load">x</div><a href="javascript:alert(3)">y</a>"#;
        app.t
            .db
            .append_attempts(
                id,
                &[NewAttempt {
                    step: "fetch".into(),
                    provider: Some("p".into()),
                    attempt_no: 1,
                    node: None,
                    started_at: crate::helpers::wall_ms(),
                    duration_ms: 12,
                    http_status: Some(500),
                    outcome: Outcome::Retry,
                    error_code: Some("http_5xx".into()),
                    excerpt: Some(payload.into()),
                    request: Some(ballast::domain::request::SentRequest {
                        method: "POST".into(),
                        url: format!("https://crm.example/{payload}"),
                        headers: vec![("X-Test".into(), payload.into())],
                        body: Some(payload.into()),
                    }),
                }],
                &[],
            )
            .await
            .unwrap();
        // A call sent with no reply kept yet (`at_most_once`) is shown too,
        // its request as inert as an attempt's.
        let held = app
            .t
            .db
            .claim_due(&ballast::store::ClaimRequest {
                owner: "node:gone".into(),
                now: crate::helpers::wall_ms() + 7_200_000,
                lease: Duration::from_secs(30),
                limit: 1,
                group_caps: Vec::new(),
            })
            .await
            .unwrap()
            .remove(0);
        app.t
            .db
            .record_intents(&[ballast::store::NewIntent {
                lease: held.lease().unwrap(),
                record_id: id,
                step: "fetch".into(),
                provider: Some("p".into()),
                attempt_no: 2,
                node: Some("node:gone".into()),
                sent_at: crate::helpers::wall_ms(),
                request: Some(ballast::domain::request::SentRequest {
                    method: "POST".into(),
                    url: format!("https://crm.example/{payload}"),
                    headers: Vec::new(),
                    body: Some(payload.into()),
                }),
            }])
            .await
            .unwrap();
        app.t
            .db
            .release(&[held.lease().unwrap()], crate::helpers::wall_ms())
            .await
            .unwrap();
        let page = app.get(&format!("/records/{id}"), Some(&login)).await.text().await.unwrap();
        assert!(page.contains("sent by node:gone; no reply kept yet"), "the open call is shown");
        let req = ActionRequest {
            record_id: id,
            action: OperatorAction::Park,
            actor: "setup".into(),
            reason: Some(payload.into()),
            now: crate::helpers::wall_ms(),
            steps: Vec::new(),
            until: None,
            took: None,
            input: None,
            repin: None,
            failed_items: false,
            signal: None,
        };
        app.t.db.act(&req).await.unwrap();
        let mut inert = 0;
        for path in [format!("/records/{id}"), "/records".into(), "/audit".into()] {
            let html = app.get(&path, Some(&login)).await.text().await.unwrap();
            let shown = if path == "/records" { "&#60;script&#62;alert(&#39;key&#39;)" } else { "&#60;script&#62;alert(1)&#60;/script&#62;" };
            assert!(html.contains(shown), "{path}: escaped text shown");
            for live in ["<script>alert", "<img src=x", "<div hx-get=\"/admin", "href=\"javascript:"] {
                assert!(!html.contains(live), "{path}: live markup `{live}`");
                inert += 1;
            }
        }
        println!("{} stored XSS: {inert} payload × page checks, all inert", backend.as_str());
        app.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_are_limited_per_address_and_per_account() {
    let extra = "[server.limits]\nlogins_per_minute = 4\naccount_failures = 3\n";
    let clock = ManualClock::new(crate::helpers::wall_ms() - 3_600_000);
    let Some(app) = WebApp::spawn_clocked(Backend::Sqlite, "throttle", extra, &clock).await else {
        return;
    };
    app.user("alice", Role::Viewer).await;
    // Per account: three failures make the name wait a second, even for
    // the right password (the clock stands still, so the wait holds).
    for _ in 0..3 {
        assert_eq!(app.try_login("alice", "wrong-password").await.status(), 401);
    }
    let delayed = app.try_login("alice", &password_of("alice")).await;
    assert_eq!(delayed.status(), 429);
    assert_eq!(delayed.headers()["retry-after"], "1");
    assert!(
        delayed
            .text()
            .await
            .unwrap()
            .contains("Too many failed logins")
    );
    // Per address: the fifth attempt in a minute is refused before any check,
    // and a spoofed X-Forwarded-For does not help (no trusted proxy).
    let r = app
        .client
        .post(app.url("/login"))
        .header("origin", app.origin())
        .header("x-forwarded-for", "203.0.113.9")
        .form(&[("username", "bob"), ("password", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "60");
    assert!(r.text().await.unwrap().contains("too many login attempts"));
    app.stop().await;
    // Unknown names wait the same way (no enumeration by delay), and
    // guesses sent at once past the threshold take turns: one is checked
    // per wait, whichever node gets it.
    let extra = "[server.limits]\nlogins_per_minute = 100\naccount_failures = 3\n";
    let Some(app) = WebApp::spawn_clocked(Backend::Sqlite, "throttle2", extra, &clock).await else {
        return;
    };
    app.user("dave", Role::Viewer).await;
    for _ in 0..3 {
        assert_eq!(app.try_login("ghost", "guess-123456").await.status(), 401);
    }
    assert_eq!(
        app.try_login("ghost", "guess-123456").await.status(),
        429,
        "an unknown name waits too"
    );
    for _ in 0..3 {
        assert_eq!(app.try_login("dave", "guess-123456").await.status(), 401);
    }
    // The wait (1 s on the stopped clock) passes; then eight at once.
    clock.advance(1_000);
    let before = app
        .t
        .db
        .login_failures("dave")
        .await
        .unwrap()
        .unwrap()
        .failures;
    let guesses: Vec<_> = (0..8)
        .map(|_| app.try_login("dave", "guess-123456"))
        .collect();
    let mut statuses: Vec<u16> = futures_util::future::join_all(guesses)
        .await
        .iter()
        .map(|r| r.status().as_u16())
        .collect();
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [401, 429, 429, 429, 429, 429, 429, 429],
        "one guess checked"
    );
    let after = app
        .t
        .db
        .login_failures("dave")
        .await
        .unwrap()
        .unwrap()
        .failures;
    assert_eq!(after, before + 1, "the one checked counted once");
    assert_eq!(
        app.try_login("dave", "pw-dave-0123456789").await.status(),
        429,
        "the right password waits too"
    );
    app.stop().await;
}

/// The name's delay after failures: 1 s at the threshold, doubling with
/// each further failure, never more than 30 s however many come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_login_delay_grows_with_failures_and_is_capped() {
    let extra = "[server.limits]\nlogins_per_minute = 1000\naccount_failures = 2\n";
    let clock = ManualClock::new(crate::helpers::wall_ms() - 3_600_000);
    let Some(app) = WebApp::spawn_clocked(Backend::Sqlite, "delay_cap", extra, &clock).await else {
        return;
    };
    app.user("alice", Role::Viewer).await;
    // Two failures reach the threshold; each later check waits.
    for _ in 0..2 {
        assert_eq!(app.try_login("alice", "wrong-password").await.status(), 401);
    }
    let mut waits = Vec::new();
    for _ in 0..9 {
        let r = app.try_login("alice", "wrong-password").await;
        assert_eq!(r.status(), 429);
        let secs: u64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        waits.push(secs);
        // Just short of the wait, the name still waits; at it, the next
        // guess is checked (and fails, lengthening the wait).
        clock.advance(secs * 1000 - 1);
        assert_eq!(app.try_login("alice", "wrong-password").await.status(), 429);
        clock.advance(1);
        assert_eq!(app.try_login("alice", "wrong-password").await.status(), 401);
    }
    assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30, 30]);
    // Past the longest wait, the owner gets in, however many failures.
    clock.advance(30_000);
    assert_eq!(
        app.try_login("alice", &password_of("alice")).await.status(),
        303
    );
    app.stop().await;
}

/// An attacker who keeps failing on a name slows only browsers that never
/// logged in to it: one holding the device cookie of an earlier login to
/// that name goes straight to the password check. The cookie is signed
/// and bound to the name: it helps no other name, and a forged one helps
/// nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attackers_failures_do_not_keep_out_a_user_with_a_device_cookie() {
    let extra = "[server.limits]\nlogins_per_minute = 1000\naccount_failures = 3\n";
    let clock = ManualClock::new(crate::helpers::wall_ms() - 3_600_000);
    let Some(app) = WebApp::spawn_clocked(Backend::Sqlite, "device", extra, &clock).await else {
        return;
    };
    app.user("alice", Role::Viewer).await;
    app.user("bob", Role::Viewer).await;
    let first = app.try_login("alice", &password_of("alice")).await;
    assert_eq!(first.status(), 303);
    let device = device_cookie(first.headers()).expect("a device cookie");
    let set = first
        .headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.contains("ballast_device="))
        .unwrap()
        .to_ascii_lowercase();
    assert!(
        set.contains("httponly") && set.contains("max-age="),
        "{set}"
    );
    // The attacker's failures, on alice and on bob.
    for name in ["alice", "bob"] {
        for _ in 0..20 {
            let r = app.try_login(name, "guess-123456").await;
            assert!([401, 429].contains(&r.status().as_u16()));
        }
    }
    let with = |name: &str, cookie: &str| {
        app.client
            .post(app.url("/login"))
            .header("origin", app.origin())
            .header("cookie", cookie.to_owned())
            .form(&[
                ("username", name),
                ("password", &password_of(name)),
                ("next", "/"),
            ])
            .send()
    };
    assert_eq!(
        app.try_login("alice", &password_of("alice")).await.status(),
        429
    );
    assert_eq!(
        with("bob", &device).await.unwrap().status(),
        429,
        "not bob's"
    );
    let (value, mac) = device.rsplit_once('.').unwrap();
    let forged = format!("{value}.{}", "0".repeat(mac.len()));
    assert_eq!(
        with("alice", &forged).await.unwrap().status(),
        429,
        "forged"
    );
    assert_eq!(
        with("alice", &device).await.unwrap().status(),
        303,
        "alice's browser"
    );
    app.stop().await;
}

/// Password checks are bounded per node: with every place taken, a login
/// is answered 503 with `Retry-After`, unchecked and uncounted; once a
/// place is free, logins are checked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_past_the_password_check_cap_are_told_to_come_back() {
    let extra = "[server.limits]\npassword_checks = 1\naccount_failures = 1\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "check_cap", extra).await else {
        return;
    };
    app.user("alice", Role::Viewer).await;
    let held = app
        .state
        .web
        .password_checks
        .try_slot()
        .expect("the one place");
    for password in ["wrong-password".to_owned(), password_of("alice")] {
        let r = app.try_login("alice", &password).await;
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
        assert!(r.text().await.unwrap().contains("Try again in a second"));
    }
    drop(held);
    // Had the refused wrong password counted, alice would wait now.
    assert_eq!(
        app.try_login("alice", &password_of("alice")).await.status(),
        303
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxy_forwards_the_client_address() {
    let extra =
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n[server.limits]\nlogins_per_minute = 2\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "proxy", extra).await else {
        return;
    };
    let attempt = |ip: &'static str| {
        app.client
            .post(app.url("/login"))
            .header("origin", app.origin())
            .header("x-forwarded-for", ip)
            .form(&[("username", "nobody"), ("password", "x")])
            .send()
    };
    for _ in 0..2 {
        assert_eq!(attempt("198.51.100.1").await.unwrap().status(), 401);
    }
    assert_eq!(
        attempt("198.51.100.1").await.unwrap().status(),
        429,
        "that client is limited"
    );
    assert_eq!(
        attempt("198.51.100.2").await.unwrap().status(),
        401,
        "another client is not"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_follow_the_transition_table_and_are_audited() {
    both("actions", async |backend, test| {
        let Some(app) = WebApp::spawn(
            backend,
            test,
            "[server.limits]\nbulk_max = 5\nbulk_per_minute = 2\n",
        )
        .await
        else {
            return;
        };
        app.user("op", Role::Operator).await;
        let login = app.login("op").await;
        let id = app.record("a-1").await;
        app.park(id).await;
        // The detail page offers what the state allows.
        let html = app
            .get(&format!("/records/{id}"), Some(&login))
            .await
            .text()
            .await
            .unwrap();
        // (Parking a parked record again names when it resumes.)
        for a in ["retry", "resume", "cancel", "park"] {
            assert!(
                html.contains(&format!(r#"data-action="{a}""#)),
                "{a} offered"
            );
        }
        assert!(html.contains(r#"name="until""#), "the condition is offered");
        // Retry through htmx: the fragment comes back with the new state.
        let r = app
            .htmx_post(
                &format!("/records/{id}/actions"),
                &login,
                &[("action", "retry")],
            )
            .await;
        assert_eq!(r.status(), 200);
        let frag = r.text().await.unwrap();
        assert!(frag.contains(r#"id="record-state">pending"#), "{frag}");
        assert!(!frag.contains("<html"), "a fragment, not a page");
        // An action the state does not allow is refused, readably, and nothing changes.
        let r = app
            .htmx_post(
                &format!("/records/{id}/actions"),
                &login,
                &[("action", "resume")],
            )
            .await;
        assert_eq!(r.status(), 409);
        assert_eq!(r.headers()["hx-retarget"], "#flash");
        let msg = r.text().await.unwrap();
        assert!(
            msg.contains("flash error") && msg.contains("resume"),
            "{msg}"
        );
        // Park needs a reason.
        assert_eq!(
            app.post(
                &format!("/records/{id}/actions"),
                Some(&login),
                &[("action", "park")]
            )
            .await
            .status(),
            400
        );

        // The bulk form's filter fields come with the list fragment, so an
        // htmx filter change updates what "every matching record" means.
        let frag = app
            .fragment("/records?state=parked&provider=crm", &login)
            .await;
        assert!(
            frag.contains(r#"form="bulk" name="state" value="parked""#),
            "{frag}"
        );
        assert!(frag.contains(r#"form="bulk" name="provider" value="crm""#));
        // Bulk: a dry run counts, needs a reason, and changes nothing.
        let ids: Vec<i64> = {
            let mut v = Vec::new();
            for k in 0..4 {
                v.push(app.record(&format!("b-{k}")).await);
            }
            v
        };
        app.park(ids[0]).await;
        let id_strs: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        let mut form: Vec<(&str, &str)> = id_strs.iter().map(|i| ("ids", i.as_str())).collect();
        form.push(("action", "park"));
        let no_reason = app.post("/records/bulk", Some(&login), &form).await;
        assert_eq!(no_reason.status(), 400);
        form.push(("reason", "vendor outage"));
        let preview = app
            .post("/records/bulk", Some(&login), &form)
            .await
            .text()
            .await
            .unwrap();
        assert!(
            preview.contains(r#"<strong id="bulk-count">3</strong> of 4"#),
            "{preview}"
        );
        assert_eq!(
            app.t
                .db
                .get_record(ids[1])
                .await
                .unwrap()
                .unwrap()
                .state
                .as_str(),
            "pending",
            "a dry run changes nothing"
        );
        form.push(("mode", "apply"));
        let applied = app
            .post("/records/bulk", Some(&login), &form)
            .await
            .text()
            .await
            .unwrap();
        assert!(
            applied.contains("Applied <strong>park</strong> to 3 record(s)"),
            "{applied}"
        );
        for id in &ids[1..] {
            let events = app.t.db.record_events(*id).await.unwrap();
            let e = events
                .iter()
                .find(|e| e.audit && e.kind == "park")
                .expect("an audited event per record");
            assert_eq!(
                (e.actor.as_str(), e.reason.as_deref()),
                ("op", Some("vendor outage"))
            );
        }
        // The audit log page shows them, filterable by actor.
        let audit = app
            .get("/audit?actor=op&kind=park", Some(&login))
            .await
            .text()
            .await
            .unwrap();
        assert!(audit.matches("vendor outage").count() >= 3);
        // Capped per request…
        let many: Vec<String> = (0..6).map(|i| (ids[0] + 100 + i).to_string()).collect();
        let mut big: Vec<(&str, &str)> = many.iter().map(|i| ("ids", i.as_str())).collect();
        big.extend([("action", "retry"), ("reason", "too many")]);
        let r = app.post("/records/bulk", Some(&login), &big).await;
        assert_eq!(r.status(), 400);
        // …and rate-limited per user (2 per minute here; one used above).
        let mut again: Vec<(&str, &str)> = id_strs.iter().map(|i| ("ids", i.as_str())).collect();
        again.extend([("action", "retry"), ("reason", "again"), ("mode", "apply")]);
        assert_eq!(
            app.post("/records/bulk", Some(&login), &again)
                .await
                .status(),
            200
        );
        assert_eq!(
            app.post("/records/bulk", Some(&login), &again)
                .await
                .status(),
            429
        );
        app.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_changes_take_effect_on_the_next_request() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "revoke", "").await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let bob = app.user("bob", Role::Operator).await;
    let admin = app.login("admin").await;
    for (path, form) in [
        (format!("/admin/users/{bob}/role"), vec![("role", "viewer")]),
        (
            format!("/admin/users/{bob}/password"),
            vec![("password", "a-brand-new-password")],
        ),
        (format!("/admin/users/{bob}/disable"), vec![]),
    ] {
        let session = if path.ends_with("password") || path.ends_with("disable") {
            // Log in again with whatever the password is now.
            let pw = if path.ends_with("disable") {
                "a-brand-new-password".to_owned()
            } else {
                password_of("bob")
            };
            let r = app.try_login("bob", &pw).await;
            assert_eq!(r.status(), 303, "{path}");
            Login {
                cookie: session_cookie(r.headers()).unwrap(),
                csrf: String::new(),
            }
        } else {
            app.login("bob").await
        };
        assert_eq!(app.get("/records", Some(&session)).await.status(), 200);
        let r = app.post(&path, Some(&admin), &form).await;
        assert_eq!(r.status(), 303, "{path}");
        assert_eq!(
            app.get("/records", Some(&session)).await.status(),
            303,
            "{path}: old session ended"
        );
    }
    assert_eq!(
        app.try_login("bob", "a-brand-new-password").await.status(),
        401,
        "disabled"
    );
    let audit = app
        .t
        .db
        .audit_log(&ballast::store::AuditFilter {
            actor: Some("admin".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        audit
            .items
            .iter()
            .filter(|e| e.kind == "user_changed")
            .count(),
        3
    );
    app.stop().await;
}

/// The users page never leaves the control plane without an enabled admin:
/// the last one can be neither demoted nor disabled (409 `last_admin`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_enabled_admin_cannot_be_demoted_or_disabled() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "last_admin", "").await else {
        return;
    };
    let root = app.user("admin", Role::Admin).await;
    let ann = app.user("ann", Role::Admin).await;
    let admin = app.login("admin").await;
    let post = async |path: String, form: &[(&str, &str)]| {
        let r = app.post(&path, Some(&admin), form).await;
        let status = r.status().as_u16();
        (status, r.text().await.unwrap())
    };
    let viewer = [("role", "viewer")];
    assert_eq!(
        post(format!("/admin/users/{ann}/disable"), &[]).await.0,
        303
    );
    // Ann is disabled: admin is the last enabled admin.
    let (status, page) = post(format!("/admin/users/{root}/role"), &viewer).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("last enabled admin"), "{page}");
    assert_eq!(
        post(format!("/admin/users/{ann}/role"), &viewer).await.0,
        303
    );
    assert_eq!(post(format!("/admin/users/{ann}/enable"), &[]).await.0, 303);
    // Ann is an enabled viewer now: still no second admin.
    assert_eq!(
        post(format!("/admin/users/{root}/role"), &viewer).await.0,
        409
    );
    let admin_role = [("role", "admin")];
    assert_eq!(
        post(format!("/admin/users/{ann}/role"), &admin_role)
            .await
            .0,
        303
    );
    assert_eq!(
        post(format!("/admin/users/{root}/role"), &viewer).await.0,
        303
    );
    let kept = app.t.db.user_by_id(root).await.unwrap().unwrap();
    assert_eq!(kept.role, Role::Viewer);
    app.stop().await;
}

/// A new password, on the users page as at the command line, has at
/// least 12 characters and is none of the most common passwords (nor one
/// of them with digits after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_passwords_are_long_and_uncommon() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "weak_pw", "").await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let bob = app.user("bob", Role::Operator).await;
    let admin = app.login("admin").await;
    for weak in ["eleven char", "qwerty123456", "Monkey1234567"] {
        let add = [
            ("username", "carol"),
            ("role", "viewer"),
            ("password", weak),
        ];
        let reset = [("password", weak)];
        for (path, form) in [
            ("/admin/users".to_owned(), &add[..]),
            (format!("/admin/users/{bob}/password"), &reset[..]),
        ] {
            let r = app.post(&path, Some(&admin), form).await;
            assert_eq!(r.status(), 400, "{path} {weak}");
        }
    }
    assert!(app.t.db.user_by_name("carol").await.unwrap().is_none());
    assert_eq!(
        app.try_login("bob", &password_of("bob")).await.status(),
        303
    );
    app.stop().await;
}

/// A token made to last a day works for that day; then it is refused 401
/// with its own code, and the tokens page says it expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_tokens_may_expire() {
    let clock = ManualClock::new(crate::helpers::wall_ms() - 3_600_000);
    let Some(app) = WebApp::spawn_clocked(Backend::Sqlite, "token_expiry", "", &clock).await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let admin = app.login("admin").await;
    let make = async |name: &str, days: &str| {
        let form = [
            ("name", name),
            ("role", "viewer"),
            ("expires_in_days", days),
        ];
        let r = app.post("/admin/tokens", Some(&admin), &form).await;
        assert_eq!(r.status(), 201, "{name}");
        let html = r.text().await.unwrap();
        let at = html.find("blt_").unwrap();
        html[at..at + 44].to_owned()
    };
    let daily = make("daily", "1").await;
    let forever = make("forever", "").await;
    let bad = [("name", "x"), ("role", "viewer"), ("expires_in_days", "0")];
    assert_eq!(
        app.post("/admin/tokens", Some(&admin), &bad).await.status(),
        400
    );
    // The page says when each expires, and which have.
    let gone = ballast::store::NewApiToken {
        unmask: false,
        pipelines: ballast::domain::scope::Scope::all(),
        name: "gone".into(),
        token_hash: "h".into(),
        prefix: "blt_0000".into(),
        role: Role::Viewer,
        created_by: "test".into(),
        actor: "test".into(),
        expires_at: Some(clock.now_ms() - 1),
    };
    app.t
        .db
        .create_api_token(&gone, clock.now_ms())
        .await
        .unwrap();
    let page = app.text("/admin/tokens", Some(&admin)).await;
    let row = |name: &str| {
        let at = page.find(&format!("<td>{name}</td>")).unwrap();
        page[at..at + page[at..].find("</tr>").unwrap()].to_owned()
    };
    assert!(row("gone").contains("<td>expired</td>"), "{}", row("gone"));
    assert!(row("forever").contains(">never<") && row("forever").contains("<td>active</td>"));
    assert!(!row("daily").contains(">never<") && row("daily").contains("<td>active</td>"));
    let call = async |token: &str| {
        app.client
            .get(app.url("/api/v1/records"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
    };
    clock.advance(86_400_000 - 1);
    assert_eq!(call(&daily).await.status(), 200, "within its day");
    clock.advance(1);
    let r = call(&daily).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "token_expired");
    assert_eq!(call(&forever).await.status(), 200, "no expiry");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_tokens_are_shown_once_and_revocable() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "tokens", "").await else {
        return;
    };
    app.user("admin", Role::Admin).await;
    let admin = app.login("admin").await;
    let r = app
        .post(
            "/admin/tokens",
            Some(&admin),
            &[("name", "ci"), ("role", "viewer")],
        )
        .await;
    assert_eq!(r.status(), 201);
    let html = r.text().await.unwrap();
    let at = html.find("blt_").unwrap();
    let token = html[at..at + 44].to_owned();
    let ok = app
        .client
        .get(app.url("/api/v1/records"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    // Listed by prefix only; the database keeps a hash.
    let list = app
        .get("/admin/tokens", Some(&admin))
        .await
        .text()
        .await
        .unwrap();
    assert!(!list.contains(&token) && list.contains(&token[..10]));
    let stored = app.t.db.list_api_tokens().await.unwrap();
    assert!(stored[0].last_used_at.is_some());
    let id = stored[0].id;
    assert_eq!(
        app.post(&format!("/admin/tokens/{id}/revoke"), Some(&admin), &[])
            .await
            .status(),
        303
    );
    let gone = app
        .client
        .get(app.url("/api/v1/records"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 401);
    let body: Value = gone.json().await.unwrap();
    assert_eq!(body["error"], "unauthenticated");
    app.stop().await;
}

/// A provider's "slow down" pause, kept for every node, is on the
/// providers page while it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_page_shows_a_throttle_pause() {
    let provider = "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "throttle-page", provider).await else {
        return;
    };
    app.user("vera", Role::Viewer).await;
    let login = app.login("vera").await;
    let page = app
        .get("/providers", Some(&login))
        .await
        .text()
        .await
        .unwrap();
    assert!(!page.contains("Throttled until"), "no pause yet");
    let now = crate::helpers::wall_ms();
    app.t
        .db
        .throttle_provider("p", now + 600_000, now)
        .await
        .unwrap();
    let page = app
        .get("/providers", Some(&login))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("Throttled until (every node)") && page.contains("outcome throttled"),
        "{page}"
    );
    app.stop().await;
}

/// Served over plain HTTP on localhost (cookies without `Secure`), no
/// response carries HSTS, which would pin a browser to an HTTPS this
/// server does not speak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_on_localhost_brings_no_hsts() {
    let extra = "[server]\nsecure_cookies = false\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "hsts", extra).await else {
        return;
    };
    for path in ["/healthz", "/login", "/nope", "/api/v1/records"] {
        let r = app.get(path, None).await;
        assert!(
            r.headers().get("strict-transport-security").is_none(),
            "{path}"
        );
    }
    app.stop().await;
}

/// `/hooks` and `/metrics` are limited per client address before anything
/// is looked up or verified: past the burst, 429 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_and_metrics_are_limited_per_address() {
    let extra = "[server.limits]\nhooks_per_second = 1\napi_per_second = 1\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "hook-limit", extra).await else {
        return;
    };
    let mut statuses = Vec::new();
    for _ in 0..10 {
        let r = app
            .client
            .post(app.url("/hooks/nobody"))
            .header("x-signature", "t=1,v1=00")
            .body(vec![b'x'; 1024])
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            assert_eq!(r.headers()["retry-after"], "1");
        }
        statuses.push(r.status().as_u16());
    }
    // A burst of two is looked up (no such provider), then refused.
    assert_eq!(&statuses[..2], &[404, 404], "{statuses:?}");
    assert!(statuses.contains(&429), "{statuses:?}");
    let mut metrics = Vec::new();
    for _ in 0..40 {
        let r = app
            .client
            .get(app.url("/metrics"))
            .bearer_auth("metrics-token-0123456789")
            .send()
            .await
            .unwrap();
        metrics.push(r.status().as_u16());
    }
    assert_eq!(metrics[0], 200, "{metrics:?}");
    assert!(metrics.contains(&429), "{metrics:?}");
    app.stop().await;
}

/// A record parked by its step ("attempts exhausted") shows that step as
/// `parked` in its Steps table and its graph, not as the `retrying` it was
/// about to do, with the step's reason beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_records_step_reads_parked() {
    let failing = axum::Router::new().fallback(|| async {
        (
            axum::http::StatusCode::BAD_GATEWAY,
            axum::Json(serde_json::json!({ "error": "down" })),
        )
    });
    let base = crate::helpers::serve_router(failing).await;
    let extra = format!(
        r#"
[providers.p]
base_url = "{base}"
retry = {{ max_attempts = 1, base = "10ms", cap = "10ms", deadline = "1m" }}
[[pipelines.pay.steps]]
name = "fetch"
provider = "p"
request = {{ method = "POST", path = "/v1/charge", body = '{{}}' }}
"#
    );
    let Some(app) = WebApp::spawn(Backend::Sqlite, "parked-step", &extra).await else {
        return;
    };
    app.user("vera", Role::Viewer).await;
    let new = NewRecord {
        pipeline: "pay".into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some("p-1".into()),
        input: json!({}),
        run_at: crate::helpers::wall_ms(),
    };
    let id = app
        .t
        .db
        .create_record(new, crate::helpers::wall_ms())
        .await
        .unwrap()
        .record
        .id;
    let rec = crate::wait::until("the record parks", Duration::from_secs(60), async || {
        let r = app.t.db.get_record(id).await.unwrap().unwrap();
        if r.state == ballast::domain::RecordState::Parked {
            Ok(r)
        } else {
            Err(r.state)
        }
    })
    .await;
    assert_eq!(rec.step.as_deref(), Some("fetch"));
    let run = &app.t.db.step_runs(id).await.unwrap()[0];
    let login = app.login("vera").await;
    let page = app
        .get(&format!("/records/{id}"), Some(&login))
        .await
        .text()
        .await
        .unwrap();
    // The Steps table's row: the step's name, then its state.
    let row = page
        .split("<tr><td>fetch</td>")
        .nth(1)
        .unwrap_or_else(|| panic!("no steps row: {page}"));
    let shown: String = row.chars().take(200).collect();
    assert!(
        row.starts_with("<td>parked</td>"),
        "stored as {:?}: {shown}",
        run.state
    );
    assert!(!page.contains("<td>retrying</td>"), "{page}");
    app.stop().await;
}

/// A base URL carrying a password or a key is shown to viewers without
/// them, as attempts' URLs are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_page_hides_a_base_urls_credentials() {
    let provider =
        "[providers.p]\nbase_url = \"http://u:pw-s3cret@127.0.0.1:9/v1?api_key=k-s3cret\"\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "base-url-page", provider).await else {
        return;
    };
    app.user("vera", Role::Viewer).await;
    let login = app.login("vera").await;
    let page = app
        .get("/providers", Some(&login))
        .await
        .text()
        .await
        .unwrap();
    assert!(!page.contains("s3cret"), "{page}");
    assert!(page.contains("127.0.0.1:9/v1?api_key=[redacted]"), "{page}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_a_token() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "metrics-auth", "").await else {
        return;
    };
    assert_eq!(app.get("/metrics", None).await.status(), 401);
    let wrong = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth("metrics-token-wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let ok = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth("metrics-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(
        ok.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let token = app.token(Role::Viewer).await;
    let ok = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    app.stop().await;
}

/// Prometheus's `promtool`, or `None` (with a line saying so) where it is
/// not installed; under CI it must be.
fn promtool() -> Option<&'static str> {
    let there = std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !there {
        assert!(
            !crate::helpers::in_ci(),
            "CI installs promtool (Debian's prometheus)"
        );
        crate::helpers::skip("promtool is not installed here (apt-get install prometheus)");
    }
    there.then_some("promtool")
}

/// `promtool check metrics` finds nothing in `text`.
fn promtool_check(promtool: &str, text: &str) {
    let mut check = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}"
    );
}

/// `ballast_group_records`: records of a group at work per (pipeline,
/// group, state), from the maintained counters (which agree with the
/// rows), the `server.metrics_groups` biggest groups of each pipeline
/// named and the rest summed in `ballast_group_records_other`, names
/// escaped (promtool reads the scrape), a finished group gone from the
/// next scrape, and its counters' rows deleted by housekeeping.
async fn metrics_break_down_by_group(backend: Backend) {
    let Some(t) = TestDb::new(backend, "metrics_groups").await else {
        return;
    };
    let app = WebApp::spawn_edited(t, "", true, |c| c.server.metrics_groups = 2).await;
    let now = crate::helpers::wall_ms();
    let record = |pipeline: &str, group: Option<&str>, key: String| NewRecord {
        pipeline: pipeline.into(),
        group: group.map(str::to_owned),
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some(key),
        input: json!({}),
        run_at: now + 3_600_000,
    };
    let quote = "qu\"o\\te";
    let mut batch = Vec::new();
    for (pipeline, group, n) in [
        ("gm-a", Some("big"), 3),
        ("gm-a", Some(quote), 2),
        ("gm-a", Some("tiny"), 1),
        ("gm-a", Some("small"), 1),
        ("gm-a", None, 2),
        ("gm-b", Some("solo"), 1),
    ] {
        for i in 0..n {
            batch.push(record(pipeline, group, format!("{group:?}-{i}")));
        }
    }
    // Through each backend's batch enqueue (PostgreSQL's is a function
    // of its own, counting in SQL).
    let made = app.t.db.create_records(batch, now).await.unwrap();
    let id = |group: &str| -> Vec<i64> {
        made.iter()
            .filter(|c| c.record.group.as_deref() == Some(group))
            .map(|c| c.record.id)
            .collect()
    };
    app.park(id("big")[0]).await;
    app.act(id("small")[0], OperatorAction::Cancel).await;
    crate::helpers::assert_counters_match(&app.t.db).await;
    let text = app.metrics().await;
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("ballast_group_records"))
        .collect();
    let line = |pipeline: &str, group: &str, state: &str, n: i64| match group {
        "" => {
            format!("ballast_group_records_other{{pipeline=\"{pipeline}\",state=\"{state}\"}} {n}")
        }
        _ => format!(
            "ballast_group_records{{pipeline=\"{pipeline}\",group=\"{group}\",state=\"{state}\"}} {n}"
        ),
    };
    let mut wanted = Vec::new();
    // ("": the pipeline's groups past the two named, summed.)
    for (pipeline, group, pending, parked) in [
        ("gm-a", "", 1, 0),
        ("gm-a", "big", 2, 1),
        ("gm-a", r#"qu\"o\\te"#, 2, 0),
        ("gm-b", "solo", 1, 0),
    ] {
        for (state, n) in [
            ("pending", pending),
            ("running", 0),
            ("waiting", 0),
            ("retrying", 0),
            ("parked", parked),
        ] {
            wanted.push(line(pipeline, group, state, n));
        }
    }
    let mut got: Vec<String> = series.iter().map(|s| (*s).to_owned()).collect();
    got.sort();
    wanted.sort();
    assert_eq!(got, wanted, "{text}");
    if let Some(promtool) = promtool() {
        promtool_check(promtool, &text);
    }

    // Every record finished: the family is gone, and housekeeping deletes
    // the counters' rows (each key's shards add up to nothing).
    for c in &made {
        let r = app.t.db.get_record(c.record.id).await.unwrap().unwrap();
        if !r.state.is_terminal() {
            app.act(r.id, OperatorAction::Cancel).await;
        }
    }
    crate::helpers::assert_counters_match(&app.t.db).await;
    let text = app.metrics().await;
    assert!(!text.contains("ballast_group_records"), "{text}");
    let forgotten = app.t.db.forget_idle_groups(2).await.unwrap();
    assert!(forgotten >= 2, "{forgotten}");
    while app.t.db.forget_idle_groups(2).await.unwrap() > 0 {}
    assert!(app.t.db.group_counts().await.unwrap().is_empty());
    // A group with work again is counted from nothing.
    let again = app
        .t
        .db
        .create_records(vec![record("gm-b", Some("solo"), "again".into())], now)
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    crate::helpers::assert_counters_match(&app.t.db).await;
    assert!(
        app.metrics()
            .await
            .contains(&line("gm-b", "solo", "pending", 1))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_metrics_break_down_by_group() {
    metrics_break_down_by_group(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_metrics_break_down_by_group() {
    metrics_break_down_by_group(Backend::Postgres).await;
}

/// Every family `/metrics` serves says what it is (HELP), and promtool's
/// linter finds nothing in a scrape taken after a record ran (so the
/// call counters and the histogram are in it); every family the code
/// reports is described.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_explain_themselves() {
    let Some(promtool) = promtool() else {
        return;
    };
    let ok = axum::Router::new().fallback(|| async { axum::Json(json!({ "ok": true })) });
    let base = crate::helpers::serve_router(ok).await;
    let extra = format!(
        r#"
[providers.p]
base_url = "{base}"
[[providers.p.rules]]
when = {{ status = "2xx" }}
outcome = "success"
[[pipelines.pay.steps]]
name = "fetch"
provider = "p"
request = {{ method = "POST", path = "/v1/charge", body = '{{}}' }}
"#
    );
    let Some(app) = WebApp::spawn(Backend::Sqlite, "metrics-help", &extra).await else {
        return;
    };
    let new = NewRecord {
        pipeline: "pay".into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some("m-1".into()),
        input: json!({}),
        run_at: crate::helpers::wall_ms(),
    };
    let id = app
        .t
        .db
        .create_record(new.clone(), crate::helpers::wall_ms())
        .await
        .unwrap()
        .record
        .id;
    crate::wait::until("the record succeeds", Duration::from_secs(60), async || {
        let r = app.t.db.get_record(id).await.unwrap().unwrap();
        match r.state {
            ballast::domain::RecordState::Succeeded => Ok(()),
            _ => Err((r.state, r.reason)),
        }
    })
    .await;
    // A record of a group at work (in a pipeline no node runs), for the
    // groups' families.
    let mut grouped = new.clone();
    grouped.pipeline = "idle".into();
    grouped.group = Some("tenant-1".into());
    grouped.external_key = Some("m-2".into());
    app.t
        .db
        .create_record(grouped, crate::helpers::wall_ms())
        .await
        .unwrap();
    let text = app.metrics().await;
    let families = |prefix: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_owned)
            .collect()
    };
    let typed = families("# TYPE ");
    for must in [
        "ballast_records",
        "ballast_attempts_total",
        "ballast_attempt_duration_seconds",
        "ballast_records_finished_total",
        "ballast_group_records",
    ] {
        assert!(typed.iter().any(|t| t == must), "{must} is served: {text}");
    }
    let helped = families("# HELP ");
    for t in &typed {
        assert!(helped.contains(t), "{t} has no HELP: {text}");
    }
    promtool_check(promtool, &text);
    // Every family the code reports anywhere in `src/` (counters,
    // histograms, the scrape's gauges) is described.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![root];
    let mut code = String::new();
    while let Some(path) = files.pop() {
        match std::fs::read_dir(&path) {
            Ok(dir) => files.extend(dir.map(|e| e.unwrap().path())),
            Err(_) if path.extension().is_some_and(|e| e == "rs") => {
                code.push_str(&std::fs::read_to_string(&path).unwrap());
            }
            Err(_) => {}
        }
    }
    // The first string literal after each of `openers`.
    let names_after = |openers: &[&str]| -> Vec<String> {
        let mut names = Vec::new();
        for opener in openers {
            for piece in code.split(opener).skip(1) {
                if let Some(name) = piece
                    .trim_start()
                    .strip_prefix('"')
                    .and_then(|p| p.split('"').next())
                {
                    names.push(name.to_owned());
                }
            }
        }
        names.sort();
        names.dedup();
        names
    };
    let described = names_after(&[
        "describe_counter!(",
        "describe_gauge!(",
        "describe_histogram!(",
    ]);
    let reported: Vec<String> =
        names_after(&["counter!(", "gauge!(", "histogram!(", "gauges.push(("])
            .into_iter()
            .filter(|n| n.starts_with("ballast_"))
            .collect();
    assert!(
        reported.len() >= 10 && described.len() >= 10,
        "{reported:?} {described:?}"
    );
    for r in &reported {
        assert!(described.contains(r), "{r} is reported but not described");
    }
    app.stop().await;
}

/// The shipped alert rules load, and fire as their unit tests say
/// (`deploy/prometheus-alerts.test.yml`, `promtool test rules`).
#[test]
fn the_shipped_alert_rules_pass_promtool() {
    let Some(promtool) = promtool() else {
        return;
    };
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    for args in [
        ["check", "rules", "prometheus-alerts.yml"],
        ["test", "rules", "prometheus-alerts.test.yml"],
    ] {
        let out = std::process::Command::new(promtool)
            .args(args)
            .current_dir(&deploy)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_is_rate_limited_per_token() {
    let extra = "[server.limits]\napi_per_second = 1\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "api-limit", extra).await else {
        return;
    };
    let a = app.token(Role::Viewer).await;
    let b = app.token(Role::Viewer).await;
    let get = |t: &str| {
        app.client
            .get(app.url("/api/v1/records"))
            .bearer_auth(t)
            .send()
    };
    // A burst of two, then refused until the bucket refills.
    assert_eq!(get(&a).await.unwrap().status(), 200);
    assert_eq!(get(&a).await.unwrap().status(), 200);
    let r = get(&a).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "rate_limited");
    assert_eq!(
        get(&b).await.unwrap().status(),
        200,
        "another token has its own budget"
    );
    // Time passing is the point here: the limiter refills on governor's own
    // clock, which the test cannot drive, at one request a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(get(&a).await.unwrap().status(), 200, "refilled");
    // Inventing tokens buys nothing: the client's address has its own cap
    // (four a second, bursts of eight). The wait above gave back the four
    // requests the address spent before it, and the refilled request took
    // one, so seven invented tokens pass before the cap: no second wait.
    let mut statuses = Vec::new();
    for _ in 0..12 {
        let (fake, _, _) = ballast::web::auth::new_api_token().unwrap();
        statuses.push(get(&fake).await.unwrap().status().as_u16());
    }
    assert_eq!(&statuses[..3], &[401, 401, 401], "{statuses:?}");
    assert!(
        statuses.contains(&429),
        "invented tokens are limited by address: {statuses:?}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_users_cost_the_same_time_as_known_ones() {
    let extra = "[server.limits]\nlogins_per_minute = 1000\naccount_failures = 1000\n";
    let Some(app) = WebApp::spawn(Backend::Sqlite, "login-timing", extra).await else {
        return;
    };
    app.user("alice", Role::Viewer).await;
    let mut known = Vec::new();
    let mut unknown = Vec::new();
    for i in 0..7 {
        for (name, out) in [("alice", &mut known), (&*format!("ghost{i}"), &mut unknown)] {
            let start = std::time::Instant::now();
            assert_eq!(
                app.try_login(name, "wrong-password-123").await.status(),
                401
            );
            out.push(start.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (k, u) = (median(&mut known), median(&mut unknown));
    println!(
        "login with a wrong password: known user {k:.1} ms, unknown user {u:.1} ms (medians of 7)"
    );
    // Both pay one argon2 verification; without the dummy hash the unknown
    // name would answer in well under a tenth of the time. This compares
    // wall-clock durations on purpose, for want of a better witness: the
    // server counts no verifications that the test could read instead.
    assert!(
        u > k * 0.5 && u < k * 2.0,
        "known {k:.1} ms vs unknown {u:.1} ms"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_survive_a_restart_until_the_key_is_rotated() {
    both("restart", async |backend, test| {
        let Some(t) = TestDb::new(backend, test).await else {
            return;
        };
        let app = WebApp::spawn_with(t, "", false).await;
        app.user("alice", Role::Viewer).await;
        let login = app.login("alice").await;
        let t = app.stop_keeping_db().await;
        let app = WebApp::spawn_with(t, "", false).await;
        assert_eq!(
            app.get("/records", Some(&login)).await.status(),
            200,
            "same key after a restart"
        );
        // `ballast rotate-secret` does this: a new key, every session ended.
        let n = app
            .t
            .db
            .rotate_meta_secret(
                ballast::web::SESSION_SECRET_KEY,
                &ballast::web::new_session_secret().unwrap(),
                crate::helpers::wall_ms(),
            )
            .await
            .unwrap();
        assert!(n >= 1);
        assert_eq!(
            app.get("/records", Some(&login)).await.status(),
            303,
            "ended at once"
        );
        let t = app.stop_keeping_db().await;
        let app = WebApp::spawn_with(t, "", false).await;
        let again = app.login("alice").await;
        assert_eq!(
            app.get("/records", Some(&again)).await.status(),
            200,
            "the new key signs new sessions"
        );
        app.stop().await;
    })
    .await;
}

/// Issue 23: an `at_most_once` request step whose charge timed out after
/// the provider took it offers "it took effect" with its outputs to fill
/// in (a JSON object of the step's output names); outputs that are not
/// JSON are refused readably, nothing changed; the step's outputs given
/// succeed the step and the record leaves `parked`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_step_took_effect_with_outputs_given_on_the_page() {
    let (url, charges, _) = crate::engine::charge_then_receipt().await;
    let text = crate::engine::charge_then_receipt_toml(&url);
    let Some(app) = WebApp::spawn(Backend::Sqlite, "took_page", &text).await else {
        return;
    };
    app.user("op", Role::Operator).await;
    let login = app.login("op").await;
    // The test's engine works ten days ahead of the wall clock, so the
    // app's workers leave the record to it.
    let config = Config::parse(&text, std::path::Path::new("t.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let ahead = crate::helpers::wall_ms() + 10 * 86_400_000;
    let (engine, _clock) =
        crate::engine::manual_engine_at(&app.t.db, std::sync::Arc::new(config), "wt", ahead).await;
    let id = engine
        .enqueue(Enqueue::new("pay", Some("t-1"), json!({})))
        .await
        .unwrap()
        .record
        .id;
    crate::engine::drain(&engine).await;
    let page = format!("/records/{id}");
    let html = app.get(&page, Some(&login)).await.text().await.unwrap();
    assert!(html.contains(r#"id="took-effect""#), "offered");
    assert!(
        html.contains(r#"name="output""#) && !html.contains(r#"name="job_id""#),
        "a request step names its outputs, not a job"
    );
    assert!(
        html.contains("amount") && html.contains("charge_id"),
        "the step's outputs are offered to fill in"
    );
    let path = format!("/records/{id}/actions");
    let r = app
        .post(
            &path,
            Some(&login),
            &[("action", "took_effect"), ("output", "ch_1")],
        )
        .await;
    assert!(r.status().is_client_error(), "{}", r.status());
    assert!(r.text().await.unwrap().contains("not JSON"));
    let rec = app.t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.state, ballast::domain::RecordState::Parked);
    let r = app
        .post(
            &path,
            Some(&login),
            &[
                ("action", "took_effect"),
                ("output", r#"{"charge_id": "ch_9", "amount": 7}"#),
                ("reason", "found in the gateway's dashboard"),
            ],
        )
        .await;
    assert_eq!(r.status(), 303);
    let rec = app.t.db.get_record(id).await.unwrap().unwrap();
    assert_ne!(rec.state, ballast::domain::RecordState::Parked);
    let charge = app
        .t
        .db
        .step_runs(id)
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.step == "charge")
        .unwrap();
    assert_eq!(
        (charge.state, charge.output),
        (
            ballast::domain::StepState::Succeeded,
            Some(json!({ "charge_id": "ch_9", "amount": 7 }))
        )
    );
    assert_eq!(charges.load(std::sync::atomic::Ordering::SeqCst), 1);
    app.stop().await;
}

/// Issue 20 item 5: `/metrics` carries what people alert on, read from the
/// store at the scrape (records by pipeline and state, the oldest due
/// record's wait, each provider's breaker, pause and "slow down" pause),
/// and every metric the shipped alert rules and Grafana dashboard use is
/// one Ballast exports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_what_alerts_need_and_the_shipped_rules_use_them() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "metrics_gauges", "").await else {
        return;
    };
    let token = app.token(Role::Viewer).await;
    let now = crate::helpers::wall_ms();
    let record = |pipeline: &str, key: String, run_at: i64| NewRecord {
        pipeline: pipeline.into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some(key),
        input: json!({}),
        run_at,
    };
    let mut batch: Vec<NewRecord> = (0..3)
        .map(|i| record("g-leads", format!("due-{i}"), now - 90_000 + i * 1_000))
        .collect();
    batch.push(record("g-quiet", "later".into(), now + 3_600_000));
    batch.push(record("g-leads", "to-park".into(), now + 3_600_000));
    batch.push(NewRecord {
        group: Some("g-tenant".into()),
        ..record("g-grouped", "grouped".into(), now + 3_600_000)
    });
    let made = app.t.db.create_records(batch, now).await.unwrap();
    // (Names of this test's own: the recorder is the process's, and other
    // tests scrape it too.)
    app.park(made[4].record.id).await;
    let mut open = ballast::domain::ProviderState::new("g-sim", now);
    open.breaker = ballast::domain::BreakerState::Open;
    open.open_until = Some(now + 60_000);
    app.t.db.save_provider_state(&open).await.unwrap();
    app.t
        .db
        .set_provider_pause("g-crm", true, "admin", Some("maintenance"), now)
        .await
        .unwrap();
    let scrape = async || {
        let r = app
            .client
            .get(app.url("/metrics"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    };
    let text = scrape().await;
    // The value of the series whose line starts with `series`.
    let value = |series: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    };
    assert_eq!(
        value(r#"ballast_records{pipeline="g-leads",state="pending"}"#),
        3.0
    );
    assert_eq!(
        value(r#"ballast_records{pipeline="g-quiet",state="pending"}"#),
        1.0
    );
    // The oldest due record fell due 90 s before the records were made.
    let waited = value(r#"ballast_oldest_due_seconds{pipeline="g-leads"}"#);
    assert!((90.0..150.0).contains(&waited), "{waited}");
    assert_eq!(
        value(r#"ballast_oldest_due_seconds{pipeline="g-quiet"}"#),
        0.0
    );
    assert_eq!(
        value(r#"ballast_records{pipeline="g-leads",state="parked"}"#),
        1.0
    );
    // A state with no records says 0 rather than nothing.
    assert_eq!(
        value(r#"ballast_records{pipeline="g-leads",state="cancelled"}"#),
        0.0
    );
    assert_eq!(
        value(r#"ballast_provider_breaker{provider="g-sim",state="open"}"#),
        1.0
    );
    assert_eq!(
        value(r#"ballast_provider_breaker{provider="g-sim",state="closed"}"#),
        0.0
    );
    assert_eq!(value(r#"ballast_provider_paused{provider="g-crm"}"#), 1.0);
    assert_eq!(value(r#"ballast_provider_paused{provider="g-sim"}"#), 0.0);

    // Every `ballast_*` name the shipped rules and dashboard query is one
    // Ballast exports (gauges above; counters and the histogram as the
    // engine keeps them).
    let exported = [
        "ballast_records",
        "ballast_oldest_due_seconds",
        "ballast_provider_breaker",
        "ballast_provider_paused",
        "ballast_provider_throttled_seconds",
        "ballast_attempts_total",
        "ballast_deferrals_total",
        "ballast_attempt_duration_seconds_bucket",
        "ballast_group_records",
        "ballast_group_records_other",
    ];
    assert!(
        text.contains(
            "\nballast_group_records{pipeline=\"g-grouped\",group=\"g-tenant\",state=\"pending\"} 1\n"
        ),
        "{text}"
    );
    // The parked record resumed and one attempt timed: the next scrape
    // says 0 parked (not the last count) and has the histogram's buckets.
    app.act(made[4].record.id, OperatorAction::Resume).await;
    metrics::histogram!("ballast_attempt_duration_seconds", "provider" => "g-sim", "step" => "g")
        .record(0.2);
    let text = scrape().await;
    assert!(
        text.contains("\nballast_records{pipeline=\"g-leads\",state=\"parked\"} 0\n"),
        "{text}"
    );
    assert!(
        text.contains(
            "\nballast_attempt_duration_seconds_bucket{provider=\"g-sim\",step=\"g\",le=\"0.25\"} 1\n"
        ),
        "{text}"
    );
    for name in ["ballast_records", "ballast_attempt_duration_seconds_bucket"]
        .iter()
        .chain(&exported[..5])
    {
        assert!(text.contains(&format!("\n{name}{{")), "{name} not exported");
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = std::fs::read_to_string(root.join("deploy/prometheus-alerts.yml")).unwrap();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut exprs: Vec<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr: "))
        .map(str::to_owned)
        .collect();
    assert_eq!(exprs.len(), 5, "one expression per alert rule");
    for p in dashboard["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for expr in &exprs {
        let names: Vec<&str> = expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("ballast_"))
            .collect();
        assert!(!names.is_empty(), "{expr}");
        for n in names {
            assert!(
                exported.contains(&n),
                "{n} in `{expr}` is not a Ballast metric"
            );
        }
    }
    // With promtool at hand, the rules are checked as Prometheus would.
    match std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(root.join("deploy/prometheus-alerts.yml"))
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(_) => crate::helpers::skip("promtool check: promtool is not installed"),
    }
    app.stop().await;
}

/// Issue 20 item 4 on the dashboard: an operator enqueues a record from the
/// records page, now or later (a UTC time or a delay); a bad input or time
/// is refused readably and creates nothing; a viewer cannot enqueue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_enqueues_for_later_from_the_records_page() {
    let config = crate::cli::ORDERS;
    let Some(app) = WebApp::spawn(Backend::Sqlite, "enqueue_page", config).await else {
        return;
    };
    app.user("op", Role::Operator).await;
    app.user("v", Role::Viewer).await;
    let op = app.login("op").await;
    let html = app.get("/records", Some(&op)).await.text().await.unwrap();
    assert!(
        html.contains(r#"id="enqueue""#) && html.contains(r#"name="run_at""#),
        "the form is offered"
    );
    let before = crate::helpers::wall_ms();
    let r = app
        .post(
            "/records/enqueue",
            Some(&op),
            &[
                ("pipeline", "orders"),
                ("key", "o-later"),
                ("input", r#"{"amount": 5}"#),
                ("run_at", ""),
                ("delay", "2h"),
                ("priority", "7"),
            ],
        )
        .await;
    assert_eq!(r.status(), 303);
    let to = r.headers()["location"].to_str().unwrap().to_owned();
    let id: i64 = to.trim_start_matches("/records/").parse().unwrap();
    let rec = app.t.db.get_record(id).await.unwrap().unwrap();
    let after = crate::helpers::wall_ms();
    assert_eq!(rec.input, json!({ "amount": 5 }));
    assert_eq!(rec.priority, 7);
    let page = app.get(&to, Some(&op)).await.text().await.unwrap();
    assert!(page.contains(r#"id="record-priority">7<"#), "{page}");
    let due = rec.next_run_at.unwrap();
    assert!(
        (before + 7_200_000..=after + 7_200_000).contains(&due),
        "{due}"
    );
    // A time as the browser's `datetime-local` sends it, read as UTC.
    let at_ms = (before / 60_000 + 30 * 1_440) * 60_000;
    let local = ballast::domain::time::format_ms(at_ms)[..16].to_owned();
    let r = app
        .post(
            "/records/enqueue",
            Some(&op),
            &[("pipeline", "orders"), ("key", "o-at"), ("run_at", &local)],
        )
        .await;
    assert_eq!(r.status(), 303);
    let id: i64 = r.headers()["location"].to_str().unwrap()[9..]
        .parse()
        .unwrap();
    let rec = app.t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.next_run_at, Some(at_ms));
    assert_eq!(rec.priority, ballast::domain::DEFAULT_PRIORITY);
    // The list shows a priority other than the default, and filters by it.
    let list = app
        .get("/records?priority=7", Some(&op))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        list.contains(">o-later<") && !list.contains(">o-at<"),
        "{list}"
    );
    assert!(
        list.contains(r#"title="priority">priority 7</small>"#),
        "{list}"
    );
    assert!(
        list.contains(r#"name="priority" value="7""#),
        "the bulk form's filter"
    );
    // A bulk action over every record of that priority names it alone.
    let r = app
        .post(
            "/records/bulk",
            Some(&op),
            &[
                ("action", "cancel"),
                ("reason", "r"),
                ("all_matching", "1"),
                ("priority", "7"),
            ],
        )
        .await;
    let preview = r.text().await.unwrap();
    assert!(
        preview.contains(r#"<strong id="bulk-count">1</strong> of 1 selected"#),
        "{preview}"
    );
    for (form, says) in [
        (vec![("input", "{oops")], "not JSON"),
        (
            vec![("delay", "1h"), ("run_at", local.as_str())],
            "not both",
        ),
        (vec![("delay", "soon")], "invalid duration"),
        (vec![("run_at", "noon")], "invalid time"),
        (vec![("priority", "12")], "out of range"),
        (vec![("priority", "high")], "not 0 to 9"),
    ] {
        let mut fields = vec![("pipeline", "orders"), ("key", "o-bad")];
        fields.extend(form);
        let r = app.post("/records/enqueue", Some(&op), &fields).await;
        assert_eq!(r.status(), 400, "{fields:?}");
        let body = r.text().await.unwrap();
        assert!(body.contains(says), "{fields:?}: {body}");
    }
    let made = crate::helpers::record_total(&app.t.db).await;
    assert_eq!(made, 2, "nothing created by a refused enqueue");
    let viewer = app.login("v").await;
    let r = app
        .post("/records/enqueue", Some(&viewer), &[("pipeline", "orders")])
        .await;
    assert_eq!(r.status(), 403);
    app.stop().await;
}

/// Export through the API: every record the filters select, past several
/// pages of the store, each once, newest first, with its steps' outputs
/// (and attempts when asked); CSV with a header and formula-looking text
/// defused; a bad format refused.
async fn export_streams_every_selected_record(backend: Backend) {
    use ballast::domain::{StepState, WorkResult};
    use ballast::store::{ClaimRequest, Commit, StepWrite};
    let Some(app) = WebApp::spawn(backend, "export", "").await else {
        return;
    };
    let n = 1_203;
    let now = crate::helpers::wall_ms();
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let batch = chunk
            .iter()
            .map(|i| NewRecord {
                pipeline: "manual".into(),
                group: None,
                priority: ballast::domain::DEFAULT_PRIORITY,
                pipeline_version: None,
                external_key: Some(format!("e-{i}")),
                input: json!({ "i": i }),
                run_at: now + 3_600_000,
            })
            .collect();
        app.t.db.create_records(batch, now).await.unwrap();
    }
    // Three finish, each with an output and an attempt.
    let later = now + 3_600_000;
    for i in 0..3 {
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
        step.output = Some(json!({ "score": i, "note": "=1+1" }));
        step.finished_at = Some(later);
        let mut c = Commit::new(r.lease().unwrap(), later, Some(WorkResult::Completed));
        c.steps = vec![step];
        c.reason = Some("=HYPERLINK(\"http://evil\")".into());
        c.attempts = vec![NewAttempt {
            step: "enrich".into(),
            provider: Some("p".into()),
            attempt_no: 1,
            node: None,
            started_at: later,
            duration_ms: 5,
            http_status: Some(200),
            outcome: Outcome::Success,
            error_code: None,
            excerpt: Some("{\"ok\":true}".into()),
            request: None,
        }];
        app.t.db.commit(&c).await.unwrap();
    }
    let token = app.token(Role::Operator).await;
    // In clear (the records' pipeline is not configured here: an export
    // would mask them whole, `sensitive::*`).
    let get = |path: &str| {
        let join = if path.contains('?') { '&' } else { '?' };
        let path = format!("{path}{join}unmasked=1&reason=test");
        app.client.get(app.url(&path)).bearer_auth(&token).send()
    };
    let r = get("/api/v1/records/export").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    assert!(
        r.headers()["content-disposition"]
            .to_str()
            .unwrap()
            .starts_with("attachment; filename=\"ballast-records-")
    );
    let text = r.text().await.unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), n);
    let ids: Vec<i64> = lines
        .iter()
        .map(|l| l["record"]["id"].as_i64().unwrap())
        .collect();
    assert!(
        ids.windows(2).all(|w| w[0] > w[1]),
        "newest first, each once"
    );
    let finished: Vec<&Value> = lines
        .iter()
        .filter(|l| l["record"]["state"] == "succeeded")
        .collect();
    assert_eq!(finished.len(), 3);
    for l in &finished {
        assert_eq!(l["steps"][0]["output"]["note"], "=1+1");
        assert!(l.get("attempts").is_none());
    }
    // Filtered, with attempts, as CSV.
    let r = get("/api/v1/records/export?state=succeeded&format=csv&attempts=1")
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/csv; charset=utf-8");
    let csv = r.text().await.unwrap();
    let rows: Vec<&str> = csv.split_terminator("\r\n").collect();
    assert_eq!(rows.len(), 4, "{csv}");
    assert!(
        rows[0].starts_with("id,pipeline,pipeline_version,external_key,"),
        "{}",
        rows[0]
    );
    for row in &rows[1..] {
        assert!(row.contains(",succeeded,"), "{row}");
        assert!(
            row.contains("\"'=HYPERLINK(\"\"http://evil\"\")\""),
            "{row}"
        );
        assert!(row.contains("\"\"note\"\":\"\"=1+1\"\""), "{row}");
        assert!(row.contains("\"\"outcome\"\":\"\"success\"\""), "{row}");
    }
    let jsonl = get("/api/v1/records/export?state=succeeded&attempts=1")
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for l in jsonl.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["attempts"].as_array().unwrap().len(), 1);
    }
    // A key prefix selects; nothing selected is an empty file.
    let some = get("/api/v1/records/export?q=e-119")
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(some.lines().count(), 11, "e-119 and e-1190..e-1199: {some}");
    let none = get("/api/v1/records/export?pipeline=nothing&format=csv")
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(none.split_terminator("\r\n").count(), 1);
    let bad = get("/api/v1/records/export?format=xml").await.unwrap();
    assert_eq!(bad.status(), 400);
    let body: Value = bad.json().await.unwrap();
    assert_eq!(body["error"], "bad_format");
    // Each export is in the audit log, with its filter.
    let audit = app
        .t
        .db
        .audit_log(&ballast::store::AuditFilter {
            kind: Some("export".into()),
            limit: 50,
            ..Default::default()
        })
        .await
        .unwrap()
        .items;
    assert_eq!(audit.len(), 5, "{audit:?}");
    assert!(
        audit
            .iter()
            .any(|e| e.detail.as_ref().unwrap()["filter"] == "state=succeeded")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_export_streams_every_selected_record() {
    export_streams_every_selected_record(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_export_streams_every_selected_record() {
    export_streams_every_selected_record(Backend::Postgres).await;
}

/// The header's search box: a record named by its id, its key or a
/// provider's job id opens at once; a key two pipelines share lists both;
/// nothing found says so; an empty query is the records list.
async fn the_search_box_finds_a_record_by_id_key_or_job_id(backend: Backend) {
    use ballast::domain::StepState;
    use ballast::store::{ClaimRequest, Commit, StepWrite};
    let Some(app) = WebApp::spawn(
        backend,
        "search",
        "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\n",
    )
    .await
    else {
        return;
    };
    app.user("vera", Role::Viewer).await;
    let login = app.login("vera").await;
    let a = app.record("lead-1").await;
    let other = app.record("lead-2").await;
    // The same key in another pipeline.
    let now = crate::helpers::wall_ms();
    let twin = app
        .t
        .db
        .create_record(
            NewRecord {
                pipeline: "second".into(),
                group: None,
                priority: ballast::domain::DEFAULT_PRIORITY,
                pipeline_version: None,
                external_key: Some("lead-2".into()),
                input: json!({}),
                run_at: now + 3_600_000,
            },
            now,
        )
        .await
        .unwrap()
        .record
        .id;
    // A job at provider `p` for `a`.
    let claim = ClaimRequest {
        owner: "w".into(),
        now: now + 3_600_000,
        lease: Duration::from_secs(30),
        limit: 1,
        group_caps: Vec::new(),
    };
    // Whichever record the claim takes gets the job.
    let r = app.t.db.claim_due(&claim).await.unwrap().remove(0);
    let jobbed = r.id;
    let mut step = StepWrite::pending("render");
    step.provider = Some("p".into());
    step.state = StepState::Waiting;
    step.job_id = Some("job-7f3a".into());
    let mut c = Commit::new(r.lease().unwrap(), now + 3_600_000, None);
    c.next_run_at = Some(now + 7_200_000);
    c.steps = vec![step];
    app.t.db.commit(&c).await.unwrap();
    let go = |q: &str| {
        let path = format!("/search?q={}", q.replace('#', "%23").replace('+', "%2B"));
        let login = &login;
        let app = &app;
        async move { app.get(&path, Some(login)).await }
    };
    for (q, id) in [
        (a.to_string(), a),
        (format!("#{a}"), a),
        ("lead-1".to_string(), a),
        ("job-7f3a".to_string(), jobbed),
        (format!(" {other} "), other),
    ] {
        let r = go(&q).await;
        assert_eq!(r.status(), 303, "{q}");
        assert_eq!(r.headers()["location"], format!("/records/{id}"), "{q}");
    }
    let both = go("lead-2").await;
    assert_eq!(both.status(), 200);
    let page = both.text().await.unwrap();
    assert!(
        page.contains(&format!("href=\"/records/{other}\""))
            && page.contains(&format!("href=\"/records/{twin}\"")),
        "{page}"
    );
    // Not numbers: a sign, or a `#` twice.
    for q in ["+1", "##1"] {
        assert_eq!(go(q).await.status(), 200, "{q}");
    }
    let none = go("nothing-like-it").await.text().await.unwrap();
    assert!(
        none.contains("No record holds those words, and none has that id, key or job id."),
        "{none}"
    );
    // Words: once indexed, the records holding them, newest first (`lead`
    // is no record's key, and in each one's key or input).
    app.t
        .db
        .index_records(&[a, other, twin], &[], 0)
        .await
        .unwrap();
    let worded = go("lead").await.text().await.unwrap();
    let at = |id: i64| {
        worded
            .find(&format!("href=\"/records/{id}\""))
            .unwrap_or_else(|| panic!("{id} listed: {worded}"))
    };
    assert!(at(twin) < at(other) && at(other) < at(a), "{worded}");
    let empty = go("").await;
    assert_eq!(empty.status(), 303);
    assert_eq!(empty.headers()["location"], "/records");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_search_box_finds_a_record_by_id_key_or_job_id() {
    the_search_box_finds_a_record_by_id_key_or_job_id(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_search_box_finds_a_record_by_id_key_or_job_id() {
    the_search_box_finds_a_record_by_id_key_or_job_id(Backend::Postgres).await;
}

/// Issue 20 item 3: the records page (and the API's list) takes a
/// created and an updated date range; a bare date as the end takes in
/// that whole day; a date it cannot read is a clear error.
async fn the_records_list_filters_by_created_and_updated_dates(backend: Backend) {
    let Some(app) = WebApp::spawn(backend, "dates", "").await else {
        return;
    };
    app.user("vera", Role::Viewer).await;
    let login = app.login("vera").await;
    // 2026-11-28, 2026-11-30 and 2026-12-01, at noon UTC.
    let day = 86_400_000;
    let noon = |d: i64| 1_795_867_200_000 + d * day;
    let mut ids = Vec::new();
    for (key, created) in [("d-28", noon(0)), ("d-30", noon(2)), ("d-01", noon(3))] {
        let new = NewRecord {
            pipeline: "manual".into(),
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            pipeline_version: None,
            external_key: Some(key.into()),
            input: json!({}),
            run_at: created + 3_600_000,
        };
        ids.push(
            app.t
                .db
                .create_record(new, created)
                .await
                .unwrap()
                .record
                .id,
        );
    }
    let (d28, d30, d01) = (ids[0], ids[1], ids[2]);
    let listed = async |query: &str| -> Vec<i64> {
        let r = app.get(&format!("/records?{query}"), Some(&login)).await;
        assert_eq!(r.status(), 200, "{query}");
        let page = r.text().await.unwrap();
        ids.iter()
            .copied()
            .filter(|id| page.contains(&format!("href=\"/records/{id}\"")))
            .collect()
    };
    assert_eq!(listed("created_from=2026-11-30").await, vec![d30, d01]);
    assert_eq!(
        listed("created_to=2026-11-30").await,
        vec![d28, d30],
        "the whole day"
    );
    assert_eq!(
        listed("created_from=2026-11-29&created_to=2026-11-30T12:00").await,
        Vec::<i64>::new(),
        "the end itself is not in"
    );
    assert_eq!(
        listed("created_from=2026-11-30T11:59Z&created_to=2026-11-30T12:01").await,
        vec![d30]
    );
    assert_eq!(
        listed("updated_from=2026-12-01&state=pending").await,
        vec![d01]
    );
    assert_eq!(listed("updated_to=2026-11-27").await, Vec::<i64>::new());
    for (query, says) in [
        ("created_from=yesterday", "created_from"),
        (
            "updated_from=2026-12-02&updated_to=2026-12-01",
            "before `updated_to`",
        ),
    ] {
        let bad = app.get(&format!("/records?{query}"), Some(&login)).await;
        assert_eq!(bad.status(), 400, "{query}");
        let text = bad.text().await.unwrap();
        assert!(text.contains(says), "{query}: {text}");
    }
    // The list's links carry the range (the next page, the exports).
    let page = app
        .get("/records?created_from=2026-11-30", Some(&login))
        .await
        .text()
        .await
        .unwrap();
    assert!(page.contains("created_from=2026-11-30"), "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_records_list_filters_by_created_and_updated_dates() {
    the_records_list_filters_by_created_and_updated_dates(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_records_list_filters_by_created_and_updated_dates() {
    the_records_list_filters_by_created_and_updated_dates(Backend::Postgres).await;
}

/// Issue 21 item 6, first part: every page links a favicon (served from
/// the binary), and the stylesheet carries a dark scheme for systems that
/// ask for one and print styles for a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_have_a_favicon_a_dark_scheme_and_print_styles() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "favicon", "").await else {
        return;
    };
    app.user("v", Role::Viewer).await;
    let login = app.login("v").await;
    for page in [
        app.get("/login", None).await,
        app.get("/records", Some(&login)).await,
    ] {
        let html = page.text().await.unwrap();
        assert!(
            html.contains(r#"<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">"#),
            "{html}"
        );
    }
    let icon = app.get("/static/favicon.svg", None).await;
    assert_eq!(icon.status(), 200);
    assert_eq!(icon.headers()["content-type"], "image/svg+xml");
    assert!(icon.text().await.unwrap().starts_with("<svg"));
    let css = app.get("/static/app.css", None).await.text().await.unwrap();
    assert!(css.contains("@media screen and (prefers-color-scheme: dark)"));
    assert!(
        css.contains(":root[data-theme=dark]"),
        "a user's choice too"
    );
    assert!(css.contains("@media print"));
    app.stop().await;
}

/// Issue 21 item 6: the colour scheme a user picks is kept with the user
/// (a new login, another browser, has it) and set on every page's root;
/// "system" clears it; anything else is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_colour_scheme_follows_them() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "theme", "").await else {
        return;
    };
    app.user("v", Role::Viewer).await;
    app.user("w", Role::Viewer).await;
    let login = app.login("v").await;
    let page = app.text("/records", Some(&login)).await;
    assert!(
        page.contains(r#"<html lang="en">"#),
        "none chosen: the system's"
    );
    assert!(page.contains(r#"name="theme" value="dark""#));
    let set = |theme: &'static str| {
        let login = login.clone();
        let app = &app;
        async move {
            app.client
                .post(app.url("/me/theme"))
                .header("origin", app.origin())
                .header("referer", app.url("/records?state=parked"))
                .header("cookie", &login.cookie)
                .header("x-csrf-token", &login.csrf)
                .form(&[("theme", theme)])
                .send()
                .await
                .unwrap()
        }
    };
    let r = set("dark").await;
    assert_eq!(r.status(), 303);
    assert_eq!(
        r.headers()["location"],
        "/records?state=parked",
        "back where it was"
    );
    let again = app.login("v").await;
    for l in [&login, &again] {
        let page = app.text("/audit", Some(l)).await;
        assert!(
            page.contains(r#"<html lang="en" data-theme="dark">"#),
            "{page}"
        );
        assert!(page.contains(r#"name="theme" value="light""#));
    }
    let other = app.login("w").await;
    let page = app.text("/audit", Some(&other)).await;
    assert!(
        page.contains(r#"<html lang="en">"#),
        "another user's is their own"
    );
    assert_eq!(set("purple").await.status(), 400);
    assert_eq!(set("light").await.status(), 303);
    let page = app.text("/", Some(&login)).await;
    assert!(page.contains(r#"data-theme="light""#));
    assert_eq!(set("system").await.status(), 303);
    let page = app.text("/", Some(&login)).await;
    assert!(!page.contains("data-theme"));
    let user = app.t.db.user_by_name("v").await.unwrap().unwrap();
    assert_eq!(user.theme, None);
    // The login page, before anyone is known, follows the system.
    let page = app.text("/login", None).await;
    assert!(!page.contains("data-theme"));
    app.stop().await;
}

/// Issue 24 item 5: the overview names the configuration this node runs,
/// and says when the live nodes do not all run the same one (a node from
/// before migration 18, which says none, is left out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_says_when_nodes_run_different_configurations() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "config_split", "").await else {
        return;
    };
    app.user("v", Role::Viewer).await;
    let login = app.login("v").await;
    let beat = |id: &str, version: Option<&str>| ballast::store::NodeBeat {
        config_version: version.map(str::to_owned),
        ..ballast::store::NodeBeat::this_process(id, crate::helpers::wall_ms())
    };
    let db = app.t.db.clone();
    db.heartbeat(&beat("old-node", None), crate::helpers::wall_ms())
        .await
        .unwrap();
    // This node's own beat says its version.
    let page = crate::helpers::poll_until("this node's beat", Duration::from_secs(30), || async {
        let page = app.text("/", Some(&login)).await;
        page.contains("2 live node(s)").then_some(page)
    })
    .await;
    let ours = page
        .split(r#"<code id="config-version">"#)
        .nth(1)
        .and_then(|rest| rest.split('<').next())
        .unwrap()
        .to_owned();
    assert_eq!(ours.len(), 12, "{ours}");
    assert!(
        !page.contains("config-split"),
        "one version said: no warning"
    );
    db.heartbeat(
        &beat("other", Some("0123456789ab")),
        crate::helpers::wall_ms(),
    )
    .await
    .unwrap();
    let page = app.text("/", Some(&login)).await;
    assert!(page.contains(r#"id="config-split""#), "{page}");
    assert!(
        page.contains("other runs <code>0123456789ab</code>"),
        "{page}"
    );
    assert!(
        page.contains(&format!("runs <code>{ours}</code>")),
        "{page}"
    );
    assert!(!page.contains("old-node runs"), "{page}");
    db.heartbeat(&beat("other", Some(&ours)), crate::helpers::wall_ms())
        .await
        .unwrap();
    let page = app.text("/", Some(&login)).await;
    assert!(!page.contains("config-split"), "the same again");
    app.stop().await;
}

/// Issue 24 item 5: a record pinned to an older version of its pipeline
/// says so on its page, whose replay offers the current version; ticked,
/// the replay runs the current version's steps and the record is pinned
/// to it, the audit entry keeping both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_on_the_page_may_move_a_record_to_the_current_version() {
    let text = crate::engine::single_step_toml("http://127.0.0.1:9", "");
    let Some(app) = WebApp::spawn(Backend::Sqlite, "replay_current", &text).await else {
        return;
    };
    app.user("op", Role::Operator).await;
    let login = app.login("op").await;
    let db = app.t.db.clone();
    let now = crate::helpers::wall_ms();
    let current = db.pipeline_versions(Some("pay"), 5).await.unwrap();
    assert_eq!(current.len(), 1, "pinned at start");
    let (current, definition) = (current[0].id, current[0].definition.clone());
    let old = db
        .pin_pipeline("pay", "an-older-hash", &definition, now)
        .await
        .unwrap();
    let created = db
        .create_records(
            vec![NewRecord {
                pipeline: "pay".into(),
                pipeline_version: Some(old),
                external_key: Some("old-1".into()),
                group: None,
                priority: ballast::domain::DEFAULT_PRIORITY,
                input: json!({}),
                run_at: now + 86_400_000,
            }],
            now,
        )
        .await
        .unwrap();
    let id = created[0].record.id;
    let cancel = ActionRequest {
        record_id: id,
        action: OperatorAction::Cancel,
        actor: "test".into(),
        reason: None,
        now,
        steps: Vec::new(),
        until: None,
        took: None,
        input: None,
        repin: None,
        failed_items: false,
        signal: None,
    };
    db.act(&cancel).await.unwrap();
    let page = app.text(&format!("/records/{id}"), Some(&login)).await;
    assert!(
        page.contains(&format!(
            "version {old} (new records get version {current})"
        )),
        "{page}"
    );
    assert!(page.contains(r#"name="on_current""#), "{page}");
    let list = app.text("/pipelines", Some(&login)).await;
    assert!(list.contains(&format!(r#"data-version="{current}" class="current""#)));
    assert!(
        list.contains(&format!(r#"data-version="{old}">"#)),
        "{list}"
    );
    let r = app
        .post(
            &format!("/records/{id}/actions"),
            Some(&login),
            &[
                ("action", "replay"),
                ("step", "charge"),
                ("on_current", "on"),
                ("reason", "onto the current version"),
            ],
        )
        .await;
    assert_eq!(r.status(), 303, "{:?}", r.text().await);
    let rec = db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.pipeline_version, Some(current));
    let events = db.record_events(id).await.unwrap();
    let replay = events.iter().find(|e| e.kind == "replay").expect("audited");
    assert_eq!(
        replay.detail.as_ref().unwrap()["version"],
        json!({ "from": old, "to": current })
    );
    let page = app.text(&format!("/records/{id}"), Some(&login)).await;
    assert!(page.contains(&format!("version {current} (current)")));
    assert!(
        !page.contains(r#"name="on_current""#),
        "nothing newer to offer"
    );
    app.stop().await;
}
