//! Sensitive values: the fields a pipeline (JSON pointers into a record's
//! input and step outputs) or a provider (pointers into its replies)
//! declares sensitive, and their masks. A mask keeps a value's shape: its
//! letters and digits become `•`, its punctuation stays, and the last
//! characters stay where a suffix is configured (`•••-••-1234`); a long
//! value shows at most [`MAX_SHOWN`] characters of mask, so its length is
//! told only as a class. Numbers become masked strings; objects and lists
//! are masked leaf by leaf.
//!
//! Used at the source, before anything is kept for people (an attempt's
//! request and reply excerpt: by pointer in a JSON reply, and every
//! occurrence of a record's sensitive values in any text), and when a
//! record is shown to a caller without the `unmask` permission.

use serde_json::Value;

/// The most mask characters a value shows; a longer one ends in `…`.
pub const MAX_SHOWN: usize = 24;
/// Values shorter than this are not looked for in free text (they would
/// match noise); they are still masked where a pointer names them.
pub const MIN_SCRUBBED: usize = 4;
/// What stands for a masked character.
pub const DOT: char = '•';

/// One sensitive field: where it is (pointer segments; `*` stands for any
/// key or index) and how many trailing characters its mask keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    segments: Vec<String>,
    pub keep_last: usize,
}

impl Rule {
    /// A rule from a JSON pointer (`/input/ssn`, `/people/*/ssn`; `~1` and
    /// `~0` escape `/` and `~`; `""` is the whole document).
    pub fn parse(pointer: &str, keep_last: usize) -> Result<Rule, String> {
        if keep_last > 8 {
            return Err(format!("`{pointer}`: keep at most the last 8 characters"));
        }
        if pointer.is_empty() {
            // The whole document.
            return Ok(Rule {
                segments: Vec::new(),
                keep_last,
            });
        }
        let Some(rest) = pointer.strip_prefix('/') else {
            return Err(format!(
                "`{pointer}` is not a JSON pointer (it starts with `/`)"
            ));
        };
        if keep_last > 8 {
            return Err(format!("`{pointer}`: keep at most the last 8 characters"));
        }
        let segments = rest
            .split('/')
            .map(|s| s.replace("~1", "/").replace("~0", "~"))
            .collect();
        Ok(Rule {
            segments,
            keep_last,
        })
    }

    /// Its segments.
    pub fn segments(&self) -> &[String] {
        &self.segments
    }

    /// A rule at `segments` keeping what this one keeps.
    pub fn at(&self, segments: Vec<String>) -> Rule {
        Rule {
            segments,
            keep_last: self.keep_last,
        }
    }
}

/// Whether pointer segments `a` start with `prefix` (`*` matching any one
/// segment on either side).
pub fn starts_with(a: &[String], prefix: &[String]) -> bool {
    a.len() >= prefix.len()
        && a.iter()
            .zip(prefix)
            .all(|(x, y)| x == y || x == "*" || y == "*")
}

/// The mask of `text`, keeping its last `keep_last` characters (at most
/// half of them).
pub fn mask_text(text: &str, keep_last: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    let keep = keep_last.min(chars.len() / 2);
    let (hidden, kept) = chars.split_at(chars.len() - keep);
    let mut out: String = hidden
        .iter()
        .take(MAX_SHOWN)
        .map(|c| match c {
            // Punctuation that gives a value its shape, and never needs
            // escaping in JSON, a URL's path or a header.
            '-' | '.' | '@' | '/' | ':' | ' ' | '_' | '+' | '(' | ')' | ',' => *c,
            _ => DOT,
        })
        .collect();
    if hidden.len() > MAX_SHOWN {
        out.push('…');
    }
    out.extend(kept);
    out
}

