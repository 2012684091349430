//! The chaos simulator: a real HTTP provider with a seeded, configurable
//! failure mix, a ledger of side effects per idempotency key, and figures
//! for tests and benchmarks. Served by `ballast sim`, and mounted in-process
//! by tests and the demo.
//!
//! Routes (chaos applies to `/v1/*` only):
//! - `POST /v1/charge`: a synchronous call with a side effect. The body's
//!   `client_reference` (or `ref`) is the client's own reference for it.
//! - `POST /v1/jobs`, `GET /v1/jobs/{id}`: an asynchronous job to poll.
//! - `GET /v1/charges?client_reference=R`, `GET /v1/jobs?client_reference=R`:
//!   `{"data": [{"id", "status", "client_reference"}, ...]}`, every charge
//!   (with its `amount`) or job made for that reference, newest first: how
//!   a client finds what it made when it never heard the answer. Chaos as
//!   for any call, no side effect.
//! - `GET /v1/moved/{id}`: where a redirect fault points; answers 200
//!   `{"status": "succeeded"}`, a trap for a client that follows a POST's
//!   redirect and takes the moved page for the call's answer. No chaos.
//! - `POST /oauth/token` (when the profile has `oauth2`): client
//!   credentials, by HTTP Basic or in the form, for a bearer token that
//!   every `/v1/*` route then requires (a 401 `invalid_token` otherwise,
//!   before any chaos and with no side effect). Tokens die `ttl` after
//!   issue by the simulator's clock, whatever `expires_in` says.
//! - `GET /_sim/ledger`: effects per key and per reference, double charges.
//! - `GET /_sim/arrivals`: every `POST /v1/charge` and `POST /v1/jobs` that
//!   reached the simulator, in arrival order: key, reference, route,
//!   whether it applied an effect, and the fault it drew.
//! - `GET /_sim/stats`: requests, the most in any one second, the most in
//!   flight at once, tokens issued and 401s for bad or expired tokens.
//! - `POST /_sim/outage`: `{"for_ms": N, "brownout": 0.0..1.0}` from now;
//!   503s unless `"status"` says 429 (with `"retry_after"`, the header's
//!   text) or another 5xx; any other status is a 400.
//! - `POST /_sim/token_outage`: `{"for_ms": N}`: the token endpoint
//!   answers 503 for that long.

mod ledger;
mod oauth2;
mod profile;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::domain::{Clock, SystemClock, UnixMs};

pub use ledger::{Arrival, LedgerFigures, Route};
use ledger::{ArrivalId, Charge, Ledger};
pub use profile::{Fault, Maintenance, Outage, Profile, SimOAuth2};

#[derive(Debug, Clone)]
struct Job {
    id: String,
    ready_at: UnixMs,
    fate: JobFate,
    /// Polls that saw it finished (a flip happens after the first).
    seen_done: u32,
    input: Value,
}

/// The jobs made, by id, idempotency key and client reference.
#[derive(Debug, Default)]
struct Jobs {
    by_id: HashMap<String, Job>,
    /// Job ids per idempotency key, so a resubmission gets the same job.
    by_key: HashMap<String, String>,
    /// Job ids per client reference, oldest first, for lookups.
    by_ref: HashMap<String, Vec<String>>,
}

impl Job {
    fn done(&self, now: UnixMs) -> bool {
        now >= self.ready_at && self.fate != JobFate::Never
    }

    /// What a poll shows now, given the polls that saw it finished
    /// before (a lookup counts no poll, and shows what the last one did).
    fn shown(&self, now: UnixMs) -> Shown {
        match self.fate {
            _ if !self.done(now) => Shown::Running,
            JobFate::Fail => Shown::Failed("render failed"),
            JobFate::Flip if self.seen_done > 1 => Shown::Failed("result withdrawn"),
            _ => Shown::Succeeded,
        }
    }
}

/// What a poll shows of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    Running,
    /// Failed, and why.
    Failed(&'static str),
    Succeeded,
}

