//! What the control plane says of notifications out (`[[notify]]`), for
//! the notifications page and `/api/v1/notifications` alike: each
//! subscription with its state, and the notices (deliveries) a caller may
//! see: those of records of its pipelines; provider notices to those who
//! see every pipeline.

use serde::Serialize;

use crate::domain::UnixMs;
use crate::store::{Notice, NoticeFilter, Page};
use crate::web::AppState;
use crate::web::auth::Caller;
use crate::web::error::{WebError, WebResult};

/// One subscription as configured, with its shared state.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SubscriptionStatus {
    pub name: String,
    /// The provider its deliveries go to (and are governed by), and the
    /// path under its base URL.
    pub provider: String,
    pub path: String,
    /// `standard_webhooks` or `slack`.
    pub format: &'static str,
    pub events: Vec<String>,
    pub pipelines: Vec<String>,
    pub groups: Vec<String>,
    pub providers: Vec<String>,
    /// False once turned off (after failing for `disable_after`, or by an
    /// admin): nothing is sent until it is turned on again.
    pub on: bool,
    pub failing_since: Option<UnixMs>,
    pub disabled_at: Option<UnixMs>,
    pub disabled_reason: Option<String>,
}

/// Every configured subscription with its state, as the caller may see
/// them: a caller limited to pipelines sees those limited to one of its
/// pipelines.
pub async fn subscriptions(
    state: &AppState,
    caller: &Caller,
) -> WebResult<Vec<SubscriptionStatus>> {
    let config = state.config.get();
    let states = state.db.subscription_states().await?;
    Ok(config
        .notify
        .iter()
        .filter(|n| caller.sees_all() || n.pipelines.iter().any(|p| caller.sees(p)))
        .map(|n| {
            let s = states.iter().find(|s| s.name == n.name);
            SubscriptionStatus {
                name: n.name.clone(),
                provider: n.provider.clone(),
                path: n.path.clone(),
                format: match n.format {
                    crate::config::notify::Format::StandardWebhooks => "standard_webhooks",
                    crate::config::notify::Format::Slack => "slack",
                },
                events: n.events.clone(),
                // A caller limited to pipelines is not told of others.
                pipelines: n
                    .pipelines
                    .iter()
                    .filter(|p| caller.sees(p))
                    .cloned()
                    .collect(),
                groups: n.groups.clone(),
                providers: n.providers.clone(),
                on: s.is_none_or(|s| s.disabled_at.is_none()),
                failing_since: s.and_then(|s| s.failing_since),
                disabled_at: s.and_then(|s| s.disabled_at),
                disabled_reason: s.and_then(|s| s.disabled_reason.clone()),
            }
        })
        .collect())
}

/// `f` within what the caller sees: a caller limited to pipelines reads
/// the notices of their records only.
pub async fn list(
    state: &AppState,
    caller: &Caller,
    mut f: NoticeFilter,
) -> WebResult<Page<Notice>> {
    f.pipelines = crate::web::scope::visible(state, caller).await?;
    Ok(state.db.notices(&f).await?)
}

/// Notice `id`, when the caller sees it; else not found, the same either
/// way.
pub async fn one(state: &AppState, caller: &Caller, id: i64) -> WebResult<Notice> {
    let f = NoticeFilter {
        id: Some(id),
        limit: 1,
        ..NoticeFilter::default()
    };
    list(state, caller, f)
        .await?
        .items
        .pop()
        .ok_or_else(|| WebError::NotFound(format!("notice {id} not found")))
}

/// Sends notice `id` again, if the caller sees it and its subscription
/// is still configured.
pub async fn redeliver(state: &AppState, caller: &Caller, id: i64) -> WebResult<Notice> {
    let n = one(state, caller, id).await?;
    if !state
        .config
        .get()
        .notify
        .iter()
        .any(|s| s.name == n.subscription)
    {
        return Err(WebError::bad(
            "unknown_subscription",
            format!("subscription `{}` is no longer configured", n.subscription),
        ));
    }
    Ok(state.ops().redeliver_notice(id, &caller.actor).await?)
}

/// Turns subscription `name` on or off.
pub async fn turn(
    state: &AppState,
    caller: &Caller,
    name: &str,
    on: bool,
) -> WebResult<SubscriptionStatus> {
    let all = subscriptions(state, caller).await?;
    if !all.iter().any(|s| s.name == name) {
        return Err(WebError::NotFound(format!("no subscription {name}")));
    }
    state
        .ops()
        .turn_subscription(name, on, &caller.actor)
        .await?;
    subscriptions(state, caller)
        .await?
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| WebError::NotFound(format!("no subscription {name}")))
}