/// The mask of a whole value: every string and number in it.
pub fn mask_value(v: &Value, keep_last: usize) -> Value {
    match v {
        Value::String(s) => Value::String(mask_text(s, keep_last)),
        Value::Number(n) => Value::String(mask_text(&n.to_string(), keep_last)),
        Value::Bool(_) => Value::String(DOT.to_string()),
        Value::Array(items) => {
            Value::Array(items.iter().map(|i| mask_value(i, keep_last)).collect())
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), mask_value(v, keep_last)))
                .collect(),
        ),
        Value::Null => Value::Null,
    }
}

/// Masks, in `root`, every value a rule names; true when any was there.
pub fn apply(root: &mut Value, rules: &[Rule]) -> bool {
    let mut any = false;
    for r in rules {
        any |= mask_at(root, &r.segments, r.keep_last);
    }
    any
}

fn mask_at(v: &mut Value, segments: &[String], keep: usize) -> bool {
    let Some((first, rest)) = segments.split_first() else {
        if v.is_null() {
            return false;
        }
        *v = mask_value(v, keep);
        return true;
    };
    match v {
        Value::Object(map) if first == "*" => map
            .values_mut()
            .fold(false, |any, c| mask_at(c, rest, keep) | any),
        Value::Object(map) => map.get_mut(first).is_some_and(|c| mask_at(c, rest, keep)),
        Value::Array(items) if first == "*" => items
            .iter_mut()
            .fold(false, |any, c| mask_at(c, rest, keep) | any),
        Value::Array(items) => first
            .parse::<usize>()
            .ok()
            .and_then(|i| items.get_mut(i))
            .is_some_and(|c| mask_at(c, rest, keep)),
        _ => false,
    }
}

/// Masks a record's input and its steps' outputs by `rules` (pointers
/// into `{input, steps: {<step>: {output}}}`); returns the sensitive
/// values they held, with their masks (for [`scrub`]).
pub fn record(
    rules: &[Rule],
    rec: &mut super::Record,
    runs: &mut [super::StepRun],
) -> Vec<(String, String)> {
    let mut steps = serde_json::Map::new();
    for r in runs.iter_mut() {
        let output = r.output.take().unwrap_or(Value::Null);
        steps.insert(r.step.clone(), serde_json::json!({ "output": output }));
    }
    let mut ctx = serde_json::json!({
        "input": std::mem::take(&mut rec.input),
        "steps": steps,
    });
    let found = values(&ctx, rules);
    apply(&mut ctx, rules);
    rec.input = ctx["input"].take();
    for r in runs.iter_mut() {
        let out = ctx["steps"][&r.step]["output"].take();
        r.output = (!out.is_null()).then_some(out);
    }
    found
}

/// The sensitive values of `root` as text, each with its mask; a value
/// named by several rules once, with its most masked mask.
pub fn values(root: &Value, rules: &[Rule]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for r in rules {
        collect(root, &r.segments, r.keep_last, &mut found);
    }
    dedup(found)
}

/// Values sorted by value, each once, with its most masked mask (the one
/// that keeps the fewest characters in clear).
fn dedup(mut found: Vec<(String, String)>) -> Vec<(String, String)> {
    let clear = |m: &str| m.chars().filter(|c| *c != DOT && *c != '…').count();
    found.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| clear(&a.1).cmp(&clear(&b.1))));
    found.dedup_by(|a, b| a.0 == b.0);
    found
}

fn collect(v: &Value, segments: &[String], keep: usize, out: &mut Vec<(String, String)>) {
    match (segments.split_first(), v) {
        (None, Value::String(s)) => out.push((s.clone(), mask_text(s, keep))),
        (None, Value::Number(n)) => {
            let s = n.to_string();
            let masked = mask_text(&s, keep);
            out.push((s, masked));
        }
        (None, Value::Array(items)) => items.iter().for_each(|i| collect(i, &[], keep, out)),
        (None, Value::Object(map)) => map.values().for_each(|c| collect(c, &[], keep, out)),
        (None, _) => {}
        (Some((first, rest)), Value::Object(map)) if first == "*" => {
            map.values().for_each(|c| collect(c, rest, keep, out));
        }
        (Some((first, rest)), Value::Object(map)) => {
            if let Some(c) = map.get(first) {
                collect(c, rest, keep, out);
            }
        }
        (Some((first, rest)), Value::Array(items)) if first == "*" => {
            items.iter().for_each(|c| collect(c, rest, keep, out));
        }
        (Some((first, rest)), Value::Array(items)) => {
            if let Some(c) = first.parse::<usize>().ok().and_then(|i| items.get(i)) {
                collect(c, rest, keep, out);
            }
        }
        (Some(_), _) => {}
    }
}

