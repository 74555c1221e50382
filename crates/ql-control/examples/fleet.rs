//! A fleet of idle agents against one running `ql-control serve`: each its own worker with
//! its own certificate on one mTLS keep-alive connection, opening a session and then
//! long-polling for offers at the shipped agent's cadence. Run by `bench/fleet`, which
//! starts the server and reads its memory and CPU.
//!
//! Usage: `fleet --dir STATE --url https://127.0.0.1:PORT --operator https://127.0.0.1:PORT`
//! `--token-file FILE --server-pid PID --agents N [--ramp R] [--hold S] [--offers K]`
//! `[--poll-wait-ms W] [--heartbeats]`
//!
//! It ramps to N agents at R new connections a second, waits until every one holds a
//! session, measures the server's RSS, then lets the fleet idle for S seconds (the
//! server's CPU, in percent of one core, and the requests a second over that window), and
//! then submits K runs, one every 200 ms, each for one agent picked at random (an agent
//! label only that agent declares), through the operator API: the time from the submit to
//! the offer reaching its agent is the offer latency. Each offered run is cancelled at
//! once, so the fleet stays idle. It prints, in one run: agents connected, the server's
//! RSS before and with the fleet and per agent, idle CPU and requests a second, offer
//! latency p50 / p99 / max and the CPU while offering, drops and reconnects. Last, the
//! same K offers again while an operator pages through the workers (500 a page, as the
//! dashboard shows them), one page after another, from the first again after the last:
//! the pages' time and the offers' latency meanwhile.
//!
//! The cadence is the shipped agent's: a poll proves the session alive, so an idle agent
//! sends one long-poll after another (`--poll-wait-ms`, default 25000). `--heartbeats` is
//! an older agent's instead: polls end at the next heartbeat (the server's `heartbeatMs`),
//! and a heartbeat goes out between them.
//!
//! The client speaks HTTP/1.1 by hand over tokio-rustls: one request at a time per
//! connection, as the agent does, in a few kilobytes per agent, so ten thousand of them fit
//! beside the server on one machine.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use ql_control::ops::view::SubmitBody;
use ql_control::ops::{Remote, RemoteOptions};
use ql_wire::ids::{Counter, RunId, SessionId, WorkerId};
use ql_wire::offer::{Offers, PollOffers};
use ql_wire::route::Route;
use ql_wire::session::{Heartbeat, OpenSession, SessionOpened};

struct Args {
    dir: PathBuf,
    url: String,
    operator: String,
    token_file: PathBuf,
    server_pid: u32,
    agents: usize,
    ramp: u64,
    hold: u64,
    offers: usize,
    poll_wait_ms: u64,
    heartbeats: bool,
}

fn args() -> Args {
    let mut a = Args {
        dir: PathBuf::new(),
        url: String::new(),
        operator: String::new(),
        token_file: PathBuf::new(),
        server_pid: 0,
        agents: 100,
        ramp: 500,
        hold: 60,
        offers: 100,
        poll_wait_ms: 25_000,
        heartbeats: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--heartbeats" {
            a.heartbeats = true;
            continue;
        }
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--dir" => a.dir = value.into(),
            "--url" => a.url = value,
            "--operator" => a.operator = value,
            "--token-file" => a.token_file = value.into(),
            "--server-pid" => a.server_pid = value.parse().expect("--server-pid"),
            "--agents" => a.agents = value.parse().expect("--agents"),
            "--ramp" => a.ramp = value.parse().expect("--ramp"),
            "--hold" => a.hold = value.parse().expect("--hold"),
            "--offers" => a.offers = value.parse().expect("--offers"),
            "--poll-wait-ms" => a.poll_wait_ms = value.parse().expect("--poll-wait-ms"),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// What every agent adds to, read by the main task.
#[derive(Default)]
struct Tally {
    sessions: AtomicU64,
    requests: AtomicU64,
    drops: AtomicU64,
    reconnects: AtomicU64,
    /// Offer latencies in microseconds.
    latencies: Mutex<Vec<u64>>,
}

/// Per agent: when the run meant for it was submitted, so its poll can time the offer.
type Waiting = Arc<Mutex<HashMap<usize, Instant>>>;

/// One HTTP/1.1 keep-alive connection, one request at a time.
struct Conn {
    stream: BufReader<TlsStream<TcpStream>>,
}

impl Conn {
    async fn open(connector: &TlsConnector, addr: &str) -> std::io::Result<Self> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_owned();
        let name = ServerName::try_from(host).map_err(std::io::Error::other)?;
        let tls = connector.connect(name, tcp).await?;
        Ok(Self { stream: BufReader::with_capacity(2048, tls) })
    }

    /// POSTs `body` to `path`; the status and the answer's body.
    async fn post(&mut self, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: ql\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let tls = self.stream.get_mut();
        tls.write_all(head.as_bytes()).await?;
        tls.write_all(body).await?;
        tls.flush().await?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await?;
        let status = line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("no status line: {line:?}"))
        })?;
        let mut length = 0usize;
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut answer = vec![0; length];
        self.stream.read_exact(&mut answer).await?;
        Ok((status, answer))
    }
}

