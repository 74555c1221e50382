//! Loading a command's [`Keys`] into [`Rows`], inside the command's transaction.
//!
//! SQLite has one write lock for the whole file and `BEGIN IMMEDIATE` takes it up front,
//! so the protocol's lock order holds trivially; loads still follow it (attempt, session,
//! run, lease) so the shape matches the PostgreSQL store. Every multi-row load is
//! bounded: the sweeper and placement take batches, and the next call takes the rest.

use rusqlite::{Connection, OptionalExtension, Row};

use ql_wire::ids::{AttemptId, OfferId, RunId, SessionId, WorkerId};

use super::queue::Queue;
use super::rows;
use crate::core::{Fit, Grace, Keys, Lapsed, Rows, Timings, Work, COMPLETION_EVENT};
use crate::model::{
    Attempt, Certificate, Delivery, Enrolment, Event, Lease, Millis, Offer, Run, Schedule, Session, Worker,
};
use crate::store::records::{
    ATTEMPT_COLS, CERTIFICATE_COLS, DELIVERY_COLS, ENROLMENT_COLS, EVENT_COLS, LEASE_COLS, OFFER_COLS, OPERATOR_COLS,
    RUN_COLS, SCHEDULE_COLS, SESSION_COLS, WORKER_COLS,
};

/// Most queued runs placement looks at per poll.
pub(super) const PLACEMENT_BATCH: usize = 256;
/// Most lapsed rows of each kind one sweep handles, and most schedules it fires.
pub(super) const SWEEP_BATCH: usize = 256;

/// When the worker's newest renewed certificate was issued (a renewal's rate: see
/// `core::identity::record_certificate`).
const LAST_RENEWAL: &str = "SELECT max(issued_at) FROM certificates WHERE worker = ?1 AND renewed_from IS NOT NULL";

pub(super) fn schedule(conn: &Connection, name: &str) -> rusqlite::Result<Option<Schedule>> {
    one(conn, &format!("SELECT {SCHEDULE_COLS} FROM schedules WHERE name = ?1"), name, rows::read)
}

/// A run's webhook delivery.
pub(super) fn delivery(conn: &Connection, run: &RunId) -> rusqlite::Result<Option<Delivery>> {
    one(conn, &format!("SELECT {DELIVERY_COLS} FROM deliveries WHERE run_id = ?1"), run.as_str(), rows::read)
}

/// At most `batch` deliveries due by `now` whose runs ended, each with its run, earliest
/// first.
fn due_deliveries(conn: &Connection, now: Millis, batch: usize) -> rusqlite::Result<Vec<(Delivery, Run)>> {
    let sql = format!(
        "SELECT {DELIVERY_COLS} FROM deliveries WHERE state IN ('waiting', 'pending') AND next_at <= ?1 \
         AND run_id IN (SELECT id FROM runs WHERE status IN ('succeeded', 'failed', 'cancelled', 'timed_out')) \
         ORDER BY next_at, run_id LIMIT ?2"
    );
    let due: Vec<Delivery> = conn
        .prepare_cached(&sql)?
        .query_map((now, i64::try_from(batch).unwrap_or(i64::MAX)), rows::read)?
        .collect::<rusqlite::Result<_>>()?;
    let mut out = Vec::with_capacity(due.len());
    for d in due {
        if let Some(r) = run(conn, &d.run)? {
            out.push((d, r));
        }
    }
    Ok(out)
}

/// The schedules due by `now`, each with its last run and its latest fire time, earliest
/// first.
fn due_schedules(conn: &Connection, now: Millis) -> rusqlite::Result<Vec<crate::core::DueSchedule>> {
    let sql = format!(
        "SELECT {SCHEDULE_COLS} FROM schedules WHERE paused = 0 AND due_at <= ?1 ORDER BY due_at, name LIMIT ?2"
    );
    let due: Vec<Schedule> = conn
        .prepare_cached(&sql)?
        .query_map((now, SWEEP_BATCH as i64), rows::read)?
        .collect::<rusqlite::Result<_>>()?;
    let mut out = Vec::with_capacity(due.len());
    for s in due {
        let last = match &s.last_run {
            Some(id) => run(conn, id)?,
            None => None,
        };
        let fired: Option<Millis> = conn
            .prepare_cached("SELECT max(fire_at) FROM fires WHERE schedule = ?1")?
            .query_row([&s.name], |r| r.get(0))?;
        out.push((s, last, fired));
    }
    Ok(out)
}

