//! The operator's commands, one implementation for every way of reaching the authority.
//!
//! [`Local`] does each command on a store and an artifact store — the CLI with `--dir` or
//! `--database`, and the operator API's handlers in `serve` ([`crate::api`]), so a
//! remote command is decided by exactly the code a local one is. [`Remote`] sends the same
//! command to that API over HTTPS (the CLI with `--server`). Both answer the values of
//! [`view`], which [`text`] prints for people; [`Target`] is whichever of the two the CLI
//! was pointed at.

pub mod local;
mod remote;
pub mod text;
pub mod view;

pub use local::Local;
pub use remote::{Remote, RemoteOptions};

use ql_wire::ids::{RunId, WorkerId};
use ql_wire::ErrorCode;

use crate::admin::Authority;
use crate::blob::any::Blobs;
use crate::core::Access;
use crate::store::StoreError;
use view::{
    CertificateList, Done, LogWindow, RunPage, RunView, ScheduleBody, ScheduleList, ScheduleView, SubmitBody,
    WorkerList,
};

/// What an operator changes of a worker's access: disable, enable or revoke it whole, or
/// revoke one of its certificates by serial (with `with_renewals`, and every certificate
/// renewed from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessChange<'a> {
    /// Disable, enable or revoke.
    pub access: Access,
    /// One certificate (revoke only), as `workers certificates` shows its serial.
    pub serial: Option<&'a str>,
    /// With `serial`: the certificates renewed from it too.
    pub with_renewals: bool,
}

/// Why an operator command did not happen: the API's `{error}` code and a sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError {
    /// The code, as the worker protocol's.
    pub code: ErrorCode,
    /// What to tell the operator.
    pub message: String,
}

impl OpError {
    /// An error with `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// Bad input.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// Nothing of that name.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<StoreError> for OpError {
    fn from(e: StoreError) -> Self {
        Self::new(ErrorCode::Unavailable, e.to_string())
    }
}

impl From<OpError> for String {
    fn from(e: OpError) -> Self {
        e.message
    }
}

/// Which runs to list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunFilter {
    /// Only this schedule's.
    pub schedule: Option<String>,
    /// Only with this status.
    pub status: Option<String>,
    /// At most this many (capped at [`MAX_PAGE`]).
    pub limit: usize,
    /// Only older than this run (the next page).
    pub before: Option<String>,
    /// Only runs offered to this worker.
    pub worker: Option<String>,
}

/// The most rows one list answers.
pub const MAX_PAGE: usize = 500;

/// What to do to a schedule by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleAction {
    /// Fire nothing until resumed.
    Pause,
    /// Fire again from the next time after now.
    Resume,
    /// Submit its run now.
    RunNow,
    /// Remove it (its runs stay).
    Remove,
}

impl ScheduleAction {
    /// The action a POST names (`pause`, `resume`, `run-now`; removing is a DELETE).
    pub fn posted(word: &str) -> Option<Self> {
        match word {
            "pause" => Some(Self::Pause),
            "resume" => Some(Self::Resume),
            "run-now" => Some(Self::RunNow),
            _ => None,
        }
    }

    /// The word in the API's path (`:pause`) and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::RunNow => "run-now",
            Self::Remove => "remove",
        }
    }
}

/// What to ask of a worker's log window.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogRequest {
    /// The attempt whose log was being read; another one starts at 0.
    pub attempt: Option<String>,
    /// The first byte wanted.
    pub offset: u64,
    /// At most this many bytes.
    pub limit: u64,
    /// Following a live run: its newest attempt, and the live chunks until it ends.
    pub follow: bool,
    /// With `follow`, how long to wait for more when there is none yet.
    pub wait_ms: u64,
}

/// The authority the CLI was pointed at: the state directory or database, or a `serve`.
#[derive(Debug)]
// One per process.
#[allow(clippy::large_enum_variant)]
pub enum Target {
    /// `--dir` / `--database`.
    Local(Local<Authority, Blobs>),
    /// `--server`.
    Remote(Remote),
}

/// Forwards one command to whichever side the target is.
macro_rules! forward {
    ($self:ident . $method:ident ( $($arg:expr),* )) => {
        match $self {
            Target::Local(l) => l.$method($($arg),*).await,
            Target::Remote(r) => r.$method($($arg),*),
        }
    };
}

impl Target {
    /// Queues a run.
    pub async fn submit(&self, body: &SubmitBody) -> Result<Done, OpError> {
        forward!(self.submit(body))
    }
    /// Cancels a run.
    pub async fn cancel(&self, run: &RunId) -> Result<Done, OpError> {
        forward!(self.cancel(run))
    }
    /// Lists runs.
    pub async fn runs(&self, filter: &RunFilter) -> Result<RunPage, OpError> {
        forward!(self.runs(filter))
    }
    /// One run.
    pub async fn run(&self, run: &RunId) -> Result<RunView, OpError> {
        forward!(self.run(run))
    }
    /// A piece of a run's log.
    pub async fn log(&self, run: &RunId, request: &LogRequest) -> Result<LogWindow, OpError> {
        forward!(self.log(run, request))
    }
    /// A page of workers, by id, after `after`.
    pub async fn workers(&self, limit: usize, after: Option<&str>) -> Result<WorkerList, OpError> {
        forward!(self.workers(limit, after))
    }
    /// A page of the recorded certificates ([`crate::ops::Local::certificates`]).
    pub async fn certificates(
        &self,
        worker: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<CertificateList, OpError> {
        forward!(self.certificates(worker, after, limit))
    }
    /// Changes a worker's access ([`AccessChange`]).
    pub async fn set_access(&self, worker: &WorkerId, change: AccessChange<'_>) -> Result<Done, OpError> {
        forward!(self.set_access(worker, change))
    }
    /// Sets the labels the operator vouches for of a worker.
    pub async fn label(&self, worker: &WorkerId, labels: &[String]) -> Result<Done, OpError> {
        forward!(self.label(worker, labels))
    }
    /// The schedules.
    pub async fn schedules(&self) -> Result<ScheduleList, OpError> {
        forward!(self.schedules())
    }
    /// One schedule with its recent fires.
    pub async fn schedule(&self, name: &str) -> Result<ScheduleView, OpError> {
        forward!(self.schedule(name))
    }
    /// Adds a schedule.
    pub async fn add_schedule(&self, body: &ScheduleBody) -> Result<Done, OpError> {
        forward!(self.add_schedule(body))
    }
    /// Pauses, resumes, fires or removes a schedule.
    pub async fn schedule_action(&self, name: &str, action: ScheduleAction) -> Result<Done, OpError> {
        forward!(self.schedule_action(name, action))
    }
}
