//! Outage grace: the authority's own absence never lapses a lease or a session.
//!
//! Every sweep, on every replica, records when it ran (`Write::Alive`). When a sweep finds
//! that no replica has swept for longer than [`Timings::outage_after_ms`], nobody was
//! serving: no agent could renew or heartbeat, however healthy its jobs. Before anything is
//! swept, that sweep gives the time back — the way Nomad resets its heartbeat timers after
//! a leader election. Every live lease gets its absence added to its expiry, and at least
//! its full TTL from now, so an agent that was waiting out its backoff still has a whole
//! lease to come back in; every live session the same with the session TTL; every open
//! offer its absence. A job's deadline is not moved: the job ran on meanwhile.
//!
//! One replica restarting while another serves gives no grace (the other one's sweeps
//! kept the record fresh); the record is read under a lock in the sweep's transaction, so
//! two replicas starting together give the grace once.

use ql_wire::ids::AttemptId;

use super::{Decision, Reply, Timings, Write};
use crate::model::{Attempt, Lease, LeaseState, Millis, Offer, OfferState, Session, SessionState};

/// The live rows an outage's grace extends (loaded only when [`absence`] says so).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grace {
    /// How long no replica swept.
    pub absent_ms: Millis,
    /// Online and draining sessions.
    pub sessions: Vec<Session>,
    /// Leased leases with their attempts (which carry the lease's expiry too).
    pub leases: Vec<(Lease, Attempt)>,
    /// Open offers.
    pub offers: Vec<Offer>,
}

/// What a grace gave back, for the operator's log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Graced {
    /// How long no replica swept.
    pub absent_ms: Millis,
    /// Leases extended.
    pub leases: usize,
    /// Sessions extended.
    pub sessions: usize,
    /// Offers extended.
    pub offers: usize,
}

/// How long the authority was absent, if it was: the time since any replica last swept
/// (`alive_at`), when that is longer than `outage_after_ms`. A database no replica ever
/// swept has no absence to give back.
pub fn absence(alive_at: Option<Millis>, now: Millis, timings: &Timings) -> Option<Millis> {
    let gap = now.saturating_sub(alive_at?);
    (gap > i64::try_from(timings.outage_after_ms).unwrap_or(i64::MAX)).then_some(gap)
}

/// Gives an absence back to the live rows of `grace` (see the module doc) and records
/// the authority alive at `now`. Rows no longer live are left alone.
pub(super) fn give_back(grace: &Grace, now: Millis, timings: &Timings) -> Decision {
    let gap = grace.absent_ms.max(0);
    let mut writes = Vec::new();
    let live_sessions =
        grace.sessions.iter().filter(|s| matches!(s.state, SessionState::Online | SessionState::Draining));
    let mut sessions = 0;
    for s in live_sessions {
        let expires_at = (s.expires_at + gap).max(now + ms(timings.session_ttl_ms));
        writes.push(Write::Session(Session { expires_at, ..s.clone() }));
        sessions += 1;
    }
    let mut leases = 0;
    for (lease, attempt) in grace.leases.iter().filter(|(l, a)| l.state == LeaseState::Leased && holds(a, &l.attempt)) {
        let expires_at = (lease.facts.expires_at + gap).max(now + ms(lease.ttl_ms));
        let facts = crate::model::LeaseFacts { expires_at, ..lease.facts.clone() };
        writes.push(Write::Lease(Lease { facts: facts.clone(), ..lease.clone() }));
        writes.push(Write::Attempt(Attempt { lease: Some(facts), ..attempt.clone() }));
        leases += 1;
    }
    let mut offers = 0;
    for o in grace.offers.iter().filter(|o| o.state == OfferState::Open) {
        writes.push(Write::Offer(Offer { expires_at: o.expires_at + gap, ..o.clone() }));
        offers += 1;
    }
    writes.push(Write::Alive(now));
    let graced = Graced { absent_ms: gap, leases, sessions, offers };
    Decision::apply(Reply::Graced(graced), writes)
}

