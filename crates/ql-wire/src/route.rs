//! Every worker route, built and parsed in this one place.
//!
//! Parsing is strict on purpose: the path must be exactly one of the table's shapes, every
//! id must pass its own validation, and anything else is refused — no percent-decoding
//! (ids never need it, so `%` is refused outright), no empty, `.` or `..` segments, no
//! trailing slash, no query string. A path that parses names exactly one resource.
//!
//! | method | path under `/v1/workers/{w}` |
//! |---|---|
//! | POST | `/sessions` |
//! | POST | `/sessions/{s}/heartbeat` |
//! | POST | `/sessions/{s}/offers:poll` |
//! | POST | `/sessions/{s}/offers/{o}/claim` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/starting` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/running` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/start-failure` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/lease:renew` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/completion` |
//! | PUT  | `/sessions/{s}/runs/{r}/attempts/{a}/artifacts/{artifactId}` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/log:append` |
//! | POST | `/sessions/{s}/runs/{r}/attempts/{a}/artifacts/{artifactId}:seal` |

use std::fmt;

use crate::ids::{ArtifactId, AttemptId, OfferId, RunId, SessionId, WorkerId};
use crate::limits::{ARTIFACT_BODY_CAP, COMPLETION_BODY_CAP, JSON_BODY_CAP, LOG_CHUNK_BODY_CAP};

/// Media type of every JSON route.
pub const JSON_MEDIA_TYPE: &str = "application/json";
/// Media type of the artifact route.
pub const ARTIFACT_MEDIA_TYPE: &str = "application/vnd.qinglong.worker-artifact";
/// Media type of the live-log route.
pub const LOG_CHUNK_MEDIA_TYPE: &str = "application/vnd.qinglong.worker-log-chunk";
/// The suffix of the seal route's last segment.
const SEAL_SUFFIX: &str = ":seal";

/// The path of one attempt, shared by the attempt routes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AttemptPath {
    /// The worker.
    pub worker: WorkerId,
    /// The session speaking.
    pub session: SessionId,
    /// The run.
    pub run: RunId,
    /// The attempt.
    pub attempt: AttemptId,
}

/// A command on an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptCommand {
    /// `starting`.
    Starting,
    /// `running`.
    Running,
    /// `start-failure`.
    StartFailure,
    /// `lease:renew`.
    RenewLease,
    /// `completion`.
    Completion,
    /// `abandon`.
    Abandon,
}

impl AttemptCommand {
    const ALL: [Self; 6] =
        [Self::Starting, Self::Running, Self::StartFailure, Self::RenewLease, Self::Completion, Self::Abandon];

    /// The last path segment.
    pub fn segment(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::StartFailure => "start-failure",
            Self::RenewLease => "lease:renew",
            Self::Completion => "completion",
            Self::Abandon => "abandon",
        }
    }
}

/// One worker route with its parameters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Route {
    /// Open a session.
    OpenSession(WorkerId),
    /// Heartbeat (and drain) a session.
    Heartbeat(WorkerId, SessionId),
    /// Close a session for good.
    CloseSession(WorkerId, SessionId),
    /// Long-poll for offers.
    PollOffers(WorkerId, SessionId),
    /// Claim an offer.
    Claim(WorkerId, SessionId, OfferId),
    /// A start ACK, renewal or completion.
    Attempt(AttemptPath, AttemptCommand),
    /// Upload an artifact.
    Artifact(AttemptPath, ArtifactId),
    /// Append a chunk to the live log.
    LogAppend(AttemptPath),
    /// Seal the live log into the artifact.
    Seal(AttemptPath, ArtifactId),
}

/// A request that names no route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownRoute;

impl fmt::Display for UnknownRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no such route")
    }
}

impl std::error::Error for UnknownRoute {}

/// Whether `path` holds a character no route has: an escape, a query, a fragment or a
/// backslash. Such a path names no route, however it would decode. Compared as bytes:
/// these are ASCII, and no byte of a longer UTF-8 character is ASCII.
pub(crate) fn escapes(path: &str) -> bool {
    path.bytes().any(|b| matches!(b, b'%' | b'?' | b'#' | b'\\'))
}

