//! The live log end to end (PROTOCOL §13): a real `ql-control serve` and a real
//! `ql-agent run` over mutual TLS, the log streamed in chunks while the job runs.
//!
//! - `ql-control logs --follow` prints a line while the job that printed it still runs;
//! - through a slow uplink (a rate-limiting proxy of the test's own, `common/throttle.rs`)
//!   and with ql-control's *default* lease settings, 16 MiB at 256 KiB/s and 4 MiB at
//!   64 KiB/s end `succeeded` with their exact logs: renewals and heartbeats go between
//!   chunks, so no lease or session lapses while the log crawls up the link;
//! - the spool under the agent's state directory never holds more than what the server has
//!   not acknowledged, plus one chunk: acknowledged bytes are given back as they go.
//!
//! Nothing sleeps to synchronise: every wait polls a condition against a deadline.

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::throttle::Throttle;
use common::{agent_config, control_bin, init_control, read_journal, wait_for, wait_within, Agent, Control, TempDir};

/// The log `seq -f '%063.0f' 1 n` prints: n lines of 64 bytes (`%g` would turn 10^6 into `1e+06`).
fn lines(n: u64) -> Vec<u8> {
    (1..=n).flat_map(|i| format!("{i:0>63}\n").into_bytes()).collect()
}

fn status(control: &Control, run: &str) -> String {
    control.show(run)["status"].as_str().unwrap_or_default().to_owned()
}

fn wait_terminal(control: &Control, run: &str, limit: Duration, context: impl Fn() -> String) -> String {
    wait_within(limit, &format!("run {run} to end"), context, || {
        Some(status(control, run)).filter(|s| common::is_terminal(s))
    })
}

