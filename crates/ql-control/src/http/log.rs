//! The live-log routes of PROTOCOL §13: `log:append` and `artifacts/{id}:seal`.
//!
//! A chunk is read like an artifact: the frame header first, then the fence and the
//! offset are checked in the store's transaction ([`Command::AdmitLogChunk`]) before any
//! content byte is read, so a refusal or an offset conflict costs the sender no upload.
//! An admitted chunk (at most 256 KiB) is read whole, put into the artifact store — the
//! storage every replica sees — and only then acknowledged in the database
//! ([`Command::AppendLog`]), so an acknowledged byte is always durable. A chunk that
//! repeats acknowledged bytes is compared with them and answered `already_appended`,
//! changing nothing.
//!
//! The seal marks the log sealed in the database first ([`Command::SealLog`]: no chunk is
//! accepted after it), then composes the artifact from the acknowledged chunks through
//! the same put-if-absent upload a `PUT` uses, so it answers exactly as the `PUT` does.
//! Composing 64 MiB takes a while, and the agent gives a request only a third of its
//! lease: the composition runs as a task of its own that outlives a request that gave up
//! ([`Sealing`]), a repeated seal joins the one in progress, and once the artifact is
//! stored a repeat is answered from its receipt (`already_stored`) without composing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::StatusCode;
use tokio::sync::watch;

use ql_wire::artifact::ArtifactReply;
use ql_wire::frame::{Item, LogChunkDecoder};
use ql_wire::ids::{ArtifactId, ProjectId};
use ql_wire::log::{LogAppendReply, LogChunkHeader, Seal};
use ql_wire::route::AttemptPath;
use ql_wire::{ErrorCode, Outcome};

use super::ingress::{after_commit, answer, next_data, open_frame, Answer, BodyClock, Injected, Shared};
use super::trail::Trail;
use crate::blob::{ArtifactKey, BlobStore, PutOutcome, Upload as _};
use crate::core::{same_bytes, ChunkPlan, Command, Reply};
use crate::fault::Fault;
use crate::model::LogChunk;
use crate::store::{Store, ALL_CHUNKS};

/// `log:append`. See the module doc.
pub(super) async fn append<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    trail: &Trail<S>,
    path: AttemptPath,
    length: u64,
    mut body: Incoming,
    injected: Injected<'_>,
) -> Answer {
    if injected.0 == Some(Fault::Refuse) {
        return Answer::refuse_and_close(ErrorCode::Unavailable);
    }
    let clock = BodyClock::new(&shared.cfg, length);
    let (mut decoder, header, pending) = match open_frame::<LogChunkHeader>(length, &mut body, &clock).await {
        Ok(opened) => opened,
        Err(answer) => return answer,
    };
    if injected.0 == Some(Fault::Conflict) {
        return Answer::log_conflict(header.offset).closing();
    }
    let admitted = trail.execute(Command::AdmitLogChunk(path.clone(), header.clone())).await;
    let admitted = match admitted {
        Ok(Ok(Reply::ChunkAdmitted(admitted))) => admitted,
        Ok(Ok(Reply::LogOffsetConflict(acked))) => return Answer::log_conflict(acked).closing(),
        Ok(Err(code)) => return Answer::refuse_and_close(code),
        Ok(Ok(_)) | Err(_) => return Answer::refuse_and_close(ErrorCode::Unavailable),
    };
    let content = match read_content(&mut decoder, &mut body, pending, &header, injected, &clock).await {
        Ok(content) => content,
        Err(answer) => return answer,
    };
    let key = key(admitted.project, &path, header.artifact_id.clone());
    // The body was read to its end: the connection stays usable whatever the outcome.
    if admitted.plan == ChunkPlan::Replay {
        return match acknowledged_equals(shared, &key, &header, &content).await {
            Ok(true) => {
                Answer::ok(StatusCode::OK, &LogAppendReply { result: Outcome::AlreadyAppended, acked: admitted.acked })
            }
            Ok(false) => Answer::log_conflict(admitted.acked),
            Err(()) => Answer::refuse(ErrorCode::Unavailable),
        };
    }
    let sha256 = match shared.blobs.put_chunk(&key, header.offset, &content).await {
        Ok(sha256) => sha256,
        Err(_) => return Answer::refuse(ErrorCode::Unavailable),
    };
    let result = shared.store.execute(Command::AppendLog(path, header, sha256)).await;
    after_commit(injected).await;
    answer(result)
}

