//! What the journal remembers, as values: the [`Record`]s that are written to disk and the
//! [`JournalState`] they fold into.
//!
//! [`JournalState::apply`] is pure: it checks a record against the state and either refuses
//! it, leaving the state untouched, or applies all of it. Recovery replays the file through
//! the same function, so the state after a restart is the state before it.

use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Token;
use ql_wire::ids::{ArtifactId, AttemptId, Counter, OfferId, RunId, SessionId};
use ql_wire::lease::StopIntent;
use ql_wire::spec::ExecutionSpec;
use ql_wire::text::{ExecutorHandle, Reason};
use ql_wire::time::Timestamp;

/// Which job a record speaks of: the attempt, under the session that claimed it. A restarted
/// agent may hold a newer session while it finishes jobs claimed under an older one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct JobKey {
    /// The session that claimed the offer.
    pub(crate) session_id: SessionId,
    /// The attempt the offer started.
    pub(crate) attempt_id: AttemptId,
}

/// One durable fact. Each is appended (and fsynced) before the agent acts on it.
///
/// The JSON form is `{"kind":"<variant>", ...fields}` with camelCase names; raw tokens are
/// written in the clear because this file is the one place that must keep them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase", rename_all_fields = "camelCase", deny_unknown_fields)]
pub(crate) enum Record {
    /// The agent's current session (a newer one replaces it).
    Session {
        /// The session.
        session_id: SessionId,
        /// Its generation.
        generation: Counter,
        /// The server's heartbeat interval: a restarted agent resumes the session with a
        /// heartbeat and then needs the interval, which only `open` reports.
        heartbeat_ms: u64,
    },
    /// The agent closed its session on a clean exit: the next start opens a fresh one
    /// rather than trying to resume it.
    SessionClosed {
        /// The session.
        session_id: SessionId,
    },
    /// An offer and the lease token made for it, written before the claim is sent.
    Offered {
        /// The session that polled the offer and will claim it.
        session_id: SessionId,
        /// That session's generation.
        session_generation: Counter,
        /// The offer.
        offer_id: OfferId,
        /// The offer's run.
        run_id: RunId,
        /// The offer's attempt.
        attempt_id: AttemptId,
        /// The fresh lease token the claim will present.
        #[serde(serialize_with = "expose_token")]
        lease_token: Token,
    },
    /// The claim's answer.
    Claimed {
        /// The job.
        job: JobKey,
        /// The lease's generation.
        lease_generation: Counter,
        /// The lease's version.
        lease_version: Counter,
        /// The lease's time to live.
        lease_ttl_ms: u64,
        /// What to run.
        spec: ExecutionSpec,
    },
    /// A renewal advanced the lease version.
    Renewed {
        /// The job.
        job: JobKey,
        /// The new version.
        lease_version: Counter,
    },
    /// The `starting` ACK was accepted.
    StartingAcked {
        /// The job.
        job: JobKey,
    },
    /// The process is about to be started: written before its run directory is made and
    /// it is forked. A restart that finds this without `spawned` or `spawnFailed` cannot
    /// know whether the process started, so it looks for it (by the attempt id in its
    /// environment) instead of starting it again.
    Spawning {
        /// The job.
        job: JobKey,
    },
    /// The process was started.
    Spawned {
        /// The job.
        job: JobKey,
        /// How to find the process again after a restart.
        executor_handle: ExecutorHandle,
        /// The process id.
        pid: u32,
        /// The process group the job runs in.
        pgid: u32,
    },
    /// The process could not be started; a `start-failure` is owed.
    SpawnFailed {
        /// The job.
        job: JobKey,
        /// What to report.
        reason: Reason,
    },
    /// The callback capability, written before the `running` ACK that registers its digest
    /// (a completion from `starting` needs it too).
    CallbackMinted {
        /// The job.
        job: JobKey,
        /// The callback sequence the ACK registers.
        callback_sequence: Counter,
        /// The raw callback token the completion presents.
        #[serde(serialize_with = "expose_token")]
        callback_token: Token,
        /// The artifact the log will be uploaded as, if any.
        log_artifact_id: Option<ArtifactId>,
    },
    /// The `running` ACK was accepted.
    RunningAcked {
        /// The job.
        job: JobKey,
    },
    /// The process ended: the evidence a completion reports.
    Exited {
        /// The job.
        job: JobKey,
        /// The exit code, when it exited.
        exit_code: Option<i32>,
        /// The signal, when a signal ended it.
        signal: Option<i32>,
        /// When the agent saw it end (evidence, not authority).
        finished_at: Timestamp,
        /// Bytes of log kept in the spool.
        log_len: u64,
        /// Whether the log was cut at its limit.
        truncated: bool,
    },
    /// The server acknowledged the live log up to `acked` bytes (PROTOCOL §13): the next
    /// chunk starts there, and the spool may let go of everything before it.
    LogAcked {
        /// The job.
        job: JobKey,
        /// Bytes acknowledged from offset 0.
        acked: u64,
    },
    /// The log was stored; the completion must present this receipt.
    ArtifactStored {
        /// The job.
        job: JobKey,
        /// The store's receipt.
        receipt: Receipt,
    },
    /// A renewal delivered a stop intent.
    StopSeen {
        /// The job.
        job: JobKey,
        /// The intent; the strongest seen is kept.
        intent: StopIntent,
    },
    /// The job is finished with (completed, or its lease was lost); forget it.
    Dropped {
        /// The job.
        job: JobKey,
    },
}

