//! Checkpoints off the writer's path: a thread of its own copies the WAL back into the
//! database file while the writer goes on committing.
//!
//! SQLite's automatic checkpoint runs inside the COMMIT that crosses
//! `wal_autocheckpoint` pages, on the committing connection: the writer, whose batch then
//! waits for the copy and two more syncs (the WAL's, then the database file's). Under 64
//! concurrent clients that was a quarter of the server's sync calls (bench/RESULTS.md).
//! This thread instead runs a `PASSIVE` checkpoint every
//! [`SqliteOptions::checkpoint_interval`](super::SqliteOptions::checkpoint_interval)
//! once something was committed since the last one (`PRAGMA data_version`): `PASSIVE`
//! takes no write lock and waits for nobody, so it costs the writer nothing, and a fleet
//! that commits all the time pays two syncs per interval for it instead of two per
//! thousand pages. The writer keeps SQLite's own checkpoint as a backstop at
//! [`SqliteOptions::wal_autocheckpoint_pages`](super::SqliteOptions::wal_autocheckpoint_pages),
//! so the WAL stays bounded should this thread fall behind or fail.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::Connection;

use super::{schema, sql};
use crate::store::StoreError;

/// Starts the checkpoint thread on its own connection to `path`; it stops when the
/// returned sender is dropped.
pub(super) fn spawn(path: &Path, busy_timeout: Duration, interval: Duration) -> Result<mpsc::Sender<()>, StoreError> {
    let conn = schema::connect(path, busy_timeout).map_err(sql)?;
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("ql-sqlite-checkpoint".to_owned())
        .spawn(move || run(&conn, &stopped, interval))
        .map_err(|e| StoreError(format!("starting the sqlite checkpoint thread: {e}")))?;
    Ok(stop)
}

fn run(conn: &Connection, stopped: &mpsc::Receiver<()>, interval: Duration) {
    let mut seen = None;
    // Frames a checkpoint could not copy (a reader still needed them): try again at the
    // next tick even if nothing new was committed.
    let mut behind = false;
    // Told once per failure, not once per tick.
    let mut failing = false;
    while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
        let version = data_version(conn);
        if version.is_some() && version == seen && !behind {
            continue;
        }
        seen = version;
        behind = match checkpoint(conn) {
            Ok((frames, copied)) => {
                failing = false;
                copied < frames
            }
            Err(e) => {
                // Nothing is lost: the WAL keeps every commit, and the writer's own
                // checkpoint bounds it.
                if !std::mem::replace(&mut failing, true) {
                    eprintln!("ql-control: sqlite checkpoint failed, retrying every {} ms: {e}", interval.as_millis());
                }
                true
            }
        };
    }
}

fn data_version(conn: &Connection) -> Option<i64> {
    conn.query_row("PRAGMA data_version", [], |r| r.get(0)).ok()
}

/// One `PASSIVE` checkpoint: the WAL's frames, and how many of them are now in the
/// database file.
pub(super) fn checkpoint(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| Ok((r.get(1)?, r.get(2)?)))
}
