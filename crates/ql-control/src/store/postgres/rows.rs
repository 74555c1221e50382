//! Model rows to PostgreSQL columns and back, one function pair per table.
//!
//! The same shape as the SQLite store's `rows.rs`: every struct field of
//! [`crate::model`] has exactly one column (nested lease and claim facts flattened with a
//! prefix), so a row written and read back equals the original, and reading re-validates
//! every value through its `ql_wire` type — a row a foreign writer corrupted surfaces as
//! an error, never as an invalid value in memory.
//!
//! Every integer column is BIGINT (read as `i64`), labels are JSONB (sent and read as
//! text, so no serde feature of the driver is needed), and the other JSON columns are
//! TEXT kept byte for byte. Rows are upserted with `INSERT ... ON CONFLICT (key) DO
//! UPDATE`; events and audit records are only ever inserted.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use ql_wire::ids::{Counter, Invalid};
use ql_wire::lease::StopIntent;

use super::Error;
use crate::model::{
    Attempt, AttemptStatus, AuditRecord, ClaimFacts, EndKind, Event, Lease, LeaseFacts, LeaseState, Offer, OfferState,
    Run, RunStatus, Session, SessionState,
};

type Result<T> = std::result::Result<T, Error>;

/// Parameters of one statement, boxed so one vector holds every column's type.
pub(super) type Params = Vec<Box<dyn ToSql + Sync + Send>>;

fn corrupt(column: &str, why: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("column {column}: {why}"))
}

/// A `u64` as PostgreSQL's BIGINT.
fn int(n: u64) -> Result<i64> {
    i64::try_from(n).map_err(|_| corrupt("integer", format!("{n} does not fit BIGINT")))
}

fn get<'a, T: tokio_postgres::types::FromSql<'a>>(row: &'a Row, col: &str) -> Result<T> {
    row.try_get(col).map_err(Error::Pg)
}

fn text<T: TryFrom<String, Error = Invalid>>(row: &Row, col: &str) -> Result<T> {
    T::try_from(get::<String>(row, col)?).map_err(|e| corrupt(col, e))
}

fn opt_text<T: TryFrom<String, Error = Invalid>>(row: &Row, col: &str) -> Result<Option<T>> {
    get::<Option<String>>(row, col)?.map(T::try_from).transpose().map_err(|e| corrupt(col, e))
}

fn unsigned<T: TryFrom<i64>>(row: &Row, col: &str) -> Result<T> {
    let n: i64 = get(row, col)?;
    T::try_from(n).map_err(|_| corrupt(col, format!("{n} out of range")))
}

fn small(row: &Row, col: &str) -> Result<Option<i32>> {
    get::<Option<i64>>(row, col)?
        .map(|n| i32::try_from(n).map_err(|_| corrupt(col, format!("{n} out of range"))))
        .transpose()
}

fn counter(row: &Row, col: &str) -> Result<Counter> {
    opt_counter(row, col)?.ok_or_else(|| corrupt(col, "NULL"))
}

fn opt_counter(row: &Row, col: &str) -> Result<Option<Counter>> {
    get::<Option<i64>>(row, col)?
        .map(|n| u64::try_from(n).map_err(|_| Invalid::OutOfRange { min: 1, max: u64::MAX }).and_then(Counter::new))
        .transpose()
        .map_err(|e| corrupt(col, e))
}

fn json<T: serde::de::DeserializeOwned>(row: &Row, col: &str) -> Result<T> {
    serde_json::from_str(&get::<String>(row, col)?).map_err(|e| corrupt(col, e))
}

fn opt_json<T: serde::de::DeserializeOwned>(row: &Row, col: &str) -> Result<Option<T>> {
    get::<Option<String>>(row, col)?.map(|s| serde_json::from_str(&s)).transpose().map_err(|e| corrupt(col, e))
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| corrupt("json", e))
}

