//! The worker PKI: one private CA per control plane, the server certificate the agents
//! verify, and one client certificate per worker (PROTOCOL §2).
//!
//! Layout under the control plane's data directory:
//!
//! | file | mode | what |
//! |---|---|---|
//! | `<dir>/pki/ca.crt` | 0644 | the worker CA (self-signed, `CA:TRUE, pathlen:0`, key usage cert sign) |
//! | `<dir>/pki/ca.key` | 0600 | its key |
//! | `<dir>/pki/server.crt` | 0644 | the ingress certificate: the given DNS names and IP addresses, server-auth |
//! | `<dir>/pki/server.key` | 0600 | its key |
//!
//! [`enroll`] issues a worker certificate whose only subject alternative name is the URI
//! `urn:qinglong:worker:<workerId>` — the principal the ingress binds every path to — with
//! the client-auth extended key usage, and writes it with its key and the CA certificate
//! for the agent to install.
//!
//! Keys are ECDSA P-256 made by ring. A key file is created with mode 0600 from the start
//! (never widened and narrowed later) and with `create_new`, so an existing key is never
//! overwritten: re-running [`init_pki`] on an initialised directory, or enrolling a worker
//! whose files are still in `out`, is refused. Key PEM text is only ever held in
//! [`Zeroizing`] buffers and is never printed. Writes are not transactional: if one fails
//! half-way, remove what was written and run the command again.

use std::fmt;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use x509_parser::time::ASN1Time;
use zeroize::Zeroizing;

use crate::keys::hex;

use ql_wire::ids::WorkerId;

/// The scheme and namespace of a worker principal URI; the worker id follows.
pub const WORKER_URI_PREFIX: &str = "urn:qinglong:worker:";

/// How long the worker CA is valid.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long the server certificate is valid.
pub const SERVER_VALIDITY: Duration = Duration::from_secs(2 * 365 * 24 * 3600);
/// How long a worker certificate is valid by default (`worker_cert_lifetime_ms`); its
/// agent renews it when about two thirds of that has passed.
pub const WORKER_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
/// Certificates start up to this long before they are made, so a peer whose clock is a
/// little behind does not refuse a fresh one (an eighth of a shorter lifetime).
pub const BACKDATE: Duration = Duration::from_secs(3600);

/// The principal URI of a worker: `urn:qinglong:worker:<id>`.
pub fn worker_uri(worker: &WorkerId) -> String {
    format!("{WORKER_URI_PREFIX}{worker}")
}

/// The files of an initialised PKI directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PkiPaths {
    /// `<dir>/pki`.
    pub dir: PathBuf,
    /// The CA certificate.
    pub ca_cert: PathBuf,
    /// The CA key (mode 0600).
    pub ca_key: PathBuf,
    /// The server certificate.
    pub server_cert: PathBuf,
    /// The server key (mode 0600).
    pub server_key: PathBuf,
}

impl PkiPaths {
    /// The paths under the data directory `dir` (nothing is read or created).
    pub fn new(dir: &Path) -> Self {
        let pki = dir.join("pki");
        Self {
            ca_cert: pki.join("ca.crt"),
            ca_key: pki.join("ca.key"),
            server_cert: pki.join("server.crt"),
            server_key: pki.join("server.key"),
            dir: pki,
        }
    }
}

/// The files [`enroll`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolled {
    /// `<out>/<workerId>.crt`.
    pub cert: PathBuf,
    /// `<out>/<workerId>.key` (mode 0600).
    pub key: PathBuf,
    /// `<out>/ca.crt`: the root the agent trusts for the server.
    pub ca: PathBuf,
}

/// A worker certificate just issued, for the authority's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// The certificate (PEM).
    pub pem: String,
    /// Its serial number ([`serial_hex`]).
    pub serial: String,
    /// Its last valid moment, in milliseconds since the epoch.
    pub not_after_ms: i64,
}

