//! Sessions: open (replacing older ones) and heartbeat (which also drains).

use ql_wire::ids::{Counter, SessionId, WorkerId};
use ql_wire::session::{
    CloseSession, Heartbeat, HeartbeatReply, OpenSession, SessionClosed, SessionOpened, SessionStatus,
};
use ql_wire::{ErrorCode, Outcome};

use super::{Decision, IdGen, Reply, Rows, Timings, Write};
use crate::model::{Millis, Session, SessionState};

/// Whether a session may still speak: the same worker, online or draining, unexpired.
pub(crate) fn is_live(s: &Session, worker: &WorkerId, now: Millis) -> bool {
    &s.worker == worker && matches!(s.state, SessionState::Online | SessionState::Draining) && s.expires_at > now
}

pub(super) fn open(
    worker: &WorkerId,
    body: &OpenSession,
    rows: &Rows,
    now: Millis,
    timings: &Timings,
    ids: &mut IdGen,
) -> Decision {
    // A live session that still speaks is not taken over: another agent holding this
    // worker's identity (a twin: a restored backup, a replaced router still plugged in) is
    // refused, and the agent that holds the session keeps it and its jobs. Only a session
    // that went quiet for `takeover_after_ms`, or is draining, is replaced — and so is one
    // never heard from since it was opened: its agent polls or heartbeats at once, so a
    // session that stayed silent is one whose answer was lost, and the open that finds it
    // is that agent's repeat.
    // A long-poll holds the session alive beyond its TTL for its wait (`delivery::poll`):
    // its agent is speaking for that long too, so the quiet window starts after it. A
    // window of zero turns the refusal off.
    let quiet_after = i64::try_from(timings.takeover_after_ms).unwrap_or(i64::MAX);
    let ttl = i64::try_from(timings.session_ttl_ms).unwrap_or(i64::MAX);
    let speaking = |s: &&Session| {
        let held = s.expires_at.saturating_sub(s.seen_at).saturating_sub(ttl).max(0);
        quiet_after > 0
            && s.state == SessionState::Online
            && s.expires_at > now
            && s.seen_at > s.created_at
            && now.saturating_sub(s.seen_at) < quiet_after.saturating_add(held)
    };
    if rows.worker_sessions.iter().any(|s| &s.worker == worker && speaking(&s)) {
        return Decision::refuse(ErrorCode::SessionConflict);
    }
    let highest = rows.worker_sessions.iter().map(|s| s.generation.get()).max().unwrap_or(0);
    let Ok(generation) = Counter::new(highest + 1) else {
        return Decision::refuse(ErrorCode::SessionConflict);
    };
    let mut writes: Vec<Write> = rows
        .worker_sessions
        .iter()
        .filter(|s| matches!(s.state, SessionState::Online | SessionState::Draining))
        .map(|s| Write::Session(Session { state: SessionState::Replaced, ..s.clone() }))
        .collect();
    let session = Session {
        id: ids.session(),
        worker: worker.clone(),
        generation,
        state: SessionState::Online,
        capacity: body.capacity,
        labels: body.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        agent_version: body.agent_version.to_string(),
        arch: body.arch.to_string(),
        created_at: now,
        seen_at: now,
        expires_at: now + timings.session_ttl_ms as i64,
        offered: false,
    };
    let reply = SessionOpened {
        session_id: session.id.clone(),
        generation,
        heartbeat_ms: timings.heartbeat_ms,
        session_ttl_ms: timings.session_ttl_ms,
    };
    writes.push(Write::Session(session));
    // No wake-up: the new session polls next itself, and sessions it replaced learn it
    // at their next request.
    Decision::apply(Reply::SessionOpened(reply), writes)
}

pub(super) fn heartbeat(
    worker: &WorkerId,
    session: &SessionId,
    body: &Heartbeat,
    rows: &Rows,
    now: Millis,
    timings: &Timings,
) -> Decision {
    let Some(s) = rows.session.as_ref().filter(|s| &s.worker == worker && &s.id == session) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if s.generation != body.generation || !is_live(s, worker, now) {
        return Decision::refuse(ErrorCode::SessionConflict);
    }
    // Draining is one-way: a session that said it drains never takes new work again.
    let state =
        if body.draining || s.state == SessionState::Draining { SessionState::Draining } else { SessionState::Online };
    let status = if state == SessionState::Draining { SessionStatus::Draining } else { SessionStatus::Online };
    let updated = Session { state, seen_at: now, expires_at: now + timings.session_ttl_ms as i64, ..s.clone() };
    Decision::apply(Reply::Heartbeat(HeartbeatReply { status }), vec![Write::Session(updated)])
}

