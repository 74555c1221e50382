//! Model rows to SQL columns and back, one function pair per table.
//!
//! Every struct field of [`crate::model`] has exactly one column (nested lease and claim
//! facts are flattened with a prefix), so a row written and read back is equal to the
//! original. Reading re-validates every value through its `ql_wire` type: a row a
//! foreign writer corrupted surfaces as an error, never as an invalid value in memory.
//!
//! Rows are upserted with `INSERT ... ON CONFLICT(key) DO UPDATE` rather than
//! `INSERT OR REPLACE`: REPLACE deletes and re-inserts, which would trip the foreign keys
//! pointing at the row. Events and audit records are only ever inserted.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use rusqlite::types::Type;
use rusqlite::{named_params, Connection, Row};

use ql_wire::ids::{Counter, Invalid};
use ql_wire::lease::StopIntent;

use crate::model::{
    Attempt, AttemptStatus, AuditRecord, ClaimFacts, EndKind, Event, Lease, LeaseFacts, LeaseState, Offer, OfferState,
    Run, RunStatus, Session, SessionState,
};

/// A column whose value its type refuses.
#[derive(Debug)]
struct Corrupt {
    column: String,
    why: String,
}

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "column {}: {}", self.column, self.why)
    }
}

impl std::error::Error for Corrupt {}

fn corrupt(row: &Row<'_>, column: &str, why: impl std::fmt::Display) -> rusqlite::Error {
    let idx = row.as_ref().column_index(column).unwrap_or(0);
    rusqlite::Error::FromSqlConversionFailure(
        idx,
        Type::Text,
        Box::new(Corrupt { column: column.to_owned(), why: why.to_string() }),
    )
}

fn too_big(n: u64) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(Box::new(Corrupt {
        column: "integer".to_owned(),
        why: format!("{n} does not fit a signed 64-bit integer"),
    }))
}

/// A `u64` as SQLite's signed integer.
fn int(n: u64) -> rusqlite::Result<i64> {
    i64::try_from(n).map_err(|_| too_big(n))
}

fn text<T: TryFrom<String, Error = Invalid>>(row: &Row<'_>, col: &str) -> rusqlite::Result<T> {
    let s: String = row.get(col)?;
    T::try_from(s).map_err(|e| corrupt(row, col, e))
}

fn opt_text<T: TryFrom<String, Error = Invalid>>(row: &Row<'_>, col: &str) -> rusqlite::Result<Option<T>> {
    let s: Option<String> = row.get(col)?;
    s.map(T::try_from).transpose().map_err(|e| corrupt(row, col, e))
}

fn unsigned<T: TryFrom<i64>>(row: &Row<'_>, col: &str) -> rusqlite::Result<T> {
    let n: i64 = row.get(col)?;
    T::try_from(n).map_err(|_| corrupt(row, col, format!("{n} out of range")))
}

fn counter(row: &Row<'_>, col: &str) -> rusqlite::Result<Counter> {
    opt_counter(row, col)?.ok_or_else(|| corrupt(row, col, "NULL"))
}

fn opt_counter(row: &Row<'_>, col: &str) -> rusqlite::Result<Option<Counter>> {
    let n: Option<i64> = row.get(col)?;
    n.map(|n| u64::try_from(n).map_err(|_| Invalid::OutOfRange { min: 1, max: u64::MAX }).and_then(Counter::new))
        .transpose()
        .map_err(|e| corrupt(row, col, e))
}

fn json<T: serde::de::DeserializeOwned>(row: &Row<'_>, col: &str) -> rusqlite::Result<T> {
    let s: String = row.get(col)?;
    serde_json::from_str(&s).map_err(|e| corrupt(row, col, e))
}

fn opt_json<T: serde::de::DeserializeOwned>(row: &Row<'_>, col: &str) -> rusqlite::Result<Option<T>> {
    let s: Option<String> = row.get(col)?;
    s.map(|s| serde_json::from_str(&s)).transpose().map_err(|e| corrupt(row, col, e))
}

