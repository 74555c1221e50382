//! The PostgreSQL side of the shared row mapping ([`crate::store::records`]):
//! `tokio_postgres`'s row read as [`Columns`] (in select-list order), a [`Value`] as a
//! parameter, and each table's select list and upsert, or for a row the command loaded,
//! an update of the columns its decision changed.
//!
//! What differs from SQLite: labels are JSONB, so they are selected as `labels::text`
//! and sent as text cast to JSONB (no serde feature of the driver is needed); the other
//! JSON columns are TEXT kept byte for byte. Integers are BIGINT, read and sent as
//! `i64`, and placeholders are `$n`. Corrupt values become [`Error::Corrupt`].

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::LazyLock;

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::Error;
use crate::store::columns::{Columns, Corrupt, Table, Value};
use crate::store::records::{Stored, ATTEMPTS, LEASES, OFFERS, RUNS, SCHEDULES, SESSIONS, TABLES, WORKERS};

/// Reads a row selected with its table's select list.
pub(super) fn read<T: Stored>(row: &Row) -> Result<T, Error> {
    T::read(&InOrder { row, next: Cell::new(0) })
}

/// A row whose columns are looked up from where the last one was found. A model reads
/// its select list in order, so each column is found at the first name compared;
/// `Row`'s own lookup compares names from the first column every time, and a load's
/// rows, up to 33 columns each, spent a few percent of the server's CPU on it.
struct InOrder<'a> {
    row: &'a Row,
    next: Cell<usize>,
}

impl InOrder<'_> {
    fn index(&self, col: &str) -> Result<usize, Error> {
        let columns = self.row.columns();
        let n = columns.len();
        let from = self.next.get();
        let i = (from..n).chain(0..from.min(n)).find(|&i| columns[i].name() == col);
        let i = i.ok_or_else(|| Error::Corrupt(format!("no column {col} in the row")))?;
        self.next.set(i + 1);
        Ok(i)
    }

    fn get<'r, T: tokio_postgres::types::FromSql<'r>>(&'r self, col: &str) -> Result<T, Error> {
        self.row.try_get(self.index(col)?).map_err(Error::Pg)
    }
}

impl Columns for InOrder<'_> {
    type Error = Error;

    fn text(&self, col: &str) -> Result<String, Error> {
        self.get(col)
    }

    fn opt_text(&self, col: &str) -> Result<Option<String>, Error> {
        self.get(col)
    }

    fn int(&self, col: &str) -> Result<i64, Error> {
        self.get(col)
    }

    fn opt_int(&self, col: &str) -> Result<Option<i64>, Error> {
        self.get(col)
    }

    fn corrupt(&self, err: Corrupt) -> Error {
        Error::Corrupt(err.to_string())
    }
}

/// Parameters of one statement, boxed so one vector holds every column's type.
pub(super) type Params = Vec<Box<dyn ToSql + Sync + Send>>;

/// The parameters of a write, in column order.
pub(super) fn params<T: Stored>(row: &T) -> Result<Params, Error> {
    let values = row.values().map_err(|e| Error::Corrupt(e.to_string()))?;
    Ok(values.into_iter().map(param).collect())
}

fn param(v: Value) -> Box<dyn ToSql + Sync + Send> {
    match v {
        Value::Text(t) => Box::new(t),
        Value::Int(n) => Box::new(n),
    }
}

/// Columns sent as text and stored as JSONB.
const JSONB: &[&str] = &["labels", "agent_labels"];

/// The placeholder of the `i`th parameter: JSONB columns take their text cast.
fn placeholder(i: usize, col: &str) -> String {
    if JSONB.contains(&col) {
        format!("${i}::text::jsonb")
    } else {
        format!("${i}")
    }
}

/// The select list of a table: JSONB columns come back as text (see the module doc).
fn select_list(table: &Table) -> String {
    let list: Vec<String> =
        table.names().map(|c| if JSONB.contains(&c) { format!("{c}::text AS {c}") } else { c.to_owned() }).collect();
    list.join(", ")
}

