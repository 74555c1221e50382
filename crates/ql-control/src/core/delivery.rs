//! Delivery (PROTOCOL §6): placement of queued runs onto a polling session, and claim.

use serde_json::json;
use std::collections::BTreeMap;

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

/// What a queued run asks of a worker: the operator's labels of it, and the labels its
/// agent declares. A submit's wake-up carries it, so that only the long-polls of sessions
/// that take the run look again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Want {
    /// Labels the operator gave the worker that it must carry.
    pub labels: BTreeMap<String, String>,
    /// Labels the worker's agent must declare.
    pub agent_labels: BTreeMap<String, String>,
}

/// Most declared labels a session may have for stores to find the runs it takes by the
/// subsets of its labels ([`Fit::declared_subsets`]): 2^6 = 64 lookups per poll at most.
pub const SUBSET_LABELS: usize = 6;

/// What a session takes: its worker's labels as the operator set them, and the ones its
/// agent declared. A poll's answer carries it to the wait that follows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fit {
    /// The operator's labels of the worker ([`crate::model::Worker`]).
    pub trusted: BTreeMap<String, String>,
    /// The session's declared labels.
    pub declared: BTreeMap<String, String>,
}

impl Fit {
    /// Whether the worker carries every label `want` asks for: the operator's for
    /// `labels`, the declared ones for `agent_labels`. A declared label never stands in
    /// for a trusted one.
    pub fn takes(&self, want: &Want) -> bool {
        self.takes_labels(&want.labels, &want.agent_labels)
    }

    /// Every subset of the declared labels, when there are at most [`SUBSET_LABELS`] of
    /// them: a run's `agent_labels` are within the declared ones exactly when they are one
    /// of these, so a store can look the runs a session may take up by them instead of
    /// testing every queued run. `None` past the bound (2^n subsets).
    pub fn declared_subsets(&self) -> Option<Vec<BTreeMap<String, String>>> {
        let all: Vec<(&String, &String)> = self.declared.iter().collect();
        (all.len() <= SUBSET_LABELS).then(|| {
            (0..1usize << all.len())
                .map(|mask| {
                    let chosen = all.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0);
                    chosen.map(|(_, (k, v))| ((*k).clone(), (*v).clone())).collect()
                })
                .collect()
        })
    }

    /// Whether a run's `agent_labels` are all among the declared labels.
    pub fn declares(&self, agent_labels: &BTreeMap<String, String>) -> bool {
        agent_labels.iter().all(|(k, v)| self.declared.get(k) == Some(v))
    }

    fn takes_labels(&self, labels: &BTreeMap<String, String>, agent_labels: &BTreeMap<String, String>) -> bool {
        labels.iter().all(|(k, v)| self.trusted.get(k) == Some(v)) && self.declares(agent_labels)
    }
}

/// How many queued runs a poll of `session` may place, with `active` attempts taking
/// its capacity: its free capacity, and none unless it is online. The stores load no
/// more queued runs than this for a poll.
pub fn placement_room(session: &Session, active: u32) -> usize {
    if session.state != SessionState::Online {
        return 0;
    }
    session.capacity.saturating_sub(active) as usize
}

