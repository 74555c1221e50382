//! Authentication and binding: TLS 1.3 only, the worker CA, one worker URI, the
//! path's worker, and framing checked before a body is read.

use super::*;

/// Whether a client with this configuration gets any HTTP answer.
fn gets_an_answer(server: &Server, config: Arc<ClientConfig>) -> bool {
    let Ok(mut raw) = Raw::connect(server.addr, config) else { return false };
    if raw
        .head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", "content-length: 0"])
        .is_err()
    {
        return false;
    }
    raw.response().is_ok()
}

#[test]
fn a_tls12_only_client_is_refused() {
    let server = Server::start("tls12");
    let creds = server.enroll("router-1");
    let config = client_config(&server.ca_pem(), Some(&creds), &[&rustls::version::TLS12]);
    assert!(Raw::connect(server.addr, config.clone()).is_err(), "TLS 1.2 handshake refused");
    assert!(!gets_an_answer(&server, config));
    server.wait_for("both handshakes to fail", |st| st.handshake_failures() == 2);
    assert_eq!(server.stats().requests(), 0);
}

#[test]
fn a_client_without_a_certificate_is_served_only_the_identity_routes_once_per_connection() {
    let server = Server::start("nocert");
    let config = client_config(&server.ca_pem(), None, &[&rustls::version::TLS13]);
    let before = server.snapshot();
    let mut raw = Raw::connect(server.addr, config.clone()).unwrap();
    raw.head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", "content-length: 0"])
        .unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.error(), ErrorCode::Unauthenticated);
    assert!(raw.ended(), "one request, then the connection ends");
    assert_eq!(server.snapshot(), before);
    assert_eq!(
        server.audits().last().map(|a| (a.principal.clone(), a.outcome.clone())),
        Some((None, "unauthenticated".into()))
    );

    // The CA is anyone's to read, one request per connection.
    let mut raw = Raw::connect(server.addr, config).unwrap();
    raw.head("GET", "/v1/ca", &[]).unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.status, 200);
    let bundle: ql_wire::enrol::CaBundle = ql_wire::decode(&response.body).unwrap();
    assert_eq!(bundle.ca.as_str().as_bytes(), server.ca_pem());
    assert!(raw.ended());
}

#[test]
fn a_certificate_from_a_foreign_ca_is_refused() {
    let server = Server::start("foreign");
    let foreign = TempDir::new("foreign-ca");
    pki::init_pki(foreign.path(), &["localhost".into()]).unwrap();
    let (files, _) =
        pki::enroll(foreign.path(), &wid("router-1"), &foreign.path().join("out"), pki::WORKER_VALIDITY).unwrap();
    let creds = Creds::read(&files.ca, &files.cert, &files.key);
    assert!(!gets_an_answer(&server, client_config(&server.ca_pem(), Some(&creds), &[&rustls::version::TLS13])));
    server.wait_for("the handshake to fail", |st| st.handshake_failures() == 1);
    assert_eq!(server.stats().requests(), 0);
}

/// Signs a client certificate with the server's CA but with the given URI SANs (and a
/// DNS name), bypassing `pki::enroll`, which would always add exactly one worker URI.
fn odd_client_cert(server: &Server, uris: &[&str]) -> Creds {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(&server.pki.ca_key).unwrap()).unwrap();
    let ca_pem = std::fs::read(&server.pki.ca_cert).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(&ca_pem).unwrap();
    let ca = pem.parse_x509().unwrap();
    let cn = ca.subject().iter_common_name().next().unwrap().as_str().unwrap().to_owned();
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = rcgen::DistinguishedName::new();
    ca_params.distinguished_name.push(DnType::CommonName, cn);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let issuer = Issuer::new(ca_params, &ca_key);

    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::ExplicitNoCa;
    params.use_authority_key_identifier_extension = true;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.subject_alt_names = vec![SanType::DnsName("router-1.example".try_into().unwrap())];
    params.subject_alt_names.extend(uris.iter().map(|u| SanType::URI((*u).try_into().unwrap())));
    let cert = params.signed_by(&key, &issuer).unwrap();
    Creds { ca: ca_pem, cert: cert.pem().into_bytes(), key: key.serialize_pem().into_bytes() }
}

