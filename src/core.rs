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
//! Claim -> Starting -> Spawn -> MintCallback -> Running -> Wait/Renew ... exit
//!       -> Upload (the log) -> Complete -> Drop
//! ```
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
//! - the agent restarted while the process ran: `Recover` (find it by its handle, stop it,
//!   record how it ended), then `Upload` and `Complete`;
//! - the server ended the job (a 409 or 404) or holds its result: `Stop` whatever still
//!   runs, then `Drop`.
//!
//! The renewal cadence is a third of the server's `leaseTtlMs` after the last claim or
//! renewal that succeeded, measured from when its request was sent. A renewal whose answer
//! was lost may still have advanced the lease version; [`renew_failed`] and [`RenewDoubt`]
//! resolve that (repeat with the same version, then with the next one) before any other
//! fenced command is sent.

use std::time::{Duration, Instant};

use ql_wire::ack::{Running, StartFailure};
use ql_wire::artifact::{ArtifactHeader, ArtifactSchema};
use ql_wire::capability::Token;
use ql_wire::completion::{Completion, CompletionSchema};
use ql_wire::ids::{ArtifactId, Counter};
use ql_wire::lease::{Renewed, StopIntent};
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

/// Whether the last renewal's outcome is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RenewDoubt {
    /// The lease version in the journal is the server's.
    Sure,
    /// A renewal's answer was lost: the server may have advanced the version. Repeat it.
    AnswerLost,
    /// The repeat met `lease_conflict`, so the lost renewal most likely applied: renew
    /// with the next version.
    TryNext,
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
}

impl Default for Runtime {
    fn default() -> Self {
        Self {
            lease_fresh_at: None,
            timeout_at: None,
            process: Process::Absent,
            renew_doubt: RenewDoubt::Sure,
            log_lost: false,
            finished: false,
        }
    }
}

/// The moment a decision is made, with the agent-wide facts that bear on every job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Now {
    /// The monotonic now.
    pub(crate) at: Instant,
    /// While draining: when running jobs are stopped.
    pub(crate) drain_by: Option<Instant>,
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
    /// Start the process (local).
    Spawn,
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
    /// Upload the log.
    Upload(ArtifactHeader),
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
            (Process::Absent, Some(_), None) => Step::Recover,
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
    let fence = fence(job, lease, lease.version);
    let renew_at = renew_at(lease, rt);
    let in_doubt = rt.renew_doubt != RenewDoubt::Sure;
    let renew_due = in_doubt || renew_at.is_none_or(|t| now.at >= t);
    let renew = || Step::Renew(renew_fence(job, lease, rt.renew_doubt));

    if let Some(exit) = &job.exit {
        // Upload and completion need not renew (the process is done), but they must not
        // present a version the server may have moved past.
        if in_doubt {
            return renew();
        }
        let Some(callback) = &job.callback else {
            // The agent crashed between the spawn and the mint: the completion still needs
            // a callback token.
            return Step::MintCallback;
        };
        let stored = job.artifact.clone();
        if let (Some(_), None, false) = (&callback.log_artifact_id, &stored, rt.log_lost) {
            return Step::Upload(ArtifactHeader::new(fence, ArtifactSchema, exit.log_len, exit.truncated));
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
        if in_doubt {
            return renew();
        }
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
        Process::Absent => Step::Recover,
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
            Step::Wait(earliest([renew_at, rt.timeout_at, now.drain_by]))
        }
        Process::Stopping if renew_due => renew(),
        Process::Stopping => Step::Wait(renew_at),
    }
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

fn earliest<const N: usize>(times: [Option<Instant>; N]) -> Option<Instant> {
    times.into_iter().flatten().min()
}

/// The fence of `job` at `version`.
fn fence(job: &Job, lease: &Lease, version: Counter) -> Fence {
    Fence {
        session_generation: job.session_generation,
        offer_id: job.offer_id.clone(),
        lease_generation: lease.generation,
        lease_token: job.lease_token.clone(),
        expected_lease_version: version,
    }
}

fn renew_fence(job: &Job, lease: &Lease, doubt: RenewDoubt) -> Fence {
    let version = match doubt {
        RenewDoubt::Sure | RenewDoubt::AnswerLost => lease.version,
        // At the counter's end there is no next version; the server refuses either way.
        RenewDoubt::TryNext => lease.version.next().unwrap_or(lease.version),
    };
    fence(job, lease, version)
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

/// What a refusal with `code` means.
pub(crate) fn disposition(code: ErrorCode) -> Disposition {
    match code {
        ErrorCode::Unavailable => Disposition::Retry,
        ErrorCode::Unauthenticated | ErrorCode::PrincipalMismatch => Disposition::Misconfigured,
        ErrorCode::NotFound
        | ErrorCode::SessionConflict
        | ErrorCode::OfferConflict
        | ErrorCode::LeaseConflict
        | ErrorCode::StateConflict
        | ErrorCode::ReplayMismatch
        | ErrorCode::AlreadyTerminal
        | ErrorCode::ArtifactConflict
        | ErrorCode::InvalidRequest
        | ErrorCode::LengthRequired
        | ErrorCode::PayloadTooLarge
        | ErrorCode::UnsupportedMediaType => Disposition::EndJob,
    }
}

/// The renewal doubt after a renewal failed with `code` (`None`: the answer was lost in
/// transport). `None` as the result: the job must end.
pub(crate) fn renew_failed(doubt: RenewDoubt, code: Option<ErrorCode>) -> Option<RenewDoubt> {
    let lost = if doubt == RenewDoubt::Sure { RenewDoubt::AnswerLost } else { doubt };
    match code.map(disposition) {
        None | Some(Disposition::Retry) => Some(lost),
        Some(Disposition::Misconfigured) => Some(doubt),
        Some(Disposition::EndJob) if code == Some(ErrorCode::LeaseConflict) && doubt == RenewDoubt::AnswerLost => {
            Some(RenewDoubt::TryNext)
        }
        Some(Disposition::EndJob) => None,
    }
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
    let doublings = failures.saturating_sub(1).min(30);
    let full = initial.saturating_mul(1u32 << doublings).min(max);
    let half = full / 2;
    let span = u64::try_from(half.as_millis()).unwrap_or(u64::MAX).saturating_add(1);
    let wait = half + Duration::from_millis(random % span);
    retry_after.map_or(wait, |r| wait.max(r))
}

#[cfg(test)]
mod tests;
