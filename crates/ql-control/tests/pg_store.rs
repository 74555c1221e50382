//! PostgreSQL-only proofs beyond the shared contract suite: the three roles are enforced
//! by PostgreSQL itself, a connection that dies right after a completion's COMMIT loses
//! only the reply, two sweepers on two replicas at once never double-expire, and a
//! commit on one replica wakes the other's long-polls through LISTEN/NOTIFY, and a
//! request's admission decided with its command is read after the command's locks, and
//! the hot tables' row rules refuse what their CHECK constraints used to, and a poll's
//! queue probe reads no run queued for other label sets, and commands of concurrent
//! agents commit together while a command that fails among them fails alone, and a
//! session named by refused commands holds no place on the lanes, and the polls of
//! agents in step run as one wave, each deciding as it would after the ones before it,
//! and a renewal writes its lease row alone while every read of the attempt takes its
//! lease's version and expiry from the lease.
//!
//! Each test has a database of its own on the server `QL_TEST_PG_URL` names (see
//! `contract/pg.rs`; `scripts/test` provides one).

mod contract;

use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::Duration;

use ql_control::core::{Command, Reply};
use ql_control::model::{AttemptStatus, AuditRecord, LeaseState};
use ql_control::store::postgres::{checked_text, GroupCommits, PgOptions, PgStore};
use ql_control::store::{Audit, Snapshot, Store};
use ql_wire::completion::TerminalStatus;
use ql_wire::offer::PollOffers;
use ql_wire::{ErrorCode, Outcome};
use tokio_postgres::types::Type;

use contract::pg::{connect, Pg, TestDb};
use contract::*;

/// The SQLSTATE of a statement `client` runs, or `None` when it succeeds.
async fn sqlstate(client: &tokio_postgres::Client, sql: &str) -> Option<String> {
    client.batch_execute(sql).await.err().map(|e| e.code().map_or_else(|| e.to_string(), |c| c.code().to_owned()))
}

const INSUFFICIENT_PRIVILEGE: &str = "42501";

#[tokio::test]
async fn the_worker_ingress_role_may_append_audit_records_and_nothing_else() {
    let b = Pg::new().await;
    let store = b.store();
    // A real run with a lease, so every refused statement below has a row to hit.
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    let (run, attempt) = (h.run().as_str().to_owned(), h.attempt().as_str().to_owned());

    let ingress = connect(&b.db().url("ql_worker_ingress")).await;
    assert_eq!(
        sqlstate(&ingress, "INSERT INTO audit (at, principal, route, outcome) VALUES (1, 'router-1', 'x', 'admitted')")
            .await,
        None,
        "worker-ingress appends audit records"
    );
    let refused = [
        format!("UPDATE runs SET status = 'succeeded' WHERE id = '{run}'"),
        "INSERT INTO runs (id, project, spec, labels, status, retry_budget, retries_used, attempts, \
         lease_generations, created_at) VALUES ('run_forged', 'default', '{}', '{}', 'queued', 0, 0, 0, 0, 0)"
            .to_owned(),
        format!("UPDATE attempts SET status = 'succeeded' WHERE id = '{attempt}'"),
        format!("UPDATE leases SET version = version + 1 WHERE attempt_id = '{attempt}'"),
        format!("INSERT INTO events (id, run_id, kind, payload, at) VALUES ('evt_forged', '{run}', 'run.succeeded', '{{}}', 0)"),
        "UPDATE sessions SET state = 'expired'".to_owned(),
        "UPDATE offers SET state = 'withdrawn'".to_owned(),
        format!("DELETE FROM runs WHERE id = '{run}'"),
        "SELECT * FROM runs".to_owned(),
        "SELECT * FROM audit".to_owned(),
        "UPDATE audit SET outcome = 'rewritten'".to_owned(),
    ];
    for sql in &refused {
        assert_eq!(sqlstate(&ingress, sql).await.as_deref(), Some(INSUFFICIENT_PRIVILEGE), "worker-ingress: {sql}");
    }

    // The runtime role changes state, but never deletes and never rewrites history.
    let runtime = connect(&b.db().runtime_url()).await;
    for sql in [
        format!("DELETE FROM runs WHERE id = '{run}'"),
        format!("UPDATE events SET kind = 'rewritten' WHERE run_id = '{run}'"),
        "DELETE FROM events".to_owned(),
        "UPDATE audit SET outcome = 'rewritten'".to_owned(),
        "DELETE FROM audit".to_owned(),
        // The custom setting the pruning function uses does not open the table either.
        "SET ql.audit_prune = 'on'; DELETE FROM audit".to_owned(),
        "SET ql.run_prune = 'on'; DELETE FROM events".to_owned(),
        "DELETE FROM log_chunks".to_owned(),
        "CREATE TABLE forged (x int)".to_owned(),
    ] {
        assert_eq!(sqlstate(&runtime, &sql).await.as_deref(), Some(INSUFFICIENT_PRIVILEGE), "runtime: {sql}");
    }
    // Even the owner cannot rewrite history (the append-only triggers).
    let owner = connect(&b.db().url("ql_owner")).await;
    assert_eq!(
        sqlstate(&owner, &format!("UPDATE events SET kind = 'rewritten' WHERE run_id = '{run}'")).await.as_deref(),
        Some(INSUFFICIENT_PRIVILEGE)
    );
    // Nor remove an audit record but through the pruning function.
    assert_eq!(sqlstate(&owner, "DELETE FROM audit").await.as_deref(), Some(INSUFFICIENT_PRIVILEGE));
    assert_eq!(sqlstate(&ingress, "SELECT prune_audit(NULL, 0)").await.as_deref(), Some(INSUFFICIENT_PRIVILEGE));
    // Nor an event but with its run, through the run pruning function (the run's events
    // are there to hit; chunks have the same trigger).
    assert_eq!(sqlstate(&owner, "DELETE FROM events").await.as_deref(), Some(INSUFFICIENT_PRIVILEGE));
    let prune = format!("SELECT prune_runs(ARRAY['{run}'], 0)");
    assert_eq!(sqlstate(&ingress, &prune).await.as_deref(), Some(INSUFFICIENT_PRIVILEGE));

    // Nothing the refused statements tried changed anything.
    let d = detail(&store, h.run()).await;
    assert_eq!(d.run.status, ql_control::model::RunStatus::Dispatching);
    assert_eq!(d.leases[0].facts.version.get(), 1);
    assert!(d.events.iter().all(|e| e.id.as_str() != "evt_forged"));

    // A store whose audit records go through the worker-ingress role.
    let offset = Arc::new(AtomicI64::new(0));
    let audited =
        b.db().store(PgOptions { audit_url: Some(b.db().url("ql_worker_ingress")), ..Pg::options(&offset) }).await;
    let rec = AuditRecord {
        at: 0,
        principal: Some(worker("router-1")),
        route: "session.open".into(),
        outcome: "admitted".into(),
    };
    audited.audit(rec.clone()).await.expect("worker-ingress writes audit records through the store");
    assert_eq!(audited.audits().await.unwrap().len(), 2);
    // It reads what admission needs, and nothing of it is refused by its grants.
    assert_eq!(audited.admit(rec.clone(), "0a".into()).await.unwrap(), None);
    let disable = Command::SetAccess(worker("router-1"), ql_control::core::Access::Disable);
    assert!(store.execute(disable).await.unwrap().is_ok());
    assert_eq!(audited.admit(rec, "0a".into()).await.unwrap(), Some(ql_wire::ErrorCode::WorkerDisabled));
    assert_eq!(audited.audits().await.unwrap().last().map(|a| a.outcome.clone()), Some("worker_disabled".into()));
}

#[tokio::test]
async fn a_connection_killed_right_after_a_completion_commits_loses_only_the_reply() {
    let db = TestDb::new("kill").await;
    let offset = Arc::new(AtomicI64::new(0));
    let kill = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let armed = kill.clone();
    let options = PgOptions {
        kill_after_commit: Some(Arc::new(move |cmd: &Command| {
            matches!(cmd, Command::Complete(..)) && armed.swap(false, std::sync::atomic::Ordering::SeqCst)
        })),
        ..Pg::options(&offset)
    };
    let store = db.store(options).await;
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;

    kill.store(true, std::sync::atomic::Ordering::SeqCst);
    let first = store.execute(h.complete(Some(0))).await;
    assert!(first.is_err(), "the first call answers unavailable (a StoreError is 503): {first:?}");
    assert_eq!(
        exec(&store, h.complete(Some(0))).await,
        Ok(completed(Outcome::AlreadyCompleted, TerminalStatus::Succeeded)),
        "the agent's replay finds the committed completion"
    );
    let d = detail(&store, h.run()).await;
    let completion: Vec<&str> = d
        .events
        .iter()
        .map(|e| e.kind.as_str())
        .filter(|k| *k == "attempt.completed" || *k == "run.succeeded")
        .collect();
    assert_eq!(completion, ["attempt.completed", "run.succeeded"], "exactly the two completion events");
    assert_eq!(d.leases[0].state, LeaseState::Completed);
    check_invariants(&store.snapshot().await.unwrap());
}

// Two worker threads: the two sweeps run truly in parallel, not just interleaved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sweeping_at_once_expire_each_lease_once() {
    let b = Pg::new().await;
    let (a, other) = (b.store(), b.other_process());
    const RUNS: usize = 24;
    let agent = open_with(&a, "router-1", RUNS as u32, &[]).await;
    for _ in 0..RUNS {
        submit(&a, LONG_TIMEOUT_MS, 1).await;
    }
    let body = PollOffers { generation: agent.generation, wait_ms: 0, max: RUNS as u32 };
    let all = match exec(&a, Command::PollOffers(agent.worker.clone(), agent.session.clone(), body)).await {
        Ok(Reply::Offers(o, _)) => o.offers,
        other => panic!("poll: {other:?}"),
    };
    assert_eq!(all.len(), RUNS);
    for offer in &all[..RUNS / 2] {
        let h = claim(&a, &agent, offer).await;
        to_starting(&a, &h).await;
    }
    // Past every lease and every unclaimed offer: each replica sweeps, both at once,
    // until neither finds anything.
    b.advance(b.timings().lease_ttl_ms as i64 + 1_000);
    let mut total = 0;
    loop {
        let (x, y) = tokio::join!(sweep(&a), sweep(&other));
        total += x + y;
        if x + y == 0 {
            break;
        }
    }
    assert_eq!(total, RUNS, "every lapsed lease and offer is swept exactly once");
    let snap = a.snapshot().await.unwrap();
    check_invariants(&snap);
    let lost = snap.events.iter().filter(|e| e.kind == "attempt.lost").count();
    assert_eq!(lost, RUNS, "one attempt.lost per attempt");
    assert!(snap.leases.iter().all(|l| l.state == LeaseState::Expired));
    assert!(snap.runs.iter().all(|r| r.status == ql_control::model::RunStatus::Queued));
    let spent: u32 = snap.runs.iter().map(|r| r.retries_used).sum();
    assert_eq!(spent as usize, RUNS / 2, "a lost lease spends a retry, a lapsed offer does not");
}