fn to_json<T: serde::Serialize>(value: &T) -> rusqlite::Result<String> {
    serde_json::to_string(value).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

fn status<T>(row: &Row<'_>, col: &str, parse: fn(&str) -> Option<T>) -> rusqlite::Result<T> {
    let s: String = row.get(col)?;
    parse(&s).ok_or_else(|| corrupt(row, col, format!("unknown value {s:?}")))
}

fn opt_status<T>(row: &Row<'_>, col: &str, parse: fn(&str) -> Option<T>) -> rusqlite::Result<Option<T>> {
    let s: Option<String> = row.get(col)?;
    s.map(|s| parse(&s).ok_or_else(|| corrupt(row, col, format!("unknown value {s:?}")))).transpose()
}

/// `StopIntent` has no text form of its own in `ql_wire`; these are its wire words.
fn stop_text(stop: Option<StopIntent>) -> Option<&'static str> {
    stop.map(|s| match s {
        StopIntent::Cancel => "cancel",
        StopIntent::Timeout => "timeout",
    })
}

fn parse_stop(s: &str) -> Option<StopIntent> {
    match s {
        "cancel" => Some(StopIntent::Cancel),
        "timeout" => Some(StopIntent::Timeout),
        _ => None,
    }
}

/// Builds `INSERT ... ON CONFLICT(key) DO UPDATE SET` for every non-key column.
fn upsert_sql(table: &str, key: &str, cols: &str) -> String {
    let names: Vec<&str> = cols.split(',').map(str::trim).collect();
    let values: Vec<String> = names.iter().map(|c| format!(":{c}")).collect();
    let updates: Vec<String> = names.iter().filter(|c| **c != key).map(|c| format!("{c} = excluded.{c}")).collect();
    format!(
        "INSERT INTO {table} ({}) VALUES ({}) ON CONFLICT ({key}) DO UPDATE SET {}",
        names.join(", "),
        values.join(", "),
        updates.join(", ")
    )
}

// ---------------------------------------------------------------------------- sessions

/// Columns of `sessions`, in select order.
pub(super) const SESSION_COLS: &str =
    "id, worker, generation, state, capacity, labels, agent_version, arch, created_at, seen_at, expires_at";

static SESSION_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("sessions", "id", SESSION_COLS));

pub(super) fn session(row: &Row<'_>) -> rusqlite::Result<Session> {
    Ok(Session {
        id: text(row, "id")?,
        worker: text(row, "worker")?,
        generation: counter(row, "generation")?,
        state: status(row, "state", SessionState::parse)?,
        capacity: unsigned(row, "capacity")?,
        labels: json::<BTreeMap<String, String>>(row, "labels")?,
        agent_version: row.get("agent_version")?,
        arch: row.get("arch")?,
        created_at: row.get("created_at")?,
        seen_at: row.get("seen_at")?,
        expires_at: row.get("expires_at")?,
    })
}

pub(super) fn put_session(conn: &Connection, s: &Session) -> rusqlite::Result<()> {
    conn.prepare_cached(&SESSION_UPSERT)?.execute(named_params! {
        ":id": s.id.as_str(),
        ":worker": s.worker.as_str(),
        ":generation": int(s.generation.get())?,
        ":state": s.state.as_str(),
        ":capacity": s.capacity,
        ":labels": to_json(&s.labels)?,
        ":agent_version": s.agent_version,
        ":arch": s.arch,
        ":created_at": s.created_at,
        ":seen_at": s.seen_at,
        ":expires_at": s.expires_at,
    })?;
    Ok(())
}

// -------------------------------------------------------------------------------- runs

/// Columns of `runs`, in select order.
pub(super) const RUN_COLS: &str = "id, project, spec, labels, status, stop, retry_budget, retries_used, attempts, \
     lease_generations, current_attempt_id, deadline_at, created_at, started_at, finished_at, error_code, summary";

static RUN_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("runs", "id", RUN_COLS));