impl Route {
    /// Parses a method and a path (without query), refusing anything not in the table.
    pub fn parse(method: &str, path: &str) -> Result<Self, UnknownRoute> {
        if escapes(path) {
            return Err(UnknownRoute);
        }
        let rest = path.strip_prefix("/v1/workers/").ok_or(UnknownRoute)?;
        let segs: Vec<&str> = rest.split('/').collect();
        let worker = WorkerId::parse(segs[0]).map_err(|_| UnknownRoute)?;
        let session = |i: usize| SessionId::parse(segs[i]).map_err(|_| UnknownRoute);
        let route = match (method, &segs[1..]) {
            ("POST", ["sessions"]) => Self::OpenSession(worker),
            ("POST", ["sessions", _, "heartbeat"]) => Self::Heartbeat(worker, session(2)?),
            ("POST", ["sessions", _, "close"]) => Self::CloseSession(worker, session(2)?),
            ("POST", ["sessions", _, "offers:poll"]) => Self::PollOffers(worker, session(2)?),
            ("POST", ["sessions", _, "offers", offer, "claim"]) => {
                Self::Claim(worker, session(2)?, OfferId::parse(*offer).map_err(|_| UnknownRoute)?)
            }
            (_, ["sessions", _, "runs", run, "attempts", attempt, tail @ ..]) => {
                let at = AttemptPath {
                    worker,
                    session: session(2)?,
                    run: RunId::parse(*run).map_err(|_| UnknownRoute)?,
                    attempt: AttemptId::parse(*attempt).map_err(|_| UnknownRoute)?,
                };
                match (method, tail) {
                    ("PUT", ["artifacts", id]) => Self::Artifact(at, ArtifactId::parse(*id).map_err(|_| UnknownRoute)?),
                    ("POST", ["artifacts", last]) => {
                        let id = last.strip_suffix(SEAL_SUFFIX).ok_or(UnknownRoute)?;
                        Self::Seal(at, ArtifactId::parse(id).map_err(|_| UnknownRoute)?)
                    }
                    ("POST", ["log:append"]) => Self::LogAppend(at),
                    ("POST", [last]) => {
                        let cmd = AttemptCommand::ALL.into_iter().find(|c| c.segment() == *last).ok_or(UnknownRoute)?;
                        Self::Attempt(at, cmd)
                    }
                    _ => return Err(UnknownRoute),
                }
            }
            _ => return Err(UnknownRoute),
        };
        Ok(route)
    }

