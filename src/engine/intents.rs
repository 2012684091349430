//! Intents before the call (`at_most_once`), written in groups: a call
//! that asks while a writer is free is written at once, with whatever else
//! has asked; while every writer is busy, the calls that ask wait for the
//! next free one together. So a call waits for its own batch's commit, not
//! for one already under way as well, and a busy node still pays one
//! durable commit per batch of calls, not per call.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::domain::Clock;
use crate::store::{Db, NewIntent, StoreError};

/// The most intents written in one transaction.
const BATCH_MAX: usize = 1_000;

/// Batches written at most at once on PostgreSQL, which commits them side
/// by side (fewer where the pool is small: a third of its connections,
/// three at the default ten, the rest left to claims, commits and leases).
/// Each batch locks its records' rows in id order, as a group commit does,
/// so two batches never wait on each other in a circle. SQLite's one
/// writer would take them in turn: there one batch at a time gathers more.
const WRITERS: usize = 4;

/// How many batches `db` writes at once.
fn writers(db: &Db) -> usize {
    match db.backend() {
        crate::store::Backend::Postgres => (db.max_connections() as usize / 3).clamp(1, WRITERS),
        crate::store::Backend::Sqlite => 1,
    }
}

struct Ask {
    intent: NewIntent,
    done: oneshot::Sender<Result<i64, String>>,
}

/// The handle calls write their intents through; the task ends when the
/// last handle is dropped.
pub(crate) struct IntentWriter {
    asks: mpsc::UnboundedSender<Ask>,
}

impl IntentWriter {
    pub(crate) fn spawn(db: Db, clock: Arc<dyn Clock>) -> Self {
        let (asks, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, writers(&db), move |batch| {
            let (db, clock) = (db.clone(), clock.clone());
            async move { write(&db, batch, clock.as_ref()).await }
        }));
        IntentWriter { asks }
    }

    /// Writes `intent` durably; its id once it is, or why not (then the
    /// call must not be made).
    pub(crate) async fn write(&self, intent: NewIntent) -> Result<i64, String> {
        let (done, wait) = oneshot::channel();
        self.asks
            .send(Ask { intent, done })
            .map_err(|_| "the intent writer has stopped".to_owned())?;
        wait.await
            .unwrap_or_else(|_| Err("the intent writer has stopped".into()))
    }
}

/// Gathers the asks into batches and hands each to `write`, at most
/// `writers` at once.
async fn run<W, F>(mut rx: mpsc::UnboundedReceiver<Ask>, writers: usize, write: W)
where
    W: Fn(Vec<Ask>) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let writers = Arc::new(Semaphore::new(writers));
    while let Some(first) = rx.recv().await {
        // A free writer first: the asks that come meanwhile join this batch.
        let Ok(writer) = Arc::clone(&writers).acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < BATCH_MAX {
            match rx.try_recv() {
                Ok(ask) => batch.push(ask),
                Err(_) => break,
            }
        }
        batch.sort_by_key(|a| a.intent.record_id);
        let written = write(batch);
        tokio::spawn(async move {
            written.await;
            drop(writer);
        });
    }
}

/// Writes one batch and answers each of its calls.
async fn write(db: &Db, batch: Vec<Ask>, clock: &dyn Clock) {
    let intents: Vec<NewIntent> = batch.iter().map(|a| a.intent.clone()).collect();
    let started = clock.instant();
    let written: Result<Vec<Result<i64, StoreError>>, StoreError> =
        db.record_intents(&intents).await;
    tracing::debug!(
        intents = intents.len(),
        took_us = (clock.instant() - started).as_micros() as u64,
        "intents written"
    );
    match written {
        Ok(ids) => {
            for (ask, id) in batch.into_iter().zip(ids) {
                let _ = ask
                    .done
                    .send(id.map_err(|e| format!("the call's intent: {e}")));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, intents = intents.len(), "cannot write call intents; the calls are not made");
            let why = format!("cannot write the call's intent: {e}");
            for ask in batch {
                let _ = ask.done.send(Err(why.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Mutex;

    fn ask(record_id: i64) -> (Ask, oneshot::Receiver<Result<i64, String>>) {
        let (done, answer) = oneshot::channel();
        let intent = NewIntent {
            lease: crate::store::Lease {
                record_id,
                owner: "n".into(),
                token: 1,
            },
            record_id,
            step: "call".into(),
            provider: Some("p".into()),
            attempt_no: 1,
            node: None,
            sent_at: 0,
            request: None,
        };
        (Ask { intent, done }, answer)
    }

    /// A batch that asks while others are being written is written beside
    /// them (up to `WRITERS` at once), its records in id order; once every
    /// writer is busy, the asks that come wait together for the next one.
    /// (Written one batch at a time, the second would never start while
    /// the first is held: the test would not end.)
    #[tokio::test]
    async fn batches_are_written_side_by_side_up_to_the_writers() {
        const { assert!(WRITERS > 1) };
        let (asks, rx) = mpsc::unbounded_channel();
        let (started, mut writes) = mpsc::unbounded_channel::<Vec<i64>>();
        let gate = Arc::new(Mutex::new(()));
        let held = Arc::clone(&gate).lock_owned().await;
        let write = move |batch: Vec<Ask>| {
            let (started, gate) = (started.clone(), Arc::clone(&gate));
            async move {
                let ids = batch.iter().map(|a| a.intent.record_id).collect();
                let _ = started.send(ids);
                let _open = gate.lock().await;
                for a in batch {
                    let _ = a.done.send(Ok(a.intent.record_id));
                }
            }
        };
        tokio::spawn(run(rx, WRITERS, write));
        let mut answers = Vec::new();
        for id in 0..WRITERS as i64 {
            let (a, answer) = ask(100 - id);
            asks.send(a).map_err(|_| ()).unwrap();
            answers.push(answer);
            // Written at once, though every batch before it still waits.
            assert_eq!(writes.recv().await, Some(vec![100 - id]));
        }
        // Every writer busy: these wait, then go together, in id order
        // (with a writer free, 7 would have gone alone).
        for id in [7, 3, 5] {
            let (a, answer) = ask(id);
            asks.send(a).map_err(|_| ()).unwrap();
            answers.push(answer);
        }
        drop(held);
        assert_eq!(writes.recv().await, Some(vec![3, 5, 7]));
        for answer in answers {
            assert!(answer.await.unwrap().is_ok());
        }
    }
}
