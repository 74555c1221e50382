//! The identity routes ([`ql_wire::enrol`]): the worker CA for anyone who asks, a
//! certificate for the holder of a one-time enrolment token, and a renewed certificate
//! for a worker that proves itself with its current one.
//!
//! Only these routes serve a connection without a client certificate (one request each,
//! see [`super`]). The request's key is checked (ECDSA P-256, signed by that key, the
//! worker id as its subject) and the certificate is signed before the store is asked, so
//! the store decides on the token (or the worker's standing) and records the serial in one
//! transaction: a refused request stores nothing, and the certificate made for it is
//! never sent. A replica without `ca.key` answers `503 unavailable`.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, StatusCode};

use ql_wire::enrol::{CaBundle, CertificatePem, Enrol, IdentityRoute, Issued, Renew, IDENTITY_BODY_CAP};
use ql_wire::ids::WorkerId;
use ql_wire::route::JSON_MEDIA_TYPE;
use ql_wire::time::Timestamp;
use ql_wire::ErrorCode;

use super::framing;
use super::ingress::{audit_refusal, read_exact, Answer, BodyClock, ReadBy, Shared};
use crate::blob::BlobStore;
use crate::core::{Command, Issuer, Reply};
use crate::model::AuditRecord;
use crate::pki::Ca;
use crate::store::Store;

/// What the ingress needs to issue certificates.
pub struct Identity {
    /// The worker CA certificate (PEM), served at `GET /v1/ca`.
    pub ca_pem: String,
    /// The CA with its key; `None` on a replica that has no `ca.key`.
    pub ca: Option<Ca>,
    /// How long an issued certificate is valid.
    pub lifetime: Duration,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("issues", &self.ca.is_some()).field("lifetime", &self.lifetime).finish()
    }
}

impl PartialEq for Identity {
    fn eq(&self, other: &Self) -> bool {
        self.ca_pem == other.ca_pem && self.lifetime == other.lifetime && self.ca.is_some() == other.ca.is_some()
    }
}

impl Eq for Identity {}

/// Answers one identity request.
pub(super) async fn handle<S: Store, B: BlobStore>(
    shared: &Arc<Shared<S, B>>,
    principal: Option<WorkerId>,
    serial: String,
    route: IdentityRoute,
    req: Request<Incoming>,
) -> Answer {
    let name = route.name();
    let Some(identity) = shared.cfg.identity.clone() else {
        audit_refusal(shared, principal, name, ErrorCode::NotFound).await;
        return Answer::refuse_and_close(ErrorCode::NotFound);
    };
    let answer = match route {
        IdentityRoute::Ca => ca(shared, principal.clone(), &identity).await,
        IdentityRoute::Enrol(worker) => enrol(shared, &identity, worker, req).await,
        IdentityRoute::Renew(worker) => renew(shared, &identity, principal.clone(), serial, worker, req).await,
    };
    if let Some(code) = answer.code() {
        audit_refusal(shared, principal, name, code).await;
    }
    answer
}

async fn ca<S: Store, B: BlobStore>(shared: &Shared<S, B>, principal: Option<WorkerId>, identity: &Identity) -> Answer {
    let record = AuditRecord { at: 0, principal, route: "ca.get".into(), outcome: "admitted".into() };
    if shared.store.audit(record).await.is_err() {
        return Answer::refuse_and_close(ErrorCode::Unavailable);
    }
    match CertificatePem::parse(identity.ca_pem.clone()) {
        Ok(ca) => Answer::ok(StatusCode::OK, &CaBundle { ca }),
        Err(_) => Answer::refuse(ErrorCode::Unavailable),
    }
}

/// The request's body, framed as every JSON body is, within the identity routes' cap.
async fn body<S: Store, B: BlobStore>(shared: &Shared<S, B>, req: Request<Incoming>) -> Result<Vec<u8>, Answer> {
    let length = framing::check_body(JSON_MEDIA_TYPE, IDENTITY_BODY_CAP as u64, req.headers())
        .map_err(Answer::refuse_and_close)?;
    let clock = BodyClock::new(&shared.cfg, length).until(req.extensions().get::<ReadBy>().copied());
    let mut body = req.into_body();
    let bytes = read_exact(&mut body, length, &clock).await.map_err(Answer::refuse_and_close)?;
    Ok(bytes.to_vec())
}

