//! The store contract: what every authority store must do, proven by driving real
//! protocol commands through [`Store::execute`] against a real database.
//!
//! A backend plugs in through [`Backend`] (a store, a second handle on the same database
//! as another process would hold, a way to move DB time, and two backdoors that only
//! tests use). Each scenario in [`scenarios`] is an `async fn` generic over the backend;
//! `tests/store_contract.rs` instantiates every scenario once per backend, so SQLite and
//! PostgreSQL ([`pg`]) answer to the same suite.
//!
//! Time never passes by sleeping: scenarios move DB time forward with
//! [`Backend::advance`] and rely on the store reading DB time inside its transaction.

#![allow(dead_code, unreachable_pub)]

pub mod identity;
pub mod operators;
pub mod pg;
pub mod scenarios;
pub mod schedules;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;

use ql_control::core::{CancelOutcome, Command, Reply, Submit, Timings};
use ql_control::model::{RunStatus, Session};
use ql_control::store::{RunDetail, Snapshot, Store};
use ql_wire::ack::{AckReply, Running, StartFailure};
use ql_wire::artifact::Receipt;
use ql_wire::capability::Token;
use ql_wire::completion::{Completion, CompletionReply, CompletionSchema};
use ql_wire::ids::{AttemptId, Counter, OfferId, ProjectId, RunId, SessionId, WorkerId};
use ql_wire::lease::Renewed;
use ql_wire::offer::{Claim, Claimed, Offer as WireOffer, PollOffers};
use ql_wire::route::AttemptPath;
use ql_wire::session::{Heartbeat, HeartbeatReply, OpenSession};
use ql_wire::spec::{ExecutionSpec, SpecSchema};
use ql_wire::text::{ExecutorHandle, Reason};
use ql_wire::time::Timestamp;
use ql_wire::{ErrorCode, Fence, Outcome};

/// What a backend gives the suite.
pub trait Backend {
    /// The store under test.
    type Store: Store;

    /// A handle on the store under test.
    fn store(&self) -> Self::Store;

    /// A second, independent handle on the same database, as another process (the
    /// operator CLI, another replica) would open it.
    fn other_process(&self) -> Self::Store;

    /// The durations the store was opened with.
    fn timings(&self) -> Timings;

    /// Moves DB time forward by `ms`.
    fn advance(&self, ms: i64);

    /// Sets an attempt's executor type behind the store's back (a row no command of
    /// this protocol can make, which the decisions must still refuse).
    fn set_executor_type(&self, attempt: &AttemptId, executor_type: &str) -> impl Future<Output = ()>;

    /// Appends an event behind the store's back, so that the next command appending
    /// the same event type for the attempt fails inside its transaction.
    fn plant_event(&self, run: &RunId, attempt: &AttemptId, kind: &str) -> impl Future<Output = ()>;

    /// Every text value of every column of every table.
    fn all_text(&self) -> impl Future<Output = Vec<String>>;
}

/// Durations short enough to reason about, long enough that real time passing during a
/// test never lapses anything: only [`Backend::advance`] does.
pub fn test_timings() -> Timings {
    // An outage is an hour without a sweep: longer than any time travel of a scenario
    // that does not mean one.
    Timings {
        heartbeat_ms: 1_000,
        session_ttl_ms: 600_000,
        offer_ttl_ms: 30_000,
        lease_ttl_ms: 60_000,
        outage_after_ms: OUTAGE_AFTER_MS,
        takeover_after_ms: TAKEOVER_AFTER_MS,
        missed_after_ms: 60_000,
        renew_interval_ms: RENEW_INTERVAL_MS,
    }
}

/// A worker renews at most once in this long (see `test_timings`).
pub const RENEW_INTERVAL_MS: u64 = 60_000;

/// A session seen within this is not taken over (see `test_timings`).
pub const TAKEOVER_AFTER_MS: u64 = 2_000;

/// No sweep for this long is an outage (see `test_timings`).
pub const OUTAGE_AFTER_MS: u64 = 3_600_000;

