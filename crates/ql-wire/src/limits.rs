//! Every numeric bound of the protocol, in one place so both sides agree.

/// Default cap for a JSON request body.
pub const JSON_BODY_CAP: usize = 4 * 1024;
/// Cap for a completion request body.
pub const COMPLETION_BODY_CAP: usize = 16 * 1024;
/// No JSON route accepts more than this, whatever its own cap says.
pub const JSON_HARD_CAP: usize = 64 * 1024;
/// Cap for the whole claim response (it carries the execution spec).
pub const CLAIM_RESPONSE_CAP: usize = 320 * 1024;

/// Largest artifact frame header.
pub const FRAME_HEADER_MAX: usize = 4096;
/// Largest artifact content.
pub const ARTIFACT_CONTENT_MAX: u64 = 64 * 1024 * 1024;
/// The artifact route's hard cap: length prefix, largest header, largest content.
pub const ARTIFACT_BODY_CAP: u64 = 4 + FRAME_HEADER_MAX as u64 + ARTIFACT_CONTENT_MAX;

/// Largest content of one live-log chunk (PROTOCOL §13).
pub const LOG_CHUNK_MAX: u64 = 256 * 1024;
/// The `log:append` route's hard cap: length prefix, largest header, largest chunk.
pub const LOG_CHUNK_BODY_CAP: u64 = 4 + FRAME_HEADER_MAX as u64 + LOG_CHUNK_MAX;

/// Largest generation, version or sequence number (JSON-safe integers).
pub const COUNTER_MAX: u64 = (1 << 53) - 1;

/// Labels a session may declare.
pub const LABELS_MAX: usize = 16;
/// Jobs a session may run at once.
pub const CAPACITY_MAX: u32 = 64;
/// Longest offer long-poll, in milliseconds.
pub const POLL_WAIT_MAX_MS: u64 = 30_000;
/// Offers one poll may return.
pub const POLL_MAX_OFFERS: u32 = 64;

/// Arguments in an argv spec.
pub const ARGV_MAX: usize = 64;
/// Bytes in one argument.
pub const ARG_MAX_BYTES: usize = 4096;
/// Bytes of a script's source.
pub const SCRIPT_MAX_BYTES: usize = 256 * 1024;
/// Environment pairs in a spec.
pub const ENV_MAX: usize = 64;
/// Bytes of one environment value.
pub const ENV_VALUE_MAX_BYTES: usize = 4096;
/// Largest log a spec may ask for.
pub const LOG_LIMIT_MAX: u64 = 64 * 1024 * 1024;
/// Longest run timeout: one week.
pub const TIMEOUT_MAX_MS: u64 = 7 * 24 * 3600 * 1000;

/// Bytes of an executor handle.
pub const HANDLE_MAX_BYTES: usize = 512;
/// Bytes of a start-failure reason.
pub const REASON_MAX_BYTES: usize = 256;
/// Bytes of an agent version or architecture string.
pub const SHORT_TEXT_MAX_BYTES: usize = 64;
/// Bytes of a label value.
pub const LABEL_VALUE_MAX_BYTES: usize = 128;

/// How far past DB time a worker's `finishedAt` may be, in milliseconds.
pub const FINISHED_AT_SKEW_MS: i64 = 5 * 60 * 1000;