impl Shown {
    fn status(self) -> &'static str {
        match self {
            Shown::Running => "running",
            Shown::Failed(_) => "failed",
            Shown::Succeeded => "succeeded",
        }
    }
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
    jobs: Mutex<Jobs>,
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

    /// Every `POST /v1/charge` and `POST /v1/jobs` that reached the
    /// simulator so far, in arrival order, whatever became of it.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.sim.arrivals()
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
        .route("/v1/charges", get(list_charges))
        .route("/v1/jobs", post(submit_job).get(list_jobs))
        .route("/v1/jobs/{id}", get(poll_job))
        .route("/v1/moved/{id}", get(moved))
        .route("/oauth/token", post(oauth2::token))
        .route(
            "/_sim/ledger",
            get(|State(s): State<Arc<Sim>>| async move { Json(s.ledger_figures()) }),
        )
        .route(
            "/_sim/arrivals",
            get(|State(s): State<Arc<Sim>>| async move { Json(s.arrivals()) }),
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
        Self::lock(&self.ledger).figures()
    }

    fn arrivals(&self) -> Vec<Arrival> {
        Self::lock(&self.ledger).arrivals().to_vec()
    }

    /// Lists a mutating call in the arrivals with the fault it drew; a
    /// read is not listed.
    fn arrive(&self, call: Call, fault: &str) -> Option<ArrivalId> {
        let Call::Mutation {
            route,
            key,
            reference,
        } = call
        else {
            return None;
        };
        Some(Self::lock(&self.ledger).arrive(route, key, reference, fault))
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
        let maintenance = self
            .profile
            .maintenance
            .iter()
            .find(|m| elapsed >= m.after && elapsed < m.after + m.lasts)
            .map(|m| (1.0, Fault::Maintenance(m.retry_after.as_secs())));
        let fault = match maintenance.or(manual).or(scheduled) {
            Some((brownout, fault)) if rng.f64() < brownout.max(f64::EPSILON) => fault,
            _ => self.profile.draw_fault(&mut rng, self.clock.now_system()),
        };
        let latency = self.profile.draw_latency(&mut rng);
        let effect_anyway = rng.bool();
        (fault, latency, effect_anyway)
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
/// client reference.
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

/// The client's own reference for what it asks for: `client_reference`,
/// or `ref` when that is absent (null counts as absent).
fn reference(body: &Value) -> Option<String> {
    let given = |name: &str| body.get(name).filter(|r| !r.is_null());
    given("client_reference")
        .or_else(|| given("ref"))
        .map(|r| match r {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
}

/// What a `/v1/*` call is to the chaos.
enum Call {
    /// A poll or a lookup: no side effect, not listed in the arrivals.
    Read,
    /// A call with a side effect, listed in the arrivals.
    Mutation {
        route: Route,
        key: Option<String>,
        reference: Option<String>,
    },
}

/// Runs `respond` under the chaos profile: delay, then either the real
/// answer or the drawn fault. `respond` applies the call's side effect (it
/// is given the call's place in the arrivals, for a mutation); it runs for
/// real answers and for faults that come after the work (see
/// [`Fault::applies_effect`]). A read (a poll, a lookup) that draws a fault
/// meant for effects (a reset or a stall after the effect) is answered: it
/// has no effect to apply first. An unauthorized request is refused before
/// any of it. A mutation is listed in the arrivals with its fault, however
/// it ends.
async fn with_chaos(
    sim: &Sim,
    headers: &HeaderMap,
    call: Call,
    respond: impl FnOnce(Option<ArrivalId>) -> Response,
) -> Response {
    let _flying = match sim.admit(headers) {
        Ok(flying) => flying,
        Err(refused) => {
            sim.arrive(call, "unauthorized");
            return refused.into_response();
        }
    };
    let (fault, latency, effect_anyway) = sim.draw();
    let fault = match (&call, fault) {
        (Call::Read, Fault::ResetAfterEffect | Fault::StallAfterEffect) => Fault::None,
        (_, fault) => fault,
    };
    let arrival = sim.arrive(call, fault.name());
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if fault == Fault::None {
        return respond(arrival);
    }
    if fault.applies_effect(effect_anyway) {
        let _ = respond(arrival);
    }
    fault_reply(sim, fault).await
}

/// What a call that drew `fault` gets instead of its answer.
async fn fault_reply(sim: &Sim, fault: Fault) -> Response {
    let json_body = |body: &'static [u8]| {
        (
            [(header::CONTENT_TYPE, "application/json")],
            Bytes::from_static(body),
        )
            .into_response()
    };
    match fault {
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
        Fault::Maintenance(secs) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, secs.to_string())],
            Json(json!({ "error": "maintenance" })),
        )
            .into_response(),
        Fault::ServerError(code) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, Json(json!({ "error": "upstream trouble" }))).into_response()
        }
        Fault::ClientError(code) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
            (status, Json(json!({ "error": "invalid_request", "message": "the provider refuses this input" }))).into_response()
        }
        Fault::Hang | Fault::StallAfterEffect => {
            tokio::time::sleep(sim.profile.hang).await;
            (StatusCode::GATEWAY_TIMEOUT, "too late").into_response()
        }
        Fault::Reset | Fault::ResetAfterEffect => reset(),
        Fault::Truncated => json_body(b"{\"id\": \"ch_1\", \"status\": \"succ"),
        Fault::Html => (
            [(header::CONTENT_TYPE, "text/html")],
            "<html><body><h1>502 Bad Gateway</h1><script>alert(1)</script></body></html>",
        )
            .into_response(),
        // `None` is the call's own answer and never comes here.
        Fault::Empty | Fault::None => StatusCode::OK.into_response(),
        Fault::Oversized => {
            let big = format!("{{\"padding\": \"{}\"}}", "x".repeat(3 * 1024 * 1024));
            ([(header::CONTENT_TYPE, "application/json")], big).into_response()
        }
        Fault::Redirect => {
            let to = format!("/v1/moved/{}", sim.next_id("mv"));
            (StatusCode::FOUND, [(header::LOCATION, to)]).into_response()
        }
        Fault::GzipBomb => gzip_bomb().await,
        Fault::BadUtf8 => json_body(b"{\"id\":\"\xff\xfe\xfd\"}"),
    }
}

