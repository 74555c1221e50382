//! The PostgreSQL authority store: several `ql-control` replicas, one truth.
//!
//! # One command, one short transaction
//!
//! [`Store::execute`] takes a pooled connection and runs, in one transaction:
//! the command's locks and loads in the protocol's fixed order (attempt advisory fence,
//! worker session, run and attempt, run lease — see [`load`]); then DB time, read with a
//! statement of its own issued *after* the last lock, so it is the `statement_timestamp()`
//! of a moment every lock was held; then the shared pure [`core::decide`] (no decision
//! logic lives here); then the decision's rows and events, in order, with the request's
//! audit record when it has one ([`Store::execute_audited`]); then COMMIT. A refusal
//! rolls back (it carries no writes), or commits only its request's audit records. Any SQL error — a constraint, a lost
//! connection, a failed COMMIT — closes the connection, which makes the server roll the
//! transaction back, and becomes a [`StoreError`] (`503 unavailable`: safe to repeat).
//!
//! Transactions run at READ COMMITTED: every row a decision rewrites was read under a row
//! lock, which PostgreSQL returns at its latest committed version, so no update is lost.
//! Rows the command loaded are written with a plain UPDATE, new ones with an upsert.
//!
//! Round trips: a fenced command sends its whole load (BEGIN, locks, loads, DB time) as
//! one pipeline and its writes, NOTIFY and COMMIT as a second, every update counting its
//! rows inside the transaction ([`found`]: a shortfall aborts it, and the COMMIT behind
//! rolls back); a poll sends its load as
//! two (the second needs the session's labels and room). A request whose admission
//! is decided with its command ([`Audit::admit`]) reads it in the statement that reads DB
//! time, after the locks: no round trip of its own, and a revocation that committed while
//! the command waited for a lock is seen. Refused, the transaction commits only the
//! refusal's audit record. The server executes a
//! connection's statements strictly in order, so pipelining changes neither the lock
//! order nor when DB time is stamped ([`load`] explains).
//!
//! # Group commit
//!
//! Commands about a worker session (its polls, claims, heartbeats and attempt commands)
//! go through one of [`PgOptions::lanes`] lanes, which fill in turn, each up to
//! [`PgOptions::lane_fill`] commands in flight (see [`group`]): a lane takes
//! every command waiting on it (at most [`PgOptions::batch_max`]; for at most
//! [`PgOptions::lane_window`], one from each agent of its last two groups) and runs them
//! one after another in one transaction, each exactly as above but for BEGIN and COMMIT, which the
//! group shares ([`PgStore::execute_batch`]). Under many concurrent agents one commit —
//! one WAL flush, one transaction's bookkeeping — serves many ACKs; a command that finds
//! its lane idle runs alone as before. A later command of a group sees the earlier ones'
//! writes (one transaction), so a group decides what the same commands one at a time
//! would. The fenced commands of a group that name no session, attempt, run or offer an
//! earlier command of it names form a wave ([`wave`]), run before the group's other
//! commands (all of a group's commands are in flight together, so any serial order of
//! them is one they could have run in): one statement per level of the lock order loads
//! every command's rows, and commands that write alike send each write once for several,
//! the wave's audit records and its events as multi-row `INSERT`s, so a wave of ten
//! costs PostgreSQL the relations and indexes of a few commands. The polls of different
//! sessions then form a wave of polls ([`polls`]): three round trips for all of them
//! instead of three each, every poll deciding as it would after the ones before it. A session's commands in
//! flight share a lane, so they never wait for each other from two groups of one
//! replica. (A group's commands after its wave take their session's lock after the
//! wave's lower-level locks, and a wave takes several fences, each level in key order;
//! a group can so wait for another transaction that waits for it, and PostgreSQL breaks
//! such a deadlock: the group it fails runs command by command.) If a command of a group fails, nothing of the group is
//! kept and each command runs again alone; other commands (submits, operator commands,
//! sweeps) run alone.
//!
//! # Roles
//!
//! The store connects as the runtime role (`ql_runtime`: SELECT, INSERT, UPDATE on the
//! state tables, append-only on history). Audit records may go through a second pool
//! connected as the worker-ingress role (`ql_worker_ingress`, which may only append audit
//! records) — [`PgOptions::audit_url`]. Migrations run as the owner, separately
//! ([`migrate`]). The migration file documents the grants.
//!
//! # Wake-ups across replicas
//!
//! A waking decision ([`Decision::wake`](crate::core::Decision::wake), or one that queued
//! runs) sends `NOTIFY ql_changes` inside its transaction, so the notification leaves
//! exactly when the change commits. Each store keeps one dedicated connection that
//! `LISTEN`s and wakes every long-poll on every notification from another store; when that
//! connection drops it reconnects and wakes them once (a notification may have been
//! missed). Its own decisions it tells its long-polls directly ([`super::wakes`]), so a
//! submit wakes only the polls of sessions that take the run, on the replica that queued
//! it; the others re-run their poll.
//!
//! # DB time
//!
//! `statement_timestamp()` plus [`PgOptions::clock_offset`], zero in production; tests
//! move time forward with the offset instead of sleeping.

mod found;
mod group;
mod load;
mod polls;
mod pool;
mod projection;
mod rows;
mod schema;
mod wave;

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Config, Row};

use ql_wire::ids::{AttemptId, ProjectId, RunId, WorkerId};
use ql_wire::ErrorCode;

use super::loaded::{Known, Loaded};
use super::records::{
    ATTEMPTS, AUDIT_COLS, CERTIFICATES, DELIVERIES, ENROLMENTS, EVENTS, EVENT_COLS, FIRES, LEASES, LOG_CHUNKS,
    LOG_CHUNK_COLS, OFFERS, OPERATORS, RUNS, SCHEDULES, SESSIONS, WORKERS,
};
use super::wakes::Wakes;
use super::{Audit, AuditRetention, RunDetail, RunQuery, RunRetention, SessionRetention, Snapshot, Store, StoreError};
use crate::core::{self, Command, IdGen, Reply, Rows, Timings, Write};
use crate::model::{Attempt, AuditRecord, Certificate, Fire, LogChunk, Millis, Operator, Run, Schedule, Worker};
use crate::store::records::{CERTIFICATE_COLS, DELIVERY_COLS, ENROLMENT_COLS, FIRE_COLS, OPERATOR_COLS};
use pool::{Pool, Pooled};
use rows::{ATTEMPT_COLS, LEASE_COLS, OFFER_COLS, RUN_COLS, SCHEDULE_COLS, SESSION_COLS, WORKER_COLS};

