//! Artifact admission and the atomic completion of ADR-0117 (PROTOCOL §9, §10).

use serde_json::json;

use ql_wire::artifact::{ArtifactHeader, Receipt};
use ql_wire::completion::{Completion, CompletionReply, TerminalStatus};
use ql_wire::ids::ArtifactId;
use ql_wire::lease::StopIntent;
use ql_wire::limits::FINISHED_AT_SKEW_MS;
use ql_wire::route::AttemptPath;
use ql_wire::{ErrorCode, Outcome};

use super::fence::{effective_stop, identify, live, Held, SessionNeed};
use super::start::{terminate, Ending, EXECUTION_CANCELLED, EXECUTION_TIMED_OUT};
use super::{Decision, IdGen, Reply, Rows, Write};
use crate::model::{Attempt, AttemptStatus, EndKind, LeaseState, Millis, Run, RunStatus};

/// Error code of a run whose process exited non-zero or by a signal.
pub const EXECUTION_FAILED: &str = "EXECUTION_FAILED";

/// The event type of a completion; replays compare against it.
pub const COMPLETION_EVENT: &str = "attempt.completed";

/// Before any content is read: the fence, a live lease, and a quota — the log artifact
/// the `running` ACK declared (once declared, no other id), no longer than the spec's
/// log limit. With `confirm`, the same once the content has arrived, except that a lease
/// that lapsed meanwhile still counts until it is swept (as for the completion): an upload
/// that outlived its lease's sweep is not stored; and the receipt the content makes is
/// claimed for the attempt, or refused when other content was claimed before.
pub(super) fn admit_artifact(
    path: &AttemptPath,
    artifact: &ArtifactId,
    header: &ArtifactHeader,
    confirm: Option<&Receipt>,
    rows: &Rows,
    now: Millis,
) -> Result<Decision, ErrorCode> {
    let fence = header.fence();
    let held = identify(path, &fence, rows, now, SessionNeed::SameGeneration)?;
    if held.attempt.status.is_terminal() || held.run.status.is_terminal() {
        return Err(ErrorCode::AlreadyTerminal);
    }
    if !matches!(held.attempt.status, AttemptStatus::Starting | AttemptStatus::Running) {
        return Err(ErrorCode::StateConflict);
    }
    live(&held, &fence, now, confirm.is_none())?;
    if held.attempt.log_artifact.as_ref().is_some_and(|declared| declared != artifact) {
        return Err(ErrorCode::ArtifactConflict);
    }
    if header.content_length > held.run.spec.log_limit_bytes {
        return Err(ErrorCode::PayloadTooLarge);
    }
    let reply = Reply::ArtifactAdmitted(held.run.project.clone());
    let Some(receipt) = confirm else {
        return Ok(Decision::answer(reply));
    };
    if &receipt.artifact_id != artifact
        || receipt.length != header.content_length
        || receipt.truncated != header.truncated
    {
        return Err(ErrorCode::InvalidRequest);
    }
    // One content per attempt's artifact: the first confirmed upload's. A repeat of it
    // goes on (to a replay answer from the store); other content never reaches the store.
    match &held.attempt.claimed_artifact {
        Some(claimed) if claimed == receipt => Ok(Decision::answer(reply)),
        Some(_) => Err(ErrorCode::ArtifactConflict),
        None => {
            let next = Attempt { claimed_artifact: Some(receipt.clone()), ..held.attempt.clone() };
            Ok(Decision::apply(reply, vec![Write::Attempt(next)]))
        }
    }
}

fn statuses(status: TerminalStatus) -> (AttemptStatus, RunStatus) {
    match status {
        TerminalStatus::Succeeded => (AttemptStatus::Succeeded, RunStatus::Succeeded),
        TerminalStatus::Failed => (AttemptStatus::Failed, RunStatus::Failed),
        TerminalStatus::Cancelled => (AttemptStatus::Cancelled, RunStatus::Cancelled),
        TerminalStatus::TimedOut => (AttemptStatus::TimedOut, RunStatus::TimedOut),
    }
}

