//! Enrolment with a one-time token, renewal over the worker's own certificate, and the
//! connection caps.

use super::*;

/// A PKCS#10 request for a fresh P-256 key whose subject's common name is `cn`.
fn csr(cn: &str) -> (rcgen::KeyPair, Vec<u8>) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(rcgen::DnType::CommonName, cn);
    let der = params.serialize_request(&key).unwrap().der().to_vec();
    (key, der)
}

impl Server {
    fn token(&self, worker: &str, ttl_ms: u64) -> Token {
        let token = Token::generate().unwrap();
        let cmd = Command::CreateEnrolment(wid(worker), token.digest(), ttl_ms);
        assert!(self.rt.block_on(self.store.execute(cmd)).unwrap().is_ok());
        token
    }

    /// POSTs `body` on a connection without a client certificate.
    fn anonymous_post(&self, path: &str, body: &[u8]) -> RawResponse {
        let mut raw = Raw::connect(self.addr, client_config(&self.ca_pem(), None, &[&rustls::version::TLS13])).unwrap();
        let length = format!("content-length: {}", body.len());
        raw.head("POST", path, &["content-type: application/json", &length]).unwrap();
        raw.send(body).unwrap();
        raw.response().unwrap()
    }

    fn enrol(&self, worker: &str, token: &Token, csr: &[u8]) -> RawResponse {
        let body = ql_wire::enrol::Enrol {
            token: token.clone(),
            csr: ql_wire::enrol::CertificateRequest::new(csr.to_vec()).unwrap(),
        };
        self.anonymous_post(&format!("/v1/workers/{worker}/certificate:enrol"), &ql_wire::encode(&body))
    }
}

/// A client whose credentials are `issued` for `key`.
fn issued_client(server: &Server, worker: &str, issued: &ql_wire::enrol::Issued, key: &rcgen::KeyPair) -> Client {
    let creds = Creds {
        ca: server.ca_pem(),
        cert: issued.certificate.as_str().as_bytes().to_vec(),
        key: key.serialize_pem().into_bytes(),
    };
    Client::new(server.addr, &creds, wid(worker))
}

#[test]
fn a_token_enrols_its_worker_once_and_every_other_use_stores_nothing() {
    let server = Server::start("enrol");
    let token = server.token("router-1", 600_000);
    let (key, request) = csr("router-1");
    let response = server.enrol("router-1", &token, &request);
    assert_eq!(response.status, 201, "{}", String::from_utf8_lossy(&response.body));
    let issued: ql_wire::enrol::Issued = ql_wire::decode(&response.body).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(issued.certificate.as_str().as_bytes()).unwrap();
    assert_eq!(http::tls::principal(&[pem.contents.clone().into()]), Ok(wid("router-1")));
    let snap = server.snapshot();
    assert_eq!(snap.certificates.len(), 1);
    assert_eq!(snap.certificates[0].serial, http::tls::serial(&[pem.contents.into()]));
    assert_eq!(snap.certificates[0].not_after, issued.not_after.millis());
    // The certificate works for its worker at once.
    let (_, generation) = issued_client(&server, "router-1", &issued, &key).open(1);
    assert_eq!(generation, Counter::ONE);

    let before = server.snapshot();
    let (_, again) = csr("router-1");
    assert_eq!(server.enrol("router-1", &token, &again).error(), ErrorCode::EnrolmentRefused, "a reused token");
    let other = server.token("router-2", 600_000);
    assert_eq!(server.enrol("router-1", &other, &again).error(), ErrorCode::EnrolmentRefused, "another worker's token");
    let (_, for_other) = csr("router-3");
    let third = server.token("router-1", 600_000);
    assert_eq!(
        server.enrol("router-1", &third, &for_other).error(),
        ErrorCode::InvalidRequest,
        "a CSR for another worker id"
    );
    assert_eq!(
        server.enrol("router-1", &third, b"\x30\x03\x02\x01\x00").error(),
        ErrorCode::InvalidRequest,
        "not a CSR"
    );
    let expired = server.token("router-1", 0);
    assert_eq!(server.enrol("router-1", &expired, &again).error(), ErrorCode::EnrolmentRefused, "an expired token");
    let after = server.snapshot();
    assert_eq!((&after.certificates, &after.sessions), (&before.certificates, &before.sessions), "nothing stored");
    // The token the CSR mismatch left unspent still works.
    assert_eq!(server.enrol("router-1", &third, &again).status, 201);
}

