//! `ql-control serve`: the HTTPS ingress and the sweeper, on one Tokio runtime.
//!
//! The authority is the state directory's SQLite file by default, or the PostgreSQL
//! database `--database` names; either way the same generic server runs over it. Every
//! replica of a PostgreSQL deployment runs this same command against the same database.
//!
//! The sweeper runs here on a timer, and so does the collection of the artifact store:
//! what failed uploads left, and live-log chunks of recorded logs ([`collect_forever`]);
//! both are idempotent and safe on every replica. On SIGTERM or Ctrl-C the ingress stops accepting, lets in-flight
//! requests finish, and the process prints what it served (connections, requests) before
//! it exits.
//!
//! Under systemd (`Type=notify`, see `packaging/systemd/ql-control.service`) it reports
//! `READY=1` once it listens on an open store, pings the watchdog while the store answers
//! (see [`watchdog_forever`]) and reports `STOPPING=1` when the graceful stop begins.
//! Without `$NOTIFY_SOCKET` none of that happens.

use std::path::Path;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use ql_notify::Notify;

use crate::api::{self, ApiConfig};
use crate::blob::any::Blobs;
use crate::blob::{ArtifactKey, BlobError, BlobStore, Collected, Recorded, Recording, Remembering};
use crate::config::{Config, Layout};
use crate::core::{Command, Reply};
use crate::http::{self, IngressConfig};
use crate::metrics::Metrics;
use crate::store::postgres::{PgOptions, PgStore};
use crate::store::sqlite::{SqliteOptions, SqliteStore};
use crate::store::{AuditRetention, RunRetention, SessionRetention, Store};

/// The ingress settings a [`Config`] implies.
pub fn ingress_config(config: &Config) -> IngressConfig {
    let count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    IngressConfig {
        header_read_timeout: Duration::from_millis(config.header_timeout_ms),
        idle_timeout: Duration::from_millis(config.idle_timeout_ms),
        body_idle_timeout: Duration::from_millis(config.read_timeout_ms),
        handshake_timeout: Duration::from_millis(config.handshake_timeout_ms),
        max_connections: count(config.max_connections),
        max_handshakes: count(config.max_handshakes),
        max_handshakes_per_ip: count(config.max_handshakes_per_ip),
        max_connections_per_worker: count(config.max_connections_per_worker),
        max_header_bytes: count(config.max_header_bytes),
        upload_grace: Duration::from_millis(config.upload_grace_ms),
        min_upload_rate: config.min_upload_rate,
        report_every: Duration::from_millis(config.refusal_report_ms),
        max_anonymous_connections: count(config.max_anonymous_connections),
        max_anonymous_connections_per_ip: count(config.max_anonymous_connections_per_ip),
        ..IngressConfig::default()
    }
}

/// One sweep, and what it did on stderr: lapsed rows swept, or after an outage the time
/// given back (`core::grace`).
pub async fn sweep_once<S: Store>(store: &S) {
    match store.execute(Command::Sweep).await {
        Ok(Ok(Reply::Swept(n))) if n > 0 => eprintln!("ql-control: swept {n} lapsed row(s)"),
        Ok(Ok(Reply::Graced(g))) => eprintln!(
            "ql-control: no replica swept for {} ms (an outage of the authority): gave that time back to \
             {} lease(s), {} session(s) and {} offer(s) before sweeping",
            g.absent_ms, g.leases, g.sessions, g.offers
        ),
        Ok(_) => {}
        Err(e) => eprintln!("ql-control: sweep failed: {e}"),
    }
}

/// Removes the oldest ended runs past `retention` ([`Store::prunable_runs`]): each
/// one's stored logs from `blobs` first, then the rows of those whose logs went. A run
/// whose logs could not be removed keeps its rows, so the next sweep tries it again
/// rather than leaving files no row names. Returns how many runs went.
pub async fn prune_runs<S: Store, B: BlobStore>(store: &S, blobs: &B, retention: RunRetention) -> Result<u64, String> {
    let ended = store.prunable_runs(retention).await.map_err(|e| e.to_string())?;
    let mut gone = Vec::with_capacity(ended.len());
    let (mut failed, mut last) = (0, None);
    for (project, run) in ended {
        match blobs.remove_run(&project, &run).await {
            Ok(_) => gone.push(run),
            Err(e) => {
                failed += 1;
                last = Some(format!("{run}: {e}"));
            }
        }
    }
    let pruned = store.prune_runs(gone, retention).await.map_err(|e| e.to_string())?;
    match last {
        Some(e) => Err(format!(
            "the stored files of {failed} run(s) could not be removed, the last {e}; their rows stay for the next \
             try, {pruned} other run(s) removed"
        )),
        None => Ok(pruned),
    }
}

