//! One request, from its head to its answer.
//!
//! Everything that can refuse a request without its body runs before the body is first
//! polled, in this order: authentication (the connection's principal), the route, the
//! binding of the path's worker to the principal, the admission (a disabled worker, a
//! revoked certificate: [`super::trail`] says when it is decided and how it goes on
//! record), and the framing headers. A request refused before its admission leaves one
//! audit record with the refusal's code; one admitted and then refused (framing, a fence,
//! a twin's open) leaves `admitted` and then its code. hyper sends `100 Continue` only
//! when the body is first polled, so an agent that sends `Expect: 100-continue` learns of
//! every one of these refusals before it sends a single body byte. A refusal before the
//! body ends the connection (`Connection: close`): the unread body must never be taken
//! for the next request; so does a refused admission.
//!
//! The artifact route then reads the body only as far as the frame header — polling it
//! there is what releases `100 Continue` — and asks the store to re-check the fence in
//! its transaction ([`Command::AdmitArtifact`]). A fence refusal is answered without
//! reading any content. Only an admitted upload streams its content, frame by frame,
//! through the [`FrameDecoder`](ql_wire::frame::FrameDecoder) into the artifact store;
//! memory stays bounded by one frame, whatever the artifact's size. Before the upload is made visible the fence is
//! checked once more ([`Command::ConfirmArtifact`]): content that trickled in until after
//! its lease was swept, or its run ended, is discarded, and other content than the first
//! confirmed for the attempt is refused before it reaches the store. The live-log routes (PROTOCOL §13) are in
//! [`super::log`]: a chunk is framed the same way and admitted the same way.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, EXPECT};
use hyper::{Request, Response, StatusCode};
use tokio::time::{sleep_until, timeout, Instant};
use zeroize::Zeroizing;

use ql_wire::ack::{Abandon, Running, StartFailure};
use ql_wire::artifact::ArtifactHeader;
use ql_wire::artifact::ArtifactReply;
use ql_wire::completion::Completion;
use ql_wire::frame::{Decoder, FrameError, FrameHeader, Item};
use ql_wire::ids::{ArtifactId, SessionId, WorkerId};
use ql_wire::log::Seal;
use ql_wire::offer::{Claim, PollOffers};
use ql_wire::route::{AttemptCommand, AttemptPath, Route, JSON_MEDIA_TYPE};
use ql_wire::session::{CloseSession, Heartbeat, OpenSession};
use ql_wire::{Body, ErrorBody, ErrorCode, Fence, Outcome};

use super::trail::Trail;
use super::{framing, log, IngressConfig, IngressStats};
use crate::blob::{ArtifactKey, BlobStore, PutOutcome, Upload as _};
use crate::core::{Command, Reply};
use crate::fault::{self, Fault, Reset};
use crate::model::AuditRecord;
use crate::store::{Store, StoreError};

/// What every connection of one server shares.
pub(super) struct Shared<S, B> {
    pub(super) store: S,
    pub(super) blobs: B,
    pub(super) cfg: IngressConfig,
    pub(super) stats: Arc<IngressStats>,
    /// The seals being composed in this process (see [`super::log`]).
    pub(super) sealing: log::Sealing,
    /// Handshakes and connections held, for the limits of [`super`].
    pub(super) occupancy: super::occupancy::Occupancy,
    /// Lines about refused connections, at a bounded rate.
    pub(super) reports: super::Reports,
}