pub(super) fn run(row: &Row<'_>) -> rusqlite::Result<Run> {
    Ok(Run {
        id: text(row, "id")?,
        project: text(row, "project")?,
        spec: json(row, "spec")?,
        labels: json(row, "labels")?,
        status: status(row, "status", RunStatus::parse)?,
        stop: opt_status(row, "stop", parse_stop)?,
        retry_budget: unsigned(row, "retry_budget")?,
        retries_used: unsigned(row, "retries_used")?,
        attempts: unsigned(row, "attempts")?,
        lease_generations: unsigned(row, "lease_generations")?,
        current_attempt: opt_text(row, "current_attempt_id")?,
        deadline_at: row.get("deadline_at")?,
        created_at: row.get("created_at")?,
        started_at: row.get("started_at")?,
        finished_at: row.get("finished_at")?,
        error_code: row.get("error_code")?,
        summary: row.get("summary")?,
    })
}

pub(super) fn put_run(conn: &Connection, r: &Run) -> rusqlite::Result<()> {
    conn.prepare_cached(&RUN_UPSERT)?.execute(named_params! {
        ":id": r.id.as_str(),
        ":project": r.project.as_str(),
        ":spec": to_json(&r.spec)?,
        ":labels": to_json(&r.labels)?,
        ":status": r.status.as_str(),
        ":stop": stop_text(r.stop),
        ":retry_budget": r.retry_budget,
        ":retries_used": r.retries_used,
        ":attempts": r.attempts,
        ":lease_generations": int(r.lease_generations)?,
        ":current_attempt_id": r.current_attempt.as_ref().map(|a| a.as_str()),
        ":deadline_at": r.deadline_at,
        ":created_at": r.created_at,
        ":started_at": r.started_at,
        ":finished_at": r.finished_at,
        ":error_code": r.error_code,
        ":summary": r.summary,
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------- attempts

/// Columns of `attempts`, in select order.
pub(super) const ATTEMPT_COLS: &str = "id, run_id, number, executor_type, status, offer_id, session_id, worker, \
     lease_worker, lease_session_id, lease_session_generation, lease_offer_id, lease_generation, lease_token_digest, \
     lease_version, lease_expires_at, executor_handle, log_artifact_id, callback_sequence, callback_digest, \
     exit_code, signal, worker_finished_at, artifact, end_kind, created_at, started_at, ended_at, error_code, summary";

static ATTEMPT_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("attempts", "id", ATTEMPT_COLS));

fn attempt_lease(row: &Row<'_>) -> rusqlite::Result<Option<LeaseFacts>> {
    let Some(worker) = opt_text(row, "lease_worker")? else {
        return Ok(None);
    };
    Ok(Some(LeaseFacts {
        worker,
        session: text(row, "lease_session_id")?,
        session_generation: counter(row, "lease_session_generation")?,
        offer: text(row, "lease_offer_id")?,
        lease_generation: counter(row, "lease_generation")?,
        token_digest: text(row, "lease_token_digest")?,
        version: counter(row, "lease_version")?,
        expires_at: row.get("lease_expires_at")?,
    }))
}

pub(super) fn attempt(row: &Row<'_>) -> rusqlite::Result<Attempt> {
    Ok(Attempt {
        id: text(row, "id")?,
        run: text(row, "run_id")?,
        number: unsigned(row, "number")?,
        executor_type: row.get("executor_type")?,
        status: status(row, "status", AttemptStatus::parse)?,
        offer: text(row, "offer_id")?,
        session: text(row, "session_id")?,
        worker: text(row, "worker")?,
        lease: attempt_lease(row)?,
        executor_handle: opt_text(row, "executor_handle")?,
        log_artifact: opt_text(row, "log_artifact_id")?,
        callback_sequence: opt_counter(row, "callback_sequence")?,
        callback_digest: opt_text(row, "callback_digest")?,
        exit_code: row.get("exit_code")?,
        signal: row.get("signal")?,
        worker_finished_at: row.get("worker_finished_at")?,
        artifact: opt_json(row, "artifact")?,
        end: opt_status(row, "end_kind", EndKind::parse)?,
        created_at: row.get("created_at")?,
        started_at: row.get("started_at")?,
        ended_at: row.get("ended_at")?,
        error_code: row.get("error_code")?,
        summary: row.get("summary")?,
    })
}

pub(super) fn put_attempt(conn: &Connection, a: &Attempt) -> rusqlite::Result<()> {
    let l = a.lease.as_ref();
    conn.prepare_cached(&ATTEMPT_UPSERT)?.execute(named_params! {
        ":id": a.id.as_str(),
        ":run_id": a.run.as_str(),
        ":number": a.number,
        ":executor_type": a.executor_type,
        ":status": a.status.as_str(),
        ":offer_id": a.offer.as_str(),
        ":session_id": a.session.as_str(),
        ":worker": a.worker.as_str(),
        ":lease_worker": l.map(|l| l.worker.as_str()),
        ":lease_session_id": l.map(|l| l.session.as_str()),
        ":lease_session_generation": l.map(|l| int(l.session_generation.get())).transpose()?,
        ":lease_offer_id": l.map(|l| l.offer.as_str()),
        ":lease_generation": l.map(|l| int(l.lease_generation.get())).transpose()?,
        ":lease_token_digest": l.map(|l| l.token_digest.as_str()),
        ":lease_version": l.map(|l| int(l.version.get())).transpose()?,
        ":lease_expires_at": l.map(|l| l.expires_at),
        ":executor_handle": a.executor_handle.as_ref().map(|h| h.as_str()),
        ":log_artifact_id": a.log_artifact.as_ref().map(|x| x.as_str()),
        ":callback_sequence": a.callback_sequence.map(|c| int(c.get())).transpose()?,
        ":callback_digest": a.callback_digest.as_ref().map(|d| d.as_str()),
        ":exit_code": a.exit_code,
        ":signal": a.signal,
        ":worker_finished_at": a.worker_finished_at,
        ":artifact": a.artifact.as_ref().map(to_json).transpose()?,
        ":end_kind": a.end.map(EndKind::as_str),
        ":created_at": a.created_at,
        ":started_at": a.started_at,
        ":ended_at": a.ended_at,
        ":error_code": a.error_code,
        ":summary": a.summary,
    })?;
    Ok(())
}

// ------------------------------------------------------------------------------ offers

/// Columns of `offers`, in select order.
pub(super) const OFFER_COLS: &str = "id, run_id, attempt_id, worker, session_id, session_generation, state, \
     expires_at, claim_token_digest, claim_lease_generation, claim_lease_expires_at, claim_lease_ttl_ms";

static OFFER_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("offers", "id", OFFER_COLS));

pub(super) fn offer(row: &Row<'_>) -> rusqlite::Result<Offer> {
    let claim = match opt_text(row, "claim_token_digest")? {
        None => None,
        Some(token_digest) => Some(ClaimFacts {
            token_digest,
            lease_generation: counter(row, "claim_lease_generation")?,
            lease_expires_at: row.get("claim_lease_expires_at")?,
            lease_ttl_ms: unsigned(row, "claim_lease_ttl_ms")?,
        }),
    };
    Ok(Offer {
        id: text(row, "id")?,
        run: text(row, "run_id")?,
        attempt: text(row, "attempt_id")?,
        worker: text(row, "worker")?,
        session: text(row, "session_id")?,
        session_generation: counter(row, "session_generation")?,
        state: status(row, "state", OfferState::parse)?,
        expires_at: row.get("expires_at")?,
        claim,
    })
}

pub(super) fn put_offer(conn: &Connection, o: &Offer) -> rusqlite::Result<()> {
    let c = o.claim.as_ref();
    conn.prepare_cached(&OFFER_UPSERT)?.execute(named_params! {
        ":id": o.id.as_str(),
        ":run_id": o.run.as_str(),
        ":attempt_id": o.attempt.as_str(),
        ":worker": o.worker.as_str(),
        ":session_id": o.session.as_str(),
        ":session_generation": int(o.session_generation.get())?,
        ":state": o.state.as_str(),
        ":expires_at": o.expires_at,
        ":claim_token_digest": c.map(|c| c.token_digest.as_str()),
        ":claim_lease_generation": c.map(|c| int(c.lease_generation.get())).transpose()?,
        ":claim_lease_expires_at": c.map(|c| c.lease_expires_at),
        ":claim_lease_ttl_ms": c.map(|c| int(c.lease_ttl_ms)).transpose()?,
    })?;
    Ok(())
}

// ------------------------------------------------------------------------------ leases

/// Columns of `leases`, in select order.
pub(super) const LEASE_COLS: &str = "attempt_id, run_id, state, worker, session_id, session_generation, offer_id, \
     lease_generation, token_digest, version, expires_at, ttl_ms";

static LEASE_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("leases", "attempt_id", LEASE_COLS));

