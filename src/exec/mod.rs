//! Spawning and supervising one job's process group.
//!
//! [`Job::spawn`] starts the spec's program (an argv, or a script written to the run
//! directory and run as `<interpreter> <file>`) in a new process group, with the spec's
//! environment on top of a small inherited one, in the run's own working directory. The
//! child's stdout and stderr are one pipe; the agent copies the pipe into a spool file
//! through a fixed 8 KiB buffer and stops keeping bytes at the spec's `logLimitBytes`
//! (it keeps reading and discarding them, so the child never blocks on a full pipe, and
//! marks the log truncated). Disk and memory stay bounded whatever the job prints, which
//! matters where the spool lives in RAM (`/tmp` on OpenWrt). The bytes written so far are
//! counted where the agent can read them ([`Job::spooled`]) to stream the log while the job
//! runs, and [`release_spool`] gives back the disk (or RAM) of the part the server
//! acknowledged, by punching a hole: offsets stay as they were, so the spool holds only
//! what is not acknowledged yet.
//!
//! Layout of a run, under the agent's state directory:
//!
//! ```text
//! <state>/runs/<attemptId>/          mode 0700
//!                          work/     the child's working directory
//!                          script.sh the script, for script specs (.py, .js for the others)
//!                          output.log the spool: stdout and stderr, at most logLimitBytes
//! ```
//!
//! The script and the spool sit beside the working directory, not in it, so the job
//! cannot clobber its own log by writing files. The run directory is fsynced before the
//! fork: a spool that is missing after a crash proves the process was never started.
//!
//! Every process of a job carries its attempt id in its environment ([`ATTEMPT_VAR`],
//! set after the spec's variables so a spec cannot change it). That is how a restarted
//! agent finds a process it started but had no time to record ([`find_unrecorded`]), and
//! the members a job left behind when its leader is gone ([`stop_leftovers`]).
//!
//! Driving: everything happens while [`Job::wait`] or [`Job::stop`] is being polled; both
//! may be dropped at an await point and called again (a timeout is `wait` raced against an
//! `async_io::Timer`, then `stop`). The pipe holds 64 KiB, so a job whose future is not
//! polled for a while only pauses. The executor that runs the agent must spawn
//! `smol::process::driver()` before the first job, so async-process adds no reaper thread.
//!
//! [`Job::stop`] sends TERM to the whole group, waits up to a grace period, sends KILL, and
//! returns only when no member of the group is alive (zombies excluded).
//!
//! The agent does not run a [`Job`] itself: each job runs under a supervisor process of its
//! own ([`supervise`]), which holds the pipe, the spool and the exit, so a job outlives its
//! agent. A restarted agent takes a job back through its supervisor; only a job started by
//! an agent without supervisors is found through its [`executor handle`](Job::executor_handle)
//! with [`is_alive`] and ended with [`stop_orphan`].
//!
//! No unsafe code: the pipe comes from rustix's `pipe_with` and signals from its
//! `kill_process_group`, both safe wrappers already in the tree through async-io.

mod group;
pub(crate) mod supervise;

pub(crate) use group::{
    find_unrecorded, group_alive, is_alive, stop_leftovers, stop_orphan, time_left, Found, ATTEMPT_VAR,
};
pub(crate) use supervise::Supervised;

use rustix::pipe::{pipe_with, PipeFlags};
use rustix::process::Signal;
use smol::io::AsyncReadExt;
use smol::process::{Child, Command, Stdio};
use smol::{future, Async, Timer};
use std::cell::Cell;
use std::ffi::OsString;
use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::rc::Rc;
use std::time::Duration;

use ql_wire::ids::AttemptId;
use ql_wire::spec::{ExecutionSpec, Interpreter};
use ql_wire::text::ExecutorHandle;

/// Variables a job inherits from the agent; everything else comes from the spec.
pub(crate) const INHERITED_ENV: &[&str] = &["PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR"];
/// `PATH` for a job when the agent itself has none.
pub(crate) const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The copy buffer between the pipe and the spool.
pub(crate) const COPY_BUFFER: usize = 8 * 1024;

/// Where one run's files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RunDir {
    /// `<state>/runs/<attemptId>`.
    pub(crate) root: PathBuf,
    /// The child's working directory.
    pub(crate) work: PathBuf,
    /// The log spool.
    pub(crate) spool: PathBuf,
    /// The attempt the run belongs to (its processes carry it in [`ATTEMPT_VAR`]).
    pub(crate) attempt: AttemptId,
}

