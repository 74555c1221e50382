//! The storage seam: one trait every authority store implements (SQLite today,
//! PostgreSQL for replicas), and one contract test suite that runs against each.
//!
//! A store does not decide anything. For each [`Command`] it opens one short
//! transaction, locks and loads the command's [`Keys`](crate::core::Keys) in the protocol's
//! lock order (attempt fence, worker session, run and attempt, run lease), reads DB time
//! after the locks, calls [`crate::core::decide`], writes the decision's rows and events,
//! and commits. A refusal or any error rolls back, so nothing changes.
//!
//! Raw tokens never reach a store: commands carry them only to be digested by the
//! decision code, and rows hold digests.

mod columns;
mod loaded;
pub mod postgres;
mod records;
pub mod sqlite;
pub mod wakes;

use std::future::Future;
use std::ops::Range;

use ql_wire::ids::{AttemptId, ProjectId, RunId};
use ql_wire::ErrorCode;
use tokio::sync::watch;

use crate::core::{Command, Reply};
use ql_wire::ids::WorkerId;

use crate::model::{
    Attempt, AuditRecord, Certificate, Delivery, Enrolment, Event, Fire, Lease, LogChunk, Offer, Operator, Run,
    RunStatus, Schedule, Session, Worker,
};

/// The store could not reach or use its database. Maps to `503 unavailable`.
#[derive(Debug)]
pub struct StoreError(pub String);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "store unavailable: {}", self.0)
    }
}

impl std::error::Error for StoreError {}

/// A worker as a page of them lists it ([`Store::worker_page`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEntry {
    /// Its id.
    pub id: WorkerId,
    /// Its record (trusted labels, access), if it has one.
    pub record: Option<Worker>,
    /// Its newest session, if it ever opened one.
    pub session: Option<Session>,
    /// Its recorded certificates, newest first.
    pub certificates: Vec<Certificate>,
}

/// A run with everything recorded about it, for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDetail {
    /// The run.
    pub run: Run,
    /// Its attempts, oldest first.
    pub attempts: Vec<Attempt>,
    /// Its leases, oldest first.
    pub leases: Vec<Lease>,
    /// Its events, in commit order.
    pub events: Vec<Event>,
    /// Its webhook delivery, if it asked for one.
    pub delivery: Option<Delivery>,
}

/// Every row, in a stable order: what tests compare to prove a refusal changed nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Sessions by id.
    pub sessions: Vec<Session>,
    /// Runs by id.
    pub runs: Vec<Run>,
    /// Attempts by id.
    pub attempts: Vec<Attempt>,
    /// Offers by id.
    pub offers: Vec<Offer>,
    /// Leases by attempt id.
    pub leases: Vec<Lease>,
    /// Events in commit order.
    pub events: Vec<Event>,
    /// Live-log chunks by attempt and offset.
    pub log_chunks: Vec<LogChunk>,
    /// Workers' records by id.
    pub workers: Vec<Worker>,
    /// Certificates by serial.
    pub certificates: Vec<Certificate>,
    /// Enrolments by token digest.
    pub enrolments: Vec<Enrolment>,
    /// Schedules by name.
    pub schedules: Vec<Schedule>,
    /// Fires by schedule and time.
    pub fires: Vec<Fire>,
    /// Operator credentials by name.
    pub operators: Vec<Operator>,
    /// Webhook deliveries by run.
    pub deliveries: Vec<Delivery>,
}

/// Which runs to list: newest first, at most `limit`, of one schedule and one status if
/// given.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunQuery {
    /// Only runs this schedule submitted.
    pub schedule: Option<String>,
    /// Only runs with this status.
    pub status: Option<RunStatus>,
    /// At most this many.
    pub limit: usize,
    /// Only runs listed after this one (older): the next page.
    pub before: Option<RunId>,
    /// Only runs with an attempt offered to this worker.
    pub worker: Option<WorkerId>,
}

impl RunQuery {
    /// The newest `limit` runs.
    pub fn latest(limit: usize) -> Self {
        Self { limit, ..Self::default() }
    }
}

