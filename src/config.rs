//! The agent's settings: one `key = value` file plus command-line overrides.
//!
//! The file format is deliberately tiny, so it needs no parser dependency and an OpenWrt
//! owner can edit it with `vi`:
//!
//! ```text
//! # comment lines start with '#'; blank lines are ignored
//! server = https://control.example:8443
//! worker_id = router-1
//! label.site = attic
//! ```
//!
//! One setting per line, split at the first `=`; key and value are trimmed, and a value may
//! be wrapped in double quotes to keep leading or trailing spaces. A `#` only starts a
//! comment at the beginning of a line (label values may contain one). Every key may appear
//! once; an unknown key is an error, so a typo never silently falls back to a default.
//! Relative paths in the file are taken relative to the file's directory; relative paths
//! given as flags, relative to the working directory.
//!
//! Flags override the file: `--server`, `--worker-id`, `--cert`, `--key`, `--ca`,
//! `--state-dir`, `--capacity`, `--log-level`, and `--set key=value` for any setting.
//! Validation happens once everything is merged; an error names where the bad value came
//! from (`config line 7: capacity must be 1..=64`, `--capacity: ...`).
//!
//! Every duration is a setting in milliseconds, so tests can run the whole protocol fast.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ql_wire::ids::WorkerId;
use ql_wire::limits::{CAPACITY_MAX, LABELS_MAX, LOG_CHUNK_MAX, LOG_LIMIT_MAX, POLL_WAIT_MAX_MS};
use ql_wire::text::{LabelKey, LabelValue};

use crate::log::Level;

/// Where the agent looks for its configuration when `--config` is not given.
pub(crate) const DEFAULT_PATH: &str = "/etc/ql-agent/agent.conf";

/// A setting's name, its default (`None`: required; `Some("")`: optional, unset unless
/// given), and a one-line description.
/// The README's table is written from the same list.
pub(crate) const SETTINGS: &[(&str, Option<&str>, &str)] = &[
    ("server", None, "base URL of ql-control, `https://host:port`"),
    ("worker_id", None, "this worker's id; must match the certificate's `urn:qinglong:worker:<id>`"),
    ("cert", None, "client certificate chain (PEM)"),
    ("key", None, "client private key (PEM)"),
    ("ca", None, "the CA that signed the server certificate (PEM); the only one trusted"),
    ("state_dir", Some("/var/lib/ql-agent"), "journal and run directories"),
    ("capacity", Some("1"), "jobs run at once, 1..=64"),
    ("drain_timeout_ms", Some("30000"), "on SIGTERM: how long running jobs may finish before they are stopped"),
    ("stop_grace_ms", Some("5000"), "between TERM and KILL when a job's process group is stopped"),
    ("group_poll_ms", Some("50"), "how often a stopping process group is looked at"),
    (
        "handoff_timeout_ms",
        Some("10000"),
        "how long a job's new supervisor may take to say the job runs (longer, it is stopped), 1..=60000",
    ),
    ("poll_wait_ms", Some("25000"), "long-poll wait for offers while no job runs, 0..=30000"),
    ("busy_poll_wait_ms", Some("1000"), "long-poll wait while jobs run (the agent is single-threaded), 0..=30000"),
    ("connect_timeout_ms", Some("10000"), "TCP connect plus TLS handshake"),
    ("call_timeout_ms", Some("15000"), "a whole call; a long-poll gets its wait on top"),
    (
        "upload_timeout_ms",
        Some("600000"),
        "a whole log upload in one frame (only a job that ends before its `running` ACK)",
    ),
    ("log_flush_bytes", Some("65536"), "while a job runs, send its log once this many bytes wait, 1..=67108864"),
    ("log_flush_ms", Some("1000"), "while a job runs, send what waits of its log at least this often"),
    (
        "log_chunk_bytes",
        Some("262144"),
        "largest log chunk, 4096..=262144 (smaller on a slow uplink: the agent adapts)",
    ),
    ("backoff_initial_ms", Some("500"), "first wait after a failed call"),
    ("backoff_max_ms", Some("30000"), "cap of the doubling wait between failed calls"),
    ("log_level", Some("info"), "error, warn, info or debug"),
    ("lock_wait_ms", Some("120000"), "at start, how long to wait for another agent using state_dir to exit"),
    (
        "reload_marker",
        Some(""),
        "a file whose presence turns the next SIGTERM into a handover (exit at once, jobs run on): set by a service manager's reload",
    ),
];

/// The smallest log chunk: the agent shrinks chunks on a slow uplink, never below this.
pub(crate) const MIN_CHUNK: u64 = 4096;