/// A run's time limit long enough never to pass unless a scenario wants it to.
pub const LONG_TIMEOUT_MS: u64 = 3_600_000;
/// A run's time limit a scenario passes on purpose (shorter than a lease's TTL).
pub const SHORT_TIMEOUT_MS: u64 = 10_000;

// ------------------------------------------------------------------------- temp dirs

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `ql-<tag>-<pid>-<n>-<nanos>`.
    pub fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let dir = std::env::temp_dir().join(format!("ql-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// The directory.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// --------------------------------------------------------------------------- commands

/// Runs a command; a store failure fails the test (the contract is about decisions).
pub async fn exec<S: Store>(store: &S, cmd: Command) -> Result<Reply, ErrorCode> {
    store.execute(cmd).await.expect("the store is available")
}

/// Runs a command that must be refused with `code` and must change nothing at all.
pub async fn refused<S: Store>(store: &S, cmd: Command, code: ErrorCode, what: &str) {
    let before = store.snapshot().await.unwrap();
    let got = exec(store, cmd).await;
    assert_eq!(got, Err(code), "{what}");
    let after = store.snapshot().await.unwrap();
    assert_unchanged(&before, &after, what);
}

/// Runs a command whose answer must be `reply` and must change nothing (a replay).
pub async fn replayed<S: Store>(store: &S, cmd: Command, reply: Reply, what: &str) {
    let before = store.snapshot().await.unwrap();
    assert_eq!(exec(store, cmd).await, Ok(reply), "{what}");
    let after = store.snapshot().await.unwrap();
    assert_unchanged(&before, &after, what);
}

/// Two snapshots are equal, table by table, with a readable failure.
pub fn assert_unchanged(before: &Snapshot, after: &Snapshot, what: &str) {
    assert_eq!(before.sessions, after.sessions, "{what}: sessions changed");
    assert_eq!(before.runs, after.runs, "{what}: runs changed");
    assert_eq!(before.attempts, after.attempts, "{what}: attempts changed");
    assert_eq!(before.offers, after.offers, "{what}: offers changed");
    assert_eq!(before.leases, after.leases, "{what}: leases changed");
    assert_eq!(before.events, after.events, "{what}: events changed");
    assert_eq!(before.log_chunks, after.log_chunks, "{what}: log chunks changed");
    assert_eq!(before.workers, after.workers, "{what}: workers changed");
    assert_eq!(before.certificates, after.certificates, "{what}: certificates changed");
    assert_eq!(before.enrolments, after.enrolments, "{what}: enrolments changed");
    assert_eq!(before.schedules, after.schedules, "{what}: schedules changed");
    assert_eq!(before.fires, after.fires, "{what}: fires changed");
    assert_eq!(before.operators, after.operators, "{what}: operators changed");
    assert_eq!(before.deliveries, after.deliveries, "{what}: deliveries changed");
}

pub fn worker(name: &str) -> WorkerId {
    WorkerId::parse(name).unwrap()
}

pub fn project() -> ProjectId {
    ProjectId::parse("default").unwrap()
}

pub fn spec(timeout_ms: u64) -> ExecutionSpec {
    ExecutionSpec {
        schema: SpecSchema,
        project_id: project(),
        argv: Some(vec!["/bin/echo".into(), "hello".into()]),
        script: None,
        env: BTreeMap::new(),
        timeout_ms,
        log_limit_bytes: 65_536,
    }
}

/// Queues a run and returns its id.
pub async fn submit<S: Store>(store: &S, timeout_ms: u64, retry_budget: u32) -> RunId {
    submit_with(store, timeout_ms, retry_budget, BTreeMap::new(), BTreeMap::new()).await
}

/// Queues a run that needs the operator's `labels` of its worker and the `agent_labels`
/// its agent declares.
pub async fn submit_with<S: Store>(
    store: &S,
    timeout_ms: u64,
    retry_budget: u32,
    labels: BTreeMap<String, String>,
    agent_labels: BTreeMap<String, String>,
) -> RunId {
    let cmd = Command::Submit(Submit {
        project: project(),
        spec: spec(timeout_ms),
        labels,
        agent_labels,
        retry_budget,
        notify: None,
    });
    match exec(store, cmd).await {
        Ok(Reply::Submitted(id)) => id,
        other => panic!("submit: {other:?}"),
    }
}

pub async fn cancel<S: Store>(store: &S, run: &RunId) -> CancelOutcome {
    match exec(store, Command::Cancel(run.clone())).await {
        Ok(Reply::Cancelled(outcome)) => outcome,
        other => panic!("cancel: {other:?}"),
    }
}

pub async fn sweep<S: Store>(store: &S) -> usize {
    match exec(store, Command::Sweep).await {
        Ok(Reply::Swept(n)) => n,
        other => panic!("sweep: {other:?}"),
    }
}

/// A worker's open session, as its agent knows it.
#[derive(Debug, Clone)]
pub struct Agent {
    pub worker: WorkerId,
    pub session: SessionId,
    pub generation: Counter,
}

pub fn open_body(capacity: u32, labels: &[(&str, &str)]) -> OpenSession {
    OpenSession {
        agent_version: "0.1.0".parse().unwrap(),
        arch: "mipsel".parse().unwrap(),
        labels: labels.iter().map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap())).collect(),
        capacity,
    }
}

