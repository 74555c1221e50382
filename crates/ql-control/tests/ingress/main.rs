//! The worker ingress over real TLS 1.3 with real certificates from `pki`, a real
//! listener on 127.0.0.1, the SQLite store and the local-files artifact store.
//!
//! Two clients: ureq configured the way the agent is (ring provider filtered to TLS 1.3
//! suites, only the worker CA as root, the worker's client certificate, HTTP statuses as
//! values), and a raw rustls client over a std `TcpStream` that writes HTTP/1.1 bytes by
//! hand, for everything a well-behaved client would never send.
//!
//! No test sleeps to synchronise: each waits for a condition with a deadline.

use std::collections::BTreeMap;
use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned, SupportedProtocolVersion};

use ql_control::blob::fs::FsBlobStore;
use ql_control::blob::{ArtifactKey, BlobError, BlobStore, Collected, Recorded, Recording, Remembering};
use ql_control::core::{Command, Reply, Submit, Timings};
use ql_control::http::{self, IngressConfig, IngressStats};
use ql_control::model::AuditRecord;
use ql_control::pki::{self, PkiPaths};
use ql_control::store::sqlite::{SqliteOptions, SqliteStore};
use ql_control::store::{Snapshot, Store as _};
use ql_wire::ack::{Abandon, AckReply, Running, StartFailure};
use ql_wire::artifact::{ArtifactHeader, ArtifactReply, ArtifactSchema, Receipt};
use ql_wire::capability::{Digest, Token};
use ql_wire::completion::{Completion, CompletionReply, CompletionSchema, TerminalStatus};
use ql_wire::frame::encode_prefix;
use ql_wire::ids::{ArtifactId, Counter, ProjectId, RunId, SessionId, WorkerId};
use ql_wire::lease::Renewed;
use ql_wire::log::{LogAppendReply, LogChunkHeader, LogChunkSchema, Seal};
use ql_wire::offer::{Claim, Claimed, Offers, PollOffers};
use ql_wire::route::{AttemptCommand, AttemptPath, Route, ARTIFACT_MEDIA_TYPE, JSON_MEDIA_TYPE, LOG_CHUNK_MEDIA_TYPE};
use ql_wire::session::{Heartbeat, HeartbeatReply, OpenSession, SessionOpened, SessionStatus};
use ql_wire::spec::{ExecutionSpec, SpecSchema};
use ql_wire::text::{ExecutorHandle, Reason};
use ql_wire::time::Timestamp;
use ql_wire::{Body, ErrorBody, ErrorCode, Fence, Outcome};

/// How long any one wait in these tests may take before it is a failure.
const PATIENCE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------
// The server under test.

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let mut rnd = [0u8; 8];
        getrandom::getrandom(&mut rnd).unwrap();
        let suffix: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        let path = std::env::temp_dir().join(format!("ql-ingress-{name}-{suffix}"));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Short timeouts so the tests that wait for one finish quickly; long enough that a slow
/// machine never trips the others.
fn test_config() -> IngressConfig {
    IngressConfig {
        handshake_timeout: Duration::from_secs(10),
        header_read_timeout: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(30),
        body_idle_timeout: Duration::from_millis(500),
        upload_grace: Duration::from_secs(5),
        min_upload_rate: 64 * 1024,
        max_poll_wait: Duration::from_secs(10),
        linger_timeout: Duration::from_secs(2),
        max_connections: 64,
        max_handshakes: 64,
        max_handshakes_per_ip: 64,
        max_connections_per_worker: 64,
        max_header_bytes: 16 * 1024,
        shutdown_grace: Duration::from_secs(2),
        accept_backoff: Duration::from_millis(10),
        report_every: Duration::from_secs(10),
        max_anonymous_connections: 4,
        max_anonymous_connections_per_ip: 4,
        identity: None,
        metrics: None,
    }
}

struct Server {
    // Field order is drop order: the ingress stops before the runtime goes.
    ingress: Option<http::Ingress>,
    rt: tokio::runtime::Runtime,
    store: SqliteStore,
    blobs: FsBlobStore,
    addr: SocketAddr,
    pki: PkiPaths,
    dir: TempDir,
}

impl Server {
    fn start(name: &str) -> Self {
        Self::start_with(name, test_config())
    }