/// The validated settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    /// `https://host:port`, without a trailing slash.
    pub(crate) server: String,
    /// The worker id the paths carry.
    pub(crate) worker_id: WorkerId,
    /// Client certificate chain.
    pub(crate) cert: PathBuf,
    /// Client private key.
    pub(crate) key: PathBuf,
    /// The trusted CA.
    pub(crate) ca: PathBuf,
    /// Journal and run directories.
    pub(crate) state_dir: PathBuf,
    /// Jobs at once.
    pub(crate) capacity: u32,
    /// Placement labels.
    pub(crate) labels: BTreeMap<LabelKey, LabelValue>,
    /// How long draining jobs may run before they are stopped.
    pub(crate) drain_timeout: Duration,
    /// TERM to KILL.
    pub(crate) stop_grace: Duration,
    /// How often a stopping group is looked at.
    pub(crate) group_poll: Duration,
    /// How long a new supervisor may take to hand its job over.
    pub(crate) handoff_timeout: Duration,
    /// Long-poll wait with no job running.
    pub(crate) poll_wait: Duration,
    /// Long-poll wait while jobs run.
    pub(crate) busy_poll_wait: Duration,
    /// Connect and handshake.
    pub(crate) connect_timeout: Duration,
    /// A whole call.
    pub(crate) call_timeout: Duration,
    /// A whole upload.
    pub(crate) upload_timeout: Duration,
    /// Unacknowledged log bytes that make a chunk worth sending while the job runs.
    pub(crate) log_flush_bytes: u64,
    /// The longest a running job's waiting log bytes wait.
    pub(crate) log_flush: Duration,
    /// The largest chunk.
    pub(crate) log_chunk_bytes: u64,
    /// When this file exists at SIGTERM, the agent hands its jobs over instead of draining.
    pub(crate) reload_marker: Option<PathBuf>,
    /// How long to wait at start for another agent on the state directory to exit.
    pub(crate) lock_wait: Duration,
    /// First backoff.
    pub(crate) backoff_initial: Duration,
    /// Backoff cap.
    pub(crate) backoff_max: Duration,
    /// Log verbosity.
    pub(crate) log_level: Level,
}

/// A configuration error, already phrased for the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConfigError(pub(crate) String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Where a value came from, for error messages and relative paths.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    /// A line of the config file; relative paths are taken from `dir`.
    Line { line: usize, dir: PathBuf },
    /// A command-line flag.
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Line { line, .. } => write!(f, "config line {line}"),
            Self::Flag(flag) => f.write_str(flag),
        }
    }
}

/// Raw settings before validation: each key's text and where it came from.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sources {
    values: BTreeMap<String, (String, Origin)>,
}

fn known(key: &str) -> bool {
    SETTINGS.iter().any(|(k, ..)| *k == key) || key.strip_prefix("label.").is_some_and(|l| !l.is_empty())
}

