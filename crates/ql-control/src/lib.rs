//! `ql-control`, the QingLong Edge control plane: the single authority over runs.
//!
//! - [`model`]: the rows of the authority;
//! - [`core`]: every protocol decision, as pure functions of rows, request and DB time;
//! - [`store`]: the storage seam and its SQLite and PostgreSQL implementations;
//! - [`blob`]: the artifact store seam and its local-files and S3 implementations;
//! - [`pki`], [`identity`], [`keys`]: the worker CA, the server certificate and worker
//!   enrolment; disabling and revoking workers; the server's own keys;
//! - [`http`]: the worker ingress: TLS 1.3 mTLS, principal binding, framing, routes;
//! - [`ops`]: the operator commands, on a store or sent to a remote `serve`; [`api`]:
//!   the operator API that serves them; [`web`]: the dashboard; [`metrics`]: what
//!   Prometheus scrapes; [`notifier`]: the webhooks; [`client`]: the HTTP client they use;
//! - [`config`], [`admin`], [`logs`], [`serve`]: the state directory, the authority an
//!   operator command opens, the log reader (stored or live) and the server;
//! - [`fault`]: the crash matrix's fault points (test builds only).
//!
//! These docs are for those who work on the server (`cargo doc --document-private-items`):
//! a public item's doc may name the private code that carries it out.
#![allow(rustdoc::private_intra_doc_links)]

pub mod admin;
pub mod api;
pub mod blob;
pub mod client;
pub mod config;
pub mod core;
pub mod fault;
pub mod http;
pub mod identity;
pub mod keys;
pub mod logs;
pub mod metrics;
pub mod model;
pub mod notifier;
pub mod ops;
pub mod pki;
pub mod serve;
pub mod store;
pub mod web;
