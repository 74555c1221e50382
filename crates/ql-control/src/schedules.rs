//! The operator's schedule commands: add, list, show, pause, resume, remove and run-now,
//! each through the store's decision code ([`crate::core`]). The sweeper of `serve` fires
//! them (see `core::schedule`).

use crate::admin::{submit_request, when, SubmitArgs};
use crate::core::{Command, Reply, ScheduleSpec};
use crate::model::{CatchUp, Overlap, Schedule};
use crate::store::Store;

/// A schedule as typed on the command line.
#[derive(Debug, Clone)]
pub struct ScheduleArgs {
    /// Its name.
    pub name: String,
    /// The cron expression.
    pub cron: String,
    /// The time zone (default UTC).
    pub tz: String,
    /// Random delay of each fire, in milliseconds.
    pub random_delay_ms: u64,
    /// `skip`, `queue` or `allow`.
    pub overlap: String,
    /// `none` or `once`.
    pub catch_up: String,
    /// What each fire runs, as `submit` takes it.
    pub submit: SubmitArgs,
}

/// Checks everything an operator typed (before the store is asked), then the spec.
pub fn spec_of(args: &ScheduleArgs) -> Result<ScheduleSpec, String> {
    crate::core::check_schedule_name(&args.name)?;
    crate::core::parse_cron(&args.cron, &args.tz)?;
    let overlap: Overlap = args.overlap.parse()?;
    let catch_up: CatchUp = args.catch_up.parse()?;
    Ok(ScheduleSpec {
        name: args.name.clone(),
        cron: args.cron.clone(),
        tz: args.tz.clone(),
        random_delay_ms: args.random_delay_ms,
        overlap,
        catch_up,
        submit: submit_request(&args.submit)?,
    })
}

async fn execute<S: Store>(store: &S, cmd: Command) -> Result<Reply, String> {
    match store.execute(cmd).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(ql_wire::ErrorCode::NotFound)) => Err("no such schedule".into()),
        Ok(Err(ql_wire::ErrorCode::StateConflict)) => Err("a schedule with that name exists already".into()),
        Ok(Err(code)) => Err(format!("refused: {code}")),
        Err(e) => Err(e.to_string()),
    }
}

fn line(s: &Schedule) -> String {
    format!(
        "{:<20} {:<20} {:<16} {:<8} {:<6} {:<24} {}",
        s.name,
        s.cron,
        s.tz,
        s.overlap.as_str(),
        if s.paused { "yes" } else { "no" },
        if s.paused { "-".to_owned() } else { when(Some(s.due_at)) },
        s.last_run.as_ref().map_or("-", |r| r.as_str())
    )
}

fn header() -> String {
    format!("{:<20} {:<20} {:<16} {:<8} {:<6} {:<24} {}", "NAME", "CRON", "TZ", "OVERLAP", "PAUSED", "NEXT", "LAST RUN")
}

/// Adds a schedule and says when it first fires.
pub async fn add<S: Store>(store: &S, args: &ScheduleArgs) -> Result<String, String> {
    let spec = spec_of(args)?;
    match execute(store, Command::AddSchedule(Box::new(spec))).await? {
        Reply::Schedule(s) => Ok(format!("{} added; first fire {}", s.name, when(Some(s.due_at)))),
        other => Err(format!("unexpected answer {other:?}")),
    }
}

/// The schedules as a table.
pub async fn list<S: Store>(store: &S) -> Result<String, String> {
    let all = store.schedules().await.map_err(|e| e.to_string())?;
    let mut out = header() + "\n";
    for s in &all {
        out += &(line(s) + "\n");
    }
    Ok(out)
}

/// One schedule with its recent fires.
pub async fn show<S: Store>(store: &S, name: &str) -> Result<String, String> {
    let all = store.schedules().await.map_err(|e| e.to_string())?;
    let s = all.into_iter().find(|s| s.name == name).ok_or("no such schedule")?;
    let mut out = format!(
        "{}\n{}\ncatch-up {}, random delay {} ms, project {}, retries {}\nrecent fires\n",
        header(),
        line(&s),
        s.catch_up.as_str(),
        s.random_delay_ms,
        s.submit.project,
        s.submit.retry_budget
    );
    for f in store.fires(name, 20).await.map_err(|e| e.to_string())? {
        out += &format!(
            "  {:<24} {:<8} {}\n",
            when(Some(f.fire_at)),
            f.outcome.as_str(),
            f.run.as_ref().map_or("-", |r| r.as_str())
        );
    }
    Ok(out)
}

/// Pauses (`true`) or resumes a schedule.
pub async fn pause<S: Store>(store: &S, name: &str, paused: bool) -> Result<String, String> {
    match execute(store, Command::PauseSchedule(name.to_owned(), paused)).await? {
        Reply::Schedule(s) if s.paused => Ok(format!("{} paused", s.name)),
        Reply::Schedule(s) => Ok(format!("{} resumed; next fire {}", s.name, when(Some(s.due_at)))),
        other => Err(format!("unexpected answer {other:?}")),
    }
}

/// Removes a schedule.
pub async fn remove<S: Store>(store: &S, name: &str) -> Result<String, String> {
    execute(store, Command::RemoveSchedule(name.to_owned())).await?;
    Ok(format!("{name} removed (its runs stay)"))
}

/// Submits a schedule's run now.
pub async fn run_now<S: Store>(store: &S, name: &str) -> Result<String, String> {
    match execute(store, Command::RunScheduleNow(name.to_owned())).await? {
        Reply::Submitted(run) => Ok(run.to_string()),
        other => Err(format!("unexpected answer {other:?}")),
    }
}
