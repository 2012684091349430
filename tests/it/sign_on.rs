//! Single sign-on against a real OpenID provider: panva's `oidc-provider`
//! (tests/oidc), run by each test on a port of its own, its development
//! login form filled in by a cookie-keeping client as a browser would.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use ballast::domain::{ManualClock, Role};
use reqwest::StatusCode;
use std::io::BufRead;

use ballast::store::Backend;

use crate::helpers::{TestDb, in_ci, wall_ms};
use crate::web::{WebApp, session_cookie};

const CLIENT_SECRET: &str = "a-test-client-secret-0123456789";

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/oidc")
}

/// Installs the provider's packages once per run (from the lock file).
async fn installed() -> bool {
    static DONE: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();
    *DONE
        .get_or_init(|| async {
            let node = std::process::Command::new("node")
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if !node {
                assert!(!in_ci(), "CI machines have Node.js");
                crate::helpers::skip("Node.js is not installed here");
                return false;
            }
            if dir().join("node_modules/oidc-provider").exists() {
                return true;
            }
            let npm = || {
                std::process::Command::new("npm")
                    .args(["ci", "--no-audit", "--no-fund"])
                    .current_dir(dir())
                    .status()
                    .is_ok_and(|s| s.success())
            };
            let ok = tokio::task::spawn_blocking(npm).await.unwrap();
            assert!(ok || !in_ci(), "npm ci in tests/oidc failed");
            if !ok {
                crate::helpers::skip("cannot install tests/oidc's packages (npm ci failed)");
            }
            ok
        })
        .await
}

/// The provider, stopped when dropped. Its accounts' groups are read from
/// a file at each sign-in, so a test can change them.
pub struct Provider {
    pub issuer: String,
    accounts: tempfile::NamedTempFile,
    child: std::process::Child,
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Provider {
    async fn start(accounts: serde_json::Value) -> Option<Provider> {
        Self::start_on("127.0.0.1", accounts).await
    }

    /// The provider, its issuer on `host` (which resolves to 127.0.0.1).
    pub async fn start_on(host: &str, accounts: serde_json::Value) -> Option<Provider> {
        if !installed().await {
            return None;
        }
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), accounts.to_string()).unwrap();
        let mut child = std::process::Command::new("node")
            .arg("provider.mjs")
            .current_dir(dir())
            .env("OIDC_CLIENT_SECRET", CLIENT_SECRET)
            .env("OIDC_ACCOUNTS_FILE", file.path())
            .env("OIDC_HOST", host)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("node starts");
        let stdout = child.stdout.take().unwrap();
        // The first line, once it serves (or nothing, if it died first).
        let read = move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map(|_| line)
        };
        let line = tokio::time::timeout(Duration::from_secs(60), tokio::task::spawn_blocking(read))
            .await
            .expect("the provider says where it listens within a minute")
            .unwrap()
            .unwrap();
        let said: serde_json::Value = serde_json::from_str(&line).unwrap();
        Some(Provider {
            issuer: said["issuer"].as_str().unwrap().to_owned(),
            accounts: file,
            child,
        })
    }

    fn set_groups(&self, accounts: serde_json::Value) {
        std::fs::write(self.accounts.path(), accounts.to_string()).unwrap();
    }
}

/// Ballast's `[oidc]` for `issuer`, its callback on the test server's
/// address.
pub fn settings(issuer: &str, more: &str) -> String {
    format!(
        r#"
[oidc]
issuer = "{issuer}"
client_id = "ballast"
redirect_url = "http://@ADDR@/auth/oidc/callback"
scopes = ["profile", "groups"]
{more}
[[oidc.roles]]
group = "ops"
role = "operator"
[[oidc.roles]]
group = "support-a"
role = "viewer"
pipelines = ["a"]
[[oidc.roles]]
group = "admins"
role = "admin"
"#
    )
}

pub fn with_secret(c: &mut ballast::config::Config) {
    c.oidc.as_mut().unwrap().client_secret = Some(ballast::config::Secret::new(CLIENT_SECRET));
}

async fn app(backend: Backend, test: &str, issuer: &str, more: &str) -> Option<WebApp> {
    let t = TestDb::new(backend, test).await?;
    Some(WebApp::spawn_edited(t, &settings(issuer, more), true, with_secret).await)
}

