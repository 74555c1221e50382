//! The journal file: framing, checksums, recovery, appends and compaction. The byte layout
//! is described in the [parent module](super).

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use zeroize::Zeroizing;

use super::state::{job_records, JournalState, Record, Refused};

/// The first eight bytes of every journal.
pub(crate) const MAGIC: [u8; 8] = *b"QLAGJRNL";
/// The format version this code writes and reads.
pub(crate) const VERSION: u32 = 1;
/// Magic plus version.
pub(crate) const HEADER_LEN: u64 = 12;
/// Length plus checksum in front of every payload.
const FRAME_LEN: usize = 8;
/// The largest payload accepted. A claim answer is at most 320 KiB of JSON and serde_json
/// escapes no more than any valid encoding must, so a claimed spec re-encodes to about that;
/// 1 MiB leaves room while a corrupt length cannot make recovery allocate much.
pub(crate) const RECORD_MAX: u32 = 1 << 20;
/// The journal's name inside its directory.
pub(crate) const FILE_NAME: &str = "journal";
/// Where compaction writes before renaming over [`FILE_NAME`].
pub(crate) const TEMP_NAME: &str = "journal.tmp";
/// The file an open journal holds an exclusive `flock` on: one agent per state directory.
/// (Not the journal itself: compaction renames a new file over it.)
pub(crate) const LOCK_NAME: &str = "lock";

/// Tuning for a [`Journal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Options {
    /// [`Journal::commit`] compacts once the file is larger than this and more than twice
    /// its size after the last compaction (so a large live state cannot make every append
    /// rewrite the file).
    pub(crate) compact_threshold: u64,
}

impl Default for Options {
    fn default() -> Self {
        // Small enough for a router's flash, large enough that compaction is rare.
        Self { compact_threshold: 256 * 1024 }
    }
}

/// What recovery found when the journal was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Recovery {
    /// Complete records read.
    pub(crate) records: usize,
    /// Complete records that the state refused (ignored the same way when first applied).
    pub(crate) refused: usize,
    /// Bytes of torn or corrupt tail cut off the file.
    pub(crate) dropped_bytes: u64,
    /// Whether the file was missing or held only part of its header, and was made anew.
    pub(crate) created: bool,
}

/// Why [`Journal::commit`] failed.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// The state refused the record; nothing was written.
    Refused(Refused),
    /// The record could not be made durable; nothing was applied and the file holds
    /// nothing of it.
    Io(io::Error),
    /// The record was made durable and applied, but the compaction that followed failed.
    /// The previous file is intact; the next commit tries again.
    Compaction(io::Error),
}

impl std::fmt::Display for CommitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) => write!(f, "journal record refused: {why}"),
            Self::Io(e) => write!(f, "journal write failed: {e}"),
            Self::Compaction(e) => write!(f, "journal record kept, but compaction failed: {e}"),
        }
    }
}

impl std::error::Error for CommitError {}

/// The open journal file. Appends go to the end of the last good record.
#[derive(Debug)]
pub(crate) struct Journal {
    dir: PathBuf,
    file: File,
    /// End of the last durable record: where the next one goes.
    len: u64,
    /// The file's length right after it was opened or compacted.
    base_len: u64,
    options: Options,
    recovery: Recovery,
    /// Set when a failed write could not be cut back off the file; appends are refused until
    /// a compaction rewrites it (or the journal is reopened).
    poisoned: bool,
    /// Locked for as long as the journal is open; the kernel lets go when the process ends,
    /// however it ends.
    _lock: File,
}

impl Journal {
    /// Opens (creating if needed) the journal in `dir` with default options, recovering the
    /// state its complete records describe and cutting off any torn or corrupt tail.
    pub(crate) fn open(dir: &Path) -> io::Result<(Journal, JournalState)> {
        Self::open_with(dir, Options::default())
    }

    /// [`Journal::open`] with explicit options.
    pub(crate) fn open_with(dir: &Path, options: Options) -> io::Result<(Journal, JournalState)> {
        DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        let lock = lock(dir)?;
        remove_if_present(&dir.join(TEMP_NAME))?;
        let path = dir.join(FILE_NAME);
        let mut file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Self::create(dir, options, lock),
            Err(e) => return Err(e),
        };
        // The file holds raw tokens: keep it private even if someone loosened its mode.
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        let file_len = file.metadata()?.len();

