//! The HTTP control plane: one router per area, merged here with the layers
//! every response passes through.
//!
//! - open: `/healthz`, `/readyz`, `/login`, `/static/*`, signed `/hooks/*`
//!   and `/triggers/*`;
//! - dashboard pages and fragments: a session cookie, CSRF on every write;
//! - `/api/v1`: bearer API tokens, rate-limited per token and per address;
//! - `/metrics`: the metrics token or an API token, rate-limited per address;
//! - `/hooks/*`, `/triggers/*`: rate-limited per address before any lookup
//!   or signature check.

mod api;
pub use api::served as openapi;
mod assets;
pub mod auth;
pub mod error;
pub mod fmt;
pub mod graph;
mod health;
mod hooks;
pub mod htmx;
pub mod lanes;
pub mod mask;
pub mod metrics;
pub mod notices;
pub mod oidc;
pub mod pages;
pub mod people;
pub mod providers;
pub mod query;
pub mod requests;
pub mod scope;
pub mod security;
mod state;
pub mod stats_view;
mod triggers;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware::{from_fn, from_fn_with_state};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

pub use auth::AuthKeys;
pub use state::AppState;

/// What the control plane keeps beside the store: keys and per-user limits.
pub struct WebContext {
    pub keys: AuthKeys,
    /// Bulk actions per user.
    pub bulk_limiter: DefaultKeyedRateLimiter<String>,
    /// Password checks under way on this node, bounded.
    pub password_checks: crate::auth::password::Checks,
    /// The single sign-on provider's client (its discovery and keys).
    pub sign_on: crate::web::oidc::Client,
}

impl WebContext {
    pub fn new(
        keys: AuthKeys,
        limits: &crate::config::WebLimits,
        clock: Arc<dyn crate::domain::Clock>,
    ) -> Result<Self, String> {
        let per_minute =
            std::num::NonZeroU32::new(limits.bulk_per_minute).unwrap_or(std::num::NonZeroU32::MIN);
        Ok(WebContext {
            sign_on: crate::web::oidc::Client::new(clock)?,
            keys,
            bulk_limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
            password_checks: crate::auth::password::Checks::new(
                usize::try_from(limits.password_checks).unwrap_or(usize::MAX),
            ),
        })
    }
}

/// Every route of the control plane, with its layers.
pub fn router(state: AppState) -> Router {
    let limits = state.config.get().server.limits.clone();
    let dashboard = pages::router(&state)
        .layer(from_fn_with_state(state.clone(), security::csrf))
        .layer(from_fn(security::page_errors));
    Router::new()
        .merge(health::router())
        .merge(hooks::router(&state))
        .merge(triggers::router(&state))
        .merge(assets::router())
        .merge(metrics::router(&state))
        .merge(dashboard)
        .nest("/api/v1", api::router(&state))
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(from_fn_with_state(state.clone(), security::headers))
        // Outermost: every response, errors from the layers above
        // included, carries the id and is logged once.
        .layer(from_fn_with_state(state.clone(), requests::request_id))
        .with_state(state)
}

/// `routes` limited per client address (a trusted proxy's forwarded one):
/// `per_second` on average, in bursts of twice as many; past it, 429 with
/// `Retry-After: 1` saying `what`, before the handler reads the body,
/// looks anything up or checks a signature.
pub(crate) fn per_address(
    routes: Router<AppState>,
    state: &AppState,
    per_second: u64,
    what: &'static str,
) -> Router<AppState> {
    use axum::http::{HeaderValue, header};
    use axum::response::IntoResponse;
    let per_second = per_second.max(1);
    let config = tower_governor::governor::GovernorConfigBuilder::default()
        .key_extractor(auth::ClientIpKey {
            trusted: state.web.keys.trusted_proxies.clone(),
        })
        .per_nanosecond((1_000_000_000 / per_second).max(1))
        .burst_size(u32::try_from(per_second * 2).unwrap_or(u32::MAX))
        .finish();
    let Some(config) = config else {
        return routes;
    };
    let limiter = config.limiter().clone();
    clean_every_minute(state.shutdown.clone(), move || limiter.retain_recent());
    let refuse = move |_| {
        let mut r = error::WebError::TooManyRequests(what.into()).into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    };
    routes.layer(tower_governor::GovernorLayer::new(Arc::new(config)).error_handler(refuse))
}

/// Runs `clean` every minute until shutdown: rate limiters forget idle
/// keys, so their memory stays bounded whatever keys clients send.
pub(crate) fn clean_every_minute(
    stop: tokio_util::sync::CancellationToken,
    clean: impl Fn() + Send + 'static,
) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(60)) => clean(),
                () = stop.cancelled() => break,
            }
        }
    });
}

/// How long ended sessions, old delivery ids, statistics and login
/// counters are kept.
const KEEP_MS: i64 = crate::engine::stats::KEEP_MS;