/// A provider with `accounts` and a Ballast on SQLite signing on with it
/// (`more` added to its `[oidc]`).
async fn both(accounts: serde_json::Value, test: &str, more: &str) -> Option<(Provider, WebApp)> {
    let idp = Provider::start(accounts).await?;
    let app = app(Backend::Sqlite, test, &idp.issuer, more).await?;
    Some((idp, app))
}

/// `login` signs in at `app` in a new browser, through to Ballast's
/// answer to the provider's.
async fn sign_in(app: &WebApp, login: &str) -> (Browser, reqwest::Response) {
    let mut browser = Browser::default();
    let back = browser.sign_in_until_back(app, login, &|u| u).await;
    let r = browser.send(&back, None).await;
    (browser, r)
}

/// A browser's cookies, by host and port and name (paths ignored: the
/// provider's cookies have names of their own).
#[derive(Default)]
struct Jar(HashMap<String, HashMap<String, String>>);

impl Jar {
    fn host(url: &reqwest::Url) -> String {
        format!("{}:{:?}", url.host_str().unwrap_or_default(), url.port())
    }

    fn keep(&mut self, url: &reqwest::Url, r: &reqwest::Response) {
        let jar = self.0.entry(Self::host(url)).or_default();
        for v in r.headers().get_all("set-cookie") {
            let v = v.to_str().unwrap();
            let pair = v.split(';').next().unwrap();
            let (name, value) = pair.split_once('=').unwrap();
            let gone = value.is_empty()
                || v.to_ascii_lowercase().contains("max-age=0")
                || v.contains("1970");
            match gone {
                true => jar.remove(name),
                false => jar.insert(name.to_owned(), value.to_owned()),
            };
        }
    }

    fn header(&self, url: &reqwest::Url) -> String {
        self.0
            .get(&Self::host(url))
            .map(|c| {
                c.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            })
            .unwrap_or_default()
    }
}

/// One browser: a client that follows nothing by itself, and its cookies.
#[derive(Default)]
struct Browser {
    jar: Jar,
}

impl Browser {
    async fn send(&mut self, url: &str, form: Option<&[(&str, &str)]>) -> reqwest::Response {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let parsed = reqwest::Url::parse(url).unwrap();
        let req = match form {
            Some(f) => client.post(url).form(f),
            None => client.get(url),
        };
        let r = req
            .header("cookie", self.jar.header(&parsed))
            .send()
            .await
            .unwrap();
        self.jar.keep(&parsed, &r);
        r
    }

    /// Starts a sign-in at `app` and goes through the provider's login
    /// form as `login` (and its consent), up to the provider's answer: the
    /// callback URL, not yet visited. `edit` may change the authorization
    /// request on its way to the provider.
    async fn sign_in_until_back(
        &mut self,
        app: &WebApp,
        login: &str,
        edit: &dyn Fn(String) -> String,
    ) -> String {
        let r = self
            .send(&app.url("/auth/oidc/start?next=/records"), None)
            .await;
        assert_eq!(r.status(), StatusCode::SEE_OTHER, "{:?}", r.text().await);
        let mut at = edit(location(&r));
        for _ in 0..10 {
            if at.starts_with(&app.origin()) {
                return at;
            }
            let r = self.send(&at, None).await;
            if r.status().is_redirection() {
                at = absolute(&at, &location(&r));
                continue;
            }
            assert_eq!(r.status(), StatusCode::OK, "{at}");
            let page = r.text().await.unwrap();
            let form: &[(&str, &str)] = if page.contains(r#"value="login""#) {
                &[("prompt", "login"), ("login", login), ("password", "any")]
            } else if page.contains(r#"value="consent""#) {
                &[("prompt", "consent")]
            } else {
                panic!("an unexpected page at {at}: {page}");
            };
            let r = self.send(&at, Some(form)).await;
            assert!(r.status().is_redirection(), "{at}: {}", r.status());
            at = absolute(&at, &location(&r));
        }
        panic!("the provider never sent the browser back");
    }
}

/// `url` without its `iss` parameter.
fn without_iss(url: &str) -> String {
    let mut url = reqwest::Url::parse(url).unwrap();
    let kept: Vec<(String, String)> = url
        .query_pairs()
        .filter(|(k, _)| k != "iss")
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    url.query_pairs_mut().clear().extend_pairs(kept);
    url.into()
}

