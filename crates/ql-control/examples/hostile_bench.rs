//! An honest worker's latency, and the server's memory, while others attack a running
//! `ql-control serve` over loopback. Run by `bench/hostile.sh`, which starts the server
//! with the limits `init` writes.
//!
//! Each phase keeps `--attackers N` hostile connections going (each one reopened as soon
//! as the server closes it, as a determined attacker would), waits `--settle-ms`, then
//! times `--samples` honest rounds of another worker: a fresh connection (TCP, TLS 1.3
//! handshake with its certificate), then a heartbeat and an offers poll answered on its
//! session (opened once: a second open would be refused as a twin's). It prints the p50, p95 and worst round, the server's RSS at the end of the phase and how
//! many attacker connections the server ended (closed, timed out or turned away). The
//! settle time outlasts the handshake timeout, so the reopening is part of the attack.
//!
//! - `none`: no attack, the baseline;
//! - `tcp`: plain TCP connections that never start a handshake, from one loopback address
//!   (no certificate needed); `tcp-spread`: the same from eight addresses;
//! - `trickle`: TLS connections with a valid worker certificate (another worker's) that
//!   send a request head one byte every 500 ms;
//! - `big-heads`: the same certificate, each connection sending a 400 KiB head with no end;
//! - `bad-tls`: connections that send a ClientHello-sized run of garbage.
//!
//! Usage: `hostile_bench --dir STATE --url https://127.0.0.1:PORT --server-pid PID`
//! `[--attackers 200] [--samples 30] [--settle-ms 6000] [--phases none,tcp,...]`

// Only its client is used here.
#[allow(dead_code)]
#[path = "../tests/common/worker_client.rs"]
mod worker_client;

use worker_client::post;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ql_control::pki::Enrolled;
use ql_wire::ids::WorkerId;
use ql_wire::offer::{Offers, PollOffers};
use ql_wire::route::Route;
use ql_wire::session::{Heartbeat, HeartbeatReply, OpenSession, SessionOpened};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

struct Args {
    dir: std::path::PathBuf,
    url: String,
    server_pid: u32,
    attackers: usize,
    samples: usize,
    settle: Duration,
    phases: Vec<String>,
}

fn args() -> Args {
    let mut a = Args {
        dir: "".into(),
        url: String::new(),
        server_pid: 0,
        attackers: 200,
        samples: 30,
        settle: Duration::from_millis(6_000),
        phases: ["none", "tcp", "tcp-spread", "trickle", "big-heads", "bad-tls"].map(String::from).to_vec(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--dir" => a.dir = value.into(),
            "--url" => a.url = value,
            "--server-pid" => a.server_pid = value.parse().expect("--server-pid"),
            "--attackers" => a.attackers = value.parse().expect("--attackers"),
            "--samples" => a.samples = value.parse().expect("--samples"),
            "--settle-ms" => a.settle = Duration::from_millis(value.parse().expect("--settle-ms")),
            "--phases" => a.phases = value.split(',').map(String::from).collect(),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn enrolled(dir: &std::path::Path, worker: &str) -> Enrolled {
    worker_client::enrolled(dir, &WorkerId::parse(worker).unwrap())
}

/// A rustls client configuration presenting `e`'s certificate (TLS 1.3, ring).
fn tls_config(e: &Enrolled) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(&e.ca).expect("ca")).expect("root");
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(&e.cert).expect("cert").map(|c| c.expect("cert")).collect();
    let key = PrivateKeyDer::from_pem_file(&e.key).expect("key");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .expect("client cert");
    Arc::new(config)
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn tls_connect(addr: SocketAddr, config: &Arc<rustls::ClientConfig>) -> std::io::Result<Tls> {
    let mut tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    tcp.set_write_timeout(Some(Duration::from_secs(10)))?;
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let mut conn = rustls::ClientConnection::new(config.clone(), name).map_err(std::io::Error::other)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)?;
    }
    Ok(Tls::new(conn, tcp))
}

/// Whether the server has closed `tcp`: what it sent is read and dropped until the end
/// (closed) or nothing more is waiting (open).
fn closed(tcp: &TcpStream) -> bool {
    let _ = tcp.set_nonblocking(true);
    let mut sink = [0u8; 4096];
    let gone = loop {
        match (&*tcp).read(&mut sink) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) => break e.kind() != std::io::ErrorKind::WouldBlock,
        }
    };
    let _ = tcp.set_nonblocking(false);
    gone
}

