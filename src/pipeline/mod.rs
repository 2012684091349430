//! Pipelines compiled from configuration: steps in dependency order, their
//! upstream sets, and their request templates, all checked at load so that
//! `ballast check-config` catches what would otherwise fail at 3 a.m.

mod each;
pub mod kinds;
pub mod template;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::pipeline::{PipelineConfig, StepConfig};
use crate::config::provider::check_pointer;
use crate::config::{Config, ConfigError};

use crate::domain::kind::{Confirms, Kind};
pub use crate::domain::pipeline::{
    CallbackSpec, Condition, Fallback, HttpMethod, Pipeline, PollSpec, RequestSpec, Step,
};
pub use template::{Judged, PassContext, Quoting, TemplateError, Templates};

/// Every pipeline of a configuration, with their templates.
#[derive(Debug, Clone)]
pub struct Pipelines {
    pub pipelines: BTreeMap<String, Arc<Pipeline>>,
    pub templates: Arc<Templates>,
}

fn step_key(pipeline: &str, step: &str, field: &str) -> String {
    format!("pipelines.{pipeline}.steps[{step}].{field}")
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Compiles a pinned definition (as stored when a record started) with its
/// own templates, so records finish on the pipeline they began with.
pub fn compile_pinned(
    name: &str,
    definition: &Value,
    config: &Config,
) -> Result<(Arc<Pipeline>, Arc<Templates>), ConfigError> {
    let p: PipelineConfig =
        serde_json::from_value(definition.clone()).map_err(|e| ConfigError::Invalid {
            key: format!("pipelines.{name}"),
            message: format!("pinned definition unreadable: {e}"),
        })?;
    let mut templates = Templates::new();
    let pipeline = compile_one(name, &p, config, &mut templates)?;
    Ok((Arc::new(pipeline), Arc::new(templates)))
}

/// Compiles and checks every pipeline against the configured providers.
pub fn compile(config: &Config) -> Result<Pipelines, ConfigError> {
    let mut templates = Templates::new();
    let mut pipelines = BTreeMap::new();
    for (name, p) in &config.pipelines {
        let pipeline = compile_one(name, p, config, &mut templates)?;
        // A lookup is only ever made for an `at_most_once` call: one that
        // cannot be made is a mistake (a pinned definition keeps its own,
        // whatever the provider says now).
        for s in &pipeline.steps {
            // A provider's setting spares its `GET`s; a step's own does not.
            let get = s
                .request
                .as_ref()
                .is_some_and(|r| r.method == HttpMethod::Get);
            let guarded = s.at_most_once == Some(true)
                || (!get
                    && config
                        .providers
                        .get(&s.provider)
                        .is_some_and(|pc| s.at_most_once(pc.at_most_once)));
            if s.lookup.is_some() && !guarded {
                return Err(invalid(
                    step_key(name, &s.name, "lookup"),
                    format!(
                        "is only made for `at_most_once` calls: set `at_most_once = true` on \
                         the step or on provider `{}`",
                        s.provider
                    ),
                ));
            }
        }
        pipelines.insert(name.clone(), Arc::new(pipeline));
    }
    check_children(&pipelines)?;
    Ok(Pipelines {
        pipelines,
        templates: Arc::new(templates),
    })
}

/// The most levels of child records below a record (a child's child is
/// two).
pub const MAX_CHILD_DEPTH: usize = 5;

/// Every `pipeline` step names a configured pipeline, and no chain of
/// children runs into a cycle or deeper than [`MAX_CHILD_DEPTH`].
fn check_children(pipelines: &BTreeMap<String, Arc<Pipeline>>) -> Result<(), ConfigError> {
    let children = |p: &Pipeline| -> Vec<(String, String)> {
        let steps = p.steps.iter();
        steps
            .filter_map(|s| Some((s.name.clone(), s.kind.child()?.pipeline.clone())))
            .collect()
    };
    for (name, p) in pipelines {
        for (step, child) in children(p) {
            if !pipelines.contains_key(&child) {
                return Err(invalid(
                    step_key(name, &step, "pipeline"),
                    format!("unknown pipeline `{child}`"),
                ));
            }
        }
    }
    // Depth first from each pipeline, along its chain of children.
    fn deepest(
        at: &str,
        pipelines: &BTreeMap<String, Arc<Pipeline>>,
        chain: &mut Vec<String>,
        children: &dyn Fn(&Pipeline) -> Vec<(String, String)>,
    ) -> Result<(), (String, String)> {
        if chain.len() - 1 > MAX_CHILD_DEPTH {
            return Err(("depth".into(), chain.join(" → ")));
        }
        for (_, child) in children(&pipelines[at]) {
            if chain.contains(&child) {
                chain.push(child);
                return Err(("cycle".into(), chain.join(" → ")));
            }
            chain.push(child.clone());
            deepest(&child, pipelines, chain, children)?;
            chain.pop();
        }
        Ok(())
    }
    for (name, p) in pipelines {
        for (step, child) in children(p) {
            let mut chain = vec![name.clone(), child.clone()];
            let found = if &child == name {
                Err(("cycle".to_owned(), chain.join(" → ")))
            } else {
                deepest(&child, pipelines, &mut chain, &children)
            };
            if let Err((what, path)) = found {
                let message = match what.as_str() {
                    "cycle" => format!("child pipelines run in a cycle: {path}"),
                    _ => {
                        format!("child pipelines nest deeper than {MAX_CHILD_DEPTH} levels: {path}")
                    }
                };
                return Err(invalid(step_key(name, &step, "pipeline"), message));
            }
        }
    }
    Ok(())
}

fn invalid(key: String, message: String) -> ConfigError {
    ConfigError::Invalid { key, message }
}

fn compile_one(
    name: &str,
    p: &PipelineConfig,
    config: &Config,
    templates: &mut Templates,
) -> Result<Pipeline, ConfigError> {
    if !valid_name(name) {
        return Err(invalid(
            format!("pipelines.{name}"),
            "pipeline names are 1-64 characters of a-z, 0-9, `_`, `-`".into(),
        ));
    }
    if p.steps.is_empty() {
        return Err(invalid(
            format!("pipelines.{name}.steps"),
            "a pipeline needs at least one step".into(),
        ));
    }
    if p.group_concurrency == Some(0) {
        return Err(invalid(
            format!("pipelines.{name}.group_concurrency"),
            "must be at least 1 (leave it out for no cap)".into(),
        ));
    }
    for (key, d) in [("retain", p.retain), ("retain_excerpts", p.retain_excerpts)] {
        if d.is_some_and(|d| d.0 < std::time::Duration::from_secs(1)) {
            return Err(invalid(
                format!("pipelines.{name}.{key}"),
                "must be at least 1s".into(),
            ));
        }
    }
    if let (Some(r), Some(e)) = (p.retain, p.retain_excerpts) {
        if e.0 > r.0 {
            return Err(invalid(
                format!("pipelines.{name}.retain_excerpts"),
                "must be no longer than `retain` (the records go first)".into(),
            ));
        }
    }
    if let Some(schedule) = &p.schedule {
        let key = format!("pipelines.{name}.schedule");
        crate::domain::schedule::Cron::parse(&schedule.cron)
            .map_err(|e| invalid(format!("{key}.cron"), e))?;
        if !schedule.input.is_object() {
            return Err(invalid(
                format!("{key}.input"),
                "must be a table (the record's input)".into(),
            ));
        }
        crate::domain::check_priority(schedule.priority)
            .map_err(|m| invalid(format!("{key}.priority"), m))?;
    }
    let by_name = check_steps(name, p, config)?;
    let order = dependency_order(name, p, &by_name)?;
    let mut upstream: HashMap<String, BTreeSet<String>> = HashMap::new();
    let mut steps = Vec::with_capacity(p.steps.len());
    for i in order {
        let s = &p.steps[i];
        let mut up = BTreeSet::new();
        for need in s.needs.iter().chain(&s.needs_any) {
            up.insert(need.clone());
            up.extend(upstream.get(need).cloned().unwrap_or_default());
        }
        upstream.insert(s.name.clone(), up.clone());
        steps.push(compile_step(name, s, up, templates, None)?);
    }
    let undo = compile_undo(name, p, config, &upstream, templates)?;
    let definition =
        serde_json::to_value(p).map_err(|e| invalid(format!("pipelines.{name}"), e.to_string()))?;
    let hash = hex::encode(Sha256::digest(definition.to_string().as_bytes()));
    Ok(Pipeline {
        name: name.to_owned(),
        steps,
        undo,
        undo_on_failure: p.on_failure == Some(crate::config::pipeline::OnFailure::Undo),
        definition,
        hash,
    })
}

/// Each step's `undo` as a step of its own (`undo:NAME`, a `request` to
/// the undo's provider, or the step's): it sees what the step saw, and
/// the step's output as `output`; its retries and timeout are the
/// step's, and its calls `at_most_once` when the step's are.
fn compile_undo(
    name: &str,
    p: &PipelineConfig,
    config: &Config,
    upstream: &HashMap<String, BTreeSet<String>>,
    templates: &mut Templates,
) -> Result<Vec<Step>, ConfigError> {
    let mut undo = Vec::new();
    if p.on_failure == Some(crate::config::pipeline::OnFailure::Undo)
        && p.steps.iter().all(|s| s.undo.is_none())
    {
        return Err(invalid(
            format!("pipelines.{name}.on_failure"),
            "`undo`, but no step says how it is undone (`undo = { request = … }`)".into(),
        ));
    }
    for s in &p.steps {
        let Some(u) = &s.undo else {
            continue;
        };
        let provider = u.provider.clone().unwrap_or_else(|| s.provider.clone());
        if !config.providers.contains_key(&provider) {
            return Err(invalid(
                step_key(name, &s.name, "undo.provider"),
                format!("unknown provider `{provider}`"),
            ));
        }
        let step = StepConfig {
            name: crate::domain::undo::name_of(&s.name),
            provider,
            kind: kinds::REQUEST,
            needs: Vec::new(),
            needs_any: Vec::new(),
            when: None,
            required: true,
            request: Some(u.request.clone()),
            outputs: BTreeMap::new(),
            undo: None,
            pipeline: None,
            input: None,
            confirm: None,
            lookup: None,
            job_id: None,
            poll: None,
            callback: None,
            for_each: None,
            max_parallel: None,
            items_required: None,
            ..s.clone()
        };
        let mut up = upstream.get(&s.name).cloned().unwrap_or_default();
        up.insert(s.name.clone());
        undo.push(compile_step(
            name,
            &step,
            up,
            templates,
            Some(s.name.clone()),
        )?);
    }
    Ok(undo)
}

/// Checks step names (valid, unique), providers (configured) and needs
/// (known steps, not itself); returns each step's index by name.
fn check_steps<'p>(
    name: &str,
    p: &'p PipelineConfig,
    config: &Config,
) -> Result<HashMap<&'p str, usize>, ConfigError> {
    let mut by_name: HashMap<&str, usize> = HashMap::new();
    for (i, s) in p.steps.iter().enumerate() {
        if !valid_name(&s.name) {
            return Err(invalid(
                format!("pipelines.{name}.steps[{i}].name"),
                format!(
                    "`{}`: step names are 1-64 characters of a-z, 0-9, `_`, `-`",
                    s.name
                ),
            ));
        }
        if by_name.insert(&s.name, i).is_some() {
            return Err(invalid(
                step_key(name, &s.name, "name"),
                "two steps have this name".into(),
            ));
        }
    }
    for s in &p.steps {
        if !s.provider.is_empty() && !config.providers.contains_key(&s.provider) {
            return Err(invalid(
                step_key(name, &s.name, "provider"),
                format!("unknown provider `{}`", s.provider),
            ));
        }
        for (field, needs) in [("needs", &s.needs), ("needs_any", &s.needs_any)] {
            for need in needs {
                if !by_name.contains_key(need.as_str()) {
                    return Err(invalid(
                        step_key(name, &s.name, field),
                        format!("unknown step `{need}`"),
                    ));
                }
                if need == &s.name {
                    return Err(invalid(
                        step_key(name, &s.name, field),
                        "a step cannot need itself".into(),
                    ));
                }
            }
        }
        if let (Some(retry), Some(p)) = (&s.retry, config.providers.get(&s.provider)) {
            retry.over(&p.retry).check().map_err(|(field, message)| {
                invalid(
                    step_key(name, &s.name, field),
                    format!("{message} (with the provider's settings this step keeps)"),
                )
            })?;
        }
        if s.timeout.is_some_and(|t| t.0.is_zero()) {
            return Err(invalid(
                step_key(name, &s.name, "timeout"),
                "must be more than 0".into(),
            ));
        }
        if let Some(both) = s.needs_any.iter().find(|n| s.needs.contains(n)) {
            return Err(invalid(
                step_key(name, &s.name, "needs_any"),
                format!("`{both}` is in `needs` too: a step is needed by all or by any, not both"),
            ));
        }
    }
    Ok(by_name)
}

