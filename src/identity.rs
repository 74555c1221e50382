//! The agent's own certificate: a key made on this device (ECDSA P-256, by ring, which the
//! TLS stack already links), the PKCS#10 request sent for it, the validity of the
//! certificate that comes back, and installing key and certificate in place.
//!
//! The request is a handful of DER elements, written here rather than with a certificate
//! crate: the agent needs only this one shape, and a general X.509 library would cost
//! more flash than the rest of the identity code together.
//!
//! Installing is crash-safe: the new key and certificate are written whole as
//! `<key>.new` and `<cert>.new` (fsynced), then the key is renamed over the old one, then
//! the certificate. A crash between the two renames leaves `<cert>.new` alone, which
//! [`recover`] finishes at the next start; a crash before them leaves both `.new` files,
//! which it removes (the old pair is intact and still valid).

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use ql_wire::ids::WorkerId;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair as _, ECDSA_P256_SHA256_ASN1_SIGNING};
use zeroize::Zeroizing;

/// A key just made, with the request for its certificate.
pub(crate) struct NewKey {
    /// The private key, PKCS#8 PEM.
    pub(crate) pem: Zeroizing<String>,
    /// The certificate signing request, DER.
    pub(crate) csr: Vec<u8>,
    /// The public key (the uncompressed point).
    pub(crate) public: Vec<u8>,
}

/// `SEQUENCE`, `SET`, `INTEGER`, `BIT STRING`, `UTF8String`, `[0]` constructed.
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const INTEGER: u8 = 0x02;
const BIT_STRING: u8 = 0x03;
const UTF8_STRING: u8 = 0x0c;
const CONTEXT_0: u8 = 0xa0;
/// The encoded OIDs: commonName, id-ecPublicKey, prime256v1, ecdsa-with-SHA256.
const OID_COMMON_NAME: &[u8] = &[0x06, 0x03, 0x55, 0x04, 0x03];
const OID_EC_PUBLIC_KEY: &[u8] = &[0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
const OID_P256: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
const OID_ECDSA_SHA256: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02];

/// One DER element.
fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len.to_be_bytes().into_iter().skip_while(|&b| b == 0).collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

fn bit_string(bytes: &[u8]) -> Vec<u8> {
    der(BIT_STRING, &[&[0u8][..], bytes].concat())
}

/// Makes a P-256 key and the request for `worker`'s certificate: subject `CN=<worker>`,
/// no attributes, signed by the key.
pub(crate) fn new_key(worker: &WorkerId) -> Result<NewKey, String> {
    let rng = SystemRandom::new();
    let alg = &ECDSA_P256_SHA256_ASN1_SIGNING;
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).map_err(|_| "cannot make a key".to_owned())?;
    let pkcs8 = Zeroizing::new(pkcs8.as_ref().to_vec());
    let key = EcdsaKeyPair::from_pkcs8(alg, &pkcs8, &rng).map_err(|_| "cannot use the new key".to_owned())?;

    let name = der(SET, &der(SEQUENCE, &[OID_COMMON_NAME, &der(UTF8_STRING, worker.as_str().as_bytes())].concat()));
    let algorithm = der(SEQUENCE, &[OID_EC_PUBLIC_KEY, OID_P256].concat());
    let spki = der(SEQUENCE, &[algorithm, bit_string(key.public_key().as_ref())].concat());
    let info = der(SEQUENCE, &[der(INTEGER, &[0]), der(SEQUENCE, &name), spki, der(CONTEXT_0, &[])].concat());
    let signature = key.sign(&rng, &info).map_err(|_| "cannot sign the request".to_owned())?;
    let csr = der(SEQUENCE, &[info, der(SEQUENCE, OID_ECDSA_SHA256), bit_string(signature.as_ref())].concat());
    Ok(NewKey { pem: Zeroizing::new(pem("PRIVATE KEY", &pkcs8)), csr, public: key.public_key().as_ref().to_vec() })
}