fn status<T>(row: &Row, col: &str, parse: fn(&str) -> Option<T>) -> Result<T> {
    let s: String = get(row, col)?;
    parse(&s).ok_or_else(|| corrupt(col, format!("unknown value {s:?}")))
}

fn opt_status<T>(row: &Row, col: &str, parse: fn(&str) -> Option<T>) -> Result<Option<T>> {
    get::<Option<String>>(row, col)?
        .map(|s| parse(&s).ok_or_else(|| corrupt(col, format!("unknown value {s:?}"))))
        .transpose()
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

/// Columns sent as text and stored as JSONB.
const JSONB: &[&str] = &["labels"];

/// The select list of a table: JSONB columns come back as text (see the module doc).
fn select_list(cols: &str) -> String {
    cols.split(',')
        .map(str::trim)
        .map(|c| if JSONB.contains(&c) { format!("{c}::text AS {c}") } else { c.to_owned() })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Builds `UPDATE ... SET` of every non-key column `WHERE key = $1 RETURNING 1`, with
/// the parameters in the same order as the upsert's (the key is every table's first
/// column). The store uses it for rows it loaded under a lock in this transaction: a
/// plain update skips the upsert's speculative insertion, and `RETURNING` lets the store
/// prove the row was there.
fn update_sql(table: &str, key: &str, cols: &str) -> String {
    let names: Vec<&str> = cols.split(',').map(str::trim).collect();
    assert_eq!(names[0], key, "the key is the first column");
    let sets: Vec<String> = names
        .iter()
        .enumerate()
        .skip(1)
        .map(
            |(i, c)| {
                if JSONB.contains(c) {
                    format!("{c} = ${}::text::jsonb", i + 1)
                } else {
                    format!("{c} = ${}", i + 1)
                }
            },
        )
        .collect();
    format!("UPDATE {table} SET {} WHERE {key} = $1 RETURNING 1", sets.join(", "))
}

/// Builds `INSERT ... ON CONFLICT (key) DO UPDATE SET` for every non-key column.
fn upsert_sql(table: &str, key: &str, cols: &str) -> String {
    let names: Vec<&str> = cols.split(',').map(str::trim).collect();
    let values: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, c)| if JSONB.contains(c) { format!("${}::text::jsonb", i + 1) } else { format!("${}", i + 1) })
        .collect();
    let updates: Vec<String> = names.iter().filter(|c| **c != key).map(|c| format!("{c} = excluded.{c}")).collect();
    format!(
        "INSERT INTO {table} ({}) VALUES ({}) ON CONFLICT ({key}) DO UPDATE SET {}",
        names.join(", "),
        values.join(", "),
        updates.join(", ")
    )
}

macro_rules! params {
    ($($value:expr),* $(,)?) => {
        vec![$(Box::new($value) as Box<dyn ToSql + Sync + Send>),*]
    };
}

// ---------------------------------------------------------------------------- sessions

const SESSION_COLS_RAW: &str =
    "id, worker, generation, state, capacity, labels, agent_version, arch, created_at, seen_at, expires_at";

/// The select list of `sessions`.
pub(super) static SESSION_COLS: LazyLock<String> = LazyLock::new(|| select_list(SESSION_COLS_RAW));
/// The upsert of `sessions`.
pub(super) static SESSION_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("sessions", "id", SESSION_COLS_RAW));
/// The update of `sessions` (see [`update_sql`]).
pub(super) static SESSION_UPDATE: LazyLock<String> = LazyLock::new(|| update_sql("sessions", "id", SESSION_COLS_RAW));

pub(super) fn session(row: &Row) -> Result<Session> {
    Ok(Session {
        id: text(row, "id")?,
        worker: text(row, "worker")?,
        generation: counter(row, "generation")?,
        state: status(row, "state", SessionState::parse)?,
        capacity: unsigned(row, "capacity")?,
        labels: json::<BTreeMap<String, String>>(row, "labels")?,
        agent_version: get(row, "agent_version")?,
        arch: get(row, "arch")?,
        created_at: get(row, "created_at")?,
        seen_at: get(row, "seen_at")?,
        expires_at: get(row, "expires_at")?,
    })
}

