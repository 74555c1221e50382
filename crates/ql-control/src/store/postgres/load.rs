//! Locking and loading a command's [`Keys`] into [`Rows`], inside its transaction.
//!
//! # Lock order (ADR-0109 §2)
//!
//! Every command takes its locks in one fixed order, so two commands can wait for each
//! other only in one direction and never deadlock:
//!
//! 1. the attempt's advisory fence: `pg_advisory_xact_lock(hashtextextended('attempt:'
//!    || id, 0))` — transaction-level, so a pooled connection never keeps it;
//! 2. the worker session, `SELECT ... FOR UPDATE`;
//! 3. the run, then the attempt, `FOR UPDATE`;
//! 4. the run lease, `FOR UPDATE`;
//! 5. the offer, `FOR UPDATE` (claim and cancel write it; it comes last).
//!
//! A command skips the levels it has no key for, never goes back up. Opening a session
//! first takes an advisory lock on the worker (two agents of one worker racing to open
//! must not both take the same generation), then the worker's sessions.
//!
//! Cancel names only the run. It reads the run's current attempt without a lock, takes
//! that attempt's fence, then locks the run; if the current attempt changed in between,
//! the transaction is retried ([`Error::Retry`]) rather than taking a fence out of order.
//!
//! # Pipelining
//!
//! Commands that name their attempt, session and run up front (every fenced command and
//! claim) send the whole load — `BEGIN`, fence, session, run, attempt, lease, offer,
//! completion event, DB time — in one pipeline, without waiting for each answer.
//! PostgreSQL executes a connection's statements strictly one after another, so the
//! locks are still taken in the order above, and the DB-time statement still starts
//! only after the last lock is held (`statement_timestamp()` is stamped when the server
//! begins that statement). One round trip instead of nine. A poll takes two ([`poll`]):
//! what its keys name (the session, the worker the request names, the session's active
//! attempts and open offers), then what needs the session's labels and room (the queue
//! probe) and DB time.
//!
//! # Placement and the sweeper never wait
//!
//! A poll locks the session, then takes queued runs with `FOR UPDATE SKIP LOCKED`: a run
//! another replica is placing right now is simply not offered here. The sweeper takes
//! every lock with `pg_try_advisory_xact_lock` and `SKIP LOCKED`, so it never waits for
//! a command — it cannot deadlock with anything, two sweepers on two replicas split the
//! lapsed rows between them, and a row busy in a live command is left for the next sweep.
//! The decision re-checks every lapse against DB time read after the locks. The one lock
//! a sweep waits for is the `authority` row (outage grace), which only sweeps take, and
//! first.

use std::collections::HashMap;
use std::sync::LazyLock;

use tokio_postgres::Row;

use ql_wire::ids::{AttemptId, RunId, SessionId, WorkerId};
use ql_wire::ErrorCode;

use super::rows::SCHEDULE_COLS;
use super::rows::{self, ATTEMPT_COLS, LEASE_COLS, OFFER_COLS, RUN_COLS, SESSION_COLS, WORKER_COLS};
use super::{schema, Admit, Error, Statement, Tx, STAMP_ADMIT};
use crate::core::{placement_room, Fit, Grace, Keys, Lapsed, Rows, Timings, Work, COMPLETION_EVENT};
use crate::model::{Millis, Session, Worker};
use crate::store::records::EVENT_COLS;
use crate::store::records::{CERTIFICATE_COLS, ENROLMENT_COLS};

/// Most queued runs placement looks at per poll.
pub(super) const PLACEMENT_BATCH: usize = 256;
/// Most lapsed rows of each kind one sweep handles.
pub(super) const SWEEP_BATCH: i64 = 256;

/// The blocking fence of an attempt.
const FENCE: &str = "SELECT pg_advisory_xact_lock(hashtextextended('attempt:' || $1, 0))";
/// The non-blocking fence of an attempt (sweeper).
const TRY_FENCE: &str = "SELECT pg_try_advisory_xact_lock(hashtextextended('attempt:' || $1, 0))";
/// When the worker's newest renewed certificate was issued (a renewal's rate: see
/// `core::identity::record_certificate`). Under the worker's lock, as every renewal.
const LAST_RENEWAL: &str = "SELECT max(issued_at) FROM certificates WHERE worker = $1 AND renewed_from IS NOT NULL";
/// The lock that serialises opening sessions of one worker.
const WORKER_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended('worker:' || $1, 0))";

/// An attempt's event of a kind, through the index that makes it unique (its run, the
/// attempt, the kind): `$1` the attempt, `$2` the kind.
pub(super) static COMPLETION_EVENT_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {EVENT_COLS} FROM events WHERE run_id = (SELECT run_id FROM attempts WHERE id = $1) \
         AND COALESCE(attempt_id, '') = $1 AND kind = $2"
    )
});

/// The event of a kind (`$2`) of each attempt of `$1`, as [`COMPLETION_EVENT_SQL`] finds
/// one's. `OFFSET 0` keeps each lookup a probe of the unique index, whatever the planner
/// guesses of the array.
#[doc(hidden)]
pub static COMPLETION_EVENTS_OF: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT e.* FROM unnest($1::text[]) AS k (key) CROSS JOIN LATERAL (SELECT {EVENT_COLS} FROM events \
         WHERE run_id = (SELECT run_id FROM attempts WHERE id = k.key) AND COALESCE(attempt_id, '') = k.key \
         AND kind = $2 OFFSET 0) e"
    )
});

fn by_id(table: &str, cols: &str, key: &str, lock: &str) -> String {
    format!("SELECT {cols} FROM {table} WHERE {key} = $1 {lock}")
}

async fn session(tx: &mut Tx<'_>, id: &SessionId, lock: &str) -> Result<Option<Session>, Error> {
    let sql = by_id("sessions", &SESSION_COLS, "id", lock);
    tx.one(&sql, &[&id.as_str()]).await?.as_ref().map(rows::read).transpose()
}