/// The per-connection hyper service: the shared parts and the connection's principal,
/// extracted once after the handshake (`None` when the certificate names no worker).
pub(super) struct Service<S, B> {
    pub(super) shared: Arc<Shared<S, B>>,
    pub(super) principal: Option<WorkerId>,
    /// The client certificate's serial number (lowercase hex), when it has a principal.
    pub(super) serial: String,
    /// Set once a worker request of the connection succeeded (its worker's share of
    /// connections keeps it before those never admitted: see [`super`]).
    pub(super) admitted: Option<Arc<AtomicBool>>,
    /// For a connection without a certificate: when its request's body must have come.
    pub(super) read_by: Option<Instant>,
    /// Set when an answer left request bytes unread: the connection then ends with a
    /// lingering close.
    pub(super) unread: Arc<AtomicBool>,
    /// Lets a fault point reset the connection (test builds only; see [`crate::fault`]).
    pub(super) reset: Reset,
    /// The connection's idle and head clocks: stopped while a request is answered.
    pub(super) clock: Arc<super::head::HeadClock>,
}

type Answered = Pin<Box<dyn Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send>>;

impl<S: Store, B: BlobStore> hyper::service::Service<Request<Incoming>> for Service<S, B> {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    // Boxed so the future is `Unpin`, which `poll_without_shutdown` (used for the
    // lingering close) requires.
    type Future = Answered;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        if let Some(by) = self.read_by {
            req.extensions_mut().insert(ReadBy(by));
        }
        let shared = self.shared.clone();
        let principal = self.principal.clone();
        let serial = self.serial.clone();
        let unread = self.unread.clone();
        let reset = self.reset.clone();
        let clock = self.clock.clone();
        let admitted = self.admitted.clone();
        clock.answering();
        Box::pin(async move {
            shared.stats.requests.fetch_add(1, Ordering::Relaxed);
            let (routed, started) = (Routed::of(&req), Instant::now());
            let route = routed.name();
            let worker_route = matches!(routed, Routed::Worker(_));
            let answer = handle(&shared, principal, serial, req, routed, &reset).await;
            // Only an admitted request of a worker route succeeds.
            if let (true, true, Some(admitted)) = (worker_route, answer.status.is_success(), &admitted) {
                admitted.store(true, Ordering::Relaxed);
            }
            if let Some(metrics) = &shared.cfg.metrics {
                metrics.request(route, answer.status.as_u16(), started.elapsed());
            }
            clock.answered();
            if answer.close {
                unread.store(true, Ordering::Relaxed);
            }
            Ok(answer.into_response())
        })
    }
}

/// A response about to be sent.
pub(super) struct Answer {
    status: StatusCode,
    body: Vec<u8>,
    /// End the connection after this response (the request body was not read to its end).
    close: bool,
    /// The refusal's code, for the audit record of the request's outcome.
    code: Option<ErrorCode>,
}

impl Answer {
    pub(super) fn ok<T: Body>(status: StatusCode, body: &T) -> Self {
        Self { status, body: ql_wire::encode(body), close: false, code: None }
    }

