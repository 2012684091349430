//! Request templates (minijinja): URL paths, headers and bodies rendered
//! over `input`, `steps.<name>.output`, `record`, `key` (the step's stable
//! key) and, for polls, `job_id`; a confirmation's also over `output`.
//! Undefined variables are errors, never empty strings, and rendering is
//! bounded by fuel so a template cannot spin.
//!
//! What a template interpolates is quoted for where it lands, so that a
//! record's input cannot change a request's shape: in a path or query,
//! percent-encoded as one segment (a value of `.` or `..` refused), and
//! the engine keeps the URL under the provider's base path; in a JSON body, a string's characters escaped as
//! inside a JSON string (a quote in the input cannot end the string and
//! add a field); in a header, as is (the engine refuses a value a header
//! cannot carry). Values already made for their place (`tojson`,
//! `urlencode`) and those marked `| raw` are written as they are.

use std::collections::{BTreeSet, HashMap};

use minijinja::{
    AutoEscape, Environment, Error, Output, State, UndefinedBehavior, Value as TplValue,
};
use percent_encoding::{AsciiSet, utf8_percent_encode};
use serde_json::Value;

/// Everything but RFC 3986's unreserved characters is percent-encoded: a
/// value is one path segment or one query value, whatever it holds.
const COMPONENT: &AsciiSet = crate::domain::mask::URL_COMPONENT;

/// How a template's interpolated values are quoted: by where the rendered
/// text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quoting {
    /// A URL's path and query, or a form body: percent-encoded.
    Url,
    /// A JSON body: strings escaped as inside a JSON string.
    Json,
    /// A header or a body of another type: written as is.
    Text,
}

impl Quoting {
    const ALL: [Quoting; 3] = [Quoting::Url, Quoting::Json, Quoting::Text];

    fn index(self) -> usize {
        match self {
            Quoting::Url => 0,
            Quoting::Json => 1,
            Quoting::Text => 2,
        }
    }

    /// A body's quoting, from the content type the step names (JSON when
    /// it names none, as the engine then sends `application/json`).
    pub fn of_body(content_type: Option<&str>) -> Quoting {
        let Some(t) = content_type else {
            return Quoting::Json;
        };
        let essence = t
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence == "application/json" || essence.ends_with("+json") {
            Quoting::Json
        } else if essence == "application/x-www-form-urlencoded" {
            Quoting::Url
        } else {
            Quoting::Text
        }
    }

    /// Writes `value` as this quoting wants it.
    fn write(self, out: &mut Output, value: &TplValue) -> Result<(), Error> {
        let text = value.to_string();
        let quoted = match self {
            _ if value.is_safe() => text,
            Quoting::Text => text,
            // `.` and `..` would move a path even encoded (URL parsers
            // read `%2e%2e` as `..`): a value cannot be one.
            Quoting::Url if text == "." || text == ".." => {
                return Err(Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("`{text}` cannot be a value in a URL: it would move the path"),
                ));
            }
            Quoting::Url => utf8_percent_encode(&text, COMPONENT).to_string(),
            Quoting::Json if value.as_str().is_some() => {
                let json = serde_json::to_string(&text).unwrap_or_default();
                let inner = json.strip_prefix('"').and_then(|j| j.strip_suffix('"'));
                inner.unwrap_or_default().to_owned()
            }
            Quoting::Json => text,
        };
        out.write_str(&quoted)
            .map_err(|e| Error::new(minijinja::ErrorKind::WriteFailure, e.to_string()))
    }
}

/// Instructions one render may execute.
const FUEL: u64 = 100_000;

/// What a template may refer to.
pub struct Scope<'a> {
    /// Steps whose outputs exist when this step runs.
    pub upstream: &'a BTreeSet<String>,
    /// Poll templates also see the provider's `job_id`.
    pub job_id: bool,
    /// Confirmation templates also see `output`, the step's own output.
    pub output: bool,
    /// How what the template interpolates is quoted.
    pub quoting: Quoting,
    /// A for-each step's templates also see `item` and `item_index`.
    pub item: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("{0}")]
    Syntax(String),
    #[error(
        "refers to `{0}`, which is not available here (use `input`, `steps.<upstream step>.output`, `record`, `key`{1})"
    )]
    UnknownVariable(String, &'static str),
    #[error("refers to step `{0}`, which is not upstream of this step: add it to `needs`")]
    NotUpstream(String),
    #[error("template `{0}` is not loaded")]
    Missing(String),
    #[error("rendering failed: {0}")]
    Render(String),
}

