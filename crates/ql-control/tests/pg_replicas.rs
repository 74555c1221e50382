//! Two `ql-control serve` replicas on one PostgreSQL database, real agents' traffic over
//! mTLS spread across both, and an operator cancelling at random: at the end every run
//! has ended exactly once and the committed state satisfies every invariant. Then the
//! same with PostgreSQL restarted in the middle: agents ride through `unavailable` and
//! converge.
//!
//! Each simulated agent is one thread with one client certificate, sending one request
//! at a time, each to the next replica in turn (any replica may answer any request). It
//! drives its attempts through claim, starting, running, renewals and completion, replays
//! some commands exactly as an agent does after a lost response, fails some starts, and
//! now and then "crashes" (abandons an attempt) so the replicas' sweepers expire leases.
//! On `unavailable` or a dropped connection it repeats the same request, as the protocol
//! says is safe.

mod contract;
#[path = "common/proxy.rs"]
mod proxy;
#[path = "common/s3.rs"]
mod s3;
#[path = "common/worker_client.rs"]
mod worker_client;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ql_control::config::{Config, Layout};
use ql_control::core::{Command as Cmd, Reply, Submit};
use ql_control::model::RunStatus;
use ql_control::store::postgres::{PgOptions, PgStore};
use ql_control::store::Store;
use ql_wire::ack::{AckReply, Running, StartFailure};
use ql_wire::artifact::{ArtifactHeader, ArtifactReply, ArtifactSchema, Receipt};
use ql_wire::capability::{Digest, Token};
use ql_wire::completion::{Completion, CompletionReply, CompletionSchema, TerminalStatus};
use ql_wire::error::ErrorBody;
use ql_wire::frame::encode_prefix;
use ql_wire::ids::{ArtifactId, Counter, RunId, WorkerId};
use ql_wire::lease::Renewed;
use ql_wire::offer::{Claimed, Offers, PollOffers};
use ql_wire::route::{AttemptCommand, AttemptPath, Route, ARTIFACT_MEDIA_TYPE};
use ql_wire::session::{OpenSession, SessionOpened};
use ql_wire::text::Reason;
use ql_wire::time::Timestamp;
use ql_wire::{decode, encode, Body, ErrorCode, Fence, Outcome};