    pub(super) fn refuse(code: ErrorCode) -> Self {
        let status = StatusCode::from_u16(code.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        Self { status, body: ql_wire::encode(&ErrorBody::new(code)), close: false, code: Some(code) }
    }

    /// A refusal whose request body was not read to its end.
    pub(super) fn refuse_and_close(code: ErrorCode) -> Self {
        Self { close: true, ..Self::refuse(code) }
    }

    /// `409 log_offset_conflict` with the acknowledged length.
    pub(super) fn log_conflict(acked: u64) -> Self {
        let body = ErrorBody { error: ErrorCode::LogOffsetConflict, acked: Some(acked) };
        let code = Some(ErrorCode::LogOffsetConflict);
        Self { status: StatusCode::CONFLICT, body: ql_wire::encode(&body), close: false, code }
    }

    /// The same, when the request body was not read to its end.
    pub(super) fn closing(self) -> Self {
        Self { close: true, ..self }
    }

    /// The refusal's code, if this is one that is still to be recorded.
    pub(super) fn code(&self) -> Option<ErrorCode> {
        self.code
    }

    /// A refusal already on record (the admission recorded it).
    pub(super) fn unaudited(self) -> Self {
        Self { code: None, ..self }
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let length = self.body.len();
        let mut response = Response::new(Full::new(Bytes::from(self.body)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(JSON_MEDIA_TYPE));
        headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
        // Claims carry the execution spec (its environment may hold secrets).
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if self.close {
            headers.insert(CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// What a request's method and path name, parsed once for its handling and its metric:
/// an identity route, or a worker route or none. A query string is never part of a route.
enum Routed {
    Identity(ql_wire::enrol::IdentityRoute),
    Worker(Option<Route>),
}

impl Routed {
    fn of(req: &Request<Incoming>) -> Self {
        let (method, path) = (req.method().as_str(), req.uri().path());
        if req.uri().query().is_some() {
            return Self::Worker(None);
        }
        match ql_wire::enrol::IdentityRoute::parse(method, path) {
            Some(route) => Self::Identity(route),
            None => Self::Worker(Route::parse(method, path).ok()),
        }
    }

    /// The route's name (one of a fixed set, `unknown` for any other request): a
    /// metric's label.
    fn name(&self) -> &'static str {
        match self {
            Self::Identity(route) => route.name(),
            Self::Worker(route) => route.as_ref().map_or("unknown", Route::name),
        }
    }
}

async fn handle<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    principal: Option<WorkerId>,
    serial: String,
    req: Request<Incoming>,
    routed: Routed,
    reset: &Reset,
) -> Answer {
    let name = routed.name();
    let route = match routed {
        Routed::Identity(route) => {
            return Box::pin(super::identity::handle(shared, principal, serial, route, req)).await
        }
        Routed::Worker(route) => route,
    };
    let Some(principal) = principal else {
        Box::pin(audit_refusal(shared, None, name, ErrorCode::Unauthenticated)).await;
        return Answer::refuse_and_close(ErrorCode::Unauthenticated);
    };
    let Some(route) = route else {
        Box::pin(audit_refusal(shared, Some(principal), name, ErrorCode::NotFound)).await;
        return Answer::refuse_and_close(ErrorCode::NotFound);
    };
    if *route.worker() != principal {
        Box::pin(audit_refusal(shared, Some(principal), name, ErrorCode::PrincipalMismatch)).await;
        return Answer::refuse_and_close(ErrorCode::PrincipalMismatch);
    }
    // The admission is decided per request, so a certificate revoked (or a worker
    // disabled) while a connection is open is refused on that connection's next request:
    // before the body is asked for, or, for a small JSON body the client sent unasked,
    // with the command in one transaction ([`Trail`]). A refusal is on record at once; an
    // admission goes on record with the request's first command.
    let record =
        AuditRecord { at: 0, principal: Some(principal.clone()), route: name.to_owned(), outcome: "admitted".into() };
    let framed = matches!(route, Route::Artifact(..) | Route::LogAppend(_));
    let trail = if framed || req.headers().contains_key(EXPECT) {
        match Box::pin(shared.store.admit(record.clone(), serial)).await {
            Ok(None) => Trail::admitted(shared.store.clone(), record),
            Ok(Some(code)) => return Answer::refuse_and_close(code),
            Err(_) => return Answer::refuse_and_close(ErrorCode::Unavailable),
        }
    } else {
        Trail::deferred(shared.store.clone(), record, serial)
    };
    let mut answer = match framing::check(&route, req.headers()) {
        Err(code) => Answer::refuse_and_close(code),
        Ok(length) => {
            let body = req.into_body();
            let fault = fault::on_request(route.name());
            // Each route's future boxed: a request's future is as large as its largest
            // await, and a long-poll, which lives 25 s, would carry an upload's state.
            match route {
                Route::Artifact(path, artifact) => {
                    Box::pin(put_artifact(shared, &trail, path, artifact, length, body, (fault, reset))).await
                }
                Route::LogAppend(path) => {
                    Box::pin(log::append(shared, &trail, path, length, body, (fault, reset))).await
                }
                route => Box::pin(json_route(shared, &trail, route, length, body, (fault, reset))).await,
            }
        }
    };
    // A request refused before its first command is admitted (or refused) now.
    match Box::pin(trail.settle()).await {
        Ok(None) => {}
        Ok(Some(code)) => answer = Answer::refuse_and_close(code),
        Err(_) => answer = Answer::refuse_and_close(ErrorCode::Unavailable),
    }
    if answer.code.is_some_and(super::trail::is_admission_refusal) {
        answer = answer.closing();
    }
    // An admitted request refused after all (framing, a fence, a replay's conflict, a
    // twin's open) gets a second record: its outcome.
    if !Box::pin(trail.finish(answer.code)).await {
        shared.stats.audit_failures.fetch_add(1, Ordering::Relaxed);
    }
    answer
}

/// The fault to inject into one request and the handle to reset its connection (test
/// builds only; see [`crate::fault`]: without the feature, there is never a fault).
pub(super) type Injected<'a> = (Option<Fault>, &'a Reset);

/// Acts out a fault that strikes after the command ran: its transaction has committed.
pub(super) async fn after_commit((fault, reset): Injected<'_>) {
    match fault {
        Some(Fault::Drop) => reset.fire().await,
        Some(Fault::Crash) => fault::crash(),
        Some(Fault::Delay(delay)) => tokio::time::sleep(delay).await,
        Some(Fault::Refuse | Fault::Reset | Fault::Conflict) | None => {}
    }
}

/// Records a refusal. A failed write does not change the answer: the request is refused
/// either way and nothing was read or changed.
pub(super) async fn audit_refusal<S: Store, B>(
    shared: &Shared<S, B>,
    principal: Option<WorkerId>,
    route: &str,
    code: ErrorCode,
) {
    let record = AuditRecord { at: 0, principal, route: route.to_owned(), outcome: code.as_str().to_owned() };
    if shared.store.audit(record).await.is_err() {
        shared.stats.audit_failures.fetch_add(1, Ordering::Relaxed);
    }
}

/// How long a request body may take: each piece within the idle timeout, and the whole
/// body within a deadline set by its length — [`IngressConfig::upload_grace`] plus the
/// length at [`IngressConfig::min_upload_rate`] — so a trickle cannot hold a connection
/// (or an upload its lease) indefinitely.
///
/// [`IngressConfig::upload_grace`]: super::IngressConfig::upload_grace
/// [`IngressConfig::min_upload_rate`]: super::IngressConfig::min_upload_rate
pub(super) struct BodyClock {
    idle: Duration,
    deadline: Instant,
}

/// When the body of a request on a connection without a certificate must have come (a
/// request extension): such a connection holds one of few slots, so its whole request,
/// the part its peer controls, fits in the head's time.
#[derive(Clone, Copy)]
pub(super) struct ReadBy(pub(super) Instant);

impl BodyClock {
    /// The clock of a body of `length` bytes, starting now.
    pub(super) fn new(cfg: &IngressConfig, length: u64) -> Self {
        let rate = cfg.min_upload_rate.max(1);
        let crawl = Duration::from_secs_f64(length as f64 / rate as f64);
        Self { idle: cfg.body_idle_timeout, deadline: Instant::now() + cfg.upload_grace + crawl }
    }

    /// The same clock, ending by `by` at the latest.
    pub(super) fn until(self, by: Option<ReadBy>) -> Self {
        Self { deadline: by.map_or(self.deadline, |b| self.deadline.min(b.0)), ..self }
    }
}

/// The next non-empty data frame, `None` at the end of the body. A stalled, too slow or
/// broken body is `invalid_request`: it cannot be the exact body the headers declared.
pub(super) async fn next_data(body: &mut Incoming, clock: &BodyClock) -> Result<Option<Bytes>, ErrorCode> {
    loop {
        let left = clock.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorCode::InvalidRequest);
        }
        match timeout(clock.idle.min(left), body.frame()).await {
            Err(_) | Ok(Some(Err(_))) => return Err(ErrorCode::InvalidRequest),
            Ok(None) => return Ok(None),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if !data.is_empty() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }
}

/// Reads exactly `length` bytes (already within the route's cap) into a buffer that is
/// wiped on drop: JSON bodies carry lease and callback tokens.
pub(super) async fn read_exact(
    body: &mut Incoming,
    length: u64,
    clock: &BodyClock,
) -> Result<Zeroizing<Vec<u8>>, ErrorCode> {
    let length = usize::try_from(length).map_err(|_| ErrorCode::PayloadTooLarge)?;
    let mut buf = Zeroizing::new(Vec::with_capacity(length));
    while let Some(data) = next_data(body, clock).await? {
        if buf.len() + data.len() > length {
            return Err(ErrorCode::InvalidRequest);
        }
        buf.extend_from_slice(&data);
    }
    if buf.len() != length {
        return Err(ErrorCode::InvalidRequest);
    }
    Ok(buf)
}

fn decode<T: Body>(bytes: &[u8]) -> Result<T, Answer> {
    ql_wire::decode::<T>(bytes).map_err(|_| Answer::refuse(ErrorCode::InvalidRequest))
}

async fn json_route<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    trail: &Trail<S>,
    route: Route,
    length: u64,
    mut body: Incoming,
    injected: Injected<'_>,
) -> Answer {
    let bytes = match read_exact(&mut body, length, &BodyClock::new(&shared.cfg, length)).await {
        Ok(bytes) => bytes,
        Err(code) => return Answer::refuse_and_close(code),
    };
    match injected.0 {
        Some(Fault::Refuse) => return Answer::refuse(ErrorCode::Unavailable),
        Some(Fault::Reset) => injected.1.fire().await,
        _ => {}
    }
    let answer = match json_command(shared, trail, route, &bytes).await {
        Ok(answer) | Err(answer) => answer,
    };
    after_commit(injected).await;
    answer
}

async fn json_command<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    trail: &Trail<S>,
    route: Route,
    bytes: &[u8],
) -> Result<Answer, Answer> {
    let command = match route {
        Route::OpenSession(worker) => Command::OpenSession(worker, decode::<OpenSession>(bytes)?),
        Route::Heartbeat(worker, session) => Command::Heartbeat(worker, session, decode::<Heartbeat>(bytes)?),
        Route::CloseSession(worker, session) => Command::CloseSession(worker, session, decode::<CloseSession>(bytes)?),
        Route::PollOffers(worker, session) => {
            return Ok(poll(shared, trail, worker, session, decode::<PollOffers>(bytes)?).await);
        }
        Route::Claim(worker, session, offer) => Command::Claim(worker, session, offer, decode::<Claim>(bytes)?),
        Route::Attempt(path, AttemptCommand::Starting) => Command::Starting(path, decode::<Fence>(bytes)?),
        Route::Attempt(path, AttemptCommand::Running) => Command::Running(path, decode::<Running>(bytes)?),
        Route::Attempt(path, AttemptCommand::StartFailure) => {
            Command::StartFailure(path, decode::<StartFailure>(bytes)?)
        }
        Route::Attempt(path, AttemptCommand::RenewLease) => Command::Renew(path, decode::<Fence>(bytes)?),
        Route::Attempt(path, AttemptCommand::Abandon) => Command::Abandon(path, decode::<Abandon>(bytes)?),
        Route::Attempt(path, AttemptCommand::Completion) => {
            return Ok(Box::pin(complete(shared, trail, path, decode::<Completion>(bytes)?)).await);
        }
        Route::Seal(path, artifact) => {
            return Ok(Box::pin(log::seal(shared, trail, path, artifact, decode::<Seal>(bytes)?)).await);
        }
        // Dispatched before the body is read; never reaches here.
        Route::Artifact(..) | Route::LogAppend(_) => return Err(Answer::refuse(ErrorCode::NotFound)),
    };
    Ok(answer(Box::pin(trail.execute(command)).await))
}

