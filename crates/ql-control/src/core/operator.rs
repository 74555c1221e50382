//! Operator commands that change state: submit and cancel.

use serde_json::json;
use std::collections::BTreeMap;

use ql_wire::ids::ProjectId;
use ql_wire::lease::StopIntent;
use ql_wire::limits::LABELS_MAX;
use ql_wire::spec::ExecutionSpec;
use ql_wire::text::{LabelKey, LabelValue};

use super::start::{run_transition, transition, EXECUTION_CANCELLED};
use super::{event, Decision, IdGen, Reply, Rows, Write};
use crate::model::{Attempt, AttemptStatus, EndKind, Millis, Notify, OfferState, Run, RunStatus};
use ql_wire::ErrorCode;

/// A run to queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submit {
    /// Project.
    pub project: ProjectId,
    /// What to run (its `projectId` must equal `project`).
    pub spec: ExecutionSpec,
    /// Labels the worker must carry by the operator's word.
    pub labels: BTreeMap<String, String>,
    /// Labels the worker's agent must declare.
    pub agent_labels: BTreeMap<String, String>,
    /// Lost leases tolerated before the run fails.
    pub retry_budget: u32,
    /// A webhook told of the run's end.
    pub notify: Option<Notify>,
}

/// What a cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The run had not been claimed: it is cancelled now.
    Cancelled,
    /// A worker holds it: the stop intent is recorded and delivered on its next renewal.
    StopRequested,
    /// The run had already ended with this status.
    AlreadyEnded(RunStatus),
}

/// Why a set of labels could never be matched: a worker carries at most [`LABELS_MAX`]
/// labels of each kind, each a valid [`LabelKey`] and [`LabelValue`], so a run asking for
/// anything else would stay queued for ever (and a worker is never given such a label).
pub fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), String> {
    if labels.len() > LABELS_MAX {
        return Err(format!("at most {LABELS_MAX} labels, not {}: no worker could carry them all", labels.len()));
    }
    for (key, value) in labels {
        LabelKey::parse(key.as_str()).map_err(|e| format!("label {key:?}: {e}; no worker could declare it"))?;
        LabelValue::parse(value.as_str())
            .map_err(|e| format!("label {key:?} value {value:?}: {e}; no worker could declare it"))?;
    }
    Ok(())
}

/// The longest webhook URL.
const URL_MAX: usize = 2048;

/// Why `url` cannot be a webhook's: an `http://` or `https://` URL with a host, of at
/// most 2048 printable ASCII characters.
pub fn check_url(url: &str) -> Result<(), String> {
    let rest = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://"));
    let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or(""));
    match host {
        _ if url.len() > URL_MAX => Err(format!("a webhook URL of at most {URL_MAX} characters")),
        _ if !url.bytes().all(|b| b.is_ascii_graphic()) => Err("a webhook URL of printable ASCII, no spaces".into()),
        Some(h) if !h.is_empty() && !h.starts_with('@') && !h.ends_with(':') => Ok(()),
        _ => Err(format!("webhook {url:?}: an http:// or https:// URL with a host")),
    }
}

/// Whether a run request could ever run (the spec and project agree, labels a worker
/// could carry).
pub(super) fn check_submit(s: &Submit) -> Result<(), ErrorCode> {
    if s.spec.project_id != s.project
        || s.spec.validate().is_err()
        || check_labels(&s.labels).is_err()
        || check_labels(&s.agent_labels).is_err()
        || s.notify.as_ref().is_some_and(|n| check_url(&n.url).is_err())
    {
        return Err(ErrorCode::InvalidRequest);
    }
    Ok(())
}

pub(super) fn submit(s: &Submit, now: Millis, ids: &mut IdGen) -> Decision {
    if let Err(code) = check_submit(s) {
        return Decision::refuse(code);
    }
    let (run, writes) = submitted(s, None, now, ids);
    Decision::apply(Reply::Submitted(run), writes).waking_for(s)
}

