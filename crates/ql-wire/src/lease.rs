//! Lease renewal (whose body is the bare [`Fence`]) and the stop it delivers.

use serde::{Deserialize, Serialize};

use crate::ids::Counter;
use crate::limits::JSON_BODY_CAP;
use crate::time::Timestamp;
use crate::Body;
#[cfg(doc)]
use crate::Fence;

/// Why the worker must stop a job. `timeout` outranks `cancel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopIntent {
    /// An operator cancelled the run.
    Cancel,
    /// The run exceeded its time limit.
    Timeout,
}

impl StopIntent {
    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cancel => "cancel",
            Self::Timeout => "timeout",
        }
    }

    /// The intent that wins when both were raised.
    pub fn strongest(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        a.max(b)
    }
}

/// Answer to a renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Renewed {
    /// The lease's new version; the next command's expected version.
    pub lease_version: Counter,
    /// When the renewed lease lapses (server time, for display).
    pub lease_expires_at: Timestamp,
    /// A stop the worker must carry out, or `null`.
    #[serde(deserialize_with = "Option::deserialize")]
    pub stop: Option<StopIntent>,
}

impl Body for Renewed {
    const CAP: usize = JSON_BODY_CAP;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_outranks_cancel_outranks_none() {
        use StopIntent::*;
        assert_eq!(StopIntent::strongest(Some(Cancel), Some(Timeout)), Some(Timeout));
        assert_eq!(StopIntent::strongest(Some(Timeout), Some(Cancel)), Some(Timeout));
        assert_eq!(StopIntent::strongest(None, Some(Cancel)), Some(Cancel));
        assert_eq!(StopIntent::strongest(None, None), None);
    }
}
