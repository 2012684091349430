//! Secrets that cannot be guessed: every one Ballast makes (the first
//! admin's password, the session signing key, session ids, API tokens, the
//! demo's webhook secret) is drawn from the operating system's CSPRNG
//! (`getrandom`), never from a seeded generator such as `fastrand` (whose
//! state, seeded from a clock and a thread id, is at most 64 bits) nor from
//! UUIDs (whose v4 form carries 122 random bits and says nothing of where
//! they came from).

use thiserror::Error;

/// The operating system could not give random bytes (no entropy source, or
/// a sandbox forbidding it): nothing that needs a secret can go on.
#[derive(Debug, Error)]
#[error("the operating system's random source failed: {0}")]
pub struct RandomError(getrandom::Error);

/// `N` bytes from the operating system's CSPRNG.
pub fn bytes<const N: usize>() -> Result<[u8; N], RandomError> {
    let mut out = [0u8; N];
    getrandom::fill(&mut out).map_err(RandomError)?;
    Ok(out)
}

/// `N` random bytes as `2 × N` lowercase hex digits: `8 × N` bits.
pub fn hex<const N: usize>() -> Result<String, RandomError> {
    Ok(::hex::encode(bytes::<N>()?))
}

/// The letters of a generated password: a–z, A–Z, 0–9 (62, so each letter
/// carries log2(62) ≈ 5.95 bits).
const ALPHABET: &[u8; 62] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";

/// A password of `len` letters of [`ALPHABET`], each uniform: a random byte
/// is used only when below 248 (4 × 62), so `byte % 62` has no bias.
/// 26 letters carry 26 × 5.95 ≈ 154 bits.
pub fn password(len: usize) -> Result<String, RandomError> {
    let mut out = String::with_capacity(len);
    while out.len() < len {
        for b in bytes::<64>()? {
            if b < 248 && out.len() < len {
                out.push(char::from(ALPHABET[usize::from(b % 62)]));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_have_their_length_and_alphabet_and_differ() {
        let a = password(26).unwrap();
        let b = password(26).unwrap();
        assert_eq!(a.len(), 26);
        assert!(a.bytes().all(|c| ALPHABET.contains(&c)), "{a}");
        assert_ne!(a, b);
        assert_eq!(password(0).unwrap(), "");
        assert_eq!(password(1_000).unwrap().len(), 1_000);
    }

    #[test]
    fn every_letter_is_drawn() {
        // 20,000 letters: a letter of the 62 missing by chance has a
        // probability of about 62 × e^(-322), so a gap is a biased draw.
        let text = password(20_000).unwrap();
        for c in ALPHABET {
            assert!(
                text.as_bytes().contains(c),
                "{} never drawn",
                char::from(*c)
            );
        }
    }

    #[test]
    fn hex_secrets_have_their_length_and_differ() {
        let a = hex::<32>().unwrap();
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, hex::<32>().unwrap());
        assert_ne!(bytes::<16>().unwrap(), bytes::<16>().unwrap());
    }
}