    /// The HTTP method.
    pub fn method(&self) -> &'static str {
        match self {
            Self::Artifact(..) => "PUT",
            _ => "POST",
        }
    }

    /// The path, built from validated ids (which never need escaping).
    pub fn path(&self) -> String {
        let attempt = |p: &AttemptPath| {
            format!("/v1/workers/{}/sessions/{}/runs/{}/attempts/{}", p.worker, p.session, p.run, p.attempt)
        };
        match self {
            Self::OpenSession(w) => format!("/v1/workers/{w}/sessions"),
            Self::Heartbeat(w, s) => format!("/v1/workers/{w}/sessions/{s}/heartbeat"),
            Self::CloseSession(w, s) => format!("/v1/workers/{w}/sessions/{s}/close"),
            Self::PollOffers(w, s) => format!("/v1/workers/{w}/sessions/{s}/offers:poll"),
            Self::Claim(w, s, o) => format!("/v1/workers/{w}/sessions/{s}/offers/{o}/claim"),
            Self::Attempt(p, cmd) => format!("{}/{}", attempt(p), cmd.segment()),
            Self::Artifact(p, id) => format!("{}/artifacts/{id}", attempt(p)),
            Self::LogAppend(p) => format!("{}/log:append", attempt(p)),
            Self::Seal(p, id) => format!("{}/artifacts/{id}{SEAL_SUFFIX}", attempt(p)),
        }
    }

    /// The worker the path speaks for; the server binds it to the certificate's.
    pub fn worker(&self) -> &WorkerId {
        match self {
            Self::OpenSession(w)
            | Self::Heartbeat(w, _)
            | Self::CloseSession(w, _)
            | Self::PollOffers(w, _)
            | Self::Claim(w, ..) => w,
            Self::Attempt(p, _) | Self::Artifact(p, _) | Self::LogAppend(p) | Self::Seal(p, _) => &p.worker,
        }
    }

    /// Every [`Route::name`], in the order of a run's life (heartbeat second, close last).
    pub const NAMES: [&'static str; 14] = [
        "session.open",
        "session.heartbeat",
        "offers.poll",
        "offer.claim",
        "attempt.starting",
        "attempt.running",
        "lease.renew",
        "log.append",
        "artifact.seal",
        "artifact.put",
        "attempt.completion",
        "attempt.start_failure",
        "session.close",
        "attempt.abandon",
    ];

    /// A stable, low-cardinality name for audit records and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::OpenSession(_) => "session.open",
            Self::Heartbeat(..) => "session.heartbeat",
            Self::CloseSession(..) => "session.close",
            Self::PollOffers(..) => "offers.poll",
            Self::Claim(..) => "offer.claim",
            Self::Attempt(_, AttemptCommand::Starting) => "attempt.starting",
            Self::Attempt(_, AttemptCommand::Running) => "attempt.running",
            Self::Attempt(_, AttemptCommand::StartFailure) => "attempt.start_failure",
            Self::Attempt(_, AttemptCommand::RenewLease) => "lease.renew",
            Self::Attempt(_, AttemptCommand::Completion) => "attempt.completion",
            Self::Attempt(_, AttemptCommand::Abandon) => "attempt.abandon",
            Self::Artifact(..) => "artifact.put",
            Self::LogAppend(_) => "log.append",
            Self::Seal(..) => "artifact.seal",
        }
    }

    /// The request media type the route accepts.
    pub fn media_type(&self) -> &'static str {
        match self {
            Self::Artifact(..) => ARTIFACT_MEDIA_TYPE,
            Self::LogAppend(_) => LOG_CHUNK_MEDIA_TYPE,
            _ => JSON_MEDIA_TYPE,
        }
    }

    /// The largest request body the route accepts.
    pub fn body_cap(&self) -> u64 {
        match self {
            Self::Artifact(..) => ARTIFACT_BODY_CAP,
            Self::LogAppend(_) => LOG_CHUNK_BODY_CAP,
            Self::Attempt(_, AttemptCommand::Completion) => COMPLETION_BODY_CAP as u64,
            _ => JSON_BODY_CAP as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at() -> AttemptPath {
        AttemptPath {
            worker: WorkerId::parse("r1").unwrap(),
            session: SessionId::parse("s1").unwrap(),
            run: RunId::parse("run1").unwrap(),
            attempt: AttemptId::parse("a1").unwrap(),
        }
    }

    fn every_route() -> Vec<Route> {
        let w = WorkerId::parse("r1").unwrap();
        let s = SessionId::parse("s1").unwrap();
        let mut all = vec![
            Route::OpenSession(w.clone()),
            Route::Heartbeat(w.clone(), s.clone()),
            Route::CloseSession(w.clone(), s.clone()),
            Route::PollOffers(w.clone(), s.clone()),
            Route::Claim(w, s, OfferId::parse("o1").unwrap()),
            Route::Artifact(at(), ArtifactId::parse("log").unwrap()),
            Route::LogAppend(at()),
            Route::Seal(at(), ArtifactId::parse("log").unwrap()),
        ];
        all.extend(AttemptCommand::ALL.map(|c| Route::Attempt(at(), c)));
        all
    }

    #[test]
    fn names_lists_every_route_name_once() {
        let mut named: Vec<&str> = every_route().iter().map(Route::name).collect();
        let mut listed = Route::NAMES.to_vec();
        named.sort_unstable();
        listed.sort_unstable();
        assert_eq!(named, listed);
    }

    #[test]
    fn every_route_round_trips_through_its_path() {
        for route in every_route() {
            assert_eq!(Route::parse(route.method(), &route.path()), Ok(route.clone()), "{}", route.path());
        }
    }

    #[test]
    fn paths_match_the_protocol_table() {
        let paths: Vec<String> = every_route().iter().map(|r| format!("{} {}", r.method(), r.path())).collect();
        assert!(paths.contains(&"POST /v1/workers/r1/sessions".to_owned()));
        assert!(paths.contains(&"POST /v1/workers/r1/sessions/s1/offers:poll".to_owned()));
        assert!(paths.contains(&"POST /v1/workers/r1/sessions/s1/close".to_owned()));
        assert!(paths.contains(&"POST /v1/workers/r1/sessions/s1/runs/run1/attempts/a1/lease:renew".to_owned()));
        assert!(paths.contains(&"POST /v1/workers/r1/sessions/s1/runs/run1/attempts/a1/start-failure".to_owned()));
        assert!(paths.contains(&"PUT /v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/log".to_owned()));
        assert!(paths.contains(&"POST /v1/workers/r1/sessions/s1/runs/run1/attempts/a1/log:append".to_owned()));
        assert!(paths.contains(&"POST /v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/log:seal".to_owned()));
    }

    #[test]
    fn wrong_method_is_unknown() {
        for route in every_route() {
            let other = if route.method() == "POST" { "PUT" } else { "POST" };
            assert_eq!(Route::parse(other, &route.path()), Err(UnknownRoute), "{}", route.path());
            assert_eq!(Route::parse("GET", &route.path()), Err(UnknownRoute));
        }
    }

    #[test]
    fn refuses_tricks_and_near_misses() {
        for path in [
            "",
            "/",
            "/v1/workers/r1",
            "/v1/workers/r1/",
            "/v1/workers/r1/sessions/",
            "/v1/workers//sessions",
            "/v1/workers/R1/sessions",
            "/v1/workers/r%31/sessions",
            "/v1/workers/r1/sessions%2fs1/heartbeat",
            "/v1/workers/r1/sessions/s1/heartbeat/",
            "/v1/workers/r1/sessions/s1/heartbeat?x=1",
            "/v1/workers/r1/sessions/s1/heartbeat#x",
            "/v1/workers/r1/sessions/../sessions/s1/heartbeat",
            "/v1/workers/r1/sessions/./heartbeat",
            "/v1/workers/r1/sessions/s.1/heartbeat",
            "/v1/workers/r1/sessions/s1/offers/o1/claim/x",
            "/v1/workers/r1/sessions/s1/offers:renew",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/lease%3Arenew",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/..",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/a/b",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/STARTING",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/log:seal/x",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/:seal",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/log:seal:seal",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/artifacts/log:unseal",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/log:append/",
            "/v1/workers/r1/sessions/s1/runs/run1/attempts/a1/log",
            "/v1/workers/r1\\sessions",
            "//v1/workers/r1/sessions",
            "/v2/workers/r1/sessions",
        ] {
            assert_eq!(Route::parse("POST", path), Err(UnknownRoute), "{path:?}");
            assert_eq!(Route::parse("PUT", path), Err(UnknownRoute), "{path:?}");
        }
    }

    #[test]
    fn caps_and_media_types_follow_the_contract() {
        let completion = Route::Attempt(at(), AttemptCommand::Completion);
        assert_eq!(completion.body_cap(), 16 * 1024);
        assert_eq!(Route::Attempt(at(), AttemptCommand::Running).body_cap(), 4 * 1024);
        let artifact = Route::Artifact(at(), ArtifactId::parse("log").unwrap());
        assert_eq!(artifact.body_cap(), 64 * 1024 * 1024 + 4096 + 4);
        assert_eq!(artifact.media_type(), ARTIFACT_MEDIA_TYPE);
        assert_eq!(completion.media_type(), JSON_MEDIA_TYPE);
        let append = Route::LogAppend(at());
        assert_eq!(append.body_cap(), 256 * 1024 + 4096 + 4);
        assert_eq!(append.media_type(), LOG_CHUNK_MEDIA_TYPE);
        let seal = Route::Seal(at(), ArtifactId::parse("log").unwrap());
        assert_eq!((seal.body_cap(), seal.media_type()), (4 * 1024, JSON_MEDIA_TYPE));
    }
}