/// Why a PKI command failed. Never carries key material.
#[derive(Debug)]
pub enum PkiError {
    /// Reading or writing a file failed.
    Io(PathBuf, io::Error),
    /// The file exists already and is not overwritten.
    Exists(PathBuf),
    /// The server certificate needs at least one host name or address.
    NoHosts,
    /// A host is neither an IP address nor a usable DNS name.
    Host(String),
    /// The stored CA is unusable (not PEM, not a CA, or its key does not match).
    BadCa(String),
    /// Certificate generation failed.
    Cert(rcgen::Error),
    /// A certificate signing request was refused (why, in a few words).
    Csr(&'static str),
}

impl fmt::Display for PkiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(path, e) => write!(f, "{}: {e}", path.display()),
            Self::Exists(path) => write!(f, "{} exists already; refusing to overwrite it", path.display()),
            Self::NoHosts => f.write_str("the server certificate needs at least one host name or IP address"),
            Self::Host(host) => write!(f, "{host:?} is neither an IP address nor a DNS name"),
            Self::BadCa(why) => write!(f, "the worker CA is unusable: {why}"),
            Self::Cert(e) => write!(f, "certificate generation failed: {e}"),
            Self::Csr(why) => write!(f, "certificate signing request refused: {why}"),
        }
    }
}

impl std::error::Error for PkiError {}

impl From<rcgen::Error> for PkiError {
    fn from(e: rcgen::Error) -> Self {
        Self::Cert(e)
    }
}

/// Creates the worker CA and the server certificate for `hosts` under `<dir>/pki`.
///
/// A host that parses as an IP address becomes an IP SAN, anything else a DNS SAN.
/// Refuses to touch a directory that already holds any of the four files.
pub fn init_pki(dir: &Path, hosts: &[String]) -> Result<PkiPaths, PkiError> {
    let paths = PkiPaths::new(dir);
    if hosts.is_empty() {
        return Err(PkiError::NoHosts);
    }
    for path in [&paths.ca_cert, &paths.ca_key, &paths.server_cert, &paths.server_key] {
        if fs::symlink_metadata(path).is_ok() {
            return Err(PkiError::Exists(path.clone()));
        }
    }

    let ca_key = KeyPair::generate()?;
    let ca_params = ca_params(&format!("QingLong Edge worker CA {}", hex(&random::<4>())));
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, &ca_key);

    let server_key = KeyPair::generate()?;
    let mut server = leaf_params(&hosts[0], SERVER_VALIDITY);
    for host in hosts {
        server.subject_alt_names.push(host_san(host)?);
    }
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = server.signed_by(&server_key, &issuer)?;

    // Generate everything before the first write, so a generation failure leaves nothing.
    create_dir(&paths.dir)?;
    write_new(&paths.ca_key, Zeroizing::new(ca_key.serialize_pem()).as_bytes(), 0o600)?;
    write_new(&paths.ca_cert, ca_cert.pem().as_bytes(), 0o644)?;
    write_new(&paths.server_key, Zeroizing::new(server_key.serialize_pem()).as_bytes(), 0o600)?;
    write_new(&paths.server_cert, server_cert.pem().as_bytes(), 0o644)?;
    sync_dir(&paths.dir)?;
    Ok(paths)
}

/// Issues a new server certificate and key under `<dir>/pki` for `hosts` (default: the
/// names of the current one), signed by the same CA, so agents keep trusting it. Both are
/// written whole beside the old ones and renamed over them, the key first; a crash in
/// between leaves a pair that `serve` refuses to load, and running this again mends it.
pub fn renew_server_cert(dir: &Path, hosts: &[String]) -> Result<PkiPaths, PkiError> {
    let paths = PkiPaths::new(dir);
    let hosts = if hosts.is_empty() { server_hosts(dir)? } else { hosts.to_vec() };
    if hosts.is_empty() {
        return Err(PkiError::NoHosts);
    }
    let ca = Ca::load(dir)?;
    let (key, cert) = ca.server_pair(&hosts)?;
    let staged = |p: &Path| {
        let mut name = p.as_os_str().to_owned();
        name.push(".new");
        PathBuf::from(name)
    };
    for (path, bytes, mode) in [
        (&paths.server_key, Zeroizing::new(key.serialize_pem()).as_bytes().to_vec(), 0o600),
        (&paths.server_cert, cert.pem().into_bytes(), 0o644),
    ] {
        let _ = fs::remove_file(staged(path));
        write_new(&staged(path), &bytes, mode)?;
    }
    for path in [&paths.server_key, &paths.server_cert] {
        fs::rename(staged(path), path).map_err(|e| PkiError::Io(path.clone(), e))?;
        sync_dir(&paths.dir)?;
    }
    Ok(paths)
}

