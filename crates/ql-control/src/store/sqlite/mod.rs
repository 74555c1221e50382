//! The embedded SQLite authority store: the single-node default.
//!
//! # Shape
//!
//! One dedicated thread owns the one write connection and takes jobs from a channel;
//! callers await the answer on a oneshot. SQLite admits one writer per file anyway, and a
//! single owner means no connection pool, no lock contention inside the process, and
//! statements prepared once. Reads that change nothing (operators', a completion's run, a
//! log's chunks) run on a thread and connection of their own ([`reader`]), each in a read
//! transaction: one consistent state, and the writer never waits for them.
//!
//! # One command, one atomic unit; many commands, one fsync
//!
//! Each command runs inside its own `SAVEPOINT`: it loads the command's
//! [`Keys`](crate::core::Keys), reads DB time *after* loading, calls [`core::decide`], and
//! writes the decision's rows and events in order. A refusal carries no writes; any SQL
//! error rolls back to the savepoint and becomes a [`StoreError`]: a command's state and
//! events change together or not at all. A request's audit records
//! ([`Store::execute_audited`]) are written under the same savepoint, so they commit with
//! the decision they precede.
//!
//! The writer takes every job already queued (up to [`BATCH_MAX`]) into one
//! `BEGIN IMMEDIATE` transaction (taking the file's write lock up front, so no other
//! process can interleave) and commits them together: group commit, so concurrent agents
//! share one fsync. Two windows let a batch gather first: right after a batch of idle
//! agents' polls and heartbeats (which arrive one by one) the writer sleeps
//! [`SqliteOptions::idle_window`], and once the last batch showed many concurrent callers
//! it waits up to [`SqliteOptions::commit_window`] for as many again; a lone caller, or one
//! after a quiet, never waits. If the commit fails, every command of the batch answers
//! [`StoreError`] (503, safe to repeat) and nothing of the batch is kept.
//!
//! # Durability
//!
//! `synchronous=NORMAL`: SQLite writes the WAL at commit without syncing it, and the
//! writer syncs it (`fdatasync`, what `FULL` would do) before any answer of a batch that
//! decided something leaves. A batch whose commands only saw sessions or refused
//! ([`core::Decision::only_liveness`]) is answered at once and synced by the next batch
//! that decides something — the WAL is one file written in order, so that sync covers
//! every earlier commit — or after [`SqliteOptions::lazy_sync`]: an idle fleet's polls
//! then share a sync a second instead of taking one each. With
//! [`SqliteOptions::hold_batches`] above one, the batches already queued behind a deciding
//! one commit before its sync, and every answer since (lazy ones too, which may have read
//! the decision) waits for that one sync. A failed sync breaks the writer until a restart:
//! what it committed may not be on disk, so nothing is answered from it.
//!
//! # Settings
//!
//! WAL journal (readers do not block the writer), `synchronous=NORMAL` with the writer's
//! own syncs above, `foreign_keys=ON`, and a busy timeout because other processes —
//! the operator CLI — open the same file. The file is created with mode 0600. The WAL is
//! checkpointed by a thread of its own ([`checkpoint`]); the writer's
//! `wal_autocheckpoint` is only a backstop.
//!
//! # Wake-ups
//!
//! [`Store::changes`] rises when a decision says work may have appeared
//! ([`Decision::wake`](crate::core::Decision::wake) for every poll, or the runs a decision
//! queued, [`Decision::wants`](crate::core::Decision::wants), for the polls of the
//! sessions that take them: [`super::wakes`]). Commits by *other* processes are
//! noticed through `PRAGMA data_version` on the write connection, checked every
//! [`SqliteOptions::watch_tick`] between jobs: that is how a run submitted by the CLI
//! wakes a long-poll in the server.
//!
//! # DB time
//!
//! `julianday('now')` read inside the transaction, plus [`SqliteOptions::clock_offset`].
//! The offset is zero in production; tests move time forward with it instead of sleeping.

mod checkpoint;
mod load;
mod queue;
mod reader;
mod rows;
mod schema;

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::sync::{oneshot, watch};

use ql_wire::ids::{AttemptId, ProjectId, RunId, WorkerId};
use ql_wire::ErrorCode;

