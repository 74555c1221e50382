//! The authority an operator command opens: the state directory's SQLite file (the same
//! file as `serve`; SQLite serialises the writers) or, with `--database postgres://...`,
//! the same PostgreSQL database as every replica; and what the operator typed for a run,
//! as the operator API's body. The commands themselves are [`crate::ops`].

use std::collections::BTreeMap;
use std::path::Path;

use ql_wire::ids::{RunId, WorkerId};

use crate::blob::any::Blobs;
use crate::config::{Config, Layout};
use crate::core::{Command, Reply};
use crate::ops::view::{NotifyBody, ScriptBody, SubmitBody};
use crate::store::postgres::{PgOptions, PgStore};
use crate::store::sqlite::SqliteStore;
use crate::store::{RunDetail, Snapshot, Store, StoreError};

/// What to run, as an operator describes it.
#[derive(Debug, Clone, Default)]
pub struct SubmitArgs {
    /// Project.
    pub project: String,
    /// A program and its arguments (exclusive with `script`).
    pub argv: Vec<String>,
    /// A script file (exclusive with `argv`).
    pub script: Option<std::path::PathBuf>,
    /// `sh`, `python3` or `node` (default `sh`).
    pub interpreter: Option<String>,
    /// `NAME=value` pairs.
    pub env: Vec<String>,
    /// Run time limit.
    pub timeout_ms: u64,
    /// Bytes of log kept.
    pub log_limit: u64,
    /// `key=value` labels the operator gave the worker (`ql-control label`).
    pub labels: Vec<String>,
    /// `key=value` labels the worker's agent declares.
    pub agent_labels: Vec<String>,
    /// Lost leases tolerated.
    pub retries: u32,
    /// A webhook URL told of the run's end.
    pub notify: Option<String>,
    /// `all` or `failure`: which ends the webhook is told of.
    pub notify_on: Option<String>,
}

fn pair(text: &str, what: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{what} {text:?} must look like NAME=value"))
}

/// The API's body of what the operator typed: the script file read here, on the machine
/// the command runs on; every rule of the run is checked by [`crate::ops::Local`].
pub fn body_of(args: &SubmitArgs) -> Result<SubmitBody, String> {
    let (argv, script) = match (&args.script, args.argv.is_empty()) {
        (Some(path), true) => {
            let source = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let interpreter = args.interpreter.clone().unwrap_or_else(|| "sh".into());
            (None, Some(ScriptBody { interpreter, source }))
        }
        (None, false) if args.interpreter.is_some() => {
            return Err("--interpreter runs a --script; a program after `--` runs as it is".into());
        }
        (None, false) => (Some(args.argv.clone()), None),
        (Some(_), false) => return Err("give either a program after `--` or --script, not both".into()),
        (None, true) => return Err("nothing to run: give a program after `--`, or --script FILE".into()),
    };
    let mut env = BTreeMap::new();
    for e in &args.env {
        let (k, v) = pair(e, "--env")?;
        env.insert(k, v);
    }
    let body = SubmitBody {
        project: args.project.clone(),
        argv,
        script,
        env,
        timeout_ms: args.timeout_ms,
        log_limit_bytes: args.log_limit,
        labels: labels_of(&args.labels, "--label")?,
        agent_labels: labels_of(&args.agent_labels, "--agent-label")?,
        retries: args.retries,
        notify: match (&args.notify, &args.notify_on) {
            (Some(url), on) => Some(NotifyBody { url: url.clone(), on: on.clone().unwrap_or_else(|| "all".into()) }),
            (None, Some(_)) => return Err("--notify-on goes with --notify URL".into()),
            (None, None) => None,
        },
    };
    // Refuse what could never run before anything is sent.
    crate::ops::local::submit_of(&body)?;
    Ok(body)
}

/// `key=value` words as labels, refusing any a worker could never carry.
pub fn labels_of(words: &[String], flag: &str) -> Result<BTreeMap<String, String>, String> {
    let labels = words.iter().map(|l| pair(l, flag)).collect::<Result<_, _>>()?;
    crate::core::check_labels(&labels).map_err(|e| format!("{flag}: {e}"))?;
    Ok(labels)
}

/// Opens the state directory's store with its configured timings.
pub fn open_store(dir: &Path) -> Result<(SqliteStore, Config), String> {
    let layout = Layout::new(dir);
    let config = Config::load(&layout)?;
    let store = SqliteStore::open(layout.database(), config.timings()).map_err(|e| e.to_string())?;
    Ok((store, config))
}

/// The authority an operator command talks to: the state directory's SQLite file (the
/// default) or a PostgreSQL database shared by replicas.
#[derive(Debug, Clone)]
pub enum Authority {
    /// `<dir>/control.db`.
    Sqlite(SqliteStore),
    /// `--database postgres://...`.
    Postgres(PgStore),
}

/// Forwards one [`Store`] method to whichever store is inside.
macro_rules! either {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            Authority::Sqlite($s) => $call.await,
            Authority::Postgres($s) => $call.await,
        }
    };
}

