//! Identifiers and counters, each a type that cannot hold a value the protocol refuses.
//!
//! Ids are parsed, never built unchecked: a `RunId` in memory always matches
//! `[A-Za-z0-9_-]{1,64}`, so paths, SQL keys and file names built from it need no escaping.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::limits::COUNTER_MAX;

/// The rule a value broke. Each maps to `400 invalid_request` on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalid {
    /// An empty string where one is required.
    Empty,
    /// Longer than the field allows, in bytes.
    TooLong {
        /// The bound.
        max: usize,
    },
    /// A character outside the field's charset.
    Charset,
    /// A control character in printable text.
    NotPrintable,
    /// A number outside its range.
    OutOfRange {
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
    /// A token that is not 43 characters.
    TokenLength,
    /// A token that is not canonical unpadded base64url.
    TokenEncoding,
    /// A token whose 32 bytes have fewer than 16 distinct values.
    TokenWeak,
    /// A digest that is not 64 lowercase hex characters.
    Digest,
    /// A time that is not RFC 3339 UTC with a `Z`.
    Timestamp,
    /// A `schema` string other than the one expected.
    Schema,
    /// More items than the field allows.
    TooMany {
        /// The bound.
        max: usize,
    },
    /// A spec with both `argv` and `script`, or neither.
    ArgvXorScript,
    /// An environment variable name outside `[A-Za-z_][A-Za-z0-9_]*`.
    EnvName,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("must not be empty"),
            Self::TooLong { max } => write!(f, "longer than {max} bytes"),
            Self::Charset => f.write_str("character outside the allowed set"),
            Self::NotPrintable => f.write_str("contains a control character"),
            Self::OutOfRange { min, max } => write!(f, "outside {min}..={max}"),
            Self::TokenLength => f.write_str("token must be 43 characters"),
            Self::TokenEncoding => f.write_str("token must be unpadded base64url of 32 bytes"),
            Self::TokenWeak => f.write_str("token has too few distinct byte values"),
            Self::Digest => f.write_str("digest must be 64 lowercase hex characters"),
            Self::Timestamp => f.write_str("time must be RFC 3339 UTC ending in Z"),
            Self::Schema => f.write_str("unexpected schema"),
            Self::TooMany { max } => write!(f, "more than {max} items"),
            Self::ArgvXorScript => f.write_str("exactly one of argv and script is required"),
            Self::EnvName => f.write_str("environment name must match [A-Za-z_][A-Za-z0-9_]*"),
        }
    }
}

impl std::error::Error for Invalid {}

/// Checks a string against a length bound and a per-character rule.
pub(crate) fn check_chars(s: &str, max: usize, first: fn(u8) -> bool, rest: fn(u8) -> bool) -> Result<(), Invalid> {
    let bytes = s.as_bytes();
    let Some((&head, tail)) = bytes.split_first() else {
        return Err(Invalid::Empty);
    };
    if bytes.len() > max {
        return Err(Invalid::TooLong { max });
    }
    if !first(head) || !tail.iter().all(|&b| rest(b)) {
        return Err(Invalid::Charset);
    }
    Ok(())
}

fn server_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