/// Makes the state directory `to` of another replica from the initialised `from`: the
/// same CA certificate, a server certificate of its own for `hosts` (its machine's names),
/// signed by `from`'s CA, and with `with_ca_key` the CA key too (only for replicas that
/// enrol or renew workers; the others answer those requests `503`, which agents retry
/// elsewhere). `to` must not hold a PKI yet.
pub fn init_replica(from: &Path, to: &Path, hosts: &[String], with_ca_key: bool) -> Result<PkiPaths, PkiError> {
    let source = PkiPaths::new(from);
    let paths = PkiPaths::new(to);
    if hosts.is_empty() {
        return Err(PkiError::NoHosts);
    }
    for path in [&paths.ca_cert, &paths.ca_key, &paths.server_cert, &paths.server_key] {
        if fs::symlink_metadata(path).is_ok() {
            return Err(PkiError::Exists(path.clone()));
        }
    }
    let ca = Ca::load(from)?;
    let (key, cert) = ca.server_pair(hosts)?;
    create_dir(&paths.dir)?;
    if with_ca_key {
        let ca_key = read_secret(&source.ca_key)?;
        write_new(&paths.ca_key, ca_key.as_bytes(), 0o600)?;
    }
    write_new(&paths.ca_cert, ca.cert_pem.as_bytes(), 0o644)?;
    write_new(&paths.server_key, Zeroizing::new(key.serialize_pem()).as_bytes(), 0o600)?;
    write_new(&paths.server_cert, cert.pem().as_bytes(), 0o644)?;
    sync_dir(&paths.dir)?;
    Ok(paths)
}

/// Issues `worker`'s client certificate, signed by the CA under `<dir>/pki`.
///
/// `out` is always a directory (created, mode 0700, when missing); it receives
/// `<workerId>.crt`, `<workerId>.key` (0600) and `ca.crt`. A path that looks like a file
/// name is still used as a directory name. An existing certificate or key for the worker is
/// never overwritten, and an existing `ca.crt` must be this CA's (the agent's trust anchor
/// is never swapped silently).
pub fn enroll(dir: &Path, worker: &WorkerId, out: &Path, lifetime: Duration) -> Result<(Enrolled, Issued), PkiError> {
    let ca = Ca::load(dir)?;
    let ca_pem = &ca.cert_pem;
    let ca_present = room_for(&ca, worker, out)?;
    let (cert_path, key_path, ca_path) = out_paths(worker, out);

    let key = KeyPair::generate()?;
    let issued = ca.issue(worker, &key, lifetime)?;

    create_dir(out)?;
    write_new(&key_path, Zeroizing::new(key.serialize_pem()).as_bytes(), 0o600)?;
    write_new(&cert_path, issued.pem.as_bytes(), 0o644)?;
    if !ca_present {
        write_new(&ca_path, ca_pem.as_bytes(), 0o644)?;
    }
    sync_dir(out)?;
    Ok((Enrolled { cert: cert_path, key: key_path, ca: ca_path }, issued))
}

/// Refuses what [`enroll`] would refuse about `out` (a certificate or key of `worker`
/// already there, another CA's `ca.crt`) before anything else is done: `enroll
/// --replace` revokes and labels first, which a refusal after them would leave done.
pub fn check_out(dir: &Path, worker: &WorkerId, out: &Path) -> Result<(), PkiError> {
    room_for(&Ca::load(dir)?, worker, out)?;
    // A directory that cannot be made (a file in its place, a parent not writable) would
    // refuse as late: it is made now (as `enroll` makes it).
    create_dir(out)
}

