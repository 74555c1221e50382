//! `ql-control`: the QingLong Edge control plane — the one authority the agents talk to,
//! and the operator's tool to enrol workers, submit and cancel runs, and read results.
//!
//! Here: the command line, where an operator command goes (`--server` or the state
//! directory), and the dispatch; each family of commands in `cli/`.

use argh::FromArgs;
use std::path::PathBuf;
use std::process::ExitCode;

use ql_control::admin;
use ql_wire::ids::{RunId, WorkerId};

use cli::runs::{Cancel, Logs, Runs, Show, SubmitCmd};
use cli::schedules::ScheduleCmd;
use cli::setup::{Enroll, Init, Migrate, OperatorCmd, Serve};
use cli::workers::{Label, Workers};

/// The server allocates for every request, statement and row it reads. mimalloc took
/// 12 % off the server's CPU per ACK against glibc's malloc (bench/RESULTS.md), with the
/// same memory per idle agent.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod cli {
    pub(crate) mod runs;
    pub(crate) mod schedules;
    pub(crate) mod setup;
    pub(crate) mod workers;
}

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
        Some(_) => Err(format!(
            "{command} works on the state directory or database only, not through --server (or $QL_CONTROL_SERVER)"
        )),
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

fn main() -> ExitCode {
    let cli: Cli = argh::from_env();
    let reach = Reach { server: cli.server, token_file: cli.token_file, ca: cli.ca };
    let result = match cli.command {
        Cmd::Version(Version {}) => {
            println!("ql-control {} (protocol qinglong/worker v1)", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Cmd::Init(cmd) => local_only(&reach, "init").and_then(|()| cli::setup::init(cmd)),
        Cmd::Enroll(cmd) => local_only(&reach, "enroll").and_then(|()| cli::setup::enroll(cmd)),
        Cmd::Label(cmd) => cli::workers::label(&reach, cmd),
        Cmd::Serve(cmd) => local_only(&reach, "serve").and_then(|()| cli::setup::serve(cmd)),
        Cmd::Migrate(cmd) => local_only(&reach, "migrate").and_then(|()| cli::setup::migrate(cmd)),
        Cmd::Submit(cmd) => cli::runs::submit(&reach, cmd),
        Cmd::Cancel(cmd) => cli::runs::cancel(&reach, cmd),
        Cmd::Runs(cmd) => cli::runs::runs(&reach, cmd),
        Cmd::Show(cmd) => cli::runs::show(&reach, cmd),
        Cmd::Logs(cmd) => cli::runs::logs(&reach, cmd),
        Cmd::Workers(cmd) => cli::workers::workers(&reach, cmd),
        Cmd::Schedule(cmd) => cli::schedules::schedule(&reach, cmd),
        Cmd::Operator(cmd) => local_only(&reach, "operator").and_then(|()| cli::setup::operator(cmd)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ql-control: {e}");
            ExitCode::FAILURE
        }
    }
}