impl TemplateError {
    pub fn code(&self) -> &'static str {
        "template_error"
    }
}

/// Every request template of the loaded pipelines: one environment per
/// quoting (a formatter is the environment's), and which one holds each.
pub struct Templates {
    envs: [Environment<'static>; 3],
    quoting: HashMap<String, Quoting>,
    /// Conditions by id: each one's source and the variables it reads.
    conditions: HashMap<String, (String, Vec<String>)>,
}

/// What a condition found.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    pub holds: bool,
    /// Each variable it names (`steps.kyc.output.verdict`) and its value.
    pub read: Vec<(String, Value)>,
}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Templates").finish_non_exhaustive()
    }
}

impl Default for Templates {
    fn default() -> Self {
        Self::new()
    }
}

impl Templates {
    pub fn new() -> Self {
        Templates {
            envs: Quoting::ALL.map(environment),
            quoting: HashMap::new(),
            conditions: HashMap::new(),
        }
    }

    /// Parses `source` as template `id` and checks what it refers to.
    pub fn add(&mut self, id: &str, source: &str, scope: &Scope<'_>) -> Result<(), TemplateError> {
        let env = &mut self.envs[scope.quoting.index()];
        env.add_template_owned(id.to_owned(), source.to_owned())
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        self.quoting.insert(id.to_owned(), scope.quoting);
        let env = &self.envs[scope.quoting.index()];
        let tpl = env
            .get_template(id)
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        let vars = tpl.undeclared_variables(true);
        check_variables(vars, env, scope)?;
        Ok(())
    }

    /// Parses `source` as condition `id` (a `when`: an expression, true
    /// or false) and checks what it refers to as [`Templates::add`] does.
    pub fn add_condition(
        &mut self,
        id: &str,
        source: &str,
        scope: &Scope<'_>,
    ) -> Result<(), TemplateError> {
        let env = &self.envs[Quoting::Text.index()];
        let expr = env
            .compile_expression(source)
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        let vars = expr.undeclared_variables(true);
        // Evidence names values: a bare `steps` (read by a subscript, as
        // `steps["a-b"]`) would keep every output, and says nothing.
        let mut read: Vec<String> = vars
            .iter()
            .filter(|v| !is_global(env, v) && v.as_str() != "steps")
            .cloned()
            .collect();
        read.sort();
        check_variables(vars, env, scope)?;
        self.conditions
            .insert(id.to_owned(), (source.to_owned(), read));
        Ok(())
    }

    /// Evaluates condition `id` over `ctx`: whether it holds, and the
    /// values it read (each variable it names, as `ctx` has it; `null`
    /// where `ctx` has none).
    pub fn judge(&self, id: &str, ctx: &Value) -> Result<Judged, TemplateError> {
        let (source, read) = self
            .conditions
            .get(id)
            .ok_or_else(|| TemplateError::Missing(id.to_owned()))?;
        let env = &self.envs[Quoting::Text.index()];
        let expr = env
            .compile_expression(source)
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        let value = expr
            .eval(TplValue::from(minijinja::value::Serde(ctx)))
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        if value.is_undefined() {
            return Err(TemplateError::Render(format!(
                "`{source}` is undefined here (test with `is defined` what may be missing)"
            )));
        }
        let read = read
            .iter()
            .map(|path| {
                (
                    path.clone(),
                    lookup(ctx, path).cloned().unwrap_or(Value::Null),
                )
            })
            .collect();
        Ok(Judged {
            holds: value.is_true(),
            read,
        })
    }

    /// Renders template `id` over `ctx` (a JSON object).
    pub fn render(&self, id: &str, ctx: &Value) -> Result<String, TemplateError> {
        self.render_view(id, value_of(ctx))
    }