fn one<T>(
    conn: &Connection,
    sql: &str,
    key: &str,
    map: fn(&Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<Option<T>> {
    conn.prepare_cached(sql)?.query_row([key], map).optional()
}

pub(super) fn session(conn: &Connection, id: &SessionId) -> rusqlite::Result<Option<Session>> {
    one(conn, &format!("SELECT {SESSION_COLS} FROM sessions WHERE id = ?1"), id.as_str(), rows::read)
}

pub(super) fn run(conn: &Connection, id: &RunId) -> rusqlite::Result<Option<Run>> {
    one(conn, &format!("SELECT {RUN_COLS} FROM runs WHERE id = ?1"), id.as_str(), rows::read)
}

pub(super) fn attempt(conn: &Connection, id: &AttemptId) -> rusqlite::Result<Option<Attempt>> {
    one(conn, &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE id = ?1"), id.as_str(), rows::read)
}

pub(super) fn lease(conn: &Connection, attempt: &AttemptId) -> rusqlite::Result<Option<Lease>> {
    one(conn, &format!("SELECT {LEASE_COLS} FROM leases WHERE attempt_id = ?1"), attempt.as_str(), rows::read)
}

pub(super) fn worker(conn: &Connection, id: &WorkerId) -> rusqlite::Result<Option<Worker>> {
    one(conn, &format!("SELECT {WORKER_COLS} FROM workers WHERE id = ?1"), id.as_str(), rows::read)
}

pub(super) fn certificate(conn: &Connection, serial: &str) -> rusqlite::Result<Option<Certificate>> {
    one(conn, &format!("SELECT {CERTIFICATE_COLS} FROM certificates WHERE serial = ?1"), serial, rows::read)
}

fn enrolment(conn: &Connection, digest: &str) -> rusqlite::Result<Option<Enrolment>> {
    one(conn, &format!("SELECT {ENROLMENT_COLS} FROM enrolments WHERE token_digest = ?1"), digest, rows::read)
}

fn worker_certificates(conn: &Connection, worker: &WorkerId) -> rusqlite::Result<Vec<Certificate>> {
    let sql = format!("SELECT {CERTIFICATE_COLS} FROM certificates WHERE worker = ?1 ORDER BY issued_at, serial");
    conn.prepare_cached(&sql)?.query_map([worker.as_str()], rows::read)?.collect()
}

/// Each named row with its run and attempt, by key; a row gone meanwhile is left out.
fn with_run_attempt<T>(
    conn: &Connection,
    ids: Vec<(String, String, String)>,
    row: impl Fn(&Connection, &str) -> rusqlite::Result<Option<T>>,
) -> rusqlite::Result<Vec<(T, Run, Attempt)>> {
    let mut out = Vec::with_capacity(ids.len());
    for (key, r, a) in ids {
        let (Some(x), Some(run), Some(attempt)) = (
            row(conn, &key)?,
            one(conn, &format!("SELECT {RUN_COLS} FROM runs WHERE id = ?1"), &r, rows::read)?,
            one(conn, &format!("SELECT {ATTEMPT_COLS} FROM attempts WHERE id = ?1"), &a, rows::read)?,
        ) else {
            continue;
        };
        out.push((x, run, attempt));
    }
    Ok(out)
}

fn offer_by(conn: &Connection, id: &str) -> rusqlite::Result<Option<Offer>> {
    one(conn, &format!("SELECT {OFFER_COLS} FROM offers WHERE id = ?1"), id, rows::read)
}

fn lease_by(conn: &Connection, attempt: &str) -> rusqlite::Result<Option<Lease>> {
    one(conn, &format!("SELECT {LEASE_COLS} FROM leases WHERE attempt_id = ?1"), attempt, rows::read)
}

/// What the worker holds: its leased attempts and open offers (a worker holds at most
/// its sessions' capacity of them).
fn worker_work(conn: &Connection, worker: &WorkerId) -> rusqlite::Result<Work> {
    let triples = |sql: &str| -> rusqlite::Result<Vec<(String, String, String)>> {
        conn.prepare_cached(sql)?.query_map([worker.as_str()], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?.collect()
    };
    let leased = triples(
        "SELECT attempt_id, run_id, attempt_id FROM leases WHERE state = 'leased' AND worker = ?1 ORDER BY attempt_id",
    )?;
    let open = triples("SELECT id, run_id, attempt_id FROM offers WHERE state = 'open' AND worker = ?1 ORDER BY id")?;
    Ok(Work { leases: with_run_attempt(conn, leased, lease_by)?, offers: with_run_attempt(conn, open, offer_by)? })
}

pub(super) fn offer(conn: &Connection, id: &OfferId) -> rusqlite::Result<Option<Offer>> {
    one(conn, &format!("SELECT {OFFER_COLS} FROM offers WHERE id = ?1"), id.as_str(), rows::read)
}

fn completion_event(conn: &Connection, attempt: &AttemptId) -> rusqlite::Result<Option<Event>> {
    conn.prepare_cached(&format!("SELECT {EVENT_COLS} FROM events WHERE attempt_id = ?1 AND kind = ?2"))?
        .query_row([attempt.as_str(), COMPLETION_EVENT], rows::read)
        .optional()
}

/// The worker's live sessions (to replace) and its highest generation (to succeed). Older
/// ended sessions cannot change the decision, so they are not loaded.
fn worker_sessions(conn: &Connection, worker: &WorkerId) -> rusqlite::Result<Vec<Session>> {
    let sql = format!(
        "SELECT {SESSION_COLS} FROM sessions WHERE worker = ?1 AND (state IN ('online', 'draining') \
         OR generation = (SELECT MAX(generation) FROM sessions WHERE worker = ?1)) ORDER BY generation"
    );
    conn.prepare_cached(&sql)?.query_map([worker.as_str()], rows::read)?.collect()
}

fn open_offers(conn: &Connection, session: &SessionId) -> rusqlite::Result<Vec<Offer>> {
    let sql =
        format!("SELECT {OFFER_COLS} FROM offers WHERE session_id = ?1 AND state = 'open' ORDER BY expires_at, id");
    conn.prepare_cached(&sql)?.query_map([session.as_str()], rows::read)?.collect()
}

fn active_attempts(conn: &Connection, session: &SessionId) -> rusqlite::Result<u32> {
    let n: i64 = conn
        .prepare_cached(
            "SELECT COUNT(*) FROM attempts WHERE session_id = ?1 \
             AND status IN ('offered', 'claimed', 'starting', 'running')",
        )?
        .query_row([session.as_str()], |r| r.get(0))?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

fn lapsed(conn: &Connection, now: Millis) -> rusqlite::Result<Lapsed> {
    let limit = SWEEP_BATCH as i64;
    let sessions = conn
        .prepare_cached(&format!(
            "SELECT {SESSION_COLS} FROM sessions WHERE state IN ('online', 'draining') AND expires_at <= ?1 \
             ORDER BY expires_at, id LIMIT ?2"
        ))?
        .query_map((now, limit), rows::read)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    // Each lapsed offer or lease is read with its run and attempt by key (at most one
    // batch of point lookups), so every table keeps its one row-mapping function.
    let offer_ids: Vec<(String, String, String)> = conn
        .prepare_cached(
            "SELECT id, run_id, attempt_id FROM offers WHERE state = 'open' AND expires_at <= ?1 \
             ORDER BY expires_at, id LIMIT ?2",
        )?
        .query_map((now, limit), |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let offers = with_run_attempt(conn, offer_ids, offer_by)?;
    let lease_ids: Vec<(String, String, String)> = conn
        .prepare_cached(
            "SELECT attempt_id, run_id, attempt_id FROM leases WHERE state = 'leased' AND expires_at <= ?1 \
             ORDER BY expires_at, attempt_id LIMIT ?2",
        )?
        .query_map((now, limit), |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let leases = with_run_attempt(conn, lease_ids, lease_by)?;
    let overdue = conn
        .prepare_cached(&format!(
            "SELECT {RUN_COLS} FROM runs WHERE deadline_at IS NOT NULL AND deadline_at <= ?1 \
             AND status NOT IN ('succeeded', 'failed', 'cancelled', 'timed_out') \
             AND (stop IS NULL OR stop <> 'timeout') ORDER BY deadline_at, id LIMIT ?2"
        ))?
        .query_map((now, limit), rows::read)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Lapsed { sessions, offers, leases, overdue })
}

/// When a replica last swept (`None` before the first sweep).
fn alive_at(conn: &Connection) -> rusqlite::Result<Option<Millis>> {
    conn.prepare_cached("SELECT alive_at FROM authority WHERE id = 1")?.query_row([], |r| r.get(0)).optional()
}

/// Every live row an outage's grace extends (once per outage, so not batched).
fn grace(conn: &Connection, absent_ms: Millis) -> rusqlite::Result<Grace> {
    let sessions = conn
        .prepare_cached(&format!(
            "SELECT {SESSION_COLS} FROM sessions WHERE state IN ('online', 'draining') ORDER BY id"
        ))?
        .query_map([], rows::read)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let leased: Vec<String> = conn
        .prepare_cached("SELECT attempt_id FROM leases WHERE state = 'leased' ORDER BY attempt_id")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let mut leases = Vec::with_capacity(leased.len());
    for a in leased {
        let id = AttemptId::parse(a.as_str()).map_err(|e| rusqlite::Error::ToSqlConversionFailure(e.into()))?;
        if let (Some(l), Some(at)) = (lease(conn, &id)?, attempt(conn, &id)?) {
            leases.push((l, at));
        }
    }
    let offers = conn
        .prepare_cached(&format!("SELECT {OFFER_COLS} FROM offers WHERE state = 'open' ORDER BY id"))?
        .query_map([], rows::read)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(Grace { absent_ms, sessions, leases, offers })
}

/// Loads what `keys` names. `sweep_now` is DB time for the lapse queries; the decision
/// reads DB time again after loading and re-checks every lapse against it.
pub(super) fn load(
    conn: &Connection,
    keys: &Keys,
    timings: &Timings,
    queue: &mut Queue,
    sweep_now: impl FnOnce() -> rusqlite::Result<Millis>,
) -> rusqlite::Result<Rows> {
    let mut rows = Rows::default();
    if let Some(id) = &keys.attempt {
        rows.attempt = attempt(conn, id)?;
        if rows.attempt.is_some() {
            rows.lease = lease(conn, id)?;
        }
    }
    if let Some(id) = &keys.session {
        rows.session = session(conn, id)?;
    }
    // The run named by the keys, else the attempt's own run.
    let run_id = keys.run.clone().or_else(|| rows.attempt.as_ref().map(|a| a.run.clone()));
    if let Some(id) = &run_id {
        rows.run = run(conn, id)?;
    }
    if let Some(id) = &keys.offer {
        rows.offer = offer(conn, id)?;
    }
    if let Some(w) = &keys.worker_sessions {
        rows.worker_sessions = worker_sessions(conn, w)?;
    }
    if let Some(w) = &keys.worker {
        rows.worker = worker(conn, w)?;
    }
    if let Some(w) = &keys.worker_certificates {
        rows.certificates = worker_certificates(conn, w)?;
        let sql = format!("SELECT {ENROLMENT_COLS} FROM enrolments WHERE worker = ?1 AND used_at IS NULL");
        rows.enrolments =
            conn.prepare_cached(&sql)?.query_map([w.as_str()], rows::read)?.collect::<rusqlite::Result<_>>()?;
    }
    if let Some(w) = &keys.worker_work {
        rows.worker_work = worker_work(conn, w)?;
    }
    if let Some(serial) = &keys.certificate {
        rows.certificate = certificate(conn, serial)?;
    }
    if let Some(serial) = &keys.presented {
        rows.presented = certificate(conn, serial)?;
    }
    if let Some(w) = &keys.last_renewal {
        rows.last_renewal = conn.prepare_cached(LAST_RENEWAL)?.query_row([w.as_str()], |r| r.get(0))?;
    }
    if let Some(digest) = &keys.enrolment {
        rows.enrolment = enrolment(conn, digest.as_str())?;
    }
    if let Some(name) = &keys.schedule {
        rows.schedule = schedule(conn, name)?;
    }
    if let Some(name) = &keys.operator {
        let sql = format!("SELECT {OPERATOR_COLS} FROM operators WHERE name = ?1");
        rows.operator = one(conn, &sql, name, rows::read)?;
    }
    if keys.placement {
        if let Some(s) = rows.session.clone() {
            // The session's own worker, whatever the keys named.
            let trusted = rows.worker.as_ref().filter(|w| w.id == s.worker).map(|w| w.labels.clone());
            let fit = Fit { trusted: trusted.unwrap_or_default(), declared: s.labels.clone() };
            rows.active_attempts = active_attempts(conn, &s.id)?;
            let room = crate::core::placement_room(&s, rows.active_attempts).min(PLACEMENT_BATCH);
            rows.queued = queue.fitting(conn, &fit, room)?;
            rows.open_offers = open_offers(conn, &s.id)?;
        }
    }
    if keys.current_attempt {
        if let Some(current) = rows.run.as_ref().and_then(|r| r.current_attempt.clone()) {
            rows.attempt = attempt(conn, &current)?;
            rows.lease = lease(conn, &current)?;
            if let Some(o) = rows.attempt.as_ref().map(|a| a.offer.clone()) {
                rows.offer = offer(conn, &o)?;
            }
        }
    }
    if keys.completion_event {
        if let Some(id) = &keys.attempt {
            rows.completion_event = completion_event(conn, id)?;
        }
    }
    if keys.due_schedules {
        rows.due_schedules = due_schedules(conn, sweep_now()?)?;
        return Ok(rows);
    }
    if let Some(run) = &keys.delivery {
        rows.delivery = delivery(conn, run)?;
    }
    if let Some(batch) = keys.due_deliveries {
        rows.due_deliveries = due_deliveries(conn, sweep_now()?, batch)?;
        return Ok(rows);
    }
    if keys.sweep {
        // An outage first: its grace replaces the sweep (see `core::grace`).
        let now = sweep_now()?;
        rows.alive_at = alive_at(conn)?;
        match crate::core::absence(rows.alive_at, now, timings) {
            Some(absent_ms) => rows.grace = Some(grace(conn, absent_ms)?),
            None => rows.lapsed = lapsed(conn, now)?,
        }
    }
    Ok(rows)
}
