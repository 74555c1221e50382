//! A wave of polls: the polls of one group, each of another session, loaded together
//! (see the [module doc](super) for groups).
//!
//! Agents that move in step poll in step: at 8 agents, eight polls reach a lane at once.
//! One after another, each takes its own two load round trips and a third for its writes
//! (bench/RESULTS.md). As a wave they take three in all, the last carrying the group's
//! COMMIT when the wave ends it: every poll's first load ([`load::poll_first`]) set-based
//! in one pipeline, a statement for all of each of its four reads ([`first`]), every
//! poll's queue probe (those by label sets as one statement: [`load::probes`]) with
//! one DB time for all in a second, and every poll's writes,
//! merged where they are alike ([`wave::record`]), in a third. The generic plans
//! ([`load::GENERIC_PLANS`]) are chosen first, as a wave of fenced commands does, so
//! that a wave's size never makes PostgreSQL plan its statements afresh.
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

use std::collections::HashMap;
use std::sync::LazyLock;

use tokio_postgres::Row;

use super::load;
use super::rows::{self, SESSION_COLS};
use super::wave::{self, Recorded};
use super::{admit_of, Admit, Done, Error, PgStore, Statement, Tx};
use crate::core;
use crate::model::{Offer, Run, Session, Worker};

use super::group::Job;