#[tokio::test]
async fn a_commit_on_one_replica_wakes_the_other() {
    let b = Pg::new().await;
    let (a, other) = (b.store(), b.other_process());
    let mut rx = other.changes();
    // Opening the store bumped the counter once, after its LISTEN took effect.
    rx.borrow_and_update();
    submit(&a, LONG_TIMEOUT_MS, 0).await;
    tokio::time::timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("a submit on one replica wakes the other's long-polls")
        .unwrap();

    // A decision that does not wake (an open, a heartbeat) sends nothing, nor does a
    // refused command. PostgreSQL delivers notifications in the order their transactions
    // committed, so a listener that hears `other`'s submit next heard nothing from them.
    let (_listening, mut heard) = notifications(&b.db().runtime_url()).await;
    submit(&a, LONG_TIMEOUT_MS, 0).await;
    let from_a = next_notification(&mut heard).await;
    let agent = open(&a, "router-1").await;
    assert!(heartbeat(&a, &agent, false).await.is_ok());
    let refusal = exec(&a, Command::Cancel("run_missing".parse().unwrap())).await;
    assert_eq!(refusal, Err(ErrorCode::NotFound));
    submit(&other, LONG_TIMEOUT_MS, 0).await;
    let next = next_notification(&mut heard).await;
    assert_ne!(next, from_a, "an open, a heartbeat or a refusal notified the other replicas");
}

/// A connection of its own that listens on `ql_changes` (it listens while the client is
/// kept), and the payloads of the notifications it hears.
async fn notifications(url: &str) -> (tokio_postgres::Client, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    // The client's statements need the connection polled: this task polls it for good.
    tokio::spawn(async move {
        while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let Ok(tokio_postgres::AsyncMessage::Notification(n)) = message {
                let _ = tx.send(n.payload().to_owned());
            }
        }
    });
    client.batch_execute("LISTEN ql_changes").await.unwrap();
    (client, rx)
}

async fn next_notification(heard: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), heard.recv()).await.expect("a notification").expect("listening")
}

