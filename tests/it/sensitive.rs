//! Sensitive fields (issue 49 item 3): a pipeline's fields and a
//! provider's reply fields are masked at the source in what attempts keep
//! (the request sent, the reply's excerpt), shown masked on pages, in the
//! API and in exports to callers without `unmask` (in clear to those with
//! it), exported in clear only with `unmask` and a reason (audited), and
//! left out of search documents; the workflow itself runs on the values.

use std::time::Duration;

use ballast::domain::scope::Scope;
use ballast::domain::{RecordState, Role};
use ballast::store::{Backend, NewApiToken, NewUser};
use serde_json::{Value, json};

use crate::web::{WebApp, password_of};

const SSN: &str = "123-45-6789";
const DOC: &str = "https://docs.example/passport/P1234567";
/// A name a URL and `tojson` both spell their own ways.
const NAME: &str = "Jane O'Brien";
const ACCOUNT: &str = "ACCT-998877";

/// A KYC provider: echoes the SSN it was sent and answers with a document
/// URL, the person's SSN and a verdict.
async fn kyc() -> String {
    let app = axum::Router::new().fallback(|body: String| async move {
        let sent: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        axum::Json(json!({
            "status": "succeeded",
            "document_url": DOC,
            "person": { "ssn": sent["ssn"], "name": "Jane" },
            "verdict": "clear",
            "account": ACCOUNT,
            "echo": format!("checked {} for {}", sent["ssn"].as_str().unwrap_or(""), sent["name"]),
        }))
    });
    crate::helpers::serve_router(app).await
}

