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
    // The jobs run until the restarted ql-control has served them again.
    let gate = w.path("gate");
    let job = |i| format!("echo start {i}; while [ ! -e '{}' ]; do sleep 0.05; done; echo end {i}", gate.display());
    let runs: Vec<String> = (0..3).map(|i| w.control.submit(&["--", "sh", "-c", &job(i)])).collect();
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
    common::wait_for(
        "the restart to give the outage back",
        || w.context(),
        || w.control.log().contains("gave that time back").then_some(()),
    );
    for run in &runs {
        assert_eq!(w.control.show(run)["status"], "running", "the job ran through the outage");
    }
    std::fs::write(&gate, b"").unwrap();
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

#[test]
fn two_agents_with_one_identity_converge_and_the_second_says_why() {
    // Agent one holds w1's session; a second agent with the same certificate and its own
    // state directory (a restored backup on another router) starts beside it.
    let w = World::new("twins", &[]);
    common::wait_for(
        "the first agent's session",
        || w.context(),
        || w.control.cli(&["workers"]).stdout.windows(6).any(|s| s == b"online").then_some(()),
    );
    let twin_root = w.path("twin");
    std::fs::create_dir_all(&twin_root).unwrap();
    let config = w.agent.config.clone();
    let text = std::fs::read_to_string(&config).unwrap().replace(
        &format!("state_dir = {}", w.path("agent-state").display()),
        &format!("state_dir = {}", twin_root.join("state").display()),
    );
    let twin_config = twin_root.join("agent.conf");
    std::fs::write(&twin_config, text).unwrap();
    let twin = common::Agent::spawn_with(&common::agent_bin(), &twin_root.join("agent.err"), twin_config, &[]);
    common::wait_for(
        "the twin to be refused",
        || twin.log(),
        || twin.log().contains("another agent with worker id w1 holds its session").then_some(()),
    );

    // For a minute with both running, a job every five seconds: each finishes, once, on
    // the session's holder. (The minute is the scenario's length, paced by the clock; each
    // job is waited for by its status.)
    let start = std::time::Instant::now();
    for i in 0..12u32 {
        let run = w.control.submit(&["--", "sh", "-c", &format!("echo job {i}")]);
        let shown = w.wait_status(&run, "succeeded");
        assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "once: {shown}");
        assert_eq!(w.control.logs(&run), format!("job {i}\n").into_bytes());
        let next = start + std::time::Duration::from_secs(5 * u64::from(i + 1));
        std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
    }
    let listed = common::text(&w.control.cli(&["workers"]));
    let sessions: Vec<&str> = listed.lines().filter(|l| l.starts_with("w1 ")).collect();
    assert_eq!(sessions.len(), 1, "the twin never took the session over:\n{listed}");
    let generation = sessions[0].split_whitespace().nth(2);
    assert_eq!(generation, Some("1"), "no session was ever replaced in the minute:\n{listed}");
    assert!(listed.contains("TWINS: session opens refused"), "{listed}");
    assert!(!twin.log().contains("claimed"), "the twin ran nothing:\n{}", twin.log());
}

#[test]
fn a_clean_exit_closes_the_session_and_the_next_start_opens_a_fresh_one_at_once() {
    let mut w = World::new("close", &[]);
    let run = w.control.submit(&["--", "sh", "-c", "echo once"]);
    w.wait_status(&run, "succeeded");
    assert!(w.agent.terminate().success(), "{}", w.context());
    assert!(w.agent.log().contains("closed"), "{}", w.agent.log());
    let listed = common::text(&w.control.cli(&["workers"]));
    assert!(listed.lines().any(|l| l.starts_with("w1 ") && l.contains(" closed ")), "{listed}");

    // The next start opens a session straight away: nothing to resume, nothing to wait for.
    let before = w.agent.log();
    w.agent = common::Agent::spawn(&w.root.0, w.agent.config.clone());
    let again = w.control.submit(&["--", "sh", "-c", "echo twice"]);
    w.wait_status(&again, "succeeded");
    let log = w.agent.log();
    let second_life = &log[before.len()..];
    assert!(!second_life.contains("cannot be resumed"), "{second_life}");
    assert!(second_life.contains("generation 2 opened"), "{second_life}");
}

