//! AWS Signature Version 4 (issue 49 item 6): requests the engine signs
//! are checked by botocore, AWS's Python SDK core (not by the signer that
//! made them), with temporary credentials and S3's rules; a wrong secret
//! is refused; the history keeps neither signature nor token.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use ballast::config::Config;
use ballast::domain::RecordState;
use ballast::engine::Enqueue;
use ballast::store::Backend;
use serde_json::json;

use crate::helpers::TestDb;

const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";

/// Whether botocore can be imported (CI installs it); prints the skip.
fn botocore() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import botocore"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(!crate::helpers::in_ci(), "CI installs python3's botocore");
        crate::helpers::skip("python3 with botocore is not installed here");
    }
    ok
}

/// What `tests/fixtures/sigv4_verify.py` says of `request` (a JSON object:
/// method, url, headers, body): `ok`, else why not.
fn verify(request: &serde_json::Value) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sigv4_verify.py");
    let mut child = Command::new("python3")
        .arg(script)
        .arg(SECRET)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    serde_json::to_writer(stdin, request).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A provider that answers 200 `succeeded` to a request botocore
/// verifies, else 401; keeps each verdict with the request's path.
async fn verifier() -> (String, Arc<Mutex<Vec<(String, String)>>>) {
    let verdicts = Arc::new(Mutex::new(Vec::new()));
    let app = axum::Router::new().fallback({
        let verdicts = verdicts.clone();
        move |method: axum::http::Method,
              uri: axum::http::Uri,
              headers: axum::http::HeaderMap,
              body: String| {
            let verdicts = verdicts.clone();
            async move {
                let host = headers.get("host").and_then(|h| h.to_str().ok());
                let target = uri.path_and_query().map_or("/", |p| p.as_str());
                let request = json!({
                    "method": method.as_str(),
                    "url": format!("http://{}{target}", host.unwrap_or("")),
                    "headers": headers
                        .iter()
                        .map(|(k, v)| [k.as_str(), v.to_str().unwrap_or("")])
                        .collect::<Vec<_>>(),
                    "body": body,
                });
                let verdict = tokio::task::spawn_blocking(move || verify(&request))
                    .await
                    .unwrap();
                let good = verdict == "ok";
                verdicts.lock().unwrap().push((target.to_owned(), verdict));
                crate::tls::verdict_reply(good)
            }
        }
    });
    (crate::helpers::serve_router(app).await, verdicts)
}

