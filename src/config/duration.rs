//! Human durations in configuration: `500ms`, `10s`, `2m`, `1h30m`, `1d`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A `Duration` written the way people write them.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn secs(s: u64) -> Self {
        HumanDuration(Duration::from_secs(s))
    }
}

impl fmt::Debug for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms == 0 {
            f.write_str("0s")
        } else if ms % 1000 != 0 {
            write!(f, "{ms}ms")
        } else {
            write!(f, "{}s", ms / 1000)
        }
    }
}

/// Parses a sequence of `<number><unit>` parts, units `ms s m h d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("invalid duration `{text}`: expected e.g. `500ms`, `10s`, `2m`, `1h30m`");
    let s = text.trim();
    if s.is_empty() {
        return Err(bad());
    }
    let mut total: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(bad());
        }
        let n: u128 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit_ms: u128 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total = n
            .checked_mul(unit_ms)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
    }
    let ms = u64::try_from(total).map_err(|_| bad())?;
    Ok(Duration::from_millis(ms))
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text)
            .map(HumanDuration)
            .map_err(serde::de::Error::custom)
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_units_and_sums() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
    }

    #[test]
    fn rejects_nonsense() {
        for bad in [
            "",
            "s",
            "10",
            "10 s",
            "10x",
            "-1s",
            "1.5s",
            "99999999999999999999999d",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn display_round_trips(ms in 0u64..10_000_000_000) {
            let d = HumanDuration(Duration::from_millis(ms));
            prop_assert_eq!(parse_duration(&d.to_string()), Ok(d.0));
        }

        #[test]
        fn never_panics(s in ".{0,24}") {
            let _ = parse_duration(&s);
        }
    }
}