/// Opens a session with the given capacity and labels.
pub async fn open_with<S: Store>(store: &S, name: &str, capacity: u32, labels: &[(&str, &str)]) -> Agent {
    let w = worker(name);
    match exec(store, Command::OpenSession(w.clone(), open_body(capacity, labels))).await {
        Ok(Reply::SessionOpened(o)) => Agent { worker: w, session: o.session_id, generation: o.generation },
        other => panic!("open session: {other:?}"),
    }
}

/// Opens a session of capacity 1 without labels.
pub async fn open<S: Store>(store: &S, name: &str) -> Agent {
    open_with(store, name, 1, &[]).await
}

pub async fn heartbeat<S: Store>(store: &S, a: &Agent, draining: bool) -> Result<HeartbeatReply, ErrorCode> {
    let body = Heartbeat { generation: a.generation, draining };
    match exec(store, Command::Heartbeat(a.worker.clone(), a.session.clone(), body)).await {
        Ok(Reply::Heartbeat(r)) => Ok(r),
        Ok(other) => panic!("heartbeat: {other:?}"),
        Err(code) => Err(code),
    }
}

pub async fn poll<S: Store>(store: &S, a: &Agent) -> Vec<WireOffer> {
    let body = PollOffers { generation: a.generation, wait_ms: 0, max: 8 };
    match exec(store, Command::PollOffers(a.worker.clone(), a.session.clone(), body)).await {
        Ok(Reply::Offers(o, _)) => o.offers,
        other => panic!("poll: {other:?}"),
    }
}

/// What an agent holds after a successful claim: everything later commands need.
#[derive(Debug, Clone)]
pub struct Held {
    pub agent: Agent,
    pub path: AttemptPath,
    pub offer: OfferId,
    pub lease_token: Token,
    pub callback_token: Token,
    pub claimed: Claimed,
    /// The lease version the agent last saw.
    pub version: Counter,
    /// The evidence a completion presents (kept so a replay is byte-for-byte the same).
    pub finished_at: Timestamp,
}

pub fn claim_cmd(a: &Agent, offer: &WireOffer, token: &Token) -> Command {
    let body = Claim {
        generation: a.generation,
        run_id: offer.run_id.clone(),
        attempt_id: offer.attempt_id.clone(),
        lease_token: token.clone(),
    };
    Command::Claim(a.worker.clone(), a.session.clone(), offer.offer_id.clone(), body)
}