impl RunDir {
    /// The run directory of `attempt` under the agent's state directory. The attempt id's
    /// charset (`[A-Za-z0-9_-]`) makes it a safe file name.
    pub(crate) fn new(state_dir: &Path, attempt: &AttemptId) -> Self {
        let root = state_dir.join("runs").join(attempt.as_str());
        Self { work: root.join("work"), spool: root.join("output.log"), root, attempt: attempt.clone() }
    }

    /// Where a script for `interpreter` is written.
    pub(crate) fn script(&self, interpreter: Interpreter) -> PathBuf {
        self.root.join(match interpreter {
            Interpreter::Sh => "script.sh",
            Interpreter::Python3 => "script.py",
            Interpreter::Node => "script.js",
        })
    }

    /// Removes the run's files, once its log is uploaded and the job dropped.
    pub(crate) fn remove(&self) -> io::Result<()> {
        match fs::remove_dir_all(&self.root) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// Removes the run directories under `state_dir` of attempts `named` does not name (the
/// journal's jobs): a crash between a job's `dropped` record and the removal of its
/// directory leaves one, spool and all, and on a router the state may live in RAM.
/// Returns how many it removed.
pub(crate) fn remove_strays(state_dir: &Path, named: impl Fn(&str) -> bool) -> io::Result<usize> {
    let entries = match fs::read_dir(state_dir.join("runs")) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        entries => entries?,
    };
    let (mut removed, mut failed) = (0, None);
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        // Only what the agent made: a directory named as an attempt id.
        let Some(attempt) = name.to_str().and_then(|n| AttemptId::parse(n).ok()) else { continue };
        if named(attempt.as_str()) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        // One that cannot be removed does not keep the others.
        match RunDir::new(state_dir, &attempt).remove() {
            Ok(()) => removed += 1,
            Err(e) => failed = Some(e),
        }
    }
    failed.map_or(Ok(removed), Err)
}

/// Why a job could not be started. Its `Display` is fit for a start-failure reason: it
/// names the program, never an argument or an environment value.
#[derive(Debug)]
pub(crate) enum SpawnError {
    /// The spec has neither an argv nor a script (it was not validated).
    NothingToRun,
    /// The run directory, the script file or the spool could not be written.
    RunDir(io::Error),
    /// The output pipe could not be made.
    Pipe(io::Error),
    /// The program could not be executed: missing, not executable, ...
    Program {
        /// `argv[0]`, or the interpreter.
        program: String,
        /// What exec said.
        error: io::Error,
    },
    /// The process started but its `/proc` entry could not be read, so it has no handle; it
    /// was killed.
    Handle(io::Error),
    /// The job's supervisor could not start it: what it said.
    Supervised(String),
    /// No supervisor could be started (say, under an emulator that cannot execute the
    /// agent's own binary again): the job was not started.
    NoSupervisor(String),
    /// The supervisor was started but did not say the job runs within the hand-off's
    /// timeout, before it made the job's spool: it was stopped, and the job not started.
    SupervisorSlow,
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NothingToRun => f.write_str("the spec names neither a program nor a script"),
            Self::RunDir(e) => write!(f, "cannot prepare the run directory: {e}"),
            Self::Pipe(e) => write!(f, "cannot create the output pipe: {e}"),
            Self::Program { program, error } => write!(f, "cannot start `{program}`: {error}"),
            Self::Handle(e) => write!(f, "cannot read the started process's /proc entry: {e}"),
            Self::Supervised(why) => f.write_str(why),
            Self::NoSupervisor(why) => write!(f, "cannot start a supervisor for the job: {why}"),
            Self::SupervisorSlow => f.write_str("its supervisor did not hand the job over in time"),
        }
    }
}

impl std::error::Error for SpawnError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NothingToRun | Self::Supervised(_) | Self::NoSupervisor(_) | Self::SupervisorSlow => None,
            Self::RunDir(e) | Self::Pipe(e) | Self::Handle(e) | Self::Program { error: e, .. } => Some(e),
        }
    }
}

/// How a job ended, and what its spool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exit {
    /// The exit code, when the process exited.
    pub(crate) code: Option<i32>,
    /// The signal, when a signal ended the process.
    pub(crate) signal: Option<i32>,
    /// Whether output past the log limit was discarded.
    pub(crate) truncated: bool,
    /// Bytes in the spool.
    pub(crate) log_len: u64,
}

