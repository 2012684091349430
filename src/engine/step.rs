//! One step's call in a pass ([`StepCall`]), as an async shell around the
//! pure decisions of `domain::step`: decide before the call → gate (pause,
//! concurrency slot, rate limit, breaker, retry budget) → one exchange →
//! decide what the reply means. It writes to the store only what must be
//! settled before a call leaves: an `at_most_once` call's intent (through
//! the intent writer), a half-open probe's claim on the cluster's breaker
//! (given back when no probe is made), and the provider's cluster permits
//! its gates lease. The step's new state, its attempts and what the reply
//! told every call go back to the caller (the pass, or a confirmation
//! poll), which commits and publishes them.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tracing::Instrument as _;

use super::gate::{BreakerNews, Flight, Gate, Granted, Heard, Held, Probe, heard, ms};
use super::http::{Call, Exchange, exchange};
use super::limits::ProviderRuntime;
use super::token::NoToken;
use crate::config::Secret;
use crate::domain::request::{Outgoing, SentRequest};
use crate::domain::rules::{Reply, classify};
use crate::domain::step::{
    Before, BudgetMove, Decision, Delivery, Judged, Park, Planned, ReplyFacts, after_reply,
    apply_deliveries, before_call, defer, park_or_fail, spend_attempt, unbuildable,
};
use crate::domain::{Clock, Outcome, Record, StepState, UnixMs, idempotency_key};
use crate::pipeline::{RequestSpec, Step, Templates};
use crate::store::{Db, NewAttempt, StepWrite};

/// Template context: `input`, `record`, and each succeeded step's output.
pub fn context(rec: &Record, states: &HashMap<String, StepWrite>) -> Value {
    let mut steps = Map::new();
    for (name, w) in states {
        if w.state == StepState::Succeeded {
            steps.insert(
                name.clone(),
                json!({ "output": w.output.clone().unwrap_or(Value::Null) }),
            );
        }
    }
    json!({
        "input": rec.input,
        "record": { "id": rec.id, "key": rec.external_key, "pipeline": rec.pipeline },
        "steps": steps,
    })
}

/// The result of one step pass.
pub struct StepOutput {
    pub write: StepWrite,
    pub attempts: Vec<NewAttempt>,
    /// When the record must be parked.
    pub park: Option<Park>,
    /// What this pass's call taught the cluster's breaker: (provider, news).
    pub breaker: Option<(String, BreakerNews)>,
    /// A provider's "slow down" pause for every node: (provider, until).
    pub throttled: Option<(String, UnixMs)>,
    /// Webhook deliveries applied by this pass.
    pub callbacks_done: Vec<i64>,
    /// The step was given back because the node is stopping.
    pub stopped: bool,
    /// Its first confirmation, for a step with `confirm` that succeeded.
    pub confirm: Option<crate::domain::confirm::Pending>,
    /// The intent its call completes (`at_most_once`).
    pub intents_done: Vec<i64>,
}

impl StepOutput {
    pub(super) fn new(decision: Decision) -> Self {
        StepOutput {
            write: decision.write,
            attempts: Vec::new(),
            park: decision.park,
            breaker: None,
            throttled: None,
            callbacks_done: Vec::new(),
            stopped: false,
            confirm: None,
            intents_done: Vec::new(),
        }
    }
}

/// One step's call in a pass, with everything it needs: its record, its
/// state, the request's context, and the node's gates and writers.
pub struct StepCall<'a> {
    pub record: &'a Record,
    pub step: &'a Step,
    pub write: StepWrite,
    /// The pass's context, shared by its steps (and a step's items).
    pub ctx: std::sync::Arc<crate::pipeline::PassContext>,
    /// An item's value and index (a step for each item): its templates
    /// see them as `item` and `item_index`.
    pub item: Option<(Value, i64)>,
    pub templates: std::sync::Arc<Templates>,
    pub node: &'a str,
    pub installation: &'a str,
    pub clock: &'a dyn Clock,
    /// For the cluster's breaker (half-open probes are claimed there) and
    /// the provider's cluster permits.
    pub db: &'a Db,
    /// Where `at_most_once` calls write their intents.
    pub(crate) intents: &'a super::intents::IntentWriter,
    pub now: UnixMs,
    /// Webhook deliveries waiting for this step (callback steps only).
    pub callbacks: Vec<crate::store::PendingCallback>,
    /// The longest this pass may wait for a slot or the rate limit.
    pub max_wait: Duration,
    /// The node is shutting down: make no new call.
    pub stopping: &'a super::Stopping,
    /// The engine's insides, for a `pipeline` step's child record.
    pub(super) engine: &'a super::Inner,
}

/// What a confirmation poll found.
#[derive(Debug)]
pub enum Asked {
    /// The provider answered (or the exchange failed): its outcome, the
    /// exchange kept as an attempt, and what the reply tells every call
    /// to the provider.
    Said {
        outcome: Outcome,
        attempt: Box<NewAttempt>,
        heard: Heard,
    },
    /// A gate said no (a pause, the breaker, the limits, no token): ask
    /// again then.
    Later(UnixMs),
    /// The poll request cannot be built (a template error).
    Broken(String),
}

