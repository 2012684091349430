//! Pipelines as the engine runs them: compiled, checked steps, each with
//! its kind (`super::kind::Kind`) and the shapes kinds share (requests,
//! polls, callbacks). `crate::pipeline` compiles them from configuration;
//! nothing after compilation falls back to a default.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::ReversalPolicy;
use super::kind::Kind;

/// A compiled request: templates by name in `pipeline::Templates`.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub method: HttpMethod,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<String>,
}

/// The HTTP methods a step may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpMethod {
    Get,
    Post,
    Put,
    Patch,
    Delete,
}

impl HttpMethod {
    pub fn parse(s: &str) -> Option<HttpMethod> {
        Some(match s.to_ascii_uppercase().as_str() {
            "GET" => HttpMethod::Get,
            "POST" => HttpMethod::Post,
            "PUT" => HttpMethod::Put,
            "PATCH" => HttpMethod::Patch,
            "DELETE" => HttpMethod::Delete,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            HttpMethod::Get => "GET",
            HttpMethod::Post => "POST",
            HttpMethod::Put => "PUT",
            HttpMethod::Patch => "PATCH",
            HttpMethod::Delete => "DELETE",
        }
    }
}

/// How often and for how long a submitted job is polled.
#[derive(Debug, Clone)]
pub struct PollSpec {
    pub request: RequestSpec,
    pub every: Duration,
    pub deadline: Duration,
}

/// What a callback step does when no delivery has come by its deadline.
#[derive(Debug, Clone)]
pub enum Fallback {
    /// Park the record for a human.
    Park,
    /// Ask the provider with this poll request, for the poll's deadline.
    Poll(PollSpec),
}

/// How a callback step waits for its webhook.
#[derive(Debug, Clone)]
pub struct CallbackSpec {
    /// JSON pointer to the job id in a delivery's body.
    pub delivery_job_id: String,
    /// How long after the submit a delivery is waited for.
    pub deadline: Duration,
    pub fallback: Fallback,
}

/// One step, compiled.
#[derive(Debug, Clone)]
pub struct Step {
    pub name: String,
    pub provider: String,
    /// What its kind adds (`crate::pipeline::kinds`, one module each).
    pub kind: Arc<dyn Kind>,
    pub needs: Vec<String>,
    /// A join: any one of these must succeed (and the rest end).
    pub needs_any: Vec<String>,
    /// Whether the step runs at all, judged when it is first ready.
    pub when: Option<Condition>,
    /// Every step this one depends on, directly or not.
    pub upstream: BTreeSet<String>,
    pub required: bool,
    /// The step's call (`None` for a kind that calls no provider, whose
    /// `provider` is empty).
    pub request: Option<RequestSpec>,
    pub outputs: BTreeMap<String, String>,
    pub on_reversal: ReversalPolicy,
    /// Requests after success that must still say success.
    pub confirm: Option<Confirm>,
    /// The request a confirmation makes, when not the job's poll (a
    /// synchronous step's, over `output` as well).
    pub confirm_request: Option<RequestSpec>,
    /// How to ask the provider whether a call whose outcome is not known
    /// took effect (`at_most_once`; job steps only).
    pub lookup: Option<Lookup>,
    /// The step's own `at_most_once`, over its provider's when set.
    pub at_most_once: Option<bool>,
    /// Its calls' timeout, over its provider's when set (calling kinds).
    pub timeout: Option<Duration>,
    /// Its retry settings, over its provider's.
    pub retry: super::step::RetryOverride,
    /// For an undo step (`Pipeline::undo`): the step whose effect it
    /// undoes, whose output its templates see as `output`.
    pub undoes: Option<String>,
    /// `for_each`: the step runs once per item of a list
    /// (`super::each`).
    pub each: Option<super::each::Each>,
}

/// A step as the pages draw it: what it needs, its join and its
/// condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub name: String,
    pub needs: Vec<String>,
    pub needs_any: Vec<String>,
    pub when: Option<String>,
    /// Its kind's name.
    pub kind: String,
    /// A step for each item: how many items of a record run at once.
    pub each: Option<u32>,
    /// It starts child records (each run's job id is its child's id).
    pub children: bool,
}

