//! The scenarios of the store contract, each an `async fn` over any [`Backend`].
//!
//! Every scenario ends by checking the invariants on the final state, and every refusal
//! is checked against a snapshot taken before it: a refused command changes no row and
//! appends no event.

use std::collections::BTreeMap;
use std::time::Duration;

use ql_control::core::{
    Access, CancelOutcome, Command, Reply, EXECUTION_CANCELLED, EXECUTION_FAILED, EXECUTION_TIMED_OUT,
    EXECUTOR_START_FAILED, LEASE_LOST, OFFER_EXPIRED, WORKER_LOST,
};
use ql_control::model::{
    AttemptStatus, AuditRecord, EndKind, LeaseState, OfferState, RunStatus, SessionState, REMOTE_WORKER,
};
use ql_control::store::{Audit, AuditRetention, SessionRetention, Store};
use ql_wire::ack::Running;
use ql_wire::artifact::{ArtifactHeader, ArtifactSchema, Receipt};
use ql_wire::capability::{Digest, Token};
use ql_wire::completion::TerminalStatus;
use ql_wire::ids::{ArtifactId, AttemptId, Counter, OfferId, RunId, SessionId};
use ql_wire::lease::StopIntent;
use ql_wire::route::AttemptPath;
use ql_wire::session::SessionStatus;
use ql_wire::time::Timestamp;
use ql_wire::{ErrorCode, Outcome};

use super::*;

// ------------------------------------------------------------------------ happy path

/// submit -> open -> poll -> claim -> starting -> running -> renew -> completion, with
/// every replay the protocol defines along the way.
pub async fn the_whole_protocol_with_replays<B: Backend>(b: B) {
    let store = b.store();
    let timings = b.timings();
    let run = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let agent = open(&store, "router-1").await;
    assert_eq!(agent.generation, Counter::ONE);

    // Placement turns the queued run into an attempt and an offer; the run dispatches.
    let offers = poll(&store, &agent).await;
    assert_eq!(offers.len(), 1);
    let offer = offers[0].clone();
    assert_eq!(offer.run_id, run);
    let d = detail(&store, &run).await;
    assert_eq!(d.run.status, RunStatus::Dispatching);
    assert_eq!(d.run.current_attempt.as_ref(), Some(&offer.attempt_id));
    assert_eq!(d.attempts.len(), 1);
    assert_eq!((d.attempts[0].status, d.attempts[0].number), (AttemptStatus::Offered, 1));
    assert_eq!(d.attempts[0].executor_type, REMOTE_WORKER);
    // Polling again lists the same open offer and places nothing new.
    assert_eq!(poll(&store, &agent).await, vec![offer.clone()]);

    // Claim, its exact replay, and anyone else's claim.
    let mut h = claim(&store, &agent, &offer).await;
    assert_eq!(h.claimed.lease_generation, Counter::ONE);
    assert_eq!(h.claimed.lease_version, Counter::ONE);
    assert_eq!(h.claimed.lease_ttl_ms, timings.lease_ttl_ms);
    assert_eq!(h.claimed.spec, spec(LONG_TIMEOUT_MS));
    let same = Reply::Claimed(Box::new(h.claimed.clone()));
    replayed(&store, claim_cmd(&agent, &offer, &h.lease_token), same, "exact claim replay").await;
    let stranger = Token::generate().unwrap();
    refused(&store, claim_cmd(&agent, &offer, &stranger), ErrorCode::OfferConflict, "claim with another token").await;

    // starting, and its replay.
    to_starting(&store, &h).await;
    replayed(&store, h.starting(), ack(Outcome::AlreadyStarting), "starting replay").await;

    // running, its replay, a late starting, and a running that differs.
    assert_eq!(exec(&store, h.running()).await, Ok(ack(Outcome::Running)));
    replayed(&store, h.running(), ack(Outcome::AlreadyRunning), "running replay").await;
    replayed(&store, h.starting(), ack(Outcome::AlreadyRunning), "late starting").await;
    let other_handle =
        Running::new(h.fence(), "pid:1 start:1".parse().unwrap(), None, Counter::ONE, h.callback_token.digest());
    refused(
        &store,
        Command::Running(h.path.clone(), other_handle),
        ErrorCode::ReplayMismatch,
        "running with another handle",
    )
    .await;
    let d = detail(&store, &run).await;
    assert_eq!(d.run.status, RunStatus::Running);
    assert_eq!(d.attempts[0].status, AttemptStatus::Running);
    assert_eq!(d.run.started_at, d.attempts[0].started_at);
    assert_eq!(d.leases[0].facts.version, Counter::ONE, "running does not advance the lease");

    // Renewal is the only step that advances a live lease.
    let before = detail(&store, &run).await.leases[0].clone();
    let renewed = renew(&store, &mut h).await;
    assert_eq!((renewed.lease_version.get(), renewed.stop), (2, None));
    let after = detail(&store, &run).await.leases[0].clone();
    assert_eq!(after.facts.version.get(), 2);
    assert!(after.facts.expires_at >= before.facts.expires_at);
    assert_eq!(renewed.lease_expires_at.millis(), after.facts.expires_at);
    assert_eq!(renew(&store, &mut h).await.lease_version.get(), 3);

    // Completion, its exact replay, and a replay that changed its story.
    let done = completed(Outcome::Completed, TerminalStatus::Succeeded);
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(done));
    let again = completed(Outcome::AlreadyCompleted, TerminalStatus::Succeeded);
    replayed(&store, h.complete(Some(0)), again, "exact completion replay").await;
    refused(&store, h.complete(Some(1)), ErrorCode::ReplayMismatch, "completion replay with another exit code").await;
    refused(&store, h.renew(), ErrorCode::LeaseConflict, "renewal after completion").await;

    let d = detail(&store, &run).await;
    assert_eq!(d.run.status, RunStatus::Succeeded);
    assert_eq!(d.run.error_code, None);
    assert!(d.run.finished_at >= d.run.started_at);
    let a = &d.attempts[0];
    assert_eq!(
        (a.status, a.end, a.exit_code, a.signal),
        (AttemptStatus::Succeeded, Some(EndKind::Completion), Some(0), None)
    );
    assert_eq!(a.callback_sequence, Some(Counter::ONE));
    assert_eq!(a.callback_digest.as_ref(), Some(&h.callback_token.digest()));
    assert_eq!(a.worker_finished_at, Some(h.finished_at.millis()));
    assert_eq!(a.executor_handle, Some(Held::handle()));
    let l = &d.leases[0];
    assert_eq!((l.state, l.facts.version.get()), (LeaseState::Completed, 4));
    assert_eq!(l.facts.token_digest, h.lease_token.digest());
    assert_eq!(
        kinds(&d),
        [
            "run.queued",
            "attempt.offered",
            "run.dispatching",
            "attempt.claimed",
            "attempt.starting",
            "attempt.running",
            "run.running",
            "attempt.completed",
            "run.succeeded",
        ]
    );
    let offer_row = store.snapshot().await.unwrap().offers.into_iter().find(|o| o.id == offer.offer_id).unwrap();
    assert_eq!(offer_row.state, OfferState::Claimed);
    check_invariants(&store.snapshot().await.unwrap());
}

/// A worker that crashed before its `running` ACK completes from `starting`, and the
/// callback digest is registered by the completion itself.
pub async fn completion_from_starting_registers_the_callback<B: Backend>(b: B) {
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_starting(&store, &h).await;
    assert_eq!(exec(&store, h.complete(Some(2))).await, Ok(completed(Outcome::Completed, TerminalStatus::Failed)));
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::Failed, Some(EXECUTION_FAILED)));
    assert_eq!(d.attempts[0].callback_digest.as_ref(), Some(&h.callback_token.digest()));
    assert_eq!(d.run.started_at, None, "it never reported running");
    let again = completed(Outcome::AlreadyCompleted, TerminalStatus::Failed);
    replayed(&store, h.complete(Some(2)), again, "replay of a completion from starting").await;
    check_invariants(&store.snapshot().await.unwrap());
}