/// Half a body, then the connection breaks.
fn reset() -> Response {
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
    let call = Call::Mutation {
        route: Route::Charge,
        key: key.clone(),
        reference: reference.clone(),
    };
    let s = sim.clone();
    with_chaos(&sim, &headers, call, move |arrival| {
        let amount = body.get("amount").cloned().unwrap_or(json!(0));
        let made = Charge {
            id,
            reference,
            amount,
        };
        // A known key gets its first charge back, as real providers do.
        let honour_keys = !s.profile.ignore_keys;
        let (charge, replayed) = Sim::lock(&s.ledger).charge(honour_keys, arrival, key, made);
        (
            StatusCode::OK,
            Json(json!({
                "id": charge.id,
                "status": "succeeded",
                "amount": charge.amount,
                "replayed": replayed,
            })),
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
    let call = Call::Mutation {
        route: Route::Jobs,
        key: key.clone(),
        reference: reference.clone(),
    };
    let s = sim.clone();
    with_chaos(&sim, &headers, call, move |arrival| {
        // The same key gets the same job back, as real providers do.
        // One lock across check and insert: two concurrent submits with one
        // key must get one job, as from a real provider.
        let mut jobs = Sim::lock(&s.jobs);
        if let Some(k) = key.as_deref().filter(|_| !s.profile.ignore_keys) {
            if let Some(id) = jobs.by_key.get(k).cloned() {
                return (
                    StatusCode::OK,
                    Json(json!({ "id": id, "status": "queued" })),
                )
                    .into_response();
            }
        }
        Sim::lock(&s.ledger).count(arrival, key.as_deref(), reference.as_deref());
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
        jobs.by_id.insert(id.clone(), job);
        if let Some(k) = key {
            jobs.by_key.insert(k, id.clone());
        }
        if let Some(r) = reference {
            jobs.by_ref.entry(r).or_default().push(id.clone());
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
    with_chaos(&sim, &headers, Call::Read, move |_| {
        let mut jobs = Sim::lock(&s.jobs);
        let Some(job) = jobs.by_id.get_mut(&id) else {
            return (StatusCode::NOT_FOUND, Json(json!({ "error": "no such job" }))).into_response();
        };
        let now = s.clock.now_ms();
        if job.done(now) {
            job.seen_done += 1;
        }
        let body = match job.shown(now) {
            Shown::Running => json!({ "id": job.id, "status": "running" }),
            Shown::Failed(error) => json!({ "id": job.id, "status": "failed", "error": error }),
            Shown::Succeeded => json!({
                "id": job.id,
                "status": "succeeded",
                "result": { "url": format!("https://cdn.example/{}.mp4", job.id), "input": job.input },
            }),
        };
        (StatusCode::OK, Json(body)).into_response()
    })
    .await
}

/// A lookup's query: `?client_reference=R`.
#[derive(Debug, Deserialize)]
struct ByReference {
    client_reference: Option<String>,
}

/// A lookup's answer: `{"data": [...]}`, or a 400 without a reference.
fn lookup(query: ByReference, find: impl FnOnce(&str) -> Vec<Value>) -> Response {
    match query.client_reference {
        Some(r) => (StatusCode::OK, Json(json!({ "data": find(&r) }))).into_response(),
        None => (
            StatusCode::BAD_REQUEST,
            Json(json!({ "error": "invalid_request", "message": "client_reference is required" })),
        )
            .into_response(),
    }
}

/// `GET /v1/charges?client_reference=R`: the charges made for R, newest
/// first.
async fn list_charges(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    Query(query): Query<ByReference>,
) -> Response {
    let s = sim.clone();
    with_chaos(&sim, &headers, Call::Read, move |_| {
        lookup(query, |r| {
            let ledger = Sim::lock(&s.ledger);
            ledger
                .charges_for(r)
                .map(|c| {
                    json!({
                        "id": c.id,
                        "status": "succeeded",
                        "amount": c.amount,
                        "client_reference": r,
                    })
                })
                .collect()
        })
    })
    .await
}

/// `GET /v1/jobs?client_reference=R`: the jobs made for R, newest first,
/// each with its status as the last poll showed it.
async fn list_jobs(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    Query(query): Query<ByReference>,
) -> Response {
    let s = sim.clone();
    with_chaos(&sim, &headers, Call::Read, move |_| {
        lookup(query, |r| {
            let jobs = Sim::lock(&s.jobs);
            let now = s.clock.now_ms();
            let ids = jobs.by_ref.get(r).into_iter().flatten().rev();
            ids.filter_map(|id| jobs.by_id.get(id))
                .map(|j| json!({ "id": j.id, "status": j.shown(now).status(), "client_reference": r }))
                .collect()
        })
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
                    // A 429 (too many deliveries) is tried again, as
                    // providers do; another 4xx is final.
                    Ok(resp)
                        if resp.status().is_success()
                            || (resp.status().is_client_error() && resp.status() != 429) =>
                    {
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

    /// `POST {path}` (`/v1/charge` or `/v1/jobs`) with an idempotency key
    /// and a client reference; the whole answer read, or the error.
    async fn post(
        client: &reqwest::Client,
        sim: &SimHandle,
        path: &str,
        key: &str,
        reference: &str,
    ) -> reqwest::Result<(u16, Value)> {
        let resp = client
            .post(format!("{}{path}", sim.base_url()))
            .header("idempotency-key", key)
            .json(&json!({ "client_reference": reference, "amount": 5 }))
            .send()
            .await?;
        let status = resp.status().as_u16();
        Ok((status, resp.json().await?))
    }

    /// The ids a lookup (`/v1/charges` or `/v1/jobs`) finds for `reference`
    /// (plain enough for a URL), in the order given; each row names the
    /// reference.
    async fn looked_up(sim: &SimHandle, path: &str, reference: &str) -> Vec<String> {
        let resp = reqwest::Client::new()
            .get(format!(
                "{}{path}?client_reference={reference}",
                sim.base_url()
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let body: Value = resp.json().await.unwrap();
        let rows = body["data"].as_array().unwrap();
        for row in rows {
            assert_eq!(row["client_reference"], reference, "{row}");
        }
        rows.iter()
            .map(|row| row["id"].as_str().unwrap().to_owned())
            .collect()
    }

    /// Each arrival's key, fault and whether it applied an effect.
    fn arrived(sim: &SimHandle) -> Vec<(Option<String>, String, bool)> {
        sim.arrivals()
            .into_iter()
            .map(|a| (a.key, a.fault, a.effect))
            .collect()
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

    #[tokio::test]
    async fn a_known_key_is_one_effect_unless_keys_are_ignored_then_a_second_and_a_double_charge() {
        for ignore_keys in [false, true] {
            let sim = SimHandle::spawn(profile(|p| p.ignore_keys = ignore_keys))
                .await
                .unwrap();
            let client = reqwest::Client::new();
            let mut charges = Vec::new();
            let mut jobs = Vec::new();
            for _ in 0..2 {
                let (status, body) = post(&client, &sim, "/v1/charge", "k1", "r1").await.unwrap();
                assert_eq!(status, 200);
                charges.push((
                    body["id"].as_str().unwrap().to_owned(),
                    body["replayed"] == true,
                ));
                let (_, body) = post(&client, &sim, "/v1/jobs", "k2", "j1").await.unwrap();
                jobs.push(body["id"].as_str().unwrap().to_owned());
            }
            let found = looked_up(&sim, "/v1/charges", "r1").await;
            let found_jobs = looked_up(&sim, "/v1/jobs", "j1").await;
            let ledger = sim.ledger();
            assert_eq!((ledger.keys, ledger.refs), (2, 2));
            if ignore_keys {
                assert_ne!(charges[0].0, charges[1].0, "a second charge");
                assert!(!charges[0].1 && !charges[1].1, "{charges:?}");
                assert_ne!(jobs[0], jobs[1], "a second job");
                assert_eq!((ledger.effects, ledger.double_charges), (4, 2));
                assert_eq!(found, [charges[1].0.clone(), charges[0].0.clone()]);
                assert_eq!(found_jobs, [jobs[1].clone(), jobs[0].clone()]);
            } else {
                assert_eq!(charges[0].0, charges[1].0, "the first charge back");
                assert_eq!((charges[0].1, charges[1].1), (false, true));
                assert_eq!(jobs[0], jobs[1]);
                assert_eq!((ledger.effects, ledger.double_charges), (2, 0));
                assert_eq!(found, [charges[0].0.clone()]);
                assert_eq!(found_jobs, [jobs[0].clone()]);
            }
            let effects: Vec<bool> = sim.arrivals().iter().map(|a| a.effect).collect();
            assert_eq!(effects, [true, true, ignore_keys, ignore_keys]);
            sim.stop();
        }
    }

    #[tokio::test]
    async fn a_reset_after_the_effect_hides_what_a_lookup_then_finds() {
        let sim = SimHandle::spawn(profile(|p| p.p_reset_after_effect = 1.0))
            .await
            .unwrap();
        let client = reqwest::Client::new();
        for (path, reference) in [("/v1/charge", "r1"), ("/v1/jobs", "j1")] {
            let answer = post(&client, &sim, path, reference, reference).await;
            assert!(answer.is_err(), "{path}: {answer:?}");
        }
        let ledger = sim.ledger();
        assert_eq!((ledger.effects, ledger.double_charges), (2, 0));
        // The knob is about effects: lookups draw it and are answered.
        assert_eq!(looked_up(&sim, "/v1/charges", "r1").await.len(), 1);
        assert_eq!(looked_up(&sim, "/v1/jobs", "j1").await.len(), 1);
        let fault = || "reset_after_effect".to_owned();
        assert_eq!(
            arrived(&sim),
            [
                (Some("r1".to_owned()), fault(), true),
                (Some("j1".to_owned()), fault(), true)
            ]
        );
        sim.stop();
    }

    #[tokio::test]
    async fn a_stall_after_the_effect_outlasts_the_client_and_a_lookup_finds_the_charge() {
        let sim = SimHandle::spawn(profile(|p| {
            p.p_stall_after_effect = 1.0;
            p.hang = Duration::from_secs(30);
        }))
        .await
        .unwrap();
        // The timeout is what the test is about: the client gives up, the
        // provider has charged.
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let answer = post(&client, &sim, "/v1/charge", "k1", "r1").await;
        assert!(answer.is_err_and(|e| e.is_timeout()));
        assert_eq!(sim.ledger().effects, 1);
        let found = looked_up(&sim, "/v1/charges", "r1").await;
        assert_eq!(found.len(), 1);
        assert!(found[0].starts_with("ch_"), "{found:?}");
        assert_eq!(
            arrived(&sim),
            [(Some("k1".to_owned()), "stall_after_effect".to_owned(), true)]
        );
        sim.stop();
    }

    #[tokio::test]
    async fn a_lookup_for_an_unknown_reference_finds_nothing_and_one_without_a_reference_is_refused()
     {
        let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
        let client = reqwest::Client::new();
        post(&client, &sim, "/v1/charge", "k1", "r1").await.unwrap();
        post(&client, &sim, "/v1/jobs", "k2", "r1").await.unwrap();
        for path in ["/v1/charges", "/v1/jobs"] {
            assert_eq!(looked_up(&sim, path, "r2").await, Vec::<String>::new());
            let bare = client
                .get(format!("{}{path}", sim.base_url()))
                .send()
                .await
                .unwrap();
            assert_eq!(bare.status().as_u16(), 400, "{path}");
        }
        let body: Value = client
            .get(format!("{}/v1/charges?client_reference=r1", sim.base_url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(body["data"][0]["status"], "succeeded");
        assert_eq!(body["data"][0]["amount"], 5);
        assert_eq!(sim.arrivals().len(), 2, "lookups are not arrivals");
        sim.stop();
    }

    #[tokio::test]
    async fn arrivals_list_every_mutating_request_in_order_with_its_fate() {
        let clock = crate::domain::ManualClock::new(1_700_000_000_000);
        let sim = SimHandle::spawn_with_clock(Profile::clean(1), Arc::new(clock.clone()))
            .await
            .unwrap();
        let client = reqwest::Client::new();
        post(&client, &sim, "/v1/charge", "k1", "r1").await.unwrap();
        post(&client, &sim, "/v1/charge", "k1", "r1").await.unwrap();
        let (_, job) = post(&client, &sim, "/v1/jobs", "k2", "j1").await.unwrap();
        sim.storm(1_000, 1.0, Fault::ServerError(503));
        let (status, _) = post(&client, &sim, "/v1/charge", "k3", "r3").await.unwrap();
        assert_eq!(status, 503);
        clock.advance(1_000);
        // A poll is no arrival; a charge without a key is one.
        let poll = format!("{}/v1/jobs/{}", sim.base_url(), job["id"].as_str().unwrap());
        assert_eq!(
            client.get(poll).send().await.unwrap().status().as_u16(),
            200
        );
        let keyless = client
            .post(format!("{}/v1/charge", sim.base_url()))
            .json(&json!({ "ref": "r4" }))
            .send()
            .await
            .unwrap();
        assert_eq!(keyless.status().as_u16(), 200);

        let rows = sim.arrivals();
        let routes: Vec<Route> = rows.iter().map(|a| a.route).collect();
        use Route::{Charge, Jobs};
        assert_eq!(routes, [Charge, Charge, Jobs, Charge, Charge]);
        let refs: Vec<Option<&str>> = rows.iter().map(|a| a.client_reference.as_deref()).collect();
        assert_eq!(
            refs,
            [Some("r1"), Some("r1"), Some("j1"), Some("r3"), Some("r4")]
        );
        let key = |k: &str| Some(k.to_owned());
        let (none, five) = ("none".to_owned(), "server_error".to_owned());
        assert_eq!(
            arrived(&sim),
            [
                (key("k1"), none.clone(), true),
                (key("k1"), none.clone(), false),
                (key("k2"), none.clone(), true),
                (key("k3"), five, false),
                (None, none, true),
            ]
        );
        // The same rows over HTTP, for a test driving `ballast sim`.
        let served: Vec<Arrival> = client
            .get(format!("{}/_sim/arrivals", sim.base_url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(served, rows);
        let raw: Value = client
            .get(format!("{}/_sim/arrivals", sim.base_url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(raw[2]["route"], "POST /v1/jobs");
        assert_eq!(raw[2]["client_reference"], "j1");
        sim.stop();
    }

    #[test]
    fn client_reference_wins_over_ref_and_null_is_none() {
        let of = |body: Value| reference(&body);
        assert_eq!(
            of(json!({ "client_reference": "a", "ref": "b" })).as_deref(),
            Some("a")
        );
        assert_eq!(of(json!({ "ref": "b" })).as_deref(), Some("b"));
        assert_eq!(
            of(json!({ "client_reference": null, "ref": 7 })).as_deref(),
            Some("7")
        );
        assert_eq!(of(json!({ "ref": null })), None);
        assert_eq!(of(Value::Null), None);
    }
}