/// Removes ended runs past `retention` every `every` ([`prune_runs`]), for ever: a task
/// of its own, since removing a backlog (a first start on months of history, a bucket
/// answering slowly) takes what it takes, and the sweeps must not wait for it (a sweep
/// late by more than `outage_grace_after_ms` is taken for an outage).
pub async fn prune_runs_forever<S: Store, B: BlobStore>(store: S, blobs: B, every: Duration, retention: RunRetention) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = prune_runs(&store, &blobs, retention).await {
            eprintln!("ql-control: pruning ended runs failed: {e}");
        }
    }
}

/// Sweeps lapsed offers, sessions and leases every `every`, and prunes the audit records
/// beyond `retention` and the ended sessions beyond `sessions`, for ever.
pub async fn sweep_forever<S: Store>(store: S, every: Duration, retention: AuditRetention, sessions: SessionRetention) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        sweep_once(&store).await;
        // Schedules fire at the sweep after their time: a sweep interval of a second keeps
        // a six-field schedule to the second.
        if let Err(e) = store.execute(Command::FireSchedules).await {
            eprintln!("ql-control: firing schedules failed: {e}");
        }
        if let Err(e) = store.prune_audit(retention).await {
            eprintln!("ql-control: pruning audit records failed: {e}");
        }
        if let Err(e) = store.prune_sessions(sessions).await {
            eprintln!("ql-control: pruning ended sessions failed: {e}");
        }
    }
}

/// The authority as the artifact store's collection asks it: an attempt has recorded its
/// log once its run's detail shows that artifact on it (under the key's project), and
/// never will once it ended without it: only a completion records an artifact, and it
/// ends the attempt.
#[derive(Clone)]
pub struct Authority<S>(pub S);

impl<S: Store> Recorded for Authority<S> {
    async fn recorded(&self, key: &ArtifactKey) -> Result<Recording, BlobError> {
        let detail = self.0.run_detail(&key.run).await.map_err(|e| BlobError(format!("asking the authority: {e}")))?;
        // Ids are made here and a run's project is fixed: a run or attempt that is not
        // there under that project never will be.
        let Some(detail) = detail.filter(|d| d.run.project == key.project) else { return Ok(Recording::Never) };
        let Some(attempt) = detail.attempts.iter().find(|a| a.id == key.attempt) else { return Ok(Recording::Never) };
        Ok(if attempt.artifact.as_ref().is_some_and(|r| r.artifact_id == key.artifact) {
            Recording::Recorded
        } else if attempt.status.is_terminal() {
            Recording::Never
        } else {
            Recording::NotYet
        })
    }
}

/// One pass of the artifact store's collection ([`BlobStore::collect`]) of what was last
/// written before `before`, told to `metrics` when given.
pub async fn collect_once<B: BlobStore, R: Recorded>(
    blobs: &B,
    recorded: &R,
    before: SystemTime,
    metrics: Option<&Metrics>,
) -> Result<Collected, BlobError> {
    let pass = blobs.collect(before, recorded).await;
    if let Some(metrics) = metrics {
        metrics.collection(pass.as_ref().ok());
    }
    pass
}

/// How often and what [`collect_forever`] collects.
#[derive(Debug, Clone, Copy)]
pub struct Collection {
    /// Between passes, the first at the start.
    pub every: Duration,
    /// A leftover or chunk goes once it is this old.
    pub age: Duration,
    /// Attempts whose chunks are their log for good that are asked about once, not every
    /// pass ([`Remembering`]).
    pub remember: usize,
}

