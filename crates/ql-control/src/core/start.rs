//! The start ACKs of ADR-0109 (`starting`, `running`, `start-failure`) and lease
//! renewal with stop delivery (PROTOCOL §7, §8).

use serde_json::json;

use ql_wire::ack::{AckReply, Running, StartFailure};
use ql_wire::ids::Counter;
use ql_wire::lease::{Renewed, StopIntent};
use ql_wire::route::AttemptPath;
use ql_wire::time::Timestamp;
use ql_wire::{ErrorCode, Fence, Outcome};

use super::fence::{effective_stop, identify, live, Held, SessionNeed};
use super::{event, Decision, IdGen, Reply, Rows, Write};
use crate::model::{Attempt, AttemptStatus, EndKind, Lease, LeaseState, Millis, Run, RunStatus};

/// Error code of a start failure with no stop intent.
pub const EXECUTOR_START_FAILED: &str = "EXECUTOR_START_FAILED";
/// Error code of a cancelled run.
pub const EXECUTION_CANCELLED: &str = "EXECUTION_CANCELLED";
/// Error code of a timed-out run.
pub const EXECUTION_TIMED_OUT: &str = "EXECUTION_TIMED_OUT";

fn ack(outcome: Outcome) -> Reply {
    Reply::Ack(AckReply { result: outcome })
}

pub(super) fn starting(path: &AttemptPath, fence: &Fence, rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let held = match identify(path, fence, rows, now, SessionNeed::Live) {
        Ok(h) => h,
        Err(code) => return Decision::refuse(code),
    };
    let (run, attempt) = (held.run, held.attempt);
    if attempt.status.is_terminal() || run.status.is_terminal() {
        return Decision::refuse(ErrorCode::AlreadyTerminal);
    }
    if let Err(code) = live(&held, fence, now, true) {
        return Decision::refuse(code);
    }
    match (attempt.status, run.status) {
        (AttemptStatus::Starting, RunStatus::Dispatching) => Decision::answer(ack(Outcome::AlreadyStarting)),
        (AttemptStatus::Running, RunStatus::Running) => Decision::answer(ack(Outcome::AlreadyRunning)),
        (AttemptStatus::Claimed, RunStatus::Dispatching) => {
            let next = Attempt { status: AttemptStatus::Starting, ..attempt.clone() };
            let payload = json!({ "leaseVersion": held.lease.facts.version });
            let ev = event(
                ids,
                &run.id,
                Some(&attempt.id),
                "attempt.starting",
                transition(attempt.status, next.status),
                payload,
                now,
            );
            Decision::apply(ack(Outcome::Started), vec![Write::Attempt(next), ev])
        }
        _ => Decision::refuse(ErrorCode::StateConflict),
    }
}

