//! One operator API request: the bearer token checked first (nothing of an
//! unauthenticated request is read past its head), then the route, its role, its body,
//! and the operator command it names. Answers are JSON, and refusals
//! `{"error": code, "message": ...}` with the worker protocol's codes and statuses.
//!
//! | method | path | role | command |
//! |---|---|---|---|
//! | GET | `/metrics` | read | the OpenMetrics text ([`crate::metrics`]) |
//! | GET | `/v1/runs?status=&schedule=&worker=&limit=&before=` | read | runs, newest first, a page |
//! | POST | `/v1/runs` | admin | submit |
//! | GET | `/v1/runs/{run}` | read | show |
//! | POST | `/v1/runs/{run}:cancel` | admin | cancel |
//! | GET | `/v1/runs/{run}/log?attempt=&offset=&limit=&follow=&waitMs=` | read | logs |
//! | GET | `/v1/workers?limit=&after=` | read | workers |
//! | POST | `/v1/workers/{w}:disable`, `:enable`, `:revoke` | admin | workers disable, ... |
//! | PUT | `/v1/workers/{w}/labels` | admin | label |
//! | GET | `/v1/certificates?worker=&limit=&after=` | read | workers certificates |
//! | GET | `/v1/schedules` | read | schedule list |
//! | POST | `/v1/schedules` | admin | schedule add |
//! | GET | `/v1/schedules/{name}` | read | schedule show |
//! | POST | `/v1/schedules/{name}:pause`, `:resume`, `:run-now` | admin | schedule pause, ... |
//! | DELETE | `/v1/schedules/{name}` | admin | schedule remove |

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

use ql_wire::capability::Token;
use ql_wire::ids::{RunId, WorkerId};
use ql_wire::ErrorCode;

use super::ApiConfig;
use crate::blob::BlobStore;
use crate::core::Access;
use crate::model::Role;
use crate::ops::{AccessChange, Local, LogRequest, OpError, RunFilter, ScheduleAction};
use crate::store::Store;

/// What every request of a listener shares.
pub(super) struct Shared<S, B> {
    pub(super) local: Local<S, B>,
    pub(super) config: ApiConfig,
    pub(super) metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    pub(super) web: Option<crate::web::Web>,
}

type Answer = Response<Full<Bytes>>;

/// The route a request names, with what it needs.
enum Route {
    Metrics,
    Runs,
    Submit,
    Run(RunId),
    Cancel(RunId),
    Log(RunId),
    Workers,
    Access(WorkerId, Access),
    Labels(WorkerId),
    Certificates,
    Schedules,
    AddSchedule,
    Schedule(String),
    ScheduleAction(String, ScheduleAction),
}

impl Route {
    /// The route of `method` and `path`; `None`: no such route.
    fn of(method: &Method, path: &str) -> Option<Route> {
        if (method, path) == (&Method::GET, "/metrics") {
            return Some(Route::Metrics);
        }
        let parts: Vec<&str> = path.strip_prefix("/v1/")?.split('/').collect();
        let run = |s: &str| RunId::parse(s).ok();
        let worker = |s: &str| WorkerId::parse(s).ok();
        let name = |s: &str| crate::core::check_schedule_name(s).ok().map(|()| s.to_owned());
        Some(match (method, parts.as_slice()) {
            (&Method::GET, ["runs"]) => Route::Runs,
            (&Method::POST, ["runs"]) => Route::Submit,
            (&Method::GET, ["runs", id]) => Route::Run(run(id)?),
            (&Method::POST, ["runs", action]) => match action.split_once(':')? {
                (id, "cancel") => Route::Cancel(run(id)?),
                _ => return None,
            },
            (&Method::GET, ["runs", id, "log"]) => Route::Log(run(id)?),
            (&Method::GET, ["workers"]) => Route::Workers,
            (&Method::POST, ["workers", action]) => {
                let (w, word) = action.split_once(':')?;
                let access = match word {
                    "disable" => Access::Disable,
                    "enable" => Access::Enable,
                    "revoke" => Access::Revoke,
                    _ => return None,
                };
                Route::Access(worker(w)?, access)
            }
            (&Method::PUT, ["workers", w, "labels"]) => Route::Labels(worker(w)?),
            (&Method::GET, ["certificates"]) => Route::Certificates,
            (&Method::GET, ["schedules"]) => Route::Schedules,
            (&Method::POST, ["schedules"]) => Route::AddSchedule,
            (&Method::GET, ["schedules", n]) => Route::Schedule(name(n)?),
            (&Method::DELETE, ["schedules", n]) => Route::ScheduleAction(name(n)?, ScheduleAction::Remove),
            (&Method::POST, ["schedules", action]) => {
                let (n, word) = action.split_once(':')?;
                Route::ScheduleAction(name(n)?, ScheduleAction::posted(word)?)
            }
            _ => return None,
        })
    }

