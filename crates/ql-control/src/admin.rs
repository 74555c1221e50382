//! Operator commands against a state directory: submit, cancel, runs, show, logs and
//! workers. They open the same SQLite file as `serve` (SQLite serialises the writers) —
//! or, with `--database postgres://...`, the same PostgreSQL database as every replica —
//! and go through the same decision code, so an operator can never break a protocol rule.

use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

use ql_wire::ids::{ProjectId, RunId, WorkerId};
use ql_wire::spec::{EnvName, ExecutionSpec, Interpreter, Script, SpecSchema};
use ql_wire::time::Timestamp;

use crate::blob::fs::FsBlobStore;

use crate::config::{Config, Layout};
use crate::core::{CancelOutcome, Command, Reply, Submit};
use crate::model::{Attempt, Millis};
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
    /// `key=value` labels the operator gave the worker ([`label_worker`]).
    pub labels: Vec<String>,
    /// `key=value` labels the worker's agent declares.
    pub agent_labels: Vec<String>,
    /// Lost leases tolerated.
    pub retries: u32,
}

fn pair(text: &str, what: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{what} {text:?} must look like NAME=value"))
}

/// Builds the run request, refusing what the protocol would refuse.
pub fn submit_request(args: &SubmitArgs) -> Result<Submit, String> {
    let project = ProjectId::parse(args.project.as_str()).map_err(|e| format!("project {:?}: {e}", args.project))?;
    let (argv, script) = match (&args.script, args.argv.is_empty()) {
        (Some(path), true) => {
            let source = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let interpreter = match args.interpreter.as_deref().unwrap_or("sh") {
                "sh" => Interpreter::Sh,
                "python3" => Interpreter::Python3,
                "node" => Interpreter::Node,
                other => return Err(format!("interpreter {other:?}: use sh, python3 or node")),
            };
            (None, Some(Script { interpreter, source }))
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
        env.insert(EnvName::parse(k.as_str()).map_err(|e| format!("--env {k:?}: {e}"))?, v);
    }
    let labels = labels_of(&args.labels, "--label")?;
    let agent_labels = labels_of(&args.agent_labels, "--agent-label")?;
    let spec = ExecutionSpec {
        schema: SpecSchema,
        project_id: project.clone(),
        argv,
        script,
        env,
        timeout_ms: args.timeout_ms,
        log_limit_bytes: args.log_limit,
    };
    spec.validate().map_err(|e| format!("the run is out of bounds: {e}"))?;
    Ok(Submit { project, spec, labels, agent_labels, retry_budget: args.retries })
}

/// `key=value` words as labels, refusing any a worker could never carry.
pub fn labels_of(words: &[String], flag: &str) -> Result<BTreeMap<String, String>, String> {
    let labels = words.iter().map(|l| pair(l, flag)).collect::<Result<_, _>>()?;
    crate::core::check_labels(&labels).map_err(|e| format!("{flag}: {e}"))?;
    Ok(labels)
}

/// Sets the labels the operator vouches for of `worker` (all of them; none clears them)
/// and says what it now carries.
pub async fn label_worker<S: Store>(store: &S, worker: &WorkerId, words: &[String]) -> Result<String, String> {
    let labels = labels_of(words, "label")?;
    match execute(store, Command::LabelWorker(worker.clone(), labels)).await? {
        Reply::WorkerLabelled(w) => Ok(format!("{}: {}", w.id.as_str(), label_list(&w.labels))),
        other => Err(format!("unexpected answer {other:?}")),
    }
}

/// Labels as `k=v,k=v`, or `-` for none.
fn label_list(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "-".into();
    }
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
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
    async fn execute(&self, cmd: Command) -> Result<Result<Reply, ql_wire::ErrorCode>, StoreError> {
        either!(self, s => s.execute(cmd))
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
    async fn certificates(&self, limit: usize) -> Result<Vec<crate::model::Certificate>, StoreError> {
        either!(self, s => s.certificates(limit))
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
    async fn sessions(&self, limit: usize) -> Result<Vec<crate::model::Session>, StoreError> {
        either!(self, s => s.sessions(limit))
    }
    async fn workers(&self, limit: usize) -> Result<Vec<crate::model::Worker>, StoreError> {
        either!(self, s => s.workers(limit))
    }
    async fn log_chunks(&self, attempt: &ql_wire::ids::AttemptId) -> Result<Vec<crate::model::LogChunk>, StoreError> {
        either!(self, s => s.log_chunks(attempt))
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

/// Opens the state directory's artifact store.
pub fn open_blobs(dir: &Path) -> Result<FsBlobStore, String> {
    FsBlobStore::open(Layout::new(dir).artifacts()).map_err(|e| e.to_string())
}

async fn execute<S: Store>(store: &S, cmd: Command) -> Result<Reply, String> {
    match store.execute(cmd).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(code)) => Err(format!("refused: {code}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Queues a run and returns its id.
pub async fn submit<S: Store>(store: &S, args: &SubmitArgs) -> Result<RunId, String> {
    match execute(store, Command::Submit(submit_request(args)?)).await? {
        Reply::Submitted(id) => Ok(id),
        other => Err(format!("unexpected answer {other:?}")),
    }
}

/// Cancels a run and says what happened.
pub async fn cancel<S: Store>(store: &S, run: &RunId) -> Result<String, String> {
    match execute(store, Command::Cancel(run.clone())).await {
        Ok(Reply::Cancelled(CancelOutcome::Cancelled)) => Ok(format!("{run} cancelled")),
        Ok(Reply::Cancelled(CancelOutcome::StopRequested)) => {
            Ok(format!("{run}: stop requested; the worker stops it at its next lease renewal"))
        }
        Ok(Reply::Cancelled(CancelOutcome::AlreadyEnded(status))) => Ok(format!("{run} had already ended: {status}")),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) if e.ends_with("not_found") => Err(format!("no run {run} (see `ql-control runs`)")),
        Err(e) => Err(e),
    }
}

/// A time for people.
pub fn when(ms: Option<Millis>) -> String {
    ms.and_then(|ms| Timestamp::from_millis(ms).ok()).map_or_else(|| "-".into(), |t| t.to_string())
}

/// The runs as a table.
pub async fn runs<S: Store>(store: &S, query: &crate::store::RunQuery) -> Result<String, String> {
    let runs = store.runs(query).await.map_err(|e| e.to_string())?;
    let mut out = format!(
        "{:<28} {:<11} {:>8} {:<24} {:<24} {:<16} {}\n",
        "RUN", "STATUS", "ATTEMPTS", "CREATED", "FINISHED", "SCHEDULE", "ERROR"
    );
    for r in runs {
        out += &format!(
            "{:<28} {:<11} {:>8} {:<24} {:<24} {:<16} {}\n",
            r.id.as_str(),
            r.status.as_str(),
            r.attempts,
            when(Some(r.created_at)),
            when(r.finished_at),
            r.schedule.as_deref().unwrap_or("-"),
            r.error_code.as_deref().unwrap_or("-")
        );
    }
    Ok(out)
}

/// The sessions as a table, with each worker's trusted labels (the operator's, see
/// [`label_worker`]) beside the labels its agent declared, and how many times in the last
/// hour another agent with the same identity was refused a session (a twin); then the
/// workers that have labels but no session listed.
pub async fn workers<S: Store>(store: &S, limit: usize) -> Result<String, String> {
    let sessions = store.sessions(limit).await.map_err(|e| e.to_string())?;
    let records = store.workers(limit).await.map_err(|e| e.to_string())?;
    let twins = store.twin_refusals(3_600_000).await.map_err(|e| e.to_string())?;
    let certificates = store.certificates(usize::MAX).await.map_err(|e| e.to_string())?;
    let record = |w: &WorkerId| records.iter().find(|r| &r.id == w);
    let trusted = |w: &WorkerId| record(w).map_or("-".into(), |r| label_list(&r.labels));
    // Revoked until a certificate is issued after the revocation (an enrolment again).
    let enrolled_since = |w: &WorkerId, at: i64| {
        certificates.iter().any(|c| &c.worker == w && c.revoked_at.is_none() && c.issued_at >= at)
    };
    let access = |w: &WorkerId| match record(w) {
        Some(r) if r.disabled_at.is_some() => "disabled",
        Some(r) if r.revoked_at.is_some_and(|at| !enrolled_since(w, at)) => "revoked",
        _ => "active",
    };
    // The latest not-after among the worker's certificates still valid for it.
    let not_after = |w: &WorkerId| {
        let latest =
            certificates.iter().filter(|c| &c.worker == w && c.revoked_at.is_none()).map(|c| c.not_after).max();
        latest.map_or_else(|| "-".to_owned(), |t| when(Some(t)))
    };
    let refused = |w: &WorkerId| twins.iter().find(|(t, _)| t == w).map_or(0, |(_, n)| *n);
    let line = |cells: [&str; 12]| {
        format!(
            "{:<24} {:<28} {:>4} {:<9} {:>8} {:<24} {:<20} {:>5} {:<8} {:<24} {:<24} {}\n",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            cells[5],
            cells[6],
            cells[7],
            cells[8],
            cells[9],
            cells[10],
            cells[11]
        )
    };
    let mut out = line([
        "WORKER",
        "SESSION",
        "GEN",
        "STATUS",
        "CAPACITY",
        "LAST SEEN",
        "AGENT",
        "TWINS",
        "ACCESS",
        "CERT NOT AFTER",
        "TRUSTED LABELS",
        "DECLARED",
    ]);
    for s in &sessions {
        out += &line([
            s.worker.as_str(),
            s.id.as_str(),
            &s.generation.get().to_string(),
            s.state.as_str(),
            &s.capacity.to_string(),
            &when(Some(s.seen_at)),
            &format!("{} {}", s.agent_version, s.arch),
            &refused(&s.worker).to_string(),
            access(&s.worker),
            &not_after(&s.worker),
            &trusted(&s.worker),
            &label_list(&s.labels),
        ]);
    }
    let mut quiet: Vec<&WorkerId> = records.iter().map(|r| &r.id).collect();
    quiet.extend(certificates.iter().map(|c| &c.worker));
    quiet.sort();
    quiet.dedup();
    for w in quiet.into_iter().filter(|w| !sessions.iter().any(|s| &s.worker == *w)) {
        out += &line([w.as_str(), "-", "-", "-", "-", "-", "-", "-", access(w), &not_after(w), &trusted(w), "-"]);
    }
    if twins.iter().any(|(_, n)| *n > 0) {
        out += "TWINS: session opens refused in the last hour because another agent with the same worker id \
                held the session: two ql-agents share one certificate\n";
    }
    Ok(out)
}

fn attempt_view(a: &Attempt) -> serde_json::Value {
    json!({
        "attemptId": a.id,
        "number": a.number,
        "status": a.status.as_str(),
        "worker": a.worker,
        "sessionId": a.session,
        "offerId": a.offer,
        "leaseGeneration": a.lease.as_ref().map(|l| l.lease_generation),
        "leaseVersion": a.lease.as_ref().map(|l| l.version),
        "executorHandle": a.executor_handle,
        "exitCode": a.exit_code,
        "signal": a.signal,
        "artifact": a.artifact,
        "errorCode": a.error_code,
        "summary": a.summary,
        "startedAt": when(a.started_at),
        "endedAt": when(a.ended_at),
    })
}

/// A run, its attempts and its events as JSON (digests of tokens left out).
pub fn detail_json(d: &RunDetail) -> serde_json::Value {
    let r = &d.run;
    json!({
        "runId": r.id,
        "project": r.project,
        "status": r.status.as_str(),
        "stop": r.stop,
        "labels": r.labels,
        "agentLabels": r.agent_labels,
        "errorCode": r.error_code,
        "summary": r.summary,
        "attempts": d.attempts.iter().map(attempt_view).collect::<Vec<_>>(),
        "leases": d.leases.iter().map(|l| json!({
            "attemptId": l.attempt, "state": l.state.as_str(), "version": l.facts.version,
            "generation": l.facts.lease_generation, "expiresAt": when(Some(l.facts.expires_at)),
        })).collect::<Vec<_>>(),
        "events": d.events.iter().map(|e| json!({
            "eventId": e.id, "attemptId": e.attempt, "type": e.kind, "from": e.from_status, "to": e.to_status,
            "payload": e.payload, "at": when(Some(e.at)),
        })).collect::<Vec<_>>(),
        "createdAt": when(Some(r.created_at)),
        "startedAt": when(r.started_at),
        "finishedAt": when(r.finished_at),
    })
}

/// One run for people.
pub fn detail_text(d: &RunDetail) -> String {
    let r = &d.run;
    let mut out = format!(
        "run      {}\nproject  {}\nstatus   {}{}\ncreated  {}\nstarted  {}\nfinished {}\n",
        r.id,
        r.project,
        r.status,
        r.error_code.as_ref().map_or(String::new(), |c| format!(" ({c})")),
        when(Some(r.created_at)),
        when(r.started_at),
        when(r.finished_at),
    );
    if let Some(stop) = r.stop {
        out += &format!("stop     {stop:?}\n");
    }
    if !r.labels.is_empty() || !r.agent_labels.is_empty() {
        out += &format!("labels   {} (trusted), {} (declared)\n", label_list(&r.labels), label_list(&r.agent_labels));
    }
    for a in &d.attempts {
        out += &format!(
            "attempt  {} #{} {} on {} exit={} signal={}{}\n",
            a.id,
            a.number,
            a.status,
            a.worker,
            a.exit_code.map_or("-".into(), |c| c.to_string()),
            a.signal.map_or("-".into(), |s| s.to_string()),
            a.artifact.as_ref().map_or(String::new(), |r| format!(
                " log={}B{}",
                r.length,
                if r.truncated { " (truncated)" } else { "" }
            )),
        );
    }
    out += "events\n";
    for e in &d.events {
        out += &format!(
            "  {} {:<22} {} -> {}\n",
            when(Some(e.at)),
            e.kind,
            e.from_status.as_deref().unwrap_or("-"),
            e.to_status.as_deref().unwrap_or("-")
        );
    }
    out
}

/// Looks a run up, with a message that says what to do when it is missing.
pub async fn detail<S: Store>(store: &S, run: &RunId) -> Result<RunDetail, String> {
    store
        .run_detail(run)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no run {run} (see `ql-control runs`)"))
}
