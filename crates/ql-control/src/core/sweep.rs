//! The sweeper's decisions (PROTOCOL §11): expire what lapsed by DB time. Idempotent: a
//! second sweep over the same rows finds nothing lapsed, and any replica may run it.

use serde_json::json;
use std::collections::HashSet;

use ql_wire::lease::StopIntent;

use super::start::{run_transition, transition, EXECUTION_CANCELLED, EXECUTION_TIMED_OUT};
use super::{event, Decision, IdGen, Lapsed, Reply, Write};
use crate::model::{
    Attempt, AttemptStatus, EndKind, Lease, LeaseState, Millis, Offer, OfferState, Run, RunStatus, Session,
    SessionState,
};

/// Error code of a run that lost its lease beyond its retry budget.
pub const LEASE_LOST: &str = "LEASE_LOST";
/// Error code of an attempt whose offer lapsed unclaimed.
pub const OFFER_EXPIRED: &str = "OFFER_EXPIRED";

pub(super) fn sweep(lapsed: &Lapsed, now: Millis, ids: &mut IdGen) -> Decision {
    let mut writes = Vec::new();
    let mut touched: HashSet<&str> = HashSet::new();
    let mut changed = 0;
    for s in lapsed.sessions.iter().filter(|s| s.expires_at <= now) {
        if matches!(s.state, SessionState::Online | SessionState::Draining) {
            writes.push(Write::Session(Session { state: SessionState::Expired, ..s.clone() }));
            changed += 1;
        }
    }
    for (lease, run, attempt) in &lapsed.leases {
        if lease.state == LeaseState::Leased && lease.facts.expires_at <= now && touched.insert(run.id.as_str()) {
            writes.extend(lose_lease(lease, run, attempt, now, ids));
            changed += 1;
        }
    }
    for (offer, run, attempt) in &lapsed.offers {
        if offer.state == OfferState::Open && offer.expires_at <= now && touched.insert(run.id.as_str()) {
            writes.extend(lapse_offer(offer, run, attempt, now, ids));
            changed += 1;
        }
    }
    for run in &lapsed.overdue {
        let due = run.deadline_at.is_some_and(|d| d <= now);
        if due && !run.status.is_terminal() && run.stop != Some(StopIntent::Timeout) && touched.insert(run.id.as_str())
        {
            writes.push(Write::Run(Run { stop: Some(StopIntent::Timeout), ..run.clone() }));
            writes.push(event(
                ids,
                &run.id,
                run.current_attempt.as_ref(),
                "run.timeout_requested",
                (Some(run.status.as_str()), Some(run.status.as_str())),
                json!({ "deadlineAt": run.deadline_at }),
                now,
            ));
            changed += 1;
        }
    }
    writes.push(Write::Alive(now));
    Decision::apply(Reply::Swept(changed), writes).waking_for_queued()
}

/// An expired lease: the attempt is lost; the run follows its stop intent, else is
/// re-queued within its retry budget, else fails with `LEASE_LOST`.
fn lose_lease(lease: &Lease, run: &Run, attempt: &Attempt, now: Millis, ids: &mut IdGen) -> Vec<Write> {
    lost_lease(lease, run, attempt, LEASE_LOST, None, now, ids)
}

/// A lease given up or lapsed, as [`lose_lease`] says, with `code` as the loss's error
/// code (and the run's, when its budget is spent) and `summary` on the attempt.
pub(super) fn lost_lease(
    lease: &Lease,
    run: &Run,
    attempt: &Attempt,
    code: &str,
    summary: Option<&str>,
    now: Millis,
    ids: &mut IdGen,
) -> Vec<Write> {
    let lost = Attempt {
        status: AttemptStatus::Lost,
        end: Some(EndKind::LeaseLost),
        ended_at: Some(now),
        error_code: Some(code.to_owned()),
        summary: summary.map(str::to_owned).or_else(|| attempt.summary.clone()),
        ..attempt.clone()
    };
    let next_run = match run.stop {
        Some(StopIntent::Timeout) => ended(run, RunStatus::TimedOut, EXECUTION_TIMED_OUT, now),
        Some(StopIntent::Cancel) => ended(run, RunStatus::Cancelled, EXECUTION_CANCELLED, now),
        None if run.retries_used < run.retry_budget => requeued(run, run.retries_used + 1),
        None => ended(run, RunStatus::Failed, code, now),
    };
    let mut writes = vec![Write::Lease(Lease { state: LeaseState::Expired, ..lease.clone() })];
    writes.extend(lose(attempt, lost, run, next_run, code, now, ids));
    writes
}

