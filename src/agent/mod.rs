//! The shell: the one loop that performs what [`crate::core`] decides.
//!
//! Everything runs on one thread, in one `smol` `LocalExecutor`: the main loop below and
//! one small supervision task per running process (it copies the process's output into
//! its spool, and on request stops its group). HTTP calls are blocking `ureq` calls made
//! by the main loop itself, one at a time over the client's one connection; while a call
//! is in flight nothing else runs, so long-polls are kept short while jobs run
//! (`busy_poll_wait_ms`) and never outlast the next renewal.
//!
//! Each turn of the loop:
//!
//! 1. takes the ends of processes and SIGTERM/SIGINT, without waiting;
//! 2. makes sure there is a session (resuming the journal's with a heartbeat, else opening a
//!    new one), unless draining;
//! 3. heartbeats when no heartbeat or poll answer came for an interval (announcing a
//!    drain at once), before the jobs' steps unless the last heartbeat failed;
//! 4. asks the core for each job's next step and performs it;
//! 5. long-polls for offers when capacity is free and the agent is not draining: a poll
//!    keeps the session alive, so an idle agent sends one long-poll after another;
//! 6. otherwise waits, racing a timer for the next due time against process ends and
//!    signals.
//!
//! **Persist, then act.** Every fact is committed to the journal (fsynced) before the
//! command that depends on it: the offer and a fresh lease token before the claim, the
//! callback token before `running`, the exit evidence before the last chunks and the seal,
//! each acknowledged log offset before the next chunk, the receipt before the completion.
//! An answer is committed before the next command uses it.
//!
//! The session's calls are in [`session`], each job's steps in [`job`], the certificate's
//! renewal in [`renew`].
//!
//! **The live log** ([`live_log`]): while a job runs and after, its spool goes out in
//! chunks from the journal's acknowledged offset; each chunk is a turn of its own, so
//! renewals, heartbeats and other jobs' steps go between chunks however long the log.
//!
//! **Lost answers.** A call that fails in transport, or with 503, blocks every call for a
//! backoff (capped doubling with jitter, at least the server's `Retry-After`); the next turn
//! asks the core again, which rebuilds the same request from the journal. `already_*`
//! answers count as success. A 404 or 409 on a job's command ends the job: its process group
//! is stopped, it is dropped from the journal, and one line says why.
//!
//! **Drain.** The first SIGTERM (or SIGINT) sends a `draining` heartbeat and stops polling;
//! running jobs get `drain_timeout_ms`, then they are stopped (TERM, grace, KILL) and
//! completed, and the agent exits 0. Whatever cannot be reported within one more
//! `drain_timeout_ms` (the server is down, say) stays in the journal for the next start. A
//! second signal stops the jobs at once.
//!
//! **Restart.** Jobs in the journal continue from their step. A process that was running
//! when the agent died is taken back while its supervisor runs (its log streams on, its
//! true exit is reported); one that ended meanwhile is reported with the exit its
//! supervisor kept. With neither (the machine went down, or the supervisor alone was
//! killed, also under a running agent) what is left is stopped and the attempt given up
//! as lost (`abandon`): its log is what was acknowledged before. What cannot be stopped
//! keeps the attempt: the recovery is tried again after a back-off, the lease renewed
//! meanwhile, since a run given up while its job still runs would run twice; once the
//! back-off would pass `backoff_max_ms` the job is reported without an exit status. So
//! is a job whose stop the agent asked for and could not make, or whose supervisor was
//! lost while the agent was stopping it. A process the old agent set out to start (`spawning`) but did not
//! record is looked for by the attempt id in its environment and recovered the same way;
//! if none is found and its run directory was never made, it is started; otherwise it is
//! reported as a start failure, never started twice. A renewal may have been in flight when
//! the agent died, so a resumed job's lease version is in doubt: a `lease_conflict` earns
//! one repeat with the next version.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_signal::{Signal, Signals};
use smol::channel::{self, Receiver, Sender};
use smol::stream::StreamExt;
use smol::{future, LocalExecutor, Timer};

use ql_notify::Notify;
use ql_wire::ids::{Counter, SessionId};
use ql_wire::route::{AttemptCommand, AttemptPath, Route};
use ql_wire::time::Timestamp;
use ql_wire::ErrorCode;

mod job;
mod live_log;
mod renew;
mod session;

use std::cell::Cell;

