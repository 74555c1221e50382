//! The systemd notification protocol (`sd_notify`), without libsystemd: std only, no
//! dependencies, no unsafe code. Both daemons use it, `ql-agent` (whose main loop folds
//! the watchdog into its waits) and `ql-control serve` (which pings from a Tokio task).
//!
//! Under a unit with `Type=notify`, systemd passes a datagram socket in `$NOTIFY_SOCKET`
//! (a file-system path, or `@name` for Linux's abstract namespace) and, with
//! `WatchdogSec=`, the watchdog period in `$WATCHDOG_USEC` (for the process
//! `$WATCHDOG_PID`, when set). The service sends newline-separated `KEY=value`
//! assignments, one datagram per message:
//!
//! - `READY=1` once it is up (systemd holds `systemctl start` until then);
//! - `WATCHDOG=1` at least once per period, or systemd kills and restarts it;
//! - `STOPPING=1` when it begins to shut down;
//! - `STATUS=...`, one line shown by `systemctl status`;
//! - `EXTEND_TIMEOUT_USEC=...`, asking for more time than `TimeoutStopSec` while draining.
//!
//! Notification is best effort, as in libsystemd: without `$NOTIFY_SOCKET` (started by
//! procd, by hand, by a test) every method does nothing, and a failed send is counted,
//! never fatal. A send waits at most [`SEND_WAIT`] for room in the manager's queue (then
//! the message is lost), so the methods may be called from a single-threaded loop or from
//! async code: a busy manager still gets READY and STOPPING, a stuck one costs half a
//! second, never a stall.
//!
//! Time is an argument: [`Notify::watchdog_due`] says when the next ping is due and
//! [`Notify::tick`] sends it if `now` has reached that, so a main loop folds the due time
//! into its waits like any other deadline. A service that pings from a timer of its own
//! asks [`Notify::watchdog_every`] for the interval and calls [`Notify::watchdog`].
#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::{Duration, Instant};

/// Where notifications go: the datagram socket systemd named.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

/// How long a notification may wait for room in the service manager's queue.
pub const SEND_WAIT: Duration = Duration::from_millis(500);

impl Notifier {
    /// Opens an unbound datagram socket aimed at `address`, the value of `$NOTIFY_SOCKET`:
    /// an absolute path, or `@name` for an abstract socket.
    pub fn connect(address: &OsStr) -> io::Result<Notifier> {
        let bytes = address.as_encoded_bytes();
        let addr = match bytes.first() {
            Some(b'/') => SocketAddr::from_pathname(address)?,
            Some(b'@') => abstract_addr(&bytes[1..])?,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "NOTIFY_SOCKET must be an absolute path or start with @",
                ))
            }
        };
        let socket = UnixDatagram::unbound()?;
        // A Unix datagram send waits while the receiver's queue is full. A service manager
        // busy for a moment (a boot storm) must still get READY and STOPPING, so the send
        // waits, but only for SEND_WAIT: one that far behind loses the message rather than
        // stalling the caller's loop.
        socket.set_write_timeout(Some(SEND_WAIT))?;
        Ok(Notifier { socket, addr })
    }

    /// Sends one message (`KEY=value` lines) as one datagram, waiting at most
    /// [`SEND_WAIT`] for room at the receiver (then `WouldBlock`).
    pub fn send(&self, message: &str) -> io::Result<()> {
        let sent = self.socket.send_to_addr(message.as_bytes(), &self.addr)?;
        if sent == message.len() {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::WriteZero, "the notification was cut short"))
        }
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn abstract_addr(name: &[u8]) -> io::Result<SocketAddr> {
    #[cfg(target_os = "android")]
    use std::os::android::net::SocketAddrExt;
    #[cfg(target_os = "linux")]
    use std::os::linux::net::SocketAddrExt;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn abstract_addr(_name: &[u8]) -> io::Result<SocketAddr> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "abstract sockets exist only on Linux"))
}

