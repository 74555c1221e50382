//! The Debian packages for cluster nodes: `packaging/deb/build-deb` builds ql-agent's and
//! ql-control's .deb from their `[package.metadata.deb]`, and `dpkg-deb` reads them back:
//! fields, conffiles, maintainer scripts, files, modes and owners. The maintainer scripts
//! run against stubs of adduser, deb-systemd-helper and friends, to prove what they do on
//! install, upgrade, removal and purge.
//!
//! Needs dpkg-deb and dpkg-shlibdeps (Debian's dpkg and dpkg-dev) and python3.

#[path = "common/scratch.rs"]
mod scratch;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use scratch::{run, TempDir};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

fn stdout(out: Output) -> String {
    String::from_utf8(out.stdout).unwrap()
}

/// A small real executable stands in for the binary: packaging does not care what it
/// does, and dpkg-shlibdeps needs a dynamically linked ELF file to read.
fn stand_in_binary(dir: &Path, name: &str) -> PathBuf {
    let bin = dir.join(name);
    fs::copy("/bin/true", &bin).unwrap();
    bin
}

fn build_deb(package: &str, out: &Path) -> PathBuf {
    let bin = stand_in_binary(out, package);
    let built = run(Command::new(Path::new(ROOT).join("packaging/deb/build-deb"))
        .arg(package)
        .arg("--binary")
        .arg(&bin)
        .arg("--out")
        .arg(out)
        .args(["--arch", "amd64"])
        .env("SOURCE_DATE_EPOCH", "1700000000"));
    let deb = PathBuf::from(stdout(built).trim());
    assert_eq!(deb, out.join(format!("{package}_{VERSION}-1_amd64.deb")));
    deb
}

fn field(deb: &Path, name: &str) -> String {
    stdout(run(Command::new("dpkg-deb").arg("--field").arg(deb).arg(name))).trim_end().to_owned()
}

/// `dpkg-deb --contents`: path -> (mode string, owner/group).
fn contents(deb: &Path) -> BTreeMap<String, (String, String)> {
    stdout(run(Command::new("dpkg-deb").arg("--contents").arg(deb)))
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[5].to_owned(), (f[0].to_owned(), f[1].to_owned()))
        })
        .collect()
}

fn control_dir(deb: &Path, into: &Path) -> PathBuf {
    let dir = into.join("DEBIAN");
    run(Command::new("dpkg-deb").arg("--control").arg(deb).arg(&dir));
    dir
}

fn data_dir(deb: &Path, into: &Path) -> PathBuf {
    let dir = into.join("data");
    run(Command::new("dpkg-deb").arg("--extract").arg(deb).arg(&dir));
    dir
}

