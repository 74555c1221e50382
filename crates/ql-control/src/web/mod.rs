//! The dashboard: server-rendered pages under `/ui/` on the operator listener — runs
//! (filtered, paged), a run (attempts, events, its log, live while it runs), workers and
//! schedules (pause, resume and run-now for the admin role).
//!
//! An operator signs in with an operator token (`POST /ui/login`); the session cookie
//! holds no token, only `<operator>.<expiry>.<MAC>`, the MAC (HMAC-SHA256 under a key
//! derived from the webhook key every replica shares) covering the operator, the expiry
//! and its token's digest, so removing the operator ends its sessions. The cookie is
//! `HttpOnly; Secure; SameSite=Strict`; every form that changes something carries a
//! CSRF token bound to the session and checked before anything is done. Every page is
//! sent with a strict Content-Security-Policy (scripts and styles from this server only,
//! no inline code); every text shown is escaped ([`pages`]); the only script is the
//! live tail ([`TAIL_JS`]), and every page works without it.

mod pages;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use zeroize::Zeroizing;

use ql_wire::capability::Token;
use ql_wire::ids::RunId;

use crate::blob::BlobStore;
use crate::keys::{hmac, hmac_hex, hmac_valid};
use crate::model::{Operator, Role};
use crate::ops::{Local, LogRequest, OpError, RunFilter, ScheduleAction};
use crate::store::Store;

/// The stylesheet.
const APP_CSS: &str = include_str!("app.css");
/// The live tail.
pub const TAIL_JS: &str = include_str!("tail.js");

/// The policy every page is sent with.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
                   form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The session cookie's name: `__Host-`, so the browser keeps it only if it is `Secure`,
/// for this host alone and for every path.
const COOKIE: &str = "__Host-ql_ui";

/// The dashboard's settings.
pub struct Web {
    key: Zeroizing<Vec<u8>>,
    /// How long a sign-in lasts.
    pub session_ttl: Duration,
    /// A form must arrive within this of its head.
    pub body_timeout: Duration,
}

impl std::fmt::Debug for Web {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Web").field("key", &"<redacted>").field("session_ttl", &self.session_ttl).finish()
    }
}

impl Web {
    /// The dashboard keyed from `secret` (the text of `dashboard_secret_file`), sessions
    /// lasting `session_ttl`, forms arriving within `body_timeout`.
    pub fn new(secret: &str, session_ttl: Duration, body_timeout: Duration) -> Self {
        let key = hmac(secret.as_bytes(), b"ql-control dashboard sessions");
        Self { key: Zeroizing::new(key), session_ttl, body_timeout }
    }

    fn cookie_text(operator: &Operator, expiry: u64) -> String {
        format!("{}\n{expiry}\n{}", operator.name, operator.token_digest.as_str())
    }

    fn cookie_mac(&self, operator: &Operator, expiry: u64) -> String {
        hmac_hex(&self.key, Self::cookie_text(operator, expiry).as_bytes())
    }

    /// Whether `given` (hex) is the MAC of a cookie for `operator` until `expiry`, checked
    /// in constant time.
    fn cookie_valid(&self, operator: &Operator, expiry: u64, given: &str) -> bool {
        hmac_valid(&self.key, Self::cookie_text(operator, expiry).as_bytes(), given)
    }

    /// The CSRF token of a session cookie.
    fn csrf(&self, cookie: &str) -> String {
        hmac_hex(&self.key, format!("csrf\n{cookie}").as_bytes())
    }