    /// The role the route needs: looking is `read`, changing is `admin`.
    fn role(&self) -> Role {
        match self {
            Route::Metrics | Route::Runs | Route::Run(_) | Route::Log(_) | Route::Workers | Route::Certificates => {
                Role::Read
            }
            Route::Schedules | Route::Schedule(_) => Role::Read,
            _ => Role::Admin,
        }
    }
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Answer {
    let mut answer = Response::new(Full::new(Bytes::from(serde_json::to_vec(body).expect("an answer serialises"))));
    *answer.status_mut() = status;
    answer.headers_mut().insert("content-type", "application/json".parse().expect("a header value"));
    answer.headers_mut().insert("cache-control", "no-store".parse().expect("a header value"));
    answer
}

/// A refusal: the code's status, `{error, message}`.
pub(super) fn refuse(e: &OpError) -> Answer {
    let status = StatusCode::from_u16(e.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut answer = json(status, &serde_json::json!({ "error": e.code, "message": e.message }));
    if e.code == ErrorCode::Unauthenticated {
        answer.headers_mut().insert("www-authenticate", "Bearer".parse().expect("a header value"));
    }
    answer
}

fn answer<T: Serialize>(result: Result<T, OpError>) -> Answer {
    match result {
        Ok(body) => json(StatusCode::OK, &body),
        Err(e) => refuse(&e),
    }
}

/// The role of the request's bearer token, or why it has none.
async fn authenticate<S: Store, B: BlobStore>(
    shared: &Shared<S, B>,
    request: &Request<Incoming>,
) -> Result<Role, OpError> {
    let unauthenticated =
        || OpError::new(ErrorCode::Unauthenticated, "give an operator token: Authorization: Bearer <token>");
    let header = request.headers().get("authorization").and_then(|v| v.to_str().ok()).ok_or_else(unauthenticated)?;
    let presented = header.strip_prefix("Bearer ").ok_or_else(unauthenticated)?;
    let (name, secret) = presented.trim().rsplit_once('.').ok_or_else(unauthenticated)?;
    let secret = Token::parse(secret).map_err(|_| unauthenticated())?;
    // The database's own words stay in the server's log, not in an unauthenticated answer.
    let operators = shared.local.store.operators().await.map_err(|e| {
        eprintln!("ql-control: operator API: {e}");
        OpError::new(ErrorCode::Unavailable, "the database is unreachable; try again")
    })?;
    let found = operators.iter().find(|o| o.name == name);
    // Every token may look; what it may change is the route's to say.
    crate::core::authorize(found, &secret.digest(), Role::Read).map_err(|_| unauthenticated())
}

fn query(request: &Request<Incoming>) -> BTreeMap<String, String> {
    crate::web::pairs(request.uri().query().unwrap_or(""))
}

fn number<T: std::str::FromStr>(q: &BTreeMap<String, String>, key: &str, default: T) -> Result<T, OpError> {
    match q.get(key) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| OpError::invalid(format!("{key}={v:?} is not a number"))),
    }
}

/// The body's length as the request's `Content-Length` declares it.
fn declared_length(request: &Request<Incoming>) -> Option<u64> {
    request.headers().get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok())
}

