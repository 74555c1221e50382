//! The dashboard in a real headless Chromium (Debian's, through ChromeDriver's WebDriver
//! API) against a real `serve` with a real agent: it signs in with an operator token,
//! opens each page and checks what it shows against the database — a succeeded, a failed
//! and a running run; an online and an expired worker — follows a running job's log
//! until a line the job printed after the page loaded appears, pauses a schedule as an
//! admin, and saves a screenshot of each page (under `target/dashboard/`). A job that
//! prints `<script>` and a label with markup are shown as text. A request without a
//! session, and a form without its CSRF token, are refused and change nothing.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use common::{wait_for, Agent, Proc, World};

/// One ChromeDriver and its browser session.
struct Browser {
    http: ureq::Agent,
    base: String,
    _driver: Proc,
    _profile: PathBuf,
}

impl Browser {
    fn start(root: &Path) -> Browser {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver runs (scripts/browser install)");
        let driver = Proc(driver);
        let http: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let url = format!("http://127.0.0.1:{port}");
        wait_for("chromedriver to listen", String::new, || {
            http.get(format!("{url}/status")).call().ok().filter(|r| r.status() == 200).map(drop)
        });
        let profile = root.join("chromium-profile");
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,900",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            // The server's certificate is signed by the state directory's CA, which this
            // browser does not know.
            "acceptInsecureCerts": true,
            "goog:chromeOptions": { "binary": "/usr/bin/chromium", "args": args },
        }}});
        let session = post(&http, &format!("{url}/session"), &caps);
        let id = session["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {session}")).to_owned();
        Browser { http, base: format!("{url}/session/{id}"), _driver: driver, _profile: profile }
    }

    fn cmd(&self, path: &str, body: Value) -> Value {
        post(&self.http, &format!("{}{path}", self.base), &body)
    }

    fn get(&self, path: &str) -> Value {
        let mut r = self.http.get(format!("{}{path}", self.base)).call().unwrap();
        serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
    }

    fn open(&self, url: &str) {
        self.cmd("/url", json!({ "url": url }));
    }

    fn find(&self, css: &str) -> Option<String> {
        let v = self.cmd("/element", json!({ "using": "css selector", "value": css }));
        v["value"]["element-6066-11e4-a52e-4f735466cecf"].as_str().map(str::to_owned)
    }

    fn text(&self, css: &str) -> String {
        let el = self.find(css).unwrap_or_else(|| panic!("no {css} in {}", self.source()));
        self.get(&format!("/element/{el}/text"))["value"].as_str().unwrap_or_default().to_owned()
    }

    fn click(&self, css: &str) {
        let el = self.find(css).unwrap_or_else(|| panic!("no {css}"));
        self.cmd(&format!("/element/{el}/click"), json!({}));
    }

    fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css).unwrap_or_else(|| panic!("no {css}"));
        self.cmd(&format!("/element/{el}/value"), json!({ "text": text }));
    }

    fn source(&self) -> String {
        self.get("/source")["value"].as_str().unwrap_or_default().to_owned()
    }

    fn title(&self) -> String {
        self.get("/title")["value"].as_str().unwrap_or_default().to_owned()
    }

    /// Whether an alert dialog is open (a script the page must not have run would open one).
    fn alert_open(&self) -> bool {
        self.get("/alert/text")["value"].get("error").is_none()
    }

    fn cookie(&self, name: &str) -> String {
        let v = self.get(&format!("/cookie/{name}"));
        v["value"]["value"].as_str().unwrap_or_else(|| panic!("no cookie {name}: {v}")).to_owned()
    }

    fn screenshot(&self, path: &Path) {
        let png = self.get("/screenshot")["value"].as_str().unwrap().to_owned();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, base64_decode(&png)).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.http.delete(&self.base).call();
    }
}

fn post(http: &ureq::Agent, url: &str, body: &Value) -> Value {
    let mut r = http.post(url).header("Content-Type", "application/json").send(body.to_string().as_bytes()).unwrap();
    serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
}

/// Standard base64 with padding, as WebDriver sends screenshots.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let clean: Vec<u8> = text.bytes().filter(|c| *c != b'=' && !c.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let n = chunk.iter().fold(0u32, |acc, c| (acc << 6) | u32::from(value(*c))) << (6 * (4 - chunk.len()));
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

/// Where the screenshots go: `target/dashboard/` of this workspace.
fn shots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target").join("dashboard")
}

