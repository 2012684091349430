//! Several `ballast serve` processes on one PostgreSQL database, governing
//! one provider as one (issue 18): its rate limit and concurrency cap hold
//! for the cluster, and a node killed with SIGKILL mid-run loses nothing.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ballast::domain::RecordState;
use ballast::store::{Backend, NewRecord, Store};
use serde_json::json;

use crate::engine::{Counting, single_step_toml, wait_at_rest};
use crate::faults::{Serve, signal};
use crate::helpers::TestDb;

/// Three serve processes share 600 records against a provider answering in
/// 50 ms, limited to 100 calls a second and 12 in flight. A third of the way
/// through, one is killed (SIGKILL): the other two finish its records. In
/// no second do more than 100 calls reach the provider, never more than 12
/// are in flight, and every record succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_serve_processes_hold_a_provider_as_one() {
    let Some(t) = TestDb::migrated(Backend::Postgres, "three_serves").await else {
        return;
    };
    let n = 600;
    let (provider, url) = Counting::spawn(Duration::from_millis(50)).await;
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    // Leases long enough that a commit slowed by a loaded machine cannot
    // outlive one (a lost lease may call a record again, which the calls'
    // count below would take for the kill's doing).
    let toml = format!(
        "[database]\nurl = \"{}\"\n[engine]\nlease = \"8s\"\n{}",
        t.url,
        single_step_toml(&url, "concurrency = 12\nrate_limits = [\"100/s\"]")
    );
    for d in &dirs {
        std::fs::write(d.path().join("ballast.toml"), &toml).unwrap();
    }
    let env = [("BALLAST_ADMIN_PASSWORD", "three-serves-admin-pw")];
    let mut nodes = Vec::new();
    for d in &dirs {
        nodes.push(Serve::start(d.path(), &env).await);
    }
    let now = crate::helpers::wall_ms();
    let records = (0..n)
        .map(|i| NewRecord {
            pipeline: "pay".into(),
            group: None,
            pipeline_version: None,
            external_key: Some(format!("r-{i}")),
            input: json!({}),
            run_at: now,
        })
        .collect();
    t.db.create_records(records, now).await.unwrap();
    crate::helpers::poll_until("a third done", Duration::from_secs(60), || async {
        let counts = t.db.state_counts().await.unwrap();
        let done: i64 = counts
            .iter()
            .filter(|c| c.state == RecordState::Succeeded)
            .map(|c| c.count)
            .sum();
        (done >= n / 3).then_some(())
    })
    .await;
    // Killed while it holds records (its leases run out and the others
    // take them over).
    let killed = nodes.remove(0);
    let pid = i64::from(killed.child.id());
    let id =
        t.db.list_nodes()
            .await
            .unwrap()
            .into_iter()
            .find(|n| n.pid == pid)
            .unwrap()
            .id;
    crate::helpers::poll_until(
        "the node holds records",
        Duration::from_secs(30),
        || async {
            crate::helpers::lease_holders(&t.db)
                .await
                .contains(&id)
                .then_some(())
        },
    )
    .await;
    signal(&killed.child, "KILL");
    drop(killed);
    let took = wait_at_rest(&t.db, n, Duration::from_secs(120)).await;
    for node in nodes {
        node.stop().await;
    }
    let calls = provider.arrivals.lock().unwrap().len();
    let busiest = provider.busiest(1_000);
    let most = provider.most_in_flight.load(Ordering::SeqCst);
    println!(
        "three serve processes: {n} records ({calls} calls) at rest {took:?} after the kill; \
         busiest second {busiest} (limit 100), most in flight {most} (cap 12)"
    );
    assert!(busiest <= 100, "{busiest} calls in one second");
    assert!(most <= 12, "{most} calls in flight at once");
    let counts = t.db.state_counts().await.unwrap();
    assert_eq!(counts.len(), 1, "{counts:?}");
    assert_eq!(
        (counts[0].state, counts[0].count),
        (RecordState::Succeeded, n),
        "0 lost"
    );
    // The killed node's calls in flight may have been made again by the
    // node that took its records over; nothing else is called twice.
    assert!(
        calls >= n as usize && calls <= n as usize + 12,
        "{calls} calls"
    );
}
