//! Request templates (minijinja): URL paths, headers and bodies rendered
//! over `input`, `steps.<name>.output`, `record`, `key` (the step's stable
//! key) and, for polls, `job_id`; a confirmation's also over `output`.
//! Undefined variables are errors, never empty strings, and rendering is
//! bounded by fuel so a template cannot spin.

use std::collections::BTreeSet;

use minijinja::{AutoEscape, Environment, UndefinedBehavior, Value as TplValue};
use serde_json::Value;

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

/// Every request template of the loaded pipelines.
pub struct Templates {
    env: Environment<'static>,
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
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        // Bodies are JSON or plain text: quoting is `tojson`'s job, not HTML's.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_fuel(Some(FUEL));
        Templates { env }
    }

    /// Parses `source` as template `id` and checks what it refers to.
    pub fn add(&mut self, id: &str, source: &str, scope: &Scope<'_>) -> Result<(), TemplateError> {
        self.env
            .add_template_owned(id.to_owned(), source.to_owned())
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        let tpl = self
            .env
            .get_template(id)
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        let mut vars: Vec<String> = tpl.undeclared_variables(true).into_iter().collect();
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
                root if self.env.globals().any(|(g, _)| g == root) => {}
                "job_id" if scope.job_id => {}
                "output" if scope.output => {}
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

    /// Renders template `id` over `ctx` (a JSON object).
    pub fn render(&self, id: &str, ctx: &Value) -> Result<String, TemplateError> {
        let tpl = self
            .env
            .get_template(id)
            .map_err(|_| TemplateError::Missing(id.to_owned()))?;
        tpl.render(TplValue::from(minijinja::value::Serde(ctx)))
            .map_err(|e| TemplateError::Render(e.to_string()))
    }
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
        };
        assert!(
            t.add("g", "/v1/charges/{{ output.id }}", &confirming)
                .is_ok()
        );
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let mut t = Templates::new();
        let up = scope(&[]);
        let s = Scope {
            upstream: &up,
            job_id: false,
            output: false,
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
            if t.add("x", &src, &Scope { upstream: &up, job_id: true, output: true }).is_ok() {
                let _ = t.render("x", &json!({ "input": {}, "steps": {}, "record": {}, "job_id": "j" }));
            }
        }
    }
}
