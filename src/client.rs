//! The agent's one connection to ql-control: ureq over rustls (ring), TLS 1.3 only, our
//! CA only, our client certificate presented.
//!
//! Requests go one at a time over one keep-alive connection, a request's head and its
//! body's first part in one write and one TLS record (an upload's head, which waits for
//! `100 Continue`, goes alone): `ql_client`, which also looks the server up on the calling
//! thread. Error statuses are read as the protocol's JSON error codes without dropping
//! the connection (`http_status_as_error(false)`), and every response body is read to its
//! end so the connection goes back to the pool. Uploads send `Expect: 100-continue` and an exact
//! `Content-Length`, so a refusal arrives before the body is sent and is never lost to a
//! broken pipe. ureq does not retry; the caller decides what to repeat.

use std::cell::Cell;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ql_wire::artifact::ArtifactReply;
use ql_wire::log::LogAppendReply;
use ql_wire::route::{Route, JSON_MEDIA_TYPE};
use ql_wire::time::Timestamp;
use ql_wire::{decode, encode_exact, Body, ErrorBody, ErrorCode};
use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};
use zeroize::Zeroizing;

/// How long each step of a call may take. Every one is configurable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// TCP connect and TLS handshake.
    pub(crate) connect: Duration,
    /// A whole ordinary call (sending, waiting, reading the answer).
    pub(crate) call: Duration,
    /// Extra allowance on top of a long-poll's own wait.
    pub(crate) poll_slack: Duration,
    /// A whole artifact upload.
    pub(crate) upload: Duration,
}

/// The PEM material the agent authenticates with. The key is wiped when dropped.
pub(crate) struct Credentials {
    /// Client certificate chain.
    pub(crate) cert_pem: Vec<u8>,
    /// Client private key.
    pub(crate) key_pem: Zeroizing<Vec<u8>>,
    /// The worker CA that signed the server certificate.
    pub(crate) ca_pem: Vec<u8>,
}

impl Credentials {
    /// Reads the three PEM files. Errors name the file, never its content.
    pub(crate) fn load(
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
    ) -> Result<Self, SetupError> {
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read(path).map_err(|e| SetupError(format!("cannot read the {what} {}: {e}", path.display())))
        };
        Ok(Self {
            cert_pem: read(cert, "certificate file")?,
            key_pem: Zeroizing::new(read(key, "key file")?),
            ca_pem: read(ca, "CA file")?,
        })
    }

    /// The worker ids named by `urn:qinglong:worker:<id>` URIs in the first certificate.
    ///
    /// The agent has no X.509 parser (it does not need one to connect), so this looks for
    /// the URI's bytes in the DER: a SAN URI is stored as plain IA5 text. It is only used
    /// to tell an operator early that `worker_id` and the certificate disagree; the server
    /// decides.
    pub(crate) fn certificate_workers(&self) -> Vec<String> {
        const PREFIX: &[u8] = b"urn:qinglong:worker:";
        let Some(Ok(ureq::tls::PemItem::Certificate(cert))) = ureq::tls::parse_pem(&self.cert_pem).next() else {
            return Vec::new();
        };
        let der = cert.der();
        let mut found = Vec::new();
        let mut at = 0;
        while let Some(pos) = der[at..].windows(PREFIX.len()).position(|w| w == PREFIX) {
            let uri = at + pos;
            at = uri + PREFIX.len();
            // A GeneralName URI is `[6] IA5String`: tag 0x86, then a short length.
            let (Some(&0x86), Some(&len)) = (uri.checked_sub(2).map(|i| &der[i]), uri.checked_sub(1).map(|i| &der[i]))
            else {
                continue;
            };
            let end = uri + usize::from(len);
            if len < 0x80 && end <= der.len() && end >= at {
                found.push(String::from_utf8_lossy(&der[at..end]).into_owned());
            }
        }
        found
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials { key: <redacted>, .. }")
    }
}

