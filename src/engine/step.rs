//! One pass over one ready step: protections first (pause, breaker, rate
//! limit, retry budget, concurrency), then one exchange, then the step's
//! new state from the reply's outcome. Nothing here writes to the store.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::http::{Call, exchange};
use super::limits::ProviderRuntime;
use crate::config::pipeline::{CallbackFallback, StepKind};
use crate::domain::rules::classify;
use crate::domain::{Outcome, Record, StepState, UnixMs, idempotency_key};
use crate::pipeline::{RequestSpec, Step, Templates};
use crate::store::{NewAttempt, StepWrite};

/// A granted rate-limit slot; dropping it marks the call complete, whether
/// it finished, failed before sending, or was cancelled mid-flight.
struct Flight<'a> {
    rt: &'a ProviderRuntime,
    sent: bool,
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        if self.sent {
            self.rt.limiter().complete(super::now_ms());
        } else {
            self.rt.limiter().abandon();
        }
    }
}

/// A breaker permit; dropping it unused gives a half-open probe back.
struct Probe<'a> {
    rt: &'a ProviderRuntime,
    permit: Option<crate::domain::breaker::Permit>,
}

impl Probe<'_> {
    /// Records the call's verdict; true when the breaker changed state.
    fn record(mut self, failed: bool, took: Duration, now: UnixMs) -> bool {
        let Some(permit) = self.permit.take() else {
            return false;
        };
        let mut b = self.rt.breaker();
        let before = b.state();
        b.record(permit, failed, took, now);
        b.state() != before
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.rt.breaker().release(permit);
        }
    }
}

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
    /// (error code, reason) when the record must be parked.
    pub park: Option<(String, String)>,
    /// The provider whose breaker changed state during this pass.
    pub breaker_moved: Option<String>,
    /// Webhook deliveries applied by this pass.
    pub callbacks_done: Vec<i64>,
    /// The step was given back because the node is stopping.
    pub stopped: bool,
}

/// Everything one step pass needs.
pub struct StepRun<'a> {
    pub record: &'a Record,
    pub step: &'a Step,
    pub write: StepWrite,
    pub ctx: Value,
    pub templates: std::sync::Arc<Templates>,
    pub node: &'a str,
    pub installation: &'a str,
    pub now: UnixMs,
    /// Webhook deliveries waiting for this step (callback steps only).
    pub callbacks: Vec<crate::store::PendingCallback>,
    /// The longest this pass may wait for a slot or the rate limit.
    pub max_wait: Duration,
    /// The node is shutting down: make no new call.
    pub stopping: &'a super::Stopping,
}

/// How long past its deadline a job's last poll may still be made (it
/// waits for a provider pause, an open breaker, a free slot).
pub const LAST_POLL_GRACE_MS: i64 = 60_000;

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