/// Claims `offer` with a fresh lease token.
pub async fn claim<S: Store>(store: &S, a: &Agent, offer: &WireOffer) -> Held {
    let token = Token::generate().unwrap();
    let claimed = match exec(store, claim_cmd(a, offer, &token)).await {
        Ok(Reply::Claimed(c)) => *c,
        other => panic!("claim: {other:?}"),
    };
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    Held {
        agent: a.clone(),
        path: AttemptPath {
            worker: a.worker.clone(),
            session: a.session.clone(),
            run: offer.run_id.clone(),
            attempt: offer.attempt_id.clone(),
        },
        offer: offer.offer_id.clone(),
        lease_token: token,
        callback_token: Token::generate().unwrap(),
        version: claimed.lease_version,
        finished_at: Timestamp::from_millis(wall).unwrap(),
        claimed,
    }
}

impl Held {
    pub fn run(&self) -> &RunId {
        &self.path.run
    }

    pub fn attempt(&self) -> &AttemptId {
        &self.path.attempt
    }

    /// The fence at the version the agent last saw.
    pub fn fence(&self) -> Fence {
        self.fence_at(self.version)
    }

    pub fn fence_at(&self, version: Counter) -> Fence {
        Fence {
            session_generation: self.agent.generation,
            offer_id: self.offer.clone(),
            lease_generation: self.claimed.lease_generation,
            lease_token: self.lease_token.clone(),
            expected_lease_version: version,
        }
    }

    pub fn handle() -> ExecutorHandle {
        "pid:4242 start:99".parse().unwrap()
    }

    pub fn running_body(&self, fence: Fence) -> Running {
        Running::new(fence, Self::handle(), None, Counter::ONE, self.callback_token.digest())
    }

    pub fn start_failure_body(&self, fence: Fence) -> StartFailure {
        StartFailure::new(fence, Reason::parse("spawn failed: no such file or directory").unwrap())
    }

    pub fn completion_body(&self, fence: Fence, exit_code: Option<i32>, artifact: Option<Receipt>) -> Completion {
        Completion::new(
            fence,
            CompletionSchema,
            Counter::ONE,
            self.callback_token.clone(),
            exit_code,
            None,
            self.finished_at,
            artifact,
        )
    }

    pub fn starting(&self) -> Command {
        Command::Starting(self.path.clone(), self.fence())
    }

    pub fn running(&self) -> Command {
        Command::Running(self.path.clone(), self.running_body(self.fence()))
    }

    pub fn start_failure(&self) -> Command {
        Command::StartFailure(self.path.clone(), self.start_failure_body(self.fence()))
    }

    pub fn renew(&self) -> Command {
        Command::Renew(self.path.clone(), self.fence())
    }

    pub fn complete(&self, exit_code: Option<i32>) -> Command {
        Command::Complete(self.path.clone(), self.completion_body(self.fence(), exit_code, None), None)
    }
}

pub fn ack(outcome: Outcome) -> Reply {
    Reply::Ack(AckReply { result: outcome })
}

pub fn completed(result: Outcome, status: ql_wire::completion::TerminalStatus) -> Reply {
    Reply::Completed(CompletionReply { result, status })
}

/// Submits a run, opens a session of `name` and claims the run's offer.
pub async fn claimed_run<S: Store>(store: &S, name: &str, timeout_ms: u64, retry_budget: u32) -> Held {
    let run = submit(store, timeout_ms, retry_budget).await;
    let agent = open(store, name).await;
    let offers = poll(store, &agent).await;
    let offer = offers.iter().find(|o| o.run_id == run).expect("the run is offered");
    claim(store, &agent, offer).await
}

/// Drives a held attempt to `starting`.
pub async fn to_starting<S: Store>(store: &S, h: &Held) {
    assert_eq!(exec(store, h.starting()).await, Ok(ack(Outcome::Started)));
}

/// Drives a held attempt from `claimed` to `running`.
pub async fn to_running<S: Store>(store: &S, h: &Held) {
    to_starting(store, h).await;
    assert_eq!(exec(store, h.running()).await, Ok(ack(Outcome::Running)));
}

