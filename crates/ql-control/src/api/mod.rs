//! The operator API: JSON over HTTPS on a listener of its own (default loopback), for
//! the CLI's `--server` and for scripts. Operators are not workers: no client
//! certificate, but a bearer token (`ql-control operator add`) whose role — `read` or
//! `admin` — decides what it may do ([`crate::core::authorize`]). Every route calls the
//! same operator command the local CLI runs ([`crate::ops::Local`]), so nothing here
//! decides anything; [`routes`] maps each route to its command and role.
//!
//! Per connection: the TLS handshake within [`ApiConfig::handshake_timeout`], request
//! heads within [`ApiConfig::header_read_timeout`], bodies of at most
//! [`ApiConfig::max_body_bytes`], at most [`ApiConfig::max_connections`] at once (beyond
//! that a connection is closed at once).

mod routes;

pub(crate) use routes::log_answer;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::blob::BlobStore;
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
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let Ok((tcp, _peer)) = accepted else {
            // Out of descriptors, most likely: pause rather than spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(tcp);
            continue;
        };
        let (acceptor, shared, config, mut stopped) =
            (acceptor.clone(), shared.clone(), config.clone(), stopped.clone());
        connections.spawn(async move {
            let _slot = slot;
            let Ok(Ok(tls)) = tokio::time::timeout(config.handshake_timeout, acceptor.accept(tcp)).await else {
                return;
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
                _ = stopped.changed() => {}
            }
        });
    }
    connections.abort_all();
}
