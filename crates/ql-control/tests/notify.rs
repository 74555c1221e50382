//! `ql-control serve` under a service manager: the real binary, started with
//! `$NOTIFY_SOCKET` naming a datagram socket this test bound where systemd would, and a
//! short `$WATCHDOG_USEC`. It must send `READY=1` once it listens (its "listening on" line
//! already written), `WATCHDOG=1` again and again while it serves, and `STOPPING=1` when
//! SIGTERM starts the graceful stop, then exit 0 — what `Type=notify` and `WatchdogSec=`
//! in `packaging/systemd/ql-control.service` rely on.
//!
//! No test sleeps to synchronise and nothing is timed: every wait is a blocking receive or
//! a poll with a deadline, and the deadline only turns a hang into a failure.

use std::io::{self, Read as _};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ql-control");

/// How long any one wait may take before it is a failure.
const PATIENCE: Duration = Duration::from_secs(30);

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("ql-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A process killed when the test ends, unless it already ended.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The service manager's end: the socket `$NOTIFY_SOCKET` names.
struct Manager {
    socket: UnixDatagram,
}

impl Manager {
    fn bind(path: &Path) -> Self {
        Self { socket: UnixDatagram::bind(path).expect("bind the notify socket") }
    }

    /// The next message, or `None` once `deadline` passed without one.
    fn receive_before(&self, deadline: Instant) -> Option<String> {
        let left = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        self.socket.set_read_timeout(Some(left)).unwrap();
        let mut buf = [0u8; 4096];
        match self.socket.recv(&mut buf) {
            Ok(n) => Some(String::from_utf8(buf[..n].to_vec()).expect("notifications are UTF-8")),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => None,
            Err(e) => panic!("receiving a notification: {e}"),
        }
    }
}

fn log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Polls the child until it exits, at most [`PATIENCE`].
fn exit_status(child: &mut Child, stderr: &Path) -> ExitStatus {
    let end = Instant::now() + PATIENCE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < end, "ql-control did not stop after SIGTERM:\n{}", log(stderr));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `ql-control serve` under a service manager, in a scratch directory.
struct Service {
    manager: Manager,
    /// Where the server's stderr goes.
    stderr: PathBuf,
    stdout: ChildStdout,
    server: Proc,
}

impl Service {
    /// `ql-control init` into `<tmp>/state`, the manager's socket bound at `<tmp>/notify`,
    /// then `ql-control serve` on that state with a 200 ms `$WATCHDOG_USEC` (a ping every
    /// 100 ms, so the pings come within the test's patience); `$NOTIFY_SOCKET` names the
    /// socket only when `named`, and is unset otherwise.
    fn start(tmp: &TempDir, named: bool) -> Self {
        let state = tmp.path().join("state");
        let init = Command::new(BIN).args(["init", "--host", "127.0.0.1", "--dir"]).arg(&state).output().unwrap();
        assert!(init.status.success(), "init: {}", String::from_utf8_lossy(&init.stderr));

        let socket = tmp.path().join("notify");
        let manager = Manager::bind(&socket);
        let stderr = tmp.path().join("serve.err");
        let mut serve = Command::new(BIN);
        serve.args(["serve", "--listen", "127.0.0.1:0", "--operator-listen", "", "--dir"]).arg(&state);
        if named {
            serve.env("NOTIFY_SOCKET", &socket);
        } else {
            serve.env_remove("NOTIFY_SOCKET");
        }
        let mut child = serve
            .env("WATCHDOG_USEC", "200000")
            .env_remove("WATCHDOG_PID")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("ql-control serve starts");
        let stdout = child.stdout.take().unwrap();
        Self { manager, stderr, stdout, server: Proc(child) }
    }
}

#[test]
fn serve_reports_ready_pings_the_watchdog_and_reports_stopping_on_sigterm() {
    let tmp = TempDir::new("control-notify");
    let Service { manager, stderr, mut stdout, mut server } = Service::start(&tmp, true);

    // READY=1 first, naming where it listens.
    let deadline = Instant::now() + PATIENCE;
    let ready = manager.receive_before(deadline).unwrap_or_else(|| panic!("no READY=1:\n{}", log(&stderr)));
    let status = ready.strip_prefix("READY=1\nSTATUS=").unwrap_or_else(|| panic!("the first message: {ready:?}"));
    assert!(status.starts_with("listening on https://127.0.0.1:"), "{status:?}");
    // The "listening on" line was written before READY=1 was sent: it is in the pipe now,
    // so a read that must not wait finds it.
    rustix::io::ioctl_fionbio(&stdout, true).unwrap();
    let mut buf = [0u8; 4096];
    let n = stdout.read(&mut buf).expect("the listening line is written before READY=1");
    assert_eq!(String::from_utf8_lossy(&buf[..n]), format!("{status}\n"));

    // Pings, more than one: the watchdog task keeps running (and the store keeps answering).
    let deadline = Instant::now() + PATIENCE;
    let mut pings = 0;
    while pings < 2 {
        let message =
            manager.receive_before(deadline).unwrap_or_else(|| panic!("{pings} ping(s) only:\n{}", log(&stderr)));
        assert_eq!(message, "WATCHDOG=1", "only pings while serving");
        pings += 1;
    }

    // SIGTERM: STOPPING=1 (pings may still come before it), then a clean exit.
    let pid = rustix::process::Pid::from_child(&server.0);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM delivered");
    let deadline = Instant::now() + PATIENCE;
    let stopping = loop {
        let message = manager
            .receive_before(deadline)
            .unwrap_or_else(|| panic!("no STOPPING=1 after SIGTERM:\n{}", log(&stderr)));
        if message != "WATCHDOG=1" {
            break message;
        }
    };
    assert!(stopping.starts_with("STOPPING=1\nSTATUS=stopping"), "{stopping:?}");
    let status = exit_status(&mut server.0, &stderr);
    assert!(status.success(), "ql-control exited with {status}:\n{}", log(&stderr));
    assert!(log(&stderr).contains("stopped after"), "{}", log(&stderr));
}

#[test]
fn serve_without_notify_socket_sends_nothing_and_still_stops_cleanly() {
    // The manager's socket exists, but nobody names it: nothing may reach it.
    let tmp = TempDir::new("control-no-notify");
    let Service { manager, stderr, mut stdout, mut server } = Service::start(&tmp, false);
    let mut line = [0u8; 4096];
    let n = stdout.read(&mut line).unwrap();
    assert!(String::from_utf8_lossy(&line[..n]).starts_with("listening on "), "{}", log(&stderr));

    rustix::process::kill_process(rustix::process::Pid::from_child(&server.0), rustix::process::Signal::TERM)
        .expect("SIGTERM delivered");
    let status = exit_status(&mut server.0, &stderr);
    assert!(status.success(), "ql-control exited with {status}:\n{}", log(&stderr));
    manager.socket.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    let got = manager.socket.recv(&mut buf);
    assert!(matches!(&got, Err(e) if e.kind() == io::ErrorKind::WouldBlock), "a notification arrived: {got:?}");
}