fn location(r: &reqwest::Response) -> String {
    r.headers()["location"].to_str().unwrap().to_owned()
}

fn absolute(base: &str, to: &str) -> String {
    reqwest::Url::parse(base).unwrap().join(to).unwrap().into()
}

/// The audit entries of `kind`, newest first.
async fn audited(app: &WebApp, kind: &str) -> Vec<serde_json::Value> {
    let events = app
        .t
        .db
        .audit_log(&ballast::store::AuditFilter {
            kind: Some(kind.into()),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    events.items.into_iter().filter_map(|e| e.detail).collect()
}

async fn sign_on_creates_users_from_their_groups(backend: Backend) {
    let Some(idp) = Provider::start(serde_json::json!({ "alice": ["support-a", "other"] })).await
    else {
        return;
    };
    let Some(app) = app(backend, "sign_on_users", &idp.issuer, "").await else {
        return;
    };
    let mut browser = Browser::default();
    let back = browser.sign_in_until_back(&app, "alice", &|u| u).await;
    assert!(
        back.contains("iss="),
        "the provider names itself (RFC 9207): {back}"
    );
    let r = browser.send(&back, None).await;
    assert_eq!(r.status(), StatusCode::OK);
    let cookie = session_cookie(r.headers()).expect("a session");
    let page = r.text().await.unwrap();
    assert!(
        page.contains(r#"http-equiv="refresh" content="0; url=/records""#),
        "{page}"
    );
    let alice = app
        .t
        .db
        .user_by_name("alice")
        .await
        .unwrap()
        .expect("alice was made");
    assert!(alice.signs_on && !alice.disabled);
    assert_eq!(alice.role, Role::Viewer);
    assert_eq!(alice.pipelines.patterns(), ["a"]);
    assert!(
        alice.password_hash.starts_with('!'),
        "no password logs her in"
    );
    let home = app
        .client
        .get(app.url("/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(home.status(), StatusCode::OK);
    assert!(home.text().await.unwrap().contains("alice"));
    let added = audited(&app, "user_added").await;
    assert!(
        added
            .iter()
            .any(|d| d["user"] == "alice" && d["issuer"] == idp.issuer.as_str()),
        "{added:?}"
    );
    let r = app.try_login("alice", "any").await;
    assert_eq!(
        r.status(),
        StatusCode::UNAUTHORIZED,
        "her password is the provider's"
    );

    // Her groups change at the provider: the next sign-in follows them and
    // ends her other sessions.
    idp.set_groups(serde_json::json!({ "alice": ["ops"] }));
    let mut second = Browser::default();
    let back = second.sign_in_until_back(&app, "alice", &|u| u).await;
    assert_eq!(second.send(&back, None).await.status(), StatusCode::OK);
    let alice = app.t.db.user_by_name("alice").await.unwrap().unwrap();
    assert_eq!(
        (alice.role, alice.pipelines.is_all()),
        (Role::Operator, true)
    );
    let old = app
        .client
        .get(app.url("/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        old.status(),
        StatusCode::SEE_OTHER,
        "the old session ended with the change"
    );
    let changed = audited(&app, "user_changed").await;
    assert!(
        changed
            .iter()
            .any(|d| d["user"] == "alice" && d["role"] == "operator"),
        "{changed:?}"
    );

    // Disabled in Ballast: the provider's word does not bring her back.
    let change = ballast::store::UserChange::Disabled(true);
    app.t
        .db
        .update_user(alice.id, &change, wall_ms())
        .await
        .unwrap();
    let mut third = Browser::default();
    let back = third.sign_in_until_back(&app, "alice", &|u| u).await;
    let r = third.send(&back, None).await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(session_cookie(r.headers()).is_none_or(|c| c.ends_with('=')));
    let refused = audited(&app, "sign_on_refused").await;
    assert!(
        refused
            .iter()
            .any(|d| d["reason"] == "the user is disabled"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn sqlite_sign_on_creates_users_from_their_groups() {
    sign_on_creates_users_from_their_groups(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_sign_on_creates_users_from_their_groups() {
    sign_on_creates_users_from_their_groups(Backend::Postgres).await;
}

/// A token `user` made, as the tokens page would: its id.
async fn token_of(app: &WebApp, user: &str) -> i64 {
    let (_, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
    let t = ballast::store::NewApiToken {
        name: format!("{user}'s"),
        token_hash: hash,
        prefix,
        role: Role::Admin,
        created_by: user.to_owned(),
        actor: user.into(),
        expires_at: None,
        pipelines: ballast::domain::scope::Scope::all(),
        unmask: false,
    };
    app.t.db.create_api_token(&t, wall_ms()).await.unwrap().id
}

async fn token_revoked(app: &WebApp, id: i64) -> bool {
    let tokens = app.t.db.list_api_tokens().await.unwrap();
    tokens
        .iter()
        .find(|t| t.id == id)
        .unwrap()
        .revoked_at
        .is_some()
}

#[tokio::test]
async fn access_taken_away_at_the_provider_ends_here_but_never_the_last_admin() {
    let accounts = serde_json::json!({ "dana": ["admins"], "carol": ["ops"] });
    let Some((idp, app)) = both(accounts, "sign_on_taken_away", "").await else {
        return;
    };
    let (_, r) = sign_in(&app, "dana").await;
    let dana_session = session_cookie(r.headers()).unwrap();
    let dana = app.t.db.user_by_name("dana").await.unwrap().unwrap();
    assert_eq!(dana.role, Role::Admin);
    let token = token_of(&app, "dana").await;
    // A password for her is refused: she signs on.
    let hash = ballast::auth::password::hash("a-long-enough-password").unwrap();
    let change = ballast::store::UserChange::Password(hash);
    let err = app
        .t
        .db
        .update_user(dana.id, &change, wall_ms())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("signs on"), "{err}");

    // Her groups now grant nothing: refused, and her session and the
    // tokens she made end with it.
    idp.set_groups(serde_json::json!({ "dana": ["marketing"] }));
    let (_, r) = sign_in(&app, "dana").await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let home = app
        .client
        .get(app.url("/"))
        .header("cookie", &dana_session)
        .send()
        .await
        .unwrap();
    assert_eq!(home.status(), StatusCode::SEE_OTHER, "her session ended");
    assert!(token_revoked(&app, token).await, "her token was revoked");
    let dana = app.t.db.user_by_name("dana").await.unwrap().unwrap();
    assert!(
        dana.role == Role::Viewer && dana.pipelines.is_none(),
        "{dana:?}"
    );
    let changed = audited(&app, "user_changed").await;
    assert!(
        changed
            .iter()
            .any(|d| d["user"] == "dana" && d["pipelines"] == "none"),
        "{changed:?}"
    );

    // The last enabled admin stays one whatever the provider says.
    idp.set_groups(serde_json::json!({ "dana": ["admins"] }));
    assert_eq!(sign_in(&app, "dana").await.1.status(), StatusCode::OK);
    let admin = app.t.db.user_by_name("admin").await.unwrap().unwrap();
    let off = ballast::store::UserChange::Disabled(true);
    app.t
        .db
        .update_user(admin.id, &off, wall_ms())
        .await
        .unwrap();
    idp.set_groups(serde_json::json!({ "dana": ["ops"], "carol": ["ops"] }));
    let (_, r) = sign_in(&app, "dana").await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(r.text().await.unwrap().contains("last enabled admin"));
    let dana = app.t.db.user_by_name("dana").await.unwrap().unwrap();
    assert_eq!(dana.role, Role::Admin);
    // Nor does losing every group take the last admin's role.
    idp.set_groups(serde_json::json!({ "dana": ["marketing"], "carol": ["ops"] }));
    let (_, r) = sign_in(&app, "dana").await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let dana = app.t.db.user_by_name("dana").await.unwrap().unwrap();
    assert_eq!(dana.role, Role::Admin);
    let refused = audited(&app, "sign_on_refused").await;
    assert!(
        refused[0]["reason"]
            .as_str()
            .unwrap()
            .contains("last enabled admin"),
        "{refused:?}"
    );

    // A person whose name a local user has gets another: people are known
    // by issuer and subject.
    app.user("carol", Role::Viewer).await;
    let (_, r) = sign_in(&app, "carol").await;
    assert_eq!(r.status(), StatusCode::OK);
    let carol2 = app
        .t
        .db
        .user_by_name("carol-2")
        .await
        .unwrap()
        .expect("carol-2");
    assert!(carol2.signs_on && carol2.role == Role::Operator);
    let local = app.t.db.user_by_name("carol").await.unwrap().unwrap();
    assert!(
        !local.signs_on && local.role == Role::Viewer,
        "the local carol is untouched"
    );
    assert_eq!(sign_in(&app, "carol").await.1.status(), StatusCode::OK);
    assert!(
        app.t.db.user_by_name("carol-3").await.unwrap().is_none(),
        "found again, not made again"
    );
}

#[tokio::test]
async fn sign_on_refuses_a_replayed_state_and_a_foreign_browser() {
    let Some((_idp, app)) = both(
        serde_json::json!({ "alice": ["ops"] }),
        "sign_on_replay",
        "",
    )
    .await
    else {
        return;
    };
    let mut browser = Browser::default();
    let back = browser.sign_in_until_back(&app, "alice", &|u| u).await;
    let held = browser
        .jar
        .header(&reqwest::Url::parse(&app.url("/")).unwrap());
    // Another browser (no state cookie) bringing the answer is refused,
    // and the sign-in stays for its own browser.
    let r = Browser::default().send(&back, None).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("did not start in this browser")
    );
    let r = browser.send(&back, None).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(session_cookie(r.headers()).is_some());
    // The same answer again, with the same cookie: the state was taken.
    let again = app
        .client
        .get(&back)
        .header("cookie", &held)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::BAD_REQUEST);
    assert!(session_cookie(again.headers()).is_none());
    assert!(again.text().await.unwrap().contains("used already"));
    let refused = audited(&app, "sign_on_refused").await;
    assert_eq!(
        refused.len(),
        1,
        "the replay, not the foreign browser: {refused:?}"
    );
    // An answer without the `iss` the provider says it sends.
    let mut browser = Browser::default();
    let back = browser.sign_in_until_back(&app, "alice", &|u| u).await;
    let r = browser.send(&without_iss(&back), None).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(r.text().await.unwrap().contains("does not name its issuer"));
    assert!(refused[0]["reason"].as_str().unwrap().contains("replayed"));
}

#[tokio::test]
async fn sign_on_refuses_a_nonce_that_is_not_the_sign_ins() {
    let Some((_idp, app)) =
        both(serde_json::json!({ "alice": ["ops"] }), "sign_on_nonce", "").await
    else {
        return;
    };
    let mut browser = Browser::default();
    // The authorization request leaves with another nonce: the token the
    // provider mints carries it, as a token stolen from another sign-in
    // would carry that one's.
    let forge = |u: String| {
        let mut url = reqwest::Url::parse(&u).unwrap();
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| match k.as_ref() {
                "nonce" => (k.into_owned(), "a-nonce-of-another-sign-in".to_owned()),
                _ => (k.into_owned(), v.into_owned()),
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
        url.into()
    };
    let back = browser.sign_in_until_back(&app, "alice", &forge).await;
    let r = browser.send(&back, None).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(session_cookie(r.headers()).is_none());
    assert!(r.text().await.unwrap().contains("nonce"));
    assert!(app.t.db.user_by_name("alice").await.unwrap().is_none());
    let refused = audited(&app, "sign_on_refused").await;
    assert!(
        refused[0]["reason"].as_str().unwrap().contains("nonce"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn sign_on_refuses_an_expired_id_token() {
    let Some(idp) = Provider::start(serde_json::json!({ "alice": ["ops"] })).await else {
        return;
    };
    let Some(t) = TestDb::new(Backend::Sqlite, "sign_on_expired").await else {
        return;
    };
    let clock = ManualClock::new(wall_ms());
    let app =
        WebApp::spawn_clocked_edited(t, &settings(&idp.issuer, ""), &clock, with_secret).await;
    let mut browser = Browser::default();
    let back = browser.sign_in_until_back(&app, "alice", &|u| u).await;
    // The provider's ID tokens last a minute; three pass on Ballast's
    // clock before the answer arrives (the sign-in itself allows ten).
    clock.advance(3 * 60_000);
    let r = browser.send(&back, None).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(session_cookie(r.headers()).is_none());
    assert!(r.text().await.unwrap().contains("expired"));
    assert!(app.t.db.user_by_name("alice").await.unwrap().is_none());
}

#[tokio::test]
async fn sign_on_refuses_tokens_of_another_issuer() {
    let Some(idp) = Provider::start(serde_json::json!({ "alice": ["ops"] })).await else {
        return;
    };
    // A discovery document that claims another issuer (this server's)
    // while the tokens are the real provider's: what a mixed-up or
    // impersonating provider looks like.
    let real = idp.issuer.clone();
    let fake = crate::helpers::serve_router(axum::Router::new().route(
        "/.well-known/openid-configuration",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let real = real.clone();
            async move {
                let host = headers["host"].to_str().unwrap().to_owned();
                let url = format!("{real}/.well-known/openid-configuration");
                let mut doc: serde_json::Value =
                    reqwest::get(url).await.unwrap().json().await.unwrap();
                doc["issuer"] = format!("http://{host}").into();
                // As an impersonator would, lest its answers be refused
                // for lacking `iss` before the ID token is looked at.
                doc["authorization_response_iss_parameter_supported"] = false.into();
                axum::Json(doc)
            }
        }),
    ))
    .await;
    let Some(app) = app(Backend::Sqlite, "sign_on_issuer", &fake, "").await else {
        return;
    };
    let (_, r) = sign_in(&app, "alice").await;
    assert_eq!(
        r.status(),
        StatusCode::BAD_REQUEST,
        "the answer names its issuer"
    );
    assert!(r.text().await.unwrap().contains("not `http://"));
    // Without the answer's `iss`, the ID token's own issuer is caught.
    let mut browser = Browser::default();
    let back = browser.sign_in_until_back(&app, "alice", &|u| u).await;
    let r = browser.send(&without_iss(&back), None).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let page = r.text().await.unwrap();
    assert!(
        page.contains("ID token is not valid") && page.contains("issued by"),
        "{page}"
    );
    assert!(app.t.db.user_by_name("alice").await.unwrap().is_none());
    assert_eq!(audited(&app, "sign_on_refused").await.len(), 2);
}

#[tokio::test]
async fn sign_on_refuses_a_person_whose_groups_grant_nothing() {
    let Some((_idp, app)) = both(
        serde_json::json!({ "bob": ["marketing"] }),
        "sign_on_nothing",
        "",
    )
    .await
    else {
        return;
    };
    let (_, r) = sign_in(&app, "bob").await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(session_cookie(r.headers()).is_none());
    assert!(r.text().await.unwrap().contains("grant no access"));
    assert!(
        app.t.db.user_by_name("bob").await.unwrap().is_none(),
        "no user is made"
    );
    let refused = audited(&app, "sign_on_refused").await;
    assert_eq!(
        refused[0]["groups"],
        serde_json::json!(["marketing"]),
        "{refused:?}"
    );
    assert_eq!(refused[0]["user"], "bob");
}

#[tokio::test]
async fn sign_on_only_turns_passwords_off_and_logs_out_at_the_provider() {
    let Some(idp) = Provider::start(serde_json::json!({ "alice": ["ops"] })).await else {
        return;
    };
    let more = "local_passwords = false\nlogout_at_provider = true\nlabel = \"Acme ID\"";
    let Some(app) = app(Backend::Sqlite, "sign_on_only", &idp.issuer, more).await else {
        return;
    };
    let page = app
        .client
        .get(app.url("/login"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("Sign in with Acme ID") && page.contains("/auth/oidc/start?next=%2F"));
    assert!(
        !page.contains(r#"type="password""#),
        "no password form: {page}"
    );
    let r = app
        .try_login("admin", &crate::web::password_of("admin"))
        .await;
    assert_eq!(
        r.status(),
        StatusCode::FORBIDDEN,
        "the right password, refused"
    );
    assert!(session_cookie(r.headers()).is_none());

    let (_, r) = sign_in(&app, "alice").await;
    assert_eq!(r.status(), StatusCode::OK);
    let cookie = session_cookie(r.headers()).unwrap();
    let home = app
        .client
        .get(app.url("/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    let csrf = crate::web::csrf_in(&home.text().await.unwrap()).unwrap();
    let login = crate::web::Login {
        cookie: cookie.clone(),
        csrf,
    };
    let out = app.post("/logout", Some(&login), &[]).await;
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    let to = location(&out);
    assert!(
        to.starts_with(&format!("{}/session/end?", idp.issuer)),
        "{to}"
    );
    assert!(
        to.contains("post_logout_redirect_uri=http%3A%2F%2F127.0.0.1"),
        "{to}"
    );
    let home = app
        .client
        .get(app.url("/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        home.status(),
        StatusCode::SEE_OTHER,
        "the Ballast session ended"
    );
}
