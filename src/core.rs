//! The functional core: what to do next with one job, decided from what the journal holds
//! and a few facts that only live in memory. No I/O, no clock, no randomness: time comes in
//! as an [`Instant`] read by the shell, on the monotonic clock only (the wall clock never
//! decides when a lease is renewed), and random numbers come in as arguments.
//!
//! [`next`] maps `(journal job, runtime facts, now)` to one [`Step`]. Steps that speak to
//! ql-control carry their request body, built only from the journal, so a command whose
//! answer was lost is repeated with exactly the same fence and body. The life of a job:
//!
//! ```text
//! Claim -> Starting -> Spawn -> MintCallback -> Running -> Wait/Renew/Append ... exit
//!       -> Append ... (the rest of the log) -> Seal -> Complete -> Drop
//! ```
//!
//! The log streams while the job runs (PROTOCOL §13): once [`LogPolicy::flush_bytes`] wait
//! in the spool, or [`LogPolicy::flush`] after the last chunk, the next chunk goes out from
//! the acknowledged offset the journal holds, at most the runtime's chunk cap. Renewals
//! always come first, and a chunk is sized so that it takes about a sixth of the lease
//! ([`adapt_chunk`]) and is given a third of it: no request that holds the one connection
//! outlasts a third of the lease, however slow the uplink. A job that ends before its
//! `running` ACK has no live log on the server and uploads its log in one frame (`Upload`)
//! as before.
//!
//! and its detours:
//!
//! - the spawn fails: `StartFailure`, then `Drop`;
//! - a renewal delivers a stop intent, the spec's timeout passes, or a drain runs out: `Stop`
//!   the process group, then `Upload` and `Complete` as usual (the server picks the terminal
//!   status from its intent, never from a late exit code);
//! - a stop is known before the spawn: `SkipSpawn("stopped before start")`, then
//!   `StartFailure`;
//! - the process exited before the `running` ACK: complete from `starting` (the protocol
//!   allows it), skipping `Running`;
//! - the agent restarted while the process ran, or lost track of it (its supervisor
//!   killed): `Recover` (take it back while its supervisor runs; else the exit its
//!   supervisor kept, then the log and `Complete` as usual; else stop what is left and
//!   `Abandon`: nobody knows how it ended; what cannot be stopped holds the recovery back,
//!   `Runtime::recover_hold`);
//! - the agent restarted after it set out to start the process (`spawning`) but before it
//!   recorded the start: `Adopt` (find the process by the attempt id in its environment and
//!   record it, so `Recover` follows; or learn that it never started, and `Spawn`; or, when
//!   that cannot be known, record a spawn failure rather than start it a second time);
//! - the server ended the job (a 409 or 404) or holds its result: `Stop` whatever still
//!   runs, then `Drop`.
//!
//! The renewal cadence is a third of the server's `leaseTtlMs` after the last claim or
//! renewal that succeeded, measured from when its request was sent — for a claim, from its
//! first sending, since a lost answer may hide an earlier success ([`claimed_fresh_at`]).
//! Renewals go on after the process ended, while the log is uploaded and the completion
//! sent, as long as the lease's age is known, and after a restart while a log is still to
//! go out (the first at once), until the server refuses one. A renewal whose answer was lost may still
//! have advanced the lease version, and so may one in flight when the agent died;
//! [`RenewDoubt`] tracks that: every fenced command is sent with the journal's version
//! first, and a `lease_conflict` met while a renewal may have applied earns a repeat with
//! the next version, once for each such renewal ([`renew_failed`], [`retry_next_version`]).

use std::time::{Duration, Instant};

use ql_wire::ack::{Abandon, Running, StartFailure};
use ql_wire::artifact::{ArtifactHeader, ArtifactSchema};
use ql_wire::capability::Token;
use ql_wire::completion::{Completion, CompletionSchema};
use ql_wire::ids::{ArtifactId, Counter};
use ql_wire::lease::{Renewed, StopIntent};
use ql_wire::log::{LogChunkHeader, LogChunkSchema, Seal};
use ql_wire::offer::{Claim, Claimed};
use ql_wire::text::Reason;
use ql_wire::time::Timestamp;
use ql_wire::{ErrorCode, Fence};

use crate::journal::{Job, JobKey, Lease, Record};