#[doc(hidden)]
pub use found::checked_text;
pub use group::GroupCommits;
#[doc(hidden)]
pub use load::{
    ACTIVE_ATTEMPTS_OF, COMPLETION_EVENTS_OF, OPEN_OFFERS_OF, QUEUE_PROBE, QUEUE_PROBES_OF, QUEUE_WALK, WORKERS_OF,
};
pub use schema::{ROLES, SCHEMA_VERSION};
#[doc(hidden)]
pub use wave::{merged_update, WAVE_FENCES, WAVE_RUNS};

/// Records a sweep (see `core::grace`).
const ALIVE: &str =
    "INSERT INTO authority (id, alive_at) VALUES (1, $1) ON CONFLICT (id) DO UPDATE SET alive_at = EXCLUDED.alive_at";

/// The notification channel of waking decisions.
const CHANNEL: &str = "ql_changes";

/// Why a store operation failed (all become [`StoreError`]).
#[derive(Debug)]
pub(crate) enum Error {
    /// The driver or the server refused.
    Pg(tokio_postgres::Error),
    /// A stored value its type refuses, or a schema this build cannot use.
    Corrupt(String),
    /// Cancel saw the run's current attempt change under it; run the command again.
    Retry,
    /// A decision's event names a run or attempt its command neither loaded nor wrote
    /// ([`Loaded::dangling`]): refused before anything is sent, as the foreign keys
    /// events no longer carry would have refused it at COMMIT (migration 0017).
    Dangling(String),
    /// The pool is closed.
    Closed,
    /// The test hook of [`PgOptions::kill_after_commit`] ended the connection.
    Killed,
    /// The transaction of a group of commands failed as it began or committed; each of
    /// them is told so.
    Group(String),
    /// A pipeline that held the COMMIT failed where the COMMIT may have run (the
    /// connection lost, the backend ended): what committed is unknown, so the commands
    /// are not run again.
    Unsure(String),
}

impl Error {
    /// This error for each of `n` commands run together.
    fn each(self, n: usize) -> Vec<Result<Result<Reply, ErrorCode>, Error>> {
        let why = self.to_string();
        (0..n)
            .map(|_| Err(if matches!(self, Self::Killed) { Self::Killed } else { Self::Group(why.clone()) }))
            .collect()
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pg(e) => match e.as_db_error() {
                Some(db) => write!(f, "postgres: {} ({})", db.message(), db.code().code()),
                None => write!(f, "postgres: {e}"),
            },
            Self::Corrupt(why) | Self::Dangling(why) => write!(f, "postgres: {why}"),
            Self::Retry => f.write_str("postgres: the run changed while cancelling, retries exhausted"),
            Self::Closed => f.write_str("postgres: the pool is closed"),
            Self::Killed => f.write_str("postgres: the connection was terminated after COMMIT (test hook)"),
            Self::Group(why) => f.write_str(why),
            Self::Unsure(why) => write!(f, "postgres: the COMMIT may or may not have run: {why}"),
        }
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        StoreError(e.to_string())
    }
}

/// A test hook: after the COMMIT of a command it returns `true` for, the store
/// terminates its own backend (`pg_terminate_backend`) and fails the call, as if the
/// connection had died between COMMIT and the reply.
pub type KillAfterCommit = Arc<dyn Fn(&Command) -> bool + Send + Sync>;

/// How to open a [`PgStore`].
#[derive(Clone)]
pub struct PgOptions {
    /// Durations the authority hands out.
    pub timings: Timings,
    /// Added to the server's clock to make DB time. Zero in production; tests raise it
    /// to move time forward without sleeping.
    pub clock_offset: Arc<AtomicI64>,
    /// Most connections this store holds (the LISTEN connection not counted).
    pub pool_size: usize,
    /// How long to wait for a connection to open.
    pub connect_timeout: Duration,
    /// A URL for audit records, normally as the worker-ingress role; `None`: the
    /// runtime connection writes them.
    pub audit_url: Option<String>,
    /// Test-only fault injection (see [`KillAfterCommit`]).
    pub kill_after_commit: Option<KillAfterCommit>,
    /// Lanes of group commit: a command about a worker session (its polls, claims and
    /// attempt commands) goes to a lane ([`group`]), which runs the commands queued on it
    /// in one transaction each time ([`PgStore::execute_batch`]). Zero: every command in
    /// a transaction of its own.
    pub lanes: usize,
    /// Commands in flight a lane takes before the next lane takes any: a few agents
    /// share one lane's groups, a busy replica spreads over every lane.
    pub lane_fill: usize,
    /// Most commands one lane's transaction takes.
    pub batch_max: usize,
    /// How long a lane's next group may wait, once its first command is there, for one
    /// command from each agent of the lane's last two groups (see [`group`]): agents
    /// answered together come back together, and one group for all of them costs the
    /// database less than two. Zero runs what is queued at once; a lone agent never
    /// waits. Tokio's timer rounds it up to the next millisecond.
    pub lane_window: Duration,
    /// Most statements each connection keeps prepared; past it, a connection's cache
    /// starts over (each statement dropped is closed on the server). The store's texts
    /// are a few hundred at most (each table's reads and writes, and a wave's merged
    /// writes in a few sizes): the bound keeps the server's memory per connection
    /// bounded whatever the store sends.
    pub prepared_max: usize,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            timings: Timings::default(),
            clock_offset: Arc::new(AtomicI64::new(0)),
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            audit_url: None,
            kill_after_commit: None,
            lanes: 4,
            lane_fill: 16,
            batch_max: 32,
            lane_window: Duration::from_millis(1),
            prepared_max: 512,
        }
    }
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("timings", &self.timings)
            .field("pool_size", &self.pool_size)
            .field("lanes", &self.lanes)
            .field("lane_fill", &self.lane_fill)
            .field("batch_max", &self.batch_max)
            .field("lane_window", &self.lane_window)
            .field("prepared_max", &self.prepared_max)
            .field("audit_url", &self.audit_url.is_some())
            .finish_non_exhaustive()
    }
}

/// The PostgreSQL authority store. Cloning is cheap; clones share the pool and the
/// LISTEN connection, which stops when the last clone is dropped.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

