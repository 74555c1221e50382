//! A decision's writes as one statement.
//!
//! Every write becomes a data-modifying CTE of a single `WITH ... SELECT`, the request's
//! audit record the first of them; the final `SELECT` reports how many rows each `UPDATE`
//! of a loaded row found and sends the wake-up's `NOTIFY`. One statement instead of one
//! per row: the server parses, plans and answers once, and the pipeline that carries it
//! and `COMMIT` is two messages long whatever the decision wrote.
//!
//! All CTEs of one statement see the same snapshot and run in no promised order, which
//! shapes the plan:
//! - a row is written at most once: a decision that writes a row twice keeps only its
//!   last write, as an `UPDATE` of the columns that differ from the row as loaded (or, for
//!   a row the command did not load, an upsert); what the database holds at COMMIT is the
//!   same as if every write had run in turn;
//! - events, whose `seq` is their append order, are appended by one multi-row `INSERT`
//!   in the order the decision made them;
//! - foreign keys are checked at COMMIT (they are deferred) and no unique key moves from
//!   one row to another within a decision, so the order of the other writes is free.

use std::borrow::Cow;
use std::collections::HashMap;

use tokio_postgres::types::ToSql;

use super::{refs, rows, Error, ALIVE, AUDIT_SQL};
use crate::core::{Rows, Write};
use crate::store::loaded::{Known, Loaded};
use crate::store::records::{
    ATTEMPTS, CERTIFICATES, DELIVERIES, ENROLMENTS, EVENTS, FIRES, LEASES, LOG_CHUNKS, OFFERS, OPERATORS, RUNS,
    SCHEDULES, SESSIONS, WORKERS,
};

/// One write's statement and parameters, and whether it is an UPDATE that must report
/// its row.
pub(super) struct Planned {
    sql: Cow<'static, str>,
    params: rows::Params,
    update: bool,
}

/// The row a write replaces, by table and key; `None` for history, which is appended.
fn identity(write: &Write) -> Option<(&'static str, String)> {
    let (table, key) = match write {
        Write::Session(x) => ("sessions", x.id.to_string()),
        Write::Run(x) => ("runs", x.id.to_string()),
        Write::Attempt(x) => ("attempts", x.id.to_string()),
        Write::Offer(x) => ("offers", x.id.to_string()),
        Write::Lease(x) => ("leases", x.attempt.to_string()),
        Write::Worker(x) => ("workers", x.id.to_string()),
        Write::Certificate(x) => ("certificates", x.serial.clone()),
        Write::Enrolment(x) => ("enrolments", x.token_digest.to_string()),
        Write::Schedule(x) => ("schedules", x.name.clone()),
        Write::RemoveSchedule(name) => ("schedules", name.clone()),
        Write::Operator(x) => ("operators", x.name.clone()),
        Write::RemoveOperator(name) => ("operators", name.clone()),
        Write::Delivery(x) => ("deliveries", x.run.to_string()),
        Write::Alive(_) => ("authority", String::new()),
        Write::Event(_) | Write::LogChunk(_) | Write::Fire(_) => return None,
    };
    Some((table, key))
}

/// The statements of a decision's writes (see the module doc). A row the command loaded
/// exists and is locked in this transaction: it is updated in the columns that changed
/// (nothing is sent for a row written as it was); a new one is upserted, history
/// inserted.
pub(super) fn plan(loaded_rows: &Rows, writes: &[Write]) -> Result<Vec<Planned>, Error> {
    let mut last = HashMap::new();
    for (i, write) in writes.iter().enumerate() {
        if let Some(id) = identity(write) {
            last.insert(id, i);
        }
    }
    let loaded = Loaded::of(loaded_rows);
    let mut planned = Vec::with_capacity(writes.len());
    let mut events: Option<(usize, rows::Params, usize)> = None;
    for (i, write) in writes.iter().enumerate() {
        if identity(write).is_some_and(|id| last[&id] != i) {
            continue; // a later write of the same row replaces it
        }
        if let Write::Event(e) = write {
            let (_, params, n) = events.get_or_insert_with(|| (planned.len(), Vec::new(), 0));
            params.extend(rows::params(e)?);
            *n += 1;
            continue;
        }
        let (sql, params, update) = match loaded.known(write) {
            None => (write_sql(write).into(), write_params(write)?, false),
            Some(known) => {
                let changed = match known {
                    Known::Session(new, old) => rows::update_changed(new, old)?,
                    Known::Run(new, old) => rows::update_changed(new, old)?,
                    Known::Attempt(new, old) => rows::update_changed(new, old)?,
                    Known::Offer(new, old) => rows::update_changed(new, old)?,
                    Known::Lease(new, old) => rows::update_changed(new, old)?,
                };
                // Written as it was: nothing to send.
                let Some((sql, params)) = changed else { continue };
                (sql.into(), params, true)
            }
        };
        planned.push(Planned { sql, params, update });
    }
    if let Some((at, params, n)) = events {
        planned.insert(at, Planned { sql: rows::insert_many(&EVENTS, n).into(), params, update: false });
    }
    Ok(planned)
}