/// Whether `attempt` is the one `lease` belongs to and still carries its projection.
fn holds(attempt: &Attempt, lease_attempt: &AttemptId) -> bool {
    &attempt.id == lease_attempt && attempt.lease.is_some()
}

fn ms(n: u64) -> Millis {
    i64::try_from(n).unwrap_or(i64::MAX / 4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::model::AttemptStatus;

    fn timings_with_outage(outage_after_ms: u64) -> Timings {
        Timings { outage_after_ms, ..timings() }
    }

    #[test]
    fn an_absence_is_only_a_gap_longer_than_the_outage_threshold() {
        let t = timings_with_outage(5_000);
        assert_eq!(absence(None, NOW, &t), None, "never swept: nothing to give back");
        assert_eq!(absence(Some(NOW - 5_000), NOW, &t), None);
        assert_eq!(absence(Some(NOW - 5_001), NOW, &t), Some(5_001));
        assert_eq!(absence(Some(NOW + 3), NOW, &t), None, "a record from the future is no absence");
    }

    #[test]
    fn live_leases_and_sessions_get_the_absence_back_and_at_least_a_whole_ttl() {
        let t = timings_with_outage(5_000);
        let w = world(AttemptStatus::Running);
        let (lease, attempt) = (w.lease.clone().unwrap(), w.attempt.clone().unwrap());
        let soon = Lease {
            facts: crate::model::LeaseFacts { expires_at: NOW - 40_000 + 1_000, ..lease.facts.clone() },
            ..lease.clone()
        };
        let attempt = Attempt { lease: Some(soon.facts.clone()), ..attempt };
        let session = Session { expires_at: NOW - 40_000 + 30_000, ..session(1) };
        let offer = Offer { expires_at: NOW - 40_000 + 2_000, ..w.offer.clone().unwrap() };
        let open_offer = Offer { state: OfferState::Open, ..offer };
        let grace = Grace {
            absent_ms: 40_000,
            sessions: vec![session.clone()],
            leases: vec![(soon.clone(), attempt.clone())],
            offers: vec![open_offer.clone()],
        };
        let d = give_back(&grace, NOW, &t);
        let Ok(Reply::Graced(g)) = d.reply else { panic!("{d:?}") };
        assert_eq!((g.absent_ms, g.leases, g.sessions, g.offers), (40_000, 1, 1, 1));
        let lease_expiry = NOW + soon.ttl_ms as i64;
        for write in &d.writes {
            match write {
                // 1 s was left: the gap gives it back, the TTL floor makes it a whole lease.
                Write::Lease(l) => assert_eq!(l.facts.expires_at, lease_expiry),
                Write::Attempt(a) => assert_eq!(a.lease.as_ref().unwrap().expires_at, lease_expiry, "the projection"),
                // 30 s were left, more than the session TTL: the gap gives all of it back.
                Write::Session(s) => assert_eq!(s.expires_at, NOW + 30_000),
                Write::Offer(o) => assert_eq!(o.expires_at, NOW + 2_000),
                Write::Alive(at) => assert_eq!(*at, NOW),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(matches!(d.writes.last(), Some(Write::Alive(_))));
    }

    #[test]
    fn rows_no_longer_live_are_left_alone() {
        let t = timings_with_outage(5_000);
        let w = world(AttemptStatus::Running);
        let ended = Lease { state: LeaseState::Completed, ..w.lease.clone().unwrap() };
        let grace = Grace {
            absent_ms: 40_000,
            sessions: vec![Session { state: SessionState::Replaced, ..session(1) }],
            leases: vec![(ended, w.attempt.clone().unwrap())],
            offers: vec![Offer { state: OfferState::Claimed, ..w.offer.clone().unwrap() }],
        };
        let d = give_back(&grace, NOW, &t);
        assert_eq!(d.writes, vec![Write::Alive(NOW)]);
    }
}