    /// Renders template `id` over `view` (a [`PassContext::view`]).
    pub fn render_view(&self, id: &str, view: TplValue) -> Result<String, TemplateError> {
        let env = self
            .quoting
            .get(id)
            .map(|q| &self.envs[q.index()])
            .ok_or_else(|| TemplateError::Missing(id.to_owned()))?;
        let tpl = env
            .get_template(id)
            .map_err(|_| TemplateError::Missing(id.to_owned()))?;
        tpl.render(view)
            .map_err(|e| TemplateError::Render(e.to_string()))
    }
}

/// A JSON value as the templates see it.
pub fn value_of(v: &Value) -> TplValue {
    TplValue::from(minijinja::value::Serde(v))
}

/// A pass's context: the JSON its conditions read (`input`, `record`,
/// `steps.<name>.output`) and, converted on first use and then shared,
/// the same as the templates' values. Every call of the pass renders over
/// views of it without converting the record's input again: a step for
/// each of 10,000 items converted the whole context, its list included,
/// for every template of every item.
pub struct PassContext {
    json: Value,
    values: std::sync::OnceLock<Converted>,
    /// The record's sensitive values, found once per pass (every item of a
    /// step for each item shares them).
    scrubber: std::sync::OnceLock<std::sync::Arc<crate::domain::mask::Scrubber>>,
}

impl std::fmt::Debug for PassContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PassContext").finish_non_exhaustive()
    }
}

/// The context's top-level values but `steps`, and each step's entry.
struct Converted {
    top: Vec<(String, TplValue)>,
    steps: Vec<(String, TplValue)>,
    /// Whether the context has `steps` (an object).
    has_steps: bool,
}

impl PassContext {
    pub fn new(json: Value) -> Self {
        PassContext {
            json,
            values: std::sync::OnceLock::new(),
            scrubber: std::sync::OnceLock::new(),
        }
    }

    /// The record's sensitive values by `rules` (its pipeline's, asked
    /// the first time only), with their masks.
    pub fn scrubber(
        &self,
        rules: impl FnOnce() -> Vec<crate::domain::mask::Rule>,
    ) -> std::sync::Arc<crate::domain::mask::Scrubber> {
        use crate::domain::mask;
        self.scrubber
            .get_or_init(|| {
                let rules = rules();
                std::sync::Arc::new(mask::Scrubber::new(mask::values(&self.json, &rules)))
            })
            .clone()
    }

    pub fn json(&self) -> &Value {
        &self.json
    }

    fn converted(&self) -> &Converted {
        self.values.get_or_init(|| {
            let (mut top, mut steps, mut has_steps) = (Vec::new(), Vec::new(), false);
            for (k, v) in self.json.as_object().into_iter().flatten() {
                match (k.as_str(), v.as_object()) {
                    ("steps", Some(outputs)) => {
                        has_steps = true;
                        steps.extend(outputs.iter().map(|(name, o)| (name.clone(), value_of(o))));
                    }
                    _ => top.push((k.clone(), value_of(v))),
                }
            }
            Converted {
                top,
                steps,
                has_steps,
            }
        })
    }

    /// [`Self::view`] as JSON (what a step's condition reads and keeps):
    /// only the outputs of the steps `upstream` are copied.
    pub fn json_view(&self, upstream: &BTreeSet<String>, extra: Vec<(&str, Value)>) -> Value {
        let mut ctx = serde_json::Map::new();
        for (k, v) in self.json.as_object().into_iter().flatten() {
            let v = match (k.as_str(), v.as_object()) {
                ("steps", Some(outputs)) => Value::Object(
                    outputs
                        .iter()
                        .filter(|(name, _)| upstream.contains(*name))
                        .map(|(name, o)| (name.clone(), o.clone()))
                        .collect(),
                ),
                _ => v.clone(),
            };
            ctx.insert(k.clone(), v);
        }
        ctx.extend(extra.into_iter().map(|(k, v)| (k.to_owned(), v)));
        Value::Object(ctx)
    }

