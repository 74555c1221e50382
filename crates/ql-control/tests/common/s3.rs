//! A real S3 server for the tests: `s3s-fs` (SigV4, conditional put, ranged GET), one
//! process per test on a port of its own, its data in a throwaway directory removed when
//! dropped. `./scripts/test` installs it (cached) and names it in `$QL_TEST_S3FS`.
//!
//! Included as `#[path = "common/s3.rs"] mod s3;`.

#![allow(dead_code)] // Not every includer uses every helper.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ql_control::blob::s3::{S3BlobStore, S3Options};

/// Where the tests learn how to get the server.
pub(crate) const HOW_TO_GET_S3: &str = "run the tests through ./scripts/test (it installs s3s-fs with \
     `cargo install --locked s3s-fs --version 0.14.1 --features binary` when missing and sets QL_TEST_S3FS), \
     or set QL_TEST_S3FS to an s3s-fs binary";

/// The bucket every server here has.
pub(crate) const BUCKET: &str = "ql-test";
/// Its key pair (the server's own, throwaway).
pub(crate) const ACCESS_KEY: &str = "ql-test-access";
/// The secret half.
pub(crate) const SECRET_KEY: &str = "ql-test-secret-key";

/// A running `s3s-fs`, killed and its data removed when dropped.
pub(crate) struct S3Server {
    child: Option<Child>,
    root: PathBuf,
    port: u16,
    spawns: u32,
    /// `http://127.0.0.1:PORT`.
    pub(crate) endpoint: String,
}

fn binary() -> PathBuf {
    let bin = std::env::var_os("QL_TEST_S3FS").unwrap_or_else(|| panic!("QL_TEST_S3FS is not set: {HOW_TO_GET_S3}"));
    let bin = PathBuf::from(bin);
    assert!(bin.is_file(), "QL_TEST_S3FS={} is not a file: {HOW_TO_GET_S3}", bin.display());
    bin
}

impl S3Server {
    /// Starts a server with the bucket [`BUCKET`], its data under a fresh directory.
    pub(crate) fn start(tag: &str) -> Self {
        let mut rnd = [0u8; 6];
        getrandom::getrandom(&mut rnd).unwrap();
        let suffix: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        let root = std::env::temp_dir().join(format!("ql-s3-{tag}-{suffix}"));
        // s3s-fs keeps a bucket as a directory of its root.
        std::fs::create_dir_all(root.join("data").join(BUCKET)).unwrap();
        let mut server = Self { child: None, root, port: 0, spawns: 0, endpoint: String::new() };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        self.spawns += 1;
        let log = self.root.join(format!("server-{}.log", self.spawns));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(self.root.join("data"))
            .env("RUST_LOG", "info")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting s3s-fs: {e}: {HOW_TO_GET_S3}"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        let marker = "server is running at http://127.0.0.1:";
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(at) = text.find(marker) {
                let port: String = text[at + marker.len()..].chars().take_while(char::is_ascii_digit).collect();
                self.port = port.parse().unwrap();
                self.endpoint = format!("http://127.0.0.1:{}", self.port);
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("s3s-fs exited ({status}) before listening:\n{text}");
            }
            assert!(Instant::now() < deadline, "s3s-fs did not listen within 20 s:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (the bucket is down: connections are refused).
    pub(crate) fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, with the same data.
    pub(crate) fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// The data directory (a bucket is `data/<bucket>`, an object a file under it).
    pub(crate) fn data(&self) -> &Path {
        &self.root
    }

    /// Options for a store under `prefix` in [`BUCKET`].
    pub(crate) fn options(&self, prefix: &str) -> S3Options {
        S3Options {
            endpoint: self.endpoint.clone(),
            region: "us-east-1".into(),
            bucket: BUCKET.into(),
            prefix: prefix.into(),
            path_style: true,
            credentials: aws_credential_types::Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"),
            timeout: Duration::from_secs(10),
            roots: Vec::new(),
            // Small pages, so a listing of a test's few objects takes several.
            list_page: 2,
        }
    }

    /// A store under `prefix` in [`BUCKET`].
    pub(crate) fn store(&self, prefix: &str) -> S3BlobStore {
        S3BlobStore::new(self.options(prefix))
    }

    /// The environment a `ql-control` process needs for this server.
    pub(crate) fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
