//! Encryption at rest: the values records carry (inputs, outputs,
//! excerpts, requests sent, event details, callback bodies) sealed with
//! AES-256-GCM before they reach the database, each tagged with the id of
//! its key, and opened when read.
//!
//! A sealed value is text: `\u{1}bs1:<key id>:<base64url(nonce ‖
//! ciphertext ‖ tag)>`; in a JSON column, that text as a JSON string. The
//! nonce is random (96 bits) per value; the additional data is the field
//! (`input`, `output`…), so a value moved into another kind of column
//! does not open. A value kept in clear whose text begins with `\u{1}`
//! is written escaped (`\u{1}bp1:` before it) and read back unescaped, so
//! no reply, however crafted, reads as a sealed value.

use std::collections::BTreeMap;

use aws_lc_rs::aead::{AES_256_GCM, Aad, NONCE_LEN, Nonce, RandomizedNonceKey};
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use serde_json::Value;
use std::borrow::Cow;

/// A sealed value's prefix (format 1); the key id and the sealed bytes follow.
const SEALED: &str = "\u{1}bs1:";
/// The prefix of a value kept in clear that began with `\u{1}`.
const ESCAPED: &str = "\u{1}bp1:";

/// A key's length: AES-256.
pub const KEY_BYTES: usize = 32;

/// What a sealed value is, bound into it as additional data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Input,
    Output,
    Excerpt,
    Request,
    Detail,
    Callback,
    /// A value in an export of an encrypted database.
    Export,
}

impl Field {
    fn aad(self) -> &'static [u8] {
        match self {
            Field::Input => b"ballast input",
            Field::Output => b"ballast output",
            Field::Excerpt => b"ballast excerpt",
            Field::Request => b"ballast request",
            Field::Detail => b"ballast detail",
            Field::Callback => b"ballast callback",
            Field::Export => b"ballast export",
        }
    }
}

/// Why a stored value did not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error(
        "a value is sealed with data key `{0}`, which this node does not have \
         (database.encryption.keys)"
    )]
    UnknownKey(String),
    #[error(
        "a value sealed with data key `{0}` does not open: the key is not the one it was sealed with, or the value was altered"
    )]
    Altered(String),
    #[error("a sealed value is malformed")]
    Malformed,
    #[error("the operating system's random source failed: nothing can be sealed")]
    Random,
}

struct DataKey {
    aead: RandomizedNonceKey,
    check: String,
}

/// The data keys a node holds: the one new values are sealed with (none:
/// new values are kept in clear) and every key old values may be sealed
/// with. `Debug` shows ids only.
#[derive(Default)]
pub struct Keyring {
    current: Option<String>,
    keys: BTreeMap<String, DataKey>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Whether `id` may name a key: 1 to 32 of `A-Z a-z 0-9 . _ -`.
pub fn valid_key_id(id: &str) -> bool {
    (1..=32).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// A key as written in its file or variable: 32 bytes in base64
/// (`openssl rand -base64 32`). The message never holds the value.
pub fn parse_key(text: &str) -> Result<[u8; KEY_BYTES], String> {
    let text = text.trim();
    let bytes = STANDARD
        .decode(text)
        .or_else(|_| URL_SAFE_NO_PAD.decode(text.trim_end_matches('=')))
        .map_err(|_| "is not base64 (make one with `openssl rand -base64 32`)".to_owned())?;
    bytes.try_into().map_err(|b: Vec<u8>| {
        format!(
            "holds {} bytes; a data key is {KEY_BYTES} (make one with `openssl rand -base64 32`)",
            b.len()
        )
    })
}

impl Keyring {
    /// A keyring of `keys`, sealing new values with `current` (which must
    /// be one of them).
    pub fn new(
        current: Option<&str>,
        keys: impl IntoIterator<Item = (String, [u8; KEY_BYTES])>,
    ) -> Result<Keyring, String> {
        let mut ring = Keyring::default();
        for (id, bytes) in keys {
            if !valid_key_id(&id) {
                return Err(format!(
                    "data key id `{id}` must be 1-32 characters of A-Z, a-z, 0-9, `.`, `_` or `-`"
                ));
            }
            let aead = RandomizedNonceKey::new(&AES_256_GCM, &bytes)
                .map_err(|_| format!("data key `{id}` is not an AES-256 key"))?;
            ring.keys.insert(
                id,
                DataKey {
                    aead,
                    check: check_value(&bytes),
                },
            );
        }
        if let Some(c) = current {
            if !ring.keys.contains_key(c) {
                return Err(format!("data key `{c}` is not among the keys given"));
            }
            ring.current = Some(c.to_owned());
        }
        Ok(ring)
    }

    /// The key new values are sealed with.
    pub fn current(&self) -> Option<&str> {
        self.current.as_deref()
    }

    /// The ids of the keys held, in order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// A key's check value: shows that the key a node holds under an id is
    /// the one the database's values were sealed with, without revealing it.
    pub fn check(&self, id: &str) -> Option<&str> {
        self.keys.get(id).map(|k| k.check.as_str())
    }

    /// Whether this keyring seals or opens anything.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// `plain` as stored: sealed with the current key, else in clear
    /// (escaped when it could pass for a sealed value).
    pub fn seal_text<'a>(&self, field: Field, plain: &'a str) -> Result<Cow<'a, str>, SealError> {
        Ok(match self.current.as_deref() {
            Some(id) => Cow::Owned(self.seal_bytes(id, field, plain.as_bytes())?),
            None if plain.starts_with('\u{1}') => Cow::Owned(format!("{ESCAPED}{plain}")),
            None => Cow::Borrowed(plain),
        })
    }