    /// Whether `given` is the CSRF token of `cookie`, checked in constant time.
    fn csrf_valid(&self, cookie: &str, given: Option<&String>) -> bool {
        given.is_some_and(|g| hmac_valid(&self.key, format!("csrf\n{cookie}").as_bytes(), g))
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Who is signed in: the operator, their role, the cookie (for CSRF).
struct Session {
    name: String,
    role: Role,
    cookie: String,
}

type Answer = Response<Full<Bytes>>;

fn page(status: StatusCode, html: String) -> Answer {
    let mut answer = Response::new(Full::new(Bytes::from(html)));
    *answer.status_mut() = status;
    let h = answer.headers_mut();
    h.insert("content-type", "text/html; charset=utf-8".parse().expect("a header value"));
    secure_headers(h);
    answer
}

fn secure_headers(h: &mut hyper::HeaderMap) {
    h.insert("content-security-policy", CSP.parse().expect("a header value"));
    h.insert("x-content-type-options", "nosniff".parse().expect("a header value"));
    h.insert("referrer-policy", "no-referrer".parse().expect("a header value"));
    h.insert("x-frame-options", "DENY".parse().expect("a header value"));
    h.insert("cache-control", "no-store".parse().expect("a header value"));
}

fn redirect(to: &str, cookie: Option<String>) -> Answer {
    let mut answer = Response::new(Full::new(Bytes::new()));
    *answer.status_mut() = StatusCode::SEE_OTHER;
    let h = answer.headers_mut();
    if let Ok(v) = to.parse() {
        h.insert("location", v);
    }
    if let Some(c) = cookie.and_then(|c| c.parse().ok()) {
        h.insert("set-cookie", c);
    }
    secure_headers(h);
    answer
}

fn asset(kind: &'static str, text: &'static str) -> Answer {
    let mut answer = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    let h = answer.headers_mut();
    h.insert("content-type", kind.parse().expect("a header value"));
    h.insert("x-content-type-options", "nosniff".parse().expect("a header value"));
    h.insert("cache-control", "no-cache".parse().expect("a header value"));
    answer
}

fn error_page(e: &OpError) -> Answer {
    let status = StatusCode::from_u16(e.code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    page(status, pages::error(&e.message))
}

/// `k=v&...` pairs, percent-decoded (`+` is a space): a query string or a form body.
pub(crate) fn pairs(text: &str) -> BTreeMap<String, String> {
    let decode = |s: &str| percent_encoding::percent_decode_str(&s.replace('+', " ")).decode_utf8_lossy().into_owned();
    text.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn cookie_of(request: &Request<Incoming>) -> Option<String> {
    let header = request.headers().get("cookie")?.to_str().ok()?;
    header.split(';').filter_map(|c| c.trim().split_once('=')).find(|(k, _)| *k == COOKIE).map(|(_, v)| v.to_owned())
}

async fn session<S: Store, B: BlobStore>(
    web: &Web,
    local: &Local<S, B>,
    request: &Request<Incoming>,
) -> Option<Session> {
    let cookie = cookie_of(request)?;
    // `<name>.<expiry>.<mac>`, and a name may hold dots.
    let mut parts = cookie.rsplitn(3, '.');
    let (given, expiry, name) = (parts.next()?, parts.next()?.parse::<u64>().ok()?, parts.next()?);
    if expiry <= now_secs() {
        return None;
    }
    let operators = local.store.operators().await.ok()?;
    let operator = operators.iter().find(|o| o.name == name)?;
    web.cookie_valid(operator, expiry, given).then(|| Session {
        name: operator.name.clone(),
        role: operator.role,
        cookie,
    })
}

async fn form(request: Request<Incoming>, timeout: Duration) -> Result<BTreeMap<String, String>, OpError> {
    let collected = tokio::time::timeout(timeout, Limited::new(request.into_body(), 16 * 1024).collect())
        .await
        .map_err(|_| OpError::invalid(format!("the form did not arrive within {} s", timeout.as_secs())))?;
    let bytes = collected
        .map_err(|_| OpError::new(ql_wire::ErrorCode::PayloadTooLarge, "a form of at most 16 KiB"))?
        .to_bytes();
    Ok(pairs(&String::from_utf8_lossy(&bytes)))
}

/// Answers a request under `/ui`.
pub(crate) async fn handle<S: Store, B: BlobStore>(
    web: &Web,
    local: &Local<S, B>,
    request: Request<Incoming>,
) -> Answer {
    let path = request.uri().path().to_owned();
    let method = request.method().clone();
    // A form posted from another site (the browser says so) is refused before anything,
    // the sign-in's included; the CSRF token is checked on top for every other form.
    let cross_site = request.headers().get("sec-fetch-site").is_some_and(|v| v.as_bytes() == b"cross-site");
    if method == Method::POST && cross_site {
        return error_page(&OpError::new(ql_wire::ErrorCode::Forbidden, "a form from this dashboard, please"));
    }
    match (&method, path.as_str()) {
        (&Method::GET, "/ui/static/app.css") => return asset("text/css; charset=utf-8", APP_CSS),
        (&Method::GET, "/ui/static/tail.js") => return asset("text/javascript; charset=utf-8", TAIL_JS),
        (&Method::GET, "/ui/login") => return page(StatusCode::OK, pages::login(None)),
        (&Method::POST, "/ui/login") => return login(web, local, request).await,
        _ => {}
    }
    let Some(who) = session(web, local, &request).await else {
        if path.ends_with("/log") {
            return error_page(&OpError::new(ql_wire::ErrorCode::Unauthenticated, "sign in first"));
        }
        return redirect("/ui/login", None);
    };
    let query = pairs(request.uri().query().unwrap_or(""));
    let csrf = web.csrf(&who.cookie);
    let parts: Vec<&str> = path.trim_start_matches("/ui").trim_matches('/').split('/').collect();
    let view = pages::Viewer { name: &who.name, admin: who.role == Role::Admin, csrf: &csrf };
    match (&method, parts.as_slice()) {
        (&Method::GET, [""]) => redirect("/ui/runs", None),
        (&Method::GET, ["runs"]) => {
            let filter = RunFilter {
                status: query.get("status").filter(|s| !s.is_empty()).cloned(),
                schedule: query.get("schedule").filter(|s| !s.is_empty()).cloned(),
                worker: query.get("worker").filter(|s| !s.is_empty()).cloned(),
                before: query.get("before").filter(|s| !s.is_empty()).cloned(),
                limit: 50,
            };
            match local.runs(&filter).await {
                Ok(runs) => page(StatusCode::OK, pages::runs(&view, &filter, &runs)),
                Err(e) => error_page(&e),
            }
        }
        (&Method::GET, ["runs", id]) => {
            let Ok(run) = RunId::parse(*id) else { return error_page(&OpError::not_found("no such run")) };
            let view_run = match local.run(&run).await {
                Ok(v) => v,
                Err(e) => return error_page(&e),
            };
            let window = local.log(&run, &LogRequest { limit: 1024 * 1024, ..LogRequest::default() }).await;
            page(StatusCode::OK, pages::run(&view, &view_run, window.ok().as_ref()))
        }
        (&Method::GET, ["runs", id, "log"]) => {
            let Ok(run) = RunId::parse(*id) else { return error_page(&OpError::not_found("no such run")) };
            let number = |k: &str| query.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let request = LogRequest {
                attempt: query.get("attempt").cloned(),
                offset: number("offset"),
                limit: 1024 * 1024,
                follow: true,
                wait_ms: number("waitMs").min(20_000),
            };
            match local.log(&run, &request).await {
                Ok(w) => {
                    let mut answer = crate::api::log_answer(w);
                    secure_headers(answer.headers_mut());
                    answer
                }
                Err(e) => error_page(&e),
            }
        }
        (&Method::GET, ["workers"]) => match local.workers(500, query.get("after").map(String::as_str)).await {
            Ok(list) => page(StatusCode::OK, pages::workers(&view, &list)),
            Err(e) => error_page(&e),
        },
        (&Method::GET, ["schedules"]) => match local.schedules().await {
            Ok(list) => page(StatusCode::OK, pages::schedules(&view, &list, &last_outcomes(local, &list).await, None)),
            Err(e) => error_page(&e),
        },
        (&Method::POST, ["logout"]) => match form(request, web.body_timeout).await {
            Ok(f) if web.csrf_valid(&who.cookie, f.get("csrf")) => {
                redirect("/ui/login", Some(format!("{COOKIE}=; HttpOnly; Secure; SameSite=Strict; Path=/; Max-Age=0")))
            }
            _ => error_page(&OpError::new(ql_wire::ErrorCode::Forbidden, "a form from this dashboard, please")),
        },
        (&Method::POST, ["schedules", name, action]) => {
            let Some(action) = ScheduleAction::posted(action) else {
                return error_page(&OpError::not_found("no such action"));
            };
            let name = (*name).to_owned();
            // The form's CSRF token first, then the role: nothing is done for a forged
            // or a read-only request.
            let fields = match form(request, web.body_timeout).await {
                Ok(f) => f,
                Err(e) => return error_page(&e),
            };
            if !web.csrf_valid(&who.cookie, fields.get("csrf")) {
                return error_page(&OpError::new(ql_wire::ErrorCode::Forbidden, "a form from this dashboard, please"));
            }
            if who.role != Role::Admin {
                return error_page(&OpError::new(ql_wire::ErrorCode::Forbidden, "the read role may not do this"));
            }
            let done = local.schedule_action(&name, action).await;
            match (done, local.schedules().await) {
                (Ok(d), Ok(list)) => {
                    let outcomes = last_outcomes(local, &list).await;
                    page(StatusCode::OK, pages::schedules(&view, &list, &outcomes, Some(&d.message)))
                }
                (Err(e), _) | (_, Err(e)) => error_page(&e),
            }
        }
        _ => error_page(&OpError::not_found("no such page")),
    }
}

/// Each schedule's last run's status, by run id.
async fn last_outcomes<S: Store, B: BlobStore>(
    local: &Local<S, B>,
    list: &crate::ops::view::ScheduleList,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for id in list.schedules.iter().filter_map(|s| s.last_run.as_deref()) {
        if let Ok(run) = RunId::parse(id) {
            if let Ok(view) = local.run(&run).await {
                out.insert(id.to_owned(), view.status);
            }
        }
    }
    out
}

async fn login<S: Store, B: BlobStore>(web: &Web, local: &Local<S, B>, request: Request<Incoming>) -> Answer {
    let fields = match form(request, web.body_timeout).await {
        Ok(f) => f,
        Err(e) => return error_page(&e),
    };
    let token = Zeroizing::new(fields.get("token").cloned().unwrap_or_default());
    let refused = || page(StatusCode::UNAUTHORIZED, pages::login(Some("that token is not an operator's")));
    let Some((name, secret)) = token.trim().rsplit_once('.') else { return refused() };
    let Ok(secret) = Token::parse(secret) else { return refused() };
    let Ok(operators) = local.store.operators().await else {
        return error_page(&OpError::new(ql_wire::ErrorCode::Unavailable, "the database is unreachable"));
    };
    let found = operators.iter().find(|o| o.name == name);
    if crate::core::authorize(found, &secret.digest(), Role::Read).is_err() {
        return refused();
    }
    let operator = found.expect("authorized");
    let expiry = now_secs() + web.session_ttl.as_secs();
    let value = format!("{}.{expiry}.{}", operator.name, web.cookie_mac(operator, expiry));
    let max_age = web.session_ttl.as_secs();
    redirect(
        "/ui/runs",
        Some(format!("{COOKIE}={value}; HttpOnly; Secure; SameSite=Strict; Path=/; Max-Age={max_age}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operator(token: &Token) -> Operator {
        Operator { name: "ops".into(), role: Role::Read, token_digest: token.digest(), created_at: 0 }
    }

    #[test]
    fn a_session_cookie_is_bound_to_its_operator_its_expiry_and_its_token() {
        let web = Web::new("a server key of some length", Duration::from_secs(60), Duration::from_secs(1));
        let token = Token::generate().unwrap();
        let ops = operator(&token);
        let mac = web.cookie_mac(&ops, 100);
        assert!(web.cookie_valid(&ops, 100, &mac));
        assert!(!web.cookie_valid(&ops, 101, &mac), "another expiry");
        let replaced = operator(&Token::generate().unwrap());
        assert!(!web.cookie_valid(&replaced, 100, &mac), "the operator's token was replaced");
        let other = Web::new("another server key entirely", Duration::from_secs(60), Duration::from_secs(1));
        assert!(!other.cookie_valid(&ops, 100, &mac), "another server key");
        for bad in ["", "zz", &mac[1..]] {
            assert!(!web.cookie_valid(&ops, 100, bad), "{bad:?}");
        }
        assert_ne!(web.csrf("a.1.x"), web.csrf("a.1.y"), "a CSRF token per session");
        assert!(web.csrf_valid("a.1.x", Some(&web.csrf("a.1.x"))));
        assert!(!web.csrf_valid("a.1.y", Some(&web.csrf("a.1.x"))));
        assert!(!web.csrf_valid("a.1.x", None));
    }

    #[test]
    fn form_pairs_are_percent_decoded() {
        let p = pairs("token=a%2Eb+c&csrf=&x");
        assert_eq!(p["token"], "a.b c");
        assert_eq!(p["csrf"], "");
        assert_eq!(p["x"], "");
    }
}
