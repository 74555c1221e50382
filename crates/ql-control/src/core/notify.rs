//! Webhook deliveries: one per run that asked for one, decided from rows and DB time.
//!
//! A run submitted with a webhook gets its delivery row in the submit's own transaction,
//! `waiting`. Once the run is terminal, [`claim`] (run by `serve`'s notifier on any
//! replica) takes due deliveries: one whose run ended in a way its `on` does not ask
//! for is `skipped`; the others are claimed — an attempt counted, and `next_at` moved
//! past the claim's time so no other replica sends it meanwhile. The notifier sends
//! each and reports with [`done`]: `delivered`, or after a failure `pending` again with
//! a doubling backoff, until `max_attempts` made it `failed`. A replica that dies
//! mid-send leaves its claim to lapse, and another sends again: at least once, with the
//! run id as the idempotency key. Nothing here waits on a receiver; a run's completion
//! never does either.

use ql_wire::ids::RunId;
use ql_wire::ErrorCode;

use super::{Decision, Reply, Rows, Write};
use crate::model::{Delivery, DeliveryState, Millis, Notify, NotifyOn, Run, RunStatus};

/// How deliveries are claimed and retried (`control.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryPolicy {
    /// A claim keeps other replicas off a delivery this long (longer than a send's timeout).
    pub claim_ms: u64,
    /// Sends tried before a delivery is `failed`.
    pub max_attempts: u32,
    /// The wait after the first failed send; it doubles with each further one.
    pub backoff_ms: u64,
    /// The longest wait between two sends.
    pub backoff_max_ms: u64,
    /// Deliveries claimed at once.
    pub batch: usize,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        Self { claim_ms: 30_000, max_attempts: 5, backoff_ms: 2_000, backoff_max_ms: 300_000, batch: 16 }
    }
}

/// The longest error kept of a failed send.
const ERROR_MAX: usize = 200;

/// A run's delivery as it is submitted.
pub(super) fn waiting(run: &RunId, notify: &Notify, now: Millis) -> Write {
    Write::Delivery(Delivery {
        run: run.clone(),
        url: notify.url.clone(),
        on: notify.on,
        state: DeliveryState::Waiting,
        attempts: 0,
        next_at: now,
        last_error: None,
        created_at: now,
        updated_at: now,
    })
}

/// Whether a run that ended with `status` is one `on` asks to hear about.
pub fn wanted(on: NotifyOn, status: RunStatus) -> bool {
    match on {
        NotifyOn::All => true,
        NotifyOn::Failure => matches!(status, RunStatus::Failed | RunStatus::TimedOut),
    }
}

/// Claims the due deliveries (their runs terminal, their time come), skipping those
/// their run's end does not ask for; answers the claimed ones with their runs.
pub(super) fn claim(rows: &Rows, now: Millis, policy: &DeliveryPolicy) -> Decision {
    let mut writes = Vec::new();
    let mut claimed: Vec<(Delivery, Run)> = Vec::new();
    for (d, run) in &rows.due_deliveries {
        let due = matches!(d.state, DeliveryState::Waiting | DeliveryState::Pending) && d.next_at <= now;
        if !due || !run.status.is_terminal() || d.run != run.id {
            continue;
        }
        if !wanted(d.on, run.status) {
            writes.push(Write::Delivery(Delivery { state: DeliveryState::Skipped, updated_at: now, ..d.clone() }));
            continue;
        }
        let next_at = now.saturating_add(i64::try_from(policy.claim_ms).unwrap_or(i64::MAX));
        let taken =
            Delivery { state: DeliveryState::Pending, attempts: d.attempts + 1, next_at, updated_at: now, ..d.clone() };
        writes.push(Write::Delivery(taken.clone()));
        claimed.push((taken, run.clone()));
    }
    Decision::apply(Reply::Deliveries(claimed), writes)
}

/// What one send did: delivered, or why not.
pub type Sent = Result<(), String>;

