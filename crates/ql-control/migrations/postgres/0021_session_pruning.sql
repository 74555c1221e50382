-- Ended sessions pruned: a worker holding one valid certificate could open sessions in a
-- loop and leave a row each, for ever. A session on which work was placed is marked
-- `offered` in the placement's transaction (an offer, an attempt, a lease may name it);
-- the sweeper removes ended sessions never offered anything that are more than `keep`
-- generations behind their worker's newest, at most `batch` a call, through
-- prune_sessions, which the owner owns: the runtime role may call it and still has no
-- DELETE of its own. Sessions recorded before count as offered. The partial index holds
-- only the candidates, and a heartbeat's or poll's update of a live session changes no
-- column it covers.
ALTER TABLE sessions ADD COLUMN offered BIGINT NOT NULL DEFAULT 1 CHECK (offered IN (0, 1));
CREATE INDEX sessions_prunable ON sessions (worker, generation)
    WHERE offered = 0 AND state IN ('closed', 'expired', 'replaced');

CREATE FUNCTION prune_sessions(keep BIGINT, batch BIGINT) RETURNS BIGINT
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public AS $$
DECLARE
    gone BIGINT := 0;
BEGIN
    DELETE FROM sessions WHERE id IN (
        SELECT s.id FROM sessions s
        WHERE s.offered = 0 AND s.state IN ('closed', 'expired', 'replaced')
          AND s.generation <= (SELECT max(m.generation) FROM sessions m WHERE m.worker = s.worker) - keep
        ORDER BY s.worker, s.generation
        LIMIT batch
        FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS gone = ROW_COUNT;
    RETURN gone;
END
$$;
REVOKE ALL ON FUNCTION prune_sessions(BIGINT, BIGINT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION prune_sessions(BIGINT, BIGINT) TO ql_runtime;
