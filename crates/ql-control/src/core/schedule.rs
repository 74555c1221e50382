//! Schedules: a run submitted at each time a cron expression names, in a time zone.
//!
//! The sweeper (any replica) fires what is due, in the transaction that locks the
//! schedule: each fire is a row keyed by (schedule, fire time), written with its run, so
//! two replicas and a restart never fire one time twice, nor a clock that went back (a
//! schedule goes on from after the latest time fired under its name). Cron expressions
//! take five fields or six (seconds first) and are evaluated by croner in the schedule's
//! IANA time zone (jiff's bundled database), with its daylight-saving convention, which is
//! Vixie cron's:
//! a fixed time that falls in a gap (clocks forward) fires at the first instant after the
//! gap, a fixed time that happens twice (clocks back) fires once, at the first; an interval
//! (`*/15 * * * *`, seconds or minutes wildcards) fires at every instant it names.
//!
//! - `overlap`: `skip` records a fire whose schedule's previous run has not ended as
//!   skipped; `queue` holds the fire until it has (then fires once); `allow` fires anyway.
//! - `catch_up`: a fire found more than `missed_after_ms` late (every replica was down)
//!   is recorded missed with `none`, or fired once with `once`; either way the schedule
//!   goes on from the next time after now, so an outage never fires a burst.
//! - `random_delay_ms`: each fire waits a random delay of up to this long after its time
//!   (QingLong's users spread their sign-ins); the fire keeps its nominal time as its key.
//!   At most [`RANDOM_DELAY_MAX_MS`] (a day): a longer one only pushes the fire past any
//!   sensible time, and near `u64::MAX` it overflowed the draw and the due time.

use std::str::FromStr;

use jiff::tz::TimeZone;
use jiff::Timestamp;
use serde_json::json;

use ql_wire::ErrorCode;

use super::operator::{submitted, Submit};
use super::{event, Decision, IdGen, Reply, Rows, Write};
use crate::model::{Fire, FireOutcome, Millis, Run, Schedule};

/// A schedule as an operator describes it, before it is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleSpec {
    /// The schedule's name.
    pub name: String,
    /// The cron expression.
    pub cron: String,
    /// The IANA time zone it is read in.
    pub tz: String,
    /// Up to this long after each fire time, drawn per fire.
    pub random_delay_ms: u64,
    /// What a fire does while the previous run still runs.
    pub overlap: crate::model::Overlap,
    /// What a fire missed while no replica ran does.
    pub catch_up: crate::model::CatchUp,
    /// The run each fire submits.
    pub submit: Submit,
}

/// Why a schedule is refused.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not a schedule name ([a-z0-9][a-z0-9._-]{{0,63}})"))
    }
}

/// The parsed cron expression and time zone, or why not.
pub fn parse(cron: &str, tz: &str) -> Result<(croner::Cron, TimeZone), String> {
    let parser = croner::parser::CronParser::builder().seconds(croner::parser::Seconds::Optional).build();
    let parsed = parser.parse(cron).map_err(|e| format!("cron {cron:?}: {e}"))?;
    let zone = TimeZone::get(tz).map_err(|e| format!("time zone {tz:?}: {e}"))?;
    Ok((parsed, zone))
}

/// The first fire time strictly after `after` (milliseconds), or `None` when the
/// expression never matches again.
pub fn next_after(cron: &str, tz: &str, after: Millis) -> Option<Millis> {
    let (cron, zone) = parse(cron, tz).ok()?;
    let start = Timestamp::from_millisecond(after).ok()?.to_zoned(zone);
    let next = cron.find_next_occurrence(&start, false).ok()?;
    Some(next.timestamp().as_millisecond())
}

/// The longest random delay of a fire: a day.
pub const RANDOM_DELAY_MAX_MS: u64 = 24 * 60 * 60 * 1000;

/// Refuses a random delay longer than [`RANDOM_DELAY_MAX_MS`].
pub fn check_random_delay(random_delay_ms: u64) -> Result<(), String> {
    if random_delay_ms > RANDOM_DELAY_MAX_MS {
        return Err(format!("random delay {random_delay_ms} ms: at most {RANDOM_DELAY_MAX_MS} ms (a day)"));
    }
    Ok(())
}

