//! The identity scenarios of the store contract: admission of every request against the
//! worker's switches and the certificate's record, revocation and disabling ending what
//! a worker holds in one transaction, and one-time enrolment tokens.

use ql_control::core::{Access, AccessChanged, Command, Issuer, Reply, WORKER_DISABLED, WORKER_REVOKED};
use ql_control::model::{AttemptStatus, AuditRecord, Certificate, RunStatus, SessionState};
use ql_control::store::Store;
use ql_wire::capability::Token;
use ql_wire::ErrorCode;

use super::*;

fn cert(w: &str, serial: &str) -> Certificate {
    Certificate {
        serial: serial.into(),
        worker: worker(w),
        issued_at: 0,
        not_after: i64::MAX / 2,
        revoked_at: None,
        renewed_from: None,
    }
}

async fn admit<S: Store>(store: &S, w: &str, serial: &str) -> Option<ErrorCode> {
    let record =
        AuditRecord { at: 0, principal: Some(worker(w)), route: "session.open".into(), outcome: String::new() };
    store.admit(record, serial.into()).await.expect("the store is available")
}

async fn last_outcome<S: Store>(store: &S) -> String {
    store.audits().await.unwrap().pop().map(|a| a.outcome).unwrap_or_default()
}

/// A request is admitted while its worker is enabled and its certificate unrevoked; the
/// audit record says which way it went. An unrecorded certificate (issued before they
/// were recorded) is admitted until its worker is revoked whole, a recorded one issued
/// after that revocation is admitted again.
pub async fn admission_follows_the_worker_and_its_certificates<B: Backend>(b: B) {
    let store = b.store();
    let replica = b.other_process();
    assert_eq!(admit(&store, "router-1", "0a").await, None, "an unrecorded certificate, never revoked");
    assert!(store.audits().await.unwrap().is_empty(), "an admission goes on record with its request's command");
    exec(&store, Command::RecordCertificate(cert("router-1", "01"), Issuer::Operator)).await.unwrap();
    assert_eq!(admit(&store, "router-1", "01").await, None);

    exec(&replica, Command::SetAccess(worker("router-1"), Access::Disable)).await.unwrap();
    assert_eq!(admit(&store, "router-1", "01").await, Some(ErrorCode::WorkerDisabled), "seen by the other process");
    assert_eq!(last_outcome(&store).await, "worker_disabled");
    assert_eq!(admit(&store, "router-2", "0b").await, None, "another worker is not touched");
    exec(&store, Command::SetAccess(worker("router-1"), Access::Enable)).await.unwrap();
    assert_eq!(admit(&store, "router-1", "01").await, None);

    exec(&store, Command::RevokeCertificate(worker("router-1"), "01".into(), false)).await.unwrap();
    assert_eq!(admit(&store, "router-1", "01").await, Some(ErrorCode::CertificateRevoked));
    assert_eq!(last_outcome(&store).await, "certificate_revoked");
    assert_eq!(admit(&store, "router-1", "0a").await, None, "one certificate revoked alone");
    refused(
        &store,
        Command::RevokeCertificate(worker("router-2"), "01".into(), true),
        ErrorCode::NotFound,
        "another worker's serial",
    )
    .await;

    exec(&store, Command::SetAccess(worker("router-1"), Access::Revoke)).await.unwrap();
    assert_eq!(
        admit(&store, "router-1", "0a").await,
        Some(ErrorCode::CertificateRevoked),
        "unrecorded, after a revoke"
    );
    exec(&store, Command::RecordCertificate(cert("router-1", "02"), Issuer::Operator)).await.unwrap();
    assert_eq!(admit(&store, "router-1", "02").await, None, "enrolled again");
    // A certificate recorded for another worker never speaks for this one.
    exec(&store, Command::RecordCertificate(cert("router-2", "03"), Issuer::Operator)).await.unwrap();
    assert_eq!(admit(&store, "router-1", "03").await, Some(ErrorCode::CertificateRevoked));
    refused(
        &store,
        Command::RecordCertificate(cert("router-1", "02"), Issuer::Operator),
        ErrorCode::StateConflict,
        "a serial recorded twice",
    )
    .await;
    // A renewal admitted before a revocation, recorded after it, is refused then.
    let renewal = |serial: &str, presented: &str| {
        Command::RecordCertificate(cert("router-1", serial), Issuer::Worker(presented.into()))
    };
    assert!(exec(&store, renewal("05", "02")).await.is_ok(), "a renewal by an admitted certificate");
    exec(&store, Command::RevokeCertificate(worker("router-1"), "05".into(), false)).await.unwrap();
    refused(&store, renewal("06", "05"), ErrorCode::CertificateRevoked, "a renewal by a certificate revoked meanwhile")
        .await;
    exec(&store, Command::SetAccess(worker("router-1"), Access::Revoke)).await.unwrap();
    refused(&store, renewal("07", "02"), ErrorCode::CertificateRevoked, "a renewal after the worker was revoked").await;
}

