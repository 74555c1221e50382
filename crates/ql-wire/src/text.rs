//! Bounded printable text: the free-form strings of the protocol, each with a fixed upper
//! bound so no field can carry an unbounded payload.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::ids::{string_type, Invalid};
use crate::limits::{HANDLE_MAX_BYTES, LABEL_VALUE_MAX_BYTES, REASON_MAX_BYTES, SHORT_TEXT_MAX_BYTES};

/// Non-empty, at most `max` bytes of UTF-8, and no control characters.
pub(crate) fn check_printable(s: &str, max: usize) -> Result<(), Invalid> {
    if s.is_empty() {
        return Err(Invalid::Empty);
    }
    if s.len() > max {
        return Err(Invalid::TooLong { max });
    }
    if s.chars().any(char::is_control) {
        return Err(Invalid::NotPrintable);
    }
    Ok(())
}

fn label_key_char(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-' | b'/')
}

string_type!(
    /// The agent's version string, for operators.
    AgentVersion,
    |s| check_printable(s, SHORT_TEXT_MAX_BYTES)
);

string_type!(
    /// The agent's CPU architecture (`mipsel`, `aarch64`, ...).
    Arch,
    |s| check_printable(s, SHORT_TEXT_MAX_BYTES)
);

string_type!(
    /// A placement label name: `[a-z0-9._/-]{1,63}`.
    LabelKey,
    |s| crate::ids::check_chars(s, 63, label_key_char, label_key_char)
);

string_type!(
    /// A placement label value.
    LabelValue,
    |s| check_printable(s, LABEL_VALUE_MAX_BYTES)
);

string_type!(
    /// How the worker finds its executor again after a restart (a pid and start time,
    /// say): printable UTF-8, 1..=512 bytes, stable for the attempt.
    ExecutorHandle,
    |s| check_printable(s, HANDLE_MAX_BYTES)
);

string_type!(
    /// A low-sensitivity summary of why a start failed: printable, 1..=256 bytes.
    Reason,
    |s| check_printable(s, REASON_MAX_BYTES)
);

impl Reason {
    /// Builds a reason from any text, cutting it at a character boundary within the bound
    /// and replacing control characters, so an error message can always be reported.
    pub fn summarise(text: &str) -> Self {
        let mut out = String::new();
        for c in text.chars() {
            let c = if c.is_control() { ' ' } else { c };
            if out.len() + c.len_utf8() > REASON_MAX_BYTES {
                break;
            }
            out.push(c);
        }
        if out.trim().is_empty() {
            out = "unknown".to_owned();
        }
        Self(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_bounds_are_one_to_512_printable_bytes() {
        assert!(ExecutorHandle::parse("pid:42 start:9").is_ok());
        assert!(ExecutorHandle::parse("é".repeat(256)).is_ok());
        assert_eq!(ExecutorHandle::parse(""), Err(Invalid::Empty));
        assert_eq!(ExecutorHandle::parse("a".repeat(513)), Err(Invalid::TooLong { max: 512 }));
        assert_eq!(ExecutorHandle::parse("pid\n42"), Err(Invalid::NotPrintable));
        assert_eq!(ExecutorHandle::parse("pid\u{7f}"), Err(Invalid::NotPrintable));
    }

    #[test]
    fn reason_summarise_always_yields_a_valid_reason() {
        let long = "x".repeat(1000);
        assert_eq!(Reason::summarise(&long).as_str().len(), 256);
        assert_eq!(Reason::summarise("a\nb").as_str(), "a b");
        assert_eq!(Reason::summarise("").as_str(), "unknown");
        let multi = "é".repeat(200);
        assert!(Reason::parse(Reason::summarise(&multi).as_str()).is_ok());
    }

    #[test]
    fn label_keys_use_their_charset() {
        assert!(LabelKey::parse("arch/mips").is_ok());
        assert_eq!(LabelKey::parse("Arch"), Err(Invalid::Charset));
        assert_eq!(LabelKey::parse("a".repeat(64)), Err(Invalid::TooLong { max: 63 }));
    }
}