/// The delay drawn for one fire (a stored delay is never above the maximum; one that were
/// is drawn within it).
fn delay(random_delay_ms: u64, ids: &mut IdGen) -> Millis {
    let most = random_delay_ms.min(RANDOM_DELAY_MAX_MS);
    if most == 0 {
        return 0;
    }
    i64::try_from(ids.draw(most + 1)).unwrap_or(0)
}

/// Moves a schedule on to its first time after `from` (due after its delay), or pauses it
/// when its expression names no later time.
fn move_on(s: &mut Schedule, from: Millis, ids: &mut IdGen) {
    match next_after(&s.cron, &s.tz, from) {
        Some(next) => {
            s.next_fire_at = next;
            s.due_at = next + delay(s.random_delay_ms, ids);
        }
        None => s.paused = true,
    }
}

/// Records a new schedule, its first fire the first time after `now`.
pub(super) fn add(spec: &ScheduleSpec, rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    if check_name(&spec.name).is_err()
        || check_random_delay(spec.random_delay_ms).is_err()
        || super::operator::check_submit(&spec.submit).is_err()
    {
        return Decision::refuse(ErrorCode::InvalidRequest);
    }
    if rows.schedule.is_some() {
        return Decision::refuse(ErrorCode::StateConflict);
    }
    let Some(next) = next_after(&spec.cron, &spec.tz, now) else {
        return Decision::refuse(ErrorCode::InvalidRequest);
    };
    let schedule = Schedule {
        name: spec.name.clone(),
        cron: spec.cron.clone(),
        tz: spec.tz.clone(),
        random_delay_ms: spec.random_delay_ms,
        overlap: spec.overlap,
        catch_up: spec.catch_up,
        submit: spec.submit.clone(),
        paused: false,
        next_fire_at: next,
        due_at: next + delay(spec.random_delay_ms, ids),
        last_run: None,
        created_at: now,
        updated_at: now,
    };
    Decision::apply(Reply::Schedule(Box::new(schedule.clone())), vec![Write::Schedule(schedule)])
}

/// Pauses or resumes a schedule. Resuming starts again from the first time after now:
/// what fell due while it was paused is not fired.
pub(super) fn set_paused(name: &str, paused: bool, rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let Some(s) = rows.schedule.as_ref().filter(|s| s.name == name) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    if s.paused == paused {
        return Decision::answer(Reply::Schedule(Box::new(s.clone())));
    }
    let mut updated = Schedule { paused, updated_at: now, ..s.clone() };
    if !paused {
        let Some(next) = next_after(&s.cron, &s.tz, now) else {
            return Decision::refuse(ErrorCode::StateConflict);
        };
        updated.next_fire_at = next;
        updated.due_at = next + delay(s.random_delay_ms, ids);
    }
    Decision::apply(Reply::Schedule(Box::new(updated.clone())), vec![Write::Schedule(updated)])
}

/// Removes a schedule (its fires and runs stay, for the record).
pub(super) fn remove(name: &str, rows: &Rows) -> Decision {
    match rows.schedule.as_ref().filter(|s| s.name == name) {
        None => Decision::refuse(ErrorCode::NotFound),
        Some(s) => Decision::apply(Reply::Schedule(Box::new(s.clone())), vec![Write::RemoveSchedule(s.name.clone())]),
    }
}

/// Submits the schedule's run now, outside its times (`run-now`).
pub(super) fn run_now(name: &str, rows: &Rows, now: Millis, ids: &mut IdGen) -> Decision {
    let Some(s) = rows.schedule.as_ref().filter(|s| s.name == name) else {
        return Decision::refuse(ErrorCode::NotFound);
    };
    let (run, mut writes) = submitted(&s.submit, Some(&s.name), now, ids);
    writes.push(Write::Schedule(Schedule { last_run: Some(run.clone()), updated_at: now, ..s.clone() }));
    Decision::apply(Reply::Submitted(run), writes).waking_for(&s.submit)
}

