//! Group commit. Workers hand their finished passes to one committer task
//! per engine; it writes every pass that arrived while the previous
//! transaction ran in one transaction (`Store::commit_many`), so a busy
//! node pays one durable commit, and a handful of multi-row statements, per
//! group instead of per record. An idle node commits a lone pass at once:
//! nothing waits for a group to fill.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::domain::{Clock, Record};
use crate::store::{Commit, Db, Store, StoreResult};

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
        if let Err(mpsc::error::SendError(job)) = self.jobs.send(Job { commit, done }) {
            // The task is gone (runtime shutting down): commit directly.
            let result = self.db.commit(&job.commit).await;
            return Some((job.commit, result));
        }
        wait.await.ok()
    }
}

async fn run(db: Db, mut rx: mpsc::UnboundedReceiver<Job>, clock: Arc<dyn Clock>) {
    // A pass for a record already in the group waits for the next one.
    let mut carry: Option<Job> = None;
    loop {
        let first = match carry.take() {
            Some(job) => job,
            None => match rx.recv().await {
                Some(job) => job,
                None => return,
            },
        };
        let mut ids = HashSet::from([first.commit.lease.record_id]);
        let mut group = vec![first];
        while group.len() < GROUP_MAX {
            match rx.try_recv() {
                Ok(job) if ids.insert(job.commit.lease.record_id) => group.push(job),
                Ok(job) => {
                    carry = Some(job);
                    break;
                }
                Err(_) => break,
            }
        }
        let (commits, waiters): (Vec<Commit>, Vec<_>) =
            group.into_iter().map(|j| (j.commit, j.done)).unzip();
        let started = clock.instant();
        let results = match db.commit_many(&commits).await {
            Ok(results) => results,
            Err(e) if commits.len() == 1 => vec![Err(e)],
            Err(e) => {
                // One bad pass must not sink the others: one by one.
                tracing::warn!(error = %e, group = commits.len(), "group commit failed; committing one by one");
                let mut each = Vec::with_capacity(commits.len());
                for c in &commits {
                    each.push(db.commit(c).await);
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
}
