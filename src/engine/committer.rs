//! Group commit. Workers hand their finished passes to one committer task
//! per engine; it writes every pass that arrived while the previous
//! transaction ran in one transaction (`Work::commit_many`), so a busy
//! node pays one durable commit, and a handful of multi-row statements, per
//! group instead of per record. An idle node commits a lone pass at once:
//! nothing waits for a group to fill. On PostgreSQL two groups are written
//! at once (with one, a group waited on the previous group's flush while
//! the cores idled); a record is never in two groups being written.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinError, JoinSet};

use crate::domain::{Clock, Record};
use crate::store::{Commit, Db, StoreResult};

/// The most passes written in one transaction.
const GROUP_MAX: usize = 1_000;

type Outcome = (Commit, StoreResult<Record>);

struct Job {
    commit: Commit,
    done: oneshot::Sender<Outcome>,
}

/// The handle workers commit through; the task ends when the last handle
/// is dropped.
pub(crate) struct Committer {
    jobs: mpsc::UnboundedSender<Job>,
    db: Db,
}

impl Committer {
    pub(crate) fn spawn(db: Db, clock: Arc<dyn Clock>) -> Self {
        let (jobs, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(db.clone(), rx, clock));
        Committer { jobs, db }
    }

    /// Commits one pass within the next group; gives the commit back with
    /// its result. `None` only if the task died with the pass (a panic):
    /// the lease then expires and another pass redoes the work, idempotency
    /// keys keeping it from paying twice.
    pub(crate) async fn commit(&self, commit: Commit) -> Option<Outcome> {
        let (done, wait) = oneshot::channel();
        if let Err(mpsc::error::SendError(mut job)) = self.jobs.send(Job { commit, done }) {
            // The task is gone (runtime shutting down): commit directly.
            let result = commit_alone(&self.db, &mut job.commit).await;
            return Some((job.commit, result));
        }
        wait.await.ok()
    }
}

async fn run(db: Db, mut rx: mpsc::UnboundedReceiver<Job>, clock: Arc<dyn Clock>) {
    let parallel = groups_at_once(&db);
    // A pass for a record already in a group (this one, or one being
    // written) waits for the next.
    let mut carry: Option<Job> = None;
    let mut writing: JoinSet<Vec<i64>> = JoinSet::new();
    let mut busy: HashSet<i64> = HashSet::new();
    loop {
        while let Some(done) = writing.try_join_next() {
            forget(&mut busy, done, writing.is_empty());
        }
        let first = match carry.take() {
            Some(job) => job,
            None => match rx.recv().await {
                Some(job) => job,
                None => break,
            },
        };
        // Room for a group, and none holding this record: passes arriving
        // meanwhile join this group.
        while writing.len() >= parallel || busy.contains(&first.commit.lease.record_id) {
            match writing.join_next().await {
                Some(done) => forget(&mut busy, done, writing.is_empty()),
                None => break,
            }
        }
        let mut ids = vec![first.commit.lease.record_id];
        let mut group = vec![first];
        busy.insert(ids[0]);
        while group.len() < GROUP_MAX {
            match rx.try_recv() {
                Ok(job) if busy.insert(job.commit.lease.record_id) => {
                    ids.push(job.commit.lease.record_id);
                    group.push(job);
                }
                Ok(job) => {
                    carry = Some(job);
                    break;
                }
                Err(_) => break,
            }
        }
        let (db, clock) = (db.clone(), clock.clone());
        writing.spawn(async move {
            write(&db, group, clock.as_ref()).await;
            ids
        });
    }
    while writing.join_next().await.is_some() {}
}

/// How many groups are written at once: two on PostgreSQL, so that one
/// group's statements run while another waits for its commit to reach
/// the disk (their records never overlap; rows are locked in id order and
/// counter rows in one order, on shards picked at random); one on SQLite,
/// whose one writer would only queue them.
fn groups_at_once(db: &Db) -> usize {
    match db {
        Db::Postgres(_) => 2,
        Db::Sqlite(_) => 1,
    }
}

/// A written group's records are free for the next; a group whose task
/// panicked cannot say which were its own, so when none is being written
/// every record is.
fn forget(busy: &mut HashSet<i64>, done: Result<Vec<i64>, JoinError>, idle: bool) {
    match done {
        Ok(ids) => {
            for id in ids {
                busy.remove(&id);
            }
        }
        Err(_) if idle => busy.clear(),
        Err(_) => {}
    }
}

/// Writes `commits` in one transaction (every write of the committer goes
/// through here). `Commit::new_steps` is a hint (naming none is always
/// right): a group that fails on a run's key while some commit named runs
/// new is written again naming none, so that no pass loses its replies.
async fn commit_group(db: &Db, commits: &mut [Commit]) -> StoreResult<Vec<StoreResult<Record>>> {
    match db.commit_many(commits).await {
        Err(e) if e.is_key_taken() && commits.iter().any(|c| !c.new_steps.is_empty()) => {
            tracing::error!(error = %e, group = commits.len(), "a step run named new was stored; writing the group again as upserts");
            for c in commits.iter_mut() {
                c.new_steps.clear();
            }
            db.commit_many(commits).await
        }
        written => written,
    }
}

/// `c` alone, through [`commit_group`].
async fn commit_alone(db: &Db, c: &mut Commit) -> StoreResult<Record> {
    let record_id = c.lease.record_id;
    let mut results = commit_group(db, std::slice::from_mut(c)).await?;
    results
        .pop()
        .unwrap_or(Err(crate::store::StoreError::LeaseLost { record_id }))
}

/// Writes one group and answers each of its passes.
async fn write(db: &Db, group: Vec<Job>, clock: &dyn Clock) {
    let (mut commits, waiters): (Vec<Commit>, Vec<_>) =
        group.into_iter().map(|j| (j.commit, j.done)).unzip();
    let started = clock.instant();
    let results = match commit_group(db, &mut commits).await {
        Ok(results) => results,
        Err(e) if commits.len() == 1 => vec![Err(e)],
        Err(e) => {
            // One bad pass must not sink the others: one by one.
            tracing::warn!(error = %e, group = commits.len(), "group commit failed; committing one by one");
            let mut each = Vec::with_capacity(commits.len());
            for c in &mut commits {
                each.push(commit_alone(db, c).await);
            }
            each
        }
    };
    tracing::debug!(
        group = commits.len(),
        took_us = (clock.instant() - started).as_micros() as u64,
        "group committed"
    );
    for ((commit, done), result) in commits.into_iter().zip(waiters).zip(results) {
        // A worker that stopped waiting (shutdown) is not an error.
        let _ = done.send((commit, result));
    }
}
