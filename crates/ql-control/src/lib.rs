//! `ql-control`, the QingLong Edge control plane: the single authority over runs.
//!
//! - [`model`]: the rows of the authority;
//! - [`core`]: every protocol decision, as pure functions of rows, request and DB time;
//! - [`store`]: the storage seam and its SQLite implementation;
//! - [`blob`]: the artifact store seam and its local-files implementation.

pub mod blob;
pub mod core;
pub mod model;
pub mod store;
