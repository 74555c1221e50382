//! The writer's index of queued runs: what placement looks through on every poll.
//!
//! Finding the runs a session takes meant, per poll, reading every queued run and parsing
//! its label maps in SQL; with many runs queued for other workers (a run per router, say)
//! that scan was most of a poll's cost. The writer owns the only write connection of this
//! process, so it keeps each queued run's labels in memory, in placement order, and
//! matches them with the decision core's own rule ([`Fit::takes`]); the runs that fit are
//! then read by id and checked to be queued still.
//!
//! The index follows every run the writer writes ([`Queue::note`]). A job whose savepoint
//! rolls back after it noted a run, or a failed batch, drops the index; so does a commit
//! by another process (`PRAGMA data_version` is read before each use: the CLI submits
//! into the same file). A dropped index is read again, whole, at its next use.

use std::collections::BTreeMap;

use rusqlite::Connection;

use ql_wire::ids::RunId;

use crate::core::{Fit, Want};
use crate::model::{Millis, Run, RunStatus};

use super::load;

/// Queued runs by (submitted at, id): placement's order.
#[derive(Default)]
pub(super) struct Queue {
    /// The index, when it is known to be current.
    runs: Option<BTreeMap<(Millis, RunId), Want>>,
    /// The connection's `data_version` when the index was last known current.
    version: Option<i64>,
    /// A run was noted since [`Queue::mark`]: a rollback from there must drop the index.
    touched: bool,
}

impl Queue {
    /// Follows a run the writer just wrote (inside the open transaction).
    pub(super) fn note(&mut self, run: &Run) {
        self.touched = true;
        if let Some(runs) = &mut self.runs {
            let key = (run.created_at, run.id.clone());
            if run.status == RunStatus::Queued {
                let want = Want { labels: run.labels.clone(), agent_labels: run.agent_labels.clone() };
                runs.insert(key, want);
            } else {
                runs.remove(&key);
            }
        }
    }

    /// A job begins: what it notes from here is what a rollback would undo.
    pub(super) fn mark(&mut self) {
        self.touched = false;
    }

    /// The job's or the batch's writes were rolled back.
    pub(super) fn rolled_back(&mut self) {
        if self.touched {
            self.runs = None;
        }
    }

    /// The whole batch was given up.
    pub(super) fn drop_all(&mut self) {
        self.runs = None;
    }

    /// The oldest queued runs (at most `limit`) a session with `fit` takes.
    pub(super) fn fitting(&mut self, conn: &Connection, fit: &Fit, limit: usize) -> rusqlite::Result<Vec<Run>> {
        let version: i64 = conn.prepare_cached("PRAGMA data_version")?.query_row([], |r| r.get(0))?;
        if self.version != Some(version) {
            self.runs = None;
            self.version = Some(version);
        }
        if self.runs.is_none() {
            self.runs = Some(read(conn)?);
        }
        let ids: Vec<RunId> = self
            .runs
            .iter()
            .flatten()
            .filter(|(_, want)| fit.takes(want))
            .take(limit)
            .map(|((_, id), _)| id.clone())
            .collect();
        let mut runs = Vec::with_capacity(ids.len());
        for id in ids {
            // The index is a guide; the row is the truth.
            if let Some(run) = load::run(conn, &id)?.filter(|r| r.status == RunStatus::Queued) {
                runs.push(run);
            }
        }
        Ok(runs)
    }
}

/// Every queued run's labels, from the table.
fn read(conn: &Connection) -> rusqlite::Result<BTreeMap<(Millis, RunId), Want>> {
    let mut stmt =
        conn.prepare_cached("SELECT id, created_at, labels, agent_labels FROM runs WHERE status = 'queued'")?;
    let mut rows = stmt.query([])?;
    let mut runs = BTreeMap::new();
    while let Some(row) = rows.next()? {
        let text = |i: usize| row.get::<_, String>(i);
        let labels = |i: usize| {
            serde_json::from_str(&text(i)?)
                .map_err(|e| rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into()))
        };
        let id = RunId::parse(text(0)?.as_str())
            .map_err(|e| rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, e.into()))?;
        runs.insert((row.get(1)?, id), Want { labels: labels(2)?, agent_labels: labels(3)? });
    }
    Ok(runs)
}
