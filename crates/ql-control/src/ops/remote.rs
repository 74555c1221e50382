//! The operator commands sent to a `serve`'s operator API over HTTPS: the CLI with
//! `--server`. The server's certificate is checked against the CA the operator names
//! (the state directory's `ca.crt`, copied over; it is public); the bearer token is read
//! from a file or `$QL_CONTROL_TOKEN`, held zeroized, and never printed.

use std::io::Read as _;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use zeroize::Zeroizing;

use ql_wire::artifact::Receipt;
use ql_wire::ids::{RunId, WorkerId};
use ql_wire::ErrorCode;

use super::view::{
    CertificateList, Done, LogWindow, RunPage, RunView, ScheduleBody, ScheduleList, ScheduleView, SubmitBody,
    WorkerList,
};
use super::{AccessChange, LogRequest, OpError, RunFilter, ScheduleAction};
use crate::core::Access;

/// The most one answer may carry (a log window is smaller; see the API).
const ANSWER_CAP: u64 = 16 * 1024 * 1024;

/// How to reach a `serve`.
#[derive(Clone)]
pub struct RemoteOptions {
    /// `https://host:port` of its operator listener.
    pub server: String,
    /// The operator token, `<name>.<secret>`.
    pub token: Zeroizing<String>,
    /// The CA certificate (PEM) the server's certificate is checked against.
    pub ca: PathBuf,
    /// A whole call may take this long (a log follow's wait comes on top).
    pub timeout: Duration,
}

impl std::fmt::Debug for RemoteOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteOptions")
            .field("server", &self.server)
            .field("token", &"<redacted>")
            .field("ca", &self.ca)
            .finish()
    }
}

/// A client of one `serve`'s operator API.
pub struct Remote {
    agent: ureq::Agent,
    base: String,
    token: Zeroizing<String>,
    timeout: Duration,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote").field("base", &self.base).field("token", &"<redacted>").finish()
    }
}

fn failed(message: impl Into<String>) -> OpError {
    OpError::new(ErrorCode::Unavailable, message)
}

impl Remote {
    /// A client for `options.server`.
    pub fn new(options: &RemoteOptions) -> Result<Self, OpError> {
        if !options.server.starts_with("https://") {
            return Err(OpError::invalid(format!("--server {:?}: give an https:// URL", options.server)));
        }
        let pem = std::fs::read(&options.ca).map_err(|e| OpError::invalid(format!("{}: {e}", options.ca.display())))?;
        let certs = crate::client::certificates(&pem);
        if certs.is_empty() {
            return Err(OpError::invalid(format!("{}: no certificate in it", options.ca.display())));
        }
        Ok(Self {
            agent: crate::client::agent(&certs, true, None),
            base: options.server.trim_end_matches('/').to_owned(),
            token: options.token.clone(),
            timeout: options.timeout,
        })
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
        wait: Duration,
    ) -> Result<ureq::http::Response<ureq::Body>, OpError> {
        let url = format!("{}{path}", self.base);
        let auth = Zeroizing::new(format!("Bearer {}", self.token.as_str()));
        let limit = Some(self.timeout + wait);
        let sent = match (method, body) {
            ("GET", _) => {
                let mut r =
                    self.agent.get(&url).config().timeout_global(limit).build().header("Authorization", auth.as_str());
                for (k, v) in query {
                    r = r.query(*k, v);
                }
                r.call()
            }
            ("DELETE", _) => self
                .agent
                .delete(&url)
                .config()
                .timeout_global(limit)
                .build()
                .header("Authorization", auth.as_str())
                .call(),
            (m, body) => {
                let builder = if m == "PUT" { self.agent.put(&url) } else { self.agent.post(&url) };
                let r = builder.config().timeout_global(limit).build().header("Authorization", auth.as_str());
                r.header("Content-Type", "application/json").send(&body.unwrap_or_else(|| b"{}".to_vec())[..])
            }
        };
        let mut response = sent.map_err(|e| failed(format!("{}: {e}", self.base)))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let text = response.body_mut().with_config().limit(64 * 1024).read_to_string().unwrap_or_default();
        #[derive(serde::Deserialize)]
        struct Refusal {
            error: ErrorCode,
            #[serde(default)]
            message: Option<String>,
        }
        match serde_json::from_str::<Refusal>(&text) {
            Ok(r) => Err(OpError::new(r.error, r.message.unwrap_or_else(|| format!("refused: {}", r.error)))),
            Err(_) => Err(failed(format!("{}: answered {}", self.base, response.status()))),
        }
    }

