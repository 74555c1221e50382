//! A transaction's writes as few statements, each counting its own rows.
//!
//! Every statement costs PostgreSQL's backend about as much around its execution (bind,
//! executor start and end, its answer) as a small write costs to run, and every
//! UPDATE of loaded rows must find each of them. So consecutive writes to different
//! tables go as one statement of data-modifying `WITH` queries, which PostgreSQL runs
//! each exactly once, whatever the outer query reads:
//!
//! ```sql
//! WITH w1 AS (INSERT INTO audit ...), w2 AS (UPDATE leases ... RETURNING 1)
//! SELECT rows_found((SELECT count(*) FROM w2), 8, 'leases')
//! ```
//!
//! `rows_found` (migration 0016) raises when an update found fewer rows than it was
//! due, inside the transaction: the transaction aborts, and a COMMIT sent behind it in
//! the same pipeline rolls back. That is what lets a transaction's last writes and its
//! COMMIT share one round trip. The `WITH` queries of one statement all see the
//! statement's snapshot, not each other's writes, and run in no set order, so a
//! statement takes at most one write per table: two writes of one table, which may be
//! of one row, stay in two statements, in their order.

use std::borrow::Cow;

use super::Statement;

/// Most parameters one statement may carry (the protocol counts them in 16 bits).
pub(super) const MAX_PARAMS: usize = 32_767;

/// `statements`, each of which must find `rows[i]` rows (0: not counted), as few
/// statements: every run of consecutive INSERTs and UPDATEs into different tables as one
/// ([module doc](self)), and every UPDATE counted by PostgreSQL. Returns the statements
/// and, for each, the rows its answer must hold: 0 for all but a statement passed as it
/// is that must find rows (one this cannot read, counted from its answer as before).
pub(super) fn combine(statements: Vec<Statement>, rows: Vec<usize>) -> (Vec<Statement>, Vec<usize>) {
    let (mut out, mut counts) = (Vec::new(), Vec::new());
    let mut run: Vec<(Statement, usize, String)> = Vec::new();
    let flush = |run: &mut Vec<(Statement, usize, String)>, out: &mut Vec<Statement>, counts: &mut Vec<usize>| {
        if let Some(s) = together(std::mem::take(run)) {
            out.push(s);
            counts.push(0);
        }
    };
    for (statement, n) in statements.into_iter().zip(rows) {
        let Some(table) = target(&statement.0, n) else {
            flush(&mut run, &mut out, &mut counts);
            out.push(statement);
            counts.push(n);
            continue;
        };
        let params: usize = run.iter().map(|(s, _, _)| s.1.len()).sum();
        if run.iter().any(|(_, _, t)| *t == table) || params + statement.1.len() > MAX_PARAMS {
            flush(&mut run, &mut out, &mut counts);
        }
        run.push((statement, n, table));
    }
    flush(&mut run, &mut out, &mut counts);
    (out, counts)
}

/// The table a write goes to, when it may join a statement: an `INSERT INTO t (...)` or
/// an `UPDATE t SET ...` (one that must find rows returns one per row), with no quoted
/// text in which a `$` could be more than a placeholder.
fn target(sql: &str, rows: usize) -> Option<String> {
    let (rest, update) = match (sql.strip_prefix("INSERT INTO "), sql.strip_prefix("UPDATE ")) {
        (Some(rest), _) => (rest, false),
        (_, Some(rest)) => (rest, true),
        _ => return None,
    };
    let table = rest.split(' ').next()?;
    let word = !table.is_empty() && table.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    let quoted = sql.contains(['\'', '"']) || sql.contains("$$");
    let counted = rows == 0 || (update && sql.ends_with(" RETURNING 1"));
    (word && !quoted && counted).then(|| table.to_owned())
}

/// One statement for `run` (writes to different tables, each with the rows it must
/// find), or the one write as it is when it counts nothing; `None` for no write.
fn together(run: Vec<(Statement, usize, String)>) -> Option<Statement> {
    match run.len() {
        0 => return None,
        1 if run[0].1 == 0 => return run.into_iter().next().map(|(s, _, _)| s),
        _ => {}
    }
    let (mut ctes, mut checks, mut params) = (Vec::new(), Vec::new(), Vec::new());
    for (i, ((sql, p), n, table)) in run.into_iter().enumerate() {
        ctes.push(format!("w{} AS ({})", i + 1, shifted(&sql, params.len())));
        if n > 0 {
            checks.push(format!("rows_found((SELECT count(*) FROM w{}), {n}, '{table}')", i + 1));
        }
        params.extend(p);
    }
    let outer = if checks.is_empty() { "0".to_owned() } else { checks.join(", ") };
    Some((Cow::Owned(format!("WITH {} SELECT {outer}", ctes.join(", "))), params))
}