/// An artifact is admitted only under a live fence, and a completion must present
/// exactly the receipt the artifact store holds.
pub async fn artifacts_are_admitted_and_completions_match_their_receipt<B: Backend>(b: B) {
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    let log = ArtifactId::parse("log").unwrap();
    let header = |h: &Held| ArtifactHeader::new(h.fence(), ArtifactSchema, 5, false);
    let admit = |h: &Held| Command::AdmitArtifact(h.path.clone(), log.clone(), header(h));
    refused(&store, admit(&h), ErrorCode::StateConflict, "artifact before starting").await;
    to_starting(&store, &h).await;
    assert_eq!(exec(&store, admit(&h)).await, Ok(Reply::ArtifactAdmitted(project())));

    let receipt = Receipt { artifact_id: log.clone(), length: 5, sha256: Digest::of(b"hello"), truncated: false };
    let body = h.completion_body(h.fence(), Some(0), Some(receipt.clone()));
    let other = Receipt { sha256: Digest::of(b"other"), ..receipt.clone() };
    let mismatched = Command::Complete(h.path.clone(), body.clone(), Some(other));
    refused(&store, mismatched, ErrorCode::ArtifactConflict, "store holds other content").await;
    let missing = Command::Complete(h.path.clone(), body.clone(), None);
    refused(&store, missing, ErrorCode::ArtifactConflict, "store holds nothing").await;
    let ok = Command::Complete(h.path.clone(), body.clone(), Some(receipt.clone()));
    assert_eq!(exec(&store, ok.clone()).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));
    assert_eq!(detail(&store, h.run()).await.attempts[0].artifact, Some(receipt));
    replayed(&store, ok, completed(Outcome::AlreadyCompleted, TerminalStatus::Succeeded), "replay with receipt").await;
    refused(&store, admit(&h), ErrorCode::AlreadyTerminal, "artifact after completion").await;
    check_invariants(&store.snapshot().await.unwrap());
}

// ------------------------------------------------------------------------- live log

/// `log:append` and the seal (PROTOCOL §13): only while running, at exactly the
/// acknowledged offset; repeats are compared, gaps and overlaps answered with the
/// acknowledged length, the log limit and the seal hold, and every refusal changes
/// nothing.
pub async fn the_live_log_appends_at_the_acknowledged_offset_then_seals<B: Backend>(b: B) {
    use ql_control::core::{ChunkAdmitted, ChunkPlan};
    use ql_wire::log::{LogAppendReply, LogChunkHeader, LogChunkSchema, Seal};

    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    let log = ArtifactId::parse("log").unwrap();
    let header = |h: &Held, offset, len| LogChunkHeader::new(h.fence(), LogChunkSchema, log.clone(), offset, len);
    let admit = |h: &Held, offset, len| Command::AdmitLogChunk(h.path.clone(), header(h, offset, len));
    let append = |h: &Held, offset, len, bytes: &[u8]| {
        Command::AppendLog(h.path.clone(), header(h, offset, len), Digest::of(bytes))
    };
    let admitted = |plan, acked| Reply::ChunkAdmitted(ChunkAdmitted { project: project(), plan, acked });

    refused(&store, admit(&h, 0, 5), ErrorCode::StateConflict, "a chunk before starting").await;
    to_starting(&store, &h).await;
    refused(&store, admit(&h, 0, 5), ErrorCode::StateConflict, "a chunk before running").await;
    let running = Running::new(h.fence(), Held::handle(), Some(log.clone()), Counter::ONE, h.callback_token.digest());
    assert_eq!(exec(&store, Command::Running(h.path.clone(), running)).await, Ok(ack(Outcome::Running)));

    replayed(&store, admit(&h, 0, 5), admitted(ChunkPlan::Append, 0), "admission writes nothing").await;
    let first = Reply::LogAppended(LogAppendReply { result: Outcome::Appended, acked: 5 });
    assert_eq!(exec(&store, append(&h, 0, 5, b"hello")).await, Ok(first));
    let second = Reply::LogAppended(LogAppendReply { result: Outcome::Appended, acked: 11 });
    assert_eq!(exec(&store, append(&h, 5, 6, b" world")).await, Ok(second));
    let chunks = store.log_chunks(h.attempt(), ql_control::store::ALL_CHUNKS).await.unwrap();
    assert_eq!(chunks.iter().map(|c| (c.offset, c.length)).collect::<Vec<_>>(), [(0, 5), (5, 6)]);
    assert_eq!(chunks[1].sha256, Digest::of(b" world"));
    // A window's chunks: those that hold any of its bytes, and no other.
    for (within, expected) in [
        (0..5, vec![(0, 5)]),
        (4..5, vec![(0, 5)]),
        (4..6, vec![(0, 5), (5, 6)]),
        (5..6, vec![(5, 6)]),
        (10..1_000, vec![(5, 6)]),
        (11..1_000, vec![]),
        (3..3, vec![]),
        (u64::MAX - 1..u64::MAX, vec![]),
    ] {
        let chunks = store.log_chunks(h.attempt(), within.clone()).await.unwrap();
        assert_eq!(chunks.iter().map(|c| (c.offset, c.length)).collect::<Vec<_>>(), expected, "{within:?}");
    }
    assert_eq!(detail(&store, h.run()).await.attempts[0].log_acked, 11);

    // A repeat lies within what is acknowledged: its bytes are compared by the caller.
    replayed(&store, admit(&h, 0, 5), admitted(ChunkPlan::Replay, 11), "a repeated chunk").await;
    replayed(&store, admit(&h, 3, 8), admitted(ChunkPlan::Replay, 11), "a repeat across chunks").await;
    // Everything else that is not the acknowledged offset: the length, and no change.
    for (offset, len, what) in [(12, 1, "a gap"), (9, 5, "an overlap past the end"), (0, 12, "a longer repeat")] {
        replayed(&store, admit(&h, offset, len), Reply::LogOffsetConflict(11), what).await;
    }
    // A chunk that was admitted, but the log moved on before it was appended.
    replayed(&store, append(&h, 5, 6, b" world"), Reply::LogOffsetConflict(11), "append behind the log").await;

    // Fence, artifact and limit refusals.
    let stale = Command::AdmitLogChunk(
        h.path.clone(),
        LogChunkHeader::new(h.fence_at(Counter::new(9).unwrap()), LogChunkSchema, log.clone(), 11, 1),
    );
    refused(&store, stale, ErrorCode::LeaseConflict, "a chunk at a stale lease version").await;
    let other = Command::AdmitLogChunk(
        h.path.clone(),
        LogChunkHeader::new(h.fence(), LogChunkSchema, ArtifactId::parse("other").unwrap(), 11, 1),
    );
    refused(&store, other, ErrorCode::ArtifactConflict, "a chunk of an undeclared artifact").await;
    let limit = spec(LONG_TIMEOUT_MS).log_limit_bytes;
    refused(&store, admit(&h, 11, limit - 10), ErrorCode::PayloadTooLarge, "a chunk past the log limit").await;
    refused(&store, append(&h, 11, limit - 10, b"x"), ErrorCode::PayloadTooLarge, "an append past the limit").await;

    // The one-frame upload has a quota too: the declared artifact, within the log limit.
    let frame = |len| ArtifactHeader::new(h.fence(), ArtifactSchema, len, false);
    let put = |id: &ArtifactId, len| Command::AdmitArtifact(h.path.clone(), id.clone(), frame(len));
    let other_id = ArtifactId::parse("other").unwrap();
    refused(&store, put(&other_id, 5), ErrorCode::ArtifactConflict, "an undeclared artifact").await;
    refused(&store, put(&log, limit + 1), ErrorCode::PayloadTooLarge, "an artifact past the log limit").await;
    replayed(&store, put(&log, limit), Reply::ArtifactAdmitted(project()), "the declared artifact").await;
    // Confirming claims the content's receipt for the attempt: the database, not the
    // artifact store, decides which content the artifact is.
    let made = |content: &[u8]| Receipt {
        artifact_id: log.clone(),
        length: content.len() as u64,
        sha256: Digest::of(content),
        truncated: false,
    };
    let confirm_of = |content: &[u8]| {
        Command::ConfirmArtifact(h.path.clone(), log.clone(), frame(content.len() as u64), made(content))
    };
    let confirm = confirm_of(b"hello");
    assert_eq!(exec(&store, confirm.clone()).await, Ok(Reply::ArtifactAdmitted(project())));
    assert_eq!(detail(&store, h.run()).await.attempts[0].claimed_artifact, Some(made(b"hello")));
    replayed(&store, confirm.clone(), Reply::ArtifactAdmitted(project()), "the same content again").await;
    refused(&store, confirm_of(b"world"), ErrorCode::ArtifactConflict, "other content for the artifact").await;
    let mismatched = Command::ConfirmArtifact(h.path.clone(), log.clone(), frame(6), made(b"hello"));
    refused(&store, mismatched, ErrorCode::InvalidRequest, "a receipt of another length than its header").await;

    // The seal: exactly the acknowledged length, once; no chunk after it.
    let seal = |len| Command::SealLog(h.path.clone(), log.clone(), Seal::new(h.fence(), len, false));
    replayed(&store, seal(10), Reply::LogOffsetConflict(11), "a seal short of the log").await;
    replayed(&store, seal(12), Reply::LogOffsetConflict(11), "a seal past the log").await;
    let other_seal =
        Command::SealLog(h.path.clone(), ArtifactId::parse("other").unwrap(), Seal::new(h.fence(), 11, false));
    refused(&store, other_seal, ErrorCode::ArtifactConflict, "a seal of an undeclared artifact").await;
    assert_eq!(exec(&store, seal(11)).await, Ok(Reply::SealAdmitted(project())));
    assert!(detail(&store, h.run()).await.attempts[0].log_sealed);
    replayed(&store, seal(11), Reply::SealAdmitted(project()), "a repeated seal").await;
    refused(&store, admit(&h, 11, 1), ErrorCode::StateConflict, "a chunk after the seal").await;
    refused(&store, append(&h, 11, 1, b"!"), ErrorCode::StateConflict, "an append after the seal").await;

    let receipt =
        Receipt { artifact_id: log.clone(), length: 11, sha256: Digest::of(b"hello world"), truncated: false };
    let body = h.completion_body(h.fence(), Some(0), Some(receipt.clone()));
    let done = Command::Complete(h.path.clone(), body, Some(receipt));
    assert_eq!(exec(&store, done).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));
    refused(&store, admit(&h, 11, 1), ErrorCode::AlreadyTerminal, "a chunk after completion").await;
    refused(&store, seal(11), ErrorCode::AlreadyTerminal, "a seal after completion").await;
    refused(&store, confirm, ErrorCode::AlreadyTerminal, "an upload that outlived its run").await;
    check_invariants(&store.snapshot().await.unwrap());
}