/// The chunk's content, whole. A `reset` fault strikes halfway through it.
async fn read_content(
    decoder: &mut LogChunkDecoder,
    body: &mut Incoming,
    mut pending: Bytes,
    header: &LogChunkHeader,
    injected: Injected<'_>,
    clock: &BodyClock,
) -> Result<Vec<u8>, Answer> {
    let declared = header.content_length as usize;
    let mut content = Vec::with_capacity(declared);
    loop {
        let mut input: &[u8] = &pending;
        loop {
            match decoder.next(&mut input) {
                Ok(Some(Item::Content(bytes))) => {
                    content.extend_from_slice(bytes);
                    if injected.0 == Some(Fault::Reset) && content.len() >= declared.div_ceil(2) {
                        injected.1.fire().await;
                    }
                }
                Ok(None) => break,
                Ok(Some(Item::Header(_))) | Err(_) => return Err(Answer::refuse_and_close(ErrorCode::InvalidRequest)),
            }
        }
        pending = match next_data(body, clock).await {
            Ok(Some(data)) => data,
            Ok(None) => break,
            Err(code) => return Err(Answer::refuse_and_close(code)),
        };
    }
    if decoder.finish().is_err() {
        return Err(Answer::refuse_and_close(ErrorCode::InvalidRequest));
    }
    Ok(content)
}

fn key(project: ProjectId, path: &AttemptPath, artifact: ArtifactId) -> ArtifactKey {
    ArtifactKey { project, run: path.run.clone(), attempt: path.attempt.clone(), artifact }
}

/// Whether a repeated chunk equals the acknowledged bytes it covers. `Err` when the
/// stores could not tell.
async fn acknowledged_equals<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    key: &ArtifactKey,
    header: &LogChunkHeader,
    content: &[u8],
) -> Result<bool, ()> {
    let chunks = shared.store.log_chunks(&key.attempt, header.offset..header.end()).await.map_err(|_| ())?;
    let mut stored = Vec::new();
    for chunk in chunks {
        let bytes = shared.blobs.read_chunk(key, chunk.offset, chunk.length, &chunk.sha256).await.map_err(|_| ())?;
        stored.push((chunk, bytes));
    }
    Ok(same_bytes(header.offset, content, &stored))
}

/// How a composition ended: the store's outcome, or `Err` when the stores failed.
type Composed = Option<Result<PutOutcome, ()>>;

/// The compositions in progress in this process, by artifact: a repeated seal waits for
/// the one already running instead of composing the same bytes again.
#[derive(Default)]
pub(super) struct Sealing(Mutex<HashMap<ArtifactKey, watch::Receiver<Composed>>>);

/// `artifacts/{id}:seal`. See the module doc.
pub(super) async fn seal<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    trail: &Trail<S>,
    path: AttemptPath,
    artifact: ArtifactId,
    body: Seal,
) -> Answer {
    let (length, truncated) = (body.content_length, body.truncated);
    let project = match trail.execute(Command::SealLog(path.clone(), artifact.clone(), body)).await {
        Ok(Ok(Reply::SealAdmitted(project))) => project,
        other => return answer(other),
    };
    let key = key(project, &path, artifact);
    let outcome = match shared.blobs.inspect(&key).await {
        Err(_) => Err(()),
        Ok(Some(receipt)) if receipt.length == length && receipt.truncated == truncated => {
            Ok(PutOutcome::AlreadyStored(receipt))
        }
        Ok(Some(_)) => Ok(PutOutcome::Conflict),
        Ok(None) => composed(shared, key, length, truncated).await,
    };
    match outcome {
        Ok(PutOutcome::Stored(receipt)) => {
            Answer::ok(StatusCode::OK, &ArtifactReply { result: Outcome::Stored, receipt })
        }
        Ok(PutOutcome::AlreadyStored(receipt)) => {
            Answer::ok(StatusCode::OK, &ArtifactReply { result: Outcome::AlreadyStored, receipt })
        }
        Ok(PutOutcome::Conflict) => Answer::refuse(ErrorCode::ArtifactConflict),
        Err(()) => Answer::refuse(ErrorCode::Unavailable),
    }
}

