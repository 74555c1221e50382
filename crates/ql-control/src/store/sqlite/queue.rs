//! The writer's index of queued runs: what placement looks through on every poll.
//!
//! Finding the runs a session takes meant, per poll, reading every queued run and parsing
//! its label maps in SQL; with many runs queued for other workers (a run per router, say)
//! that scan was most of a poll's cost. The writer owns the only write connection of this
//! process, so it keeps each queued run's labels in memory, in placement order, and
//! matches them with the decision core's own rule ([`Fit::takes`]); the runs that fit are
//! then read by id and checked to be queued still.
//!
//! Runs are also kept by their `agent_labels`: a session declaring a few labels takes a
//! run only if the run's `agent_labels` is one of their subsets
//! ([`Fit::declared_subsets`]), so a poll looks those subsets up and walks only their
//! runs, in placement order, instead of every queued run. When the subsets would
//! outnumber the label sets queued (a session declaring many labels), the poll walks the
//! label sets queued instead, and the runs of those within its labels: a set at a time,
//! as many as the queue holds (as many as its runs only when every run has a set of its
//! own).
//!
//! The index follows every run the writer writes ([`Queue::note`]). A job whose savepoint
//! rolls back after it noted a run, or a failed batch, drops the index; so does a commit
//! by another process (`PRAGMA data_version` is read before each use: the CLI submits
//! into the same file). A dropped index is read again, whole, at its next use.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rusqlite::Connection;

use ql_wire::ids::RunId;

use crate::core::{Fit, Want, SUBSET_LABELS};
use crate::model::{Millis, Run, RunStatus};

use super::load;

/// A queued run's key: placement's order (submitted at, then id).
type Key = (Millis, RunId);

/// The queued runs, in placement order and by their `agent_labels`.
#[derive(Default)]
struct Index {
    runs: BTreeMap<Key, Want>,
    by_agent_labels: HashMap<BTreeMap<String, String>, BTreeSet<Key>>,
}

impl Index {
    fn insert(&mut self, key: Key, want: Want) {
        self.remove(&key);
        self.by_agent_labels.entry(want.agent_labels.clone()).or_default().insert(key.clone());
        self.runs.insert(key, want);
    }

    fn remove(&mut self, key: &Key) {
        let Some(want) = self.runs.remove(key) else { return };
        if let Some(keys) = self.by_agent_labels.get_mut(&want.agent_labels) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_agent_labels.remove(&want.agent_labels);
            }
        }
    }

    /// The oldest `limit` runs `fit` takes.
    fn fitting(&self, fit: &Fit, limit: usize) -> Vec<RunId> {
        if self.runs.is_empty() {
            return Vec::new(); // an idle fleet's polls: no subsets to make
        }
        // The label sets to walk: the queued ones among the declared labels' subsets, or,
        // when the subsets outnumber the sets queued (a session declaring many labels),
        // the queued sets within the declared labels.
        let few_subsets = fit.declared.len() <= SUBSET_LABELS && 1 << fit.declared.len() <= self.by_agent_labels.len();
        let sets: Vec<&BTreeSet<Key>> = if few_subsets {
            let subsets = fit.declared_subsets().unwrap_or_default();
            subsets.iter().filter_map(|subset| self.by_agent_labels.get(subset)).collect()
        } else {
            self.by_agent_labels.iter().filter(|(set, _)| fit.declares(set)).map(|(_, keys)| keys).collect()
        };
        let mut found: Vec<&Key> =
            sets.into_iter().flat_map(|keys| keys.iter().filter(|k| fit.takes(&self.runs[*k])).take(limit)).collect();
        found.sort();
        found.into_iter().take(limit).map(|(_, id)| id.clone()).collect()
    }
}

/// The writer's index of queued runs.
#[derive(Default)]
pub(super) struct Queue {
    /// The index, when it is known to be current.
    runs: Option<Index>,
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

