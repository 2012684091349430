//! Sensitive fields in the configuration: a pipeline's (JSON pointers into
//! a record's `input` and its steps' outputs) and a provider's (pointers
//! into its replies), each a pointer or `{ pointer, keep_last }`; and the
//! rules a pipeline's records are masked by, the providers' carried over
//! to the step outputs taken from those reply fields (`domain::mask`).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError};
use crate::domain::mask::{Rule, starts_with};

/// `"/input/ssn"` or `{ pointer = "/input/ssn", keep_last = 4 }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum SensitiveField {
    Pointer(String),
    Kept {
        pointer: String,
        #[serde(default)]
        keep_last: usize,
    },
}

impl SensitiveField {
    /// Its rule, or why it cannot be one.
    pub fn rule(&self) -> Result<Rule, String> {
        match self {
            SensitiveField::Pointer(p) => Rule::parse(p, 0),
            SensitiveField::Kept { pointer, keep_last } => Rule::parse(pointer, *keep_last),
        }
    }
}

/// The rules of `fields` (checked at load: one that cannot be is left
/// out).
fn rules(fields: &[SensitiveField]) -> Vec<Rule> {
    fields.iter().filter_map(|f| f.rule().ok()).collect()
}

impl Config {
    /// Whether nothing of `pipeline`'s records is masked: it is known and
    /// no pipeline or provider names a sensitive field (so
    /// [`sensitive_rules`](Self::sensitive_rules) and
    /// [`reply_rules`](Self::reply_rules) are empty for it), found without
    /// building either: what every call asks first.
    pub fn masks_nothing(&self, pipeline: &str) -> bool {
        self.pipelines.contains_key(pipeline)
            && self.pipelines.values().all(|p| p.sensitive.is_empty())
            && self.providers.values().all(|p| p.sensitive.is_empty())
    }

    /// What records of `pipeline` are masked by: its own fields; the input
    /// fields of the pipelines that start it with their own input (a
    /// `pipeline` step without an `input` template), however far up; the
    /// step outputs its steps take from a provider's sensitive reply fields
    /// (an output at or inside one is sensitive whole; one holding one, at
    /// that place); and its children's sensitive outputs, which its
    /// `pipeline` steps' outputs hold. A pipeline this configuration does
    /// not know (a node that does not run it) is masked whole: its input
    /// and every output.
    pub fn sensitive_rules(&self, pipeline: &str) -> Vec<Rule> {
        if !self.pipelines.contains_key(pipeline) {
            let whole = |p: &str| Rule::parse(p, 0).ok();
            return ["/input", "/steps/*/output"]
                .into_iter()
                .filter_map(whole)
                .collect();
        }
        let mut out = self.input_rules(pipeline, &mut BTreeSet::new());
        out.extend(self.output_rules(pipeline, &mut BTreeSet::new()));
        out
    }

    /// `pipeline`'s settings, the first time a walk (`seen`) reaches it
    /// (a cycle of child pipelines is walked once).
    fn first_visit(
        &self,
        pipeline: &str,
        seen: &mut BTreeSet<String>,
    ) -> Option<&super::pipeline::PipelineConfig> {
        self.pipelines
            .get(pipeline)
            .filter(|_| seen.insert(pipeline.into()))
    }

    /// `pipeline`'s `/input` fields, its own and its parents'.
    fn input_rules(&self, pipeline: &str, seen: &mut BTreeSet<String>) -> Vec<Rule> {
        let Some(p) = self.first_visit(pipeline, seen) else {
            return Vec::new();
        };
        let is_input = |r: &Rule| r.segments().first().is_some_and(|s| s == "input");
        let mut out: Vec<Rule> = rules(&p.sensitive).into_iter().filter(is_input).collect();
        for (name, parent) in &self.pipelines {
            let starts = parent.steps.iter().any(|s| {
                s.pipeline.as_deref() == Some(pipeline) && s.input.is_none() && s.for_each.is_none()
            });
            if starts {
                out.extend(self.input_rules(name, &mut seen.clone()));
            }
        }
        out
    }

