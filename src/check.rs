//! `ql-agent check`: proves the configuration, the credentials and the path to ql-control
//! work, without disturbing a running agent.
//!
//! It opens no journal and no session (opening one would replace the running agent's). It
//! sends one heartbeat for a session that cannot exist (`check`, generation 1). Getting
//! `404 not_found` back proves the TLS 1.3 handshake against the configured CA, the client
//! certificate, and the server's binding of the path's worker id to the certificate's
//! principal; `403 principal_mismatch` means `worker_id` is not the certificate's. The
//! server writes an audit record of the probe, nothing else.

use ql_wire::ids::{Counter, SessionId};
use ql_wire::route::Route;
use ql_wire::session::{Heartbeat, HeartbeatReply};
use ql_wire::ErrorCode;

use crate::client::{CallError, Client, Credentials, Timeouts};
use crate::config::Config;

/// The session id of the probe.
pub(crate) const PROBE_SESSION: &str = "check";

/// Why the check failed, phrased for the operator.
#[derive(Debug)]
pub(crate) struct CheckFailed(pub(crate) String);

fn wall_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn text(ms: i64) -> String {
    ql_wire::time::Timestamp::from_millis(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

/// The certificate's validity at `now_ms`: a line, a warning when its renewal is overdue
/// (the agent renews it over its connection at two thirds of its lifetime), or a failure
/// once it has expired.
fn validity(cert_pem: &[u8], now_ms: i64) -> Result<String, CheckFailed> {
    let Some((not_before, not_after)) =
        crate::identity::first_certificate(cert_pem).and_then(|der| crate::identity::validity(&der))
    else {
        return Err(CheckFailed("the certificate file holds no readable certificate".into()));
    };
    let due = crate::identity::renew_at((not_before, not_after));
    if now_ms >= not_after {
        return Err(CheckFailed(format!(
            "the certificate expired at {}: enrol this device again (ql-control enroll <worker> --token)",
            text(not_after)
        )));
    }
    if now_ms >= due {
        return Ok(format!(
            "warning: certificate renewal is overdue (due {}, valid until {}): is the agent running and reaching the server?",
            text(due),
            text(not_after)
        ));
    }
    Ok(format!("certificate valid until {} (the agent renews it from {})", text(not_after), text(due)))
}

/// Runs the check. On success, returns the lines to print.
pub(crate) fn check(cfg: &Config) -> Result<Vec<String>, CheckFailed> {
    let mut out = Vec::new();
    if let Some(done) = crate::identity::recover(&cfg.key, &cfg.cert).map_err(CheckFailed)? {
        out.push(format!("certificate: {done}"));
    }
    let creds = Credentials::load(&cfg.cert, &cfg.key, &cfg.ca).map_err(|e| CheckFailed(e.0))?;
    let named = creds.certificate_workers();
    match named.as_slice() {
        [one] if one == cfg.worker_id.as_str() => out.push(format!("certificate principal: urn:qinglong:worker:{one}")),
        [one] => {
            return Err(CheckFailed(format!(
                "the certificate is for worker `{one}` but worker_id is `{}`",
                cfg.worker_id
            )))
        }
        [] => return Err(CheckFailed("the certificate names no urn:qinglong:worker:<id> URI".into())),
        _ => {
            return Err(CheckFailed(format!("the certificate names {} workers; the server refuses that", named.len())))
        }
    }
    let timeouts = Timeouts {
        connect: cfg.connect_timeout,
        call: cfg.call_timeout,
        poll_slack: std::time::Duration::ZERO,
        upload: cfg.upload_timeout,
    };
    out.push(validity(&creds.cert_pem, wall_ms())?);
    let client = Client::new(&cfg.server, &creds, timeouts).map_err(|e| CheckFailed(e.0))?;
    let route = Route::Heartbeat(cfg.worker_id.clone(), SessionId::parse(PROBE_SESSION).expect("a valid id"));
    let body = Heartbeat { generation: Counter::ONE, draining: false };
    match client.call::<Heartbeat, HeartbeatReply>(&route, &body) {
        Err(CallError::Refused { code: ErrorCode::NotFound, .. }) => {
            out.push(format!("server {}: TLS 1.3 with the client certificate accepted", cfg.server));
            out.push(format!(
                "worker {}: principal bound (probe heartbeat of session `{PROBE_SESSION}` answered 404 not_found, as expected)",
                cfg.worker_id
            ));
            Ok(out)
        }
        Err(CallError::Refused { code: ErrorCode::PrincipalMismatch, .. }) => Err(CheckFailed(format!(
            "the server says worker_id `{}` is not this certificate's worker (403 principal_mismatch)",
            cfg.worker_id
        ))),
        Err(CallError::Refused {
            code: code @ (ErrorCode::CertificateRevoked | ErrorCode::WorkerDisabled), ..
        }) => Err(CheckFailed(format!("the server refuses this worker: 403 {code}; ask its operator"))),
        Err(CallError::Refused { code: ErrorCode::Unauthenticated, .. }) => {
            Err(CheckFailed("the server refused the client certificate (401 unauthenticated)".into()))
        }
        Err(CallError::Refused { status, code, .. }) => {
            Err(CheckFailed(format!("the server answered {status} {code} to the probe; expected 404 not_found")))
        }
        Err(CallError::Transport(e)) => Err(CheckFailed(format!("cannot reach {}: {e}", cfg.server))),
        Err(CallError::Protocol(e)) => {
            Err(CheckFailed(format!("{} does not speak the worker protocol: {e}", cfg.server)))
        }
        Ok(reply) => Err(CheckFailed(format!(
            "the server accepted a heartbeat for the probe session `{PROBE_SESSION}` ({}); it should not exist",
            reply.status.as_str()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 90-day certificate (its key thrown away); the times below come from its own validity.
    const CERT: &[u8] = include_bytes!("testdata/validity.crt");

    #[test]
    fn the_check_says_when_a_renewal_is_overdue_and_fails_once_the_certificate_expired() {
        let der = crate::identity::first_certificate(CERT).unwrap();
        let (not_before, not_after) = crate::identity::validity(&der).unwrap();
        assert_eq!(not_after - not_before, 90 * 86_400_000);
        let due = crate::identity::renew_at((not_before, not_after));
        let fresh = validity(CERT, not_before).unwrap();
        assert!(fresh.starts_with("certificate valid until"), "{fresh}");
        let overdue = validity(CERT, due).unwrap();
        assert!(overdue.starts_with("warning: certificate renewal is overdue"), "{overdue}");
        let expired = validity(CERT, not_after).unwrap_err().0;
        assert!(expired.contains("expired"), "{expired}");
        assert!(validity(b"not a certificate", 0).is_err());
    }
}
