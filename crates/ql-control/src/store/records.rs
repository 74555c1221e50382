//! Every model type of [`crate::model`] to its table row and back, written once for both
//! stores: the column lists, the reading, and the values of a write, in column order.
//!
//! Every struct field has exactly one column (nested lease and claim facts are
//! flattened with a prefix), so a row written and read back equals the original. Adding
//! a column means editing the table's column list, its `read` and its `values` here —
//! and the two migrations; the backends need nothing.

use ql_wire::lease::StopIntent;

use super::columns::{Columns, Corrupt, Table, Value as V};
use crate::model::{
    Attempt, AttemptStatus, AuditRecord, CatchUp, Certificate, ClaimFacts, Delivery, DeliveryState, EndKind, Enrolment,
    Event, Fire, FireOutcome, Lease, LeaseFacts, LeaseState, LogChunk, Notify, NotifyOn, Offer, OfferState, Operator,
    Overlap, Role, Run, RunStatus, Schedule, Session, SessionState, Worker,
};

/// A model type stored as one row of one table.
pub(super) trait Stored: Sized {
    /// Its table.
    const TABLE: &'static Table;
    /// Reads one row selected with the table's column list.
    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error>;
    /// The values of a write, in the table's column order.
    fn values(&self) -> Result<Vec<V>, Corrupt>;
}

fn parse_stop(s: &str) -> Option<StopIntent> {
    match s {
        "cancel" => Some(StopIntent::Cancel),
        "timeout" => Some(StopIntent::Timeout),
        _ => None,
    }
}

/// Columns of `sessions`, in select order.
pub(super) const SESSION_COLS: &str =
    "id, worker, generation, state, capacity, labels, agent_version, arch, created_at, seen_at, expires_at, offered";
/// Columns of `runs`, in select order.
pub(super) const RUN_COLS: &str =
    "id, project, spec, labels, agent_labels, status, stop, retry_budget, retries_used, attempts, \
     lease_generations, current_attempt_id, deadline_at, created_at, started_at, finished_at, error_code, summary, \
     schedule";
/// Columns of `attempts`, in select order.
pub(super) const ATTEMPT_COLS: &str = "id, run_id, number, executor_type, status, offer_id, session_id, worker, \
     lease_worker, lease_session_id, lease_session_generation, lease_offer_id, lease_generation, lease_token_digest, \
     lease_version, lease_expires_at, executor_handle, log_artifact_id, callback_sequence, callback_digest, \
     exit_code, signal, worker_finished_at, artifact, end_kind, created_at, started_at, ended_at, error_code, summary, \
     log_acked, log_sealed, claimed_artifact";
/// Columns of `offers`, in select order.
pub(super) const OFFER_COLS: &str = "id, run_id, attempt_id, worker, session_id, session_generation, state, \
     expires_at, claim_token_digest, claim_lease_generation, claim_lease_expires_at, claim_lease_ttl_ms";
/// Columns of `leases`, in select order.
pub(super) const LEASE_COLS: &str = "attempt_id, run_id, state, worker, session_id, session_generation, offer_id, \
     lease_generation, token_digest, version, expires_at, ttl_ms";
/// Columns of `events`, in select order (`seq` is storage order, not a model field).
pub(super) const EVENT_COLS: &str = "id, run_id, attempt_id, kind, from_status, to_status, payload, at";
/// Columns of `log_chunks`, in select order.
pub(super) const LOG_CHUNK_COLS: &str = "attempt_id, byte_offset, length, sha256";
/// Columns of `workers`, in select order.
pub(super) const WORKER_COLS: &str = "id, labels, disabled_at, revoked_at, created_at, updated_at";
/// Columns of `enrolments`, in select order.
pub(super) const ENROLMENT_COLS: &str = "token_digest, worker, created_at, expires_at, used_at, serial";
/// Columns of `schedules`, in select order.
pub(super) const SCHEDULE_COLS: &str = "name, cron, tz, random_delay_ms, overlap, catch_up, project, spec, labels, \
     agent_labels, retry_budget, paused, next_fire_at, due_at, last_run_id, created_at, updated_at, notify_url, notify_on";
/// Columns of `deliveries`, in select order.
pub(super) const DELIVERY_COLS: &str =
    "run_id, url, notify_on, state, attempts, next_at, last_error, created_at, updated_at";
