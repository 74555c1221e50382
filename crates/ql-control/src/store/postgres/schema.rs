//! Migrations, applied by the migration owner, and the schema check every runtime
//! connection makes before serving.
//!
//! The applied version lives in `ql_schema_version`, written in the same transaction as
//! the migrations it records (PostgreSQL DDL is transactional): a crash mid-migration
//! leaves the old version and none of the new schema. A transaction-level advisory lock
//! serialises migrators, so two replicas started at once cannot both apply version 1. A
//! database written by a newer build is refused rather than guessed at, also by a replica
//! that was serving when another build's `migrate` moved it ([`Watch`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio_postgres::{Client, GenericClient};

use super::Error;

/// Migrations in order; entry `i` takes the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    include_str!("../../../migrations/postgres/0001_init.sql"),
    include_str!("../../../migrations/postgres/0002_live_log.sql"),
    include_str!("../../../migrations/postgres/0003_audit_retention.sql"),
    include_str!("../../../migrations/postgres/0004_trusted_labels.sql"),
    include_str!("../../../migrations/postgres/0005_outage_grace.sql"),
    include_str!("../../../migrations/postgres/0006_session_closed.sql"),
    include_str!("../../../migrations/postgres/0007_identity.sql"),
    include_str!("../../../migrations/postgres/0008_schedules.sql"),
    include_str!("../../../migrations/postgres/0009_operators.sql"),
    include_str!("../../../migrations/postgres/0010_webhooks.sql"),
    include_str!("../../../migrations/postgres/0011_artifact_claim.sql"),
    include_str!("../../../migrations/postgres/0012_hot_renewals.sql"),
    include_str!("../../../migrations/postgres/0013_placement_by_labels.sql"),
    include_str!("../../../migrations/postgres/0014_checks_by_trigger.sql"),
    include_str!("../../../migrations/postgres/0015_fewer_indexes.sql"),
    include_str!("../../../migrations/postgres/0016_rows_found.sql"),
    include_str!("../../../migrations/postgres/0017_events_named_by_the_store.sql"),
    include_str!("../../../migrations/postgres/0018_one_queue_index.sql"),
    include_str!("../../../migrations/postgres/0019_keys_compared_bytewise.sql"),
    include_str!("../../../migrations/postgres/0020_certificate_lineage.sql"),
    include_str!("../../../migrations/postgres/0021_session_pruning.sql"),
    include_str!("../../../migrations/postgres/0022_lease_projection_read.sql"),
    include_str!("../../../migrations/postgres/0023_twin_refusals.sql"),
    include_str!("../../../migrations/postgres/0024_run_retention.sql"),
    include_str!("../../../migrations/postgres/0025_certificate_pages.sql"),
];

/// The schema version this build reads and writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The roles the migrations grant to (created by the cluster administrator beforehand;
/// `scripts/pg` does it for a throwaway cluster).
pub const ROLES: [&str; 3] = ["ql_owner", "ql_runtime", "ql_worker_ingress"];

/// Serialises migrators across processes.
const MIGRATION_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended('ql-control:migrate', 0))";

async fn version(client: &impl GenericClient) -> Result<Option<i64>, Error> {
    let exists: bool =
        client.query_one("SELECT to_regclass('ql_schema_version') IS NOT NULL", &[]).await.map_err(Error::Pg)?.get(0);
    if !exists {
        return Ok(None);
    }
    let row = client.query_one("SELECT version FROM ql_schema_version", &[]).await.map_err(Error::Pg)?;
    Ok(Some(row.get(0)))
}

/// Brings the schema to [`SCHEMA_VERSION`]; `client` must be connected as the owner.
/// Returns the version found before.
pub(super) async fn migrate(client: &mut Client) -> Result<i64, Error> {
    let tx = client.transaction().await.map_err(Error::Pg)?;
    tx.execute(MIGRATION_LOCK, &[]).await.map_err(Error::Pg)?;
    let current = version(&tx).await?.unwrap_or(0);
    if current > SCHEMA_VERSION {
        return Err(Error::Corrupt(format!("schema version {current} is newer than this build's {SCHEMA_VERSION}")));
    }
    if current == 0 {
        tx.batch_execute(
            "CREATE TABLE ql_schema_version (one BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one), version BIGINT NOT NULL); \
             INSERT INTO ql_schema_version (version) VALUES (0); \
             REVOKE ALL ON ql_schema_version FROM PUBLIC; \
             GRANT SELECT ON ql_schema_version TO ql_runtime;",
        )
        .await
        .map_err(Error::Pg)?;
    }
    for sql in &MIGRATIONS[current as usize..] {
        tx.batch_execute(sql).await.map_err(Error::Pg)?;
    }
    tx.execute("UPDATE ql_schema_version SET version = $1", &[&SCHEMA_VERSION]).await.map_err(Error::Pg)?;
    if current < SCHEMA_VERSION {
        // Delivered at the commit: serving replicas look at the version again ([`Watch`]).
        tx.execute("SELECT pg_notify($1, $2)", &[&super::CHANNEL, &MOVED]).await.map_err(Error::Pg)?;
    }
    tx.commit().await.map_err(Error::Pg)?;
    Ok(current)
}