/// One figure of the authority's rows for metrics: `kind` (`runs`, `attempts`, `sessions`, `leases`,
/// `fires`, `deliveries` by their status; `queued_age_ms`, `artifact_bytes`), its
/// status (empty for the last two), and the figure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// What is counted.
    pub kind: String,
    /// Of which status.
    pub label: String,
    /// The count, age or sum.
    pub value: i64,
}

/// Every byte of a live log: [`Store::log_chunks`] of all its chunks.
pub const ALL_CHUNKS: Range<u64> = 0..u64::MAX;

/// The statement of [`Store::log_chunks`], its placeholders numbered after `mark` (`?`
/// or `$`): an attempt's (`1`) chunks that hold bytes from `2` up to `3`, by offset.
/// Chunks tile the log from 0, so the first that may is the last to start at or before
/// the window: both bounds are on the primary key (attempt, offset), and the window's
/// rows are all that is read, however small a log's chunks are.
#[doc(hidden)]
pub fn log_chunks_sql(mark: char) -> String {
    format!(
        "SELECT {} FROM log_chunks WHERE attempt_id = {mark}1 AND byte_offset >= coalesce((SELECT byte_offset \
         FROM log_chunks WHERE attempt_id = {mark}1 AND byte_offset <= {mark}2 ORDER BY byte_offset DESC LIMIT 1), 0) \
         AND byte_offset < {mark}3 AND byte_offset + length > {mark}2 AND {mark}3 > {mark}2 ORDER BY byte_offset",
        records::LOG_CHUNK_COLS
    )
}

/// A page of workers' ids ([`Store::worker_page`]): those with a record, a certificate or
/// a session, after `{mark}1` (text), by id, at most `{mark}2`. Each source is read by its
/// own index from the cursor on, up to the page's size in workers (their sessions' and
/// certificates' entries), not the fleet.
#[doc(hidden)]
pub fn worker_ids_sql(mark: char) -> String {
    format!(
        "SELECT id FROM (\
         SELECT id FROM (SELECT id FROM workers WHERE id > {mark}1 ORDER BY id LIMIT {mark}2) a \
         UNION SELECT worker FROM (SELECT DISTINCT worker FROM certificates WHERE worker > {mark}1 \
         ORDER BY worker LIMIT {mark}2) b \
         UNION SELECT worker FROM (SELECT DISTINCT worker FROM sessions WHERE worker > {mark}1 \
         ORDER BY worker LIMIT {mark}2) c\
         ) u ORDER BY id LIMIT {mark}2"
    )
}

/// A page of [`Store::certificates`], by worker, then newest first (the serial breaking
/// ties): the parameters are, in order, the worker when `worker`, the cursor's serial when
/// `after`, and the limit. The cursor's row is found by its serial, and the page is read
/// from the cursor's worker on in the order of `certificates_page`, not the whole table.
#[doc(hidden)]
pub fn certificates_sql(mark: char, worker: bool, after: bool) -> String {
    let mut n = 0;
    let mut next = || {
        n += 1;
        format!("{mark}{n}")
    };
    let mut from = "certificates c".to_owned();
    let mut conditions = Vec::new();
    if worker {
        conditions.push(format!("c.worker = {}", next()));
    }
    if after {
        from += &format!(", (SELECT worker kw, issued_at ki, serial ks FROM certificates WHERE serial = {}) k", next());
        conditions.push(
            "c.worker >= k.kw AND (c.worker > k.kw OR c.issued_at < k.ki OR (c.issued_at = k.ki AND c.serial < k.ks))"
                .to_owned(),
        );
    }
    let filter = if conditions.is_empty() { String::new() } else { format!(" WHERE {}", conditions.join(" AND ")) };
    let cols = records::CERTIFICATE_COLS.split(", ").map(|c| format!("c.{c}")).collect::<Vec<_>>().join(", ");
    format!("SELECT {cols} FROM {from}{filter} ORDER BY c.worker, c.issued_at DESC, c.serial DESC LIMIT {}", next())
}