/// Why a call did not produce the expected answer.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The server answered with a protocol error code.
    Refused {
        /// HTTP status.
        status: u16,
        /// The code.
        code: ErrorCode,
        /// `Retry-After`, when the server sent one.
        retry_after: Option<Duration>,
        /// The acknowledged length of the live log, with `log_offset_conflict`.
        acked: Option<u64>,
    },
    /// The call did not complete: connection, TLS or timeout. Safe to repeat.
    Transport(String),
    /// The server answered something the protocol does not allow.
    Protocol(String),
}

impl CallError {
    /// The protocol code, when the server refused.
    pub(crate) fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused { status, code, .. } => write!(f, "refused: {status} {code}"),
            Self::Transport(e) => write!(f, "transport: {e}"),
            Self::Protocol(e) => write!(f, "protocol: {e}"),
        }
    }
}

/// Could not build the client from the configured credentials.
#[derive(Debug)]
pub(crate) struct SetupError(pub(crate) String);

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The one HTTP client of the agent.
pub(crate) struct Client {
    agent: ureq::Agent,
    base: String,
    timeouts: Timeouts,
    /// The server's clock as the `Date` header of its last answer showed it: when the
    /// answer arrived, and the header's time (whole seconds, so never ahead of the server).
    server_date: Cell<Option<(Instant, Timestamp)>>,
}

/// A ring provider restricted to TLS 1.3 suites: ureq has no protocol-version setting,
/// and without TLS 1.2 suites no TLS 1.2 handshake can be agreed.
fn tls13_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.retain(|s| matches!(s, rustls::SupportedCipherSuite::Tls13(_)));
    Arc::new(provider)
}

impl Client {
    /// A client for `base` (`https://host:port`) presenting `creds`.
    pub(crate) fn new(base: &str, creds: &Credentials, timeouts: Timeouts) -> Result<Self, SetupError> {
        let ca = certificates(&creds.ca_pem, "CA file")?;
        let chain = certificates(&creds.cert_pem, "certificate file")?;
        let key = PrivateKey::from_pem(&creds.key_pem).map_err(|e| SetupError(format!("client key: {e}")))?;
        let tls = TlsConfig::builder()
            .provider(TlsProvider::Rustls)
            .unversioned_rustls_crypto_provider(tls13_provider())
            .root_certs(RootCerts::new_with_certs(&ca))
            .client_cert(Some(ClientCert::new_with_certs(&chain, key)))
            .build();
        Ok(Self::with_tls(base, tls, timeouts))
    }

    /// A client for the same server with the same timeouts, presenting `creds` (a
    /// renewed certificate): its first call opens a new connection.
    pub(crate) fn with_credentials(&self, creds: &Credentials) -> Result<Self, SetupError> {
        Self::new(&self.base, creds, self.timeouts)
    }

    /// A client with no certificate of its own, for enrolling: trusting `ca_pem`, or with
    /// `None` verifying nothing — only to read the CA, whose fingerprint the caller then
    /// compares before it sends anything that matters.
    pub(crate) fn anonymous(base: &str, ca_pem: Option<&[u8]>, timeouts: Timeouts) -> Result<Self, SetupError> {
        let builder =
            TlsConfig::builder().provider(TlsProvider::Rustls).unversioned_rustls_crypto_provider(tls13_provider());
        let tls = match ca_pem {
            Some(pem) => builder.root_certs(RootCerts::new_with_certs(&certificates(pem, "CA")?)).build(),
            None => builder.disable_verification(true).build(),
        };
        Ok(Self::with_tls(base, tls, timeouts))
    }

    fn with_tls(base: &str, tls: TlsConfig, timeouts: Timeouts) -> Self {
        let config = ureq::Agent::config_builder()
            .tls_config(tls)
            .https_only(true)
            .http_status_as_error(false)
            .max_redirects(0)
            .max_idle_connections(1)
            .max_idle_connections_per_host(1)
            // ureq's 128 KiB defaults are sized for servers, not routers: answers are at
            // most a 320 KiB claim read in pieces, headers are short, and uploads stream.
            .input_buffer_size(16 * 1024)
            .output_buffer_size(16 * 1024)
            .max_response_header_size(8 * 1024)
            .timeout_connect(Some(timeouts.connect))
            .user_agent(format!("ql-agent/{}", env!("CARGO_PKG_VERSION")))
            .build();
        let agent = ql_client::agent(config);
        Self { agent, base: base.trim_end_matches('/').to_owned(), timeouts, server_date: Cell::new(None) }
    }

