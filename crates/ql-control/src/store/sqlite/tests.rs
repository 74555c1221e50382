//! SQLite-specific checks: every model field round-trips through its row, the schema's
//! constraints hold, and the file is private. The protocol itself is proven by the
//! backend-independent contract suite in `tests/store_contract.rs`.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use rusqlite::Connection;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ArtifactId, AttemptId, Counter, EventId, OfferId, ProjectId, RunId, SessionId, WorkerId};
use ql_wire::lease::StopIntent;
use ql_wire::session::Heartbeat;
use ql_wire::spec::{EnvName, ExecutionSpec, Interpreter, Script, SpecSchema};

use super::*;
use crate::model::*;

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let dir = std::env::temp_dir().join(format!("ql-sqlite-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn db(&self) -> PathBuf {
        self.0.join("authority.db")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn conn(dir: &TempDir) -> Connection {
    let mut c = schema::connect(&dir.db(), Duration::from_secs(5)).unwrap();
    schema::migrate(&mut c).unwrap();
    c
}

fn digest(seed: u8) -> Digest {
    Digest::of(&[seed; 8])
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([("arch".to_owned(), "mipsel".to_owned()), ("site/zone".to_owned(), "b-2".to_owned())])
}

fn full_session() -> Session {
    Session {
        id: SessionId::parse("ses_1").unwrap(),
        worker: WorkerId::parse("router-1").unwrap(),
        generation: Counter::new(7).unwrap(),
        state: SessionState::Draining,
        capacity: 3,
        labels: labels(),
        agent_version: "0.1.0 (abc)".into(),
        arch: "mipsel".into(),
        created_at: 1_000,
        seen_at: 2_000,
        expires_at: 3_000,
        offered: true,
    }
}

fn full_run() -> Run {
    let mut env = BTreeMap::new();
    env.insert(EnvName::parse("GREETING").unwrap(), "héllo \"world\"".to_owned());
    Run {
        id: RunId::parse("run_1").unwrap(),
        project: ProjectId::parse("proj").unwrap(),
        spec: ExecutionSpec {
            schema: SpecSchema,
            project_id: ProjectId::parse("proj").unwrap(),
            argv: None,
            script: Some(Script { interpreter: Interpreter::Python3, source: "print('hi')\n".into() }),
            env,
            timeout_ms: 90_000,
            log_limit_bytes: 4096,
        },
        labels: labels(),
        agent_labels: [("arch".to_owned(), "mipsel".to_owned())].into(),
        status: RunStatus::Running,
        stop: Some(StopIntent::Cancel),
        retry_budget: 4,
        retries_used: 2,
        attempts: 3,
        lease_generations: 9,
        current_attempt: Some(AttemptId::parse("att_1").unwrap()),
        deadline_at: Some(99_000),
        created_at: 1_000,
        started_at: Some(1_500),
        finished_at: Some(9_000),
        error_code: Some("EXECUTION_CANCELLED".into()),
        summary: Some("stopped by operator".into()),
        schedule: Some("nightly".into()),
    }
}

fn facts() -> LeaseFacts {
    LeaseFacts {
        worker: WorkerId::parse("router-1").unwrap(),
        session: SessionId::parse("ses_1").unwrap(),
        session_generation: Counter::new(7).unwrap(),
        offer: OfferId::parse("off_1").unwrap(),
        lease_generation: Counter::new(9).unwrap(),
        token_digest: digest(1),
        version: Counter::new(5).unwrap(),
        expires_at: 8_000,
    }
}

fn full_attempt() -> Attempt {
    Attempt {
        id: AttemptId::parse("att_1").unwrap(),
        run: RunId::parse("run_1").unwrap(),
        number: 3,
        executor_type: REMOTE_WORKER.into(),
        status: AttemptStatus::Cancelled,
        offer: OfferId::parse("off_1").unwrap(),
        session: SessionId::parse("ses_1").unwrap(),
        worker: WorkerId::parse("router-1").unwrap(),
        lease: Some(facts()),
        executor_handle: Some("pid:42 start:7".parse().unwrap()),
        log_artifact: Some(ArtifactId::parse("log").unwrap()),
        callback_sequence: Some(Counter::new(2).unwrap()),
        callback_digest: Some(digest(2)),
        exit_code: Some(-3),
        signal: Some(15),
        worker_finished_at: Some(8_500),
        artifact: Some(Receipt {
            artifact_id: ArtifactId::parse("log").unwrap(),
            length: 12,
            sha256: digest(3),
            truncated: true,
        }),
        log_acked: 12,
        log_sealed: true,
        claimed_artifact: None,
        end: Some(EndKind::Completion),
        created_at: 1_100,
        started_at: Some(1_500),
        ended_at: Some(9_000),
        error_code: Some("EXECUTION_CANCELLED".into()),
        summary: Some("a summary".into()),
    }
}

fn full_offer() -> Offer {
    Offer {
        id: OfferId::parse("off_1").unwrap(),
        run: RunId::parse("run_1").unwrap(),
        attempt: AttemptId::parse("att_1").unwrap(),
        worker: WorkerId::parse("router-1").unwrap(),
        session: SessionId::parse("ses_1").unwrap(),
        session_generation: Counter::new(7).unwrap(),
        state: OfferState::Claimed,
        expires_at: 4_000,
        claim: Some(ClaimFacts {
            token_digest: digest(1),
            lease_generation: Counter::new(9).unwrap(),
            lease_expires_at: 5_000,
            lease_ttl_ms: 30_000,
        }),
    }
}

fn full_lease() -> Lease {
    Lease {
        attempt: AttemptId::parse("att_1").unwrap(),
        run: RunId::parse("run_1").unwrap(),
        state: LeaseState::Completed,
        facts: facts(),
        ttl_ms: 30_000,
    }
}

fn full_event() -> Event {
    Event {
        id: EventId::parse("evt_1").unwrap(),
        run: RunId::parse("run_1").unwrap(),
        attempt: Some(AttemptId::parse("att_1").unwrap()),
        kind: "attempt.completed".into(),
        from_status: Some("running".into()),
        to_status: Some("cancelled".into()),
        payload: serde_json::json!({ "exitCode": -3, "nested": { "a": [1, "two", null, true] }, "big": 9_007_199_254_740_991u64 }),
        at: 9_000,
    }
}

fn write_all(c: &mut Connection, writes: &[Write]) -> rusqlite::Result<()> {
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    for w in writes {
        apply(&tx, w)?;
    }
    tx.commit()
}

fn world() -> Vec<Write> {
    vec![
        Write::Session(full_session()),
        Write::Run(full_run()),
        Write::Attempt(full_attempt()),
        Write::Offer(full_offer()),
        Write::Lease(full_lease()),
        Write::Event(full_event()),
    ]
}

#[test]
fn every_field_round_trips_through_its_row() {
    let dir = TempDir::new("roundtrip");
    let mut c = conn(&dir);
    write_all(&mut c, &world()).unwrap();
    let snap = snapshot(&c).unwrap();
    assert_eq!(snap.sessions, vec![full_session()]);
    assert_eq!(snap.runs, vec![full_run()]);
    assert_eq!(snap.attempts, vec![full_attempt()]);
    assert_eq!(snap.offers, vec![full_offer()]);
    assert_eq!(snap.leases, vec![full_lease()]);
    assert_eq!(snap.events, vec![full_event()]);
}

#[test]
fn a_loaded_row_is_written_in_the_columns_its_decision_changed_and_only_those() {
    let dir = TempDir::new("changed");
    let mut c = conn(&dir);
    write_all(&mut c, &world()).unwrap();
    let known = full_session();
    // Behind the model's back: a column the next write does not change.
    c.execute("UPDATE sessions SET agent_version = 'marker' WHERE id = 'ses_1'", []).unwrap();
    let seen = Session { seen_at: 2_500, expires_at: 3_500, ..known.clone() };
    rows::update_changed(&c, &seen, &known).unwrap();
    let (version, seen_at, expires_at): (String, i64, i64) = c
        .query_row("SELECT agent_version, seen_at, expires_at FROM sessions WHERE id = 'ses_1'", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    assert_eq!((version.as_str(), seen_at, expires_at), ("marker", 2_500, 3_500));
    // Nothing changed: no statement at all.
    let before = c.total_changes();
    rows::update_changed(&c, &seen, &seen).unwrap();
    assert_eq!(c.total_changes(), before);
    // A row it believed loaded but the table lacks is a lost write, refused loudly.
    let ghost = |s: &Session| Session { id: SessionId::parse("ses_ghost").unwrap(), ..s.clone() };
    let err = rows::update_changed(&c, &ghost(&seen), &ghost(&known)).unwrap_err();
    assert!(matches!(err, rusqlite::Error::StatementChangedRows(0)), "{err}");
}

#[test]
fn a_row_written_twice_by_one_decision_is_compared_with_its_first_write() {
    let loaded_rows = crate::core::Rows { session: Some(full_session()), ..Default::default() };
    let mut loaded = Loaded::of(&loaded_rows);
    let first = Write::Session(Session { seen_at: 9_000, ..full_session() });
    let second = Write::Session(full_session());
    assert!(matches!(loaded.known(&first), Some(Known::Session(_, old)) if *old == full_session()));
    loaded.wrote(&first);
    // Back to the loaded value: a comparison with the loaded row would find nothing to write.
    assert!(matches!(loaded.known(&second), Some(Known::Session(_, old)) if old.seen_at == 9_000));
    assert!(loaded.known(&Write::Event(full_event())).is_none(), "history is only appended");
}

#[test]
fn an_event_names_only_a_run_and_an_attempt_of_it_its_command_loaded_or_wrote() {
    let id = |s: &str| AttemptId::parse(s).unwrap();
    let event = |run: &str, attempt: Option<&str>| {
        Write::Event(Event { run: RunId::parse(run).unwrap(), attempt: attempt.map(id), ..full_event() })
    };
    // run_1 loaded, its current attempt att_1 not; att_2 of run_1 loaded.
    let rows = crate::core::Rows {
        run: Some(full_run()),
        attempt: Some(Attempt { id: id("att_2"), ..full_attempt() }),
        ..Default::default()
    };
    let mut loaded = Loaded::of(&rows);
    assert_eq!(loaded.dangling(&event("run_1", None)), None, "a loaded run");
    assert_eq!(loaded.dangling(&event("run_1", Some("att_2"))), None, "a loaded attempt of that run");
    assert_eq!(loaded.dangling(&event("run_1", Some("att_1"))), None, "the loaded run's current attempt");
    let unknown_run = loaded.dangling(&event("run_9", None)).expect("a run never loaded");
    assert!(unknown_run.contains("run_9") && unknown_run.contains(&full_event().kind), "{unknown_run}");
    let unknown = loaded.dangling(&event("run_1", Some("att_9"))).expect("an attempt never loaded");
    assert!(unknown.contains("att_9"), "{unknown}");
    // A run written by the decision counts from its write on; an attempt must be its run's.
    let new_run = Write::Run(Run { id: RunId::parse("run_2").unwrap(), current_attempt: None, ..full_run() });
    assert!(loaded.dangling(&event("run_2", None)).is_some(), "not yet written");
    loaded.wrote(&new_run);
    assert_eq!(loaded.dangling(&event("run_2", None)), None, "written");
    assert!(loaded.dangling(&event("run_2", Some("att_2"))).is_some(), "att_2 is run_1's");
    assert!(loaded.dangling(&event("run_2", Some("att_1"))).is_some(), "run_1's current attempt is not run_2's");
    assert_eq!(loaded.dangling(&new_run), None, "only events are checked");
}

#[test]
fn empty_optional_fields_round_trip_as_null() {
    let dir = TempDir::new("nulls");
    let mut c = conn(&dir);
    let session = Session { labels: BTreeMap::new(), ..full_session() };
    let run = Run {
        spec: ExecutionSpec { argv: Some(vec!["true".into()]), script: None, env: BTreeMap::new(), ..full_run().spec },
        labels: BTreeMap::new(),
        stop: None,
        current_attempt: None,
        deadline_at: None,
        started_at: None,
        finished_at: None,
        error_code: None,
        summary: None,
        schedule: None,
        ..full_run()
    };
    let attempt = Attempt {
        lease: None,
        executor_handle: None,
        log_artifact: None,
        callback_sequence: None,
        callback_digest: None,
        exit_code: None,
        signal: None,
        worker_finished_at: None,
        artifact: None,
        end: None,
        started_at: None,
        ended_at: None,
        error_code: None,
        summary: None,
        ..full_attempt()
    };
    let offer = Offer { claim: None, ..full_offer() };
    let event =
        Event { attempt: None, from_status: None, to_status: None, payload: serde_json::json!({}), ..full_event() };
    let writes = vec![
        Write::Session(session.clone()),
        Write::Run(run.clone()),
        Write::Attempt(attempt.clone()),
        Write::Offer(offer.clone()),
        Write::Event(event.clone()),
    ];
    write_all(&mut c, &writes).unwrap();
    let snap = snapshot(&c).unwrap();
    assert_eq!((snap.sessions, snap.runs, snap.attempts), (vec![session], vec![run], vec![attempt]));
    assert_eq!((snap.offers, snap.events), (vec![offer], vec![event]));
}

#[test]
fn upsert_updates_in_place_without_breaking_references() {
    let dir = TempDir::new("upsert");
    let mut c = conn(&dir);
    write_all(&mut c, &world()).unwrap();
    // REPLACE would delete the run under its attempts, lease and events; an upsert must not.
    let run = Run { status: RunStatus::Cancelled, ..full_run() };
    let attempt = Attempt { status: AttemptStatus::Lost, lease: None, ..full_attempt() };
    write_all(&mut c, &[Write::Run(run.clone()), Write::Attempt(attempt.clone())]).unwrap();
    let snap = snapshot(&c).unwrap();
    assert_eq!((snap.runs, snap.attempts), (vec![run], vec![attempt]));
    assert_eq!(snap.events.len(), 1);
}

#[test]
fn an_event_type_is_never_appended_twice_for_an_attempt() {
    let dir = TempDir::new("events");
    let mut c = conn(&dir);
    write_all(&mut c, &world()).unwrap();
    let again = Event { id: EventId::parse("evt_2").unwrap(), ..full_event() };
    assert!(write_all(&mut c, &[Write::Event(again)]).is_err());
    // Run-level events (no attempt) are unique per run, too.
    let run_level =
        Event { id: EventId::parse("evt_3").unwrap(), attempt: None, kind: "run.queued".into(), ..full_event() };
    write_all(&mut c, &[Write::Event(run_level.clone())]).unwrap();
    let twice = Event { id: EventId::parse("evt_4").unwrap(), ..run_level };
    assert!(write_all(&mut c, &[Write::Event(twice)]).is_err());
    assert!(c.execute("UPDATE events SET kind = 'x'", []).is_err(), "events are append-only");
    assert_eq!(snapshot(&c).unwrap().events.len(), 2);
}

#[test]
fn foreign_keys_and_status_checks_hold_at_commit() {
    let dir = TempDir::new("constraints");
    let mut c = conn(&dir);
    // An attempt of a run that does not exist.
    let orphan = vec![Write::Session(full_session()), Write::Attempt(full_attempt()), Write::Offer(full_offer())];
    assert!(write_all(&mut c, &orphan).is_err());
    write_all(&mut c, &world()).unwrap();
    for (table, column) in [
        ("sessions", "state"),
        ("runs", "status"),
        ("runs", "stop"),
        ("attempts", "status"),
        ("attempts", "end_kind"),
        ("offers", "state"),
        ("leases", "state"),
    ] {
        let refused = c.execute(&format!("UPDATE {table} SET {column} = 'bogus'"), []);
        assert!(refused.is_err(), "{table}.{column} accepted an unknown value");
    }
    assert!(c.execute("UPDATE leases SET token_digest = 'not-a-digest'", []).is_err());
    assert!(c.execute("UPDATE attempts SET lease_version = NULL", []).is_err(), "lease projection is all or nothing");
}

#[test]
fn the_database_file_is_private_and_in_wal_mode() {
    let dir = TempDir::new("mode");
    let c = conn(&dir);
    let mode = std::fs::metadata(dir.db()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let journal: String = c.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
    assert_eq!(journal, "wal");
    let sync: i64 = c.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
    assert_eq!(sync, 1, "synchronous=NORMAL: the writer syncs the WAL itself");
    let fk: i64 = c.query_row("PRAGMA foreign_keys", [], |r| r.get(0)).unwrap();
    assert_eq!(fk, 1);
    let wal = dir.0.join("authority.db-wal");
    if wal.exists() {
        assert_eq!(std::fs::metadata(wal).unwrap().permissions().mode() & 0o777, 0o600);
    }
}

#[test]
fn a_newer_schema_is_refused_and_migration_is_idempotent() {
    let dir = TempDir::new("schema");
    drop(conn(&dir));
    let mut c = conn(&dir);
    let v: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, SCHEMA_VERSION);
    c.pragma_update(None, "user_version", SCHEMA_VERSION + 1).unwrap();
    assert!(schema::migrate(&mut c).is_err());
    drop(c);
    assert!(SqliteStore::open(dir.db(), Timings::default()).is_err());
}

/// With deferred foreign keys SQLite looks up the rows referencing each parent row it
/// inserts while a violation is pending, and placement always leaves one pending (an
/// offer and its attempt reference each other). Without an index on the referencing
/// column that lookup reads the whole table, so every placement would slow down with
/// history. Every referencing column must lead some index (or be the primary key).
#[test]
fn every_foreign_key_column_leads_an_index() {
    let dir = TempDir::new("fk-index");
    let c = conn(&dir);
    let strings = |sql: &str| -> Vec<String> {
        let mut stmt = c.prepare(sql).unwrap();
        stmt.query_map([], |r| r.get::<_, String>(0)).unwrap().map(Result::unwrap).collect()
    };
    let tables = strings("SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'");
    let mut checked = 0;
    let mut unindexed = Vec::new();
    for table in &tables {
        let mut leading = strings(&format!(
            "SELECT (SELECT name FROM pragma_index_info(l.name) WHERE seqno = 0) FROM pragma_index_list('{table}') l \
             WHERE (SELECT name FROM pragma_index_info(l.name) WHERE seqno = 0) IS NOT NULL"
        ));
        leading.extend(strings(&format!("SELECT name FROM pragma_table_info('{table}') WHERE pk = 1")));
        for column in strings(&format!("SELECT \"from\" FROM pragma_foreign_key_list('{table}')")) {
            if !leading.contains(&column) {
                unindexed.push(format!("{table}.{column}"));
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} foreign keys found: is the schema there?");
    assert_eq!(unindexed, Vec::<String>::new(), "referencing columns that lead no index");
}

#[test]
fn a_version_1_database_gains_the_foreign_key_indexes() {
    let dir = TempDir::new("upgrade");
    let mut c = schema::connect(&dir.db(), Duration::from_secs(5)).unwrap();
    c.execute_batch(schema::MIGRATIONS[0]).unwrap();
    c.pragma_update(None, "user_version", 1).unwrap();
    let index_count = |c: &Connection| -> i64 {
        c.query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'index' \
             AND name IN ('runs_current_attempt', 'attempts_offer', 'offers_run')",
            [],
            |r| r.get(0),
        )
        .unwrap()
    };
    assert_eq!(index_count(&c), 0);
    schema::migrate(&mut c).unwrap();
    let v: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, SCHEMA_VERSION);
    assert_eq!(index_count(&c), 3);
}

#[test]
fn runs_queued_before_trusted_labels_keep_asking_for_declared_ones() {
    let dir = TempDir::new("labels-upgrade");
    let mut c = schema::connect(&dir.db(), Duration::from_secs(5)).unwrap();
    for sql in &schema::MIGRATIONS[..4] {
        c.execute_batch(sql).unwrap();
    }
    c.pragma_update(None, "user_version", 4).unwrap();
    let spec = serde_json::to_string(&full_run().spec).unwrap();
    c.execute(
        "INSERT INTO runs (id, project, spec, labels, status, retry_budget, retries_used, attempts, \
         lease_generations, created_at) VALUES ('run_old', 'proj', ?1, '{\"arch\":\"mips\"}', 'queued', 0, 0, 0, 0, 1)",
        [spec],
    )
    .unwrap();
    schema::migrate(&mut c).unwrap();
    let (labels, agent_labels): (String, String) = c
        .query_row("SELECT labels, agent_labels FROM runs WHERE id = 'run_old'", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap();
    assert_eq!((labels.as_str(), agent_labels.as_str()), ("{}", r#"{"arch":"mips"}"#));
}

#[test]
fn the_sessions_table_is_rebuilt_for_closed_with_its_rows_and_references_intact() {
    let dir = TempDir::new("closed-upgrade");
    let mut c = schema::connect(&dir.db(), Duration::from_secs(5)).unwrap();
    for sql in &schema::MIGRATIONS[..6] {
        c.execute_batch(sql).unwrap();
    }
    c.pragma_update(None, "user_version", 6).unwrap();
    c.execute(
        "INSERT INTO sessions (id, worker, generation, state, capacity, labels, agent_version, arch, created_at, \
         seen_at, expires_at) VALUES ('ses_old', 'w1', 1, 'online', 1, '{}', '0.1.0', 'x86_64', 1, 1, 9)",
        [],
    )
    .unwrap();
    schema::migrate(&mut c).unwrap();
    let fk: i64 = c.query_row("PRAGMA foreign_keys", [], |r| r.get(0)).unwrap();
    assert_eq!(fk, 1, "foreign keys are back on");
    let state: String = c.query_row("SELECT state FROM sessions WHERE id = 'ses_old'", [], |r| r.get(0)).unwrap();
    assert_eq!(state, "online");
    c.execute("UPDATE sessions SET state = 'closed' WHERE id = 'ses_old'", []).unwrap();
    assert!(c.execute("UPDATE sessions SET state = 'gone' WHERE id = 'ses_old'", []).is_err(), "still checked");
    let refs: i64 = c
        .query_row("SELECT count(*) FROM pragma_foreign_key_list('attempts') WHERE \"table\" = 'sessions'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(refs, 1, "attempts still refer to sessions");
}

#[test]
fn db_time_is_sql_time_plus_the_offset() {
    let dir = TempDir::new("clock");
    let c = conn(&dir);
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let now = schema::db_now(&c, 0).unwrap();
    assert!((now - wall).abs() < 5_000, "db time {now} vs wall {wall}");
    let later = schema::db_now(&c, 60_000).unwrap();
    assert!(later - now >= 60_000 && later - now < 65_000);
}

#[tokio::test]
async fn audit_records_get_db_time_and_keep_their_order() {
    let dir = TempDir::new("audit");
    let offset = Arc::new(AtomicI64::new(0));
    let store = SqliteStore::open_with(dir.db(), Timings::default(), offset.clone()).unwrap();
    let rec = |route: &str| AuditRecord {
        at: 0,
        principal: Some(WorkerId::parse("router-1").unwrap()),
        route: route.into(),
        outcome: "admitted".into(),
    };
    store.audit(rec("session.open")).await.unwrap();
    offset.store(3_600_000, Ordering::SeqCst);
    store.audit(AuditRecord { principal: None, outcome: "principal_mismatch".into(), ..rec("unknown") }).await.unwrap();
    let audits = store.audits().await.unwrap();
    assert_eq!(audits.len(), 2);
    assert_eq!(audits[0].route, "session.open");
    assert_eq!(audits[1].principal, None);
    assert!(audits[1].at - audits[0].at >= 3_600_000);
    assert!(audits[0].at > 1_600_000_000_000);
}

/// Audit records found in the database file alone, as a power cut that lost the WAL
/// would leave it: what checkpoints copied there. A copy torn by a checkpoint writing
/// meanwhile reads as none.
fn checkpointed_audits(dir: &TempDir) -> i64 {
    let copy = TempDir::new("copy");
    std::fs::copy(dir.db(), copy.db()).unwrap();
    let c = Connection::open(copy.db()).unwrap();
    c.query_row("SELECT count(*) FROM audit", [], |r| r.get(0)).unwrap_or(0)
}

async fn open_and_audit(dir: &TempDir, checkpoint_interval: Duration, n: i64) -> SqliteStore {
    let options = SqliteOptions {
        checkpoint_interval,
        // Far beyond what the test writes: the writer never checkpoints by itself.
        wal_autocheckpoint_pages: 1 << 30,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open_with_options(dir.db(), options).unwrap();
    for i in 0..n {
        let rec = AuditRecord { at: 0, principal: None, route: format!("r{i}"), outcome: "admitted".into() };
        store.audit(rec).await.unwrap();
    }
    store
}

#[tokio::test]
async fn the_checkpoint_thread_copies_commits_into_the_database_file() {
    let dir = TempDir::new("checkpoint");
    let store = open_and_audit(&dir, Duration::from_millis(5), 50).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while checkpointed_audits(&dir) != 50 {
        assert!(Instant::now() < deadline, "the commits never reached the database file");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let backstop: i64 =
        store.call(|w| w.conn.query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0)).map_err(sql)).await.unwrap();
    assert_eq!(backstop, 1 << 30, "the writer's own checkpoint is only the backstop");
}

#[tokio::test]
async fn without_the_checkpoint_thread_commits_stay_in_the_wal_until_the_backstop() {
    let dir = TempDir::new("no-checkpoint");
    let store = open_and_audit(&dir, Duration::ZERO, 50).await;
    // Every commit answered is in the WAL, and nothing copied it on.
    assert_eq!(store.audits().await.unwrap().len(), 50);
    assert_eq!(checkpointed_audits(&dir), 0);
}

/// A job for [`Writer::run_batch`] that runs `work` and reports its result on `out`.
fn job<T: Send + 'static>(
    work: impl FnOnce(&mut Writer) -> Result<T, StoreError> + Send + 'static,
    out: std::sync::mpsc::Sender<Result<T, String>>,
) -> Job {
    Box::new(move |w| {
        let result = w.map_err(|e| StoreError(e.0.clone())).and_then(work);
        let keep = result.is_ok();
        Answer {
            keep,
            deliver: Box::new(move |committed| {
                let _ = out.send(committed.map_err(|e| e.0.clone()).and(result.map_err(|e| e.0)));
            }),
        }
    })
}

fn writer(dir: &TempDir) -> Writer {
    Writer {
        conn: conn(dir),
        timings: Timings::default(),
        clock_offset: Arc::new(AtomicI64::new(0)),
        wakes: Arc::default(),
        data_version: None,
        wake_pending: false,
        wants_pending: Vec::new(),
        queue: queue::Queue::default(),
        commit_window: Duration::ZERO,
        commit_window_min_batch: 2,
        last_batch: 0,
        last_idle: false,
        last_end: None,
        idle_window: Duration::ZERO,
        path: dir.db(),
        wal: None,
        lazy_sync: Duration::ZERO,
        unsynced: None,
        job_lazy: false,
        job_seen: false,
        decided: false,
        held: Vec::new(),
        held_batches: 0,
        hold_max: HOLD_MAX,
        broken: None,
        durable: Arc::default(),
    }
}

fn audit_rows(w: &Writer) -> i64 {
    w.conn.query_row("SELECT count(*) FROM audit", [], |r| r.get(0)).unwrap()
}

#[test]
fn a_failing_job_rolls_back_alone_and_the_rest_of_its_batch_commits() {
    let dir = TempDir::new("batch");
    let mut w = writer(&dir);
    let (tx, rx) = std::sync::mpsc::channel();
    let record = |route: &str| AuditRecord { at: 1, principal: None, route: route.into(), outcome: "admitted".into() };
    let (a, b) = (record("a"), record("b"));
    let ok = |r: AuditRecord| move |w: &mut Writer| rows::write(&w.conn, &r).map_err(sql);
    let failing = |w: &mut Writer| -> Result<(), StoreError> {
        rows::write(&w.conn, &AuditRecord { at: 1, principal: None, route: "c".into(), outcome: "x".into() })
            .map_err(sql)?;
        Err(StoreError("the decision failed after writing".into()))
    };
    w.run_batch(vec![job(ok(a), tx.clone()), job(failing, tx.clone()), job(ok(b), tx.clone())]);
    let answers: Vec<Result<(), String>> = rx.try_iter().collect();
    assert_eq!(answers.len(), 3);
    assert!(answers[0].is_ok() && answers[2].is_ok());
    assert!(answers[1].as_ref().unwrap_err().contains("failed after writing"));
    let routes: Vec<String> = all(&w.conn, "SELECT route FROM audit ORDER BY seq", [], |r| r.get(0)).unwrap();
    assert_eq!(routes, ["a", "b"], "only the failing job's write is gone");
    assert!(w.conn.is_autocommit(), "the batch transaction is closed");
}

#[test]
fn when_the_batch_cannot_begin_every_job_answers_the_error_and_nothing_runs() {
    let dir = TempDir::new("batch-busy");
    let mut w = writer(&dir);
    // Another connection holds the write lock past the busy timeout.
    let other = conn(&dir);
    other.busy_timeout(Duration::from_millis(1)).unwrap();
    w.conn.busy_timeout(Duration::from_millis(1)).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let write = |w: &mut Writer| {
        rows::write(&w.conn, &AuditRecord { at: 1, principal: None, route: "a".into(), outcome: "x".into() })
            .map_err(sql)
    };
    w.run_batch(vec![job(write, tx.clone()), job(write, tx)]);
    let answers: Vec<Result<(), String>> = rx.try_iter().collect();
    assert_eq!(answers.len(), 2);
    assert!(answers.iter().all(|a| a.as_ref().unwrap_err().contains("sqlite")), "{answers:?}");
    other.execute_batch("ROLLBACK").unwrap();
    assert_eq!(audit_rows(&w), 0);
}

#[test]
fn the_index_of_queued_runs_follows_commits_rollbacks_and_other_processes() {
    let dir = TempDir::new("queue");
    let mut w = writer(&dir);
    let (tx, rx) = std::sync::mpsc::channel();
    let queued = Run {
        status: RunStatus::Queued,
        labels: BTreeMap::new(),
        agent_labels: labels(),
        current_attempt: None,
        schedule: None,
        ..full_run()
    };
    let fitting = |w: &mut Writer, fit: crate::core::Fit| {
        let runs = w.queue.fitting(&w.conn, &fit, 10).map_err(sql)?;
        Ok(runs.into_iter().map(|r| r.id).collect::<Vec<_>>())
    };
    let fit = crate::core::Fit { trusted: BTreeMap::new(), declared: labels() };
    let (all, others) = (fit.clone(), crate::core::Fit::default());
    // Read while empty, then a run queued through the writer is found at once.
    let note = |run: Run| {
        move |w: &mut Writer| {
            apply(&w.conn, &Write::Run(run.clone())).map_err(sql)?;
            w.queue.note(&run);
            Ok(Vec::new())
        }
    };
    w.run_batch(vec![job(move |w| fitting(w, all), tx.clone()), job(note(queued.clone()), tx.clone())]);
    let (fit_a, fit_b) = (fit.clone(), fit.clone());
    w.run_batch(vec![job(move |w| fitting(w, fit_a), tx.clone()), job(move |w| fitting(w, others), tx.clone())]);
    let answers: Vec<Vec<RunId>> = rx.try_iter().map(Result::unwrap).collect();
    assert_eq!(answers[2], vec![queued.id.clone()], "queued and committed: indexed");
    assert!(answers[3].is_empty(), "a session without the label does not take it");

    // A job that took it out of the queue and then failed leaves it queued.
    let taken = Run { status: RunStatus::Cancelled, ..queued.clone() };
    let failing = move |w: &mut Writer| -> Result<Vec<RunId>, StoreError> {
        apply(&w.conn, &Write::Run(taken.clone())).map_err(sql)?;
        w.queue.note(&taken);
        Err(StoreError("the decision failed after writing".into()))
    };
    w.run_batch(vec![job(failing, tx.clone()), job(move |w| fitting(w, fit_b), tx.clone())]);
    let answers: Vec<Result<Vec<RunId>, String>> = rx.try_iter().collect();
    assert_eq!(answers[1].as_ref().unwrap(), &vec![queued.id.clone()], "rolled back: still queued");

    // Another process queues one (the CLI's submit): the next placement finds it.
    let theirs = Run { id: RunId::parse("run_2").unwrap(), created_at: 2_000, ..queued.clone() };
    rows::write(&conn(&dir), &theirs).unwrap();
    w.run_batch(vec![job(move |w| fitting(w, fit), tx.clone())]);
    let found = rx.try_iter().next().unwrap().unwrap();
    assert_eq!(found, vec![queued.id.clone(), theirs.id], "another process's commit is seen, in placement order");
}

/// A poll reads only as many queued runs as it has room for, the oldest, and a run the
/// index still holds but that left the queue behind its back makes it read the table
/// again rather than place nothing.
#[test]
fn placement_reads_its_room_of_queued_runs_and_a_stale_index_is_read_again() {
    let dir = TempDir::new("queue-room");
    let mut w = writer(&dir);
    let fit = crate::core::Fit { trusted: BTreeMap::new(), declared: labels() };
    let queued = |i: i64| Run {
        id: RunId::parse(format!("run_{i}")).unwrap(),
        status: RunStatus::Queued,
        labels: BTreeMap::new(),
        agent_labels: labels(),
        current_attempt: None,
        schedule: None,
        created_at: 1_000 + i,
        ..full_run()
    };
    for i in 1..=5 {
        rows::write(&w.conn, &queued(i)).unwrap();
    }
    let fitting = |w: &mut Writer, limit| {
        let runs = w.queue.fitting(&w.conn, &fit, limit).unwrap();
        runs.into_iter().map(|r| r.id.to_string()).collect::<Vec<_>>()
    };
    assert_eq!(fitting(&mut w, 2), ["run_1", "run_2"]);
    assert!(fitting(&mut w, 0).is_empty(), "no room: no run read");
    // The oldest leaves the queue on the writer's own connection without the index
    // hearing of it (the file's data version does not change for its own writes).
    w.conn.execute("UPDATE runs SET status = 'cancelled' WHERE id = 'run_1'", []).unwrap();
    assert_eq!(fitting(&mut w, 2), ["run_2", "run_3"], "the table read again: a full room");
}

#[test]
fn a_batch_waits_in_its_window_only_for_concurrent_callers() {
    let dir = TempDir::new("window");
    let (tx, rx) = std::sync::mpsc::channel();
    let noop = |w: &mut Writer| -> Result<(), StoreError> { w.control("SELECT 1") };
    let mut w = Writer { commit_window: Duration::from_secs(3600), commit_window_min_batch: 3, ..writer(&dir) };
    let (jobs, queue) = mpsc::channel::<Job>();
    // A lone caller, or fewer callers than the window's minimum batch: committed at once,
    // the window unused.
    for few in [1, 2] {
        w.last_batch = few;
        assert_eq!(w.gather(&queue, job(noop, tx.clone())).len(), 1, "after a batch of {few}");
    }
    // After a batch of three, a batch waits for more callers, however late they come,
    // until there are as many as last time.
    w.last_batch = 3;
    jobs.send(job(noop, tx.clone())).unwrap();
    let late = std::thread::spawn({
        let (jobs, tx) = (jobs.clone(), tx.clone());
        move || jobs.send(job(noop, tx)).map_err(drop)
    });
    assert_eq!(w.gather(&queue, job(noop, tx.clone())).len(), 3);
    late.join().unwrap().unwrap();
    // What is queued already joins without waiting, up to the batch's bound.
    for _ in 0..BATCH_MAX + 1 {
        jobs.send(job(noop, tx.clone())).unwrap();
    }
    let first = queue.recv().unwrap();
    assert_eq!(w.gather(&queue, first).len(), BATCH_MAX);
    drop(rx);
}

#[test]
fn a_batch_pauses_to_gather_only_right_after_a_batch_that_decided_nothing() {
    let dir = TempDir::new("idle");
    let window = Duration::from_millis(10);
    let end = Instant::now();
    let w = Writer { idle_window: window, last_idle: true, last_end: Some(end), ..writer(&dir) };
    assert_eq!(w.idle_pause(end + window / 2), Some(window), "polls arriving one by one");
    assert_eq!(w.idle_pause(end + window), None, "a job after a quiet has no company to wait for");
    assert_eq!(Writer { last_idle: false, ..w }.idle_pause(end), None, "the last batch decided something");
    let w = Writer { idle_window: Duration::ZERO, last_idle: true, last_end: Some(end), ..writer(&dir) };
    assert_eq!(w.idle_pause(end), None, "no window");
    let w = Writer { idle_window: window, last_idle: true, ..writer(&dir) };
    assert_eq!(w.idle_pause(end), None, "no batch yet");
}

#[test]
fn only_a_batch_of_idle_polls_and_heartbeats_makes_the_next_one_pause() {
    let dir = TempDir::new("idle-kind");
    let mut w = writer(&dir);
    let now = schema::db_now(&w.conn, 0).unwrap();
    let session = Session { state: SessionState::Online, seen_at: now, expires_at: now + 3_600_000, ..full_session() };
    write_all(&mut w.conn, &[Write::Session(session.clone())]).unwrap();
    let (tx, _rx) = std::sync::mpsc::channel();
    let beat = move |draining| {
        let cmd = Command::Heartbeat(
            session.worker.clone(),
            session.id.clone(),
            Heartbeat { generation: session.generation, draining },
        );
        move |w: &mut Writer| {
            w.job_lazy = true;
            w.execute(&cmd).map(drop)
        }
    };
    // An idle agent's heartbeat only sees its session: the next batch may gather.
    w.run_batch(vec![job(beat(false), tx.clone())]);
    assert!(w.last_idle, "a batch of idle heartbeats");
    // A refusal's (or a chunk admission's) audit record alone decides nothing either, but
    // it is no idle agent's: a live log's next chunk must not wait behind it.
    w.run_batch(vec![job(refusal_audit, tx.clone())]);
    assert!(!w.last_idle, "an audit record alone");
    w.run_batch(vec![job(beat(false), tx.clone()), job(refusal_audit, tx.clone())]);
    assert!(!w.last_idle, "idle heartbeats with other work");
    // Draining is news: it is decided, not seen.
    w.run_batch(vec![job(beat(true), tx.clone())]);
    assert!(!w.last_idle, "a heartbeat that declares draining");
}

/// A job that writes an audit record alone (a refusal's): it says it may wait for its sync.
fn refusal_audit(w: &mut Writer) -> Result<(), StoreError> {
    w.job_lazy = true;
    w.record(AuditRecord { at: 1, principal: None, route: "refused".into(), outcome: "x".into() })
}

/// A job whose write decides something: it is durable before its answer.
fn deciding_write(w: &mut Writer) -> Result<(), StoreError> {
    let record = AuditRecord { at: 1, principal: None, route: "decided".into(), outcome: "x".into() };
    rows::write(&w.conn, &record).map_err(sql)
}

#[test]
fn a_commit_that_decides_nothing_waits_for_its_sync_and_one_that_decides_syncs_it() {
    let dir = TempDir::new("lazy");
    let mut w = Writer { lazy_sync: Duration::from_secs(3600), ..writer(&dir) };
    let (tx, rx) = std::sync::mpsc::channel();
    let (audit_only, decided) = (refusal_audit, deciding_write);
    let read = |w: &mut Writer| {
        w.conn.query_row("SELECT count(*) FROM audit", [], |r| r.get::<_, i64>(0)).map(drop).map_err(sql)
    };

    w.run_batch(vec![job(audit_only, tx.clone())]);
    assert!(w.unsynced.is_some() && w.wal.is_none(), "answered, its sync still to come");
    w.run_batch(vec![job(audit_only, tx.clone()), job(decided, tx.clone())]);
    assert!(
        w.unsynced.is_none() && w.wal.is_some(),
        "the deciding job synced the WAL, and the waiting commits with it"
    );
    w.run_batch(vec![job(read, tx.clone())]);
    assert!(w.unsynced.is_none(), "a commit that wrote nothing has nothing to sync");

    w.run_batch(vec![job(audit_only, tx.clone())]);
    w.sync_if_due();
    assert!(w.unsynced.is_some(), "not due yet");
    w.unsynced = w.unsynced.map(|since| since - w.lazy_sync);
    w.sync_if_due();
    assert!(w.unsynced.is_none(), "synced when due");
    assert!(rx.try_iter().all(|a: Result<(), String>| a.is_ok()));

    // A sync that fails (fdatasync of a pipe is EINVAL) fails the batch that needed it,
    // and every batch after it, which then writes nothing.
    let (pipe, _keep) = std::io::pipe().unwrap();
    w.wal = Some(File::from(std::os::fd::OwnedFd::from(pipe)));
    let before = audit_rows(&w);
    w.run_batch(vec![job(decided, tx.clone())]);
    let failed: Vec<Result<(), String>> = rx.try_iter().collect();
    assert!(
        failed.len() == 1 && failed[0].as_ref().unwrap_err().contains("syncing the database's WAL failed"),
        "{failed:?}"
    );
    assert!(w.broken.is_some());
    let refused = w.durable.wait().unwrap_err();
    assert!(refused.0.contains("syncing the database's WAL failed"), "no read is answered either: {refused:?}");
    let committed_unsynced = audit_rows(&w);
    w.run_batch(vec![job(decided, tx.clone()), job(audit_only, tx.clone())]);
    let refused: Vec<Result<(), String>> = rx.try_iter().collect();
    assert!(
        refused.len() == 2 && refused.iter().all(|a| a.as_ref().unwrap_err().contains("restart ql-control")),
        "{refused:?}"
    );
    assert_eq!(audit_rows(&w), committed_unsynced, "a broken writer writes nothing");
    assert_eq!(committed_unsynced, before + 1);
}

#[test]
fn answers_wait_for_the_sync_that_covers_them_and_one_sync_covers_the_batches_held() {
    let dir = TempDir::new("held");
    let mut w = Writer { lazy_sync: Duration::from_secs(3600), ..writer(&dir) };
    let (tx, rx) = std::sync::mpsc::channel();
    let (audit_only, decided) = (refusal_audit, deciding_write);

    w.run_held(vec![job(decided, tx.clone())]);
    assert!(rx.try_recv().is_err(), "a decision's answer waits for its sync");
    assert!(!durable_now(&w), "and so does a read that may have seen it");
    w.run_held(vec![job(audit_only, tx.clone())]);
    assert!(rx.try_recv().is_err(), "so does a later answer, which may have read that decision");
    assert_eq!((w.held.len(), w.held_batches), (2, 2));
    assert!(w.wal.is_none(), "nothing synced yet");
    w.release();
    let answers: Vec<Result<(), String>> = rx.try_iter().collect();
    assert_eq!(answers, vec![Ok(()), Ok(())]);
    assert!(durable_now(&w), "the sync lets reads be answered");
    assert!(w.wal.is_some() && w.unsynced.is_none() && w.held.is_empty() && w.held_batches == 0);

    // With no decision waiting, an answer that decides nothing leaves at once, and so
    // does a read that saw it.
    w.run_held(vec![job(audit_only, tx.clone())]);
    assert_eq!(rx.try_iter().count(), 1);
    assert!(durable_now(&w));
    assert!(w.held.is_empty() && w.unsynced.is_some());
}

/// A live log's window is found on the chunks' primary key, for both its bounds: SQLite's
/// own plan of the statement the store runs searches the key twice and scans nothing.
#[test]
fn a_live_log_window_is_searched_on_the_chunks_key() {
    let dir = TempDir::new("log-window");
    let c = conn(&dir);
    let sql = format!("EXPLAIN QUERY PLAN {}", crate::store::log_chunks_sql('?'));
    let mut stmt = c.prepare(&sql).unwrap();
    let steps: Vec<String> = stmt
        .query_map(rusqlite::params!["att_x", 5, 10], |r| r.get::<_, String>(3))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let searches = steps.iter().filter(|s| s.starts_with("SEARCH log_chunks USING")).count();
    assert_eq!(searches, 2, "{steps:?}");
    assert!(steps.iter().all(|s| !s.starts_with("SCAN")), "{steps:?}");
    assert!(steps.iter().all(|s| !s.contains("TEMP B-TREE")), "no sort of its own: {steps:?}");
}

/// The workers' list counts twin refusals over an hour through an index of the refusals
/// alone: the hour's other audit records (every poll of a fleet) are never read.
#[test]
fn twin_refusals_are_counted_from_an_index_of_refusals_alone() {
    let dir = TempDir::new("twins");
    let c = conn(&dir);
    let mut stmt = c.prepare(&format!("EXPLAIN QUERY PLAN {TWIN_REFUSALS}")).unwrap();
    let steps: Vec<String> = stmt.query_map([0_i64], |r| r.get::<_, String>(3)).unwrap().map(Result::unwrap).collect();
    assert!(steps.iter().any(|s| s.starts_with("SEARCH audit USING") && s.contains("INDEX audit_twins")), "{steps:?}");
    assert!(steps.iter().all(|s| !s.starts_with("SCAN")), "{steps:?}");
}

/// An operator's read runs beside the writer: while one is held in the middle of its read
/// transaction, an agent's command commits and is answered, and the read, once let go,
/// still sees the state as of its start; the next read sees the command.
#[tokio::test]
async fn an_operators_read_never_holds_up_the_writer() {
    let dir = TempDir::new("reader");
    let store = SqliteStore::open(dir.db(), Timings::default()).unwrap();
    let (entered, in_read) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let reading = store.clone();
    let held = tokio::spawn(async move {
        reading
            .read(move |conn, _| {
                let count = || conn.query_row("SELECT count(*) FROM audit", [], |r| r.get::<_, i64>(0)).map_err(sql);
                let before = count()?;
                entered.send(()).unwrap();
                released.recv().unwrap();
                Ok((before, count()?))
            })
            .await
    });
    tokio::task::spawn_blocking(move || in_read.recv().unwrap()).await.unwrap();
    let record = AuditRecord {
        at: 0,
        principal: Some(WorkerId::parse("router-1").unwrap()),
        route: "session.open".into(),
        outcome: "admitted".into(),
    };
    // Were the writer waiting for the read, this would never be answered: the read is
    // let go only after it.
    let answered = tokio::time::timeout(Duration::from_secs(60), store.audit(record)).await;
    answered.expect("the writer answers while a read is held").unwrap();
    release.send(()).unwrap();
    assert_eq!(held.await.unwrap().unwrap(), (0, 0), "one state for the whole read");
    assert_eq!(store.audits().await.unwrap().len(), 1, "a later read sees the commit");
}

/// Nothing sent to the reader writes.
#[tokio::test]
async fn the_reader_cannot_write() {
    let dir = TempDir::new("reader-only");
    let store = SqliteStore::open(dir.db(), Timings::default()).unwrap();
    let wrote = store
        .read(|conn, _| {
            conn.execute("INSERT INTO audit (at, route, outcome) VALUES (0, 'x', 'admitted')", []).map_err(sql)
        })
        .await;
    assert!(wrote.is_err(), "{wrote:?}");
    assert!(store.audits().await.unwrap().is_empty());
}

/// Whether a read begun now would be answered at once: every deciding commit counted is
/// synced, so the reader's [`reader::Durable::wait`] would not block.
fn durable_now(w: &Writer) -> bool {
    let (committing, synced) = w.durable.counts();
    synced >= committing
}

/// The watchdog's probe waits for the writer: held while the writer is held, when a read
/// sent after it is answered, and answered once the writer goes on.
#[tokio::test]
async fn the_watchdogs_probe_goes_through_the_writer() {
    use std::future::Future as _;
    use std::task::Poll;
    let dir = TempDir::new("probe");
    let store = SqliteStore::open(dir.db(), Timings::default()).unwrap();
    let (entered, in_job) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let holding = store.clone();
    let held = tokio::spawn(async move {
        holding
            .call(move |_| {
                entered.send(()).unwrap();
                released.recv().unwrap();
                Ok(())
            })
            .await
    });
    tokio::task::spawn_blocking(move || in_job.recv().unwrap()).await.unwrap();
    let mut probe = Box::pin(store.probe());
    let once = std::future::poll_fn(|cx| Poll::Ready(probe.as_mut().poll(cx))).await;
    assert!(once.is_pending(), "sent, not answered");
    let query = RunQuery { limit: 1, ..RunQuery::default() };
    assert!(store.runs(&query).await.unwrap().is_empty(), "the reader answers meanwhile");
    let again = std::future::poll_fn(|cx| Poll::Ready(probe.as_mut().poll(cx))).await;
    assert!(again.is_pending(), "the probe still waits for the writer");
    release.send(()).unwrap();
    held.await.unwrap().unwrap();
    assert!(probe.await.is_ok());
}

/// A page of workers reads each source by its index from the cursor on: no table is
/// scanned, whatever the fleet's size.
#[test]
fn a_page_of_workers_searches_each_source_by_index() {
    let dir = TempDir::new("worker-page");
    let c = conn(&dir);
    let mut stmt = c.prepare(&format!("EXPLAIN QUERY PLAN {}", crate::store::worker_ids_sql('?'))).unwrap();
    let steps: Vec<String> =
        stmt.query_map(rusqlite::params!["", 50], |r| r.get::<_, String>(3)).unwrap().map(Result::unwrap).collect();
    for table in ["workers", "certificates", "sessions"] {
        assert!(steps.iter().any(|s| s.starts_with(&format!("SEARCH {table} USING"))), "{table}: {steps:?}");
        assert!(!steps.iter().any(|s| s.starts_with(&format!("SCAN {table}"))), "{table}: {steps:?}");
    }
}

/// A writer that failed a sync answers no read, and the watchdog's probe, which a restart
/// alone can satisfy, never answers: the writer's error is not an answer.
#[tokio::test]
async fn a_writer_that_failed_a_sync_stops_the_watchdogs_probe_and_answers_no_read() {
    use std::future::Future as _;
    use std::task::Poll;
    let dir = TempDir::new("broken");
    let store = SqliteStore::open(dir.db(), Timings::default()).unwrap();
    let query = RunQuery { limit: 1, ..RunQuery::default() };
    assert!(store.runs(&query).await.is_ok());
    // What a failed fdatasync leaves (see `Writer::sync`).
    store
        .call(|w| {
            let why = "syncing the database's WAL failed: injected; restart ql-control".to_owned();
            w.durable.broken(&why);
            w.broken = Some(why);
            Ok(())
        })
        .await
        .unwrap();
    let refused = store.runs(&query).await.unwrap_err();
    assert!(refused.0.contains("restart ql-control"), "{refused:?}");
    let mut probe = Box::pin(store.probe());
    let first = std::future::poll_fn(|cx| Poll::Ready(probe.as_mut().poll(cx))).await;
    assert!(first.is_pending());
    // The writer answers in order: once this is answered, so was the probe's job.
    let record = AuditRecord { at: 0, principal: None, route: "x".into(), outcome: "admitted".into() };
    assert!(store.audit(record).await.is_err());
    let then = std::future::poll_fn(|cx| Poll::Ready(probe.as_mut().poll(cx))).await;
    assert!(then.is_pending(), "the writer's error is not an answer");
}