/// The artifact id the log is uploaded as.
pub(crate) const LOG_ARTIFACT_ID: &str = "log";
/// The start-failure reason when a stop intent arrived before the process was started.
pub(crate) const STOPPED_BEFORE_START: &str = "stopped before start";
/// The start-failure reason when a drain ran out before the process was started.
pub(crate) const SHUT_DOWN_BEFORE_START: &str = "agent shut down before start";
/// The start-failure reason when the agent died while starting the process and cannot tell
/// whether it ran: reported rather than run a second time.
pub(crate) const START_INTERRUPTED: &str = "the agent stopped while starting the process; not started again";
/// The abandon reason when an agent (restarted, or watching the job when its supervisor
/// was killed) finds a job's process and its supervisor gone with no recorded end: lost
/// through no fault of the job.
pub(crate) const JOB_LOST: &str = "the job's process and its supervisor were gone, with no recorded end";

/// Whether this agent holds the job's process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Process {
    /// Not started in this agent's life: never spawned, already ended, or orphaned by a
    /// restart.
    Absent,
    /// Running and supervised.
    Running,
    /// A stop was asked for; its end has not been seen yet.
    Stopping,
}

/// What the agent knows of the server's lease version beyond its journal's. Only renewals
/// move the version on, and every lost answer may hide one that applied: each
/// `lease_conflict` met while one may have applied proves it did, and moves commands on to
/// the next version. Two lost answers in a row (both applied) need two such steps, so the
/// steps are counted, not capped at one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RenewDoubt {
    /// Renewals past the journal's version that a `lease_conflict` proved applied: fenced
    /// commands go out with the journal's version plus this many.
    pub(crate) ahead: u32,
    /// The last renewal sent with that version lost its answer, or the agent restarted (one
    /// may have been in flight when it died): it may have applied as well.
    pub(crate) unsure: bool,
}

impl RenewDoubt {
    /// The journal's version is the server's.
    pub(crate) const SURE: Self = Self { ahead: 0, unsure: false };

    /// After a renewal sent with the current version lost its answer.
    pub(crate) const fn lost(self) -> Self {
        Self { ahead: self.ahead, unsure: true }
    }

    /// After a `lease_conflict` proved that the renewal in doubt applied.
    pub(crate) const fn next(self) -> Self {
        Self { ahead: self.ahead.saturating_add(1), unsure: false }
    }
}

/// Facts about a job that die with the agent process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Runtime {
    /// When the request of the last successful claim or renewal was sent. `None` after a
    /// restart: the lease's age is unknown, so it is renewed first.
    pub(crate) lease_fresh_at: Option<Instant>,
    /// When the spec's timeout ends the process, on the local clock (set at the spawn; the
    /// server's deadline runs from the claim, so this one is never earlier).
    pub(crate) timeout_at: Option<Instant>,
    /// The process, as far as this agent holds it.
    pub(crate) process: Process,
    /// Whether the lease version is known.
    pub(crate) renew_doubt: RenewDoubt,
    /// The spool is gone or shorter than the journal says (a reboot emptied a RAM disk):
    /// complete without a log rather than upload something else.
    pub(crate) log_lost: bool,
    /// The server holds the job's terminal facts, or ended the job: forget it once nothing
    /// of it runs.
    pub(crate) finished: bool,
    /// The job was in the journal when the agent started: its claim may predate the
    /// restart.
    pub(crate) resumed: bool,
    /// When this agent first sent the job's claim.
    pub(crate) claim_sent_at: Option<Instant>,
    /// The journal's `spawning` intent was never acted on (no run directory was made): the
    /// process may be started.
    pub(crate) unstarted: bool,
    /// Bytes the running process has put in its spool so far.
    pub(crate) spooled: u64,
    /// The server refused a renewal of the ended process's lease (its session is gone,
    /// say): it is reported without renewals.
    pub(crate) renewals_refused: bool,
    /// When the last log chunk was acknowledged (or the process started): the flush
    /// interval counts from it.
    pub(crate) log_sent_at: Option<Instant>,
    /// The largest chunk to send next (`0`: the policy's largest); see [`adapt_chunk`].
    pub(crate) chunk_cap: u64,
    /// No log chunk or seal of this job while held: the server refused the last one as a
    /// conflict at the offset the journal holds ([`conflict_moves`]). The job's renewals,
    /// and the other jobs, go on meanwhile.
    pub(crate) log_hold: Hold,
    /// No `Recover` of this job while held: the last one could not stop what runs of it,
    /// and giving the attempt up meanwhile would run it twice. Its renewals go on.
    pub(crate) recover_hold: Hold,
    /// Its process runs in the agent itself, its supervisor having been too slow to start
    /// ([`may_hand_over`]).
    pub(crate) in_agent: bool,
}