/// A replica serving when another build moves the schema (its `migrate` notifies) stops
/// deciding: every command answers unavailable, naming both versions, and changes
/// nothing, until the version is this build's again; and this build's `migrate`
/// notifies so when it moves the schema.
#[tokio::test]
async fn a_replica_serving_when_the_schema_moves_decides_nothing_until_it_is_back() {
    let db = TestDb::new("moved").await;
    let store = db.store(Pg::options(&Arc::new(AtomicI64::new(0)))).await;
    let owner = connect(&db.url("ql_owner")).await;
    // Its commands have settled what the listener suspected when it began to listen.
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;

    // A newer build's migrate: the version moves on, and the notification says so.
    let last = ql_control::store::postgres::SCHEMA_VERSION;
    let status = "SELECT status FROM attempts WHERE id = $1";
    let attempt = h.path.attempt.as_str();
    let before: String = owner.query_one(status, &[&attempt]).await.unwrap().get(0);
    owner
        .batch_execute("UPDATE ql_schema_version SET version = version + 1; NOTIFY ql_changes, 'schema'")
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let refused = loop {
        match store.run_detail(h.run()).await {
            Err(e) => break e,
            Ok(_) => assert!(std::time::Instant::now() < deadline, "the replica never looked at the schema again"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let newer = format!("schema version {}", last + 1);
    assert!(refused.0.contains(&newer) && refused.0.contains(&last.to_string()), "{refused:?}");
    let answer = store.execute(h.starting()).await;
    assert!(answer.as_ref().is_err_and(|e| e.0.contains(&newer)), "{answer:?}");
    let after: String = owner.query_one(status, &[&attempt]).await.unwrap().get(0);
    assert_eq!(after, before, "nothing decided");

    // The version back at this build's: the replica, reading it on every command while it
    // differs, decides again.
    owner.execute("UPDATE ql_schema_version SET version = $1", &[&last]).await.unwrap();
    assert_eq!(exec(&store, h.starting()).await, Ok(ack(Outcome::Started)));

    // This build's migrate, finding the version before its last, notifies as it commits.
    let (_listening, mut heard) = notifications(&db.url("ql_owner")).await;
    owner.execute("UPDATE ql_schema_version SET version = $1", &[&(last - 1)]).await.unwrap();
    assert_eq!(ql_control::store::postgres::migrate(&db.url("ql_owner")).await.unwrap(), (last - 1, last));
    assert_eq!(next_notification(&mut heard).await, "schema");
}

/// A request whose admission is decided with its command reads it after the command's
/// locks: a worker disabled while the command waited for its attempt's fence is refused,
/// and only the refusal is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_disabled_while_its_command_waits_for_a_lock_is_refused() {
    let b = Pg::new().await;
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    let audits = store.audits().await.unwrap().len();
    let before = store.snapshot().await.unwrap();

    // Another transaction holds the attempt's fence, as a command in flight would.
    let other = connect(&b.db().url("ql_owner")).await;
    let fence = format!("BEGIN; SELECT pg_advisory_xact_lock(hashtextextended('attempt:' || '{}', 0))", h.attempt());
    other.batch_execute(&fence).await.unwrap();
    let record = AuditRecord {
        at: 0,
        principal: Some(worker("router-1")),
        route: "lease.renew".into(),
        outcome: "admitted".into(),
    };
    let renewal = tokio::spawn({
        let (store, cmd) = (store.clone(), h.renew());
        async move { store.execute_audited(cmd, Some(Audit { record, admit: Some("0a".into()) })).await }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = other
            .query_one("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted", &[])
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the renewal never waited for the fence");
        tokio::task::yield_now().await;
    }
    // The worker is disabled in the same transaction that releases the fence.
    other
        .batch_execute(
            "INSERT INTO workers (id, labels, disabled_at, revoked_at, created_at, updated_at) \
             VALUES ('router-1', '{}', 1, NULL, 0, 0) ON CONFLICT (id) DO UPDATE SET disabled_at = 1; COMMIT",
        )
        .await
        .unwrap();

    assert_eq!(renewal.await.unwrap().unwrap(), Err(ErrorCode::WorkerDisabled));
    let after = store.snapshot().await.unwrap();
    assert_eq!(Snapshot { workers: before.workers.clone(), ..after }, before, "nothing but the worker changed");
    let written: Vec<String> = store.audits().await.unwrap()[audits..].iter().map(|a| a.outcome.clone()).collect();
    assert_eq!(written, ["worker_disabled"], "the refusal alone is on record");
}

/// Submits a run that needs the declared labels `agent`; returns its id.
async fn submit_for(store: &ql_control::store::postgres::PgStore, agent: &[(&str, &str)]) -> ql_wire::ids::RunId {
    let agent = agent.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    submit_with(store, LONG_TIMEOUT_MS, 0, std::collections::BTreeMap::new(), agent).await
}

/// The runs a session declaring `labels` is offered from one queue, and the runs it fits
/// in placement order: runs for other workers first, then some it fits and some it does
/// not, interleaved.
async fn placed(labels: &[(&str, &str)]) -> (Vec<ql_wire::ids::RunId>, Vec<ql_wire::ids::RunId>) {
    let b = Pg::new().await;
    let store = b.store();
    for i in 0..40 {
        submit_for(&store, &[("site", &format!("other-{i}"))]).await;
    }
    let mut fitting = Vec::new();
    fitting.push(submit_for(&store, &[("arch", "mipsel"), ("site", "a")]).await);
    submit_for(&store, &[("arch", "arm")]).await;
    fitting.push(submit_for(&store, &[]).await);
    submit_for(&store, &[("arch", "mipsel"), ("site", "b")]).await;
    fitting.push(submit_for(&store, &[("arch", "mipsel")]).await);
    fitting.push(submit_for(&store, &[("site", "a")]).await);
    submit_for(&store, &[("arch", "mipsel"), ("site", "a"), ("gpu", "yes")]).await;
    let agent = open_with(&store, "router-1", 10, labels).await;
    let poll = PollOffers { generation: agent.generation, wait_ms: 0, max: 10 };
    let offered = match exec(&store, Command::PollOffers(agent.worker.clone(), agent.session.clone(), poll)).await {
        Ok(Reply::Offers(o, _)) => o.offers.into_iter().map(|o| o.run_id).collect(),
        other => panic!("poll: {other:?}"),
    };
    let snapshot = store.snapshot().await.unwrap();
    check_invariants(&snapshot);
    // Placement's order is (submitted at, id): runs submitted in one millisecond go by id.
    let order = |id: &ql_wire::ids::RunId| {
        let run = snapshot.runs.iter().find(|r| &r.id == id).expect("a submitted run");
        (run.created_at, run.id.clone())
    };
    fitting.sort_by_key(order);
    (offered, fitting)
}

/// Placement looks runs up by every subset of a session's labels: it offers exactly the
/// runs those labels cover, oldest first, past runs waiting for other workers; a session
/// declaring more labels than it probes subsets for is matched by the walk of the label sets queued,
/// with the same answer.
#[tokio::test]
async fn placement_offers_exactly_the_runs_a_sessions_labels_cover_oldest_first() {
    let (offered, fitting) = placed(&[("arch", "mipsel"), ("site", "a")]).await;
    assert_eq!(offered, fitting, "by subsets");
    let many = [("arch", "mipsel"), ("site", "a"), ("x1", "1"), ("x2", "2"), ("x3", "3"), ("x4", "4"), ("x5", "5")];
    assert!(many.len() > ql_control::core::SUBSET_LABELS);
    let (offered, fitting) = placed(&many).await;
    assert_eq!(offered, fitting, "by the walk");
}

const CHECK_VIOLATION: &str = "23514";
/// Text that must be JSON and is not fails its cast.
const NOT_JSON: &str = "22P02";

/// The SQLSTATE and the constraint named by the error of a statement `client` runs, or
/// `None` when it succeeds.
async fn refusal(client: &tokio_postgres::Client, sql: &str) -> Option<(String, Option<String>)> {
    let e = client.batch_execute(sql).await.err()?;
    let db = e.as_db_error();
    Some((
        db.map_or_else(|| e.to_string(), |d| d.code().code().to_owned()),
        db.and_then(|d| d.constraint().map(str::to_owned)),
    ))
}

/// The hot tables' rules (migration 0014 moved most of them from CHECK constraints into
/// row triggers that fire only for the columns they are about): each one refuses a row
/// that breaks it as a check violation naming the constraint it was, when an UPDATE sets
/// that column alone (so every rule's column is in its trigger's list) and on INSERT;
/// nothing of a refused statement is written; an update that leaves a costly column as it
/// was, or sets it anew within the rule, still passes.
#[tokio::test]
async fn a_row_that_breaks_a_hot_tables_rule_is_refused_and_changes_nothing() {
    let b = Pg::new().await;
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    let (run, attempt) = (h.run().as_str().to_owned(), h.attempt().as_str().to_owned());
    let before = store.snapshot().await.unwrap();
    let runtime = connect(&b.db().runtime_url()).await;
    let digest = "0".repeat(64);
    let at_run = format!("WHERE id = '{run}'");
    let at_attempt = format!("WHERE id = '{attempt}'");
    let at_lease = format!("WHERE attempt_id = '{attempt}'");
    let refused = [
        ("sessions_generation_check", "UPDATE sessions SET generation = 0".to_owned()),
        ("sessions_capacity_check", "UPDATE sessions SET capacity = -1".to_owned()),
        ("sessions_state_check", "UPDATE sessions SET state = 'asleep'".to_owned()),
        ("sessions_labels_check", "UPDATE sessions SET labels = '[]'".to_owned()),
        ("sessions_offered_check", "UPDATE sessions SET offered = 2".to_owned()),
        ("runs_status_check", format!("UPDATE runs SET status = 'paused' {at_run}")),
        ("runs_stop_check", format!("UPDATE runs SET stop = 'halt' {at_run}")),
        ("runs_retry_budget_check", format!("UPDATE runs SET retry_budget = -1 {at_run}")),
        ("runs_retries_used_check", format!("UPDATE runs SET retries_used = -1 {at_run}")),
        ("runs_attempts_check", format!("UPDATE runs SET attempts = -1 {at_run}")),
        ("runs_lease_generations_check", format!("UPDATE runs SET lease_generations = -1 {at_run}")),
        ("runs_labels_check", format!("UPDATE runs SET labels = '1' {at_run}")),
        ("runs_agent_labels_check", format!("UPDATE runs SET agent_labels = '\"x\"' {at_run}")),
        ("attempts_number_check", format!("UPDATE attempts SET number = 0 {at_attempt}")),
        ("attempts_status_check", format!("UPDATE attempts SET status = 'paused' {at_attempt}")),
        ("attempts_end_kind_check", format!("UPDATE attempts SET end_kind = 'vanished' {at_attempt}")),
        ("attempts_log_acked_check", format!("UPDATE attempts SET log_acked = -1 {at_attempt}")),
        ("attempts_log_sealed_check", format!("UPDATE attempts SET log_sealed = 2 {at_attempt}")),
        ("attempts_lease_token_digest_check", format!("UPDATE attempts SET lease_token_digest = 'ABC' {at_attempt}")),
        ("attempts_callback_digest_check", format!("UPDATE attempts SET callback_digest = 'xyz' {at_attempt}")),
        ("attempts_check", format!("UPDATE attempts SET lease_version = NULL {at_attempt}")),
        ("attempts_check", format!("UPDATE attempts SET lease_expires_at = NULL {at_attempt}")),
        ("attempts_check", format!("UPDATE attempts SET lease_worker = NULL {at_attempt}")),
        ("offers_state_check", "UPDATE offers SET state = 'lost'".to_owned()),
        ("offers_check", "UPDATE offers SET claim_lease_generation = NULL".to_owned()),
        ("offers_check", "UPDATE offers SET claim_lease_expires_at = NULL".to_owned()),
        ("offers_check", "UPDATE offers SET claim_lease_ttl_ms = NULL".to_owned()),
        ("offers_claim_token_digest_check", "UPDATE offers SET claim_token_digest = 'nope'".to_owned()),
        ("leases_state_check", format!("UPDATE leases SET state = 'stolen' {at_lease}")),
        ("leases_version_check", format!("UPDATE leases SET version = 0 {at_lease}")),
        ("leases_token_digest_check", format!("UPDATE leases SET token_digest = upper('{digest}a') {at_lease}")),
    ];
    // On INSERT too: a copy of a real row (in a temporary table) with one value broken.
    let copy = |table: &str, key: &str, set: &str| {
        format!(
            "CREATE TEMP TABLE t AS SELECT * FROM {table} LIMIT 1; UPDATE t SET {key} = {key} || '_copy', {set}; \
             INSERT INTO {table} SELECT * FROM t"
        )
    };
    let inserted = [
        ("sessions_state_check", copy("sessions", "id", "generation = 99, state = 'asleep'")),
        ("runs_status_check", copy("runs", "id", "status = 'paused'")),
        ("attempts_callback_digest_check", copy("attempts", "id", "number = 99, callback_digest = 'xyz'")),
        ("offers_claim_token_digest_check", copy("offers", "id", "claim_token_digest = 'nope'")),
        ("leases_token_digest_check", copy("leases", "attempt_id", "lease_generation = 99, token_digest = 'x'")),
    ];
    for (constraint, sql) in refused.iter().chain(&inserted) {
        let expected = Some((CHECK_VIOLATION.to_owned(), Some((*constraint).to_owned())));
        assert_eq!(refusal(&runtime, sql).await, expected, "{sql}");
    }
    let not_json = [
        format!("UPDATE runs SET spec = 'not json' {at_run}"),
        copy("runs", "id", "spec = '{'"),
        format!("UPDATE attempts SET artifact = '{{' {at_attempt}"),
        format!("UPDATE attempts SET claimed_artifact = '[' {at_attempt}"),
    ];
    for sql in &not_json {
        assert_eq!(refusal(&runtime, sql).await.map(|r| r.0).as_deref(), Some(NOT_JSON), "{sql}");
    }
    assert_eq!(store.snapshot().await.unwrap(), before, "a refused statement changed something");
    // Rows within the rules still write, a costly column left as it was or set anew.
    for sql in [
        format!("UPDATE runs SET spec = spec, summary = 'kept' {at_run}"),
        format!("UPDATE leases SET token_digest = '{digest}' {at_lease}"),
        format!("UPDATE attempts SET artifact = '{{}}' {at_attempt}"),
    ] {
        assert_eq!(refusal(&runtime, &sql).await, None, "{sql}");
    }
}

/// Rows of `runs` a plan node and its children read: what they returned and what their
/// filters removed, over every loop (EXPLAIN gives per-loop averages).
fn runs_rows_read(node: &serde_json::Value) -> f64 {
    rows_read(node, "runs")
}

/// The rows of `table` a plan read, as [`runs_rows_read`] counts them.
fn rows_read(node: &serde_json::Value, table: &str) -> f64 {
    let n = |k: &str| node.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    let own = if node.get("Relation Name").and_then(|r| r.as_str()) == Some(table) {
        (n("Actual Rows") + n("Rows Removed by Filter") + n("Rows Removed by Index Recheck")) * n("Actual Loops")
    } else {
        0.0
    };
    let children =
        node.get("Plans").and_then(|p| p.as_array()).map_or(0.0, |p| p.iter().map(|c| rows_read(c, table)).sum());
    own + children
}

/// `n` runs queued for agents declaring `agent_labels` (JSON), as the owner, analysed.
async fn queue_runs(owner: &tokio_postgres::Client, n: u32, agent_labels: &str) {
    let sql = format!(
        "INSERT INTO runs (id, project, spec, labels, agent_labels, status, retry_budget, retries_used, attempts, \
         lease_generations, created_at) SELECT 'run_' || g, 'default', '{{}}', '{{}}', '{agent_labels}', \
         'queued', 0, 0, 0, 0, g FROM generate_series(1, {n}) g; ANALYZE runs"
    );
    owner.batch_execute(&sql).await.unwrap();
}

/// The plan of `EXPLAIN (ANALYZE, FORMAT JSON) {statement}`, run on `client`.
async fn analysed(client: &tokio_postgres::Client, statement: &str) -> serde_json::Value {
    let text = client
        .simple_query(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {statement}"))
        .await
        .unwrap()
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .expect("a plan");
    let explained: serde_json::Value = serde_json::from_str(&text).unwrap();
    explained[0]["Plan"].clone()
}

/// Every update of loaded rows counts them inside its transaction ([`checked_text`]), so
/// a transaction's last writes and its COMMIT share one pipeline: one that finds fewer
/// rows than it was due fails (SQLSTATE XX001, naming the table and the count), the
/// COMMIT behind it rolls back, and nothing written before it in the transaction is
/// kept; one that finds them all commits.
#[tokio::test]
async fn an_update_short_of_its_rows_aborts_the_commit_sent_behind_it() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    queue_runs(&owner, 2, "{}").await;
    let runtime = connect(&b.db().url("ql_runtime")).await;
    let update = "UPDATE runs SET summary = $2 WHERE id = $1 RETURNING 1";
    let update = ql_control::store::postgres::merged_update(update, &[Type::TEXT, Type::TEXT], 2).unwrap();
    let update = runtime.prepare(&checked_text(&update, 2)).await.unwrap();
    let audit = runtime.prepare("INSERT INTO audit (at, principal, route, outcome) VALUES (1, NULL, 'test', 'ok')");
    let audit = audit.await.unwrap();
    let state = || async {
        let audits: i64 = owner.query_one("SELECT count(*) FROM audit", &[]).await.unwrap().get(0);
        let rows = owner.query("SELECT id, summary FROM runs ORDER BY id", &[]).await.unwrap();
        let runs: Vec<(String, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        (audits, runs)
    };
    // BEGIN, an audit record, the update of run_1 and `second`, COMMIT: one pipeline.
    let pipeline = |second: &'static str| {
        let (runtime, audit, update) = (&runtime, &audit, &update);
        async move {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&"run_1", &"done", &second, &"done"];
            let (begin, audited, updated, commit) = tokio::join!(
                runtime.simple_query("BEGIN"),
                runtime.execute(audit, &[]),
                runtime.query(update, &params),
                runtime.simple_query("COMMIT"),
            );
            begin.unwrap();
            audited.unwrap();
            commit.expect("the COMMIT answers, as a rollback after a failed statement");
            updated
        }
    };
    let before = state().await;

    let refused = pipeline("run_none").await.expect_err("one of the two runs is not there");
    let db = refused.as_db_error().expect("PostgreSQL refused it");
    assert_eq!(db.code().code(), "XX001", "{db:?}");
    assert_eq!(db.message(), "an update of runs found 1 of the 2 rows it had loaded");
    assert_eq!(state().await, before, "nothing of the transaction was kept: the COMMIT rolled back");

    let written = pipeline("run_2").await.expect("both runs are there");
    assert_eq!(written[0].get::<_, i64>(0), 2);
    let (audits, runs) = state().await;
    assert_eq!(audits, before.0 + 1, "the audit record committed");
    assert!(runs.iter().all(|(_, summary)| summary.as_deref() == Some("done")), "{runs:?}");
}

/// A wave locks each command's run by a probe of the runs' key, on the plan the store
/// runs it on, however few runs the table holds: with `id = ANY($1)` PostgreSQL guessed
/// ten rows and read a table of a few hundred runs whole.
#[tokio::test]
async fn a_waves_load_reads_only_the_runs_it_names() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    queue_runs(&owner, 300, "{}").await;
    let lock = ql_control::store::postgres::WAVE_RUNS.as_str();
    owner
        .batch_execute(&format!("PREPARE lock (text[]) AS {lock}; SET plan_cache_mode = force_generic_plan; BEGIN"))
        .await
        .unwrap();
    let plan = &analysed(&owner, "EXECUTE lock(ARRAY['run_12', 'run_150', 'run_299', 'run_none'])").await;
    assert_eq!(plan["Actual Rows"].as_f64(), Some(3.0), "the three runs that exist: {plan}");
    // EXPLAIN rounds each probe's rows to a whole one: at most one per key named.
    let read = runs_rows_read(plan);
    assert!(read <= 4.0, "the lock read {read} runs for four keys: {plan}");
}

/// The keys every command probes compare byte for byte (migration 0019), as SQLite's
/// do, whatever the database's collation: each column is "C", and so is `events_once`,
/// whose key is an expression of one.
#[tokio::test]
async fn the_keys_of_the_hot_tables_compare_byte_for_byte() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    let keys = [
        ("sessions", "id"),
        ("sessions", "worker"),
        ("runs", "id"),
        ("runs", "current_attempt_id"),
        ("attempts", "id"),
        ("attempts", "run_id"),
        ("attempts", "offer_id"),
        ("attempts", "session_id"),
        ("leases", "attempt_id"),
        ("leases", "run_id"),
        ("offers", "id"),
        ("offers", "run_id"),
        ("offers", "attempt_id"),
        ("offers", "session_id"),
        ("events", "id"),
        ("events", "run_id"),
        ("events", "attempt_id"),
        ("events", "kind"),
        ("log_chunks", "attempt_id"),
        ("deliveries", "run_id"),
        ("workers", "id"),
        ("certificates", "serial"),
        ("certificates", "worker"),
    ];
    let collation = "SELECT c.collname::text FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation \
                     WHERE a.attrelid = $1::text::regclass AND a.attname = $2";
    for (table, column) in keys {
        let name: String = owner.query_one(collation, &[&table, &column]).await.unwrap().get(0);
        assert_eq!(name, "C", "{table}.{column}");
    }
    let index = "SELECT c.collname::text FROM pg_index i, unnest(i.indcollation) AS k (oid) \
                 JOIN pg_collation c ON c.oid = k.oid WHERE i.indexrelid = 'events_once'::regclass";
    let names: Vec<String> = owner.query(index, &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(names, ["C", "C", "C"], "events_once (run_id, COALESCE(attempt_id, ''), kind)");
}

/// A wave of completions reads each attempt's completion event by a probe of the
/// events' unique key, on the generic plan it runs on, however many events other
/// attempts have: 2,000 attempts with three events each, four named.
#[tokio::test]
async fn a_waves_completion_events_are_read_by_a_probe_of_each_attempt() {
    use ql_control::core::COMPLETION_EVENT;
    use ql_control::store::postgres::COMPLETION_EVENTS_OF;
    let b = Pg::new().await;
    let admin = connect(&b.db().url("postgres")).await;
    // Rows alone, without the runs and the rules behind them (replica role: no triggers).
    admin
        .batch_execute(&format!(
            "SET session_replication_role = replica; \
             INSERT INTO attempts (id, run_id, number, executor_type, status, offer_id, session_id, worker, created_at) \
             SELECT 'a_' || g, 'r_' || g, 1, 'shell', 'succeeded', 'o_' || g, 's_' || g, 'w_' || g, g \
             FROM generate_series(1, 2000) g; \
             INSERT INTO events (id, run_id, attempt_id, kind, payload, at) \
             SELECT 'e_' || k || '_' || g, 'r_' || g, 'a_' || g, k, '{{}}', g \
             FROM generate_series(1, 2000) g, unnest(ARRAY['attempt.started', 'attempt.running', '{COMPLETION_EVENT}']) k; \
             ANALYZE attempts, events"
        ))
        .await
        .unwrap();
    let owner = connect(&b.db().url("ql_owner")).await;
    let events = COMPLETION_EVENTS_OF.as_str();
    owner
        .batch_execute(&format!("PREPARE events (text[], text) AS {events}; SET plan_cache_mode = force_generic_plan"))
        .await
        .unwrap();
    let keys = "ARRAY['a_12', 'a_150', 'a_1999', 'a_none']";
    let plan = &analysed(&owner, &format!("EXECUTE events({keys}, '{COMPLETION_EVENT}')")).await;
    assert_eq!(plan["Actual Rows"].as_f64(), Some(3.0), "the three attempts' completion events: {plan}");
    for table in ["events", "attempts"] {
        let read = rows_read(plan, table);
        assert!(read <= 4.0, "{table}: read {read} rows for four keys: {plan}");
    }
}

/// A wave of polls reads each session's worker, active attempts and open offers by a
/// probe of its key, on the generic plans it runs on, however many rows other sessions
/// have: 2,000 sessions with an active attempt and an open offer each, and four named
/// (on a table of a few pages, a scan of it costs about what a probe does, and
/// PostgreSQL may take either).
#[tokio::test]
async fn a_wave_of_polls_first_load_reads_only_the_rows_of_the_sessions_it_names() {
    use ql_control::store::postgres::{ACTIVE_ATTEMPTS_OF, OPEN_OFFERS_OF, WORKERS_OF};
    let b = Pg::new().await;
    let admin = connect(&b.db().url("postgres")).await;
    // Rows alone, without the runs and the rules behind them (replica role: no triggers).
    admin
        .batch_execute(
            "SET session_replication_role = replica; \
             INSERT INTO workers (id, labels, created_at, updated_at) SELECT 'w_' || g, '{}', g, g \
             FROM generate_series(1, 2000) g; \
             INSERT INTO attempts (id, run_id, number, executor_type, status, offer_id, session_id, worker, created_at) \
             SELECT 'a_' || g, 'r_' || g, 1, 'shell', 'running', 'o_' || g, 's_' || g, 'w_' || g, g \
             FROM generate_series(1, 2000) g; \
             INSERT INTO offers (id, run_id, attempt_id, worker, session_id, session_generation, state, expires_at) \
             SELECT 'o_' || g, 'r_' || g, 'a_' || g, 'w_' || g, 's_' || g, 1, 'open', g FROM generate_series(1, 2000) g; \
             ANALYZE workers, attempts, offers",
        )
        .await
        .unwrap();
    let owner = connect(&b.db().url("ql_owner")).await;
    owner.batch_execute("SET plan_cache_mode = force_generic_plan").await.unwrap();
    for (i, (table, sql, prefix)) in [
        ("workers", WORKERS_OF.as_str(), "w"),
        ("attempts", ACTIVE_ATTEMPTS_OF, "s"),
        ("offers", OPEN_OFFERS_OF.as_str(), "s"),
    ]
    .into_iter()
    .enumerate()
    {
        owner.batch_execute(&format!("PREPARE first_{i} (text[]) AS {sql}")).await.unwrap();
        let keys = format!("ARRAY['{prefix}_12', '{prefix}_150', '{prefix}_1999', '{prefix}_none']");
        let plan = &analysed(&owner, &format!("EXECUTE first_{i}({keys})")).await;
        let read = rows_read(plan, table);
        assert!(read <= 4.0, "{table}: read {read} rows for four keys: {plan}");
        assert!(read >= 3.0, "{table}: the three keys' rows are found: {plan}");
    }
}

/// A wave's fences put the rest of its transaction on generic plans, and only its
/// transaction: PostgreSQL planned every level's lock afresh in every wave, its planning
/// costing more than the lock (the probes of the test above are the generic plan).
#[tokio::test]
async fn a_waves_fences_set_generic_plans_until_its_transaction_ends() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    let show = "SHOW plan_cache_mode";
    let get = |rows: Vec<tokio_postgres::Row>| rows[0].get::<_, String>(0);
    assert_eq!(get(owner.query(show, &[]).await.unwrap()), "auto");
    owner.batch_execute("BEGIN").await.unwrap();
    let fences = ql_control::store::postgres::WAVE_FENCES;
    let attempts = vec!["att_1".to_owned(), "att_2".to_owned()];
    assert_eq!(owner.query(fences, &[&attempts]).await.unwrap().len(), 2, "a fence per attempt");
    assert_eq!(get(owner.query(show, &[]).await.unwrap()), "force_generic_plan");
    owner.batch_execute("COMMIT").await.unwrap();
    assert_eq!(get(owner.query(show, &[]).await.unwrap()), "auto", "for the wave's transaction only");
}