/// The steps' indexes in an order where each comes after what it needs
/// (Kahn); a cycle is an error naming its steps.
fn dependency_order(
    name: &str,
    p: &PipelineConfig,
    by_name: &HashMap<&str, usize>,
) -> Result<Vec<usize>, ConfigError> {
    let mut order: Vec<usize> = Vec::with_capacity(p.steps.len());
    let mut placed = vec![false; p.steps.len()];
    while order.len() < p.steps.len() {
        let next = (0..p.steps.len()).find(|&i| {
            !placed[i]
                && p.steps[i]
                    .needs
                    .iter()
                    .chain(&p.steps[i].needs_any)
                    .all(|n| by_name.get(n.as_str()).is_some_and(|&j| placed[j]))
        });
        let Some(i) = next else {
            let stuck: Vec<&str> = (0..p.steps.len())
                .filter(|&i| !placed[i])
                .map(|i| p.steps[i].name.as_str())
                .collect();
            return Err(invalid(
                format!("pipelines.{name}.steps"),
                format!(
                    "the `needs` (and `needs_any`) of steps {} form a cycle",
                    stuck.join(", ")
                ),
            ));
        };
        placed[i] = true;
        order.push(i);
    }
    Ok(order)
}

/// How the template of `field` (`request.path`, `request.headers.X`,
/// `request.body`, `poll.path`, `until` …) quotes what it interpolates: a
/// body for the content type the step sends it as, a header or a sleep's
/// `until` as is, anything else (a path or query) percent-encoded.
fn quoting_of(s: &StepConfig, field: &str) -> Quoting {
    if field.ends_with(".body") {
        let content_type = s.request.iter().flat_map(|r| r.headers.iter());
        let named = content_type
            .filter(|(h, _)| h.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.as_str())
            .next();
        Quoting::of_body(named)
    } else if field == "input" {
        // A child record's input: JSON, as a body is.
        Quoting::Json
    } else if field.contains(".headers.") || field == "until" {
        // A header, and a value that is no part of a request (a sleep's
        // `until`), as they are.
        Quoting::Text
    } else {
        Quoting::Url
    }
}

