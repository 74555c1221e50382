//! Times on the wire: RFC 3339 UTC strings ending in `Z`, held as milliseconds since the
//! Unix epoch. The crate never reads a clock; callers hand times in.
//!
//! The canonical form has exactly three fraction digits (`2026-11-30T08:00:00.000Z`);
//! parsing accepts zero to nine fraction digits and keeps millisecond precision.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::ids::Invalid;

/// A UTC instant with millisecond precision, between 1970 and 9999.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Timestamp(i64);

const MS_PER_DAY: i64 = 86_400_000;
const MAX_MS: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z

impl Timestamp {
    /// From milliseconds since the epoch.
    pub fn from_millis(ms: i64) -> Result<Self, Invalid> {
        if (0..=MAX_MS).contains(&ms) {
            Ok(Self(ms))
        } else {
            Err(Invalid::Timestamp)
        }
    }

    /// Milliseconds since the epoch.
    pub fn millis(self) -> i64 {
        self.0
    }

    /// This instant plus a duration, saturating at the representable range.
    pub fn plus_millis(self, ms: i64) -> Self {
        Self(self.0.saturating_add(ms).clamp(0, MAX_MS))
    }

    /// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z`.
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        let b = s.as_bytes();
        if b.len() < 20
            || b.len() > 30
            || b[4] != b'-'
            || b[7] != b'-'
            || b[10] != b'T'
            || b[13] != b':'
            || b[16] != b':'
            || b[b.len() - 1] != b'Z'
        {
            return Err(Invalid::Timestamp);
        }
        let num = |from: usize, to: usize| -> Result<i64, Invalid> {
            b[from..to].iter().try_fold(0i64, |acc, &c| {
                if c.is_ascii_digit() {
                    Ok(acc * 10 + i64::from(c - b'0'))
                } else {
                    Err(Invalid::Timestamp)
                }
            })
        };
        let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
        let (hour, minute, second) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
        let millis = match &b[19..b.len() - 1] {
            [] => 0,
            [b'.', digits @ ..] if !digits.is_empty() => {
                let mut ms = 0;
                for (i, &c) in digits.iter().enumerate() {
                    if !c.is_ascii_digit() {
                        return Err(Invalid::Timestamp);
                    }
                    if i < 3 {
                        ms = ms * 10 + i64::from(c - b'0');
                    }
                }
                ms * 10i64.pow(3u32.saturating_sub(digits.len() as u32))
            }
            _ => return Err(Invalid::Timestamp),
        };
        if year < 1970
            || !(1..=12).contains(&month)
            || day < 1
            || day > days_in_month(year, month)
            || hour > 23
            || minute > 59
            || second > 59
        {
            return Err(Invalid::Timestamp);
        }
        let days = days_from_civil(year, month, day);
        Self::from_millis(days * MS_PER_DAY + ((hour * 60 + minute) * 60 + second) * 1000 + millis)
    }
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (days, ms) = (self.0.div_euclid(MS_PER_DAY), self.0.rem_euclid(MS_PER_DAY));
        let (y, m, d) = civil_from_days(days);
        let (secs, frac) = (ms / 1000, ms % 1000);
        write!(f, "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{frac:03}Z", secs / 3600, secs / 60 % 60, secs % 60)
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl TryFrom<String> for Timestamp {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        Self::parse(&s)
    }
}

impl From<Timestamp> for String {
    fn from(t: Timestamp) -> String {
        t.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form_round_trips() {
        for s in [
            "1970-01-01T00:00:00.000Z",
            "2026-11-30T08:05:09.042Z",
            "2024-02-29T23:59:59.999Z",
            "9999-12-31T23:59:59.999Z",
        ] {
            assert_eq!(Timestamp::parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn known_instants_match_the_epoch() {
        assert_eq!(Timestamp::parse("1970-01-01T00:00:00Z").unwrap().millis(), 0);
        assert_eq!(Timestamp::parse("2001-09-09T01:46:40Z").unwrap().millis(), 1_000_000_000_000);
        assert_eq!(Timestamp::parse("2001-09-09T01:46:40.5Z").unwrap().millis(), 1_000_000_000_500);
        assert_eq!(Timestamp::parse("2001-09-09T01:46:40.123456789Z").unwrap().millis(), 1_000_000_000_123);
    }

    #[test]
    fn every_millisecond_of_a_day_boundary_formats_back() {
        for ms in [0, 1, 999, 86_399_999, 86_400_000, 951_782_400_000, 1_798_761_599_999] {
            let t = Timestamp::from_millis(ms).unwrap();
            assert_eq!(Timestamp::parse(&t.to_string()).unwrap(), t);
        }
    }

    #[test]
    fn refuses_non_utc_and_malformed_times() {
        for s in [
            "",
            "2026-11-30T08:00:00",
            "2026-11-30T08:00:00+08:00",
            "2026-11-30t08:00:00z",
            "2026-11-30 08:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "2026-11-31T00:00:00Z",
            "2026-11-30T24:00:00Z",
            "2026-11-30T08:60:00Z",
            "2026-11-30T08:00:60Z",
            "1969-12-31T23:59:59Z",
            "2026-11-30T08:00:00.Z",
            "2026-11-30T08:00:00.1234567890Z",
            "+2026-11-30T08:00:00Z",
        ] {
            assert_eq!(Timestamp::parse(s), Err(Invalid::Timestamp), "{s}");
        }
    }
}
