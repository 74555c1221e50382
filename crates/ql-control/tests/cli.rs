//! The operator CLI refuses what could never run, says why, and changes nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ql-control");

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A scratch directory `ql-cli-<name>-<pid>` with a state directory `state` made by
/// `ql-control init` in it.
fn initialised(name: &str) -> (Dir, PathBuf) {
    let root = Dir(std::env::temp_dir().join(format!("ql-cli-{name}-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&root.0);
    let dir = root.0.join("state");
    let init = Command::new(BIN).args(["init", "--host", "127.0.0.1", "--dir"]).arg(&dir).output().unwrap();
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    (root, dir)
}

/// `ql-control <args[0]> --dir <dir> <args[1..]>`: the directory before any `--`.
fn cli(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN).arg(args[0]).arg("--dir").arg(dir).args(&args[1..]).output().unwrap()
}

#[test]
fn submit_refuses_labels_no_worker_carries_and_an_interpreter_without_a_script() {
    let (_root, dir) = initialised("submit");
    let before = cli(&dir, &["runs"]).stdout;
    let many: Vec<String> = (0..17).map(|i| format!("l{i}=v")).collect();
    let mut seventeen = vec!["submit"];
    for label in &many {
        seventeen.extend(["--label", label]);
    }
    seventeen.extend(["--", "true"]);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["submit", "--label", "A=b", "--", "true"], "no worker could declare it"),
        (vec!["submit", "--label", "site=a\nb", "--", "true"], "no worker could declare it"),
        (seventeen, "at most 16 labels"),
        (vec!["submit", "--interpreter", "bash", "--", "true"], "--interpreter runs a --script"),
    ];
    for (args, says) in cases {
        let out = cli(&dir, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
    assert_eq!(cli(&dir, &["runs"]).stdout, before, "nothing was queued");
    let ok = cli(&dir, &["submit", "--label", "site=attic", "--", "true"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
}

#[test]
fn init_makes_a_private_state_directory_whatever_the_umask_and_others_are_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let root = Dir(std::env::temp_dir().join(format!("ql-cli-private-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&root.0);
    std::fs::create_dir_all(&root.0).unwrap();
    let dir = root.0.join("state");
    let init = Command::new("sh")
        .arg("-c")
        .arg(format!("umask 000; exec {BIN} init --host 127.0.0.1 --dir {}", dir.display()))
        .output()
        .unwrap();
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("control.json")), 0o600);
    assert_eq!(mode(&dir.join("control.db")), 0o600);
    assert_eq!(mode(&dir.join("artifacts")), 0o700);

    let before = cli(&dir, &["runs"]);
    assert!(before.status.success());
    for (path, loose) in [(dir.clone(), 0o777), (dir.join("control.json"), 0o666), (dir.join("control.db"), 0o620)] {
        let was = mode(&path);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(loose)).unwrap();
        for args in [vec!["runs"], vec!["submit", "--", "true"], vec!["serve", "--listen", "127.0.0.1:0"]] {
            let out = cli(&dir, &args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("refusing a state directory"),
                "{args:?} with {path:?}: {err}"
            );
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(was)).unwrap();
    }
    assert_eq!(cli(&dir, &["runs"]).stdout, before.stdout, "nothing changed");
}

#[test]
fn the_operator_gives_a_worker_its_trusted_labels_at_enrolment_or_later() {
    let (root, dir) = initialised("labels");
    let out = root.0.join("out");
    let text = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();

    // A bad label is refused before a certificate is issued.
    let bad = cli(&dir, &["enroll", "w1", "--out", out.to_str().unwrap(), "--label", "Site=x"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("--label"));
    assert!(!out.join("w1.crt").exists(), "nothing issued");

    let enrolled = cli(&dir, &["enroll", "w1", "--out", out.to_str().unwrap(), "--label", "site=cluster-prod"]);
    assert!(enrolled.status.success(), "{}", String::from_utf8_lossy(&enrolled.stderr));
    assert!(text(&enrolled).contains("w1: site=cluster-prod"), "{}", text(&enrolled));
    let listed = text(&cli(&dir, &["workers"]));
    assert!(listed.contains("TRUSTED LABELS") && listed.contains("site=cluster-prod"), "{listed}");

    let before = text(&cli(&dir, &["workers"]));
    let refused = cli(&dir, &["label", "w1", "tier=a\nb"]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("label"));
    assert_eq!(text(&cli(&dir, &["workers"])), before, "a refused label changes nothing");

    let relabelled = cli(&dir, &["label", "w1", "tier=lab"]);
    assert!(relabelled.status.success());
    let listed = text(&cli(&dir, &["workers"]));
    assert!(listed.contains("tier=lab") && !listed.contains("site=cluster-prod"), "replaced: {listed}");
    assert!(cli(&dir, &["submit", "--label", "tier=lab", "--agent-label", "arch=mips", "--", "true"]).status.success());
}

#[test]
fn enroll_records_each_certificate_and_replace_revokes_the_ones_before() {
    let (root, dir) = initialised("replace");
    let enroll = |out: &str, extra: &[&str]| {
        let mut args = vec!["enroll", "r1", "--out"];
        let out = root.0.join(out);
        let out = out.to_str().unwrap().to_owned();
        args.push(&out);
        args.extend(extra);
        let done = cli(&dir, &args);
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
        String::from_utf8(done.stdout).unwrap()
    };
    let first = enroll("first", &[]);
    assert!(first.contains("certificate serial"), "{first}");
    let listed = || String::from_utf8(cli(&dir, &["workers", "certificates"]).stdout).unwrap();
    // The REVOKED column of each row.
    let rows =
        |text: &str| text.lines().skip(1).map(|l| l.split_whitespace().nth(4).unwrap().to_owned()).collect::<Vec<_>>();
    assert_eq!(rows(&listed()), ["-"], "one certificate, not revoked");
    let second = enroll("second", &["--replace"]);
    assert!(second.contains("r1 revoked: 1 recorded certificate(s)"), "{second}");
    let mut revoked = rows(&listed());
    revoked.sort();
    assert_eq!(revoked.len(), 2);
    assert_eq!(revoked[0], "-", "the new one stands");
    assert_ne!(revoked[1], "-", "the old one is revoked");
    // Into a directory that holds r1's files already: refused before the revocation and
    // the labels it asks for, so the worker keeps its certificate and its labels.
    let workers = || String::from_utf8(cli(&dir, &["workers"]).stdout).unwrap();
    let (certificates, before) = (listed(), workers());
    let out = root.0.join("second");
    let again = cli(&dir, &["enroll", "r1", "--replace", "--label", "site=attic", "--out", out.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && said.contains("r1.crt"), "{said}");
    assert_eq!((listed(), workers()), (certificates.clone(), before.clone()), "nothing revoked, labelled or issued");
    // Nor into a file where the directory would go.
    let file = root.0.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let again = cli(&dir, &["enroll", "r1", "--replace", "--out", file.to_str().unwrap()]);
    assert!(!again.status.success(), "{}", String::from_utf8_lossy(&again.stdout));
    assert_eq!((listed(), workers()), (certificates, before), "nothing revoked for a file in the way");
    // Neither --out nor --token: refused before anything is issued.
    let neither = cli(&dir, &["enroll", "r2"]);
    assert!(!neither.status.success());
    assert!(!listed().contains("r2"));
    let workers = workers();
    assert!(workers.lines().any(|l| l.starts_with("r1 ") && l.contains("active")), "enrolled again: {workers}");
}

#[test]
fn serve_raises_its_open_file_limit_and_says_when_even_the_hard_one_is_too_low() {
    use std::io::{BufRead as _, BufReader};
    let (root, dir) = initialised("nofile");
    // The defaults need 1024 + 256 + 64 descriptors.
    let serve = |limits: &str| {
        let err = root.0.join("serve.err");
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "{limits}; exec {BIN} serve --listen 127.0.0.1:0 --operator-listen '' --dir {}",
                dir.display()
            ))
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("listening on"), "{line}");
        let _ = child.kill();
        let _ = child.wait();
        std::fs::read_to_string(err).unwrap()
    };
    let low = serve("ulimit -n 512");
    assert!(low.contains("need about 1344 open files, the limit is 512"), "{low}");
    let raised = serve("ulimit -Hn 4096; ulimit -Sn 256");
    assert!(!raised.contains("open files"), "the soft limit was raised to the hard one: {raised}");
}

#[test]
fn serve_removes_what_uploads_that_never_completed_left_once_old_enough() {
    use std::io::{BufRead as _, BufReader};
    let (_root, dir) = initialised("leftovers");
    let config = dir.join("control.json");
    let mut settings: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    settings["artifact_collect_ms"] = 50.into();
    std::fs::write(&config, serde_json::to_vec_pretty(&settings).unwrap()).unwrap();
    // An upload's temporary file from two days ago (its server died mid-upload), and one
    // of an upload in progress.
    let attempt = dir.join("artifacts/proj/run_1/att_1");
    std::fs::create_dir_all(&attempt).unwrap();
    let (old, young) = (attempt.join(".log.0123456789abcdef.tmp"), attempt.join(".log.fedcba9876543210.tmp"));
    for path in [&old, &young] {
        std::fs::write(path, [7u8; 100]).unwrap();
    }
    let two_days = std::time::Duration::from_secs(2 * 24 * 3_600);
    let file = std::fs::File::options().write(true).open(&old).unwrap();
    file.set_modified(std::time::SystemTime::now() - two_days).unwrap();

    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--operator-listen", "", "--dir"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let said = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|line| line.contains("leftover(s)") || line.contains("collecting"))
        .unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    assert!(said.contains("removed 1 leftover(s) of uploads that never completed, 100 bytes"), "{said}");
    assert!(!old.exists(), "the old one went");
    assert!(young.exists(), "the young one stays: its upload may still be under way");
}

#[test]
fn serve_removes_ended_runs_past_their_retention_with_their_stored_logs() {
    let (_root, dir) = initialised("retention");
    let run_of = |out: Output| {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_owned()
    };
    let ended = run_of(cli(&dir, &["submit", "--", "true"]));
    assert!(cli(&dir, &["cancel", &ended]).status.success());
    let stuck = run_of(cli(&dir, &["submit", "--", "true"]));
    assert!(cli(&dir, &["cancel", &stuck]).status.success());
    let queued = run_of(cli(&dir, &["submit", "--", "true"]));
    // What each run stored (as a completion's log would be); the stuck run's place is a
    // file where a directory belongs, which no removal can take as a run's place.
    let (gone, kept) = (dir.join("artifacts/default").join(&ended), dir.join("artifacts/default").join(&queued));
    for place in [&gone, &kept] {
        std::fs::create_dir_all(place.join("att_1")).unwrap();
        std::fs::write(place.join("att_1/log.receipt"), b"{}").unwrap();
    }
    let unremovable = dir.join("artifacts/default").join(&stuck);
    std::fs::write(&unremovable, b"not a directory").unwrap();
    let config = dir.join("control.json");
    let mut settings: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    // The shortest retention the check allows: no upload outlives a second here.
    settings["upload_grace_ms"] = 100.into();
    settings["min_upload_rate"] = (1u64 << 40).into();
    settings["s3_timeout_ms"] = 100.into();
    settings["run_retention_ms"] = 1_000.into();
    settings["sweep_interval_ms"] = 50.into();
    std::fs::write(&config, serde_json::to_vec_pretty(&settings).unwrap()).unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--operator-listen", "", "--dir"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("serve.err")).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // Waits, asking every 50 ms for a minute at most, for the run to go and for the line
    // about the stuck one (said once the others' rows went).
    let told = || std::fs::read_to_string(dir.join("serve.err")).unwrap().contains("could not be removed");
    let shown = loop {
        let shown = cli(&dir, &["show", &ended]);
        if (!shown.status.success() && told()) || std::time::Instant::now() > deadline {
            break shown;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    let said = String::from_utf8_lossy(&shown.stderr);
    assert!(said.contains(&format!("no run {ended}")), "the ended run went: {said}");
    assert!(!gone.exists(), "and what it stored with it");
    assert!(kept.join("att_1/log.receipt").exists(), "a queued run's stays");
    assert!(cli(&dir, &["show", &queued]).status.success(), "a queued run stays");
    assert!(cli(&dir, &["show", &stuck]).status.success(), "a run whose files could not go keeps its rows");
    assert!(unremovable.exists());
    let err = std::fs::read_to_string(dir.join("serve.err")).unwrap();
    assert!(err.contains("the stored files of 1 run(s) could not be removed") && err.contains(&stuck), "{err}");
}

/// `ql-control <words> --dir <dir> <rest>`: a subcommand's own `--dir`.
fn sub(dir: &Path, words: &[&str], rest: &[&str]) -> Output {
    Command::new(BIN).args(words).arg("--dir").arg(dir).args(rest).output().unwrap()
}

#[test]
fn every_operator_command_refuses_bad_input_says_why_and_writes_nothing() {
    let (root, dir) = initialised("refusals");
    let out = root.0.join("creds");
    let out = out.to_str().unwrap();
    let ok = |o: Output| assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    ok(cli(&dir, &["enroll", "r1", "--out", out]));
    ok(cli(&dir, &["submit", "--", "true"]));
    ok(sub(&dir, &["schedule", "add"], &["nightly", "--cron", "0 30 7 * * *", "--", "true"]));
    ok(sub(&dir, &["operator", "add"], &["alice", "--role", "admin"]));
    let state = || {
        let listings: [(&[&str], &[&str]); 5] = [
            (&["runs"], &[]),
            (&["workers"], &[]),
            (&["workers", "certificates"], &[]),
            (&["schedule", "list"], &[]),
            (&["operator", "list"], &[]),
        ];
        listings.map(|(words, rest)| String::from_utf8(sub(&dir, words, rest).stdout).unwrap())
    };
    let before = state();
    assert!(before[0].lines().count() == 2 && before[3].contains("nightly") && before[4].contains("alice"));
    let cases: [(&[&str], &[&str], &str); 18] = [
        (&["schedule", "add"], &["nightly", "--cron", "0 30 7 * * *", "--", "true"], "exists already"),
        (&["schedule", "add"], &["other", "--cron", "61 * * * *", "--", "true"], "cron"),
        (&["schedule", "add"], &["other", "--cron", "* * * * *", "--tz", "Mars/Olympus", "--", "true"], "time zone"),
        (&["schedule", "add"], &["Other", "--cron", "* * * * *", "--", "true"], "not a schedule name"),
        (&["schedule", "add"], &["other", "--cron", "* * * * *", "--overlap", "often", "--", "true"], "often"),
        (&["schedule", "pause"], &["nosuch"], "no such schedule"),
        (&["schedule", "run-now"], &["nosuch"], "no such schedule"),
        (&["schedule", "remove"], &["nosuch"], "no such schedule"),
        (&["cancel"], &["not-a-run"], "no run not-a-run"),
        (&["workers", "disable"], &["Not_A_Worker"], "not a worker name"),
        (&["workers", "revoke"], &["r1", "--serial", "00ff"], "no certificate of r1 with that serial"),
        (
            &["workers", "revoke"],
            &["r1", "--serial", "00ff", "--with-renewals"],
            "no certificate of r1 with that serial",
        ),
        (&["workers", "revoke"], &["r1", "--with-renewals"], "renewals go with a serial only"),
        (&["operator", "add"], &["bob", "--role", "root"], "root"),
        (&["operator", "add"], &["alice", "--role", "read"], "alice"),
        (&["operator", "remove"], &["nosuch"], "nosuch"),
        (&["enroll"], &["r2", "--token", "--out", out], "either --token"),
        (&["submit"], &["--env", "NOEQUALS", "--", "true"], "NOEQUALS"),
    ];
    for (words, rest, says) in cases {
        let refused = sub(&dir, words, rest);
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains(says), "{words:?} {rest:?}: {err}");
        assert_eq!(state(), before, "{words:?} {rest:?} changed something");
    }
}

/// Blocking a name nothing here knows (a typo, most likely) blocks it all the same, and
/// says that nothing named it before.
#[test]
fn revoking_a_name_nothing_knew_says_so() {
    let (_root, dir) = initialised("unknown-worker");
    let out = cli(&dir, &["workers", "revoke", "routr-1"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("routr-1 revoked") && said.contains("nothing here named routr-1 before"), "{said}");
    let workers = String::from_utf8(cli(&dir, &["workers"]).stdout).unwrap();
    assert!(workers.lines().any(|l| l.starts_with("routr-1 ") && l.contains("revoked")), "{workers}");
    let again = String::from_utf8(cli(&dir, &["workers", "disable", "routr-1"]).stdout).unwrap();
    assert!(again.contains("routr-1 disabled") && !again.contains("nothing here named"), "known now: {again}");
}
