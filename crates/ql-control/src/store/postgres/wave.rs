//! A wave: the fenced commands of one group about rows none of the others names, loaded
//! and recorded set-based (see the [module doc](super) for groups).
//!
//! PostgreSQL's cost of a statement follows the relations and indexes it opens, much
//! more than the rows it touches: eight renewals' locked loads as one statement per
//! table, and their audit records and lease writes as one statement each, cost it about
//! a third less than the same rows a statement each (bench/RESULTS.md). So a wave
//! sends one statement per level of the lock order for all its commands, each level's
//! rows locked in key order (the order of [`load`]'s module doc still
//! holds, level by level), and one for DB time with every admission; then reads each
//! command's rows out by key and lets each decide alone, as it would alone
//! ([`load::read_fenced`]). Then the writes: every audit record first and every event
//! last, each as multi-row `INSERT`s; of the rest, commands whose records are the same
//! statements one for one (renewals) send each of them for several at once, as a
//! multi-row `INSERT` or an `UPDATE ... FROM (VALUES ...)` that must find every row
//! (each by a probe of its key, written by its tuple id: [`Update::merged`]),
//! in chunks of a power of two so each connection prepares few texts ([`merged`]).
//! Commands of a wave share no row, so the order between them does not matter, and
//! each command's own writes keep their order.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::LazyLock;

use tokio_postgres::types::Type;
use tokio_postgres::Row;

use super::found;
use super::load::{self, COMPLETION_EVENTS_OF};
use super::rows::{self, ATTEMPT_COLS, LEASE_COLS, OFFER_COLS, RUN_COLS, SESSION_COLS};
use super::{admit_of, counted, Admit, Done, Error, PgStore, Statement, Tx, AUDIT_SQL};
use crate::core::{self, COMPLETION_EVENT};
use crate::model::Millis;
use crate::store::records::EVENTS;
use crate::store::Audit;

use super::group::Job;

/// Every fence of a wave, in the order of `$1` (sorted: see [`loads`]); and from there to
/// the end of the transaction, every statement on its generic plan. Left to choose,
/// PostgreSQL planned each level's lock and the DB time afresh in every wave: on a
/// generic plan it guesses ten keys in an array it cannot see, so a plan for the few a
/// wave sends (four at 8 agents) always looked cheaper. That planning cost more than the
/// statement (0.04–0.07 ms each, five a wave, against 0.02–0.04 to run), and the
/// generic plan is the same probes ([`locked`]). The groups' other statements are all
/// by key (see [`load`]'s `GENERIC_PLANS`, which selects the same expression).
#[doc(hidden)]
pub const WAVE_FENCES: &str = concat!(
    "SELECT pg_advisory_xact_lock(hashtextextended('attempt:' || a, 0)), ",
    load::generic_plans!(),
    " FROM unnest($1::text[]) AS a"
);

/// DB time once for the wave, after every lock, with each command's admission (a row per
/// command, in order; NULLs for a command with none to decide). Each lookup is its own
/// subquery, so each is an index probe whatever the planner guesses of the array.
const STAMPS: &str = "SELECT (floor(extract(epoch FROM statement_timestamp()) * 1000))::bigint + $1::bigint, \
     w.disabled_at, w.revoked_at, c.worker, c.issued_at, c.not_after, c.revoked_at \
     FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS p (principal, serial, n) \
     LEFT JOIN LATERAL (SELECT disabled_at, revoked_at FROM workers WHERE id = p.principal OFFSET 0) w ON true \
     LEFT JOIN LATERAL (SELECT worker, issued_at, not_after, revoked_at FROM certificates \
     WHERE serial = p.serial OFFSET 0) c ON true ORDER BY p.n";

/// `table`'s rows whose `key` is in `$1`, locked in the order of `$1`. A locking
/// subquery is never merged into the query around it, so each key is one probe of the
/// key's index: `key = ANY($1)` on a generic plan guesses ten rows and scans a small
/// table whole (measured: 145 µs for four runs instead of 9 µs each).
pub(super) fn locked(table: &str, cols: &str, key: &str) -> String {
    format!("SELECT t.* FROM unnest($1::text[]) AS k (key) CROSS JOIN LATERAL (SELECT {cols} FROM {table} WHERE {key} = k.key FOR UPDATE) t")
}

/// How a wave locks its runs (a test reads its plan).
#[doc(hidden)]
pub static WAVE_RUNS: LazyLock<String> = LazyLock::new(|| LEVELS[1].0.clone());