// `Token` serialises through an owned `String` copy that is never wiped; writing the
// borrowed text directly keeps the only extra copy in the caller's zeroizing buffer.
fn expose_token<S: Serializer>(token: &Token, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(token.expose())
}

/// The agent's current session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CurrentSession {
    /// The session.
    pub(crate) session_id: SessionId,
    /// Its generation.
    pub(crate) generation: Counter,
    /// The server's heartbeat interval.
    pub(crate) heartbeat_ms: u64,
}

/// The lease a claim granted and what it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lease {
    /// The lease's generation.
    pub(crate) generation: Counter,
    /// The last version the agent saw; the next command's expected version.
    pub(crate) version: Counter,
    /// The lease's time to live.
    pub(crate) ttl_ms: u64,
    /// What to run.
    pub(crate) spec: ExecutionSpec,
}

/// The started process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Spawn {
    /// How to find the process again.
    pub(crate) executor_handle: ExecutorHandle,
    /// The process id.
    pub(crate) pid: u32,
    /// The process group.
    pub(crate) pgid: u32,
}

/// The callback capability registered (or to be registered) by `running`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Callback {
    /// The callback sequence.
    pub(crate) sequence: Counter,
    /// The raw callback token.
    pub(crate) token: Token,
    /// The log's artifact id, if any.
    pub(crate) log_artifact_id: Option<ArtifactId>,
}

/// How the process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExitEvidence {
    /// The exit code.
    pub(crate) exit_code: Option<i32>,
    /// The signal.
    pub(crate) signal: Option<i32>,
    /// When the agent saw it end.
    pub(crate) finished_at: Timestamp,
    /// Bytes of log kept.
    pub(crate) log_len: u64,
    /// Whether the log was cut.
    pub(crate) truncated: bool,
}

/// Everything the agent holds about one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Job {
    /// The claiming session's generation.
    pub(crate) session_generation: Counter,
    /// The offer.
    pub(crate) offer_id: OfferId,
    /// The run.
    pub(crate) run_id: RunId,
    /// The raw lease token.
    pub(crate) lease_token: Token,
    /// Set by the claim's answer.
    pub(crate) lease: Option<Lease>,
    /// Whether `starting` was accepted.
    pub(crate) starting_acked: bool,
    /// Whether the agent set out to start the process (see [`Record::Spawning`]).
    pub(crate) spawning: bool,
    /// Set once the process started.
    pub(crate) spawn: Option<Spawn>,
    /// Set when the process could not start.
    pub(crate) spawn_failure: Option<Reason>,
    /// Set before the `running` ACK.
    pub(crate) callback: Option<Callback>,
    /// Whether `running` was accepted.
    pub(crate) running_acked: bool,
    /// Set once the process ended.
    pub(crate) exit: Option<ExitEvidence>,
    /// Bytes of the live log the server acknowledged.
    pub(crate) log_acked: u64,
    /// Set once the log was stored.
    pub(crate) artifact: Option<Receipt>,
    /// The strongest stop intent seen.
    pub(crate) stop: Option<StopIntent>,
}

/// Everything the journal holds: the current session and the jobs, keyed by session and
/// attempt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct JournalState {
    /// The agent's current session, once it has one.
    pub(crate) session: Option<CurrentSession>,
    /// The jobs the agent holds.
    pub(crate) jobs: BTreeMap<JobKey, Job>,
}

/// Why [`JournalState::apply`] refused a record. A refused record changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The record names a job the state does not hold.
    UnknownJob,
    /// An offer for a job the state already holds.
    DuplicateJob,
    /// A step whose prerequisite is missing (a spawn before the claim, say).
    TooEarly,
    /// A step that was already recorded, or one that excludes it (a spawn after a spawn
    /// failure).
    Repeated,
    /// A renewal whose version does not advance the lease's.
    StaleLeaseVersion,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::UnknownJob => "the record names a job the journal does not hold",
            Self::DuplicateJob => "the journal already holds this job",
            Self::TooEarly => "a step the record depends on is missing",
            Self::Repeated => "the step was already recorded",
            Self::StaleLeaseVersion => "the lease version does not advance",
        })
    }
}

impl std::error::Error for Refused {}