#[test]
fn logs_follow_prints_a_line_while_the_job_runs_then_checks_the_stored_log() {
    let root = TempDir::new("follow");
    let control = Control::start(&root.0);
    let agent = Agent::start(&root.0, &control, &[("log_flush_ms", "200")]);
    let (printed, gate) = (root.0.join("printed"), root.0.join("gate"));
    let script = format!(
        "printf 'first line\\n'; touch {}; while [ ! -e {} ]; do sleep 0.02; done; printf 'last line\\n'",
        printed.display(),
        gate.display()
    );
    let run = control.submit(&["--", "sh", "-c", &script]);
    let mut follower = Command::new(control_bin())
        .args(["logs", &run, "--follow", "--poll-ms", "100", "--dir"])
        .arg(&control.dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let (seen, mut out) = (seen.clone(), follower.stdout.take().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let context = || format!("--- agent ---\n{}\n--- control ---\n{}", agent.log(), control.log());
    wait_for("the job to print its first line", context, || printed.exists().then_some(()));
    // The line reaches the follower's screen while the job, held by its gate, still runs
    // (how long it took is printed, not asserted).
    let printed_at = Instant::now();
    wait_for("the follower to print the first line", context, || {
        seen.lock().unwrap().starts_with(b"first line\n").then_some(())
    });
    eprintln!("first line followed {} ms after it was printed", printed_at.elapsed().as_millis());
    assert_eq!(status(&control, &run), "running", "the line came while the job ran");
    // `logs` without --follow prints what has arrived so far of the running job.
    assert_eq!(control.logs(&run), b"first line\n");

    fs::write(&gate, b"").unwrap();
    let exit = wait_for("the follower to exit", context, || follower.try_wait().unwrap());
    reader.join().unwrap();
    let mut err = String::new();
    follower.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(exit.success(), "logs --follow: {err}");
    assert_eq!(seen.lock().unwrap().as_slice(), b"first line\nlast line\n");
    assert!(err.contains("SHA-256") && err.contains("checked"), "the stored log's check: {err}");
    assert_eq!(status(&control, &run), "succeeded");
    assert_eq!(control.logs(&run), b"first line\nlast line\n");
}

/// ql-control with its default lease, session and heartbeat settings; an agent reaching it
/// through a link of `rate` bytes a second; a job that prints `n` lines of 64 bytes at once
/// and exits. The run must succeed with its exact log.
fn through_a_slow_uplink(tag: &str, rate: u64, n: u64) {
    let root = TempDir::new(tag);
    let dir = root.0.join("control");
    init_control(control_bin(), &dir, &root.0.join("creds"), &[]);
    let control = Control::serve(control_bin(), &dir, "127.0.0.1:0", &root.0.join("control.err"), &[]);
    let link = Throttle::start(control.addr(), rate);
    let config = root.0.join("agent.conf");
    let settings = [("poll_wait_ms", "2000"), ("log_level", "debug")];
    fs::write(&config, agent_config(&link.url(), &root.0.join("creds"), &root.0.join("agent-state"), &settings))
        .unwrap();
    let agent = Agent::spawn(&root.0, config);
    let limit = (n * 64).to_string();
    let count = n.to_string();
    let run = control.submit(&["--log-limit", &limit, "--", "seq", "-f", "%063.0f", "1", &count]);
    let started = Instant::now();
    let context = || format!("--- agent ---\n{}\n--- control ---\n{}", agent.log(), control.log());
    // The upload alone takes n * 64 / rate seconds; twice that, and a minute, is plenty.
    let limit = Duration::from_secs(60 + 2 * n * 64 / rate);
    let ended = wait_terminal(&control, &run, limit, context);
    let shown = control.show(&run);
    assert_eq!(ended, "succeeded", "{shown}\n{}", context());
    let log = control.logs(&run);
    assert!(log == lines(n), "the stored log is not the job's ({} bytes)", log.len());
    let took = started.elapsed();
    let renewals = shown["events"].as_array().map_or(0, |e| e.len());
    eprintln!("{tag}: {} bytes through {rate} B/s in {:.1} s ({renewals} events)", n * 64, took.as_secs_f64());
    let log = agent.log();
    for lost in ["lease_conflict", "session_conflict", "LEASE_LOST"] {
        assert!(!log.contains(lost), "{lost} on the way:\n{log}");
    }
}

#[test]
fn sixteen_mib_through_a_256_kib_per_second_uplink_succeed_with_default_leases() {
    through_a_slow_uplink("uplink-256k", 256 * 1024, 256 * 1024);
}

#[test]
fn four_mib_through_a_64_kib_per_second_uplink_succeed_with_default_leases() {
    through_a_slow_uplink("uplink-64k", 64 * 1024, 64 * 1024);
}

/// Bytes the files under `dir` occupy on disk (holes take none).
fn on_disk(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => on_disk(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

#[test]
fn the_spool_holds_only_what_the_server_has_not_acknowledged() {
    let root = TempDir::new("spool");
    let control = Control::start(&root.0);
    let link = Throttle::start(control.addr(), 8 * 1024 * 1024);
    let config = root.0.join("agent.conf");
    let state = root.0.join("agent-state");
    fs::write(&config, agent_config(&link.url(), &root.0.join("creds"), &state, &[("log_level", "debug")])).unwrap();
    let agent = Agent::spawn(&root.0, config);
    let n = 1024 * 1024;
    let run = control.submit(&["--log-limit", "67108864", "--", "seq", "-f", "%063.0f", "1", &n.to_string()]);
    let context = || format!("--- agent ---\n{}\n--- control ---\n{}", agent.log(), control.log());
    let chunk = 256 * 1024;
    let (mut most, mut samples) = (0u64, 0u32);
    wait_for("the run to end", context, || {
        // The acknowledged offset first, then the disk, then the spool's length: each
        // later reading can only make the allowance larger, never the usage look smaller.
        // The run directories alone: the journal beside them is rewritten whole when it
        // is compacted (for a moment, two copies), which says nothing about the spool.
        let acked = read_journal(&state).log_acked;
        let used = on_disk(&state.join("runs"));
        let spool = fs::read_dir(state.join("runs")).ok().and_then(|mut d| d.next()).and_then(Result::ok);
        let spooled = spool.and_then(|d| fs::metadata(d.path().join("output.log")).ok()).map_or(0, |m| m.len());
        // Whole blocks: the spool's partly acknowledged block and its last one, and the
        // run directory's few small files (its spec, status, exit).
        let allowed = spooled.saturating_sub(acked) + chunk + 2 * 4096 + 8 * 4096;
        assert!(used <= allowed, "{used} bytes on disk, {} not acknowledged (acked {acked})", spooled - acked);
        most = most.max(used);
        samples += 1;
        Some(status(&control, &run)).filter(|s| common::is_terminal(s))
    });
    assert_eq!(status(&control, &run), "succeeded", "{}", context());
    let log = control.logs(&run);
    assert!(log == lines(n), "the stored log is not the job's ({} bytes)", log.len());
    assert!(samples > 10, "the spool was looked at only {samples} times");
    eprintln!("spool: at most {most} bytes on disk in the run directory for a 64 MiB log ({samples} samples)");
}
