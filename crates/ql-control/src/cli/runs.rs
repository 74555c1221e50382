//! The commands about runs: `submit`, `cancel`, `runs`, `show` and `logs`, on the state
//! directory's authority or through `--server`.

use std::path::PathBuf;

use argh::FromArgs;
use ql_control::admin::{self, SubmitArgs};

use crate::{run_id, with_target, with_target_reading, Reach};

/// Queue a run: a program and its arguments after `--`, or --script FILE.
#[derive(FromArgs)]
#[argh(subcommand, name = "submit")]
pub(crate) struct SubmitCmd {
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
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
    /// time limit in milliseconds (default one hour)
    #[argh(option, default = "3_600_000")]
    timeout_ms: u64,
    /// bytes of log kept (default 1 MiB, at most 64 MiB)
    #[argh(option, default = "1_048_576")]
    log_limit: u64,
    /// key=value the operator gave the worker (`ql-control label`) that it must carry
    /// to be offered the run (repeatable)
    #[argh(option)]
    label: Vec<String>,
    /// key=value the worker's agent must declare (its own say, not vouched for;
    /// repeatable)
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
    /// the program and its arguments
    #[argh(positional, greedy)]
    argv: Vec<String>,
}

/// Cancel a run: at once if no worker holds it, else at the worker's next renewal.
#[derive(FromArgs)]
#[argh(subcommand, name = "cancel")]
pub(crate) struct Cancel {
    /// the run
    #[argh(positional)]
    run: String,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// List runs, newest first.
#[derive(FromArgs)]
#[argh(subcommand, name = "runs")]
pub(crate) struct Runs {
    /// only runs this schedule submitted
    #[argh(option)]
    schedule: Option<String>,
    /// only runs with this status (queued, dispatching, running, succeeded, failed,
    /// cancelled, timed_out)
    #[argh(option)]
    status: Option<String>,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
    /// how many (default 50, at most 500)
    #[argh(option, default = "50")]
    limit: usize,
    /// only runs older than this one (the next page)
    #[argh(option)]
    before: Option<String>,
    /// only runs offered to this worker
    #[argh(option)]
    worker: Option<String>,
}

/// Show a run with its attempts and events.
#[derive(FromArgs)]
#[argh(subcommand, name = "show")]
pub(crate) struct Show {
    /// the run
    #[argh(positional)]
    run: String,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
    /// print JSON instead of text
    #[argh(switch)]
    json: bool,
}

/// Print a run's log: the stored one, SHA-256 checked against its receipt, or what has
/// arrived so far of a running job's; --follow prints it as it grows until the run ends.
#[derive(FromArgs)]
#[argh(subcommand, name = "logs")]
pub(crate) struct Logs {
    /// the run
    #[argh(positional)]
    run: String,
    /// keep printing the log as it arrives, until the run is terminal
    #[argh(switch, short = 'f')]
    follow: bool,
    /// with --follow, how often to look for more (default 500 ms)
    #[argh(option, default = "500")]
    poll_ms: u64,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
    /// where stored logs live, as for serve: s3://bucket/prefix (default: control.json's
    /// artifacts; or $QL_CONTROL_ARTIFACTS)
    #[argh(option)]
    artifacts: Option<String>,
}

impl SubmitCmd {
    /// What `submit` queues, as a schedule takes it too.
    fn args(self) -> (SubmitArgs, Option<PathBuf>, Option<String>) {
        let args = SubmitArgs {
            project: self.project,
            argv: self.argv,
            script: self.script,
            interpreter: self.interpreter,
            env: self.env,
            timeout_ms: self.timeout_ms,
            log_limit: self.log_limit,
            labels: self.label,
            agent_labels: self.agent_label,
            retries: self.retries,
            notify: self.notify,
            notify_on: self.notify_on,
        };
        (args, self.dir, self.database)
    }
}

pub(crate) fn submit(reach: &Reach, cmd: SubmitCmd) -> Result<(), String> {
    let (args, dir, database) = cmd.args();
    let body = admin::body_of(&args)?;
    let done = with_target(reach, dir, database, async |t| t.submit(&body).await)?;
    println!("{}", done.message);
    Ok(())
}

pub(crate) fn cancel(reach: &Reach, cmd: Cancel) -> Result<(), String> {
    let run = run_id(&cmd.run)?;
    let done = with_target(reach, cmd.dir, cmd.database, async |t| t.cancel(&run).await)?;
    println!("{}", done.message);
    Ok(())
}

pub(crate) fn runs(reach: &Reach, cmd: Runs) -> Result<(), String> {
    let filter = ql_control::ops::RunFilter {
        schedule: cmd.schedule,
        status: cmd.status,
        limit: cmd.limit,
        before: cmd.before,
        worker: cmd.worker,
    };
    let page = with_target(reach, cmd.dir, cmd.database, async |t| t.runs(&filter).await)?;
    print!("{}", ql_control::ops::text::runs(&page));
    Ok(())
}

pub(crate) fn show(reach: &Reach, cmd: Show) -> Result<(), String> {
    let run = run_id(&cmd.run)?;
    let view = with_target(reach, cmd.dir, cmd.database, async |t| t.run(&run).await)?;
    if cmd.json {
        println!("{}", serde_json::to_string_pretty(&view).expect("JSON"));
    } else {
        print!("{}", ql_control::ops::text::run(&view));
    }
    Ok(())
}

pub(crate) fn logs(reach: &Reach, cmd: Logs) -> Result<(), String> {
    let run = run_id(&cmd.run)?;
    let follow = cmd.follow.then(|| std::time::Duration::from_millis(cmd.poll_ms.max(1)));
    with_target_reading(reach, cmd.dir, cmd.database, cmd.artifacts, async |t| {
        ql_control::logs::logs(t, &run, follow, &mut std::io::stdout().lock())
            .await
            .map_err(|e| ql_control::ops::OpError::new(ql_wire::ErrorCode::Unavailable, e))
    })
}
