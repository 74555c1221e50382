//! Lease and callback capabilities: tokens the worker makes and the digests the server
//! keeps instead of them.
//!
//! A token is 32 bytes from the OS CSPRNG, written as unpadded base64url (43 characters).
//! Its digest is the lowercase hex SHA-256 of those 43 ASCII characters. The server stores
//! and compares only digests, and compares them in constant time. A raw token lives in a
//! zeroizing buffer and prints as `<redacted>`.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fmt;
use zeroize::Zeroizing;

use crate::ids::Invalid;

/// Characters in an encoded token.
pub const TOKEN_CHARS: usize = 43;
/// Fewest distinct byte values a token's 32 bytes may have.
pub const TOKEN_MIN_DISTINCT: usize = 16;

/// A raw lease or callback token. Never logged, never stored by the server.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Token(Zeroizing<String>);

impl Serialize for Token {
    /// Written straight from the zeroizing original: no copy of it is left behind.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0.as_str())
    }
}

/// The token a worker creates to claim an offer; it fences every later command.
pub type LeaseToken = Token;
/// The token whose digest a `running` ACK registers and a completion proves.
pub type CallbackToken = Token;

impl Token {
    /// Draws a fresh token from the OS CSPRNG, redrawing the (astronomically rare) weak ones.
    pub fn generate() -> Result<Self, getrandom::Error> {
        loop {
            let mut bytes = Zeroizing::new([0u8; 32]);
            getrandom::getrandom(&mut bytes[..])?;
            if let Ok(token) = Self::from_bytes(&bytes) {
                return Ok(token);
            }
        }
    }

    /// Encodes 32 bytes as a token, refusing weak ones.
    pub fn from_bytes(bytes: &[u8; 32]) -> Result<Self, Invalid> {
        check_strength(bytes)?;
        Ok(Self(Zeroizing::new(encode_base64url(bytes))))
    }

    /// Parses an encoded token, refusing wrong length, bad encoding and weak ones.
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        if s.len() != TOKEN_CHARS {
            return Err(Invalid::TokenLength);
        }
        let bytes = decode_base64url(s.as_bytes()).ok_or(Invalid::TokenEncoding)?;
        check_strength(&bytes)?;
        Ok(Self(Zeroizing::new(s.to_owned())))
    }

    /// The encoded token, for the one place that must send or journal it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The digest the server stores in the token's place.
    pub fn digest(&self) -> Digest {
        Digest::of(self.0.as_bytes())
    }

    /// Whether this token's digest equals `stored`, compared in constant time.
    pub fn matches(&self, stored: &Digest) -> bool {
        self.digest().ct_eq(stored)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl TryFrom<String> for Token {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        let s = Zeroizing::new(s);
        Self::parse(&s)
    }
}

fn check_strength(bytes: &[u8; 32]) -> Result<(), Invalid> {
    let mut seen = [false; 256];
    for &b in bytes {
        seen[usize::from(b)] = true;
    }
    if seen.iter().filter(|&&s| s).count() < TOKEN_MIN_DISTINCT {
        return Err(Invalid::TokenWeak);
    }
    Ok(())
}

fn encode_base64url(bytes: &[u8; 32]) -> String {
    crate::base64::encode(bytes, crate::base64::URL)
}

/// Decodes exactly 43 unpadded base64url characters into 32 bytes. The last character
/// carries 2 spare bits that must be zero, so each token has one encoding only.
fn decode_base64url(s: &[u8]) -> Option<[u8; 32]> {
    crate::base64::decode(s, crate::base64::URL)?.try_into().ok()
}

/// A lowercase hex SHA-256: a token digest or an artifact's content digest.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

impl Digest {
    /// Hashes bytes.
    pub fn of(bytes: &[u8]) -> Self {
        Self::from_raw(&Sha256::digest(bytes).into())
    }

    /// Hex-encodes a finished SHA-256.
    pub fn from_raw(raw: &[u8; 32]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(64);
        for b in raw {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        }
        Self(s)
    }

    /// Parses 64 lowercase hex characters.
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        if s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(Self(s.to_owned()))
        } else {
            Err(Invalid::Digest)
        }
    }

    /// The hex text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Equality that takes the same time wherever the first difference is.
    pub fn ct_eq(&self, other: &Digest) -> bool {
        ct_eq(self.0.as_bytes(), other.0.as_bytes())
    }
}

