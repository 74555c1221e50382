//! The live log's two steps (PROTOCOL §13): send the next chunk of a job's spool, and
//! seal what the server acknowledged into the artifact.
//!
//! A chunk is read from the spool at the journal's acknowledged offset and sent with a
//! third of the lease to get through; its answer (or a `log_offset_conflict`, which says
//! where the server's log stands) is journaled before the next chunk, and only then is
//! the acknowledged part of the spool released. A chunk that did not get through in time
//! halves the next one; one that did sizes the next to the uplink ([`core::adapt_chunk`]).
//! Each chunk ends the job's turn ([`Turn::Yield`]): heartbeats, renewals and other jobs
//! go between chunks.

use std::time::{Duration, Instant};

use ql_wire::artifact::ArtifactReply;
use ql_wire::log::{LogChunkHeader, Seal};
use ql_wire::route::Route;
use ql_wire::{ErrorCode, Outcome};

use super::{attempt_path, Agent, Counted, Fatal, Turn};
use crate::client::CallError;
use crate::core;
use crate::exec::{self, RunDir};
use crate::journal::{Job, JobKey, Record};

impl Agent {
    /// Sends one chunk of the live log.
    pub(super) fn append(
        &mut self,
        key: &JobKey,
        job: &Job,
        who: &str,
        header: LogChunkHeader,
        now: Instant,
    ) -> Result<Turn, Fatal> {
        let (offset, len) = (header.offset, header.content_length);
        let Some(file) = self.spool_range(key, who, offset, len) else { return Ok(Turn::Moved) };
        let prefix = ql_wire::frame::encode_prefix(&header).map_err(|e| Fatal(format!("log chunk header: {e}")))?;
        let ttl = Duration::from_millis(job.lease.as_ref().map_or(0, |l| l.ttl_ms));
        let within = self.third_of_lease(job);
        let route = Route::LogAppend(attempt_path(&self.cfg, key, job));
        let started = Instant::now();
        let answer = self.client.append(&route, &prefix[..], &mut Counted(file), len, within);
        let max = self.cfg.log_chunk_bytes;
        match answer {
            Ok(reply) if matches!(reply.result, Outcome::Appended | Outcome::AlreadyAppended) => {
                self.call_ok();
                self.settle_version(key, job)?;
                let cap = core::adapt_chunk(len, started.elapsed(), ttl, max);
                self.rt(key).chunk_cap = cap;
                debug!(
                    "{who}: log acknowledged to {} ({len} bytes in {} ms)",
                    reply.acked,
                    started.elapsed().as_millis()
                );
                self.acknowledged(key, job, who, reply.acked, now)?;
                Ok(Turn::Yield)
            }
            Ok(other) => Ok(self.unexpected(key, who, "log chunk", other.result)),
            Err(CallError::Refused { code: ErrorCode::LogOffsetConflict, acked: Some(acked), .. })
                if !core::conflict_moves(job.log_acked, acked) =>
            {
                Ok(self.conflict_stands(key, who, "log chunk", acked))
            }
            Err(CallError::Refused { code: ErrorCode::LogOffsetConflict, acked: Some(acked), .. }) => {
                self.call_ok();
                self.settle_version(key, job)?;
                info!("{who}: the server holds {acked} bytes of the log, not {offset}; going on from there");
                self.acknowledged(key, job, who, acked, now)?;
                Ok(Turn::Yield)
            }
            Err(e) => {
                if matches!(e, CallError::Transport(_)) {
                    let cap = core::shrink_chunk(self.rt(key).chunk_cap, max);
                    warn!(
                        "{who}: a {len}-byte log chunk did not get through in {} ms; next ones at most {cap} bytes",
                        within.as_millis()
                    );
                    self.rt(key).chunk_cap = cap;
                }
                Ok(self.job_call_failed(key, who, "log chunk", e))
            }
        }
    }