/// Revoking a certificate alone leaves what was renewed from it; with its renewals, it
/// revokes every certificate renewed from it, however many renewals down, and nothing
/// else, and again changes nothing more. Each record names what it was renewed from.
pub async fn revoking_a_certificate_revokes_what_was_renewed_from_it<B: Backend>(b: B) {
    let store = b.store();
    let renewal =
        |serial: &str, from: &str| Command::RecordCertificate(cert("router-1", serial), Issuer::Worker(from.into()));
    exec(&store, Command::RecordCertificate(cert("router-1", "10"), Issuer::Operator)).await.unwrap();
    exec(&store, Command::RecordCertificate(cert("router-1", "14"), Issuer::Operator)).await.unwrap();
    exec(&store, Command::RecordCertificate(cert("router-2", "20"), Issuer::Operator)).await.unwrap();
    for (serial, from) in [("11", "10"), ("12", "11"), ("13", "10")] {
        exec(&store, renewal(serial, from)).await.unwrap();
        b.advance(RENEW_INTERVAL_MS as i64);
    }
    let lineage = |all: &[Certificate]| -> Vec<(String, Option<String>, bool)> {
        all.iter().map(|c| (c.serial.clone(), c.renewed_from.clone(), c.revoked_at.is_some())).collect()
    };
    let mut before = lineage(&store.certificates(None, None, 100).await.unwrap());
    before.sort();
    let from = |s: &str| Some(s.to_owned());
    assert_eq!(
        before,
        [
            ("10".into(), None, false),
            ("11".into(), from("10"), false),
            ("12".into(), from("11"), false),
            ("13".into(), from("10"), false),
            ("14".into(), None, false),
            ("20".into(), None, false),
        ]
    );

    // Alone: an old certificate retired after a rotation, the one renewed from it serves.
    let reply = exec(&store, Command::RevokeCertificate(worker("router-1"), "11".into(), false)).await.unwrap();
    assert!(
        matches!(&reply, Reply::CertificateRevoked(c, 0) if c.serial == "11" && c.revoked_at.is_some()),
        "{reply:?}"
    );
    assert_eq!(admit(&store, "router-1", "11").await, Some(ErrorCode::CertificateRevoked));
    assert_eq!(admit(&store, "router-1", "12").await, None, "renewed from 11, revoked alone");
    // Again with its renewals: 12 goes too.
    let reply = exec(&store, Command::RevokeCertificate(worker("router-1"), "11".into(), true)).await.unwrap();
    assert!(matches!(&reply, Reply::CertificateRevoked(c, 1) if c.serial == "11"), "{reply:?}");
    let refusals = [("10", false), ("11", true), ("12", true), ("13", false), ("14", false)];
    for (serial, refused) in refusals {
        assert_eq!(admit(&store, "router-1", serial).await.is_some(), refused, "{serial} after revoking 11's line");
    }
    let reply = exec(&store, Command::RevokeCertificate(worker("router-1"), "10".into(), true)).await.unwrap();
    assert!(matches!(&reply, Reply::CertificateRevoked(c, 1) if c.serial == "10"), "13 only: {reply:?}");
    for (serial, refused) in [("10", true), ("13", true), ("14", false)] {
        assert_eq!(admit(&store, "router-1", serial).await.is_some(), refused, "{serial} after revoking 10's line");
    }
    assert_eq!(admit(&store, "router-2", "20").await, None, "another worker's certificate");

    let after = store.certificates(None, None, 100).await.unwrap();
    let reply = exec(&store, Command::RevokeCertificate(worker("router-1"), "10".into(), true)).await.unwrap();
    assert!(matches!(&reply, Reply::CertificateRevoked(c, 0) if c.serial == "10"), "{reply:?}");
    assert_eq!(store.certificates(None, None, 100).await.unwrap(), after, "a repeat changes nothing");
}

