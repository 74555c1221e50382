//! The worker session: opening or resuming it, heartbeats, the long-poll for offers, and
//! closing it at the end of a drain.

use std::time::{Duration, Instant};

use ql_wire::capability::Token;
use ql_wire::offer::{Offers, PollOffers};
use ql_wire::route::Route;
use ql_wire::session::{CloseSession, Heartbeat, HeartbeatReply, OpenSession, SessionClosed, SessionOpened};
use ql_wire::text::{AgentVersion, Arch};
use ql_wire::ErrorCode;

use super::{Agent, Fatal, Live};
use crate::client::CallError;
use crate::core::Runtime;
use crate::journal::{CurrentSession, JobKey, Record};

impl Agent {
    pub(super) async fn establish_session(&mut self, now: Instant) -> Result<(), Fatal> {
        if !self.resume_tried {
            if let Some(CurrentSession { session_id, generation, heartbeat_ms }) = self.state.session.clone() {
                let route = Route::Heartbeat(self.cfg.worker_id.clone(), session_id.clone());
                let body = Heartbeat { generation, draining: false };
                match self.client.call::<Heartbeat, HeartbeatReply>(&route, &body) {
                    Ok(_) => {
                        self.call_ok();
                        self.resume_tried = true;
                        info!("session {session_id} generation {generation} resumed");
                        self.session = Some(Live {
                            id: session_id,
                            generation,
                            heartbeat: Duration::from_millis(heartbeat_ms),
                            contact: now,
                            told_draining: false,
                            beat_failed: false,
                        });
                        return Ok(());
                    }
                    Err(e) => match self.session_call_failed("resuming the session", &e) {
                        Some(code) => {
                            self.resume_tried = true;
                            info!("session {session_id} cannot be resumed ({code}); opening a new one");
                        }
                        None => return Ok(()),
                    },
                }
            } else {
                self.resume_tried = true;
            }
        }
        let body = OpenSession {
            agent_version: AgentVersion::parse(env!("CARGO_PKG_VERSION")).expect("a short printable version"),
            arch: Arch::parse(std::env::consts::ARCH).expect("a short printable arch"),
            labels: self.cfg.labels.clone(),
            capacity: self.cfg.capacity,
        };
        match self.client.call::<OpenSession, SessionOpened>(&Route::OpenSession(self.cfg.worker_id.clone()), &body) {
            Ok(opened) => {
                self.call_ok();
                self.commit(&Record::Session {
                    session_id: opened.session_id.clone(),
                    generation: opened.generation,
                    heartbeat_ms: opened.heartbeat_ms,
                })?;
                info!(
                    "session {} generation {} opened (heartbeat {} ms)",
                    opened.session_id, opened.generation, opened.heartbeat_ms
                );
                self.notify.status(&format!("session {} open as {}", opened.session_id, self.cfg.worker_id));
                // A zero interval would spin; the server's TTL leaves room for a second.
                let heartbeat = Duration::from_millis(opened.heartbeat_ms.max(100));
                self.session = Some(Live {
                    id: opened.session_id,
                    generation: opened.generation,
                    heartbeat,
                    // Heard from at once, by a poll or else a heartbeat now: the server lets
                    // a repeated open replace a session never heard from (a lost answer's).
                    contact: now.checked_sub(heartbeat).unwrap_or(now),
                    told_draining: false,
                    beat_failed: false,
                });
            }
            Err(e) => match self.session_call_failed("opening a session", &e) {
                Some(ErrorCode::SessionConflict) => {
                    // The server keeps a session that still speaks: another agent holds
                    // this identity. Wait (growing, capped, jittered) rather than fight it.
                    self.block(None);
                    error!(
                        "another agent with worker id {} holds its session (a second ql-agent with this \
                         certificate: a restored backup, or a replaced device still running?); \
                         this one runs nothing and tries again in {} ms",
                        self.cfg.worker_id,
                        self.net.until.map_or(0, |u| u.saturating_duration_since(Instant::now()).as_millis())
                    );
                }
                Some(code) => {
                    // Only a broken server answers an open with this; pace the repeats.
                    warn!("opening a session: {code}; will repeat");
                    self.block(None);
                }
                None => {}
            },
        }
        Ok(())
    }

