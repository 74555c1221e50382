//! The store contract suite (see `contract/mod.rs`), instantiated for every backend.
//!
//! Each backend gets one `#[tokio::test]` per scenario, each on a fresh database. Adding
//! a backend means implementing [`contract::Backend`] for it and listing it in
//! [`contract_suite!`] below; the scenarios do not change. PostgreSQL's backend lives in
//! `contract/pg.rs` and needs a server (`scripts/test` provides one).

mod contract;

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::types::ValueRef;
use rusqlite::Connection;

use ql_control::core::Timings;
use ql_control::store::sqlite::{SqliteOptions, SqliteStore};
use ql_wire::ids::{AttemptId, RunId};

use contract::{test_timings, Backend, TempDir};

/// A SQLite file in a fresh temp dir, with a clock offset the suite controls.
struct Sqlite {
    _dir: TempDir,
    path: PathBuf,
    offset: Arc<AtomicI64>,
    store: SqliteStore,
}

impl Sqlite {
    fn new() -> Self {
        let dir = TempDir::new("contract-sqlite");
        let path = dir.path().join("authority.db");
        let offset = Arc::new(AtomicI64::new(0));
        let store = SqliteStore::open_with_options(&path, Self::options(&offset)).unwrap();
        Self { _dir: dir, path, offset, store }
    }

    fn options(offset: &Arc<AtomicI64>) -> SqliteOptions {
        SqliteOptions {
            timings: test_timings(),
            clock_offset: offset.clone(),
            // Short, so the cross-process wake-up test answers quickly.
            watch_tick: Duration::from_millis(10),
            ..SqliteOptions::default()
        }
    }

    /// A plain connection, as an operator with the `sqlite3` shell would have.
    fn backdoor(&self) -> Connection {
        let c = Connection::open(&self.path).unwrap();
        c.busy_timeout(Duration::from_secs(5)).unwrap();
        c
    }
}

impl Backend for Sqlite {
    type Store = SqliteStore;

    fn store(&self) -> SqliteStore {
        self.store.clone()
    }

    fn other_process(&self) -> SqliteStore {
        SqliteStore::open_with_options(&self.path, Self::options(&self.offset)).unwrap()
    }

    fn timings(&self) -> Timings {
        test_timings()
    }

    fn advance(&self, ms: i64) {
        self.offset.fetch_add(ms, Ordering::SeqCst);
    }

    async fn set_executor_type(&self, attempt: &AttemptId, executor_type: &str) {
        let n = self
            .backdoor()
            .execute("UPDATE attempts SET executor_type = ?1 WHERE id = ?2", [executor_type, attempt.as_str()])
            .unwrap();
        assert_eq!(n, 1);
    }

    async fn plant_event(&self, run: &RunId, attempt: &AttemptId, kind: &str) {
        self.backdoor()
            .execute(
                "INSERT INTO events (id, run_id, attempt_id, kind, payload, at) VALUES ('evt_planted', ?1, ?2, ?3, '{}', 0)",
                [run.as_str(), attempt.as_str(), kind],
            )
            .unwrap();
    }

    async fn all_text(&self) -> Vec<String> {
        let c = self.backdoor();
        let tables: Vec<String> = c
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(tables.len() >= 7, "every table of the schema: {tables:?}");
        let mut out = Vec::new();
        for table in tables {
            let mut stmt = c.prepare(&format!("SELECT * FROM {table}")).unwrap();
            let columns = stmt.column_count();
            let mut rows = stmt.query([]).unwrap();
            while let Some(row) = rows.next().unwrap() {
                for i in 0..columns {
                    match row.get_ref(i).unwrap() {
                        ValueRef::Text(t) => out.push(String::from_utf8_lossy(t).into_owned()),
                        ValueRef::Blob(b) => out.push(String::from_utf8_lossy(b).into_owned()),
                        _ => {}
                    }
                }
            }
        }
        out
    }
}

/// One test per scenario for each backend listed: `mod <backend>` with one
/// `#[tokio::test]` per scenario, each on the backend `make` builds.
macro_rules! contract_suite {
    ($($backend:ident: $make:expr),+ $(,)? => $scenarios:tt) => {
        $(contract_suite!(@one $backend: $make => $scenarios);)+
    };
    (@one $backend:ident: $make:expr => [$($scenario:ident),* $(,)?]) => {
        mod $backend {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test]
                async fn $scenario() {
                    #[allow(unused_imports)]
                    use contract::identity::*;
                    #[allow(unused_imports)]
                    use contract::scenarios::*;
                    #[allow(unused_imports)]
                    use contract::operators::*;
                    #[allow(unused_imports)]
                    use contract::schedules::*;
                    $scenario($make).await;
                }
            )*
        }
    };
}

contract_suite!(
    sqlite: Sqlite::new(),
    postgres: contract::pg::Pg::new().await,
    => [
        the_whole_protocol_with_replays,
        admission_follows_the_worker_and_its_certificates,
        revoking_a_certificate_revokes_what_was_renewed_from_it,
        the_worker_page_lists_each_known_worker_once_by_id,
        the_certificate_pages_list_each_once_by_worker_newest_first,
        a_worker_renews_at_most_once_an_interval,
        ended_sessions_never_offered_work_are_pruned,
        revoking_a_worker_ends_what_it_holds_and_requeues_its_runs,
        disabling_a_worker_requeues_its_runs_and_a_repeat_changes_nothing_more,
        an_enrolment_token_is_spent_once,
        an_operator_credential_is_added_once_and_removed_once,
        a_webhook_delivery_is_claimed_once_and_retried_until_delivered,
        stats_count_the_rows_by_status,
        ended_runs_past_their_retention_go_with_every_row_that_names_them,
        each_fire_time_fires_once_whoever_sweeps,
        overlap_catch_up_and_pause_decide_each_fire,
        a_clock_gone_back_never_fires_a_time_twice,
        completion_from_starting_registers_the_callback,
        artifacts_are_admitted_and_completions_match_their_receipt,
        the_live_log_appends_at_the_acknowledged_offset_then_seals,
        start_failure_and_its_replay,
        stop_intents_decide_the_terminal_status,
        cancel_before_a_claim_ends_the_run,
        every_drift_is_refused_and_changes_nothing,
        a_new_session_replaces_the_old_one,
        a_repeated_open_replaces_a_session_never_heard_from,
        a_closed_session_ends_and_the_next_opens_at_once,
        placement_honours_labels_and_capacity,
        trusted_labels_come_from_the_operator_not_the_agent,
        an_expired_offer_requeues_without_spending_retries,
        expired_leases_are_lost_then_the_run_fails,
        an_abandoned_attempt_is_lost_at_once_and_its_run_queued_again,
        an_outage_of_the_authority_gives_its_time_back_to_live_leases,
        an_overdue_run_gets_a_timeout_stop,
        no_raw_token_reaches_the_database,
        changes_wake_on_new_work_here_and_elsewhere,
        a_submit_wakes_only_the_polls_that_take_its_run,
        a_requeue_wakes_only_the_polls_that_take_its_run,
        operator_reads_are_ordered_and_bounded,
        audit_records_are_pruned_by_age_and_count,
        twin_refusals_are_counted_from_the_audit_records,
        an_audited_command_commits_its_admission_with_its_decision,
        a_failed_write_rolls_back_the_whole_command,
        racing_claims_and_polls_admit_exactly_one,
    ]
);