pub(super) fn running(path: &AttemptPath, body: &Running, rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let fence = body.fence();
    let held = match identify(path, &fence, rows, now, SessionNeed::Live) {
        Ok(h) => h,
        Err(code) => return Decision::refuse(code),
    };
    let (run, attempt) = (held.run, held.attempt);
    if attempt.status.is_terminal() || run.status.is_terminal() {
        return Decision::refuse(ErrorCode::AlreadyTerminal);
    }
    if let Err(code) = live(&held, &fence, now, true) {
        return Decision::refuse(code);
    }
    match (attempt.status, run.status) {
        (AttemptStatus::Running, RunStatus::Running) => {
            let same = attempt.executor_handle.as_ref() == Some(&body.executor_handle)
                && attempt.log_artifact == body.log_artifact_id
                && attempt.callback_sequence == Some(body.callback_sequence)
                && attempt.callback_digest.as_ref().is_some_and(|d| d.ct_eq(&body.callback_token_digest));
            if same {
                Decision::answer(ack(Outcome::AlreadyRunning))
            } else {
                Decision::refuse(ErrorCode::ReplayMismatch)
            }
        }
        (AttemptStatus::Starting, RunStatus::Dispatching) => {
            let next_attempt = Attempt {
                status: AttemptStatus::Running,
                started_at: Some(now),
                executor_handle: Some(body.executor_handle.clone()),
                log_artifact: body.log_artifact_id.clone(),
                callback_sequence: Some(body.callback_sequence),
                callback_digest: Some(body.callback_token_digest.clone()),
                ..attempt.clone()
            };
            let next_run = Run { status: RunStatus::Running, started_at: Some(now), ..run.clone() };
            let payload = json!({
                "executorHandle": body.executor_handle,
                "logArtifactId": body.log_artifact_id,
                "callbackSequence": body.callback_sequence,
            });
            let attempt_ev = event(
                ids,
                &run.id,
                Some(&attempt.id),
                "attempt.running",
                transition(attempt.status, next_attempt.status),
                payload,
                now,
            );
            let run_ev = event(
                ids,
                &run.id,
                Some(&attempt.id),
                "run.running",
                run_transition(run.status, next_run.status),
                json!({ "attemptId": attempt.id }),
                now,
            );
            Decision::apply(
                ack(Outcome::Running),
                vec![Write::Attempt(next_attempt), Write::Run(next_run), attempt_ev, run_ev],
            )
        }
        _ => Decision::refuse(ErrorCode::StateConflict),
    }
}

/// The terminal status, outcome and error code a start failure maps to.
pub(super) fn start_failure_mapping(stop: Option<StopIntent>) -> (AttemptStatus, RunStatus, Outcome, &'static str) {
    match stop {
        Some(StopIntent::Timeout) => {
            (AttemptStatus::TimedOut, RunStatus::TimedOut, Outcome::TimedOut, EXECUTION_TIMED_OUT)
        }
        Some(StopIntent::Cancel) => {
            (AttemptStatus::Cancelled, RunStatus::Cancelled, Outcome::Cancelled, EXECUTION_CANCELLED)
        }
        None => (AttemptStatus::Failed, RunStatus::Failed, Outcome::Failed, EXECUTOR_START_FAILED),
    }
}

