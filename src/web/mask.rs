//! Sensitive fields shown masked (`domain::mask`) to a caller without the
//! `unmask` permission: a record's input and step outputs (current,
//! replaced and per item) by the rules of its pipeline (every value, for a
//! pipeline this node does not know), and every text kept of it (requests
//! and reply excerpts, reasons, event details) scrubbed of the values
//! those held, whenever that text was kept.

use std::sync::Arc;

use crate::domain::mask::{self, Rule, Scrubber};
use crate::domain::{Attempt, Event, Intent, Record, StepRun, StepVersion};
use crate::web::AppState;
use crate::web::auth::Caller;
use crate::web::error::{WebError, WebResult};

/// How one record is shown to one caller: `None` of [`Shown::of`] when in
/// clear (the caller may unmask, or the pipeline has no sensitive field).
pub struct Shown {
    rules: Vec<Rule>,
    /// The record's sensitive values, read before masking.
    values: Arc<Scrubber>,
}

impl Shown {
    /// The masking of records of `pipeline` for `caller`, with no values
    /// read yet ([`Shown::record`] reads them).
    pub fn of(state: &AppState, caller: &Caller, pipeline: &str) -> Option<Shown> {
        if caller.unmask {
            return None;
        }
        let rules = state.config.get().sensitive_rules(pipeline);
        (!rules.is_empty()).then(|| Shown {
            rules,
            values: Arc::new(Scrubber::new(Vec::new())),
        })
    }

    /// Masks `rec`'s input, its steps' outputs and their replaced
    /// versions, noting the sensitive values all of them held (for the
    /// texts, [`Shown::text`]); and the reasons.
    pub fn record(&mut self, rec: &mut Record, runs: &mut [StepRun], versions: &mut [StepVersion]) {
        let mut found = mask::record(&self.rules, rec, runs);
        for v in versions.iter_mut() {
            let rules = self.under(&v.step);
            if let Some(out) = v.output.as_mut() {
                found.extend(mask::values(out, &rules));
                mask::apply(out, &rules);
            }
        }
        self.values = Arc::new(Scrubber::new(found));
        rec.reason = rec.reason.as_deref().map(|r| self.text(r));
        for r in runs.iter_mut() {
            r.reason = r.reason.as_deref().map(|t| self.text(t));
        }
    }

    /// The rules under `/steps/<step>/output`, rebased on the output of a
    /// run named `name`: a step's, or an item's (`STEP#N`: one element of
    /// the step's).
    fn under(&self, name: &str) -> Vec<Rule> {
        let (step, item) = match crate::domain::each::item_of(name) {
            Some((step, _)) => (step, true),
            None => (name, false),
        };
        self.rules
            .iter()
            .filter_map(|r| {
                let s = r.segments();
                let own = s.len() >= 3 && s[0] == "steps" && (s[1] == step || s[1] == "*");
                if !(own && s[2] == "output") {
                    return None;
                }
                let rest = match item {
                    false => &s[3..],
                    // A rule on the whole output covers every item.
                    true => s.get(4..).unwrap_or(&[]),
                };
                Some(r.at(rest.to_vec()))
            })
            .collect()
    }

    /// Masks the outputs of a step's items.
    pub fn items(&self, items: &mut [StepRun]) {
        for i in items {
            let rules = self.under(&i.step);
            if let Some(out) = i.output.as_mut() {
                mask::apply(out, &rules);
                self.values.json(out);
            }
            i.reason = i.reason.as_deref().map(|t| self.text(t));
        }
    }

    /// `text` with the record's sensitive values masked.
    pub fn text(&self, text: &str) -> String {
        self.values.clean(text)
    }

    /// Masks what attempts kept (requests and excerpts kept before a field
    /// was declared sensitive included).
    pub fn attempts(&self, attempts: &mut [Attempt]) {
        for a in attempts {
            if let Some(e) = &a.excerpt {
                a.excerpt = Some(self.text(e));
            }
            if let Some(r) = &mut a.request {
                self.request(r);
            }
        }
    }

    /// Masks the requests of calls still out.
    pub fn intents(&self, intents: &mut [Intent]) {
        for i in intents {
            if let Some(r) = &mut i.request {
                self.request(r);
            }
        }
    }