/// One step held back after failures in a row, for a back-off that doubles with each
/// ([`backoff`]): a job's log or recovery, the certificate's renewal. Nothing else of the
/// agent waits for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Hold {
    /// Not before this instant.
    pub(crate) until: Option<Instant>,
    /// The failures in a row so far.
    pub(crate) failures: u32,
}

impl Hold {
    /// Until when the step is held back, if it still is.
    pub(crate) fn holds(&self, now: Instant) -> Option<Instant> {
        self.until.filter(|t| now < *t)
    }

    /// One more failure: the step waits the next back-off from `now`, which is returned.
    pub(crate) fn fail(&mut self, initial: Duration, max: Duration, random: u64, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let wait = backoff(initial, max, self.failures, random, None);
        self.until = Some(now + wait);
        wait
    }

    /// Whether one more failure's back-off would pass `max` (the doubling is spent).
    pub(crate) fn spent(&self, initial: Duration, max: Duration) -> bool {
        doubled(initial, self.failures.saturating_add(1)) > max
    }
}

impl Default for Runtime {
    fn default() -> Self {
        Self {
            lease_fresh_at: None,
            timeout_at: None,
            process: Process::Absent,
            renew_doubt: RenewDoubt::SURE,
            log_lost: false,
            finished: false,
            resumed: false,
            claim_sent_at: None,
            unstarted: false,
            spooled: 0,
            renewals_refused: false,
            log_sent_at: None,
            chunk_cap: 0,
            log_hold: Hold::default(),
            recover_hold: Hold::default(),
            in_agent: false,
        }
    }
}

impl Runtime {
    /// The runtime facts of a job found in the journal at start: the lease's age and its
    /// version are unknown.
    pub(crate) fn resumed() -> Self {
        Self { renew_doubt: RenewDoubt::SURE.lost(), resumed: true, ..Self::default() }
    }
}

/// When and how much of a running job's log is sent (the agent's settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogPolicy {
    /// Waiting bytes that make a chunk worth sending at once.
    pub(crate) flush_bytes: u64,
    /// The longest waiting bytes wait.
    pub(crate) flush: Duration,
    /// The largest chunk.
    pub(crate) chunk_max: u64,
}

/// The smallest chunk [`adapt_chunk`] chooses.
pub(crate) const MIN_CHUNK: u64 = crate::config::MIN_CHUNK;

/// The moment a decision is made, with the agent-wide facts that bear on every job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Now {
    /// The monotonic now.
    pub(crate) at: Instant,
    /// While draining: when running jobs are stopped.
    pub(crate) drain_by: Option<Instant>,
    /// The log streaming settings.
    pub(crate) log: LogPolicy,
}

/// Why a process is being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopCause {
    /// A renewal delivered the server's stop intent.
    Intent(StopIntent),
    /// The spec's timeout passed on the local clock.
    Timeout,
    /// The agent is shutting down and the drain time ran out.
    Drain,
    /// The server ended the job.
    Ended,
}

/// The one next thing to do with a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send the claim.
    Claim(Claim),
    /// Renew the lease.
    Renew(Fence),
    /// Send `starting`.
    Starting(Fence),
    /// Start the process (local): record the `spawning` intent (unless it is on record),
    /// then fork.
    Spawn,
    /// The journal says the process was about to be started but not whether it was: look
    /// for it (local). See [`Record::Spawning`].
    Adopt,
    /// Record a spawn failure without spawning (local).
    SkipSpawn(Reason),
    /// Record a fresh callback token, sequence 1, log artifact [`LOG_ARTIFACT_ID`] (local).
    MintCallback,
    /// Send `running`.
    Running(Running),
    /// Send `start-failure`.
    StartFailure(StartFailure),
    /// The journal says the process was started but this agent does not hold it: find it,
    /// stop it if it still runs, and record how it ended (local).
    Recover,
    /// Stop the process group (local).
    Stop(StopCause),
    /// Nothing to do before this instant, unless the process ends (`None`: only then).
    Wait(Option<Instant>),
    /// Upload the whole log in one frame (a job that never had its `running` ACK).
    Upload(ArtifactHeader),
    /// Send the next chunk of the live log.
    Append(LogChunkHeader),
    /// Seal the acknowledged log into the artifact.
    Seal(Seal),
    /// Send the completion.
    Complete(Completion),
    /// Forget the job: record `Dropped` and remove its run directory (local).
    Drop,
}