    /// Ends the session for good on a clean exit (nothing left to report), so the next
    /// start opens a fresh one at once. Best effort: without an answer, the next start
    /// finds out by itself.
    pub(super) fn close_session(&mut self) -> Result<(), Fatal> {
        let Some(live) = self.session.take() else { return Ok(()) };
        let route = Route::CloseSession(self.cfg.worker_id.clone(), live.id.clone());
        let body = CloseSession { generation: live.generation };
        match self.client.call::<CloseSession, SessionClosed>(&route, &body) {
            Ok(_) => info!("session {} closed", live.id),
            // Replaced or lapsed already, or a server without `close`: gone either way.
            Err(CallError::Refused { code: ErrorCode::SessionConflict | ErrorCode::NotFound, .. }) => {
                info!("session {} had already ended", live.id);
            }
            Err(e) => {
                warn!("closing session {}: {e}; the next start finds out for itself", live.id);
                return Ok(());
            }
        }
        self.commit(&Record::SessionClosed { session_id: live.id })
    }

    /// Whether the session has had no contact for a heartbeat interval.
    pub(super) fn heartbeat_due(&self, now: Instant) -> bool {
        self.session.as_ref().is_some_and(|l| now >= l.contact + l.heartbeat)
    }

    pub(super) async fn heartbeat(&mut self, now: Instant) {
        let live = self.session.as_ref().expect("a session");
        let draining = self.drain_by.is_some();
        let route = Route::Heartbeat(self.cfg.worker_id.clone(), live.id.clone());
        let body = Heartbeat { generation: live.generation, draining };
        match self.client.call::<Heartbeat, HeartbeatReply>(&route, &body) {
            Ok(reply) => {
                self.call_ok();
                debug!("heartbeat: {}", reply.status.as_str());
                let live = self.session.as_mut().expect("a session");
                live.contact = now;
                live.beat_failed = false;
                if draining && !live.told_draining {
                    live.told_draining = true;
                    info!("session {} is draining: no new work", live.id);
                }
            }
            Err(e) => {
                if let Some(live) = self.session.as_mut() {
                    live.beat_failed = true;
                }
                if let Some(code) = self.session_call_failed("heartbeat", &e) {
                    let id = self.session.take().map(|l| l.id.to_string()).unwrap_or_default();
                    if draining {
                        info!("session {id} ended ({code}) while draining");
                    } else {
                        warn!("session {id} ended ({code}); opening a new one");
                    }
                }
            }
        }
    }

    pub(super) async fn poll(&mut self, now: Instant, free: u32, due: Option<Instant>) -> Result<(), Fatal> {
        let live = self.session.as_ref().expect("a session");
        let mut wait = if self.state.jobs.is_empty() { self.cfg.poll_wait } else { self.cfg.busy_poll_wait };
        if let Some(due) = due {
            wait = wait.min(due.saturating_duration_since(now));
        }
        let route = Route::PollOffers(self.cfg.worker_id.clone(), live.id.clone());
        let session_id = live.id.clone();
        let generation = live.generation;
        let body = PollOffers { generation, wait_ms: wait.as_millis() as u64, max: free };
        debug!("polling for up to {free} offer(s), waiting up to {} ms", body.wait_ms);
        match self.client.poll::<PollOffers, Offers>(&route, &body, wait) {
            Ok(offers) => {
                self.call_ok();
                // The server held the session alive until the answer, and a TTL after it.
                if let Some(live) = self.session.as_mut() {
                    live.contact = Instant::now();
                }
                for offer in offers.offers {
                    let key = JobKey { session_id: session_id.clone(), attempt_id: offer.attempt_id.clone() };
                    // The server repeats open offers it made before: one journal entry each.
                    if self.state.jobs.contains_key(&key) {
                        continue;
                    }
                    if self.drain_by.is_some() || self.state.jobs.len() >= self.cfg.capacity as usize {
                        break;
                    }
                    let token = Token::generate().map_err(|e| Fatal(format!("the OS random source failed: {e}")))?;
                    self.commit(&Record::Offered {
                        session_id: session_id.clone(),
                        session_generation: generation,
                        offer_id: offer.offer_id,
                        run_id: offer.run_id.clone(),
                        attempt_id: offer.attempt_id.clone(),
                        lease_token: token,
                    })?;
                    self.rts.insert(key, Runtime::default());
                    info!("run {} attempt {}: offered", offer.run_id, offer.attempt_id);
                }
            }
            Err(e) => {
                if let Some(code) = self.session_call_failed("polling for offers", &e) {
                    warn!("session {session_id} ended ({code}); opening a new one");
                    self.session = None;
                }
            }
        }
        Ok(())
    }
}