    /// What one step's templates see: the context with only the outputs
    /// of the steps `upstream` of it under `steps` (what check-config let
    /// it name: a subscript it cannot check sees no more), and `extra`
    /// (its key, item, job id …) beside them. Nothing of the context is
    /// copied: the view looks its values up as a template reads them.
    pub fn view(
        self: &std::sync::Arc<Self>,
        upstream: &BTreeSet<String>,
        extra: Vec<(&'static str, TplValue)>,
    ) -> TplValue {
        let c = self.converted();
        let steps = c.has_steps.then(|| {
            (c.steps.iter().enumerate())
                .filter(|(_, (name, _))| upstream.contains(name))
                .map(|(n, _)| n)
                .collect()
        });
        TplValue::from_object(View {
            ctx: self.clone(),
            steps,
            steps_value: std::sync::OnceLock::new(),
            extra,
        })
    }
}

/// One step's view of a pass's context ([`PassContext::view`]): `extra`,
/// then `steps` (the upstream steps' entries, by their place in the
/// context's; a map of them made on first use), then the context's other
/// top-level values.
#[derive(Debug)]
struct View {
    ctx: std::sync::Arc<PassContext>,
    /// `None` when the context has no `steps`.
    steps: Option<Vec<usize>>,
    steps_value: std::sync::OnceLock<TplValue>,
    extra: Vec<(&'static str, TplValue)>,
}

impl View {
    /// Every key, in order (as a map of them would have them).
    fn keys(&self) -> Vec<&str> {
        let top = self.ctx.converted().top.iter().map(|(k, _)| k.as_str());
        let steps = self.steps.as_ref().map(|_| "steps");
        let mut keys: Vec<&str> = (self.extra.iter().map(|(k, _)| *k))
            .chain(steps)
            .chain(top)
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }
}

impl minijinja::value::Object for View {
    fn get_value(self: &std::sync::Arc<Self>, key: &TplValue) -> Option<TplValue> {
        self.get_value_by_str(key.as_str()?)
    }