struct Inner {
    pool: Pool,
    audit: Option<Pool>,
    timings: Timings,
    clock_offset: Arc<AtomicI64>,
    wakes: Arc<Wakes>,
    /// Names this store's own notifications, which its listener skips: its long-polls
    /// were woken directly, and only for the sessions a decision concerned.
    nonce: String,
    kill_after_commit: Option<KillAfterCommit>,
    listener: tokio::task::JoinHandle<()>,
    /// Group commit's lanes ([`PgOptions::lanes`]).
    lanes: group::Lanes,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

fn parse_url(url: &str) -> Result<Config, StoreError> {
    // The URL may carry a password: never echo it back.
    Config::from_str(url).map_err(|_| StoreError("the database URL is not a valid PostgreSQL URL".to_owned()))
}

/// Applies the migrations as the owner role at `owner_url`; returns the version found
/// before and the version now.
pub async fn migrate(owner_url: &str) -> Result<(i64, i64), StoreError> {
    let config = parse_url(owner_url)?;
    let mut client = Pool::connect(&config).await?;
    let before = schema::migrate(&mut client).await?;
    Ok((before, SCHEMA_VERSION))
}

impl PgStore {
    /// Connects as the runtime role at `url`, checks the schema version, and starts the
    /// LISTEN connection. Must be called inside a Tokio runtime.
    pub async fn open(url: &str, options: PgOptions) -> Result<Self, StoreError> {
        let config = parse_url(url)?;
        let prepared = options.prepared_max.max(1);
        // Not yet read: the first connection taken reads the version.
        let watch = Arc::new(schema::Watch::default());
        watch.suspect();
        let pool = Pool::new(config.clone(), options.pool_size, options.connect_timeout, prepared, watch.clone());
        pool.get().await?.keep();
        let audit = match &options.audit_url {
            // The ingress role may not read the schema's version: what it does alone (an
            // audit record, an admission's refusal) decides nothing of a run, and every
            // command goes through the runtime pool, which looks.
            Some(u) => {
                let watch = Arc::new(schema::Watch::default());
                Some(Pool::new(parse_url(u)?, options.pool_size.min(4), options.connect_timeout, prepared, watch))
            }
            None => None,
        };
        let wakes = Arc::new(Wakes::default());
        let nonce = IdGen::random().session().to_string();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let listener = tokio::spawn(listen(config, wakes.clone(), watch, nonce.clone(), ready_tx));
        // Listening before the first command: a change committed elsewhere right after
        // `open` returns must not be missed.
        let _ = tokio::time::timeout(options.connect_timeout, ready_rx).await;
        let (lanes, queues) = group::Lanes::new(options.lanes, options.lane_fill);
        let inner = Arc::new(Inner {
            pool,
            audit,
            timings: options.timings,
            clock_offset: options.clock_offset,
            wakes,
            nonce,
            kill_after_commit: options.kill_after_commit,
            listener,
            lanes,
        });
        for queue in queues {
            tokio::spawn(group::lane(Arc::downgrade(&inner), queue, options.batch_max.max(1), options.lane_window));
        }
        Ok(Self { inner })
    }

    fn offset(&self) -> i64 {
        self.inner.clock_offset.load(Ordering::SeqCst)
    }

    /// Closes the idle connections (tests use it after restarting the server).
    pub fn reset_idle(&self) {
        self.inner.pool.clear();
    }

    async fn execute_once(&self, cmd: &Command, audit: Option<&Audit>) -> Result<Result<Reply, ErrorCode>, Error> {
        let mut conn = self.inner.pool.get().await?;
        let mut open = false;
        let done = self.step(&mut conn, cmd, audit, &mut open, true).await?;
        self.committed(&mut conn, std::slice::from_ref(cmd)).await?;
        conn.keep();
        Ok(done.apply(&self.inner.wakes))
    }

    /// [`PgStore::execute_once`], again while cancel sees its run change under it.
    async fn execute_retrying(&self, cmd: &Command, audit: Option<&Audit>) -> Result<Result<Reply, ErrorCode>, Error> {
        for _ in 0..RETRIES {
            match self.execute_once(cmd, audit).await {
                Err(Error::Retry) => continue,
                other => return other,
            }
        }
        Err(Error::Retry)
    }

    /// The test hook of [`PgOptions::kill_after_commit`], once `cmds` committed.
    async fn committed(&self, conn: &mut pool::Conn, cmds: &[Command]) -> Result<(), Error> {
        if self.inner.kill_after_commit.as_ref().is_some_and(|hook| cmds.iter().any(|c| hook(c))) {
            // The connection dies after COMMIT and before the reply: the caller must see
            // `unavailable`, and its replay must find the committed facts.
            let _ = conn.client().execute("SELECT pg_terminate_backend(pg_backend_pid())", &[]).await;
            return Err(Error::Killed);
        }
        Ok(())
    }

    /// One command inside the transaction on `conn`: its load, decision and writes. The
    /// load begins the transaction unless `open` says it is already open (and sets it).
    /// With `alone`, the command ends the transaction too (COMMIT, or ROLLBACK when it
    /// refused and has nothing to record); in a batch, the batch does.
    async fn step(
        &self,
        conn: &mut pool::Conn,
        cmd: &Command,
        audit: Option<&Audit>,
        open: &mut bool,
        alone: bool,
    ) -> Result<Done, Error> {
        let offset = self.offset();
        let admit = match audit {
            Some(Audit { record, admit: Some(serial) }) => match &record.principal {
                Some(principal) => Some(Admit { principal, serial }),
                None => {
                    append_audit(conn, record, ErrorCode::Unauthenticated.as_str(), offset).await?;
                    return Ok(Done::refused(ErrorCode::Unauthenticated));
                }
            },
            _ => None,
        };
        let mut tx = Tx { conn };
        let begin = !std::mem::replace(open, true);
        let loaded = load::load(&mut tx, &cmd.keys(), offset, &self.inner.timings, admit, begin).await?;
        let concluded = self.conclude(cmd, audit.map(|a| &a.record), loaded, offset)?;
        if alone && concluded.rollback {
            tx.finish("ROLLBACK").await?;
            return Ok(concluded.done);
        }
        // Each update counts its own rows ([`found`]). If any statement fails,
        // PostgreSQL refuses every later one in the aborted transaction and turns the
        // COMMIT into a rollback; the failure surfaces from the pipeline, and the
        // connection is discarded.
        let rows = concluded.checks.iter().map(|&update| usize::from(update)).collect();
        let (mut record, mut rows) = found::checked(concluded.record, rows);
        if alone {
            record.push(("COMMIT".into(), Vec::new()));
            rows.push(0);
        }
        if !record.is_empty() {
            let answers = tx.run(&record).await?;
            counted(rows, &answers)?;
        }
        Ok(concluded.done)
    }

