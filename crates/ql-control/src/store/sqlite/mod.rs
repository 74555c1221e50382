//! The embedded SQLite authority store: the single-node default.
//!
//! # Shape
//!
//! One dedicated thread owns the one write connection and takes jobs from a channel;
//! callers await the answer on a oneshot. SQLite admits one writer per file anyway, and a
//! single owner means no connection pool, no lock contention inside the process, and
//! statements prepared once. Reads for operators run on the same thread inside a read
//! transaction, so they see one consistent state.
//!
//! # One command, one transaction
//!
//! [`Store::execute`] runs `BEGIN IMMEDIATE` (taking the file's write lock up front, so
//! no other process can interleave), loads the command's [`Keys`](crate::core::Keys),
//! reads DB time *after* loading, calls [`core::decide`], writes the decision's rows and
//! events in order, and commits. A refusal rolls back (it carries no writes), and any SQL
//! error rolls back and becomes a [`StoreError`]: state and events change together or
//! not at all.
//!
//! # Settings
//!
//! WAL journal (readers do not block the writer), `synchronous=FULL` (a committed answer
//! survives power loss), `foreign_keys=ON`, and a busy timeout because other processes —
//! the operator CLI — open the same file. The file is created with mode 0600.
//!
//! # Wake-ups
//!
//! [`Store::changes`] rises when a decision says work may have appeared
//! ([`Decision::wake`](crate::core::Decision::wake)). Commits by *other* processes are
//! noticed through `PRAGMA data_version` on the write connection, checked every
//! [`SqliteOptions::watch_tick`] between jobs: that is how a run submitted by the CLI
//! wakes a long-poll in the server.
//!
//! # DB time
//!
//! `julianday('now')` read inside the transaction, plus [`SqliteOptions::clock_offset`].
//! The offset is zero in production; tests move time forward with it instead of sleeping.

mod load;
mod rows;
mod schema;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{oneshot, watch};

use ql_wire::ids::RunId;
use ql_wire::ErrorCode;

use super::{RunDetail, Snapshot, Store, StoreError};
use crate::core::{self, Command, IdGen, Reply, Timings, Write};
use crate::model::{AuditRecord, Run, Session};
use rows::{ATTEMPT_COLS, EVENT_COLS, LEASE_COLS, OFFER_COLS, RUN_COLS, SESSION_COLS};

pub use schema::SCHEMA_VERSION;

/// How to open a [`SqliteStore`].
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// Durations the authority hands out.
    pub timings: Timings,
    /// Added to SQL's clock to make DB time. Zero in production; tests raise it to move
    /// time forward without sleeping.
    pub clock_offset: Arc<AtomicI64>,
    /// How often to look for commits by other processes (default 250 ms).
    pub watch_tick: Duration,
    /// How long to wait for another process's write lock before failing (default 5 s).
    pub busy_timeout: Duration,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            timings: Timings::default(),
            clock_offset: Arc::new(AtomicI64::new(0)),
            watch_tick: Duration::from_millis(250),
            busy_timeout: Duration::from_secs(5),
        }
    }
}

/// The SQLite authority store. Cloning is cheap: every clone talks to the same writer
/// thread, which ends when the last clone is dropped.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.inner.path).finish_non_exhaustive()
    }
}

struct Inner {
    path: PathBuf,
    jobs: mpsc::Sender<Job>,
    changes: Arc<watch::Sender<u64>>,
}

type Job = Box<dyn FnOnce(&mut Writer) + Send>;

/// What the writer thread owns.
struct Writer {
    conn: Connection,
    timings: Timings,
    clock_offset: Arc<AtomicI64>,
    changes: Arc<watch::Sender<u64>>,
    data_version: Option<i64>,
}

fn sql(e: rusqlite::Error) -> StoreError {
    StoreError(format!("sqlite: {e}"))
}

fn gone() -> StoreError {
    StoreError("the sqlite writer thread has stopped".to_owned())
}

impl SqliteStore {
    /// Opens (or creates) the database at `path` with real DB time.
    pub fn open(path: impl AsRef<Path>, timings: Timings) -> Result<Self, StoreError> {
        Self::open_with_options(path, SqliteOptions { timings, ..SqliteOptions::default() })
    }

