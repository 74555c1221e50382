//! Group commit on PostgreSQL: the lanes that run many agents' commands in one
//! transaction (see the [module doc](super) for what a group decides and why).
//!
//! A command about a worker session goes to a lane. A lane takes every command waiting
//! on it, up to `batch_max`, and, for at most its window, those of the agents it expects
//! ([`expected`]), and runs them as one group ([`PgStore::execute_batch`]) in one
//! transaction: its fenced commands about different rows first, as a wave
//! ([`wave`]), then the polls of different sessions, as a wave of polls ([`polls`](super::polls)),
//! then the others one after another. The fewer groups carry the same
//! commands, the less each command costs PostgreSQL, but one lane is one backend at a
//! time. So lanes fill in turn: a command goes to the first lane with fewer than `fill`
//! commands in flight (waiting or running), and only when every lane has that many to
//! the one with fewest. A few agents share one lane, whose groups gather the agents the
//! one before answered; a busier replica spreads over every lane. A session with a
//! command in flight sends its next one to the same lane, so its commands never wait for
//! each other from two groups of one replica; with nothing in flight it holds no place
//! (a worker naming made-up sessions leaves nothing behind).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use ql_wire::ErrorCode;

use super::{wave, Done, Error, Inner, PgStore};
use crate::core::{Command, Reply};
use crate::store::Audit;

/// Commands waiting on one lane.
const LANE_QUEUE: usize = 1024;

/// A command's answer as a lane gives it.
type Answer = Result<Result<Reply, ErrorCode>, Error>;

/// What group commit did so far on one store ([`PgStore::group_commits`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupCommits {
    /// Transactions that committed more than one command.
    pub transactions: u64,
    /// The commands they carried.
    pub commands: u64,
    /// Groups that failed and whose commands ran again, each alone.
    pub run_alone: u64,
    /// Sessions with a command in flight on a lane now.
    pub placed: u64,
    /// Statements the committed groups did not send: a wave's one statement for `n`
    /// commands' rows stands for `n` ([`wave`]) and saves `n - 1`.
    pub saved: u64,
}

/// A command queued on a lane, and where its answer goes.
pub(super) struct Job {
    pub(super) cmd: Command,
    pub(super) audit: Option<Audit>,
    pub(super) session: String,
    pub(super) answer: oneshot::Sender<Answer>,
}

/// The lanes of one store: their queues, each session's lane, and what they did.
pub(super) struct Lanes {
    queues: Vec<mpsc::Sender<Job>>,
    places: Mutex<Places>,
    transactions: AtomicU64,
    grouped: AtomicU64,
    run_alone: AtomicU64,
    saved: AtomicU64,
}

/// Which lane each session with a command in flight has, and each lane's commands in
/// flight.
struct Places {
    /// Commands in flight on each lane.
    load: Vec<usize>,
    /// Session id: its lane and its commands in flight (at least one).
    sessions: HashMap<String, (usize, usize)>,
    /// Commands in flight a lane takes before the next lane takes any.
    fill: usize,
}

impl Lanes {
    /// `n` lanes (none: every command alone), and the queue each lane's task takes; a
    /// lane takes `fill` commands in flight before the next lane takes any.
    pub(super) fn new(n: usize, fill: usize) -> (Self, Vec<mpsc::Receiver<Job>>) {
        let (queues, receivers) = (0..n).map(|_| mpsc::channel(LANE_QUEUE)).unzip();
        let places = Places { load: vec![0; n], sessions: HashMap::new(), fill };
        let zero = || AtomicU64::new(0);
        (
            Self {
                queues,
                places: Mutex::new(places),
                transactions: zero(),
                grouped: zero(),
                run_alone: zero(),
                saved: zero(),
            },
            receivers,
        )
    }

    pub(super) fn on(&self) -> bool {
        !self.queues.is_empty()
    }

