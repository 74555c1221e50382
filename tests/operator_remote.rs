//! The CLI from another machine: `ql-control --server` against a real `serve`'s operator
//! API, with a real agent running the job. The README's quickstart runs through it — a
//! script submitted, its log followed live to the end with its SHA-256 checked, the run
//! shown and listed, the worker listed — with no access to the state directory but its
//! public CA certificate; a read-only token may look but not change, and the commands
//! that need the state directory itself refuse `--server`.

mod common;

use std::process::{Command, Output};

use common::{text, World};

/// `ql-control --server URL --ca CA <args>` with `token` in `$QL_CONTROL_TOKEN`, from a
/// directory that is not the state directory.
fn remote(w: &World, token: &str, args: &[&str]) -> Output {
    remote_command(w, token, args).output().expect("ql-control runs")
}

/// The command [`remote`] runs, to start it and read its output as it comes.
fn remote_command(w: &World, token: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(&w.control.bin);
    cmd.args(["--server", &w.control.operator_url, "--ca"])
        .arg(w.control.dir.join("pki").join("ca.crt"))
        .args(args)
        .env("QL_CONTROL_TOKEN", token)
        .env("QL_CONTROL_DIR", "/nonexistent/ql-control")
        .current_dir(w.path(""));
    cmd
}