#[test]
fn a_worker_renews_over_its_own_certificate_and_the_old_one_can_then_be_revoked() {
    let server = Server::start("renew");
    let token = server.token("router-1", 600_000);
    let (key, request) = csr("router-1");
    let first: ql_wire::enrol::Issued = ql_wire::decode(&server.enrol("router-1", &token, &request).body).unwrap();
    let old = issued_client(&server, "router-1", &first, &key);
    let (new_key, request) = csr("router-1");
    let body = ql_wire::enrol::Renew { csr: ql_wire::enrol::CertificateRequest::new(request).unwrap() };
    let renew = format!("{}/v1/workers/router-1/certificate:renew", old.base);
    let mut response =
        old.agent.post(&renew).header("content-type", JSON_MEDIA_TYPE).send(&ql_wire::encode(&body)[..]).unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let second: ql_wire::enrol::Issued = ql_wire::decode(&response.body_mut().read_to_vec().unwrap()).unwrap();
    assert_eq!(server.snapshot().certificates.len(), 2);
    // Renewed, the worker is not renewed again within the interval, by either certificate.
    let renewed = issued_client(&server, "router-1", &second, &new_key);
    for client in [&renewed, &old] {
        let url = format!("{}/v1/workers/router-1/certificate:renew", client.base);
        let response =
            client.agent.post(&url).header("content-type", JSON_MEDIA_TYPE).send(&ql_wire::encode(&body)[..]);
        assert_eq!(response.unwrap().status().as_u16(), 409, "a second renewal at once: state_conflict");
    }
    assert_eq!(server.snapshot().certificates.len(), 2, "nothing recorded for them");

    let old_serial = {
        let (_, pem) = x509_parser::pem::parse_x509_pem(first.certificate.as_str().as_bytes()).unwrap();
        http::tls::serial(&[pem.contents.into()])
    };
    let revoke = Command::RevokeCertificate(wid("router-1"), old_serial, false);
    assert!(server.rt.block_on(server.store.execute(revoke)).unwrap().is_ok());
    let (session, generation) = issued_client(&server, "router-1", &second, &new_key).open(1);
    let hb = old.post(&Route::Heartbeat(wid("router-1"), session), &Heartbeat { generation, draining: false });
    assert_eq!(hb.error(), ErrorCode::CertificateRevoked, "the old certificate, revoked after the rotation");

    // Renewal needs a certificate, and the worker's own.
    let anonymous = server.anonymous_post("/v1/workers/router-1/certificate:renew", &ql_wire::encode(&body));
    assert_eq!(anonymous.error(), ErrorCode::Unauthenticated);
    let stranger = server.client("router-2");
    let url = format!("{}/v1/workers/router-1/certificate:renew", stranger.base);
    let response = stranger.agent.post(&url).header("content-type", JSON_MEDIA_TYPE).send(&ql_wire::encode(&body)[..]);
    assert_eq!(response.unwrap().status().as_u16(), 403, "another worker's renewal: principal_mismatch");
    assert_eq!(server.snapshot().certificates.len(), 2, "nothing issued for them");
}

