//! TLS for the worker ingress: TLS 1.3 only, client certificates verified against the
//! worker CA (a connection without one is anonymous: only the identity routes serve it),
//! and the principal read from the verified certificate.
//!
//! The principal is the certificate's one URI subject alternative name
//! `urn:qinglong:worker:<workerId>` (PROTOCOL §2). A certificate with no URI SAN, with
//! more than one (even if only one has our form), or whose URI is not a valid worker id
//! has no principal: its requests are answered `401 unauthenticated`. Being strict about
//! "exactly one URI" means a certificate can never speak for two identities.
//!
//! Only ring provides the cryptography (no aws-lc-rs enters the tree).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use x509_parser::extensions::GeneralName;

use ql_wire::ids::WorkerId;

use crate::pki::{read_secret, PkiPaths, WORKER_URI_PREFIX};

/// The ALPN protocol the ingress speaks.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Why a server configuration could not be built.
#[derive(Debug)]
pub enum TlsError {
    /// A PEM input held no certificate, no key, or was malformed (names the input).
    Pem(&'static str),
    /// A file could not be read.
    Io(String),
    /// rustls refused the certificates or the key.
    Rustls(rustls::Error),
    /// The client verifier could not be built from the CA.
    Verifier(rustls::server::VerifierBuilderError),
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pem(what) => write!(f, "{what}: no usable PEM item"),
            Self::Io(why) => f.write_str(why),
            Self::Rustls(e) => write!(f, "TLS configuration refused: {e}"),
            Self::Verifier(e) => write!(f, "client verifier: {e}"),
        }
    }
}

impl std::error::Error for TlsError {}

/// The ring provider every TLS object of the ingress uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The ingress's server configuration: TLS 1.3 only, a client certificate chaining to
/// `ca_pem` required, ALPN `http/1.1`. `cert_pem` may hold the server certificate followed
/// by intermediates.
pub fn server_config(ca_pem: &[u8], cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let mut roots = RootCertStore::empty();
    let mut any_root = false;
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert.map_err(|_| TlsError::Pem("worker CA"))?).map_err(TlsError::Rustls)?;
        any_root = true;
    }
    if !any_root {
        return Err(TlsError::Pem("worker CA"));
    }
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| TlsError::Pem("server certificate"))?;
    if chain.is_empty() {
        return Err(TlsError::Pem("server certificate"));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| TlsError::Pem("server key"))?;

    // A client certificate, when one is presented, must chain to the worker CA; a client
    // may present none, and is then served only the identity routes (an agent enrolling
    // with a token has no certificate yet), one request per connection.
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(TlsError::Verifier)?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(TlsError::Rustls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(TlsError::Rustls)?;
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(config))
}

/// [`server_config`] from the files [`crate::pki::init_pki`] wrote under `dir`.
pub fn server_config_from_dir(dir: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let paths = PkiPaths::new(dir);
    let read = |p: &Path| std::fs::read(p).map_err(|e| TlsError::Io(format!("{}: {e}", p.display())));
    let key = read_secret(&paths.server_key).map_err(|e| TlsError::Io(e.to_string()))?;
    server_config(&read(&paths.ca_cert)?, &read(&paths.server_cert)?, key.as_bytes())
}

/// The operator API's server configuration: the same server certificate as the worker
/// ingress, TLS 1.3 only, no client certificate (operators present a bearer token).
pub fn operator_config_from_dir(dir: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let paths = PkiPaths::new(dir);
    let cert_pem =
        std::fs::read(&paths.server_cert).map_err(|e| TlsError::Io(format!("{}: {e}", paths.server_cert.display())))?;
    let key_pem = read_secret(&paths.server_key).map_err(|e| TlsError::Io(e.to_string()))?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| TlsError::Pem("server certificate"))?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|_| TlsError::Pem("server key"))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(TlsError::Rustls)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(TlsError::Rustls)?;
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(config))
}

/// Why a verified peer has no principal. Every variant answers `401 unauthenticated`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unauthenticated {
    /// The peer presented no certificate.
    NoCertificate,
    /// The end-entity certificate or its SAN extension could not be parsed.
    Unparsable,
    /// The certificate has no URI SAN.
    NoWorkerUri,
    /// The certificate has more than one URI SAN.
    SeveralUris,
    /// The URI is not `urn:qinglong:worker:<valid workerId>`.
    BadWorkerUri,
}

impl fmt::Display for Unauthenticated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoCertificate => "no client certificate",
            Self::Unparsable => "the client certificate cannot be parsed",
            Self::NoWorkerUri => "the client certificate has no worker URI",
            Self::SeveralUris => "the client certificate has more than one URI",
            Self::BadWorkerUri => "the client certificate's URI is not a worker principal",
        })
    }
}

impl std::error::Error for Unauthenticated {}

