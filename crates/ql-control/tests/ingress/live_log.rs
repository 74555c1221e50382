//! The live log (PROTOCOL §13): appended by offset, sealed into the artifact, its chunks
//! removed once a completion records that artifact, and the collection of the ones left.

use super::*;

#[test]
fn the_live_log_is_appended_by_offset_then_sealed_into_the_artifact() {
    let case = UploadCase::new("live-log");
    let (a, b, c) = (content(1_000, 1), content(256 * 1024, 2), content(7, 3));
    let appended = |answer: Answer, acked| {
        let reply: LogAppendReply = answer.json(200);
        assert_eq!((reply.result, reply.acked), (Outcome::Appended, acked));
    };
    appended(case.client.append(&case.job, 0, &a), 1_000);
    appended(case.client.append(&case.job, 1_000, &b), 1_000 + 256 * 1024);
    let acked = (1_000 + b.len() + c.len()) as u64;
    appended(case.client.append(&case.job, 1_000 + b.len() as u64, &c), acked);
    let after_appends = case.server.snapshot();

    // A lost answer's repeat, and a repeat re-cut across chunks: already there.
    let again: LogAppendReply = case.client.append(&case.job, 0, &a).json(200);
    assert_eq!((again.result, again.acked), (Outcome::AlreadyAppended, acked));
    let mut across = a[500..].to_vec();
    across.extend_from_slice(&b[..100]);
    let again: LogAppendReply = case.client.append(&case.job, 500, &across).json(200);
    assert_eq!(again.result, Outcome::AlreadyAppended);
    // A changed byte, a gap, an overlap: the acknowledged length, nothing changed.
    let mut changed = a.clone();
    changed[999] ^= 1;
    assert_eq!(case.client.append(&case.job, 0, &changed).log_conflict(), acked);
    assert_eq!(case.client.append(&case.job, acked + 1, b"x").log_conflict(), acked);
    assert_eq!(case.client.append(&case.job, acked - 3, b"xyzw").log_conflict(), acked);
    assert_eq!(case.client.seal(&case.job, acked - 1).log_conflict(), acked);
    assert_eq!(case.server.snapshot(), after_appends, "refusals and repeats change nothing");
    assert_eq!(case.server.inspect(&case.job.key(&log_id())), None, "nothing sealed yet");

    let whole: Vec<u8> = [a.as_slice(), &b, &c].concat();
    let sealed: ArtifactReply = case.client.seal(&case.job, acked).json(200);
    assert_eq!(sealed.result, Outcome::Stored);
    assert_eq!((sealed.receipt.length, sealed.receipt.sha256.clone()), (acked, Digest::of(&whole)));
    let resealed: ArtifactReply = case.client.seal(&case.job, acked).json(200);
    assert_eq!((resealed.result, &resealed.receipt), (Outcome::AlreadyStored, &sealed.receipt));
    assert_eq!(case.client.append(&case.job, acked, b"late").error(), ErrorCode::StateConflict);

    let done: CompletionReply = case
        .client
        .post(&case.job.route(AttemptCommand::Completion), &case.job.completion(0, Some(sealed.receipt.clone())))
        .json(200);
    assert_eq!(done.status, TerminalStatus::Succeeded);
    let names: Vec<String> = case.server.audits().into_iter().map(|a| a.route).collect();
    assert!(names.iter().filter(|n| *n == "log.append").count() >= 9, "every chunk is audited: {names:?}");
    assert!(names.iter().any(|n| n == "artifact.seal"));
}

/// The file store, but its first chunk read first says so on `gate` and waits for the
/// answer: the test completes the attempt right there, between a reader's look at the
/// run and its read of a chunk.
#[derive(Clone)]
struct Gated {
    inner: FsBlobStore,
    gate: Arc<Mutex<Option<Gate>>>,
}

/// Where a gated read says it has come, and where it waits to go on.
type Gate = (mpsc::Sender<()>, mpsc::Receiver<()>);

impl BlobStore for Gated {
    type Upload = <FsBlobStore as BlobStore>::Upload;

    async fn begin(&self, key: &ArtifactKey, length: u64, truncated: bool) -> Result<Self::Upload, BlobError> {
        self.inner.begin(key, length, truncated).await
    }