    fn start_with(name: &str, mut cfg: IngressConfig) -> Self {
        let dir = TempDir::new(name);
        let pki = pki::init_pki(dir.path(), &["127.0.0.1".into(), "localhost".into()]).unwrap();
        cfg.identity = Some(Arc::new(http::identity::Identity {
            ca_pem: std::fs::read_to_string(&pki.ca_cert).unwrap(),
            ca: Some(pki::Ca::load(dir.path()).unwrap()),
            lifetime: pki::WORKER_VALIDITY,
        }));
        let tls = http::tls::server_config_from_dir(dir.path()).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let timings = Timings {
            heartbeat_ms: 1_000,
            session_ttl_ms: 600_000,
            offer_ttl_ms: 600_000,
            lease_ttl_ms: 600_000,
            outage_after_ms: 600_000,
            takeover_after_ms: 0,
            missed_after_ms: 60_000,
            ..Timings::default()
        };
        let options = SqliteOptions { timings, ..SqliteOptions::default() };
        let store = SqliteStore::open_with_options(dir.path().join("authority.db"), options).unwrap();
        let blobs = FsBlobStore::open(dir.path().join("artifacts")).unwrap();
        let ingress = rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            http::spawn(listener, tls, store.clone(), blobs.clone(), cfg).unwrap()
        });
        let addr = ingress.local_addr();
        Self { ingress: Some(ingress), rt, store, blobs, addr, pki, dir }
    }

    fn stats(&self) -> &IngressStats {
        self.ingress.as_ref().unwrap().stats()
    }

    fn snapshot(&self) -> Snapshot {
        self.rt.block_on(self.store.snapshot()).unwrap()
    }

    fn audits(&self) -> Vec<AuditRecord> {
        self.rt.block_on(self.store.audits()).unwrap()
    }

    fn inspect(&self, key: &ArtifactKey) -> Option<Receipt> {
        self.rt.block_on(self.blobs.inspect(key)).unwrap()
    }

    fn submit(&self) -> RunId {
        self.submit_for(BTreeMap::new())
    }

    /// Queues a run that needs the operator's `labels` of its worker.
    fn submit_for(&self, labels: BTreeMap<String, String>) -> RunId {
        self.submit_with(labels, 0)
    }

    fn submit_with(&self, labels: BTreeMap<String, String>, retry_budget: u32) -> RunId {
        let spec = ExecutionSpec {
            schema: SpecSchema,
            project_id: project(),
            argv: Some(vec!["true".into()]),
            script: None,
            env: BTreeMap::new(),
            timeout_ms: 600_000,
            log_limit_bytes: 1024 * 1024,
        };
        let submit =
            Submit { project: project(), spec, labels, agent_labels: BTreeMap::new(), retry_budget, notify: None };
        match self.rt.block_on(self.store.execute(Command::Submit(submit))).unwrap() {
            Ok(Reply::Submitted(run)) => run,
            other => panic!("submit: {other:?}"),
        }
    }

    /// Enrols `worker` under this server's CA (once) and returns its PEM material.
    fn enroll(&self, worker: &str) -> Creds {
        let out = self.dir.path().join("agents").join(worker);
        let (cert, key) = (out.join(format!("{worker}.crt")), out.join(format!("{worker}.key")));
        if !cert.exists() {
            pki::enroll(self.dir.path(), &wid(worker), &out, pki::WORKER_VALIDITY).unwrap();
        }
        Creds::read(&out.join("ca.crt"), &cert, &key)
    }

    /// Another certificate of `worker`, issued beside its first (`name` tells them apart).
    fn second_certificate(&self, worker: &str, name: &str) -> Creds {
        let out = self.dir.path().join("agents").join(format!("{worker}-{name}"));
        pki::enroll(self.dir.path(), &wid(worker), &out, pki::WORKER_VALIDITY).unwrap();
        Creds::read(&out.join("ca.crt"), &out.join(format!("{worker}.crt")), &out.join(format!("{worker}.key")))
    }

    fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(&self.pki.ca_cert).unwrap()
    }

    /// A ureq client set up like the agent's, for `worker`.
    fn client(&self, worker: &str) -> Client {
        Client::new(self.addr, &self.enroll(worker), wid(worker))
    }

    /// A raw TLS 1.3 client for `worker`.
    fn raw(&self, worker: &str) -> Raw {
        let creds = self.enroll(worker);
        Raw::connect(self.addr, client_config(&self.ca_pem(), Some(&creds), &[&rustls::version::TLS13])).unwrap()
    }

    /// Waits until the server's counters satisfy `cond`.
    fn wait_for(&self, what: &str, cond: impl Fn(&IngressStats) -> bool) {
        wait_until(what, || cond(self.stats()));
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(ingress) = self.ingress.take() {
            let _ = self.rt.block_on(ingress.shutdown());
        }
    }
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        // A poll interval, not a synchronisation: the condition decides.
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wid(s: &str) -> WorkerId {
    WorkerId::parse(s).unwrap()
}