    /// `pipeline`'s step-output fields: its own, those taken from its
    /// providers' sensitive reply fields, and its children's.
    fn output_rules(&self, pipeline: &str, seen: &mut BTreeSet<String>) -> Vec<Rule> {
        let Some(p) = self.first_visit(pipeline, seen) else {
            return Vec::new();
        };
        let is_output = |r: &Rule| r.segments().first().is_some_and(|s| s != "input");
        let mut out: Vec<Rule> = rules(&p.sensitive).into_iter().filter(is_output).collect();
        for step in &p.steps {
            // Where the step's output starts: a step for each item lists
            // its items' outputs.
            let mut base = vec!["steps".to_owned(), step.name.clone(), "output".into()];
            if step.for_each.is_some() {
                base.push("*".into());
            }
            if let Some(child) = &step.pipeline {
                // A child's output is `{ <its step>: <that step's output> }`.
                // (A path's own set: two steps may start one child.)
                for r in self.output_rules(child, &mut seen.clone()) {
                    let s = r.segments();
                    if s.len() >= 3 && s[0] == "steps" && s[2] == "output" {
                        let mut at = base.clone();
                        at.push(s[1].clone());
                        at.extend(s[3..].iter().cloned());
                        out.push(r.at(at));
                    }
                }
            }
            let Some(provider) = self.providers.get(&step.provider) else {
                continue;
            };
            for reply in rules(&provider.sensitive) {
                for (name, pointer) in &step.outputs {
                    let Ok(taken) = Rule::parse(pointer, 0) else {
                        continue;
                    };
                    let mut at = base.clone();
                    at.push(name.clone());
                    if starts_with(reply.segments(), taken.segments()) {
                        at.extend(reply.segments()[taken.segments().len()..].iter().cloned());
                        out.push(reply.at(at));
                    } else if starts_with(taken.segments(), reply.segments()) {
                        out.push(reply.at(at));
                    }
                }
            }
        }
        out
    }

    /// What a reply to `step` of `pipeline` from `provider` is masked by:
    /// the provider's sensitive fields, and the reply fields the step
    /// takes outputs from that the pipeline declares sensitive.
    pub fn reply_rules(&self, pipeline: &str, step: &str, provider: &str) -> Vec<Rule> {
        let mut out = self
            .providers
            .get(provider)
            .map(|p| rules(&p.sensitive))
            .unwrap_or_default();
        let Some(p) = self.pipelines.get(pipeline) else {
            return out;
        };
        let Some(s) = p.steps.iter().find(|s| s.name == step) else {
            return out;
        };
        let skip = 3 + usize::from(s.for_each.is_some());
        for r in rules(&p.sensitive) {
            let seg = r.segments();
            let own = seg.len() >= 3 && seg[0] == "steps" && (seg[1] == step || seg[1] == "*");
            if !own || seg[2] != "output" {
                continue;
            }
            for (name, pointer) in &s.outputs {
                let Ok(taken) = Rule::parse(pointer, 0) else {
                    continue;
                };
                match seg.get(skip) {
                    // The whole output: every field it takes.
                    None => out.push(r.at(taken.segments().to_vec())),
                    Some(n) if n == name || n == "*" => {
                        let mut at = taken.segments().to_vec();
                        at.extend(seg[skip + 1..].iter().cloned());
                        out.push(r.at(at));
                    }
                    Some(_) => {}
                }
            }
        }
        out
    }