    async fn inspect(&self, key: &ArtifactKey) -> Result<Option<Receipt>, BlobError> {
        self.inner.inspect(key).await
    }

    async fn read(&self, key: &ArtifactKey, offset: u64, limit: u64) -> Result<Option<Vec<u8>>, BlobError> {
        self.inner.read(key, offset, limit).await
    }

    async fn put_chunk(&self, key: &ArtifactKey, offset: u64, bytes: &[u8]) -> Result<Digest, BlobError> {
        self.inner.put_chunk(key, offset, bytes).await
    }

    async fn read_chunk(&self, key: &ArtifactKey, at: u64, len: u64, sha256: &Digest) -> Result<Vec<u8>, BlobError> {
        let gate = self.gate.lock().unwrap().take();
        if let Some((tell, wait)) = gate {
            tell.send(()).unwrap();
            wait.recv().unwrap();
        }
        self.inner.read_chunk(key, at, len, sha256).await
    }

    async fn remove_chunk(&self, key: &ArtifactKey, offset: u64, sha256: &Digest) -> Result<(), BlobError> {
        self.inner.remove_chunk(key, offset, sha256).await
    }

    async fn remove_run(&self, project: &ql_wire::ids::ProjectId, run: &ql_wire::ids::RunId) -> Result<u64, BlobError> {
        self.inner.remove_run(project, run).await
    }

    async fn collect<R: Recorded>(&self, before: SystemTime, recorded: &R) -> Result<Collected, BlobError> {
        self.inner.collect(before, recorded).await
    }
}

/// The names of the files under `dir` (recursively) that contain `part`.
fn files_named(dir: &Path, part: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(files_named(&path, part));
        } else if path.file_name().is_some_and(|n| n.to_string_lossy().contains(part)) {
            found.push(path.display().to_string());
        }
    }
    found
}

/// A live log of two chunks (`a`, then `b`) appended and sealed: the seal's answer.
fn two_chunks_sealed(case: &UploadCase, a: &[u8], b: &[u8]) -> ArtifactReply {
    let _: LogAppendReply = case.client.append(&case.job, 0, a).json(200);
    let acked: LogAppendReply = case.client.append(&case.job, a.len() as u64, b).json(200);
    case.client.seal(&case.job, acked.acked).json(200)
}

/// One pass of serve's collection over everything written until an hour from now.
fn collect_all<R: Recorded>(
    server: &Server,
    recorded: &R,
    metrics: Option<&ql_control::metrics::Metrics>,
) -> Collected {
    let before = SystemTime::now() + Duration::from_secs(3_600);
    server.rt.block_on(ql_control::serve::collect_once(&server.blobs, recorded, before, metrics)).unwrap()
}