/// Columns of `fires`, in select order.
pub(super) const FIRE_COLS: &str = "schedule, fire_at, outcome, run_id, at";
/// Columns of `operators`, in select order.
pub(super) const OPERATOR_COLS: &str = "name, role, token_digest, created_at";
/// Columns of `certificates`, in select order.
pub(super) const CERTIFICATE_COLS: &str = "serial, worker, issued_at, not_after, revoked_at, renewed_from";
/// Columns of `audit`, in select order (`seq` as for events).
pub(super) const AUDIT_COLS: &str = "at, principal, route, outcome";

pub(super) const SESSIONS: Table = Table { name: "sessions", key: Some("id"), cols: SESSION_COLS };
pub(super) const RUNS: Table = Table { name: "runs", key: Some("id"), cols: RUN_COLS };
pub(super) const ATTEMPTS: Table = Table { name: "attempts", key: Some("id"), cols: ATTEMPT_COLS };
pub(super) const OFFERS: Table = Table { name: "offers", key: Some("id"), cols: OFFER_COLS };
pub(super) const LEASES: Table = Table { name: "leases", key: Some("attempt_id"), cols: LEASE_COLS };
/// Never upserted: the unique index refuses a second event of the same type for the same
/// attempt, which rolls the whole command back.
pub(super) const EVENTS: Table = Table { name: "events", key: None, cols: EVENT_COLS };
pub(super) const AUDIT: Table = Table { name: "audit", key: None, cols: AUDIT_COLS };
/// Never upserted: a chunk, once acknowledged, is never replaced (the primary key
/// refuses a second one at the same offset).
pub(super) const LOG_CHUNKS: Table = Table { name: "log_chunks", key: None, cols: LOG_CHUNK_COLS };
pub(super) const WORKERS: Table = Table { name: "workers", key: Some("id"), cols: WORKER_COLS };
pub(super) const CERTIFICATES: Table = Table { name: "certificates", key: Some("serial"), cols: CERTIFICATE_COLS };
pub(super) const ENROLMENTS: Table = Table { name: "enrolments", key: Some("token_digest"), cols: ENROLMENT_COLS };

/// Every table a model type is stored in.
pub(super) const SCHEDULES: Table = Table { name: "schedules", key: Some("name"), cols: SCHEDULE_COLS };
/// Never upserted: the primary key (schedule, fire time) refuses a second fire.
pub(super) const FIRES: Table = Table { name: "fires", key: None, cols: FIRE_COLS };

pub(super) const OPERATORS: Table = Table { name: "operators", key: Some("name"), cols: OPERATOR_COLS };
pub(super) const DELIVERIES: Table = Table { name: "deliveries", key: Some("run_id"), cols: DELIVERY_COLS };

/// Every table a model type is stored in.
pub(super) const TABLES: [&Table; 15] = [
    &SESSIONS,
    &RUNS,
    &ATTEMPTS,
    &OFFERS,
    &LEASES,
    &EVENTS,
    &AUDIT,
    &LOG_CHUNKS,
    &WORKERS,
    &CERTIFICATES,
    &ENROLMENTS,
    &SCHEDULES,
    &FIRES,
    &OPERATORS,
    &DELIVERIES,
];

impl Stored for Session {
    const TABLE: &'static Table = &SESSIONS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Session {
            id: c.valid("id")?,
            worker: c.valid("worker")?,
            generation: c.counter("generation")?,
            state: c.word("state", SessionState::parse)?,
            capacity: c.num("capacity")?,
            labels: c.json("labels")?,
            agent_version: c.text("agent_version")?,
            arch: c.text("arch")?,
            created_at: c.int("created_at")?,
            seen_at: c.int("seen_at")?,
            expires_at: c.int("expires_at")?,
            offered: c.int("offered")? != 0,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.id.as_str()),
            V::text(self.worker.as_str()),
            V::big(self.generation.get())?,
            V::text(self.state.as_str()),
            V::int(self.capacity),
            V::json(&self.labels)?,
            V::text(&self.agent_version),
            V::text(&self.arch),
            V::int(self.created_at),
            V::int(self.seen_at),
            V::int(self.expires_at),
            V::int(i64::from(self.offered)),
        ])
    }
}