impl Record {
    /// The job the record speaks of, if any.
    pub(crate) fn job(&self) -> Option<JobKey> {
        match self {
            Self::Session { .. } | Self::SessionClosed { .. } => None,
            Self::Offered { session_id, attempt_id, .. } => {
                Some(JobKey { session_id: session_id.clone(), attempt_id: attempt_id.clone() })
            }
            Self::Claimed { job, .. }
            | Self::Renewed { job, .. }
            | Self::StartingAcked { job }
            | Self::Spawning { job }
            | Self::Spawned { job, .. }
            | Self::SpawnFailed { job, .. }
            | Self::CallbackMinted { job, .. }
            | Self::RunningAcked { job }
            | Self::Exited { job, .. }
            | Self::LogAcked { job, .. }
            | Self::ArtifactStored { job, .. }
            | Self::StopSeen { job, .. }
            | Self::Dropped { job } => Some(job.clone()),
        }
    }
}

fn require(ok: bool, refused: Refused) -> Result<(), Refused> {
    if ok {
        Ok(())
    } else {
        Err(refused)
    }
}

impl JournalState {
    /// Whether `record` would apply, without changing anything.
    pub(crate) fn check(&self, record: &Record) -> Result<(), Refused> {
        let job = match record {
            Record::Session { .. } | Record::SessionClosed { .. } => return Ok(()),
            Record::Offered { session_id, attempt_id, .. } => {
                let key = JobKey { session_id: session_id.clone(), attempt_id: attempt_id.clone() };
                return require(!self.jobs.contains_key(&key), Refused::DuplicateJob);
            }
            other => {
                let key = other.job().expect("every record but Session and Offered names a job");
                self.jobs.get(&key).ok_or(Refused::UnknownJob)?
            }
        };
        let claimed = job.lease.is_some();
        match record {
            Record::Session { .. } | Record::SessionClosed { .. } | Record::Offered { .. } | Record::Dropped { .. } => {
                Ok(())
            }
            Record::Claimed { .. } => require(!claimed, Refused::Repeated),
            Record::Renewed { lease_version, .. } => {
                let lease = job.lease.as_ref().ok_or(Refused::TooEarly)?;
                require(*lease_version > lease.version, Refused::StaleLeaseVersion)
            }
            Record::StartingAcked { .. } => {
                require(claimed, Refused::TooEarly)?;
                require(!job.starting_acked, Refused::Repeated)
            }
            Record::Spawning { .. } => {
                require(claimed, Refused::TooEarly)?;
                require(!job.spawning && job.spawn.is_none() && job.spawn_failure.is_none(), Refused::Repeated)
            }
            Record::Spawned { .. } | Record::SpawnFailed { .. } => {
                require(claimed, Refused::TooEarly)?;
                require(job.spawn.is_none() && job.spawn_failure.is_none(), Refused::Repeated)
            }
            Record::CallbackMinted { .. } => {
                require(claimed, Refused::TooEarly)?;
                require(job.callback.is_none(), Refused::Repeated)
            }
            Record::RunningAcked { .. } => {
                require(job.starting_acked && job.spawn.is_some() && job.callback.is_some(), Refused::TooEarly)?;
                require(!job.running_acked, Refused::Repeated)
            }
            Record::Exited { .. } => {
                require(job.spawn.is_some(), Refused::TooEarly)?;
                require(job.exit.is_none(), Refused::Repeated)
            }
            Record::LogAcked { acked, .. } => {
                require(job.running_acked, Refused::TooEarly)?;
                require(job.artifact.is_none() && *acked > job.log_acked, Refused::Repeated)?;
                // After the exit the spool's length is known: nothing past it was sent.
                require(job.exit.as_ref().is_none_or(|e| *acked <= e.log_len), Refused::TooEarly)
            }
            Record::ArtifactStored { .. } => {
                require(job.exit.is_some(), Refused::TooEarly)?;
                require(job.artifact.is_none(), Refused::Repeated)
            }
            Record::StopSeen { .. } => require(claimed, Refused::TooEarly),
        }
    }