/// Everything but RFC 3986's unreserved characters (ALPHA, DIGIT and
/// `-._~`): how a template quotes a value in a URL (`pipeline::template`).
pub const URL_COMPONENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// What JavaScript's `encodeURIComponent` encodes.
const JS_COMPONENT: &percent_encoding::AsciiSet = &URL_COMPONENT
    .remove(b'!')
    .remove(b'\'')
    .remove(b'(')
    .remove(b')')
    .remove(b'*');

/// The ways a value may be spelt in a request or a reply: as it is; inside
/// a JSON string (serde's escapes, `\/`, and `\uXXXX` for every character
/// not alphanumeric, as minijinja's `tojson` and Python write them);
/// percent-encoded as a URL carries it (with `%20` or `+`, `/` kept or
/// not, hex upper or lower case).
fn spellings(clear: &str) -> Vec<String> {
    let encoded = percent_encoding::utf8_percent_encode(clear, URL_COMPONENT).to_string();
    let slash_kept = encoded.replace("%2F", "/");
    // JavaScript's encodeURIComponent leaves `!'()*` as they are.
    let js = percent_encoding::utf8_percent_encode(clear, JS_COMPONENT).to_string();
    let mut all = vec![
        clear.to_owned(),
        js,
        encoded.clone(),
        encoded.replace("%20", "+"),
        slash_kept.clone(),
        slash_kept.replace("%20", "+"),
    ];
    let lower: Vec<String> = all
        .iter()
        .filter(|s| s.contains('%'))
        .map(|s| lower_hex(s))
        .collect();
    all.extend(lower);
    all.sort();
    all.dedup();
    all
}

/// `%2F` as `%2f`: percent escapes with lower-case hex.
fn lower_hex(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let esc = rest.get(at..at + 3).unwrap_or(&rest[at..]);
        out.push_str(&esc.to_ascii_lowercase());
        rest = &rest[at + esc.len()..];
    }
    out.push_str(rest);
    out
}

/// A record's sensitive values, found in any text in one pass (however
/// many there are: a step for each of 10,000 items has as many), and in
/// JSON leaf by leaf.
pub struct Scrubber {
    /// Each value (short ones too), with its mask, sorted by value.
    values: Vec<(String, String)>,
    /// Every spelling of each value of [`MIN_SCRUBBED`] characters or
    /// more, longest first where they start together; `None`: none.
    automaton: Option<(aho_corasick::AhoCorasick, Vec<String>)>,
}

