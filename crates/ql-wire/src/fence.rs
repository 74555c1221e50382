//! The fence: the fields that prove which lease a command speaks for.
//!
//! Every command after the claim carries the same five fields at the top level of its
//! body. The crate's `fenced_body!` macro declares such a body so the fields are spelled once.

use serde::{Deserialize, Serialize};

use crate::capability::LeaseToken;
use crate::ids::{Counter, OfferId};
use crate::limits::JSON_BODY_CAP;
use crate::Body;

/// Which lease a command speaks for. Also the whole body of `starting` and `lease:renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Fence {
    /// The session's generation when it claimed the offer.
    pub session_generation: Counter,
    /// The offer that was claimed.
    pub offer_id: OfferId,
    /// The lease's generation.
    pub lease_generation: Counter,
    /// The raw lease token the worker made for the claim.
    pub lease_token: LeaseToken,
    /// The lease version the worker last saw.
    pub expected_lease_version: Counter,
}

impl Body for Fence {
    const CAP: usize = JSON_BODY_CAP;
}

/// Declares a body made of the fence's five fields followed by its own.
macro_rules! fenced_body {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        #[serde(rename_all = "camelCase", deny_unknown_fields)]
        pub struct $name {
            /// See [`Fence::session_generation`](crate::Fence::session_generation).
            pub session_generation: $crate::ids::Counter,
            /// See [`Fence::offer_id`](crate::Fence::offer_id).
            pub offer_id: $crate::ids::OfferId,
            /// See [`Fence::lease_generation`](crate::Fence::lease_generation).
            pub lease_generation: $crate::ids::Counter,
            /// See [`Fence::lease_token`](crate::Fence::lease_token).
            pub lease_token: $crate::capability::LeaseToken,
            /// See [`Fence::expected_lease_version`](crate::Fence::expected_lease_version).
            pub expected_lease_version: $crate::ids::Counter,
            $( $(#[$fmeta])* pub $field: $ty, )*
        }

        impl $name {
            /// Builds the body from a fence and the body's own fields.
            #[allow(clippy::too_many_arguments)]
            pub fn new(fence: $crate::Fence, $($field: $ty),*) -> Self {
                Self {
                    session_generation: fence.session_generation,
                    offer_id: fence.offer_id,
                    lease_generation: fence.lease_generation,
                    lease_token: fence.lease_token,
                    expected_lease_version: fence.expected_lease_version,
                    $($field),*
                }
            }

            /// The fence this body carries.
            pub fn fence(&self) -> $crate::Fence {
                $crate::Fence {
                    session_generation: self.session_generation,
                    offer_id: self.offer_id.clone(),
                    lease_generation: self.lease_generation,
                    lease_token: self.lease_token.clone(),
                    expected_lease_version: self.expected_lease_version,
                }
            }
        }
    };
}
pub(crate) use fenced_body;

/// Declares a `schema` tag: a unit type that (de)serialises as one exact string.
macro_rules! schema_tag {
    ($(#[$meta:meta])* $name:ident = $text:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        #[serde(try_from = "String", into = "&'static str")]
        pub struct $name;

        impl $name {
            /// The exact schema string.
            pub const TEXT: &'static str = $text;
        }

        impl TryFrom<String> for $name {
            type Error = $crate::Invalid;
            fn try_from(s: String) -> Result<Self, $crate::Invalid> {
                if s == $text {
                    Ok(Self)
                } else {
                    Err($crate::Invalid::Schema)
                }
            }
        }

        impl From<$name> for &'static str {
            fn from(_: $name) -> &'static str {
                $text
            }
        }
    };
}
pub(crate) use schema_tag;
