//! The jobs: each job's next step asked of [`crate::core`] and performed (claim, the
//! ACKs, start, renewal, stop, the log and its seal, completion), and what a failed or
//! unexpected answer does to the job.

use std::fs::File;
use std::io;
use std::time::{Duration, Instant};

use smol::{channel, future};

use ql_wire::ack::AckReply;
use ql_wire::capability::Token;
use ql_wire::completion::CompletionReply;
use ql_wire::lease::Renewed;
use ql_wire::offer::Claimed;
use ql_wire::route::{AttemptCommand, Route};
use ql_wire::text::Reason;
use ql_wire::{ErrorCode, Fence, Outcome};

use super::{attempt_path, attempt_route, earliest, ending_of, wall_now, who, Agent, Counted, Ended, Fatal, Turn};
use crate::client::CallError;
use crate::core::{self, Disposition, Ending, LogPolicy, Now, Process, RenewDoubt, Runtime, Step, StopCause};
use crate::exec::{self, RunDir};
use crate::journal::{Job, JobKey, Record};

impl Agent {
    /// Performs each job's steps until it waits or a call fails. Returns whether anything
    /// moved, and the earliest instant a waiting job needs attention.
    ///
    /// A job's steps run back to back, without looking at process ends in between, so a
    /// quick job still gets its `running` ACK before its exit is recorded.
    pub(super) async fn work(&mut self, blocked: bool) -> Result<(bool, Option<Instant>), Fatal> {
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
                // Before a renewal with a version a lease_conflict proved (a renewal whose
                // answer was lost did apply), the journal learns that version: this renewal
                // may apply as well, and after a restart only it can still be in doubt,
                // which a resumed job allows for. (Only renewals move the version on.)
                let doubt = rt.renew_doubt;
                if doubt.ahead > 0 && matches!(step, Step::Renew(_)) {
                    if let Some(record) = core::settled(&key, job, doubt) {
                        self.commit(&record)?;
                    }
                    self.rt(&key).renew_doubt = RenewDoubt { ahead: 0, unsure: doubt.unsure };
                    continue;
                }
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

    pub(super) async fn perform(&mut self, key: &JobKey, step: Step, now: Instant) -> Result<Turn, Fatal> {
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
                        rt.renew_doubt = RenewDoubt::SURE;
                        debug!("{who}: lease renewed to version {}", renewed.lease_version);
                        Ok(Turn::Moved)
                    }
                    Err(e) => {
                        let doubt = self.rt(key).renew_doubt;
                        match core::renew_failed(doubt, e.code()) {
                            Some(next) if next.ahead > doubt.ahead => {
                                warn!("{who}: renewal answer was lost and the repeat met lease_conflict; trying the next lease version");
                                self.rt(key).renew_doubt = next;
                                Ok(Turn::Moved)
                            }
                            Some(next) => {
                                self.rt(key).renew_doubt = next;
                                Ok(self.job_call_failed(key, &who, "lease renewal", e))
                            }
                            None if !core::renewal_refused_ends_job(&job) => {
                                warn!("{who}: lease renewal: {e}; reporting the ended process without renewals");
                                self.rt(key).renewals_refused = true;
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
                let supervise = self.supervise_jobs.then_some(self.cfg.handoff_timeout);
                match exec::Running::spawn(spec, run_dir, self.cfg.group_poll, self.cfg.stop_grace, supervise) {
                    Ok((mut process, unsupervised)) => {
                        match unsupervised {
                            Some(exec::Unsupervised::ForGood(why)) => {
                                warn!(
                                    "jobs run in the agent itself, without a supervisor ({why}): they end with the agent"
                                );
                                self.supervise_jobs = false;
                            }
                            Some(exec::Unsupervised::ThisOnce(why)) => {
                                warn!("{who}: runs in the agent itself ({why}): it ends with the agent");
                                self.rt(key).in_agent = true;
                            }
                            None => {}
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
                let handed = exec::supervise::handed_off(&run_dir, self.cfg.handoff_timeout).unwrap_or_else(|e| {
                    warn!("{who}: could not read what its supervisor left: {e}");
                    None
                });
                // A supervisor that has not handed the job over by now could still start it,
                // beside the one this agent would start: it is stopped first (or found to
                // have handed it over after all).
                let (handed, stalled) = match handed {
                    Some(handed) => (Some(handed), Ok(exec::supervise::Stalled::Nothing)),
                    None => {
                        let (poll, grace) = (self.cfg.group_poll, self.cfg.stop_grace);
                        match exec::supervise::stop_stalled(&run_dir, poll, grace).await {
                            Ok(exec::supervise::Stalled::Said(said)) => {
                                (Some(said), Ok(exec::supervise::Stalled::Nothing))
                            }
                            stalled => (None, stalled),
                        }
                    }
                };
                match handed {
                    Some(Ok((handle, pid))) => {
                        info!("{who}: found the job the previous agent's supervisor started ({handle})");
                        self.commit(&Record::Spawned { job: key.clone(), executor_handle: handle, pid, pgid: pid })?;
                        return Ok(Turn::Moved);
                    }
                    Some(Err(why)) => {
                        warn!("{who}: {why}");
                        self.commit(&Record::SpawnFailed { job: key.clone(), reason: Reason::summarise(&why) })?;
                        return Ok(Turn::Moved);
                    }
                    None => {}
                }
                let attempt = key.attempt_id.as_str();
                let found = match stalled {
                    Ok(stalled) => {
                        if stalled == exec::supervise::Stalled::Stopped {
                            info!("{who}: stopped the supervisor the previous agent started, which had not said the job runs");
                        }
                        exec::find_unrecorded(attempt, self.cfg.stop_grace, self.cfg.group_poll).await
                    }
                    Err(e) => Err(e),
                };
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
                if self.exit_kept(key, &who, &run_dir)? {
                    return Ok(Turn::Moved);
                }
                // Its supervisor still runs it: take it back, log and all.
                if exec::supervise::supervisor_alive(&run_dir) {
                    match exec::Supervised::attach(run_dir.clone(), self.cfg.group_poll) {
                        Ok(process) => {
                            let process = exec::Running::Supervised(process);
                            let timeout = Duration::from_millis(job.lease.as_ref().map_or(0, |l| l.spec.timeout_ms));
                            // Its timeout counts from its start, not from this agent's.
                            let left = exec::time_left(&spawn.executor_handle, timeout);
                            if left.is_zero() {
                                info!("{who}: its process outlived the previous agent and its timeout; stopping it");
                            } else {
                                info!(
                                    "{who}: its process outlived the previous agent; watching it again ({} ms of its timeout left)",
                                    left.as_millis()
                                );
                            }
                            self.supervise(key.clone(), process);
                            let rt = self.rt(key);
                            rt.process = Process::Running;
                            rt.timeout_at = Some(now + left);
                            rt.log_sent_at = Some(now);
                            return Ok(Turn::Moved);
                        }
                        Err(e) => warn!("{who}: could not watch its process again: {e}"),
                    }
                }
                // Looked at again, the supervisor found gone: it may have recorded the end
                // and exited between the two looks.
                if self.exit_kept(key, &who, &run_dir)? {
                    return Ok(Turn::Moved);
                }
                let (signal, stopped) = if exec::is_alive(&spawn.executor_handle) {
                    let stopped =
                        exec::stop_orphan(&spawn.executor_handle, self.cfg.stop_grace, self.cfg.group_poll).await;
                    if stopped.is_ok() {
                        info!("{who}: its process ran on unwatched; stopped it");
                    }
                    // Killed only if the stop went through.
                    (stopped.is_ok().then_some(9), stopped.map(drop).map_err(|e| format!("its process ({e})")))
                } else {
                    info!("{who}: its process ended with no end on record");
                    let (attempt, grace, poll) = (key.attempt_id.as_str(), self.cfg.stop_grace, self.cfg.group_poll);
                    let stopped = exec::stop_leftovers(attempt, spawn.pgid, grace, poll).await;
                    if stopped.as_ref().is_ok_and(|some| *some) {
                        info!("{who}: stopped what its process left running");
                    }
                    (None, stopped.map(drop).map_err(|e| format!("what its process left running ({e})")))
                };
                // What could not be stopped may still run: giving the attempt up would run
                // it twice. The recovery is tried again while the back-off grows; once it
                // would pass its cap the job is reported without an exit status, which ends
                // its run as the server decides, never running it again. A job the server
                // ended already has nothing to give up.
                let mut unstoppable = false;
                if let (Err(what), false) = (&stopped, self.rt(key).finished) {
                    match self.recover_later(key, &who, what) {
                        Some(turn) => return Ok(turn),
                        None => unstoppable = true,
                    }
                }
                // Nobody knows how it ended: not the job's failure. Unless the server ended
                // the job already, it is given up, and its run goes back to the queue
                // within its retries (the events say WORKER_LOST).
                let giving_up = !self.rt(key).finished && !unstoppable;
                let mut abandon = if giving_up { core::abandon(&job, self.rt(key)) } else { None };
                while let Some(body) = abandon.take() {
                    let route = attempt_route(&self.cfg, key, &job, AttemptCommand::Abandon);
                    let doubt = self.rt(key).renew_doubt;
                    match self.client.call::<_, AckReply>(&route, &body) {
                        Ok(AckReply { result: Outcome::Abandoned }) => {
                            self.call_ok();
                            warn!("{who}: its process ended with no recorded end; reported lost, not failed");
                        }
                        Ok(other) => return Ok(self.unexpected(key, &who, "abandon", other.result)),
                        // A renewal in flight when the agent died may have moved the lease
                        // on: the abandon is repeated with the next version (once for that
                        // renewal), as every fenced command is, rather than left to the
                        // lease's lapse.
                        Err(CallError::Refused { code: ErrorCode::LeaseConflict, .. })
                            if core::retry_next_version(doubt, ErrorCode::LeaseConflict) =>
                        {
                            warn!("{who}: abandon met lease_conflict while a renewal's outcome is unknown; repeating with the next lease version");
                            self.rt(key).renew_doubt = doubt.next();
                            abandon = core::abandon(&job, self.rt(key));
                            continue;
                        }
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

    pub(super) fn rt(&mut self, key: &JobKey) -> &mut Runtime {
        self.rts.entry(key.clone()).or_default()
    }

    /// A fenced command succeeded: its version is the server's. When that was the next
    /// version (a renewal whose answer was lost did apply), it is recorded first.
    pub(super) fn settle_version(&mut self, key: &JobKey, job: &Job) -> Result<(), Fatal> {
        if let Some(record) = core::settled(key, job, self.rt(key).renew_doubt) {
            self.commit(&record)?;
        }
        self.rt(key).renew_doubt = RenewDoubt::SURE;
        Ok(())
    }

    pub(super) fn upload(
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
    pub(super) fn spool_range(&mut self, key: &JobKey, who: &str, offset: u64, len: u64) -> Option<File> {
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

    pub(super) fn supervise(&mut self, key: JobKey, mut process: exec::Running) {
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
                    // The exit seen stands: a stop that fails after it (no `/proc`, say)
                    // must not turn a finished job into a lost one, which runs again.
                    Some(Ok(exit)) => match process.stop(grace).await {
                        Ok(stopped) => Ok(stopped),
                        Err(e) => {
                            warn!("attempt {}: could not stop what its job left running: {e}", task_key.attempt_id);
                            Ok(exit)
                        }
                    },
                    None => process.stop(grace).await,
                };
                let _ = ended.send(Ended { key: task_key, result, finished_at: wall_now() }).await;
            })
            .detach();
        self.stops.insert(key, stop_tx);
    }

    /// A job command failed: repeat later, or end the job.
    pub(super) fn job_call_failed(&mut self, key: &JobKey, who: &str, what: &str, err: CallError) -> Turn {
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
                let rt = self.rt(key);
                rt.renew_doubt = rt.renew_doubt.next();
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

    pub(super) fn end_job(&mut self, key: &JobKey, who: &str, what: &str, err: &CallError) -> Turn {
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

    pub(super) fn unexpected(&mut self, key: &JobKey, who: &str, what: &str, result: Outcome) -> Turn {
        warn!(
            "{who}: {what} answered `{}`, which it never should; stopping and dropping the job",
            outcome_word(result)
        );
        self.rt(key).finished = true;
        Turn::Moved
    }

    /// The recovery could not stop what runs of the job: giving the attempt up now would
    /// queue its run again while it still runs, so the recovery waits a back-off that
    /// doubles and tries again, the job's renewals going on meanwhile. `None` once the
    /// next doubling would pass its cap (`backoff_max_ms`): the recovery stops trying.
    fn recover_later(&mut self, key: &JobKey, who: &str, what: &str) -> Option<Turn> {
        let random = self.draw();
        let (initial, max) = (self.cfg.backoff_initial, self.cfg.backoff_max);
        let hold = &mut self.rt(key).recover_hold;
        if hold.spent(initial, max) {
            error!(
                "{who}: could not stop {what} after {} tries; reporting the job without an exit status, since \
                 giving it up while it may still run would run it twice",
                hold.failures + 1
            );
            return None;
        }
        let now = Instant::now();
        let wait = hold.fail(initial, max, random, now);
        let until = now + wait;
        warn!(
            "{who}: could not stop {what}; the attempt is given up only once it is stopped: again in {} ms",
            wait.as_millis()
        );
        Some(Turn::Idle(Some(until)))
    }

    /// Records the exit the job's supervisor kept, if it kept one (the process ended while
    /// no agent watched it).
    fn exit_kept(&mut self, key: &JobKey, who: &str, run_dir: &RunDir) -> Result<bool, Fatal> {
        let Ok(Some(exit)) = exec::supervise::exit_recorded(run_dir) else { return Ok(false) };
        info!("{who}: its process ended unwatched; its supervisor kept the exit");
        let finished_at = core::evidence_time(wall_now(), self.server_clock(), Instant::now());
        self.commit(&core::exited(key, ending_of(&exit, finished_at)))?;
        Ok(true)
    }
}

fn outcome_word(o: Outcome) -> String {
    serde_json::to_string(&o).unwrap_or_default().trim_matches('"').to_owned()
}