// --------------------------------------------------------------------- start failure

/// start-failure ends attempt and run, and its replay at the original expected version
/// (the lease now at expected + 1) answers the same without a second event.
pub async fn start_failure_and_its_replay<B: Backend>(b: B) {
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    refused(&store, h.start_failure(), ErrorCode::StateConflict, "start-failure before starting").await;
    to_starting(&store, &h).await;
    assert_eq!(exec(&store, h.start_failure()).await, Ok(ack(Outcome::Failed)));

    let d = detail(&store, h.run()).await;
    assert_eq!(d.run.status, RunStatus::Failed);
    assert_eq!(d.run.error_code.as_deref(), Some(EXECUTOR_START_FAILED));
    assert_eq!(d.run.summary.as_deref(), Some("spawn failed: no such file or directory"));
    let a = &d.attempts[0];
    assert_eq!((a.status, a.end), (AttemptStatus::Failed, Some(EndKind::StartFailure)));
    assert_eq!(a.callback_sequence, Some(Counter::ONE), "the callback sequence advanced past any receipt");
    assert_eq!((d.leases[0].state, d.leases[0].facts.version.get()), (LeaseState::Completed, 2));
    assert_eq!(kinds(&d).iter().filter(|k| **k == "attempt.failed" || **k == "run.failed").count(), 2);

    replayed(&store, h.start_failure(), ack(Outcome::Failed), "start-failure replay at expected + 1").await;
    let mut stranger = h.clone();
    stranger.lease_token = Token::generate().unwrap();
    refused(&store, stranger.start_failure(), ErrorCode::LeaseConflict, "start-failure replay, other token").await;
    let mut later = h.clone();
    later.version = Counter::new(2).unwrap();
    refused(&store, later.start_failure(), ErrorCode::AlreadyTerminal, "start-failure replay at the new version").await;
    // A late completion after a start failure is refused at either version.
    refused(&store, h.complete(Some(0)), ErrorCode::AlreadyTerminal, "late completion").await;
    refused(&store, later.complete(Some(0)), ErrorCode::AlreadyTerminal, "late completion, new version").await;
    refused(&store, h.starting(), ErrorCode::AlreadyTerminal, "late starting").await;
    refused(&store, h.renew(), ErrorCode::LeaseConflict, "renewal after start-failure").await;
    check_invariants(&store.snapshot().await.unwrap());
}

// ---------------------------------------------------------------------- stop intents

/// Timeout over cancel over the exit code, for completions and start failures alike.
pub async fn stop_intents_decide_the_terminal_status<B: Backend>(b: B) {
    let store = b.store();

    // Cancel while running: delivered on renewal, and the exit code no longer decides.
    let mut h = claimed_run(&store, "router-a", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    assert_eq!(cancel(&store, h.run()).await, CancelOutcome::StopRequested);
    assert_eq!(renew(&store, &mut h).await.stop, Some(StopIntent::Cancel));
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::Cancelled)));
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::Cancelled, Some(EXECUTION_CANCELLED)));
    assert!(kinds(&d).contains(&"run.cancel_requested"));
    assert_eq!(cancel(&store, h.run()).await, CancelOutcome::AlreadyEnded(RunStatus::Cancelled));

    // Timeout outranks cancel: the deadline passes after the cancel.
    let mut h = claimed_run(&store, "router-b", SHORT_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    assert_eq!(renew(&store, &mut h).await.stop, None);
    assert_eq!(cancel(&store, h.run()).await, CancelOutcome::StopRequested);
    b.advance(SHORT_TIMEOUT_MS as i64 + 1_000);
    assert_eq!(renew(&store, &mut h).await.stop, Some(StopIntent::Timeout), "the deadline passed: timeout wins");
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::TimedOut)));
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::TimedOut, Some(EXECUTION_TIMED_OUT)));

    // No stop intent: the exit code decides.
    let h = claimed_run(&store, "router-c", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    assert_eq!(exec(&store, h.complete(Some(3))).await, Ok(completed(Outcome::Completed, TerminalStatus::Failed)));
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.error_code.as_deref(), d.attempts[0].exit_code), (Some(EXECUTION_FAILED), Some(3)));

    // A start failure under a cancel is a cancellation.
    let h = claimed_run(&store, "router-d", LONG_TIMEOUT_MS, 0).await;
    to_starting(&store, &h).await;
    assert_eq!(cancel(&store, h.run()).await, CancelOutcome::StopRequested);
    assert_eq!(exec(&store, h.start_failure()).await, Ok(ack(Outcome::Cancelled)));
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::Cancelled, Some(EXECUTION_CANCELLED)));
    replayed(&store, h.start_failure(), ack(Outcome::Cancelled), "cancelled start-failure replay").await;

    // A start failure past the deadline is a timeout, even under a cancel.
    let h = claimed_run(&store, "router-e", SHORT_TIMEOUT_MS, 0).await;
    to_starting(&store, &h).await;
    assert_eq!(cancel(&store, h.run()).await, CancelOutcome::StopRequested);
    b.advance(SHORT_TIMEOUT_MS as i64 + 1_000);
    assert_eq!(exec(&store, h.start_failure()).await, Ok(ack(Outcome::TimedOut)));
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::TimedOut, Some(EXECUTION_TIMED_OUT)));

    check_invariants(&store.snapshot().await.unwrap());
}

/// Cancelling before a claim ends the run at once; a withdrawn offer cannot be claimed.
pub async fn cancel_before_a_claim_ends_the_run<B: Backend>(b: B) {
    let store = b.store();
    let queued = submit(&store, LONG_TIMEOUT_MS, 0).await;
    assert_eq!(cancel(&store, &queued).await, CancelOutcome::Cancelled);
    let d = detail(&store, &queued).await;
    assert_eq!((d.run.status, d.attempts.len()), (RunStatus::Cancelled, 0));
    assert_eq!(kinds(&d), ["run.queued", "run.cancelled"]);

    let offered = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let agent = open(&store, "router-1").await;
    let offers = poll(&store, &agent).await;
    assert_eq!(offers.len(), 1);
    assert_eq!(cancel(&store, &offered).await, CancelOutcome::Cancelled);
    let d = detail(&store, &offered).await;
    assert_eq!(d.run.status, RunStatus::Cancelled);
    assert_eq!((d.attempts[0].status, d.attempts[0].end), (AttemptStatus::Cancelled, Some(EndKind::Withdrawn)));
    let offer = store.snapshot().await.unwrap().offers.into_iter().find(|o| o.id == offers[0].offer_id).unwrap();
    assert_eq!(offer.state, OfferState::Withdrawn);
    let token = Token::generate().unwrap();
    refused(&store, claim_cmd(&agent, &offers[0], &token), ErrorCode::OfferConflict, "claim of a withdrawn offer")
        .await;
    assert!(poll(&store, &agent).await.is_empty(), "a withdrawn offer is not listed");
    replayed(
        &store,
        Command::Cancel(offered.clone()),
        Reply::Cancelled(CancelOutcome::AlreadyEnded(RunStatus::Cancelled)),
        "cancel twice",
    )
    .await;
    refused(&store, Command::Cancel(RunId::parse("run_missing").unwrap()), ErrorCode::NotFound, "cancel unknown").await;
    check_invariants(&store.snapshot().await.unwrap());
}

// --------------------------------------------------------------------------- drift

fn with_path(h: &Held, f: impl FnOnce(&mut AttemptPath)) -> Held {
    let mut h = h.clone();
    f(&mut h.path);
    h
}

fn with_fence(h: &Held, f: impl FnOnce(&mut Held)) -> Held {
    let mut h = h.clone();
    f(&mut h);
    h
}

