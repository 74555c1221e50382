//! A worker identity's life, end to end with real processes over real TLS: a device
//! enrols with a one-time token and its own key, renews its certificate twice during a
//! run that still succeeds on one session, keeps working after its old certificate is
//! revoked; a wrong CA fingerprint or a spent token stores nothing; a revoked worker's
//! running attempt is queued again at once and finished by another worker.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use common::{agent_bin, Agent, Control, TempDir};

fn agent_cli(args: &[&str]) -> Output {
    Command::new(agent_bin()).args(args).output().expect("ql-agent runs")
}

/// `ql-control enroll <worker> --token`: the token and the CA fingerprint it printed.
fn token(control: &Control, worker: &str) -> (String, String) {
    let out = control.cli(&["enroll", worker, "--token", "--server", &control.url]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let command = text.lines().find(|l| l.trim_start().starts_with("ql-agent enroll")).expect("the agent's command");
    let word = |flag: &str| {
        let words: Vec<&str> = command.split_whitespace().collect();
        words[words.iter().position(|w| *w == flag).unwrap() + 1].to_owned()
    };
    (word("--token"), word("--ca-fingerprint"))
}

fn enrol(control: &Control, token: &str, fingerprint: &str, dir: &Path) -> Output {
    agent_cli(&[
        "enroll",
        "--server",
        &control.url,
        "--token",
        token,
        "--ca-fingerprint",
        fingerprint,
        "--dir",
        dir.to_str().unwrap(),
    ])
}

/// Serials of `worker`'s recorded certificates, oldest first.
fn serials(control: &Control, worker: &str) -> Vec<String> {
    let out = control.cli(&["workers", "certificates"]);
    let text = String::from_utf8(out.stdout).unwrap();
    let mut rows: Vec<(String, String)> = text
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            (cells.first() == Some(&worker)).then(|| (cells[2].to_owned(), cells[1].to_owned()))
        })
        .collect();
    rows.sort();
    rows.into_iter().map(|(_, serial)| serial).collect()
}

fn control_with(root: &Path, extra: &[(&str, u64)]) -> Control {
    let dir = root.join("control");
    let timings: Vec<(&str, u64)> = common::SHORT_TIMINGS.iter().copied().chain(extra.iter().copied()).collect();
    common::init_control(common::control_bin(), &dir, &root.join("creds"), &timings);
    Control::serve(common::control_bin(), &dir, "127.0.0.1:0", &root.join("control.err"), &[])
}