/// A poll is proof of life (the agent cannot heartbeat while it long-polls on its one
/// connection), so it extends the session for the whole wait and a TTL after it, then
/// places queued runs up to free capacity. An agent may therefore poll instead of
/// heartbeating, one long-poll after another. The same poll run again while it waits (a
/// wake-up) writes the session only when that extends it by more than a heartbeat, so a
/// wake-up that places nothing writes nothing.
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
    let expires_at = now + body.wait_ms as i64 + timings.session_ttl_ms as i64;
    let mut writes = Vec::new();
    if expires_at - session.expires_at > timings.heartbeat_ms as i64 || session.seen_at <= session.created_at {
        writes.push(Write::Session(Session { seen_at: now, expires_at, ..session.clone() }));
    }
    let placed_at = writes.len();
    let mut offers: Vec<WireOffer> =
        rows.open_offers.iter().filter(|o| o.state == OfferState::Open && o.expires_at > now).map(wire_offer).collect();
    let fit = Fit {
        trusted: rows.worker.as_ref().filter(|w| &w.id == worker).map(|w| w.labels.clone()).unwrap_or_default(),
        declared: session.labels.clone(),
    };
    let takes = |r: &Run| fit.takes_labels(&r.labels, &r.agent_labels);
    let room = placement_room(session, rows.active_attempts).min(body.max as usize);
    for run in rows.queued.iter().filter(|r| r.status == RunStatus::Queued && takes(r)).take(room) {
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
        writes.splice(placed_at..placed_at, [Write::Run(next_run), Write::Attempt(attempt), Write::Offer(offer)]);
    }
    // The first work placed on the session marks it, in the placement's transaction: an
    // offer names it from now on, so it is never pruned.
    if !session.offered && writes.len() > placed_at {
        match writes.first_mut() {
            Some(Write::Session(s)) if placed_at > 0 => s.offered = true,
            _ => writes.insert(0, Write::Session(Session { offered: true, ..session.clone() })),
        }
    }
    offers.truncate(body.max as usize);
    Decision::apply(Reply::Offers(Offers { offers }, Box::new(fit)), writes)
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
        log_acked: 0,
        log_sealed: false,
        claimed_artifact: None,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::core::{decide, Command};

    fn poll_body(max: u32) -> PollOffers {
        PollOffers { generation: Counter::ONE, wait_ms: 0, max }
    }

    fn polling(rows: &Rows, max: u32) -> Decision {
        let s = rows.session.as_ref().unwrap();
        decide(&Command::PollOffers(worker(), s.id.clone(), poll_body(max)), rows, NOW, &timings(), &mut ids())
    }

    fn placement_rows(queued: usize, capacity: u32) -> Rows {
        let mut s = session(1);
        s.capacity = capacity;
        let queued = (0..queued).map(|i| Run { id: format!("run_{i}").parse().unwrap(), ..queued_run() }).collect();
        Rows { session: Some(s), queued, ..Rows::default() }
    }

    fn offers(d: &Decision) -> Vec<WireOffer> {
        match &d.reply {
            Ok(Reply::Offers(o, _)) => o.offers.clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn agent_labels_fit_exactly_when_they_are_a_subset_of_the_declared_ones() {
        let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        // Every agent_labels over two keys and three values each (absent, "a", "b").
        let mut wanted = Vec::new();
        for x in [None, Some("a"), Some("b")] {
            for y in [None, Some("a"), Some("b")] {
                let pairs: Vec<(&str, &str)> =
                    [("x", x), ("y", y)].into_iter().filter_map(|(k, v)| Some((k, v?))).collect();
                wanted.push(map(&pairs));
            }
        }
        for declared in [map(&[]), map(&[("x", "a")]), map(&[("x", "a"), ("y", "b")]), map(&[("y", "a"), ("z", "c")])] {
            let fit = Fit { trusted: BTreeMap::new(), declared };
            let subsets = fit.declared_subsets().expect("within the bound");
            assert_eq!(subsets.len(), 1 << fit.declared.len());
            for agent_labels in &wanted {
                let want = Want { labels: BTreeMap::new(), agent_labels: agent_labels.clone() };
                assert_eq!(fit.takes(&want), subsets.contains(agent_labels), "{fit:?} {agent_labels:?}");
            }
        }
        let many = (0..=SUBSET_LABELS).map(|i| (format!("k{i}"), "v".to_owned())).collect();
        assert_eq!(Fit { trusted: BTreeMap::new(), declared: many }.declared_subsets(), None);
    }

    #[test]
    fn an_idle_poll_and_a_refused_one_change_nothing_but_liveness_and_an_offer_does() {
        let idle = placement_rows(0, 2);
        let d = polling(&idle, 1);
        assert!(offers(&d).is_empty() && !d.writes.is_empty());
        assert!(d.only_liveness(&idle));
        let queued = placement_rows(1, 2);
        let d = polling(&queued, 1);
        assert_eq!(offers(&d).len(), 1);
        assert!(!d.only_liveness(&queued));
        let stale = PollOffers { generation: Counter::new(2).unwrap(), ..poll_body(1) };
        let s = queued.session.as_ref().unwrap();
        let d = decide(&Command::PollOffers(worker(), s.id.clone(), stale), &queued, NOW, &timings(), &mut ids());
        assert!(d.reply.is_err());
        assert!(d.only_liveness(&queued));
    }

    #[test]
    fn poll_places_queued_runs_up_to_free_capacity() {
        let rows = placement_rows(3, 2);
        let d = polling(&rows, 8);
        assert_eq!(offers(&d).len(), 2);
        let runs: Vec<&Run> =
            d.writes.iter().filter_map(|w| if let Write::Run(r) = w { Some(r) } else { None }).collect();
        assert_eq!(runs.len(), 2);
        assert!(runs
            .iter()
            .all(|r| r.status == RunStatus::Dispatching && r.attempts == 1 && r.current_attempt.is_some()));
        let kinds = event_kinds(&d);
        assert_eq!(kinds.iter().filter(|k| *k == "attempt.offered").count(), 2);
        assert_eq!(kinds.iter().filter(|k| *k == "run.dispatching").count(), 2);
        let seen = d.writes.iter().find_map(|w| if let Write::Session(s) = w { Some(s) } else { None }).unwrap();
        assert_eq!(seen.expires_at, NOW + timings().session_ttl_ms as i64, "a poll keeps the session alive");
    }

    #[test]
    fn a_polls_room_is_its_sessions_free_capacity_and_none_unless_online() {
        let mut s = session(1);
        s.capacity = 3;
        let room = |s: &Session, active| placement_room(s, active);
        assert_eq!([room(&s, 0), room(&s, 1), room(&s, 3), room(&s, 5)], [3, 2, 0, 0]);
        for state in [SessionState::Draining, SessionState::Replaced, SessionState::Expired, SessionState::Closed] {
            assert_eq!(room(&Session { state, ..s.clone() }, 0), 0, "{state:?}");
        }
    }

    #[test]
    fn the_first_work_placed_on_a_session_marks_it_in_the_same_decision() {
        let t = timings();
        let body = PollOffers { generation: Counter::ONE, wait_ms: 0, max: 1 };
        let poll = |rows: &Rows, now: Millis| {
            let cmd = Command::PollOffers(worker(), SessionId::parse("ses_1").unwrap(), body.clone());
            decide(&cmd, rows, now, &t, &mut ids())
        };
        let marks = |d: &Decision| {
            d.writes
                .iter()
                .filter_map(|w| if let Write::Session(s) = w { Some(s.offered) } else { None })
                .collect::<Vec<_>>()
        };
        let fresh = Session { offered: false, seen_at: NOW - 100, created_at: NOW - 1_000, ..session(1) };
        // Nothing to place: no mark (the poll may write the session for its own reasons).
        let idle = poll(&Rows { session: Some(fresh.clone()), ..Rows::default() }, NOW);
        assert!(marks(&idle).iter().all(|offered| !offered), "{:?}", idle.writes);
        // Placing marks it, once, before the placement's writes; an offered one is not written for it.
        let rows = Rows { session: Some(fresh.clone()), queued: vec![queued_run()], ..Rows::default() };
        let placing = poll(&rows, NOW);
        assert_eq!(marks(&placing), [true], "{:?}", placing.writes);
        assert!(matches!(placing.writes.first(), Some(Write::Session(s)) if s.offered && s.id == fresh.id));
        // Never seen since it opened: the poll writes the session anyway, and that one
        // write carries the mark.
        let seen = Session { seen_at: fresh.created_at, ..fresh.clone() };
        let both = poll(&Rows { session: Some(seen), queued: vec![queued_run()], ..Rows::default() }, NOW);
        assert_eq!(marks(&both), [true], "the poll's own session write carries the mark: {:?}", both.writes);
        let marked = Session { offered: true, ..fresh };
        let again = poll(&Rows { session: Some(marked), queued: vec![queued_run()], ..Rows::default() }, NOW);
        assert!(marks(&again).is_empty(), "{:?}", again.writes);
    }

    #[test]
    fn a_long_poll_keeps_its_session_alive_for_its_wait_and_a_wake_up_writes_nothing_new() {
        let t = timings();
        let wait = 25_000;
        let body = PollOffers { generation: Counter::ONE, wait_ms: wait, max: 1 };
        let mut rows = Rows { session: Some(session(1)), ..Rows::default() };
        let poll = |rows: &Rows, now: Millis| {
            decide(
                &Command::PollOffers(worker(), SessionId::parse("ses_1").unwrap(), body.clone()),
                rows,
                now,
                &t,
                &mut ids(),
            )
        };
        let first = poll(&rows, NOW);
        let Some(Write::Session(seen)) = first.writes.first() else { panic!("{:?}", first.writes) };
        assert_eq!(seen.expires_at, NOW + wait as i64 + t.session_ttl_ms as i64, "the wait and a TTL after it");
        assert_eq!(seen.seen_at, NOW);
        rows.session = Some(seen.clone());
        // The same poll run again by a wake-up within a heartbeat: nothing to write.
        let woken = poll(&rows, NOW + t.heartbeat_ms as i64);
        assert_eq!(woken.reply, Ok(Reply::Offers(Offers { offers: vec![] }, Box::default())));
        assert!(woken.writes.is_empty(), "{:?}", woken.writes);
        // Later than a heartbeat, it extends the session again.
        let later = poll(&rows, NOW + t.heartbeat_ms as i64 + 1);
        assert!(matches!(later.writes.as_slice(), [Write::Session(s)] if s.seen_at == NOW + t.heartbeat_ms as i64 + 1));
        // A queued run is still placed by a poll that needs no session write.
        rows.queued = vec![queued_run()];
        let placing = poll(&rows, NOW + 1);
        assert_eq!(offers(&placing).len(), 1);
        assert!(!placing.writes.iter().any(|w| matches!(w, Write::Session(_))));
        assert!(matches!(placing.writes.first(), Some(Write::Run(r)) if r.status == RunStatus::Dispatching));
    }

    #[test]
    fn poll_respects_max_active_attempts_labels_and_draining() {
        assert_eq!(offers(&polling(&placement_rows(3, 4), 1)).len(), 1);
        let mut busy = placement_rows(3, 2);
        busy.active_attempts = 2;
        assert!(offers(&polling(&busy, 8)).is_empty());
        let mut labelled = placement_rows(1, 1);
        labelled.queued[0].agent_labels.insert("arch".into(), "mips".into());
        assert!(offers(&polling(&labelled, 8)).is_empty());
        labelled.session.as_mut().unwrap().labels.insert("arch".into(), "mips".into());
        assert_eq!(offers(&polling(&labelled, 8)).len(), 1);
        let mut draining = placement_rows(3, 2);
        draining.session.as_mut().unwrap().state = SessionState::Draining;
        assert!(offers(&polling(&draining, 8)).is_empty());
    }

    #[test]
    fn a_trusted_label_is_matched_only_by_the_operators_record_of_the_worker() {
        let trusted = |pairs: &[(&str, &str)]| crate::model::Worker {
            labels: pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            ..crate::model::Worker::new(worker(), NOW - 5)
        };
        let mut rows = placement_rows(1, 1);
        rows.queued[0].labels.insert("site".into(), "cluster-prod".into());
        // The agent declares it: not enough.
        rows.session.as_mut().unwrap().labels.insert("site".into(), "cluster-prod".into());
        assert!(offers(&polling(&rows, 8)).is_empty(), "a declared label is not trusted");
        // The operator's record of another worker: not this one's.
        rows.worker =
            Some(crate::model::Worker { id: "router-9".parse().unwrap(), ..trusted(&[("site", "cluster-prod")]) });
        assert!(offers(&polling(&rows, 8)).is_empty());
        rows.worker = Some(trusted(&[("site", "attic")]));
        assert!(offers(&polling(&rows, 8)).is_empty(), "another value");
        rows.worker = Some(trusted(&[("site", "cluster-prod"), ("tier", "x")]));
        assert_eq!(offers(&polling(&rows, 8)).len(), 1);
        // Both kinds at once: each from its own source.
        rows.queued[0].agent_labels.insert("arch".into(), "mips".into());
        assert!(offers(&polling(&rows, 8)).is_empty());
        rows.session.as_mut().unwrap().labels.insert("arch".into(), "mips".into());
        assert_eq!(offers(&polling(&rows, 8)).len(), 1);
    }

    #[test]
    fn poll_returns_open_offers_it_made_before() {
        let mut rows = placement_rows(0, 1);
        let open = world(AttemptStatus::Offered).offer.unwrap();
        rows.open_offers = vec![open.clone(), Offer { expires_at: NOW, ..open.clone() }];
        rows.active_attempts = 1;
        assert_eq!(offers(&polling(&rows, 8)), vec![wire_offer(&open)]);
    }

    #[test]
    fn poll_refuses_a_stale_or_foreign_session() {
        let rows = placement_rows(1, 1);
        let s = rows.session.as_ref().unwrap();
        let stale = PollOffers { generation: Counter::new(2).unwrap(), ..poll_body(1) };
        let d = decide(&Command::PollOffers(worker(), s.id.clone(), stale), &rows, NOW, &timings(), &mut ids());
        assert_eq!(d, Decision::refuse(ErrorCode::SessionConflict));
        let d = decide(
            &Command::PollOffers(other_worker(), s.id.clone(), poll_body(1)),
            &rows,
            NOW,
            &timings(),
            &mut ids(),
        );
        assert_eq!(d, Decision::refuse(ErrorCode::NotFound));
    }

    fn claim_body(tok: ql_wire::capability::Token) -> Claim {
        Claim {
            generation: Counter::ONE,
            run_id: "run_1".parse().unwrap(),
            attempt_id: "att_1".parse().unwrap(),
            lease_token: tok,
        }
    }

    fn claiming(rows: &Rows, body: Claim) -> Decision {
        let s = rows.session.as_ref().unwrap().id.clone();
        decide(&Command::Claim(worker(), s, "off_1".parse().unwrap(), body), rows, NOW, &timings(), &mut ids())
    }

    #[test]
    fn claim_issues_lease_version_one_and_an_exact_repeat_gets_the_same_answer() {
        let rows = world(AttemptStatus::Offered);
        let d = claiming(&rows, claim_body(lease_token()));
        let Ok(Reply::Claimed(c)) = &d.reply else { panic!("{d:?}") };
        assert_eq!((c.lease_generation.get(), c.lease_version.get(), c.lease_ttl_ms), (2, 1, 5_000));
        assert_eq!(c.spec, spec());
        let after = applied(&rows, &d);
        let (a, l, r) = (after.attempt.clone().unwrap(), after.lease.clone().unwrap(), after.run.clone().unwrap());
        assert_eq!(a.status, AttemptStatus::Claimed);
        assert_eq!(a.lease, Some(l.facts.clone()));
        assert_eq!(l.facts.token_digest, lease_token().digest());
        assert_eq!(r.deadline_at, Some(NOW + 60_000));
        assert_eq!(event_kinds(&d), ["attempt.claimed"]);
        assert_eq!(claiming(&after, claim_body(lease_token())), Decision::answer(Reply::Claimed(c.clone())));
        assert_eq!(claiming(&after, claim_body(token(5))), Decision::refuse(ErrorCode::OfferConflict));
    }

    #[test]
    fn claim_refusals() {
        let rows = world(AttemptStatus::Offered);
        let mut lapsed = rows.clone();
        lapsed.offer.as_mut().unwrap().expires_at = NOW;
        assert_eq!(claiming(&lapsed, claim_body(lease_token())), Decision::refuse(ErrorCode::OfferConflict));
        for state in [OfferState::Expired, OfferState::Withdrawn] {
            let mut gone = rows.clone();
            gone.offer.as_mut().unwrap().state = state;
            assert_eq!(claiming(&gone, claim_body(lease_token())), Decision::refuse(ErrorCode::OfferConflict));
        }
        let wrong_run = Claim { run_id: "run_2".parse().unwrap(), ..claim_body(lease_token()) };
        assert_eq!(claiming(&rows, wrong_run), Decision::refuse(ErrorCode::OfferConflict));
        let stale = Claim { generation: Counter::new(2).unwrap(), ..claim_body(lease_token()) };
        assert_eq!(claiming(&rows, stale), Decision::refuse(ErrorCode::SessionConflict));
        let mut elsewhere = rows.clone();
        elsewhere.offer.as_mut().unwrap().session = "ses_9".parse().unwrap();
        assert_eq!(claiming(&elsewhere, claim_body(lease_token())), Decision::refuse(ErrorCode::NotFound));
        let mut replaced = rows.clone();
        replaced.session.as_mut().unwrap().state = SessionState::Replaced;
        assert_eq!(claiming(&replaced, claim_body(lease_token())), Decision::refuse(ErrorCode::SessionConflict));
    }
}
