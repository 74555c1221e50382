//! The core's transitions, one by one, then every path through a job's life walked by a
//! small simulator that plays the server and the process.

use super::*;
use crate::journal::state::fixtures::{self, c, key, token};
use crate::journal::{JournalState, Record};
use ql_wire::artifact::Receipt;
use ql_wire::capability::Digest;
use ql_wire::text::ExecutorHandle;

const TTL_MS: u64 = 30_000;

fn replay(records: &[Record]) -> JournalState {
    let mut state = JournalState::default();
    for r in records {
        state.apply(r).unwrap_or_else(|e| panic!("{r:?} refused: {e}"));
    }
    state
}

fn k() -> JobKey {
    key("s1", "a1")
}

/// The journal after the first `n` records of a normal life (offer, claim, starting, spawn,
/// mint, running).
fn after(n: usize) -> (JournalState, Job) {
    let key = k();
    let all = [
        fixtures::offered(&key, 3),
        fixtures::claimed(&key),
        Record::StartingAcked { job: key.clone() },
        fixtures::spawned(&key),
        fixtures::minted(&key, 9),
        Record::RunningAcked { job: key.clone() },
    ];
    let state = replay(&all[..n]);
    let job = state.jobs[&key].clone();
    (state, job)
}

fn with(job: &Job, records: &[Record]) -> Job {
    let mut state = JournalState::default();
    let key = k();
    for r in fixtures::lifecycle(&key).into_iter().take(1).chain(job_to_records(job)).chain(records.iter().cloned()) {
        state.apply(&r).unwrap_or_else(|e| panic!("{r:?} refused: {e}"));
    }
    state.jobs[&key].clone()
}

fn job_to_records(job: &Job) -> Vec<Record> {
    crate::journal::state::job_records(&k(), job).into_iter().skip(1).collect()
}

fn t0() -> Instant {
    // Any instant works: only differences matter.
    Instant::now()
}

/// The agent's default log settings.
const POLICY: LogPolicy = LogPolicy { flush_bytes: 65_536, flush: Duration::from_millis(1_000), chunk_max: 262_144 };

fn at(base: Instant, ms: u64) -> Now {
    Now { at: base + Duration::from_millis(ms), drain_by: None, log: POLICY }
}

fn fresh(base: Instant) -> Runtime {
    Runtime { lease_fresh_at: Some(base), ..Runtime::default() }
}

fn running(base: Instant) -> Runtime {
    Runtime {
        lease_fresh_at: Some(base),
        timeout_at: Some(base + Duration::from_millis(60_000)),
        process: Process::Running,
        ..Runtime::default()
    }
}

fn exited_record(code: Option<i32>, signal: Option<i32>) -> Record {
    exited(
        &k(),
        Ending {
            exit_code: code,
            signal,
            finished_at: Timestamp::parse("2026-11-30T08:00:00Z").unwrap(),
            log_len: 12,
            truncated: false,
        },
    )
}

fn kind(step: &Step) -> &'static str {
    match step {
        Step::Claim(_) => "claim",
        Step::Renew(_) => "renew",
        Step::Starting(_) => "starting",
        Step::Spawn => "spawn",
        Step::Adopt => "adopt",
        Step::SkipSpawn(_) => "skip-spawn",
        Step::MintCallback => "mint",
        Step::Running(_) => "running",
        Step::StartFailure(_) => "start-failure",
        Step::Recover => "recover",
        Step::Stop(_) => "stop",
        Step::Wait(_) => "wait",
        Step::Upload(_) => "upload",
        Step::Append(_) => "append",
        Step::Seal(_) => "seal",
        Step::Complete(_) => "complete",
        Step::Drop => "drop",
    }
}

#[test]
fn an_unclaimed_job_claims_with_the_token_and_generation_from_its_journal() {
    let (_, job) = after(1);
    let base = t0();
    let Step::Claim(claim) = next(&k(), &job, &Runtime::default(), at(base, 0)) else { panic!() };
    assert_eq!(claim.lease_token, token(3));
    assert_eq!(claim.generation, c(1));
    assert_eq!((claim.run_id.as_str(), claim.attempt_id.as_str()), ("run-a1", "a1"));
}

