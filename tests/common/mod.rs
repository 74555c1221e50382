//! What the end-to-end tests share: real `ql-control` and `ql-agent` processes over mutual
//! TLS on loopback, each test in a directory of its own, and waits that poll a condition
//! against a deadline (nothing sleeps to synchronise).
//!
//! The `ql-control` binary is built on first use (`cargo build -p ql-control`, with the
//! same profile and target directory as the test), or taken from `QL_CONTROL_BIN`; the
//! agent is this build's, or `QL_AGENT_BIN`.
// Each test crate uses a different part of this module.
#![allow(dead_code, unreachable_pub)]

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

mod scratch;
pub mod throttle;
pub use scratch::TempDir;

/// How long any one condition may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Builds `ql-control` with `features` next to this test's `ql-agent` (same profile, same
/// target directory) and returns the binary. With features, the binary is copied to a
/// path of its own, so a later build without them cannot swap it underneath a running test.
pub fn build_control(features: &[&str]) -> PathBuf {
    let agent = Path::new(env!("CARGO_BIN_EXE_ql-agent"));
    let profile_dir = agent.parent().expect("a target profile directory");
    let target_dir = profile_dir.parent().expect("a target directory");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "-p", "ql-control", "--bin", "ql-control", "--profile", profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().expect("cargo runs");
    assert!(out.status.success(), "building ql-control failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let built = profile_dir.join("ql-control");
    if features.is_empty() {
        return built;
    }
    let own = profile_dir.join(format!("ql-control-{}", features.join("-")));
    // Tests of one binary run at once, and more than one may ask for the same build.
    static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let copy = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = own.with_extension(format!("tmp{}-{copy}", std::process::id()));
    fs::copy(&built, &tmp).expect("copy ql-control");
    fs::rename(&tmp, &own).expect("rename ql-control");
    own
}

/// The default `ql-control` (see the module doc).
pub fn control_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| match std::env::var_os("QL_CONTROL_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => build_control(&[]),
    })
}

/// The `ql-agent` under test: this build's, or `QL_AGENT_BIN` (to hold another build, an
/// older release say, to the same tests).
pub fn agent_bin() -> PathBuf {
    std::env::var_os("QL_AGENT_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ql-agent")), PathBuf::from)
}

/// Polls `f` until it yields a value or [`DEADLINE`] passes.
pub fn wait_for<T>(what: &str, context: impl Fn() -> String, f: impl FnMut() -> Option<T>) -> T {
    wait_within(DEADLINE, what, context, f)
}

/// Polls `f` until it yields a value or `limit` passes.
pub fn wait_within<T>(
    limit: Duration,
    what: &str,
    context: impl Fn() -> String,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}\n{}", context());
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A process killed when the test ends, unless it already ended.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn signal(child: &Child, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a pid");
    rustix::process::kill_process(pid, sig).expect("signal delivered");
}

/// Short protocol timings for `control.json`: renewals every second, lapsed leases swept
/// fast.
pub const SHORT_TIMINGS: &[(&str, u64)] = &[
    ("heartbeat_ms", 1_000),
    ("session_ttl_ms", 5_000),
    ("offer_ttl_ms", 5_000),
    ("lease_ttl_ms", 3_000),
    ("sweep_interval_ms", 100),
    ("outage_grace_after_ms", 1_000),
    ("session_takeover_after_ms", 3_000),
    ("change_poll_ms", 20),
];

