//! The local-files artifact store: the single-node default (replicas share a bucket).
//!
//! # Layout
//!
//! ```text
//! <root>/<project>/<run>/<attempt>/
//!     <artifact>.<sha256>             the content, named by its digest
//!     <artifact>.receipt.json         {artifactId, length, sha256, truncated}: the commit
//!     .<artifact>.<random>.tmp        an upload in progress (or a receipt being written)
//!     <artifact>.chunk.<offset>.<sha256>  one live-log chunk (PROTOCOL §13)
//!                                     (until the completion records the artifact)
//! ```
//!
//! Every path part is a validated id (`[A-Za-z0-9_-]{1,64}`), so none can be empty, `.`,
//! `..` or contain a separator, and no id contains a `.`: content, receipt and temporary
//! names of different artifacts never collide.
//!
//! # Put-if-absent, immutable, crash-safe
//!
//! An upload streams into a temporary file in the final directory while hashing and
//! counting, so memory stays bounded whatever the size. [`Upload::finish`] then:
//!
//! 1. refuses a byte count other than the declared length (the temporary file goes);
//! 2. fsyncs the content;
//! 3. if a receipt exists, answers from it: same length, digest and truncation is
//!    `AlreadyStored` with the stored receipt, anything else is `Conflict`;
//! 4. publishes the content as `<artifact>.<sha256>` with `hard_link`, which never
//!    overwrites (an existing file of that name already holds these very bytes), and
//!    fsyncs the directory;
//! 5. writes the receipt to a temporary file, fsyncs it, and publishes it with
//!    `hard_link` — the commit point — then fsyncs the directory and its ancestors.
//!    Losing that race to a concurrent upload is answered like step 3.
//!
//! Content is durable before any receipt names it, so a crash at any point leaves either
//! no receipt (the key is still free; a leftover content file is harmless and is reused
//! by an identical retry) or a receipt whose content exists. [`BlobStore::inspect`]
//! reads only the receipt and checks that the content exists with the receipt's length;
//! it does not re-hash 64 MiB. A receipt without matching content is reported as an
//! error, never as absent, so corruption fails closed.
//!
//! [`BlobStore::collect`] removes, once older than its bound, the temporary files of
//! uploads that never finished, content its artifact's receipt does not name, and the
//! chunks of attempts the authority says have recorded their log.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ArtifactId, ProjectId, RunId};
use ql_wire::limits::ARTIFACT_CONTENT_MAX;

use super::{ArtifactKey, BlobError, BlobStore, Collected, PutOutcome, Recorded, Recording, Upload};

/// Artifacts as files under one root directory.
#[derive(Debug, Clone)]
pub struct FsBlobStore {
    root: Arc<PathBuf>,
}

fn err(what: impl std::fmt::Display) -> BlobError {
    BlobError(what.to_string())
}

/// A directory only the owner may enter: logs can hold whatever a job printed.
fn make_dirs(path: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path)
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    File::open(path)?.sync_all()
}