    fn get_value_by_str(self: &std::sync::Arc<Self>, key: &str) -> Option<TplValue> {
        if let Some((_, v)) = self.extra.iter().find(|(k, _)| *k == key) {
            return Some(v.clone());
        }
        if key == "steps" {
            let seen = self.steps.as_ref()?;
            let value = self.steps_value.get_or_init(|| {
                let all = &self.ctx.converted().steps;
                TplValue::from(
                    seen.iter()
                        .map(|n| (all[*n].0.clone(), all[*n].1.clone()))
                        .collect::<std::collections::BTreeMap<String, TplValue>>(),
                )
            });
            return Some(value.clone());
        }
        let top = &self.ctx.converted().top;
        top.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    fn enumerate(self: &std::sync::Arc<Self>) -> minijinja::value::Enumerator {
        let keys = self.keys().into_iter().map(TplValue::from).collect();
        minijinja::value::Enumerator::Values(keys)
    }
}

/// Whether `var` is one of the functions the environment provides
/// (`range`, `dict` …) rather than a value of the context.
fn is_global(env: &Environment<'_>, var: &str) -> bool {
    let root = var.split('.').next().unwrap_or("");
    env.globals().any(|(g, _)| g == root)
}

/// Checks the variables a template or condition refers to against what
/// its scope lets it see.
fn check_variables(
    vars: std::collections::HashSet<String>,
    env: &Environment<'_>,
    scope: &Scope<'_>,
) -> Result<(), TemplateError> {
    let mut vars: Vec<String> = vars.into_iter().collect();
    vars.sort();
    let hint = match (scope.job_id, scope.output) {
        (true, true) => ", `job_id`, `output`",
        (false, true) => ", `output`",
        (true, false) => ", `job_id`",
        (false, false) => "",
    };
    for var in vars {
        let mut parts = var.split('.');
        match parts.next().unwrap_or("") {
            // The step's stable key (its idempotency key, one per
            // record, step and generation): a client reference.
            "input" | "record" | "key" => {}
            // Functions the environment provides (`range`, `dict`…).
            _ if is_global(env, &var) => {}
            "job_id" if scope.job_id => {}
            "output" if scope.output => {}
            "item" | "item_index" if scope.item => {}
            "steps" => {
                if let Some(step) = parts.next() {
                    if !scope.upstream.contains(step) {
                        return Err(TemplateError::NotUpstream(step.to_owned()));
                    }
                }
            }
            _ => return Err(TemplateError::UnknownVariable(var.clone(), hint)),
        }
    }
    Ok(())
}

/// The value at dotted `path` (`steps.kyc.output.verdict`) in `ctx`.
fn lookup<'v>(ctx: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('.').try_fold(ctx, |v, part| match v {
        Value::Object(m) => m.get(part),
        Value::Array(a) => part.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// An environment whose interpolations are quoted by `quoting`.
fn environment(quoting: Quoting) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    // Quoting is the formatter's, not HTML's.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_fuel(Some(FUEL));
    env.set_formatter(move |out: &mut Output, _: &mut State, v: &TplValue| quoting.write(out, v));
    // Written as is: the template says it means the value unquoted.
    env.add_filter("raw", |v: TplValue| {
        TplValue::from_safe_string(v.to_string())
    });
    // Jinja's `urlencode` (which keeps `/`), its result made for a URL.
    env.add_filter("urlencode", |v: &TplValue| {
        minijinja::filters::urlencode(v).map(TplValue::from_safe_string)
    });
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn scope(up: &[&str]) -> BTreeSet<String> {
        up.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn renders_and_refuses_undefined() {
        let mut t = Templates::new();
        let up = scope(&["fetch"]);
        let s = Scope {
            upstream: &up,
            job_id: false,
            output: false,
            quoting: Quoting::Url,
            item: false,
        };
        assert!(
            t.add(
                "a",
                "/x/{{ input.id | urlencode }}/{{ steps.fetch.output.n }}",
                &s
            )
            .is_ok()
        );
        let ctx =
            json!({ "input": { "id": "a b/c" }, "steps": { "fetch": { "output": { "n": 3 } } } });
        // Jinja's `urlencode` keeps `/`, as in Jinja.
        assert_eq!(t.render("a", &ctx).ok().as_deref(), Some("/x/a%20b/c/3"));
        let missing = t.render("a", &json!({ "input": {} }));
        assert!(
            matches!(missing, Err(TemplateError::Render(_))),
            "{missing:?}"
        );
        assert!(matches!(
            t.add("b", "{{ secret }}", &s),
            Err(TemplateError::UnknownVariable(..))
        ));
        assert!(matches!(
            t.add("c", "{{ steps.other.output }}", &s),
            Err(TemplateError::NotUpstream(_))
        ));
        assert!(matches!(
            t.add("d", "{{ job_id }}", &s),
            Err(TemplateError::UnknownVariable(..))
        ));
        assert!(
            t.add(
                "e",
                "{{ job_id }}",
                &Scope {
                    upstream: &up,
                    job_id: true,
                    output: false,
                    quoting: Quoting::Url,
                    item: false,
                }
            )
            .is_ok()
        );
        // Only a confirmation's request sees the step's own `output`.
        assert!(matches!(
            t.add("f", "{{ output.id }}", &s),
            Err(TemplateError::UnknownVariable(..))
        ));
        let confirming = Scope {
            upstream: &up,
            job_id: false,
            output: true,
            quoting: Quoting::Url,
            item: false,
        };
        assert!(
            t.add("g", "/v1/charges/{{ output.id }}", &confirming)
                .is_ok()
        );
    }

    #[test]
    fn a_condition_is_judged_with_what_it_read() {
        let mut t = Templates::new();
        let up = scope(&["kyc"]);
        let s = Scope {
            upstream: &up,
            job_id: false,
            output: false,
            quoting: Quoting::Text,
            item: false,
        };
        let source = "steps.kyc.output.verdict == 'review' and input.n > 2";
        t.add_condition("c", source, &s)
            .unwrap_or_else(|e| panic!("{e}"));
        let ctx = |verdict: &str| json!({ "input": { "n": 3 }, "steps": { "kyc": { "output": { "verdict": verdict } } } });
        let j = t
            .judge("c", &ctx("review"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(j.holds);
        assert_eq!(
            j.read,
            vec![
                ("input.n".to_owned(), json!(3)),
                ("steps.kyc.output.verdict".to_owned(), json!("review")),
            ]
        );
        assert!(!t.judge("c", &ctx("clear")).map(|j| j.holds).unwrap_or(true));
        // What may be missing is tested for; what is missing otherwise is
        // an error, never false.
        t.add_condition("d", "input.flag is defined and input.flag", &s)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !t.judge("d", &json!({ "input": {} }))
                .map(|j| j.holds)
                .unwrap_or(true)
        );
        t.add_condition("e", "input.flag", &s)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            t.judge("e", &json!({ "input": {} })),
            Err(TemplateError::Render(_))
        ));
        assert!(matches!(
            t.add_condition("f", "steps.other.output.x", &s),
            Err(TemplateError::NotUpstream(_))
        ));
        assert!(matches!(
            t.add_condition("g", "input.x ==", &s),
            Err(TemplateError::Syntax(_))
        ));
        // Bounded like a template.
        t.add_condition("h", "range(100000) | map('string') | join | length > 0", &s)
            .unwrap_or_else(|e| panic!("{e}"));
        let spun = t.judge("h", &json!({})).map_err(|e| e.to_string());
        assert!(spun.as_ref().is_err_and(|e| e.contains("fuel")), "{spun:?}");
    }