/// One attacker connection, reopened whenever the server ends it, until `stop`.
fn attack(
    kind: &str,
    index: usize,
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    stop: &AtomicBool,
    ended: &AtomicUsize,
) {
    let pause = Duration::from_millis(500);
    // `tcp` comes from one address, `tcp-spread` from eight.
    let spread = if kind == "tcp-spread" { 8 } else { 1 };
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build().expect("a runtime");
    while !stop.load(Ordering::Relaxed) {
        match kind {
            "tcp" | "tcp-spread" => {
                let from: SocketAddr = format!("127.0.0.{}:0", 2 + index % spread).parse().unwrap();
                let Ok(tcp) = connect_from(from, addr, &rt) else {
                    std::thread::sleep(pause);
                    continue;
                };
                while !stop.load(Ordering::Relaxed) && !closed(&tcp) {
                    std::thread::sleep(pause);
                }
            }
            "trickle" | "big-heads" => {
                let Ok(mut tls) = tls_connect(addr, &config) else {
                    std::thread::sleep(pause);
                    continue;
                };
                let head =
                    format!("POST /v1/workers/w-attacker/sessions HTTP/1.1\r\nx-pad: {}", "a".repeat(400 * 1024));
                if kind == "big-heads" {
                    let _ = tls.write_all(head.as_bytes()).and_then(|()| tls.flush());
                    while !stop.load(Ordering::Relaxed) && !closed(tls.get_ref()) {
                        std::thread::sleep(pause);
                    }
                } else {
                    for byte in head.as_bytes() {
                        if stop.load(Ordering::Relaxed)
                            || tls.write_all(std::slice::from_ref(byte)).and_then(|()| tls.flush()).is_err()
                        {
                            break;
                        }
                        std::thread::sleep(pause);
                    }
                }
            }
            "bad-tls" => {
                let Ok(mut tcp) = TcpStream::connect_timeout(&addr, Duration::from_secs(10)) else {
                    std::thread::sleep(pause);
                    continue;
                };
                let _ = tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).and_then(|()| tcp.write_all(&[0x55; 512]));
                while !stop.load(Ordering::Relaxed) && !closed(&tcp) {
                    std::thread::sleep(pause);
                }
            }
            other => panic!("unknown attack {other}"),
        }
        if !stop.load(Ordering::Relaxed) {
            ended.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A plain TCP connection from `from` (another loopback address): std cannot bind before
/// it connects, tokio's `TcpSocket` can.
fn connect_from(from: SocketAddr, to: SocketAddr, rt: &tokio::runtime::Runtime) -> std::io::Result<TcpStream> {
    let tcp = rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(from)?;
        socket.connect(to).await?.into_std()
    })?;
    tcp.set_nonblocking(false)?;
    Ok(tcp)
}

/// The honest worker's session, opened once: a worker whose session speaks is not given
/// another (a twin would be refused).
fn honest_session(e: &Enrolled, url: &str) -> SessionOpened {
    let agent = worker_client::client(e, Duration::from_secs(60));
    let open = OpenSession {
        agent_version: "bench".parse().unwrap(),
        arch: std::env::consts::ARCH.parse().unwrap(),
        labels: Default::default(),
        capacity: 1,
    };
    post(&agent, url, &Route::OpenSession(WorkerId::parse("w-honest").unwrap()), &open)
}

/// One honest round on a fresh connection: a heartbeat, then a poll.
fn honest_round(e: &Enrolled, url: &str, session: &SessionOpened) -> Duration {
    let worker = WorkerId::parse("w-honest").unwrap();
    let started = Instant::now();
    let agent = worker_client::client(e, Duration::from_secs(60));
    let beat = Heartbeat { generation: session.generation, draining: false };
    let _: HeartbeatReply = post(&agent, url, &Route::Heartbeat(worker.clone(), session.session_id.clone()), &beat);
    let poll = PollOffers { generation: session.generation, wait_ms: 0, max: 1 };
    let _: Offers = post(&agent, url, &Route::PollOffers(worker, session.session_id.clone()), &poll);
    started.elapsed()
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()))
        .unwrap_or(0)
}

fn main() {
    let a = args();
    let addr: SocketAddr = a.url.trim_start_matches("https://").parse().expect("--url https://IP:PORT");
    let honest = enrolled(&a.dir, "w-honest");
    let session = honest_session(&honest, &a.url);
    let attacker = tls_config(&enrolled(&a.dir, "w-attacker"));
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>12} {:>16}",
        "attack", "p50 ms", "p95 ms", "max ms", "server RSS", "server ended"
    );
    for phase in &a.phases {
        let stop = Arc::new(AtomicBool::new(false));
        let ended = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = if phase == "none" {
            Vec::new()
        } else {
            (0..a.attackers)
                .map(|i| {
                    let (kind, config, stop, ended) = (phase.clone(), attacker.clone(), stop.clone(), ended.clone());
                    std::thread::spawn(move || attack(&kind, i, addr, config, &stop, &ended))
                })
                .collect()
        };
        std::thread::sleep(a.settle);
        let mut times: Vec<Duration> = (0..a.samples).map(|_| honest_round(&honest, &a.url, &session)).collect();
        times.sort();
        let at = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3;
        let rss = rss_kib(a.server_pid, "VmRSS:");
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        println!(
            "{:<10} {:>9.1} {:>9.1} {:>9.1} {:>9} KiB {:>16}",
            phase,
            at(0.5),
            at(0.95),
            at(1.0),
            rss,
            ended.load(Ordering::Relaxed)
        );
    }
    println!("server peak RSS (VmHWM): {} KiB", rss_kib(a.server_pid, "VmHWM:"));
}