/// A wave's one update of several commands' runs finds each by a probe of the runs'
/// key even on a generic plan made while the table held a few runs and was never
/// analysed, as a one-row update does. A connection keeps that plan while the table
/// grows, until it is analysed: joined on the key, it read the table whole in every
/// wave (a hash join over a sequential scan: 0.24–0.27 ms a statement as the attempts
/// and leases grew to 2,480 rows, against 0.05 ms on a key probe).
#[tokio::test]
async fn a_waves_merged_update_probes_the_key_of_a_table_never_analysed() {
    use tokio_postgres::types::Type;
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    let one = "UPDATE runs SET status = $2, started_at = $3 WHERE id = $1 RETURNING 1";
    let merged = ql_control::store::postgres::merged_update(one, &[Type::TEXT, Type::TEXT, Type::INT8], 4).unwrap();
    let types = ["text", "text", "int8"].repeat(4).join(", ");
    owner
        .batch_execute(&format!(
            "INSERT INTO runs (id, project, spec, labels, agent_labels, status, retry_budget, retries_used, \
             attempts, lease_generations, created_at) SELECT 'run_' || g, 'default', '{{}}', '{{}}', '{{}}', \
             'queued', 0, 0, 0, 0, g FROM generate_series(1, 3) g; \
             SET plan_cache_mode = force_generic_plan; PREPARE w ({types}) AS {merged}; BEGIN"
        ))
        .await
        .unwrap();
    let args = ["run_1", "run_3", "run_2", "run_none"].map(|id| format!("'{id}', 'queued', 1")).join(", ");
    let plan = &analysed(&owner, &format!("EXECUTE w({args})")).await;
    assert_eq!(plan["Actual Rows"].as_f64(), Some(3.0), "the three runs that exist: {plan}");
    let mut scans = Vec::new();
    scans_of(plan, &mut scans);
    assert!(!scans.is_empty(), "{plan}");
    assert!(scans.iter().all(|s| s != "Seq Scan"), "the update scanned runs by {scans:?}: {plan}");
}

/// The kind of every node of `node` and its children that reads `runs`, but the update.
fn scans_of(node: &serde_json::Value, out: &mut Vec<String>) {
    let kind = node["Node Type"].as_str().unwrap_or_default();
    if node["Relation Name"].as_str() == Some("runs") && kind != "ModifyTable" {
        out.push(kind.to_owned());
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        scans_of(child, out);
    }
}