pub(super) fn lease(row: &Row<'_>) -> rusqlite::Result<Lease> {
    Ok(Lease {
        attempt: text(row, "attempt_id")?,
        run: text(row, "run_id")?,
        state: status(row, "state", LeaseState::parse)?,
        facts: LeaseFacts {
            worker: text(row, "worker")?,
            session: text(row, "session_id")?,
            session_generation: counter(row, "session_generation")?,
            offer: text(row, "offer_id")?,
            lease_generation: counter(row, "lease_generation")?,
            token_digest: text(row, "token_digest")?,
            version: counter(row, "version")?,
            expires_at: row.get("expires_at")?,
        },
        ttl_ms: unsigned(row, "ttl_ms")?,
    })
}

pub(super) fn put_lease(conn: &Connection, l: &Lease) -> rusqlite::Result<()> {
    let f = &l.facts;
    conn.prepare_cached(&LEASE_UPSERT)?.execute(named_params! {
        ":attempt_id": l.attempt.as_str(),
        ":run_id": l.run.as_str(),
        ":state": l.state.as_str(),
        ":worker": f.worker.as_str(),
        ":session_id": f.session.as_str(),
        ":session_generation": int(f.session_generation.get())?,
        ":offer_id": f.offer.as_str(),
        ":lease_generation": int(f.lease_generation.get())?,
        ":token_digest": f.token_digest.as_str(),
        ":version": int(f.version.get())?,
        ":expires_at": f.expires_at,
        ":ttl_ms": int(l.ttl_ms)?,
    })?;
    Ok(())
}

