//! The artifact store seam (PROTOCOL §9): immutable, put-if-absent, keyed by project,
//! run, attempt and artifact id. It never sees a worker identity or a token.
//!
//! A put streams content in through [`BlobStore::begin`] and [`Upload::write`], hashing
//! as it goes, and [`Upload::finish`] makes it visible atomically. Same key and same
//! content again is a replay with the same receipt; same key, other content, a conflict.
//!
//! The chunks of a live log (PROTOCOL §13) live beside the artifact they are sealed into,
//! each named by its offset and its SHA-256: immutable too, and put before the database
//! acknowledges them, so an acknowledged chunk always exists. Which chunks make the log
//! is the database's word (its `log_chunks` rows); a chunk the database never
//! acknowledged (a crash between the put and the commit) is unreferenced garbage.

pub mod any;
pub mod fs;
pub mod s3;

use std::collections::HashSet;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ArtifactId, AttemptId, ProjectId, RunId};

/// Where an artifact lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ArtifactKey {
    /// Project.
    pub project: ProjectId,
    /// Run.
    pub run: RunId,
    /// Attempt.
    pub attempt: AttemptId,
    /// Artifact.
    pub artifact: ArtifactId,
}

impl ArtifactKey {
    /// The key the parts of a stored name give (`<project>/<run>/<attempt>/` and the
    /// artifact of its file name), when each is a valid id.
    pub(crate) fn parse(project: &str, run: &str, attempt: &str, artifact: &str) -> Option<Self> {
        Some(Self {
            project: ProjectId::parse(project).ok()?,
            run: RunId::parse(run).ok()?,
            attempt: AttemptId::parse(attempt).ok()?,
            artifact: ArtifactId::parse(artifact).ok()?,
        })
    }
}

/// The file (or object) name of a live-log chunk in its attempt's place, in every store.
pub(crate) fn chunk_file(artifact: &ArtifactId, offset: u64, sha256: &Digest) -> String {
    format!("{artifact}.chunk.{offset}.{}", sha256.as_str())
}

/// The artifact whose chunk `name` is, when it is exactly what [`chunk_file`] writes (no
/// sign or leading zero in the offset, a whole digest).
pub(crate) fn chunk_artifact(name: &str) -> Option<&str> {
    let (artifact, rest) = name.split_once(".chunk.")?;
    let (offset, digest) = rest.split_once('.')?;
    offset.parse::<u64>().ok().filter(|n| n.to_string() == offset)?;
    Digest::parse(digest).ok()?;
    Some(artifact)
}

/// How a put ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored now.
    Stored(Receipt),
    /// The same content was stored before; this is its receipt.
    AlreadyStored(Receipt),
    /// Other content is stored under the key; nothing changed.
    Conflict,
}

/// What [`BlobStore::collect`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collected {
    /// Leftovers of uploads removed: files or objects.
    pub removed: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Live-log chunks of recorded logs removed.
    pub chunks: u64,
    /// Their bytes.
    pub chunk_bytes: u64,
    /// Attempts with old chunks the authority could not answer about: their chunks stay
    /// until a later collection (the rest of the store is collected all the same).
    pub unanswered: u64,
}

/// The authority's word on whether an attempt has recorded its log's artifact. From then
/// on no reader reads the attempt's live-log chunks, so [`BlobStore::collect`] may remove
/// the ones whose removal at the completion did not happen (the store was down just then,
/// or the server stopped first). Only the database can tell such chunks from those of a
/// log still being written, or of an attempt that ended without one.
pub trait Recorded: Clone + Send + Sync + 'static {
    /// Whether the attempt `key` names has recorded that artifact.
    fn recorded(&self, key: &ArtifactKey) -> impl Future<Output = Result<Recording, BlobError>> + Send;
}

/// What [`Recorded`] says of an attempt's artifact. Only [`Recording::Recorded`] lets its
/// chunks go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    /// Recorded: every reader reads the artifact, none the chunks.
    Recorded,
    /// Not yet: the attempt has not ended, its log may still be being written.
    NotYet,
    /// Never: the attempt ended without recording it (or there is no such attempt under
    /// that project), so its chunks are its log for good. This answer cannot change.
    Never,
}