async fn one_by<T>(
    tx: &mut Tx<'_>,
    table: &str,
    cols: &str,
    key: &str,
    id: &str,
    lock: &str,
    map: fn(&Row) -> Result<T, Error>,
) -> Result<Option<T>, Error> {
    let sql = by_id(table, cols, key, lock);
    tx.one(&sql, &[&id]).await?.as_ref().map(map).transpose()
}

async fn fence(tx: &mut Tx<'_>, attempt: &AttemptId) -> Result<(), Error> {
    tx.one(FENCE, &[&attempt.as_str()]).await.map(drop)
}

async fn try_fence(tx: &mut Tx<'_>, attempt: &str) -> Result<bool, Error> {
    let row = tx.one(TRY_FENCE, &[&attempt]).await?;
    Ok(row.is_some_and(|r| r.get::<_, bool>(0)))
}

/// The worker's live sessions (to replace) and its highest generation (to succeed), as
/// in the SQLite store.
async fn worker_sessions(tx: &mut Tx<'_>, worker: &WorkerId) -> Result<Vec<Session>, Error> {
    tx.one(WORKER_LOCK, &[&worker.as_str()]).await?;
    let sql = format!(
        "SELECT {} FROM sessions WHERE worker = $1 AND (state IN ('online', 'draining') \
         OR generation = (SELECT MAX(generation) FROM sessions WHERE worker = $1)) ORDER BY generation FOR UPDATE",
        *SESSION_COLS
    );
    tx.all(&sql, &[&worker.as_str()]).await?.iter().map(rows::read).collect()
}

/// The attempts the worker holds (leased, or offered and open), by id: their fences are
/// taken, blocking and in id order, before any other lock (see the module doc), so
/// revoking a worker waits for a command in flight on one of them rather than racing it.
async fn fence_worker_work(tx: &mut Tx<'_>, worker: &WorkerId) -> Result<(), Error> {
    let held = tx
        .all(
            "SELECT attempt_id FROM leases WHERE state = 'leased' AND worker = $1 \
             UNION SELECT attempt_id FROM offers WHERE state = 'open' AND worker = $1 ORDER BY 1",
            &[&worker.as_str()],
        )
        .await?;
    for row in held {
        let a: String = row.get(0);
        tx.one(FENCE, &[&a.as_str()]).await?;
    }
    Ok(())
}

/// The worker's leased attempts and open offers with their runs and attempts, locked
/// (after its sessions). One placed in the instant between the fences and here has no
/// fence held and is left to lapse as usual.
async fn worker_work(tx: &mut Tx<'_>, worker: &WorkerId) -> Result<Work, Error> {
    const LOCK: &str = "FOR UPDATE";
    let mut out = Work::default();
    let leased = tx
        .all(
            "SELECT attempt_id, run_id FROM leases WHERE state = 'leased' AND worker = $1 ORDER BY attempt_id",
            &[&worker.as_str()],
        )
        .await?;
    for c in leased {
        let (a, r): (String, String) = (c.get(0), c.get(1));
        let run = one_by(tx, "runs", &RUN_COLS, "id", &r, LOCK, rows::read).await?;
        let attempt = one_by(tx, "attempts", &ATTEMPT_COLS, "id", &a, LOCK, rows::read).await?;
        let lease = one_by(tx, "leases", &LEASE_COLS, "attempt_id", &a, LOCK, rows::read).await?;
        if let (Some(lease), Some(run), Some(attempt)) = (lease, run, attempt) {
            out.leases.push((lease, run, attempt));
        }
    }
    let open = tx
        .all(
            "SELECT id, run_id, attempt_id FROM offers WHERE state = 'open' AND worker = $1 ORDER BY id",
            &[&worker.as_str()],
        )
        .await?;
    for c in open {
        let (o, r, a): (String, String, String) = (c.get(0), c.get(1), c.get(2));
        let run = one_by(tx, "runs", &RUN_COLS, "id", &r, LOCK, rows::read).await?;
        let attempt = one_by(tx, "attempts", &ATTEMPT_COLS, "id", &a, LOCK, rows::read).await?;
        let offer = one_by(tx, "offers", &OFFER_COLS, "id", &o, LOCK, rows::read).await?;
        if let (Some(offer), Some(run), Some(attempt)) = (offer, run, attempt) {
            out.offers.push((offer, run, attempt));
        }
    }
    Ok(out)
}

/// The expression that puts the rest of a transaction on generic plans: the poll's
/// [`GENERIC_PLANS`] and a wave's fences ([`WAVE_FENCES`](super::wave::WAVE_FENCES))
/// select it.
macro_rules! generic_plans {
    () => {
        "set_config('plan_cache_mode', 'force_generic_plan', true)"
    };
}
pub(super) use generic_plans;

/// Sent before the queue probe by label sets (see [`Queue`]), in its round trip: the
/// probe runs on the plan PostgreSQL prepared once for the connection. Left to choose,
/// PostgreSQL plans it afresh on every poll (an estimate for the actual number of label
/// sets always looks cheaper than the generic one), and that planning costs several
/// times the probe itself; the generic plan follows the queue's statistics all the same
/// (a sort of the few runs queued for a label set, or an ordered index scan of a long
/// queue). For the rest of the transaction only (the poll's writes, by key, and in a
/// group the commands after it, whose statements are all by key).
pub(super) const GENERIC_PLANS: &str = concat!("SELECT ", generic_plans!());

/// The queue probe by label sets: `$1` the worker's trusted labels, `$2` the label sets
/// (JSON text) a run's `agent_labels` may be, `$3` the room. Each set is probed on
/// `runs_queue_fit` in its order (agent_labels, then age), stopping at the room. The
/// set is compared as `= ANY (ARRAY[set])` and the order names `agent_labels`, so that
/// index is the only one that yields the order: with `=`, PostgreSQL would treat the
/// column as constant and could walk the whole queue in age order instead (it does when
/// every queued run has the same labels, guessing they all match any set). It is also
/// the queue's only index (migration 0018): with statistics taken while the queue was
/// empty, PostgreSQL took a second, smaller one by age alone for as cheap, and read the
/// whole queue.
pub static QUEUE_PROBE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT c.* FROM unnest($2::text[]) AS s (fit) CROSS JOIN LATERAL {} c ORDER BY c.created_at, c.id LIMIT $3",
        probe_of_set("s.fit::jsonb", "$1::text::jsonb", "$3")
    )
});

