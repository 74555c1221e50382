//! The artifact store in an S3-compatible bucket (AWS S3, MinIO, Garage, Ceph RGW, R2,
//! s3s): what replicas on machines that share no disk share.
//!
//! # Layout
//!
//! ```text
//! <prefix>/<project>/<run>/<attempt>/
//!     <artifact>.data.<random>               the content of one upload
//!     <artifact>.receipt.json                {artifactId, length, sha256, truncated, object}:
//!                                            the commit, put with `If-None-Match: *`
//!     <artifact>.chunk.<offset>.<sha256>     one live-log chunk (PROTOCOL §13)
//!                                            (until the completion records the artifact)
//! ```
//!
//! # Put-if-absent, immutable, nothing half-written visible
//!
//! The frame header declares the content's length before any content, so an upload is one
//! streaming `PutObject` with that `Content-Length` to a name of its own: memory stays at
//! a few frames whatever the size (the channel to the sending thread is bounded), and a
//! `PutObject` is all-or-nothing on every S3 service, so an upload cut off anywhere leaves
//! no object. The SHA-256 and the byte count are computed while streaming.
//! [`Upload::finish`] then puts the receipt with `If-None-Match: *`, the commit point: a
//! `412` means a receipt is there, and it is compared like the file store's (same length,
//! digest and truncation is `AlreadyStored`, anything else `Conflict`; either way this
//! upload's object is removed). Content without a receipt is never read.
//!
//! Not every service makes its existence check and its write one atomic step (s3s-fs
//! does not). The database is therefore the arbiter of an attempt's artifact: an upload's
//! receipt is claimed in the attempt's row, under the transaction that confirms its fence
//! (`core::finish::admit_artifact`), before it is published here, so a second upload with
//! other content is refused before it can race the first to the bucket.
//!
//! Requests are signed with SigV4 (`aws-sigv4`); small bodies (receipts, chunks) with
//! their SHA-256, which the service checks, the streamed content as `UNSIGNED-PAYLOAD`
//! (its digest is ours to check, and is: [`BlobStore::inspect`] compares the length the
//! service holds with the receipt, every read of a chunk its digest, and readers of a log
//! its SHA-256). No error names a credential.
//!
//! [`BlobStore::collect`] lists the prefix (ListObjectsV2) and removes upload content older
//! than its bound that the artifact's receipt, read again just before, does not name: what
//! an upload left when its receipt's write failed without an answer, or its server stopped
//! between the two. It also removes the old chunks of attempts the authority says have
//! recorded their log ([`super::Recorded`]).

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ProjectId, RunId};
use ql_wire::limits::ARTIFACT_CONTENT_MAX;

use super::{ArtifactKey, BlobError, BlobStore, Collected, PutOutcome, Recorded, Recording, Upload};

/// Frames buffered between an upload and the thread sending it.
const IN_FLIGHT_FRAMES: usize = 8;

/// Where the bucket is and how to reach it.
#[derive(Debug, Clone)]
pub struct S3Options {
    /// `http(s)://host[:port]`, no path.
    pub endpoint: String,
    /// The signing region.
    pub region: String,
    /// The bucket.
    pub bucket: String,
    /// Object names start with this (no leading or trailing `/`; may be empty).
    pub prefix: String,
    /// `https://endpoint/bucket/key` rather than `https://bucket.endpoint/key`.
    pub path_style: bool,
    /// The access key pair (Debug shows only the key id).
    pub credentials: aws_credential_types::Credentials,
    /// Every request but a streamed upload's body within this; a streamed body's next
    /// frame within this too.
    pub timeout: Duration,
    /// CA certificates trusted for an `https://` endpoint.
    pub roots: Vec<ureq::tls::Certificate<'static>>,
    /// Objects one listing asks for (`max-keys`; S3 answers at most 1,000).
    pub list_page: u32,
}