    /// A `log_offset_conflict` naming the length the journal already holds
    /// ([`core::conflict_moves`]): the job's log waits a back-off that doubles with each
    /// such refusal in a row, and nothing else of the agent does.
    fn conflict_stands(&mut self, key: &JobKey, who: &str, what: &str, acked: u64) -> Turn {
        self.call_ok();
        let random = self.draw();
        let (initial, max) = (self.cfg.backoff_initial, self.cfg.backoff_max);
        let now = Instant::now();
        let wait = self.rt(key).log_hold.fail(initial, max, random, now);
        let until = now + wait;
        warn!(
            "{who}: {what}: the server refused it as a log offset conflict at {acked} bytes, where the log \
             stands; repeating in {} ms",
            wait.as_millis()
        );
        Turn::Idle(Some(until))
    }

    /// No request that holds the one connection may outlast a third of the lease: the
    /// renewal waits for it.
    fn third_of_lease(&self, job: &Job) -> Duration {
        let ttl = Duration::from_millis(job.lease.as_ref().map_or(0, |l| l.ttl_ms));
        (ttl / 3).max(Duration::from_millis(1))
    }

    /// The server holds `acked` bytes of the log: journal that, then let the spool go of
    /// them. Less than the journal already holds means the server lost acknowledged bytes,
    /// which the spool no longer has: the job completes without a log.
    fn acknowledged(&mut self, key: &JobKey, job: &Job, who: &str, acked: u64, now: Instant) -> Result<(), Fatal> {
        let sent = job.exit.as_ref().map_or(self.rt(key).spooled, |e| e.log_len);
        if acked < job.log_acked || acked > sent {
            warn!(
                "{who}: the server says it holds {acked} bytes of the log, the agent sent {}; completing without a log",
                job.log_acked
            );
            self.rt(key).log_lost = true;
            return Ok(());
        }
        if acked > job.log_acked {
            self.commit(&Record::LogAcked { job: key.clone(), acked })?;
        }
        self.rt(key).log_hold.failures = 0;
        self.rt(key).log_sent_at = Some(now);
        let spool = RunDir::new(&self.cfg.state_dir, &key.attempt_id).spool;
        match exec::release_spool(&spool, acked) {
            Ok(true) => {}
            Ok(false) => debug!("{who}: this file system cannot release acknowledged spool bytes"),
            Err(e) => warn!("{who}: could not release acknowledged spool bytes: {e}"),
        }
        Ok(())
    }

    /// Seals the acknowledged log into the artifact.
    pub(super) fn seal(&mut self, key: &JobKey, job: &Job, who: &str, body: Seal) -> Result<Turn, Fatal> {
        let artifact = job.callback.as_ref().and_then(|c| c.log_artifact_id.clone()).expect("a log artifact");
        let route = Route::Seal(attempt_path(&self.cfg, key, job), artifact);
        // The server composes the artifact meanwhile; a seal that takes longer than a third
        // of the lease is repeated after a renewal, and joins the composition in progress.
        let within = self.third_of_lease(job).min(self.cfg.call_timeout);
        let started = Instant::now();
        match self.client.call_within::<Seal, ArtifactReply>(&route, &body, within) {
            Ok(reply) if matches!(reply.result, Outcome::Stored | Outcome::AlreadyStored) => {
                self.call_ok();
                self.settle_version(key, job)?;
                let r = &reply.receipt;
                let truncated = if r.truncated { ", truncated" } else { "" };
                info!("{who}: log sealed ({} bytes{truncated}) in {} ms", r.length, started.elapsed().as_millis());
                self.commit(&Record::ArtifactStored { job: key.clone(), receipt: reply.receipt })?;
                Ok(Turn::Moved)
            }
            Ok(other) => Ok(self.unexpected(key, who, "log seal", other.result)),
            Err(CallError::Refused { code: ErrorCode::LogOffsetConflict, acked: Some(acked), .. })
                if !core::conflict_moves(job.log_acked, acked) =>
            {
                Ok(self.conflict_stands(key, who, "log seal", acked))
            }
            Err(CallError::Refused { code: ErrorCode::LogOffsetConflict, acked: Some(acked), .. }) => {
                self.call_ok();
                info!("{who}: the server holds {acked} bytes of the log before the seal");
                self.acknowledged(key, job, who, acked, Instant::now())?;
                Ok(Turn::Moved)
            }
            Err(e) => Ok(self.job_call_failed(key, who, "log seal", e)),
        }
    }
}
