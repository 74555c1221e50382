//! Audit, timeouts, shutdown, labels and revocation on open connections.

use super::*;

// ---------------------------------------------------------------------------------------
// Audit.

#[test]
fn admissions_and_refusals_are_audited() {
    let server = Server::start("audit");
    let client = server.client("router-1");
    client.open(1);
    let mut raw = server.raw("router-2");
    raw.head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", "content-length: 2"])
        .unwrap();
    assert_eq!(raw.response().unwrap().error(), ErrorCode::PrincipalMismatch);
    // Admitted, then refused by the store: a heartbeat of a session that does not exist.
    let missing = SessionId::parse("ses_missing").unwrap();
    let hb = Heartbeat { generation: Counter::ONE, draining: false };
    assert_eq!(client.post(&Route::Heartbeat(wid("router-1"), missing), &hb).error(), ErrorCode::NotFound);
    let audits = server.audits();
    let found = |principal: &str, route: &str, outcome: &str| {
        audits.iter().any(|a| a.principal == Some(wid(principal)) && a.route == route && a.outcome == outcome)
    };
    assert!(found("router-1", "session.open", "admitted"));
    assert!(found("router-2", "session.open", "principal_mismatch"));
    let heartbeats: Vec<&str> =
        audits.iter().filter(|a| a.route == "session.heartbeat").map(|a| a.outcome.as_str()).collect();
    assert_eq!(heartbeats, ["admitted", "not_found"], "the outcome follows the admission");
    assert!(audits.iter().all(|a| a.at > 0), "DB time is filled in");
}

// ---------------------------------------------------------------------------------------
// Lifecycle.

#[test]
fn shutdown_closes_idle_connections_and_stops_accepting() {
    let mut server = Server::start("shutdown");
    let client = server.client("router-1");
    client.open(1);
    let ingress = server.ingress.take().unwrap();
    server.rt.block_on(ingress.shutdown()).unwrap();
    assert!(TcpStream::connect(server.addr).is_err(), "the listener is gone");
}

#[test]
fn a_stalled_handshake_times_out() {
    let cfg = IngressConfig { handshake_timeout: Duration::from_millis(200), ..test_config() };
    let server = Server::start_with("handshake", cfg);
    let _silent = TcpStream::connect(server.addr).unwrap();
    server.wait_for("the handshake to time out", |st| st.handshake_failures() == 1);
}

#[test]
fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let cfg = IngressConfig { idle_timeout: Duration::from_millis(300), ..test_config() };
    let server = Server::start_with("idle", cfg);
    let mut raw = server.raw("router-1");
    assert!(raw.ended(), "the server closed the idle connection");
    server.wait_for("the connection to close", |st| st.closed() == 1 && st.timed_out() == 1);
    assert_eq!(server.stats().requests(), 0);
}

#[test]
fn a_trickled_head_is_cut_off_at_the_header_timeout_however_its_bytes_keep_coming() {
    // The idle timeout is long; the head's clock starts at its first byte.
    let cfg = IngressConfig { header_read_timeout: Duration::from_millis(400), ..test_config() };
    let server = Server::start_with("trickle-head", cfg);
    let honest = server.client("router-2");
    let (session, generation) = honest.open(1);
    let before = server.snapshot();
    let mut raw = server.raw("router-1");
    // A head of 4,000 bytes, one every 10 ms, would take 40 s (each byte well within
    // any idle timeout). The pacing is the test's slow client, not a wait for the server.
    let head = format!("POST /v1/workers/router-1/sessions HTTP/1.1\r\nx-pad: {}", "a".repeat(4_000));
    let mut sent = 0;
    for byte in head.as_bytes() {
        if server.stats().timed_out() == 1 || raw.send(std::slice::from_ref(byte)).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(10));
        // An honest worker is served meanwhile.
        if sent == 20 {
            assert!(honest.poll(&session, generation, 0, 1).offers.is_empty());
        }
    }
    assert!(sent < head.len(), "cut off before the head was complete");
    server.wait_for("the trickled connection to be closed", |st| st.timed_out() == 1);
    assert!(raw.ended());
    assert_eq!(server.stats().requests(), 2, "the honest open and poll were the only requests");
    let after = server.snapshot();
    assert_eq!(after.events, before.events, "nothing of the trickle reached the store");
}

