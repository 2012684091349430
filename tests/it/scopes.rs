//! Permissions per pipeline (issue 49 item 2): a user or token limited to
//! pipelines gets, on every route, records of those only: lists, counts,
//! search, export, bulk selections and the audit log leave the others out;
//! a record of another pipeline is not found, exactly as a record that
//! does not exist; enqueueing into another pipeline is refused as an
//! unknown pipeline. A caller seeing every pipeline sees both, on each
//! route (so that each check can fail).

use ballast::domain::scope::Scope;
use ballast::domain::{OperatorAction, Role};
use ballast::store::{Backend, NewApiToken, NewRecord, NewUser, RecordFilter};
use serde_json::{Value, json};

use crate::web::{Login, WebApp, password_of};

const CONFIG: &str = r#"
[providers.crm]
base_url = "http://127.0.0.1:9"
[providers.kyc]
base_url = "http://127.0.0.1:9"

[[pipelines.lead-enrichment.steps]]
name = "enrich"
provider = "crm"
request = { method = "POST", path = "/x", body = '{}' }

[[pipelines.verify-customer.steps]]
name = "verify"
provider = "kyc"
request = { method = "POST", path = "/x", body = '{}' }
"#;

/// A record of `pipeline` with key `key`, due in an hour, parked (so
/// that actions apply).
async fn record(app: &WebApp, pipeline: &str, key: &str) -> i64 {
    let now = crate::helpers::wall_ms();
    let new = NewRecord {
        pipeline: pipeline.into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some(key.into()),
        input: json!({ "customer": key }),
        run_at: now + 3_600_000,
    };
    let id = app.t.db.create_record(new, now).await.unwrap().record.id;
    app.act(id, OperatorAction::Park).await;
    id
}

pub(crate) async fn user(app: &WebApp, name: &str, role: Role, scope: &str) {
    let u = NewUser {
        unmask: false,
        username: name.into(),
        password_hash: ballast::auth::password::hash(&password_of(name)).unwrap(),
        role,
        pipelines: Scope::parse(scope).unwrap(),
    };
    app.t
        .db
        .create_user(&u, crate::helpers::wall_ms())
        .await
        .unwrap();
}