impl Sources {
    /// Reads the file at `path`.
    pub(crate) fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read config file {}: {e}", path.display())))?;
        let dir = path.parent().map(Path::to_owned).unwrap_or_default();
        Self::parse(&text, &dir)
    }

    /// Parses the file's text; relative paths will be taken from `dir`.
    pub(crate) fn parse(text: &str, dir: &Path) -> Result<Self, ConfigError> {
        let mut out = Self::default();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let trimmed = raw.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let Some((key, value)) = trimmed.split_once('=') else {
                return Err(ConfigError(format!("config line {line}: expected `key = value`")));
            };
            let (key, value) = (key.trim(), unquote(value.trim()));
            if !known(key) {
                return Err(ConfigError(format!("config line {line}: unknown setting `{key}`")));
            }
            if let Some((_, Origin::Line { line: first, .. })) = out.values.get(key) {
                return Err(ConfigError(format!("config line {line}: `{key}` is already set on line {first}")));
            }
            out.values.insert(key.to_owned(), (value.to_owned(), Origin::Line { line, dir: dir.to_owned() }));
        }
        Ok(out)
    }

    /// Sets `key` from a flag, replacing whatever the file said.
    pub(crate) fn set_flag(&mut self, flag: &str, key: &str, value: &str) -> Result<(), ConfigError> {
        if !known(key) {
            return Err(ConfigError(format!("{flag}: unknown setting `{key}`")));
        }
        self.values.insert(key.to_owned(), (value.to_owned(), Origin::Flag(flag.to_owned())));
        Ok(())
    }

    /// Applies a `--set key=value` flag.
    pub(crate) fn set_pair(&mut self, pair: &str) -> Result<(), ConfigError> {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(ConfigError(format!("--set {pair}: expected key=value")));
        };
        let key = key.trim();
        self.set_flag(&format!("--set {key}"), key, value.trim())
    }

    /// Validates the merged settings.
    pub(crate) fn finish(&self) -> Result<Config, ConfigError> {
        let get = |key: &str| -> Option<&(String, Origin)> { self.values.get(key) };
        let required = |key: &str| -> Result<&(String, Origin), ConfigError> {
            get(key).ok_or_else(|| {
                ConfigError(format!("{key} is not set (add `{key} = ...` to the config file or pass a flag)"))
            })
        };
        let fail = |origin: &Origin, what: String| ConfigError(format!("{origin}: {what}"));
        let default = |key: &str| -> String {
            SETTINGS.iter().find(|(k, ..)| *k == key).and_then(|(_, d, _)| *d).unwrap_or_default().to_owned()
        };
        let number = |key: &str, min: u64, max: u64| -> Result<u64, ConfigError> {
            let (text, origin) = match get(key) {
                Some((t, o)) => (t.clone(), Some(o)),
                None => (default(key), None),
            };
            let n: Option<u64> = text.parse().ok().filter(|n| (min..=max).contains(n));
            n.ok_or_else(|| {
                let what = format!("{key} must be {min}..={max}, not `{text}`");
                match origin {
                    Some(o) => fail(o, what),
                    None => ConfigError(what),
                }
            })
        };
        let ms = |key: &str, min: u64, max: u64| number(key, min, max).map(Duration::from_millis);
        let path = |key: &str| -> Result<PathBuf, ConfigError> {
            let (text, origin) = required(key)?;
            if text.is_empty() {
                return Err(fail(origin, format!("{key} must not be empty")));
            }
            Ok(resolve(text, origin))
        };

        let (server_text, server_origin) = required("server")?;
        let server = server_text.trim_end_matches('/').to_owned();
        let authority = server.strip_prefix("https://").unwrap_or("");
        if authority.is_empty() || authority.contains(['/', '?', '#', ' ']) {
            return Err(fail(server_origin, format!("server must be https://host:port, not `{server_text}`")));
        }
        let (id_text, id_origin) = required("worker_id")?;
        let worker_id = WorkerId::parse(id_text.as_str())
            .map_err(|e| fail(id_origin, format!("worker_id `{id_text}` is not a worker id ({e})")))?;
        let state_dir = match get("state_dir") {
            Some((text, origin)) if text.is_empty() => return Err(fail(origin, "state_dir must not be empty".into())),
            Some((text, origin)) => resolve(text, origin),
            None => PathBuf::from(default("state_dir")),
        };

        let mut labels = BTreeMap::new();
        for (key, (text, origin)) in &self.values {
            let Some(name) = key.strip_prefix("label.") else { continue };
            let k = LabelKey::parse(name).map_err(|e| fail(origin, format!("label name `{name}`: {e}")))?;
            let v = LabelValue::parse(text.as_str()).map_err(|e| fail(origin, format!("label `{name}` value: {e}")))?;
            labels.insert(k, v);
        }
        if labels.len() > LABELS_MAX {
            return Err(ConfigError(format!("at most {LABELS_MAX} labels, not {}", labels.len())));
        }

        let log_level = match get("log_level") {
            None => Level::Info,
            Some((text, origin)) => Level::parse(text)
                .ok_or_else(|| fail(origin, format!("log_level must be error, warn, info or debug, not `{text}`")))?,
        };

        // An hour bounds every timeout: long enough for anything real, short enough that a
        // typo of extra zeros is caught rather than waited out.
        const HOUR: u64 = 3_600_000;
        let config = Config {
            server,
            worker_id,
            cert: path("cert")?,
            key: path("key")?,
            ca: path("ca")?,
            state_dir,
            capacity: number("capacity", 1, u64::from(CAPACITY_MAX))? as u32,
            labels,
            drain_timeout: ms("drain_timeout_ms", 0, 24 * HOUR)?,
            stop_grace: ms("stop_grace_ms", 0, HOUR)?,
            group_poll: ms("group_poll_ms", 1, 60_000)?,
            // The agent does nothing else while it waits: a minute at most.
            handoff_timeout: ms("handoff_timeout_ms", 1, 60_000)?,
            poll_wait: ms("poll_wait_ms", 0, POLL_WAIT_MAX_MS)?,
            busy_poll_wait: ms("busy_poll_wait_ms", 0, POLL_WAIT_MAX_MS)?,
            connect_timeout: ms("connect_timeout_ms", 1, HOUR)?,
            call_timeout: ms("call_timeout_ms", 1, HOUR)?,
            upload_timeout: ms("upload_timeout_ms", 1, 24 * HOUR)?,
            log_flush_bytes: number("log_flush_bytes", 1, LOG_LIMIT_MAX)?,
            log_flush: ms("log_flush_ms", 1, HOUR)?,
            log_chunk_bytes: number("log_chunk_bytes", MIN_CHUNK, LOG_CHUNK_MAX)?,
            lock_wait: ms("lock_wait_ms", 0, HOUR)?,
            reload_marker: get("reload_marker").filter(|(t, _)| !t.is_empty()).map(|(t, o)| resolve(t, o)),
            backoff_initial: ms("backoff_initial_ms", 1, HOUR)?,
            backoff_max: ms("backoff_max_ms", 1, HOUR)?,
            log_level,
        };
        if config.backoff_max < config.backoff_initial {
            let origin = get("backoff_max_ms").or(get("backoff_initial_ms")).map(|(_, o)| o.to_string());
            let what = "backoff_max_ms must not be below backoff_initial_ms";
            return Err(ConfigError(match origin {
                Some(o) => format!("{o}: {what}"),
                None => what.to_owned(),
            }));
        }
        Ok(config)
    }
}

