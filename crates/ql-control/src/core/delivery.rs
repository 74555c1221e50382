//! Delivery (PROTOCOL §6): placement of queued runs onto a polling session, and claim.

use serde_json::json;

use ql_wire::ids::{Counter, OfferId, SessionId, WorkerId};
use ql_wire::offer::{Claim, Claimed, Offer as WireOffer, Offers, PollOffers};
use ql_wire::time::Timestamp;
use ql_wire::ErrorCode;

use super::session::is_live;
use super::start::{run_transition, transition};
use super::{event, Decision, IdGen, Reply, Rows, Timings, Write};
use crate::model::{
    Attempt, AttemptStatus, ClaimFacts, Lease, LeaseFacts, LeaseState, Millis, Offer, OfferState, Run, RunStatus,
    Session, SessionState, REMOTE_WORKER,
};

fn stamp(ms: Millis) -> Timestamp {
    Timestamp::from_millis(ms.max(0)).unwrap_or_else(|_| Timestamp::from_millis(0).expect("epoch"))
}

fn wire_offer(o: &Offer) -> WireOffer {
    WireOffer {
        offer_id: o.id.clone(),
        run_id: o.run.clone(),
        attempt_id: o.attempt.clone(),
        expires_at: stamp(o.expires_at),
    }
}

/// Whether a session carries every label the run asks for.
fn fits(run: &Run, session: &Session) -> bool {
    run.labels.iter().all(|(k, v)| session.labels.get(k) == Some(v))
}

/// A poll is proof of life (the agent cannot heartbeat while it long-polls on its one
/// connection), so it extends the session, then places queued runs up to free capacity.
pub(super) fn poll(
    worker: &WorkerId,
    session_id: &SessionId,
    body: &PollOffers,
    rows: &Rows,
    now: Millis,
    timings: &Timings,
    ids: &mut IdGen,
) -> Decision {
    let Some(session) = rows.session.as_ref().filter(|s| &s.worker == worker && &s.id == session_id) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if session.generation != body.generation || !is_live(session, worker, now) {
        return Decision::refuse(ErrorCode::SessionConflict);
    }
    let seen = Session { seen_at: now, expires_at: now + timings.session_ttl_ms as i64, ..session.clone() };
    let mut writes = vec![Write::Session(seen)];
    let mut offers: Vec<WireOffer> =
        rows.open_offers.iter().filter(|o| o.state == OfferState::Open && o.expires_at > now).map(wire_offer).collect();
    let free = session.capacity.saturating_sub(rows.active_attempts) as usize;
    let room = free.min(body.max as usize);
    if session.state == SessionState::Online {
        for run in rows.queued.iter().filter(|r| r.status == RunStatus::Queued && fits(r, session)).take(room) {
            let (offer, attempt, next_run) = place(run, session, now, timings, ids);
            writes.push(event(
                ids,
                &run.id,
                Some(&attempt.id),
                "attempt.offered",
                (None, Some(AttemptStatus::Offered.as_str())),
                json!({ "offerId": offer.id, "sessionId": session.id, "worker": session.worker }),
                now,
            ));
            writes.push(event(
                ids,
                &run.id,
                Some(&attempt.id),
                "run.dispatching",
                run_transition(run.status, next_run.status),
                json!({ "attemptId": attempt.id }),
                now,
            ));
            offers.push(wire_offer(&offer));
            writes.splice(1..1, [Write::Run(next_run), Write::Attempt(attempt), Write::Offer(offer)]);
        }
    }
    offers.truncate(body.max as usize);
    Decision::apply(Reply::Offers(Offers { offers }), writes)
}

