//! An attempt's projection of its lease, as PostgreSQL keeps it: the lease row holds the
//! version and expiry, and every read of an attempt takes them from there.
//!
//! The protocol keeps on each attempt a projection of its lease that always agrees with
//! it (PROTOCOL §3): a renewal advances both. Written as two rows, a renewal updates the
//! attempt's row only for those two columns, a second heap update with its WAL record and
//! index work, in the transaction every ACK of a running job pays for. So on PostgreSQL an
//! attempt's `lease_version` and `lease_expires_at` keep what its claim wrote, no later
//! write of the attempt touches them ([`unwritten`]: a renewal, which changes nothing
//! else of it, writes nothing), and the store completes the projection from the lease
//! whenever it reads the two together: the decisions see the projection the protocol
//! describes.
//!
//! Every read of a claimed attempt that can reach a decision or an answer loads its
//! lease in the same transaction (the fenced loads, a cancel, a worker's work, the sweep,
//! a run's detail, the snapshot; the attempts of open offers, read without one, are not
//! claimed and hold no projection), and a lease row is deleted only with its attempt
//! (an ended run past its retention, `Store::prune_runs`), so the stored
//! columns are never what anyone sees. So the fence's check that the projection agrees
//! with the lease can, here, only catch the other six facts drifting; the SQLite store
//! keeps both copies, and the contract suite checks there that every decision advances
//! the attempt's. Migration 0022 says so on the columns, and moves the schema version so
//! that a replica of an older build, which would read them, refuses the database when it
//! starts: every replica is stopped before `migrate` (README).

use std::collections::HashMap;

use crate::core::Rows;
use crate::model::{Attempt, Lease};

/// Sets `attempt`'s projection of version and expiry from `lease`, if it is its lease
/// and the attempt holds a projection (it has been claimed).
pub(super) fn follow(attempt: &mut Attempt, lease: &Lease) {
    if lease.attempt != attempt.id {
        return;
    }
    if let Some(p) = attempt.lease.as_mut() {
        p.version = lease.facts.version;
        p.expires_at = lease.facts.expires_at;
    }
}

/// Completes every attempt of `rows` loaded with its lease ([`follow`]).
pub(super) fn complete(rows: &mut Rows) {
    if let (Some(attempt), Some(lease)) = (rows.attempt.as_mut(), rows.lease.as_ref()) {
        follow(attempt, lease);
    }
    let pairs = rows.worker_work.leases.iter_mut().chain(rows.lapsed.leases.iter_mut());
    for (lease, _, attempt) in pairs {
        follow(attempt, lease);
    }
    if let Some(grace) = rows.grace.as_mut() {
        for (lease, attempt) in &mut grace.leases {
            follow(attempt, lease);
        }
    }
}

/// Completes each of `attempts` from its lease among `leases`.
pub(super) fn complete_all(attempts: &mut [Attempt], leases: &[Lease]) {
    let by_attempt: HashMap<&str, &Lease> = leases.iter().map(|l| (l.attempt.as_str(), l)).collect();
    for attempt in attempts {
        if let Some(lease) = by_attempt.get(attempt.id.as_str()) {
            follow(attempt, lease);
        }
    }
}

/// `new` as it is written over the stored `old`: with `old`'s version and expiry when
/// both hold a projection, so that a change of those two columns alone writes nothing.
/// The stored columns keep what the attempt's first projection (its claim) wrote.
pub(super) fn unwritten(new: &Attempt, old: &Attempt) -> Attempt {
    let mut out = new.clone();
    if let (Some(n), Some(o)) = (out.lease.as_mut(), old.lease.as_ref()) {
        n.version = o.version;
        n.expires_at = o.expires_at;
    }
    out
}

#[cfg(test)]
mod tests {
    use ql_wire::ids::{AttemptId, Counter};

    use super::*;
    use crate::core::testkit;
    use crate::model::AttemptStatus;

    #[test]
    fn a_loaded_attempt_takes_version_and_expiry_from_its_lease_only() {
        let rows = testkit::world(AttemptStatus::Running);
        let (mut attempt, mut lease) = (rows.attempt.clone().unwrap(), rows.lease.clone().unwrap());
        let stored = attempt.clone();
        lease.facts.version = Counter::new(7).unwrap();
        lease.facts.expires_at += 30_000;
        follow(&mut attempt, &lease);
        assert_eq!(attempt.lease.as_ref(), Some(&lease.facts), "the projection agrees with the lease");
        assert_eq!(Attempt { lease: stored.lease.clone(), ..attempt.clone() }, stored, "nothing else moved");

        // Another attempt's lease, or an attempt not claimed, is left as it is.
        let mut other = Lease { attempt: AttemptId::parse("att_other").unwrap(), ..lease.clone() };
        other.facts.version = Counter::new(9).unwrap();
        let before = attempt.clone();
        follow(&mut attempt, &other);
        assert_eq!(attempt, before);
        let mut unclaimed = Attempt { lease: None, ..stored.clone() };
        follow(&mut unclaimed, &lease);
        assert_eq!(unclaimed.lease, None);
    }

    #[test]
    fn every_pair_of_rows_is_completed() {
        let base = testkit::world(AttemptStatus::Running);
        let (attempt, mut lease) = (base.attempt.clone().unwrap(), base.lease.clone().unwrap());
        let run = base.run.clone().unwrap();
        lease.facts.version = Counter::new(4).unwrap();
        let mut rows = Rows { lease: Some(lease.clone()), ..base };
        rows.worker_work.leases.push((lease.clone(), run.clone(), attempt.clone()));
        rows.lapsed.leases.push((lease.clone(), run, attempt.clone()));
        rows.grace = Some(crate::core::Grace { leases: vec![(lease.clone(), attempt.clone())], ..Default::default() });
        complete(&mut rows);
        let projections = [
            rows.attempt.as_ref(),
            rows.worker_work.leases.first().map(|(_, _, a)| a),
            rows.lapsed.leases.first().map(|(_, _, a)| a),
            rows.grace.as_ref().and_then(|g| g.leases.first()).map(|(_, a)| a),
        ];
        for a in projections {
            assert_eq!(a.and_then(|a| a.lease.as_ref()), Some(&lease.facts));
        }

        let mut attempts = vec![attempt.clone()];
        complete_all(&mut attempts, std::slice::from_ref(&lease));
        assert_eq!(attempts[0].lease.as_ref(), Some(&lease.facts));
    }

    #[test]
    fn a_renewed_projection_alone_writes_nothing_and_a_claim_writes_it_whole() {
        let rows = testkit::world(AttemptStatus::Running);
        let stored = rows.attempt.clone().unwrap();
        let mut renewed = stored.clone();
        let p = renewed.lease.as_mut().unwrap();
        p.version = p.version.next().unwrap();
        p.expires_at += 30_000;
        assert_eq!(unwritten(&renewed, &stored), stored, "only the two columns changed: nothing to write");

        let ended = Attempt { exit_code: Some(0), ..renewed.clone() };
        assert_eq!(unwritten(&ended, &stored), Attempt { exit_code: Some(0), ..stored.clone() });

        let unclaimed = Attempt { lease: None, ..stored.clone() };
        assert_eq!(unwritten(&stored, &unclaimed), stored, "a claim writes the whole projection");
    }
}