/// `<worker>.crt`, `<worker>.key` and `ca.crt` in `out`.
fn out_paths(worker: &WorkerId, out: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (out.join(format!("{worker}.crt")), out.join(format!("{worker}.key")), out.join("ca.crt"))
}

/// Whether `out` may receive `worker`'s certificate and key: neither there yet, and a
/// `ca.crt` there only if it is `ca`'s (then true: it stays).
fn room_for(ca: &Ca, worker: &WorkerId, out: &Path) -> Result<bool, PkiError> {
    let (cert_path, key_path, ca_path) = out_paths(worker, out);
    for path in [cert_path, key_path] {
        if fs::symlink_metadata(&path).is_ok() {
            return Err(PkiError::Exists(path));
        }
    }
    match fs::read(&ca_path) {
        Ok(existing) if existing == ca.cert_pem.as_bytes() => Ok(true),
        Ok(_) => Err(PkiError::Exists(ca_path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(PkiError::Io(ca_path, e)),
    }
}

/// The worker CA, loaded to issue certificates: for `enroll`, and in `serve` for the
/// agents that enrol with a token or renew (a replica without `ca.key` cannot).
pub struct Ca {
    /// `ca.crt` as stored.
    pub cert_pem: String,
    key: KeyPair,
    common_name: String,
}

impl fmt::Debug for Ca {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ca").field("common_name", &self.common_name).finish_non_exhaustive()
    }
}

impl Ca {
    /// Loads `<dir>/pki/ca.crt` and `ca.key`, checking that they belong together.
    pub fn load(dir: &Path) -> Result<Self, PkiError> {
        let paths = PkiPaths::new(dir);
        let cert_pem = fs::read_to_string(&paths.ca_cert).map_err(|e| PkiError::Io(paths.ca_cert.clone(), e))?;
        let key_pem = read_secret(&paths.ca_key)?;
        let key = KeyPair::from_pem(&key_pem).map_err(|_| PkiError::BadCa("ca.key is not a PEM key".into()))?;
        let common_name = ca_common_name(&cert_pem, &key)?;
        Ok(Self { cert_pem, key, common_name })
    }

    /// A new server key and its certificate for `hosts` (an IP address becomes an IP
    /// SAN, anything else a DNS SAN).
    fn server_pair(&self, hosts: &[String]) -> Result<(KeyPair, rcgen::Certificate), PkiError> {
        let issuer = Issuer::new(ca_params(&self.common_name), &self.key);
        let key = KeyPair::generate()?;
        let mut server = leaf_params(&hosts[0], SERVER_VALIDITY);
        for host in hosts {
            server.subject_alt_names.push(host_san(host)?);
        }
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = server.signed_by(&key, &issuer)?;
        Ok((key, cert))
    }

    /// The CA certificate's SHA-256 fingerprint (of its DER), lowercase hex: what an
    /// agent pins when it enrols with a token.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert_pem).unwrap_or_default()
    }

    /// Issues `worker`'s client certificate for `key` (the worker URI as its only SAN,
    /// client-auth), valid for `lifetime`.
    pub fn issue(
        &self,
        worker: &WorkerId,
        key: &impl rcgen::PublicKeyData,
        lifetime: Duration,
    ) -> Result<Issued, PkiError> {
        let issuer = Issuer::new(ca_params(&self.common_name), &self.key);
        let mut params = leaf_params(worker.as_str(), lifetime);
        let uri = worker_uri(worker).try_into().map_err(|_| PkiError::Host(worker.to_string()))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let not_after_ms = params.not_after.unix_timestamp().saturating_mul(1000);
        let serial = params.serial_number.as_ref().map(|s| serial_hex(s.as_ref())).unwrap_or_default();
        let cert = params.signed_by(key, &issuer)?;
        Ok(Issued { pem: cert.pem(), serial, not_after_ms })
    }

    /// Issues `worker`'s certificate for the key of a PKCS#10 request (DER), after
    /// checking it: an ECDSA P-256 key, a valid signature by that key (the holder has
    /// it), and the worker id as the subject's common name.
    pub fn issue_for_request(&self, worker: &WorkerId, csr_der: &[u8], lifetime: Duration) -> Result<Issued, PkiError> {
        let key = RequestKey::check(worker, csr_der)?;
        self.issue(worker, &key, lifetime)
    }
}

