//! The notifier: on every node, delivers the outbox's due notices
//! (`store::notices`) to each `[[notify]]` subscription, through the same
//! gates as any call to its provider (`engine::gate`: pause, concurrency,
//! rate limits, breaker), signed per Standard Webhooks with the notice's
//! id as `webhook-id` on every attempt. A 2xx delivers it; a reply the
//! provider's rules call a throttle holds it (no attempt spent) and
//! pauses the provider; anything else counts against the provider's
//! breaker and is retried with its backoff until `retry_for`, then given
//! up. A subscription failing for
//! `disable_after` is turned off by the store, audited.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::gate::{Gate, Held, heard, ms};
use super::http::Call;
use super::limits::ProviderRuntime;
use super::supervisor::{Loop, Stop};
use super::{Engine, Setup, Stopping};
use crate::config::Secret;
use crate::config::notify::{Format, NotifyConfig};
use crate::domain::breaker::Admit;
use crate::domain::{Outcome, UnixMs};
use crate::store::{Notice, NoticeOutcome, NoticeRound, NoticeSettle, StoreError};

/// How often a node looks for notices due.
const EVERY_MS: i64 = 1_000;
/// How long the notices of a subscription that cannot read its secret
/// wait before it tries again.
const SECRET_AGAIN_MS: i64 = 30_000;
/// How many of a subscription's notices one node sends at once.
const BATCH: u32 = 50;

/// The notifier of one node.
pub struct Notifier {
    engine: Engine,
}

impl Loop for Notifier {
    const STOP: Stop = Stop::Finish("notifications");

    /// Each subscription's round runs on its own: a subscriber slow to
    /// answer (up to its provider's timeout) delays its own next round
    /// only. A round that found a full batch starts that subscription's
    /// next at once; the rest come each second. The rounds run in this
    /// loop's task (no task outlives it); those under way when the node
    /// stops settle before the loop ends.
    async fn run(self, shutdown: CancellationToken) {
        let i = &self.engine.inner;
        let stopping = Stopping::default();
        let mut rounds = Rounds::default();
        let mut tick = i.clock.now_ms();
        loop {
            let now = i.clock.now_ms();
            // A clock set back is no reason to wait that long.
            if tick > now + EVERY_MS {
                tick = now;
            }
            if now >= tick {
                tick = now + EVERY_MS;
                self.start_rounds(&mut rounds, &stopping, None);
            }
            let ended = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(ended) = rounds.next() => Some(ended),
                () = i.clock.sleep_until(tick) => None,
            };
            if let Some((name, true)) = ended {
                self.start_rounds(&mut rounds, &stopping, Some(&name));
            }
        }
        // Gates stop waiting; deliveries under way are settled.
        stopping.stop();
        while rounds.next().await.is_some() {}
    }
}

/// One subscription's round: its name, and whether it found a full batch.
type Round<'a> = std::pin::Pin<Box<dyn Future<Output = (String, bool)> + Send + 'a>>;

/// The subscriptions' rounds under way on one node, one at most each.
#[derive(Default)]
struct Rounds<'a> {
    under_way: futures_util::stream::FuturesUnordered<Round<'a>>,
    names: std::collections::HashSet<String>,
}

impl<'a> Rounds<'a> {
    /// The next round to end, forgotten.
    async fn next(&mut self) -> Option<(String, bool)> {
        use futures_util::StreamExt;
        let (name, full) = self.under_way.next().await?;
        self.names.remove(&name);
        Some((name, full))
    }
}

impl Notifier {
    pub fn of(engine: &Engine) -> Notifier {
        Notifier {
            engine: engine.clone(),
        }
    }

    /// Sends each subscription's notices due now (those turned off, or
    /// whose provider is paused or its breaker open, wait), and returns
    /// when every subscription's round has ended. True when a
    /// subscription had a full batch (more may be due). For tests and
    /// tools on a node whose own loop does not run (the store keeps each
    /// record's notices in order either way).
    pub async fn deliver_due(&self, stopping: &Stopping) -> Result<bool, StoreError> {
        let setup = self.engine.inner.setup();
        let rounds = configured(&setup).map(|(sub, rt)| self.deliver_to(sub, rt, stopping));
        let mut full = false;
        let mut failed = None;
        for round in futures_util::future::join_all(rounds).await {
            match round {
                Ok(f) => full |= f,
                Err(e) => {
                    tracing::warn!(error = %e, "a subscription's round failed");
                    failed = Some(e);
                }
            }
        }
        match failed {
            Some(e) if !full => Err(e),
            _ => Ok(full),
        }
    }

