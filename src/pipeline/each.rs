//! A step's `for_each`, `max_parallel` and `items_required`, checked and
//! compiled (`domain::each` runs them).

use std::collections::BTreeSet;

use crate::config::pipeline::{ItemsRequired, StepConfig};
use crate::domain::each::{Each, MAX_PARALLEL};
use crate::domain::kind::Kind;

/// The field at fault and why, for a step's key.
type Refusal = (&'static str, String);

/// The step's `for_each`, compiled, when it has one; refuses the
/// settings that need it without it, a kind that cannot run once per
/// item, and a list read from a step it does not need.
pub(super) fn compile(
    s: &StepConfig,
    kind: &dyn Kind,
    upstream: &BTreeSet<String>,
) -> Result<Option<Each>, Refusal> {
    let Some(pointer) = &s.for_each else {
        let given = [
            ("max_parallel", s.max_parallel.is_some()),
            ("items_required", s.items_required.is_some()),
        ];
        return match given.iter().find(|(_, set)| *set) {
            Some((field, _)) => Err((
                field,
                format!("`{field}` belongs to a step for each item: give `for_each` too"),
            )),
            None => Ok(None),
        };
    };
    if !kind.for_each() {
        return Err((
            "for_each",
            format!(
                "a `{}` step cannot run once per item (only `request`, `submit_poll` and `pipeline` steps can)",
                kind.name()
            ),
        ));
    }
    for (field, set) in [("confirm", s.confirm.is_some()), ("undo", s.undo.is_some())] {
        if set {
            return Err((
                field,
                format!("a step for each item takes no `{field}` (not supported yet)"),
            ));
        }
    }
    check_source(pointer, upstream).map_err(|m| ("for_each", m))?;
    let max_parallel = s.items_at_once();
    if !(1..=MAX_PARALLEL).contains(&max_parallel) {
        return Err((
            "max_parallel",
            format!("{max_parallel}: from 1 to {MAX_PARALLEL} items at once"),
        ));
    }
    let required = match &s.items_required {
        None => None,
        Some(ItemsRequired::Word(w)) if w == "all" => None,
        Some(ItemsRequired::Count(n)) if *n > 0 => Some(*n),
        Some(other) => {
            let given = match other {
                ItemsRequired::Word(w) => format!("`{w}`"),
                ItemsRequired::Count(n) => n.to_string(),
            };
            return Err((
                "items_required",
                format!("{given}: `\"all\"` or how many items must succeed (from 1)"),
            ));
        }
    };
    Ok(Some(Each {
        pointer: pointer.clone(),
        max_parallel,
        required,
    }))
}

/// A `for_each` names a list in the record's input or in the output of a
/// step this one needs.
fn check_source(pointer: &str, upstream: &BTreeSet<String>) -> Result<(), String> {
    let mut parts = pointer.split('/');
    let first = parts.next();
    match (first, parts.next(), parts.next(), parts.next()) {
        (Some(""), Some("input"), ..) => Ok(()),
        (Some(""), Some("steps"), Some(step), Some("output")) if upstream.contains(step) => Ok(()),
        (Some(""), Some("steps"), Some(step), Some("output")) => Err(format!(
            "`{pointer}` reads step `{step}`, which this step does not need (add it to `needs`)"
        )),
        _ => Err(format!(
            "`{pointer}`: a JSON pointer into the input (`/input/...`) or a needed step's \
             output (`/steps/NAME/output/...`)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_read_from_the_input_or_a_needed_output() {
        let up: BTreeSet<String> = ["split".to_owned()].into();
        assert!(check_source("/input/chunks", &up).is_ok());
        assert!(check_source("/input", &up).is_ok());
        assert!(check_source("/steps/split/output/parts", &up).is_ok());
        assert!(check_source("/steps/split/output", &up).is_ok());
        let not_needed = check_source("/steps/other/output/x", &up).unwrap_err();
        assert!(not_needed.contains("does not need"), "{not_needed}");
        for bad in ["input/chunks", "/record/id", "/steps/split/job", ""] {
            assert!(check_source(bad, &up).is_err(), "{bad}");
        }
    }
}
