//! The happy path over one keep-alive connection, and the long-poll.

use super::*;

#[test]
fn every_route_succeeds_over_one_keep_alive_connection() {
    let server = Server::start("happy");
    let client = server.client("router-1");
    server.submit();
    server.submit();
    server.submit();

    // Sessions.
    let (session, generation) = client.open(3);
    let hb: HeartbeatReply = client
        .post(&Route::Heartbeat(wid("router-1"), session.clone()), &Heartbeat { generation, draining: false })
        .json(200);
    assert_eq!(hb.status, SessionStatus::Online);

    // Delivery.
    let offers = client.poll(&session, generation, 0, 3);
    assert_eq!(offers.offers.len(), 3);
    let mut job = client.claim(&session, generation, &offers.offers[0]);
    let failing = client.claim(&session, generation, &offers.offers[1]);
    let framed = client.claim(&session, generation, &offers.offers[2]);

    // Start ACKs, renewal.
    assert_eq!(client.starting(&job).result, Outcome::Started);
    assert_eq!(client.running(&job, Some(&log_id())).result, Outcome::Running);
    let renewed = client.renew(&mut job);
    assert_eq!(renewed.lease_version.get(), 2);
    assert_eq!(renewed.stop, None);

    // The live log: two chunks, then the seal makes them the artifact.
    let (first, second) = (content(256 * 1024, 7), content(1000, 8));
    let reply: LogAppendReply = client.append(&job, 0, &first).json(200);
    assert_eq!((reply.result, reply.acked), (Outcome::Appended, first.len() as u64));
    let acked: LogAppendReply = client.append(&job, first.len() as u64, &second).json(200);
    let sealed: ArtifactReply = client.seal(&job, acked.acked).json(200);
    assert_eq!(sealed.result, Outcome::Stored);
    assert_eq!(sealed.receipt.sha256, Digest::of(&[first.as_slice(), &second].concat()));
    assert_eq!(server.inspect(&job.key(&log_id())), Some(sealed.receipt.clone()));

    // Completion, with the receipt re-inspected by the server.
    let done: CompletionReply =
        client.post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(sealed.receipt))).json(200);
    assert_eq!((done.result, done.status), (Outcome::Completed, TerminalStatus::Succeeded));

    // A job that ends before its `running` ACK: its log in one frame, streamed with
    // `Expect: 100-continue`, 1 MiB, then the completion from `starting`.
    assert_eq!(client.starting(&framed).result, Outcome::Started);
    let blob = content(1024 * 1024, 9);
    let stored: ArtifactReply = client.put_artifact(&framed.artifact_route(&log_id()), &framed.frame(&blob)).json(200);
    assert_eq!(stored.result, Outcome::Stored);
    assert_eq!(stored.receipt.length, blob.len() as u64);
    assert_eq!(stored.receipt.sha256, Digest::of(&blob));
    assert_eq!(server.inspect(&framed.key(&log_id())), Some(stored.receipt.clone()));
    let done: CompletionReply =
        client.post(&framed.route(AttemptCommand::Completion), &framed.completion(0, Some(stored.receipt))).json(200);
    assert_eq!((done.result, done.status), (Outcome::Completed, TerminalStatus::Succeeded));

    // start-failure on the second attempt.
    assert_eq!(client.starting(&failing).result, Outcome::Started);
    let body = StartFailure::new(failing.fence.clone(), Reason::parse("spawn failed").unwrap());
    let failed: AckReply = client.post(&failing.route(AttemptCommand::StartFailure), &body).json(200);
    assert_eq!(failed.result, Outcome::Failed);

    // A job lost with its supervisor: abandoned, its run queued again.
    let lost_run = server.submit();
    let offers = client.poll(&session, generation, 0, 1);
    let lost = client.claim(&session, generation, &offers.offers[0]);
    assert_eq!(lost.path.run, lost_run);
    assert_eq!(client.starting(&lost).result, Outcome::Started);
    let body = Abandon::new(lost.fence.clone(), Reason::parse("gone").unwrap());
    let abandoned: AckReply = client.post(&lost.route(AttemptCommand::Abandon), &body).json(200);
    assert_eq!(abandoned.result, Outcome::Abandoned);

    // The clean exit: the session closes, once.
    let close = ql_wire::session::CloseSession { generation };
    let closed: ql_wire::session::SessionClosed =
        client.post(&Route::CloseSession(wid("router-1"), session.clone()), &close).json(200);
    assert_eq!(closed.result, Outcome::Closed);

    // Fourteen routes, twenty-three requests, one TCP connection.
    assert_eq!(server.stats().requests(), 23);
    assert_eq!(server.stats().connections(), 1, "the agent's one keep-alive connection served everything");
    assert_eq!(server.stats().handshake_failures(), 0);

    let admitted: Vec<String> =
        server.audits().into_iter().filter(|a| a.outcome == "admitted").map(|a| a.route).collect();
    for route in ql_wire::route::Route::NAMES {
        assert!(admitted.iter().any(|r| r == route), "{route} audited as admitted: {admitted:?}");
    }
    assert!(server.audits().iter().all(|a| a.principal == Some(wid("router-1"))));
}

#[test]
fn refusals_after_the_body_keep_the_connection() {
    let server = Server::start("keep");
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let route = Route::Heartbeat(wid("router-1"), session.clone());

    // Unknown field: 400, body read, connection kept.
    let answer = client.post_bytes(&route, br#"{"generation":1,"draining":false,"extra":1}"#);
    assert_eq!(answer.error(), ErrorCode::InvalidRequest);
    // Not JSON at all.
    assert_eq!(client.post_bytes(&route, b"not json").error(), ErrorCode::InvalidRequest);
    // A conflict from the store: a generation that is not the session's.
    let stale = Counter::new(generation.get() + 5).unwrap();
    let answer = client.post(&route, &Heartbeat { generation: stale, draining: false });
    assert_eq!(answer.status, 409);
    // And the session still answers.
    let hb: HeartbeatReply = client.post(&route, &Heartbeat { generation, draining: true }).json(200);
    assert_eq!(hb.status, SessionStatus::Draining);
    assert_eq!(server.stats().connections(), 1);
}

// ---------------------------------------------------------------------------------------
// Long-poll.

#[test]
fn an_empty_poll_waits_for_its_deadline() {
    let server = Server::start("poll-empty");
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let started = Instant::now();
    let offers = client.poll(&session, generation, 300, 1);
    assert!(offers.offers.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(300), "answered after {:?}", started.elapsed());
}

#[test]
fn a_waiting_poll_wakes_when_work_arrives() {
    let server = Server::start("poll-wake");
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let before = server.stats().requests();
    let offers = std::thread::scope(|s| {
        let waiting = s.spawn(|| client.poll(&session, generation, 10_000, 1));
        server.wait_for("the poll to arrive", |st| st.requests() > before);
        server.submit();
        waiting.join().unwrap()
    });
    // Woken, not timed out: at its deadline a poll answers what it began with (nothing).
    assert_eq!(offers.offers.len(), 1);
}

#[test]
fn the_server_caps_a_polls_wait() {
    let cfg = IngressConfig { max_poll_wait: Duration::from_millis(200), ..test_config() };
    let server = Server::start_with("poll-cap", cfg);
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    // Uncapped, the poll would outlast the client's patience (20 s) and fail.
    const _: () = assert!(PATIENCE.as_millis() < 30_000);
    assert!(client.poll(&session, generation, 30_000, 1).offers.is_empty());
}