    /// Applies one record, or refuses it and changes nothing.
    pub(crate) fn apply(&mut self, record: &Record) -> Result<(), Refused> {
        self.check(record)?;
        if let Record::Session { session_id, generation, heartbeat_ms } = record {
            self.session = Some(CurrentSession {
                session_id: session_id.clone(),
                generation: *generation,
                heartbeat_ms: *heartbeat_ms,
            });
            return Ok(());
        }
        if let Record::SessionClosed { session_id } = record {
            if self.session.as_ref().is_some_and(|s| &s.session_id == session_id) {
                self.session = None;
            }
            return Ok(());
        }
        let key = record.job().expect("every record but the session's names a job");
        if let Record::Offered { session_generation, offer_id, run_id, lease_token, .. } = record {
            let job = Job {
                session_generation: *session_generation,
                offer_id: offer_id.clone(),
                run_id: run_id.clone(),
                lease_token: lease_token.clone(),
                lease: None,
                starting_acked: false,
                spawning: false,
                spawn: None,
                spawn_failure: None,
                callback: None,
                running_acked: false,
                exit: None,
                log_acked: 0,
                artifact: None,
                stop: None,
            };
            self.jobs.insert(key, job);
            return Ok(());
        }
        if let Record::Dropped { .. } = record {
            self.jobs.remove(&key);
            return Ok(());
        }
        let job = self.jobs.get_mut(&key).expect("check found the job");
        match record {
            Record::Session { .. } | Record::SessionClosed { .. } | Record::Offered { .. } | Record::Dropped { .. } => {
                unreachable!("handled above")
            }
            Record::Claimed { lease_generation, lease_version, lease_ttl_ms, spec, .. } => {
                job.lease = Some(Lease {
                    generation: *lease_generation,
                    version: *lease_version,
                    ttl_ms: *lease_ttl_ms,
                    spec: spec.clone(),
                });
            }
            Record::Renewed { lease_version, .. } => {
                job.lease.as_mut().expect("check saw the lease").version = *lease_version;
            }
            Record::StartingAcked { .. } => job.starting_acked = true,
            Record::Spawning { .. } => job.spawning = true,
            Record::Spawned { executor_handle, pid, pgid, .. } => {
                job.spawn = Some(Spawn { executor_handle: executor_handle.clone(), pid: *pid, pgid: *pgid });
            }
            Record::SpawnFailed { reason, .. } => job.spawn_failure = Some(reason.clone()),
            Record::CallbackMinted { callback_sequence, callback_token, log_artifact_id, .. } => {
                job.callback = Some(Callback {
                    sequence: *callback_sequence,
                    token: callback_token.clone(),
                    log_artifact_id: log_artifact_id.clone(),
                });
            }
            Record::RunningAcked { .. } => job.running_acked = true,
            Record::Exited { exit_code, signal, finished_at, log_len, truncated, .. } => {
                job.exit = Some(ExitEvidence {
                    exit_code: *exit_code,
                    signal: *signal,
                    finished_at: *finished_at,
                    log_len: *log_len,
                    truncated: *truncated,
                });
            }
            Record::LogAcked { acked, .. } => job.log_acked = *acked,
            Record::ArtifactStored { receipt, .. } => job.artifact = Some(receipt.clone()),
            Record::StopSeen { intent, .. } => job.stop = StopIntent::strongest(job.stop, Some(*intent)),
        }
        Ok(())
    }

    /// The records that rebuild this state from nothing, in an order [`apply`] accepts:
    /// what compaction writes. The session comes first, then each job's records.
    ///
    /// [`apply`]: JournalState::apply
    pub(crate) fn to_records(&self) -> Vec<Record> {
        let mut out: Vec<Record> = self.session_record().into_iter().collect();
        for (key, job) in &self.jobs {
            out.extend(job_records(key, job));
        }
        out
    }

    /// The record of the current session, if there is one.
    pub(crate) fn session_record(&self) -> Option<Record> {
        self.session.as_ref().map(|s| Record::Session {
            session_id: s.session_id.clone(),
            generation: s.generation,
            heartbeat_ms: s.heartbeat_ms,
        })
    }
}