/// The outcome of composing `key`: joins the composition in progress, or starts one as a
/// task of its own, which finishes even if this request is abandoned.
async fn composed<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    key: ArtifactKey,
    length: u64,
    truncated: bool,
) -> Result<PutOutcome, ()> {
    let mut done = {
        let mut sealing = shared.sealing.0.lock().unwrap_or_else(|e| e.into_inner());
        match sealing.get(&key) {
            Some(running) => running.clone(),
            None => {
                let (tx, rx) = watch::channel(None);
                sealing.insert(key.clone(), rx.clone());
                let shared = shared.clone();
                tokio::spawn(async move {
                    let outcome = match shared.store.log_chunks(&key.attempt, ALL_CHUNKS).await {
                        Ok(chunks) => compose(&shared.blobs, &key, &chunks, length, truncated).await,
                        Err(_) => Err(()),
                    };
                    shared.sealing.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
                    let _ = tx.send(Some(outcome));
                });
                rx
            }
        }
    };
    let outcome = match done.wait_for(Option::is_some).await {
        Ok(outcome) => outcome.clone().unwrap_or(Err(())),
        Err(_) => Err(()),
    };
    outcome
}

/// Removes the chunks of the log `key` once the attempt's completion has recorded the
/// artifact they were sealed into: every reader reads that artifact from then on
/// ([`crate::ops`]), and no chunk is admitted after a seal. A task of its own, so the
/// completion's answer does not wait for a bucket's round trips; best effort, since a
/// chunk left behind (a failure, a crash before this ran) is never read, and the
/// artifact store's collection removes it later ([`crate::serve::collect_forever`]).
pub(super) fn remove_chunks<S: Store, B: BlobStore>(shared: &Arc<Shared<S, B>>, key: ArtifactKey) {
    // Counted before the answer goes out, so a client can tell what its request started.
    shared.stats.chunk_removals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let shared = shared.clone();
    tokio::spawn(async move {
        let removed = async {
            for chunk in shared.store.log_chunks(&key.attempt, ALL_CHUNKS).await.map_err(|e| e.to_string())? {
                shared.blobs.remove_chunk(&key, chunk.offset, &chunk.sha256).await.map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(())
        };
        if let Err(e) = removed.await {
            eprintln!(
                "ql-control: the live-log chunks of attempt {} stay (for the artifact store's collection): {e}",
                key.attempt
            );
        }
    });
}

/// Streams the acknowledged chunks, in order, into one put-if-absent upload of `length`
/// bytes. Chunks that do not tile `0..length` exactly are a corrupt store: refused.
async fn compose<B: BlobStore>(
    blobs: &B,
    key: &ArtifactKey,
    chunks: &[LogChunk],
    length: u64,
    truncated: bool,
) -> Result<PutOutcome, ()> {
    let mut at = 0;
    for chunk in chunks {
        if chunk.offset != at {
            return Err(());
        }
        at += chunk.length;
    }
    if at != length {
        return Err(());
    }
    let mut upload = blobs.begin(key, length, truncated).await.map_err(|_| ())?;
    for chunk in chunks {
        let bytes = blobs.read_chunk(key, chunk.offset, chunk.length, &chunk.sha256).await.map_err(|_| ())?;
        upload.write(&bytes).await.map_err(|_| ())?;
    }
    upload.finish().await.map_err(|_| ())
}