/// The wire answer to a store outcome.
pub(super) fn answer(result: Result<Result<Reply, ErrorCode>, StoreError>) -> Answer {
    let reply = match result {
        Ok(Ok(reply)) => reply,
        Ok(Err(code)) => return Answer::refuse(code),
        Err(_) => return Answer::refuse(ErrorCode::Unavailable),
    };
    match reply {
        Reply::SessionOpened(body) => Answer::ok(StatusCode::CREATED, &body),
        Reply::Heartbeat(body) => Answer::ok(StatusCode::OK, &body),
        Reply::SessionClosed(body) => Answer::ok(StatusCode::OK, &body),
        Reply::Offers(body, _) => Answer::ok(StatusCode::OK, &body),
        Reply::Claimed(body) => Answer::ok(StatusCode::OK, &*body),
        Reply::Ack(body) => Answer::ok(StatusCode::OK, &body),
        Reply::Renewed(body) => Answer::ok(StatusCode::OK, &body),
        Reply::Completed(body) => Answer::ok(StatusCode::OK, &body),
        Reply::LogAppended(body) => Answer::ok(StatusCode::OK, &body),
        Reply::LogOffsetConflict(acked) => Answer::log_conflict(acked),
        // Operator and internal replies never answer a worker route; if one ever did, the
        // authority misbehaved and the worker should try again later.
        Reply::ArtifactAdmitted(_)
        | Reply::ChunkAdmitted(_)
        | Reply::SealAdmitted(_)
        | Reply::Submitted(_)
        | Reply::Cancelled(_)
        | Reply::WorkerLabelled(_)
        | Reply::AccessChanged(_)
        | Reply::CertificateRevoked(..)
        | Reply::CertificateRecorded(_)
        | Reply::EnrolmentCreated(_)
        | Reply::Schedule(_)
        | Reply::Operator(_)
        | Reply::Deliveries(_)
        | Reply::Delivery(_)
        | Reply::Fired(_)
        | Reply::Swept(_)
        | Reply::Graced(_) => Answer::refuse(ErrorCode::Unavailable),
    }
}