/// Waits until no chunk file is left under `artifacts` (the completion's removal ran).
fn until_no_chunk(artifacts: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !files_named(artifacts, ".chunk.").is_empty() {
        assert!(Instant::now() < deadline, "the chunks stay: {:?}", files_named(artifacts, ".chunk."));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_completion_that_records_the_log_removes_its_chunks_and_readers_read_the_artifact() {
    let case = UploadCase::new("chunks-go");
    let (client, job, server) = (&case.client, &case.job, &case.server);
    let (a, b) = (content(256 * 1024, 4), content(999, 5));
    let sealed = two_chunks_sealed(&case, &a, &b);
    let artifacts = server.dir.path().join("artifacts");
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 2, "sealed, the chunks are still there");

    // A completion the store refuses records nothing: the chunks stay the log.
    let mut other = sealed.receipt.clone();
    other.sha256 = Digest::of(b"other bytes");
    let refused = client.post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(other)));
    assert_eq!(refused.error(), ErrorCode::ArtifactConflict);

    // A follower looks at the run while it runs, and reads its first chunk only once the
    // completion has recorded the log and its chunks are gone: it gets the stored log.
    let (tell, told) = mpsc::channel();
    let (go, wait) = mpsc::channel();
    let gated = Gated { inner: server.blobs.clone(), gate: Arc::new(Mutex::new(Some((tell, wait)))) };
    let ops = ql_control::ops::Local { store: server.store.clone(), blobs: gated };
    let look = |follow| {
        let request = ql_control::ops::LogRequest { attempt: None, offset: 0, limit: 1 << 20, follow, wait_ms: 0 };
        server.rt.block_on(ops.log(&job.path.run, &request)).unwrap()
    };
    let whole = [a.as_slice(), &b].concat();
    let completion = job.completion(0, Some(sealed.receipt.clone()));
    std::thread::scope(|s| {
        let follower = s.spawn(|| look(true));
        told.recv().unwrap();
        let done: CompletionReply = client.post(&job.route(AttemptCommand::Completion), &completion).json(200);
        assert_eq!(done.status, TerminalStatus::Succeeded);
        assert_eq!(server.stats().chunk_removals(), 1, "the completion removes the chunks");
        until_no_chunk(&artifacts);
        go.send(()).unwrap();
        let followed = follower.join().unwrap();
        assert!(followed.terminal);
        assert_eq!((followed.bytes.as_slice(), followed.sealed.as_ref()), (whole.as_slice(), Some(&sealed.receipt)));
    });
    assert_eq!(server.inspect(&job.key(&log_id())), Some(sealed.receipt.clone()), "the artifact stays");
    assert_eq!(
        server.rt.block_on(server.store.log_chunks(&job.path.attempt, ql_control::store::ALL_CHUNKS)).unwrap().len(),
        2,
        "so do the rows"
    );
    let looked = look(false);
    assert_eq!((looked.bytes, looked.sealed), (whole, Some(sealed.receipt.clone())));
    // Its replay, as often as a worker likes, starts no removal again.
    for _ in 0..3 {
        let again: CompletionReply = client.post(&job.route(AttemptCommand::Completion), &completion).json(200);
        assert_eq!(again.result, Outcome::AlreadyCompleted);
    }
    assert_eq!(server.stats().chunk_removals(), 1, "a replay removes nothing");
}

#[test]
fn the_collection_removes_the_chunks_a_completion_left_of_a_recorded_log_only() {
    let case = UploadCase::new("chunks-collected");
    let (client, job, server) = (&case.client, &case.job, &case.server);
    let (a, b) = (content(256 * 1024, 6), content(4_321, 7));
    let sealed = two_chunks_sealed(&case, &a, &b);
    let artifacts = server.dir.path().join("artifacts");
    let authority = ql_control::serve::Authority(server.store.clone());
    let metrics = ql_control::metrics::Metrics::new();
    let collect = || collect_all(server, &authority, Some(&metrics));

    // Sealed but not yet recorded by a completion, the chunks are still the log.
    assert_eq!(server.rt.block_on(authority.recorded(&job.key(&log_id()))).unwrap(), Recording::NotYet);
    assert_eq!(collect(), Collected::default());
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 2);

    let done: CompletionReply =
        client.post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(sealed.receipt.clone()))).json(200);
    assert_eq!(done.status, TerminalStatus::Succeeded);
    until_no_chunk(&artifacts);
    // As if that removal had not happened (the store was down, the server stopped).
    let key = job.key(&log_id());
    for (offset, bytes) in [(0, &a), (a.len() as u64, &b)] {
        server.rt.block_on(server.blobs.put_chunk(&key, offset, bytes)).unwrap();
    }
    // Only that artifact of that attempt, under its run's project, counts as recorded;
    // the ended attempt will never record another.
    let mut other = key.clone();
    other.artifact = ArtifactId::parse("other").unwrap();
    let mut elsewhere = key.clone();
    elsewhere.project = ProjectId::parse("elsewhere").unwrap();
    for (k, recorded) in [(&key, Recording::Recorded), (&other, Recording::Never), (&elsewhere, Recording::Never)] {
        assert_eq!(server.rt.block_on(authority.recorded(k)).unwrap(), recorded, "{k:?}");
    }
    let before = server.snapshot();
    let chunk_bytes = (a.len() + b.len()) as u64;
    assert_eq!(collect(), Collected { chunks: 2, chunk_bytes, ..Collected::default() });
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 0);
    assert_eq!(server.snapshot(), before, "the authority is only asked");
    assert_eq!(server.inspect(&key), Some(sealed.receipt.clone()), "the artifact stays");
    let text = server.rt.block_on(metrics.render(&server.store)).unwrap();
    for line in [
        "ql_artifact_collections_total{outcome=\"done\"} 2".to_owned(),
        "ql_artifact_collected_total{kind=\"log_chunk\"} 2".to_owned(),
        format!("ql_artifact_collected_bytes_total{{kind=\"log_chunk\"}} {chunk_bytes}"),
        "ql_artifact_collected_total{kind=\"upload_leftover\"} 0".to_owned(),
        "ql_artifact_collection_unanswered_total 0".to_owned(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    let ops = ql_control::ops::Local { store: server.store.clone(), blobs: server.blobs.clone() };
    let request = ql_control::ops::LogRequest { attempt: None, offset: 0, limit: 1 << 20, follow: false, wait_ms: 0 };
    let log = server.rt.block_on(ops.log(&job.path.run, &request)).unwrap();
    assert_eq!((log.bytes, log.sealed), ([a.as_slice(), &b].concat(), Some(sealed.receipt)));

    // Chunks the ended attempt can never record stay, and serve's collection asks the
    // database about them once, not every pass.
    server.rt.block_on(server.blobs.put_chunk(&other, 0, b"never sealed")).unwrap();
    let counted = Counted(authority, Arc::default());
    let remembering = Remembering::new(counted.clone(), 8);
    for _ in 0..2 {
        assert_eq!(collect_all(server, &remembering, None), Collected::default());
    }
    assert_eq!(counted.1.load(Ordering::Relaxed), 1, "asked once");
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 1, "the chunk stays");
}

