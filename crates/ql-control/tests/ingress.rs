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
        let mut tcp = TcpStream::connect(addr)?;
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
// The happy path.

#[test]
fn every_route_succeeds_over_one_keep_alive_connection() {
    let server = Server::start("happy");
    let client = server.client("router-1");
    server.submit();
    server.submit();
    server.submit();

    // Sessions.
    let (session, generation) = client.open(3);
    let hb: HeartbeatReply = client
        .post(&Route::Heartbeat(wid("router-1"), session.clone()), &Heartbeat { generation, draining: false })
        .json(200);
    assert_eq!(hb.status, SessionStatus::Online);

    // Delivery.
    let offers = client.poll(&session, generation, 0, 3);
    assert_eq!(offers.offers.len(), 3);
    let mut job = client.claim(&session, generation, &offers.offers[0]);
    let failing = client.claim(&session, generation, &offers.offers[1]);
    let framed = client.claim(&session, generation, &offers.offers[2]);

    // Start ACKs, renewal.
    assert_eq!(client.starting(&job).result, Outcome::Started);
    assert_eq!(client.running(&job, Some(&log_id())).result, Outcome::Running);
    let renewed = client.renew(&mut job);
    assert_eq!(renewed.lease_version.get(), 2);
    assert_eq!(renewed.stop, None);

    // The live log: two chunks, then the seal makes them the artifact.
    let (first, second) = (content(256 * 1024, 7), content(1000, 8));
    let reply: LogAppendReply = client.append(&job, 0, &first).json(200);
    assert_eq!((reply.result, reply.acked), (Outcome::Appended, first.len() as u64));
    let acked: LogAppendReply = client.append(&job, first.len() as u64, &second).json(200);
    let sealed: ArtifactReply = client.seal(&job, acked.acked).json(200);
    assert_eq!(sealed.result, Outcome::Stored);
    assert_eq!(sealed.receipt.sha256, Digest::of(&[first.as_slice(), &second].concat()));
    assert_eq!(server.inspect(&job.key(&log_id())), Some(sealed.receipt.clone()));

    // Completion, with the receipt re-inspected by the server.
    let done: CompletionReply =
        client.post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(sealed.receipt))).json(200);
    assert_eq!((done.result, done.status), (Outcome::Completed, TerminalStatus::Succeeded));

    // A job that ends before its `running` ACK: its log in one frame, streamed with
    // `Expect: 100-continue`, 1 MiB, then the completion from `starting`.
    assert_eq!(client.starting(&framed).result, Outcome::Started);
    let blob = content(1024 * 1024, 9);
    let stored: ArtifactReply = client.put_artifact(&framed.artifact_route(&log_id()), &framed.frame(&blob)).json(200);
    assert_eq!(stored.result, Outcome::Stored);
    assert_eq!(stored.receipt.length, blob.len() as u64);
    assert_eq!(stored.receipt.sha256, Digest::of(&blob));
    assert_eq!(server.inspect(&framed.key(&log_id())), Some(stored.receipt.clone()));
    let done: CompletionReply =
        client.post(&framed.route(AttemptCommand::Completion), &framed.completion(0, Some(stored.receipt))).json(200);
    assert_eq!((done.result, done.status), (Outcome::Completed, TerminalStatus::Succeeded));

    // start-failure on the second attempt.
    assert_eq!(client.starting(&failing).result, Outcome::Started);
    let body = StartFailure::new(failing.fence.clone(), Reason::parse("spawn failed").unwrap());
    let failed: AckReply = client.post(&failing.route(AttemptCommand::StartFailure), &body).json(200);
    assert_eq!(failed.result, Outcome::Failed);

    // A job lost with its supervisor: abandoned, its run queued again.
    let lost_run = server.submit();
    let offers = client.poll(&session, generation, 0, 1);
    let lost = client.claim(&session, generation, &offers.offers[0]);
    assert_eq!(lost.path.run, lost_run);
    assert_eq!(client.starting(&lost).result, Outcome::Started);
    let body = Abandon::new(lost.fence.clone(), Reason::parse("gone").unwrap());
    let abandoned: AckReply = client.post(&lost.route(AttemptCommand::Abandon), &body).json(200);
    assert_eq!(abandoned.result, Outcome::Abandoned);

    // The clean exit: the session closes, once.
    let close = ql_wire::session::CloseSession { generation };
    let closed: ql_wire::session::SessionClosed =
        client.post(&Route::CloseSession(wid("router-1"), session.clone()), &close).json(200);
    assert_eq!(closed.result, Outcome::Closed);

    // Fourteen routes, twenty-three requests, one TCP connection.
    assert_eq!(server.stats().requests(), 23);
    assert_eq!(server.stats().connections(), 1, "the agent's one keep-alive connection served everything");
    assert_eq!(server.stats().handshake_failures(), 0);

    let admitted: Vec<String> =
        server.audits().into_iter().filter(|a| a.outcome == "admitted").map(|a| a.route).collect();
    for route in ql_wire::route::Route::NAMES {
        assert!(admitted.iter().any(|r| r == route), "{route} audited as admitted: {admitted:?}");
    }
    assert!(server.audits().iter().all(|a| a.principal == Some(wid("router-1"))));
}