/// The offers long-poll: poll, and while nothing is offered and time remains, wait for
/// the store's change counter (or the deadline) and poll again — unless every wake-up
/// since was for runs this session does not take (what it takes came with the poll's
/// answer), then wait on without asking the store. At the deadline the last answer
/// stands: whatever could have placed a run woke the wait. The counter is marked seen
/// before each poll, so a change committed between the poll and the wait still wakes it;
/// there is no busy loop.
async fn poll<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    trail: &Trail<S>,
    worker: WorkerId,
    session: SessionId,
    body: PollOffers,
) -> Answer {
    let wait = Duration::from_millis(body.wait_ms).min(shared.cfg.max_poll_wait);
    let deadline = Instant::now() + wait;
    let mut changes = shared.store.changes();
    let mut seen = *changes.borrow_and_update();
    loop {
        // Boxed: a long-poll waits far longer than it executes, and holds only its wait.
        let result = Box::pin(trail.execute(Command::PollOffers(worker.clone(), session.clone(), body.clone()))).await;
        let fit = match &result {
            Ok(Ok(Reply::Offers(o, fit))) if o.offers.is_empty() => fit.as_ref().clone(),
            _ => return answer(result),
        };
        if Instant::now() >= deadline {
            return answer(result);
        }
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    // The store is gone: nothing will wake us, so wait out the deadline.
                    if changed.is_err() {
                        sleep_until(deadline).await;
                        return answer(result);
                    }
                }
                // Nothing that concerned this session happened: the answer stands (the
                // poll kept the session alive for the whole wait when it began).
                () = sleep_until(deadline) => return answer(result),
            }
            let now = *changes.borrow_and_update();
            let concerned = shared.store.wakes_since(seen, now).is_none_or(|wants| wants.iter().any(|w| fit.takes(w)));
            seen = now;
            if concerned {
                break;
            }
        }
    }
}