    /// Starts a round for each configured subscription (or for `only`)
    /// that has none under way. The round keeps the subscription and
    /// provider it started with (a reload meanwhile applies to the next).
    /// Reads nothing: the rounds under way are not polled while this runs.
    fn start_rounds<'a>(
        &'a self,
        rounds: &mut Rounds<'a>,
        stopping: &'a Stopping,
        only: Option<&str>,
    ) {
        let setup = self.engine.inner.setup();
        for (sub, rt) in configured(&setup) {
            if only.is_some_and(|n| n != sub.name) || !rounds.names.insert(sub.name.clone()) {
                continue;
            }
            let (sub, rt) = (sub.clone(), rt.clone());
            rounds.under_way.push(Box::pin(async move {
                let full = self
                    .deliver_to(&sub, &rt, stopping)
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(subscription = %sub.name, error = %e, "a subscription's round failed");
                        false
                    });
                (sub.name, full)
            }));
        }
    }

    /// Sends `sub`'s notices due now, unless its provider is paused or its
    /// breaker open (or `sub` is turned off: the claim takes none); as many
    /// at once as the provider's concurrency. True when that many were due
    /// (more may be).
    async fn deliver_to(
        &self,
        sub: &NotifyConfig,
        rt: &ProviderRuntime,
        stopping: &Stopping,
    ) -> Result<bool, StoreError> {
        let i = &self.engine.inner;
        let now = i.clock.now_ms();
        let held = rt.is_paused() || matches!(rt.breaker().admit(now), Admit::Wait(_));
        if held || stopping.is_set() {
            return Ok(false);
        }
        // A delivery under way holds its notice this long: then another
        // node may send it (at least once).
        let lease = 2 * ms(rt.config.timeout.0) + 5_000;
        let batch = BATCH.min(rt.config.concurrency.max(1));
        let due =
            i.db.claim_notices(&sub.name, now, now + lease, batch)
                .await?;
        if due.is_empty() {
            return Ok(false);
        }
        // Read when there is something to sign (it may be a file).
        let secret = match read_secret(sub).await {
            Ok(s) => s,
            Err(why) => {
                tracing::error!(subscription = %sub.name, error = %why, "a subscription cannot read its secret");
                // Looked for again in a while, not every round: the
                // error is logged each time.
                let later = NoticeOutcome::Deferred {
                    at: now + SECRET_AGAIN_MS,
                };
                self.settle(sub, &due, vec![later; due.len()]).await?;
                return Ok(false);
            }
        };
        let sends = due
            .iter()
            .map(|n| self.deliver(sub, rt, secret.as_ref(), n, stopping));
        let outcomes = futures_util::future::join_all(sends).await;
        // A round whose every notice the limits held is no sign of more.
        let sent = outcomes
            .iter()
            .any(|o| !matches!(o, NoticeOutcome::Deferred { .. }));
        self.settle(sub, &due, outcomes).await?;
        Ok(sent && due.len() == batch as usize)
    }

    /// Writes what became of a round's deliveries, in one transaction.
    async fn settle(
        &self,
        sub: &NotifyConfig,
        due: &[Notice],
        outcomes: Vec<NoticeOutcome>,
    ) -> Result<(), StoreError> {
        let i = &self.engine.inner;
        let now = i.clock.now_ms();
        let mut settles = Vec::with_capacity(due.len());
        let mut verdicts = Vec::with_capacity(due.len());
        for (n, outcome) in due.iter().zip(outcomes) {
            let verdict = match &outcome {
                NoticeOutcome::Delivered { .. } => "delivered",
                NoticeOutcome::Deferred { .. } => "held",
                NoticeOutcome::Throttled { .. } => "throttled",
                NoticeOutcome::Failed {
                    retry_at: Some(_), ..
                } => "failed",
                NoticeOutcome::Failed { retry_at: None, .. } => "given_up",
            };
            verdicts.push(verdict);
            settles.push(NoticeSettle {
                id: n.id,
                lease_token: n.lease_token,
                outcome,
            });
        }
        let round = NoticeRound {
            subscription: sub.name.clone(),
            now,
            disable_after_ms: ms(sub.disable_after.0),
            settles,
        };
        let done = i.db.settle_notices(&round).await?;
        // Counted once the round is written (a round whose settles failed
        // goes again; a notice whose lease lapsed meanwhile counts too).
        for verdict in verdicts {
            metrics::counter!("ballast_notices_total", "subscription" => sub.name.clone(), "outcome" => verdict)
                .increment(1);
        }
        if done.lost > 0 {
            tracing::info!(subscription = %sub.name, notices = done.lost, "notices' leases lapsed before their deliveries were settled; they go again");
        }
        if done.disabled {
            tracing::warn!(subscription = %sub.name, "subscription turned off: its deliveries have failed for disable_after");
        }
        Ok(())
    }

    /// One delivery of `n`: through the gates, sent, judged by the
    /// provider's rules.
    async fn deliver(
        &self,
        sub: &NotifyConfig,
        rt: &ProviderRuntime,
        secret: Option<&Secret>,
        n: &Notice,
        stopping: &Stopping,
    ) -> NoticeOutcome {
        let i = &self.engine.inner;
        let now = i.clock.now_ms();
        let gate = Gate {
            clock: i.clock.as_ref(),
            db: &i.db,
            node: &i.opts.node_id,
            stopping,
            max_wait: std::time::Duration::from_millis(500),
            now,
            record: n.record_id,
        };
        let mut granted = match gate.enter(rt, (n.attempts > 0, n.attempts == 0)).await {
            Ok(g) => g,
            Err(Held::Deferred(at, _) | Held::Outage(at)) => return NoticeOutcome::Deferred { at },
            Err(Held::Stopping) => return NoticeOutcome::Deferred { at: now },
        };
        let x = match self.send(sub, rt, secret, n, &mut granted.flight).await {
            Ok(x) => x,
            Err(held) => return held,
        };
        let after = i.clock.now_ms();
        // A subscriber acknowledges with any 2xx (Standard Webhooks); the
        // provider's rules judge the rest (a throttle, a failure).
        let outcome = match x.http_status {
            Some(200..=299) => Outcome::Success,
            _ => crate::domain::rules::classify(&rt.rules, &x.reply).outcome,
        };
        let failed_call = matches!(outcome, Outcome::Retry | Outcome::Unknown);
        let h = heard(rt, (outcome, failed_call), &x, granted.probe, after);
        let paused = h.throttled.as_ref().map(|t| t.1);
        super::sync::publish_heard(i, h).await;
        match (outcome, paused) {
            (Outcome::Success, _) => NoticeOutcome::Delivered {
                status: x.http_status.unwrap_or(0),
                reply: x.excerpt,
            },
            // A subscriber that only ever says "slow down" gives up its
            // notices too, at `retry_for`.
            (Outcome::Throttled, Some(until)) if !past_retry_for(sub, n, until) => {
                NoticeOutcome::Throttled {
                    at: until,
                    status: x.http_status,
                    reply: x.excerpt,
                }
            }
            (Outcome::Throttled, _) => NoticeOutcome::Failed {
                status: x.http_status,
                reply: x.excerpt,
                retry_at: None,
            },
            _ => failed(sub, rt, n, (x.http_status, x.excerpt, x.retry_after), after),
        }
    }
}

