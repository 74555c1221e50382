-- Keys compare byte for byte. Every command probes and inserts into btree indexes of
-- text keys (ids, the events' unique key, the queue's run ids), and under a database's
-- libc collation each comparison of two different values copies both and calls strcoll:
-- about 4 % of a busy lane's PostgreSQL CPU went to text comparisons in index searches
-- (perf, 8 agents), even under C.UTF-8, which PostgreSQL 15 does not treat as "C". The keys are
-- ASCII identifiers made by the server, so "C" changes no equality; it orders them byte
-- for byte, as SQLite's store does (BINARY), where the database's collation could order
-- them otherwise (case folded, say) as a tie-break after time.
--
-- Both sides of each foreign key change together, and the indexes on these columns are
-- rebuilt (the rows are not rewritten: the type stays text); `events_once` keys on
-- COALESCE(attempt_id, ''), whose collation is the column's. A query comparing one of
-- these columns with a parameter or another text takes the column's collation, so every
-- probe still uses its index.

ALTER TABLE sessions
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN worker TYPE text COLLATE "C";
ALTER TABLE runs
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN current_attempt_id TYPE text COLLATE "C";
ALTER TABLE attempts
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN run_id TYPE text COLLATE "C",
    ALTER COLUMN offer_id TYPE text COLLATE "C",
    ALTER COLUMN session_id TYPE text COLLATE "C";
ALTER TABLE leases
    ALTER COLUMN attempt_id TYPE text COLLATE "C",
    ALTER COLUMN run_id TYPE text COLLATE "C";
ALTER TABLE offers
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN run_id TYPE text COLLATE "C",
    ALTER COLUMN attempt_id TYPE text COLLATE "C",
    ALTER COLUMN session_id TYPE text COLLATE "C";
ALTER TABLE events
    ALTER COLUMN id TYPE text COLLATE "C",
    ALTER COLUMN run_id TYPE text COLLATE "C",
    ALTER COLUMN attempt_id TYPE text COLLATE "C",
    ALTER COLUMN kind TYPE text COLLATE "C";
ALTER TABLE log_chunks
    ALTER COLUMN attempt_id TYPE text COLLATE "C";
ALTER TABLE deliveries
    ALTER COLUMN run_id TYPE text COLLATE "C";
ALTER TABLE workers
    ALTER COLUMN id TYPE text COLLATE "C";
ALTER TABLE certificates
    ALTER COLUMN serial TYPE text COLLATE "C",
    ALTER COLUMN worker TYPE text COLLATE "C";
