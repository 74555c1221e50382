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
    let Some(lease) = rows.lease.as_ref().filter(|l| l.attempt == attempt.id) else {
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

/// The stop intent in force: the run's own, raised to `timeout` once its deadline passed
/// (the sweeper records that later; a decision must not wait for it).
pub(super) fn effective_stop(run: &Run, now: Millis) -> Option<StopIntent> {
    let overdue = run.deadline_at.is_some_and(|d| d <= now).then_some(StopIntent::Timeout);
    StopIntent::strongest(run.stop, overdue)
}
