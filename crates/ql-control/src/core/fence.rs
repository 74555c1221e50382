//! The fence check every attempt command shares (PROTOCOL §7): which session, run,
//! attempt and lease a request speaks for, and whether it may.
//!
//! [`identify`] proves the request names this attempt's lease (session, generation,
//! offer, lease generation, token digest) and that the attempt's projection agrees with
//! the lease. [`live`] adds what the non-terminal commands need: a `leased`, unexpired
//! lease at exactly the expected version. Replays check versions themselves.

use ql_wire::lease::StopIntent;
use ql_wire::route::AttemptPath;
use ql_wire::{ErrorCode, Fence};

use super::session::is_live;
use super::Rows;
use crate::model::{Attempt, Lease, LeaseState, Millis, Run, Session, REMOTE_WORKER};

/// Whether the command needs the session to be online or draining and unexpired.
/// Completion and artifact upload do not: a restarted agent may finish from durable
/// evidence after its session lapsed, as long as the lease was not swept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SessionNeed {
    Live,
    SameGeneration,
}

/// The rows a fenced request was proven to speak for.
pub(super) struct Held<'a> {
    pub(super) run: &'a Run,
    pub(super) attempt: &'a Attempt,
    pub(super) lease: &'a Lease,
}

pub(super) fn identify<'a>(
    path: &AttemptPath,
    fence: &Fence,
    rows: &'a Rows,
    now: Millis,
    need: SessionNeed,
) -> Result<Held<'a>, ErrorCode> {
    let (Some(run), Some(attempt)) = (rows.run.as_ref(), rows.attempt.as_ref()) else {
        return Err(ErrorCode::NotFound);
    };
    if run.id != path.run || attempt.id != path.attempt || attempt.run != run.id || attempt.worker != path.worker {
        return Err(ErrorCode::NotFound);
    }
    let Some(session) = rows.session.as_ref().filter(|s| s.id == path.session && s.worker == path.worker) else {
        return Err(ErrorCode::NotFound);
    };
    check_session(session, fence, path, now, need)?;
    if attempt.executor_type != REMOTE_WORKER {
        return Err(ErrorCode::StateConflict);
    }
    // A swept lease is gone for good: whatever the attempt's state, the worker must stop.
    let Some(lease) = rows.lease.as_ref().filter(|l| l.attempt == attempt.id && l.state != LeaseState::Expired) else {
        return Err(ErrorCode::LeaseConflict);
    };
    let f = &lease.facts;
    let same = f.worker == path.worker
        && f.session == path.session
        && f.session_generation == fence.session_generation
        && f.offer == fence.offer_id
        && f.lease_generation == fence.lease_generation;
    // The token is compared last and always, by digest, in constant time.
    if !(fence.lease_token.matches(&f.token_digest) && same) {
        return Err(ErrorCode::LeaseConflict);
    }
    if attempt.lease.as_ref() != Some(f) {
        return Err(ErrorCode::StateConflict);
    }
    Ok(Held { run, attempt, lease })
}

fn check_session(
    s: &Session,
    fence: &Fence,
    path: &AttemptPath,
    now: Millis,
    need: SessionNeed,
) -> Result<(), ErrorCode> {
    if s.generation != fence.session_generation {
        return Err(ErrorCode::SessionConflict);
    }
    if need == SessionNeed::Live && !is_live(s, &path.worker, now) {
        return Err(ErrorCode::SessionConflict);
    }
    Ok(())
}

/// The lease is `leased`, at the expected version, and (when `unexpired`) not lapsed.
pub(super) fn live(held: &Held<'_>, fence: &Fence, now: Millis, unexpired: bool) -> Result<(), ErrorCode> {
    let l = held.lease;
    if l.state != LeaseState::Leased || l.facts.version != fence.expected_lease_version {
        return Err(ErrorCode::LeaseConflict);
    }
    if unexpired && l.facts.expires_at <= now {
        return Err(ErrorCode::LeaseConflict);
    }
    Ok(())
}

