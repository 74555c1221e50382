//! The crash, power-loss and network-fault matrix (issue 5): every run converges, nothing
//! twice.
//!
//! Built only with the `faults` feature (`required-features` in `Cargo.toml`), which compiles
//! the fault points into `ql-agent` (`src/fault.rs`) and, for the `ql-control` this test
//! builds, into the control plane (`crates/ql-control/src/fault.rs`). Run it with
//! `scripts/fault-matrix`, which prints the table, or as part of `scripts/test`.
//!
//! Each cell is one scenario: a fresh control plane (a copy of one initialised state
//! directory) and a fresh agent, one job with one outcome (success, failure (exit 3),
//! cancel, timeout, or a program that cannot start), one fault. Agent faults SIGKILL the
//! agent at a named point; control faults commit then drop the answer, delay it past the
//! agent's timeout, crash after the commit, refuse with 503, or reset the connection in the
//! middle of a request or an upload. Whatever died is restarted (the agent from the same
//! state directory, ql-control from the same database on the same port) and then:
//!
//! - the run reaches exactly one terminal state, the expected one: the job's own outcome,
//!   whenever the agent died — a job outlives its agent under its supervisor, which keeps
//!   its output and records its exit, and the restarted agent takes it back or reports the
//!   recorded exit; a process that finished before the crash completes from its durable
//!   exit evidence, including from `starting` (ADR-0117);
//! - each event type exists at most once per attempt;
//! - the stored log is the spool's: the job prints 256 KiB of known lines, so the stored
//!   log is exactly them when the process finished by itself, a prefix of them when it was
//!   stopped, and `ql-control logs` checks its SHA-256 against the receipt; a run without a
//!   log failed with a clear error code;
//! - the job's process started at most once (it appends its pid to a file) and none of its
//!   processes (found by a tag in their environment) is left running;
//! - the agent's journal ends with no job in it, and no lease is left `leased`;
//! - agents restarted at once converge by their own reports, never by lease expiry.
//!
//! Also: the starting-only window of ADR-0117 (the process finished while `running` was
//! refused, then the agent died); recovery after an expired lease and after a replaced
//! session (the job is stopped and nothing is sent on the stale lease); and torn journals:
//! the agent is killed after each record of a run, then the journal is cut one byte short
//! (the last record torn) or given one stray byte (a torn next record), and restarted. Every
//! byte offset is covered in-process by the journal's and the core's own tests
//! (`truncation_at_every_offset_*`); end to end, every record boundary and one byte either
//! side of it.
//!
//! The `ql-control` with fault points is built on first use (`cargo build -p ql-control
//! --features faults`, same profile and target directory), or taken from
//! `QL_CONTROL_FAULTS_BIN`.
//!
//! Timings are short on both sides (lease 1.5 s, heartbeat 0.3 s, call timeout 0.7 s) and
//! scenarios run three at a time (`QL_MATRIX_THREADS`). `QL_MATRIX_ONLY=text` runs the cells
//! whose row name contains `text`.

mod common;

use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ql_wire::route::Route;
use serde_json::Value;

use common::{agent_config, build_control, init_control, read_journal, tagged_processes, Agent, Control, TempDir};

/// The control plane's timings for every scenario.
const TIMINGS: &[(&str, u64)] = &[
    ("heartbeat_ms", 300),
    ("session_ttl_ms", 3_000),
    ("offer_ttl_ms", 2_000),
    ("lease_ttl_ms", 1_500),
    ("sweep_interval_ms", 100),
    ("change_poll_ms", 20),
    ("read_timeout_ms", 2_000),
];

/// The agent's settings for every scenario.
const AGENT: &[(&str, &str)] = &[
    ("poll_wait_ms", "1000"),
    ("busy_poll_wait_ms", "100"),
    ("stop_grace_ms", "300"),
    ("group_poll_ms", "20"),
    ("drain_timeout_ms", "2000"),
    ("connect_timeout_ms", "1000"),
    ("call_timeout_ms", "700"),
    // Below two thirds of the lease: a blocked upload cannot outlast the lease.
    ("upload_timeout_ms", "700"),
    ("backoff_initial_ms", "30"),
    ("backoff_max_ms", "300"),
    ("log_level", "debug"),
    // The log streams only once the process ended, in four 64 KiB chunks, so every fault
    // point of the live log has one phase; rows that stream while the job runs say so
    // (`Row::streams`, [`STREAMING`]).
    ("log_flush_bytes", "67108864"),
    ("log_flush_ms", "3600000"),
    ("log_chunk_bytes", "65536"),
];

/// What a row that streams the log while the job runs sets on top of [`AGENT`].
const STREAMING: &[(&str, &str)] = &[("log_flush_bytes", "65536"), ("log_flush_ms", "50")];

/// How long a delayed answer is held back: past the call and the upload timeouts.
const DELAY_MS: &str = "1800";
/// The timeout of the timeout outcome's job: shorter than the lease, so a job whose agent
/// died reaches its deadline before its lease can lapse.
const JOB_TIMEOUT_MS: u64 = 1_200;
/// The environment variable that tags a scenario's job processes.
const TAG: &str = "QL_MATRIX_TAG";
/// How long one scenario may take.
const CELL_DEADLINE: Duration = Duration::from_secs(45);
/// How often a scenario looks again at what it waits for.
const POLL: Duration = Duration::from_millis(40);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Success,
    Failure,
    Cancel,
    Timeout,
    StartFail,
}

const OUTCOMES: [Outcome; 5] =
    [Outcome::Success, Outcome::Failure, Outcome::Cancel, Outcome::Timeout, Outcome::StartFail];

impl Outcome {
    fn column(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Cancel => "cancel",
            Self::Timeout => "timeout",
            Self::StartFail => "no program",
        }
    }
}

/// Where the process is when the fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No process yet: it is started after the fault.
    Before,
    /// The process runs and has not ended.
    During,
    /// The process ended and its exit is on record.
    After,
}

/// What the test does to the journal of the killed agent before restarting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tear {
    None,
    /// Cut one byte: the last record is torn.
    CutOne,
    /// Add one stray byte: a torn next record.
    AddOne,
}

/// Scenarios that need their own driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Special {
    None,
    /// The agent dies mid-run and comes back only after the lease was swept.
    ExpiredLease,
    /// The agent is frozen mid-run while another agent replaces its session.
    ReplacedSession,
}

#[derive(Debug, Clone)]
struct Row {
    name: String,
    agent: Option<String>,
    control: Option<String>,
    phase: Phase,
    outcomes: Vec<Outcome>,
    tear: Tear,
    special: Special,
    table: usize,
    /// The job is let finish as soon as the agent died, and the agent is restarted only
    /// once the job's leader is gone (what it left behind must still be stopped).
    ends_while_down: bool,
    /// The agent streams the log while the job runs ([`STREAMING`]).
    streams: bool,
}