/// `der` as PEM text with `label`.
fn pem(label: &str, der: &[u8]) -> String {
    let text = Zeroizing::new(ql_wire::base64::encode(der, ql_wire::base64::STANDARD));
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in text.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    // Standard PEM pads to a multiple of four.
    if !text.len().is_multiple_of(4) {
        out.pop();
        out.push_str(&"=".repeat(4 - text.len() % 4));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// One DER element at the start of `input`: its tag, its content and what follows.
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        (rest[..n].iter().fold(0usize, |acc, &b| acc << 8 | usize::from(b)), &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// An X.509 time (`UTCTime` or `GeneralizedTime`, UTC) in milliseconds since the epoch.
fn time(tag: u8, text: &[u8]) -> Option<i64> {
    if !text.iter().all(|b| b.is_ascii_digit() || *b == b'Z') {
        return None;
    }
    let text = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    let full = match (tag, text.len()) {
        (0x17, 12) => format!("{}{text}", if text[..2].parse::<u32>().ok()? < 50 { "20" } else { "19" }),
        (0x18, 14) => text.to_owned(),
        _ => return None,
    };
    let rfc3339 =
        format!("{}-{}-{}T{}:{}:{}Z", &full[..4], &full[4..6], &full[6..8], &full[8..10], &full[10..12], &full[12..14]);
    ql_wire::time::Timestamp::parse(&rfc3339).ok().map(|t| t.millis())
}

/// The validity (not before, not after, in milliseconds) of a DER certificate.
pub(crate) fn validity(cert: &[u8]) -> Option<(i64, i64)> {
    let (SEQUENCE, certificate, _) = element(cert)? else { return None };
    let (SEQUENCE, tbs, _) = element(certificate)? else { return None };
    let mut rest = tbs;
    let (tag, _, after) = element(rest)?;
    if tag == CONTEXT_0 {
        rest = after; // the version
    }
    for _ in 0..3 {
        rest = element(rest)?.2; // serial, signature algorithm, issuer
    }
    let (SEQUENCE, times, _) = element(rest)? else { return None };
    let (tag, not_before, rest) = element(times)?;
    let not_before = time(tag, not_before)?;
    let (tag, not_after, _) = element(rest)?;
    Some((not_before, time(tag, not_after)?))
}

/// When a certificate valid over `(not_before, not_after)` is due for renewal: two
/// thirds of the way through.
pub(crate) fn renew_at((not_before, not_after): (i64, i64)) -> i64 {
    not_before + (not_after - not_before) / 3 * 2
}

/// Whether the certificate in `pem` is for the key whose public point is `public` (it
/// carries the point in its subject public key): checked before anything is installed,
/// so a wrong answer can never leave the agent with a key and a certificate that do not
/// belong together.
pub(crate) fn certifies(pem: &[u8], public: &[u8]) -> Result<(), String> {
    let der = first_certificate(pem).ok_or("the answer holds no certificate")?;
    if public.is_empty() || !der.windows(public.len()).any(|w| w == public) {
        return Err("the certificate the server answered is not for this device's new key".into());
    }
    Ok(())
}

/// The first certificate of a PEM file, DER.
pub(crate) fn first_certificate(pem: &[u8]) -> Option<Vec<u8>> {
    ureq::tls::parse_pem(pem).find_map(|item| match item {
        Ok(ureq::tls::PemItem::Certificate(c)) => Some(c.der().to_vec()),
        _ => None,
    })
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(suffix);
    path.with_file_name(name)
}

/// Replaces `path` with `bytes` (mode `mode`): written whole beside it, then renamed.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    let staged = sibling(path, ".new");
    write_whole(&staged, bytes, mode)?;
    fs::rename(&staged, path).map_err(|e| format!("{}: {e}", path.display()))?;
    sync_parent(path)
}

/// Writes `bytes` to `path` whole, with `mode` from the first byte, and fsyncs it.
fn write_whole(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    let fail = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut file = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(path).map_err(fail)?;
    file.write_all(bytes).map_err(fail)?;
    file.sync_all().map_err(fail)
}

fn sync_parent(path: &Path) -> Result<(), String> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| format!("{}: {e}", dir.display()))
}

/// Replaces the key at `key` and the certificate at `cert` (see the module doc).
pub(crate) fn install(key: &Path, key_pem: &str, cert: &Path, cert_pem: &str) -> Result<(), String> {
    let (key_new, cert_new) = (sibling(key, ".new"), sibling(cert, ".new"));
    write_whole(&key_new, key_pem.as_bytes(), 0o600)?;
    write_whole(&cert_new, cert_pem.as_bytes(), 0o644)?;
    sync_parent(&key_new)?;
    fs::rename(&key_new, key).map_err(|e| format!("{}: {e}", key.display()))?;
    sync_parent(key)?;
    fs::rename(&cert_new, cert).map_err(|e| format!("{}: {e}", cert.display()))?;
    sync_parent(cert)
}