/// The probe of one label set, as [`QUEUE_PROBE`] explains it: the oldest queued runs,
/// at most `limit`, whose `agent_labels` are `fit` and whose `labels` the worker's
/// `trusted` ones cover, each locked unless another transaction holds it (SQL
/// expressions, all three).
fn probe_of_set(fit: &str, trusted: &str, limit: &str) -> String {
    format!(
        "(SELECT {} FROM runs r WHERE r.status = 'queued' AND r.agent_labels = ANY (ARRAY[{fit}]) \
         AND {trusted} @> r.labels ORDER BY r.agent_labels, r.created_at, r.id LIMIT {limit} FOR UPDATE SKIP LOCKED)",
        *RUN_COLS
    )
}

/// The queue probe of a session declaring more labels than it probes subsets for: `$1`
/// the worker's trusted labels, `$2` the declared labels, `$3` the room. It walks the
/// label sets queued (one step along `runs_queue_fit` per set, from each set to the next),
/// keeps those within the declared labels, and probes each as [`QUEUE_PROBE`] probes one:
/// its cost follows how many label sets are queued (as many as runs only when every run
/// has a set of its own), not how many runs. As the probe by subsets does, it locks up to
/// the room's runs of each set within the declared labels until COMMIT.
#[doc(hidden)]
pub static QUEUE_WALK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH RECURSIVE sets (fit) AS (\
         (SELECT r.agent_labels FROM runs r WHERE r.status = 'queued' ORDER BY r.agent_labels LIMIT 1) \
         UNION ALL SELECT (SELECT r.agent_labels FROM runs r WHERE r.status = 'queued' AND r.agent_labels > s.fit \
         ORDER BY r.agent_labels LIMIT 1) FROM sets s WHERE s.fit IS NOT NULL) \
         SELECT c.* FROM (SELECT fit FROM sets WHERE $2::text::jsonb @> fit) s CROSS JOIN LATERAL {} c \
         ORDER BY c.created_at, c.id LIMIT $3",
        probe_of_set("s.fit", "$1::text::jsonb", "$3")
    )
});

/// The queue probes of several polls as one statement: a row of `$1`..`$4` (the poll,
/// its worker's trusted labels, one of its label sets, its limit) for each label set of
/// each poll, each probed as [`QUEUE_PROBE`] probes one, in the order of the rows (so the
/// runs are locked in the order the polls' own probes would lock them, one after
/// another). Each run found is tagged with its poll (`probe`), and the answer is in
/// poll order, each poll's runs oldest first ([`probed`]): a poll keeps the first up to
/// its limit, as its own probe's outer `LIMIT` would.
#[doc(hidden)]
pub static QUEUE_PROBES_OF: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT q.* FROM (SELECT c.*, p.n AS probe \
         FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[]) AS p (n, trusted, fit, lim) \
         CROSS JOIN LATERAL {} c) q ORDER BY q.probe, q.created_at, q.id",
        probe_of_set("p.fit::jsonb", "p.trusted::jsonb", "p.lim")
    )
});

/// How a poll probes the queue for runs its worker fits (its trusted labels cover the
/// run's `labels`, the session's declared ones its `agent_labels`), oldest first, locked
/// with SKIP LOCKED, at most as many as its limit ([`poll_probe`]).
///
/// A run fits a session's declared labels exactly when its `agent_labels` is one of their
/// subsets, so placement probes the queue's index by `agent_labels` once per subset, each
/// probe taking at most the limit in age order (skipping locked ones), then keeps the
/// oldest of them: its cost follows the session's labels and room, not how many runs
/// wait for other workers. The runs a probe locked beyond those stay queued and are
/// released at COMMIT (another replica's poll skips them meanwhile, as any run being
/// placed). A session declaring more than [`SUBSET_LABELS`](crate::core::SUBSET_LABELS)
/// labels walks the label sets queued instead ([`QUEUE_WALK`]).
pub(super) enum Queue {
    /// By label sets: the trusted labels and each set, as JSON.
    Fits { trusted: String, fits: Vec<String> },
    /// By the label sets queued: the trusted labels and the declared ones, as JSON.
    Walk { trusted: String, declared: String },
}

impl Queue {
    fn of(session: &Session, trusted: Option<&Worker>) -> Result<Self, Error> {
        let json = |labels: &std::collections::BTreeMap<String, String>| {
            serde_json::to_string(labels).map_err(|e| Error::Corrupt(e.to_string()))
        };
        let fit =
            Fit { trusted: trusted.map(|w| w.labels.clone()).unwrap_or_default(), declared: session.labels.clone() };
        let trusted = json(&fit.trusted)?;
        Ok(match fit.declared_subsets() {
            Some(subsets) => Queue::Fits { trusted, fits: subsets.iter().map(json).collect::<Result<_, _>>()? },
            None => Queue::Walk { trusted, declared: json(&fit.declared)? },
        })
    }

    /// The statements of one poll's probe taking at most `limit`, and which of their
    /// answers holds the runs: they go in the poll's second round trip ([`poll`]).
    pub(super) fn statements(self, limit: usize) -> (Vec<Statement>, usize) {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        match self {
            Queue::Fits { trusted, fits } => {
                let params: rows::Params = vec![Box::new(trusted), Box::new(fits), Box::new(limit)];
                (vec![(GENERIC_PLANS.into(), Vec::new()), (QUEUE_PROBE.as_str().into(), params)], 1)
            }
            Queue::Walk { trusted, declared } => {
                let params: rows::Params = vec![Box::new(trusted), Box::new(declared), Box::new(limit)];
                (vec![(GENERIC_PLANS.into(), Vec::new()), (QUEUE_WALK.as_str().into(), params)], 1)
            }
        }
    }
}