impl Row {
    fn new(name: &str, agent: Option<&str>, control: Option<&str>, phase: Phase, outcomes: &[Outcome]) -> Row {
        Row {
            name: name.to_owned(),
            agent: agent.map(str::to_owned),
            control: control.map(str::to_owned),
            phase,
            outcomes: outcomes.to_vec(),
            tear: Tear::None,
            special: Special::None,
            table: 0,
            ends_while_down: false,
            streams: false,
        }
    }

    /// Whether the job must stay alive until the control fault fired (renewal faults).
    fn gate_after_fault(&self) -> bool {
        self.agent.is_none() && self.control.as_deref().is_some_and(|c| c.contains("lease.renew"))
    }
}

fn rows() -> Vec<Row> {
    use Outcome::*;
    use Phase::*;
    let four = [Success, Failure, Cancel, Timeout];
    let five = [Success, Failure, Cancel, Timeout, StartFail];
    let mut rows = Vec::new();
    // The agent, SIGKILLed after each journal record and after each answer arrived.
    let agent: &[(&str, Phase, &[Outcome])] = &[
        ("journal:session", Before, &five),
        ("journal:offered", Before, &five),
        ("sent:offer.claim", Before, &five),
        ("journal:claimed", Before, &five),
        ("sent:attempt.starting", Before, &five),
        ("journal:startingAcked", Before, &five),
        ("journal:spawning", Before, &five),
        ("spawned", During, &four),
        ("journal:spawned", During, &four),
        ("journal:callbackMinted", During, &four),
        ("sent:attempt.running", During, &four),
        ("journal:runningAcked", During, &four),
        ("sent:lease.renew@1", During, &four),
        ("journal:renewed@1", During, &four),
        ("sent:lease.renew@2", During, &four),
        ("journal:renewed@2", During, &four),
        // Only a cancel: a timeout is stopped by the agent's own timer, which runs out
        // before a renewal can bring the intent.
        ("journal:stopSeen", During, &[Cancel]),
        ("journal:exited", After, &four),
        ("upload-body@65536", After, &four),
        ("sent:log.append@1", After, &four),
        ("journal:logAcked@1", After, &four),
        ("upload-body@100000", After, &four),
        ("sent:log.append@4", After, &four),
        ("journal:logAcked@4", After, &four),
        ("sent:artifact.seal", After, &four),
        ("journal:artifactStored", After, &four),
        ("sent:attempt.completion", After, &four),
        ("journal:dropped", After, &four),
        ("journal:spawnFailed", Before, &[StartFail]),
        ("sent:attempt.start_failure", Before, &[StartFail]),
    ];
    for (point, phase, outcomes) in agent {
        rows.push(Row::new(&format!("agent {point}"), Some(point), None, *phase, outcomes));
    }
    // The live log while the job runs: the agent dies after a chunk went out, and after one
    // was journaled; the restarted agent goes on from the journal's offset.
    for point in ["sent:log.append@1", "journal:logAcked@2"] {
        let mut row = Row::new(&format!("agent {point} (while the job runs)"), Some(point), None, During, &four);
        row.streams = true;
        rows.push(row);
    }
    // The control plane and the network: each kind of fault at the routes in `routes` but
    // those it leaves out. Heartbeats and the close at a clean exit are left out: they
    // carry no part of a run; so is the abandon of a job lost with its supervisor, which
    // no row loses (its supervisor always outlives the agent here).
    // The one-frame upload is only for a job that ended before its `running` ACK: its
    // faults are rows of the starting-only window below.
    let routes: Vec<&str> = Route::NAMES
        .into_iter()
        .filter(|r| !["session.heartbeat", "session.close", "attempt.abandon", "artifact.put"].contains(r))
        .collect();
    let before_spawn = &routes[..4];
    let kinds: &[(&str, &str, &[&str])] = &[
        ("drop", "", &[]),
        ("delay", "", &["session.open", "offers.poll"]),
        ("crash", "", &["offers.poll"]),
        ("503", "@3", &["session.open"]),
        ("reset", "", &["session.open", "offers.poll"]),
    ];
    for (kind, count, left_out) in kinds {
        for route in routes.iter().filter(|r| !left_out.contains(*r)) {
            let spec = format!("{kind}:{route}{count}");
            let outcomes: Vec<Outcome> = if *route == "attempt.start_failure" {
                vec![StartFail]
            } else if before_spawn.contains(route) {
                five.to_vec()
            } else {
                four.to_vec()
            };
            let name = match (*kind, *route) {
                ("reset", "log.append") => "control reset:log.append (mid-chunk)".to_owned(),
                ("reset", _) => format!("control {spec} (mid-request)"),
                _ => format!("control {spec}"),
            };
            rows.push(Row::new(&name, None, Some(&spec), Phase::Before, &outcomes));
        }
    }
    // The process ends while its agent is down, leaving a background child behind.
    for point in ["journal:spawned", "journal:runningAcked"] {
        let mut row = Row::new(&format!("agent {point}, job ends while down"), Some(point), None, During, &[Success]);
        row.ends_while_down = true;
        row.table = 1;
        rows.push(row);
    }
    // ADR-0117's starting-only window: `running` is refused, the process finishes, its exit
    // is journaled, the agent dies; the restarted agent completes from `starting`.
    let mut starting_only = Row::new(
        "starting-only window (running refused, agent killed after exit)",
        Some("journal:exited"),
        Some("503:attempt.running@1000000"),
        Phase::After,
        &[Success, Failure],
    );
    starting_only.table = 1;
    rows.push(starting_only);
    // The one-frame upload of that window, under each kind of control fault.
    for (kind, count) in [("drop", ""), ("delay", ""), ("crash", ""), ("503", "@3"), ("reset", "")] {
        let spec = format!("503:attempt.running@1000000,{kind}:artifact.put{count}");
        let what = if kind == "reset" { " (mid-upload)" } else { "" };
        let name = format!("starting-only window, control {kind}:artifact.put{count}{what}");
        let mut row = Row::new(&name, None, Some(&spec), Phase::After, &[Success, Failure]);
        row.table = 1;
        rows.push(row);
    }
    let mut expired =
        Row::new("restart after the lease was swept", Some("journal:renewed@1"), None, During, &[Success]);
    expired.special = Special::ExpiredLease;
    expired.table = 1;
    rows.push(expired);
    let mut replaced = Row::new("session replaced while the agent was frozen", None, None, During, &[Success]);
    replaced.special = Special::ReplacedSession;
    replaced.table = 1;
    rows.push(replaced);
    // Torn journals: each record of a run, cut one byte short or followed by a stray byte.
    let records: &[(&str, Phase)] = &[
        ("session", Before),
        ("offered", Before),
        ("claimed", Before),
        ("startingAcked", Before),
        ("spawning", Before),
        ("spawned", During),
        ("callbackMinted", During),
        ("runningAcked", During),
        ("exited", After),
        ("logAcked", After),
        ("artifactStored", After),
        ("dropped", After),
    ];
    for (kind, phase) in records {
        for tear in [Tear::CutOne, Tear::AddOne] {
            let what = if tear == Tear::CutOne { "cut 1 byte (torn)" } else { "+1 stray byte" };
            let point = format!("journal:{kind}");
            let mut row = Row::new(&format!("{point}, {what}"), Some(&point), None, *phase, &[Success]);
            row.tear = tear;
            row.table = 2;
            // Cut short, a record leaves the state before it: a torn `spawned` leaves a
            // process without its record (its supervisor's files name it), a torn `exited`
            // a process without its exit (its supervisor recorded it).
            rows.push(row);
        }
    }
    rows
}

