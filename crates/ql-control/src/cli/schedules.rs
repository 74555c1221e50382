//! `schedule`: add, list, show, pause, resume, remove and run-now, on the state
//! directory's authority or through `--server`.

use std::path::PathBuf;

use argh::FromArgs;
use ql_control::admin::{self, SubmitArgs};

use crate::{with_target, Reach};

/// Schedules: runs submitted at the times a cron expression names (fired by `serve`).
#[derive(FromArgs)]
#[argh(subcommand, name = "schedule")]
pub(crate) struct ScheduleCmd {
    #[argh(subcommand)]
    action: ScheduleAction,
}

#[derive(FromArgs)]
#[argh(subcommand)]
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
enum ScheduleAction {
    Add(ScheduleAdd),
    List(ScheduleList),
    Show(ScheduleName),
    Pause(SchedulePause),
    Resume(ScheduleResume),
    Remove(ScheduleRemove),
    RunNow(ScheduleRunNow),
}

/// Add a schedule: what to run (as `submit` takes it) and when.
#[derive(FromArgs)]
#[argh(subcommand, name = "add")]
struct ScheduleAdd {
    /// the schedule's name: [a-z0-9][a-z0-9._-]{0,63}
    #[argh(positional)]
    name: String,
    /// cron expression: five fields, or six with seconds first ("0 30 7 * * *")
    #[argh(option)]
    cron: String,
    /// IANA time zone the expression is read in (default UTC)
    #[argh(option, default = "String::from(\"UTC\")")]
    tz: String,
    /// each fire waits a random delay of up to this many milliseconds (default 0)
    #[argh(option, default = "0")]
    random_delay_ms: u64,
    /// while the previous run has not ended: skip (default), queue or allow
    #[argh(option, default = "String::from(\"skip\")")]
    overlap: String,
    /// a fire missed while no ql-control ran: none (default) or once
    #[argh(option, default = "String::from(\"none\")")]
    catch_up: String,
    /// project (default "default")
    #[argh(option, default = "String::from(\"default\")")]
    project: String,
    /// a script file to run with --interpreter
    #[argh(option)]
    script: Option<PathBuf>,
    /// sh (default), python3 or node
    #[argh(option)]
    interpreter: Option<String>,
    /// NAME=value added to the job's environment (repeatable)
    #[argh(option)]
    env: Vec<String>,
    /// time limit of each run in milliseconds (default one hour)
    #[argh(option, default = "3_600_000")]
    timeout_ms: u64,
    /// bytes of log kept (default 1 MiB)
    #[argh(option, default = "1_048_576")]
    log_limit: u64,
    /// key=value the operator gave the worker that it must carry (repeatable)
    #[argh(option)]
    label: Vec<String>,
    /// key=value the worker's agent must declare (repeatable)
    #[argh(option)]
    agent_label: Vec<String>,
    /// times a run whose worker vanished is queued again (default 0)
    #[argh(option, default = "0")]
    retries: u32,
    /// a webhook URL POSTed the run's end (signed with the webhook key)
    #[argh(option)]
    notify: Option<String>,
    /// with --notify: all (default) or failure (failed and timed_out only)
    #[argh(option)]
    notify_on: Option<String>,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
    /// the program and its arguments
    #[argh(positional, greedy)]
    argv: Vec<String>,
}

/// Declares a schedule subcommand that takes a name and the authority's flags.
macro_rules! schedule_named {
    ($(#[$meta:meta])* $name:ident, $word:literal) => {
        $(#[$meta])*
        #[derive(FromArgs)]
        #[argh(subcommand, name = $word)]
        struct $name {
            /// the schedule
            #[argh(positional)]
            name: String,
            /// state directory
            #[argh(option)]
            dir: Option<PathBuf>,
            /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
            #[argh(option)]
            database: Option<String>,
        }
    };
}

schedule_named!(
    /// Show a schedule and its recent fires.
    ScheduleName, "show"
);
schedule_named!(
    /// Pause a schedule: it fires nothing until resumed.
    SchedulePause, "pause"
);
schedule_named!(
    /// Resume a schedule from its next time after now.
    ScheduleResume, "resume"
);
schedule_named!(
    /// Remove a schedule (its runs stay).
    ScheduleRemove, "remove"
);
schedule_named!(
    /// Submit a schedule's run now, outside its times.
    ScheduleRunNow, "run-now"
);

/// List schedules: cron, time zone, overlap, next fire, last run.
#[derive(FromArgs)]
#[argh(subcommand, name = "list")]
struct ScheduleList {
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

pub(crate) fn schedule(reach: &Reach, cmd: ScheduleCmd) -> Result<(), String> {
    use ql_control::ops::{text, ScheduleAction as Act};
    let (dir, database) = match &cmd.action {
        ScheduleAction::Add(a) => (a.dir.clone(), a.database.clone()),
        ScheduleAction::List(a) => (a.dir.clone(), a.database.clone()),
        ScheduleAction::Show(a) => (a.dir.clone(), a.database.clone()),
        ScheduleAction::Pause(a) => (a.dir.clone(), a.database.clone()),
        ScheduleAction::Resume(a) => (a.dir.clone(), a.database.clone()),
        ScheduleAction::Remove(a) => (a.dir.clone(), a.database.clone()),
        ScheduleAction::RunNow(a) => (a.dir.clone(), a.database.clone()),
    };
    let named = |name: &str, action| (name.to_owned(), action);
    let out = match cmd.action {
        ScheduleAction::Add(a) => {
            let run = admin::body_of(&SubmitArgs {
                project: a.project,
                argv: a.argv,
                script: a.script,
                interpreter: a.interpreter,
                env: a.env,
                timeout_ms: a.timeout_ms,
                log_limit: a.log_limit,
                labels: a.label,
                agent_labels: a.agent_label,
                retries: a.retries,
                notify: a.notify,
                notify_on: a.notify_on,
            })?;
            let body = ql_control::ops::view::ScheduleBody {
                name: a.name,
                cron: a.cron,
                tz: a.tz,
                random_delay_ms: a.random_delay_ms,
                overlap: a.overlap,
                catch_up: a.catch_up,
                run,
            };
            // Refuse what could never fire before opening anything.
            ql_control::ops::local::schedule_of(&body)?;
            with_target(reach, dir, database, async |t| Ok(t.add_schedule(&body).await?.message))?
        }
        ScheduleAction::List(_) => {
            with_target(reach, dir, database, async |t| Ok(text::schedules(&t.schedules().await?)))?
        }
        ScheduleAction::Show(a) => {
            with_target(reach, dir, database, async |t| Ok(text::schedule(&t.schedule(&a.name).await?)))?
        }
        other => {
            let (name, action) = match other {
                ScheduleAction::Pause(a) => named(&a.name, Act::Pause),
                ScheduleAction::Resume(a) => named(&a.name, Act::Resume),
                ScheduleAction::Remove(a) => named(&a.name, Act::Remove),
                ScheduleAction::RunNow(a) => named(&a.name, Act::RunNow),
                ScheduleAction::Add(_) | ScheduleAction::List(_) | ScheduleAction::Show(_) => unreachable!(),
            };
            with_target(reach, dir, database, async |t| Ok(t.schedule_action(&name, action).await?.message))?
        }
    };
    println!("{}", out.trim_end());
    Ok(())
}
