//! Builders for the decision tests: a consistent world of rows at each attempt state,
//! with the raw tokens that go with it.

use std::collections::BTreeMap;

use ql_wire::ack::{Running, StartFailure};
use ql_wire::capability::Token;
use ql_wire::completion::{Completion, CompletionSchema};
use ql_wire::ids::{AttemptId, Counter, OfferId, ProjectId, RunId, SessionId, WorkerId};
use ql_wire::route::AttemptPath;
use ql_wire::session::OpenSession;
use ql_wire::spec::{ExecutionSpec, SpecSchema};
use ql_wire::text::{ExecutorHandle, Reason};
use ql_wire::time::Timestamp;
use ql_wire::Fence;

use super::{IdGen, Rows, Timings};
use crate::model::*;

pub(crate) const NOW: Millis = 1_800_000_000_000;

pub(crate) fn timings() -> Timings {
    Timings {
        heartbeat_ms: 1_000,
        session_ttl_ms: 3_000,
        offer_ttl_ms: 2_000,
        lease_ttl_ms: 5_000,
        outage_after_ms: 5_000,
        takeover_after_ms: 2_000,
        missed_after_ms: 60_000,
        renew_interval_ms: 10_000,
    }
}

/// A valid run request.
pub(crate) fn submit_request() -> super::Submit {
    super::Submit {
        project: ProjectId::parse("default").unwrap(),
        spec: spec(),
        labels: BTreeMap::new(),
        agent_labels: BTreeMap::new(),
        retry_budget: 0,
        notify: None,
    }
}

pub(crate) fn ids() -> IdGen {
    IdGen::new([7; 12])
}

pub(crate) fn worker() -> WorkerId {
    WorkerId::parse("router-1").unwrap()
}

pub(crate) fn other_worker() -> WorkerId {
    WorkerId::parse("router-2").unwrap()
}

pub(crate) fn token(seed: u8) -> Token {
    Token::from_bytes(&std::array::from_fn(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))).unwrap()
}

pub(crate) fn lease_token() -> Token {
    token(1)
}

pub(crate) fn callback_token() -> Token {
    token(2)
}

pub(crate) fn open_body() -> OpenSession {
    OpenSession {
        agent_version: "0.1.0".parse().unwrap(),
        arch: "mipsel".parse().unwrap(),
        labels: BTreeMap::new(),
        capacity: 1,
    }
}

pub(crate) fn session(generation: u64) -> Session {
    Session {
        id: SessionId::parse(format!("ses_{generation}")).unwrap(),
        worker: worker(),
        generation: Counter::new(generation).unwrap(),
        state: SessionState::Online,
        capacity: 1,
        labels: BTreeMap::new(),
        agent_version: "0.1.0".into(),
        arch: "mipsel".into(),
        created_at: NOW - 1_000,
        seen_at: NOW - 1_000,
        expires_at: NOW + 2_000,
        // As a session that has held work: placing on it writes nothing for the mark.
        offered: true,
    }
}

pub(crate) fn spec() -> ExecutionSpec {
    ExecutionSpec {
        schema: SpecSchema,
        project_id: ProjectId::parse("default").unwrap(),
        argv: Some(vec!["true".into()]),
        script: None,
        env: BTreeMap::new(),
        timeout_ms: 60_000,
        log_limit_bytes: 1024,
    }
}

pub(crate) fn queued_run() -> Run {
    Run {
        id: RunId::parse("run_1").unwrap(),
        project: ProjectId::parse("default").unwrap(),
        spec: spec(),
        labels: BTreeMap::new(),
        agent_labels: BTreeMap::new(),
        status: RunStatus::Queued,
        stop: None,
        retry_budget: 1,
        retries_used: 0,
        attempts: 0,
        lease_generations: 0,
        current_attempt: None,
        deadline_at: None,
        created_at: NOW - 10_000,
        started_at: None,
        finished_at: None,
        error_code: None,
        summary: None,
        schedule: None,
    }
}