    /// A stored text as it was before [`seal_text`](Self::seal_text).
    pub fn open_text(&self, field: Field, stored: String) -> Result<String, SealError> {
        if !stored.starts_with('\u{1}') {
            return Ok(stored);
        }
        if let Some(rest) = stored.strip_prefix(ESCAPED) {
            return Ok(rest.to_owned());
        }
        if sealed_with(&stored).is_none() {
            // Kept in clear before sealing existed, unescaped.
            return Ok(stored);
        }
        let bytes = self.open_bytes(field, &stored)?;
        String::from_utf8(bytes).map_err(|_| SealError::Malformed)
    }

    /// `value` as a JSON column stores it: sealed (its JSON text, sealed,
    /// as a JSON string) with the current key, else as it is (escaped when
    /// it is a string that could pass for a sealed value).
    pub fn seal_json<'a>(
        &self,
        field: Field,
        value: &'a Value,
    ) -> Result<Cow<'a, Value>, SealError> {
        Ok(match (self.current.as_deref(), value) {
            (Some(id), v) => {
                let text = serde_json::to_vec(v).unwrap_or_default();
                Cow::Owned(Value::String(self.seal_bytes(id, field, &text)?))
            }
            (None, Value::String(s)) if s.starts_with('\u{1}') => {
                Cow::Owned(Value::String(format!("{ESCAPED}{s}")))
            }
            (None, _) => Cow::Borrowed(value),
        })
    }

    /// A JSON column's value as it was before [`seal_json`](Self::seal_json).
    pub fn open_json(&self, field: Field, stored: Value) -> Result<Value, SealError> {
        let Value::String(s) = &stored else {
            return Ok(stored);
        };
        if !s.starts_with('\u{1}') {
            return Ok(stored);
        }
        if let Some(rest) = s.strip_prefix(ESCAPED) {
            return Ok(Value::String(rest.to_owned()));
        }
        if sealed_with(s).is_none() {
            return Ok(stored);
        }
        let bytes = self.open_bytes(field, s)?;
        serde_json::from_slice(&bytes).map_err(|_| SealError::Malformed)
    }

    fn seal_bytes(&self, id: &str, field: Field, plain: &[u8]) -> Result<String, SealError> {
        let key = self
            .keys
            .get(id)
            .ok_or_else(|| SealError::UnknownKey(id.to_owned()))?;
        let mut data = plain.to_vec();
        // Sealing fails only when the random source (the nonce) does.
        let nonce = key
            .aead
            .seal_in_place_append_tag(Aad::from(field.aad()), &mut data)
            .map_err(|_| SealError::Random)?;
        let mut sealed = Vec::with_capacity(NONCE_LEN + data.len());
        sealed.extend_from_slice(nonce.as_ref());
        sealed.extend_from_slice(&data);
        Ok(format!("{SEALED}{id}:{}", URL_SAFE_NO_PAD.encode(sealed)))
    }

    fn open_bytes(&self, field: Field, stored: &str) -> Result<Vec<u8>, SealError> {
        let (id, body) = parse_sealed(stored).ok_or(SealError::Malformed)?;
        let key = self
            .keys
            .get(id)
            .ok_or_else(|| SealError::UnknownKey(id.to_owned()))?;
        let mut data = URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| SealError::Malformed)?;
        if data.len() < NONCE_LEN {
            return Err(SealError::Malformed);
        }
        let nonce = Nonce::try_assume_unique_for_key(&data[..NONCE_LEN])
            .map_err(|_| SealError::Malformed)?;
        let mut rest = data.split_off(NONCE_LEN);
        let len = key
            .aead
            .open_in_place(nonce, Aad::from(field.aad()), &mut rest)
            .map_err(|_| SealError::Altered(id.to_owned()))?
            .len();
        rest.truncate(len);
        Ok(rest)
    }
}