    fn json<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
    ) -> Result<T, OpError> {
        let mut response = self.call(method, path, query, body, Duration::ZERO)?;
        let bytes = response
            .body_mut()
            .with_config()
            .limit(ANSWER_CAP)
            .read_to_vec()
            .map_err(|e| failed(format!("{}: {e}", self.base)))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| failed(format!("{}: an answer this CLI cannot read: {e}", self.base)))
    }

    fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T, OpError> {
        self.json("POST", path, &[], Some(serde_json::to_vec(body).expect("a body serialises")))
    }

    /// Queues a run.
    pub fn submit(&self, body: &SubmitBody) -> Result<Done, OpError> {
        self.post("/v1/runs", body)
    }

    /// Cancels a run.
    pub fn cancel(&self, run: &RunId) -> Result<Done, OpError> {
        self.post(&format!("/v1/runs/{run}:cancel"), &serde_json::json!({}))
    }

    /// Lists runs.
    pub fn runs(&self, filter: &RunFilter) -> Result<RunPage, OpError> {
        let mut query = vec![("limit", filter.limit.to_string())];
        query.extend(filter.schedule.clone().map(|s| ("schedule", s)));
        query.extend(filter.status.clone().map(|s| ("status", s)));
        query.extend(filter.before.clone().map(|s| ("before", s)));
        query.extend(filter.worker.clone().map(|s| ("worker", s)));
        self.json("GET", "/v1/runs", &query, None)
    }

    /// One run.
    pub fn run(&self, run: &RunId) -> Result<RunView, OpError> {
        self.json("GET", &format!("/v1/runs/{run}"), &[], None)
    }

    /// A piece of a run's log.
    pub fn log(&self, run: &RunId, request: &LogRequest) -> Result<LogWindow, OpError> {
        let mut query = vec![
            ("offset", request.offset.to_string()),
            ("limit", request.limit.to_string()),
            ("follow", request.follow.to_string()),
            ("waitMs", request.wait_ms.to_string()),
        ];
        query.extend(request.attempt.clone().map(|a| ("attempt", a)));
        let wait = Duration::from_millis(request.wait_ms);
        let mut response = self.call("GET", &format!("/v1/runs/{run}/log"), &query, None, wait)?;
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let sealed = match header("ql-log-receipt") {
            None => None,
            Some(json) => Some(
                serde_json::from_str::<Receipt>(&json)
                    .map_err(|e| failed(format!("{}: a log receipt this CLI cannot read: {e}", self.base)))?,
            ),
        };
        let mut window = LogWindow {
            attempt: header("ql-log-attempt"),
            number: header("ql-log-attempt-number").and_then(|n| n.parse().ok()).unwrap_or(0),
            offset: header("ql-log-offset").and_then(|n| n.parse().ok()).unwrap_or(0),
            bytes: Vec::new(),
            status: header("ql-run-status").unwrap_or_default(),
            terminal: header("ql-run-terminal").as_deref() == Some("true"),
            sealed,
        };
        let cap = request.limit.saturating_add(1).min(ANSWER_CAP);
        response
            .body_mut()
            .as_reader()
            .take(cap)
            .read_to_end(&mut window.bytes)
            .map_err(|e| failed(format!("{}: {e}", self.base)))?;
        Ok(window)
    }

    /// A page of workers, by id, after `after`.
    pub fn workers(&self, limit: usize, after: Option<&str>) -> Result<WorkerList, OpError> {
        let mut query = vec![("limit", limit.to_string())];
        query.extend(after.map(|a| ("after", a.to_owned())));
        self.json("GET", "/v1/workers", &query, None)
    }

    /// A page of the recorded certificates.
    pub fn certificates(
        &self,
        worker: Option<&str>,
        after: Option<&str>,
        limit: usize,
    ) -> Result<CertificateList, OpError> {
        let mut query = vec![("limit", limit.to_string())];
        query.extend(worker.map(|w| ("worker", w.to_owned())));
        query.extend(after.map(|a| ("after", a.to_owned())));
        self.json("GET", "/v1/certificates", &query, None)
    }

    /// Changes a worker's access ([`AccessChange`]).
    pub fn set_access(&self, worker: &WorkerId, change: AccessChange<'_>) -> Result<Done, OpError> {
        let word = match change.access {
            Access::Disable => "disable",
            Access::Enable => "enable",
            Access::Revoke => "revoke",
        };
        let mut body = serde_json::json!({});
        if let Some(serial) = change.serial {
            body["serial"] = serial.into();
        }
        if change.with_renewals {
            body["withRenewals"] = true.into();
        }
        self.post(&format!("/v1/workers/{worker}:{word}"), &body)
    }

    /// Sets the labels the operator vouches for of a worker.
    pub fn label(&self, worker: &WorkerId, labels: &[String]) -> Result<Done, OpError> {
        let labels = crate::admin::labels_of(labels, "label").map_err(OpError::invalid)?;
        let body = serde_json::to_vec(&serde_json::json!({ "labels": labels })).expect("labels serialise");
        self.json("PUT", &format!("/v1/workers/{worker}/labels"), &[], Some(body))
    }

    /// The schedules.
    pub fn schedules(&self) -> Result<ScheduleList, OpError> {
        self.json("GET", "/v1/schedules", &[], None)
    }

    /// One schedule with its recent fires.
    pub fn schedule(&self, name: &str) -> Result<ScheduleView, OpError> {
        crate::core::check_schedule_name(name).map_err(OpError::invalid)?;
        self.json("GET", &format!("/v1/schedules/{name}"), &[], None)
    }

    /// Adds a schedule.
    pub fn add_schedule(&self, body: &ScheduleBody) -> Result<Done, OpError> {
        self.post("/v1/schedules", body)
    }

    /// Pauses, resumes, fires now or removes a schedule.
    pub fn schedule_action(&self, name: &str, action: ScheduleAction) -> Result<Done, OpError> {
        crate::core::check_schedule_name(name).map_err(OpError::invalid)?;
        match action {
            ScheduleAction::Remove => self.json("DELETE", &format!("/v1/schedules/{name}"), &[], None),
            other => self.post(&format!("/v1/schedules/{name}:{}", other.as_str()), &serde_json::json!({})),
        }
    }
}