/// Fires every due schedule (see the module doc). `missed_after_ms`: how late a fire may
/// be found before it counts as missed.
pub(super) fn fire_due(rows: &Rows, now: Millis, missed_after_ms: u64, ids: &mut IdGen) -> Decision {
    let mut writes = Vec::new();
    let mut fired = 0;
    for (s, last, fired_until) in &rows.due_schedules {
        if s.paused || s.due_at > now {
            continue;
        }
        // This time fired already: the clock went back since, and the schedule was resumed
        // or added again under its name. Never a second time (its fire row would clash and
        // take the whole batch down with it): it goes on from the first time after that
        // fire, which the next sweeps fire, or find late, as any other.
        if let Some(until) = fired_until.filter(|f| s.next_fire_at <= *f) {
            let mut moved = Schedule { updated_at: now, ..s.clone() };
            move_on(&mut moved, until, ids);
            writes.push(Write::Schedule(moved));
            continue;
        }
        let previous_live = last.as_ref().is_some_and(|r: &Run| !r.status.is_terminal());
        // Late from when it was due (its time plus its delay, or the last sweep that held
        // it): a long random delay or a long hold is not an outage.
        let late = now.saturating_sub(s.due_at) > i64::try_from(missed_after_ms).unwrap_or(i64::MAX);
        let outcome = match (late, s.catch_up, s.overlap, previous_live) {
            (true, crate::model::CatchUp::None, ..) => FireOutcome::Missed,
            (_, _, crate::model::Overlap::Skip, true) => FireOutcome::Skipped,
            // Held until the previous run ended: due again at each sweep meanwhile, so the
            // hold never counts as lateness and held schedules take their turn in the batch.
            (_, _, crate::model::Overlap::Queue, true) => {
                writes.push(Write::Schedule(Schedule { due_at: now, updated_at: now, ..s.clone() }));
                continue;
            }
            _ => FireOutcome::Queued,
        };
        let mut next_schedule = s.clone();
        let run = if outcome == FireOutcome::Queued {
            let (run, run_writes) = submitted(&s.submit, Some(&s.name), now, ids);
            writes.extend(run_writes);
            next_schedule.last_run = Some(run.clone());
            Some(run)
        } else {
            None
        };
        writes.push(Write::Fire(Fire {
            schedule: s.name.clone(),
            fire_at: s.next_fire_at,
            outcome,
            run: run.clone(),
            at: now,
        }));
        if let Some(run) = &run {
            writes.push(event(
                ids,
                run,
                None,
                "run.scheduled",
                (None, None),
                json!({ "schedule": s.name, "fireAt": s.next_fire_at }),
                now,
            ));
        }
        // From the fire time on, or from now after a late one: never a burst of the past.
        let from = if late { now } else { s.next_fire_at };
        move_on(&mut next_schedule, from, ids);
        next_schedule.updated_at = now;
        writes.push(Write::Schedule(next_schedule));
        fired += 1;
    }
    Decision::apply(Reply::Fired(fired), writes).waking_for_queued()
}

impl FromStr for crate::model::Overlap {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        crate::model::Overlap::parse(s).ok_or_else(|| format!("--overlap is skip, queue or allow, not {s:?}"))
    }
}

