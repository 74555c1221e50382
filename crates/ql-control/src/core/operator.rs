//! Operator commands that change state: submit and cancel.

use serde_json::json;
use std::collections::BTreeMap;

use ql_wire::ids::ProjectId;
use ql_wire::lease::StopIntent;
use ql_wire::spec::ExecutionSpec;

use super::start::{run_transition, transition, EXECUTION_CANCELLED};
use super::{event, Decision, IdGen, Reply, Rows, Write};
use crate::model::{Attempt, AttemptStatus, EndKind, Millis, OfferState, Run, RunStatus};
use ql_wire::ErrorCode;

/// A run to queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submit {
    /// Project.
    pub project: ProjectId,
    /// What to run (its `projectId` must equal `project`).
    pub spec: ExecutionSpec,
    /// Labels a session must carry.
    pub labels: BTreeMap<String, String>,
    /// Lost leases tolerated before the run fails.
    pub retry_budget: u32,
}

/// What a cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The run had not been claimed: it is cancelled now.
    Cancelled,
    /// A worker holds it: the stop intent is recorded and delivered on its next renewal.
    StopRequested,
    /// The run had already ended with this status.
    AlreadyEnded(RunStatus),
}

pub(super) fn submit(s: &Submit, now: Millis, ids: &mut IdGen) -> Decision {
    if s.spec.project_id != s.project || s.spec.validate().is_err() {
        return Decision::refuse(ErrorCode::InvalidRequest);
    }
    let run = Run {
        id: ids.run(),
        project: s.project.clone(),
        spec: s.spec.clone(),
        labels: s.labels.clone(),
        status: RunStatus::Queued,
        stop: None,
        retry_budget: s.retry_budget,
        retries_used: 0,
        attempts: 0,
        lease_generations: 0,
        current_attempt: None,
        deadline_at: None,
        created_at: now,
        started_at: None,
        finished_at: None,
        error_code: None,
        summary: None,
    };
    let ev = event(ids, &run.id, None, "run.queued", (None, Some("queued")), json!({ "project": s.project }), now);
    Decision::apply(Reply::Submitted(run.id.clone()), vec![Write::Run(run), ev]).waking()
}

/// Cancels a run. Its current attempt, lease and offer are loaded with it.
pub(super) fn cancel(rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let Some(run) = rows.run.as_ref() else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if run.status.is_terminal() {
        return Decision::answer(Reply::Cancelled(CancelOutcome::AlreadyEnded(run.status)));
    }
    let attempt = rows.attempt.as_ref().filter(|a| Some(&a.id) == run.current_attempt.as_ref());
    let ended = Run {
        status: RunStatus::Cancelled,
        finished_at: Some(now),
        error_code: Some(EXECUTION_CANCELLED.to_owned()),
        ..run.clone()
    };
    match attempt {
        None if run.status == RunStatus::Queued => {
            let ev =
                event(ids, &run.id, None, "run.cancelled", run_transition(run.status, ended.status), json!({}), now);
            Decision::apply(Reply::Cancelled(CancelOutcome::Cancelled), vec![Write::Run(ended), ev])
        }
        Some(a) if a.status == AttemptStatus::Offered => {
            let mut writes = Vec::new();
            if let Some(offer) = rows.offer.as_ref().filter(|o| o.id == a.offer && o.state == OfferState::Open) {
                writes.push(Write::Offer(crate::model::Offer { state: OfferState::Withdrawn, ..offer.clone() }));
            }
            let gone = Attempt {
                status: AttemptStatus::Cancelled,
                end: Some(EndKind::Withdrawn),
                ended_at: Some(now),
                error_code: Some(EXECUTION_CANCELLED.to_owned()),
                ..a.clone()
            };
            writes.push(event(
                ids,
                &run.id,
                Some(&a.id),
                "attempt.cancelled",
                transition(a.status, gone.status),
                json!({}),
                now,
            ));
            writes.push(event(
                ids,
                &run.id,
                Some(&a.id),
                "run.cancelled",
                run_transition(run.status, ended.status),
                json!({ "attemptId": a.id }),
                now,
            ));
            writes.splice(0..0, [Write::Attempt(gone), Write::Run(ended)]);
            Decision::apply(Reply::Cancelled(CancelOutcome::Cancelled), writes).waking()
        }
        _ => {
            let stop = StopIntent::strongest(run.stop, Some(StopIntent::Cancel));
            if stop == run.stop {
                return Decision::answer(Reply::Cancelled(CancelOutcome::StopRequested));
            }
            let next = Run { stop, ..run.clone() };
            let ev = event(
                ids,
                &run.id,
                run.current_attempt.as_ref(),
                "run.cancel_requested",
                (Some(run.status.as_str()), Some(run.status.as_str())),
                json!({}),
                now,
            );
            Decision::apply(Reply::Cancelled(CancelOutcome::StopRequested), vec![Write::Run(next), ev])
        }
    }
}
