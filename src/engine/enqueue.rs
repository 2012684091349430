//! Intake: records enqueued one at a time or in a batch, each pinned to
//! its pipeline's current version; a new record wakes this node's workers.

use serde_json::Value;

use super::{Engine, Inner, lock};
use crate::domain::{DEFAULT_PRIORITY, UnixMs};
use crate::store::{Created, NewRecord, StoreError};

/// A record to enqueue ([`Engine::enqueue`], [`Engine::enqueue_batch`]).
#[derive(Debug, Clone)]
pub struct Enqueue {
    pub pipeline: String,
    /// Its group (a tenant, say): the pipeline's groups share the workers
    /// fairly (`domain::fair`), and the pipeline's `group_concurrency`
    /// caps each. A repeated key returns the record it named, whatever its
    /// group.
    pub group: Option<String>,
    /// 0 to 9 (9 first within its queue); `None`: 5.
    pub priority: Option<u8>,
    /// Makes it idempotent: the same key returns the same record.
    pub key: Option<String>,
    pub input: Value,
    /// Due then (scheduled work: the record waits `pending` until then);
    /// `None`: now.
    pub run_at: Option<UnixMs>,
}

impl Enqueue {
    /// `input` for `pipeline`, due now, in no group; `key` makes it
    /// idempotent.
    pub fn new(pipeline: impl Into<String>, key: Option<&str>, input: Value) -> Enqueue {
        Enqueue {
            pipeline: pipeline.into(),
            group: None,
            priority: None,
            key: key.map(str::to_owned),
            input,
            run_at: None,
        }
    }

    /// Into `group` (none: no group).
    pub fn in_group(mut self, group: Option<&str>) -> Enqueue {
        self.group = group.map(str::to_owned);
        self
    }

    /// At `priority` (none: the default).
    pub fn with_priority(mut self, priority: Option<u8>) -> Enqueue {
        self.priority = priority;
        self
    }

    /// The row to write: pinned to `version`, due at its time or `now`.
    fn into_record(self, version: i64, now: UnixMs) -> NewRecord {
        NewRecord {
            pipeline: self.pipeline,
            pipeline_version: Some(version),
            external_key: self.key,
            group: self.group,
            priority: self.priority.unwrap_or(DEFAULT_PRIORITY),
            input: self.input,
            run_at: self.run_at.unwrap_or(now),
        }
    }

    /// Due at `run_at` instead of now.
    pub fn at(mut self, run_at: UnixMs) -> Enqueue {
        self.run_at = Some(run_at);
        self
    }
}

/// The longest group name, in characters.
pub const MAX_GROUP_LEN: usize = 200;

/// A group is named or absent: an empty name would be the same queue as
/// none, and a very long one is a mistake.
pub fn check_group(group: Option<&str>) -> Result<(), StoreError> {
    match group {
        Some("") => Err(StoreError::Invalid(
            "group is empty (leave it out for none)".into(),
        )),
        Some(g) if g.chars().count() > MAX_GROUP_LEN => Err(StoreError::Invalid(format!(
            "group is longer than {MAX_GROUP_LEN} characters"
        ))),
        // A filter by group is an exact match: a group that only spaces
        // tell from another could not be told apart when selected.
        Some(g) if g.trim() != g => Err(StoreError::Invalid(
            "group begins or ends with a space".into(),
        )),
        _ => Ok(()),
    }
}

/// A priority is 0 to 9.
pub fn check_priority(priority: Option<u8>) -> Result<(), StoreError> {
    crate::domain::check_priority(priority).map_err(StoreError::Invalid)
}

impl Engine {
    /// Enqueues a record, idempotent on (pipeline, external key), pinned to
    /// its pipeline's current version, and wakes the workers if it is new.
    pub async fn enqueue(&self, item: Enqueue) -> Result<Created, StoreError> {
        enqueue_in(&self.inner, item).await
    }

    /// Enqueues records of any pipelines and groups at once, all or none:
    /// one statement on PostgreSQL, one transaction on SQLite; at most
    /// [`MAX_BATCH`](crate::store::MAX_BATCH). An unknown pipeline or a bad
    /// group refuses the whole batch, naming the item (counted from 0).
    /// Keys make each idempotent, as for [`enqueue`](Self::enqueue).
    pub async fn enqueue_batch(&self, items: Vec<Enqueue>) -> Result<Vec<Created>, StoreError> {
        let now = self.inner.clock.now_ms();
        let mut batch = Vec::with_capacity(items.len());
        {
            let current = lock(&self.inner.current);
            for (i, item) in items.into_iter().enumerate() {
                check_group(item.group.as_deref())
                    .and_then(|()| check_priority(item.priority))
                    .map_err(|e| StoreError::Invalid(format!("item {i}: {e}")))?;
                let version = current.get(&item.pipeline).copied().ok_or_else(|| {
                    StoreError::Invalid(format!("item {i}: unknown pipeline `{}`", item.pipeline))
                })?;
                batch.push(item.into_record(version, now));
            }
        }
        insert(&self.inner, batch, now).await
    }
}

/// Writes `batch` and wakes this node's workers if a record is new.
async fn insert(i: &Inner, batch: Vec<NewRecord>, now: UnixMs) -> Result<Vec<Created>, StoreError> {
    let created = i.db.create_records(batch, now).await?;
    if created.iter().any(|c| c.created) {
        i.wake.notify_one();
    }
    Ok(created)
}

/// [`Engine::enqueue`] on the engine's insides (a `pipeline` step starts
/// its child through it).
pub(super) async fn enqueue_in(i: &Inner, item: Enqueue) -> Result<Created, StoreError> {
    check_group(item.group.as_deref())?;
    check_priority(item.priority)?;
    let version = lock(&i.current).get(&item.pipeline).copied();
    let Some(version) = version else {
        return Err(StoreError::Invalid(format!(
            "unknown pipeline `{}`",
            item.pipeline
        )));
    };
    let now = i.clock.now_ms();
    let batch = vec![item.into_record(version, now)];
    let mut created = insert(i, batch, now).await?;
    created
        .pop()
        .ok_or_else(|| StoreError::Invalid("nothing enqueued".into()))
}
