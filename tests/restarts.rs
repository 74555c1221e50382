//! Riding through restarts, end to end with real processes: ql-control killed (SIGKILL)
//! and restarted on the same state directory after longer than a lease's TTL, with jobs
//! running on a real agent. The time nobody served is given back to the leases and the
//! session (outage grace, `core::grace`), so every job runs on, finishes and is reported
//! exactly once.

mod common;

use std::time::Duration;

use common::{attempt, World};

#[test]
fn a_control_plane_down_longer_than_a_lease_loses_no_running_job() {
    // Leases of 3 s and sessions of 5 s (SHORT_TIMINGS); the outage lasts 6 s.
    let mut w = World::new("outage", &[("capacity", "3")]);
    let runs: Vec<String> = (0..3)
        .map(|i| w.control.submit(&["--", "sh", "-c", &format!("echo start {i}; sleep 9; echo end {i}")]))
        .collect();
    for run in &runs {
        w.wait_status(run, "running");
    }
    let addr = w.control.addr().to_owned();
    w.control.server.0.kill().unwrap();
    w.control.server.0.wait().unwrap();
    // The outage itself: the scenario is an authority absent longer than every lease and
    // the session, not a wait for anything to happen.
    std::thread::sleep(Duration::from_secs(6));
    let restarted = common::Control::serve(&w.control.bin, &w.control.dir, &addr, &w.control.stderr, &[]);
    w.control = restarted;
    for (i, run) in runs.iter().enumerate() {
        let shown = w.wait_status(run, "succeeded");
        assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "exactly once: {shown}");
        assert_eq!(attempt(&shown)["exitCode"], 0);
        assert_eq!(w.control.logs(run), format!("start {i}\nend {i}\n").into_bytes());
    }
    let log = w.control.log();
    assert!(log.contains("gave that time back to 3 lease(s), 1 session(s)"), "{log}");
    assert!(w.agent.terminate().success(), "{}", w.context());
}