/// A [`Recorded`] that remembers up to `capacity` artifacts answered [`Recording::Never`],
/// the one answer that cannot change. `serve` keeps one across its collections, so the
/// chunks of an attempt that ended without a completion (its log for good) cost the
/// database one question per process, not one every pass. Past `capacity` the rest are
/// asked each pass, as without it.
///
/// It keeps a keyed 64-bit hash of each key, not the key (16 bytes or so each, not a
/// few hundred): two keys sharing a hash, a chance in 2^64 per pair under a key no one
/// outside the process knows, would only keep the other attempt's chunks until a restart.
#[derive(Clone)]
pub struct Remembering<R> {
    inner: R,
    never: Arc<Mutex<HashSet<u64>>>,
    hasher: RandomState,
    capacity: usize,
}

impl<R: Recorded> Remembering<R> {
    /// Remembers up to `capacity` answers of `inner` (0: none).
    pub fn new(inner: R, capacity: usize) -> Self {
        Self { inner, never: Arc::default(), hasher: RandomState::new(), capacity }
    }

    fn never(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.never.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<R: Recorded> Recorded for Remembering<R> {
    async fn recorded(&self, key: &ArtifactKey) -> Result<Recording, BlobError> {
        let hash = self.hasher.hash_one(key);
        if self.never().contains(&hash) {
            return Ok(Recording::Never);
        }
        let answer = self.inner.recorded(key).await?;
        if answer == Recording::Never {
            let mut never = self.never();
            if never.len() < self.capacity {
                never.insert(hash);
            }
        }
        Ok(answer)
    }
}

/// The store failed (disk, permissions, network to the bucket).
#[derive(Debug)]
pub struct BlobError(pub String);

impl std::fmt::Display for BlobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "artifact store: {}", self.0)
    }
}

impl std::error::Error for BlobError {}

impl From<std::io::Error> for BlobError {
    fn from(e: std::io::Error) -> Self {
        Self(e.to_string())
    }
}

/// Whether an upload takes `len` more bytes: not once it failed, and not past its declared
/// length, which fails it (every store refuses the same way).
fn admit_write(failed: &mut bool, written: u64, declared: u64, len: usize) -> Result<(), BlobError> {
    if *failed {
        return Err(BlobError("upload already failed".into()));
    }
    if written.saturating_add(len as u64) > declared {
        *failed = true;
        return Err(BlobError(format!("more than the declared {declared} bytes")));
    }
    Ok(())
}

/// An upload in progress. Dropping it without [`Upload::finish`] discards it.
pub trait Upload: Send {
    /// Appends content.
    fn write(&mut self, bytes: &[u8]) -> impl Future<Output = Result<(), BlobError>> + Send;

    /// The receipt of everything written, once it is all the declared length: what the
    /// database claims for the artifact before [`Upload::finish`] publishes it.
    fn receipt(&self) -> Result<Receipt, BlobError>;

    /// Makes the content durable and visible, unless other content holds the key.
    fn finish(self) -> impl Future<Output = Result<PutOutcome, BlobError>> + Send;
}