    /// The oldest queued runs (at most `limit`, the poll's room) a session with `fit`
    /// takes: only those rows are read.
    pub(super) fn fitting(&mut self, conn: &Connection, fit: &Fit, limit: usize) -> rusqlite::Result<Vec<Run>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let version: i64 = conn.prepare_cached("PRAGMA data_version")?.query_row([], |r| r.get(0))?;
        if self.version != Some(version) {
            self.runs = None;
            self.version = Some(version);
        }
        // The index is a guide; the row is the truth. Should a run the index holds be no
        // longer queued, the index is read again from the table, once.
        let (runs, current) = self.candidates(conn, fit, limit)?;
        if current {
            return Ok(runs);
        }
        self.runs = None;
        Ok(self.candidates(conn, fit, limit)?.0)
    }

    /// The rows of the runs the index gives for `fit`, those still queued, and whether
    /// every one was.
    fn candidates(&mut self, conn: &Connection, fit: &Fit, limit: usize) -> rusqlite::Result<(Vec<Run>, bool)> {
        let index = match &mut self.runs {
            Some(index) => index,
            none => none.insert(read(conn)?),
        };
        let (mut runs, mut current) = (Vec::with_capacity(limit), true);
        for id in index.fitting(fit, limit) {
            match load::run(conn, &id)?.filter(|r| r.status == RunStatus::Queued) {
                Some(run) => runs.push(run),
                None => current = false,
            }
        }
        Ok((runs, current))
    }
}

/// Every queued run's labels, from the table.
fn read(conn: &Connection) -> rusqlite::Result<Index> {
    let mut stmt =
        conn.prepare_cached("SELECT id, created_at, labels, agent_labels FROM runs WHERE status = 'queued'")?;
    let mut rows = stmt.query([])?;
    let mut runs = Index::default();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn lookups_by_label_subsets_find_what_a_scan_finds_in_the_same_order() {
        let mut index = Index::default();
        let agent =
            [map(&[]), map(&[("arch", "mipsel")]), map(&[("arch", "arm")]), map(&[("arch", "mipsel"), ("site", "a")])];
        let trusted = [map(&[]), map(&[("tier", "gold")])];
        for i in 0..48_i64 {
            let want =
                Want { labels: trusted[(i % 5 % 2) as usize].clone(), agent_labels: agent[(i % 4) as usize].clone() };
            // Submitted out of order: the index keeps placement order whatever came first.
            index.insert(((i * 7) % 48, format!("run_{i:02}").parse().unwrap()), want);
        }
        // A run that left the queue, and one noted twice.
        index.remove(&(0, "run_00".parse().unwrap()));
        index.insert((7, "run_01".parse().unwrap()), Want { labels: map(&[]), agent_labels: map(&[("arch", "arm")]) });

        let declared_many =
            map(&[("arch", "mipsel"), ("site", "a"), ("a", "1"), ("b", "2"), ("c", "3"), ("d", "4"), ("e", "5")]);
        // Four label sets are queued: two declared labels look their four subsets up, three
        // or seven walk the queued sets within them.
        let declared_three = map(&[("arch", "mipsel"), ("site", "a"), ("c", "3")]);
        let declared = [map(&[]), map(&[("arch", "mipsel")]), map(&[("arch", "mipsel"), ("site", "a")])];
        for declared in declared.into_iter().chain([declared_three, declared_many]) {
            for trusted in &trusted {
                let fit = Fit { trusted: trusted.clone(), declared: declared.clone() };
                for limit in [1, 3, 100] {
                    let scan: Vec<RunId> = index
                        .runs
                        .iter()
                        .filter(|(_, want)| fit.takes(want))
                        .take(limit)
                        .map(|((_, id), _)| id.clone())
                        .collect();
                    assert_eq!(index.fitting(&fit, limit), scan, "{fit:?}, {limit}");
                }
            }
        }
        assert_eq!(
            index.by_agent_labels.values().map(BTreeSet::len).sum::<usize>(),
            index.runs.len(),
            "one entry per run"
        );
    }
}