/// One step's templates being added: each under `pipeline/step/field`,
/// checked against the step's upstream, quoted for where it lands.
struct StepTemplates<'a> {
    pipeline: &'a str,
    step: &'a StepConfig,
    upstream: &'a BTreeSet<String>,
    templates: &'a mut Templates,
}

impl StepTemplates<'_> {
    fn key(&self, field: &str) -> String {
        step_key(self.pipeline, &self.step.name, field)
    }

    /// Adds `source` as the template of `field`; `job_id` and `output`
    /// say whether it may refer to them. Returns its id.
    fn add(
        &mut self,
        field: &str,
        source: &str,
        job_id: bool,
        output: bool,
    ) -> Result<String, ConfigError> {
        let id = format!("{}/{}/{field}", self.pipeline, self.step.name);
        let scope = template::Scope {
            upstream: self.upstream,
            job_id,
            output,
            quoting: quoting_of(self.step, field),
            item: self.step.for_each.is_some(),
        };
        self.templates
            .add(&id, source, &scope)
            .map_err(|e| invalid(self.key(field), e.to_string()))?;
        Ok(id)
    }

    /// Adds `source` as the step's `when`, an expression over what its
    /// templates see.
    fn condition(&mut self, source: &str) -> Result<Condition, ConfigError> {
        let id = format!("{}/{}/when", self.pipeline, self.step.name);
        let scope = template::Scope {
            upstream: self.upstream,
            job_id: false,
            output: false,
            quoting: Quoting::Text,
            item: false,
        };
        self.templates
            .add_condition(&id, source, &scope)
            .map_err(|e| invalid(self.key("when"), e.to_string()))?;
        Ok(Condition {
            id,
            source: source.to_owned(),
        })
    }

    fn method(&self, m: &str, field: &str) -> Result<HttpMethod, ConfigError> {
        HttpMethod::parse(m)
            .ok_or_else(|| invalid(self.key(field), format!("unknown HTTP method `{m}`")))
    }

    /// A bodiless `GET`-like request of `field.path` and `field.method`.
    fn asking(
        &mut self,
        field: &str,
        (method, path): (&str, &str),
        job_id: bool,
        output: bool,
    ) -> Result<RequestSpec, ConfigError> {
        Ok(RequestSpec {
            method: self.method(method, &format!("{field}.method"))?,
            path: self.add(&format!("{field}.path"), path, job_id, output)?,
            headers: Vec::new(),
            body: None,
        })
    }
}

