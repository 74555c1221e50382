//! The PostgreSQL side of the tests: a fresh database per test on the server that
//! `QL_TEST_PG_URL` names, migrated by the owner role, and the contract [`Backend`].
//!
//! `scripts/test` (the README's test command) installs PostgreSQL when it is missing,
//! starts a throwaway cluster with `scripts/pg`, exports its superuser URL as
//! `QL_TEST_PG_URL` and removes the cluster afterwards. Without that variable these tests
//! fail, saying so: nothing is skipped.
//!
//! Each [`TestDb`] is `CREATE DATABASE ... OWNER ql_owner`, migrated through
//! [`ql_control::store::postgres::migrate`] as `ql_owner`, then used as `ql_runtime`
//! (and `ql_worker_ingress` where a test needs it), exactly as a deployment would. It is
//! dropped (`WITH (FORCE)`) when the test ends.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::Arc;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use ql_control::core::Timings;
use ql_control::store::postgres::{migrate, PgOptions, PgStore};
use ql_wire::ids::{AttemptId, RunId};

use super::{test_timings, Backend};

/// How to get a server, printed whenever one is missing.
pub const HOW_TO_GET_POSTGRES: &str = "the PostgreSQL tests need a server: run `scripts/test` (it installs \
     PostgreSQL when missing, starts a throwaway cluster and sets QL_TEST_PG_URL), or start one with \
     `eval \"$(scripts/pg start /tmp/ql-pg)\"` and run cargo test again";

/// The superuser connection settings of the test server.
pub fn admin_config() -> Config {
    let url =
        std::env::var("QL_TEST_PG_URL").unwrap_or_else(|_| panic!("QL_TEST_PG_URL is not set: {HOW_TO_GET_POSTGRES}"));
    url.parse().unwrap_or_else(|e| panic!("QL_TEST_PG_URL is not a PostgreSQL URL ({e}): {HOW_TO_GET_POSTGRES}"))
}

/// A connection string for `user` on `dbname` of the test server.
pub fn url_for(user: &str, dbname: &str) -> String {
    let admin = admin_config();
    let host = match admin.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = admin.get_ports().first().copied().unwrap_or(5432);
    let mut url = format!("host={host} port={port} user={user} dbname={dbname}");
    if let Some(pw) = admin.get_password() {
        // Only when the test server wants passwords at all: the same one for every role.
        url.push_str(&format!(" password={}", String::from_utf8_lossy(pw)));
    }
    url
}

/// Connects with `url`, running the connection on the current runtime.
pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test server failed ({e}): {HOW_TO_GET_POSTGRES}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

async fn admin() -> Client {
    let admin = admin_config();
    let user = admin.get_user().unwrap_or("postgres").to_owned();
    let db = admin.get_dbname().unwrap_or("postgres").to_owned();
    connect(&url_for(&user, &db)).await
}

/// One database of its own, migrated, dropped when this is dropped.
pub struct TestDb {
    /// The database name.
    pub name: String,
}

impl TestDb {
    /// Creates and migrates a fresh database.
    pub async fn new(tag: &str) -> Self {
        let db = Self::unmigrated(tag).await;
        migrate(&db.url("ql_owner")).await.expect("migrating as the owner");
        db
    }

    /// Creates a fresh database owned by `ql_owner`, with no schema yet.
    pub async fn unmigrated(tag: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let name = format!("ql_{tag}_{}_{}_{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst));
        let admin = admin().await;
        // The roles are cluster-wide: create them once, whoever gets here first.
        admin
            .batch_execute(
                "BEGIN; SELECT pg_advisory_xact_lock(7071); \
                 DO $$ BEGIN \
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ql_owner') THEN CREATE ROLE ql_owner LOGIN; END IF; \
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ql_runtime') THEN CREATE ROLE ql_runtime LOGIN; END IF; \
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ql_worker_ingress') \
                     THEN CREATE ROLE ql_worker_ingress LOGIN; END IF; \
                 END $$; COMMIT;",
            )
            .await
            .expect("creating the roles");
        admin.batch_execute(&format!("CREATE DATABASE {name} OWNER ql_owner")).await.expect("creating the database");
        Self { name }
    }

    /// A connection string for `user` on this database.
    pub fn url(&self, user: &str) -> String {
        url_for(user, &self.name)
    }

    /// The runtime role's connection string.
    pub fn runtime_url(&self) -> String {
        self.url("ql_runtime")
    }

    /// Opens a store on this database as the runtime role.
    pub async fn store(&self, options: PgOptions) -> PgStore {
        PgStore::open(&self.runtime_url(), options).await.expect("opening the store")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime; the cleanup gets a runtime of its own.
        let name = self.name.clone();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let admin = admin().await;
                let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
            });
        });
        let _ = done.join();
    }
}

/// The contract backend: a fresh database, the store under test and a second store on
/// it (another replica), sharing one clock offset.
pub struct Pg {
    offset: Arc<AtomicI64>,
    store: PgStore,
    other: PgStore,
    owner: Client,
    // Last: the database is dropped after the stores' connections.
    db: TestDb,
}

impl Pg {
    /// Options as the suite wants them, on `offset`.
    pub fn options(offset: &Arc<AtomicI64>) -> PgOptions {
        PgOptions { timings: test_timings(), clock_offset: offset.clone(), pool_size: 8, ..PgOptions::default() }
    }

    /// A fresh database with two stores on it.
    pub async fn new() -> Self {
        let db = TestDb::new("contract").await;
        let offset = Arc::new(AtomicI64::new(0));
        let store = db.store(Self::options(&offset)).await;
        let other = db.store(Self::options(&offset)).await;
        let owner = connect(&db.url("ql_owner")).await;
        Self { offset, store, other, owner, db }
    }

    /// The database.
    pub fn db(&self) -> &TestDb {
        &self.db
    }
}

impl Backend for Pg {
    type Store = PgStore;

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    fn other_process(&self) -> PgStore {
        self.other.clone()
    }

    fn timings(&self) -> Timings {
        test_timings()
    }

    fn advance(&self, ms: i64) {
        self.offset.fetch_add(ms, Ordering::SeqCst);
    }

    async fn set_executor_type(&self, attempt: &AttemptId, executor_type: &str) {
        let n = self
            .owner
            .execute("UPDATE attempts SET executor_type = $1 WHERE id = $2", &[&executor_type, &attempt.as_str()])
            .await
            .unwrap();
        assert_eq!(n, 1);
    }

    async fn plant_event(&self, run: &RunId, attempt: &AttemptId, kind: &str) {
        self.owner
            .execute(
                "INSERT INTO events (id, run_id, attempt_id, kind, payload, at) VALUES ('evt_planted', $1, $2, $3, '{}', 0)",
                &[&run.as_str(), &attempt.as_str(), &kind],
            )
            .await
            .unwrap();
    }

    async fn all_text(&self) -> Vec<String> {
        let tables: Vec<String> = self
            .owner
            .query("SELECT tablename::text FROM pg_tables WHERE schemaname = 'public'", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(tables.len() >= 7, "every table of the schema: {tables:?}");
        let mut out = Vec::new();
        for table in tables {
            // Every column of every row as text, whatever its type.
            let sql =
                format!("SELECT v.value FROM {table} t, jsonb_each_text(to_jsonb(t)) v WHERE v.value IS NOT NULL");
            for row in self.owner.query(&sql, &[]).await.unwrap() {
                out.push(row.get::<_, String>(0));
            }
        }
        let _ = &self.db;
        out
    }
}