/// An offer nobody claimed: the attempt is lost and the run goes back to the queue
/// without spending its retry budget (it never started).
fn lapse_offer(offer: &Offer, run: &Run, attempt: &Attempt, now: Millis, ids: &mut IdGen) -> Vec<Write> {
    lost_offer(offer, run, attempt, OFFER_EXPIRED, now, ids)
}

/// An open offer ended unclaimed, as [`lapse_offer`] says, with `code` as the loss's code.
pub(super) fn lost_offer(
    offer: &Offer,
    run: &Run,
    attempt: &Attempt,
    code: &str,
    now: Millis,
    ids: &mut IdGen,
) -> Vec<Write> {
    let lost = Attempt {
        status: AttemptStatus::Lost,
        end: Some(EndKind::OfferExpired),
        ended_at: Some(now),
        error_code: Some(code.to_owned()),
        ..attempt.clone()
    };
    let next_run = requeued(run, run.retries_used);
    let mut writes = vec![Write::Offer(Offer { state: OfferState::Expired, ..offer.clone() })];
    writes.extend(lose(attempt, lost, run, next_run, code, now, ids));
    writes
}

/// The writes shared by every loss: the `attempt.lost` event (from `was`), the run's event,
/// then the two rows.
fn lose(
    was: &Attempt,
    lost: Attempt,
    run: &Run,
    next_run: Run,
    code: &str,
    now: Millis,
    ids: &mut IdGen,
) -> [Write; 4] {
    [
        event(
            ids,
            &run.id,
            Some(&was.id),
            "attempt.lost",
            transition(was.status, lost.status),
            json!({ "errorCode": code }),
            now,
        ),
        run_event(ids, run, &next_run, &was.id, now),
        Write::Attempt(lost),
        Write::Run(next_run),
    ]
}

fn run_event(ids: &mut IdGen, run: &Run, next: &Run, attempt: &ql_wire::ids::AttemptId, now: Millis) -> Write {
    event(
        ids,
        &run.id,
        Some(attempt),
        &format!("run.{}", next.status),
        run_transition(run.status, next.status),
        json!({ "attemptId": attempt, "errorCode": next.error_code }),
        now,
    )
}

fn requeued(run: &Run, retries_used: u32) -> Run {
    Run {
        status: RunStatus::Queued,
        retries_used,
        current_attempt: None,
        deadline_at: None,
        started_at: None,
        ..run.clone()
    }
}

