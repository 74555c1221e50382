//! `ql-control`: the QingLong Edge control plane — the one authority the agents talk to,
//! and the operator's tool to enrol workers, submit and cancel runs, and read results.

use argh::FromArgs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ql_control::admin::{self, SubmitArgs};
use ql_control::config::{Config, Layout};
use ql_wire::ids::{RunId, WorkerId};

/// QingLong Edge control plane. Every command works on one state directory: --dir, or
/// $QL_CONTROL_DIR, or /var/lib/ql-control. The authority is that directory's SQLite
/// file, unless --database (or $QL_CONTROL_DATABASE) names a PostgreSQL database. With
/// --server (or $QL_CONTROL_SERVER), the operator commands (submit, cancel, runs, show,
/// logs, workers, label, schedule) go to that serve's operator API instead.
#[derive(FromArgs)]
struct Cli {
    /// a serve's operator API, https://host:port (default: work on the state directory)
    #[argh(option)]
    server: Option<String>,
    /// with --server: a file holding the operator token (default $QL_CONTROL_TOKEN)
    #[argh(option)]
    token_file: Option<PathBuf>,
    /// with --server: the CA certificate that signed the server's (default $QL_CONTROL_CA,
    /// else the state directory's ca.crt)
    #[argh(option)]
    ca: Option<PathBuf>,
    #[argh(subcommand)]
    command: Cmd,
}

#[derive(FromArgs)]
#[argh(subcommand)]
enum Cmd {
    Init(Init),
    Enroll(Enroll),
    Serve(Serve),
    Submit(SubmitCmd),
    Cancel(Cancel),
    Runs(Runs),
    Show(Show),
    Logs(Logs),
    Workers(Workers),
    Label(Label),
    Schedule(ScheduleCmd),
    Operator(OperatorCmd),
    Migrate(Migrate),
    Version(Version),
}

