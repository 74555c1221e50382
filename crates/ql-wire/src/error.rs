//! Outcomes and error codes: the stable, low-cardinality words of the wire.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::limits::JSON_BODY_CAP;
use crate::Body;

/// The `result` of a successful command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// `starting` applied.
    Started,
    /// `starting` was already applied with the same authority.
    AlreadyStarting,
    /// `running` applied.
    Running,
    /// `running` (or a late `starting`) found the attempt correctly running.
    AlreadyRunning,
    /// `start-failure` ended the attempt as failed.
    Failed,
    /// `start-failure` ended the attempt as cancelled.
    Cancelled,
    /// `start-failure` ended the attempt as timed out.
    TimedOut,
    /// The artifact was stored.
    Stored,
    /// The same artifact was stored before.
    AlreadyStored,
    /// The completion applied.
    Completed,
    /// The same completion applied before.
    AlreadyCompleted,
    /// The log chunk was appended.
    Appended,
    /// The log chunk lies within what was acknowledged and equals it.
    AlreadyAppended,
    /// The session was closed.
    Closed,
    /// The session had been closed before.
    AlreadyClosed,
    /// The attempt was abandoned: lost, its run queued again within its retry budget.
    Abandoned,
}

impl Outcome {
    /// Whether the command had been applied before (a replay after a lost response).
    pub fn is_replay(self) -> bool {
        matches!(
            self,
            Self::AlreadyStarting
                | Self::AlreadyRunning
                | Self::AlreadyStored
                | Self::AlreadyCompleted
                | Self::AlreadyAppended
                | Self::AlreadyClosed
        )
    }
}

/// Every error code of the protocol, with its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Schema, bounds, unknown field, weak token, bad digest.
    InvalidRequest,
    /// No or bad client certificate.
    Unauthenticated,
    /// The path's worker is not the certificate's.
    PrincipalMismatch,
    /// The client certificate was revoked (alone, or with every certificate of its
    /// worker): enrol again.
    CertificateRevoked,
    /// The operator disabled the worker: every certificate of it is refused until it is
    /// enabled again.
    WorkerDisabled,
    /// The enrolment token is unknown, spent, expired or for another worker.
    EnrolmentRefused,
    /// Operator API only: the operator's role does not allow the request.
    Forbidden,
    /// No such session, offer, run or attempt (or route).
    NotFound,
    /// The session was replaced, closed or expired.
    SessionConflict,
    /// The offer is claimed by someone else, or lapsed.
    OfferConflict,
    /// The lease does not match the fence, or expired.
    LeaseConflict,
    /// The attempt or run is not in a state that allows the command.
    StateConflict,
    /// A replay whose facts differ from the applied command.
    ReplayMismatch,
    /// The run already ended some other way.
    AlreadyTerminal,
    /// Same artifact identity, other content.
    ArtifactConflict,
    /// A log chunk or seal that does not continue the acknowledged log; the answer says
    /// how much is acknowledged.
    LogOffsetConflict,
    /// Chunked or missing Content-Length.
    LengthRequired,
    /// Over the route's cap.
    PayloadTooLarge,
    /// Wrong Content-Type or Content-Encoding.
    UnsupportedMediaType,
    /// The authority is unreachable; safe to repeat.
    Unavailable,
}

impl ErrorCode {
    /// The HTTP status that carries this code.
    pub fn status(self) -> u16 {
        match self {
            Self::InvalidRequest => 400,
            Self::Unauthenticated => 401,
            Self::PrincipalMismatch
            | Self::CertificateRevoked
            | Self::WorkerDisabled
            | Self::EnrolmentRefused
            | Self::Forbidden => 403,
            Self::NotFound => 404,
            Self::SessionConflict
            | Self::OfferConflict
            | Self::LeaseConflict
            | Self::StateConflict
            | Self::ReplayMismatch
            | Self::AlreadyTerminal
            | Self::ArtifactConflict
            | Self::LogOffsetConflict => 409,
            Self::LengthRequired => 411,
            Self::PayloadTooLarge => 413,
            Self::UnsupportedMediaType => 415,
            Self::Unavailable => 503,
        }
    }

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::Unauthenticated => "unauthenticated",
            Self::PrincipalMismatch => "principal_mismatch",
            Self::CertificateRevoked => "certificate_revoked",
            Self::WorkerDisabled => "worker_disabled",
            Self::EnrolmentRefused => "enrolment_refused",
            Self::Forbidden => "forbidden",
            Self::NotFound => "not_found",
            Self::SessionConflict => "session_conflict",
            Self::OfferConflict => "offer_conflict",
            Self::LeaseConflict => "lease_conflict",
            Self::StateConflict => "state_conflict",
            Self::ReplayMismatch => "replay_mismatch",
            Self::AlreadyTerminal => "already_terminal",
            Self::ArtifactConflict => "artifact_conflict",
            Self::LogOffsetConflict => "log_offset_conflict",
            Self::LengthRequired => "length_required",
            Self::PayloadTooLarge => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::Unavailable => "unavailable",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `{"error":"<code>"}`, and for `log_offset_conflict` also `"acked"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// The code.
    pub error: ErrorCode,
    /// The acknowledged length of the log, with `log_offset_conflict` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked: Option<u64>,
}

impl ErrorBody {
    /// The body of a refusal with `code`.
    pub fn new(code: ErrorCode) -> Self {
        Self { error: code, acked: None }
    }
}

impl Body for ErrorBody {
    const CAP: usize = JSON_BODY_CAP;

    fn validate(&self) -> Result<(), crate::Invalid> {
        // Only the log conflict carries a length, and it always does.
        if self.acked.is_some() != (self.error == ErrorCode::LogOffsetConflict) {
            return Err(crate::Invalid::Schema);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ErrorCode; 20] = [
        ErrorCode::InvalidRequest,
        ErrorCode::Unauthenticated,
        ErrorCode::PrincipalMismatch,
        ErrorCode::CertificateRevoked,
        ErrorCode::WorkerDisabled,
        ErrorCode::EnrolmentRefused,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::SessionConflict,
        ErrorCode::OfferConflict,
        ErrorCode::LeaseConflict,
        ErrorCode::StateConflict,
        ErrorCode::ReplayMismatch,
        ErrorCode::AlreadyTerminal,
        ErrorCode::ArtifactConflict,
        ErrorCode::LogOffsetConflict,
        ErrorCode::LengthRequired,
        ErrorCode::PayloadTooLarge,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::Unavailable,
    ];

    #[test]
    fn as_str_matches_serde_for_every_code() {
        for code in ALL {
            assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{}\"", code.as_str()));
        }
    }

    #[test]
    fn statuses_follow_the_protocol_table() {
        let table: Vec<(u16, &str)> = ALL.iter().map(|c| (c.status(), c.as_str())).collect();
        assert!(table.contains(&(400, "invalid_request")));
        assert!(table.contains(&(401, "unauthenticated")));
        assert!(table.contains(&(403, "principal_mismatch")));
        assert!(table.contains(&(403, "certificate_revoked")));
        assert!(table.contains(&(403, "worker_disabled")));
        assert!(table.contains(&(403, "enrolment_refused")));
        assert!(table.contains(&(403, "forbidden")));
        assert!(table.contains(&(404, "not_found")));
        assert!(table.contains(&(411, "length_required")));
        assert!(table.contains(&(413, "payload_too_large")));
        assert!(table.contains(&(415, "unsupported_media_type")));
        assert!(table.contains(&(503, "unavailable")));
        assert_eq!(table.iter().filter(|(s, _)| *s == 409).count(), 8);
    }
}