    /// Whether every sensitive field is a pointer, and a pipeline's point
    /// into `input` or one of its steps' `output`.
    pub(super) fn check_sensitive(&self) -> Result<(), ConfigError> {
        let invalid = |key: String, message: String| ConfigError::Invalid { key, message };
        for (name, p) in &self.providers {
            for f in &p.sensitive {
                f.rule()
                    .map_err(|m| invalid(format!("providers.{name}.sensitive"), m))?;
            }
        }
        for (name, p) in &self.pipelines {
            for f in &p.sensitive {
                let key = || format!("pipelines.{name}.sensitive");
                let rule = f.rule().map_err(|m| invalid(key(), m))?;
                let s = rule.segments();
                let ok = match s.first().map(String::as_str) {
                    Some("input") => true,
                    Some("steps") => {
                        s.len() >= 3
                            && s[2] == "output"
                            && (s[1] == "*" || p.steps.iter().any(|st| st.name == s[1]))
                    }
                    _ => false,
                };
                // A step for each item lists its items' outputs.
                let each = |name: &str| {
                    p.steps
                        .iter()
                        .any(|st| st.name == name && st.for_each.is_some())
                };
                if ok && s[0] == "steps" && each(&s[1]) && s.len() > 3 && s[3] != "*" {
                    let m = format!(
                        "{f:?}: step `{}` runs for each item and its output lists theirs: \
                         write `/steps/{}/output/*/{}`",
                        s[1],
                        s[1],
                        s[3..].join("/")
                    );
                    return Err(invalid(key(), m));
                }
                if !ok {
                    let m = format!(
                        "{f:?} names no field of a record: start with `/input/` or \
                         `/steps/<step>/output`"
                    );
                    return Err(invalid(key(), m));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `masks_nothing` (every call's first question) says so only where
    /// the rules it spares building are empty; a sensitive field of any
    /// pipeline or provider, or a pipeline not known here, is a no.
    #[test]
    fn masks_nothing_only_where_every_rule_is_empty() {
        let plain = r#"
[providers.kyc]
base_url = "http://k.example"
[pipelines.verify]
[[pipelines.verify.steps]]
name = "check"
provider = "kyc"
request = { method = "POST", path = "/c", body = '{}' }
outputs = { person = "/person" }
"#;
        let with = |provider: &str, pipeline: &str| {
            let text = plain
                .replace(
                    "[pipelines.verify]\n",
                    &format!("[pipelines.verify]\n{pipeline}"),
                )
                .replace(
                    "base_url = \"http://k.example\"\n",
                    &format!("base_url = \"http://k.example\"\n{provider}"),
                );
            Config::parse(&text, std::path::Path::new("s.toml")).unwrap()
        };
        let none = with("", "");
        assert!(none.masks_nothing("verify"));
        assert!(none.sensitive_rules("verify").is_empty());
        assert!(none.reply_rules("verify", "check", "kyc").is_empty());
        assert!(
            !none.masks_nothing("elsewhere"),
            "unknown here: masked whole"
        );
        // Another pipeline's field is enough (a parent's input may be its
        // child's): no short cut, the rules decide.
        let mut other = with("", "");
        let mut elsewhere = other.pipelines["verify"].clone();
        elsewhere.sensitive = vec![SensitiveField::Pointer("/input/ssn".into())];
        other.pipelines.insert("other".into(), elsewhere);
        assert!(!other.masks_nothing("verify"));
        for config in [
            with("sensitive = [\"/person/ssn\"]\n", ""),
            with("", "sensitive = [\"/input/ssn\"]\n"),
        ] {
            assert!(!config.masks_nothing("verify"));
            let rules = config.sensitive_rules("verify").len()
                + config.reply_rules("verify", "check", "kyc").len();
            assert!(rules > 0);
        }
    }

    #[test]
    fn a_providers_sensitive_reply_fields_follow_the_outputs_taken_from_them() {
        let text = r#"
[providers.kyc]
base_url = "http://k.example"
sensitive = ["/person/ssn", { pointer = "/document_url", keep_last = 3 }]

[pipelines.verify]
sensitive = [{ pointer = "/input/ssn", keep_last = 4 }]
[[pipelines.verify.steps]]
name = "check"
provider = "kyc"
request = { method = "POST", path = "/c", body = '{}' }
outputs = { doc = "/document_url", person = "/person", verdict = "/verdict" }
"#;
        let config = Config::parse(text, std::path::Path::new("s.toml")).unwrap();
        config.check_sensitive().unwrap();
        let rules = config.sensitive_rules("verify");
        let at: Vec<(String, usize)> = rules
            .iter()
            .map(|r| (r.segments().join("/"), r.keep_last))
            .collect();
        assert_eq!(
            at,
            [
                ("input/ssn".to_owned(), 4),
                ("steps/check/output/person/ssn".to_owned(), 0),
                ("steps/check/output/doc".to_owned(), 3),
            ]
        );
        // A child started with the parent's input has the parent's fields.
        let family = format!(
            "{text}\n[[pipelines.verify.steps]]\nname = \"more\"\nkind = \"pipeline\"\npipeline = \"child\"\n\
             [[pipelines.child.steps]]\nname = \"c\"\nprovider = \"kyc\"\n\
             request = {{ method = \"POST\", path = \"/c\", body = '{{}}' }}\n"
        );
        let config = Config::parse(&family, std::path::Path::new("s.toml")).unwrap();
        let child: Vec<String> = config
            .sensitive_rules("child")
            .iter()
            .map(|r| r.segments().join("/"))
            .collect();
        assert_eq!(child, ["input/ssn"]);
        // However far down; and a child's sensitive outputs are its
        // parent's step's.
        let deeper = format!(
            "{family}[[pipelines.child.steps]]\nname = \"grand\"\nkind = \"pipeline\"\npipeline = \"leaf\"\n\
             [[pipelines.leaf.steps]]\nname = \"l\"\nprovider = \"kyc\"\n\
             request = {{ method = \"POST\", path = \"/l\", body = '{{}}' }}\noutputs = {{ who = \"/person\" }}\n"
        );
        let config = Config::parse(&deeper, std::path::Path::new("s.toml")).unwrap();
        let joined = |p: &str| -> Vec<String> {
            config
                .sensitive_rules(p)
                .iter()
                .map(|r| r.segments().join("/"))
                .collect()
        };
        assert_eq!(joined("leaf"), ["input/ssn", "steps/l/output/who/ssn"]);
        assert!(
            joined("verify").contains(&"steps/more/output/grand/l/who/ssn".to_owned()),
            "{:?}",
            joined("verify")
        );
        let config = Config::parse(text, std::path::Path::new("s.toml")).unwrap();
        // Unknown here: masked whole.
        assert_eq!(config.sensitive_rules("nope").len(), 2);
        // A reply is masked where the pipeline's outputs come from.
        let reply: Vec<String> = config
            .reply_rules("verify", "check", "kyc")
            .iter()
            .map(|r| r.segments().join("/"))
            .collect();
        assert_eq!(reply, ["person/ssn", "document_url"]);
        let text_out = text.replace(
            "sensitive = [{ pointer = \"/input/ssn\", keep_last = 4 }]",
            "sensitive = [\"/steps/check/output/verdict\"]",
        );
        let config = Config::parse(&text_out, std::path::Path::new("s.toml")).unwrap();
        let reply: Vec<String> = config
            .reply_rules("verify", "check", "kyc")
            .iter()
            .map(|r| r.segments().join("/"))
            .collect();
        assert_eq!(reply, ["person/ssn", "document_url", "verdict"]);
        let bad = text.replace("/input/ssn", "/record/ssn");
        let config = Config::parse(&bad, std::path::Path::new("s.toml")).unwrap();
        let e = config.check_sensitive().unwrap_err().to_string();
        assert!(
            e.contains("pipelines.verify.sensitive") && e.contains("/input/"),
            "{e}"
        );
        let bad = text.replace("/input/ssn", "/steps/nope/output/x");
        let config = Config::parse(&bad, std::path::Path::new("s.toml")).unwrap();
        assert!(config.check_sensitive().is_err());
        // A step for each item: its output is a list.
        let each = text
            .replace("/input/ssn", "/steps/check/output/doc")
            .replace("outputs = {", "for_each = \"/input/people\"\noutputs = {");
        let config = Config::parse(&each, std::path::Path::new("s.toml")).unwrap();
        let e = config.check_sensitive().unwrap_err().to_string();
        assert!(e.contains("/steps/check/output/*/doc"), "{e}");
    }
}