    /// What a command's load means: the shared decision ([`core::decide`]) and the
    /// statements that record it — the request's audit records, the decision's writes
    /// and its notification.
    fn conclude(
        &self,
        cmd: &Command,
        audit: Option<&AuditRecord>,
        (mut rows, now, refused): (Rows, Millis, Option<ErrorCode>),
        offset: i64,
    ) -> Result<Concluded, Error> {
        projection::complete(&mut rows);
        let audited = |outcome: &str| -> Statement {
            let principal = audit.and_then(|a| a.principal.as_ref()).map(|p| p.as_str().to_owned());
            let route = audit.map(|a| a.route.clone());
            (
                AUDIT_SQL.into(),
                vec![Box::new(offset), Box::new(principal), Box::new(route), Box::new(outcome.to_owned())],
            )
        };
        if let Some(code) = refused {
            // Refused admission: the refusal alone goes on record, and the locks go.
            return Ok(Concluded::refused(code, vec![audited(code.as_str())]));
        }
        let decision = core::decide(cmd, &rows, now, &self.inner.timings, &mut IdGen::random());
        let mut record: Vec<Statement> = audit.map(|a| audited(&a.outcome)).into_iter().collect();
        let reply = match decision.reply {
            Ok(reply) => reply,
            // A refusal carries no writes by contract; nothing is applied either way.
            Err(code) if audit.is_none() => {
                return Ok(Concluded { rollback: true, ..Concluded::refused(code, record) })
            }
            Err(code) => {
                // Only the request's audit records: the admission and the refusal.
                record.push(audited(code.as_str()));
                return Ok(Concluded::refused(code, record));
            }
        };
        let mut checks = vec![false; record.len()];
        for w in plan(&rows, &decision.writes)? {
            record.push((w.sql, w.params));
            checks.push(w.update);
        }
        if decision.wake || !decision.wants.is_empty() {
            record
                .push(("SELECT pg_notify($1, $2)".into(), vec![Box::new(CHANNEL), Box::new(self.inner.nonce.clone())]));
            checks.push(false);
        }
        let runs = decision.writes.iter().filter_map(|w| if let Write::Run(r) = w { Some(r.id.clone()) } else { None });
        let runs = runs.collect();
        let done = Done { answer: Ok(reply), wake: decision.wake, wants: decision.wants };
        Ok(Concluded { done, record, checks, runs, rollback: false })
    }

    /// A connection inside a REPEATABLE READ, READ ONLY transaction: operator reads see
    /// one snapshot, as of one commit.
    async fn reading(&self) -> Result<Pooled<'_>, Error> {
        let conn = self.inner.pool.get().await?;
        conn.client().batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await.map_err(Error::Pg)?;
        Ok(conn)
    }

    /// Ends a read started by [`PgStore::reading`] and returns its connection.
    async fn done(mut conn: Pooled<'_>) -> Result<(), Error> {
        conn.client().batch_execute("COMMIT").await.map_err(Error::Pg)?;
        conn.keep();
        Ok(())
    }
}

/// A command's answer and whom its decision wakes, once its transaction commits.
struct Done {
    answer: Result<Reply, ErrorCode>,
    wake: bool,
    wants: Vec<core::Want>,
}

impl Done {
    fn refused(code: ErrorCode) -> Self {
        Self { answer: Err(code), wake: false, wants: Vec::new() }
    }

    /// Wakes the long-polls the decision concerns (its transaction committed) and
    /// returns the answer.
    fn apply(self, wakes: &Wakes) -> Result<Reply, ErrorCode> {
        if self.wake {
            wakes.all();
        } else if !self.wants.is_empty() {
            wakes.runs(self.wants);
        }
        self.answer
    }
}

/// One statement of a pipeline, owning its parameters.
pub(super) type Statement = (std::borrow::Cow<'static, str>, rows::Params);

/// A command's decision and the statements that record it ([`PgStore::conclude`]).
struct Concluded {
    done: Done,
    record: Vec<Statement>,
    /// For each statement of `record`: an UPDATE of a loaded row, which must find it.
    checks: Vec<bool>,
    /// The runs the decision writes (a wave of polls: [`polls`]).
    runs: Vec<RunId>,
    /// Refused with nothing to record: alone, the transaction rolls back.
    rollback: bool,
}

impl Concluded {
    fn refused(code: ErrorCode, record: Vec<Statement>) -> Self {
        let checks = vec![false; record.len()];
        Self { done: Done::refused(code), record, checks, runs: Vec::new(), rollback: false }
    }
}

/// An UPDATE of a loaded row that found none would be a lost write. It cannot happen (the
/// row was locked and nothing deletes), and PostgreSQL counts every update's rows itself
/// ([`found`]); a statement sent as it is that must find `n` rows (0: not counted) is
/// counted here, and if it fell short the COMMIT may have run already: fail loudly
/// rather than answer as if it had been written.
fn counted(rows: impl IntoIterator<Item = usize>, answers: &[Vec<Row>]) -> Result<(), Error> {
    if rows.into_iter().zip(answers).any(|(n, got)| n > 0 && got.len() != n) {
        return Err(Error::Corrupt("an update found no row it had loaded".to_owned()));
    }
    Ok(())
}

/// The admission a request still needs decided with its command, if it has a principal.
fn admit_of(audit: Option<&Audit>) -> Option<Admit<'_>> {
    match audit {
        Some(Audit { record, admit: Some(serial) }) => {
            record.principal.as_ref().map(|principal| Admit { principal, serial })
        }
        _ => None,
    }
}

/// An open transaction on a pooled connection. It has no Drop: a transaction that is not
/// finished is ended by closing its connection (the pool discards it), which makes the
/// server roll it back.
pub(crate) struct Tx<'a> {
    conn: &'a mut pool::Conn,
}

fn refs(params: &[Box<dyn ToSql + Sync + Send>]) -> Vec<&(dyn ToSql + Sync)> {
    params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect()
}

