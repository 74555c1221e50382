//! A wave of polls: the polls of one group, each of another session, loaded together
//! (see the [module doc](super) for groups).
//!
//! Agents that move in step poll in step: at 8 agents, eight polls reach a lane at once.
//! One after another, each takes its own two load round trips and a third for its writes
//! (README, Benchmarks). As a wave they take three in all: every poll's first load
//! ([`load::poll_first`]) in one pipeline, every poll's queue probe with one DB time for
//! all in a second, and every poll's writes, merged where they are alike
//! ([`wave::record`]), in a third.
//!
//! The polls decide one after another, in the order of their sessions (the order their
//! sessions were locked in), each as it would right after the ones before it in one
//! transaction. What a poll loads no other poll writes, but for the queue: a poll writes
//! only its own session, attempts and offers, and the runs it places. So each poll's
//! probe takes as many runs more than its room as the polls before it have room
//! ([`load::poll_probe`]), and a poll decides on what its probe found less the runs the
//! polls before it placed, cut to its room: the oldest of the runs it would have found
//! after them. When that leaves it short of its room and its probe stopped at its limit
//! (the runs beyond the limit were not seen), the poll is left out of the wave and runs
//! again after it, alone ([`PgStore::polls`] answers `None` for it). The first poll of a
//! wave takes no more than its room and is never left out, so a group always moves on.

use super::load;
use super::wave::{self, Recorded};
use super::{admit_of, Admit, Done, Error, PgStore, Statement, Tx};
use crate::core;
use crate::model::Run;

use super::group::Job;

impl PgStore {
    /// Polls of a group, each of a session no other names ([`wave::pick`]), in three
    /// round trips (see the module doc). Returns each poll's decision, or `None` for a
    /// poll to run again after the wave, and how many statements the wave did not send.
    pub(super) async fn polls(
        &self,
        conn: &mut super::pool::Conn,
        jobs: &[&Job],
        open: &mut bool,
    ) -> Result<(Vec<Option<Done>>, u64), Error> {
        let offset = self.offset();
        let keys: Vec<core::Keys> = jobs.iter().map(|j| j.cmd.keys()).collect();
        // Sessions are locked in key order, so two waves lock them in one order.
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|&a, &b| {
            keys[a].session.as_ref().map(|s| s.as_str()).cmp(&keys[b].session.as_ref().map(|s| s.as_str()))
        });
        let begin = !std::mem::replace(open, true);
        let mut tx = Tx { conn };
        let first: Vec<Statement> = order.iter().flat_map(|&i| load::poll_first(&keys[i])).collect();
        let mut answers = tx.begun(begin, first).await?;
        let mut loaded = Vec::with_capacity(order.len());
        for _ in &order {
            loaded.push(load::read_poll_first(&mut answers)?);
        }
        // Each probe, its runs' answer in the batch; every room before it is its extra.
        let (mut batch, mut probes, mut before, mut alone) = (Vec::<Statement>::new(), Vec::new(), 0usize, 0usize);
        for rows in &loaded {
            let probe = load::poll_probe(rows, before)?;
            before = before.saturating_add(probe.room);
            alone += probe.statements.len() + 1;
            let mut at = None;
            for (j, statement) in probe.statements.into_iter().enumerate() {
                // The generic plans hold for the rest of the transaction: once is enough.
                if statement.0 == load::GENERIC_PLANS && batch.iter().any(|s| s.0 == load::GENERIC_PLANS) {
                    continue;
                }
                if probe.at == Some(j) {
                    at = Some(batch.len());
                }
                batch.push(statement);
            }
            probes.push((at, probe.room, probe.limit));
        }
        let admits: Vec<Option<Admit<'_>>> = order.iter().map(|&i| admit_of(jobs[i].audit.as_ref())).collect();
        batch.push(wave::stamps(offset, &admits));
        // The first loads are each poll's own; the second round trip saves the rest.
        let saved_loads = alone - batch.len();
        let mut answers = tx.run(&batch).await?;
        let stamps = answers.pop().unwrap_or_default();
        if stamps.len() != order.len() {
            return Err(Error::Corrupt(format!("DB time read {} rows for {} polls", stamps.len(), order.len())));
        }
        let mut done: Vec<Option<Done>> = jobs.iter().map(|_| None).collect();
        let (mut placed, mut records) = (Vec::new(), Vec::new());
        for ((((&i, mut rows), (at, room, limit)), stamp), admit) in
            order.iter().zip(loaded).zip(probes).zip(stamps).zip(&admits)
        {
            if let Some(at) = at {
                let found: Vec<Run> =
                    answers.get(at).into_iter().flatten().map(super::rows::read).collect::<Result<_, _>>()?;
                let seen = found.len();
                let mut queued: Vec<Run> = found.into_iter().filter(|r| !placed.contains(&r.id)).collect();
                if queued.len() < room && seen == limit {
                    continue; // the runs beyond its limit might have been its: alone, after the wave
                }
                queued.truncate(room);
                rows.queued = queued;
            }
            let (now, refused) = load::read_stamp(vec![stamp], *admit)?;
            let job = jobs[i];
            let concluded =
                self.conclude(&job.cmd, job.audit.as_ref().map(|a| &a.record), (rows, now, refused), offset)?;
            placed.extend(concluded.runs);
            records.push(Recorded { statements: concluded.record, checks: concluded.checks });
            done[i] = Some(concluded.done);
        }
        let merged = wave::record(&mut tx, records, false).await?;
        Ok((done, (saved_loads + merged) as u64))
    }
}
