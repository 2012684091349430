//! `kind = "request"` (the default): one call; its reply is the result.

use std::sync::Arc;

use super::Registered;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::kind::Kind;
use crate::pipeline::StepTemplates;

/// The kind an undo call's step has (`pipeline::compile_undo`).
pub const KIND: crate::config::pipeline::StepKind = crate::config::pipeline::StepKind::Request;

pub(super) const REGISTERED: Registered = Registered {
    name: "request",
    fields: super::CALLS,
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

    fn for_each(&self) -> bool {
        true
    }
}

/// A `request` step reads nothing of its own (another kind's settings
/// are refused before this).
fn compile(_: &StepConfig, _: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    Ok(Arc::new(Request))
}
