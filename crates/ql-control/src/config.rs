//! The control plane's settings: `<dir>/control.json`, written by `init` with every
//! default spelled out so an operator sees what can be tuned. Every duration is here, so
//! tests and small deployments can shorten them.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::core::Timings;

/// Everything `serve` needs besides the PKI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields, default)]
pub struct Config {
    /// Address the HTTPS ingress binds (`--listen` overrides it).
    pub listen: String,
    /// Where artifacts live: empty for `<dir>/artifacts`, or `s3://bucket/prefix` for a
    /// bucket every replica shares (`--artifacts` and `$QL_CONTROL_ARTIFACTS` override it).
    pub artifacts: String,
    /// The S3 endpoint, `http(s)://host[:port]` (`$AWS_ENDPOINT_URL_S3` and
    /// `$AWS_ENDPOINT_URL` override it; empty: AWS's own for `s3_region`).
    pub s3_endpoint: String,
    /// The S3 signing region (`$AWS_REGION` and `$AWS_DEFAULT_REGION` override it).
    pub s3_region: String,
    /// `path`, `virtual` (bucket in the host name) or `auto`: path-style for an
    /// endpoint of your own (MinIO, Garage, s3s), virtual-hosted for AWS.
    pub s3_addressing: String,
    /// The AWS credentials file read when `$AWS_ACCESS_KEY_ID` is not set (empty:
    /// `$AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/credentials`); it must be 0600.
    pub s3_credentials_file: String,
    /// CA certificates trusted for an `https://` S3 endpoint.
    pub s3_ca_file: String,
    /// One S3 request (or the next piece of a streamed upload) within this.
    pub s3_timeout_ms: u64,
    /// Objects one listing of the bucket asks for (S3 answers at most 1,000).
    pub s3_list_page: u32,
    /// Address the operator API binds (`--operator-listen` overrides it; empty: none).
    pub operator_listen: String,
    /// Operator API connections served at once.
    pub operator_max_connections: u64,
    /// Of those, how many one address (an IPv6 peer's /64) holds: one peer cannot keep
    /// the operators out.
    pub operator_max_connections_per_ip: u64,
    /// The longest wait of an operator API log follow (`waitMs`).
    pub operator_log_wait_ms: u64,
    /// How long a dashboard sign-in lasts.
    pub dashboard_session_ms: u64,
    /// The key dashboard sessions are signed with, made at the first `serve` when absent;
    /// relative to the state directory. Replicas share it; nobody else needs it.
    pub dashboard_secret_file: String,
    /// An operator API or dashboard request body must arrive within this of its head.
    pub operator_body_timeout_ms: u64,
    /// The key webhook bodies are signed with (HMAC-SHA256), made at the first `serve`
    /// when absent; relative to the state directory. Replicas share it.
    pub webhook_secret_file: String,
    /// CA certificates trusted for `https://` webhooks.
    pub webhook_ca_file: String,
    /// One webhook send may take this long.
    pub webhook_timeout_ms: u64,
    /// How often the notifier looks for deliveries due.
    pub webhook_poll_ms: u64,
    /// Sends tried before a delivery is `failed`.
    pub webhook_max_attempts: u64,
    /// The wait after a first failed send; it doubles with each further one.
    pub webhook_backoff_ms: u64,
    /// The longest wait between two sends.
    pub webhook_backoff_max_ms: u64,
    /// How often agents heartbeat.
    pub heartbeat_ms: u64,
    /// A session lapses after this long without a heartbeat or poll.
    pub session_ttl_ms: u64,
    /// An offer lapses after this long unclaimed.
    pub offer_ttl_ms: u64,
    /// A lease lapses after this long without renewal.
    pub lease_ttl_ms: u64,
    /// How often the sweeper looks for lapsed rows.
    pub sweep_interval_ms: u64,
    /// No replica sweeping for longer than this is an outage: the next sweep gives its
    /// time back to live leases and sessions (longer than `sweep_interval_ms`).
    pub outage_grace_after_ms: u64,
    /// A worker's online session seen within this is not taken over by another agent
    /// with the same identity (0: a new session always replaces the old).
    pub session_takeover_after_ms: u64,
    /// How often the server notices work submitted by another process.
    pub change_poll_ms: u64,
    /// SQLite group commit: how long, in microseconds, a batch of commands may wait for
    /// more while many callers are concurrent (0: commit what is queued at once).
    pub commit_window_us: u64,
    /// SQLite group commit: the batch size from which `commit_window_us` applies; fewer
    /// concurrent callers never wait.
    pub commit_window_min_batch: u64,
    /// SQLite: how long a commit that changed nothing but a session's liveness (an idle
    /// poll, a plain heartbeat) or only audit records (a refusal) may wait for its fsync;
    /// any commit that decides something syncs it at once (0: every commit syncs before
    /// its answer). Shorter than `session_ttl_ms - heartbeat_ms`.
    pub lazy_sync_ms: u64,
    /// SQLite: while callers keep coming, how many batches commit one after another before
    /// the one sync their answers wait for (1: every batch syncs on its own).
    pub sync_hold_batches: u64,
    /// SQLite: right after a batch of idle agents' polls and heartbeats, how long the next
    /// batch gathers before it begins, so they share a commit (0: at once).
    pub idle_batch_window_ms: u64,
    /// SQLite: how often a thread of its own checkpoints the WAL into the database file
    /// while the writer goes on committing (0: the writer checkpoints inside its commits,
    /// as SQLite does by default).
    pub checkpoint_ms: u64,
    /// SQLite: WAL pages after which the writer checkpoints inside a commit; with
    /// `checkpoint_ms` set, a backstop that bounds the WAL.
    pub wal_autocheckpoint_pages: u64,
    /// Threads that serve connections (TLS, HTTP), beside the SQLite writer's own; 0: the
    /// store's ([`serving_threads`](crate::serve::serving_threads)). Every hand-off between
    /// threads is a wake-up: on SQLite, one thread made an idle fleet of 10,000 cost 40 %
    /// less CPU than two (bench/RESULTS.md). One is the main thread, on tokio's
    /// current-thread scheduler: a multi-thread runtime's one worker wakes its own I/O
    /// driver for every task an I/O event wakes.
    pub runtime_threads: u64,
    /// PostgreSQL (`serve --database`): most connections this replica holds to the
    /// database, beside its LISTEN connection; commands beyond wait for one.
    pub pg_pool_size: u64,
    /// PostgreSQL: lanes of group commit. A command about a worker session goes to a
    /// lane, which runs the commands waiting on it in one transaction (one commit for
    /// many concurrent agents); 0 runs every command in a transaction of its own. At
    /// most `pg_pool_size`.
    pub pg_lanes: u64,
    /// PostgreSQL: commands in flight a lane takes before the next lane takes any. The
    /// fewer groups carry the same commands, the less each costs the database, but a
    /// lane runs one group at a time: a few agents share one lane, more spread over all.
    pub pg_lane_fill: u64,
    /// PostgreSQL: most commands one lane's transaction takes.
    pub pg_batch_max: u64,
    /// PostgreSQL: how long, in microseconds, a lane's next group may wait for one
    /// command from each agent of its last two groups (0: run what is queued at once; a
    /// lone agent never waits).
    pub pg_lane_window_us: u64,
    /// PostgreSQL: most statements each connection keeps prepared (past it, its cache
    /// starts over).
    pub pg_prepared_max: u64,
    /// Longest wait for the next piece of a request body.
    pub read_timeout_ms: u64,
    /// A request head must be complete this long after its first byte.
    pub header_timeout_ms: u64,
    /// Idle keep-alive connections (no byte of a next request) are closed after this long;
    /// longer than `heartbeat_ms`.
    pub idle_timeout_ms: u64,
    /// The TLS handshake must finish within this.
    pub handshake_timeout_ms: u64,
    /// Connections served at once, after their handshake.
    pub max_connections: u64,
    /// TLS handshakes in progress at once.
    pub max_handshakes: u64,
    /// TLS handshakes in progress at once from one IP address (an IPv6 peer's /64).
    pub max_handshakes_per_ip: u64,
    /// Connections one worker may hold; a further one closes its oldest on the same
    /// certificate, else its oldest never admitted, else its oldest.
    pub max_connections_per_worker: u64,
    /// The largest request head, in bytes (at least 1024).
    pub max_header_bytes: u64,
    /// A request body may take this long plus its length at `min_upload_rate`.
    pub upload_grace_ms: u64,
    /// The slowest average pace of a request body, in bytes a second.
    pub min_upload_rate: u64,
    /// At most one line per this about failed TLS handshakes, and one about connections
    /// turned away at a limit.
    pub refusal_report_ms: u64,
    /// Audit records older than this are pruned by the sweeper (0: kept at any age).
    pub audit_max_age_ms: u64,
    /// The sweeper keeps at most this many audit records, the newest (0: any number).
    pub audit_max_records: u64,
    /// Of a worker's ended sessions never offered any work, only those among its newest
    /// this many generations stay; the sweeper prunes the others (at least 1: the newest
    /// always stays).
    pub ended_sessions_kept: u64,
    /// The most sessions one sweep prunes (0: none).
    pub session_prune_batch: u64,
    /// How long an ended run stays, with its attempts, events and stored log, from when it
    /// ended (0: for ever). The sweeper removes the oldest first, and none whose webhook
    /// is still waiting to be delivered.
    pub run_retention_ms: u64,
    /// The most ended runs removed in one sweep (0: none).
    pub run_prune_batch: u64,
    /// How often the artifact store is searched for what uploads that never completed
    /// left, and for live-log chunks of recorded logs (0: never).
    pub artifact_collect_ms: u64,
    /// Such a leftover or chunk goes once it is this old; longer than any upload can take.
    pub artifact_leftover_age_ms: u64,
    /// How many attempts that ended without recording their log, whose chunks are its log
    /// for good, the collection remembers so that it asks the database about each once
    /// per process rather than every pass (0: none; past it, the rest every pass).
    pub artifact_collect_remember: u64,
    /// How long a worker certificate is valid; its agent renews it when about two thirds
    /// of that has passed.
    pub worker_cert_lifetime_ms: u64,
    /// A worker renews its certificate at most once in this long, or in a sixth of the
    /// lifetime if that is shorter (0: no limit).
    pub worker_renew_interval_ms: u64,
    /// How long a one-time enrolment token (`enroll --token`) can be used.
    pub enrolment_token_ttl_ms: u64,
    /// Concurrent connections without a client certificate (agents enrolling with a
    /// token); each is served one request (0: none, no enrolment over the network).
    pub max_anonymous_connections: u64,
    /// Of those, how many one address may hold (an IPv6 peer's /64).
    pub max_anonymous_connections_per_ip: u64,
    /// A schedule's fire found later than this after its time (no replica was running)
    /// is a missed one, which follows the schedule's `--catch-up`.
    pub schedule_missed_after_ms: u64,
    /// How long `/metrics` reuses the database's figures (runs, attempts, sessions,
    /// leases, fires and deliveries by state, counted over whole tables) before a scrape
    /// reads them again (0: every scrape).
    pub metrics_stats_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        let t = Timings::default();
        Self {
            listen: "0.0.0.0:8443".into(),
            artifacts: String::new(),
            s3_endpoint: String::new(),
            s3_region: String::new(),
            s3_addressing: "auto".into(),
            s3_credentials_file: String::new(),
            s3_ca_file: "/etc/ssl/certs/ca-certificates.crt".into(),
            s3_timeout_ms: 30_000,
            s3_list_page: 1_000,
            operator_listen: "127.0.0.1:8444".into(),
            operator_max_connections: 64,
            operator_max_connections_per_ip: 16,
            operator_log_wait_ms: 25_000,
            dashboard_session_ms: 12 * 3_600_000,
            dashboard_secret_file: "dashboard.key".into(),
            operator_body_timeout_ms: 10_000,
            webhook_secret_file: "webhook.key".into(),
            webhook_ca_file: "/etc/ssl/certs/ca-certificates.crt".into(),
            webhook_timeout_ms: 10_000,
            webhook_poll_ms: 1_000,
            webhook_max_attempts: 5,
            webhook_backoff_ms: 2_000,
            webhook_backoff_max_ms: 300_000,
            heartbeat_ms: t.heartbeat_ms,
            session_ttl_ms: t.session_ttl_ms,
            offer_ttl_ms: t.offer_ttl_ms,
            lease_ttl_ms: t.lease_ttl_ms,
            sweep_interval_ms: 1_000,
            outage_grace_after_ms: t.outage_after_ms,
            session_takeover_after_ms: t.takeover_after_ms,
            change_poll_ms: 250,
            commit_window_us: 1_000,
            commit_window_min_batch: crate::store::sqlite::COMMIT_WINDOW_MIN_BATCH as u64,
            lazy_sync_ms: 1_000,
            sync_hold_batches: 1,
            idle_batch_window_ms: 10,
            checkpoint_ms: 1_000,
            wal_autocheckpoint_pages: u64::from(crate::store::sqlite::WAL_BACKSTOP_PAGES),
            runtime_threads: 0,
            pg_pool_size: 16,
            pg_lanes: 4,
            pg_lane_fill: 16,
            pg_batch_max: 32,
            pg_lane_window_us: 1_000,
            pg_prepared_max: 512,
            read_timeout_ms: 60_000,
            header_timeout_ms: 10_000,
            idle_timeout_ms: 300_000,
            handshake_timeout_ms: 5_000,
            max_connections: 1024,
            max_handshakes: 256,
            max_handshakes_per_ip: 32,
            max_connections_per_worker: 4,
            max_header_bytes: 8 * 1024,
            upload_grace_ms: 30_000,
            min_upload_rate: 4096,
            refusal_report_ms: 10_000,
            audit_max_age_ms: 30 * 24 * 3_600_000,
            audit_max_records: 1_000_000,
            ended_sessions_kept: 16,
            session_prune_batch: 1_000,
            run_retention_ms: 30 * 24 * 3_600_000,
            run_prune_batch: 100,
            artifact_collect_ms: 6 * 3_600_000,
            artifact_leftover_age_ms: 24 * 3_600_000,
            artifact_collect_remember: 100_000,
            worker_cert_lifetime_ms: crate::pki::WORKER_VALIDITY.as_millis() as u64,
            worker_renew_interval_ms: t.renew_interval_ms,
            enrolment_token_ttl_ms: 3_600_000,
            max_anonymous_connections: 16,
            max_anonymous_connections_per_ip: 4,
            schedule_missed_after_ms: 60_000,
            metrics_stats_ms: 10_000,
        }
    }
}