#[test]
fn a_long_poll_is_not_idle() {
    // The poll waits a second, three times the idle timeout, on its one connection.
    let cfg = IngressConfig {
        idle_timeout: Duration::from_millis(300),
        max_poll_wait: Duration::from_secs(1),
        ..test_config()
    };
    let server = Server::start_with("poll-idle", cfg);
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    assert!(client.poll(&session, generation, 1_000, 1).offers.is_empty());
    assert_eq!(server.stats().timed_out(), 0, "the poll's connection was not cut");
    assert_eq!(server.stats().connections(), 1, "one connection carried both requests");
}

#[test]
fn a_worker_declaring_a_label_the_operator_did_not_give_it_is_not_offered_the_run() {
    let server = Server::start("trusted-labels");
    let prod = || BTreeMap::from([("site".to_owned(), "cluster-prod".to_owned())]);
    let run = server.submit_for(prod());
    // router-1 holds a valid certificate and declares the label.
    let liar = server.client("router-1");
    let (session, generation) = liar.open_declaring(1, &[("site", "cluster-prod")]);
    let before = server.snapshot();
    assert!(liar.poll(&session, generation, 0, 1).offers.is_empty());
    let after = server.snapshot();
    assert_eq!((&after.runs, &after.offers, &after.events), (&before.runs, &before.offers, &before.events));
    // The operator gives the label to router-2, which declares nothing.
    let labelled = server.rt.block_on(server.store.execute(Command::LabelWorker(wid("router-2"), prod()))).unwrap();
    assert!(matches!(labelled, Ok(Reply::WorkerLabelled(_))));
    let node = server.client("router-2");
    let (session, generation) = node.open(1);
    let offers = node.poll(&session, generation, 0, 1).offers;
    assert_eq!(offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), vec![&run]);
}

#[test]
fn a_body_naming_a_worker_is_refused() {
    // Bodies never carry a worker identity: a body naming one is an unknown field.
    let server = Server::start("identity");
    let client = server.client("router-1");
    let answer = client.post_bytes(
        &Route::OpenSession(wid("router-1")),
        br#"{"agentVersion":"0.1.0","arch":"x86_64","labels":{},"capacity":1,"workerId":"router-2"}"#,
    );
    assert_eq!(answer.error(), ErrorCode::InvalidRequest);
    assert!(server.snapshot().sessions.is_empty());
}

