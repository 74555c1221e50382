-- An event's run and attempt were checked by two deferred foreign keys: at COMMIT, for
-- every event, a query that locks the run's row (FOR KEY SHARE) and another the
-- attempt's, about twenty for a group of eight ACKs, and about a tenth of the ACK rate
-- at 8 clients (bench/RESULTS.md). The store now checks what they checked before it
-- sends anything: an event may name only a run its command loaded or wrote, and an
-- attempt of that run it loaded or wrote, or that run's current attempt (store/loaded.rs,
-- both stores). Such a row still exists at COMMIT: no runtime role may DELETE, and
-- ql-control never changes a run's or an attempt's id. The run's current attempt is
-- vouched for by the foreign key of `runs` itself, which stays, as do all the others.
ALTER TABLE events
    DROP CONSTRAINT events_run_id_fkey,
    DROP CONSTRAINT events_attempt_id_fkey;