/// An immutable artifact store.
pub trait BlobStore: Clone + Send + Sync + 'static {
    /// The upload type.
    type Upload: Upload;

    /// Starts an upload of exactly `length` bytes; `truncated` is recorded in the receipt.
    fn begin(
        &self,
        key: &ArtifactKey,
        length: u64,
        truncated: bool,
    ) -> impl Future<Output = Result<Self::Upload, BlobError>> + Send;

    /// The receipt of what is stored under `key`, re-read from the store.
    fn inspect(&self, key: &ArtifactKey) -> impl Future<Output = Result<Option<Receipt>, BlobError>> + Send;

    /// At most `limit` bytes of the stored content from `offset` (operators read logs
    /// with it, a window at a time); `None` when nothing is stored under `key`.
    fn read(
        &self,
        key: &ArtifactKey,
        offset: u64,
        limit: u64,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, BlobError>> + Send;

    /// Stores one live-log chunk of the artifact `key` at `offset`, durably, and returns
    /// its SHA-256. The same bytes again are stored once.
    fn put_chunk(
        &self,
        key: &ArtifactKey,
        offset: u64,
        bytes: &[u8],
    ) -> impl Future<Output = Result<Digest, BlobError>> + Send;

    /// The bytes of the chunk at `offset` with digest `sha256`, checked against both
    /// `length` and the digest (a missing or altered chunk is an error).
    fn read_chunk(
        &self,
        key: &ArtifactKey,
        offset: u64,
        length: u64,
        sha256: &Digest,
    ) -> impl Future<Output = Result<Vec<u8>, BlobError>> + Send;

    /// Removes the chunk at `offset` with digest `sha256`. Once the artifact composed from
    /// a log's chunks is recorded, every reader reads that artifact, never its chunks
    /// again. A chunk already gone is no error.
    fn remove_chunk(
        &self,
        key: &ArtifactKey,
        offset: u64,
        sha256: &Digest,
    ) -> impl Future<Output = Result<(), BlobError>> + Send;

    /// Removes everything stored for the run `run` of `project`: every attempt's
    /// artifacts, receipts, live-log chunks and leftovers. Returns how many files or
    /// objects went; a run with nothing stored is no error. The authority calls it for an
    /// ended run past its retention, before it removes the run's rows, so a failure keeps
    /// both for the next sweep.
    fn remove_run(&self, project: &ProjectId, run: &RunId) -> impl Future<Output = Result<u64, BlobError>> + Send;

    /// Removes what uploads that never completed left behind, last written before
    /// `before`: content no receipt names and temporary files. `before` must be older than
    /// any upload in progress can be (the caller's bound); then nothing removed can ever be
    /// named or read, and replicas may collect at the same time. Also removes the
    /// live-log chunks last written before `before` of every attempt `recorded` says has
    /// recorded its artifact (asked once for each attempt that has such chunks; one it
    /// cannot answer about keeps them, and is counted).
    fn collect<R: Recorded>(
        &self,
        before: SystemTime,
        recorded: &R,
    ) -> impl Future<Output = Result<Collected, BlobError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An authority that answers by attempt (`att_ended`: never, `att_down`: an error,
    /// any other: not yet) and counts what it is asked.
    #[derive(Clone, Default)]
    struct Counting(Arc<Mutex<Vec<String>>>);

    impl Counting {
        fn asked(&self, attempt: &str) -> usize {
            self.0.lock().unwrap().iter().filter(|a| *a == attempt).count()
        }
    }

    impl Recorded for Counting {
        async fn recorded(&self, key: &ArtifactKey) -> Result<Recording, BlobError> {
            self.0.lock().unwrap().push(key.attempt.to_string());
            match key.attempt.as_str() {
                "att_down" => Err(BlobError("the authority is down".into())),
                a if a.starts_with("att_ended") => Ok(Recording::Never),
                _ => Ok(Recording::NotYet),
            }
        }
    }

    fn key(attempt: &str) -> ArtifactKey {
        ArtifactKey::parse("p", "run_1", attempt, "log").unwrap()
    }

    fn ask(remembering: &Remembering<Counting>, attempt: &str, times: usize) -> Vec<Result<Recording, String>> {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        (0..times).map(|_| runtime.block_on(remembering.recorded(&key(attempt))).map_err(|e| e.0)).collect()
    }

    #[test]
    fn only_a_never_is_remembered() {
        let counting = Counting::default();
        let remembering = Remembering::new(counting.clone(), 8);
        assert_eq!(ask(&remembering, "att_ended", 3), vec![Ok(Recording::Never); 3]);
        assert_eq!(ask(&remembering, "att_open", 3), vec![Ok(Recording::NotYet); 3]);
        assert_eq!(ask(&remembering, "att_down", 2), vec![Err("the authority is down".to_owned()); 2]);
        let asked: Vec<usize> = ["att_ended", "att_open", "att_down"].iter().map(|a| counting.asked(a)).collect();
        assert_eq!(asked, [1, 3, 2]);
        // Another artifact of the same attempt is another question.
        let mut other = key("att_ended");
        other.artifact = ArtifactId::parse("other").unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(runtime.block_on(remembering.recorded(&other)).unwrap(), Recording::Never);
        assert_eq!(counting.asked("att_ended"), 2);
    }

    #[test]
    fn past_its_capacity_the_rest_are_asked_each_time() {
        let counting = Counting::default();
        let remembering = Remembering::new(counting.clone(), 1);
        for attempt in ["att_ended_a", "att_ended_b"] {
            assert_eq!(ask(&remembering, attempt, 3), vec![Ok(Recording::Never); 3]);
        }
        assert_eq!((counting.asked("att_ended_a"), counting.asked("att_ended_b")), (1, 3));
        let none = Remembering::new(counting.clone(), 0);
        assert_eq!(ask(&none, "att_ended_a", 2), vec![Ok(Recording::Never); 2]);
        assert_eq!(counting.asked("att_ended_a"), 3);
    }
}