/// The tables a fenced command locks, in lock order, each with its key column.
static LEVELS: LazyLock<[(String, &str); 4]> = LazyLock::new(|| {
    [
        (locked("sessions", &SESSION_COLS, "id"), "id"),
        (locked("runs", &RUN_COLS, "id"), "id"),
        (locked("attempts", &ATTEMPT_COLS, "id"), "id"),
        (locked("leases", &LEASE_COLS, "attempt_id"), "attempt_id"),
    ]
});

/// How a wave locks the offers its commands name.
static OFFERS: LazyLock<String> = LazyLock::new(|| locked("offers", &OFFER_COLS, "id"));

/// Keys as one text array, sorted: every level of a wave is locked in key order, so two
/// waves lock each level's rows in one order.
pub(super) fn texts(ids: impl Iterator<Item = String>) -> rows::Params {
    let mut ids: Vec<String> = ids.collect();
    ids.sort_unstable();
    vec![Box::new(ids)]
}

/// The load of a wave of fenced commands (`BEGIN` not included): every fence, each
/// level's rows, the offers named, the completion events named (one statement for all),
/// and DB time with every admission last. [`split`] reads the answers.
fn loads(keys: &[core::Keys], offset: i64, admits: &[Option<Admit<'_>>]) -> Vec<Statement> {
    let named = |k: &core::Keys| {
        let (Some(a), Some(s), Some(r)) = (&k.attempt, &k.session, &k.run) else {
            unreachable!("a fenced command names its attempt, session and run");
        };
        (a.as_str().to_owned(), s.as_str().to_owned(), r.as_str().to_owned())
    };
    let ids: Vec<_> = keys.iter().map(named).collect();
    let [sessions, runs, attempts, leases] = &*LEVELS;
    let mut out: Vec<Statement> = vec![
        (WAVE_FENCES.into(), texts(ids.iter().map(|i| i.0.clone()))),
        (sessions.0.as_str().into(), texts(ids.iter().map(|i| i.1.clone()))),
        (runs.0.as_str().into(), texts(ids.iter().map(|i| i.2.clone()))),
        (attempts.0.as_str().into(), texts(ids.iter().map(|i| i.0.clone()))),
        (leases.0.as_str().into(), texts(ids.iter().map(|i| i.0.clone()))),
    ];
    if keys.iter().any(|k| k.offer.is_some()) {
        let offers = keys.iter().filter_map(|k| k.offer.as_ref().map(|o| o.as_str().to_owned()));
        out.push((OFFERS.as_str().into(), texts(offers)));
    }
    let events: Vec<String> =
        keys.iter().zip(&ids).filter(|(k, _)| k.completion_event).map(|(_, id)| id.0.clone()).collect();
    if !events.is_empty() {
        out.push((COMPLETION_EVENTS_OF.as_str().into(), vec![Box::new(events), Box::new(COMPLETION_EVENT)]));
    }
    out.push(stamps(offset, admits));
    out
}

/// DB time once for several commands, after all their locks, with each one's admission
/// ([`STAMPS`]: a row per command, in the order of `admits`).
pub(super) fn stamps(offset: i64, admits: &[Option<Admit<'_>>]) -> Statement {
    let principals: Vec<Option<String>> = admits.iter().map(|a| a.map(|a| a.principal.as_str().to_owned())).collect();
    let serials: Vec<Option<String>> = admits.iter().map(|a| a.map(|a| a.serial.to_owned())).collect();
    (STAMPS.into(), vec![Box::new(offset), Box::new(principals), Box::new(serials)])
}

/// Each command's answers to [`loads`], in the shape of its own
/// [`fenced_load`](load::fenced_load)'s (for [`load::read_fenced`]): its row of each
/// level found by key, and its row of DB time.
fn split(keys: &[core::Keys], answers: impl Iterator<Item = Vec<Row>>) -> Result<Vec<Vec<Vec<Row>>>, Error> {
    let mut answers = answers;
    let mut next = || answers.next().unwrap_or_default();
    next(); // the fences
    let by_key = |rows: Vec<Row>, key: &str| -> Result<HashMap<String, Row>, Error> {
        rows.into_iter().map(|r| Ok((r.try_get::<_, String>(key).map_err(Error::Pg)?, r))).collect()
    };
    let mut found: Vec<HashMap<String, Row>> = Vec::with_capacity(4);
    for (_, key) in LEVELS.iter() {
        found.push(by_key(next(), key)?);
    }
    let mut offers = if keys.iter().any(|k| k.offer.is_some()) { by_key(next(), "id")? } else { HashMap::new() };
    let mut events: HashMap<String, Vec<Row>> = HashMap::new();
    if keys.iter().any(|k| k.completion_event) {
        for row in next() {
            let attempt: Option<String> = row.try_get("attempt_id").map_err(Error::Pg)?;
            events.entry(attempt.unwrap_or_default()).or_default().push(row);
        }
    }
    let stamps = next();
    if stamps.len() != keys.len() {
        return Err(Error::Corrupt(format!("DB time read {} rows for {} commands", stamps.len(), keys.len())));
    }
    let mut take = |level: usize, id: Option<&str>| -> Vec<Row> {
        id.and_then(|id| found[level].remove(id)).into_iter().collect()
    };
    let mut out = Vec::with_capacity(keys.len());
    for (k, stamp) in keys.iter().zip(stamps) {
        let attempt = k.attempt.as_ref().map(|a| a.as_str());
        let mut answers = vec![
            Vec::new(),
            take(0, k.session.as_ref().map(|s| s.as_str())),
            take(1, k.run.as_ref().map(|r| r.as_str())),
            take(2, attempt),
            take(3, attempt),
        ];
        if let Some(o) = &k.offer {
            answers.push(offers.remove(o.as_str()).into_iter().collect());
        }
        if k.completion_event {
            answers.push(attempt.and_then(|a| events.remove(a)).unwrap_or_default());
        }
        answers.push(vec![stamp]);
        out.push(answers);
    }
    Ok(out)
}

impl PgStore {
    /// Several fenced commands of a group whose rows are all different ([`pick`]):
    /// the wave's load in one pipeline, set-based, then every command's writes in
    /// another, merged where commands write alike ([`writes`]; a merged UPDATE is
    /// prepared first, a round trip the first time on a connection). In one transaction,
    /// with rows no other command of the wave touches, each decides what it would
    /// decide alone.
    pub(super) async fn wave(
        &self,
        conn: &mut super::pool::Conn,
        jobs: &[&Job],
        open: &mut bool,
        commit: bool,
    ) -> Result<(Vec<Done>, u64), Error> {
        let offset = self.offset();
        let keys: Vec<core::Keys> = jobs.iter().map(|j| j.cmd.keys()).collect();
        let admits: Vec<Option<Admit<'_>>> = jobs.iter().map(|j| admit_of(j.audit.as_ref())).collect();
        let begin = !std::mem::replace(open, true);
        let mut tx = Tx { conn };
        let statements = loads(&keys, offset, &admits);
        // What the commands' own loads would have sent ([`load::fenced_load`]).
        let alone: usize =
            keys.iter().map(|k| 6 + usize::from(k.offer.is_some()) + usize::from(k.completion_event)).sum();
        let mut saved = alone - statements.len();
        let answers = tx.begun(begin, statements).await?;
        let (mut records, mut done) = (Vec::with_capacity(jobs.len()), Vec::with_capacity(jobs.len()));
        for (((job, k), admit), answers) in jobs.iter().zip(&keys).zip(&admits).zip(split(&keys, answers)?) {
            let loaded: (core::Rows, Millis, _) = load::read_fenced(k, *admit, &mut answers.into_iter())?;
            let concluded = self.conclude(&job.cmd, job.audit.as_ref().map(|a| &a.record), loaded, offset)?;
            records.push(Recorded { statements: concluded.record, checks: concluded.checks });
            done.push(concluded.done);
        }
        saved += record(&mut tx, records, commit).await?;
        Ok((done, saved as u64))
    }
}

/// Sends the statements that record a wave's decisions ([`writes`]), each update
/// counting its own rows ([`found`]), and with `commit` the COMMIT in the same
/// pipeline; returns how many statements merging saved.
///
/// With the COMMIT sent, a statement or the COMMIT PostgreSQL refused with an ERROR left
/// nothing committed: the transaction aborted, and a COMMIT behind the failed statement
/// rolled back. Any other failure (the connection lost, the backend ended with a FATAL)
/// may have come after the COMMIT ran: [`Error::Unsure`].
pub(super) async fn record(tx: &mut Tx<'_>, records: Vec<Recorded>, commit: bool) -> Result<usize, Error> {
    let (record, rows, saved) = writes(tx, records).await?;
    let (mut record, rows) = found::checked(record, rows);
    if commit {
        record.push(("COMMIT".into(), Vec::new()));
    }
    if !record.is_empty() {
        let answers = match tx.run(&record).await {
            Err(Error::Pg(e)) if commit && !refused(&e) => return Err(Error::Unsure(e.to_string())),
            answers => answers?,
        };
        match counted(rows, &answers) {
            // The COMMIT ran: answer as unsure, never run the commands again.
            Err(e) if commit => return Err(Error::Unsure(e.to_string())),
            checked => checked?,
        }
    }
    Ok(saved)
}

/// Whether PostgreSQL refused a statement with an ERROR, which aborts the transaction
/// and nothing more (a FATAL ends the backend, whatever it had done).
fn refused(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().and_then(|db| db.parsed_severity()) == Some(tokio_postgres::error::Severity::Error)
}

/// One command's statements, and for each whether it is an UPDATE that must find its row.
pub(super) struct Recorded {
    pub(super) statements: Vec<Statement>,
    pub(super) checks: Vec<bool>,
}

/// The statements that record a wave's decisions, and for each how many rows it must
/// return (an UPDATE of loaded rows: one per row; 0, not checked), and how many
/// statements merging saved. Every command's audit records go first, as one multi-row
/// `INSERT`, and its events last, as another: both tables are only appended to, each
/// command's own rows keep their order (a run's events their `seq` order), and the
/// events' foreign keys are checked at COMMIT. Of the rest, commands whose statements
/// are the same, one for one, form a kind; each statement of a kind of several is sent
/// once for all of them where it can be merged ([`merged_insert`], [`Update::merged`]),
/// and otherwise once per command, in command order.
async fn writes(tx: &mut Tx<'_>, records: Vec<Recorded>) -> Result<(Vec<Statement>, Vec<usize>, usize), Error> {
    let events_sql = rows::upsert(&EVENTS);
    let (mut audits, mut events, mut kinds): (Vec<Statement>, Vec<Statement>, Vec<Vec<Recorded>>) =
        (Vec::new(), Vec::new(), Vec::new());
    for r in records {
        let mut rest = Recorded { statements: Vec::new(), checks: Vec::new() };
        for (statement, check) in r.statements.into_iter().zip(r.checks) {
            match statement.0.as_ref() {
                sql if sql == AUDIT_SQL => audits.push(statement),
                sql if sql == events_sql => events.push(statement),
                _ => {
                    rest.statements.push(statement);
                    rest.checks.push(check);
                }
            }
        }
        match kinds.iter_mut().find(|k| same_statements(&k[0], &rest)) {
            Some(kind) => kind.push(rest),
            None => kinds.push(vec![rest]),
        }
    }
    let (mut out, mut rows, mut saved) = (Vec::new(), Vec::new(), 0);
    saved += appended(audits, &mut out, &mut rows);
    for kind in kinds {
        let n = kind.len();
        let width = kind[0].statements.len();
        let checks = kind[0].checks.clone();
        let mut columns: Vec<Vec<Statement>> = (0..width).map(|_| Vec::with_capacity(n)).collect();
        for r in kind {
            for (j, s) in r.statements.into_iter().enumerate() {
                columns[j].push(s);
            }
        }
        for (column, check) in columns.into_iter().zip(checks) {
            let sql = column[0].0.clone();
            let width = column[0].1.len();
            let update = match Update::parse(&sql) {
                Some(update) if n > 1 => Some((update, tx.conn.prepare(&sql).await?.params().to_vec())),
                _ => None,
            };
            let merge = |k: usize| match &update {
                Some((update, types)) => update.merged(types, k),
                None => merged_insert(&sql, width, k),
            };
            saved += merged(column, usize::from(check), merge, &mut out, &mut rows);
        }
    }
    saved += appended(events, &mut out, &mut rows);
    Ok((out, rows, saved))
}

/// Most parameters one statement may carry (the protocol counts them in 16 bits).
const MAX_PARAMS: usize = 32_767;

/// Rows of one append-only table as multi-row `INSERT`s ([`merged`]).
fn appended(column: Vec<Statement>, out: &mut Vec<Statement>, rows: &mut Vec<usize>) -> usize {
    let Some((sql, width)) = column.first().map(|s| (s.0.clone(), s.1.len())) else { return 0 };
    merged(column, 0, |k| merged_insert(&sql, width, k), out, rows)
}

/// Sends `column`, statements of one SQL text (each returning `check` rows), in chunks
/// of a power of two, each chunk of several as the one statement `merge` makes for that
/// many (or as they are, when it makes none). Chunks of a few sizes keep the texts, and
/// so each connection's prepared statements, few: ten renewals are a chunk of eight and
/// one of two. A chunk stays under the protocol's 32,767 parameters a statement, however
/// large a group. Returns how many statements that saved.
fn merged(
    column: Vec<Statement>,
    check: usize,
    merge: impl Fn(usize) -> Option<String>,
    out: &mut Vec<Statement>,
    rows: &mut Vec<usize>,
) -> usize {
    let mut saved = 0;
    let width = column.first().map_or(1, |s| s.1.len().max(1));
    let most = 1 << (MAX_PARAMS / width).max(1).ilog2();
    let mut rest = column.into_iter().peekable();
    while rest.peek().is_some() {
        let k = (1 << rest.len().ilog2()).min(most);
        let chunk: Vec<Statement> = rest.by_ref().take(k).collect();
        match merge(k).filter(|_| k > 1) {
            Some(sql) => {
                out.push((Cow::Owned(sql), chunk.into_iter().flat_map(|s| s.1).collect()));
                rows.push(check * k);
                saved += k - 1;
            }
            None => {
                rows.extend(std::iter::repeat_n(check, k));
                out.extend(chunk);
            }
        }
    }
    saved
}

fn same_statements(a: &Recorded, b: &Recorded) -> bool {
    a.checks == b.checks
        && a.statements.len() == b.statements.len()
        && a.statements.iter().zip(&b.statements).all(|(x, y)| x.0 == y.0 && x.1.len() == y.1.len())
}

/// `sql` with every placeholder `$i` renumbered `$(i + by)`.
fn shifted(sql: &str, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..].bytes().take_while(u8::is_ascii_digit).count();
        match rest[at + 1..at + 1 + digits].parse::<usize>() {
            Ok(i) => out.push_str(&format!("${}", i + by)),
            Err(_) => out.push('$'),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// `INSERT INTO t (...) VALUES (row) [rest]` of `params` parameters as one statement
/// of `n` rows, the parameters of each row after the last's; `None` for any other
/// statement, or when its rest takes parameters.
fn merged_insert(sql: &str, params: usize, n: usize) -> Option<String> {
    if !sql.starts_with("INSERT INTO ") {
        return None;
    }
    let start = sql.find(" VALUES (")? + " VALUES ".len();
    let mut depth = 0usize;
    let mut end = None;
    for (i, c) in sql[start..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(start + i + 1);
                    break;
                }
            }
            '\'' | '"' => return None,
            _ => {}
        }
    }
    let end = end?;
    let (head, row, rest) = (&sql[..start], &sql[start..end], &sql[end..]);
    if rest.contains('$') {
        return None;
    }
    let rows: Vec<String> = (0..n).map(|i| shifted(row, i * params)).collect();
    Some(format!("{head}{}{rest}", rows.join(", ")))
}