/// Where things live in a state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The directory.
    pub dir: PathBuf,
}

impl Layout {
    /// The layout of `dir`.
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf() }
    }

    /// The settings file.
    pub fn config(&self) -> PathBuf {
        self.dir.join("control.json")
    }

    /// The SQLite database.
    pub fn database(&self) -> PathBuf {
        self.dir.join("control.db")
    }

    /// The local artifact store.
    pub fn artifacts(&self) -> PathBuf {
        self.dir.join("artifacts")
    }

    /// Refuses a state directory that someone else could change: the directory, its
    /// settings, its database and its artifact store must belong to this process's user
    /// and be writable by nobody else. Otherwise a local user could swap in a database
    /// whose runs every worker then executes, or settings that disarm the leases.
    pub fn check_private(&self) -> Result<(), String> {
        use std::os::unix::fs::MetadataExt as _;
        // This process's effective user, as Linux shows it: the owner of /proc/self.
        let me = std::fs::metadata("/proc/self").map_err(|e| format!("/proc/self: {e}"))?.uid();
        for path in [self.dir.clone(), self.config(), self.database(), self.artifacts()] {
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(meta) => meta,
                // What does not exist yet is made private when it is made.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(format!("{}: {e}", path.display())),
            };
            if meta.uid() != me {
                return Err(format!(
                    "{} belongs to user {}, not to this user ({me}): refusing a state directory another user controls",
                    path.display(),
                    meta.uid()
                ));
            }
            if meta.mode() & 0o022 != 0 {
                return Err(format!(
                    "{} is writable by {} (mode {:o}): refusing a state directory others can change; \
                     `chmod go-w {}` if that is not meant",
                    path.display(),
                    if meta.mode() & 0o002 != 0 { "everyone" } else { "its group" },
                    meta.mode() & 0o7777,
                    path.display()
                ));
            }
        }
        Ok(())
    }
}