/// A poll's queue probe, on the plan the store runs it on, reads only the runs of the
/// session's label sets, up to its room, however many runs wait for other workers, even
/// when every queued run has the same labels (where PostgreSQL, comparing with `=`,
/// guessed that all of them match any set and walked the queue in age order).
#[tokio::test]
async fn a_polls_queue_probe_reads_no_run_queued_for_other_label_sets() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    queue_runs(&owner, 2000, r#"{"arch":"mipsel"}"#).await;
    prepare_probe(&owner).await;
    // (the session's label sets, its room, the runs it is offered)
    for (sets, room, offered) in [
        (r#"ARRAY['{}', '{"arch":"arm"}']"#, 4.0, 0.0),
        (r#"ARRAY['{}', '{"arch":"mipsel"}']"#, 4.0, 4.0),
        (r#"ARRAY['{}', '{"arch":"mipsel"}']"#, 1.0, 1.0),
    ] {
        let plan = &analysed(&owner, &format!("EXECUTE probe('{{}}', {sets}, {room})")).await;
        assert_eq!(plan["Actual Rows"].as_f64(), Some(offered), "{sets}, room {room}");
        let read = runs_rows_read(plan);
        assert!(read <= room * 2.0, "{sets}, room {room}: the probe read {read} queued runs: {plan}");
        // A wave's probes as one: this poll's sets, and another poll's that fit no run.
        let others = r#"ARRAY['{}', '{"arch":"arm"}']"#;
        let probes = format!(
            "EXECUTE probes(ARRAY[0, 0, 1, 1], ARRAY['{{}}', '{{}}', '{{}}', '{{}}'], {sets} || {others}, \
             ARRAY[{room}, {room}, {room}, {room}]::bigint[])"
        );
        let plan = &analysed(&owner, &probes).await;
        assert_eq!(plan["Actual Rows"].as_f64(), Some(offered), "{sets}, room {room}, in a wave");
        let read = runs_rows_read(plan);
        assert!(read <= room * 2.0, "{sets}, room {room}: the wave's probe read {read} queued runs: {plan}");
    }
}

/// The same when PostgreSQL's statistics were taken while the queue was empty, as
/// autovacuum takes them between bursts, and the queue filled afterwards: the generic
/// plan still probes by label set. While a second index of the queue by age alone
/// existed (until migration 0018), PostgreSQL found that smaller index as cheap for a
/// queue it believed empty, and every poll read every queued run.
#[tokio::test]
async fn a_polls_queue_probe_reads_by_label_set_after_statistics_of_an_empty_queue() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    owner
        .batch_execute(
            "INSERT INTO runs (id, project, spec, labels, agent_labels, status, retry_budget, retries_used, \
             attempts, lease_generations, created_at) SELECT 'run_done_' || lpad(g::text, 20, '0'), 'default', '{}', \
             '{}', jsonb_build_object('arch', 'arm', 'shard', g % 8), 'queued', 0, 0, 0, 0, g \
             FROM generate_series(1, 5000) g; \
             UPDATE runs SET status = 'succeeded'",
        )
        .await
        .unwrap();
    // Run, and ended: the queue's indexes keep the pages they grew to, empty.
    owner.batch_execute("VACUUM ANALYZE runs").await.unwrap();
    owner
        .batch_execute(
            "INSERT INTO runs (id, project, spec, labels, agent_labels, status, retry_budget, retries_used, \
             attempts, lease_generations, created_at) SELECT CASE WHEN g % 1000 = 0 THEN 'mine_' ELSE 'other_' END || g, \
             'default', '{}', '{}', CASE WHEN g % 1000 = 0 THEN '{\"arch\":\"arm\"}' ELSE '{\"arch\":\"mipsel\"}' END::jsonb, \
             'queued', 0, 0, 0, 0, 5000 + g FROM generate_series(1, 2000) g",
        )
        .await
        .unwrap();
    prepare_probe(&owner).await;
    let plan = &analysed(&owner, r#"EXECUTE probe('{}', ARRAY['{}', '{"arch":"arm"}'], 4)"#).await;
    assert_eq!(plan["Actual Rows"].as_f64(), Some(2.0), "the two runs queued for arm: {plan}");
    let read = runs_rows_read(plan);
    assert!(read <= 8.0, "the probe read {read} queued runs: {plan}");
}

/// A renewal and the revocation of its certificate's line with its renewals, sent
/// together: both take the worker's lock, so whichever commits first, the other sees it.
/// Either the renewal is refused (the certificate it presents is revoked) or the
/// certificate it recorded is revoked with the line: a renewed certificate never serves
/// on from a revoked line.
#[tokio::test]
async fn a_renewal_racing_the_revocation_of_its_line_never_outlives_it() {
    use ql_control::core::Issuer;
    use ql_control::model::Certificate;
    let b = Pg::new().await;
    let (store, replica) = (b.store(), b.other_process());
    let cert = |serial: &str| Certificate {
        serial: serial.into(),
        worker: worker("router-1"),
        issued_at: 0,
        not_after: i64::MAX / 2,
        revoked_at: None,
        renewed_from: None,
    };
    let mut outcomes = (0, 0);
    for round in 0..40 {
        let (old, new) = (format!("{round:02x}00"), format!("{round:02x}01"));
        exec(&store, Command::RecordCertificate(cert(&old), Issuer::Operator)).await.unwrap();
        let renewal = exec(&store, Command::RecordCertificate(cert(&new), Issuer::Worker(old.clone())));
        let revocation = exec(&replica, Command::RevokeCertificate(worker("router-1"), old.clone(), true));
        let (renewed, revoked) = tokio::join!(renewal, revocation);
        assert!(matches!(revoked, Ok(Reply::CertificateRevoked(..))), "round {round}: {revoked:?}");
        let all = store.certificates(None, None, 1_000).await.unwrap();
        let recorded = all.iter().find(|c| c.serial == new);
        match renewed {
            Ok(Reply::CertificateRecorded(_)) => {
                let recorded = recorded.expect("a recorded renewal is on record");
                assert!(recorded.revoked_at.is_some(), "round {round}: the renewal outlived its line: {recorded:?}");
                outcomes.0 += 1;
            }
            Err(ErrorCode::CertificateRevoked) => {
                assert!(recorded.is_none(), "round {round}: a refused renewal recorded nothing");
                outcomes.1 += 1;
            }
            other => panic!("round {round}: {other:?}"),
        }
        // The next round's renewal is not held back by this one's.
        b.advance(RENEW_INTERVAL_MS as i64);
    }
    assert_eq!(outcomes.0 + outcomes.1, 40, "{outcomes:?}");
}

/// A window of a long live log reads the chunk rows that hold its bytes, and one more
/// probe, not every row: what a repeated chunk and an operator's reader of a window ask
/// for, however small the chunks a worker sent.
#[tokio::test]
async fn a_live_log_window_reads_only_the_chunks_that_hold_its_bytes() {
    let b = Pg::new().await;
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    let owner = connect(&b.db().url("ql_owner")).await;
    let attempt = h.attempt().as_str();
    owner
        .batch_execute(&format!(
            "INSERT INTO log_chunks (attempt_id, byte_offset, length, sha256) \
             SELECT '{attempt}', g, 1, repeat('0', 64) FROM generate_series(0, 99999) g; ANALYZE log_chunks"
        ))
        .await
        .unwrap();
    let sql = ql_control::store::log_chunks_sql('$');
    owner
        .batch_execute(&format!(
            "PREPARE log_window (text, bigint, bigint) AS {sql}; SET plan_cache_mode = force_generic_plan"
        ))
        .await
        .unwrap();
    // (the window, the chunks that hold its bytes)
    for (within, held) in [(50_000..50_003, 3.0), (0..1, 1.0), (99_999..200_000, 1.0), (100_000..100_001, 0.0)] {
        let [from, to] = ql_control::store::log_chunk_bounds(&within);
        let plan = &analysed(&owner, &format!("EXECUTE log_window('{attempt}', {from}, {to})")).await;
        assert_eq!(plan["Actual Rows"].as_f64(), Some(held), "{within:?}: {plan}");
        let read = rows_read(plan, "log_chunks");
        assert!(read <= held + 2.0, "{within:?}: the window read {read} chunk rows: {plan}");
    }
    let all = store.log_chunks(h.attempt(), ql_control::store::ALL_CHUNKS).await.unwrap();
    assert_eq!(all.len(), 100_000, "all of them, when asked for all");
}

/// A session declaring more labels than placement probes subsets for: its probe walks the
/// label sets queued, one index step each, and reads the runs of only those within its
/// labels, up to its room, however many runs wait for other label sets.
#[tokio::test]
async fn a_probe_for_many_declared_labels_reads_each_queued_label_set_once_not_every_run() {
    let b = Pg::new().await;
    let owner = connect(&b.db().url("ql_owner")).await;
    queue_runs(&owner, 2000, r#"{"arch":"mipsel"}"#).await;
    owner
        .batch_execute(
            "INSERT INTO runs (id, project, spec, labels, agent_labels, status, retry_budget, retries_used, \
             attempts, lease_generations, created_at) SELECT 'mine_' || g, 'default', '{}', '{}', \
             jsonb_build_object('arch', 'arm', 'x' || (g % 3), '1'), 'queued', 0, 0, 0, 0, 3000 + g \
             FROM generate_series(1, 30) g; ANALYZE runs",
        )
        .await
        .unwrap();
    let walk = ql_control::store::postgres::QUEUE_WALK.as_str();
    owner
        .batch_execute(&format!(
            "PREPARE walk (text, text, bigint) AS {walk}; SET plan_cache_mode = force_generic_plan"
        ))
        .await
        .unwrap();
    let many = r#"{"arch":"arm","x0":"1","x1":"1","a":"1","b":"1","c":"1","d":"1"}"#;
    // Four label sets queued: mipsel's, and arm's with x0, x1 or x2 (ten runs each); the
    // session takes two. The walk reads one run a set (five steps at most), then the two
    // sets' runs up to the room each: a read of x2's runs, or of the queue, would show.
    // (its labels, its room, the runs it is offered, the most runs it may read)
    let riscv = r#"{"arch":"riscv"}"#;
    for (declared, room, offered, most) in [(many, 4, 4.0, 13.0), (many, 100, 20.0, 25.0), (riscv, 4, 0.0, 5.0)] {
        let plan = &analysed(&owner, &format!("EXECUTE walk('{{}}', '{declared}', {room})")).await;
        assert_eq!(plan["Actual Rows"].as_f64(), Some(offered), "{declared}, room {room}: {plan}");
        let read = runs_rows_read(plan);
        assert!(read <= most, "{declared}, room {room}: the walk read {read} runs: {plan}");
    }
}

/// Prepares the queue probe as `probe`, and a wave's probes as `probes`, on `client`, on
/// the generic plans the store runs.
async fn prepare_probe(client: &tokio_postgres::Client) {
    let probe = ql_control::store::postgres::QUEUE_PROBE.as_str();
    let probes = ql_control::store::postgres::QUEUE_PROBES_OF.as_str();
    client
        .batch_execute(&format!(
            "PREPARE probe (text, text[], bigint) AS {probe}; \
             PREPARE probes (bigint[], text[], text[], bigint[]) AS {probes}; \
             SET plan_cache_mode = force_generic_plan"
        ))
        .await
        .unwrap();
}

/// A store on `b`'s database with one lane: every session's commands share it.
async fn one_lane(b: &Pg) -> PgStore {
    b.db().store(PgOptions { lanes: 1, ..Pg::options(&Arc::new(AtomicI64::new(0))) }).await
}

/// Asserts that since `before` one transaction carried `n` commands, none run again alone.
fn one_group_since(store: &PgStore, before: GroupCommits, n: u64, what: &str) {
    let after = store.group_commits();
    assert_eq!(
        (after.transactions - before.transactions, after.commands - before.commands, after.run_alone),
        (1, n, 0),
        "{what}: {after:?}"
    );
}

/// Four agents, each holding a claimed attempt of a run of its own.
async fn four_held(store: &PgStore) -> Vec<Held> {
    let mut held = Vec::new();
    for i in 0..4 {
        held.push(claimed_run(store, &format!("router-{i}"), LONG_TIMEOUT_MS, 0).await);
    }
    held
}

/// The four agents' `starting`, sent at once: on this single-threaded runtime all four
/// are queued on the lane before it runs, so it takes them as one group.
async fn starting_at_once(
    store: &PgStore,
    h: &[Held],
) -> [Result<Result<Reply, ErrorCode>, ql_control::store::StoreError>; 4] {
    let (a, b, c, d) = tokio::join!(
        store.execute(h[0].starting()),
        store.execute(h[1].starting()),
        store.execute(h[2].starting()),
        store.execute(h[3].starting()),
    );
    [a, b, c, d]
}

#[tokio::test]
async fn commands_of_concurrent_agents_commit_together_each_with_its_own_answer() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let h = four_held(&store).await;
    let before = store.group_commits();

    let answers = starting_at_once(&store, &h).await;
    for answer in answers {
        assert_eq!(answer.unwrap(), Ok(ack(Outcome::Started)));
    }
    one_group_since(&store, before, 4, "one transaction carried the four commands");
    for held in &h {
        let d = detail(&store, held.run()).await;
        assert_eq!(d.attempts[0].status, AttemptStatus::Starting);
        assert_eq!(d.events.iter().filter(|e| e.kind == "attempt.starting").count(), 1);
    }
    check_invariants(&store.snapshot().await.unwrap());
}

/// Lanes fill in turn: with room for two commands in flight on each, four agents'
/// commands at once go two by two to the first two lanes of three; with room for four,
/// all four to the first. Each group commits once, every agent gets its own answer.
#[tokio::test]
async fn lanes_fill_in_turn_so_a_few_agents_share_one_commit() {
    for (fill, groups) in [(2, 2), (4, 1)] {
        let b = Pg::new().await;
        let options = PgOptions { lanes: 3, lane_fill: fill, ..Pg::options(&Arc::new(AtomicI64::new(0))) };
        let store = b.db().store(options).await;
        let h = four_held(&store).await;
        let before = store.group_commits();
        for answer in starting_at_once(&store, &h).await {
            assert_eq!(answer.unwrap(), Ok(ack(Outcome::Started)), "fill {fill}");
        }
        let after = store.group_commits();
        assert_eq!(
            (after.transactions - before.transactions, after.commands - before.commands, after.run_alone, after.placed),
            (groups, 4, 0, 0),
            "fill {fill}: {after:?}"
        );
        // The same figures on /metrics, as this replica's totals.
        let text = ql_control::metrics::Metrics::new().render(&store).await.unwrap();
        for line in [
            format!("ql_pg_group_transactions_total {}", after.transactions),
            format!("ql_pg_group_commands_total {}", after.commands),
            format!("ql_pg_group_saved_statements_total {}", after.saved),
            "ql_pg_group_run_alone_total 0".to_owned(),
            "ql_pg_lane_sessions 0".to_owned(),
        ] {
            assert!(text.lines().any(|l| l == line), "fill {fill}: {line} in\n{text}");
        }
        check_invariants(&store.snapshot().await.unwrap());
    }
}

/// A store with one lane whose groups wait up to an hour for the agents it expects: a
/// test that waited on it would not end.
async fn one_patient_lane(b: &Pg) -> PgStore {
    let options =
        PgOptions { lanes: 1, lane_window: Duration::from_secs(3600), ..Pg::options(&Arc::new(AtomicI64::new(0))) };
    b.db().store(options).await
}

/// Yields to the store's tasks until `done`, failing past a deadline far beyond any
/// wait the test expects.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}: not by the deadline");
        tokio::task::yield_now().await;
    }
}

/// Agents a lane answered together come back one by one: the lane waits for each of
/// them and runs them as one group, rather than the first alone and the rest after.
#[tokio::test]
async fn a_lane_waits_for_the_agents_of_its_last_groups_and_runs_them_together() {
    let b = Pg::new().await;
    let h = four_held(&one_lane(&b).await).await;
    let store = one_patient_lane(&b).await;
    for answer in starting_at_once(&store, &h).await {
        assert_eq!(answer.unwrap(), Ok(ack(Outcome::Started)));
    }
    let before = store.group_commits();

    // One agent's `running` first, on its own: the yields let the lane take it before the
    // others are sent, so a lane that did not wait would run it alone.
    let first = tokio::spawn({
        let (store, cmd) = (store.clone(), h[0].running());
        async move { store.execute(cmd).await }
    });
    until("the first `running` is in flight", || store.group_commits().placed == 1).await;
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    let (b1, c1, d1) =
        tokio::join!(store.execute(h[1].running()), store.execute(h[2].running()), store.execute(h[3].running()));
    for answer in [first.await.unwrap(), b1, c1, d1] {
        assert_eq!(answer.unwrap(), Ok(ack(Outcome::Running)));
    }
    one_group_since(&store, before, 4, "the four `running` went in one group");
    check_invariants(&store.snapshot().await.unwrap());
}

/// The lane expects only the agents it answered: a lone agent's commands, one after
/// another, never wait for the window (an hour here).
#[tokio::test]
async fn a_lone_agent_never_waits_for_a_lanes_window() {
    let b = Pg::new().await;
    let store = one_patient_lane(&b).await;
    let alone = async {
        let mut h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
        to_running(&store, &h).await;
        renew(&store, &mut h).await;
        h
    };
    let h = tokio::time::timeout(Duration::from_secs(60), alone).await.expect("no command waited for the window");
    assert_eq!(detail(&store, h.run()).await.attempts[0].status, AttemptStatus::Running);
    check_invariants(&store.snapshot().await.unwrap());
}

/// A worker whose commands name a session that does not exist holds no group of its lane:
/// the lane expects back only the sessions it decided for, so an honest agent's next
/// command runs at once rather than after the window (an hour here) for the made-up one.
#[tokio::test]
async fn a_made_up_session_does_not_hold_a_lanes_next_group() {
    let b = Pg::new().await;
    let store = one_patient_lane(&b).await;
    let mut h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    let made_up = Agent { session: "ses_madeup".parse().unwrap(), ..h.agent.clone() };
    assert_eq!(heartbeat(&store, &made_up, false).await, Err(ErrorCode::NotFound));
    let next = tokio::time::timeout(Duration::from_secs(60), renew(&store, &mut h)).await;
    next.expect("the honest agent's renewal did not wait for the made-up session");
    assert_eq!(detail(&store, h.run()).await.attempts[0].status, AttemptStatus::Running);
    check_invariants(&store.snapshot().await.unwrap());
}

/// With room for only a few prepared statements, each connection's cache starts over
/// again and again through a group's cycle, and every answer is what it would be.
#[tokio::test]
async fn a_connection_keeping_few_statements_prepared_answers_the_same() {
    let b = Pg::new().await;
    let store =
        b.db().store(PgOptions { lanes: 1, prepared_max: 2, ..Pg::options(&Arc::new(AtomicI64::new(0))) }).await;
    let h = four_held(&store).await;
    for answer in starting_at_once(&store, &h).await {
        assert_eq!(answer.unwrap(), Ok(ack(Outcome::Started)));
    }
    for held in &h {
        assert_eq!(exec(&store, held.running()).await, Ok(ack(Outcome::Running)));
    }
    let (a, b2) = tokio::join!(store.execute(h[0].renew()), store.execute(h[1].renew()));
    assert!(matches!((a.unwrap(), b2.unwrap()), (Ok(Reply::Renewed(_)), Ok(Reply::Renewed(_)))));
    assert!(store.group_commits().saved > 0, "the groups merged statements: {:?}", store.group_commits());
    check_invariants(&store.snapshot().await.unwrap());
}

#[tokio::test]
async fn a_command_that_fails_among_others_fails_alone_and_the_others_commit() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let h = four_held(&store).await;
    // The second agent's `starting` writes its attempt, then appends its event, which
    // now collides: its statement fails inside the group's transaction.
    b.plant_event(h[1].run(), h[1].attempt(), "attempt.starting").await;
    let poisoned = detail(&store, h[1].run()).await;

    let answers = starting_at_once(&store, &h).await;
    for (i, answer) in answers.iter().enumerate() {
        if i == 1 {
            assert!(answer.is_err(), "the failing command answers unavailable: {answer:?}");
        } else {
            assert_eq!(answer.as_ref().unwrap(), &Ok(ack(Outcome::Started)), "agent {i}");
        }
    }
    assert_eq!(store.group_commits(), GroupCommits { run_alone: 1, ..GroupCommits::default() });
    assert_eq!(detail(&store, h[1].run()).await, poisoned, "nothing of the failed command was kept");
    for i in [0, 2, 3] {
        let d = detail(&store, h[i].run()).await;
        assert_eq!(d.attempts[0].status, AttemptStatus::Starting, "agent {i}");
        assert_eq!(d.events.iter().filter(|e| e.kind == "attempt.starting").count(), 1, "agent {i}: once");
    }
    check_invariants(&store.snapshot().await.unwrap());
}

