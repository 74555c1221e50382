//! Jobs that outlive the agent: each job runs under a small supervisor of its own.
//!
//! The agent does not hold a job's output pipe itself. It starts `ql-agent supervise
//! <run dir>` (its own binary, through `/proc/self/exe`, so an upgrade that replaced the
//! file on disk does not stop it), in a process group of its own, and the supervisor runs
//! the job as [`Job`] always did: the job's group, the pipe into the capped spool, the
//! wait, the clean-up of members left behind. What the supervisor learns it leaves in the
//! run directory, each file written whole (temporary name, fsync, rename, fsync of the
//! directory):
//!
//! ```text
//! <run dir>/spec.json     the spec, from the agent (0600); the supervisor deletes it once
//!                         read, since its environment may hold secrets
//!           job           `pid:<p> start:<t>` of the job, then of the supervisor, once the
//!                         job runs
//!           status        how the job ended (exit code or signal, log length, truncated),
//!                         or why it could not start: one line of text
//! ```
//!
//! When the agent dies — SIGKILL, a crash, procd or systemd restarting it — the supervisor
//! and the job go on, and the job keeps its whole output. The restarted agent finds them
//! through the journal: [`Supervised::attach`] when the supervisor still runs (the agent
//! streams the log on from where the server acknowledged it and reports the true exit),
//! [`exit_recorded`] when the job ended meanwhile. Only when the machine itself went down
//! are both gone, and the exit is unknown. When the agent died while its supervisor was
//! still starting the job, the restarted agent waits `handoff_timeout_ms` for the hand-over
//! ([`handed_off`]); a supervisor slower than that ([`stop_stalled`], found by the attempt
//! it carries in [`SUPERVISOR_VAR`]) is frozen, its files read once more (it may have handed
//! the job over just then, and goes on), and otherwise killed before the agent looks for
//! the job, or starts it, itself: else the two could both start it.
//!
//! [`Supervised`] has the shape of [`Job`] for the agent: the spool's length for the live
//! log ([`Supervised::spooled`], read from the file every `poll`), [`Supervised::wait`]
//! for the status, [`Supervised::stop`] to end the job's group (TERM, grace, KILL — the
//! supervisor then records the signal). A stop sent to the agent's own process group does
//! not reach the supervisor or the job.

use std::cell::Cell;
use std::fs::{self, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use smol::process::{Child, Command, Stdio};
use smol::Timer;

use ql_wire::ids::AttemptId;
use ql_wire::spec::ExecutionSpec;
use ql_wire::text::ExecutorHandle;

use super::group::{self, executor_handle, group_alive, is_alive, parse_handle, read_stat};
use super::{sync_dir, Exit, Job, RunDir, SpawnError};

/// The subcommand that runs a supervisor.
pub(crate) const SUPERVISE: &str = "supervise";
/// The variable that marks a supervisor with its attempt (its job's environment is its
/// own, without it): an agent restarted while a start was under way finds the supervisor
/// by it ([`stop_stalled`]).
pub(crate) const SUPERVISOR_VAR: &str = "QL_SUPERVISOR_OF";

/// `status`: how the job ended, or why it never started. One line of text, written whole:
/// `exited <code|-> <signal|-> <truncated 0|1> <log length>`, or `not-started <why>`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Status {
    Exited(Exit),
    NotStarted(String),
}

impl Status {
    fn to_line(&self) -> String {
        let opt = |n: Option<i32>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
        match self {
            Self::Exited(e) => {
                format!("exited {} {} {} {}\n", opt(e.code), opt(e.signal), u8::from(e.truncated), e.log_len)
            }
            Self::NotStarted(why) => format!("not-started {}\n", why.replace('\n', " ")),
        }
    }

    fn parse(text: &str) -> Option<Self> {
        let line = text.strip_suffix('\n')?;
        if let Some(why) = line.strip_prefix("not-started ") {
            return Some(Self::NotStarted(why.to_owned()));
        }
        let mut words = line.strip_prefix("exited ")?.split(' ');
        let mut opt = || match words.next()? {
            "-" => Some(None),
            w => w.parse().ok().map(Some),
        };
        let (code, signal) = (opt()?, opt()?);
        let truncated = words.next()? == "1";
        let log_len = words.next()?.parse().ok()?;
        words.next().is_none().then_some(Self::Exited(Exit { code, signal, truncated, log_len }))
    }
}