/// Every way a fenced request can speak for the wrong lease is refused with its exact
/// code, and nothing changes.
pub async fn every_drift_is_refused_and_changes_nothing<B: Backend>(b: B) {
    let store = b.store();
    let timings = b.timings();
    let mut h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    renew(&store, &mut h).await;
    assert_eq!(h.version.get(), 2);

    // A second attempt, left claimed, for the wrong-state cases and a foreign run id.
    let c = claimed_run(&store, "router-2", LONG_TIMEOUT_MS, 0).await;

    let two = Counter::new(2).unwrap();
    let cases: Vec<(&str, Command, ErrorCode)> = vec![
        (
            "unknown session",
            with_path(&h, |p| p.session = SessionId::parse("ses_nope").unwrap()).renew(),
            ErrorCode::NotFound,
        ),
        ("other worker", with_path(&h, |p| p.worker = worker("router-2")).renew(), ErrorCode::NotFound),
        (
            "unknown attempt",
            with_path(&h, |p| p.attempt = AttemptId::parse("att_nope").unwrap()).renew(),
            ErrorCode::NotFound,
        ),
        ("other run", with_path(&h, |p| p.run = c.path.run.clone()).renew(), ErrorCode::NotFound),
        (
            "other session of the worker",
            with_path(&h, |p| p.session = c.path.session.clone()).renew(),
            ErrorCode::NotFound,
        ),
        ("other session generation", with_fence(&h, |h| h.agent.generation = two).renew(), ErrorCode::SessionConflict),
        (
            "other offer",
            with_fence(&h, |h| h.offer = OfferId::parse("off_nope").unwrap()).renew(),
            ErrorCode::LeaseConflict,
        ),
        ("other offer, real", with_fence(&h, |h| h.offer = c.offer.clone()).renew(), ErrorCode::LeaseConflict),
        (
            "other lease generation",
            with_fence(&h, |h| h.claimed.lease_generation = two).renew(),
            ErrorCode::LeaseConflict,
        ),
        (
            "other token",
            with_fence(&h, |h| h.lease_token = Token::generate().unwrap()).renew(),
            ErrorCode::LeaseConflict,
        ),
        (
            "other attempt's token",
            with_fence(&h, |h| h.lease_token = c.lease_token.clone()).renew(),
            ErrorCode::LeaseConflict,
        ),
        ("stale version, renew", with_fence(&h, |h| h.version = Counter::ONE).renew(), ErrorCode::LeaseConflict),
        ("stale version, running", with_fence(&h, |h| h.version = Counter::ONE).running(), ErrorCode::LeaseConflict),
        (
            "future version, renew",
            with_fence(&h, |h| h.version = Counter::new(3).unwrap()).renew(),
            ErrorCode::LeaseConflict,
        ),
        ("start-failure while running", h.start_failure(), ErrorCode::StateConflict),
        (
            "completion, other callback token",
            with_fence(&h, |h| h.callback_token = Token::generate().unwrap()).complete(Some(0)),
            ErrorCode::LeaseConflict,
        ),
        (
            "completion, other callback sequence",
            Command::Complete(
                h.path.clone(),
                {
                    let mut body = h.completion_body(h.fence(), Some(0), None);
                    body.callback_sequence = two;
                    body
                },
                None,
            ),
            ErrorCode::LeaseConflict,
        ),
        (
            "completion, finished an hour in the future",
            with_fence(&h, |h| h.finished_at = h.finished_at.plus_millis(3_600_000)).complete(Some(0)),
            ErrorCode::InvalidRequest,
        ),
        ("running before starting", c.running(), ErrorCode::StateConflict),
        ("start-failure before starting", c.start_failure(), ErrorCode::StateConflict),
        ("completion before starting", c.complete(Some(0)), ErrorCode::StateConflict),
        (
            "artifact before starting",
            Command::AdmitArtifact(
                c.path.clone(),
                ArtifactId::parse("log").unwrap(),
                ArtifactHeader::new(c.fence(), ArtifactSchema, 1, false),
            ),
            ErrorCode::StateConflict,
        ),
        (
            "heartbeat, other generation",
            Command::Heartbeat(
                h.agent.worker.clone(),
                h.agent.session.clone(),
                ql_wire::session::Heartbeat { generation: two, draining: false },
            ),
            ErrorCode::SessionConflict,
        ),
        (
            "claim of a claimed offer by its own session with another token",
            claim_cmd(
                &c.agent,
                &ql_wire::offer::Offer {
                    offer_id: c.offer.clone(),
                    run_id: c.path.run.clone(),
                    attempt_id: c.path.attempt.clone(),
                    expires_at: Timestamp::from_millis(0).unwrap(),
                },
                &Token::generate().unwrap(),
            ),
            ErrorCode::OfferConflict,
        ),
    ];
    for (what, cmd, code) in cases {
        refused(&store, cmd, code, what).await;
    }

    // An executor type this protocol does not serve, set behind the store's back.
    b.set_executor_type(h.attempt(), "local_process").await;
    refused(&store, h.renew(), ErrorCode::StateConflict, "executor type local_process, renew").await;
    refused(&store, h.complete(Some(0)), ErrorCode::StateConflict, "executor type local_process, completion").await;
    b.set_executor_type(h.attempt(), REMOTE_WORKER).await;

    // A lease lapsed by DB time (not yet swept) refuses the live commands...
    b.advance(timings.lease_ttl_ms as i64 + 1_000);
    refused(&store, h.renew(), ErrorCode::LeaseConflict, "renew on a lapsed lease").await;
    refused(&store, h.starting(), ErrorCode::LeaseConflict, "starting on a lapsed lease").await;
    refused(&store, h.running(), ErrorCode::LeaseConflict, "running replay on a lapsed lease").await;
    let admit = Command::AdmitArtifact(
        h.path.clone(),
        ArtifactId::parse("log").unwrap(),
        ArtifactHeader::new(h.fence(), ArtifactSchema, 1, false),
    );
    refused(&store, admit, ErrorCode::LeaseConflict, "artifact on a lapsed lease").await;
    // ...but a completion from durable evidence still lands until a sweep expires it.
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));
    check_invariants(&store.snapshot().await.unwrap());
}

// -------------------------------------------------------------------------- sessions

/// A new session replaces the old: the old one's heartbeat and live commands conflict,
/// while its attempts may still complete under their leases. Draining takes no new work.
pub async fn a_new_session_replaces_the_old_one<B: Backend>(b: B) {
    let store = b.store();
    let timings = b.timings();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    assert_eq!(
        heartbeat(&store, &h.agent, false).await,
        Ok(ql_wire::session::HeartbeatReply { status: SessionStatus::Online })
    );

    // While the session speaks, a second agent with the same identity (a twin) is refused,
    // and nothing changes.
    let twin = Command::OpenSession(worker("router-1"), open_body(1, &[]));
    refused(&store, twin, ErrorCode::SessionConflict, "a twin").await;
    // Once it has been quiet for the takeover window, its agent is taken for gone.
    b.advance(TAKEOVER_AFTER_MS as i64);
    let newer = open(&store, "router-1").await;
    assert_eq!(newer.generation.get(), 2);
    let hb = |a: &Agent| {
        Command::Heartbeat(
            a.worker.clone(),
            a.session.clone(),
            ql_wire::session::Heartbeat { generation: a.generation, draining: false },
        )
    };
    refused(&store, hb(&h.agent), ErrorCode::SessionConflict, "heartbeat of the replaced session").await;
    assert_eq!(session_row(&store, &h.agent.session).await.state, SessionState::Replaced);
    refused(&store, h.renew(), ErrorCode::SessionConflict, "renew from the replaced session").await;
    let poll_old = Command::PollOffers(
        h.agent.worker.clone(),
        h.agent.session.clone(),
        ql_wire::offer::PollOffers { generation: h.agent.generation, wait_ms: 0, max: 1 },
    );
    refused(&store, poll_old, ErrorCode::SessionConflict, "poll from the replaced session").await;
    // The lease was not swept: the restarted agent completes from its journal.
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));

    // Draining is one-way and takes no new work.
    let status = |s| Ok(ql_wire::session::HeartbeatReply { status: s });
    assert_eq!(heartbeat(&store, &newer, true).await, status(SessionStatus::Draining));
    submit(&store, LONG_TIMEOUT_MS, 0).await;
    assert!(poll(&store, &newer).await.is_empty(), "a draining session is offered nothing");
    assert_eq!(heartbeat(&store, &newer, false).await, status(SessionStatus::Draining));

    // A session that is not seen within its TTL expires on the next sweep.
    b.advance(timings.session_ttl_ms as i64 + 1_000);
    refused(&store, hb(&newer), ErrorCode::SessionConflict, "heartbeat of a lapsed session").await;
    assert!(sweep(&store).await >= 1);
    assert_eq!(session_row(&store, &newer.session).await.state, SessionState::Expired);
    let third = open(&store, "router-1").await;
    assert_eq!(third.generation.get(), 3);
    let unknown = Agent { session: SessionId::parse("ses_nope").unwrap(), ..third.clone() };
    refused(&store, hb(&unknown), ErrorCode::NotFound, "heartbeat of an unknown session").await;
    let foreign = Agent { worker: worker("router-9"), ..third.clone() };
    refused(&store, hb(&foreign), ErrorCode::NotFound, "heartbeat of another worker's session").await;
    check_invariants(&store.snapshot().await.unwrap());
}

