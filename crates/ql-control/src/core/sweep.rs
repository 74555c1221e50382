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
    let d = Decision::apply(Reply::Swept(changed), writes);
    if changed > 0 {
        d.waking()
    } else {
        d
    }
}

/// An expired lease: the attempt is lost; the run follows its stop intent, else is
/// re-queued within its retry budget, else fails with `LEASE_LOST`.
fn lose_lease(lease: &Lease, run: &Run, attempt: &Attempt, now: Millis, ids: &mut IdGen) -> Vec<Write> {
    let lost = Attempt {
        status: AttemptStatus::Lost,
        end: Some(EndKind::LeaseLost),
        ended_at: Some(now),
        error_code: Some(LEASE_LOST.to_owned()),
        ..attempt.clone()
    };
    let next_run = match run.stop {
        Some(StopIntent::Timeout) => ended(run, RunStatus::TimedOut, EXECUTION_TIMED_OUT, now),
        Some(StopIntent::Cancel) => ended(run, RunStatus::Cancelled, EXECUTION_CANCELLED, now),
        None if run.retries_used < run.retry_budget => requeued(run, run.retries_used + 1),
        None => ended(run, RunStatus::Failed, LEASE_LOST, now),
    };
    vec![
        Write::Lease(Lease { state: LeaseState::Expired, ..lease.clone() }),
        event(
            ids,
            &run.id,
            Some(&attempt.id),
            "attempt.lost",
            transition(attempt.status, lost.status),
            json!({ "errorCode": LEASE_LOST }),
            now,
        ),
        run_event(ids, run, &next_run, &attempt.id, now),
        Write::Attempt(lost),
        Write::Run(next_run),
    ]
}

/// An offer nobody claimed: the attempt is lost and the run goes back to the queue
/// without spending its retry budget (it never started).
fn lapse_offer(offer: &Offer, run: &Run, attempt: &Attempt, now: Millis, ids: &mut IdGen) -> Vec<Write> {
    let lost = Attempt {
        status: AttemptStatus::Lost,
        end: Some(EndKind::OfferExpired),
        ended_at: Some(now),
        error_code: Some(OFFER_EXPIRED.to_owned()),
        ..attempt.clone()
    };
    let next_run = requeued(run, run.retries_used);
    vec![
        Write::Offer(Offer { state: OfferState::Expired, ..offer.clone() }),
        event(
            ids,
            &run.id,
            Some(&attempt.id),
            "attempt.lost",
            transition(attempt.status, lost.status),
            json!({ "errorCode": OFFER_EXPIRED }),
            now,
        ),
        run_event(ids, run, &next_run, &attempt.id, now),
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