/// `UPDATE t SET c = $2[::text::jsonb], ... WHERE key = $1 RETURNING 1`, the update
/// [`rows::update_changed`] writes.
#[derive(Debug, PartialEq)]
struct Update<'a> {
    table: &'a str,
    key: &'a str,
    /// Each column set, its placeholder's number and the cast after it.
    sets: Vec<(&'a str, usize, &'a str)>,
}

impl<'a> Update<'a> {
    fn parse(sql: &'a str) -> Option<Self> {
        let rest = sql.strip_prefix("UPDATE ")?;
        let (table, rest) = rest.split_once(" SET ")?;
        let (sets, rest) = rest.split_once(" WHERE ")?;
        let key = rest.strip_suffix(" = $1 RETURNING 1")?;
        let word = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !word(table) || !word(key) {
            return None;
        }
        let sets = sets
            .split(", ")
            .map(|set| {
                let (col, value) = set.split_once(" = $")?;
                let digits = value.bytes().take_while(u8::is_ascii_digit).count();
                let cast = &value[digits..];
                (word(col) && (cast.is_empty() || cast == "::text::jsonb")).then_some((
                    col,
                    value[..digits].parse().ok()?,
                    cast,
                ))
            })
            .collect::<Option<Vec<_>>>()?;
        // The placeholders are $2, $3, ... in order, after the key's $1.
        sets.iter().enumerate().all(|(i, s)| s.1 == i + 2).then_some(Self { table, key, sets })
    }

