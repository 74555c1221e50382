-- The load of a fenced command (an ACK, a renewal, a completion, a log chunk) in one
-- call: the attempt's fence, then its session, run, attempt, lease and offer locked in
-- the protocol's order (ADR-0109 §2), the completion event, DB time read after every
-- lock, and what the request's admission reads. The store sends it with BEGIN as one
-- round trip of two statements instead of nine; the decision stays in the store's code.
--
-- Rows come back as JSON text (`to_jsonb`): TEXT columns as strings byte for byte,
-- BIGINT as numbers, labels as objects. A row that does not exist is NULL. DB time is
-- `clock_timestamp()` read after the last lock (inside a function `statement_timestamp()`
-- is the calling statement's start, before the locks).
CREATE FUNCTION ql_load_fenced(
    p_attempt TEXT, p_session TEXT, p_run TEXT, p_offer TEXT, p_event_kind TEXT,
    p_offset BIGINT, p_principal TEXT, p_serial TEXT,
    OUT session_row TEXT, OUT run_row TEXT, OUT attempt_row TEXT, OUT lease_row TEXT,
    OUT offer_row TEXT, OUT event_row TEXT, OUT db_now BIGINT,
    OUT worker_disabled_at BIGINT, OUT worker_revoked_at BIGINT, OUT cert_worker TEXT,
    OUT cert_issued_at BIGINT, OUT cert_not_after BIGINT, OUT cert_revoked_at BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('attempt:' || p_attempt, 0));
    SELECT to_jsonb(x)::text INTO session_row FROM sessions x WHERE x.id = p_session FOR UPDATE;
    SELECT to_jsonb(x)::text INTO run_row FROM runs x WHERE x.id = p_run FOR UPDATE;
    SELECT to_jsonb(x)::text INTO attempt_row FROM attempts x WHERE x.id = p_attempt FOR UPDATE;
    IF attempt_row IS NOT NULL THEN
        SELECT to_jsonb(x)::text INTO lease_row FROM leases x WHERE x.attempt_id = p_attempt FOR UPDATE;
    END IF;
    IF p_offer IS NOT NULL THEN
        SELECT to_jsonb(x)::text INTO offer_row FROM offers x WHERE x.id = p_offer FOR UPDATE;
    END IF;
    IF p_event_kind IS NOT NULL THEN
        SELECT to_jsonb(x)::text INTO event_row FROM events x
            WHERE x.attempt_id = p_attempt AND x.kind = p_event_kind;
    END IF;
    db_now := (floor(extract(epoch FROM clock_timestamp()) * 1000))::bigint + p_offset;
    IF p_principal IS NOT NULL THEN
        SELECT w.disabled_at, w.revoked_at INTO worker_disabled_at, worker_revoked_at
            FROM workers w WHERE w.id = p_principal;
        SELECT c.worker, c.issued_at, c.not_after, c.revoked_at
            INTO cert_worker, cert_issued_at, cert_not_after, cert_revoked_at
            FROM certificates c WHERE c.serial = p_serial;
    END IF;
END
$$;

-- It runs with its caller's privileges: the runtime role's, which already reads and
-- locks every table it names.
REVOKE ALL ON FUNCTION ql_load_fenced(TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, TEXT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ql_load_fenced(TEXT, TEXT, TEXT, TEXT, TEXT, BIGINT, TEXT, TEXT) TO ql_runtime;
