//! What the operator commands answer, as plain serialisable values: the operator API's
//! JSON bodies, and what the CLI prints (as text, [`super::text`], or as JSON). The same
//! value comes from the local store and from a remote `serve`, so the CLI prints the same
//! either way. Readers ignore fields they do not know: an older CLI can talk to a newer
//! server.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use ql_wire::artifact::Receipt;
use ql_wire::lease::StopIntent;
use ql_wire::time::Timestamp;

use crate::model::{Attempt, Certificate, Fire, Millis, Run, Schedule};
use crate::store::RunDetail;

/// A time for people and JSON: RFC 3339 UTC.
pub fn time(ms: Millis) -> String {
    Timestamp::from_millis(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

fn opt_time(ms: Option<Millis>) -> Option<String> {
    ms.map(time)
}

/// What to run, as the API takes it (`POST /v1/runs`, and each schedule's run).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SubmitBody {
    /// Project (default `default`).
    #[serde(default = "default_project")]
    pub project: String,
    /// A program and its arguments (or `script`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A script and its interpreter (or `argv`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<ScriptBody>,
    /// Added to the job's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Time limit in milliseconds (default one hour).
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// Bytes of log kept (default 1 MiB).
    #[serde(default = "default_log_limit")]
    pub log_limit_bytes: u64,
    /// Labels the operator gave the worker that it must carry.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Labels the worker's agent must declare.
    #[serde(default)]
    pub agent_labels: BTreeMap<String, String>,
    /// Times a run whose worker vanished is queued again.
    #[serde(default)]
    pub retries: u32,
    /// A webhook told of the run's end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifyBody>,
}

/// A webhook: where to POST a run's end, and which ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NotifyBody {
    /// An `http://` or `https://` URL.
    pub url: String,
    /// `all` (default) or `failure` (`failed` and `timed_out`).
    #[serde(default = "all")]
    pub on: String,
}

fn all() -> String {
    "all".into()
}

fn default_project() -> String {
    "default".into()
}
fn default_timeout() -> u64 {
    3_600_000
}
fn default_log_limit() -> u64 {
    1_048_576
}

/// A script to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScriptBody {
    /// `sh`, `python3` or `node`.
    pub interpreter: String,
    /// The script's text.
    pub source: String,
}

/// A schedule, as the API takes it (`POST /v1/schedules`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScheduleBody {
    /// Its name.
    pub name: String,
    /// Five fields, or six with seconds first.
    pub cron: String,
    /// IANA time zone (default UTC).
    #[serde(default = "utc")]
    pub tz: String,
    /// Random delay of each fire, in milliseconds.
    #[serde(default)]
    pub random_delay_ms: u64,
    /// `skip` (default), `queue` or `allow`.
    #[serde(default = "skip")]
    pub overlap: String,
    /// `none` (default) or `once`.
    #[serde(default = "none")]
    pub catch_up: String,
    /// What each fire runs.
    pub run: SubmitBody,
}

fn utc() -> String {
    "UTC".into()
}
fn skip() -> String {
    "skip".into()
}
fn none() -> String {
    "none".into()
}

/// What a change did: a sentence for people, and the run it made, if any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Done {
    /// What happened.
    pub message: String,
    /// The run submitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
}

impl Done {
    /// A change with nothing but its sentence.
    pub fn said(message: impl Into<String>) -> Self {
        Self { message: message.into(), run_id: None }
    }
}

/// One run in a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunRow {
    /// Its id.
    pub run_id: String,
    /// Its project.
    pub project: String,
    /// Its status.
    pub status: String,
    /// Attempts made.
    pub attempts: u32,
    /// Submitted at.
    pub created_at: String,
    /// Ended at.
    pub finished_at: Option<String>,
    /// The schedule that submitted it.
    pub schedule: Option<String>,
    /// Why it failed.
    pub error_code: Option<String>,
}