#[test]
fn refusals_after_the_body_keep_the_connection() {
    let server = Server::start("keep");
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let route = Route::Heartbeat(wid("router-1"), session.clone());

    // Unknown field: 400, body read, connection kept.
    let answer = client.post_bytes(&route, br#"{"generation":1,"draining":false,"extra":1}"#);
    assert_eq!(answer.error(), ErrorCode::InvalidRequest);
    // Not JSON at all.
    assert_eq!(client.post_bytes(&route, b"not json").error(), ErrorCode::InvalidRequest);
    // A conflict from the store: a generation that is not the session's.
    let stale = Counter::new(generation.get() + 5).unwrap();
    let answer = client.post(&route, &Heartbeat { generation: stale, draining: false });
    assert_eq!(answer.status, 409);
    // And the session still answers.
    let hb: HeartbeatReply = client.post(&route, &Heartbeat { generation, draining: true }).json(200);
    assert_eq!(hb.status, SessionStatus::Draining);
    assert_eq!(server.stats().connections(), 1);
}

// ---------------------------------------------------------------------------------------
// Long-poll.

#[test]
fn an_empty_poll_waits_for_its_deadline() {
    let server = Server::start("poll-empty");
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let started = Instant::now();
    let offers = client.poll(&session, generation, 300, 1);
    assert!(offers.offers.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(300), "answered after {:?}", started.elapsed());
}

#[test]
fn a_waiting_poll_wakes_when_work_arrives() {
    let server = Server::start("poll-wake");
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let before = server.stats().requests();
    let started = Instant::now();
    let offers = std::thread::scope(|s| {
        let waiting = s.spawn(|| client.poll(&session, generation, 10_000, 1));
        server.wait_for("the poll to arrive", |st| st.requests() > before);
        server.submit();
        waiting.join().unwrap()
    });
    assert_eq!(offers.offers.len(), 1);
    assert!(started.elapsed() < Duration::from_secs(8), "woken, not timed out: {:?}", started.elapsed());
}

#[test]
fn the_server_caps_a_polls_wait() {
    let cfg = IngressConfig { max_poll_wait: Duration::from_millis(200), ..test_config() };
    let server = Server::start_with("poll-cap", cfg);
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    let started = Instant::now();
    assert!(client.poll(&session, generation, 30_000, 1).offers.is_empty());
    assert!(started.elapsed() < Duration::from_secs(10), "capped: {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------
// Authentication and binding.

/// Whether a client with this configuration gets any HTTP answer.
fn gets_an_answer(server: &Server, config: Arc<ClientConfig>) -> bool {
    let Ok(mut raw) = Raw::connect(server.addr, config) else { return false };
    if raw
        .head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", "content-length: 0"])
        .is_err()
    {
        return false;
    }
    raw.response().is_ok()
}

#[test]
fn a_tls12_only_client_is_refused() {
    let server = Server::start("tls12");
    let creds = server.enroll("router-1");
    let config = client_config(&server.ca_pem(), Some(&creds), &[&rustls::version::TLS12]);
    assert!(Raw::connect(server.addr, config.clone()).is_err(), "TLS 1.2 handshake refused");
    assert!(!gets_an_answer(&server, config));
    server.wait_for("both handshakes to fail", |st| st.handshake_failures() == 2);
    assert_eq!(server.stats().requests(), 0);
}

#[test]
fn a_client_without_a_certificate_is_served_only_the_identity_routes_once_per_connection() {
    let server = Server::start("nocert");
    let config = client_config(&server.ca_pem(), None, &[&rustls::version::TLS13]);
    let before = server.snapshot();
    let mut raw = Raw::connect(server.addr, config.clone()).unwrap();
    raw.head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", "content-length: 0"])
        .unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.error(), ErrorCode::Unauthenticated);
    assert!(raw.ended(), "one request, then the connection ends");
    assert_eq!(server.snapshot(), before);
    assert_eq!(
        server.audits().last().map(|a| (a.principal.clone(), a.outcome.clone())),
        Some((None, "unauthenticated".into()))
    );

    // The CA is anyone's to read, one request per connection.
    let mut raw = Raw::connect(server.addr, config).unwrap();
    raw.head("GET", "/v1/ca", &[]).unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.status, 200);
    let bundle: ql_wire::enrol::CaBundle = ql_wire::decode(&response.body).unwrap();
    assert_eq!(bundle.ca.as_str().as_bytes(), server.ca_pem());
    assert!(raw.ended());
}

#[test]
fn a_certificate_from_a_foreign_ca_is_refused() {
    let server = Server::start("foreign");
    let foreign = TempDir::new("foreign-ca");
    pki::init_pki(foreign.path(), &["localhost".into()]).unwrap();
    let (files, _) =
        pki::enroll(foreign.path(), &wid("router-1"), &foreign.path().join("out"), pki::WORKER_VALIDITY).unwrap();
    let creds = Creds::read(&files.ca, &files.cert, &files.key);
    assert!(!gets_an_answer(&server, client_config(&server.ca_pem(), Some(&creds), &[&rustls::version::TLS13])));
    server.wait_for("the handshake to fail", |st| st.handshake_failures() == 1);
    assert_eq!(server.stats().requests(), 0);
}

/// Signs a client certificate with the server's CA but with the given URI SANs (and a
/// DNS name), bypassing `pki::enroll`, which would always add exactly one worker URI.
fn odd_client_cert(server: &Server, uris: &[&str]) -> Creds {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(&server.pki.ca_key).unwrap()).unwrap();
    let ca_pem = std::fs::read(&server.pki.ca_cert).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(&ca_pem).unwrap();
    let ca = pem.parse_x509().unwrap();
    let cn = ca.subject().iter_common_name().next().unwrap().as_str().unwrap().to_owned();
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = rcgen::DistinguishedName::new();
    ca_params.distinguished_name.push(DnType::CommonName, cn);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let issuer = Issuer::new(ca_params, &ca_key);

    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::ExplicitNoCa;
    params.use_authority_key_identifier_extension = true;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.subject_alt_names = vec![SanType::DnsName("router-1.example".try_into().unwrap())];
    params.subject_alt_names.extend(uris.iter().map(|u| SanType::URI((*u).try_into().unwrap())));
    let cert = params.signed_by(&key, &issuer).unwrap();
    Creds { ca: ca_pem, cert: cert.pem().into_bytes(), key: key.serialize_pem().into_bytes() }
}

#[test]
fn a_certificate_without_exactly_one_worker_uri_is_unauthenticated() {
    let server = Server::start("nouri");
    for (n, uris) in [vec![], vec!["urn:qinglong:worker:router-1", "urn:qinglong:worker:router-2"]].iter().enumerate() {
        let creds = odd_client_cert(&server, uris);
        let client = Client::new(server.addr, &creds, wid("router-1"));
        let answer = client.post_bytes(&Route::OpenSession(wid("router-1")), b"{}");
        assert_eq!(answer.error(), ErrorCode::Unauthenticated);
        server.wait_for("the connection to close", |st| st.closed() == n + 1);
    }
    assert_eq!(server.stats().handshake_failures(), 0, "the chain was valid; the principal was not");
    assert_eq!(server.stats().authenticated(), 0);
    let audits = server.audits();
    assert_eq!(audits.len(), 2);
    assert!(audits
        .iter()
        .all(|a| a.principal.is_none() && a.outcome == "unauthenticated" && a.route == "session.open"));
    assert!(server.snapshot().sessions.is_empty());
}

#[test]
fn another_workers_path_is_refused_before_its_body_is_read() {
    let server = Server::start("mismatch");
    let mut raw = server.raw("router-2");
    // A large declared body that is never sent: the answer must come anyway.
    raw.head(
        "PUT",
        "/v1/workers/router-1/sessions/s1/runs/r1/attempts/a1/artifacts/log",
        &[&format!("content-type: {ARTIFACT_MEDIA_TYPE}"), "content-length: 60000000", "expect: 100-continue"],
    )
    .unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.error(), ErrorCode::PrincipalMismatch);
    assert!(response.interim.is_empty(), "no 100 Continue: the body was never asked for");
    assert!(response.closes());
    assert!(raw.ended());

    let audits = server.audits();
    assert_eq!(audits.len(), 1);
    assert_eq!(audits[0].principal, Some(wid("router-2")));
    assert_eq!((audits[0].route.as_str(), audits[0].outcome.as_str()), ("artifact.put", "principal_mismatch"));
}

#[test]
fn unknown_routes_and_query_strings_are_not_found() {
    let server = Server::start("notfound");
    for (method, path) in [
        ("POST", "/v1/workers/router-1/sessions?x=1"),
        ("POST", "/v1/workers/router-1/sessions/"),
        ("GET", "/v1/workers/router-1/sessions"),
        ("POST", "/v1/workers/router-1/sessions/s1/offers%3Apoll"),
        ("POST", "/metrics"),
    ] {
        let mut raw = server.raw("router-1");
        raw.head(method, path, &["content-type: application/json", "content-length: 2"]).unwrap();
        let response = raw.response().unwrap();
        assert_eq!(response.error(), ErrorCode::NotFound, "{method} {path}");
        assert!(response.closes());
    }
    let audits = server.audits();
    assert_eq!(audits.len(), 5);
    assert!(audits
        .iter()
        .all(|a| a.principal == Some(wid("router-1")) && a.route == "unknown" && a.outcome == "not_found"));
}

#[test]
fn json_framing_is_checked_before_the_body() {
    let server = Server::start("json-framing");
    let path = "/v1/workers/router-1/sessions";
    for (headers, code) in [
        (vec!["content-type: text/plain", "content-length: 2"], ErrorCode::UnsupportedMediaType),
        (vec!["content-type: application/json; charset=utf-8", "content-length: 2"], ErrorCode::UnsupportedMediaType),
        (
            vec!["content-type: application/json", "content-encoding: gzip", "content-length: 2"],
            ErrorCode::UnsupportedMediaType,
        ),
        (vec!["content-type: application/json", "transfer-encoding: chunked"], ErrorCode::LengthRequired),
        (vec!["content-type: application/json"], ErrorCode::LengthRequired),
        (vec!["content-type: application/json", "content-length: 4097"], ErrorCode::PayloadTooLarge),
    ] {
        let mut raw = server.raw("router-1");
        let mut all = headers.clone();
        all.push("expect: 100-continue");
        raw.head("POST", path, &all).unwrap();
        let response = raw.response().unwrap();
        assert_eq!(response.error(), code, "{headers:?}");
        assert!(response.interim.is_empty(), "{headers:?}: refused without asking for the body");
        assert!(response.closes());
    }
    assert!(server.snapshot().sessions.is_empty());
    // Each was admitted (authenticated and bound) before its framing was refused.
    assert_eq!(server.audits().iter().filter(|a| a.outcome == "admitted").count(), 6);
}

// ---------------------------------------------------------------------------------------
// The artifact route.

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

