//! `abandon`: the worker lost a job through no fault of the job. Its process and the
//! supervisor that would have recorded its end are gone (the machine went down, say), so
//! nobody knows how the job ended: it is not the job's failure. The attempt is lost, as
//! when its lease lapses, but at once and with its own code ([`WORKER_LOST`]), and the run
//! goes back to the queue within its retry budget (or ends `failed` with that code once
//! the budget is spent; a stop intent still decides, as for a lapse).

use ql_wire::ack::{Abandon, AckReply};
use ql_wire::route::AttemptPath;
use ql_wire::{ErrorCode, Outcome};

use super::fence::{identify, live, SessionNeed};
use super::sweep::lost_lease;
use super::{Decision, IdGen, Reply, Rows};
use crate::model::{AttemptStatus, Millis};

/// Error code of an attempt its worker lost through no fault of the job.
pub const WORKER_LOST: &str = "WORKER_LOST";

pub(super) fn abandon(
    path: &AttemptPath,
    body: &Abandon,
    rows: &Rows,
    now: Millis,
    ids: &mut IdGen,
) -> Result<Decision, ErrorCode> {
    let fence = body.fence();
    let held = identify(path, &fence, rows, now, SessionNeed::Live)?;
    if held.attempt.status.is_terminal() || held.run.status.is_terminal() {
        return Err(ErrorCode::AlreadyTerminal);
    }
    if !matches!(held.attempt.status, AttemptStatus::Claimed | AttemptStatus::Starting | AttemptStatus::Running) {
        return Err(ErrorCode::StateConflict);
    }
    // Not necessarily unexpired: an agent that came back late may give up a lease the
    // sweeper has not reached yet.
    live(&held, &fence, now, false)?;
    let summary = body.reason.to_string();
    let writes = lost_lease(held.lease, held.run, held.attempt, WORKER_LOST, Some(&summary), now, ids);
    Ok(Decision::apply(Reply::Ack(AckReply { result: Outcome::Abandoned }), writes).waking_for_queued())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::core::{Want, Write};
    use crate::model::{LeaseState, RunStatus};
    use ql_wire::text::Reason;

    fn body(rows: &Rows) -> Abandon {
        let lease = rows.lease.as_ref().unwrap();
        let fence = ql_wire::Fence {
            session_generation: lease.facts.session_generation,
            offer_id: lease.facts.offer.clone(),
            lease_generation: lease.facts.lease_generation,
            lease_token: lease_token(),
            expected_lease_version: lease.facts.version,
        };
        Abandon::new(fence, Reason::parse("gone after a restart").unwrap())
    }

    #[test]
    fn an_abandoned_attempt_is_lost_and_its_run_queued_within_its_budget() {
        let rows = world(AttemptStatus::Running);
        let d = abandon(&path(&rows), &body(&rows), &rows, NOW, &mut ids()).unwrap();
        assert_eq!(d.reply, Ok(Reply::Ack(AckReply { result: Outcome::Abandoned })));
        let run = d.writes.iter().find_map(|w| if let Write::Run(r) = w { Some(r) } else { None }).unwrap();
        assert_eq!((run.status, run.retries_used), (RunStatus::Queued, 1));
        let want = Want { labels: run.labels.clone(), agent_labels: run.agent_labels.clone() };
        assert_eq!((d.wake, d.wants.clone()), (false, vec![want]), "the polls that take the run look again");
        let attempt = d.writes.iter().find_map(|w| if let Write::Attempt(a) = w { Some(a) } else { None }).unwrap();
        assert_eq!((attempt.status, attempt.error_code.as_deref()), (AttemptStatus::Lost, Some(WORKER_LOST)));
        assert_eq!(attempt.summary.as_deref(), Some("gone after a restart"));
        assert!(d.writes.iter().any(|w| matches!(w, Write::Lease(l) if l.state == LeaseState::Expired)));
        assert_eq!(event_kinds(&d), ["attempt.lost", "run.queued"]);
    }

    #[test]
    fn with_its_budget_spent_the_run_fails_worker_lost() {
        let mut rows = world(AttemptStatus::Running);
        rows.run.as_mut().unwrap().retry_budget = 0;
        let d = abandon(&path(&rows), &body(&rows), &rows, NOW, &mut ids()).unwrap();
        let run = d.writes.iter().find_map(|w| if let Write::Run(r) = w { Some(r) } else { None }).unwrap();
        assert_eq!((run.status, run.error_code.as_deref()), (RunStatus::Failed, Some(WORKER_LOST)));
    }

    #[test]
    fn a_stale_fence_or_an_ended_attempt_is_refused_and_writes_nothing() {
        let rows = world(AttemptStatus::Running);
        let mut stale = body(&rows);
        stale.expected_lease_version = stale.expected_lease_version.next().unwrap();
        assert_eq!(abandon(&path(&rows), &stale, &rows, NOW, &mut ids()).unwrap_err(), ErrorCode::LeaseConflict);
        let mut ended = world(AttemptStatus::Running);
        ended.lease.as_mut().unwrap().state = LeaseState::Expired;
        assert_eq!(
            abandon(&path(&ended), &body(&ended), &ended, NOW, &mut ids()).unwrap_err(),
            ErrorCode::LeaseConflict
        );
    }
}
