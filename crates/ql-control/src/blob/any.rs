//! The artifact store a deployment chose: local files (the zero-set-up default) or an
//! S3 bucket, decided at start from `artifacts` (`--artifacts`, `$QL_CONTROL_ARTIFACTS`).
//!
//! Credentials for a bucket come the way the AWS tools take them: `$AWS_ACCESS_KEY_ID`
//! and `$AWS_SECRET_ACCESS_KEY` (and `$AWS_SESSION_TOKEN`), else the `[default]` (or
//! `$AWS_PROFILE`) section of the credentials file, which must be readable by its owner
//! only. They never enter `control.json`, and nothing prints them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;

use super::fs::{FsBlobStore, FsUpload};
use super::s3::{S3BlobStore, S3Options, S3Upload};
use super::{ArtifactKey, BlobError, BlobStore, PutOutcome, Upload};
use crate::config::{Config, Layout};

/// One of the stores.
#[derive(Debug, Clone)]
pub enum Blobs {
    /// `<dir>/artifacts`.
    Files(FsBlobStore),
    /// A bucket.
    S3(S3BlobStore),
}

/// An upload into whichever store.
#[derive(Debug)]
pub enum BlobsUpload {
    /// Into files.
    Files(FsUpload),
    /// Into a bucket.
    S3(S3Upload),
}

/// The environment, as a function so tests can give one.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process's environment (empty values count as unset).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Blobs {
    /// The store `config` (or `chosen`, when given) names for the state directory
    /// `layout`; `create` makes the local directory (serve), reading commands do not.
    pub fn open(layout: &Layout, config: &Config, chosen: Option<&str>, create: bool) -> Result<Self, String> {
        let env = process_env;
        let url = chosen.map(str::to_owned).or_else(|| env("QL_CONTROL_ARTIFACTS")).unwrap_or(config.artifacts.clone());
        if url.is_empty() {
            let root = layout.artifacts();
            return if create {
                FsBlobStore::open(&root).map(Self::Files).map_err(|e| e.to_string())
            } else {
                Ok(Self::Files(FsBlobStore::existing(&root)))
            };
        }
        Ok(Self::S3(S3BlobStore::new(s3_options(config, &url, &env)?)))
    }

    /// Where artifacts go, for `serve`'s first lines.
    pub fn describe(&self) -> String {
        match self {
            Self::Files(f) => format!("{} (local files)", f.root().display()),
            Self::S3(s) => s.describe(),
        }
    }
}

/// The bucket's settings from `config` and the environment.
pub fn s3_options(config: &Config, url: &str, env: Env<'_>) -> Result<S3Options, String> {
    let (bucket, prefix) = super::s3::parse_url(url)?;
    let region = env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .or_else(|| Some(config.s3_region.clone()).filter(|r| !r.is_empty()))
        .unwrap_or_else(|| "us-east-1".into());
    let custom = env("AWS_ENDPOINT_URL_S3")
        .or_else(|| env("AWS_ENDPOINT_URL"))
        .or_else(|| Some(config.s3_endpoint.clone()).filter(|e| !e.is_empty()));
    let path_style = match config.s3_addressing.as_str() {
        "path" => true,
        "virtual" => false,
        _ => custom.is_some(),
    };
    let endpoint = custom.unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
    let endpoint = endpoint.trim_end_matches('/').to_owned();
    let rest = endpoint
        .strip_prefix("https://")
        .or_else(|| endpoint.strip_prefix("http://"))
        .ok_or_else(|| format!("the S3 endpoint {endpoint} is not http(s)://host[:port]"))?;
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return Err(format!("the S3 endpoint {endpoint} is not http(s)://host[:port] (no path, no user)"));
    }
    let roots = if endpoint.starts_with("https://") {
        let pem = std::fs::read(&config.s3_ca_file).map_err(|e| format!("s3_ca_file {}: {e}", config.s3_ca_file))?;
        crate::client::certificates(&pem)
    } else {
        Vec::new()
    };
    Ok(S3Options {
        endpoint,
        region,
        bucket,
        prefix,
        path_style,
        credentials: credentials(config, env)?,
        timeout: Duration::from_millis(config.s3_timeout_ms),
        roots,
        list_page: config.s3_list_page,
    })
}