/// Refuses a database whose schema is not exactly this build's.
async fn check(client: &Client) -> Result<(), Error> {
    match version(client).await? {
        Some(SCHEMA_VERSION) => Ok(()),
        Some(v) if v > SCHEMA_VERSION => Err(Error::Corrupt(format!(
            "the database is at schema version {v}, this build reads {SCHEMA_VERSION}: a newer build migrated it; \
             run that build"
        ))),
        Some(v) => Err(Error::Corrupt(format!(
            "the database is at schema version {v}, this build needs {SCHEMA_VERSION}: run `ql-control migrate` \
             as the migration owner"
        ))),
        None => Err(Error::Corrupt(
            "the database has no QingLong schema: run `ql-control migrate --database <owner URL>` first".to_owned(),
        )),
    }
}

/// The payload of the notification `migrate` sends on the store's channel when it moved
/// the schema.
pub(super) const MOVED: &str = "schema";

/// Whether the schema may have moved under a serving replica. The replica reads the
/// version when it opens (its watch begins suspecting); a `migrate` run while it serves notifies ([`MOVED`]), and its
/// listener, which may have missed that while it reconnected, suspects a move each time
/// it listens again. Each suspicion is counted; a connection is handed out only once a
/// read of the version that began after the latest suspicion found it this build's (one
/// read at a time, the others waiting for it), and while it is not, every connection
/// taken reads it again and the command answers unavailable. So a replica stops deciding
/// once its listener hears the move: what it still runs is what began before (the
/// moment between a migration's commit and its notification, or a listener reconnecting,
/// which retries every 2 s at most). An older build would misread a moved schema;
/// migration 0022 made one refuse its attempts' commands.
#[derive(Debug, Default)]
pub(super) struct Watch {
    /// Suspicions so far.
    suspected: AtomicU64,
    /// The suspicions the last finished read covered (those counted before it began).
    settled: AtomicU64,
    /// Whether the last finished read found another version.
    moved: AtomicBool,
    /// One read at a time.
    reading: tokio::sync::Mutex<()>,
}

impl Watch {
    /// The schema may have moved: look again before the next command.
    pub(super) fn suspect(&self) {
        self.suspected.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether the last finished read covers every suspicion and found this build's.
    fn sound(&self) -> bool {
        !self.moved.load(Ordering::Acquire)
            && self.settled.load(Ordering::Acquire) >= self.suspected.load(Ordering::Acquire)
    }

    /// Reads the version on `client` unless a read since the latest suspicion found it
    /// this build's: an error while it is not. A read that fails or is given up (its
    /// caller dropped) settles nothing, so the next caller reads again.
    pub(super) async fn confirm(&self, client: &Client) -> Result<(), Error> {
        if self.sound() {
            return Ok(());
        }
        let _one = self.reading.lock().await;
        if self.sound() {
            return Ok(());
        }
        let covers = self.suspected.load(Ordering::Acquire);
        let found = check(client).await;
        match &found {
            Ok(()) => self.moved.store(false, Ordering::Release),
            Err(Error::Corrupt(_)) => self.moved.store(true, Ordering::Release),
            Err(_) => return found,
        }
        self.settled.fetch_max(covers, Ordering::AcqRel);
        found
    }
}

/// DB time in milliseconds since the Unix epoch, plus `offset`: the `statement_timestamp()`
/// of this very statement, which the store issues only after it holds every lock.
pub(super) const DB_NOW: &str = "SELECT (floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + $1::bigint";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_watch_is_sound_and_each_suspicion_needs_a_read_that_began_after_it() {
        let w = Watch::default();
        assert!(w.sound(), "nothing suspected yet");
        w.suspect();
        assert!(!w.sound());
        // A read that began before a second suspicion settles only the first.
        let covers = w.suspected.load(Ordering::Acquire);
        w.suspect();
        w.settled.fetch_max(covers, Ordering::AcqRel);
        assert!(!w.sound(), "the later suspicion is still open");
        w.settled.fetch_max(w.suspected.load(Ordering::Acquire), Ordering::AcqRel);
        assert!(w.sound());
        w.moved.store(true, Ordering::Release);
        assert!(!w.sound(), "a moved schema is read again by every caller");
    }
}