#[test]
fn connections_without_a_certificate_have_a_cap_of_their_own() {
    let cfg = IngressConfig { max_anonymous_connections: 1, ..test_config() };
    let server = Server::start_with("anonymous-cap", cfg);
    let anonymous = || Raw::connect(server.addr, client_config(&server.ca_pem(), None, &[&rustls::version::TLS13]));
    // Two at once for the one slot: one holds it (sending nothing), the other is turned
    // away without an answer.
    let mut both = [anonymous().unwrap(), anonymous().unwrap()];
    server.wait_for("one of them to be turned away", |st| st.turned_away() == 1);
    let answered = both
        .iter_mut()
        .map(|raw| raw.head("GET", "/v1/ca", &[]).is_ok() && raw.response().is_ok_and(|r| r.status == 200))
        .filter(|served| *served)
        .count();
    assert_eq!(answered, 1, "the one holding the slot is served, the other was closed");
    // Workers are not touched by it.
    let (_, generation) = server.client("router-1").open(1);
    assert_eq!(generation, Counter::ONE);
}

/// `max_anonymous_connections` 0 turns enrolment over the network off: a connection
/// without a certificate is closed after its handshake without an answer, even one
/// bringing a valid token, which stays unspent; workers with certificates are served.
#[test]
fn no_place_without_a_certificate_turns_every_anonymous_connection_away_and_spends_no_token() {
    let cfg = IngressConfig { max_anonymous_connections: 0, ..test_config() };
    let server = Server::start_with("anonymous-off", cfg);
    let token = server.token("router-1", 600_000);
    let before = server.snapshot();
    let (_, request) = csr("router-1");
    let body =
        ql_wire::enrol::Enrol { token: token.clone(), csr: ql_wire::enrol::CertificateRequest::new(request).unwrap() };
    let body = ql_wire::encode(&body);
    let mut raw = Raw::connect(server.addr, client_config(&server.ca_pem(), None, &[&rustls::version::TLS13])).unwrap();
    let length = format!("content-length: {}", body.len());
    // The server may close before the head is written: a failed write is as good as an
    // answerless end.
    let sent = raw.head("POST", "/v1/workers/router-1/certificate:enrol", &["content-type: application/json", &length]);
    assert!(sent.is_err() || raw.ended(), "closed without an answer");
    server.wait_for("the connection to be turned away", |st| st.turned_away() == 1);
    let after = server.snapshot();
    assert_eq!((&after.certificates, &after.enrolments), (&before.certificates, &before.enrolments), "nothing spent");
    // Workers are not touched by it.
    let (_, generation) = server.client("router-2").open(1);
    assert_eq!(generation, Counter::ONE);
}

#[test]
fn one_address_holds_only_its_share_of_the_connections_without_a_certificate() {
    let cfg = IngressConfig { max_anonymous_connections: 8, max_anonymous_connections_per_ip: 2, ..test_config() };
    let server = Server::start_with("anonymous-per-ip", cfg);
    let anonymous = || Raw::connect(server.addr, client_config(&server.ca_pem(), None, &[&rustls::version::TLS13]));
    // Three at once from one address, slots for eight: the third is turned away.
    let mut three = [anonymous().unwrap(), anonymous().unwrap(), anonymous().unwrap()];
    server.wait_for("the third to be turned away", |st| st.turned_away() == 1);
    let answered = three
        .iter_mut()
        .map(|raw| raw.head("GET", "/v1/ca", &[]).is_ok() && raw.response().is_ok_and(|r| r.status == 200))
        .filter(|served| *served)
        .count();
    assert_eq!(answered, 2, "the two holding the address's places are served");
    // Served once each, they are closed, and the address may connect again.
    server.wait_for("the three to be closed", |st| st.closed() >= 3);
    let mut again = anonymous().unwrap();
    again.head("GET", "/v1/ca", &[]).unwrap();
    assert_eq!(again.response().unwrap().status, 200);
}

