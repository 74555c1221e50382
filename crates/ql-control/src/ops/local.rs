//! Every operator command on a store and an artifact store, through the store's one
//! decision code ([`crate::core`]): what the CLI does with `--dir` or `--database`, and
//! what the operator API does for a remote CLI.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::ids::{ProjectId, RunId, WorkerId};
use ql_wire::spec::{EnvName, ExecutionSpec, Interpreter, Script, SpecSchema};
use ql_wire::ErrorCode;

use super::view::{
    time, CertificateList, CertificateRow, Done, FireRow, LogWindow, RunPage, RunRow, RunView, ScheduleBody,
    ScheduleList, ScheduleRow, ScheduleView, SubmitBody, WorkerList, WorkerRow,
};
use super::{AccessChange, LogRequest, OpError, RunFilter, ScheduleAction, MAX_PAGE};
use crate::admin::labels_of;
use crate::blob::{ArtifactKey, BlobStore};
use crate::core::{Access, CancelOutcome, Command, Reply, ScheduleSpec, Submit};
use crate::model::{Attempt, AttemptStatus, Certificate, Notify, NotifyOn, RunStatus};
use crate::store::{RunDetail, RunQuery, Store, WorkerEntry};

/// The commands on `store` and `blobs`.
#[derive(Debug, Clone)]
pub struct Local<S, B> {
    /// The authority.
    pub store: S,
    /// Where logs are.
    pub blobs: B,
}

/// Builds the run request from the API's body, refusing what the protocol would refuse.
pub fn submit_of(body: &SubmitBody) -> Result<Submit, OpError> {
    let invalid = |m: String| OpError::invalid(m);
    let project =
        ProjectId::parse(body.project.as_str()).map_err(|e| invalid(format!("project {:?}: {e}", body.project)))?;
    let (argv, script) = match (&body.argv, &body.script) {
        (Some(argv), None) if !argv.is_empty() => (Some(argv.clone()), None),
        (None, Some(s)) => {
            let interpreter = match s.interpreter.as_str() {
                "sh" => Interpreter::Sh,
                "python3" => Interpreter::Python3,
                "node" => Interpreter::Node,
                other => return Err(invalid(format!("interpreter {other:?}: use sh, python3 or node"))),
            };
            (None, Some(Script { interpreter, source: s.source.clone() }))
        }
        (Some(_), Some(_)) => return Err(invalid("give either a program or a script, not both".into())),
        _ => return Err(invalid("nothing to run: give a program (argv) or a script".into())),
    };
    let mut env = BTreeMap::new();
    for (k, v) in &body.env {
        env.insert(EnvName::parse(k.as_str()).map_err(|e| invalid(format!("--env {k:?}: {e}")))?, v.clone());
    }
    let labels = labels_of(&label_words(&body.labels)?, "--label").map_err(invalid)?;
    let agent_labels = labels_of(&label_words(&body.agent_labels)?, "--agent-label").map_err(invalid)?;
    let spec = ExecutionSpec {
        schema: SpecSchema,
        project_id: project.clone(),
        argv,
        script,
        env,
        timeout_ms: body.timeout_ms,
        log_limit_bytes: body.log_limit_bytes,
    };
    spec.validate().map_err(|e| invalid(format!("the run is out of bounds: {e}")))?;
    let notify = match &body.notify {
        None => None,
        Some(n) => {
            crate::core::check_url(&n.url).map_err(invalid)?;
            let on = NotifyOn::parse(&n.on).ok_or_else(|| invalid(format!("notify on {:?}: all or failure", n.on)))?;
            Some(Notify { url: n.url.clone(), on })
        }
    };
    Ok(Submit { project, spec, labels, agent_labels, retry_budget: body.retries, notify })
}

/// Checks a schedule's body (before the store is asked), then its run.
pub fn schedule_of(body: &ScheduleBody) -> Result<ScheduleSpec, OpError> {
    crate::core::check_schedule_name(&body.name).map_err(OpError::invalid)?;
    crate::core::parse_cron(&body.cron, &body.tz).map_err(OpError::invalid)?;
    crate::core::check_random_delay(body.random_delay_ms).map_err(OpError::invalid)?;
    Ok(ScheduleSpec {
        name: body.name.clone(),
        cron: body.cron.clone(),
        tz: body.tz.clone(),
        random_delay_ms: body.random_delay_ms,
        overlap: body.overlap.parse().map_err(OpError::invalid)?,
        catch_up: body.catch_up.parse().map_err(OpError::invalid)?,
        submit: submit_of(&body.run)?,
    })
}

/// Windows of stored logs read at once.
static STORED_READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(16);