/// Records how the send of `attempt` went. A report for another attempt than the
/// delivery's latest (its claim lapsed and another replica sent again) is
/// `state_conflict` and changes nothing.
pub(super) fn done(
    run: &RunId,
    attempt: u32,
    sent: &Sent,
    rows: &Rows,
    now: Millis,
    policy: &DeliveryPolicy,
) -> Decision {
    let Some(d) = rows.delivery.as_ref().filter(|d| &d.run == run) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if d.state != DeliveryState::Pending || d.attempts != attempt {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let next = match sent {
        Ok(()) => Delivery { state: DeliveryState::Delivered, last_error: None, updated_at: now, ..d.clone() },
        Err(e) => {
            let mut error = e.clone();
            if error.len() > ERROR_MAX {
                let mut cut = ERROR_MAX;
                while !error.is_char_boundary(cut) {
                    cut -= 1;
                }
                error.truncate(cut);
            }
            let state = if d.attempts >= policy.max_attempts { DeliveryState::Failed } else { DeliveryState::Pending };
            let wait = backoff(policy, d.attempts);
            let next_at = now.saturating_add(i64::try_from(wait).unwrap_or(i64::MAX));
            Delivery { state, next_at, last_error: Some(error), updated_at: now, ..d.clone() }
        }
    };
    Decision::apply(Reply::Delivery(Box::new(next.clone())), vec![Write::Delivery(next)])
}

/// The wait after `attempts` failed sends: `backoff_ms` doubled for each after the
/// first, at most `backoff_max_ms`.
pub fn backoff(policy: &DeliveryPolicy, attempts: u32) -> u64 {
    let doublings = attempts.saturating_sub(1).min(32);
    policy.backoff_ms.saturating_mul(1u64 << doublings).min(policy.backoff_max_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::{queued_run, NOW};

    fn delivery(state: DeliveryState, attempts: u32, on: NotifyOn) -> Delivery {
        let Write::Delivery(d) = waiting(&queued_run().id, &Notify { url: "http://hook".into(), on }, NOW - 10) else {
            unreachable!()
        };
        Delivery { state, attempts, ..d }
    }

    fn ended(status: RunStatus) -> Run {
        Run { status, finished_at: Some(NOW - 5), ..queued_run() }
    }

    fn policy() -> DeliveryPolicy {
        DeliveryPolicy { claim_ms: 1_000, max_attempts: 3, backoff_ms: 100, backoff_max_ms: 250, batch: 16 }
    }

    #[test]
    fn a_delivery_is_claimed_once_its_run_ended_and_skipped_when_its_end_is_not_asked_for() {
        let rows = |d: Delivery, r: Run| Rows { due_deliveries: vec![(d, r)], ..Rows::default() };
        let running = rows(delivery(DeliveryState::Waiting, 0, NotifyOn::All), queued_run());
        assert_eq!(claim(&running, NOW, &policy()).writes, vec![], "a run still going is not notified");

        let d = claim(
            &rows(delivery(DeliveryState::Waiting, 0, NotifyOn::All), ended(RunStatus::Succeeded)),
            NOW,
            &policy(),
        );
        let Ok(Reply::Deliveries(claimed)) = &d.reply else { panic!("{d:?}") };
        assert_eq!(claimed.len(), 1);
        assert_eq!(
            (claimed[0].0.state, claimed[0].0.attempts, claimed[0].0.next_at),
            (DeliveryState::Pending, 1, NOW + 1_000)
        );

        let d = claim(
            &rows(delivery(DeliveryState::Waiting, 0, NotifyOn::Failure), ended(RunStatus::Succeeded)),
            NOW,
            &policy(),
        );
        assert!(matches!(&d.reply, Ok(Reply::Deliveries(c)) if c.is_empty()));
        assert!(matches!(&d.writes[..], [Write::Delivery(x)] if x.state == DeliveryState::Skipped));
        for status in [RunStatus::Failed, RunStatus::TimedOut] {
            let d = claim(&rows(delivery(DeliveryState::Waiting, 0, NotifyOn::Failure), ended(status)), NOW, &policy());
            assert!(matches!(&d.reply, Ok(Reply::Deliveries(c)) if c.len() == 1), "{status:?}");
        }
        let claimed_elsewhere = Delivery { next_at: NOW + 1, ..delivery(DeliveryState::Pending, 1, NotifyOn::All) };
        assert_eq!(claim(&rows(claimed_elsewhere, ended(RunStatus::Failed)), NOW, &policy()).writes, vec![]);
        for state in [DeliveryState::Delivered, DeliveryState::Failed, DeliveryState::Skipped] {
            assert_eq!(
                claim(&rows(delivery(state, 1, NotifyOn::All), ended(RunStatus::Failed)), NOW, &policy()).writes,
                vec![]
            );
        }
    }

    #[test]
    fn a_failed_send_backs_off_doubling_until_the_last_attempt_fails_the_delivery() {
        let run = queued_run().id;
        let rows = |d: Delivery| Rows { delivery: Some(d), ..Rows::default() };
        let sent: Sent = Err("connection refused".into());
        let d = done(&run, 1, &sent, &rows(delivery(DeliveryState::Pending, 1, NotifyOn::All)), NOW, &policy());
        assert!(matches!(&d.writes[..], [Write::Delivery(x)]
            if x.state == DeliveryState::Pending && x.next_at == NOW + 100 && x.last_error.as_deref() == Some("connection refused")));
        let d = done(&run, 2, &sent, &rows(delivery(DeliveryState::Pending, 2, NotifyOn::All)), NOW, &policy());
        assert!(matches!(&d.writes[..], [Write::Delivery(x)] if x.next_at == NOW + 200));
        let d = done(&run, 3, &sent, &rows(delivery(DeliveryState::Pending, 3, NotifyOn::All)), NOW, &policy());
        assert!(matches!(&d.writes[..], [Write::Delivery(x)] if x.state == DeliveryState::Failed));
        assert_eq!(backoff(&policy(), 9), 250, "capped");

        let d = done(&run, 2, &Ok(()), &rows(delivery(DeliveryState::Pending, 2, NotifyOn::All)), NOW, &policy());
        assert!(matches!(&d.writes[..], [Write::Delivery(x)] if x.state == DeliveryState::Delivered));
        // A stale report (another replica claimed it again since) changes nothing.
        let stale = rows(delivery(DeliveryState::Pending, 3, NotifyOn::All));
        assert_eq!(done(&run, 2, &Ok(()), &stale, NOW, &policy()), Decision::refuse(ErrorCode::StateConflict));
        let gone = rows(delivery(DeliveryState::Delivered, 2, NotifyOn::All));
        assert_eq!(done(&run, 2, &sent, &gone, NOW, &policy()), Decision::refuse(ErrorCode::StateConflict));
        assert_eq!(done(&run, 1, &sent, &Rows::default(), NOW, &policy()), Decision::refuse(ErrorCode::NotFound));
        let long = Err("é".repeat(300));
        let d = done(&run, 1, &long, &rows(delivery(DeliveryState::Pending, 1, NotifyOn::All)), NOW, &policy());
        assert!(matches!(&d.writes[..], [Write::Delivery(x)] if x.last_error.as_ref().unwrap().len() <= ERROR_MAX));
    }
}