    fn quoted(quoting: Quoting, source: &str, input: Value) -> String {
        let mut t = Templates::new();
        let up = scope(&[]);
        let s = Scope {
            upstream: &up,
            job_id: true,
            output: false,
            quoting,
            item: false,
        };
        t.add("t", source, &s).unwrap_or_else(|e| panic!("{e}"));
        t.render("t", &json!({ "input": input, "job_id": "../../admin" }))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn an_input_cannot_add_a_field_to_a_json_body() {
        let evil = r#"x", "admin": true, "y": ""#;
        let body = quoted(
            Quoting::Json,
            r#"{"name": "{{ input.name }}", "n": {{ input.n }}, "raw": {{ input.obj | tojson }}, "own": {{ input.frag | raw }}}"#,
            json!({ "name": evil, "n": 3, "obj": { "a": "b\"" }, "frag": "[1, 2]" }),
        );
        let parsed: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(
            parsed,
            json!({ "name": evil, "n": 3, "raw": { "a": "b\"" }, "own": [1, 2] })
        );
        assert!(parsed.get("admin").is_none());
        // Control characters too: a newline in the input is `\n` in the body.
        let nl = quoted(
            Quoting::Json,
            r#"{"s": "{{ input.s }}"}"#,
            json!({ "s": "a\nb\\" }),
        );
        assert_eq!(nl, r#"{"s": "a\nb\\"}"#);
    }

    #[test]
    fn a_path_interpolation_is_one_segment() {
        assert_eq!(
            quoted(Quoting::Url, "/v1/jobs/{{ job_id }}", json!({})),
            "/v1/jobs/..%2F..%2Fadmin"
        );
        assert_eq!(
            quoted(
                Quoting::Url,
                "/find?q={{ input.q }}&x=1",
                json!({ "q": "a b&c=d#e?" })
            ),
            "/find?q=a%20b%26c%3Dd%23e%3F&x=1"
        );
        // Already encoded by the template: not encoded twice.
        assert_eq!(
            quoted(
                Quoting::Url,
                "/find?d={{ input.q | urlencode }}",
                json!({ "q": "a@b" })
            ),
            "/find?d=a%40b"
        );
        // A value of `.` or `..` would move the path: refused.
        for dots in [".", ".."] {
            let mut t = Templates::new();
            let up = scope(&[]);
            let s = Scope {
                upstream: &up,
                job_id: false,
                output: false,
                quoting: Quoting::Url,
                item: false,
            };
            t.add("t", "/v1/accounts/{{ input.a }}/refunds", &s)
                .unwrap_or_else(|e| panic!("{e}"));
            let e = t.render("t", &json!({ "input": { "a": dots } }));
            assert!(matches!(e, Err(TemplateError::Render(_))), "{dots}: {e:?}");
        }
        // Meant whole: `raw`.
        assert_eq!(
            quoted(Quoting::Url, "/{{ input.p | raw }}", json!({ "p": "a/b" })),
            "/a/b"
        );
        assert_eq!(
            quoted(Quoting::Text, "{{ input.h }}", json!({ "h": "a b/\"c" })),
            "a b/\"c"
        );
    }

    #[test]
    fn a_body_is_quoted_for_its_content_type() {
        assert_eq!(Quoting::of_body(None), Quoting::Json);
        assert_eq!(
            Quoting::of_body(Some("application/json; charset=utf-8")),
            Quoting::Json
        );
        assert_eq!(
            Quoting::of_body(Some("application/vnd.api+json")),
            Quoting::Json
        );
        assert_eq!(
            Quoting::of_body(Some("application/x-www-form-urlencoded")),
            Quoting::Url
        );
        assert_eq!(Quoting::of_body(Some("text/plain")), Quoting::Text);
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let mut t = Templates::new();
        let up = scope(&[]);
        let s = Scope {
            upstream: &up,
            job_id: false,
            output: false,
            quoting: Quoting::Url,
            item: false,
        };
        t.add(
            "spin",
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            &s,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            t.render("spin", &json!({})),
            Err(TemplateError::Render(_))
        ));
    }

    proptest! {
        #[test]
        fn any_source_is_accepted_or_refused_never_panics(src in ".{0,60}") {
            let mut t = Templates::new();
            let up = scope(&["a"]);
            if t.add("x", &src, &Scope { upstream: &up, job_id: true, output: true, quoting: Quoting::Json, item: false }).is_ok() {
                let _ = t.render("x", &json!({ "input": {}, "steps": {}, "record": {}, "job_id": "j" }));
            }
        }
    }
}

#[cfg(test)]
mod view_tests {
    use super::*;
    use serde_json::json;