        let mut header = [0u8; HEADER_LEN as usize];
        let got = read_up_to(&mut file, &mut header)?;
        if got < header.len() {
            let expected = header_bytes();
            if header[..got] != expected[..got] {
                return Err(not_a_journal(&path));
            }
            // Only a crash-truncated copy of a fresh journal can look like this (creation
            // renames a complete header into place): it held no records.
            return Self::create(dir, options, lock);
        }
        if header[..8] != MAGIC {
            return Err(not_a_journal(&path));
        }
        let version = u32::from_be_bytes(header[8..].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{} is journal format version {version}; this agent reads {VERSION}", path.display()),
            ));
        }

        let mut state = JournalState::default();
        let mut recovery = Recovery::default();
        let mut reader = io::BufReader::with_capacity(8 * 1024, &mut file);
        let mut good = HEADER_LEN;
        while let Some(frame_len) = next_frame(&mut reader, file_len - good)? {
            let record = &frame_len.record;
            recovery.records += 1;
            if state.apply(record).is_err() {
                recovery.refused += 1;
            }
            good += frame_len.len;
        }
        drop(reader);
        if good < file_len {
            recovery.dropped_bytes = file_len - good;
            file.set_len(good)?;
            file.sync_all()?;
        }
        let journal = Journal {
            dir: dir.to_owned(),
            file,
            len: good,
            base_len: good,
            options,
            recovery,
            poisoned: false,
            _lock: lock,
        };
        Ok((journal, state))
    }

    /// Writes a fresh journal holding only the header, atomically.
    fn create(dir: &Path, options: Options, lock: File) -> io::Result<(Journal, JournalState)> {
        let file = write_atomically(dir, |_| Ok(()))?;
        // The directory may be new too (a first start): its own entry is made durable,
        // or a power loss could take the journal, and the runs it records, with it. Best
        // effort: a parent this user may not open is no reason not to start.
        if let Some(parent) = dir.parent() {
            // A relative directory's parent may be the current one.
            let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            let _ = sync_dir(parent);
        }
        let recovery = Recovery { created: true, ..Recovery::default() };
        let journal = Journal {
            dir: dir.to_owned(),
            file,
            len: HEADER_LEN,
            base_len: HEADER_LEN,
            options,
            recovery,
            poisoned: false,
            _lock: lock,
        };
        Ok((journal, JournalState::default()))
    }

    /// What recovery found when this journal was opened.
    pub(crate) fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// The journal's length in bytes: header plus every durable record.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Appends one record and fsyncs it. When this returns `Ok` the record counts and the
    /// caller applies it; on an error the file holds nothing of it.
    pub(crate) fn append(&mut self, record: &Record) -> io::Result<()> {
        if self.poisoned {
            return Err(io::Error::other("an earlier journal write failed and could not be undone; compact or reopen"));
        }
        let frame = encode(record)?;
        let written = self.file.write_all_at(&frame, self.len).and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += frame.len() as u64;
                Ok(())
            }
            Err(e) => {
                // A partial frame (or one whose fsync failed, so may be lost) must not stay
                // in front of later records: cut it off, or refuse further appends.
                if self.file.set_len(self.len).and_then(|()| self.file.sync_all()).is_err() {
                    self.poisoned = true;
                }
                Err(e)
            }
        }
    }

    /// Checks the record against `state`, appends it, applies it, then compacts when a job
    /// was dropped or the file has grown past the threshold. The one call the agent needs to
    /// persist a fact before acting on it.
    pub(crate) fn commit(&mut self, state: &mut JournalState, record: &Record) -> Result<(), CommitError> {
        state.check(record).map_err(CommitError::Refused)?;
        self.append(record).map_err(CommitError::Io)?;
        state.apply(record).expect("check accepted the record");
        if matches!(record, Record::Dropped { .. }) || self.should_compact() {
            self.compact(state).map_err(CommitError::Compaction)?;
        }
        Ok(())
    }

    /// Whether the file has grown enough to be worth rewriting.
    pub(crate) fn should_compact(&self) -> bool {
        self.len > self.options.compact_threshold && self.len > self.base_len.saturating_mul(2)
    }

    /// Rewrites the file to hold just the records that rebuild `state`, which must be the
    /// state this journal's records produced. Writes a temporary file, fsyncs it, renames it
    /// over the journal and fsyncs the directory; on an error the old file stays in force.
    pub(crate) fn compact(&mut self, state: &JournalState) -> io::Result<()> {
        let mut len = HEADER_LEN;
        let file = write_atomically(&self.dir, |f| {
            let mut put = |record: &Record| -> io::Result<()> {
                let frame = encode(record)?;
                f.write_all(&frame)?;
                len += frame.len() as u64;
                Ok(())
            };
            if let Some(session) = state.session_record() {
                put(&session)?;
            }
            for (key, job) in &state.jobs {
                job_records(key, job).iter().try_for_each(&mut put)?;
            }
            Ok(())
        });
        match file {
            Ok(file) => {
                self.file = file;
                self.len = len;
                self.base_len = len;
                self.poisoned = false;
                Ok(())
            }
            Err(AtomicWriteError::Before(e)) => Err(e),
            Err(AtomicWriteError::After(e)) => {
                // The rename happened but may not be durable: the old file could come back
                // after a crash, so appends to the new one are not safe to count on.
                self.poisoned = true;
                Err(e)
            }
        }
    }
}

