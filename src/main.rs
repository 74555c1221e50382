//! `ql-agent`: the QingLong Edge worker daemon.
//!
//! - `ql-agent run`: the daemon ([`agent`]);
//! - `ql-agent check`: validates the configuration and credentials against ql-control
//!   ([`check`]);
//! - `ql-agent enroll`: gets this device's certificate with a one-time token ([`enrol`]);
//! - `ql-agent version`;
//! - `ql-agent supervise`: one job's supervisor, started by the agent ([`exec`]).
//!
//! Module map: [`config`] (settings), [`log`] (stderr lines), [`core`] (the pure job state
//! machine), [`agent`] (the one loop that performs it), [`client`] (the one mTLS
//! connection), [`journal`] (durable facts), [`exec`] (process groups).

use argh::FromArgs;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

#[macro_use]
mod log;
mod agent;
mod check;
mod client;
mod config;
mod core;
mod enrol;
mod fault;
mod identity;
// The agent uses a subset of the journal's and the executor's API; the rest is exercised
// by their own tests.
#[allow(dead_code, unused_imports)]
mod exec;
#[allow(dead_code, unused_imports)]
mod journal;

/// QingLong Edge agent: runs scheduled scripts handed out by ql-control.
#[derive(FromArgs)]
struct Cli {
    #[argh(subcommand)]
    command: Command,
}

#[derive(FromArgs)]
#[argh(subcommand)]
enum Command {
    Run(Run),
    Check(Check),
    Enroll(Enroll),
    Version(Version),
}

/// Enrol this device with a one-time token from `ql-control enroll WORKER --token`: its
/// key is made here and never sent; the server's CA must have the fingerprint given.
/// Writes `<worker>.key` (0600), `<worker>.crt` and `ca.crt` into --dir.
#[derive(FromArgs)]
#[argh(subcommand, name = "enroll")]
struct Enroll {
    /// ql-control's base URL, https://host:port
    #[argh(option)]
    server: String,
    /// the token `ql-control enroll --token` printed (or use --token-file)
    #[argh(option)]
    token: Option<String>,
    /// a file holding the token, `-` for standard input (keeps it out of `ps`)
    #[argh(option)]
    token_file: Option<PathBuf>,
    /// the SHA-256 fingerprint of the server's CA, as `ql-control enroll` printed it
    #[argh(option)]
    ca_fingerprint: String,
    /// where the files go (default /etc/ql-agent)
    #[argh(option, default = "PathBuf::from(\"/etc/ql-agent\")")]
    dir: PathBuf,
    /// TCP connect plus TLS handshake, and each call, in milliseconds (default 15000)
    #[argh(option, default = "15_000")]
    timeout_ms: u64,
}

fn enroll(args: Enroll) -> Result<String, String> {
    let token = match (args.token, args.token_file) {
        (Some(token), None) => zeroize::Zeroizing::new(token),
        (None, Some(path)) if path.as_os_str() == "-" => {
            let mut token = zeroize::Zeroizing::new(String::new());
            std::io::stdin().read_line(&mut token).map_err(|e| format!("reading the token: {e}"))?;
            token
        }
        (None, Some(path)) => {
            zeroize::Zeroizing::new(std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?)
        }
        _ => return Err("give the token with --token or --token-file".into()),
    };
    let wait = std::time::Duration::from_millis(args.timeout_ms);
    let timeouts = client::Timeouts { connect: wait, call: wait, poll_slack: wait, upload: wait };
    let done = enrol::enroll(&args.server, &token, &args.ca_fingerprint, &args.dir, timeouts)?;
    let (w, dir) = (&done.worker, args.dir.display());
    Ok(format!(
        "enrolled {w}: {dir}/{w}.key (made here, mode 0600), {dir}/{w}.crt (valid until {}, renewed by the agent), \
         {dir}/ca.crt\nnext: server = {} and worker_id = {w} in the agent's configuration, then start it",
        done.not_after, args.server
    ))
}

