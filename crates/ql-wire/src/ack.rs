//! The start ACKs of ADR-0109: `starting` (whose body is the bare [`Fence`]), `running`
//! and `start-failure`, the `abandon` of a job the worker lost, and their common reply.

use serde::{Deserialize, Serialize};

use crate::capability::Digest;
use crate::error::Outcome;
use crate::fence::fenced_body;
use crate::ids::{ArtifactId, Counter};
use crate::limits::JSON_BODY_CAP;
use crate::text::{ExecutorHandle, Reason};
use crate::Body;
#[cfg(doc)]
use crate::Fence;

fenced_body! {
    /// `POST .../attempts/{a}/running`: the executor exists and can be found again.
    pub struct Running {
        /// How the worker finds the executor after a restart.
        pub executor_handle: ExecutorHandle,
        /// The log artifact the worker will upload, if any (present, possibly `null`).
        #[serde(deserialize_with = "Option::deserialize")]
        pub log_artifact_id: Option<ArtifactId>,
        /// The callback sequence a completion must present.
        pub callback_sequence: Counter,
        /// Digest of the callback token a completion must present.
        pub callback_token_digest: Digest,
    }
}

impl Body for Running {
    const CAP: usize = JSON_BODY_CAP;
}

fenced_body! {
    /// `POST .../attempts/{a}/start-failure`: the executor could not be started.
    pub struct StartFailure {
        /// A short summary without secrets.
        pub reason: Reason,
    }
}

impl Body for StartFailure {
    const CAP: usize = JSON_BODY_CAP;
}

fenced_body! {
    /// `POST .../attempts/{a}/abandon`: the worker lost the job through no fault of the job
    /// — its process and the supervisor that would have recorded its end are gone (the
    /// machine went down, say) — so nobody knows how it ended. The attempt is lost and the
    /// run goes back to the queue within its retry budget, as when a lease lapses, at once.
    pub struct Abandon {
        /// A short summary without secrets.
        pub reason: Reason,
    }
}

impl Body for Abandon {
    const CAP: usize = JSON_BODY_CAP;
}

/// The reply to every start ACK (and, with other outcomes, to renewals' siblings).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AckReply {
    /// `started`, `already_starting`, `running`, `already_running`, for a start-failure
    /// the terminal `failed`, `cancelled` or `timed_out`, for an abandon `abandoned`.
    pub result: Outcome,
}

impl Body for AckReply {
    const CAP: usize = JSON_BODY_CAP;
}
