//! What this process knows of the machine it runs on: its host name and a
//! node id unique across restarts. Like [`SystemClock`](super::SystemClock),
//! these are the few reads of the environment the layers above share, kept
//! at the bottom so that no layer has to reach up for them.

use std::time::Duration;

/// How often a node tells the others it is alive.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// The live nodes (heard from within three heartbeats of `now`) and the
/// configuration each runs, when they do not all run the same one; empty
/// otherwise. A node that says none (from before migration 18) is left
/// out.
pub fn config_split(nodes: &[super::Node], now: super::UnixMs) -> Vec<(String, String)> {
    let horizon = now - 3 * HEARTBEAT_EVERY.as_millis() as i64;
    let said: Vec<(String, String)> = nodes
        .iter()
        .filter(|n| n.heartbeat_at > horizon)
        .filter_map(|n| Some((n.id.clone(), n.config_version.clone()?)))
        .collect();
    let first = said.first().map(|s| s.1.clone());
    if said.iter().all(|s| Some(&s.1) == first.as_ref()) {
        return Vec::new();
    }
    said
}

/// A node id unique across restarts and machines: host, pid, and a random tail.
pub fn new_node_id() -> String {
    let host = hostname();
    let tail = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &tail[..8])
}

/// This machine's name, for node listings.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, heartbeat_at: i64, version: Option<&str>) -> crate::domain::Node {
        crate::domain::Node {
            id: id.into(),
            hostname: "h".into(),
            pid: 1,
            version: "0.1.0".into(),
            started_at: 0,
            heartbeat_at,
            draining: false,
            data_key: None,
            config_version: version.map(str::to_owned),
        }
    }

    #[test]
    fn nodes_differ_only_among_the_live_ones_that_say() {
        let now = 100_000;
        let same = [node("a", now, Some("v1")), node("b", now - 1, Some("v1"))];
        assert!(config_split(&same, now).is_empty());
        let quiet = [node("a", now, Some("v1")), node("old", now, None)];
        assert!(config_split(&quiet, now).is_empty(), "one that says none");
        let gone = [
            node("a", now, Some("v1")),
            node("dead", now - 60_000, Some("v0")),
        ];
        assert!(config_split(&gone, now).is_empty(), "a dead node's row");
        let split = [node("a", now, Some("v1")), node("b", now, Some("v2"))];
        assert_eq!(
            config_split(&split, now),
            vec![("a".into(), "v1".into()), ("b".into(), "v2".into())]
        );
    }
}