impl S3Options {
    /// `s3://bucket/prefix` as the store's URL.
    pub fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// Splits `s3://bucket/prefix` into a bucket and a prefix, refusing what would need
/// escaping in an object name (the rest of every name is validated ids).
pub fn parse_url(url: &str) -> Result<(String, String), String> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| format!("{url}: an S3 store is s3://bucket[/prefix]"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !bucket.starts_with(['-', '.'])
        && !bucket.ends_with(['-', '.']);
    if !bucket_ok {
        return Err(format!("{url}: {bucket:?} is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')"));
    }
    let prefix = prefix.trim_end_matches('/');
    let segment_ok = |s: &str| {
        !s.is_empty() && s != "." && s != ".." && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    if !prefix.is_empty() && !prefix.split('/').all(segment_ok) {
        return Err(format!("{url}: the prefix may hold only A-Z, a-z, 0-9, '-', '_', '.' between slashes"));
    }
    Ok((bucket.to_owned(), prefix.to_owned()))
}

/// Artifacts as objects in one bucket, under one prefix.
#[derive(Clone)]
pub struct S3BlobStore {
    inner: Arc<Inner>,
}

struct Inner {
    options: S3Options,
    /// Small requests, each within `options.timeout`.
    agent: ureq::Agent,
    /// Streamed uploads: their bodies take as long as the worker's upload does.
    streaming: ureq::Agent,
}

impl std::fmt::Debug for S3BlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3BlobStore").field("url", &self.inner.options.url()).finish_non_exhaustive()
    }
}

fn err(what: impl std::fmt::Display) -> BlobError {
    BlobError(what.to_string())
}

/// The service's `<Code>` in an error body, if it sent one.
fn error_code(body: &str) -> Option<&str> {
    let start = body.find("<Code>")? + "<Code>".len();
    let len = body[start..].find("</Code>")?;
    Some(&body[start..start + len])
}

fn random_suffix() -> Result<String, BlobError> {
    let mut bytes = [0u8; 8];
    getrandom::getrandom(&mut bytes).map_err(|e| err(format!("no randomness for an object name: {e}")))?;
    Ok(crate::keys::hex(&bytes))
}

/// The receipt as stored: the wire receipt and the object holding the content.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Stored {
    #[serde(flatten)]
    receipt: Receipt,
    object: String,
}

/// One page of a ListObjectsV2 answer (the fields read of it).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ListPage {
    #[serde(default)]
    contents: Vec<Listed>,
    #[serde(default)]
    is_truncated: bool,
    next_continuation_token: Option<String>,
}

/// One object of a [`ListPage`].
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Listed {
    key: String,
    last_modified: String,
    #[serde(default)]
    size: u64,
}

/// What a query value keeps unescaped: RFC 3986's unreserved characters, as SigV4 wants.
const QUERY_VALUE: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

/// What a request's signature covers of its body.
enum Payload<'a> {
    /// No body.
    Empty,
    /// A small body, signed with its SHA-256 (the service checks it).
    Bytes(&'a [u8]),
    /// A streamed body of this length, `UNSIGNED-PAYLOAD`.
    Streamed(u64),
}

/// A response: status, and the body when it was read.
struct Answer {
    status: u16,
    body: Vec<u8>,
    length: Option<u64>,
}

impl S3BlobStore {
    /// A store over `options`; nothing is sent until the first request.
    pub fn new(options: S3Options) -> Self {
        let https_only = options.endpoint.starts_with("https://");
        let agent = crate::client::agent(&options.roots, https_only, Some(options.timeout));
        let streaming = crate::client::streaming_agent(&options.roots, https_only, options.timeout);
        Self { inner: Arc::new(Inner { options, agent, streaming }) }
    }

    /// The store's `s3://` URL.
    pub fn url(&self) -> String {
        self.inner.options.url()
    }

    /// What `serve` says about where artifacts go.
    pub fn describe(&self) -> String {
        let o = &self.inner.options;
        let style = if o.path_style { "path-style" } else { "virtual-hosted" };
        format!("{} at {} ({style}, region {})", o.url(), o.endpoint, o.region)
    }

    fn dir(&self, key: &ArtifactKey) -> String {
        let prefix = &self.inner.options.prefix;
        let tail = format!("{}/{}/{}", key.project, key.run, key.attempt);
        if prefix.is_empty() {
            tail
        } else {
            format!("{prefix}/{tail}")
        }
    }

    fn receipt_name(&self, key: &ArtifactKey) -> String {
        format!("{}/{}.receipt.json", self.dir(key), key.artifact)
    }

    fn chunk_name(&self, key: &ArtifactKey, offset: u64, sha256: &Digest) -> String {
        format!("{}/{}", self.dir(key), super::chunk_file(&key.artifact, offset, sha256))
    }