impl Step {
    /// Whether the step sends a request to ql-control.
    pub(crate) fn is_remote(&self) -> bool {
        matches!(
            self,
            Self::Claim(_)
                | Self::Renew(_)
                | Self::Starting(_)
                | Self::Running(_)
                | Self::StartFailure(_)
                | Self::Upload(_)
                | Self::Append(_)
                | Self::Seal(_)
                | Self::Complete(_)
        )
    }
}

/// How long after a successful claim or renewal the next renewal is due: a third of the
/// lease's time to live, leaving two thirds for the renewal to get through.
pub(crate) fn renew_interval(lease: &Lease) -> Duration {
    Duration::from_millis(lease.ttl_ms / 3)
}

/// When the job's next renewal is due; `None` when it is due now (age unknown).
pub(crate) fn renew_at(lease: &Lease, rt: &Runtime) -> Option<Instant> {
    rt.lease_fresh_at.map(|t| t + renew_interval(lease))
}

/// Decides the next step for `job`.
pub(crate) fn next(key: &JobKey, job: &Job, rt: &Runtime, now: Now) -> Step {
    if rt.finished {
        return match (rt.process, &job.spawn, &job.exit) {
            (Process::Running, ..) => Step::Stop(StopCause::Ended),
            (Process::Stopping, ..) => Step::Wait(None),
            // Ended by the server, it has nothing to give up: no hold (see `Step::Recover`).
            (Process::Absent, Some(_), None) => Step::Recover,
            (Process::Absent, None, _) if unsettled_spawn(job, rt) => Step::Adopt,
            _ => Step::Drop,
        };
    }
    let Some(lease) = &job.lease else {
        return Step::Claim(Claim {
            generation: job.session_generation,
            run_id: job.run_id.clone(),
            attempt_id: key.attempt_id.clone(),
            lease_token: job.lease_token.clone(),
        });
    };
    let fence = fence(job, lease, version_in_doubt(lease, rt.renew_doubt));
    let renew_at = renew_at(lease, rt);
    let in_doubt = rt.renew_doubt != RenewDoubt::SURE;
    let renew_due = in_doubt || renew_at.is_none_or(|t| now.at >= t);
    let renew = || Step::Renew(fence.clone());

    if let Some(exit) = &job.exit {
        // The lease must outlive the upload and the completion: keep renewing while its
        // age is known. After a restart it is not, and the session may be gone, which a
        // completion does not need: report at once, unless a log is still to go out,
        // which takes as long as it takes (a lease left to lapse meanwhile would lose the
        // run's end, and run it again): then renew first. Once the server refuses a
        // renewal, report without them.
        let log_to_send = job.callback.as_ref().is_some_and(|c| c.log_artifact_id.is_some())
            && job.artifact.is_none()
            && !rt.log_lost;
        if renew_due && !rt.renewals_refused && (rt.lease_fresh_at.is_some() || log_to_send) {
            return renew();
        }
        let Some(callback) = &job.callback else {
            // The agent crashed between the spawn and the mint: the completion still needs
            // a callback token.
            return Step::MintCallback;
        };
        let stored = job.artifact.clone();
        if let (Some(artifact), None, false) = (&callback.log_artifact_id, &stored, rt.log_lost) {
            if !job.running_acked {
                return Step::Upload(ArtifactHeader::new(fence, ArtifactSchema, exit.log_len, exit.truncated));
            }
            if let Some(until) = rt.log_hold.holds(now.at) {
                return Step::Wait(earliest([renew_at.filter(|_| !rt.renewals_refused), Some(until)]));
            }
            if job.log_acked < exit.log_len {
                let len = (exit.log_len - job.log_acked).min(chunk_cap(rt, now.log));
                return Step::Append(LogChunkHeader::new(fence, LogChunkSchema, artifact.clone(), job.log_acked, len));
            }
            return Step::Seal(Seal::new(fence, exit.log_len, exit.truncated));
        }
        return Step::Complete(Completion::new(
            fence,
            CompletionSchema,
            callback.sequence,
            callback.token.clone(),
            exit.exit_code,
            exit.signal,
            exit.finished_at,
            if rt.log_lost { None } else { stored },
        ));
    }
    if let Some(reason) = &job.spawn_failure {
        // This agent records a spawn failure only after `starting`; a journal from elsewhere
        // may not have, and start-failure needs it.
        if !job.starting_acked {
            return Step::Starting(fence);
        }
        return Step::StartFailure(StartFailure::new(fence, reason.clone()));
    }
    let Some(spawn) = &job.spawn else {
        if renew_due {
            return renew();
        }
        if !job.starting_acked {
            return Step::Starting(fence);
        }
        if unsettled_spawn(job, rt) {
            return Step::Adopt;
        }
        if job.stop.is_some() {
            return Step::SkipSpawn(Reason::summarise(STOPPED_BEFORE_START));
        }
        if now.drain_by.is_some_and(|d| now.at >= d) {
            return Step::SkipSpawn(Reason::summarise(SHUT_DOWN_BEFORE_START));
        }
        return Step::Spawn;
    };
    let Some(callback) = &job.callback else {
        return Step::MintCallback;
    };
    match rt.process {
        Process::Absent => match rt.recover_hold.holds(now.at) {
            Some(_) if renew_due => renew(),
            Some(until) => Step::Wait(earliest([renew_at, Some(until)])),
            None => Step::Recover,
        },
        Process::Running => {
            if let Some(cause) = stop_cause(job, rt, now) {
                return Step::Stop(cause);
            }
            if renew_due {
                return renew();
            }
            if !job.running_acked {
                return Step::Running(Running::new(
                    fence,
                    spawn.executor_handle.clone(),
                    callback.log_artifact_id.clone(),
                    callback.sequence,
                    callback.token.digest(),
                ));
            }
            let (chunk, flush_at) = live_chunk(job, rt, now, &fence);
            if let Some(header) = chunk {
                return Step::Append(header);
            }
            Step::Wait(earliest([renew_at, rt.timeout_at, now.drain_by, flush_at]))
        }
        Process::Stopping if renew_due => renew(),
        Process::Stopping => Step::Wait(renew_at),
    }
}

