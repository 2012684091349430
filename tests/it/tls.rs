//! Issue 49 item 6: providers that need certificates. A provider behind
//! a TLS server that requires a client certificate from its own CA is
//! called with the configured CA and client certificate; without the
//! certificate, with one from another CA, or without the CA, no call
//! reaches it. Files that are not what they claim are refused naming the
//! setting.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ballast::config::Config;
use ballast::domain::RecordState;
use ballast::engine::Enqueue;
use ballast::store::Backend;
use serde_json::json;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::helpers::TestDb;

/// A file of `tests/fixtures/tls` (a CA, a server certificate for
/// 127.0.0.1, a client certificate it signed, and a stranger's signed by
/// another CA; made with `openssl`, valid for a century).
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

/// A TLS listener that asks every client for a certificate signed by the
/// test CA and refuses the handshake without one; keeps each refusal.
struct MutualTls {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    refused: Arc<Mutex<Vec<String>>>,
}

impl axum::serve::Listener for MutualTls {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            match self.acceptor.accept(tcp).await {
                Ok(tls) => return (tls, addr),
                Err(e) => self.refused.lock().unwrap().push(e.to_string()),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// The server: its base URL, the calls that reached it, the handshakes
/// it refused.
async fn server() -> (String, Arc<Mutex<usize>>, Arc<Mutex<Vec<String>>>) {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(fixture("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(fixture("server.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(fixture("server.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let (calls, refused) = (Arc::new(Mutex::new(0)), Arc::new(Mutex::new(Vec::new())));
    let listener = MutualTls {
        tcp,
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        refused: refused.clone(),
    };
    let app = axum::Router::new().route(
        "/v1/charge",
        axum::routing::post({
            let calls = calls.clone();
            move || {
                *calls.lock().unwrap() += 1;
                async { axum::Json(json!({ "status": "succeeded" })) }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("https://{addr}"), calls, refused)
}

/// Provider `name` at `base` with `tls` (none when empty), one attempt
/// only, and pipeline `name` calling it once.
fn provider(name: &str, base: &str, tls: &str) -> String {
    let tls = match tls {
        "" => String::new(),
        t => format!("tls = {{ {t} }}"),
    };
    format!(
        r#"
[providers.{name}]
base_url = "{base}"
timeout = "5s"
{tls}
retry = {{ max_attempts = 1 }}
[[providers.{name}.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.{name}.steps]]
name = "charge"
provider = "{name}"
request = {{ method = "POST", path = "/v1/charge", body = '{{}}' }}
"#
    )
}

fn file(name: &str) -> String {
    fixture(name).display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_behind_mutual_tls_gets_the_client_certificate() {
    let (base, calls, refused) = server().await;
    let (ca, cert, key) = (file("ca.pem"), file("client.pem"), file("client.key"));
    let (stranger, stranger_key) = (file("stranger.pem"), file("stranger.key"));
    let text = [
        provider(
            "good",
            &base,
            &format!(r#"ca_file = "{ca}", cert_file = "{cert}", key_file = "{key}""#),
        ),
        provider("nocert", &base, &format!(r#"ca_file = "{ca}""#)),
        provider(
            "stranger",
            &base,
            &format!(r#"ca_file = "{ca}", cert_file = "{stranger}", key_file = "{stranger_key}""#),
        ),
        provider(
            "noca",
            &base,
            &format!(r#"cert_file = "{cert}", key_file = "{key}""#),
        ),
    ]
    .concat();
    let config = Config::parse(&text, Path::new("tls.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    let t = TestDb::migrated(Backend::Sqlite, "tls").await.unwrap();
    let (engine, _clock) = crate::engine::manual_engine(&t.db, Arc::new(config), "tls").await;
    let mut ids = Vec::new();
    for name in ["good", "nocert", "stranger", "noca"] {
        let made = engine
            .enqueue(Enqueue::new(name, Some(name), json!({})))
            .await
            .unwrap();
        ids.push((name, made.record.id));
    }
    crate::engine::drain(&engine).await;
    let state = async |id: i64| t.db.get_record(id).await.unwrap().unwrap().state;
    assert_eq!(state(ids[0].1).await, RecordState::Succeeded);
    for (name, id) in &ids[1..] {
        let s = state(*id).await;
        assert_ne!(s, RecordState::Succeeded, "{name}");
        let attempts = t.db.attempts(*id).await.unwrap();
        assert_eq!(attempts.len(), 1, "{name}: {attempts:?}");
    }
    // Only the call with the client certificate reached the provider;
    // the server refused the handshakes without one or with a stranger's
    // (and the client without the CA refused the server's).
    assert_eq!(*calls.lock().unwrap(), 1);
    let refused = refused.lock().unwrap().clone();
    assert!(refused.len() >= 3, "{refused:?}");
    assert!(
        refused
            .iter()
            .any(|r| r.contains("peer sent no certificates")),
        "{refused:?}"
    );
    assert!(
        refused.iter().any(|r| r.contains("UnknownIssuer")),
        "{refused:?}"
    );
}

/// A CA file without a certificate, a key that is not one, a certificate
/// without its key: each refused naming its setting.
#[test]
fn check_config_refuses_tls_files_that_are_not_what_they_say() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let junk = junk.display().to_string();
    let (ca, cert) = (file("ca.pem"), file("client.pem"));
    let err = |tls: &str| {
        let text = provider("p", "https://127.0.0.1:9", tls);
        let config = Config::parse(&text, Path::new("tls.toml")).unwrap();
        config.validate(&|_| None).err().map(|e| e.to_string())
    };
    let cases = [
        (
            format!(r#"ca_file = "{junk}""#),
            format!("config `providers.p.tls.ca_file`: file {junk} holds no PEM certificate"),
        ),
        (
            format!(r#"ca_file = "{ca}", cert_file = "{cert}""#),
            "config `providers.p.tls`: set `cert_file` and `key_file` together".to_owned(),
        ),
    ];
    for (tls, said) in cases {
        assert_eq!(err(&tls), Some(said), "{tls}");
    }
    let not_a_key = err(&format!(r#"cert_file = "{cert}", key_file = "{junk}""#)).unwrap();
    assert!(
        not_a_key.starts_with("config `providers.p.tls.key_file`: ")
            && not_a_key.contains("are not a PEM certificate and its private key"),
        "{not_a_key}"
    );
    assert_eq!(
        err(&format!(
            r#"ca_file = "{ca}", cert_file = "{cert}", key_file = "{}""#,
            file("client.key")
        )),
        None
    );
}