/// Completion: re-inspect the stored artifact (ADR-0117 §3) before the transaction, so
/// the decision compares the receipt with what the store holds, not with what the worker
/// says it holds. A completion that records the artifact makes the live log's chunks
/// garbage ([`log::remove_chunks`]).
async fn complete<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    trail: &Trail<S>,
    path: AttemptPath,
    body: Completion,
) -> Answer {
    let (key, stored) = match &body.artifact {
        None => (None, None),
        Some(receipt) => {
            // A run's project never changes, so reading it outside the transaction is safe;
            // an unknown run is left for the transaction to refuse.
            let project = match shared.store.run_detail(&path.run).await {
                Ok(detail) => detail.map(|d| d.run.project),
                Err(_) => return Answer::refuse(ErrorCode::Unavailable),
            };
            match project {
                None => (None, None),
                Some(project) => {
                    let key = ArtifactKey {
                        project,
                        run: path.run.clone(),
                        attempt: path.attempt.clone(),
                        artifact: receipt.artifact_id.clone(),
                    };
                    match shared.blobs.inspect(&key).await {
                        Ok(stored) => (Some(key), stored),
                        Err(_) => return Answer::refuse(ErrorCode::Unavailable),
                    }
                }
            }
        }
    };
    let outcome = trail.execute(Command::Complete(path, body, stored)).await;
    if let (Ok(Ok(Reply::Completed(reply))), Some(key)) = (&outcome, key) {
        // Completed now with the artifact: the attempt records its receipt. Not on a
        // replay (`already_completed`), which a worker may send as often as it likes:
        // chunks a crash left behind are the artifact store's collection's.
        if reply.result == Outcome::Completed {
            log::remove_chunks(shared, key);
        }
    }
    answer(outcome)
}