/// What the non-terminal ACKs (`starting`, `running`) need: the lease identified with a
/// live session, the attempt and run not ended, and the lease live at the expected version.
pub(super) fn live_ack<'a>(
    path: &AttemptPath,
    fence: &Fence,
    rows: &'a Rows,
    now: Millis,
) -> Result<Held<'a>, ErrorCode> {
    let held = identify(path, fence, rows, now, SessionNeed::Live)?;
    if held.attempt.status.is_terminal() || held.run.status.is_terminal() {
        return Err(ErrorCode::AlreadyTerminal);
    }
    live(&held, fence, now, true)?;
    Ok(held)
}

/// The stop intent in force: the run's own, raised to `timeout` once its deadline passed
/// (the sweeper records that later; a decision must not wait for it).
pub(super) fn effective_stop(run: &Run, now: Millis) -> Option<StopIntent> {
    let overdue = run.deadline_at.is_some_and(|d| d <= now).then_some(StopIntent::Timeout);
    StopIntent::strongest(run.stop, overdue)
}

#[cfg(test)]
mod tests {
    //! Every drift of PROTOCOL §7, for every fenced command: refused with its code, and
    //! the decision carries no writes.

    use super::super::testkit::*;
    use super::super::{decide, Command, Decision, Rows};
    use crate::model::*;
    use ql_wire::artifact::{ArtifactHeader, ArtifactSchema};
    use ql_wire::ids::{ArtifactId, Counter, OfferId, SessionId};
    use ql_wire::route::AttemptPath;
    use ql_wire::{ErrorCode, Fence};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Kind {
        Starting,
        Running,
        StartFailure,
        Renew,
        Admit,
        Complete,
    }

    const ALL: [Kind; 6] =
        [Kind::Starting, Kind::Running, Kind::StartFailure, Kind::Renew, Kind::Admit, Kind::Complete];

    /// The attempt state each command succeeds from.
    fn base(kind: Kind) -> Rows {
        world(match kind {
            Kind::Starting => AttemptStatus::Claimed,
            Kind::Running | Kind::StartFailure => AttemptStatus::Starting,
            Kind::Renew | Kind::Admit | Kind::Complete => AttemptStatus::Running,
        })
    }

    fn command(kind: Kind, p: AttemptPath, f: Fence) -> Command {
        match kind {
            Kind::Starting => Command::Starting(p, f),
            Kind::Running => {
                let b = running_body();
                Command::Running(
                    p,
                    ql_wire::ack::Running::new(f, b.executor_handle, None, Counter::ONE, b.callback_token_digest),
                )
            }
            Kind::StartFailure => {
                Command::StartFailure(p, ql_wire::ack::StartFailure::new(f, start_failure_body().reason))
            }
            Kind::Renew => Command::Renew(p, f),
            Kind::Admit => Command::AdmitArtifact(
                p,
                ArtifactId::parse("log").unwrap(),
                ArtifactHeader::new(f, ArtifactSchema, 3, false),
            ),
            Kind::Complete => {
                let b = completion_body(Some(0));
                Command::Complete(
                    p,
                    ql_wire::completion::Completion::new(
                        f,
                        b.schema,
                        b.callback_sequence,
                        b.callback_token,
                        b.exit_code,
                        b.signal,
                        b.finished_at,
                        None,
                    ),
                    None,
                )
            }
        }
    }

    fn run(kind: Kind, rows: &Rows, p: AttemptPath, f: Fence) -> Decision {
        decide(&command(kind, p, f), rows, NOW, &timings(), &mut ids())
    }

    #[test]
    fn every_command_succeeds_from_its_base_state() {
        for kind in ALL {
            let rows = base(kind);
            let d = run(kind, &rows, path(&rows), fence());
            assert!(d.reply.is_ok(), "{kind:?}: {d:?}");
        }
    }

    fn assert_refused(kind: Kind, rows: &Rows, p: AttemptPath, f: Fence, code: ErrorCode, what: &str) {
        assert_eq!(run(kind, rows, p, f), Decision::refuse(code), "{kind:?} with {what}");
    }

