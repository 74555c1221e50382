//! The operator API: JSON over HTTPS on a listener of its own (default loopback), for
//! the CLI's `--server` and for scripts. Operators are not workers: no client
//! certificate, but a bearer token (`ql-control operator add`) whose role — `read` or
//! `admin` — decides what it may do ([`crate::core::authorize`]). Every route calls the
//! same operator command the local CLI runs ([`crate::ops::Local`]), so nothing here
//! decides anything; [`routes`] maps each route to its command and role.
//!
//! Per connection: the TLS handshake within [`ApiConfig::handshake_timeout`], request
//! heads within [`ApiConfig::header_read_timeout`], bodies of at most
//! [`ApiConfig::max_body_bytes`]. At most [`ApiConfig::max_connections`] at once, of which
//! one address holds at most [`ApiConfig::max_connections_per_ip`]: beyond that a
//! connection is closed at once, unless every place is taken and an address holding at
//! least two more than the newcomer's gives up its oldest ([`crate::http::occupancy`]):
//! closed at once in its handshake, else once the request in flight is answered. Anyone
//! who reaches the port holds a place from its first byte, before any token is shown, so
//! one address cannot keep the operators out (operators behind one proxy or NAT share its
//! address's share).

mod routes;

pub(crate) use routes::log_answer;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::blob::BlobStore;
use crate::http::occupancy::{Door, Full};
use crate::http::report::Report;
use crate::ops::Local;
use crate::store::Store;

/// Settings of the operator listener; every one configurable so tests run them short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    /// The TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// A request's head must arrive within this.
    pub header_read_timeout: Duration,
    /// The largest request body (a submitted script is the largest).
    pub max_body_bytes: usize,
    /// A request body must arrive within this of its head: a trickle holds no slot long.
    pub body_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// Of those, how many one address holds (an IPv6 peer's /64).
    pub max_connections_per_ip: usize,
    /// At most one line per this about connections turned away.
    pub report_every: Duration,
    /// The longest wait of a log follow, whatever `waitMs` asks.
    pub max_log_wait: Duration,
    /// The most log bytes one answer carries.
    pub max_log_window: u64,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            max_body_bytes: 1024 * 1024,
            body_timeout: Duration::from_secs(10),
            max_connections: 64,
            max_connections_per_ip: 16,
            report_every: Duration::from_secs(60),
            max_log_wait: Duration::from_secs(25),
            max_log_window: 4 * 1024 * 1024,
        }
    }
}

/// A running operator listener.
#[derive(Debug)]
pub struct Api {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Api {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and ends the connections (a log follow in flight ends with them).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Serves the operator API on `listener` until [`Api::shutdown`].
pub fn spawn<S: Store, B: BlobStore>(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    local: Local<S, B>,
    config: ApiConfig,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    web: Option<crate::web::Web>,
) -> std::io::Result<Api> {
    let addr = listener.local_addr()?;
    let (stop, stopped) = watch::channel(false);
    let shared = Arc::new(routes::Shared { local, config: config.clone(), metrics, web });
    let task = tokio::spawn(accept_loop(listener, TlsAcceptor::from(tls), shared, config, stopped));
    Ok(Api { addr, stop, task })
}

async fn accept_loop<S: Store, B: BlobStore>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    shared: Arc<routes::Shared<S, B>>,
    config: ApiConfig,
    mut stopped: watch::Receiver<bool>,
) {
    let door = Arc::new(Door::default());
    let turned_away = Report::new("operator connection(s) turned away", config.report_every);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let Ok((tcp, peer)) = accepted else {
            // Out of descriptors, most likely: pause rather than spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        // The place is taken here, in the order connections arrive.
        let ip = peer.ip();
        let place = match door.enter(ip, config.max_connections_per_ip, config.max_connections) {
            Ok(place) => place,
            Err(full) => {
                let (reason, line) = match full {
                    Full::Address => (
                        "address",
                        format!(
                            "from {ip}: its {} connections (operator_max_connections_per_ip) taken",
                            config.max_connections_per_ip
                        ),
                    ),
                    Full::All => (
                        "all",
                        format!(
                            "from {ip}: all {} connections (operator_max_connections) taken, \
                             by no address holding two more",
                            config.max_connections
                        ),
                    ),
                };
                turned_away.event(&line);
                if let Some(metrics) = &shared.metrics {
                    metrics.operator_turned_away(reason);
                }
                continue;
            }
        };
        let (acceptor, shared, config, mut stopped) =
            (acceptor.clone(), shared.clone(), config.clone(), stopped.clone());
        connections.spawn(async move {
            let evicted = place.evicted.clone();
            let handshake = tokio::time::timeout(config.handshake_timeout, acceptor.accept(tcp));
            // A place taken in the handshake by a newcomer from an address holding fewer
            // ends the connection there.
            let tls = tokio::select! {
                accepted = handshake => match accepted {
                    Ok(Ok(tls)) => tls,
                    _ => return,
                },
                _ = evicted.notified() => return,
                _ = stopped.changed() => return,
            };
            let service = hyper::service::service_fn(move |request| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(routes::answered(&shared, request).await) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(config.header_read_timeout)
                .serve_connection(TokioIo::new(tls), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                // Taken later, it closes once the request in flight, if any, is answered:
                // an operator's command is never cut off halfway.
                _ = evicted.notified() => {
                    connection.as_mut().graceful_shutdown();
                    // Its place is the newcomer's already: the longest answer (a follow,
                    // after its body) bounds how long it stays uncounted, whatever the
                    // client's pace of reading.
                    let longest = config.body_timeout + config.max_log_wait + config.header_read_timeout;
                    tokio::select! {
                        _ = tokio::time::timeout(longest, connection.as_mut()) => {}
                        _ = stopped.changed() => {}
                    }
                }
                _ = stopped.changed() => {}
            }
            drop(place);
        });
    }
    connections.abort_all();
}
