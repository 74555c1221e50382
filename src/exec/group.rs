//! Process groups seen through `/proc` and reached with `kill(2)`: executor handles, group
//! liveness, group signals, and stopping a group the agent no longer has as a child.
//!
//! `kill(-pgid, 0)` keeps succeeding while a group's zombies wait to be reaped, so liveness
//! is decided by scanning `/proc/*/stat` for members of the group that are not zombies.
//! Signals go through rustix's safe `kill_process_group`, so no unsafe code is needed.

use rustix::process::{kill_process_group, Pid, Signal};
use smol::{future, Timer};
use std::fs;
use std::io;
use std::time::Duration;

use ql_wire::text::ExecutorHandle;

/// The fields of `/proc/<pid>/stat` the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// The state letter (`R`, `S`, `D`, `Z`, ...).
    pub(crate) state: u8,
    /// The process group.
    pub(crate) pgrp: i32,
    /// Start time in clock ticks after boot: with the pid, names one process for good.
    pub(crate) starttime: u64,
}

impl Stat {
    /// Whether the process still runs: zombies and dead tasks do not.
    pub(crate) fn is_live(&self) -> bool {
        !matches!(self.state, b'Z' | b'X' | b'x')
    }
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces and parentheses,
/// so fields are counted from the last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // Fields 3 (state) and 5 (pgrp); field 22 (starttime) is 17 further on.
    let state = *fields.next()?.as_bytes().first()?;
    let pgrp = fields.nth(1)?.parse().ok()?;
    let starttime = fields.nth(16)?.parse().ok()?;
    Some(Stat { state, pgrp, starttime })
}

/// Reads one process's stat; `NotFound` once the process has been reaped.
pub(crate) fn read_stat(pid: u32) -> io::Result<Stat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&text).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unreadable /proc/{pid}/stat")))
}