/// Apply the PostgreSQL schema migrations, connected as the migration owner (ql_owner).
#[derive(FromArgs)]
#[argh(subcommand, name = "migrate")]
struct Migrate {
    /// the owner's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// Create a state directory: worker CA, server certificate, database, artifact
/// directory and control.json with every default written out.
#[derive(FromArgs)]
#[argh(subcommand, name = "init")]
struct Init {
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// a DNS name or IP address agents use to reach this server (repeatable;
    /// default: localhost and 127.0.0.1)
    #[argh(option)]
    host: Vec<String>,
    /// address to listen on (default 0.0.0.0:8443), stored in control.json
    #[argh(option)]
    listen: Option<String>,
    /// on an initialised directory: issue the server certificate again under the same CA
    /// (for --host names, default the current ones); workers keep their certificates
    #[argh(switch)]
    renew_server_cert: bool,
    /// make --dir the state directory of another replica of this initialised one: the
    /// same CA and settings, a server certificate of its own for --host, no CA key
    /// (unless --with-ca-key) and no database (replicas share PostgreSQL)
    #[argh(option)]
    replica_of: Option<PathBuf>,
    /// with --replica-of: give the replica the CA key too, so it enrols and renews workers
    #[argh(switch)]
    with_ca_key: bool,
}

/// Enrol a worker: with --token, print a one-time token for `ql-agent enroll` on the
/// device (its key never leaves it); with --out, issue its certificate and key here
/// (with the CA certificate) to copy over, for air-gapped setups.
#[derive(FromArgs)]
#[argh(subcommand, name = "enroll")]
struct Enroll {
    /// the worker's name: [a-z0-9][a-z0-9._-]{0,62}
    #[argh(positional)]
    worker: String,
    /// directory to write <worker>.crt, <worker>.key and ca.crt into
    #[argh(option)]
    out: Option<PathBuf>,
    /// print a one-time enrolment token instead of issuing a key
    #[argh(switch)]
    token: bool,
    /// how long the token can be used, in milliseconds (default: control.json's
    /// enrolment_token_ttl_ms, one hour)
    #[argh(option)]
    token_ttl_ms: Option<u64>,
    /// the server URL the agent will use, for the printed command (default
    /// https://<first host of the server certificate>:<listen port>)
    #[argh(option)]
    server: Option<String>,
    /// revoke every certificate the worker had before issuing the new one (a replaced
    /// device, a re-enrolment after a theft)
    #[argh(switch)]
    replace: bool,
    /// key=value the operator vouches for of this worker (repeatable): runs submitted
    /// with --label match these; replaces the worker's labels when given
    #[argh(option)]
    label: Vec<String>,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, for --label (default: the state directory's
    /// SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// Set the labels the operator vouches for of a worker, replacing the ones it had (none
/// clears them). `submit --label` matches these, never what an agent declares.
#[derive(FromArgs)]
#[argh(subcommand, name = "label")]
struct Label {
    /// the worker
    #[argh(positional)]
    worker: String,
    /// key=value labels
    #[argh(positional, greedy)]
    labels: Vec<String>,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// Serve the worker protocol over HTTPS with mutual TLS, and sweep lapsed leases.
#[derive(FromArgs)]
#[argh(subcommand, name = "serve")]
struct Serve {
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
    /// address to listen on (overrides control.json); port 0 picks a free port
    #[argh(option)]
    listen: Option<String>,
    /// address of the operator API (overrides control.json's operator_listen; "" for
    /// none); port 0 picks a free port
    #[argh(option)]
    operator_listen: Option<String>,
    /// where artifacts live: s3://bucket/prefix for a bucket the replicas share
    /// (overrides control.json's artifacts; or $QL_CONTROL_ARTIFACTS; default: the state
    /// directory's artifacts/)
    #[argh(option)]
    artifacts: Option<String>,
}

/// Operator API credentials: bearer tokens for `--server` and the API, stored as digests.
#[derive(FromArgs)]
#[argh(subcommand, name = "operator")]
struct OperatorCmd {
    #[argh(subcommand)]
    action: OperatorAction,
}

#[derive(FromArgs)]
#[argh(subcommand)]
enum OperatorAction {
    Add(OperatorAdd),
    List(OperatorList),
    Remove(OperatorRemove),
}

/// Add an operator and print its token once: read (look) or admin (also change).
#[derive(FromArgs)]
#[argh(subcommand, name = "add")]
struct OperatorAdd {
    /// the operator's name: [a-z0-9][a-z0-9._-]{0,62}
    #[argh(positional)]
    name: String,
    /// read (default) or admin
    #[argh(option, default = "String::from(\"read\")")]
    role: String,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// List operators: name, role, created (never a token).
#[derive(FromArgs)]
#[argh(subcommand, name = "list")]
struct OperatorList {
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// Remove an operator: its token is refused from the next request on.
#[derive(FromArgs)]
#[argh(subcommand, name = "remove")]
struct OperatorRemove {
    /// the operator
    #[argh(positional)]
    name: String,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// Queue a run: a program and its arguments after `--`, or --script FILE.
#[derive(FromArgs)]
#[argh(subcommand, name = "submit")]
struct SubmitCmd {
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
struct Cancel {
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
struct Runs {
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
struct Show {
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
struct Logs {
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

/// List worker sessions (generation, status, capacity, last heartbeat, access, the
/// certificate's not-after); or disable, enable or revoke a worker.
#[derive(FromArgs)]
#[argh(subcommand, name = "workers")]
struct Workers {
    #[argh(subcommand)]
    action: Option<WorkersAction>,
    /// state directory
    #[argh(option)]
    dir: Option<PathBuf>,
    /// the authority's PostgreSQL URL, as the runtime role (default: the state
    /// directory's SQLite file; or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
    /// how many (default 50)
    #[argh(option, default = "50")]
    limit: usize,
}

#[derive(FromArgs)]
#[argh(subcommand)]
enum WorkersAction {
    Revoke(Revoke),
    Disable(Disable),
    Enable(Enable),
    Certificates(Certificates),
}

/// Revoke a worker: every certificate issued to it so far (or with --serial, one) is
/// refused from its next request on, on every replica; its sessions close and its
/// running attempts are lost and queued again within their retry budget.
#[derive(FromArgs)]
#[argh(subcommand, name = "revoke")]
struct Revoke {
    /// the worker
    #[argh(positional)]
    worker: String,
    /// revoke only the certificate with this serial (`workers certificates`)
    #[argh(option)]
    serial: Option<String>,
    #[argh(option)]
    /// state directory
    dir: Option<PathBuf>,
    #[argh(option)]
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    database: Option<String>,
}

/// Disable a worker until `workers enable`: its certificates are refused, its sessions
/// close and its running attempts are queued again.
#[derive(FromArgs)]
#[argh(subcommand, name = "disable")]
struct Disable {
    /// the worker
    #[argh(positional)]
    worker: String,
    #[argh(option)]
    /// state directory
    dir: Option<PathBuf>,
    #[argh(option)]
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    database: Option<String>,
}

/// Enable a disabled worker again (revoked certificates stay revoked).
#[derive(FromArgs)]
#[argh(subcommand, name = "enable")]
struct Enable {
    /// the worker
    #[argh(positional)]
    worker: String,
    #[argh(option)]
    /// state directory
    dir: Option<PathBuf>,
    #[argh(option)]
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    database: Option<String>,
}

/// List the recorded worker certificates: serial, issued, not-after, revoked.
#[derive(FromArgs)]
#[argh(subcommand, name = "certificates")]
struct Certificates {
    #[argh(option)]
    /// state directory
    dir: Option<PathBuf>,
    #[argh(option)]
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    database: Option<String>,
}

/// Schedules: runs submitted at the times a cron expression names (fired by `serve`).
#[derive(FromArgs)]
#[argh(subcommand, name = "schedule")]
struct ScheduleCmd {
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

fn schedule(reach: &Reach, cmd: ScheduleCmd) -> Result<(), String> {
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

fn operator(cmd: OperatorCmd) -> Result<(), String> {
    use ql_control::identity;
    match cmd.action {
        OperatorAction::Add(a) => {
            let role =
                ql_control::model::Role::parse(&a.role).ok_or_else(|| format!("--role {:?}: read or admin", a.role))?;
            ql_control::core::check_operator_name(&a.name)?;
            with_authority(a.dir, a.database, async |store| {
                let token = identity::add_operator(store, &a.name, role).await?;
                println!("operator {} ({}); its token, shown this once:", a.name, role.as_str());
                println!("{}", token.as_str());
                Ok(())
            })
        }
        OperatorAction::List(a) => with_authority(a.dir, a.database, async |store| {
            print!("{}", identity::operators(store).await?);
            Ok(())
        }),
        OperatorAction::Remove(a) => with_authority(a.dir, a.database, async |store| {
            println!("{}", identity::remove_operator(store, &a.name).await?);
            Ok(())
        }),
    }
}

/// Where the operator commands go: the global --server, --token-file and --ca.
struct Reach {
    server: Option<String>,
    token_file: Option<PathBuf>,
    ca: Option<PathBuf>,
}

impl Reach {
    fn server(&self) -> Option<String> {
        self.server.clone().or_else(|| std::env::var("QL_CONTROL_SERVER").ok()).filter(|s| !s.is_empty())
    }

    /// The remote side, when --server names one.
    fn remote(&self, dir: Option<PathBuf>) -> Result<Option<ql_control::ops::Remote>, String> {
        let Some(server) = self.server() else {
            return Ok(None);
        };
        let token = match &self.token_file {
            Some(path) => {
                let text = ql_control::pki::read_secret(path).map_err(|e| e.to_string())?;
                zeroize::Zeroizing::new(text.trim().to_owned())
            }
            None => zeroize::Zeroizing::new(
                std::env::var("QL_CONTROL_TOKEN")
                    .map_err(|_| "--server needs an operator token: --token-file FILE or $QL_CONTROL_TOKEN")?,
            ),
        };
        let ca = self
            .ca
            .clone()
            .or_else(|| std::env::var_os("QL_CONTROL_CA").map(PathBuf::from))
            .unwrap_or_else(|| ql_control::pki::PkiPaths::new(&state_dir(dir)).ca_cert);
        let options = ql_control::ops::RemoteOptions { server, token, ca, timeout: std::time::Duration::from_secs(30) };
        Ok(Some(ql_control::ops::Remote::new(&options)?))
    }
}

/// Runs `f` on the operator commands' target: the remote serve when --server is given,
/// else the authority of the state directory or database (in one runtime: a PostgreSQL
/// store lives on the runtime that opened it).
fn with_target<T>(
    reach: &Reach,
    dir: Option<PathBuf>,
    db: Option<String>,
    f: impl AsyncFnOnce(&ql_control::ops::Target) -> Result<T, ql_control::ops::OpError>,
) -> Result<T, String> {
    with_target_reading(reach, dir, db, None, f)
}

/// [`with_target`] for a command that reads stored logs: `artifacts` names their store
/// when the state directory's settings do not.
fn with_target_reading<T>(
    reach: &Reach,
    dir: Option<PathBuf>,
    db: Option<String>,
    artifacts: Option<String>,
    f: impl AsyncFnOnce(&ql_control::ops::Target) -> Result<T, ql_control::ops::OpError>,
) -> Result<T, String> {
    use ql_control::ops::{Local, Target};
    let remote = reach.remote(dir.clone())?;
    runtime().block_on(async move {
        let target = match remote {
            Some(remote) => Target::Remote(remote),
            None => {
                let dir = state_dir(dir);
                let (store, _) = admin::open_authority(&dir, database(db).as_deref()).await?;
                Target::Local(Local { store, blobs: admin::open_blobs(&dir, artifacts.as_deref())? })
            }
        };
        f(&target).await.map_err(String::from)
    })
}

/// Print the version.
#[derive(FromArgs)]
#[argh(subcommand, name = "version")]
struct Version {}

fn state_dir(dir: Option<PathBuf>) -> PathBuf {
    dir.or_else(|| std::env::var_os("QL_CONTROL_DIR").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("/var/lib/ql-control"))
}

/// The PostgreSQL URL, if any: the flag, else $QL_CONTROL_DATABASE.
fn database(flag: Option<String>) -> Option<String> {
    flag.or_else(|| std::env::var("QL_CONTROL_DATABASE").ok()).filter(|s| !s.is_empty())
}

/// Runs `f` on the authority in one runtime (a PostgreSQL store lives on the runtime
/// that opened it).
fn with_authority<T>(
    dir: Option<PathBuf>,
    db: Option<String>,
    f: impl AsyncFnOnce(&admin::Authority) -> Result<T, String>,
) -> Result<T, String> {
    let dir = state_dir(dir);
    runtime().block_on(async move {
        let (store, _) = admin::open_authority(&dir, database(db).as_deref()).await?;
        f(&store).await
    })
}

/// Refuses --server for a command that needs the state directory itself (its CA key, or
/// the credentials it makes).
fn local_only(reach: &Reach, command: &str) -> Result<(), String> {
    match reach.server() {
        Some(_) => Err(format!("{command} works on the state directory or database only, not through --server")),
        None => Ok(()),
    }
}

fn worker_id(text: &str) -> Result<WorkerId, String> {
    WorkerId::parse(text).map_err(|e| format!("{text:?} is not a worker name ([a-z0-9][a-z0-9._-]{{0,62}}): {e}"))
}

fn run_id(text: &str) -> Result<RunId, String> {
    RunId::parse(text).map_err(|e| format!("{text:?} is not a run id: {e}"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime starts")
}

/// Creates `path` (and its parents) owner-only, whatever the umask.
fn private_dir(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(path)
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `init --replica-of FROM --dir TO`: the directory to copy to another replica's machine.
fn init_replica(from: &Path, to: &Path, hosts: &[String], with_ca_key: bool) -> Result<(), String> {
    let source = Layout::new(from);
    let config = Config::load(&source)?;
    if hosts.is_empty() {
        return Err("--replica-of needs --host: the names agents reach the replica by".into());
    }
    // What every replica must agree on besides the database and the bucket: the settings,
    // and the keys webhooks and dashboard sessions are signed with (made now if absent).
    let keys = [&config.webhook_secret_file, &config.dashboard_secret_file];
    let keys: Vec<_> = keys
        .iter()
        .map(|name| ql_control::keys::key_file(&from.join(name)).map(|key| (name.to_string(), key)))
        .collect::<Result<_, _>>()?;
    private_dir(to)?;
    let layout = Layout::new(to);
    layout.check_private()?;
    ql_control::pki::init_replica(from, to, hosts, with_ca_key).map_err(|e| e.to_string())?;
    config.save(&layout)?;
    for (name, key) in keys {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let path = to.join(&name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(key.as_bytes()).and_then(|()| f.sync_all()))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    println!(
        "initialised {} as a replica of {} for {}{}",
        to.display(),
        from.display(),
        hosts.join(", "),
        if with_ca_key { ", with the CA key" } else { "" }
    );
    println!(
        "next: copy it to the replica's machine (scp -rp keeps its modes), then ql-control serve --dir DIR \
         --database postgres://... --artifacts s3://bucket/prefix"
    );
    Ok(())
}

fn init(cmd: Init) -> Result<(), String> {
    let dir = state_dir(cmd.dir);
    let layout = Layout::new(&dir);
    if cmd.renew_server_cert {
        layout.check_private()?;
        let paths = ql_control::pki::renew_server_cert(&dir, &cmd.host).map_err(|e| e.to_string())?;
        let hosts = ql_control::pki::server_hosts(&dir).map_err(|e| e.to_string())?;
        println!(
            "issued {} again for {}; restart ql-control serve to use it",
            paths.server_cert.display(),
            hosts.join(", ")
        );
        return Ok(());
    }
    if layout.config().exists() {
        return Err(format!("{} is already initialised (found {})", dir.display(), layout.config().display()));
    }
    if let Some(from) = cmd.replica_of {
        return init_replica(&from, &dir, &cmd.host, cmd.with_ca_key);
    }
    if cmd.with_ca_key {
        return Err("--with-ca-key goes with --replica-of (a new state directory has its CA key)".into());
    }
    // Owner only, whatever the umask: the directory holds the CA key and the database.
    private_dir(&dir)?;
    layout.check_private()?;
    let hosts = if cmd.host.is_empty() { vec!["localhost".into(), "127.0.0.1".into()] } else { cmd.host };
    ql_control::pki::init_pki(&dir, &hosts).map_err(|e| e.to_string())?;
    let config = Config { listen: cmd.listen.unwrap_or_else(|| Config::default().listen), ..Config::default() };
    config.save(&layout)?;
    private_dir(&layout.artifacts())?;
    // Creating the store applies the schema now, so a broken disk shows up at init.
    let (_store, _) = admin::open_store(&dir)?;
    println!("initialised {} for {}", dir.display(), hosts.join(", "));
    println!(
        "next: ql-control enroll WORKER --dir {} --out DIR, then ql-control serve --dir {}",
        dir.display(),
        dir.display()
    );
    Ok(())
}

fn enroll(cmd: Enroll, worker: WorkerId) -> Result<(), String> {
    use ql_control::identity;
    // Refuse bad labels and bad combinations before anything is issued.
    admin::labels_of(&cmd.label, "--label")?;
    if cmd.token == cmd.out.is_some() {
        return Err("enroll takes either --token (the agent makes its key) or --out DIR (a key made here)".into());
    }
    let dir = state_dir(cmd.dir.clone());
    let config = Config::load(&Layout::new(&dir))?;
    let ca = if cmd.token { None } else { Some(ql_control::pki::Ca::load(&dir).map_err(|e| e.to_string())?) };
    with_authority(cmd.dir, cmd.database, async |store| {
        if cmd.replace {
            let done = identity::set_access(store, &worker, ql_control::core::Access::Revoke).await?;
            println!("{done}");
        }
        if !cmd.label.is_empty() {
            let local = ql_control::ops::Local { store: store.clone(), blobs: admin::open_blobs(&dir, None)? };
            println!("{}", local.label(&worker, &cmd.label).await?.message);
        }
        match (&cmd.out, ca) {
            (Some(out), _) => {
                let lifetime = config.worker_cert_lifetime();
                let (done, issued) =
                    ql_control::pki::enroll(&dir, &worker, out, lifetime).map_err(|e| e.to_string())?;
                identity::record_issued(store, &worker, &issued).await?;
                println!("enrolled {worker}: {} {} {}", done.cert.display(), done.key.display(), done.ca.display());
                println!("certificate serial {}, valid until {}", issued.serial, millis_text(issued.not_after_ms));
            }
            (None, _) => {
                let ttl = std::time::Duration::from_millis(cmd.token_ttl_ms.unwrap_or(config.enrolment_token_ttl_ms));
                let token = identity::create_token(store, &worker, ttl).await?;
                let fingerprint = ql_control::pki::ca_fingerprint(&dir).map_err(|e| e.to_string())?;
                let server = cmd.server.clone().unwrap_or_else(|| default_server(&dir, &config));
                println!("enrolment token for {worker} (single use, valid for {} s):", ttl.as_secs());
                println!("{token}");
                println!("on the device:");
                println!("  ql-agent enroll --server {server} --token {token} --ca-fingerprint {fingerprint}");
            }
        }
        Ok(())
    })
}

fn millis_text(ms: i64) -> String {
    ql_wire::time::Timestamp::from_millis(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

/// `https://<first name of the server certificate>:<port ql-control listens on>`.
fn default_server(dir: &std::path::Path, config: &Config) -> String {
    let host =
        ql_control::pki::server_hosts(dir).ok().and_then(|h| h.into_iter().next()).unwrap_or_else(|| "HOST".into());
    let port = config.listen.rsplit_once(':').map_or("8443", |(_, p)| p);
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    format!("https://{host}:{port}")
}

fn workers(reach: &Reach, cmd: Workers) -> Result<(), String> {
    use ql_control::core::Access;
    use ql_control::ops::text;
    // The state directory and database may be given before or after the action.
    let (dir, database) = match &cmd.action {
        None => (None, None),
        Some(WorkersAction::Certificates(a)) => (a.dir.clone(), a.database.clone()),
        Some(WorkersAction::Revoke(a)) => (a.dir.clone(), a.database.clone()),
        Some(WorkersAction::Disable(a)) => (a.dir.clone(), a.database.clone()),
        Some(WorkersAction::Enable(a)) => (a.dir.clone(), a.database.clone()),
    };
    let access = |worker: &str, access, serial: Option<String>| Ok::<_, String>((worker_id(worker)?, access, serial));
    let change = match &cmd.action {
        None | Some(WorkersAction::Certificates(_)) => None,
        Some(WorkersAction::Revoke(a)) => Some(access(&a.worker, Access::Revoke, a.serial.clone())?),
        Some(WorkersAction::Disable(a)) => Some(access(&a.worker, Access::Disable, None)?),
        Some(WorkersAction::Enable(a)) => Some(access(&a.worker, Access::Enable, None)?),
    };
    let out = with_target(reach, dir.or(cmd.dir), database.or(cmd.database), async |t| {
        Ok(match (&cmd.action, change) {
            (_, Some((worker, access, serial))) => {
                t.set_access(&worker, access, serial.as_deref()).await?.message + "\n"
            }
            (Some(WorkersAction::Certificates(_)), None) => text::certificates(&t.certificates().await?),
            (_, None) => text::workers(&t.workers(cmd.limit).await?),
        })
    })?;
    print!("{out}");
    Ok(())
}

fn main() -> ExitCode {
    let cli: Cli = argh::from_env();
    let reach = Reach { server: cli.server, token_file: cli.token_file, ca: cli.ca };
    let result = match cli.command {
        Cmd::Version(Version {}) => {
            println!("ql-control {} (protocol qinglong/worker v1)", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Cmd::Init(cmd) => local_only(&reach, "init").and_then(|()| init(cmd)),
        Cmd::Enroll(cmd) => {
            local_only(&reach, "enroll").and_then(|()| worker_id(&cmd.worker)).and_then(|worker| enroll(cmd, worker))
        }
        Cmd::Label(cmd) => worker_id(&cmd.worker).and_then(|worker| {
            let done = with_target(&reach, cmd.dir, cmd.database, async |t| t.label(&worker, &cmd.labels).await)?;
            println!("{}", done.message);
            Ok(())
        }),
        Cmd::Serve(cmd) => ql_control::serve::run(
            &state_dir(cmd.dir),
            ql_control::serve::Listen { workers: cmd.listen, operators: cmd.operator_listen, artifacts: cmd.artifacts },
            database(cmd.database),
        ),
        Cmd::Migrate(cmd) => match database(cmd.database) {
            None => Err("migrate needs --database <the migration owner's PostgreSQL URL>".to_owned()),
            Some(url) => runtime().block_on(async move {
                let (before, now) = ql_control::store::postgres::migrate(&url).await.map_err(|e| e.to_string())?;
                println!("schema version {before} -> {now}");
                Ok(())
            }),
        },
        Cmd::Submit(cmd) => {
            let args = SubmitArgs {
                project: cmd.project,
                argv: cmd.argv,
                script: cmd.script,
                interpreter: cmd.interpreter,
                env: cmd.env,
                timeout_ms: cmd.timeout_ms,
                log_limit: cmd.log_limit,
                labels: cmd.label,
                agent_labels: cmd.agent_label,
                retries: cmd.retries,
                notify: cmd.notify,
                notify_on: cmd.notify_on,
            };
            admin::body_of(&args).and_then(|body| {
                let done = with_target(&reach, cmd.dir, cmd.database, async |t| t.submit(&body).await)?;
                println!("{}", done.message);
                Ok(())
            })
        }
        Cmd::Cancel(cmd) => run_id(&cmd.run).and_then(|run| {
            let done = with_target(&reach, cmd.dir, cmd.database, async |t| t.cancel(&run).await)?;
            println!("{}", done.message);
            Ok(())
        }),
        Cmd::Runs(cmd) => {
            let filter = ql_control::ops::RunFilter {
                schedule: cmd.schedule,
                status: cmd.status,
                limit: cmd.limit,
                before: cmd.before,
                worker: cmd.worker,
            };
            with_target(&reach, cmd.dir, cmd.database, async |t| t.runs(&filter).await).map(|page| {
                print!("{}", ql_control::ops::text::runs(&page));
            })
        }
        Cmd::Show(cmd) => run_id(&cmd.run).and_then(|run| {
            let view = with_target(&reach, cmd.dir, cmd.database, async |t| t.run(&run).await)?;
            if cmd.json {
                println!("{}", serde_json::to_string_pretty(&view).expect("JSON"));
            } else {
                print!("{}", ql_control::ops::text::run(&view));
            }
            Ok(())
        }),
        Cmd::Logs(cmd) => run_id(&cmd.run).and_then(|run| {
            let follow = cmd.follow.then(|| std::time::Duration::from_millis(cmd.poll_ms.max(1)));
            with_target_reading(&reach, cmd.dir, cmd.database, cmd.artifacts, async |t| {
                ql_control::logs::logs(t, &run, follow, &mut std::io::stdout().lock())
                    .await
                    .map_err(|e| ql_control::ops::OpError::new(ql_wire::ErrorCode::Unavailable, e))
            })
        }),
        Cmd::Workers(cmd) => workers(&reach, cmd),
        Cmd::Schedule(cmd) => schedule(&reach, cmd),
        Cmd::Operator(cmd) => local_only(&reach, "operator").and_then(|()| operator(cmd)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ql-control: {e}");
            ExitCode::FAILURE
        }
    }
}