impl From<&Step> for Shape {
    fn from(s: &Step) -> Self {
        Shape {
            name: s.name.clone(),
            needs: s.needs.clone(),
            needs_any: s.needs_any.clone(),
            when: s.when.as_ref().map(|c| c.source.clone()),
            kind: s.kind.name().to_owned(),
            each: s.each.as_ref().map(|e| e.max_parallel),
            children: s.kind.child().is_some(),
        }
    }
}

/// A step's `when`: its source, and its id among the loaded conditions
/// (`pipeline::Templates::judge`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub id: String,
    pub source: String,
}

/// `lookup = { path = "/v1/jobs?client_reference={{ key }}", job_id = "/data/0/id" }`:
/// a request that finds the job a submit made, if it made one.
#[derive(Debug, Clone)]
pub struct Lookup {
    pub request: RequestSpec,
    /// JSON pointer to the found job's id in the lookup's reply; absent in
    /// a 2xx reply means the call did not take effect.
    pub job_id: String,
}

/// `confirm`: `times` polls after a success, `after` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confirm {
    pub after: Duration,
    pub times: u32,
}

impl Step {
    /// Whether this step's side-effecting calls are written down before
    /// they leave and never resent blindly, given its provider's setting.
    pub fn at_most_once(&self, provider: bool) -> bool {
        self.at_most_once.unwrap_or(provider)
    }

    /// How long each of its calls may take, given its provider's timeout.
    pub fn call_timeout(&self, provider: Duration) -> Duration {
        self.timeout.unwrap_or(provider)
    }

    /// Its retries, given its provider's.
    pub fn retry_policy(&self, provider: super::step::RetryPolicy) -> super::step::RetryPolicy {
        self.retry.over(provider)
    }

    /// JSON pointer to the job id in the submit reply (job steps only).
    pub fn job_pointer(&self) -> Option<&str> {
        self.kind.job_pointer()
    }

    /// The request a confirmation makes: its own, or the job's poll.
    pub fn confirm_request(&self) -> Option<&RequestSpec> {
        self.confirm_request
            .as_ref()
            .or_else(|| self.poll().map(|p| &p.request))
    }

    /// The request that asks about a submitted job, if the step ever polls.
    pub fn poll(&self) -> Option<&PollSpec> {
        self.kind.poll()
    }

    /// How the step waits for webhooks (callback steps only).
    pub fn callback(&self) -> Option<&CallbackSpec> {
        self.kind.callback()
    }
}

/// One pipeline, compiled.
#[derive(Debug, Clone)]
pub struct Pipeline {
    pub name: String,
    /// Steps in an order where every step comes after the steps it needs.
    pub steps: Vec<Step>,
    /// The undo calls of the steps that declare one (`undo:NAME`, each
    /// a `request` step), run only by an undo (`domain::undo`).
    pub undo: Vec<Step>,
    /// A required step's failure runs the undo first (`on_failure`).
    pub undo_on_failure: bool,
    /// The definition as JSON, pinned by records that start with it.
    pub definition: Value,
    /// SHA-256 of `definition`, hex.
    pub hash: String,
}

impl Pipeline {
    pub fn step(&self, name: &str) -> Option<&Step> {
        self.steps.iter().find(|s| s.name == name)
    }

    /// `name` and every step downstream of it, in pipeline order: what a
    /// replay from `name` re-runs.
    pub fn from_step(&self, name: &str) -> Option<Vec<String>> {
        self.step(name)?;
        Some(
            self.steps
                .iter()
                .filter(|s| s.name == name || s.upstream.contains(name))
                .map(|s| s.name.clone())
                .collect(),
        )
    }
}