/// What every scenario shares: the binaries and an initialised state directory to copy.
struct Env {
    control_bin: PathBuf,
    agent_bin: PathBuf,
    template: TempDir,
}

/// The job's log: 4096 lines of 64 bytes.
fn expected_log() -> Vec<u8> {
    (1..=4096).flat_map(|i| format!("{i:063}\n").into_bytes()).collect()
}

/// One scenario's world.
struct Scenario<'a> {
    env: &'a Env,
    row: &'a Row,
    outcome: Outcome,
    root: TempDir,
    tag: String,
    control: Control,
    listen: String,
    agent: Option<Agent>,
    agent_config: PathBuf,
    state: PathBuf,
    run: String,
    fault_at: Option<Instant>,
    notes: Vec<String>,
}

/// A converged cell: how long it took from the fault to the end, and how it ended.
#[derive(Debug, Clone)]
struct Converged {
    seconds: f64,
    swept: bool,
}

fn cp(from: &Path, to: &Path) {
    let out = Command::new("cp").arg("-a").arg(from).arg(to).output().expect("cp runs");
    assert!(out.status.success(), "cp: {}", String::from_utf8_lossy(&out.stderr));
}

impl<'a> Scenario<'a> {
    fn new(env: &'a Env, row: &'a Row, outcome: Outcome, n: usize) -> Scenario<'a> {
        let root = TempDir::new(&format!("fm{n}"));
        cp(&env.template.0.join("control"), &root.0.join("control"));
        cp(&env.template.0.join("creds"), &root.0.join("creds"));
        let mut control_env = vec![("QL_CONTROL_FAULT_DELAY_MS", DELAY_MS)];
        if let Some(spec) = &row.control {
            control_env.push(("QL_CONTROL_FAULT", spec));
        }
        let control = Control::serve(
            &env.control_bin,
            &root.0.join("control"),
            "127.0.0.1:0",
            &root.0.join("control.err"),
            &control_env,
        );
        let listen = control.addr().to_owned();
        let state = root.0.join("agent-state");
        let agent_config = root.0.join("agent.conf");
        fs::write(&agent_config, agent_config_text(&control.url, &root.0, &state, row.streams)).unwrap();
        let tag = format!("{}-{n}", std::process::id());
        Scenario {
            env,
            row,
            outcome,
            root,
            tag,
            control,
            listen,
            agent: None,
            agent_config,
            state,
            run: String::new(),
            fault_at: None,
            notes: Vec::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.0.join(name)
    }

    fn start_agent(&mut self, fault: Option<&str>) {
        let env: Vec<(&str, &str)> = fault.map(|f| ("QL_AGENT_FAULT", f)).into_iter().collect();
        let agent = Agent::spawn_with(&self.env.agent_bin, &self.path("agent.err"), self.agent_config.clone(), &env);
        self.agent = Some(agent);
    }

    fn agent_log(&self) -> String {
        fs::read_to_string(self.path("agent.err")).unwrap_or_default()
    }

    fn context(&self) -> String {
        let shown = if self.run.is_empty() { Value::Null } else { self.show() };
        let tail = |text: String| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(60)..].join("\n")
        };
        format!(
            "--- notes ---\n{}\n--- run ---\n{}\n--- journal ---\n{:?}\n--- agent log ---\n{}\n--- ql-control log ---\n{}",
            self.notes.join("\n"),
            serde_json::to_string_pretty(&shown).unwrap_or_default(),
            read_journal(&self.state),
            tail(self.agent_log()),
            tail(self.control.log()),
        )
    }

    fn show(&self) -> Value {
        let out = self.control.cli(&["show", &self.run, "--json"]);
        if !out.status.success() {
            return Value::Null;
        }
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// Submits the job for the outcome.
    fn submit(&mut self) {
        let gate = self.path("gate");
        let starts = self.path("starts");
        let code = if self.outcome == Outcome::Failure { 3 } else { 0 };
        let script = format!(
            "echo $$ >> {starts}; sleep 600 >/dev/null 2>&1 & seq -f '%063g' 1 4096; \
             while [ ! -e {gate} ]; do sleep 0.02; done; exit {code}",
            starts = starts.display(),
            gate = gate.display(),
        );
        let timeout = if self.outcome == Outcome::Timeout { JOB_TIMEOUT_MS } else { 60_000 };
        let tag = format!("{TAG}={}", self.tag);
        let timeout = timeout.to_string();
        let mut args = vec!["--env", &tag, "--timeout-ms", &timeout, "--"];
        if self.outcome == Outcome::StartFail {
            args.push("/nonexistent/ql-matrix-program");
        } else {
            args.extend(["sh", "-c", &script]);
        }
        self.run = self.control.submit(&args);
    }

    fn open_gate(&self) {
        let _ = fs::write(self.path("gate"), b"");
    }

    fn restart_control(&mut self) {
        let control =
            Control::serve(&self.env.control_bin, &self.control.dir, &self.listen, &self.path("control.err"), &[]);
        self.control = control;
    }

    /// Whether the agent's journal holds no job and no process of the job is left.
    fn job_gone(&self) -> bool {
        read_journal(&self.state).jobs.is_empty() && tagged_processes(TAG, &self.tag).is_empty()
    }

    fn starts(&self) -> usize {
        fs::read_to_string(self.path("starts")).unwrap_or_default().lines().count()
    }

    /// Tears the journal as the row asks.
    fn tear(&mut self) {
        let path = self.state.join("journal");
        let mut bytes = fs::read(&path).unwrap();
        match self.row.tear {
            Tear::None => return,
            Tear::CutOne => {
                bytes.pop();
            }
            Tear::AddOne => bytes.push(0),
        }
        fs::write(&path, bytes).unwrap();
        self.notes.push(format!("journal torn: {:?}", self.row.tear));
    }
}

