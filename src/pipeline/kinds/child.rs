//! `kind = "pipeline"`: the step starts one record of another pipeline
//! (`pipeline = "NAME"`, its input from the `input` template, else the
//! parent's; for each item, else the item; at `priority`, else the
//! parent's), keyed from the parent so that a retry never starts a second,
//! and waits for it holding no worker. The child's succeeded steps'
//! outputs, by step name, are the step's output. The engine's side (the
//! child enqueued, read, and its parent woken) is `engine::child`; the
//! decisions are `domain::child`.

use std::sync::Arc;

use super::Registered;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::child::ChildSpec;
use crate::domain::kind::{Confirms, Kind, Made};
use crate::pipeline::{StepTemplates, invalid};

pub(super) const REGISTERED: Registered = Registered {
    name: "pipeline",
    fields: &["pipeline", "input", "priority"],
    label: "child pipeline",
    compile,
};

/// A step that runs a child record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Child(pub ChildSpec);

impl Kind for Child {
    fn name(&self) -> &'static str {
        "pipeline"
    }

    fn calls(&self) -> bool {
        false
    }

    fn child(&self) -> Option<&ChildSpec> {
        Some(&self.0)
    }

    fn made(&self) -> Made {
        Made::Neither("runs a child record: act on the child, and its parent follows")
    }

    fn confirms(&self) -> Confirms {
        Confirms::Never("a child record's result is not asked again")
    }

    /// One child record per item (its input the item, unless `input`
    /// says otherwise).
    fn for_each(&self) -> bool {
        true
    }
}

/// `pipeline`, named; `input`, a template, when given. Whether the
/// pipeline exists, and the depth and cycles of children, are checked
/// over the whole configuration (`pipeline::check_children`).
fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let Some(pipeline) = s.pipeline.clone().filter(|p| !p.is_empty()) else {
        return Err(invalid(
            t.key("pipeline"),
            "a `pipeline` step needs `pipeline`, the pipeline its child record runs".into(),
        ));
    };
    let input = match &s.input {
        Some(source) => Some(t.add("input", source, false, false)?),
        None => None,
    };
    crate::domain::check_priority(s.priority).map_err(|m| invalid(t.key("priority"), m))?;
    Ok(Arc::new(Child(ChildSpec {
        pipeline,
        input,
        priority: s.priority,
    })))
}