#[test]
fn artifact_framing_refusals_come_before_the_body() {
    let case = UploadCase::new("artifact-framing");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cap = Route::Artifact(case.job.path.clone(), log_id()).body_cap();
    let over = format!("content-length: {}", cap + 1);
    for (headers, code) in [
        (vec!["content-type: application/json", "content-length: 100"], ErrorCode::UnsupportedMediaType),
        (vec!["content-type: application/octet-stream", "content-length: 100"], ErrorCode::UnsupportedMediaType),
        (vec![&ct, "content-encoding: gzip", "content-length: 100"], ErrorCode::UnsupportedMediaType),
        (vec![&ct, "transfer-encoding: chunked"], ErrorCode::LengthRequired),
        (vec![&ct], ErrorCode::LengthRequired),
        (vec![&ct, &over], ErrorCode::PayloadTooLarge),
    ] {
        let response = case.put(&headers, b"");
        assert_eq!(response.error(), code, "{headers:?}");
        assert!(response.interim.is_empty(), "{headers:?}: refused before 100 Continue");
        assert!(response.closes());
    }
    case.assert_untouched();
}

#[test]
fn an_artifact_header_over_4096_bytes_is_refused() {
    let case = UploadCase::new("artifact-header");
    let mut body = 5000u32.to_be_bytes().to_vec();
    body.extend(std::iter::repeat_n(b' ', 5000));
    let response = case.put_frame(body.len(), &body);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    assert_eq!(response.interim, vec![100], "the header is in the body, so the body was asked for");
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn a_header_content_length_that_disagrees_with_the_body_is_refused() {
    let case = UploadCase::new("artifact-mismatch");
    let log = content(1000, 1);
    // The header promises more content than the body carries.
    let mut frame = encode_prefix(&case.job.header(1007)).unwrap().to_vec();
    frame.extend_from_slice(&log);
    let response = case.put_frame(frame.len(), &frame);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn a_body_longer_than_its_frame_is_refused() {
    let case = UploadCase::new("artifact-long");
    let mut frame = case.job.frame(&content(1000, 2));
    frame.extend_from_slice(b"trailing bytes the frame does not declare");
    let response = case.put_frame(frame.len(), &frame);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    case.assert_untouched();
}

#[test]
fn a_body_that_stops_short_is_refused_and_nothing_is_stored() {
    let case = UploadCase::new("artifact-short");
    let frame = case.job.frame(&content(100_000, 3));
    // Declares the whole frame, sends all but the last 10 bytes, then goes quiet: the
    // upload is admitted and started, and must be discarded.
    let response = case.put_frame(frame.len(), &frame[..frame.len() - 10]);
    assert_eq!(response.error(), ErrorCode::InvalidRequest);
    assert_eq!(response.interim, vec![100]);
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn a_body_cut_off_by_the_client_stores_nothing() {
    let case = UploadCase::new("artifact-cut");
    let frame = case.job.frame(&content(100_000, 4));
    let mut raw = case.server.raw("router-1");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cl = format!("content-length: {}", frame.len());
    raw.head("PUT", &case.path(), &[&ct, &cl]).unwrap();
    raw.send(&frame[..frame.len() / 2]).unwrap();
    raw.tls.conn.send_close_notify();
    raw.tls.flush().unwrap();
    raw.tls.sock.shutdown(std::net::Shutdown::Write).unwrap();
    // Whatever the server manages to say, the connection ends and nothing is kept. (The
    // agent client's own connection is still open: only this one closes.)
    if let Ok(response) = raw.response() {
        assert_eq!(response.error(), ErrorCode::InvalidRequest);
    }
    case.server.wait_for("the connection to end", |st| st.closed() == 1);
    case.assert_untouched();
}

#[test]
fn an_upload_that_outlives_its_run_is_refused_at_its_end_and_not_stored() {
    let case = UploadCase::new("artifact-outlived");
    let frame = case.job.frame(&content(100_000, 4));
    let mut raw = case.server.raw("router-1");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cl = format!("content-length: {}", frame.len());
    raw.head("PUT", &case.path(), &[&ct, &cl]).unwrap();
    raw.send(&frame[..frame.len() / 2]).unwrap();
    // The upload was admitted and its content is arriving (the store holds it aside)...
    let dir = case.server.dir.path().join("artifacts").join("default").join(case.job.path.run.as_str());
    let dir = dir.join(case.job.path.attempt.as_str());
    let pending = || std::fs::read_dir(&dir).map_or(0, |d| d.filter_map(Result::ok).count());
    wait_until("the upload to be admitted", || pending() > 0);
    // ...when the run ends some other way.
    let done: CompletionReply =
        case.client.post(&case.job.route(AttemptCommand::Completion), &case.job.completion(0, None)).json(200);
    assert_eq!(done.status, TerminalStatus::Succeeded);
    raw.send(&frame[frame.len() / 2..]).unwrap();
    assert_eq!(raw.response().unwrap().error(), ErrorCode::AlreadyTerminal);
    assert_eq!(case.server.inspect(&case.job.key(&log_id())), None, "nothing stored");
    assert_eq!(pending(), 0, "the content held aside is gone");
}

#[test]
fn an_upload_slower_than_the_minimum_rate_is_cut_off_and_nothing_is_stored() {
    // A grace of 300 ms and 1 MiB/s: 100 KB may take 400 ms in all.
    let cfg = IngressConfig {
        upload_grace: Duration::from_millis(300),
        min_upload_rate: 1024 * 1024,
        body_idle_timeout: Duration::from_secs(5),
        ..test_config()
    };
    let server = Server::start_with("trickle", cfg);
    let client = server.client("router-1");
    let job = client.running_job(&server, Some(&log_id()));
    let before = server.snapshot();
    let frame = job.frame(&content(100_000, 4));
    let mut raw = server.raw("router-1");
    let ct = format!("content-type: {ARTIFACT_MEDIA_TYPE}");
    let cl = format!("content-length: {}", frame.len());
    raw.head("PUT", &job.artifact_route(&log_id()).path(), &[&ct, &cl]).unwrap();
    // A kilobyte every 20 ms (50 KB/s, each piece well within the idle timeout): the whole
    // body would take two seconds, five times its deadline. The pacing is the test's
    // slow client, not a wait for the server.
    for piece in frame.chunks(1024) {
        if raw.send(piece).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let answer = raw.response().unwrap();
    assert_eq!(answer.error(), ErrorCode::InvalidRequest, "cut off");
    assert!(answer.closes());
    assert_eq!(server.inspect(&job.key(&log_id())), None, "nothing stored");
    assert_eq!(server.snapshot(), before, "no row changed");
    // The same body at full speed goes through.
    let stored: ArtifactReply = client.put_artifact(&job.artifact_route(&log_id()), &frame).json(200);
    assert_eq!(stored.result, Outcome::Stored);
}

#[test]
fn a_request_head_over_the_cap_is_refused_with_431() {
    let server = Server::start("head-cap");
    let mut raw = server.raw("router-1");
    let long = format!("x-padding: {}", "a".repeat(20 * 1024));
    raw.head("POST", "/v1/workers/router-1/sessions", &[&long, "content-length: 0"]).unwrap();
    assert_eq!(raw.response().unwrap().status, 431);
    assert_eq!(server.snapshot(), Snapshot::default(), "nothing was read as a request");
}

#[test]
fn connections_from_one_address_without_a_certificate_cannot_crowd_out_workers() {
    let cfg = IngressConfig { max_connections: 8, max_handshakes: 16, max_handshakes_per_ip: 4, ..test_config() };
    let server = Server::start_with("crowd", cfg);
    // Fifty plain TCP connections from another loopback address, holding their
    // handshakes open and sending nothing.
    let addr = server.addr;
    let crowd: Vec<tokio::net::TcpStream> = server.rt.block_on(async {
        let mut all = Vec::new();
        for _ in 0..50 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            all.push(socket.connect(addr).await.unwrap());
        }
        all
    });
    server.wait_for("the crowd beyond four to be turned away", |st| st.turned_away() >= 46);
    // A worker still gets in, and is served.
    let client = server.client("router-1");
    let (_, generation) = client.open(1);
    assert_eq!(generation, Counter::ONE);
    drop(crowd);
}

#[test]
fn one_worker_cannot_hold_more_than_its_share_of_connections() {
    let cfg = IngressConfig { max_connections: 6, max_connections_per_worker: 2, ..test_config() };
    let server = Server::start_with("share", cfg);
    // router-1 opens six connections; each beyond two closes its oldest.
    let mut held: Vec<Raw> = (0..6).map(|_| server.raw("router-1")).collect();
    server.wait_for("router-1's oldest connections to be closed", |st| st.evicted() == 4);
    // router-2 still gets in (two slots of six are router-1's), and so does router-1's
    // newest connection.
    let other = server.client("router-2");
    assert_eq!(other.open(1).1, Counter::ONE);
    let newest = held.last_mut().unwrap();
    newest.head("POST", "/v1/workers/router-1/sessions", &["content-length: 0"]).unwrap();
    assert_eq!(newest.response().unwrap().status, 415, "served (and refused for its framing)");
    assert!(held[0].ended(), "the oldest was closed");
}

#[test]
fn fence_drift_refuses_the_upload_without_reading_content() {
    let mut case = UploadCase::new("artifact-fence");
    // The lease moves on (renewal), the upload still speaks for version 1.
    let stale = case.job.fence.clone();
    case.client.renew(&mut case.job);
    case.before = case.server.snapshot();
    let header = ArtifactHeader::new(stale, ArtifactSchema, 1_000_000, false);
    let prefix = encode_prefix(&header).unwrap();
    let declared = prefix.len() + 1_000_000;
    // Only the prefix is sent: the refusal must not wait for content.
    let response = case.put_frame(declared, &prefix);
    assert_eq!(response.error(), ErrorCode::LeaseConflict);
    assert!(response.closes());
    case.assert_untouched();
}

#[test]
fn the_agent_reads_a_fence_refusal_even_mid_upload() {
    // ureq writes the whole body before it reads: after `100 Continue` the server refuses
    // on the header and stops reading, and only the lingering close lets the 409 arrive
    // instead of a reset.
    let mut case = UploadCase::new("artifact-linger");
    let stale_job =
        Job { path: case.job.path.clone(), fence: case.job.fence.clone(), callback: case.job.callback.clone() };
    case.client.renew(&mut case.job);
    case.before = case.server.snapshot();
    let answer = case.client.put_artifact(&stale_job.artifact_route(&log_id()), &stale_job.frame(&content(8 << 20, 9)));
    assert_eq!(answer.error(), ErrorCode::LeaseConflict);
    case.assert_untouched();
}

#[test]
fn the_agent_learns_of_a_refusal_before_sending_its_upload() {
    let case = UploadCase::new("artifact-expect");
    let intruder = case.server.client("router-2");
    let answer = intruder.put_artifact(&case.job.artifact_route(&log_id()), &case.job.frame(&content(8 << 20, 10)));
    assert_eq!(answer.error(), ErrorCode::PrincipalMismatch);
    case.assert_untouched();
}

#[test]
fn an_upload_for_an_unknown_attempt_is_refused() {
    let case = UploadCase::new("artifact-unknown");
    let mut path = case.job.path.clone();
    path.attempt = ql_wire::ids::AttemptId::parse("att_nope").unwrap();
    let route = Route::Artifact(path, log_id());
    let answer = case.client.put_artifact(&route, &case.job.frame(b"hello"));
    assert_eq!(answer.status, 404);
    case.assert_untouched();
}

#[test]
fn a_replayed_artifact_is_already_stored_and_other_content_conflicts() {
    let case = UploadCase::new("artifact-replay");
    let route = case.job.artifact_route(&log_id());
    let log = content(50_000, 5);
    let first: ArtifactReply = case.client.put_artifact(&route, &case.job.frame(&log)).json(200);
    assert_eq!(first.result, Outcome::Stored);
    // The one row an upload writes: its receipt, claimed for the attempt.
    let claimed = case.server.snapshot();
    assert_eq!(claimed.attempts[0].claimed_artifact.as_ref(), Some(&first.receipt));
    let again: ArtifactReply = case.client.put_artifact(&route, &case.job.frame(&log)).json(200);
    assert_eq!(again.result, Outcome::AlreadyStored);
    assert_eq!(again.receipt, first.receipt);
    let other = case.client.put_artifact(&route, &case.job.frame(&content(50_000, 6)));
    assert_eq!(other.error(), ErrorCode::ArtifactConflict);
    assert_eq!(case.server.inspect(&case.job.key(&log_id())), Some(first.receipt));
    assert_eq!(case.server.snapshot(), claimed, "a replay and a conflict write nothing");
    // All three read their bodies to the end: one connection.
    assert_eq!(case.server.stats().connections(), 1);
}

#[test]
fn the_live_log_is_appended_by_offset_then_sealed_into_the_artifact() {
    let case = UploadCase::new("live-log");
    let (a, b, c) = (content(1_000, 1), content(256 * 1024, 2), content(7, 3));
    let appended = |answer: Answer, acked| {
        let reply: LogAppendReply = answer.json(200);
        assert_eq!((reply.result, reply.acked), (Outcome::Appended, acked));
    };
    appended(case.client.append(&case.job, 0, &a), 1_000);
    appended(case.client.append(&case.job, 1_000, &b), 1_000 + 256 * 1024);
    let acked = (1_000 + b.len() + c.len()) as u64;
    appended(case.client.append(&case.job, 1_000 + b.len() as u64, &c), acked);
    let after_appends = case.server.snapshot();

    // A lost answer's repeat, and a repeat re-cut across chunks: already there.
    let again: LogAppendReply = case.client.append(&case.job, 0, &a).json(200);
    assert_eq!((again.result, again.acked), (Outcome::AlreadyAppended, acked));
    let mut across = a[500..].to_vec();
    across.extend_from_slice(&b[..100]);
    let again: LogAppendReply = case.client.append(&case.job, 500, &across).json(200);
    assert_eq!(again.result, Outcome::AlreadyAppended);
    // A changed byte, a gap, an overlap: the acknowledged length, nothing changed.
    let mut changed = a.clone();
    changed[999] ^= 1;
    assert_eq!(case.client.append(&case.job, 0, &changed).log_conflict(), acked);
    assert_eq!(case.client.append(&case.job, acked + 1, b"x").log_conflict(), acked);
    assert_eq!(case.client.append(&case.job, acked - 3, b"xyzw").log_conflict(), acked);
    assert_eq!(case.client.seal(&case.job, acked - 1).log_conflict(), acked);
    assert_eq!(case.server.snapshot(), after_appends, "refusals and repeats change nothing");
    assert_eq!(case.server.inspect(&case.job.key(&log_id())), None, "nothing sealed yet");

    let whole: Vec<u8> = [a.as_slice(), &b, &c].concat();
    let sealed: ArtifactReply = case.client.seal(&case.job, acked).json(200);
    assert_eq!(sealed.result, Outcome::Stored);
    assert_eq!((sealed.receipt.length, sealed.receipt.sha256.clone()), (acked, Digest::of(&whole)));
    let resealed: ArtifactReply = case.client.seal(&case.job, acked).json(200);
    assert_eq!((resealed.result, &resealed.receipt), (Outcome::AlreadyStored, &sealed.receipt));
    assert_eq!(case.client.append(&case.job, acked, b"late").error(), ErrorCode::StateConflict);

    let done: CompletionReply = case
        .client
        .post(&case.job.route(AttemptCommand::Completion), &case.job.completion(0, Some(sealed.receipt.clone())))
        .json(200);
    assert_eq!(done.status, TerminalStatus::Succeeded);
    let names: Vec<String> = case.server.audits().into_iter().map(|a| a.route).collect();
    assert!(names.iter().filter(|n| *n == "log.append").count() >= 9, "every chunk is audited: {names:?}");
    assert!(names.iter().any(|n| n == "artifact.seal"));
}

/// The file store, but its first chunk read first says so on `gate` and waits for the
/// answer: the test completes the attempt right there, between a reader's look at the
/// run and its read of a chunk.
#[derive(Clone)]
struct Gated {
    inner: FsBlobStore,
    gate: Arc<Mutex<Option<Gate>>>,
}

/// Where a gated read says it has come, and where it waits to go on.
type Gate = (mpsc::Sender<()>, mpsc::Receiver<()>);

impl BlobStore for Gated {
    type Upload = <FsBlobStore as BlobStore>::Upload;

    async fn begin(&self, key: &ArtifactKey, length: u64, truncated: bool) -> Result<Self::Upload, BlobError> {
        self.inner.begin(key, length, truncated).await
    }

    async fn inspect(&self, key: &ArtifactKey) -> Result<Option<Receipt>, BlobError> {
        self.inner.inspect(key).await
    }

    async fn read(&self, key: &ArtifactKey, offset: u64, limit: u64) -> Result<Option<Vec<u8>>, BlobError> {
        self.inner.read(key, offset, limit).await
    }

    async fn put_chunk(&self, key: &ArtifactKey, offset: u64, bytes: &[u8]) -> Result<Digest, BlobError> {
        self.inner.put_chunk(key, offset, bytes).await
    }

    async fn read_chunk(&self, key: &ArtifactKey, at: u64, len: u64, sha256: &Digest) -> Result<Vec<u8>, BlobError> {
        let gate = self.gate.lock().unwrap().take();
        if let Some((tell, wait)) = gate {
            tell.send(()).unwrap();
            wait.recv().unwrap();
        }
        self.inner.read_chunk(key, at, len, sha256).await
    }

    async fn remove_chunk(&self, key: &ArtifactKey, offset: u64, sha256: &Digest) -> Result<(), BlobError> {
        self.inner.remove_chunk(key, offset, sha256).await
    }

    async fn collect<R: Recorded>(&self, before: SystemTime, recorded: &R) -> Result<Collected, BlobError> {
        self.inner.collect(before, recorded).await
    }
}

/// The names of the files under `dir` (recursively) that contain `part`.
fn files_named(dir: &Path, part: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(files_named(&path, part));
        } else if path.file_name().is_some_and(|n| n.to_string_lossy().contains(part)) {
            found.push(path.display().to_string());
        }
    }
    found
}

/// A live log of two chunks (`a`, then `b`) appended and sealed: the seal's answer.
fn two_chunks_sealed(case: &UploadCase, a: &[u8], b: &[u8]) -> ArtifactReply {
    let _: LogAppendReply = case.client.append(&case.job, 0, a).json(200);
    let acked: LogAppendReply = case.client.append(&case.job, a.len() as u64, b).json(200);
    case.client.seal(&case.job, acked.acked).json(200)
}

/// Waits until no chunk file is left under `artifacts` (the completion's removal ran).
fn until_no_chunk(artifacts: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !files_named(artifacts, ".chunk.").is_empty() {
        assert!(Instant::now() < deadline, "the chunks stay: {:?}", files_named(artifacts, ".chunk."));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_completion_that_records_the_log_removes_its_chunks_and_readers_read_the_artifact() {
    let case = UploadCase::new("chunks-go");
    let (client, job, server) = (&case.client, &case.job, &case.server);
    let (a, b) = (content(256 * 1024, 4), content(999, 5));
    let sealed = two_chunks_sealed(&case, &a, &b);
    let artifacts = server.dir.path().join("artifacts");
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 2, "sealed, the chunks are still there");

    // A completion the store refuses records nothing: the chunks stay the log.
    let mut other = sealed.receipt.clone();
    other.sha256 = Digest::of(b"other bytes");
    let refused = client.post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(other)));
    assert_eq!(refused.error(), ErrorCode::ArtifactConflict);

    // A follower looks at the run while it runs, and reads its first chunk only once the
    // completion has recorded the log and its chunks are gone: it gets the stored log.
    let (tell, told) = mpsc::channel();
    let (go, wait) = mpsc::channel();
    let gated = Gated { inner: server.blobs.clone(), gate: Arc::new(Mutex::new(Some((tell, wait)))) };
    let ops = ql_control::ops::Local { store: server.store.clone(), blobs: gated };
    let look = |follow| {
        let request = ql_control::ops::LogRequest { attempt: None, offset: 0, limit: 1 << 20, follow, wait_ms: 0 };
        server.rt.block_on(ops.log(&job.path.run, &request)).unwrap()
    };
    let whole = [a.as_slice(), &b].concat();
    std::thread::scope(|s| {
        let follower = s.spawn(|| look(true));
        told.recv().unwrap();
        let done: CompletionReply = client
            .post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(sealed.receipt.clone())))
            .json(200);
        assert_eq!(done.status, TerminalStatus::Succeeded);
        until_no_chunk(&artifacts);
        go.send(()).unwrap();
        let followed = follower.join().unwrap();
        assert!(followed.terminal);
        assert_eq!((followed.bytes.as_slice(), followed.sealed.as_ref()), (whole.as_slice(), Some(&sealed.receipt)));
    });
    assert_eq!(server.inspect(&job.key(&log_id())), Some(sealed.receipt.clone()), "the artifact stays");
    assert_eq!(server.rt.block_on(server.store.log_chunks(&job.path.attempt)).unwrap().len(), 2, "so do the rows");
    let looked = look(false);
    assert_eq!((looked.bytes, looked.sealed), (whole, Some(sealed.receipt)));
}