fn unquote(value: &str) -> &str {
    value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value)
}

fn resolve(text: &str, origin: &Origin) -> PathBuf {
    let p = PathBuf::from(text);
    match origin {
        Origin::Line { dir, .. } if p.is_relative() => dir.join(p),
        _ => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "server = https://127.0.0.1:8443\nworker_id = r1\ncert = r1.crt\nkey = r1.key\nca = ca.crt\n";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Sources::parse(text, Path::new("/etc/ql"))?.finish()
    }

    fn error(text: &str) -> String {
        parse(text).unwrap_err().0
    }

    #[test]
    fn a_minimal_file_gets_every_default() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.server, "https://127.0.0.1:8443");
        assert_eq!(c.worker_id.as_str(), "r1");
        assert_eq!(c.cert, PathBuf::from("/etc/ql/r1.crt"), "relative paths follow the file");
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/ql-agent"));
        assert_eq!(c.capacity, 1);
        assert!(c.labels.is_empty());
        assert_eq!(c.poll_wait, Duration::from_millis(25_000));
        assert_eq!(c.busy_poll_wait, Duration::from_millis(1_000));
        assert_eq!(c.drain_timeout, Duration::from_millis(30_000));
        assert_eq!(c.stop_grace, Duration::from_millis(5_000));
        assert_eq!(c.backoff_initial, Duration::from_millis(500));
        assert_eq!(c.backoff_max, Duration::from_millis(30_000));
        assert_eq!(c.log_level, Level::Info);
    }

    #[test]
    fn every_documented_default_parses() {
        // The defaults in SETTINGS are what the README shows: each must be valid on its own.
        let mut text = MINIMAL.to_owned();
        for (key, default, _) in SETTINGS {
            if let (Some(d), false) = (default.filter(|d| !d.is_empty()), MINIMAL.contains(key)) {
                text.push_str(&format!("{key} = {d}\n"));
            }
        }
        assert_eq!(parse(&text).unwrap(), parse(MINIMAL).unwrap());
    }

    #[test]
    fn comments_blank_lines_quotes_and_labels() {
        let text = format!(
            "# a comment\n\n   # indented comment\n{MINIMAL}label.site = \"attic # 2 \"\nlabel.arch/cpu = mips\ncapacity=4\n"
        );
        let c = parse(&text).unwrap();
        assert_eq!(c.capacity, 4);
        let labels: Vec<(&str, &str)> = c.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(labels, [("arch/cpu", "mips"), ("site", "attic # 2 ")]);
    }

    #[test]
    fn errors_name_the_line_and_the_rule() {
        assert_eq!(
            error(&format!("{MINIMAL}\n# x\ncapacity = 65\n")),
            "config line 8: capacity must be 1..=64, not `65`"
        );
        assert_eq!(error(&format!("{MINIMAL}capacity = 0\n")), "config line 6: capacity must be 1..=64, not `0`");
        assert_eq!(error(&format!("{MINIMAL}capacity = two\n")), "config line 6: capacity must be 1..=64, not `two`");
        assert_eq!(error(&format!("{MINIMAL}capacity\n")), "config line 6: expected `key = value`");
        assert_eq!(error(&format!("{MINIMAL}capacty = 2\n")), "config line 6: unknown setting `capacty`");
        assert_eq!(
            error(&format!("{MINIMAL}server = https://x:1\n")),
            "config line 6: `server` is already set on line 1"
        );
        assert_eq!(
            error(&format!("{MINIMAL}poll_wait_ms = 30001\n")),
            "config line 6: poll_wait_ms must be 0..=30000, not `30001`"
        );
        assert_eq!(
            error(&format!("{MINIMAL}call_timeout_ms = 0\n")),
            "config line 6: call_timeout_ms must be 1..=3600000, not `0`"
        );
        assert_eq!(
            error(&format!("{MINIMAL}log_level = loud\n")),
            "config line 6: log_level must be error, warn, info or debug, not `loud`"
        );
        assert_eq!(error(&format!("{MINIMAL}label. = x\n")), "config line 6: unknown setting `label.`");
        assert!(error(&format!("{MINIMAL}label.Site = x\n")).starts_with("config line 6: label name `Site`"));
        assert!(error(&format!("{MINIMAL}backoff_initial_ms = 900\nbackoff_max_ms = 800\n"))
            .starts_with("config line 7: backoff_max_ms must not be below"));
    }

    #[test]
    fn server_and_worker_id_are_checked() {
        let with = |server: &str| MINIMAL.replace("https://127.0.0.1:8443", server);
        for bad in ["http://127.0.0.1:8443", "127.0.0.1:8443", "https://", "https://h:1/path", "https://h:1?q"] {
            assert!(error(&with(bad)).starts_with("config line 1: server must be https://host:port"), "{bad}");
        }
        assert_eq!(parse(&with("https://h:1/")).unwrap().server, "https://h:1");
        assert!(
            error(&MINIMAL.replace("= r1\n", "= R1\n")).starts_with("config line 2: worker_id `R1` is not a worker id")
        );
    }

    #[test]
    fn missing_required_settings_are_named() {
        for key in ["server", "worker_id", "cert", "key", "ca"] {
            let text: String = MINIMAL.lines().filter(|l| !l.starts_with(key)).map(|l| format!("{l}\n")).collect();
            assert!(error(&text).starts_with(&format!("{key} is not set")), "{key}: {}", error(&text));
        }
    }

    #[test]
    fn flags_override_the_file_and_name_themselves_in_errors() {
        let mut s = Sources::parse(&format!("{MINIMAL}capacity = 2\n"), Path::new("/etc/ql")).unwrap();
        s.set_flag("--capacity", "capacity", "3").unwrap();
        s.set_flag("--state-dir", "state_dir", "rel/state").unwrap();
        s.set_pair("poll_wait_ms=100").unwrap();
        s.set_pair("label.zone = lab").unwrap();
        let c = s.finish().unwrap();
        assert_eq!(c.capacity, 3);
        assert_eq!(c.state_dir, PathBuf::from("rel/state"), "flag paths stay relative to the working directory");
        assert_eq!(c.poll_wait, Duration::from_millis(100));
        assert_eq!(c.labels.values().next().unwrap().as_str(), "lab");
        s.set_flag("--capacity", "capacity", "99").unwrap();
        assert_eq!(s.finish().unwrap_err().0, "--capacity: capacity must be 1..=64, not `99`");
        s.set_flag("--capacity", "capacity", "1").unwrap();
        s.set_pair("busy_poll_wait_ms=x").unwrap();
        assert_eq!(s.finish().unwrap_err().0, "--set busy_poll_wait_ms: busy_poll_wait_ms must be 0..=30000, not `x`");
        assert_eq!(s.set_pair("nonsense").unwrap_err().0, "--set nonsense: expected key=value");
        assert_eq!(s.set_pair("bogus=1").unwrap_err().0, "--set bogus: unknown setting `bogus`");
    }

    #[test]
    fn the_readme_documents_every_setting_with_its_default() {
        let readme = include_str!("../README.md");
        let section = &readme[readme.find("## ql-agent configuration").expect("the README section")..];
        for (key, default, _) in SETTINGS {
            let row =
                section.lines().find(|l| l.starts_with(&format!("| `{key}` |"))).unwrap_or_else(|| panic!("{key}"));
            let want = match default {
                None => "required".to_owned(),
                Some("") => "none".to_owned(),
                Some(d) => format!("`{d}`"),
            };
            assert!(row.contains(&format!("| {want} |")), "{key}: {row}");
        }
        assert!(section.contains("| `label.<name>` |"));
    }

    #[test]
    fn too_many_labels_are_refused() {
        let labels: String = (0..17).map(|i| format!("label.l{i} = v\n")).collect();
        assert_eq!(error(&format!("{MINIMAL}{labels}")), "at most 16 labels, not 17");
    }
}