/// Every place for connections without a certificate taken by one address, its
/// connections sending nothing: an agent enrolling from another address still gets in,
/// closing that address's oldest, and is served.
#[test]
fn an_address_that_takes_every_place_without_a_certificate_cannot_keep_an_enrolling_agent_out() {
    let cfg = IngressConfig { max_anonymous_connections: 4, max_anonymous_connections_per_ip: 4, ..test_config() };
    let server = Server::start_with("anonymous-share", cfg);
    let config = || client_config(&server.ca_pem(), None, &[&rustls::version::TLS13]);
    // Five from 127.0.0.2: four take every place, the fifth is turned away at the
    // address's own cap, which shows the four are held.
    let crowd: Vec<Raw> = (0..5).map(|_| Raw::connect_from("127.0.0.2", server.addr, config()).unwrap()).collect();
    server.wait_for("the fifth to be turned away", |st| st.turned_away() == 1);
    // One from 127.0.0.1 gets in, and is served.
    let mut newcomer = Raw::connect(server.addr, config()).unwrap();
    newcomer.head("GET", "/v1/ca", &[]).unwrap();
    assert_eq!(newcomer.response().unwrap().status, 200);
    server.wait_for("the crowd's oldest to have been closed for it", |st| st.turned_away() == 2);
    drop(crowd);
}

#[test]
fn a_connection_without_a_certificate_has_the_head_time_for_its_body_too() {
    // The body's own clocks far longer than the patience of this test's reads (20 s).
    let cfg = IngressConfig {
        header_read_timeout: Duration::from_secs(2),
        body_idle_timeout: Duration::from_secs(60),
        upload_grace: Duration::from_secs(60),
        ..test_config()
    };
    let server = Server::start_with("anonymous-deadline", cfg);
    let mut slow =
        Raw::connect(server.addr, client_config(&server.ca_pem(), None, &[&rustls::version::TLS13])).unwrap();
    // A whole head, then a body that never comes: refused once the head's time is out,
    // and closed, its slot given back.
    slow.head(
        "POST",
        "/v1/workers/router-1/certificate:enrol",
        &["content-type: application/json", "content-length: 100"],
    )
    .unwrap();
    assert_eq!(slow.response().unwrap().error(), ErrorCode::InvalidRequest);
    assert!(slow.ended(), "closed");
}

#[test]
fn connections_beyond_max_connections_are_closed_at_once_and_those_served_go_on() {
    let metrics = Arc::new(ql_control::metrics::Metrics::new());
    metrics.set_max_connections(3);
    let cfg = IngressConfig { max_connections: 3, metrics: Some(metrics.clone()), ..test_config() };
    let server = Server::start_with("slots", cfg);
    let served: Vec<(Client, SessionId, Counter)> = (1..=3)
        .map(|i| {
            let client = server.client(&format!("router-{i}"));
            let (session, generation) = client.open(1);
            (client, session, generation)
        })
        .collect();
    // Three more workers, each with a valid certificate: every one is closed after its
    // handshake, without an answer, instead of waiting in the backlog.
    for i in 4..=6 {
        let mut raw = server.raw(&format!("router-{i}"));
        raw.head("POST", &format!("/v1/workers/router-{i}/sessions"), &["content-length: 0"]).unwrap();
        assert!(raw.ended(), "router-{i} was closed, not served");
    }
    server.wait_for("three connections to be turned away and closed", |st| st.turned_away() == 3 && st.closed() == 3);
    // Those served go on, on the connections they hold.
    for (client, session, generation) in &served {
        let route = Route::Heartbeat(client.worker.clone(), session.clone());
        let hb: HeartbeatReply = client.post(&route, &Heartbeat { generation: *generation, draining: false }).json(200);
        assert_eq!(hb.status, SessionStatus::Online);
    }
    assert_eq!(server.snapshot().sessions.len(), 3, "no session for the workers turned away");
    let text = server.rt.block_on(metrics.render(&server.store)).unwrap();
    for line in [
        "ql_worker_connections 3",
        "ql_worker_connections_max 3",
        "ql_worker_connections_turned_away_total{reason=\"slots\"} 3",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
}