    /// The lane of one more command of `session` (in flight until [`Lanes::done`]): its
    /// session's while another of it is in flight, else the first lane below `fill`, else
    /// the least busy.
    fn route(&self, session: &str) -> usize {
        let mut places = self.places.lock().unwrap_or_else(|e| e.into_inner());
        let p = &mut *places;
        let lane = match p.sessions.get_mut(session) {
            Some((lane, in_flight)) => {
                *in_flight += 1;
                *lane
            }
            None => {
                let lanes = 0..p.load.len();
                let lane = lanes.clone().find(|&l| p.load[l] < p.fill);
                let lane = lane.or_else(|| lanes.min_by_key(|&l| p.load[l])).unwrap_or(0);
                p.sessions.insert(session.to_owned(), (lane, 1));
                lane
            }
        };
        p.load[lane] += 1;
        lane
    }

    /// A command of `session` was answered.
    fn done(&self, session: &str) {
        let mut places = self.places.lock().unwrap_or_else(|e| e.into_inner());
        let p = &mut *places;
        let Some((lane, in_flight)) = p.sessions.get_mut(session) else { return };
        p.load[*lane] = p.load[*lane].saturating_sub(1);
        *in_flight -= 1;
        if *in_flight == 0 {
            p.sessions.remove(session);
        }
    }

    /// How many sessions have a command in flight.
    fn placed(&self) -> usize {
        self.places.lock().unwrap_or_else(|e| e.into_inner()).sessions.len()
    }
}

/// The lane key of `cmd` from `audit`'s principal: the session it names, as that
/// principal — a request naming another worker's session (refused, once loaded) never
/// waits in that session's lane. None, and the command runs alone, when it names no
/// session, is about a whole worker's work (a revocation takes many fences), or comes
/// from a request with no principal (refused at once, recorded on its own).
pub(super) fn lane_key(cmd: &Command, audit: Option<&Audit>) -> Option<String> {
    let keys = cmd.keys();
    let session = keys.session.filter(|_| keys.worker_work.is_none())?;
    match audit {
        None => Some(session.as_str().to_owned()),
        Some(Audit { record, admit }) => match (&record.principal, admit) {
            (Some(principal), _) => Some(format!("{}/{}", principal.as_str(), session.as_str())),
            (None, Some(_)) => None,
            (None, None) => Some(session.as_str().to_owned()),
        },
    }
}

impl PgStore {
    /// How many transactions committed several commands together, how many commands
    /// they carried, and how many groups failed and ran again command by command.
    pub fn group_commits(&self) -> GroupCommits {
        let l = &self.inner.lanes;
        GroupCommits {
            transactions: l.transactions.load(Ordering::Relaxed),
            commands: l.grouped.load(Ordering::Relaxed),
            run_alone: l.run_alone.load(Ordering::Relaxed),
            saved: l.saved.load(Ordering::Relaxed),
            placed: l.placed() as u64,
        }
    }

    /// Runs `cmd` on the lane of `session` and waits for its answer.
    pub(super) async fn in_lane(&self, session: String, cmd: Command, audit: Option<Audit>) -> Answer {
        let lanes = &self.inner.lanes;
        let lane = lanes.route(&session);
        let (answer, answered) = oneshot::channel();
        if let Err(refused) = lanes.queues[lane].send(Job { cmd, audit, session, answer }).await {
            lanes.done(&refused.0.session);
            return Err(Error::Closed);
        }
        answered.await.map_err(|_| Error::Closed)?
    }