/// Placement honours labels and capacity, oldest run first.
pub async fn placement_honours_labels_and_capacity<B: Backend>(b: B) {
    let store = b.store();
    let mips = BTreeMap::from([("arch".to_owned(), "mips".to_owned())]);
    let picky = submit_with(&store, LONG_TIMEOUT_MS, 0, BTreeMap::new(), mips).await;
    let plain = open_with(&store, "router-1", 2, &[]).await;
    assert!(poll(&store, &plain).await.is_empty(), "a run needing arch=mips is not offered to a session without it");
    let router = open_with(&store, "router-2", 2, &[("arch", "mips"), ("site", "north")]).await;
    let offers = poll(&store, &router).await;
    assert_eq!(offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), vec![&picky]);

    b.advance(1);
    let first = submit(&store, LONG_TIMEOUT_MS, 0).await;
    b.advance(1);
    let second = submit(&store, LONG_TIMEOUT_MS, 0).await;
    b.advance(1);
    let third = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let offers = poll(&store, &plain).await;
    let mut offered: Vec<_> = offers.iter().map(|o| o.run_id.clone()).collect();
    offered.sort();
    let mut oldest = vec![first, second];
    oldest.sort();
    assert_eq!(offered, oldest, "capacity 2 takes the two oldest");
    assert_eq!(poll(&store, &plain).await.len(), 2, "a full session is offered nothing more");
    assert_eq!(detail(&store, &third).await.run.status, RunStatus::Queued);
    check_invariants(&store.snapshot().await.unwrap());
}

/// An agent that exits cleanly closes its session: it ends `closed` at once (a repeat
/// answers `already_closed` and changes nothing), it takes no more requests, and the
/// worker's next agent opens a fresh session without waiting for the takeover window.
pub async fn a_closed_session_ends_and_the_next_opens_at_once<B: Backend>(b: B) {
    let store = b.store();
    let agent = open(&store, "router-1").await;
    let close = || {
        Command::CloseSession(
            agent.worker.clone(),
            agent.session.clone(),
            ql_wire::session::CloseSession { generation: agent.generation },
        )
    };
    let closed = ql_wire::session::SessionClosed { result: Outcome::Closed };
    assert_eq!(exec(&store, close()).await, Ok(Reply::SessionClosed(closed)));
    assert_eq!(session_row(&store, &agent.session).await.state, SessionState::Closed);
    let again = ql_wire::session::SessionClosed { result: Outcome::AlreadyClosed };
    replayed(&store, close(), Reply::SessionClosed(again), "a repeated close").await;
    let hb = Command::Heartbeat(
        agent.worker.clone(),
        agent.session.clone(),
        ql_wire::session::Heartbeat { generation: agent.generation, draining: false },
    );
    refused(&store, hb, ErrorCode::SessionConflict, "a heartbeat of a closed session").await;
    assert_eq!(sweep(&store).await, 0, "nothing left to expire");
    let next = open(&store, "router-1").await;
    assert_eq!(next.generation.get(), agent.generation.get() + 1);
    check_invariants(&store.snapshot().await.unwrap());
}

/// A run's `labels` are matched only by what the operator set of the worker: an agent
/// declaring them is not offered the run, the labelled worker is, whatever it declares;
/// a refused labelling changes nothing, and a label taken away stops the placement.
pub async fn trusted_labels_come_from_the_operator_not_the_agent<B: Backend>(b: B) {
    let store = b.store();
    let prod = || BTreeMap::from([("site".to_owned(), "cluster-prod".to_owned())]);
    let label = |w: &str, labels: BTreeMap<String, String>| Command::LabelWorker(worker(w), labels);
    let meant = submit_with(&store, LONG_TIMEOUT_MS, 0, prod(), BTreeMap::new()).await;
    let liar = open_with(&store, "router-1", 2, &[("site", "cluster-prod")]).await;
    let before = store.snapshot().await.unwrap();
    assert!(poll(&store, &liar).await.is_empty(), "a declared label is not trusted");
    let after = store.snapshot().await.unwrap();
    assert_eq!((after.runs, after.offers, after.events), (before.runs, before.offers, before.events));

    let bad = BTreeMap::from([("Site".to_owned(), "x".to_owned())]);
    let before = store.snapshot().await.unwrap();
    refused(&store, label("router-2", bad), ErrorCode::InvalidRequest, "a label no run could ask for").await;
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "refused labelling");

    let Ok(Reply::WorkerLabelled(record)) = exec(&store, label("router-2", prod())).await else { panic!() };
    assert_eq!(record.labels, prod());
    let node = open_with(&store, "router-2", 2, &[]).await;
    let offers = poll(&store, &node).await;
    assert_eq!(offers.iter().map(|o| &o.run_id).collect::<Vec<_>>(), vec![&meant]);
    assert!(poll(&store, &liar).await.is_empty(), "still not the declaring one");

    exec(&store, label("router-2", BTreeMap::new())).await.unwrap();
    let later = submit_with(&store, LONG_TIMEOUT_MS, 0, prod(), BTreeMap::new()).await;
    assert!(poll(&store, &node).await.iter().all(|o| o.run_id != later), "the label was taken away");
    let snapshot = store.snapshot().await.unwrap();
    assert_eq!(snapshot.workers.len(), 1);
    check_invariants(&snapshot);
}

// --------------------------------------------------------------------------- sweeper

/// An offer nobody claimed lapses: the run is queued again without spending a retry,
/// and the next poll makes a fresh attempt.
pub async fn an_expired_offer_requeues_without_spending_retries<B: Backend>(b: B) {
    let store = b.store();
    let timings = b.timings();
    let run = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let agent = open(&store, "router-1").await;
    let first = poll(&store, &agent).await.remove(0);
    assert_eq!(sweep(&store).await, 0, "nothing has lapsed yet");

    b.advance(timings.offer_ttl_ms as i64 + 1_000);
    let token = Token::generate().unwrap();
    refused(&store, claim_cmd(&agent, &first, &token), ErrorCode::OfferConflict, "claim of a lapsed offer").await;
    assert_eq!(sweep(&store).await, 1);
    let d = detail(&store, &run).await;
    assert_eq!((d.run.status, d.run.retries_used, d.run.current_attempt.clone()), (RunStatus::Queued, 0, None));
    let a = &d.attempts[0];
    assert_eq!(
        (a.status, a.end, a.error_code.as_deref()),
        (AttemptStatus::Lost, Some(EndKind::OfferExpired), Some(OFFER_EXPIRED))
    );
    let offer = store.snapshot().await.unwrap().offers.into_iter().find(|o| o.id == first.offer_id).unwrap();
    assert_eq!(offer.state, OfferState::Expired);

    // Sweeping again changes nothing.
    let before = store.snapshot().await.unwrap();
    assert_eq!(sweep(&store).await, 0);
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "second sweep");

    // The next poll makes attempt 2, which runs to success: the budget was not spent.
    let second = poll(&store, &agent).await.remove(0);
    assert_ne!(second.attempt_id, first.attempt_id);
    let h = claim(&store, &agent, &second).await;
    to_running(&store, &h).await;
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));
    let d = detail(&store, &run).await;
    assert_eq!(d.attempts.iter().map(|a| a.number).collect::<Vec<_>>(), [1, 2]);
    check_invariants(&store.snapshot().await.unwrap());
}

/// A job its worker lost through no fault of the job is given up at once: the attempt is
/// lost with `WORKER_LOST`, the run queued again within its budget (then failed with that
/// code), nothing is sent on the given-up lease, and a stale fence changes nothing.
pub async fn an_abandoned_attempt_is_lost_at_once_and_its_run_queued_again<B: Backend>(b: B) {
    let store = b.store();
    let run = submit(&store, LONG_TIMEOUT_MS, 1).await;
    let agent = open(&store, "router-1").await;
    let offer = poll(&store, &agent).await.remove(0);
    let h = claim(&store, &agent, &offer).await;
    to_running(&store, &h).await;
    let abandon = |h: &Held, fence: Fence| {
        Command::Abandon(
            h.path.clone(),
            ql_wire::ack::Abandon::new(fence, ql_wire::text::Reason::parse("gone").unwrap()),
        )
    };
    refused(&store, abandon(&h, h.fence_at(Counter::new(9).unwrap())), ErrorCode::LeaseConflict, "a stale fence").await;
    let reply = exec(&store, abandon(&h, h.fence())).await;
    assert_eq!(reply, Ok(Reply::Ack(ql_wire::ack::AckReply { result: Outcome::Abandoned })));
    let d = detail(&store, &run).await;
    assert_eq!((d.run.status, d.run.retries_used), (RunStatus::Queued, 1));
    assert_eq!((d.attempts[0].status, d.attempts[0].error_code.as_deref()), (AttemptStatus::Lost, Some(WORKER_LOST)));
    assert!(kinds(&d).ends_with(&["attempt.lost", "run.queued"]));
    refused(&store, abandon(&h, h.fence()), ErrorCode::LeaseConflict, "a repeat").await;
    refused(&store, h.complete(Some(0)), ErrorCode::LeaseConflict, "a completion on the given-up lease").await;

    // The second attempt, lost too: the budget is spent.
    let offer = poll(&store, &agent).await.remove(0);
    let h2 = claim(&store, &agent, &offer).await;
    to_running(&store, &h2).await;
    exec(&store, abandon(&h2, h2.fence())).await.unwrap();
    let d = detail(&store, &run).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::Failed, Some(WORKER_LOST)));
    check_invariants(&store.snapshot().await.unwrap());
}