/// One complete record and the bytes it took.
struct Frame {
    record: Record,
    len: u64,
}

/// Reads the next record, or `None` at the end of the good records: end of file, a torn
/// frame, an impossible length or a checksum mismatch. A record whose checksum holds but
/// whose payload does not decode was written whole by something else; that is an error,
/// not a tail to cut.
fn next_frame(reader: &mut impl Read, remaining: u64) -> io::Result<Option<Frame>> {
    if remaining < FRAME_LEN as u64 {
        return Ok(None);
    }
    let mut head = [0u8; FRAME_LEN];
    reader.read_exact(&mut head)?;
    let len = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
    let sum = u32::from_be_bytes(head[4..].try_into().expect("4 bytes"));
    if len == 0 || len > RECORD_MAX || u64::from(len) > remaining - FRAME_LEN as u64 {
        return Ok(None);
    }
    let mut payload = Zeroizing::new(vec![0u8; len as usize]);
    reader.read_exact(&mut payload)?;
    if crc32(&[&head[..4], &payload]) != sum {
        return Ok(None);
    }
    let record = serde_json::from_slice(&payload).map_err(|e| {
        io::Error::new(io::ErrorKind::InvalidData, format!("journal record with a good checksum does not decode: {e}"))
    })?;
    Ok(Some(Frame { record, len: FRAME_LEN as u64 + u64::from(len) }))
}

/// Encodes a record as one frame in a zeroizing buffer sized up front, so no reallocation
/// leaves a stray copy of a token behind.
fn encode(record: &Record) -> io::Result<Zeroizing<Vec<u8>>> {
    let mut counter = ByteCount(0);
    serde_json::to_writer(&mut counter, record)?;
    let len = counter.0;
    if len == 0 || len > RECORD_MAX as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("journal record of {len} bytes is too large")));
    }
    let mut frame = Zeroizing::new(Vec::with_capacity(FRAME_LEN + len));
    frame.extend_from_slice(&(len as u32).to_be_bytes());
    frame.extend_from_slice(&[0; 4]);
    serde_json::to_writer(&mut *frame, record)?;
    debug_assert_eq!(frame.len(), FRAME_LEN + len);
    let sum = crc32(&[&frame[..4], &frame[FRAME_LEN..]]);
    frame[4..FRAME_LEN].copy_from_slice(&sum.to_be_bytes());
    Ok(frame)
}

/// A writer that only counts.
struct ByteCount(usize);

impl Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn header_bytes() -> [u8; HEADER_LEN as usize] {
    let mut h = [0u8; HEADER_LEN as usize];
    h[..8].copy_from_slice(&MAGIC);
    h[8..].copy_from_slice(&VERSION.to_be_bytes());
    h
}

enum AtomicWriteError {
    /// Failed before the rename: the old file is untouched.
    Before(io::Error),
    /// Failed after the rename: the new file is in place but maybe not durably.
    After(io::Error),
}

impl From<AtomicWriteError> for io::Error {
    fn from(e: AtomicWriteError) -> Self {
        match e {
            AtomicWriteError::Before(e) | AtomicWriteError::After(e) => e,
        }
    }
}

