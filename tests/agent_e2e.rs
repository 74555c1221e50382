//! End to end: a real `ql-control serve` and a real `ql-agent run`, as processes, over
//! mutual TLS on loopback.
//!
//! Each test builds its own world in a fresh directory: `ql-control init`, short
//! protocol timings in `control.json`, `ql-control enroll`, `serve --listen
//! 127.0.0.1:0`, and an agent configured with short waits. Runs are submitted and
//! inspected with the `ql-control` CLI (`submit`, `show --json`, `logs`, `cancel`).
//! Nothing sleeps to synchronise: every wait polls a condition against a deadline.
//!
//! The `ql-control` binary is built on first use (`cargo build -p ql-control`), or taken
//! from `QL_CONTROL_BIN`.

use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long any one condition may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(30);

fn control_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("QL_CONTROL_BIN") {
            return PathBuf::from(bin);
        }
        // Build it next to this test's ql-agent, with the same profile.
        let agent = Path::new(env!("CARGO_BIN_EXE_ql-agent"));
        let profile_dir = agent.parent().expect("a target profile directory");
        let target_dir = profile_dir.parent().expect("a target directory");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(other) => other,
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args(["build", "--quiet", "-p", "ql-control", "--bin", "ql-control", "--profile", profile])
            .arg("--target-dir")
            .arg(target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("cargo runs");
        assert!(out.status.success(), "building ql-control failed:\n{}", String::from_utf8_lossy(&out.stderr));
        profile_dir.join("ql-control")
    })
}

/// A directory removed when the test ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ql-e2e-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Polls `f` until it yields a value or the deadline passes.
fn wait_for<T>(what: &str, context: impl Fn() -> String, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}\n{}", context());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A process killed when the test ends, unless it already ended.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a pid");
    rustix::process::kill_process(pid, sig).expect("signal delivered");
}

/// One ql-control with its state directory, serving on loopback.
struct Control {
    dir: PathBuf,
    server: Proc,
    url: String,
    stderr: PathBuf,
}