/// When no replica swept for longer than the outage threshold, the next sweep gives the
/// absence back before it sweeps anything: the lease and the session outlive the outage
/// (and get at least a whole TTL from now), the agent's renewal and heartbeat go through,
/// and only a lapse after the authority is back loses the lease. A replica that keeps
/// sweeping (another process on the same database) leaves no absence to give back.
pub async fn an_outage_of_the_authority_gives_its_time_back_to_live_leases<B: Backend>(b: B) {
    let store = b.store();
    let timings = b.timings();
    // A time limit beyond the outage: a deadline is not moved by a grace (the job ran on).
    let run = submit(&store, 3 * OUTAGE_AFTER_MS, 0).await;
    let agent = open(&store, "router-1").await;
    let offer = poll(&store, &agent).await.remove(0);
    let mut h = claim(&store, &agent, &offer).await;
    to_starting(&store, &h).await;
    assert_eq!(sweep(&store).await, 0, "the first sweep records the authority alive");

    // Nobody swept for longer than the threshold and than the lease and session TTLs.
    b.advance(OUTAGE_AFTER_MS as i64 + 1_000);
    let graced = match exec(&store, Command::Sweep).await {
        Ok(Reply::Graced(g)) => g,
        other => panic!("a grace, not {other:?}"),
    };
    assert_eq!((graced.leases, graced.sessions), (1, 1));
    assert!(graced.absent_ms > OUTAGE_AFTER_MS as i64);
    let d = detail(&store, &run).await;
    assert_eq!(d.run.status, RunStatus::Dispatching, "nothing was swept");
    assert_eq!(d.leases[0].state, LeaseState::Leased);
    assert_eq!(d.attempts[0].lease.as_ref().unwrap().expires_at, d.leases[0].facts.expires_at, "the projection");
    assert_eq!(sweep(&store).await, 0, "the next sweep finds nothing lapsed");
    renew(&store, &mut h).await;
    heartbeat(&store, &agent, false).await.expect("the session lived through the outage");
    check_invariants(&store.snapshot().await.unwrap());

    // Another replica sweeping meanwhile: no absence, and a lapse is a lapse.
    let other = b.other_process();
    assert_eq!(sweep(&other).await, 0);
    b.advance(timings.lease_ttl_ms as i64 + 1_000);
    assert_eq!(sweep(&other).await, 1, "the lease lapsed while the authority served");
    assert_eq!(detail(&store, &run).await.run.status, RunStatus::Failed);
    check_invariants(&store.snapshot().await.unwrap());
}

/// An expired lease loses its attempt; the run is re-queued within its retry budget and
/// fails with LEASE_LOST beyond it. Requests on the swept lease are refused.
pub async fn expired_leases_are_lost_then_the_run_fails<B: Backend>(b: B) {
    let store = b.store();
    let timings = b.timings();
    let lapse = timings.lease_ttl_ms as i64 + 1_000;
    let run = submit(&store, LONG_TIMEOUT_MS, 1).await;
    let agent = open(&store, "router-1").await;
    let offer = poll(&store, &agent).await.remove(0);
    let h1 = claim(&store, &agent, &offer).await;
    to_starting(&store, &h1).await;

    b.advance(lapse);
    assert_eq!(sweep(&store).await, 1);
    let d = detail(&store, &run).await;
    assert_eq!((d.run.status, d.run.retries_used, d.run.current_attempt.clone()), (RunStatus::Queued, 1, None));
    assert_eq!(d.run.deadline_at, None, "a re-queued run gets a fresh deadline at its next claim");
    let a = &d.attempts[0];
    assert_eq!(
        (a.status, a.end, a.error_code.as_deref()),
        (AttemptStatus::Lost, Some(EndKind::LeaseLost), Some(LEASE_LOST))
    );
    assert_eq!(d.leases[0].state, LeaseState::Expired);
    assert!(kinds(&d).ends_with(&["attempt.lost", "run.queued"]));

    // A swept lease is gone for good (§11): every request on it is a lease conflict.
    refused(&store, h1.renew(), ErrorCode::LeaseConflict, "renew on a swept lease").await;
    refused(&store, h1.complete(Some(0)), ErrorCode::LeaseConflict, "completion on a swept lease").await;
    refused(&store, h1.start_failure(), ErrorCode::LeaseConflict, "start-failure on a swept lease").await;
    refused(&store, h1.starting(), ErrorCode::LeaseConflict, "starting on a swept lease").await;
    let before = store.snapshot().await.unwrap();
    assert_eq!(sweep(&store).await, 0);
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "second sweep");

    // Attempt 2 under lease generation 2, lost too: the budget is spent, the run fails.
    let offer = poll(&store, &agent).await.remove(0);
    let h2 = claim(&store, &agent, &offer).await;
    assert_eq!(h2.claimed.lease_generation.get(), 2);
    refused(
        &store,
        with_fence(&h2, |h| h.claimed.lease_generation = Counter::ONE).renew(),
        ErrorCode::LeaseConflict,
        "old lease generation",
    )
    .await;
    to_running(&store, &h2).await;
    b.advance(lapse);
    assert_eq!(sweep(&store).await, 1);
    let d = detail(&store, &run).await;
    assert_eq!((d.run.status, d.run.error_code.as_deref()), (RunStatus::Failed, Some(LEASE_LOST)));
    assert!(d.run.finished_at.is_some());
    assert_eq!(d.leases.iter().map(|l| l.state).collect::<Vec<_>>(), [LeaseState::Expired, LeaseState::Expired]);
    let before = store.snapshot().await.unwrap();
    assert_eq!(sweep(&store).await, 0);
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "sweep after failure");
    refused(&store, h2.complete(Some(0)), ErrorCode::LeaseConflict, "completion after the run failed").await;
    check_invariants(&store.snapshot().await.unwrap());
}

/// A run past its deadline gets a timeout stop intent, delivered on renewal, once.
pub async fn an_overdue_run_gets_a_timeout_stop<B: Backend>(b: B) {
    let store = b.store();
    let mut h = claimed_run(&store, "router-1", SHORT_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    assert_eq!(sweep(&store).await, 0);
    b.advance(SHORT_TIMEOUT_MS as i64 + 1_000);
    assert_eq!(sweep(&store).await, 1);
    let d = detail(&store, h.run()).await;
    assert_eq!((d.run.status, d.run.stop), (RunStatus::Running, Some(StopIntent::Timeout)));
    assert!(kinds(&d).contains(&"run.timeout_requested"));
    let before = store.snapshot().await.unwrap();
    assert_eq!(sweep(&store).await, 0);
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "second sweep");
    // A cancel cannot lower a timeout, and changes nothing.
    replayed(
        &store,
        Command::Cancel(h.run().clone()),
        Reply::Cancelled(CancelOutcome::StopRequested),
        "cancel after timeout",
    )
    .await;
    assert_eq!(renew(&store, &mut h).await.stop, Some(StopIntent::Timeout));
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::TimedOut)));
    check_invariants(&store.snapshot().await.unwrap());
}

// ------------------------------------------------------------------- secrets, reads

/// No raw lease or callback token is stored anywhere, and no event payload carries a
/// token digest.
pub async fn no_raw_token_reaches_the_database<B: Backend>(b: B) {
    let store = b.store();
    let mut h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    to_running(&store, &h).await;
    renew(&store, &mut h).await;
    assert_eq!(exec(&store, h.complete(Some(0))).await, Ok(completed(Outcome::Completed, TerminalStatus::Succeeded)));
    let f = claimed_run(&store, "router-2", LONG_TIMEOUT_MS, 0).await;
    to_starting(&store, &f).await;
    assert_eq!(exec(&store, f.start_failure()).await, Ok(ack(Outcome::Failed)));

    let texts = b.all_text().await;
    let digest = h.lease_token.digest();
    assert!(texts.iter().any(|t| t == digest.as_str()), "the scan sees the digest columns");
    for token in [&h.lease_token, &h.callback_token, &f.lease_token, &f.callback_token] {
        let raw = token.expose();
        assert!(!texts.iter().any(|t| t.contains(raw)), "a raw token is stored");
    }
    let digests = [h.lease_token.digest(), h.callback_token.digest(), f.lease_token.digest()];
    for e in store.snapshot().await.unwrap().events {
        let payload = e.payload.to_string();
        assert!(!digests.iter().any(|d| payload.contains(d.as_str())), "event {} carries a token digest", e.kind);
    }
    check_invariants(&store.snapshot().await.unwrap());
}

