//! What this process knows of the machine it runs on: its host name and a
//! node id unique across restarts. Like [`SystemClock`](super::SystemClock),
//! these are the few reads of the environment the layers above share, kept
//! at the bottom so that no layer has to reach up for them.

use std::time::Duration;

/// How often a node tells the others it is alive.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

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
