//! The start ACKs of ADR-0109 (`starting`, `running`, `start-failure`) and lease
//! renewal with stop delivery (PROTOCOL §7, §8).

use serde_json::json;

use ql_wire::ack::{AckReply, Running, StartFailure};
use ql_wire::ids::Counter;
use ql_wire::lease::{Renewed, StopIntent};
use ql_wire::route::AttemptPath;
use ql_wire::time::Timestamp;
use ql_wire::{ErrorCode, Fence, Outcome};

use super::fence::{effective_stop, identify, live, live_ack, Held, SessionNeed};
use super::{event, Decision, IdGen, Reply, Rows, Write};
use crate::model::{Attempt, AttemptStatus, EndKind, Lease, LeaseFacts, LeaseState, Millis, Run, RunStatus};

/// Error code of a start failure with no stop intent.
pub const EXECUTOR_START_FAILED: &str = "EXECUTOR_START_FAILED";
/// Error code of a cancelled run.
pub const EXECUTION_CANCELLED: &str = "EXECUTION_CANCELLED";
/// Error code of a timed-out run.
pub const EXECUTION_TIMED_OUT: &str = "EXECUTION_TIMED_OUT";

fn ack(outcome: Outcome) -> Reply {
    Reply::Ack(AckReply { result: outcome })
}

pub(super) fn starting(
    path: &AttemptPath,
    fence: &Fence,
    rows: &Rows,
    now: Millis,
    ids: &mut IdGen,
) -> Result<Decision, ErrorCode> {
    let held = live_ack(path, fence, rows, now)?;
    let (run, attempt) = (held.run, held.attempt);
    match (attempt.status, run.status) {
        (AttemptStatus::Starting, RunStatus::Dispatching) => Ok(Decision::answer(ack(Outcome::AlreadyStarting))),
        (AttemptStatus::Running, RunStatus::Running) => Ok(Decision::answer(ack(Outcome::AlreadyRunning))),
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
            Ok(Decision::apply(ack(Outcome::Started), vec![Write::Attempt(next), ev]))
        }
        _ => Err(ErrorCode::StateConflict),
    }
}

