//! ACK throughput of a running `ql-control serve`, over real mTLS on one keep-alive
//! connection per client (the agent's shape).
//!
//! Each client is its own enrolled worker. It loops: poll, claim, then the fenced
//! commands that ADR-0109 and ADR-0117 make one short transaction each — `starting`,
//! `running`, `--renewals` lease renewals and the completion — and times every one of
//! those. It prints ACK transactions per second (from the moment every client has its
//! connection and session to the last one's end) and p50/p99 latency. Run by
//! `bench/control.sh`, which starts the server and reports its memory too.
//!
//! Usage: `ack_bench --dir STATE --url https://127.0.0.1:PORT --clients N --cycles K`
//! `[--renewals R] [--upload-mib M --uploads U] [--database postgres://...]`
//!
//! `--database` names the PostgreSQL database the server runs on (as the runtime role),
//! so the runs are submitted there; without it, the state directory's SQLite file.
//! `bench/pg_acks.sh` runs it against PostgreSQL beside `pgbench`.
//!
//! `--frame-out FILE` (with `--upload-mib M`, `--uploads U`, `--clients 0`) only prepares
//! uploads for another client: it holds one attempt at `running`, writes a valid artifact
//! frame of M MiB to FILE and prints `cert`, `key` and `ca` lines (the worker's PEM files)
//! and U `url` lines (one artifact: the first upload stores it, the others are replays). `bench/agent.sh` sends the file with `curl` to
//! compare the agent's upload throughput with curl's.

#[path = "../tests/common/worker_client.rs"]
mod worker_client;

use worker_client::post;

use std::time::{Duration, Instant};

use ql_control::admin::{self, SubmitArgs};
use ql_wire::ack::{AckReply, Running};
use ql_wire::artifact::{ArtifactHeader, ArtifactReply, ArtifactSchema};
use ql_wire::capability::Token;
use ql_wire::completion::{Completion, CompletionReply, CompletionSchema};
use ql_wire::ids::{ArtifactId, Counter, WorkerId};
use ql_wire::lease::Renewed;
use ql_wire::offer::{Claimed, Offers, PollOffers};
use ql_wire::route::{AttemptCommand, AttemptPath, Route};
use ql_wire::session::{CloseSession, OpenSession, SessionClosed, SessionOpened};
use ql_wire::time::Timestamp;
use ql_wire::{decode, Fence};

struct Args {
    dir: std::path::PathBuf,
    url: String,
    clients: usize,
    cycles: usize,
    renewals: usize,
    upload_mib: u64,
    uploads: usize,
    database: Option<String>,
    frame_out: Option<std::path::PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        dir: "".into(),
        url: String::new(),
        clients: 1,
        cycles: 20,
        renewals: 5,
        upload_mib: 0,
        uploads: 0,
        database: None,
        frame_out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--dir" => a.dir = value.into(),
            "--url" => a.url = value,
            "--clients" => a.clients = value.parse().expect("--clients"),
            "--cycles" => a.cycles = value.parse().expect("--cycles"),
            "--renewals" => a.renewals = value.parse().expect("--renewals"),
            "--upload-mib" => a.upload_mib = value.parse().expect("--upload-mib"),
            "--uploads" => a.uploads = value.parse().expect("--uploads"),
            "--database" => a.database = Some(value),
            "--frame-out" => a.frame_out = Some(value.into()),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn agent(dir: &std::path::Path, worker: &WorkerId) -> ureq::Agent {
    enrolled_agent(dir, worker).0
}

/// Enrols `worker` and returns a client presenting its certificate, and its PEM files.
fn enrolled_agent(dir: &std::path::Path, worker: &WorkerId) -> (ureq::Agent, ql_control::pki::Enrolled) {
    let enrolled = worker_client::enrolled(dir, worker);
    (worker_client::client(&enrolled, Duration::from_secs(60)), enrolled)
}

/// One client's loop; returns the latency of each fenced ACK transaction.
fn client(a: &Args, index: usize, ready: &std::sync::Barrier) -> Vec<Duration> {
    let worker = WorkerId::parse(format!("bench-{index}")).unwrap();
    let agent = agent(&a.dir, &worker);
    let url = a.url.as_str();
    let open = OpenSession {
        agent_version: "bench".parse().unwrap(),
        arch: std::env::consts::ARCH.parse().unwrap(),
        labels: [("bench".parse().unwrap(), index.to_string().parse().unwrap())].into(),
        capacity: 1,
    };
    let session: SessionOpened = post(&agent, url, &Route::OpenSession(worker.clone()), &open);
    ready.wait();
    let mut times = Vec::with_capacity(a.cycles * (a.renewals + 3));
    let mut timed = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    };
    for _ in 0..a.cycles {
        let poll = PollOffers { generation: session.generation, wait_ms: 5_000, max: 1 };
        let offers: Offers = post(&agent, url, &Route::PollOffers(worker.clone(), session.session_id.clone()), &poll);
        let offer = offers.offers.into_iter().next().expect("an offer within 5 s");
        let (token, claim) = worker_client::claim(&session, &offer);
        let route = Route::Claim(worker.clone(), session.session_id.clone(), offer.offer_id.clone());
        let claimed: Claimed = post(&agent, url, &route, &claim);
        let (path, mut fence) = worker_client::claimed(&worker, &session, &offer, token, &claimed);
        let at = |cmd| Route::Attempt(path.clone(), cmd);
        timed(&mut || {
            let _: AckReply = post(&agent, url, &at(AttemptCommand::Starting), &fence);
        });
        let callback = Token::generate().unwrap();
        let running =
            Running::new(fence.clone(), "pid:1 start:1".parse().unwrap(), None, Counter::ONE, callback.digest());
        timed(&mut || {
            let _: AckReply = post(&agent, url, &at(AttemptCommand::Running), &running);
        });
        for _ in 0..a.renewals {
            timed(&mut || {
                let r: Renewed = post(&agent, url, &at(AttemptCommand::RenewLease), &fence);
                fence.expected_lease_version = r.lease_version;
            });
        }
        let done = Completion::new(
            fence.clone(),
            CompletionSchema,
            Counter::ONE,
            callback.clone(),
            Some(0),
            None,
            Timestamp::from_millis(0).unwrap(),
            None,
        );
        timed(&mut || {
            let _: CompletionReply = post(&agent, url, &at(AttemptCommand::Completion), &done);
        });
    }
    // A clean exit, as the agent's: the next round's client of this worker opens at once.
    let close = CloseSession { generation: session.generation };
    let _: SessionClosed = post(&agent, url, &Route::CloseSession(worker, session.session_id.clone()), &close);
    times
}