/// A group that ends with a wave sends its COMMIT in the pipeline of that wave's writes.
/// If the connection ends while that pipeline runs (here its backend is terminated while
/// it waits inside the events' insert), the COMMIT may have run for all the store can
/// tell: every command is answered unavailable and none runs again, where a statement
/// PostgreSQL refused (the test above) leaves nothing committed and runs each again.
/// The agents' replays then decide from whatever committed: here nothing had.
#[tokio::test]
async fn a_group_whose_connection_ends_with_its_commit_sent_runs_nothing_again() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let h = four_held(&store).await;
    // The superuser, who alone may see and end another role's backend.
    let admin = contract::pg::admin_config().get_user().unwrap_or("postgres").to_owned();
    let owner = connect(&b.db().url(&admin)).await;
    owner
        .batch_execute(
            "CREATE FUNCTION held() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$; \
             CREATE TRIGGER held AFTER INSERT ON events FOR EACH STATEMENT EXECUTE FUNCTION held(); \
             SELECT pg_advisory_lock(4242)",
        )
        .await
        .unwrap();
    let claimed = detail(&store, h[0].run()).await;
    let before = store.group_commits();
    let terminate = async {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let waiting = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                       WHERE datname = current_database() AND usename = 'ql_runtime' \
                       AND wait_event_type = 'Lock' AND wait_event = 'advisory'";
        while owner.query(waiting, &[]).await.unwrap().is_empty() {
            assert!(std::time::Instant::now() < deadline, "the group never reached its events");
            tokio::task::yield_now().await;
        }
        owner.batch_execute("SELECT pg_advisory_unlock(4242); DROP TRIGGER held ON events").await.unwrap();
    };

    let (answers, ()) = tokio::join!(starting_at_once(&store, &h), terminate);
    for (i, answer) in answers.iter().enumerate() {
        let why = answer.as_ref().expect_err("the COMMIT's fate is unknown: unavailable").to_string();
        assert!(why.contains("the COMMIT may or may not have run"), "agent {i}: {why}");
    }
    let after = store.group_commits();
    assert_eq!((after.run_alone, after.transactions), (before.run_alone, before.transactions), "{after:?}");
    assert_eq!(detail(&store, h[0].run()).await, claimed, "the backend ended before COMMIT: nothing kept");
    // Each agent repeats its `starting` (safe to repeat): decided now, once.
    for (i, answer) in starting_at_once(&store, &h).await.into_iter().enumerate() {
        assert_eq!(answer.unwrap(), Ok(ack(Outcome::Started)), "agent {i}");
    }
    check_invariants(&store.snapshot().await.unwrap());
}