#[test]
fn a_claimed_job_sends_starting_with_its_fence() {
    let (_, job) = after(2);
    let base = t0();
    let Step::Starting(fence) = next(&k(), &job, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!(fence.lease_token, token(3));
    assert_eq!(fence.offer_id.as_str(), "offer-a1");
    assert_eq!((fence.session_generation, fence.lease_generation, fence.expected_lease_version), (c(1), c(1), c(1)));
}

#[test]
fn after_starting_the_process_is_spawned() {
    let (_, job) = after(3);
    let base = t0();
    assert_eq!(next(&k(), &job, &fresh(base), at(base, 0)), Step::Spawn);
}

#[test]
fn a_lease_of_unknown_age_is_renewed_before_anything_else() {
    let base = t0();
    for n in 2..=3 {
        let (_, job) = after(n);
        let step = next(&k(), &job, &Runtime::default(), at(base, 0));
        assert!(matches!(step, Step::Renew(ref f) if f.expected_lease_version == c(1)), "{n}: {step:?}");
    }
}

#[test]
fn renewal_is_due_a_third_of_the_ttl_after_the_last_success() {
    let (_, job) = after(6);
    let base = t0();
    let third = TTL_MS / 3;
    assert_eq!(
        next(&k(), &job, &running(base), at(base, third - 1)),
        Step::Wait(Some(base + Duration::from_millis(third)))
    );
    assert!(matches!(next(&k(), &job, &running(base), at(base, third)), Step::Renew(_)));
    // Before the spawn too.
    let (_, job) = after(2);
    assert!(matches!(next(&k(), &job, &fresh(base), at(base, third)), Step::Renew(_)));
    assert!(matches!(next(&k(), &job, &fresh(base), at(base, third - 1)), Step::Starting(_)));
}

#[test]
fn a_spawned_job_mints_its_callback_before_the_running_ack() {
    let (_, job) = after(4);
    let base = t0();
    assert_eq!(next(&k(), &job, &running(base), at(base, 0)), Step::MintCallback);
    let Record::CallbackMinted { callback_sequence, log_artifact_id, .. } = minted(&k(), token(5)) else { panic!() };
    assert_eq!(callback_sequence, c(1));
    assert_eq!(log_artifact_id.unwrap().as_str(), LOG_ARTIFACT_ID);
}

#[test]
fn the_running_ack_registers_handle_log_sequence_and_digest() {
    let (_, job) = after(5);
    let base = t0();
    let Step::Running(body) = next(&k(), &job, &running(base), at(base, 0)) else { panic!() };
    assert_eq!(body.executor_handle, ExecutorHandle::parse("pid:4242 start:777").unwrap());
    assert_eq!(body.log_artifact_id.unwrap().as_str(), "log-1");
    assert_eq!(body.callback_sequence, c(1));
    assert_eq!(body.callback_token_digest, token(9).digest());
    assert_eq!(body.expected_lease_version, c(1));
}

#[test]
fn a_running_job_waits_for_the_earliest_of_renewal_timeout_drain_and_a_look_at_its_log() {
    let (_, job) = after(6);
    let base = t0();
    let log = POLICY.flush;
    let mut rt = running(base);
    rt.timeout_at = Some(base + Duration::from_millis(4_000));
    // Nothing in the spool: look again within the flush interval.
    assert_eq!(next(&k(), &job, &rt, at(base, 0)), Step::Wait(Some(base + log)));
    rt.log_sent_at = Some(base);
    let late = at(base, 2_500);
    assert_eq!(next(&k(), &job, &rt, late), Step::Wait(Some(late.at + log)));
    assert_eq!(next(&k(), &job, &rt, at(base, 3_500)), Step::Wait(Some(base + Duration::from_millis(4_000))));
    let slow = Now { log: LogPolicy { flush: Duration::from_secs(60), ..POLICY }, ..at(base, 0) };
    assert_eq!(next(&k(), &job, &rt, slow), Step::Wait(Some(base + Duration::from_millis(4_000))));
    let now = Now { drain_by: Some(base + Duration::from_millis(2_000)), ..slow };
    assert_eq!(next(&k(), &job, &rt, now), Step::Wait(Some(base + Duration::from_millis(2_000))));
    rt.timeout_at = None;
    assert_eq!(next(&k(), &job, &rt, slow), Step::Wait(Some(base + Duration::from_millis(TTL_MS / 3))));
}

#[test]
fn a_running_job_streams_its_log_from_the_acknowledged_offset() {
    let (_, job) = after(6);
    let base = t0();
    let rt = Runtime { spooled: 1_000, log_sent_at: Some(base), ..running(base) };
    // A few bytes wait for the flush interval, then go as one chunk.
    assert_eq!(next(&k(), &job, &rt, at(base, 999)), Step::Wait(Some(base + POLICY.flush)));
    let Step::Append(h) = next(&k(), &job, &rt, at(base, 1_000)) else { panic!() };
    assert_eq!((h.offset, h.content_length, h.artifact_id.as_str()), (0, 1_000, "log-1"));
    assert_eq!((h.lease_token.clone(), h.expected_lease_version), (token(3), c(1)));
    // Enough bytes go at once, at most a chunk, from where the journal says the server is.
    let acked = with(&job, &[Record::LogAcked { job: k(), acked: 1_000 }]);
    let busy = Runtime { spooled: 1_000 + 700_000, ..rt };
    let Step::Append(h) = next(&k(), &acked, &busy, at(base, 1)) else { panic!() };
    assert_eq!((h.offset, h.content_length), (1_000, 262_144));
    let small = Runtime { chunk_cap: 10_000, ..busy };
    let Step::Append(h) = next(&k(), &acked, &small, at(base, 1)) else { panic!() };
    assert_eq!(h.content_length, 10_000);
    // A renewal that is due goes first; a lost log is not streamed.
    assert!(matches!(next(&k(), &acked, &busy, at(base, TTL_MS / 3)), Step::Renew(_)));
    let lost = Runtime { log_lost: true, ..busy };
    assert!(matches!(next(&k(), &acked, &lost, at(base, 1)), Step::Wait(_)));
}

#[test]
fn an_ended_job_sends_the_rest_of_its_log_then_seals_then_completes() {
    let (_, job) = after(6);
    let base = t0();
    let ended = with(&job, &[Record::LogAcked { job: k(), acked: 5 }, exited_record(Some(0), None)]);
    let Step::Append(h) = next(&k(), &ended, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!((h.offset, h.content_length), (5, 7));
    let all = with(&ended, &[Record::LogAcked { job: k(), acked: 12 }]);
    let Step::Seal(seal) = next(&k(), &all, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!((seal.content_length, seal.truncated, seal.lease_token.clone()), (12, false, token(3)));
    let stored = with(&all, &[fixtures::stored(&k())]);
    let Step::Complete(body) = next(&k(), &stored, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!(body.artifact.unwrap().length, 12);
}

#[test]
fn chunks_are_sized_to_a_sixth_of_the_lease_at_the_uplinks_pace() {
    let ttl = Duration::from_millis(TTL_MS);
    // 256 KiB/s: 5 s of it is more than a chunk may be.
    assert_eq!(adapt_chunk(262_144, Duration::from_secs(1), ttl, 262_144), 262_144);
    // 16 KiB/s: 80 KiB in 5 s.
    assert_eq!(adapt_chunk(16_384, Duration::from_secs(1), ttl, 262_144), 81_920);
    // Never below the floor, never above the policy, whatever was measured.
    assert_eq!(adapt_chunk(1, Duration::from_secs(100), ttl, 262_144), MIN_CHUNK);
    assert_eq!(adapt_chunk(262_144, Duration::ZERO, ttl, 100_000), 100_000);
    assert_eq!(shrink_chunk(0, 262_144), 131_072);
    assert_eq!(shrink_chunk(131_072, 262_144), 65_536);
    assert_eq!(shrink_chunk(MIN_CHUNK, 262_144), MIN_CHUNK);
}

#[test]
fn stop_causes_rank_intent_then_timeout_then_drain() {
    let (_, job) = after(6);
    let base = t0();
    let mut rt = running(base);
    rt.timeout_at = Some(base);
    let drained = Now { at: base, drain_by: Some(base), log: POLICY };
    assert_eq!(next(&k(), &job, &rt, drained), Step::Stop(StopCause::Timeout));
    rt.timeout_at = None;
    assert_eq!(next(&k(), &job, &rt, drained), Step::Stop(StopCause::Drain));
    for intent in [StopIntent::Cancel, StopIntent::Timeout] {
        let stopped = with(&job, &[Record::StopSeen { job: k(), intent }]);
        assert_eq!(next(&k(), &stopped, &rt, drained), Step::Stop(StopCause::Intent(intent)));
    }
}

#[test]
fn a_stop_outranks_a_due_renewal_and_the_running_ack() {
    let (_, job) = after(5);
    let stopped = with(&job, &[Record::StopSeen { job: k(), intent: StopIntent::Cancel }]);
    let base = t0();
    let rt = Runtime { process: Process::Running, ..Runtime::default() };
    assert_eq!(next(&k(), &stopped, &rt, at(base, 0)), Step::Stop(StopCause::Intent(StopIntent::Cancel)));
}

#[test]
fn a_stopping_job_keeps_its_lease_alive_and_otherwise_waits() {
    let (_, job) = after(6);
    let base = t0();
    let rt = Runtime { process: Process::Stopping, ..running(base) };
    assert_eq!(next(&k(), &job, &rt, at(base, 1)), Step::Wait(Some(base + Duration::from_millis(TTL_MS / 3))));
    assert!(matches!(next(&k(), &job, &rt, at(base, TTL_MS / 3)), Step::Renew(_)));
}

#[test]
fn a_stop_seen_before_the_spawn_reports_a_start_failure() {
    let (_, job) = after(3);
    let stopped = with(&job, &[Record::StopSeen { job: k(), intent: StopIntent::Cancel }]);
    let base = t0();
    assert_eq!(
        next(&k(), &stopped, &fresh(base), at(base, 0)),
        Step::SkipSpawn(Reason::summarise(STOPPED_BEFORE_START))
    );
    // Before `starting`, `starting` comes first: start-failure needs it.
    let (_, claimed) = after(2);
    let stopped = with(&claimed, &[Record::StopSeen { job: k(), intent: StopIntent::Timeout }]);
    assert!(matches!(next(&k(), &stopped, &fresh(base), at(base, 0)), Step::Starting(_)));
}

#[test]
fn a_drain_that_ran_out_before_the_spawn_reports_a_start_failure() {
    let (_, job) = after(3);
    let base = t0();
    let now = Now { at: base, drain_by: Some(base), log: POLICY };
    assert_eq!(next(&k(), &job, &fresh(base), now), Step::SkipSpawn(Reason::summarise(SHUT_DOWN_BEFORE_START)));
    let later = Now { at: base, drain_by: Some(base + Duration::from_millis(1)), log: POLICY };
    assert_eq!(next(&k(), &job, &fresh(base), later), Step::Spawn, "a drain with time left still starts claimed jobs");
}

#[test]
fn a_spawn_failure_is_reported_with_its_reason() {
    let (_, job) = after(3);
    let reason = Reason::summarise("cannot start `nope`: No such file or directory");
    let failed = with(&job, &[Record::SpawnFailed { job: k(), reason: reason.clone() }]);
    let base = t0();
    let Step::StartFailure(body) = next(&k(), &failed, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!(body.reason, reason);
    assert_eq!(body.lease_token, token(3));
    // A failure journaled before `starting` (not this agent's order) sends `starting` first.
    let (_, claimed) = after(2);
    let early = with(&claimed, &[Record::SpawnFailed { job: k(), reason }]);
    assert!(matches!(next(&k(), &early, &fresh(base), at(base, 0)), Step::Starting(_)));
}

#[test]
fn an_exit_before_the_running_ack_skips_it_and_uploads_then_completes() {
    let (_, job) = after(5);
    let ended = with(&job, &[exited_record(Some(0), None)]);
    let base = t0();
    let Step::Upload(header) = next(&k(), &ended, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!((header.content_length, header.truncated), (12, false));
    let stored = with(&ended, &[fixtures::stored(&k())]);
    let Step::Complete(body) = next(&k(), &stored, &fresh(base), at(base, 0)) else { panic!() };
    assert_eq!(body.artifact.unwrap().length, 12);
    assert_eq!(body.callback_token, token(9));
    assert_eq!((body.exit_code, body.signal), (Some(0), None));
}

/// After a restart the lease's age is unknown: an ended job whose log is still to go out
/// renews first (streaming it may outlast the lease), one with nothing left but its
/// completion reports at once, and once renewals are refused neither renews.
#[test]
fn an_exited_job_of_unknown_lease_age_renews_only_before_streaming_its_log() {
    let (_, job) = after(6);
    let ended = with(&job, &[exited_record(Some(3), None)]);
    let base = t0();
    assert!(matches!(next(&k(), &ended, &Runtime::default(), at(base, 0)), Step::Renew(_)));
    let stored = with(&ended, &[fixtures::stored(&k())]);
    assert!(matches!(next(&k(), &stored, &Runtime::default(), at(base, 0)), Step::Complete(_)));
    let refused = Runtime { renewals_refused: true, ..Runtime::default() };
    assert!(matches!(next(&k(), &ended, &refused, at(base, 0)), Step::Append(_)));
}

#[test]
fn a_lost_log_completes_without_an_artifact() {
    let (_, job) = after(6);
    let ended = with(&job, &[exited_record(None, Some(9))]);
    let base = t0();
    let rt = Runtime { log_lost: true, ..fresh(base) };
    let Step::Complete(body) = next(&k(), &ended, &rt, at(base, 0)) else { panic!() };
    assert_eq!((body.artifact, body.exit_code, body.signal), (None, None, Some(9)));
}

#[test]
fn a_crash_between_spawn_and_mint_still_mints_before_completing() {
    let (_, job) = after(4);
    let ended = with(&job, &[exited_record(None, Some(9))]);
    let base = t0();
    assert_eq!(next(&k(), &ended, &Runtime::default(), at(base, 0)), Step::MintCallback);
}

#[test]
fn a_spawned_process_this_agent_does_not_hold_is_recovered() {
    for n in [5, 6] {
        let (_, job) = after(n);
        let base = t0();
        assert_eq!(next(&k(), &job, &fresh(base), at(base, 0)), Step::Recover, "after {n} records");
    }
}

/// A recovery that could not stop what runs of the job waits its back-off before the next
/// one, renewing meanwhile when a renewal falls due: giving the attempt up while the job
/// still runs would run it twice. A job the server ended has nothing to give up.
#[test]
fn a_recovery_that_could_not_stop_the_job_waits_and_renews_meanwhile() {
    let base = t0();
    let (_, job) = after(6);
    let renewal = renew_at(job.lease.as_ref().unwrap(), &fresh(base)).unwrap();
    let when = |t: Instant| Now { at: t, ..at(base, 0) };
    let held = |until: Instant| Runtime { recover_hold: Hold { until: Some(until), failures: 1 }, ..fresh(base) };
    // Held until before the renewal is due: wait, then recover.
    let soon = base + Duration::from_millis(1);
    assert!(soon < renewal);
    assert_eq!(next(&k(), &job, &held(soon), when(base)), Step::Wait(Some(soon)));
    assert_eq!(next(&k(), &job, &held(soon), when(soon)), Step::Recover);
    // Held past it: the renewal goes first.
    let late = renewal + Duration::from_secs(3_600);
    assert_eq!(next(&k(), &job, &held(late), when(base)), Step::Wait(Some(renewal)));
    assert!(matches!(next(&k(), &job, &held(late), when(renewal)), Step::Renew(_)));
    // A job the server ended: nothing to give up, so no hold.
    let finished = Runtime { finished: true, ..held(late) };
    assert_eq!(next(&k(), &job, &finished, when(base)), Step::Recover);
}

#[test]
fn a_finished_job_stops_what_runs_and_is_dropped() {
    let base = t0();
    let (_, job) = after(6);
    let rt = |process| Runtime { finished: true, process, ..fresh(base) };
    assert_eq!(next(&k(), &job, &rt(Process::Running), at(base, 0)), Step::Stop(StopCause::Ended));
    assert_eq!(next(&k(), &job, &rt(Process::Stopping), at(base, 0)), Step::Wait(None));
    assert_eq!(next(&k(), &job, &rt(Process::Absent), at(base, 0)), Step::Recover);
    let ended = with(&job, &[exited_record(Some(0), None)]);
    assert_eq!(next(&k(), &ended, &rt(Process::Absent), at(base, 0)), Step::Drop);
    for n in 1..=3 {
        let (_, early) = after(n);
        assert_eq!(next(&k(), &early, &rt(Process::Absent), at(base, 0)), Step::Drop, "after {n} records");
    }
}

#[test]
fn a_renewal_in_doubt_is_settled_by_renewing_while_the_lease_is_kept() {
    let base = t0();
    let (_, job) = after(6);
    let ended = with(&job, &[exited_record(Some(0), None)]);
    for j in [&after(2).1, &after(3).1, &after(5).1, &job, &ended] {
        let lost = Runtime { renew_doubt: RenewDoubt::SURE.lost(), ..running(base) };
        let step = next(&k(), j, &lost, at(base, 0));
        assert!(matches!(step, Step::Renew(ref f) if f.expected_lease_version == c(1)), "{step:?}");
        let next_one = Runtime { renew_doubt: RenewDoubt::SURE.lost().next(), ..running(base) };
        let step = next(&k(), j, &next_one, at(base, 0));
        assert!(matches!(step, Step::Renew(ref f) if f.expected_lease_version == c(2)), "{step:?}");
    }
}

/// Found by the fault matrix (`agent sent:lease.renew@1`): the agent died after a renewal
/// was applied but before its answer was journaled. The restarted agent presented the
/// journal's version, met `lease_conflict`, and dropped a job whose result it held: the run
/// was lost to lease expiry. Now a resumed job is in doubt, and a conflict earns a repeat
/// with the next version, which is then recorded.
#[test]
fn a_restarted_job_settles_a_renewal_lost_in_the_crash_with_the_next_version() {
    let base = t0();
    let (_, job) = after(6);
    let ended = with(&job, &[exited_record(Some(0), None)]);
    let failed = with(&after(3).1, &[Record::SpawnFailed { job: k(), reason: Reason::summarise("x") }]);
    let resumed = Runtime::resumed();
    assert_eq!(resumed.renew_doubt, RenewDoubt::SURE.lost());
    // The log still to go out: renewed first, with the journal's version.
    let Step::Renew(f) = next(&k(), &ended, &resumed, at(base, 0)) else { panic!() };
    assert_eq!(f.expected_lease_version, c(1));
    // No renewal first for a start failure: the session may be gone, and it needs none.
    let Step::StartFailure(b) = next(&k(), &failed, &resumed, at(base, 0)) else { panic!() };
    assert_eq!(b.expected_lease_version, c(1));
    assert!(retry_next_version(RenewDoubt::SURE.lost(), ErrorCode::LeaseConflict));
    assert!(
        !retry_next_version(RenewDoubt::SURE.lost().next(), ErrorCode::LeaseConflict),
        "one repeat for each renewal in doubt"
    );
    assert!(!retry_next_version(RenewDoubt::SURE, ErrorCode::LeaseConflict));
    assert!(!retry_next_version(RenewDoubt::SURE.lost(), ErrorCode::SessionConflict));
    let next_one = Runtime { renew_doubt: RenewDoubt::SURE.lost().next(), ..resumed };
    let Step::Renew(f) = next(&k(), &ended, &next_one, at(base, 0)) else { panic!() };
    assert_eq!(f.expected_lease_version, c(2));
    let refused = Runtime { renewals_refused: true, ..next_one };
    let Step::Append(h) = next(&k(), &ended, &refused, at(base, 0)) else { panic!() };
    assert_eq!(h.expected_lease_version, c(2));
    let Step::StartFailure(b) = next(&k(), &failed, &next_one, at(base, 0)) else { panic!() };
    assert_eq!(b.expected_lease_version, c(2));
    // Once a command went through with the next version, the journal learns it.
    assert_eq!(
        settled(&k(), &ended, RenewDoubt::SURE.lost().next()),
        Some(Record::Renewed { job: k(), lease_version: c(2) })
    );
    assert_eq!(settled(&k(), &ended, RenewDoubt::SURE.lost()), None);
    assert_eq!(settled(&k(), &ended, RenewDoubt::SURE), None);
    // A running job resumed renews first, with the journal's version.
    let step = next(&k(), &job, &Runtime { process: Process::Running, ..resumed }, at(base, 0));
    assert!(matches!(step, Step::Renew(ref f) if f.expected_lease_version == c(1)), "{step:?}");
}

/// Found by the fault matrix (`control delay:artifact.put`, `control drop:artifact.put`):
/// once the process had ended the agent stopped renewing, so an upload or a completion that
/// had to be repeated met an expired lease and the run was lost. Now the lease is renewed
/// while the report goes out, as long as its age is known.
#[test]
fn an_ended_process_keeps_its_lease_alive_while_it_is_reported() {
    let base = t0();
    let (_, job) = after(6);
    let ended = with(&job, &[exited_record(Some(0), None)]);
    let third = TTL_MS / 3;
    let kept = fresh(base);
    assert!(matches!(next(&k(), &ended, &kept, at(base, third - 1)), Step::Append(_)));
    assert!(matches!(next(&k(), &ended, &kept, at(base, third)), Step::Renew(_)));
    let stored = with(&ended, &[fixtures::stored(&k())]);
    assert!(matches!(next(&k(), &stored, &kept, at(base, third)), Step::Renew(_)));
    assert!(matches!(next(&k(), &stored, &kept, at(base, 0)), Step::Complete(_)));
    // Age unknown (a restart): renewed first, then at the usual pace while the log goes
    // out, however long that takes.
    let unknown = Runtime { lease_fresh_at: None, ..Runtime::resumed() };
    assert!(matches!(next(&k(), &ended, &unknown, at(base, third)), Step::Renew(_)));
    let renewed = Runtime { lease_fresh_at: Some(base), renew_doubt: RenewDoubt::SURE, ..unknown };
    assert!(matches!(next(&k(), &ended, &renewed, at(base, third - 1)), Step::Append(_)));
    assert!(matches!(next(&k(), &ended, &renewed, at(base, 4 * third)), Step::Renew(_)));
    // Renewals refused (the session is gone): reported without them.
    let refused = Runtime { renewals_refused: true, ..unknown };
    assert!(matches!(next(&k(), &ended, &refused, at(base, third)), Step::Append(_)));
    assert!(matches!(next(&k(), &stored, &refused, at(base, third)), Step::Complete(_)));
    // A refused renewal ends a running job, not the report of an ended one.
    assert!(renewal_refused_ends_job(&job));
    assert!(!renewal_refused_ends_job(&ended));
}

/// Found by the fault matrix (`control delay:offer.claim`): the claim's answer came late,
/// the repeat got the same lease, and the agent counted the lease's age from the repeat;
/// the lease had been made by the first sending and lapsed before the first renewal.
#[test]
fn a_repeated_claim_counts_the_lease_from_its_first_sending() {
    let base = t0();
    let rt = Runtime { claim_sent_at: Some(base), ..Runtime::default() };
    assert_eq!(claimed_fresh_at(&rt), Some(base));
    let (_, job) = after(2);
    let claimed = Runtime { lease_fresh_at: claimed_fresh_at(&rt), ..rt };
    assert!(matches!(next(&k(), &job, &claimed, at(base, TTL_MS / 3)), Step::Renew(_)));
    // A job found in the journal may have been claimed before the restart.
    let resumed = Runtime { claim_sent_at: Some(base), ..Runtime::resumed() };
    assert_eq!(claimed_fresh_at(&resumed), None);
}

/// Found by the fault matrix (`agent spawned`): the agent died between the fork and the
/// `spawned` record, and the restarted agent started the job a second time. Now a
/// `spawning` intent precedes the fork, and a restart that finds it unsettled looks for the
/// process instead of starting another.
#[test]
fn an_unsettled_spawning_intent_is_adopted_never_spawned_again() {
    let base = t0();
    let intent = with(&after(3).1, &[Record::Spawning { job: k() }]);
    // (Renewed since the restart, so the renewal does not come first.)
    let resumed = Runtime { lease_fresh_at: Some(base), renew_doubt: RenewDoubt::SURE, ..Runtime::resumed() };
    assert_eq!(next(&k(), &intent, &resumed, at(base, 0)), Step::Adopt);
    // Even with a stop intent or a drain: a process may run and must be found first.
    let stopped = with(&intent, &[Record::StopSeen { job: k(), intent: StopIntent::Cancel }]);
    assert_eq!(next(&k(), &stopped, &resumed, at(base, 0)), Step::Adopt);
    let finished = Runtime { finished: true, ..resumed };
    assert_eq!(next(&k(), &intent, &finished, at(base, 0)), Step::Adopt);
    // Found: recorded, then recovered like any orphan.
    let found = with(&intent, &[fixtures::spawned(&k())]);
    assert_eq!(next(&k(), &found, &resumed, at(base, 0)), Step::MintCallback);
    // Never started (no run directory): start it now.
    let unstarted = Runtime { unstarted: true, ..resumed };
    assert_eq!(next(&k(), &intent, &unstarted, at(base, 0)), Step::Spawn);
    assert_eq!(next(&k(), &intent, &Runtime { finished: true, ..unstarted }, at(base, 0)), Step::Drop);
    // Unknown: reported as a start failure, never run twice.
    let failed = with(&intent, &[Record::SpawnFailed { job: k(), reason: Reason::summarise(START_INTERRUPTED) }]);
    assert!(matches!(next(&k(), &failed, &resumed, at(base, 0)), Step::StartFailure(_)));
}

#[test]
fn renewal_doubt_follows_lost_answers_and_conflicts() {
    let sure = RenewDoubt::SURE;
    let lost = sure.lost();
    let next = lost.next();
    assert_eq!(next, RenewDoubt { ahead: 1, unsure: false });
    assert_eq!(renew_failed(sure, None), Some(lost));
    assert_eq!(renew_failed(sure, Some(ErrorCode::Unavailable)), Some(lost));
    assert_eq!(renew_failed(lost, None), Some(lost));
    assert_eq!(renew_failed(lost, Some(ErrorCode::LeaseConflict)), Some(next));
    // The renewal sent with the next version may have applied too.
    assert_eq!(renew_failed(next, None), Some(RenewDoubt { ahead: 1, unsure: true }));
    assert_eq!(renew_failed(next.lost(), Some(ErrorCode::LeaseConflict)), Some(RenewDoubt { ahead: 2, unsure: false }));
    assert_eq!(renew_failed(next, Some(ErrorCode::LeaseConflict)), None);
    assert_eq!(renew_failed(sure, Some(ErrorCode::LeaseConflict)), None);
    assert_eq!(renew_failed(lost, Some(ErrorCode::SessionConflict)), None);
    assert_eq!(renew_failed(sure, Some(ErrorCode::PrincipalMismatch)), Some(sure));
}

/// Every way up to six steps can go: a renewal answered, applied with its answer lost, or
/// lost on the way; or the agent restarting. The server's lease stays live throughout.
/// The agent journals a version a `lease_conflict` proved before its next renewal (as
/// `Agent::work` does). It never gives the job up, never presents a version the server has not
/// reached, and its next answered renewal brings the journal level with the server. Two
/// answers lost in a row once ended a healthy job here, and its run went back to the
/// queue while it still ran.
#[test]
fn lost_renewal_answers_never_end_a_job_whose_lease_is_live() {
    #[derive(Clone, Copy, PartialEq)]
    enum Fate {
        Answered,
        AppliedUnanswered,
        NeverArrived,
        Restart,
    }
    let fates = [Fate::Answered, Fate::AppliedUnanswered, Fate::NeverArrived, Fate::Restart];
    let (_, job) = after(6);
    let lease = job.lease.clone().expect("a claimed job has a lease");
    let at = |version: u64| Lease { version: c(version), ..lease.clone() };
    let steps = 6;
    for n in 0..4usize.pow(steps) {
        let path: Vec<Fate> = (0..steps).map(|i| fates[n / 4usize.pow(i) % 4]).collect();
        let (mut server, mut journal, mut doubt) = (lease.version.get(), lease.version.get(), RenewDoubt::SURE);
        // The path, then answered renewals until one succeeds.
        for (i, fate) in path.iter().copied().chain(std::iter::repeat(Fate::Answered)).enumerate() {
            assert!(i < steps as usize + 3, "no renewal succeeded after the path {n}");
            if fate == Fate::Restart {
                doubt = Runtime::resumed().renew_doubt;
                continue;
            }
            if doubt.ahead > 0 {
                journal = version_in_doubt(&at(journal), doubt).get();
                doubt = RenewDoubt { ahead: 0, unsure: doubt.unsure };
            }
            let presented = version_in_doubt(&at(journal), doubt).get();
            assert!(presented <= server, "path {n}: presented {presented}, the server is at {server}");
            let applies = presented == server && fate != Fate::NeverArrived;
            if applies {
                server += 1;
            }
            match fate {
                Fate::Answered if applies => {
                    journal = server;
                    doubt = RenewDoubt::SURE;
                    if i >= path.len() {
                        break;
                    }
                }
                Fate::Answered => {
                    doubt = renew_failed(doubt, Some(ErrorCode::LeaseConflict))
                        .unwrap_or_else(|| panic!("path {n}: a live lease given up at step {i}"));
                }
                _ => doubt = renew_failed(doubt, None).expect("a lost answer never ends a job"),
            }
        }
        assert_eq!(journal, server, "path {n}");
    }
}

#[test]
fn every_error_code_has_a_disposition() {
    use Disposition::*;
    let table = [
        (ErrorCode::InvalidRequest, EndJob),
        (ErrorCode::Unauthenticated, Misconfigured),
        (ErrorCode::PrincipalMismatch, Misconfigured),
        (ErrorCode::EnrolmentRefused, Misconfigured),
        (ErrorCode::CertificateRevoked, EndJob),
        (ErrorCode::WorkerDisabled, EndJob),
        (ErrorCode::NotFound, EndJob),
        (ErrorCode::SessionConflict, EndJob),
        (ErrorCode::OfferConflict, EndJob),
        (ErrorCode::LeaseConflict, EndJob),
        (ErrorCode::StateConflict, EndJob),
        (ErrorCode::ReplayMismatch, EndJob),
        (ErrorCode::AlreadyTerminal, EndJob),
        (ErrorCode::ArtifactConflict, EndJob),
        (ErrorCode::LengthRequired, EndJob),
        (ErrorCode::PayloadTooLarge, EndJob),
        (ErrorCode::UnsupportedMediaType, EndJob),
        (ErrorCode::Unavailable, Retry),
    ];
    for (code, want) in table {
        assert_eq!(disposition(code), want, "{code}");
    }
}

#[test]
fn renewal_records_advance_the_version_and_keep_only_news_of_a_stop() {
    let (_, job) = after(6);
    let answer = |v: u64, stop| Renewed {
        lease_version: c(v),
        lease_expires_at: Timestamp::parse("2026-11-30T08:00:30Z").unwrap(),
        stop,
    };
    assert_eq!(renewed(&k(), &job, &answer(2, None)), vec![Record::Renewed { job: k(), lease_version: c(2) }]);
    let cancel = Record::StopSeen { job: k(), intent: StopIntent::Cancel };
    assert_eq!(renewed(&k(), &job, &answer(2, Some(StopIntent::Cancel)))[1], cancel);
    let cancelled = with(&job, &[cancel]);
    assert_eq!(renewed(&k(), &cancelled, &answer(2, Some(StopIntent::Cancel))).len(), 1, "the same intent is no news");
    assert_eq!(renewed(&k(), &cancelled, &answer(2, Some(StopIntent::Timeout))).len(), 2, "a stronger one is");
    assert!(renewed(&k(), &job, &answer(1, None)).is_empty(), "a version that does not advance is not recorded");
}

#[test]
fn exit_records_drop_signals_the_protocol_cannot_carry() {
    let e = |signal| Ending {
        exit_code: None,
        signal,
        finished_at: Timestamp::parse("2026-11-30T08:00:00Z").unwrap(),
        log_len: 0,
        truncated: false,
    };
    let Record::Exited { signal, .. } = exited(&k(), e(Some(9))) else { panic!() };
    assert_eq!(signal, Some(9));
    let Record::Exited { signal, .. } = exited(&k(), e(Some(0))) else { panic!() };
    assert_eq!(signal, None);
}

#[test]
fn backoff_doubles_to_its_cap_with_half_jitter_and_honours_retry_after() {
    let ms = Duration::from_millis;
    let (initial, max) = (ms(100), ms(1_000));
    assert_eq!(backoff(initial, max, 1, 0, None), ms(50));
    assert_eq!(backoff(initial, max, 1, 50, None), ms(100));
    assert_eq!(backoff(initial, max, 1, 51, None), ms(50), "jitter wraps within half the wait");
    assert_eq!(backoff(initial, max, 2, 0, None), ms(100));
    assert_eq!(backoff(initial, max, 4, 0, None), ms(400));
    assert_eq!(backoff(initial, max, 5, 0, None), ms(500), "capped at max");
    assert_eq!(backoff(initial, max, u32::MAX, u64::MAX, None).max(ms(500)), backoff(initial, max, 99, u64::MAX, None));
    for random in 0..2_000 {
        let w = backoff(initial, max, 9, random, None);
        assert!(w >= ms(500) && w <= max, "{w:?}");
    }
    assert_eq!(backoff(initial, max, 1, 0, Some(ms(7_000))), ms(7_000));
    assert_eq!(backoff(initial, max, 5, 0, Some(ms(10))), ms(500));
}

#[test]
fn a_hold_doubles_from_now_and_is_spent_once_the_next_doubling_passes_the_cap() {
    let ms = Duration::from_millis;
    let (initial, max) = (ms(100), ms(400));
    let base = Instant::now();
    let mut hold = Hold::default();
    assert_eq!(hold.holds(base), None, "a fresh hold holds nothing");
    // Full waits of 100, 200, 400 ms (random 0 draws the fixed half); the fourth would be 800.
    for (n, half) in [(1, 50), (2, 100), (3, 200)] {
        assert!(!hold.spent(initial, max), "failure {n} still fits");
        let at = base + ms(10 * n);
        assert_eq!(hold.fail(initial, max, 0, at), ms(half));
        assert_eq!(hold.failures, n as u32);
        assert_eq!(hold.holds(at), Some(at + ms(half)));
        assert_eq!(hold.holds(at + ms(half)), None, "it ends at its instant");
    }
    assert!(hold.spent(initial, max), "the next doubling (800 ms) passes the cap");
    hold.failures = 0;
    assert!(!hold.spent(initial, max), "a success in between starts it over");
}

#[test]
fn a_held_lease_caps_the_backoff_at_a_sixth_of_its_ttl() {
    let ms = Duration::from_millis;
    assert_eq!(backoff_cap(ms(30_000), None), ms(30_000), "no lease, the configured cap");
    assert_eq!(backoff_cap(ms(30_000), Some(30_000)), ms(5_000));
    assert_eq!(backoff_cap(ms(2_000), Some(30_000)), ms(2_000), "a lower configured cap stays");
    assert_eq!(backoff_cap(ms(30_000), Some(60)), ms(100), "never below 100 ms");
}

#[test]
fn a_reload_drains_while_a_process_runs_in_the_agent_itself() {
    let running = Runtime { process: Process::Running, ..Runtime::default() };
    let in_agent = Runtime { in_agent: true, ..running };
    assert!(may_hand_over(true, []), "nothing runs");
    assert!(may_hand_over(true, [&running, &running]), "every process has its supervisor");
    assert!(!may_hand_over(true, [&running, &in_agent]), "one would end with the agent");
    assert!(!may_hand_over(true, [&Runtime { process: Process::Stopping, ..in_agent }]));
    // Once its process ended, what is left of it (upload, completion) is in the journal.
    assert!(may_hand_over(true, [&running, &Runtime { process: Process::Absent, ..in_agent }]));
    assert!(!may_hand_over(false, [&running]), "no supervisors here at all");
}

#[test]
fn a_held_lease_caps_a_retry_after_too() {
    let ms = Duration::from_millis;
    let cap = backoff_cap(ms(30_000), Some(30_000));
    let asked = honoured_retry_after(Some(ms(120_000)), Some(cap));
    assert_eq!(asked, Some(ms(5_000)), "a proxy's two minutes would outlive the lease");
    assert_eq!(backoff(ms(100), cap, 1, 0, asked), ms(5_000));
    assert_eq!(honoured_retry_after(Some(ms(2_000)), Some(cap)), Some(ms(2_000)), "a shorter one stands");
    assert_eq!(honoured_retry_after(Some(ms(120_000)), None), Some(ms(120_000)), "no lease: all of it");
    assert_eq!(honoured_retry_after(None, Some(cap)), None);
}

#[test]
fn remote_steps_are_exactly_the_commands() {
    let (_, job) = after(6);
    let base = t0();
    assert!(next(&k(), &job, &running(base), at(base, TTL_MS)).is_remote());
    assert!(!Step::Spawn.is_remote() && !Step::Drop.is_remote() && !Step::Wait(None).is_remote());
}

// ---- every path, simulated ----

/// What the simulated world does.
#[derive(Debug, Clone, Copy)]
struct Scenario {
    /// The spawn fails.
    spawn_fails: bool,
    /// The first renewal after this many ms of the process running delivers this intent.
    stop: Option<StopIntent>,
    /// The process exits on its own after this long.
    run_ms: u64,
    /// The agent restarts after this many steps.
    restart_after: Option<usize>,
    /// SIGTERM arrives this many ms after the start; the drain lasts 5 s.
    drain_at: Option<u64>,
    /// Every remote command's first answer is lost.
    lose_answers: bool,
}

struct Sim {
    state: JournalState,
    rt: Runtime,
    base: Instant,
    now: Instant,
    drain_by: Option<Instant>,
    exit_at: Option<(Instant, Option<i32>, Option<i32>)>,
    spawned_at: Option<Instant>,
    server_version: u64,
    trace: Vec<&'static str>,
    sent_last: Option<Step>,
}

impl Sim {
    fn new() -> Self {
        let base = t0();
        Sim {
            state: replay(&[fixtures::session("s1", 1), fixtures::offered(&k(), 3)]),
            rt: Runtime::default(),
            base,
            now: base,
            drain_by: None,
            exit_at: None,
            spawned_at: None,
            server_version: 1,
            trace: Vec::new(),
            sent_last: None,
        }
    }

    fn commit(&mut self, r: Record) {
        self.state.apply(&r).unwrap_or_else(|e| panic!("the journal refused {r:?}: {e}\ntrace {:?}", self.trace));
    }

    fn ms(&self, n: u64) -> Instant {
        self.base + Duration::from_millis(n)
    }

    fn run(mut self, s: Scenario) -> Vec<&'static str> {
        for i in 0..400 {
            if s.restart_after == Some(i) {
                // The agent dies: memory is lost; a running process becomes an orphan.
                self.rt = Runtime::resumed();
                self.trace.push("RESTART");
            }
            if let Some(d) = s.drain_at {
                if self.drain_by.is_none() && self.now >= self.ms(d) {
                    self.drain_by = Some(self.ms(d + 5_000));
                }
            }
            let Some(job) = self.state.jobs.get(&k()).cloned() else { return self.trace };
            let now = Now { at: self.now, drain_by: self.drain_by, log: POLICY };
            let step = next(&k(), &job, &self.rt, now);
            self.trace.push(kind(&step));
            if step.is_remote() {
                // The body depends on the journal alone: a compacted journal gives the same.
                let rebuilt = replay(&self.state.to_records());
                assert_eq!(next(&k(), &rebuilt.jobs[&k()], &self.rt, now), step, "compaction changed the body");
                if s.lose_answers && self.sent_last.as_ref() != Some(&step) && !matches!(step, Step::Renew(_)) {
                    // The answer is lost; the same request must come again.
                    self.sent_last = Some(step.clone());
                    continue;
                }
                self.sent_last = None;
            }
            self.apply(step, &job, &s);
        }
        panic!("no end after 400 steps: {:?}", self.trace);
    }

    fn apply(&mut self, step: Step, job: &Job, s: &Scenario) {
        let key = k();
        match step {
            Step::Claim(_) => {
                let answer = Claimed {
                    lease_generation: c(1),
                    lease_version: c(1),
                    lease_expires_at: Timestamp::parse("2026-11-30T08:00:30Z").unwrap(),
                    lease_ttl_ms: TTL_MS,
                    spec: fixtures::spec(),
                };
                self.commit(claimed(&key, &answer));
                self.rt.lease_fresh_at = Some(self.now);
            }
            Step::Renew(f) => {
                assert_eq!(f.expected_lease_version.get(), self.server_version, "renewal with a stale version");
                self.server_version += 1;
                let ran = self.spawned_at.map(|t| self.now - t);
                let stop = match (s.stop, ran) {
                    (Some(i), Some(_)) => Some(i),
                    (Some(i), None) if s.restart_after.is_some() => Some(i),
                    _ => None,
                };
                let answer = Renewed {
                    lease_version: c(self.server_version),
                    lease_expires_at: Timestamp::parse("2026-11-30T08:00:30Z").unwrap(),
                    stop,
                };
                for r in renewed(&key, job, &answer) {
                    self.commit(r);
                }
                self.rt.lease_fresh_at = Some(self.now);
                self.rt.renew_doubt = RenewDoubt::SURE;
            }
            Step::Starting(f) => {
                assert_eq!(f.expected_lease_version.get(), self.server_version);
                self.commit(Record::StartingAcked { job: key });
            }
            Step::Adopt => panic!("the simulated agent always records its spawn: {:?}", self.trace),
            Step::Spawn => {
                if !job.spawning {
                    self.commit(Record::Spawning { job: key.clone() });
                }
                if s.spawn_fails {
                    self.commit(Record::SpawnFailed { job: key, reason: Reason::summarise("no such program") });
                } else {
                    self.commit(fixtures::spawned(&key));
                    self.rt.process = Process::Running;
                    // The process prints its whole log at once.
                    self.rt.spooled = 5;
                    self.rt.timeout_at = Some(self.now + Duration::from_millis(fixtures::spec().timeout_ms));
                    self.spawned_at = Some(self.now);
                    self.exit_at = Some((self.now + Duration::from_millis(s.run_ms), Some(0), None));
                }
            }
            Step::SkipSpawn(reason) => self.commit(Record::SpawnFailed { job: key, reason }),
            Step::MintCallback => self.commit(minted(&key, token(9))),
            Step::Running(b) => {
                assert_eq!(b.expected_lease_version.get(), self.server_version);
                assert!(job.exit.is_none(), "running after the exit");
                self.commit(Record::RunningAcked { job: key });
            }
            Step::StartFailure(b) => {
                assert!(job.starting_acked && job.spawn.is_none());
                assert_eq!(b.expected_lease_version.get(), self.server_version);
                self.rt.finished = true;
            }
            Step::Recover => {
                // The orphan is found alive (if it has not exited yet) and killed.
                let signal = self.exit_at.take().map(|_| 9);
                self.commit(self.ending(None, signal));
            }
            Step::Stop(_) => {
                assert_eq!(self.rt.process, Process::Running);
                self.rt.process = Process::Stopping;
                self.exit_at = Some((self.now + Duration::from_millis(10), None, Some(15)));
            }
            Step::Wait(until) => {
                let exit = self.exit_at.filter(|_| self.rt.process != Process::Absent);
                // A signal interrupts a wait, as it does in the shell.
                let signal = s.drain_at.map(|d| self.ms(d)).filter(|_| self.drain_by.is_none());
                let wake = [until, exit.map(|e| e.0), signal].into_iter().flatten().min();
                let Some(wake) = wake else { panic!("waiting for nothing: {:?}", self.trace) };
                self.now = self.now.max(wake);
                if let Some((_, code, signal)) = exit.filter(|e| e.0 <= wake) {
                    self.exit_at = None;
                    self.rt.process = Process::Absent;
                    self.commit(self.ending(code, signal));
                }
            }
            Step::Upload(h) => {
                let exit = job.exit.as_ref().unwrap();
                assert_eq!((h.content_length, h.truncated), (exit.log_len, exit.truncated));
                assert_eq!(h.expected_lease_version.get(), self.server_version);
                let receipt = Receipt {
                    artifact_id: ArtifactId::parse(LOG_ARTIFACT_ID).unwrap(),
                    length: exit.log_len,
                    sha256: Digest::of(b""),
                    truncated: exit.truncated,
                };
                self.commit(Record::ArtifactStored { job: key, receipt });
            }
            Step::Append(h) => {
                assert_eq!(h.offset, job.log_acked, "a chunk not at the acknowledged offset");
                let have = job.exit.as_ref().map_or(self.rt.spooled, |e| e.log_len);
                assert!(h.content_length > 0 && h.end() <= have, "a chunk past the spool: {h:?}");
                assert_eq!(h.expected_lease_version.get(), self.server_version);
                self.commit(Record::LogAcked { job: key, acked: h.end() });
                self.rt.log_sent_at = Some(self.now);
            }
            Step::Seal(b) => {
                let exit = job.exit.as_ref().unwrap();
                assert_eq!((b.content_length, b.truncated), (exit.log_len, exit.truncated));
                assert_eq!(job.log_acked, exit.log_len, "a seal before the whole log was acknowledged");
                let receipt = Receipt {
                    artifact_id: ArtifactId::parse(LOG_ARTIFACT_ID).unwrap(),
                    length: exit.log_len,
                    sha256: Digest::of(b""),
                    truncated: exit.truncated,
                };
                self.commit(Record::ArtifactStored { job: key, receipt });
            }
            Step::Complete(b) => {
                assert!(job.exit.is_some() && b.artifact.is_some(), "completion without the log");
                assert_eq!(b.expected_lease_version.get(), self.server_version);
                self.rt.finished = true;
            }
            Step::Drop => self.commit(Record::Dropped { job: key }),
        }
        // Time passes a little with every step.
        self.now += Duration::from_millis(1);
    }

    fn ending(&self, code: Option<i32>, signal: Option<i32>) -> Record {
        exited(
            &k(),
            Ending {
                exit_code: code,
                signal,
                finished_at: Timestamp::parse("2026-11-30T08:00:00Z").unwrap(),
                log_len: 5,
                truncated: false,
            },
        )
    }
}

fn walk(s: Scenario) -> Vec<&'static str> {
    Sim::new().run(s)
}

fn plain() -> Scenario {
    Scenario { spawn_fails: false, stop: None, run_ms: 1_000, restart_after: None, drain_at: None, lose_answers: false }
}

/// The trace without waits, restarts and repeats, for readable expectations.
fn squeeze(trace: &[&'static str]) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for t in trace {
        if *t != "wait" && *t != "RESTART" && out.last() != Some(t) {
            out.push(t);
        }
    }
    out
}

#[test]
fn a_normal_life() {
    assert_eq!(
        squeeze(&walk(plain())),
        ["claim", "starting", "spawn", "mint", "running", "append", "seal", "complete", "drop"]
    );
}

#[test]
fn a_long_job_renews_every_third_of_the_ttl() {
    let trace = walk(Scenario { run_ms: 45_000, ..plain() });
    assert_eq!(trace.iter().filter(|t| **t == "renew").count(), 4, "{trace:?}");
}

#[test]
fn a_failed_spawn_life() {
    assert_eq!(
        squeeze(&walk(Scenario { spawn_fails: true, ..plain() })),
        ["claim", "starting", "spawn", "start-failure", "drop"]
    );
}

#[test]
fn a_cancelled_life_stops_then_completes() {
    let trace = squeeze(&walk(Scenario { stop: Some(StopIntent::Cancel), run_ms: 100_000, ..plain() }));
    assert_eq!(
        trace,
        ["claim", "starting", "spawn", "mint", "running", "append", "renew", "stop", "seal", "complete", "drop"]
    );
}

#[test]
fn a_local_timeout_stops_then_completes() {
    let trace = squeeze(&walk(Scenario { run_ms: 100_000, ..plain() }));
    // Renewals go on while the group stops: the lease must outlive the stop.
    let tail: Vec<_> = trace.iter().skip_while(|t| **t != "stop").filter(|t| **t != "renew").collect();
    assert_eq!(tail, [&"stop", &"seal", &"complete", &"drop"], "{trace:?}");
}

#[test]
fn a_drain_stops_a_long_job_and_still_completes_it() {
    let trace = squeeze(&walk(Scenario { run_ms: 100_000, drain_at: Some(1_000), ..plain() }));
    assert_eq!(trace, ["claim", "starting", "spawn", "mint", "running", "append", "stop", "seal", "complete", "drop"]);
}

#[test]
fn a_stop_after_a_restart_before_the_spawn_is_a_start_failure() {
    let trace = squeeze(&walk(Scenario { stop: Some(StopIntent::Cancel), restart_after: Some(1), ..plain() }));
    assert_eq!(trace, ["claim", "renew", "starting", "skip-spawn", "start-failure", "drop"]);
}

#[test]
fn lost_answers_repeat_the_same_request() {
    let trace = walk(Scenario { lose_answers: true, ..plain() });
    for cmd in ["claim", "starting", "running", "append", "seal", "complete"] {
        assert_eq!(trace.iter().filter(|t| **t == cmd).count(), 2, "{cmd}: {trace:?}");
    }
}

#[test]
fn every_path_ends_in_one_terminal_command_and_a_drop() {
    let mut walks = 0;
    for spawn_fails in [false, true] {
        for stop in [None, Some(StopIntent::Cancel), Some(StopIntent::Timeout)] {
            for run_ms in [5, 1_000, 45_000, 100_000] {
                for restart_after in [None].into_iter().chain((0..16).map(Some)) {
                    for drain_at in [None, Some(0), Some(2_000)] {
                        for lose_answers in [false, true] {
                            let s = Scenario { spawn_fails, stop, run_ms, restart_after, drain_at, lose_answers };
                            let trace = walk(s);
                            walks += 1;
                            let t = squeeze(&trace);
                            assert_eq!(t.last(), Some(&"drop"), "{s:?}: {trace:?}");
                            let terminal: Vec<_> =
                                t.iter().filter(|x| matches!(**x, "complete" | "start-failure")).collect();
                            assert_eq!(terminal.len(), 1, "{s:?}: {trace:?}");
                            let spawned = t.contains(&"mint");
                            assert_eq!(spawned, t.contains(&"complete"), "{s:?}: {trace:?}");
                            if spawned {
                                let up = t.iter().position(|x| matches!(*x, "upload" | "seal")).unwrap();
                                let done = t.iter().position(|x| *x == "complete").unwrap();
                                assert!(up < done, "{s:?}: {trace:?}");
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(walks, 2 * 3 * 4 * 17 * 3 * 2);
}

/// The agent's recovery path at every byte offset of a recorded life (the journal's own
/// test covers the file; this one what the restarted agent then does): the state is that
/// of the complete records before the cut, never part of a torn one, and the first step
/// never starts a process the journal says may have started, nor presents a version the
/// journal does not hold.
#[test]
fn truncation_at_every_offset_resumes_from_the_complete_prefix_and_never_spawns_twice() {
    // A RAM disk where there is one: thousands of fsyncs cost nothing there.
    let shm = std::path::Path::new("/dev/shm");
    let root = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
    let dir = root.join(format!("ql-core-every-offset-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut journal, mut state) = crate::journal::Journal::open(&dir.join("full")).unwrap();
    let mut records = vec![fixtures::session("s1", 1)];
    records.extend(fixtures::lifecycle(&k()));
    let mut ends = Vec::new();
    for r in &records {
        journal.commit(&mut state, r).unwrap();
        ends.push(journal.len());
    }
    let bytes = std::fs::read(dir.join("full").join("journal")).unwrap();
    assert_eq!(bytes.len() as u64, *ends.last().unwrap());
    let base = t0();
    for cut in 0..=bytes.len() {
        let here = dir.join(format!("cut-{cut}"));
        std::fs::create_dir_all(&here).unwrap();
        std::fs::write(here.join("journal"), &bytes[..cut]).unwrap();
        let (_, recovered) = crate::journal::Journal::open(&here).unwrap_or_else(|e| panic!("offset {cut}: {e}"));
        let complete = ends.iter().filter(|&&end| end <= cut as u64).count();
        assert_eq!(recovered, replay(&records[..complete]), "offset {cut}");
        if let Some(job) = recovered.jobs.get(&k()) {
            let step = next(&k(), job, &Runtime::resumed(), at(base, 0));
            let may_have_started = job.spawning || job.spawn.is_some();
            assert!(!(may_have_started && step == Step::Spawn), "offset {cut}: {step:?} after {job:?}");
            let unsettled = job.spawning && job.spawn.is_none() && job.spawn_failure.is_none();
            assert!(!unsettled || matches!(step, Step::Renew(_) | Step::Adopt), "offset {cut}: {step:?}");
            let version = match &step {
                Step::Renew(f) | Step::Starting(f) => Some(f.expected_lease_version),
                Step::Upload(h) => Some(h.expected_lease_version),
                Step::Append(h) => Some(h.expected_lease_version),
                Step::Seal(b) => Some(b.expected_lease_version),
                Step::Complete(b) => Some(b.expected_lease_version),
                _ => None,
            };
            assert_eq!(version, version.and(job.lease.as_ref().map(|l| l.version)), "offset {cut}");
        }
        std::fs::remove_dir_all(&here).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn ts(ms: i64) -> Timestamp {
    Timestamp::from_millis(ms).unwrap()
}

#[test]
fn the_server_clock_moves_on_with_the_monotonic_clock() {
    let base = t0();
    let clock = ServerClock { at: base, ms: 1_000_000 };
    assert_eq!(clock.at(base), 1_000_000);
    assert_eq!(clock.at(base + Duration::from_millis(4_500)), 1_004_500);
    // An instant before the answer (never asked for, but harmless): the answer's time.
    assert_eq!(clock.at(base.checked_sub(Duration::from_secs(1)).unwrap_or(base)), 1_000_000);
}

#[test]
fn finished_at_is_the_wall_clock_unless_it_runs_ahead_of_the_server() {
    let base = t0();
    let clock = Some(ServerClock { at: base, ms: 1_000_000 });
    let later = base + Duration::from_secs(5);
    // No answer seen yet: only the wall clock is known.
    assert_eq!(evidence_time(ts(9_999_999), None, later), ts(9_999_999));
    // Behind the server or on time: the wall clock stands (the server takes the later).
    assert_eq!(evidence_time(ts(1_004_000), clock, later), ts(1_004_000));
    assert_eq!(evidence_time(ts(1_005_000), clock, later), ts(1_005_000));
    // Ahead (ten minutes, as on a router with a wrong clock): the server's time.
    assert_eq!(evidence_time(ts(1_605_000), clock, later), ts(1_005_000));
}

#[test]
fn a_held_log_waits_while_its_renewals_go_on() {
    let (_, job) = after(6);
    let base = t0();
    let until = base + Duration::from_millis(500);
    // Running, bytes waiting: no chunk before `until`, one after.
    let rt = Runtime { spooled: 1_000, log_hold: Hold { until: Some(until), failures: 1 }, ..running(base) };
    assert_eq!(next(&k(), &job, &rt, at(base, 100)), Step::Wait(Some(until)));
    assert!(matches!(next(&k(), &job, &rt, at(base, 500)), Step::Append(_)));
    // A renewal that is due goes first.
    let long = Runtime { log_hold: Hold { until: Some(base + Duration::from_millis(TTL_MS)), failures: 1 }, ..rt };
    assert!(matches!(next(&k(), &job, &long, at(base, TTL_MS / 3)), Step::Renew(_)));
    // Ended: neither the rest of the log nor the seal before `until`.
    let ended = with(&job, &[Record::LogAcked { job: k(), acked: 5 }, exited_record(Some(0), None)]);
    let held = Runtime { log_hold: Hold { until: Some(until), failures: 1 }, ..fresh(base) };
    assert_eq!(next(&k(), &ended, &held, at(base, 100)), Step::Wait(Some(until)));
    let all = with(&ended, &[Record::LogAcked { job: k(), acked: 12 }]);
    assert_eq!(next(&k(), &all, &held, at(base, 100)), Step::Wait(Some(until)));
    assert!(matches!(next(&k(), &all, &held, at(base, 500)), Step::Seal(_)));
    assert!(matches!(next(&k(), &all, &long, at(base, TTL_MS / 3)), Step::Renew(_)));
}

#[test]
fn a_log_offset_conflict_at_the_offset_held_moves_nothing() {
    assert!(!conflict_moves(4_096, 4_096), "the length the journal holds: no answer, back off");
    assert!(conflict_moves(4_096, 8_192), "the server holds more: go on from there");
    assert!(conflict_moves(4_096, 0), "the server lost bytes: complete without a log");
}
