//! The schedule scenarios of the store contract: fires decided by DB time, once per fire
//! time whichever process sweeps, with their overlap and catch-up rules.

use std::collections::BTreeSet;

use ql_control::core::{Command, Reply, ScheduleSpec, Submit};
use ql_control::model::{CatchUp, FireOutcome, Overlap};
use ql_control::store::{RunQuery, Store};

use super::*;

fn every_second(name: &str, overlap: Overlap, catch_up: CatchUp) -> Command {
    Command::AddSchedule(Box::new(ScheduleSpec {
        name: name.into(),
        cron: "* * * * * *".into(),
        tz: "UTC".into(),
        random_delay_ms: 0,
        overlap,
        catch_up,
        submit: Submit {
            project: project(),
            spec: spec(LONG_TIMEOUT_MS),
            labels: BTreeMap::new(),
            agent_labels: BTreeMap::new(),
            retry_budget: 0,
            notify: None,
        },
    }))
}

/// Two processes sweep the same database at every second: each fire time has exactly
/// one fire, and each queued fire exactly one run of that schedule.
pub async fn each_fire_time_fires_once_whoever_sweeps<B: Backend>(b: B) {
    let (store, other) = (b.store(), b.other_process());
    assert!(matches!(exec(&store, every_second("tick", Overlap::Allow, CatchUp::None)).await, Ok(Reply::Schedule(_))));
    for _ in 0..5 {
        b.advance(1_000);
        let (x, y) = tokio::join!(store.execute(Command::FireSchedules), other.execute(Command::FireSchedules));
        assert!(x.unwrap().is_ok() && y.unwrap().is_ok());
    }
    let snap = store.snapshot().await.unwrap();
    let times: BTreeSet<i64> = snap.fires.iter().map(|f| f.fire_at).collect();
    assert_eq!(times.len(), snap.fires.len(), "no fire time twice");
    assert!(snap.fires.len() >= 5, "one a second: {:?}", snap.fires);
    let runs = store.runs(&RunQuery { schedule: Some("tick".into()), ..RunQuery::latest(100) }).await.unwrap();
    assert_eq!(runs.len(), snap.fires.iter().filter(|f| f.outcome == FireOutcome::Queued).count());
    let fired: BTreeSet<_> = snap.fires.iter().filter_map(|f| f.run.clone()).collect();
    assert_eq!(fired, runs.iter().map(|r| r.id.clone()).collect(), "each run is its fire's");
    check_invariants(&snap);
}

/// `overlap skip` records a fire as skipped while the previous run has not ended; a fire
/// found a minute late is missed with `catch_up none`; pausing fires nothing; a second
/// schedule of the same name is refused and changes nothing.
pub async fn overlap_catch_up_and_pause_decide_each_fire<B: Backend>(b: B) {
    let store = b.store();
    exec(&store, every_second("slow", Overlap::Skip, CatchUp::None)).await.unwrap();
    refused(&store, every_second("slow", Overlap::Allow, CatchUp::None), ErrorCode::StateConflict, "a second slow")
        .await;
    b.advance(1_000);
    exec(&store, Command::FireSchedules).await.unwrap();
    b.advance(1_000);
    exec(&store, Command::FireSchedules).await.unwrap();
    let outcomes = |snap: &ql_control::store::Snapshot| snap.fires.iter().map(|f| f.outcome).collect::<Vec<_>>();
    let snap = store.snapshot().await.unwrap();
    assert_eq!(outcomes(&snap), [FireOutcome::Queued, FireOutcome::Skipped], "the first run is still queued");

    b.advance(120_000);
    exec(&store, Command::FireSchedules).await.unwrap();
    let snap = store.snapshot().await.unwrap();
    assert_eq!(outcomes(&snap).last(), Some(&FireOutcome::Missed), "two minutes late, not caught up");
    assert_eq!(snap.fires.len(), 3, "no burst of the missed seconds");

    exec(&store, Command::PauseSchedule("slow".into(), true)).await.unwrap();
    b.advance(5_000);
    exec(&store, Command::FireSchedules).await.unwrap();
    assert_eq!(store.snapshot().await.unwrap().fires.len(), 3, "paused");
    let Ok(Reply::Submitted(now_run)) = exec(&store, Command::RunScheduleNow("slow".into())).await else { panic!() };
    let runs = store.runs(&RunQuery { schedule: Some("slow".into()), ..RunQuery::latest(10) }).await.unwrap();
    assert!(runs.iter().any(|r| r.id == now_run));
    refused(&store, Command::RemoveSchedule("nope".into()), ErrorCode::NotFound, "an unknown schedule").await;
    exec(&store, Command::RemoveSchedule("slow".into())).await.unwrap();
    assert!(store.schedules().await.unwrap().is_empty());
    check_invariants(&store.snapshot().await.unwrap());
}

/// The clock goes back after a fire and a schedule is added again under its name, so its
/// next times are ones that came and fired already. None of them fires a second time, and
/// the other schedules of each sweep fire on: the clash of a second fire row once rolled
/// back every schedule's fires, at every sweep.
pub async fn a_clock_gone_back_never_fires_a_time_twice<B: Backend>(b: B) {
    let store = b.store();
    exec(&store, every_second("tick", Overlap::Allow, CatchUp::None)).await.unwrap();
    b.advance(1_000);
    exec(&store, Command::FireSchedules).await.unwrap();
    let first: Vec<i64> = store.snapshot().await.unwrap().fires.iter().map(|f| f.fire_at).collect();
    assert_eq!(first.len(), 1, "{first:?}");
    b.advance(-3_000);
    exec(&store, Command::RemoveSchedule("tick".into())).await.unwrap();
    exec(&store, every_second("tick", Overlap::Allow, CatchUp::None)).await.unwrap();
    exec(&store, every_second("tock", Overlap::Allow, CatchUp::None)).await.unwrap();
    for _ in 0..5 {
        b.advance(1_000);
        exec(&store, Command::FireSchedules).await.expect("the sweep fires");
    }
    let snap = store.snapshot().await.unwrap();
    let times = |name: &str| snap.fires.iter().filter(|f| f.schedule == name).map(|f| f.fire_at).collect::<Vec<_>>();
    let ticks = times("tick");
    let again = ticks.iter().filter(|t| **t <= first[0]).count();
    assert_eq!(again, 1, "no time at or before the last fire again: {ticks:?}");
    assert!(times("tock").len() >= 4, "the other schedule fired on: {:?}", times("tock"));
    check_invariants(&snap);
}