/// The entries of a [`Store::worker_page`]: each id with its rows among those read for
/// the page.
pub(crate) fn entries(
    ids: Vec<String>,
    sessions: Vec<Session>,
    records: Vec<Worker>,
    certificates: Vec<Certificate>,
) -> Result<Vec<WorkerEntry>, StoreError> {
    let mut sessions: std::collections::HashMap<WorkerId, Session> =
        sessions.into_iter().map(|s| (s.worker.clone(), s)).collect();
    let mut records: std::collections::HashMap<WorkerId, Worker> =
        records.into_iter().map(|r| (r.id.clone(), r)).collect();
    let mut held: std::collections::HashMap<WorkerId, Vec<Certificate>> = std::collections::HashMap::new();
    for c in certificates {
        held.entry(c.worker.clone()).or_default().push(c);
    }
    ids.into_iter()
        .map(|id| {
            let id = WorkerId::parse(id).map_err(|e| StoreError(e.to_string()))?;
            Ok(WorkerEntry {
                record: records.remove(&id),
                session: sessions.remove(&id),
                certificates: held.remove(&id).unwrap_or_default(),
                id,
            })
        })
        .collect()
}

/// The window's bounds as [`log_chunks_sql`] takes them.
#[doc(hidden)]
pub fn log_chunk_bounds(within: &Range<u64>) -> [i64; 2] {
    let at = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    [at(within.start), at(within.end)]
}

/// The statement of [`Store::stats`], less its dialect: `{NOW}` is DB time and `{LENGTH}`
/// a stored receipt's length.
pub(crate) const STATS_SQL: &str = "SELECT 'runs', status, count(*) FROM runs GROUP BY status \
     UNION ALL SELECT 'sessions', state, count(*) FROM sessions GROUP BY state \
     UNION ALL SELECT 'leases', state, count(*) FROM leases GROUP BY state \
     UNION ALL SELECT 'attempts', status, count(*) FROM attempts GROUP BY status \
     UNION ALL SELECT 'fires', outcome, count(*) FROM fires GROUP BY outcome \
     UNION ALL SELECT 'deliveries', state, count(*) FROM deliveries GROUP BY state \
     UNION ALL SELECT 'queued_age_ms', '', {NOW} - min(created_at) FROM runs WHERE status = 'queued' HAVING count(*) > 0 \
     UNION ALL SELECT 'artifact_bytes', '', CAST(coalesce(sum({LENGTH}), 0) AS BIGINT) FROM attempts \
     WHERE artifact IS NOT NULL";

/// How long audit records are kept: the sweeper removes those older than `max_age_ms`
/// (by DB time) and all but the newest `max_records`; `None` sets no bound of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AuditRetention {
    /// The oldest record kept, in milliseconds of age.
    pub max_age_ms: Option<u64>,
    /// The most records kept.
    pub max_records: Option<u64>,
}

/// Which ended sessions the sweeper keeps ([`Store::prune_sessions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionRetention {
    /// A worker's newest generations, whose ended sessions stay, offered or not, at least
    /// one (the newest always stays, so the next open numbers after it; a
    /// restarted agent resumes the session its journal names, answered
    /// `session_conflict` while it stays, `not_found` once pruned: either way it opens a
    /// new one).
    pub kept: u64,
    /// The most pruned in one sweep.
    pub batch: u64,
}

/// Which ended runs the sweeper removes ([`Store::prunable_runs`], [`Store::prune_runs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunRetention {
    /// How long an ended run stays, in milliseconds from when it ended.
    pub max_age_ms: u64,
    /// The most removed in one sweep.
    pub batch: u64,
}

/// The oldest ended runs past their retention ([`Store::prunable_runs`]), their project
/// and id: ended before `{cutoff}` (an expression of DB time less the retention), at most
/// `{limit}`, and none whose webhook is still waiting to be delivered. `runs_ended`
/// holds the ended runs by when they ended.
#[doc(hidden)]
pub fn prunable_runs_sql(cutoff: &str, limit: &str) -> String {
    format!(
        "SELECT project, id FROM runs WHERE status IN ('succeeded', 'failed', 'cancelled', 'timed_out') \
         AND finished_at < {cutoff} AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.run_id = runs.id \
         AND d.state IN ('waiting', 'pending')) ORDER BY finished_at LIMIT {limit}"
    )
}