    #[test]
    fn fence_drift_is_refused_with_its_code_and_no_writes() {
        for kind in ALL {
            let rows = base(kind);
            let p = path(&rows);
            let cases: Vec<(&str, Fence, ErrorCode)> = vec![
                (
                    "another session generation",
                    Fence { session_generation: Counter::new(2).unwrap(), ..fence() },
                    ErrorCode::SessionConflict,
                ),
                (
                    "another offer",
                    Fence { offer_id: OfferId::parse("off_2").unwrap(), ..fence() },
                    ErrorCode::LeaseConflict,
                ),
                (
                    "another lease generation",
                    Fence { lease_generation: Counter::new(2).unwrap(), ..fence() },
                    ErrorCode::LeaseConflict,
                ),
                ("another token", Fence { lease_token: token(99), ..fence() }, ErrorCode::LeaseConflict),
                (
                    "a stale version",
                    Fence { expected_lease_version: Counter::new(2).unwrap(), ..fence() },
                    ErrorCode::LeaseConflict,
                ),
            ];
            for (what, f, code) in cases {
                assert_refused(kind, &rows, p.clone(), f, code, what);
            }
        }
    }

    #[test]
    fn path_drift_is_not_found() {
        for kind in ALL {
            let rows = base(kind);
            let other_session = AttemptPath { session: SessionId::parse("ses_9").unwrap(), ..path(&rows) };
            assert_refused(kind, &rows, other_session, fence(), ErrorCode::NotFound, "another session id");
            let other_worker = AttemptPath { worker: other_worker(), ..path(&rows) };
            assert_refused(kind, &rows, other_worker, fence(), ErrorCode::NotFound, "another worker");
            let missing = Rows { attempt: None, ..rows.clone() };
            assert_refused(kind, &missing, path(&rows), fence(), ErrorCode::NotFound, "no attempt");
        }
    }

    #[test]
    fn state_drift_is_refused() {
        for kind in ALL {
            let rows = base(kind);
            let mut foreign = rows.clone();
            foreign.attempt.as_mut().unwrap().executor_type = "local".into();
            assert_refused(kind, &foreign, path(&rows), fence(), ErrorCode::StateConflict, "another executor type");
            let mut drifted = rows.clone();
            drifted.attempt.as_mut().unwrap().lease.as_mut().unwrap().expires_at += 1;
            assert_refused(kind, &drifted, path(&rows), fence(), ErrorCode::StateConflict, "a projection drift");
            let mut swept = rows.clone();
            swept.lease.as_mut().unwrap().state = LeaseState::Expired;
            assert_refused(kind, &swept, path(&rows), fence(), ErrorCode::LeaseConflict, "a swept lease");
            let unleased = Rows { lease: None, ..rows.clone() };
            assert_refused(kind, &unleased, path(&rows), fence(), ErrorCode::LeaseConflict, "no lease");
        }
    }

    #[test]
    fn a_lapsed_lease_refuses_non_terminal_commands_only() {
        for kind in ALL {
            let mut rows = base(kind);
            let expiry = NOW;
            rows.lease.as_mut().unwrap().facts.expires_at = expiry;
            rows.attempt.as_mut().unwrap().lease.as_mut().unwrap().expires_at = expiry;
            let d = run(kind, &rows, path(&rows), fence());
            match kind {
                // Terminal steps may finish from durable evidence until a sweep expires it.
                Kind::StartFailure | Kind::Complete => assert!(d.reply.is_ok(), "{kind:?}: {d:?}"),
                _ => assert_eq!(d, Decision::refuse(ErrorCode::LeaseConflict), "{kind:?}"),
            }
        }
    }

    #[test]
    fn a_dead_session_refuses_acks_but_not_completion_or_upload() {
        for state in [SessionState::Replaced, SessionState::Expired] {
            for kind in ALL {
                let mut rows = base(kind);
                rows.session.as_mut().unwrap().state = state;
                let d = run(kind, &rows, path(&rows), fence());
                match kind {
                    Kind::Complete | Kind::Admit => assert!(d.reply.is_ok(), "{kind:?}: {d:?}"),
                    _ => assert_eq!(d, Decision::refuse(ErrorCode::SessionConflict), "{kind:?} {state}"),
                }
            }
        }
        for kind in [Kind::Starting, Kind::Running, Kind::StartFailure, Kind::Renew] {
            let mut rows = base(kind);
            rows.session.as_mut().unwrap().expires_at = NOW;
            assert_refused(kind, &rows, path(&rows), fence(), ErrorCode::SessionConflict, "a lapsed session");
        }
    }
}
