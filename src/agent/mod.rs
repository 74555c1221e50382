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
//! when the agent died is found by its executor handle: still alive, it is stopped (its
//! output pipe died with the old agent) and recorded as killed; gone, it is recorded with
//! no exit status (and members it left behind are stopped). Either way its log is uploaded
//! and it is completed. A process the old agent set out to start (`spawning`) but did not
//! record is looked for by the attempt id in its environment and recovered the same way;
//! if none is found and its run directory was never made, it is started; otherwise it is
//! reported as a start failure, never started twice. A renewal may have been in flight when
//! the agent died, so a resumed job's lease version is in doubt: a `lease_conflict` earns
//! one repeat with the next version.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_signal::{Signal, Signals};
use smol::channel::{self, Receiver, Sender};
use smol::stream::StreamExt;
use smol::{future, LocalExecutor, Timer};

use ql_notify::Notify;
use ql_wire::ack::AckReply;
use ql_wire::capability::Token;
use ql_wire::completion::CompletionReply;
use ql_wire::ids::{Counter, SessionId};
use ql_wire::lease::Renewed;
use ql_wire::offer::{Claimed, Offers, PollOffers};
use ql_wire::route::{AttemptCommand, AttemptPath, Route};
use ql_wire::session::{CloseSession, Heartbeat, HeartbeatReply, OpenSession, SessionClosed, SessionOpened};
use ql_wire::text::{AgentVersion, Arch, Reason};
use ql_wire::time::Timestamp;
use ql_wire::{ErrorCode, Fence, Outcome};

mod live_log;
mod renew;

use std::cell::Cell;