    fn request(&self, r: &mut crate::domain::request::SentRequest) {
        r.url = self.text(&r.url);
        for (_, v) in &mut r.headers {
            *v = self.text(v);
        }
        if let Some(b) = &r.body {
            r.body = Some(self.values.body(b));
        }
    }

    /// Masks the record's events: an input edit by the pipeline's rules,
    /// and every value anywhere in a detail (outputs an operator gave, a
    /// delivery's body) or a reason.
    pub fn events(&self, events: &mut [Event]) {
        for e in events {
            if let Some(edit) = e.detail.as_mut().and_then(|d| d.get_mut("input")) {
                for side in ["old", "new"] {
                    if let Some(v) = edit.get_mut(side) {
                        let mut ctx = serde_json::json!({ "input": v.take() });
                        mask::apply(&mut ctx, &self.rules);
                        *v = ctx["input"].take();
                    }
                }
            }
            if let Some(d) = e.detail.as_mut() {
                // A delivery's or a reply's body: whatever fields it holds.
                for key in ["callback", "reply"] {
                    if let Some(v) = d.get_mut(key) {
                        *v = mask::mask_value(v, 0);
                    }
                }
                self.values.json(d);
            }
            e.reason = e.reason.as_deref().map(|r| self.text(r));
        }
    }
}

/// The keys of an audit entry's detail that carry a record's data: an
/// input edit, outputs an operator gave, a delivery's or a reply's body.
const DATA_KEYS: [&str; 4] = ["input", "output", "callback", "reply"];

/// Masks audit entries' record data whole (`DATA_KEYS`) for a caller
/// without `unmask`, unless no pipeline here has a sensitive field (the
/// audit log lists entries of every record; a node that runs no pipeline
/// knows none, and masks).
pub fn event_details(state: &AppState, caller: &Caller, events: &mut [Event]) {
    if caller.unmask {
        return;
    }
    let config = state.config.get();
    let none = !config.pipelines.is_empty()
        && config
            .pipelines
            .keys()
            .all(|p| config.sensitive_rules(p).is_empty());
    if none {
        return;
    }
    for d in events.iter_mut().filter_map(|e| e.detail.as_mut()) {
        for key in DATA_KEYS {
            if let Some(v) = d.get_mut(key) {
                *v = mask::mask_value(v, 0);
            }
        }
    }
}

/// Refuses an edit of a record's input by a caller who sees some of it
/// masked (the edit would write masks over the values).
pub fn may_edit(state: &AppState, caller: &Caller, pipeline: &str) -> WebResult<()> {
    let Some(shown) = Shown::of(state, caller, pipeline) else {
        return Ok(());
    };
    let input = shown.rules.iter().any(|r| {
        r.segments()
            .first()
            .is_none_or(|s| s == "input" || s == "*")
    });
    match input {
        false => Ok(()),
        true => Err(WebError::bad(
            "unmask_needed",
            "this record's input holds sensitive fields you see masked: editing it needs the \
             unmask permission",
        )),
    }
}

/// Masks records shown in a list (their input and reason) for `caller`.
pub fn list(state: &AppState, caller: &Caller, records: &mut [Record]) {
    if caller.unmask {
        return;
    }
    let config = state.config.get();
    let mut rules: std::collections::BTreeMap<String, Vec<Rule>> = Default::default();
    for r in records {
        let rules = rules
            .entry(r.pipeline.clone())
            .or_insert_with(|| config.sensitive_rules(&r.pipeline));
        if !rules.is_empty() {
            let values = Scrubber::new(mask::record(rules, r, &mut []));
            r.reason = r.reason.as_deref().map(|t| values.clean(t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An item's run is named `STEP#N`: it is masked by its step's rules
    /// on one element of the step's output.
    #[test]
    fn items_are_masked_by_their_steps_rules() {
        let rules = ["/steps/each/output/*/ssn", "/steps/whole/output"]
            .map(|p| Rule::parse(p, 0).unwrap())
            .to_vec();
        let shown = Shown {
            rules,
            values: Arc::new(Scrubber::new(Vec::new())),
        };
        let joined = |name: &str| -> Vec<String> {
            shown
                .under(name)
                .iter()
                .map(|r| r.segments().join("/"))
                .collect()
        };
        assert_eq!(joined("each#3"), ["ssn"]);
        assert_eq!(joined("each"), ["*/ssn"]);
        assert_eq!(joined("whole#0"), [""]);
        assert!(joined("other#1").is_empty());
    }
}
