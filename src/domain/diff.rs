//! A structural difference between two JSON values, as operators read it:
//! one change per leaf that differs, named by its JSON Pointer (RFC 6901).
//! Objects are compared key by key; arrays element by element at the same
//! index (an element added or removed at the end is one change; one
//! inserted at the front shows as every later element changed, which is
//! what a positional reading of the data says).

use serde::Serialize;
use serde_json::Value;

/// One difference.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Change {
    Added {
        path: String,
        new: Value,
    },
    Removed {
        path: String,
        old: Value,
    },
    Changed {
        path: String,
        old: Value,
        new: Value,
    },
}

impl Change {
    pub fn path(&self) -> &str {
        match self {
            Change::Added { path, .. }
            | Change::Removed { path, .. }
            | Change::Changed { path, .. } => path,
        }
    }
}

/// The changes that turn `old` into `new`, in document order (object keys
/// sorted), at most `limit` of them; the second value is how many more
/// there were.
pub fn diff(old: &Value, new: &Value, limit: usize) -> (Vec<Change>, usize) {
    let mut out = Vec::new();
    let mut more = 0;
    walk(old, new, &mut String::new(), &mut |c| {
        if out.len() < limit {
            out.push(c);
        } else {
            more += 1;
        }
    });
    (out, more)
}

fn walk(old: &Value, new: &Value, path: &mut String, emit: &mut dyn FnMut(Change)) {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let step = k.replace('~', "~0").replace('/', "~1");
                child(a.get(k), b.get(k), &step, path, emit);
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for i in 0..a.len().max(b.len()) {
                child(a.get(i), b.get(i), &i.to_string(), path, emit);
            }
        }
        (a, b) if a == b => {}
        (a, b) => emit(Change::Changed {
            path: path.clone(),
            old: a.clone(),
            new: b.clone(),
        }),
    }
}

/// One member or element (`step`, already escaped) present in either side.
fn child(
    a: Option<&Value>,
    b: Option<&Value>,
    step: &str,
    path: &mut String,
    emit: &mut dyn FnMut(Change),
) {
    let len = path.len();
    path.push('/');
    path.push_str(step);
    match (a, b) {
        (Some(x), Some(y)) => walk(x, y, path, emit),
        (Some(x), None) => emit(Change::Removed {
            path: path.clone(),
            old: x.clone(),
        }),
        (None, Some(y)) => emit(Change::Added {
            path: path.clone(),
            new: y.clone(),
        }),
        (None, None) => {}
    }
    path.truncate(len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn leaves_are_added_removed_and_changed_by_pointer() {
        let old = json!({ "url": "a.png", "size": [1, 2], "meta": { "x/y": 1, "gone": true }, "same": 3 });
        let new = json!({ "url": "b.png", "size": [1, 2, 3], "meta": { "x/y": 2 }, "same": 3, "new": null });
        let (changes, more) = diff(&old, &new, 100);
        assert_eq!(more, 0);
        assert_eq!(
            changes,
            vec![
                Change::Removed {
                    path: "/meta/gone".into(),
                    old: json!(true)
                },
                Change::Changed {
                    path: "/meta/x~1y".into(),
                    old: json!(1),
                    new: json!(2)
                },
                Change::Added {
                    path: "/new".into(),
                    new: json!(null)
                },
                Change::Added {
                    path: "/size/2".into(),
                    new: json!(3)
                },
                Change::Changed {
                    path: "/url".into(),
                    old: json!("a.png"),
                    new: json!("b.png")
                },
            ]
        );
    }

    #[test]
    fn a_change_of_kind_is_one_change_at_its_place_and_the_limit_holds() {
        let (c, _) = diff(&json!({ "a": [1] }), &json!({ "a": { "0": 1 } }), 10);
        assert_eq!(
            c,
            vec![Change::Changed {
                path: "/a".into(),
                old: json!([1]),
                new: json!({ "0": 1 })
            }]
        );
        let (c, _) = diff(&json!(1), &json!("1"), 10);
        assert_eq!(c[0].path(), "");
        let old = json!((0..50).collect::<Vec<_>>());
        let new = json!((1..51).collect::<Vec<_>>());
        let (c, more) = diff(&old, &new, 10);
        assert_eq!((c.len(), more), (10, 40));
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (-3i64..3).prop_map(Value::from),
            "[a-c~/]{0,2}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-c~/]{0,2}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Applies changes as JSON Patch would (`pointer_mut`, then set or
    /// remove), removals from the end so indices stay right.
    fn apply(mut doc: Value, changes: &[Change]) -> Value {
        fn parent_and_key(path: &str) -> (String, String) {
            let at = path.rfind('/').unwrap_or(0);
            let key = path[at + 1..].replace("~1", "/").replace("~0", "~");
            (path[..at].to_owned(), key)
        }
        for c in changes.iter().rev() {
            match c {
                Change::Changed { path, new, .. } if path.is_empty() => doc = new.clone(),
                Change::Changed { path, new, .. } => {
                    *doc.pointer_mut(path).unwrap_or_else(|| panic!("{path}")) = new.clone();
                }
                Change::Removed { path, .. } => {
                    let (parent, key) = parent_and_key(path);
                    match doc.pointer_mut(&parent) {
                        Some(Value::Object(m)) => {
                            m.remove(&key);
                        }
                        Some(Value::Array(a)) => {
                            a.remove(key.parse::<usize>().unwrap_or(0));
                        }
                        _ => panic!("no parent for {path}"),
                    }
                }
                Change::Added { .. } => {}
            }
        }
        for c in changes {
            if let Change::Added { path, new } = c {
                let (parent, key) = parent_and_key(path);
                match doc.pointer_mut(&parent) {
                    Some(Value::Object(m)) => {
                        m.insert(key, new.clone());
                    }
                    Some(Value::Array(a)) => a.push(new.clone()),
                    _ => panic!("no parent for {path}"),
                }
            }
        }
        doc
    }

    proptest! {
        /// The changes are exactly the difference: applied to the old
        /// value they give the new one, and there are none between equals.
        #[test]
        fn changes_turn_old_into_new(old in value(), new in value()) {
            let (changes, more) = diff(&old, &new, usize::MAX);
            prop_assert_eq!(more, 0);
            prop_assert_eq!(apply(old.clone(), &changes), new.clone());
            prop_assert!(diff(&new, &new, usize::MAX).0.is_empty());
        }
    }
}
