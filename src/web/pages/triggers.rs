//! `/triggers`: each configured trigger (`[triggers.NAME]`) with what it
//! accepts and ignores, and its newest deliveries with their verdicts, for
//! the pipelines the caller sees.

use askama::Template;
use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;

use crate::web::AppState;
use crate::web::auth::{Authed, Viewer};
use crate::web::error::WebResult;
use crate::web::htmx::is_htmx;

use super::{Nav, html, when};

/// Deliveries shown per trigger.
const SHOWN: u32 = 20;

pub fn router() -> Router<AppState> {
    Router::new().route("/triggers", get(list))
}

struct DeliveryView {
    at: String,
    verdict: String,
    status: u16,
    refused: bool,
    event_type: String,
    event_id: String,
    record_id: Option<i64>,
    detail: String,
}

struct TriggerView {
    name: String,
    preset: &'static str,
    pipeline: String,
    accept: String,
    ignore: String,
    deliveries: Vec<DeliveryView>,
}

#[derive(Template)]
#[template(path = "pages/triggers.html", blocks = ["list"])]
struct TriggersPage {
    nav: Nav,
    /// Whether any trigger is configured (some may be of pipelines the
    /// caller does not see).
    configured: bool,
    triggers: Vec<TriggerView>,
}

async fn list(
    caller: Authed<Viewer>,
    State(state): State<AppState>,
    headers: HeaderMap,
) -> WebResult<Response> {
    let config = state.config.get();
    let mut triggers = Vec::new();
    for (name, t) in &config.triggers {
        if !caller.sees(&t.pipeline) {
            continue;
        }
        let kept = state.db.trigger_deliveries(Some(name), SHOWN).await?;
        triggers.push(TriggerView {
            name: name.clone(),
            preset: t.preset.as_str(),
            pipeline: t.pipeline.clone(),
            accept: if t.accept.is_empty() {
                "every type not ignored".into()
            } else {
                t.accept.join(", ")
            },
            ignore: t.ignore.join(", "),
            // A trigger pointed at another pipeline since keeps its
            // earlier deliveries for their own pipeline's viewers.
            deliveries: kept
                .into_iter()
                .filter(|d| caller.sees(&d.pipeline))
                .map(|d| DeliveryView {
                    at: when(d.received_at),
                    refused: d.status >= 400,
                    verdict: d.verdict,
                    status: d.status,
                    event_type: d.event_type.unwrap_or_default(),
                    event_id: d.event_id.unwrap_or_default(),
                    record_id: d.record_id,
                    detail: d.detail.unwrap_or_default(),
                })
                .collect(),
        });
    }
    let t = TriggersPage {
        nav: Nav::new(&caller, "triggers"),
        configured: !config.triggers.is_empty(),
        triggers,
    };
    if is_htmx(&headers) {
        return html(&t.as_list());
    }
    html(&t)
}