fn config(base: &str) -> String {
    format!(
        r#"
[providers.kyc]
base_url = "{base}"
sensitive = ["/document_url", "/person/ssn"]
[[providers.kyc.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[pipelines.verify]
sensitive = [{{ pointer = "/input/ssn", keep_last = 4 }}, "/input/name", "/input/cvv", "/steps/check/output/account"]
[[pipelines.verify.steps]]
name = "check"
provider = "kyc"
request = {{ method = "POST", path = "/check/{{{{ input.ssn }}}}/{{{{ input.name }}}}?n={{{{ input.name | urlencode }}}}", body = '{{"ssn": {{{{ input.ssn | tojson }}}}, "name": {{{{ input.name | tojson }}}}, "cvv": {{{{ input.cvv | tojson }}}}}}' }}
outputs = {{ doc = "/document_url", person = "/person", verdict = "/verdict", account = "/account" }}
"#
    )
}

async fn token(app: &WebApp, name: &str, unmask: bool) -> String {
    let (token, hash, prefix) = ballast::web::auth::new_api_token().unwrap();
    let t = NewApiToken {
        name: name.into(),
        token_hash: hash,
        prefix,
        role: Role::Operator,
        created_by: "test".into(),
        actor: "test".into(),
        expires_at: None,
        pipelines: Scope::all(),
        unmask,
    };
    app.t
        .db
        .create_api_token(&t, crate::helpers::wall_ms())
        .await
        .unwrap();
    token
}

async fn get(app: &WebApp, token: &str, path: &str) -> (u16, String) {
    let r = app
        .client
        .get(app.url(path))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// No clear sensitive value in `text`: the SSN, the document's number,
/// the account (taken from a reply field only the pipeline declares), the
/// name however spelt (`O'Brien`, `O%27Brien`, `O\u0027Brien`), the CVV.
fn clean(text: &str) -> bool {
    ![SSN, "P1234567", "998877", "Brien", "\"737\""]
        .iter()
        .any(|v| text.contains(v))
}

async fn fields(backend: Backend) {
    let base = kyc().await;
    let Some(app) = WebApp::spawn(backend, "sensitive", &config(&base)).await else {
        return;
    };
    let masked = token(&app, "masked", false).await;
    let clear = token(&app, "clear", true).await;
    let r = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&clear)
        .json(&json!({ "pipeline": "verify", "key": "jane", "input": { "ssn": SSN, "name": NAME, "cvv": "737", "plan": "gold" } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["record"]["id"]
        .as_i64()
        .unwrap();
    crate::wait::until(
        "the record succeeds",
        Duration::from_secs(30),
        async || match app.t.db.get_record(id).await.unwrap().unwrap().state {
            RecordState::Succeeded => Ok(()),
            other => Err(other),
        },
    )
    .await;
    // The workflow ran on the values: the step's output holds them.
    let runs = app.t.db.step_runs(id).await.unwrap();
    assert_eq!(runs[0].output.as_ref().unwrap()["doc"], DOC);
    // At the source: the attempt keeps the request and the reply masked.
    let attempts = app.t.db.attempts(id).await.unwrap();
    let kept = format!("{:?} {:?}", attempts[0].request, attempts[0].excerpt);
    assert!(clean(&kept), "{kept}");
    assert!(
        kept.contains("•••-••-6789") && kept.contains("clear"),
        "{kept}"
    );
    // Shown masked to a caller without `unmask`, in clear with it.
    let (s, shown) = get(&app, &masked, &format!("/api/v1/records/{id}")).await;
    assert_eq!(s, 200);
    assert!(clean(&shown), "{shown}");
    let shown: Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["record"]["input"]["ssn"], "•••-••-6789");
    assert_eq!(shown["record"]["input"]["plan"], "gold");
    assert_eq!(shown["steps"][0]["output"]["verdict"], "clear");
    let (_, open) = get(&app, &clear, &format!("/api/v1/records/{id}")).await;
    let open: Value = serde_json::from_str(&open).unwrap();
    assert_eq!(open["record"]["input"]["ssn"], SSN);
    assert_eq!(open["steps"][0]["output"]["doc"], DOC);
    let (_, list) = get(&app, &masked, "/api/v1/records").await;
    assert!(clean(&list) && list.contains("gold"), "{list}");
    // Exports: masked for everyone unless asked, with `unmask` and a
    // reason (audited).
    for path in [
        "/api/v1/records/export",
        "/api/v1/records/export?attempts=1",
        "/api/v1/records/export?format=csv&attempts=1",
    ] {
        let (_, export) = get(&app, &clear, path).await;
        assert!(
            clean(&export) && export.contains("gold"),
            "{path}: {export}"
        );
    }
    let (s, _) = get(
        &app,
        &masked,
        "/api/v1/records/export?unmasked=1&reason=audit",
    )
    .await;
    assert_eq!(s, 403);
    let (s, _) = get(&app, &clear, "/api/v1/records/export?unmasked=1").await;
    assert_eq!(s, 400);
    let path = "/api/v1/records/export?unmasked=1&reason=regulator%20request";
    let (s, export) = get(&app, &clear, path).await;
    assert_eq!(s, 200);
    assert!(export.contains(SSN) && export.contains(DOC), "{export}");
    let audit = ballast::store::AuditFilter {
        kind: Some("export".into()),
        limit: 10,
        ..Default::default()
    };
    let entries = app.t.db.audit_log(&audit).await.unwrap().items;
    assert!(
        entries
            .iter()
            .any(|e| e.reason.as_deref() == Some("regulator request")
                && e.detail.as_ref().is_some_and(|d| d["unmasked"] == true)),
        "{entries:?}"
    );
    // Pages: a viewer sees it masked, a viewer with `unmask` in clear.
    for (name, unmask) in [("viewer", false), ("auditor", true)] {
        let u = NewUser {
            username: name.into(),
            password_hash: ballast::auth::password::hash(&password_of(name)).unwrap(),
            role: Role::Viewer,
            pipelines: Scope::all(),
            unmask,
        };
        app.t
            .db
            .create_user(&u, crate::helpers::wall_ms())
            .await
            .unwrap();
        let login = app.login(name).await;
        let page = app.text(&format!("/records/{id}"), Some(&login)).await;
        assert_eq!(clean(&page), !unmask, "{name}");
        assert!(page.contains("gold"));
    }
    // What an action answers is masked as well.
    let park = json!({ "action": "replay", "reason": "x", "step": "check" });
    let r = app
        .client
        .post(app.url(&format!("/api/v1/records/{id}/actions")))
        .bearer_auth(&masked)
        .json(&park)
        .send()
        .await
        .unwrap();
    let answered = r.text().await.unwrap();
    assert!(clean(&answered) && answered.contains("gold"), "{answered}");
    // An operator who sees the input masked cannot edit it.
    let retry = json!({ "action": "retry", "reason": "x", "input": { "ssn": "•••" } });
    let r = app
        .client
        .post(app.url(&format!("/api/v1/records/{id}/actions")))
        .bearer_auth(&masked)
        .json(&retry)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"], "unmask_needed");
    // A pipeline this node does not run (removed, or a dashboard-only
    // node): its fields are not known here, so it is masked whole.
    let now = crate::helpers::wall_ms();
    let gone = ballast::store::NewRecord {
        pipeline: "gone".into(),
        group: None,
        priority: ballast::domain::DEFAULT_PRIORITY,
        pipeline_version: None,
        external_key: Some("g".into()),
        input: json!({ "card": "4111111111111111" }),
        run_at: now + 3_600_000,
    };
    let gone = app.t.db.create_record(gone, now).await.unwrap().record.id;
    let (_, shown) = get(&app, &masked, &format!("/api/v1/records/{gone}")).await;
    assert!(!shown.contains("4111") && shown.contains("••••"), "{shown}");
    let (_, open) = get(&app, &clear, &format!("/api/v1/records/{gone}")).await;
    assert!(open.contains("4111111111111111"), "{open}");
    // Search: found by key, never by a sensitive value.
    let engine = app.state.engine.as_ref().unwrap();
    let indexer = ballast::engine::search::SearchIndexer::of(engine);
    crate::wait::until(
        "the record is indexed",
        Duration::from_secs(30),
        async || {
            indexer
                .index_search_once(crate::helpers::wall_ms() + 60_000)
                .await
                .unwrap();
            match app.t.db.search_records("jane", 5).await.unwrap().len() {
                1 => Ok(()),
                n => Err(n),
            }
        },
    )
    .await;
    for word in [SSN, "P1234567", "6789"] {
        assert!(
            app.t.db.search_records(word, 5).await.unwrap().is_empty(),
            "{word}"
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sensitive_fields_are_masked_at_the_source_and_when_shown() {
    fields(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sensitive_fields_are_masked_at_the_source_and_when_shown() {
    fields(Backend::Postgres).await;
}
