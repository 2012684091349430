//! `[pipelines.NAME]`: the steps a record goes through, as an operator
//! writes them. `crate::pipeline` compiles and checks them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::HumanDuration;
use crate::domain::ReversalPolicy;

/// One pipeline as configured.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    #[serde(default)]
    pub description: Option<String>,
    /// At most this many records of one group (those enqueued with the
    /// same `group`; those without one form one group) leased at once,
    /// across every node: the "concurrency key" of other workflow engines.
    /// Unset: groups share the workers fairly, uncapped. Read from the
    /// current configuration, never from a record's pinned definition, so
    /// it is not part of that definition (nor of its hash): changing it
    /// makes no new pipeline version, and an older binary can still read
    /// the definitions pinned by this one.
    #[serde(default, skip_serializing)]
    pub group_concurrency: Option<u32>,
    /// Records enqueued on a cron schedule. Like `group_concurrency`, read
    /// from the current configuration and not part of the pinned
    /// definition.
    #[serde(default, skip_serializing)]
    pub schedule: Option<ScheduleConfig>,
    /// Finished records (succeeded, failed, cancelled) are deleted this
    /// long after they finished, with their attempts and events (audit
    /// entries stay); parked ones never are. Unset: kept.
    #[serde(default, skip_serializing)]
    pub retain: Option<HumanDuration>,
    /// The excerpts and requests kept with finished records' attempts
    /// are blanked this long after the record finished (no longer than
    /// `retain`). Unset: kept as long as the record.
    #[serde(default, skip_serializing)]
    pub retain_excerpts: Option<HumanDuration>,
    /// `"undo"`: when a required step fails, the undo calls of the steps
    /// that succeeded run (in reverse order of completion) before the
    /// record ends failed. Unset, a failure only fails the record. Not
    /// written into a pinned definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_failure: Option<OnFailure>,
    /// Sensitive fields of its records (`/input/ssn`,
    /// `/steps/kyc/output/url`; `domain::mask`): masked for callers
    /// without `unmask`, in what attempts keep, and left out of search.
    /// Read from the current configuration, not part of the pinned
    /// definition.
    #[serde(default, skip_serializing)]
    pub sensitive: Vec<super::sensitive::SensitiveField>,
    pub steps: Vec<StepConfig>,
}

/// What a pipeline does when a required step fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// The record fails; nothing is undone (an operator may still undo).
    Stop,
    /// The succeeded steps' undo calls run first.
    Undo,
}

/// `undo = { provider = "pay", request = { method = "POST", path = "/refunds", body = '…{{ output.charge }}…' } }`:
/// the call that undoes a step's effect, its templates seeing the step's
/// own output as `output`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UndoConfig {
    /// The provider it calls; unset, the step's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    pub request: RequestConfig,
}

/// `schedule = { cron = "0 */6 * * *", input = { … }, missed = "skip",
/// priority = 7 }`:
/// a record with `input` at every tick of `cron` (UTC), fired once across
/// every node and keyed by its tick.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    pub cron: String,
    #[serde(default = "empty_object")]
    pub input: serde_json::Value,
    /// Ticks missed while no node ran: the latest fires once (default), or
    /// none does.
    #[serde(default)]
    pub missed: crate::domain::schedule::Missed,
    /// Each record's priority, 0 to 9 (unset: 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

/// How a step talks to its provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// One call; its reply is the result.
    Request,
    /// Submit a job, keep its id, poll until it ends.
    SubmitPoll,
    /// Submit a job, wait for a signed webhook naming it.
    Callback,
    /// Wait, calling nothing: a durable timer.
    Sleep,
    /// Wait for an operator to approve or reject.
    Approval,
    /// Wait for a caller's signal through the API.
    Signal,
    /// Start a record of another pipeline and wait for it.
    Pipeline,
}

/// What a step that waits for a person or a signal does when its
/// `timeout` passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Park the record for a human (the step can still be decided).
    #[default]
    Park,
    /// Fail the step (a required one fails its record).
    Fail,
    /// Succeed with `timeout_output`, and go on.
    Continue,
}