impl Drop for Scenario<'_> {
    /// Whatever a cell left running (it failed, say) does not outlive it.
    fn drop(&mut self) {
        for pid in tagged_processes(TAG, &self.tag) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

fn agent_config_text(url: &str, root: &Path, state: &Path, streams: bool) -> String {
    let mut settings: Vec<(&str, &str)> = AGENT.to_vec();
    if streams {
        settings.retain(|(k, _)| !STREAMING.iter().any(|(s, _)| s == k));
        settings.extend_from_slice(STREAMING);
    }
    agent_config(url, &root.join("creds"), state, &settings)
}

fn max_lease_version(shown: &Value) -> u64 {
    shown["leases"].as_array().into_iter().flatten().filter_map(|l| l["version"].as_u64()).max().unwrap_or(0)
}

fn events(shown: &Value) -> Vec<(String, String)> {
    shown["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| (e["attemptId"].as_str().unwrap_or("-").to_owned(), e["type"].as_str().unwrap_or("").to_owned()))
        .collect()
}

/// Runs one cell; `Err` says what broke.
fn run_cell(env: &Env, row: &Row, outcome: Outcome, n: usize) -> Result<Converged, String> {
    let mut s = Scenario::new(env, row, outcome, n);
    let result = catch_unwind(AssertUnwindSafe(|| drive(&mut s)));
    match result {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(format!("{e}\n{}", s.context())),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Err(format!("panicked: {msg}\n{}", s.context()))
        }
    }
}

fn drive(s: &mut Scenario<'_>) -> Result<Converged, String> {
    match s.row.special {
        Special::None => drive_fault(s),
        Special::ExpiredLease => drive_expired_lease(s),
        Special::ReplacedSession => drive_replaced_session(s),
    }
}

/// How the scenario's agent ended, if it did: `Ok(true)` when its fault point killed it.
fn agent_ended(s: &mut Scenario<'_>) -> Result<bool, String> {
    let Some(agent) = s.agent.as_mut() else { return Ok(false) };
    let Some(status) = agent.proc.0.try_wait().map_err(|e| e.to_string())? else { return Ok(false) };
    let log = s.agent_log();
    if status.signal() == Some(9) && log.contains("reached: SIGKILL") {
        s.agent = None;
        return Ok(true);
    }
    Err(format!("the agent ended on its own ({status})"))
}

/// Polls `ready` every `every` until it yields a value; `Err(what)` once the cell's `end`
/// passed without one.
fn poll<T>(
    end: Instant,
    every: Duration,
    what: &str,
    mut ready: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    loop {
        if let Some(value) = ready()? {
            return Ok(value);
        }
        if Instant::now() > end {
            return Err(what.to_owned());
        }
        std::thread::sleep(every);
    }
}

fn drive_fault(s: &mut Scenario<'_>) -> Result<Converged, String> {
    let start = Instant::now();
    let end = start + CELL_DEADLINE;
    let row = s.row;
    let outcome = s.outcome;
    let gated = matches!(outcome, Outcome::Success | Outcome::Failure);
    if gated && row.phase != Phase::During && !row.gate_after_fault() {
        s.open_gate();
    }
    s.submit();
    s.start_agent(row.agent.as_deref());
    let mut agent_died = false;
    let mut control_died = false;
    let mut cancelled = false;
    let mut control_fired = false;
    let mut terminal: Option<Value> = None;
    loop {
        if Instant::now() > end {
            return Err(match (s.fault_at, &terminal) {
                (None, _) => "the fault point was never reached".into(),
                (Some(_), None) => "the run did not end before the deadline".into(),
                (Some(_), Some(_)) => "the journal still holds the job, or a process of it runs".into(),
            });
        }
        let shown = s.show();
        let status = shown["status"].as_str().unwrap_or("").to_owned();
        // The agent.
        if agent_ended(s)? {
            agent_died = true;
            s.fault_at.get_or_insert_with(Instant::now);
            s.notes.push(format!("agent killed at its fault point after {:?} ({status})", start.elapsed()));
            s.tear();
            if row.ends_while_down {
                s.open_gate();
            }
        }
        let starts = s.starts();
        if starts > 1 {
            return Err(format!("the job's process was started {starts} times"));
        }
        // The control plane.
        if let Some(st) = s.control.server.0.try_wait().map_err(|e| e.to_string())? {
            if !s.control.log().contains("fired") {
                return Err(format!("ql-control ended on its own ({st})"));
            }
            control_died = true;
            s.fault_at.get_or_insert_with(Instant::now);
            s.notes.push(format!("ql-control crashed at its fault point after {:?}; restarted", start.elapsed()));
            s.restart_control();
        }
        if !control_fired && row.control.is_some() && s.control.log().contains(" fired") {
            control_fired = true;
            if row.agent.is_none() {
                s.fault_at.get_or_insert_with(Instant::now);
            }
            if gated && row.gate_after_fault() {
                s.open_gate();
            }
        }
        // The cancel, once the job runs and renewed twice, or once something died.
        if outcome == Outcome::Cancel
            && !cancelled
            && (agent_died
                || control_died
                || (status == "running" && max_lease_version(&shown) >= 3)
                || common::is_terminal(&status))
        {
            if !common::is_terminal(&status) {
                let out = s.control.cli(&["cancel", &s.run]);
                if !out.status.success() {
                    return Err(format!("cancel: {}", String::from_utf8_lossy(&out.stderr)));
                }
                s.notes.push(format!("cancelled after {:?} ({status})", start.elapsed()));
            }
            cancelled = true;
        }
        // Restart a killed agent: at once, except that a job let finish while its agent is
        // down first finishes.
        if s.agent.is_none() {
            let leader = fs::read_to_string(s.path("starts")).unwrap_or_default();
            let leader_gone = leader.split_whitespace().all(|p| p.parse().map_or(true, |p| !common::alive(p)));
            let ready = !row.ends_while_down || leader_gone;
            if ready {
                s.notes.push(format!("agent restarted after {:?}", start.elapsed()));
                s.start_agent(None);
                // A job the agent died under lives on: it finishes once the next agent runs
                // (which takes it back, or finds the exit its supervisor recorded).
                if gated && row.phase == Phase::During && row.agent.is_some() {
                    s.open_gate();
                }
            }
        }
        if terminal.is_none() && common::is_terminal(&status) {
            terminal = Some(shown);
        }
        // Done: the run ended, every fault fired, the agent runs and forgot the job, and no
        // process of the job is left.
        let fired = (row.agent.is_none() || agent_died) && (row.control.is_none() || control_fired);
        if terminal.is_some() && fired && s.agent.is_some() && s.job_gone() {
            break;
        }
        std::thread::sleep(POLL);
    }
    let terminal = terminal.expect("checked above");
    let fault_at = s.fault_at.ok_or("the fault point was never reached")?;
    let seconds = fault_at.elapsed().as_secs_f64();
    let shown = s.show();
    if shown["status"] != terminal["status"] {
        return Err(format!("the run changed after its end: {} then {}", terminal["status"], shown["status"]));
    }
    check(s, &shown)
        .map(|swept| Converged { seconds, swept })
        .map_err(|e| format!("{e}\n(agent died: {agent_died}, control died: {control_died})"))
}

/// The expected terminal status of a cell.
fn expected(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Cancel => "cancelled",
        Outcome::Timeout => "timed_out",
        Outcome::Failure | Outcome::StartFail => "failed",
        Outcome::Success => "succeeded",
    }
}