fn terminal_of(status: AttemptStatus) -> Option<TerminalStatus> {
    match status {
        AttemptStatus::Succeeded => Some(TerminalStatus::Succeeded),
        AttemptStatus::Failed => Some(TerminalStatus::Failed),
        AttemptStatus::Cancelled => Some(TerminalStatus::Cancelled),
        AttemptStatus::TimedOut => Some(TerminalStatus::TimedOut),
        _ => None,
    }
}

/// Stop intent first (timeout over cancel), then the exit code.
pub fn terminal_status(stop: Option<StopIntent>, exit_code: Option<i32>) -> (TerminalStatus, Option<&'static str>) {
    match (stop, exit_code) {
        (Some(StopIntent::Timeout), _) => (TerminalStatus::TimedOut, Some(EXECUTION_TIMED_OUT)),
        (Some(StopIntent::Cancel), _) => (TerminalStatus::Cancelled, Some(EXECUTION_CANCELLED)),
        (None, Some(0)) => (TerminalStatus::Succeeded, None),
        (None, _) => (TerminalStatus::Failed, Some(EXECUTION_FAILED)),
    }
}

/// The completion event's payload: every terminal fact, and nothing secret.
/// The completion event's payload, less the lease version that [`terminate`] adds.
fn completion_payload(body: &Completion, status: TerminalStatus, code: Option<&str>) -> serde_json::Value {
    json!({
        "status": status,
        "errorCode": code,
        "exitCode": body.exit_code,
        "signal": body.signal,
        "finishedAt": body.finished_at,
        "callbackSequence": body.callback_sequence,
        "artifact": body.artifact,
    })
}

pub(super) fn complete(
    path: &AttemptPath,
    body: &Completion,
    stored: Option<&Receipt>,
    rows: &Rows,
    now: Millis,
    ids: &mut IdGen,
) -> Result<Decision, ErrorCode> {
    let fence = body.fence();
    let held = identify(path, &fence, rows, now, SessionNeed::SameGeneration)?;
    let (run, attempt) = (held.run, held.attempt);
    if attempt.status.is_terminal() || run.status.is_terminal() {
        return replay(&held, body, rows);
    }
    match (attempt.status, run.status) {
        (AttemptStatus::Starting, RunStatus::Dispatching) | (AttemptStatus::Running, RunStatus::Running) => {}
        _ => return Err(ErrorCode::StateConflict),
    }
    // The lease must not have been swept; it may have lapsed on the clock meanwhile.
    live(&held, &fence, now, false)?;
    if body.finished_at.millis() > now + FINISHED_AT_SKEW_MS {
        return Err(ErrorCode::InvalidRequest);
    }
    let digest = body.callback_token.digest();
    if attempt.status == AttemptStatus::Running {
        let registered = attempt.callback_sequence == Some(body.callback_sequence)
            && attempt.callback_digest.as_ref().is_some_and(|d| d.ct_eq(&digest));
        if !registered {
            return Err(ErrorCode::LeaseConflict);
        }
    }
    if let Some(receipt) = &body.artifact {
        let declared = attempt.log_artifact.as_ref().is_none_or(|id| *id == receipt.artifact_id);
        if stored != Some(receipt) || !declared {
            return Err(ErrorCode::ArtifactConflict);
        }
    }
    let (status, code) = terminal_status(effective_stop(run, now), body.exit_code);
    let (attempt_status, run_status) = statuses(status);
    let evidence = body.finished_at.millis();
    let ended_at = [now, evidence, attempt.created_at, run.created_at, attempt.started_at.unwrap_or(0)]
        .into_iter()
        .max()
        .unwrap_or(now);
    let ending = Ending {
        attempt: Attempt {
            status: attempt_status,
            callback_sequence: Some(body.callback_sequence),
            callback_digest: Some(digest),
            exit_code: body.exit_code,
            signal: body.signal,
            worker_finished_at: Some(evidence),
            artifact: body.artifact.clone(),
            end: Some(EndKind::Completion),
            ended_at: Some(ended_at),
            error_code: code.map(str::to_owned),
            ..attempt.clone()
        },
        run: Run {
            status: run_status,
            finished_at: Some(ended_at),
            error_code: code.map(str::to_owned),
            ..run.clone()
        },
        kind: COMPLETION_EVENT.to_owned(),
        payload: completion_payload(body, status, code),
        at: ended_at,
    };
    let reply = CompletionReply { result: Outcome::Completed, status };
    // No wake-up: the capacity freed is this session's, whose agent polls next on the
    // connection it completed on; no other waiting poll could place anything more.
    Ok(Decision::apply(Reply::Completed(reply), terminate(&held, ending, ids)?))
}