/// A worker renews at most once an interval, whichever of its certificates asks: a second
/// renewal within it, down the line or beside it, is refused and records nothing (the
/// agent's old certificate serves on). Other workers, and the operator, are not held back.
pub async fn a_worker_renews_at_most_once_an_interval<B: Backend>(b: B) {
    let store = b.store();
    let renewal =
        |w: &str, serial: &str, from: &str| Command::RecordCertificate(cert(w, serial), Issuer::Worker(from.into()));
    exec(&store, Command::RecordCertificate(cert("router-1", "30"), Issuer::Operator)).await.unwrap();
    exec(&store, Command::RecordCertificate(cert("router-2", "40"), Issuer::Operator)).await.unwrap();
    exec(&store, renewal("router-1", "31", "30")).await.unwrap();
    refused(&store, renewal("router-1", "32", "31"), ErrorCode::StateConflict, "the renewed one, at once").await;
    refused(&store, renewal("router-1", "32", "30"), ErrorCode::StateConflict, "the old one again, at once").await;
    exec(&store, renewal("router-2", "41", "40")).await.expect("another worker renews meanwhile");
    exec(&store, Command::RecordCertificate(cert("router-1", "33"), Issuer::Operator))
        .await
        .expect("the operator issues whenever asked");

    // The test moves DB time on by half an interval: the real time the test takes is far
    // less than the other half.
    b.advance(RENEW_INTERVAL_MS as i64 / 2);
    refused(&store, renewal("router-1", "32", "31"), ErrorCode::StateConflict, "half an interval on").await;
    b.advance(RENEW_INTERVAL_MS as i64 / 2);
    exec(&store, renewal("router-1", "32", "31")).await.expect("an interval later");
    let mut lines: Vec<(String, Option<String>)> =
        store.certificates(None, None, 100).await.unwrap().into_iter().map(|c| (c.serial, c.renewed_from)).collect();
    lines.sort();
    let from = |s: &str| Some(s.to_owned());
    let want = [("30", None), ("31", from("30")), ("32", from("31")), ("33", None), ("40", None), ("41", from("40"))];
    assert_eq!(lines, want.map(|(s, f)| (s.to_owned(), f)));
}

/// Revoking a worker closes its sessions, loses its running attempt and its open offer at
/// once and queues their runs again (the running one spending a retry, the offered one
/// not), all in one transaction; another worker then takes both.
pub async fn revoking_a_worker_ends_what_it_holds_and_requeues_its_runs<B: Backend>(b: B) {
    let store = b.store();
    let running_run = submit(&store, LONG_TIMEOUT_MS, 1).await;
    let offered_run = submit(&store, LONG_TIMEOUT_MS, 0).await;
    let agent = open_with(&store, "router-1", 2, &[]).await;
    let offers = poll(&store, &agent).await;
    assert_eq!(offers.len(), 2);
    let running = offers.iter().find(|o| o.run_id == running_run).unwrap().clone();
    let h = claim(&store, &agent, &running).await;
    to_running(&store, &h).await;
    exec(&store, Command::RecordCertificate(cert("router-1", "11"), Issuer::Operator)).await.unwrap();

    let reply = exec(&store, Command::SetAccess(worker("router-1"), Access::Revoke)).await;
    assert_eq!(
        reply,
        Ok(Reply::AccessChanged(AccessChanged { sessions: 1, attempts: 2, certificates: 1, unknown: false }))
    );
    let snap = store.snapshot().await.unwrap();
    assert_eq!(snap.sessions.iter().find(|s| s.id == agent.session).unwrap().state, SessionState::Closed);
    let d = detail(&store, &running_run).await;
    assert_eq!((d.run.status, d.run.retries_used), (RunStatus::Queued, 1));
    assert_eq!(
        (d.attempts[0].status, d.attempts[0].error_code.as_deref()),
        (AttemptStatus::Lost, Some(WORKER_REVOKED))
    );
    assert!(kinds(&d).ends_with(&["attempt.lost", "run.queued"]));
    let d = detail(&store, &offered_run).await;
    assert_eq!((d.run.status, d.run.retries_used), (RunStatus::Queued, 0));
    assert_eq!(d.attempts[0].error_code.as_deref(), Some(WORKER_REVOKED));
    assert!(snap.certificates.iter().all(|c| c.revoked_at.is_some()));
    refused(&store, h.renew(), ErrorCode::SessionConflict, "the revoked agent's renewal").await;

    let other = open_with(&store, "router-2", 2, &[]).await;
    assert_eq!(poll(&store, &other).await.len(), 2, "another worker takes both runs");
    check_invariants(&store.snapshot().await.unwrap());
}