/// Several polls' probes by label sets ([`Queue::Fits`]) as one statement
/// ([`QUEUE_PROBES_OF`]): each (the poll, its trusted labels, its label sets, its limit).
pub(super) fn probes(probes: Vec<(usize, String, Vec<String>, usize)>) -> Statement {
    let (mut n, mut trusted, mut fit, mut lim) = (Vec::<i64>::new(), Vec::new(), Vec::new(), Vec::<i64>::new());
    for (poll, labels, fits, limit) in probes {
        for f in fits {
            n.push(i64::try_from(poll).unwrap_or(i64::MAX));
            trusted.push(labels.clone());
            fit.push(f);
            lim.push(i64::try_from(limit).unwrap_or(i64::MAX));
        }
    }
    (QUEUE_PROBES_OF.as_str().into(), vec![Box::new(n), Box::new(trusted), Box::new(fit), Box::new(lim)])
}

/// Each poll's runs in the answer to [`probes`], oldest first (all a probe by set took:
/// the poll keeps the first of them up to its limit, as one poll's probe does).
pub(super) fn probed(rows: Vec<Row>) -> Result<HashMap<usize, Vec<Row>>, Error> {
    let mut out: HashMap<usize, Vec<Row>> = HashMap::new();
    for row in rows {
        let poll: i64 = row.try_get("probe").map_err(Error::Pg)?;
        let poll = usize::try_from(poll).map_err(|_| Error::Corrupt(format!("a queue probe of poll {poll}")))?;
        out.entry(poll).or_default().push(row);
    }
    Ok(out)
}

/// The statuses of an attempt that hold its session's capacity.
macro_rules! active {
    () => {
        "status IN ('offered', 'claimed', 'starting', 'running')"
    };
}

/// A session's active attempts (`$1` the session).
const ACTIVE_ATTEMPTS: &str = concat!("SELECT COUNT(*) FROM attempts WHERE session_id = $1 AND ", active!());

/// Each session's active attempts, a row (session, count) per key of `$1`.
#[doc(hidden)]
pub const ACTIVE_ATTEMPTS_OF: &str = concat!(
    "SELECT k.key, (SELECT COUNT(*) FROM attempts WHERE session_id = k.key AND ",
    active!(),
    ") FROM unnest($1::text[]) AS k (key)"
);

/// A session's open offers, oldest deadline first (`$1` the session).
static OPEN_OFFERS: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM offers WHERE session_id = $1 AND state = 'open' ORDER BY expires_at, id", *OFFER_COLS)
});

/// The open offers of every session of `$1`, each session's oldest deadline first.
/// `OFFSET 0` keeps each session's lookup a probe of its index, whatever the planner
/// guesses of the array.
#[doc(hidden)]
pub static OPEN_OFFERS_OF: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT o.* FROM unnest($1::text[]) AS k (key) CROSS JOIN LATERAL (SELECT {} FROM offers \
         WHERE session_id = k.key AND state = 'open' ORDER BY expires_at, id OFFSET 0) o ORDER BY k.key, o.expires_at, o.id",
        *OFFER_COLS
    )
});

/// The workers of `$1`, a probe of the key each.
#[doc(hidden)]
pub static WORKERS_OF: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT w.* FROM unnest($1::text[]) AS k (key) CROSS JOIN LATERAL (SELECT {} FROM workers WHERE id = k.key OFFSET 0) w", *WORKER_COLS)
});

/// Locks and loads the attempt's run, attempt and lease (in that order).
async fn run_attempt_lease(
    tx: &mut Tx<'_>,
    run: Option<&RunId>,
    attempt: &AttemptId,
    out: &mut Rows,
) -> Result<(), Error> {
    const LOCK: &str = "FOR UPDATE";
    if let Some(run) = run {
        out.run = one_by(tx, "runs", &RUN_COLS, "id", run.as_str(), LOCK, rows::read).await?;
    }
    out.attempt = one_by(tx, "attempts", &ATTEMPT_COLS, "id", attempt.as_str(), LOCK, rows::read).await?;
    if out.run.is_none() && run.is_none() {
        if let Some(r) = out.attempt.as_ref().map(|a| a.run.clone()) {
            out.run = one_by(tx, "runs", &RUN_COLS, "id", r.as_str(), LOCK, rows::read).await?;
        }
    }
    if out.attempt.is_some() {
        out.lease = one_by(tx, "leases", &LEASE_COLS, "attempt_id", attempt.as_str(), LOCK, rows::read).await?;
    }
    Ok(())
}

/// Cancel: fence of the run's current attempt, then the run, attempt, lease and offer.
async fn current_attempt(tx: &mut Tx<'_>, run: &RunId, out: &mut Rows) -> Result<(), Error> {
    let seen = one_by(tx, "runs", "current_attempt_id", "id", run.as_str(), "", |r| {
        r.try_get::<_, Option<String>>(0).map_err(Error::Pg)
    })
    .await?;
    let Some(seen) = seen else {
        return Ok(()); // no such run: the decision answers not_found
    };
    if let Some(a) = &seen {
        tx.one(FENCE, &[&a.as_str()]).await?;
    }
    out.run = one_by(tx, "runs", &RUN_COLS, "id", run.as_str(), "FOR UPDATE", rows::read).await?;
    let now_current = out.run.as_ref().and_then(|r| r.current_attempt.as_ref()).map(|a| a.as_str().to_owned());
    if now_current != seen {
        return Err(Error::Retry);
    }
    if let Some(a) = out.run.as_ref().and_then(|r| r.current_attempt.clone()) {
        run_attempt_lease(tx, None, &a, out).await?;
        if let Some(o) = out.attempt.as_ref().map(|a| a.offer.clone()) {
            out.offer = one_by(tx, "offers", &OFFER_COLS, "id", o.as_str(), "FOR UPDATE", rows::read).await?;
        }
    }
    Ok(())
}