/// Renews and records the new version in `h`.
pub async fn renew<S: Store>(store: &S, h: &mut Held) -> Renewed {
    match exec(store, h.renew()).await {
        Ok(Reply::Renewed(r)) => {
            h.version = r.lease_version;
            r
        }
        other => panic!("renew: {other:?}"),
    }
}

pub async fn detail<S: Store>(store: &S, run: &RunId) -> RunDetail {
    store.run_detail(run).await.unwrap().expect("the run exists")
}

pub async fn session_row<S: Store>(store: &S, id: &SessionId) -> Session {
    store.snapshot().await.unwrap().sessions.into_iter().find(|s| &s.id == id).expect("the session exists")
}

pub fn kinds(d: &RunDetail) -> Vec<&str> {
    d.events.iter().map(|e| e.kind.as_str()).collect()
}

// ------------------------------------------------------------------------- invariants

const TERMINAL_EVENTS: [&str; 4] = ["run.succeeded", "run.failed", "run.cancelled", "run.timed_out"];

/// The invariants every committed state satisfies, whatever happened before.
pub fn check_invariants(snap: &Snapshot) {
    let attempts: HashMap<&AttemptId, _> = snap.attempts.iter().map(|a| (&a.id, a)).collect();
    let runs: HashMap<&RunId, _> = snap.runs.iter().map(|r| (&r.id, r)).collect();

    // Each run has at most one terminal event, and a terminal run has exactly one.
    for run in &snap.runs {
        let terminal =
            snap.events.iter().filter(|e| e.run == run.id && TERMINAL_EVENTS.contains(&e.kind.as_str())).count();
        assert!(terminal <= 1, "run {} has {terminal} terminal events", run.id);
        assert_eq!(
            terminal == 1,
            run.status.is_terminal(),
            "run {} is {} with {terminal} terminal events",
            run.id,
            run.status
        );
    }

    // No event type twice for one attempt (or, run-level, for one run).
    let mut seen = HashSet::new();
    for e in &snap.events {
        assert!(seen.insert((&e.run, &e.attempt, &e.kind)), "event {} appended twice for {:?}", e.kind, e.attempt);
    }

    for lease in &snap.leases {
        // The attempt's projection equals the lease's own facts.
        let attempt = attempts.get(&lease.attempt).expect("a lease's attempt exists");
        assert_eq!(attempt.lease.as_ref(), Some(&lease.facts), "attempt {} projection drifted", attempt.id);
        // No live lease on an ended run or attempt.
        let run = runs.get(&lease.run).expect("a lease's run exists");
        if lease.state == ql_control::model::LeaseState::Leased {
            assert!(!run.status.is_terminal(), "run {} is {} but its lease is leased", run.id, run.status);
            assert!(
                !attempt.status.is_terminal(),
                "attempt {} is {} but its lease is leased",
                attempt.id,
                attempt.status
            );
        }
    }

    // An attempt's live-log chunks tile exactly what it acknowledged, from offset 0.
    for attempt in &snap.attempts {
        let mut at = 0;
        for chunk in snap.log_chunks.iter().filter(|c| c.attempt == attempt.id) {
            assert_eq!(chunk.offset, at, "attempt {}: a gap or an overlap at {at}", attempt.id);
            at += chunk.length;
        }
        assert_eq!(at, attempt.log_acked, "attempt {}: chunks end at {at}", attempt.id);
    }
    assert!(snap.log_chunks.iter().all(|c| attempts.contains_key(&c.attempt)), "a chunk of no attempt");

    for run in &snap.runs {
        // A run's current attempt exists and belongs to it; at most one attempt is active.
        if let Some(current) = &run.current_attempt {
            assert_eq!(&attempts.get(current).expect("current attempt exists").run, &run.id);
        }
        let active = snap.attempts.iter().filter(|a| a.run == run.id && a.status.is_active()).count();
        assert!(active <= 1, "run {} has {active} active attempts", run.id);
        if run.status == RunStatus::Queued {
            assert_eq!(active, 0, "queued run {} has an active attempt", run.id);
        }
    }
}
