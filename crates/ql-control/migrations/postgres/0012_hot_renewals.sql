-- A lease renewal rewrites two rows, the lease and its attempt's projection of it, and
-- a busy fleet renews far more often than anything else happens. Neither write changes
-- an indexed column once the lease index no longer keys on `expires_at`, so PostgreSQL
-- can update both in place (a HOT update: no new index entry, no index to clean up
-- later) whenever the row's page has room, which a lower fill factor leaves.
--
-- The sweeper finds lapsed leases among the live ones (`state = 'leased'`, an index of
-- attempt ids) and filters them by time: a scan of the live leases per sweep, not of
-- every lease ever taken, in exchange for renewals that touch no index.
DROP INDEX leases_lapse;
CREATE INDEX leases_live ON leases (attempt_id) WHERE state = 'leased';
ALTER TABLE leases SET (fillfactor = 70);
ALTER TABLE attempts SET (fillfactor = 70);