impl Tx<'_> {
    async fn exec_simple(&mut self, sql: &str) -> Result<(), Error> {
        self.conn.client().batch_execute(sql).await.map_err(Error::Pg)
    }

    async fn finish(mut self, sql: &str) -> Result<(), Error> {
        self.exec_simple(sql).await
    }

    /// At most one row.
    pub(crate) async fn one(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Option<Row>, Error> {
        let stmt = self.conn.prepare(sql).await?;
        self.conn.client().query_opt(&stmt, params).await.map_err(Error::Pg)
    }

    /// Every row.
    pub(crate) async fn all(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, Error> {
        let stmt = self.conn.prepare(sql).await?;
        self.conn.client().query(&stmt, params).await.map_err(Error::Pg)
    }

    /// A statement without rows (or whose rows do not matter).
    pub(crate) async fn exec(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, Error> {
        let stmt = self.conn.prepare(sql).await?;
        self.conn.client().execute(&stmt, params).await.map_err(Error::Pg)
    }

    /// Runs `batch` as one pipeline: every statement is sent before any answer is
    /// awaited, and the server executes them strictly in order. Returns each one's rows;
    /// the first error fails the whole batch.
    pub(crate) async fn pipeline(
        &mut self,
        batch: &[(&str, Vec<&(dyn ToSql + Sync)>)],
    ) -> Result<Vec<Vec<Row>>, Error> {
        let mut stmts = Vec::with_capacity(batch.len());
        for (sql, _) in batch {
            stmts.push(self.conn.prepare(sql).await?);
        }
        let client = self.conn.client();
        let futures: Vec<_> = stmts.iter().zip(batch).map(|(stmt, (_, params))| client.query(stmt, params)).collect();
        in_order(futures).await.into_iter().map(|r| r.map_err(Error::Pg)).collect()
    }

    /// [`Tx::run`] of a load, after `BEGIN` when `begin` says the transaction is not open
    /// yet (in the same round trip): each load statement's rows, in order.
    pub(crate) async fn begun(
        &mut self,
        begin: bool,
        load: impl IntoIterator<Item = Statement>,
    ) -> Result<std::iter::Skip<std::vec::IntoIter<Vec<Row>>>, Error> {
        let batch: Vec<Statement> = begin.then(|| ("BEGIN".into(), Vec::new())).into_iter().chain(load).collect();
        Ok(self.run(&batch).await?.into_iter().skip(usize::from(begin)))
    }

    /// [`Tx::pipeline`] of statements that own their parameters.
    pub(crate) async fn run(&mut self, batch: &[Statement]) -> Result<Vec<Vec<Row>>, Error> {
        let batch: Vec<(&str, Vec<&(dyn ToSql + Sync)>)> =
            batch.iter().map(|(sql, p)| (sql.as_ref(), refs(p))).collect();
        self.pipeline(&batch).await
    }

    /// DB time (see [`schema::DB_NOW`]).
    pub(crate) async fn now(&mut self, offset: i64) -> Result<i64, Error> {
        let row = self.one(schema::DB_NOW, &[&offset]).await?;
        Ok(row.map_or(0, |r| r.get(0)))
    }
}

/// One write's statement and parameters, and whether it is an UPDATE that must report
/// its row.
struct Planned {
    sql: std::borrow::Cow<'static, str>,
    params: rows::Params,
    update: bool,
}

/// The statements of a decision's writes, in order. A row the command loaded exists and
/// is locked in this transaction: it is updated, in the columns that changed (nothing is
/// sent for a row written as it was); a new one is upserted, history inserted.
fn plan(loaded_rows: &Rows, writes: &[Write]) -> Result<Vec<Planned>, Error> {
    let mut loaded = Loaded::of(loaded_rows);
    let mut planned = Vec::with_capacity(writes.len());
    for write in writes {
        if let Some(why) = loaded.dangling(write) {
            return Err(Error::Dangling(why));
        }
        let (sql, params, update) = match loaded.known(write) {
            None => (write_sql(write).into(), write_params(write)?, false),
            Some(known) => {
                let changed = match known {
                    Known::Session(new, old) => rows::update_changed(new, old)?,
                    Known::Run(new, old) => rows::update_changed(new, old)?,
                    Known::Attempt(new, old) => rows::update_changed(&projection::unwritten(new, old), old)?,
                    Known::Offer(new, old) => rows::update_changed(new, old)?,
                    Known::Lease(new, old) => rows::update_changed(new, old)?,
                };
                // Written as it was: nothing to send.
                let Some((sql, params)) = changed else { continue };
                (sql.into(), params, true)
            }
        };
        // A row written is known from here on, so a second write of it is compared
        // with the first.
        loaded.wrote(write);
        planned.push(Planned { sql, params, update });
    }
    Ok(planned)
}

/// The statement that writes a row the command did not load: an upsert, for history an
/// insert.
fn write_sql(write: &Write) -> &'static str {
    let table = match write {
        Write::Session(_) => &SESSIONS,
        Write::Run(_) => &RUNS,
        Write::Attempt(_) => &ATTEMPTS,
        Write::Offer(_) => &OFFERS,
        Write::Lease(_) => &LEASES,
        // History is only ever appended.
        Write::Event(_) => &EVENTS,
        Write::LogChunk(_) => &LOG_CHUNKS,
        Write::Worker(_) => &WORKERS,
        Write::Certificate(_) => &CERTIFICATES,
        Write::Enrolment(_) => &ENROLMENTS,
        Write::Schedule(_) => &SCHEDULES,
        Write::Fire(_) => &FIRES,
        Write::RemoveSchedule(_) => return "DELETE FROM schedules WHERE name = $1",
        Write::Operator(_) => &OPERATORS,
        Write::Delivery(_) => &DELIVERIES,
        Write::RemoveOperator(_) => return "DELETE FROM operators WHERE name = $1",
        Write::Alive(_) => return ALIVE,
    };
    rows::upsert(table)
}

/// Its parameters.
fn write_params(write: &Write) -> Result<rows::Params, Error> {
    match write {
        Write::Session(s) => rows::params(s),
        Write::Run(r) => rows::params(r),
        Write::Attempt(a) => rows::params(a),
        Write::Offer(o) => rows::params(o),
        Write::Lease(l) => rows::params(l),
        Write::Event(e) => rows::params(e),
        Write::LogChunk(c) => rows::params(c),
        Write::Worker(w) => rows::params(w),
        Write::Certificate(c) => rows::params(c),
        Write::Enrolment(e) => rows::params(e),
        Write::Schedule(x) => rows::params(x),
        Write::Fire(f) => rows::params(f),
        Write::RemoveSchedule(name) | Write::RemoveOperator(name) => Ok(vec![Box::new(name.clone())]),
        Write::Operator(o) => rows::params(o),
        Write::Delivery(d) => rows::params(d),
        Write::Alive(at) => Ok(vec![Box::new(*at)]),
    }
}

/// The LISTEN connection: bumps `changes` on every notification, reconnects when it
/// drops (bumping once, since a notification may have been missed meanwhile), and has
/// the schema looked at again when `migrate` says it moved it or when it listens anew
/// ([`schema::Watch`]).
async fn listen(
    config: Config,
    wakes: Arc<Wakes>,
    watch: Arc<schema::Watch>,
    nonce: String,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let bump = || wakes.all();
    let mut ready = Some(ready);
    let mut backoff = Duration::from_millis(50);
    loop {
        if let Ok((client, mut connection)) = config.connect(tokio_postgres::NoTls).await {
            // The client's request needs the connection polled; both run in this task.
            let mut listening = Box::pin(client.batch_execute("LISTEN ql_changes"));
            let mut listened = false;
            let ended = std::future::poll_fn(|cx| {
                if !listened {
                    match listening.as_mut().poll(cx) {
                        std::task::Poll::Ready(Ok(())) => {
                            listened = true;
                            watch.suspect();
                            bump();
                            if let Some(r) = ready.take() {
                                let _ = r.send(());
                            }
                        }
                        std::task::Poll::Ready(Err(_)) => return std::task::Poll::Ready(()),
                        std::task::Poll::Pending => {}
                    }
                }
                loop {
                    match connection.poll_message(cx) {
                        std::task::Poll::Ready(Some(Ok(tokio_postgres::AsyncMessage::Notification(n)))) => {
                            if n.payload() == schema::MOVED {
                                watch.suspect();
                            }
                            if n.payload() != nonce {
                                bump();
                            }
                        }
                        std::task::Poll::Ready(Some(Ok(_))) => {}
                        std::task::Poll::Ready(Some(Err(_)) | None) => return std::task::Poll::Ready(()),
                        std::task::Poll::Pending => return std::task::Poll::Pending,
                    }
                }
            });
            ended.await;
            if listened {
                backoff = Duration::from_millis(50);
            }
            bump();
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Awaits every future, polling them in order each time: the first poll of a
/// tokio-postgres query sends its request, so the requests leave in this order. (A
/// general-purpose join may poll in another order, which would break the lock order.)
async fn in_order<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pending: Vec<Option<Pin<Box<F>>>> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut done: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut waiting = false;
        for (slot, out) in pending.iter_mut().zip(done.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => waiting = true,
                }
            }
        }
        if waiting {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    done.into_iter().map(|v| v.expect("every future finished")).collect()
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn map_all<T>(rows: Vec<Row>, f: fn(&Row) -> Result<T, Error>) -> Result<Vec<T>, Error> {
    rows.iter().map(f).collect()
}

/// The statement's DB time in milliseconds, before the replica's clock offset.
const DB_NOW_MS: &str = "(floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint";

/// Appends an audit record stamped with DB time: `$1` the clock offset, then principal,
/// route and outcome.
const AUDIT_SQL: &str = "INSERT INTO audit (at, principal, route, outcome) VALUES \
     ((floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + $1::bigint, $2, $3, $4)";

/// DB time and what the admission of a request reads ([`core::admission`]): `$1` the
/// clock offset, `$2` the principal, `$3` the serial of the certificate it presented. Only
/// what the worker-ingress role may read: the worker's switches and the certificate's
/// record. A command reads it as its last load statement, after every lock ([`load`]).
pub(super) const STAMP_ADMIT: &str = "SELECT (floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint \
     + $1::bigint, w.disabled_at, w.revoked_at, c.worker, c.issued_at, c.not_after, c.revoked_at \
     FROM (SELECT 1) one LEFT JOIN workers w ON w.id = $2 LEFT JOIN certificates c ON c.serial = $3";

/// A request to admit with a command: its principal and its certificate's serial.
#[derive(Clone, Copy)]
pub(super) struct Admit<'a> {
    principal: &'a WorkerId,
    serial: &'a str,
}

impl Admit<'_> {
    /// DB time and the admission's refusal, if any, from a row of [`STAMP_ADMIT`].
    pub(super) fn read(&self, row: &Row) -> Result<(Millis, Option<ErrorCode>), Error> {
        let now: Millis = row.get(0);
        let (disabled_at, revoked_at): (Option<i64>, Option<i64>) = (row.get(1), row.get(2));
        let worker = (disabled_at.is_some() || revoked_at.is_some()).then(|| Worker {
            disabled_at,
            revoked_at,
            ..Worker::new(self.principal.clone(), 0)
        });
        let cert = match row.get::<_, Option<String>>(3) {
            None => None,
            Some(w) => Some(Certificate {
                serial: self.serial.to_owned(),
                worker: WorkerId::parse(w.as_str()).map_err(|e| Error::Corrupt(e.to_string()))?,
                issued_at: row.get(4),
                not_after: row.get(5),
                revoked_at: row.get(6),
                renewed_from: None,
            }),
        };
        Ok((now, core::admission(self.principal, worker.as_ref(), cert.as_ref(), now).err()))
    }
}

/// Whether the request `record` is of, presenting the certificate `serial`, is refused
/// ([`core::admission`]), decided on its own (before a request's body).
async fn refusal(
    conn: &mut pool::Conn,
    record: &AuditRecord,
    serial: &str,
    offset: i64,
) -> Result<Option<ErrorCode>, Error> {
    let Some(principal) = &record.principal else {
        return Ok(Some(ErrorCode::Unauthenticated));
    };
    let stmt = conn.prepare(STAMP_ADMIT).await?;
    let row = conn.client().query_one(&stmt, &[&offset, &principal.as_str(), &serial]).await.map_err(Error::Pg)?;
    Ok(Admit { principal, serial }.read(&row)?.1)
}

/// Appends `record` with `outcome`, on its own (outside any transaction of a command).
async fn append_audit(conn: &mut pool::Conn, record: &AuditRecord, outcome: &str, offset: i64) -> Result<(), Error> {
    let stmt = conn.prepare(AUDIT_SQL).await?;
    let principal = record.principal.as_ref().map(|p| p.as_str());
    conn.client().execute(&stmt, &[&offset, &principal, &record.route, &outcome]).await.map_err(Error::Pg)?;
    Ok(())
}

/// How many times a command is run again when cancel saw its run change under it.
const RETRIES: usize = 8;

impl Store for PgStore {
    async fn execute_audited(
        &self,
        cmd: Command,
        audit: Option<Audit>,
    ) -> Result<Result<Reply, ErrorCode>, StoreError> {
        if let Some(session) = group::lane_key(&cmd, audit.as_ref()).filter(|_| self.inner.lanes.on()) {
            return self.in_lane(session, cmd, audit).await.map_err(StoreError::from);
        }
        self.execute_retrying(&cmd, audit.as_ref()).await.map_err(StoreError::from)
    }

    async fn audit(&self, record: AuditRecord) -> Result<(), StoreError> {
        let pool = self.inner.audit.as_ref().unwrap_or(&self.inner.pool);
        let mut conn = pool.get().await?;
        append_audit(&mut conn, &record, &record.outcome, self.offset()).await?;
        conn.keep();
        Ok(())
    }

    async fn admit(&self, record: AuditRecord, serial: String) -> Result<Option<ErrorCode>, StoreError> {
        let pool = self.inner.audit.as_ref().unwrap_or(&self.inner.pool);
        let mut conn = pool.get().await?;
        let refused = refusal(&mut conn, &record, &serial, self.offset()).await?;
        if let Some(code) = refused {
            append_audit(&mut conn, &record, code.as_str(), self.offset()).await?;
        }
        conn.keep();
        Ok(refused)
    }

    async fn prune_audit(&self, retention: AuditRetention) -> Result<u64, StoreError> {
        const SQL: &str = "SELECT prune_audit(\
             (floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + $1::bigint - $2::bigint, $3::bigint)";
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let mut conn = self.inner.pool.get().await?;
        let age = retention.max_age_ms.map(clamp);
        let keep = retention.max_records.map(clamp);
        let row = conn.client().query_one(SQL, &[&self.offset(), &age, &keep]).await.map_err(Error::Pg)?;
        conn.keep();
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    async fn prune_sessions(&self, retention: SessionRetention) -> Result<u64, StoreError> {
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let mut conn = self.inner.pool.get().await?;
        let row = conn
            .client()
            .query_one("SELECT prune_sessions($1, $2)", &[&clamp(retention.kept.max(1)), &clamp(retention.batch)])
            .await
            .map_err(Error::Pg)?;
        conn.keep();
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    async fn prunable_runs(&self, retention: RunRetention) -> Result<Vec<(ProjectId, RunId)>, StoreError> {
        let sql = super::prunable_runs_sql(&format!("{DB_NOW_MS} + $1::bigint - $2::bigint"), "$3");
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let conn = self.reading().await?;
        let found = conn
            .client()
            .query(&sql, &[&self.offset(), &clamp(retention.max_age_ms), &clamp(retention.batch)])
            .await
            .map_err(Error::Pg)?;
        Self::done(conn).await?;
        Ok(found.iter().filter_map(|r| super::ended_run(r.get(0), r.get(1))).collect())
    }

    async fn prune_runs(&self, runs: Vec<RunId>, retention: RunRetention) -> Result<u64, StoreError> {
        if runs.is_empty() {
            return Ok(0);
        }
        let sql = format!("SELECT prune_runs($1::text[], {DB_NOW_MS} + $2::bigint - $3::bigint)");
        let ids: Vec<&str> = runs.iter().map(RunId::as_str).collect();
        let age = i64::try_from(retention.max_age_ms).unwrap_or(i64::MAX);
        let mut conn = self.inner.pool.get().await?;
        let row = conn.client().query_one(&sql, &[&ids, &self.offset(), &age]).await.map_err(Error::Pg)?;
        conn.keep();
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    async fn twin_refusals(&self, within_ms: u64) -> Result<Vec<(WorkerId, u64)>, StoreError> {
        const SQL: &str = "SELECT principal, count(*) FROM audit WHERE route = 'session.open' \
             AND outcome = 'session_conflict' AND principal IS NOT NULL \
             AND at >= (floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + $1::bigint - $2::bigint \
             GROUP BY principal ORDER BY principal";
        let within = i64::try_from(within_ms).unwrap_or(i64::MAX);
        let conn = self.reading().await?;
        let found = conn.client().query(SQL, &[&self.offset(), &within]).await.map_err(Error::Pg)?;
        Self::done(conn).await?;
        found
            .iter()
            .map(|r| {
                let worker: String = r.get(0);
                let n: i64 = r.get(1);
                Ok((WorkerId::parse(worker.as_str()).map_err(|e| StoreError(e.to_string()))?, n.max(0) as u64))
            })
            .collect()
    }

    async fn audits(&self) -> Result<Vec<AuditRecord>, StoreError> {
        let mut conn = self.reading().await?;
        let found = map_all(
            Tx { conn: &mut conn }.all(&format!("SELECT {AUDIT_COLS} FROM audit ORDER BY seq"), &[]).await?,
            rows::read,
        )?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn runs(&self, query: &RunQuery) -> Result<Vec<Run>, StoreError> {
        let sql = format!(
            "SELECT {} FROM runs WHERE ($1::text IS NULL OR schedule = $1) AND ($2::text IS NULL OR status = $2) \
             AND ($4::text IS NULL OR (created_at, id) < (SELECT created_at, id FROM runs WHERE id = $4)) \
             AND ($5::text IS NULL OR id IN (SELECT run_id FROM attempts WHERE worker = $5)) \
             ORDER BY created_at DESC, id DESC LIMIT $3",
            *RUN_COLS
        );
        let (schedule, status) = (query.schedule.as_deref(), query.status.map(|s| s.as_str()));
        let before = query.before.as_ref().map(|r| r.as_str());
        let mut conn = self.reading().await?;
        let worker = query.worker.as_ref().map(|w| w.as_str());
        let params: [&(dyn ToSql + Sync); 5] = [&schedule, &status, &limit(query.limit), &before, &worker];
        let found = map_all(Tx { conn: &mut conn }.all(&sql, &params).await?, rows::read)?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn schedules(&self) -> Result<Vec<Schedule>, StoreError> {
        let sql = format!("SELECT {} FROM schedules ORDER BY name", *SCHEDULE_COLS);
        let mut conn = self.reading().await?;
        let found = map_all(Tx { conn: &mut conn }.all(&sql, &[]).await?, rows::read)?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn stats(&self) -> Result<Vec<crate::store::Stat>, StoreError> {
        let q = crate::store::STATS_SQL
            .replace("{NOW}", "((floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + $1::bigint)")
            .replace("{LENGTH}", "(artifact::jsonb->>'length')::bigint");
        let conn = self.reading().await?;
        let found = conn.client().query(&q, &[&self.offset()]).await.map_err(Error::Pg)?;
        Self::done(conn).await?;
        Ok(found
            .iter()
            .map(|r| crate::store::Stat {
                kind: r.get(0),
                label: r.get(1),
                value: r.get::<_, Option<i64>>(2).unwrap_or(0),
            })
            .collect())
    }

    async fn operators(&self) -> Result<Vec<Operator>, StoreError> {
        let sql = format!("SELECT {OPERATOR_COLS} FROM operators ORDER BY name");
        let mut conn = self.reading().await?;
        let found = map_all(Tx { conn: &mut conn }.all(&sql, &[]).await?, rows::read)?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn fires(&self, schedule: &str, n: usize) -> Result<Vec<Fire>, StoreError> {
        let sql = format!("SELECT {FIRE_COLS} FROM fires WHERE schedule = $1 ORDER BY fire_at DESC LIMIT $2");
        let mut conn = self.reading().await?;
        let found = map_all(Tx { conn: &mut conn }.all(&sql, &[&schedule, &limit(n)]).await?, rows::read)?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn probe(&self) -> Result<(), StoreError> {
        // Generated run ids are `run_` and random characters: this one is never found, and
        // the lookup reads one primary-key index page and nothing more.
        let probe = RunId::parse("watchdog-probe").expect("the probe is a valid run id");
        self.run_detail(&probe).await.map(drop)
    }

    async fn run_detail(&self, run: &RunId) -> Result<Option<RunDetail>, StoreError> {
        let id = run.as_str();
        let mut conn = self.reading().await?;
        let mut tx = Tx { conn: &mut conn };
        let sql = format!("SELECT {} FROM runs WHERE id = $1", *RUN_COLS);
        let Some(run) = tx.one(&sql, &[&id]).await?.as_ref().map(rows::read).transpose()? else {
            Self::done(conn).await?;
            return Ok(None);
        };
        let sql = format!("SELECT {} FROM attempts WHERE run_id = $1 ORDER BY number", *ATTEMPT_COLS);
        let mut attempts: Vec<Attempt> = map_all(tx.all(&sql, &[&id]).await?, rows::read)?;
        let sql = format!("SELECT {} FROM leases WHERE run_id = $1 ORDER BY lease_generation, attempt_id", *LEASE_COLS);
        let leases = map_all(tx.all(&sql, &[&id]).await?, rows::read)?;
        projection::complete_all(&mut attempts, &leases);
        let sql = format!("SELECT {EVENT_COLS} FROM events WHERE run_id = $1 ORDER BY seq");
        let events = map_all(tx.all(&sql, &[&id]).await?, rows::read)?;
        let sql = format!("SELECT {DELIVERY_COLS} FROM deliveries WHERE run_id = $1");
        let delivery = tx.one(&sql, &[&id]).await?.as_ref().map(rows::read).transpose()?;
        Self::done(conn).await?;
        Ok(Some(RunDetail { run, attempts, leases, events, delivery }))
    }

    async fn log_chunks(&self, attempt: &AttemptId, within: Range<u64>) -> Result<Vec<LogChunk>, StoreError> {
        let sql = crate::store::log_chunks_sql('$');
        let [from, to] = crate::store::log_chunk_bounds(&within);
        let mut conn = self.reading().await?;
        let params: [&(dyn ToSql + Sync); 3] = [&attempt.as_str(), &from, &to];
        let found = map_all(Tx { conn: &mut conn }.all(&sql, &params).await?, rows::read)?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn worker_page(&self, after: Option<&WorkerId>, n: usize) -> Result<Vec<super::WorkerEntry>, StoreError> {
        let after = after.map_or("", |w| w.as_str());
        let sessions = format!(
            "SELECT {} FROM sessions s WHERE s.worker = ANY($1::text[]) \
             AND s.generation = (SELECT max(m.generation) FROM sessions m WHERE m.worker = s.worker)",
            *SESSION_COLS
        );
        let records = format!("SELECT {} FROM workers WHERE id = ANY($1::text[])", *WORKER_COLS);
        let certificates =
            format!("SELECT {CERTIFICATE_COLS} FROM certificates WHERE worker = ANY($1::text[]) ORDER BY issued_at DESC, serial DESC");
        let mut conn = self.reading().await?;
        let mut tx = Tx { conn: &mut conn };
        let found = tx.all(&super::worker_ids_sql('$'), &[&after, &limit(n)]).await?;
        let ids: Vec<String> = found.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>().map_err(Error::Pg)?;
        let sessions = map_all(tx.all(&sessions, &[&ids]).await?, rows::read)?;
        let records = map_all(tx.all(&records, &[&ids]).await?, rows::read)?;
        let certificates = map_all(tx.all(&certificates, &[&ids]).await?, rows::read)?;
        Self::done(conn).await?;
        super::entries(ids, sessions, records, certificates)
    }

    async fn certificates(
        &self,
        worker: Option<&WorkerId>,
        after: Option<&str>,
        n: usize,
    ) -> Result<Vec<Certificate>, StoreError> {
        let sql = super::certificates_sql('$', worker.is_some(), after.is_some());
        let (worker, n) = (worker.map(|w| w.to_string()), limit(n));
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::new();
        params.extend(worker.as_ref().map(|w| w as &(dyn ToSql + Sync)));
        params.extend(after.as_ref().map(|a| a as &(dyn ToSql + Sync)));
        params.push(&n);
        let mut conn = self.reading().await?;
        let found = map_all(Tx { conn: &mut conn }.all(&sql, &params).await?, rows::read)?;
        Self::done(conn).await?;
        Ok(found)
    }

    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let mut conn = self.reading().await?;
        let mut tx = Tx { conn: &mut conn };
        let q = |table: &str, cols: &str, order: &str| format!("SELECT {cols} FROM {table} ORDER BY {order}");
        let mut snap = Snapshot {
            sessions: map_all(tx.all(&q("sessions", &SESSION_COLS, "id"), &[]).await?, rows::read)?,
            runs: map_all(tx.all(&q("runs", &RUN_COLS, "id"), &[]).await?, rows::read)?,
            attempts: map_all(tx.all(&q("attempts", &ATTEMPT_COLS, "id"), &[]).await?, rows::read)?,
            offers: map_all(tx.all(&q("offers", &OFFER_COLS, "id"), &[]).await?, rows::read)?,
            leases: map_all(tx.all(&q("leases", &LEASE_COLS, "attempt_id"), &[]).await?, rows::read)?,
            events: map_all(tx.all(&q("events", EVENT_COLS, "seq"), &[]).await?, rows::read)?,
            log_chunks: map_all(
                tx.all(&q("log_chunks", LOG_CHUNK_COLS, "attempt_id, byte_offset"), &[]).await?,
                rows::read,
            )?,
            workers: map_all(tx.all(&q("workers", &WORKER_COLS, "id"), &[]).await?, rows::read)?,
            certificates: map_all(tx.all(&q("certificates", CERTIFICATE_COLS, "serial"), &[]).await?, rows::read)?,
            enrolments: map_all(tx.all(&q("enrolments", ENROLMENT_COLS, "token_digest"), &[]).await?, rows::read)?,
            schedules: map_all(tx.all(&q("schedules", &SCHEDULE_COLS, "name"), &[]).await?, rows::read)?,
            fires: map_all(tx.all(&q("fires", FIRE_COLS, "schedule, fire_at"), &[]).await?, rows::read)?,
            operators: map_all(tx.all(&q("operators", OPERATOR_COLS, "name"), &[]).await?, rows::read)?,
            deliveries: map_all(tx.all(&q("deliveries", DELIVERY_COLS, "run_id"), &[]).await?, rows::read)?,
        };
        Self::done(conn).await?;
        projection::complete_all(&mut snap.attempts, &snap.leases);
        Ok(snap)
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.inner.wakes.subscribe()
    }

    fn wakes_since(&self, seen: u64, now: u64) -> Option<Vec<crate::core::Want>> {
        self.inner.wakes.since(seen, now)
    }

    fn commit_groups(&self) -> Option<GroupCommits> {
        self.inner.lanes.on().then(|| self.group_commits())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit;
    use crate::model::{AttemptStatus, Event};

    #[test]
    fn an_event_naming_a_run_its_command_did_not_load_plans_no_statement() {
        let rows = testkit::world(AttemptStatus::Running);
        let run = rows.run.as_ref().unwrap();
        let event = |run: &str| Event {
            id: "evt_1".parse().unwrap(),
            run: run.parse().unwrap(),
            attempt: run.eq("run_1").then(|| "att_1".parse().unwrap()),
            kind: "attempt.completed".into(),
            from_status: None,
            to_status: None,
            payload: serde_json::json!({}),
            at: 1,
        };
        assert_eq!(run.id.as_str(), "run_1");
        assert_eq!(plan(&rows, &[Write::Event(event("run_1"))]).map(|p| p.len()).ok(), Some(1), "its own run");
        let before = Write::Run(run.clone());
        match plan(&rows, &[before, Write::Event(event("run_9"))]) {
            Err(Error::Dangling(why)) => assert!(why.contains("run_9"), "{why}"),
            other => panic!("planned {:?}", other.map(|p| p.len())),
        }
    }
}