impl Scrubber {
    /// The scrubber of `values` (as [`values`] gives them).
    pub fn new(values: Vec<(String, String)>) -> Scrubber {
        let values = dedup(values);
        let mut patterns = Vec::new();
        let mut masks = Vec::new();
        for (clear, masked) in &values {
            if clear.chars().count() < MIN_SCRUBBED {
                continue;
            }
            for spelt in spellings(clear) {
                patterns.push(spelt);
                masks.push(masked.clone());
            }
        }
        let automaton = match patterns.is_empty() {
            true => None,
            false => aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&patterns)
                .ok()
                .map(|a| (a, masks)),
        };
        Scrubber { values, automaton }
    }

    /// Whether it has nothing to mask.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The values it masks, with their masks.
    pub fn values(&self) -> &[(String, String)] {
        &self.values
    }

    /// `text` with every spelling of a value masked; `None` when none is
    /// there.
    pub fn text(&self, text: &str) -> Option<String> {
        let (a, masks) = self.automaton.as_ref()?;
        let plain = a.is_match(text).then(|| a.replace_all(text, masks));
        let now = plain.as_deref().unwrap_or(text);
        if !now.contains('\\') {
            return plain;
        }
        // Inside JSON strings: escapes decoded (remembering where each
        // decoded byte came from), values found there, their raw spans
        // masked.
        let mut decoded = String::with_capacity(now.len());
        let mut origin = Vec::with_capacity(now.len() + 1);
        let mut i = 0;
        while i < now.len() {
            let (c, len) = super::model::json_char_at(now, i);
            origin.extend(std::iter::repeat_n(i, c.len_utf8()));
            decoded.push(c);
            i += len;
        }
        origin.push(now.len());
        let mut out = String::with_capacity(now.len());
        let mut done = 0;
        for m in a.find_iter(&decoded) {
            let (from, to) = (origin[m.start()], origin[m.end()]);
            if from < done {
                continue;
            }
            out.push_str(&now[done..from]);
            out.push_str(&masks[m.pattern().as_usize()]);
            done = to;
        }
        if done == 0 {
            return plain;
        }
        out.push_str(&now[done..]);
        Some(out)
    }

    /// `text`, masked where needed.
    pub fn clean(&self, text: &str) -> String {
        self.text(text).unwrap_or_else(|| text.to_owned())
    }

    /// A JSON value with each leaf that is a sensitive value masked (short
    /// values too), and values inside longer strings masked.
    pub fn json(&self, v: &mut Value) {
        match v {
            Value::String(s) => {
                if let Some(masked) = self.exact(s) {
                    *s = masked;
                } else if let Some(clean) = self.text(s) {
                    *s = clean;
                }
            }
            Value::Number(n) => {
                if let Some(masked) = self.exact(&n.to_string()) {
                    *v = Value::String(masked);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|i| self.json(i)),
            Value::Object(map) => map.values_mut().for_each(|i| self.json(i)),
            _ => {}
        }
    }

    /// The mask of `s` when it is a sensitive value.
    fn exact(&self, s: &str) -> Option<String> {
        let at = self
            .values
            .binary_search_by(|(c, _)| c.as_str().cmp(s))
            .ok()?;
        Some(self.values[at].1.clone())
    }

    /// A body as kept: a JSON one leaf by leaf (and written again), any
    /// other as text.
    pub fn body(&self, text: &str) -> String {
        if self.is_empty() {
            return text.to_owned();
        }
        match serde_json::from_str::<Value>(text) {
            Ok(mut v) => {
                self.json(&mut v);
                self.clean(&v.to_string())
            }
            Err(_) => self.clean(text),
        }
    }
}

