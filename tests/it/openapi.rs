//! The API's contract: the OpenAPI document a node serves is valid (by an
//! external validator), names truly the role each operation needs, and a
//! property-based API tester nobody here wrote finds no fault in a live
//! server: no 5xx, every status, header and body as documented.

use std::path::PathBuf;

use ballast::domain::Role;
use ballast::sim::{Profile, SimHandle};
use ballast::store::Backend;
use serde_json::{Value, json};

use crate::web::WebApp;

/// A tool of `tests/api/requirements.txt`, from the virtual environment
/// `.ci/run` makes, or `None` (with a line saying so) where there is none;
/// under CI it must be there.
fn tool(name: &str) -> Option<PathBuf> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/api/.venv/bin/{name}"));
    let there = path.is_file();
    if !there {
        assert!(
            !crate::helpers::in_ci(),
            "CI installs {name} (tests/api/requirements.txt)"
        );
        crate::helpers::skip(&format!(
            "{name} is not installed here (python3 -m venv tests/api/.venv && \
             tests/api/.venv/bin/pip install -r tests/api/requirements.txt)"
        ));
    }
    there.then_some(path)
}

/// A node with the API tests' pipeline and a record in it.
async fn node(test: &str) -> Option<(SimHandle, WebApp, i64)> {
    node_on(Backend::Sqlite, test).await
}

/// [`node`] on `backend`.
async fn node_on(backend: Backend, test: &str) -> Option<(SimHandle, WebApp, i64)> {
    let sim = SimHandle::spawn(Profile::clean(3)).await.unwrap();
    let extra = format!(
        "{}\n[server.limits]\napi_per_second = 100000\nbulk_per_minute = 100000\n",
        crate::api::pipeline(&sim.base_url())
    );
    let Some(app) = WebApp::spawn(backend, test, &extra).await else {
        sim.stop();
        return None;
    };
    let op = app.token(Role::Operator).await;
    let made: Value = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(&op)
        .json(&json!({"pipeline": "leads", "key": "first", "input": {"n": 1}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = made["record"]["id"].as_i64().unwrap();
    Some((sim, app, id))
}

async fn fetch_document(app: &WebApp) -> (String, Value) {
    let served = app
        .client
        .get(app.url("/api/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), 200);
    assert_eq!(served.headers()["content-type"], "application/json");
    let text = served.text().await.unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    (text, doc)
}

/// The document is served without a token, is what `ballast openapi`
/// prints, passes an external OpenAPI 3.1 validator, and every error
/// is a problem (RFC 9457) with its stable code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_is_described_by_a_valid_openapi_document() {
    let Some((sim, app, id)) = node("openapi_doc").await else {
        return;
    };
    let (text, doc) = fetch_document(&app).await;
    assert_eq!(text, *ballast::web::openapi().unwrap());
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(doc["servers"][0]["url"], "/api/v1");
    for path in [
        "/records",
        "/records/{id}",
        "/records/{id}/actions",
        "/providers",
        "/audit",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} is documented");
    }
    // Actions by the names the API takes and answers (`replay`, where the
    // stored trigger says `replay_from`).
    let actions: Vec<&str> = ballast::domain::OperatorAction::ALL
        .iter()
        .map(|a| a.as_str())
        .collect();
    assert_eq!(
        doc["components"]["schemas"]["OperatorAction"]["enum"],
        json!(actions)
    );
    if let Some(validator) = tool("openapi-spec-validator") {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), &text).unwrap();
        let out = std::process::Command::new(validator)
            .arg(file.path())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the validator refuses the document: {said}"
        );
        assert!(said.contains("OK"), "{said}");
    }
    // Errors, from the token check to the routing, are problems.
    let viewer = app.token(Role::Viewer).await;
    let cases = [
        (
            format!("/api/v1/records/{id}"),
            None,
            401,
            "unauthenticated",
        ),
        (
            "/api/v1/records/abc".to_owned(),
            Some(&viewer),
            404,
            "not_found",
        ),
        (
            "/api/v1/nowhere".to_owned(),
            Some(&viewer),
            404,
            "not_found",
        ),
        (
            "/api/v1/records?limit=-1".to_owned(),
            Some(&viewer),
            400,
            "invalid_query",
        ),
        (
            "/api/v1/records/export".to_owned(),
            Some(&viewer),
            403,
            "forbidden",
        ),
    ];
    for (path, token, status, code) in cases {
        let mut req = app.client.get(app.url(&path));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        let res = req.send().await.unwrap();
        assert_eq!(res.status(), status, "{path}");
        assert_eq!(
            res.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        let problem: Value = res.json().await.unwrap();
        assert_eq!(problem["type"], "about:blank", "{path}: {problem}");
        assert_eq!(problem["status"], status, "{path}: {problem}");
        assert_eq!(problem["code"], code, "{path}: {problem}");
        assert_eq!(problem["error"], code, "{path}: {problem}");
        assert!(
            problem["title"].as_str().is_some_and(|t| !t.is_empty()),
            "{problem}"
        );
        assert!(
            problem["detail"].as_str().is_some_and(|t| !t.is_empty()),
            "{problem}"
        );
    }
    // A method a route does not take: a problem too, saying what it takes.
    let res = app
        .client
        .delete(app.url("/api/v1/records"))
        .bearer_auth(&viewer)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 405);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let allow = res
        .headers()
        .get("allow")
        .map(|v| v.to_str().unwrap().to_owned());
    assert!(
        allow
            .as_deref()
            .is_some_and(|a| a.contains("GET") && a.contains("POST")),
        "{allow:?}"
    );
    let problem: Value = res.json().await.unwrap();
    assert_eq!(problem["code"], "method_not_allowed", "{problem}");
    app.stop().await;
    sim.stop();
}