/// The chunk a running job's log is due to send now, or when to look again.
fn live_chunk(job: &Job, rt: &Runtime, now: Now, fence: &Fence) -> (Option<LogChunkHeader>, Option<Instant>) {
    let Some(artifact) = job.callback.as_ref().and_then(|c| c.log_artifact_id.as_ref()).filter(|_| !rt.log_lost) else {
        return (None, None);
    };
    if let Some(until) = rt.log_hold.holds(now.at) {
        return (None, Some(until));
    }
    let waiting = rt.spooled.saturating_sub(job.log_acked);
    let flush_at = rt.log_sent_at.map(|t| t + now.log.flush);
    if waiting == 0 {
        // Output may come at any moment: look again within the flush interval.
        return (None, Some(flush_at.filter(|t| *t > now.at).unwrap_or(now.at + now.log.flush)));
    }
    if waiting >= now.log.flush_bytes || flush_at.is_none_or(|t| now.at >= t) {
        let len = waiting.min(chunk_cap(rt, now.log));
        let header = LogChunkHeader::new(fence.clone(), LogChunkSchema, artifact.clone(), job.log_acked, len);
        return (Some(header), None);
    }
    (None, flush_at)
}

/// The largest chunk to send now.
fn chunk_cap(rt: &Runtime, log: LogPolicy) -> u64 {
    if rt.chunk_cap == 0 {
        log.chunk_max
    } else {
        rt.chunk_cap.clamp(MIN_CHUNK.min(log.chunk_max), log.chunk_max)
    }
}

/// Whether a `log_offset_conflict` that says the server holds `acked` bytes of the log
/// moves the job on from `held`, what its journal holds acknowledged. One that names
/// exactly that contradicts its own refusal (a server or proxy misbehaving): repeating the
/// chunk or the seal at once would loop, so the job's log is held back for a back-off
/// ([`Runtime::log_hold`]) while its renewals and the other jobs go on.
pub(crate) fn conflict_moves(held: u64, acked: u64) -> bool {
    acked != held
}

