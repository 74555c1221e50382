//! End to end: a real `ql-control serve` and a real `ql-agent run`, as processes, over
//! mutual TLS on loopback.
//!
//! Each test builds its own world in a fresh directory: `ql-control init`, short
//! protocol timings in `control.json`, `ql-control enroll`, `serve --listen
//! 127.0.0.1:0`, and an agent configured with short waits. Runs are submitted and
//! inspected with the `ql-control` CLI (`submit`, `show --json`, `logs`, `cancel`).
//! Nothing sleeps to synchronise: every wait polls a condition against a deadline. The
//! helpers live in `tests/common/`, shared with the fault matrix.
//!
//! The `ql-control` binary is built on first use (`cargo build -p ql-control`), or taken
//! from `QL_CONTROL_BIN`.

mod common;

use std::fs;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{alive, attempt, read_pids, signal, text, wait_for, Agent, World};

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

#[test]
fn a_second_agent_on_the_same_state_directory_refuses_to_start_and_changes_nothing() {
    let w = World::new("twice", &[]);
    wait_for("the first agent's session", || w.context(), || w.agent.log().contains(" opened").then_some(()));
    let journal = w.path("agent-state").join("journal");
    let before = fs::read(&journal).unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_ql-agent"))
        .args(["run", "--set", "lock_wait_ms=0", "--config"])
        .arg(&w.agent.config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another ql-agent is using this state directory"), "{err}");
    assert_eq!(fs::read(&journal).unwrap(), before, "the refused agent wrote to the journal");

    // The first agent holds on: it still runs work, in the same session.
    let run = w.control.submit(&["--", "echo", "still here"]);
    w.wait_status(&run, "succeeded");
    assert_eq!(w.control.logs(&run), b"still here\n");
    assert_eq!(w.agent.log().matches(" opened").count(), 1, "{}", w.context());
}

/// A restart that starts the new agent while the old one still drains (procd's restart,
/// a package upgrade): the new one waits for the state directory's lock, then takes over
/// with the journal the old one left, and runs the next job.
#[test]
fn a_second_agent_waits_for_the_first_to_exit_then_takes_over() {
    let mut w = World::new("takeover", &[]);
    wait_for("the first agent's session", || w.context(), || w.agent.log().contains(" opened").then_some(()));
    let second_log = w.path("second.err");
    let mut second =
        Agent::spawn_with(Path::new(env!("CARGO_BIN_EXE_ql-agent")), &second_log, w.agent.config.clone(), &[]);
    let second_text = || fs::read_to_string(&second_log).unwrap_or_default();
    wait_for("the second agent to wait", second_text, || second_text().contains("waiting up to").then_some(()));
    assert!(!second_text().contains("session "), "the second agent used a session beside the first");

    assert!(w.agent.terminate().success(), "{}", w.context());
    // It resumes the session the journal holds, or opens a new one if the server let that go.
    let took_over = || second_text().contains(" resumed") || second_text().contains(" opened");
    wait_for("the second agent to take over", second_text, || took_over().then_some(()));
    let run = w.control.submit(&["--", "echo", "from the second"]);
    w.wait_status(&run, "succeeded");
    assert_eq!(w.control.logs(&run), b"from the second\n");
    assert!(second.terminate().success(), "{}", second_text());
}

/// Under systemd (`Type=notify`, `WatchdogSec=`): the real agent, started with
/// `$NOTIFY_SOCKET` naming a datagram socket bound here and a 200 ms `$WATCHDOG_USEC`,
/// reports READY, pings the watchdog while it serves, and reports STOPPING with the time
/// its drain needs when SIGTERM arrives, then exits 0.
#[test]
fn under_systemd_the_agent_reports_ready_pings_the_watchdog_and_reports_stopping() {
    let root = common::TempDir::new("notify");
    let control = common::Control::start(&root.0);
    let socket_path = root.0.join("notify");
    let manager = UnixDatagram::bind(&socket_path).unwrap();
    // Only turns a hang into a failure: every receive returns as soon as a message is there.
    manager.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let socket = socket_path.to_str().unwrap();
    let env = [("NOTIFY_SOCKET", socket), ("WATCHDOG_USEC", "200000")];
    let mut agent = Agent::start_with_env(&root.0, &control, &[("poll_wait_ms", "100")], &env);
    let receive = || {
        let mut buf = [0u8; 4096];
        let n = manager.recv(&mut buf).unwrap_or_else(|e| panic!("no notification: {e}\n{}", agent_log(&root.0)));
        String::from_utf8(buf[..n].to_vec()).unwrap()
    };

    let ready = receive();
    assert!(ready.lines().any(|l| l == "READY=1"), "the first message must be READY: {ready:?}");
    let mut pings = 0;
    while pings < 2 {
        let message = receive();
        assert!(!message.contains("STOPPING"), "{message:?}");
        pings += message.lines().filter(|l| *l == "WATCHDOG=1").count();
    }

    signal(&agent.proc.0, rustix::process::Signal::TERM);
    let stopping = loop {
        let message = receive();
        if message.lines().any(|l| l == "STOPPING=1") {
            break message;
        }
    };
    let extend = stopping.lines().find_map(|l| l.strip_prefix("EXTEND_TIMEOUT_USEC="));
    assert!(extend.is_some_and(|v| v.parse::<u64>().is_ok_and(|us| us > 0)), "{stopping:?}");
    let child = &mut agent.proc.0;
    let status = wait_for("the agent to exit", || agent_log(&root.0), || child.try_wait().unwrap());
    assert!(status.success(), "{}", agent_log(&root.0));
}

fn agent_log(root: &Path) -> String {
    fs::read_to_string(root.join("agent.err")).unwrap_or_default()
}
