//! `ballast rotate-data-key`: every value sealed at rest moved to the
//! current data key (or into clear, when none is set), in batches while
//! the nodes run, then the keys no value uses any more retired.

use crate::domain::{Clock, Node, UnixMs};
use crate::store::{Db, Resealed, SealedColumn, StoreError};

/// How many full passes a rotation makes at most: the first moves the
/// values, the next finds none left (or the few a node wrote meanwhile).
const MAX_PASSES: u32 = 4;

/// What a rotation did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Rotation {
    pub passes: u32,
    pub scanned: u64,
    pub resealed: u64,
    /// The keys retired at the end: no value is sealed with them.
    pub retired: Vec<String>,
}

/// The live nodes (heard from within three heartbeats) that seal new
/// values with another key than `target` (`None`: in clear), each as
/// `id (key)`. A node from before migration 27 says nothing: in clear.
fn sealing_otherwise(nodes: &[Node], now: UnixMs, target: Option<&str>) -> Vec<String> {
    let horizon = now - 3 * crate::domain::host::HEARTBEAT_EVERY.as_millis() as i64;
    nodes
        .iter()
        .filter(|n| n.heartbeat_at > horizon)
        .filter(|n| n.data_key.as_deref().unwrap_or("") != target.unwrap_or(""))
        .map(|n| match n.data_key.as_deref().filter(|k| !k.is_empty()) {
            Some(k) => format!("{} (key {k})", n.id),
            None => format!("{} (in clear)", n.id),
        })
        .collect()
}

/// Refuses while a live node seals with another key than the rotation's.
async fn every_node_seals_with(
    db: &Db,
    clock: &dyn Clock,
    target: Option<&str>,
) -> Result<(), StoreError> {
    let others = sealing_otherwise(&db.list_nodes().await?, clock.now_ms(), target);
    if others.is_empty() {
        return Ok(());
    }
    Err(StoreError::Keys(format!(
        "nodes still seal new values otherwise: {}; reload them with the new configuration \
         (each says its key with its next heartbeat, within {} s), then run rotate-data-key again",
        others.join(", "),
        crate::domain::host::HEARTBEAT_EVERY.as_secs()
    )))
}

/// Re-seals every sealed column in batches of `batch`, pass after pass
/// until one moves nothing, then retires every key but the current one.
/// Refused, before it starts and before it retires a key, while a live
/// node seals with another key. `progress` hears each column's pass.
pub async fn rotate(
    db: &Db,
    clock: &dyn Clock,
    batch: u32,
    mut progress: impl FnMut(u32, SealedColumn, &Resealed),
) -> Result<Rotation, StoreError> {
    let target = db.keyring().current().map(str::to_owned);
    every_node_seals_with(db, clock, target.as_deref()).await?;
    let mut done = Rotation::default();
    for pass in 1..=MAX_PASSES {
        done.passes = pass;
        let mut moved = 0;
        for column in SealedColumn::ALL {
            let total = reseal_column(db, column, batch).await?;
            moved += total.resealed + total.raced;
            done.scanned += total.scanned;
            done.resealed += total.resealed;
            progress(pass, column, &total);
        }
        if moved == 0 {
            every_node_seals_with(db, clock, target.as_deref()).await?;
            done.retired = db
                .retire_data_keys(target.as_deref(), clock.now_ms())
                .await?;
            return Ok(done);
        }
    }
    Err(StoreError::Keys(format!(
        "values were still being written with another data key after {MAX_PASSES} passes: \
         reload every node with the new configuration, then run rotate-data-key again"
    )))
}

/// One pass over a column: its batches' figures summed.
async fn reseal_column(db: &Db, column: SealedColumn, batch: u32) -> Result<Resealed, StoreError> {
    let mut total = Resealed::default();
    let mut after = 0;
    loop {
        let r = db.reseal(column, after, batch).await?;
        total.scanned += r.scanned;
        total.resealed += r.resealed;
        total.raced += r.raced;
        match r.next {
            Some(next) => after = next,
            None => return Ok(total),
        }
    }
}