#[test]
fn a_revoked_worker_is_refused_on_its_open_connection_and_another_finishes_its_run() {
    use ql_control::core::{Access, WORKER_REVOKED};
    use ql_control::model::{AttemptStatus, RunStatus};
    let server = Server::start("revoke");
    server.submit_with(BTreeMap::new(), 1);
    let w1 = server.client("router-1");
    let (session, generation) = w1.open(1);
    let offers = w1.poll(&session, generation, 0, 1).offers;
    let mut job = w1.claim(&session, generation, &offers[0]);
    assert_eq!(w1.starting(&job).result, Outcome::Started);
    assert_eq!(w1.running(&job, None).result, Outcome::Running);
    w1.renew(&mut job);
    let connections = server.stats().connections();
    let before = server.snapshot();

    let revoked = server.rt.block_on(server.store.execute(Command::SetAccess(wid("router-1"), Access::Revoke)));
    assert!(matches!(revoked, Ok(Ok(Reply::AccessChanged(c))) if c.sessions == 1 && c.attempts == 1));
    let after_revoke = server.snapshot();
    // The next request on the connection opened before is refused: its body, sent with
    // its head, is used for nothing, and the connection ends.
    let answer = w1.post(&job.route(AttemptCommand::RenewLease), &job.fence);
    assert_eq!(answer.error(), ErrorCode::CertificateRevoked);
    assert_eq!(server.stats().connections(), connections, "refused on the connection it already had");
    assert_eq!(server.audits().last().map(|a| a.outcome.as_str()), Some("certificate_revoked"));
    let refused = server.snapshot();
    assert_eq!(
        (&refused.runs, &refused.leases, &refused.events),
        (&after_revoke.runs, &after_revoke.leases, &after_revoke.events)
    );
    // A new connection of the same certificate fares no better.
    let body = OpenSession {
        agent_version: "0.1.0".parse().unwrap(),
        arch: "x86_64".parse().unwrap(),
        labels: BTreeMap::new(),
        capacity: 1,
    };
    let again = server.client("router-1").post(&Route::OpenSession(wid("router-1")), &body);
    assert_eq!(again.error(), ErrorCode::CertificateRevoked);
    // One that waits to be asked for its body is refused before it is asked.
    let mut raw = server.raw("router-1");
    let head = ["content-type: application/json", "content-length: 2", "expect: 100-continue"];
    raw.head("POST", &Route::OpenSession(wid("router-1")).path(), &head).unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.error(), ErrorCode::CertificateRevoked);
    assert!(response.interim.is_empty(), "refused before 100 Continue");
    assert!(response.closes());
    assert_eq!(server.snapshot().sessions, refused.sessions, "no session opened");

    let lost = &after_revoke.attempts[0];
    assert_eq!((lost.status, lost.error_code.as_deref()), (AttemptStatus::Lost, Some(WORKER_REVOKED)));
    assert_eq!(after_revoke.runs[0].status, RunStatus::Queued);
    assert_ne!(before.runs[0].status, RunStatus::Queued);

    // Another worker takes the run again and finishes it.
    let w2 = server.client("router-2");
    let (session, generation) = w2.open(1);
    let offers = w2.poll(&session, generation, 0, 1).offers;
    assert_eq!(offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), vec![&job.path.run]);
    let job2 = w2.claim(&session, generation, &offers[0]);
    assert_eq!(w2.starting(&job2).result, Outcome::Started);
    let done: CompletionReply = w2.post(&job2.route(AttemptCommand::Completion), &job2.completion(0, None)).json(200);
    assert_eq!(done.result, Outcome::Completed);
    let end = server.snapshot();
    assert_eq!(end.runs[0].status, RunStatus::Succeeded);
}

/// The workers' list pages through every worker the store knows, by id, each with its
/// newest session and its own standing: a disabled worker's row says so, with its trusted
/// labels, wherever its record falls among the others.
#[test]
fn the_workers_list_pages_by_id_and_gives_each_worker_its_own_standing() {
    use ql_control::core::Access;
    let server = Server::start("workers-list");
    let w1 = server.client("router-1");
    w1.open(1);
    let ops = ql_control::ops::Local { store: server.store.clone(), blobs: server.blobs.clone() };
    for w in ["a-0", "a-1", "a-2", "router-1"] {
        let labelled = server.rt.block_on(ops.label(&wid(w), &["site=attic".to_owned()]));
        assert!(labelled.is_ok(), "{labelled:?}");
    }
    let disabled = server.rt.block_on(server.store.execute(Command::SetAccess(wid("router-1"), Access::Disable)));
    assert!(matches!(disabled, Ok(Ok(Reply::AccessChanged(_)))), "{disabled:?}");
    let page = |after: Option<&str>| server.rt.block_on(ops.workers(2, after)).unwrap();
    let rows = |list: &ql_control::ops::view::WorkerList| -> Vec<(String, Option<u64>, String)> {
        list.workers.iter().map(|r| (r.worker.clone(), r.generation, r.access.clone())).collect()
    };
    let first = page(None);
    assert_eq!(rows(&first), [("a-0".into(), None, "active".into()), ("a-1".into(), None, "active".into())]);
    assert_eq!(first.next.as_deref(), Some("a-1"));
    let second = page(first.next.as_deref());
    assert_eq!(rows(&second), [("a-2".into(), None, "active".into()), ("router-1".into(), Some(1), "disabled".into())]);
    assert_eq!(second.workers[1].labels.get("site").map(String::as_str), Some("attic"));
    assert_eq!(second.workers[1].status.as_deref(), Some("closed"), "its newest session, closed by the disable");
    let last = page(second.next.as_deref());
    assert!(last.workers.is_empty() && last.next.is_none(), "{last:?}");
    let bad = server.rt.block_on(ops.workers(2, Some("Not A Worker")));
    assert!(bad.is_err(), "{bad:?}");
}
