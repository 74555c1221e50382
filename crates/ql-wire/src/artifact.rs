//! The artifact route of ADR-0117: the frame header, the receipt, and the reply.
//! The frame's byte layout lives in [`crate::frame`].

use serde::{Deserialize, Serialize};

use crate::capability::Digest;
use crate::error::Outcome;
use crate::fence::{fenced_body, schema_tag};
use crate::ids::{ArtifactId, Invalid};
use crate::limits::{ARTIFACT_CONTENT_MAX, FRAME_HEADER_MAX, JSON_BODY_CAP};
use crate::Body;

schema_tag!(
    /// `qinglong/remote-worker-artifact-upload@v1`.
    ArtifactSchema = "qinglong/remote-worker-artifact-upload@v1"
);

fenced_body! {
    /// The JSON header at the front of an artifact frame.
    pub struct ArtifactHeader {
        /// Always [`ArtifactSchema::TEXT`].
        pub schema: ArtifactSchema,
        /// Bytes of content after the header.
        pub content_length: u64,
        /// Whether the worker cut the content at its log limit.
        pub truncated: bool,
    }
}

impl Body for ArtifactHeader {
    const CAP: usize = FRAME_HEADER_MAX;

    fn validate(&self) -> Result<(), Invalid> {
        if self.content_length > ARTIFACT_CONTENT_MAX {
            return Err(Invalid::OutOfRange { min: 0, max: ARTIFACT_CONTENT_MAX });
        }
        Ok(())
    }
}

/// What the artifact store holds: identity, consumed length, SHA-256 and truncation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Receipt {
    /// The artifact.
    pub artifact_id: ArtifactId,
    /// Bytes stored.
    pub length: u64,
    /// SHA-256 of the bytes stored.
    pub sha256: Digest,
    /// Whether the worker cut the content.
    pub truncated: bool,
}

/// Answer to an artifact upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ArtifactReply {
    /// `stored` or `already_stored`.
    pub result: Outcome,
    /// What the store holds; the completion must present exactly this.
    pub receipt: Receipt,
}

impl Body for ArtifactReply {
    const CAP: usize = JSON_BODY_CAP;
}
