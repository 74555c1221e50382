//! `ql-agent enroll`: this device gets its worker certificate with a one-time token, its
//! key made here and never sent anywhere.
//!
//! 1. The token (`<workerId>.<secret>`, from `ql-control enroll W --token`) names the
//!    worker.
//! 2. The worker CA is read from `GET /v1/ca` over a connection that verifies nothing,
//!    and its SHA-256 fingerprint must be the one the operator gave: otherwise nothing
//!    more is sent.
//! 3. A P-256 key and a request for it are made ([`crate::identity`]), and the token and
//!    the request go to `POST /v1/workers/{w}/certificate:enrol` over a connection that
//!    trusts only that CA.
//! 4. Key (0600), certificate and CA are installed under the directory given, as
//!    `<worker>.key`, `<worker>.crt` and `ca.crt` (what the OpenWrt service and the
//!    example `agent.conf` expect). The token is spent by then: a failure after it
//!    needs a new token.

use std::path::Path;

use ql_wire::capability::{Digest, Token};
use ql_wire::enrol::{CaBundle, CertificateRequest, Enrol, IdentityRoute, Issued};
use ql_wire::ids::WorkerId;

use crate::client::{CallError, Client, Timeouts};
use crate::identity;

/// Where the files went.
pub(crate) struct Enrolled {
    pub(crate) worker: WorkerId,
    pub(crate) not_after: ql_wire::time::Timestamp,
}

/// The fingerprint as the operator may have typed it: hex, any case, colons allowed.
fn normalise(fingerprint: &str) -> Option<String> {
    let hex: String = fingerprint.trim().chars().filter(|c| *c != ':').collect::<String>().to_ascii_lowercase();
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hex)
}

fn refused(what: &str, e: CallError) -> String {
    match e.code() {
        Some(ql_wire::ErrorCode::EnrolmentRefused) => {
            format!("{what}: the server refused the token (unknown, used, expired or for another worker); ask for a new one")
        }
        Some(ql_wire::ErrorCode::WorkerDisabled) => format!("{what}: the worker is disabled on the server"),
        _ => format!("{what}: {e}"),
    }
}

/// Checks the CA bundle the server sent against the pinned fingerprint: it must hold
/// exactly one certificate, whose SHA-256 is the pin, since everything trusted from then on
/// (the enrolment's connection, the `ca.crt` written) is that bundle.
fn pinned_ca(bundle: &[u8], pinned: &str) -> Result<(), String> {
    let found = ureq::tls::parse_pem(bundle).filter(|i| matches!(i, Ok(ureq::tls::PemItem::Certificate(_)))).count();
    if found != 1 {
        return Err(format!("the server's CA bundle holds {found} certificates, not one: nothing was sent"));
    }
    let der = identity::first_certificate(bundle).ok_or("the server's CA is not a certificate")?;
    let seen = Digest::of(&der);
    if seen.as_str() != pinned {
        return Err(format!(
            "the server's CA has fingerprint {} and not the one given: nothing was sent (a wrong server, or a machine in between)",
            seen.as_str()
        ));
    }
    Ok(())
}

/// Enrols this device (see the module doc).
pub(crate) fn enroll(
    server: &str,
    token: &str,
    fingerprint: &str,
    dir: &Path,
    timeouts: Timeouts,
) -> Result<Enrolled, String> {
    let (worker, secret) = token
        .trim()
        .rsplit_once('.')
        .and_then(|(w, s)| Some((WorkerId::parse(w).ok()?, Token::parse(s).ok()?)))
        .ok_or("the token is not `<worker>.<secret>` as `ql-control enroll --token` prints it")?;
    let pinned = normalise(fingerprint).ok_or("--ca-fingerprint is not a SHA-256 in hex")?;

    let unverified = Client::anonymous(server, None, timeouts).map_err(|e| e.0)?;
    let bundle: CaBundle = unverified
        .identity::<CaBundle, CaBundle>(&IdentityRoute::Ca, None)
        .map_err(|e| refused("reading the CA", e))?;
    pinned_ca(bundle.ca.as_str().as_bytes(), &pinned)?;

    let key = identity::new_key(&worker)?;
    let csr = CertificateRequest::new(key.csr.clone()).map_err(|e| format!("the request: {e}"))?;
    let verified = Client::anonymous(server, Some(bundle.ca.as_str().as_bytes()), timeouts).map_err(|e| e.0)?;
    let issued: Issued = verified
        .identity(&IdentityRoute::Enrol(worker.clone()), Some(&Enrol { token: secret, csr }))
        .map_err(|e| refused("enrolling", e))?;

    identity::certifies(issued.certificate.as_str().as_bytes(), &key.public)?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (key_path, cert_path) = (dir.join(format!("{worker}.key")), dir.join(format!("{worker}.crt")));
    identity::install(&key_path, &key.pem, &cert_path, issued.certificate.as_str())?;
    identity::write_atomically(&dir.join("ca.crt"), bundle.ca.as_str().as_bytes(), 0o644)?;
    Ok(Enrolled { worker, not_after: issued.not_after })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bundle_of_the_one_pinned_certificate_is_trusted() {
        let one: &[u8] = include_bytes!("testdata/validity.crt");
        let der = identity::first_certificate(one).unwrap();
        let pin = Digest::of(&der).as_str().to_owned();
        assert_eq!(pinned_ca(one, &pin), Ok(()));
        assert!(pinned_ca(one, &"00".repeat(32)).unwrap_err().contains("nothing was sent"));
        // The real CA first, and another after it: the pin would match the first.
        let two = [one, one].concat();
        assert!(pinned_ca(&two, &pin).unwrap_err().contains("2 certificates"));
        assert!(pinned_ca(b"", &pin).is_err());
    }

    #[test]
    fn fingerprints_are_read_as_an_operator_types_them() {
        let hex = "ab".repeat(32);
        assert_eq!(normalise(&hex.to_uppercase()), Some(hex.clone()));
        let colons: String =
            hex.as_bytes().chunks(2).map(|c| std::str::from_utf8(c).unwrap()).collect::<Vec<_>>().join(":");
        assert_eq!(normalise(&colons), Some(hex));
        assert_eq!(normalise("abcd"), None);
        assert_eq!(normalise(&"zz".repeat(32)), None);
    }
}
