//! The SQLite side of the shared row mapping ([`crate::store::records`]): `rusqlite`'s
//! row read as [`Columns`], a [`Value`] as a parameter, and each table's write
//! statement, prepared once per connection (`prepare_cached`) and built once per process;
//! or, for a row the command loaded, an `UPDATE` of the columns its decision changed.
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

/// Writes `row` over `known`, the same row as the database holds it now: an `UPDATE` of
/// only the columns that differ, or nothing when none does. SQLite maintains an index,
/// and checks a `CHECK`, only for the columns an `UPDATE` sets; the upsert sets them all,
/// which made a renewal rewrite every index of its attempt.
pub(super) fn update_changed<T: Stored>(conn: &Connection, row: &T, known: &T) -> rusqlite::Result<()> {
    let conversion = |e| rusqlite::Error::ToSqlConversionFailure(Box::new(e));
    let (new, old) = (row.values().map_err(conversion)?, known.values().map_err(conversion)?);
    let table = T::TABLE;
    let key = table.key.expect("only keyed tables are updated in place");
    let names = &NAMES[table.name];
    let at = names.iter().position(|n| *n == key).expect("the key is a column");
    if new[at] != old[at] {
        return write(conn, row);
    }
    let changed: Vec<usize> = (0..new.len()).filter(|&i| new[i] != old[i]).collect();
    if changed.is_empty() {
        return Ok(());
    }
    let sets: Vec<String> = changed.iter().enumerate().map(|(n, &i)| format!("{} = ?{}", names[i], n + 1)).collect();
    let sql = format!("UPDATE {} SET {} WHERE {key} = ?{}", table.name, sets.join(", "), changed.len() + 1);
    let params = changed.iter().map(|&i| &new[i]).chain([&new[at]]);
    match conn.prepare_cached(&sql)?.execute(rusqlite::params_from_iter(params))? {
        1 => Ok(()),
        // The row was loaded in this transaction and nothing deletes: a lost write.
        n => Err(rusqlite::Error::StatementChangedRows(n)),
    }
}