impl From<&Run> for RunRow {
    fn from(r: &Run) -> Self {
        Self {
            run_id: r.id.to_string(),
            project: r.project.to_string(),
            status: r.status.as_str().into(),
            attempts: r.attempts,
            created_at: time(r.created_at),
            finished_at: opt_time(r.finished_at),
            schedule: r.schedule.clone(),
            error_code: r.error_code.clone(),
        }
    }
}

/// A page of runs, newest first; `next` asks for the page after it (`before=`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunPage {
    /// The runs.
    pub runs: Vec<RunRow>,
    /// The last run of a full page: pass it as `before` for the next one.
    pub next: Option<String>,
}

/// A run with its attempts, leases and events (no token digest anywhere).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunView {
    /// Its id.
    pub run_id: String,
    /// Its project.
    pub project: String,
    /// Its status.
    pub status: String,
    /// A stop the operator or the clock asked for.
    pub stop: Option<StopIntent>,
    /// Labels the worker must carry (the operator's).
    pub labels: BTreeMap<String, String>,
    /// Labels the agent must declare.
    pub agent_labels: BTreeMap<String, String>,
    /// Why it failed.
    pub error_code: Option<String>,
    /// A short summary.
    pub summary: Option<String>,
    /// The schedule that submitted it.
    #[serde(default)]
    pub schedule: Option<String>,
    /// Its attempts, oldest first.
    pub attempts: Vec<AttemptView>,
    /// Its leases, oldest first.
    pub leases: Vec<LeaseView>,
    /// Its events, in commit order.
    pub events: Vec<EventView>,
    /// Its webhook delivery.
    #[serde(default)]
    pub delivery: Option<DeliveryView>,
    /// Submitted at.
    pub created_at: String,
    /// Running since.
    pub started_at: Option<String>,
    /// Ended at.
    pub finished_at: Option<String>,
}

/// A run's webhook delivery: where it stands (the URL's origin only: the rest may be a
/// receiver's secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    /// Scheme, host and port of the URL.
    pub origin: String,
    /// `all` or `failure`.
    pub on: String,
    /// `waiting`, `pending`, `delivered`, `failed` or `skipped`.
    pub state: String,
    /// Sends tried.
    pub attempts: u32,
    /// Why the last send failed.
    pub last_error: Option<String>,
    /// Last changed at.
    pub updated_at: String,
}

pub use crate::model::url_origin as origin;

/// One attempt of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttemptView {
    /// Its id.
    pub attempt_id: String,
    /// 1 for the first.
    pub number: u32,
    /// Its status.
    pub status: String,
    /// The worker it was offered to.
    pub worker: String,
    /// That worker's session.
    pub session_id: String,
    /// The offer.
    pub offer_id: String,
    /// The lease's generation and version, once claimed.
    pub lease_generation: Option<u64>,
    /// The lease's version.
    pub lease_version: Option<u64>,
    /// The worker's handle of the job.
    pub executor_handle: Option<String>,
    /// The job's exit code.
    pub exit_code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// The stored log's receipt.
    pub artifact: Option<Receipt>,
    /// Bytes of live log acknowledged.
    #[serde(default)]
    pub log_acked: u64,
    /// Why it failed.
    pub error_code: Option<String>,
    /// A short summary.
    pub summary: Option<String>,
    /// Started at.
    pub started_at: Option<String>,
    /// Ended at.
    pub ended_at: Option<String>,
}

/// One lease of a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseView {
    /// Its attempt.
    pub attempt_id: String,
    /// `leased`, `released`, `expired`.
    pub state: String,
    /// Its version.
    pub version: u64,
    /// Its generation.
    pub generation: u64,
    /// It lapses at.
    pub expires_at: String,
}

