//! The chaos simulator: a real HTTP provider with a seeded, configurable
//! failure mix, a ledger of side effects per idempotency key, and figures
//! for tests and benchmarks. Served by `ballast sim`, and mounted in-process
//! by tests and the demo.
//!
//! Routes (chaos applies to `/v1/*` only):
//! - `POST /v1/charge`: a synchronous call with a side effect.
//! - `POST /v1/jobs`, `GET /v1/jobs/{id}`: an asynchronous job to poll.
//! - `GET /v1/moved/{id}`: where a redirect fault points; answers 200
//!   `{"status": "succeeded"}`, a trap for a client that follows a POST's
//!   redirect and takes the moved page for the call's answer. No chaos.
//! - `POST /oauth/token` (when the profile has `oauth2`): client
//!   credentials, by HTTP Basic or in the form, for a bearer token that
//!   every `/v1/*` route then requires (a 401 `invalid_token` otherwise,
//!   before any chaos and with no side effect). Tokens die `ttl` after
//!   issue by the simulator's clock, whatever `expires_in` says.
//! - `GET /_sim/ledger`: effects per key and per `ref`, double charges.
//! - `GET /_sim/stats`: requests, the most in any one second, the most in
//!   flight at once, tokens issued and 401s for bad or expired tokens.
//! - `POST /_sim/outage`: `{"for_ms": N, "brownout": 0.0..1.0}` from now;
//!   503s unless `"status"` says 429 (with `"retry_after"`, the header's
//!   text) or another 5xx; any other status is a 400.
//! - `POST /_sim/token_outage`: `{"for_ms": N}`: the token endpoint
//!   answers 503 for that long.

mod oauth2;
mod profile;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::domain::{Clock, SystemClock, UnixMs};

pub use profile::{Fault, Outage, Profile, SimOAuth2};

/// What happened at the provider, for tests to count.
#[derive(Debug, Default)]
struct Ledger {
    /// Effects applied per idempotency key.
    by_key: HashMap<String, u32>,
    /// Effects applied per business reference (`ref` in the body): more than
    /// one is a double charge, whatever keys were sent.
    by_ref: HashMap<String, u32>,
    effects: u64,
}

#[derive(Debug, Clone)]
struct Job {
    id: String,
    ready_at: UnixMs,
    fate: JobFate,
    /// Polls that saw it finished (a flip happens after the first).
    seen_done: u32,
    input: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobFate {
    Succeed,
    Fail,
    Never,
    /// Succeeds, then changes its mind.
    Flip,
}

/// Shared simulator state.
struct Sim {
    profile: Profile,
    rng: Mutex<fastrand::Rng>,
    ledger: Mutex<Ledger>,
    jobs: Mutex<HashMap<String, Job>>,
    /// Job ids per idempotency key, so a resubmission gets the same job.
    jobs_by_key: Mutex<HashMap<String, String>>,
    started: UnixMs,
    /// Requests per whole second since start, at arrival.
    per_second: Mutex<Vec<u32>>,
    /// Requests in flight now (arrived, not yet answered), and the most
    /// at once.
    in_flight: Mutex<(u32, u32)>,
    /// A manual outage: until when, the share of requests it hits, and
    /// what they get.
    outage: Mutex<Option<(UnixMs, f64, Fault)>>,
    next_id: Mutex<u64>,
    client: reqwest::Client,
    callbacks_sent: Mutex<u64>,
    /// Jobs whose callbacks are still to be sent (or retried).
    callbacks_pending: Mutex<u64>,
    /// The provider's own clock: when jobs are ready and outages end (in
    /// its milliseconds), signatures and HTTP dates. Latencies and hangs
    /// are real time.
    clock: Arc<dyn Clock>,
    /// OAuth2 tokens issued, and the token endpoint's outage.
    tokens: Mutex<oauth2::Tokens>,
}

/// A handle on a running simulator.
#[derive(Clone)]
pub struct SimHandle {
    sim: Arc<Sim>,
    pub addr: SocketAddr,
    shutdown: CancellationToken,
}

/// Ledger figures.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LedgerFigures {
    pub keys: usize,
    pub refs: usize,
    pub effects: u64,
    /// Business references charged more than once.
    pub double_charges: usize,
}

