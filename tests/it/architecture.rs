//! The shape of `src/`, checked: functions fit on a screen, the store
//! keeps no rules and its traits stay small. These read the source files,
//! so a change that breaks the shape fails here, naming where.

use std::path::{Path, PathBuf};

/// The longest a function in `src/` may be (its `#[cfg(test)] mod`s aside).
const MAX_FN_LINES: usize = 100;
/// The most methods one store trait may declare.
const MAX_TRAIT_METHODS: usize = 30;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn sources(under: &str) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join(under),
        &mut files,
    );
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// The lines before a file's unit tests (`#[cfg(test)]` then `mod`).
fn before_tests(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| {
            lines[i].trim() == "#[cfg(test)]"
                && lines
                    .get(i + 1)
                    .is_some_and(|l| l.trim_start().starts_with("mod "))
        })
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// A line's code with string and character literals and `//` comments
/// blanked, for counting braces.
fn code_of(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(d) = chars.next() {
                    match d {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '\'' => {
                // A char literal ('x', '\n', '{'), not a lifetime.
                let rest: String = chars.clone().take(3).collect();
                if rest.starts_with('\\') {
                    chars.find(|&d| d == '\'');
                } else if rest.chars().nth(1) == Some('\'') {
                    chars.nth(1);
                }
            }
            '/' if chars.peek() == Some(&'/') => break,
            _ => out.push(c),
        }
    }
    out
}

/// A function's name when `line` starts one.
fn fn_name(line: &str) -> Option<&str> {
    let mut rest = line.trim_start();
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("async ").unwrap_or(rest);
    let name = rest.strip_prefix("fn ")?;
    Some(
        name.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()
            .unwrap_or(""),
    )
}

/// (file, line, name, length) of every function in `lines` with a body.
fn functions(file: &Path, lines: &[&str]) -> Vec<(String, usize, String, usize)> {
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else {
            continue;
        };
        let (mut depth, mut opened) = (0i64, false);
        for (end, l) in lines.iter().enumerate().skip(start) {
            let code = code_of(l);
            if !opened && code.contains(';') && !code.contains('{') {
                break;
            }
            for c in code.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth == 0 {
                let at = format!("{}", file.display());
                found.push((at, start + 1, name.to_owned(), end - start + 1));
                break;
            }
        }
    }
    found
}