/// A job that waits for `go` in `dir` before it finishes, printing its pid first.
fn gated_job(dir: &std::path::Path, tag: &str) -> String {
    format!(
        "echo $$ >> {pids}; echo before {tag}; while [ ! -e {go} ]; do sleep 0.05; done; echo after {tag}",
        pids = dir.join(format!("{tag}.pids")).display(),
        go = dir.join(format!("{tag}.go")).display(),
    )
}

#[test]
fn a_job_outlives_its_agent_and_the_restarted_agent_reports_its_whole_log_and_exit() {
    let mut w = World::new("outlive", &[("capacity", "2")]);
    let dir = w.path("gates");
    std::fs::create_dir_all(&dir).unwrap();
    // One job ends while no agent runs, one after the next agent took it back.
    let ended_while_down = w.control.submit(&["--", "sh", "-c", &gated_job(&dir, "a")]);
    let outlived = w.control.submit(&["--", "sh", "-c", &gated_job(&dir, "b")]);
    for run in [&ended_while_down, &outlived] {
        w.wait_status(run, "running");
    }
    for tag in ["a", "b"] {
        let pids = dir.join(format!("{tag}.pids"));
        common::wait_for("the job's pid", || w.context(), || (!common::read_pids(&pids).is_empty()).then_some(()));
    }
    // A crash: the agent dies at once. Its jobs do not.
    common::signal(&w.agent.proc.0, rustix::process::Signal::KILL);
    let _ = w.agent.proc.0.wait();
    let a = common::read_pids(&dir.join("a.pids"))[0];
    assert!(common::alive(a), "the job lives on without its agent");
    std::fs::write(dir.join("a.go"), b"").unwrap();
    common::wait_for("job a to end with no agent", || w.context(), || (!common::alive(a)).then_some(()));

    w.agent = common::Agent::spawn(&w.root.0, w.agent.config.clone());
    common::wait_for(
        "the restarted agent to take job b back",
        || w.context(),
        || w.agent.log().contains("watching it again").then_some(()),
    );
    std::fs::write(dir.join("b.go"), b"").unwrap();
    for (run, tag) in [(&ended_while_down, "a"), (&outlived, "b")] {
        let shown = w.wait_status(run, "succeeded");
        assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "exactly once: {shown}");
        assert_eq!(attempt(&shown)["exitCode"], 0, "the true exit: {shown}");
        assert_eq!(w.control.logs(run), format!("before {tag}\nafter {tag}\n").into_bytes(), "the whole log");
    }
    assert!(w.agent.log().contains("its supervisor kept the exit"), "{}", w.context());
}

/// A job taken back after it ran past its timeout while no agent watched it is stopped at
/// once by the agent's own timer, as timed out: its timeout counts from its own start, not
/// from the restarted agent's (which would give it the whole timeout again, and leave the
/// stop to ql-control's deadline at the next renewal).
#[test]
fn a_job_that_ran_past_its_timeout_while_no_agent_watched_is_stopped_when_taken_back() {
    let root = common::TempDir::new("outran");
    // Leases and sessions that outlast the agent's absence: the server keeps the attempt.
    let long = |(key, value): &(&'static str, u64)| match *key {
        "lease_ttl_ms" | "session_ttl_ms" => (*key, 120_000),
        _ => (*key, *value),
    };
    let timings: Vec<(&str, u64)> = common::SHORT_TIMINGS.iter().map(long).collect();
    let dir = root.0.join("control");
    common::init_control(common::control_bin(), &dir, &root.0.join("creds"), &timings);
    let control = common::Control::serve(common::control_bin(), &dir, "127.0.0.1:0", &root.0.join("control.err"), &[]);
    let agent = common::Agent::start(&root.0, &control, &[]);
    let mut w = World { control, agent, root };
    let gates = w.path("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let (pids, aged) = (gates.join("pids"), gates.join("aged"));
    // It says when it has run longer than its timeout, then runs on until stopped (or
    // until the test's directory is gone, should the test fail first).
    let body = format!(
        "echo $$ >> {p}; sleep 11; touch {a}; while [ -d {g} ]; do sleep 0.05; done",
        p = pids.display(),
        a = aged.display(),
        g = gates.display()
    );
    let run = w.control.submit(&["--timeout-ms", "10000", "--", "sh", "-c", &body]);
    w.wait_status(&run, "running");
    common::wait_for("the job's pid", || w.context(), || (!common::read_pids(&pids).is_empty()).then_some(()));
    common::signal(&w.agent.proc.0, rustix::process::Signal::KILL);
    let _ = w.agent.proc.0.wait();
    let first_life = w.agent.log();
    assert!(!first_life.contains("stopping its process group"), "killed before its timeout: {first_life}");
    common::wait_for("the job to run past its timeout", || w.context(), || aged.exists().then_some(()));

    w.agent = common::Agent::spawn(&w.root.0, w.agent.config.clone());
    let second_life = || w.agent.log()[first_life.len()..].to_owned();
    common::wait_for(
        "the restarted agent to take the job back with nothing left of its timeout",
        || w.context(),
        || second_life().contains("outlived the previous agent and its timeout").then_some(()),
    );
    let shown = w.wait_status(&run, "timed_out");
    assert_eq!(shown["errorCode"], "EXECUTION_TIMED_OUT", "{shown}");
    assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "exactly once: {shown}");
    for pid in common::read_pids(&pids) {
        assert!(!common::alive(pid), "process {pid} of the timed-out job is still alive");
    }
    // Its own timer stopped it, before a renewal could bring ql-control's deadline.
    assert!(second_life().contains("stopping its process group: its timeout passed"), "{}", w.context());
    assert!(!second_life().contains("watching it again"), "{}", w.context());
}