/// Traffic figures.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StatsFigures {
    pub requests: u64,
    /// The most requests that arrived in any one wall-clock second.
    pub max_per_second: u32,
    /// The most requests in flight at once (from arrival until answered,
    /// or until the client went away).
    pub max_in_flight: u32,
    /// OAuth2 tokens issued by `POST /oauth/token`.
    pub tokens_issued: u64,
    /// 401s sent to `/v1/*` requests for a missing, unknown or expired
    /// token.
    pub unauthorized: u64,
}

impl SimHandle {
    /// Serves a simulator with `profile` on `listener` until the handle's
    /// `stop` (or the returned server future's end).
    pub async fn start(
        profile: Profile,
        listener: tokio::net::TcpListener,
    ) -> std::io::Result<SimHandle> {
        Self::start_with_clock(profile, listener, Arc::new(SystemClock)).await
    }

    /// [`start`](Self::start) on `clock`: jobs become ready and outages end
    /// as it says (a test's manual clock, shared with the engine), while
    /// latencies and hangs stay real time.
    pub async fn start_with_clock(
        profile: Profile,
        listener: tokio::net::TcpListener,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<SimHandle> {
        let addr = listener.local_addr()?;
        let sim = Arc::new(Sim {
            rng: Mutex::new(fastrand::Rng::with_seed(profile.seed)),
            profile,
            ledger: Mutex::default(),
            jobs: Mutex::default(),
            jobs_by_key: Mutex::default(),
            started: clock.now_ms(),
            per_second: Mutex::default(),
            in_flight: Mutex::default(),
            outage: Mutex::default(),
            next_id: Mutex::new(0),
            client: reqwest::Client::new(),
            callbacks_sent: Mutex::new(0),
            callbacks_pending: Mutex::new(0),
            clock,
            tokens: Mutex::default(),
        });
        let shutdown = CancellationToken::new();
        let app = router(sim.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "simulator stopped");
            }
        });
        Ok(SimHandle {
            sim,
            addr,
            shutdown,
        })
    }

    /// Starts on a free loopback port.
    pub async fn spawn(profile: Profile) -> std::io::Result<SimHandle> {
        Self::spawn_with_clock(profile, Arc::new(SystemClock)).await
    }

    /// [`spawn`](Self::spawn) on `clock` (see [`start_with_clock`](Self::start_with_clock)).
    pub async fn spawn_with_clock(
        profile: Profile,
        clock: Arc<dyn Clock>,
    ) -> std::io::Result<SimHandle> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        Self::start_with_clock(profile, listener, clock).await
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn ledger(&self) -> LedgerFigures {
        self.sim.ledger_figures()
    }

    /// Callbacks sent so far.
    pub fn callbacks_sent(&self) -> u64 {
        *Sim::lock(&self.sim.callbacks_sent)
    }

    /// Jobs whose callbacks (late ones, duplicates and retries included)
    /// are not all sent yet: zero once the simulator has nothing more to
    /// deliver for the jobs it was given.
    pub fn callbacks_pending(&self) -> u64 {
        *Sim::lock(&self.sim.callbacks_pending)
    }

    pub fn stats(&self) -> StatsFigures {
        self.sim.stats_figures()
    }

    /// Every request fails with a 503 (or `brownout` of them do) for
    /// `for_ms` from now.
    pub fn outage(&self, for_ms: u64, brownout: f64) {
        self.sim
            .set_outage(for_ms, brownout, Fault::ServerError(503));
    }

    /// A storm: every request (or `brownout` of them) gets `fault` for
    /// `for_ms` from now, e.g. `Fault::RateLimited(Some("2".into()))`.
    pub fn storm(&self, for_ms: u64, brownout: f64, fault: Fault) {
        self.sim.set_outage(for_ms, brownout, fault);
    }

    /// The OAuth2 token endpoint answers 503 for `for_ms` from now.
    pub fn token_outage(&self, for_ms: u64) {
        self.sim.set_token_outage(for_ms);
    }

    pub fn stop(&self) {
        self.shutdown.cancel();
    }
}