/// `ql-control init` into `dir` with `timings` written to its `control.json`, and worker
/// `w1` enrolled into `creds`.
pub fn init_control(bin: &Path, dir: &Path, creds: &Path, timings: &[(&str, u64)]) {
    let run = |args: &[&str]| {
        let out = Command::new(bin).args(args).output().expect("ql-control runs");
        assert!(out.status.success(), "ql-control {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&["init", "--dir", dir.to_str().unwrap(), "--host", "127.0.0.1"]);
    let path = dir.join("control.json");
    let mut config: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    for (key, value) in timings {
        config[*key] = (*value).into();
    }
    fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    run(&["enroll", "w1", "--dir", dir.to_str().unwrap(), "--out", creds.to_str().unwrap()]);
}

/// One ql-control with its state directory, serving on loopback.
pub struct Control {
    pub bin: PathBuf,
    pub dir: PathBuf,
    pub server: Proc,
    pub url: String,
    /// The operator API's `https://host:port`.
    pub operator_url: String,
    pub stderr: PathBuf,
}

impl Control {
    /// A fresh state directory under `root` (`root/control`, credentials in
    /// `root/creds`) with [`SHORT_TIMINGS`], served on a free port.
    pub fn start(root: &Path) -> Control {
        let dir = root.join("control");
        init_control(control_bin(), &dir, &root.join("creds"), SHORT_TIMINGS);
        Self::serve(control_bin(), &dir, "127.0.0.1:0", &root.join("control.err"), &[])
    }

    /// `ql-control serve` on an existing state directory, with `env` added to its
    /// environment. Its stderr is appended to `stderr`.
    pub fn serve(bin: &Path, dir: &Path, listen: &str, stderr: &Path, env: &[(&str, &str)]) -> Control {
        let err = fs::OpenOptions::new().create(true).append(true).open(stderr).unwrap();
        let mut child = Command::new(bin)
            .args(["serve", "--dir", dir.to_str().unwrap(), "--listen", listen, "--operator-listen", "127.0.0.1:0"])
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("ql-control serve starts");
        let stdout = child.stdout.take().unwrap();
        let server = Proc(child);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // The operator API's line comes first, "listening on" last.
        let mut operator_url = String::new();
        let url = loop {
            let line = rx.recv_timeout(DEADLINE).unwrap_or_else(|_| {
                panic!(
                    "ql-control serve did not say where it listens:\n{}",
                    fs::read_to_string(stderr).unwrap_or_default()
                )
            });
            if let Some(url) = line.strip_prefix("operator API on ") {
                operator_url = url.trim().to_owned();
            }
            if let Some(url) = line.strip_prefix("listening on ") {
                break url.trim().to_owned();
            }
        };
        Control { bin: bin.to_owned(), dir: dir.to_owned(), server, url, operator_url, stderr: stderr.to_owned() }
    }

    /// An HTTPS client of the operator API that trusts this state directory's CA and
    /// follows no redirect.
    pub fn operator_client(&self) -> ureq::Agent {
        use ureq::tls::{PemItem, RootCerts, TlsConfig, TlsProvider};
        let pem = fs::read(self.dir.join("pki").join("ca.crt")).unwrap();
        let roots: Vec<_> = ureq::tls::parse_pem(&pem)
            .filter_map(|i| match i {
                Ok(PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        let tls = TlsConfig::builder()
            .provider(TlsProvider::Rustls)
            .unversioned_rustls_crypto_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .root_certs(RootCerts::new_with_certs(&roots))
            .build();
        ureq::Agent::config_builder().tls_config(tls).http_status_as_error(false).max_redirects(0).build().into()
    }

    /// `ql-control operator add NAME --role ROLE`: its token.
    pub fn operator(&self, name: &str, role: &str) -> String {
        let out = self.cli(&["operator", "add", name, "--role", role]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        text(&out).lines().nth(1).unwrap().trim().to_owned()
    }

    /// `host:port` of the server.
    pub fn addr(&self) -> &str {
        self.url.trim_start_matches("https://")
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(&self.bin).args(args).arg("--dir").arg(&self.dir).output().expect("ql-control runs")
    }

    pub fn submit(&self, args: &[&str]) -> String {
        let out = Command::new(&self.bin)
            .arg("submit")
            .arg("--dir")
            .arg(&self.dir)
            .args(args)
            .output()
            .expect("ql-control runs");
        assert!(out.status.success(), "submit {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        text(&out)
    }

    pub fn show(&self, run: &str) -> Value {
        let out = self.cli(&["show", run, "--json"]);
        assert!(out.status.success(), "show {run}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("show --json prints JSON")
    }

    pub fn logs(&self, run: &str) -> Vec<u8> {
        let out = self.cli(&["logs", run]);
        assert!(out.status.success(), "logs {run}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Stops the server and returns how many TCP connections it accepted.
    pub fn stop_and_count_connections(mut self) -> usize {
        signal(&self.server.0, rustix::process::Signal::TERM);
        let status = wait_for("ql-control to stop", String::new, || self.server.0.try_wait().unwrap());
        assert!(status.success());
        let err = fs::read_to_string(&self.stderr).unwrap();
        let count = err
            .lines()
            .find_map(|l| l.split("stopped after ").nth(1)?.split(" connection").next()?.parse().ok())
            .unwrap_or_else(|| panic!("ql-control did not report its connections:\n{err}"));
        count
    }
}

/// The agent's configuration file for `control`, with `settings` after the connection
/// lines. Credentials are read from `creds`, the journal lives in `state`.
pub fn agent_config(control_url: &str, creds: &Path, state: &Path, settings: &[(&str, &str)]) -> String {
    let mut text = format!(
        "server = {control_url}\nworker_id = w1\ncert = {}\nkey = {}\nca = {}\nstate_dir = {}\n",
        creds.join("w1.crt").display(),
        creds.join("w1.key").display(),
        creds.join("ca.crt").display(),
        state.display()
    );
    for (k, v) in settings {
        text.push_str(&format!("{k} = {v}\n"));
    }
    text
}

/// One agent process.
pub struct Agent {
    pub proc: Proc,
    pub log: PathBuf,
    pub config: PathBuf,
}

impl Agent {
    pub fn start(root: &Path, control: &Control, extra: &[(&str, &str)]) -> Agent {
        Self::start_with_env(root, control, extra, &[])
    }

    /// [`Agent::start`] with `env` added to the agent's environment.
    pub fn start_with_env(root: &Path, control: &Control, extra: &[(&str, &str)], env: &[(&str, &str)]) -> Agent {
        let config = root.join("agent.conf");
        let defaults = [
            ("poll_wait_ms", "2000"),
            ("busy_poll_wait_ms", "100"),
            ("stop_grace_ms", "500"),
            ("drain_timeout_ms", "10000"),
            ("backoff_initial_ms", "50"),
            ("backoff_max_ms", "500"),
            ("log_level", "debug"),
        ];
        let settings: Vec<(&str, &str)> =
            defaults.iter().filter(|(k, _)| !extra.iter().any(|(e, _)| e == k)).chain(extra).copied().collect();
        let text = agent_config(&control.url, &root.join("creds"), &root.join("agent-state"), &settings);
        fs::write(&config, text).unwrap();
        Self::spawn_with(&agent_bin(), &root.join("agent.err"), config, env)
    }

    pub fn spawn(root: &Path, config: PathBuf) -> Agent {
        Self::spawn_with(&agent_bin(), &root.join("agent.err"), config, &[])
    }

    /// `ql-agent run --config config` with `env` added; stderr appended to `log`.
    pub fn spawn_with(bin: &Path, log: &Path, config: PathBuf, env: &[(&str, &str)]) -> Agent {
        let stderr = fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let child = Command::new(bin)
            .args(["run", "--config"])
            .arg(&config)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("ql-agent starts");
        Agent { proc: Proc(child), log: log.to_owned(), config }
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        signal(&self.proc.0, rustix::process::Signal::TERM);
        let log = self.log.clone();
        let child = &mut self.proc.0;
        wait_for("the agent to exit", || fs::read_to_string(&log).unwrap_or_default(), || child.try_wait().unwrap())
    }
}

/// A world: one control plane, one agent.
pub struct World {
    pub control: Control,
    pub agent: Agent,
    pub root: TempDir,
}

impl World {
    pub fn new(tag: &str, agent: &[(&str, &str)]) -> World {
        let root = TempDir::new(tag);
        let control = Control::start(&root.0);
        let agent = Agent::start(&root.0, &control, agent);
        World { control, agent, root }
    }

    pub fn context(&self) -> String {
        format!("--- agent log ---\n{}\n--- ql-control log ---\n{}", self.agent.log(), self.control.log())
    }

    pub fn status(&self, run: &str) -> String {
        self.control.show(run)["status"].as_str().unwrap().to_owned()
    }

    /// Waits until the run reaches `status` (or fails the test if it ends otherwise).
    pub fn wait_status(&self, run: &str, want: &str) -> Value {
        wait_for(
            &format!("run {run} to be {want}"),
            || format!("{}\n{}", self.control.show(run), self.context()),
            || {
                let shown = self.control.show(run);
                let status = shown["status"].as_str().unwrap().to_owned();
                if status == want {
                    return Some(shown);
                }
                assert!(!is_terminal(&status), "run {run} ended {status}, not {want}\n{shown}");
                None
            },
        )
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.root.0.join(name)
    }
}

/// The run statuses that never change again.
pub const TERMINAL: [&str; 4] = ["succeeded", "failed", "cancelled", "timed_out"];

pub fn is_terminal(status: &str) -> bool {
    TERMINAL.contains(&status)
}

pub fn attempt(shown: &Value) -> &Value {
    &shown["attempts"][0]
}

/// Whether `pid` is a live (non-zombie) process.
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()).unwrap_or("");
    !matches!(state, "Z" | "X" | "x")
}

pub fn read_pids(path: &Path) -> Vec<u32> {
    let mut text = String::new();
    if let Ok(mut f) = fs::File::open(path) {
        f.read_to_string(&mut text).unwrap();
    }
    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// Live processes whose environment holds `name=value` (a job tagged at submit).
pub fn tagged_processes(name: &str, value: &str) -> Vec<u32> {
    let needle = format!("{name}={value}");
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(environ) = fs::read(format!("/proc/{pid}/environ")) else { continue };
        if environ.split(|&b| b == 0).any(|var| var == needle.as_bytes()) && alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// What an agent's journal holds, read with the documented format (see
/// `src/journal/mod.rs`): the record kinds in order, the jobs still held (offered and not
/// dropped), and the bytes after the last complete record.
#[derive(Debug, Default)]
pub struct JournalView {
    pub kinds: Vec<String>,
    /// `(offset, length)` of each complete frame.
    pub frames: Vec<(u64, u64)>,
    pub jobs: Vec<String>,
    pub torn: u64,
    /// The last acknowledged live-log offset on record (any job).
    pub log_acked: u64,
}

pub fn read_journal(state_dir: &Path) -> JournalView {
    let bytes = fs::read(state_dir.join("journal")).unwrap_or_default();
    let mut view = JournalView::default();
    if bytes.len() < 12 {
        view.torn = bytes.len() as u64;
        return view;
    }
    assert_eq!(&bytes[..8], b"QLAGJRNL", "not an agent journal");
    let mut at = 12;
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let end = at + 8 + len;
        if len == 0 || end > bytes.len() {
            break;
        }
        let Ok(record) = serde_json::from_slice::<Value>(&bytes[at + 8..end]) else { break };
        let kind = record["kind"].as_str().unwrap_or_default().to_owned();
        let job =
            |r: &Value| format!("{}/{}", r["sessionId"].as_str().unwrap_or(""), r["attemptId"].as_str().unwrap_or(""));
        match kind.as_str() {
            "offered" => view.jobs.push(job(&record)),
            "logAcked" => view.log_acked = record["acked"].as_u64().unwrap_or_default(),
            "dropped" => {
                let key = job(&record["job"]);
                view.jobs.retain(|j| *j != key);
            }
            _ => {}
        }
        view.kinds.push(kind);
        view.frames.push((at as u64, (end - at) as u64));
        at = end;
    }
    view.torn = (bytes.len() - at) as u64;
    view
}