/// A queued run for `s` (of `schedule`, if a schedule submitted it), and its writes.
pub(super) fn submitted(
    s: &Submit,
    schedule: Option<&str>,
    now: Millis,
    ids: &mut IdGen,
) -> (ql_wire::ids::RunId, Vec<Write>) {
    let run = Run {
        id: ids.run(),
        project: s.project.clone(),
        spec: s.spec.clone(),
        labels: s.labels.clone(),
        agent_labels: s.agent_labels.clone(),
        status: RunStatus::Queued,
        stop: None,
        retry_budget: s.retry_budget,
        retries_used: 0,
        attempts: 0,
        lease_generations: 0,
        current_attempt: None,
        deadline_at: None,
        created_at: now,
        started_at: None,
        finished_at: None,
        error_code: None,
        summary: None,
        schedule: schedule.map(str::to_owned),
    };
    let payload = match schedule {
        Some(name) => json!({ "project": s.project, "schedule": name }),
        None => json!({ "project": s.project }),
    };
    let ev = event(ids, &run.id, None, "run.queued", (None, Some("queued")), payload, now);
    let id = run.id.clone();
    let mut writes = vec![Write::Run(run), ev];
    // The delivery is written with the run, so no end of it can pass unnoticed.
    writes.extend(s.notify.as_ref().map(|n| super::notify::waiting(&id, n, now)));
    (id, writes)
}