fn router(sim: Arc<Sim>) -> Router {
    Router::new()
        .route("/v1/charge", post(charge))
        .route("/v1/jobs", post(submit_job))
        .route("/v1/jobs/{id}", get(poll_job))
        .route("/v1/moved/{id}", get(moved))
        .route("/oauth/token", post(oauth2::token))
        .route(
            "/_sim/ledger",
            get(|State(s): State<Arc<Sim>>| async move { Json(s.ledger_figures()) }),
        )
        .route(
            "/_sim/stats",
            get(|State(s): State<Arc<Sim>>| async move { Json(s.stats_figures()) }),
        )
        .route("/_sim/outage", post(outage))
        .route("/_sim/token_outage", post(oauth2::token_outage))
        .with_state(sim)
}

impl Sim {
    fn lock<'a, T>(m: &'a Mutex<T>) -> std::sync::MutexGuard<'a, T> {
        // A panicking handler must not take the simulator down with it.
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn ledger_figures(&self) -> LedgerFigures {
        let l = Self::lock(&self.ledger);
        LedgerFigures {
            keys: l.by_key.len(),
            refs: l.by_ref.len(),
            effects: l.effects,
            double_charges: l.by_ref.values().filter(|n| **n > 1).count(),
        }
    }

    fn stats_figures(&self) -> StatsFigures {
        let s = Self::lock(&self.per_second);
        let tokens = Self::lock(&self.tokens);
        StatsFigures {
            requests: s.iter().map(|n| u64::from(*n)).sum(),
            max_per_second: s.iter().copied().max().unwrap_or(0),
            max_in_flight: Self::lock(&self.in_flight).1,
            tokens_issued: tokens.issued,
            unauthorized: tokens.unauthorized,
        }
    }

    fn set_outage(&self, for_ms: u64, brownout: f64, fault: Fault) {
        *Self::lock(&self.outage) = Some((
            self.clock.now_ms() + i64::try_from(for_ms).unwrap_or(i64::MAX / 2),
            brownout.clamp(0.0, 1.0),
            fault,
        ));
    }

    /// Counts a `/v1/*` request in and lets it through if it is
    /// authorized (see [`authorize`](Self::authorize)); it stays in flight
    /// while the guard lives.
    fn admit(&self, headers: &HeaderMap) -> Result<InFlight<'_>, oauth2::Unauthorized> {
        self.count_request();
        let flying = InFlight::new(self);
        self.authorize(headers)?;
        Ok(flying)
    }

    fn count_request(&self) {
        let second = usize::try_from((self.clock.now_ms() - self.started) / 1000).unwrap_or(0);
        let mut s = Self::lock(&self.per_second);
        if s.len() <= second {
            s.resize(second + 1, 0);
        }
        s[second] += 1;
    }

    fn next_id(&self, prefix: &str) -> String {
        let mut n = Self::lock(&self.next_id);
        *n += 1;
        format!("{prefix}_{:06}", *n)
    }

    /// Draws this request's fate: an outage first, then the profile's mix.
    fn draw(&self) -> (Fault, Duration, bool) {
        let mut rng = Self::lock(&self.rng);
        let outage = Self::lock(&self.outage).clone();
        let now = self.clock.now_ms();
        let elapsed = Duration::from_millis(u64::try_from(now - self.started).unwrap_or(0));
        let scheduled = self
            .profile
            .outages
            .iter()
            .find(|o| elapsed >= o.after && elapsed < o.after + o.lasts)
            .map(|o| (o.brownout, Fault::ServerError(503)));
        let manual = outage
            .filter(|(until, _, _)| now < *until)
            .map(|(_, b, f)| (b, f));
        let fault = match manual.or(scheduled) {
            Some((brownout, fault)) if rng.f64() < brownout.max(f64::EPSILON) => fault,
            _ => self.profile.draw_fault(&mut rng, self.clock.now_system()),
        };
        let latency = self.profile.draw_latency(&mut rng);
        let effect_anyway = rng.bool();
        (fault, latency, effect_anyway)
    }

    /// Applies a side effect once per idempotency key (unless the profile
    /// ignores keys); returns the number of times this key has applied.
    fn apply_effect(&self, key: Option<&str>, reference: Option<&str>) -> u32 {
        let mut l = Self::lock(&self.ledger);
        if let Some(k) = key {
            if !self.profile.ignore_keys {
                if let Some(n) = l.by_key.get(k) {
                    return *n;
                }
            }
        }
        l.effects += 1;
        if let Some(k) = key {
            *l.by_key.entry(k.to_owned()).or_default() += 1;
        }
        if let Some(r) = reference {
            *l.by_ref.entry(r.to_owned()).or_default() += 1;
        }
        1
    }
}