fn project() -> ProjectId {
    ProjectId::parse("default").unwrap()
}

fn now() -> Timestamp {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    Timestamp::from_millis(i64::try_from(ms).unwrap()).unwrap()
}

/// A client's PEM material.
struct Creds {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Creds {
    fn read(ca: &Path, cert: &Path, key: &Path) -> Self {
        Self { ca: std::fs::read(ca).unwrap(), cert: std::fs::read(cert).unwrap(), key: std::fs::read(key).unwrap() }
    }
}

// ---------------------------------------------------------------------------------------
// The agent-like client.

/// ring, with only the TLS 1.3 cipher suites: ureq has no protocol-version setting, so
/// this is how the agent refuses anything older.
fn tls13_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.retain(|suite| suite.version() == &rustls::version::TLS13);
    Arc::new(provider)
}

struct Client {
    agent: ureq::Agent,
    base: String,
    worker: WorkerId,
}

/// A status and a body.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: Vec<u8>,
}

impl Answer {
    fn json<T: Body>(&self, status: u16) -> T {
        assert_eq!(self.status, status, "body: {}", String::from_utf8_lossy(&self.body));
        ql_wire::decode::<T>(&self.body).unwrap()
    }

    /// The acknowledged length a `log_offset_conflict` carries.
    fn log_conflict(&self) -> u64 {
        assert_eq!(self.error(), ErrorCode::LogOffsetConflict);
        ql_wire::decode::<ErrorBody>(&self.body).unwrap().acked.expect("the acknowledged length")
    }

    fn error(&self) -> ErrorCode {
        let body: ErrorBody = serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not an error body: {}", String::from_utf8_lossy(&self.body)));
        assert_eq!(self.status, body.error.status(), "status matches the code");
        body.error
    }
}

