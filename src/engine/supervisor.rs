//! The background loops beside the dispatch loop, started and stopped in
//! one place. Each loop is a type of its own module implementing
//! [`Loop`]; a new one is its module plus one line in
//! [`Supervisor::start`], whose order is the order they start in and, but
//! for the [`Stop::Last`] ones (stopped after the node's hand-back), the
//! order they stop in.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Engine;
use super::confirm::Confirmations;
use super::leases::LeaseKeeper;
use super::listen::Listener;
use super::notify::Notifier;
use super::resume::Resumer;
use super::retention::Purger;
use super::schedule::Scheduler;
use super::search::SearchIndexer;
use super::stats::StatsFlusher;
use super::sync::ProviderSync;

/// What a loop gives back once it has stopped (a task lease, the last
/// figures).
pub(super) type HandBack = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How the supervisor stops a loop at shutdown.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stop {
    /// Aborted (and waited for) before the node hands back its records'
    /// leases and its permits.
    Abort,
    /// Stops by itself once the shutdown token is cancelled: its step under
    /// way (named, for the warning) is let finish, for at most 5 s.
    Finish(&'static str),
    /// Keeps running while the node hands back what it holds; aborted
    /// after that, not waited for.
    Last,
}

/// A background loop of the engine.
pub(super) trait Loop: Send + Sized + 'static {
    /// How it is stopped at shutdown.
    const STOP: Stop = Stop::Abort;

    /// Runs until `shutdown` (or until aborted).
    fn run(self, shutdown: CancellationToken) -> impl Future<Output = ()> + Send + 'static;

    /// What to do once it has stopped, made before it starts.
    fn hand_back(&self) -> Option<HandBack> {
        None
    }
}

/// A loop started.
struct Running {
    task: JoinHandle<()>,
    stop: Stop,
    hand_back: Option<HandBack>,
}

/// Every background loop of one [`Engine::run`].
pub(super) struct Supervisor {
    shutdown: CancellationToken,
    running: Vec<Running>,
}

impl Supervisor {
    /// Reads the providers' shared state once (pauses, open breakers and
    /// peers are known before the first claim), then starts every loop.
    pub(super) async fn start(engine: &Engine, shutdown: &CancellationToken) -> Supervisor {
        ProviderSync::of(engine).sync_providers_once().await;
        let mut s = Supervisor {
            shutdown: shutdown.clone(),
            running: Vec::new(),
        };
        s.spawn(LeaseKeeper::of(engine));
        s.spawn(ProviderSync::of(engine));
        s.spawn(StatsFlusher::of(engine));
        s.spawn(Confirmations::of(engine));
        s.spawn(Resumer::of(engine));
        s.spawn(Scheduler::of(engine));
        s.spawn(Purger::of(engine));
        s.spawn(SearchIndexer::of(engine));
        s.spawn(Notifier::of(engine));
        if let Some(listener) = Listener::of(engine) {
            s.spawn(listener);
        }
        s
    }

    fn spawn<L: Loop>(&mut self, l: L) {
        let hand_back = l.hand_back();
        let task = tokio::spawn(l.run(self.shutdown.clone()));
        self.running.push(Running {
            task,
            stop: L::STOP,
            hand_back,
        });
    }

    /// Stops every loop, in the order they started: first all but the
    /// [`Stop::Last`] ones, then `hand_back` (the node's leases and
    /// permits go back), then the last ones. Each loop's own hand-back
    /// follows its stop.
    pub(super) async fn stop(self, hand_back: impl Future<Output = ()>) {
        let (last, first): (Vec<Running>, Vec<Running>) = self
            .running
            .into_iter()
            .partition(|r| matches!(r.stop, Stop::Last));
        for r in first {
            match r.stop {
                Stop::Finish(what) => finish_within(r.task, what).await,
                Stop::Abort | Stop::Last => {
                    r.task.abort();
                    let _ = r.task.await;
                }
            }
            if let Some(h) = r.hand_back {
                h.await;
            }
        }
        hand_back.await;
        for r in last {
            r.task.abort();
            if let Some(h) = r.hand_back {
                h.await;
            }
        }
    }
}

/// Lets a background task that stops by itself at shutdown finish its
/// step, for at most 5 s; then stops it, saying so.
async fn finish_within(mut task: JoinHandle<()>, what: &str) {
    if tokio::time::timeout(Duration::from_secs(5), &mut task)
        .await
        .is_err()
    {
        tracing::warn!("{what} outlasted 5 s of shutdown; stopped");
        task.abort();
        let _ = task.await;
    }
}