    /// The same update of `n` rows, each row's parameters after the last's, each cast
    /// to the type PostgreSQL gave it in the one-row statement (`types`). Each row is
    /// found by a probe of the key's index and written by its tuple id: joined on the
    /// key itself, a plan made while the table was small (a connection's prepared
    /// statement keeps its generic plan until the table is analysed again) read the
    /// table whole for every group, slower with every run the table gained.
    fn merged(&self, types: &[Type], n: usize) -> Option<String> {
        let width = self.sets.len() + 1;
        if types.len() != width {
            return None;
        }
        let row = |r: usize| {
            let values: Vec<String> =
                types.iter().enumerate().map(|(i, t)| format!("${}::{}", r * width + i + 1, t.name())).collect();
            format!("({})", values.join(", "))
        };
        let rows: Vec<String> = (0..n).map(row).collect();
        let names: Vec<String> = (1..=width).map(|i| format!("p{i}")).collect();
        let sets: Vec<String> = self.sets.iter().map(|(col, i, cast)| format!("{col} = v.p{i}{cast}")).collect();
        Some(format!(
            "UPDATE {t} SET {} FROM (SELECT v.*, f.tid FROM (VALUES {}) AS v ({}) CROSS JOIN LATERAL \
             (SELECT ctid AS tid FROM {t} WHERE {k} = v.p1 OFFSET 0) f) v WHERE {t}.ctid = v.tid RETURNING 1",
            sets.join(", "),
            rows.join(", "),
            names.join(", "),
            t = self.table,
            k = self.key,
        ))
    }
}

