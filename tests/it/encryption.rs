//! Encryption at rest (issue 49 item 4): inputs, outputs, excerpts,
//! requests, event details and callback bodies are sealed with the current
//! data key before they reach the database (read back in clear by the
//! node, found in no column, no search document and nowhere in a SQLite
//! file), exports stay sealed unless asked in clear, `rotate-data-key`
//! moves every value to a new key while the node runs and then retires the
//! old one, and a node whose keys cannot read the database refuses to
//! start.

use std::sync::Arc;
use std::time::Duration;

use ballast::auth::seal::Keyring;
use ballast::domain::RecordState;
use ballast::store::{Backend, Db, SealedColumn, migrate};
use serde_json::{Value, json};

use crate::web::WebApp;

/// What the provider is sent and echoes back: found nowhere at rest.
const SECRET: &str = "SECRET-4242-ABCD";

fn ring(current: Option<&str>, keys: &[(&str, u8)]) -> Arc<Keyring> {
    Arc::new(
        Keyring::new(
            current,
            keys.iter().map(|(id, b)| ((*id).to_owned(), [*b; 32])),
        )
        .unwrap(),
    )
}

/// A provider that echoes the secret it was sent in its reply.
async fn echo() -> String {
    let app = axum::Router::new().fallback(|body: String| async move {
        let sent: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        axum::Json(json!({ "status": "done", "echo": sent["secret"], "note": format!("saw {}", sent["secret"]) }))
    });
    crate::helpers::serve_router(app).await
}

fn config(base: &str) -> String {
    format!(
        r#"
[providers.echo]
base_url = "{base}"
[[providers.echo.rules]]
when = {{ status = "2xx" }}
outcome = "success"

[pipelines.enrich]
[[pipelines.enrich.steps]]
name = "call"
provider = "echo"
request = {{ method = "POST", path = "/x", body = '{{"secret": {{{{ input.secret | tojson }}}}}}' }}
outputs = {{ echo = "/echo", note = "/note" }}
"#
    )
}

/// The text values `sql` selects, read over a connection of its own.
async fn texts(url: &str, backend: Backend, sql: String) -> Vec<String> {
    let sql = sqlx::AssertSqlSafe(sql);
    match backend {
        Backend::Sqlite => {
            let pool = sqlx::SqlitePool::connect(url).await.unwrap();
            let v = sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap();
            pool.close().await;
            v
        }
        Backend::Postgres => {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            let v = sqlx::query_scalar(sql).fetch_all(&pool).await.unwrap();
            pool.close().await;
            v
        }
    }
}

/// Every stored value of every sealed column, as the column holds it.
async fn raw(url: &str, backend: Backend) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for column in SealedColumn::ALL {
        let name = column.name();
        let (table, col) = name.split_once('.').unwrap();
        let sql = format!("SELECT CAST({col} AS TEXT) FROM {table} WHERE {col} IS NOT NULL");
        let values = texts(url, backend, sql).await;
        out.extend(values.into_iter().map(|v| (name.clone(), v)));
    }
    out
}

/// Waits until the search indexer has written the documents of every
/// event so far.
async fn indexed(url: &str, backend: Backend) {
    let sql = "SELECT CAST((SELECT max(id) FROM events) - (SELECT event_id FROM search_progress) AS TEXT)";
    crate::wait::until(
        "the search index catches up",
        Duration::from_secs(30),
        async || {
            let behind: i64 = texts(url, backend, sql.to_owned()).await[0]
                .parse()
                .unwrap();
            if behind <= 0 { Ok(()) } else { Err(behind) }
        },
    )
    .await;
}

/// Whether a stored value is sealed with `key`: the text of a text column,
/// a JSON string in a JSON column.
fn sealed_with(stored: &str, key: &str) -> bool {
    let text = serde_json::from_str::<String>(stored).unwrap_or_else(|_| stored.to_owned());
    ballast::auth::seal::sealed_with(&text) == Some(key)
}

