//! The artifact store contract (PROTOCOL §9, §13), run against each store that ships:
//! the local files and an S3 bucket served by a real S3 server (`s3s-fs`, see
//! `common/s3.rs`). Put-if-absent, the same content is the same receipt, other content a
//! conflict, `inspect`, ranged reads, live-log chunks, an upload cut off anywhere
//! leaving nothing visible, and the collection of what uploads that never completed left
//! and of the chunks of recorded logs.

#[path = "common/s3.rs"]
mod s3;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sha2::{Digest as _, Sha256};

use ql_control::blob::fs::FsBlobStore;
use ql_control::blob::s3::S3Options;
use ql_control::blob::{ArtifactKey, BlobError, BlobStore, Collected, PutOutcome, Recorded, Recording, Upload};
use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ArtifactId, AttemptId, ProjectId, RunId};

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let mut rnd = [0u8; 6];
        getrandom::getrandom(&mut rnd).unwrap();
        let suffix: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        let dir = std::env::temp_dir().join(format!("ql-blob-contract-{tag}-{suffix}"));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn key(attempt: &str, artifact: &str) -> ArtifactKey {
    ArtifactKey {
        project: ProjectId::parse("proj").unwrap(),
        run: RunId::parse("run_1").unwrap(),
        attempt: AttemptId::parse(attempt).unwrap(),
        artifact: ArtifactId::parse(artifact).unwrap(),
    }
}

/// The authority as the collection asks it: the attempts that recorded their log (none
/// answers when `None`), those that ended without one, and which attempts it was asked
/// about. Any other attempt is still writing its log.
#[derive(Clone)]
struct Authority {
    recorded: Option<Vec<String>>,
    ended: Vec<String>,
    asked: Arc<Mutex<Vec<String>>>,
}

impl Authority {
    fn recording(attempts: &[&str]) -> Self {
        let recorded = Some(attempts.iter().map(|a| a.to_string()).collect());
        Self { recorded, ended: Vec::new(), asked: Arc::default() }
    }

    fn ended(self, attempts: &[&str]) -> Self {
        Self { ended: attempts.iter().map(|a| a.to_string()).collect(), ..self }
    }

    fn failing() -> Self {
        Self { recorded: None, ended: Vec::new(), asked: Arc::default() }
    }

    /// The attempts asked about since the last call, sorted.
    fn asked(&self) -> Vec<String> {
        let mut asked = std::mem::take(&mut *self.asked.lock().unwrap());
        asked.sort();
        asked
    }
}

impl Recorded for Authority {
    async fn recorded(&self, key: &ArtifactKey) -> Result<Recording, BlobError> {
        self.asked.lock().unwrap().push(key.attempt.to_string());
        let recorded = self.recorded.as_ref().ok_or_else(|| BlobError("the authority is down".into()))?;
        let named = |attempts: &[String]| attempts.iter().any(|a| a == key.attempt.as_str());
        Ok(if named(recorded) {
            Recording::Recorded
        } else if named(&self.ended) {
            Recording::Never
        } else {
            Recording::NotYet
        })
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

async fn put<B: BlobStore>(store: &B, k: &ArtifactKey, content: &[u8], truncated: bool) -> PutOutcome {
    let mut up = store.begin(k, content.len() as u64, truncated).await.unwrap();
    for chunk in content.chunks(7) {
        up.write(chunk).await.unwrap();
    }
    assert_eq!(up.receipt().unwrap(), receipt_of(k.artifact.as_str(), content, truncated));
    up.finish().await.unwrap()
}

/// Every file under `root`, by relative name, with its size.
fn files(root: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let size = std::fs::metadata(&p).map_or(0, |m| m.len());
                out.push((p.strip_prefix(root).unwrap().display().to_string(), size));
            }
        }
    }
    out.sort();
    out
}