/// The watchdog period systemd asked for: `$WATCHDOG_USEC` microseconds, if
/// `$WATCHDOG_PID` is unset or names this process. `None` when there is no watchdog or the
/// values do not parse.
pub fn watchdog_period(usec: Option<&OsStr>, pid: Option<&OsStr>, own_pid: u32) -> Option<Duration> {
    if let Some(pid) = pid {
        if pid.to_str()?.parse::<u32>().ok()? != own_pid {
            return None;
        }
    }
    let usec: u64 = usec?.to_str()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// A service's side of the protocol: which messages it sends, and when the watchdog is due.
#[derive(Debug)]
pub struct Notify {
    to: Option<Notifier>,
    /// How often to ping: half the watchdog period, as systemd recommends.
    ping_every: Option<Duration>,
    last_ping: Instant,
    failures: u32,
}

impl Notify {
    /// Reads `$NOTIFY_SOCKET`, `$WATCHDOG_USEC` and `$WATCHDOG_PID`. A socket that cannot
    /// be opened is reported in the error and notification stays off.
    pub fn from_env(now: Instant) -> (Notify, Option<String>) {
        let var = std::env::var_os;
        let period =
            watchdog_period(var("WATCHDOG_USEC").as_deref(), var("WATCHDOG_PID").as_deref(), std::process::id());
        Notify::from_socket(var("NOTIFY_SOCKET").as_deref(), period, now)
    }

    /// Notification to `address` (`$NOTIFY_SOCKET`; none: off), pinging within `period`.
    fn from_socket(address: Option<&OsStr>, period: Option<Duration>, now: Instant) -> (Notify, Option<String>) {
        match address {
            None => (Notify::off(now), None),
            Some(address) => match Notifier::connect(address) {
                Ok(to) => (Notify::new(Some(to), period, now), None),
                Err(e) => (Notify::off(now), Some(format!("NOTIFY_SOCKET {}: {e}", address.to_string_lossy()))),
            },
        }
    }

    /// Notification to `to` (none: off), with a watchdog of `period`.
    pub fn new(to: Option<Notifier>, period: Option<Duration>, now: Instant) -> Notify {
        let ping_every = period.filter(|_| to.is_some()).map(|p| (p / 2).max(Duration::from_millis(1)));
        Notify { to, ping_every, last_ping: now, failures: 0 }
    }

    /// No notification at all.
    pub fn off(now: Instant) -> Notify {
        Notify::new(None, None, now)
    }

    /// Whether a service manager listens.
    pub fn is_on(&self) -> bool {
        self.to.is_some()
    }

    /// Sends failed so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    fn send(&mut self, message: &str) {
        if let Some(to) = &self.to {
            if to.send(message).is_err() {
                self.failures = self.failures.saturating_add(1);
            }
        }
    }

    /// `READY=1` with a status line; counts as a watchdog ping.
    pub fn ready(&mut self, status: &str, now: Instant) {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)));
        self.last_ping = now;
    }

    /// `STATUS=...`.
    pub fn status(&mut self, status: &str) {
        self.send(&format!("STATUS={}", one_line(status)));
    }

    /// `STOPPING=1` with a status line, and `EXTEND_TIMEOUT_USEC` for `need` (how long the
    /// drain may take from now), so systemd waits for the drain even past `TimeoutStopSec`.
    pub fn stopping(&mut self, status: &str, need: Option<Duration>) {
        let mut message = format!("STOPPING=1\nSTATUS={}", one_line(status));
        if let Some(need) = need {
            message.push_str(&format!("\nEXTEND_TIMEOUT_USEC={}", need.as_micros()));
        }
        self.send(&message);
    }

    /// When the next `WATCHDOG=1` is due; `None` without a watchdog.
    pub fn watchdog_due(&self) -> Option<Instant> {
        self.ping_every.map(|every| self.last_ping + every)
    }

    /// How often to ping: half the watchdog period, as systemd recommends; `None` without
    /// a watchdog (or without a service manager to ping).
    pub fn watchdog_every(&self) -> Option<Duration> {
        self.ping_every
    }

    /// Sends `WATCHDOG=1` now, due or not; the next one is due half a period after `now`.
    pub fn watchdog(&mut self, now: Instant) {
        self.send("WATCHDOG=1");
        self.last_ping = now;
    }

    /// Sends `WATCHDOG=1` if it is due at `now`.
    pub fn tick(&mut self, now: Instant) {
        if self.watchdog_due().is_some_and(|due| now >= due) {
            self.watchdog(now);
        }
    }
}