/// The largest window of a stored log read at once.
const LOG_WINDOW_MAX: u64 = 4 * 1024 * 1024;

/// `key=value` words of a label map, refusing a key with a `=` (it would split apart).
pub fn label_words(labels: &BTreeMap<String, String>) -> Result<Vec<String>, OpError> {
    if let Some(k) = labels.keys().find(|k| k.contains('=')) {
        return Err(OpError::invalid(format!("label {k:?}: a key without '='")));
    }
    Ok(labels.iter().map(|(k, v)| format!("{k}={v}")).collect())
}

/// Labels as `k=v,k=v`, or `-` for none.
pub fn label_list(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "-".into();
    }
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

impl<S: Store, B: BlobStore> Local<S, B> {
    async fn execute(&self, cmd: Command) -> Result<Reply, OpError> {
        match self.store.execute(cmd).await? {
            Ok(reply) => Ok(reply),
            Err(code) => Err(OpError::new(code, format!("refused: {code}"))),
        }
    }

    /// Queues a run.
    pub async fn submit(&self, body: &SubmitBody) -> Result<Done, OpError> {
        match self.execute(Command::Submit(submit_of(body)?)).await? {
            Reply::Submitted(id) => Ok(Done { message: id.to_string(), run_id: Some(id.to_string()) }),
            other => Err(unexpected(&other)),
        }
    }

    /// Cancels a run: at once if no worker holds it, else at the worker's next renewal.
    pub async fn cancel(&self, run: &RunId) -> Result<Done, OpError> {
        let message = match self.execute(Command::Cancel(run.clone())).await {
            Ok(Reply::Cancelled(CancelOutcome::Cancelled)) => format!("{run} cancelled"),
            Ok(Reply::Cancelled(CancelOutcome::StopRequested)) => {
                format!("{run}: stop requested; the worker stops it at its next lease renewal")
            }
            Ok(Reply::Cancelled(CancelOutcome::AlreadyEnded(status))) => format!("{run} had already ended: {status}"),
            Ok(other) => return Err(unexpected(&other)),
            Err(e) if e.code == ErrorCode::NotFound => return Err(no_run(run)),
            Err(e) => return Err(e),
        };
        Ok(Done { message, run_id: Some(run.to_string()) })
    }

    /// Runs, newest first, a page at a time.
    pub async fn runs(&self, filter: &RunFilter) -> Result<RunPage, OpError> {
        let status = match &filter.status {
            None => None,
            Some(s) => {
                Some(RunStatus::parse(s).ok_or_else(|| OpError::invalid(format!("status {s:?} is not a run status")))?)
            }
        };
        let before = match &filter.before {
            None => None,
            Some(r) => Some(RunId::parse(r.as_str()).map_err(|e| OpError::invalid(format!("before {r:?}: {e}")))?),
        };
        let worker = match &filter.worker {
            None => None,
            Some(w) => Some(WorkerId::parse(w.as_str()).map_err(|e| OpError::invalid(format!("worker {w:?}: {e}")))?),
        };
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let query = RunQuery { schedule: filter.schedule.clone(), status, limit, before, worker };
        let runs: Vec<RunRow> = self.store.runs(&query).await?.iter().map(RunRow::from).collect();
        let next = (runs.len() == limit).then(|| runs.last().map(|r| r.run_id.clone())).flatten();
        Ok(RunPage { runs, next })
    }

    async fn detail(&self, run: &RunId) -> Result<RunDetail, OpError> {
        self.store.run_detail(run).await?.ok_or_else(|| no_run(run))
    }

    /// One run with its attempts, leases and events.
    pub async fn run(&self, run: &RunId) -> Result<RunView, OpError> {
        Ok(RunView::from(&self.detail(run).await?))
    }

    /// Sets the labels the operator vouches for of `worker` (all of them; none clears
    /// them) and says what it now carries.
    pub async fn label(&self, worker: &WorkerId, words: &[String]) -> Result<Done, OpError> {
        let labels = labels_of(words, "label").map_err(OpError::invalid)?;
        match self.execute(Command::LabelWorker(worker.clone(), labels)).await? {
            Reply::WorkerLabelled(w) => Ok(Done::said(format!("{}: {}", w.id.as_str(), label_list(&w.labels)))),
            other => Err(unexpected(&other)),
        }
    }

