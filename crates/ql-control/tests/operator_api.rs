//! The operator API of a real `ql-control serve`, over real TLS with the state
//! directory's certificates: every route answers its admin, a read-only token is refused
//! every change, a request without a valid token learns nothing, and no refusal changes
//! a row. Tokens are stored only as digests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use ql_control::store::{Snapshot, Store as _};

const BIN: &str = env!("CARGO_BIN_EXE_ql-control");

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A process killed when the test ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn ql(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "ql-control {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `operator add NAME --role ROLE`, returning the token it printed.
fn add_operator(dir: &Path, name: &str, role: &str) -> String {
    let out = ql(&["operator", "add", name, "--role", role, "--dir", dir.to_str().unwrap()]);
    out.lines().nth(1).expect("the token line").trim().to_owned()
}

/// The operator URL of a `serve` on `dir`.
fn serve(dir: &Path) -> (Proc, String) {
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--operator-listen", "127.0.0.1:0", "--dir"])
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("serve.err")).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(child);
    use std::io::BufRead as _;
    let mut operators = None;
    for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
        if let Some(url) = line.strip_prefix("operator API on ") {
            operators = Some(url.trim().to_owned());
        }
        // The last line it prints.
        if line.starts_with("listening on ") {
            break;
        }
    }
    (proc, operators.expect("serve says where its operator API is"))
}

struct Api {
    agent: ureq::Agent,
    url: String,
}

/// An answer: status, JSON body (or `Null`), the `www-authenticate` header, and whether it
/// ends its connection.
struct Answer {
    status: u16,
    body: Value,
    challenge: Option<String>,
    /// The answer said `Connection: close`.
    closes: bool,
}

impl Api {
    fn new(ca: &Path, url: String) -> Self {
        let roots = ql_control::client::certificates(&std::fs::read(ca).unwrap());
        Self { agent: ql_control::client::agent(&roots, true, Some(Duration::from_secs(30))), url }
    }

    fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<(&str, Vec<u8>)>) -> Answer {
        let url = format!("{}{path}", self.url);
        let auth = token.map(|t| format!("Bearer {t}"));
        let response = match method {
            "GET" | "DELETE" => {
                let mut r = if method == "GET" { self.agent.get(&url) } else { self.agent.delete(&url) };
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            _ => {
                let mut r = if method == "PUT" { self.agent.put(&url) } else { self.agent.post(&url) };
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                let (kind, bytes) = body.unwrap_or(("application/json", b"{}".to_vec()));
                r.header("Content-Type", kind).send(&bytes[..])
            }
        };
        let mut response = response.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = response.status().as_u16();
        let challenge = response.headers().get("www-authenticate").map(|v| v.to_str().unwrap().to_owned());
        let closes = response.headers().get("connection").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        let text = response.body_mut().read_to_string().unwrap();
        Answer { status, body: serde_json::from_str(&text).unwrap_or(Value::Null), challenge, closes }
    }

    fn json(&self, method: &str, path: &str, token: &str, body: Value) -> Answer {
        self.call(method, path, Some(token), Some(("application/json", serde_json::to_vec(&body).unwrap())))
    }
}

fn snapshot(dir: &Path) -> Snapshot {
    let (store, _) = ql_control::admin::open_store(dir).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(store.snapshot()).unwrap()
}