/// A request counted in flight until it is answered or its client goes
/// away (its handler is dropped).
struct InFlight<'a>(&'a Sim);

impl<'a> InFlight<'a> {
    fn new(sim: &'a Sim) -> Self {
        let mut f = Sim::lock(&sim.in_flight);
        f.0 += 1;
        f.1 = f.1.max(f.0);
        InFlight(sim)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        Sim::lock(&self.0.in_flight).0 -= 1;
    }
}

/// A mutating request's body (null when absent), idempotency key and
/// business reference.
fn request_parts(
    headers: &HeaderMap,
    body: Option<Json<Value>>,
) -> (Value, Option<String>, Option<String>) {
    let body = body.map(|Json(b)| b).unwrap_or(Value::Null);
    let reference = reference(&body);
    (body, idempotency_key(headers), reference)
}

fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn reference(body: &Value) -> Option<String> {
    body.get("ref").map(|r| match r {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

/// Runs `respond` under the chaos profile: delay, then either the real
/// answer or the drawn fault. `effect` applies the side effect; it runs for
/// real answers, for answers the client cannot read (truncated, a gzip
/// bomb, bad UTF-8) and, half the time, before a hang or reset (the
/// provider did the work but the client never heard). An unauthorized
/// request is refused before any of it.
async fn with_chaos(sim: &Sim, headers: &HeaderMap, effect: impl FnOnce() -> Response) -> Response {
    let _flying = match sim.admit(headers) {
        Ok(flying) => flying,
        Err(refused) => return refused.into_response(),
    };
    let (fault, latency, effect_anyway) = sim.draw();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    match fault {
        Fault::None => effect(),
        Fault::RateLimited(retry_after) => {
            let mut resp = (
                StatusCode::TOO_MANY_REQUESTS,
                Json(json!({ "error": "rate_limited" })),
            )
                .into_response();
            if let Some(ra) = retry_after {
                if let Ok(v) = HeaderValue::from_str(&ra) {
                    resp.headers_mut().insert(header::RETRY_AFTER, v);
                }
            }
            resp
        }
        Fault::ServerError(code) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, Json(json!({ "error": "upstream trouble" }))).into_response()
        }
        Fault::ClientError(code) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
            (status, Json(json!({ "error": "invalid_request", "message": "the provider refuses this input" }))).into_response()
        }
        Fault::Hang => {
            if effect_anyway {
                let _ = effect();
            }
            tokio::time::sleep(sim.profile.hang).await;
            (StatusCode::GATEWAY_TIMEOUT, "too late").into_response()
        }
        Fault::Reset => {
            if effect_anyway {
                let _ = effect();
            }
            // Half a body, then the connection breaks.
            let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
                Ok(Bytes::from_static(b"{\"id\": \"partial")),
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "simulated reset",
                )),
            ];
            let mut resp = Response::new(Body::from_stream(futures_util::stream::iter(chunks)));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
        Fault::Truncated => {
            let _ = effect();
            (
                [(header::CONTENT_TYPE, "application/json")],
                "{\"id\": \"ch_1\", \"status\": \"succ",
            )
                .into_response()
        }
        Fault::Html => (
            [(header::CONTENT_TYPE, "text/html")],
            "<html><body><h1>502 Bad Gateway</h1><script>alert(1)</script></body></html>",
        )
            .into_response(),
        Fault::Empty => StatusCode::OK.into_response(),
        Fault::Oversized => {
            let big = format!("{{\"padding\": \"{}\"}}", "x".repeat(3 * 1024 * 1024));
            ([(header::CONTENT_TYPE, "application/json")], big).into_response()
        }
        Fault::Redirect => {
            let to = format!("/v1/moved/{}", sim.next_id("mv"));
            (StatusCode::FOUND, [(header::LOCATION, to)]).into_response()
        }
        Fault::GzipBomb => {
            let _ = effect();
            gzip_bomb().await
        }
        Fault::BadUtf8 => {
            let _ = effect();
            (
                [(header::CONTENT_TYPE, "application/json")],
                Bytes::from_static(b"{\"id\":\"\xff\xfe\xfd\"}"),
            )
                .into_response()
        }
    }
}

