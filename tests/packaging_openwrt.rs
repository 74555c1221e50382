//! The OpenWrt package: `packaging/openwrt/build-ipk` makes an .ipk the way OpenWrt's
//! ipkg-build does (checked by unpacking it), and the procd init script, run against a
//! sample UCI config by `packaging/openwrt/test/procd-harness.sh` (stubs for rc.common,
//! functions.sh and procd.sh), asks procd for the instance we mean.
//!
//! Needs only what every Debian machine has: sh, GNU tar, gzip and od. The harness also
//! runs under busybox ash (OpenWrt's shell) when `busybox` is installed, as in CI.

#[path = "common/scratch.rs"]
mod scratch;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use scratch::{run, TempDir};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const EPOCH: &str = "1700000000";

fn text(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The smallest file that build-ipk takes for a binary: an ELF header of the given class
/// (1: 32-bit, 2: 64-bit), byte order (1: little, 2: big) and machine.
fn fake_elf(path: &Path, class: u8, data: u8, machine: u16) {
    let mut h = vec![0u8; 64];
    h[..4].copy_from_slice(b"\x7fELF");
    h[4] = class;
    h[5] = data;
    h[6] = 1;
    let (t, m) = if data == 1 {
        (2u16.to_le_bytes(), machine.to_le_bytes())
    } else {
        (2u16.to_be_bytes(), machine.to_be_bytes())
    };
    h[16..18].copy_from_slice(&t);
    h[18..20].copy_from_slice(&m);
    fs::write(path, h).unwrap();
}

fn build_ipk(binary: &Path, arch: &str, out: &Path) -> Output {
    Command::new(Path::new(ROOT).join("packaging/openwrt/build-ipk"))
        .arg("--binary")
        .arg(binary)
        .args(["--arch", arch, "--out"])
        .arg(out)
        .env("SOURCE_DATE_EPOCH", EPOCH)
        .output()
        .expect("build-ipk starts")
}

/// `tar -tv` of an archive: (mode string, owner/group, size, mtime, name) per member.
fn members(archive: &Path) -> Vec<(String, String, u64, String, String)> {
    let out = run(Command::new("tar")
        .args(["--list", "--verbose", "--numeric-owner", "--full-time", "-z", "-f"])
        .arg(archive)
        .env("TZ", "UTC"));
    text(&out)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_owned(), f[1].to_owned(), f[2].parse().unwrap(), format!("{} {}", f[3], f[4]), f[5].to_owned())
        })
        .collect()
}

fn extract(archive: &Path, into: &Path) {
    fs::create_dir_all(into).unwrap();
    run(Command::new("tar").arg("-xzf").arg(archive).arg("-C").arg(into));
}

fn built_ipk(dir: &TempDir) -> PathBuf {
    let bin = dir.path().join("ql-agent");
    fake_elf(&bin, 1, 1, 8);
    let out = build_ipk(&bin, "mipsel_24kc", &dir.path().join("out"));
    assert!(out.status.success(), "build-ipk failed: {}", String::from_utf8_lossy(&out.stderr));
    let ipk = PathBuf::from(text(&out).trim());
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(ipk, dir.path().join(format!("out/ql-agent_{version}-r1_mipsel_24kc.ipk")));
    ipk
}