impl Client {
    /// The agent trusts the CA that came with its enrolment, and nothing else.
    fn new(addr: SocketAddr, creds: &Creds, worker: WorkerId) -> Self {
        use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};
        let root = Certificate::from_pem(&creds.ca).unwrap();
        let cert = Certificate::from_pem(&creds.cert).unwrap();
        let key = PrivateKey::from_pem(&creds.key).unwrap();
        let tls = TlsConfig::builder()
            .provider(TlsProvider::Rustls)
            .root_certs(RootCerts::new_with_certs(&[root]))
            .client_cert(Some(ClientCert::new_with_certs(&[cert], key)))
            .unversioned_rustls_crypto_provider(tls13_provider())
            .build();
        let agent = ureq::Agent::config_builder()
            .tls_config(tls)
            .http_status_as_error(false)
            .timeout_global(Some(PATIENCE))
            .build()
            .new_agent();
        Self { agent, base: format!("https://{addr}"), worker }
    }

    fn post<T: Body>(&self, route: &Route, body: &T) -> Answer {
        self.post_bytes(route, &ql_wire::encode(body))
    }

    fn post_bytes(&self, route: &Route, body: &[u8]) -> Answer {
        let mut response = self
            .agent
            .post(format!("{}{}", self.base, route.path()))
            .header("content-type", JSON_MEDIA_TYPE)
            .send(body)
            .unwrap();
        let status = response.status().as_u16();
        Answer { status, body: response.body_mut().read_to_vec().unwrap() }
    }

    /// Streams an artifact frame the way the agent does: explicit length, `Expect:
    /// 100-continue`, a reader body.
    fn put_artifact(&self, route: &Route, frame: &[u8]) -> Answer {
        let mut reader = frame;
        let mut response = self
            .agent
            .put(format!("{}{}", self.base, route.path()))
            .header("content-type", ARTIFACT_MEDIA_TYPE)
            .header("content-length", frame.len().to_string())
            .header("expect", "100-continue")
            .send(ureq::SendBody::from_reader(&mut reader))
            .unwrap();
        let status = response.status().as_u16();
        Answer { status, body: response.body_mut().read_to_vec().unwrap() }
    }

    /// Sends one live-log chunk the way the agent does.
    fn append(&self, job: &Job, offset: u64, chunk: &[u8]) -> Answer {
        let header = LogChunkHeader::new(job.fence.clone(), LogChunkSchema, log_id(), offset, chunk.len() as u64);
        let mut frame = encode_prefix(&header).unwrap().to_vec();
        frame.extend_from_slice(chunk);
        let mut reader = &frame[..];
        let mut response = self
            .agent
            .post(format!("{}{}", self.base, Route::LogAppend(job.path.clone()).path()))
            .header("content-type", LOG_CHUNK_MEDIA_TYPE)
            .header("content-length", frame.len().to_string())
            .header("expect", "100-continue")
            .send(ureq::SendBody::from_reader(&mut reader))
            .unwrap();
        let status = response.status().as_u16();
        Answer { status, body: response.body_mut().read_to_vec().unwrap() }
    }

    fn seal(&self, job: &Job, length: u64) -> Answer {
        self.post(&Route::Seal(job.path.clone(), log_id()), &Seal::new(job.fence.clone(), length, false))
    }

    fn open(&self, capacity: u32) -> (SessionId, Counter) {
        self.open_declaring(capacity, &[])
    }

    /// Opens a session declaring `labels`.
    fn open_declaring(&self, capacity: u32, labels: &[(&str, &str)]) -> (SessionId, Counter) {
        let body = OpenSession {
            agent_version: "0.1.0".parse().unwrap(),
            arch: "x86_64".parse().unwrap(),
            labels: labels.iter().map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap())).collect(),
            capacity,
        };
        let opened: SessionOpened = self.post(&Route::OpenSession(self.worker.clone()), &body).json(201);
        (opened.session_id, opened.generation)
    }

    fn poll(&self, session: &SessionId, generation: Counter, wait_ms: u64, max: u32) -> Offers {
        let route = Route::PollOffers(self.worker.clone(), session.clone());
        self.post(&route, &PollOffers { generation, wait_ms, max }).json(200)
    }

    /// Claims `offer` and returns the job with a fresh lease token.
    fn claim(&self, session: &SessionId, generation: Counter, offer: &ql_wire::offer::Offer) -> Job {
        let token = Token::generate().unwrap();
        let route = Route::Claim(self.worker.clone(), session.clone(), offer.offer_id.clone());
        let body = Claim {
            generation,
            run_id: offer.run_id.clone(),
            attempt_id: offer.attempt_id.clone(),
            lease_token: token.clone(),
        };
        let claimed: Claimed = self.post(&route, &body).json(200);
        assert_eq!(claimed.lease_version, Counter::ONE);
        Job {
            path: AttemptPath {
                worker: self.worker.clone(),
                session: session.clone(),
                run: offer.run_id.clone(),
                attempt: offer.attempt_id.clone(),
            },
            fence: Fence {
                session_generation: generation,
                offer_id: offer.offer_id.clone(),
                lease_generation: claimed.lease_generation,
                lease_token: token,
                expected_lease_version: claimed.lease_version,
            },
            callback: Token::generate().unwrap(),
        }
    }

    fn starting(&self, job: &Job) -> AckReply {
        self.post(&job.route(AttemptCommand::Starting), &job.fence).json(200)
    }

    fn running(&self, job: &Job, log: Option<&ArtifactId>) -> AckReply {
        let body = Running::new(
            job.fence.clone(),
            ExecutorHandle::parse("pid:1 start:1").unwrap(),
            log.cloned(),
            Counter::ONE,
            job.callback.digest(),
        );
        self.post(&job.route(AttemptCommand::Running), &body).json(200)
    }

    fn renew(&self, job: &mut Job) -> Renewed {
        let renewed: Renewed = self.post(&job.route(AttemptCommand::RenewLease), &job.fence).json(200);
        job.fence.expected_lease_version = renewed.lease_version;
        renewed
    }

    /// Submits a run and brings it to `running` through the routes: open, poll, claim,
    /// starting, running.
    fn running_job(&self, server: &Server, log: Option<&ArtifactId>) -> Job {
        server.submit();
        let (session, generation) = self.open(1);
        let offers = self.poll(&session, generation, 0, 1);
        assert_eq!(offers.offers.len(), 1);
        let job = self.claim(&session, generation, &offers.offers[0]);
        assert_eq!(self.starting(&job).result, Outcome::Started);
        assert_eq!(self.running(&job, log).result, Outcome::Running);
        job
    }
}