    /// Opens with a clock offset the caller controls (tests move DB time with it).
    pub fn open_with(
        path: impl AsRef<Path>,
        timings: Timings,
        clock_offset: Arc<AtomicI64>,
    ) -> Result<Self, StoreError> {
        Self::open_with_options(path, SqliteOptions { timings, clock_offset, ..SqliteOptions::default() })
    }

    /// Opens with every setting explicit: migrates the schema, then starts the writer.
    ///
    /// Opening blocks briefly (file I/O, and the busy timeout if another process is
    /// migrating); call it before serving, or from a blocking task.
    pub fn open_with_options(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let mut conn = schema::connect(&path, options.busy_timeout).map_err(sql)?;
        schema::migrate(&mut conn).map_err(sql)?;
        let (changes, _) = watch::channel(0u64);
        let changes = Arc::new(changes);
        let (jobs, queue) = mpsc::channel::<Job>();
        let mut writer = Writer {
            conn,
            timings: options.timings,
            clock_offset: options.clock_offset,
            changes: changes.clone(),
            data_version: None,
        };
        writer.watch_foreign_commits();
        let tick = options.watch_tick.max(Duration::from_millis(1));
        std::thread::Builder::new()
            .name("ql-sqlite-writer".to_owned())
            .spawn(move || writer.serve(queue, tick))
            .map_err(|e| StoreError(format!("starting the sqlite writer: {e}")))?;
        Ok(Self { inner: Arc::new(Inner { path, jobs, changes }) })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `f` on the writer thread and awaits its answer.
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Writer) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |w| {
            // The caller may have given up (a dropped request); the work is done anyway.
            let _ = tx.send(f(w));
        });
        self.inner.jobs.send(job).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