/// Provider `name` signing for `service` in eu-west-1 with the keys in
/// `files` (each a `signing.` field and its file); its step posts to
/// `path`.
fn signed(
    name: &str,
    base: &str,
    (service, path): (&str, &str),
    files: &[(&str, &Path)],
) -> String {
    let keys: Vec<String> = files
        .iter()
        .map(|(field, file)| format!("{field} = \"{}\"", file.display()))
        .collect();
    crate::tls::provider(name, base, "")
        .replace(
            "retry = { max_attempts = 1 }",
            &format!(
                "retry = {{ max_attempts = 1 }}\nsigning = {{ scheme = \"aws-sigv4\", region = \"eu-west-1\", service = \"{service}\", {} }}",
                keys.join(", ")
            ),
        )
        .replace("path = \"/v1/charge\"", &format!("path = \"{path}\""))
        .replace("body = '{}'", "body = '{\"amount\": 5, \"note\": \"é\"}'")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_signatures_verify_with_botocore_and_a_wrong_secret_does_not() {
    if !botocore() {
        return;
    }
    let (base, verdicts) = verifier().await;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let id = write("key_id", "AKIDEXAMPLE\n");
    let secret = write("secret", &format!("{SECRET}\n"));
    let token = write("token", "FwoGZXIvYXdzEXAMPLETOKEN==");
    let wrong = write("wrong", "not-the-secret");
    let query = "/v1/charge/{{ key }}?z=1&a=b%20c&ref={{ key }}";
    let text = [
        signed(
            "api",
            &base,
            ("execute-api", query),
            &[
                ("access_key_id_file", &id),
                ("secret_file", &secret),
                ("session_token_file", &token),
            ],
        ),
        signed(
            "bucket",
            &base,
            ("s3", "/my-bucket/reports/{{ key }}.json"),
            &[("access_key_id_file", &id), ("secret_file", &secret)],
        ),
        signed(
            "wrong",
            &base,
            ("execute-api", "/v1/charge"),
            &[("access_key_id_file", &id), ("secret_file", &wrong)],
        ),
    ]
    .concat();
    let config = Config::parse(&text, Path::new("sigv4.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let t = TestDb::migrated(Backend::Sqlite, "sigv4").await.unwrap();
    let (engine, _clock) = crate::engine::manual_engine(&t.db, Arc::new(config), "sigv4").await;
    let mut ids = Vec::new();
    for name in ["api", "bucket", "wrong"] {
        let made = engine
            .enqueue(Enqueue::new(name, Some(&format!("{name}-1")), json!({})))
            .await
            .unwrap();
        ids.push(made.record.id);
    }
    crate::engine::drain(&engine).await;
    let state = async |id: i64| t.db.get_record(id).await.unwrap().unwrap().state;
    let seen = verdicts.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(state(ids[0]).await, RecordState::Succeeded, "{seen:?}");
    assert_eq!(state(ids[1]).await, RecordState::Succeeded, "{seen:?}");
    assert_ne!(state(ids[2]).await, RecordState::Succeeded);
    let wrong_seen = seen.iter().find(|(path, _)| path == "/v1/charge").unwrap();
    assert!(wrong_seen.1.starts_with("mismatch"), "{seen:?}");
    // The history keeps the headers' names, never the signature or the
    // session token.
    let attempts = t.db.attempts(ids[0]).await.unwrap();
    let sent = format!("{:?}", attempts[0].request);
    assert!(
        sent.contains(r#"("authorization", "[redacted]")"#),
        "{sent}"
    );
    assert!(
        sent.contains(r#"("x-amz-security-token", "[redacted]")"#),
        "{sent}"
    );
    assert!(
        !sent.contains("EXAMPLETOKEN") && !sent.contains("Signature="),
        "{sent}"
    );
}

#[test]
fn check_config_refuses_aws_signing_that_cannot_sign() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "k").unwrap();
    let err = |signing: &str, extra: &str| {
        let text = crate::tls::provider("p", "https://127.0.0.1:9", "").replace(
            "retry = { max_attempts = 1 }",
            &format!("retry = {{ max_attempts = 1 }}\n{extra}\nsigning = {{ {signing} }}"),
        );
        let config = Config::parse(&text, Path::new("sigv4.toml")).unwrap();
        config.validate(&|_| None).err().map(|e| e.to_string())
    };
    let files = format!(
        "secret_file = \"{0}\", access_key_id_file = \"{0}\"",
        key.display()
    );
    let aws = format!("scheme = \"aws-sigv4\", {files}");
    let scoped = format!("{aws}, region = \"eu-west-1\", service = \"s3\"");
    assert_eq!(err(&scoped, ""), None);
    let auth = format!(
        "auth = {{ header = \"Authorization\", value_file = \"{}\" }}",
        key.display()
    );
    let cases = [
        (
            aws.clone(),
            "",
            "config `providers.p.signing.region`: is required",
        ),
        (
            format!("{aws}, region = \"eu west\", service = \"s3\""),
            "",
            "config `providers.p.signing.region`: is required: letters",
        ),
        (
            format!("{scoped}, header = \"X-Sig\""),
            "",
            "config `providers.p.signing`: `header` does not apply to scheme AwsSigV4",
        ),
        (
            format!(
                "secret_file = \"{}\", region = \"eu-west-1\"",
                key.display()
            ),
            "",
            "config `providers.p.signing`: `region` does not apply to scheme HmacSha256",
        ),
        (
            format!(
                "scheme = \"aws-sigv4\", secret_file = \"{}\", region = \"eu-west-1\", service = \"s3\"",
                key.display()
            ),
            "",
            "config `providers.p.signing.access_key_id_env`: ",
        ),
        (
            scoped.clone(),
            &auth,
            "config `providers.p.signing`: AWS signing is the provider's credential",
        ),
    ];
    for (signing, extra, expected) in cases {
        let e = err(&signing, extra);
        assert!(
            e.as_deref().is_some_and(|e| e.starts_with(expected)),
            "{signing} {extra}: {e:?}"
        );
    }
}
