-- Ended sessions pruned: a worker holding one valid certificate could open sessions in a
-- loop and leave a row each, for ever. A session on which work was placed is marked
-- `offered` in the placement's transaction (an offer, an attempt, a lease may name it);
-- the sweeper removes ended sessions never offered anything that are more than `keep`
-- generations behind their worker's newest, at most `batch` a call, through
-- prune_sessions, which the owner owns: the runtime role may call it and still has no
-- DELETE of its own. Sessions recorded before count as offered. The partial index holds
-- only the candidates. Deleting a session makes PostgreSQL look for attempts and offers
-- still naming it (their foreign keys): the two indexes on session_id make that a probe
-- rather than a scan of each table. The rule on `offered` is a row trigger of its own, as
-- the table's other rules are (migration 0014), rather than a CHECK every heartbeat would
-- evaluate: it fires on a session's insert, and once more when its first placement marks
-- it.
ALTER TABLE sessions ADD COLUMN offered BIGINT NOT NULL DEFAULT 1;
CREATE INDEX sessions_prunable ON sessions (worker, generation)
    WHERE offered = 0 AND state IN ('closed', 'expired', 'replaced');
CREATE INDEX attempts_session ON attempts (session_id);
CREATE INDEX offers_session ON offers (session_id);

CREATE FUNCTION sessions_offered_checked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (NEW.offered IN (0, 1)) THEN
        RAISE EXCEPTION 'sessions: offered must be 0 or 1'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'sessions_offered_check', TABLE = 'sessions';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER sessions_offered_checked
    BEFORE INSERT OR UPDATE OF offered ON sessions
    FOR EACH ROW EXECUTE FUNCTION sessions_offered_checked();

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