/// The bomb inflates to this many bytes and a little more.
const BOMB_SIZE: usize = 64 * 1024 * 1024;

/// The gzip bomb's body: `{"padding":"` and 64 MiB of spaces, about 64 KiB
/// compressed. A process-wide constant, built on first use: compressing it
/// takes a second or more, and every simulator in a process (a test run
/// starts many) can share the same bytes. None if it could not be built.
static GZIP_BOMB: LazyLock<Option<Bytes>> = LazyLock::new(|| {
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let spaces = vec![b' '; 1024 * 1024];
    let mut write = || -> std::io::Result<()> {
        gz.write_all(b"{\"padding\":\"")?;
        for _ in 0..BOMB_SIZE / spaces.len() {
            gz.write_all(&spaces)?;
        }
        gz.write_all(b"\"}")
    };
    write().ok()?;
    gz.finish().ok().map(Bytes::from)
});

/// A 200 whose gzip body inflates to 64 MiB.
async fn gzip_bomb() -> Response {
    // Built off the async workers, the first time.
    let body = tokio::task::spawn_blocking(|| GZIP_BOMB.clone()).await;
    match body {
        Ok(Some(body)) => (
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CONTENT_ENCODING, "gzip"),
            ],
            body,
        )
            .into_response(),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "no bomb today").into_response(),
    }
}

/// `GET /v1/moved/{id}`: where a redirect points. It claims success for a
/// call that did nothing.
async fn moved(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let _flying = match sim.admit(&headers) {
        Ok(flying) => flying,
        Err(refused) => return refused.into_response(),
    };
    (
        StatusCode::OK,
        Json(json!({ "status": "succeeded", "id": id, "note": "you followed a redirect" })),
    )
        .into_response()
}

async fn charge(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    body: Option<Json<Value>>,
) -> Response {
    let (body, key, reference) = request_parts(&headers, body);
    let id = sim.next_id("ch");
    let s = sim.clone();
    with_chaos(&sim, &headers, move || {
        let times = s.apply_effect(key.as_deref(), reference.as_deref());
        let amount = body.get("amount").cloned().unwrap_or(json!(0));
        (
            StatusCode::OK,
            Json(
                json!({ "id": id, "status": "succeeded", "amount": amount, "replayed": times > 1 }),
            ),
        )
            .into_response()
    })
    .await
}

async fn submit_job(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    body: Option<Json<Value>>,
) -> Response {
    let (body, key, reference) = request_parts(&headers, body);
    let s = sim.clone();
    with_chaos(&sim, &headers, move || {
        // The same key gets the same job back, as real providers do.
        // One lock across check and insert: two concurrent submits with one
        // key must get one job, as from a real provider.
        let mut by_key = Sim::lock(&s.jobs_by_key);
        if let Some(k) = key.as_deref().filter(|_| !s.profile.ignore_keys) {
            if let Some(id) = by_key.get(k).cloned() {
                return (
                    StatusCode::OK,
                    Json(json!({ "id": id, "status": "queued" })),
                )
                    .into_response();
            }
        }
        s.apply_effect(key.as_deref(), reference.as_deref());
        let id = s.next_id("job");
        let (fate, ready_in) = {
            let mut rng = Sim::lock(&s.rng);
            (
                s.profile.draw_job_fate(&mut rng),
                s.profile.draw_job_time(&mut rng),
            )
        };
        let fate = match fate {
            0 => JobFate::Succeed,
            1 => JobFate::Fail,
            2 => JobFate::Never,
            _ => JobFate::Flip,
        };
        let callback_url = body
            .get("callback_url")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let job = Job {
            id: id.clone(),
            ready_at: s.clock.now_ms()
                + i64::try_from(ready_in.as_millis()).unwrap_or(i64::MAX / 2),
            fate,
            seen_done: 0,
            input: body,
        };
        if let Some(url) = callback_url {
            *Sim::lock(&s.callbacks_pending) += 1;
            tokio::spawn(send_callbacks(s.clone(), job.clone(), url));
        }
        Sim::lock(&s.jobs).insert(id.clone(), job);
        if let Some(k) = key {
            by_key.insert(k, id.clone());
        }
        (
            StatusCode::ACCEPTED,
            Json(json!({ "id": id, "status": "queued" })),
        )
            .into_response()
    })
    .await
}