#[test]
fn the_collection_removes_the_chunks_a_completion_left_of_a_recorded_log_only() {
    let case = UploadCase::new("chunks-collected");
    let (client, job, server) = (&case.client, &case.job, &case.server);
    let (a, b) = (content(256 * 1024, 6), content(4_321, 7));
    let sealed = two_chunks_sealed(&case, &a, &b);
    let artifacts = server.dir.path().join("artifacts");
    let authority = ql_control::serve::Authority(server.store.clone());
    let metrics = ql_control::metrics::Metrics::new();
    let collect = || {
        let before = SystemTime::now() + Duration::from_secs(3_600);
        let pass = ql_control::serve::collect_once(&server.blobs, &authority, before, Some(&metrics));
        server.rt.block_on(pass).unwrap()
    };

    // Sealed but not yet recorded by a completion, the chunks are still the log.
    assert_eq!(server.rt.block_on(authority.recorded(&job.key(&log_id()))).unwrap(), Recording::NotYet);
    assert_eq!(collect(), Collected::default());
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 2);

    let done: CompletionReply =
        client.post(&job.route(AttemptCommand::Completion), &job.completion(0, Some(sealed.receipt.clone()))).json(200);
    assert_eq!(done.status, TerminalStatus::Succeeded);
    until_no_chunk(&artifacts);
    // As if that removal had not happened (the store was down, the server stopped).
    let key = job.key(&log_id());
    for (offset, bytes) in [(0, &a), (a.len() as u64, &b)] {
        server.rt.block_on(server.blobs.put_chunk(&key, offset, bytes)).unwrap();
    }
    // Only that artifact of that attempt, under its run's project, counts as recorded;
    // the ended attempt will never record another.
    let mut other = key.clone();
    other.artifact = ArtifactId::parse("other").unwrap();
    let mut elsewhere = key.clone();
    elsewhere.project = ProjectId::parse("elsewhere").unwrap();
    for (k, recorded) in [(&key, Recording::Recorded), (&other, Recording::Never), (&elsewhere, Recording::Never)] {
        assert_eq!(server.rt.block_on(authority.recorded(k)).unwrap(), recorded, "{k:?}");
    }
    let before = server.snapshot();
    let chunk_bytes = (a.len() + b.len()) as u64;
    assert_eq!(collect(), Collected { chunks: 2, chunk_bytes, ..Collected::default() });
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 0);
    assert_eq!(server.snapshot(), before, "the authority is only asked");
    assert_eq!(server.inspect(&key), Some(sealed.receipt.clone()), "the artifact stays");
    let text = server.rt.block_on(metrics.render(&server.store)).unwrap();
    for line in [
        "ql_artifact_collections_total{outcome=\"done\"} 2".to_owned(),
        "ql_artifact_collected_total{kind=\"log_chunk\"} 2".to_owned(),
        format!("ql_artifact_collected_bytes_total{{kind=\"log_chunk\"}} {chunk_bytes}"),
        "ql_artifact_collected_total{kind=\"upload_leftover\"} 0".to_owned(),
        "ql_artifact_collection_unanswered_total 0".to_owned(),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    let ops = ql_control::ops::Local { store: server.store.clone(), blobs: server.blobs.clone() };
    let request = ql_control::ops::LogRequest { attempt: None, offset: 0, limit: 1 << 20, follow: false, wait_ms: 0 };
    let log = server.rt.block_on(ops.log(&job.path.run, &request)).unwrap();
    assert_eq!((log.bytes, log.sealed), ([a.as_slice(), &b].concat(), Some(sealed.receipt)));

    // Chunks the ended attempt can never record stay, and serve's collection asks the
    // database about them once, not every pass.
    server.rt.block_on(server.blobs.put_chunk(&other, 0, b"never sealed")).unwrap();
    let counted = Counted(authority, Arc::default());
    let remembering = Remembering::new(counted.clone(), 8);
    for _ in 0..2 {
        let before = SystemTime::now() + Duration::from_secs(3_600);
        let pass = ql_control::serve::collect_once(&server.blobs, &remembering, before, None);
        assert_eq!(server.rt.block_on(pass).unwrap(), Collected::default());
    }
    assert_eq!(counted.1.load(Ordering::Relaxed), 1, "asked once");
    assert_eq!(files_named(&artifacts, ".chunk.").len(), 1, "the chunk stays");
}