    fn url_of(&self, name: &str) -> String {
        let o = &self.inner.options;
        if o.path_style {
            format!("{}/{}/{name}", o.endpoint, o.bucket)
        } else {
            let (scheme, host) = o.endpoint.split_once("://").unwrap_or(("https", &o.endpoint));
            format!("{scheme}://{}.{host}/{name}", o.bucket)
        }
    }

    /// One signed request, on a blocking thread (ureq is synchronous).
    async fn send(
        &self,
        method: &'static str,
        name: &str,
        headers: Vec<(&'static str, String)>,
        payload: Payload<'_>,
    ) -> Result<Answer, BlobError> {
        let request = self.signed(method, name, headers, &payload)?;
        let body = match payload {
            Payload::Bytes(bytes) => OwnedBody::Bytes(bytes.to_vec()),
            Payload::Empty | Payload::Streamed(_) => OwnedBody::Empty,
        };
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.call(request, body))
            .await
            .map_err(|e| err(format!("S3 request task: {e}")))?
    }

    fn signed(
        &self,
        method: &'static str,
        name: &str,
        headers: Vec<(&'static str, String)>,
        payload: &Payload<'_>,
    ) -> Result<http::Request<()>, BlobError> {
        use aws_sigv4::http_request::{
            sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
            UriPathNormalizationMode,
        };
        let o = &self.inner.options;
        let url = self.url_of(name);
        let mut builder = http::Request::builder().method(method).uri(&url);
        for (header, value) in &headers {
            builder = builder.header(*header, value);
        }
        if let Payload::Streamed(length) = payload {
            builder = builder.header("content-length", length.to_string());
        }
        let mut request = builder.body(()).map_err(|e| err(format!("S3 request for {name}: {e}")))?;
        let host = request.uri().authority().map(|a| a.to_string()).unwrap_or_default();
        request.headers_mut().insert("host", host.parse().map_err(|_| err("S3 endpoint host"))?);

        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        let identity = o.credentials.clone().into();
        let params = aws_sigv4::sign::v4::SigningParams::builder()
            .identity(&identity)
            .region(&o.region)
            .name("s3")
            .time(SystemTime::now())
            .settings(settings)
            .build()
            .map_err(|e| err(format!("S3 signing: {e}")))?
            .into();
        let signable_body = match payload {
            Payload::Empty => SignableBody::Bytes(&[]),
            Payload::Bytes(bytes) => SignableBody::Bytes(bytes),
            Payload::Streamed(_) => SignableBody::UnsignedPayload,
        };
        let pairs: Vec<(String, String)> = request
            .headers()
            .iter()
            .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
            .collect();
        let signable = SignableRequest::new(
            method,
            url.as_str(),
            pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            signable_body,
        )
        .map_err(|e| err(format!("S3 signing: {e}")))?;
        let (instructions, _) = sign(signable, &params).map_err(|e| err(format!("S3 signing: {e}")))?.into_parts();
        instructions.apply_to_request_http1x(&mut request);
        Ok(request)
    }

    fn call(&self, request: http::Request<()>, body: OwnedBody) -> Result<Answer, BlobError> {
        let what = format!("{} {}", request.method(), request.uri().path());
        let (parts, ()) = request.into_parts();
        let result = match body {
            OwnedBody::Empty => self.inner.agent.run(http::Request::from_parts(parts, ())),
            OwnedBody::Bytes(bytes) => self.inner.agent.run(http::Request::from_parts(parts, bytes)),
            OwnedBody::Stream(mut reader) => {
                let body = ureq::SendBody::from_reader(&mut reader);
                self.inner.streaming.run(http::Request::from_parts(parts, body))
            }
        };
        let mut response = result.map_err(|e| err(format!("S3 {what}: {e}")))?;
        let status = response.status().as_u16();
        let length =
            response.headers().get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        let mut body = Vec::new();
        // A GET's body is at most a window of a log or a chunk; an error body is small.
        let limit = ARTIFACT_CONTENT_MAX + 1;
        response
            .body_mut()
            .as_reader()
            .take(limit)
            .read_to_end(&mut body)
            .map_err(|e| err(format!("S3 {what}: reading the answer: {e}")))?;
        Ok(Answer { status, body, length })
    }

    fn refused(what: &str, answer: &Answer) -> BlobError {
        let body = String::from_utf8_lossy(&answer.body);
        match error_code(&body) {
            Some(code) => err(format!("S3 {what}: {} {code}", answer.status)),
            None => err(format!("S3 {what}: status {}", answer.status)),
        }
    }

    /// One page of the objects under the store's prefix (ListObjectsV2), from `token`.
    async fn list(&self, token: Option<&str>) -> Result<ListPage, BlobError> {
        self.list_under("", token).await
    }

    /// One page of the objects under `under` (empty, or ending in `/`) within the store's
    /// prefix, from `token`.
    async fn list_under(&self, under: &str, token: Option<&str>) -> Result<ListPage, BlobError> {
        let prefix = &self.inner.options.prefix;
        let prefix = if prefix.is_empty() { under.to_owned() } else { format!("{prefix}/{under}") };
        let encode = |v: &str| percent_encoding::utf8_percent_encode(v, QUERY_VALUE).to_string();
        let page = self.inner.options.list_page;
        let mut query = format!("?list-type=2&max-keys={page}&prefix={}", encode(&prefix));
        if let Some(token) = token {
            query.push_str(&format!("&continuation-token={}", encode(token)));
        }
        let answer = self.send("GET", &query, vec![], Payload::Empty).await?;
        if answer.status != 200 {
            return Err(Self::refused("listing objects", &answer));
        }
        let body = std::str::from_utf8(&answer.body).map_err(|_| err("S3 listing: not UTF-8"))?;
        quick_xml::de::from_str(body).map_err(|e| err(format!("S3 listing: {e}")))
    }

    /// The artifact an object this store made belongs to, and what the object is:
    /// `<prefix>/<project>/<run>/<attempt>/<artifact>.data.<random>` (an upload's content)
    /// or `<artifact>.chunk.<offset>.<sha256>` (a live-log chunk) in the same place.
    fn named(&self, name: &str) -> Option<(ArtifactKey, Object)> {
        let prefix = &self.inner.options.prefix;
        let rest = if prefix.is_empty() { name } else { name.strip_prefix(prefix.as_str())?.strip_prefix('/')? };
        let mut parts = rest.split('/');
        let (project, run, attempt, file) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let (artifact, object) = if let Some((artifact, random)) = file.split_once(".data.") {
            // Exactly what `random_suffix` makes: nothing else in a shared bucket looks like it.
            let ours = random.len() == 16 && random.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            (ours.then_some(artifact)?, Object::Content)
        } else {
            (super::chunk_artifact(file)?, Object::Chunk)
        };
        Some((ArtifactKey::parse(project, run, attempt, artifact)?, object))
    }

    async fn delete_quietly(&self, name: &str) {
        // Best effort: an object no receipt names is garbage, never read.
        let _ = self.send("DELETE", name, vec![], Payload::Empty).await;
    }

    async fn stored(&self, key: &ArtifactKey) -> Result<Option<Stored>, BlobError> {
        let name = self.receipt_name(key);
        let answer = self.send("GET", &name, vec![], Payload::Empty).await?;
        match answer.status {
            200 => {}
            404 => return Ok(None),
            _ => return Err(Self::refused("reading a receipt", &answer)),
        }
        let stored: Stored =
            serde_json::from_slice(&answer.body).map_err(|e| err(format!("unreadable receipt {name}: {e}")))?;
        if stored.receipt.artifact_id != key.artifact || !stored.object.starts_with(&self.dir(key)) {
            return Err(err(format!("receipt {name} names another artifact")));
        }
        Ok(Some(stored))
    }
}

/// A request body a blocking thread can own.
enum OwnedBody {
    Empty,
    Bytes(Vec<u8>),
    Stream(ChannelReader),
}

enum Frame {
    Data(Vec<u8>),
    End,
}

/// The sending thread's side of an upload: frames until [`Frame::End`]; a channel closed
/// before it is an abandoned upload, which must fail the request, not end it short.
struct ChannelReader {
    rx: mpsc::Receiver<Frame>,
    frame: Vec<u8>,
    at: usize,
    ended: bool,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.frame.len() {
            if self.ended {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Frame::Data(bytes)) => (self.frame, self.at) = (bytes, 0),
                Some(Frame::End) => self.ended = true,
                None => return Err(std::io::Error::other("upload abandoned")),
            }
        }
        let n = out.len().min(self.frame.len() - self.at);
        out[..n].copy_from_slice(&self.frame[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// An upload in progress: a streaming `PutObject`, a running hash and a byte count.
pub struct S3Upload {
    store: S3BlobStore,
    key: ArtifactKey,
    object: String,
    declared: u64,
    truncated: bool,
    tx: Option<mpsc::Sender<Frame>>,
    sending: Option<tokio::task::JoinHandle<Result<Answer, BlobError>>>,
    hasher: Sha256,
    written: u64,
    failed: bool,
}

impl std::fmt::Debug for S3Upload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Upload").field("object", &self.object).field("written", &self.written).finish()
    }
}

impl Drop for S3Upload {
    fn drop(&mut self) {
        // Unfinished: closing the channel fails the request. Should the service already
        // hold every byte (the upload was refused after its content arrived), the object
        // it made is removed once the request ends; it is unreferenced either way.
        drop(self.tx.take());
        if let (Some(sending), Ok(runtime)) = (self.sending.take(), tokio::runtime::Handle::try_current()) {
            let (store, object) = (self.store.clone(), self.object.clone());
            runtime.spawn(async move {
                if matches!(sending.await, Ok(Ok(Answer { status: 200, .. }))) {
                    store.delete_quietly(&object).await;
                }
            });
        }
    }
}

impl S3Upload {
    fn computed(&self) -> Receipt {
        let sha256 = Digest::from_raw(&self.hasher.clone().finalize().into());
        Receipt { artifact_id: self.key.artifact.clone(), length: self.written, sha256, truncated: self.truncated }
    }
}

impl Upload for S3Upload {
    async fn write(&mut self, bytes: &[u8]) -> Result<(), BlobError> {
        super::admit_write(&mut self.failed, self.written, self.declared, bytes.len())?;
        let Some(tx) = self.tx.as_ref() else {
            return Err(err("upload already finished"));
        };
        let timeout = self.store.inner.options.timeout;
        match tokio::time::timeout(timeout, tx.send(Frame::Data(bytes.to_vec()))).await {
            Ok(Ok(())) => {}
            // The sending thread ended, so the request did: its answer says why.
            Ok(Err(_)) => {
                self.failed = true;
                let why = match self.sending.take() {
                    Some(sending) => match sending.await {
                        Ok(Ok(answer)) => S3BlobStore::refused("storing content", &answer),
                        Ok(Err(e)) => e,
                        Err(e) => err(format!("upload task: {e}")),
                    },
                    None => err("upload already failed"),
                };
                return Err(why);
            }
            Err(_) => {
                self.failed = true;
                return Err(err(format!("the bucket took no more of the upload for {timeout:?}")));
            }
        }
        self.hasher.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn receipt(&self) -> Result<Receipt, BlobError> {
        if self.failed || self.written != self.declared {
            return Err(err(format!("{} bytes received, {} declared", self.written, self.declared)));
        }
        Ok(self.computed())
    }

    async fn finish(mut self) -> Result<PutOutcome, BlobError> {
        let receipt = self.receipt()?;
        let (Some(tx), Some(sending)) = (self.tx.take(), self.sending.take()) else {
            return Err(err("upload already finished"));
        };
        // The request may have ended already: it stops reading at its Content-Length.
        let _ = tx.send(Frame::End).await;
        drop(tx);
        let answer = sending.await.map_err(|e| err(format!("upload task: {e}")))??;
        if answer.status != 200 {
            return Err(S3BlobStore::refused("storing content", &answer));
        }
        let store = self.store.clone();
        let stored = Stored { receipt: receipt.clone(), object: self.object.clone() };
        let body = serde_json::to_vec(&stored).map_err(err)?;
        let name = store.receipt_name(&self.key);
        let headers = vec![("if-none-match", "*".to_owned()), ("content-type", "application/json".to_owned())];
        let answer = store.send("PUT", &name, headers, Payload::Bytes(&body)).await;
        match answer {
            Ok(a) if a.status == 200 => Ok(PutOutcome::Stored(receipt)),
            // A receipt is there (412), or another conditional write of it is in progress
            // (409): what it says decides, and this upload's object is not needed.
            Ok(a) if a.status == 412 || a.status == 409 => {
                store.delete_quietly(&self.object).await;
                match store.stored(&self.key).await? {
                    Some(held) if held.receipt == receipt => Ok(PutOutcome::AlreadyStored(held.receipt)),
                    Some(_) => Ok(PutOutcome::Conflict),
                    None => Err(err("the receipt's conditional write conflicted; try again")),
                }
            }
            Ok(a) => {
                store.delete_quietly(&self.object).await;
                Err(S3BlobStore::refused("storing a receipt", &a))
            }
            // Unknown whether the receipt landed: the object stays, since it may be named.
            Err(e) => Err(e),
        }
    }
}

impl BlobStore for S3BlobStore {
    type Upload = S3Upload;