/// Whether any process of group `pgid` is alive (zombies excluded).
pub(crate) fn group_alive(pgid: u32) -> io::Result<bool> {
    let Ok(pgid) = i32::try_from(pgid) else {
        return Ok(false);
    };
    for entry in fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // A process may exit between the listing and the read: it is then not alive.
        if let Ok(stat) = read_stat(pid) {
            if stat.pgrp == pgid && stat.is_live() {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Sends `signal` to every process of group `pgid`. A group with no processes left is not
/// an error.
pub(crate) fn signal_group(pgid: u32, signal: Signal) -> io::Result<()> {
    // kill(-1) would signal every process the agent may signal: never build it.
    let pid = i32::try_from(pgid).ok().filter(|&p| p > 1).and_then(Pid::from_raw);
    let Some(pid) = pid else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("refusing to signal process group {pgid}")));
    };
    match kill_process_group(pid, signal) {
        Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Resolves once no process of group `pgid` is alive, looking every `poll`.
pub(crate) async fn group_gone(pgid: u32, poll: Duration) -> io::Result<()> {
    while group_alive(pgid)? {
        Timer::after(poll).await;
    }
    Ok(())
}

/// Sends TERM to the group, waits up to `grace` for it to die, then sends KILL and waits
/// until no member is alive. Returns `true` if KILL was needed.
pub(crate) async fn terminate_group(pgid: u32, grace: Duration, poll: Duration) -> io::Result<bool> {
    signal_group(pgid, Signal::TERM)?;
    let ended = future::or(async { group_gone(pgid, poll).await.map(|()| true) }, async {
        Timer::after(grace).await;
        Ok(false)
    })
    .await?;
    if ended {
        return Ok(false);
    }
    signal_group(pgid, Signal::KILL)?;
    group_gone(pgid, poll).await?;
    Ok(true)
}

/// The handle of a process: `pid:<pid> start:<starttime>`. The start time tells the
/// process apart from a later one that reuses its pid.
pub(crate) fn executor_handle(pid: u32, starttime: u64) -> ExecutorHandle {
    ExecutorHandle::parse(format!("pid:{pid} start:{starttime}")).expect("a short printable handle")
}

/// The pid and start time in a handle this module made.
pub(crate) fn parse_handle(handle: &ExecutorHandle) -> Option<(u32, u64)> {
    let (pid, start) = handle.as_str().strip_prefix("pid:")?.split_once(" start:")?;
    Some((pid.parse().ok()?, start.parse().ok()?))
}

/// The unit of `/proc/<pid>/stat`'s start time: USER_HZ, which Linux fixes at 100 ticks a
/// second on every architecture the agent is built for (only alpha's differs). A constant,
/// not the aux vector's `AT_CLKTCK`, so that reading it can never fail.
const USER_HZ: u64 = 100;

/// What is left of `timeout` for the job whose process `handle` names, counted from that
/// process's start: a restarted agent that takes a job back gives it only the rest, never
/// a whole timeout again. The start time counts ticks on the boot clock
/// (`CLOCK_BOOTTIME`), which no change of the wall clock moves; the whole `timeout` when
/// the handle is not one this module made (its start time unknown).
pub(crate) fn time_left(handle: &ExecutorHandle, timeout: Duration) -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let since_boot = Duration::new(u64::try_from(now.tv_sec).unwrap_or(0), u32::try_from(now.tv_nsec).unwrap_or(0));
    match parse_handle(handle) {
        Some((_, start)) => left_of(timeout, start, since_boot),
        None => timeout,
    }
}

/// [`time_left`] of a process started `start` ticks after boot, at `since_boot`.
fn left_of(timeout: Duration, start: u64, since_boot: Duration) -> Duration {
    let started = Duration::from_secs(start / USER_HZ) + Duration::from_millis((start % USER_HZ) * 1_000 / USER_HZ);
    timeout.saturating_sub(since_boot.saturating_sub(started))
}

/// Whether the handle's process still runs: same pid, same start time, not a zombie. A
/// restarted agent asks this of the handles in its journal.
pub(crate) fn is_alive(handle: &ExecutorHandle) -> bool {
    let Some((pid, start)) = parse_handle(handle) else {
        return false;
    };
    read_stat(pid).is_ok_and(|stat| stat.starttime == start && stat.is_live())
}

/// Ends the process group of a job this agent no longer has as a child (it restarted):
/// TERM, up to `grace`, then KILL, then waits until no member is alive.
///
/// The group is signalled only while the handle's own process is still there (running or a
/// zombie); a job leads its group, so the group's id is that process's pid. Once it has
/// gone and been reaped, the id may belong to someone else, so nothing is sent and
/// `Ok(false)` is returned.
pub(crate) async fn stop_orphan(handle: &ExecutorHandle, grace: Duration, poll: Duration) -> io::Result<bool> {
    let (pid, start) = parse_handle(handle)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not an executor handle of this agent"))?;
    match read_stat(pid) {
        Ok(stat) if stat.starttime == start && stat.pgrp == pid as i32 => {}
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    }
    terminate_group(pid, grace, poll).await?;
    Ok(true)
}

/// The environment variable that carries a job's attempt id into every process of it.
pub(crate) const ATTEMPT_VAR: &str = "QL_ATTEMPT_ID";

/// Live processes whose environment carries `ATTEMPT_VAR=<attempt>`, with their stat.
pub(crate) fn marked(attempt: &str) -> io::Result<Vec<(u32, Stat)>> {
    marked_by(ATTEMPT_VAR, attempt)
}

/// Live processes whose environment carries `var=value`, with their stat. A process's
/// environment is read from `/proc/<pid>/environ` (as it was at exec), which only its own
/// user (or root) can read: the agent's jobs run as the agent's user, or were started by
/// it as root and may have changed user since (which is why they are not filtered by it).
pub(crate) fn marked_by(var: &str, value: &str) -> io::Result<Vec<(u32, Stat)>> {
    let needle = format!("{var}={value}");
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // Processes exit, and others' are unreadable: either way, not ours to find.
        let Ok(environ) = fs::read(format!("/proc/{pid}/environ")) else { continue };
        if !environ.split(|&b| b == 0).any(|var| var == needle.as_bytes()) {
            continue;
        }
        if let Ok(stat) = read_stat(pid) {
            if stat.is_live() {
                found.push((pid, stat));
            }
        }
    }
    Ok(found)
}

/// Whether `/proc/<pid>` belongs to the agent's effective user (as the process's own
/// directory does, unless it made itself undumpable).
pub(crate) fn owned_by_me(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let me = rustix::process::geteuid().as_raw();
    fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == me)
}

/// The distinct process groups of `found` (as [`marked`] returns them), in order.
pub(crate) fn groups_of(found: &[(u32, Stat)]) -> Vec<i32> {
    let mut groups: Vec<i32> = found.iter().map(|(_, s)| s.pgrp).collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// What [`find_unrecorded`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    /// The job's process runs: it leads its group (pid = pgid).
    Leader {
        /// Its handle.
        handle: ExecutorHandle,
        /// Its pid, and its group's id.
        pid: u32,
    },
    /// The leader is gone; members it left behind were stopped.
    Stopped,
    /// No process of the job runs.
    Nothing,
}