fn credentials(config: &Config, env: Env<'_>) -> Result<aws_credential_types::Credentials, String> {
    let made = |id: String, secret: String, token: Option<String>| {
        aws_credential_types::Credentials::new(id, secret, token, None, "ql-control")
    };
    if let Some(id) = env("AWS_ACCESS_KEY_ID") {
        let secret = env("AWS_SECRET_ACCESS_KEY")
            .ok_or("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not: set both for the S3 store")?;
        return Ok(made(id, secret, env("AWS_SESSION_TOKEN")));
    }
    let file = Some(config.s3_credentials_file.clone())
        .filter(|f| !f.is_empty())
        .or_else(|| env("AWS_SHARED_CREDENTIALS_FILE"))
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|home| Path::new(&home).join(".aws/credentials")))
        .ok_or("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or s3_credentials_file")?;
    let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
    let text = read_private(&file)?;
    let values = profile_values(&text, &profile);
    let value = |key: &str| values.iter().find(|(k, _)| k == key).map(|(_, v)| String::clone(v));
    match (value("aws_access_key_id"), value("aws_secret_access_key")) {
        (Some(id), Some(secret)) => Ok(made(id, secret, value("aws_session_token"))),
        _ => Err(format!(
            "no S3 credentials: {} has no aws_access_key_id and aws_secret_access_key in [{profile}], and \
             AWS_ACCESS_KEY_ID is not set",
            file.display()
        )),
    }
}

/// The file's text, refused when anyone but its owner may read it (a key in it is a key
/// to every log).
fn read_private(path: &Path) -> Result<zeroize::Zeroizing<String>, String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).map_err(|e| {
        format!(
            "no S3 credentials: {}: {e} (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or write that file, 0600)",
            path.display()
        )
    })?;
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} may be read by others (mode {:o}): `chmod 600 {}` first",
            path.display(),
            meta.mode() & 0o777,
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(zeroize::Zeroizing::new(text))
}

/// `key = value` lines of one `[profile]` section of an AWS-style INI file.
fn profile_values(text: &str, profile: &str) -> Vec<(String, zeroize::Zeroizing<String>)> {
    let mut inside = false;
    let mut values = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') && line.ends_with(']') {
            let name = line[1..line.len() - 1].trim();
            inside = name == profile || name.strip_prefix("profile ").map(str::trim) == Some(profile);
            continue;
        }
        if !inside || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            values.push((k.trim().to_owned(), zeroize::Zeroizing::new(v.trim().to_owned())));
        }
    }
    values
}

impl Upload for BlobsUpload {
    async fn write(&mut self, bytes: &[u8]) -> Result<(), BlobError> {
        match self {
            Self::Files(u) => u.write(bytes).await,
            Self::S3(u) => u.write(bytes).await,
        }
    }

    fn receipt(&self) -> Result<Receipt, BlobError> {
        match self {
            Self::Files(u) => u.receipt(),
            Self::S3(u) => u.receipt(),
        }
    }

    async fn finish(self) -> Result<PutOutcome, BlobError> {
        match self {
            Self::Files(u) => u.finish().await,
            Self::S3(u) => u.finish().await,
        }
    }
}

impl BlobStore for Blobs {
    type Upload = BlobsUpload;

    async fn begin(&self, key: &ArtifactKey, length: u64, truncated: bool) -> Result<BlobsUpload, BlobError> {
        match self {
            Self::Files(s) => s.begin(key, length, truncated).await.map(BlobsUpload::Files),
            Self::S3(s) => s.begin(key, length, truncated).await.map(BlobsUpload::S3),
        }
    }

    async fn inspect(&self, key: &ArtifactKey) -> Result<Option<Receipt>, BlobError> {
        match self {
            Self::Files(s) => s.inspect(key).await,
            Self::S3(s) => s.inspect(key).await,
        }
    }

    async fn read(&self, key: &ArtifactKey, offset: u64, limit: u64) -> Result<Option<Vec<u8>>, BlobError> {
        match self {
            Self::Files(s) => s.read(key, offset, limit).await,
            Self::S3(s) => s.read(key, offset, limit).await,
        }
    }

    async fn put_chunk(&self, key: &ArtifactKey, offset: u64, bytes: &[u8]) -> Result<Digest, BlobError> {
        match self {
            Self::Files(s) => s.put_chunk(key, offset, bytes).await,
            Self::S3(s) => s.put_chunk(key, offset, bytes).await,
        }
    }