/// Background upkeep of the control plane: every minute, idle rate-limit
/// keys are forgotten and the statistics' minute rows more than 61
/// minutes old are folded into hour rows; expired sessions, old statistics,
/// delivery ids, login counters, deliveries no step took (after the
/// longest callback deadline) and idle groups' counters are purged hourly (every node does both;
/// the compaction is safe run at once, the deletes are idempotent).
pub async fn housekeeping(state: AppState) {
    let mut minutes: u64 = 0;
    loop {
        let now = state.clock.now_ms();
        // The first run after an upgrade may fold days of minutes, an hour
        // per transaction: a shutdown meanwhile drops the one in hand.
        tokio::select! {
            r = state.db.compact_rollups(stats_view::compaction_cutoff(now)) => {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "could not fold statistics into hours");
                }
            }
            () = state.shutdown.cancelled() => break,
        }
        if minutes % 60 == 0 {
            if let Err(e) = state.db.purge_sessions(now).await {
                tracing::warn!(error = %e, "could not purge sessions");
            }
            if let Err(e) = state.db.purge_stats(now - KEEP_MS).await {
                tracing::warn!(error = %e, "could not purge old statistics");
            }
            let orphans = now - orphan_window_ms(&state.config.get());
            if let Err(e) = state.db.purge_orphan_deliveries(orphans).await {
                tracing::warn!(error = %e, "could not purge deliveries no step took");
            }
            forget_idle_groups(&state).await;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(60)) => {}
            () = state.shutdown.cancelled() => break,
        }
        minutes += 1;
        state.web.bulk_limiter.retain_recent();
    }
}

/// Drops the counters of groups that have no work left, a batch at a
/// time until none is left, one fails, or 100 batches went (busy groups'
/// keys add up to nothing again and again: the rest waits an hour).
async fn forget_idle_groups(state: &AppState) {
    const BATCH: u32 = 1000;
    for _ in 0..100 {
        match state.db.forget_idle_groups(BATCH).await {
            Ok(n) if n > 0 => {}
            Ok(_) => break,
            Err(e) => {
                tracing::warn!(error = %e, "could not forget idle groups' counters");
                break;
            }
        }
    }
}

/// How long a delivery no step took is kept for a step that commits its
/// job id later (after a lookup, an operator's "it took effect"): as long
/// as any callback step waits for its delivery (the longest `deadline`),
/// and no less than the longest signature tolerance or an hour.
fn orphan_window_ms(config: &crate::config::Config) -> i64 {
    let deadlines = config
        .pipelines
        .values()
        .flat_map(|p| p.steps.iter())
        .filter_map(|s| s.callback.as_ref().map(|c| c.deadline.0));
    let tolerances = config.providers.values().map(|p| p.webhook_tolerance.0);
    let longest = deadlines
        .chain(tolerances)
        .max()
        .unwrap_or_default()
        .max(Duration::from_secs(3600));
    i64::try_from(longest.as_millis()).unwrap_or(i64::MAX)
}

/// Where the generated session signing key is kept (table `meta`).
pub const SESSION_SECRET_KEY: &str = "session_secret";

/// A fresh signing key: 256 bits from the OS's CSPRNG, as hex.
pub fn new_session_secret() -> Result<String, crate::auth::secret::RandomError> {
    crate::auth::secret::hex::<32>()
}

/// Builds the shared web context: the signing secret from the configuration
/// or the database, and the dummy hash for unknown users; the sign-on
/// provider's discovery is begun (a provider down now is tried again at
/// the first sign-in, and said in the log).
pub async fn context(
    config: &crate::config::Config,
    db: &crate::store::Db,
    clock: Arc<dyn crate::domain::Clock>,
) -> anyhow::Result<Arc<WebContext>> {
    let secret = match &config.server.secret_key {
        Some(key) => key.expose().as_bytes().to_vec(),
        None => {
            let fresh = new_session_secret()?;
            db.ensure_meta(SESSION_SECRET_KEY, &fresh)
                .await?
                .into_bytes()
        }
    };
    let dummy = crate::auth::password::hash_blocking(crate::auth::secret::hex::<16>()?)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let keys = AuthKeys::new(&secret, &config.server, dummy).map_err(|e| anyhow::anyhow!("{e}"))?;
    let web =
        Arc::new(WebContext::new(keys, &config.server.limits, clock).map_err(anyhow::Error::msg)?);
    if let Some(oidc) = config.oidc.clone() {
        let web = web.clone();
        tokio::spawn(async move {
            match web.sign_on.metadata(&oidc).await {
                Ok(_) => tracing::info!(issuer = %oidc.issuer, "sign-on provider discovered"),
                Err(e) => {
                    tracing::warn!(error = %e, issuer = %oidc.issuer, "sign-on provider not discovered yet; tried again at the first sign-in")
                }
            }
        });
    }
    Ok(web)
}
