//! The HTTPS client setup `ql-agent` and `ql-control` share: a ureq agent whose lookups run
//! on the calling thread ([`InlineResolver`]) and whose requests' heads leave with their
//! bodies' first parts ([`Coalesced`]). Each program brings its own TLS configuration and timeouts.
//!
//! Built on ureq's `unversioned` transport and resolver traits, which ureq exempts from
//! semver: the workspace pins ureq in `Cargo.lock`, and a change there shows up here.

mod coalesce;

pub use coalesce::{Coalesce, Coalesced};

use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{Connector, DefaultConnector, NextTimeout};

/// An agent of `config`: ureq's own connectors (TCP, then TLS) under [`Coalesce`], and
/// [`InlineResolver`].
pub fn agent(config: ureq::config::Config) -> ureq::Agent {
    ureq::Agent::with_parts(config, DefaultConnector::new().chain(Coalesce), InlineResolver::default())
}

/// ureq's resolver, asked without a deadline. Given one (any call timeout sets one), ureq
/// resolves every request on a thread of its own so that it can give up on a slow lookup:
/// a thread made and ended per request, for an IP address too, and when a pooled
/// connection is reused (on a router, a third thread with its own malloc arena and a 2 MiB
/// stack, in a daemon that otherwise has two). Without one it resolves on the calling
/// thread, as every other step of a call runs: a lookup is bounded by the system
/// resolver's own timeouts (`resolv.conf`), and an IP address needs none.
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