impl Stored for Run {
    const TABLE: &'static Table = &RUNS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Run {
            id: c.valid("id")?,
            project: c.valid("project")?,
            spec: c.json("spec")?,
            labels: c.json("labels")?,
            agent_labels: c.json("agent_labels")?,
            status: c.word("status", RunStatus::parse)?,
            stop: c.opt_word("stop", parse_stop)?,
            retry_budget: c.num("retry_budget")?,
            retries_used: c.num("retries_used")?,
            attempts: c.num("attempts")?,
            lease_generations: c.num("lease_generations")?,
            current_attempt: c.opt_valid("current_attempt_id")?,
            deadline_at: c.opt_int("deadline_at")?,
            created_at: c.int("created_at")?,
            started_at: c.opt_int("started_at")?,
            finished_at: c.opt_int("finished_at")?,
            error_code: c.opt_text("error_code")?,
            summary: c.opt_text("summary")?,
            schedule: c.opt_text("schedule")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.id.as_str()),
            V::text(self.project.as_str()),
            V::json(&self.spec)?,
            V::json(&self.labels)?,
            V::json(&self.agent_labels)?,
            V::text(self.status.as_str()),
            V::opt_text(self.stop.map(StopIntent::as_str)),
            V::int(self.retry_budget),
            V::int(self.retries_used),
            V::int(self.attempts),
            V::big(self.lease_generations)?,
            V::opt_text(self.current_attempt.as_ref().map(|a| a.as_str())),
            V::opt_int(self.deadline_at),
            V::int(self.created_at),
            V::opt_int(self.started_at),
            V::opt_int(self.finished_at),
            V::opt_text(self.error_code.as_deref()),
            V::opt_text(self.summary.as_deref()),
            V::opt_text(self.schedule.as_deref()),
        ])
    }
}

impl Stored for Schedule {
    const TABLE: &'static Table = &SCHEDULES;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Schedule {
            name: c.text("name")?,
            cron: c.text("cron")?,
            tz: c.text("tz")?,
            random_delay_ms: c.num("random_delay_ms")?,
            overlap: c.word("overlap", Overlap::parse)?,
            catch_up: c.word("catch_up", CatchUp::parse)?,
            submit: crate::core::Submit {
                project: c.valid("project")?,
                spec: c.json("spec")?,
                labels: c.json("labels")?,
                agent_labels: c.json("agent_labels")?,
                retry_budget: c.num("retry_budget")?,
                notify: match (c.opt_text("notify_url")?, c.opt_word("notify_on", NotifyOn::parse)?) {
                    (Some(url), Some(on)) => Some(Notify { url, on }),
                    _ => None,
                },
            },
            paused: c.int("paused")? != 0,
            next_fire_at: c.int("next_fire_at")?,
            due_at: c.int("due_at")?,
            last_run: c.opt_valid("last_run_id")?,
            created_at: c.int("created_at")?,
            updated_at: c.int("updated_at")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(&self.name),
            V::text(&self.cron),
            V::text(&self.tz),
            V::big(self.random_delay_ms)?,
            V::text(self.overlap.as_str()),
            V::text(self.catch_up.as_str()),
            V::text(self.submit.project.as_str()),
            V::json(&self.submit.spec)?,
            V::json(&self.submit.labels)?,
            V::json(&self.submit.agent_labels)?,
            V::int(self.submit.retry_budget),
            V::int(i64::from(self.paused)),
            V::int(self.next_fire_at),
            V::int(self.due_at),
            V::opt_text(self.last_run.as_ref().map(|r| r.as_str())),
            V::int(self.created_at),
            V::int(self.updated_at),
            V::opt_text(self.submit.notify.as_ref().map(|n| n.url.as_str())),
            V::opt_text(self.submit.notify.as_ref().map(|n| n.on.as_str())),
        ])
    }
}

impl Stored for Delivery {
    const TABLE: &'static Table = &DELIVERIES;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Delivery {
            run: c.valid("run_id")?,
            url: c.text("url")?,
            on: c.word("notify_on", NotifyOn::parse)?,
            state: c.word("state", DeliveryState::parse)?,
            attempts: c.num("attempts")?,
            next_at: c.int("next_at")?,
            last_error: c.opt_text("last_error")?,
            created_at: c.int("created_at")?,
            updated_at: c.int("updated_at")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.run.as_str()),
            V::text(&self.url),
            V::text(self.on.as_str()),
            V::text(self.state.as_str()),
            V::int(self.attempts),
            V::int(self.next_at),
            V::opt_text(self.last_error.as_deref()),
            V::int(self.created_at),
            V::int(self.updated_at),
        ])
    }
}

