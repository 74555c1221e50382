//! The worker ingress: HTTP/1.1 over TLS 1.3 with mutual TLS (PROTOCOL §2).
//!
//! - [`tls`]: the server configuration and the certificate principal;
//! - [`framing`]: the header rules every request body must meet;
//! - `ingress`: one request, from route and principal binding to the store's answer.
//!
//! Per connection: accept, the TLS handshake within
//! [`IngressConfig::handshake_timeout`], the principal read once from the verified client
//! certificate, then hyper's HTTP/1 server with keep-alive — the agent keeps one
//! connection for all its requests — and request heads of at most
//! [`IngressConfig::max_header_bytes`], each within [`IngressConfig::header_read_timeout`]
//! of its first byte; between requests a connection may stay idle for
//! [`IngressConfig::idle_timeout`] ([`head`]).
//!
//! Nobody can starve the others of connections. A handshake in progress takes no
//! connection slot, and there are at most [`IngressConfig::max_handshakes`] of them, at
//! most [`IngressConfig::max_handshakes_per_ip`] from one address (an IPv6 peer's /64,
//! `address_of`): anyone who can reach
//! the port, certificate or not, can hold only a few, and with every place taken a
//! handshake from an address holding at least two fewer takes the oldest place of the
//! address holding most ([`occupancy`]). A connection without a certificate (an agent
//! enrolling) is served one request and holds one of
//! [`IngressConfig::max_anonymous_connections`] places, at most
//! [`IngressConfig::max_anonymous_connections_per_ip`] from one address, shared by the
//! same rule. A connection takes one of
//! [`IngressConfig::max_connections`] slots only once its handshake succeeded (beyond
//! that it is closed, and the agent comes back after its backoff), and one worker holds
//! at most [`IngressConfig::max_connections_per_worker`]: a further one closes that
//! worker's oldest on the same certificate, else its oldest not yet admitted (no request
//! of it succeeded), else its oldest, so a worker's newest connection — the live one, after a
//! reconnect — always gets through, and one certificate can never lock out another; a
//! copy of a revoked certificate, never admitted, closes only its own connections. When a connection ends after an
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
mod head;
pub mod identity;
mod ingress;
mod log;
pub(crate) mod occupancy;
pub(crate) mod report;
pub mod tls;
mod trail;

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use log::Sealing;
use occupancy::Occupancy;
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
    /// How long a request's head may take, from its first byte (see [`head`]); more
    /// bytes do not extend it.
    pub header_read_timeout: Duration,
    /// How long a connection may wait for the next request with nothing of it arrived,
    /// the keep-alive idle timeout: keep it above the agent's longest quiet period (its
    /// heartbeat interval), or its one connection is closed between requests.
    pub idle_timeout: Duration,
    /// The longest wait for the next piece of a request body.
    pub body_idle_timeout: Duration,
    /// A whole request body may take this long plus its length at [`Self::min_upload_rate`].
    pub upload_grace: Duration,
    /// The slowest pace a request body may arrive at, in bytes a second, on average.
    pub min_upload_rate: u64,
    /// The longest offers long-poll, whatever `waitMs` asks for.
    pub max_poll_wait: Duration,
    /// After closing its side of a connection, how long the server keeps reading and
    /// discarding what the client still sends (see the module doc).
    pub linger_timeout: Duration,
    /// Connections served at once, after their handshake; beyond it one is closed.
    pub max_connections: usize,
    /// TLS handshakes in progress at once.
    pub max_handshakes: usize,
    /// TLS handshakes in progress at once from one IP address.
    pub max_handshakes_per_ip: usize,
    /// Connections one worker may hold; a further one closes its oldest on the same
    /// certificate, else its oldest never admitted, else its oldest.
    pub max_connections_per_worker: usize,
    /// The largest request head (request line and headers); a larger one is `431`.
    pub max_header_bytes: usize,
    /// On shutdown, how long in-flight requests may take to finish.
    pub shutdown_grace: Duration,
    /// After a failed accept (for example, out of file descriptors), the pause before
    /// the next attempt.
    pub accept_backoff: Duration,
    /// At most one line per this about failed handshakes, and one about connections
    /// turned away at a limit (the counters keep the totals).
    pub report_every: Duration,
    /// Connections without a client certificate served at once (agents enrolling with a
    /// token); each is served one request, its head and body within `header_read_timeout`
    /// of the handshake.
    pub max_anonymous_connections: usize,
    /// Of those, how many one address may hold (an IPv6 peer's /64): one peer cannot take
    /// them all and keep everyone else from enrolling.
    pub max_anonymous_connections_per_ip: usize,
    /// The CA and lifetime the identity routes issue with; `None`: they answer `404`.
    pub identity: Option<Arc<identity::Identity>>,
    /// Where each request's route, status and latency are counted; `None`: nowhere.
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl Default for IngressConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            body_idle_timeout: Duration::from_secs(30),
            upload_grace: Duration::from_secs(30),
            min_upload_rate: 4096,
            max_poll_wait: Duration::from_millis(ql_wire::limits::POLL_WAIT_MAX_MS),
            linger_timeout: Duration::from_secs(2),
            max_connections: 1024,
            max_handshakes: 256,
            max_handshakes_per_ip: 32,
            max_connections_per_worker: 4,
            max_header_bytes: 8 * 1024,
            shutdown_grace: Duration::from_secs(10),
            accept_backoff: Duration::from_millis(100),
            report_every: Duration::from_secs(10),
            max_anonymous_connections: 16,
            max_anonymous_connections_per_ip: 4,
            identity: None,
            metrics: None,
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
    turned_away: AtomicUsize,
    evicted: AtomicUsize,
    timed_out: AtomicUsize,
    pub(crate) chunk_removals: AtomicUsize,
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

    /// Connections closed unserved: too many handshakes (from one address, or at all), or
    /// every slot taken.
    pub fn turned_away(&self) -> usize {
        self.turned_away.load(Ordering::Relaxed)
    }

    /// Connections closed because their worker opened one more than it may hold.
    pub fn evicted(&self) -> usize {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Connections closed idle, or in the middle of a head that took too long.
    pub fn timed_out(&self) -> usize {
        self.timed_out.load(Ordering::Relaxed)
    }

    /// Removals of an attempt's live-log chunks started (one per completion that recorded
    /// its log; a replay starts none).
    pub fn chunk_removals(&self) -> usize {
        self.chunk_removals.load(Ordering::Relaxed)
    }
}