use crate::client::{CallError, Client};
use crate::config::Config;
use crate::core::{
    self, Disposition, Ending, LogPolicy, Now, Process, RenewDoubt, Runtime, ServerClock, Step, StopCause,
};
use crate::exec::{self, RunDir};
use crate::journal::{CommitError, CurrentSession, Job, JobKey, Journal, JournalState, Record};

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
                    return Ok(());
                }
                if self.give_up_at.is_some_and(|g| now >= g) && self.stops.is_empty() {
                    warn!(
                        "drain: {} job(s) could not be reported in time; the journal keeps them for the next start",
                        self.state.jobs.len()
                    );
                    return Ok(());
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
            _ => self.on_signal(),
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
    /// start it again. Jobs that run in the agent itself (no supervisor could be started)
    /// would end with it: then this is an ordinary drain.
    fn hand_over(&mut self, why: &str) {
        if !self.supervise_jobs {
            warn!("{why}: jobs run in the agent itself here, so it drains instead of handing them over");
            return self.on_signal();
        }
        info!(
            "{why}: exiting at once; {} running job(s) stay with their supervisors for the next start",
            self.state.jobs.len()
        );
        self.notify.stopping("handing the running jobs over to the next start", None);
        std::process::exit(HANDOVER_EXIT);
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
            Err(e) => {
                warn!("{who}: lost track of the process ({e}); reporting it without an exit status");
                let (log_len, truncated) = self.spool_facts(&key, job);
                Ending { exit_code: None, signal: None, finished_at, log_len, truncated }
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

    fn block(&mut self, retry_after: Option<Duration>) {
        self.net.failures = self.net.failures.saturating_add(1);
        // xorshift: a new spread for every wait.
        self.random ^= self.random << 13;
        self.random ^= self.random >> 7;
        self.random ^= self.random << 17;
        // While a job holds a lease, never wait longer than a sixth of it: after an outage
        // of the control plane, the lease the server gives back must see a renewal in
        // time.
        let shortest_lease = self.state.jobs.values().filter_map(|j| j.lease.as_ref()).map(|l| l.ttl_ms).min();
        let max = core::backoff_cap(self.cfg.backoff_max, shortest_lease);
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

    // ---- session ----

    async fn establish_session(&mut self, now: Instant) -> Result<(), Fatal> {
        if !self.resume_tried {
            if let Some(CurrentSession { session_id, generation, heartbeat_ms }) = self.state.session.clone() {
                let route = Route::Heartbeat(self.cfg.worker_id.clone(), session_id.clone());
                let body = Heartbeat { generation, draining: false };
                match self.client.call::<Heartbeat, HeartbeatReply>(&route, &body) {
                    Ok(_) => {
                        self.call_ok();
                        self.resume_tried = true;
                        info!("session {session_id} generation {generation} resumed");
                        self.session = Some(Live {
                            id: session_id,
                            generation,
                            heartbeat: Duration::from_millis(heartbeat_ms),
                            contact: now,
                            told_draining: false,
                            beat_failed: false,
                        });
                        return Ok(());
                    }
                    Err(e) => match self.session_call_failed("resuming the session", &e) {
                        Some(code) => {
                            self.resume_tried = true;
                            info!("session {session_id} cannot be resumed ({code}); opening a new one");
                        }
                        None => return Ok(()),
                    },
                }
            } else {
                self.resume_tried = true;
            }
        }
        let body = OpenSession {
            agent_version: AgentVersion::parse(env!("CARGO_PKG_VERSION")).expect("a short printable version"),
            arch: Arch::parse(std::env::consts::ARCH).expect("a short printable arch"),
            labels: self.cfg.labels.clone(),
            capacity: self.cfg.capacity,
        };
        match self.client.call::<OpenSession, SessionOpened>(&Route::OpenSession(self.cfg.worker_id.clone()), &body) {
            Ok(opened) => {
                self.call_ok();
                self.commit(&Record::Session {
                    session_id: opened.session_id.clone(),
                    generation: opened.generation,
                    heartbeat_ms: opened.heartbeat_ms,
                })?;
                info!(
                    "session {} generation {} opened (heartbeat {} ms)",
                    opened.session_id, opened.generation, opened.heartbeat_ms
                );
                self.notify.status(&format!("session {} open as {}", opened.session_id, self.cfg.worker_id));
                // A zero interval would spin; the server's TTL leaves room for a second.
                let heartbeat = Duration::from_millis(opened.heartbeat_ms.max(100));
                self.session = Some(Live {
                    id: opened.session_id,
                    generation: opened.generation,
                    heartbeat,
                    // Heard from at once, by a poll or else a heartbeat now: the server lets
                    // a repeated open replace a session never heard from (a lost answer's).
                    contact: now.checked_sub(heartbeat).unwrap_or(now),
                    told_draining: false,
                    beat_failed: false,
                });
            }
            Err(e) => match self.session_call_failed("opening a session", &e) {
                Some(ErrorCode::SessionConflict) => {
                    // The server keeps a session that still speaks: another agent holds
                    // this identity. Wait (growing, capped, jittered) rather than fight it.
                    self.block(None);
                    error!(
                        "another agent with worker id {} holds its session (a second ql-agent with this \
                         certificate: a restored backup, or a replaced device still running?); \
                         this one runs nothing and tries again in {} ms",
                        self.cfg.worker_id,
                        self.net.until.map_or(0, |u| u.saturating_duration_since(Instant::now()).as_millis())
                    );
                }
                Some(code) => {
                    // Only a broken server answers an open with this; pace the repeats.
                    warn!("opening a session: {code}; will repeat");
                    self.block(None);
                }
                None => {}
            },
        }
        Ok(())
    }

    /// Ends the session for good on a clean exit (nothing left to report), so the next
    /// start opens a fresh one at once. Best effort: without an answer, the next start
    /// finds out by itself.
    fn close_session(&mut self) -> Result<(), Fatal> {
        let Some(live) = self.session.take() else { return Ok(()) };
        let route = Route::CloseSession(self.cfg.worker_id.clone(), live.id.clone());
        let body = CloseSession { generation: live.generation };
        match self.client.call::<CloseSession, SessionClosed>(&route, &body) {
            Ok(_) => info!("session {} closed", live.id),
            // Replaced or lapsed already, or a server without `close`: gone either way.
            Err(CallError::Refused { code: ErrorCode::SessionConflict | ErrorCode::NotFound, .. }) => {
                info!("session {} had already ended", live.id);
            }
            Err(e) => {
                warn!("closing session {}: {e}; the next start finds out for itself", live.id);
                return Ok(());
            }
        }
        self.commit(&Record::SessionClosed { session_id: live.id })
    }

    /// Whether the session has had no contact for a heartbeat interval.
    fn heartbeat_due(&self, now: Instant) -> bool {
        self.session.as_ref().is_some_and(|l| now >= l.contact + l.heartbeat)
    }

    async fn heartbeat(&mut self, now: Instant) {
        let live = self.session.as_ref().expect("a session");
        let draining = self.drain_by.is_some();
        let route = Route::Heartbeat(self.cfg.worker_id.clone(), live.id.clone());
        let body = Heartbeat { generation: live.generation, draining };
        match self.client.call::<Heartbeat, HeartbeatReply>(&route, &body) {
            Ok(reply) => {
                self.call_ok();
                debug!("heartbeat: {}", reply.status.as_str());
                let live = self.session.as_mut().expect("a session");
                live.contact = now;
                live.beat_failed = false;
                if draining && !live.told_draining {
                    live.told_draining = true;
                    info!("session {} is draining: no new work", live.id);
                }
            }
            Err(e) => {
                if let Some(live) = self.session.as_mut() {
                    live.beat_failed = true;
                }
                if let Some(code) = self.session_call_failed("heartbeat", &e) {
                    let id = self.session.take().map(|l| l.id.to_string()).unwrap_or_default();
                    if draining {
                        info!("session {id} ended ({code}) while draining");
                    } else {
                        warn!("session {id} ended ({code}); opening a new one");
                    }
                }
            }
        }
    }

    async fn poll(&mut self, now: Instant, free: u32, due: Option<Instant>) -> Result<(), Fatal> {
        let live = self.session.as_ref().expect("a session");
        let mut wait = if self.state.jobs.is_empty() { self.cfg.poll_wait } else { self.cfg.busy_poll_wait };
        if let Some(due) = due {
            wait = wait.min(due.saturating_duration_since(now));
        }
        let route = Route::PollOffers(self.cfg.worker_id.clone(), live.id.clone());
        let session_id = live.id.clone();
        let generation = live.generation;
        let body = PollOffers { generation, wait_ms: wait.as_millis() as u64, max: free };
        debug!("polling for up to {free} offer(s), waiting up to {} ms", body.wait_ms);
        match self.client.poll::<PollOffers, Offers>(&route, &body, wait) {
            Ok(offers) => {
                self.call_ok();
                // The server held the session alive until the answer, and a TTL after it.
                if let Some(live) = self.session.as_mut() {
                    live.contact = Instant::now();
                }
                for offer in offers.offers {
                    let key = JobKey { session_id: session_id.clone(), attempt_id: offer.attempt_id.clone() };
                    // The server repeats open offers it made before: one journal entry each.
                    if self.state.jobs.contains_key(&key) {
                        continue;
                    }
                    if self.drain_by.is_some() || self.state.jobs.len() >= self.cfg.capacity as usize {
                        break;
                    }
                    let token = Token::generate().map_err(|e| Fatal(format!("the OS random source failed: {e}")))?;
                    self.commit(&Record::Offered {
                        session_id: session_id.clone(),
                        session_generation: generation,
                        offer_id: offer.offer_id,
                        run_id: offer.run_id.clone(),
                        attempt_id: offer.attempt_id.clone(),
                        lease_token: token,
                    })?;
                    self.rts.insert(key, Runtime::default());
                    info!("run {} attempt {}: offered", offer.run_id, offer.attempt_id);
                }
            }
            Err(e) => {
                if let Some(code) = self.session_call_failed("polling for offers", &e) {
                    warn!("session {session_id} ended ({code}); opening a new one");
                    self.session = None;
                }
            }
        }
        Ok(())
    }

    // ---- jobs ----

    /// Performs each job's steps until it waits or a call fails. Returns whether anything
    /// moved, and the earliest instant a waiting job needs attention.
    ///
    /// A job's steps run back to back, without looking at process ends in between, so a
    /// quick job still gets its `running` ACK before its exit is recorded.
    async fn work(&mut self, blocked: bool) -> Result<(bool, Option<Instant>), Fatal> {
        let mut moved = false;
        let mut due = None;
        let mut blocked = blocked;
        let keys: Vec<JobKey> = self.state.jobs.keys().cloned().collect();
        for key in keys {
            while let Some(job) = self.state.jobs.get(&key) {
                // Read per step: calls take time, and a claim's or renewal's age counts from
                // when its request was sent.
                let now = Instant::now();
                let rt = self.rts.entry(key.clone()).or_default();
                if let Some(spooled) = self.spooled.get(&key) {
                    rt.spooled = spooled.get();
                }
                let log = LogPolicy {
                    flush_bytes: self.cfg.log_flush_bytes,
                    flush: self.cfg.log_flush,
                    chunk_max: self.cfg.log_chunk_bytes,
                };
                let step = core::next(&key, job, rt, Now { at: now, drain_by: self.drain_by, log });
                if step.is_remote() && blocked {
                    break;
                }
                match self.perform(&key, step, now).await? {
                    Turn::Moved => moved = true,
                    Turn::Idle(t) => {
                        due = earliest(due, t);
                        break;
                    }
                    Turn::Blocked => {
                        blocked = true;
                        break;
                    }
                    Turn::Yield => {
                        moved = true;
                        break;
                    }
                }
            }
        }
        Ok((moved, due))
    }

    async fn perform(&mut self, key: &JobKey, step: Step, now: Instant) -> Result<Turn, Fatal> {
        let job = self.state.jobs.get(key).expect("the job").clone();
        let who = who(key, &job);
        match step {
            Step::Wait(until) => Ok(Turn::Idle(until)),
            Step::Claim(body) => {
                let route = Route::Claim(self.cfg.worker_id.clone(), key.session_id.clone(), job.offer_id.clone());
                self.rt(key).claim_sent_at.get_or_insert(now);
                match self.client.call::<_, Claimed>(&route, &body) {
                    Ok(claimed) => {
                        self.call_ok();
                        self.commit(&core::claimed(key, &claimed))?;
                        let rt = self.rt(key);
                        rt.lease_fresh_at = core::claimed_fresh_at(rt);
                        info!(
                            "{who}: claimed (lease ttl {} ms, timeout {} ms, log limit {} bytes)",
                            claimed.lease_ttl_ms, claimed.spec.timeout_ms, claimed.spec.log_limit_bytes
                        );
                        Ok(Turn::Moved)
                    }
                    Err(e) => Ok(self.job_call_failed(key, &who, "claim", e)),
                }
            }
            Step::Renew(fence) => {
                let route = attempt_route(&self.cfg, key, &job, AttemptCommand::RenewLease);
                match self.client.call::<Fence, Renewed>(&route, &fence) {
                    Ok(renewed) => {
                        self.call_ok();
                        for record in core::renewed(key, &job, &renewed) {
                            if let Record::StopSeen { intent, .. } = &record {
                                info!("{who}: the server asks to stop ({})", intent.as_str());
                            }
                            self.commit(&record)?;
                        }
                        let rt = self.rt(key);
                        rt.lease_fresh_at = Some(now);
                        rt.renew_doubt = RenewDoubt::Sure;
                        debug!("{who}: lease renewed to version {}", renewed.lease_version);
                        Ok(Turn::Moved)
                    }
                    Err(e) => {
                        let doubt = self.rt(key).renew_doubt;
                        match core::renew_failed(doubt, e.code()) {
                            Some(RenewDoubt::TryNext) if doubt != RenewDoubt::TryNext => {
                                warn!("{who}: renewal answer was lost and the repeat met lease_conflict; trying the next lease version");
                                self.rt(key).renew_doubt = RenewDoubt::TryNext;
                                Ok(Turn::Moved)
                            }
                            Some(next) => {
                                self.rt(key).renew_doubt = next;
                                Ok(self.job_call_failed(key, &who, "lease renewal", e))
                            }
                            None if !core::renewal_refused_ends_job(&job) => {
                                warn!("{who}: lease renewal: {e}; reporting the ended process without renewals");
                                self.rt(key).lease_fresh_at = None;
                                Ok(Turn::Moved)
                            }
                            None => Ok(self.end_job(key, &who, "lease renewal", &e)),
                        }
                    }
                }
            }
            Step::Starting(fence) => {
                let route = attempt_route(&self.cfg, key, &job, AttemptCommand::Starting);
                match self.client.call::<Fence, AckReply>(&route, &fence) {
                    Ok(AckReply { result: Outcome::Started | Outcome::AlreadyStarting | Outcome::AlreadyRunning }) => {
                        self.call_ok();
                        self.settle_version(key, &job)?;
                        self.commit(&Record::StartingAcked { job: key.clone() })?;
                        Ok(Turn::Moved)
                    }
                    Ok(other) => Ok(self.unexpected(key, &who, "starting", other.result)),
                    Err(e) => Ok(self.job_call_failed(key, &who, "starting", e)),
                }
            }
            Step::Spawn => {
                if !job.spawning {
                    self.commit(&Record::Spawning { job: key.clone() })?;
                }
                let spec = &job.lease.as_ref().expect("a claimed job").spec;
                let run_dir = RunDir::new(&self.cfg.state_dir, &key.attempt_id);
                let supervise = self.supervise_jobs;
                match exec::Running::spawn(spec, run_dir, self.cfg.group_poll, self.cfg.stop_grace, supervise) {
                    Ok((mut process, unsupervised)) => {
                        if let Some(why) = unsupervised {
                            warn!(
                                "jobs run in the agent itself, without a supervisor ({why}): they end with the agent"
                            );
                            self.supervise_jobs = false;
                        }
                        crate::fault::hit("spawned");
                        let record = Record::Spawned {
                            job: key.clone(),
                            executor_handle: process.executor_handle().clone(),
                            pid: process.pid(),
                            pgid: process.pgid(),
                        };
                        if let Err(e) = self.commit(&record) {
                            // Unrecorded, the process could never be found again: end it.
                            let _ = process.stop(self.cfg.stop_grace).await;
                            return Err(e);
                        }
                        info!("{who}: started ({})", process.executor_handle());
                        let timeout = Duration::from_millis(spec.timeout_ms);
                        self.supervise(key.clone(), process);
                        let rt = self.rt(key);
                        rt.process = Process::Running;
                        rt.timeout_at = Some(now + timeout);
                        rt.log_sent_at = Some(now);
                    }
                    Err(e) => {
                        warn!("{who}: {e}");
                        let reason = Reason::summarise(&e.to_string());
                        self.commit(&Record::SpawnFailed { job: key.clone(), reason })?;
                    }
                }
                Ok(Turn::Moved)
            }
            Step::SkipSpawn(reason) => {
                info!("{who}: not starting it: {reason}");
                self.commit(&Record::SpawnFailed { job: key.clone(), reason })?;
                Ok(Turn::Moved)
            }
            Step::MintCallback => {
                let token = Token::generate().map_err(|e| Fatal(format!("the OS random source failed: {e}")))?;
                self.commit(&core::minted(key, token))?;
                Ok(Turn::Moved)
            }
            Step::Running(body) => {
                let route = attempt_route(&self.cfg, key, &job, AttemptCommand::Running);
                match self.client.call::<_, AckReply>(&route, &body) {
                    Ok(AckReply { result: Outcome::Running | Outcome::AlreadyRunning }) => {
                        self.call_ok();
                        self.settle_version(key, &job)?;
                        self.commit(&Record::RunningAcked { job: key.clone() })?;
                        info!("{who}: running");
                        Ok(Turn::Moved)
                    }
                    Ok(other) => Ok(self.unexpected(key, &who, "running", other.result)),
                    Err(e) => Ok(self.job_call_failed(key, &who, "running", e)),
                }
            }
            Step::StartFailure(body) => {
                let route = attempt_route(&self.cfg, key, &job, AttemptCommand::StartFailure);
                match self.client.call::<_, AckReply>(&route, &body) {
                    Ok(AckReply { result: result @ (Outcome::Failed | Outcome::Cancelled | Outcome::TimedOut) }) => {
                        self.call_ok();
                        self.settle_version(key, &job)?;
                        info!("{who}: start failure reported ({}); the run is {}", body.reason, outcome_word(result));
                        self.rt(key).finished = true;
                        Ok(Turn::Moved)
                    }
                    Ok(other) => Ok(self.unexpected(key, &who, "start-failure", other.result)),
                    Err(e) => Ok(self.job_call_failed(key, &who, "start-failure", e)),
                }
            }
            Step::Adopt => {
                let run_dir = RunDir::new(&self.cfg.state_dir, &key.attempt_id);
                match exec::supervise::handed_off(&run_dir) {
                    Ok(Some(Ok((handle, pid)))) => {
                        info!("{who}: found the job the previous agent's supervisor started ({handle})");
                        self.commit(&Record::Spawned { job: key.clone(), executor_handle: handle, pid, pgid: pid })?;
                        return Ok(Turn::Moved);
                    }
                    Ok(Some(Err(why))) => {
                        warn!("{who}: {why}");
                        self.commit(&Record::SpawnFailed { job: key.clone(), reason: Reason::summarise(&why) })?;
                        return Ok(Turn::Moved);
                    }
                    Ok(None) => {}
                    Err(e) => warn!("{who}: could not read what its supervisor left: {e}"),
                }
                let attempt = key.attempt_id.as_str();
                let found = exec::find_unrecorded(attempt, self.cfg.stop_grace, self.cfg.group_poll).await;
                match found {
                    Ok(exec::Found::Leader { handle, pid }) => {
                        info!("{who}: found the process the previous agent started but did not record ({handle})");
                        self.commit(&Record::Spawned { job: key.clone(), executor_handle: handle, pid, pgid: pid })?;
                    }
                    Ok(exec::Found::Nothing) if !run_dir.spool.exists() => {
                        info!("{who}: the previous agent stopped before it started the process");
                        self.rt(key).unstarted = true;
                    }
                    other => {
                        if let Err(e) = other {
                            warn!("{who}: could not look for its process: {e}");
                        }
                        warn!("{who}: the previous agent stopped while starting the process; it is not started again");
                        let reason = Reason::summarise(core::START_INTERRUPTED);
                        self.commit(&Record::SpawnFailed { job: key.clone(), reason })?;
                    }
                }
                Ok(Turn::Moved)
            }
            Step::Recover => {
                let spawn = job.spawn.as_ref().expect("a spawned job");
                let run_dir = RunDir::new(&self.cfg.state_dir, &key.attempt_id);
                // Its supervisor recorded the end while no agent watched: the true exit.
                if let Ok(Some(exit)) = exec::supervise::exit_recorded(&run_dir) {
                    info!("{who}: its process ended while the agent was down; its supervisor kept the exit");
                    let finished_at = core::evidence_time(wall_now(), self.server_clock(), Instant::now());
                    self.commit(&core::exited(key, ending_of(&exit, finished_at)))?;
                    return Ok(Turn::Moved);
                }
                // Its supervisor still runs it: take it back, log and all.
                if exec::supervise::supervisor_alive(&run_dir) {
                    match exec::Supervised::attach(run_dir, self.cfg.group_poll) {
                        Ok(process) => {
                            let process = exec::Running::Supervised(process);
                            info!("{who}: its process outlived the previous agent; watching it again");
                            let timeout = Duration::from_millis(job.lease.as_ref().map_or(0, |l| l.spec.timeout_ms));
                            self.supervise(key.clone(), process);
                            let rt = self.rt(key);
                            rt.process = Process::Running;
                            rt.timeout_at = Some(now + timeout);
                            rt.log_sent_at = Some(now);
                            return Ok(Turn::Moved);
                        }
                        Err(e) => warn!("{who}: could not watch its process again: {e}"),
                    }
                }
                let signal = if exec::is_alive(&spawn.executor_handle) {
                    match exec::stop_orphan(&spawn.executor_handle, self.cfg.stop_grace, self.cfg.group_poll).await {
                        Ok(_) => info!("{who}: its process outlived the previous agent; stopped it"),
                        Err(e) => warn!("{who}: could not stop the orphaned process: {e}"),
                    }
                    Some(9)
                } else {
                    info!("{who}: its process ended while the agent was down");
                    let (attempt, grace, poll) = (key.attempt_id.as_str(), self.cfg.stop_grace, self.cfg.group_poll);
                    match exec::stop_leftovers(attempt, spawn.pgid, grace, poll).await {
                        Ok(true) => info!("{who}: stopped what its process left running"),
                        Ok(false) => {}
                        Err(e) => warn!("{who}: could not stop what its process left running: {e}"),
                    }
                    None
                };
                // Nobody knows how it ended: not the job's failure. Unless the server ended
                // the job already, it is given up, and its run goes back to the queue
                // within its retries (the events say WORKER_LOST).
                let abandon = if self.rt(key).finished { None } else { core::abandon(&job, self.rt(key)) };
                if let Some(body) = abandon {
                    let route = attempt_route(&self.cfg, key, &job, AttemptCommand::Abandon);
                    match self.client.call::<_, AckReply>(&route, &body) {
                        Ok(AckReply { result: Outcome::Abandoned }) => {
                            self.call_ok();
                            warn!("{who}: its process ended with no recorded end; reported lost, not failed");
                        }
                        Ok(other) => return Ok(self.unexpected(key, &who, "abandon", other.result)),
                        // Applied before (an answer lost), or ended some other way: gone either way.
                        Err(CallError::Refused {
                            code:
                                ErrorCode::LeaseConflict
                                | ErrorCode::AlreadyTerminal
                                | ErrorCode::NotFound
                                | ErrorCode::SessionConflict,
                            ..
                        }) => info!("{who}: its attempt had already ended"),
                        Err(e) => return Ok(self.job_call_failed(key, &who, "abandon", e)),
                    }
                    self.rt(key).finished = true;
                }
                let (log_len, truncated) = self.spool_facts(key, &job);
                let finished_at = core::evidence_time(wall_now(), self.server_clock(), Instant::now());
                let ending = Ending { exit_code: None, signal, finished_at, log_len, truncated };
                self.commit(&core::exited(key, ending))?;
                Ok(Turn::Moved)
            }
            Step::Stop(cause) => {
                let why = match cause {
                    StopCause::Intent(intent) => format!("the server asked ({})", intent.as_str()),
                    StopCause::Timeout => "its timeout passed".to_owned(),
                    StopCause::Drain => "the agent is shutting down".to_owned(),
                    StopCause::Ended => "the server ended the job".to_owned(),
                };
                info!("{who}: stopping its process group: {why}");
                if let Some(stop) = self.stops.get(key) {
                    let _ = stop.try_send(());
                }
                self.rt(key).process = Process::Stopping;
                Ok(Turn::Moved)
            }
            Step::Upload(header) => self.upload(key, &job, &who, header),
            Step::Append(header) => self.append(key, &job, &who, header, now),
            Step::Seal(body) => self.seal(key, &job, &who, body),
            Step::Complete(body) => {
                let route = attempt_route(&self.cfg, key, &job, AttemptCommand::Completion);
                match self.client.call::<_, CompletionReply>(&route, &body) {
                    Ok(CompletionReply { result: Outcome::Completed | Outcome::AlreadyCompleted, status }) => {
                        self.call_ok();
                        self.settle_version(key, &job)?;
                        info!(
                            "{who}: completed: {}",
                            serde_json::to_string(&status).unwrap_or_default().trim_matches('"')
                        );
                        self.rt(key).finished = true;
                        Ok(Turn::Moved)
                    }
                    Ok(other) => Ok(self.unexpected(key, &who, "completion", other.result)),
                    Err(e) => Ok(self.job_call_failed(key, &who, "completion", e)),
                }
            }
            Step::Drop => {
                self.commit(&Record::Dropped { job: key.clone() })?;
                self.rts.remove(key);
                self.stops.remove(key);
                self.spooled.remove(key);
                if let Err(e) = RunDir::new(&self.cfg.state_dir, &key.attempt_id).remove() {
                    warn!("{who}: could not remove its run directory: {e}");
                }
                debug!("{who}: dropped from the journal");
                Ok(Turn::Moved)
            }
        }
    }

    fn rt(&mut self, key: &JobKey) -> &mut Runtime {
        self.rts.entry(key.clone()).or_default()
    }

    /// A fenced command succeeded: its version is the server's. When that was the next
    /// version (a renewal whose answer was lost did apply), it is recorded first.
    fn settle_version(&mut self, key: &JobKey, job: &Job) -> Result<(), Fatal> {
        if let Some(record) = core::settled(key, job, self.rt(key).renew_doubt) {
            self.commit(&record)?;
        }
        self.rt(key).renew_doubt = RenewDoubt::Sure;
        Ok(())
    }

    fn upload(
        &mut self,
        key: &JobKey,
        job: &Job,
        who: &str,
        header: ql_wire::artifact::ArtifactHeader,
    ) -> Result<Turn, Fatal> {
        let callback = job.callback.as_ref().expect("a minted job");
        let artifact_id = callback.log_artifact_id.clone().expect("a log artifact");
        let len = header.content_length;
        let Some(file) = self.spool_range(key, who, 0, len) else { return Ok(Turn::Moved) };
        let prefix = ql_wire::frame::encode_prefix(&header).map_err(|e| Fatal(format!("artifact header: {e}")))?;
        let mut content = Counted(file);
        let route = Route::Artifact(attempt_path(&self.cfg, key, job), artifact_id);
        let started = Instant::now();
        match self.client.upload(&route, &prefix[..], &mut content, len) {
            Ok(reply) if matches!(reply.result, Outcome::Stored | Outcome::AlreadyStored) => {
                self.call_ok();
                self.settle_version(key, job)?;
                let r = &reply.receipt;
                if r.length != len || r.truncated != header.truncated {
                    warn!("{who}: the stored log's receipt differs from what was sent; completing with the server's");
                }
                info!(
                    "{who}: log stored ({} bytes{}) in {} ms",
                    r.length,
                    if r.truncated { ", truncated" } else { "" },
                    started.elapsed().as_millis()
                );
                self.commit(&Record::ArtifactStored { job: key.clone(), receipt: reply.receipt })?;
                Ok(Turn::Moved)
            }
            Ok(other) => Ok(self.unexpected(key, who, "log upload", other.result)),
            Err(e) => Ok(self.job_call_failed(key, who, "log upload", e)),
        }
    }

    /// The job's spool, positioned at `offset`, holding at least `len` bytes from there.
    /// A spool that is gone or shorter (a reboot emptied a RAM disk) marks the log lost:
    /// the job completes without one rather than with something else.
    fn spool_range(&mut self, key: &JobKey, who: &str, offset: u64, len: u64) -> Option<File> {
        use std::io::{Seek, SeekFrom};
        let spool = RunDir::new(&self.cfg.state_dir, &key.attempt_id).spool;
        let opened = File::open(&spool).and_then(|mut f| {
            let have = f.metadata()?.len();
            if have < offset + len {
                let what = format!("{have} of {} bytes left", offset + len);
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, what));
            }
            f.seek(SeekFrom::Start(offset))?;
            Ok(f)
        });
        match opened {
            Ok(f) => Some(f),
            Err(e) => {
                warn!("{who}: its log spool is unusable ({e}); completing without a log");
                self.rt(key).log_lost = true;
                None
            }
        }
    }

    fn supervise(&mut self, key: JobKey, mut process: exec::Running) {
        self.spooled.insert(key.clone(), process.spooled());
        let (stop_tx, stop_rx) = channel::bounded::<()>(1);
        let ended = self.ended_tx.clone();
        let grace = self.cfg.stop_grace;
        let task_key = key.clone();
        self.ex
            .spawn(async move {
                let waited = future::or(async { Some(process.wait().await) }, async {
                    // A request, or the agent letting go of the job: either way, stop it.
                    let _ = stop_rx.recv().await;
                    None
                })
                .await;
                // Even after a normal exit, stop ends members the job left behind, so no
                // process of a finished job outlives it.
                let result = match waited {
                    Some(Err(e)) => {
                        let _ = process.stop(grace).await;
                        Err(e)
                    }
                    Some(Ok(_)) | None => process.stop(grace).await,
                };
                let _ = ended.send(Ended { key: task_key, result, finished_at: wall_now() }).await;
            })
            .detach();
        self.stops.insert(key, stop_tx);
    }

    /// A job command failed: repeat later, or end the job.
    fn job_call_failed(&mut self, key: &JobKey, who: &str, what: &str, err: CallError) -> Turn {
        match &err {
            CallError::Transport(_) | CallError::Protocol(_) => {
                warn!("{who}: {what}: {err}; will repeat");
                self.block(None);
                Turn::Blocked
            }
            CallError::Refused { code, .. } if core::retry_next_version(self.rt(key).renew_doubt, *code) => {
                warn!(
                    "{who}: {what}: {err} while a renewal's outcome is unknown; repeating with the next lease version"
                );
                self.rt(key).renew_doubt = RenewDoubt::TryNext;
                Turn::Moved
            }
            CallError::Refused { code, retry_after, .. } => match core::disposition(*code) {
                Disposition::Retry => {
                    warn!("{who}: {what}: {err}; will repeat");
                    self.block(*retry_after);
                    Turn::Blocked
                }
                Disposition::Misconfigured => {
                    error!("{who}: {what}: {err}; check the configuration and the certificate");
                    self.block(*retry_after);
                    Turn::Blocked
                }
                Disposition::EndJob => self.end_job(key, who, what, &err),
            },
        }
    }

    fn end_job(&mut self, key: &JobKey, who: &str, what: &str, err: &CallError) -> Turn {
        let code = err.code().map_or_else(|| err.to_string(), |c| c.to_string());
        warn!("{who}: {code} from the server on {what}; stopping and dropping the job");
        if err.code() == Some(ErrorCode::SessionConflict)
            && self.session.as_ref().is_some_and(|l| l.id == key.session_id)
        {
            // The session itself is gone: open a new one rather than wait for the heartbeat.
            self.session = None;
        }
        self.rt(key).finished = true;
        Turn::Moved
    }

    fn unexpected(&mut self, key: &JobKey, who: &str, what: &str, result: Outcome) -> Turn {
        warn!(
            "{who}: {what} answered `{}`, which it never should; stopping and dropping the job",
            outcome_word(result)
        );
        self.rt(key).finished = true;
        Turn::Moved
    }
}

fn outcome_word(o: Outcome) -> String {
    serde_json::to_string(&o).unwrap_or_default().trim_matches('"').to_owned()
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