use contract::pg::TestDb;
use contract::{check_invariants, spec, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_ql-control");

/// A running `ql-control serve`, stopped when dropped.
struct Server {
    child: Child,
    url: String,
    /// The operator API's, when it has one.
    operator_url: Option<String>,
}

impl Server {
    fn start(dir: &Path, database: &str) -> Self {
        Self::start_logged(dir, database, Stdio::null())
    }

    /// The same, its stderr to `stderr`.
    fn start_logged(dir: &Path, database: &str, stderr: impl Into<Stdio>) -> Self {
        Self::start_with(dir, database, stderr, &["--operator-listen", ""], &[])
    }

    /// The same with more arguments and environment.
    fn start_with(dir: &Path, database: &str, stderr: impl Into<Stdio>, args: &[&str], env: &[(&str, String)]) -> Self {
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--database", database])
            .args(args)
            .arg("--dir")
            .arg(dir)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("ql-control serve starts");
        // The operator API's line, when there is one, comes first; "listening on" last.
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut operator_url = None;
        loop {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            if let Some(url) = line.trim().strip_prefix("operator API on ") {
                operator_url = Some(url.to_owned());
                continue;
            }
            let url = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("serve said {line:?}"));
            return Self { child, url: url.to_owned(), operator_url };
        }
    }

    /// `host:port` of the worker ingress.
    fn addr(&self) -> std::net::SocketAddr {
        self.url.trim_start_matches("https://").parse().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A state directory (PKI, control.json with short durations) shared by the replicas.
fn state_dir(tmp: &TempDir) -> PathBuf {
    let dir = tmp.path().join("state");
    let ok = Command::new(BIN).args(["init", "--host", "127.0.0.1", "--dir"]).arg(&dir).output().unwrap();
    assert!(ok.status.success(), "init: {}", String::from_utf8_lossy(&ok.stderr));
    let layout = Layout::new(&dir);
    let config = Config {
        heartbeat_ms: 1_000,
        session_ttl_ms: 20_000,
        offer_ttl_ms: 3_000,
        lease_ttl_ms: 3_000,
        sweep_interval_ms: 200,
        ..Config::load(&layout).unwrap()
    };
    config.save(&layout).unwrap();
    dir
}

/// A tiny deterministic generator (xorshift): each agent's choices are reproducible.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// What every agent reports.
#[derive(Default)]
struct Tally {
    /// Answers by code (`ok` for success).
    answers: HashMap<String, usize>,
    /// Anything the protocol forbids.
    violations: Vec<String>,
    /// The terminal status each completion or start failure was told, by run.
    told: HashMap<RunId, TerminalStatus>,
    /// Attempts deliberately abandoned.
    abandoned: usize,
    /// The receipt of each log stored and completed with, by run.
    logs: HashMap<RunId, Receipt>,
}

struct Agent {
    http: ureq::Agent,
    /// With logs: uploads go on a connection of their own (behind a balancer, often to
    /// another replica than the completion).
    uploads: Option<ureq::Agent>,
    urls: Vec<String>,
    next: usize,
    tally: Arc<Mutex<Tally>>,
    deadline: Instant,
}

impl Agent {
    fn new(dir: &Path, worker: &WorkerId, urls: Vec<String>, tally: Arc<Mutex<Tally>>, deadline: Instant) -> Self {
        let (enrolled, _) =
            ql_control::pki::enroll(dir, worker, &dir.join("workers"), ql_control::pki::WORKER_VALIDITY)
                .expect("enroll");
        let http = worker_client::client(&enrolled, Duration::from_secs(30));
        let uploads = Some(worker_client::client(&enrolled, Duration::from_secs(30)));
        Self { http, uploads, urls, next: 0, tally, deadline }
    }

    /// An agent that completes without a log.
    fn without_logs(mut self) -> Self {
        self.uploads = None;
        self
    }

    /// Uploads `content` as the attempt's log, repeating on `unavailable` or a cut
    /// connection; `Err` with the code of any other refusal.
    fn upload(&mut self, path: &AttemptPath, fence: &Fence, content: &[u8]) -> Result<Receipt, ErrorCode> {
        let route = Route::Artifact(path.clone(), ArtifactId::parse("log").unwrap());
        let header = ArtifactHeader::new(fence.clone(), ArtifactSchema, content.len() as u64, false);
        let mut frame = encode_prefix(&header).unwrap().to_vec();
        frame.extend_from_slice(content);
        let mut backoff = Duration::from_millis(10);
        loop {
            let url = &self.urls[self.next % self.urls.len()];
            self.next += 1;
            let http = self.uploads.as_ref().expect("an agent with logs");
            let sent =
                http.put(format!("{url}{}", route.path())).header("content-type", ARTIFACT_MEDIA_TYPE).send(&frame[..]);
            let answer = sent.ok().and_then(|mut r| Some((r.status().as_u16(), r.body_mut().read_to_vec().ok()?)));
            let code = match answer {
                Some((200, bytes)) => {
                    self.note("upload ok");
                    return Ok(decode::<ArtifactReply>(&bytes).expect("an artifact reply").receipt);
                }
                Some((_, bytes)) => decode::<ErrorBody>(&bytes).map(|b| b.error).unwrap_or(ErrorCode::Unavailable),
                None => ErrorCode::Unavailable,
            };
            self.note(&format!("upload {}", code.as_str()));
            if code != ErrorCode::Unavailable || Instant::now() >= self.deadline {
                return Err(code);
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(300));
        }
    }

    fn note(&self, what: &str) {
        *self.tally.lock().unwrap().answers.entry(what.to_owned()).or_default() += 1;
    }

    fn violation(&self, what: String) {
        self.tally.lock().unwrap().violations.push(what);
    }

    /// One request to the next replica; `Err(Unavailable)` also for a dropped connection.
    fn once<Req: Body, Resp: Body>(&mut self, route: &Route, body: &Req) -> Result<Resp, ErrorCode> {
        let url = &self.urls[self.next % self.urls.len()];
        self.next += 1;
        let sent = self
            .http
            .post(format!("{url}{}", route.path()))
            .header("Content-Type", "application/json")
            .send(&encode(body)[..]);
        let Ok(mut resp) = sent else {
            self.note("transport");
            return Err(ErrorCode::Unavailable);
        };
        let Ok(bytes) = resp.body_mut().read_to_vec() else {
            self.note("transport");
            return Err(ErrorCode::Unavailable);
        };
        if resp.status().is_success() {
            self.note("ok");
            return Ok(decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", route.name())));
        }
        let code = decode::<ErrorBody>(&bytes).map(|b| b.error).unwrap_or_else(|_| {
            self.violation(format!("{} {}: {}", route.name(), resp.status(), String::from_utf8_lossy(&bytes)));
            ErrorCode::Unavailable
        });
        self.note(code.as_str());
        Err(code)
    }

    /// Repeats a request while the authority is unavailable (safe, per the protocol).
    fn call<Req: Body, Resp: Body>(&mut self, route: &Route, body: &Req) -> Result<Resp, ErrorCode> {
        let mut backoff = Duration::from_millis(10);
        loop {
            match self.once(route, body) {
                Err(ErrorCode::Unavailable) if Instant::now() < self.deadline => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(300));
                }
                other => return other,
            }
        }
    }
}

fn open_session(a: &mut Agent, worker: &WorkerId) -> SessionOpened {
    let body = OpenSession {
        agent_version: "stress".parse().unwrap(),
        arch: "x86_64".parse().unwrap(),
        labels: Default::default(),
        capacity: 1,
    };
    a.call(&Route::OpenSession(worker.clone()), &body).expect("open a session")
}

/// One agent: takes offers until `stop`, driving each attempt along a path its seed picks.
fn agent_loop(index: usize, mut a: Agent, stop: Arc<AtomicBool>) {
    let worker = WorkerId::parse(format!("agent-{index}")).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((index as u64 + 1) * 0x1000_0001));
    let mut session = open_session(&mut a, &worker);
    while !stop.load(Ordering::SeqCst) && Instant::now() < a.deadline {
        let poll = PollOffers { generation: session.generation, wait_ms: 200, max: 1 };
        let offers: Offers = match a.call(&Route::PollOffers(worker.clone(), session.session_id.clone()), &poll) {
            Ok(o) => o,
            Err(ErrorCode::SessionConflict) => {
                session = open_session(&mut a, &worker);
                continue;
            }
            Err(code) => {
                a.violation(format!("poll: {code}"));
                continue;
            }
        };
        let Some(offer) = offers.offers.into_iter().next() else { continue };
        let (token, claim) = worker_client::claim(&session, &offer);
        let route = Route::Claim(worker.clone(), session.session_id.clone(), offer.offer_id.clone());
        let claimed: Claimed = match a.call(&route, &claim) {
            Ok(c) => c,
            // Withdrawn by a cancel, lapsed, or our session was replaced meanwhile.
            Err(ErrorCode::OfferConflict | ErrorCode::SessionConflict | ErrorCode::NotFound) => continue,
            Err(code) => {
                a.violation(format!("claim: {code}"));
                continue;
            }
        };
        let (path, mut fence) = worker_client::claimed(&worker, &session, &offer, token, &claimed);
        let at = |cmd| Route::Attempt(path.clone(), cmd);
        let fate = rng.below(100);
        if fate < 4 {
            a.tally.lock().unwrap().abandoned += 1;
            continue; // a crash: the lease lapses and a sweeper takes it back
        }
        // A refusal on a live attempt is legitimate only as one of these (a cancel or
        // sweep got there first); anything else is a violation.
        let gone = |code: ErrorCode| {
            matches!(code, ErrorCode::LeaseConflict | ErrorCode::AlreadyTerminal | ErrorCode::SessionConflict)
        };
        match a.call::<_, AckReply>(&at(AttemptCommand::Starting), &fence) {
            Ok(r) if matches!(r.result, Outcome::Started | Outcome::AlreadyStarting) => {}
            Ok(r) => a.violation(format!("starting answered {:?}", r.result)),
            Err(code) if gone(code) => continue,
            Err(code) => {
                a.violation(format!("starting: {code}"));
                continue;
            }
        }
        if fate.is_multiple_of(3) {
            match a.call::<_, AckReply>(&at(AttemptCommand::Starting), &fence) {
                Ok(r) if r.result == Outcome::AlreadyStarting => {}
                Err(code) if gone(code) => continue,
                other => a.violation(format!("starting replay: {other:?}")),
            }
        }
        if fate < 14 {
            let body = StartFailure::new(fence.clone(), Reason::parse("spawn failed").unwrap());
            let first = a.call::<_, AckReply>(&at(AttemptCommand::StartFailure), &body);
            let Ok(first) = first else {
                if !gone(first.unwrap_err()) {
                    a.violation("start-failure refused".into());
                }
                continue;
            };
            let status = match first.result {
                Outcome::Failed => TerminalStatus::Failed,
                Outcome::Cancelled => TerminalStatus::Cancelled,
                Outcome::TimedOut => TerminalStatus::TimedOut,
                other => {
                    a.violation(format!("start-failure answered {other:?}"));
                    continue;
                }
            };
            a.tally.lock().unwrap().told.insert(offer.run_id.clone(), status);
            match a.call::<_, AckReply>(&at(AttemptCommand::StartFailure), &body) {
                Ok(r) if r == first => {}
                other => a.violation(format!("start-failure replay: {other:?} after {first:?}")),
            }
            continue;
        }
        let callback = Token::generate().unwrap();
        let log_id = a.uploads.is_some().then(|| ArtifactId::parse("log").unwrap());
        let running =
            Running::new(fence.clone(), "pid:1 start:1".parse().unwrap(), log_id, Counter::ONE, callback.digest());
        match a.call::<_, AckReply>(&at(AttemptCommand::Running), &running) {
            Ok(r) if matches!(r.result, Outcome::Running | Outcome::AlreadyRunning) => {}
            Ok(r) => a.violation(format!("running answered {:?}", r.result)),
            Err(code) if gone(code) => continue,
            Err(code) => {
                a.violation(format!("running: {code}"));
                continue;
            }
        }
        if fate.is_multiple_of(4) {
            match a.call::<_, AckReply>(&at(AttemptCommand::Running), &running) {
                Ok(r) if r.result == Outcome::AlreadyRunning => {}
                Err(code) if gone(code) => continue,
                other => a.violation(format!("running replay: {other:?}")),
            }
        }
        let mut lost = false;
        for _ in 0..rng.below(4) {
            match a.call::<_, Renewed>(&at(AttemptCommand::RenewLease), &fence) {
                Ok(r) => {
                    fence.expected_lease_version = r.lease_version;
                    if r.stop.is_some() {
                        break; // stop the job, then complete normally
                    }
                }
                Err(code) if gone(code) => {
                    lost = true;
                    break;
                }
                Err(code) => {
                    a.violation(format!("renew: {code}"));
                    lost = true;
                    break;
                }
            }
        }
        if lost {
            continue;
        }
        let receipt = if a.uploads.is_some() {
            // A log of its own for every attempt, from a line to the spec's 64 KiB limit.
            let line = format!("{} of {} says {}\n", offer.attempt_id, offer.run_id, rng.below(1_000_000));
            let mut content = line.repeat(1 + rng.below(1_000) as usize).into_bytes();
            content.truncate(65_536);
            match a.upload(&path, &fence, &content) {
                Ok(receipt) => Some(receipt),
                Err(code) if gone(code) => continue,
                Err(code) => {
                    a.violation(format!("upload: {code}"));
                    continue;
                }
            }
        } else {
            None
        };
        let exit = if fate.is_multiple_of(5) { 1 } else { 0 };
        let done = Completion::new(
            fence.clone(),
            CompletionSchema,
            Counter::ONE,
            callback.clone(),
            Some(exit),
            None,
            Timestamp::from_millis(1_700_000_000_000).unwrap(),
            receipt.clone(),
        );
        let first = match a.call::<_, CompletionReply>(&at(AttemptCommand::Completion), &done) {
            Ok(r) => r,
            Err(code) if gone(code) => continue,
            Err(code) => {
                a.violation(format!("completion: {code}"));
                continue;
            }
        };
        let mut tally = a.tally.lock().unwrap();
        tally.told.insert(offer.run_id.clone(), first.status);
        if let Some(receipt) = receipt {
            tally.logs.insert(offer.run_id.clone(), receipt);
        }
        drop(tally);
        if fate.is_multiple_of(2) {
            match a.call::<_, CompletionReply>(&at(AttemptCommand::Completion), &done) {
                Ok(r) if r.result == Outcome::AlreadyCompleted && r.status == first.status => {}
                other => a.violation(format!("completion replay: {other:?} after {first:?}")),
            }
        }
    }
}