impl Control {
    fn start(root: &Path) -> Control {
        let dir = root.join("control");
        let run = |args: &[&str]| {
            let out = Command::new(control_bin()).args(args).output().expect("ql-control runs");
            assert!(out.status.success(), "ql-control {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(&["init", "--dir", dir.to_str().unwrap(), "--host", "127.0.0.1"]);
        // Short protocol timings: renewals every second, lapsed leases swept fast.
        let path = dir.join("control.json");
        let mut config: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        for (key, value) in [
            ("heartbeat_ms", 1_000),
            ("session_ttl_ms", 5_000),
            ("offer_ttl_ms", 5_000),
            ("lease_ttl_ms", 3_000),
            ("sweep_interval_ms", 100),
            ("change_poll_ms", 20),
        ] {
            config[key] = value.into();
        }
        fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        run(&["enroll", "w1", "--dir", dir.to_str().unwrap(), "--out", root.join("creds").to_str().unwrap()]);

        let stderr = root.join("control.err");
        let mut child = Command::new(control_bin())
            .args(["serve", "--dir", dir.to_str().unwrap(), "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(fs::File::create(&stderr).unwrap())
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
        let url = loop {
            let line = rx.recv_timeout(DEADLINE).expect("ql-control serve prints where it listens");
            if let Some(url) = line.strip_prefix("listening on ") {
                break url.trim().to_owned();
            }
        };
        Control { dir, server, url, stderr }
    }

    fn cli(&self, args: &[&str]) -> Output {
        Command::new(control_bin()).args(args).arg("--dir").arg(&self.dir).output().expect("ql-control runs")
    }

    fn submit(&self, args: &[&str]) -> String {
        let out = Command::new(control_bin())
            .arg("submit")
            .arg("--dir")
            .arg(&self.dir)
            .args(args)
            .output()
            .expect("ql-control runs");
        assert!(out.status.success(), "submit {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        text(&out)
    }

    fn show(&self, run: &str) -> Value {
        let out = self.cli(&["show", run, "--json"]);
        assert!(out.status.success(), "show {run}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("show --json prints JSON")
    }

    fn logs(&self, run: &str) -> Vec<u8> {
        let out = self.cli(&["logs", run]);
        assert!(out.status.success(), "logs {run}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    /// Stops the server and returns how many TCP connections it accepted.
    fn stop_and_count_connections(mut self) -> usize {
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

/// One agent process.
struct Agent {
    proc: Proc,
    log: PathBuf,
    config: PathBuf,
}

impl Agent {
    fn start(root: &Path, control: &Control, extra: &[(&str, &str)]) -> Agent {
        let creds = root.join("creds");
        let config = root.join("agent.conf");
        let mut text = format!(
            "server = {}\nworker_id = w1\ncert = {}\nkey = {}\nca = {}\nstate_dir = {}\n",
            control.url,
            creds.join("w1.crt").display(),
            creds.join("w1.key").display(),
            creds.join("ca.crt").display(),
            root.join("agent-state").display()
        );
        let defaults = [
            ("poll_wait_ms", "2000"),
            ("busy_poll_wait_ms", "100"),
            ("stop_grace_ms", "500"),
            ("drain_timeout_ms", "10000"),
            ("backoff_initial_ms", "50"),
            ("backoff_max_ms", "500"),
            ("log_level", "debug"),
        ];
        for (k, v) in defaults.iter().filter(|(k, _)| !extra.iter().any(|(e, _)| e == k)).chain(extra) {
            text.push_str(&format!("{k} = {v}\n"));
        }
        fs::write(&config, text).unwrap();
        Self::spawn(root, config)
    }

    fn spawn(root: &Path, config: PathBuf) -> Agent {
        let log = root.join("agent.err");
        let stderr = fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_ql-agent"))
            .args(["run", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("ql-agent starts");
        Agent { proc: Proc(child), log, config }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    fn terminate(&mut self) -> std::process::ExitStatus {
        signal(&self.proc.0, rustix::process::Signal::TERM);
        let log = self.log.clone();
        let child = &mut self.proc.0;
        wait_for("the agent to exit", || fs::read_to_string(&log).unwrap_or_default(), || child.try_wait().unwrap())
    }
}

/// A world: one control plane, one agent.
struct World {
    control: Control,
    agent: Agent,
    root: TempDir,
}

impl World {
    fn new(tag: &str, agent: &[(&str, &str)]) -> World {
        let root = TempDir::new(tag);
        let control = Control::start(&root.0);
        let agent = Agent::start(&root.0, &control, agent);
        World { control, agent, root }
    }

    fn context(&self) -> String {
        format!(
            "--- agent log ---\n{}\n--- ql-control log ---\n{}",
            self.agent.log(),
            fs::read_to_string(&self.control.stderr).unwrap_or_default()
        )
    }

    fn status(&self, run: &str) -> String {
        self.control.show(run)["status"].as_str().unwrap().to_owned()
    }

    /// Waits until the run reaches `status` (or fails the test if it ends otherwise).
    fn wait_status(&self, run: &str, want: &str) -> Value {
        wait_for(
            &format!("run {run} to be {want}"),
            || format!("{}\n{}", self.control.show(run), self.context()),
            || {
                let shown = self.control.show(run);
                let status = shown["status"].as_str().unwrap().to_owned();
                if status == want {
                    return Some(shown);
                }
                let terminal = ["succeeded", "failed", "cancelled", "timed_out"];
                assert!(!terminal.contains(&status.as_str()), "run {run} ended {status}, not {want}\n{shown}");
                None
            },
        )
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.0.join(name)
    }
}

fn attempt(shown: &Value) -> &Value {
    &shown["attempts"][0]
}

/// Whether `pid` is a live (non-zombie) process.
fn alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()).unwrap_or("");
    !matches!(state, "Z" | "X" | "x")
}

fn read_pids(path: &Path) -> Vec<u32> {
    let mut text = String::new();
    if let Ok(mut f) = fs::File::open(path) {
        f.read_to_string(&mut text).unwrap();
    }
    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

#[test]
fn argv_and_script_jobs_succeed_with_their_exact_log_over_one_connection() {
    let mut w = World::new("basic", &[]);
    let argv = w.control.submit(&["--", "sh", "-c", "printf 'out\\n'; printf 'err\\n' >&2; printf 'tail'"]);
    let shown = w.wait_status(&argv, "succeeded");
    assert_eq!(attempt(&shown)["exitCode"], 0);
    assert_eq!(w.control.logs(&argv), b"out\nerr\ntail");
    assert!(shown["startedAt"].is_string(), "the running ACK was sent: {shown}");

    let script = w.path("job.sh");
    fs::write(&script, "echo \"hello $WHO\"\npwd >/dev/null\nexit 0\n").unwrap();
    let run =
        w.control.submit(&["--script", script.to_str().unwrap(), "--interpreter", "sh", "--env", "WHO=router owner"]);
    w.wait_status(&run, "succeeded");
    assert_eq!(w.control.logs(&run), b"hello router owner\n");

    let failing = w.control.submit(&["--", "sh", "-c", "echo nope; exit 3"]);
    let shown = w.wait_status(&failing, "failed");
    assert_eq!(attempt(&shown)["exitCode"], 3);
    assert_eq!(w.control.logs(&failing), b"nope\n");

    let log = w.agent.log();
    assert!(!log.contains("router owner"), "an environment value reached the log:\n{log}");
    assert!(w.agent.terminate().success(), "{}", w.context());
    let connections = w.control.stop_and_count_connections();
    assert_eq!(connections, 1, "the agent must keep one connection for the whole session\n{log}");
}

#[test]
fn a_program_that_cannot_start_is_a_start_failure() {
    let w = World::new("spawnfail", &[]);
    let run = w.control.submit(&["--", "/nonexistent/program", "arg"]);
    let shown = w.wait_status(&run, "failed");
    assert_eq!(shown["errorCode"], "EXECUTOR_START_FAILED", "{shown}");
    let summary = attempt(&shown)["summary"].as_str().unwrap_or_default().to_owned();
    assert!(summary.contains("/nonexistent/program"), "{shown}");
    assert!(!summary.contains(" arg"), "arguments stay out of the reason: {summary}");
}

#[test]
fn a_timeout_ends_the_whole_process_group() {
    let w = World::new("timeout", &[]);
    let pids = w.path("pids");
    let body = format!("sleep 60 & echo $! >> {0}; echo $$ >> {0}; wait", pids.display());
    let run = w.control.submit(&["--timeout-ms", "1500", "--", "sh", "-c", &body]);
    let shown = w.wait_status(&run, "timed_out");
    assert_eq!(shown["errorCode"], "EXECUTION_TIMED_OUT", "{shown}");
    let pids = read_pids(&pids);
    assert_eq!(pids.len(), 2, "the job wrote its pids");
    for pid in pids {
        assert!(!alive(pid), "process {pid} of the timed-out job is still alive");
    }
}

#[test]
fn a_cancel_ends_the_whole_process_group() {
    let w = World::new("cancel", &[]);
    let pids = w.path("pids");
    let body = format!("sleep 60 & echo $! >> {0}; echo $$ >> {0}; wait", pids.display());
    let run = w.control.submit(&["--", "sh", "-c", &body]);
    w.wait_status(&run, "running");
    wait_for("the job's pids", || w.context(), || (read_pids(&pids).len() == 2).then_some(()));
    let out = w.control.cli(&["cancel", &run]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let shown = w.wait_status(&run, "cancelled");
    assert_eq!(shown["errorCode"], "EXECUTION_CANCELLED", "{shown}");
    for pid in read_pids(&pids) {
        assert!(!alive(pid), "process {pid} of the cancelled job is still alive");
    }
}

#[test]
fn a_log_over_its_limit_is_stored_truncated() {
    let w = World::new("truncate", &[]);
    let run = w.control.submit(&["--log-limit", "100", "--", "sh", "-c", "head -c 5000 /dev/zero | tr '\\0' x"]);
    let shown = w.wait_status(&run, "succeeded");
    assert_eq!(w.control.logs(&run), vec![b'x'; 100]);
    let artifact = &attempt(&shown)["artifact"];
    assert_eq!((artifact["length"].as_u64(), artifact["truncated"].as_bool()), (Some(100), Some(true)), "{shown}");
}

#[test]
fn capacity_two_runs_two_jobs_at_once() {
    let w = World::new("capacity", &[("capacity", "2")]);
    // Each job waits for the other's mark: they can only both finish if they overlap.
    let (a, b) = (w.path("a"), w.path("b"));
    let job = |mine: &Path, theirs: &Path| {
        format!("touch {}; while [ ! -e {} ]; do sleep 0.02; done; echo met", mine.display(), theirs.display())
    };
    let first = w.control.submit(&["--timeout-ms", "20000", "--", "sh", "-c", &job(&a, &b)]);
    let second = w.control.submit(&["--timeout-ms", "20000", "--", "sh", "-c", &job(&b, &a)]);
    w.wait_status(&first, "succeeded");
    w.wait_status(&second, "succeeded");
    assert_eq!(w.control.logs(&first), b"met\n");
    assert_eq!(w.control.logs(&second), b"met\n");
}

#[test]
fn sigterm_lets_a_running_job_finish_then_exits_zero() {
    let mut w = World::new("drain", &[]);
    let gate = w.path("gate");
    let body = format!("while [ ! -e {} ]; do sleep 0.02; done; echo finished", gate.display());
    let run = w.control.submit(&["--", "sh", "-c", &body]);
    w.wait_status(&run, "running");
    signal(&w.agent.proc.0, rustix::process::Signal::TERM);
    wait_for("the agent to announce the drain", || w.context(), || w.agent.log().contains("is draining").then_some(()));
    // Work submitted now is not taken: the session drains.
    let late = w.control.submit(&["--", "echo", "late"]);
    fs::write(&gate, b"").unwrap();
    w.wait_status(&run, "succeeded");
    let status = w.agent.terminate();
    assert!(status.success(), "{}", w.context());
    assert_eq!(w.control.logs(&run), b"finished\n");
    assert_eq!(w.status(&late), "queued", "a draining agent claims nothing");
}

#[test]
fn a_drain_that_runs_out_stops_the_job_and_still_completes_it() {
    let mut w = World::new("drainout", &[("drain_timeout_ms", "300")]);
    let pids = w.path("pids");
    let body = format!("echo $$ >> {}; echo started; sleep 60", pids.display());
    let run = w.control.submit(&["--", "sh", "-c", &body]);
    w.wait_status(&run, "running");
    wait_for("the job's pid", || w.context(), || (!read_pids(&pids).is_empty()).then_some(()));
    let status = w.agent.terminate();
    assert!(status.success(), "{}", w.context());
    let shown = w.control.show(&run);
    assert_eq!(shown["status"], "failed", "stopped by the drain, reported as it ended: {shown}");
    assert_eq!(attempt(&shown)["signal"], 15, "{shown}");
    assert_eq!(w.control.logs(&run), b"started\n");
    for pid in read_pids(&pids) {
        assert!(!alive(pid), "process {pid} outlived the drain");
    }
}

#[test]
fn a_restarted_agent_stops_its_orphan_and_completes_the_run() {
    let mut w = World::new("restart", &[]);
    let pids = w.path("pids");
    let body = format!("echo $$ >> {}; echo before; sleep 60", pids.display());
    let run = w.control.submit(&["--", "sh", "-c", &body]);
    w.wait_status(&run, "running");
    wait_for("the job's pid", || w.context(), || (!read_pids(&pids).is_empty()).then_some(()));
    // A crash: the agent dies at once, its job keeps running.
    signal(&w.agent.proc.0, rustix::process::Signal::KILL);
    let _ = w.agent.proc.0.wait();
    let pid = read_pids(&pids)[0];
    assert!(alive(pid), "the orphan lives on until the agent comes back");
    w.agent = Agent::spawn(&w.root.0, w.agent.config.clone());
    let shown = w.wait_status(&run, "failed");
    assert_eq!(attempt(&shown)["signal"], 9, "{shown}");
    assert_eq!(w.control.logs(&run), b"before\n");
    assert!(!alive(pid), "the orphan was stopped");
    assert!(w.agent.log().contains("outlived the previous agent"), "{}", w.context());
}

#[test]
fn check_reports_the_principal_and_refuses_a_foreign_worker_id() {
    let w = World::new("check", &[]);
    let out =
        Command::new(env!("CARGO_BIN_EXE_ql-agent")).args(["check", "--config"]).arg(&w.agent.config).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = text(&out);
    assert!(printed.contains("urn:qinglong:worker:w1") && printed.contains("404 not_found"), "{printed}");

    let out = Command::new(env!("CARGO_BIN_EXE_ql-agent"))
        .args(["check", "--config"])
        .arg(&w.agent.config)
        .args(["--worker-id", "w2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("worker `w1`") && err.contains("`w2`"), "{err}");
}