/// A run with one attempt at `status`, claimed by session generation 1 under a lease at
/// version 1, consistent in every projection.
pub(crate) fn world(status: AttemptStatus) -> Rows {
    let s = session(1);
    let attempt_id = AttemptId::parse("att_1").unwrap();
    let offer_id = OfferId::parse("off_1").unwrap();
    let facts = LeaseFacts {
        worker: worker(),
        session: s.id.clone(),
        session_generation: s.generation,
        offer: offer_id.clone(),
        lease_generation: Counter::ONE,
        token_digest: lease_token().digest(),
        version: Counter::ONE,
        expires_at: NOW + 4_000,
    };
    let run_status = match status {
        AttemptStatus::Running => RunStatus::Running,
        _ => RunStatus::Dispatching,
    };
    let run = Run {
        status: run_status,
        attempts: 1,
        lease_generations: 1,
        current_attempt: Some(attempt_id.clone()),
        deadline_at: Some(NOW + 50_000),
        started_at: (status == AttemptStatus::Running).then_some(NOW - 500),
        ..queued_run()
    };
    let running = status == AttemptStatus::Running;
    let attempt = Attempt {
        id: attempt_id.clone(),
        run: run.id.clone(),
        number: 1,
        executor_type: REMOTE_WORKER.into(),
        status,
        offer: offer_id.clone(),
        session: s.id.clone(),
        worker: worker(),
        lease: (status != AttemptStatus::Offered).then(|| facts.clone()),
        executor_handle: running.then(handle),
        log_artifact: None,
        callback_sequence: running.then_some(Counter::ONE),
        callback_digest: running.then(|| callback_token().digest()),
        exit_code: None,
        signal: None,
        worker_finished_at: None,
        artifact: None,
        log_acked: 0,
        log_sealed: false,
        claimed_artifact: None,
        end: None,
        created_at: NOW - 2_000,
        started_at: run.started_at,
        ended_at: None,
        error_code: None,
        summary: None,
    };
    let lease =
        Lease { attempt: attempt_id.clone(), run: run.id.clone(), state: LeaseState::Leased, facts, ttl_ms: 5_000 };
    let offer = Offer {
        id: offer_id,
        run: run.id.clone(),
        attempt: attempt_id,
        worker: worker(),
        session: s.id.clone(),
        session_generation: s.generation,
        state: if status == AttemptStatus::Offered { OfferState::Open } else { OfferState::Claimed },
        expires_at: NOW + 1_000,
        claim: None,
    };
    Rows {
        session: Some(s),
        run: Some(run),
        attempt: Some(attempt),
        lease: (status != AttemptStatus::Offered).then_some(lease),
        offer: Some(offer),
        ..Rows::default()
    }
}

pub(crate) fn handle() -> ExecutorHandle {
    "pid:42 start:7".parse().unwrap()
}

pub(crate) fn path(rows: &Rows) -> AttemptPath {
    AttemptPath {
        worker: worker(),
        session: rows.session.as_ref().unwrap().id.clone(),
        run: rows.run.as_ref().unwrap().id.clone(),
        attempt: rows.attempt.as_ref().unwrap().id.clone(),
    }
}

pub(crate) fn fence() -> Fence {
    Fence {
        session_generation: Counter::ONE,
        offer_id: OfferId::parse("off_1").unwrap(),
        lease_generation: Counter::ONE,
        lease_token: lease_token(),
        expected_lease_version: Counter::ONE,
    }
}

pub(crate) fn running_body() -> Running {
    Running::new(fence(), handle(), None, Counter::ONE, callback_token().digest())
}

pub(crate) fn start_failure_body() -> StartFailure {
    StartFailure::new(fence(), Reason::parse("spawn failed: no such file").unwrap())
}

pub(crate) fn completion_body(exit_code: Option<i32>) -> Completion {
    Completion::new(
        fence(),
        CompletionSchema,
        Counter::ONE,
        callback_token(),
        exit_code,
        None,
        Timestamp::from_millis(NOW - 100).unwrap(),
        None,
    )
}

/// The rows after a store applied `d`'s writes: what the next command would load.
pub(crate) fn applied(rows: &Rows, d: &super::Decision) -> Rows {
    let mut next = rows.clone();
    for w in &d.writes {
        match w {
            super::Write::Session(s) => next.session = Some(s.clone()),
            super::Write::Run(r) => next.run = Some(r.clone()),
            super::Write::Attempt(a) => next.attempt = Some(a.clone()),
            super::Write::Offer(o) => next.offer = Some(o.clone()),
            super::Write::Lease(l) => next.lease = Some(l.clone()),
            super::Write::Event(e) if e.kind == super::COMPLETION_EVENT => next.completion_event = Some(e.clone()),
            super::Write::Worker(w) => next.worker = Some(w.clone()),
            super::Write::Alive(at) => next.alive_at = Some(*at),
            super::Write::Certificate(c) => next.certificate = Some(c.clone()),
            super::Write::Enrolment(e) => next.enrolment = Some(e.clone()),
            super::Write::Schedule(x) => next.schedule = Some(x.clone()),
            super::Write::RemoveSchedule(_) => next.schedule = None,
            super::Write::Operator(o) => next.operator = Some(o.clone()),
            super::Write::RemoveOperator(_) => next.operator = None,
            super::Write::Delivery(d) => next.delivery = Some(d.clone()),
            super::Write::Event(_) | super::Write::LogChunk(_) | super::Write::Fire(_) => {}
        }
    }
    next
}

/// The kinds of the events a decision appends, in order.
pub(crate) fn event_kinds(d: &super::Decision) -> Vec<String> {
    d.writes
        .iter()
        .filter_map(|w| match w {
            super::Write::Event(e) => Some(e.kind.clone()),
            _ => None,
        })
        .collect()
}