/// Constant-time equality of two byte strings of public length.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for Digest {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        Self::parse(&s)
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_bytes() -> [u8; 32] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(11))
    }

    #[test]
    fn generated_tokens_are_valid_distinct_and_43_chars() {
        let a = Token::generate().unwrap();
        let b = Token::generate().unwrap();
        assert_eq!(a.expose().len(), TOKEN_CHARS);
        assert!(Token::parse(a.expose()).is_ok());
        assert_ne!(a.expose(), b.expose());
    }

    #[test]
    fn encoding_round_trips_through_parse() {
        let t = Token::from_bytes(&sample_bytes()).unwrap();
        assert_eq!(decode_base64url(t.expose().as_bytes()), Some(sample_bytes()));
        assert_eq!(Token::parse(t.expose()).unwrap(), t);
    }

    #[test]
    fn encoding_matches_a_known_vector() {
        // 32 bytes 0x00..0x1f, checked against Python's base64.urlsafe_b64encode.
        let bytes: [u8; 32] = std::array::from_fn(|i| i as u8);
        assert_eq!(encode_base64url(&bytes), "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8");
    }

    #[test]
    fn refuses_wrong_length() {
        let t = Token::from_bytes(&sample_bytes()).unwrap();
        assert_eq!(Token::parse(&t.expose()[..42]), Err(Invalid::TokenLength));
        assert_eq!(Token::parse(&format!("{}A", t.expose())), Err(Invalid::TokenLength));
        assert_eq!(Token::parse(&format!("{}=", t.expose())), Err(Invalid::TokenLength));
    }

    #[test]
    fn refuses_non_base64url_and_non_canonical_text() {
        let t = Token::from_bytes(&sample_bytes()).unwrap();
        let mut plus = t.expose().to_owned();
        plus.replace_range(0..1, "+");
        assert_eq!(Token::parse(&plus), Err(Invalid::TokenEncoding));
        // The last character's two spare bits set: same bytes, second spelling.
        let mut spare = t.expose().to_owned();
        let last = spare.pop().unwrap();
        let pos = crate::base64::URL.iter().position(|&a| char::from(a) == last).unwrap();
        spare.push(char::from(crate::base64::URL[pos | 1]));
        assert_ne!(spare, t.expose());
        assert_eq!(Token::parse(&spare), Err(Invalid::TokenEncoding));
    }

    #[test]
    fn refuses_tokens_with_fewer_than_16_distinct_bytes() {
        let weak: [u8; 32] = std::array::from_fn(|i| (i % 15) as u8);
        assert_eq!(Token::from_bytes(&weak), Err(Invalid::TokenWeak));
        assert_eq!(Token::parse(&encode_base64url(&weak)), Err(Invalid::TokenWeak));
        let just_enough: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
        assert!(Token::parse(&encode_base64url(&just_enough)).is_ok());
        assert_eq!(Token::parse(&"A".repeat(43)), Err(Invalid::TokenWeak));
    }

    #[test]
    fn debug_never_shows_the_token() {
        let t = Token::from_bytes(&sample_bytes()).unwrap();
        let shown = format!("{t:?} {:?}", Some(&t));
        assert!(!shown.contains(t.expose()));
        assert!(shown.contains("<redacted>"));
    }

    #[test]
    fn digest_is_sha256_of_the_ascii_token() {
        // sha256("abc")
        assert_eq!(Digest::of(b"abc").as_str(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let t = Token::from_bytes(&sample_bytes()).unwrap();
        assert_eq!(t.digest(), Digest::of(t.expose().as_bytes()));
        assert!(t.matches(&t.digest()));
        assert!(!t.matches(&Digest::of(b"other")));
    }

    #[test]
    fn digest_refuses_anything_but_64_lowercase_hex() {
        let good = Digest::of(b"x").as_str().to_owned();
        assert!(Digest::parse(&good).is_ok());
        assert_eq!(Digest::parse(&good.to_uppercase()), Err(Invalid::Digest));
        assert_eq!(Digest::parse(&good[..63]), Err(Invalid::Digest));
        assert_eq!(Digest::parse(&format!("{good}0")), Err(Invalid::Digest));
        assert_eq!(Digest::parse(&good.replace(|c: char| c.is_ascii_digit(), "g")), Err(Invalid::Digest));
    }

    #[test]
    fn ct_eq_compares_contents_and_lengths() {
        assert!(ct_eq(b"same", b"same"));
        assert!(!ct_eq(b"same", b"sane"));
        assert!(!ct_eq(b"same", b"sam"));
    }
}
