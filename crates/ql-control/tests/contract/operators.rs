//! The operator-credential scenarios of the store contract: a name is taken once, a
//! credential is kept as its digest only, and removing it leaves the others.

use ql_control::core::{authorize, Command, Reply};
use ql_control::model::Role;
use ql_control::store::Store;
use ql_wire::capability::Token;

use super::*;

pub async fn an_operator_credential_is_added_once_and_removed_once<B: Backend>(b: B) {
    let store = b.store();
    let (reader, admin) = (Token::generate().unwrap(), Token::generate().unwrap());
    let added = exec(&store, Command::AddOperator("viewer".into(), Role::Read, reader.digest())).await;
    assert!(matches!(added, Ok(Reply::Operator(o)) if o.role == Role::Read && o.token_digest == reader.digest()));
    assert!(exec(&store, Command::AddOperator("boss".into(), Role::Admin, admin.digest())).await.is_ok());
    refused(
        &store,
        Command::AddOperator("viewer".into(), Role::Admin, admin.digest()),
        ErrorCode::StateConflict,
        "a taken name",
    )
    .await;
    refused(
        &store,
        Command::AddOperator("Bad Name".into(), Role::Admin, admin.digest()),
        ErrorCode::InvalidRequest,
        "a bad name",
    )
    .await;
    refused(&store, Command::RemoveOperator("nobody".into()), ErrorCode::NotFound, "an unknown name").await;

    let operators = store.operators().await.unwrap();
    let names: Vec<&str> = operators.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["boss", "viewer"]);
    let viewer = operators.iter().find(|o| o.name == "viewer");
    assert_eq!(authorize(viewer, &reader.digest(), Role::Read), Ok(Role::Read));
    assert_eq!(authorize(viewer, &reader.digest(), Role::Admin), Err(ErrorCode::Forbidden));
    assert_eq!(authorize(viewer, &admin.digest(), Role::Read), Err(ErrorCode::Unauthenticated));

    assert!(exec(&store, Command::RemoveOperator("viewer".into())).await.is_ok());
    let left: Vec<String> = store.operators().await.unwrap().into_iter().map(|o| o.name).collect();
    assert_eq!(left, ["boss"]);
    assert_eq!(store.snapshot().await.unwrap().operators.len(), 1);
}

/// A run's webhook delivery is written with the run, claimed once its run ended (by one
/// of two processes claiming at once), and retried after a failure until it is delivered;
/// a stale report changes nothing.
pub async fn a_webhook_delivery_is_claimed_once_and_retried_until_delivered<B: Backend>(b: B) {
    use ql_control::core::{DeliveryPolicy, Submit};
    use ql_control::model::{DeliveryState, Notify, NotifyOn};
    let (store, other) = (b.store(), b.other_process());
    let notify = Some(Notify { url: "http://127.0.0.1:9/hook".into(), on: NotifyOn::All });
    let submit = Submit {
        project: project(),
        spec: spec(LONG_TIMEOUT_MS),
        labels: BTreeMap::new(),
        agent_labels: BTreeMap::new(),
        retry_budget: 0,
        notify,
    };
    let Ok(Reply::Submitted(run)) = exec(&store, Command::Submit(submit)).await else { panic!("submit") };
    let policy =
        DeliveryPolicy { claim_ms: 60_000, max_attempts: 3, backoff_ms: 1_000, backoff_max_ms: 1_000, batch: 16 };
    let snap = store.snapshot().await.unwrap();
    assert_eq!(snap.deliveries.len(), 1, "written with its run");
    assert_eq!(snap.deliveries[0].state, DeliveryState::Waiting);
    let claimed = |r: Result<Reply, ErrorCode>| match r {
        Ok(Reply::Deliveries(d)) => d.len(),
        other => panic!("{other:?}"),
    };
    assert_eq!(claimed(exec(&store, Command::ClaimDeliveries(policy)).await), 0, "a queued run is not told of");

    assert_eq!(cancel(&store, &run).await, ql_control::core::CancelOutcome::Cancelled);
    let (x, y) =
        tokio::join!(store.execute(Command::ClaimDeliveries(policy)), other.execute(Command::ClaimDeliveries(policy)));
    assert_eq!(claimed(x.unwrap()) + claimed(y.unwrap()), 1, "one claim of the ended run's delivery");
    assert_eq!(claimed(exec(&store, Command::ClaimDeliveries(policy)).await), 0, "claimed: not again meanwhile");

    let failed = Command::DeliveryDone(run.clone(), 1, Err("answered 500".into()), policy);
    assert!(exec(&store, failed).await.is_ok());
    b.advance(1_001);
    assert_eq!(claimed(exec(&store, Command::ClaimDeliveries(policy)).await), 1, "again after the backoff");
    refused(&store, Command::DeliveryDone(run.clone(), 1, Ok(()), policy), ErrorCode::StateConflict, "a stale report")
        .await;
    assert!(exec(&store, Command::DeliveryDone(run.clone(), 2, Ok(()), policy)).await.is_ok());
    let d = &store.snapshot().await.unwrap().deliveries[0];
    assert_eq!((d.state, d.attempts, d.last_error.as_deref()), (DeliveryState::Delivered, 2, None));
    let detail = store.run_detail(&run).await.unwrap().unwrap();
    assert_eq!(detail.delivery.as_ref().map(|d| d.state), Some(DeliveryState::Delivered));
}

