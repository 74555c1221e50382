//! ql-control's own HTTP client (the CLI's `--server`, webhooks, the S3 store): ureq over rustls with
//! ring, trusting only the CA certificates given, never following a redirect, and
//! answering every status (the caller reads refusals).

use std::sync::Arc;
use std::time::Duration;

use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig, TlsProvider};

/// The certificates in PEM text (anything else in it is ignored).
pub fn certificates(pem: &[u8]) -> Vec<Certificate<'static>> {
    ureq::tls::parse_pem(pem)
        .filter_map(|item| match item {
            Ok(PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect()
}

/// An agent for requests whose body takes as long as its source does (a streamed
/// upload): connecting and the answer after the body are bounded by `timeout`, the
/// body's pace by its source.
pub fn streaming_agent(roots: &[Certificate<'static>], https_only: bool, timeout: Duration) -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .tls_config(tls_config(roots))
        .https_only(https_only)
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_connect(Some(timeout))
        .timeout_recv_response(Some(timeout))
        .user_agent(format!("ql-control/{}", env!("CARGO_PKG_VERSION")))
        .build();
    ql_client::agent(config)
}

fn tls_config(roots: &[Certificate<'static>]) -> TlsConfig {
    TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .root_certs(RootCerts::new_with_certs(roots))
        .build()
}

/// An agent trusting `roots` alone; `https_only` refuses plain `http://`; every call
/// within `timeout`, if given.
pub fn agent(roots: &[Certificate<'static>], https_only: bool, timeout: Option<Duration>) -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .tls_config(tls_config(roots))
        .https_only(https_only)
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_connect(Some(Duration::from_secs(10)))
        .timeout_global(timeout)
        .user_agent(format!("ql-control/{}", env!("CARGO_PKG_VERSION")))
        .build();
    ql_client::agent(config)
}