use crate::client::{CallError, Client};
use crate::config::Config;
use crate::core::{self, Disposition, Ending, Process, Runtime, ServerClock};
use crate::exec::{self, RunDir};
use crate::journal::{CommitError, Job, JobKey, Journal, JournalState, Record};

/// Why the agent cannot go on: the journal cannot be written, or the OS refused something
/// the agent cannot work without.
#[derive(Debug)]
pub(crate) struct Fatal(pub(crate) String);

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A process's end, reported by its supervision task.
struct Ended {
    key: JobKey,
    result: io::Result<exec::Exit>,
    finished_at: Timestamp,
}

/// The session the agent speaks for, as far as it knows.
struct Live {
    id: SessionId,
    generation: Counter,
    heartbeat: Duration,
    /// When the last heartbeat that succeeded was sent, or the last poll answered.
    contact: Instant,
    /// Whether the server was told the session drains.
    told_draining: bool,
    /// Whether the last heartbeat failed: then the jobs' steps go first next time, since
    /// their answers may say more (a revoked certificate stops a job through its renewal).
    beat_failed: bool,
}

/// The shared call backoff: one server, one connection, so one failure blocks every call.
#[derive(Default)]
struct Net {
    failures: u32,
    until: Option<Instant>,
}

/// What a performed step did to the turn.
enum Turn {
    /// Something changed: ask again.
    Moved,
    /// Nothing to do before this instant (`None`: until something happens).
    Idle(Option<Instant>),
    /// A call failed: no more calls this turn.
    Blocked,
    /// Something changed, and the job's next step waits for the next turn, so that a
    /// heartbeat and the other jobs' steps can go first (a long log streams chunk by chunk).
    Yield,
}

/// The exit status of a handover (EX_TEMPFAIL): the service manager starts the agent again.
pub(crate) const HANDOVER_EXIT: i32 = 75;

/// The running agent.
pub(crate) struct Agent {
    /// The service manager's notification channel (systemd `Type=notify`), if any.
    notify: Notify,
    cfg: Config,
    client: Client,
    journal: Journal,
    state: JournalState,
    rts: BTreeMap<JobKey, Runtime>,
    stops: BTreeMap<JobKey, Sender<()>>,
    /// Each supervised process's spool length, as its supervision task counts it.
    spooled: BTreeMap<JobKey, Rc<Cell<u64>>>,
    ended_tx: Sender<Ended>,
    ended_rx: Receiver<Ended>,
    ex: Rc<LocalExecutor<'static>>,
    /// Whether jobs start under a supervisor; off once one could not be started.
    supervise_jobs: bool,
    session: Option<Live>,
    resume_tried: bool,
    net: Net,
    drain_by: Option<Instant>,
    give_up_at: Option<Instant>,
    /// The drain is a reload's that could not hand its jobs over: it ends with the
    /// handover's exit status, so the service manager starts the agent again.
    reload_drain: bool,
    signals: Signals,
    random: u64,
    /// When the client certificate is due for renewal.
    renewal: renew::Renewal,
}

/// Opens the journal, waiting up to `lock_wait_ms` for another agent on the same state
/// directory to exit: a restart (procd's, an upgrade's) may start the new agent while the
/// old one still drains, and giving up at once would leave none running.
fn open_journal(cfg: &Config) -> Result<(Journal, JournalState), Fatal> {
    let deadline = Instant::now() + cfg.lock_wait;
    let mut said = false;
    loop {
        match Journal::open(&cfg.state_dir) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                if !said {
                    info!("{e}; waiting up to {} ms for it to exit", cfg.lock_wait.as_millis());
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(200).min(cfg.lock_wait));
            }
            Err(e) => return Err(Fatal(format!("cannot open the journal in {}: {e}", cfg.state_dir.display()))),
            Ok(opened) => {
                if said {
                    info!("the other agent is gone; going on");
                }
                return Ok(opened);
            }
        }
    }
}

/// The journal's facts of how a process ended, finished at `finished_at`.
fn ending_of(exit: &exec::Exit, finished_at: Timestamp) -> Ending {
    Ending { exit_code: exit.code, signal: exit.signal, finished_at, log_len: exit.log_len, truncated: exit.truncated }
}

fn wall_now() -> Timestamp {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    let ms = i64::try_from(ms).unwrap_or(0).saturating_add(crate::fault::clock_skew_ms());
    Timestamp::from_millis(ms).unwrap_or_else(|_| Timestamp::from_millis(0).expect("epoch"))
}

