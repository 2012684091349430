//! Pipelines compiled from configuration: steps in dependency order, their
//! upstream sets, and their request templates, all checked at load so that
//! `ballast check-config` catches what would otherwise fail at 3 a.m.

pub mod template;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::pipeline::{CallbackConfig, PipelineConfig, StepKind};
use crate::config::provider::check_pointer;
use crate::config::{Config, ConfigError};
use crate::domain::ReversalPolicy;

pub use template::{TemplateError, Templates};

/// A compiled request: templates by name in [`Templates`].
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

/// One step, compiled.
#[derive(Debug, Clone)]
pub struct Step {
    pub name: String,
    pub provider: String,
    pub kind: StepKind,
    pub needs: Vec<String>,
    /// Every step this one depends on, directly or not.
    pub upstream: BTreeSet<String>,
    pub required: bool,
    pub request: RequestSpec,
    pub job_id: Option<String>,
    pub poll: Option<PollSpec>,
    pub callback: Option<CallbackConfig>,
    pub outputs: BTreeMap<String, String>,
    pub on_reversal: ReversalPolicy,
}

/// One pipeline, compiled.
#[derive(Debug, Clone)]
pub struct Pipeline {
    pub name: String,
    /// Steps in an order where every step comes after the steps it needs.
    pub steps: Vec<Step>,
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
        pipelines.insert(name.clone(), Arc::new(pipeline));
    }
    Ok(Pipelines {
        pipelines,
        templates: Arc::new(templates),
    })
}

