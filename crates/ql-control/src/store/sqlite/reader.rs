//! Operators' reads off the writer's path: a thread of its own with its own connection.
//!
//! The writer commits every agent's command; a read on its thread (a page of runs, the
//! workers' list, an hour of audit records counted) made every agent wait behind it, and
//! at a fleet's size such a read takes a good part of a second. Here each read runs in a
//! read transaction of its own on this thread's connection: WAL gives it one consistent
//! state as of its start, and the writer never waits for it. It sees what was committed
//! before it began, as another process reading the file (the operator CLI) does.
//!
//! The connection is `query_only`: nothing sent here can write.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::mpsc;
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
    match conn.execute_batch("BEGIN DEFERRED") {
        Ok(()) => {
            // A job that panics drops its answer (its caller hears the store is gone), and
            // the thread goes on to the next.
            let _ = catch_unwind(AssertUnwindSafe(|| job(Ok(conn))));
            // A read transaction has nothing to keep; ending it lets the checkpoint copy
            // the frames it held.
            if conn.execute_batch("ROLLBACK").is_err() && !conn.is_autocommit() {
                eprintln!("ql-control: the sqlite reader could not end a read transaction");
            }
        }
        Err(e) => job(Err(&sql(e))),
    }
}