/// Compiles one step: its templates (checked against its upstream), its
/// kind with the data that kind needs, its output pointers.
fn compile_step(
    pipeline: &str,
    s: &StepConfig,
    up: BTreeSet<String>,
    templates: &mut Templates,
    undoes: Option<String>,
) -> Result<Step, ConfigError> {
    let mut t = StepTemplates {
        pipeline,
        step: s,
        upstream: &up,
        templates,
    };
    let request = match &s.request {
        Some(r) => Some(compile_request(r, &mut t, undoes.is_some())?),
        None => None,
    };
    let when = match &s.when {
        Some(source) => Some(t.condition(source)?),
        None => None,
    };
    let kind = kinds::compile(s, &mut t)?;
    fits_kind(s, kind.as_ref(), &t)?;
    let kind_calls = kind.calls();
    let key = |field: &str| step_key(pipeline, &s.name, field);
    let (confirm, confirm_request) = match &s.confirm {
        None => (None, None),
        Some(c) => compile_confirm(c, kind.confirms(), &mut t)?,
    };
    let lookup = match &s.lookup {
        None => None,
        Some(_) if kind.job_pointer().is_none() => {
            return Err(invalid(
                key("lookup"),
                "finds a job a submit made: give it to a `submit_poll` or `callback` step".into(),
            ));
        }
        Some(l) => {
            check_pointer(&l.job_id).map_err(|m| invalid(key("lookup.job_id"), m))?;
            Some(crate::domain::pipeline::Lookup {
                request: t.asking("lookup", (&l.method, &l.path), false, false)?,
                job_id: l.job_id.clone(),
            })
        }
    };
    for (out, pointer) in &s.outputs {
        check_pointer(pointer).map_err(|m| invalid(key(&format!("outputs.{out}")), m))?;
    }
    let each = each::compile(s, kind.as_ref(), &up).map_err(|(f, m)| invalid(key(f), m))?;
    Ok(Step {
        name: s.name.clone(),
        provider: s.provider.clone(),
        kind,
        needs: s.needs.clone(),
        needs_any: s.needs_any.clone(),
        when,
        upstream: up,
        required: s.required,
        request,
        outputs: s.outputs.clone(),
        on_reversal: s.on_reversal,
        confirm,
        confirm_request,
        lookup,
        at_most_once: s.at_most_once,
        undoes,
        each,
        timeout: s.timeout.filter(|_| kind_calls).map(|t| t.0),
        retry: s.retry.as_ref().map_or_else(Default::default, |r| {
            crate::domain::step::RetryOverride {
                max_attempts: r.max_attempts,
                unknown_attempts: r.unknown_attempts,
                base: r.base.map(|d| d.0),
                cap: r.cap.map(|d| d.0),
                deadline: r.deadline.map(|d| d.0),
            }
        }),
    })
}