    /// Sends a JSON body to an identity route and decodes the JSON answer.
    pub(crate) fn identity<Req: Body, Resp: Body>(
        &self,
        route: &ql_wire::enrol::IdentityRoute,
        body: Option<&Req>,
    ) -> Result<Resp, CallError> {
        let url = format!("{}{}", self.base, route.path());
        let limit = Some(self.timeouts.call);
        let response = match body {
            None => self.agent.get(url).config().timeout_global(limit).build().call(),
            Some(body) => {
                let json = Zeroizing::new(encode_exact(body));
                let request = self.agent.post(url).config().timeout_global(limit).build();
                request.header("Content-Type", JSON_MEDIA_TYPE).send(&json[..])
            }
        };
        self.note_date(&response);
        answer(response, Resp::CAP)
    }

    /// Sends a JSON body and decodes the JSON answer.
    pub(crate) fn call<Req: Body, Resp: Body>(&self, route: &Route, body: &Req) -> Result<Resp, CallError> {
        self.call_within(route, body, self.timeouts.call)
    }

    /// Like [`Client::call`] for a long-poll that may legitimately wait `wait`.
    pub(crate) fn poll<Req: Body, Resp: Body>(
        &self,
        route: &Route,
        body: &Req,
        wait: Duration,
    ) -> Result<Resp, CallError> {
        self.call_within(route, body, self.timeouts.call + wait + self.timeouts.poll_slack)
    }

    /// Like [`Client::call`] with a time limit of the caller's.
    pub(crate) fn call_within<Req: Body, Resp: Body>(
        &self,
        route: &Route,
        body: &Req,
        limit: Duration,
    ) -> Result<Resp, CallError> {
        // The body may hold a raw token: wipe the buffer once it is sent.
        let json = Zeroizing::new(encode_exact(body));
        let response = self
            .agent
            .post(format!("{}{}", self.base, route.path()))
            .config()
            .timeout_global(Some(limit))
            .build()
            .header("Content-Type", JSON_MEDIA_TYPE)
            .send(&json[..]);
        self.note_date(&response);
        if response.is_ok() {
            crate::fault::answered(route);
        }
        answer(response, Resp::CAP)
    }

    /// Uploads an artifact: the frame prefix, then `content_len` bytes from `content`.
    pub(crate) fn upload(
        &self,
        route: &Route,
        prefix: &[u8],
        content: &mut dyn Read,
        content_len: u64,
    ) -> Result<ArtifactReply, CallError> {
        self.send_frame(route, prefix, content, content_len, self.timeouts.upload)
    }

    /// Sends one live-log chunk (PROTOCOL §13) within `within`: the frame prefix, then
    /// `content_len` bytes from `content`.
    pub(crate) fn append(
        &self,
        route: &Route,
        prefix: &[u8],
        content: &mut dyn Read,
        content_len: u64,
        within: Duration,
    ) -> Result<LogAppendReply, CallError> {
        self.send_frame(route, prefix, content, content_len, within)
    }

    /// A framed body with an exact length and `Expect: 100-continue`, so a refusal of the
    /// header arrives before the content is sent.
    fn send_frame<Resp: Body>(
        &self,
        route: &Route,
        prefix: &[u8],
        content: &mut dyn Read,
        content_len: u64,
        within: Duration,
    ) -> Result<Resp, CallError> {
        let total = prefix.len() as u64 + content_len;
        let mut reader = std::io::Cursor::new(prefix).chain(content.take(content_len));
        let url = format!("{}{}", self.base, route.path());
        let request = match route.method() {
            "PUT" => self.agent.put(url),
            _ => self.agent.post(url),
        };
        let response = request
            .config()
            .timeout_global(Some(within))
            .build()
            .header("Content-Type", route.media_type())
            .header("Content-Length", total.to_string())
            .header("Expect", "100-continue")
            .send(ureq::SendBody::from_reader(&mut reader));
        self.note_date(&response);
        if response.is_ok() {
            crate::fault::answered(route);
        }
        answer(response, Resp::CAP)
    }
}