/// `already_completed` only for the exact same completion: lease completed at exactly
/// expected + 1 by a completion, the same terminal facts, and a stored completion event
/// with exactly the payload this request would have written.
fn replay(held: &Held<'_>, body: &Completion, rows: &Rows) -> Result<Decision, ErrorCode> {
    let (attempt, lease) = (held.attempt, held.lease);
    let at_next = body.expected_lease_version.next() == Some(lease.facts.version);
    if lease.state != LeaseState::Completed || !at_next || attempt.end != Some(EndKind::Completion) {
        return Err(ErrorCode::AlreadyTerminal);
    }
    let status = terminal_of(attempt.status).ok_or(ErrorCode::AlreadyTerminal)?;
    let facts_match = attempt.exit_code == body.exit_code
        && attempt.signal == body.signal
        && attempt.callback_sequence == Some(body.callback_sequence)
        && attempt.callback_digest.as_ref().is_some_and(|d| body.callback_token.matches(d))
        && attempt.artifact == body.artifact
        && attempt.worker_finished_at == Some(body.finished_at.millis());
    let mut expected = completion_payload(body, status, attempt.error_code.as_deref());
    expected["leaseVersion"] = json!(lease.facts.version);
    let event_matches = rows.completion_event.as_ref().is_some_and(|e| {
        e.kind == COMPLETION_EVENT
            && matches!(e.from_status.as_deref(), Some("starting" | "running"))
            && e.payload == expected
    });
    if facts_match && event_matches {
        Ok(Decision::answer(Reply::Completed(CompletionReply { result: Outcome::AlreadyCompleted, status })))
    } else {
        Err(ErrorCode::ReplayMismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::core::{decide, Command};
    use ql_wire::ids::Counter;
    use ql_wire::time::Timestamp;

    fn go(cmd: Command, rows: &Rows) -> Decision {
        decide(&cmd, rows, NOW, &timings(), &mut ids())
    }

    fn complete_with(rows: &Rows, body: Completion, stored: Option<Receipt>) -> Decision {
        go(Command::Complete(path(rows), body, stored), rows)
    }

    fn receipt() -> Receipt {
        Receipt {
            artifact_id: "log".parse().unwrap(),
            length: 3,
            sha256: ql_wire::capability::Digest::of(b"hi\n"),
            truncated: false,
        }
    }

    #[test]
    fn completion_from_running_ends_lease_attempt_and_run_with_two_events() {
        let rows = world(AttemptStatus::Running);
        let d = complete_with(&rows, completion_body(Some(0)), None);
        assert_eq!(
            d.reply,
            Ok(Reply::Completed(CompletionReply { result: Outcome::Completed, status: TerminalStatus::Succeeded }))
        );
        assert_eq!(event_kinds(&d), [COMPLETION_EVENT, "run.succeeded"]);
        let after = applied(&rows, &d);
        let (a, r, l) = (after.attempt.unwrap(), after.run.unwrap(), after.lease.unwrap());
        assert_eq!(
            (a.status, r.status, l.state),
            (AttemptStatus::Succeeded, RunStatus::Succeeded, LeaseState::Completed)
        );
        assert_eq!(l.facts.version.get(), 2);
        assert_eq!(a.lease, Some(l.facts));
        assert_eq!((a.exit_code, a.end), (Some(0), Some(EndKind::Completion)));
        assert_eq!(r.finished_at, Some(NOW), "terminal time is DB time when the evidence is older");
        assert!(!d.wake, "the capacity freed is the completing session's own: no other poll is woken");
    }

    #[test]
    fn status_follows_stop_intent_then_exit_code() {
        let cases = [
            (None, None, Some(0), TerminalStatus::Succeeded),
            (None, None, Some(3), TerminalStatus::Failed),
            (None, None, None, TerminalStatus::Failed),
            (Some(StopIntent::Cancel), None, Some(0), TerminalStatus::Cancelled),
            (Some(StopIntent::Timeout), None, Some(0), TerminalStatus::TimedOut),
            (Some(StopIntent::Cancel), Some(NOW), Some(0), TerminalStatus::TimedOut),
            (None, Some(NOW), Some(0), TerminalStatus::TimedOut),
        ];
        for (stop, deadline, exit, status) in cases {
            let mut rows = world(AttemptStatus::Running);
            let run = rows.run.as_mut().unwrap();
            run.stop = stop;
            if deadline.is_some() {
                run.deadline_at = deadline;
            }
            let d = complete_with(&rows, completion_body(exit), None);
            assert!(
                matches!(d.reply, Ok(Reply::Completed(CompletionReply { status: s, .. })) if s == status),
                "{stop:?} {exit:?}: {d:?}"
            );
        }
    }

    #[test]
    fn completion_from_starting_registers_the_callback_now() {
        let rows = world(AttemptStatus::Starting);
        let d = complete_with(&rows, completion_body(Some(0)), None);
        let after = applied(&rows, &d);
        let a = after.attempt.unwrap();
        assert_eq!(a.callback_digest, Some(callback_token().digest()));
        assert_eq!(after.run.unwrap().status, RunStatus::Succeeded);
        let Some(crate::core::Write::Event(e)) =
            d.writes.iter().find(|w| matches!(w, crate::core::Write::Event(e) if e.kind == COMPLETION_EVENT))
        else {
            panic!("no completion event");
        };
        assert_eq!(e.from_status.as_deref(), Some("starting"));
    }

    #[test]
    fn completion_refusals() {
        let rows = world(AttemptStatus::Claimed);
        assert_eq!(complete_with(&rows, completion_body(Some(0)), None), Decision::refuse(ErrorCode::StateConflict));
        let rows = world(AttemptStatus::Running);
        let mut body = completion_body(Some(0));
        body.callback_token = token(60);
        assert_eq!(complete_with(&rows, body, None), Decision::refuse(ErrorCode::LeaseConflict));
        let mut body = completion_body(Some(0));
        body.callback_sequence = Counter::new(2).unwrap();
        assert_eq!(complete_with(&rows, body, None), Decision::refuse(ErrorCode::LeaseConflict));
        let mut body = completion_body(Some(0));
        body.finished_at = Timestamp::from_millis(NOW + FINISHED_AT_SKEW_MS + 1).unwrap();
        assert_eq!(complete_with(&rows, body, None), Decision::refuse(ErrorCode::InvalidRequest));
        let mut body = completion_body(Some(0));
        body.finished_at = Timestamp::from_millis(NOW + FINISHED_AT_SKEW_MS).unwrap();
        let d = complete_with(&rows, body, None);
        assert_eq!(
            applied(&rows, &d).run.unwrap().finished_at,
            Some(NOW + FINISHED_AT_SKEW_MS),
            "the safe upper bound"
        );
    }

    #[test]
    fn the_receipt_must_match_the_stored_artifact_exactly() {
        let rows = world(AttemptStatus::Running);
        let mut body = completion_body(Some(0));
        body.artifact = Some(receipt());
        assert_eq!(complete_with(&rows, body.clone(), None), Decision::refuse(ErrorCode::ArtifactConflict));
        let other = Receipt { length: 4, ..receipt() };
        assert_eq!(complete_with(&rows, body.clone(), Some(other)), Decision::refuse(ErrorCode::ArtifactConflict));
        let d = complete_with(&rows, body.clone(), Some(receipt()));
        assert_eq!(applied(&rows, &d).attempt.unwrap().artifact, Some(receipt()));
        let mut declared_other = rows.clone();
        declared_other.attempt.as_mut().unwrap().log_artifact = Some("other".parse().unwrap());
        assert_eq!(
            complete_with(&declared_other, body, Some(receipt())),
            Decision::refuse(ErrorCode::ArtifactConflict)
        );
    }

    #[test]
    fn exact_replay_is_already_completed_and_any_drift_a_mismatch() {
        let rows = world(AttemptStatus::Running);
        let mut body = completion_body(Some(3));
        body.artifact = Some(receipt());
        let first = complete_with(&rows, body.clone(), Some(receipt()));
        let after = applied(&rows, &first);
        let replay = complete_with(&after, body.clone(), Some(receipt()));
        assert_eq!(
            replay,
            Decision::answer(Reply::Completed(CompletionReply {
                result: Outcome::AlreadyCompleted,
                status: TerminalStatus::Failed
            }))
        );
        let drifts: Vec<Completion> = vec![
            Completion { exit_code: Some(0), ..body.clone() },
            Completion { signal: Some(9), ..body.clone() },
            Completion { artifact: None, ..body.clone() },
            Completion { finished_at: Timestamp::from_millis(NOW - 99).unwrap(), ..body.clone() },
            Completion { callback_token: token(61), ..body.clone() },
        ];
        for drift in drifts {
            assert_eq!(complete_with(&after, drift, Some(receipt())), Decision::refuse(ErrorCode::ReplayMismatch));
        }
        let mut tampered = after.clone();
        tampered.completion_event.as_mut().unwrap().payload["exitCode"] = 4.into();
        assert_eq!(
            complete_with(&tampered, body.clone(), Some(receipt())),
            Decision::refuse(ErrorCode::ReplayMismatch)
        );
        let mut extra_key = after.clone();
        extra_key.completion_event.as_mut().unwrap().payload["extra"] = 1.into();
        assert_eq!(
            complete_with(&extra_key, body.clone(), Some(receipt())),
            Decision::refuse(ErrorCode::ReplayMismatch)
        );
        let mut missing_event = after.clone();
        missing_event.completion_event = None;
        assert_eq!(
            complete_with(&missing_event, body.clone(), Some(receipt())),
            Decision::refuse(ErrorCode::ReplayMismatch)
        );
        let mut later = body.clone();
        later.expected_lease_version = Counter::new(2).unwrap();
        assert_eq!(complete_with(&after, later, Some(receipt())), Decision::refuse(ErrorCode::AlreadyTerminal));
    }

    #[test]
    fn a_late_completion_after_start_failure_is_already_terminal() {
        let rows = world(AttemptStatus::Starting);
        let failed = go(Command::StartFailure(path(&rows), start_failure_body()), &rows);
        let after = applied(&rows, &failed);
        assert_eq!(complete_with(&after, completion_body(Some(0)), None), Decision::refuse(ErrorCode::AlreadyTerminal));
        let mut at_next = completion_body(Some(0));
        at_next.expected_lease_version = Counter::new(2).unwrap();
        assert_eq!(complete_with(&after, at_next, None), Decision::refuse(ErrorCode::AlreadyTerminal));
    }

    #[test]
    fn artifact_admission_follows_attempt_state() {
        let header = ArtifactHeader::new(fence(), ql_wire::artifact::ArtifactSchema, 3, false);
        let cmd = |rows: &Rows| Command::AdmitArtifact(path(rows), "log".parse().unwrap(), header.clone());
        for status in [AttemptStatus::Starting, AttemptStatus::Running] {
            let rows = world(status);
            assert_eq!(go(cmd(&rows), &rows), Decision::answer(Reply::ArtifactAdmitted("default".parse().unwrap())));
        }
        let rows = world(AttemptStatus::Claimed);
        assert_eq!(go(cmd(&rows), &rows), Decision::refuse(ErrorCode::StateConflict));
        let rows = world(AttemptStatus::Running);
        let after = applied(&rows, &complete_with(&rows, completion_body(Some(0)), None));
        assert_eq!(go(cmd(&after), &after), Decision::refuse(ErrorCode::AlreadyTerminal));
    }
}