async fn token(app: &WebApp, name: &str, role: Role, scope: &str) -> String {
    let (token, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
    let t = NewApiToken {
        unmask: false,
        name: name.into(),
        token_hash: hash,
        prefix,
        role,
        created_by: "test".into(),
        actor: "test".into(),
        expires_at: None,
        pipelines: Scope::parse(scope).unwrap(),
    };
    app.t
        .db
        .create_api_token(&t, crate::helpers::wall_ms())
        .await
        .unwrap();
    token
}

/// An API call with `token`: its status and JSON body.
async fn api(
    app: &WebApp,
    token: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let url = app.url(&format!("/api/v1{path}"));
    let req = match method {
        "GET" => app.client.get(url),
        _ => app.client.post(url),
    };
    let req = req.bearer_auth(token);
    let req = match body {
        Some(b) => req.json(&b),
        None => req,
    };
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The ids of the records a JSON list names (`items[].id`).
fn ids(list: &Value) -> Vec<i64> {
    list["items"]
        .as_array()
        .map(|a| a.iter().filter_map(|r| r["id"].as_i64()).collect())
        .unwrap_or_default()
}

/// What one caller gets across the API, for this round's records `a` (of
/// lead-enrichment, key `{round}-a`) and `b` (of verify-customer, key
/// `{round}-b`): `b` there or not as `sees_b` says.
async fn api_matrix(app: &WebApp, token: &str, (round, a, b): (&str, i64, i64), sees_b: bool) {
    let (s, list) = api(app, token, "GET", "/records", None).await;
    assert_eq!(s, 200);
    // `/metrics` breaks figures down by every pipeline: not for a token
    // limited to some.
    let metrics = app
        .client
        .get(app.url("/metrics"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status() == 403, !sees_b, "{:?}", metrics.status());
    assert!(ids(&list).contains(&a));
    assert_eq!(ids(&list).contains(&b), sees_b, "list {list}");
    let (_, filtered) = api(app, token, "GET", "/records?pipeline=verify-customer", None).await;
    assert_eq!(ids(&filtered).contains(&b), sees_b, "{filtered}");
    let (_, keyed) = api(app, token, "GET", &format!("/records?q={round}-b"), None).await;
    assert_eq!(ids(&keyed).contains(&b), sees_b, "{keyed}");
    // One record: not found, word for word as an id that never was.
    let (s, one) = api(app, token, "GET", &format!("/records/{b}"), None).await;
    let (_, never) = api(app, token, "GET", "/records/987654", None).await;
    match sees_b {
        true => assert_eq!(s, 200, "{one}"),
        false => {
            assert_eq!(s, 404);
            assert_eq!(one["error"], never["error"]);
            assert_eq!(
                one["message"]
                    .as_str()
                    .map(|m| m.replace(&b.to_string(), "N")),
                never["message"].as_str().map(|m| m.replace("987654", "N"))
            );
        }
    }
    let (s, _) = api(app, token, "GET", &format!("/records/{a}"), None).await;
    assert_eq!(s, 200);
    let not_found = |s: u16| assert_eq!(s == 404, !sees_b, "status {s}");
    let (s, _) = api(
        app,
        token,
        "GET",
        &format!("/records/{b}/items/verify"),
        None,
    )
    .await;
    not_found(s);
    let retry = json!({ "action": "resume", "reason": "scoped" });
    let (s, _) = api(
        app,
        token,
        "POST",
        &format!("/records/{b}/signals/verify"),
        Some(json!({})),
    )
    .await;
    if !sees_b {
        assert_eq!(s, 404);
    }
    // Exports and bulk selections: b's record is not among them.
    let path = format!("/records/export?q={round}-");
    let export = api(app, token, "GET", &path, None).await.1.to_string();
    assert!(export.contains(&format!("{round}-a")), "{export}");
    assert_eq!(export.contains(&format!("{round}-b")), sees_b, "{export}");
    let preview = |sel: Value| {
        let mut body = json!({ "action": "resume", "reason": "scoped" });
        body.as_object_mut()
            .unwrap()
            .extend(sel.as_object().unwrap().clone());
        body
    };
    let (s, by_ids) = api(
        app,
        token,
        "POST",
        "/records/bulk",
        Some(preview(json!({ "ids": [a, b] }))),
    )
    .await;
    assert_eq!(s, 200, "{by_ids}");
    assert_eq!(
        by_ids["matched"],
        json!(if sees_b { 2 } else { 1 }),
        "{by_ids}"
    );
    let (_, every) = api(
        app,
        token,
        "POST",
        "/records/bulk",
        Some(preview(json!({ "filter": { "q": format!("{round}-") } }))),
    )
    .await;
    assert_eq!(
        every["matched"],
        json!(if sees_b { 2 } else { 1 }),
        "{every}"
    );
    // Enqueueing into a pipeline it does not see: an unknown pipeline.
    let new = |p: &str| json!({ "pipeline": p, "key": format!("new-{p}") });
    let (s, refused) = api(app, token, "POST", "/records", Some(new("verify-customer"))).await;
    let (_, unknown) = api(
        app,
        token,
        "POST",
        "/records",
        Some(new("no-such-pipeline")),
    )
    .await;
    match sees_b {
        true => assert!(s == 201 || s == 200, "{s} {refused}"),
        false => {
            assert_eq!(s, 400);
            assert_eq!(refused["error"], unknown["error"]);
        }
    }
    // Acting on b's record last (it changes it).
    let (s, _) = api(
        app,
        token,
        "POST",
        &format!("/records/{b}/actions"),
        Some(retry),
    )
    .await;
    not_found(s);
    // The providers its pipelines call, and the audit log's actions on
    // its records only.
    let (s, providers) = api(app, token, "GET", "/providers", None).await;
    assert_eq!(s, 200);
    let names: Vec<&str> = providers["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(names.contains(&"crm"), "{providers}");
    assert_eq!(names.contains(&"kyc"), sees_b, "{providers}");
    // Its pipelines' figures, not the others'.
    let (s, pipelines) = api(app, token, "GET", "/pipelines", None).await;
    assert_eq!(s, 200);
    let names: Vec<&str> = pipelines["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(names.contains(&"lead-enrichment"), "{pipelines}");
    assert_eq!(names.contains(&"verify-customer"), sees_b, "{pipelines}");
    let (s, audit) = api(app, token, "GET", "/audit?limit=500", None).await;
    assert_eq!(s, 200);
    let on = |id: i64| {
        audit["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["record_id"] == id)
    };
    assert!(on(a), "{audit}");
    assert_eq!(on(b), sees_b, "{audit}");
    // The search box's answers: by key and by id.
    for q in [format!("{round}-b"), b.to_string()] {
        let (s, found) = api(app, token, "GET", &format!("/search?q={q}"), None).await;
        assert_eq!(s, 200);
        let named: Vec<i64> = found["named"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["id"].as_i64())
            .collect();
        assert_eq!(named.contains(&b), sees_b, "{q}: {found}");
    }
    let (_, mine) = api(app, token, "GET", &format!("/search?q={round}-a"), None).await;
    assert!(
        mine["named"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["id"] == a),
        "{mine}"
    );
}

/// What one dashboard operator gets across the pages (as
/// [`api_matrix`]).
async fn page_matrix(app: &WebApp, login: &Login, (round, a, b): (&str, i64, i64), sees_b: bool) {
    let link = |id: i64| format!("href=\"/records/{id}\"");
    let list = app.text("/records", Some(login)).await;
    assert!(list.contains(&link(a)), "{list}");
    assert_eq!(list.contains(&link(b)), sees_b);
    // The filter's choices name the pipelines it sees only.
    assert_eq!(list.contains("verify-customer"), sees_b);
    let filtered = app
        .text("/records?pipeline=verify-customer", Some(login))
        .await;
    assert_eq!(filtered.contains(&link(b)), sees_b);
    assert_eq!(
        app.get(&format!("/records/{b}"), Some(login))
            .await
            .status()
            == 404,
        !sees_b
    );
    assert_eq!(
        app.get(&format!("/records/{a}"), Some(login))
            .await
            .status(),
        200
    );
    let live = app
        .get(&format!("/records/{b}/live?v=x"), Some(login))
        .await;
    assert_eq!(live.status() == 404, !sees_b);
    // Search by key, and by id (one match goes straight to it).
    // (As the results' own refresh: one match would redirect.)
    let found = app.fragment(&format!("/search?q={round}-b"), login).await;
    assert_eq!(found.contains(&link(b)), sees_b, "{found}");
    let by_id = app.get(&format!("/search?q={b}"), Some(login)).await;
    assert_eq!(by_id.status() == 303, sees_b, "{:?}", by_id.status());
    // The overview's counts, the pipelines page, the providers it calls.
    let overview = app.text("/", Some(login)).await;
    assert!(overview.contains("lead-enrichment"));
    assert_eq!(overview.contains("verify-customer"), sees_b);
    assert_eq!(overview.contains("kyc"), sees_b);
    let pipelines = app.text("/pipelines", Some(login)).await;
    assert!(pipelines.contains("lead-enrichment"));
    assert_eq!(pipelines.contains("verify-customer"), sees_b);
    let providers = app.text("/providers", Some(login)).await;
    assert!(providers.contains("crm"));
    assert_eq!(providers.contains("kyc"), sees_b);
    // The audit log: the parks of a's record, not of b's.
    let audit = app.text("/audit", Some(login)).await;
    assert!(audit.contains(&format!("/records/{a}\"")), "{audit}");
    assert_eq!(audit.contains(&format!("/records/{b}\"")), sees_b);
    let export = app
        .text(
            &format!("/records/export?format=csv&q={round}-"),
            Some(login),
        )
        .await;
    assert!(export.contains(&format!("{round}-a")));
    assert_eq!(export.contains(&format!("{round}-b")), sees_b);
    let bulk = app
        .post(
            "/records/bulk",
            Some(login),
            &[
                ("ids", &a.to_string()),
                ("ids", &b.to_string()),
                ("action", "resume"),
                ("reason", "scoped"),
            ],
        )
        .await
        .text()
        .await
        .unwrap();
    let matched = if sees_b {
        "of 2 selected"
    } else {
        "of 1 selected"
    };
    assert!(bulk.contains(matched), "{bulk}");
    let enqueue = app
        .post(
            "/records/enqueue",
            Some(login),
            &[("pipeline", "verify-customer"), ("key", "form-b")],
        )
        .await;
    assert_eq!(enqueue.status() == 400, !sees_b, "{:?}", enqueue.status());
    let act = app
        .post(
            &format!("/records/{b}/actions"),
            Some(login),
            &[("action", "resume"), ("reason", "scoped")],
        )
        .await;
    assert_eq!(act.status() == 404, !sees_b, "{:?}", act.status());
}

async fn matrix(backend: Backend) {
    let Some(app) = WebApp::spawn(backend, "scopes", CONFIG).await else {
        return;
    };
    user(&app, "lead-viewer", Role::Viewer, "lead-*").await;
    user(&app, "lead-operator", Role::Operator, "lead-enrichment").await;
    user(&app, "everyone", Role::Operator, "").await;
    let scoped = token(&app, "lead-token", Role::Operator, "lead-*, other").await;
    let unscoped = token(&app, "every-token", Role::Operator, "").await;
    // Pages: the viewer and both operators.
    for (who, sees_b) in [
        ("lead-viewer", false),
        ("lead-operator", false),
        ("everyone", true),
    ] {
        let a = record(&app, "lead-enrichment", &format!("{who}-a")).await;
        let b = record(&app, "verify-customer", &format!("{who}-b")).await;
        let login = app.login(who).await;
        if who == "lead-viewer" {
            // A viewer: the read routes (its writes are refused by role).
            let link = format!("href=\"/records/{b}\"");
            assert!(!app.text("/records", Some(&login)).await.contains(&link));
            assert_eq!(
                app.get(&format!("/records/{b}"), Some(&login))
                    .await
                    .status(),
                404
            );
            // (One match would redirect: its page and its results' own
            // refresh are both checked.)
            let search = format!("/search?q={who}-b");
            let found = app.get(&search, Some(&login)).await;
            assert_eq!(found.status(), 200);
            assert!(!app.fragment(&search, &login).await.contains(&link));
            assert!(
                !app.text("/audit", Some(&login))
                    .await
                    .contains(&format!("/records/{b}\""))
            );
            assert!(
                !app.text("/", Some(&login))
                    .await
                    .contains("verify-customer")
            );
        } else {
            page_matrix(&app, &login, (who, a, b), sees_b).await;
        }
    }
    for (who, token, sees_b) in [("t1", &scoped, false), ("t2", &unscoped, true)] {
        let a = record(&app, "lead-enrichment", &format!("{who}-a")).await;
        let b = record(&app, "verify-customer", &format!("{who}-b")).await;
        api_matrix(&app, token, (who, a, b), sees_b).await;
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_every_route_keeps_a_caller_to_its_pipelines() {
    matrix(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_every_route_keeps_a_caller_to_its_pipelines() {
    matrix(Backend::Postgres).await;
}

/// Pages of a list within some pipelines hold each of their records once,
/// newest first, however the pipelines interleave: through the merge of
/// one list per pipeline (a few) and through one search (many).
async fn paging_within(backend: Backend) {
    let Some(t) = crate::helpers::TestDb::migrated(backend, "scope_pages").await else {
        return;
    };
    let now = crate::helpers::wall_ms();
    // 20 pipelines; p0 has many records, p1 few, the rest one each.
    let mut batch = Vec::new();
    for i in 0..90 {
        let pipeline = match i {
            i if i % 10 == 3 => "p1".to_owned(),
            i if i < 20 => format!("p{}", i % 20),
            _ => "p0".to_owned(),
        };
        batch.push(NewRecord {
            pipeline,
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            pipeline_version: None,
            external_key: Some(format!("k{i}")),
            input: json!({}),
            run_at: now + 3_600_000,
        });
    }
    t.db.create_records(batch, now).await.unwrap();
    let all = crate::helpers::all_records(&t.db, None).await;
    for within in [
        vec!["p1".to_owned()],
        vec!["p0".to_owned(), "p1".to_owned()],
        vec!["p1".to_owned(), "p5".to_owned(), "p9".to_owned()],
        (0..20)
            .map(|i| format!("p{i}"))
            .filter(|p| p != "p0")
            .collect(),
        vec![],
    ] {
        let mut want: Vec<i64> = all
            .iter()
            .filter(|r| within.contains(&r.pipeline))
            .map(|r| r.id)
            .collect();
        want.sort_unstable_by(|a, b| b.cmp(a));
        let mut got = Vec::new();
        let mut before = None;
        loop {
            let f = RecordFilter {
                pipelines: Some(within.clone()),
                before,
                limit: 7,
                ..Default::default()
            };
            let page = t.db.list_records(&f).await.unwrap();
            got.extend(page.items.iter().map(|r| r.id));
            match page.next {
                Some(n) => before = Some(n),
                None => break,
            }
        }
        assert_eq!(got, want, "within {within:?}");
        // A pipeline asked for outside the scope: nothing.
        let outside = RecordFilter {
            pipeline: Some("p0".into()),
            pipelines: Some(vec!["p1".into()]),
            ..Default::default()
        };
        assert!(t.db.list_records(&outside).await.unwrap().items.is_empty());
    }
}

#[tokio::test]
async fn sqlite_lists_within_pipelines_page_through_each_record_once() {
    paging_within(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_lists_within_pipelines_page_through_each_record_once() {
    paging_within(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_limit_users_and_tokens_to_pipelines_but_never_an_admin() {
    let Some(app) = WebApp::spawn(Backend::Sqlite, "scope_admin", CONFIG).await else {
        return;
    };
    let support = app.user("support", Role::Viewer).await;
    let admin = app.login("admin").await;
    let before = app.login("support").await;
    let r = app
        .post(
            &format!("/admin/users/{support}/pipelines"),
            Some(&admin),
            &[("pipelines", "lead-*, verify-customer")],
        )
        .await;
    assert_eq!(r.status(), 303);
    let changed = app.t.db.user_by_id(support).await.unwrap().unwrap();
    assert_eq!(
        changed.pipelines,
        Scope::parse("lead-*,verify-customer").unwrap()
    );
    // The change ends the user's sessions; the users page shows it.
    assert_ne!(app.get("/records", Some(&before)).await.status(), 200);
    let users = app.text("/admin/users", Some(&admin)).await;
    assert!(
        users.contains("value=\"lead-*, verify-customer\""),
        "{users}"
    );
    // An admin sees every pipeline: never limited, made or changed so (a
    // change of an account is refused as the last admin's demotion is).
    let me = app.t.db.user_by_name("admin").await.unwrap().unwrap().id;
    let r = app
        .post(
            &format!("/admin/users/{me}/pipelines"),
            Some(&admin),
            &[("pipelines", "lead-*")],
        )
        .await;
    assert_eq!(r.status(), 409);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("an admin sees every pipeline")
    );
    let r = app
        .post(
            &format!("/admin/users/{support}/role"),
            Some(&admin),
            &[("role", "admin")],
        )
        .await;
    assert_eq!(r.status(), 409);
    let add = |role: &'static str| {
        [
            ("username", "new-one"),
            ("role", role),
            ("password", "a-long-enough-password-9"),
            ("pipelines", "lead-*"),
        ]
    };
    assert_eq!(
        app.post("/admin/users", Some(&admin), &add("admin"))
            .await
            .status(),
        400
    );
    assert_eq!(
        app.post("/admin/users", Some(&admin), &add("operator"))
            .await
            .status(),
        303
    );
    // Tokens: made with pipelines, listed with them.
    let form = [
        ("name", "crm-sync"),
        ("role", "operator"),
        ("pipelines", "lead-*"),
    ];
    let made = app.post("/admin/tokens", Some(&admin), &form).await;
    assert_eq!(made.status(), 201);
    assert!(made.text().await.unwrap().contains("<td>lead-*</td>"));
    let form = [("name", "x"), ("role", "admin"), ("pipelines", "lead-*")];
    assert_eq!(
        app.post("/admin/tokens", Some(&admin), &form)
            .await
            .status(),
        400
    );
    app.stop().await;
}

/// Going down past migration 25 (a binary without permissions per
/// pipeline) disables the users and revokes the tokens limited to
/// pipelines, rather than letting them see every one.
async fn down_disables_the_limited(backend: Backend) {
    let Some(t) = crate::helpers::TestDb::migrated(backend, "scope_down").await else {
        return;
    };
    let now = crate::helpers::wall_ms();
    for (name, scope) in [("limited", "a"), ("free", "")] {
        let u = NewUser {
            unmask: false,
            username: name.into(),
            password_hash: "x".into(),
            role: Role::Viewer,
            pipelines: Scope::parse(scope).unwrap(),
        };
        t.db.create_user(&u, now).await.unwrap();
        let tok = NewApiToken {
            unmask: false,
            name: name.into(),
            token_hash: format!("hash-{name}"),
            prefix: format!("p-{name}"),
            role: Role::Viewer,
            created_by: "test".into(),
            actor: "test".into(),
            expires_at: None,
            pipelines: Scope::parse(scope).unwrap(),
        };
        t.db.create_api_token(&tok, now).await.unwrap();
    }
    ballast::store::migrate::down(&t.db, 24).await.unwrap();
    let users = "SELECT username FROM users WHERE disabled ORDER BY username";
    assert_eq!(names(&t, users).await, ["limited"]);
    let tokens = "SELECT name FROM api_tokens WHERE revoked_at IS NOT NULL ORDER BY name";
    assert_eq!(names(&t, tokens).await, ["limited"]);
    ballast::store::migrate::up(&t.db, None).await.unwrap();
}

/// The names `sql` selects, read outside the store (whose columns the
/// schema going down no longer has).
async fn names(t: &crate::helpers::TestDb, sql: &'static str) -> Vec<String> {
    match &t.db {
        ballast::store::Db::Sqlite(_) => {
            let pool = sqlx::SqlitePool::connect(&t.url).await.unwrap();
            sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap()
        }
        ballast::store::Db::Postgres(_) => {
            let pool = sqlx::PgPool::connect(&t.url).await.unwrap();
            sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap()
        }
    }
}

#[tokio::test]
async fn sqlite_going_down_disables_the_users_limited_to_pipelines() {
    down_disables_the_limited(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_going_down_disables_the_users_limited_to_pipelines() {
    down_disables_the_limited(Backend::Postgres).await;
}