/// The public key of a checked certificate signing request.
struct RequestKey(Vec<u8>);

/// id-ecPublicKey, prime256v1 and ecdsa-with-SHA256.
const EC_PUBLIC_KEY: &str = "1.2.840.10045.2.1";
const P256: &str = "1.2.840.10045.3.1.7";
const ECDSA_SHA256: &str = "1.2.840.10045.4.3.2";

impl RequestKey {
    fn check(worker: &WorkerId, der: &[u8]) -> Result<Self, PkiError> {
        use x509_parser::prelude::FromDer as _;
        let (rest, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(der)
            .map_err(|_| PkiError::Csr("not a PKCS#10 request"))?;
        if !rest.is_empty() {
            return Err(PkiError::Csr("trailing bytes after the request"));
        }
        let info = &csr.certification_request_info;
        let spki = &info.subject_pki;
        let curve = spki.algorithm.parameters.as_ref().and_then(|p| p.as_oid().ok()).map(|o| o.to_id_string());
        if spki.algorithm.algorithm.to_id_string() != EC_PUBLIC_KEY || curve.as_deref() != Some(P256) {
            return Err(PkiError::Csr("the key is not ECDSA P-256"));
        }
        if csr.signature_algorithm.algorithm.to_id_string() != ECDSA_SHA256 {
            return Err(PkiError::Csr("the signature is not ECDSA with SHA-256"));
        }
        let point = spki.subject_public_key.data.to_vec();
        let key = ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_ASN1, &point);
        key.verify(info.raw, &csr.signature_value.data).map_err(|_| PkiError::Csr("the signature does not verify"))?;
        let cn = info.subject.iter_common_name().next().and_then(|cn| cn.as_str().ok());
        if cn != Some(worker.as_str()) {
            return Err(PkiError::Csr("the subject's common name is not the worker id"));
        }
        Ok(Self(point))
    }
}

impl rcgen::PublicKeyData for RequestKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// The fingerprint of the worker CA under `dir` ([`fingerprint`]).
pub fn ca_fingerprint(dir: &Path) -> Result<String, PkiError> {
    let paths = PkiPaths::new(dir);
    let pem = fs::read_to_string(&paths.ca_cert).map_err(|e| PkiError::Io(paths.ca_cert.clone(), e))?;
    fingerprint(&pem).ok_or_else(|| PkiError::BadCa("ca.crt is not PEM".into()))
}

/// The DNS names and IP addresses of the server certificate under `dir`, in order.
pub fn server_hosts(dir: &Path) -> Result<Vec<String>, PkiError> {
    let paths = PkiPaths::new(dir);
    let pem = fs::read(&paths.server_cert).map_err(|e| PkiError::Io(paths.server_cert.clone(), e))?;
    let bad = || PkiError::BadCa("server.crt is not a certificate".into());
    let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).map_err(|_| bad())?;
    let cert = pem.parse_x509().map_err(|_| bad())?;
    let san = cert.subject_alternative_name().map_err(|_| bad())?;
    Ok(san
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(d) => Some((*d).to_owned()),
            x509_parser::extensions::GeneralName::IPAddress(ip) => match ip.len() {
                4 => Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*ip).ok()?).to_string()),
                16 => Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*ip).ok()?).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect())
}

/// The SHA-256 of the first certificate in `pem` (its DER), lowercase hex.
pub fn fingerprint(pem: &str) -> Option<String> {
    use sha2::Digest as _;
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
    Some(hex(&sha2::Sha256::digest(&pem.contents)))
}

