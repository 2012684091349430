//! `kind = "approval"`: the record waits, holding no worker, until an
//! operator approves or rejects it (on its page or through the API, a
//! comment required, audited). The decision is the step's output
//! (`{"decision": "approved" | "rejected", "comment", "by", "at"}`), which
//! later steps' conditions can branch on. With `timeout`, it parks, fails
//! or goes on (`on_timeout`) when no one decided in time. The wait itself
//! is `person::Wait`, shared with `signal`.

use std::sync::Arc;

use super::Registered;
use super::person;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::awaiting::Awaits;
use crate::domain::kind::Kind;
use crate::pipeline::StepTemplates;

pub(super) const REGISTERED: Registered = Registered {
    name: "approval",
    fields: person::FIELDS,
    label: "approval",
    compile,
};

fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let wait = person::compile(
        s,
        t,
        Awaits::Approval,
        person::timed_out_output(Some(("decision", "timed_out"))),
    )?;
    Ok(Arc::new(wait))
}