/// A sealed text's key id and body, or `None` for anything else (a value
/// kept in clear before sealing existed may begin with U+0001 too).
fn parse_sealed(stored: &str) -> Option<(&str, &str)> {
    let (id, body) = stored.strip_prefix(SEALED)?.split_once(':')?;
    let base64url = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'_';
    (valid_key_id(id) && !body.is_empty() && body.bytes().all(base64url)).then_some((id, body))
}

/// How a stored value is kept: the key id it is sealed with, or `None`
/// for a value in clear (escaped or not).
pub fn sealed_with(stored: &str) -> Option<&str> {
    parse_sealed(stored).map(|(id, _)| id)
}

/// [`sealed_with`] for a JSON column's value.
pub fn json_sealed_with(stored: &Value) -> Option<&str> {
    stored.as_str().and_then(sealed_with)
}

/// A key's check value: the start of an HMAC-SHA-256 of a fixed text
/// under the key.
fn check_value(key: &[u8; KEY_BYTES]) -> String {
    let mac = aws_lc_rs::hmac::sign(
        &aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, key),
        b"ballast data key check 1",
    );
    hex::encode(&mac.as_ref()[..8])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ring(current: Option<&str>) -> Keyring {
        Keyring::new(current, [("k1".into(), [7; 32]), ("k2".into(), [9; 32])]).unwrap()
    }

    #[test]
    fn values_round_trip_sealed_and_in_clear() {
        let values = [
            json!({"ssn": "123-45-6789", "n": [1, 2.5, null]}),
            json!("plain"),
            json!("\u{1}bs1:k1:AAAA"),
            json!("\u{1}bp1:x"),
            json!(null),
        ];
        for current in [Some("k1"), None] {
            let r = ring(current);
            for v in &values {
                let stored = r.seal_json(Field::Output, v).unwrap().into_owned();
                assert_eq!(r.open_json(Field::Output, stored.clone()).unwrap(), *v);
                assert_eq!(current.is_some(), json_sealed_with(&stored).is_some());
                if current.is_some() {
                    assert!(!stored.to_string().contains("123-45"));
                }
            }
            for t in ["GET /x", "", "\u{1}bs1:k9:zz", "\u{1}", "\u{1}\u{2}binary"] {
                let stored = r.seal_text(Field::Excerpt, t).unwrap().into_owned();
                assert_eq!(r.open_text(Field::Excerpt, stored).unwrap(), t);
            }
        }
    }

    #[test]
    fn a_value_kept_in_clear_before_sealing_existed_reads_as_it_was() {
        let r = ring(Some("k1"));
        for old in ["\u{1}\u{2}binary", "\u{1}bs1:", "\u{1}bs1:no key:AA"] {
            assert_eq!(r.open_text(Field::Excerpt, old.into()).unwrap(), old);
            assert_eq!(r.open_json(Field::Output, json!(old)).unwrap(), json!(old));
        }
    }

    #[test]
    fn a_sealed_value_opens_only_with_its_key_and_field() {
        let r = ring(Some("k2"));
        let stored = r.seal_text(Field::Input, "secret").unwrap().into_owned();
        assert_eq!(sealed_with(&stored), Some("k2"));
        assert_eq!(
            r.open_text(Field::Excerpt, stored.clone()),
            Err(SealError::Altered("k2".into()))
        );
        let only_k1 = Keyring::new(None, [("k1".into(), [7; 32])]).unwrap();
        assert_eq!(
            only_k1.open_text(Field::Input, stored.clone()),
            Err(SealError::UnknownKey("k2".into()))
        );
        let other = Keyring::new(None, [("k2".into(), [8; 32])]).unwrap();
        assert_eq!(
            other.open_text(Field::Input, stored.clone()),
            Err(SealError::Altered("k2".into()))
        );
        let mut flipped = stored.into_bytes();
        let last = flipped.len() - 2;
        flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
        assert!(
            r.open_text(Field::Input, String::from_utf8(flipped).unwrap())
                .is_err()
        );
        // Two seals of one value differ (a fresh nonce each).
        assert_ne!(
            r.seal_text(Field::Input, "x").unwrap(),
            r.seal_text(Field::Input, "x").unwrap()
        );
    }

    #[test]
    fn keys_are_32_bytes_of_base64_and_ids_are_short_names() {
        let b64 = STANDARD.encode([1u8; 32]);
        assert_eq!(parse_key(&format!("{b64}\n")).unwrap(), [1; 32]);
        assert!(
            parse_key(&STANDARD.encode([1u8; 16]))
                .unwrap_err()
                .contains("16 bytes")
        );
        assert!(parse_key("not base64!").unwrap_err().contains("not base64"));
        assert!(Keyring::new(None, [("a:b".into(), [1; 32])]).is_err());
        assert!(Keyring::new(Some("k3"), [("k1".into(), [1; 32])]).is_err());
        let r = ring(None);
        assert_ne!(r.check("k1"), r.check("k2"));
        assert!(!format!("{r:?}").contains("7, 7"));
    }
}
