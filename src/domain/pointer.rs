//! JSON Pointer lookups (RFC 6901) that allocate nothing: reply rules,
//! outputs and job ids are read through them on every call, where
//! `serde_json::Value::pointer` builds a string per token. Same answers
//! as `Value::pointer` (a property test holds them to it).

use serde_json::Value;

/// The value `pointer` names in `value`: `""` is the whole value; anything
/// else starts with `/`, each token unescaped (`~1` is `/`, `~0` is `~`),
/// an array indexed by a decimal without sign or leading zero.
pub fn get<'v>(value: &'v Value, pointer: &str) -> Option<&'v Value> {
    if pointer.is_empty() {
        return Some(value);
    }
    let rest = pointer.strip_prefix('/')?;
    rest.split('/').try_fold(value, |at, token| step(at, token))
}

/// One token down from `at`.
fn step<'v>(at: &'v Value, token: &str) -> Option<&'v Value> {
    if token.contains('~') {
        // Rare: unescaped into a string of its own.
        let unescaped = token.replace("~1", "/").replace("~0", "~");
        return down(at, &unescaped);
    }
    down(at, token)
}

fn down<'v>(at: &'v Value, token: &str) -> Option<&'v Value> {
    match at {
        Value::Object(map) => map.get(token),
        Value::Array(list) => index(token).and_then(|i| list.get(i)),
        _ => None,
    }
}

/// An array index as RFC 6901 spells one: digits, no sign, no leading
/// zero but `0` itself.
fn index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn pointers_reach_what_rfc_6901_says() {
        let v = json!({"a": {"b/c": [10, {"~d": true}]}, "": 1, "01": 2});
        assert_eq!(get(&v, ""), Some(&v));
        assert_eq!(get(&v, "/a/b~1c/0"), Some(&json!(10)));
        assert_eq!(get(&v, "/a/b~1c/1/~0d"), Some(&json!(true)));
        assert_eq!(get(&v, "/"), Some(&json!(1)));
        assert_eq!(get(&v, "/01"), Some(&json!(2)));
        assert_eq!(get(&v, "/a/b~1c/01"), None);
        assert_eq!(get(&v, "/a/b~1c/+1"), None);
        assert_eq!(get(&v, "/a/b~1c/2"), None);
        assert_eq!(get(&v, "a"), None);
    }

    /// Tokens drawn from what trips pointers up: escapes, digits with
    /// signs and leading zeros, empty tokens.
    fn token() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            Just("~".to_owned()),
            Just("~0".to_owned()),
            Just("~1".to_owned()),
            Just("~01".to_owned()),
            Just("+1".to_owned()),
            Just("01".to_owned()),
            "[0-3]",
            "[ab~/01]{1,3}",
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        let key = prop_oneof![
            Just(String::new()),
            Just("~".to_owned()),
            Just("/".to_owned()),
            Just("01".to_owned()),
            "[ab~/01]{1,2}",
        ];
        let leaf = prop_oneof![Just(Value::Null), any::<i64>().prop_map(Value::from)];
        leaf.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(key.clone(), inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn same_answers_as_serde_json(
            v in value(),
            tokens in prop::collection::vec(token(), 0..4),
            slash in any::<bool>(),
        ) {
            let mut pointer: String = tokens.iter().map(|t| format!("/{t}")).collect();
            if !slash && !pointer.is_empty() {
                pointer.remove(0);
            }
            prop_assert_eq!(get(&v, &pointer), v.pointer(&pointer), "{}", pointer);
        }
    }
}
