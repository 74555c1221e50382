//! Sessions: open, heartbeat (which also carries the drain flag), and their replies.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::ids::{Counter, Invalid, SessionId};
use crate::limits::{CAPACITY_MAX, JSON_BODY_CAP, LABELS_MAX};
use crate::text::{AgentVersion, Arch, LabelKey, LabelValue};
use crate::Body;

/// `POST /v1/workers/{w}/sessions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OpenSession {
    /// The agent's version.
    pub agent_version: AgentVersion,
    /// The agent's CPU architecture.
    pub arch: Arch,
    /// Placement labels, at most 16.
    pub labels: BTreeMap<LabelKey, LabelValue>,
    /// Jobs this session runs at once, 1..=64.
    pub capacity: u32,
}

impl Body for OpenSession {
    const CAP: usize = JSON_BODY_CAP;

    fn validate(&self) -> Result<(), Invalid> {
        if self.labels.len() > LABELS_MAX {
            return Err(Invalid::TooMany { max: LABELS_MAX });
        }
        if !(1..=CAPACITY_MAX).contains(&self.capacity) {
            return Err(Invalid::OutOfRange { min: 1, max: u64::from(CAPACITY_MAX) });
        }
        Ok(())
    }
}

/// 201 answer to [`OpenSession`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionOpened {
    /// The new session.
    pub session_id: SessionId,
    /// One more than the worker's previous highest generation.
    pub generation: Counter,
    /// How often the agent should heartbeat.
    pub heartbeat_ms: u64,
    /// How long the session lives without a heartbeat.
    pub session_ttl_ms: u64,
}

impl Body for SessionOpened {
    const CAP: usize = JSON_BODY_CAP;
}

/// `POST .../sessions/{s}/heartbeat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Heartbeat {
    /// The session's generation.
    pub generation: Counter,
    /// True once the agent stops taking new work.
    pub draining: bool,
}

impl Body for Heartbeat {
    const CAP: usize = JSON_BODY_CAP;
}

/// A live session's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// Takes offers.
    Online,
    /// Finishes its running attempts, takes nothing new.
    Draining,
}

impl SessionStatus {
    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Online => "online",
            Self::Draining => "draining",
        }
    }
}

/// Answer to [`Heartbeat`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HeartbeatReply {
    /// The session's status after the heartbeat.
    pub status: SessionStatus,
}

impl Body for HeartbeatReply {
    const CAP: usize = JSON_BODY_CAP;
}

/// `POST .../sessions/{s}/close`: an agent that stops for good, after draining, ends its
/// session `closed`, so the worker's next agent opens a fresh one at once instead of
/// trying to resume it. An agent that only restarts (and re-attaches to its jobs) keeps
/// its session and sends no close.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CloseSession {
    /// The session's generation.
    pub generation: Counter,
}

impl Body for CloseSession {
    const CAP: usize = JSON_BODY_CAP;
}

/// Answer to [`CloseSession`]: `closed`, or `already_closed` for a repeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionClosed {
    /// What the close did.
    pub result: crate::Outcome,
}

impl Body for SessionClosed {
    const CAP: usize = JSON_BODY_CAP;

    fn validate(&self) -> Result<(), crate::Invalid> {
        match self.result {
            crate::Outcome::Closed | crate::Outcome::AlreadyClosed => Ok(()),
            _ => Err(crate::Invalid::Schema),
        }
    }
}