pub(super) fn session_params(s: &Session) -> Result<Params> {
    Ok(params![
        s.id.as_str().to_owned(),
        s.worker.as_str().to_owned(),
        int(s.generation.get())?,
        s.state.as_str(),
        i64::from(s.capacity),
        to_json(&s.labels)?,
        s.agent_version.clone(),
        s.arch.clone(),
        s.created_at,
        s.seen_at,
        s.expires_at,
    ])
}

// -------------------------------------------------------------------------------- runs

const RUN_COLS_RAW: &str = "id, project, spec, labels, status, stop, retry_budget, retries_used, attempts, \
     lease_generations, current_attempt_id, deadline_at, created_at, started_at, finished_at, error_code, summary";

/// The select list of `runs`.
pub(super) static RUN_COLS: LazyLock<String> = LazyLock::new(|| select_list(RUN_COLS_RAW));
/// The upsert of `runs`.
pub(super) static RUN_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("runs", "id", RUN_COLS_RAW));
/// The update of `runs` (see [`update_sql`]).
pub(super) static RUN_UPDATE: LazyLock<String> = LazyLock::new(|| update_sql("runs", "id", RUN_COLS_RAW));

pub(super) fn run(row: &Row) -> Result<Run> {
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
        deadline_at: get(row, "deadline_at")?,
        created_at: get(row, "created_at")?,
        started_at: get(row, "started_at")?,
        finished_at: get(row, "finished_at")?,
        error_code: get(row, "error_code")?,
        summary: get(row, "summary")?,
    })
}

pub(super) fn run_params(r: &Run) -> Result<Params> {
    Ok(params![
        r.id.as_str().to_owned(),
        r.project.as_str().to_owned(),
        to_json(&r.spec)?,
        to_json(&r.labels)?,
        r.status.as_str(),
        stop_text(r.stop),
        i64::from(r.retry_budget),
        i64::from(r.retries_used),
        i64::from(r.attempts),
        int(r.lease_generations)?,
        r.current_attempt.as_ref().map(|a| a.as_str().to_owned()),
        r.deadline_at,
        r.created_at,
        r.started_at,
        r.finished_at,
        r.error_code.clone(),
        r.summary.clone(),
    ])
}

// ---------------------------------------------------------------------------- attempts

const ATTEMPT_COLS_RAW: &str = "id, run_id, number, executor_type, status, offer_id, session_id, worker, \
     lease_worker, lease_session_id, lease_session_generation, lease_offer_id, lease_generation, lease_token_digest, \
     lease_version, lease_expires_at, executor_handle, log_artifact_id, callback_sequence, callback_digest, \
     exit_code, signal, worker_finished_at, artifact, end_kind, created_at, started_at, ended_at, error_code, summary";

/// The select list of `attempts`.
pub(super) static ATTEMPT_COLS: LazyLock<String> = LazyLock::new(|| select_list(ATTEMPT_COLS_RAW));
/// The upsert of `attempts`.
pub(super) static ATTEMPT_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("attempts", "id", ATTEMPT_COLS_RAW));
/// The update of `attempts` (see [`update_sql`]).
pub(super) static ATTEMPT_UPDATE: LazyLock<String> = LazyLock::new(|| update_sql("attempts", "id", ATTEMPT_COLS_RAW));

fn attempt_lease(row: &Row) -> Result<Option<LeaseFacts>> {
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
        expires_at: get(row, "lease_expires_at")?,
    }))
}