async fn body<T: DeserializeOwned>(request: Request<Incoming>, limits: (usize, Duration)) -> Result<T, OpError> {
    let (cap, timeout) = limits;
    let json_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json_type {
        return Err(OpError::new(ErrorCode::UnsupportedMediaType, "send Content-Type: application/json"));
    }
    if declared_length(&request).is_some_and(|n| n > cap as u64) {
        // Read what was sent before refusing it (a bounded amount, for a bounded time):
        // closing on unread bytes makes the kernel reset the connection, which can
        // destroy the refusal before the client reads it.
        let mut body = request.into_body();
        let drain = async {
            let mut left = 16 * cap as u64;
            while let Some(Ok(frame)) = body.frame().await {
                let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                left = left.saturating_sub(n);
                if left == 0 {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, drain).await;
        return Err(OpError::new(ErrorCode::PayloadTooLarge, format!("a body of at most {cap} bytes")));
    }
    let collected = tokio::time::timeout(timeout, Limited::new(request.into_body(), cap).collect())
        .await
        .map_err(|_| OpError::invalid(format!("the body did not arrive within {} s", timeout.as_secs())))?;
    let bytes = collected
        .map_err(|_| OpError::new(ErrorCode::PayloadTooLarge, format!("a body of at most {cap} bytes")))?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| OpError::invalid(format!("the body: {e}")))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AccessBody {
    #[serde(default)]
    serial: Option<String>,
    #[serde(default, rename = "withRenewals")]
    with_renewals: bool,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LabelsBody {
    labels: BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

/// The answer to `request` ([`handle`]). A refusal of a request that came with a body
/// says `Connection: close`: it may have been given before the body was read (who asks
/// and the route come first), and hyper then closes the connection after it, so a client
/// must not send its next request on this one.
pub(super) async fn answered<S: Store, B: BlobStore>(shared: &Shared<S, B>, request: Request<Incoming>) -> Answer {
    let carries_body =
        declared_length(&request).is_some_and(|n| n > 0) || request.headers().contains_key("transfer-encoding");
    let mut answer = handle(shared, request).await;
    let refused = answer.status().is_client_error() || answer.status().is_server_error();
    if carries_body && refused {
        answer.headers_mut().insert("connection", "close".parse().expect("a header value"));
    }
    answer
}

/// Answers one request.
async fn handle<S: Store, B: BlobStore>(shared: &Shared<S, B>, request: Request<Incoming>) -> Answer {
    // The dashboard signs its operators in with a cookie of its own (see `web`).
    if let Some(web) = &shared.web {
        if request.uri().path() == "/ui" || request.uri().path().starts_with("/ui/") {
            return crate::web::handle(web, &shared.local, request).await;
        }
    }
    // Who asks comes first: an unauthenticated request learns nothing, not even which
    // routes exist.
    let role = match authenticate(shared, &request).await {
        Ok(role) => role,
        Err(e) => return refuse(&e),
    };
    let Some(route) = Route::of(request.method(), request.uri().path()) else {
        return refuse(&OpError::not_found("no such route (see the README's operator API)"));
    };
    if !role.allows(route.role()) {
        return refuse(&OpError::new(ErrorCode::Forbidden, format!("the {} role may not do this", role.as_str())));
    }
    let local = &shared.local;
    let cap = (shared.config.max_body_bytes, shared.config.body_timeout);
    let q = query(&request);
    match route {
        Route::Metrics => metrics(shared).await,
        Route::Runs => {
            let filter = match number(&q, "limit", 50) {
                Ok(limit) => RunFilter {
                    schedule: q.get("schedule").cloned(),
                    status: q.get("status").cloned(),
                    limit,
                    before: q.get("before").cloned(),
                    worker: q.get("worker").cloned(),
                },
                Err(e) => return refuse(&e),
            };
            answer(local.runs(&filter).await)
        }
        Route::Submit => match body(request, cap).await {
            Ok(b) => answer(local.submit(&b).await),
            Err(e) => refuse(&e),
        },
        Route::Run(run) => answer(local.run(&run).await),
        Route::Cancel(run) => match body::<Empty>(request, cap).await {
            Ok(_) => answer(local.cancel(&run).await),
            Err(e) => refuse(&e),
        },
        Route::Log(run) => log(shared, &run, &q).await,
        Route::Workers => match number(&q, "limit", 50) {
            Ok(limit) => answer(local.workers(limit, q.get("after").map(String::as_str)).await),
            Err(e) => refuse(&e),
        },
        Route::Access(worker, access) => match body::<AccessBody>(request, cap).await {
            Ok(b) => {
                let change = AccessChange { access, serial: b.serial.as_deref(), with_renewals: b.with_renewals };
                answer(local.set_access(&worker, change).await)
            }
            Err(e) => refuse(&e),
        },
        Route::Labels(worker) => match body::<LabelsBody>(request, cap).await {
            Ok(b) => match crate::ops::local::label_words(&b.labels) {
                Ok(words) => answer(local.label(&worker, &words).await),
                Err(e) => refuse(&e),
            },
            Err(e) => refuse(&e),
        },
        Route::Certificates => match number(&q, "limit", 50) {
            Ok(limit) => {
                let (worker, after) = (q.get("worker").map(String::as_str), q.get("after").map(String::as_str));
                answer(local.certificates(worker, after, limit).await)
            }
            Err(e) => refuse(&e),
        },
        Route::Schedules => answer(local.schedules().await),
        Route::AddSchedule => match body(request, cap).await {
            Ok(b) => answer(local.add_schedule(&b).await),
            Err(e) => refuse(&e),
        },
        Route::Schedule(name) => answer(local.schedule(&name).await),
        Route::ScheduleAction(name, action) => {
            if action != ScheduleAction::Remove {
                if let Err(e) = body::<Empty>(request, cap).await {
                    return refuse(&e);
                }
            }
            answer(local.schedule_action(&name, action).await)
        }
    }
}

/// `/metrics`: the OpenMetrics text ([`crate::metrics`]).
async fn metrics<S: Store, B: BlobStore>(shared: &Shared<S, B>) -> Answer {
    let Some(metrics) = &shared.metrics else {
        return refuse(&OpError::not_found("this server keeps no metrics"));
    };
    match metrics.render(&shared.local.store).await {
        Ok(text) => {
            let mut answer = Response::new(Full::new(Bytes::from(text)));
            let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
            answer.headers_mut().insert("content-type", kind.parse().expect("a header value"));
            answer.headers_mut().insert("cache-control", "no-store".parse().expect("a header value"));
            answer
        }
        Err(e) => refuse(&OpError::from(e)),
    }
}

/// A log window: the bytes as the body, what they are in headers.
async fn log<S: Store, B: BlobStore>(shared: &Shared<S, B>, run: &RunId, q: &BTreeMap<String, String>) -> Answer {
    let config = &shared.config;
    let parsed = (|| {
        Ok::<_, OpError>(LogRequest {
            attempt: q.get("attempt").cloned(),
            offset: number(q, "offset", 0)?,
            limit: number(q, "limit", config.max_log_window)?.clamp(1, config.max_log_window),
            follow: q.get("follow").is_some_and(|v| v == "true" || v == "1"),
            wait_ms: number(q, "waitMs", 0u64)?.min(u64::try_from(config.max_log_wait.as_millis()).unwrap_or(u64::MAX)),
        })
    })();
    let request = match parsed {
        Ok(r) => r,
        Err(e) => return refuse(&e),
    };
    let window = match shared.local.log(run, &request).await {
        Ok(w) => w,
        Err(e) => return refuse(&e),
    };
    log_answer(window)
}

/// A log window as an answer: the bytes as the body, what they are in headers (the
/// operator API's and the dashboard's live tail alike).
pub(crate) fn log_answer(window: crate::ops::view::LogWindow) -> Answer {
    let mut answer = Response::new(Full::new(Bytes::from(window.bytes)));
    let headers = answer.headers_mut();
    let mut set = |name: &'static str, value: String| {
        if let Ok(v) = value.parse() {
            headers.insert(name, v);
        }
    };
    set("content-type", "application/octet-stream".into());
    set("cache-control", "no-store".into());
    set("ql-run-status", window.status);
    set("ql-run-terminal", window.terminal.to_string());
    set("ql-log-offset", window.offset.to_string());
    if let Some(attempt) = window.attempt {
        set("ql-log-attempt", attempt);
        set("ql-log-attempt-number", window.number.to_string());
    }
    if let Some(receipt) = window.sealed {
        set("ql-log-receipt", serde_json::to_string(&receipt).expect("a receipt serialises"));
    }
    answer
}