async fn poll_job(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let s = sim.clone();
    with_chaos(&sim, &headers, move || {
        let mut jobs = Sim::lock(&s.jobs);
        let Some(job) = jobs.get_mut(&id) else {
            return (StatusCode::NOT_FOUND, Json(json!({ "error": "no such job" }))).into_response();
        };
        let now = s.clock.now_ms();
        let body = if now < job.ready_at || job.fate == JobFate::Never {
            json!({ "id": job.id, "status": "running" })
        } else {
            job.seen_done += 1;
            match job.fate {
                JobFate::Fail => json!({ "id": job.id, "status": "failed", "error": "render failed" }),
                JobFate::Flip if job.seen_done > 1 => {
                    json!({ "id": job.id, "status": "failed", "error": "result withdrawn" })
                }
                _ => json!({
                    "id": job.id,
                    "status": "succeeded",
                    "result": { "url": format!("https://cdn.example/{}.mp4", job.id), "input": job.input },
                }),
            }
        };
        (StatusCode::OK, Json(body)).into_response()
    })
    .await
}

/// Sends a job's callbacks when it finishes, with the profile's mischief:
/// duplicates, a stale progress report after the final word, lost
/// deliveries, and flips (success, then a contradicting failure).
async fn send_callbacks(sim: Arc<Sim>, job: Job, url: String) {
    // Counted out however this ends (a lost callback returns early).
    struct Sent(Arc<Sim>);
    impl Drop for Sent {
        fn drop(&mut self) {
            *Sim::lock(&self.0.callbacks_pending) -= 1;
        }
    }
    let _sent = Sent(sim.clone());
    sim.clock.sleep_until(job.ready_at).await;
    let (dup, late, lost) = {
        let mut rng = Sim::lock(&sim.rng);
        let p = &sim.profile;
        (
            rng.f64() < p.p_callback_duplicate,
            rng.f64() < p.p_callback_late_progress,
            rng.f64() < p.p_callback_lost,
        )
    };
    let done = json!({
        "job_id": job.id,
        "status": "succeeded",
        "result": { "url": format!("https://cdn.example/{}.mp4", job.id) },
    });
    let mut sends = match job.fate {
        JobFate::Never => return,
        _ if lost => return,
        JobFate::Fail => {
            vec![json!({ "job_id": job.id, "status": "failed", "error": "render failed" })]
        }
        JobFate::Succeed => vec![done],
        JobFate::Flip => vec![
            done,
            json!({ "job_id": job.id, "status": "failed", "error": "result withdrawn" }),
        ],
    };
    if late {
        sends.push(json!({ "job_id": job.id, "status": "running" }));
    }
    // Each message has its delivery id; a redelivery repeats it.
    let mut sends: Vec<(String, Value)> = sends
        .into_iter()
        .enumerate()
        .map(|(n, body)| (format!("dlv-{}-{n}", job.id), body))
        .collect();
    if dup {
        sends.insert(0, sends[0].clone());
    }
    for (delivery_id, body) in sends {
        let text = body.to_string();
        let mut req = sim
            .client
            .post(&url)
            .header("content-type", "application/json")
            .header("x-delivery-id", delivery_id);
        if let Some(secret) = &sim.profile.callback_secret {
            let now_s = sim.clock.now_ms() / 1000;
            req = req.header(
                "x-signature",
                crate::auth::webhook::sign(secret.as_bytes(), now_s, text.as_bytes()),
            );
        }
        // A provider retries failed deliveries a few times.
        for attempt in 0..5u64 {
            match req.try_clone().map(|r| r.body(text.clone())) {
                Some(r) => match r.send().await {
                    Ok(resp) if resp.status().is_success() || resp.status().is_client_error() => {
                        break;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100 * (attempt + 1))).await,
                },
                None => break,
            }
        }
        *Sim::lock(&sim.callbacks_sent) += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn outage(State(sim): State<Arc<Sim>>, Json(body): Json<Value>) -> StatusCode {
    let for_ms = body.get("for_ms").and_then(Value::as_u64).unwrap_or(10_000);
    let brownout = body.get("brownout").and_then(Value::as_f64).unwrap_or(1.0);
    let fault = match body.get("status").and_then(Value::as_u64) {
        Some(429) => Fault::RateLimited(
            body.get("retry_after")
                .and_then(Value::as_str)
                .map(str::to_owned),
        ),
        Some(code @ 500..=599) => Fault::ServerError(code as u16),
        None => Fault::ServerError(503),
        // An outage answers 429 or a 5xx; anything else is a mistake.
        Some(_) => return StatusCode::BAD_REQUEST,
    };
    sim.set_outage(for_ms, brownout, fault);
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clean profile with `set` applied.
    fn profile(set: impl FnOnce(&mut Profile)) -> Profile {
        let mut p = Profile::clean(1);
        set(&mut p);
        p
    }

    /// `POST /v1/charge` for `reference`, following redirects or not.
    async fn charge(sim: &SimHandle, reference: &str, follow: bool) -> reqwest::Response {
        let policy = if follow {
            reqwest::redirect::Policy::default()
        } else {
            reqwest::redirect::Policy::none()
        };
        let client = reqwest::Client::builder().redirect(policy).build().unwrap();
        client
            .post(format!("{}/v1/charge", sim.base_url()))
            .json(&json!({ "ref": reference, "amount": 5 }))
            .send()
            .await
            .unwrap()
    }

    fn header_of<'a>(resp: &'a reqwest::Response, name: &str) -> &'a str {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    #[tokio::test]
    async fn a_redirect_does_nothing_and_its_target_claims_success() {
        let sim = SimHandle::spawn(profile(|p| p.p_redirect = 1.0))
            .await
            .unwrap();
        let resp = charge(&sim, "r1", false).await;
        assert_eq!(resp.status().as_u16(), 302);
        let to = header_of(&resp, "location").to_owned();
        assert!(to.starts_with("/v1/moved/mv_"), "{to}");

        // A client that follows it turns the POST into a GET of the target,
        // which says the call succeeded.
        let followed = charge(&sim, "r2", true).await;
        assert_eq!(followed.status().as_u16(), 200);
        assert!(followed.url().path().starts_with("/v1/moved/"));
        let body: Value = followed.json().await.unwrap();
        assert_eq!(body["status"], "succeeded");
        assert_eq!(body["note"], "you followed a redirect");
        assert_eq!(sim.ledger().effects, 0, "a redirect applies nothing");
        sim.stop();
    }

    #[tokio::test]
    async fn a_gzip_bomb_is_small_inflates_past_64_mib_and_applies_the_effect() {
        use std::io::Read as _;
        let sim = SimHandle::spawn(profile(|p| p.p_gzip_bomb = 1.0))
            .await
            .unwrap();
        let resp = charge(&sim, "b1", false).await;
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(header_of(&resp, "content-encoding"), "gzip");
        assert_eq!(header_of(&resp, "content-type"), "application/json");
        let body = resp.bytes().await.unwrap();
        assert!(body.len() < 256 * 1024, "{} bytes on the wire", body.len());
        // Counted as it inflates, never held whole.
        let mut gz = flate2::read::GzDecoder::new(&body[..]);
        let mut head = [0u8; 12];
        gz.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"{\"padding\":\"");
        let rest = std::io::copy(&mut gz, &mut std::io::sink()).unwrap();
        assert!(rest + 12 > BOMB_SIZE as u64, "inflates to {}", rest + 12);
        assert_eq!(sim.ledger().effects, 1, "the provider did the work");
        sim.stop();
    }

    #[tokio::test]
    async fn bad_utf8_is_a_200_that_does_not_decode_and_applies_the_effect() {
        let sim = SimHandle::spawn(profile(|p| p.p_bad_utf8 = 1.0))
            .await
            .unwrap();
        let resp = charge(&sim, "u1", false).await;
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(header_of(&resp, "content-type"), "application/json");
        let body = resp.bytes().await.unwrap();
        assert!(body.starts_with(b"{\"id\":\""), "{body:?}");
        assert!(std::str::from_utf8(&body).is_err());
        assert!(serde_json::from_slice::<Value>(&body).is_err());
        assert_eq!(sim.ledger().effects, 1);
        sim.stop();
    }
}