/// Cancels a run. Its current attempt, lease and offer are loaded with it.
pub(super) fn cancel(rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let Some(run) = rows.run.as_ref() else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if run.status.is_terminal() {
        return Decision::answer(Reply::Cancelled(CancelOutcome::AlreadyEnded(run.status)));
    }
    let attempt = rows.attempt.as_ref().filter(|a| Some(&a.id) == run.current_attempt.as_ref());
    let ended = Run {
        status: RunStatus::Cancelled,
        finished_at: Some(now),
        error_code: Some(EXECUTION_CANCELLED.to_owned()),
        ..run.clone()
    };
    match attempt {
        None if run.status == RunStatus::Queued => {
            let ev =
                event(ids, &run.id, None, "run.cancelled", run_transition(run.status, ended.status), json!({}), now);
            Decision::apply(Reply::Cancelled(CancelOutcome::Cancelled), vec![Write::Run(ended), ev])
        }
        Some(a) if a.status == AttemptStatus::Offered => {
            let mut writes = Vec::new();
            if let Some(offer) = rows.offer.as_ref().filter(|o| o.id == a.offer && o.state == OfferState::Open) {
                writes.push(Write::Offer(crate::model::Offer { state: OfferState::Withdrawn, ..offer.clone() }));
            }
            let gone = Attempt {
                status: AttemptStatus::Cancelled,
                end: Some(EndKind::Withdrawn),
                ended_at: Some(now),
                error_code: Some(EXECUTION_CANCELLED.to_owned()),
                ..a.clone()
            };
            writes.push(event(
                ids,
                &run.id,
                Some(&a.id),
                "attempt.cancelled",
                transition(a.status, gone.status),
                json!({}),
                now,
            ));
            writes.push(event(
                ids,
                &run.id,
                Some(&a.id),
                "run.cancelled",
                run_transition(run.status, ended.status),
                json!({ "attemptId": a.id }),
                now,
            ));
            writes.splice(0..0, [Write::Attempt(gone), Write::Run(ended)]);
            // No wake-up: a cancel makes nothing placeable, and the session an offer was
            // open for is its agent's, which claims (and learns) next, not a waiting poll.
            Decision::apply(Reply::Cancelled(CancelOutcome::Cancelled), writes)
        }
        _ => {
            let stop = StopIntent::strongest(run.stop, Some(StopIntent::Cancel));
            if stop == run.stop {
                return Decision::answer(Reply::Cancelled(CancelOutcome::StopRequested));
            }
            let next = Run { stop, ..run.clone() };
            let ev = event(
                ids,
                &run.id,
                run.current_attempt.as_ref(),
                "run.cancel_requested",
                (Some(run.status.as_str()), Some(run.status.as_str())),
                json!({}),
                now,
            );
            Decision::apply(Reply::Cancelled(CancelOutcome::StopRequested), vec![Write::Run(next), ev])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;

    fn submit_req() -> Submit {
        Submit {
            project: "default".parse().unwrap(),
            spec: spec(),
            labels: BTreeMap::new(),
            agent_labels: BTreeMap::new(),
            retry_budget: 2,
            notify: None,
        }
    }

    #[test]
    fn submit_queues_a_run_with_one_event() {
        let d = submit(&submit_req(), NOW, &mut ids());
        let Ok(Reply::Submitted(id)) = &d.reply else { panic!("{d:?}") };
        let Some(Write::Run(run)) = d.writes.first() else { panic!() };
        assert_eq!((&run.id, run.status, run.retry_budget, run.created_at), (id, RunStatus::Queued, 2, NOW));
        assert_eq!(event_kinds(&d), ["run.queued"]);
        assert!(!d.wake, "not every waiting poll");
        assert_eq!(
            d.wants,
            vec![crate::core::Want { labels: run.labels.clone(), agent_labels: run.agent_labels.clone() }]
        );
    }

    #[test]
    fn submit_refuses_a_spec_of_another_project_or_out_of_bounds() {
        let mut other = submit_req();
        other.project = "elsewhere".parse().unwrap();
        assert_eq!(submit(&other, NOW, &mut ids()), Decision::refuse(ErrorCode::InvalidRequest));
        let mut bad = submit_req();
        bad.spec.timeout_ms = 0;
        assert_eq!(submit(&bad, NOW, &mut ids()), Decision::refuse(ErrorCode::InvalidRequest));
    }

    #[test]
    fn submit_refuses_labels_no_worker_could_ever_declare() {
        let with = |pairs: Vec<(String, String)>| Submit { labels: pairs.into_iter().collect(), ..submit_req() };
        let ok = with(vec![("site".into(), "attic".into()), ("arch/mips".into(), "24kc".into())]);
        assert!(submit(&ok, NOW, &mut ids()).reply.is_ok());
        let many = with((0..17).map(|i| (format!("l{i}"), "v".into())).collect());
        let refused = [
            with(vec![("A".into(), "b".into())]),
            with(vec![("site".into(), "a\nb".into())]),
            with(vec![("".into(), "x".into())]),
            with(vec![("k".into(), "v".repeat(129))]),
            many,
        ];
        for bad in refused {
            assert_eq!(submit(&bad, NOW, &mut ids()), Decision::refuse(ErrorCode::InvalidRequest), "{:?}", bad.labels);
            assert!(check_labels(&bad.labels).is_err());
            // The same, asked of the agent's declared labels.
            let declared = Submit { labels: BTreeMap::new(), agent_labels: bad.labels.clone(), ..submit_req() };
            assert_eq!(submit(&declared, NOW, &mut ids()), Decision::refuse(ErrorCode::InvalidRequest));
        }
    }

    #[test]
    fn cancel_of_a_queued_run_ends_it() {
        let rows = Rows { run: Some(queued_run()), ..Rows::default() };
        let d = cancel(&rows, NOW, &mut ids());
        assert_eq!(d.reply, Ok(Reply::Cancelled(CancelOutcome::Cancelled)));
        let after = applied(&rows, &d);
        assert_eq!(after.run.unwrap().status, RunStatus::Cancelled);
        assert_eq!(event_kinds(&d), ["run.cancelled"]);
    }

    #[test]
    fn cancel_of_an_offered_run_withdraws_the_offer() {
        let rows = world(AttemptStatus::Offered);
        let d = cancel(&rows, NOW, &mut ids());
        let after = applied(&rows, &d);
        assert_eq!(after.offer.unwrap().state, OfferState::Withdrawn);
        assert_eq!(after.attempt.unwrap().status, AttemptStatus::Cancelled);
        assert_eq!(after.run.unwrap().status, RunStatus::Cancelled);
        assert_eq!(event_kinds(&d), ["attempt.cancelled", "run.cancelled"]);
    }

    #[test]
    fn cancel_of_a_held_run_records_the_stop_intent_once() {
        for status in [AttemptStatus::Claimed, AttemptStatus::Starting, AttemptStatus::Running] {
            let rows = world(status);
            let d = cancel(&rows, NOW, &mut ids());
            assert_eq!(d.reply, Ok(Reply::Cancelled(CancelOutcome::StopRequested)));
            let after = applied(&rows, &d);
            assert_eq!(after.run.as_ref().unwrap().stop, Some(StopIntent::Cancel));
            assert_eq!(
                cancel(&after, NOW, &mut ids()),
                Decision::answer(Reply::Cancelled(CancelOutcome::StopRequested))
            );
        }
        let mut timed = world(AttemptStatus::Running);
        timed.run.as_mut().unwrap().stop = Some(StopIntent::Timeout);
        assert!(cancel(&timed, NOW, &mut ids()).writes.is_empty(), "timeout outranks cancel");
    }

    #[test]
    fn cancel_of_an_ended_run_changes_nothing() {
        let mut rows = Rows { run: Some(queued_run()), ..Rows::default() };
        rows.run.as_mut().unwrap().status = RunStatus::Succeeded;
        assert_eq!(
            cancel(&rows, NOW, &mut ids()),
            Decision::answer(Reply::Cancelled(CancelOutcome::AlreadyEnded(RunStatus::Succeeded)))
        );
        assert_eq!(cancel(&Rows::default(), NOW, &mut ids()), Decision::refuse(ErrorCode::NotFound));
    }
}