/// The records that rebuild one job. Compaction writes them a job at a time so it never
/// holds a second copy of every spec at once.
pub(crate) fn job_records(key: &JobKey, job: &Job) -> Vec<Record> {
    let k = || key.clone();
    let mut out = vec![Record::Offered {
        session_id: key.session_id.clone(),
        session_generation: job.session_generation,
        offer_id: job.offer_id.clone(),
        run_id: job.run_id.clone(),
        attempt_id: key.attempt_id.clone(),
        lease_token: job.lease_token.clone(),
    }];
    if let Some(lease) = &job.lease {
        // The current version stands in for the claim's version and every renewal.
        out.push(Record::Claimed {
            job: k(),
            lease_generation: lease.generation,
            lease_version: lease.version,
            lease_ttl_ms: lease.ttl_ms,
            spec: lease.spec.clone(),
        });
    }
    if job.starting_acked {
        out.push(Record::StartingAcked { job: k() });
    }
    if job.spawning {
        out.push(Record::Spawning { job: k() });
    }
    if let Some(s) = &job.spawn {
        out.push(Record::Spawned { job: k(), executor_handle: s.executor_handle.clone(), pid: s.pid, pgid: s.pgid });
    }
    if let Some(reason) = &job.spawn_failure {
        out.push(Record::SpawnFailed { job: k(), reason: reason.clone() });
    }
    if let Some(c) = &job.callback {
        out.push(Record::CallbackMinted {
            job: k(),
            callback_sequence: c.sequence,
            callback_token: c.token.clone(),
            log_artifact_id: c.log_artifact_id.clone(),
        });
    }
    if job.running_acked {
        out.push(Record::RunningAcked { job: k() });
    }
    if job.log_acked > 0 {
        // The last acknowledgement stands in for every one before it.
        out.push(Record::LogAcked { job: k(), acked: job.log_acked });
    }
    if let Some(e) = &job.exit {
        out.push(Record::Exited {
            job: k(),
            exit_code: e.exit_code,
            signal: e.signal,
            finished_at: e.finished_at,
            log_len: e.log_len,
            truncated: e.truncated,
        });
    }
    if let Some(receipt) = &job.artifact {
        out.push(Record::ArtifactStored { job: k(), receipt: receipt.clone() });
    }
    if let Some(intent) = job.stop {
        out.push(Record::StopSeen { job: k(), intent });
    }
    out
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Records for tests, valid by construction.

    use super::*;
    use ql_wire::capability::Digest;
    use ql_wire::spec::SpecSchema;

    pub(crate) fn token(seed: u8) -> Token {
        Token::from_bytes(&std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))).unwrap()
    }

    pub(crate) fn key(session: &str, attempt: &str) -> JobKey {
        JobKey { session_id: SessionId::parse(session).unwrap(), attempt_id: AttemptId::parse(attempt).unwrap() }
    }

    pub(crate) fn c(n: u64) -> Counter {
        Counter::new(n).unwrap()
    }

    pub(crate) fn session(id: &str, generation: u64) -> Record {
        Record::Session { session_id: SessionId::parse(id).unwrap(), generation: c(generation), heartbeat_ms: 10_000 }
    }

    pub(crate) fn offered(k: &JobKey, seed: u8) -> Record {
        Record::Offered {
            session_id: k.session_id.clone(),
            session_generation: c(1),
            offer_id: OfferId::parse(format!("offer-{}", k.attempt_id)).unwrap(),
            run_id: RunId::parse(format!("run-{}", k.attempt_id)).unwrap(),
            attempt_id: k.attempt_id.clone(),
            lease_token: token(seed),
        }
    }

    pub(crate) fn spec() -> ExecutionSpec {
        let mut env = BTreeMap::new();
        env.insert("GREETING".parse().unwrap(), "hello \"quoted\" \u{1F600}".to_owned());
        ExecutionSpec {
            schema: SpecSchema,
            project_id: "proj-1".parse().unwrap(),
            argv: None,
            script: Some(ql_wire::spec::Script {
                interpreter: ql_wire::spec::Interpreter::Sh,
                source: "echo \"$GREETING\"\nexit 0\n".to_owned(),
            }),
            env,
            timeout_ms: 60_000,
            log_limit_bytes: 1 << 20,
        }
    }

    pub(crate) fn claimed(k: &JobKey) -> Record {
        Record::Claimed {
            job: k.clone(),
            lease_generation: c(1),
            lease_version: c(1),
            lease_ttl_ms: 30_000,
            spec: spec(),
        }
    }

    pub(crate) fn spawned(k: &JobKey) -> Record {
        Record::Spawned {
            job: k.clone(),
            executor_handle: ExecutorHandle::parse("pid:4242 start:777").unwrap(),
            pid: 4242,
            pgid: 4242,
        }
    }

    pub(crate) fn minted(k: &JobKey, seed: u8) -> Record {
        Record::CallbackMinted {
            job: k.clone(),
            callback_sequence: c(1),
            callback_token: token(seed),
            log_artifact_id: Some(ArtifactId::parse("log-1").unwrap()),
        }
    }

    pub(crate) fn exited(k: &JobKey) -> Record {
        Record::Exited {
            job: k.clone(),
            exit_code: Some(0),
            signal: None,
            finished_at: Timestamp::parse("2026-11-30T08:00:00.000Z").unwrap(),
            log_len: 12,
            truncated: false,
        }
    }

    pub(crate) fn stored(k: &JobKey) -> Record {
        Record::ArtifactStored {
            job: k.clone(),
            receipt: Receipt {
                artifact_id: ArtifactId::parse("log-1").unwrap(),
                length: 12,
                sha256: Digest::of(b"hello world\n"),
                truncated: false,
            },
        }
    }

    /// Every step of one job's life, in the order the agent records them.
    pub(crate) fn lifecycle(k: &JobKey) -> Vec<Record> {
        vec![
            offered(k, 3),
            claimed(k),
            Record::StartingAcked { job: k.clone() },
            Record::Spawning { job: k.clone() },
            spawned(k),
            minted(k, 9),
            Record::RunningAcked { job: k.clone() },
            Record::LogAcked { job: k.clone(), acked: 5 },
            Record::Renewed { job: k.clone(), lease_version: c(2) },
            Record::StopSeen { job: k.clone(), intent: StopIntent::Cancel },
            exited(k),
            Record::LogAcked { job: k.clone(), acked: 12 },
            stored(k),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;

    fn replay(records: &[Record]) -> JournalState {
        let mut state = JournalState::default();
        for r in records {
            state.apply(r).unwrap_or_else(|e| panic!("{r:?} refused: {e}"));
        }
        state
    }

    /// Applies `record` expecting `want`, and checks a refusal left the state alone.
    fn expect(state: &mut JournalState, record: &Record, want: Result<(), Refused>) {
        let before = state.clone();
        assert_eq!(state.check(record), want, "check of {record:?}");
        assert_eq!(state.apply(record), want, "apply of {record:?}");
        if want.is_err() {
            assert_eq!(*state, before, "a refused {record:?} changed the state");
        }
    }

    #[test]
    fn a_full_lifecycle_builds_the_job_step_by_step() {
        let k = key("s1", "a1");
        let state = replay(&lifecycle(&k));
        let job = &state.jobs[&k];
        assert_eq!(job.lease_token, token(3));
        assert_eq!(job.offer_id.as_str(), "offer-a1");
        assert_eq!(job.run_id.as_str(), "run-a1");
        let lease = job.lease.as_ref().unwrap();
        assert_eq!((lease.generation, lease.version, lease.ttl_ms), (c(1), c(2), 30_000));
        assert_eq!(lease.spec, spec());
        assert!(job.starting_acked && job.running_acked);
        assert_eq!(job.spawn.as_ref().unwrap().pgid, 4242);
        let cb = job.callback.as_ref().unwrap();
        assert_eq!((cb.sequence, &cb.token), (c(1), &token(9)));
        assert_eq!(job.exit.as_ref().unwrap().exit_code, Some(0));
        assert_eq!(job.artifact.as_ref().unwrap().length, 12);
        assert_eq!(job.log_acked, 12);
        assert_eq!(job.stop, Some(StopIntent::Cancel));
        assert_eq!(job.spawn_failure, None);
    }

    #[test]
    fn log_acknowledgements_only_advance_and_never_pass_the_spool() {
        let k = key("s1", "a1");
        let life = lifecycle(&k);
        let running = life.iter().position(|r| matches!(r, Record::RunningAcked { .. })).unwrap();
        let mut state = replay(&life[..running]);
        let acked = |n| Record::LogAcked { job: k.clone(), acked: n };
        expect(&mut state, &acked(1), Err(Refused::TooEarly));
        expect(&mut state, &life[running], Ok(()));
        expect(&mut state, &acked(0), Err(Refused::Repeated));
        expect(&mut state, &acked(7), Ok(()));
        expect(&mut state, &acked(7), Err(Refused::Repeated));
        expect(&mut state, &acked(6), Err(Refused::Repeated));
        expect(&mut state, &exited(&k), Ok(()));
        expect(&mut state, &acked(13), Err(Refused::TooEarly));
        expect(&mut state, &acked(12), Ok(()));
        expect(&mut state, &stored(&k), Ok(()));
        assert_eq!(state.jobs[&k].log_acked, 12);
        let compacted = replay(&state.to_records());
        assert_eq!(compacted, state, "compaction keeps the last acknowledgement");
    }

    #[test]
    fn session_records_replace_the_current_session() {
        let mut state = JournalState::default();
        expect(&mut state, &session("s1", 1), Ok(()));
        expect(&mut state, &session("s2", 2), Ok(()));
        let s = state.session.as_ref().unwrap();
        assert_eq!((s.session_id.as_str(), s.generation), ("s2", c(2)));
        assert!(state.jobs.is_empty());
    }

    #[test]
    fn a_closed_session_is_forgotten_and_an_older_close_changes_nothing() {
        let mut state = JournalState::default();
        expect(&mut state, &session("s2", 2), Ok(()));
        let closed = |id: &str| Record::SessionClosed { session_id: SessionId::parse(id).unwrap() };
        expect(&mut state, &closed("s1"), Ok(()));
        assert_eq!(state.session.as_ref().map(|s| s.session_id.as_str()), Some("s2"), "not the current one");
        expect(&mut state, &closed("s2"), Ok(()));
        assert_eq!(state.session, None);
        assert_eq!(state.session_record(), None, "compaction keeps no session");
    }

    #[test]
    fn every_step_before_the_offer_names_an_unknown_job() {
        let k = key("s1", "a1");
        let mut state = JournalState::default();
        for r in lifecycle(&k).iter().skip(1).chain([&Record::Dropped { job: k.clone() }]) {
            expect(&mut state, r, Err(Refused::UnknownJob));
        }
    }

    #[test]
    fn a_second_offer_for_the_same_job_is_refused_but_other_keys_are_not() {
        let k = key("s1", "a1");
        let mut state = replay(&[offered(&k, 3)]);
        expect(&mut state, &offered(&k, 4), Err(Refused::DuplicateJob));
        expect(&mut state, &offered(&key("s2", "a1"), 4), Ok(()));
        expect(&mut state, &offered(&key("s1", "a2"), 5), Ok(()));
        assert_eq!(state.jobs.len(), 3);
    }

    #[test]
    fn steps_after_the_offer_need_the_claim() {
        let k = key("s1", "a1");
        let mut state = replay(&[offered(&k, 3)]);
        let needs_claim = [
            Record::Renewed { job: k.clone(), lease_version: c(2) },
            Record::StartingAcked { job: k.clone() },
            spawned(&k),
            Record::SpawnFailed { job: k.clone(), reason: Reason::summarise("no") },
            minted(&k, 9),
            Record::RunningAcked { job: k.clone() },
            exited(&k),
            stored(&k),
            Record::StopSeen { job: k.clone(), intent: StopIntent::Timeout },
        ];
        for r in &needs_claim {
            expect(&mut state, r, Err(Refused::TooEarly));
        }
        expect(&mut state, &claimed(&k), Ok(()));
        expect(&mut state, &claimed(&k), Err(Refused::Repeated));
    }

    #[test]
    fn running_needs_starting_spawn_and_callback_in_any_order() {
        let k = key("s1", "a1");
        let running = Record::RunningAcked { job: k.clone() };
        let prereqs = [Record::StartingAcked { job: k.clone() }, spawned(&k), minted(&k, 9)];
        // Every strict subset of the prerequisites is too early; all three are enough.
        for mask in 0..8u8 {
            let mut state = replay(&[offered(&k, 3), claimed(&k)]);
            for (i, r) in prereqs.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    expect(&mut state, r, Ok(()));
                }
            }
            let want = if mask == 7 { Ok(()) } else { Err(Refused::TooEarly) };
            expect(&mut state, &running, want);
        }
    }

    #[test]
    fn each_step_is_recorded_once() {
        let k = key("s1", "a1");
        let mut state = replay(&lifecycle(&k));
        for r in [
            claimed(&k),
            Record::StartingAcked { job: k.clone() },
            Record::Spawning { job: k.clone() },
            spawned(&k),
            Record::SpawnFailed { job: k.clone(), reason: Reason::summarise("late") },
            minted(&k, 10),
            Record::RunningAcked { job: k.clone() },
            exited(&k),
            stored(&k),
        ] {
            expect(&mut state, &r, Err(Refused::Repeated));
        }
    }

    #[test]
    fn the_spawning_intent_needs_the_claim_and_comes_once_before_the_outcome() {
        let k = key("s1", "a1");
        let spawning = Record::Spawning { job: k.clone() };
        let mut state = replay(&[offered(&k, 3)]);
        expect(&mut state, &spawning, Err(Refused::TooEarly));
        let mut state = replay(&[offered(&k, 3), claimed(&k), Record::StartingAcked { job: k.clone() }]);
        expect(&mut state, &spawning, Ok(()));
        assert!(state.jobs[&k].spawning && state.jobs[&k].spawn.is_none());
        expect(&mut state, &spawning, Err(Refused::Repeated));
        // Either outcome may follow the intent; a journal written before intents existed
        // (a spawn without one) stays readable.
        let mut failed = state.clone();
        expect(&mut failed, &Record::SpawnFailed { job: k.clone(), reason: Reason::summarise("gone") }, Ok(()));
        expect(&mut state, &spawned(&k), Ok(()));
        expect(&mut state, &spawning, Err(Refused::Repeated));
        replay(&[offered(&k, 3), claimed(&k), spawned(&k)]);
    }

    #[test]
    fn a_spawn_failure_excludes_a_spawn_and_the_steps_that_need_one() {
        let k = key("s1", "a1");
        let mut state = replay(&[offered(&k, 3), claimed(&k), Record::StartingAcked { job: k.clone() }]);
        expect(&mut state, &Record::SpawnFailed { job: k.clone(), reason: Reason::summarise("ENOENT") }, Ok(()));
        assert_eq!(state.jobs[&k].spawn_failure.as_ref().unwrap().as_str(), "ENOENT");
        expect(&mut state, &spawned(&k), Err(Refused::Repeated));
        expect(&mut state, &exited(&k), Err(Refused::TooEarly));
        expect(&mut state, &minted(&k, 9), Ok(()));
        expect(&mut state, &Record::RunningAcked { job: k.clone() }, Err(Refused::TooEarly));
    }

    #[test]
    fn exit_needs_a_spawn_and_the_artifact_needs_the_exit() {
        let k = key("s1", "a1");
        let mut state = replay(&[offered(&k, 3), claimed(&k)]);
        expect(&mut state, &exited(&k), Err(Refused::TooEarly));
        expect(&mut state, &stored(&k), Err(Refused::TooEarly));
        expect(&mut state, &spawned(&k), Ok(()));
        expect(&mut state, &stored(&k), Err(Refused::TooEarly));
        // A crash before the running ACK still leaves exit evidence to complete with.
        expect(&mut state, &exited(&k), Ok(()));
        expect(&mut state, &stored(&k), Ok(()));
    }

    #[test]
    fn renewals_must_advance_the_lease_version() {
        let k = key("s1", "a1");
        let mut state = replay(&[offered(&k, 3), claimed(&k)]);
        expect(&mut state, &Record::Renewed { job: k.clone(), lease_version: c(1) }, Err(Refused::StaleLeaseVersion));
        expect(&mut state, &Record::Renewed { job: k.clone(), lease_version: c(3) }, Ok(()));
        expect(&mut state, &Record::Renewed { job: k.clone(), lease_version: c(2) }, Err(Refused::StaleLeaseVersion));
        expect(&mut state, &Record::Renewed { job: k.clone(), lease_version: c(3) }, Err(Refused::StaleLeaseVersion));
        assert_eq!(state.jobs[&k].lease.as_ref().unwrap().version, c(3));
    }

    #[test]
    fn the_strongest_stop_intent_is_kept() {
        let k = key("s1", "a1");
        let mut state = replay(&[offered(&k, 3), claimed(&k)]);
        let stop = |intent| Record::StopSeen { job: k.clone(), intent };
        expect(&mut state, &stop(StopIntent::Cancel), Ok(()));
        assert_eq!(state.jobs[&k].stop, Some(StopIntent::Cancel));
        expect(&mut state, &stop(StopIntent::Timeout), Ok(()));
        expect(&mut state, &stop(StopIntent::Cancel), Ok(()));
        assert_eq!(state.jobs[&k].stop, Some(StopIntent::Timeout));
    }

    #[test]
    fn dropping_a_job_forgets_it_and_only_it() {
        let (a, b) = (key("s1", "a1"), key("s1", "a2"));
        let mut state = replay(&[session("s1", 1), offered(&a, 3), offered(&b, 4), claimed(&b)]);
        expect(&mut state, &Record::Dropped { job: b.clone() }, Ok(()));
        assert_eq!(state.jobs.keys().collect::<Vec<_>>(), vec![&a]);
        expect(&mut state, &Record::Dropped { job: b.clone() }, Err(Refused::UnknownJob));
        expect(&mut state, &claimed(&b), Err(Refused::UnknownJob));
        // The attempt may be offered again (a fresh job) once it was dropped.
        expect(&mut state, &offered(&b, 5), Ok(()));
        assert!(state.session.is_some());
    }

    #[test]
    fn to_records_rebuilds_the_state_at_every_step_of_a_life() {
        let (a, b) = (key("s1", "a1"), key("s0", "b1"));
        let mut all = vec![session("s1", 2), offered(&b, 7), claimed(&b)];
        all.push(Record::SpawnFailed { job: b.clone(), reason: Reason::summarise("no such program") });
        all.extend(lifecycle(&a));
        for n in 0..=all.len() {
            let state = replay(&all[..n]);
            let rebuilt = replay(&state.to_records());
            assert_eq!(rebuilt, state, "after {n} records");
        }
    }

    #[test]
    fn records_round_trip_through_json_with_camel_case_kinds() {
        let k = key("s1", "a1");
        for r in lifecycle(&k).into_iter().chain([session("s1", 1), Record::Dropped { job: k.clone() }]) {
            let json = serde_json::to_string(&r).unwrap();
            let back: Record = serde_json::from_str(&json).unwrap();
            assert_eq!(back, r, "{json}");
        }
        let json = serde_json::to_string(&Record::StartingAcked { job: k.clone() }).unwrap();
        assert_eq!(json, r#"{"kind":"startingAcked","job":{"sessionId":"s1","attemptId":"a1"}}"#);
        let json = serde_json::to_string(&claimed(&k)).unwrap();
        assert!(json.contains(r#""leaseTtlMs":30000"#), "{json}");
    }

    #[test]
    fn decoding_refuses_unknown_fields_kinds_and_invalid_values() {
        for bad in [
            r#"{"kind":"startingAcked","job":{"sessionId":"s1","attemptId":"a1"},"extra":1}"#,
            r#"{"kind":"startingAcked","job":{"sessionId":"s1","attemptId":"a1","x":1}}"#,
            r#"{"kind":"teleported","job":{"sessionId":"s1","attemptId":"a1"}}"#,
            r#"{"kind":"startingAcked","job":{"sessionId":"s 1","attemptId":"a1"}}"#,
            r#"{"kind":"session","sessionId":"s1","generation":0}"#,
            r#"{"kind":"renewed","job":{"sessionId":"s1","attemptId":"a1"}}"#,
        ] {
            assert!(serde_json::from_str::<Record>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tokens_are_serialised_for_the_file_but_never_debug_printed() {
        let k = key("s1", "a1");
        let (offer, mint) = (offered(&k, 3), minted(&k, 9));
        for (r, t) in [(&offer, token(3)), (&mint, token(9))] {
            assert!(serde_json::to_string(r).unwrap().contains(t.expose()));
            assert!(!format!("{r:?}").contains(t.expose()));
        }
        let state = replay(&lifecycle(&k));
        let shown = format!("{state:?}");
        assert!(!shown.contains(token(3).expose()) && !shown.contains(token(9).expose()));
        assert!(!shown.contains("hello \\\"quoted"), "spec env values must not be shown");
    }
}