/// A job whose first run sleeps and whose second says `second`, submitted with one
/// retry and running: its run, its process id and its run directory's `job` file (the
/// job's and its supervisor's handles).
fn running_once_then_second(w: &World) -> (String, u32, std::path::PathBuf) {
    let dir = w.path("gates");
    std::fs::create_dir_all(&dir).unwrap();
    let (marker, pids) = (dir.join("first"), dir.join("pids"));
    let body = format!(
        "if [ -e {m} ]; then echo second; else touch {m}; echo $$ >> {p}; echo first; sleep 600; fi",
        m = marker.display(),
        p = pids.display()
    );
    let run = w.control.submit(&["--retries", "1", "--", "sh", "-c", &body]);
    let shown = w.wait_status(&run, "running");
    common::wait_for("the job's pid", || w.context(), || (!common::read_pids(&pids).is_empty()).then_some(()));
    let job = common::read_pids(&pids)[0];
    let attempt_id = attempt(&shown)["attemptId"].as_str().unwrap().to_owned();
    let job_file = w.path("agent-state").join("runs").join(attempt_id).join("job");
    (run, job, job_file)
}

/// The run of [`running_once_then_second`] succeeded on its second attempt, its first
/// given up as lost (not failed), and its log is the second's.
fn lost_then_ran_again(w: &World, run: &str) {
    let shown = w.wait_status(run, "succeeded");
    let attempts = shown["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{shown}");
    assert_eq!(
        (attempts[0]["status"].as_str(), attempts[0]["errorCode"].as_str()),
        (Some("lost"), Some("WORKER_LOST")),
        "{shown}"
    );
    assert_eq!(w.control.logs(run), b"second\n");
    assert!(w.agent.log().contains("reported lost, not failed"), "{}", w.context());
}

#[test]
fn a_job_lost_with_its_supervisor_is_given_up_and_its_run_runs_again_within_its_retries() {
    let mut w = World::new("lost", &[]);
    let (run, _, job_file) = running_once_then_second(&w);
    // What a machine that went down leaves behind (with the journal on disk): neither the
    // agent, nor the supervisor, nor the job.
    common::signal(&w.agent.proc.0, rustix::process::Signal::KILL);
    let _ = w.agent.proc.0.wait();
    let handles = std::fs::read_to_string(&job_file).unwrap();
    let pid_of = |line: &str| -> i32 { line.split_whitespace().next().unwrap()[4..].parse().unwrap() };
    let (job, supervisor) = {
        let mut lines = handles.lines();
        (pid_of(lines.next().unwrap()), pid_of(lines.next().unwrap()))
    };
    for pid in [supervisor, job] {
        let _ =
            rustix::process::kill_process(rustix::process::Pid::from_raw(pid).unwrap(), rustix::process::Signal::KILL);
    }
    common::wait_for(
        "the job and its supervisor to be gone",
        || w.context(),
        || (!common::alive(job as u32) && !common::alive(supervisor as u32)).then_some(()),
    );

    w.agent = common::Agent::spawn(&w.root.0, w.agent.config.clone());
    lost_then_ran_again(&w, &run);
}

