//! A worker identity's life: which requests are admitted, what disabling or revoking a
//! worker does to its sessions and its work, and the record of every certificate issued,
//! by an operator or over an enrolment token.
//!
//! A request is admitted ([`admission`]) while its worker is not disabled and its
//! certificate is not revoked. A certificate the authority has no record of (issued
//! before certificates were recorded) is admitted only until its worker is first revoked
//! whole; from then on only recorded certificates can speak for it, so a stolen
//! unrecorded one is never let back in by a later enrolment.
//!
//! Disabling or revoking a worker ends what it holds in the same transaction: its live
//! sessions close, its leased attempts are lost at once and their runs queued again
//! within their retry budget (never left to run out a lease), and its open offers lapse
//! (the run is queued again without spending its budget). The events name why
//! ([`WORKER_REVOKED`], [`WORKER_DISABLED`]).

use std::collections::{HashMap, HashSet};

use ql_wire::capability::Digest;
use ql_wire::ids::WorkerId;
use ql_wire::ErrorCode;

use super::sweep::{lost_lease, lost_offer};
use super::{Decision, IdGen, Reply, Rows, Write};
use crate::model::{Certificate, Enrolment, LeaseState, Millis, OfferState, Session, SessionState, Worker};

/// Error code of an attempt lost because the operator revoked its worker.
pub const WORKER_REVOKED: &str = "WORKER_REVOKED";
/// Error code of an attempt lost because the operator disabled its worker.
pub const WORKER_DISABLED: &str = "WORKER_DISABLED";

/// What an operator does to a worker identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Refuse every certificate of the worker until it is enabled again.
    Disable,
    /// Admit the worker's certificates again (revoked ones stay revoked).
    Enable,
    /// Revoke every certificate of the worker issued so far, recorded or not.
    Revoke,
}

/// Who asks for a certificate to be recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Issuer {
    /// An operator on the control machine (`ql-control enroll`).
    Operator,
    /// The worker itself, renewing over its own connection with the certificate of this
    /// serial, which must still be admitted when the new one is recorded.
    Worker(String),
}

/// What disabling or revoking a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AccessChanged {
    /// Sessions closed.
    pub sessions: usize,
    /// Attempts lost (leased or offered).
    pub attempts: usize,
    /// Certificates revoked.
    pub certificates: usize,
    /// Nothing named the worker before: no record, session, certificate or token (a
    /// mistyped name, most likely; or a worker whose certificate predates the records and
    /// that never came, which this still blocks).
    pub unknown: bool,
}

/// Whether a request of `principal` presenting the certificate `serial` (its record, if
/// the authority has one) is admitted.
pub fn admission(
    principal: &WorkerId,
    worker: Option<&Worker>,
    cert: Option<&Certificate>,
    now: Millis,
) -> Result<(), ErrorCode> {
    if worker.is_some_and(|w| w.disabled_at.is_some()) {
        return Err(ErrorCode::WorkerDisabled);
    }
    match cert {
        Some(c) if c.revoked_at.is_some() || &c.worker != principal => Err(ErrorCode::CertificateRevoked),
        Some(c) if c.not_after <= now => Err(ErrorCode::Unauthenticated),
        Some(_) => Ok(()),
        None if worker.is_some_and(|w| w.revoked_at.is_some()) => Err(ErrorCode::CertificateRevoked),
        None => Ok(()),
    }
}