/// The authority the collection asks, counting the questions.
#[derive(Clone)]
struct Counted<R>(R, Arc<AtomicUsize>);

impl<R: Recorded> Recorded for Counted<R> {
    async fn recorded(&self, key: &ArtifactKey) -> Result<Recording, BlobError> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.recorded(key).await
    }
}

#[test]
fn a_chunk_refused_on_its_header_sends_no_content() {
    let case = UploadCase::new("live-log-fence");
    // At a stale lease version, the fence is refused before the content is asked for.
    let mut stale =
        Job { fence: case.job.fence.clone(), path: case.job.path.clone(), callback: case.job.callback.clone() };
    stale.fence.expected_lease_version = Counter::new(7).unwrap();
    assert_eq!(case.client.append(&stale, 0, &content(200_000, 4)).error(), ErrorCode::LeaseConflict);
    assert_eq!(case.server.snapshot(), case.before, "no row changed");
    // The spec's log limit (1 MiB here) is the most a log may reach, not a byte more.
    let chunk = content(256 * 1024, 5);
    for i in 0..4u64 {
        let reply: LogAppendReply = case.client.append(&case.job, i * chunk.len() as u64, &chunk).json(200);
        assert_eq!(reply.acked, (i + 1) * chunk.len() as u64);
    }
    let full = case.server.snapshot();
    assert_eq!(case.client.append(&case.job, 1024 * 1024, b"!").error(), ErrorCode::PayloadTooLarge);
    assert_eq!(case.server.snapshot(), full, "no row changed");
}

