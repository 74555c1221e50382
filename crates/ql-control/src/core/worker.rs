//! What the operator says of a worker identity: the labels it vouches for.
//!
//! An agent declares labels when it opens a session, and anyone holding the worker's
//! certificate can declare anything. Labels the operator sets here are bound to the
//! identity in the authority's database; `submit --label` matches these, and only
//! `submit --agent-label` matches what an agent declares (see [`super::delivery`]).

use std::collections::BTreeMap;

use ql_wire::ids::WorkerId;
use ql_wire::ErrorCode;

use super::operator::check_labels;
use super::{Decision, Reply, Rows, Write};
use crate::model::{Millis, Worker};

/// Sets `worker`'s trusted labels to `labels` (all of them: a label left out is removed),
/// recording the worker if it was not yet.
pub(super) fn set_labels(worker: &WorkerId, labels: &BTreeMap<String, String>, rows: &Rows, now: Millis) -> Decision {
    if check_labels(labels).is_err() {
        return Decision::refuse(ErrorCode::InvalidRequest);
    }
    let existing = rows.worker.as_ref().filter(|w| &w.id == worker);
    let base = existing.cloned().unwrap_or_else(|| Worker::new(worker.clone(), now));
    let updated = Worker { labels: labels.clone(), updated_at: now, ..base };
    if existing.is_some_and(|w| w.labels == *labels) {
        return Decision::apply(Reply::WorkerLabelled(Box::new(updated)), Vec::new());
    }
    // Runs that could not be placed before may fit now.
    Decision::apply(Reply::WorkerLabelled(Box::new(updated.clone())), vec![Write::Worker(updated)]).waking()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Millis = 1_700_000_000_000;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn w1() -> WorkerId {
        WorkerId::parse("router-1").unwrap()
    }

    #[test]
    fn the_first_labels_record_the_worker_and_later_ones_replace_them() {
        let d = set_labels(&w1(), &labels(&[("site", "attic")]), &Rows::default(), NOW);
        let Ok(Reply::WorkerLabelled(first)) = &d.reply else { panic!("{d:?}") };
        assert_eq!((first.created_at, first.updated_at), (NOW, NOW));
        assert_eq!(d.writes, vec![Write::Worker((**first).clone())]);
        assert!(d.wake);

        let rows = Rows { worker: Some((**first).clone()), ..Rows::default() };
        let d = set_labels(&w1(), &labels(&[("tier", "lab")]), &rows, NOW + 5);
        let Ok(Reply::WorkerLabelled(second)) = &d.reply else { panic!("{d:?}") };
        assert_eq!(second.labels, labels(&[("tier", "lab")]), "site is gone");
        assert_eq!((second.created_at, second.updated_at), (NOW, NOW + 5));
    }

    #[test]
    fn the_same_labels_again_write_nothing() {
        let first = Worker { labels: labels(&[("site", "attic")]), ..Worker::new(w1(), NOW) };
        let rows = Rows { worker: Some(first), ..Rows::default() };
        let d = set_labels(&w1(), &labels(&[("site", "attic")]), &rows, NOW + 5);
        assert!(d.reply.is_ok());
        assert!(d.writes.is_empty());
    }

    #[test]
    fn labels_no_run_could_ask_for_are_refused_and_write_nothing() {
        for bad in [labels(&[("Site", "x")]), labels(&[("site", "a\nb")])] {
            assert_eq!(set_labels(&w1(), &bad, &Rows::default(), NOW), Decision::refuse(ErrorCode::InvalidRequest));
        }
    }
}