/// A call that left, as it ended: its reply and the request kept, when
/// and under which attempt number it was sent, the token it carried, and
/// the `401` kept before it when a refused token was renewed.
struct Sent {
    x: Exchange,
    request: SentRequest,
    started: UnixMs,
    attempt_no: i32,
    token: Option<Secret>,
    refused: Option<NewAttempt>,
}

/// The error code of a `401` answered to a call whose OAuth2 token was
/// then renewed (and the call sent again).
pub const TOKEN_REFUSED: &str = "token_expired";

/// The values scrubbed from everything a call keeps: the provider's
/// credential and the call's token.
pub(super) fn scrubbed<'s>(rt: &'s ProviderRuntime, token: Option<&'s Secret>) -> Vec<&'s str> {
    let key = rt.secrets.credential();
    key.into_iter().chain(token).map(Secret::expose).collect()
}

/// Adds the provider's credential (or OAuth2 `token`) to a call's
/// `headers`.
pub(super) fn credentials(
    rt: &ProviderRuntime,
    token: Option<&Secret>,
    headers: &mut Vec<(String, String)>,
) {
    if let Some((h, v)) = rt.config.auth_header(&rt.secrets) {
        headers.push((h, v.expose().to_owned()));
    }
    if let (Some(src), Some(t)) = (&rt.token, token) {
        headers.push((src.header().to_owned(), format!("Bearer {}", t.expose())));
    }
}

/// Adds to a call's `headers` what the client would add by itself
/// (written here, so that the request kept is the request sent):
/// `User-Agent`, `Accept`, `Content-Type` for a body, `Accept-Encoding`.
pub(super) fn usual_headers(rt: &ProviderRuntime, headers: &mut Vec<(String, String)>, body: bool) {
    let agent = concat!("ballast/", env!("CARGO_PKG_VERSION"));
    for (name, value) in [("User-Agent", agent), ("Accept", "*/*")] {
        if !super::http::names(headers, name) {
            headers.push((name.into(), value.into()));
        }
    }
    if body && !super::http::names(headers, "content-type") {
        headers.push(("Content-Type".into(), "application/json".into()));
    }
    if !rt.config.decode.is_empty() && !super::http::names(headers, "accept-encoding") {
        let codings: Vec<&str> = rt.config.decode.iter().map(|c| c.as_str()).collect();
        headers.push(("Accept-Encoding".into(), codings.join(", ")));
    }
}

/// Signs the request `(method, url, body)` at `at_ms` as the provider
/// asks (`signing`): its signature's headers replace any of the same
/// names, so that what is sent is what was signed.
pub(super) fn sign(
    rt: &ProviderRuntime,
    at_ms: i64,
    (method, url, body): (&str, &reqwest::Url, &str),
    headers: &mut Vec<(String, String)>,
) -> Result<(), String> {
    use crate::auth::signing;
    let (Some(config), Some(secret)) = (&rt.config.signing, &rt.secrets.signing) else {
        return Ok(());
    };
    let signed = match (config.scheme.hmac(), &rt.secrets.aws) {
        (Some(hash), _) => {
            let target = match url.query() {
                Some(q) => format!("{}?{q}", url.path()),
                None => url.path().to_owned(),
            };
            let at_s = at_ms.div_euclid(1000);
            let value = signing::sign(
                hash,
                secret.expose().as_bytes(),
                at_s,
                (method, &target, body),
            );
            vec![(config.header().to_owned(), value)]
        }
        (None, Some(identity)) => {
            let keys = signing::AwsKeys {
                access_key_id: identity.access_key_id.expose(),
                secret_access_key: secret.expose(),
                session_token: identity.session_token.as_ref().map(Secret::expose),
            };
            let scope = (
                config.region.as_deref().unwrap_or_default(),
                config.service.as_deref().unwrap_or_default(),
            );
            let request = signing::Request {
                method,
                url: url.as_str(),
                headers,
                body: body.as_bytes(),
            };
            signing::aws_sigv4(&keys, scope, at_ms, &request)?
        }
        // Read together (`read_secrets`): not one without the other.
        (None, None) => return Err("AWS signing without its access key id".into()),
    };
    headers.retain(|(k, _)| !signed.iter().any(|(s, _)| s.eq_ignore_ascii_case(k)));
    headers.extend(signed);
    Ok(())
}