impl Stored for Fire {
    const TABLE: &'static Table = &FIRES;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Fire {
            schedule: c.text("schedule")?,
            fire_at: c.int("fire_at")?,
            outcome: c.word("outcome", FireOutcome::parse)?,
            run: c.opt_valid("run_id")?,
            at: c.int("at")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(&self.schedule),
            V::int(self.fire_at),
            V::text(self.outcome.as_str()),
            V::opt_text(self.run.as_ref().map(|r| r.as_str())),
            V::int(self.at),
        ])
    }
}

/// An attempt's projection of its lease: all its columns NULL before the claim.
fn attempt_lease<C: Columns + ?Sized>(c: &C) -> Result<Option<LeaseFacts>, C::Error> {
    let Some(worker) = c.opt_valid("lease_worker")? else {
        return Ok(None);
    };
    Ok(Some(LeaseFacts {
        worker,
        session: c.valid("lease_session_id")?,
        session_generation: c.counter("lease_session_generation")?,
        offer: c.valid("lease_offer_id")?,
        lease_generation: c.counter("lease_generation")?,
        token_digest: c.valid("lease_token_digest")?,
        version: c.counter("lease_version")?,
        expires_at: c.int("lease_expires_at")?,
    }))
}

impl Stored for Attempt {
    const TABLE: &'static Table = &ATTEMPTS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Attempt {
            id: c.valid("id")?,
            run: c.valid("run_id")?,
            number: c.num("number")?,
            executor_type: c.text("executor_type")?,
            status: c.word("status", AttemptStatus::parse)?,
            offer: c.valid("offer_id")?,
            session: c.valid("session_id")?,
            worker: c.valid("worker")?,
            lease: attempt_lease(c)?,
            executor_handle: c.opt_valid("executor_handle")?,
            log_artifact: c.opt_valid("log_artifact_id")?,
            callback_sequence: c.opt_counter("callback_sequence")?,
            callback_digest: c.opt_valid("callback_digest")?,
            exit_code: c.opt_num("exit_code")?,
            signal: c.opt_num("signal")?,
            worker_finished_at: c.opt_int("worker_finished_at")?,
            artifact: c.opt_json("artifact")?,
            end: c.opt_word("end_kind", EndKind::parse)?,
            created_at: c.int("created_at")?,
            started_at: c.opt_int("started_at")?,
            ended_at: c.opt_int("ended_at")?,
            error_code: c.opt_text("error_code")?,
            summary: c.opt_text("summary")?,
            log_acked: c.num("log_acked")?,
            log_sealed: c.int("log_sealed")? != 0,
            claimed_artifact: c.opt_json("claimed_artifact")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        let l = self.lease.as_ref();
        Ok(vec![
            V::text(self.id.as_str()),
            V::text(self.run.as_str()),
            V::int(self.number),
            V::text(&self.executor_type),
            V::text(self.status.as_str()),
            V::text(self.offer.as_str()),
            V::text(self.session.as_str()),
            V::text(self.worker.as_str()),
            V::opt_text(l.map(|l| l.worker.as_str())),
            V::opt_text(l.map(|l| l.session.as_str())),
            V::opt_big(l.map(|l| l.session_generation.get()))?,
            V::opt_text(l.map(|l| l.offer.as_str())),
            V::opt_big(l.map(|l| l.lease_generation.get()))?,
            V::opt_text(l.map(|l| l.token_digest.as_str())),
            V::opt_big(l.map(|l| l.version.get()))?,
            V::opt_int(l.map(|l| l.expires_at)),
            V::opt_text(self.executor_handle.as_ref().map(|h| h.as_str())),
            V::opt_text(self.log_artifact.as_ref().map(|x| x.as_str())),
            V::opt_big(self.callback_sequence.map(|c| c.get()))?,
            V::opt_text(self.callback_digest.as_ref().map(|d| d.as_str())),
            V::opt_int(self.exit_code),
            V::opt_int(self.signal),
            V::opt_int(self.worker_finished_at),
            V::opt_json(self.artifact.as_ref())?,
            V::opt_text(self.end.map(EndKind::as_str)),
            V::int(self.created_at),
            V::opt_int(self.started_at),
            V::opt_int(self.ended_at),
            V::opt_text(self.error_code.as_deref()),
            V::opt_text(self.summary.as_deref()),
            V::big(self.log_acked)?,
            V::int(i64::from(self.log_sealed)),
            V::opt_json(self.claimed_artifact.as_ref())?,
        ])
    }
}