/// The step's call: method, path, headers and body, each a template.
fn compile_request(
    r: &crate::config::pipeline::RequestConfig,
    t: &mut StepTemplates<'_>,
    output: bool,
) -> Result<RequestSpec, ConfigError> {
    let mut headers = Vec::new();
    for (h, v) in &r.headers {
        headers.push((
            h.clone(),
            t.add(&format!("request.headers.{h}"), v, false, output)?,
        ));
    }
    Ok(RequestSpec {
        method: t.method(&r.method, "request.method")?,
        path: t.add("request.path", &r.path, false, output)?,
        headers,
        body: match &r.body {
            Some(b) => Some(t.add("request.body", b, false, output)?),
            None => None,
        },
    })
}

/// A calling kind has a provider and a request; a kind that calls none
/// has neither, nor anything only a call has (outputs read from a reply,
/// a confirmation, a lookup, `at_most_once`).
fn fits_kind(s: &StepConfig, kind: &dyn Kind, t: &StepTemplates<'_>) -> Result<(), ConfigError> {
    let name = kind.name();
    if kind.calls() {
        if s.provider.is_empty() {
            return Err(invalid(
                t.key("provider"),
                format!("a `{name}` step calls a provider: name it (`provider = \"...\"`)"),
            ));
        }
        if s.request.is_none() {
            return Err(invalid(
                t.key("request"),
                format!("a `{name}` step needs `request = {{ path = ... }}`"),
            ));
        }
        return Ok(());
    }
    let given = [
        ("provider", !s.provider.is_empty()),
        ("request", s.request.is_some()),
        ("outputs", !s.outputs.is_empty()),
        ("confirm", s.confirm.is_some()),
        ("lookup", s.lookup.is_some()),
        ("at_most_once", s.at_most_once.is_some()),
    ];
    match given.iter().find(|(_, set)| *set) {
        Some((field, _)) => Err(invalid(
            t.key(field),
            format!("a `{name}` step calls no provider: it takes no `{field}`"),
        )),
        None => Ok(()),
    }
}