/// Disabling does the same with its own code, and a repeat ends nothing more.
pub async fn disabling_a_worker_requeues_its_runs_and_a_repeat_changes_nothing_more<B: Backend>(b: B) {
    let store = b.store();
    let h = claimed_run(&store, "router-1", LONG_TIMEOUT_MS, 1).await;
    let run = h.run().clone();
    to_running(&store, &h).await;
    exec(&store, Command::SetAccess(worker("router-1"), Access::Disable)).await.unwrap();
    let d = detail(&store, &run).await;
    assert_eq!(d.run.status, RunStatus::Queued, "lost through no fault of the job: not failed");
    assert_eq!(d.attempts[0].error_code.as_deref(), Some(WORKER_DISABLED));
    let before = store.snapshot().await.unwrap();
    let again = exec(&store, Command::SetAccess(worker("router-1"), Access::Disable)).await;
    assert_eq!(again, Ok(Reply::AccessChanged(AccessChanged::default())));
    let after = store.snapshot().await.unwrap();
    assert_eq!((&before.sessions, &before.runs, &before.events), (&after.sessions, &after.runs, &after.events));
    check_invariants(&after);
}

/// A token is spent once, on its own worker, before it expires; every other use is
/// refused and stores nothing.
pub async fn an_enrolment_token_is_spent_once<B: Backend>(b: B) {
    let store = b.store();
    let token = Token::generate().unwrap();
    let digest = token.digest();
    exec(&store, Command::CreateEnrolment(worker("router-1"), digest.clone(), 60_000)).await.unwrap();
    refused(
        &store,
        Command::Enrol(digest.clone(), cert("router-2", "21")),
        ErrorCode::EnrolmentRefused,
        "a token for another worker",
    )
    .await;
    refused(
        &store,
        Command::Enrol(Token::generate().unwrap().digest(), cert("router-1", "21")),
        ErrorCode::EnrolmentRefused,
        "an unknown token",
    )
    .await;
    let reply = exec(&store, Command::Enrol(digest.clone(), cert("router-1", "21"))).await;
    assert!(matches!(reply, Ok(Reply::CertificateRecorded(c)) if c.serial == "21"));
    let snap = store.snapshot().await.unwrap();
    assert_eq!(snap.enrolments[0].serial.as_deref(), Some("21"));
    assert!(snap.enrolments[0].used_at.is_some());
    refused(&store, Command::Enrol(digest, cert("router-1", "22")), ErrorCode::EnrolmentRefused, "a reused token")
        .await;

    // A token minted before its worker was disabled died with the access it would have
    // given; one minted while it is disabled gives none; one whose certificate's serial is
    // recorded already neither. Each is refused and stores nothing.
    let before = Token::generate().unwrap();
    exec(&store, Command::CreateEnrolment(worker("router-4"), before.digest(), 60_000)).await.unwrap();
    exec(&store, Command::SetAccess(worker("router-4"), Access::Disable)).await.unwrap();
    let why = "a token of a worker disabled since";
    refused(&store, Command::Enrol(before.digest(), cert("router-4", "24")), ErrorCode::EnrolmentRefused, why).await;
    let disabled = Token::generate().unwrap();
    exec(&store, Command::CreateEnrolment(worker("router-4"), disabled.digest(), 60_000)).await.unwrap();
    let why = "a token of a disabled worker";
    refused(&store, Command::Enrol(disabled.digest(), cert("router-4", "24")), ErrorCode::WorkerDisabled, why).await;
    let again = Token::generate().unwrap();
    exec(&store, Command::CreateEnrolment(worker("router-1"), again.digest(), 60_000)).await.unwrap();
    let why = "a serial recorded already";
    refused(&store, Command::Enrol(again.digest(), cert("router-1", "21")), ErrorCode::StateConflict, why).await;

    let short = Token::generate().unwrap();
    exec(&store, Command::CreateEnrolment(worker("router-3"), short.digest(), 1_000)).await.unwrap();
    b.advance(1_000);
    refused(&store, Command::Enrol(short.digest(), cert("router-3", "23")), ErrorCode::EnrolmentRefused, "expired")
        .await;
    let texts = b.all_text().await;
    let raw = [&token, &short, &before, &disabled, &again].map(|t| t.expose().to_owned());
    assert!(!texts.iter().any(|t| raw.iter().any(|r| t.contains(r.as_str()))), "no raw token stored");
}