fn random_suffix() -> Result<String, BlobError> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes).map_err(|e| err(format!("no randomness for a temporary name: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn remove_quietly(path: &Path) {
    // Best effort: a leftover temporary file is garbage, not a fact anyone reads.
    let _ = std::fs::remove_file(path);
}

impl FsBlobStore {
    /// Opens the store at `root`, creating it (mode 0700) if needed.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, BlobError> {
        let root = root.as_ref().to_path_buf();
        make_dirs(&root)?;
        Ok(Self { root: Arc::new(root) })
    }

    /// The store at `root` for reading only: nothing is created, so an operator command
    /// on a machine without the directory changes nothing there (and finds no log).
    pub fn existing(root: impl AsRef<Path>) -> Self {
        Self { root: Arc::new(root.as_ref().to_path_buf()) }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self, key: &ArtifactKey) -> PathBuf {
        self.root.join(key.project.as_str()).join(key.run.as_str()).join(key.attempt.as_str())
    }

    /// Syncs the attempt directory and every ancestor up to the root, so directories
    /// created for this upload survive power loss along with the entries in them.
    fn sync_chain(&self, dir: &Path) -> std::io::Result<()> {
        let mut at = Some(dir);
        while let Some(d) = at {
            sync_dir(d)?;
            if d == self.root.as_path() {
                break;
            }
            at = d.parent();
        }
        Ok(())
    }
}

fn receipt_path(dir: &Path, artifact: &ArtifactId) -> PathBuf {
    dir.join(format!("{artifact}.receipt.json"))
}

fn content_path(dir: &Path, artifact: &ArtifactId, sha256: &Digest) -> PathBuf {
    dir.join(format!("{artifact}.{}", sha256.as_str()))
}

fn chunk_path(dir: &Path, artifact: &ArtifactId, offset: u64, sha256: &Digest) -> PathBuf {
    dir.join(super::chunk_file(artifact, offset, sha256))
}

/// Writes a chunk under its digest's name: a temporary file, fsynced, linked (never
/// overwriting: an existing file of that name holds these very bytes), then the
/// directory chain fsynced, so the chunk is durable before the database acknowledges it.
fn write_chunk(store: &FsBlobStore, dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), BlobError> {
    // Only a directory made now needs its ancestors synced; after the first chunk of an
    // attempt, syncing the attempt's own directory is enough.
    let fresh = !dir.is_dir();
    make_dirs(dir)?;
    let tmp = dir.join(format!(".chunk.{}.tmp", random_suffix()?));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        remove_quietly(&tmp);
        return Err(e.into());
    }
    let linked = std::fs::hard_link(&tmp, path);
    remove_quietly(&tmp);
    match linked {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if std::fs::metadata(path)?.len() != bytes.len() as u64 {
                return Err(err("chunk file of this digest has another length"));
            }
        }
        Err(e) => return Err(e.into()),
    }
    if fresh {
        store.sync_chain(dir)?;
    } else {
        sync_dir(dir)?;
    }
    Ok(())
}

/// The committed receipt for `artifact` in `dir`, checked against its content.
fn read_receipt(dir: &Path, artifact: &ArtifactId) -> Result<Option<Receipt>, BlobError> {
    let bytes = match std::fs::read(receipt_path(dir, artifact)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let receipt: Receipt = serde_json::from_slice(&bytes).map_err(|e| err(format!("unreadable receipt: {e}")))?;
    if &receipt.artifact_id != artifact {
        return Err(err("receipt names another artifact"));
    }
    let content = content_path(dir, artifact, &receipt.sha256);
    match std::fs::metadata(&content) {
        Ok(m) if m.is_file() && m.len() == receipt.length => Ok(Some(receipt)),
        Ok(_) => Err(err("stored content does not match its receipt")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(err("receipt without content")),
        Err(e) => Err(e.into()),
    }
}

fn compare(stored: Receipt, offered: &Receipt) -> PutOutcome {
    if &stored == offered {
        PutOutcome::AlreadyStored(stored)
    } else {
        PutOutcome::Conflict
    }
}

/// Steps 3 to 5 of the module doc, on a blocking thread. `tmp` holds exactly the
/// receipt's bytes, already fsynced.
fn publish(store: &FsBlobStore, dir: &Path, tmp: &Path, receipt: &Receipt) -> Result<PutOutcome, BlobError> {
    let artifact = &receipt.artifact_id;
    if let Some(stored) = read_receipt(dir, artifact)? {
        remove_quietly(tmp);
        return Ok(compare(stored, receipt));
    }
    let content = content_path(dir, artifact, &receipt.sha256);
    match std::fs::hard_link(tmp, &content) {
        Ok(()) => {}
        // Named by its digest: an existing file holds these bytes (left by a crashed or
        // concurrent identical put). Its length is the cheap sanity check.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if std::fs::metadata(&content)?.len() != receipt.length {
                remove_quietly(tmp);
                return Err(err("content file of this digest has another length"));
            }
        }
        Err(e) => {
            remove_quietly(tmp);
            return Err(e.into());
        }
    }
    remove_quietly(tmp);
    sync_dir(dir)?;

    let receipt_tmp = dir.join(format!(".{artifact}.{}.receipt.tmp", random_suffix()?));
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&receipt_tmp)?;
        f.write_all(&serde_json::to_vec(receipt).map_err(std::io::Error::other)?)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        remove_quietly(&receipt_tmp);
        return Err(e.into());
    }
    let linked = std::fs::hard_link(&receipt_tmp, receipt_path(dir, artifact));
    remove_quietly(&receipt_tmp);
    match linked {
        Ok(()) => {
            store.sync_chain(dir)?;
            Ok(PutOutcome::Stored(receipt.clone()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let stored = read_receipt(dir, artifact)?.ok_or_else(|| err("receipt vanished"))?;
            if stored.sha256 != receipt.sha256 {
                // No receipt can ever name our content now: it is garbage.
                remove_quietly(&content);
            }
            Ok(compare(stored, receipt))
        }
        Err(e) => Err(e.into()),
    }
}

/// Asks the authority whether an attempt has recorded its artifact ([`Recorded`]).
type Ask<'a> = dyn FnMut(&ArtifactKey) -> Result<bool, BlobError> + 'a;

/// One collection's walk over the store's files.
struct Walk<'a> {
    root: &'a Path,
    before: SystemTime,
    /// Set once the collection's caller is gone: the walk stops.
    abandoned: &'a AtomicBool,
}