impl Store for Authority {
    async fn execute_audited(
        &self,
        cmd: Command,
        audit: Option<crate::store::Audit>,
    ) -> Result<Result<Reply, ql_wire::ErrorCode>, StoreError> {
        either!(self, s => s.execute_audited(cmd, audit))
    }
    async fn audit(&self, record: crate::model::AuditRecord) -> Result<(), StoreError> {
        either!(self, s => s.audit(record))
    }
    async fn admit(
        &self,
        record: crate::model::AuditRecord,
        serial: String,
    ) -> Result<Option<ql_wire::ErrorCode>, StoreError> {
        either!(self, s => s.admit(record, serial))
    }
    async fn prune_audit(&self, retention: crate::store::AuditRetention) -> Result<u64, StoreError> {
        either!(self, s => s.prune_audit(retention))
    }
    async fn prune_sessions(&self, retention: crate::store::SessionRetention) -> Result<u64, StoreError> {
        either!(self, s => s.prune_sessions(retention))
    }
    async fn prunable_runs(
        &self,
        retention: crate::store::RunRetention,
    ) -> Result<Vec<(ql_wire::ids::ProjectId, RunId)>, StoreError> {
        either!(self, s => s.prunable_runs(retention))
    }
    async fn prune_runs(&self, runs: Vec<RunId>, retention: crate::store::RunRetention) -> Result<u64, StoreError> {
        either!(self, s => s.prune_runs(runs, retention))
    }
    async fn certificates(
        &self,
        worker: Option<&WorkerId>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<crate::model::Certificate>, StoreError> {
        either!(self, s => s.certificates(worker, after, limit))
    }
    async fn twin_refusals(&self, within_ms: u64) -> Result<Vec<(WorkerId, u64)>, StoreError> {
        either!(self, s => s.twin_refusals(within_ms))
    }
    async fn audits(&self) -> Result<Vec<crate::model::AuditRecord>, StoreError> {
        either!(self, s => s.audits())
    }
    async fn runs(&self, query: &crate::store::RunQuery) -> Result<Vec<crate::model::Run>, StoreError> {
        either!(self, s => s.runs(query))
    }
    async fn schedules(&self) -> Result<Vec<crate::model::Schedule>, StoreError> {
        either!(self, s => s.schedules())
    }
    async fn fires(&self, schedule: &str, limit: usize) -> Result<Vec<crate::model::Fire>, StoreError> {
        either!(self, s => s.fires(schedule, limit))
    }
    async fn run_detail(&self, run: &RunId) -> Result<Option<RunDetail>, StoreError> {
        either!(self, s => s.run_detail(run))
    }
    async fn probe(&self) -> Result<(), StoreError> {
        either!(self, s => s.probe())
    }
    async fn stats(&self) -> Result<Vec<crate::store::Stat>, StoreError> {
        either!(self, s => s.stats())
    }
    async fn operators(&self) -> Result<Vec<crate::model::Operator>, StoreError> {
        either!(self, s => s.operators())
    }
    async fn worker_page(
        &self,
        after: Option<&WorkerId>,
        limit: usize,
    ) -> Result<Vec<crate::store::WorkerEntry>, StoreError> {
        either!(self, s => s.worker_page(after, limit))
    }
    async fn log_chunks(
        &self,
        attempt: &ql_wire::ids::AttemptId,
        within: std::ops::Range<u64>,
    ) -> Result<Vec<crate::model::LogChunk>, StoreError> {
        either!(self, s => s.log_chunks(attempt, within))
    }
    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        either!(self, s => s.snapshot())
    }
    fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        match self {
            Authority::Sqlite(s) => s.changes(),
            Authority::Postgres(s) => s.changes(),
        }
    }
    fn wakes_since(&self, seen: u64, now: u64) -> Option<Vec<crate::core::Want>> {
        match self {
            Authority::Sqlite(s) => s.wakes_since(seen, now),
            Authority::Postgres(s) => s.wakes_since(seen, now),
        }
    }
    fn commit_groups(&self) -> Option<crate::store::postgres::GroupCommits> {
        match self {
            Authority::Sqlite(s) => s.commit_groups(),
            Authority::Postgres(s) => s.commit_groups(),
        }
    }
}

/// Whether `database` names a PostgreSQL database (a `postgres://` or `postgresql://`
/// URL, or libpq `key=value` settings).
pub fn is_postgres(database: &str) -> bool {
    database.starts_with("postgres://") || database.starts_with("postgresql://") || database.contains('=')
}

/// Opens the authority: PostgreSQL when `database` is given, else the state directory's
/// SQLite file. Call inside the Tokio runtime that will use the store.
pub async fn open_authority(dir: &Path, database: Option<&str>) -> Result<(Authority, Config), String> {
    match database {
        None => open_store(dir).map(|(s, c)| (Authority::Sqlite(s), c)),
        Some(url) if is_postgres(url) => {
            // The operator commands need no state directory besides control.json's
            // timings; without one, the defaults.
            let layout = Layout::new(dir);
            let config = if layout.config().exists() { Config::load(&layout)? } else { Config::default() };
            let options = PgOptions { timings: config.timings(), pool_size: 2, ..PgOptions::default() };
            let store = PgStore::open(url, options).await.map_err(|e| e.to_string())?;
            Ok((Authority::Postgres(store), config))
        }
        Some(_) => Err("--database takes a postgres://... URL (SQLite is the state directory's default)".to_owned()),
    }
}

/// The artifact store `chosen` names, else the one the state directory's settings name
/// (or `$QL_CONTROL_ARTIFACTS`), for reading logs; nothing is created.
pub fn open_blobs(dir: &Path, chosen: Option<&str>) -> Result<Blobs, String> {
    let layout = Layout::new(dir);
    let config = if layout.config().exists() { Config::load(&layout)? } else { Config::default() };
    Blobs::open(&layout, &config, chosen, false)
}