/// The workers' pages: every worker the store knows — by a session, a record (labels) or
/// a certificate — once, by id, after the last of the page before, each with its newest
/// session.
pub async fn the_worker_page_lists_each_known_worker_once_by_id<B: Backend>(b: B) {
    let store = b.store();
    open(&store, "s-2").await;
    let newest = open(&store, "s-2").await;
    open(&store, "s-0").await;
    exec(&store, Command::RecordCertificate(cert("c-1", "01"), Issuer::Operator)).await.unwrap();
    exec(&store, Command::RecordCertificate(cert("c-1", "02"), Issuer::Operator)).await.unwrap();
    exec(&store, Command::RecordCertificate(cert("s-0", "03"), Issuer::Operator)).await.unwrap();
    let labels = std::collections::BTreeMap::from([("site".to_owned(), "attic".to_owned())]);
    exec(&store, Command::LabelWorker(worker("l-3"), labels.clone())).await.unwrap();
    exec(&store, Command::LabelWorker(worker("s-2"), labels)).await.unwrap();

    let all = page(&store, None, 10).await;
    let ids: Vec<&str> = all.iter().map(|(w, _)| w.as_str()).collect();
    assert_eq!(ids, ["c-1", "l-3", "s-0", "s-2"], "each once, by id");
    assert_eq!(all[3].1.as_ref(), Some(&newest.session), "the newest of its sessions");
    assert!(all[0].1.is_none() && all[1].1.is_none() && all[2].1.is_some());
    assert_eq!(page(&store, None, 2).await, all[..2].to_vec());
    assert_eq!(page(&store, Some("l-3"), 2).await, all[2..].to_vec());
    assert_eq!(page(&store, Some("s-2"), 2).await, vec![], "nothing after the last");
    assert_eq!(page(&store, Some("a"), 1).await, all[..1].to_vec(), "after any text, not only a known id");

    // Each with its own rows: its record and its certificates, newest first.
    let entries = store.worker_page(None, 10).await.unwrap();
    let serials = |i: usize| entries[i].certificates.iter().map(|c| c.serial.as_str()).collect::<Vec<_>>();
    assert_eq!((serials(0), serials(1), serials(2), serials(3)), (vec!["02", "01"], vec![], vec!["03"], vec![]));
    let labelled = |i: usize| entries[i].record.as_ref().map(|r| r.labels.len());
    assert_eq!((labelled(0), labelled(1), labelled(2), labelled(3)), (None, Some(1), None, Some(1)));
}

/// The certificates' pages: by worker, then newest first (the serial breaking a tie),
/// each once across pages of any size, after the certificate the cursor names; one
/// worker's alone; nothing after a serial no certificate has.
pub async fn the_certificate_pages_list_each_once_by_worker_newest_first<B: Backend>(b: B) {
    let store = b.store();
    // Recorded at DB time: three moments, the last two of `a`'s at the same one.
    for batch in
        [[("a", "0a"), ("c", "10")].as_slice(), &[("c", "11"), ("b", "ff"), ("a", "01")], &[("a", "0b"), ("a", "0c")]]
    {
        for (w, serial) in batch {
            exec(&store, Command::RecordCertificate(cert(w, serial), Issuer::Operator)).await.unwrap();
        }
        b.advance(1_000);
    }
    let serials = |page: Vec<Certificate>| page.into_iter().map(|c| c.serial).collect::<Vec<_>>();
    let all = serials(store.certificates(None, None, 100).await.unwrap());
    assert_eq!(all, ["0c", "0b", "01", "0a", "ff", "11", "10"]);
    for size in 1..=all.len() {
        let (mut seen, mut after) = (Vec::new(), None::<String>);
        loop {
            let page = serials(store.certificates(None, after.as_deref(), size).await.unwrap());
            assert!(page.len() <= size);
            if page.is_empty() {
                break;
            }
            after = page.last().cloned();
            seen.extend(page);
        }
        assert_eq!(seen, all, "pages of {size}");
    }
    let c = worker("c");
    assert_eq!(serials(store.certificates(Some(&c), None, 100).await.unwrap()), ["11", "10"]);
    assert_eq!(serials(store.certificates(Some(&c), Some("11"), 100).await.unwrap()), ["10"]);
    assert_eq!(serials(store.certificates(Some(&worker("d")), None, 100).await.unwrap()), Vec::<String>::new());
    assert_eq!(serials(store.certificates(None, Some("dead"), 100).await.unwrap()), Vec::<String>::new());
}

/// A worker page's ids, each with its session's id.
async fn page<S: Store>(
    store: &S,
    after: Option<&str>,
    limit: usize,
) -> Vec<(String, Option<ql_wire::ids::SessionId>)> {
    let after = after.map(worker);
    let found = store.worker_page(after.as_ref(), limit).await.unwrap();
    found.into_iter().map(|w| (w.id.as_str().to_owned(), w.session.map(|s| s.id))).collect()
}
