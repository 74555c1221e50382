//! A worker's side of the protocol over real mTLS, for the tests and examples that drive a
//! running `ql-control serve` as agents do: the client, set up like the agent's, and the
//! claim of an offer with the fence it yields.
//!
//! `tests/pg_replicas.rs` includes it as `#[path = "common/worker_client.rs"] mod
//! worker_client;`, `examples/ack_bench.rs` as `#[path = "../tests/common/worker_client.rs"]`.

use std::sync::Arc;
use std::time::Duration;

use ql_control::pki::Enrolled;
use ql_wire::capability::Token;
use ql_wire::ids::WorkerId;
use ql_wire::offer::{Claim, Claimed, Offer};
use ql_wire::route::AttemptPath;
use ql_wire::session::SessionOpened;
use ql_wire::Fence;
use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};

/// A client for an enrolled worker, set up like the agent's: TLS 1.3 only (ring), the
/// enrolment's CA as the only root, the worker's certificate, one keep-alive connection,
/// every status an answer (not an error), and `timeout` for each request.
pub(crate) fn client(enrolled: &Enrolled, timeout: Duration) -> ureq::Agent {
    let read = |p: &std::path::Path| std::fs::read(p).expect("read pem");
    let ca = Certificate::from_pem(&read(&enrolled.ca)).expect("ca");
    let cert = Certificate::from_pem(&read(&enrolled.cert)).expect("cert");
    let key = PrivateKey::from_pem(&read(&enrolled.key)).expect("key");
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.retain(|s| matches!(s, rustls::SupportedCipherSuite::Tls13(_)));
    let tls = TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(provider))
        .root_certs(RootCerts::new_with_certs(&[ca]))
        .client_cert(Some(ClientCert::new_with_certs(&[cert], key)))
        .build();
    ql_client::agent(
        ureq::Agent::config_builder()
            .tls_config(tls)
            .http_status_as_error(false)
            .max_idle_connections_per_host(1)
            .timeout_global(Some(timeout))
            .build(),
    )
}

/// `worker`'s enrolment under `dir/bench-workers`: made on the first call, the same files
/// on later ones (benchmarks run again against one state directory).
#[allow(dead_code)] // Not every includer uses every helper.
pub(crate) fn enrolled(dir: &std::path::Path, worker: &WorkerId) -> Enrolled {
    let out = dir.join("bench-workers");
    match ql_control::pki::enroll(dir, worker, &out, ql_control::pki::WORKER_VALIDITY).map(|(e, _)| e) {
        Err(ql_control::pki::PkiError::Exists(_)) => Enrolled {
            cert: out.join(format!("{worker}.crt")),
            key: out.join(format!("{worker}.key")),
            ca: out.join("ca.crt"),
        },
        other => other.expect("enroll"),
    }
}

/// POSTs `body` to `route` and decodes the answer, which must be a success.
#[allow(dead_code)] // Not every includer uses every helper.
pub(crate) fn post<Req: ql_wire::Body, Resp: ql_wire::Body>(
    agent: &ureq::Agent,
    url: &str,
    route: &ql_wire::route::Route,
    body: &Req,
) -> Resp {
    let mut resp = agent
        .post(format!("{url}{}", route.path()))
        .header("Content-Type", "application/json")
        .send(&ql_wire::encode(body)[..])
        .expect("request");
    let bytes = resp.body_mut().read_to_vec().expect("body");
    assert!(resp.status().is_success(), "{} {}: {}", route.name(), resp.status(), String::from_utf8_lossy(&bytes));
    ql_wire::decode(&bytes).expect("answer decodes")
}

/// A fresh lease token, and the claim of `offer` in `session` under it.
pub(crate) fn claim(session: &SessionOpened, offer: &Offer) -> (Token, Claim) {
    let token = Token::generate().unwrap();
    let claim = Claim {
        generation: session.generation,
        run_id: offer.run_id.clone(),
        attempt_id: offer.attempt_id.clone(),
        lease_token: token.clone(),
    };
    (token, claim)
}

/// The attempt `worker` claimed with `offer` in `session`: its path, and the fence of the
/// lease `claimed` granted to `token`.
pub(crate) fn claimed(
    worker: &WorkerId,
    session: &SessionOpened,
    offer: &Offer,
    token: Token,
    claimed: &Claimed,
) -> (AttemptPath, Fence) {
    let path = AttemptPath {
        worker: worker.clone(),
        session: session.session_id.clone(),
        run: offer.run_id.clone(),
        attempt: offer.attempt_id.clone(),
    };
    let fence = Fence {
        session_generation: session.generation,
        offer_id: offer.offer_id.clone(),
        lease_generation: claimed.lease_generation,
        lease_token: token,
        expected_lease_version: claimed.lease_version,
    };
    (path, fence)
}