// ------------------------------------------------------------------------------ events

/// Columns of `events`, in select order (`seq` is storage order, not a model field).
pub(super) const EVENT_COLS: &str = "id, run_id, attempt_id, kind, from_status, to_status, payload, at";

pub(super) fn event(row: &Row<'_>) -> rusqlite::Result<Event> {
    Ok(Event {
        id: text(row, "id")?,
        run: text(row, "run_id")?,
        attempt: opt_text(row, "attempt_id")?,
        kind: row.get("kind")?,
        from_status: row.get("from_status")?,
        to_status: row.get("to_status")?,
        payload: json(row, "payload")?,
        at: row.get("at")?,
    })
}

/// Appends an event. Never an upsert: the unique index refuses a second event of the
/// same type for the same attempt, which rolls the whole command back.
pub(super) fn append_event(conn: &Connection, e: &Event) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO events (id, run_id, attempt_id, kind, from_status, to_status, payload, at) \
         VALUES (:id, :run_id, :attempt_id, :kind, :from_status, :to_status, :payload, :at)",
    )?
    .execute(named_params! {
        ":id": e.id.as_str(),
        ":run_id": e.run.as_str(),
        ":attempt_id": e.attempt.as_ref().map(|a| a.as_str()),
        ":kind": e.kind,
        ":from_status": e.from_status,
        ":to_status": e.to_status,
        ":payload": to_json(&e.payload)?,
        ":at": e.at,
    })?;
    Ok(())
}

// ------------------------------------------------------------------------------- audit

pub(super) fn audit(row: &Row<'_>) -> rusqlite::Result<AuditRecord> {
    Ok(AuditRecord {
        at: row.get("at")?,
        principal: opt_text(row, "principal")?,
        route: row.get("route")?,
        outcome: row.get("outcome")?,
    })
}

pub(super) fn append_audit(conn: &Connection, r: &AuditRecord) -> rusqlite::Result<()> {
    conn.prepare_cached("INSERT INTO audit (at, principal, route, outcome) VALUES (?1, ?2, ?3, ?4)")?.execute((
        r.at,
        r.principal.as_ref().map(|p| p.as_str()),
        &r.route,
        &r.outcome,
    ))?;
    Ok(())
}