/// `[[pipelines.NAME.steps]]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StepConfig {
    pub name: String,
    /// The provider a calling kind calls; absent for a kind that calls
    /// none (its kind's module says which).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider: String,
    #[serde(default = "defaults::kind")]
    pub kind: StepKind,
    /// Steps that must succeed first; independent steps run in parallel.
    #[serde(default)]
    pub needs: Vec<String>,
    /// A join after branches: the step runs once any of these succeeded
    /// and the rest ended (skipped or failed), besides everything in
    /// `needs`; none succeeding skips it. Not written into a pinned
    /// definition when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs_any: Vec<String>,
    /// An expression over `input`, `record` and the outputs of the steps
    /// upstream (`when = "steps.kyc.output.verdict == 'review'"`): false,
    /// and the step is skipped with what it read kept. Not written into a
    /// pinned definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<String>,
    /// A failed optional step is recorded and the record goes on.
    #[serde(default = "defaults::yes")]
    pub required: bool,
    /// The call of a calling kind; absent for a kind that calls none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestConfig>,
    /// JSON pointer to the provider's job id in the submit reply.
    #[serde(default)]
    pub job_id: Option<String>,
    #[serde(default)]
    pub poll: Option<PollConfig>,
    #[serde(default)]
    pub callback: Option<CallbackConfig>,
    /// `kind = "sleep"`: how long the step sleeps (`for = "24h"`).
    #[serde(default, rename = "for", skip_serializing_if = "Option::is_none")]
    pub sleep_for: Option<HumanDuration>,
    /// `kind = "sleep"`: until when, a template giving a UTC time
    /// (`until = "{{ input.ship_at }}"`), instead of `for`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// A calling kind: each call's timeout, over its provider's (a slow
    /// generation beside a fast status check). `kind = "approval"` or
    /// `"signal"`: how long the step waits (none: as long as it takes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<HumanDuration>,
    /// A calling kind: its own retries, each setting given over its
    /// provider's (`retry = { max_attempts = 3, deadline = "2h" }`); the
    /// retry budget stays the provider's. Not written into a pinned
    /// definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<StepRetryConfig>,
    /// What its `timeout` does (park when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
    /// With `on_timeout = "continue"`: the step's output then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_output: Option<serde_json::Value>,
    /// A calling kind: the call that undoes its effect (a refund for a
    /// charge), made by an undo (`on_failure = "undo"`, or an operator's).
    /// Not written into a pinned definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<UndoConfig>,
    /// `kind = "pipeline"`: the pipeline its child record runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    /// `kind = "pipeline"`: a template giving the child's input as JSON
    /// (`input = '{"doc": {{ steps.upload.output.url | tojson }}}'`);
    /// unset, the child gets the parent's input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// `kind = "pipeline"`: the child record's priority, 0 to 9; unset,
    /// the parent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Output name → JSON pointer into the final reply.
    #[serde(default)]
    pub outputs: BTreeMap<String, String>,
    #[serde(default = "defaults::on_reversal")]
    pub on_reversal: ReversalPolicy,
    /// Ask the provider again after the step succeeded: `times` requests,
    /// `after` apart (the first `after` the success); a reply that no
    /// longer says success is a reversal (`on_reversal`). A job step asks
    /// with its poll request unless `path` is given; a `request` step needs
    /// `path` (a template that also sees `output`, the step's own output).
    /// Not written into a pinned definition when unset, so definitions
    /// without it keep their hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirm: Option<ConfirmConfig>,
    /// For a job step of an `at_most_once` provider: how to ask whether a
    /// submit whose outcome is not known took effect (found: the step
    /// follows that job; a 2xx without it: the submit is sent again).
    /// Not written into a pinned definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup: Option<LookupConfig>,
    /// Overrides the provider's `at_most_once` for this step's calls (a
    /// payment step on a provider whose other calls may be resent). Not
    /// written into a pinned definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_most_once: Option<bool>,
    /// A step for each item: a JSON pointer to a list in what the step's
    /// templates see (`"/input/chunks"`, `"/steps/split/output/parts"`);
    /// the step runs once per item, its templates seeing `item` and
    /// `item_index`, its output the items' outputs in item order. Not
    /// written into a pinned definition when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<String>,
    /// With `for_each`: the most items of one record unfinished at once
    /// (10 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallel: Option<u32>,
    /// With `for_each`: how many items must succeed, `"all"` (the
    /// default) or a count; the rest may fail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items_required: Option<ItemsRequired>,
}