/// The whole contract on `store`; `stored` lists what the store holds for attempt `att`
/// (its files and their sizes, whatever the store), to prove refused and cut-off uploads
/// leave nothing.
async fn contract<B: BlobStore>(store: B, stored: impl Fn(&str) -> Vec<(String, u64)>) {
    // Put-if-absent: stored, the same again is a replay with the same receipt, other
    // content (or the same bytes with another truncation) a conflict.
    let k = key("att_replay", "log");
    let hello = receipt_of("log", b"hello, world\n", false);
    assert_eq!(put(&store, &k, b"hello, world\n", false).await, PutOutcome::Stored(hello.clone()));
    assert_eq!(put(&store, &k, b"hello, world\n", false).await, PutOutcome::AlreadyStored(hello.clone()));
    assert_eq!(put(&store, &k, b"other bytes", false).await, PutOutcome::Conflict);
    assert_eq!(put(&store, &k, b"hello, world\n", true).await, PutOutcome::Conflict, "truncation is identity");
    assert_eq!(store.inspect(&k).await.unwrap(), Some(hello));
    assert_eq!(store.read(&k, 0, u64::MAX).await.unwrap().as_deref(), Some(&b"hello, world\n"[..]));
    assert_eq!(stored("att_replay").len(), 2, "one content and its receipt: {:?}", stored("att_replay"));

    // Ranged reads, as `logs` pages through a stored log.
    assert_eq!(store.read(&k, 7, 5).await.unwrap().as_deref(), Some(&b"world"[..]));
    assert_eq!(store.read(&k, 7, 1000).await.unwrap().as_deref(), Some(&b"world\n"[..]));
    assert_eq!(store.read(&k, 13, 10).await.unwrap(), Some(Vec::new()), "at the end");
    assert_eq!(store.read(&k, 99, 10).await.unwrap(), Some(Vec::new()), "past the end");
    assert_eq!(store.read(&key("att_replay", "nothing"), 0, 10).await.unwrap(), None);

    // An empty artifact is an artifact.
    let empty = key("att_empty", "log");
    let up = store.begin(&empty, 0, false).await.unwrap();
    assert_eq!(up.finish().await.unwrap(), PutOutcome::Stored(receipt_of("log", b"", false)));
    assert_eq!(store.read(&empty, 0, u64::MAX).await.unwrap(), Some(Vec::new()));

    // Short, long, and cut off: refused, nothing visible, the key still free.
    let short = key("att_short", "log");
    let mut up = store.begin(&short, 10, false).await.unwrap();
    up.write(b"12345").await.unwrap();
    assert!(up.receipt().is_err());
    assert!(up.finish().await.is_err());
    assert_eq!(store.inspect(&short).await.unwrap(), None);

    let long = key("att_long", "log");
    let mut up = store.begin(&long, 4, false).await.unwrap();
    up.write(b"1234").await.unwrap();
    assert!(up.write(b"5").await.is_err());
    assert!(up.finish().await.is_err());
    assert_eq!(store.inspect(&long).await.unwrap(), None);

    let cut = key("att_cut", "log");
    let mut up = store.begin(&cut, 1 << 20, false).await.unwrap();
    up.write(&[7u8; 100 * 1024]).await.unwrap();
    drop(up);
    assert_eq!(store.inspect(&cut).await.unwrap(), None);
    assert_eq!(store.read(&cut, 0, 10).await.unwrap(), None);
    assert_eq!(put(&store, &cut, b"after", false).await, PutOutcome::Stored(receipt_of("log", b"after", false)));

    // Streamed: 8 MiB in 64 KiB writes, hashed on the way.
    let big = key("att_big", "log");
    let mut chunk = vec![0u8; 64 * 1024];
    let mut expected = Sha256::new();
    let total = 8 * 1024 * 1024u64;
    let mut up = store.begin(&big, total, true).await.unwrap();
    for i in 0..total / chunk.len() as u64 {
        chunk.iter_mut().enumerate().for_each(|(j, b)| *b = (i as u8).wrapping_mul(31) ^ (j as u8));
        expected.update(&chunk);
        up.write(&chunk).await.unwrap();
    }
    let receipt = Receipt {
        artifact_id: ArtifactId::parse("log").unwrap(),
        length: total,
        sha256: Digest::from_raw(&expected.finalize().into()),
        truncated: true,
    };
    assert_eq!(up.finish().await.unwrap(), PutOutcome::Stored(receipt.clone()));
    assert_eq!(store.inspect(&big).await.unwrap(), Some(receipt));
    let tail = store.read(&big, total - 3, 10).await.unwrap().unwrap();
    assert_eq!(tail.len(), 3);
    assert!(store.begin(&key("att_big", "huge"), ql_wire::limits::ARTIFACT_CONTENT_MAX + 1, false).await.is_err());

    // Live-log chunks: stored under their digest, read back checked.
    let live = key("att_live", "log");
    let sha = store.put_chunk(&live, 0, b"first line\n").await.unwrap();
    assert_eq!(sha, Digest::of(b"first line\n"));
    assert_eq!(store.put_chunk(&live, 0, b"first line\n").await.unwrap(), sha, "a repeat is the same chunk");
    assert_eq!(store.read_chunk(&live, 0, 11, &sha).await.unwrap(), b"first line\n");
    assert!(store.read_chunk(&live, 0, 10, &sha).await.is_err(), "another length");
    assert!(store.read_chunk(&live, 0, 11, &Digest::of(b"x")).await.is_err(), "another digest");
    assert!(store.read_chunk(&live, 11, 11, &sha).await.is_err(), "a chunk never stored");
    // Removed once its log is recorded: gone, a second removal is no error, and the
    // other chunks of the log stay.
    let next = store.put_chunk(&live, 11, b"second line\n").await.unwrap();
    store.remove_chunk(&live, 0, &sha).await.unwrap();
    assert!(store.read_chunk(&live, 0, 11, &sha).await.is_err(), "a removed chunk");
    store.remove_chunk(&live, 0, &sha).await.unwrap();
    assert_eq!(store.read_chunk(&live, 11, 12, &next).await.unwrap(), b"second line\n");
    assert_eq!(stored("att_live").len(), 1, "one chunk left: {:?}", stored("att_live"));

    // Leftovers of uploads that never completed (their process died after the last byte,
    // before the receipt): one of an artifact no receipt names, one beside a receipt that
    // names other content. Collected only once older than the bound; what a receipt
    // names, the receipt and the chunks stay.
    let kept = key("att_left", "log");
    put(&store, &kept, b"named content", false).await;
    store.put_chunk(&kept, 0, b"a chunk").await.unwrap();
    let size = |files: &[(String, u64)]| files.iter().map(|(_, size)| size).sum::<u64>();
    let (kept_files, kept_size) = (stored("att_left").len(), size(&stored("att_left")));
    for (k, bytes) in [(key("att_left", "other"), &b"12345"[..]), (kept.clone(), &b"lost"[..])] {
        let mut up = store.begin(&k, bytes.len() as u64, false).await.unwrap();
        up.write(bytes).await.unwrap();
        std::mem::forget(up);
    }
    // The leftovers' bytes land as the uploads stream them.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while stored("att_left").len() < kept_files + 2 || size(&stored("att_left")) < kept_size + 9 {
        assert!(std::time::Instant::now() < deadline, "the leftovers never landed: {:?}", stored("att_left"));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The chunks of a log the authority says is recorded go too, once older than the
    // bound; those of a log still being written (`att_live`) or of an attempt that ended
    // without recording it (`att_left`) stay. The authority is asked once for each
    // attempt with old chunks.
    let done = key("att_done", "log");
    for (offset, bytes) in [(0, &b"first "[..]), (6, &b"second"[..])] {
        store.put_chunk(&done, offset, bytes).await.unwrap();
    }
    put(&store, &done, b"first second", false).await;
    let authority = Authority::recording(&["att_done"]).ended(&["att_left"]);

    let all = stored("att_left");
    let (done_files, live_files) = (stored("att_done"), stored("att_live"));
    let hour = Duration::from_secs(3_600);
    let young = store.collect(SystemTime::now() - hour, &authority).await.unwrap();
    assert_eq!(young, Collected::default(), "younger than the bound");
    assert_eq!((stored("att_left"), stored("att_done"), stored("att_live")), (all, done_files, live_files.clone()));
    assert_eq!(authority.asked(), Vec::<String>::new(), "nothing old to ask about");
    let old = store.collect(SystemTime::now() + hour, &authority).await.unwrap();
    assert_eq!(old, Collected { removed: 2, bytes: 9, chunks: 2, chunk_bytes: 12, unanswered: 0 });
    assert_eq!(authority.asked(), ["att_done", "att_left", "att_live"], "once for each attempt with old chunks");
    assert_eq!(stored("att_left").len(), kept_files, "the named content, its receipt and the chunk stay");
    assert_eq!(store.read(&kept, 0, 100).await.unwrap().as_deref(), Some(&b"named content"[..]));
    assert_eq!(store.read_chunk(&kept, 0, 7, &Digest::of(b"a chunk")).await.unwrap(), b"a chunk");
    assert_eq!(stored("att_done").len(), 2, "the recorded log's chunks are gone, its content and receipt stay");
    assert_eq!(store.read(&done, 0, 100).await.unwrap().as_deref(), Some(&b"first second"[..]));
    assert_eq!(stored("att_live"), live_files, "the log being written stays");
    let again = store.collect(SystemTime::now() + hour, &authority).await.unwrap();
    assert_eq!(again, Collected::default(), "nothing is left");

    // An authority that cannot answer keeps the chunks of each attempt it was asked
    // about, and says how many; the upload leftovers go all the same.
    let mut up = store.begin(&key("att_left", "again"), 3, false).await.unwrap();
    up.write(b"abc").await.unwrap();
    std::mem::forget(up);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while size(&stored("att_left")) < kept_size + 3 {
        assert!(std::time::Instant::now() < deadline, "the leftover never landed: {:?}", stored("att_left"));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let unsure = Authority::failing();
    let unanswered = store.collect(SystemTime::now() + hour, &unsure).await.unwrap();
    assert_eq!(unanswered, Collected { removed: 1, bytes: 3, unanswered: 2, ..Collected::default() });
    assert_eq!(unsure.asked(), ["att_left", "att_live"]);
    assert_eq!((stored("att_left").len(), stored("att_live")), (kept_files, live_files));

    // Racing puts of one key: whatever each was told, what is stored afterwards is one
    // of the contents told `Stored`, whole. (Which one wins is the database's to decide:
    // see `ConfirmArtifact`; a store whose conditional write is atomic tells one only.)
    let race = key("att_race", "log");
    let (a, b) = tokio::join!(put(&store, &race, b"aaaa", false), put(&store, &race, b"bbbb", false));
    let told: Vec<Receipt> = [a, b]
        .into_iter()
        .filter_map(|o| match o {
            PutOutcome::Stored(r) => Some(r),
            _ => None,
        })
        .collect();
    let now = store.inspect(&race).await.unwrap().expect("one content is stored");
    assert!(told.contains(&now), "stored {now:?}, told {told:?}");
    let content = store.read(&race, 0, 10).await.unwrap().unwrap();
    assert_eq!(Digest::of(&content), now.sha256);

    // A run removed (its retention past): every attempt's files under it go, another
    // run's stay, and removing it again is nothing to do.
    let other = ArtifactKey { run: RunId::parse("run_2").unwrap(), ..key("att_other", "log") };
    assert!(matches!(put(&store, &other, b"kept", false).await, PutOutcome::Stored(_)));
    // `stored` of no attempt: everything the store holds for the run.
    let before = stored("").len();
    assert!(before > 0);
    let (project, run) = (k.project.clone(), k.run.clone());
    assert_eq!(store.remove_run(&project, &run).await.unwrap(), before as u64, "each file or object once");
    assert_eq!(stored(""), Vec::new(), "nothing of the run is left");
    assert_eq!(store.inspect(&k).await.unwrap(), None);
    assert!(store.inspect(&other).await.unwrap().is_some(), "another run's stays");
    assert_eq!(store.read(&other, 0, 10).await.unwrap().as_deref(), Some(&b"kept"[..]));
    assert_eq!(store.remove_run(&project, &run).await.unwrap(), 0, "gone already");
}

#[tokio::test]
async fn the_file_store_keeps_the_contract() {
    let dir = TempDir::new("files");
    let store = FsBlobStore::open(&dir.0).unwrap();
    let root = dir.0.clone();
    contract(store, move |attempt| files(&root.join("proj/run_1").join(attempt))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_s3_store_keeps_the_contract() {
    let server = s3::S3Server::start("contract");
    let store = server.store("edge/contract");
    let data = server.data().join("data").join(s3::BUCKET).join("edge/contract/proj/run_1");
    contract(store, move |attempt| files(&data.join(attempt))).await;
}

/// One object a page: an attempt's chunks come on pages of their own, and the database is
/// still asked once for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_collection_asks_once_for_an_attempt_whose_chunks_span_pages() {
    let server = s3::S3Server::start("pages");
    let store = ql_control::blob::s3::S3BlobStore::new(S3Options { list_page: 1, ..server.options("edge/pages") });
    let (done, live) = (key("att_done", "log"), key("att_live", "log"));
    for (offset, bytes) in [(0, &b"one "[..]), (4, &b"two "[..]), (8, &b"three"[..])] {
        store.put_chunk(&done, offset, bytes).await.unwrap();
        store.put_chunk(&live, offset, bytes).await.unwrap();
    }
    let authority = Authority::recording(&["att_done"]);
    let later = SystemTime::now() + Duration::from_secs(3_600);
    let collected = store.collect(later, &authority).await.unwrap();
    assert_eq!(collected, Collected { chunks: 3, chunk_bytes: 13, ..Collected::default() });
    assert_eq!(authority.asked(), ["att_done", "att_live"]);
    let chunks = server.data().join("data").join(s3::BUCKET).join("edge/pages/proj/run_1");
    assert_eq!((files(&chunks.join("att_done")).len(), files(&chunks.join("att_live")).len()), (0, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_that_is_down_fails_the_upload_and_shows_nothing_half_written() {
    let mut server = s3::S3Server::start("down");
    let store = server.store("down");
    let k = key("att_down", "log");
    let mut up = store.begin(&k, 1 << 20, false).await.unwrap();
    up.write(&[1u8; 64 * 1024]).await.unwrap();
    server.stop();
    // The bucket is gone mid-upload: a write or the finish fails, never a receipt.
    let mut failed = false;
    for _ in 0..15 {
        if up.write(&[1u8; 64 * 1024]).await.is_err() {
            failed = true;
            break;
        }
    }
    if !failed {
        assert!(up.finish().await.is_err(), "an upload into a stopped bucket succeeded");
    }
    assert!(store.inspect(&k).await.is_err(), "a stopped bucket answers nothing");
    server.restart();
    assert_eq!(store.inspect(&k).await.unwrap(), None, "nothing half-written became visible");
    assert_eq!(put(&store, &k, b"again", false).await, PutOutcome::Stored(receipt_of("log", b"again", false)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_refused_and_the_error_names_no_secret() {
    let server = s3::S3Server::start("creds");
    let mut options = server.options("creds");
    options.credentials = aws_credential_types::Credentials::new(s3::ACCESS_KEY, "not-the-secret", None, None, "t");
    let store = ql_control::blob::s3::S3BlobStore::new(options);
    let e = store.put_chunk(&key("att_creds", "log"), 0, b"x").await.unwrap_err().to_string();
    assert!(e.contains("403"), "{e}");
    assert!(!e.contains("not-the-secret") && !e.contains(s3::SECRET_KEY), "{e}");
    let e = store.inspect(&key("att_creds", "log")).await.unwrap_err().to_string();
    assert!(e.contains("403"), "{e}");
}
