//! The vocabulary both stores share for moving a model value in and out of a table row,
//! so that [`super::records`] maps each model type once, not once per database.
//!
//! Both schemas store only two kinds of value: text (ids, statuses, JSON) and 64-bit
//! integers (times, counts, counters) — SQLite's INTEGER, PostgreSQL's BIGINT; neither
//! has a boolean column. So a backend adapts its row type to [`Columns`] (four getters
//! by column name and one way to report a corrupt value), and turns a [`Value`] into its
//! own parameter type. Everything else here — validation through the `ql_wire` types,
//! range checks, JSON, status words — is written once on top of those getters.
//!
//! [`Table`] names a table's columns in the one order every select list and every write
//! uses, and builds the write statement from it; only the placeholder syntax differs
//! between the databases, so each backend passes its own.

use ql_wire::ids::{Counter, Invalid};

/// A stored value its type refuses, or a model value a column cannot hold.
#[derive(Debug)]
pub(super) struct Corrupt {
    /// The column (or, on the write side, the kind of value).
    pub(super) column: String,
    /// What is wrong with it.
    pub(super) why: String,
}

impl Corrupt {
    pub(super) fn new(column: &str, why: impl std::fmt::Display) -> Self {
        Self { column: column.to_owned(), why: why.to_string() }
    }
}

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "column {}: {}", self.column, self.why)
    }
}

impl std::error::Error for Corrupt {}

/// A row read by column name. Backends implement the five required methods; the typed
/// readers re-validate every value, so a row a foreign writer corrupted surfaces as an
/// error, never as an invalid value in memory.
pub(super) trait Columns {
    /// The backend's own error, which its store already turns into a `StoreError`.
    type Error;

    /// A NOT NULL text column.
    fn text(&self, col: &str) -> Result<String, Self::Error>;
    /// A nullable text column.
    fn opt_text(&self, col: &str) -> Result<Option<String>, Self::Error>;
    /// A NOT NULL integer column.
    fn int(&self, col: &str) -> Result<i64, Self::Error>;
    /// A nullable integer column.
    fn opt_int(&self, col: &str) -> Result<Option<i64>, Self::Error>;
    /// The backend's error for a value its model type refuses.
    fn corrupt(&self, err: Corrupt) -> Self::Error;

    /// A `ql_wire` value kept as text (an id, a digest, a handle), validated again.
    fn valid<T: TryFrom<String, Error = Invalid>>(&self, col: &str) -> Result<T, Self::Error> {
        T::try_from(self.text(col)?).map_err(|e| self.corrupt(Corrupt::new(col, e)))
    }

    /// [`Columns::valid`] of a nullable column.
    fn opt_valid<T: TryFrom<String, Error = Invalid>>(&self, col: &str) -> Result<Option<T>, Self::Error> {
        self.opt_text(col)?.map(T::try_from).transpose().map_err(|e| self.corrupt(Corrupt::new(col, e)))
    }

    /// An integer narrowed to its model type (`u32` counts, `u64` durations, `i32` codes).
    fn num<T: TryFrom<i64>>(&self, col: &str) -> Result<T, Self::Error> {
        let n = self.int(col)?;
        T::try_from(n).map_err(|_| self.corrupt(Corrupt::new(col, format!("{n} out of range"))))
    }

    /// [`Columns::num`] of a nullable column.
    fn opt_num<T: TryFrom<i64>>(&self, col: &str) -> Result<Option<T>, Self::Error> {
        self.opt_int(col)?
            .map(|n| T::try_from(n).map_err(|_| self.corrupt(Corrupt::new(col, format!("{n} out of range")))))
            .transpose()
    }

    /// A [`Counter`] (never NULL, never below one).
    fn counter(&self, col: &str) -> Result<Counter, Self::Error> {
        self.opt_counter(col)?.ok_or_else(|| self.corrupt(Corrupt::new(col, "NULL")))
    }

    /// A nullable [`Counter`].
    fn opt_counter(&self, col: &str) -> Result<Option<Counter>, Self::Error> {
        self.opt_int(col)?
            .map(|n| u64::try_from(n).map_err(|_| Invalid::OutOfRange { min: 1, max: u64::MAX }).and_then(Counter::new))
            .transpose()
            .map_err(|e| self.corrupt(Corrupt::new(col, e)))
    }

    /// JSON kept as text.
    fn json<T: serde::de::DeserializeOwned>(&self, col: &str) -> Result<T, Self::Error> {
        serde_json::from_str(&self.text(col)?).map_err(|e| self.corrupt(Corrupt::new(col, e)))
    }

