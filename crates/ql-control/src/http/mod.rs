//! The worker ingress: HTTP/1.1 over TLS 1.3 with mutual TLS (PROTOCOL §2).
//!
//! - [`tls`]: the server configuration and the certificate principal;
//! - [`framing`]: the header rules every request body must meet;
//! - `ingress`: one request, from route and principal binding to the store's answer.
//!
//! Per connection: accept (at most [`IngressConfig::max_connections`] at once), the TLS
//! handshake within [`IngressConfig::handshake_timeout`], the principal read once from
//! the verified client certificate, then hyper's HTTP/1 server with keep-alive — the
//! agent keeps one connection for all its requests. When a connection ends after an
//! answer that left request bytes unread (a refusal before or inside the body), the
//! server closes its side and keeps reading and discarding for
//! [`IngressConfig::linger_timeout`] (a "lingering close"): closing a socket that still
//! has unread request bytes makes the kernel send a TCP reset, which can destroy the
//! refusal the agent has not read yet.
//!
//! [`serve`] runs until the process ends; [`serve_until`] stops on a signal; [`spawn`]
//! runs the server as a task and returns an [`Ingress`] handle with its address, its
//! counters and a shutdown. A shutdown stops accepting, lets in-flight requests finish
//! for [`IngressConfig::shutdown_grace`] (idle connections close at once), then drops
//! what is left.

pub mod framing;
mod ingress;
mod log;
pub mod tls;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use log::Sealing;
use rustls::ServerConfig;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::timeout;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::blob::BlobStore;
use crate::store::Store;
use ingress::{Service, Shared};

/// HTTP settings of the ingress, independent of the authority's [`crate::core::Timings`].
/// Every duration is configurable so tests can run them short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngressConfig {
    /// The TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// How long a request's head may take to arrive, counted from the moment the
    /// connection is ready for it. hyper starts this clock as soon as the previous
    /// response is written, so it is also the keep-alive idle timeout: keep it above the
    /// agent's longest quiet period (its heartbeat interval), or its one connection is
    /// closed between requests.
    pub header_read_timeout: Duration,
    /// The longest wait for the next piece of a request body.
    pub body_idle_timeout: Duration,
    /// The longest offers long-poll, whatever `waitMs` asks for.
    pub max_poll_wait: Duration,
    /// After closing its side of a connection, how long the server keeps reading and
    /// discarding what the client still sends (see the module doc).
    pub linger_timeout: Duration,
    /// Connections served at once; beyond it the server stops accepting until one ends.
    pub max_connections: usize,
    /// On shutdown, how long in-flight requests may take to finish.
    pub shutdown_grace: Duration,
    /// After a failed accept (for example, out of file descriptors), the pause before
    /// the next attempt.
    pub accept_backoff: Duration,
}

impl Default for IngressConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(75),
            body_idle_timeout: Duration::from_secs(30),
            max_poll_wait: Duration::from_millis(ql_wire::limits::POLL_WAIT_MAX_MS),
            linger_timeout: Duration::from_secs(2),
            max_connections: 1024,
            shutdown_grace: Duration::from_secs(10),
            accept_backoff: Duration::from_millis(100),
        }
    }
}

/// Counters of a running ingress, for operators and tests.
#[derive(Debug, Default)]
pub struct IngressStats {
    connections: AtomicUsize,
    handshake_failures: AtomicUsize,
    authenticated: AtomicUsize,
    closed: AtomicUsize,
    requests: AtomicUsize,
    audit_failures: AtomicUsize,
}

impl IngressStats {
    /// TCP connections accepted.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Connections whose TLS handshake failed or timed out (no or untrusted client
    /// certificate, wrong protocol version, garbage).
    pub fn handshake_failures(&self) -> usize {
        self.handshake_failures.load(Ordering::Relaxed)
    }

    /// Connections whose certificate named a worker principal.
    pub fn authenticated(&self) -> usize {
        self.authenticated.load(Ordering::Relaxed)
    }

    /// Connections finished, whatever the reason.
    pub fn closed(&self) -> usize {
        self.closed.load(Ordering::Relaxed)
    }

    /// Requests received.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }

    /// Refusals whose audit record could not be written.
    pub fn audit_failures(&self) -> usize {
        self.audit_failures.load(Ordering::Relaxed)
    }
}

/// Serves the worker ingress on `listener` until the process ends.
pub async fn serve<S: Store, B: BlobStore>(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    store: S,
    blobs: B,
    cfg: IngressConfig,
) -> io::Result<()> {
    serve_until(listener, tls, store, blobs, cfg, std::future::pending()).await
}

/// Serves the worker ingress on `listener` until `shutdown` completes, then shuts down as
/// the module doc describes.
pub async fn serve_until<S: Store, B: BlobStore>(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    store: S,
    blobs: B,
    cfg: IngressConfig,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let (stop, stopped) = watch::channel(false);
    let shared = Arc::new(Shared { store, blobs, cfg, stats: Arc::default(), sealing: Sealing::default() });
    let server = run(listener, TlsAcceptor::from(tls), shared, stopped);
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => return result,
        () = shutdown => {
            let _ = stop.send(true);
        }
    }
    server.await
}

