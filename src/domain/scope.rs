//! Which pipelines a user or an API token may see and act on: every one,
//! or those whose names match one of a list of patterns (`lead-*`: `*`
//! stands for any run of characters). Records of other pipelines are not
//! there for it: not listed, not counted, not found (404).

use std::fmt;

use super::Role;

/// The most patterns one scope holds.
pub const MAX_PATTERNS: usize = 50;

/// A scope: empty is every pipeline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope(Vec<String>);

impl Scope {
    /// Every pipeline.
    pub fn all() -> Scope {
        Scope(Vec::new())
    }

    /// A scope from its written form: patterns separated by commas
    /// (spaces around them ignored); empty or `*` is every pipeline.
    pub fn parse(text: &str) -> Result<Scope, String> {
        let mut patterns: Vec<String> = Vec::new();
        let mut every = false;
        for p in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if p.len() > 200 || p.chars().any(char::is_control) {
                return Err(format!("`{p}` is not a pipeline name or pattern"));
            }
            every |= p == "*";
            if !patterns.iter().any(|q| q == p) {
                patterns.push(p.to_owned());
            }
        }
        if patterns.len() > MAX_PATTERNS {
            return Err(format!("at most {MAX_PATTERNS} pipelines or patterns"));
        }
        match every {
            true => Ok(Scope::all()),
            false => Ok(Scope(patterns)),
        }
    }

    /// No pipeline: what a user whose groups no longer grant anything
    /// keeps (stored as the one empty pattern, which no pipeline has).
    pub fn none() -> Scope {
        Scope(vec![String::new()])
    }

    /// Whether it is [`none`](Self::none).
    pub fn is_none(&self) -> bool {
        self.0.len() == 1 && self.0[0].is_empty()
    }

    /// Whether it is every pipeline.
    pub fn is_all(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether records of `pipeline` are within it.
    pub fn allows(&self, pipeline: &str) -> bool {
        self.is_all() || self.0.iter().any(|p| matches(p, pipeline))
    }

    /// Its patterns (none: every pipeline).
    pub fn patterns(&self) -> &[String] {
        &self.0
    }

    /// How it is stored: `None` for every pipeline, else the patterns
    /// joined by commas.
    pub fn stored(&self) -> Option<String> {
        (!self.is_all()).then(|| self.0.join(","))
    }

    /// The scope a stored column holds (`None`: every pipeline). A column
    /// that names no pattern (never written so) is read as no pipeline,
    /// never as every one.
    pub fn from_stored(column: Option<&str>) -> Scope {
        let Some(text) = column else {
            return Scope::all();
        };
        let patterns: Vec<String> = text
            .split(',')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect();
        match patterns.is_empty() {
            // The empty pattern matches only a pipeline without a name.
            true => Scope(vec![String::new()]),
            false => Scope(patterns),
        }
    }

    /// The pipelines of `names` within it, for a query: `None` when it is
    /// every pipeline (no condition).
    pub fn within<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Option<Vec<String>> {
        if self.is_all() {
            return None;
        }
        let mut within: Vec<String> = names
            .into_iter()
            .filter(|n| self.allows(n))
            .map(str::to_owned)
            .collect();
        within.sort();
        within.dedup();
        Some(within)
    }

    /// Refuses a scope `role` cannot have: an admin manages users, tokens
    /// and the configuration of every pipeline, so an admin sees them all.
    pub fn check_role(&self, role: Role) -> Result<(), String> {
        match (role, self.is_all()) {
            (Role::Admin, false) => Err(
                "an admin sees every pipeline: limit a viewer or an operator to pipelines".into(),
            ),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.is_all(), self.is_none()) {
            (true, _) => f.write_str("all pipelines"),
            (_, true) => f.write_str("no pipeline"),
            _ => f.write_str(&self.0.join(", ")),
        }
    }
}

/// Whether `name` matches `pattern` (`*`: any run of characters, the
/// rest literal).
fn matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        // No `*`: the whole name.
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_names_with_stars_and_nothing_else() {
        let s = Scope::parse(" lead-*, verify-customer ,*-eu-*-x").unwrap();
        for yes in [
            "lead-",
            "lead-enrichment",
            "verify-customer",
            "a-eu-b-x",
            "-eu--x",
        ] {
            assert!(s.allows(yes), "{yes}");
        }
        for no in [
            "lead",
            "verify-customers",
            "xverify-customer",
            "a-eu-b-xy",
            "eu-x",
        ] {
            assert!(!s.allows(no), "{no}");
        }
        assert!(Scope::parse("").unwrap().is_all());
        assert!(Scope::parse("a, *").unwrap().is_all());
        assert!(Scope::parse("*, a\u{7}").is_err());
        assert!(Scope::all().allows("anything"));
        assert!(Scope::parse("a\nb").is_err());
        let many: Vec<String> = (0..=MAX_PATTERNS).map(|i| format!("p{i}")).collect();
        assert!(Scope::parse(&many.join(",")).is_err());
    }

    #[test]
    fn a_scope_is_stored_and_read_back_and_resolved_against_names() {
        let s = Scope::parse("b, a-*, b").unwrap();
        assert_eq!(s.stored().as_deref(), Some("b,a-*"));
        assert_eq!(Scope::from_stored(s.stored().as_deref()), s);
        assert_eq!(Scope::from_stored(None), Scope::all());
        for junk in ["", ","] {
            let none = Scope::from_stored(Some(junk));
            assert!(!none.is_all() && !none.allows("a") && !none.allows("*"));
        }
        assert_eq!(
            s.within(["c", "a-2", "b", "a-1", "b"]),
            Some(vec!["a-1".into(), "a-2".into(), "b".into()])
        );
        assert_eq!(Scope::all().within(["a"]), None);
        assert!(s.check_role(Role::Admin).is_err());
        assert!(s.check_role(Role::Operator).is_ok());
        assert!(Scope::all().check_role(Role::Admin).is_ok());
        assert_eq!(s.to_string(), "b, a-*");
    }
}