/// Reads a key file into a zeroizing buffer.
pub fn read_secret(path: &Path) -> Result<Zeroizing<String>, PkiError> {
    let bytes = Zeroizing::new(fs::read(path).map_err(|e| PkiError::Io(path.to_owned(), e))?);
    let text =
        std::str::from_utf8(&bytes).map_err(|_| PkiError::BadCa(format!("{} is not PEM text", path.display())))?;
    Ok(Zeroizing::new(text.to_owned()))
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, CA_VALIDITY);
    params.serial_number = Some(serial());
    params
}

fn leaf_params(common_name: &str, lifetime: Duration) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, lifetime);
    params.serial_number = Some(serial());
    params
}

fn host_san(host: &str) -> Result<SanType, PkiError> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let label_ok = |(i, label): (usize, &str)| {
        (i == 0 && label == "*")
            || (!label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
    };
    let valid = !host.is_empty() && host.len() <= 253 && host.split('.').enumerate().all(label_ok);
    if !valid {
        return Err(PkiError::Host(host.to_owned()));
    }
    Ok(SanType::DnsName(host.try_into().map_err(|_| PkiError::Host(host.to_owned()))?))
}

/// The stored CA's common name, from which the issuer is rebuilt (its subject and key
/// usages), checked against the key, so a swapped `ca.key` cannot sign certificates that
/// chain to nothing.
fn ca_common_name(ca_pem: &str, ca_key: &KeyPair) -> Result<String, PkiError> {
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(ca_pem.as_bytes()).map_err(|_| PkiError::BadCa("ca.crt is not PEM".into()))?;
    let cert = pem.parse_x509().map_err(|_| PkiError::BadCa("ca.crt is not a certificate".into()))?;
    let is_ca = matches!(cert.basic_constraints(), Ok(Some(bc)) if bc.value.ca);
    if !is_ca {
        return Err(PkiError::BadCa("ca.crt is not a CA certificate".into()));
    }
    if cert.public_key().raw != rcgen::PublicKeyData::subject_public_key_info(ca_key).as_slice() {
        return Err(PkiError::BadCa("ca.key does not belong to ca.crt".into()));
    }
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| PkiError::BadCa("ca.crt has no common name".into()))?;
    Ok(cn.to_owned())
}

fn set_validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = ASN1Time::now().to_datetime();
    params.not_before = now - BACKDATE.min(lifetime / 8);
    params.not_after = now + lifetime;
}

fn random<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    getrandom::getrandom(&mut bytes).expect("the OS CSPRNG is available");
    bytes
}

/// A positive 16-byte serial, unique with overwhelming probability (RFC 5280 §4.1.2.2).
fn serial() -> SerialNumber {
    let mut bytes = random::<16>();
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    SerialNumber::from_slice(&bytes)
}

/// A certificate serial number as the authority records it: lowercase hex of its DER
/// content bytes with leading zero bytes dropped (a positive serial may carry one).
pub fn serial_hex(raw: &[u8]) -> String {
    let start = raw.iter().position(|&b| b != 0).unwrap_or(raw.len());
    hex(&raw[start..])
}

fn create_dir(path: &Path) -> Result<(), PkiError> {
    DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(|e| PkiError::Io(path.to_owned(), e))
}

/// Creates `path` with `mode` from the first byte (never a chmod afterwards) and syncs it.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PkiError> {
    let io_err = |e: io::Error| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            PkiError::Exists(path.to_owned())
        } else {
            PkiError::Io(path.to_owned(), e)
        }
    };
    let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(io_err)?;
    file.write_all(bytes).map_err(io_err)?;
    file.sync_all().map_err(io_err)
}