/// An ended run's project and id as [`prunable_runs_sql`] reads them back. A row whose
/// ids do not parse (written by no build of this) is told and left, so it cannot stop
/// the pruning of every run after it.
pub(crate) fn ended_run(project: &str, run: &str) -> Option<(ProjectId, RunId)> {
    match (ProjectId::parse(project), RunId::parse(run)) {
        (Ok(project), Ok(run)) => Some((project, run)),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("ql-control: an ended run {run:?} of project {project:?} is left: {e}");
            None
        }
    }
}

/// The audit of the request a command answers ([`Store::execute_audited`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Audit {
    /// The request's `admitted` record.
    pub record: AuditRecord,
    /// The serial of the certificate the request presented, when its admission is decided
    /// here, in the command's transaction ([`crate::core::admission`]). Refused, the
    /// command does not run: the refusal is recorded (alone) and returned.
    pub admit: Option<String>,
}

/// An authority store. Cheap to clone handles are expected (`Arc` inside).
pub trait Store: Clone + Send + Sync + 'static {
    /// Runs one command in one transaction (see the module doc).
    fn execute(&self, cmd: Command) -> impl Future<Output = Result<Result<Reply, ErrorCode>, StoreError>> + Send {
        self.execute_audited(cmd, None)
    }

    /// Runs one command as [`Store::execute`] does, and with it, in the same atomic unit,
    /// the audit of the request that carries it (when given, see [`Audit`]): the request's
    /// admission if it is still to be decided, its `admitted` record, and a record of the
    /// decision's refusal code if it refuses. The audit is durable with the decision,
    /// never after it, and one commit carries both. A [`StoreError`] keeps neither.
    fn execute_audited(
        &self,
        cmd: Command,
        audit: Option<Audit>,
    ) -> impl Future<Output = Result<Result<Reply, ErrorCode>, StoreError>> + Send;

    /// Appends a security audit record (its `at` is filled with DB time).
    fn audit(&self, record: AuditRecord) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Decides whether a request of `record.principal` presenting the certificate `serial`
    /// is admitted ([`crate::core::admission`]: not when its worker is disabled or the
    /// certificate revoked) and returns the refusal's code if not. A refusal is recorded
    /// in the same step; an admission writes nothing: its `admitted` record goes on record
    /// with the request's first command ([`Store::execute_audited`]), so an admitted
    /// request costs one commit, not two.
    fn admit(
        &self,
        record: AuditRecord,
        serial: String,
    ) -> impl Future<Output = Result<Option<ErrorCode>, StoreError>> + Send;

    /// Prunes audit records from the old end as `retention` says; returns how many went.
    fn prune_audit(&self, retention: AuditRetention) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Prunes ended sessions (closed, expired, replaced) that were never offered work
    /// ([`Session::offered`](crate::model::Session::offered)) and are not among their
    /// worker's newest `retention.kept` generations, at most `retention.batch` of them;
    /// returns how many went. Nothing names such a session,
    /// and a worker opening sessions in a loop would otherwise leave a row each.
    fn prune_sessions(&self, retention: SessionRetention) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The oldest ended runs that ended more than `retention.max_age_ms` ago by DB time
    /// and whose webhook is not waiting to be delivered, at most `retention.batch`: each
    /// one's project and id, for the artifact store to remove its logs before
    /// [`Store::prune_runs`] removes its rows.
    fn prunable_runs(
        &self,
        retention: RunRetention,
    ) -> impl Future<Output = Result<Vec<(ProjectId, RunId)>, StoreError>> + Send;

    /// Removes those of `runs` still prunable under `retention` (as
    /// [`Store::prunable_runs`] finds them) with every row that names them: attempts,
    /// offers, leases, events, live-log chunks and the webhook delivery. Returns how many
    /// runs went. An agent that still names one (a completion replayed after months) is
    /// answered `not_found`, which ends its job.
    fn prune_runs(
        &self,
        runs: Vec<RunId>,
        retention: RunRetention,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Per worker, how many session opens were refused as a twin's (`session_conflict`)
    /// within the last `within_ms` of DB time, from the audit records.
    fn twin_refusals(&self, within_ms: u64) -> impl Future<Output = Result<Vec<(WorkerId, u64)>, StoreError>> + Send;

    /// Audit records, oldest first (for operators and tests).
    fn audits(&self) -> impl Future<Output = Result<Vec<AuditRecord>, StoreError>> + Send;

    /// Runs, newest first, as `query` says.
    fn runs(&self, query: &RunQuery) -> impl Future<Output = Result<Vec<Run>, StoreError>> + Send;

    /// Schedules, by name.
    fn schedules(&self) -> impl Future<Output = Result<Vec<Schedule>, StoreError>> + Send;

    /// A schedule's fires, newest first, at most `limit`.
    fn fires(&self, schedule: &str, limit: usize) -> impl Future<Output = Result<Vec<Fire>, StoreError>> + Send;

    /// One run with its attempts, leases and events.
    fn run_detail(&self, run: &RunId) -> impl Future<Output = Result<Option<RunDetail>, StoreError>> + Send;

    /// The acknowledged live-log chunks of an attempt that hold bytes of `within`, by
    /// offset ([`ALL_CHUNKS`] for all of them): a reader of a window, or a repeated chunk,
    /// reads the rows of that window, not every row of a long log.
    fn log_chunks(
        &self,
        attempt: &AttemptId,
        within: Range<u64>,
    ) -> impl Future<Output = Result<Vec<LogChunk>, StoreError>> + Send;

    /// Certificates recorded, by worker then newest first ([`certificates_sql`]): only
    /// `worker`'s when given, only those after the certificate whose serial is `after`
    /// (none when no certificate has that serial), at most `limit`.
    fn certificates(
        &self,
        worker: Option<&WorkerId>,
        after: Option<&str>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Certificate>, StoreError>> + Send;

    /// Counts of the rows by status, the oldest queued run's age and the bytes of the
    /// stored logs, for metrics ([`Stat`]).
    fn stats(&self) -> impl Future<Output = Result<Vec<Stat>, StoreError>> + Send;

    /// Operator credentials, by name.
    fn operators(&self) -> impl Future<Output = Result<Vec<Operator>, StoreError>> + Send;

    /// The workers the store knows (a record, a certificate or a session) with ids after
    /// `after`, by id, at most `limit`, each with its record, its newest session and its
    /// certificates: one page reads the rows of its workers alone.
    fn worker_page(
        &self,
        after: Option<&WorkerId>,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<WorkerEntry>, StoreError>> + Send;

    /// Every row (tests and invariant checks).
    fn snapshot(&self) -> impl Future<Output = Result<Snapshot, StoreError>> + Send;

    /// Answers once the path commands take works (the watchdog's probe): for SQLite a job
    /// through the writer thread, which takes the file's write lock; for PostgreSQL a
    /// lookup through the pool. An error is an answer too.
    fn probe(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A counter that rises whenever work may have appeared — in this process or, for
    /// shared databases, in another one. Long-polls wait on it.
    fn changes(&self) -> watch::Receiver<u64>;

    /// What the wake-ups after the counter's value `seen` up to `now` were for: the runs
    /// they queued, or `None` when one was for every poll (or is not known here). A poll
    /// whose session takes none of the runs waits on without asking the store.
    fn wakes_since(&self, seen: u64, now: u64) -> Option<Vec<crate::core::Want>> {
        let _ = (seen, now);
        None
    }

    /// What this process's group commit did so far, for metrics; `None` for a store
    /// without one (SQLite's writer batches by its own rules).
    fn commit_groups(&self) -> Option<postgres::GroupCommits> {
        None
    }
}