#[test]
fn a_completion_whose_receipt_is_not_what_the_store_holds_is_refused() {
    let case = UploadCase::new("completion-receipt");
    let log = content(10_000, 8);
    let stored: ArtifactReply =
        case.client.put_artifact(&case.job.artifact_route(&log_id()), &case.job.frame(&log)).json(200);
    let mut forged = stored.receipt.clone();
    forged.length += 1;
    let uploaded = case.server.snapshot();
    let route = case.job.route(AttemptCommand::Completion);
    let answer = case.client.post(&route, &case.job.completion(0, Some(forged)));
    assert_eq!(answer.error(), ErrorCode::ArtifactConflict);
    assert_eq!(case.server.snapshot(), uploaded);
    let done: CompletionReply = case.client.post(&route, &case.job.completion(0, Some(stored.receipt))).json(200);
    assert_eq!(done.result, Outcome::Completed);
}

// ---------------------------------------------------------------------------------------
// Audit.

#[test]
fn admissions_and_refusals_are_audited() {
    let server = Server::start("audit");
    let client = server.client("router-1");
    client.open(1);
    let mut raw = server.raw("router-2");
    raw.head("POST", "/v1/workers/router-1/sessions", &["content-type: application/json", "content-length: 2"])
        .unwrap();
    assert_eq!(raw.response().unwrap().error(), ErrorCode::PrincipalMismatch);
    // Admitted, then refused by the store: a heartbeat of a session that does not exist.
    let missing = SessionId::parse("ses_missing").unwrap();
    let hb = Heartbeat { generation: Counter::ONE, draining: false };
    assert_eq!(client.post(&Route::Heartbeat(wid("router-1"), missing), &hb).error(), ErrorCode::NotFound);
    let audits = server.audits();
    let found = |principal: &str, route: &str, outcome: &str| {
        audits.iter().any(|a| a.principal == Some(wid(principal)) && a.route == route && a.outcome == outcome)
    };
    assert!(found("router-1", "session.open", "admitted"));
    assert!(found("router-2", "session.open", "principal_mismatch"));
    let heartbeats: Vec<&str> =
        audits.iter().filter(|a| a.route == "session.heartbeat").map(|a| a.outcome.as_str()).collect();
    assert_eq!(heartbeats, ["admitted", "not_found"], "the outcome follows the admission");
    assert!(audits.iter().all(|a| a.at > 0), "DB time is filled in");
}

// ---------------------------------------------------------------------------------------
// Lifecycle.

#[test]
fn shutdown_closes_idle_connections_and_stops_accepting() {
    let mut server = Server::start("shutdown");
    let client = server.client("router-1");
    client.open(1);
    let ingress = server.ingress.take().unwrap();
    server.rt.block_on(ingress.shutdown()).unwrap();
    assert!(TcpStream::connect(server.addr).is_err(), "the listener is gone");
}

#[test]
fn a_stalled_handshake_times_out() {
    let cfg = IngressConfig { handshake_timeout: Duration::from_millis(200), ..test_config() };
    let server = Server::start_with("handshake", cfg);
    let _silent = TcpStream::connect(server.addr).unwrap();
    server.wait_for("the handshake to time out", |st| st.handshake_failures() == 1);
}

#[test]
fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let cfg = IngressConfig { idle_timeout: Duration::from_millis(300), ..test_config() };
    let server = Server::start_with("idle", cfg);
    let mut raw = server.raw("router-1");
    assert!(raw.ended(), "the server closed the idle connection");
    server.wait_for("the connection to close", |st| st.closed() == 1 && st.timed_out() == 1);
    assert_eq!(server.stats().requests(), 0);
}

#[test]
fn a_trickled_head_is_cut_off_at_the_header_timeout_however_its_bytes_keep_coming() {
    // The idle timeout is long; the head's clock starts at its first byte.
    let cfg = IngressConfig { header_read_timeout: Duration::from_millis(400), ..test_config() };
    let server = Server::start_with("trickle-head", cfg);
    let honest = server.client("router-2");
    let (session, generation) = honest.open(1);
    let before = server.snapshot();
    let mut raw = server.raw("router-1");
    // A head of 4,000 bytes, one every 10 ms, would take 40 s (each byte well within
    // any idle timeout). The pacing is the test's slow client, not a wait for the server.
    let head = format!("POST /v1/workers/router-1/sessions HTTP/1.1\r\nx-pad: {}", "a".repeat(4_000));
    let mut sent = 0;
    for byte in head.as_bytes() {
        if server.stats().timed_out() == 1 || raw.send(std::slice::from_ref(byte)).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(10));
        // An honest worker is served meanwhile.
        if sent == 20 {
            assert!(honest.poll(&session, generation, 0, 1).offers.is_empty());
        }
    }
    assert!(sent < head.len(), "cut off before the head was complete");
    server.wait_for("the trickled connection to be closed", |st| st.timed_out() == 1);
    assert!(raw.ended());
    assert_eq!(server.stats().requests(), 2, "the honest open and poll were the only requests");
    let after = server.snapshot();
    assert_eq!(after.events, before.events, "nothing of the trickle reached the store");
}

