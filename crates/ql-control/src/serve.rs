//! `ql-control serve`: the HTTPS ingress and the sweeper, on one Tokio runtime.
//!
//! The authority is the state directory's SQLite file by default, or the PostgreSQL
//! database `--database` names; either way the same generic server runs over it. Every
//! replica of a PostgreSQL deployment runs this same command against the same database.
//!
//! The sweeper runs here on a timer; it is idempotent and safe on every replica. On
//! SIGTERM or Ctrl-C the ingress stops accepting, lets in-flight requests finish, and
//! the process prints what it served (connections, requests) before it exits.

use std::path::Path;
use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, Layout};
use crate::core::{Command, Reply};
use crate::http::{self, IngressConfig};
use crate::store::postgres::{PgOptions, PgStore};
use crate::store::sqlite::{SqliteOptions, SqliteStore};
use crate::store::Store;

/// The ingress settings a [`Config`] implies.
pub fn ingress_config(config: &Config) -> IngressConfig {
    IngressConfig {
        header_read_timeout: Duration::from_millis(config.idle_timeout_ms),
        body_idle_timeout: Duration::from_millis(config.read_timeout_ms),
        ..IngressConfig::default()
    }
}

/// Sweeps lapsed offers, sessions and leases every `every`, for ever.
pub async fn sweep_forever<S: Store>(store: S, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match store.execute(Command::Sweep).await {
            Ok(Ok(Reply::Swept(n))) if n > 0 => eprintln!("ql-control: swept {n} lapsed row(s)"),
            Ok(_) => {}
            Err(e) => eprintln!("ql-control: sweep failed: {e}"),
        }
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Runs the server until SIGTERM or Ctrl-C, on the SQLite file of `dir`, or on the
/// PostgreSQL database `database` names (connected as the runtime role).
pub fn run(dir: &Path, listen: Option<String>, database: Option<String>) -> Result<(), String> {
    let layout = Layout::new(dir);
    let config = Config::load(&layout)?;
    let addr = listen.unwrap_or_else(|| config.listen.clone());
    let tls = http::tls::server_config_from_dir(dir).map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    runtime.block_on(async move {
        match database {
            Some(url) => {
                if !crate::admin::is_postgres(&url) {
                    return Err("--database takes a postgres://... URL".to_owned());
                }
                let options = PgOptions { timings: config.timings(), ..PgOptions::default() };
                let store = PgStore::open(&url, options).await.map_err(|e| e.to_string())?;
                serve_on(store, &layout, &config, tls, &addr).await
            }
            None => {
                let options = SqliteOptions {
                    timings: config.timings(),
                    clock_offset: Arc::new(AtomicI64::new(0)),
                    watch_tick: Duration::from_millis(config.change_poll_ms),
                    ..SqliteOptions::default()
                };
                let store = SqliteStore::open_with_options(layout.database(), options).map_err(|e| e.to_string())?;
                serve_on(store, &layout, &config, tls, &addr).await
            }
        }
    })
}

/// The server over any store: ingress, sweeper, and a clean stop on a signal.
async fn serve_on<S: Store>(
    store: S,
    layout: &Layout,
    config: &Config,
    tls: Arc<rustls::ServerConfig>,
    addr: &str,
) -> Result<(), String> {
    let blobs = crate::blob::fs::FsBlobStore::open(layout.artifacts()).map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("listening on {addr}: {e}"))?;
    let ingress = http::spawn(listener, tls, store.clone(), blobs, ingress_config(config))
        .map_err(|e| format!("starting the ingress: {e}"))?;
    // Scripts and tests read this line to learn the port when they asked for port 0.
    println!("listening on https://{}", ingress.local_addr());
    let sweeper = tokio::spawn(sweep_forever(store, Duration::from_millis(config.sweep_interval_ms)));
    shutdown_signal().await;
    sweeper.abort();
    let (connections, requests) = (ingress.stats().connections(), ingress.stats().requests());
    let result = ingress.shutdown().await.map_err(|e| format!("ingress: {e}"));
    eprintln!("ql-control: stopped after {connections} connection(s), {requests} request(s)");
    result
}