/// Runs `runs` runs through `replicas` servers on `database` with `agents` agents while
/// an operator cancels some; `restart` is called once, a third of the way through.
/// What a stress does to the system once a third of its runs ended (it may read what the
/// agents saw so far).
type Disruption = Box<dyn FnOnce(Arc<Mutex<Tally>>) + Send>;

async fn stress(db_url: &str, replicas: usize, agents: usize, runs: usize, restart: Option<Disruption>) {
    let tmp = TempDir::new("pg-replicas");
    let dir = state_dir(&tmp);
    let servers: Vec<Server> = (0..replicas).map(|_| Server::start(&dir, db_url)).collect();
    let urls: Vec<String> = servers.iter().map(|s| s.url.clone()).collect();
    let logs = false;
    stress_on(db_url, &dir, urls, logs, agents, runs, restart).await;
    drop(servers);
}

/// The stress of [`stress`] against servers already running at `urls`, agents enrolled
/// with the CA of `dir`, completing with a log each when `logs`; what the agents saw.
async fn stress_on(
    db_url: &str,
    dir: &Path,
    urls: Vec<String>,
    logs: bool,
    agents: usize,
    runs: usize,
    restart: Option<Disruption>,
) -> Tally {
    let store = PgStore::open(db_url, PgOptions { pool_size: 2, ..PgOptions::default() }).await.unwrap();

    let mut ids = Vec::with_capacity(runs);
    for _ in 0..runs {
        let submit = Submit {
            project: contract::project(),
            spec: spec(600_000),
            labels: Default::default(),
            agent_labels: Default::default(),
            retry_budget: 1,
            notify: None,
        };
        match store.execute(Cmd::Submit(submit)).await.unwrap() {
            Ok(Reply::Submitted(id)) => ids.push(id),
            other => panic!("submit: {other:?}"),
        }
    }

    let started = Instant::now();
    let deadline = started + Duration::from_secs(240);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..agents)
        .map(|i| {
            let a =
                Agent::new(dir, &WorkerId::parse(format!("agent-{i}")).unwrap(), urls.clone(), tally.clone(), deadline);
            let a = if logs { a } else { a.without_logs() };
            let stop = stop.clone();
            std::thread::spawn(move || agent_loop(i, a, stop))
        })
        .collect();

    // The operator: cancels one run in twenty, at random moments, and watches progress.
    let mut rng = Rng(42);
    let mut restart = restart;
    let mut cancels = 0;
    let mut done = 0;
    while Instant::now() < deadline {
        if cancels < runs / 20 {
            let run = &ids[rng.below(runs as u64) as usize];
            if let Ok(Ok(_)) = store.execute(Cmd::Cancel(run.clone())).await {
                cancels += 1;
            }
        }
        if let Ok(all) = store.runs(&ql_control::store::RunQuery::latest(runs + 10)).await {
            done = all.iter().filter(|r| r.status.is_terminal()).count();
            if done == runs {
                break;
            }
        }
        if done >= runs / 3 {
            if let Some(f) = restart.take() {
                let tally = tally.clone();
                tokio::task::spawn_blocking(move || f(tally)).await.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    assert!(restart.is_none(), "the disruption ran");
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    eprintln!(
        "{runs} runs through {} address(es), {agents} agents, {cancels} cancels, {} abandoned: {done} ended in \
         {elapsed:.1?}; answers {:?}",
        urls.len(),
        tally.abandoned,
        tally.answers
    );
    assert!(tally.violations.is_empty(), "protocol violations: {:#?}", tally.violations);
    assert_eq!(done, runs, "every run ended before the deadline");

    let snap = store.snapshot().await.unwrap();
    check_invariants(&snap);
    let status: HashMap<&RunId, RunStatus> = snap.runs.iter().map(|r| (&r.id, r.status)).collect();
    for (run, told) in &tally.told {
        let want = match told {
            TerminalStatus::Succeeded => RunStatus::Succeeded,
            TerminalStatus::Failed => RunStatus::Failed,
            TerminalStatus::Cancelled => RunStatus::Cancelled,
            TerminalStatus::TimedOut => RunStatus::TimedOut,
        };
        assert_eq!(status[run], want, "run {run}: the agent was told {told:?}");
    }
    for (run, receipt) in &tally.logs {
        let attempt = snap.attempts.iter().find(|a| &a.run == run && a.artifact.is_some());
        assert_eq!(attempt.and_then(|a| a.artifact.as_ref()), Some(receipt), "run {run}: the log completed with");
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_a_thousand_runs_racing_end_each_run_once() {
    let db = TestDb::new("replicas").await;
    stress(&db.runtime_url(), 2, 8, 1_000, None).await;
}

/// The replicas the design records draw: separate state directories (the second made by
/// `init --replica-of`, without the CA key), one PostgreSQL database, one S3 bucket,
/// agents behind a round-robin TCP proxy that cuts some connections mid-answer. Uploads
/// and completions land on either replica; the bucket is stopped for a while a third of
/// the way through. Every run ends once, and every log is read back through each
/// replica's operator API with its SHA-256 checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_only_postgres_and_a_bucket_serve_every_log_from_either() {
    let db = TestDb::new("bucket").await;
    let url = db.runtime_url();
    let tmp = TempDir::new("pg-bucket");
    let a_dir = state_dir(&tmp);
    let b_dir = tmp.path().join("replica-b");
    let made = Command::new(BIN)
        .args(["init", "--host", "127.0.0.1", "--replica-of"])
        .arg(&a_dir)
        .arg("--dir")
        .arg(&b_dir)
        .output()
        .unwrap();
    assert!(made.status.success(), "init --replica-of: {}", String::from_utf8_lossy(&made.stderr));
    assert!(!b_dir.join("pki/ca.key").exists(), "only the replicas that enrol get the CA key");
    assert!(!b_dir.join("control.db").exists() && !b_dir.join("artifacts").exists(), "nothing shared on a disk");

    let bucket = Arc::new(Mutex::new(s3::S3Server::start("replicas")));
    let env = bucket.lock().unwrap().env();
    let artifacts = format!("s3://{}/replicas", s3::BUCKET);
    let log = |name: &str| std::fs::File::create(tmp.path().join(name)).unwrap();
    let args = ["--artifacts", artifacts.as_str(), "--operator-listen", "127.0.0.1:0"];
    let servers = [
        Server::start_with(&a_dir, &url, log("a.err"), &args, &env),
        Server::start_with(&b_dir, &url, log("b.err"), &args, &env),
    ];
    for name in ["a.err", "b.err"] {
        let said = std::fs::read_to_string(tmp.path().join(name)).unwrap();
        assert!(said.contains(&format!("artifacts in {artifacts} at ")), "{name}: {said}");
        assert!(!said.contains(s3::SECRET_KEY), "{name}: {said}");
    }
    let proxy = proxy::Proxy::start(servers.iter().map(Server::addr).collect(), 3);
    let outage = {
        let bucket = bucket.clone();
        move |tally: Arc<Mutex<Tally>>| {
            bucket.lock().unwrap().stop();
            // Down until an upload has met the outage (refused, to be repeated), then back.
            let met = || tally.lock().unwrap().answers.get("upload unavailable").is_some_and(|&n| n > 0);
            let end = Instant::now() + Duration::from_secs(60);
            while !met() {
                assert!(Instant::now() < end, "no upload met the bucket's outage");
                std::thread::sleep(Duration::from_millis(20));
            }
            bucket.lock().unwrap().restart();
        }
    };
    let tally = stress_on(&url, &a_dir, vec![proxy.url()], true, 8, 500, Some(Box::new(outage))).await;
    let connections = proxy.connections();
    eprintln!("connections per replica {connections:?}, {} cut", proxy.cuts());
    assert!(connections.iter().all(|&n| n >= 8), "both replicas served agents: {connections:?}");
    assert!(proxy.cuts() > 0, "some answers were lost on the way");
    assert!(
        tally.answers.get("upload unavailable").is_some_and(|&n| n > 0),
        "the bucket outage was met: {:?}",
        tally.answers
    );
    assert!(tally.logs.len() >= 300, "most runs stored a log: {}", tally.logs.len());

    // Every log, from either replica: the bytes' SHA-256 is the receipt's.
    let token = {
        let out = Command::new(BIN)
            .args(["operator", "add", "reader", "--role", "read", "--database", &url, "--dir"])
            .arg(&a_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "operator add: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().lines().nth(1).unwrap().trim().to_owned()
    };
    let roots = ql_control::client::certificates(&std::fs::read(a_dir.join("pki/ca.crt")).unwrap());
    let http = ql_control::client::agent(&roots, true, Some(Duration::from_secs(30)));
    for (run, receipt) in &tally.logs {
        for server in &servers {
            let base = server.operator_url.as_deref().unwrap();
            let mut resp = http
                .get(format!("{base}/v1/runs/{run}/log?limit={}", 4 * 1024 * 1024))
                .header("authorization", format!("Bearer {token}"))
                .call()
                .unwrap();
            let bytes = resp.body_mut().with_config().limit(u64::MAX).read_to_vec().unwrap();
            assert_eq!(resp.status(), 200, "{run} from {base}: {}", String::from_utf8_lossy(&bytes));
            assert_eq!(bytes.len() as u64, receipt.length, "{run} from {base}");
            assert_eq!(Digest::of(&bytes), receipt.sha256, "{run} from {base}");
        }
    }
    // And by the operator command on replica B's machine, which has no artifacts directory:
    // the store is the bucket its flag names.
    for (run, receipt) in tally.logs.iter().take(3) {
        let out = Command::new(BIN)
            .args(["logs", &run.to_string(), "--database", &url, "--artifacts", &artifacts, "--dir"])
            .arg(&b_dir)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap();
        assert!(out.status.success(), "logs {run}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(Digest::of(&out.stdout), receipt.sha256, "logs {run} --artifacts");
    }
    drop(servers);
}

/// A throwaway cluster of this test's own (it restarts it), removed when dropped.
struct Cluster(PathBuf);

impl Cluster {
    fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg")
    }

    fn start(tmp: &TempDir) -> (Self, HashMap<String, String>) {
        let dir = tmp.path().join("cluster");
        let out = Command::new(Self::script()).arg("start").arg(&dir).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            contract::pg::HOW_TO_GET_POSTGRES,
            String::from_utf8_lossy(&out.stderr)
        );
        let env = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.trim_matches('\'').to_owned()))
            .collect();
        (Self(dir), env)
    }

    fn restart(&self) {
        let out = Command::new(Self::script()).arg("restart").arg(&self.0).output().unwrap();
        assert!(out.status.success(), "restart: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(Self::script()).arg("stop").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_ride_through_a_postgres_restart_and_converge() {
    let tmp = TempDir::new("pg-restart");
    let (cluster, env) = Cluster::start(&tmp);
    ql_control::store::postgres::migrate(&env["QL_PG_OWNER_URL"]).await.unwrap();
    let cluster = Arc::new(cluster);
    let c = cluster.clone();
    stress(&env["QL_PG_URL"], 2, 6, 300, Some(Box::new(move |_| c.restart()))).await;
    drop(cluster);
}

/// A run held at `running` by `worker` through `a`: its path, fence and callback token.
fn hold(a: &mut Agent, worker: &WorkerId) -> (ql_wire::route::AttemptPath, ql_wire::Fence, Token) {
    let session = open_session(a, worker);
    let poll = PollOffers { generation: session.generation, wait_ms: 5_000, max: 1 };
    let offers: Offers =
        a.call(&Route::PollOffers(worker.clone(), session.session_id.clone()), &poll).expect("an offer");
    let offer = offers.offers.into_iter().next().expect("the run is offered");
    let (token, claim) = worker_client::claim(&session, &offer);
    let claimed: Claimed = a
        .call(&Route::Claim(worker.clone(), session.session_id.clone(), offer.offer_id.clone()), &claim)
        .expect("claimed");
    let (path, fence) = worker_client::claimed(worker, &session, &offer, token, &claimed);
    let _: AckReply = a.call(&Route::Attempt(path.clone(), AttemptCommand::Starting), &fence).expect("starting");
    let callback = Token::generate().unwrap();
    let running = Running::new(fence.clone(), "pid:1 start:1".parse().unwrap(), None, Counter::ONE, callback.digest());
    let _: AckReply = a.call(&Route::Attempt(path.clone(), AttemptCommand::Running), &running).expect("running");
    (path, fence, callback)
}

/// Outage grace across replicas: while one replica serves, another's restart gives no
/// grace and a lease nobody renews lapses; when every replica was down, the first one back
/// gives the absence back and the held lease renews and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_grace_is_given_only_when_no_replica_served() {
    let db = TestDb::new("grace").await;
    let tmp = TempDir::new("pg-grace");
    let dir = state_dir(&tmp);
    let layout = Layout::new(&dir);
    // The worker opens a second session while its first still speaks: no takeover window.
    let config =
        Config { outage_grace_after_ms: 1_000, session_takeover_after_ms: 0, ..Config::load(&layout).unwrap() };
    config.save(&layout).unwrap();
    let url = db.runtime_url();
    let store = PgStore::open(&url, PgOptions { pool_size: 2, ..PgOptions::default() }).await.unwrap();
    let log = |name: &str| std::fs::File::create(tmp.path().join(name)).unwrap();
    let read = |name: &str| std::fs::read_to_string(tmp.path().join(name)).unwrap_or_default();
    let submit = || async {
        let submit = Submit {
            project: contract::project(),
            spec: spec(600_000),
            labels: Default::default(),
            agent_labels: Default::default(),
            retry_budget: 0,
            notify: None,
        };
        match store.execute(Cmd::Submit(submit)).await.unwrap() {
            Ok(Reply::Submitted(id)) => id,
            other => panic!("submit: {other:?}"),
        }
    };
    let status = |run: RunId| {
        let store = store.clone();
        async move { store.run_detail(&run).await.unwrap().unwrap().run.status }
    };
    let worker = WorkerId::parse("w-grace").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let tally = Arc::new(Mutex::new(Tally::default()));

    // One replica down, the other serving: the lease lapses, and the restart gives nothing.
    let a = Server::start_logged(&dir, &url, log("a1.err"));
    let b = Server::start_logged(&dir, &url, log("b.err"));
    let first = submit().await;
    let mut agent = Agent::new(&dir, &worker, vec![a.url.clone()], tally.clone(), deadline);
    let (path, fence, _) = hold(&mut agent, &worker);
    drop(a);
    while status(first.clone()).await != RunStatus::Failed {
        assert!(Instant::now() < deadline, "replica b never swept the lapsed lease");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = Server::start_logged(&dir, &url, log("a2.err"));
    agent.urls = vec![a.url.clone()];
    let refused = agent.call::<_, Renewed>(&Route::Attempt(path, AttemptCommand::RenewLease), &fence);
    assert_eq!(refused.unwrap_err(), ErrorCode::LeaseConflict, "the lapse was real: b served throughout");
    assert!(!read("a2.err").contains("gave that time back"), "{}", read("a2.err"));

    // Every replica down for longer than the lease: the first one back gives it back.
    let second = submit().await;
    let (path, mut fence, callback) = hold(&mut agent, &worker);
    drop(a);
    drop(b);
    // The outage itself, longer than the lease's 3 s (not a wait for anything).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let a = Server::start_logged(&dir, &url, log("a3.err"));
    agent.urls = vec![a.url.clone()];
    let renewed: Renewed = agent
        .call(&Route::Attempt(path.clone(), AttemptCommand::RenewLease), &fence)
        .expect("renewed after the outage");
    fence.expected_lease_version = renewed.lease_version;
    let done = Completion::new(
        fence,
        CompletionSchema,
        Counter::ONE,
        callback,
        Some(0),
        None,
        Timestamp::from_millis(0).unwrap(),
        None,
    );
    let reply: CompletionReply = agent.call(&Route::Attempt(path, AttemptCommand::Completion), &done).expect("done");
    assert_eq!(reply.status, TerminalStatus::Succeeded);
    assert_eq!(status(second).await, RunStatus::Succeeded);
    assert!(read("a3.err").contains("gave that time back to 1 lease(s)"), "{}", read("a3.err"));
    check_invariants(&store.snapshot().await.unwrap());
    drop(a);
}

/// The README's PostgreSQL commands as an operator types them: `migrate` as the owner
/// (twice, as an upgrade does), then `serve`, `submit` and `runs` as the runtime role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_postgres_commands_migrate_then_serve_submit_and_list() {
    let db = TestDb::unmigrated("readme").await;
    let tmp = TempDir::new("pg-readme");
    let dir = state_dir(&tmp);
    let cli = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let owner = db.url("ql_owner");
    let runtime = db.runtime_url();
    let first = cli(&["migrate", "--database", &owner]);
    let again = cli(&["migrate", "--database", &owner]);
    let now = first.trim().strip_prefix("schema version 0 -> ").unwrap_or_else(|| panic!("first migrate: {first:?}"));
    assert_eq!(again.trim(), format!("schema version {now} -> {now}"), "the second migrate has nothing to apply");
    let _server = Server::start(&dir, &runtime);
    let dir = dir.to_str().unwrap();
    let run = cli(&["submit", "--dir", dir, "--database", &runtime, "--", "sh", "-c", "echo hello"]);
    let run = run.trim();
    assert!(run.starts_with("run_"), "submit printed {run:?}");
    let runs = cli(&["runs", "--dir", dir, "--database", &runtime]);
    let row = runs.lines().find(|l| l.starts_with(run)).unwrap_or_else(|| panic!("{run} not in:\n{runs}"));
    assert!(row.contains("queued"), "{row}");
}

/// Two replicas serving one fresh database, with a store handle on it. Field order is
/// drop order: the servers stop before the database goes.
struct Replicas {
    _a: Server,
    b: Server,
    store: PgStore,
    url: String,
    dir: PathBuf,
    _tmp: TempDir,
    _db: TestDb,
}

impl Replicas {
    async fn start(name: &str) -> Self {
        let db = TestDb::new(name).await;
        let tmp = TempDir::new(&format!("pg-{name}"));
        let dir = state_dir(&tmp);
        let url = db.runtime_url();
        let store = PgStore::open(&url, PgOptions { pool_size: 2, ..PgOptions::default() }).await.unwrap();
        let (a, b) = (Server::start(&dir, &url), Server::start(&dir, &url));
        Self { _a: a, b, store, url, dir, _tmp: tmp, _db: db }
    }
}

/// A revocation given to one replica's database is seen by the other at once: the
/// revoked worker's next request to replica b, on the connection it already had, is
/// refused, and its running attempt was queued again in the revocation's transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_revoked_through_the_database_is_refused_by_every_replica_at_once() {
    let r = Replicas::start("revoke").await;
    let (dir, url, store, b) = (r.dir.clone(), r.url.clone(), &r.store, &r.b);
    let submit = Submit {
        project: contract::project(),
        spec: spec(600_000),
        labels: Default::default(),
        agent_labels: Default::default(),
        retry_budget: 1,
        notify: None,
    };
    let Ok(Reply::Submitted(run)) = store.execute(Cmd::Submit(submit)).await.unwrap() else { panic!("submit") };
    let worker = WorkerId::parse("w-revoked").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut agent = Agent::new(&dir, &worker, vec![b.url.clone()], Arc::default(), deadline);
    let (path, fence, _) = hold(&mut agent, &worker);

    // The operator revokes it with the CLI, against the database (as on replica a).
    let out = Command::new(BIN)
        .args(["workers", "revoke", worker.as_str(), "--database", &url, "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let detail = store.run_detail(&run).await.unwrap().unwrap();
    assert_eq!((detail.run.status, detail.run.retries_used), (RunStatus::Queued, 1));
    assert_eq!(detail.attempts[0].error_code.as_deref(), Some(ql_control::core::WORKER_REVOKED));

    let refused = agent.once::<_, Renewed>(&Route::Attempt(path, AttemptCommand::RenewLease), &fence);
    assert_eq!(refused.unwrap_err(), ErrorCode::CertificateRevoked);
    let audits = store.audits().await.unwrap();
    assert_eq!(audits.last().map(|a| a.outcome.as_str()), Some("certificate_revoked"));
    check_invariants(&store.snapshot().await.unwrap());
}

/// A schedule firing every second on two replicas of one PostgreSQL database: each fire
/// time fires once, and each queued fire has exactly one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_on_two_replicas_fires_each_time_once() {
    let r = Replicas::start("schedules").await;
    let (dir, url, store) = (r.dir.clone(), r.url.clone(), &r.store);
    let out = Command::new(BIN)
        .args(["schedule", "add", "tick", "--cron", "* * * * * *", "--overlap", "allow", "--database", &url, "--dir"])
        .arg(&dir)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.fires("tick", 100).await.unwrap().len() < 5 {
        assert!(Instant::now() < deadline, "the schedule did not fire five times");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(store.execute(Cmd::PauseSchedule("tick".into(), true)).await.unwrap().is_ok());
    let fires = store.fires("tick", 1000).await.unwrap();
    let times: std::collections::BTreeSet<i64> = fires.iter().map(|f| f.fire_at).collect();
    assert_eq!(times.len(), fires.len(), "no fire time twice");
    let query =
        ql_control::store::RunQuery { schedule: Some("tick".into()), ..ql_control::store::RunQuery::latest(1000) };
    let runs = store.runs(&query).await.unwrap();
    let fired: std::collections::BTreeSet<_> = fires.iter().filter_map(|f| f.run.clone()).collect();
    assert_eq!(fired.len(), fires.iter().filter(|f| f.run.is_some()).count());
    assert_eq!(fired, runs.iter().map(|r| r.id.clone()).collect(), "one run per queued fire, and no other");
}