/// Looks for the processes of `attempt` that an earlier agent started but did not record
/// (it died between the fork and the record). A leader found is left running for the
/// caller to adopt; members without their leader are stopped (TERM, `grace`, KILL).
pub(crate) async fn find_unrecorded(attempt: &str, grace: Duration, poll: Duration) -> io::Result<Found> {
    let found = marked(attempt)?;
    if let Some((pid, stat)) = found.iter().find(|(pid, stat)| stat.pgrp == *pid as i32) {
        return Ok(Found::Leader { handle: executor_handle(*pid, stat.starttime), pid: *pid });
    }
    if found.is_empty() {
        return Ok(Found::Nothing);
    }
    for pgid in groups_of(&found) {
        // Live members keep the group's id theirs: signalling it reaches only them.
        terminate_group(pgid as u32, grace, poll).await?;
    }
    Ok(Found::Stopped)
}

/// Stops what is left of a recorded job whose leader is gone: the live members of group
/// `pgid` that carry the job's `attempt`. Returns whether there were any.
pub(crate) async fn stop_leftovers(attempt: &str, pgid: u32, grace: Duration, poll: Duration) -> io::Result<bool> {
    let left = marked(attempt)?.into_iter().any(|(_, s)| s.pgrp == pgid as i32);
    if left {
        terminate_group(pgid, grace, poll).await?;
    }
    Ok(left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_counts_fields_after_the_last_parenthesis() {
        let line = "4242 (we (ird) na me) S 1 4240 4240 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 10000 200";
        assert_eq!(parse_stat(line), Some(Stat { state: b'S', pgrp: 4240, starttime: 987_654 }));
        assert_eq!(parse_stat("1 (x) Z 0 1 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 5 0 0").map(|s| s.is_live()), Some(false));
        assert_eq!(parse_stat("no parenthesis"), None);
        assert_eq!(parse_stat("1 (x) S 0 1"), None);
    }

    #[test]
    fn this_process_reads_back_as_alive_with_its_own_group() {
        let me = std::process::id();
        let stat = read_stat(me).unwrap();
        assert!(stat.is_live());
        let handle = executor_handle(me, stat.starttime);
        assert_eq!(parse_handle(&handle), Some((me, stat.starttime)));
        assert!(is_alive(&handle));
        assert!(!is_alive(&executor_handle(me, stat.starttime + 1)), "another start time is another process");
        assert!(group_alive(stat.pgrp as u32).unwrap());
    }

    #[test]
    fn a_job_taken_back_has_only_what_is_left_of_its_timeout() {
        let minute = Duration::from_secs(60);
        // Started 10 s after boot, now 25.5 s after: 15.5 s gone.
        assert_eq!(left_of(minute, 1_000, Duration::from_millis(25_500)), Duration::from_millis(44_500));
        // Ticks that are not whole seconds: started 10.57 s after boot.
        assert_eq!(left_of(minute, 1_057, Duration::from_millis(10_570)), minute);
        assert_eq!(left_of(minute, 1_057, Duration::from_millis(11_000)), minute - Duration::from_millis(430));
        // Run past it while no agent watched: nothing left.
        assert_eq!(left_of(minute, 1_000, Duration::from_secs(70)), Duration::ZERO);
        assert_eq!(left_of(minute, 1_000, Duration::from_secs(3_600)), Duration::ZERO);
        // A start after "now" (clocks that disagree) takes nothing off; nor does any start
        // overflow.
        assert_eq!(left_of(minute, 9_000, Duration::from_secs(10)), minute);
        assert_eq!(left_of(minute, u64::MAX, Duration::from_secs(10)), minute);
    }

    #[test]
    fn this_process_has_run_for_part_of_a_long_timeout_and_past_a_zero_one() {
        let me = std::process::id();
        let handle = executor_handle(me, read_stat(me).unwrap().starttime);
        let day = Duration::from_secs(86_400);
        assert!(time_left(&handle, day) > Duration::ZERO, "this test process has not run for a day");
        assert_eq!(time_left(&handle, Duration::ZERO), Duration::ZERO);
        let foreign = ExecutorHandle::parse("4242").unwrap();
        assert_eq!(time_left(&foreign, day), day, "a handle this module did not make keeps the whole timeout");
    }

    #[test]
    fn handles_this_agent_did_not_make_are_not_alive() {
        for text in ["pid:x start:1", "4242", "pid:1 start:", "pid:4194305 start:1"] {
            assert!(!is_alive(&ExecutorHandle::parse(text).unwrap()), "{text}");
        }
    }

    #[test]
    fn signalling_group_zero_or_one_is_refused() {
        for pgid in [0, 1, u32::MAX] {
            assert_eq!(signal_group(pgid, Signal::TERM).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        }
    }
}