#[test]
fn a_long_poll_is_not_idle() {
    // The poll waits a second, three times the idle timeout, on its one connection.
    let cfg = IngressConfig {
        idle_timeout: Duration::from_millis(300),
        max_poll_wait: Duration::from_secs(1),
        ..test_config()
    };
    let server = Server::start_with("poll-idle", cfg);
    let client = server.client("router-1");
    let (session, generation) = client.open(1);
    assert!(client.poll(&session, generation, 1_000, 1).offers.is_empty());
    assert_eq!(server.stats().timed_out(), 0, "the poll's connection was not cut");
    assert_eq!(server.stats().connections(), 1, "one connection carried both requests");
}

#[test]
fn a_worker_declaring_a_label_the_operator_did_not_give_it_is_not_offered_the_run() {
    let server = Server::start("trusted-labels");
    let prod = || BTreeMap::from([("site".to_owned(), "cluster-prod".to_owned())]);
    let run = server.submit_for(prod());
    // router-1 holds a valid certificate and declares the label.
    let liar = server.client("router-1");
    let (session, generation) = liar.open_declaring(1, &[("site", "cluster-prod")]);
    let before = server.snapshot();
    assert!(liar.poll(&session, generation, 0, 1).offers.is_empty());
    let after = server.snapshot();
    assert_eq!((&after.runs, &after.offers, &after.events), (&before.runs, &before.offers, &before.events));
    // The operator gives the label to router-2, which declares nothing.
    let labelled = server.rt.block_on(server.store.execute(Command::LabelWorker(wid("router-2"), prod()))).unwrap();
    assert!(matches!(labelled, Ok(Reply::WorkerLabelled(_))));
    let node = server.client("router-2");
    let (session, generation) = node.open(1);
    let offers = node.poll(&session, generation, 0, 1).offers;
    assert_eq!(offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), vec![&run]);
}

#[test]
fn a_body_naming_a_worker_is_refused() {
    // Bodies never carry a worker identity: a body naming one is an unknown field.
    let server = Server::start("identity");
    let client = server.client("router-1");
    let answer = client.post_bytes(
        &Route::OpenSession(wid("router-1")),
        br#"{"agentVersion":"0.1.0","arch":"x86_64","labels":{},"capacity":1,"workerId":"router-2"}"#,
    );
    assert_eq!(answer.error(), ErrorCode::InvalidRequest);
    assert!(server.snapshot().sessions.is_empty());
}

#[test]
fn a_revoked_worker_is_refused_on_its_open_connection_and_another_finishes_its_run() {
    use ql_control::core::{Access, WORKER_REVOKED};
    use ql_control::model::{AttemptStatus, RunStatus};
    let server = Server::start("revoke");
    server.submit_with(BTreeMap::new(), 1);
    let w1 = server.client("router-1");
    let (session, generation) = w1.open(1);
    let offers = w1.poll(&session, generation, 0, 1).offers;
    let mut job = w1.claim(&session, generation, &offers[0]);
    assert_eq!(w1.starting(&job).result, Outcome::Started);
    assert_eq!(w1.running(&job, None).result, Outcome::Running);
    w1.renew(&mut job);
    let connections = server.stats().connections();
    let before = server.snapshot();

    let revoked = server.rt.block_on(server.store.execute(Command::SetAccess(wid("router-1"), Access::Revoke)));
    assert!(matches!(revoked, Ok(Ok(Reply::AccessChanged(c))) if c.sessions == 1 && c.attempts == 1));
    let after_revoke = server.snapshot();
    // The next request on the connection opened before is refused: its body, sent with
    // its head, is used for nothing, and the connection ends.
    let answer = w1.post(&job.route(AttemptCommand::RenewLease), &job.fence);
    assert_eq!(answer.error(), ErrorCode::CertificateRevoked);
    assert_eq!(server.stats().connections(), connections, "refused on the connection it already had");
    assert_eq!(server.audits().last().map(|a| a.outcome.as_str()), Some("certificate_revoked"));
    let refused = server.snapshot();
    assert_eq!(
        (&refused.runs, &refused.leases, &refused.events),
        (&after_revoke.runs, &after_revoke.leases, &after_revoke.events)
    );
    // A new connection of the same certificate fares no better.
    let body = OpenSession {
        agent_version: "0.1.0".parse().unwrap(),
        arch: "x86_64".parse().unwrap(),
        labels: BTreeMap::new(),
        capacity: 1,
    };
    let again = server.client("router-1").post(&Route::OpenSession(wid("router-1")), &body);
    assert_eq!(again.error(), ErrorCode::CertificateRevoked);
    // One that waits to be asked for its body is refused before it is asked.
    let mut raw = server.raw("router-1");
    let head = ["content-type: application/json", "content-length: 2", "expect: 100-continue"];
    raw.head("POST", &Route::OpenSession(wid("router-1")).path(), &head).unwrap();
    let response = raw.response().unwrap();
    assert_eq!(response.error(), ErrorCode::CertificateRevoked);
    assert!(response.interim.is_empty(), "refused before 100 Continue");
    assert!(response.closes());
    assert_eq!(server.snapshot().sessions, refused.sessions, "no session opened");

    let lost = &after_revoke.attempts[0];
    assert_eq!((lost.status, lost.error_code.as_deref()), (AttemptStatus::Lost, Some(WORKER_REVOKED)));
    assert_eq!(after_revoke.runs[0].status, RunStatus::Queued);
    assert_ne!(before.runs[0].status, RunStatus::Queued);

    // Another worker takes the run again and finishes it.
    let w2 = server.client("router-2");
    let (session, generation) = w2.open(1);
    let offers = w2.poll(&session, generation, 0, 1).offers;
    assert_eq!(offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), vec![&job.path.run]);
    let job2 = w2.claim(&session, generation, &offers[0]);
    assert_eq!(w2.starting(&job2).result, Outcome::Started);
    let done: CompletionReply = w2.post(&job2.route(AttemptCommand::Completion), &job2.completion(0, None)).json(200);
    assert_eq!(done.result, Outcome::Completed);
    let end = server.snapshot();
    assert_eq!(end.runs[0].status, RunStatus::Succeeded);
}

// ---------------------------------------------------------------------------------------
// Enrolment with a token, and renewal.

/// A PKCS#10 request for a fresh P-256 key whose subject's common name is `cn`.
fn csr(cn: &str) -> (rcgen::KeyPair, Vec<u8>) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(rcgen::DnType::CommonName, cn);
    let der = params.serialize_request(&key).unwrap().der().to_vec();
    (key, der)
}

impl Server {
    fn token(&self, worker: &str, ttl_ms: u64) -> Token {
        let token = Token::generate().unwrap();
        let cmd = Command::CreateEnrolment(wid(worker), token.digest(), ttl_ms);
        assert!(self.rt.block_on(self.store.execute(cmd)).unwrap().is_ok());
        token
    }

    /// POSTs `body` on a connection without a client certificate.
    fn anonymous_post(&self, path: &str, body: &[u8]) -> RawResponse {
        let mut raw = Raw::connect(self.addr, client_config(&self.ca_pem(), None, &[&rustls::version::TLS13])).unwrap();
        let length = format!("content-length: {}", body.len());
        raw.head("POST", path, &["content-type: application/json", &length]).unwrap();
        raw.send(body).unwrap();
        raw.response().unwrap()
    }

    fn enrol(&self, worker: &str, token: &Token, csr: &[u8]) -> RawResponse {
        let body = ql_wire::enrol::Enrol {
            token: token.clone(),
            csr: ql_wire::enrol::CertificateRequest::new(csr.to_vec()).unwrap(),
        };
        self.anonymous_post(&format!("/v1/workers/{worker}/certificate:enrol"), &ql_wire::encode(&body))
    }
}