impl Writer {
    fn serve(mut self, queue: mpsc::Receiver<Job>, tick: Duration) {
        let mut checked = Instant::now();
        loop {
            match queue.recv_timeout(tick) {
                Ok(job) => {
                    // A panic in a decision is a bug, but it must not take the authority
                    // down: the transaction rolls back as it unwinds, the caller gets a
                    // StoreError from its dropped oneshot, and the thread serves on.
                    if catch_unwind(AssertUnwindSafe(|| job(&mut self))).is_err() && !self.conn.is_autocommit() {
                        let _ = self.conn.execute_batch("ROLLBACK");
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            if checked.elapsed() >= tick {
                self.watch_foreign_commits();
                checked = Instant::now();
            }
        }
    }

    /// `data_version` changes when another connection (another process) commits; this
    /// connection's own commits leave it alone, so the wake is exactly "someone else wrote".
    fn watch_foreign_commits(&mut self) {
        let Ok(version) = self.conn.query_row("PRAGMA data_version", [], |r| r.get::<_, i64>(0)) else {
            return;
        };
        if self.data_version.is_some_and(|seen| seen != version) {
            self.wake();
        }
        self.data_version = Some(version);
    }

    fn wake(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn offset(&self) -> i64 {
        self.clock_offset.load(Ordering::SeqCst)
    }

    fn execute(&mut self, cmd: &Command) -> Result<Result<Reply, ErrorCode>, StoreError> {
        let offset = self.offset();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(sql)?;
        let rows = load::load(&tx, &cmd.keys(), || schema::db_now(&tx, offset)).map_err(sql)?;
        // DB time after every row is loaded (and, with BEGIN IMMEDIATE, after the lock).
        let now = schema::db_now(&tx, offset).map_err(sql)?;
        let decision = core::decide(cmd, &rows, now, &self.timings, &mut IdGen::random());
        let reply = match decision.reply {
            Ok(reply) => reply,
            Err(code) => {
                // A refusal carries no writes by contract; nothing is applied either way.
                tx.rollback().map_err(sql)?;
                return Ok(Err(code));
            }
        };
        for write in &decision.writes {
            apply(&tx, write).map_err(sql)?;
        }
        tx.commit().map_err(sql)?;
        if decision.wake {
            self.wake();
        }
        Ok(Ok(reply))
    }
}

fn apply(conn: &Connection, write: &Write) -> rusqlite::Result<()> {
    match write {
        Write::Session(s) => rows::put_session(conn, s),
        Write::Run(r) => rows::put_run(conn, r),
        Write::Attempt(a) => rows::put_attempt(conn, a),
        Write::Offer(o) => rows::put_offer(conn, o),
        Write::Lease(l) => rows::put_lease(conn, l),
        Write::Event(e) => rows::append_event(conn, e),
    }
}

fn all<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    map: fn(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<Vec<T>> {
    conn.prepare_cached(sql)?.query_map(params, map)?.collect()
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn snapshot(conn: &mut Connection) -> rusqlite::Result<Snapshot> {
    // One read transaction: the six tables as of one commit.
    let tx = conn.transaction()?;
    let snap = Snapshot {
        sessions: all(&tx, &format!("SELECT {SESSION_COLS} FROM sessions ORDER BY id"), [], rows::session)?,
        runs: all(&tx, &format!("SELECT {RUN_COLS} FROM runs ORDER BY id"), [], rows::run)?,
        attempts: all(&tx, &format!("SELECT {ATTEMPT_COLS} FROM attempts ORDER BY id"), [], rows::attempt)?,
        offers: all(&tx, &format!("SELECT {OFFER_COLS} FROM offers ORDER BY id"), [], rows::offer)?,
        leases: all(&tx, &format!("SELECT {LEASE_COLS} FROM leases ORDER BY attempt_id"), [], rows::lease)?,
        events: all(&tx, &format!("SELECT {EVENT_COLS} FROM events ORDER BY seq"), [], rows::event)?,
    };
    tx.commit()?;
    Ok(snap)
}

fn run_detail(conn: &mut Connection, id: &RunId) -> rusqlite::Result<Option<RunDetail>> {
    let tx = conn.transaction()?;
    let Some(run) = load::run(&tx, id)? else {
        return Ok(None);
    };
    let attempts = all(
        &tx,
        &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE run_id = ?1 ORDER BY number"),
        [id.as_str()],
        rows::attempt,
    )?;
    let leases = all(
        &tx,
        &format!("SELECT {LEASE_COLS} FROM leases WHERE run_id = ?1 ORDER BY lease_generation, attempt_id"),
        [id.as_str()],
        rows::lease,
    )?;
    let events = all(
        &tx,
        &format!("SELECT {EVENT_COLS} FROM events WHERE run_id = ?1 ORDER BY seq"),
        [id.as_str()],
        rows::event,
    )?;
    tx.commit()?;
    Ok(Some(RunDetail { run, attempts, leases, events }))
}

impl Store for SqliteStore {
    async fn execute(&self, cmd: Command) -> Result<Result<Reply, ErrorCode>, StoreError> {
        self.call(move |w| w.execute(&cmd)).await
    }

    async fn audit(&self, record: AuditRecord) -> Result<(), StoreError> {
        self.call(move |w| {
            let at = schema::db_now(&w.conn, w.offset()).map_err(sql)?;
            rows::append_audit(&w.conn, &AuditRecord { at, ..record }).map_err(sql)
        })
        .await
    }

    async fn audits(&self) -> Result<Vec<AuditRecord>, StoreError> {
        self.call(|w| {
            all(&w.conn, "SELECT at, principal, route, outcome FROM audit ORDER BY seq", [], rows::audit).map_err(sql)
        })
        .await
    }

    async fn runs(&self, n: usize) -> Result<Vec<Run>, StoreError> {
        self.call(move |w| {
            let q = format!("SELECT {RUN_COLS} FROM runs ORDER BY created_at DESC, id DESC LIMIT ?1");
            all(&w.conn, &q, [limit(n)], rows::run).map_err(sql)
        })
        .await
    }

    async fn run_detail(&self, run: &RunId) -> Result<Option<RunDetail>, StoreError> {
        let run = run.clone();
        self.call(move |w| run_detail(&mut w.conn, &run).map_err(sql)).await
    }

    async fn sessions(&self, n: usize) -> Result<Vec<Session>, StoreError> {
        self.call(move |w| {
            let q = format!("SELECT {SESSION_COLS} FROM sessions ORDER BY created_at DESC, id DESC LIMIT ?1");
            all(&w.conn, &q, [limit(n)], rows::session).map_err(sql)
        })
        .await
    }

    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        self.call(|w| snapshot(&mut w.conn).map_err(sql)).await
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }
}

#[cfg(test)]
mod tests;