pub(super) fn running(
    path: &AttemptPath,
    body: &Running,
    rows: &Rows,
    now: Millis,
    ids: &mut IdGen,
) -> Result<Decision, ErrorCode> {
    let fence = body.fence();
    let held = live_ack(path, &fence, rows, now)?;
    let (run, attempt) = (held.run, held.attempt);
    match (attempt.status, run.status) {
        (AttemptStatus::Running, RunStatus::Running) => {
            let same = attempt.executor_handle.as_ref() == Some(&body.executor_handle)
                && attempt.log_artifact == body.log_artifact_id
                && attempt.callback_sequence == Some(body.callback_sequence)
                && attempt.callback_digest.as_ref().is_some_and(|d| d.ct_eq(&body.callback_token_digest));
            if same {
                Ok(Decision::answer(ack(Outcome::AlreadyRunning)))
            } else {
                Err(ErrorCode::ReplayMismatch)
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
            Ok(Decision::apply(
                ack(Outcome::Running),
                vec![Write::Attempt(next_attempt), Write::Run(next_run), attempt_ev, run_ev],
            ))
        }
        _ => Err(ErrorCode::StateConflict),
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
) -> Result<Decision, ErrorCode> {
    let fence = body.fence();
    let held = identify(path, &fence, rows, now, SessionNeed::Live)?;
    let (run, attempt) = (held.run, held.attempt);
    if attempt.status.is_terminal() || run.status.is_terminal() {
        return replay_start_failure(&held, &fence);
    }
    if (attempt.status, run.status) != (AttemptStatus::Starting, RunStatus::Dispatching) {
        return Err(ErrorCode::StateConflict);
    }
    live(&held, &fence, now, false)?;
    let (attempt_status, run_status, outcome, code) = start_failure_mapping(effective_stop(run, now));
    let summary = body.reason.to_string();
    // Advancing the callback sequence closes the door on any late completion receipt.
    let callback_sequence = Some(attempt.callback_sequence.and_then(Counter::next).unwrap_or(Counter::ONE));
    let ending = Ending {
        attempt: Attempt {
            status: attempt_status,
            callback_sequence,
            end: Some(EndKind::StartFailure),
            ended_at: Some(now),
            error_code: Some(code.to_owned()),
            summary: Some(summary.clone()),
            ..attempt.clone()
        },
        run: Run {
            status: run_status,
            finished_at: Some(now),
            error_code: Some(code.to_owned()),
            summary: Some(summary.clone()),
            ..run.clone()
        },
        kind: format!("attempt.{attempt_status}"),
        payload: json!({ "errorCode": code, "summary": summary }),
        at: now,
    };
    Ok(Decision::apply(ack(outcome), terminate(&held, ending, ids)?))
}

/// A repeat after a lost response: the lease completed at exactly expected + 1 by a start
/// failure whose terminal mapping is the recorded one. Identity was proven by `identify`.
fn replay_start_failure(held: &Held<'_>, fence: &Fence) -> Result<Decision, ErrorCode> {
    let (run, attempt, lease) = (held.run, held.attempt, held.lease);
    let at_next = fence.expected_lease_version.next() == Some(lease.facts.version);
    if lease.state != LeaseState::Completed || !at_next || attempt.end != Some(EndKind::StartFailure) {
        return Err(ErrorCode::AlreadyTerminal);
    }
    [None, Some(StopIntent::Cancel), Some(StopIntent::Timeout)]
        .into_iter()
        .map(start_failure_mapping)
        .find(|(a, r, _, code)| {
            *a == attempt.status && *r == run.status && attempt.error_code.as_deref() == Some(*code)
        })
        .map(|(.., outcome, _)| Decision::answer(ack(outcome)))
        .ok_or(ErrorCode::ReplayMismatch)
}

pub(super) fn renew(path: &AttemptPath, fence: &Fence, rows: &Rows, now: Millis) -> Result<Decision, ErrorCode> {
    let held = identify(path, fence, rows, now, SessionNeed::Live)?;
    let (run, attempt, lease) = (held.run, held.attempt, held.lease);
    live(&held, fence, now, true)?;
    if !matches!(attempt.status, AttemptStatus::Claimed | AttemptStatus::Starting | AttemptStatus::Running) {
        return Err(ErrorCode::StateConflict);
    }
    let version = lease.facts.version.next().ok_or(ErrorCode::LeaseConflict)?;
    let expires_at = now + lease.ttl_ms as i64;
    let facts = LeaseFacts { version, expires_at, ..lease.facts.clone() };
    let reply = Renewed {
        lease_version: version,
        lease_expires_at: Timestamp::from_millis(expires_at).map_err(|_| ErrorCode::StateConflict)?,
        stop: effective_stop(run, now),
    };
    Ok(Decision::apply(
        Reply::Renewed(reply),
        vec![
            Write::Lease(Lease { facts: facts.clone(), ..lease.clone() }),
            Write::Attempt(Attempt { lease: Some(facts), ..attempt.clone() }),
        ],
    ))
}

/// How a fenced terminal step ends an attempt and its run.
pub(super) struct Ending {
    /// The attempt's terminal row (its lease projection is filled in by [`terminate`]).
    pub(super) attempt: Attempt,
    /// The run's terminal row.
    pub(super) run: Run,
    /// The attempt event's type.
    pub(super) kind: String,
    /// The attempt event's payload (the new lease version is added to it).
    pub(super) payload: serde_json::Value,
    /// Terminal time.
    pub(super) at: Millis,
}

/// The writes of a terminal step (start-failure or completion), one transaction's worth:
/// the lease completed at version + 1, the attempt and its projection, the run, and one
/// event for each of attempt and run.
pub(super) fn terminate(held: &Held<'_>, ending: Ending, ids: &mut IdGen) -> Result<Vec<Write>, ErrorCode> {
    let (run, attempt, lease) = (held.run, held.attempt, held.lease);
    let version = lease.facts.version.next().ok_or(ErrorCode::LeaseConflict)?;
    let facts = LeaseFacts { version, ..lease.facts.clone() };
    let Ending { attempt: next_attempt, run: next_run, kind, mut payload, at } = ending;
    payload["leaseVersion"] = json!(version);
    let attempt_ev =
        event(ids, &run.id, Some(&attempt.id), &kind, transition(attempt.status, next_attempt.status), payload, at);
    let run_ev = event(
        ids,
        &run.id,
        Some(&attempt.id),
        &format!("run.{}", next_run.status),
        run_transition(run.status, next_run.status),
        json!({ "attemptId": attempt.id, "errorCode": next_run.error_code }),
        at,
    );
    Ok(vec![
        Write::Lease(Lease { state: LeaseState::Completed, facts: facts.clone(), ..lease.clone() }),
        Write::Attempt(Attempt { lease: Some(facts), ..next_attempt }),
        Write::Run(next_run),
        attempt_ev,
        run_ev,
    ])
}

pub(super) fn transition(from: AttemptStatus, to: AttemptStatus) -> (Option<&'static str>, Option<&'static str>) {
    (Some(from.as_str()), Some(to.as_str()))
}

pub(super) fn run_transition(from: RunStatus, to: RunStatus) -> (Option<&'static str>, Option<&'static str>) {
    (Some(from.as_str()), Some(to.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::core::{decide, Command};
    use crate::model::*;

    fn go(cmd: Command, rows: &Rows) -> Decision {
        decide(&cmd, rows, NOW, &timings(), &mut ids())
    }

    fn starting_cmd(rows: &Rows) -> Command {
        Command::Starting(path(rows), fence())
    }

    #[test]
    fn starting_moves_claimed_to_starting_and_keeps_the_run_dispatching() {
        let rows = world(AttemptStatus::Claimed);
        let d = go(starting_cmd(&rows), &rows);
        assert_eq!(d.reply, Ok(ack(Outcome::Started)));
        assert_eq!(event_kinds(&d), ["attempt.starting"]);
        let after = applied(&rows, &d);
        assert_eq!(after.attempt.as_ref().unwrap().status, AttemptStatus::Starting);
        assert_eq!(after.run, rows.run, "the run stays dispatching, untouched");
        assert_eq!(after.lease, rows.lease, "starting does not touch the lease");
    }

    #[test]
    fn starting_replays_answer_already_starting_or_already_running() {
        let rows = world(AttemptStatus::Starting);
        assert_eq!(go(starting_cmd(&rows), &rows), Decision::answer(ack(Outcome::AlreadyStarting)));
        let rows = world(AttemptStatus::Running);
        assert_eq!(go(starting_cmd(&rows), &rows), Decision::answer(ack(Outcome::AlreadyRunning)));
    }

    #[test]
    fn running_moves_attempt_and_run_to_running_with_db_time() {
        let rows = world(AttemptStatus::Starting);
        let d = go(Command::Running(path(&rows), running_body()), &rows);
        assert_eq!(d.reply, Ok(ack(Outcome::Running)));
        assert_eq!(event_kinds(&d), ["attempt.running", "run.running"]);
        let after = applied(&rows, &d);
        let (a, r) = (after.attempt.unwrap(), after.run.unwrap());
        assert_eq!((a.status, r.status), (AttemptStatus::Running, RunStatus::Running));
        assert_eq!((a.started_at, r.started_at), (Some(NOW), Some(NOW)));
        assert_eq!(a.executor_handle, Some(handle()));
        assert_eq!(a.callback_sequence, Some(Counter::ONE));
        assert_eq!(a.callback_digest, Some(callback_token().digest()));
        assert_eq!(after.lease, rows.lease, "running does not advance the lease version");
    }

    #[test]
    fn running_replay_needs_the_same_facts() {
        let rows = world(AttemptStatus::Starting);
        let d = go(Command::Running(path(&rows), running_body()), &rows);
        let after = applied(&rows, &d);
        assert_eq!(
            go(Command::Running(path(&after), running_body()), &after),
            Decision::answer(ack(Outcome::AlreadyRunning))
        );
        let mut other = running_body();
        other.executor_handle = "pid:43 start:7".parse().unwrap();
        assert_eq!(go(Command::Running(path(&after), other), &after), Decision::refuse(ErrorCode::ReplayMismatch));
        let mut other = running_body();
        other.callback_token_digest = token(50).digest();
        assert_eq!(go(Command::Running(path(&after), other), &after), Decision::refuse(ErrorCode::ReplayMismatch));
        let mut other = running_body();
        other.log_artifact_id = Some("log".parse().unwrap());
        assert_eq!(go(Command::Running(path(&after), other), &after), Decision::refuse(ErrorCode::ReplayMismatch));
    }

    #[test]
    fn running_requires_starting() {
        let rows = world(AttemptStatus::Claimed);
        assert_eq!(
            go(Command::Running(path(&rows), running_body()), &rows),
            Decision::refuse(ErrorCode::StateConflict)
        );
    }

    fn fail(rows: &Rows) -> Decision {
        go(Command::StartFailure(path(rows), start_failure_body()), rows)
    }

    #[test]
    fn start_failure_terminates_attempt_run_and_lease_atomically() {
        let rows = world(AttemptStatus::Starting);
        let d = fail(&rows);
        assert_eq!(d.reply, Ok(ack(Outcome::Failed)));
        assert_eq!(event_kinds(&d), ["attempt.failed", "run.failed"]);
        let after = applied(&rows, &d);
        let (a, r, l) = (after.attempt.unwrap(), after.run.unwrap(), after.lease.unwrap());
        assert_eq!((a.status, r.status, l.state), (AttemptStatus::Failed, RunStatus::Failed, LeaseState::Completed));
        assert_eq!(l.facts.version.get(), 2);
        assert_eq!(a.lease.as_ref(), Some(&l.facts), "the projection follows the lease");
        assert_eq!(a.error_code.as_deref(), Some(EXECUTOR_START_FAILED));
        assert_eq!(a.summary.as_deref(), Some("spawn failed: no such file"));
        assert_eq!(a.callback_sequence, Some(Counter::ONE), "the callback sequence advances past none");
    }

    #[test]
    fn start_failure_maps_the_stop_intent_timeout_over_cancel() {
        let cases = [
            (None, None, Outcome::Failed, EXECUTOR_START_FAILED),
            (Some(StopIntent::Cancel), None, Outcome::Cancelled, EXECUTION_CANCELLED),
            (Some(StopIntent::Timeout), None, Outcome::TimedOut, EXECUTION_TIMED_OUT),
            (Some(StopIntent::Cancel), Some(NOW), Outcome::TimedOut, EXECUTION_TIMED_OUT),
        ];
        for (stop, deadline, outcome, code) in cases {
            let mut rows = world(AttemptStatus::Starting);
            let run = rows.run.as_mut().unwrap();
            run.stop = stop;
            if deadline.is_some() {
                run.deadline_at = deadline;
            }
            let d = fail(&rows);
            assert_eq!(d.reply, Ok(ack(outcome)), "{stop:?}");
            assert_eq!(applied(&rows, &d).run.unwrap().error_code.as_deref(), Some(code));
        }
    }

    #[test]
    fn start_failure_replay_at_expected_plus_one_answers_the_same_without_writes() {
        let mut rows = world(AttemptStatus::Starting);
        rows.run.as_mut().unwrap().stop = Some(StopIntent::Cancel);
        let first = fail(&rows);
        let after = applied(&rows, &first);
        assert_eq!(fail(&after), Decision::answer(ack(Outcome::Cancelled)));
        let mut wrong_token = start_failure_body();
        wrong_token.lease_token = token(77);
        assert_eq!(
            go(Command::StartFailure(path(&after), wrong_token), &after),
            Decision::refuse(ErrorCode::LeaseConflict)
        );
        let mut beyond = after.clone();
        let next = beyond.lease.as_ref().unwrap().facts.version.next().unwrap();
        beyond.lease.as_mut().unwrap().facts.version = next;
        beyond.attempt.as_mut().unwrap().lease.as_mut().unwrap().version = next;
        assert_eq!(fail(&beyond), Decision::refuse(ErrorCode::AlreadyTerminal));
        let mut remapped = after.clone();
        remapped.attempt.as_mut().unwrap().error_code = Some(EXECUTOR_START_FAILED.into());
        assert_eq!(fail(&remapped), Decision::refuse(ErrorCode::ReplayMismatch));
    }

    #[test]
    fn start_failure_only_from_starting() {
        for status in [AttemptStatus::Claimed, AttemptStatus::Running] {
            let rows = world(status);
            assert_eq!(fail(&rows), Decision::refuse(ErrorCode::StateConflict), "{status}");
        }
    }

    #[test]
    fn renewal_advances_the_version_and_delivers_the_stop() {
        let mut rows = world(AttemptStatus::Running);
        let d = go(Command::Renew(path(&rows), fence()), &rows);
        let Ok(Reply::Renewed(r)) = &d.reply else { panic!("{d:?}") };
        assert_eq!((r.lease_version.get(), r.stop), (2, None));
        assert_eq!(r.lease_expires_at.millis(), NOW + 5_000);
        let after = applied(&rows, &d);
        assert_eq!(after.attempt.unwrap().lease, Some(after.lease.unwrap().facts));
        assert!(event_kinds(&d).is_empty());
        rows.run.as_mut().unwrap().stop = Some(StopIntent::Cancel);
        let d = go(Command::Renew(path(&rows), fence()), &rows);
        assert!(matches!(d.reply, Ok(Reply::Renewed(Renewed { stop: Some(StopIntent::Cancel), .. }))));
        rows.run.as_mut().unwrap().deadline_at = Some(NOW);
        let d = go(Command::Renew(path(&rows), fence()), &rows);
        assert!(matches!(d.reply, Ok(Reply::Renewed(Renewed { stop: Some(StopIntent::Timeout), .. }))));
    }

    #[test]
    fn renewal_of_a_completed_lease_is_a_lease_conflict() {
        let rows = world(AttemptStatus::Starting);
        let after = applied(&rows, &fail(&rows));
        let mut f = fence();
        f.expected_lease_version = Counter::new(2).unwrap();
        assert_eq!(go(Command::Renew(path(&after), f), &after), Decision::refuse(ErrorCode::LeaseConflict));
    }

    #[test]
    fn acks_on_a_terminal_attempt_are_already_terminal() {
        let rows = world(AttemptStatus::Starting);
        let after = applied(&rows, &fail(&rows));
        assert_eq!(go(starting_cmd(&after), &after), Decision::refuse(ErrorCode::AlreadyTerminal));
        assert_eq!(
            go(Command::Running(path(&after), running_body()), &after),
            Decision::refuse(ErrorCode::AlreadyTerminal)
        );
    }
}