impl Config {
    /// The protocol durations.
    pub fn timings(&self) -> Timings {
        Timings {
            heartbeat_ms: self.heartbeat_ms,
            session_ttl_ms: self.session_ttl_ms,
            offer_ttl_ms: self.offer_ttl_ms,
            lease_ttl_ms: self.lease_ttl_ms,
            outage_after_ms: self.outage_grace_after_ms,
            takeover_after_ms: self.session_takeover_after_ms,
            missed_after_ms: self.schedule_missed_after_ms,
            renew_interval_ms: self.worker_renew_interval_ms,
        }
    }

    /// How webhook deliveries are claimed and retried: a claim outlasts three sends.
    pub fn delivery_policy(&self) -> crate::core::DeliveryPolicy {
        crate::core::DeliveryPolicy {
            claim_ms: self.webhook_timeout_ms.saturating_mul(3),
            max_attempts: u32::try_from(self.webhook_max_attempts).unwrap_or(u32::MAX),
            backoff_ms: self.webhook_backoff_ms,
            backoff_max_ms: self.webhook_backoff_max_ms.max(self.webhook_backoff_ms),
            ..crate::core::DeliveryPolicy::default()
        }
    }

    /// How long a worker certificate is valid.
    pub fn worker_cert_lifetime(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.worker_cert_lifetime_ms)
    }

    /// The longest an upload can last, from its first byte to its receipt.
    pub fn longest_upload_ms(&self) -> u64 {
        let content = ql_wire::limits::ARTIFACT_CONTENT_MAX.saturating_mul(1_000) / self.min_upload_rate.max(1);
        self.upload_grace_ms.saturating_add(content).saturating_add(self.s3_timeout_ms)
    }

    /// What the sweeper keeps of the audit records.
    pub fn audit_retention(&self) -> crate::store::AuditRetention {
        let bound = |n: u64| (n > 0).then_some(n);
        crate::store::AuditRetention {
            max_age_ms: bound(self.audit_max_age_ms),
            max_records: bound(self.audit_max_records),
        }
    }

    /// What the sweeper keeps of the ended sessions.
    pub fn session_retention(&self) -> crate::store::SessionRetention {
        crate::store::SessionRetention { kept: self.ended_sessions_kept, batch: self.session_prune_batch }
    }

    /// What the sweeper keeps of the ended runs: `None` keeps them all.
    pub fn run_retention(&self) -> Option<crate::store::RunRetention> {
        (self.run_retention_ms > 0 && self.run_prune_batch > 0)
            .then_some(crate::store::RunRetention { max_age_ms: self.run_retention_ms, batch: self.run_prune_batch })
    }

    /// Refuses settings that cannot work together.
    pub fn check(&self) -> Result<(), String> {
        let positive = [
            ("heartbeat_ms", self.heartbeat_ms),
            ("session_ttl_ms", self.session_ttl_ms),
            ("offer_ttl_ms", self.offer_ttl_ms),
            ("lease_ttl_ms", self.lease_ttl_ms),
            ("sweep_interval_ms", self.sweep_interval_ms),
            ("change_poll_ms", self.change_poll_ms),
            ("read_timeout_ms", self.read_timeout_ms),
            ("header_timeout_ms", self.header_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("max_connections", self.max_connections),
            ("pg_pool_size", self.pg_pool_size),
            ("pg_batch_max", self.pg_batch_max),
            ("pg_lane_fill", self.pg_lane_fill),
            ("pg_prepared_max", self.pg_prepared_max),
            ("sync_hold_batches", self.sync_hold_batches),
            ("wal_autocheckpoint_pages", self.wal_autocheckpoint_pages),
            ("max_handshakes", self.max_handshakes),
            ("max_handshakes_per_ip", self.max_handshakes_per_ip),
            ("max_anonymous_connections_per_ip", self.max_anonymous_connections_per_ip),
            ("max_connections_per_worker", self.max_connections_per_worker),
            ("min_upload_rate", self.min_upload_rate),
            ("worker_cert_lifetime_ms", self.worker_cert_lifetime_ms),
            ("enrolment_token_ttl_ms", self.enrolment_token_ttl_ms),
            ("schedule_missed_after_ms", self.schedule_missed_after_ms),
            ("operator_max_connections", self.operator_max_connections),
            ("operator_max_connections_per_ip", self.operator_max_connections_per_ip),
            ("webhook_timeout_ms", self.webhook_timeout_ms),
            ("operator_body_timeout_ms", self.operator_body_timeout_ms),
            ("dashboard_session_ms", self.dashboard_session_ms),
            ("webhook_poll_ms", self.webhook_poll_ms),
            ("webhook_max_attempts", self.webhook_max_attempts),
            ("s3_timeout_ms", self.s3_timeout_ms),
            ("s3_list_page", u64::from(self.s3_list_page)),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be greater than 0"));
        }
        if self.pg_lanes > self.pg_pool_size {
            return Err("pg_lanes must be at most pg_pool_size: each lane's transaction holds a connection".into());
        }
        if !["auto", "path", "virtual"].contains(&self.s3_addressing.as_str()) {
            return Err(format!("s3_addressing is {:?}: it is auto, path or virtual", self.s3_addressing));
        }
        if !self.artifacts.is_empty() {
            crate::blob::s3::parse_url(&self.artifacts).map_err(|e| format!("artifacts: {e}"))?;
        }
        if self.max_header_bytes < 1024 {
            return Err("max_header_bytes must be at least 1024".into());
        }
        if self.commit_window_min_batch < 2 {
            return Err("commit_window_min_batch must be at least 2: a lone caller never waits for others".into());
        }
        if i32::try_from(self.wal_autocheckpoint_pages).is_err() {
            return Err(format!("wal_autocheckpoint_pages must be at most {}", i32::MAX));
        }
        if self.heartbeat_ms >= self.session_ttl_ms {
            return Err("heartbeat_ms must be shorter than session_ttl_ms, or every session lapses".into());
        }
        if self.lazy_sync_ms >= self.session_ttl_ms - self.heartbeat_ms {
            return Err("lazy_sync_ms must be shorter than session_ttl_ms - heartbeat_ms: a power cut may take back that much of a session's life".into());
        }
        // Without a collection the age bounds nothing.
        if self.artifact_collect_ms > 0 && self.artifact_leftover_age_ms < self.longest_upload_ms() {
            return Err(format!(
                "artifact_leftover_age_ms must be at least {} ms: an upload may take upload_grace_ms plus 64 MiB at \
                 min_upload_rate, and its receipt s3_timeout_ms more, and what it wrote must not be taken for a leftover",
                self.longest_upload_ms()
            ));
        }
        // An upload or a chunk admitted before its run ended may still be writing: its
        // run's place must outlive it, or its files would outlive the run's rows.
        if self.run_retention_ms > 0 && self.run_retention_ms < self.longest_upload_ms() {
            return Err(format!(
                "run_retention_ms must be at least {} ms (or 0: for ever): an upload admitted before its run ended \
                 may take upload_grace_ms plus 64 MiB at min_upload_rate, and its receipt s3_timeout_ms more",
                self.longest_upload_ms()
            ));
        }
        if self.outage_grace_after_ms <= self.sweep_interval_ms {
            return Err(
                "outage_grace_after_ms must be longer than sweep_interval_ms, or every sweep finds an outage".into()
            );
        }
        if self.session_takeover_after_ms != 0 && self.session_takeover_after_ms < 2 * self.heartbeat_ms {
            return Err("session_takeover_after_ms must be 0 or at least twice heartbeat_ms, or an agent between two \
                 heartbeats could be taken over"
                .into());
        }
        if self.idle_timeout_ms <= self.heartbeat_ms {
            return Err(
                "idle_timeout_ms must be longer than heartbeat_ms, or an agent's connection is closed between its requests"
                    .into(),
            );
        }
        Ok(())
    }

    /// Reads `<dir>/control.json`, once the state directory proved private.
    pub fn load(layout: &Layout) -> Result<Self, String> {
        layout.check_private()?;
        let path = layout.config();
        let text = std::fs::read(&path).map_err(|e| {
            format!("{}: {e} (run `ql-control init --dir {}` first)", path.display(), layout.dir.display())
        })?;
        let config: Self = serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        config.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(config)
    }

    /// Writes the settings as pretty JSON, readable and writable by the owner only
    /// (whatever the umask).
    pub fn save(&self, layout: &Layout) -> Result<(), String> {
        use std::io::Write as _;
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let mut text = serde_json::to_vec_pretty(self).expect("settings serialise");
        text.push(b'\n');
        let path = layout.config();
        let fail = |e: std::io::Error| format!("{}: {e}", path.display());
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(fail)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(fail)?;
        file.write_all(&text).map_err(fail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_consistent_and_round_trip() {
        let c = Config::default();
        assert_eq!(c.check(), Ok(()));
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<Config>(&json).unwrap(), c);
    }

    #[test]
    fn missing_keys_take_defaults_and_unknown_keys_are_refused() {
        let c: Config = serde_json::from_str(r#"{"lease_ttl_ms": 900}"#).unwrap();
        assert_eq!(c.lease_ttl_ms, 900);
        assert_eq!(c.heartbeat_ms, Config::default().heartbeat_ms);
        assert!(serde_json::from_str::<Config>(r#"{"lease_ttl": 900}"#).is_err());
    }

    #[test]
    fn refuses_zero_durations_and_a_heartbeat_longer_than_the_session() {
        let c = Config { artifact_leftover_age_ms: 3_600_000, ..Config::default() };
        assert!(c.check().unwrap_err().contains("artifact_leftover_age_ms"), "under the slowest 64 MiB upload");
        let c = Config { run_retention_ms: 3_600_000, ..Config::default() };
        assert!(c.check().unwrap_err().contains("run_retention_ms"), "a run gone before its slowest upload");
        assert!(Config { run_retention_ms: 0, ..Config::default() }.check().is_ok(), "0: for ever");
        let c = Config { artifact_leftover_age_ms: 3_600_000, min_upload_rate: 1 << 20, ..Config::default() };
        assert_eq!(c.check(), Ok(()), "a faster floor allows an hour");
        let c = Config { artifact_leftover_age_ms: 3_600_000, artifact_collect_ms: 0, ..Config::default() };
        assert_eq!(c.check(), Ok(()), "no collection, no bound");
        let c = Config { sweep_interval_ms: 0, ..Config::default() };
        assert!(c.check().unwrap_err().contains("sweep_interval_ms"));
        let c = Config { heartbeat_ms: 5_000, session_ttl_ms: 5_000, ..Config::default() };
        assert!(c.check().unwrap_err().contains("heartbeat_ms"));
        let c = Config { idle_timeout_ms: 10_000, ..Config::default() };
        assert!(c.check().unwrap_err().contains("idle_timeout_ms"));
    }

    #[test]
    fn refuses_group_commit_settings_that_cannot_work() {
        // Zero would turn the backstop off, leaving the WAL unbounded should the
        // checkpoint thread fall behind; SQLite takes a page count that fits an `int`.
        for pages in [0, 1 << 31] {
            let c = Config { wal_autocheckpoint_pages: pages, ..Config::default() };
            assert!(c.check().unwrap_err().contains("wal_autocheckpoint_pages"), "{pages}");
        }
        let c = Config { commit_window_min_batch: 1, ..Config::default() };
        assert!(c.check().unwrap_err().contains("commit_window_min_batch"));
        let c = Config { checkpoint_ms: 0, ..Config::default() };
        assert_eq!(c.check(), Ok(()), "no checkpoint thread: the writer checkpoints as SQLite does");
        // PostgreSQL: each lane's transaction holds a pooled connection while it runs.
        let c = Config { pg_lanes: 17, pg_pool_size: 16, ..Config::default() };
        assert!(c.check().unwrap_err().contains("pg_lanes"));
        for name in ["pg_batch_max", "pg_lane_fill", "pg_prepared_max"] {
            let c = match name {
                "pg_batch_max" => Config { pg_batch_max: 0, ..Config::default() },
                "pg_lane_fill" => Config { pg_lane_fill: 0, ..Config::default() },
                _ => Config { pg_prepared_max: 0, ..Config::default() },
            };
            assert!(c.check().unwrap_err().contains(name), "{name}");
        }
        let c = Config { pg_lanes: 0, ..Config::default() };
        assert_eq!(c.check(), Ok(()), "no lanes: every command in a transaction of its own");
    }
}