/// The serial number of a verified peer's end-entity certificate, as the authority
/// records it ([`crate::pki::serial_hex`]); empty without a parsable certificate.
pub fn serial(peer: &[CertificateDer<'_>]) -> String {
    peer.first()
        .and_then(|der| x509_parser::parse_x509_certificate(der).ok())
        .map(|(_, cert)| crate::pki::serial_hex(cert.raw_serial()))
        .unwrap_or_default()
}

/// The worker principal of a verified peer chain (end-entity certificate first).
pub fn principal(peer: &[CertificateDer<'_>]) -> Result<WorkerId, Unauthenticated> {
    let end_entity = peer.first().ok_or(Unauthenticated::NoCertificate)?;
    let (rest, cert) = x509_parser::parse_x509_certificate(end_entity).map_err(|_| Unauthenticated::Unparsable)?;
    if !rest.is_empty() {
        return Err(Unauthenticated::Unparsable);
    }
    // A duplicated SAN extension is an error here, never "pick one".
    let san = cert.subject_alternative_name().map_err(|_| Unauthenticated::Unparsable)?;
    let mut uris = san.iter().flat_map(|ext| ext.value.general_names.iter()).filter_map(|name| match name {
        GeneralName::URI(uri) => Some(*uri),
        _ => None,
    });
    let uri = uris.next().ok_or(Unauthenticated::NoWorkerUri)?;
    if uris.next().is_some() {
        return Err(Unauthenticated::SeveralUris);
    }
    let id = uri.strip_prefix(WORKER_URI_PREFIX).ok_or(Unauthenticated::BadWorkerUri)?;
    WorkerId::parse(id).map_err(|_| Unauthenticated::BadWorkerUri)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType};

    fn cert_with(sans: Vec<SanType>) -> CertificateDer<'static> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        params.self_signed(&key).unwrap().der().clone()
    }

    fn uri(s: &str) -> SanType {
        SanType::URI(s.try_into().unwrap())
    }

    #[test]
    fn the_one_worker_uri_is_the_principal() {
        let cert =
            cert_with(vec![uri("urn:qinglong:worker:router-1"), SanType::DnsName("r1.example".try_into().unwrap())]);
        assert_eq!(principal(&[cert]), Ok(WorkerId::parse("router-1").unwrap()));
    }

    #[test]
    fn no_uri_is_refused() {
        assert_eq!(principal(&[cert_with(vec![])]), Err(Unauthenticated::NoWorkerUri));
        let dns_only = cert_with(vec![SanType::DnsName("router-1".try_into().unwrap())]);
        assert_eq!(principal(&[dns_only]), Err(Unauthenticated::NoWorkerUri));
    }

    #[test]
    fn two_uris_are_refused_even_when_one_is_ours() {
        let two = cert_with(vec![uri("urn:qinglong:worker:router-1"), uri("spiffe://example/router-1")]);
        assert_eq!(principal(&[two]), Err(Unauthenticated::SeveralUris));
        let both_ours = cert_with(vec![uri("urn:qinglong:worker:router-1"), uri("urn:qinglong:worker:router-2")]);
        assert_eq!(principal(&[both_ours]), Err(Unauthenticated::SeveralUris));
    }

    #[test]
    fn foreign_or_invalid_uris_are_refused() {
        for bad in [
            "spiffe://example/router-1",
            "urn:qinglong:worker:",
            "urn:qinglong:worker:Router-1",
            "urn:qinglong:worker:router-1/x",
            "URN:qinglong:worker:router-1",
            "urn:qinglong:workers:router-1",
        ] {
            assert_eq!(principal(&[cert_with(vec![uri(bad)])]), Err(Unauthenticated::BadWorkerUri), "{bad}");
        }
    }

    #[test]
    fn no_or_garbage_certificate_is_refused() {
        assert_eq!(principal(&[]), Err(Unauthenticated::NoCertificate));
        assert_eq!(principal(&[CertificateDer::from(vec![0x30, 0x03, 1, 2, 3])]), Err(Unauthenticated::Unparsable));
    }

    #[test]
    fn server_config_loads_the_pki_and_refuses_missing_parts() {
        let dir = crate::pki::tests::TempDir::new("tls-config");
        let paths = crate::pki::init_pki(dir.path(), &["127.0.0.1".into(), "localhost".into()]).unwrap();
        let config = server_config_from_dir(dir.path()).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
        let ca = std::fs::read(&paths.ca_cert).unwrap();
        let cert = std::fs::read(&paths.server_cert).unwrap();
        assert!(matches!(server_config(b"", &cert, b""), Err(TlsError::Pem("worker CA"))));
        assert!(matches!(server_config(&ca, b"", b""), Err(TlsError::Pem("server certificate"))));
        assert!(matches!(server_config(&ca, &cert, b"not a key"), Err(TlsError::Pem("server key"))));
    }
}