/// Begins the transaction and loads what `keys` names, taking the locks in the
/// protocol's order; then reads DB time and, with `admit`, the request's admission.
/// Returns the rows, DB time and the admission's refusal, if any.
pub(super) async fn load(
    tx: &mut Tx<'_>,
    keys: &Keys,
    offset: i64,
    timings: &Timings,
    admit: Option<Admit<'_>>,
    begin: bool,
) -> Result<(Rows, Millis, Option<ErrorCode>), Error> {
    if is_fenced(keys) {
        return pipelined(tx, keys, offset, admit, begin).await;
    }
    if is_poll(keys) {
        return poll(tx, keys, offset, admit, begin).await;
    }
    if begin {
        tx.exec("BEGIN", &[]).await?;
    }
    let rows = load_in_order(tx, keys, offset, timings).await?;
    // DB time from a statement issued after every lock is held.
    let (now, refused) = match admit {
        None => (tx.now(offset).await?, None),
        Some(a) => {
            let row = tx.one(STAMP_ADMIT, &[&offset, &a.principal.as_str(), &a.serial]).await?;
            a.read(&row.ok_or_else(|| Error::Corrupt("DB time read no row".to_owned()))?)?
        }
    };
    Ok((rows, now, refused))
}

/// Whether `keys` are a fenced command's (attempt, session and run named up front, an
/// offer and the completion event perhaps, nothing else): its whole load is one pipeline
/// ([`fenced_load`]).
pub(super) fn is_fenced(keys: &Keys) -> bool {
    let fenced = Keys {
        attempt: keys.attempt.clone(),
        session: keys.session.clone(),
        run: keys.run.clone(),
        offer: keys.offer.clone(),
        completion_event: keys.completion_event,
        ..Keys::default()
    };
    keys.attempt.is_some() && keys.session.is_some() && keys.run.is_some() && *keys == fenced
}

/// The load of a fenced command as statements (see the module doc), `BEGIN` not
/// included: fence, session, run, attempt, lease, the offer and the completion event
/// when named, and last DB time (with the admission, given one). [`read_fenced`] reads
/// their answers.
pub(super) fn fenced_load(keys: &Keys, offset: i64, admit: Option<Admit<'_>>) -> Vec<Statement> {
    const LOCK: &str = "FOR UPDATE";
    let (Some(attempt), Some(session), Some(run)) = (&keys.attempt, &keys.session, &keys.run) else {
        unreachable!("a fenced command names its attempt, session and run");
    };
    let a = || -> rows::Params { vec![Box::new(attempt.as_str().to_owned())] };
    let mut out: Vec<Statement> = vec![
        (FENCE.into(), a()),
        (by_id("sessions", &SESSION_COLS, "id", LOCK).into(), vec![Box::new(session.as_str().to_owned())]),
        (by_id("runs", &RUN_COLS, "id", LOCK).into(), vec![Box::new(run.as_str().to_owned())]),
        (by_id("attempts", &ATTEMPT_COLS, "id", LOCK).into(), a()),
        (by_id("leases", &LEASE_COLS, "attempt_id", LOCK).into(), a()),
    ];
    if let Some(o) = &keys.offer {
        out.push((by_id("offers", &OFFER_COLS, "id", LOCK).into(), vec![Box::new(o.as_str().to_owned())]));
    }
    if keys.completion_event {
        out.push((
            COMPLETION_EVENT_SQL.as_str().into(),
            vec![Box::new(attempt.as_str().to_owned()), Box::new(COMPLETION_EVENT)],
        ));
    }
    out.push(stamp(offset, admit));
    out
}

/// Reads the answers to [`fenced_load`]'s statements, in order, from `answers`.
pub(super) fn read_fenced(
    keys: &Keys,
    admit: Option<Admit<'_>>,
    answers: &mut impl Iterator<Item = Vec<Row>>,
) -> Result<(Rows, Millis, Option<ErrorCode>), Error> {
    let mut next = || answers.next().unwrap_or_default();
    let first = |rows: Vec<Row>| rows.into_iter().next();
    next(); // the fence
    let mut out = Rows {
        session: first(next()).as_ref().map(rows::read).transpose()?,
        run: first(next()).as_ref().map(rows::read).transpose()?,
        attempt: first(next()).as_ref().map(rows::read).transpose()?,
        lease: first(next()).as_ref().map(rows::read).transpose()?,
        ..Rows::default()
    };
    if out.attempt.is_none() {
        out.lease = None; // as the sequential load: no attempt, no lease
    }
    if keys.offer.is_some() {
        out.offer = first(next()).as_ref().map(rows::read).transpose()?;
    }
    if keys.completion_event {
        out.completion_event = first(next()).as_ref().map(rows::read).transpose()?;
    }
    let (now, refused) = read_stamp(next(), admit)?;
    Ok((out, now, refused))
}

/// The statement that reads DB time, with the admission given one; it comes after every
/// lock of the load.
fn stamp(offset: i64, admit: Option<Admit<'_>>) -> Statement {
    match admit {
        None => (schema::DB_NOW.into(), vec![Box::new(offset)]),
        Some(a) => (
            STAMP_ADMIT.into(),
            vec![Box::new(offset), Box::new(a.principal.as_str().to_owned()), Box::new(a.serial.to_owned())],
        ),
    }
}

/// DB time and the admission's refusal from the answer to [`stamp`].
pub(super) fn read_stamp(rows: Vec<Row>, admit: Option<Admit<'_>>) -> Result<(Millis, Option<ErrorCode>), Error> {
    let stamp = rows.into_iter().next().ok_or_else(|| Error::Corrupt("DB time read no row".to_owned()))?;
    match admit {
        None => Ok((stamp.get(0), None)),
        Some(a) => a.read(&stamp),
    }
}

/// Whether `keys` are a poll's (a session, its worker, placement; nothing else): its
/// load is two pipelines ([`poll`]).
pub(super) fn is_poll(keys: &Keys) -> bool {
    let poll = Keys { session: keys.session.clone(), worker: keys.worker.clone(), placement: true, ..Keys::default() };
    keys.session.is_some() && keys.worker.is_some() && *keys == poll
}

