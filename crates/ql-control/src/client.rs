//! ql-control's own HTTP client (the CLI's `--server`, webhooks, the S3 store): ureq over rustls with
//! ring, trusting only the CA certificates given, never following a redirect, and
//! answering every status (the caller reads refusals).

use std::sync::Arc;
use std::time::Duration;

use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig, TlsProvider};
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

/// The certificates in PEM text (anything else in it is ignored).
pub fn certificates(pem: &[u8]) -> Vec<Certificate<'static>> {
    ureq::tls::parse_pem(pem)
        .filter_map(|item| match item {
            Ok(PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect()
}

/// ureq's resolver, asked without a deadline. Given one (a call timeout sets one), ureq
/// resolves every request on a thread of its own so that it can give up on a slow lookup:
/// a thread made and ended per request, for an IP address too, and when a pooled
/// connection is reused. Without one it resolves on the calling thread, a lookup bounded
/// by the system resolver's own timeouts (`resolv.conf`). The agent's client does the same.
#[derive(Debug, Default)]
pub struct InlineResolver(DefaultResolver);

impl Resolver for InlineResolver {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let untimed = NextTimeout { after: ureq::unversioned::transport::time::Duration::NotHappening, ..timeout };
        self.0.resolve(uri, config, untimed)
    }
}

/// An agent of `config` that resolves with [`InlineResolver`].
pub fn agent_of(config: ureq::config::Config) -> ureq::Agent {
    ureq::Agent::with_parts(config, DefaultConnector::new(), InlineResolver::default())
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
    agent_of(config)
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
    agent_of(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Given a deadline already spent, ureq's own resolver gives up on the thread it would
    /// look up on; this one looks up on the caller's thread, which no deadline cuts short.
    #[test]
    fn a_lookup_runs_on_the_calling_thread_whatever_the_deadline() {
        let uri: ureq::http::Uri = "https://127.0.0.1:8443/x".parse().unwrap();
        let spent = NextTimeout {
            after: ureq::unversioned::transport::time::Duration::Exact(Duration::ZERO),
            reason: ureq::Timeout::Resolve,
            per_read: None,
            per_write: None,
        };
        let addrs = InlineResolver::default().resolve(&uri, &ureq::config::Config::default(), spent).unwrap();
        assert_eq!(addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["127.0.0.1:8443"]);
    }
}