impl Notifier {
    /// Sends `n` (its gates passed): with an OAuth2 subscriber's token,
    /// taken as a step's call takes it (without one the notice waits for
    /// the endpoint, no attempt spent), and, when the subscriber refuses
    /// the token (`401`), once more with a renewed one, the refusal not
    /// counted against it (as a step's call does). The reply, or what
    /// became of the notice without one.
    async fn send(
        &self,
        sub: &NotifyConfig,
        rt: &ProviderRuntime,
        secret: Option<&Secret>,
        n: &Notice,
        flight: &mut super::gate::Flight<'_>,
    ) -> Result<super::http::Exchange, NoticeOutcome> {
        let clock = self.engine.inner.clock.as_ref();
        let now = clock.now_ms();
        // Without a token, the notice waits until the endpoint may answer.
        let held = |no: super::token::NoToken| NoticeOutcome::Deferred { at: no.until };
        let mut sent = rt.token_now(clock).await.map_err(held)?;
        let mut renewed = false;
        loop {
            // The subscriber's URL or signature cannot be made: nothing
            // left; retried (an operator may fix the provider).
            let call = call_of(sub, rt, (secret, sent.as_ref()), n, clock.now_ms())
                .map_err(|why| failed(sub, rt, n, (None, why, None), now))?;
            flight.sent = true;
            // What the subscriber echoes of the credential, the token or
            // the signing secret is not kept.
            let mut secrets = super::step::scrubbed(rt, sent.as_ref());
            secrets.extend(secret.map(Secret::expose));
            let x = super::http::exchange(&rt.client, &call, &secrets, clock).await;
            rt.judge_token(sent.as_ref(), x.http_status, clock);
            if renewed || sent.is_none() || x.http_status != Some(401) {
                return Ok(x);
            }
            renewed = true;
            sent = rt.token_now(clock).await.map_err(held)?;
        }
    }
}