#[tokio::test]
async fn an_agents_commands_in_one_group_each_see_the_one_before() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    // Queued in this order on the lane, before it runs: `running` is accepted only if it
    // sees the `starting` the same transaction wrote just before it.
    let (starting, running) = tokio::join!(store.execute(h.starting()), store.execute(h.running()));
    assert_eq!(starting.unwrap(), Ok(ack(Outcome::Started)));
    assert_eq!(running.unwrap(), Ok(ack(Outcome::Running)));
    assert_eq!(store.group_commits(), GroupCommits { transactions: 1, commands: 2, run_alone: 0, placed: 0, saved: 0 });
    assert_eq!(detail(&store, h.run()).await.attempts[0].status, AttemptStatus::Running);
    check_invariants(&store.snapshot().await.unwrap());
}

/// Records certificate `serial` of worker `name`, then revokes it.
async fn revoked(store: &PgStore, name: &str, serial: &str) {
    let cert = ql_control::model::Certificate {
        serial: serial.into(),
        worker: worker(name),
        issued_at: 0,
        not_after: i64::MAX / 2,
        revoked_at: None,
        renewed_from: None,
    };
    exec(store, Command::RecordCertificate(cert, ql_control::core::Issuer::Operator)).await.unwrap();
    exec(store, Command::RevokeCertificate(worker(name), serial.into(), false)).await.unwrap();
}

/// The principal and outcome of every audit record after the first `n`, sorted.
async fn outcomes_since(store: &PgStore, n: usize) -> Vec<(String, String)> {
    let mut written: Vec<(String, String)> = store.audits().await.unwrap()[n..]
        .iter()
        .map(|a| (a.principal.as_ref().unwrap().as_str().to_owned(), a.outcome.clone()))
        .collect();
    written.sort();
    written
}

/// A worker request's audit record, its admission decided with its command.
fn admitted(name: &str, route: &str, serial: &str) -> Option<Audit> {
    let record = AuditRecord { at: 0, principal: Some(worker(name)), route: route.into(), outcome: "admitted".into() };
    Some(Audit { record, admit: Some(serial.into()) })
}

/// The version and expiry an attempt stores for its lease, as its row holds them.
async fn stored_projection(client: &tokio_postgres::Client, h: &Held) -> (i64, i64) {
    let sql = "SELECT lease_version, lease_expires_at FROM attempts WHERE id = $1";
    let row = client.query_one(sql, &[&h.path.attempt.as_str()]).await.unwrap();
    (row.get(0), row.get(1))
}

/// A renewal writes the lease row alone: the attempt's row keeps the version and expiry
/// its claim wrote, and every read of the attempt (a run's detail, the snapshot, the
/// fence of the next command) takes them from the lease, so the projection agrees with
/// the lease wherever it is seen.
#[tokio::test]
async fn a_renewal_writes_the_lease_alone_and_every_read_takes_the_projection_from_it() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let owner = connect(&b.db().url("ql_owner")).await;
    let mut h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    let claimed = stored_projection(&owner, &h).await;

    let first = renew(&store, &mut h).await;
    let last = renew(&store, &mut h).await;
    assert_eq!(last.lease_version.get(), first.lease_version.get() + 1);
    assert_eq!(stored_projection(&owner, &h).await, claimed, "no renewal wrote the attempt's row");
    let d = detail(&store, h.run()).await;
    let lease = &d.leases[0].facts;
    assert_eq!((lease.version, lease.expires_at), (last.lease_version, last.lease_expires_at.millis()));
    assert_eq!(d.attempts[0].lease.as_ref(), Some(lease), "the run's detail completes the projection");
    let snapshot = store.snapshot().await.unwrap();
    assert_eq!(snapshot.attempts[0].lease.as_ref(), Some(lease), "so does the snapshot");
    check_invariants(&snapshot);
    // The row is stale where it is not read: the lease has moved past what it holds.
    assert_ne!(claimed.0, last.lease_version.get() as i64);

    // The next fenced command finds the projection it expects, and ends the run.
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));
    let d = detail(&store, h.run()).await;
    assert_eq!(d.attempts[0].status, AttemptStatus::Succeeded);
    assert_eq!(d.attempts[0].lease.as_ref(), Some(&d.leases[0].facts));
    check_invariants(&store.snapshot().await.unwrap());
}

#[tokio::test]
async fn renewals_of_concurrent_agents_are_sent_once_for_all_and_each_renews_its_own_lease() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let h = four_held(&store).await;
    for held in &h {
        to_running(&store, held).await;
    }
    // router-2 presents a certificate revoked since: refused at admission, in the wave.
    revoked(&store, "router-2", "02").await;
    let refused_before = detail(&store, h[2].run()).await;
    let (before, audits) = (store.group_commits(), store.audits().await.unwrap().len());

    let renew = |i: usize, serial: &str| {
        store.execute_audited(h[i].renew(), admitted(&format!("router-{i}"), "lease.renew", serial))
    };
    let (a, b2, c, d) = tokio::join!(renew(0, "0a"), renew(1, "0a"), renew(2, "02"), renew(3, "0a"));

    for (i, answer) in [(0, a), (1, b2), (3, d)] {
        match answer.unwrap() {
            Ok(Reply::Renewed(r)) => {
                assert_eq!(r.lease_version.get(), h[i].version.get() + 1, "agent {i}");
                let lease = &detail(&store, h[i].run()).await.leases[0];
                assert_eq!(lease.facts.version, r.lease_version, "agent {i}: its own lease, renewed once");
                assert_eq!(lease.facts.expires_at, r.lease_expires_at.millis(), "agent {i}");
            }
            other => panic!("agent {i}: {other:?}"),
        }
    }
    assert_eq!(c.unwrap(), Err(ErrorCode::CertificateRevoked));
    assert_eq!(detail(&store, h[2].run()).await, refused_before, "the refused renewal changed nothing");
    let after = store.group_commits();
    assert_eq!((after.transactions - before.transactions, after.commands - before.commands), (1, 4), "{after:?}");
    // The four loads as one statement per level of the lock order and one for DB time
    // and every admission (6 for 24: 18 saved); the four audit records as one (3 saved);
    // the three admitted renewals' lease writes as one for two of them and one for the
    // third (chunks of a power of two: 1 saved; a renewal writes no attempt row).
    assert_eq!(after.saved - before.saved, 22, "{after:?}");
    let written = outcomes_since(&store, audits).await;
    let expected = [
        ("router-0", "admitted"),
        ("router-1", "admitted"),
        ("router-2", "certificate_revoked"),
        ("router-3", "admitted"),
    ];
    assert_eq!(written, expected.map(|(w, o)| (w.to_owned(), o.to_owned())), "each request on record once");
    check_invariants(&store.snapshot().await.unwrap());
}

#[tokio::test]
async fn a_wave_of_different_commands_each_decides_as_it_would_alone_and_a_poll_among_them_after_it() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let h = four_held(&store).await;
    to_starting(&store, &h[1]).await;
    to_running(&store, &h[2]).await;
    to_running(&store, &h[3]).await;
    // Agent 3 renews at a version its lease has not reached: refused, as alone.
    let ahead = ql_wire::ids::Counter::new(h[3].version.get() + 1).unwrap();
    let stale = Command::Renew(h[3].path.clone(), h[3].fence_at(ahead));
    let stale_before = detail(&store, h[3].run()).await;
    // A fifth agent polls for a queued run, between the others' commands: the four
    // fenced commands still form one wave, the poll runs after it.
    let queued = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let fifth = open(&store, "router-4").await;
    let polled = PollOffers { generation: fifth.generation, wait_ms: 0, max: 8 };
    let before = store.group_commits();

    let (a, b2, p, c, d) = tokio::join!(
        store.execute(h[0].starting()),
        store.execute(h[1].running()),
        store.execute(Command::PollOffers(fifth.worker.clone(), fifth.session.clone(), polled)),
        store.execute(h[2].renew()),
        store.execute(stale.clone()),
    );

    assert_eq!(a.unwrap(), Ok(ack(Outcome::Started)));
    assert_eq!(b2.unwrap(), Ok(ack(Outcome::Running)));
    assert!(matches!(c.unwrap(), Ok(Reply::Renewed(_))));
    match p.unwrap() {
        Ok(Reply::Offers(o, _)) => assert_eq!(o.offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), [&queued]),
        other => panic!("poll: {other:?}"),
    }
    let refusal = d.unwrap();
    assert!(refusal.is_err(), "{refusal:?}");
    let after = store.group_commits();
    assert_eq!((after.transactions - before.transactions, after.commands - before.commands), (1, 5), "{after:?}");
    // One load for the four (18 saved), and the events of `starting` (one) and `running`
    // (two) as one statement for two and one for the third (1 saved); each command's
    // other writes its own.
    assert_eq!(after.saved - before.saved, 19, "{after:?}");
    assert_eq!(detail(&store, h[0].run()).await.attempts[0].status, AttemptStatus::Starting);
    assert_eq!(detail(&store, h[1].run()).await.attempts[0].status, AttemptStatus::Running);
    assert_eq!(detail(&store, h[3].run()).await, stale_before, "the refused renewal changed nothing");
    // Alone, the same command gets the same answer.
    assert_eq!(store.execute(stale).await.unwrap(), refusal);
    check_invariants(&store.snapshot().await.unwrap());
}

