//! A worker's certificate, obtained and renewed over the protocol (a v1 addition): the
//! key is made on the device and never leaves it; the server sees a PKCS#10 request and
//! answers a certificate.
//!
//! | method | path | who | body | answer |
//! |---|---|---|---|---|
//! | GET | `/v1/ca` | anyone | none | [`CaBundle`] |
//! | POST | `/v1/workers/{w}/certificate:enrol` | anyone with a token for `w` | [`Enrol`] | `201` [`Issued`] |
//! | POST | `/v1/workers/{w}/certificate:renew` | `w`, by its current certificate | [`Renew`] | `201` [`Issued`] |
//!
//! An agent enrolling first reads the worker CA over a connection it does not verify,
//! checks it against the SHA-256 fingerprint the operator gave it, and only then sends
//! its token, over a connection verified against that CA: a machine in the middle
//! learns nothing it could use. The token is single-use and expires; a refusal is
//! `403 enrolment_refused` whatever the reason, so nobody learns which tokens exist.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::capability::Token;
use crate::ids::{Invalid, WorkerId};
use crate::limits::JSON_BODY_CAP;
use crate::time::Timestamp;
use crate::Body;

/// The largest DER certificate signing request accepted.
pub const CSR_MAX_BYTES: usize = 2048;
/// The largest PEM text of an issued certificate or of the CA bundle.
pub const PEM_MAX_BYTES: usize = 8 * 1024;
/// The largest body of an identity route.
pub const IDENTITY_BODY_CAP: usize = JSON_BODY_CAP;

/// A PKCS#10 certificate signing request, DER, carried as unpadded base64url.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CertificateRequest(Vec<u8>);

impl CertificateRequest {
    /// Wraps DER bytes, refusing an empty or oversized request.
    pub fn new(der: Vec<u8>) -> Result<Self, Invalid> {
        if der.is_empty() {
            return Err(Invalid::Empty);
        }
        if der.len() > CSR_MAX_BYTES {
            return Err(Invalid::TooLong { max: CSR_MAX_BYTES });
        }
        Ok(Self(der))
    }

    /// The DER bytes.
    pub fn der(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for CertificateRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CertificateRequest({} bytes)", self.0.len())
    }
}

impl TryFrom<String> for CertificateRequest {
    type Error = Invalid;
    fn try_from(s: String) -> Result<Self, Invalid> {
        Self::new(crate::base64::decode(s.as_bytes(), crate::base64::URL).ok_or(Invalid::Charset)?)
    }
}

impl From<CertificateRequest> for String {
    fn from(c: CertificateRequest) -> Self {
        crate::base64::encode(&c.0, crate::base64::URL)
    }
}

/// Checks PEM text's shape (not the certificate: the receiver parses that): bounded,
/// printable, starting with a certificate block.
fn check_pem(text: &str) -> Result<(), Invalid> {
    if text.len() > PEM_MAX_BYTES {
        return Err(Invalid::TooLong { max: PEM_MAX_BYTES });
    }
    if !text.starts_with("-----BEGIN CERTIFICATE-----") {
        return Err(Invalid::Schema);
    }
    if text.bytes().any(|b| !(b == b'\n' || b == b'\r' || (0x20..0x7f).contains(&b))) {
        return Err(Invalid::NotPrintable);
    }
    Ok(())
}

crate::ids::string_type!(
    /// PEM text: one or more `-----BEGIN CERTIFICATE-----` blocks, bounded.
    CertificatePem,
    check_pem
);

/// `POST .../certificate:enrol`: the one-time token and the device's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Enrol {
    /// The secret half of the operator's enrolment token.
    pub token: Token,
    /// The request, for the worker's own key.
    pub csr: CertificateRequest,
}

impl Body for Enrol {
    const CAP: usize = IDENTITY_BODY_CAP;
}

/// `POST .../certificate:renew`: a new key's request, over the current certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Renew {
    /// The request, for a new key.
    pub csr: CertificateRequest,
}

impl Body for Renew {
    const CAP: usize = IDENTITY_BODY_CAP;
}

/// Answer to [`Enrol`] and [`Renew`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Issued {
    /// The worker's certificate.
    pub certificate: CertificatePem,
    /// Its last valid moment.
    pub not_after: Timestamp,
}

impl Body for Issued {
    const CAP: usize = PEM_MAX_BYTES + 256;
}