    async fn begin(&self, key: &ArtifactKey, length: u64, truncated: bool) -> Result<S3Upload, BlobError> {
        if length > ARTIFACT_CONTENT_MAX {
            return Err(err(format!("{length} bytes exceeds the artifact limit")));
        }
        let object = format!("{}/{}.data.{}", self.dir(key), key.artifact, random_suffix()?);
        let (tx, rx) = mpsc::channel(IN_FLIGHT_FRAMES);
        let reader = ChannelReader { rx, frame: Vec::new(), at: 0, ended: false };
        let request = self.signed("PUT", &object, vec![], &Payload::Streamed(length))?;
        let store = self.clone();
        let sending = tokio::task::spawn_blocking(move || store.call(request, OwnedBody::Stream(reader)));
        Ok(S3Upload {
            store: self.clone(),
            key: key.clone(),
            object,
            declared: length,
            truncated,
            tx: Some(tx),
            sending: Some(sending),
            hasher: Sha256::new(),
            written: 0,
            failed: false,
        })
    }

    async fn inspect(&self, key: &ArtifactKey) -> Result<Option<Receipt>, BlobError> {
        let Some(stored) = self.stored(key).await? else {
            return Ok(None);
        };
        let answer = self.send("HEAD", &stored.object, vec![], Payload::Empty).await?;
        match (answer.status, answer.length) {
            (200, Some(length)) if length == stored.receipt.length => Ok(Some(stored.receipt)),
            (200, _) => Err(err("stored content does not match its receipt")),
            (404, _) => Err(err("receipt without content")),
            _ => Err(Self::refused("inspecting content", &answer)),
        }
    }