    /// Runs commands routed to one lane ([`PgOptions::lanes`](super::PgOptions::lanes)) in one transaction: each
    /// command's load, decision and writes in turn — waves of fenced commands first,
    /// then waves of polls ([`wave::pick`]), the others in arrival order — then one COMMIT for
    /// all (group commit: one flush of the WAL and one transaction's overhead for the
    /// batch), sent in the pipeline of the last wave's writes when a wave ends the group.
    /// Every answer waits for that COMMIT. If a command fails before it — a
    /// statement, a lock wait PostgreSQL breaks as a deadlock — nothing of the batch is
    /// kept and each command runs again alone, so one command's failure is only its own.
    /// A COMMIT that fails may have committed: every command is answered with the error
    /// (`unavailable`, safe to repeat), as a command alone would be; so is a pipeline
    /// holding the COMMIT that failed other than by PostgreSQL refusing a statement
    /// ([`Error::Unsure`]).
    pub(super) async fn execute_batch(&self, jobs: &[Job]) -> Vec<Result<Result<Reply, ErrorCode>, Error>> {
        let mut conn = match self.inner.pool.get().await {
            Ok(conn) => conn,
            Err(e) => return e.each(jobs.len()),
        };
        let (mut open, mut committing) = (false, false);
        let mut done: Vec<Option<Done>> = jobs.iter().map(|_| None).collect();
        let (mut pending, mut saved): (Vec<usize>, u64) = ((0..jobs.len()).collect(), 0);
        while !pending.is_empty() {
            let ran = match wave::pick(jobs, &pending) {
                wave::Pick::Alone(i) => {
                    let job = &jobs[i];
                    let step = self.step(&mut conn, &job.cmd, job.audit.as_ref(), &mut open, false).await;
                    step.map(|d| (vec![(i, Some(d))], 0))
                }
                wave::Pick::Wave(picked) => {
                    // The group's last commands: their writes carry its COMMIT.
                    committing = picked.len() == pending.len();
                    let wave: Vec<&Job> = picked.iter().map(|&i| &jobs[i]).collect();
                    let ran = self.wave(&mut conn, &wave, &mut open, committing).await;
                    ran.map(|(d, s)| (picked.into_iter().zip(d.into_iter().map(Some)).collect(), s))
                }
                wave::Pick::Polls(picked) => {
                    let polls: Vec<&Job> = picked.iter().map(|&i| &jobs[i]).collect();
                    let last = picked.len() == pending.len();
                    let ran = self.polls(&mut conn, &polls, &mut open, last).await;
                    ran.map(|(d, s, commit)| {
                        committing = commit;
                        (picked.into_iter().zip(d).collect(), s)
                    })
                }
            };
            match ran {
                Ok((ran, s)) => {
                    // A poll a wave left out (`None`) stays pending and runs again.
                    for (i, d) in ran {
                        if let Some(d) = d {
                            pending.retain(|&p| p != i);
                            done[i] = Some(d);
                        }
                    }
                    saved += s;
                }
                // The COMMIT was sent and may have run: no command runs again.
                Err(e @ Error::Unsure(_)) => return e.each(jobs.len()),
                Err(_) => {
                    // Nothing of the group committed: the connection is dropped (rolling
                    // it back), and each command runs again on its own.
                    drop(conn);
                    self.inner.lanes.run_alone.fetch_add(1, Ordering::Relaxed);
                    let mut out = Vec::with_capacity(jobs.len());
                    for job in jobs {
                        out.push(self.execute_retrying(&job.cmd, job.audit.as_ref()).await);
                    }
                    return out;
                }
            }
        }
        let done: Vec<Done> = done.into_iter().map(|d| d.expect("every command of the group ran")).collect();
        // A COMMIT that fails may or may not have committed: every caller is told the
        // store is unavailable, and its replay finds whatever committed.
        let committed = async {
            if open && !committing {
                conn.client().batch_execute("COMMIT").await.map_err(Error::Pg)?;
            }
            let cmds: Vec<Command> = jobs.iter().map(|j| j.cmd.clone()).collect();
            self.committed(&mut conn, &cmds).await
        };
        match committed.await {
            Ok(()) => {
                conn.keep();
                self.inner.lanes.transactions.fetch_add(1, Ordering::Relaxed);
                self.inner.lanes.grouped.fetch_add(done.len() as u64, Ordering::Relaxed);
                self.inner.lanes.saved.fetch_add(saved, Ordering::Relaxed);
                done.into_iter().map(|d| Ok(d.apply(&self.inner.wakes))).collect()
            }
            Err(e) => e.each(jobs.len()),
        }
    }
}