/// Checks the invariants on a converged run. `Ok(true)` when its attempt was lost to
/// lease expiry (allowed only where the agent came back too late to report).
fn check(s: &Scenario<'_>, shown: &Value) -> Result<bool, String> {
    let row = s.row;
    let status = shown["status"].as_str().unwrap_or("");
    let want = expected(s.outcome);
    if status != want {
        return Err(format!("the run ended {status}, not {want}"));
    }
    // Events: one terminal run event; each type at most once per attempt.
    let evs = events(shown);
    let terminal_events =
        evs.iter().filter(|(_, t)| common::TERMINAL.iter().any(|st| *t == format!("run.{st}"))).count();
    if terminal_events != 1 {
        return Err(format!("{terminal_events} terminal run events"));
    }
    let mut seen = BTreeMap::new();
    for e in &evs {
        *seen.entry(e.clone()).or_insert(0) += 1;
    }
    if let Some(((attempt, kind), n)) = seen.iter().find(|(_, n)| **n > 1) {
        return Err(format!("event {kind} appended {n} times for attempt {attempt}"));
    }
    // Leases.
    if let Some(l) = shown["leases"].as_array().into_iter().flatten().find(|l| l["state"] == "leased") {
        return Err(format!("a lease is still leased: {l}"));
    }
    // How it ended.
    let last = shown["attempts"].as_array().and_then(|a| a.last()).cloned().unwrap_or(Value::Null);
    let swept = last["status"] == "lost";
    if swept && row.special == Special::None {
        return Err("the run ended by lease expiry although its agent came back at once".into());
    }
    // The process: started at most once, and as many times as the protocol says.
    let starts = s.starts();
    if starts > 1 {
        return Err(format!("the job's process was started {starts} times"));
    }
    if s.outcome == Outcome::StartFail && starts != 0 {
        return Err("a program that cannot start was started".into());
    }
    // The log.
    let error_code = shown["errorCode"].as_str();
    if last["artifact"].is_null() {
        if status == "succeeded" || error_code.is_none() {
            return Err("no log stored, and no error code says why".into());
        }
        if status == "succeeded" || (s.outcome == Outcome::Failure && !swept) {
            return Err("the job finished by itself but its log was not stored".into());
        }
    } else {
        let out = s.control.cli(&["logs", &s.run]);
        if !out.status.success() {
            return Err(format!("logs: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let log = out.stdout;
        let full = expected_log();
        let finished_by_itself = matches!(s.outcome, Outcome::Success | Outcome::Failure);
        if finished_by_itself && log != full {
            return Err(format!("the stored log is {} bytes, not the job's {} bytes of output", log.len(), full.len()));
        }
        if !full.starts_with(&log) {
            return Err("the stored log is not what the job printed".into());
        }
    }
    if let Some(code) = last["exitCode"].as_i64() {
        let want_code = if s.outcome == Outcome::Failure { 3 } else { 0 };
        if matches!(s.outcome, Outcome::Success | Outcome::Failure) && code != want_code {
            return Err(format!("exit code {code}, not {want_code}"));
        }
    }
    if s.outcome == Outcome::StartFail && error_code != Some("EXECUTOR_START_FAILED") {
        return Err(format!("a program that cannot start ended with {error_code:?}"));
    }
    let log = s.agent_log();
    for bad in ["panicked", "receipt differs"] {
        if log.contains(bad) {
            return Err(format!("the agent's log says `{bad}`"));
        }
    }
    Ok(swept)
}

/// The agent dies mid-run and is restarted only after its lease was swept: it must stop
/// the orphan and drop the job without acting on the stale lease.
fn drive_expired_lease(s: &mut Scenario<'_>) -> Result<Converged, String> {
    let end = Instant::now() + CELL_DEADLINE;
    s.submit();
    s.start_agent(s.row.agent.as_deref());
    poll(end, POLL, "the agent never reached its fault point", || Ok(agent_ended(s)?.then_some(())))?;
    s.fault_at = Some(Instant::now());
    let before = poll(end, POLL, "the lease was never swept", || {
        let shown = s.show();
        let swept = shown["attempts"][0]["status"] == "lost";
        Ok(swept.then_some(shown))
    })?;
    if tagged_processes(TAG, &s.tag).is_empty() {
        return Err("the orphan should still run before the agent comes back".into());
    }
    s.start_agent(None);
    poll(end, POLL, "the restarted agent did not stop the orphan and drop the job", || Ok(s.job_gone().then_some(())))?;
    let seconds = s.fault_at.unwrap().elapsed().as_secs_f64();
    let after = s.show();
    if events(&after) != events(&before) || after["attempts"] != before["attempts"] {
        return Err("the restarted agent changed the run after its lease was swept".into());
    }
    lease_lost(s, &after, seconds, "lease_conflict", "the restarted agent did not meet the swept lease")
}

/// The agent is frozen mid-run while a second agent of the same worker opens a session,
/// replacing the first one's. Thawed, the first agent must stop its job (session_conflict)
/// without completing it; the lease then lapses.
fn drive_replaced_session(s: &mut Scenario<'_>) -> Result<Converged, String> {
    let end = Instant::now() + CELL_DEADLINE;
    s.submit();
    s.start_agent(None);
    poll(end, POLL, "the job never ran", || {
        Ok((s.show()["status"] == "running" && !tagged_processes(TAG, &s.tag).is_empty()).then_some(()))
    })?;
    let first = s.agent.take().unwrap();
    common::signal(&first.proc.0, rustix::process::Signal::STOP);
    s.fault_at = Some(Instant::now());
    let other_state = s.path("other-state");
    let other_config = s.path("other.conf");
    fs::write(&other_config, agent_config_text(&s.control.url, &s.root.0, &other_state, false)).unwrap();
    let other = Agent::spawn_with(&s.env.agent_bin, &s.path("other.err"), other_config, &[]);
    poll(end, Duration::from_millis(20), "the second agent never opened a session", || {
        Ok(fs::read_to_string(s.path("other.err")).unwrap_or_default().contains("opened").then_some(()))
    })?;
    drop(other);
    common::signal(&first.proc.0, rustix::process::Signal::CONT);
    s.agent = Some(first);
    poll(end, POLL, "the thawed agent did not stop its job and drop it", || Ok(s.job_gone().then_some(())))?;
    let shown = poll(end, POLL, "the run never ended", || {
        let shown = s.show();
        Ok(common::is_terminal(shown["status"].as_str().unwrap_or("")).then_some(shown))
    })?;
    let seconds = s.fault_at.unwrap().elapsed().as_secs_f64();
    if events(&shown).iter().any(|(_, t)| t == "attempt.completed") {
        return Err("the agent completed a run whose session was replaced".into());
    }
    lease_lost(s, &shown, seconds, "session_conflict", "the thawed agent never met session_conflict")
}

/// How a cell that must lose its lease ends: the run failed `LEASE_LOST` and the agent's log
/// shows the refusal that stopped it (`conflict`; `Err(unmet)` if not).
fn lease_lost(s: &Scenario<'_>, shown: &Value, seconds: f64, conflict: &str, unmet: &str) -> Result<Converged, String> {
    if shown["status"] != "failed" || shown["errorCode"] != "LEASE_LOST" {
        return Err(format!("the run ended {} {}, not failed LEASE_LOST", shown["status"], shown["errorCode"]));
    }
    if !s.agent_log().contains(conflict) {
        return Err(unmet.to_owned());
    }
    Ok(Converged { seconds, swept: true })
}

fn setup() -> Env {
    // Built here with its fault points, like agent_e2e builds its ql-control, unless given.
    let control_bin = match std::env::var_os("QL_CONTROL_FAULTS_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => build_control(&["faults"]),
    };
    // The agent binary this test was built with has the fault points; copy it so that a
    // build without them cannot replace it underneath the scenarios.
    let built = Path::new(env!("CARGO_BIN_EXE_ql-agent"));
    let agent_bin = built.with_file_name("ql-agent-faults");
    let tmp = built.with_file_name(format!("ql-agent-faults.tmp{}", std::process::id()));
    fs::copy(built, &tmp).unwrap();
    fs::rename(&tmp, &agent_bin).unwrap();
    let template = TempDir::new("fm-template");
    init_control(&control_bin, &template.0.join("control"), &template.0.join("creds"), TIMINGS);
    Env { control_bin, agent_bin, template }
}

type Results = BTreeMap<(usize, Outcome), Result<Converged, String>>;

fn print_table(title: &str, rows: &[(usize, &Row)], outcomes: &[Outcome], results: &Results) {
    let width = rows.iter().map(|(_, r)| r.name.len()).max().unwrap_or(10).max(20);
    println!("\n{title}\n");
    let mut header = format!("| {:<width$} |", "fault point");
    let mut rule = format!("|{}|", "-".repeat(width + 2));
    for o in outcomes {
        header.push_str(&format!(" {:<10} |", o.column()));
        rule.push_str(&format!("{}|", "-".repeat(12)));
    }
    println!("{header}\n{rule}");
    for (i, row) in rows {
        let mut line = format!("| {:<width$} |", row.name);
        for o in outcomes {
            let cell = match results.get(&(*i, *o)) {
                None => "n/a".to_owned(),
                Some(Ok(c)) => format!("ok {:.1}s{}", c.seconds, if c.swept { "*" } else { "" }),
                Some(Err(_)) => "FAIL".to_owned(),
            };
            line.push_str(&format!(" {cell:<10} |"));
        }
        println!("{line}");
    }
}

#[test]
fn every_fault_converges_with_nothing_twice() {
    let env = setup();
    let only = std::env::var("QL_MATRIX_ONLY").unwrap_or_default();
    let rows = rows();
    let mut queue = VecDeque::new();
    for (i, row) in rows.iter().enumerate() {
        if !row.name.contains(only.as_str()) {
            continue;
        }
        for o in &row.outcomes {
            queue.push_back((i, *o));
        }
    }
    let cells = queue.len();
    let threads: usize = std::env::var("QL_MATRIX_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let queue = Arc::new(Mutex::new(queue));
    let results: Arc<Mutex<Results>> = Arc::default();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            let (queue, results, rows, env) = (queue.clone(), results.clone(), &rows, &env);
            scope.spawn(move || loop {
                let Some((i, outcome)) = queue.lock().unwrap().pop_front() else { break };
                let n = i * OUTCOMES.len() + outcome as usize;
                let result = run_cell(env, &rows[i], outcome, n);
                if let Err(e) = &result {
                    eprintln!("FAIL {} × {}:\n{e}\n", rows[i].name, outcome.column());
                }
                results.lock().unwrap().insert((i, outcome), result);
            });
        }
    });
    let results = Arc::try_unwrap(results).ok().unwrap().into_inner().unwrap();
    let elapsed = started.elapsed();
    let titles = [
        "Fault point × job outcome: `ok <seconds from the fault to convergence>`; `*` = by lease expiry",
        "Recovery windows",
        "Torn journals (the agent killed after the record, then the file torn)",
    ];
    for (t, title) in titles.iter().enumerate() {
        let table: Vec<(usize, &Row)> =
            rows.iter().enumerate().filter(|(i, r)| r.table == t && results.keys().any(|(j, _)| j == i)).collect();
        if table.is_empty() {
            continue;
        }
        let cols: Vec<Outcome> =
            OUTCOMES.iter().copied().filter(|o| table.iter().any(|(i, _)| results.contains_key(&(*i, *o)))).collect();
        print_table(title, &table, &cols, &results);
    }
    let failed: Vec<String> = results
        .iter()
        .filter(|(_, r)| r.is_err())
        .map(|((i, o), _)| format!("{} × {}", rows[*i].name, o.column()))
        .collect();
    println!(
        "\n{cells} scenarios, {} converged, {} failed, in {:.0} s with {threads} at a time",
        cells - failed.len(),
        failed.len(),
        elapsed.as_secs_f64()
    );
    assert!(failed.is_empty(), "failed cells:\n{}", failed.join("\n"));
}

/// A wall clock ten minutes ahead of the server's, as on a router without a battery-backed
/// clock. The server refuses a `finishedAt` more than five minutes ahead of its own time;
/// the agent caps it with the server's clock as its answers' `Date` showed it, so the run
/// still succeeds rather than being refused and lost.
#[test]
fn a_clock_ten_minutes_ahead_still_completes_its_runs() {
    let root = TempDir::new("clock-ahead");
    let control = Control::start(&root.0);
    let mut agent = Agent::start_with_env(&root.0, &control, &[], &[("QL_AGENT_CLOCK_SKEW_MS", "600000")]);
    let run = control.submit(&["--", "echo", "on time"]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
    assert_eq!(control.logs(&run), b"on time\n");
    assert!(agent.terminate().success(), "{}", agent.log());
}

/// A server that answers the live log's chunks with `log_offset_conflict` at the very
/// offset the agent holds, four times in a row: nothing the agent can send mends that, so
/// it holds that job's log back for a wait that doubles (each at least 0.5, 1, 1 and 1 s
/// here) rather than repeating at once, and renews the lease meanwhile: the holds outlast
/// the 3 s lease, and the run still succeeds on its first attempt with its whole log.
#[test]
fn a_live_log_refused_at_the_offset_it_holds_waits_and_renews_meanwhile() {
    let root = TempDir::new("log-conflict");
    let dir = root.0.join("control");
    let bin = build_control(&["faults"]);
    init_control(&bin, &dir, &root.0.join("creds"), common::SHORT_TIMINGS);
    let env = [("QL_CONTROL_FAULT", "conflict:log.append@4")];
    let control = Control::serve(&bin, &dir, "127.0.0.1:0", &root.0.join("control.err"), &env);
    let backoff = [("backoff_initial_ms", "1000"), ("backoff_max_ms", "2000")];
    let mut agent = Agent::start(&root.0, &control, &backoff);
    let run = control.submit(&["--", "echo", "held back"]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
    assert_eq!(shown["attempts"].as_array().map(Vec::len), Some(1), "the lease held: {shown}");
    assert!(control.log().contains("fault conflict:log.append@4 fired (request 4)"), "{}", context());
    // Each hold as the agent logged it: its wait, doubling from 1 s to the 2 s cap, half of
    // it fixed and half drawn.
    let log = agent.log();
    let waits: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("refused it as a log offset conflict at 0 bytes, where the log stands"))
        .map(|l| l.rsplit_once("repeating in ").and_then(|(_, w)| w.trim_end_matches(" ms").parse().ok()).unwrap())
        .collect();
    assert_eq!(waits.len(), 4, "one hold for each conflict\n{}", context());
    for (wait, full) in waits.iter().zip([1_000, 2_000, 2_000, 2_000]) {
        assert!((full / 2..=full).contains(wait), "{waits:?}\n{}", context());
    }
    assert_eq!(control.logs(&run), b"held back\n");
    assert!(agent.terminate().success(), "{}", agent.log());
}

/// The shown run, once it ended (whatever its status).
fn run_ended(control: &Control, run: &str, context: impl Fn() -> String) -> Value {
    common::wait_for("the run to end", context, || {
        let shown = control.show(run);
        common::is_terminal(shown["status"].as_str().unwrap_or("")).then_some(shown)
    })
}

/// A job's supervisor dies after it started the job and before it said which process it
/// is (killed on a router short of memory, say). The job may already run, so the agent
/// neither runs it again itself nor leaves it running unwatched: it stops it and reports
/// the start failed. (It once ran the job a second time, in the agent.)
#[test]
fn a_supervisor_that_dies_after_starting_the_job_never_makes_it_run_twice() {
    let root = TempDir::new("supervisor-dies");
    let control = Control::start(&root.0);
    let mut agent = Agent::start_with_env(&root.0, &control, &[], &[("QL_AGENT_FAULT", "handoff")]);
    let ran = root.0.join("ran");
    let job = format!("echo once >> '{}'; sleep 3", ran.display());
    let run = control.submit(&["--retries", "0", "--", "sh", "-c", &job]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "failed", "{shown}\n{}", context());
    assert!(agent.log().contains("its supervisor failed after starting the job"), "{}", context());
    // Stopped, the job ran at most once (its first line, if it got that far).
    let lines = fs::read_to_string(&ran).unwrap_or_default().lines().count();
    assert!(lines <= 1, "the job ran {lines} times\n{}", context());
    assert!(agent.terminate().success(), "{}", agent.log());
}

/// An agent whose supervisors hang at `fault` (`hang:<point>`), and which would wait a
/// minute for a hand-over: the test kills it long before.
fn hanging_agent(root: &TempDir, control: &Control, fault: &str) -> Agent {
    Agent::start_with_env(&root.0, control, &[("handoff_timeout_ms", "60000")], &[("QL_AGENT_FAULT", fault)])
}

/// Kills the supervisors of an attempt that are still there when dropped: a hung one never
/// gets past its point by itself, however the test ends. (Only pids that carry the mark,
/// so as never to signal another process.)
struct Reaped(String);

impl Drop for Reaped {
    fn drop(&mut self) {
        for pid in tagged_processes("QL_SUPERVISOR_OF", &self.0) {
            let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// The pid of the supervisor of `run`'s first attempt, once there is one, and what ends it.
fn hung_supervisor(control: &Control, run: &str, agent: &Agent) -> (u32, Reaped) {
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let attempt: String = common::wait_for("the run's attempt", context, || {
        control.show(run)["attempts"][0]["attemptId"].as_str().map(str::to_owned)
    });
    let supervisor = common::wait_for("its supervisor", context, || {
        tagged_processes("QL_SUPERVISOR_OF", &attempt).into_iter().next()
    });
    (supervisor, Reaped(attempt))
}

/// Kills `agent` and starts it again on its state, without a fault, waiting 2 s for a
/// hand-over (its own supervisors, on a busy machine, hand over in time).
fn restart_impatient(root: &TempDir, agent: &mut Agent) {
    common::signal(&agent.proc.0, rustix::process::Signal::KILL);
    let _ = agent.proc.0.wait();
    let config = fs::read_to_string(&agent.config).unwrap();
    let restarted = config.replace("handoff_timeout_ms = 60000", "handoff_timeout_ms = 2000");
    assert_ne!(config, restarted, "the restarted agent's hand-off timeout is set");
    fs::write(&agent.config, restarted).unwrap();
    *agent = Agent::spawn(&root.0, agent.config.clone());
}

/// The agent dies while a job's supervisor, slower than `handoff_timeout_ms`, has not yet
/// started the job (a router thrashing its flash, say). The restarted agent must not start
/// the job beside it: it kills that supervisor first, then starts the job once. (It once
/// left the old supervisor to start the job a second time whenever it got to run.)
#[test]
fn a_supervisor_slower_than_the_handoff_timeout_is_stopped_before_the_job_starts_again() {
    let root = TempDir::new("supervisor-slow");
    let control = Control::start(&root.0);
    // The first agent would wait a minute for the hand-over: it dies long before.
    let mut agent = hanging_agent(&root, &control, "hang:supervise");
    let ran = root.0.join("ran");
    let run = control.submit(&["--retries", "0", "--", "sh", "-c", &format!("echo once >> '{}'", ran.display())]);
    // Found, it hangs before it reads the spec, or soon will: it never gets past that.
    let (supervisor, _reaped) = hung_supervisor(&control, &run, &agent);
    restart_impatient(&root, &mut agent);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
    assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "{shown}");
    assert!(!common::alive(supervisor), "the slow supervisor is gone\n{}", context());
    assert!(agent.log().contains("stopped the supervisor the previous agent started"), "{}", context());
    assert_eq!(fs::read_to_string(&ran).unwrap(), "once\n", "{}", context());
    assert!(agent.terminate().success(), "{}", agent.log());
}

/// The agent dies while a job's supervisor has started the job but hangs before it says
/// which process it is. The restarted agent freezes and kills that supervisor, finds the
/// job by its attempt id, and, nobody watching its output any more, stops it and gives
/// the attempt up as lost: the run goes again within its retries, never twice at once.
#[test]
fn a_supervisor_that_started_the_job_and_hangs_is_stopped_and_its_attempt_given_up() {
    let root = TempDir::new("supervisor-hangs-after-start");
    let control = Control::start(&root.0);
    let mut agent = hanging_agent(&root, &control, "hang:handoff");
    let (marker, pids) = (root.0.join("first"), root.0.join("pids"));
    let body = format!(
        "if [ -e {m} ]; then echo second; else touch {m}; echo $$ >> {p}; echo first; sleep 600; fi",
        m = marker.display(),
        p = pids.display()
    );
    let run = control.submit(&["--retries", "1", "--", "sh", "-c", &body]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let job = common::wait_for("the job's pid", context, || common::read_pids(&pids).first().copied());
    let (supervisor, _reaped) = hung_supervisor(&control, &run, &agent);
    restart_impatient(&root, &mut agent);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
    let attempts = shown["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{shown}");
    assert_eq!(attempts[0]["errorCode"], "WORKER_LOST", "{shown}");
    assert_eq!(control.logs(&run), b"second\n");
    assert!(!common::alive(supervisor) && !common::alive(job), "both stopped\n{}", context());
    assert!(agent.log().contains("stopped the supervisor the previous agent started"), "{}", context());
    assert!(agent.terminate().success(), "{}", agent.log());
}

/// Every supervisor slower than `handoff_timeout_ms` (each hangs before it reads its
/// spec): the agent stops each one and runs that job itself, and tries a supervisor again
/// for the next job rather than giving supervision up for good.
#[test]
fn a_slow_supervisor_costs_its_own_job_a_supervisor_and_the_next_job_tries_again() {
    let root = TempDir::new("supervisor-slow-twice");
    let control = Control::start(&root.0);
    let quick = [("handoff_timeout_ms", "500")];
    let mut agent = Agent::start_with_env(&root.0, &control, &quick, &[("QL_AGENT_FAULT", "hang:supervise")]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let mut attempts = Vec::new();
    for n in 1..=2 {
        let run = control.submit(&["--", "sh", "-c", &format!("echo job {n}")]);
        let shown = run_ended(&control, &run, context);
        assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
        assert_eq!(control.logs(&run), format!("job {n}\n").into_bytes());
        attempts.push(shown["attempts"][0]["attemptId"].as_str().unwrap().to_owned());
    }
    let log = agent.log();
    let slow = "runs in the agent itself (its supervisor did not hand the job over in time)";
    assert_eq!(log.matches(slow).count(), 2, "each job tried a supervisor\n{}", context());
    assert!(!log.contains("without a supervisor"), "supervision was not given up\n{}", context());
    for attempt in &attempts {
        assert!(tagged_processes("QL_SUPERVISOR_OF", attempt).is_empty(), "its slow supervisor was stopped");
    }
    assert!(agent.terminate().success(), "{}", agent.log());
}

/// A reload (SIGHUP) while a job runs in the agent itself, its supervisor having been too
/// slow: that job would end with the agent, so the agent drains instead of handing over,
/// reports the job once, and exits with the handover's status, for the service manager
/// (`Restart=on-failure`) to start it again; a second reload meanwhile changes nothing. (It
/// once handed over, and the job was lost and run again; then, draining, it exited 0 and
/// stayed stopped.)
#[test]
fn a_reload_while_a_job_runs_in_the_agent_itself_drains_it_and_exits_to_be_restarted() {
    let root = TempDir::new("reload-in-agent");
    let control = Control::start(&root.0);
    let quick = [("handoff_timeout_ms", "500")];
    let mut agent = Agent::start_with_env(&root.0, &control, &quick, &[("QL_AGENT_FAULT", "hang:supervise")]);
    let (gate, started) = (root.0.join("gate"), root.0.join("started"));
    fs::write(&gate, b"").unwrap();
    let body = format!(
        "touch '{s}'; while [ -e '{g}' ]; do sleep 0.1; done; echo done",
        s = started.display(),
        g = gate.display()
    );
    let run = control.submit(&["--retries", "0", "--", "sh", "-c", &body]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    common::wait_for("the job running in the agent itself", context, || {
        (started.exists() && agent.log().contains("runs in the agent itself")).then_some(())
    });
    common::signal(&agent.proc.0, rustix::process::Signal::HUP);
    common::wait_for("the drain", context, || agent.log().contains("drains instead of handing").then_some(()));
    // A second reload (two settings committed in a row) neither stops the job nor hands it over.
    common::signal(&agent.proc.0, rustix::process::Signal::HUP);
    common::wait_for("the second reload seen", context, || agent.log().contains("already draining").then_some(()));
    fs::remove_file(&gate).unwrap();
    let status = agent.proc.0.wait().unwrap();
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    assert_eq!(status.code(), Some(75), "{}", context());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
    assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "{shown}");
    assert_eq!(control.logs(&run), b"done\n");
}

/// The same clock, and the agent dies right after the running ACK; its job ends while it
/// is down. Restarted, it records the exit before any lease answer: the `Date` of the
/// server's first answer (the session's resumption) caps `finishedAt`, so the completion is
/// accepted, not refused and lost.
#[test]
fn a_clock_ten_minutes_ahead_still_reports_a_job_that_ended_while_the_agent_was_down() {
    let root = TempDir::new("clock-ahead-restart");
    let control = Control::start(&root.0);
    let skew = ("QL_AGENT_CLOCK_SKEW_MS", "600000");
    let mut first = Agent::start_with_env(&root.0, &control, &[], &[skew, ("QL_AGENT_FAULT", "journal:runningAcked")]);
    let run = control.submit(&["--", "echo", "before the crash"]);
    let child = &mut first.proc.0;
    let log = first.log.clone();
    common::wait_for(
        "the agent to die at its fault point",
        || fs::read_to_string(&log).unwrap_or_default(),
        || child.try_wait().unwrap(),
    );
    let mut second = Agent::spawn_with(
        Path::new(env!("CARGO_BIN_EXE_ql-agent")),
        &root.0.join("agent2.err"),
        first.config.clone(),
        &[skew],
    );
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", second.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_ne!(shown["errorCode"], "LEASE_LOST", "{shown}\n{}", context());
    assert!(events(&shown).iter().any(|(_, kind)| kind == "attempt.completed"), "{shown}\n{}", context());
    assert!(second.terminate().success(), "{}", second.log());
}

/// A seal slower than the agent's call timeout, six times over (the server composing a
/// big log on a loaded machine): the agent repeats it, and its heartbeats go between the
/// repeats, so neither its session nor the run lapses while the seal keeps failing.
#[test]
fn a_seal_slower_than_the_call_timeout_again_and_again_keeps_the_session_and_the_run() {
    let root = TempDir::new("slow-seal");
    let dir = root.0.join("control");
    let bin = build_control(&["faults"]);
    init_control(&bin, &dir, &root.0.join("creds"), common::SHORT_TIMINGS);
    let slow: Vec<String> = (1..=6).map(|n| format!("delay:artifact.seal@{n}")).collect();
    let slow = slow.join(",");
    let env = [("QL_CONTROL_FAULT", slow.as_str()), ("QL_CONTROL_FAULT_DELAY_MS", "3000")];
    let control = Control::serve(&bin, &dir, "127.0.0.1:0", &root.0.join("control.err"), &env);
    // The live log: the job's output streams while it runs, and the seal follows its end.
    let mut agent = Agent::start(&root.0, &control, &[]);
    let run = control.submit(&["--", "sh", "-c", "sleep 1; echo sealed late"]);
    let context = || format!("--- agent ---\n{}\n--- ql-control ---\n{}", agent.log(), control.log());
    let shown = run_ended(&control, &run, context);
    assert_eq!(shown["status"], "succeeded", "{shown}\n{}", context());
    assert!(control.log().contains("fault delay:artifact.seal@6 fired"), "{}", context());
    assert_eq!(control.logs(&run), b"sealed late\n");
    assert!(!agent.log().contains("session_conflict"), "the session never lapsed:\n{}", context());
    assert!(agent.terminate().success(), "{}", agent.log());
}