/// Work submitted here or by another process wakes long-polls.
pub async fn changes_wake_on_new_work_here_and_elsewhere<B: Backend>(b: B) {
    let store = b.store();
    let mut rx = store.changes();
    submit(&store, LONG_TIMEOUT_MS, 0).await;
    assert!(rx.has_changed().unwrap(), "a submit wakes this process's long-polls");
    rx.borrow_and_update();

    let other = b.other_process();
    submit(&other, LONG_TIMEOUT_MS, 0).await;
    tokio::time::timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("a submit by another process wakes this one")
        .unwrap();
    assert_eq!(store.runs(&ql_control::store::RunQuery::latest(10)).await.unwrap().len(), 2);
}

/// A submit's wake-up names its run, so only the polls of sessions that take it look
/// again; a commit by another process wakes every poll.
pub async fn a_submit_wakes_only_the_polls_that_take_its_run<B: Backend>(b: B) {
    use ql_control::core::{Fit, Want};
    let store = b.store();
    let mut rx = store.changes();
    let seen = *rx.borrow_and_update();
    let site = |v: &str| BTreeMap::from([("site".to_owned(), v.to_owned())]);
    submit_with(&store, LONG_TIMEOUT_MS, 0, BTreeMap::new(), site("attic")).await;
    let now = *rx.borrow_and_update();
    assert!(now != seen, "a submit wakes");
    let wants = store.wakes_since(seen, now).expect("a submit's wake-up names its run");
    assert_eq!(wants, vec![Want { labels: BTreeMap::new(), agent_labels: site("attic") }]);
    assert!(Fit { declared: site("attic"), ..Fit::default() }.takes(&wants[0]));
    assert!(!Fit { declared: site("cellar"), ..Fit::default() }.takes(&wants[0]), "another session waits on");
    // An open queues nothing: no wake-up at all.
    open(&store, "router-1").await;
    assert!(!rx.has_changed().unwrap(), "an open wakes nobody");

    let other = b.other_process();
    submit(&other, LONG_TIMEOUT_MS, 0).await;
    tokio::time::timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("a submit by another process wakes this one")
        .unwrap();
    let later = *rx.borrow_and_update();
    assert_eq!(store.wakes_since(now, later), None, "another process's commit: every poll looks again");
}

/// A run a sweep puts back in the queue wakes only the polls of the sessions that take
/// it, as a submit does.
pub async fn a_requeue_wakes_only_the_polls_that_take_its_run<B: Backend>(b: B) {
    use ql_control::core::Want;
    let store = b.store();
    let site = BTreeMap::from([("site".to_owned(), "attic".to_owned())]);
    let run = submit_with(&store, LONG_TIMEOUT_MS, 1, BTreeMap::new(), site.clone()).await;
    let agent = open_with(&store, "router-1", 1, &[("site", "attic")]).await;
    let offer = poll(&store, &agent).await.remove(0);
    let held = claim(&store, &agent, &offer).await;
    to_starting(&store, &held).await;
    let mut rx = store.changes();
    let seen = *rx.borrow_and_update();
    b.advance(b.timings().lease_ttl_ms as i64 + 1_000);
    assert_eq!(sweep(&store).await, 1);
    assert_eq!(detail(&store, &run).await.run.status, RunStatus::Queued);
    let now = *rx.borrow_and_update();
    assert!(now != seen, "a re-queue wakes");
    let wants = store.wakes_since(seen, now);
    assert_eq!(wants, Some(vec![Want { labels: BTreeMap::new(), agent_labels: site }]), "named by its labels");
}

/// The operator reads: newest first, bounded, and absent runs are `None`.
pub async fn operator_reads_are_ordered_and_bounded<B: Backend>(b: B) {
    let store = b.store();
    let mut runs = Vec::new();
    for _ in 0..3 {
        runs.push(submit(&store, LONG_TIMEOUT_MS, 0).await);
        b.advance(10);
    }
    let listed: Vec<RunId> =
        store.runs(&ql_control::store::RunQuery::latest(2)).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(listed, vec![runs[2].clone(), runs[1].clone()]);
    let first = open(&store, "router-1").await;
    b.advance(10);
    open(&store, "router-2").await;
    let workers = store.worker_page(None, 1).await.unwrap();
    let listed: Vec<_> = workers.iter().map(|w| (&w.id, w.session.as_ref().map(|s| &s.id))).collect();
    assert_eq!(listed, vec![(&first.worker, Some(&first.session))], "by id, bounded");
    assert_eq!(store.run_detail(&RunId::parse("run_missing").unwrap()).await.unwrap(), None);

    let rec = AuditRecord {
        at: 0,
        principal: Some(worker("router-1")),
        route: "session.open".into(),
        outcome: "admitted".into(),
    };
    store.audit(rec.clone()).await.unwrap();
    store.audit(AuditRecord { principal: None, outcome: "unauthenticated".into(), ..rec }).await.unwrap();
    let audits = store.audits().await.unwrap();
    assert_eq!(audits.iter().map(|a| a.outcome.as_str()).collect::<Vec<_>>(), ["admitted", "unauthenticated"]);
    assert!(audits.iter().all(|a| a.at > 0), "the store fills DB time");
    check_invariants(&store.snapshot().await.unwrap());
}

/// An open whose answer was lost is repeated at once: a session never heard from since
/// it was opened is replaced by the next open, while one that has spoken is not.
pub async fn a_repeated_open_replaces_a_session_never_heard_from<B: Backend>(b: B) {
    let store = b.store();
    let lost = open(&store, "router-1").await;
    let again = open(&store, "router-1").await;
    assert_eq!(again.generation.get(), lost.generation.get() + 1);
    let snap = store.snapshot().await.unwrap();
    let state = |id: &SessionId| snap.sessions.iter().find(|s| &s.id == id).unwrap().state;
    assert_eq!(state(&lost.session), SessionState::Replaced);
    b.advance(1);
    heartbeat(&store, &again, false).await.unwrap();
    let twin = Command::OpenSession(worker("router-1"), open_body(1, &[]));
    refused(&store, twin, ErrorCode::SessionConflict, "once it spoke, a second open is a twin's").await;
}

/// A request's `admitted` record commits with its command: both or neither. A refused
/// command keeps the record and adds its refusal's, and changes nothing else. An
/// admission decided in the command's transaction that refuses runs no command and
/// records the refusal alone.
pub async fn an_audited_command_commits_its_admission_with_its_decision<B: Backend>(b: B) {
    let store = b.store();
    let agent = open(&store, "router-1").await;
    assert!(store.audits().await.unwrap().is_empty(), "a command without a record writes none");
    let rec = AuditRecord {
        at: 0,
        principal: Some(worker("router-1")),
        route: "session.heartbeat".into(),
        outcome: "admitted".into(),
    };
    let audit = |admit: Option<&str>| Some(Audit { record: rec.clone(), admit: admit.map(str::to_owned) });
    let beat = ql_wire::session::Heartbeat { generation: agent.generation, draining: false };
    let command = |session: &SessionId| Command::Heartbeat(worker("router-1"), session.clone(), beat.clone());
    let answered = store.execute_audited(command(&agent.session), audit(None)).await.unwrap();
    assert!(matches!(answered, Ok(Reply::Heartbeat(_))), "{answered:?}");
    let answered = store.execute_audited(command(&agent.session), audit(Some("0a"))).await.unwrap();
    assert!(matches!(answered, Ok(Reply::Heartbeat(_))), "admitted in the transaction: {answered:?}");
    let before = store.snapshot().await.unwrap();
    let missing = SessionId::parse("ses_missing").unwrap();
    let refused = store.execute_audited(command(&missing), audit(Some("0a"))).await.unwrap();
    assert_eq!(refused, Err(ErrorCode::NotFound));
    assert_eq!(store.snapshot().await.unwrap(), before, "the refusal changed no state");
    let outcomes = || async { store.audits().await.unwrap().into_iter().map(|a| a.outcome).collect::<Vec<_>>() };
    assert_eq!(outcomes().await, ["admitted", "admitted", "admitted", "not_found"], "each admission, then the refusal");

    exec(&store, Command::SetAccess(worker("router-1"), Access::Disable)).await.unwrap();
    let before = store.snapshot().await.unwrap();
    let turned_away = store.execute_audited(command(&agent.session), audit(Some("0a"))).await.unwrap();
    assert_eq!(turned_away, Err(ErrorCode::WorkerDisabled));
    assert_eq!(store.snapshot().await.unwrap(), before, "the command did not run");
    assert_eq!(outcomes().await.last().map(String::as_str), Some("worker_disabled"));
    assert_eq!(outcomes().await.len(), 5, "the refusal alone");
}