/// The next chunk cap after `sent` bytes went through in `took`: what the uplink carries
/// in a sixth of the lease (`lease_ttl`), within [`MIN_CHUNK`]..=`max`. A chunk is given a
/// third of the lease, so one that takes a sixth leaves room for a slower moment; a
/// renewal waits for at most one chunk.
pub(crate) fn adapt_chunk(sent: u64, took: Duration, lease_ttl: Duration, max: u64) -> u64 {
    let target = lease_ttl / 6;
    let took_us = took.as_micros().max(1);
    let fits = u128::from(sent).saturating_mul(target.as_micros()) / took_us;
    u64::try_from(fits).unwrap_or(u64::MAX).clamp(MIN_CHUNK.min(max), max)
}

/// The next chunk cap after a chunk of `cap` bytes did not get through in time: half.
pub(crate) fn shrink_chunk(cap: u64, max: u64) -> u64 {
    (if cap == 0 { max } else { cap } / 2).max(MIN_CHUNK.min(max))
}

/// Why the running process must stop now, if it must: the server's intent first, then
/// the local timeout, then the drain.
fn stop_cause(job: &Job, rt: &Runtime, now: Now) -> Option<StopCause> {
    if let Some(intent) = job.stop {
        return Some(StopCause::Intent(intent));
    }
    if rt.timeout_at.is_some_and(|t| now.at >= t) {
        return Some(StopCause::Timeout);
    }
    if now.drain_by.is_some_and(|d| now.at >= d) {
        return Some(StopCause::Drain);
    }
    None
}

/// Whether a `spawning` intent on record has no known outcome yet.
fn unsettled_spawn(job: &Job, rt: &Runtime) -> bool {
    job.spawning && job.spawn.is_none() && job.spawn_failure.is_none() && !rt.unstarted
}

fn earliest<const N: usize>(times: [Option<Instant>; N]) -> Option<Instant> {
    times.into_iter().flatten().min()
}

/// The fence of `job` at `version`.
/// The `abandon` of `job`, with the fence its next command would carry (`None` before a
/// claim: there is no lease to give up).
pub(crate) fn abandon(job: &Job, rt: &Runtime) -> Option<Abandon> {
    let lease = job.lease.as_ref()?;
    Some(Abandon::new(fence(job, lease, version_in_doubt(lease, rt.renew_doubt)), Reason::summarise(JOB_LOST)))
}

fn fence(job: &Job, lease: &Lease, version: Counter) -> Fence {
    Fence {
        session_generation: job.session_generation,
        offer_id: job.offer_id.clone(),
        lease_generation: lease.generation,
        lease_token: job.lease_token.clone(),
        expected_lease_version: version,
    }
}

/// The version fenced commands present: the journal's, moved on by each renewal a
/// `lease_conflict` proved applied while its answer was in doubt.
pub(crate) fn version_in_doubt(lease: &Lease, doubt: RenewDoubt) -> Counter {
    // At the counter's end there is no next version; the server refuses either way.
    (0..doubt.ahead).try_fold(lease.version, |v, _| v.next()).unwrap_or(lease.version)
}

/// When the lease of a claim that just succeeded was last fresh: when this agent first
/// sent the claim (a send whose answer was lost may have made the lease), or unknown — so
/// renewed first — for a job found in the journal, whose claim may predate the restart.
pub(crate) fn claimed_fresh_at(rt: &Runtime) -> Option<Instant> {
    if rt.resumed {
        None
    } else {
        rt.claim_sent_at
    }
}

/// The record that settles the version after a fenced command succeeded with a later one
/// ([`RenewDoubt::ahead`]): the lost renewals did apply.
pub(crate) fn settled(key: &JobKey, job: &Job, doubt: RenewDoubt) -> Option<Record> {
    let lease = job.lease.as_ref()?;
    let version = version_in_doubt(lease, doubt);
    (version > lease.version).then(|| Record::Renewed { job: key.clone(), lease_version: version })
}

/// The record that makes a claim's answer durable.
pub(crate) fn claimed(key: &JobKey, answer: &Claimed) -> Record {
    Record::Claimed {
        job: key.clone(),
        lease_generation: answer.lease_generation,
        lease_version: answer.lease_version,
        lease_ttl_ms: answer.lease_ttl_ms,
        spec: answer.spec.clone(),
    }
}