fn ended(run: &Run, status: RunStatus, code: &str, now: Millis) -> Run {
    Run { status, finished_at: Some(now), error_code: Some(code.to_owned()), ..run.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::core::{Lapsed, Rows, Want};

    fn swept(lapsed: &Lapsed) -> Decision {
        sweep(lapsed, NOW, &mut ids())
    }

    fn lapsed_lease(rows: &Rows) -> Lapsed {
        let mut lease = rows.lease.clone().unwrap();
        lease.facts.expires_at = NOW;
        let mut attempt = rows.attempt.clone().unwrap();
        attempt.lease = Some(lease.facts.clone());
        Lapsed { leases: vec![(lease, rows.run.clone().unwrap(), attempt)], ..Lapsed::default() }
    }

    fn written_run(d: &Decision) -> Run {
        d.writes.iter().find_map(|w| if let Write::Run(r) = w { Some(r.clone()) } else { None }).unwrap()
    }

    #[test]
    fn an_expired_lease_loses_the_attempt_and_requeues_within_budget() {
        let rows = world(AttemptStatus::Running);
        let d = swept(&lapsed_lease(&rows));
        assert_eq!(d.reply, Ok(Reply::Swept(1)));
        let run = written_run(&d);
        assert_eq!((run.status, run.retries_used, run.current_attempt.clone()), (RunStatus::Queued, 1, None));
        assert!(d.writes.iter().any(|w| matches!(w, Write::Lease(l) if l.state == LeaseState::Expired)));
        assert!(d.writes.iter().any(
            |w| matches!(w, Write::Attempt(a) if a.status == AttemptStatus::Lost && a.end == Some(EndKind::LeaseLost))
        ));
        assert_eq!(event_kinds(&d), ["attempt.lost", "run.queued"]);
        assert!(!d.wake, "not every waiting poll");
        assert_eq!(d.wants, [Want { labels: run.labels.clone(), agent_labels: run.agent_labels.clone() }]);
    }

    #[test]
    fn an_expired_lease_beyond_budget_fails_the_run_with_lease_lost() {
        let mut rows = world(AttemptStatus::Running);
        rows.run.as_mut().unwrap().retries_used = 1;
        let d = swept(&lapsed_lease(&rows));
        let run = written_run(&d);
        assert_eq!((run.status, run.error_code.as_deref()), (RunStatus::Failed, Some(LEASE_LOST)));
        assert_eq!(event_kinds(&d), ["attempt.lost", "run.failed"]);
    }

    #[test]
    fn an_expired_lease_under_a_stop_intent_ends_as_the_intent_says() {
        for (stop, status) in [(StopIntent::Cancel, RunStatus::Cancelled), (StopIntent::Timeout, RunStatus::TimedOut)] {
            let mut rows = world(AttemptStatus::Running);
            rows.run.as_mut().unwrap().stop = Some(stop);
            assert_eq!(written_run(&swept(&lapsed_lease(&rows))).status, status);
        }
    }

    #[test]
    fn an_unclaimed_offer_requeues_without_spending_retries() {
        let rows = world(AttemptStatus::Offered);
        let mut offer = rows.offer.clone().unwrap();
        offer.expires_at = NOW;
        let lapsed = Lapsed {
            offers: vec![(offer, rows.run.clone().unwrap(), rows.attempt.clone().unwrap())],
            ..Lapsed::default()
        };
        let d = swept(&lapsed);
        let run = written_run(&d);
        assert_eq!((run.status, run.retries_used), (RunStatus::Queued, 0));
        assert!(d.writes.iter().any(|w| matches!(w, Write::Offer(o) if o.state == OfferState::Expired)));
    }

    #[test]
    fn sessions_expire_and_overdue_runs_get_a_timeout_intent() {
        let mut s = session(1);
        s.expires_at = NOW;
        let mut overdue = world(AttemptStatus::Running).run.unwrap();
        overdue.deadline_at = Some(NOW);
        let d = swept(&Lapsed { sessions: vec![s.clone()], overdue: vec![overdue], ..Lapsed::default() });
        assert!(d.writes.contains(&Write::Session(Session { state: SessionState::Expired, ..s })));
        assert_eq!(written_run(&d).stop, Some(StopIntent::Timeout));
        assert_eq!(event_kinds(&d), ["run.timeout_requested"]);
    }

    #[test]
    fn sweeping_what_is_not_lapsed_changes_nothing() {
        let rows = world(AttemptStatus::Running);
        let mut live = lapsed_lease(&rows);
        live.leases[0].0.facts.expires_at = NOW + 1;
        let mut s = session(1);
        s.state = SessionState::Expired;
        s.expires_at = NOW - 1;
        live.sessions.push(s);
        let mut timed = rows.run.clone().unwrap();
        timed.stop = Some(StopIntent::Timeout);
        timed.deadline_at = Some(NOW);
        live.overdue.push(timed);
        let d = swept(&live);
        assert_eq!(d, Decision::apply(Reply::Swept(0), vec![Write::Alive(NOW)]), "only the sweep itself is recorded");
    }

    #[test]
    fn a_run_with_a_lost_lease_is_not_also_marked_overdue() {
        let mut rows = world(AttemptStatus::Running);
        rows.run.as_mut().unwrap().deadline_at = Some(NOW);
        let mut lapsed = lapsed_lease(&rows);
        lapsed.overdue.push(rows.run.clone().unwrap());
        let d = swept(&lapsed);
        assert_eq!(d.writes.iter().filter(|w| matches!(w, Write::Run(_))).count(), 1);
    }
}