    /// Changes `worker`'s access ([`AccessChange`]).
    pub async fn set_access(&self, worker: &WorkerId, change: AccessChange<'_>) -> Result<Done, OpError> {
        let said = match (change.access, change.serial) {
            (Access::Revoke, Some(serial)) => {
                crate::identity::revoke_certificate(&self.store, worker, serial, change.with_renewals).await
            }
            (_, Some(_)) => return Err(OpError::invalid("a serial goes with revoke only")),
            (_, None) if change.with_renewals => return Err(OpError::invalid("renewals go with a serial only")),
            (access, None) => crate::identity::set_access(&self.store, worker, access).await,
        };
        said.map(Done::said).map_err(coded)
    }

    /// The workers the store knows (a record, a certificate or a session) after `after`,
    /// by id, at most `limit`, each with its newest session and its standing; see
    /// [`WorkerRow`]. A page reads its workers' rows, and the hour's twin refusals (an
    /// index of refusals alone). An empty `after` is the first page.
    pub async fn workers(&self, limit: usize, after: Option<&str>) -> Result<WorkerList, OpError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let after = after
            .filter(|w| !w.is_empty())
            .map(|w| WorkerId::parse(w).map_err(|e| OpError::invalid(format!("after {w:?}: {e}"))))
            .transpose()?;
        let page = self.store.worker_page(after.as_ref(), limit).await?;
        let twins = self.store.twin_refusals(3_600_000).await?;
        let twins: HashMap<&WorkerId, u64> = twins.iter().map(|(w, n)| (w, *n)).collect();
        let row = |w: &WorkerEntry| {
            let valid: Vec<&Certificate> = w.certificates.iter().filter(|c| c.revoked_at.is_none()).collect();
            // Revoked until a certificate is issued after the revocation (an enrolment again).
            let access = match &w.record {
                Some(r) if r.disabled_at.is_some() => "disabled",
                Some(r) if r.revoked_at.is_some_and(|at| !valid.iter().any(|c| c.issued_at >= at)) => "revoked",
                _ => "active",
            };
            let session = w.session.as_ref();
            WorkerRow {
                worker: w.id.to_string(),
                session: session.map(|s| s.id.to_string()),
                generation: session.map(|s| s.generation.get()),
                status: session.map(|s| s.state.as_str().into()),
                capacity: session.map(|s| s.capacity),
                last_seen: session.map(|s| time(s.seen_at)),
                agent: session.map(|s| format!("{} {}", s.agent_version, s.arch)),
                twins: twins.get(&w.id).copied().unwrap_or(0),
                access: access.into(),
                // The latest not-after among the worker's certificates still valid for it.
                cert_not_after: valid.iter().map(|c| c.not_after).max().map(time),
                labels: w.record.as_ref().map(|r| r.labels.clone()).unwrap_or_default(),
                declared: session.map(|s| s.labels.clone()).unwrap_or_default(),
            }
        };
        let next = (page.len() == limit).then(|| page.last().map(|w| w.id.to_string())).flatten();
        Ok(WorkerList { workers: page.iter().map(row).collect(), next })
    }

    /// A page of the recorded certificates (only `worker`'s, when given), by worker then
    /// newest first, after the certificate `after` names; with the last serial of a full
    /// page as `next`.
    pub async fn certificates(
        &self,
        worker: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<CertificateList, OpError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let worker = worker
            .filter(|w| !w.is_empty())
            .map(|w| WorkerId::parse(w).map_err(|e| OpError::invalid(format!("worker {w:?}: {e}"))))
            .transpose()?;
        // Serials are recorded in lowercase hex.
        let after = after.filter(|a| !a.is_empty()).map(str::to_ascii_lowercase);
        if let Some(a) = &after {
            if a.len() > 64 || !a.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(OpError::invalid(format!("after {a:?}: a certificate's serial (hex) is expected")));
            }
        }
        let page = self.store.certificates(worker.as_ref(), after.as_deref(), limit).await?;
        let next = (page.len() == limit).then(|| page.last().map(|c| c.serial.clone())).flatten();
        Ok(CertificateList { certificates: page.iter().map(CertificateRow::from).collect(), next })
    }

    /// The schedules.
    pub async fn schedules(&self) -> Result<ScheduleList, OpError> {
        Ok(ScheduleList { schedules: self.store.schedules().await?.iter().map(ScheduleRow::from).collect() })
    }

    /// One schedule with its 20 latest fires.
    pub async fn schedule(&self, name: &str) -> Result<ScheduleView, OpError> {
        let all = self.store.schedules().await?;
        let s = all.iter().find(|s| s.name == name).ok_or_else(no_schedule)?;
        let fires = self.store.fires(name, 20).await?;
        Ok(ScheduleView { schedule: ScheduleRow::from(s), fires: fires.iter().map(FireRow::from).collect() })
    }

    /// Adds a schedule and says when it first fires.
    pub async fn add_schedule(&self, body: &ScheduleBody) -> Result<Done, OpError> {
        let spec = schedule_of(body)?;
        let taken = "a schedule with that name exists already";
        match self.schedule_command(Command::AddSchedule(Box::new(spec)), taken).await? {
            Reply::Schedule(s) => Ok(Done::said(format!("{} added; first fire {}", s.name, time(s.due_at)))),
            other => Err(unexpected(&other)),
        }
    }

    /// Pauses, resumes, fires now or removes a schedule.
    pub async fn schedule_action(&self, name: &str, action: ScheduleAction) -> Result<Done, OpError> {
        let name = name.to_owned();
        let cmd = match action {
            ScheduleAction::Pause => Command::PauseSchedule(name.clone(), true),
            ScheduleAction::Resume => Command::PauseSchedule(name.clone(), false),
            ScheduleAction::RunNow => Command::RunScheduleNow(name.clone()),
            ScheduleAction::Remove => Command::RemoveSchedule(name.clone()),
        };
        // The one conflict of these: a schedule resumed whose cron fires never again.
        let ended = "its cron expression has no time left to fire";
        match (action, self.schedule_command(cmd, ended).await?) {
            (ScheduleAction::Remove, _) => Ok(Done::said(format!("{name} removed (its runs stay)"))),
            (_, Reply::Submitted(run)) => Ok(Done { message: run.to_string(), run_id: Some(run.to_string()) }),
            (_, Reply::Schedule(s)) if s.paused => Ok(Done::said(format!("{} paused", s.name))),
            (_, Reply::Schedule(s)) => Ok(Done::said(format!("{} resumed; next fire {}", s.name, time(s.due_at)))),
            (_, other) => Err(unexpected(&other)),
        }
    }

    /// `cmd` about a schedule, its conflict told as `conflict`.
    async fn schedule_command(&self, cmd: Command, conflict: &str) -> Result<Reply, OpError> {
        self.execute(cmd).await.map_err(|e| match e.code {
            ErrorCode::NotFound => no_schedule(),
            ErrorCode::StateConflict => OpError::new(e.code, conflict),
            _ => e,
        })
    }

    /// A piece of the run's log; see [`crate::logs`] for which attempt's, and when the
    /// stored log replaces the live chunks. With `follow`, waits up to `wait_ms` for more
    /// when there is none yet.
    pub async fn log(&self, run: &RunId, request: &LogRequest) -> Result<LogWindow, OpError> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(request.wait_ms);
        let mut changes = self.store.changes();
        loop {
            let window = self.window(run, request).await?;
            let idle = window.bytes.is_empty() && window.sealed.is_none() && !window.terminal;
            if !request.follow || !idle || tokio::time::Instant::now() >= deadline {
                return Ok(window);
            }
            // A store notices writes of other processes only so often: look again at least
            // every 250 ms.
            let nap = deadline.min(tokio::time::Instant::now() + Duration::from_millis(250));
            let _ = tokio::time::timeout_at(nap, changes.changed()).await;
        }
    }

    async fn window(&self, run: &RunId, request: &LogRequest) -> Result<LogWindow, OpError> {
        let d = self.detail(run).await?;
        let terminal = d.run.status.is_terminal();
        let mut window = LogWindow { status: d.run.status.as_str().into(), terminal, ..LogWindow::default() };
        let Some(attempt) = target(&d, request.follow && !terminal) else {
            return Ok(window);
        };
        // An offset counts in the attempt it was read from: another attempt starts at 0.
        let offset = match request.attempt.as_deref() {
            Some(a) if a != attempt.id.as_str() => 0,
            _ => request.offset,
        };
        window.attempt = Some(attempt.id.to_string());
        window.number = attempt.number;
        window.offset = offset;
        let limit = request.limit.max(1);
        let key = |artifact| ArtifactKey {
            project: d.run.project.clone(),
            run: d.run.id.clone(),
            attempt: attempt.id.clone(),
            artifact,
        };
        // The stored log once the attempt's completion recorded it, the live chunks before
        // (the completion removes them). Its receipt ends a look without following, or a
        // follower's once the run ended: a retry's attempt may follow.
        if let Some(receipt) = &attempt.artifact {
            let sealed = terminal || !request.follow;
            return self.stored(window, &key(receipt.artifact_id.clone()), receipt, sealed, limit).await;
        }
        let Some(artifact) = attempt.log_artifact.clone() else {
            return Ok(window);
        };
        match self.live(&mut window, &key(artifact), limit).await {
            Ok(()) => Ok(window),
            Err(e) => {
                // The chunks went as the completion committed after this look began: the
                // stored log, just recorded, holds the same bytes.
                let now = self.detail(run).await?;
                let Some(receipt) = now.attempts.iter().find(|a| a.id == attempt.id).and_then(|a| a.artifact.as_ref())
                else {
                    return Err(e);
                };
                window.bytes.clear();
                window.terminal = now.run.status.is_terminal();
                window.status = now.run.status.as_str().into();
                let sealed = window.terminal || !request.follow;
                self.stored(window, &key(receipt.artifact_id.clone()), receipt, sealed, limit).await
            }
        }
    }

    /// A window of the stored log `key` from `window.offset`, its receipt's `sealed` when
    /// the window reaches the end and `seal` says the look ends there.
    async fn stored(
        &self,
        mut window: LogWindow,
        key: &ArtifactKey,
        receipt: &Receipt,
        seal: bool,
        limit: u64,
    ) -> Result<LogWindow, OpError> {
        // A window at a time, as a ranged read: `logs` checks the SHA-256 of all it read
        // against the receipt the last window carries; a window that is the whole log is
        // checked here too, so a short log is never shown unchecked. A few at a time, so
        // no number of readers holds many windows in memory.
        let _reading = STORED_READS.acquire().await.map_err(|_| unavailable("shutting down".into()))?;
        let (offset, run) = (window.offset, &key.run);
        let bytes = self
            .blobs
            .read(key, offset, limit.min(LOG_WINDOW_MAX))
            .await
            .map_err(|e| OpError::new(ErrorCode::Unavailable, e.to_string()))?
            .ok_or_else(|| unavailable(format!("the log of {run} is recorded but missing from the artifact store")))?;
        let whole = offset == 0 && bytes.len() as u64 == receipt.length;
        if whole && !Digest::of(&bytes).ct_eq(&receipt.sha256) {
            return Err(unavailable(format!(
                "the stored log of {run} does not match its receipt (SHA-256 or length differs)"
            )));
        }
        if seal && offset.saturating_add(bytes.len() as u64) >= receipt.length {
            window.sealed = Some(receipt.clone());
        }
        window.bytes = bytes;
        Ok(window)
    }

    /// Appends to `window` the acknowledged chunks of the live log `key` from its offset,
    /// up to `limit` bytes.
    async fn live(&self, window: &mut LogWindow, key: &ArtifactKey, limit: u64) -> Result<(), OpError> {
        let offset = window.offset;
        for chunk in self.store.log_chunks(&key.attempt, offset..offset.saturating_add(limit)).await? {
            let end = chunk.offset + chunk.length;
            let have = offset + window.bytes.len() as u64;
            if end <= have {
                continue;
            }
            if window.bytes.len() as u64 >= limit {
                break;
            }
            let bytes = self
                .blobs
                .read_chunk(key, chunk.offset, chunk.length, &chunk.sha256)
                .await
                .map_err(|e| unavailable(e.to_string()))?;
            let from = usize::try_from(have.saturating_sub(chunk.offset)).unwrap_or(usize::MAX).min(bytes.len());
            window.bytes.extend_from_slice(&bytes[from..]);
        }
        window.bytes.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(())
    }
}