/// The records that make a renewal's answer durable: the new version (when it advanced,
/// as it always should) and the stop intent it delivered.
pub(crate) fn renewed(key: &JobKey, job: &Job, answer: &Renewed) -> Vec<Record> {
    let mut out = Vec::new();
    if job.lease.as_ref().is_some_and(|l| answer.lease_version > l.version) {
        out.push(Record::Renewed { job: key.clone(), lease_version: answer.lease_version });
    }
    if let Some(intent) = answer.stop {
        // Only a stronger intent is news: repeating the same one would grow the journal
        // every renewal while a stopped job winds down.
        if StopIntent::strongest(job.stop, Some(intent)) != job.stop {
            out.push(Record::StopSeen { job: key.clone(), intent });
        }
    }
    out
}

/// The callback record for a fresh `token`.
pub(crate) fn minted(key: &JobKey, token: Token) -> Record {
    Record::CallbackMinted {
        job: key.clone(),
        callback_sequence: Counter::ONE,
        callback_token: token,
        log_artifact_id: Some(ArtifactId::parse(LOG_ARTIFACT_ID).expect("a valid artifact id")),
    }
}

/// How a process ended, as the agent saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ending {
    /// The exit code.
    pub(crate) exit_code: Option<i32>,
    /// The signal.
    pub(crate) signal: Option<i32>,
    /// Wall-clock time of the observation (evidence only).
    pub(crate) finished_at: Timestamp,
    /// Bytes in the spool.
    pub(crate) log_len: u64,
    /// Whether output was cut.
    pub(crate) truncated: bool,
}

/// The record of a process's end.
pub(crate) fn exited(key: &JobKey, e: Ending) -> Record {
    Record::Exited {
        job: key.clone(),
        exit_code: e.exit_code,
        // The protocol admits signals 1..=64; anything else is no signal it can carry.
        signal: e.signal.filter(|s| (1..=64).contains(s)),
        finished_at: e.finished_at,
        log_len: e.log_len,
        truncated: e.truncated,
    }
}

/// What a refused command means for the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// The authority was unreachable: repeat the same request after a backoff.
    Retry,
    /// The server will not accept this job's command (a fence, state or replay drift, an
    /// unknown job, or a request it cannot parse, which repeating cannot mend): stop the
    /// job and forget it.
    EndJob,
    /// The credentials or the configuration are wrong: nothing works until an operator
    /// acts. Back off and keep trying, loudly.
    Misconfigured,
}

/// The server's clock as an answer showed it: its time `ms` (milliseconds since the
/// epoch, from the answer's `Date`) when the answer arrived, `at`. The server stamped it
/// before the answer left, in whole seconds, so the estimate never runs ahead of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServerClock {
    pub(crate) at: Instant,
    pub(crate) ms: i64,
}

impl ServerClock {
    /// The server's time at `now`, by this machine's monotonic clock since the answer.
    pub(crate) fn at(&self, now: Instant) -> i64 {
        let since = now.saturating_duration_since(self.at).as_millis();
        self.ms.saturating_add(i64::try_from(since).unwrap_or(i64::MAX))
    }
}

/// The `finishedAt` evidence for a process that ended at `wall` by this machine's clock:
/// `wall`, unless that runs ahead of the server's clock, which then caps it. A router
/// without a battery-backed clock can be far off, and the server refuses a completion
/// whose `finishedAt` is more than five minutes ahead of its own time — every run of such
/// a router would be lost. (A clock that runs behind is harmless: the server takes the
/// later of its own time and the evidence.)
pub(crate) fn evidence_time(wall: Timestamp, server: Option<ServerClock>, now: Instant) -> Timestamp {
    match server.map(|c| c.at(now)) {
        Some(server_ms) if server_ms < wall.millis() => Timestamp::from_millis(server_ms).unwrap_or(wall),
        _ => wall,
    }
}

/// What a refusal with `code` means.
pub(crate) fn disposition(code: ErrorCode) -> Disposition {
    match code {
        ErrorCode::Unavailable => Disposition::Retry,
        // `forbidden` is the operator API's; a worker route never answers it.
        ErrorCode::Unauthenticated
        | ErrorCode::PrincipalMismatch
        | ErrorCode::EnrolmentRefused
        | ErrorCode::Forbidden => Disposition::Misconfigured,
        // The server gave the worker's attempts up when it revoked or disabled it, and
        // queued their runs again: running on here would only duplicate them.
        ErrorCode::CertificateRevoked
        | ErrorCode::WorkerDisabled
        | ErrorCode::NotFound
        | ErrorCode::SessionConflict
        | ErrorCode::OfferConflict
        | ErrorCode::LeaseConflict
        | ErrorCode::StateConflict
        | ErrorCode::ReplayMismatch
        | ErrorCode::AlreadyTerminal
        | ErrorCode::ArtifactConflict
        | ErrorCode::LogOffsetConflict
        | ErrorCode::InvalidRequest
        | ErrorCode::LengthRequired
        | ErrorCode::PayloadTooLarge
        | ErrorCode::UnsupportedMediaType => Disposition::EndJob,
    }
}