    async fn read(&self, key: &ArtifactKey, offset: u64, limit: u64) -> Result<Option<Vec<u8>>, BlobError> {
        let Some(stored) = self.stored(key).await? else {
            return Ok(None);
        };
        let length = stored.receipt.length;
        let end = offset.saturating_add(limit).min(length);
        if offset >= end {
            return Ok(Some(Vec::new()));
        }
        let range = vec![("range", format!("bytes={offset}-{}", end - 1))];
        let answer = self.send("GET", &stored.object, range, Payload::Empty).await?;
        let bytes = match answer.status {
            206 => answer.body,
            // A service that ignores Range sends it all.
            200 => answer.body.get(offset as usize..end as usize).map(<[u8]>::to_vec).unwrap_or_default(),
            404 => return Err(err("receipt without content")),
            _ => return Err(Self::refused("reading content", &answer)),
        };
        if bytes.len() as u64 != end - offset {
            return Err(err("stored content does not match its receipt"));
        }
        Ok(Some(bytes))
    }

    async fn put_chunk(&self, key: &ArtifactKey, offset: u64, bytes: &[u8]) -> Result<Digest, BlobError> {
        let sha256 = Digest::of(bytes);
        // Named by its digest: a repeat writes the very same bytes again, harmlessly.
        let name = self.chunk_name(key, offset, &sha256);
        let answer = self.send("PUT", &name, vec![], Payload::Bytes(bytes)).await?;
        if answer.status != 200 {
            return Err(Self::refused("storing a chunk", &answer));
        }
        Ok(sha256)
    }

