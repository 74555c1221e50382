//! The live log of PROTOCOL §13: chunk admission, the append and the seal.
//!
//! A chunk is decided twice. [`admit_chunk`] runs on the frame header alone, before any
//! content byte is read, and says whether the content would be appended or is a repeat
//! to compare; the content then goes to the artifact store, and [`append`] decides again
//! under the attempt's locks, so a concurrent request that moved the log on meanwhile
//! is caught. Only [`append`] and [`seal`] write: the acknowledged length and the chunk
//! row, or the seal mark. The bytes of a chunk are compared with what is acknowledged
//! by [`same_bytes`], a pure function of the chunks' stored contents.

use ql_wire::capability::Digest;
use ql_wire::fence::Fence;
use ql_wire::ids::{ArtifactId, ProjectId};
use ql_wire::log::{LogAppendReply, LogChunkHeader, Seal};
use ql_wire::route::AttemptPath;
use ql_wire::{ErrorCode, Outcome};

use super::fence::{identify, live, Held, SessionNeed};
use super::{Decision, Reply, Rows, Write};
use crate::model::{Attempt, AttemptStatus, LogChunk, Millis};

/// What a chunk that passed admission is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkPlan {
    /// It continues the acknowledged log: store its content, then [`append`].
    Append,
    /// It lies wholly within the acknowledged log: compare its content with the stored
    /// bytes ([`same_bytes`]); equal is `already_appended`, anything else a conflict.
    Replay,
}

/// The answer of a chunk admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkAdmitted {
    /// Where the attempt's artifacts live.
    pub project: ProjectId,
    /// What to do with the content.
    pub plan: ChunkPlan,
    /// The acknowledged length now.
    pub acked: u64,
}

/// The fence and state checks that every live-log command shares: the attempt is
/// `running` under a `leased`, unexpired lease at the expected version, the artifact is
/// the one its `running` ACK declared, and the log is not sealed.
fn writable<'a>(
    path: &AttemptPath,
    fence: &Fence,
    artifact: &ArtifactId,
    rows: &'a Rows,
    now: Millis,
) -> Result<Held<'a>, ErrorCode> {
    let held = identify(path, fence, rows, now, SessionNeed::SameGeneration)?;
    if held.attempt.status.is_terminal() || held.run.status.is_terminal() {
        return Err(ErrorCode::AlreadyTerminal);
    }
    if held.attempt.status != AttemptStatus::Running {
        return Err(ErrorCode::StateConflict);
    }
    live(&held, fence, now, true)?;
    if held.attempt.log_artifact.as_ref() != Some(artifact) {
        return Err(ErrorCode::ArtifactConflict);
    }
    Ok(held)
}

/// Where a chunk falls against what is acknowledged, once the attempt may take it.
fn place(attempt: &Attempt, limit: u64, header: &LogChunkHeader) -> Result<ChunkPlan, Decision> {
    if attempt.log_sealed {
        return Err(Decision::refuse(ErrorCode::StateConflict));
    }
    let acked = attempt.log_acked;
    if header.offset == acked {
        if header.end() > limit {
            return Err(Decision::refuse(ErrorCode::PayloadTooLarge));
        }
        return Ok(ChunkPlan::Append);
    }
    if header.end() <= acked {
        return Ok(ChunkPlan::Replay);
    }
    Err(Decision::answer(Reply::LogOffsetConflict(acked)))
}

pub(super) fn admit_chunk(path: &AttemptPath, header: &LogChunkHeader, rows: &Rows, now: Millis) -> Decision {
    let held = match writable(path, &header.fence(), &header.artifact_id, rows, now) {
        Ok(held) => held,
        Err(code) => return Decision::refuse(code),
    };
    match place(held.attempt, held.run.spec.log_limit_bytes, header) {
        Ok(plan) => Decision::answer(Reply::ChunkAdmitted(ChunkAdmitted {
            project: held.run.project.clone(),
            plan,
            acked: held.attempt.log_acked,
        })),
        Err(decision) => decision,
    }
}