use super::loaded::{Known, Loaded};
use super::records::{
    ATTEMPT_COLS, AUDIT_COLS, CERTIFICATE_COLS, DELIVERY_COLS, ENROLMENT_COLS, EVENT_COLS, FIRE_COLS, LEASE_COLS,
    LOG_CHUNK_COLS, OFFER_COLS, OPERATOR_COLS, RUN_COLS, SCHEDULE_COLS, SESSION_COLS, WORKER_COLS,
};
use super::wakes::Wakes;
use super::{Audit, AuditRetention, RunDetail, RunQuery, RunRetention, SessionRetention, Snapshot, Store, StoreError};
use crate::core::{self, Command, IdGen, Reply, Timings, Write};
use crate::model::{AuditRecord, Certificate, Fire, LogChunk, Operator, Run, Schedule};

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
    /// Group commit: once the last batch held at least [`SqliteOptions::commit_window_min_batch`]
    /// jobs (many concurrent callers), how long a new batch may wait for as many before it
    /// commits (default 1 ms). Zero commits what is queued at once. A disk that syncs fast
    /// would otherwise commit each cohort of callers in several small pieces; a few
    /// callers, or a lone one, never wait.
    pub commit_window: Duration,
    /// The batch size from which the commit window applies (default 8): below it the
    /// wait would cost a few callers more time than the sync it saves (PostgreSQL's
    /// `commit_siblings` plays the same part for its `commit_delay`).
    pub commit_window_min_batch: usize,
    /// How long a commit that changed nothing but a session's liveness (an idle poll, a
    /// plain heartbeat) or nothing but audit records (a refusal) may wait for the WAL's
    /// sync, which the next commit that decides anything, or this timer, does for it
    /// ([`core::Decision::only_liveness`]). Zero syncs every commit before its answer.
    pub lazy_sync: Duration,
    /// Most batches committed one after another, while callers keep coming, before the
    /// sync their answers wait for (1: each batch synced on its own).
    pub hold_batches: usize,
    /// After a batch of idle agents' polls and heartbeats (each only saw its session),
    /// how long the writer lets the next batch gather before it begins (default 10 ms).
    /// Idle agents' polls arrive one by one; committed together they share their pages
    /// and WAL writes, and the writer and the connections' thread wake once per batch,
    /// not once per poll.
    /// Zero begins at once.
    pub idle_window: Duration,
    /// How often a thread of its own checkpoints the WAL into the database file, when
    /// something was committed ([`checkpoint`]). Zero: no such thread, and the writer
    /// checkpoints inside its commits every `wal_autocheckpoint_pages`.
    pub checkpoint_interval: Duration,
    /// WAL pages after which the writer checkpoints inside a commit (SQLite's
    /// `wal_autocheckpoint`): with the checkpoint thread, only a backstop.
    pub wal_autocheckpoint_pages: u32,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            timings: Timings::default(),
            clock_offset: Arc::new(AtomicI64::new(0)),
            watch_tick: Duration::from_millis(250),
            busy_timeout: Duration::from_secs(5),
            commit_window: Duration::from_millis(1),
            commit_window_min_batch: COMMIT_WINDOW_MIN_BATCH,
            lazy_sync: Duration::from_secs(1),
            hold_batches: HOLD_MAX,
            idle_window: Duration::from_millis(10),
            checkpoint_interval: Duration::from_secs(1),
            wal_autocheckpoint_pages: WAL_BACKSTOP_PAGES,
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
    wakes: Arc<Wakes>,
    /// Reads that change nothing ([`reader`]).
    reads: mpsc::Sender<reader::ReadJob>,
    /// What the writer has synced, which reads wait for.
    durable: Arc<reader::Durable>,
    /// DB time's offset, for reads.
    clock_offset: Arc<AtomicI64>,
    /// Stops the checkpoint thread when the last clone is dropped.
    _checkpointer: Option<mpsc::Sender<()>>,
}

/// Most jobs committed together.
pub const BATCH_MAX: usize = 64;

/// The default of [`SqliteOptions::hold_batches`]: each batch held waits for the ones
/// after it, so the bound keeps that wait short.
pub const HOLD_MAX: usize = 1;

/// The default of [`SqliteOptions::commit_window_min_batch`].
pub const COMMIT_WINDOW_MIN_BATCH: usize = 8;

/// The default of [`SqliteOptions::wal_autocheckpoint_pages`]: 64 MiB of 4 KiB pages,
/// sixteen times SQLite's own, since the checkpoint thread normally keeps the WAL far
/// shorter.
pub const WAL_BACKSTOP_PAGES: u32 = 16_384;

/// A unit of work for the writer: given the writer inside the batch transaction (or the
/// reason there is none), it does its work and returns how to answer once the batch's
/// fate is known.
type Job = Box<dyn FnOnce(Result<&mut Writer, &StoreError>) -> Answer + Send>;

/// Sends a job's answer once the batch's commit succeeded (`Ok`) or failed.
type Deliver = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// Whether the job's work should be kept, and how to deliver its answer after the commit.
struct Answer {
    keep: bool,
    deliver: Deliver,
}