    async fn read_chunk(
        &self,
        key: &ArtifactKey,
        offset: u64,
        length: u64,
        sha256: &Digest,
    ) -> Result<Vec<u8>, BlobError> {
        let name = self.chunk_name(key, offset, sha256);
        let answer = self.send("GET", &name, vec![], Payload::Empty).await?;
        match answer.status {
            200 => {}
            404 => return Err(err("acknowledged chunk missing")),
            _ => return Err(Self::refused("reading a chunk", &answer)),
        }
        if answer.body.len() as u64 != length || Digest::of(&answer.body) != *sha256 {
            return Err(err("stored chunk does not match its record"));
        }
        Ok(answer.body)
    }

    async fn remove_chunk(&self, key: &ArtifactKey, offset: u64, sha256: &Digest) -> Result<(), BlobError> {
        let answer = self.send("DELETE", &self.chunk_name(key, offset, sha256), vec![], Payload::Empty).await?;
        match answer.status {
            // S3 answers 204 whether or not the object was there; some services 404.
            200 | 204 | 404 => Ok(()),
            _ => Err(Self::refused("removing a chunk", &answer)),
        }
    }

    async fn remove_run(&self, project: &ProjectId, run: &RunId) -> Result<u64, BlobError> {
        let under = format!("{project}/{run}/");
        let mut removed = 0;
        let mut token = None;
        loop {
            let page = self.list_under(&under, token.as_deref()).await?;
            for object in &page.contents {
                let answer = self.send("DELETE", &object.key, vec![], Payload::Empty).await?;
                match answer.status {
                    200 | 204 => removed += 1,
                    // Another replica's sweep was first.
                    404 => {}
                    _ => return Err(Self::refused("removing a run's object", &answer)),
                }
            }
            match page.next_continuation_token {
                Some(next) if page.is_truncated => token = Some(next),
                _ => return Ok(removed),
            }
        }
    }