pub(super) fn append(
    path: &AttemptPath,
    header: &LogChunkHeader,
    sha256: &Digest,
    rows: &Rows,
    now: Millis,
) -> Decision {
    let held = match writable(path, &header.fence(), &header.artifact_id, rows, now) {
        Ok(held) => held,
        Err(code) => return Decision::refuse(code),
    };
    let attempt = held.attempt;
    match place(attempt, held.run.spec.log_limit_bytes, header) {
        Ok(ChunkPlan::Append) => {}
        // Another request moved the log on since the admission: the content was not
        // compared, so the sender learns where the log stands and goes on from there.
        Ok(ChunkPlan::Replay) => return Decision::answer(Reply::LogOffsetConflict(attempt.log_acked)),
        Err(decision) => return decision,
    }
    let chunk = LogChunk {
        attempt: attempt.id.clone(),
        offset: header.offset,
        length: header.content_length,
        sha256: sha256.clone(),
    };
    let acked = header.end();
    let next = Attempt { log_acked: acked, ..attempt.clone() };
    let reply = Reply::LogAppended(LogAppendReply { result: Outcome::Appended, acked });
    Decision::apply(reply, vec![Write::Attempt(next), Write::LogChunk(chunk)])
}

pub(super) fn seal(path: &AttemptPath, artifact: &ArtifactId, body: &Seal, rows: &Rows, now: Millis) -> Decision {
    let held = match writable(path, &body.fence(), artifact, rows, now) {
        Ok(held) => held,
        Err(code) => return Decision::refuse(code),
    };
    let attempt = held.attempt;
    if body.content_length != attempt.log_acked {
        return Decision::answer(Reply::LogOffsetConflict(attempt.log_acked));
    }
    let reply = Reply::SealAdmitted(held.run.project.clone());
    if attempt.log_sealed {
        // A repeated seal: the artifact is composed (again) from the same chunks.
        return Decision::answer(reply);
    }
    Decision::apply(reply, vec![Write::Attempt(Attempt { log_sealed: true, ..attempt.clone() })])
}