/// Disables, enables or revokes `worker` (see the module doc).
pub(super) fn set_access(worker: &WorkerId, access: Access, rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let known = rows.worker.as_ref().is_some_and(|w| &w.id == worker)
        || rows.worker_sessions.iter().any(|s| &s.worker == worker)
        || rows.certificates.iter().any(|c| &c.worker == worker)
        || rows.enrolments.iter().any(|e| &e.worker == worker);
    let record = rows.worker.clone().filter(|w| &w.id == worker).unwrap_or_else(|| Worker::new(worker.clone(), now));
    let mut changed = AccessChanged { unknown: !known && access != Access::Enable, ..AccessChanged::default() };
    let (updated, code) = match access {
        Access::Enable => {
            if record.disabled_at.is_none() {
                return Decision::answer(Reply::AccessChanged(changed));
            }
            let enabled = Worker { disabled_at: None, updated_at: now, ..record };
            // Runs its sessions could take may be placed again once it comes back.
            return Decision::apply(Reply::AccessChanged(changed), vec![Write::Worker(enabled)]).waking();
        }
        Access::Disable => {
            (Worker { disabled_at: record.disabled_at.or(Some(now)), updated_at: now, ..record }, WORKER_DISABLED)
        }
        Access::Revoke => (Worker { revoked_at: Some(now), updated_at: now, ..record }, WORKER_REVOKED),
    };
    let mut writes = vec![Write::Worker(updated)];
    if access == Access::Revoke {
        for cert in rows.certificates.iter().filter(|c| &c.worker == worker && c.revoked_at.is_none()) {
            writes.push(Write::Certificate(Certificate { revoked_at: Some(now), ..cert.clone() }));
            changed.certificates += 1;
        }
    }
    // Tokens not yet spent die with the access they would have given.
    for e in rows.enrolments.iter().filter(|e| &e.worker == worker && e.used_at.is_none() && e.expires_at > now) {
        writes.push(Write::Enrolment(Enrolment { expires_at: now, ..e.clone() }));
    }
    let live = |s: &&Session| &s.worker == worker && matches!(s.state, SessionState::Online | SessionState::Draining);
    for s in rows.worker_sessions.iter().filter(live) {
        writes.push(Write::Session(Session {
            state: SessionState::Closed,
            seen_at: now,
            expires_at: now,
            ..s.clone()
        }));
        changed.sessions += 1;
    }
    let summary = match access {
        Access::Revoke => "the operator revoked the worker",
        _ => "the operator disabled the worker",
    };
    for (lease, run, attempt) in &rows.worker_work.leases {
        if lease.state == LeaseState::Leased && &attempt.worker == worker && !run.status.is_terminal() {
            writes.extend(lost_lease(lease, run, attempt, code, Some(summary), now, ids));
            changed.attempts += 1;
        }
    }
    for (offer, run, attempt) in &rows.worker_work.offers {
        if offer.state == OfferState::Open && &offer.worker == worker && !run.status.is_terminal() {
            writes.extend(lost_offer(offer, run, attempt, code, now, ids));
            changed.attempts += 1;
        }
    }
    Decision::apply(Reply::AccessChanged(changed), writes).waking()
}

/// Revokes one certificate by serial, and with `renewals` every certificate renewed from
/// it, however many renewals down (`rows.certificates`, the worker's): whoever holds a
/// copy may have renewed it before it was revoked. Without, an old certificate is retired
/// after a rotation and the one renewed from it serves on. Its worker's sessions stay:
/// another certificate of the worker (a rotated one) may hold them, and the revoked are
/// refused from their next request on. Revoking a revoked one again with `renewals`
/// revokes what was renewed from it since.
pub(super) fn revoke_certificate(
    worker: &WorkerId,
    serial: &str,
    renewals: bool,
    rows: &Rows,
    now: Millis,
) -> Decision {
    let Some(c) = rows.certificate.as_ref().filter(|c| c.serial == serial && &c.worker == worker) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    let revoke = |c: &Certificate| Certificate { revoked_at: c.revoked_at.or(Some(now)), ..c.clone() };
    let mut writes: Vec<Write> = c.revoked_at.is_none().then(|| Write::Certificate(revoke(c))).into_iter().collect();
    // Each certificate's renewals, looked up rather than searched for: a worker may have
    // renewed many times (a thief's copy in a loop), and revoking must stay linear in them.
    let mut renewed: HashMap<&str, Vec<&Certificate>> = HashMap::new();
    for d in rows.certificates.iter().filter(|d| renewals && &d.worker == worker) {
        if let Some(parent) = d.renewed_from.as_deref() {
            renewed.entry(parent).or_default().push(d);
        }
    }
    let mut line: Vec<&str> = vec![&c.serial];
    let mut seen: HashSet<&str> = HashSet::from([c.serial.as_str()]);
    let mut descendants = 0;
    let mut next = 0;
    while let Some(&parent) = line.get(next) {
        next += 1;
        for d in renewed.get(parent).into_iter().flatten() {
            if !seen.insert(&d.serial) {
                continue;
            }
            line.push(&d.serial);
            if d.revoked_at.is_none() {
                writes.push(Write::Certificate(revoke(d)));
                descendants += 1;
            }
        }
    }
    Decision::apply(Reply::CertificateRevoked(Box::new(revoke(c)), descendants), writes)
}