fn compile_one(
    name: &str,
    p: &PipelineConfig,
    config: &Config,
    templates: &mut Templates,
) -> Result<Pipeline, ConfigError> {
    let invalid = |key: String, message: String| ConfigError::Invalid { key, message };
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
        if !config.providers.contains_key(&s.provider) {
            return Err(invalid(
                step_key(name, &s.name, "provider"),
                format!("unknown provider `{}`", s.provider),
            ));
        }
        for need in &s.needs {
            if !by_name.contains_key(need.as_str()) {
                return Err(invalid(
                    step_key(name, &s.name, "needs"),
                    format!("unknown step `{need}`"),
                ));
            }
            if need == &s.name {
                return Err(invalid(
                    step_key(name, &s.name, "needs"),
                    "a step cannot need itself".into(),
                ));
            }
        }
    }

    // Order steps so that each comes after what it needs (Kahn), and find cycles.
    let mut order: Vec<usize> = Vec::with_capacity(p.steps.len());
    let mut placed = vec![false; p.steps.len()];
    while order.len() < p.steps.len() {
        let next = (0..p.steps.len()).find(|&i| {
            !placed[i]
                && p.steps[i]
                    .needs
                    .iter()
                    .all(|n| by_name.get(n.as_str()).is_some_and(|&j| placed[j]))
        });
        match next {
            Some(i) => {
                placed[i] = true;
                order.push(i);
            }
            None => {
                let stuck: Vec<&str> = (0..p.steps.len())
                    .filter(|&i| !placed[i])
                    .map(|i| p.steps[i].name.as_str())
                    .collect();
                return Err(invalid(
                    format!("pipelines.{name}.steps"),
                    format!("the `needs` of steps {} form a cycle", stuck.join(", ")),
                ));
            }
        }
    }

    let mut upstream: HashMap<String, BTreeSet<String>> = HashMap::new();
    let mut steps = Vec::with_capacity(p.steps.len());
    for i in order {
        let s = &p.steps[i];
        let mut up = BTreeSet::new();
        for need in &s.needs {
            up.insert(need.clone());
            up.extend(upstream.get(need).cloned().unwrap_or_default());
        }
        upstream.insert(s.name.clone(), up.clone());

        let key = |field: &str| step_key(name, &s.name, field);
        let method = |m: &str, field: &str| {
            HttpMethod::parse(m)
                .ok_or_else(|| invalid(key(field), format!("unknown HTTP method `{m}`")))
        };
        let scope = template::Scope {
            upstream: &up,
            job_id: false,
        };
        let tpl =
            |templates: &mut Templates, field: &str, source: &str, scope: &template::Scope<'_>| {
                let id = format!("{name}/{}/{field}", s.name);
                templates
                    .add(&id, source, scope)
                    .map_err(|e| invalid(key(field), e.to_string()))?;
                Ok::<_, ConfigError>(id)
            };
        let mut headers = Vec::new();
        for (h, v) in &s.request.headers {
            headers.push((
                h.clone(),
                tpl(templates, &format!("request.headers.{h}"), v, &scope)?,
            ));
        }
        let request = RequestSpec {
            method: method(&s.request.method, "request.method")?,
            path: tpl(templates, "request.path", &s.request.path, &scope)?,
            headers,
            body: match &s.request.body {
                Some(b) => Some(tpl(templates, "request.body", b, &scope)?),
                None => None,
            },
        };
        let poll_scope = template::Scope {
            upstream: &up,
            job_id: true,
        };
        let poll = match &s.poll {
            Some(pc) => Some(PollSpec {
                request: RequestSpec {
                    method: method(&pc.method, "poll.method")?,
                    path: tpl(templates, "poll.path", &pc.path, &poll_scope)?,
                    headers: Vec::new(),
                    body: None,
                },
                every: pc.every.0,
                deadline: pc.deadline.0,
            }),
            None => None,
        };
        match s.kind {
            StepKind::Request => {
                if s.poll.is_some() || s.callback.is_some() || s.job_id.is_some() {
                    return Err(invalid(key("kind"), "a `request` step has no `job_id`, `poll` or `callback`; use `submit_poll` or `callback`".into()));
                }
            }
            StepKind::SubmitPoll => {
                if s.job_id.is_none() {
                    return Err(invalid(key("job_id"), "a `submit_poll` step needs `job_id` (a JSON pointer into the submit reply)".into()));
                }
                if s.poll.is_none() {
                    return Err(invalid(
                        key("poll"),
                        "a `submit_poll` step needs `poll = { path = ... }`".into(),
                    ));
                }
            }
            StepKind::Callback => {
                if s.job_id.is_none() {
                    return Err(invalid(
                        key("job_id"),
                        "a `callback` step needs `job_id` (a JSON pointer into the submit reply)"
                            .into(),
                    ));
                }
                let Some(cb) = &s.callback else {
                    return Err(invalid(
                        key("callback"),
                        "a `callback` step needs `callback = { job_id = ... }`".into(),
                    ));
                };
                check_pointer(&cb.job_id).map_err(|m| invalid(key("callback.job_id"), m))?;
                if cb.fallback == crate::config::pipeline::CallbackFallback::Poll
                    && s.poll.is_none()
                {
                    return Err(invalid(
                        key("callback.fallback"),
                        "`fallback = \"poll\"` needs a `poll` request".into(),
                    ));
                }
            }
        }
        if let Some(j) = &s.job_id {
            check_pointer(j).map_err(|m| invalid(key("job_id"), m))?;
        }
        for (out, pointer) in &s.outputs {
            check_pointer(pointer).map_err(|m| invalid(key(&format!("outputs.{out}")), m))?;
        }
        steps.push(Step {
            name: s.name.clone(),
            provider: s.provider.clone(),
            kind: s.kind,
            needs: s.needs.clone(),
            upstream: up,
            required: s.required,
            request,
            job_id: s.job_id.clone(),
            poll,
            callback: s.callback.clone(),
            outputs: s.outputs.clone(),
            on_reversal: s.on_reversal,
        });
    }
    let definition =
        serde_json::to_value(p).map_err(|e| invalid(format!("pipelines.{name}"), e.to_string()))?;
    let hash = hex::encode(Sha256::digest(definition.to_string().as_bytes()));
    Ok(Pipeline {
        name: name.to_owned(),
        steps,
        definition,
        hash,
    })
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
                .and_then(|s| s.request.body.as_deref())
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