#[test]
fn no_function_in_src_is_over_100_lines() {
    let mut long = Vec::new();
    for (path, text) in sources("src") {
        for f in functions(&path, &before_tests(&text)) {
            if f.3 > MAX_FN_LINES {
                long.push(format!("{}:{} {} ({} lines)", f.0, f.1, f.2, f.3));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_counter_sees_a_long_function() {
    let body: String = (0..120)
        .map(|i| format!("    let x{i} = '{{';\n"))
        .collect();
    let text = format!("fn long() {{\n{body}}}\n\nfn short() {{}}\n");
    let lines: Vec<&str> = text.lines().collect();
    let found = functions(Path::new("x.rs"), &lines);
    let lengths: Vec<(&str, usize)> = found.iter().map(|f| (f.2.as_str(), f.3)).collect();
    assert_eq!(lengths, [("long", 122), ("short", 1)]);
}

#[test]
fn the_store_keeps_no_rules_and_its_traits_are_small() {
    for (path, text) in sources("src/store") {
        let lines = before_tests(&text);
        for (n, line) in lines.iter().enumerate() {
            let code = code_of(line);
            for rule in ["OperatorAction::", "ReversalPolicy::"] {
                assert!(
                    !code.contains(rule),
                    "{}:{}: the store decides with `{rule}`: decide in domain/",
                    path.display(),
                    n + 1
                );
            }
        }
        let mut trait_at = None;
        let mut methods = 0;
        for (n, line) in lines.iter().enumerate() {
            if line.starts_with("pub trait ") && line.trim_end().ends_with('{') {
                (trait_at, methods) = (Some(n + 1), 0);
            } else if trait_at.is_some() && *line == "}" {
                assert!(
                    methods <= MAX_TRAIT_METHODS,
                    "{}:{}: a store trait of {methods} methods (at most {MAX_TRAIT_METHODS})",
                    path.display(),
                    trait_at.unwrap_or(0)
                );
                trait_at = None;
            } else if trait_at.is_some() && fn_name(line).is_some() {
                methods += 1;
            }
        }
    }
}

#[test]
fn the_engine_keeps_to_claiming_passing_and_committing() {
    const MAX_ENGINE_METHODS: usize = 25;
    let mut methods = Vec::new();
    for (path, text) in sources("src/engine") {
        let lines = before_tests(&text);
        let mut inside = false;
        for line in lines {
            if line.starts_with("impl Engine {") {
                inside = true;
            } else if inside && line == "}" {
                inside = false;
            } else if inside && line.starts_with("    ") && !line.starts_with("     ") {
                if let Some(name) = fn_name(line) {
                    methods.push(format!("{}: {name}", path.display()));
                }
            }
        }
    }
    assert!(
        methods.len() <= MAX_ENGINE_METHODS,
        "Engine has {} methods (at most {MAX_ENGINE_METHODS}):\n{}",
        methods.len(),
        methods.join("\n")
    );
}

/// Where `needle` is named in `src/` code (tests aside), outside `allowed`
/// (paths under `src/`).
fn named_outside(needle: &str, allowed: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for (path, text) in sources("src") {
        let rel = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if allowed.iter().any(|a| rel.starts_with(a)) {
            continue;
        }
        for (n, line) in before_tests(&text).iter().enumerate() {
            if code_of(line).contains(needle) {
                found.push(format!("src/{rel}:{}", n + 1));
            }
        }
    }
    found
}

#[test]
fn a_step_kind_and_an_operator_action_are_each_one_module() {
    // Which kind a step is, is asked of its kind (`domain::kind::Kind`),
    // never matched on outside the kinds' folder and the configuration.
    let kinds = named_outside("StepKind::", &["pipeline/kinds/", "config/pipeline.rs"]);
    assert!(
        kinds.is_empty(),
        "kinds matched on outside pipeline/kinds/: {kinds:?}"
    );
    for kind in [
        "kinds::Request",
        "kinds::SubmitPoll",
        "kinds::Callback",
        "kinds::Sleep",
    ] {
        let named = named_outside(kind, &["pipeline/kinds/"]);
        assert!(
            named.is_empty(),
            "`{kind}` named outside its module: {named:?}"
        );
    }
    // What an action allows is decided by its module under domain/action/:
    // nothing else reads the transition table for an operator.
    let table = named_outside("Trigger::Operator", &["domain/"]);
    assert!(
        table.is_empty(),
        "actions decided outside domain/action/: {table:?}"
    );
}

#[test]
fn the_module_check_sees_a_match_outside() {
    let found = named_outside("fn named_outside", &[]);
    assert!(found.is_empty(), "this file is not under src/: {found:?}");
    let here = named_outside("pub fn transition(", &[]);
    assert_eq!(here.len(), 1, "{here:?}");
}

#[test]
fn the_architecture_page_is_a_map_and_its_invariants_name_tests() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md");
    let text = std::fs::read_to_string(path).unwrap();
    let chars = text.chars().count();
    assert!(
        chars <= 15_000,
        "ARCHITECTURE.md is {chars} characters (at most 15,000)"
    );
    let invariants = text.split("\n## Invariants").nth(1).unwrap();
    let invariants = invariants.split("\n## ").next().unwrap();
    // Items start with "N. " at the line's start; each names a test
    // (`module::name`).
    let mut items: Vec<String> = Vec::new();
    for line in invariants.lines() {
        let number = line.split_once(". ").map(|(n, _)| n);
        if number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
            items.push(String::new());
        }
        if let Some(item) = items.last_mut() {
            item.push_str(line);
            item.push('\n');
        }
    }
    assert!(items.len() >= 30, "{} invariants found", items.len());
    for item in &items {
        assert!(item.contains("::"), "an invariant names no test:\n{item}");
    }
}