/// Records a certificate just issued (`issued_at` becomes DB time). A worker renewing
/// its own is admitted again here, in the transaction that records the new one (and, on
/// PostgreSQL, under the worker's lock that revoking takes too): its request was admitted
/// before its body arrived, and a revocation meanwhile must win.
///
/// A worker renews at most once per `interval_ms` ([`renew_interval`]): each renewal is a
/// row kept for as long as its line may be revoked, and a worker renewing in a loop, or
/// one certificate over and over, would add them without end. The agent renews two thirds
/// of the way through a lifetime, so it meets this only when it did not install what it
/// renewed (a lost answer, a crash, a backup restored) or another holds its identity; it
/// retries with its old certificate, which serves meanwhile.
pub(super) fn record_certificate(
    cert: &Certificate,
    issuer: &Issuer,
    rows: &Rows,
    now: Millis,
    interval_ms: u64,
) -> Decision {
    if let Issuer::Worker(_) = issuer {
        let worker = rows.worker.as_ref().filter(|w| w.id == cert.worker);
        let presented = rows.presented.as_ref();
        if let Err(code) = admission(&cert.worker, worker, presented, now) {
            return Decision::refuse(code);
        }
        let life = |c: &Certificate| c.not_after.saturating_sub(now).max(0).unsigned_abs();
        let mut interval = renew_interval(interval_ms, life(cert));
        // A certificate presented with less life left than a lifetime's third (the
        // lifetime was raised since it was issued) still renews before it expires.
        if let Some(presented) = &rows.presented {
            interval = interval.min(life(presented) / 2);
        }
        // Since the last renewal by DB time: one recorded in the future (the clock went
        // back) holds nothing back.
        let since = rows.last_renewal.map(|at| now.saturating_sub(at));
        if since.is_some_and(|since| (0..i64::try_from(interval).unwrap_or(i64::MAX)).contains(&since)) {
            return Decision::refuse(ErrorCode::StateConflict);
        }
    }
    if rows.certificate.is_some() {
        // A serial is 16 random bytes: a repeat is a replay or a bug, never a new one.
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let renewed_from = match issuer {
        Issuer::Worker(serial) => Some(serial.clone()),
        Issuer::Operator => None,
    };
    let recorded = Certificate { issued_at: now, revoked_at: None, renewed_from, ..cert.clone() };
    Decision::apply(Reply::CertificateRecorded(Box::new(recorded.clone())), vec![Write::Certificate(recorded)])
}

/// The least time between two renewals of one worker: `interval_ms`, or a sixth of a
/// certificate's lifetime if that is shorter, so that an agent whose renewal was refused
/// two thirds of the way through its certificate's life still renews well before it
/// expires.
pub(crate) fn renew_interval(interval_ms: u64, lifetime_ms: u64) -> u64 {
    interval_ms.min(lifetime_ms / 6)
}

/// Records a one-time enrolment token (its digest) for `worker`, valid for `ttl_ms`.
pub(super) fn create_enrolment(worker: &WorkerId, digest: &Digest, ttl_ms: u64, rows: &Rows, now: Millis) -> Decision {
    if rows.enrolment.is_some() {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let enrolment = Enrolment {
        token_digest: digest.clone(),
        worker: worker.clone(),
        created_at: now,
        expires_at: now.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX)),
        used_at: None,
        serial: None,
    };
    Decision::apply(Reply::EnrolmentCreated(enrolment.expires_at), vec![Write::Enrolment(enrolment)])
}