impl Collection {
    /// The collection `config` sets, if it is on.
    pub fn of(config: &Config) -> Option<Self> {
        (config.artifact_collect_ms > 0).then(|| Self {
            every: Duration::from_millis(config.artifact_collect_ms),
            age: Duration::from_millis(config.artifact_leftover_age_ms),
            remember: usize::try_from(config.artifact_collect_remember).unwrap_or(usize::MAX),
        })
    }
}

/// Every `collection.every`, from the start, removes what uploads that never completed
/// left in the artifact store once it is `collection.age` old, and the chunks of recorded
/// logs whose removal at the completion did not happen ([`collect_once`]), and says on
/// stderr what went. Safe on every replica.
pub async fn collect_forever<B: BlobStore, S: Store>(
    blobs: B,
    store: S,
    collection: Collection,
    metrics: Option<Arc<Metrics>>,
) {
    let Collection { every, age, remember } = collection;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let authority = Remembering::new(Authority(store), remember);
    loop {
        tick.tick().await;
        let before = SystemTime::now().checked_sub(age).unwrap_or(SystemTime::UNIX_EPOCH);
        match collect_once(&blobs, &authority, before, metrics.as_deref()).await {
            Ok(c) => {
                if c.removed > 0 {
                    eprintln!(
                        "ql-control: removed {} leftover(s) of uploads that never completed, {} bytes",
                        c.removed, c.bytes
                    );
                }
                if c.chunks > 0 {
                    eprintln!(
                        "ql-control: removed {} live-log chunk(s) of recorded logs, {} bytes",
                        c.chunks, c.chunk_bytes
                    );
                }
                if c.unanswered > 0 {
                    eprintln!(
                        "ql-control: the old live-log chunks of {} attempt(s) stay until the next collection: \
                         the database did not answer whether they recorded their log",
                        c.unanswered
                    );
                }
            }
            Err(e) => eprintln!("ql-control: collecting the artifact store failed: {e}"),
        }
    }
}

/// The service manager's channel, shared by the serve flow and the watchdog task. Each
/// use holds the lock for one datagram send, never across an await.
type SharedNotify = Arc<Mutex<Notify>>;

fn notifying<T>(notify: &SharedNotify, f: impl FnOnce(&mut Notify) -> T) -> T {
    f(&mut notify.lock().unwrap_or_else(PoisonError::into_inner))
}

/// Pings systemd's watchdog every `every` (half of `WatchdogSec=`), each time only after
/// the store answered its probe ([`Store::probe`]).
///
/// The probe takes the path every command takes, so the pings prove what a restart would
/// repair: the Tokio runtime still runs tasks, and the store still works through its queue
/// — for SQLite the one writer thread (a stuck fsync or a write lock never released stops
/// the pings), for PostgreSQL the pool (every connection hanging stops them). An error
/// answer counts as an answer: PostgreSQL being down is not repaired by restarting us
/// (requests answer 503 meanwhile; restarts would fail to connect until systemd's start
/// limit gives up on the unit). A SQLite writer that failed a sync or stopped is repaired
/// only by a restart, and its probe never answers. Nothing here times the probe: one that
/// never returns is exactly what the watchdog is for.
async fn watchdog_forever<S: Store>(store: S, notify: SharedNotify, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let _answered = store.probe().await;
        notifying(&notify, |n| n.watchdog(Instant::now()));
    }
}

/// SIGTERM or SIGINT (Ctrl-C), caught from the moment this returns: a signal that comes
/// once the server announced itself (its "listening on" line, READY=1) starts the graceful
/// stop instead of killing the process, however soon it comes.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, String> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("catching SIGTERM: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("catching SIGINT: {e}"))?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Descriptors a server with these limits may need at once: every connection and
/// handshake, and a margin for the database, the artifact files and the listener.
pub fn descriptors_needed(config: &Config) -> u64 {
    config.max_connections.saturating_add(config.max_handshakes).saturating_add(64)
}

/// Raises the soft limit on open files to the hard one, and says so when even that is
/// below what the limits need: beyond it, accepts fail and SQLite cannot open its files.
fn raise_descriptor_limit(config: &Config) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    // `None` is unlimited.
    if limit.current != limit.maximum {
        let _ = setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum });
    }
    let needed = descriptors_needed(config);
    if let Some(have) = getrlimit(Resource::Nofile).current.filter(|have| *have < needed) {
        eprintln!(
            "ql-control: max_connections and max_handshakes need about {needed} open files, the limit is {have}: \
             raise it (systemd: LimitNOFILE=) or lower max_connections"
        );
    }
}