/// What the agent remembers about one claimed attempt.
struct Job {
    path: AttemptPath,
    fence: Fence,
    callback: Token,
}

impl Job {
    fn route(&self, cmd: AttemptCommand) -> Route {
        Route::Attempt(self.path.clone(), cmd)
    }

    fn artifact_route(&self, id: &ArtifactId) -> Route {
        Route::Artifact(self.path.clone(), id.clone())
    }

    fn key(&self, id: &ArtifactId) -> ArtifactKey {
        ArtifactKey {
            project: project(),
            run: self.path.run.clone(),
            attempt: self.path.attempt.clone(),
            artifact: id.clone(),
        }
    }

    fn header(&self, content_length: u64) -> ArtifactHeader {
        ArtifactHeader::new(self.fence.clone(), ArtifactSchema, content_length, false)
    }

    /// A well-formed frame for `content`.
    fn frame(&self, content: &[u8]) -> Vec<u8> {
        let mut frame = encode_prefix(&self.header(content.len() as u64)).unwrap().to_vec();
        frame.extend_from_slice(content);
        frame
    }

    fn completion(&self, exit_code: i32, artifact: Option<Receipt>) -> Completion {
        Completion::new(
            self.fence.clone(),
            CompletionSchema,
            Counter::ONE,
            self.callback.clone(),
            Some(exit_code),
            None,
            now(),
            artifact,
        )
    }
}

fn log_id() -> ArtifactId {
    ArtifactId::parse("log").unwrap()
}