/// A worker `bench-<label>` with one attempt of the run labelled `bench=<label>` held at
/// `running`: its client, PEM files, attempt and fence.
fn held_at_running(a: &Args, label: &str) -> (ureq::Agent, ql_control::pki::Enrolled, AttemptPath, Fence) {
    let worker = WorkerId::parse(format!("bench-{label}")).unwrap();
    let (agent, enrolled) = enrolled_agent(&a.dir, &worker);
    let url = a.url.as_str();
    let open = OpenSession {
        agent_version: "bench".parse().unwrap(),
        arch: std::env::consts::ARCH.parse().unwrap(),
        labels: [("bench".parse().unwrap(), label.parse().unwrap())].into(),
        capacity: 1,
    };
    let session: SessionOpened = post(&agent, url, &Route::OpenSession(worker.clone()), &open);
    let poll = PollOffers { generation: session.generation, wait_ms: 5_000, max: 1 };
    let offers: Offers = post(&agent, url, &Route::PollOffers(worker.clone(), session.session_id.clone()), &poll);
    let offer = offers.offers.into_iter().next().expect("an upload offer");
    let (token, claim) = worker_client::claim(&session, &offer);
    let claimed: Claimed =
        post(&agent, url, &Route::Claim(worker.clone(), session.session_id.clone(), offer.offer_id.clone()), &claim);
    let (path, fence) = worker_client::claimed(&worker, &session, &offer, token, &claimed);
    let _: AckReply = post(&agent, url, &Route::Attempt(path.clone(), AttemptCommand::Starting), &fence);
    let running = Running::new(
        fence.clone(),
        "pid:1 start:1".parse().unwrap(),
        None,
        Counter::ONE,
        Token::generate().unwrap().digest(),
    );
    let _: AckReply = post(&agent, url, &Route::Attempt(path.clone(), AttemptCommand::Running), &running);
    (agent, enrolled, path, fence)
}

/// Writes one frame of `--upload-mib` MiB for an attempt held at `running` to `out`, and
/// prints where and with what another client may send it `--uploads` times.
fn frame_out(a: &Args, out: &std::path::Path) {
    let (_, enrolled, path, fence) = held_at_running(a, "curl");
    let len = a.upload_mib * 1024 * 1024;
    let header = ArtifactHeader::new(fence, ArtifactSchema, len, false);
    let mut file = std::io::BufWriter::new(std::fs::File::create(out).expect("frame file"));
    std::io::Write::write_all(&mut file, &ql_wire::frame::encode_prefix(&header).unwrap()).unwrap();
    std::io::copy(&mut std::io::Read::take(std::io::repeat(b'c'), len), &mut file).unwrap();
    std::io::Write::flush(&mut file).unwrap();
    println!("cert {}", enrolled.cert.display());
    println!("key {}", enrolled.key.display());
    println!("ca {}", enrolled.ca.display());
    // One attempt stores one content: the first upload stores it, each further one is a
    // replay the server reads to its end and compares, the same work.
    let route = Route::Artifact(path.clone(), ArtifactId::parse("curl").unwrap());
    for _ in 0..a.uploads {
        println!("url {}{}", a.url, route.path());
    }
}