fn place(run: &Run, session: &Session, now: Millis, timings: &Timings, ids: &mut IdGen) -> (Offer, Attempt, Run) {
    let attempt_id = ids.attempt();
    let offer = Offer {
        id: ids.offer(),
        run: run.id.clone(),
        attempt: attempt_id.clone(),
        worker: session.worker.clone(),
        session: session.id.clone(),
        session_generation: session.generation,
        state: OfferState::Open,
        expires_at: now + timings.offer_ttl_ms as i64,
        claim: None,
    };
    let attempt = Attempt {
        id: attempt_id.clone(),
        run: run.id.clone(),
        number: run.attempts + 1,
        executor_type: REMOTE_WORKER.to_owned(),
        status: AttemptStatus::Offered,
        offer: offer.id.clone(),
        session: session.id.clone(),
        worker: session.worker.clone(),
        lease: None,
        executor_handle: None,
        log_artifact: None,
        callback_sequence: None,
        callback_digest: None,
        exit_code: None,
        signal: None,
        worker_finished_at: None,
        artifact: None,
        end: None,
        created_at: now,
        started_at: None,
        ended_at: None,
        error_code: None,
        summary: None,
    };
    let next_run = Run {
        status: RunStatus::Dispatching,
        attempts: run.attempts + 1,
        current_attempt: Some(attempt_id),
        ..run.clone()
    };
    (offer, attempt, next_run)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn claim(
    worker: &WorkerId,
    session_id: &SessionId,
    offer_id: &OfferId,
    body: &Claim,
    rows: &Rows,
    now: Millis,
    timings: &Timings,
    ids: &mut IdGen,
) -> Decision {
    let Some(offer) =
        rows.offer.as_ref().filter(|o| &o.id == offer_id && &o.worker == worker && &o.session == session_id)
    else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    let Some(session) = rows.session.as_ref().filter(|s| &s.id == session_id && &s.worker == worker) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if session.generation != body.generation
        || offer.session_generation != body.generation
        || !is_live(session, worker, now)
    {
        return Decision::refuse(ErrorCode::SessionConflict);
    }
    if offer.run != body.run_id || offer.attempt != body.attempt_id {
        return Decision::refuse(ErrorCode::OfferConflict);
    }
    let (Some(run), Some(attempt)) = (rows.run.as_ref(), rows.attempt.as_ref()) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    let digest = body.lease_token.digest();
    match offer.state {
        OfferState::Claimed => {
            // An exact repeat (same offer, session, generation, token) gets the same answer.
            let same = offer.claim.as_ref().is_some_and(|c| c.token_digest.ct_eq(&digest));
            match (same, offer.claim.as_ref()) {
                (true, Some(c)) => Decision::answer(claimed(c, run)),
                _ => Decision::refuse(ErrorCode::OfferConflict),
            }
        }
        OfferState::Expired | OfferState::Withdrawn => Decision::refuse(ErrorCode::OfferConflict),
        OfferState::Open if offer.expires_at <= now => Decision::refuse(ErrorCode::OfferConflict),
        OfferState::Open => {
            if attempt.status != AttemptStatus::Offered || run.status != RunStatus::Dispatching || attempt.run != run.id
            {
                return Decision::refuse(ErrorCode::StateConflict);
            }
            let Ok(lease_generation) = Counter::new(run.lease_generations + 1) else {
                return Decision::refuse(ErrorCode::StateConflict);
            };
            let facts = LeaseFacts {
                worker: worker.clone(),
                session: session_id.clone(),
                session_generation: body.generation,
                offer: offer_id.clone(),
                lease_generation,
                token_digest: digest.clone(),
                version: Counter::ONE,
                expires_at: now + timings.lease_ttl_ms as i64,
            };
            let claim = ClaimFacts {
                token_digest: digest,
                lease_generation,
                lease_expires_at: facts.expires_at,
                lease_ttl_ms: timings.lease_ttl_ms,
            };
            let lease = Lease {
                attempt: attempt.id.clone(),
                run: run.id.clone(),
                state: LeaseState::Leased,
                facts: facts.clone(),
                ttl_ms: timings.lease_ttl_ms,
            };
            let next_attempt = Attempt { status: AttemptStatus::Claimed, lease: Some(facts), ..attempt.clone() };
            let next_run = Run {
                lease_generations: lease_generation.get(),
                deadline_at: Some(now + run.spec.timeout_ms as i64),
                ..run.clone()
            };
            let reply = claimed(&claim, &next_run);
            let next_offer = Offer { state: OfferState::Claimed, claim: Some(claim), ..offer.clone() };
            let ev = event(
                ids,
                &run.id,
                Some(&attempt.id),
                "attempt.claimed",
                transition(attempt.status, next_attempt.status),
                json!({ "offerId": offer.id, "leaseGeneration": lease_generation }),
                now,
            );
            Decision::apply(
                reply,
                vec![
                    Write::Offer(next_offer),
                    Write::Run(next_run),
                    Write::Attempt(next_attempt),
                    Write::Lease(lease),
                    ev,
                ],
            )
        }
    }
}

fn claimed(c: &ClaimFacts, run: &Run) -> Reply {
    Reply::Claimed(Box::new(Claimed {
        lease_generation: c.lease_generation,
        lease_version: Counter::ONE,
        lease_expires_at: stamp(c.lease_expires_at),
        lease_ttl_ms: c.lease_ttl_ms,
        spec: run.spec.clone(),
    }))
}