#[test]
fn every_page_shows_the_database_escaped_with_a_live_log_and_checked_forms() {
    let w = World::new("dashboard", &[("capacity", "2")]);
    let admin = w.control.operator("boss", "admin");
    let ui = format!("{}/ui", w.control.operator_url);

    // An expired worker: w2 opens a session and dies without closing it.
    let creds2 = w.path("creds2");
    let out = w.control.cli(&["enroll", "w2", "--out", creds2.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config = format!(
        // A poll keeps its session alive for its wait: a short one, so the session of the
        // dead agent expires soon.
        "server = {}\nworker_id = w2\ncert = {}\nkey = {}\nca = {}\nstate_dir = {}\npoll_wait_ms = 1000\n",
        w.control.url,
        creds2.join("w2.crt").display(),
        creds2.join("w2.key").display(),
        creds2.join("ca.crt").display(),
        w.path("state2").display()
    );
    let config_path = w.path("agent2.conf");
    std::fs::write(&config_path, config).unwrap();
    let mut second = Agent::spawn_with(&common::agent_bin(), &w.path("agent2.err"), config_path, &[]);
    let expired = || {
        let out = String::from_utf8(w.control.cli(&["workers"]).stdout).unwrap();
        out.lines().any(|l| l.starts_with("w2 ") && l.contains("expired")).then_some(())
    };
    wait_for(
        "w2 to be online",
        || second.log(),
        || {
            let out = String::from_utf8(w.control.cli(&["workers"]).stdout).unwrap();
            out.lines().any(|l| l.starts_with("w2 ") && l.contains("online")).then_some(())
        },
    );
    second.proc.0.kill().unwrap();
    second.proc.0.wait().unwrap();
    wait_for("w2's session to expire", String::new, expired);

    // A trusted label with markup; a succeeded run printing a script; a failed run; a
    // running one that prints a line after the page has loaded.
    let label = Command::new(&w.control.bin)
        .args(["label", "--dir"])
        .arg(&w.control.dir)
        .args(["w1", "site=<b>attic</b>"])
        .output()
        .unwrap();
    assert!(label.status.success(), "{}", String::from_utf8_lossy(&label.stderr));
    let ok = w.control.submit(&["--", "sh", "-c", "echo '<script>alert(1)</script>'; echo done"]);
    let bad = w.control.submit(&["--", "sh", "-c", "echo nope; exit 3"]);
    w.wait_status(&ok, "succeeded");
    w.wait_status(&bad, "failed");
    let gate = w.path("gate");
    let running = w.control.submit(&[
        "--",
        "sh",
        "-c",
        &format!(
            "echo started; while [ ! -e {} ]; do sleep 0.1; done; echo after-the-page-loaded; sleep 60",
            gate.display()
        ),
    ]);
    wait_for("the running job's first line", String::new, || {
        let out = w.control.cli(&["logs", &running]);
        String::from_utf8_lossy(&out.stdout).contains("started").then_some(())
    });
    let add = Command::new(&w.control.bin)
        .args(["schedule", "add", "nightly", "--cron", "0 30 7 * * *", "--dir"])
        .arg(&w.control.dir)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(add.status.success());

    // Without a session: to the sign-in page, and nothing else.
    let client = w.control.operator_client();
    for page in ["/runs".to_owned(), format!("/runs/{ok}"), "/workers".into(), "/schedules".into(), "".into()] {
        let r = client.get(format!("{ui}{page}")).call().unwrap();
        assert_eq!((r.status().as_u16(), r.headers()["location"].to_str().unwrap()), (303, "/ui/login"), "{page}");
    }
    let r = client.get(format!("{ui}/runs/{ok}/log")).call().unwrap();
    assert_eq!(r.status(), 401, "the live log without a session");
    let r = client.get(format!("{ui}/runs")).header("Cookie", "__Host-ql_ui=boss.99999999999.00ff").call().unwrap();
    assert_eq!(r.status(), 303, "a forged cookie is no session");
    assert_eq!(client.get(format!("{}/metrics", w.control.operator_url)).call().unwrap().status(), 401);

    let b = Browser::start(w.path("").as_path());
    b.open(&format!("{ui}/login"));
    b.type_into("input[name=token]", "boss.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
    b.click("button[type=submit]");
    // A click returns before the page it posts has loaded: wait for it.
    wait_for(
        "a wrong token to be refused",
        || b.source(),
        || b.source().contains("that token is not an operator").then_some(()),
    );
    b.screenshot(&shots().join("login.png"));
    b.type_into("input[name=token]", &admin);
    b.click("button[type=submit]");
    wait_for("the runs page", || b.source(), || (b.title() == "Runs · QingLong Edge").then_some(()));

    // Runs: each with the status the database holds.
    let table = b.text("table");
    for (run, status) in [(&ok, "succeeded"), (&bad, "failed"), (&running, "running")] {
        let row =
            table.lines().find(|l| l.contains(run.as_str())).unwrap_or_else(|| panic!("{run} not listed:\n{table}"));
        assert!(row.contains(status), "{row}");
        assert_eq!(w.control.show(run)["status"], status);
    }
    b.screenshot(&shots().join("runs.png"));
    b.open(&format!("{ui}/runs?status=failed"));
    let failed = b.text("table");
    assert!(failed.contains(&bad) && !failed.contains(&ok), "{failed}");

    // A run: its log shown as text, never run as a script.
    b.open(&format!("{ui}/runs/{ok}"));
    assert_eq!(b.text("#log"), "<script>alert(1)</script>\ndone");
    assert!(b.source().contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(!b.alert_open(), "the job's output ran as a script");
    let sha = w.control.show(&ok)["attempts"][0]["artifact"]["sha256"].as_str().unwrap().to_owned();
    assert!(b.text("table").contains(&sha), "the stored log's SHA-256 is shown");
    b.screenshot(&shots().join("run.png"));

    // The running job's page follows its log: a line printed after the page loaded.
    b.open(&format!("{ui}/runs/{running}"));
    assert!(b.text("#log").contains("started"));
    std::fs::write(&gate, "").unwrap();
    wait_for(
        "the live tail to show the new line",
        || b.source(),
        || b.text("#log").contains("after-the-page-loaded").then_some(()),
    );
    b.screenshot(&shots().join("live-log.png"));

    // Workers: w1 online with its label as text, w2 expired.
    b.open(&format!("{ui}/workers"));
    let workers = b.text("table");
    let row = |w: &str| workers.lines().find(|l| l.starts_with(&format!("{w} "))).unwrap_or_default().to_owned();
    assert!(row("w1").contains("online") && row("w1").contains("site=<b>attic</b>"), "{workers}");
    assert!(row("w2").contains("expired"), "{workers}");
    assert!(!b.source().contains("<b>attic</b>"), "the label's markup is escaped");
    b.screenshot(&shots().join("workers.png"));

    // Schedules: a form without its CSRF token changes nothing; the admin's button does.
    let cookie = b.cookie("__Host-ql_ui");
    let forged = client
        .post(format!("{ui}/schedules/nightly/pause"))
        .header("Cookie", format!("__Host-ql_ui={cookie}"))
        .header("Content-Type", "application/x-www-form-urlencoded")
        .send(&b"csrf=forged"[..])
        .unwrap();
    assert_eq!(forged.status(), 403);
    let cross_site = client
        .post(format!("{ui}/login"))
        .header("Sec-Fetch-Site", "cross-site")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .send(format!("token={admin}").as_bytes())
        .unwrap();
    assert_eq!(cross_site.status(), 403, "a sign-in posted from another site");
    // With a session's own CSRF token: nothing from another site, no unknown action,
    // nothing without the session, and nothing for the read role.
    let csrf_of = |cookie: &str| {
        let mut page = client.get(format!("{ui}/schedules")).header("Cookie", format!("__Host-ql_ui={cookie}"));
        page = page.header("Accept", "text/html");
        let html = page.call().unwrap().body_mut().read_to_string().unwrap();
        let field = "name=\"csrf\" value=\"";
        let at = html.find(field).expect("a form with its CSRF token") + field.len();
        html[at..].split('"').next().unwrap().to_owned()
    };
    let pause = |action: &str, cookie: Option<&str>, csrf: &str, site: &str| {
        let mut r = client.post(format!("{ui}/schedules/nightly/{action}"));
        if let Some(cookie) = cookie {
            r = r.header("Cookie", format!("__Host-ql_ui={cookie}"));
        }
        r = r.header("Sec-Fetch-Site", site).header("Content-Type", "application/x-www-form-urlencoded");
        r.send(format!("csrf={csrf}").as_bytes()).unwrap().status().as_u16()
    };
    let csrf = csrf_of(&cookie);
    assert_eq!(pause("pause", Some(&cookie), &csrf, "cross-site"), 403, "a valid form posted from another site");
    assert_eq!(pause("frobnicate", Some(&cookie), &csrf, "same-origin"), 404, "an unknown action");
    assert_eq!(pause("pause", None, &csrf, "same-origin"), 303, "no session: to the sign-in page");
    let viewer = w.control.operator("viewer", "read");
    let signed_in = client
        .post(format!("{ui}/login"))
        .header("Content-Type", "application/x-www-form-urlencoded")
        .send(format!("token={viewer}").as_bytes())
        .unwrap();
    let set = signed_in.headers()["set-cookie"].to_str().unwrap();
    let read_cookie = set.strip_prefix("__Host-ql_ui=").unwrap().split(';').next().unwrap().to_owned();
    let read_csrf = csrf_of(&read_cookie);
    assert_eq!(pause("pause", Some(&read_cookie), &read_csrf, "same-origin"), 403, "the read role");
    let listed = || String::from_utf8(w.control.cli(&["schedule", "list"]).stdout).unwrap();
    assert!(listed().lines().any(|l| l.starts_with("nightly") && l.contains(" no ")), "{}", listed());
    b.open(&format!("{ui}/schedules"));
    b.screenshot(&shots().join("schedules.png"));
    b.click("form[action='/ui/schedules/nightly/pause'] button");
    wait_for("the schedule to be paused", || b.source(), || b.source().contains("nightly paused").then_some(()));
    assert!(listed().lines().any(|l| l.starts_with("nightly") && l.contains(" yes ")), "{}", listed());

    // Signing out ends the session.
    b.click("form[action='/ui/logout'] button");
    wait_for("the sign-in page", || b.source(), || (b.title() == "Sign in · QingLong Edge").then_some(()));
    b.open(&format!("{ui}/runs"));
    assert_eq!(b.title(), "Sign in · QingLong Edge");
}