/// Finishes or undoes an [`install`] a crash interrupted. Returns what it did, if anything.
pub(crate) fn recover(key: &Path, cert: &Path) -> Result<Option<&'static str>, String> {
    let (key_new, cert_new) = (sibling(key, ".new"), sibling(cert, ".new"));
    match (key_new.exists(), cert_new.exists()) {
        (false, true) => {
            fs::rename(&cert_new, cert).map_err(|e| format!("{}: {e}", cert.display()))?;
            sync_parent(cert)?;
            Ok(Some("finished installing a renewed certificate"))
        }
        (true, _) => {
            let _ = fs::remove_file(&key_new);
            let _ = fs::remove_file(&cert_new);
            Ok(Some("dropped a renewal that was not installed; the previous certificate stays"))
        }
        (false, false) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_take_the_short_and_the_long_form() {
        assert_eq!(der(0x04, &[1, 2]), [0x04, 2, 1, 2]);
        let long = der(0x04, &[0; 200]);
        assert_eq!(&long[..3], &[0x04, 0x81, 200]);
        let longer = der(0x04, &[0; 300]);
        assert_eq!(&longer[..4], &[0x04, 0x82, 0x01, 0x2c]);
        assert_eq!(element(&longer), Some((0x04, &[0u8; 300][..], &[][..])));
        assert_eq!(element(&[0x04, 0x82, 0x01]), None, "a length past the input");
    }

    #[test]
    fn a_request_names_the_worker_and_carries_a_p256_key() {
        let worker = WorkerId::parse("router-1").unwrap();
        let made = new_key(&worker).unwrap();
        let (tag, request, rest) = element(&made.csr).unwrap();
        assert_eq!((tag, rest.len()), (SEQUENCE, 0));
        let (_, info, rest) = element(request).unwrap();
        let (_, algorithm, rest) = element(rest).unwrap();
        assert_eq!(algorithm, OID_ECDSA_SHA256);
        assert_eq!(element(rest).unwrap().0, BIT_STRING);
        let text = String::from_utf8_lossy(info);
        assert!(text.contains("router-1"));
        assert!(
            made.pem.starts_with("-----BEGIN PRIVATE KEY-----\n") && made.pem.ends_with("-----END PRIVATE KEY-----\n")
        );
        // The PEM decodes back to a key ring accepts.
        let body: String = made.pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = ql_wire::base64::decode(body.trim_end_matches('=').as_bytes(), ql_wire::base64::STANDARD).unwrap();
        assert!(EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &der, &SystemRandom::new()).is_ok());
    }

    #[test]
    fn a_certificate_for_another_key_is_never_installed() {
        let cert: &[u8] = include_bytes!("testdata/validity.crt");
        let other = new_key(&WorkerId::parse("w1").unwrap()).unwrap();
        assert!(certifies(cert, &other.public).is_err());
        assert!(certifies(b"not pem", &other.public).is_err());
        assert!(certifies(cert, &[]).is_err());
    }

    #[test]
    fn times_read_in_both_forms() {
        assert_eq!(time(0x17, b"700101000000Z"), Some(0));
        assert_eq!(
            time(0x17, b"491231235959Z"),
            ql_wire::time::Timestamp::parse("2049-12-31T23:59:59Z").ok().map(|t| t.millis())
        );
        assert_eq!(
            time(0x18, b"20700101000000Z"),
            ql_wire::time::Timestamp::parse("2070-01-01T00:00:00Z").ok().map(|t| t.millis())
        );
        assert_eq!(time(0x17, b"700101000000"), None);
        assert_eq!(time(0x17, "7001010000é0Z".as_bytes()), None, "no panic on text that is not ASCII digits");
        assert_eq!(renew_at((0, 90)), 60);
    }

    #[test]
    fn an_interrupted_install_is_finished_or_undone() {
        let dir = std::env::temp_dir().join(format!("ql-identity-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let (key, cert) = (dir.join("w.key"), dir.join("w.crt"));
        install(&key, "k1", &cert, "c1").unwrap();
        assert_eq!((fs::read_to_string(&key).unwrap(), fs::read_to_string(&cert).unwrap()), ("k1".into(), "c1".into()));
        // A crash between the renames: the key is new, the certificate waits.
        install(&key, "k2", &cert, "c2").unwrap();
        fs::write(sibling(&cert, ".new"), "c3").unwrap();
        fs::write(&key, "k3").unwrap();
        assert!(recover(&key, &cert).unwrap().is_some());
        assert_eq!(fs::read_to_string(&cert).unwrap(), "c3");
        // A crash before them: both new files go, the pair stays.
        fs::write(sibling(&key, ".new"), "k4").unwrap();
        fs::write(sibling(&cert, ".new"), "c4").unwrap();
        assert!(recover(&key, &cert).unwrap().is_some());
        assert_eq!((fs::read_to_string(&key).unwrap(), fs::read_to_string(&cert).unwrap()), ("k3".into(), "c3".into()));
        assert_eq!(recover(&key, &cert).unwrap(), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