/// The update [`rows::update_changed`] writes for one row (`sql`, its parameters of
/// `types`) as the one statement a wave sends for `n` rows (a test reads its plan).
#[doc(hidden)]
pub fn merged_update(sql: &str, types: &[Type], n: usize) -> Option<String> {
    Update::parse(sql)?.merged(types, n)
}

/// Whether a command of a group may join a wave: a fenced command (its load is one
/// pipeline) that is not an unauthenticated request.
fn wavy(job: &Job, keys: &core::Keys) -> bool {
    !unauthenticated(job) && load::is_fenced(keys)
}

/// Whether a command of a group may join a wave of polls: a poll that is not an
/// unauthenticated request.
fn polling(job: &Job, keys: &core::Keys) -> bool {
    !unauthenticated(job) && load::is_poll(keys)
}

/// A request with no principal, refused before anything loads ([`PgStore::step`]).
fn unauthenticated(job: &Job) -> bool {
    matches!(&job.audit, Some(Audit { record, admit: Some(_) }) if record.principal.is_none())
}

/// The rows a command names, as `kind:id`: its session, attempt, run and offer.
fn named(keys: core::Keys) -> Vec<String> {
    [
        keys.session.map(|s| format!("s:{}", s.as_str())),
        keys.attempt.map(|a| format!("a:{}", a.as_str())),
        keys.run.map(|r| format!("r:{}", r.as_str())),
        keys.offer.map(|o| format!("o:{}", o.as_str())),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// What a group runs next ([`pick`]).
#[derive(Debug, PartialEq)]
pub(super) enum Pick {
    /// Fenced commands about rows no other names ([`PgStore::wave`]).
    Wave(Vec<usize>),
    /// Polls of sessions no other names ([`PgStore::polls`](super::polls)).
    Polls(Vec<usize>),
    /// One command alone.
    Alone(usize),
}

/// The next commands of a group to run (`pending`, indexes of `jobs` in arrival order):
/// a wave of every wavy command that names no row an earlier pending command names;
/// when that is fewer than two, the polls that name no such row; when those are fewer
/// than two as well, the first wavy command, or the first command, alone. Every command
/// of a group is in flight at once, so running a wave first is a serial order they could
/// have run in (a poll left for later may place a run a command of the wave put back in
/// the queue); a command about a row one left for later names waits its turn behind it.
pub(super) fn pick(jobs: &[Job], pending: &[usize]) -> Pick {
    let free = |joins: fn(&Job, &core::Keys) -> bool| {
        let mut seen: Vec<String> = Vec::new();
        let mut wave = Vec::new();
        for &i in pending {
            let keys = jobs[i].cmd.keys();
            let joins = joins(&jobs[i], &keys);
            let ids = named(keys);
            if joins && !ids.iter().any(|id| seen.contains(id)) {
                wave.push(i);
            }
            seen.extend(ids);
        }
        wave
    };
    match (free(wavy), free(polling)) {
        (wave, _) if wave.len() > 1 => Pick::Wave(wave),
        (_, polls) if polls.len() > 1 => Pick::Polls(polls),
        (wave, _) => Pick::Alone(wave.first().copied().unwrap_or(pending[0])),
    }
}

#[cfg(test)]
mod tests {
    use ql_wire::capability::Token;
    use ql_wire::fence::Fence;
    use ql_wire::ids::Counter;
    use ql_wire::route::AttemptPath;

    use super::*;
    use crate::core::Command;

    fn job(cmd: Command) -> Job {
        let (answer, _) = tokio::sync::oneshot::channel();
        Job { cmd, audit: None, session: String::new(), answer }
    }

    /// A renewal of attempt `n` on session `session`.
    fn renewal(session: u32, n: u32) -> Job {
        let path = AttemptPath {
            worker: "router-1".parse().unwrap(),
            session: format!("ses_{session}").parse().unwrap(),
            run: format!("run_{n}").parse().unwrap(),
            attempt: format!("att_{n}").parse().unwrap(),
        };
        let fence = Fence {
            session_generation: Counter::ONE,
            offer_id: format!("off_{n}").parse().unwrap(),
            lease_generation: Counter::ONE,
            lease_token: Token::generate().unwrap(),
            expected_lease_version: Counter::ONE,
        };
        job(Command::Renew(path, fence))
    }

    /// A heartbeat of session `session` (not wavy, as a poll).
    fn heartbeat(session: u32) -> Job {
        let body = ql_wire::session::Heartbeat { generation: Counter::ONE, draining: false };
        job(Command::Heartbeat("router-1".parse().unwrap(), format!("ses_{session}").parse().unwrap(), body))
    }

    /// A poll of session `session`.
    fn poll(session: u32) -> Job {
        let body = ql_wire::offer::PollOffers { generation: Counter::ONE, wait_ms: 0, max: 1 };
        job(Command::PollOffers("router-1".parse().unwrap(), format!("ses_{session}").parse().unwrap(), body))
    }

    #[test]
    fn a_wave_takes_every_fenced_command_about_rows_no_earlier_command_names() {
        // Renewals of sessions 1 and 2 around another session's heartbeat: one wave, the
        // heartbeat after it.
        let jobs = [renewal(1, 1), heartbeat(3), renewal(2, 2)];
        assert_eq!(pick(&jobs, &[0, 1, 2]), Pick::Wave(vec![0, 2]));
        assert_eq!(pick(&jobs, &[1]), Pick::Alone(1), "nothing wavy left: the first alone");
        // A renewal behind a heartbeat of its own session waits its turn behind it.
        let jobs = [heartbeat(1), renewal(1, 1), renewal(2, 2)];
        assert_eq!(pick(&jobs, &[0, 1, 2]), Pick::Alone(2), "a wave of one runs alone");
        assert_eq!(pick(&jobs, &[0, 1]), Pick::Alone(0));
        // Two commands about one attempt: the second waits for the first's wave.
        let jobs = [renewal(1, 1), renewal(1, 1), renewal(2, 2)];
        assert_eq!(pick(&jobs, &[0, 1, 2]), Pick::Wave(vec![0, 2]));
        assert_eq!(pick(&jobs, &[1]), Pick::Alone(1));
    }

    #[test]
    fn polls_of_sessions_no_earlier_command_names_form_a_wave_after_the_fenced_one() {
        // Fenced commands first, then the polls.
        let jobs = [poll(1), renewal(2, 2), poll(3), renewal(4, 4), poll(5)];
        assert_eq!(pick(&jobs, &[0, 1, 2, 3, 4]), Pick::Wave(vec![1, 3]));
        assert_eq!(pick(&jobs, &[0, 2, 4]), Pick::Polls(vec![0, 2, 4]));
        // A poll behind a command of its own session waits its turn; so does a second
        // poll of one session.
        let jobs = [heartbeat(1), poll(1), poll(2), poll(2), poll(3)];
        assert_eq!(pick(&jobs, &[0, 1, 2, 3, 4]), Pick::Polls(vec![2, 4]));
        assert_eq!(pick(&jobs, &[0, 1, 3]), Pick::Alone(0));
        assert_eq!(pick(&jobs, &[1, 3]), Pick::Polls(vec![1, 3]));
        // One poll alone is no wave.
        assert_eq!(pick(&jobs, &[3]), Pick::Alone(3));
    }

    #[test]
    fn an_insert_of_one_row_becomes_one_of_several_each_with_its_own_parameters() {
        let audit = "INSERT INTO audit (at, principal) VALUES ((floor(x))::bigint + $1::bigint, $2)";
        assert_eq!(
            merged_insert(audit, 2, 3).unwrap(),
            "INSERT INTO audit (at, principal) VALUES ((floor(x))::bigint + $1::bigint, $2), \
             ((floor(x))::bigint + $3::bigint, $4), ((floor(x))::bigint + $5::bigint, $6)"
        );
        let upsert = "INSERT INTO t (id, a) VALUES ($1, $2::text::jsonb) ON CONFLICT (id) DO UPDATE SET a = EXCLUDED.a";
        assert_eq!(
            merged_insert(upsert, 2, 2).unwrap(),
            "INSERT INTO t (id, a) VALUES ($1, $2::text::jsonb), ($3, $4::text::jsonb) \
             ON CONFLICT (id) DO UPDATE SET a = EXCLUDED.a"
        );
        assert_eq!(shifted("$1 + $10, $2", 10), "$11 + $20, $12");
        // Anything else is sent as it is.
        assert_eq!(merged_insert("INSERT INTO t (a) VALUES ($1) ON CONFLICT (a) DO UPDATE SET b = $2", 2, 2), None);
        assert_eq!(merged_insert("INSERT INTO t (a) VALUES ('$1')", 1, 2), None);
        assert_eq!(merged_insert("SELECT pg_notify($1, $2)", 2, 2), None);
    }

    #[test]
    fn several_alike_go_in_chunks_of_a_power_of_two_each_counting_its_rows() {
        let sql = "UPDATE leases SET version = $2 WHERE attempt_id = $1 RETURNING 1";
        let column: Vec<Statement> =
            (0..11i64).map(|i| (Cow::Borrowed(sql), vec![Box::new(i) as _, Box::new(i) as _])).collect();
        let (mut out, mut rows) = (Vec::new(), Vec::new());
        let saved = merged(column, 1, |k| Some(format!("{k} rows")), &mut out, &mut rows);
        let texts: Vec<&str> = out.iter().map(|s| s.0.as_ref()).collect();
        assert_eq!(texts, ["8 rows", "2 rows", sql]);
        assert_eq!(out.iter().map(|s| s.1.len()).collect::<Vec<_>>(), [16, 4, 2], "each row's parameters, in order");
        assert_eq!(rows, [8, 2, 1], "each must find every row it names");
        assert_eq!(saved, 8);
        // However many, a chunk stays under the protocol's parameters per statement.
        let wide: Vec<Statement> =
            (0..5000i64).map(|i| (Cow::Borrowed(sql), (0..8).map(|_| Box::new(i) as _).collect())).collect();
        let (mut out, mut rows) = (Vec::new(), Vec::new());
        merged(wide, 0, |k| Some(format!("{k} rows")), &mut out, &mut rows);
        assert!(out.iter().all(|s| s.1.len() <= MAX_PARAMS), "{:?}", out.iter().map(|s| s.1.len()).max());
        assert_eq!(out.iter().map(|s| s.1.len()).sum::<usize>(), 40_000, "every row sent once");
        // Statements that cannot merge go as they are, each with its own count.
        let column: Vec<Statement> = (0..3i64).map(|i| (Cow::Borrowed(sql), vec![Box::new(i) as _])).collect();
        let (mut out, mut rows) = (Vec::new(), Vec::new());
        assert_eq!(merged(column, 1, |_| None, &mut out, &mut rows), 0);
        assert_eq!((out.len(), rows), (3, vec![1, 1, 1]));
    }

    #[test]
    fn an_update_of_one_loaded_row_becomes_one_of_several_that_must_find_each() {
        let sql = "UPDATE sessions SET seen_at = $2, labels = $3::text::jsonb WHERE id = $1 RETURNING 1";
        let update = Update::parse(sql).unwrap();
        assert_eq!(
            update,
            Update { table: "sessions", key: "id", sets: vec![("seen_at", 2, ""), ("labels", 3, "::text::jsonb")] }
        );
        assert_eq!(
            update.merged(&[Type::TEXT, Type::INT8, Type::TEXT], 2).unwrap(),
            "UPDATE sessions SET seen_at = v.p2, labels = v.p3::text::jsonb FROM (SELECT v.*, f.tid \
             FROM (VALUES ($1::text, $2::int8, $3::text), ($4::text, $5::int8, $6::text)) AS v (p1, p2, p3) \
             CROSS JOIN LATERAL (SELECT ctid AS tid FROM sessions WHERE id = v.p1 OFFSET 0) f) v \
             WHERE sessions.ctid = v.tid RETURNING 1"
        );
        assert_eq!(update.merged(&[Type::TEXT], 2), None, "types that do not fit: as it is");
        for other in [
            "UPDATE leases SET version = version + 1 WHERE attempt_id = $1 RETURNING 1",
            "UPDATE leases SET version = $3 WHERE attempt_id = $1 RETURNING 1",
            "UPDATE leases SET version = $2 WHERE attempt_id = $1",
            "DELETE FROM schedules WHERE name = $1",
        ] {
            assert_eq!(Update::parse(other), None, "{other}");
        }
    }
}