/// `sql` with every placeholder `$i` renumbered `$(i + by)`.
pub(super) fn shifted(sql: &str, by: usize) -> String {
    if by == 0 {
        return sql.to_owned();
    }
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

/// The texts [`combine`] makes of writes given as their SQL, parameter count and the
/// rows each must find (a test runs them against PostgreSQL).
#[doc(hidden)]
pub fn combined_texts(writes: &[(&str, usize, usize)]) -> Vec<String> {
    let statements = writes
        .iter()
        .map(|&(sql, params, _)| {
            let params: super::rows::Params = (0..params).map(|_| Box::new(0_i64) as _).collect();
            (Cow::Owned(sql.to_owned()), params)
        })
        .collect();
    let rows = writes.iter().map(|w| w.2).collect();
    combine(statements, rows).0.into_iter().map(|s| s.0.into_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUDIT: &str = "INSERT INTO audit (at, principal) VALUES ($1, $2)";
    const LEASE: &str = "UPDATE leases SET version = $2 WHERE attempt_id = $1 RETURNING 1";
    const ATTEMPT: &str = "UPDATE attempts SET lease_version = $2 WHERE id = $1 RETURNING 1";

    fn texts(writes: &[(&str, usize, usize)]) -> Vec<String> {
        combined_texts(writes)
    }

    #[test]
    fn writes_into_different_tables_go_as_one_statement_that_counts_each_updates_rows() {
        assert_eq!(
            texts(&[(AUDIT, 2, 0), (ATTEMPT, 2, 1), (LEASE, 2, 1)]),
            ["WITH w1 AS (INSERT INTO audit (at, principal) VALUES ($1, $2)), \
              w2 AS (UPDATE attempts SET lease_version = $4 WHERE id = $3 RETURNING 1), \
              w3 AS (UPDATE leases SET version = $6 WHERE attempt_id = $5 RETURNING 1) \
              SELECT rows_found((SELECT count(*) FROM w2), 1, 'attempts'), \
              rows_found((SELECT count(*) FROM w3), 1, 'leases')"]
        );
        // An update alone is counted too; an insert alone goes as it is.
        assert_eq!(
            texts(&[(LEASE, 2, 8)]),
            ["WITH w1 AS (UPDATE leases SET version = $2 WHERE attempt_id = $1 RETURNING 1) \
              SELECT rows_found((SELECT count(*) FROM w1), 8, 'leases')"]
        );
        assert_eq!(texts(&[(AUDIT, 2, 0)]), [AUDIT]);
        let inserts = texts(&[(AUDIT, 2, 0), ("INSERT INTO events (id) VALUES ($1)", 1, 0)]);
        assert_eq!(
            inserts,
            ["WITH w1 AS (INSERT INTO audit (at, principal) VALUES ($1, $2)), \
              w2 AS (INSERT INTO events (id) VALUES ($3)) SELECT 0"]
        );
    }

    #[test]
    fn a_second_write_into_one_table_starts_the_next_statement_in_order() {
        let out = texts(&[(AUDIT, 2, 0), (LEASE, 2, 1), (ATTEMPT, 2, 1), (LEASE, 2, 1), (AUDIT, 2, 0)]);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out[0].starts_with("WITH w1 AS (INSERT INTO audit") && out[0].contains("w3 AS (UPDATE attempts"));
        assert!(out[1].starts_with("WITH w1 AS (UPDATE leases SET version = $2 WHERE attempt_id = $1"), "{out:?}");
        assert!(out[1].contains("w2 AS (INSERT INTO audit (at, principal) VALUES ($3, $4))"), "{out:?}");
    }

    #[test]
    fn anything_else_goes_as_it_is_and_ends_the_statement_before_it() {
        let notify = "SELECT pg_notify($1, $2)";
        let quoted = "UPDATE runs SET status = 'x' WHERE id = $1 RETURNING 1";
        let unreturned = "UPDATE runs SET status = $2 WHERE id = $1";
        let upsert = "INSERT INTO leases (attempt_id) VALUES ($1) ON CONFLICT (attempt_id) DO UPDATE SET state = 'x'";
        let out = texts(&[(AUDIT, 2, 0), (notify, 2, 0), (quoted, 1, 1), (unreturned, 2, 1), (upsert, 1, 0)]);
        assert_eq!(out, [AUDIT, notify, quoted, unreturned, upsert]);
        // What must be counted and cannot be here keeps its count for the answer.
        let statements = vec![(Cow::Borrowed(unreturned), Vec::new()), (Cow::Borrowed(LEASE), Vec::new())];
        assert_eq!(combine(statements, vec![1, 4]).1, [1, 0]);
    }

    #[test]
    fn a_statement_stays_under_the_protocols_parameters() {
        let wide = MAX_PARAMS / 2 + 1;
        let out = texts(&[(AUDIT, wide, 0), ("INSERT INTO events (id) VALUES ($1)", wide, 0)]);
        assert_eq!(out.len(), 2, "two writes of over half the parameters each go apart");
        assert_eq!(shifted("$1 + $10, $2 $$", 10), "$11 + $20, $12 $$");
    }
}
