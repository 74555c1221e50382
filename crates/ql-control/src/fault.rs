//! Fault points for the crash matrix (`tests/fault_matrix.rs` at the workspace root),
//! compiled only into test builds.
//!
//! With the `faults` cargo feature (off by default, refused in optimised builds), the
//! ingress reads `QL_CONTROL_FAULT` once: a comma-separated list of `kind:route[@n]`, where
//! `route` is a worker route's name (`offer.claim`, `attempt.running`, `lease.renew`,
//! `artifact.put`, `attempt.completion`, ...) and `n` (default 1) picks the route's `n`-th
//! request. Kinds:
//!
//! - `drop`: run the command (its transaction commits), then close the connection with a
//!   TCP reset instead of answering: the answer is lost;
//! - `delay`: run the command, then hold the answer back `QL_CONTROL_FAULT_DELAY_MS`
//!   (default 3000) before sending it, past the agent's call timeout;
//! - `crash`: run the command, then end the process at once (abort), before answering;
//! - `503`: refuse the route's first `n` requests with `503 unavailable`, without running
//!   them;
//! - `reset`: reset the connection in the middle of the request: for a JSON route after its
//!   body was read and before the command runs; for `artifact.put`, after 64 KiB of content
//!   went into the artifact store (the upload is discarded);
//! - `conflict`: answer the route's first `n` live-log chunks (`log.append`) with `409
//!   log_offset_conflict` at the offset each names, the length the agent holds already,
//!   without running them: a server that misbehaves in a way no agent can mend.
//!
//! Every fault that fires prints `ql-control: fault <kind>:<route>@<n> fired` on stderr, so
//! a test knows when it happened. Without the feature every function here does nothing,
//! the variables are never read, and the ingress's fault branches are compiled out.

#[cfg(all(feature = "faults", not(debug_assertions)))]
compile_error!("the `faults` feature is for test builds only; it must never reach a release binary");

use std::time::Duration;

/// Whether fault points are compiled in.
pub const ENABLED: bool = cfg!(feature = "faults");

/// Content bytes stored before a `reset` fault ends an artifact upload.
pub const RESET_UPLOAD_AFTER: u64 = 64 * 1024;

/// What the ingress does to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Run the command, then reset the connection without answering.
    Drop,
    /// Run the command, then answer after this long.
    Delay(Duration),
    /// Run the command, then end the process.
    Crash,
    /// Refuse with 503 without running the command.
    Refuse,
    /// Reset the connection in the middle of the request.
    Reset,
    /// Refuse a live-log chunk as a conflict at the offset it names.
    Conflict,
}

/// Counts a request of `route` and returns the fault to inject into it, if any.
#[cfg(feature = "faults")]
pub fn on_request(route: &str) -> Option<Fault> {
    armed::on_request(route)
}

/// Counts a request of `route` and returns the fault to inject into it, if any.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn on_request(_route: &str) -> Option<Fault> {
    None
}

/// Ends the process at once, as a crash would: no shutdown, no flush.
pub fn crash() -> ! {
    std::process::abort()
}

#[cfg(feature = "faults")]
mod armed {
    use super::Fault;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use std::time::Duration;

    const VAR: &str = "QL_CONTROL_FAULT";
    const DELAY_VAR: &str = "QL_CONTROL_FAULT_DELAY_MS";

    struct Entry {
        kind: String,
        route: String,
        n: u64,
    }

    struct Armed {
        entries: Vec<Entry>,
        delay: Duration,
        hits: Mutex<HashMap<String, u64>>,
    }

