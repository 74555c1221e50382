//! The PostgreSQL side of the shared row mapping ([`crate::store::records`]):
//! `tokio_postgres`'s row read as [`Columns`], a [`Value`] as a parameter, and each
//! table's select list, upsert and update.
//!
//! What differs from SQLite: labels are JSONB, so they are selected as `labels::text`
//! and sent as text cast to JSONB (no serde feature of the driver is needed); the other
//! JSON columns are TEXT kept byte for byte. Integers are BIGINT, read and sent as
//! `i64`, and placeholders are `$n`. Corrupt values become [`Error::Corrupt`].

use std::collections::HashMap;
use std::sync::LazyLock;

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::Error;
use crate::store::columns::{Columns, Corrupt, Table, Value};
use crate::store::records::{Stored, ATTEMPTS, LEASES, OFFERS, RUNS, SCHEDULES, SESSIONS, TABLES, WORKERS};

impl Columns for Row {
    type Error = Error;

    fn text(&self, col: &str) -> Result<String, Error> {
        self.try_get(col).map_err(Error::Pg)
    }

    fn opt_text(&self, col: &str) -> Result<Option<String>, Error> {
        self.try_get(col).map_err(Error::Pg)
    }

    fn int(&self, col: &str) -> Result<i64, Error> {
        self.try_get(col).map_err(Error::Pg)
    }

    fn opt_int(&self, col: &str) -> Result<Option<i64>, Error> {
        self.try_get(col).map_err(Error::Pg)
    }

    fn corrupt(&self, err: Corrupt) -> Error {
        Error::Corrupt(err.to_string())
    }
}

/// Reads a row selected with its table's select list.
pub(super) fn read<T: Stored>(row: &Row) -> Result<T, Error> {
    T::read(row)
}

/// Parameters of one statement, boxed so one vector holds every column's type.
pub(super) type Params = Vec<Box<dyn ToSql + Sync + Send>>;

/// The parameters of a write, in column order.
pub(super) fn params<T: Stored>(row: &T) -> Result<Params, Error> {
    let values = row.values().map_err(|e| Error::Corrupt(e.to_string()))?;
    let param = |v| -> Box<dyn ToSql + Sync + Send> {
        match v {
            Value::Text(t) => Box::new(t),
            Value::Int(n) => Box::new(n),
        }
    };
    Ok(values.into_iter().map(param).collect())
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

/// Builds `UPDATE ... SET` of every non-key column `WHERE key = $1 RETURNING 1`, with
/// the parameters in the same order as the upsert's (the key is every table's first
/// column). The store uses it for rows it loaded under a lock in this transaction: a
/// plain update skips the upsert's speculative insertion, and `RETURNING` lets the store
/// prove the row was there.
fn build_update(table: &Table) -> Option<String> {
    let key = table.key?;
    let names: Vec<&str> = table.names().collect();
    assert_eq!(names[0], key, "the key is the first column");
    let sets: Vec<String> =
        names.iter().enumerate().skip(1).map(|(i, c)| format!("{c} = {}", placeholder(i + 1, c))).collect();
    Some(format!("UPDATE {} SET {} WHERE {key} = $1 RETURNING 1", table.name, sets.join(", ")))
}

/// Each table's upsert (for history, its insert), by table name.
static WRITE: LazyLock<HashMap<&str, String>> =
    LazyLock::new(|| TABLES.iter().map(|t| (t.name, t.write_sql(placeholder))).collect());

/// Each keyed table's update (see [`build_update`]), by table name.
static UPDATE: LazyLock<HashMap<&str, String>> =
    LazyLock::new(|| TABLES.iter().filter_map(|t| Some((t.name, build_update(t)?))).collect());

/// The statement that writes a new row of `table`: an upsert, or for history an insert.
pub(super) fn upsert(table: &Table) -> &'static str {
    &WRITE[table.name]
}

/// The statement that updates a row of `table` the command loaded (see [`build_update`]).
pub(super) fn update(table: &Table) -> &'static str {
    &UPDATE[table.name]
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
