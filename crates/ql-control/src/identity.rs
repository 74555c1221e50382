//! The operator's side of a worker identity: disable, enable and revoke a worker or one
//! of its certificates, record what `enroll` issues, and make one-time enrolment tokens.
//! Each goes through the store's one decision code ([`crate::core`]), so a revocation
//! applies on every replica of the same database from the next request on.
//!
//! An enrolment token is printed once as `<workerId>.<secret>`: the agent needs nothing
//! else to know which worker it enrols. The authority keeps only the secret's SHA-256.

use std::time::Duration;

use ql_wire::capability::Token;
use ql_wire::ids::WorkerId;

use crate::core::{Access, AccessChanged, Command, Issuer, Reply};
use crate::model::{Certificate, Role};
use crate::pki::Issued;
use crate::store::Store;
use zeroize::Zeroizing;

async fn execute<S: Store>(store: &S, cmd: Command) -> Result<Reply, String> {
    match store.execute(cmd).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(code)) => Err(format!("refused: {code}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Disables, enables or revokes `worker`, and says what that ended.
pub async fn set_access<S: Store>(store: &S, worker: &WorkerId, access: Access) -> Result<String, String> {
    let Reply::AccessChanged(AccessChanged { sessions, attempts, certificates, unknown }) =
        execute(store, Command::SetAccess(worker.clone(), access)).await?
    else {
        return Err("unexpected answer".into());
    };
    let said = match access {
        Access::Enable => format!("{worker} enabled"),
        Access::Disable => format!(
            "{worker} disabled: {sessions} session(s) closed, {attempts} attempt(s) lost and their runs queued again"
        ),
        Access::Revoke => format!(
            "{worker} revoked: {certificates} recorded certificate(s) and any unrecorded one refused, {sessions} \
             session(s) closed, {attempts} attempt(s) lost and their runs queued again; enrol it again to bring it back"
        ),
    };
    Ok(if unknown {
        format!(
            "{said}\nnote: nothing here named {worker} before (no record, session, certificate or token): check the \
             name; `ql-control workers` lists the workers"
        )
    } else {
        said
    })
}

/// Revokes the certificate with `serial` (as `ql-control workers certificates` shows it),
/// and with `renewals` every certificate renewed from it.
pub async fn revoke_certificate<S: Store>(
    store: &S,
    worker: &WorkerId,
    serial: &str,
    renewals: bool,
) -> Result<String, String> {
    let serial = serial.trim().to_ascii_lowercase().replace(':', "");
    match execute(store, Command::RevokeCertificate(worker.clone(), serial, renewals)).await {
        Ok(Reply::CertificateRevoked(c, 0)) => Ok(format!("certificate {} of {} revoked", c.serial, c.worker)),
        Ok(Reply::CertificateRevoked(c, renewed)) => Ok(format!(
            "certificate {} of {} revoked, with {renewed} certificate(s) renewed from it",
            c.serial, c.worker
        )),
        Ok(_) => Err("unexpected answer".into()),
        Err(e) if e.ends_with("not_found") => Err(format!("no certificate of {worker} with that serial is recorded")),
        Err(e) => Err(e),
    }
}

/// Records a certificate `enroll` just issued.
pub async fn record_issued<S: Store>(store: &S, worker: &WorkerId, issued: &Issued) -> Result<(), String> {
    let cert = certificate(worker, issued);
    execute(store, Command::RecordCertificate(cert, Issuer::Operator)).await.map(drop)
}

/// The record of `issued` (its `issued_at` is set by the store).
pub fn certificate(worker: &WorkerId, issued: &Issued) -> Certificate {
    Certificate {
        serial: issued.serial.clone(),
        worker: worker.clone(),
        issued_at: 0,
        not_after: issued.not_after_ms,
        revoked_at: None,
        renewed_from: None,
    }
}

/// Makes a one-time enrolment token for `worker`, valid for `ttl`; returns its text,
/// which is shown once and never stored.
pub async fn create_token<S: Store>(store: &S, worker: &WorkerId, ttl: Duration) -> Result<String, String> {
    let token = Token::generate().map_err(|e| format!("no randomness: {e}"))?;
    let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
    execute(store, Command::CreateEnrolment(worker.clone(), token.digest(), ttl_ms)).await?;
    Ok(format!("{worker}.{}", token.expose()))
}

/// Adds an operator API credential named `name` with `role`; returns its token, shown
/// once: the authority keeps only the secret's SHA-256.
pub async fn add_operator<S: Store>(store: &S, name: &str, role: Role) -> Result<Zeroizing<String>, String> {
    crate::core::check_operator_name(name)?;
    let token = Token::generate().map_err(|e| format!("no randomness: {e}"))?;
    match store.execute(Command::AddOperator(name.to_owned(), role, token.digest())).await {
        Ok(Ok(_)) => Ok(Zeroizing::new(format!("{name}.{}", token.expose()))),
        Ok(Err(ql_wire::ErrorCode::StateConflict)) => {
            Err(format!("an operator {name:?} exists already: `ql-control operator remove {name}` first"))
        }
        Ok(Err(code)) => Err(format!("refused: {code}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Removes an operator API credential: its token is refused from the next request on.
pub async fn remove_operator<S: Store>(store: &S, name: &str) -> Result<String, String> {
    match execute(store, Command::RemoveOperator(name.to_owned())).await {
        Ok(_) => Ok(format!("operator {name} removed; its token is refused from now on")),
        Err(e) if e.ends_with("not_found") => Err(format!("no operator {name:?} (see `ql-control operator list`)")),
        Err(e) => Err(e),
    }
}

/// The operator credentials, one line each (never a digest).
pub async fn operators<S: Store>(store: &S) -> Result<String, String> {
    let all = store.operators().await.map_err(|e| e.to_string())?;
    let mut out = format!("{:<24} {:<6} {}\n", "OPERATOR", "ROLE", "CREATED");
    for o in all {
        out += &format!("{:<24} {:<6} {}\n", o.name, o.role.as_str(), crate::ops::view::time(o.created_at));
    }
    Ok(out)
}

/// Splits an enrolment token's text into its worker and secret.
pub fn parse_token(text: &str) -> Option<(WorkerId, Token)> {
    let (worker, secret) = text.trim().rsplit_once('.')?;
    Some((WorkerId::parse(worker).ok()?, Token::parse(secret).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_worker_and_nothing_else_parses() {
        let token = Token::generate().unwrap();
        let text = format!("router.home-1.{}", token.expose());
        let (worker, secret) = parse_token(&text).unwrap();
        assert_eq!(worker.as_str(), "router.home-1");
        assert_eq!(secret.digest(), token.digest());
        for bad in ["", "router-1", ".abc", &format!("Router.{}", token.expose()), "router-1.short"] {
            assert!(parse_token(bad).is_none(), "{bad:?}");
        }
    }
}