#[test]
fn the_ipk_is_an_ipkg_build_container_with_opkg_fields() {
    let dir = TempDir::new("layout");
    let ipk = built_ipk(&dir);
    let bytes = fs::read(&ipk).unwrap();
    assert_eq!(&bytes[..2], b"\x1f\x8b", "the container itself is gzip'd");

    // The outer tar: three members in ipkg-build's order, owned by root, at the epoch.
    let outer = members(&ipk);
    let names: Vec<&str> = outer.iter().map(|m| m.4.as_str()).collect();
    assert_eq!(names, ["./debian-binary", "./data.tar.gz", "./control.tar.gz"]);
    for (mode, owner, _, mtime, name) in &outer {
        assert_eq!((mode.as_str(), owner.as_str()), ("-rw-r--r--", "0/0"), "{name}");
        assert_eq!(mtime, "2023-11-14 22:13:20", "{name}");
    }
    let x = dir.path().join("x");
    extract(&ipk, &x);
    assert_eq!(fs::read_to_string(x.join("debian-binary")).unwrap(), "2.0\n");

    // control.tar.gz
    let control_members = members(&x.join("control.tar.gz"));
    let names: Vec<&str> = control_members.iter().map(|m| m.4.as_str()).collect();
    assert_eq!(names, ["./", "./conffiles", "./control", "./postinst", "./prerm"]);
    assert!(control_members.iter().all(|m| m.1 == "0/0"));
    let c = x.join("control");
    extract(&x.join("control.tar.gz"), &c);
    let control = fs::read_to_string(c.join("control")).unwrap();
    let field = |name: &str| -> String {
        let prefix = format!("{name}: ");
        let line = control.lines().find(|l| l.starts_with(&prefix));
        line.unwrap_or_else(|| panic!("no {name} in\n{control}"))[prefix.len()..].to_owned()
    };
    assert_eq!(field("Package"), "ql-agent");
    assert_eq!(field("Version"), format!("{}-r1", env!("CARGO_PKG_VERSION")));
    assert_eq!(field("Architecture"), "mipsel_24kc");
    assert_eq!(field("Depends"), "libc");
    assert_eq!(field("Section"), "net");
    assert_eq!(field("License"), "Apache-2.0");
    assert_eq!(field("SourceDateEpoch"), EPOCH);
    assert!(control.contains("\nDescription:  Runs QingLong"), "{control}");
    // Installed-Size is the uncompressed data tar in bytes, as ipkg-build counts it.
    let data_tar = run(Command::new("gzip").arg("-dc").arg(x.join("data.tar.gz"))).stdout;
    assert_eq!(field("Installed-Size"), data_tar.len().to_string());
    assert_eq!(fs::read_to_string(c.join("conffiles")).unwrap(), "/etc/config/ql-agent\n");
    for (script, call) in [("postinst", "default_postinst $0 $@"), ("prerm", "default_prerm $0 $@")] {
        let body = fs::read_to_string(c.join(script)).unwrap();
        assert!(body.starts_with("#!/bin/sh\n"), "{script}");
        assert!(body.contains(". ${IPKG_INSTROOT}/lib/functions.sh\n"), "{script}");
        assert!(body.ends_with(&format!("{call}\n")), "{script}: {body}");
        assert_eq!(fs::metadata(c.join(script)).unwrap().permissions().mode() & 0o777, 0o755, "{script}");
    }

    // data.tar.gz: the files, their modes, root-owned, no CONTROL.
    let data = members(&x.join("data.tar.gz"));
    let get = |name: &str| data.iter().find(|m| m.4 == name).unwrap_or_else(|| panic!("no {name} in {data:?}"));
    assert_eq!(get("./usr/bin/ql-agent").0, "-rwxr-xr-x");
    assert_eq!(get("./etc/init.d/ql-agent").0, "-rwxr-xr-x");
    assert_eq!(get("./etc/config/ql-agent").0, "-rw-------");
    assert_eq!(get("./etc/ql-agent/").0, "drwx------");
    assert_eq!(get("./lib/upgrade/keep.d/ql-agent").0, "-rw-r--r--");
    assert!(data.iter().all(|m| m.1 == "0/0" && m.3 == "2023-11-14 22:13:20"), "{data:?}");
    assert!(!data.iter().any(|m| m.4.contains("CONTROL")), "{data:?}");
    let mut sorted: Vec<&str> = data.iter().map(|m| m.4.as_str()).collect();
    sorted.sort_unstable();
    assert_eq!(sorted, data.iter().map(|m| m.4.as_str()).collect::<Vec<_>>(), "sorted by name");
    let d = x.join("data");
    extract(&x.join("data.tar.gz"), &d);
    assert_eq!(fs::read_to_string(d.join("lib/upgrade/keep.d/ql-agent")).unwrap(), "/etc/ql-agent/\n");
    for (shipped, source) in
        [("etc/init.d/ql-agent", "files/ql-agent.init"), ("etc/config/ql-agent", "files/ql-agent.config")]
    {
        let want = fs::read(Path::new(ROOT).join("packaging/openwrt").join(source)).unwrap();
        assert_eq!(fs::read(d.join(shipped)).unwrap(), want, "{shipped}");
    }
}