pub(super) fn start_failure(
    path: &AttemptPath,
    body: &StartFailure,
    rows: &Rows,
    now: Millis,
    ids: &mut IdGen,
) -> Decision {
    let fence = body.fence();
    let held = match identify(path, &fence, rows, now, SessionNeed::Live) {
        Ok(h) => h,
        Err(code) => return Decision::refuse(code),
    };
    let (run, attempt, lease) = (held.run, held.attempt, held.lease);
    if attempt.status.is_terminal() || run.status.is_terminal() {
        return replay_start_failure(&held, &fence);
    }
    if (attempt.status, run.status) != (AttemptStatus::Starting, RunStatus::Dispatching) {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    if let Err(code) = live(&held, &fence, now, false) {
        return Decision::refuse(code);
    }
    let Some(version) = lease.facts.version.next() else {
        return Decision::refuse(ErrorCode::LeaseConflict);
    };
    let (attempt_status, run_status, outcome, code) = start_failure_mapping(effective_stop(run, now));
    let summary = body.reason.to_string();
    let facts = facts_at(lease, version);
    // Advancing the callback sequence closes the door on any late completion receipt.
    let callback_sequence = Some(attempt.callback_sequence.and_then(Counter::next).unwrap_or(Counter::ONE));
    let next_lease = Lease { state: LeaseState::Completed, facts: facts.clone(), ..lease.clone() };
    let next_attempt = Attempt {
        status: attempt_status,
        lease: Some(facts),
        callback_sequence,
        end: Some(EndKind::StartFailure),
        ended_at: Some(now),
        error_code: Some(code.to_owned()),
        summary: Some(summary.clone()),
        ..attempt.clone()
    };
    let next_run = Run {
        status: run_status,
        finished_at: Some(now),
        error_code: Some(code.to_owned()),
        summary: Some(summary.clone()),
        ..run.clone()
    };
    let payload = json!({ "errorCode": code, "summary": summary, "leaseVersion": version });
    let attempt_ev = event(
        ids,
        &run.id,
        Some(&attempt.id),
        &format!("attempt.{attempt_status}"),
        transition(attempt.status, attempt_status),
        payload,
        now,
    );
    let run_ev = event(
        ids,
        &run.id,
        Some(&attempt.id),
        &format!("run.{run_status}"),
        run_transition(run.status, run_status),
        json!({ "attemptId": attempt.id, "errorCode": code }),
        now,
    );
    Decision::apply(
        ack(outcome),
        vec![Write::Lease(next_lease), Write::Attempt(next_attempt), Write::Run(next_run), attempt_ev, run_ev],
    )
}

/// A repeat after a lost response: the lease completed at exactly expected + 1 by a start
/// failure whose terminal mapping is the recorded one. Identity was proven by `identify`.
fn replay_start_failure(held: &Held<'_>, fence: &Fence) -> Decision {
    let (run, attempt, lease) = (held.run, held.attempt, held.lease);
    let at_next = fence.expected_lease_version.next() == Some(lease.facts.version);
    if lease.state != LeaseState::Completed || !at_next || attempt.end != Some(EndKind::StartFailure) {
        return Decision::refuse(ErrorCode::AlreadyTerminal);
    }
    let mapped =
        [None, Some(StopIntent::Cancel), Some(StopIntent::Timeout)].into_iter().map(start_failure_mapping).find(
            |(a, r, _, code)| *a == attempt.status && *r == run.status && attempt.error_code.as_deref() == Some(*code),
        );
    match mapped {
        Some((.., outcome, _)) => Decision::answer(ack(outcome)),
        None => Decision::refuse(ErrorCode::ReplayMismatch),
    }
}

pub(super) fn renew(path: &AttemptPath, fence: &Fence, rows: &Rows, now: Millis) -> Decision {
    let held = match identify(path, fence, rows, now, SessionNeed::Live) {
        Ok(h) => h,
        Err(code) => return Decision::refuse(code),
    };
    let (run, attempt, lease) = (held.run, held.attempt, held.lease);
    if let Err(code) = live(&held, fence, now, true) {
        return Decision::refuse(code);
    }
    if !matches!(attempt.status, AttemptStatus::Claimed | AttemptStatus::Starting | AttemptStatus::Running) {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let Some(version) = lease.facts.version.next() else {
        return Decision::refuse(ErrorCode::LeaseConflict);
    };
    let expires_at = now + lease.ttl_ms as i64;
    let facts = crate::model::LeaseFacts { version, expires_at, ..lease.facts.clone() };
    let reply = Renewed {
        lease_version: version,
        lease_expires_at: Timestamp::from_millis(expires_at).unwrap_or(Timestamp::from_millis(0).expect("epoch")),
        stop: effective_stop(run, now),
    };
    Decision::apply(
        Reply::Renewed(reply),
        vec![
            Write::Lease(Lease { facts: facts.clone(), ..lease.clone() }),
            Write::Attempt(Attempt { lease: Some(facts), ..attempt.clone() }),
        ],
    )
}

/// The lease facts at a new version (terminal steps keep the expiry).
pub(super) fn facts_at(lease: &Lease, version: Counter) -> crate::model::LeaseFacts {
    crate::model::LeaseFacts { version, ..lease.facts.clone() }
}

pub(super) fn transition(from: AttemptStatus, to: AttemptStatus) -> (Option<&'static str>, Option<&'static str>) {
    (Some(from.as_str()), Some(to.as_str()))
}

pub(super) fn run_transition(from: RunStatus, to: RunStatus) -> (Option<&'static str>, Option<&'static str>) {
    (Some(from.as_str()), Some(to.as_str()))
}
