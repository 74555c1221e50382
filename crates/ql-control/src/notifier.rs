//! `serve`'s webhook notifier: every `webhook_poll_ms` it claims the due deliveries
//! ([`crate::core::DeliveryPolicy`], any replica may) and POSTs each run's end to its
//! URL, concurrently and each within `webhook_timeout_ms`, then records how each went.
//! A run's completion never waits on this: the delivery row was written with the run,
//! and the notifier finds it once the run has ended.
//!
//! The body is JSON (see [`body`]); `QL-Delivery` is the run id — the idempotency key a
//! receiver deduplicates on, since a replica that dies mid-send leaves the delivery to be
//! sent again — `QL-Delivery-Attempt` counts the sends, and `QL-Signature` is
//! `sha256=` and the hex HMAC-SHA256 of the body under the webhook key (the text of
//! `webhook_secret_file`, [`crate::keys::key_file`]; replicas share it).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use zeroize::Zeroizing;

use crate::core::{Command, DeliveryPolicy, Reply};
use crate::model::{Delivery, Run};
use crate::ops::view::time;
use crate::store::Store;

/// What the notifier sends with.
pub struct Notifier {
    agent: ureq::Agent,
    key: Zeroizing<Vec<u8>>,
    policy: DeliveryPolicy,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier").field("key", &"<redacted>").field("policy", &self.policy).finish()
    }
}

impl Notifier {
    /// A notifier signing with `key`, trusting the CA certificates in `ca_file` (if it
    /// exists) for `https://` receivers, each send within `timeout`.
    pub fn new(key: &str, ca_file: &Path, timeout: Duration, policy: DeliveryPolicy) -> Self {
        let roots = crate::client::certificates(&std::fs::read(ca_file).unwrap_or_default());
        let agent = crate::client::agent(&roots, false, Some(timeout));
        Self { agent, key: Zeroizing::new(key.as_bytes().to_vec()), policy }
    }

    /// Sends one delivery (blocking): `Ok` for a 2xx answer.
    fn send(&self, d: &Delivery, run: &Run) -> Result<(), String> {
        let body = body(d, run);
        let signature = crate::keys::hmac_hex(&self.key, &body);
        let answer = self
            .agent
            .post(&d.url)
            .header("Content-Type", "application/json")
            .header("QL-Delivery", run.id.as_str())
            .header("QL-Delivery-Attempt", d.attempts.to_string())
            .header("QL-Signature", format!("sha256={signature}"))
            .send(&body[..]);
        match answer {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => Err(format!("answered {}", r.status().as_u16())),
            // The error's kind, never the URL (it may carry a secret of the receiver's).
            Err(e) => Err(match e {
                ureq::Error::Io(io) => format!("{:?}", io.kind()),
                ureq::Error::Timeout(_) => "timed out".into(),
                other => other.to_string().split(':').next().unwrap_or("failed").to_owned(),
            }),
        }
    }
}

/// What a receiver gets: the run's end.
pub fn body(d: &Delivery, run: &Run) -> Vec<u8> {
    let json = serde_json::json!({
        "type": "run.finished",
        "deliveryId": run.id,
        "attempt": d.attempts,
        "run": {
            "runId": run.id,
            "project": run.project,
            "schedule": run.schedule,
            "status": run.status.as_str(),
            "errorCode": run.error_code,
            "summary": run.summary,
            "attempts": run.attempts,
            "createdAt": time(run.created_at),
            "startedAt": run.started_at.map(time),
            "finishedAt": run.finished_at.map(time),
        },
    });
    serde_json::to_vec(&json).expect("a body serialises")
}

/// Claims and sends due deliveries every `every`, for ever.
pub async fn notify_forever<S: Store>(store: S, notifier: Arc<Notifier>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        notify_once(&store, &notifier).await;
    }
}

/// One claim and its sends.
pub async fn notify_once<S: Store>(store: &S, notifier: &Arc<Notifier>) {
    let policy = notifier.policy;
    let claimed = match store.execute(Command::ClaimDeliveries(policy)).await {
        Ok(Ok(Reply::Deliveries(claimed))) => claimed,
        Ok(other) => return eprintln!("ql-control: claiming webhook deliveries: unexpected {other:?}"),
        Err(e) => return eprintln!("ql-control: claiming webhook deliveries failed: {e}"),
    };
    let mut sends = tokio::task::JoinSet::new();
    for (d, run) in claimed {
        let notifier = notifier.clone();
        sends.spawn_blocking(move || {
            let sent = notifier.send(&d, &run);
            (d, sent)
        });
    }
    while let Some(done) = sends.join_next().await {
        let Ok((d, sent)) = done else { continue };
        if let Err(e) = &sent {
            eprintln!("ql-control: webhook of {} (attempt {}): {e}", d.run, d.attempts);
        }
        match store.execute(Command::DeliveryDone(d.run.clone(), d.attempts, sent, policy)).await {
            Ok(Ok(_)) | Ok(Err(ql_wire::ErrorCode::StateConflict)) => {}
            Ok(Err(code)) => eprintln!("ql-control: recording the webhook of {}: {code}", d.run),
            Err(e) => eprintln!("ql-control: recording the webhook of {}: {e}", d.run),
        }
    }
}
