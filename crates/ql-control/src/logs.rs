//! `ql-control logs`: a run's log for an operator, stored or live.
//!
//! A run's log is its latest attempt's: the sealed artifact once one is recorded
//! (checked against its receipt's length and SHA-256), before that the acknowledged
//! live-log chunks (PROTOCOL §13) — what the worker has delivered so far. With `follow`,
//! the reader prints what arrives as it arrives, polling the store, and stops once the
//! run is terminal, after the stored log's SHA-256 was checked against everything it
//! printed. A retry's new attempt starts its own log; the reader says so and follows it.

use std::io::Write;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use ql_wire::capability::Digest;
use ql_wire::ids::{AttemptId, RunId};

use crate::admin::detail;
use crate::blob::{ArtifactKey, BlobStore};
use crate::model::{Attempt, AttemptStatus};
use crate::store::{RunDetail, Store};

/// What has been printed of one attempt's log.
struct Printed {
    attempt: AttemptId,
    bytes: u64,
    hasher: Sha256,
}

/// Writes the run's log to `out`; see the module doc. `follow` is the poll interval.
pub async fn logs<S: Store, B: BlobStore>(
    store: &S,
    blobs: &B,
    run: &RunId,
    follow: Option<Duration>,
    out: &mut dyn Write,
) -> Result<(), String> {
    let mut printed: Option<Printed> = None;
    loop {
        let d = detail(store, run).await?;
        let terminal = d.run.status.is_terminal();
        let Some(attempt) = target(&d, follow.is_some() && !terminal) else {
            if terminal || follow.is_none() {
                return Err(format!("run {run} has no log (status {})", d.run.status));
            }
            wait(follow).await;
            continue;
        };
        if printed.as_ref().is_none_or(|p| p.attempt != attempt.id) {
            if printed.is_some() {
                eprintln!("(attempt #{} starts its own log)", attempt.number);
            }
            printed = Some(Printed { attempt: attempt.id.clone(), bytes: 0, hasher: Sha256::new() });
        }
        let p = printed.as_mut().expect("set above");
        let key = |artifact| ArtifactKey {
            project: d.run.project.clone(),
            run: d.run.id.clone(),
            attempt: attempt.id.clone(),
            artifact,
        };
        // While following, the live chunks are printed until the run ends; the stored
        // log then checks all of them.
        let stored = attempt.artifact.as_ref().filter(|_| terminal || follow.is_none());
        if let Some(receipt) = stored {
            let content = blobs
                .read(&key(receipt.artifact_id.clone()))
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("the log of {run} is recorded but missing from the artifact store"))?;
            if content.len() as u64 != receipt.length || !Digest::of(&content).ct_eq(&receipt.sha256) {
                return Err(format!("the stored log of {run} does not match its receipt (SHA-256 or length differs)"));
            }
            let seen = usize::try_from(p.bytes).unwrap_or(usize::MAX).min(content.len());
            let prefix = Digest::from_raw(&std::mem::take(&mut p.hasher).finalize().into());
            if seen as u64 != p.bytes || !Digest::of(&content[..seen]).ct_eq(&prefix) {
                return Err(format!("the stored log of {run} differs from the live log printed before it"));
            }
            out.write_all(&content[seen..]).map_err(|e| e.to_string())?;
            out.flush().map_err(|e| e.to_string())?;
            if follow.is_some() {
                eprintln!("(stored log: {} bytes, SHA-256 {} checked)", receipt.length, receipt.sha256);
            }
            if receipt.truncated {
                eprintln!("(log truncated at {} bytes by the worker)", receipt.length);
            }
            return Ok(());
        } else {
            print_chunks(store, blobs, &key, attempt, p, out).await?;
            if follow.is_none() {
                if !terminal {
                    eprintln!("(run {}: {} bytes of its log so far)", d.run.status, p.bytes);
                }
                return Ok(());
            }
            if terminal {
                eprintln!("(run {}: no stored log; {} bytes had arrived)", d.run.status, p.bytes);
                return Ok(());
            }
        }
        wait(follow).await;
    }
}

/// The attempt whose log is the run's: the latest one; for a finished run, or a look
/// without following, the latest one that has any log.
fn target(d: &RunDetail, live: bool) -> Option<&Attempt> {
    if live {
        return d.attempts.last().filter(|a| a.status != AttemptStatus::Offered);
    }
    d.attempts.iter().rev().find(|a| a.artifact.is_some() || a.log_acked > 0)
}

/// Prints the acknowledged chunks past what was printed.
async fn print_chunks<S: Store, B: BlobStore>(
    store: &S,
    blobs: &B,
    key: &dyn Fn(ql_wire::ids::ArtifactId) -> ArtifactKey,
    attempt: &Attempt,
    p: &mut Printed,
    out: &mut dyn Write,
) -> Result<(), String> {
    let Some(artifact) = attempt.log_artifact.clone() else {
        return Ok(());
    };
    let key = key(artifact);
    for chunk in store.log_chunks(&attempt.id).await.map_err(|e| e.to_string())? {
        let end = chunk.offset + chunk.length;
        if end <= p.bytes {
            continue;
        }
        let bytes =
            blobs.read_chunk(&key, chunk.offset, chunk.length, &chunk.sha256).await.map_err(|e| e.to_string())?;
        let from = usize::try_from(p.bytes.saturating_sub(chunk.offset)).unwrap_or(usize::MAX).min(bytes.len());
        out.write_all(&bytes[from..]).map_err(|e| e.to_string())?;
        p.hasher.update(&bytes[from..]);
        p.bytes = end;
    }
    out.flush().map_err(|e| e.to_string())
}

async fn wait(follow: Option<Duration>) {
    tokio::time::sleep(follow.unwrap_or_default()).await;
}