/// Addresses given on the command line, over control.json's.
#[derive(Debug, Clone, Default)]
pub struct Listen {
    /// The worker ingress (`--listen`).
    pub workers: Option<String>,
    /// The operator API (`--operator-listen`; empty: none).
    pub operators: Option<String>,
    /// The artifact store (`--artifacts`).
    pub artifacts: Option<String>,
}

/// The operator API's settings a [`Config`] implies.
pub fn api_config(config: &Config) -> ApiConfig {
    ApiConfig {
        handshake_timeout: Duration::from_millis(config.handshake_timeout_ms),
        header_read_timeout: Duration::from_millis(config.header_timeout_ms),
        max_connections: usize::try_from(config.operator_max_connections).unwrap_or(usize::MAX),
        max_connections_per_ip: usize::try_from(config.operator_max_connections_per_ip).unwrap_or(usize::MAX),
        report_every: Duration::from_millis(config.refusal_report_ms),
        max_log_wait: Duration::from_millis(config.operator_log_wait_ms),
        body_timeout: Duration::from_millis(config.operator_body_timeout_ms),
        ..ApiConfig::default()
    }
}

/// How many threads serve connections: `configured` (at most 64), or with 0 the store's
/// own. One on SQLite, whose writer has a thread of its own: an idle fleet costs least
/// there. On PostgreSQL, where the lanes and their database connections run on these
/// threads too, one on a machine of one or two cores and two on more: on two cores a
/// hand-off between two threads often wakes a core that sleeps, which costs more than the
/// second thread gains (at 8 agents in step, with the database on the same two cores, one
/// thread made 8 % more ACKs than two in alternate rounds, and as many at 64;
/// bench/RESULTS.md).
pub fn serving_threads(configured: u64, postgres: bool, cores: usize) -> usize {
    match configured {
        0 if postgres && cores > 2 => 2,
        0 => 1,
        n => usize::try_from(n).unwrap_or(usize::MAX).min(64),
    }
}

/// Runs the server until SIGTERM or Ctrl-C, on the SQLite file of `dir`, or on the
/// PostgreSQL database `database` names (connected as the runtime role).
pub fn run(dir: &Path, listen: Listen, database: Option<String>) -> Result<(), String> {
    let layout = Layout::new(dir);
    let mut config = Config::load(&layout)?;
    raise_descriptor_limit(&config);
    let addr = listen.workers.unwrap_or_else(|| config.listen.clone());
    if let Some(operators) = listen.operators {
        config.operator_listen = operators;
    }
    // Refused here, before anything listens, when the bucket's settings are unusable.
    let blobs = Blobs::open(&layout, &config, listen.artifacts.as_deref(), true)?;
    let tls = http::tls::server_config_from_dir(dir).map_err(|e| e.to_string())?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = serving_threads(config.runtime_threads, database.is_some(), cores);
    // One thread: the current-thread scheduler on this one. A multi-thread runtime's
    // single worker would wake its own I/O driver (an eventfd write and another
    // epoll_wait) for each task an I/O event wakes: 7 % of the server's CPU under the
    // PostgreSQL ACK benchmark (bench/RESULTS.md).
    let mut builder = match threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        _ => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(threads);
            b
        }
    };
    let runtime = builder.enable_all().build().map_err(|e| format!("starting the runtime: {e}"))?;
    runtime.block_on(async move {
        match database {
            Some(url) => {
                if !crate::admin::is_postgres(&url) {
                    return Err("--database takes a postgres://... URL".to_owned());
                }
                let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
                let options = PgOptions {
                    timings: config.timings(),
                    pool_size: size(config.pg_pool_size),
                    lanes: size(config.pg_lanes),
                    lane_fill: size(config.pg_lane_fill),
                    batch_max: size(config.pg_batch_max),
                    lane_window: Duration::from_micros(config.pg_lane_window_us),
                    prepared_max: size(config.pg_prepared_max),
                    ..PgOptions::default()
                };
                let store = PgStore::open(&url, options).await.map_err(|e| e.to_string())?;
                serve_on(store, blobs, &layout, &config, tls, &addr).await
            }
            None => {
                let options = SqliteOptions {
                    timings: config.timings(),
                    clock_offset: Arc::new(AtomicI64::new(0)),
                    watch_tick: Duration::from_millis(config.change_poll_ms),
                    commit_window: Duration::from_micros(config.commit_window_us),
                    commit_window_min_batch: usize::try_from(config.commit_window_min_batch).unwrap_or(usize::MAX),
                    lazy_sync: Duration::from_millis(config.lazy_sync_ms),
                    hold_batches: usize::try_from(config.sync_hold_batches).unwrap_or(usize::MAX),
                    idle_window: Duration::from_millis(config.idle_batch_window_ms),
                    checkpoint_interval: Duration::from_millis(config.checkpoint_ms),
                    wal_autocheckpoint_pages: u32::try_from(config.wal_autocheckpoint_pages).unwrap_or(u32::MAX),
                    ..SqliteOptions::default()
                };
                let store = SqliteStore::open_with_options(layout.database(), options).map_err(|e| e.to_string())?;
                serve_on(store, blobs, &layout, &config, tls, &addr).await
            }
        }
    })
}