/// A poll's load in two round trips, in the order [`load_in_order`] takes it: `BEGIN`,
/// the session (locked), the worker, the session's active attempts and open offers in
/// one pipeline ([`poll_first`]); then what needs the session's labels and room — the
/// queue probe, which locks the runs it takes ([`poll_probe`]) — and DB time last, in
/// another.
async fn poll(
    tx: &mut Tx<'_>,
    keys: &Keys,
    offset: i64,
    admit: Option<Admit<'_>>,
    begin: bool,
) -> Result<(Rows, Millis, Option<ErrorCode>), Error> {
    let mut answers = tx.begun(begin, poll_first(keys)).await?;
    let mut out = read_poll_first(&mut answers)?;
    let probe = poll_probe(&out, 0)?;
    let (mut batch, at) = match probe.queue {
        Some(queue) => {
            let (statements, at) = queue.statements(probe.limit);
            (statements, Some(at))
        }
        None => (Vec::new(), None),
    };
    batch.push(stamp(offset, admit));
    let mut answers = tx.run(&batch).await?;
    let (now, refused) = read_stamp(answers.pop().unwrap_or_default(), admit)?;
    if let Some(at) = at {
        let runs = answers.into_iter().nth(at).unwrap_or_default();
        out.queued = runs.iter().map(rows::read).collect::<Result<_, _>>()?;
    }
    Ok((out, now, refused))
}

/// A poll's first round trip: its session (locked), the worker its request names, the
/// session's active attempts and its open offers.
pub(super) fn poll_first(keys: &Keys) -> [Statement; 4] {
    let (Some(session), Some(worker)) = (&keys.session, &keys.worker) else {
        unreachable!("a poll names its session and worker");
    };
    let s = || -> rows::Params { vec![Box::new(session.as_str().to_owned())] };
    [
        (by_id("sessions", &SESSION_COLS, "id", "FOR UPDATE").into(), s()),
        (by_id("workers", &WORKER_COLS, "id", "").into(), vec![Box::new(worker.as_str().to_owned())]),
        (ACTIVE_ATTEMPTS.into(), s()),
        (OPEN_OFFERS.as_str().into(), s()),
    ]
}

/// The rows of [`poll_first`]'s four answers (no session: nothing else).
pub(super) fn read_poll_first(answers: &mut impl Iterator<Item = Vec<Row>>) -> Result<Rows, Error> {
    let mut next = || answers.next().unwrap_or_default();
    let first = |rows: Vec<Row>| rows.into_iter().next();
    let mut out = Rows {
        session: first(next()).as_ref().map(rows::read).transpose()?,
        worker: first(next()).as_ref().map(rows::read).transpose()?,
        ..Rows::default()
    };
    let (active, open) = (next(), next());
    if out.session.is_some() {
        let n: i64 = first(active).map_or(0, |r| r.get(0));
        out.active_attempts = u32::try_from(n).unwrap_or(u32::MAX);
        out.open_offers = open.iter().map(rows::read).collect::<Result<_, _>>()?;
    }
    Ok(out)
}

/// A poll's queue probe ([`Queue`]; none: no session, or no room), the session's room,
/// and how many runs the probe takes at most.
pub(super) struct Probe {
    pub(super) queue: Option<Queue>,
    pub(super) room: usize,
    /// The room and `extra` more.
    pub(super) limit: usize,
}

/// The queue probe of a poll whose first round trip read `loaded`, taking up to `extra`
/// runs more than its room (a wave of polls: [`super::polls`]).
pub(super) fn poll_probe(loaded: &Rows, extra: usize) -> Result<Probe, Error> {
    let none = Probe { queue: None, room: 0, limit: 0 };
    // No session, no placement.
    let Some(session) = &loaded.session else { return Ok(none) };
    // The session's own worker, whatever the keys named.
    let trusted = loaded.worker.clone().filter(|w| w.id == session.worker);
    let room = placement_room(session, loaded.active_attempts).min(PLACEMENT_BATCH);
    if room == 0 {
        return Ok(none);
    }
    let limit = room.saturating_add(extra).min(PLACEMENT_BATCH);
    Ok(Probe { queue: Some(Queue::of(session, trusted.as_ref())?), room, limit })
}

/// The pipelined load of a fenced command (see the module doc).
async fn pipelined(
    tx: &mut Tx<'_>,
    keys: &Keys,
    offset: i64,
    admit: Option<Admit<'_>>,
    begin: bool,
) -> Result<(Rows, Millis, Option<ErrorCode>), Error> {
    let mut answers = tx.begun(begin, fenced_load(keys, offset, admit)).await?;
    read_fenced(keys, admit, &mut answers)
}