    async fn collect<R: Recorded>(&self, before: SystemTime, recorded: &R) -> Result<Collected, BlobError> {
        let before = jiff::Timestamp::try_from(before).map_err(|e| err(format!("collecting leftovers: {e}")))?;
        let mut collected = Collected::default();
        // The listing is in key order, so an attempt's chunks come together: whether it
        // recorded its artifact is asked once for them.
        let mut asked: Option<(ArtifactKey, bool)> = None;
        let mut token = None;
        loop {
            let page = self.list(token.as_deref()).await?;
            for object in &page.contents {
                let Some((key, kind)) = self.named(&object.key) else { continue };
                let written: jiff::Timestamp = object
                    .last_modified
                    .parse()
                    .map_err(|e| err(format!("S3 listing: LastModified {:?}: {e}", object.last_modified)))?;
                if written >= before {
                    continue;
                }
                let counts = match kind {
                    Object::Content => {
                        // The receipt read now: content it names stays. (An upload
                        // writes its receipt right after its content, long before
                        // `before`.)
                        if self.stored(&key).await?.is_some_and(|stored| stored.object == object.key) {
                            continue;
                        }
                        (&mut collected.removed, &mut collected.bytes)
                    }
                    Object::Chunk => {
                        let known = asked.as_ref().filter(|(k, _)| *k == key).map(|(_, r)| *r);
                        let recorded = match known {
                            Some(r) => r,
                            None => {
                                recorded.recorded(&key).await.map(|a| a == Recording::Recorded).unwrap_or_else(|_| {
                                    collected.unanswered += 1;
                                    false
                                })
                            }
                        };
                        asked = Some((key, recorded));
                        if !recorded {
                            continue;
                        }
                        (&mut collected.chunks, &mut collected.chunk_bytes)
                    }
                };
                let answer = self.send("DELETE", &object.key, vec![], Payload::Empty).await?;
                if !matches!(answer.status, 200 | 204 | 404) {
                    return Err(Self::refused("removing a leftover", &answer));
                }
                // A 404: another replica (or the completion's own removal) was first.
                if answer.status != 404 {
                    *counts.0 += 1;
                    *counts.1 += object.size;
                }
            }
            match page.next_continuation_token {
                Some(next) if page.is_truncated => token = Some(next),
                _ => return Ok(collected),
            }
        }
    }
}

/// What an object this store made is ([`S3BlobStore::named`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Object {
    /// An upload's content.
    Content,
    /// A live-log chunk.
    Chunk,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls_name_a_bucket_and_a_safe_prefix() {
        assert_eq!(parse_url("s3://ql-artifacts").unwrap(), ("ql-artifacts".into(), String::new()));
        assert_eq!(parse_url("s3://ql-artifacts/edge/prod/").unwrap(), ("ql-artifacts".into(), "edge/prod".into()));
        for bad in
            ["ql-artifacts", "s3://", "s3://A_b", "s3://ab", "s3://b/../x", "s3://bucket/a//b", "s3://bucket/a b"]
        {
            assert!(parse_url(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn an_error_body_gives_its_code() {
        let body = "<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>x</Message></Error>";
        assert_eq!(error_code(body), Some("NoSuchBucket"));
        assert_eq!(error_code("not xml"), None);
    }

    #[test]
    fn an_abandoned_upload_is_an_error_not_an_end() {
        let (tx, rx) = mpsc::channel(4);
        let mut reader = ChannelReader { rx, frame: Vec::new(), at: 0, ended: false };
        tx.try_send(Frame::Data(b"abc".to_vec())).unwrap();
        drop(tx);
        let mut out = Vec::new();
        assert!(reader.read_to_end(&mut out).is_err());
        assert_eq!(out, b"abc");

        let (tx, rx) = mpsc::channel(4);
        let mut reader = ChannelReader { rx, frame: Vec::new(), at: 0, ended: false };
        tx.try_send(Frame::Data(b"abc".to_vec())).unwrap();
        tx.try_send(Frame::End).unwrap();
        let mut out = Vec::new();
        reader.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"abc");
    }

    #[test]
    fn only_content_and_chunks_this_store_names_are_taken_for_collection() {
        let store = |prefix: &str| {
            S3BlobStore::new(S3Options {
                endpoint: "http://127.0.0.1:9".into(),
                region: "us-east-1".into(),
                bucket: "bucket".into(),
                prefix: prefix.into(),
                path_style: true,
                credentials: aws_credential_types::Credentials::new("id", "secret", None, None, "test"),
                timeout: Duration::from_secs(1),
                roots: Vec::new(),
                list_page: 1_000,
            })
        };
        let (edge, bare) = (store("edge/prod"), store(""));
        let (key, object) = edge.named("edge/prod/proj/run_1/att_1/log.data.0123456789abcdef").expect("content");
        assert_eq!((key.project.as_str(), key.run.as_str()), ("proj", "run_1"));
        assert_eq!((key.attempt.as_str(), key.artifact.as_str(), object), ("att_1", "log", Object::Content));
        assert!(bare.named("proj/run_1/att_1/log.data.0123456789abcdef").is_some());
        let sha = Digest::of(b"chunk");
        let chunk = format!("edge/prod/proj/run_1/att_1/log.chunk.262144.{}", sha.as_str());
        let (key, object) = edge.named(&chunk).expect("a chunk");
        assert_eq!((key.attempt.as_str(), key.artifact.as_str(), object), ("att_1", "log", Object::Chunk));
        let odd = [
            format!("edge/prod/proj/run_1/att_1/log.chunk.x.{}", sha.as_str()),
            format!("edge/prod/proj/run_1/att_1/log.chunk.+5.{}", sha.as_str()),
            format!("edge/prod/proj/run_1/att_1/log.chunk.05.{}", sha.as_str()),
            format!("edge/prod/proj/run_1/att_1/x/log.chunk.0.{}", sha.as_str()),
        ];
        for other in [
            "edge/prodx/proj/run_1/att_1/log.data.0123456789abcdef",
            "edge/prod/run_1/att_1/log.data.0123456789abcdef",
            "edge/prod/proj/run_1/att_1/x/log.data.0123456789abcdef",
            "edge/prod/proj/run_1/att_1/log.receipt.json",
            "edge/prod/proj/run_1/att_1/log.chunk.0.0123456789abcdef",
            "edge/prod/proj/run_1/att_1/log.data.0123456789ABCDEF",
            "edge/prod/proj/run_1/att_1/log.data.0123456789abcde",
            "edge/prod/proj/run_1/att_1/lo g.data.0123456789abcdef",
        ]
        .into_iter()
        .chain(odd.iter().map(String::as_str))
        {
            assert!(edge.named(other).is_none(), "{other}");
        }
    }

    #[test]
    fn debug_shows_no_secret() {
        let credentials = aws_credential_types::Credentials::new("AKIDEXAMPLE", "s3cr3t-value", None, None, "test");
        let store = S3BlobStore::new(S3Options {
            endpoint: "http://127.0.0.1:9".into(),
            region: "us-east-1".into(),
            bucket: "bucket".into(),
            prefix: String::new(),
            path_style: true,
            credentials,
            timeout: Duration::from_secs(1),
            roots: Vec::new(),
            list_page: 1_000,
        });
        let shown = format!("{store:?} {}", store.describe());
        assert!(!shown.contains("s3cr3t"), "{shown}");
    }
}
