//! The QingLong Edge worker protocol, v1: the contract between `ql-agent` and `ql-control`.
//!
//! Everything here is pure: types, bounds, route paths, the artifact frame codec and the
//! capability helpers. Nothing performs network or file I/O, spawns a task or reads a
//! clock; times are values handed in by the caller. The one exception is
//! [`capability::LeaseToken::generate`], which draws from the OS CSPRNG because a token
//! made any other way would not be a capability.
//!
//! One file per message family, as the protocol groups them: [`session`], [`offer`] (with
//! the execution [`spec`]), [`ack`], [`lease`], [`artifact`], the live [`log`],
//! [`completion`] and [`error`]. Every body type refuses unknown fields and validates its bounds when it is
//! decoded with [`decode`].

pub mod ack;
pub mod artifact;
pub mod base64;
pub mod capability;
pub mod completion;
pub mod enrol;
pub mod error;
pub mod fence;
pub mod frame;
pub mod ids;
pub mod lease;
pub mod limits;
pub mod log;
pub mod offer;
pub mod route;
pub mod session;
pub mod spec;
pub mod text;
pub mod time;

pub use error::{ErrorBody, ErrorCode, Outcome};
pub use fence::Fence;
pub use ids::Invalid;

use serde::{de::DeserializeOwned, Serialize};

/// A request or response body of the protocol.
///
/// `validate` checks the rules that a field's own type cannot express (counts, sizes,
/// exclusive alternatives); field-level rules run while the body is deserialised.
pub trait Body: Serialize + DeserializeOwned {
    /// The largest encoded size this body may have on the wire.
    const CAP: usize;

    /// Checks cross-field rules after deserialisation.
    fn validate(&self) -> Result<(), Invalid> {
        Ok(())
    }
}

/// Why a body was refused. Every variant maps to `400 invalid_request` on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The body is larger than its route allows.
    TooLarge {
        /// The cap that applies.
        cap: usize,
        /// The size that was offered.
        len: usize,
    },
    /// Not JSON, an unknown or missing field, or a field that failed its own rule.
    Malformed(String),
    /// Every field parsed but a cross-field rule failed.
    Invalid(Invalid),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge { cap, len } => write!(f, "body of {len} bytes exceeds the {cap}-byte cap"),
            Self::Malformed(why) => write!(f, "malformed body: {why}"),
            Self::Invalid(why) => write!(f, "invalid body: {why}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Decodes and validates one body, refusing it before parsing when it exceeds `T::CAP`.
pub fn decode<T: Body>(bytes: &[u8]) -> Result<T, DecodeError> {
    decode_capped(bytes, T::CAP)
}

/// Like [`decode`] with a tighter cap chosen by the route (never above `T::CAP`).
pub fn decode_capped<T: Body>(bytes: &[u8], cap: usize) -> Result<T, DecodeError> {
    let cap = cap.min(T::CAP);
    if bytes.len() > cap {
        return Err(DecodeError::TooLarge { cap, len: bytes.len() });
    }
    let body: T = serde_json::from_slice(bytes).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    body.validate().map_err(DecodeError::Invalid)?;
    Ok(body)
}

/// Encodes a body as compact JSON.
pub fn encode<T: Body>(body: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail: no maps with non-string keys, no I/O.
    serde_json::to_vec(body).expect("protocol bodies always serialise")
}

/// [`encode`] into a buffer of exactly the body's length, for a body that holds a raw
/// token: a buffer grown by reallocation would leave copies of it in the memory it gave
/// back (the caller wipes the one buffer once the body is sent). Twice the work of
/// [`encode`], so only where a token is.
pub fn encode_exact<T: Serialize + ?Sized>(body: &T) -> Vec<u8> {
    let mut counted = Counted(0);
    serde_json::to_writer(&mut counted, body).expect("protocol bodies always serialise");
    let mut out = Vec::with_capacity(counted.0);
    serde_json::to_writer(&mut out, body).expect("protocol bodies always serialise");
    out
}

/// A writer that only counts what it is given.
struct Counted(usize);

impl std::io::Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
