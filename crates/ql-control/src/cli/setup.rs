//! The commands that set a control plane up and run it: `init` (a state directory, or
//! a replica's copy of one), `enroll`, `operator`, `migrate` and `serve`.

use std::path::{Path, PathBuf};

use argh::FromArgs;
use ql_control::admin;
use ql_control::config::{Config, Layout};

use crate::{database, runtime, state_dir, with_authority, worker_id};

/// Apply the PostgreSQL schema migrations, connected as the migration owner (ql_owner).
#[derive(FromArgs)]
#[argh(subcommand, name = "migrate")]
pub(crate) struct Migrate {
    /// the owner's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    #[argh(option)]
    database: Option<String>,
}

/// Create a state directory: worker CA, server certificate, database, artifact
/// directory and control.json with every default written out.
#[derive(FromArgs)]
#[argh(subcommand, name = "init")]
pub(crate) struct Init {
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
pub(crate) struct Enroll {
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

/// Serve the worker protocol over HTTPS with mutual TLS, and sweep lapsed leases.
#[derive(FromArgs)]
#[argh(subcommand, name = "serve")]
pub(crate) struct Serve {
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
pub(crate) struct OperatorCmd {
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

pub(crate) fn init(cmd: Init) -> Result<(), String> {
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

pub(crate) fn enroll(cmd: Enroll) -> Result<(), String> {
    let worker = worker_id(&cmd.worker)?;
    use ql_control::identity;
    // Refuse bad labels and bad combinations before anything is issued.
    admin::labels_of(&cmd.label, "--label")?;
    if cmd.token == cmd.out.is_some() {
        return Err("enroll takes either --token (the agent makes its key) or --out DIR (a key made here)".into());
    }
    let dir = state_dir(cmd.dir.clone());
    let config = Config::load(&Layout::new(&dir))?;
    let ca = if cmd.token { None } else { Some(ql_control::pki::Ca::load(&dir).map_err(|e| e.to_string())?) };
    if let Some(out) = &cmd.out {
        ql_control::pki::check_out(&dir, &worker, out).map_err(|e| e.to_string())?;
    }
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

pub(crate) fn operator(cmd: OperatorCmd) -> Result<(), String> {
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

pub(crate) fn serve(cmd: Serve) -> Result<(), String> {
    ql_control::serve::run(
        &state_dir(cmd.dir),
        ql_control::serve::Listen { workers: cmd.listen, operators: cmd.operator_listen, artifacts: cmd.artifacts },
        database(cmd.database),
    )
}

pub(crate) fn migrate(cmd: Migrate) -> Result<(), String> {
    let url = database(cmd.database).ok_or("migrate needs --database <the migration owner's PostgreSQL URL>")?;
    runtime().block_on(async move {
        let (before, now) = ql_control::store::postgres::migrate(&url).await.map_err(|e| e.to_string())?;
        println!("schema version {before} -> {now}");
        Ok(())
    })
}