/// Whether a fenced command other than a renewal that was refused with `code` deserves a
/// repeat with the next lease version ([`RenewDoubt::next`]): a renewal whose answer was
/// lost, or that was in flight when the agent died, may have moved the version on.
pub(crate) fn retry_next_version(doubt: RenewDoubt, code: ErrorCode) -> bool {
    doubt.unsure && code == ErrorCode::LeaseConflict
}

/// What a renewal refusal that ends the lease's renewals means for the job: it ends, unless
/// its process already ended — then its report (upload and completion, which need no live
/// session) still goes out, unrenewed, and their own refusal ends it.
pub(crate) fn renewal_refused_ends_job(job: &Job) -> bool {
    job.exit.is_none()
}

/// The renewal doubt after a renewal failed with `code` (`None`: the answer was lost in
/// transport). `None` as the result: the job must end.
pub(crate) fn renew_failed(doubt: RenewDoubt, code: Option<ErrorCode>) -> Option<RenewDoubt> {
    match code.map(disposition) {
        None | Some(Disposition::Retry) => Some(doubt.lost()),
        Some(Disposition::Misconfigured) => Some(doubt),
        Some(Disposition::EndJob) if code == Some(ErrorCode::LeaseConflict) && doubt.unsure => Some(doubt.next()),
        Some(Disposition::EndJob) => None,
    }
}

/// Whether a reload may hand the running jobs over to the next start (exit at once, each
/// left to its supervisor): only when every process still running has one. A process that
/// runs in the agent itself, for good (`supervise_jobs` off) or this once (its supervisor
/// was too slow to start), ends with the agent, and the next one would find no end of it
/// on record, report it lost and let its run go again: then the reload drains instead.
pub(crate) fn may_hand_over<'a>(supervise_jobs: bool, jobs: impl IntoIterator<Item = &'a Runtime>) -> bool {
    supervise_jobs && !jobs.into_iter().any(|rt| rt.in_agent && rt.process != Process::Absent)
}

/// The longest wait between repeated calls: `max`, or a sixth of the shortest lease held,
/// whichever is shorter (never below 100 ms). A lease the server gave back after an outage
/// has its whole TTL to see the next renewal; six tries fit in it.
pub(crate) fn backoff_cap(max: Duration, shortest_lease_ms: Option<u64>) -> Duration {
    shortest_lease_ms.map_or(max, |ttl| max.min(Duration::from_millis(ttl / 6).max(Duration::from_millis(100))))
}

/// How much of a `Retry-After` the agent honours: all of it, unless a job holds a lease,
/// then no more than the back-off's cap ([`backoff_cap`]). A wait past the lease's lapse
/// would end jobs that still run, and a proxy in front of the replicas may ask for minutes.
pub(crate) fn honoured_retry_after(retry_after: Option<Duration>, lease_cap: Option<Duration>) -> Option<Duration> {
    retry_after.map(|r| lease_cap.map_or(r, |cap| r.min(cap)))
}

/// The wait before repeating a call after `failures` failures in a row: doubling from
/// `initial`, capped at `max`, half of it fixed and half drawn from `random` (so agents that
/// lost the server together do not return together), and never shorter than the server's
/// `Retry-After`.
pub(crate) fn backoff(
    initial: Duration,
    max: Duration,
    failures: u32,
    random: u64,
    retry_after: Option<Duration>,
) -> Duration {
    let full = doubled(initial, failures).min(max);
    let half = full / 2;
    let span = u64::try_from(half.as_millis()).unwrap_or(u64::MAX).saturating_add(1);
    let wait = half + Duration::from_millis(random % span);
    retry_after.map_or(wait, |r| wait.max(r))
}

/// `initial` doubled for each failure in a row after the first, uncapped.
fn doubled(initial: Duration, failures: u32) -> Duration {
    initial.saturating_mul(1u32 << failures.saturating_sub(1).min(30))
}

#[cfg(test)]
mod tests;
