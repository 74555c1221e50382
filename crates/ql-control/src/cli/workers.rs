//! The commands about workers: `workers` (sessions, certificates, revoke, disable,
//! enable) and `label`.

use std::path::PathBuf;

use argh::FromArgs;

use crate::{with_target, worker_id, Reach};

/// Set the labels the operator vouches for of a worker, replacing the ones it had (none
/// clears them). `submit --label` matches these, never what an agent declares.
#[derive(FromArgs)]
#[argh(subcommand, name = "label")]
pub(crate) struct Label {
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

/// List workers by id, each with its newest session (generation, status, capacity, last
/// heartbeat), access and the certificate's not-after; or disable, enable or revoke one.
#[derive(FromArgs)]
#[argh(subcommand, name = "workers")]
pub(crate) struct Workers {
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
    /// only workers whose id comes after this one (the next page)
    #[argh(option)]
    after: Option<String>,
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
    /// with --serial, also revoke every certificate renewed from it, however many
    /// renewals down (a copied certificate its holder may have renewed)
    #[argh(switch)]
    with_renewals: bool,
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

/// List the recorded worker certificates by worker, newest first: serial, issued,
/// not-after, revoked, renewed from.
#[derive(FromArgs)]
#[argh(subcommand, name = "certificates")]
struct Certificates {
    #[argh(option)]
    /// state directory
    dir: Option<PathBuf>,
    #[argh(option)]
    /// the authority's PostgreSQL URL (or $QL_CONTROL_DATABASE)
    database: Option<String>,
    /// only this worker's certificates
    #[argh(option)]
    worker: Option<String>,
    /// how many (default 50)
    #[argh(option, default = "50")]
    limit: usize,
    /// only the certificates listed after the one with this serial (the next page)
    #[argh(option)]
    after: Option<String>,
}

pub(crate) fn workers(reach: &Reach, cmd: Workers) -> Result<(), String> {
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
    let access = |worker: &str, access, serial: Option<String>, renewals| {
        Ok::<_, String>((worker_id(worker)?, access, serial, renewals))
    };
    let change = match &cmd.action {
        None | Some(WorkersAction::Certificates(_)) => None,
        Some(WorkersAction::Revoke(a)) => Some(access(&a.worker, Access::Revoke, a.serial.clone(), a.with_renewals)?),
        Some(WorkersAction::Disable(a)) => Some(access(&a.worker, Access::Disable, None, false)?),
        Some(WorkersAction::Enable(a)) => Some(access(&a.worker, Access::Enable, None, false)?),
    };
    let out = with_target(reach, dir.or(cmd.dir), database.or(cmd.database), async |t| {
        Ok(match (&cmd.action, change) {
            (_, Some((worker, access, serial, with_renewals))) => {
                let change = ql_control::ops::AccessChange { access, serial: serial.as_deref(), with_renewals };
                t.set_access(&worker, change).await?.message + "\n"
            }
            (Some(WorkersAction::Certificates(c)), None) => {
                text::certificates(&t.certificates(c.worker.as_deref(), c.after.as_deref(), c.limit).await?)
            }
            (_, None) => text::workers(&t.workers(cmd.limit, cmd.after.as_deref()).await?),
        })
    })?;
    print!("{out}");
    Ok(())
}

pub(crate) fn label(reach: &Reach, cmd: Label) -> Result<(), String> {
    let worker = worker_id(&cmd.worker)?;
    let done = with_target(reach, cmd.dir, cmd.database, async |t| t.label(&worker, &cmd.labels).await)?;
    println!("{}", done.message);
    Ok(())
}