/// One event of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    /// Its id.
    pub event_id: String,
    /// Its attempt.
    pub attempt_id: Option<String>,
    /// Its type.
    #[serde(rename = "type")]
    pub kind: String,
    /// Status before.
    pub from: Option<String>,
    /// Status after.
    pub to: Option<String>,
    /// Its facts.
    pub payload: serde_json::Value,
    /// Recorded at.
    pub at: String,
}

fn attempt_view(a: &Attempt) -> AttemptView {
    AttemptView {
        attempt_id: a.id.to_string(),
        number: a.number,
        status: a.status.as_str().into(),
        worker: a.worker.to_string(),
        session_id: a.session.to_string(),
        offer_id: a.offer.to_string(),
        lease_generation: a.lease.as_ref().map(|l| l.lease_generation.get()),
        lease_version: a.lease.as_ref().map(|l| l.version.get()),
        executor_handle: a.executor_handle.as_ref().map(|h| h.as_str().to_owned()),
        exit_code: a.exit_code,
        signal: a.signal,
        artifact: a.artifact.clone(),
        log_acked: a.log_acked,
        error_code: a.error_code.clone(),
        summary: a.summary.clone(),
        started_at: opt_time(a.started_at),
        ended_at: opt_time(a.ended_at),
    }
}

impl From<&RunDetail> for RunView {
    fn from(d: &RunDetail) -> Self {
        let r = &d.run;
        Self {
            run_id: r.id.to_string(),
            project: r.project.to_string(),
            status: r.status.as_str().into(),
            stop: r.stop,
            labels: r.labels.clone(),
            agent_labels: r.agent_labels.clone(),
            error_code: r.error_code.clone(),
            summary: r.summary.clone(),
            schedule: r.schedule.clone(),
            attempts: d.attempts.iter().map(attempt_view).collect(),
            leases: d
                .leases
                .iter()
                .map(|l| LeaseView {
                    attempt_id: l.attempt.to_string(),
                    state: l.state.as_str().into(),
                    version: l.facts.version.get(),
                    generation: l.facts.lease_generation.get(),
                    expires_at: time(l.facts.expires_at),
                })
                .collect(),
            events: d
                .events
                .iter()
                .map(|e| EventView {
                    event_id: e.id.to_string(),
                    attempt_id: e.attempt.as_ref().map(ToString::to_string),
                    kind: e.kind.clone(),
                    from: e.from_status.clone(),
                    to: e.to_status.clone(),
                    payload: e.payload.clone(),
                    at: time(e.at),
                })
                .collect(),
            delivery: d.delivery.as_ref().map(|x| DeliveryView {
                origin: origin(&x.url),
                on: x.on.as_str().into(),
                state: x.state.as_str().into(),
                attempts: x.attempts,
                last_error: x.last_error.clone(),
                updated_at: time(x.updated_at),
            }),
            created_at: time(r.created_at),
            started_at: opt_time(r.started_at),
            finished_at: opt_time(r.finished_at),
        }
    }
}

/// One worker: its newest session's facts, its access and certificates, its labels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerRow {
    /// The worker.
    pub worker: String,
    /// Its newest session (none: a worker known by its record or certificates only).
    pub session: Option<String>,
    /// The session's generation.
    pub generation: Option<u64>,
    /// The session's state.
    pub status: Option<String>,
    /// Jobs it runs at once.
    pub capacity: Option<u32>,
    /// Last heard from.
    pub last_seen: Option<String>,
    /// Agent version and CPU.
    pub agent: Option<String>,
    /// Session opens refused in the last hour as a twin's.
    pub twins: u64,
    /// `active`, `disabled` or `revoked`.
    pub access: String,
    /// The latest not-after of its certificates still valid.
    pub cert_not_after: Option<String>,
    /// Labels the operator vouches for.
    pub labels: BTreeMap<String, String>,
    /// Labels its agent declared.
    pub declared: BTreeMap<String, String>,
}

/// The workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerList {
    /// One row per worker, by id, each with its newest session.
    pub workers: Vec<WorkerRow>,
    /// The last worker of a full page: pass it as `after` for the next one.
    #[serde(default)]
    pub next: Option<String>,
}