pub(super) fn attempt(row: &Row) -> Result<Attempt> {
    Ok(Attempt {
        id: text(row, "id")?,
        run: text(row, "run_id")?,
        number: unsigned(row, "number")?,
        executor_type: get(row, "executor_type")?,
        status: status(row, "status", AttemptStatus::parse)?,
        offer: text(row, "offer_id")?,
        session: text(row, "session_id")?,
        worker: text(row, "worker")?,
        lease: attempt_lease(row)?,
        executor_handle: opt_text(row, "executor_handle")?,
        log_artifact: opt_text(row, "log_artifact_id")?,
        callback_sequence: opt_counter(row, "callback_sequence")?,
        callback_digest: opt_text(row, "callback_digest")?,
        exit_code: small(row, "exit_code")?,
        signal: small(row, "signal")?,
        worker_finished_at: get(row, "worker_finished_at")?,
        artifact: opt_json(row, "artifact")?,
        end: opt_status(row, "end_kind", EndKind::parse)?,
        created_at: get(row, "created_at")?,
        started_at: get(row, "started_at")?,
        ended_at: get(row, "ended_at")?,
        error_code: get(row, "error_code")?,
        summary: get(row, "summary")?,
    })
}

pub(super) fn attempt_params(a: &Attempt) -> Result<Params> {
    let l = a.lease.as_ref();
    Ok(params![
        a.id.as_str().to_owned(),
        a.run.as_str().to_owned(),
        i64::from(a.number),
        a.executor_type.clone(),
        a.status.as_str(),
        a.offer.as_str().to_owned(),
        a.session.as_str().to_owned(),
        a.worker.as_str().to_owned(),
        l.map(|l| l.worker.as_str().to_owned()),
        l.map(|l| l.session.as_str().to_owned()),
        l.map(|l| int(l.session_generation.get())).transpose()?,
        l.map(|l| l.offer.as_str().to_owned()),
        l.map(|l| int(l.lease_generation.get())).transpose()?,
        l.map(|l| l.token_digest.as_str().to_owned()),
        l.map(|l| int(l.version.get())).transpose()?,
        l.map(|l| l.expires_at),
        a.executor_handle.as_ref().map(|h| h.as_str().to_owned()),
        a.log_artifact.as_ref().map(|x| x.as_str().to_owned()),
        a.callback_sequence.map(|c| int(c.get())).transpose()?,
        a.callback_digest.as_ref().map(|d| d.as_str().to_owned()),
        a.exit_code.map(i64::from),
        a.signal.map(i64::from),
        a.worker_finished_at,
        a.artifact.as_ref().map(to_json).transpose()?,
        a.end.map(EndKind::as_str),
        a.created_at,
        a.started_at,
        a.ended_at,
        a.error_code.clone(),
        a.summary.clone(),
    ])
}

// ------------------------------------------------------------------------------ offers

const OFFER_COLS_RAW: &str = "id, run_id, attempt_id, worker, session_id, session_generation, state, \
     expires_at, claim_token_digest, claim_lease_generation, claim_lease_expires_at, claim_lease_ttl_ms";

/// The select list of `offers`.
pub(super) static OFFER_COLS: LazyLock<String> = LazyLock::new(|| select_list(OFFER_COLS_RAW));
/// The upsert of `offers`.
pub(super) static OFFER_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("offers", "id", OFFER_COLS_RAW));
/// The update of `offers` (see [`update_sql`]).
pub(super) static OFFER_UPDATE: LazyLock<String> = LazyLock::new(|| update_sql("offers", "id", OFFER_COLS_RAW));

