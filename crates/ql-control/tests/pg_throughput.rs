//! Many clients driving fenced ACK transactions through one PostgreSQL store at once,
//! without HTTP in the way: every invariant holds afterwards, and the store's own ACK
//! transaction rate is printed.
//!
//! In the test suite it is small (8 clients, 5 cycles). `bench/pg_acks.sh` runs it in
//! release with `QL_BENCH_CLIENTS`, `QL_BENCH_CYCLES` and `QL_BENCH_RENEWALS` (and the pool
//! and lanes of group commit with `QL_BENCH_POOL`, `QL_BENCH_LANES` and `QL_BENCH_FILL`) to put the store-level figure
//! beside `pgbench -N` at the same client count on the same server.

mod contract;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ql_control::core::{Command, Reply, Submit};
use ql_control::store::postgres::PgOptions;
use ql_control::store::Store;
use ql_wire::completion::TerminalStatus;
use ql_wire::offer::PollOffers;
use ql_wire::Outcome;

use contract::pg::{Pg, TestDb};
use contract::*;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_ack_transactions_keep_every_invariant() {
    let (clients, cycles, renewals) =
        (env("QL_BENCH_CLIENTS", 8), env("QL_BENCH_CYCLES", 5), env("QL_BENCH_RENEWALS", 5));
    let db = TestDb::new("throughput").await;
    let offset = Arc::new(AtomicI64::new(0));
    // The replica's pool (`pg_pool_size`, QL_BENCH_POOL here), one connection per client
    // at most: more clients than connections wait for one, as behind a serving replica.
    let pool_size = env("QL_BENCH_POOL", PgOptions::default().pool_size).min(clients);
    // Its lanes of group commit (`pg_lanes`, QL_BENCH_LANES here), at most one per connection.
    let lanes = env("QL_BENCH_LANES", PgOptions::default().lanes).min(pool_size);
    let lane_fill = env("QL_BENCH_FILL", PgOptions::default().lane_fill).max(1);
    let store = db.store(PgOptions { pool_size, lanes, lane_fill, ..Pg::options(&offset) }).await;
    for i in 0..clients {
        let labels = BTreeMap::from([("bench".to_owned(), i.to_string())]);
        for _ in 0..cycles {
            let submit = Submit {
                project: project(),
                spec: spec(LONG_TIMEOUT_MS),
                labels: BTreeMap::new(),
                agent_labels: labels.clone(),
                retry_budget: 0,
                notify: None,
            };
            assert!(matches!(exec(&store, Command::Submit(submit)).await, Ok(Reply::Submitted(_))));
        }
    }
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let label = i.to_string();
                let agent = open_with(&store, &format!("bench-{i}"), 1, &[("bench", label.as_str())]).await;
                let mut acks = Vec::with_capacity(cycles * (renewals + 3));
                for _ in 0..cycles {
                    let body = PollOffers { generation: agent.generation, wait_ms: 0, max: 1 };
                    let cmd = Command::PollOffers(agent.worker.clone(), agent.session.clone(), body);
                    let offer = match exec(&store, cmd).await {
                        Ok(Reply::Offers(o, _)) => o.offers.into_iter().next().expect("this client's run"),
                        other => panic!("poll: {other:?}"),
                    };
                    let mut h = claim(&store, &agent, &offer).await;
                    let timed = Instant::now();
                    to_running(&store, &h).await;
                    acks.push(timed.elapsed() / 2);
                    acks.push(timed.elapsed() / 2);
                    for _ in 0..renewals {
                        let t = Instant::now();
                        renew(&store, &mut h).await;
                        acks.push(t.elapsed());
                    }
                    let t = Instant::now();
                    let done = completed(Outcome::Completed, TerminalStatus::Succeeded);
                    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(done));
                    acks.push(t.elapsed());
                }
                acks
            })
        })
        .collect();
    let mut acks: Vec<Duration> = Vec::new();
    for t in tasks {
        acks.extend(t.await.unwrap());
    }
    let wall = started.elapsed().as_secs_f64();
    acks.sort();
    let pct = |p: f64| acks[((acks.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3;
    let grouped = store.group_commits();
    println!(
        "store-level clients {clients:>3}: {:>6} ACK transactions in {wall:.2} s = {:>7.0} ACK/s, p50 {:.2} ms, \
         p99 {:.2} ms; {} commands committed in {} groups",
        acks.len(),
        acks.len() as f64 / wall,
        pct(0.5),
        pct(0.99),
        grouped.commands,
        grouped.transactions
    );
    let snap = store.snapshot().await.unwrap();
    check_invariants(&snap);
    assert!(snap.runs.iter().all(|r| r.status == ql_control::model::RunStatus::Succeeded));
}