    fn armed() -> &'static Armed {
        static ARMED: OnceLock<Armed> = OnceLock::new();
        ARMED.get_or_init(|| {
            let spec = std::env::var(VAR).unwrap_or_default();
            let entries = spec
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|one| {
                    let (head, n) = match one.rsplit_once('@') {
                        Some((head, n)) => (head, n.parse().unwrap_or_else(|_| panic!("{VAR}: bad count in {one}"))),
                        None => (one, 1),
                    };
                    let (kind, route) =
                        head.split_once(':').unwrap_or_else(|| panic!("{VAR}: {one} is not kind:route"));
                    assert!(
                        ["drop", "delay", "crash", "503", "reset", "conflict"].contains(&kind),
                        "{VAR}: unknown fault kind in {one}"
                    );
                    eprintln!("ql-control: fault armed: {one}");
                    Entry { kind: kind.to_owned(), route: route.to_owned(), n }
                })
                .collect();
            let delay_ms = std::env::var(DELAY_VAR).ok().and_then(|v| v.parse().ok()).unwrap_or(3_000);
            Armed { entries, delay: Duration::from_millis(delay_ms), hits: Mutex::default() }
        })
    }

    pub(super) fn on_request(route: &str) -> Option<Fault> {
        let a = armed();
        if !a.entries.iter().any(|e| e.route == route) {
            return None;
        }
        let hit = {
            let mut hits = a.hits.lock().unwrap_or_else(|e| e.into_inner());
            let hit = hits.entry(route.to_owned()).or_default();
            *hit += 1;
            *hit
        };
        let entry = a.entries.iter().filter(|e| e.route == route).find(|e| match e.kind.as_str() {
            "503" | "conflict" => hit <= e.n,
            _ => hit == e.n,
        })?;
        eprintln!("ql-control: fault {}:{}@{} fired (request {hit})", entry.kind, entry.route, entry.n);
        Some(match entry.kind.as_str() {
            "drop" => Fault::Drop,
            "delay" => Fault::Delay(a.delay),
            "crash" => Fault::Crash,
            "503" => Fault::Refuse,
            "conflict" => Fault::Conflict,
            _ => Fault::Reset,
        })
    }
}

/// A handle that lets a request's handler reset its own connection. Without the feature
/// it holds nothing and never fires.
#[derive(Debug, Clone, Default)]
pub(crate) struct Reset {
    #[cfg(feature = "faults")]
    notify: std::sync::Arc<tokio::sync::Notify>,
}

impl Reset {
    /// Asks the connection to reset, then never returns: the connection drops this
    /// request's future when it resets.
    pub(crate) async fn fire(&self) {
        #[cfg(feature = "faults")]
        self.notify.notify_one();
        std::future::pending::<()>().await;
    }

    /// Resolves when a handler asked for a reset.
    pub(crate) async fn requested(&self) {
        #[cfg(feature = "faults")]
        self.notify.notified().await;
        #[cfg(not(feature = "faults"))]
        std::future::pending::<()>().await;
    }
}

#[cfg(all(test, not(feature = "faults")))]
mod tests {
    use super::*;

    /// Runs in a child process of the test binary, with the variable set (a test never
    /// changes its own process's environment: other tests read it from other threads).
    /// Ignored in a plain run, where it would have nothing to check: the test below runs
    /// it.
    #[test]
    #[ignore = "a child process of without_the_feature_the_variable_is_ignored"]
    fn child_with_the_variable_set() {
        if std::env::var_os("QL_CONTROL_FAULT").is_none() {
            println!("run by without_the_feature_the_variable_is_ignored, which sets QL_CONTROL_FAULT");
            return;
        }
        for route in ["offer.claim", "lease.renew", "artifact.put", "attempt.completion"] {
            assert_eq!(on_request(route), None, "{route}");
        }
    }

    /// Without the feature, the variable changes nothing: every route of an armed
    /// specification passes untouched.
    #[test]
    fn without_the_feature_the_variable_is_ignored() {
        const { assert!(!ENABLED) };
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "fault::tests::child_with_the_variable_set", "--ignored", "--test-threads=1"])
            .env("QL_CONTROL_FAULT", "crash:offer.claim,503:lease.renew@5,drop:artifact.put,reset:attempt.completion")
            .output()
            .unwrap();
        let printed = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && printed.contains("1 passed"), "{printed}");
    }
}
