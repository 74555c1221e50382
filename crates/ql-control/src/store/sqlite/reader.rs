//! Reads that change nothing, off the writer's path: a thread of its own with its own
//! connection.
//!
//! The writer commits every agent's command; a read on its thread (a page of runs, the
//! workers' list, an hour of audit records counted) made every agent wait behind it, and
//! at a fleet's size such a read takes a good part of a second. Here each read runs in a
//! read transaction of its own on this thread's connection: WAL gives it one consistent
//! state as of its start, and the writer never waits for it. It sees what was committed
//! before it began, as another process reading the file (the operator CLI) does.
//!
//! But a read is answered as the writer's own answers are: only once every commit of this
//! writer's that decided something, and that it may have seen, is synced ([`Durable`]),
//! and not at all once the writer failed to sync or stopped. (Another process writing the
//! same file, the operator CLI, syncs its own commits.) What an operator is shown (a run
//! recorded, which lets the artifact store's collection remove its chunks) is then never
//! undone by a power cut. A commit that only saw sessions or refused is read before its
//! sync, as the writer answers it.
//!
//! The connection is `query_only`: nothing sent here can write.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::Connection;

use super::{schema, sql};
use crate::store::StoreError;

/// A read to run: given the connection inside its read transaction, or why there is none.
pub(super) type ReadJob = Box<dyn FnOnce(Result<&Connection, &StoreError>) + Send>;

/// Starts the reader thread on its own connection to `path`; it stops when every sender
/// of the returned channel is dropped.
pub(super) fn spawn(path: &Path, busy_timeout: Duration) -> Result<mpsc::Sender<ReadJob>, StoreError> {
    let conn = schema::connect(path, busy_timeout).map_err(sql)?;
    conn.pragma_update(None, "query_only", "ON").map_err(sql)?;
    let (jobs, queue) = mpsc::channel::<ReadJob>();
    std::thread::Builder::new()
        .name("ql-sqlite-reader".to_owned())
        .spawn(move || {
            while let Ok(job) = queue.recv() {
                run(&conn, job);
            }
        })
        .map_err(|e| StoreError(format!("starting the sqlite reader: {e}")))?;
    Ok(jobs)
}

/// Runs `job` in a read transaction of its own, ended whatever the job did.
fn run(conn: &Connection, job: ReadJob) {
    // A transaction left open by a failed end would fail every later BEGIN.
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    match conn.execute_batch("BEGIN DEFERRED") {
        Ok(()) => {
            // A job that panics drops its answer (its caller hears the store is gone), and
            // the thread goes on to the next.
            let _ = catch_unwind(AssertUnwindSafe(|| job(Ok(conn))));
            // A read transaction has nothing to keep; ending it lets the checkpoint copy
            // the frames it held.
            let _ = conn.execute_batch("ROLLBACK");
        }
        Err(e) => job(Err(&sql(e))),
    }
}

/// Marks the writer stopped when dropped: held by the writer's thread.
pub(super) struct Stopped(pub(super) Arc<Durable>);

impl Drop for Stopped {
    fn drop(&mut self) {
        self.0.broken("the sqlite writer thread has stopped");
    }
}

/// What the writer has made durable, shared with the reader ([`Durable::wait`]).
#[derive(Debug, Default)]
pub(super) struct Durable {
    state: Mutex<Synced>,
    moved: Condvar,
}

#[derive(Debug, Default)]
struct Synced {
    /// Commits that decided something, counted before each is sent: a read that may have
    /// seen one finds it counted.
    committing: u64,
    /// Of those, how many the last sync covered.
    synced: u64,
    /// Why the writer stopped: a sync failed.
    broken: Option<String>,
}

impl Durable {
    fn state(&self) -> MutexGuard<'_, Synced> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The writer is about to commit a batch that decided something.
    pub(super) fn committing(&self) {
        self.state().committing += 1;
    }

    /// Every commit so far is synced.
    pub(super) fn synced(&self) {
        let mut s = self.state();
        s.synced = s.committing;
        self.moved.notify_all();
    }

    /// A sync failed: no read is answered from here on.
    pub(super) fn broken(&self, why: &str) {
        self.state().broken = Some(why.to_owned());
        self.moved.notify_all();
    }

    /// Whether the writer failed a sync or stopped.
    pub(super) fn is_broken(&self) -> bool {
        self.state().broken.is_some()
    }

    /// Deciding commits counted, and how many of them are synced.
    #[cfg(test)]
    pub(super) fn counts(&self) -> (u64, u64) {
        let s = self.state();
        (s.committing, s.synced)
    }

    /// Waits until every deciding commit counted so far is synced; the writer's failure if
    /// it broke first.
    pub(super) fn wait(&self) -> Result<(), StoreError> {
        let mut s = self.state();
        let need = s.committing;
        loop {
            if let Some(why) = &s.broken {
                return Err(StoreError(why.clone()));
            }
            if s.synced >= need {
                return Ok(());
            }
            s = self.moved.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_waits_for_the_sync_of_what_it_may_have_seen_and_never_follows_a_broken_writer() {
        let d = Durable::default();
        assert!(d.wait().is_ok(), "nothing committed, nothing to wait for");
        d.committing();
        assert_eq!(d.counts(), (1, 0));
        d.synced();
        assert!(d.wait().is_ok());
        d.committing();
        d.broken("syncing the database's WAL failed");
        assert_eq!(d.wait().unwrap_err().0, "syncing the database's WAL failed");
        d.synced();
        assert!(d.wait().is_err(), "broken for good");
    }

    #[test]
    fn a_waiting_read_is_answered_by_the_sync() {
        let d = std::sync::Arc::new(Durable::default());
        d.committing();
        let waiting = {
            let d = d.clone();
            std::thread::spawn(move || d.wait())
        };
        d.synced();
        assert!(waiting.join().unwrap().is_ok());
    }
}