/// A step's `confirm`: how often, and the request that asks (its own
/// `path`, or none for a job step, whose poll asks), refusing what cannot
/// confirm.
fn compile_confirm(
    c: &crate::config::pipeline::ConfirmConfig,
    confirms: Confirms,
    t: &mut StepTemplates<'_>,
) -> Result<
    (
        Option<crate::domain::pipeline::Confirm>,
        Option<RequestSpec>,
    ),
    ConfigError,
> {
    let refuse = |field: &str, message: &str| Err(invalid(t.key(field), message.into()));
    if c.after.0.is_zero() || c.times == 0 || c.times > 100 {
        return refuse(
            "confirm",
            "`after` must be more than 0 and `times` between 1 and 100",
        );
    }
    if let Confirms::Never(why) = confirms {
        return refuse("confirm", why);
    }
    if c.method
        .as_deref()
        .is_some_and(|m| !m.eq_ignore_ascii_case("GET"))
    {
        return refuse(
            "confirm.method",
            "a confirmation only asks: it must be `GET`",
        );
    }
    let polls = confirms == Confirms::PollOrOwn;
    let request = match (&c.path, polls) {
        (Some(path), _) => {
            let method = c.method.as_deref().unwrap_or("GET");
            Some(t.asking("confirm", (method, path), polls, true)?)
        }
        (None, true) if c.method.is_none() => None,
        (None, true) => {
            return refuse(
                "confirm.method",
                "is for a confirmation's own `path`; without one the job's poll is used",
            );
        }
        (None, false) => {
            return refuse(
                "confirm",
                "needs `path`, the request that asks about the result (for example \
                 \"/v1/charges/{{ output.id }}\"), unless the step polls a job \
                 (kind = \"submit_poll\")",
            );
        }
    };
    let spec = crate::domain::pipeline::Confirm {
        after: c.after.0,
        times: c.times,
    };
    Ok((Some(spec), request))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const PROVIDERS: &str = r#"
[providers.renderer]
base_url = "https://render.example"
[providers.crm]
base_url = "https://crm.example"
"#;

    fn load(pipelines: &str) -> Result<Pipelines, ConfigError> {
        let config = Config::parse(&format!("{PROVIDERS}{pipelines}"), Path::new("t.toml"))?;
        compile(&config)
    }

    const GOOD: &str = r#"
[[pipelines.render_video.steps]]
name = "submit"
provider = "renderer"
kind = "submit_poll"
request = { method = "POST", path = "/v1/jobs", body = '{"source": {{ input.url | tojson }}}' }
job_id = "/id"
poll = { path = "/v1/jobs/{{ job_id }}", every = "2s", deadline = "20m" }
outputs = { video_url = "/result/url" }

[[pipelines.render_video.steps]]
name = "notify"
provider = "crm"
needs = ["submit"]
required = false
request = { path = "/notes", body = '{"text": "ready: {{ steps.submit.output.video_url }}"}' }
"#;

    #[test]
    fn a_group_cap_is_at_least_one_and_leaves_the_hash_alone() {
        let capped = format!("[pipelines.render_video]\ngroup_concurrency = 0\n{GOOD}");
        let e = load(&capped)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("pipelines.render_video.group_concurrency"),
            "{e}"
        );
        // Set or not, the definition (and so its hash) is what it was
        // before the setting existed: pipelines already pinned stay pinned.
        let plain = load(GOOD).unwrap();
        assert!(
            plain.pipelines["render_video"]
                .definition
                .get("group_concurrency")
                .is_none()
        );
        let capped = format!("[pipelines.render_video]\ngroup_concurrency = 5\n{GOOD}");
        let capped = load(&capped).unwrap();
        assert_eq!(
            capped.pipelines["render_video"].hash,
            plain.pipelines["render_video"].hash
        );
    }

    #[test]
    fn a_schedule_is_checked_and_leaves_the_hash_alone() {
        let with =
            |schedule: &str| format!("[pipelines.render_video]\nschedule = {schedule}\n{GOOD}");
        let err = |text: &str| load(text).err().map(|e| e.to_string()).unwrap_or_default();
        let e = err(&with(r#"{ cron = "every hour" }"#));
        assert!(
            e.contains("pipelines.render_video.schedule.cron") && e.contains("every hour"),
            "{e}"
        );
        let e = err(&with(r#"{ cron = "0 0 30 2 *" }"#));
        assert!(e.contains("never fires"), "{e}");
        let e = err(&with(r#"{ cron = "@hourly", input = [1] }"#));
        assert!(e.contains("pipelines.render_video.schedule.input"), "{e}");
        let e = err(&with(r#"{ cron = "@hourly", missed = "sometimes" }"#));
        assert!(e.contains("missed") || e.contains("sometimes"), "{e}");
        let e = err(&with(r#"{ cron = "@hourly", when = "now" }"#));
        assert!(e.contains("when"), "{e}");
        let e = err(&with(r#"{ cron = "@hourly", priority = 10 }"#));
        assert!(
            e.contains("pipelines.render_video.schedule.priority") && e.contains("out of range"),
            "{e}"
        );
        let scheduled = load(&with(
            r#"{ cron = "@hourly", input = { a = 1 }, missed = "skip", priority = 9 }"#,
        ))
        .unwrap();
        let plain = load(GOOD).unwrap();
        assert_eq!(
            scheduled.pipelines["render_video"].hash,
            plain.pipelines["render_video"].hash
        );
    }

    #[test]
    fn a_lookup_needs_at_most_once_on_its_step_or_provider() {
        let lookup =
            r#"lookup = { path = "/v1/jobs?ref={{ key | urlencode }}", job_id = "/data/0/id" }"#;
        let with = |step: &str| {
            GOOD.replacen(
                "outputs = { video_url",
                &format!("{step}\noutputs = {{ video_url"),
                1,
            )
        };
        let e = load(&with(lookup)).err().map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(
            e.contains("pipelines.render_video.steps[submit].lookup") && e.contains("at_most_once"),
            "{e}"
        );
        let off = format!("{lookup}\nat_most_once = false");
        assert!(load(&with(&off)).is_err());
        // The step's own setting is enough, and it leaves the hash alone
        // when unset.
        let on = load(&with(&format!("{lookup}\nat_most_once = true"))).unwrap();
        let submit = on.pipelines["render_video"].step("submit").unwrap();
        assert!(submit.at_most_once(false) && submit.lookup.is_some());
        let plain = load(GOOD).unwrap();
        let s = plain.pipelines["render_video"].step("submit").unwrap();
        assert!(!s.at_most_once(false) && s.at_most_once(true));
        assert!(
            plain.pipelines["render_video"].definition["steps"][0]
                .get("at_most_once")
                .is_none()
        );
    }

    #[test]
    fn the_design_example_compiles() {
        let p = load(GOOD).unwrap_or_else(|e| panic!("{e}"));
        let rv = &p.pipelines["render_video"];
        assert_eq!(
            rv.steps.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["submit", "notify"]
        );
        assert_eq!(
            rv.from_step("submit"),
            Some(vec!["submit".to_owned(), "notify".to_owned()])
        );
        assert_eq!(rv.from_step("notify"), Some(vec!["notify".to_owned()]));
        assert_eq!(rv.hash.len(), 64);
        let ctx = serde_json::json!({ "input": { "url": "s3://a \"b\"" }, "record": { "id": 1 } });
        let body = p.templates.render(
            rv.step("submit")
                .and_then(|s| s.request.as_ref()?.body.as_deref())
                .unwrap_or(""),
            &ctx,
        );
        assert_eq!(body.ok().as_deref(), Some(r#"{"source": "s3://a \"b\""}"#));
    }

    #[test]
    fn mistakes_name_pipeline_step_and_field() {
        let cases = [
            (
                GOOD.replace("provider = \"crm\"", "provider = \"crn\""),
                "pipelines.render_video.steps[notify].provider",
                "unknown provider `crn`",
            ),
            (
                GOOD.replace("needs = [\"submit\"]", "needs = [\"sbmit\"]"),
                "pipelines.render_video.steps[notify].needs",
                "unknown step `sbmit`",
            ),
            (
                GOOD.replace("steps.submit.output", "steps.notify.output"),
                "pipelines.render_video.steps[notify].request.body",
                "`notify`",
            ),
            (
                GOOD.replace("needs = [\"submit\"]\n", ""),
                "pipelines.render_video.steps[notify].request.body",
                "not upstream",
            ),
            (
                GOOD.replace("every = \"2s\"", "every = \"2 seconds\""),
                "t.toml:",
                "invalid duration",
            ),
            (
                GOOD.replace("job_id = \"/id\"\n", ""),
                "pipelines.render_video.steps[submit].job_id",
                "needs `job_id`",
            ),
            (
                GOOD.replace("/v1/jobs/{{ job_id }}", "/v1/jobs/{{ job_id"),
                "pipelines.render_video.steps[submit].poll.path",
                "syntax",
            ),
            (
                GOOD.replace("{{ job_id }}", "{{ jobid }}"),
                "pipelines.render_video.steps[submit].poll.path",
                "`jobid`",
            ),
            (
                GOOD.replace("method = \"POST\"", "method = \"FETCH\""),
                "pipelines.render_video.steps[submit].request.method",
                "FETCH",
            ),
            (
                GOOD.replace("\"/result/url\"", "\"result/url\""),
                "pipelines.render_video.steps[submit].outputs.video_url",
                "JSON pointer",
            ),
            (
                GOOD.replace("name = \"notify\"", "name = \"submit\""),
                "pipelines.render_video.steps[submit].name",
                "two steps",
            ),
            (
                GOOD.replace("required = false", "required = false\njob_id = \"/id\""),
                "pipelines.render_video.steps[notify].job_id",
                "a `request` step takes no `job_id`",
            ),
            (
                GOOD.replace("provider = \"crm\"\n", ""),
                "pipelines.render_video.steps[notify].provider",
                "calls a provider",
            ),
            (
                GOOD.replace("request = { path = \"/notes\"", "rqst = { path = \"/notes\""),
                "t.toml:",
                "rqst",
            ),
            (
                GOOD.replace(
                    "request = { path = \"/notes\", body = '{\"text\": \"ready: {{ steps.submit.output.video_url }}\"}' }",
                    "",
                ),
                "pipelines.render_video.steps[notify].request",
                "needs `request",
            ),
        ];
        for (text, key, message) in cases {
            let err = load(&text)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| panic!("accepted: {key}"));
            assert!(err.contains(key), "expected {key} in {err}");
            assert!(err.contains(message), "expected {message:?} in {err}");
        }
    }

    #[test]
    fn a_callback_table_on_a_submit_poll_step_is_ignored_as_it_always_was() {
        let stray = GOOD.replace(
            "job_id = \"/id\"\n",
            "job_id = \"/id\"\ncallback = { job_id = \"/id\" }\n",
        );
        let p = load(&stray).unwrap_or_else(|e| panic!("{e}"));
        let submit = p.pipelines["render_video"].step("submit").unwrap();
        assert!(submit.poll().is_some() && submit.callback().is_none());
    }

    #[test]
    fn cycles_are_refused() {
        let text = r#"
[[pipelines.p.steps]]
name = "a"
provider = "crm"
needs = ["b"]
request = { path = "/a" }
[[pipelines.p.steps]]
name = "b"
provider = "crm"
needs = ["a"]
request = { path = "/b" }
"#;
        let err = load(text).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.contains("pipelines.p.steps") && err.contains("cycle"),
            "{err}"
        );
    }

    #[test]
    fn independent_steps_share_no_upstream() {
        let text = r#"
[[pipelines.p.steps]]
name = "fetch"
provider = "crm"
request = { path = "/f" }
[[pipelines.p.steps]]
name = "analyse"
provider = "renderer"
needs = ["fetch"]
request = { path = "/a/{{ steps.fetch.output.id }}" }
[[pipelines.p.steps]]
name = "enrich"
provider = "crm"
needs = ["fetch"]
request = { path = "/e" }
[[pipelines.p.steps]]
name = "update"
provider = "crm"
needs = ["analyse", "enrich"]
request = { path = "/u", body = '{{ steps.fetch.output | tojson }}' }
"#;
        let p = load(text).unwrap_or_else(|e| panic!("{e}"));
        let p = &p.pipelines["p"];
        let up = |n: &str| {
            p.step(n)
                .map(|s| s.upstream.iter().cloned().collect::<Vec<_>>())
                .unwrap_or_default()
        };
        assert_eq!(up("update"), ["analyse", "enrich", "fetch"]);
        assert!(up("enrich").iter().all(|s| s != "analyse"));
        assert_eq!(
            p.from_step("analyse"),
            Some(vec!["analyse".to_owned(), "update".to_owned()])
        );
    }
}