fn worker_first(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

fn worker_rest(b: u8) -> bool {
    worker_first(b) || matches!(b, b'.' | b'_' | b'-')
}

/// Declares a validated string newtype. `$check` decides what the string may be.
macro_rules! string_type {
    ($(#[$meta:meta])* $name:ident, $check:expr) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Parses and validates.
            pub fn parse(s: impl Into<String>) -> Result<Self, Invalid> {
                let s = s.into();
                let check: fn(&str) -> Result<(), Invalid> = $check;
                check(&s)?;
                Ok(Self(s))
            }

            /// The validated text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = Invalid;
            fn try_from(s: String) -> Result<Self, Invalid> {
                Self::parse(s)
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = Invalid;
            fn from_str(s: &str) -> Result<Self, Invalid> {
                Self::parse(s)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }
    };
}
pub(crate) use string_type;

string_type!(
    /// A worker's name, taken from its certificate: `[a-z0-9][a-z0-9._-]{0,62}`.
    WorkerId,
    |s| check_chars(s, 63, worker_first, worker_rest)
);

/// Declares a server-made (or worker-made artifact) id: `[A-Za-z0-9_-]{1,64}`.
macro_rules! opaque_id {
    ($($(#[$meta:meta])* $name:ident),* $(,)?) => {
        $(string_type!($(#[$meta])* $name, |s| check_chars(s, 64, server_char, server_char));)*
    };
}

opaque_id!(
    /// A worker session, made by the server.
    SessionId,
    /// A run, made by the server.
    RunId,
    /// One attempt of a run, made by the server.
    AttemptId,
    /// An execution offer, made by the server.
    OfferId,
    /// An event, made by the server.
    EventId,
    /// A project, made by the server.
    ProjectId,
    /// An artifact, named by the worker.
    ArtifactId,
);

/// A generation, version or sequence number: `1..=2^53-1`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct Counter(u64);

impl Counter {
    /// The first value of every counter.
    pub const ONE: Counter = Counter(1);

    /// Validates the range.
    pub fn new(n: u64) -> Result<Self, Invalid> {
        if (1..=COUNTER_MAX).contains(&n) {
            Ok(Self(n))
        } else {
            Err(Invalid::OutOfRange { min: 1, max: COUNTER_MAX })
        }
    }

    /// The number.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The next value, or `None` at the top of the range.
    pub fn next(self) -> Option<Self> {
        Self::new(self.0 + 1).ok()
    }
}

impl TryFrom<u64> for Counter {
    type Error = Invalid;
    fn try_from(n: u64) -> Result<Self, Invalid> {
        Self::new(n)
    }
}

impl From<Counter> for u64 {
    fn from(c: Counter) -> u64 {
        c.0
    }
}

impl fmt::Debug for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_id_accepts_its_charset_and_bounds() {
        assert!(WorkerId::parse("r1").is_ok());
        assert!(WorkerId::parse("0router.home_1-a").is_ok());
        assert!(WorkerId::parse("a".repeat(63)).is_ok());
    }

    #[test]
    fn worker_id_refuses_each_rule() {
        assert_eq!(WorkerId::parse(""), Err(Invalid::Empty));
        assert_eq!(WorkerId::parse("a".repeat(64)), Err(Invalid::TooLong { max: 63 }));
        assert_eq!(WorkerId::parse("Router"), Err(Invalid::Charset));
        assert_eq!(WorkerId::parse("-r"), Err(Invalid::Charset));
        assert_eq!(WorkerId::parse(".r"), Err(Invalid::Charset));
        assert_eq!(WorkerId::parse("r/1"), Err(Invalid::Charset));
        assert_eq!(WorkerId::parse("r%2f"), Err(Invalid::Charset));
        assert_eq!(WorkerId::parse("ré"), Err(Invalid::Charset));
    }

    #[test]
    fn opaque_ids_accept_their_charset_and_bounds() {
        assert!(RunId::parse("Run_01-x").is_ok());
        assert!(ArtifactId::parse("A".repeat(64)).is_ok());
    }

    #[test]
    fn opaque_ids_refuse_each_rule() {
        assert_eq!(RunId::parse(""), Err(Invalid::Empty));
        assert_eq!(SessionId::parse("a".repeat(65)), Err(Invalid::TooLong { max: 64 }));
        assert_eq!(OfferId::parse("a.b"), Err(Invalid::Charset));
        assert_eq!(AttemptId::parse("a b"), Err(Invalid::Charset));
        assert_eq!(ArtifactId::parse("../x"), Err(Invalid::Charset));
        assert_eq!(ProjectId::parse("a%20"), Err(Invalid::Charset));
    }

    #[test]
    fn counters_span_one_to_two_pow_53_minus_one() {
        assert_eq!(Counter::new(0), Err(Invalid::OutOfRange { min: 1, max: COUNTER_MAX }));
        assert_eq!(Counter::new(1).map(Counter::get), Ok(1));
        assert_eq!(Counter::new(COUNTER_MAX).map(Counter::get), Ok(COUNTER_MAX));
        assert!(Counter::new(COUNTER_MAX + 1).is_err());
        assert_eq!(Counter::new(COUNTER_MAX).unwrap().next(), None);
        assert_eq!(Counter::ONE.next().map(Counter::get), Some(2));
    }

    #[test]
    fn ids_deserialise_through_validation() {
        assert!(serde_json::from_str::<RunId>("\"ok_1\"").is_ok());
        assert!(serde_json::from_str::<RunId>("\"no way\"").is_err());
        assert!(serde_json::from_str::<Counter>("0").is_err());
        assert!(serde_json::from_str::<Counter>("-1").is_err());
        assert!(serde_json::from_str::<Counter>("1.5").is_err());
    }
}