/// Makes the new directory entries durable.
fn sync_dir(path: &Path) -> Result<(), PkiError> {
    fs::File::open(path).and_then(|d| d.sync_all()).map_err(|e| PkiError::Io(path.to_owned(), e))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;
    use x509_parser::extensions::GeneralName;
    use x509_parser::prelude::X509Certificate;

    /// A scratch directory, removed on drop.
    pub(crate) struct TempDir(PathBuf);

    impl TempDir {
        pub(crate) fn new(name: &str) -> Self {
            let path = std::env::temp_dir().join(format!("ql-{name}-{}", hex(&random::<8>())));
            fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    fn with_cert<T>(path: &Path, f: impl FnOnce(&X509Certificate<'_>) -> T) -> T {
        let pem = fs::read(path).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
        let cert = pem.parse_x509().unwrap();
        f(&cert)
    }

    fn sans(cert: &X509Certificate<'_>) -> Vec<String> {
        let san = cert.subject_alternative_name().unwrap().unwrap();
        san.value
            .general_names
            .iter()
            .map(|n| match n {
                GeneralName::DNSName(d) => format!("dns:{d}"),
                GeneralName::URI(u) => format!("uri:{u}"),
                GeneralName::IPAddress(ip) => format!("ip:{ip:?}"),
                other => format!("other:{other}"),
            })
            .collect()
    }

    fn worker(id: &str) -> WorkerId {
        WorkerId::parse(id).unwrap()
    }

    #[test]
    fn init_writes_a_ca_and_a_server_certificate_with_private_keys() {
        let dir = TempDir::new("pki-init");
        let paths = init_pki(dir.path(), &["127.0.0.1".into(), "control.example".into(), "::1".into()]).unwrap();
        assert_eq!(paths, PkiPaths::new(dir.path()));
        assert_eq!(mode(&paths.ca_key), 0o600);
        assert_eq!(mode(&paths.server_key), 0o600);
        assert_eq!(mode(&paths.ca_cert), 0o644);
        assert_eq!(mode(&paths.dir), 0o700);
        with_cert(&paths.ca_cert, |ca| {
            let bc = ca.basic_constraints().unwrap().unwrap().value;
            assert!(bc.ca);
            assert_eq!(bc.path_len_constraint, Some(0));
            let ku = ca.key_usage().unwrap().unwrap().value;
            assert!(ku.key_cert_sign());
            assert!(!ku.digital_signature());
        });
        with_cert(&paths.server_cert, |server| {
            assert_eq!(
                sans(server),
                vec![
                    "ip:[127, 0, 0, 1]".to_owned(),
                    "dns:control.example".into(),
                    format!("ip:{:?}", [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])
                ]
            );
            let eku = server.extended_key_usage().unwrap().unwrap().value;
            assert!(eku.server_auth && !eku.client_auth);
            assert!(!server.basic_constraints().unwrap().unwrap().value.ca);
        });
    }

    #[test]
    fn the_server_certificate_is_issued_again_under_the_same_ca() {
        let dir = TempDir::new("pki-renew-server");
        let paths = init_pki(dir.path(), &["127.0.0.1".into(), "control.example".into()]).unwrap();
        let (ca, old) = (fs::read(&paths.ca_cert).unwrap(), fs::read(&paths.server_cert).unwrap());
        renew_server_cert(dir.path(), &[]).unwrap();
        assert_eq!(fs::read(&paths.ca_cert).unwrap(), ca, "the CA the agents trust stays");
        assert_ne!(fs::read(&paths.server_cert).unwrap(), old);
        assert_eq!(server_hosts(dir.path()).unwrap(), ["127.0.0.1", "control.example"]);
        assert_eq!(mode(&paths.server_key), 0o600);
        crate::http::tls::server_config_from_dir(dir.path()).expect("the new pair loads");
        renew_server_cert(dir.path(), &["other.example".into()]).unwrap();
        assert_eq!(server_hosts(dir.path()).unwrap(), ["other.example"]);
    }

    #[test]
    fn init_never_overwrites_an_existing_pki() {
        let dir = TempDir::new("pki-again");
        let paths = init_pki(dir.path(), &["localhost".into()]).unwrap();
        let before = fs::read(&paths.ca_key).unwrap();
        assert!(matches!(init_pki(dir.path(), &["localhost".into()]), Err(PkiError::Exists(p)) if p == paths.ca_cert));
        assert_eq!(fs::read(&paths.ca_key).unwrap(), before);
    }

    #[test]
    fn init_refuses_no_hosts_and_bad_hosts() {
        let dir = TempDir::new("pki-hosts");
        assert!(matches!(init_pki(dir.path(), &[]), Err(PkiError::NoHosts)));
        for bad in ["", "a..b", "bad host", "x/y", "-", "a.-b", "a.*", "é.example"] {
            let refused = init_pki(dir.path(), &["localhost".into(), bad.into()]);
            assert!(matches!(&refused, Err(PkiError::Host(h)) if h == bad), "{bad:?}: {refused:?}");
        }
        assert!(!PkiPaths::new(dir.path()).ca_key.exists(), "a refused init writes nothing");
    }

    #[test]
    fn enroll_issues_one_worker_uri_with_client_auth() {
        let dir = TempDir::new("pki-enroll");
        let paths = init_pki(dir.path(), &["127.0.0.1".into()]).unwrap();
        let out = dir.path().join("out");
        let (enrolled, issued) = enroll(dir.path(), &worker("router-1"), &out, WORKER_VALIDITY).unwrap();
        assert_eq!(issued.pem.as_bytes(), fs::read(&enrolled.cert).unwrap());
        assert_eq!(enrolled.cert, out.join("router-1.crt"));
        assert_eq!(enrolled.key, out.join("router-1.key"));
        assert_eq!(mode(&enrolled.key), 0o600);
        assert_eq!(fs::read(&enrolled.ca).unwrap(), fs::read(&paths.ca_cert).unwrap());
        let ca_subject = with_cert(&paths.ca_cert, |ca| ca.subject().to_string());
        with_cert(&enrolled.cert, |cert| {
            assert_eq!(sans(cert), vec!["uri:urn:qinglong:worker:router-1".to_owned()]);
            let eku = cert.extended_key_usage().unwrap().unwrap().value;
            assert!(eku.client_auth && !eku.server_auth);
            assert_eq!(cert.issuer().to_string(), ca_subject);
            assert!(!cert.basic_constraints().unwrap().unwrap().value.ca);
        });
        let (_, pem) = x509_parser::pem::parse_x509_pem(&fs::read(&enrolled.cert).unwrap()).unwrap();
        let der = pem.contents;
        assert_eq!(crate::http::tls::principal(&[der.into()]), Ok(worker("router-1")));

        // A second worker shares the directory and its ca.crt.
        enroll(dir.path(), &worker("router-2"), &out, WORKER_VALIDITY).unwrap();
    }

    #[test]
    fn enroll_never_overwrites_a_key_or_swaps_the_trust_anchor() {
        let dir = TempDir::new("pki-enroll-again");
        init_pki(dir.path(), &["localhost".into()]).unwrap();
        let out = dir.path().join("out");
        let (first, _) = enroll(dir.path(), &worker("router-1"), &out, WORKER_VALIDITY).unwrap();
        let key = fs::read(&first.key).unwrap();
        assert!(matches!(enroll(dir.path(), &worker("router-1"), &out, WORKER_VALIDITY), Err(PkiError::Exists(_))));
        assert_eq!(fs::read(&first.key).unwrap(), key);

        let foreign = TempDir::new("pki-foreign");
        init_pki(foreign.path(), &["localhost".into()]).unwrap();
        assert!(
            matches!(enroll(foreign.path(), &worker("router-3"), &out, WORKER_VALIDITY), Err(PkiError::Exists(p)) if p == first.ca)
        );
        assert!(!out.join("router-3.key").exists());
    }

    #[test]
    fn enroll_refuses_a_ca_key_that_does_not_match() {
        let dir = TempDir::new("pki-mismatch");
        let paths = init_pki(dir.path(), &["localhost".into()]).unwrap();
        let other = TempDir::new("pki-mismatch-other");
        let other_paths = init_pki(other.path(), &["localhost".into()]).unwrap();
        fs::remove_file(&paths.ca_key).unwrap();
        fs::copy(&other_paths.ca_key, &paths.ca_key).unwrap();
        let refused = enroll(dir.path(), &worker("router-1"), &dir.path().join("out"), WORKER_VALIDITY);
        assert!(matches!(refused, Err(PkiError::BadCa(_))), "{refused:?}");
    }
}