/// Writes the header and whatever `body` writes to the temporary file, fsyncs it, renames
/// it over the journal and fsyncs the directory. Returns the new file, open for appends.
fn write_atomically(dir: &Path, body: impl FnOnce(&mut File) -> io::Result<()>) -> Result<File, AtomicWriteError> {
    let temp = dir.join(TEMP_NAME);
    let before = |e| {
        let _ = fs::remove_file(&temp);
        AtomicWriteError::Before(e)
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temp)
        .map_err(before)?;
    file.write_all(&header_bytes())
        .and_then(|()| body(&mut file))
        .and_then(|()| file.sync_all())
        .and_then(|()| fs::rename(&temp, dir.join(FILE_NAME)))
        .map_err(before)?;
    sync_dir(dir).map_err(AtomicWriteError::After)?;
    file.seek(SeekFrom::End(0)).map_err(AtomicWriteError::After)?;
    Ok(file)
}

/// Takes the state directory's lock, or says who has it. Two agents on one journal would
/// each claim, start and report the same jobs.
fn lock(dir: &Path) -> io::Result<File> {
    let path = dir.join(LOCK_NAME);
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(&path)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("another ql-agent is using this state directory (it holds {})", path.display()),
        )),
        Err(fs::TryLockError::Error(e)) => Err(e),
    }
}