    /// [`Columns::json`] of a nullable column.
    fn opt_json<T: serde::de::DeserializeOwned>(&self, col: &str) -> Result<Option<T>, Self::Error> {
        self.opt_text(col)?
            .map(|s| serde_json::from_str(&s))
            .transpose()
            .map_err(|e| self.corrupt(Corrupt::new(col, e)))
    }

    /// A status word, parsed by its enum's `parse`.
    fn word<T>(&self, col: &str, parse: fn(&str) -> Option<T>) -> Result<T, Self::Error> {
        let s = self.text(col)?;
        parse(&s).ok_or_else(|| self.corrupt(Corrupt::new(col, format!("unknown value {s:?}"))))
    }

    /// [`Columns::word`] of a nullable column.
    fn opt_word<T>(&self, col: &str, parse: fn(&str) -> Option<T>) -> Result<Option<T>, Self::Error> {
        self.opt_text(col)?
            .map(|s| parse(&s).ok_or_else(|| self.corrupt(Corrupt::new(col, format!("unknown value {s:?}")))))
            .transpose()
    }
}

/// One column's value on its way to the database. A NULL keeps its kind because
/// PostgreSQL types every parameter: a text NULL cannot go to a BIGINT column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Value {
    /// A text column's value.
    Text(Option<String>),
    /// An integer column's value.
    Int(Option<i64>),
}

impl Value {
    pub(super) fn text(s: &str) -> Self {
        Self::Text(Some(s.to_owned()))
    }

    pub(super) fn opt_text(s: Option<&str>) -> Self {
        Self::Text(s.map(str::to_owned))
    }

    pub(super) fn int(n: impl Into<i64>) -> Self {
        Self::Int(Some(n.into()))
    }

    pub(super) fn opt_int(n: Option<impl Into<i64>>) -> Self {
        Self::Int(n.map(Into::into))
    }

    /// A `u64` (a counter, a TTL) as a signed 64-bit integer, which both schemas use.
    pub(super) fn big(n: u64) -> Result<Self, Corrupt> {
        Self::opt_big(Some(n))
    }

    pub(super) fn opt_big(n: Option<u64>) -> Result<Self, Corrupt> {
        let wide = |n: u64| {
            i64::try_from(n).map_err(|_| Corrupt::new("integer", format!("{n} does not fit a signed 64-bit integer")))
        };
        Ok(Self::Int(n.map(wide).transpose()?))
    }

    /// A value as JSON text.
    pub(super) fn json<T: serde::Serialize>(value: &T) -> Result<Self, Corrupt> {
        Self::opt_json(Some(value))
    }

    pub(super) fn opt_json<T: serde::Serialize>(value: Option<&T>) -> Result<Self, Corrupt> {
        let text = value.map(serde_json::to_string).transpose().map_err(|e| Corrupt::new("json", e))?;
        Ok(Self::Text(text))
    }
}

/// A table: its name, its key, and its columns in the order of every select list and
/// every write's values.
#[derive(Debug)]
pub(super) struct Table {
    /// The table's name.
    pub(super) name: &'static str,
    /// The key a write upserts on; `None` for history (events, audit), which is only
    /// ever appended (its key is the storage order `seq`, not a model field).
    pub(super) key: Option<&'static str>,
    /// The columns, comma-separated, one per model field (nested lease and claim facts
    /// flattened with a prefix).
    pub(super) cols: &'static str,
}

impl Table {
    /// The column names, in order.
    pub(super) fn names(&self) -> impl Iterator<Item = &'static str> {
        self.cols.split(',').map(str::trim)
    }

    /// `INSERT` of every column, with `ON CONFLICT (key) DO UPDATE SET` of every other
    /// column for keyed tables. An upsert, not `INSERT OR REPLACE`: REPLACE deletes and
    /// re-inserts, which would trip the foreign keys pointing at the row. `placeholder`
    /// gets the 1-based position and the name of a column.
    pub(super) fn write_sql(&self, placeholder: impl Fn(usize, &str) -> String) -> String {
        let names: Vec<&str> = self.names().collect();
        let values: Vec<String> = names.iter().enumerate().map(|(i, c)| placeholder(i + 1, c)).collect();
        let mut sql = format!("INSERT INTO {} ({}) VALUES ({})", self.name, names.join(", "), values.join(", "));
        if let Some(key) = self.key {
            let updates: Vec<String> =
                names.iter().filter(|c| **c != key).map(|c| format!("{c} = excluded.{c}")).collect();
            sql += &format!(" ON CONFLICT ({key}) DO UPDATE SET {}", updates.join(", "));
        }
        sql
    }
}