impl StepConfig {
    /// With `for_each`: how many items of one record run at once (its
    /// `max_parallel`, or the default).
    pub fn items_at_once(&self) -> u32 {
        self.max_parallel
            .unwrap_or(crate::domain::each::DEFAULT_PARALLEL)
    }
}

/// A for-each step's `items_required`: `"all"` or a count.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum ItemsRequired {
    Count(u32),
    Word(String),
}

/// A step's `retry`: the settings it gives replace its provider's.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StepRetryConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<HumanDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<HumanDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<HumanDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_attempts: Option<u32>,
}

impl StepRetryConfig {
    /// The provider's retries with this step's settings in their place.
    pub fn over(&self, provider: &super::provider::RetryConfig) -> super::provider::RetryConfig {
        super::provider::RetryConfig {
            max_attempts: self.max_attempts.unwrap_or(provider.max_attempts),
            base: self.base.unwrap_or(provider.base),
            cap: self.cap.unwrap_or(provider.cap),
            deadline: self.deadline.unwrap_or(provider.deadline),
            unknown_attempts: self.unknown_attempts.unwrap_or(provider.unknown_attempts),
            ..provider.clone()
        }
    }
}

/// `lookup = { path = "/v1/jobs?client_reference={{ key }}", job_id = "/data/0/id" }`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LookupConfig {
    #[serde(default = "defaults::get")]
    pub method: String,
    pub path: String,
    /// JSON pointer to the found job's id in the lookup's reply.
    pub job_id: String,
}

/// `confirm = { after = "30s", times = 2 }`, and for a synchronous step
/// `path = "/v1/charges/{{ output.id }}"` (`method` defaults to `GET`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfirmConfig {
    pub after: HumanDuration,
    #[serde(default = "defaults::confirm_times")]
    pub times: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// The call: method, path under the provider's base URL, headers and body,
/// each a template over `input`, `steps.<name>.output`, `record` and
/// `key` (the step's stable key: its idempotency key, one per record, step
/// and generation, for a provider's client-reference field).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RequestConfig {
    #[serde(default = "defaults::post")]
    pub method: String,
    pub path: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub body: Option<String>,
}

/// `poll = { path = "/v1/jobs/{{ job_id }}", every = "2s", deadline = "20m" }`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PollConfig {
    #[serde(default = "defaults::get")]
    pub method: String,
    pub path: String,
    #[serde(default = "defaults::every")]
    pub every: HumanDuration,
    #[serde(default = "defaults::poll_deadline")]
    pub deadline: HumanDuration,
}

/// What to do when a callback has not come by its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CallbackFallback {
    /// Ask the provider with the step's `poll` request.
    Poll,
    /// Park the record for a human.
    Park,
}

/// `callback = { job_id = "/job_id", deadline = "1h", fallback = "park" }`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CallbackConfig {
    /// JSON pointer to the job id in the webhook body.
    pub job_id: String,
    #[serde(default = "defaults::callback_deadline")]
    pub deadline: HumanDuration,
    #[serde(default = "defaults::fallback")]
    pub fallback: CallbackFallback,
}

mod defaults {
    pub fn confirm_times() -> u32 {
        1
    }

    use super::*;
    use std::time::Duration;

    pub fn kind() -> StepKind {
        StepKind::Request
    }
    pub fn yes() -> bool {
        true
    }
    pub fn on_reversal() -> ReversalPolicy {
        ReversalPolicy::Park
    }
    pub fn post() -> String {
        "POST".into()
    }
    pub fn get() -> String {
        "GET".into()
    }
    pub fn every() -> HumanDuration {
        HumanDuration(Duration::from_secs(2))
    }
    pub fn poll_deadline() -> HumanDuration {
        HumanDuration(Duration::from_secs(20 * 60))
    }
    pub fn callback_deadline() -> HumanDuration {
        HumanDuration(Duration::from_secs(3600))
    }
    pub fn fallback() -> CallbackFallback {
        CallbackFallback::Park
    }
}
