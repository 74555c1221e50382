//! Renewing the agent's certificate over its own connection, with no restart and no run
//! lost: when about two thirds of its lifetime have passed, a new key and its request
//! ([`crate::identity`]) go to `POST .../certificate:renew` between two of the loop's
//! calls; the answer is installed in place of the old pair and the client is rebuilt on
//! it, so the next call opens a new connection with the new certificate (the session and
//! every lease carry on). A failure is retried with the doubling backoff, as is a
//! refusal (a second renewal within the server's `worker_renew_interval_ms`, after an
//! answer that was lost); the old certificate serves meanwhile. Time is the server's, as its answers' `Date` showed it,
//! so a router whose clock is far off still renews in time.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use ql_wire::enrol::{CertificateRequest, IdentityRoute, Issued, Renew};

use super::Agent;
use crate::client::Credentials;
use crate::core;
use crate::identity;

/// When the certificate in use is due for renewal, and the retries of a failed one.
#[derive(Debug, Default)]
pub(super) struct Renewal {
    /// Due at this time (milliseconds since the epoch); `None`: unknown, never renewed.
    due_ms: Option<i64>,
    /// Not again while held, after failures.
    hold: core::Hold,
}

impl Renewal {
    /// The schedule of the certificate in the PEM file `cert`.
    pub(super) fn of(cert: &[u8]) -> Self {
        let due_ms = identity::first_certificate(cert).and_then(|der| identity::validity(&der)).map(identity::renew_at);
        Self { due_ms, ..Self::default() }
    }
}

impl Agent {
    fn now_ms(&self, now: Instant) -> i64 {
        self.server_clock().map_or_else(
            || SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64),
            |c| c.at(now),
        )
    }

    /// Whether a renewal should go out now.
    pub(super) fn renewal_due(&self, now: Instant) -> bool {
        let r = &self.renewal;
        self.drain_by.is_none() && r.hold.holds(now).is_none() && r.due_ms.is_some_and(|due| self.now_ms(now) >= due)
    }

    /// Renews the certificate (see the module doc).
    pub(super) fn renew_certificate(&mut self, now: Instant) {
        match self.try_renew() {
            Ok(issued) => {
                info!("certificate renewed over the connection: valid until {}", issued.not_after);
            }
            Err(e) => {
                let random = self.draw();
                let (initial, max) = (self.cfg.backoff_initial, self.cfg.backoff_max);
                let wait = self.renewal.hold.fail(initial, max, random, now);
                warn!("renewing the certificate: {e}; the current one serves on, next try in {} ms", wait.as_millis());
            }
        }
    }

    fn try_renew(&mut self) -> Result<Issued, String> {
        let key = identity::new_key(&self.cfg.worker_id)?;
        let csr = CertificateRequest::new(key.csr.clone()).map_err(|e| format!("the request: {e}"))?;
        let route = IdentityRoute::Renew(self.cfg.worker_id.clone());
        let issued: Issued = self.client.identity(&route, Some(&Renew { csr })).map_err(|e| e.to_string())?;
        identity::certifies(issued.certificate.as_str().as_bytes(), &key.public)?;
        identity::install(&self.cfg.key, &key.pem, &self.cfg.cert, issued.certificate.as_str())?;
        let creds = Credentials::load(&self.cfg.cert, &self.cfg.key, &self.cfg.ca).map_err(|e| e.0)?;
        self.client = self.client.with_credentials(&creds).map_err(|e| e.0)?;
        self.renewal = Renewal::of(&creds.cert_pem);
        Ok(issued)
    }
}