/// `text` with every occurrence of a sensitive value masked (a
/// [`Scrubber`] for one use); `None` when none is there.
pub fn scrub(text: &str, values: &[(String, String)]) -> Option<String> {
    Scrubber::new(values.to_vec()).text(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_mask_keeps_shape_suffix_and_a_length_class() {
        assert_eq!(mask_text("123-45-6789", 4), "•••-••-6789");
        assert_eq!(mask_text("123-45-6789", 0), "•••-••-••••");
        // At most half is kept, however many are asked for.
        assert_eq!(mask_text("abcd", 8), "••cd");
        assert_eq!(mask_text("jane@example.com", 0), "••••@•••••••.•••");
        let long = mask_text(&"x".repeat(100), 2);
        assert_eq!(long, format!("{}…xx", "•".repeat(MAX_SHOWN)));
        assert_eq!(mask_value(&json!(1234567), 0), json!("•••••••"));
        assert_eq!(
            mask_value(&json!({ "a": [1, "bb"], "n": null, "t": true }), 0),
            json!({ "a": ["•", "••"], "n": null, "t": "•" })
        );
    }

    #[test]
    fn pointers_with_stars_mask_what_they_name_and_nothing_else() {
        let mut v = json!({
            "input": { "ssn": "123-45-6789", "name": "Jane", "people": [
                { "ssn": "111-22-3333", "age": 40 }, { "ssn": 222334444_i64 }
            ] },
            "steps": { "kyc": { "output": { "url": "https://docs.example/p/9" } } }
        });
        let rules = [
            Rule::parse("/input/ssn", 4).unwrap(),
            Rule::parse("/input/people/*/ssn", 0).unwrap(),
            Rule::parse("/steps/kyc/output/url", 0).unwrap(),
            Rule::parse("/input/missing", 0).unwrap(),
        ];
        let found = values(&v, &rules);
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(found.iter().any(|(c, _)| c == "https://docs.example/p/9"));
        assert!(apply(&mut v, &rules));
        assert_eq!(v["input"]["ssn"], "•••-••-6789");
        assert_eq!(v["input"]["name"], "Jane");
        assert_eq!(v["input"]["people"][0]["ssn"], "•••-••-••••");
        assert_eq!(v["input"]["people"][0]["age"], 40);
        assert_eq!(v["input"]["people"][1]["ssn"], "•••••••••");
        assert_eq!(
            v["steps"]["kyc"]["output"]["url"],
            "•••••://••••.•••••••/•/•"
        );
        assert!(!apply(&mut json!({}), &rules));
        assert!(Rule::parse("input/ssn", 0).is_err());
        assert!(Rule::parse("/a~1b", 0).unwrap().segments() == ["a/b"]);
    }

    #[test]
    fn text_is_scrubbed_of_values_also_when_escaped() {
        let v = json!({ "u": "https://x.example/a", "ssn": "123-45-6789", "pin": "12" });
        let rules = [
            Rule::parse("/u", 0).unwrap(),
            Rule::parse("/ssn", 4).unwrap(),
            Rule::parse("/pin", 0).unwrap(),
        ];
        let found = values(&v, &rules);
        // "12" is too short to look for in text (as a JSON leaf it is
        // masked).
        let text = r#"{"doc":"https:\/\/x.example\/a","id":"123-45-6789"} 12"#;
        let clean = scrub(text, &found).unwrap();
        assert!(
            !clean.contains("x.example") && !clean.contains("123-45"),
            "{clean}"
        );
        assert!(
            clean.contains("•••-••-6789") && clean.ends_with(" 12"),
            "{clean}"
        );
        assert_eq!(scrub("nothing here", &found), None);
        // In a URL, percent-encoded however; in JSON, with any escapes.
        let v = json!({ "name": "Jane O'Q/Doe\u{1}", "cvv": "123" });
        let rules = [
            Rule::parse("/name", 0).unwrap(),
            Rule::parse("/cvv", 0).unwrap(),
        ];
        let s = Scrubber::new(values(&v, &rules));
        for spelt in [
            "/people/Jane%20O%27Q%2FDoe%01",
            "?q=Jane+O%27Q/Doe%01",
            "?q=jane",
            r#"{"n":"Jane O\u0027Q\/Doe\u0001"}"#,
            r#"{"n":"Jane\u0020O\u0027Q\u002fDoe\u0001"}"#,
        ] {
            let clean = s.clean(spelt);
            assert!(
                !clean.contains("Doe") && !clean.contains("O'Q"),
                "{spelt}: {clean}"
            );
        }
        // Leaves: short values too, numbers as strings; JSON stays JSON.
        let mut body =
            json!({ "card": { "cvv": "123", "n": 123 }, "note": "x Jane O'Q/Doe\u{1} y" });
        s.json(&mut body);
        assert_eq!(body["card"]["cvv"], "•••");
        assert_eq!(body["card"]["n"], "•••");
        assert!(!body.to_string().contains("Doe"), "{body}");
        let kept = s.body(r#"{"cvv": "123", "q": "Jane O'Q/Doe\u0001"}"#);
        assert!(
            serde_json::from_str::<Value>(&kept).is_ok() && !kept.contains("123"),
            "{kept}"
        );
    }
}
