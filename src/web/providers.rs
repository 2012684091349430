//! What the control plane says of each provider, for the providers page
//! and `GET /api/v1/providers` alike: its shared state (breaker, pause,
//! throttle) from the store, its settings, and this node's live use.

use serde::Serialize;

use crate::domain::UnixMs;
use crate::web::AppState;
use crate::web::auth::Caller;
use crate::web::error::WebResult;

/// One provider as a caller may see it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ProviderStatus {
    pub name: String,
    /// Its base URL, credentials in it redacted.
    pub base_url: String,
    /// `closed`, `open` or `half_open`.
    pub breaker: &'static str,
    pub breaker_since: Option<UnixMs>,
    /// When an open breaker lets a probe through.
    pub open_until: Option<UnixMs>,
    pub paused: bool,
    pub paused_by: Option<String>,
    pub paused_reason: Option<String>,
    /// When the provider's last "slow down" ends, while it holds.
    pub throttled_until: Option<UnixMs>,
    /// Its rate limits as configured (`20/1s`).
    pub rate_limits: Vec<String>,
    pub concurrency: u32,
    /// This node's figures (none on a node without workers).
    pub node: Option<NodeUse>,
}

/// A provider's use on this node.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct NodeUse {
    pub in_flight: usize,
    /// Each limit with the calls it counts now.
    pub limits: Vec<LimitUse>,
    /// The breaker's window: calls, failed, slow.
    pub window_calls: usize,
    pub window_failed: usize,
    pub window_slow: usize,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct LimitUse {
    pub limit: String,
    pub used: usize,
}

/// Every provider `caller` may see (those its pipelines call, when it is
/// limited to pipelines), by name.
pub async fn statuses(state: &AppState, caller: &Caller) -> WebResult<Vec<ProviderStatus>> {
    let shared = state.db.provider_states().await?;
    let now = state.clock.now_ms();
    let config = state.config.get();
    let shown = crate::web::scope::providers(&config, caller);
    let statuses = config
        .providers
        .iter()
        .filter(|(name, _)| shown.as_ref().is_none_or(|s| s.contains(*name)))
        .map(|(name, cfg)| {
            let ps = shared.iter().find(|p| &p.provider == name);
            let live = state.engine.as_ref().and_then(|e| e.provider_live(name));
            ProviderStatus {
                name: name.clone(),
                base_url: crate::domain::request::redact_url(&cfg.base_url),
                breaker: ps.map_or("closed", |p| p.breaker.as_str()),
                breaker_since: ps.map(|p| p.breaker_changed_at),
                open_until: ps.and_then(|p| p.open_until),
                paused: ps.is_some_and(|p| p.paused),
                paused_by: ps.and_then(|p| p.paused_by.clone()),
                paused_reason: ps.and_then(|p| p.paused_reason.clone()),
                throttled_until: ps.and_then(|p| p.throttled_until).filter(|u| *u > now),
                rate_limits: cfg.rate_limits.iter().map(|l| format!("{l:?}")).collect(),
                concurrency: cfg.concurrency,
                node: live.map(|l| NodeUse {
                    in_flight: l.in_flight,
                    limits: l
                        .limits
                        .iter()
                        .map(|(limit, used, _)| LimitUse {
                            limit: limit.clone(),
                            used: *used,
                        })
                        .collect(),
                    window_calls: l.window_calls,
                    window_failed: l.window_failed,
                    window_slow: l.window_slow,
                }),
            }
        })
        .collect();
    Ok(statuses)
}