    async fn read_chunk(
        &self,
        key: &ArtifactKey,
        offset: u64,
        length: u64,
        sha256: &Digest,
    ) -> Result<Vec<u8>, BlobError> {
        match self {
            Self::Files(s) => s.read_chunk(key, offset, length, sha256).await,
            Self::S3(s) => s.read_chunk(key, offset, length, sha256).await,
        }
    }

    async fn remove_chunk(&self, key: &ArtifactKey, offset: u64, sha256: &Digest) -> Result<(), BlobError> {
        match self {
            Self::Files(s) => s.remove_chunk(key, offset, sha256).await,
            Self::S3(s) => s.remove_chunk(key, offset, sha256).await,
        }
    }

    async fn remove_run(&self, project: &ql_wire::ids::ProjectId, run: &ql_wire::ids::RunId) -> Result<u64, BlobError> {
        match self {
            Self::Files(s) => s.remove_run(project, run).await,
            Self::S3(s) => s.remove_run(project, run).await,
        }
    }

    async fn collect<R: super::Recorded>(
        &self,
        before: std::time::SystemTime,
        recorded: &R,
    ) -> Result<super::Collected, BlobError> {
        match self {
            Self::Files(s) => s.collect(before, recorded).await,
            Self::S3(s) => s.collect(before, recorded).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn an_endpoint_of_ones_own_is_path_style_and_aws_is_virtual_hosted() {
        let config = Config::default();
        let env = env_of(&[
            ("AWS_ACCESS_KEY_ID", "AKID"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"),
        ]);
        let o = s3_options(&config, "s3://bucket/edge", &env).unwrap();
        assert_eq!(
            (o.endpoint.as_str(), o.path_style, o.region.as_str()),
            ("http://127.0.0.1:9000", true, "us-east-1")
        );
        assert_eq!((o.bucket.as_str(), o.prefix.as_str()), ("bucket", "edge"));

        let env =
            env_of(&[("AWS_ACCESS_KEY_ID", "AKID"), ("AWS_SECRET_ACCESS_KEY", "secret"), ("AWS_REGION", "eu-west-3")]);
        let config = Config { s3_ca_file: "/dev/null".into(), ..Config::default() };
        let o = s3_options(&config, "s3://bucket", &env).unwrap();
        assert_eq!((o.endpoint.as_str(), o.path_style), ("https://s3.eu-west-3.amazonaws.com", false));
    }

    #[test]
    fn credentials_need_both_halves_and_a_private_file() {
        let config = Config::default();
        let env = env_of(&[("AWS_ACCESS_KEY_ID", "AKID"), ("AWS_ENDPOINT_URL", "http://h:1")]);
        let e = s3_options(&config, "s3://bucket", &env).unwrap_err();
        assert!(e.contains("AWS_SECRET_ACCESS_KEY"), "{e}");

        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("ql-s3-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("credentials");
        std::fs::write(
            &file,
            "[other]\naws_access_key_id = NO\n\n[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = hidden-secret\n",
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let config = Config { s3_credentials_file: file.display().to_string(), ..Config::default() };
        let env = env_of(&[("AWS_ENDPOINT_URL", "http://h:1")]);
        let e = s3_options(&config, "s3://bucket", &env).unwrap_err();
        assert!(e.contains("chmod 600") && !e.contains("hidden-secret"), "{e}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let o = s3_options(&config, "s3://bucket", &env).unwrap();
        assert_eq!(o.credentials.access_key_id(), "AKIDFILE");
        assert!(!format!("{o:?}").contains("hidden-secret"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_endpoint_with_a_path_or_a_user_is_refused() {
        let config = Config::default();
        for endpoint in ["ftp://h", "http://u:p@h", "http://h/bucket", "http://"] {
            let env = move |name: &str| match name {
                "AWS_ENDPOINT_URL" => Some(endpoint.to_owned()),
                "AWS_ACCESS_KEY_ID" | "AWS_SECRET_ACCESS_KEY" => Some("x".to_owned()),
                _ => None,
            };
            assert!(s3_options(&config, "s3://bucket", &env).is_err(), "{endpoint} was accepted");
        }
    }
}