/// Spends an enrolment token on `cert`: the token must be known, for this worker, unspent
/// and unexpired by DB time, and the worker not disabled. Every refusal is the same code,
/// so a caller learns nothing about which tokens exist.
pub(super) fn enrol(digest: &Digest, cert: &Certificate, rows: &Rows, now: Millis) -> Decision {
    let Some(enrolment) = rows.enrolment.as_ref().filter(|e| e.token_digest.ct_eq(digest)) else {
        return Decision::refuse(ErrorCode::EnrolmentRefused);
    };
    if enrolment.worker != cert.worker || enrolment.used_at.is_some() || enrolment.expires_at <= now {
        return Decision::refuse(ErrorCode::EnrolmentRefused);
    }
    if rows.worker.as_ref().is_some_and(|w| w.id == cert.worker && w.disabled_at.is_some()) {
        return Decision::refuse(ErrorCode::WorkerDisabled);
    }
    if rows.certificate.is_some() {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let spent = Enrolment { used_at: Some(now), serial: Some(cert.serial.clone()), ..enrolment.clone() };
    let recorded = Certificate { issued_at: now, revoked_at: None, renewed_from: None, ..cert.clone() };
    Decision::apply(
        Reply::CertificateRecorded(Box::new(recorded.clone())),
        vec![Write::Enrolment(spent), Write::Certificate(recorded)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::core::{Work, Write};
    use crate::model::{AttemptStatus, RunStatus};

    fn cert(serial: &str) -> Certificate {
        Certificate {
            serial: serial.into(),
            worker: worker(),
            issued_at: NOW - 10,
            not_after: NOW + 1_000_000,
            revoked_at: None,
            renewed_from: None,
        }
    }

    fn record() -> Worker {
        Worker::new(worker(), NOW - 100)
    }

    #[test]
    fn admission_refuses_a_disabled_worker_and_revoked_certificates() {
        let w = worker();
        assert_eq!(admission(&w, None, None, NOW), Ok(()), "an unrecorded certificate of a never-revoked worker");
        assert_eq!(admission(&w, Some(&record()), Some(&cert("01")), NOW), Ok(()));
        let disabled = Worker { disabled_at: Some(NOW), ..record() };
        assert_eq!(admission(&w, Some(&disabled), Some(&cert("01")), NOW), Err(ErrorCode::WorkerDisabled));
        assert_eq!(admission(&w, Some(&disabled), None, NOW), Err(ErrorCode::WorkerDisabled));
        let revoked_cert = Certificate { revoked_at: Some(NOW), ..cert("01") };
        assert_eq!(admission(&w, Some(&record()), Some(&revoked_cert), NOW), Err(ErrorCode::CertificateRevoked));
        let revoked = Worker { revoked_at: Some(NOW), ..record() };
        assert_eq!(
            admission(&w, Some(&revoked), None, NOW),
            Err(ErrorCode::CertificateRevoked),
            "unrecorded after a revoke"
        );
        assert_eq!(admission(&w, Some(&revoked), Some(&cert("02")), NOW), Ok(()), "enrolled again after the revoke");
        let foreign = Certificate { worker: other_worker(), ..cert("03") };
        assert_eq!(admission(&w, None, Some(&foreign), NOW), Err(ErrorCode::CertificateRevoked));
        let expired = Certificate { not_after: NOW, ..cert("04") };
        assert_eq!(admission(&w, None, Some(&expired), NOW), Err(ErrorCode::Unauthenticated), "past its not-after");
    }

    fn holding(status: AttemptStatus) -> Rows {
        let mut rows = world(status);
        rows.worker_sessions = rows.session.iter().cloned().collect();
        let (run, attempt) = (rows.run.clone().unwrap(), rows.attempt.clone().unwrap());
        rows.worker_work = match status {
            AttemptStatus::Offered => {
                Work { offers: vec![(rows.offer.clone().unwrap(), run, attempt)], ..Work::default() }
            }
            _ => Work { leases: vec![(rows.lease.clone().unwrap(), run, attempt)], ..Work::default() },
        };
        rows.certificates = vec![cert("01"), Certificate { revoked_at: Some(NOW - 5), ..cert("02") }];
        rows
    }

    fn written<T: Clone>(d: &Decision, pick: fn(&Write) -> Option<&T>) -> Vec<T> {
        d.writes.iter().filter_map(pick).cloned().collect()
    }

    #[test]
    fn revoking_closes_sessions_loses_leases_and_requeues_within_budget() {
        let rows = holding(AttemptStatus::Running);
        let d = set_access(&worker(), Access::Revoke, &rows, NOW, &mut ids());
        assert_eq!(
            d.reply,
            Ok(Reply::AccessChanged(AccessChanged { sessions: 1, attempts: 1, certificates: 1, unknown: false }))
        );
        assert!(d.wake);
        let w = written(&d, |w| if let Write::Worker(x) = w { Some(x) } else { None });
        assert_eq!(w[0].revoked_at, Some(NOW));
        let certs = written(&d, |w| if let Write::Certificate(x) = w { Some(x) } else { None });
        assert_eq!(certs.iter().map(|c| (c.serial.as_str(), c.revoked_at)).collect::<Vec<_>>(), [("01", Some(NOW))]);
        let sessions = written(&d, |w| if let Write::Session(x) = w { Some(x) } else { None });
        assert_eq!(sessions[0].state, SessionState::Closed);
        let runs = written(&d, |w| if let Write::Run(x) = w { Some(x) } else { None });
        assert_eq!((runs[0].status, runs[0].retries_used), (RunStatus::Queued, 1));
        let attempts = written(&d, |w| if let Write::Attempt(x) = w { Some(x) } else { None });
        assert_eq!(attempts[0].error_code.as_deref(), Some(WORKER_REVOKED));
        assert_eq!(event_kinds(&d), ["attempt.lost", "run.queued"]);
    }

    #[test]
    fn revoking_or_disabling_expires_the_tokens_not_yet_spent() {
        let pending = Enrolment {
            token_digest: token(9).digest(),
            worker: worker(),
            created_at: NOW - 10,
            expires_at: NOW + 1_000,
            used_at: None,
            serial: None,
        };
        let rows = Rows { enrolments: vec![pending.clone()], ..Rows::default() };
        for access in [Access::Revoke, Access::Disable] {
            let d = set_access(&worker(), access, &rows, NOW, &mut ids());
            assert!(
                d.writes.contains(&Write::Enrolment(Enrolment { expires_at: NOW, ..pending.clone() })),
                "{access:?}"
            );
        }
    }

    #[test]
    fn disabling_lapses_open_offers_without_spending_the_budget() {
        let rows = holding(AttemptStatus::Offered);
        let d = set_access(&worker(), Access::Disable, &rows, NOW, &mut ids());
        assert_eq!(
            d.reply,
            Ok(Reply::AccessChanged(AccessChanged { sessions: 1, attempts: 1, certificates: 0, unknown: false }))
        );
        let runs = written(&d, |w| if let Write::Run(x) = w { Some(x) } else { None });
        assert_eq!((runs[0].status, runs[0].retries_used), (RunStatus::Queued, 0));
        let attempts = written(&d, |w| if let Write::Attempt(x) = w { Some(x) } else { None });
        assert_eq!(attempts[0].error_code.as_deref(), Some(WORKER_DISABLED));
        let w = written(&d, |w| if let Write::Worker(x) = w { Some(x) } else { None });
        assert_eq!((w[0].disabled_at, w[0].revoked_at), (Some(NOW), None));
    }

    #[test]
    fn enabling_clears_the_switch_and_nothing_else() {
        let mut rows = Rows::default();
        assert_eq!(set_access(&worker(), Access::Enable, &rows, NOW, &mut ids()).writes, vec![]);
        rows.worker = Some(Worker { disabled_at: Some(NOW - 9), revoked_at: Some(NOW - 9), ..record() });
        let d = set_access(&worker(), Access::Enable, &rows, NOW, &mut ids());
        let w = written(&d, |w| if let Write::Worker(x) = w { Some(x) } else { None });
        assert_eq!((w[0].disabled_at, w[0].revoked_at), (None, Some(NOW - 9)));
    }

    #[test]
    fn blocking_a_name_nothing_named_before_says_so_and_still_blocks() {
        let unknown = |rows: &Rows, access| {
            let d = set_access(&worker(), access, rows, NOW, &mut ids());
            let Ok(Reply::AccessChanged(changed)) = d.reply else { panic!("{d:?}") };
            (changed.unknown, d.writes.iter().any(|w| matches!(w, Write::Worker(_))))
        };
        assert_eq!(unknown(&Rows::default(), Access::Revoke), (true, true), "a typo, blocked all the same");
        assert_eq!(unknown(&Rows::default(), Access::Disable), (true, true));
        assert_eq!(unknown(&Rows::default(), Access::Enable), (false, false), "enabling changes nothing");
        let certified = Rows { certificates: vec![cert("01")], ..Rows::default() };
        assert!(!unknown(&certified, Access::Revoke).0);
        assert!(!unknown(&Rows { worker: Some(record()), ..Rows::default() }, Access::Disable).0);
        let token = Rows { enrolments: vec![enrolment(NOW + 1)], ..Rows::default() };
        assert!(!unknown(&token, Access::Disable).0);
        let seen = Rows { worker_sessions: vec![session(1)], ..Rows::default() };
        assert!(!unknown(&seen, Access::Disable).0, "a session only");
        let elsewhere =
            Rows { certificates: vec![Certificate { worker: other_worker(), ..cert("02") }], ..Rows::default() };
        assert!(unknown(&elsewhere, Access::Revoke).0, "another worker's certificate");
    }

    #[test]
    fn a_certificate_is_revoked_with_its_renewals_and_an_unknown_serial_is_not_found() {
        let rows = Rows { certificate: Some(cert("0a")), ..Rows::default() };
        let d = revoke_certificate(&worker(), "0a", true, &rows, NOW);
        assert_eq!(d.writes, vec![Write::Certificate(Certificate { revoked_at: Some(NOW), ..cert("0a") })]);
        // Renewed from 0a: 0b, then 0c from 0b and 0d from 0c (0c revoked already), and
        // a cycle back to 0a that a corrupt record could make; 0e is another line, 0f
        // another worker's.
        let renewed = |serial: &str, from: &str| Certificate { renewed_from: Some(from.into()), ..cert(serial) };
        let family = vec![
            cert("0a"),
            renewed("0b", "0a"),
            Certificate { revoked_at: Some(NOW - 1), ..renewed("0c", "0b") },
            renewed("0d", "0c"),
            renewed("0e", "09"),
            Certificate { worker: other_worker(), ..renewed("0f", "0a") },
            renewed("0a", "0d"),
        ];
        let rows = Rows { certificate: Some(cert("0a")), certificates: family, ..Rows::default() };
        let d = revoke_certificate(&worker(), "0a", true, &rows, NOW);
        let certs = written(&d, |w| if let Write::Certificate(c) = w { Some(c) } else { None });
        assert_eq!(certs.iter().map(|c| c.serial.as_str()).collect::<Vec<_>>(), ["0a", "0b", "0d"]);
        assert!(certs.iter().all(|c| c.revoked_at == Some(NOW)));
        assert!(matches!(d.reply, Ok(Reply::CertificateRevoked(ref c, 2)) if c.serial == "0a"));
        let alone = revoke_certificate(&worker(), "0a", false, &rows, NOW);
        assert_eq!(alone.writes, vec![Write::Certificate(Certificate { revoked_at: Some(NOW), ..cert("0a") })]);
        assert!(matches!(alone.reply, Ok(Reply::CertificateRevoked(_, 0))), "without its renewals");
        assert_eq!(
            revoke_certificate(&worker(), "0b", false, &Rows::default(), NOW),
            Decision::refuse(ErrorCode::NotFound)
        );
        assert_eq!(revoke_certificate(&other_worker(), "0a", false, &rows, NOW), Decision::refuse(ErrorCode::NotFound));
        let again =
            Rows { certificate: Some(Certificate { revoked_at: Some(NOW - 1), ..cert("0a") }), ..Rows::default() };
        assert!(revoke_certificate(&worker(), "0a", false, &again, NOW).writes.is_empty());
    }

    /// A long line of renewals (a copy renewing in a loop) and a wide one: revoking with
    /// renewals reaches every certificate of both, each once (a correctness check; the
    /// walk's cost is its map's, read in the code).
    #[test]
    fn revoking_a_long_or_wide_line_of_renewals_reaches_every_one_once() {
        let renewed = |serial: String, from: String| Certificate { renewed_from: Some(from), ..cert(&serial) };
        let chain = (0..3_000).map(|i| match i {
            0 => cert("c0"),
            _ => renewed(format!("c{i}"), format!("c{}", i - 1)),
        });
        let wide: Vec<Certificate> = (0..3_000).map(|i| renewed(format!("w{i}"), "c0".into())).collect();
        let certificates: Vec<Certificate> = chain.chain(wide).collect();
        let rows = Rows { certificate: Some(cert("c0")), certificates, ..Rows::default() };
        let d = revoke_certificate(&worker(), "c0", true, &rows, NOW);
        assert!(matches!(d.reply, Ok(Reply::CertificateRevoked(_, 5_999))), "{:?}", d.reply);
        let certs = written(&d, |w| if let Write::Certificate(c) = w { Some(c) } else { None });
        let mut serials: Vec<&str> = certs.iter().map(|c| c.serial.as_str()).collect();
        serials.sort_unstable();
        serials.dedup();
        assert_eq!(serials.len(), 6_000, "each once, the first included");
    }

    fn enrolment(expires_at: Millis) -> Enrolment {
        Enrolment {
            token_digest: token(9).digest(),
            worker: worker(),
            created_at: NOW - 100,
            expires_at,
            used_at: None,
            serial: None,
        }
    }

    #[test]
    fn an_enrolment_token_is_spent_once_on_its_own_worker_before_it_expires() {
        let digest = token(9).digest();
        let rows = Rows { enrolment: Some(enrolment(NOW + 1)), ..Rows::default() };
        let d = enrol(&digest, &cert("0c"), &rows, NOW);
        assert!(matches!(&d.reply, Ok(Reply::CertificateRecorded(c)) if c.serial == "0c" && c.issued_at == NOW));
        assert!(d.writes.iter().any(|w| matches!(w, Write::Enrolment(e) if e.used_at == Some(NOW))));

        let refused = Decision::refuse(ErrorCode::EnrolmentRefused);
        let spent =
            Rows { enrolment: Some(Enrolment { used_at: Some(NOW - 1), ..enrolment(NOW + 1) }), ..Rows::default() };
        assert_eq!(enrol(&digest, &cert("0d"), &spent, NOW), refused);
        let expired = Rows { enrolment: Some(enrolment(NOW)), ..Rows::default() };
        assert_eq!(enrol(&digest, &cert("0d"), &expired, NOW), refused);
        let other = Certificate { worker: other_worker(), ..cert("0d") };
        assert_eq!(enrol(&digest, &other, &rows, NOW), refused);
        assert_eq!(enrol(&token(8).digest(), &cert("0d"), &rows, NOW), refused);
        assert_eq!(enrol(&digest, &cert("0d"), &Rows::default(), NOW), refused);
        let disabled = Rows { worker: Some(Worker { disabled_at: Some(NOW - 1), ..record() }), ..rows.clone() };
        assert_eq!(enrol(&digest, &cert("0d"), &disabled, NOW), Decision::refuse(ErrorCode::WorkerDisabled));
    }

    #[test]
    fn a_disabled_worker_cannot_renew_but_its_operator_may_issue() {
        let rows = Rows { worker: Some(Worker { disabled_at: Some(NOW - 1), ..record() }), ..Rows::default() };
        let renewing = Issuer::Worker("01".into());
        let refused = |rows: &Rows, code| {
            assert_eq!(record_certificate(&cert("0e"), &renewing, rows, NOW, HOUR), Decision::refuse(code))
        };
        refused(&rows, ErrorCode::WorkerDisabled);
        assert!(record_certificate(&cert("0e"), &Issuer::Operator, &rows, NOW, HOUR).reply.is_ok());
        let known = Rows { certificate: Some(cert("0e")), ..Rows::default() };
        assert_eq!(
            record_certificate(&cert("0e"), &Issuer::Operator, &known, NOW, HOUR),
            Decision::refuse(ErrorCode::StateConflict)
        );
        // Revoked while the renewal's body was on its way: the new one is not recorded.
        let revoked = Certificate { revoked_at: Some(NOW - 1), ..cert("01") };
        refused(&Rows { presented: Some(revoked), ..Rows::default() }, ErrorCode::CertificateRevoked);
        let whole = Rows { worker: Some(Worker { revoked_at: Some(NOW - 1), ..record() }), ..Rows::default() };
        refused(&whole, ErrorCode::CertificateRevoked);
    }

    const HOUR: u64 = 3_600_000;

    #[test]
    fn a_worker_renews_at_most_once_an_interval_and_its_operator_is_never_held_back() {
        let renewing = Issuer::Worker("01".into());
        // The new certificate lives 60 hours: a sixth of it (10 h) is longer than the hour.
        let new = Certificate { not_after: NOW + 60 * HOUR as i64, ..cert("0f") };
        let decide = |last: Option<Millis>, issuer: &Issuer| {
            record_certificate(&new, issuer, &Rows { last_renewal: last, ..Rows::default() }, NOW, HOUR)
        };
        assert!(decide(None, &renewing).reply.is_ok(), "never renewed before");
        let hour_ago = NOW - HOUR as i64;
        assert!(decide(Some(hour_ago), &renewing).reply.is_ok(), "renewed an interval ago");
        let refused = decide(Some(hour_ago + 1), &renewing);
        assert_eq!(refused, Decision::refuse(ErrorCode::StateConflict), "renewed less than an interval ago");
        assert!(refused.writes.is_empty());
        assert!(decide(Some(NOW), &Issuer::Operator).reply.is_ok(), "the operator issues whenever asked");
        assert!(decide(Some(NOW + 1), &renewing).reply.is_ok(), "a renewal in the future: the clock went back");
        // The certificate presented has an hour left: a renewal half an hour after the
        // last one goes through, since its holder must renew within it.
        let short_lived = |left: i64| Rows {
            last_renewal: Some(NOW - (HOUR / 2) as i64),
            presented: Some(Certificate { not_after: NOW + left, ..cert("01") }),
            ..Rows::default()
        };
        let with = |rows: &Rows| record_certificate(&new, &renewing, rows, NOW, HOUR).reply.is_ok();
        assert!(with(&short_lived(HOUR as i64)), "half an interval, with an hour left");
        assert!(!with(&short_lived(3 * HOUR as i64)), "with three hours left, the hour stands");

        // A certificate of 6 hours: the interval is a sixth of it, an hour at most.
        assert_eq!(renew_interval(HOUR, 6 * HOUR), HOUR);
        assert_eq!(renew_interval(HOUR, 3 * HOUR), HOUR / 2);
        let short = Certificate { not_after: NOW + 3 * HOUR as i64, ..cert("10") };
        let rows = |last| Rows { last_renewal: Some(last), ..Rows::default() };
        let at = |last| record_certificate(&short, &renewing, &rows(last), NOW, HOUR).reply.is_ok();
        assert!(at(NOW - (HOUR / 2) as i64), "half an hour ago is a sixth of its life ago");
        assert!(!at(NOW - (HOUR / 2) as i64 + 1));
    }
}