impl PgStore {
    /// Polls of a group, each of a session no other names ([`wave::pick`]), in three
    /// round trips (see the module doc), the COMMIT in the last when `last` (the wave
    /// ends the group) and no poll is left out. Returns each poll's decision, or `None`
    /// for a poll to run again after the wave, how many statements the wave did not
    /// send, and whether it sent the COMMIT.
    pub(super) async fn polls(
        &self,
        conn: &mut super::pool::Conn,
        jobs: &[&Job],
        open: &mut bool,
        last: bool,
    ) -> Result<(Vec<Option<Done>>, u64, bool), Error> {
        let offset = self.offset();
        let keys: Vec<core::Keys> = jobs.iter().map(|j| j.cmd.keys()).collect();
        // Sessions are locked in key order, so two waves lock them in one order.
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|&a, &b| {
            keys[a].session.as_ref().map(|s| s.as_str()).cmp(&keys[b].session.as_ref().map(|s| s.as_str()))
        });
        let begin = !std::mem::replace(open, true);
        let mut tx = Tx { conn };
        let ordered: Vec<&core::Keys> = order.iter().map(|&i| &keys[i]).collect();
        let statements = first(&ordered);
        // What each poll's own first load would have sent.
        let mut alone = 4 * ordered.len();
        let mut sent = statements.len();
        let answers = tx.begun(begin, statements).await?;
        let loaded = read_first(&ordered, answers)?;
        // Each probe: its room and limit, and where its runs are, probes by label sets
        // all in one statement; every room before it is its extra.
        let (mut batch, mut probes, mut before) = (Vec::<Statement>::new(), Vec::new(), 0usize);
        let mut by_fits = Vec::new();
        for (poll, rows) in loaded.iter().enumerate() {
            let probe = load::poll_probe(rows, before)?;
            before = before.saturating_add(probe.room);
            let found = match probe.queue {
                None => {
                    alone += 1; // DB time
                    Found::Nothing
                }
                Some(load::Queue::Fits { trusted, fits }) => {
                    alone += 3; // the generic plans, the probe, DB time
                    by_fits.push((poll, trusted, fits, probe.limit));
                    Found::Fits
                }
                Some(queue) => {
                    let (statements, at) = queue.statements(probe.limit);
                    alone += statements.len() + 1;
                    let at = batch.len() + at;
                    batch.extend(statements);
                    Found::At(at)
                }
            };
            probes.push((found, probe.room, probe.limit));
        }
        let fits_at = (!by_fits.is_empty()).then(|| {
            batch.push(load::probes(by_fits));
            batch.len() - 1
        });
        let admits: Vec<Option<Admit<'_>>> = order.iter().map(|&i| admit_of(jobs[i].audit.as_ref())).collect();
        batch.push(wave::stamps(offset, &admits));
        sent += batch.len();
        let saved_loads = alone.saturating_sub(sent);
        let mut answers = tx.run(&batch).await?;
        let stamps = answers.pop().unwrap_or_default();
        if stamps.len() != order.len() {
            return Err(Error::Corrupt(format!("DB time read {} rows for {} polls", stamps.len(), order.len())));
        }
        let mut by_fits = match fits_at {
            Some(at) => load::probed(std::mem::take(&mut answers[at]))?,
            None => HashMap::new(),
        };
        let mut done: Vec<Option<Done>> = jobs.iter().map(|_| None).collect();
        let (mut placed, mut records) = (Vec::new(), Vec::new());
        for (poll, ((((&i, mut rows), (found, room, limit)), stamp), admit)) in
            order.iter().zip(loaded).zip(probes).zip(stamps).zip(&admits).enumerate()
        {
            let runs = match found {
                Found::Nothing => None,
                Found::Fits => {
                    let mut runs = by_fits.remove(&poll).unwrap_or_default();
                    runs.truncate(limit);
                    Some(runs)
                }
                Found::At(at) => Some(std::mem::take(&mut answers[at])),
            };
            if let Some(runs) = runs {
                let found: Vec<Run> = runs.iter().map(super::rows::read).collect::<Result<_, _>>()?;
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
        let commit = last && done.iter().all(Option::is_some);
        let merged = wave::record(&mut tx, records, commit).await?;
        Ok((done, (saved_loads + merged) as u64, commit))
    }
}

/// Where a poll's queued runs are in the answers of a wave's second round trip.
enum Found {
    /// No probe: no session, or no room.
    Nothing,
    /// In the one probe of every poll by label sets ([`load::probes`]).
    Fits,
    /// In the answer at this index (a walk of the label sets queued).
    At(usize),
}

/// The wave's sessions, each locked as a poll locks its own, in key order.
static SESSIONS: LazyLock<String> = LazyLock::new(|| wave::locked("sessions", &SESSION_COLS, "id"));

/// Every poll's first load ([`load::poll_first`]) as one statement for each of its four
/// reads, after the generic plans: the sessions (locked, in key order), the workers the
/// requests name, each session's active attempts and its open offers. Each poll's own
/// reads of its attempts and offers come after its session's lock as they do alone, and
/// what a session's lock guards no other command changes until the COMMIT.
fn first(keys: &[&core::Keys]) -> Vec<Statement> {
    let named = |k: &&core::Keys| {
        let (Some(session), Some(worker)) = (&k.session, &k.worker) else {
            unreachable!("a poll names its session and worker");
        };
        (session.as_str().to_owned(), worker.as_str().to_owned())
    };
    let (sessions, mut workers): (Vec<String>, Vec<String>) = keys.iter().map(named).unzip();
    workers.sort_unstable();
    workers.dedup();
    vec![
        (load::GENERIC_PLANS.into(), Vec::new()),
        (SESSIONS.as_str().into(), wave::texts(sessions.iter().cloned())),
        (load::WORKERS_OF.as_str().into(), wave::texts(workers.into_iter())),
        (load::ACTIVE_ATTEMPTS_OF.into(), wave::texts(sessions.iter().cloned())),
        (load::OPEN_OFFERS_OF.as_str().into(), wave::texts(sessions.into_iter())),
    ]
}

/// Each poll's rows from [`first`]'s answers, in the order of `keys`, as
/// [`load::read_poll_first`] reads a poll's own (no session: nothing else).
fn read_first(keys: &[&core::Keys], mut answers: impl Iterator<Item = Vec<Row>>) -> Result<Vec<core::Rows>, Error> {
    let mut next = || answers.next().unwrap_or_default();
    let _plans = next();
    let sessions: Vec<Session> = next().iter().map(rows::read).collect::<Result<_, _>>()?;
    let workers: Vec<Worker> = next().iter().map(rows::read).collect::<Result<_, _>>()?;
    let active: HashMap<String, i64> = next().iter().map(|r| (r.get(0), r.get(1))).collect();
    let offers: Vec<Offer> = next().iter().map(rows::read).collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(keys.len());
    for k in keys {
        let (Some(session), Some(worker)) = (&k.session, &k.worker) else {
            unreachable!("a poll names its session and worker");
        };
        let mut rows = core::Rows {
            session: sessions.iter().find(|s| s.id == *session).cloned(),
            worker: workers.iter().find(|w| w.id == *worker).cloned(),
            ..core::Rows::default()
        };
        if rows.session.is_some() {
            let n = active.get(session.as_str()).copied().unwrap_or(0);
            rows.active_attempts = u32::try_from(n).unwrap_or(u32::MAX);
            rows.open_offers = offers.iter().filter(|o| o.session == *session).cloned().collect();
        }
        out.push(rows);
    }
    Ok(out)
}