#[test]
fn every_route_answers_its_role_over_tls_and_no_refusal_changes_anything() {
    let root = TempDir(std::env::temp_dir().join(format!("ql-operator-api-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&root.0);
    let dir = root.0.join("state");
    let d = dir.to_str().unwrap();
    ql(&["init", "--host", "127.0.0.1", "--dir", d]);
    ql(&["enroll", "w1", "--dir", d, "--out", root.0.join("creds").to_str().unwrap()]);
    let viewer = add_operator(&dir, "viewer", "read");
    let admin = add_operator(&dir, "boss", "admin");
    let (_serve, url) = serve(&dir);
    let api = Api::new(&dir.join("pki").join("ca.crt"), url);

    // Without a valid token nothing is answered, not even whether a route exists.
    let (name, secret) = viewer.rsplit_once('.').unwrap();
    let wrong_secret = format!("{name}.{}", "A".repeat(secret.len()));
    let unknown_name = format!("nobody.{secret}");
    let before = snapshot(&dir);
    for token in [None, Some("garbage"), Some(wrong_secret.as_str()), Some(unknown_name.as_str())] {
        for (method, path) in [("GET", "/v1/runs"), ("POST", "/v1/runs"), ("GET", "/v1/no-such-route")] {
            let a = api.call(method, path, token, None);
            assert_eq!(
                (a.status, a.body["error"].as_str()),
                (401, Some("unauthenticated")),
                "{method} {path} {token:?}"
            );
            assert_eq!(a.challenge.as_deref(), Some("Bearer"));
            // Refused before its body was read, a request with one ends its connection,
            // and says so: the client's next request goes on a new one.
            assert_eq!(a.closes, method == "POST", "{method} {path} {token:?}");
        }
    }

    // Admin: submit, with every refusal of a body changing nothing.
    let run_body = json!({ "argv": ["sh", "-c", "echo hi"], "timeoutMs": 60000 });
    for (kind, bytes, status, code) in [
        ("application/json", br#"{"argv":["true"],"bogus":1}"#.to_vec(), 400, "invalid_request"),
        ("application/json", br#"{"argv":[]}"#.to_vec(), 400, "invalid_request"),
        ("text/plain", br#"{"argv":["true"]}"#.to_vec(), 415, "unsupported_media_type"),
        ("application/json", vec![b' '; 2 * 1024 * 1024], 413, "payload_too_large"),
    ] {
        let a = api.call("POST", "/v1/runs", Some(&admin), Some((kind, bytes)));
        assert_eq!((a.status, a.body["error"].as_str()), (status, Some(code)), "{kind}: {}", a.body);
    }
    // A read-only token is refused every change.
    let refused_to_viewer = [
        ("POST", "/v1/runs".to_owned(), run_body.clone()),
        ("POST", "/v1/schedules".to_owned(), json!({ "name": "s", "cron": "* * * * *", "run": run_body })),
        ("POST", "/v1/workers/w1:disable".to_owned(), json!({})),
        ("PUT", "/v1/workers/w1/labels".to_owned(), json!({ "labels": { "site": "attic" } })),
    ];
    for (method, path, body) in &refused_to_viewer {
        let a = api.json(method, path, &viewer, body.clone());
        assert_eq!((a.status, a.body["error"].as_str()), (403, Some("forbidden")), "{method} {path}");
    }
    assert_eq!(snapshot(&dir), before, "no refusal changed a row");

    let first = api.json("POST", "/v1/runs", &admin, run_body.clone());
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.body["runId"].as_str().unwrap().to_owned();
    let second = api.json("POST", "/v1/runs", &admin, run_body.clone()).body["runId"].as_str().unwrap().to_owned();

    // Reading: a page at a time, newest first.
    let page = api.call("GET", "/v1/runs?limit=1", Some(&viewer), None).body;
    assert_eq!(page["runs"][0]["runId"], second.as_str(), "{page}");
    let next = page["next"].as_str().unwrap().to_owned();
    let page = api.call("GET", &format!("/v1/runs?limit=1&before={next}"), Some(&viewer), None).body;
    assert_eq!(page["runs"][0]["runId"], first.as_str(), "{page}");
    let queued = api.call("GET", "/v1/runs?status=queued", Some(&viewer), None).body;
    assert_eq!(queued["runs"].as_array().unwrap().len(), 2);
    let bad = api.call("GET", "/v1/runs?status=sleeping", Some(&viewer), None);
    assert_eq!((bad.status, bad.body["error"].as_str()), (400, Some("invalid_request")));
    let shown = api.call("GET", &format!("/v1/runs/{first}"), Some(&viewer), None).body;
    assert_eq!(shown["status"], "queued");
    let missing = api.call("GET", "/v1/runs/run_nosuchrun", Some(&viewer), None);
    assert_eq!((missing.status, missing.body["error"].as_str()), (404, Some("not_found")));
    let log = api.call("GET", &format!("/v1/runs/{first}/log"), Some(&viewer), None);
    assert_eq!(log.status, 200, "a queued run has no log yet, which is no error");

    // Metrics: a read token; the database's figures and each store command's latency.
    let metrics = api.call("GET", "/metrics", Some(&viewer), None);
    assert_eq!(metrics.status, 200);
    let text = {
        let mut r = api.agent.get(format!("{}/metrics", api.url)).header("Authorization", format!("Bearer {viewer}"));
        r = r.header("Accept", "application/openmetrics-text");
        r.call().unwrap().body_mut().read_to_string().unwrap()
    };
    assert!(text.contains("ql_runs{status=\"queued\"} 2"), "{text}");
    assert!(text.contains("ql_store_seconds_count{command=\"submit\"}"), "{text}");
    assert!(text.contains("ql_queued_oldest_seconds") && text.ends_with("# EOF\n"), "{text}");
    assert!(!text.contains(&first), "no run id is a label");
    assert_eq!(api.call("GET", "/metrics", None, None).status, 401);

    // Cancel.
    let before = snapshot(&dir);
    let a = api.json("POST", &format!("/v1/runs/{first}:cancel"), &viewer, json!({}));
    assert_eq!(a.status, 403);
    assert_eq!(snapshot(&dir), before);
    let a = api.json("POST", &format!("/v1/runs/{first}:cancel"), &admin, json!({}));
    assert_eq!(a.body["message"], format!("{first} cancelled"), "{}", a.body);

    // Workers: the list, the certificates, labels and access.
    let workers = api.call("GET", "/v1/workers", Some(&viewer), None).body;
    assert_eq!(workers["workers"][0]["worker"], "w1", "{workers}");
    assert_eq!(workers["workers"][0]["access"], "active");
    let certs = api.call("GET", "/v1/certificates", Some(&viewer), None).body;
    assert_eq!(certs["certificates"].as_array().unwrap().len(), 1, "{certs}");
    assert!(certs["next"].is_null(), "a page not full has no next: {certs}");
    let one = api.call("GET", "/v1/certificates?worker=w1&limit=1", Some(&viewer), None).body;
    assert_eq!(one["certificates"], certs["certificates"], "{one}");
    let serial = one["certificates"][0]["serial"].as_str().unwrap().to_owned();
    assert_eq!(one["next"], serial.as_str(), "a full page names its last serial");
    let rest = api.call("GET", &format!("/v1/certificates?after={serial}"), Some(&viewer), None).body;
    assert_eq!(rest["certificates"], json!([]), "{rest}");
    let none = api.call("GET", "/v1/certificates?worker=w2", Some(&viewer), None).body;
    assert_eq!(none["certificates"], json!([]), "{none}");
    let before = snapshot(&dir);
    for bad in ["after=zz", "after=0x1", "worker=Not_A_Worker", "limit=x"] {
        let a = api.call("GET", &format!("/v1/certificates?{bad}"), Some(&viewer), None);
        assert_eq!((a.status, a.body["error"].as_str()), (400, Some("invalid_request")), "{bad}: {}", a.body);
        assert!(a.body["message"].is_string(), "{bad}: {}", a.body);
    }
    assert_eq!(snapshot(&dir), before);
    let a = api.json("PUT", "/v1/workers/w1/labels", &admin, json!({ "labels": { "site": "attic" } }));
    assert_eq!(a.body["message"], "w1: site=attic", "{}", a.body);
    let a = api.json("PUT", "/v1/workers/w1/labels", &admin, json!({ "labels": { "A": "b" } }));
    assert_eq!(a.status, 400, "{}", a.body);
    let a = api.json("POST", "/v1/workers/w1:disable", &admin, json!({}));
    assert!(a.body["message"].as_str().unwrap().starts_with("w1 disabled"), "{}", a.body);
    let workers = api.call("GET", "/v1/workers", Some(&viewer), None).body;
    assert_eq!(workers["workers"][0]["access"], "disabled");
    let a = api.json("POST", "/v1/workers/w1:enable", &admin, json!({}));
    assert_eq!(a.body["message"], "w1 enabled");
    // At most `limit` rows, workers without a session counted too, whether they have a
    // record (labels), a certificate, or both.
    for w in ["w0", "w4"] {
        ql(&["enroll", w, "--dir", d, "--out", root.0.join(format!("creds-{w}")).to_str().unwrap()]);
    }
    for w in ["w2", "w3"] {
        let a = api.json("PUT", &format!("/v1/workers/{w}/labels"), &admin, json!({ "labels": { "site": "cellar" } }));
        assert_eq!(a.body["message"], format!("{w}: site=cellar"), "{}", a.body);
    }
    let listed = |limit: usize| -> Vec<String> {
        let body = api.call("GET", &format!("/v1/workers?limit={limit}"), Some(&viewer), None).body;
        body["workers"].as_array().unwrap().iter().map(|r| r["worker"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(listed(50), ["w0", "w1", "w2", "w3", "w4"]);
    assert_eq!(listed(2), ["w0", "w1"]);
    let page = api.call("GET", "/v1/workers?limit=2", Some(&viewer), None).body;
    assert_eq!(page["next"], "w1", "{page}");
    let page = api.call("GET", "/v1/workers?limit=2&after=w1", Some(&viewer), None).body;
    let ids: Vec<&str> = page["workers"].as_array().unwrap().iter().map(|r| r["worker"].as_str().unwrap()).collect();
    assert_eq!((ids, &page["next"]), (vec!["w2", "w3"], &json!("w3")));
    let page = api.call("GET", "/v1/workers?after=w4", Some(&viewer), None).body;
    assert_eq!((page["workers"].as_array().map(Vec::len), &page["next"]), (Some(0), &Value::Null), "{page}");
    let bad = api.call("GET", "/v1/workers?after=Not_A_Worker", Some(&viewer), None);
    assert_eq!((bad.status, bad.body["error"].as_str()), (400, Some("invalid_request")), "{}", bad.body);
    let a = api.json("POST", "/v1/workers/w1:revoke", &admin, json!({ "serial": "00ff" }));
    assert_eq!((a.status, a.body["error"].as_str()), (404, Some("not_found")), "{}", a.body);

    // Schedules.
    let schedule = json!({ "name": "nightly", "cron": "0 30 7 * * *", "tz": "Asia/Shanghai", "run": run_body });
    let a = api.json("POST", "/v1/schedules", &admin, schedule.clone());
    assert!(a.body["message"].as_str().unwrap().starts_with("nightly added"), "{}", a.body);
    let a = api.json("POST", "/v1/schedules", &admin, schedule);
    assert_eq!((a.status, a.body["error"].as_str()), (409, Some("state_conflict")));
    let a = api.json("POST", "/v1/schedules", &admin, json!({ "name": "bad", "cron": "61 * * * *", "run": run_body }));
    assert_eq!(a.status, 400, "{}", a.body);
    // Every other refusal of an admin's request changes nothing either.
    let before = snapshot(&dir);
    let schedule_with = |field: &str, value: Value| {
        let mut body = json!({ "name": "other", "cron": "0 30 7 * * *", "run": run_body });
        body[field] = value;
        body
    };
    let refused_to_admin = [
        ("POST", "/v1/runs/run_nosuchrun:cancel".to_owned(), json!({}), 404),
        ("POST", "/v1/runs/not-a-run:cancel".to_owned(), json!({}), 404),
        ("POST", format!("/v1/runs/{second}:cancel"), json!({ "why": "x" }), 400),
        ("POST", "/v1/runs".to_owned(), json!({ "argv": ["true"], "script": "echo", "interpreter": "sh" }), 400),
        ("POST", "/v1/runs".to_owned(), json!({ "argv": ["true"], "timeoutMs": 0 }), 400),
        ("POST", "/v1/runs".to_owned(), json!({ "argv": ["true"], "env": { "1X": "y" } }), 400),
        ("POST", "/v1/workers/w1:disable".to_owned(), json!({ "serial": "00ff" }), 400),
        ("POST", "/v1/workers/w1:revoke".to_owned(), json!({ "withRenewals": true }), 400),
        ("POST", "/v1/workers/w1:revoke".to_owned(), json!({ "serial": "00ff", "withRenewals": true }), 404),
        ("POST", "/v1/workers/w1:frobnicate".to_owned(), json!({}), 404),
        ("POST", "/v1/workers/Not_A_Worker:disable".to_owned(), json!({}), 404),
        ("PUT", "/v1/workers/w1/labels".to_owned(), json!({ "labels": { "a=b": "c" } }), 400),
        ("PUT", "/v1/workers/w1/labels".to_owned(), json!({}), 400),
        ("POST", "/v1/schedules".to_owned(), schedule_with("name", json!("Bad Name")), 400),
        ("POST", "/v1/schedules".to_owned(), schedule_with("tz", json!("Mars/Olympus")), 400),
        ("POST", "/v1/schedules".to_owned(), schedule_with("overlap", json!("sometimes")), 400),
        ("POST", "/v1/schedules".to_owned(), schedule_with("randomDelayMs", json!(86_400_001u64)), 400),
        ("POST", "/v1/schedules".to_owned(), schedule_with("randomDelayMs", json!(u64::MAX)), 400),
        ("POST", "/v1/schedules/nosuch:pause".to_owned(), json!({}), 404),
        ("POST", "/v1/schedules/nosuch:run-now".to_owned(), json!({}), 404),
        ("DELETE", "/v1/schedules/nosuch".to_owned(), Value::Null, 404),
    ];
    for (method, path, body, status) in &refused_to_admin {
        let a = match body {
            Value::Null => api.call(method, path, Some(&admin), None),
            body => api.json(method, path, &admin, body.clone()),
        };
        assert_eq!(a.status, *status, "{method} {path} {body}: {}", a.body);
        assert!(a.body["message"].is_string(), "a sentence says why: {method} {path}: {}", a.body);
    }
    assert_eq!(snapshot(&dir), before, "no refusal changed a row");

    let list = api.call("GET", "/v1/schedules", Some(&viewer), None).body;
    assert_eq!(list["schedules"][0]["tz"], "Asia/Shanghai", "{list}");
    for action in ["pause", "resume"] {
        let a = api.json("POST", &format!("/v1/schedules/nightly:{action}"), &admin, json!({}));
        assert!(a.body["message"].as_str().unwrap().starts_with(&format!("nightly {action}d")), "{}", a.body);
    }
    let fired = api.json("POST", "/v1/schedules/nightly:run-now", &admin, json!({})).body;
    let fired = fired["runId"].as_str().unwrap().to_owned();
    let shown = api.call("GET", &format!("/v1/runs/{fired}"), Some(&viewer), None).body;
    assert_eq!(shown["schedule"], "nightly");
    let one = api.call("GET", "/v1/schedules/nightly", Some(&viewer), None).body;
    assert_eq!(one["schedule"]["name"], "nightly", "{one}");
    let before = snapshot(&dir);
    assert_eq!(api.call("DELETE", "/v1/schedules/nightly", Some(&viewer), None).status, 403);
    assert_eq!(snapshot(&dir), before);
    let a = api.call("DELETE", "/v1/schedules/nightly", Some(&admin), None);
    assert_eq!(a.body["message"], "nightly removed (its runs stay)");
    let a = api.call("GET", "/v1/schedules/nightly", Some(&viewer), None);
    assert_eq!(a.status, 404);

    // The tokens are nowhere in the state directory; removing an operator ends its token.
    for token in [&viewer, &admin] {
        let secret = token.rsplit_once('.').unwrap().1;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                let bytes = std::fs::read(&path).unwrap();
                assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "{path:?} holds a raw token");
            }
        }
    }
    let listed = ql(&["operator", "list", "--dir", d]);
    assert!(listed.contains("viewer") && listed.contains("read") && !listed.contains(secret), "{listed}");
    ql(&["operator", "remove", "viewer", "--dir", d]);
    assert_eq!(api.call("GET", "/v1/runs", Some(&viewer), None).status, 401);
    assert_eq!(api.call("GET", "/v1/runs", Some(&admin), None).status, 200);
}

/// A `serve` whose operator listener has `all` places, `per_ip` to an address, and
/// timeouts long enough that connections which never start their handshake stay until
/// the limits alone close them; with a runtime to open bare connections from other
/// loopback addresses.
struct Door {
    _root: TempDir,
    dir: PathBuf,
    _serve: Proc,
    url: String,
    port: u16,
    admin: String,
    rt: tokio::runtime::Runtime,
}

impl Door {
    fn open(name: &str, all: u64, per_ip: u64) -> Self {
        let root = TempDir(std::env::temp_dir().join(format!("ql-operator-{name}-{}", std::process::id())));
        let _ = std::fs::remove_dir_all(&root.0);
        let dir = root.0.join("state");
        ql(&["init", "--host", "127.0.0.1", "--dir", dir.to_str().unwrap()]);
        let config = dir.join("control.json");
        let mut c: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        c["operator_max_connections"] = json!(all);
        c["operator_max_connections_per_ip"] = json!(per_ip);
        c["handshake_timeout_ms"] = json!(600_000);
        c["header_timeout_ms"] = json!(600_000);
        std::fs::write(&config, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
        let admin = add_operator(&dir, "boss", "admin");
        let (serve, url) = serve(&dir);
        let port = url.rsplit_once(':').unwrap().1.trim_end_matches('/').parse().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Self { _root: root, dir, _serve: serve, url, port, admin, rt }
    }

    /// A bare TCP connection from `from` (a loopback address), no handshake.
    fn connect(&self, from: &str) -> tokio::net::TcpStream {
        self.rt.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
            socket.connect(([127, 0, 0, 1], self.port).into()).await.unwrap()
        })
    }

    /// Whether the server closed `stream`: its read ends (EOF or reset) within a minute.
    fn closed(&self, stream: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt as _;
        let mut byte = [0u8; 1];
        self.rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(60), stream.read(&mut byte)).await })
            .map(|read| !matches!(read, Ok(n) if n > 0))
            .unwrap_or(false)
    }
}

/// One address holds at most its share of the listener, from its first byte and before
/// any token: its next connection is closed at once while an operator from another
/// address is served; with every place taken a newcomer is turned away unless the
/// heaviest address holds two more than its own, whose oldest connection then closes.
#[test]
fn one_address_cannot_keep_the_operators_out() {
    let door = Door::open("door", 4, 2);
    let (dir, url, admin) = (&door.dir, &door.url, door.admin.as_str());
    let api = Api::new(&dir.join("pki").join("ca.crt"), url.clone());
    let connect = |from: &str| door.connect(from);
    let closed = |stream: &mut tokio::net::TcpStream| door.closed(stream);
    // A connection still open: the server has not closed it (the server sends nothing first).
    let open = |stream: &tokio::net::TcpStream| {
        let mut byte = [0u8; 1];
        matches!(stream.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    };

    let mut x1 = connect("127.0.0.2");
    let x2 = connect("127.0.0.2");
    let mut x3 = connect("127.0.0.2");
    assert!(closed(&mut x3), "an address's third connection is closed unserved");
    // The operator, from 127.0.0.1, is served meanwhile (and keeps its connection).
    assert_eq!(api.call("GET", "/v1/runs", Some(admin), None).status, 200);
    let y1 = connect("127.0.0.3");
    // All four places taken: 127.0.0.3 holds one, the heaviest two, one fewer is not enough.
    let mut y2 = connect("127.0.0.3");
    assert!(closed(&mut y2), "no place for an address holding only one fewer than the heaviest");
    // 127.0.0.4 holds none: the heaviest address's oldest connection makes room for it.
    let z1 = connect("127.0.0.4");
    assert!(closed(&mut x1), "the heaviest address's oldest connection closed for the newcomer");
    // The metrics read now fills no new place: the operator's connection is kept alive.
    let text = api
        .agent
        .get(format!("{url}/metrics"))
        .header("Authorization", format!("Bearer {admin}"))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    for reason in ["address", "all"] {
        let line = format!("ql_operator_connections_turned_away_total{{reason=\"{reason}\"}} 1");
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
    assert!(open(&x2) && open(&y1) && open(&z1), "the connections within the limits stay");
    let said = std::fs::read_to_string(dir.join("serve.err")).unwrap();
    assert!(said.contains("operator connection(s) turned away") && said.contains("from 127.0.0.2"), "{said}");
}

/// A connection closed for a newcomer answers the request it is serving first: here a
/// submit whose body the client sends only once the server asked for it (`100
/// Continue`), so the request is surely being served when the newcomer takes its place.
/// Its answer comes whole, then the connection closes.
#[test]
fn a_connection_closed_for_a_newcomer_answers_its_request_in_flight_first() {
    use std::io::{Read as _, Write as _};
    use std::sync::Arc;
    let door = Door::open("evicted", 2, 2);
    let (dir, admin, port) = (&door.dir, door.admin.as_str(), door.port);
    let mut roots = rustls::RootCertStore::empty();
    for cert in ql_control::client::certificates(&std::fs::read(dir.join("pki").join("ca.crt")).unwrap()) {
        roots.add(rustls::pki_types::CertificateDer::from(cert.der().to_vec())).unwrap();
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let client = rustls::ClientConnection::new(Arc::new(tls), name).unwrap();
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut operator = rustls::StreamOwned::new(client, tcp);
    let body = br#"{"argv":["true"]}"#;
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {admin}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        body.len()
    );
    operator.write_all(head.as_bytes()).unwrap();
    operator.flush().unwrap();
    let mut seen = Vec::new();
    while !seen.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        assert_eq!(operator.read(&mut byte).unwrap(), 1, "the server asks for the body");
        seen.push(byte[0]);
    }
    assert!(seen.starts_with(b"HTTP/1.1 100"), "{}", String::from_utf8_lossy(&seen));

    // 127.0.0.1 fills the places; a newcomer from 127.0.0.3 takes the operator's, the
    // oldest; the next from 127.0.0.3 finds none (one fewer is not enough), and its close
    // tells that the server has handled the newcomer before it.
    let _second = door.connect("127.0.0.1");
    let _newcomer = door.connect("127.0.0.3");
    let mut after = door.connect("127.0.0.3");
    assert!(door.closed(&mut after), "no place for the second newcomer");

    operator.write_all(body).unwrap();
    operator.flush().unwrap();
    let mut answer = Vec::new();
    let ended = operator.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 20") && answer.contains("\"runId\""), "answered whole: {answer}");
    // Closed (with or without TLS's close_notify), not left open until the read timed out.
    let closed = ended.as_ref().map_or_else(|e| e.kind() == std::io::ErrorKind::UnexpectedEof, |_| true);
    assert!(closed, "then closed, not left open: {ended:?}");
}