impl Client {
    fn note_date(&self, response: &Result<ureq::http::Response<ureq::Body>, ureq::Error>) {
        let date = response.as_ref().ok().and_then(|r| r.headers().get("date")?.to_str().ok().and_then(http_date));
        if let Some(date) = date {
            self.server_date.set(Some((Instant::now(), date)));
        }
    }

    /// The server's clock as the `Date` header of its last answer showed it, if any.
    pub(crate) fn server_date(&self) -> Option<(Instant, Timestamp)> {
        self.server_date.get()
    }
}

/// An HTTP date in its one current form (IMF-fixdate, RFC 9110 section 5.6.7),
/// `Sun, 06 Nov 1994 08:49:37 GMT`; `None` for anything else.
pub(crate) fn http_date(s: &str) -> Option<Timestamp> {
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    if s.len() != 29 || s.get(3..5)? != ", " || s.get(25..)? != " GMT" {
        return None;
    }
    let month = MONTHS.iter().position(|m| Some(*m) == s.get(8..11))? + 1;
    let (day, year, time) = (s.get(5..7)?, s.get(12..16)?, s.get(17..25)?);
    if s.get(7..8)? != " " || s.get(11..12)? != " " || s.get(16..17)? != " " {
        return None;
    }
    Timestamp::parse(&format!("{year}-{month:02}-{day}T{time}Z")).ok()
}

/// Every certificate in a PEM file; at least one.
fn certificates(pem: &[u8], what: &str) -> Result<Vec<Certificate<'static>>, SetupError> {
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(pem) {
        match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c),
            Ok(_) => {}
            Err(e) => return Err(SetupError(format!("{what}: {e}"))),
        }
    }
    if certs.is_empty() {
        return Err(SetupError(format!("{what} holds no certificate")));
    }
    Ok(certs)
}

fn retry_after(resp: &ureq::http::Response<ureq::Body>) -> Option<Duration> {
    let secs: u64 = resp.headers().get("retry-after")?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs.min(3600)))
}

fn answer<Resp: Body>(
    response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    cap: usize,
) -> Result<Resp, CallError> {
    let mut resp = response.map_err(|e| CallError::Transport(e.to_string()))?;
    let status = resp.status().as_u16();
    let after = retry_after(&resp);
    // Read to the end, bounded, so the connection stays reusable.
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(cap as u64)
        .read_to_vec()
        .map_err(|e| CallError::Transport(format!("reading the answer: {e}")))?;
    if (200..300).contains(&status) {
        return decode::<Resp>(&bytes).map_err(|e| CallError::Protocol(format!("answer to a {status}: {e}")));
    }
    match decode::<ErrorBody>(&bytes) {
        Ok(ErrorBody { error, acked }) => Err(CallError::Refused { status, code: error, retry_after: after, acked }),
        Err(_) if status >= 500 => {
            Err(CallError::Refused { status, code: ErrorCode::Unavailable, retry_after: after, acked: None })
        }
        Err(e) => Err(CallError::Protocol(format!("status {status} without an error code: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_imf_fixdate_is_read_and_nothing_else_is() {
        let at = |s: &str| http_date(s).map(Timestamp::millis);
        assert_eq!(at("Sun, 06 Nov 1994 08:49:37 GMT"), Some(784_111_777_000));
        assert_eq!(
            at("Mon, 30 Nov 2026 16:05:00 GMT"),
            Timestamp::parse("2026-11-30T16:05:00Z").ok().map(Timestamp::millis)
        );
        for bad in [
            "",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 31 Feb 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 25:49:37 GMT",
            "Sun, 6 Nov 1994 08:49:37 GMT ",
            "Sun, 06 Nov 1994T08:49:37 GMT",
        ] {
            assert_eq!(at(bad), None, "{bad:?}");
        }
    }
}
