//! Fault points for the crash matrix (`tests/fault_matrix.rs`), compiled only into test
//! builds.
//!
//! With the `faults` cargo feature (off by default, refused in optimised builds), the agent
//! reads `QL_AGENT_FAULT=point[@n]` once and, at the `n`-th hit of `point` (default 1),
//! sends itself SIGKILL, as the OOM killer would: no destructor, no flush, no unwinding,
//! nothing written after the point. `hang:point[@n]` makes it stop there instead, asleep
//! until it is killed, as a process the scheduler or a thrashing disk leaves unrun. (Not
//! SIGSTOP: a stopped process whose group is orphaned when its parent dies is sent SIGHUP,
//! which ends it.) Without the feature every function here is empty, the
//! variable is never read, and not one byte of this machinery is in the binary.
//!
//! Points:
//!
//! - `journal:<kind>`: right after a record of that kind (`offered`, `claimed`, `spawned`,
//!   ... as in the journal's format) was fsynced and applied;
//! - `sent:<route>`: a request was answered (the server acted on it) but the answer is not
//!   handled yet; `<route>` is the protocol route's name (`offer.claim`, `attempt.starting`,
//!   `attempt.running`, `lease.renew`, `artifact.put`, `attempt.completion`, ...);
//! - `spawned`: the job's process runs but its `spawned` record is not written yet;
//! - `supervise`: a job's supervisor has started and has not read the job's spec yet;
//! - `handoff`: in a job's supervisor, the job runs but the supervisor has not yet told
//!   the agent which process it is;
//! - `upload-body`: counts the log bytes read for an upload, so `upload-body@65536` dies in
//!   the middle of the upload once 64 KiB of content were handed to the connection.
//!
//! A wrong clock is a fault too: `QL_AGENT_CLOCK_SKEW_MS=<signed ms>` moves every reading of
//! the wall clock by that much ([`clock_skew_ms`]), as on a router without a battery-backed
//! clock.

#[cfg(all(feature = "faults", not(debug_assertions)))]
compile_error!("the `faults` feature is for test builds only; it must never reach a release binary");

/// A hit of `point`.
#[inline(always)]
pub(crate) fn hit(point: &str) {
    count(point, 1);
}

/// `amount` hits of `point` at once (a byte count, say).
#[cfg(feature = "faults")]
pub(crate) fn count(point: &str, amount: u64) {
    armed::count(point, amount);
}

/// `amount` hits of `point` at once (a byte count, say).
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub(crate) fn count(_point: &str, _amount: u64) {}

/// A hit of `journal:<kind>` for the record just committed.
#[cfg(feature = "faults")]
pub(crate) fn journaled(record: &crate::journal::Record) {
    if armed::is_armed() {
        let kind = serde_json::to_value(record).ok().and_then(|v| v["kind"].as_str().map(str::to_owned));
        hit(&format!("journal:{}", kind.unwrap_or_default()));
    }
}

/// A hit of `journal:<kind>` for the record just committed.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub(crate) fn journaled(_record: &crate::journal::Record) {}

/// A hit of `sent:<route>`: the server answered `route`.
#[cfg(feature = "faults")]
pub(crate) fn answered(route: &ql_wire::route::Route) {
    if armed::is_armed() {
        hit(&format!("sent:{}", route.name()));
    }
}

/// A hit of `sent:<route>`: the server answered `route`.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub(crate) fn answered(_route: &ql_wire::route::Route) {}

/// How far the wall clock is made wrong (`QL_AGENT_CLOCK_SKEW_MS`), in milliseconds.
#[cfg(feature = "faults")]
pub(crate) fn clock_skew_ms() -> i64 {
    static SKEW: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *SKEW.get_or_init(|| {
        std::env::var("QL_AGENT_CLOCK_SKEW_MS")
            .ok()
            .map(|v| v.parse().unwrap_or_else(|_| panic!("QL_AGENT_CLOCK_SKEW_MS={v}: not a number")))
            .unwrap_or(0)
    })
}

/// How far the wall clock is made wrong: never, without the feature.
#[cfg(not(feature = "faults"))]
#[inline(always)]
pub(crate) fn clock_skew_ms() -> i64 {
    0
}

#[cfg(feature = "faults")]
mod armed {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    /// The environment variable naming the point.
    const VAR: &str = "QL_AGENT_FAULT";

    struct Armed {
        point: String,
        at: u64,
        seen: AtomicU64,
        /// Sleep for ever rather than SIGKILL (`hang:`).
        hang: bool,
    }

    fn armed() -> Option<&'static Armed> {
        static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
        ARMED
            .get_or_init(|| {
                let spec = std::env::var(VAR).ok().filter(|s| !s.is_empty())?;
                let (hang, point) = match spec.strip_prefix("hang:") {
                    Some(point) => (true, point),
                    None => (false, spec.as_str()),
                };
                let (point, at) = match point.rsplit_once('@') {
                    Some((point, n)) => (point, n.parse().unwrap_or_else(|_| panic!("{VAR}={spec}: bad count"))),
                    None => (point, 1),
                };
                eprintln!("ql-agent: fault point armed: {point} at hit {at}");
                Some(Armed { point: point.to_owned(), at, seen: AtomicU64::new(0), hang })
            })
            .as_ref()
    }

    pub(super) fn is_armed() -> bool {
        armed().is_some()
    }

    pub(super) fn count(point: &str, amount: u64) {
        let Some(a) = armed() else { return };
        if a.point != point || amount == 0 {
            return;
        }
        let before = a.seen.fetch_add(amount, Ordering::Relaxed);
        if before < a.at && before + amount >= a.at {
            if a.hang {
                eprintln!("ql-agent: fault point {point} reached: hanging");
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
            }
            eprintln!("ql-agent: fault point {point} reached: SIGKILL");
            let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
            // SIGKILL cannot be caught; it is delivered before kill returns to a
            // single-threaded caller. Never go on past the point, whatever happens.
            loop {
                std::thread::park();
            }
        }
    }
}

#[cfg(all(test, not(feature = "faults")))]
mod tests {
    use super::*;

    /// Runs in a child process of the test binary, with the variable set (a test never
    /// changes its own process's environment: other tests read it from other threads).
    /// Were the points compiled in, the first hit would SIGKILL the child. Ignored in a
    /// plain run, where it would have nothing to check: the test below runs it.
    #[test]
    #[ignore = "a child process of without_the_feature_the_variable_is_ignored"]
    fn child_with_the_variable_set() {
        let Ok(spec) = std::env::var("QL_AGENT_FAULT") else {
            println!("run by without_the_feature_the_variable_is_ignored, which sets QL_AGENT_FAULT");
            return;
        };
        let point = spec.split('@').next().unwrap_or_default().to_owned();
        for _ in 0..3 {
            hit(&point);
            count(&point, 1 << 20);
        }
        println!("survived {spec}");
    }

    /// Without the feature, the variable changes nothing.
    #[test]
    fn without_the_feature_the_variable_is_ignored() {
        for spec in ["journal:claimed", "spawned@2", "upload-body@65536"] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "fault::tests::child_with_the_variable_set",
                    "--ignored",
                    "--test-threads=1",
                    "--nocapture",
                ])
                .env("QL_AGENT_FAULT", spec)
                .output()
                .unwrap();
            let printed = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success() && printed.contains(&format!("survived {spec}")), "{spec}: {printed}");
        }
    }
}