/// One recorded certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertificateRow {
    /// The worker it names.
    pub worker: String,
    /// Its serial (hex).
    pub serial: String,
    /// Recorded at.
    pub issued_at: String,
    /// Valid until.
    pub not_after: String,
    /// Revoked at.
    pub revoked_at: Option<String>,
    /// The serial of the certificate its worker renewed to get it (absent from an older
    /// server's answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewed_from: Option<String>,
}

impl From<&Certificate> for CertificateRow {
    fn from(c: &Certificate) -> Self {
        Self {
            worker: c.worker.to_string(),
            serial: c.serial.clone(),
            issued_at: time(c.issued_at),
            not_after: time(c.not_after),
            revoked_at: opt_time(c.revoked_at),
            renewed_from: c.renewed_from.clone(),
        }
    }
}

/// The recorded certificates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertificateList {
    /// By worker, newest first.
    pub certificates: Vec<CertificateRow>,
    /// The last serial of a full page: pass it as `after` for the next one.
    #[serde(default)]
    pub next: Option<String>,
}

/// One schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScheduleRow {
    /// Its name.
    pub name: String,
    /// Its cron expression.
    pub cron: String,
    /// Its time zone.
    pub tz: String,
    /// `skip`, `queue` or `allow`.
    pub overlap: String,
    /// `none` or `once`.
    pub catch_up: String,
    /// Random delay of each fire, in milliseconds.
    pub random_delay_ms: u64,
    /// The project of its runs.
    pub project: String,
    /// Retries of each run.
    pub retries: u32,
    /// Paused.
    pub paused: bool,
    /// Its next fire (none while paused).
    pub next_fire: Option<String>,
    /// The last run it submitted.
    pub last_run: Option<String>,
}

impl From<&Schedule> for ScheduleRow {
    fn from(s: &Schedule) -> Self {
        Self {
            name: s.name.clone(),
            cron: s.cron.clone(),
            tz: s.tz.clone(),
            overlap: s.overlap.as_str().into(),
            catch_up: s.catch_up.as_str().into(),
            random_delay_ms: s.random_delay_ms,
            project: s.submit.project.to_string(),
            retries: s.submit.retry_budget,
            paused: s.paused,
            next_fire: (!s.paused).then(|| time(s.due_at)),
            last_run: s.last_run.as_ref().map(ToString::to_string),
        }
    }
}

/// The schedules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScheduleList {
    /// By name.
    pub schedules: Vec<ScheduleRow>,
}

/// One fire of a schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FireRow {
    /// The time it was for.
    pub fire_at: String,
    /// `queued`, `skipped` or `missed`.
    pub outcome: String,
    /// The run it queued.
    pub run_id: Option<String>,
}

impl From<&Fire> for FireRow {
    fn from(f: &Fire) -> Self {
        Self {
            fire_at: time(f.fire_at),
            outcome: f.outcome.as_str().into(),
            run_id: f.run.as_ref().map(ToString::to_string),
        }
    }
}

/// A schedule with its recent fires, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScheduleView {
    /// The schedule.
    pub schedule: ScheduleRow,
    /// Its recent fires.
    pub fires: Vec<FireRow>,
}

/// A piece of a run's log (`GET /v1/runs/{id}/log`): the latest attempt's, from an offset.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogWindow {
    /// The attempt whose log it is (none: no log yet).
    pub attempt: Option<String>,
    /// That attempt's number.
    pub number: u32,
    /// Where `bytes` start in that attempt's log.
    pub offset: u64,
    /// The bytes.
    pub bytes: Vec<u8>,
    /// The run's status.
    pub status: String,
    /// Whether the run has ended.
    pub terminal: bool,
    /// The stored log's receipt, when `bytes` end where it ends (nothing follows).
    pub sealed: Option<Receipt>,
}