/// The statement that writes a row the command did not load: an upsert, for history an
/// insert.
fn write_sql(write: &Write) -> &'static str {
    let table = match write {
        Write::Session(_) => &SESSIONS,
        Write::Run(_) => &RUNS,
        Write::Attempt(_) => &ATTEMPTS,
        Write::Offer(_) => &OFFERS,
        Write::Lease(_) => &LEASES,
        // History is only ever appended.
        Write::Event(_) => &EVENTS,
        Write::LogChunk(_) => &LOG_CHUNKS,
        Write::Worker(_) => &WORKERS,
        Write::Certificate(_) => &CERTIFICATES,
        Write::Enrolment(_) => &ENROLMENTS,
        Write::Schedule(_) => &SCHEDULES,
        Write::Fire(_) => &FIRES,
        Write::RemoveSchedule(_) => return "DELETE FROM schedules WHERE name = $1",
        Write::Operator(_) => &OPERATORS,
        Write::Delivery(_) => &DELIVERIES,
        Write::RemoveOperator(_) => return "DELETE FROM operators WHERE name = $1",
        Write::Alive(_) => return ALIVE,
    };
    rows::upsert(table)
}

/// Its parameters.
fn write_params(write: &Write) -> Result<rows::Params, Error> {
    match write {
        Write::Session(s) => rows::params(s),
        Write::Run(r) => rows::params(r),
        Write::Attempt(a) => rows::params(a),
        Write::Offer(o) => rows::params(o),
        Write::Lease(l) => rows::params(l),
        Write::Event(e) => rows::params(e),
        Write::LogChunk(c) => rows::params(c),
        Write::Worker(w) => rows::params(w),
        Write::Certificate(c) => rows::params(c),
        Write::Enrolment(e) => rows::params(e),
        Write::Schedule(x) => rows::params(x),
        Write::Fire(f) => rows::params(f),
        Write::RemoveSchedule(name) | Write::RemoveOperator(name) => Ok(vec![Box::new(name.clone())]),
        Write::Operator(o) => rows::params(o),
        Write::Delivery(d) => rows::params(d),
        Write::Alive(at) => Ok(vec![Box::new(*at)]),
    }
}

/// The one statement that writes a command's audit record and its planned writes and
/// sends its notification, with its parameters (see the module doc).
pub(super) struct Combined<'p> {
    pub(super) sql: String,
    pub(super) params: Vec<&'p (dyn ToSql + Sync)>,
    /// How many `UPDATE`s report their row count, the answer's first columns.
    updates: usize,
}

impl<'p> Combined<'p> {
    /// `audit`: the parameters of [`AUDIT_SQL`]; `notify`: those of `pg_notify`.
    /// `None` when there is nothing to write.
    pub(super) fn of(
        audit: Option<Vec<&'p (dyn ToSql + Sync)>>,
        planned: &'p [Planned],
        notify: Option<[&'p (dyn ToSql + Sync); 2]>,
    ) -> Option<Self> {
        if audit.is_none() && planned.is_empty() && notify.is_none() {
            return None;
        }
        let mut ctes = Vec::with_capacity(planned.len() + 1);
        let mut params = Vec::new();
        let mut select = Vec::new();
        if let Some(p) = audit {
            ctes.push(format!("a AS ({})", renumber(AUDIT_SQL, params.len())));
            params.extend(p);
        }
        for (i, w) in planned.iter().enumerate() {
            ctes.push(format!("w{i} AS ({})", renumber(&w.sql, params.len())));
            params.extend(refs(&w.params));
            if w.update {
                select.push(format!("(SELECT count(*) FROM w{i})"));
            }
        }
        let updates = select.len();
        if let Some(p) = notify {
            select.push(format!("pg_notify(${}, ${})", params.len() + 1, params.len() + 2));
            params.extend(p);
        }
        if select.is_empty() {
            select.push("1".to_owned());
        }
        let sql = match ctes.is_empty() {
            true => format!("SELECT {}", select.join(", ")),
            false => format!("WITH {} SELECT {}", ctes.join(", "), select.join(", ")),
        };
        Some(Self { sql, params, updates })
    }

    /// Whether every `UPDATE` found its row, from the statement's answer.
    pub(super) fn found_every_row(&self, answer: &[tokio_postgres::Row]) -> bool {
        let Some(row) = answer.first() else { return self.updates == 0 };
        (0..self.updates).all(|i| row.get::<_, i64>(i) == 1)
    }
}

/// `sql` with each placeholder `$n` moved to `$(n + by)`.
fn renumber(sql: &str, by: usize) -> Cow<'_, str> {
    if by == 0 {
        return Cow::Borrowed(sql);
    }
    let mut out = String::with_capacity(sql.len() + 16);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        match rest[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + by).to_string()),
            Err(_) => out.push_str(&rest[..digits]),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_move_by_the_parameters_before_them() {
        assert_eq!(
            renumber("UPDATE t SET a = $2, b = $3::text::jsonb WHERE id = $1", 0),
            "UPDATE t SET a = $2, b = $3::text::jsonb WHERE id = $1"
        );
        assert_eq!(
            renumber("UPDATE t SET a = $2, b = $10::text::jsonb WHERE id = $1", 4),
            "UPDATE t SET a = $6, b = $14::text::jsonb WHERE id = $5"
        );
        assert_eq!(renumber("SELECT '$' || $1", 2), "SELECT '$' || $3");
    }
}