#[test]
fn two_builds_of_the_same_inputs_are_byte_identical() {
    let (a, b) = (TempDir::new("repro-a"), TempDir::new("repro-b"));
    let first = fs::read(built_ipk(&a)).unwrap();
    // Another second, another directory: nothing of either leaks into the package.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let second = fs::read(built_ipk(&b)).unwrap();
    assert!(first == second, "the two .ipk files differ");
}

#[test]
fn a_binary_for_another_cpu_is_refused() {
    let dir = TempDir::new("arch");
    let bin = dir.path().join("ql-agent");
    fake_elf(&bin, 1, 2, 8); // big-endian MIPS: mips_24kc, not mipsel_24kc
    for (arch, ok) in [("mipsel_24kc", false), ("aarch64_cortex-a53", false), ("mips_24kc", true)] {
        let out = build_ipk(&bin, arch, &dir.path().join("out"));
        assert_eq!(out.status.success(), ok, "{arch}: {}", String::from_utf8_lossy(&out.stderr));
    }
    fs::write(&bin, "#!/bin/sh\n").unwrap();
    let out = build_ipk(&bin, "x86_64", &dir.path().join("out"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an ELF file"));
}

// ---- the procd init script ---------------------------------------------------------------

/// The shells the harness runs under: sh always, busybox ash when it is installed.
fn shells() -> Vec<Vec<&'static str>> {
    let mut shells = vec![vec!["sh"]];
    if Command::new("busybox").arg("true").output().is_ok_and(|o| o.status.success()) {
        shells.push(vec!["busybox", "ash"]);
    }
    shells
}

/// Runs `function` of the init script against `uci` under each shell; all must agree.
fn harness(uci: &Path, function: &str, alive: u32) -> String {
    let mut seen: Option<String> = None;
    for shell in shells() {
        let out = run(Command::new(shell[0])
            .args(&shell[1..])
            .arg(Path::new(ROOT).join("packaging/openwrt/test/procd-harness.sh"))
            .arg(Path::new(ROOT).join("packaging/openwrt/files/ql-agent.init"))
            .arg(uci)
            .arg(function)
            .env("HARNESS_ALIVE", alive.to_string())
            .env("QL_AGENT_RUN_DIR", run_dir(uci)));
        let got = text(&out);
        if let Some(first) = &seen {
            assert_eq!(&got, first, "{shell:?} disagrees");
        }
        seen = Some(got);
    }
    seen.unwrap()
}

/// Where the init script keeps its reload marker and digest in a test: beside the UCI file.
fn run_dir(uci: &Path) -> PathBuf {
    uci.parent().unwrap().join("run")
}

/// The arguments of the instance's command.
fn command_of(output: &str) -> Vec<&str> {
    output.lines().filter_map(|l| l.strip_prefix("command ")).collect()
}

fn sample_uci(dir: &Path, extra: &str) -> PathBuf {
    let key = dir.join("r1.key");
    fs::write(&key, "not a real key").unwrap();
    fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
    let uci = dir.join("ql-agent");
    let d = dir.display();
    fs::write(
        &uci,
        format!(
            "config agent 'main'\n\
             \toption enabled '1'\n\
             \toption server 'https://192.0.2.1:8443'\n\
             \toption worker_id 'r1'\n\
             \toption cert '{d}/r1.crt'\n\
             \toption key '{d}/r1.key'\n\
             \toption ca '{d}/ca.crt'\n\
             \toption capacity '2'\n\
             \toption drain_timeout_ms '20000'\n\
             \toption poll_wait_ms '10000'\n\
             \toption log_level 'debug'\n\
             \toption state_dir '/mnt/sda1/ql-agent'\n\
             \tlist label 'site=attic # 2'\n\
             \tlist label 'arch/cpu=mips'\n\
             \tlist set 'stop_grace_ms=3000'\n\
             \tlist set 'busy_poll_wait_ms=500'\n\
             {extra}"
        ),
    )
    .unwrap();
    uci
}

#[test]
fn start_service_turns_the_uci_config_into_one_procd_instance() {
    let dir = TempDir::new("procd");
    let uci = sample_uci(dir.path(), "");
    let d = dir.path().display();
    let r = run_dir(&uci).display().to_string();
    let got = harness(&uci, "start_service", 0);
    let want = format!(
        "instance\n\
         command /usr/bin/ql-agent\ncommand run\ncommand --config\ncommand /dev/null\n\
         command --server\ncommand https://192.0.2.1:8443\ncommand --worker-id\ncommand r1\n\
         command --cert\ncommand {d}/r1.crt\ncommand --key\ncommand {d}/r1.key\n\
         command --ca\ncommand {d}/ca.crt\ncommand --state-dir\ncommand /mnt/sda1/ql-agent\n\
         command --capacity\ncommand 2\ncommand --log-level\ncommand debug\n\
         command --set\ncommand drain_timeout_ms=20000\ncommand --set\ncommand poll_wait_ms=10000\n\
         command --set\ncommand reload_marker={r}/ql-agent.reload\n\
         command --set\ncommand label.site=attic # 2\ncommand --set\ncommand label.arch/cpu=mips\n\
         command --set\ncommand stop_grace_ms=3000\ncommand --set\ncommand busy_poll_wait_ms=500\n\
         term_timeout 53\n\
         respawn 3600\nrespawn 5\nrespawn 5\n\
         stdout 1\nstderr 1\n\
         file /etc/config/ql-agent\nfile {d}/r1.crt\nfile {d}/r1.key\nfile {d}/ca.crt\n\
         end\nreturn 0\n"
    );
    assert_eq!(got, want);
    // poll 10 s + call 15 s + drain 20 s + grace 3 s, rounded up, + 5 s = 53 s.
    let mode = fs::metadata(dir.path().join("r1.key")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the init script makes the key private");
}

#[test]
fn unset_paths_and_options_fall_back_to_the_documented_defaults() {
    let dir = TempDir::new("defaults");
    let uci = dir.path().join("ql-agent");
    fs::write(
        &uci,
        "config agent 'main'\n\toption enabled 'yes'\n\toption server 'https://c:1'\n\toption worker_id 'w9'\n",
    )
    .unwrap();
    let got = harness(&uci, "start_service", 0);
    let cmd = command_of(&got);
    let pairs: Vec<String> = cmd.windows(2).map(|w| format!("{} {}", w[0], w[1])).collect();
    for want in [
        "--cert /etc/ql-agent/w9.crt",
        "--key /etc/ql-agent/w9.key",
        "--ca /etc/ql-agent/ca.crt",
        "--state-dir /var/lib/ql-agent",
        "--capacity 1",
        "--log-level info",
        "--set drain_timeout_ms=30000",
        "--set poll_wait_ms=25000",
    ] {
        assert!(pairs.iter().any(|p| p == want), "{want} missing from {cmd:?}");
    }
    // The agent's defaults: 25 s poll + 15 s call + 30 s drain + 5 s grace + 5 s.
    assert!(got.contains("\nterm_timeout 80\n"), "{got}");
}

#[test]
fn a_disabled_or_incomplete_config_starts_nothing() {
    let dir = TempDir::new("disabled");
    let uci = sample_uci(dir.path(), "\toption enabled '0'\n");
    // The later `option enabled` wins, as in UCI.
    let got = harness(&uci, "start_service", 0);
    assert!(!got.contains("instance"), "{got}");
    assert!(got.starts_with("logger -t ql-agent -p daemon.notice not started: disabled"), "{got}");
    assert!(got.ends_with("return 0\n"), "{got}");

    let uci = dir.path().join("incomplete");
    fs::write(&uci, "config agent 'main'\n\toption enabled '1'\n\toption worker_id 'r1'\n").unwrap();
    let got = harness(&uci, "start_service", 0);
    assert!(!got.contains("instance"), "{got}");
    assert!(got.contains("daemon.err not started: set server and worker_id"), "{got}");
    assert!(got.ends_with("return 1\n"), "{got}");
}

#[test]
fn a_commit_of_its_config_reloads_it() {
    let dir = TempDir::new("triggers");
    let uci = sample_uci(dir.path(), "");
    assert_eq!(harness(&uci, "service_triggers", 0), "reload_trigger ql-agent\nreturn 0\n");
}

#[test]
fn a_reload_that_changes_the_agent_marks_its_restart_as_a_handover() {
    let dir = TempDir::new("reload");
    let uci = sample_uci(dir.path(), "");
    let marker = run_dir(&uci).join("ql-agent.reload");
    harness(&uci, "start_service", 0);
    // Nothing changed: procd restarts nothing, and nothing is marked.
    assert_eq!(harness(&uci, "reload_service", 0), "start\nreturn 0\n");
    assert!(!marker.exists());
    // A new key (a renewal, a re-enrolment): procd will restart the agent; its SIGTERM is
    // a handover's.
    fs::write(dir.path().join("r1.key"), "another key").unwrap();
    assert_eq!(harness(&uci, "reload_service", 0), "start\nreturn 0\n");
    assert!(marker.exists(), "the reload left its marker");
    // Disabled: procd stops the agent, which must drain, so no marker.
    fs::remove_file(&marker).unwrap();
    let off = fs::read_to_string(&uci).unwrap().replace("option enabled '1'", "option enabled '0'");
    fs::write(&uci, off).unwrap();
    assert_eq!(harness(&uci, "reload_service", 0), "start\nreturn 0\n");
    assert!(!marker.exists());
}

#[test]
fn shutdown_stops_then_waits_for_the_drain_but_not_for_ever() {
    let dir = TempDir::new("shutdown");
    let uci = sample_uci(dir.path(), "\toption shutdown_wait '3'\n");
    // The agent exits after two seconds: two sleeps.
    assert_eq!(harness(&uci, "shutdown", 2), "stop\nsleep 1\nsleep 1\nreturn 0\n");
    // It does not exit: the wait ends after shutdown_wait seconds.
    assert_eq!(harness(&uci, "shutdown", 100), "stop\nsleep 1\nsleep 1\nsleep 1\nreturn 0\n");
}

#[test]
fn the_agent_accepts_every_flag_the_init_script_passes() {
    let dir = TempDir::new("flags");
    let uci = sample_uci(dir.path(), "");
    let got = harness(&uci, "start_service", 0);
    let cmd = command_of(&got);
    assert_eq!(cmd[..2], ["/usr/bin/ql-agent", "run"]);
    // `check` takes the same flags as `run`; it loads the configuration first, then fails
    // on the missing certificate: a configuration error would mean a bad flag or value.
    let out = Command::new(env!("CARGO_BIN_EXE_ql-agent")).arg("check").args(&cmd[2..]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!stderr.contains("configuration"), "the agent refused the init script's flags: {stderr}");
    assert!(stderr.contains("check failed"), "{stderr}");
}
