//! `kind = "request"` (the default): one call; its reply is the result.

use std::sync::Arc;

use super::Registered;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::kind::Kind;
use crate::pipeline::{StepTemplates, invalid};

pub(super) const REGISTERED: Registered = Registered {
    label: "request",
    compile,
};

/// A step whose one call's reply is its result: every answer of
/// [`Kind`] is the default one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request;

impl Kind for Request {
    fn name(&self) -> &'static str {
        "request"
    }
}

/// A `request` step takes no job settings: given any, it says which kind
/// the author meant.
fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    if s.poll.is_some() || s.callback.is_some() || s.job_id.is_some() {
        return Err(invalid(
            t.key("kind"),
            "a `request` step has no `job_id`, `poll` or `callback`; use \
             `submit_poll` or `callback`"
                .into(),
        ));
    }
    Ok(Arc::new(Request))
}