/// A supervisor killed while the agent watches its job (the kernel's OOM killer on a
/// small router, say): nobody knows how the job ended, so it is reported lost, as a job
/// found gone after a restart is, its process is stopped, and its run runs again within
/// its retries.
#[test]
fn a_job_whose_supervisor_is_killed_under_a_running_agent_is_reported_lost() {
    let w = World::new("supervisor-killed", &[]);
    let (run, job, job_file) = running_once_then_second(&w);
    let supervisor: i32 = common::wait_for(
        "the supervisor's pid",
        || w.context(),
        || {
            let handles = std::fs::read_to_string(&job_file).ok()?;
            let line = handles.lines().nth(1)?;
            line.split_whitespace().next()?.strip_prefix("pid:")?.parse().ok()
        },
    );
    rustix::process::kill_process(rustix::process::Pid::from_raw(supervisor).unwrap(), rustix::process::Signal::KILL)
        .unwrap();
    lost_then_ran_again(&w, &run);
    common::wait_for("the job stopped", || w.context(), || (!common::alive(job)).then_some(()));
}

/// A reload hands the jobs over instead of draining them: a SIGTERM that finds the
/// reload marker, or a SIGHUP, ends the agent at once with status 75 and its job running;
/// the agent started again takes the job back and reports it once, its log whole. A plain
/// SIGTERM still drains (the first test of tests/agent_e2e.rs and every stop here).
#[test]
fn a_reload_restarts_the_agent_and_its_running_job_carries_on() {
    let marker_root = common::TempDir::new("reload-marker");
    let marker = marker_root.0.join("reload");
    let marker_text = marker.to_str().unwrap().to_owned();
    let mut w = World::new("reload", &[("reload_marker", marker_text.as_str())]);
    let dir = w.path("gates");
    std::fs::create_dir_all(&dir).unwrap();
    let run = w.control.submit(&["--", "sh", "-c", &gated_job(&dir, "r")]);
    w.wait_status(&run, "running");
    let pids = dir.join("r.pids");
    common::wait_for("the job's pid", || w.context(), || (!common::read_pids(&pids).is_empty()).then_some(()));
    let job = common::read_pids(&pids)[0];

    // procd's reload: the init script leaves the marker, procd sends SIGTERM.
    std::fs::write(&marker, b"").unwrap();
    common::signal(&w.agent.proc.0, rustix::process::Signal::TERM);
    let status = w.agent.proc.0.wait().unwrap();
    assert_eq!(status.code(), Some(75), "{}", w.context());
    assert!(common::alive(job), "the job runs on through the reload");
    assert!(!marker.exists(), "the marker is consumed");
    assert!(w.agent.log().contains("SIGTERM for a reload: exiting at once"), "{}", w.context());

    // Started again (procd would), it takes the job back; then SIGHUP does the same.
    w.agent = common::Agent::spawn(&w.root.0, w.agent.config.clone());
    common::wait_for(
        "the job taken back",
        || w.context(),
        || w.agent.log().contains("watching it again").then_some(()),
    );
    common::signal(&w.agent.proc.0, rustix::process::Signal::HUP);
    assert_eq!(w.agent.proc.0.wait().unwrap().code(), Some(75));
    assert!(common::alive(job));
    w.agent = common::Agent::spawn(&w.root.0, w.agent.config.clone());
    common::wait_for(
        "the job taken back again",
        || w.context(),
        || (w.agent.log().matches("watching it again").count() >= 2).then_some(()),
    );
    std::fs::write(dir.join("r.go"), b"").unwrap();
    let shown = w.wait_status(&run, "succeeded");
    assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "exactly once: {shown}");
    assert_eq!(w.control.logs(&run), b"before r\nafter r\n".to_vec(), "the whole log");
    assert!(w.agent.terminate().success(), "a plain SIGTERM drains and exits 0: {}", w.context());
}
