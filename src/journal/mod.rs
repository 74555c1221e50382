//! The agent's durable journal: persist, then act.
//!
//! Before the agent sends a claim, an ACK or a completion that depends on a fact, it
//! appends the fact to this journal and fsyncs it. After a crash or a power loss the agent
//! reopens the journal and finds every job it held: the offer and the lease token it made
//! for the claim, the lease and spec the claim returned, how far the start got, the callback
//! token, the exit evidence and the artifact receipt. It is the one place raw lease and
//! callback tokens are stored; in memory they stay in zeroizing [`ql_wire::capability::Token`]s.
//!
//! - [`state`]: the [`Record`]s and the pure [`JournalState::apply`] that folds them.
//! - [`file`](mod@file): the file itself ([`Journal`]): recovery, appends, compaction.
//!
//! # On-disk format (version 1)
//!
//! One file, `<dir>/journal`, mode 0600, in a directory created with mode 0700. All
//! integers are big-endian.
//!
//! ```text
//! header   8 bytes  magic "QLAGJRNL"
//!          4 bytes  u32 format version (1)
//! record*  4 bytes  u32 payload length L, 1 ..= 1 MiB
//!          4 bytes  u32 CRC-32 (IEEE, as in zlib) of the 4 length bytes then the payload
//!          L bytes  payload: one `Record` as compact JSON, `{"kind":"<camelCase>", ...}`
//! ```
//!
//! Rules:
//!
//! - **One agent per directory.** Opening first takes an exclusive `flock` on `<dir>/lock`
//!   (mode 0600, empty) and holds it while the journal is open; the kernel releases it
//!   when the process ends, even by SIGKILL. A second agent on the same directory is refused
//!   before it reads or writes anything: two agents sharing a journal would claim, start
//!   and report the same jobs.
//! - **A record counts once it is fsynced.** [`Journal::append`] writes the whole frame at
//!   the end of the last good record and calls `fdatasync`; only then may the caller apply
//!   it and act. If the write or the sync fails, the frame is cut off again (or, if even
//!   that fails, the journal refuses appends until it is compacted or reopened), so a
//!   failed record never sits in front of later ones.
//! - **A torn or corrupt tail is dropped, never half-applied.** Opening reads records in
//!   order and stops at the first frame that is incomplete, has a length of 0 or above the
//!   cap, or fails its checksum; the file is truncated there and fsynced. Everything before
//!   it is applied whole; nothing from it on is applied at all. A corrupt record in the
//!   middle therefore also drops the records after it: their order matters and a gap
//!   cannot be trusted. A record whose checksum holds but whose JSON does not decode was
//!   written whole by some other program or version; that is an error, and the file is
//!   left untouched for an operator.
//! - **Records the state refuses are skipped.** Replay uses the same pure
//!   [`JournalState::apply`] as the live agent, so a record refused when it was first
//!   applied is refused again, and the recovered state is the state before the crash.
//!   ([`Journal::commit`] checks before it writes, so such records only arise when a caller
//!   appends without checking.)
//! - **Creation and compaction are atomic.** A new file (the header, then any records) is
//!   written to `<dir>/journal.tmp`, fsynced, renamed over `<dir>/journal`, and then the
//!   directory is fsynced. A leftover `journal.tmp` is removed on open. A `journal` shorter
//!   than its header can only be a damaged copy of a fresh one: if its bytes match the
//!   header so far it is recreated empty, otherwise it is refused as a foreign file. A
//!   foreign magic or another version is refused, never overwritten.
//! - **The file never grows without bound.** [`Journal::commit`] rewrites the live state
//!   (via [`JournalState::to_records`]'s per-job records) when a job is dropped, and when
//!   the file is larger than a threshold ([`Options::compact_threshold`]) and more than twice
//!   its size after the last compaction.

pub(crate) mod file;
pub(crate) mod state;

pub(crate) use file::{CommitError, Journal, Options, Recovery};
pub(crate) use state::{
    Callback, CurrentSession, ExitEvidence, Job, JobKey, JournalState, Lease, Record, Refused, Spawn,
};
