//! Step kinds, one module each: what a kind accepts in its settings, its
//! compiled form, and its answers to `domain::kind::Kind` (the decisions
//! particular to it). A new kind is a new module here and one line in
//! [`registered`] (with its name in `config::pipeline::StepKind`).

mod approval;
mod callback;
mod child;
mod person;
mod request;
mod signal;
mod sleep;
mod submit_poll;

use std::sync::Arc;

pub use callback::Callback;
pub use request::{KIND as REQUEST, Request};
pub use sleep::{Sleep, Wake};
pub use submit_poll::SubmitPoll;

use super::{PollSpec, StepTemplates, invalid};
use crate::config::ConfigError;
use crate::config::pipeline::{StepConfig, StepKind as KindConfig};
use crate::config::provider::check_pointer;
use crate::domain::kind::Kind;

/// Checks a step's settings for a kind and compiles them.
type Compile = fn(&StepConfig, &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError>;

/// A kind as the rest of the house reaches it.
#[derive(Clone, Copy)]
pub struct Registered {
    /// Its name as configured (`kind = "..."`).
    pub name: &'static str,
    /// How the pages name it.
    pub label: &'static str,
    /// The step settings particular to it (beside [`COMMON`]); another
    /// kind's are refused.
    fields: &'static [&'static str],
    compile: Compile,
}

/// The step settings every kind reads; the rest belong to the kinds that
/// list them.
const COMMON: &[&str] = &[
    "name",
    "provider",
    "kind",
    "needs",
    "needs_any",
    "when",
    "required",
    "request",
    "outputs",
    "on_reversal",
    "confirm",
    "lookup",
    "at_most_once",
    "for_each",
    "max_parallel",
    "items_required",
];

/// The settings of a kind that calls a provider: its calls' own timeout
/// and retries, and the call that undoes it.
const CALLS: &[&str] = &["timeout", "retry", "undo"];

/// Every kind, by its configured name: one line each.
pub fn registered(kind: KindConfig) -> Registered {
    match kind {
        KindConfig::Request => request::REGISTERED,
        KindConfig::SubmitPoll => submit_poll::REGISTERED,
        KindConfig::Callback => callback::REGISTERED,
        KindConfig::Sleep => sleep::REGISTERED,
        KindConfig::Approval => approval::REGISTERED,
        KindConfig::Signal => signal::REGISTERED,
        KindConfig::Pipeline => child::REGISTERED,
    }
}

/// The step's kind with what it needs, refusing what it lacks or would
/// ignore.
pub(super) fn compile(
    s: &StepConfig,
    t: &mut StepTemplates<'_>,
) -> Result<Arc<dyn Kind>, ConfigError> {
    let kind = registered(s.kind);
    if let Some(field) = foreign(s, kind.fields) {
        return Err(invalid(
            t.key(&field),
            format!(
                "a `{}` step takes no `{field}` (another kind's setting)",
                kind.name
            ),
        ));
    }
    (kind.compile)(s, t)
}

/// A setting given to `s` that belongs to another kind than its own
/// (`own`): read from the step as it serializes, so a new kind's setting
/// is refused on the others without a word here.
fn foreign(s: &StepConfig, own: &[&str]) -> Option<String> {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(s) else {
        return None;
    };
    fields
        .into_iter()
        .find(|(k, v)| !v.is_null() && !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str()))
        .map(|(k, _)| k)
}

/// A job kind's `job_id`: a JSON pointer into the submit reply.
fn job_id(s: &StepConfig, t: &StepTemplates<'_>, kind: &str) -> Result<String, ConfigError> {
    let j = s.job_id.as_ref().ok_or_else(|| {
        invalid(
            t.key("job_id"),
            format!("a `{kind}` step needs `job_id` (a JSON pointer into the submit reply)"),
        )
    })?;
    check_pointer(j).map_err(|m| invalid(t.key("job_id"), m))?;
    Ok(j.clone())
}

/// The step's `poll`, compiled, when given.
fn poll(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Option<PollSpec>, ConfigError> {
    let Some(pc) = &s.poll else {
        return Ok(None);
    };
    Ok(Some(PollSpec {
        request: t.asking("poll", (&pc.method, &pc.path), true, false)?,
        every: pc.every.0,
        deadline: pc.deadline.0,
    }))
}