fn connector(a: &Args, worker: &WorkerId, ca: &ql_control::pki::Ca) -> TlsConnector {
    let key = rcgen::KeyPair::generate().expect("a key");
    let issued = ca.issue(worker, &key, Duration::from_secs(86_400)).expect("a certificate");
    let cert = CertificateDer::from_pem_slice(issued.pem.as_bytes()).expect("the certificate's PEM");
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut roots = rustls::RootCertStore::empty();
    let ca_pem = std::fs::read(a.dir.join("pki/ca.crt")).expect("ca.crt");
    roots.add(CertificateDer::from_pem_slice(&ca_pem).expect("ca.crt's PEM")).expect("the CA");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![cert], key)
        .expect("a client certificate");
    TlsConnector::from(Arc::new(config))
}

use rustls::pki_types::pem::PemObject as _;

/// One agent for ever: connect, open a session, poll; on any failure, reconnect.
async fn agent(index: usize, addr: String, connector: TlsConnector, a: Arc<Args>, tally: Arc<Tally>, waiting: Waiting) {
    let worker = WorkerId::parse(format!("fleet-{index}")).unwrap();
    let mut first = true;
    loop {
        if !first {
            tally.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        first = false;
        let Ok(mut conn) = Conn::open(&connector, &addr).await else {
            tally.drops.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        if session_loop(index, &worker, &mut conn, &a, &tally, &waiting).await.is_err() {
            tally.drops.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn session_loop(
    index: usize,
    worker: &WorkerId,
    conn: &mut Conn,
    a: &Args,
    tally: &Tally,
    waiting: &Waiting,
) -> std::io::Result<()> {
    let open = OpenSession {
        agent_version: "fleet".parse().unwrap(),
        arch: std::env::consts::ARCH.parse().unwrap(),
        labels: [("fleet".parse().unwrap(), format!("a{index}").parse().unwrap())].into(),
        capacity: 1,
    };
    let (status, body) = conn.post(&Route::OpenSession(worker.clone()).path(), &ql_wire::encode(&open)).await?;
    tally.requests.fetch_add(1, Ordering::Relaxed);
    if status != 201 {
        return Err(std::io::Error::other(format!("open: {status} {}", String::from_utf8_lossy(&body))));
    }
    let opened: SessionOpened = ql_wire::decode(&body).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    tally.sessions.fetch_add(1, Ordering::Relaxed);
    let result =
        polls(index, worker, &opened.session_id, opened.generation, opened.heartbeat_ms, conn, a, tally, waiting).await;
    tally.sessions.fetch_sub(1, Ordering::Relaxed);
    result
}

#[allow(clippy::too_many_arguments)] // One agent's state, passed down once.
async fn polls(
    index: usize,
    worker: &WorkerId,
    session: &SessionId,
    generation: Counter,
    heartbeat_ms: u64,
    conn: &mut Conn,
    a: &Args,
    tally: &Tally,
    waiting: &Waiting,
) -> std::io::Result<()> {
    let heartbeat = Duration::from_millis(heartbeat_ms);
    let poll_path = Route::PollOffers(worker.clone(), session.clone()).path();
    let beat_path = Route::Heartbeat(worker.clone(), session.clone()).path();
    let mut beat_at = Instant::now() + heartbeat;
    let mut offered: Option<RunId> = None;
    loop {
        if a.heartbeats && Instant::now() >= beat_at {
            let (status, _) =
                conn.post(&beat_path, &ql_wire::encode(&Heartbeat { generation, draining: false })).await?;
            tally.requests.fetch_add(1, Ordering::Relaxed);
            if status != 200 {
                return Err(std::io::Error::other(format!("heartbeat: {status}")));
            }
            beat_at = Instant::now() + heartbeat;
        }
        let mut wait = Duration::from_millis(a.poll_wait_ms);
        if a.heartbeats {
            wait = wait.min(beat_at.saturating_duration_since(Instant::now()));
        }
        let body = PollOffers { generation, wait_ms: wait.as_millis() as u64, max: 1 };
        let (status, answer) = conn.post(&poll_path, &ql_wire::encode(&body)).await?;
        tally.requests.fetch_add(1, Ordering::Relaxed);
        if status != 200 {
            return Err(std::io::Error::other(format!("poll: {status} {}", String::from_utf8_lossy(&answer))));
        }
        let offers: Offers = ql_wire::decode(&answer).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
        match offers.offers.first() {
            Some(offer) if offered.as_ref() != Some(&offer.run_id) => {
                if let Some(at) = waiting.lock().unwrap().remove(&index) {
                    tally.latencies.lock().unwrap().push(at.elapsed().as_micros() as u64);
                }
                offered = Some(offer.run_id.clone());
            }
            // The same offer until the cancel lands: not a busy loop.
            Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            None => {}
        }
    }
}

/// The server's resident set and CPU time so far.
fn server_usage(pid: u32) -> (u64, Duration) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command's closing parenthesis: field 14 and 15 of the whole line.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|f| f.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|f| f.parse().ok()).unwrap_or(0);
    // USER_HZ is 100 on Linux.
    (rss_kb * 1024, Duration::from_millis(ticks * 10))
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

fn main() {
    let a = Arc::new(args());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    runtime.block_on(run(a));
}

async fn run(a: Arc<Args>) {
    let addr = a.url.trim_start_matches("https://").trim_end_matches('/').to_owned();
    let ca = ql_control::pki::Ca::load(&a.dir).expect("the state directory's CA");
    let tally = Arc::new(Tally::default());
    let waiting: Waiting = Arc::default();
    let (rss_before, _) = server_usage(a.server_pid);
    let ramp_started = Instant::now();
    let mut connectors = Vec::with_capacity(a.agents);
    for i in 0..a.agents {
        connectors.push(connector(&a, &WorkerId::parse(format!("fleet-{i}")).unwrap(), &ca));
    }
    eprintln!("{} certificates issued in {:.1} s", a.agents, ramp_started.elapsed().as_secs_f64());
    let ramp_started = Instant::now();
    let every = Duration::from_micros(1_000_000 / a.ramp.max(1));
    for (i, connector) in connectors.into_iter().enumerate() {
        tokio::spawn(agent(i, addr.clone(), connector, a.clone(), tally.clone(), waiting.clone()));
        tokio::time::sleep_until((ramp_started + every * i as u32).into()).await;
    }
    // Every agent holds a session (or the ramp gives up after a minute more).
    let deadline = Instant::now() + Duration::from_secs(60);
    while (tally.sessions.load(Ordering::Relaxed) as usize) < a.agents && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ramp = ramp_started.elapsed();
    // Let the first polls settle into their cadence before measuring.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (rss_with, cpu_start) = server_usage(a.server_pid);
    let drops_start = tally.drops.load(Ordering::Relaxed);
    let requests_start = tally.requests.load(Ordering::Relaxed);
    let idle_started = Instant::now();
    // The idle window: nothing but the fleet's own cadence.
    tokio::time::sleep(Duration::from_secs(a.hold)).await;
    let idled = idle_started.elapsed();
    let (rss_idle, cpu_idle) = server_usage(a.server_pid);
    let requests = tally.requests.load(Ordering::Relaxed) - requests_start;
    let idle_cpu = (cpu_idle - cpu_start).as_secs_f64() / idled.as_secs_f64() * 100.0;

    // Then the offers, one every 200 ms, each to an agent picked at random.
    let remote = {
        let token = ql_control::pki::read_secret(&a.token_file).expect("the operator token");
        let options = RemoteOptions {
            server: a.operator.clone(),
            token: zeroize::Zeroizing::new(token.trim().to_owned()),
            ca: a.dir.join("pki/ca.crt"),
            timeout: Duration::from_secs(30),
        };
        Arc::new(Remote::new(&options).expect("the operator API"))
    };
    let offers_started = Instant::now();
    offer(&a, &remote, &waiting).await;
    let offering = offers_started.elapsed();
    let (rss_end, cpu_end) = server_usage(a.server_pid);
    let offer_cpu = (cpu_end - cpu_idle).as_secs_f64() / offering.as_secs_f64() * 100.0;
    let mut latencies = tally.latencies.lock().unwrap().clone();
    latencies.sort_unstable();
    let connected = tally.sessions.load(Ordering::Relaxed);
    let per_agent = rss_with.saturating_sub(rss_before) / a.agents.max(1) as u64;
    let mib = |b: u64| b as f64 / 1_048_576.0;
    println!(
        "agents {connected}/{} (ramp {:.1} s) | server RSS {:.1} MiB before, {:.1} MiB with the fleet ({:.1} KiB per agent), {:.1} MiB after the idle window, {:.1} MiB at the end",
        a.agents,
        ramp.as_secs_f64(),
        mib(rss_before),
        mib(rss_with),
        per_agent as f64 / 1024.0,
        mib(rss_idle),
        mib(rss_end)
    );
    println!(
        "idle {:.0} s: server CPU {idle_cpu:.1} % of one core, {:.1} requests/s, {} drops | {} offers in {:.0} s: server CPU {offer_cpu:.1} %, reached {}, latency p50 {:.0} / p99 {:.0} / max {:.0} ms | drops {} and reconnects {} in all",
        idled.as_secs_f64(),
        requests as f64 / idled.as_secs_f64(),
        tally.drops.load(Ordering::Relaxed) - drops_start,
        a.offers,
        offering.as_secs_f64(),
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        percentile(&latencies, 1.0),
        tally.drops.load(Ordering::Relaxed),
        tally.reconnects.load(Ordering::Relaxed),
    );

    // The same offers again while an operator pages through the workers (the dashboard's
    // 500 a page), one page after another: what an operator's reads cost the fleet.
    tally.latencies.lock().unwrap().clear();
    let listing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let lister = {
        let (remote, listing) = (remote.clone(), listing.clone());
        tokio::task::spawn_blocking(move || {
            let (mut took, mut after) = (Vec::new(), None);
            while listing.load(Ordering::Relaxed) {
                let started = Instant::now();
                let page = remote.workers(500, after.as_deref()).expect("the workers' list");
                took.push(started.elapsed().as_micros() as u64);
                after = page.next;
            }
            took
        })
    };
    offer(&a, &remote, &waiting).await;
    listing.store(false, Ordering::Relaxed);
    let mut lists = lister.await.unwrap();
    lists.sort_unstable();
    let mut latencies = tally.latencies.lock().unwrap().clone();
    latencies.sort_unstable();
    println!(
        "while an operator pages through the workers, 500 a page ({} pages, p50 {:.0} / max {:.0} ms): {} offers reached {}, latency p50 {:.0} / p99 {:.0} / max {:.0} ms",
        lists.len(),
        percentile(&lists, 0.5),
        percentile(&lists, 1.0),
        a.offers,
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        percentile(&latencies, 1.0),
    );
}

/// Submits `a.offers` runs, one every 200 ms, each to an agent picked at random, and
/// cancels each once offered (or given up on), so the fleet stays idle.
async fn offer(a: &Args, remote: &Arc<Remote>, waiting: &Waiting) {
    let offers_started = Instant::now();
    let mut cancels = Vec::new();
    for k in 0..a.offers {
        tokio::time::sleep_until((offers_started + Duration::from_millis(200) * k as u32).into()).await;
        // A pseudo-random agent: a multiplicative hash of k.
        let index = (k.wrapping_mul(2_654_435_761) ^ (k >> 3)) % a.agents;
        let body = SubmitBody {
            argv: Some(vec!["true".into()]),
            agent_labels: BTreeMap::from([("fleet".into(), format!("a{index}"))]),
            ..serde_json::from_str("{}").unwrap()
        };
        waiting.lock().unwrap().insert(index, Instant::now());
        let (remote, waiting) = (remote.clone(), waiting.clone());
        cancels.push(tokio::task::spawn_blocking(move || {
            let done = remote.submit(&body).expect("submit");
            let run = RunId::parse(done.run_id.expect("a run id")).expect("a run id");
            // Cancelled once offered (or given up on), so the fleet stays idle.
            let offered_by = Instant::now() + Duration::from_secs(10);
            while waiting.lock().unwrap().contains_key(&index) && Instant::now() < offered_by {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = remote.cancel(&run);
        }));
    }
    for cancel in cancels {
        let _ = cancel.await;
    }
}