/// One lane: takes every command queued on it (up to `most`), waiting up to `window`
/// for the agents it expects ([`expected`]), and runs them as one group, and again, for
/// as long as the store lives.
pub(super) async fn lane(store: Weak<Inner>, mut queue: mpsc::Receiver<Job>, most: usize, window: Duration) {
    // The lane keys of the last two groups' decided commands, the older first.
    let mut recent: [Vec<String>; 2] = Default::default();
    while let Some(first) = queue.recv().await {
        let jobs = gather(&mut queue, first, most.min(expected(&recent)), most, window).await;
        let Some(inner) = store.upgrade() else { return };
        let store = PgStore { inner };
        let answers = match jobs.as_slice() {
            [job] => vec![store.execute_retrying(&job.cmd, job.audit.as_ref()).await],
            _ => store.execute_batch(&jobs).await,
        };
        recent.rotate_left(1);
        recent[1] = decided(jobs.iter().map(|j| j.session.as_str()), &answers);
        for (job, answer) in jobs.into_iter().zip(answers) {
            store.inner.lanes.done(&job.session);
            let _ = job.answer.send(answer);
        }
    }
}

/// The sessions of a group that its lane expects back ([`expected`]): those whose
/// command was decided. A command refused or failed names a session no agent may come
/// back on (made up, another worker's, closed): counted, a worker sending commands for
/// made-up sessions would hold its lane's next two groups for the whole window each time.
fn decided<'a>(sessions: impl Iterator<Item = &'a str>, answers: &[Answer]) -> Vec<String> {
    sessions.zip(answers).filter(|(_, answer)| matches!(answer, Ok(Ok(_)))).map(|(s, _)| s.to_owned()).collect()
}

/// How many commands a lane's next group waits for: one from each session of its last
/// two groups whose command was decided ([`decided`]). Agents a group answered come back
/// together; those of the group before, answered while this one ran, are back already.
/// Waiting for the sessions of only the last group would leave a lane whose agents split
/// into two halves running half groups for ever, each queued while the other runs.
/// Measured at 8 agents: groups of 8 instead of 4, a renewal answered in 2.1–2.6 ms
/// instead of 3.6–4.3, a fifth more ACKs (bench/RESULTS.md).
fn expected(recent: &[Vec<String>; 2]) -> usize {
    let mut sessions: Vec<&str> = recent.iter().flatten().map(String::as_str).collect();
    sessions.sort_unstable();
    sessions.dedup();
    sessions.len()
}