/// Each operation's security names the role it needs (`bearer` with the
/// role as its scope), and that is the role it takes: no token is 401, a
/// lower role 403, that role gets past both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_needs_the_role_its_document_names() {
    let Some((sim, app, id)) = node("openapi_roles").await else {
        return;
    };
    let (_, doc) = fetch_document(&app).await;
    let ranks = [Role::Viewer, Role::Operator, Role::Admin];
    let mut tokens = Vec::new();
    for role in ranks {
        tokens.push(app.token(role).await);
    }
    let mut checked = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if method == "servers" {
                continue;
            }
            // A trigger is authenticated by its sender's signature alone
            // (`triggers::*`), and says so: no security requirement.
            if op["security"] == json!([{}]) {
                assert_eq!(path, "/triggers/{name}", "{method} {path} needs no token");
                continue;
            }
            let needs = op["security"][0]["bearer"][0]
                .as_str()
                .unwrap_or_else(|| panic!("{method} {path} names no role"));
            let needs = ranks.iter().position(|r| r.as_str() == needs).unwrap();
            let url = app
                .url(&format!("/api/v1{path}"))
                .replace("{id}", &id.to_string())
                .replace("{step}", "charge")
                .replace("{name}", "sim");
            let call = |token: Option<&String>| {
                let mut req = match method.as_str() {
                    "get" => app.client.get(&url),
                    "post" => app.client.post(&url).json(&json!({})),
                    other => panic!("{other} {path}: a method this test does not know"),
                };
                if let Some(t) = token {
                    req = req.bearer_auth(t);
                }
                async move { req.send().await.unwrap().status().as_u16() }
            };
            assert_eq!(call(None).await, 401, "{method} {path} without a token");
            for (rank, token) in tokens.iter().enumerate() {
                let status = call(Some(token)).await;
                if rank < needs {
                    assert_eq!(status, 403, "{method} {path} as {:?}", ranks[rank]);
                } else {
                    assert!(
                        !matches!(status, 401 | 403) && status < 500,
                        "{method} {path} as {:?}: {status}",
                        ranks[rank]
                    );
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 17, "{checked} operations");
    app.stop().await;
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_tester_finds_no_fault_in_a_live_node_sqlite() {
    api_tester(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_tester_finds_no_fault_in_a_live_node_postgres() {
    api_tester(Backend::Postgres).await;
}

/// Schemathesis, stateful (it follows what one answer gives to the next
/// call: a record made, then read and acted on), with an admin token,
/// against a live node: no 5xx, every status, content type, header and
/// body as the document says. Its seed is fixed, so a failure replays;
/// `BALLAST_SCHEMATHESIS_SEED` picks another.
async fn api_tester(backend: Backend) {
    let Some(tester) = tool("schemathesis") else {
        return;
    };
    let Some((sim, app, id)) = node_on(backend, "openapi_tester").await else {
        return;
    };
    let admin = app.token(Role::Admin).await;
    let seed = std::env::var("BALLAST_SCHEMATHESIS_SEED").unwrap_or_else(|_| "20261206".into());
    let reports = tempfile::tempdir().unwrap();
    // Names this node has, so that calls on a record, a provider or a
    // step reach past "not found" (a wrong id's 404 is tested above).
    let names = format!(
        "[parameters]\n\"path.id\" = {id}\n\"path.name\" = \"sim\"\n\"path.step\" = \"charge\"\n"
    );
    std::fs::write(reports.path().join("schemathesis.toml"), names).unwrap();
    let mut command = std::process::Command::new(tester);
    command
        .args(["run", &app.url("/api/v1/openapi.json")])
        .args(["--header", &format!("Authorization: Bearer {admin}")])
        // Every check but one: a request the schema allows may still be
        // refused by a rule no schema states (a pipeline this node does
        // not have, a park without a reason), and rightly.
        .args([
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
        ])
        .args(["--seed", &seed, "--max-examples", "25"])
        .args([
            "--phases",
            "examples,coverage,fuzzing,stateful",
            // One worker: Hypothesis on two threads at once can trip
            // over CPython 3.11's parser (an AST recursion mismatch).
            "--workers",
            "1",
        ])
        .args(["--no-color", "--output-truncate", "false"])
        .arg("--report-dir")
        .arg(reports.path())
        // Its cache (`.schemathesis/`) goes there too, not into the tree.
        .current_dir(reports.path());
    // The node runs on this process's runtime: wait for the tester on
    // another thread.
    let run = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap();
    let said =
        String::from_utf8_lossy(&run.stdout).into_owned() + &String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "schemathesis found faults (seed {seed}):\n{said}"
    );
    // Its token still worked at the end (it may revoke others, disable or
    // change users; a run whose own token went would test nothing after).
    let still = app
        .client
        .get(app.url("/api/v1/users"))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(
        still.status(),
        200,
        "the tester's token was lost during its run"
    );
    let summary = said
        .lines()
        .skip_while(|l| !l.contains("WARNINGS") && !l.contains("SUMMARY"));
    println!("{}", summary.collect::<Vec<_>>().join("\n"));
    app.stop().await;
    sim.stop();
}

/// A Python client generated from the served document by a standard
/// generator (openapi-python-client) enqueues a batch, lists it with
/// filters, acts on a record and reads the audit log through its own
/// generated code (`tests/api/client_check.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_python_client_works() {
    let (Some(generator), Some(python)) = (tool("openapi-python-client"), tool("python")) else {
        return;
    };
    let Some((sim, app, _)) = node("openapi_client").await else {
        return;
    };
    let (text, _) = fetch_document(&app).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("openapi.json"), &text).unwrap();
    // No formatter after generating: the code is run, not read.
    std::fs::write(dir.path().join("generator.yaml"), "post_hooks: []\n").unwrap();
    let generated = std::process::Command::new(generator)
        .args([
            "generate",
            "--path",
            "openapi.json",
            "--config",
            "generator.yaml",
        ])
        .args(["--output-path", "ballast_client", "--meta", "none"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&generated.stdout).into_owned()
        + &String::from_utf8_lossy(&generated.stderr);
    assert!(generated.status.success(), "the generator failed: {said}");
    assert!(!said.contains("Warning"), "the generator warns: {said}");
    let token = app.token(Role::Operator).await;
    let check = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/api/client_check.py");
    let mut command = std::process::Command::new(python);
    command
        .arg(check)
        .args([app.url(""), token])
        .env("PYTHONPATH", dir.path());
    let run = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap();
    let said =
        String::from_utf8_lossy(&run.stdout).into_owned() + &String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "the generated client's check failed:\n{said}"
    );
    println!("{said}");
    app.stop().await;
    sim.stop();
}
