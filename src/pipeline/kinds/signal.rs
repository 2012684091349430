//! `kind = "signal"`: the record waits, holding no worker, until a caller
//! signals the step (`POST /api/v1/records/{id}/signals/{step}`); the
//! signal's JSON body is the step's output. A signal id
//! (`Idempotency-Key`) makes a resent signal change nothing. With
//! `timeout`, it parks, fails or goes on (`on_timeout`) when no signal
//! came in time. The wait itself is `person::Wait`, shared with
//! `approval`.

use std::sync::Arc;

use super::Registered;
use super::person;
use crate::config::ConfigError;
use crate::config::pipeline::StepConfig;
use crate::domain::awaiting::Awaits;
use crate::domain::kind::Kind;
use crate::pipeline::StepTemplates;

pub(super) const REGISTERED: Registered = Registered {
    name: "signal",
    fields: person::FIELDS,
    label: "signal",
    compile,
};

fn compile(s: &StepConfig, t: &mut StepTemplates<'_>) -> Result<Arc<dyn Kind>, ConfigError> {
    let wait = person::compile(s, t, Awaits::Signal, person::timed_out_output(None))?;
    Ok(Arc::new(wait))
}