#[test]
fn the_agent_deb_carries_binary_unit_conffile_and_scripts() {
    let dir = TempDir::new("agent");
    let deb = build_deb("ql-agent", dir.path());

    assert_eq!(field(&deb, "Package"), "ql-agent");
    assert_eq!(field(&deb, "Version"), format!("{VERSION}-1"));
    assert_eq!(field(&deb, "Architecture"), "amd64");
    assert_eq!(field(&deb, "Section"), "net");
    assert_eq!(field(&deb, "Priority"), "optional");
    let depends = field(&deb, "Depends");
    assert!(depends.starts_with("libc6 (>= "), "$auto became dpkg-shlibdeps' answer: {depends}");
    assert!(depends.ends_with(", adduser"), "{depends}");
    assert!(field(&deb, "Description").contains("\n systemd service (ql-agent.service)"));
    assert!(field(&deb, "Installed-Size").parse::<u64>().unwrap() > 0);

    let files = contents(&deb);
    let mode = |p: &str| files.get(p).unwrap_or_else(|| panic!("no {p} in {files:?}")).0.clone();
    assert_eq!(mode("./usr/bin/ql-agent"), "-rwxr-xr-x");
    assert_eq!(mode("./lib/systemd/system/ql-agent.service"), "-rw-r--r--");
    assert_eq!(mode("./etc/default/ql-agent"), "-rw-r--r--");
    assert_eq!(mode("./usr/share/doc/ql-agent/agent.conf.example"), "-rw-r--r--");
    assert_eq!(mode("./usr/share/doc/ql-agent/copyright"), "-rw-r--r--");
    assert!(files.values().all(|(_, owner)| owner == "root/root"), "{files:?}");

    let data = data_dir(&deb, dir.path());
    assert_eq!(
        fs::read(data.join("lib/systemd/system/ql-agent.service")).unwrap(),
        fs::read(Path::new(ROOT).join("packaging/systemd/ql-agent.service")).unwrap()
    );
    assert_eq!(fs::read(data.join("usr/bin/ql-agent")).unwrap(), fs::read("/bin/true").unwrap());

    let control = control_dir(&deb, dir.path());
    assert_eq!(fs::read_to_string(control.join("conffiles")).unwrap(), "/etc/default/ql-agent\n");
    for script in ["postinst", "prerm", "postrm"] {
        let path = control.join(script);
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o755, "{script}");
        let want = fs::read(Path::new(ROOT).join("packaging/deb/ql-agent").join(script)).unwrap();
        assert_eq!(fs::read(&path).unwrap(), want, "{script}");
    }
    // md5sums covers every file, and the sums are right.
    let sums = fs::read_to_string(control.join("md5sums")).unwrap();
    assert_eq!(sums.lines().count(), files.keys().filter(|p| !p.ends_with('/')).count());
    run(Command::new("md5sum").arg("--check").arg("--quiet").arg(control.join("md5sums")).current_dir(&data));
}

#[test]
fn the_control_deb_keeps_its_environment_file_private() {
    let dir = TempDir::new("control");
    let deb = build_deb("ql-control", dir.path());
    assert_eq!(field(&deb, "Package"), "ql-control");
    assert!(field(&deb, "Depends").ends_with(", adduser"));
    let files = contents(&deb);
    assert_eq!(files["./usr/bin/ql-control"].0, "-rwxr-xr-x");
    assert_eq!(files["./lib/systemd/system/ql-control.service"].0, "-rw-r--r--");
    assert_eq!(files["./etc/ql-control/ql-control.env"].0, "-rw-r-----");
    let control = control_dir(&deb, dir.path());
    assert_eq!(fs::read_to_string(control.join("conffiles")).unwrap(), "/etc/ql-control/ql-control.env\n");
}

#[test]
fn two_builds_of_the_same_inputs_are_byte_identical() {
    let (a, b) = (TempDir::new("repro-a"), TempDir::new("repro-b"));
    let first = fs::read(build_deb("ql-agent", a.path())).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let second = fs::read(build_deb("ql-agent", b.path())).unwrap();
    assert!(first == second, "the two .deb files differ");
}

// ---- maintainer scripts, against stubs ----------------------------------------------------