#[tokio::test]
async fn sessions_named_by_refused_commands_hold_no_place_on_the_lanes() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let agent = open(&store, "router-1").await;
    assert_eq!(heartbeat(&store, &agent, false).await.map(drop), Ok(()));
    assert_eq!(store.group_commits().placed, 0, "answered: the live session holds no place");
    let before = store.snapshot().await.unwrap();

    // A worker naming sessions that are not its own, as many as it likes: each command
    // is refused, changes nothing, and leaves no place behind.
    for i in 0..50 {
        let made_up =
            Agent { session: ql_wire::ids::SessionId::parse(format!("ses_made_up_{i}")).unwrap(), ..agent.clone() };
        assert!(heartbeat(&store, &made_up, false).await.is_err(), "session {i} refused");
    }
    assert_eq!(store.group_commits().placed, 0, "the refused sessions hold none either");
    assert_eq!(store.snapshot().await.unwrap(), before, "refusals changed nothing");
    assert_eq!(heartbeat(&store, &agent, false).await.map(drop), Ok(()));
}

/// `n` agents `router-<i>` with room for `capacity`, each declaring `site=site-<i>`, and
/// a run queued for each.
async fn agents_with_a_run_each(store: &PgStore, n: usize, capacity: u32) -> (Vec<Agent>, Vec<ql_wire::ids::RunId>) {
    let mut agents = Vec::new();
    let mut runs = Vec::new();
    for i in 0..n {
        let site = format!("site-{i}");
        agents.push(open_with(store, &format!("router-{i}"), capacity, &[("site", site.as_str())]).await);
        runs.push(submit_for(store, &[("site", site.as_str())]).await);
    }
    (agents, runs)
}

/// The runs a poll's answer offers.
fn offered(answer: Result<Result<Reply, ErrorCode>, ql_control::store::StoreError>) -> Vec<ql_wire::ids::RunId> {
    match answer.expect("the store is available") {
        Ok(Reply::Offers(o, _)) => o.offers.into_iter().map(|o| o.run_id).collect(),
        other => panic!("poll: {other:?}"),
    }
}

/// A poll of `agent` for at most `max` offers.
fn poll_of(agent: &Agent, max: u32) -> Command {
    let body = PollOffers { generation: agent.generation, wait_ms: 0, max };
    Command::PollOffers(agent.worker.clone(), agent.session.clone(), body)
}

/// Polls of agents in step run as one wave: one group, their loads sent together, their
/// alike writes merged, each offered what it would be alone: the run its labels fit, and
/// for an agent with an offer still open, that offer and a run for its one free place.
/// Polls refused among them — a stale generation, a worker naming another's session —
/// are refused as alone and change nothing.
#[tokio::test]
async fn polls_of_concurrent_agents_load_together_and_each_places_its_own_run() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let (agents, runs) = agents_with_a_run_each(&store, 5, 2).await;
    // Agent 0 already holds an open offer, of a run before its second.
    let open_offer = match exec(&store, poll_of(&agents[0], 1)).await {
        Ok(Reply::Offers(o, _)) => o.offers.into_iter().next().expect("an offer"),
        other => panic!("poll: {other:?}"),
    };
    let second = submit_for(&store, &[("site", "site-0")]).await;
    let stale = Agent { generation: ql_wire::ids::Counter::new(2).unwrap(), ..agents[3].clone() };
    let intruder = Agent { worker: agents[1].worker.clone(), ..agents[4].clone() };
    let untouched = |store: &PgStore, i: usize| {
        let (store, run, session) = (store.clone(), runs[i].clone(), agents[i].session.clone());
        async move { (detail(&store, &run).await, session_row(&store, &session).await) }
    };
    let (stale_before, intruded_before) = (untouched(&store, 3).await, untouched(&store, 4).await);
    let before = store.group_commits();

    let (a, b2, c, d, e) = tokio::join!(
        store.execute(poll_of(&agents[0], 8)),
        store.execute(poll_of(&agents[1], 8)),
        store.execute(poll_of(&agents[2], 8)),
        store.execute(poll_of(&stale, 8)),
        store.execute(poll_of(&intruder, 8)),
    );

    match a.unwrap() {
        Ok(Reply::Offers(o, _)) => {
            let offered: Vec<_> = o.offers.iter().map(|o| (&o.offer_id, &o.run_id)).collect();
            assert_eq!(offered.len(), 2, "{offered:?}");
            assert_eq!(offered[0], (&open_offer.offer_id, &open_offer.run_id), "its open offer first");
            assert_eq!(offered[1].1, &second, "and a run for its free place");
        }
        other => panic!("poll: {other:?}"),
    }
    for (i, answer) in [(1, b2), (2, c)] {
        assert_eq!(offered(answer), [runs[i].clone()], "agent {i} is offered its own run");
    }
    assert_eq!(d.unwrap(), Err(ErrorCode::SessionConflict), "the stale poll is refused");
    assert_eq!(e.unwrap(), Err(ErrorCode::NotFound), "another worker's session is not found");
    one_group_since(&store, before, 5, "one transaction carried the five polls");
    // Loads: the generic plans and four statements for the five polls' first loads of
    // four each (15), the generic plans not again before the five probes (5), the five
    // probes as one (4), one DB-time read for five (4). Writes: the two agents placing
    // their first run write alike, the session, the run, the attempt and the offer each
    // as one statement for both (4); the three placing polls' six events as one
    // statement for four and one for two (4).
    assert_eq!(store.group_commits().saved - before.saved, 36, "{:?}", store.group_commits());
    check_invariants(&store.snapshot().await.unwrap());
    assert_eq!(untouched(&store, 3).await, stale_before, "the stale poll wrote nothing");
    assert_eq!(untouched(&store, 4).await, intruded_before, "the intruder wrote nothing");
}

/// Polls in one wave that fit the same runs decide as one after another would: each run
/// is placed once, oldest first, and a poll finding none left gets none.
#[tokio::test]
async fn polls_in_one_wave_that_fit_the_same_runs_place_each_run_once() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let agents = [open(&store, "router-1").await, open(&store, "router-2").await, open(&store, "router-3").await];
    let runs = [submit(&store, LONG_TIMEOUT_MS, 0).await, submit(&store, LONG_TIMEOUT_MS, 0).await];
    let before = store.group_commits();

    let (a, b2, c) = tokio::join!(
        store.execute(poll_of(&agents[0], 8)),
        store.execute(poll_of(&agents[1], 8)),
        store.execute(poll_of(&agents[2], 8)),
    );

    one_group_since(&store, before, 3, "one transaction carried the three polls");
    let answers = [offered(a), offered(b2), offered(c)];
    let mut placed: Vec<_> = answers.iter().flatten().cloned().collect();
    placed.sort();
    let mut expected = runs.to_vec();
    expected.sort();
    assert_eq!(placed, expected, "each run placed once: {answers:?}");
    assert_eq!(answers.iter().filter(|a| a.is_empty()).count(), 1, "one poll found none left: {answers:?}");
    check_invariants(&store.snapshot().await.unwrap());
}

/// A poll of a wave whose probe could not see past the runs the polls before it placed
/// runs again after the wave, in the same transaction, and is offered what it would have
/// been alone: five sessions with room for 64 each, 320 runs for any of them, each
/// offered 64 of its own though the fifth's probe (at most 256 runs) saw only the four's.
#[tokio::test]
async fn a_poll_whose_wave_hid_runs_from_it_runs_again_after_the_wave() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let mut agents = Vec::new();
    for i in 0..5 {
        agents.push(open_with(&store, &format!("router-{i}"), 64, &[]).await);
    }
    for _ in 0..320 {
        submit(&store, LONG_TIMEOUT_MS, 0).await;
    }
    let before = store.group_commits();

    let (a, b2, c, d, e) = tokio::join!(
        store.execute(poll_of(&agents[0], 64)),
        store.execute(poll_of(&agents[1], 64)),
        store.execute(poll_of(&agents[2], 64)),
        store.execute(poll_of(&agents[3], 64)),
        store.execute(poll_of(&agents[4], 64)),
    );

    one_group_since(&store, before, 5, "one transaction carried the five polls");
    let answers = [offered(a), offered(b2), offered(c), offered(d), offered(e)];
    assert!(answers.iter().all(|a| a.len() == 64), "each offered 64: {:?}", answers.map(|a| a.len()));
    let mut placed: Vec<_> = answers.iter().flatten().collect();
    placed.sort();
    placed.dedup();
    assert_eq!(placed.len(), 320, "every run placed once");
    check_invariants(&store.snapshot().await.unwrap());
}

/// A poll refused at admission in a wave of polls (its certificate revoked since) is
/// refused as alone: only its audit records are written, its session and its run are
/// unchanged, and the others place their runs.
#[tokio::test]
async fn a_poll_refused_at_admission_in_a_wave_of_polls_writes_only_its_audit_record() {
    let b = Pg::new().await;
    let store = one_lane(&b).await;
    let (agents, runs) = agents_with_a_run_each(&store, 3, 1).await;
    revoked(&store, "router-2", "02").await;
    let refused_before = (detail(&store, &runs[2]).await, session_row(&store, &agents[2].session).await);
    let (before, audits) = (store.group_commits(), store.audits().await.unwrap().len());

    let poll = |i: usize, serial: &str| {
        store.execute_audited(poll_of(&agents[i], 8), admitted(&format!("router-{i}"), "offers.poll", serial))
    };
    let (a, b2, c) = tokio::join!(poll(0, "0a"), poll(1, "0a"), poll(2, "02"));

    assert_eq!(offered(a), [runs[0].clone()]);
    assert_eq!(offered(b2), [runs[1].clone()]);
    assert_eq!(c.unwrap(), Err(ErrorCode::CertificateRevoked));
    one_group_since(&store, before, 3, "one transaction carried the three polls");
    let refused_after = (detail(&store, &runs[2]).await, session_row(&store, &agents[2].session).await);
    assert_eq!(refused_after, refused_before, "the refused poll changed nothing of its run or session");
    let written = outcomes_since(&store, audits).await;
    let expected = [("router-0", "admitted"), ("router-1", "admitted"), ("router-2", "certificate_revoked")];
    assert_eq!(written, expected.map(|(w, o)| (w.to_owned(), o.to_owned())), "each request on record once");
    check_invariants(&store.snapshot().await.unwrap());
}