/// Uploads `count` artifacts of `mib` MiB, each through an attempt held at `running` (an
/// attempt stores one content).
fn uploads(a: &Args) {
    let url = a.url.as_str();
    let len = a.upload_mib * 1024 * 1024;
    for i in 0..a.uploads {
        let (agent, _, path, fence) = held_at_running(a, &format!("upload{i}"));
        let header = ArtifactHeader::new(fence.clone(), ArtifactSchema, len, false);
        let prefix = ql_wire::frame::encode_prefix(&header).unwrap();
        let fill = std::io::Read::take(std::io::repeat(b'a' + i as u8), len);
        let mut body = std::io::Read::chain(std::io::Cursor::new(prefix.to_vec()), fill);
        let route = Route::Artifact(path.clone(), ArtifactId::parse(format!("blob{i}")).unwrap());
        let t = Instant::now();
        let mut resp = agent
            .put(format!("{url}{}", route.path()))
            .header("Content-Type", ql_wire::route::ARTIFACT_MEDIA_TYPE)
            .header("Content-Length", (prefix.len() as u64 + len).to_string())
            .header("Expect", "100-continue")
            .send(ureq::SendBody::from_reader(&mut body))
            .expect("upload");
        let bytes = resp.body_mut().read_to_vec().unwrap();
        let reply: ArtifactReply = decode(&bytes).expect("artifact reply");
        let secs = t.elapsed().as_secs_f64();
        println!(
            "upload {i}: {} MiB in {secs:.2} s ({:.0} MiB/s), {:?}",
            a.upload_mib,
            a.upload_mib as f64 / secs,
            reply.result
        );
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (store, _) = rt.block_on(admin::open_authority(&a.dir, a.database.as_deref())).expect("the authority");
    let ops = ql_control::ops::Local { store, blobs: admin::open_blobs(&a.dir, None).expect("the artifact store") };
    let queue = |args: &SubmitArgs| {
        let body = admin::body_of(args).expect("a valid run");
        rt.block_on(ops.submit(&body)).map(drop).map_err(String::from)
    };
    let submit = |label: String| SubmitArgs {
        project: "default".into(),
        argv: vec!["true".into()],
        timeout_ms: 600_000,
        log_limit: 1024,
        agent_labels: vec![label],
        ..SubmitArgs::default()
    };
    for i in 0..a.clients {
        for _ in 0..a.cycles {
            queue(&submit(format!("bench={i}"))).expect("submit");
        }
    }
    if let Some(out) = &a.frame_out {
        let mut up = submit("bench=curl".into());
        up.log_limit = a.upload_mib * 1024 * 1024;
        queue(&up).expect("submit the curl run");
        frame_out(&a, out);
        return;
    }
    for i in 0..a.uploads {
        let mut up = submit(format!("bench=upload{i}"));
        up.log_limit = 64 * 1024 * 1024;
        queue(&up).expect("submit upload run");
    }
    // The clock starts once every client has its connection and session: the figure is
    // the steady rate, not the handshakes and enrolments before it.
    let ready = std::sync::Barrier::new(a.clients + 1);
    let (mut all, wall): (Vec<Duration>, f64) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..a.clients)
            .map(|i| {
                let (a, ready) = (&a, &ready);
                s.spawn(move || client(a, i, ready))
            })
            .collect();
        ready.wait();
        let start = Instant::now();
        let all = handles.into_iter().flat_map(|h| h.join().expect("client thread")).collect();
        (all, start.elapsed().as_secs_f64())
    });
    all.sort();
    if !all.is_empty() {
        println!(
            "clients {:>3}: {:>6} ACK transactions in {wall:.2} s = {:>7.0} ACK/s, p50 {:.2} ms, p99 {:.2} ms",
            a.clients,
            all.len(),
            all.len() as f64 / wall,
            percentile(&all, 0.50).as_secs_f64() * 1e3,
            percentile(&all, 0.99).as_secs_f64() * 1e3,
        );
    }
    if a.uploads > 0 {
        uploads(&a);
    }
}
