//! Webhooks end to end with real processes: runs submitted with `--notify` (and a
//! schedule's runs) are POSTed to a receiver of the test's own, each delivery once, with
//! a valid HMAC-SHA256 signature under the state directory's webhook key, after a
//! receiver that failed at first was retried; `--notify-on failure` is told only of a
//! failure; a receiver that is down gets the bounded attempts and the delivery is
//! recorded `failed`, while the runs themselves ended on time.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::sync::mpsc;

use common::{Agent, Control, TempDir};

/// One request a receiver got: its headers (lowercase names) and body.
struct Received {
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

/// A receiver on loopback: answers 500 to its first `fail_first` requests, then 200, and
/// passes every request on.
fn receiver(fail_first: usize) -> (String, mpsc::Receiver<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook?secret=in-the-url", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut headers = BTreeMap::new();
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            loop {
                line.clear();
                reader.read_line(&mut line).unwrap();
                let Some((name, value)) = line.trim_end().split_once(':') else { break };
                headers.insert(name.to_ascii_lowercase(), value.trim().to_owned());
            }
            let length: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let status = if n < fail_first { "500 Internal Server Error" } else { "200 OK" };
            let _ = write!(stream, "HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            if tx.send(Received { headers, body }).is_err() {
                break;
            }
        }
    });
    (url, rx)
}

const WEBHOOK_SETTINGS: &[(&str, u64)] = &[
    ("webhook_poll_ms", 100),
    ("webhook_backoff_ms", 100),
    ("webhook_backoff_max_ms", 200),
    ("webhook_max_attempts", 3),
    ("webhook_timeout_ms", 2_000),
];

fn world(root: &Path) -> (Control, Agent) {
    let dir = root.join("control");
    let settings: Vec<(&str, u64)> = common::SHORT_TIMINGS.iter().chain(WEBHOOK_SETTINGS).copied().collect();
    common::init_control(common::control_bin(), &dir, &root.join("creds"), &settings);
    let control = Control::serve(common::control_bin(), &dir, "127.0.0.1:0", &root.join("control.err"), &[]);
    let agent = Agent::start(root, &control, &[]);
    (control, agent)
}

fn recv(rx: &mpsc::Receiver<Received>, what: &str) -> Received {
    rx.recv_timeout(common::DEADLINE).unwrap_or_else(|_| panic!("no {what}"))
}

/// HMAC-SHA256 of `body` under `key`, hex: what a receiver computes to check
/// `QL-Signature`.
fn hmac_hex(key: &[u8], body: &[u8]) -> String {
    let tag = ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key), body);
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn json(r: &Received) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap()
}

#[test]
fn each_run_end_is_delivered_once_signed_after_retries_and_a_receiver_down_gets_bounded_attempts() {
    let root = TempDir::new("webhooks");
    let (control, _agent) = world(&root.0);
    let key = std::fs::read_to_string(control.dir.join("webhook.key")).unwrap();
    let (url, rx) = receiver(2);

    // Told of every end: refused twice, then delivered, once, signed.
    let ok = control.submit(&["--notify", &url, "--", "sh", "-c", "echo fine"]);
    let mut seen = Vec::new();
    for attempt in 1..=3 {
        let r = recv(&rx, "delivery");
        assert_eq!(r.headers["ql-delivery"], ok);
        assert_eq!(r.headers["ql-delivery-attempt"], attempt.to_string());
        let signed = r.headers["ql-signature"].strip_prefix("sha256=").unwrap().to_owned();
        assert_eq!(signed, hmac_hex(key.trim().as_bytes(), &r.body), "a valid signature");
        assert_ne!(signed, hmac_hex(b"another key", &r.body));
        seen.push(json(&r));
    }
    assert_eq!(seen[2]["run"]["status"], "succeeded");
    assert_eq!(seen[2]["deliveryId"], ok.as_str());
    let shown = common::wait_for("the delivery to be recorded", String::new, || {
        let shown = control.show(&ok);
        (shown["delivery"]["state"] == "delivered").then_some(shown)
    });
    assert_eq!(shown["delivery"]["attempts"], 3);
    assert_eq!(shown["delivery"]["origin"], url.split("/hook").next().unwrap(), "nothing of the URL's path");
    let text = String::from_utf8(control.cli(&["show", &ok]).stdout).unwrap();
    assert!(text.contains("delivered after 3 attempt(s)") && !text.contains("in-the-url"), "{text}");

    // Told of failures only: a success says nothing, a failure does.
    let quiet = control.submit(&["--notify", &url, "--notify-on", "failure", "--", "true"]);
    let loud = control.submit(&["--notify", &url, "--notify-on", "failure", "--", "sh", "-c", "exit 3"]);
    let r = recv(&rx, "the failure's delivery");
    assert_eq!(r.headers["ql-delivery"], loud, "only the failed run is told of");
    assert_eq!(json(&r)["run"]["status"], "failed");
    common::wait_for("the success to be skipped", String::new, || {
        (control.show(&quiet)["delivery"]["state"] == "skipped").then_some(())
    });

    // A schedule's runs carry its webhook.
    let add = std::process::Command::new(&control.bin)
        .args(["schedule", "add", "hourly", "--cron", "0 * * * *", "--notify", &url, "--dir"])
        .arg(&control.dir)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(add.status.success(), "{}", String::from_utf8_lossy(&add.stderr));
    let fired = String::from_utf8(control.cli(&["schedule", "run-now", "hourly"]).stdout).unwrap().trim().to_owned();
    let r = recv(&rx, "the schedule run's delivery");
    assert_eq!(r.headers["ql-delivery"], fired);
    assert_eq!(json(&r)["run"]["schedule"], "hourly");

    // A receiver that is down: three attempts, then `failed`; the run ended regardless.
    let down = TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}/hook", down.local_addr().unwrap());
    drop(down);
    let lost = control.submit(&["--notify", &dead, "--", "true"]);
    let shown = common::wait_for("the delivery to fail", String::new, || {
        let shown = control.show(&lost);
        (shown["delivery"]["state"] == "failed").then_some(shown)
    });
    assert_eq!(shown["status"], "succeeded");
    assert_eq!(shown["delivery"]["attempts"], 3, "bounded: webhook_max_attempts");
    assert!(shown["delivery"]["lastError"].is_string(), "{shown}");

    // Refused URLs queue nothing.
    for bad in ["ftp://x/hook", "http://", "http://host/a b"] {
        let out = control.cli(&["submit", "--notify", bad, "--", "true"]);
        assert!(!out.status.success(), "{bad}");
    }

    // Nothing was delivered twice, then or ever: once the server (and its notifier) has
    // stopped, a last request of the test's own goes to the receiver, which takes its
    // connections in turn, so every delivery the server sent arrives before it.
    control.stop_and_count_connections();
    let mut last = std::net::TcpStream::connect(url.trim_start_matches("http://").split('/').next().unwrap()).unwrap();
    write!(last, "POST /end HTTP/1.1\r\nql-delivery: end\r\ncontent-length: 0\r\n\r\n").unwrap();
    let extra = recv(&rx, "the test's last request");
    assert_eq!(extra.headers.get("ql-delivery").map(String::as_str), Some("end"), "an extra delivery");
}