    /// A step's view of the pass's context renders as the JSON context it
    /// stands for (only its upstream steps' outputs, its key beside).
    #[test]
    fn a_view_renders_as_the_context_it_stands_for() {
        let ctx = json!({
            "input": { "amount": 5, "items": [1, 2.5, "x"], "nested": { "a": null } },
            "record": { "id": 7, "key": "k" },
            "steps": { "a": { "output": { "x": "y" } }, "b": { "output": 1 } },
        });
        let whole = json!({
            "input": ctx["input"],
            "record": ctx["record"],
            "steps": { "a": ctx["steps"]["a"] },
            "key": "k1",
        });
        let pass = std::sync::Arc::new(PassContext::new(ctx));
        let up: BTreeSet<String> = ["a".to_owned()].into();
        let mut strict = Environment::new();
        strict.set_undefined_behavior(UndefinedBehavior::Strict);
        for env in [Environment::new(), strict] {
            for t in [
                "{{ input.amount }} {{ record.id }} {{ steps.a.output.x }} {{ key }}",
                "{{ steps.b is defined }} {{ steps | length }} {{ input.items | length }}",
                "{{ input | tojson }} {{ steps | tojson }} {{ input.nested }}",
                "{% for k in steps %}{{ k }}{% endfor %} {{ input.items[1] }}",
                "{% for k, v in steps | items %}{{ k }}={{ v.output.x }}{% endfor %}",
                "{{ record | tojson }} {{ nothing is defined }} {{ steps.a is defined }}",
                "{{ nothing }}",
                "{{ steps.b.output }}",
            ] {
                let view = pass.view(&up, vec![("key", value_of(&json!("k1")))]);
                assert_eq!(
                    env.render_str(t, view).map_err(|e| e.kind()),
                    env.render_str(t, value_of(&whole)).map_err(|e| e.kind()),
                    "{t}"
                );
            }
        }
    }

    /// A context without `steps` shows none, whatever is upstream.
    #[test]
    fn a_view_of_a_context_without_steps_has_none() {
        let whole = json!({ "input": { "a": 1 } });
        let pass = std::sync::Arc::new(PassContext::new(whole.clone()));
        let up: BTreeSet<String> = ["a".to_owned()].into();
        let view = pass.view(&up, Vec::new());
        let env = Environment::new();
        let t = "{{ steps is defined }} {{ input.a }}";
        let rendered = env.render_str(t, view).unwrap();
        assert_eq!(rendered, env.render_str(t, value_of(&whole)).unwrap());
        assert!(rendered.ends_with(" 1"), "{rendered}");
    }
}