/// Closes a live session for good: its agent exits cleanly. A repeat finds it closed and
/// answers `already_closed`; a session replaced or lapsed meanwhile is a conflict.
pub(super) fn close(worker: &WorkerId, session: &SessionId, body: &CloseSession, rows: &Rows, now: Millis) -> Decision {
    let Some(s) = rows.session.as_ref().filter(|s| &s.worker == worker && &s.id == session) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if s.generation != body.generation {
        return Decision::refuse(ErrorCode::SessionConflict);
    }
    if s.state == SessionState::Closed {
        return Decision::answer(Reply::SessionClosed(SessionClosed { result: Outcome::AlreadyClosed }));
    }
    if !is_live(s, worker, now) {
        return Decision::refuse(ErrorCode::SessionConflict);
    }
    let closed = Session { state: SessionState::Closed, seen_at: now, expires_at: now, ..s.clone() };
    Decision::apply(Reply::SessionClosed(SessionClosed { result: Outcome::Closed }), vec![Write::Session(closed)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;

    #[test]
    fn open_takes_the_next_generation_and_replaces_live_sessions() {
        let mut rows = Rows::default();
        let mut old = session(3);
        old.state = SessionState::Online;
        // Quiet for longer than the takeover window: its agent is gone.
        old.seen_at = NOW - timings().takeover_after_ms as i64;
        let mut older = session(2);
        older.state = SessionState::Expired;
        rows.worker_sessions = vec![old.clone(), older.clone()];
        let d = open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids());
        let Ok(Reply::SessionOpened(reply)) = &d.reply else { panic!("{d:?}") };
        assert_eq!(reply.generation.get(), 4);
        assert_eq!(reply.heartbeat_ms, timings().heartbeat_ms);
        assert!(d.writes.contains(&Write::Session(Session { state: SessionState::Replaced, ..old })));
        assert!(!d.writes.iter().any(|w| matches!(w, Write::Session(s) if s.id == older.id)));
        let fresh = d.writes.iter().find_map(|w| match w {
            Write::Session(s) if s.id == reply.session_id => Some(s),
            _ => None,
        });
        let fresh = fresh.expect("the new session is written");
        assert_eq!(fresh.state, SessionState::Online);
        assert_eq!(fresh.expires_at, NOW + timings().session_ttl_ms as i64);
    }

    #[test]
    fn a_session_that_still_speaks_is_not_taken_over_but_a_draining_or_quiet_one_is() {
        let never_heard_from = session(3);
        let rows = Rows { worker_sessions: vec![never_heard_from], ..Rows::default() };
        let d = open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids());
        assert!(d.reply.is_ok(), "an open whose answer was lost is repeated at once: {d:?}");
        let speaking = Session { seen_at: NOW - 1, ..session(3) };
        let rows = Rows { worker_sessions: vec![speaking.clone()], ..Rows::default() };
        let d = open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids());
        assert_eq!(d, Decision::refuse(ErrorCode::SessionConflict), "a twin is refused and nothing changes");
        let draining = Session { state: SessionState::Draining, ..speaking.clone() };
        let rows = Rows { worker_sessions: vec![draining], ..Rows::default() };
        assert!(open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids()).reply.is_ok(), "a stopping agent's");
        // Quiet since its last heartbeat, which kept it alive one TTL.
        let last = NOW - timings().takeover_after_ms as i64;
        let quiet = Session {
            created_at: NOW - 60_000,
            seen_at: last,
            expires_at: last + timings().session_ttl_ms as i64,
            ..speaking.clone()
        };
        let rows = Rows { worker_sessions: vec![quiet.clone()], ..Rows::default() };
        assert!(open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids()).reply.is_ok(), "a quiet one");
        // Seen as long ago, but by a long-poll still waiting: it speaks until the wait ends.
        let polling = Session { expires_at: quiet.expires_at + 5_000, ..quiet.clone() };
        let rows = Rows { worker_sessions: vec![polling], ..Rows::default() };
        let d = open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids());
        assert_eq!(d, Decision::refuse(ErrorCode::SessionConflict), "a long-polling agent is not quiet");
        let polled_out = Session { seen_at: last - 5_000, ..quiet };
        let rows = Rows { worker_sessions: vec![polled_out], ..Rows::default() };
        assert!(
            open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids()).reply.is_ok(),
            "quiet after its wait"
        );
        let t = Timings { takeover_after_ms: 0, ..timings() };
        let rows = Rows { worker_sessions: vec![speaking], ..Rows::default() };
        assert!(open(&worker(), &open_body(), &rows, NOW, &t, &mut ids()).reply.is_ok(), "no window, no refusal");
    }

    #[test]
    fn close_ends_a_live_session_once_and_a_repeat_changes_nothing() {
        let s = session(2);
        let body = CloseSession { generation: s.generation };
        let rows = Rows { session: Some(s.clone()), ..Rows::default() };
        let d = close(&worker(), &s.id, &body, &rows, NOW);
        assert_eq!(d.reply, Ok(Reply::SessionClosed(SessionClosed { result: Outcome::Closed })));
        let closed = Session { state: SessionState::Closed, seen_at: NOW, expires_at: NOW, ..s.clone() };
        assert_eq!(d.writes, vec![Write::Session(closed.clone())]);
        let rows = Rows { session: Some(closed), ..Rows::default() };
        let again = close(&worker(), &s.id, &body, &rows, NOW + 5);
        assert_eq!(again, Decision::answer(Reply::SessionClosed(SessionClosed { result: Outcome::AlreadyClosed })));
        for (rows, code) in [
            (Rows::default(), ErrorCode::NotFound),
            (
                Rows { session: Some(Session { state: SessionState::Replaced, ..s.clone() }), ..Rows::default() },
                ErrorCode::SessionConflict,
            ),
            (
                Rows { session: Some(Session { expires_at: NOW, ..s.clone() }), ..Rows::default() },
                ErrorCode::SessionConflict,
            ),
        ] {
            assert_eq!(close(&worker(), &s.id, &body, &rows, NOW), Decision::refuse(code));
        }
        let stale = CloseSession { generation: Counter::ONE };
        let rows = Rows { session: Some(s.clone()), ..Rows::default() };
        assert_eq!(close(&worker(), &s.id, &stale, &rows, NOW), Decision::refuse(ErrorCode::SessionConflict));
    }

    #[test]
    fn first_session_is_generation_one() {
        let d = open(&worker(), &open_body(), &Rows::default(), NOW, &timings(), &mut ids());
        assert!(matches!(d.reply, Ok(Reply::SessionOpened(SessionOpened { generation, .. })) if generation.get() == 1));
    }

    #[test]
    fn heartbeat_extends_a_live_session() {
        let s = session(1);
        let rows = Rows { session: Some(s.clone()), ..Rows::default() };
        let body = Heartbeat { generation: s.generation, draining: false };
        let d = heartbeat(&worker(), &s.id, &body, &rows, NOW + 5, &timings());
        assert_eq!(d.reply, Ok(Reply::Heartbeat(HeartbeatReply { status: SessionStatus::Online })));
        assert_eq!(
            d.writes,
            vec![Write::Session(Session {
                seen_at: NOW + 5,
                expires_at: NOW + 5 + timings().session_ttl_ms as i64,
                ..s
            })]
        );
    }

    #[test]
    fn a_plain_heartbeat_changes_only_liveness_and_opening_draining_or_closing_more() {
        let s = session(1);
        let rows = Rows { session: Some(s.clone()), ..Rows::default() };
        let beat = |draining| {
            heartbeat(&worker(), &s.id, &Heartbeat { generation: s.generation, draining }, &rows, NOW, &timings())
        };
        assert!(beat(false).only_liveness(&rows));
        assert!(!beat(true).only_liveness(&rows));
        let closed = close(&worker(), &s.id, &CloseSession { generation: s.generation }, &rows, NOW);
        assert!(closed.reply.is_ok() && !closed.only_liveness(&rows));
        let opened = open(&worker(), &open_body(), &rows, NOW, &timings(), &mut ids());
        assert!(opened.reply.is_ok() && !opened.only_liveness(&rows));
    }

    #[test]
    fn heartbeat_with_draining_drains_for_good() {
        let s = session(1);
        let rows = Rows { session: Some(s.clone()), ..Rows::default() };
        let d = heartbeat(
            &worker(),
            &s.id,
            &Heartbeat { generation: s.generation, draining: true },
            &rows,
            NOW,
            &timings(),
        );
        assert_eq!(d.reply, Ok(Reply::Heartbeat(HeartbeatReply { status: SessionStatus::Draining })));
        let drained = Session { state: SessionState::Draining, ..s.clone() };
        let rows = Rows { session: Some(drained.clone()), ..Rows::default() };
        let d = heartbeat(
            &worker(),
            &s.id,
            &Heartbeat { generation: s.generation, draining: false },
            &rows,
            NOW,
            &timings(),
        );
        assert_eq!(d.reply, Ok(Reply::Heartbeat(HeartbeatReply { status: SessionStatus::Draining })));
    }

    #[test]
    fn heartbeat_refusals_write_nothing() {
        let s = session(2);
        let body = Heartbeat { generation: s.generation, draining: false };
        let cases: Vec<(Rows, Heartbeat, ErrorCode)> = vec![
            (Rows::default(), body.clone(), ErrorCode::NotFound),
            (
                Rows { session: Some(s.clone()), ..Rows::default() },
                Heartbeat { generation: Counter::ONE, ..body.clone() },
                ErrorCode::SessionConflict,
            ),
            (
                Rows { session: Some(Session { state: SessionState::Replaced, ..s.clone() }), ..Rows::default() },
                body.clone(),
                ErrorCode::SessionConflict,
            ),
            (
                Rows { session: Some(Session { state: SessionState::Expired, ..s.clone() }), ..Rows::default() },
                body.clone(),
                ErrorCode::SessionConflict,
            ),
            (
                Rows { session: Some(Session { expires_at: NOW, ..s.clone() }), ..Rows::default() },
                body.clone(),
                ErrorCode::SessionConflict,
            ),
            (
                Rows { session: Some(Session { worker: other_worker(), ..s.clone() }), ..Rows::default() },
                body.clone(),
                ErrorCode::NotFound,
            ),
        ];
        for (rows, body, code) in cases {
            assert_eq!(heartbeat(&worker(), &s.id, &body, &rows, NOW, &timings()), Decision::refuse(code));
        }
    }
}