impl StepCall<'_> {
    /// Gives the step back, due now, without a call: the node is stopping.
    fn shutting_down(&self) -> StepOutput {
        StepOutput {
            stopped: true,
            ..self.deferred(self.now, crate::domain::SHUTDOWN_REASON)
        }
    }

    /// Defers the step to `at` without spending an attempt.
    pub(super) fn deferred(&self, at: UnixMs, why: &str) -> StepOutput {
        metrics::counter!(
            "ballast_deferrals_total",
            &[
                ("provider", self.step.provider.clone()),
                ("reason", why.to_owned()),
            ]
        )
        .increment(1);
        let write = defer(self.write.clone(), at, why, self.now);
        StepOutput::new(Decision { write, park: None })
    }

    /// The provider's breaker is open until `until`: the step waits, or
    /// its record parks until the provider is healthy (`on_outage`).
    fn outage(&self, rt: &ProviderRuntime, until: UnixMs) -> StepOutput {
        let why = "provider circuit breaker open";
        let policy = rt.config.on_outage;
        if policy == crate::domain::park::OutagePolicy::Defer {
            return self.deferred(until, why);
        }
        let write = self.write.clone();
        let d = crate::domain::step::outage(write, policy, &rt.name, until, why, self.now);
        StepOutput::new(d)
    }

    /// gate → exchange → decide; the decisions are `domain::step`'s.
    pub async fn execute(self, rt: Option<&ProviderRuntime>) -> StepOutput {
        if let Some(spec) = self.step.kind.child() {
            return self.run_child(spec).await;
        }
        let (rt, mut plan) = match self.planned(rt) {
            Ok(p) => p,
            Err(out) => return *out,
        };
        let (granted, token, call) = match self.prepared(rt, &plan).await {
            Ok(ready) => ready,
            Err(out) => return out,
        };
        spend_attempt(&mut plan);
        let attempt_no = plan.write.attempts.max(1);
        let (call, span) = self.traced(rt, call, attempt_no);
        let started = self.clock.now_ms();
        let at_most_once = self.at_most_once(rt, &plan, &call);
        let intent = if at_most_once {
            match self
                .intend(rt, &call, token.as_ref(), attempt_no, started)
                .await
            {
                Ok(id) => Some(id),
                Err(why) => return self.deferred(self.clock.now_ms() + 1_000, &why),
            }
        } else {
            None
        };
        let mut granted = granted;
        // From here the call may reach the provider, even if this pass is
        // cancelled: it counts as sent.
        granted.flight.sent = true;
        let first = self.exchange(rt, call, token.as_ref(), span).await;
        let sent = match self
            .renewed_if_refused(rt, &plan, token, (first, started, attempt_no))
            .await
        {
            Ok(sent) => sent,
            Err(mut out) => {
                // The 401 is kept: its intent closes with it.
                out.intents_done.extend(intent);
                return out;
            }
        };
        let mut out = self.concluded(rt, plan, granted.probe, sent, at_most_once);
        out.intents_done.extend(intent);
        out
    }

    /// The provider's runtime and the call the step's state plans, or what
    /// the step becomes without one (no such provider, settled, deliveries
    /// to apply).
    fn planned<'r>(
        &self,
        rt: Option<&'r ProviderRuntime>,
    ) -> Result<(&'r ProviderRuntime, Planned), Box<StepOutput>> {
        if let Some(d) = self.judged() {
            return Err(Box::new(StepOutput::new(d)));
        }
        // A kind that calls no provider decides its pass alone.
        // What a call's templates see, `key` included (check-config lets
        // every template read it).
        let render = |id: &str| self.render(id, &self.write);
        if let Some(d) = self
            .step
            .kind
            .settle(self.step, &self.write, self.now, &render)
        {
            return Err(Box::new(StepOutput::new(d)));
        }
        let Some(rt) = rt else {
            let reason = format!("provider `{}` is not configured", self.step.provider);
            let d = park_or_fail(
                self.step,
                self.write.clone(),
                "unknown_provider",
                reason,
                self.now,
            );
            return Err(Box::new(StepOutput::new(d)));
        };
        let policy = self.step.retry_policy(rt.config.retry.policy());
        let has_deliveries = !self.callbacks.is_empty();
        match before_call(
            self.step,
            &self.write,
            &rt.name,
            has_deliveries,
            &policy,
            self.now,
        ) {
            Before::Settled(d) => Err(Box::new(StepOutput::new(d))),
            Before::Deliveries => Err(Box::new(self.apply_callbacks(rt))),
            Before::Call(plan) => Ok((rt, plan)),
        }
    }

    /// Everything a call needs before it leaves: no pause (not even a
    /// token is asked for during one), a token before the gate (without
    /// one the step waits like behind an open breaker), the gate, the
    /// token again (one refused meanwhile is not sent), the request built.
    async fn prepared<'r>(
        &'r self,
        rt: &'r ProviderRuntime,
        plan: &Planned,
    ) -> Result<(Granted<'r>, Option<Secret>, Call), StepOutput> {
        if let Some(out) = self.held_back(rt) {
            return Err(out);
        }
        let token = self.token(rt).await?;
        let granted = self.gate(rt, plan).await?;
        let token = self.token_again(rt, token).await?;
        let call = self.build_call(rt, plan, token.as_ref()).map_err(|e| {
            StepOutput::new(unbuildable(plan.write.clone(), e.code, e.reason, self.now))
        })?;
        Ok((granted, token, call))
    }

    /// Whether this call must not be paid twice, so is written down,
    /// durably, before it leaves (without that, it is not made). A
    /// provider's setting spares its `GET`s; a step's own covers its call
    /// whatever the method (a sender that sends on a `GET`). Polls and
    /// lookups only ask.
    fn at_most_once(&self, rt: &ProviderRuntime, plan: &Planned, call: &Call) -> bool {
        self.step.at_most_once(rt.config.at_most_once)
            && !plan.polling
            && (call.method != crate::pipeline::HttpMethod::Get
                || self.step.at_most_once == Some(true))
    }

    /// The exchange as it ends: when the token was refused (a `401`), it
    /// is dropped at once (no call leaves with it from now on: the others
    /// wait for the renewal this one asks for), renewed, and the call sent
    /// again, the 401 kept as evidence without spending the attempt. (The
    /// resend's place in the limits is held until the end of the pass.)
    async fn renewed_if_refused(
        &self,
        rt: &ProviderRuntime,
        plan: &Planned,
        token: Option<Secret>,
        ((x, sent), started, attempt_no): ((Exchange, SentRequest), UnixMs, i32),
    ) -> Result<Sent, StepOutput> {
        let (Some(t), Some(401)) = (&token, x.http_status) else {
            return Ok(Sent {
                x,
                request: sent,
                started,
                attempt_no,
                token,
                refused: None,
            });
        };
        if let Some(src) = &rt.token {
            src.refused(t, self.clock);
        }
        let first = self.refused_attempt(rt, (attempt_no, started), &x, sent);
        match self.resend(rt, plan, t).await {
            Ok((again, request, at, renewed, _flight)) => Ok(Sent {
                x: again,
                request,
                started: at,
                attempt_no,
                token: Some(renewed),
                refused: Some(first),
            }),
            Err(mut out) => {
                out.attempts.insert(0, first);
                Err(out)
            }
        }
    }

    /// What the exchange means: the step's new state (an uncertain call
    /// under `at_most_once` looked up or parked, never sent again), what
    /// every call to the provider hears of it, the attempt kept, and the
    /// first confirmation of a success.
    fn concluded(
        &self,
        rt: &ProviderRuntime,
        plan: Planned,
        probe: Probe<'_>,
        sent: Sent,
        at_most_once: bool,
    ) -> StepOutput {
        let Sent {
            x,
            request,
            started,
            attempt_no,
            token,
            refused,
        } = sent;
        rt.judge_token(token.as_ref(), x.http_status, self.clock);
        let policy = self.step.retry_policy(rt.config.retry.policy());
        let after = self.clock.now_ms();
        let c = classify(&rt.rules, &x.reply);
        self.count(rt, c.outcome, x.took);
        let (mut judged, failed) = self.judge(
            plan,
            (&x, c.outcome, c.error_code),
            &policy,
            (self.now, after),
        );
        if at_most_once && crate::domain::step::uncertain(&x.reply, judged.outcome) {
            let evidence = judged
                .error_code
                .clone()
                .unwrap_or_else(|| "no reply".into());
            // The provider may still be working on it: asked no sooner
            // than a call's timeout from now.
            judged.decision = crate::domain::step::uncertain_outcome(
                self.step,
                judged.decision.write,
                &evidence,
                (
                    after,
                    after + ms(self.step.call_timeout(rt.config.timeout.0)),
                ),
            );
        }
        let heard = heard(rt, (c.outcome, failed), &x, probe, after);
        self.move_budget(rt, judged.budget, after);
        let verdict = (judged.outcome, judged.error_code.clone());
        let attempt = self.attempt(rt, verdict, (attempt_no, started), &x, request);
        let w = &judged.decision.write;
        let confirm = match self.step.confirm {
            Some(spec) if w.state == StepState::Succeeded => Some(crate::domain::confirm::first(
                self.record.id,
                &w.step,
                w.generation,
                spec,
                after,
            )),
            _ => None,
        };
        StepOutput {
            confirm,
            attempts: refused.into_iter().chain([attempt]).collect(),
            breaker: heard.breaker,
            throttled: heard.throttled,
            ..StepOutput::new(judged.decision)
        }
    }

    /// What a reply means for the step (a lookup's or any other call's),
    /// and whether it counts against the provider's health.
    fn judge(
        &self,
        plan: Planned,
        (x, outcome, error_code): (&Exchange, Outcome, Option<&str>),
        policy: &crate::domain::step::RetryPolicy,
        (now, after): (UnixMs, UnixMs),
    ) -> (Judged, bool) {
        let json = match &x.reply {
            Reply::Http { json, .. } => json.as_ref(),
            Reply::Failed(_) => None,
        };
        let facts = ReplyFacts {
            outcome,
            error_code,
            json,
            http_status: x.http_status,
            retry_after: x.retry_after,
        };
        let looked_up = plan.lookup;
        let judged = if plan.lookup {
            crate::domain::step::after_lookup(
                self.step,
                plan,
                &facts,
                policy,
                after,
                fastrand::f64(),
            )
        } else {
            after_reply(self.step, plan, &facts, policy, now, after, fastrand::f64())
        };
        // A lookup's reply (a list of jobs) has no status the rules know:
        // one the lookup could read is no failure of the provider's.
        let failed = match outcome {
            Outcome::Retry => true,
            Outcome::Unknown => !(looked_up && judged.outcome == Outcome::Success),
            _ => false,
        };
        (judged, failed)
    }

    /// A confirmation poll of a step that succeeded (`confirm`): the job
    /// asked again through the same gates (no attempt spent, no retry
    /// budget drawn), its reply heard as any call's (`heard`: a throttled
    /// one pauses the provider, a failure counts for its breaker).
    pub async fn confirm(&self, rt: &ProviderRuntime) -> Asked {
        let plan = Planned {
            write: self.write.clone(),
            polling: true,
            is_retry: false,
            lookup: false,
        };
        let later =
            |out: StepOutput| Asked::Later(out.write.next_run_at.unwrap_or(self.now + 1_000));
        if let Some(out) = self.held_back(rt) {
            return later(out);
        }
        let token = match self.token(rt).await {
            Ok(t) => t,
            Err(out) => return later(out),
        };
        let mut granted = match self.gate(rt, &plan).await {
            Ok(g) => g,
            Err(out) => return later(out),
        };
        let token = match self.token_again(rt, token).await {
            Ok(t) => t,
            Err(out) => return later(out),
        };
        let Some(spec) = self.step.confirm_request() else {
            return Asked::Broken("the step has no request to confirm with".into());
        };
        let call = match self.build_call_of(rt, spec, &plan, token.as_ref()) {
            Ok(c) => c,
            Err(e) => return Asked::Broken(e.reason),
        };
        let number = (self.write.attempts.max(1), self.clock.now_ms());
        let (call, span) = self.traced(rt, call, number.0);
        granted.flight.sent = true;
        let (x, sent) = self.exchange(rt, call, token.as_ref(), span).await;
        // A 401 drops the token (the next ask gets another); it is never a
        // reversal (`domain::confirm::said`).
        rt.judge_token(token.as_ref(), x.http_status, self.clock);
        let c = classify(&rt.rules, &x.reply);
        self.count(rt, c.outcome, x.took);
        // Heard as any call is: a throttled reply pauses the provider, a
        // failure counts for its breaker.
        let failed = matches!(c.outcome, Outcome::Retry | Outcome::Unknown);
        let heard = heard(
            rt,
            (c.outcome, failed),
            &x,
            granted.probe,
            self.clock.now_ms(),
        );
        let verdict = (c.outcome, c.error_code.map(str::to_owned));
        Asked::Said {
            outcome: c.outcome,
            attempt: Box::new(self.attempt(rt, verdict, number, &x, sent)),
            heard,
        }
    }

    /// The gates (`engine::gate`) as this call passes them; a call held
    /// back is deferred (no attempt spent), or waits out the breaker as
    /// the provider's `on_outage` says.
    async fn gate<'r>(
        &'r self,
        rt: &'r ProviderRuntime,
        plan: &Planned,
    ) -> Result<Granted<'r>, StepOutput> {
        let first = !plan.is_retry && !plan.polling;
        self.gates()
            .enter(rt, (plan.is_retry, first))
            .await
            .map_err(|h| self.held(rt, h))
    }

    fn gates(&self) -> Gate<'_> {
        Gate {
            clock: self.clock,
            db: self.db,
            node: self.node,
            stopping: self.stopping,
            max_wait: self.max_wait,
            now: self.now,
            record: Some(self.record.id),
        }
    }

    fn held(&self, rt: &ProviderRuntime, h: Held) -> StepOutput {
        match h {
            Held::Stopping => self.shutting_down(),
            Held::Deferred(at, why) => self.deferred(at, why),
            Held::Outage(until) => self.outage(rt, until),
        }
    }

    /// The call's span (`call`, a client span; disabled with traces off)
    /// and the call carrying its `traceparent` when traces are on (unless
    /// the pipeline sets one itself), before anything keeps the request:
    /// its intent and its attempt hold the header that left.
    fn traced(&self, rt: &ProviderRuntime, mut call: Call, attempt: i32) -> (Call, tracing::Span) {
        let (host, port) = super::http::host_port(call.url.as_str());
        let span = tracing::debug_span!(
            "call",
            otel.kind = "client",
            record.id = self.record.id,
            step = %self.step.name,
            provider = %rt.name,
            attempt,
            http.request.method = call.method.as_str(),
            server.address = host,
            server.port = port,
            http.response.status_code = tracing::field::Empty,
            outcome = tracing::field::Empty,
            error.type = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        if let Some(tp) = crate::telemetry::traceparent(&span) {
            if !super::http::names(&call.headers, "traceparent") {
                call.headers.push(("traceparent".into(), tp));
            }
        }
        (call, span)
    }

    /// One exchange, within `span` ([`traced`](Self::traced)). A provider
    /// may echo the credential it was sent (in an error, in a field a step
    /// keeps as output), or send NUL characters: the reply comes back
    /// storable, so the key reaches no output, job id, excerpt or log. The
    /// call is then kept as the request sent, its headers and body taken
    /// over.
    async fn exchange(
        &self,
        rt: &ProviderRuntime,
        call: Call,
        token: Option<&Secret>,
        span: tracing::Span,
    ) -> (Exchange, SentRequest) {
        let secrets = scrubbed(rt, token);
        let mut x = match &rt.in_process {
            Some(p) => span.in_scope(|| {
                super::http::exchange_in_process(p.0.as_ref(), &call, &secrets, self.clock)
            }),
            None => {
                let sent = exchange(&rt.client, &call, &secrets, self.clock);
                sent.instrument(span.clone()).await
            }
        };
        if let Some(status) = x.http_status {
            span.record("http.response.status_code", i64::from(status));
        }
        x.span = span;
        // The call as the history keeps it, credentials removed
        // (`domain::request`), with the same secrets as the reply; and
        // the record's sensitive values masked in both.
        let masking = self.masking(rt);
        let out = Outgoing {
            method: call.method.as_str(),
            url: call.url.as_str(),
            headers: call.headers,
            body: call.body,
        };
        let sent = self.kept(rt, out, &secrets, masking.as_ref());
        if let Some(m) = &masking {
            x.excerpt = m.excerpt(&x.reply, &x.excerpt);
        }
        (x, sent)
    }

    /// What this call's history is masked by (`engine::sensitive`), if
    /// anything.
    fn masking(&self, rt: &ProviderRuntime) -> Option<super::sensitive::Masking> {
        let config = self.engine.config();
        let at = (
            self.record.pipeline.as_str(),
            self.step.name.as_str(),
            rt.name.as_str(),
        );
        super::sensitive::Masking::of(&config, at, &self.ctx)
    }

    /// A call as the history keeps it (`out`, its headers and body taken
    /// over): credentials removed, `secrets` wherever they appear
    /// (`domain::request`), the record's sensitive values masked
    /// (`masking`).
    fn kept(
        &self,
        rt: &ProviderRuntime,
        out: Outgoing<'_>,
        secrets: &[&str],
        masking: Option<&super::sensitive::Masking>,
    ) -> SentRequest {
        let credential_headers = rt.config.credential_headers();
        let Some(m) = masking else {
            return SentRequest::of(out, &credential_headers, secrets);
        };
        let (url, body) = m.outgoing(out.url, out.body.as_deref());
        let out = Outgoing {
            url: &url,
            body,
            ..out
        };
        let mut sent = SentRequest::of(out, &credential_headers, secrets);
        m.headers(&mut sent);
        sent
    }

    /// Writes the call down before it leaves (`at_most_once`): its intent's
    /// id, or why it could not be written.
    async fn intend(
        &self,
        rt: &ProviderRuntime,
        call: &Call,
        token: Option<&Secret>,
        attempt_no: i32,
        at: UnixMs,
    ) -> Result<i64, String> {
        let secrets = scrubbed(rt, token);
        let Some(lease) = self.record.lease() else {
            return Err("the record is not leased".into());
        };
        // The call is still to be sent: its headers and body copied.
        let out = Outgoing {
            method: call.method.as_str(),
            url: call.url.as_str(),
            headers: call.headers.clone(),
            body: call.body.clone(),
        };
        let intent = crate::store::NewIntent {
            lease,
            record_id: self.record.id,
            step: self.step.name.clone(),
            provider: Some(rt.name.clone()),
            attempt_no,
            node: Some(self.node.to_owned()),
            sent_at: at,
            request: Some(self.kept(rt, out, &secrets, self.masking(rt).as_ref())),
        };
        self.intents.write(intent).await
    }

    /// The provider's OAuth2 token, when it uses one; without one the step
    /// is deferred until the endpoint may answer (no attempt spent), with
    /// the endpoint's error code.
    async fn token(&self, rt: &ProviderRuntime) -> Result<Option<Secret>, StepOutput> {
        rt.token_now(self.clock)
            .await
            .map_err(|no| self.no_token(&no))
    }

    /// The step deferred, before anything is asked of the provider (its
    /// token endpoint included), while an operator or the provider's own
    /// "slow down" pauses it; the gate checks both again after its waits.
    fn held_back(&self, rt: &ProviderRuntime) -> Option<StepOutput> {
        if rt.is_paused() {
            return Some(self.deferred(self.now + 5_000, "provider paused by an operator"));
        }
        let until = rt.limiter().paused_at(self.clock.now_ms())?;
        Some(self.deferred(until, "provider asked to slow down"))
    }

    /// The token for a call that has passed the gate: the one taken
    /// before it, unless the provider refused that one meanwhile (another
    /// call's `401` while this one waited for a slot or the rate limit);
    /// then the renewed one, waiting for the renewal under way.
    async fn token_again(
        &self,
        rt: &ProviderRuntime,
        before: Option<Secret>,
    ) -> Result<Option<Secret>, StepOutput> {
        match before {
            Some(_) => self.token(rt).await,
            None => Ok(None),
        }
    }

    /// The step deferred for want of a token, the endpoint's error kept as
    /// the step's error code and reason.
    fn no_token(&self, no: &NoToken) -> StepOutput {
        let mut out = self.deferred(no.until, no.error.code());
        out.write.error_code = Some(no.error.code().to_owned());
        out.write.reason = Some(format!("no OAuth2 token: {}", no.error.detail()));
        out
    }

    /// After a `401` to a call with `refused`: a renewed token (or the one
    /// another call renewed meanwhile), a place in the rate limits, and the
    /// call sent again with it. Returns the reply, the request kept, when
    /// it was sent, the token it was sent with, and its place in the
    /// limits.
    async fn resend<'r>(
        &'r self,
        rt: &'r ProviderRuntime,
        plan: &Planned,
        refused: &Secret,
    ) -> Result<(Exchange, SentRequest, UnixMs, Secret, Flight<'r>), StepOutput> {
        let src = rt
            .token
            .as_ref()
            .ok_or_else(|| self.deferred(self.now, "no token source"))?;
        let token = src
            .renew(refused, &rt.client, self.clock)
            .await
            .map_err(|no| self.no_token(&no))?;
        let wait_until = self.clock.now_ms() + ms(self.max_wait);
        let taken = self
            .gates()
            .rate_limit(rt, wait_until)
            .await
            .map_err(|h| self.held(rt, h))?;
        let flight = Flight {
            rt,
            clock: self.clock,
            taken,
            sent: true,
        };
        let call = self.build_call(rt, plan, Some(&token)).map_err(|e| {
            StepOutput::new(unbuildable(plan.write.clone(), e.code, e.reason, self.now))
        })?;
        let (call, span) = self.traced(rt, call, plan.write.attempts.max(1));
        let at = self.clock.now_ms();
        let (x, sent) = self.exchange(rt, call, Some(&token), span).await;
        Ok((x, sent, at, token, flight))
    }

    /// A `401` to a call whose token was then renewed: kept in the history
    /// as the attempt it was sent for (same number), spending nothing.
    fn refused_attempt(
        &self,
        rt: &ProviderRuntime,
        number: (i32, UnixMs),
        x: &Exchange,
        sent: SentRequest,
    ) -> NewAttempt {
        self.count(rt, Outcome::Retry, x.took);
        let verdict = (Outcome::Retry, Some(TOKEN_REFUSED.to_owned()));
        self.attempt(rt, verdict, number, x, sent)
    }

    fn count(&self, rt: &ProviderRuntime, outcome: Outcome, took: Duration) {
        rt.calls.count(&rt.name, &self.step.name, outcome, took);
    }

    fn move_budget(&self, rt: &ProviderRuntime, budget: BudgetMove, at: UnixMs) {
        match budget {
            BudgetMove::None => {}
            BudgetMove::RetrySucceeded => rt.budget().on_retry_succeeded(at),
            BudgetMove::RetryFailed => rt.budget().on_retry_failed(at),
        }
    }

    /// The exchange as the failure history keeps it (its number counted
    /// when the call left, before a half-state gives the attempt back).
    fn attempt(
        &self,
        rt: &ProviderRuntime,
        (outcome, error_code): (Outcome, Option<String>),
        (attempt_no, started): (i32, UnixMs),
        x: &Exchange,
        sent: SentRequest,
    ) -> NewAttempt {
        // The call's span says what the history says of it.
        if !x.span.is_disabled() {
            x.span.record("outcome", outcome.as_str());
            if let Some(code) = &error_code {
                x.span.record("error.type", code.as_str());
            }
            if matches!(outcome, Outcome::Retry | Outcome::Fail | Outcome::Unknown) {
                x.span.record("otel.status_code", "error");
            }
        }
        NewAttempt {
            step: self.step.name.clone(),
            provider: Some(rt.name.clone()),
            attempt_no,
            node: Some(self.node.to_owned()),
            started_at: started,
            duration_ms: ms(x.took),
            http_status: x.http_status.map(i32::from),
            outcome,
            error_code,
            excerpt: Some(x.excerpt.clone()),
            request: Some(sent),
        }
    }

    /// Applies webhook deliveries (`domain::step::apply_deliveries`); each
    /// is kept in the attempt history as evidence.
    fn apply_callbacks(&self, rt: &ProviderRuntime) -> StepOutput {
        let deliveries: Vec<Delivery<'_>> = self
            .callbacks
            .iter()
            .map(|cb| Delivery {
                id: cb.id,
                body: &cb.body,
            })
            .collect();
        let (write, verdicts) =
            apply_deliveries(self.step, &self.write, &deliveries, &rt.rules, self.now);
        let masking = self.masking(rt);
        let kept = |body: &Value| match &masking {
            Some(m) => m.delivery(body),
            None => crate::domain::excerpt(&body.to_string(), crate::domain::EXCERPT_MAX_BYTES)
                .to_owned(),
        };
        let attempts = verdicts
            .iter()
            .zip(&self.callbacks)
            .map(|(v, cb)| NewAttempt {
                step: self.step.name.clone(),
                provider: Some(rt.name.clone()),
                attempt_no: write.attempts.max(1),
                node: Some(self.node.to_owned()),
                started_at: cb.received_at,
                duration_ms: 0,
                http_status: None,
                outcome: v.outcome,
                error_code: v.error_code.clone(),
                excerpt: Some(kept(&cb.body)),
                request: None,
            })
            .collect();
        StepOutput {
            attempts,
            callbacks_done: verdicts.iter().map(|v| v.id).collect(),
            ..StepOutput::new(Decision { write, park: None })
        }
    }

    /// The step's `when`, judged on its first pass over what its
    /// templates see: a step skipped (or one whose condition cannot be
    /// judged), or `None` to go on.
    pub(super) fn judged(&self) -> Option<Decision> {
        use crate::domain::condition;
        let c = self.step.when.as_ref()?;
        if !condition::to_judge(self.step, &self.write) {
            return None;
        }
        let (ctx, _) = self.context_of(&self.write);
        match self.templates.judge(&c.id, &ctx) {
            Ok(j) => condition::judged(&self.write, &c.source, j.holds, &j.read, self.now),
            Err(e) => Some(condition::unjudgeable(
                self.step,
                &self.write,
                &e.to_string(),
                self.now,
            )),
        }
    }

    /// What the step's conditions read in the state `write`: the pass's
    /// context with the step's `key` (its idempotency key, also returned)
    /// and, once it has one, its `job_id` (as its templates see them).
    pub(super) fn context_of(&self, write: &StepWrite) -> (serde_json::Value, String) {
        let (extra, key) = self.extra(write);
        (self.ctx.json_view(&self.step.upstream, extra), key)
    }

    /// What the step's templates see in the state `write` (as
    /// [`Self::context_of`], the pass's context not converted again), and
    /// its key.
    pub(super) fn view_of(&self, write: &StepWrite) -> (minijinja::Value, String) {
        let (extra, key) = self.extra(write);
        let extra = extra
            .iter()
            .map(|(k, v)| (*k, crate::pipeline::template::value_of(v)))
            .collect();
        (self.ctx.view(&self.step.upstream, extra), key)
    }

    /// Renders template `id` over the step's view in the state `write`.
    pub(super) fn render(&self, id: &str, write: &StepWrite) -> Result<String, String> {
        let (view, _) = self.view_of(write);
        self.templates
            .render_view(id, view)
            .map_err(|e| e.to_string())
    }

    /// What the step sees beside the pass's context: its `key`, its item
    /// and index (a step for each item), its `job_id` once it has one, and
    /// an undo step the `output` of the step it undoes; and the key.
    fn extra(&self, write: &StepWrite) -> (Vec<(&'static str, Value)>, String) {
        let key = idempotency_key(
            self.installation,
            self.record.id,
            &self.step.name,
            write.generation,
        );
        let mut extra = vec![("key", json!(key))];
        if let Some((item, index)) = &self.item {
            extra.push(("item", item.clone()));
            extra.push(("item_index", json!(index)));
        }
        if let Some(job) = &write.job_id {
            extra.push(("job_id", json!(job)));
        }
        if let Some(s) = self.step.undoes.as_deref() {
            let done = match self.step.upstream.contains(s) {
                true => self.ctx.json()["steps"][s]["output"].clone(),
                false => Value::Null,
            };
            extra.push(("output", done));
        }
        (extra, key)
    }

    /// The call the plan makes: the poll request for a poll, the step's
    /// request otherwise, rendered over the record's context (and the job
    /// id, for a poll).
    fn build_call(
        &self,
        rt: &ProviderRuntime,
        plan: &Planned,
        token: Option<&Secret>,
    ) -> Result<Call, Unbuildable> {
        let spec: &RequestSpec = match (self.step.poll(), plan.polling, &self.step.lookup) {
            (_, true, Some(l)) if plan.lookup => &l.request,
            (Some(p), true, _) => &p.request,
            // A calling kind always has its request (checked at compile).
            _ => self.step.request.as_ref().ok_or_else(|| Unbuildable {
                code: "request_invalid",
                reason: format!("step `{}` has no request to make", self.step.name),
            })?,
        };
        self.build_call_of(rt, spec, plan, token)
    }

    /// The call `spec` makes for this step (`build_call`'s choice, or a
    /// confirmation's request).
    fn build_call_of(
        &self,
        rt: &ProviderRuntime,
        spec: &RequestSpec,
        plan: &Planned,
        token: Option<&Secret>,
    ) -> Result<Call, Unbuildable> {
        let (view, key) = self.view_of(&plan.write);
        let render = |id: &str| {
            self.templates
                .render_view(id, view.clone())
                .map_err(|e| Unbuildable::template(format!("template: {e}")))
        };
        let path = render(&spec.path)?;
        let url = rt.call_url(&path).map_err(Unbuildable::invalid)?;
        let mut headers = Vec::new();
        for (name, id) in &spec.headers {
            let value = render(id)?;
            super::http::header_ok(name, &value).map_err(Unbuildable::invalid)?;
            headers.push((name.clone(), value));
        }
        credentials(rt, token, &mut headers);
        if spec.method != crate::pipeline::HttpMethod::Get {
            headers.push(("Idempotency-Key".into(), key));
        }
        let body = match &spec.body {
            Some(id) => Some(render(id)?),
            None => None,
        };
        usual_headers(rt, &mut headers, body.is_some());
        let at_ms = self.clock.now_ms();
        let request = (spec.method.as_str(), &url, body.as_deref().unwrap_or(""));
        sign(rt, at_ms, request, &mut headers).map_err(Unbuildable::invalid)?;
        Ok(Call {
            method: spec.method,
            url,
            headers,
            body,
            timeout: self.step.call_timeout(rt.config.timeout.0),
            max_body: rt.config.max_body,
            follow: (plan.polling
                && spec.method == crate::pipeline::HttpMethod::Get
                && rt.config.follow_redirects > 0)
                .then(|| super::redirect::Follow {
                    max: rt.config.follow_redirects,
                    within: rt.config.base_url.clone(),
                }),
            decode: rt.config.decode.clone(),
        })
    }
}

/// A request that cannot be built: its template does not render, or what
/// it renders is no request (a path leaving the provider's base URL, a
/// header value a header cannot carry). Nothing was sent: it is the
/// record's fault, never the provider's, so it counts for no breaker and
/// is never taken for a call that may have left.
#[derive(Debug)]
struct Unbuildable {
    code: &'static str,
    reason: String,
}

impl Unbuildable {
    fn template(reason: String) -> Self {
        Unbuildable {
            code: "template_error",
            reason,
        }
    }

    fn invalid(reason: String) -> Self {
        Unbuildable {
            code: "request_invalid",
            reason,
        }
    }
}
