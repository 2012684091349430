//! Intents before the call (`at_most_once`), written in groups: every call
//! that asks while the previous batch is being written goes into the next
//! one, so a busy node pays one durable commit per batch of calls, not per
//! call; a lone call is written at once.

use tokio::sync::{mpsc, oneshot};

use crate::store::{Db, NewIntent, StoreError};

/// The most intents written in one transaction.
const BATCH_MAX: usize = 1_000;

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
    pub(crate) fn spawn(db: Db) -> Self {
        let (asks, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(db, rx));
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

async fn run(db: Db, mut rx: mpsc::UnboundedReceiver<Ask>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < BATCH_MAX {
            match rx.try_recv() {
                Ok(ask) => batch.push(ask),
                Err(_) => break,
            }
        }
        let intents: Vec<NewIntent> = batch.iter().map(|a| a.intent.clone()).collect();
        let written: Result<Vec<Result<i64, StoreError>>, StoreError> =
            db.record_intents(&intents).await;
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
}