/// Signs a certificate for the request's key, or says why not.
fn issue(identity: &Identity, worker: &WorkerId, csr: &[u8]) -> Result<crate::pki::Issued, Answer> {
    let ca = identity.ca.as_ref().ok_or(Answer::refuse(ErrorCode::Unavailable))?;
    ca.issue_for_request(worker, csr, identity.lifetime).map_err(|_| Answer::refuse(ErrorCode::InvalidRequest))
}

/// The answer to a recorded certificate.
fn issued(result: Result<Result<Reply, ErrorCode>, crate::store::StoreError>, pem: String) -> Answer {
    match result {
        Ok(Ok(Reply::CertificateRecorded(c))) => {
            match (CertificatePem::parse(pem), Timestamp::from_millis(c.not_after)) {
                (Ok(certificate), Ok(not_after)) => Answer::ok(StatusCode::CREATED, &Issued { certificate, not_after }),
                _ => Answer::refuse(ErrorCode::Unavailable),
            }
        }
        Ok(Ok(_)) | Err(_) => Answer::refuse(ErrorCode::Unavailable),
        Ok(Err(code)) => Answer::refuse(code),
    }
}

async fn enrol<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    identity: &Identity,
    worker: WorkerId,
    req: Request<Incoming>,
) -> Answer {
    let record = AuditRecord { at: 0, principal: None, route: "certificate.enrol".into(), outcome: "admitted".into() };
    if shared.store.audit(record).await.is_err() {
        return Answer::refuse_and_close(ErrorCode::Unavailable);
    }
    let bytes = match body(shared, req).await {
        Ok(bytes) => zeroize::Zeroizing::new(bytes),
        Err(answer) => return answer,
    };
    let Ok(request) = ql_wire::decode::<Enrol>(&bytes) else {
        return Answer::refuse(ErrorCode::InvalidRequest);
    };
    let issued_now = match issue(identity, &worker, request.csr.der()) {
        Ok(issued) => issued,
        Err(answer) => return answer,
    };
    let cert = crate::identity::certificate(&worker, &issued_now);
    let result = shared.store.execute(Command::Enrol(request.token.digest(), cert)).await;
    issued(result, issued_now.pem)
}

async fn renew<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    identity: &Identity,
    principal: Option<WorkerId>,
    serial: String,
    worker: WorkerId,
    req: Request<Incoming>,
) -> Answer {
    let Some(principal) = principal else {
        return Answer::refuse_and_close(ErrorCode::Unauthenticated);
    };
    if principal != worker {
        return Answer::refuse_and_close(ErrorCode::PrincipalMismatch);
    }
    let record = AuditRecord {
        at: 0,
        principal: Some(principal),
        route: "certificate.renew".into(),
        outcome: "admitted".into(),
    };
    match shared.store.admit(record.clone(), serial.clone()).await {
        Ok(None) => {}
        // Recorded by the admission itself.
        Ok(Some(code)) => return Answer::refuse_and_close(code).unaudited(),
        Err(_) => return Answer::refuse_and_close(ErrorCode::Unavailable),
    }
    // A renewal is rare: its admission goes on record by itself, before the body.
    if shared.store.audit(record).await.is_err() {
        return Answer::refuse_and_close(ErrorCode::Unavailable);
    }
    let bytes = match body(shared, req).await {
        Ok(bytes) => bytes,
        Err(answer) => return answer,
    };
    let Ok(request) = ql_wire::decode::<Renew>(&bytes) else {
        return Answer::refuse(ErrorCode::InvalidRequest);
    };
    let issued_now = match issue(identity, &worker, request.csr.der()) {
        Ok(issued) => issued,
        Err(answer) => return answer,
    };
    let cert = crate::identity::certificate(&worker, &issued_now);
    let result = shared.store.execute(Command::RecordCertificate(cert, Issuer::Worker(serial))).await;
    issued(result, issued_now.pem)
}