/// The configured subscriptions, each with its provider.
fn configured(setup: &Setup) -> impl Iterator<Item = (&NotifyConfig, &Arc<ProviderRuntime>)> {
    setup
        .config
        .notify
        .iter()
        .filter_map(|sub| Some((sub, setup.providers.get(&sub.provider)?)))
}

/// A delivery that failed: due again after the provider's backoff, or
/// given up once the notice is `retry_for` old.
fn failed(
    sub: &NotifyConfig,
    rt: &ProviderRuntime,
    n: &Notice,
    (status, reply, retry_after): (Option<u16>, String, Option<std::time::Duration>),
    now: UnixMs,
) -> NoticeOutcome {
    let retry = u32::try_from(n.attempts + 1).unwrap_or(u32::MAX);
    let wait = rt
        .config
        .retry
        .backoff()
        .wait(retry, fastrand::f64(), retry_after);
    let at = now + ms(wait).max(1);
    let retry_at = (!past_retry_for(sub, n, at)).then_some(at);
    NoticeOutcome::Failed {
        status,
        reply,
        retry_at,
    }
}

/// Whether `n` is `retry_for` old at `at` (from its change, or from its
/// last redelivery or its subscription turned on again).
fn past_retry_for(sub: &NotifyConfig, n: &Notice, at: UnixMs) -> bool {
    at - n.since.unwrap_or(n.at) >= ms(sub.retry_for.0)
}

/// The request that delivers `n`: a `POST` of its body (Standard Webhooks
/// or Slack) to the provider's `base_url` and the subscription's `path`,
/// with the provider's headers (its credential or OAuth2 `token`) and
/// signature, and, with a `secret`, the Standard Webhooks headers signed
/// at `at_ms`.
fn call_of(
    sub: &NotifyConfig,
    rt: &ProviderRuntime,
    (secret, token): (Option<&Secret>, Option<&Secret>),
    n: &Notice,
    at_ms: UnixMs,
) -> Result<Call, String> {
    let url = rt.call_url(&sub.path)?;
    let body = match sub.format {
        Format::StandardWebhooks => crate::domain::notify::body(&n.topic, n.at, &n.data),
        Format::Slack => crate::domain::notify::slack_body(&n.topic, n.at, &n.data),
    };
    let body = body.to_string();
    let mut headers = Vec::new();
    if let Some(s) = secret {
        let ts = at_ms.div_euclid(1000);
        let sig = crate::auth::presets::standard_sign(
            s.expose().as_bytes(),
            &n.message_id,
            ts,
            body.as_bytes(),
        );
        headers.push(("webhook-id".to_owned(), n.message_id.clone()));
        headers.push(("webhook-timestamp".to_owned(), ts.to_string()));
        headers.push(("webhook-signature".to_owned(), sig));
    }
    super::step::credentials(rt, token, &mut headers);
    super::step::usual_headers(rt, &mut headers, true);
    super::step::sign(rt, at_ms, ("POST", &url, &body), &mut headers)?;
    Ok(Call {
        method: crate::pipeline::HttpMethod::Post,
        url,
        headers,
        body: Some(body),
        timeout: rt.config.timeout.0,
        max_body: rt.config.max_body,
        follow: None,
        decode: rt.config.decode.clone(),
    })
}

/// The subscription's secret, read off the runtime (it may be a file).
async fn read_secret(sub: &NotifyConfig) -> Result<Option<Secret>, String> {
    let reading = sub.clone();
    tokio::task::spawn_blocking(move || reading.read_secret(&|v| std::env::var(v).ok()))
        .await
        .unwrap_or_else(|e| Err(e.to_string()))
}