/// The spool file and the copy state; lives across cancelled waits.
struct Spool {
    file: File,
    limit: u64,
    written: u64,
    /// `written`, for the agent's loop to read.
    shared: Rc<Cell<u64>>,
    truncated: bool,
    buf: Box<[u8]>,
}

impl Spool {
    /// Keeps the first `n` bytes of the buffer up to the limit and discards the rest.
    fn keep(&mut self, n: usize) {
        let room = self.limit - self.written;
        let take = room.min(n as u64) as usize;
        if take > 0 {
            if self.file.write_all(&self.buf[..take]).is_err() {
                // A full disk cuts the log where it stands: keep the file and the count in
                // step and treat the rest as past the limit.
                let _ = self.file.set_len(self.written);
                self.limit = self.written;
                self.truncated = true;
                return;
            }
            self.written += take as u64;
            self.shared.set(self.written);
        }
        if take < n {
            self.truncated = true;
        }
    }
}

/// A running (or finished) job: the group leader, its output pipe and its spool.
///
/// Dropping a `Job` does not end its group (the leader is still reaped); it does close the
/// read end of the pipe, so a job that writes again dies of SIGPIPE. End it with
/// [`Job::stop`] first.
pub(crate) struct Job {
    child: Child,
    pid: u32,
    handle: ExecutorHandle,
    output: Option<Async<File>>,
    spool: Spool,
    status: Option<ExitStatus>,
    exit: Option<Exit>,
    poll: Duration,
    run_dir: RunDir,
}

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job").field("handle", &self.handle).field("exit", &self.exit).finish_non_exhaustive()
    }
}

impl Job {
    /// Starts `spec` in `run_dir`. `poll` is how often `/proc` is looked at while waiting
    /// for a stopped group to die.
    pub(crate) fn spawn(spec: &ExecutionSpec, run_dir: RunDir, poll: Duration) -> Result<Job, SpawnError> {
        let (program, args): (String, Vec<OsString>) = match (&spec.argv, &spec.script) {
            (Some(argv), None) if !argv.is_empty() => (argv[0].clone(), argv[1..].iter().map(Into::into).collect()),
            (None, Some(script)) => {
                (script.interpreter.program().to_owned(), vec![run_dir.script(script.interpreter).into()])
            }
            _ => return Err(SpawnError::NothingToRun),
        };
        DirBuilder::new().recursive(true).mode(0o700).create(&run_dir.work).map_err(SpawnError::RunDir)?;
        if let Some(script) = &spec.script {
            write_private(&run_dir.script(script.interpreter), script.source.as_bytes()).map_err(SpawnError::RunDir)?;
        }
        let spool = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&run_dir.spool)
            .map_err(SpawnError::RunDir)?;
        // The spool's name is durable before the fork (see the module doc).
        sync_dir(&run_dir.root).map_err(SpawnError::RunDir)?;
        if let Some(runs) = run_dir.root.parent() {
            sync_dir(runs).map_err(SpawnError::RunDir)?;
        }

        let (reader, writer) = pipe_with(PipeFlags::CLOEXEC).map_err(|e| SpawnError::Pipe(e.into()))?;
        let writer_too = writer.try_clone().map_err(SpawnError::Pipe)?;
        // Non-blocking applies to the read end only; the child's end stays blocking.
        let output = Async::new(File::from(reader)).map_err(SpawnError::Pipe)?;

        let mut std_cmd = std::process::Command::new(&program);
        std_cmd.args(&args).current_dir(&run_dir.work).env_clear().process_group(0);
        for name in INHERITED_ENV {
            if let Some(value) = std::env::var_os(name) {
                std_cmd.env(name, value);
            }
        }
        if std::env::var_os("PATH").is_none() {
            std_cmd.env("PATH", DEFAULT_PATH);
        }
        for (name, value) in &spec.env {
            std_cmd.env(name.as_str(), value);
        }
        std_cmd.env(ATTEMPT_VAR, run_dir.attempt.as_str());
        // async-process has no process_group, so it is set on the std Command; converting
        // resets stdio, so stdio is set after the conversion.
        let mut cmd = Command::from(std_cmd);
        cmd.stdin(Stdio::null()).stdout(Stdio::from(writer)).stderr(Stdio::from(writer_too));
        let spawned = cmd.spawn();
        // The command owns the agent's copies of the write end: close them now, so the pipe
        // ends when the job's processes close theirs.
        drop(cmd);
        let child = spawned.map_err(|error| SpawnError::Program { program, error })?;