#[test]
fn a_token_enrols_a_device_whose_certificate_renews_twice_during_one_run() {
    let root = TempDir::new("identity-rotate");
    // Certificates of six seconds: renewed about four seconds after each issue.
    let control = control_with(&root.0, &[("worker_cert_lifetime_ms", 6_000)]);
    let (token, fingerprint) = token(&control, "w9");
    let creds = root.0.join("device");
    let out = enrol(&control, &token, &fingerprint, &creds);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("enrolled w9"));
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(fs::metadata(creds.join("w9.key")).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(serials(&control, "w9").len(), 1);

    let config = root.0.join("w9.conf");
    let text = common::agent_config(
        &control.url,
        &creds,
        &root.0.join("w9-state"),
        &[("poll_wait_ms", "500"), ("backoff_initial_ms", "50"), ("backoff_max_ms", "500")],
    )
    .replace("worker_id = w1", "worker_id = w9")
    .replace("w1.crt", "w9.crt")
    .replace("w1.key", "w9.key");
    fs::write(&config, text).unwrap();
    let mut agent = Agent::spawn_with(&agent_bin(), &root.0.join("w9.err"), config, &[]);
    let context = || format!("--- agent ---\n{}\n--- control ---\n{}", agent_log(&root.0), control.log());
    // The job runs until the agent has renewed its certificate twice (three serials).
    let gate = root.0.join("gate");
    let job = format!("echo begin; while [ ! -e '{}' ]; do sleep 0.05; done; echo end", gate.display());
    let run = control.submit(&["--", "sh", "-c", &job]);
    common::wait_for("the job to start", context, || (control.show(&run)["status"] == "running").then_some(()));
    let renewed = || agent_log(&root.0).matches("certificate renewed").count();
    let (issued, renewals) = (serials(&control, "w9").len(), renewed());
    common::wait_for("two renewals while the job runs", context, || {
        (serials(&control, "w9").len() >= issued + 2 && renewed() >= renewals + 2).then_some(())
    });
    fs::write(&gate, b"").unwrap();
    let shown = common::wait_for("the run to succeed", context, || {
        let shown = control.show(&run);
        (shown["status"] == "succeeded").then_some(shown)
    });
    assert_eq!(shown["attempts"].as_array().unwrap().len(), 1, "one attempt: {shown}");
    assert_eq!(control.logs(&run), b"begin\nend\n");
    let log = agent_log(&root.0);
    assert!(log.matches("certificate renewed").count() >= 2, "{log}");
    assert_eq!(log.matches(" opened (heartbeat").count(), 1, "one session all along: {log}");
    let serials = serials(&control, "w9");
    assert!(serials.len() >= 3, "{serials:?}");

    // The first certificate, revoked after the rotations: the agent goes on with its own.
    let out = control.cli(&["workers", "revoke", "w9", "--serial", &serials[0]]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let second = control.submit(&["--", "echo", "after"]);
    common::wait_for("the second run", context, || (control.show(&second)["status"] == "succeeded").then_some(()));

    // Each renewal names the certificate it renewed, and revoking the first with its
    // renewals revokes the agent's own, however many renewals down.
    let listing = String::from_utf8(control.cli(&["workers", "certificates"]).stdout).unwrap();
    let from = |serial: &str| {
        let row = listing.lines().find(|l| l.split_whitespace().nth(1) == Some(serial)).expect("listed");
        row.split_whitespace().last().unwrap().to_owned()
    };
    assert_eq!(from(&serials[0]), "-", "{listing}");
    for pair in serials.windows(2) {
        assert_eq!(from(&pair[1]), pair[0], "{listing}");
    }
    let logged = agent_log(&root.0).len();
    let out = control.cli(&["workers", "revoke", "w9", "--serial", &serials[0], "--with-renewals"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The agent may have renewed again since the listing: at least those listed go.
    let renewed: usize = said
        .split_once("with ")
        .and_then(|(_, rest)| rest.split_once(" certificate(s) renewed from it"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(renewed >= serials.len() - 1, "{said}");
    let listing = String::from_utf8(control.cli(&["workers", "certificates"]).stdout).unwrap();
    let w9: Vec<&str> = listing.lines().filter(|l| l.starts_with("w9 ")).collect();
    assert!(w9.len() >= serials.len() && w9.iter().all(|l| l.split_whitespace().nth(4) != Some("-")), "{listing}");
    common::wait_for("the agent to be refused", context, || {
        agent_log(&root.0)[logged..].contains("certificate_revoked").then_some(())
    });
    assert!(agent.terminate().success());
}

fn agent_log(root: &Path) -> String {
    fs::read_to_string(root.join("w9.err")).unwrap_or_default()
}

#[test]
fn a_wrong_fingerprint_sends_nothing_and_a_spent_token_stores_nothing() {
    let root = TempDir::new("identity-refusals");
    let control = control_with(&root.0, &[]);
    let (token, fingerprint) = token(&control, "w8");
    let dir = root.0.join("device");
    let wrong = "00".repeat(32);
    let out = enrol(&control, &token, &wrong, &dir);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing was sent"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dir.join("w8.key").exists() && !dir.join("w8.crt").exists());
    assert!(serials(&control, "w8").is_empty());

    // The token was not spent by that: it enrols once, and only once.
    assert!(enrol(&control, &token, &fingerprint, &dir).status.success());
    let key = fs::read(dir.join("w8.key")).unwrap();
    let again = enrol(&control, &token, &fingerprint, &root.0.join("elsewhere"));
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("refused the token"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(serials(&control, "w8").len(), 1, "nothing stored for the reuse");
    assert_eq!(fs::read(dir.join("w8.key")).unwrap(), key);
    // A token for one worker cannot enrol another: the token names its worker, and a
    // forged name fails the same way.
    let forged = token.replacen("w8.", "w7.", 1);
    assert!(!enrol(&control, &forged, &fingerprint, &root.0.join("forged")).status.success());
    assert!(serials(&control, "w7").is_empty());
}

#[test]
fn a_revoked_worker_stops_its_job_and_another_worker_finishes_the_run() {
    let root = TempDir::new("identity-revoke");
    let control = control_with(&root.0, &[]);
    let mut w1 = Agent::start(&root.0, &control, &[]);
    let marker = root.0.join("first-attempt-ran");
    let script =
        format!("if [ -e {m} ]; then echo second; else touch {m}; echo first; sleep 60; fi", m = marker.display());
    let run = control.submit(&["--retries", "1", "--", "sh", "-c", &script]);
    let context = || format!("--- w1 ---\n{}\n--- control ---\n{}", w1.log(), control.log());
    let first = common::wait_for("the first attempt to run", context, || {
        let shown = control.show(&run);
        (shown["status"] == "running").then(|| shown["attempts"][0]["attemptId"].as_str().unwrap().to_owned())
    });

    // Another worker, enrolled with a token, stands by.
    let (token, fingerprint) = token(&control, "w2");
    let w2_creds = root.0.join("w2");
    assert!(enrol(&control, &token, &fingerprint, &w2_creds).status.success());
    let config = root.0.join("w2.conf");
    let text = common::agent_config(&control.url, &w2_creds, &root.0.join("w2-state"), &[("poll_wait_ms", "500")])
        .replace("worker_id = w1", "worker_id = w2")
        .replace("w1.crt", "w2.crt")
        .replace("w1.key", "w2.key");
    fs::write(&config, text).unwrap();
    let mut w2 = Agent::spawn_with(&agent_bin(), &root.0.join("w2.err"), config, &[]);

    let out = control.cli(&["workers", "revoke", "w1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 attempt(s) lost"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let shown = common::wait_for("the run to succeed on w2", context, || {
        let shown = control.show(&run);
        (shown["status"] == "succeeded").then_some(shown)
    });
    let attempts = shown["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{shown}");
    assert_eq!(
        (attempts[0]["status"].as_str(), attempts[0]["errorCode"].as_str()),
        (Some("lost"), Some("WORKER_REVOKED"))
    );
    assert_eq!(attempts[1]["worker"], "w2");
    assert_eq!(control.logs(&run), b"second\n");
    // The revoked agent stops its copy of the job (the server gave it up) and says why.
    common::wait_for("w1's job to be stopped", context, || {
        common::tagged_processes("QL_ATTEMPT_ID", &first).is_empty().then_some(())
    });
    common::wait_for("w1 to say it was revoked", context, || w1.log().contains("certificate_revoked").then_some(()));
    let workers = String::from_utf8(control.cli(&["workers"]).stdout).unwrap();
    assert!(workers.lines().any(|l| l.starts_with("w1 ") && l.contains("revoked")), "{workers}");
    assert!(w2.terminate().success());
    w1.terminate();
}