/// A decoder for a framed body of `length` bytes (a body over the route's cap is `413`,
/// one too short for a frame `400`), and the frame's header read with [`read_header`].
pub(super) async fn open_frame<H: FrameHeader>(
    length: u64,
    body: &mut Incoming,
    clock: &BodyClock,
) -> Result<(Decoder<H>, H, Bytes), Answer> {
    let mut decoder = match Decoder::<H>::new(length) {
        Ok(decoder) => decoder,
        Err(FrameError::TooLarge { .. }) => return Err(Answer::refuse_and_close(ErrorCode::PayloadTooLarge)),
        Err(_) => return Err(Answer::refuse_and_close(ErrorCode::InvalidRequest)),
    };
    let (header, pending) = read_header(&mut decoder, body, clock).await?;
    Ok((decoder, header, pending))
}

/// Reads a frame's header, and not a byte further than the data frame that carries it;
/// returns the header and the rest of that data frame. This first poll of the body is
/// what makes hyper send `100 Continue`.
async fn read_header<H: FrameHeader>(
    decoder: &mut Decoder<H>,
    body: &mut Incoming,
    clock: &BodyClock,
) -> Result<(H, Bytes), Answer> {
    loop {
        let data = match next_data(body, clock).await {
            Ok(Some(data)) => data,
            Ok(None) | Err(_) => return Err(Answer::refuse_and_close(ErrorCode::InvalidRequest)),
        };
        let mut input: &[u8] = &data;
        // The decoder consumes the slice until it completes the header (or runs out);
        // it never yields content before the header.
        let header = match decoder.next(&mut input) {
            Ok(Some(Item::Header(header))) => Some(header),
            Ok(None) => None,
            Ok(Some(Item::Content(_))) | Err(_) => return Err(Answer::refuse_and_close(ErrorCode::InvalidRequest)),
        };
        if let Some(header) = header {
            let consumed = data.len() - input.len();
            return Ok((header, data.slice(consumed..)));
        }
    }
}

