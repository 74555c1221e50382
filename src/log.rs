//! Log lines: one concise line per event on stderr, prefixed with its level.
//!
//! procd and journald capture stderr and add their own timestamps, so lines carry none.
//! What goes into a line is the caller's duty: ids, codes and counts, never a token, a key
//! or an environment value. The level is process-wide; an 8-bit atomic is used because
//! 32-bit MIPS routers have no 64-bit ones.

use std::sync::atomic::{AtomicU8, Ordering};

/// How much to log. Each level includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    /// Something failed and needs an operator.
    Error = 0,
    /// Something went wrong and was handled (a job dropped, a call repeated).
    Warn = 1,
    /// The life of sessions and jobs.
    Info = 2,
    /// Every call.
    Debug = 3,
}

impl Level {
    /// Parses a level's name.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        match text {
            "error" => Some(Self::Error),
            "warn" => Some(Self::Warn),
            "info" => Some(Self::Info),
            "debug" => Some(Self::Debug),
            _ => None,
        }
    }

    /// The level's name, as the line prefix.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
        }
    }
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Info as u8);

/// Sets the process-wide level.
pub(crate) fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether lines of `level` are written.
pub(crate) fn enabled(level: Level) -> bool {
    level as u8 <= LEVEL.load(Ordering::Relaxed)
}

/// Writes one line, if its level is enabled. Use the macros.
pub(crate) fn write(level: Level, args: std::fmt::Arguments<'_>) {
    if enabled(level) {
        eprintln!("{}: {args}", level.as_str());
    }
}

/// Logs at error level.
macro_rules! error {
    ($($t:tt)*) => { $crate::log::write($crate::log::Level::Error, format_args!($($t)*)) };
}
/// Logs at warn level.
macro_rules! warn {
    ($($t:tt)*) => { $crate::log::write($crate::log::Level::Warn, format_args!($($t)*)) };
}
/// Logs at info level.
macro_rules! info {
    ($($t:tt)*) => { $crate::log::write($crate::log::Level::Info, format_args!($($t)*)) };
}
/// Logs at debug level.
macro_rules! debug {
    ($($t:tt)*) => { $crate::log::write($crate::log::Level::Debug, format_args!($($t)*)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_order() {
        for level in [Level::Error, Level::Warn, Level::Info, Level::Debug] {
            assert_eq!(Level::parse(level.as_str()), Some(level));
        }
        assert_eq!(Level::parse("INFO"), None);
        assert!(Level::Error < Level::Debug);
    }
}