impl Stored for LogChunk {
    const TABLE: &'static Table = &LOG_CHUNKS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(LogChunk {
            attempt: c.valid("attempt_id")?,
            offset: c.num("byte_offset")?,
            length: c.num("length")?,
            sha256: c.valid("sha256")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.attempt.as_str()),
            V::big(self.offset)?,
            V::big(self.length)?,
            V::text(self.sha256.as_str()),
        ])
    }
}

impl Stored for Offer {
    const TABLE: &'static Table = &OFFERS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        // What the claim answered: all its columns NULL until claimed.
        let claim = match c.opt_valid("claim_token_digest")? {
            None => None,
            Some(token_digest) => Some(ClaimFacts {
                token_digest,
                lease_generation: c.counter("claim_lease_generation")?,
                lease_expires_at: c.int("claim_lease_expires_at")?,
                lease_ttl_ms: c.num("claim_lease_ttl_ms")?,
            }),
        };
        Ok(Offer {
            id: c.valid("id")?,
            run: c.valid("run_id")?,
            attempt: c.valid("attempt_id")?,
            worker: c.valid("worker")?,
            session: c.valid("session_id")?,
            session_generation: c.counter("session_generation")?,
            state: c.word("state", OfferState::parse)?,
            expires_at: c.int("expires_at")?,
            claim,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        let k = self.claim.as_ref();
        Ok(vec![
            V::text(self.id.as_str()),
            V::text(self.run.as_str()),
            V::text(self.attempt.as_str()),
            V::text(self.worker.as_str()),
            V::text(self.session.as_str()),
            V::big(self.session_generation.get())?,
            V::text(self.state.as_str()),
            V::int(self.expires_at),
            V::opt_text(k.map(|k| k.token_digest.as_str())),
            V::opt_big(k.map(|k| k.lease_generation.get()))?,
            V::opt_int(k.map(|k| k.lease_expires_at)),
            V::opt_big(k.map(|k| k.lease_ttl_ms))?,
        ])
    }
}

impl Stored for Lease {
    const TABLE: &'static Table = &LEASES;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Lease {
            attempt: c.valid("attempt_id")?,
            run: c.valid("run_id")?,
            state: c.word("state", LeaseState::parse)?,
            facts: LeaseFacts {
                worker: c.valid("worker")?,
                session: c.valid("session_id")?,
                session_generation: c.counter("session_generation")?,
                offer: c.valid("offer_id")?,
                lease_generation: c.counter("lease_generation")?,
                token_digest: c.valid("token_digest")?,
                version: c.counter("version")?,
                expires_at: c.int("expires_at")?,
            },
            ttl_ms: c.num("ttl_ms")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        let f = &self.facts;
        Ok(vec![
            V::text(self.attempt.as_str()),
            V::text(self.run.as_str()),
            V::text(self.state.as_str()),
            V::text(f.worker.as_str()),
            V::text(f.session.as_str()),
            V::big(f.session_generation.get())?,
            V::text(f.offer.as_str()),
            V::big(f.lease_generation.get())?,
            V::text(f.token_digest.as_str()),
            V::big(f.version.get())?,
            V::int(f.expires_at),
            V::big(self.ttl_ms)?,
        ])
    }
}

impl Stored for Event {
    const TABLE: &'static Table = &EVENTS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Event {
            id: c.valid("id")?,
            run: c.valid("run_id")?,
            attempt: c.opt_valid("attempt_id")?,
            kind: c.text("kind")?,
            from_status: c.opt_text("from_status")?,
            to_status: c.opt_text("to_status")?,
            payload: c.json("payload")?,
            at: c.int("at")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.id.as_str()),
            V::text(self.run.as_str()),
            V::opt_text(self.attempt.as_ref().map(|a| a.as_str())),
            V::text(&self.kind),
            V::opt_text(self.from_status.as_deref()),
            V::opt_text(self.to_status.as_deref()),
            V::json(&self.payload)?,
            V::int(self.at),
        ])
    }
}