/// Runs a maintainer script with every command it may call replaced by a stub that only
/// logs its arguments. Returns the log.
fn run_script(package: &str, script: &str, args: &[&str], user_exists: bool) -> String {
    let dir = TempDir::new("scripts");
    let stubs = dir.path().join("bin");
    fs::create_dir_all(&stubs).unwrap();
    let log = dir.path().join("log");
    for cmd in
        ["adduser", "install", "chown", "chmod", "deb-systemd-helper", "deb-systemd-invoke", "systemctl", "rm", "rmdir"]
    {
        let stub = stubs.join(cmd);
        fs::write(&stub, format!("#!/bin/sh\necho \"{cmd} $*\" >>\"$STUB_LOG\"\n")).unwrap();
        fs::set_permissions(&stub, fs::Permissions::from_mode(0o755)).unwrap();
    }
    // getent finds the user only when it exists.
    let getent = stubs.join("getent");
    let status = if user_exists { 0 } else { 2 };
    fs::write(&getent, format!("#!/bin/sh\necho \"getent $*\" >>\"$STUB_LOG\"\nexit {status}\n")).unwrap();
    fs::set_permissions(&getent, fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(&log, "").unwrap();
    run(Command::new("sh")
        .arg(Path::new(ROOT).join("packaging/deb").join(package).join(script))
        .args(args)
        .env("PATH", format!("{}:/usr/bin:/bin", stubs.display()))
        .env("STUB_LOG", &log));
    fs::read_to_string(&log).unwrap()
}

/// Whether this machine runs systemd (the scripts only talk to it then).
fn systemd_runs() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

#[test]
fn a_first_install_creates_the_user_and_enables_the_unit() {
    let log = run_script("ql-agent", "postinst", &["configure"], false);
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines[0], "getent passwd ql-agent");
    assert_eq!(
        lines[1],
        "adduser --system --group --quiet --home /var/lib/ql-agent --no-create-home --gecos QingLong Edge agent ql-agent"
    );
    if !Path::new("/etc/ql-agent").exists() {
        assert!(lines.contains(&"install -d -o root -g ql-agent -m 0750 /etc/ql-agent"), "{log}");
    }
    assert!(lines.contains(&"deb-systemd-helper unmask ql-agent.service"), "{log}");
    assert!(lines.contains(&"deb-systemd-helper enable ql-agent.service"), "{log}");
    if systemd_runs() {
        assert!(lines.contains(&"deb-systemd-invoke start ql-agent.service"), "{log}");
    }
}

#[test]
fn an_upgrade_keeps_the_user_and_restarts_only_a_running_agent_keeping_its_jobs() {
    let log = run_script("ql-agent", "postinst", &["configure", "0.0.9-1"], true);
    assert!(!log.contains("adduser"), "{log}");
    if systemd_runs() {
        // The running agent alone is ended, so its jobs run on for the new one.
        let lines: Vec<&str> = log.lines().collect();
        let at = |line: &str| lines.iter().position(|l| *l == line).unwrap_or_else(|| panic!("{line}: {log}"));
        let (active, kill, restart) = (
            at("systemctl --quiet is-active ql-agent.service"),
            at("systemctl kill --kill-whom=main --signal=KILL ql-agent.service"),
            at("deb-systemd-invoke restart ql-agent.service"),
        );
        assert!(active < kill && kill < restart, "{log}");
        assert!(!log.contains("deb-systemd-invoke start"), "{log}");
    }
}

#[test]
fn purge_removes_the_journal_but_keeps_the_user() {
    let log = run_script("ql-agent", "postrm", &["purge"], true);
    assert!(log.contains("deb-systemd-helper purge ql-agent.service"), "{log}");
    assert!(log.contains("rm -rf /var/lib/ql-agent"), "{log}");
    assert!(!log.contains("deluser"), "{log}");
    // ql-control's state is every run's history: purge leaves it.
    let log = run_script("ql-control", "postrm", &["purge"], true);
    assert!(log.contains("deb-systemd-helper purge ql-control.service"), "{log}");
    assert!(!log.contains("rm -rf"), "{log}");
}

#[test]
fn ql_control_install_makes_its_state_and_env_file_private() {
    let log = run_script("ql-control", "postinst", &["configure"], false);
    assert!(log.contains("adduser --system --group --quiet --home /var/lib/ql-control"), "{log}");
    assert!(log.contains("chown root:ql-control /etc/ql-control /etc/ql-control/ql-control.env"), "{log}");
    assert!(log.contains("chmod 0640 /etc/ql-control/ql-control.env"), "{log}");
    if !Path::new("/var/lib/ql-control").exists() {
        assert!(log.contains("install -d -o ql-control -g ql-control -m 0700 /var/lib/ql-control"), "{log}");
    }
}
