//! `ql-control logs`: a run's log for an operator, stored or live, local or remote.
//!
//! A run's log is its latest attempt's: the sealed artifact once one is recorded
//! (checked against its receipt's length and SHA-256 where it is read), before that the
//! acknowledged live-log chunks (PROTOCOL §13) — what the worker has delivered so far.
//! The reader asks for it a window at a time ([`crate::ops::Target::log`]); with
//! `follow` it prints what arrives as it arrives and stops once the run is terminal,
//! after the receipt's SHA-256 was checked against everything it printed. A retry's new
//! attempt starts its own log; the reader says so and follows it.

use std::io::Write;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use ql_wire::capability::Digest;
use ql_wire::ids::RunId;

use crate::ops::{LogRequest, Target};

/// The most bytes asked for at once.
const WINDOW: u64 = 1024 * 1024;

/// What has been printed of one attempt's log.
struct Printed {
    attempt: String,
    bytes: u64,
    hasher: Sha256,
}

/// Writes the run's log to `out`; see the module doc. `follow` is how long each look
/// waits for more.
pub async fn logs(target: &Target, run: &RunId, follow: Option<Duration>, out: &mut dyn Write) -> Result<(), String> {
    let mut printed: Option<Printed> = None;
    loop {
        let request = LogRequest {
            attempt: printed.as_ref().map(|p| p.attempt.clone()),
            offset: printed.as_ref().map_or(0, |p| p.bytes),
            limit: WINDOW,
            follow: follow.is_some(),
            wait_ms: follow.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        let w = target.log(run, &request).await?;
        let Some(attempt) = w.attempt.clone() else {
            if w.terminal || follow.is_none() {
                return Err(format!("run {run} has no log (status {})", w.status));
            }
            continue;
        };
        if printed.as_ref().is_none_or(|p| p.attempt != attempt) {
            if printed.is_some() {
                eprintln!("(attempt #{} starts its own log)", w.number);
            }
            printed = Some(Printed { attempt, bytes: 0, hasher: Sha256::new() });
        }
        let p = printed.as_mut().expect("set above");
        if w.offset != p.bytes {
            return Err(format!("the log of {run} was answered from byte {}, not {}", w.offset, p.bytes));
        }
        out.write_all(&w.bytes).map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
        p.hasher.update(&w.bytes);
        p.bytes += w.bytes.len() as u64;
        if let Some(receipt) = &w.sealed {
            let printed = Digest::from_raw(&std::mem::take(&mut p.hasher).finalize().into());
            if p.bytes != receipt.length || !printed.ct_eq(&receipt.sha256) {
                return Err(format!("the stored log of {run} differs from the live log printed before it"));
            }
            if follow.is_some() {
                eprintln!("(stored log: {} bytes, SHA-256 {} checked)", receipt.length, receipt.sha256);
            }
            if receipt.truncated {
                eprintln!("(log truncated at {} bytes by the worker)", receipt.length);
            }
            return Ok(());
        }
        if !w.bytes.is_empty() && w.bytes.len() as u64 >= WINDOW {
            // A full window: more is there already.
            continue;
        }
        if follow.is_none() {
            if !w.terminal {
                eprintln!("(run {}: {} bytes of its log so far)", w.status, p.bytes);
            }
            return Ok(());
        }
        if w.terminal && w.bytes.is_empty() {
            eprintln!("(run {}: no stored log; {} bytes had arrived)", w.status, p.bytes);
            return Ok(());
        }
    }
}