impl RunDir {
    fn spec_file(&self) -> PathBuf {
        self.root.join("spec.json")
    }

    fn job_file(&self) -> PathBuf {
        self.root.join("job")
    }

    fn status_file(&self) -> PathBuf {
        self.root.join("status")
    }

    /// The run directory at `root` (`<state>/runs/<attemptId>`).
    fn at(root: &Path) -> io::Result<Self> {
        let name = root.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let attempt = AttemptId::parse(name).map_err(|_| io::Error::other("not a run directory"))?;
        let state = root.parent().and_then(Path::parent).ok_or_else(|| io::Error::other("not a run directory"))?;
        Ok(RunDir::new(state, &attempt))
    }
}

/// Writes `bytes` to `path` whole: a reader sees all of it or nothing.
fn write_whole(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn read_status(run_dir: &RunDir) -> io::Result<Option<Status>> {
    match fs::read_to_string(run_dir.status_file()) {
        Ok(text) => Status::parse(&text).map(Some).ok_or_else(|| io::Error::other("a bad status file")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The job's and the supervisor's handles from the `job` file.
fn read_handoff(run_dir: &RunDir) -> io::Result<Option<(ExecutorHandle, ExecutorHandle)>> {
    let text = match fs::read_to_string(run_dir.job_file()) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut lines = text.lines().map(|l| ExecutorHandle::parse(l).map_err(|_| io::Error::other("a bad job file")));
    match (lines.next(), lines.next()) {
        (Some(job), Some(supervisor)) => Ok(Some((job?, supervisor?))),
        _ => Err(io::Error::other("a short job file")),
    }
}

/// How the job ended while no agent watched, if its supervisor recorded it.
pub(crate) fn exit_recorded(run_dir: &RunDir) -> io::Result<Option<Exit>> {
    Ok(match read_status(run_dir)? {
        Some(Status::Exited(exit)) => Some(exit),
        _ => None,
    })
}

/// Whether the job's supervisor still runs (it will record the job's end).
pub(crate) fn supervisor_alive(run_dir: &RunDir) -> bool {
    matches!(read_handoff(run_dir), Ok(Some((_, supervisor))) if is_alive(&supervisor))
}

/// What a supervisor started for a previous agent that died before journaling it: the
/// job's handle and pid once it runs, or why it could not start. A start under way (the
/// spec is still there) is waited for, up to `handoff`; `None` when no supervisor got this
/// far in that time. A supervisor still starting then must be stopped ([`stop_stalled`])
/// before anything else is concluded: it could start the job later.
pub(crate) fn handed_off(
    run_dir: &RunDir,
    handoff: Duration,
) -> io::Result<Option<Result<(ExecutorHandle, u32), String>>> {
    let gave_up = Instant::now() + handoff;
    loop {
        // Looked at first: the supervisor writes `job`, then deletes the spec, so a spec
        // gone by now means a `job` file, if any, is there to be read next.
        let starting = run_dir.spec_file().exists();
        if let Some(Status::NotStarted(error)) = read_status(run_dir)? {
            return Ok(Some(Err(error)));
        }
        if let Some((handle, _)) = read_handoff(run_dir)? {
            let (pid, _) = parse_handle(&handle).ok_or_else(|| io::Error::other("a bad job file"))?;
            return Ok(Some(Ok((handle, pid))));
        }
        if !starting || Instant::now() > gave_up {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A job run by its supervisor, as the agent sees it.
pub(crate) struct Supervised {
    /// The supervisor, when this agent started it (to reap it).
    child: Option<Child>,
    supervisor: ExecutorHandle,
    pid: u32,
    handle: ExecutorHandle,
    run_dir: RunDir,
    spooled: Rc<Cell<u64>>,
    poll: Duration,
    exit: Option<Exit>,
}

impl Supervised {
    /// Starts `spec`'s job under a new supervisor and returns once the job runs (or could
    /// not be started), waiting up to `handoff` for it to say so. `poll` is how often the
    /// supervisor's files and the job's group are looked at, `grace` what the supervisor
    /// gives members the job left behind.
    pub(crate) fn spawn(
        spec: &ExecutionSpec,
        run_dir: RunDir,
        poll: Duration,
        grace: Duration,
        handoff: Duration,
    ) -> Result<Supervised, SpawnError> {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&run_dir.root).map_err(SpawnError::RunDir)?;
        for stale in [run_dir.job_file(), run_dir.status_file()] {
            match fs::remove_file(stale) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(SpawnError::RunDir(e)),
                _ => {}
            }
        }
        let spec_json = serde_json::to_vec(spec).map_err(|e| SpawnError::RunDir(io::Error::other(e)))?;
        write_whole(&run_dir.spec_file(), &spec_json).map_err(SpawnError::RunDir)?;
        let mut cmd = std::process::Command::new("/proc/self/exe");
        cmd.arg(SUPERVISE)
            .arg(&run_dir.root)
            .arg(poll.as_millis().to_string())
            .arg(grace.as_millis().to_string())
            .env(SUPERVISOR_VAR, run_dir.attempt.as_str())
            // Its own group: what is sent to the agent's group does not reach it.
            .process_group(0);
        let mut cmd = Command::from(cmd);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        let mut child = cmd.spawn().map_err(|e| SpawnError::NoSupervisor(e.to_string()))?;
        let gave_up = Instant::now() + handoff;
        loop {
            // Whether it ended, before its files are read: one that handed the job over
            // and then ended is found handing it over, never taken for one that failed.
            let ended = child.try_status().map_or(true, |s| s.is_some());
            // Its files unreadable, the supervisor is not left to run the job unwatched.
            let unread = |child: &mut Child, e: io::Error| {
                let why = format!("reading its files: {e}");
                abandon_start(child, &run_dir, &why).unwrap_or(SpawnError::RunDir(e))
            };
            match read_status(&run_dir) {
                Ok(Some(Status::NotStarted(error))) => return Err(SpawnError::Supervised(error)),
                Ok(_) => {}
                Err(e) => return Err(unread(&mut child, e)),
            }
            let handed = match read_handoff(&run_dir) {
                Ok(handed) => handed,
                Err(e) => return Err(unread(&mut child, e)),
            };
            if let Some((handle, supervisor)) = handed {
                let Some((pid, _)) = parse_handle(&handle) else {
                    let bad = "a bad job file";
                    return Err(abandon_start(&mut child, &run_dir, bad).unwrap_or(SpawnError::Supervised(bad.into())));
                };
                let spooled = Rc::new(Cell::new(0));
                let poll = poll.max(Duration::from_millis(1));
                return Ok(Supervised {
                    child: Some(child),
                    supervisor,
                    pid,
                    handle,
                    run_dir,
                    spooled,
                    poll,
                    exit: None,
                });
            }
            if ended || Instant::now() > gave_up {
                let why = if ended { "it ended" } else { "it did not hand the job over in time" };
                if let Some(failed) = abandon_start(&mut child, &run_dir, why) {
                    return Err(failed);
                }
                // Nothing was started. One that ended cannot run here; one that was slow
                // may run the next job.
                return Err(if ended { SpawnError::NoSupervisor(why.into()) } else { SpawnError::SupervisorSlow });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The job a previous agent started, whose supervisor still runs.
    pub(crate) fn attach(run_dir: RunDir, poll: Duration) -> io::Result<Supervised> {
        let (handle, supervisor) = read_handoff(&run_dir)?.ok_or_else(|| io::Error::other("no job file"))?;
        let (pid, _) = parse_handle(&handle).ok_or_else(|| io::Error::other("a bad job file"))?;
        // An agent that died while it had frozen the supervisor ([`stop_stalled`]) left it
        // stopped: it goes on (it leads its own group, which holds nothing else).
        if let Some((supervisor_pid, _)) = parse_handle(&supervisor) {
            let _ = group::signal_group(supervisor_pid, rustix::process::Signal::CONT);
        }
        let spooled = Rc::new(Cell::new(fs::metadata(&run_dir.spool).map_or(0, |m| m.len())));
        let poll = poll.max(Duration::from_millis(1));
        Ok(Supervised { child: None, supervisor, pid, handle, run_dir, spooled, poll, exit: None })
    }

    /// The job's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The job's process group: its pid.
    pub(crate) fn pgid(&self) -> u32 {
        self.pid
    }

    /// The job's handle, `pid:<pid> start:<starttime>`.
    pub(crate) fn executor_handle(&self) -> &ExecutorHandle {
        &self.handle
    }

    /// The run's files.
    pub(crate) fn run_dir(&self) -> &RunDir {
        &self.run_dir
    }

    /// The spool's length, kept current while [`Supervised::wait`] is polled.
    pub(crate) fn spooled(&self) -> Rc<Cell<u64>> {
        self.spooled.clone()
    }

    /// Waits for the supervisor to record the job's end. An error when the supervisor
    /// ended without recording it.
    pub(crate) async fn wait(&mut self) -> io::Result<Exit> {
        if let Some(exit) = self.exit {
            return Ok(exit);
        }
        loop {
            if let Ok(meta) = fs::metadata(&self.run_dir.spool) {
                self.spooled.set(meta.len());
            }
            if let Some(exit) = exit_recorded(&self.run_dir)? {
                if let Some(child) = self.child.as_mut() {
                    let _ = child.status().await;
                }
                self.spooled.set(exit.log_len);
                self.exit = Some(exit);
                return Ok(exit);
            }
            let gone = match self.child.as_mut() {
                Some(child) => child.try_status()?.is_some(),
                None => !is_alive(&self.supervisor),
            };
            if gone {
                // It may have written the status just before it ended.
                if let Some(exit) = exit_recorded(&self.run_dir)? {
                    self.exit = Some(exit);
                    return Ok(exit);
                }
                return Err(io::Error::other("the job's supervisor ended without recording how the job ended"));
            }
            Timer::after(self.poll).await;
        }
    }

    /// Ends the job's whole group (TERM, `grace`, KILL) and waits for the supervisor to
    /// record the end.
    pub(crate) async fn stop(&mut self, grace: Duration) -> io::Result<Exit> {
        if self.exit.is_none() && group_alive(self.pid)? {
            group::terminate_group(self.pid, grace, self.poll).await?;
        }
        self.wait().await
    }
}

/// Kills every process group that carries `attempt` (a job whose supervisor is gone
/// before it could say which process it started).
fn stop_marked(attempt: &AttemptId) {
    let Ok(found) = group::marked(attempt.as_str()) else { return };
    let groups: Vec<u32> = group::groups_of(&found).into_iter().filter_map(|g| u32::try_from(g).ok()).collect();
    let _ = signal_groups(&groups, rustix::process::Signal::KILL);
}

/// Ends a supervisor the agent gives up on before it handed the job over, and a child it
/// forked that has not become the job yet (it carries the supervisor's mark, not the
/// job's); the spec (its environment may hold secrets) is not left behind. The spool is
/// made, and synced, before the job's fork: with none, nothing was started (`None`), and
/// the agent may run the job itself. With one, the job may run unwatched: it is stopped,
/// and its start reported failed (the error returned), so that it never runs twice.
fn abandon_start(child: &mut Child, run_dir: &RunDir, why: &str) -> Option<SpawnError> {
    let _ = child.kill();
    let _ = kill_marked(&run_dir.attempt);
    let _ = fs::remove_file(run_dir.spec_file());
    run_dir.spool.exists().then(|| {
        stop_marked(&run_dir.attempt);
        SpawnError::Supervised(format!("its supervisor failed after starting the job ({why})"))
    })
}

/// The process groups holding a live process marked as a supervisor of `attempt`
/// ([`SUPERVISOR_VAR`]) and run by the agent's own user (supervisors never change user;
/// another user's process carrying the mark is not one, and an agent running as root
/// would otherwise signal whatever group that user put it in), with those processes. A
/// supervisor leads its own group; a child it forked joins the job's group before it
/// becomes the job (and drops the mark): each group reaches both.
fn marked_supervisors(attempt: &AttemptId) -> io::Result<(Vec<u32>, Vec<u32>)> {
    let mut found = group::marked_by(SUPERVISOR_VAR, attempt.as_str())?;
    found.retain(|(pid, _)| group::owned_by_me(*pid));
    let groups = group::groups_of(&found).into_iter().filter_map(|g| u32::try_from(g).ok()).collect();
    Ok((groups, found.into_iter().map(|(pid, _)| pid).collect()))
}

/// Sends `signal` to each of `groups`; an error if one could not be signalled (the others
/// still are).
fn signal_groups(groups: &[u32], signal: rustix::process::Signal) -> io::Result<()> {
    let mut failed = None;
    for &pgid in groups {
        if let Err(e) = group::signal_group(pgid, signal) {
            failed.get_or_insert(e);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// SIGKILL to the supervisors of `attempt` and what they forked ([`marked_supervisors`]).
/// Returns how many groups there were.
fn kill_marked(attempt: &AttemptId) -> io::Result<usize> {
    let (groups, _) = marked_supervisors(attempt)?;
    signal_groups(&groups, rustix::process::Signal::KILL)?;
    Ok(groups.len())
}

/// What [`stop_stalled`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stalled {
    /// No supervisor of the attempt runs.
    Nothing,
    /// Its supervisor said, after all, what became of the job ([`handed_off`]'s answer):
    /// one that handed it over runs on.
    Said(Result<(ExecutorHandle, u32), String>),
    /// Its supervisors were killed.
    Stopped,
}

/// Stops the supervisors of the attempt of `run_dir` that still run, and anything they
/// forked that carries their mark. A previous agent started them and died before they
/// handed the job over: one this slow may yet start the job, after the agent started it
/// again. They are frozen (SIGSTOP) first, and once they are (or after `grace`) their
/// files are read again: one that handed the job over since the agent last looked is let
/// go on (SIGCONT) and its job found, not killed with the job left unwatched; one that
/// ended meanwhile is heard as it would have been. Otherwise every group frozen, and any
/// marked since, is killed, until none is left, for up to `grace` (an error past it).
/// The spec they were to read goes too (its environment may hold secrets).
pub(crate) async fn stop_stalled(run_dir: &RunDir, poll: Duration, grace: Duration) -> io::Result<Stalled> {
    use rustix::process::Signal;
    // A few looks at least, whatever the grace: a signal takes effect when the process
    // next runs.
    let deadline = Instant::now() + grace.max(poll.saturating_mul(4));
    let (frozen, pids) = marked_supervisors(&run_dir.attempt)?;
    let _ = signal_groups(&frozen, Signal::STOP);
    // A stop lands once a system call in progress (a rename on slow flash) is done.
    let unstopped = |pid: u32| group::read_stat(pid).is_ok_and(|s| s.is_live() && !matches!(s.state, b'T' | b't'));
    while Instant::now() < deadline && pids.iter().any(|&pid| unstopped(pid)) {
        Timer::after(poll).await;
    }
    if let Ok(Some(said)) = handed_off(run_dir, Duration::ZERO) {
        if said.is_ok() {
            if let Err(e) = signal_groups(&frozen, Signal::CONT) {
                warn!("the job's supervisor handed it over, but could not be let go on: {e}");
            }
        } else {
            let _ = signal_groups(&frozen, Signal::KILL);
        }
        return Ok(Stalled::Said(said));
    }
    // The groups frozen go whether or not they still carry the mark (a child that became
    // the job meanwhile does not); then whatever is marked, until nothing is.
    let mut any = !frozen.is_empty();
    signal_groups(&frozen, Signal::KILL)?;
    loop {
        let marked = kill_marked(&run_dir.attempt)?;
        let frozen_alive = frozen.iter().any(|&g| group::group_alive(g).unwrap_or(false));
        if marked == 0 && !frozen_alive {
            break;
        }
        any = true;
        if Instant::now() >= deadline {
            return Err(io::Error::other("a supervisor of the job outlived SIGKILL"));
        }
        Timer::after(poll).await;
    }
    let _ = fs::remove_file(run_dir.spec_file());
    Ok(if any { Stalled::Stopped } else { Stalled::Nothing })
}

/// Writes the job's `status` whole.
fn record(run_dir: &RunDir, status: &Status) -> io::Result<()> {
    write_whole(&run_dir.status_file(), status.to_line().as_bytes())
}

/// `ql-agent supervise <run dir> <poll ms> <grace ms>`: runs one job (see the module doc).
pub(crate) fn main(args: &[String]) -> i32 {
    let [root, poll, grace] = args else {
        eprintln!("usage: ql-agent supervise <run dir> <poll ms> <grace ms>");
        return 2;
    };
    let ms = |s: &str| Duration::from_millis(s.parse().unwrap_or(50));
    let (poll, grace) = (ms(poll), ms(grace));
    let run_dir = match RunDir::at(Path::new(root)) {
        Ok(run_dir) => run_dir,
        Err(e) => {
            eprintln!("ql-agent supervise: {e}");
            return 2;
        }
    };
    crate::fault::hit("supervise");
    let spec: Result<ExecutionSpec, String> = fs::read(run_dir.spec_file())
        .map_err(|e| e.to_string())
        .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|e| e.to_string()));
    let spec = match spec {
        Ok(spec) => spec,
        Err(e) => return i32::from(record(&run_dir, &Status::NotStarted(format!("reading the spec: {e}"))).is_err()),
    };
    let ex = smol::LocalExecutor::new();
    let ran = crate::run_local(
        &ex,
        Box::pin(async move {
            let mut job = match Job::spawn(&spec, run_dir.clone(), poll) {
                Ok(job) => job,
                Err(e) => {
                    // Nothing will start: the spec's environment may hold secrets.
                    let _ = fs::remove_file(run_dir.spec_file());
                    return record(&run_dir, &Status::NotStarted(e.to_string())).map_err(|e| e.to_string());
                }
            };
            crate::fault::hit("handoff");
            let me = std::process::id();
            let handoff = read_stat(me)
                .map(|stat| format!("{}\n{}\n", job.executor_handle(), executor_handle(me, stat.starttime)));
            if let Err(e) = handoff.and_then(|text| write_whole(&run_dir.job_file(), text.as_bytes())) {
                // The agent could never find the job: it must not run unwatched.
                let _ = job.stop(grace).await;
                return Err(e.to_string());
            }
            // The spec's environment may hold secrets: once the job runs it leaves the disk.
            // (Until then, its presence tells a restarted agent a start is under way.)
            let _ = fs::remove_file(run_dir.spec_file());
            // The leader's end, then whatever it left running in its group.
            let waited = job.wait().await;
            let exit = match (job.stop(grace).await, waited) {
                (Ok(exit), _) => exit,
                // Its leftovers could not be stopped: the leader's end still stands.
                (Err(_), Ok(exit)) => exit,
                // The end is not known: the agent reports the run without an exit status.
                (Err(_), Err(_)) => {
                    let log_len = fs::metadata(&run_dir.spool).map_or(0, |m| m.len());
                    Exit { code: None, signal: None, truncated: log_len >= spec.log_limit_bytes, log_len }
                }
            };
            record(&run_dir, &Status::Exited(exit)).map_err(|e| e.to_string())
        }),
    );
    i32::from(ran.is_err())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_line_round_trips_and_anything_else_is_refused() {
        let statuses = [
            Status::Exited(Exit { code: Some(0), signal: None, truncated: false, log_len: 12 }),
            Status::Exited(Exit { code: None, signal: Some(9), truncated: true, log_len: 1 << 26 }),
            Status::NotStarted("cannot start `nope`: No such file or directory (os error 2)".into()),
        ];
        for status in statuses {
            assert_eq!(Status::parse(&status.to_line()), Some(status));
        }
        for bad in ["", "exited 0 - 0\n", "exited 0 - 0 12", "exited x - 0 12\n", "done\n"] {
            assert_eq!(Status::parse(bad), None, "{bad:?}");
        }
    }
}