/// `workers` counts the session opens refused as a twin's from the audit records, per
/// worker, within a window of DB time.
pub async fn twin_refusals_are_counted_from_the_audit_records<B: Backend>(b: B) {
    let store = b.store();
    let rec = |w: &str, route: &str, outcome: &str| AuditRecord {
        at: 0,
        principal: Some(worker(w)),
        route: route.into(),
        outcome: outcome.into(),
    };
    store.audit(rec("router-1", "session.open", "session_conflict")).await.unwrap();
    b.advance(120_000);
    for r in [
        rec("router-1", "session.open", "session_conflict"),
        rec("router-1", "session.open", "session_conflict"),
        rec("router-2", "session.open", "admitted"),
        rec("router-2", "session.heartbeat", "session_conflict"),
    ] {
        store.audit(r).await.unwrap();
    }
    assert_eq!(store.twin_refusals(60_000).await.unwrap(), vec![(worker("router-1"), 2)], "the last minute");
    assert_eq!(store.twin_refusals(600_000).await.unwrap(), vec![(worker("router-1"), 3)]);
}

/// A worker opening sessions in a loop leaves no more than a few rows: of its ended
/// sessions never offered work only the newest `kept` generations stay, the rest going a
/// batch at a time; one work was placed on stays with what names it, and so do another
/// worker's. The next open still numbers after the highest.
pub async fn ended_sessions_never_offered_work_are_pruned<B: Backend>(b: B) {
    let store = b.store();
    // An agent's clean exit closes its session: the next open is no twin of it.
    let close = |a: &Agent| {
        let body = ql_wire::session::CloseSession { generation: a.generation };
        Command::CloseSession(a.worker.clone(), a.session.clone(), body)
    };
    let first = open(&store, "router-9").await;
    exec(&store, close(&first)).await.unwrap();
    let offered = open(&store, "router-9").await;
    submit(&store, 600_000, 0).await;
    assert_eq!(poll(&store, &offered).await.len(), 1, "work placed on generation 2");
    exec(&store, close(&offered)).await.unwrap();
    let mut newest = offered.clone();
    for _ in 0..18 {
        newest = open(&store, "router-9").await;
        if newest.generation.get() < 20 {
            exec(&store, close(&newest)).await.unwrap();
        }
    }
    assert_eq!(newest.generation.get(), 20);
    let other = open(&store, "router-8").await;
    let kept = |all: Vec<ql_control::model::Session>, name: &str| -> Vec<u64> {
        let mut g: Vec<u64> = all.iter().filter(|s| s.worker.as_str() == name).map(|s| s.generation.get()).collect();
        g.sort_unstable();
        g
    };
    assert!(store.snapshot().await.unwrap().sessions.iter().any(|s| s.id == first.session && !s.offered));
    assert!(store.snapshot().await.unwrap().sessions.iter().any(|s| s.id == offered.session && s.offered));

    let retention = SessionRetention { kept: 4, batch: 10 };
    assert_eq!(store.prune_sessions(SessionRetention { batch: 0, ..retention }).await.unwrap(), 0, "no batch");
    assert_eq!(store.prune_sessions(retention).await.unwrap(), 10, "a batch at a time, oldest first");
    let sessions = kept(store.snapshot().await.unwrap().sessions, "router-9");
    assert_eq!(sessions, [2, 12, 13, 14, 15, 16, 17, 18, 19, 20]);
    assert_eq!(store.prune_sessions(retention).await.unwrap(), 5);
    let sessions = kept(store.snapshot().await.unwrap().sessions, "router-9");
    assert_eq!(sessions, [2, 17, 18, 19, 20], "offered, and the newest four");
    let before = store.snapshot().await.unwrap();
    assert_eq!(store.prune_sessions(retention).await.unwrap(), 0);
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "nothing more to prune");
    assert_eq!(kept(before.sessions, "router-8"), [other.generation.get()]);
    // A heartbeat on a pruned session is told it is gone; the next open numbers on.
    assert_eq!(heartbeat(&store, &first, false).await, Err(ErrorCode::NotFound));
    exec(&store, close(&newest)).await.unwrap();
    let last = open(&store, "router-9").await;
    assert_eq!(last.generation.get(), 21);
    // Kept at zero still keeps the newest, ended too: the next generation never repeats.
    exec(&store, close(&last)).await.unwrap();
    assert_eq!(store.prune_sessions(SessionRetention { kept: 0, batch: 100 }).await.unwrap(), 4);
    assert_eq!(kept(store.snapshot().await.unwrap().sessions, "router-9"), [2, 21]);
    assert_eq!(open(&store, "router-9").await.generation.get(), 22);
}

/// The sweeper's audit retention removes only from the old end: first by age (DB time),
/// then all but the newest records; it never touches the protocol's rows.
pub async fn audit_records_are_pruned_by_age_and_count<B: Backend>(b: B) {
    let store = b.store();
    let rec = |route: &str| AuditRecord { at: 0, principal: None, route: route.into(), outcome: "admitted".into() };
    open(&store, "router-1").await;
    store.audit(rec("old-1")).await.unwrap();
    store.audit(rec("old-2")).await.unwrap();
    b.advance(60_000);
    for route in ["new-1", "new-2", "new-3"] {
        store.audit(rec(route)).await.unwrap();
    }
    let before = store.snapshot().await.unwrap();
    let routes = |audits: Vec<AuditRecord>| audits.into_iter().map(|a| a.route).collect::<Vec<_>>();

    let unbounded = AuditRetention::default();
    assert_eq!(store.prune_audit(unbounded).await.unwrap(), 0, "no bound, nothing pruned");
    let by_age = AuditRetention { max_age_ms: Some(30_000), max_records: None };
    assert_eq!(store.prune_audit(by_age).await.unwrap(), 2);
    assert_eq!(routes(store.audits().await.unwrap()), ["new-1", "new-2", "new-3"]);
    let by_count = AuditRetention { max_age_ms: None, max_records: Some(2) };
    assert_eq!(store.prune_audit(by_count).await.unwrap(), 1);
    assert_eq!(routes(store.audits().await.unwrap()), ["new-2", "new-3"]);
    assert_eq!(store.prune_audit(by_count).await.unwrap(), 0, "pruning again changes nothing");
    assert_eq!(store.snapshot().await.unwrap(), before, "no protocol row changed");
}

// ------------------------------------------------------------ atomicity, concurrency

/// A write that fails inside the transaction (here: an event type the attempt already
/// has) rolls back every row the command had written before it, and the store serves on.
pub async fn a_failed_write_rolls_back_the_whole_command<B: Backend>(b: B) {
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 0).await;
    b.plant_event(h.run(), h.attempt(), "attempt.starting").await;
    let before = store.snapshot().await.unwrap();
    // `starting` writes the attempt first, then appends its event, which now collides.
    assert!(store.execute(h.starting()).await.is_err(), "the colliding event fails the command");
    assert_unchanged(&before, &store.snapshot().await.unwrap(), "failed starting");
    assert_eq!(detail(&store, h.run()).await.attempts[0].status, AttemptStatus::Claimed);
    let mut h = h;
    assert_eq!(renew(&store, &mut h).await.lease_version.get(), 2, "the store serves on");
    check_invariants(&store.snapshot().await.unwrap());
}

/// Claims racing for one offer, from this process and another, admit exactly one; polls
/// racing for one queued run place it exactly once.
pub async fn racing_claims_and_polls_admit_exactly_one<B: Backend>(b: B) {
    let store = b.store();
    let other = b.other_process();
    submit(&store, LONG_TIMEOUT_MS, 0).await;
    let agent = open(&store, "router-1").await;
    let offer = poll(&store, &agent).await.remove(0);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s = if i % 2 == 0 { store.clone() } else { other.clone() };
        let cmd = claim_cmd(&agent, &offer, &Token::generate().unwrap());
        tasks.push(tokio::spawn(async move { s.execute(cmd).await.unwrap() }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    assert_eq!(results.iter().filter(|r| matches!(r, Ok(Reply::Claimed(_)))).count(), 1, "{results:?}");
    assert!(results.iter().all(|r| matches!(r, Ok(Reply::Claimed(_)) | Err(ErrorCode::OfferConflict))), "{results:?}");

    let run = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let x = open(&store, "router-2").await;
    let y = open(&other, "router-3").await;
    let (px, py) = tokio::join!(poll(&store, &x), poll(&other, &y));
    assert_eq!(px.iter().chain(&py).filter(|o| o.run_id == run).count(), 1, "{px:?} {py:?}");
    assert_eq!(detail(&store, &run).await.attempts.len(), 1);
    check_invariants(&store.snapshot().await.unwrap());
}