/// The attempt whose log is the run's: the latest one; for a finished run, or a look
/// without following, the latest one that has any log.
fn target(d: &RunDetail, live: bool) -> Option<&Attempt> {
    if live {
        return d.attempts.last().filter(|a| a.status != AttemptStatus::Offered);
    }
    d.attempts.iter().rev().find(|a| a.artifact.is_some() || a.log_acked > 0)
}

/// The code of an identity command's message: `refused: <code>`, a missing serial, or the
/// store's unavailability.
fn coded(message: String) -> OpError {
    let code = match message.rsplit_once("refused: ") {
        Some((_, word)) => serde_json::from_value(serde_json::Value::String(word.to_owned())).ok(),
        None if message.starts_with("no certificate") => Some(ErrorCode::NotFound),
        None if message.starts_with("store unavailable") => Some(ErrorCode::Unavailable),
        None => None,
    };
    OpError::new(code.unwrap_or(ErrorCode::InvalidRequest), message)
}

fn no_run(run: &RunId) -> OpError {
    OpError::not_found(format!("no run {run} (see `ql-control runs`)"))
}

fn no_schedule() -> OpError {
    OpError::not_found("no such schedule")
}

fn unavailable(message: String) -> OpError {
    OpError::new(ErrorCode::Unavailable, message)
}

fn unexpected(reply: &Reply) -> OpError {
    OpError::new(ErrorCode::Unavailable, format!("unexpected answer {reply:?}"))
}
