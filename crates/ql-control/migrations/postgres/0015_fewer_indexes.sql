-- Every event and every lease written maintains each index of its table, and every
-- statement on a table opens them all; two of them duplicated another's work.
--
-- `leases_run (run_id)` is the prefix of the unique `(run_id, lease_generation)`, which
-- answers a run's leases as well. `events_attempt (attempt_id, kind)` served one lookup,
-- an attempt's completion event, which `events_once (run_id, COALESCE(attempt_id, ''),
-- kind)` answers once the attempt's run is known: every command appends several events,
-- and only a completion looks one up.
DROP INDEX leases_run;
DROP INDEX events_attempt;