/// The schedules due by DB time, each locked without waiting (a replica firing one right
/// now has it; this sweep takes the others), with its last run and its latest fire time.
async fn due_schedules(tx: &mut Tx<'_>, offset: i64) -> Result<Vec<crate::core::DueSchedule>, Error> {
    let now: Millis = tx.now(offset).await?;
    let sql = format!(
        "SELECT {} FROM schedules WHERE paused = 0 AND due_at <= $1 ORDER BY due_at, name LIMIT $2 FOR UPDATE SKIP LOCKED",
        *SCHEDULE_COLS
    );
    let due: Vec<crate::model::Schedule> =
        tx.all(&sql, &[&now, &SWEEP_BATCH]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(due.len());
    for s in due {
        let last = match &s.last_run {
            Some(id) => one_by(tx, "runs", &RUN_COLS, "id", id.as_str(), "", rows::read).await?,
            None => None,
        };
        let fired = tx.one("SELECT max(fire_at) FROM fires WHERE schedule = $1", &[&s.name]).await?;
        let fired: Option<Millis> = fired.map(|r| r.try_get(0)).transpose().map_err(Error::Pg)?.flatten();
        out.push((s, last, fired));
    }
    Ok(out)
}

/// At most `batch` deliveries due by DB time whose runs ended, each with its run, each
/// locked without waiting (another replica claiming one right now keeps it).
async fn due_deliveries(
    tx: &mut Tx<'_>,
    offset: i64,
    batch: usize,
) -> Result<Vec<(crate::model::Delivery, crate::model::Run)>, Error> {
    let now: Millis = tx.now(offset).await?;
    let sql = format!(
        "SELECT {} FROM deliveries WHERE state IN ('waiting', 'pending') AND next_at <= $1 \
         AND run_id IN (SELECT id FROM runs WHERE status IN ('succeeded', 'failed', 'cancelled', 'timed_out')) \
         ORDER BY next_at, run_id LIMIT $2 FOR UPDATE SKIP LOCKED",
        crate::store::records::DELIVERY_COLS
    );
    let batch = i64::try_from(batch).unwrap_or(i64::MAX);
    let due: Vec<crate::model::Delivery> =
        tx.all(&sql, &[&now, &batch]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(due.len());
    for d in due {
        if let Some(run) = one_by(tx, "runs", &RUN_COLS, "id", d.run.as_str(), "", rows::read).await? {
            out.push((d, run));
        }
    }
    Ok(out)
}

/// Loads what `keys` names, one statement at a time, in the protocol's lock order.
async fn load_in_order(tx: &mut Tx<'_>, keys: &Keys, offset: i64, timings: &Timings) -> Result<Rows, Error> {
    let mut out = Rows::default();
    if keys.due_schedules {
        out.due_schedules = due_schedules(tx, offset).await?;
        return Ok(out);
    }
    if let Some(batch) = keys.due_deliveries {
        out.due_deliveries = due_deliveries(tx, offset, batch).await?;
        return Ok(out);
    }
    if let Some(run) = &keys.delivery {
        let cols = crate::store::records::DELIVERY_COLS;
        out.delivery = one_by(tx, "deliveries", cols, "run_id", run.as_str(), "FOR UPDATE", rows::read).await?;
    }
    if keys.sweep {
        // The one lock a sweep waits for, taken first and by sweeps only: two replicas
        // starting after an outage give its grace once (see `core::grace`).
        let alive = tx.one("SELECT alive_at FROM authority WHERE id = 1 FOR UPDATE", &[]).await?;
        out.alive_at = alive.map(|r| r.get(0));
        let now = tx.now(offset).await?;
        match crate::core::absence(out.alive_at, now, timings) {
            Some(absent_ms) => out.grace = Some(grace(tx, absent_ms).await?),
            None => out.lapsed = lapsed(tx, offset).await?,
        }
        return Ok(out);
    }
    if let Some(a) = &keys.attempt {
        fence(tx, a).await?;
    }
    if let Some(w) = &keys.worker_work {
        fence_worker_work(tx, w).await?;
    }
    if let Some(w) = &keys.worker_sessions {
        out.worker_sessions = worker_sessions(tx, w).await?;
    }
    if let Some(s) = &keys.session {
        out.session = session(tx, s, "FOR UPDATE").await?;
    }
    if let Some(w) = &keys.worker {
        // Labelling locks the record; placement only reads it.
        let lock = if keys.placement { "" } else { "FOR UPDATE" };
        out.worker = one_by(tx, "workers", &WORKER_COLS, "id", w.as_str(), lock, rows::read).await?;
    }
    if let Some(w) = &keys.worker_certificates {
        let sql = format!(
            "SELECT {CERTIFICATE_COLS} FROM certificates WHERE worker = $1 ORDER BY issued_at, serial FOR UPDATE"
        );
        out.certificates = tx.all(&sql, &[&w.as_str()]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;
        let sql = format!("SELECT {ENROLMENT_COLS} FROM enrolments WHERE worker = $1 AND used_at IS NULL FOR UPDATE");
        out.enrolments = tx.all(&sql, &[&w.as_str()]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;
    }
    if let Some(serial) = &keys.certificate {
        out.certificate =
            one_by(tx, "certificates", CERTIFICATE_COLS, "serial", serial, "FOR UPDATE", rows::read).await?;
    }
    if let Some(serial) = &keys.presented {
        out.presented = one_by(tx, "certificates", CERTIFICATE_COLS, "serial", serial, "", rows::read).await?;
    }
    if let Some(w) = &keys.last_renewal {
        let row = tx.one(LAST_RENEWAL, &[&w.as_str()]).await?;
        out.last_renewal = row.and_then(|r| r.get::<_, Option<i64>>(0));
    }
    if let Some(digest) = &keys.enrolment {
        out.enrolment =
            one_by(tx, "enrolments", ENROLMENT_COLS, "token_digest", digest.as_str(), "FOR UPDATE", rows::read).await?;
    }
    if let Some(w) = &keys.worker_work {
        out.worker_work = worker_work(tx, w).await?;
    }
    if let Some(name) = &keys.schedule {
        out.schedule = one_by(tx, "schedules", &SCHEDULE_COLS, "name", name, "FOR UPDATE", rows::read).await?;
    }
    if let Some(name) = &keys.operator {
        let cols = crate::store::records::OPERATOR_COLS;
        out.operator = one_by(tx, "operators", cols, "name", name, "FOR UPDATE", rows::read).await?;
    }
    match (&keys.attempt, &keys.run) {
        (Some(a), run) => run_attempt_lease(tx, run.as_ref(), a, &mut out).await?,
        (None, Some(r)) if keys.current_attempt => current_attempt(tx, r, &mut out).await?,
        (None, Some(r)) => out.run = one_by(tx, "runs", &RUN_COLS, "id", r.as_str(), "FOR UPDATE", rows::read).await?,
        (None, None) => {}
    }
    if let Some(o) = &keys.offer {
        out.offer = one_by(tx, "offers", &OFFER_COLS, "id", o.as_str(), "FOR UPDATE", rows::read).await?;
    }
    if keys.placement {
        // Placement is a poll's, and a poll's load is [`poll`]: keys that ask for it with
        // anything else have no load.
        return Err(Error::Corrupt("placement is loaded only for a poll".to_owned()));
    }
    if keys.completion_event {
        if let Some(a) = &keys.attempt {
            out.completion_event = tx
                .one(&COMPLETION_EVENT_SQL, &[&a.as_str(), &COMPLETION_EVENT])
                .await?
                .as_ref()
                .map(rows::read)
                .transpose()?;
        }
    }
    Ok(out)
}

/// Every live row an outage's grace extends, each locked without waiting as the lapsed
/// ones are (a row busy in a command right now is being renewed anyway). Once per outage,
/// so not batched.
async fn grace(tx: &mut Tx<'_>, absent_ms: Millis) -> Result<Grace, Error> {
    const SKIP: &str = "FOR UPDATE SKIP LOCKED";
    let sql =
        format!("SELECT {} FROM sessions WHERE state IN ('online', 'draining') ORDER BY id {SKIP}", *SESSION_COLS);
    let sessions = tx.all(&sql, &[]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;
    let leased = tx.all("SELECT attempt_id FROM leases WHERE state = 'leased' ORDER BY attempt_id", &[]).await?;
    let mut leases = Vec::with_capacity(leased.len());
    for row in leased {
        let a: String = row.get(0);
        if !try_fence(tx, &a).await? {
            continue;
        }
        let attempt = one_by(tx, "attempts", &ATTEMPT_COLS, "id", &a, SKIP, rows::read).await?;
        let lease = one_by(tx, "leases", &LEASE_COLS, "attempt_id", &a, SKIP, rows::read).await?;
        if let (Some(lease), Some(attempt)) = (lease, attempt) {
            leases.push((lease, attempt));
        }
    }
    let sql = format!("SELECT {} FROM offers WHERE state = 'open' ORDER BY id {SKIP}", *OFFER_COLS);
    let offers = tx.all(&sql, &[]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;
    Ok(Grace { absent_ms, sessions, leases, offers })
}

/// What has lapsed by DB time, each item locked without waiting (see the module doc).
async fn lapsed(tx: &mut Tx<'_>, offset: i64) -> Result<Lapsed, Error> {
    const SKIP: &str = "FOR UPDATE SKIP LOCKED";
    let now: Millis = tx.now(offset).await?;
    let mut out = Lapsed::default();

    let sql = format!(
        "SELECT {} FROM sessions WHERE state IN ('online', 'draining') AND expires_at <= $1 \
         ORDER BY expires_at, id LIMIT $2 {SKIP}",
        *SESSION_COLS
    );
    out.sessions = tx.all(&sql, &[&now, &SWEEP_BATCH]).await?.iter().map(rows::read).collect::<Result<_, _>>()?;

    // Leases, then offers, then overdue runs: candidates without locks, then each one's
    // fence, run, attempt and row, every lock non-blocking.
    let candidates = tx
        .all(
            "SELECT attempt_id, run_id FROM leases WHERE state = 'leased' AND expires_at <= $1 \
             ORDER BY expires_at, attempt_id LIMIT $2",
            &[&now, &SWEEP_BATCH],
        )
        .await?;
    for c in candidates {
        let (a, r): (String, String) = (c.get(0), c.get(1));
        if !try_fence(tx, &a).await? {
            continue;
        }
        let run = one_by(tx, "runs", &RUN_COLS, "id", &r, SKIP, rows::read).await?;
        let attempt = one_by(tx, "attempts", &ATTEMPT_COLS, "id", &a, SKIP, rows::read).await?;
        let lease = one_by(tx, "leases", &LEASE_COLS, "attempt_id", &a, SKIP, rows::read).await?;
        if let (Some(lease), Some(run), Some(attempt)) = (lease, run, attempt) {
            out.leases.push((lease, run, attempt));
        }
    }

    let candidates = tx
        .all(
            "SELECT id, run_id, attempt_id FROM offers WHERE state = 'open' AND expires_at <= $1 \
             ORDER BY expires_at, id LIMIT $2",
            &[&now, &SWEEP_BATCH],
        )
        .await?;
    for c in candidates {
        let (o, r, a): (String, String, String) = (c.get(0), c.get(1), c.get(2));
        if !try_fence(tx, &a).await? {
            continue;
        }
        let run = one_by(tx, "runs", &RUN_COLS, "id", &r, SKIP, rows::read).await?;
        let attempt = one_by(tx, "attempts", &ATTEMPT_COLS, "id", &a, SKIP, rows::read).await?;
        let offer = one_by(tx, "offers", &OFFER_COLS, "id", &o, SKIP, rows::read).await?;
        if let (Some(offer), Some(run), Some(attempt)) = (offer, run, attempt) {
            out.offers.push((offer, run, attempt));
        }
    }

    let candidates = tx
        .all(
            "SELECT id, current_attempt_id FROM runs WHERE deadline_at IS NOT NULL AND deadline_at <= $1 \
             AND status IN ('queued', 'dispatching', 'running') AND (stop IS NULL OR stop <> 'timeout') \
             ORDER BY deadline_at, id LIMIT $2",
            &[&now, &SWEEP_BATCH],
        )
        .await?;
    for c in candidates {
        let (r, a): (String, Option<String>) = (c.get(0), c.get(1));
        if let Some(a) = &a {
            if !try_fence(tx, a).await? {
                continue;
            }
        }
        if let Some(run) = one_by(tx, "runs", &RUN_COLS, "id", &r, SKIP, rows::read).await? {
            out.overdue.push(run);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Command;

    #[test]
    fn a_poll_takes_the_two_round_trip_load_and_nothing_else_does() {
        let (worker, session) = ("router-1".parse().unwrap(), "ses_1".parse().unwrap());
        let body = ql_wire::offer::PollOffers { generation: ql_wire::ids::Counter::ONE, wait_ms: 0, max: 1 };
        let keys = Command::PollOffers(worker, session, body).keys();
        assert!(is_poll(&keys), "a poll's keys: {keys:?}");
        assert!(!is_fenced(&keys));
        // One key more or less, and it is not a poll (placement with other keys has no load).
        assert!(!is_poll(&Keys { placement: false, ..keys.clone() }));
        assert!(!is_poll(&Keys { worker: None, ..keys.clone() }));
        assert!(!is_poll(&Keys { run: Some("run_1".parse().unwrap()), ..keys }));
    }
}
