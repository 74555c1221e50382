//! `ql-control`: the QingLong Edge control plane — the one authority the agents talk to,
//! and the operator's tool to enrol workers, submit and cancel runs, and read results.

use argh::FromArgs;
use std::path::PathBuf;
use std::process::ExitCode;

use ql_control::admin::{self, SubmitArgs};
use ql_control::config::{Config, Layout};
use ql_wire::ids::{RunId, WorkerId};

/// QingLong Edge control plane. Every command works on one state directory: --dir, or
/// $QL_CONTROL_DIR, or /var/lib/ql-control. The authority is that directory's SQLite
/// file, unless --database (or $QL_CONTROL_DATABASE) names a PostgreSQL database.
#[derive(FromArgs)]
struct Cli {
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
    /// how many (default 50)
    #[argh(option, default = "50")]
    limit: usize,
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

fn schedule(cmd: ScheduleCmd) -> Result<(), String> {
    use ql_control::schedules;
    let out = match cmd.action {
        ScheduleAction::Add(a) => {
            let args = schedules::ScheduleArgs {
                name: a.name,
                cron: a.cron,
                tz: a.tz,
                random_delay_ms: a.random_delay_ms,
                overlap: a.overlap,
                catch_up: a.catch_up,
                submit: SubmitArgs {
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
                },
            };
            // Refuse what could never fire before opening anything.
            schedules::spec_of(&args)?;
            with_authority(a.dir, a.database, async |store| schedules::add(store, &args).await)?
        }
        ScheduleAction::List(a) => with_authority(a.dir, a.database, async |store| schedules::list(store).await)?,
        ScheduleAction::Show(a) => {
            with_authority(a.dir, a.database, async |store| schedules::show(store, &a.name).await)?
        }
        ScheduleAction::Pause(a) => {
            with_authority(a.dir, a.database, async |store| schedules::pause(store, &a.name, true).await)?
        }
        ScheduleAction::Resume(a) => {
            with_authority(a.dir, a.database, async |store| schedules::pause(store, &a.name, false).await)?
        }
        ScheduleAction::Remove(a) => {
            with_authority(a.dir, a.database, async |store| schedules::remove(store, &a.name).await)?
        }
        ScheduleAction::RunNow(a) => {
            with_authority(a.dir, a.database, async |store| schedules::run_now(store, &a.name).await)?
        }
    };
    println!("{}", out.trim_end());
    Ok(())
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

fn worker_id(text: &str) -> Result<WorkerId, String> {
    WorkerId::parse(text).map_err(|e| format!("{text:?} is not a worker name ([a-z0-9][a-z0-9._-]{{0,62}}): {e}"))
}

fn run_id(text: &str) -> Result<RunId, String> {
    RunId::parse(text).map_err(|e| format!("{text:?} is not a run id: {e}"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime starts")
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
    // Owner only, whatever the umask: the directory holds the CA key and the database.
    let private_dir = |path: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::create_dir_all(path)
            .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| format!("{}: {e}", path.display()))
    };
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
            println!("{}", admin::label_worker(store, &worker, &cmd.label).await?);
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

fn workers(cmd: Workers) -> Result<(), String> {
    use ql_control::core::Access;
    use ql_control::identity;
    // The state directory and database may be given before or after the action.
    let (dir, database) = match &cmd.action {
        None => (None, None),
        Some(WorkersAction::Certificates(a)) => (a.dir.clone(), a.database.clone()),
        Some(WorkersAction::Revoke(a)) => (a.dir.clone(), a.database.clone()),
        Some(WorkersAction::Disable(a)) => (a.dir.clone(), a.database.clone()),
        Some(WorkersAction::Enable(a)) => (a.dir.clone(), a.database.clone()),
    };
    with_authority(dir.or(cmd.dir), database.or(cmd.database), async |store| {
        let line = match cmd.action {
            None => admin::workers(store, cmd.limit).await?,
            Some(WorkersAction::Certificates(_)) => identity::certificates(store).await?,
            Some(WorkersAction::Revoke(Revoke { worker, serial: Some(serial), .. })) => {
                identity::revoke_certificate(store, &worker_id(&worker)?, &serial).await? + "\n"
            }
            Some(WorkersAction::Revoke(Revoke { worker, serial: None, .. })) => {
                identity::set_access(store, &worker_id(&worker)?, Access::Revoke).await? + "\n"
            }
            Some(WorkersAction::Disable(Disable { worker, .. })) => {
                identity::set_access(store, &worker_id(&worker)?, Access::Disable).await? + "\n"
            }
            Some(WorkersAction::Enable(Enable { worker, .. })) => {
                identity::set_access(store, &worker_id(&worker)?, Access::Enable).await? + "\n"
            }
        };
        print!("{line}");
        Ok(())
    })
}

fn main() -> ExitCode {
    let cli: Cli = argh::from_env();
    let result = match cli.command {
        Cmd::Version(Version {}) => {
            println!("ql-control {} (protocol qinglong/worker v1)", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Cmd::Init(cmd) => init(cmd),
        Cmd::Enroll(cmd) => worker_id(&cmd.worker).and_then(|worker| enroll(cmd, worker)),
        Cmd::Label(cmd) => worker_id(&cmd.worker).and_then(|worker| {
            with_authority(cmd.dir, cmd.database, async |store| {
                println!("{}", admin::label_worker(store, &worker, &cmd.labels).await?);
                Ok(())
            })
        }),
        Cmd::Serve(cmd) => ql_control::serve::run(&state_dir(cmd.dir), cmd.listen, database(cmd.database)),
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
            };
            with_authority(cmd.dir, cmd.database, async |store| {
                println!("{}", admin::submit(store, &args).await?);
                Ok(())
            })
        }
        Cmd::Cancel(cmd) => run_id(&cmd.run).and_then(|run| {
            with_authority(cmd.dir, cmd.database, async |store| {
                println!("{}", admin::cancel(store, &run).await?);
                Ok(())
            })
        }),
        Cmd::Runs(cmd) => with_authority(cmd.dir, cmd.database, async |store| {
            let status = match &cmd.status {
                None => None,
                Some(s) => Some(
                    ql_control::model::RunStatus::parse(s)
                        .ok_or_else(|| format!("--status {s:?} is not a run status"))?,
                ),
            };
            let query = ql_control::store::RunQuery { schedule: cmd.schedule.clone(), status, limit: cmd.limit };
            print!("{}", admin::runs(store, &query).await?);
            Ok(())
        }),
        Cmd::Show(cmd) => run_id(&cmd.run).and_then(|run| {
            let d = with_authority(cmd.dir, cmd.database, async |store| admin::detail(store, &run).await)?;
            if cmd.json {
                println!("{}", serde_json::to_string_pretty(&admin::detail_json(&d)).expect("JSON"));
            } else {
                print!("{}", admin::detail_text(&d));
            }
            Ok(())
        }),
        Cmd::Logs(cmd) => run_id(&cmd.run).and_then(|run| {
            let blobs = admin::open_blobs(&state_dir(cmd.dir.clone()))?;
            with_authority(cmd.dir, cmd.database, async |store| {
                let follow = cmd.follow.then(|| std::time::Duration::from_millis(cmd.poll_ms.max(1)));
                ql_control::logs::logs(store, &blobs, &run, follow, &mut std::io::stdout().lock()).await
            })
        }),
        Cmd::Workers(cmd) => workers(cmd),
        Cmd::Schedule(cmd) => schedule(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ql-control: {e}");
            ExitCode::FAILURE
        }
    }
}