/// The figures metrics read: runs by status, the oldest queued run's age, the stored
/// bytes — the same on every store.
pub async fn stats_count_the_rows_by_status<B: Backend>(b: B) {
    let store = b.store();
    let first = submit(&store, LONG_TIMEOUT_MS, 0).await;
    submit(&store, LONG_TIMEOUT_MS, 0).await;
    cancel(&store, &first).await;
    b.advance(2_000);
    let stats = store.stats().await.unwrap();
    let value = |kind: &str, label: &str| stats.iter().find(|s| s.kind == kind && s.label == label).map(|s| s.value);
    assert_eq!(value("runs", "queued"), Some(1), "{stats:?}");
    assert_eq!(value("runs", "cancelled"), Some(1), "{stats:?}");
    assert!(value("queued_age_ms", "").is_some_and(|age| age >= 2_000), "{stats:?}");
    assert_eq!(value("artifact_bytes", ""), Some(0));
    assert_eq!(value("runs", "running"), None, "only the statuses there are");
}

/// Run retention: the oldest ended runs past it go, a batch at a time, with every row that
/// names them (attempts, offers, leases, events, live-log chunks, the delivery of a
/// webhook told), and nothing else changes. A run still queued, one that ended within the
/// retention and one whose webhook waits to be told stay, even when named to
/// `prune_runs`; a run that went is not found, and a second pass removes nothing.
pub async fn ended_runs_past_their_retention_go_with_every_row_that_names_them<B: Backend>(b: B) {
    use ql_control::core::{ChunkAdmitted, ChunkPlan, DeliveryPolicy, Submit};
    use ql_control::model::{Notify, NotifyOn};
    use ql_control::store::RunRetention;
    use ql_wire::capability::Digest;
    use ql_wire::ids::ArtifactId;
    use ql_wire::log::{LogAppendReply, LogChunkHeader, LogChunkSchema};

    let store = b.store();
    let submit_told = |url: &str| Submit {
        project: project(),
        spec: spec(LONG_TIMEOUT_MS),
        labels: BTreeMap::new(),
        agent_labels: BTreeMap::new(),
        retry_budget: 0,
        notify: Some(Notify { url: url.into(), on: NotifyOn::All }),
    };
    // Ran, with a live-log chunk, told of by a webhook that was delivered.
    let h = {
        let Ok(Reply::Submitted(run)) = exec(&store, Command::Submit(submit_told("http://127.0.0.1:9/a"))).await else {
            panic!("submit")
        };
        let agent = open(&store, "w-1").await;
        let offer = poll(&store, &agent).await.into_iter().find(|o| o.run_id == run).unwrap();
        claim(&store, &agent, &offer).await
    };
    to_starting(&store, &h).await;
    let log = ArtifactId::parse("log").unwrap();
    let running = Running::new(h.fence(), Held::handle(), Some(log.clone()), Counter::ONE, h.callback_token.digest());
    assert_eq!(exec(&store, Command::Running(h.path.clone(), running)).await, Ok(ack(Outcome::Running)));
    let header = LogChunkHeader::new(h.fence(), LogChunkSchema, log, 0, 5);
    let admitted = Reply::ChunkAdmitted(ChunkAdmitted { project: project(), plan: ChunkPlan::Append, acked: 0 });
    assert_eq!(exec(&store, Command::AdmitLogChunk(h.path.clone(), header.clone())).await, Ok(admitted));
    let appended = Reply::LogAppended(LogAppendReply { result: Outcome::Appended, acked: 5 });
    assert_eq!(exec(&store, Command::AppendLog(h.path.clone(), header, Digest::of(b"hello"))).await, Ok(appended));
    assert!(matches!(exec(&store, h.complete(Some(0))).await, Ok(Reply::Completed(_))));
    let policy =
        DeliveryPolicy { claim_ms: 60_000, max_attempts: 3, backoff_ms: 1_000, backoff_max_ms: 1_000, batch: 16 };
    assert!(matches!(exec(&store, Command::ClaimDeliveries(policy)).await, Ok(Reply::Deliveries(d)) if d.len() == 1));
    assert!(exec(&store, Command::DeliveryDone(h.run().clone(), 1, Ok(()), policy)).await.is_ok());
    b.advance(1_000);
    let cancelled = submit(&store, LONG_TIMEOUT_MS, 0).await;
    cancel(&store, &cancelled).await;
    // Ended, its webhook not told yet (nothing claims it here).
    let Ok(Reply::Submitted(untold)) = exec(&store, Command::Submit(submit_told("http://127.0.0.1:9/b"))).await else {
        panic!("submit")
    };
    cancel(&store, &untold).await;
    let queued = submit(&store, LONG_TIMEOUT_MS, 0).await;
    b.advance(10_000);
    let recent = submit(&store, LONG_TIMEOUT_MS, 0).await;
    cancel(&store, &recent).await;
    b.advance(1_000);

    let retention = |batch| RunRetention { max_age_ms: 5_000, batch };
    let prunable = |batch| {
        let store = &store;
        async move { store.prunable_runs(retention(batch)).await.unwrap().into_iter().map(|(_, r)| r).collect::<Vec<_>>() }
    };
    assert_eq!(prunable(10).await, [h.run().clone(), cancelled.clone()], "the oldest first, none waiting to be told");
    assert_eq!(prunable(1).await, [h.run().clone()], "a batch at a time");

    let before = store.snapshot().await.unwrap();
    let mut expected = before.clone();
    let gone = h.run();
    expected.runs.retain(|r| r.id != *gone);
    expected.attempts.retain(|a| a.run != *gone);
    expected.offers.retain(|o| o.run != *gone);
    expected.leases.retain(|l| l.run != *gone);
    expected.events.retain(|e| e.run != *gone);
    expected.log_chunks.retain(|c| c.attempt != *h.attempt());
    expected.deliveries.retain(|d| d.run != *gone);
    assert!(before.log_chunks.len() > expected.log_chunks.len() && before.deliveries.len() > expected.deliveries.len());
    assert!(before.events.len() > expected.events.len() && before.leases.len() > expected.leases.len());
    assert_eq!(store.prune_runs(vec![gone.clone()], retention(10)).await.unwrap(), 1);
    assert_eq!(store.snapshot().await.unwrap(), expected, "its rows alone went");
    assert!(store.run_detail(gone).await.unwrap().is_none());

    let kept = vec![queued, untold, recent, gone.clone()];
    assert_eq!(store.prune_runs(kept, retention(10)).await.unwrap(), 0, "none of these may go");
    assert_eq!(store.snapshot().await.unwrap(), expected, "and nothing changed");
    assert_eq!(prunable(10).await, std::slice::from_ref(&cancelled));
    assert_eq!(store.prune_runs(vec![cancelled.clone()], retention(10)).await.unwrap(), 1);
    assert_eq!(prunable(10).await, Vec::<RunId>::new());
    assert_eq!(store.prune_runs(vec![cancelled], retention(10)).await.unwrap(), 0, "a second pass removes nothing");
}