/// Declares a subcommand that takes the configuration flags.
macro_rules! with_config_flags {
    ($(#[$meta:meta])* struct $name:ident;) => {
        #[derive(FromArgs)]
        $(#[$meta])*
        struct $name {
            /// the config file (default: /etc/ql-agent/agent.conf, when it exists)
            #[argh(option)]
            config: Option<PathBuf>,
            /// ql-control's base URL, https://host:port
            #[argh(option)]
            server: Option<String>,
            /// this worker's id
            #[argh(option)]
            worker_id: Option<String>,
            /// client certificate chain (PEM)
            #[argh(option)]
            cert: Option<String>,
            /// client private key (PEM)
            #[argh(option)]
            key: Option<String>,
            /// the CA that signed the server certificate (PEM)
            #[argh(option)]
            ca: Option<String>,
            /// journal and run directories
            #[argh(option)]
            state_dir: Option<String>,
            /// jobs run at once, 1..=64
            #[argh(option)]
            capacity: Option<String>,
            /// error, warn, info or debug
            #[argh(option)]
            log_level: Option<String>,
            /// any setting, as key=value (repeatable)
            #[argh(option)]
            set: Vec<String>,
        }

        impl $name {
            fn load(&self) -> Result<config::Config, config::ConfigError> {
                let mut sources = match &self.config {
                    Some(path) => config::Sources::from_file(path)?,
                    None => {
                        let default = std::path::Path::new(config::DEFAULT_PATH);
                        if default.exists() {
                            config::Sources::from_file(default)?
                        } else {
                            config::Sources::default()
                        }
                    }
                };
                let flags = [
                    ("--server", "server", &self.server),
                    ("--worker-id", "worker_id", &self.worker_id),
                    ("--cert", "cert", &self.cert),
                    ("--key", "key", &self.key),
                    ("--ca", "ca", &self.ca),
                    ("--state-dir", "state_dir", &self.state_dir),
                    ("--capacity", "capacity", &self.capacity),
                    ("--log-level", "log_level", &self.log_level),
                ];
                for (flag, key, value) in flags {
                    if let Some(value) = value {
                        sources.set_flag(flag, key, value)?;
                    }
                }
                for pair in &self.set {
                    sources.set_pair(pair)?;
                }
                sources.finish()
            }
        }
    };
}

with_config_flags! {
    /// Run the agent daemon.
    #[argh(subcommand, name = "run")]
    struct Run;
}

with_config_flags! {
    /// Check the configuration, the credentials and the connection to ql-control.
    #[argh(subcommand, name = "check")]
    struct Check;
}

/// Print the agent's version and the protocol it speaks.
#[derive(FromArgs)]
#[argh(subcommand, name = "version")]
struct Version {}

fn main() -> ExitCode {
    // `ql-agent supervise ...` is the agent's own way to run a job (exec::supervise), not a
    // command for people: it stays out of --help.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(exec::supervise::SUPERVISE) {
        return ExitCode::from(u8::try_from(exec::supervise::main(&args[2..])).unwrap_or(1));
    }
    let cli: Cli = argh::from_env();
    match cli.command {
        Command::Version(Version {}) => {
            println!("ql-agent {} (protocol {})", env!("CARGO_PKG_VERSION"), ql_wire::spec::SpecSchema::TEXT);
            ExitCode::SUCCESS
        }
        Command::Check(args) => {
            let cfg = match args.load() {
                Ok(cfg) => cfg,
                Err(e) => return fail("configuration", &e.to_string()),
            };
            match check::check(&cfg) {
                Ok(lines) => {
                    for line in lines {
                        println!("{line}");
                    }
                    println!("ok");
                    ExitCode::SUCCESS
                }
                Err(e) => fail("check failed", &e.0),
            }
        }
        Command::Enroll(args) => match enroll(args) {
            Ok(done) => {
                println!("{done}");
                ExitCode::SUCCESS
            }
            Err(e) => fail("enroll", &e),
        },
        Command::Run(args) => {
            let cfg = match args.load() {
                Ok(cfg) => cfg,
                Err(e) => return fail("configuration", &e.to_string()),
            };
            log::set_level(cfg.log_level);
            match run(cfg) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail("fatal", &e),
            }
        }
    }
}

fn fail(what: &str, why: &str) -> ExitCode {
    eprintln!("error: {what}: {why}");
    ExitCode::FAILURE
}

fn run(cfg: config::Config) -> Result<(), String> {
    if let Some(done) = identity::recover(&cfg.key, &cfg.cert)? {
        warn!("certificate: {done}");
    }
    let creds = client::Credentials::load(&cfg.cert, &cfg.key, &cfg.ca).map_err(|e| e.0)?;
    if let [one] = creds.certificate_workers().as_slice() {
        if one != cfg.worker_id.as_str() {
            warn!("the certificate is for worker `{one}` but worker_id is `{}`; the server will refuse", cfg.worker_id);
        }
    }
    let timeouts = client::Timeouts {
        connect: cfg.connect_timeout,
        call: cfg.call_timeout,
        // call_timeout is the allowance on top of a long-poll's own wait.
        poll_slack: std::time::Duration::ZERO,
        upload: cfg.upload_timeout,
    };
    let client = client::Client::new(&cfg.server, &creds, timeouts).map_err(|e| e.0)?;
    drop(creds);
    let ex = Rc::new(smol::LocalExecutor::new());
    let agent = agent::Agent::new(cfg, client, ex.clone()).map_err(|e| e.0)?;
    run_local(&ex, Box::pin(async move { agent.run().await.map_err(|e| e.0) }))
}

/// A program's main future, boxed: block_on and the executor move it around by value, and
/// each copy on the main thread's stack stays resident (about 40 KiB of RSS). One type for
/// the agent and a job's supervisor, so the executor's code is in the binary once.
pub(crate) type MainFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>>>>;

/// Runs `main` on `ex`, one thread. Children are reaped on this executor, which keeps
/// async-process from starting a thread of its own.
pub(crate) fn run_local(ex: &smol::LocalExecutor<'static>, main: MainFuture) -> Result<(), String> {
    ex.spawn(smol::process::driver()).detach();
    smol::block_on(ex.run(main))
}
