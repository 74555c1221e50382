//! Opening the database file: permissions, connection settings, migrations, DB time.
//!
//! The schema version lives in SQLite's `user_version` header field, which changes in the
//! same transaction as the migration it records: a crash mid-migration leaves the old
//! version and none of the new schema. A file written by a newer build is refused rather
//! than guessed at.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

/// Migrations in order; entry `i` takes the schema from version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[&str] = &[
    include_str!("../../../migrations/sqlite/0001_init.sql"),
    include_str!("../../../migrations/sqlite/0002_fk_indexes.sql"),
    include_str!("../../../migrations/sqlite/0003_live_log.sql"),
    include_str!("../../../migrations/sqlite/0004_audit_retention.sql"),
    include_str!("../../../migrations/sqlite/0005_trusted_labels.sql"),
    include_str!("../../../migrations/sqlite/0006_outage_grace.sql"),
    include_str!("../../../migrations/sqlite/0007_session_closed.sql"),
    include_str!("../../../migrations/sqlite/0008_identity.sql"),
    include_str!("../../../migrations/sqlite/0009_schedules.sql"),
    include_str!("../../../migrations/sqlite/0010_operators.sql"),
    include_str!("../../../migrations/sqlite/0011_webhooks.sql"),
    include_str!("../../../migrations/sqlite/0012_artifact_claim.sql"),
    include_str!("../../../migrations/sqlite/0013_certificate_lineage.sql"),
    include_str!("../../../migrations/sqlite/0014_session_pruning.sql"),
    include_str!("../../../migrations/sqlite/0015_twin_refusals.sql"),
    include_str!("../../../migrations/sqlite/0016_run_retention.sql"),
    include_str!("../../../migrations/sqlite/0017_certificate_pages.sql"),
];

/// The schema version (SQLite `user_version`) this build reads and writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Opens (creating with mode 0600 if absent) and configures one connection.
/// Prepared statements kept per connection.
const STATEMENT_CACHE: usize = 256;

pub(super) fn connect(path: &Path, busy_timeout: Duration) -> rusqlite::Result<Connection> {
    // SQLite would create the file with the process umask; the database holds token
    // digests and run specs (which may carry secrets in env), so only the owner reads it.
    // SQLite gives its -wal and -shm files the main file's permissions.
    if !path.exists() {
        let created = OpenOptions::new().write(true).create_new(true).mode(0o600).open(path);
        match created {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
                    Some(format!("creating {}: {e}", path.display())),
                ))
            }
        }
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    // Before anything else: another process (the operator CLI) may hold the write lock.
    conn.busy_timeout(busy_timeout)?;
    // Every statement the writer runs stays prepared: rusqlite's default of 16 is fewer
    // than one command's loads and writes, so they were parsed again and again.
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    let mode: String = conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
            Some(format!("journal_mode stayed {mode}, WAL is required")),
        ));
    }
    // NORMAL: SQLite does not sync the WAL at commit; the writer does, before the answers
    // that depend on the commit leave (what FULL would do), or a moment later for commits
    // that decide nothing (see the writer's `sync`).
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    // Sorts and temporary tables in memory: a server at its descriptor limit must still
    // be able to run the queries that offer work to agents already connected.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    Ok(conn)
}

/// Brings the schema to [`SCHEMA_VERSION`], refusing a newer one.
pub(super) fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let version = |c: &Connection| c.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0));
    if version(conn)? == SCHEMA_VERSION {
        return Ok(());
    }
    // A migration may rebuild a table others refer to (SQLite's way to change a CHECK):
    // foreign keys are off while it runs — the pragma is a no-op inside a transaction —
    // and every reference is checked before the commit.
    conn.pragma_update(None, "foreign_keys", "OFF")?;
    let migrated = apply(conn);
    conn.pragma_update(None, "foreign_keys", "ON")?;
    migrated
}

fn apply(conn: &mut Connection) -> rusqlite::Result<()> {
    let version = |c: &Connection| c.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0));
    // IMMEDIATE: two processes opening a fresh file at once must not both migrate it.
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let current = version(&tx)?;
    if !(0..=SCHEMA_VERSION).contains(&current) {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISMATCH),
            Some(format!("schema version {current} is newer than this build's {SCHEMA_VERSION}")),
        ));
    }
    for sql in &MIGRATIONS[current as usize..] {
        tx.execute_batch(sql)?;
    }
    let broken: i64 = tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| r.get(0))?;
    if broken > 0 {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT),
            Some(format!("migrating left {broken} broken reference(s); nothing was changed")),
        ));
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit()
}

/// DB time in milliseconds since the Unix epoch, plus `offset` (tests move time with it).
///
/// `julianday('now')` is the statement's time in whole milliseconds; rounding undoes the
/// floating-point division SQLite performed to produce it.
pub(super) fn db_now(conn: &Connection, offset: i64) -> rusqlite::Result<i64> {
    let now: i64 = conn
        .prepare_cached("SELECT CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)")?
        .query_row([], |r| r.get(0))?;
    Ok(now.saturating_add(offset))
}
