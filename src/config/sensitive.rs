//! Sensitive fields in the configuration: a pipeline's (JSON pointers into
//! a record's `input` and its steps' outputs) and a provider's (pointers
//! into its replies), each a pointer or `{ pointer, keep_last }`; and the
//! rules a pipeline's records are masked by, the providers' carried over
//! to the step outputs taken from those reply fields (`domain::mask`).

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
    /// What records of `pipeline` are masked by: its own fields, and the
    /// step outputs its steps take from a provider's sensitive reply
    /// fields (an output at or inside one is sensitive whole; one holding
    /// one, at that place). A pipeline this configuration does not know
    /// (a node that does not run it) is masked whole: its input and every
    /// output.
    pub fn sensitive_rules(&self, pipeline: &str) -> Vec<Rule> {
        let Some(p) = self.pipelines.get(pipeline) else {
            let whole = |p: &str| Rule::parse(p, 0).ok();
            return ["/input", "/steps/*/output"]
                .into_iter()
                .filter_map(whole)
                .collect();
        };
        let mut out = rules(&p.sensitive);
        for step in &p.steps {
            let Some(provider) = self.providers.get(&step.provider) else {
                continue;
            };
            for reply in rules(&provider.sensitive) {
                for (name, pointer) in &step.outputs {
                    let Ok(taken) = Rule::parse(pointer, 0) else {
                        continue;
                    };
                    let mut at = vec!["steps".into(), step.name.clone(), "output".into()];
                    // A step for each item: its output lists the items'.
                    if step.for_each.is_some() {
                        at.push("*".into());
                    }
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
    }
}