/// `text` parsed by the `prometheus_client` Python package's OpenMetrics parser: for
/// each family, each sample's labels (`k=v,...`, sorted) and value (`_total` and
/// `_count` samples only for counters and histograms).
fn openmetrics(text: &str) -> serde_json::Value {
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    samples = out.setdefault(family.name, {})
    for s in family.samples:
        if family.type in ("counter",) and not s.name.endswith("_total"):
            continue
        if family.type == "histogram" and not s.name.endswith("_count"):
            continue
        samples[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the parser refused the metrics:\n{text}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `GET path` on the operator API with `token`: the status and the body.
fn get(w: &World, path: &str, token: &str) -> (u16, String) {
    let mut answer = w
        .control
        .operator_client()
        .get(format!("{}{path}", w.control.operator_url))
        .header("Authorization", format!("Bearer {token}"))
        .call()
        .unwrap();
    (answer.status().as_u16(), answer.body_mut().read_to_string().unwrap())
}

/// Its stdout, exactly, once it succeeded.
fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_quickstart_runs_remotely_through_the_operator_api() {
    let w = World::new("remote", &[]);
    let admin = w.control.operator("ops", "admin");
    let viewer = w.control.operator("viewer", "read");

    // The quickstart's job, held after its first line until the follower has shown it:
    // the log is followed while the run is live, not read once it ended.
    let (script, gate) = (w.path("job.sh"), w.path("gate"));
    let job = format!(
        "echo \"hello from QingLong Edge\"\nwhile [ ! -e '{}' ]; do sleep 0.05; done\nseq 1 20000\necho done\n",
        gate.display()
    );
    std::fs::write(&script, job).unwrap();
    let run = ok(remote(
        &w,
        &admin,
        &["submit", "--script", script.to_str().unwrap(), "--interpreter", "sh", "--timeout-ms", "60000"],
    ))
    .trim()
    .to_owned();
    let mut follower = remote_command(&w, &admin, &["logs", &run, "--follow", "--poll-ms", "200"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("ql-control runs");
    // Its lines as they come, so that a follower that stalls fails the test, not hangs it.
    let stdout = follower.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line + "\n").is_err() {
                break;
            }
        }
    });
    let mut log = lines.recv_timeout(common::DEADLINE).expect("the follower's first line");
    assert_eq!(log, "hello from QingLong Edge\n");
    assert_eq!(w.status(&run), "running", "the first line was followed while the job ran");
    std::fs::write(&gate, b"").unwrap();
    let status = common::wait_for("the follower to end", || w.context(), || follower.try_wait().unwrap());
    // Ended, it closed its output: the reader has every line, and ends.
    log.extend(lines.iter());
    let mut said = String::new();
    std::io::Read::read_to_string(&mut follower.stderr.take().unwrap(), &mut said).unwrap();
    assert!(status.success(), "{said}");
    let expected: String = std::iter::once("hello from QingLong Edge".to_owned())
        .chain((1..=20000).map(|i| i.to_string()))
        .chain(["done".to_owned()])
        .map(|l| l + "\n")
        .collect();
    let differs = log.bytes().zip(expected.bytes()).position(|(a, b)| a != b);
    assert!(
        log == expected,
        "the followed log is not the job's output: {} bytes, {} expected, first difference at {differs:?}, near {:?}",
        log.len(),
        expected.len(),
        differs.map(|at| &log[at.saturating_sub(20)..(at + 20).min(log.len())]),
    );
    assert!(said.contains("SHA-256") && said.contains("checked"), "{said}");
    assert_eq!(w.wait_status(&run, "succeeded")["status"], "succeeded");
    assert!(ok(remote(&w, &viewer, &["logs", &run])) == expected, "the stored log, read by a viewer");

    let shown = ok(remote(&w, &viewer, &["show", &run]));
    assert!(shown.contains("status   succeeded") && shown.contains("exit=0"), "{shown}");
    let json: serde_json::Value = serde_json::from_str(&ok(remote(&w, &viewer, &["show", &run, "--json"]))).unwrap();
    assert_eq!(json["attempts"][0]["artifact"]["length"], expected.len());
    assert!(ok(remote(&w, &viewer, &["runs", "--status", "succeeded"])).contains(&run));
    let workers = ok(remote(&w, &viewer, &["workers"]));
    assert!(workers.lines().any(|l| l.starts_with("w1 ") && l.contains("online")), "{workers}");
    let certificates = ok(remote(&w, &viewer, &["workers", "certificates"]));
    assert!(certificates.starts_with("WORKER") && certificates.contains("RENEWED FROM"), "{certificates}");
    // A revocation with its renewals travels whole: the server looks the serial up.
    let unknown = remote(&w, &admin, &["workers", "revoke", "w1", "--serial", "00ff", "--with-renewals"]);
    let said = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success() && said.contains("no certificate of w1 with that serial"), "{said}");

    // Schedules remotely.
    let added = ok(remote(&w, &admin, &["schedule", "add", "nightly", "--cron", "0 30 7 * * *", "--", "true"]));
    assert!(added.starts_with("nightly added"), "{added}");
    assert!(ok(remote(&w, &viewer, &["schedule", "list"])).contains("nightly"));
    let now = ok(remote(&w, &admin, &["schedule", "run-now", "nightly"])).trim().to_owned();
    assert!(ok(remote(&w, &viewer, &["runs", "--schedule", "nightly"])).contains(&now));
    w.wait_status(&now, "succeeded");
    ok(remote(&w, &admin, &["schedule", "remove", "nightly"]));

    // Prometheus's view, with a read token: the worker requests by route and status, the
    // runs by status, the stored bytes; no run id anywhere (no unbounded label).
    let (status, metrics) = get(&w, "/metrics", &viewer);
    assert_eq!(status, 200, "{metrics}");
    let value = |prefix: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix}:\n{metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("ql_runs{status=\"succeeded\"}") >= 2.0, "{metrics}");
    assert!(value("ql_artifact_bytes ") >= expected.len() as f64);
    assert!(metrics.lines().any(|l| l.starts_with("ql_requests_total{") && l.contains("route=\"session.open\"")));
    assert!(metrics.contains("ql_store_seconds_bucket{") && metrics.contains("command=\"complete\""));
    assert!(!metrics.contains(&run) && !metrics.contains("w1"), "no id is a label:\n{metrics}");
    assert_eq!(get(&w, "/metrics", "nobody.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA").0, 401);
    // The Prometheus project's own parser reads it, and its counts are what happened.
    let parsed = openmetrics(&metrics);
    let succeeded = ok(remote(&w, &viewer, &["runs", "--status", "succeeded"])).lines().count() - 1;
    assert_eq!(parsed["ql_runs"]["status=succeeded"], succeeded as f64, "{parsed}");
    assert!(parsed["ql_requests"]["code=201,route=session.open"].as_f64().unwrap() >= 1.0, "{parsed}");
    assert!(parsed["ql_store_seconds"].as_object().unwrap().keys().any(|k| k.contains("command=complete")));

    // A viewer may not change anything; --server refuses what needs the directory.
    let run_ids = || -> Vec<String> {
        text(&w.control.cli(&["runs"])).lines().skip(1).filter_map(|l| l.split(' ').next()).map(str::to_owned).collect()
    };
    let before = run_ids();
    let refused = remote(&w, &viewer, &["submit", "--", "true"]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("may not"));
    assert_eq!(run_ids(), before, "nothing was queued");
    for local in [
        &["init"][..],
        &["enroll", "w9"],
        &["serve"],
        &["migrate", "--database", "host=/nonexistent"],
        &["operator", "list"],
    ] {
        let refused = remote(&w, &admin, local);
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && said.contains("not through --server"), "{local:?}: {said}");
    }
    let wrong = remote(&w, "ops.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", &["runs"]);
    assert!(!wrong.status.success() && String::from_utf8_lossy(&wrong.stderr).contains("operator token"));
}