/// A status must stay one line: a newline would start another assignment.
fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A socket bound where systemd would bind `$NOTIFY_SOCKET`, in a fresh directory.
    struct Manager {
        dir: PathBuf,
        socket: UnixDatagram,
    }

    impl Manager {
        fn new() -> Manager {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("ql-notify-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let socket = UnixDatagram::bind(dir.join("notify")).unwrap();
            socket.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            Manager { dir, socket }
        }

        fn address(&self) -> PathBuf {
            self.dir.join("notify")
        }

        fn receive(&self) -> String {
            let mut buf = [0u8; 4096];
            let n = self.socket.recv(&mut buf).expect("a notification arrives");
            String::from_utf8(buf[..n].to_vec()).unwrap()
        }

        fn nothing_pending(&self) -> bool {
            self.socket.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 64];
            let empty = matches!(self.socket.recv(&mut buf), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
            self.socket.set_nonblocking(false).unwrap();
            empty
        }
    }

    impl Drop for Manager {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn ready_watchdog_and_stopping_reach_the_notify_socket_as_datagrams() {
        let manager = Manager::new();
        let t0 = Instant::now();
        let to = Notifier::connect(manager.address().as_os_str()).unwrap();
        let mut notify = Notify::new(Some(to), Some(Duration::from_secs(20)), t0);
        assert!(notify.is_on());

        notify.ready("connected to https://c:8443 as r1", t0);
        assert_eq!(manager.receive(), "READY=1\nSTATUS=connected to https://c:8443 as r1");

        // The watchdog is due every half period, counted from the last ping.
        assert_eq!(notify.watchdog_due(), Some(t0 + Duration::from_secs(10)));
        notify.tick(t0 + Duration::from_secs(9));
        assert!(manager.nothing_pending(), "not due yet");
        notify.tick(t0 + Duration::from_secs(10));
        assert_eq!(manager.receive(), "WATCHDOG=1");
        assert_eq!(notify.watchdog_due(), Some(t0 + Duration::from_secs(20)));

        // A service with a timer of its own pings on it, due or not.
        assert_eq!(notify.watchdog_every(), Some(Duration::from_secs(10)));
        notify.watchdog(t0 + Duration::from_secs(12));
        assert_eq!(manager.receive(), "WATCHDOG=1");
        assert_eq!(notify.watchdog_due(), Some(t0 + Duration::from_secs(22)));

        notify.status("2 job(s) running\nsecond line");
        assert_eq!(manager.receive(), "STATUS=2 job(s) running second line");

        notify.stopping("draining 2 job(s)", Some(Duration::from_secs(75)));
        assert_eq!(manager.receive(), "STOPPING=1\nSTATUS=draining 2 job(s)\nEXTEND_TIMEOUT_USEC=75000000");
        notify.stopping("stopping", None);
        assert_eq!(manager.receive(), "STOPPING=1\nSTATUS=stopping");
        assert_eq!(notify.failures(), 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_abstract_socket_address_is_understood() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("ql-notify-test-{}", std::process::id());
        let bound = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        bound.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let to = Notifier::connect(OsStr::new(&format!("@{name}"))).unwrap();
        to.send("READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = bound.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_no_watchdog_is_due() {
        let notify = Notify::new(None, Some(Duration::from_secs(20)), Instant::now());
        assert!(!notify.is_on());
        assert_eq!(notify.watchdog_due(), None);
        assert_eq!(notify.watchdog_every(), None);
        let mut notify = Notify::off(Instant::now());
        notify.ready("x", Instant::now());
        notify.watchdog(Instant::now());
        notify.tick(Instant::now() + Duration::from_secs(3600));
        assert_eq!(notify.failures(), 0);
    }

    #[test]
    fn a_manager_that_does_not_read_costs_messages_never_a_stall() {
        let manager = Manager::new();
        let to = Notifier::connect(manager.address().as_os_str()).unwrap();
        let mut notify = Notify::new(Some(to), None, Instant::now());
        // The kernel queues a bounded number of datagrams for a receiver; past that a
        // socket without a send timeout would wait here for ever.
        for _ in 0..100_000 {
            notify.status("nobody reads this");
            if notify.failures() > 0 {
                break;
            }
        }
        assert!(notify.failures() > 0, "every send was queued");
        assert_eq!(manager.receive(), "STATUS=nobody reads this", "what was queued arrives");
    }

    #[test]
    fn a_vanished_manager_is_counted_not_fatal() {
        let manager = Manager::new();
        let to = Notifier::connect(manager.address().as_os_str()).unwrap();
        drop(manager);
        let mut notify = Notify::new(Some(to), None, Instant::now());
        notify.ready("x", Instant::now());
        notify.status("y");
        assert_eq!(notify.failures(), 2);
    }

    #[test]
    fn bad_addresses_are_refused() {
        for bad in ["", "relative/path", "notify"] {
            assert!(Notifier::connect(OsStr::new(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_watchdog_period_is_for_this_process_only() {
        let s = |v: &'static str| Some(OsStr::new(v));
        assert_eq!(watchdog_period(s("30000000"), None, 7), Some(Duration::from_secs(30)));
        assert_eq!(watchdog_period(s("30000000"), s("7"), 7), Some(Duration::from_secs(30)));
        assert_eq!(watchdog_period(s("30000000"), s("8"), 7), None, "meant for another process");
        assert_eq!(watchdog_period(None, None, 7), None);
        assert_eq!(watchdog_period(s("0"), None, 7), None);
        assert_eq!(watchdog_period(s("soon"), None, 7), None);
        assert_eq!(watchdog_period(s("30000000"), s("x"), 7), None);
    }

    #[test]
    fn no_notify_socket_turns_notification_off_and_a_bad_one_says_why() {
        let now = Instant::now();
        let (notify, error) = Notify::from_socket(None, Some(Duration::from_secs(30)), now);
        assert!(!notify.is_on() && error.is_none());
        let manager = Manager::new();
        let (notify, error) = Notify::from_socket(Some(manager.address().as_os_str()), None, now);
        assert!(notify.is_on() && error.is_none(), "{error:?}");
        let (notify, error) = Notify::from_socket(Some(OsStr::new("run/notify")), None, now);
        assert!(!notify.is_on());
        assert!(error.is_some_and(|e| e.starts_with("NOTIFY_SOCKET run/notify: ") && e.contains("absolute")));
    }
}
