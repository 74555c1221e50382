//! Updates that count their own rows inside the transaction.
//!
//! Every UPDATE the store sends rewrites rows its command loaded under a row lock, so it
//! must find each of them; one that found fewer would drop part of a decision. The
//! store sends a transaction's last writes and its COMMIT in one pipeline, so a count it
//! read from the answers would come after the COMMIT had kept the rest. So each such
//! update goes as
//!
//! ```sql
//! WITH w AS (UPDATE leases ... RETURNING 1) SELECT rows_found((SELECT count(*) FROM w), 8, 'leases')
//! ```
//!
//! and `rows_found` (migration 0016) raises when the count falls short, inside the
//! transaction: it aborts, and the COMMIT behind it in the pipeline rolls back.
//!
//! Writes into different tables could go as one statement of several such `WITH`
//! queries, a statement fewer each; measured, that gained nothing at 8 agents and cost a
//! tenth at 64, whose mixed groups made many more texts to prepare (bench/RESULTS.md).

use std::borrow::Cow;

use super::Statement;

/// `statements`, each of which must find `rows[i]` rows (0: not counted), with every
/// UPDATE that must find rows counting them itself ([module doc](self)). Returns the
/// statements and, for each, the rows its answer must hold: 0 for all but a statement
/// this cannot wrap that must find rows (counted from its answer, as before).
pub(super) fn checked(statements: Vec<Statement>, rows: Vec<usize>) -> (Vec<Statement>, Vec<usize>) {
    statements
        .into_iter()
        .zip(rows)
        .map(|(statement, n)| match target(&statement.0, n) {
            Some(table) => {
                let sql =
                    format!("WITH w AS ({}) SELECT rows_found((SELECT count(*) FROM w), {n}, '{table}')", statement.0);
                ((Cow::Owned(sql), statement.1), 0)
            }
            None => (statement, n),
        })
        .unzip()
}

/// The table of an `UPDATE t SET ... RETURNING 1` that must find rows, when it can count
/// them itself: its table a plain name and no quoted text in it.
fn target(sql: &str, rows: usize) -> Option<&str> {
    let table = sql.strip_prefix("UPDATE ")?.split(' ').next()?;
    let word = !table.is_empty() && table.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    let quoted = sql.contains(['\'', '"']) || sql.contains("$$");
    (rows > 0 && word && !quoted && sql.ends_with(" RETURNING 1")).then_some(table)
}

/// The text [`checked`] makes of an update of one row or several that must find `rows`
/// (a test runs it against PostgreSQL).
#[doc(hidden)]
pub fn checked_text(sql: &str, rows: usize) -> String {
    checked(vec![(Cow::Owned(sql.to_owned()), Vec::new())], vec![rows]).0.remove(0).0.into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: &str = "UPDATE leases SET version = $2 WHERE attempt_id = $1 RETURNING 1";

    #[test]
    fn an_update_that_must_find_rows_counts_them_itself() {
        assert_eq!(
            checked_text(LEASE, 8),
            "WITH w AS (UPDATE leases SET version = $2 WHERE attempt_id = $1 RETURNING 1) \
             SELECT rows_found((SELECT count(*) FROM w), 8, 'leases')"
        );
    }

    #[test]
    fn anything_else_goes_as_it_is_with_its_count() {
        let insert = "INSERT INTO audit (at) VALUES ($1)";
        let quoted = "UPDATE runs SET status = 'x' WHERE id = $1 RETURNING 1";
        let unreturned = "UPDATE runs SET status = $2 WHERE id = $1";
        for (sql, rows) in [(insert, 0), (LEASE, 0), (quoted, 1), (unreturned, 1), ("SELECT pg_notify($1, $2)", 0)] {
            let (out, counts) = checked(vec![(Cow::Borrowed(sql), Vec::new())], vec![rows]);
            assert_eq!((out[0].0.as_ref(), counts[0]), (sql, rows), "{sql}");
        }
        // In order, each with its own count.
        let statements = vec![(Cow::Borrowed(unreturned), Vec::new()), (Cow::Borrowed(LEASE), Vec::new())];
        let (out, counts) = checked(statements, vec![1, 4]);
        assert_eq!(counts, [1, 0]);
        assert_eq!(out[0].0, unreturned);
        assert!(out[1].0.starts_with("WITH w AS (UPDATE leases"));
    }
}