/// What the writer thread owns.
struct Writer {
    conn: Connection,
    timings: Timings,
    clock_offset: Arc<AtomicI64>,
    wakes: Arc<Wakes>,
    data_version: Option<i64>,
    /// A decision of the open batch asked to wake every long-poll; done after the commit.
    wake_pending: bool,
    /// Runs the open batch queued, whose sessions' long-polls are woken after the commit.
    wants_pending: Vec<crate::core::Want>,
    /// Queued runs' labels, for placement ([`queue`]).
    queue: queue::Queue,
    /// See [`SqliteOptions::commit_window`].
    commit_window: Duration,
    /// See [`SqliteOptions::commit_window_min_batch`].
    commit_window_min_batch: usize,
    /// Jobs in the last batch: how many callers a new batch waits for.
    last_batch: usize,
    /// The last batch decided nothing (see [`SqliteOptions::idle_window`]), and when it
    /// ended.
    last_idle: bool,
    last_end: Option<Instant>,
    /// See [`SqliteOptions::idle_window`].
    idle_window: Duration,
    /// The database file, beside which SQLite keeps its WAL.
    path: PathBuf,
    /// The WAL, held open to sync it ([`Writer::sync`]).
    wal: Option<File>,
    /// See [`SqliteOptions::lazy_sync`].
    lazy_sync: Duration,
    /// Since when commits have been waiting for a sync (each of them lazy).
    unsynced: Option<Instant>,
    /// Whether the job now running may be answered before its commit is durable.
    job_lazy: bool,
    /// Whether the job now running saw a session and did nothing else: an idle agent's
    /// poll or heartbeat (see [`SqliteOptions::idle_window`]).
    job_seen: bool,
    /// A committed batch decided something that is not yet synced.
    decided: bool,
    /// Answers waiting for the next sync, and how many batches they came from.
    held: Vec<Deliver>,
    held_batches: usize,
    /// See [`SqliteOptions::hold_batches`].
    hold_max: usize,
    /// Why a sync failed. What was committed may then not be on disk, and what it showed
    /// must not be answered from: every later job fails, until the server restarts.
    broken: Option<String>,
    /// What has been synced, for the reader ([`reader::Durable`]).
    durable: Arc<reader::Durable>,
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
        // SQLite takes an `int`; zero or less would turn the backstop off.
        let backstop = i32::try_from(options.wal_autocheckpoint_pages).unwrap_or(i32::MAX).max(1);
        conn.pragma_update(None, "wal_autocheckpoint", backstop).map_err(sql)?;
        let checkpointer = match options.checkpoint_interval {
            interval if interval.is_zero() => None,
            interval => Some(checkpoint::spawn(&path, options.busy_timeout, interval)?),
        };
        let wakes = Arc::new(Wakes::default());
        let reads = reader::spawn(&path, options.busy_timeout)?;
        let durable = Arc::new(reader::Durable::default());
        let clock_offset = options.clock_offset.clone();
        let (jobs, queue) = mpsc::channel::<Job>();
        let mut writer = Writer {
            conn,
            timings: options.timings,
            clock_offset: options.clock_offset,
            wakes: wakes.clone(),
            data_version: None,
            wake_pending: false,
            wants_pending: Vec::new(),
            queue: queue::Queue::default(),
            commit_window: options.commit_window,
            commit_window_min_batch: options.commit_window_min_batch.max(2),
            last_batch: 0,
            last_idle: false,
            last_end: None,
            idle_window: options.idle_window,
            path: path.clone(),
            wal: None,
            lazy_sync: options.lazy_sync,
            unsynced: None,
            job_lazy: false,
            job_seen: false,
            decided: false,
            held: Vec::new(),
            held_batches: 0,
            hold_max: options.hold_batches.max(1),
            broken: None,
            durable: durable.clone(),
        };
        writer.watch_foreign_commits();
        let tick = options.watch_tick.max(Duration::from_millis(1));
        std::thread::Builder::new()
            .name("ql-sqlite-writer".to_owned())
            .spawn(move || {
                // However the thread ends (the store dropped, or a panic outside a job), no
                // read is left waiting for a sync that will not come.
                let _stopped = reader::Stopped(writer.durable.clone());
                writer.serve(queue, tick);
            })
            .map_err(|e| StoreError(format!("starting the sqlite writer: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner { path, jobs, wakes, reads, durable, clock_offset, _checkpointer: checkpointer }),
        })
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
        let job: Job = Box::new(move |writer| {
            let result = match writer {
                Ok(w) => f(w),
                Err(e) => Err(StoreError(e.0.clone())),
            };
            Answer {
                keep: result.is_ok(),
                deliver: Box::new(move |committed| {
                    // The caller may have given up (a dropped request); the work is done anyway.
                    let _ = tx.send(match committed {
                        Ok(()) => result,
                        Err(e) => Err(StoreError(e.0.clone())),
                    });
                }),
            }
        });
        self.inner.jobs.send(job).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Runs `f` on the reader thread ([`reader`]), given DB time's offset, and awaits its
    /// answer.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection, i64) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        let (offset, durable) = (self.inner.clock_offset.clone(), self.inner.durable.clone());
        let job: reader::ReadJob = Box::new(move |conn| {
            let read = match conn {
                Ok(conn) => f(conn, offset.load(Ordering::SeqCst)),
                Err(e) => Err(StoreError(e.0.clone())),
            };
            // The caller may have given up (a dropped request).
            let _ = tx.send(read.and_then(|read| durable.wait().map(|()| read)));
        });
        self.inner.reads.send(job).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

impl Writer {
    fn serve(mut self, queue: mpsc::Receiver<Job>, tick: Duration) {
        let mut checked = Instant::now();
        loop {
            let received = if self.held.is_empty() {
                let due = self.unsynced.map(|since| (since + self.lazy_sync).saturating_duration_since(Instant::now()));
                queue.recv_timeout(due.map_or(tick, |due| due.min(tick)))
            } else {
                // Answers wait for a sync: work already queued commits first, and one sync
                // then covers it too. Nothing queued (or enough batches held): sync now.
                match queue.try_recv() {
                    Ok(job) if self.held_batches < self.hold_max => Ok(job),
                    other => {
                        self.release();
                        match other {
                            Ok(job) => Ok(job),
                            Err(mpsc::TryRecvError::Empty) => continue,
                            Err(mpsc::TryRecvError::Disconnected) => Err(mpsc::RecvTimeoutError::Disconnected),
                        }
                    }
                }
            };
            match received {
                Ok(first) => {
                    let batch = self.gather(&queue, first);
                    self.last_batch = batch.len();
                    self.run_held(batch);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.release();
                    if self.unsynced.is_some() {
                        let _ = self.sync();
                    }
                    return;
                }
            }
            self.sync_if_due();
            if checked.elapsed() >= tick {
                self.watch_foreign_commits();
                checked = Instant::now();
            }
        }
    }

    /// The batch that begins with `first`: every job already queued, and while the last
    /// batch showed many concurrent callers, those that arrive within the commit window
    /// until there are as many as last time. Their commands share one fsync; a disk that syncs
    /// fast would otherwise commit each cohort of callers in several small pieces.
    fn gather(&self, queue: &mpsc::Receiver<Job>, first: Job) -> Vec<Job> {
        if let Some(pause) = self.idle_pause(Instant::now()) {
            // Asleep, not waiting on the queue: callers that queue meanwhile do not wake
            // the thread one by one.
            std::thread::sleep(pause);
        }
        let mut batch = vec![first];
        let deadline = Instant::now() + self.commit_window;
        while batch.len() < BATCH_MAX {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(mpsc::TryRecvError::Disconnected) => break,
                Err(mpsc::TryRecvError::Empty) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if self.last_batch < self.commit_window_min_batch
                        || batch.len() >= self.last_batch
                        || left.is_zero()
                    {
                        break;
                    }
                    match queue.recv_timeout(left) {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
            }
        }
        batch
    }

    /// How long a batch whose first job came at `now` gathers before it begins: the idle
    /// window, when the last batch decided nothing and ended within that window (polls
    /// are arriving one by one). A job after a longer quiet has no company to wait for.
    fn idle_pause(&self, now: Instant) -> Option<Duration> {
        let recent = self.last_end.is_some_and(|end| now.saturating_duration_since(end) < self.idle_window);
        (self.last_idle && recent).then_some(self.idle_window)
    }

    /// Runs `batch` in one transaction, each job under its own savepoint, then answers.
    #[cfg(test)]
    fn run_batch(&mut self, batch: Vec<Job>) {
        self.run_held(batch);
        self.release();
    }

    /// Runs `batch` in one transaction, each job under its own savepoint, and holds the
    /// answers that wait for a sync (all of them, once a batch decided something) for
    /// [`Writer::release`].
    fn run_held(&mut self, batch: Vec<Job>) {
        let begun = match &self.broken {
            Some(why) => Err(StoreError(why.clone())),
            None => self.control("BEGIN IMMEDIATE"),
        };
        if let Err(e) = begun {
            for job in batch {
                (job(Err(&e)).deliver)(Err(&e));
            }
            return;
        }
        let mut answers = Vec::with_capacity(batch.len());
        let changes = self.conn.total_changes();
        let mut lazy = true;
        // Only a batch of idle agents' polls and heartbeats makes the next one gather: a
        // live log's chunk admissions decide nothing too, and pausing after them paced
        // every chunk.
        let mut idle = true;
        for job in batch {
            if let Err(e) = self.control("SAVEPOINT job") {
                answers.push(job(Err(&e)));
                continue;
            }
            self.queue.mark();
            self.job_lazy = false;
            self.job_seen = false;
            // A panic in a decision is a bug, but it must not take the authority down: its
            // savepoint rolls back, its caller gets a StoreError from the dropped oneshot,
            // and the batch goes on.
            let answer = catch_unwind(AssertUnwindSafe(|| job(Ok(&mut *self)))).ok();
            let keep = answer.as_ref().is_some_and(|a| a.keep);
            if !keep {
                self.queue.rolled_back();
            }
            let end = if keep { Ok(()) } else { self.control("ROLLBACK TO job") };
            if let Err(e) = end.and_then(|()| self.control("RELEASE job")) {
                // The savepoint stack is in an unknown state: give the whole batch up.
                let _ = self.conn.execute_batch("ROLLBACK");
                self.queue.drop_all();
                self.wake_pending = false;
                self.wants_pending.clear();
                for a in answers.into_iter().chain(answer) {
                    (a.deliver)(Err(&e));
                }
                return;
            }
            lazy &= !keep || self.job_lazy;
            idle &= keep && self.job_lazy && self.job_seen;
            answers.extend(answer);
        }
        self.last_idle = idle;
        self.last_end = Some(Instant::now());
        let deciding = self.conn.total_changes() != changes && (!lazy || self.lazy_sync.is_zero());
        if deciding {
            self.durable.committing();
        }
        let committed = self.control("COMMIT");
        if committed.is_err() {
            let _ = self.conn.execute_batch("ROLLBACK");
            self.queue.drop_all();
            if !self.decided {
                // Every deciding commit before this one is synced, and this one is not there.
                self.durable.synced();
            }
        } else if self.conn.total_changes() != changes {
            // synchronous=NORMAL: SQLite wrote the WAL but did not sync it. A batch that
            // decided something is synced before any of its answers leaves
            // ([`Writer::release`]); a lazy one by the next such sync (the WAL is one file,
            // written in order) or by the timer in `serve`.
            self.unsynced.get_or_insert_with(Instant::now);
            self.decided |= !lazy || self.lazy_sync.is_zero();
        }
        let wants = std::mem::take(&mut self.wants_pending);
        if committed.is_ok() && std::mem::take(&mut self.wake_pending) {
            self.wake();
        } else if committed.is_ok() {
            self.wakes.runs(wants);
        }
        self.wake_pending = false;
        // Once a decision waits for its sync, every answer does: a later batch may have
        // read that decision (a repeated claim answered from it), and must not tell it
        // before it is on disk.
        match committed {
            Ok(()) if self.decided => {
                self.held.extend(answers.into_iter().map(|a| a.deliver));
                self.held_batches += 1;
            }
            committed => {
                for a in answers {
                    (a.deliver)(committed.as_ref().map(|_| ()));
                }
            }
        }
    }

    /// Syncs what the held answers wait for, then sends them (each the sync's failure, if
    /// it failed).
    fn release(&mut self) {
        if self.held.is_empty() && !self.decided {
            return;
        }
        let synced = self.sync();
        self.decided = false;
        self.held_batches = 0;
        for deliver in self.held.drain(..) {
            deliver(synced.as_ref().map(|_| ()));
        }
    }

    /// Makes every commit so far durable: `fdatasync` of the WAL, which is what
    /// `synchronous=FULL` does after each commit. A failure breaks the writer for good
    /// (after a failed fsync the kernel may have dropped the pages it could not write).
    fn sync(&mut self) -> Result<(), StoreError> {
        let synced = self.sync_wal();
        match &synced {
            Ok(()) => {
                self.unsynced = None;
                self.durable.synced();
            }
            Err(e) => {
                self.durable.broken(&e.0);
                self.broken = Some(e.0.clone());
            }
        }
        synced
    }

    /// Syncs the commits that have waited [`SqliteOptions::lazy_sync`]. A failure is kept
    /// in `broken` and answers every later job.
    fn sync_if_due(&mut self) {
        if self.unsynced.is_some_and(|since| since.elapsed() >= self.lazy_sync) {
            let _ = self.sync();
        }
    }

    fn sync_wal(&mut self) -> Result<(), StoreError> {
        let failed = |what: &str, e: std::io::Error| StoreError(format!("{what} failed: {e}; restart ql-control"));
        // SQLite removes the WAL only when its last connection closes, and this one stays
        // open; should the file be gone anyway, a new one is opened.
        if self.wal.as_ref().is_none_or(|f| f.metadata().map_or(true, |m| m.nlink() == 0)) {
            let mut name = self.path.clone().into_os_string();
            name.push("-wal");
            let wal = File::open(&name).map_err(|e| failed("opening the database's WAL", e))?;
            // The WAL's name must survive a power cut too, not only its pages.
            let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| failed("syncing the database's directory", e))?;
            self.wal = Some(wal);
        }
        self.wal.as_ref().expect("opened above").sync_data().map_err(|e| failed("syncing the database's WAL", e))
    }

    /// Runs a transaction-control statement, prepared once: parsing them anew for every
    /// job was a measurable share of the writer's time.
    fn control(&self, statement: &str) -> Result<(), StoreError> {
        self.conn.prepare_cached(statement).and_then(|mut s| s.execute([])).map(drop).map_err(sql)
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
        self.wakes.all();
    }

    /// Whether the request `record` is of, presenting the certificate `serial`, is
    /// refused ([`core::admission`]).
    fn admission(&self, record: &AuditRecord, serial: &str) -> Result<Option<ErrorCode>, StoreError> {
        let Some(principal) = &record.principal else {
            return Ok(Some(ErrorCode::Unauthenticated));
        };
        let worker = load::worker(&self.conn, principal).map_err(sql)?;
        let cert = load::certificate(&self.conn, serial).map_err(sql)?;
        let now = schema::db_now(&self.conn, self.offset()).map_err(sql)?;
        Ok(core::admission(principal, worker.as_ref(), cert.as_ref(), now).err())
    }

    /// Appends an audit record stamped with DB time.
    fn record(&self, record: AuditRecord) -> Result<(), StoreError> {
        let at = schema::db_now(&self.conn, self.offset()).map_err(sql)?;
        rows::write(&self.conn, &AuditRecord { at, ..record }).map_err(sql)
    }

    fn offset(&self) -> i64 {
        self.clock_offset.load(Ordering::SeqCst)
    }

    /// Runs one command inside the batch transaction (its savepoint is the caller's).
    fn execute(&mut self, cmd: &Command) -> Result<Result<Reply, ErrorCode>, StoreError> {
        let offset = self.offset();
        let conn = &self.conn;
        let rows = load::load(conn, &cmd.keys(), &self.timings, &mut self.queue, || schema::db_now(conn, offset))
            .map_err(sql)?;
        // DB time after every row is loaded (and, with BEGIN IMMEDIATE, after the lock).
        let now = schema::db_now(conn, offset).map_err(sql)?;
        let decision = core::decide(cmd, &rows, now, &self.timings, &mut IdGen::random());
        let seen_only = decision.only_liveness(&rows);
        self.job_lazy &= seen_only;
        self.job_seen = seen_only && !decision.writes.is_empty();
        // A refusal carries no writes by contract; nothing is applied.
        let reply = match decision.reply {
            Ok(reply) => reply,
            Err(code) => return Ok(Err(code)),
        };
        // A loaded row gets only its changed columns: a session only seen (an idle
        // fleet's every poll) its two times, a renewal its lease's expiry.
        let mut loaded = Loaded::of(&rows);
        for write in &decision.writes {
            if let Some(why) = loaded.dangling(write) {
                return Err(StoreError(why));
            }
            match loaded.known(write) {
                Some(Known::Session(new, old)) => rows::update_changed(conn, new, old),
                Some(Known::Run(new, old)) => rows::update_changed(conn, new, old),
                Some(Known::Attempt(new, old)) => rows::update_changed(conn, new, old),
                Some(Known::Offer(new, old)) => rows::update_changed(conn, new, old),
                Some(Known::Lease(new, old)) => rows::update_changed(conn, new, old),
                None => apply(conn, write),
            }
            .map_err(sql)?;
            loaded.wrote(write);
            if let Write::Run(run) = write {
                self.queue.note(run);
            }
        }
        self.wake_pending |= decision.wake;
        self.wants_pending.extend(decision.wants);
        Ok(Ok(reply))
    }
}

fn apply(conn: &Connection, write: &Write) -> rusqlite::Result<()> {
    match write {
        Write::Session(s) => rows::write(conn, s),
        Write::Run(r) => rows::write(conn, r),
        Write::Attempt(a) => rows::write(conn, a),
        Write::Offer(o) => rows::write(conn, o),
        Write::Lease(l) => rows::write(conn, l),
        Write::Event(e) => rows::write(conn, e),
        Write::LogChunk(c) => rows::write(conn, c),
        Write::Worker(w) => rows::write(conn, w),
        Write::Certificate(c) => rows::write(conn, c),
        Write::Enrolment(e) => rows::write(conn, e),
        Write::Schedule(x) => rows::write(conn, x),
        Write::Fire(f) => rows::write(conn, f),
        Write::Operator(o) => rows::write(conn, o),
        Write::Delivery(d) => rows::write(conn, d),
        Write::RemoveOperator(name) => {
            conn.prepare_cached("DELETE FROM operators WHERE name = ?1")?.execute([name.as_str()]).map(drop)
        }
        Write::RemoveSchedule(name) => {
            conn.prepare_cached("DELETE FROM schedules WHERE name = ?1")?.execute([name.as_str()]).map(drop)
        }
        Write::Alive(at) => conn
            .prepare_cached(
                "INSERT INTO authority (id, alive_at) VALUES (1, ?1) \
                 ON CONFLICT (id) DO UPDATE SET alive_at = excluded.alive_at",
            )?
            .execute([at])
            .map(drop),
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

/// [`Store::prune_sessions`]: `?1` generations kept, `?2` the batch. The partial index
/// `sessions_prunable` (migration 0014) holds the candidates, and the key on (worker,
/// generation) gives each one's worker's newest.
const PRUNE_SESSIONS: &str = "DELETE FROM sessions WHERE id IN (SELECT s.id FROM sessions s \
     WHERE s.offered = 0 AND s.state IN ('closed', 'expired', 'replaced') \
     AND s.generation <= (SELECT max(m.generation) FROM sessions m WHERE m.worker = s.worker) - ?1 \
     ORDER BY s.worker, s.generation LIMIT ?2)";

/// Refused twin opens by worker since `?1` (see [`Store::twin_refusals`]).
const TWIN_REFUSALS: &str = "SELECT principal, count(*) FROM audit WHERE at >= ?1 AND route = 'session.open' \
     AND outcome = 'session_conflict' AND principal IS NOT NULL GROUP BY principal ORDER BY principal";

/// [`Store::prune_runs`]: those of the runs `?1` (a JSON array of ids) that are still
/// prunable with the cutoff `?2`, as a JSON array.
const PRUNABLE_AMONG: &str =
    "SELECT json_group_array(r.id) FROM runs r WHERE r.id IN (SELECT value FROM json_each(?1)) \
     AND r.status IN ('succeeded', 'failed', 'cancelled', 'timed_out') AND r.finished_at < ?2 \
     AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.run_id = r.id AND d.state IN ('waiting', 'pending'))";

/// [`Store::prune_runs`]: every row naming the runs `?1` (a JSON array of ids), each
/// found through its table's key or an index that starts with the run or attempt, before
/// the runs themselves (the foreign keys are checked at the commit).
const PRUNE_RUNS: [&str; 6] = [
    "DELETE FROM log_chunks WHERE attempt_id IN (SELECT a.id FROM attempts a WHERE a.run_id IN (SELECT value FROM json_each(?1)))",
    "DELETE FROM offers WHERE attempt_id IN (SELECT a.id FROM attempts a WHERE a.run_id IN (SELECT value FROM json_each(?1)))",
    "DELETE FROM leases WHERE run_id IN (SELECT value FROM json_each(?1))",
    "DELETE FROM events WHERE run_id IN (SELECT value FROM json_each(?1))",
    "DELETE FROM deliveries WHERE run_id IN (SELECT value FROM json_each(?1))",
    "DELETE FROM attempts WHERE run_id IN (SELECT value FROM json_each(?1))",
];

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn snapshot(tx: &Connection) -> rusqlite::Result<Snapshot> {
    // Inside the batch's transaction: the seven tables as of one state.
    let snap = Snapshot {
        sessions: all(tx, &format!("SELECT {SESSION_COLS} FROM sessions ORDER BY id"), [], rows::read)?,
        runs: all(tx, &format!("SELECT {RUN_COLS} FROM runs ORDER BY id"), [], rows::read)?,
        attempts: all(tx, &format!("SELECT {ATTEMPT_COLS} FROM attempts ORDER BY id"), [], rows::read)?,
        offers: all(tx, &format!("SELECT {OFFER_COLS} FROM offers ORDER BY id"), [], rows::read)?,
        leases: all(tx, &format!("SELECT {LEASE_COLS} FROM leases ORDER BY attempt_id"), [], rows::read)?,
        events: all(tx, &format!("SELECT {EVENT_COLS} FROM events ORDER BY seq"), [], rows::read)?,
        log_chunks: all(
            tx,
            &format!("SELECT {LOG_CHUNK_COLS} FROM log_chunks ORDER BY attempt_id, byte_offset"),
            [],
            rows::read,
        )?,
        workers: all(tx, &format!("SELECT {WORKER_COLS} FROM workers ORDER BY id"), [], rows::read)?,
        certificates: all(tx, &format!("SELECT {CERTIFICATE_COLS} FROM certificates ORDER BY serial"), [], rows::read)?,
        enrolments: all(tx, &format!("SELECT {ENROLMENT_COLS} FROM enrolments ORDER BY token_digest"), [], rows::read)?,
        schedules: all(tx, &format!("SELECT {SCHEDULE_COLS} FROM schedules ORDER BY name"), [], rows::read)?,
        fires: all(tx, &format!("SELECT {FIRE_COLS} FROM fires ORDER BY schedule, fire_at"), [], rows::read)?,
        operators: all(tx, &format!("SELECT {OPERATOR_COLS} FROM operators ORDER BY name"), [], rows::read)?,
        deliveries: all(tx, &format!("SELECT {DELIVERY_COLS} FROM deliveries ORDER BY run_id"), [], rows::read)?,
    };
    Ok(snap)
}

fn run_detail(tx: &Connection, id: &RunId) -> rusqlite::Result<Option<RunDetail>> {
    let Some(run) = load::run(tx, id)? else {
        return Ok(None);
    };
    let attempts = all(
        tx,
        &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE run_id = ?1 ORDER BY number"),
        [id.as_str()],
        rows::read,
    )?;
    let leases = all(
        tx,
        &format!("SELECT {LEASE_COLS} FROM leases WHERE run_id = ?1 ORDER BY lease_generation, attempt_id"),
        [id.as_str()],
        rows::read,
    )?;
    let events =
        all(tx, &format!("SELECT {EVENT_COLS} FROM events WHERE run_id = ?1 ORDER BY seq"), [id.as_str()], rows::read)?;
    let delivery = load::delivery(tx, id)?;
    Ok(Some(RunDetail { run, attempts, leases, events, delivery }))
}

impl Store for SqliteStore {
    async fn execute_audited(
        &self,
        cmd: Command,
        audit: Option<Audit>,
    ) -> Result<Result<Reply, ErrorCode>, StoreError> {
        self.call(move |w| {
            w.job_lazy = true;
            let Some(Audit { record, admit }) = audit else {
                return w.execute(&cmd);
            };
            if let Some(code) = admit.map(|serial| w.admission(&record, &serial)).transpose()?.flatten() {
                w.record(AuditRecord { outcome: code.as_str().to_owned(), ..record })?;
                return Ok(Err(code));
            }
            w.record(record.clone())?;
            let result = w.execute(&cmd)?;
            if let Err(code) = &result {
                w.record(AuditRecord { outcome: code.as_str().to_owned(), ..record })?;
            }
            Ok(result)
        })
        .await
    }

    async fn audit(&self, record: AuditRecord) -> Result<(), StoreError> {
        self.call(move |w| {
            w.job_lazy = true;
            w.record(record)
        })
        .await
    }

    async fn admit(&self, record: AuditRecord, serial: String) -> Result<Option<ErrorCode>, StoreError> {
        self.call(move |w| {
            w.job_lazy = true;
            let refused = w.admission(&record, &serial)?;
            if let Some(code) = refused {
                w.record(AuditRecord { outcome: code.as_str().to_owned(), ..record })?;
            }
            Ok(refused)
        })
        .await
    }

    async fn certificates(
        &self,
        worker: Option<&WorkerId>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Certificate>, StoreError> {
        let q = super::certificates_sql('?', worker.is_some(), after.is_some());
        let mut params: Vec<rusqlite::types::Value> = Vec::new();
        params.extend(worker.map(|w| w.to_string().into()));
        params.extend(after.map(|a| a.to_owned().into()));
        params.push(self::limit(limit).into());
        self.read(move |conn, _| all(conn, &q, rusqlite::params_from_iter(params), rows::read).map_err(sql)).await
    }

    async fn prune_audit(&self, retention: AuditRetention) -> Result<u64, StoreError> {
        self.call(move |w| {
            let mut pruned = 0;
            if let Some(age) = retention.max_age_ms {
                let cutoff = schema::db_now(&w.conn, w.offset()).map_err(sql)?.saturating_sub(clamp(age));
                pruned += w.conn.execute("DELETE FROM audit WHERE at < ?1", [cutoff]).map_err(sql)?;
            }
            if let Some(keep) = retention.max_records {
                let q = "DELETE FROM audit WHERE seq <= (SELECT max(seq) FROM audit) - ?1";
                pruned += w.conn.execute(q, [clamp(keep)]).map_err(sql)?;
            }
            Ok(pruned as u64)
        })
        .await
    }

    async fn prune_sessions(&self, retention: SessionRetention) -> Result<u64, StoreError> {
        self.call(move |w| {
            let pruned =
                w.conn.execute(PRUNE_SESSIONS, [clamp(retention.kept.max(1)), clamp(retention.batch)]).map_err(sql)?;
            Ok(pruned as u64)
        })
        .await
    }

    async fn prunable_runs(&self, retention: RunRetention) -> Result<Vec<(ProjectId, RunId)>, StoreError> {
        self.read(move |conn, offset| {
            let cutoff = schema::db_now(conn, offset).map_err(sql)?.saturating_sub(clamp(retention.max_age_ms));
            let mut stmt = conn.prepare_cached(&super::prunable_runs_sql("?1", "?2")).map_err(sql)?;
            let found: Vec<(String, String)> = stmt
                .query_map([cutoff, clamp(retention.batch)], |r| Ok((r.get(0)?, r.get(1)?)))
                .map_err(sql)?
                .collect::<rusqlite::Result<_>>()
                .map_err(sql)?;
            Ok(found.iter().filter_map(|(p, r)| super::ended_run(p, r)).collect())
        })
        .await
    }

    async fn prune_runs(&self, runs: Vec<RunId>, retention: RunRetention) -> Result<u64, StoreError> {
        if runs.is_empty() {
            return Ok(0);
        }
        let ids = serde_json::to_string(&runs.iter().map(RunId::as_str).collect::<Vec<_>>())
            .map_err(|e| StoreError(e.to_string()))?;
        self.call(move |w| {
            let cutoff = schema::db_now(&w.conn, w.offset()).map_err(sql)?.saturating_sub(clamp(retention.max_age_ms));
            // Those still prunable, as a JSON array for the statements below.
            let doomed: String =
                w.conn.query_row(PRUNABLE_AMONG, rusqlite::params![ids, cutoff], |r| r.get(0)).map_err(sql)?;
            for statement in PRUNE_RUNS {
                w.conn.execute(statement, [&doomed]).map_err(sql)?;
            }
            let gone = w.conn.execute("DELETE FROM runs WHERE id IN (SELECT value FROM json_each(?1))", [&doomed]);
            Ok(gone.map_err(sql)? as u64)
        })
        .await
    }

    async fn twin_refusals(&self, within_ms: u64) -> Result<Vec<(WorkerId, u64)>, StoreError> {
        self.read(move |conn, offset| {
            let since = schema::db_now(conn, offset).map_err(sql)?.saturating_sub(clamp(within_ms));
            let mut stmt = conn.prepare_cached(TWIN_REFUSALS).map_err(sql)?;
            let found: Vec<(String, i64)> = stmt
                .query_map([since], |r| Ok((r.get(0)?, r.get(1)?)))
                .map_err(sql)?
                .collect::<rusqlite::Result<_>>()
                .map_err(sql)?;
            found
                .into_iter()
                .map(|(w, n)| {
                    Ok((WorkerId::parse(w.as_str()).map_err(|e| StoreError(e.to_string()))?, n.max(0) as u64))
                })
                .collect()
        })
        .await
    }

    async fn audits(&self) -> Result<Vec<AuditRecord>, StoreError> {
        self.read(|conn, _| {
            all(conn, &format!("SELECT {AUDIT_COLS} FROM audit ORDER BY seq"), [], rows::read).map_err(sql)
        })
        .await
    }

    async fn runs(&self, query: &RunQuery) -> Result<Vec<Run>, StoreError> {
        let query = query.clone();
        self.read(move |conn, _| {
            let q = format!(
                "SELECT {RUN_COLS} FROM runs WHERE (?1 IS NULL OR schedule = ?1) AND (?2 IS NULL OR status = ?2) \
                 AND (?4 IS NULL OR (created_at, id) < (SELECT created_at, id FROM runs WHERE id = ?4)) \
                 AND (?5 IS NULL OR id IN (SELECT run_id FROM attempts WHERE worker = ?5)) \
                 ORDER BY created_at DESC, id DESC LIMIT ?3"
            );
            let before = query.before.as_ref().map(|r| r.as_str().to_owned());
            let worker = query.worker.as_ref().map(|w| w.as_str().to_owned());
            let status = query.status.map(|s| s.as_str());
            let params = (query.schedule.as_deref(), status, limit(query.limit), before, worker);
            all(conn, &q, params, rows::read).map_err(sql)
        })
        .await
    }

    async fn schedules(&self) -> Result<Vec<Schedule>, StoreError> {
        self.read(|conn, _| {
            all(conn, &format!("SELECT {SCHEDULE_COLS} FROM schedules ORDER BY name"), [], rows::read).map_err(sql)
        })
        .await
    }

    async fn stats(&self) -> Result<Vec<crate::store::Stat>, StoreError> {
        self.read(|conn, offset| {
            let now = schema::db_now(conn, offset).map_err(sql)?;
            let q = crate::store::STATS_SQL
                .replace("{NOW}", &now.to_string())
                .replace("{LENGTH}", "json_extract(artifact, '$.length')");
            all(conn, &q, [], |r| Ok(crate::store::Stat { kind: r.get(0)?, label: r.get(1)?, value: r.get(2)? }))
                .map_err(sql)
        })
        .await
    }

    async fn operators(&self) -> Result<Vec<Operator>, StoreError> {
        self.read(|conn, _| {
            all(conn, &format!("SELECT {OPERATOR_COLS} FROM operators ORDER BY name"), [], rows::read).map_err(sql)
        })
        .await
    }

    async fn fires(&self, schedule: &str, n: usize) -> Result<Vec<Fire>, StoreError> {
        let schedule = schedule.to_owned();
        self.read(move |conn, _| {
            let q = format!("SELECT {FIRE_COLS} FROM fires WHERE schedule = ?1 ORDER BY fire_at DESC LIMIT ?2");
            all(conn, &q, (schedule.as_str(), limit(n)), rows::read).map_err(sql)
        })
        .await
    }

    async fn run_detail(&self, run: &RunId) -> Result<Option<RunDetail>, StoreError> {
        let run = run.clone();
        self.read(move |conn, _| run_detail(conn, &run).map_err(sql)).await
    }

    async fn log_chunks(&self, attempt: &AttemptId, within: Range<u64>) -> Result<Vec<LogChunk>, StoreError> {
        let attempt = attempt.clone();
        let [from, to] = super::log_chunk_bounds(&within);
        self.read(move |conn, _| {
            let q = super::log_chunks_sql('?');
            all(conn, &q, rusqlite::params![attempt.as_str(), from, to], rows::read).map_err(sql)
        })
        .await
    }

    async fn worker_page(&self, after: Option<&WorkerId>, n: usize) -> Result<Vec<super::WorkerEntry>, StoreError> {
        let after = after.map_or_else(String::new, |w| w.as_str().to_owned());
        self.read(move |conn, _| {
            let ids: Vec<String> =
                all(conn, &super::worker_ids_sql('?'), (after.as_str(), limit(n)), |r| r.get(0)).map_err(sql)?;
            let named = serde_json::to_string(&ids).map_err(|e| StoreError(e.to_string()))?;
            let page = "IN (SELECT value FROM json_each(?1))";
            let q = format!(
                "SELECT {SESSION_COLS} FROM sessions s WHERE s.worker {page} \
                 AND s.generation = (SELECT max(generation) FROM sessions WHERE worker = s.worker)"
            );
            let sessions = all(conn, &q, [&named], rows::read).map_err(sql)?;
            let q = format!("SELECT {WORKER_COLS} FROM workers WHERE id {page}");
            let records = all(conn, &q, [&named], rows::read).map_err(sql)?;
            let q = format!(
                "SELECT {CERTIFICATE_COLS} FROM certificates WHERE worker {page} ORDER BY issued_at DESC, serial DESC"
            );
            let certificates = all(conn, &q, [&named], rows::read).map_err(sql)?;
            super::entries(ids, sessions, records, certificates)
        })
        .await
    }

    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        self.call(|w| snapshot(&w.conn).map_err(sql)).await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        // A job of the writer's, in a batch of its own or another's: it answers once the
        // writer took the file's write lock and committed. It decides nothing and sees
        // nothing, as an idle poll: it neither costs a batch of idle polls a sync nor ends
        // their idle window.
        let answered = self
            .call(|w| {
                (w.job_lazy, w.job_seen) = (true, true);
                Ok(())
            })
            .await;
        match answered {
            // Only a restart repairs a writer that failed a sync or stopped: the probe
            // then never answers, and the watchdog lets systemd restart the server.
            Err(_) if self.inner.durable.is_broken() => std::future::pending().await,
            answered => answered,
        }
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.inner.wakes.subscribe()
    }

    fn wakes_since(&self, seen: u64, now: u64) -> Option<Vec<crate::core::Want>> {
        self.inner.wakes.since(seen, now)
    }
}

#[cfg(test)]
mod tests;
