-- Indexes on the three referencing columns 0001 left without one.
--
-- The foreign keys are deferred, and an offer and its attempt reference each other, so
-- placing a run always leaves a violation pending for a moment. While one is pending,
-- SQLite looks up the rows that reference every parent row it inserts, to see whether
-- they are now satisfied; without an index that lookup reads the whole referencing
-- table. Every placement cost a scan of `runs` and of `attempts` (and a run inserted in a
-- batch with a placement, one of `offers`), and these tables only grow.
CREATE INDEX runs_current_attempt ON runs (current_attempt_id);
CREATE INDEX attempts_offer ON attempts (offer_id);
CREATE INDEX offers_run ON offers (run_id);
