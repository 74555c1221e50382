//! The artifact route: framing, limits and fences refused before content is read, and
//! put-if-absent.

use super::*;

#[test]
fn artifact_framing_refusals_come_before_the_body() {
    let case = UploadCase::new("artifact-framing");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cap = Route::Artifact(case.job.path.clone(), log_id()).body_cap();
    let over = format!("content-length: {}", cap + 1);
    for (headers, code) in [
        (vec!["content-type: application/json", "content-length: 100"], ErrorCode::UnsupportedMediaType),
        (vec!["content-type: application/octet-stream", "content-length: 100"], ErrorCode::UnsupportedMediaType),
        (vec![&ct, "content-encoding: gzip", "content-length: 100"], ErrorCode::UnsupportedMediaType),
        (vec![&ct, "transfer-encoding: chunked"], ErrorCode::LengthRequired),
        (vec![&ct], ErrorCode::LengthRequired),
        (vec![&ct, &over], ErrorCode::PayloadTooLarge),
    ] {
        let response = case.put(&headers, b"");
        assert_eq!(response.error(), code, "{headers:?}");
        assert!(response.interim.is_empty(), "{headers:?}: refused before 100 Continue");
        assert!(response.closes());
    }
    case.assert_untouched();
}

#[test]
fn an_artifact_header_over_4096_bytes_is_refused() {
    let case = UploadCase::new("artifact-header");
    let mut body = 5000u32.to_be_bytes().to_vec();
    body.extend(std::iter::repeat_n(b' ', 5000));
    let response = case.put_frame(body.len(), &body);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    assert_eq!(response.interim, vec![100], "the header is in the body, so the body was asked for");
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn a_header_content_length_that_disagrees_with_the_body_is_refused() {
    let case = UploadCase::new("artifact-mismatch");
    let log = content(1000, 1);
    // The header promises more content than the body carries.
    let mut frame = encode_prefix(&case.job.header(1007)).unwrap().to_vec();
    frame.extend_from_slice(&log);
    let response = case.put_frame(frame.len(), &frame);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn a_body_longer_than_its_frame_is_refused() {
    let case = UploadCase::new("artifact-long");
    let mut frame = case.job.frame(&content(1000, 2));
    frame.extend_from_slice(b"trailing bytes the frame does not declare");
    let response = case.put_frame(frame.len(), &frame);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    case.assert_untouched();
}

#[test]
fn a_body_that_stops_short_is_refused_and_nothing_is_stored() {
    let case = UploadCase::new("artifact-short");
    let frame = case.job.frame(&content(100_000, 3));
    // Declares the whole frame, sends all but the last 10 bytes, then goes quiet: the
    // upload is admitted and started, and must be discarded.
    let response = case.put_frame(frame.len(), &frame[..frame.len() - 10]);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    assert_eq!(response.interim, vec![100]);
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn a_body_cut_off_by_the_client_stores_nothing() {
    let case = UploadCase::new("artifact-cut");
    let frame = case.job.frame(&content(100_000, 4));
    let mut raw = case.server.raw("router-1");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cl = format!("content-length: {}", frame.len());
    raw.head("PUT", &case.path(), &[&ct, &cl]).unwrap();
    raw.send(&frame[..frame.len() / 2]).unwrap();
    raw.tls.conn.send_close_notify();
    raw.tls.flush().unwrap();
    raw.tls.sock.shutdown(std::net::Shutdown::Write).unwrap();
    // Whatever the server manages to say, the connection ends and nothing is kept. (The
    // agent client's own connection is still open: only this one closes.)
    if let Ok(response) = raw.response() {
        assert_eq!(response.error(), ErrorCode::InvalidRequest);
    }
    case.server.wait_for("the connection to end", |st| st.closed() == 1);
    case.assert_untouched();
}

#[test]
fn an_upload_that_outlives_its_run_is_refused_at_its_end_and_not_stored() {
    let case = UploadCase::new("artifact-outlived");
    let frame = case.job.frame(&content(100_000, 4));
    let mut raw = case.server.raw("router-1");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cl = format!("content-length: {}", frame.len());
    raw.head("PUT", &case.path(), &[&ct, &cl]).unwrap();
    raw.send(&frame[..frame.len() / 2]).unwrap();
    // The upload was admitted and its content is arriving (the store holds it aside)...
    let dir = case.server.dir.path().join("artifacts").join("default").join(case.job.path.run.as_str());
    let dir = dir.join(case.job.path.attempt.as_str());
    let pending = || std::fs::read_dir(&dir).map_or(0, |d| d.filter_map(Result::ok).count());
    wait_until("the upload to be admitted", || pending() > 0);
    // ...when the run ends some other way.
    let done: CompletionReply =
        case.client.post(&case.job.route(AttemptCommand::Completion), &case.job.completion(0, None)).json(200);
    assert_eq!(done.status, TerminalStatus::Succeeded);
    raw.send(&frame[frame.len() / 2..]).unwrap();
    assert_eq!(raw.response().unwrap().error(), ErrorCode::AlreadyTerminal);
    assert_eq!(case.server.inspect(&case.job.key(&log_id())), None, "nothing stored");
    assert_eq!(pending(), 0, "the content held aside is gone");
}

#[test]
fn an_upload_slower_than_the_minimum_rate_is_cut_off_and_nothing_is_stored() {
    // A grace of 300 ms and 1 MiB/s: 100 KB may take 400 ms in all.
    let cfg = IngressConfig {
        upload_grace: Duration::from_millis(300),
        min_upload_rate: 1024 * 1024,
        body_idle_timeout: Duration::from_secs(5),
        ..test_config()
    };
    let server = Server::start_with("trickle", cfg);
    let client = server.client("router-1");
    let job = client.running_job(&server, Some(&log_id()));
    let before = server.snapshot();
    let frame = job.frame(&content(100_000, 4));
    let mut raw = server.raw("router-1");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cl = format!("content-length: {}", frame.len());
    raw.head("PUT", &job.artifact_route(&log_id()).path(), &[&ct, &cl]).unwrap();
    // A kilobyte every 20 ms (50 KB/s, each piece well within the idle timeout): the whole
    // body would take two seconds, five times its deadline. The pacing is the test's
    // slow client, not a wait for the server.
    for piece in frame.chunks(1024) {
        if raw.send(piece).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let answer = raw.response().unwrap();
    assert_eq!(answer.error(), ErrorCode::InvalidRequest, "cut off");
    assert!(answer.closes());
    assert_eq!(server.inspect(&job.key(&log_id())), None, "nothing stored");
    assert_eq!(server.snapshot(), before, "no row changed");
    // The same body at full speed goes through.
    let stored: ArtifactReply = client.put_artifact(&job.artifact_route(&log_id()), &frame).json(200);
    assert_eq!(stored.result, Outcome::Stored);
}

#[test]
fn a_request_head_over_the_cap_is_refused_with_431() {
    let server = Server::start("head-cap");
    let mut raw = server.raw("router-1");
    let long = format!("x-padding: {}", "a".repeat(20 * 1024));
    raw.head("POST", "/v1/workers/router-1/sessions", &[&long, "content-length: 0"]).unwrap();
    assert_eq!(raw.response().unwrap().status, 431);
    assert_eq!(server.snapshot(), Snapshot::default(), "nothing was read as a request");
}

#[test]
fn connections_from_one_address_without_a_certificate_cannot_crowd_out_workers() {
    let cfg = IngressConfig { max_connections: 8, max_handshakes: 16, max_handshakes_per_ip: 4, ..test_config() };
    let server = Server::start_with("crowd", cfg);
    // Fifty plain TCP connections from another loopback address, holding their
    // handshakes open and sending nothing.
    let addr = server.addr;
    let crowd: Vec<tokio::net::TcpStream> = server.rt.block_on(async {
        let mut all = Vec::new();
        for _ in 0..50 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            all.push(socket.connect(addr).await.unwrap());
        }
        all
    });
    server.wait_for("the crowd beyond four to be turned away", |st| st.turned_away() >= 46);
    // A worker still gets in, and is served.
    let client = server.client("router-1");
    let (_, generation) = client.open(1);
    assert_eq!(generation, Counter::ONE);
    drop(crowd);
}

/// Every handshake place taken by connections from one address that never finish
/// theirs: a worker from another address still gets in, its handshake closing that
/// address's oldest, and is served.
#[test]
fn an_address_that_takes_every_handshake_place_cannot_keep_a_worker_out() {
    let cfg = IngressConfig {
        max_connections: 8,
        max_handshakes: 4,
        max_handshakes_per_ip: 4,
        // The crowd's handshakes must not time out and free their places meanwhile.
        handshake_timeout: Duration::from_secs(600),
        ..test_config()
    };
    let server = Server::start_with("handshake-share", cfg);
    let addr = server.addr;
    // Five from 127.0.0.2, holding their handshakes open: four take every place, the
    // fifth is turned away at the address's own cap, which shows the four are held.
    let crowd: Vec<tokio::net::TcpStream> = server.rt.block_on(async {
        let mut all = Vec::new();
        for _ in 0..5 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            all.push(socket.connect(addr).await.unwrap());
        }
        all
    });
    server.wait_for("the fifth to be turned away", |st| st.turned_away() == 1);
    // A worker from 127.0.0.1 gets in, and is served.
    let client = server.client("router-1");
    let (_, generation) = client.open(1);
    assert_eq!(generation, Counter::ONE);
    server.wait_for("the crowd's oldest handshake to have been closed for it", |st| st.turned_away() == 2);
    drop(crowd);
}

#[test]
fn one_worker_cannot_hold_more_than_its_share_of_connections() {
    let cfg = IngressConfig { max_connections: 6, max_connections_per_worker: 2, ..test_config() };
    let server = Server::start_with("share", cfg);
    // router-1 opens six connections; each beyond two closes its oldest.
    let mut held: Vec<Raw> = (0..6).map(|_| server.raw("router-1")).collect();
    server.wait_for("router-1's oldest connections to be closed", |st| st.evicted() == 4);
    // router-2 still gets in (two slots of six are router-1's), and so does router-1's
    // newest connection.
    let other = server.client("router-2");
    assert_eq!(other.open(1).1, Counter::ONE);
    let newest = held.last_mut().unwrap();
    newest.head("POST", "/v1/workers/router-1/sessions", &["content-length: 0"]).unwrap();
    assert_eq!(newest.response().unwrap().status, 415, "served (and refused for its framing)");
    assert!(held[0].ended(), "the oldest was closed");
}

#[test]
fn a_connection_never_served_cannot_crowd_out_a_served_one_of_its_worker() {
    let cfg = IngressConfig { max_connections: 8, max_connections_per_worker: 2, ..test_config() };
    let server = Server::start_with("share-served", cfg);
    // A request that is no worker route and keeps the connection: answered, a connection
    // is held by the server before the next one comes, and it stays never admitted.
    let answered = |raw: &mut Raw| {
        raw.head("GET", "/v1/ca", &[]).unwrap();
        assert_eq!(raw.response().unwrap().status, 200, "answered");
    };
    let connect = |creds: &Creds| {
        let config = client_config(&server.ca_pem(), Some(creds), &[&rustls::version::TLS13]);
        Raw::connect(server.addr, config).unwrap()
    };
    // A second certificate of the worker whose worker requests would all be refused (a
    // copy of one revoked since) takes the worker's whole share first.
    let copy = server.second_certificate("router-1", "copy");
    let mut copies: Vec<Raw> = (0..2).map(|_| connect(&copy)).collect();
    copies.iter_mut().for_each(answered);
    // The agent still gets in (closing the copy's oldest), and is served.
    let agent = server.enroll("router-1");
    let mut live = connect(&agent);
    let body = serde_json::to_vec(&OpenSession {
        agent_version: "0.1.0".parse().unwrap(),
        arch: "x86_64".parse().unwrap(),
        labels: Default::default(),
        capacity: 1,
    })
    .unwrap();
    let length = format!("content-length: {}", body.len());
    live.head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", &length]).unwrap();
    live.send(&body).unwrap();
    assert_eq!(live.response().unwrap().status, 201, "the session opened");
    assert!(copies[0].ended(), "the copy's oldest was closed");
    // The copy connects again and again: each closes one of its own, never the agent's.
    for _ in 0..3 {
        let mut raw = connect(&copy);
        answered(&mut raw);
        copies.push(raw);
    }
    server.wait_for("the copy's older connections to be closed", |st| st.evicted() == 4);
    answered(&mut live);
    assert!(copies[..4].iter_mut().all(Raw::ended), "the copy's older connections are closed");
    answered(copies.last_mut().unwrap());
    // The agent's reconnect closes its own older connection (a half-open one, say).
    let mut again = connect(&agent);
    answered(&mut again);
    server.wait_for("the agent's older connection to be closed", |st| st.evicted() == 5);
    assert!(live.ended(), "the agent's older connection was closed");
    answered(copies.last_mut().unwrap());
}

/// The agent's fresh connection whose first request has not been answered yet (its first
/// long-poll lasts 25 s) is never served as far as the ingress knows: a copy of a revoked
/// certificate connecting again and again meanwhile closes its own connections, not it.
#[test]
fn a_copy_of_a_revoked_certificate_cannot_close_the_agents_connection_before_its_first_answer() {
    let cfg = IngressConfig { max_connections: 8, max_connections_per_worker: 2, ..test_config() };
    let server = Server::start_with("share-fresh", cfg);
    let connect = |creds: &Creds| {
        let config = client_config(&server.ca_pem(), Some(creds), &[&rustls::version::TLS13]);
        Raw::connect(server.addr, config).unwrap()
    };
    let answered = |raw: &mut Raw| {
        raw.head("GET", "/v1/ca", &[]).unwrap();
        assert_eq!(raw.response().unwrap().status, 200, "answered");
    };
    let agent = server.enroll("router-1");
    let copy = server.second_certificate("router-1", "copy");
    // The agent's connection, held by the server (a request that is no worker route was
    // answered on it), none of its worker requests answered yet.
    let mut live = connect(&agent);
    answered(&mut live);
    let mut copies = Vec::new();
    for _ in 0..4 {
        let mut raw = connect(&copy);
        answered(&mut raw);
        copies.push(raw);
    }
    server.wait_for("the copy's older connections to be closed", |st| st.evicted() == 3);
    assert!(copies[..3].iter_mut().all(Raw::ended), "the copy's older connections are closed");
    // The agent's connection stays: answered again.
    answered(&mut live);
}

#[test]
fn fence_drift_refuses_the_upload_without_reading_content() {
    let mut case = UploadCase::new("artifact-fence");
    // The lease moves on (renewal), the upload still speaks for version 1.
    let stale = case.job.fence.clone();
    case.client.renew(&mut case.job);
    case.before = case.server.snapshot();
    let header = ArtifactHeader::new(stale, ArtifactSchema, 1_000_000, false);
    let prefix = encode_prefix(&header).unwrap();
    let declared = prefix.len() + 1_000_000;
    // Only the prefix is sent: the refusal must not wait for content.
    let response = case.put_frame(declared, &prefix);
    assert_eq!(response.error(), ErrorCode::LeaseConflict);
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn the_agent_reads_a_fence_refusal_even_mid_upload() {
    // ureq writes the whole body before it reads: after `100 Continue` the server refuses
    // on the header and stops reading, and only the lingering close lets the 409 arrive
    // instead of a reset.
    let mut case = UploadCase::new("artifact-linger");
    let stale_job =
        Job { path: case.job.path.clone(), fence: case.job.fence.clone(), callback: case.job.callback.clone() };
    case.client.renew(&mut case.job);
    case.before = case.server.snapshot();
    let answer = case.client.put_artifact(&stale_job.artifact_route(&log_id()), &stale_job.frame(&content(8 << 20, 9)));
    assert_eq!(answer.error(), ErrorCode::LeaseConflict);
    case.assert_untouched();
}

#[test]
fn the_agent_learns_of_a_refusal_before_sending_its_upload() {
    let case = UploadCase::new("artifact-expect");
    let intruder = case.server.client("router-2");
    let answer = intruder.put_artifact(&case.job.artifact_route(&log_id()), &case.job.frame(&content(8 << 20, 10)));
    assert_eq!(answer.error(), ErrorCode::PrincipalMismatch);
    case.assert_untouched();
}

#[test]
fn an_upload_for_an_unknown_attempt_is_refused() {
    let case = UploadCase::new("artifact-unknown");
    let mut path = case.job.path.clone();
    path.attempt = ql_wire::ids::AttemptId::parse("att_nope").unwrap();
    let route = Route::Artifact(path, log_id());
    let answer = case.client.put_artifact(&route, &case.job.frame(b"hello"));
    assert_eq!(answer.status, 404);
    case.assert_untouched();
}

#[test]
fn a_replayed_artifact_is_already_stored_and_other_content_conflicts() {
    let case = UploadCase::new("artifact-replay");
    let route = case.job.artifact_route(&log_id());
    let log = content(50_000, 5);
    let first: ArtifactReply = case.client.put_artifact(&route, &case.job.frame(&log)).json(200);
    assert_eq!(first.result, Outcome::Stored);
    // The one row an upload writes: its receipt, claimed for the attempt.
    let claimed = case.server.snapshot();
    assert_eq!(claimed.attempts[0].claimed_artifact.as_ref(), Some(&first.receipt));
    let again: ArtifactReply = case.client.put_artifact(&route, &case.job.frame(&log)).json(200);
    assert_eq!(again.result, Outcome::AlreadyStored);
    assert_eq!(again.receipt, first.receipt);
    let other = case.client.put_artifact(&route, &case.job.frame(&content(50_000, 6)));
    assert_eq!(other.error(), ErrorCode::ArtifactConflict);
    assert_eq!(case.server.inspect(&case.job.key(&log_id())), Some(first.receipt));
    assert_eq!(case.server.snapshot(), claimed, "a replay and a conflict write nothing");
    // All three read their bodies to the end: one connection.
    assert_eq!(case.server.stats().connections(), 1);
}