/// A client whose credentials are `issued` for `key`.
fn issued_client(server: &Server, worker: &str, issued: &ql_wire::enrol::Issued, key: &rcgen::KeyPair) -> Client {
    let creds = Creds {
        ca: server.ca_pem(),
        cert: issued.certificate.as_str().as_bytes().to_vec(),
        key: key.serialize_pem().into_bytes(),
    };
    Client::new(server.addr, &creds, wid(worker))
}

#[test]
fn a_token_enrols_its_worker_once_and_every_other_use_stores_nothing() {
    let server = Server::start("enrol");
    let token = server.token("router-1", 600_000);
    let (key, request) = csr("router-1");
    let response = server.enrol("router-1", &token, &request);
    assert_eq!(response.status, 201, "{}", String::from_utf8_lossy(&response.body));
    let issued: ql_wire::enrol::Issued = ql_wire::decode(&response.body).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(issued.certificate.as_str().as_bytes()).unwrap();
    assert_eq!(http::tls::principal(&[pem.contents.clone().into()]), Ok(wid("router-1")));
    let snap = server.snapshot();
    assert_eq!(snap.certificates.len(), 1);
    assert_eq!(snap.certificates[0].serial, http::tls::serial(&[pem.contents.into()]));
    assert_eq!(snap.certificates[0].not_after, issued.not_after.millis());
    // The certificate works for its worker at once.
    let (_, generation) = issued_client(&server, "router-1", &issued, &key).open(1);
    assert_eq!(generation, Counter::ONE);

    let before = server.snapshot();
    let (_, again) = csr("router-1");
    assert_eq!(server.enrol("router-1", &token, &again).error(), ErrorCode::EnrolmentRefused, "a reused token");
    let other = server.token("router-2", 600_000);
    assert_eq!(server.enrol("router-1", &other, &again).error(), ErrorCode::EnrolmentRefused, "another worker's token");
    let (_, for_other) = csr("router-3");
    let third = server.token("router-1", 600_000);
    assert_eq!(
        server.enrol("router-1", &third, &for_other).error(),
        ErrorCode::InvalidRequest,
        "a CSR for another worker id"
    );
    assert_eq!(
        server.enrol("router-1", &third, b"\x30\x03\x02\x01\x00").error(),
        ErrorCode::InvalidRequest,
        "not a CSR"
    );
    let expired = server.token("router-1", 0);
    assert_eq!(server.enrol("router-1", &expired, &again).error(), ErrorCode::EnrolmentRefused, "an expired token");
    let after = server.snapshot();
    assert_eq!((&after.certificates, &after.sessions), (&before.certificates, &before.sessions), "nothing stored");
    // The token the CSR mismatch left unspent still works.
    assert_eq!(server.enrol("router-1", &third, &again).status, 201);
}

#[test]
fn a_worker_renews_over_its_own_certificate_and_the_old_one_can_then_be_revoked() {
    let server = Server::start("renew");
    let token = server.token("router-1", 600_000);
    let (key, request) = csr("router-1");
    let first: ql_wire::enrol::Issued = ql_wire::decode(&server.enrol("router-1", &token, &request).body).unwrap();
    let old = issued_client(&server, "router-1", &first, &key);
    let (new_key, request) = csr("router-1");
    let body = ql_wire::enrol::Renew { csr: ql_wire::enrol::CertificateRequest::new(request).unwrap() };
    let renew = format!("{}/v1/workers/router-1/certificate:renew", old.base);
    let mut response =
        old.agent.post(&renew).header("content-type", JSON_MEDIA_TYPE).send(&ql_wire::encode(&body)[..]).unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let second: ql_wire::enrol::Issued = ql_wire::decode(&response.body_mut().read_to_vec().unwrap()).unwrap();
    assert_eq!(server.snapshot().certificates.len(), 2);

    let old_serial = {
        let (_, pem) = x509_parser::pem::parse_x509_pem(first.certificate.as_str().as_bytes()).unwrap();
        http::tls::serial(&[pem.contents.into()])
    };
    let revoke = Command::RevokeCertificate(wid("router-1"), old_serial);
    assert!(server.rt.block_on(server.store.execute(revoke)).unwrap().is_ok());
    let (session, generation) = issued_client(&server, "router-1", &second, &new_key).open(1);
    let hb = old.post(&Route::Heartbeat(wid("router-1"), session), &Heartbeat { generation, draining: false });
    assert_eq!(hb.error(), ErrorCode::CertificateRevoked, "the old certificate, revoked after the rotation");

    // Renewal needs a certificate, and the worker's own.
    let anonymous = server.anonymous_post("/v1/workers/router-1/certificate:renew", &ql_wire::encode(&body));
    assert_eq!(anonymous.error(), ErrorCode::Unauthenticated);
    let stranger = server.client("router-2");
    let url = format!("{}/v1/workers/router-1/certificate:renew", stranger.base);
    let response = stranger.agent.post(&url).header("content-type", JSON_MEDIA_TYPE).send(&ql_wire::encode(&body)[..]);
    assert_eq!(response.unwrap().status().as_u16(), 403, "another worker's renewal: principal_mismatch");
    assert_eq!(server.snapshot().certificates.len(), 2, "nothing issued for them");
}

#[test]
fn connections_without_a_certificate_have_a_cap_of_their_own() {
    let cfg = IngressConfig { max_anonymous_connections: 1, ..test_config() };
    let server = Server::start_with("anonymous-cap", cfg);
    let anonymous = || Raw::connect(server.addr, client_config(&server.ca_pem(), None, &[&rustls::version::TLS13]));
    // Two at once for the one slot: one holds it (sending nothing), the other is turned
    // away without an answer.
    let mut both = [anonymous().unwrap(), anonymous().unwrap()];
    server.wait_for("one of them to be turned away", |st| st.turned_away() == 1);
    let answered = both
        .iter_mut()
        .map(|raw| raw.head("GET", "/v1/ca", &[]).is_ok() && raw.response().is_ok_and(|r| r.status == 200))
        .filter(|served| *served)
        .count();
    assert_eq!(answered, 1, "the one holding the slot is served, the other was closed");
    // Workers are not touched by it.
    let (_, generation) = server.client("router-1").open(1);
    assert_eq!(generation, Counter::ONE);
}

#[test]
fn connections_beyond_max_connections_are_closed_at_once_and_those_served_go_on() {
    let metrics = Arc::new(ql_control::metrics::Metrics::new());
    metrics.set_max_connections(3);
    let cfg = IngressConfig { max_connections: 3, metrics: Some(metrics.clone()), ..test_config() };
    let server = Server::start_with("slots", cfg);
    let served: Vec<(Client, SessionId, Counter)> = (1..=3)
        .map(|i| {
            let client = server.client(&format!("router-{i}"));
            let (session, generation) = client.open(1);
            (client, session, generation)
        })
        .collect();
    // Three more workers, each with a valid certificate: every one is closed after its
    // handshake, without an answer, instead of waiting in the backlog.
    for i in 4..=6 {
        let mut raw = server.raw(&format!("router-{i}"));
        raw.head("POST", &format!("/v1/workers/router-{i}/sessions"), &["content-length: 0"]).unwrap();
        assert!(raw.ended(), "router-{i} was closed, not served");
    }
    server.wait_for("three connections to be turned away and closed", |st| st.turned_away() == 3 && st.closed() == 3);
    // Those served go on, on the connections they hold.
    for (client, session, generation) in &served {
        let route = Route::Heartbeat(client.worker.clone(), session.clone());
        let hb: HeartbeatReply = client.post(&route, &Heartbeat { generation: *generation, draining: false }).json(200);
        assert_eq!(hb.status, SessionStatus::Online);
    }
    assert_eq!(server.snapshot().sessions.len(), 3, "no session for the workers turned away");
    let text = server.rt.block_on(metrics.render(&server.store)).unwrap();
    for line in [
        "ql_worker_connections 3",
        "ql_worker_connections_max 3",
        "ql_worker_connections_turned_away_total{reason=\"slots\"} 3",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
}