impl StepRun<'_> {
    /// Parks the record (required step) or fails the step (optional), with
    /// no exchange made.
    fn give_up(&self, mut w: StepWrite, code: &str, reason: String) -> StepOutput {
        let park = self.park_or_fail(&mut w, code, reason);
        StepOutput {
            park,
            ..self.output(w)
        }
    }

    /// When a callback step stops waiting for deliveries: its deadline, less
    /// the polling time that follows it when the fallback is to poll.
    fn callback_due(&self) -> Option<UnixMs> {
        let cb = self.step.callback.as_ref()?;
        let poll_extra = match cb.fallback {
            CallbackFallback::Poll => self.step.poll.as_ref().map_or(0, |p| ms(p.deadline)),
            CallbackFallback::Park => 0,
        };
        self.write.deadline_at.map(|d| d - poll_extra)
    }

    fn output(&self, write: StepWrite) -> StepOutput {
        StepOutput {
            write,
            attempts: Vec::new(),
            park: None,
            breaker_moved: None,
            callbacks_done: Vec::new(),
            stopped: false,
        }
    }

    /// Gives the step back, due now, without a call: the node is stopping.
    fn shutting_down(self) -> StepOutput {
        let now = self.now;
        StepOutput {
            stopped: true,
            ..self.defer(now, crate::domain::SHUTDOWN_REASON)
        }
    }

    /// Defers the step to `at` without spending an attempt.
    fn defer(self, at: UnixMs, why: &str) -> StepOutput {
        metrics::counter!(
            "ballast_deferrals_total",
            &[
                ("provider", self.step.provider.clone()),
                ("reason", why.to_owned()),
            ]
        )
        .increment(1);
        let mut w = self.write.clone();
        w.next_run_at = Some(at.max(self.now + 1));
        w.reason = Some(why.to_owned());
        self.output(w)
    }

    fn park_or_fail(
        &self,
        w: &mut StepWrite,
        code: &str,
        reason: String,
    ) -> Option<(String, String)> {
        w.error_code = Some(code.to_owned());
        w.reason = Some(reason.clone());
        w.next_run_at = None;
        if self.step.required {
            Some((code.to_owned(), reason))
        } else {
            // An optional step's failure is recorded and the record goes on.
            w.state = StepState::Failed;
            w.finished_at = Some(self.now);
            None
        }
    }

    pub async fn execute(self, rt: Option<&ProviderRuntime>) -> StepOutput {
        let now = self.now;
        let Some(rt) = rt else {
            let reason = format!("provider `{}` is not configured", self.step.provider);
            return self.give_up(self.write.clone(), "unknown_provider", reason);
        };
        // A callback step with a job waits for deliveries; once its
        // callback deadline has passed it falls back to polling (or parks).
        let callback_overdue = match (&self.step.callback, self.step.kind) {
            (Some(cb), StepKind::Callback) if self.write.job_id.is_some() => {
                let due = self.callback_due().unwrap_or(now);
                if !self.callbacks.is_empty() {
                    return self.apply_callbacks(rt);
                }
                if now < due {
                    let mut w = self.write.clone();
                    w.next_run_at = Some(due);
                    return self.output(w);
                }
                if cb.fallback == CallbackFallback::Park {
                    let reason = "no callback arrived before the callback deadline".into();
                    return self.give_up(self.write.clone(), "callback_timeout", reason);
                }
                true
            }
            _ => false,
        };
        let polling = match self.step.kind {
            StepKind::Request => false,
            StepKind::SubmitPoll => self.write.job_id.is_some(),
            StepKind::Callback => callback_overdue,
        };
        let retry = &rt.config.retry;
        let mut w = self.write.clone();
        w.provider = Some(rt.name.clone());
        if w.started_at.is_none() {
            w.started_at = Some(now);
            w.deadline_at = Some(now + ms(retry.deadline.0));
        }
        // A job gets one last poll once its deadline has passed (it may
        // have finished while the node could not ask: a pause, an open
        // breaker, the database away); that poll decides. Only when it
        // cannot be made within LAST_POLL_GRACE does the step give up
        // unasked.
        if let Some(d) = w.deadline_at.filter(|d| now >= *d) {
            if !polling || now >= d + LAST_POLL_GRACE_MS {
                let what = if polling {
                    "the job did not finish within its deadline, and no last poll could be made"
                } else {
                    "the step did not succeed within its deadline"
                };
                let reason = format!("deadline passed: {what}");
                return self.give_up(w, "deadline_passed", reason);
            }
        }
        if rt.is_paused() {
            return self.defer(now + 5_000, "provider paused by an operator");
        }
        let is_retry = !polling && w.attempts > 0;

        // Order matters: take a concurrency slot first, so that everything
        // after it (rate limit, breaker, budget) is decided just before the
        // call goes out, not while queued behind other calls.
        // Waiting for a slot or the rate limit is bounded: a record that
        // cannot be served soon goes back to the queue (no attempt spent)
        // instead of sitting on a lease while others could take it.
        let wait_until = tokio::time::Instant::now() + self.max_wait;
        // A free slot is taken at once; only a wait listens for shutdown.
        let _slot = match rt.concurrency.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                let slot = tokio::select! {
                    slot = tokio::time::timeout_at(wait_until, rt.concurrency.clone().acquire_owned()) => slot,
                    () = self.stopping.wait() => return self.shutting_down(),
                };
                let Ok(Ok(slot)) = slot else {
                    return self.defer(super::now_ms() + 50, "provider concurrency cap reached");
                };
                slot
            }
        };
        loop {
            let t = super::now_ms();
            let verdict = rt.limiter().try_acquire(t);
            match verdict {
                Ok(()) => break,
                Err(at)
                    if tokio::time::Instant::now()
                        + Duration::from_millis((at - t).max(1) as u64)
                        <= wait_until =>
                {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis((at - t).max(1) as u64)) => {}
                        () = self.stopping.wait() => return self.shutting_down(),
                    }
                }
                Err(at) => return self.defer(at, "provider rate limit"),
            }
        }
        // From here on the call counts against the limits until its guard
        // drops, even if this pass is cancelled mid-call (lease lost).
        let mut flight = Flight { rt, sent: false };
        let probe = match rt.breaker().try_acquire(super::now_ms()) {
            Ok(p) => Probe {
                rt,
                permit: Some(p),
            },
            Err(r) => return self.defer(r.until, "provider circuit breaker open"),
        };
        if self.stopping.is_set() {
            return self.shutting_down();
        }
        if is_retry && !rt.budget().try_retry(super::now_ms()) {
            return self.defer(super::now_ms() + 1_000, "provider retry budget exhausted");
        }
        if !is_retry && !polling {
            rt.budget().on_call(now);
        }

        let spec: &RequestSpec = match (&self.step.poll, polling) {
            (Some(p), true) => &p.request,
            _ => &self.step.request,
        };
        let mut ctx = self.ctx.clone();
        if let (Some(job), Some(obj)) = (&w.job_id, ctx.as_object_mut()) {
            obj.insert("job_id".into(), json!(job));
        }
        let call = match self.build_call(rt, spec, &ctx, w.generation) {
            Ok(c) => c,
            Err(e) => {
                // A template that cannot render will not render next time:
                // the step fails, with the reason.
                w.state = StepState::Failed;
                w.finished_at = Some(now);
                w.error_code = Some("template_error".into());
                w.reason = Some(e);
                w.next_run_at = None;
                return self.output(w);
            }
        };
        if !polling {
            w.attempts += 1;
        }
        let started = super::now_ms();
        // From here the call may reach the provider, even if this pass is
        // cancelled: it counts as sent.
        flight.sent = true;
        // A provider may echo the credential it was sent (in an error, in a
        // field a step keeps as output), or send NUL characters: the reply
        // comes back storable, so the key reaches no output, job id,
        // excerpt or log.
        let key = rt.config.credential(&|var| std::env::var(var).ok());
        let key = key.as_ref().map(|k| k.expose());
        let x = match &rt.in_process {
            Some(p) => super::http::exchange_in_process(p.0.as_ref(), &call, key.as_slice()),
            None => exchange(&rt.client, &call, key.as_slice()).await,
        };
        let after = super::now_ms();
        let c = classify(&rt.rules, &x.reply);
        let labels = [
            ("provider", rt.name.clone()),
            ("step", self.step.name.clone()),
        ];
        metrics::counter!(
            "ballast_attempts_total",
            &[
                ("provider", rt.name.clone()),
                ("step", self.step.name.clone()),
                ("outcome", c.outcome.as_str().to_owned()),
            ]
        )
        .increment(1);
        metrics::histogram!("ballast_attempt_duration_seconds", &labels)
            .record(x.took.as_secs_f64());

        let failed = matches!(c.outcome, Outcome::Retry | Outcome::Unknown);
        let breaker_moved = probe.record(failed, x.took, after).then(|| rt.name.clone());
        if x.http_status == Some(429) {
            // The whole provider slows down, not just this record.
            let pause = x.retry_after.unwrap_or(retry.base.0);
            rt.limiter().pause_until(after + ms(pause));
        }
        let attempt = NewAttempt {
            step: self.step.name.clone(),
            provider: Some(rt.name.clone()),
            attempt_no: w.attempts.max(1),
            node: Some(self.node.to_owned()),
            started_at: started,
            duration_ms: ms(x.took),
            http_status: x.http_status.map(i32::from),
            outcome: c.outcome,
            error_code: c.error_code.map(str::to_owned),
            excerpt: Some(x.excerpt.clone()),
        };
        let mut park = None;
        let json = match &x.reply {
            crate::domain::rules::Reply::Http { json, .. } => json.clone(),
            _ => None,
        };
        let mut outcome = c.outcome;
        let mut code = c.error_code.map(str::to_owned);
        let mut attempt = attempt;

        let submitting = self.step.kind != StepKind::Request && !polling;
        // A submit is accepted when the provider says done or "queued":
        // either way there must be a job id to follow.
        if outcome == Outcome::Success || (submitting && outcome == Outcome::Pending) {
            if submitting {
                // Submitted: keep the job id; it is committed before any poll.
                let pointer = self.step.job_id.as_deref().unwrap_or("/id");
                match json.as_ref().and_then(|j| j.pointer(pointer)) {
                    Some(id) => {
                        let id = match id {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        w.job_id = Some(id);
                        w.state = StepState::Waiting;
                        w.error_code = None;
                        w.reason = None;
                        let (every, deadline) = self
                            .step
                            .poll
                            .as_ref()
                            .map_or((Duration::from_secs(2), Duration::from_secs(1200)), |p| {
                                (p.every, p.deadline)
                            });
                        match &self.step.callback {
                            Some(cb) if self.step.kind == StepKind::Callback => {
                                // Wake at the callback deadline; a delivery
                                // before then wakes the record earlier.
                                let extra = match cb.fallback {
                                    CallbackFallback::Poll => deadline,
                                    CallbackFallback::Park => Duration::ZERO,
                                };
                                w.next_run_at = Some(after + ms(cb.deadline.0));
                                w.deadline_at = Some(after + ms(cb.deadline.0) + ms(extra));
                            }
                            _ => {
                                w.next_run_at = Some(after + ms(every));
                                w.deadline_at = Some(after + ms(deadline));
                            }
                        }
                        if is_retry {
                            rt.budget().on_retry_succeeded(after);
                        }
                        return StepOutput {
                            write: w,
                            attempts: vec![attempt],
                            park: None,
                            breaker_moved,
                            callbacks_done: Vec::new(),
                            stopped: false,
                        };
                    }
                    None => {
                        outcome = Outcome::Unknown;
                        code = Some("job_id_missing".into());
                    }
                }
            } else {
                let mut out = Map::new();
                let mut missing = None;
                for (name, pointer) in &self.step.outputs {
                    match json.as_ref().and_then(|j| j.pointer(pointer)) {
                        Some(v) => {
                            out.insert(name.clone(), v.clone());
                        }
                        None => missing = Some(name.clone()),
                    }
                }
                match missing {
                    None => {
                        w.state = StepState::Succeeded;
                        w.output = Some(Value::Object(out));
                        w.finished_at = Some(after);
                        w.next_run_at = None;
                        w.error_code = None;
                        w.reason = None;
                        if is_retry {
                            rt.budget().on_retry_succeeded(after);
                        }
                        return StepOutput {
                            write: w,
                            attempts: vec![attempt],
                            park: None,
                            breaker_moved,
                            callbacks_done: Vec::new(),
                            stopped: false,
                        };
                    }
                    Some(name) => {
                        outcome = Outcome::Unknown;
                        code = Some("output_missing".into());
                        w.reason = Some(format!("output `{name}` not found in the reply"));
                    }
                }
            }
            attempt.outcome = outcome;
            attempt.error_code = code.clone();
        }

        let backoff = retry.backoff();
        match outcome {
            Outcome::Success => {}
            Outcome::Pending => {
                // A half-state: ask again later, without spending an attempt.
                let every = self.step.poll.as_ref().map_or(backoff.base, |p| p.every);
                w.state = StepState::Waiting;
                w.next_run_at = Some(after + ms(every));
                if !polling {
                    w.attempts -= 1;
                }
                match w.deadline_at {
                    // The last poll, at or past the deadline: still running.
                    Some(d) if polling && after >= d => {
                        park = self.park_or_fail(
                            &mut w,
                            "deadline_passed",
                            "deadline passed: the job had not finished when last polled".into(),
                        );
                    }
                    // The last poll is made at the deadline itself.
                    Some(d) if polling => w.next_run_at = w.next_run_at.map(|n| n.min(d)),
                    _ => {}
                }
            }
            Outcome::Fail => {
                w.state = StepState::Failed;
                w.finished_at = Some(after);
                w.next_run_at = None;
                w.error_code = code.clone();
                w.reason = Some(format!(
                    "provider refused the call ({})",
                    x.http_status
                        .map_or_else(|| "no status".to_owned(), |s| format!("HTTP {s}"))
                ));
            }
            Outcome::Retry | Outcome::Unknown => {
                if is_retry {
                    rt.budget().on_retry_failed(after);
                }
                w.error_code = code.clone();
                let code = code.clone().unwrap_or_else(|| "unknown_reply".into());
                // Replies nobody understands are counted apart (calls and
                // polls alike) and park sooner; plain failures spend the
                // attempt budget of calls.
                let exhausted = if outcome == Outcome::Unknown {
                    w.unknowns += 1;
                    (w.unknowns as u32 >= retry.unknown_attempts.max(1))
                        .then(|| format!("{} replies no rule understood; last: {code}", w.unknowns))
                } else if !polling && w.attempts as u32 >= retry.max_attempts {
                    Some(format!(
                        "attempts exhausted ({} of {}); last error: {code}",
                        w.attempts, retry.max_attempts
                    ))
                } else {
                    None
                };
                let wait = backoff.wait(w.attempts.max(1) as u32, fastrand::f64(), x.retry_after);
                let next = after + ms(wait);
                w.state = if polling {
                    StepState::Waiting
                } else {
                    StepState::Retrying
                };
                if let Some(reason) = exhausted {
                    park = self.park_or_fail(&mut w, &code, reason);
                } else if let Some(d) = w
                    .deadline_at
                    .filter(|d| polling && next > *d && next < d + LAST_POLL_GRACE_MS)
                {
                    // A poll that failed near the deadline: the last poll is
                    // made at the deadline, and tried again within the grace
                    // until the provider answers it.
                    w.next_run_at = Some(if after < d { d } else { next });
                } else if w.deadline_at.is_some_and(|d| next > d) {
                    park = self.park_or_fail(
                        &mut w,
                        "deadline_passed",
                        format!("next try would pass the step deadline; last: {code}"),
                    );
                } else {
                    // A failed poll asks again later: the job is still out there.
                    w.next_run_at = Some(next);
                }
            }
        }
        StepOutput {
            write: w,
            attempts: vec![attempt],
            park,
            breaker_moved,
            callbacks_done: Vec::new(),
            stopped: false,
        }
    }

    /// Applies webhook deliveries in arrival order: the first terminal one
    /// decides; each is kept in the attempt history as evidence.
    fn apply_callbacks(self, rt: &ProviderRuntime) -> StepOutput {
        let mut w = self.write.clone();
        let mut attempts = Vec::new();
        let mut done = Vec::new();
        let mut decided = false;
        for cb in &self.callbacks {
            if decided {
                // Later deliveries are judged after this pass commits: one
                // may contradict the result just reached (a reversal).
                break;
            }
            done.push(cb.id);
            let reply = crate::domain::rules::Reply::Http {
                status: 200,
                json: Some(cb.body.clone()),
                body_error: None,
            };
            let c = classify(&rt.rules, &reply);
            let mut outcome = c.outcome;
            let mut code = c.error_code.map(str::to_owned);
            if !decided {
                match outcome {
                    Outcome::Success => {
                        let mut out = Map::new();
                        let missing = self.step.outputs.iter().find_map(|(name, pointer)| match cb
                            .body
                            .pointer(pointer)
                        {
                            Some(v) => {
                                out.insert(name.clone(), v.clone());
                                None
                            }
                            None => Some(name.clone()),
                        });
                        match missing {
                            None => {
                                w.state = StepState::Succeeded;
                                w.output = Some(Value::Object(out));
                                w.finished_at = Some(self.now);
                                w.next_run_at = None;
                                w.error_code = None;
                                w.reason = None;
                                decided = true;
                            }
                            Some(name) => {
                                outcome = Outcome::Unknown;
                                code = Some("output_missing".into());
                                w.error_code = code.clone();
                                w.reason = Some(format!("callback lacks output `{name}`"));
                            }
                        }
                    }
                    Outcome::Fail => {
                        w.state = StepState::Failed;
                        w.finished_at = Some(self.now);
                        w.next_run_at = None;
                        w.error_code = code.clone();
                        w.reason = Some("the provider reported failure in its callback".into());
                        decided = true;
                    }
                    // A progress report, or one we do not understand: keep
                    // waiting; the evidence is in the history.
                    _ => {}
                }
            }
            attempts.push(NewAttempt {
                step: self.step.name.clone(),
                provider: Some(rt.name.clone()),
                attempt_no: w.attempts.max(1),
                node: Some(self.node.to_owned()),
                started_at: cb.received_at,
                duration_ms: 0,
                http_status: None,
                outcome,
                error_code: code,
                excerpt: Some(
                    crate::domain::excerpt(&cb.body.to_string(), crate::domain::EXCERPT_MAX_BYTES)
                        .to_owned(),
                ),
            });
        }
        if !decided {
            w.next_run_at = Some(self.callback_due().unwrap_or(self.now).max(self.now + 1));
        }
        StepOutput {
            write: w,
            attempts,
            park: None,
            breaker_moved: None,
            callbacks_done: done,
            stopped: false,
        }
    }

    fn build_call(
        &self,
        rt: &ProviderRuntime,
        spec: &RequestSpec,
        ctx: &Value,
        generation: i32,
    ) -> Result<Call, String> {
        let render = |id: &str| {
            self.templates
                .render(id, ctx)
                .map_err(|e| format!("template: {e}"))
        };
        let path = render(&spec.path)?;
        let base = rt.config.base_url.trim_end_matches('/');
        let url = if path.starts_with('/') {
            format!("{base}{path}")
        } else {
            format!("{base}/{path}")
        };
        let mut headers = Vec::new();
        for (name, id) in &spec.headers {
            headers.push((name.clone(), render(id)?));
        }
        if let Some((h, v)) = rt.config.auth_header(&|var| std::env::var(var).ok()) {
            headers.push((h, v.expose().to_owned()));
        }
        if spec.method != crate::pipeline::HttpMethod::Get {
            let key = idempotency_key(
                self.installation,
                self.record.id,
                &self.step.name,
                generation,
            );
            headers.push(("Idempotency-Key".into(), key));
        }
        let body = match &spec.body {
            Some(id) => Some(render(id)?),
            None => None,
        };
        Ok(Call {
            method: spec.method,
            url,
            headers,
            body,
            timeout: rt.config.timeout.0,
            max_body: rt.config.max_body,
        })
    }
}