/// The group that begins with `first`: every command already queued, up to `most`, and
/// while fewer than `want`, those that arrive within `window` of now.
async fn gather(queue: &mut mpsc::Receiver<Job>, first: Job, want: usize, most: usize, window: Duration) -> Vec<Job> {
    let deadline = tokio::time::Instant::now() + window;
    let mut jobs = vec![first];
    while jobs.len() < most {
        match queue.try_recv() {
            Ok(job) => jobs.push(job),
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) if jobs.len() >= want || window.is_zero() => break,
            Err(mpsc::error::TryRecvError::Empty) => match tokio::time::timeout_at(deadline, queue.recv()).await {
                Ok(Some(job)) => jobs.push(job),
                Ok(None) | Err(_) => break,
            },
        }
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_expects_each_session_of_its_last_two_groups_once() {
        let keys = |ks: &[&str]| ks.iter().map(|k| (*k).to_owned()).collect::<Vec<_>>();
        assert_eq!(expected(&Default::default()), 0, "a fresh lane expects no one");
        assert_eq!(expected(&[vec![], keys(&["a"])]), 1, "a lone agent");
        assert_eq!(expected(&[keys(&["a", "a"]), keys(&["a"])]), 1, "its commands count once");
        let halves = [keys(&["a", "b", "c", "d"]), keys(&["e", "f", "g", "h"])];
        assert_eq!(expected(&halves), 8, "agents split into halves are all expected");
        assert_eq!(expected(&[keys(&["a", "b"]), keys(&["b", "c"])]), 3);
    }

    #[test]
    fn a_lane_expects_back_only_the_sessions_its_group_decided_for() {
        let answers: Vec<Answer> = vec![
            Ok(Ok(Reply::Swept(0))),
            Ok(Err(ErrorCode::NotFound)),
            Ok(Err(ErrorCode::SessionConflict)),
            Err(Error::Closed),
            Ok(Ok(Reply::Swept(1))),
        ];
        let sessions = ["real-1", "made-up", "closed", "unavailable", "real-2"];
        let kept = decided(sessions.into_iter(), &answers);
        assert_eq!(kept, ["real-1", "real-2"]);
        assert_eq!(expected(&[Vec::new(), kept]), 2, "the refused ones are not waited for");
    }

    #[test]
    fn a_request_waits_in_the_lane_of_its_own_principal_and_session_only() {
        let (worker, session) = ("router-1".parse().unwrap(), "ses_1".parse().unwrap());
        let body = ql_wire::session::Heartbeat { generation: ql_wire::ids::Counter::ONE, draining: false };
        let heartbeat = Command::Heartbeat(worker, session, body);
        let from = |principal: Option<&str>, admit: Option<&str>| Audit {
            record: crate::model::AuditRecord {
                at: 0,
                principal: principal.map(|p| p.parse().unwrap()),
                route: "session.heartbeat".into(),
                outcome: "admitted".into(),
            },
            admit: admit.map(str::to_owned),
        };
        let own = lane_key(&heartbeat, Some(&from(Some("router-1"), Some("0a"))));
        let other = lane_key(&heartbeat, Some(&from(Some("router-2"), Some("0b"))));
        assert!(own.is_some() && other.is_some());
        assert_ne!(own, other, "another worker naming this session is placed as itself");
        assert_eq!(lane_key(&heartbeat, Some(&from(None, Some("0c")))), None, "no principal: alone");
        assert_eq!(lane_key(&heartbeat, None), Some("ses_1".to_owned()), "the store's own commands by session");
    }

    #[test]
    fn lanes_fill_in_turn_and_a_session_in_flight_keeps_its_lane() {
        let (lanes, _queues) = Lanes::new(3, 2);
        let lane: Vec<usize> = (0..8).map(|i| lanes.route(&format!("s{i}"))).collect();
        // Two in flight on each lane in turn, then the least busy: the first of those.
        assert_eq!(lane, [0, 0, 1, 1, 2, 2, 0, 1]);
        assert_eq!(lanes.places.lock().unwrap().load, vec![3, 3, 2]);
        // s0 has a command in flight on lane 0: its next one goes there too, though the
        // other lanes are less busy.
        assert_eq!(lanes.route("s0"), 0);
        lanes.done("s0");
        // Lane 1 is answered: the next session fills it again before lane 2.
        for s in ["s2", "s3", "s7"] {
            lanes.done(s);
        }
        assert_eq!(lanes.route("s8"), 1);
        assert_eq!(lanes.route("s9"), 1);
        // Every lane has two in flight again: the first of the least busy.
        assert_eq!(lanes.places.lock().unwrap().load, vec![3, 2, 2]);
        assert_eq!(lanes.route("s10"), 1);
        // s0 answered, nothing of it in flight: it holds no place, and its next command
        // goes where a new session's would.
        lanes.done("s0");
        assert_eq!(lanes.placed(), 7);
        assert_eq!(lanes.places.lock().unwrap().load, vec![2, 3, 2]);
        assert_eq!(lanes.route("s0"), 0);
    }

    #[test]
    fn a_session_holds_a_place_only_while_a_command_of_it_is_in_flight() {
        let (lanes, _queues) = Lanes::new(2, 1);
        // Made-up sessions, each answered: none keeps a place, and no lane counts them.
        for i in 0..100 {
            lanes.route(&format!("made-up-{i}"));
            lanes.done(&format!("made-up-{i}"));
        }
        assert_eq!(lanes.placed(), 0);
        assert_eq!(lanes.places.lock().unwrap().load, vec![0, 0]);
        // Two commands of one session in flight: it keeps its place until both are
        // answered, and an answer for a session with nothing in flight changes nothing.
        let lane = lanes.route("s");
        assert_eq!(lanes.route("s"), lane);
        lanes.done("s");
        assert_eq!(lanes.placed(), 1, "a command of s is still in flight");
        lanes.done("s");
        lanes.done("s");
        assert_eq!(lanes.placed(), 0);
        assert_eq!(lanes.places.lock().unwrap().load, vec![0, 0]);
    }
}