impl FromStr for crate::model::CatchUp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        crate::model::CatchUp::parse(s).ok_or_else(|| format!("--catch-up is none or once, not {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::testkit::*;
    use crate::model::{CatchUp, Overlap, RunStatus};

    fn ms(rfc3339: &str) -> Millis {
        ql_wire::time::Timestamp::parse(rfc3339).unwrap().millis()
    }

    #[test]
    fn six_fields_take_seconds_and_five_fields_minutes() {
        assert_eq!(next_after("* * * * * *", "UTC", ms("2026-03-01T00:00:00Z")), Some(ms("2026-03-01T00:00:01Z")));
        assert_eq!(next_after("30 7 * * *", "UTC", ms("2026-03-01T00:00:00Z")), Some(ms("2026-03-01T07:30:00Z")));
        assert_eq!(
            next_after("30 7 * * *", "Asia/Shanghai", ms("2026-03-01T00:00:00Z")),
            Some(ms("2026-03-01T23:30:00Z")),
            "07:30 in Shanghai is 23:30 UTC the day before"
        );
        assert!(parse("61 * * * *", "UTC").is_err());
        assert!(parse("* * * * *", "Mars/Olympus").is_err());
    }

    #[test]
    fn daylight_saving_follows_vixie_cron() {
        // New York springs forward at 02:00 on 2026-03-08: 02:30 does not exist, and the
        // fixed-time job fires at the first instant after the gap (03:00 EDT, 07:00 UTC).
        let before = ms("2026-03-08T06:00:00Z"); // 01:00 EST
        assert_eq!(next_after("30 2 * * *", "America/New_York", before), Some(ms("2026-03-08T07:00:00Z")));
        // It falls back at 02:00 on 2026-11-01: 01:30 happens twice, the job fires once,
        // at the first (EDT, 05:30 UTC), and next on the day after.
        let first = next_after("30 1 * * *", "America/New_York", ms("2026-11-01T04:00:00Z")).unwrap();
        assert_eq!(first, ms("2026-11-01T05:30:00Z"));
        assert_eq!(next_after("30 1 * * *", "America/New_York", first), Some(ms("2026-11-02T06:30:00Z")));
        // An interval job fires at both 01:30s.
        let again = next_after("30 * * * *", "America/New_York", first).unwrap();
        assert_eq!(again, ms("2026-11-01T06:30:00Z"));
    }

    fn spec() -> ScheduleSpec {
        ScheduleSpec {
            name: "sign".into(),
            cron: "30 7 * * *".into(),
            tz: "UTC".into(),
            random_delay_ms: 0,
            overlap: Overlap::Skip,
            catch_up: CatchUp::None,
            submit: submit_request(),
        }
    }

    fn due(s: Schedule, last: Option<Run>) -> Rows {
        Rows { due_schedules: vec![(s, last, None)], ..Rows::default() }
    }

    fn added(spec: &ScheduleSpec, now: Millis) -> Schedule {
        let d = add(spec, &Rows::default(), now, &mut ids());
        let Ok(Reply::Schedule(s)) = d.reply else { panic!("{d:?}") };
        *s
    }

    fn fires(d: &Decision) -> Vec<Fire> {
        d.writes.iter().filter_map(|w| if let Write::Fire(f) = w { Some(f.clone()) } else { None }).collect()
    }

    #[test]
    fn resuming_a_schedule_with_no_fire_left_is_refused_and_writes_nothing() {
        let now = ms("2026-03-01T00:00:00Z");
        let paused = Schedule { paused: true, ..added(&spec(), now) };
        // A record whose cron never matches again (written by hand, or by a build that
        // read its time zone differently): resuming it would leave it with no next fire.
        let never = Schedule { cron: "0 0 30 2 *".into(), ..paused.clone() };
        assert_eq!(next_after(&never.cron, &never.tz, now), None);
        let rows = Rows { schedule: Some(never), ..Rows::default() };
        assert_eq!(set_paused("sign", false, &rows, now, &mut ids()), Decision::refuse(ErrorCode::StateConflict));
        let rows = Rows { schedule: Some(paused), ..Rows::default() };
        let resumed = set_paused("sign", false, &rows, now, &mut ids());
        assert!(
            matches!(&resumed.reply, Ok(Reply::Schedule(s)) if !s.paused && s.next_fire_at == ms("2026-03-01T07:30:00Z"))
        );
    }

    #[test]
    fn a_due_fire_queues_one_run_and_moves_to_the_next_time() {
        let s = added(&spec(), ms("2026-03-01T00:00:00Z"));
        assert_eq!(s.next_fire_at, ms("2026-03-01T07:30:00Z"));
        let now = ms("2026-03-01T07:30:00.200Z");
        let d = fire_due(&due(s.clone(), None), now, 60_000, &mut ids());
        assert_eq!(d.reply, Ok(Reply::Fired(1)));
        let f = fires(&d);
        assert_eq!((f[0].fire_at, f[0].outcome), (s.next_fire_at, FireOutcome::Queued));
        let run = d.writes.iter().find_map(|w| if let Write::Run(r) = w { Some(r.clone()) } else { None }).unwrap();
        assert_eq!((run.schedule.as_deref(), run.status), (Some("sign"), RunStatus::Queued));
        let next =
            d.writes.iter().find_map(|w| if let Write::Schedule(x) = w { Some(x.clone()) } else { None }).unwrap();
        assert_eq!(next.next_fire_at, ms("2026-03-02T07:30:00Z"));
        assert_eq!(next.last_run, Some(run.id));
        // Not yet due: nothing.
        assert!(fire_due(&due(next, None), now, 60_000, &mut ids()).writes.is_empty());
    }

    #[test]
    fn overlap_skip_records_a_skip_queue_holds_and_allow_fires() {
        let s = added(&spec(), ms("2026-03-01T00:00:00Z"));
        let now = s.next_fire_at;
        let live = Run { status: RunStatus::Running, ..queued_run() };
        let d = fire_due(&due(s.clone(), Some(live.clone())), now, 60_000, &mut ids());
        assert_eq!(fires(&d)[0].outcome, FireOutcome::Skipped);
        assert!(!d.writes.iter().any(|w| matches!(w, Write::Run(_))));
        let held = Schedule { overlap: Overlap::Queue, ..s.clone() };
        let d = fire_due(&due(held.clone(), Some(live.clone())), now, 60_000, &mut ids());
        assert!(fires(&d).is_empty() && !d.writes.iter().any(|w| matches!(w, Write::Run(_))), "held");
        // Held for ten minutes (each sweep moves its due time on), then the run ends: it
        // fires, even with catch-up none.
        let later = now + 600_000;
        let moved = Schedule { due_at: later - 1_000, ..held };
        let ended = Run { status: RunStatus::Succeeded, ..live.clone() };
        let fired = fires(&fire_due(&due(moved, Some(ended)), later, 60_000, &mut ids()));
        assert_eq!(fired[0].outcome, FireOutcome::Queued);
        let allowed = Schedule { overlap: Overlap::Allow, ..s };
        assert_eq!(
            fires(&fire_due(&due(allowed, Some(live)), now, 60_000, &mut ids()))[0].outcome,
            FireOutcome::Queued
        );
    }

    #[test]
    fn a_fire_missed_while_no_replica_ran_follows_catch_up_and_never_bursts() {
        let s = added(&spec(), ms("2026-03-01T00:00:00Z"));
        // Three days down.
        let now = ms("2026-03-04T09:00:00Z");
        let d = fire_due(&due(s.clone(), None), now, 60_000, &mut ids());
        assert_eq!(fires(&d).iter().map(|f| f.outcome).collect::<Vec<_>>(), [FireOutcome::Missed]);
        let next =
            d.writes.iter().find_map(|w| if let Write::Schedule(x) = w { Some(x.clone()) } else { None }).unwrap();
        assert_eq!(next.next_fire_at, ms("2026-03-05T07:30:00Z"), "from now on");
        let once = Schedule { catch_up: CatchUp::Once, ..s };
        let d = fire_due(&due(once, None), now, 60_000, &mut ids());
        assert_eq!(fires(&d).iter().map(|f| f.outcome).collect::<Vec<_>>(), [FireOutcome::Queued]);
        assert_eq!(d.writes.iter().filter(|w| matches!(w, Write::Run(_))).count(), 1, "once, not three times");
    }

    #[test]
    fn a_random_delay_moves_the_due_time_not_the_fire_time() {
        let s = added(&ScheduleSpec { random_delay_ms: 600_000, ..spec() }, ms("2026-03-01T00:00:00Z"));
        assert_eq!(s.next_fire_at, ms("2026-03-01T07:30:00Z"));
        assert!((s.next_fire_at..=s.next_fire_at + 600_000).contains(&s.due_at));
        if s.due_at > s.next_fire_at {
            assert!(fire_due(&due(s.clone(), None), s.next_fire_at, 60_000, &mut ids()).writes.is_empty());
        }
        let f = fires(&fire_due(&due(s.clone(), None), s.due_at, 60_000, &mut ids()));
        assert_eq!(f[0].fire_at, s.next_fire_at, "the fire keeps its nominal time");
        assert_eq!(f[0].outcome, FireOutcome::Queued, "a delay longer than the missed threshold is no outage");
    }

    #[test]
    fn a_time_that_fired_already_never_fires_again() {
        // Added at 07:00, so its next time is 07:30; 07:30 fired once before the clock went
        // back an hour and the schedule was added again under its name.
        let s = added(&spec(), ms("2026-03-01T07:00:00Z"));
        let fired_at = ms("2026-03-01T07:30:00Z");
        let rows = Rows { due_schedules: vec![(s.clone(), None, Some(fired_at))], ..Rows::default() };
        let d = fire_due(&rows, fired_at, 60_000, &mut ids());
        assert!(fires(&d).is_empty(), "{d:?}");
        assert!(!d.writes.iter().any(|w| matches!(w, Write::Run(_))), "no second run");
        let moved = d.writes.iter().find_map(|w| if let Write::Schedule(x) = w { Some(x.clone()) } else { None });
        assert_eq!(moved.unwrap().next_fire_at, ms("2026-03-02T07:30:00Z"), "on from after that fire");
        // Swept only two days later: the times after that fire are fired, or found late, as
        // any others are (here missed, `--catch-up none`), never skipped unrecorded.
        let later = ms("2026-03-03T08:00:00Z");
        let d = fire_due(&rows, later, 60_000, &mut ids());
        let moved = d.writes.iter().find_map(|w| if let Write::Schedule(x) = w { Some(x.clone()) } else { None });
        let moved = moved.unwrap();
        assert_eq!(moved.next_fire_at, ms("2026-03-02T07:30:00Z"));
        let f = fires(&fire_due(&due(moved, None), later, 60_000, &mut ids()));
        assert_eq!((f[0].fire_at, f[0].outcome), (ms("2026-03-02T07:30:00Z"), FireOutcome::Missed));
        // An earlier fire of the name holds nothing back.
        let rows = Rows { due_schedules: vec![(s, None, Some(fired_at - 86_400_000))], ..Rows::default() };
        assert_eq!(fires(&fire_due(&rows, fired_at, 60_000, &mut ids())).len(), 1);
    }

    #[test]
    fn a_day_is_the_longest_random_delay() {
        let s = added(&ScheduleSpec { random_delay_ms: RANDOM_DELAY_MAX_MS, ..spec() }, NOW);
        assert!((s.next_fire_at..=s.next_fire_at + 86_400_000).contains(&s.due_at));
        assert!(check_random_delay(RANDOM_DELAY_MAX_MS).is_ok());
        let err = check_random_delay(u64::MAX).unwrap_err();
        assert!(err.contains("at most 86400000 ms"), "{err}");
        // A row stored before the limit (none can be added now) still draws within a day.
        for n in 0..64u8 {
            let drawn = delay(u64::MAX, &mut IdGen::new([n; 12]));
            assert!((0..=86_400_000).contains(&drawn), "{drawn}");
        }
    }

    #[test]
    fn bad_schedules_are_refused_and_write_nothing() {
        for bad in [
            ScheduleSpec { name: "Sign".into(), ..spec() },
            ScheduleSpec { cron: "every day".into(), ..spec() },
            ScheduleSpec { tz: "Nowhere/Else".into(), ..spec() },
            ScheduleSpec { random_delay_ms: RANDOM_DELAY_MAX_MS + 1, ..spec() },
            ScheduleSpec { random_delay_ms: u64::MAX, ..spec() },
        ] {
            assert_eq!(add(&bad, &Rows::default(), NOW, &mut ids()), Decision::refuse(ErrorCode::InvalidRequest));
        }
        let existing = Rows { schedule: Some(added(&spec(), NOW)), ..Rows::default() };
        assert_eq!(add(&spec(), &existing, NOW, &mut ids()), Decision::refuse(ErrorCode::StateConflict));
        assert_eq!(set_paused("nope", true, &Rows::default(), NOW, &mut ids()), Decision::refuse(ErrorCode::NotFound));
    }
}