/// Whether `content`, placed at `offset`, equals the acknowledged bytes there. `stored`
/// holds the chunks that overlap `offset..offset + content.len()`, in order, each with
/// its bytes; chunks that do not overlap are ignored. A gap or a short chunk is a
/// difference, never a match.
pub fn same_bytes(offset: u64, content: &[u8], stored: &[(LogChunk, Vec<u8>)]) -> bool {
    let end = offset + content.len() as u64;
    let mut at = offset;
    for (chunk, bytes) in stored {
        let chunk_end = chunk.offset + chunk.length;
        if chunk_end <= at || chunk.offset >= end {
            continue;
        }
        if chunk.offset > at || bytes.len() as u64 != chunk.length {
            return false;
        }
        let from = (at - chunk.offset) as usize;
        let to = (end.min(chunk_end) - chunk.offset) as usize;
        let want = &content[(at - offset) as usize..(at - offset) as usize + (to - from)];
        if &bytes[from..to] != want {
            return false;
        }
        at = chunk.offset + to as u64;
        if at == end {
            return true;
        }
    }
    at == end
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{applied, fence, path, world, NOW};
    use super::*;
    use ql_wire::ids::AttemptId;
    use ql_wire::log::LogChunkSchema;

    fn log_id() -> ArtifactId {
        ArtifactId::parse("log").unwrap()
    }

    /// A running attempt that declared the log artifact, with `acked` bytes acknowledged.
    fn running(acked: u64) -> Rows {
        let mut rows = world(AttemptStatus::Running);
        let attempt = rows.attempt.as_mut().unwrap();
        attempt.log_artifact = Some(log_id());
        attempt.log_acked = acked;
        rows
    }

    fn header(offset: u64, len: u64) -> LogChunkHeader {
        LogChunkHeader::new(fence(), LogChunkSchema, log_id(), offset, len)
    }

    #[test]
    fn a_chunk_is_placed_by_its_offset_against_the_acknowledged_length() {
        let rows = running(100);
        let p = path(&rows);
        let plan = |offset, len| match admit_chunk(&p, &header(offset, len), &rows, NOW).reply {
            Ok(Reply::ChunkAdmitted(a)) => Ok(a.plan),
            Ok(Reply::LogOffsetConflict(acked)) => Err(Some(acked)),
            Ok(other) => panic!("{other:?}"),
            Err(_) => Err(None),
        };
        assert_eq!(plan(100, 1), Ok(ChunkPlan::Append));
        assert_eq!(plan(0, 100), Ok(ChunkPlan::Replay));
        assert_eq!(plan(99, 1), Ok(ChunkPlan::Replay));
        for (offset, len) in [(101, 1), (99, 2), (0, 101), (200, 5)] {
            assert_eq!(plan(offset, len), Err(Some(100)), "{offset}+{len}");
        }
        // No admission ever writes.
        assert!(admit_chunk(&p, &header(100, 1), &rows, NOW).writes.is_empty());
    }

    #[test]
    fn an_append_writes_the_length_and_the_chunk_and_a_repeat_then_conflicts() {
        let rows = running(0);
        let p = path(&rows);
        let sha = Digest::of(b"hello");
        let d = append(&p, &header(0, 5), &sha, &rows, NOW);
        assert_eq!(d.reply, Ok(Reply::LogAppended(LogAppendReply { result: Outcome::Appended, acked: 5 })));
        let after = applied(&rows, &d);
        assert_eq!(after.attempt.as_ref().unwrap().log_acked, 5);
        assert!(d
            .writes
            .iter()
            .any(|w| matches!(w, Write::LogChunk(c) if c.offset == 0 && c.length == 5 && c.sha256 == sha)));
        let again = append(&p, &header(0, 5), &sha, &after, NOW);
        assert_eq!((again.reply, again.writes.len()), (Ok(Reply::LogOffsetConflict(5)), 0));
    }

    #[test]
    fn the_log_limit_the_seal_and_the_state_refuse_without_writes() {
        let limit = running(0).run.unwrap().spec.log_limit_bytes;
        let full = running(limit);
        let p = path(&full);
        let refused = |d: Decision, code| {
            assert_eq!(d.reply, Err(code));
            assert!(d.writes.is_empty());
        };
        refused(admit_chunk(&p, &header(limit, 1), &full, NOW), ErrorCode::PayloadTooLarge);
        let seal_body = |len| Seal::new(fence(), len, false);
        assert_eq!(seal(&p, &log_id(), &seal_body(limit - 1), &full, NOW).reply, Ok(Reply::LogOffsetConflict(limit)));
        let sealed = applied(&full, &seal(&p, &log_id(), &seal_body(limit), &full, NOW));
        assert!(sealed.attempt.as_ref().unwrap().log_sealed);
        refused(admit_chunk(&p, &header(limit, 1), &sealed, NOW), ErrorCode::StateConflict);
        assert!(seal(&p, &log_id(), &seal_body(limit), &sealed, NOW).writes.is_empty(), "a repeated seal");
        let other = ArtifactId::parse("other").unwrap();
        refused(seal(&p, &other, &seal_body(limit), &full, NOW), ErrorCode::ArtifactConflict);
        let starting = world(AttemptStatus::Starting);
        refused(admit_chunk(&path(&starting), &header(0, 1), &starting, NOW), ErrorCode::StateConflict);
    }

    fn chunk(offset: u64, bytes: &[u8]) -> (LogChunk, Vec<u8>) {
        let c = LogChunk {
            attempt: AttemptId::parse("a1").unwrap(),
            offset,
            length: bytes.len() as u64,
            sha256: Digest::of(bytes),
        };
        (c, bytes.to_vec())
    }

    #[test]
    fn same_bytes_compares_across_chunk_boundaries() {
        let stored = [chunk(0, b"hello "), chunk(6, b"world"), chunk(11, b"!")];
        assert!(same_bytes(0, b"hello world!", &stored));
        assert!(same_bytes(3, b"lo wo", &stored));
        assert!(same_bytes(6, b"world", &stored));
        assert!(same_bytes(11, b"!", &stored));
        assert!(!same_bytes(3, b"lo Wo", &stored));
        assert!(!same_bytes(0, b"hello world!?", &stored), "past the end is no match");
        assert!(!same_bytes(0, b"hello", &stored[1..]), "a missing chunk is no match");
        assert!(same_bytes(0, b"", &stored));
    }

    #[test]
    fn same_bytes_refuses_a_stored_chunk_of_the_wrong_length() {
        let (c, _) = chunk(0, b"abcd");
        assert!(!same_bytes(0, b"ab", &[(c, b"ab".to_vec())]));
    }
}
