//! Lines about refused connections, at a bounded rate.
//!
//! A failed TLS handshake or a connection turned away at a limit is worth a line to the
//! operator (a misconfigured agent, a scan, an attack), but an attacker decides how many
//! there are: one line per event would let anyone fill the disk. A [`Report`] prints at
//! most one line per interval, counting what it did not print, and the counters of
//! [`super::IngressStats`] keep the exact totals.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// One kind of event, reported at most once per `every`.
#[derive(Debug)]
pub(crate) struct Report {
    what: &'static str,
    every: Duration,
    /// When the last line went out, and how many events since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Report {
    pub(crate) fn new(what: &'static str, every: Duration) -> Self {
        Self { what, every, state: Mutex::new((None, 0)) }
    }

    /// Counts one event; returns the line to print when one is due.
    pub(super) fn note(&self, detail: &str) -> Option<String> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.1 += 1;
        if state.0.is_some_and(|last| now.duration_since(last) < self.every) {
            return None;
        }
        let line = format!("ql-control: {} {} since the last report; the latest: {detail}", state.1, self.what);
        *state = (Some(now), 0);
        Some(line)
    }

    /// Counts one event and prints the line when one is due.
    pub(crate) fn event(&self, detail: &str) {
        if let Some(line) = self.note(detail) {
            eprintln!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_line_per_interval_counting_the_ones_in_between() {
        let report = Report::new("TLS handshake(s) failed", Duration::from_secs(10));
        let first = report.note("from 10.0.0.1: no certificate").unwrap();
        assert!(first.contains("1 TLS handshake(s) failed"), "{first}");
        for _ in 0..99 {
            assert_eq!(report.note("from 10.0.0.1: no certificate"), None);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        let next = report.note("from 10.0.0.2: timed out").unwrap();
        assert!(next.contains("100 TLS handshake(s) failed"), "{next}");
        assert!(next.ends_with("from 10.0.0.2: timed out"), "{next}");
    }
}
