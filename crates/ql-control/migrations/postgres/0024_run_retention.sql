-- Run retention: the sweeper removes ended runs older than `run_retention_ms`, with their
-- attempts, offers, leases, events, live-log chunks and webhook deliveries, oldest first
-- (their stored logs first, from the artifact store), through prune_runs, which the owner
-- owns: the runtime role may call it and still has no DELETE of its own. Events and chunks
-- stay append-only to everyone else, as audit records are (migration 0003). The index
-- holds the ended runs by when they ended, so finding the oldest reads only them. Every
-- statement here may run again (a migrate that finds the version before this one).
CREATE INDEX IF NOT EXISTS runs_ended ON runs (finished_at) WHERE status IN ('succeeded', 'failed', 'cancelled', 'timed_out');
-- Deleting a row makes PostgreSQL look, at the commit, for rows still naming it through
-- a foreign key: an offer's run, a run's current attempt and an attempt's offer had no
-- index, so each deleted run, attempt or offer would read its whole referencing table.
CREATE INDEX IF NOT EXISTS offers_run ON offers (run_id);
CREATE INDEX IF NOT EXISTS runs_current_attempt ON runs (current_attempt_id) WHERE current_attempt_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS attempts_offer ON attempts (offer_id);

DROP TRIGGER IF EXISTS events_append_only ON events;
CREATE TRIGGER events_append_only BEFORE UPDATE ON events
    FOR EACH ROW EXECUTE FUNCTION append_only();
DROP TRIGGER IF EXISTS events_pruned_only ON events;
CREATE TRIGGER events_pruned_only BEFORE DELETE ON events
    FOR EACH ROW WHEN (current_setting('ql.run_prune', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION append_only();
DROP TRIGGER IF EXISTS log_chunks_append_only ON log_chunks;
CREATE TRIGGER log_chunks_append_only BEFORE UPDATE ON log_chunks
    FOR EACH ROW EXECUTE FUNCTION append_only();
DROP TRIGGER IF EXISTS log_chunks_pruned_only ON log_chunks;
CREATE TRIGGER log_chunks_pruned_only BEFORE DELETE ON log_chunks
    FOR EACH ROW WHEN (current_setting('ql.run_prune', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION append_only();

-- Removes those of the runs `ids` that ended before `cutoff` (milliseconds since the
-- epoch) and whose webhook is not waiting to be delivered, with every row that names them;
-- returns how many runs went. A run another transaction holds is left for a later call.
CREATE OR REPLACE FUNCTION prune_runs(ids TEXT[], cutoff BIGINT) RETURNS BIGINT
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public AS $$
DECLARE
    doomed TEXT[];
    gone BIGINT := 0;
BEGIN
    SELECT array_agg(x.id) INTO doomed FROM (
        SELECT r.id FROM runs r
        WHERE r.id = ANY (ids) AND r.status IN ('succeeded', 'failed', 'cancelled', 'timed_out')
          AND r.finished_at < cutoff
          AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.run_id = r.id AND d.state IN ('waiting', 'pending'))
        FOR UPDATE SKIP LOCKED) x;
    IF doomed IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM set_config('ql.run_prune', 'on', true);
    DELETE FROM log_chunks WHERE attempt_id IN (SELECT a.id FROM attempts a WHERE a.run_id = ANY (doomed));
    DELETE FROM offers WHERE attempt_id IN (SELECT a.id FROM attempts a WHERE a.run_id = ANY (doomed));
    DELETE FROM leases WHERE run_id = ANY (doomed);
    DELETE FROM events WHERE run_id = ANY (doomed);
    DELETE FROM deliveries WHERE run_id = ANY (doomed);
    DELETE FROM attempts WHERE run_id = ANY (doomed);
    DELETE FROM runs WHERE id = ANY (doomed);
    GET DIAGNOSTICS gone = ROW_COUNT;
    PERFORM set_config('ql.run_prune', 'off', true);
    RETURN gone;
END
$$;
REVOKE ALL ON FUNCTION prune_runs(TEXT[], BIGINT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION prune_runs(TEXT[], BIGINT) TO ql_runtime;