impl Stored for Worker {
    const TABLE: &'static Table = &WORKERS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Worker {
            id: c.valid("id")?,
            labels: c.json("labels")?,
            disabled_at: c.opt_int("disabled_at")?,
            revoked_at: c.opt_int("revoked_at")?,
            created_at: c.int("created_at")?,
            updated_at: c.int("updated_at")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.id.as_str()),
            V::json(&self.labels)?,
            V::opt_int(self.disabled_at),
            V::opt_int(self.revoked_at),
            V::int(self.created_at),
            V::int(self.updated_at),
        ])
    }
}

impl Stored for Enrolment {
    const TABLE: &'static Table = &ENROLMENTS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Enrolment {
            token_digest: c.valid("token_digest")?,
            worker: c.valid("worker")?,
            created_at: c.int("created_at")?,
            expires_at: c.int("expires_at")?,
            used_at: c.opt_int("used_at")?,
            serial: c.opt_text("serial")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(self.token_digest.as_str()),
            V::text(self.worker.as_str()),
            V::int(self.created_at),
            V::int(self.expires_at),
            V::opt_int(self.used_at),
            V::opt_text(self.serial.as_deref()),
        ])
    }
}

impl Stored for Certificate {
    const TABLE: &'static Table = &CERTIFICATES;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Certificate {
            serial: c.text("serial")?,
            worker: c.valid("worker")?,
            issued_at: c.int("issued_at")?,
            not_after: c.int("not_after")?,
            revoked_at: c.opt_int("revoked_at")?,
            renewed_from: c.opt_text("renewed_from")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(&self.serial),
            V::text(self.worker.as_str()),
            V::int(self.issued_at),
            V::int(self.not_after),
            V::opt_int(self.revoked_at),
            V::opt_text(self.renewed_from.as_deref()),
        ])
    }
}

impl Stored for Operator {
    const TABLE: &'static Table = &OPERATORS;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(Operator {
            name: c.text("name")?,
            role: c.word("role", Role::parse)?,
            token_digest: c.valid("token_digest")?,
            created_at: c.int("created_at")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::text(&self.name),
            V::text(self.role.as_str()),
            V::text(self.token_digest.as_str()),
            V::int(self.created_at),
        ])
    }
}

impl Stored for AuditRecord {
    const TABLE: &'static Table = &AUDIT;

    fn read<C: Columns + ?Sized>(c: &C) -> Result<Self, C::Error> {
        Ok(AuditRecord {
            at: c.int("at")?,
            principal: c.opt_valid("principal")?,
            route: c.text("route")?,
            outcome: c.text("outcome")?,
        })
    }

    fn values(&self) -> Result<Vec<V>, Corrupt> {
        Ok(vec![
            V::int(self.at),
            V::opt_text(self.principal.as_ref().map(|p| p.as_str())),
            V::text(&self.route),
            V::text(&self.outcome),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backends build every write statement from [`TABLES`] and look it up by
    /// name, and PostgreSQL's update binds the key as `$1`: a type whose table were
    /// missing, or a key not first, would fail only at its first write.
    #[test]
    fn every_stored_table_is_listed_with_unique_columns_and_its_key_first() {
        let stored = [
            Session::TABLE,
            Run::TABLE,
            Attempt::TABLE,
            Offer::TABLE,
            Lease::TABLE,
            Event::TABLE,
            AuditRecord::TABLE,
            LogChunk::TABLE,
            Worker::TABLE,
            Certificate::TABLE,
            Enrolment::TABLE,
            Schedule::TABLE,
            Fire::TABLE,
            Operator::TABLE,
            Delivery::TABLE,
        ];
        assert_eq!(stored.len(), TABLES.len());
        for t in stored {
            assert!(TABLES.iter().any(|l| l.name == t.name), "{} is not in TABLES", t.name);
            let names: Vec<&str> = t.names().collect();
            let unique: std::collections::BTreeSet<&str> = names.iter().copied().collect();
            assert_eq!(unique.len(), names.len(), "{} names a column twice", t.name);
            if let Some(key) = t.key {
                assert_eq!(names[0], key, "{}: the key is the first column", t.name);
            }
        }
    }
}