fn who(key: &JobKey, job: &Job) -> String {
    format!("run {} attempt {}", job.run_id, key.attempt_id)
}

fn attempt_route(cfg: &Config, key: &JobKey, job: &Job, cmd: AttemptCommand) -> Route {
    Route::Attempt(attempt_path(cfg, key, job), cmd)
}

fn attempt_path(cfg: &Config, key: &JobKey, job: &Job) -> AttemptPath {
    AttemptPath {
        worker: cfg.worker_id.clone(),
        session: key.session_id.clone(),
        run: job.run_id.clone(),
        attempt: key.attempt_id.clone(),
    }
}

/// The log as it is read for an upload; counts the bytes for the `upload-body` fault point.
///
/// The agent does not hash the log itself: TLS 1.3 authenticates every byte between it and
/// the server, the server hashes what it stores, and on a MIPS router a 64 MiB log would
/// cost seconds of CPU to hash again for a check that could only catch a server bug.
struct Counted<R>(R);

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(buf)?;
        crate::fault::count("upload-body", n as u64);
        Ok(n)
    }
}

impl Agent {
    /// Opens the journal and sets up signal handling; no network yet.
    pub(crate) fn new(cfg: Config, client: Client, ex: Rc<LocalExecutor<'static>>) -> Result<Agent, Fatal> {
        let (journal, state) = open_journal(&cfg)?;
        let recovery = journal.recovery();
        if recovery.dropped_bytes > 0 || recovery.refused > 0 {
            warn!(
                "journal recovered {} records; cut {} bytes of torn tail; ignored {} refused records",
                recovery.records, recovery.dropped_bytes, recovery.refused
            );
        }
        let signals = Signals::new([Signal::Term, Signal::Int, Signal::Hup])
            .map_err(|e| Fatal(format!("cannot install the SIGTERM handler: {e}")))?;
        if let Some(marker) = &cfg.reload_marker {
            // A marker left by a reload that restarted nothing, or by a crash, is not this
            // agent's to honour.
            let _ = std::fs::remove_file(marker);
        }
        let named = |attempt: &str| state.jobs.keys().any(|k| k.attempt_id.as_str() == attempt);
        match crate::exec::remove_strays(&cfg.state_dir, named) {
            Ok(0) => {}
            Ok(n) => info!("removed {n} run director(ies) of jobs already dropped (a crash left them)"),
            Err(e) => warn!("could not remove the run directories of jobs already dropped: {e}"),
        }
        let (ended_tx, ended_rx) = channel::unbounded();
        let rts = state.jobs.keys().map(|k| (k.clone(), Runtime::resumed())).collect();
        // Seeded from the OS's per-process hash keys: enough to spread retries of many
        // agents apart, with no extra dependency.
        let random = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        };
        // systemd's Type=notify: READY, WATCHDOG and STOPPING; inert without NOTIFY_SOCKET.
        let (notify, notify_error) = Notify::from_env(Instant::now());
        if let Some(e) = notify_error {
            warn!("{e}; not notifying the service manager");
        }
        let cfg_cert = cfg.cert.clone();
        Ok(Agent {
            notify,
            cfg,
            client,
            journal,
            state,
            rts,
            stops: BTreeMap::new(),
            spooled: BTreeMap::new(),
            ended_tx,
            ended_rx,
            ex,
            supervise_jobs: true,
            session: None,
            resume_tried: false,
            net: Net::default(),
            drain_by: None,
            give_up_at: None,
            reload_drain: false,
            signals,
            random,
            renewal: renew::Renewal::of(&std::fs::read(&cfg_cert).unwrap_or_default()),
        })
    }

    /// Runs until drained. `Err` only when the agent cannot go on safely.
    pub(crate) async fn run(mut self) -> Result<(), Fatal> {
        info!(
            "ql-agent {} starting: worker {}, server {}, capacity {}, {} job(s) in the journal",
            env!("CARGO_PKG_VERSION"),
            self.cfg.worker_id,
            self.cfg.server,
            self.cfg.capacity,
            self.state.jobs.len()
        );
        for (key, job) in &self.state.jobs {
            info!("{}: resuming from the journal", who(key, job));
        }
        let status = format!("worker {} for {}", self.cfg.worker_id, self.cfg.server);
        self.notify.ready(&status, Instant::now());
        loop {
            // Let the supervision tasks copy output that piled up during a blocking call.
            future::yield_now().await;
            self.take_signals().await;
            while let Ok(ended) = self.ended_rx.try_recv() {
                self.on_ended(ended)?;
            }
            let now = Instant::now();
            self.notify.tick(now);
            if self.drain_by.is_some() {
                if self.state.jobs.is_empty() {
                    self.close_session()?;
                    info!("drained; exiting");
                    return self.drained();
                }
                if self.give_up_at.is_some_and(|g| now >= g) && self.stops.is_empty() {
                    warn!(
                        "drain: {} job(s) could not be reported in time; the journal keeps them for the next start",
                        self.state.jobs.len()
                    );
                    return self.drained();
                }
            }
            let blocked = self.net.until.is_some_and(|u| now < u);
            if !blocked && self.drain_by.is_none() && self.session.is_none() {
                self.establish_session(now).await?;
                continue;
            }
            if !blocked && self.renewal_due(now) {
                self.renew_certificate(now);
                continue;
            }
            // Before the jobs' steps: a job whose call keeps failing (a seal the server is
            // slow to compose, say) must not keep the session from its heartbeat.
            if !blocked && self.heartbeat_due(now) && self.session.as_ref().is_some_and(|l| !l.beat_failed) {
                self.heartbeat(now).await;
                continue;
            }
            let (moved, due) = self.work(blocked).await?;
            if moved {
                // A heartbeat that is due goes out even while jobs keep moving: a long log
                // streams for minutes, and the session must not lapse meanwhile.
                let t = Instant::now();
                if self.heartbeat_due(t) && self.net.until.is_none_or(|u| t >= u) {
                    self.heartbeat(t).await;
                }
                continue;
            }
            let blocked = self.net.until.is_some_and(|u| now < u);
            let mut due = earliest(due, self.net.until.filter(|_| blocked));
            due = earliest(due, self.give_up_at);
            due = earliest(due, self.notify.watchdog_due());
            if blocked || self.session.is_none() {
                self.idle(due).await?;
                continue;
            }
            let live = self.session.as_ref().expect("checked above");
            let heartbeat_at = live.contact + live.heartbeat;
            if now >= heartbeat_at || (self.drain_by.is_some() && !live.told_draining) {
                self.heartbeat(now).await;
                continue;
            }
            // A poll keeps the session alive for its whole wait and counts as contact
            // once answered, so its wait is not cut at the next heartbeat: an idle agent
            // sends one long-poll after another and no heartbeat between them.
            let free = (self.cfg.capacity as usize).saturating_sub(self.state.jobs.len());
            if free > 0 && self.drain_by.is_none() {
                self.poll(now, free as u32, due).await?;
                continue;
            }
            self.idle(earliest(due, Some(heartbeat_at))).await?;
        }
    }

    /// The server's clock as the `Date` of its last answer showed it.
    fn server_clock(&self) -> Option<ServerClock> {
        self.client.server_date().map(|(at, date)| ServerClock { at, ms: date.millis() })
    }

    /// Commits one record; a journal that cannot be written stops the agent, since acting
    /// on facts that are not durable would break every promise of the protocol.
    fn commit(&mut self, record: &Record) -> Result<(), Fatal> {
        match self.journal.commit(&mut self.state, record) {
            Ok(()) => {
                crate::fault::journaled(record);
                Ok(())
            }
            Err(CommitError::Compaction(e)) => {
                warn!("journal compaction failed (the record is kept; will retry): {e}");
                Ok(())
            }
            Err(e) => Err(Fatal(e.to_string())),
        }
    }

    // ---- signals and process ends ----

    async fn take_signals(&mut self) {
        loop {
            let mut signals = &self.signals;
            match future::poll_once(signals.next()).await {
                Some(signal @ Some(_)) => self.on_any_signal(signal),
                _ => return,
            }
        }
    }

    /// SIGHUP hands the jobs over, and so does a SIGTERM that finds the reload marker;
    /// any other signal asks for a drain.
    fn on_any_signal(&mut self, signal: Option<std::io::Result<Signal>>) {
        match signal {
            Some(Ok(Signal::Hup)) => self.hand_over("SIGHUP"),
            _ if self.reload_marked() => self.hand_over("SIGTERM for a reload"),
            // A stop: whatever drain runs ends as a stop's, not to be started again.
            _ => {
                self.reload_drain = false;
                self.on_signal();
            }
        }
    }

    /// Whether the service manager marked this SIGTERM as a reload's (the marker is
    /// consumed).
    fn reload_marked(&self) -> bool {
        self.cfg.reload_marker.as_ref().is_some_and(|m| std::fs::remove_file(m).is_ok())
    }

    /// Exits at once, leaving every running job to its supervisor: the journal holds all
    /// the next agent needs to take them back, and the session is left open for it to
    /// resume. Exit status 75 ("try again") has procd and systemd (`Restart=on-failure`)
    /// start it again. Jobs that run in the agent itself (no supervisor could be started,
    /// for good or this once) would end with it: then this is an ordinary drain.
    fn hand_over(&mut self, why: &str) {
        if !core::may_hand_over(self.supervise_jobs, self.rts.values()) {
            if self.drain_by.is_some() {
                // A repeated reload (two settings committed in a row) changes nothing: it
                // neither stops the job the drain waits for nor turns a stop into a reload.
                info!("{why}: already draining");
                return;
            }
            warn!("{why}: a job runs in the agent itself, so it drains instead of handing the jobs over");
            self.reload_drain = true;
            return self.on_signal();
        }
        info!(
            "{why}: exiting at once; {} running job(s) stay with their supervisors for the next start",
            self.state.jobs.len()
        );
        self.notify.stopping("handing the running jobs over to the next start", None);
        std::process::exit(HANDOVER_EXIT);
    }

    /// The end of a drain: a stop's exits 0; a reload's (one that drained because it could
    /// not hand its jobs over) exits as a handover does, so that the service manager,
    /// which restarts on failure, starts the agent again.
    fn drained(&self) -> Result<(), Fatal> {
        if self.reload_drain {
            info!("the drain was a reload's: exiting with status {HANDOVER_EXIT} to be started again");
            std::process::exit(HANDOVER_EXIT);
        }
        Ok(())
    }

    fn on_signal(&mut self) {
        let now = Instant::now();
        if self.drain_by.is_none() {
            let by = now + self.cfg.drain_timeout;
            self.drain_by = Some(by);
            self.give_up_at = Some(by + self.cfg.drain_timeout.max(self.cfg.call_timeout));
            let need = (by + self.cfg.drain_timeout.max(self.cfg.call_timeout) + self.cfg.call_timeout)
                .saturating_duration_since(now);
            self.notify.stopping(&format!("draining {} job(s)", self.state.jobs.len()), Some(need));
            info!(
                "shutdown requested: draining; {} job(s) get {} ms to finish",
                self.state.jobs.len(),
                self.cfg.drain_timeout.as_millis()
            );
        } else {
            info!("second shutdown signal: stopping jobs now");
            self.drain_by = Some(now);
            self.give_up_at = Some(now + self.cfg.call_timeout);
        }
    }

    fn on_ended(&mut self, ended: Ended) -> Result<(), Fatal> {
        let Ended { key, result, finished_at } = ended;
        let finished_at = core::evidence_time(finished_at, self.server_clock(), Instant::now());
        self.stops.remove(&key);
        let stopping = self.rts.get(&key).is_some_and(|rt| rt.process == Process::Stopping);
        if let Some(rt) = self.rts.get_mut(&key) {
            rt.process = Process::Absent;
        }
        let Some(job) = self.state.jobs.get(&key) else { return Ok(()) };
        if job.exit.is_some() {
            return Ok(());
        }
        let who = who(&key, job);
        let ending = match result {
            Ok(exit) => ending_of(&exit, finished_at),
            // A stop the agent asked for (a timeout, the server's intent, a drain) failed:
            // its end is reported without a status, which the server settles from why it
            // was stopped; giving it up would run it again while it may still run.
            Err(e) if stopping => {
                warn!("{who}: could not stop the process ({e}); reporting it without an exit status");
                let (log_len, truncated) = self.spool_facts(&key, job);
                Ending { exit_code: None, signal: None, finished_at, log_len, truncated }
            }
            Err(e) => {
                // Nobody knows how it ended (its supervisor was killed, say): not the job's
                // failure. With no exit on record the job's next step is the recovery a
                // restarted agent makes of it (`core::Step::Recover`), which reports it
                // lost and lets its run go again within its retries.
                warn!("{who}: lost track of the process ({e}); it will be reported lost");
                return Ok(());
            }
        };
        info!(
            "{who}: process ended ({}); log {} bytes{}",
            match (ending.exit_code, ending.signal) {
                (Some(code), _) => format!("exit code {code}"),
                (None, Some(signal)) => format!("signal {signal}"),
                (None, None) => "no status".to_owned(),
            },
            ending.log_len,
            if ending.truncated { ", truncated" } else { "" }
        );
        self.commit(&core::exited(&key, ending))
    }

    /// What the spool holds when the supervision that counted it is gone: its length, and
    /// whether that reached the limit (then the output was most likely cut).
    fn spool_facts(&self, key: &JobKey, job: &Job) -> (u64, bool) {
        let spool = RunDir::new(&self.cfg.state_dir, &key.attempt_id).spool;
        let len = std::fs::metadata(spool).map(|m| m.len()).unwrap_or(0);
        let limit = job.lease.as_ref().map_or(0, |l| l.spec.log_limit_bytes);
        (len.min(limit), limit > 0 && len >= limit)
    }

    // ---- waiting ----

    async fn idle(&mut self, until: Option<Instant>) -> Result<(), Fatal> {
        enum Woke {
            Time,
            Ended(Ended),
            Signal(Option<std::io::Result<Signal>>),
        }
        let woke = {
            let timer = async {
                match until {
                    Some(t) => {
                        Timer::at(t).await;
                    }
                    None => future::pending::<()>().await,
                }
                Woke::Time
            };
            let ended = async {
                match self.ended_rx.recv().await {
                    Ok(e) => Woke::Ended(e),
                    Err(_) => future::pending().await,
                }
            };
            let signal = async {
                let mut signals = &self.signals;
                Woke::Signal(signals.next().await)
            };
            future::or(timer, future::or(ended, signal)).await
        };
        match woke {
            Woke::Time => Ok(()),
            Woke::Ended(e) => self.on_ended(e),
            Woke::Signal(signal) => {
                self.on_any_signal(signal);
                Ok(())
            }
        }
    }

    // ---- network bookkeeping ----

    fn call_ok(&mut self) {
        self.net = Net::default();
    }

    /// A new number for a back-off's spread (xorshift).
    fn draw(&mut self) -> u64 {
        self.random ^= self.random << 13;
        self.random ^= self.random >> 7;
        self.random ^= self.random << 17;
        self.random
    }

    fn block(&mut self, retry_after: Option<Duration>) {
        self.net.failures = self.net.failures.saturating_add(1);
        // A new spread for every wait.
        self.draw();
        // While a job holds a lease, never wait longer than a sixth of it, whatever a
        // Retry-After asks: after an outage of the control plane, the lease the server
        // gives back must see a renewal in time.
        let shortest_lease = self.state.jobs.values().filter_map(|j| j.lease.as_ref()).map(|l| l.ttl_ms).min();
        let max = core::backoff_cap(self.cfg.backoff_max, shortest_lease);
        let retry_after = core::honoured_retry_after(retry_after, shortest_lease.map(|_| max));
        let wait = core::backoff(self.cfg.backoff_initial, max, self.net.failures, self.random, retry_after);
        debug!("calls paused for {} ms after {} failure(s)", wait.as_millis(), self.net.failures);
        self.net.until = Some(Instant::now() + wait);
    }

    /// Handles a failed session-level call. Returns the code when the session is gone.
    fn session_call_failed(&mut self, what: &str, err: &CallError) -> Option<ErrorCode> {
        match err {
            CallError::Refused { code: code @ (ErrorCode::SessionConflict | ErrorCode::NotFound), .. } => Some(*code),
            CallError::Refused { code, retry_after, .. } => {
                if core::disposition(*code) == Disposition::Retry {
                    warn!("{what}: {err}; will repeat");
                } else if matches!(code, ErrorCode::CertificateRevoked | ErrorCode::WorkerDisabled) {
                    error!(
                        "{what}: {err}: the operator revoked this certificate or disabled worker {}; \
                         nothing runs here until it is enrolled again or enabled",
                        self.cfg.worker_id
                    );
                } else {
                    error!(
                        "{what}: {err}; check the configuration and the certificate (worker {})",
                        self.cfg.worker_id
                    );
                }
                self.block(*retry_after);
                None
            }
            CallError::Transport(_) | CallError::Protocol(_) => {
                warn!("{what}: {err}; will repeat");
                self.block(None);
                None
            }
        }
    }
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