/// Abandons a walk when the collection that started it is dropped.
struct AbandonOnDrop(Arc<AtomicBool>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// [`BlobStore::collect`] under `dir`, its subdirectories too.
fn collect_in(walk: &Walk<'_>, dir: &Path, ask: &mut Ask<'_>, collected: &mut Collected) -> Result<(), BlobError> {
    let (root, before) = (walk.root, walk.before);
    // Whether this directory's attempt recorded its artifact: asked once, and only if
    // it holds an old chunk.
    let mut recorded = None;
    // A run's place removed meanwhile (its retention past, `remove_run`) is nothing left
    // to collect, not a failed collection.
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let entries = match std::fs::read_dir(dir) {
        Err(e) if gone(&e) => return Ok(()),
        entries => entries?,
    };
    for entry in entries {
        if walk.abandoned.load(Ordering::Relaxed) {
            return Ok(());
        }
        let entry = match entry {
            Err(e) if gone(&e) => continue,
            entry => entry?,
        };
        // Not followed: every file here is one this store made, none a link.
        let meta = match entry.metadata() {
            Err(e) if gone(&e) => continue,
            meta => meta?,
        };
        if meta.is_dir() {
            collect_in(walk, &entry.path(), ask, collected)?;
            continue;
        }
        if !meta.is_file() || meta.modified()? >= before {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        let counts = if leftover(dir, &name) {
            (&mut collected.removed, &mut collected.bytes)
        } else if let Some(key) = chunk_of(root, dir, &name) {
            if recorded.is_none() {
                recorded = Some(ask(&key).unwrap_or_else(|_| {
                    collected.unanswered += 1;
                    false
                }));
            }
            if recorded != Some(true) {
                continue;
            }
            (&mut collected.chunks, &mut collected.chunk_bytes)
        } else {
            continue;
        };
        match std::fs::remove_file(entry.path()) {
            Ok(()) => {
                *counts.0 += 1;
                *counts.1 += meta.len();
            }
            // The upload's own clean-up (or the completion's removal) was first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Removes `dir` and everything under it, counting the files; a `dir` that is not there
/// is nothing to remove. Ids make every part of a run's place, so nothing under it is a
/// link out of the store.
fn remove_tree(dir: &Path) -> std::io::Result<u64> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut files = 0;
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            files += remove_tree(&entry.path())?;
        } else {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => files += 1,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(files),
    }
}

/// The key of the chunk file `name` in the attempt directory `dir`, if it is one.
fn chunk_of(root: &Path, dir: &Path, name: &str) -> Option<ArtifactKey> {
    let artifact = super::chunk_artifact(name)?;
    let mut parts = dir.strip_prefix(root).ok()?.iter().map(|p| p.to_str());
    let (project, run, attempt) = (parts.next()??, parts.next()??, parts.next()??);
    if parts.next().is_some() {
        return None;
    }
    ArtifactKey::parse(project, run, attempt, artifact)
}

/// Whether the file `name` in `dir` is an upload's leftover: a temporary file (only an
/// upload in progress uses one), or content whose artifact's receipt names other content
/// (receipts are never replaced, so nothing can name it again). Content no receipt names
/// yet stays: an identical retry reuses it without writing it again.
fn leftover(dir: &Path, name: &str) -> bool {
    if name.starts_with('.') && name.ends_with(".tmp") {
        return true;
    }
    let Some((artifact, digest)) = name.split_once('.') else {
        return false;
    };
    let (Ok(artifact), Ok(digest)) = (ArtifactId::parse(artifact), Digest::parse(digest)) else {
        return false;
    };
    // An unreadable receipt is kept with all it might name: corruption fails closed.
    matches!(read_receipt(dir, &artifact), Ok(Some(receipt)) if receipt.sha256 != digest)
}

/// An upload in progress: a temporary file, a running hash and a byte count.
#[derive(Debug)]
pub struct FsUpload {
    store: FsBlobStore,
    dir: PathBuf,
    artifact: ArtifactId,
    declared: u64,
    truncated: bool,
    file: Option<tokio::fs::File>,
    tmp: Option<PathBuf>,
    hasher: Sha256,
    written: u64,
    failed: bool,
}

impl Drop for FsUpload {
    fn drop(&mut self) {
        // Unfinished, refused or already published (then the link is gone): either way
        // the temporary name must not stay behind.
        if let Some(tmp) = self.tmp.take() {
            remove_quietly(&tmp);
        }
    }
}

impl Upload for FsUpload {
    async fn write(&mut self, bytes: &[u8]) -> Result<(), BlobError> {
        super::admit_write(&mut self.failed, self.written, self.declared, bytes.len())?;
        let Some(file) = self.file.as_mut() else {
            return Err(err("upload already finished"));
        };
        if let Err(e) = file.write_all(bytes).await {
            self.failed = true;
            return Err(e.into());
        }
        self.hasher.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn receipt(&self) -> Result<Receipt, BlobError> {
        if self.failed {
            return Err(err("upload failed"));
        }
        if self.written != self.declared {
            return Err(err(format!("{} bytes received, {} declared", self.written, self.declared)));
        }
        let sha256 = Digest::from_raw(&self.hasher.clone().finalize().into());
        Ok(Receipt { artifact_id: self.artifact.clone(), length: self.written, sha256, truncated: self.truncated })
    }

    async fn finish(mut self) -> Result<PutOutcome, BlobError> {
        let receipt = self.receipt()?;
        let (Some(mut file), Some(tmp)) = (self.file.take(), self.tmp.clone()) else {
            return Err(err("upload already finished"));
        };
        file.flush().await?;
        file.sync_all().await?;
        drop(file);
        let (store, dir) = (self.store.clone(), self.dir.clone());
        tokio::task::spawn_blocking(move || publish(&store, &dir, &tmp, &receipt))
            .await
            .map_err(|e| err(format!("publishing task: {e}")))?
    }
}

impl BlobStore for FsBlobStore {
    type Upload = FsUpload;

    async fn begin(&self, key: &ArtifactKey, length: u64, truncated: bool) -> Result<FsUpload, BlobError> {
        if length > ARTIFACT_CONTENT_MAX {
            return Err(err(format!("{length} bytes exceeds the artifact limit")));
        }
        let dir = self.dir(key);
        let tmp = dir.join(format!(".{}.{}.tmp", key.artifact, random_suffix()?));
        let file = {
            let (dir, tmp) = (dir.clone(), tmp.clone());
            tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
                make_dirs(&dir)?;
                std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)
            })
            .await
            .map_err(|e| err(format!("creating the upload: {e}")))??
        };
        Ok(FsUpload {
            store: self.clone(),
            dir,
            artifact: key.artifact.clone(),
            declared: length,
            truncated,
            file: Some(tokio::fs::File::from_std(file)),
            tmp: Some(tmp),
            hasher: Sha256::new(),
            written: 0,
            failed: false,
        })
    }

    async fn inspect(&self, key: &ArtifactKey) -> Result<Option<Receipt>, BlobError> {
        let (dir, artifact) = (self.dir(key), key.artifact.clone());
        tokio::task::spawn_blocking(move || read_receipt(&dir, &artifact))
            .await
            .map_err(|e| err(format!("inspecting: {e}")))?
    }

    async fn read(&self, key: &ArtifactKey, offset: u64, limit: u64) -> Result<Option<Vec<u8>>, BlobError> {
        use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
        let Some(receipt) = self.inspect(key).await? else {
            return Ok(None);
        };
        let end = offset.saturating_add(limit).min(receipt.length);
        if offset >= end {
            return Ok(Some(Vec::new()));
        }
        let path = content_path(&self.dir(key), &key.artifact, &receipt.sha256);
        let mut file = tokio::fs::File::open(path).await?;
        file.seek(std::io::SeekFrom::Start(offset)).await?;
        let mut bytes = Vec::new();
        file.take(end - offset).read_to_end(&mut bytes).await?;
        if bytes.len() as u64 != end - offset {
            return Err(err("stored content does not match its receipt"));
        }
        Ok(Some(bytes))
    }

    async fn put_chunk(&self, key: &ArtifactKey, offset: u64, bytes: &[u8]) -> Result<Digest, BlobError> {
        let sha256 = Digest::of(bytes);
        let dir = self.dir(key);
        let path = chunk_path(&dir, &key.artifact, offset, &sha256);
        let (store, bytes) = (self.clone(), bytes.to_vec());
        tokio::task::spawn_blocking(move || write_chunk(&store, &dir, &path, &bytes))
            .await
            .map_err(|e| err(format!("storing a chunk: {e}")))??;
        Ok(sha256)
    }

    async fn read_chunk(
        &self,
        key: &ArtifactKey,
        offset: u64,
        length: u64,
        sha256: &Digest,
    ) -> Result<Vec<u8>, BlobError> {
        let path = chunk_path(&self.dir(key), &key.artifact, offset, sha256);
        let bytes = match tokio::fs::read(&path).await {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(err("acknowledged chunk missing")),
            Err(e) => return Err(e.into()),
        };
        if bytes.len() as u64 != length || Digest::of(&bytes) != *sha256 {
            return Err(err("stored chunk does not match its record"));
        }
        Ok(bytes)
    }

    async fn remove_chunk(&self, key: &ArtifactKey, offset: u64, sha256: &Digest) -> Result<(), BlobError> {
        // Not fsynced: a removal a power cut undoes leaves a file nothing reads.
        match tokio::fs::remove_file(chunk_path(&self.dir(key), &key.artifact, offset, sha256)).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    async fn remove_run(&self, project: &ProjectId, run: &RunId) -> Result<u64, BlobError> {
        let parent = self.root.join(project.as_str());
        let dir = parent.join(run.as_str());
        // The project's directory synced once the run's place is gone from it, before the
        // rows go: a power cut then cannot bring back files no row names.
        tokio::task::spawn_blocking(move || {
            let removed = remove_tree(&dir)?;
            match sync_dir(&parent) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(removed),
            }
        })
        .await
        .map_err(|e| err(format!("removing a run: {e}")))?
        .map_err(|e| err(format!("removing a run: {e}")))
    }

    async fn collect<R: Recorded>(&self, before: SystemTime, recorded: &R) -> Result<Collected, BlobError> {
        let (root, recorded) = (self.root.as_ref().clone(), recorded.clone());
        let runtime = tokio::runtime::Handle::current();
        // A blocking task runs to its end even once its caller is gone, and a runtime
        // that shuts down waits for it: a collection aborted (serve stopping) stops its
        // walk at the next file instead.
        let abandoned = Arc::new(AtomicBool::new(false));
        let _abandon_on_drop = AbandonOnDrop(abandoned.clone());
        tokio::task::spawn_blocking(move || {
            let mut collected = Collected::default();
            let mut ask = |key: &ArtifactKey| {
                if abandoned.load(Ordering::Relaxed) {
                    return Err(err("the collection was abandoned"));
                }
                runtime.block_on(recorded.recorded(key)).map(|answer| answer == Recording::Recorded)
            };
            let walk = Walk { root: &root, before, abandoned: &abandoned };
            collect_in(&walk, &root, &mut ask, &mut collected).map(|()| collected)
        })
        .await
        .map_err(|e| err(format!("collecting leftovers: {e}")))?
    }
}

/// What only the file store can show (its files); the contract every store keeps is
/// `tests/blob_contract.rs`.
#[cfg(test)]
mod tests {
    use super::*;
    use ql_wire::ids::{AttemptId, ProjectId, RunId};

    /// A directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
            let dir = std::env::temp_dir().join(format!("ql-blob-{tag}-{}-{n}-{nanos}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn key(artifact: &str) -> ArtifactKey {
        ArtifactKey {
            project: ProjectId::parse("proj").unwrap(),
            run: RunId::parse("run_1").unwrap(),
            attempt: AttemptId::parse("att_1").unwrap(),
            artifact: ArtifactId::parse(artifact).unwrap(),
        }
    }

    fn receipt_of(artifact: &str, content: &[u8], truncated: bool) -> Receipt {
        Receipt {
            artifact_id: ArtifactId::parse(artifact).unwrap(),
            length: content.len() as u64,
            sha256: Digest::of(content),
            truncated,
        }
    }

    async fn put(store: &FsBlobStore, k: &ArtifactKey, content: &[u8], truncated: bool) -> PutOutcome {
        let mut up = store.begin(k, content.len() as u64, truncated).await.unwrap();
        for chunk in content.chunks(7) {
            up.write(chunk).await.unwrap();
        }
        up.finish().await.unwrap()
    }

    /// Every file (not directory) under `root`, relative names.
    fn files(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let p = entry.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push(p.strip_prefix(root).unwrap().display().to_string());
                }
            }
        }
        out.sort();
        out
    }

    #[tokio::test]
    async fn a_short_upload_is_refused_and_leaves_nothing() {
        let dir = TempDir::new("short");
        let store = FsBlobStore::open(&dir.0).unwrap();
        let mut up = store.begin(&key("log"), 10, false).await.unwrap();
        up.write(b"12345").await.unwrap();
        assert!(up.finish().await.is_err());
        assert_eq!(store.inspect(&key("log")).await.unwrap(), None);
        assert_eq!(store.read(&key("log"), 0, u64::MAX).await.unwrap(), None);
        assert!(files(&dir.0).is_empty(), "{:?}", files(&dir.0));
    }

    #[tokio::test]
    async fn a_dropped_upload_leaves_nothing() {
        let dir = TempDir::new("dropped");
        let store = FsBlobStore::open(&dir.0).unwrap();
        let mut up = store.begin(&key("log"), 8, false).await.unwrap();
        up.write(b"1234").await.unwrap();
        assert_eq!(files(&dir.0).len(), 1, "the upload streams into a temporary file");
        drop(up);
        assert!(files(&dir.0).is_empty(), "{:?}", files(&dir.0));
        assert_eq!(store.inspect(&key("log")).await.unwrap(), None);
    }

    #[tokio::test]
    async fn receipts_survive_reopening_the_store() {
        let dir = TempDir::new("reopen");
        let first = FsBlobStore::open(&dir.0).unwrap();
        let stored = receipt_of("log", b"durable", false);
        assert_eq!(put(&first, &key("log"), b"durable", false).await, PutOutcome::Stored(stored.clone()));
        drop(first);
        let again = FsBlobStore::open(&dir.0).unwrap();
        assert_eq!(again.inspect(&key("log")).await.unwrap(), Some(stored.clone()));
        assert_eq!(put(&again, &key("log"), b"durable", false).await, PutOutcome::AlreadyStored(stored));
        assert_eq!(put(&again, &key("log"), b"changed", false).await, PutOutcome::Conflict);
    }

    #[tokio::test]
    async fn content_without_a_receipt_is_not_stored_and_does_not_block_the_key() {
        // What a crash between publishing the content and the receipt leaves behind.
        let dir = TempDir::new("crash");
        let store = FsBlobStore::open(&dir.0).unwrap();
        let k = key("log");
        let attempt_dir = store.dir(&k);
        make_dirs(&attempt_dir).unwrap();
        std::fs::write(content_path(&attempt_dir, &k.artifact, &Digest::of(b"first")), b"first").unwrap();
        assert_eq!(store.inspect(&k).await.unwrap(), None);
        // Another content may still take the key; the same content reuses the file.
        assert_eq!(put(&store, &k, b"second", false).await, PutOutcome::Stored(receipt_of("log", b"second", false)));
        let k2 = key("log2");
        std::fs::write(content_path(&attempt_dir, &k2.artifact, &Digest::of(b"same")), b"same").unwrap();
        assert_eq!(put(&store, &k2, b"same", false).await, PutOutcome::Stored(receipt_of("log2", b"same", false)));
    }

    #[tokio::test]
    async fn a_receipt_without_its_content_fails_closed() {
        let dir = TempDir::new("corrupt");
        let store = FsBlobStore::open(&dir.0).unwrap();
        let k = key("log");
        put(&store, &k, b"content", false).await;
        std::fs::remove_file(content_path(&store.dir(&k), &k.artifact, &Digest::of(b"content"))).unwrap();
        assert!(store.inspect(&k).await.is_err());
        assert!(store.read(&k, 0, u64::MAX).await.is_err());
    }

    #[tokio::test]
    async fn concurrent_puts_of_one_key_commit_exactly_one_content() {
        let dir = TempDir::new("race");
        let store = FsBlobStore::open(&dir.0).unwrap();
        let k = key("log");
        let (a, b) = tokio::join!(put(&store, &k, b"aaaa", false), put(&store, &k, b"bbbb", false));
        let outcomes = [a, b];
        assert_eq!(outcomes.iter().filter(|o| matches!(o, PutOutcome::Stored(_))).count(), 1, "{outcomes:?}");
        assert_eq!(outcomes.iter().filter(|o| matches!(o, PutOutcome::Conflict)).count(), 1, "{outcomes:?}");
        assert_eq!(files(&dir.0).len(), 2, "one content and its receipt: {:?}", files(&dir.0));
        let same = key("same");
        let (a, b) = tokio::join!(put(&store, &same, b"cc", false), put(&store, &same, b"cc", false));
        let mut kinds = [a, b].map(|o| match o {
            PutOutcome::Stored(_) => "stored",
            PutOutcome::AlreadyStored(_) => "already",
            PutOutcome::Conflict => "conflict",
        });
        kinds.sort();
        assert_eq!(kinds, ["already", "stored"]);
    }

    /// The authority for [`a_dropped_collection_stops_its_walk`]: its first answer waits
    /// until the test lets it go; it counts what it was asked.
    #[derive(Clone)]
    struct Held {
        asked: Arc<std::sync::Mutex<usize>>,
        told: std::sync::mpsc::Sender<()>,
        release: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>,
    }

    impl Recorded for Held {
        async fn recorded(&self, _key: &ArtifactKey) -> Result<Recording, BlobError> {
            let first = {
                let mut asked = self.asked.lock().unwrap();
                *asked += 1;
                *asked == 1
            };
            if first {
                self.told.send(()).unwrap();
                self.release.lock().unwrap().recv().unwrap();
            }
            Ok(Recording::Recorded)
        }
    }

    #[test]
    fn a_dropped_collection_stops_its_walk() {
        let dir = TempDir::new("abandon");
        let store = FsBlobStore::open(&dir.0).unwrap();
        let (told, asked_first) = std::sync::mpsc::channel();
        let (go, release) = std::sync::mpsc::channel();
        let held = Held { asked: Arc::default(), told, release: Arc::new(std::sync::Mutex::new(release)) };
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        runtime.block_on(async {
            for attempt in ["att_a", "att_b"] {
                let k = ArtifactKey { attempt: AttemptId::parse(attempt).unwrap(), ..key("log") };
                store.put_chunk(&k, 0, b"chunk").await.unwrap();
            }
            let later = SystemTime::now() + std::time::Duration::from_secs(3_600);
            let (store, held) = (store.clone(), held.clone());
            let collection = tokio::spawn(async move { store.collect(later, &held).await });
            tokio::task::spawn_blocking(move || asked_first.recv().unwrap()).await.unwrap();
            collection.abort();
            assert!(collection.await.unwrap_err().is_cancelled());
            go.send(()).unwrap();
        });
        // Shutting down waits for the walk; it asked nothing more once abandoned.
        drop(runtime);
        assert_eq!(*held.asked.lock().unwrap(), 1);
        let chunks = files(&dir.0).into_iter().filter(|f| f.contains(".chunk.")).count();
        assert!(chunks >= 1, "the other attempt's chunk stays");
    }
}