/// Starts the worker ingress as a task on the current Tokio runtime (panics outside one).
pub fn spawn<S: Store, B: BlobStore>(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    store: S,
    blobs: B,
    cfg: IngressConfig,
) -> io::Result<Ingress> {
    let local_addr = listener.local_addr()?;
    let stats = Arc::<IngressStats>::default();
    let (stop, stopped) = watch::channel(false);
    let shared = Arc::new(Shared { store, blobs, cfg, stats: stats.clone(), sealing: Sealing::default() });
    let task = tokio::spawn(run(listener, TlsAcceptor::from(tls), shared, stopped));
    Ok(Ingress { local_addr, stats, stop, task })
}

/// A running ingress. Dropping it shuts the server down without waiting.
#[derive(Debug)]
pub struct Ingress {
    local_addr: SocketAddr,
    stats: Arc<IngressStats>,
    stop: watch::Sender<bool>,
    task: JoinHandle<io::Result<()>>,
}

impl Ingress {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Its counters.
    pub fn stats(&self) -> &IngressStats {
        &self.stats
    }

    /// Stops accepting, lets in-flight requests finish (within the grace period), and
    /// returns how the server ended.
    pub async fn shutdown(self) -> io::Result<()> {
        let _ = self.stop.send(true);
        match (&mut { self }.task).await {
            Ok(result) => result,
            Err(e) => Err(io::Error::other(e)),
        }
    }
}

impl Drop for Ingress {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Resolves once a shutdown is requested (or whoever could request one is gone).
async fn stopping(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

async fn run<S: Store, B: BlobStore>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    shared: Arc<Shared<S, B>>,
    mut stopped: watch::Receiver<bool>,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(shared.cfg.max_connections.max(1)));
    let mut connections = JoinSet::new();
    loop {
        // Take a slot before accepting: at the limit, new clients wait in the backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.map_err(io::Error::other)?,
            () = stopping(&mut stopped) => break,
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopping(&mut stopped) => break,
        };
        while connections.try_join_next().is_some() {}
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(_) => {
                // Usually out of descriptors or memory: pause rather than spin.
                tokio::select! {
                    () = tokio::time::sleep(shared.cfg.accept_backoff) => continue,
                    () = stopping(&mut stopped) => break,
                }
            }
        };
        shared.stats.connections.fetch_add(1, Ordering::Relaxed);
        let (acceptor, shared, stopped) = (acceptor.clone(), shared.clone(), stopped.clone());
        connections.spawn(async move {
            connection(acceptor, tcp, &shared, stopped).await;
            shared.stats.closed.fetch_add(1, Ordering::Relaxed);
            drop(slot);
        });
    }
    drop(listener);
    let grace = shared.cfg.shutdown_grace;
    let _ = timeout(grace, async { while connections.join_next().await.is_some() {} }).await;
    connections.shutdown().await;
    Ok(())
}

async fn connection<S: Store, B: BlobStore>(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    shared: &Arc<Shared<S, B>>,
    mut stopped: watch::Receiver<bool>,
) {
    // Requests and answers are small and sequential: do not hold them back for Nagle.
    let _ = tcp.set_nodelay(true);
    let cfg = &shared.cfg;
    let stream = match timeout(cfg.handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(_)) | Err(_) => {
            shared.stats.handshake_failures.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let principal = tls::principal(stream.get_ref().1.peer_certificates().unwrap_or_default()).ok();
    if principal.is_some() {
        shared.stats.authenticated.fetch_add(1, Ordering::Relaxed);
    }

    let unread = Arc::new(AtomicBool::new(false));
    let reset = crate::fault::Reset::default();
    let service = Service { shared: shared.clone(), principal, unread: unread.clone(), reset: reset.clone() };
    let mut conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .keep_alive(true)
        .half_close(false)
        .serve_connection(TokioIo::new(stream), service);
    let mut draining = false;
    let mut reset_asked = false;
    loop {
        tokio::select! {
            _ = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => break,
            () = stopping(&mut stopped), if !draining => {
                draining = true;
                std::pin::Pin::new(&mut conn).graceful_shutdown();
            }
            // A fault point (test builds only) asked for a reset: drop the request in
            // flight and send RST, no answer and no close_notify.
            () = reset.requested(), if crate::fault::ENABLED => {
                reset_asked = true;
                break;
            }
        }
    }
    let stream = conn.into_parts().io.into_inner();
    if reset_asked {
        let _ = stream.into_inner().0.set_zero_linger();
        return;
    }
    close(stream, unread.load(Ordering::Relaxed), cfg.linger_timeout).await;
}

/// Closes our side (TLS close_notify, then FIN). With `linger`, then reads and discards
/// what the client still sends, until it closes too or `limit` passes (see the module
/// doc for why).
async fn close(mut stream: TlsStream<TcpStream>, linger: bool, limit: Duration) {
    let _ = timeout(limit, async move {
        if stream.shutdown().await.is_err() || !linger {
            return;
        }
        let (mut tcp, _) = stream.into_inner();
        let mut sink = [0u8; 8192];
        while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}