/// What the identity routes issue with: the worker CA and, where `ca.key` is present, its
/// key (a replica without one serves `GET /v1/ca` and answers enrolment and renewal
/// `503`, which an agent retries: against another replica, behind a balancer).
fn identity(layout: &Layout, config: &Config) -> Result<http::identity::Identity, String> {
    let paths = crate::pki::PkiPaths::new(&layout.dir);
    let ca_pem = std::fs::read_to_string(&paths.ca_cert).map_err(|e| format!("{}: {e}", paths.ca_cert.display()))?;
    let ca = if paths.ca_key.exists() {
        Some(crate::pki::Ca::load(&layout.dir).map_err(|e| e.to_string())?)
    } else {
        eprintln!("ql-control: no {}: this replica does not issue certificates", paths.ca_key.display());
        None
    };
    Ok(http::identity::Identity { ca_pem, ca, lifetime: config.worker_cert_lifetime() })
}

/// The server over any store: ingress, sweeper, and a clean stop on a signal.
async fn serve_on<S: Store>(
    store: S,
    blobs: Blobs,
    layout: &Layout,
    config: &Config,
    tls: Arc<rustls::ServerConfig>,
    addr: &str,
) -> Result<(), String> {
    // systemd's Type=notify: READY, WATCHDOG and STOPPING; inert without NOTIFY_SOCKET.
    let (notify, notify_error) = Notify::from_env(Instant::now());
    if let Some(e) = notify_error {
        eprintln!("ql-control: {e}; not notifying the service manager");
    }
    let notify: SharedNotify = Arc::new(Mutex::new(notify));
    let shutdown = shutdown_signal()?;
    // Every command of every part of the server is timed and counted.
    let metrics = Arc::new(crate::metrics::Metrics::new().stats_every(Duration::from_millis(config.metrics_stats_ms)));
    let store = crate::metrics::Measured::new(store, metrics.clone());
    // Before the first request: after an outage, the time no replica served is given back
    // to live leases and sessions, so no agent's request meets a lapse that was the
    // authority's own absence.
    sweep_once(&store).await;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("listening on {addr}: {e}"))?;
    let mut ingress_cfg = ingress_config(config);
    ingress_cfg.identity = Some(Arc::new(identity(layout, config)?));
    metrics.set_max_connections(ingress_cfg.max_connections);
    ingress_cfg.metrics = Some(metrics.clone());
    // What replicas must agree on: the webhook key (and, below, the dashboard's).
    let server_key = crate::keys::key_file(&layout.dir.join(&config.webhook_secret_file))?;
    // The operator API binds before anything is served, so a taken port stops serve
    // instead of leaving it without its operators' door.
    let operators = match config.operator_listen.as_str() {
        "" => None,
        addr => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("operator API: listening on {addr}: {e} (operator_listen, --operator-listen)"))?,
        ),
    };
    // Which store this replica writes to is the first thing to check when replicas
    // disagree about a log.
    eprintln!("ql-control: artifacts in {}", blobs.describe());
    let (leftovers, retained) = (blobs.clone(), blobs.clone());
    let ingress = http::spawn(listener, tls, store.clone(), blobs.clone(), ingress_cfg)
        .map_err(|e| format!("starting the ingress: {e}"))?;
    let api = match operators {
        None => None,
        Some(listener) => {
            let tls = http::tls::operator_config_from_dir(&layout.dir).map_err(|e| e.to_string())?;
            let local = crate::ops::Local { store: store.clone(), blobs };
            let dashboard_key = crate::keys::key_file(&layout.dir.join(&config.dashboard_secret_file))?;
            let web = crate::web::Web::new(
                &dashboard_key,
                Duration::from_millis(config.dashboard_session_ms),
                Duration::from_millis(config.operator_body_timeout_ms),
            );
            let api = api::spawn(listener, tls, local, api_config(config), Some(metrics.clone()), Some(web))
                .map_err(|e| format!("operator API: {e}"))?;
            Some(api)
        }
    };
    // Scripts and tests read these lines to learn the ports when they asked for port 0;
    // "listening on" comes last, and before READY=1, so whoever waited for it or for
    // `systemctl start` can read both.
    // A closed stdout (whoever started us stopped reading) is no reason to stop serving.
    let say = |line: &str| {
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), "{line}");
    };
    if let Some(api) = &api {
        say(&format!("operator API on https://{}", api.local_addr()));
    }
    let listening = format!("listening on https://{}", ingress.local_addr());
    say(&listening);
    notifying(&notify, |n| n.ready(&listening, Instant::now()));
    let every = notifying(&notify, |n| n.watchdog_every());
    let watchdog = every.map(|every| tokio::spawn(watchdog_forever(store.clone(), notify.clone(), every)));
    let notifier = {
        let key = &server_key;
        let timeout = Duration::from_millis(config.webhook_timeout_ms);
        let notifier =
            crate::notifier::Notifier::new(key, Path::new(&config.webhook_ca_file), timeout, config.delivery_policy());
        let every = Duration::from_millis(config.webhook_poll_ms);
        tokio::spawn(crate::notifier::notify_forever(store.clone(), Arc::new(notifier), every))
    };
    let every = Duration::from_millis(config.sweep_interval_ms);
    let sweeper =
        tokio::spawn(sweep_forever(store.clone(), every, config.audit_retention(), config.session_retention()));
    let pruner =
        config.run_retention().map(|runs| tokio::spawn(prune_runs_forever(store.clone(), retained, every, runs)));
    let collector = Collection::of(config)
        .map(|collection| tokio::spawn(collect_forever(leftovers, store.clone(), collection, Some(metrics.clone()))));
    shutdown.await;
    notifying(&notify, |n| n.stopping("stopping: finishing the requests in flight", None));
    sweeper.abort();
    if let Some(pruner) = pruner {
        pruner.abort();
    }
    notifier.abort();
    if let Some(collector) = collector {
        collector.abort();
    }
    let (connections, requests) = (ingress.stats().connections(), ingress.stats().requests());
    if let Some(api) = api {
        api.shutdown().await;
    }
    let result = ingress.shutdown().await.map_err(|e| format!("ingress: {e}"));
    // The watchdog pings on through the drain (harmless if systemd no longer watches once
    // the stop began), then ends with the server.
    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }
    eprintln!("ql-control: stopped after {connections} connection(s), {requests} request(s)");
    result
}

#[cfg(test)]
mod tests {
    use super::serving_threads;

    #[test]
    fn threads_follow_the_setting_or_else_the_store() {
        // (configured, PostgreSQL, cores) -> threads
        let cases = [
            ((0, false, 2), 1),
            ((0, false, 16), 1),
            ((0, true, 1), 1),
            ((0, true, 2), 1),
            ((0, true, 3), 2),
            ((0, true, 16), 2),
            ((1, true, 2), 1),
            ((3, false, 2), 3),
            ((1_000, true, 2), 64),
        ];
        for ((configured, postgres, cores), threads) in cases {
            assert_eq!(serving_threads(configured, postgres, cores), threads, "{configured} {postgres} {cores}");
        }
    }
}
