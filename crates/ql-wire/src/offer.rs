//! Delivery: polling for offers and claiming one.

use serde::{Deserialize, Serialize};

use crate::capability::LeaseToken;
use crate::ids::{AttemptId, Counter, Invalid, OfferId, RunId};
use crate::limits::{CLAIM_RESPONSE_CAP, JSON_BODY_CAP, POLL_MAX_OFFERS, POLL_WAIT_MAX_MS};
use crate::spec::ExecutionSpec;
use crate::time::Timestamp;
use crate::Body;

/// `POST .../sessions/{s}/offers:poll`: wait up to `waitMs` for at most `max` offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PollOffers {
    /// The session's generation.
    pub generation: Counter,
    /// Long-poll bound, 0..=30000.
    pub wait_ms: u64,
    /// Offers wanted, 1..=64 (the agent's free capacity).
    pub max: u32,
}

impl Body for PollOffers {
    const CAP: usize = JSON_BODY_CAP;

    fn validate(&self) -> Result<(), Invalid> {
        if self.wait_ms > POLL_WAIT_MAX_MS {
            return Err(Invalid::OutOfRange { min: 0, max: POLL_WAIT_MAX_MS });
        }
        if !(1..=POLL_MAX_OFFERS).contains(&self.max) {
            return Err(Invalid::OutOfRange { min: 1, max: u64::from(POLL_MAX_OFFERS) });
        }
        Ok(())
    }
}

/// One execution offer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Offer {
    /// The offer.
    pub offer_id: OfferId,
    /// The run it is for.
    pub run_id: RunId,
    /// The attempt it would start.
    pub attempt_id: AttemptId,
    /// When the offer lapses unless claimed.
    pub expires_at: Timestamp,
}

/// Answer to [`PollOffers`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Offers {
    /// Possibly empty when the wait ran out.
    pub offers: Vec<Offer>,
}

impl Body for Offers {
    const CAP: usize = JSON_BODY_CAP * 4;

    fn validate(&self) -> Result<(), Invalid> {
        let max = POLL_MAX_OFFERS as usize;
        if self.offers.len() > max {
            return Err(Invalid::TooMany { max });
        }
        Ok(())
    }
}

/// `POST .../offers/{o}/claim`, sent only after the offer and token are journaled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Claim {
    /// The session's generation.
    pub generation: Counter,
    /// The offer's run.
    pub run_id: RunId,
    /// The offer's attempt.
    pub attempt_id: AttemptId,
    /// A fresh token the worker made for this lease.
    pub lease_token: LeaseToken,
}

impl Body for Claim {
    const CAP: usize = JSON_BODY_CAP;
}

/// Answer to [`Claim`]: the lease and what to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Claimed {
    /// The lease's generation.
    pub lease_generation: Counter,
    /// Always 1 on a claim.
    pub lease_version: Counter,
    /// When the lease lapses unless renewed (server time, for display).
    pub lease_expires_at: Timestamp,
    /// The lease's time to live; the agent times renewals from this, not from clocks.
    pub lease_ttl_ms: u64,
    /// What to run.
    pub spec: ExecutionSpec,
}

impl Body for Claimed {
    const CAP: usize = CLAIM_RESPONSE_CAP;

    fn validate(&self) -> Result<(), Invalid> {
        self.spec.validate()
    }
}
