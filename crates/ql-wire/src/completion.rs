//! The atomic completion of ADR-0117.

use serde::{Deserialize, Serialize};

use crate::artifact::Receipt;
use crate::capability::CallbackToken;
use crate::error::Outcome;
use crate::fence::{fenced_body, schema_tag};
use crate::ids::{Counter, Invalid};
use crate::limits::{COMPLETION_BODY_CAP, JSON_BODY_CAP};
use crate::time::Timestamp;
use crate::Body;

schema_tag!(
    /// `qinglong/remote-worker-completion@v1`.
    CompletionSchema = "qinglong/remote-worker-completion@v1"
);

fenced_body! {
    /// `POST .../attempts/{a}/completion`.
    pub struct Completion {
        /// Always [`CompletionSchema::TEXT`].
        pub schema: CompletionSchema,
        /// The callback sequence registered by `running` (or registered now, from `starting`).
        pub callback_sequence: Counter,
        /// The raw callback token; the server compares its digest.
        pub callback_token: CallbackToken,
        /// The exit code, when the process exited.
        #[serde(deserialize_with = "Option::deserialize")]
        pub exit_code: Option<i32>,
        /// The signal number, when a signal ended the process.
        #[serde(deserialize_with = "Option::deserialize")]
        pub signal: Option<i32>,
        /// When the worker saw the process end (evidence, not authority).
        pub finished_at: Timestamp,
        /// The stored log's receipt, when one was uploaded.
        #[serde(deserialize_with = "Option::deserialize")]
        pub artifact: Option<Receipt>,
    }
}

impl Body for Completion {
    const CAP: usize = COMPLETION_BODY_CAP;

    fn validate(&self) -> Result<(), Invalid> {
        if let Some(signal) = self.signal {
            if !(1..=64).contains(&signal) {
                return Err(Invalid::OutOfRange { min: 1, max: 64 });
            }
        }
        Ok(())
    }
}

/// How a run or attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalStatus {
    /// Exit code 0 and no stop intent.
    Succeeded,
    /// Any other exit, or a failed start.
    Failed,
    /// Stopped by a cancel intent.
    Cancelled,
    /// Stopped by a timeout intent.
    TimedOut,
}

/// Answer to [`Completion`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CompletionReply {
    /// `completed` or `already_completed`.
    pub result: Outcome,
    /// The terminal status the authority recorded.
    pub status: TerminalStatus,
}

impl Body for CompletionReply {
    const CAP: usize = JSON_BODY_CAP;
}
