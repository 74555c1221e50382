//! The SQLite side of the shared row mapping ([`crate::store::records`]): `rusqlite`'s
//! row read as [`Columns`], a [`Value`] as a parameter, and each table's write
//! statement, prepared once per connection (`prepare_cached`) and built once per process.
//!
//! Corrupt values surface as `rusqlite` conversion errors, which the store already turns
//! into a `StoreError`.

use std::collections::HashMap;
use std::sync::LazyLock;

use rusqlite::types::{ToSqlOutput, Type};
use rusqlite::{Connection, Row, ToSql};

use crate::store::columns::{Columns, Corrupt, Value};
use crate::store::records::{Stored, TABLES};

/// A row selected with its table's column list. A column is found by its place in that
/// list: asking SQLite for every column's name on each read was a measurable share of
/// the writer's time.
struct Listed<'r, 's> {
    row: &'r Row<'s>,
    names: &'static [&'static str],
}

impl Listed<'_, '_> {
    fn index(&self, col: &str) -> rusqlite::Result<usize> {
        match self.names.iter().position(|name| *name == col) {
            Some(idx) => {
                debug_assert_eq!(self.row.as_ref().column_name(idx).ok(), Some(col), "select list out of order");
                Ok(idx)
            }
            None => self.row.as_ref().column_index(col),
        }
    }
}

impl Columns for Listed<'_, '_> {
    type Error = rusqlite::Error;

    fn text(&self, col: &str) -> rusqlite::Result<String> {
        self.row.get(self.index(col)?)
    }

    fn opt_text(&self, col: &str) -> rusqlite::Result<Option<String>> {
        self.row.get(self.index(col)?)
    }

    fn int(&self, col: &str) -> rusqlite::Result<i64> {
        self.row.get(self.index(col)?)
    }

    fn opt_int(&self, col: &str) -> rusqlite::Result<Option<i64>> {
        self.row.get(self.index(col)?)
    }

    fn corrupt(&self, err: Corrupt) -> rusqlite::Error {
        let idx = self.index(&err.column).unwrap_or(0);
        rusqlite::Error::FromSqlConversionFailure(idx, Type::Text, Box::new(err))
    }
}

impl ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        match self {
            Value::Text(v) => v.to_sql(),
            Value::Int(v) => v.to_sql(),
        }
    }
}

/// Reads a row selected with its table's column list. A plain function, so it passes
/// where `rusqlite` wants a `fn(&Row<'_>) -> Result<T>` for any row lifetime.
pub(super) fn read<T: Stored>(row: &Row<'_>) -> rusqlite::Result<T> {
    T::read(&Listed { row, names: &NAMES[T::TABLE.name] })
}

/// Each table's column names, in the order of its select list.
static NAMES: LazyLock<HashMap<&str, Vec<&'static str>>> =
    LazyLock::new(|| TABLES.iter().map(|t| (t.name, t.names().collect())).collect());

/// Each table's write statement, by table name: an upsert, or for history an insert.
static WRITE: LazyLock<HashMap<&str, String>> =
    LazyLock::new(|| TABLES.iter().map(|t| (t.name, t.write_sql(|i, _| format!("?{i}")))).collect());

/// Writes a row: upserts it, or appends it to history (events, audit).
pub(super) fn write<T: Stored>(conn: &Connection, row: &T) -> rusqlite::Result<()> {
    let values = row.values().map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
    conn.prepare_cached(&WRITE[T::TABLE.name])?.execute(rusqlite::params_from_iter(values))?;
    Ok(())
}