/// An `UPDATE` of `row` over `known`, the same row as the command loaded it under a lock
/// in this transaction: `SET` of only the columns that differ (the key is every table's
/// first column, `$1`), `RETURNING 1` so the store can prove the row was there; `None`
/// when no column differs. A renewal then sends its lease's times, not the whole attempt,
/// and a run's labels are not parsed into JSONB again when they did not change.
pub(super) fn update_changed<T: Stored>(row: &T, known: &T) -> Result<Option<(String, Params)>, Error> {
    let values = |r: &T| r.values().map_err(|e| Error::Corrupt(e.to_string()));
    let (new, old) = (values(row)?, values(known)?);
    let table = T::TABLE;
    let names: Vec<&str> = table.names().collect();
    let key = table.key.filter(|k| *k == names[0]).expect("a keyed table, its key the first column");
    let changed: Vec<usize> = (1..new.len()).filter(|&i| new[i] != old[i]).collect();
    if changed.is_empty() {
        return Ok(None);
    }
    let sets: Vec<String> =
        changed.iter().enumerate().map(|(n, &i)| format!("{} = {}", names[i], placeholder(n + 2, names[i]))).collect();
    let sql = format!("UPDATE {} SET {} WHERE {key} = $1 RETURNING 1", table.name, sets.join(", "));
    let mut new: Vec<Option<Value>> = new.into_iter().map(Some).collect();
    let params = std::iter::once(0).chain(changed).map(|i| param(new[i].take().expect("each column once")));
    Ok(Some((sql, params.collect())))
}

/// Each table's upsert (for history, its insert), by table name.
static WRITE: LazyLock<HashMap<&str, String>> =
    LazyLock::new(|| TABLES.iter().map(|t| (t.name, t.write_sql(placeholder))).collect());

/// The statement that writes a new row of `table`: an upsert, or for history an insert.
pub(super) fn upsert(table: &Table) -> &'static str {
    &WRITE[table.name]
}

/// The select list of `sessions`.
pub(super) static SESSION_COLS: LazyLock<String> = LazyLock::new(|| select_list(&SESSIONS));
/// The select list of `runs`.
pub(super) static RUN_COLS: LazyLock<String> = LazyLock::new(|| select_list(&RUNS));
/// The select list of `attempts`.
pub(super) static ATTEMPT_COLS: LazyLock<String> = LazyLock::new(|| select_list(&ATTEMPTS));
/// The select list of `offers`.
pub(super) static OFFER_COLS: LazyLock<String> = LazyLock::new(|| select_list(&OFFERS));
/// The select list of `leases`.
pub(super) static LEASE_COLS: LazyLock<String> = LazyLock::new(|| select_list(&LEASES));
/// The select list of `schedules`.
pub(super) static SCHEDULE_COLS: LazyLock<String> = LazyLock::new(|| select_list(&SCHEDULES));
/// The select list of `workers`.
pub(super) static WORKER_COLS: LazyLock<String> = LazyLock::new(|| select_list(&WORKERS));

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use ql_wire::ids::{Counter, SessionId, WorkerId};

    use super::*;
    use crate::model::{Session, SessionState};

    fn session() -> Session {
        Session {
            id: SessionId::parse("ses_1").unwrap(),
            worker: WorkerId::parse("router-1").unwrap(),
            generation: Counter::new(1).unwrap(),
            state: SessionState::Online,
            capacity: 2,
            labels: BTreeMap::from([("arch".to_owned(), "mipsel".to_owned())]),
            agent_version: "0.1.0".into(),
            arch: "mipsel".into(),
            created_at: 1_000,
            seen_at: 2_000,
            expires_at: 3_000,
            offered: false,
        }
    }

    #[test]
    fn a_loaded_row_is_updated_in_the_columns_that_changed() {
        let known = session();
        let seen = Session { seen_at: 2_500, expires_at: 3_500, ..known.clone() };
        let (sql, params) = update_changed(&seen, &known).unwrap().unwrap();
        assert_eq!(sql, "UPDATE sessions SET seen_at = $2, expires_at = $3 WHERE id = $1 RETURNING 1");
        assert_eq!(params.len(), 3, "the key, then each changed column");
        // JSONB columns keep their cast when they change.
        let relabelled = Session { labels: BTreeMap::new(), ..known.clone() };
        let (sql, _) = update_changed(&relabelled, &known).unwrap().unwrap();
        assert_eq!(sql, "UPDATE sessions SET labels = $2::text::jsonb WHERE id = $1 RETURNING 1");
        assert!(update_changed(&known, &known).unwrap().is_none(), "written as it was: no statement");
    }
}
