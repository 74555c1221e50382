//! The live log of PROTOCOL §13: a running job's log streamed in chunks acknowledged by
//! offset (`log:append`), then sealed into the immutable artifact of §9
//! (`artifacts/{id}:seal`). A chunk travels in the artifact frame ([`crate::frame`]) with
//! its own header; the seal is JSON and is answered exactly as an artifact upload.

use serde::{Deserialize, Serialize};

use crate::error::Outcome;
use crate::fence::{fenced_body, schema_tag};
use crate::ids::{ArtifactId, Invalid};
use crate::limits::{ARTIFACT_CONTENT_MAX, FRAME_HEADER_MAX, JSON_BODY_CAP, LOG_CHUNK_MAX};
use crate::Body;

schema_tag!(
    /// `qinglong/remote-worker-log-chunk@v1`.
    LogChunkSchema = "qinglong/remote-worker-log-chunk@v1"
);

fenced_body! {
    /// The JSON header at the front of a `log:append` frame.
    pub struct LogChunkHeader {
        /// Always [`LogChunkSchema::TEXT`].
        pub schema: LogChunkSchema,
        /// The log artifact the `running` ACK declared.
        pub artifact_id: ArtifactId,
        /// Where the chunk starts: the bytes the sender believes are acknowledged.
        pub offset: u64,
        /// Bytes of content after the header, `1..=262144`.
        pub content_length: u64,
    }
}

impl Body for LogChunkHeader {
    const CAP: usize = FRAME_HEADER_MAX;

    fn validate(&self) -> Result<(), Invalid> {
        if !(1..=LOG_CHUNK_MAX).contains(&self.content_length) {
            return Err(Invalid::OutOfRange { min: 1, max: LOG_CHUNK_MAX });
        }
        // No log is longer than the largest artifact, so no chunk may reach past it.
        if self.offset > ARTIFACT_CONTENT_MAX - self.content_length {
            return Err(Invalid::OutOfRange { min: 0, max: ARTIFACT_CONTENT_MAX - self.content_length });
        }
        Ok(())
    }
}

impl LogChunkHeader {
    /// Where the chunk ends.
    pub fn end(&self) -> u64 {
        self.offset + self.content_length
    }
}

/// Answer to `log:append`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LogAppendReply {
    /// `appended` or `already_appended`.
    pub result: Outcome,
    /// Bytes of the log the server holds, durably, from offset 0.
    pub acked: u64,
}

impl Body for LogAppendReply {
    const CAP: usize = JSON_BODY_CAP;

    fn validate(&self) -> Result<(), Invalid> {
        if self.acked > ARTIFACT_CONTENT_MAX {
            return Err(Invalid::OutOfRange { min: 0, max: ARTIFACT_CONTENT_MAX });
        }
        Ok(())
    }
}

fenced_body! {
    /// The body of `artifacts/{id}:seal`: the acknowledged log becomes the artifact.
    pub struct Seal {
        /// Must equal the acknowledged length.
        pub content_length: u64,
        /// Whether the worker cut the log at its limit.
        pub truncated: bool,
    }
}

impl Body for Seal {
    const CAP: usize = JSON_BODY_CAP;

    fn validate(&self) -> Result<(), Invalid> {
        if self.content_length > ARTIFACT_CONTENT_MAX {
            return Err(Invalid::OutOfRange { min: 0, max: ARTIFACT_CONTENT_MAX });
        }
        Ok(())
    }
}