/// A connection closed unserved at a limit (`reason`, a metric label): counted, told in
/// a line at a bounded rate, and measured.
fn turn_away<S, B>(shared: &Shared<S, B>, reason: &'static str, line: &str) {
    shared.stats.turned_away.fetch_add(1, Ordering::Relaxed);
    shared.reports.turned_away.event(line);
    if let Some(metrics) = &shared.cfg.metrics {
        metrics.turned_away(reason);
    }
}

/// The lines of [`report`] a server prints.
pub(crate) struct Reports {
    handshake_failed: report::Report,
    turned_away: report::Report,
}

impl Reports {
    fn new(every: Duration) -> Self {
        Self {
            handshake_failed: report::Report::new("TLS handshake(s) failed", every),
            turned_away: report::Report::new("connection(s) turned away", every),
        }
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
    let report_every = cfg.report_every;
    let shared = Arc::new(Shared {
        store,
        blobs,
        cfg,
        stats: Arc::default(),
        sealing: Sealing::default(),
        occupancy: Occupancy::default(),
        reports: Reports::new(report_every),
    });
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
    let report_every = cfg.report_every;
    let shared = Arc::new(Shared {
        store,
        blobs,
        cfg,
        stats: stats.clone(),
        sealing: Sealing::default(),
        occupancy: Occupancy::default(),
        reports: Reports::new(report_every),
    });
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
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopping(&mut stopped) => break,
        };
        while connections.try_join_next().is_some() {}
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Usually out of descriptors or memory: say so, and pause rather than spin.
                // The connections already served go on.
                turn_away(&shared, "accept", &format!("accepting a connection failed: {e}"));
                tokio::select! {
                    () = tokio::time::sleep(shared.cfg.accept_backoff) => continue,
                    () = stopping(&mut stopped) => break,
                }
            }
        };
        shared.stats.connections.fetch_add(1, Ordering::Relaxed);
        if let Some(metrics) = &shared.cfg.metrics {
            metrics.connection(true);
        }
        let (acceptor, shared, stopped, slots) = (acceptor.clone(), shared.clone(), stopped.clone(), slots.clone());
        connections.spawn(async move {
            connection(acceptor, tcp, peer.ip(), &shared, &slots, stopped).await;
            if let Some(metrics) = &shared.cfg.metrics {
                metrics.connection(false);
            }
            shared.stats.closed.fetch_add(1, Ordering::Relaxed);
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
    ip: IpAddr,
    shared: &Arc<Shared<S, B>>,
    slots: &Arc<Semaphore>,
    mut stopped: watch::Receiver<bool>,
) {
    let cfg = &shared.cfg;
    let handshaking = match shared.occupancy.handshake(ip, cfg) {
        Ok(place) => place,
        Err(full) => {
            let line = match full {
                occupancy::Full::Address => format!(
                    "from {ip}: its {} handshakes in progress (max_handshakes_per_ip) taken",
                    cfg.max_handshakes_per_ip
                ),
                occupancy::Full::All => format!(
                    "from {ip}: all {} handshake places (max_handshakes) taken, by no address holding two more",
                    cfg.max_handshakes
                ),
            };
            turn_away(shared, "handshakes", &line);
            return;
        }
    };
    // Requests and answers are small and sequential: do not hold them back for Nagle.
    let _ = tcp.set_nodelay(true);
    // The handshake and the close below are boxed: a connection's future is as large as
    // its largest state, and holding these passing ones inline cost every idle connection
    // about 10 KiB (the close's read buffer among them).
    let accepted = Box::pin(async {
        tokio::select! {
            accepted = timeout(cfg.handshake_timeout, acceptor.accept(tcp)) => Some(accepted),
            () = handshaking.evicted.notified() => None,
        }
    })
    .await;
    let Some(accepted) = accepted else {
        turn_away(
            shared,
            "handshakes",
            &format!("from {ip}: its handshake closed for one from an address holding fewer"),
        );
        return;
    };
    let stream = match accepted {
        Ok(Ok(stream)) => stream,
        failed => {
            shared.stats.handshake_failures.fetch_add(1, Ordering::Relaxed);
            let why = match failed {
                Ok(Err(e)) => e.to_string(),
                _ => "timed out".to_owned(),
            };
            shared.reports.handshake_failed.event(&format!("from {ip}: {why}"));
            return;
        }
    };
    drop(handshaking);
    let Ok(_slot) = slots.clone().try_acquire_owned() else {
        let limit = cfg.max_connections;
        turn_away(shared, "slots", &format!("from {ip}: all {limit} connection slots (max_connections) taken"));
        return;
    };
    let peer = stream.get_ref().1.peer_certificates().unwrap_or_default();
    let principal = tls::principal(peer).ok();
    let serial = tls::serial(peer);
    // Without a certificate: one request (an identity route), within a small cap of its own.
    let anonymous = peer.is_empty();
    let anonymous_place = if anonymous {
        match shared.occupancy.anonymous(ip, cfg) {
            Ok(place) => Some(place),
            Err(full) => {
                let line = match full {
                    occupancy::Full::Address => format!(
                        "from {ip}: its {} connections without a certificate (max_anonymous_connections_per_ip) taken",
                        cfg.max_anonymous_connections_per_ip
                    ),
                    occupancy::Full::All if cfg.max_anonymous_connections == 0 => {
                        format!(
                            "from {ip}: connections without a certificate are refused (max_anonymous_connections 0)"
                        )
                    }
                    occupancy::Full::All => format!(
                        "from {ip}: all {} places for connections without a certificate \
                         (max_anonymous_connections) taken, by no address holding two more",
                        cfg.max_anonymous_connections
                    ),
                };
                turn_away(shared, "anonymous", &line);
                return;
            }
        }
    } else {
        None
    };
    let mut anonymous_evicted = anonymous_place.as_ref().map(|p| p.evicted.clone());
    if principal.is_some() {
        shared.stats.authenticated.fetch_add(1, Ordering::Relaxed);
    }
    let held = principal.clone().map(|worker| shared.occupancy.hold(worker, &serial, cfg, &shared.stats));
    let evicted = held.as_ref().map(|h| h.evicted.clone());

    let unread = Arc::new(AtomicBool::new(false));
    let reset = crate::fault::Reset::default();
    let clock = head::HeadClock::new();
    let service = Service {
        shared: shared.clone(),
        principal,
        serial,
        admitted: held.as_ref().map(|h| h.admitted.clone()),
        // Its body too must come within the head's time: it holds one of few slots. What
        // the server then does with it is not cut short (an enrolment spends its token).
        read_by: anonymous.then(|| tokio::time::Instant::now() + cfg.header_read_timeout),
        unread: unread.clone(),
        reset: reset.clone(),
        clock: clock.clone(),
    };
    let mut conn = http1::Builder::new()
        .timer(TokioTimer::new())
        // The connection's own clocks ([`head`]) tell an idle connection from a slow head.
        .header_read_timeout(None)
        .max_header_size(cfg.max_header_bytes)
        .max_buf_size(cfg.max_header_bytes.max(8192))
        .keep_alive(!anonymous)
        .half_close(false)
        .serve_connection(TokioIo::new(head::Watched::new(stream, clock.clone())), service);
    let mut draining = false;
    let mut reset_asked = false;
    loop {
        tokio::select! {
            _ = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => break,
            () = stopping(&mut stopped), if !draining => {
                draining = true;
                std::pin::Pin::new(&mut conn).graceful_shutdown();
            }
            // The worker opened one connection more than it may hold: this, its oldest,
            // goes at once.
            () = async { evicted.as_ref().expect("guarded").notified().await }, if evicted.is_some() => break,
            // Without a certificate, its place went to an address holding fewer: it closes,
            // unless its one request is being answered or its answer written (an enrolment
            // cut short could spend its token for nothing); it closes after that anyway.
            () = async { anonymous_evicted.as_ref().expect("guarded").notified().await }, if anonymous_evicted.is_some() => {
                anonymous_evicted = None;
                if !clock.has_answered() {
                    turn_away(shared, "anonymous", &format!("from {ip}: closed for a connection without a certificate from an address holding fewer"));
                    break;
                }
            }
            // A connection without a certificate gets the head's time for its one request,
            // from its handshake: it cannot sit on one of the few slots it may take.
            () = clock.overstayed(if anonymous { cfg.header_read_timeout } else { cfg.idle_timeout }, cfg.header_read_timeout) => {
                shared.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                break;
            }
            // A fault point (test builds only) asked for a reset: drop the request in
            // flight and send RST, no answer and no close_notify.
            () = reset.requested(), if crate::fault::ENABLED => {
                reset_asked = true;
                break;
            }
        }
    }
    let stream = conn.into_parts().io.into_inner().into_inner();
    if reset_asked {
        let _ = stream.into_inner().0.set_zero_linger();
        return;
    }
    Box::pin(close(stream, unread.load(Ordering::Relaxed), cfg.linger_timeout)).await;
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