        let pid = child.id();
        let starttime = match group::read_stat(pid) {
            Ok(stat) => stat.starttime,
            Err(e) => {
                let _ = group::signal_group(pid, Signal::KILL);
                return Err(SpawnError::Handle(e));
            }
        };
        let spool = Spool {
            file: spool,
            limit: spec.log_limit_bytes,
            written: 0,
            shared: Rc::new(Cell::new(0)),
            truncated: false,
            buf: vec![0; COPY_BUFFER].into_boxed_slice(),
        };
        Ok(Job {
            child,
            pid,
            handle: group::executor_handle(pid, starttime),
            output: Some(output),
            spool,
            status: None,
            exit: None,
            poll,
            run_dir,
        })
    }

    /// The group leader's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The job's process group: the leader's pid.
    pub(crate) fn pgid(&self) -> u32 {
        self.pid
    }

    /// `pid:<pid> start:<starttime>`, stable for the job's life; see [`is_alive`].
    pub(crate) fn executor_handle(&self) -> &ExecutorHandle {
        &self.handle
    }

    /// The run's files.
    pub(crate) fn run_dir(&self) -> &RunDir {
        &self.run_dir
    }

    /// The count of bytes in the spool, kept current as output is copied.
    pub(crate) fn spooled(&self) -> Rc<Cell<u64>> {
        self.spool.shared.clone()
    }

    /// Copies output until every writer has closed the pipe, then waits for the leader to
    /// exit, and fsyncs the spool so the log survives a power loss with the exit evidence.
    /// Calling it again returns the same [`Exit`].
    ///
    /// Leftover members of the group that closed their output do not hold this up; use
    /// [`Job::stop`] to end them. Members that keep the output open do, until they exit or
    /// are stopped.
    pub(crate) async fn wait(&mut self) -> io::Result<Exit> {
        if let Some(exit) = self.exit {
            return Ok(exit);
        }
        pump(&mut self.output, &mut self.spool).await?;
        let status = reap(&mut self.child, &mut self.status).await?;
        self.finish(status)
    }

    /// Ends the job's whole process group: TERM, then up to `grace` for the group to die
    /// (output is still copied meanwhile), then KILL; returns once the leader is reaped and
    /// no member of the group is alive. Also cleans up after [`Job::wait`]: leftover members
    /// are ended the same way. Output written by the group before it died is kept; a
    /// process that left the group and still holds the pipe is not waited for.
    pub(crate) async fn stop(&mut self, grace: Duration) -> io::Result<Exit> {
        if self.exit.is_none() || group_alive(self.pid)? {
            group::signal_group(self.pid, Signal::TERM)?;
            if !self.settle(Some(grace)).await? {
                group::signal_group(self.pid, Signal::KILL)?;
                self.settle(None).await?;
            }
            self.drain_now()?;
        }
        let status = reap(&mut self.child, &mut self.status).await?;
        self.finish(status)
    }

    /// Copies output while waiting for the leader to be reaped and the group to be empty.
    /// `Ok(false)` when `deadline` passed first.
    async fn settle(&mut self, deadline: Option<Duration>) -> io::Result<bool> {
        let Self { child, output, spool, status, pid, poll, .. } = self;
        let (pgid, poll) = (*pid, *poll);
        let settled = async {
            reap(child, status).await?;
            group::group_gone(pgid, poll).await?;
            Ok(true)
        };
        let copying = async {
            pump(output, spool).await?;
            future::pending().await
        };
        let work = future::or(settled, copying);
        match deadline {
            Some(grace) => {
                future::or(work, async {
                    Timer::after(grace).await;
                    Ok(false)
                })
                .await
            }
            None => work.await,
        }
    }

    /// Takes what is left in the pipe without waiting, then lets go of it: once the group is
    /// gone, a writer still holding the pipe has left the group and is not the job's.
    fn drain_now(&mut self) -> io::Result<()> {
        if let Some(pipe) = self.output.take() {
            let mut reader: &File = pipe.get_ref();
            loop {
                match reader.read(&mut self.spool.buf) {
                    Ok(0) => break,
                    Ok(n) => self.spool.keep(n),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    fn finish(&mut self, status: ExitStatus) -> io::Result<Exit> {
        if let Some(exit) = self.exit {
            return Ok(exit);
        }
        self.spool.file.sync_data()?;
        let exit = Exit {
            code: status.code(),
            signal: status.signal(),
            truncated: self.spool.truncated,
            log_len: self.spool.written,
        };
        self.exit = Some(exit);
        Ok(exit)
    }
}

/// Why a job runs in the agent itself, though supervisors were asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unsupervised {
    /// No supervisor can start here: later jobs run in the agent too.
    ForGood(String),
    /// This one was too slow (a busy machine): the next job tries a supervisor again.
    ThisOnce(String),
}

/// A job the agent watches: under its supervisor (the rule), or, where no supervisor can
/// be started, run by the agent itself as [`Job`] (it then dies with the agent).
pub(crate) enum Running {
    /// Under its supervisor.
    Supervised(Supervised),
    /// In the agent itself.
    Direct(Job),
}

impl Running {
    /// Starts `spec` under a supervisor given `supervise` (how long it may take to hand the
    /// job over), or in the agent when none could (`Ok` with why not, to be said once).
    pub(crate) fn spawn(
        spec: &ExecutionSpec,
        run_dir: RunDir,
        poll: Duration,
        grace: Duration,
        supervise: Option<Duration>,
    ) -> Result<(Running, Option<Unsupervised>), SpawnError> {
        if let Some(handoff) = supervise {
            let why = match Supervised::spawn(spec, run_dir.clone(), poll, grace, handoff) {
                Ok(job) => return Ok((Self::Supervised(job), None)),
                Err(SpawnError::NoSupervisor(why)) => Unsupervised::ForGood(why),
                Err(e @ SpawnError::SupervisorSlow) => Unsupervised::ThisOnce(e.to_string()),
                Err(e) => return Err(e),
            };
            return Job::spawn(spec, run_dir, poll).map(|job| (Self::Direct(job), Some(why)));
        }
        Job::spawn(spec, run_dir, poll).map(|job| (Self::Direct(job), None))
    }

    /// The job's pid.
    pub(crate) fn pid(&self) -> u32 {
        match self {
            Self::Supervised(j) => j.pid(),
            Self::Direct(j) => j.pid(),
        }
    }

    /// The job's process group.
    pub(crate) fn pgid(&self) -> u32 {
        match self {
            Self::Supervised(j) => j.pgid(),
            Self::Direct(j) => j.pgid(),
        }
    }

    /// The job's handle.
    pub(crate) fn executor_handle(&self) -> &ExecutorHandle {
        match self {
            Self::Supervised(j) => j.executor_handle(),
            Self::Direct(j) => j.executor_handle(),
        }
    }

    /// The spool's length as it grows.
    pub(crate) fn spooled(&self) -> Rc<Cell<u64>> {
        match self {
            Self::Supervised(j) => j.spooled(),
            Self::Direct(j) => j.spooled(),
        }
    }

    /// Waits for the job's end.
    pub(crate) async fn wait(&mut self) -> io::Result<Exit> {
        match self {
            Self::Supervised(j) => j.wait().await,
            Self::Direct(j) => j.wait().await,
        }
    }

    /// Ends the job's group and waits for its end.
    pub(crate) async fn stop(&mut self, grace: Duration) -> io::Result<Exit> {
        match self {
            Self::Supervised(j) => j.stop(grace).await,
            Self::Direct(j) => j.stop(grace).await,
        }
    }
}

/// Gives back the storage of the spool's first `upto` bytes (whole blocks of them), which
/// the server acknowledged; reading them afterwards gives zeros. `Ok(false)` when the file
/// system cannot punch holes (jffs2, ubifs): the spool then keeps them, bounded as always
/// by the log limit.
pub(crate) fn release_spool(spool: &Path, upto: u64) -> io::Result<bool> {
    use rustix::fs::{fallocate, FallocateFlags};
    const BLOCK: u64 = 4096;
    let len = upto / BLOCK * BLOCK;
    if len == 0 {
        return Ok(true);
    }
    let file = OpenOptions::new().write(true).open(spool)?;
    match fallocate(&file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, 0, len) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Copies the pipe into the spool until end of file. Safe to drop at its await point: a
/// read either returned bytes, which are written before the next await, or did not happen.
async fn pump(output: &mut Option<Async<File>>, spool: &mut Spool) -> io::Result<()> {
    while let Some(pipe) = output {
        match pipe.read(&mut spool.buf).await {
            Ok(0) => *output = None,
            Ok(n) => spool.keep(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Waits for the leader's exit status, once.
async fn reap(child: &mut Child, status: &mut Option<ExitStatus>) -> io::Result<ExitStatus> {
    if let Some(s) = status {
        return Ok(*s);
    }
    let s = child.status().await?;
    *status = Some(s);
    Ok(s)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.write_all(bytes)
}

#[cfg(test)]
mod tests;