#[test]
fn a_certificate_without_exactly_one_worker_uri_is_unauthenticated() {
    let server = Server::start("nouri");
    for (n, uris) in [vec![], vec!["urn:qinglong:worker:router-1", "urn:qinglong:worker:router-2"]].iter().enumerate() {
        let creds = odd_client_cert(&server, uris);
        let client = Client::new(server.addr, &creds, wid("router-1"));
        let answer = client.post_bytes(&Route::OpenSession(wid("router-1")), b"{}");
        assert_eq!(answer.error(), ErrorCode::Unauthenticated);
        server.wait_for("the connection to close", |st| st.closed() == n + 1);
    }
    assert_eq!(server.stats().handshake_failures(), 0, "the chain was valid; the principal was not");
    assert_eq!(server.stats().authenticated(), 0);
    let audits = server.audits();
    assert_eq!(audits.len(), 2);
    assert!(audits
        .iter()
        .all(|a| a.principal.is_none() && a.outcome == "unauthenticated" && a.route == "session.open"));
    assert!(server.snapshot().sessions.is_empty());
}

#[test]
fn another_workers_path_is_refused_before_its_body_is_read() {
    let server = Server::start("mismatch");
    let mut raw = server.raw("router-2");
    // A large declared body that is never sent: the answer must come anyway.
    raw.head(
        "PUT",
        "/v1/workers/router-1/sessions/s1/runs/r1/attempts/a1/artifacts/log",
        &[&format!("content-type: {ARTIFACT_MEDIA_TYPE}"), "content-length: 60000000", "expect: 100-continue"],
    )
    .unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.error(), ErrorCode::PrincipalMismatch);
    assert!(response.interim.is_empty(), "no 100 Continue: the body was never asked for");
    assert!(response.closes());
    assert!(raw.ended());

    let audits = server.audits();
    assert_eq!(audits.len(), 1);
    assert_eq!(audits[0].principal, Some(wid("router-2")));
    assert_eq!((audits[0].route.as_str(), audits[0].outcome.as_str()), ("artifact.put", "principal_mismatch"));
}

#[test]
fn unknown_routes_and_query_strings_are_not_found() {
    let server = Server::start("notfound");
    for (method, path) in [
        ("POST", "/v1/workers/router-1/sessions?x=1"),
        ("POST", "/v1/workers/router-1/sessions/"),
        ("GET", "/v1/workers/router-1/sessions"),
        ("POST", "/v1/workers/router-1/sessions/s1/offers%3Apoll"),
        ("POST", "/metrics"),
    ] {
        let mut raw = server.raw("router-1");
        raw.head(method, path, &["content-type: application/json", "content-length: 2"]).unwrap();
        let response = raw.response().unwrap();
        assert_eq!(response.error(), ErrorCode::NotFound, "{method} {path}");
        assert!(response.closes());
    }
    let audits = server.audits();
    assert_eq!(audits.len(), 5);
    assert!(audits
        .iter()
        .all(|a| a.principal == Some(wid("router-1")) && a.route == "unknown" && a.outcome == "not_found"));
}

#[test]
fn json_framing_is_checked_before_the_body() {
    let server = Server::start("json-framing");
    let path = "/v1/workers/router-1/sessions";
    for (headers, code) in [
        (vec!["content-type: text/plain", "content-length: 2"], ErrorCode::UnsupportedMediaType),
        (vec!["content-type: application/json; charset=utf-8", "content-length: 2"], ErrorCode::UnsupportedMediaType),
        (
            vec!["content-type: application/json", "content-encoding: gzip", "content-length: 2"],
            ErrorCode::UnsupportedMediaType,
        ),
        (vec!["content-type: application/json", "transfer-encoding: chunked"], ErrorCode::LengthRequired),
        (vec!["content-type: application/json"], ErrorCode::LengthRequired),
        (vec!["content-type: application/json", "content-length: 4097"], ErrorCode::PayloadTooLarge),
    ] {
        let mut raw = server.raw("router-1");
        let mut all = headers.clone();
        all.push("expect: 100-continue");
        raw.head("POST", path, &all).unwrap();
        let response = raw.response().unwrap();
        assert_eq!(response.error(), code, "{headers:?}");
        assert!(response.interim.is_empty(), "{headers:?}: refused without asking for the body");
        assert!(response.closes());
    }
    assert!(server.snapshot().sessions.is_empty());
    // Each was admitted (authenticated and bound) before its framing was refused.
    assert_eq!(server.audits().iter().filter(|a| a.outcome == "admitted").count(), 6);
}