/// The artifact upload of ADR-0117: header, fence, then content. See the module doc.
async fn put_artifact<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    trail: &Trail<S>,
    path: AttemptPath,
    artifact: ArtifactId,
    length: u64,
    mut body: Incoming,
    injected: Injected<'_>,
) -> Answer {
    if injected.0 == Some(Fault::Refuse) {
        return Answer::refuse_and_close(ErrorCode::Unavailable);
    }
    // 1. The frame header, and not a byte further than the frame that carries it.
    let clock = BodyClock::new(&shared.cfg, length);
    let (mut decoder, header, mut pending) = match open_frame::<ArtifactHeader>(length, &mut body, &clock).await {
        Ok(opened) => opened,
        Err(answer) => return answer,
    };

    // 2. The fence, re-checked under the store's transaction; the database is released
    //    before any content moves.
    let (content_length, truncated) = (header.content_length, header.truncated);
    let admitted = trail.execute(Command::AdmitArtifact(path.clone(), artifact.clone(), header.clone())).await;
    let project = match admitted {
        Ok(Ok(Reply::ArtifactAdmitted(project))) => project,
        Ok(Ok(_)) | Err(_) => return Answer::refuse_and_close(ErrorCode::Unavailable),
        Ok(Err(code)) => return Answer::refuse_and_close(code),
    };
    let key = ArtifactKey { project, run: path.run.clone(), attempt: path.attempt.clone(), artifact: artifact.clone() };
    let mut upload = match shared.blobs.begin(&key, content_length, truncated).await {
        Ok(upload) => upload,
        Err(_) => return Answer::refuse_and_close(ErrorCode::Unavailable),
    };

    // 3. The content, frame by frame. Any failure drops `upload`, which discards it.
    let mut stored = 0u64;
    loop {
        let mut input: &[u8] = &pending;
        loop {
            match decoder.next(&mut input) {
                Ok(Some(Item::Content(content))) => {
                    if upload.write(content).await.is_err() {
                        return Answer::refuse_and_close(ErrorCode::Unavailable);
                    }
                    stored += content.len() as u64;
                    if injected.0 == Some(Fault::Reset) && stored >= fault::RESET_UPLOAD_AFTER {
                        injected.1.fire().await;
                    }
                }
                Ok(None) => break,
                Ok(Some(Item::Header(_))) | Err(_) => return Answer::refuse_and_close(ErrorCode::InvalidRequest),
            }
        }
        pending = match next_data(&mut body, &clock).await {
            Ok(Some(data)) => data,
            Ok(None) => break,
            Err(code) => return Answer::refuse_and_close(code),
        };
    }
    if decoder.finish().is_err() {
        return Answer::refuse_and_close(ErrorCode::InvalidRequest);
    }

    // The body was read to its end, so the connection stays usable whatever the outcome.
    // The lease may have been swept (or the run ended) while the content crawled in: then
    // it is not stored. Its receipt is claimed for the attempt under the same check.
    let Ok(receipt) = upload.receipt() else {
        return Answer::refuse(ErrorCode::InvalidRequest);
    };
    match shared.store.execute(Command::ConfirmArtifact(path, artifact, header, receipt)).await {
        Ok(Ok(Reply::ArtifactAdmitted(_))) => {}
        Ok(Err(code)) => return Answer::refuse(code),
        Ok(Ok(_)) | Err(_) => return Answer::refuse(ErrorCode::Unavailable),
    }
    let finished = upload.finish().await;
    after_commit(injected).await;
    match finished {
        Ok(PutOutcome::Stored(receipt)) => {
            Answer::ok(StatusCode::OK, &ArtifactReply { result: Outcome::Stored, receipt })
        }
        Ok(PutOutcome::AlreadyStored(receipt)) => {
            Answer::ok(StatusCode::OK, &ArtifactReply { result: Outcome::AlreadyStored, receipt })
        }
        Ok(PutOutcome::Conflict) => Answer::refuse(ErrorCode::ArtifactConflict),
        Err(_) => Answer::refuse(ErrorCode::Unavailable),
    }
}