async fn enqueue(app: &WebApp, token: &str, key: &str) -> i64 {
    let r = app
        .client
        .post(app.url("/api/v1/records"))
        .bearer_auth(token)
        .json(&json!({ "pipeline": "enrich", "key": key, "input": { "secret": SECRET, "n": 1 } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    r.json::<Value>().await.unwrap()["record"]["id"]
        .as_i64()
        .unwrap()
}

async fn succeeded(db: &Db, id: i64) {
    crate::wait::until(
        "the record succeeds",
        Duration::from_secs(30),
        async || match db.get_record(id).await.unwrap().unwrap().state {
            RecordState::Succeeded => Ok(()),
            other => Err(other),
        },
    )
    .await;
}

async fn spawn(backend: Backend, test: &str, keys: Arc<Keyring>) -> Option<WebApp> {
    let base = echo().await;
    let t = crate::helpers::TestDb::new(backend, test).await?;
    t.db.set_keyring(keys.clone());
    Some(
        WebApp::spawn_edited(t, &config(&base), true, move |c| {
            c.database.encryption.keyring = keys;
        })
        .await,
    )
}

async fn at_rest(backend: Backend) {
    let keys = ring(Some("k1"), &[("k1", 7)]);
    let Some(app) = spawn(backend, "encryption_at_rest", keys.clone()).await else {
        return;
    };
    let token = app.token(ballast::domain::Role::Operator).await;
    let id = enqueue(&app, &token, "alpha").await;
    succeeded(&app.t.db, id).await;
    // The node reads its values in clear: the step ran on the input, the
    // output holds the reply, the attempt its excerpt.
    let runs = app.t.db.step_runs(id).await.unwrap();
    assert_eq!(runs[0].output.as_ref().unwrap()["echo"], SECRET);
    let attempts = app.t.db.attempts(id).await.unwrap();
    assert!(attempts[0].excerpt.as_deref().unwrap().contains(SECRET));
    // The search indexer has caught up with every event (the record's
    // output included).
    indexed(&app.t.url, backend).await;
    // At rest: no column holds the secret, every value is sealed with k1.
    let stored = raw(&app.t.url, backend).await;
    for column in [
        "records.input",
        "step_runs.output",
        "attempts.excerpt",
        "attempts.request",
        "events.detail",
    ] {
        assert!(
            stored.iter().any(|(c, _)| c == column),
            "nothing stored in {column}"
        );
    }
    for (column, v) in &stored {
        assert!(!v.contains(SECRET), "{column} holds the secret: {v}");
        assert!(sealed_with(v, "k1"), "{column}: {v}");
    }
    // Search finds the record by its key, by no sealed value.
    let (_, by_key) = get(&app, &token, "/api/v1/records?q=alpha").await;
    assert!(by_key.contains(&format!("\"id\":{id}")), "{by_key}");
    let (_, found) = get(&app, &token, &format!("/api/v1/records?q={SECRET}")).await;
    assert!(!found.contains(&format!("\"id\":{id}")), "{found}");
    if backend == Backend::Sqlite {
        // Nowhere in the files: tables, indexes, the search index, the WAL.
        let file = app
            .t
            .url
            .trim_start_matches("sqlite://")
            .split('?')
            .next()
            .unwrap()
            .to_owned();
        for path in [file.clone(), format!("{file}-wal")] {
            if let Ok(bytes) = std::fs::read(&path) {
                assert!(
                    !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
                    "{path}"
                );
            }
        }
    }
    // A replay keeps the first result as a version (sealed too).
    let r = app
        .client
        .post(app.url(&format!("/api/v1/records/{id}/actions")))
        .bearer_auth(&token)
        .json(&json!({"action": "replay", "step": "call", "reason": "again"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    succeeded(&app.t.db, id).await;
    let stored = raw(&app.t.url, backend).await;
    assert!(stored.iter().any(|(c, _)| c == "step_versions.output"));
    for (column, v) in &stored {
        assert!(!v.contains(SECRET) && sealed_with(v, "k1"), "{column}: {v}");
    }
    // The API shows the values in clear to those who may see them.
    let (_, record) = get(&app, &token, &format!("/api/v1/records/{id}")).await;
    assert!(record.contains(SECRET), "{record}");
    exports(&app, &token, &keys).await;
}

/// An export is sealed unless asked in clear (with a reason); opened with
/// the keys, it is the export in clear.
async fn exports(app: &WebApp, token: &str, keys: &Keyring) {
    use ballast::engine::export::{Format, open_export};
    for (format, ext) in [(Format::Jsonl, "jsonl"), (Format::Csv, "csv")] {
        let (status, sealed) =
            get(app, token, &format!("/api/v1/records/export?format={ext}")).await;
        assert_eq!(status, 200, "{sealed}");
        assert!(
            !sealed.contains(SECRET) && !sealed.contains("saw"),
            "{sealed}"
        );
        let (status, _) = get(
            app,
            token,
            &format!("/api/v1/records/export?format={ext}&decrypted=1"),
        )
        .await;
        assert_eq!(
            status, 400,
            "a clear export of an encrypted database needs a reason"
        );
        let (status, clear) = get(
            app,
            token,
            &format!("/api/v1/records/export?format={ext}&decrypted=1&reason=audit"),
        )
        .await;
        assert_eq!(status, 200);
        assert!(clear.contains(SECRET), "{clear}");
        assert_eq!(open_export(&sealed, format, keys).unwrap(), clear);
        let other = ring(None, &[("k1", 8)]);
        assert!(
            open_export(&sealed, format, &other).is_err(),
            "another key opens nothing"
        );
    }
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

#[tokio::test]
async fn sqlite_values_are_sealed_at_rest_shown_in_clear_and_exported_sealed() {
    at_rest(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_values_are_sealed_at_rest_shown_in_clear_and_exported_sealed() {
    at_rest(Backend::Postgres).await;
}

/// `rotate-data-key` while the node runs: records enqueued and worked
/// during the rotation, every value ends sealed with the new key, the old
/// key retired; then the keys a node may start with; then back to clear.
async fn rotation(backend: Backend) {
    let k1 = ring(Some("k1"), &[("k1", 7)]);
    let Some(app) = spawn(backend, "encryption_rotation", k1).await else {
        return;
    };
    let token = app.token(ballast::domain::Role::Operator).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(enqueue(&app, &token, &format!("before-{i}")).await);
    }
    for id in &ids {
        succeeded(&app.t.db, *id).await;
    }
    // The rotation's configuration has k2; the node, still sealing with
    // k1, keeps it from starting.
    let both = ring(Some("k2"), &[("k1", 7), ("k2", 9)]);
    app.t.db.set_keyring(both.clone());
    migrate::up(&app.t.db, None).await.unwrap();
    says(&app, "k1").await;
    let clock = ballast::domain::SystemClock;
    let stale = ballast::engine::datakeys::rotate(&app.t.db, &clock, 7, |_, _, _| {}).await;
    let stale = stale.unwrap_err().to_string();
    assert!(
        stale.contains("(key k1)") && stale.contains("reload"),
        "{stale}"
    );
    // A reload gives the node k2 to seal with (k1 still opens).
    app.state.db.set_keyring(both.clone());
    says(&app, "k2").await;
    let rotating = ballast::engine::datakeys::rotate(&app.t.db, &clock, 7, |_, _, _| {});
    let working = async {
        let mut more = Vec::new();
        for i in 0..10 {
            more.push(enqueue(&app, &token, &format!("during-{i}")).await);
        }
        more
    };
    let (rotated, more) = tokio::join!(rotating, working);
    let rotated = rotated.unwrap();
    assert_eq!(rotated.retired, vec!["k1".to_owned()]);
    assert!(rotated.resealed > 0, "{rotated:?}");
    for id in ids.iter().chain(&more) {
        succeeded(&app.t.db, *id).await;
        assert_eq!(
            app.t.db.get_record(*id).await.unwrap().unwrap().input["secret"],
            SECRET
        );
    }
    for (column, v) in raw(&app.t.url, backend).await {
        assert!(!v.contains(SECRET), "{column}");
        assert!(sealed_with(&v, "k2"), "{column} not moved to k2: {v}");
    }
    // k1 retired: a node may go without it; a node without k2, or with
    // another key under the name k2, may not start.
    app.t.db.set_keyring(ring(Some("k2"), &[("k2", 9)]));
    migrate::up(&app.t.db, None).await.unwrap();
    app.t.db.set_keyring(ring(Some("k1"), &[("k1", 7)]));
    let refused = migrate::up(&app.t.db, None).await.unwrap_err().to_string();
    assert!(
        refused.contains("data key `k2`") && refused.contains("does not list"),
        "{refused}"
    );
    app.t.db.set_keyring(ring(Some("k2"), &[("k2", 1)]));
    let refused = migrate::up(&app.t.db, None).await.unwrap_err().to_string();
    assert!(refused.contains("check value differs"), "{refused}");
    // Going below migration 27 is refused while a key is in use.
    app.t.db.set_keyring(ring(None, &[("k2", 9)]));
    assert!(migrate::down(&app.t.db, 26).await.is_err());
    // No current key: the values go back to clear, every key retired.
    app.state.db.set_keyring(ring(None, &[("k2", 9)]));
    says(&app, "").await;
    let clear = ballast::engine::datakeys::rotate(&app.t.db, &clock, 50, |_, _, _| {})
        .await
        .unwrap();
    assert_eq!(clear.retired, vec!["k2".to_owned()]);
    let stored = raw(&app.t.url, backend).await;
    assert!(
        stored
            .iter()
            .any(|(c, v)| c == "records.input" && v.contains(SECRET))
    );
    assert!(
        stored
            .iter()
            .all(|(_, v)| !v.contains("\\u0001bs1") && !v.starts_with('\u{1}'))
    );
    // A retired id does not come back with another key.
    app.t.db.set_keyring(ring(Some("k1"), &[("k1", 3)]));
    let refused = migrate::up(&app.t.db, None).await.unwrap_err().to_string();
    assert!(refused.contains("a new key takes a new id"), "{refused}");
    app.t.db.set_keyring(ring(None, &[]));
    migrate::down(&app.t.db, 26).await.unwrap();
    migrate::up(&app.t.db, None).await.unwrap();
}

/// Waits until the node's heartbeat says it seals with `key` (`""`: none).
async fn says(app: &WebApp, key: &str) {
    crate::wait::until(
        "the node says its data key",
        Duration::from_secs(30),
        async || {
            let nodes = app.t.db.list_nodes().await.unwrap();
            let said: Vec<Option<String>> = nodes.into_iter().map(|n| n.data_key).collect();
            if !said.is_empty() && said.iter().all(|k| k.as_deref() == Some(key)) {
                Ok(())
            } else {
                Err(said)
            }
        },
    )
    .await;
}

#[tokio::test]
async fn sqlite_rotate_data_key_moves_every_value_while_the_node_runs() {
    rotation(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_rotate_data_key_moves_every_value_while_the_node_runs() {
    rotation(Backend::Postgres).await;
}

/// The commands an operator runs, as real processes on a SQLite file:
/// exports and backups stay sealed, `--decrypt` and `open-export` give the
/// values, `rotate-data-key` moves to a key read from the environment and
/// retires the old one, and commands refuse keys that cannot read the
/// database.
#[tokio::test]
async fn the_commands_keep_exports_and_backups_sealed_and_rotate_keys() {
    use crate::cli::{ballast, stdout};
    use base64::Engine as _;
    let b64 = |b: u8| base64::engine::general_purpose::STANDARD.encode([b; 32]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let url = format!("sqlite://{}?mode=rwc", path.join("x.db").display());
    std::fs::write(path.join("k1.key"), format!("{}\n", b64(7))).unwrap();
    let write_config = |key: &str, keys: &str| {
        let text = format!(
            "[database]\nurl = \"{url}\"\n[database.encryption]\n{key}\n[database.encryption.keys]\n{keys}\n"
        );
        std::fs::write(path.join("ballast.toml"), text).unwrap();
    };
    write_config("key = \"k1\"", "k1 = { key_file = \"k1.key\" }");
    // Records written by a node holding k1.
    let opts = ballast::store::ConnectOptions {
        keyring: ring(Some("k1"), &[("k1", 7)]),
        ..Default::default()
    };
    let db = Db::connect(&url, &opts).await.unwrap();
    migrate::up(&db, None).await.unwrap();
    let now = crate::helpers::wall_ms();
    let records = (0..3)
        .map(|i| ballast::store::NewRecord {
            pipeline: "enrich".into(),
            pipeline_version: None,
            external_key: Some(format!("k-{i}")),
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            input: json!({ "secret": SECRET, "i": i }),
            run_at: now + 3_600_000,
        })
        .collect();
    db.create_records(records, now).await.unwrap();
    db.close().await;
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let out = ballast(path, env, args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), stdout(&out), err)
    };
    let read = |name: &str| std::fs::read_to_string(path.join(name)).unwrap();
    let (ok, _, err) = run(&[], &["export", "--out", "sealed.jsonl"]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&[], &["export", "--decrypt", "--out", "clear.jsonl"]);
    assert!(ok, "{err}");
    assert!(!read("sealed.jsonl").contains(SECRET));
    assert_eq!(read("clear.jsonl").matches(SECRET).count(), 3);
    let (ok, opened, err) = run(&[], &["open-export", "sealed.jsonl"]);
    assert!(ok, "{err}");
    assert_eq!(opened, read("clear.jsonl"));
    let (ok, _, err) = run(&[], &["backup", "copy.db"]);
    assert!(ok, "{err}");
    let copy = std::fs::read(path.join("copy.db")).unwrap();
    assert!(!copy.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()));
    // A malformed key is a configuration error naming its file, not its value.
    std::fs::write(path.join("bad.key"), "not-a-key\n").unwrap();
    write_config("key = \"k1\"", "k1 = { key_file = \"bad.key\" }");
    let (ok, _, err) = run(&[], &["check-config"]);
    assert!(
        !ok && err.contains("bad.key") && !err.contains("not-a-key"),
        "{err}"
    );
    // Rotate to k2, read from the environment.
    write_config(
        "key = \"k2\"",
        "k1 = { key_file = \"k1.key\" }\nk2 = { key_env = \"DATA_KEY_2\" }",
    );
    let k2 = b64(9);
    let (ok, said, err) = run(&[("DATA_KEY_2", &k2)], &["rotate-data-key", "--batch", "2"]);
    assert!(ok, "{err}");
    assert!(said.contains("retired keys: k1"), "{said}");
    assert!(err.contains("records.input: 3 read, 3 re-sealed"), "{err}");
    // k1 may go now; without k2 nothing opens.
    write_config("key = \"k2\"", "k2 = { key_env = \"DATA_KEY_2\" }");
    let (ok, opened, err) = run(&[("DATA_KEY_2", &k2)], &["export", "--decrypt"]);
    assert!(ok && opened.matches(SECRET).count() == 3, "{err}");
    write_config("key = \"k1\"", "k1 = { key_file = \"k1.key\" }");
    let (ok, _, err) = run(&[], &["rotate-data-key"]);
    assert!(!ok && err.contains("data key `k2`"), "{err}");
    write_config("key = \"k2\"", "k2 = { key_env = \"DATA_KEY_2\" }");
    let (ok, _, err) = run(&[("DATA_KEY_2", &b64(1))], &["rotate-data-key"]);
    assert!(!ok && err.contains("check value differs"), "{err}");
}

/// Turning encryption on for a database kept in clear: the rotation seals
/// the old values and rewrites those records' search documents without
/// their words (searched by value before, by key only after).
async fn turned_on(backend: Backend) {
    let Some(t) = crate::helpers::TestDb::migrated(backend, "encryption_turned_on").await else {
        return;
    };
    let now = crate::helpers::wall_ms();
    let made =
        t.db.create_records(
            vec![ballast::store::NewRecord {
                pipeline: "enrich".into(),
                pipeline_version: None,
                external_key: Some("plain-one".into()),
                group: None,
                priority: ballast::domain::DEFAULT_PRIORITY,
                input: json!({ "secret": SECRET }),
                run_at: now + 3_600_000,
            }],
            now,
        )
        .await
        .unwrap();
    let id = made[0].record.id;
    t.db.index_records(&[id], &[], 0).await.unwrap();
    let found = |hits: Vec<ballast::domain::Record>| hits.iter().any(|r| r.id == id);
    assert!(
        found(t.db.search_records(SECRET, 10).await.unwrap()),
        "searched by value in clear"
    );
    t.db.set_keyring(ring(Some("k1"), &[("k1", 7)]));
    migrate::up(&t.db, None).await.unwrap();
    let clock = ballast::domain::SystemClock;
    let done = ballast::engine::datakeys::rotate(&t.db, &clock, 10, |_, _, _| {})
        .await
        .unwrap();
    assert_eq!(done.resealed, 1, "{done:?}");
    assert!(
        !found(t.db.search_records(SECRET, 10).await.unwrap()),
        "the words left the document"
    );
    assert!(found(t.db.search_records("plain-one", 10).await.unwrap()));
    let (column, stored) = raw(&t.url, backend)
        .await
        .into_iter()
        .find(|(c, _)| c == "records.input")
        .unwrap();
    assert!(sealed_with(&stored, "k1"), "{column}: {stored}");
}

#[tokio::test]
async fn sqlite_turning_encryption_on_seals_old_values_and_their_search_words() {
    turned_on(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_turning_encryption_on_seals_old_values_and_their_search_words() {
    turned_on(Backend::Postgres).await;
}