/// Makes a create, rename or unlink in `dir` durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn not_a_journal(path: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{} is not a ql-agent journal", path.display()))
}

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320) over the concatenated parts.
pub(crate) fn crc32(parts: &[&[u8]]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    let mut c = !0u32;
    for part in parts {
        for &b in *part {
            c = TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
        }
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::super::state::fixtures::*;
    use super::*;
    use ql_wire::lease::StopIntent;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A private directory under the system temp dir, removed on drop.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(tag: &str) -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("ql-agent-journal-{}-{n}-{tag}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Self(path)
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn journal_path(dir: &TestDir) -> PathBuf {
        dir.0.join(FILE_NAME)
    }

    /// A session, two jobs through part of their lives, and one dropped job.
    fn several_records() -> Vec<Record> {
        let (a, b, d) = (key("s1", "a1"), key("s1", "b2"), key("s0", "d3"));
        let mut records = vec![session("s0", 1), offered(&d, 1), claimed(&d), session("s1", 2)];
        records.extend(lifecycle(&a).into_iter().take(6));
        records.extend([offered(&b, 5), claimed(&b), Record::Dropped { job: d }]);
        records.push(Record::StopSeen { job: a, intent: StopIntent::Timeout });
        records
    }

    fn replay(records: &[Record]) -> JournalState {
        let mut state = JournalState::default();
        for r in records {
            state.apply(r).unwrap();
        }
        state
    }

    /// Writes `records` through a journal and returns the file's bytes and each record's end
    /// offset.
    fn write_journal(dir: &TestDir, records: &[Record]) -> (Vec<u8>, Vec<u64>) {
        let (mut journal, mut state) = Journal::open(&dir.0).unwrap();
        let mut ends = Vec::new();
        for r in records {
            journal.append(r).unwrap();
            state.apply(r).unwrap();
            ends.push(journal.len());
        }
        drop(journal);
        (fs::read(journal_path(dir)).unwrap(), ends)
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(&[b"123456789"]), 0xCBF4_3926);
        assert_eq!(crc32(&[b"1234", b"", b"56789"]), 0xCBF4_3926);
        assert_eq!(crc32(&[]), 0);
    }

    #[test]
    fn a_second_open_of_one_state_directory_is_refused_until_the_first_closes() {
        let dir = TestDir::new("lock");
        let (mut first, mut state) = Journal::open(&dir.0).unwrap();
        first.commit(&mut state, &session("s1", 1)).unwrap();
        let before = fs::read(journal_path(&dir)).unwrap();

        let err = Journal::open(&dir.0).expect_err("a second agent on the same directory");
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert!(err.to_string().contains("another ql-agent is using this state directory"), "{err}");
        assert_eq!(fs::read(journal_path(&dir)).unwrap(), before, "the refused open changed the journal");
        let mode = fs::metadata(dir.0.join(LOCK_NAME)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);

        // Compaction renames a new journal into place; the lock stays held.
        first.compact(&state).unwrap();
        assert!(Journal::open(&dir.0).is_err(), "the lock must outlive a compaction");

        drop(first);
        // Other tests of this process fork children, and a child holds a copy of every
        // descriptor (the lock's too) until its exec closes it: the lock is free once no
        // such copy is left, which takes a moment at most.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let reopened = loop {
            match Journal::open(&dir.0) {
                Ok((_, reopened)) => break reopened,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && std::time::Instant::now() < deadline => {
                    std::thread::yield_now()
                }
                Err(e) => panic!("the lock outlived the journal: {e}"),
            }
        };
        assert_eq!(reopened, state);
    }

    #[test]
    fn a_new_journal_is_a_private_file_holding_only_the_header() {
        let dir = TestDir::new("new");
        let (journal, state) = Journal::open(&dir.0.join("nested")).unwrap();
        assert_eq!(state, JournalState::default());
        assert!(journal.recovery().created);
        let path = dir.0.join("nested").join(FILE_NAME);
        assert_eq!(fs::read(&path).unwrap(), header_bytes());
        assert_eq!(&header_bytes()[..], b"QLAGJRNL\0\0\0\x01");
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir.0.join("nested")), 0o700);
    }

    #[test]
    fn records_round_trip_through_the_file() {
        let dir = TestDir::new("round-trip");
        let records = several_records();
        let (bytes, ends) = write_journal(&dir, &records);
        assert_eq!(bytes.len() as u64, *ends.last().unwrap());
        let (journal, state) = Journal::open(&dir.0).unwrap();
        assert_eq!(state, replay(&records));
        let recovery = journal.recovery();
        assert_eq!(recovery, Recovery { records: records.len(), refused: 0, dropped_bytes: 0, created: false });
        assert_eq!(mode(&journal_path(&dir)), 0o600);
    }

    #[test]
    fn the_file_keeps_raw_tokens_because_it_is_their_only_home() {
        let dir = TestDir::new("tokens");
        let (bytes, _) = write_journal(&dir, &several_records());
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains(token(3).expose()) && text.contains(token(9).expose()));
    }

    #[test]
    fn truncation_at_every_offset_recovers_exactly_the_complete_prefix() {
        let dir = TestDir::new("every-offset");
        let records = several_records();
        let (bytes, ends) = write_journal(&dir, &records);
        let extra = session("s9", 9);
        for cut in 0..=bytes.len() {
            fs::write(journal_path(&dir), &bytes[..cut]).unwrap();
            let complete = ends.iter().filter(|&&end| end <= cut as u64).count();
            let (mut journal, state) = Journal::open(&dir.0).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
            assert_eq!(state, replay(&records[..complete]), "cut at {cut}");
            let good = if complete == 0 { HEADER_LEN } else { ends[complete - 1] };
            assert_eq!(fs::metadata(journal_path(&dir)).unwrap().len(), good, "cut at {cut}: file repaired");
            let expected_drop = if (cut as u64) < HEADER_LEN { 0 } else { cut as u64 - good };
            assert_eq!(journal.recovery().dropped_bytes, expected_drop, "cut at {cut}");
            // The repaired file takes appends that a later open reads back.
            journal.append(&extra).unwrap();
            drop(journal);
            let (_, reopened) = Journal::open(&dir.0).unwrap();
            let mut want = replay(&records[..complete]);
            want.apply(&extra).unwrap();
            assert_eq!(reopened, want, "cut at {cut}, after an append");
        }
    }

    #[test]
    fn a_flipped_byte_anywhere_in_the_last_record_drops_only_that_record() {
        let dir = TestDir::new("flip");
        let records = several_records();
        let (bytes, ends) = write_journal(&dir, &records);
        let last_start = ends[ends.len() - 2] as usize;
        let without_last = replay(&records[..records.len() - 1]);
        for at in last_start..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x20;
            fs::write(journal_path(&dir), &damaged).unwrap();
            let (journal, state) = Journal::open(&dir.0).unwrap();
            assert_eq!(state, without_last, "flip at {at}");
            assert_eq!(journal.recovery().dropped_bytes, (bytes.len() - last_start) as u64, "flip at {at}");
            assert_eq!(fs::read(journal_path(&dir)).unwrap(), &bytes[..last_start], "flip at {at}");
        }
    }

    #[test]
    fn corruption_in_the_middle_drops_everything_after_it() {
        let dir = TestDir::new("middle");
        let records = several_records();
        let (mut bytes, ends) = write_journal(&dir, &records);
        // Damage the third record's payload: the first two survive, nothing after is trusted.
        bytes[ends[1] as usize + FRAME_LEN + 2] ^= 1;
        fs::write(journal_path(&dir), &bytes).unwrap();
        let (_, state) = Journal::open(&dir.0).unwrap();
        assert_eq!(state, replay(&records[..2]));
        assert_eq!(fs::metadata(journal_path(&dir)).unwrap().len(), ends[1]);
    }

    #[test]
    fn a_checksummed_record_that_does_not_decode_is_an_error_not_a_tail() {
        let dir = TestDir::new("undecodable");
        let mut bytes = header_bytes().to_vec();
        let payload = br#"{"kind":"fromTheFuture"}"#;
        bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&crc32(&[&(payload.len() as u32).to_be_bytes(), payload]).to_be_bytes());
        bytes.extend_from_slice(payload);
        fs::write(journal_path(&dir), &bytes).unwrap();
        let err = Journal::open(&dir.0).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(fs::read(journal_path(&dir)).unwrap(), bytes, "the file must be left for inspection");
    }

    #[test]
    fn a_foreign_file_or_another_version_is_refused_and_left_alone() {
        let dir = TestDir::new("foreign");
        fs::write(journal_path(&dir), b"hello, this is not a journal").unwrap();
        assert_eq!(Journal::open(&dir.0).unwrap_err().kind(), io::ErrorKind::InvalidData);
        fs::write(journal_path(&dir), b"QLA").unwrap();
        Journal::open(&dir.0).unwrap();
        fs::write(journal_path(&dir), b"QLX").unwrap();
        assert_eq!(Journal::open(&dir.0).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let mut v2 = header_bytes();
        v2[11] = 2;
        fs::write(journal_path(&dir), v2).unwrap();
        assert_eq!(Journal::open(&dir.0).unwrap_err().kind(), io::ErrorKind::Unsupported);
        assert_eq!(fs::read(journal_path(&dir)).unwrap(), v2);
    }

    #[test]
    fn a_stale_temp_file_from_a_crashed_compaction_is_removed() {
        let dir = TestDir::new("stale-temp");
        let records = several_records();
        write_journal(&dir, &records);
        fs::write(dir.0.join(TEMP_NAME), b"half a compaction").unwrap();
        let (_, state) = Journal::open(&dir.0).unwrap();
        assert_eq!(state, replay(&records));
        assert!(!dir.0.join(TEMP_NAME).exists());
    }

    #[test]
    fn a_loosened_mode_is_tightened_on_open() {
        let dir = TestDir::new("mode");
        write_journal(&dir, &several_records());
        fs::set_permissions(journal_path(&dir), fs::Permissions::from_mode(0o644)).unwrap();
        Journal::open(&dir.0).unwrap();
        assert_eq!(mode(&journal_path(&dir)), 0o600);
    }

    #[test]
    fn compaction_keeps_the_state_and_shrinks_the_file() {
        let dir = TestDir::new("compact");
        let k = key("s1", "a1");
        let mut records = several_records();
        records.extend((3..200).map(|v| Record::Renewed { job: k.clone(), lease_version: c(v) }));
        let (bytes, _) = write_journal(&dir, &records);
        let (mut journal, state) = Journal::open(&dir.0).unwrap();
        assert_eq!(state, replay(&records));
        journal.compact(&state).unwrap();
        let compacted = fs::metadata(journal_path(&dir)).unwrap().len();
        assert_eq!(compacted, journal.len());
        assert!(compacted * 4 < bytes.len() as u64, "{compacted} vs {}", bytes.len());
        assert_eq!(mode(&journal_path(&dir)), 0o600);
        assert!(!dir.0.join(TEMP_NAME).exists());
        // Appends after compaction land in the new file.
        let extra = Record::Renewed { job: k.clone(), lease_version: c(500) };
        journal.append(&extra).unwrap();
        drop(journal);
        let (_, reopened) = Journal::open(&dir.0).unwrap();
        let mut want = state;
        want.apply(&extra).unwrap();
        assert_eq!(reopened, want);
    }

    #[test]
    fn commit_refuses_before_writing_and_applies_after() {
        let dir = TestDir::new("commit");
        let k = key("s1", "a1");
        let (mut journal, mut state) = Journal::open(&dir.0).unwrap();
        let before = journal.len();
        match journal.commit(&mut state, &claimed(&k)) {
            Err(CommitError::Refused(Refused::UnknownJob)) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(journal.len(), before);
        assert_eq!(fs::metadata(journal_path(&dir)).unwrap().len(), before);
        journal.commit(&mut state, &offered(&k, 3)).unwrap();
        journal.commit(&mut state, &claimed(&k)).unwrap();
        assert!(state.jobs[&k].lease.is_some());
        drop(journal);
        assert_eq!(Journal::open(&dir.0).unwrap().1, state);
    }

    #[test]
    fn commit_compacts_when_a_job_is_dropped() {
        let dir = TestDir::new("commit-drop");
        let (a, b) = (key("s1", "a1"), key("s1", "b1"));
        let (mut journal, mut state) = Journal::open(&dir.0).unwrap();
        for r in lifecycle(&a).iter().chain(&[offered(&b, 4)]) {
            journal.commit(&mut state, r).unwrap();
        }
        let grown = journal.len();
        journal.commit(&mut state, &Record::Dropped { job: a.clone() }).unwrap();
        assert!(journal.len() < grown / 4, "{} vs {grown}", journal.len());
        drop(journal);
        let (_, reopened) = Journal::open(&dir.0).unwrap();
        assert_eq!(reopened, state);
        assert_eq!(reopened.jobs.keys().collect::<Vec<_>>(), vec![&b]);
    }

    #[test]
    fn commit_keeps_the_file_bounded_past_the_threshold() {
        let dir = TestDir::new("commit-bounded");
        let k = key("s1", "a1");
        let options = Options { compact_threshold: 4096 };
        let (mut journal, mut state) = Journal::open_with(&dir.0, options).unwrap();
        journal.commit(&mut state, &offered(&k, 3)).unwrap();
        journal.commit(&mut state, &claimed(&k)).unwrap();
        let mut largest = 0;
        for v in 2..2000 {
            journal.commit(&mut state, &Record::Renewed { job: k.clone(), lease_version: c(v) }).unwrap();
            largest = largest.max(fs::metadata(journal_path(&dir)).unwrap().len());
        }
        assert!(largest <= 4096 + 200, "the file grew to {largest}");
        drop(journal);
        let (_, reopened) = Journal::open_with(&dir.0, options).unwrap();
        assert_eq!(reopened.jobs[&k].lease.as_ref().unwrap().version, c(1999));
        assert_eq!(reopened, state);
    }

    #[test]
    fn records_refused_by_the_state_are_skipped_on_replay_the_same_way() {
        let dir = TestDir::new("refused");
        let k = key("s1", "a1");
        // Written with append alone, as a caller that applies afterwards might.
        let (mut journal, _) = Journal::open(&dir.0).unwrap();
        for r in [claimed(&k), offered(&k, 3), claimed(&k), claimed(&k)] {
            journal.append(&r).unwrap();
        }
        drop(journal);
        let (journal, state) = Journal::open(&dir.0).unwrap();
        assert_eq!(state, replay(&[offered(&k, 3), claimed(&k)]));
        assert_eq!((journal.recovery().records, journal.recovery().refused), (4, 2));
    }

    #[test]
    fn an_oversized_record_is_refused_without_touching_the_file() {
        let dir = TestDir::new("oversized");
        let k = key("s1", "a1");
        let (mut journal, _) = Journal::open(&dir.0).unwrap();
        let mut spec = spec();
        spec.script.as_mut().unwrap().source = "\u{1}".repeat(RECORD_MAX as usize / 4);
        let huge = Record::Claimed { job: k, lease_generation: c(1), lease_version: c(1), lease_ttl_ms: 1, spec };
        assert_eq!(journal.append(&huge).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(fs::metadata(journal_path(&dir)).unwrap().len(), HEADER_LEN);
        journal.append(&session("s1", 1)).unwrap();
    }
}