pub(super) fn offer(row: &Row) -> Result<Offer> {
    let claim = match opt_text(row, "claim_token_digest")? {
        None => None,
        Some(token_digest) => Some(ClaimFacts {
            token_digest,
            lease_generation: counter(row, "claim_lease_generation")?,
            lease_expires_at: get(row, "claim_lease_expires_at")?,
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
        expires_at: get(row, "expires_at")?,
        claim,
    })
}

pub(super) fn offer_params(o: &Offer) -> Result<Params> {
    let c = o.claim.as_ref();
    Ok(params![
        o.id.as_str().to_owned(),
        o.run.as_str().to_owned(),
        o.attempt.as_str().to_owned(),
        o.worker.as_str().to_owned(),
        o.session.as_str().to_owned(),
        int(o.session_generation.get())?,
        o.state.as_str(),
        o.expires_at,
        c.map(|c| c.token_digest.as_str().to_owned()),
        c.map(|c| int(c.lease_generation.get())).transpose()?,
        c.map(|c| c.lease_expires_at),
        c.map(|c| int(c.lease_ttl_ms)).transpose()?,
    ])
}

// ------------------------------------------------------------------------------ leases

const LEASE_COLS_RAW: &str = "attempt_id, run_id, state, worker, session_id, session_generation, offer_id, \
     lease_generation, token_digest, version, expires_at, ttl_ms";

/// The select list of `leases`.
pub(super) static LEASE_COLS: LazyLock<String> = LazyLock::new(|| select_list(LEASE_COLS_RAW));
/// The upsert of `leases`.
pub(super) static LEASE_UPSERT: LazyLock<String> = LazyLock::new(|| upsert_sql("leases", "attempt_id", LEASE_COLS_RAW));
/// The update of `leases` (see [`update_sql`]).
pub(super) static LEASE_UPDATE: LazyLock<String> = LazyLock::new(|| update_sql("leases", "attempt_id", LEASE_COLS_RAW));

pub(super) fn lease(row: &Row) -> Result<Lease> {
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
            expires_at: get(row, "expires_at")?,
        },
        ttl_ms: unsigned(row, "ttl_ms")?,
    })
}

pub(super) fn lease_params(l: &Lease) -> Result<Params> {
    let f = &l.facts;
    Ok(params![
        l.attempt.as_str().to_owned(),
        l.run.as_str().to_owned(),
        l.state.as_str(),
        f.worker.as_str().to_owned(),
        f.session.as_str().to_owned(),
        int(f.session_generation.get())?,
        f.offer.as_str().to_owned(),
        int(f.lease_generation.get())?,
        f.token_digest.as_str().to_owned(),
        int(f.version.get())?,
        f.expires_at,
        int(l.ttl_ms)?,
    ])
}

// ------------------------------------------------------------------------------ events

/// The select list of `events` (`seq` is storage order, not a model field).
pub(super) const EVENT_COLS: &str = "id, run_id, attempt_id, kind, from_status, to_status, payload, at";

/// Appends an event. Never an upsert: the unique index refuses a second event of the
/// same type for the same attempt, which rolls the whole command back.
pub(super) const EVENT_INSERT: &str = "INSERT INTO events (id, run_id, attempt_id, kind, from_status, to_status, \
     payload, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";

pub(super) fn event(row: &Row) -> Result<Event> {
    Ok(Event {
        id: text(row, "id")?,
        run: text(row, "run_id")?,
        attempt: opt_text(row, "attempt_id")?,
        kind: get(row, "kind")?,
        from_status: get(row, "from_status")?,
        to_status: get(row, "to_status")?,
        payload: json(row, "payload")?,
        at: get(row, "at")?,
    })
}

pub(super) fn event_params(e: &Event) -> Result<Params> {
    Ok(params![
        e.id.as_str().to_owned(),
        e.run.as_str().to_owned(),
        e.attempt.as_ref().map(|a| a.as_str().to_owned()),
        e.kind.clone(),
        e.from_status.clone(),
        e.to_status.clone(),
        to_json(&e.payload)?,
        e.at,
    ])
}

// ------------------------------------------------------------------------------- audit

pub(super) fn audit(row: &Row) -> Result<AuditRecord> {
    Ok(AuditRecord {
        at: get(row, "at")?,
        principal: opt_text(row, "principal")?,
        route: get(row, "route")?,
        outcome: get(row, "outcome")?,
    })
}
