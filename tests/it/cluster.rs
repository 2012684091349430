//! Several `ballast serve` processes on one PostgreSQL database, governing
//! one provider as one (issue 18): its rate limit and concurrency cap hold
//! for the cluster, and a node killed with SIGKILL mid-run loses nothing.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ballast::domain::RecordState;
use ballast::store::{Backend, NewRecord};
use serde_json::json;

use crate::engine::{Counting, TRIP_MS, single_step_toml, wait_at_rest};
use crate::faults::{Serve, signal};
use crate::helpers::TestDb;

/// Three serve processes share 600 records against a provider answering in
/// 50 ms, limited to 100 calls a second and 12 in flight. A tenth of the way
/// through, one is killed (SIGKILL): the other two finish its records. In
/// no second do more than 100 calls reach the provider (counted over a
/// second less the longest trip from node to provider, `TRIP_MS`: a call
/// let through just before a second began may arrive just after), never
/// more than 12 are in flight, and every record succeeds.
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
            priority: ballast::domain::DEFAULT_PRIORITY,
            pipeline_version: None,
            external_key: Some(format!("r-{i}")),
            input: json!({}),
            run_at: now,
        })
        .collect();
    t.db.create_records(records, now).await.unwrap();
    // Killed while it holds records, some way into the run (its leases
    // run out and the others take them over). Asked together: a node may
    // hold nothing late in the run, the others' claims having taken what
    // was left, so "a third done, then holding" could wait for nothing.
    let killed = nodes.remove(0);
    let pid = i64::from(killed.child.id());
    crate::helpers::poll_until(
        "a tenth done, the node holding records",
        Duration::from_secs(60),
        || async {
            let node = t.db.list_nodes().await.unwrap();
            let id = node.into_iter().find(|n| n.pid == pid)?.id;
            let counts = t.db.state_counts().await.unwrap();
            let done: i64 = counts
                .iter()
                .filter(|c| c.state == RecordState::Succeeded)
                .map(|c| c.count)
                .sum();
            let holds = crate::helpers::lease_holders(&t.db).await.contains(&id);
            (done >= n / 10 && holds).then_some(())
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
    let busiest = provider.busiest_sent(1_000, TRIP_MS);
    let most = provider.most_in_flight.load(Ordering::SeqCst);
    println!(
        "three serve processes: {n} records ({calls} calls) at rest {took:?} after the kill; \
         busiest second less {TRIP_MS} ms {busiest} (limit 100), most in flight {most} (cap 12)"
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

/// A cron schedule firing every second on two `ballast serve` processes:
/// over ten ticks and more, each tick fired once (one record per tick, no
/// tick left out between the first and the last), by whichever node
/// came first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_schedule_on_two_serve_processes_fires_each_tick_once() {
    let Some(t) = TestDb::migrated(Backend::Postgres, "two_serve_schedule").await else {
        return;
    };
    let (_provider, url) = Counting::spawn(Duration::from_millis(5)).await;
    let dirs: Vec<tempfile::TempDir> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let toml = format!(
        "[database]\nurl = \"{}\"\n[pipelines.pay]\nschedule = {{ cron = \"* * * * * *\", input = {{ n = 1 }} }}\n{}",
        t.url,
        single_step_toml(&url, "")
    );
    for d in &dirs {
        std::fs::write(d.path().join("ballast.toml"), &toml).unwrap();
    }
    let env = [("BALLAST_ADMIN_PASSWORD", "two-serves-admin-pw")];
    let mut nodes = Vec::new();
    for d in &dirs {
        nodes.push(Serve::start(d.path(), &env).await);
    }
    let ticks = || async {
        let records =
            t.db.list_records(&ballast::store::RecordFilter {
                key_prefix: Some("schedule:".into()),
                limit: 500,
                ..Default::default()
            })
            .await
            .unwrap()
            .items;
        let mut ticks: Vec<i64> = records
            .iter()
            .map(|r| {
                let key = r.external_key.as_deref().unwrap();
                ballast::domain::time::parse_utc(key.trim_start_matches("schedule:")).unwrap()
            })
            .collect();
        ticks.sort_unstable();
        ticks
    };
    // Both nodes are up before the first tick counted here.
    let from = crate::helpers::wall_ms();
    crate::helpers::poll_until("twelve ticks fired", Duration::from_secs(60), || async {
        let n = ticks().await.iter().filter(|&&t| t > from).count();
        (n >= 12).then_some(())
    })
    .await;
    for node in &nodes {
        signal(&node.child, "TERM");
    }
    for mut node in nodes {
        let _ = node.child.wait();
    }
    let all = ticks().await;
    let counted: Vec<i64> = all.iter().copied().filter(|&t| t > from).collect();
    println!(
        "{} ticks fired in all, {} since both nodes were up",
        all.len(),
        counted.len()
    );
    assert!(counted.len() >= 12, "{counted:?}");
    // One record per tick is the key's doing; none left out is the
    // watermark's.
    for w in all.windows(2) {
        assert_eq!(w[1] - w[0], 1_000, "a tick left out: {all:?}");
    }
    // Each record was made by one node, as its log says.
    let by_node: Vec<usize> = dirs
        .iter()
        .map(|d| {
            let log = std::fs::read_to_string(d.path().join("serve.log")).unwrap();
            log.lines().filter(|l| l.contains("schedule fired")).count()
        })
        .collect();
    println!("fired by each node: {by_node:?}");
    assert_eq!(by_node.iter().sum::<usize>(), all.len());
    let rows = t.db.schedules().await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].last_tick, all.last().copied());
}

/// Nodes wake each other with LISTEN/NOTIFY: a `ballast serve` whose
/// workers sleep up to ten minutes with nothing due (`engine.idle_max`)
/// takes a record another process (`ballast enqueue`) adds while it
/// sleeps, within a bound only the notification explains (a minute, a
/// tenth of its sleep). The first record makes sure it is asleep: the
/// second comes after the node has finished the first and gone idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sleeping_node_is_woken_by_another_process_enqueueing() {
    let Some(t) = TestDb::migrated(Backend::Postgres, "notify_wake").await else {
        return;
    };
    let (_provider, url) = Counting::spawn(Duration::from_millis(1)).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[database]\nurl = \"{}\"\n[engine]\nidle_max = \"10m\"\n{}",
        t.url,
        single_step_toml(&url, "")
    );
    std::fs::write(dir.path().join("ballast.toml"), &toml).unwrap();
    let env = [("BALLAST_ADMIN_PASSWORD", "notify-wake-admin-pw")];
    let node = Serve::start(dir.path(), &env).await;
    for (i, key) in ["first", "second"].into_iter().enumerate() {
        let args = ["enqueue", "pay", "--key", key, "--input", "{}"];
        let out = crate::cli::ballast_off_runtime(dir.path(), &[], &args).await;
        assert!(out.status.success(), "{}", crate::cli::stderr(&out));
        let done = crate::wait::until(
            &format!("the {key} record is taken and done"),
            Duration::from_secs(60),
            async || {
                let counts = t.db.state_counts().await.unwrap();
                let ok: i64 = counts
                    .iter()
                    .filter(|c| c.state == RecordState::Succeeded)
                    .map(|c| c.count)
                    .sum();
                if ok == i as i64 + 1 {
                    Ok(ok)
                } else {
                    Err(counts)
                }
            },
        )
        .await;
        println!("notify wake-up: {key} record done ({done} in all)");
    }
    node.stop().await;
}