/// Answer to `GET /v1/ca`: the worker CA, which also signed the server's certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CaBundle {
    /// The CA certificate.
    pub ca: CertificatePem,
}

impl Body for CaBundle {
    const CAP: usize = PEM_MAX_BYTES + 64;
}

/// The identity routes, apart from the run protocol's [`crate::route::Route`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IdentityRoute {
    /// `GET /v1/ca`.
    Ca,
    /// `POST /v1/workers/{w}/certificate:enrol`.
    Enrol(WorkerId),
    /// `POST /v1/workers/{w}/certificate:renew`.
    Renew(WorkerId),
}

impl IdentityRoute {
    /// Parses a method and a path, as strictly as [`crate::route::Route::parse`].
    pub fn parse(method: &str, path: &str) -> Option<Self> {
        if crate::route::escapes(path) {
            return None;
        }
        if (method, path) == ("GET", "/v1/ca") {
            return Some(Self::Ca);
        }
        let rest = path.strip_prefix("/v1/workers/")?;
        let (worker, tail) = rest.split_once('/')?;
        let worker = WorkerId::parse(worker).ok()?;
        match (method, tail) {
            ("POST", "certificate:enrol") => Some(Self::Enrol(worker)),
            ("POST", "certificate:renew") => Some(Self::Renew(worker)),
            _ => None,
        }
    }

    /// The HTTP method.
    pub fn method(&self) -> &'static str {
        match self {
            Self::Ca => "GET",
            _ => "POST",
        }
    }

    /// The path.
    pub fn path(&self) -> String {
        match self {
            Self::Ca => "/v1/ca".to_owned(),
            Self::Enrol(w) => format!("/v1/workers/{w}/certificate:enrol"),
            Self::Renew(w) => format!("/v1/workers/{w}/certificate:renew"),
        }
    }

    /// A stable name for audit records.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Ca => "ca.get",
            Self::Enrol(_) => "certificate.enrol",
            Self::Renew(_) => "certificate.renew",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> WorkerId {
        WorkerId::parse("router-1").unwrap()
    }

    #[test]
    fn identity_routes_round_trip_and_nothing_else_parses() {
        for r in [IdentityRoute::Ca, IdentityRoute::Enrol(w()), IdentityRoute::Renew(w())] {
            assert_eq!(IdentityRoute::parse(r.method(), &r.path()), Some(r.clone()));
            let other = if r.method() == "GET" { "POST" } else { "GET" };
            assert_eq!(IdentityRoute::parse(other, &r.path()), None);
        }
        for bad in [
            "/v1/ca/",
            "/v1/workers/router-1/certificate:enrol/",
            "/v1/workers/Router-1/certificate:enrol",
            "/v1/workers/router-1/certificate",
            "/v1/workers/router-1/certificate%3Aenrol",
            "/v1/workers//certificate:renew",
            "/v1/workers/router-1/sessions",
        ] {
            assert_eq!(IdentityRoute::parse("POST", bad), None, "{bad}");
        }
    }

    #[test]
    fn a_request_is_base64url_bounded_and_never_printed() {
        let csr = CertificateRequest::new(vec![0x30, 0x82, 1, 2]).unwrap();
        let text: String = csr.clone().into();
        assert_eq!(text, "MIIBAg");
        assert_eq!(CertificateRequest::try_from(text).unwrap(), csr);
        assert_eq!(CertificateRequest::new(vec![]), Err(Invalid::Empty));
        assert_eq!(CertificateRequest::new(vec![0; CSR_MAX_BYTES + 1]), Err(Invalid::TooLong { max: CSR_MAX_BYTES }));
        assert!(CertificateRequest::try_from("MII+Ag".to_owned()).is_err(), "the standard alphabet is not base64url");
        assert_eq!(format!("{csr:?}"), "CertificateRequest(4 bytes)");
    }

    #[test]
    fn certificate_text_must_look_like_pem() {
        assert!(CertificatePem::parse("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").is_ok());
        assert_eq!(CertificatePem::parse("MIIB"), Err(Invalid::Schema));
        assert_eq!(CertificatePem::parse("-----BEGIN CERTIFICATE-----\u{7}"), Err(Invalid::NotPrintable));
        let long = format!("-----BEGIN CERTIFICATE-----{}", "A".repeat(PEM_MAX_BYTES));
        assert_eq!(CertificatePem::parse(long), Err(Invalid::TooLong { max: PEM_MAX_BYTES }));
    }
}