/// The authority the collection asks, counting the questions.
#[derive(Clone)]
struct Counted<R>(R, Arc<AtomicUsize>);

impl<R: Recorded> Recorded for Counted<R> {
    async fn recorded(&self, key: &ArtifactKey) -> Result<Recording, BlobError> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.recorded(key).await
    }
}

#[test]
fn a_chunk_refused_on_its_header_sends_no_content() {
    let case = UploadCase::new("live-log-fence");
    // At a stale lease version, the fence is refused before the content is asked for.
    let mut stale =
        Job { fence: case.job.fence.clone(), path: case.job.path.clone(), callback: case.job.callback.clone() };
    stale.fence.expected_lease_version = Counter::new(7).unwrap();
    assert_eq!(case.client.append(&stale, 0, &content(200_000, 4)).error(), ErrorCode::LeaseConflict);
    assert_eq!(case.server.snapshot(), case.before, "no row changed");
    // The spec's log limit (1 MiB here) is the most a log may reach, not a byte more.
    let chunk = content(256 * 1024, 5);
    for i in 0..4u64 {
        let reply: LogAppendReply = case.client.append(&case.job, i * chunk.len() as u64, &chunk).json(200);
        assert_eq!(reply.acked, (i + 1) * chunk.len() as u64);
    }
    let full = case.server.snapshot();
    assert_eq!(case.client.append(&case.job, 1024 * 1024, b"!").error(), ErrorCode::PayloadTooLarge);
    assert_eq!(case.server.snapshot(), full, "no row changed");
}

#[test]
fn a_completion_whose_receipt_is_not_what_the_store_holds_is_refused() {
    let case = UploadCase::new("completion-receipt");
    let log = content(10_000, 8);
    let stored: ArtifactReply =
        case.client.put_artifact(&case.job.artifact_route(&log_id()), &case.job.frame(&log)).json(200);
    let mut forged = stored.receipt.clone();
    forged.length += 1;
    let uploaded = case.server.snapshot();
    let route = case.job.route(AttemptCommand::Completion);
    let answer = case.client.post(&route, &case.job.completion(0, Some(forged)));
    assert_eq!(answer.error(), ErrorCode::ArtifactConflict);
    assert_eq!(case.server.snapshot(), uploaded);
    let done: CompletionReply = case.client.post(&route, &case.job.completion(0, Some(stored.receipt))).json(200);
    assert_eq!(done.result, Outcome::Completed);
}