/// Content that is not all one byte, so a mix-up would show in the digest.
fn content(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

// ---------------------------------------------------------------------------------------
// The raw client.

fn client_config(
    ca: &[u8],
    creds: Option<&Creds>,
    versions: &[&'static SupportedProtocolVersion],
) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(roots);
    let config = match creds {
        Some(creds) => {
            let chain = CertificateDer::pem_slice_iter(&creds.cert).collect::<Result<Vec<_>, _>>().unwrap();
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_slice(&creds.key).unwrap()).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

/// One response, with the interim (1xx) statuses that preceded it.
#[derive(Debug)]
struct RawResponse {
    interim: Vec<u16>,
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn error(&self) -> ErrorCode {
        let body: ErrorBody = serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            panic!("{} with a non-error body: {}", self.status, String::from_utf8_lossy(&self.body))
        });
        assert_eq!(self.status, body.error.status());
        assert_eq!(self.header("content-type"), Some(JSON_MEDIA_TYPE));
        assert_eq!(self.header("content-length"), Some(self.body.len().to_string().as_str()));
        body.error
    }

    fn closes(&self) -> bool {
        self.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }
}

/// A response's status and headers.
type Head = (u16, Vec<(String, String)>);

/// HTTP/1.1 by hand over rustls.
struct Raw {
    tls: StreamOwned<ClientConnection, TcpStream>,
    buf: Vec<u8>,
}

impl Raw {
    fn connect(addr: SocketAddr, config: Arc<ClientConfig>) -> io::Result<Self> {
        Self::over(TcpStream::connect(addr)?, config)
    }

    /// [`Raw::connect`] from the loopback address `from` (any of 127/8 on Linux).
    fn connect_from(from: &str, addr: SocketAddr, config: Arc<ClientConfig>) -> io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
        let tcp = rt.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(format!("{from}:0").parse().map_err(io::Error::other)?)?;
            socket.connect(addr).await?.into_std()
        })?;
        tcp.set_nonblocking(false)?;
        Self::over(tcp, config)
    }

    fn over(mut tcp: TcpStream, config: Arc<ClientConfig>) -> io::Result<Self> {
        tcp.set_read_timeout(Some(PATIENCE))?;
        tcp.set_write_timeout(Some(PATIENCE))?;
        let name = ServerName::try_from("127.0.0.1").unwrap();
        let mut conn = ClientConnection::new(config, name).map_err(io::Error::other)?;
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp)?;
        }
        Ok(Self { tls: StreamOwned::new(conn, tcp), buf: Vec::new() })
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.tls.write_all(bytes)?;
        self.tls.flush()
    }

    /// Sends a request head for `route` with `headers` (each `name: value`).
    fn head(&mut self, method: &str, path: &str, headers: &[&str]) -> io::Result<()> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n");
        for h in headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        self.send(head.as_bytes())
    }

    fn fill(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.tls.read(&mut chunk)?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Reads one response head; `Ok(None)` when the connection ended first.
    fn read_head(&mut self) -> io::Result<Option<Head>> {
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8(self.buf.drain(..end + 4).collect()).unwrap();
                let mut lines = head.split("\r\n");
                let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
                let headers = lines
                    .filter(|l| !l.is_empty())
                    .map(|l| {
                        let (n, v) = l.split_once(':').unwrap();
                        (n.trim().to_owned(), v.trim().to_owned())
                    })
                    .collect();
                return Ok(Some((status, headers)));
            }
            if self.fill()? == 0 {
                return Ok(None);
            }
        }
    }

    /// Reads the next final response (skipping and recording 1xx ones).
    fn response(&mut self) -> io::Result<RawResponse> {
        let mut interim = Vec::new();
        loop {
            let (status, headers) =
                self.read_head()?.ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "no response"))?;
            if (100..200).contains(&status) {
                interim.push(status);
                continue;
            }
            let length: usize = headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                .map(|(_, v)| v.parse().unwrap())
                .unwrap_or(0);
            while self.buf.len() < length {
                if self.fill()? == 0 {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short response body"));
                }
            }
            let body = self.buf.drain(..length).collect();
            return Ok(RawResponse { interim, status, headers, body });
        }
    }

    /// Whether the server ended the connection (clean close, reset or alert) with
    /// nothing more to read.
    fn ended(&mut self) -> bool {
        match self.fill() {
            Ok(0) | Err(_) => self.buf.is_empty(),
            Ok(_) => false,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The upload cases the artifact and live-log tests share.

/// A running job, its store state and a raw connection, for one malformed upload each.
struct UploadCase {
    server: Server,
    client: Client,
    job: Job,
    before: Snapshot,
}

impl UploadCase {
    fn new(name: &str) -> Self {
        let server = Server::start(name);
        let client = server.client("router-1");
        let job = client.running_job(&server, Some(&log_id()));
        let before = server.snapshot();
        Self { server, client, job, before }
    }

    fn path(&self) -> String {
        self.job.artifact_route(&log_id()).path()
    }

    /// Sends a head (with `Expect: 100-continue`) and then `body`, whether or not the
    /// server asked for it, and returns the answer.
    fn put(&self, headers: &[&str], body: &[u8]) -> RawResponse {
        let mut raw = self.server.raw("router-1");
        let mut all = headers.to_vec();
        all.push("expect: 100-continue");
        raw.head("PUT", &self.path(), &all).unwrap();
        if !body.is_empty() {
            // The server may already have answered and closed; its answer is what counts.
            let _ = raw.send(body);
        }
        raw.response().unwrap()
    }

    fn put_frame(&self, declared: usize, body: &[u8]) -> RawResponse {
        let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
        let cl = format!("content-length: {declared}");
        self.put(&[&ct, &cl], body)
    }

    /// Nothing stored, no row changed.
    fn assert_untouched(&self) {
        assert_eq!(self.server.inspect(&self.job.key(&log_id())), None, "nothing stored");
        assert_eq!(self.server.snapshot(), self.before, "no row changed");
    }
}

mod artifacts;
mod enrolment;
mod identity;
mod lifecycle;
mod live_log;
mod routes;
