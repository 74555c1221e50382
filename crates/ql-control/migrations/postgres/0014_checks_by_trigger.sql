-- PostgreSQL re-reads and evaluates every CHECK constraint of a table for every row an
-- UPDATE writes, whichever columns it sets: a lease renewal re-ran the attempt's and the
-- lease's digest patterns, every status change of a run re-parsed its whole spec as
-- JSON, every heartbeat re-checked its session's labels. On the tables every ACK writes
-- (sessions, runs, attempts, offers, leases) the rules move into one row trigger each,
-- compiled once per connection, that fires only for a statement setting a column a rule
-- is about, and runs a costly rule (a JSON parse, a pattern) only when its column is
-- inserted or changed. A renewal (lease version and expiry) and a heartbeat (seen and
-- expiry times) fire none; the two rules about the columns a renewal sets stay CHECK
-- constraints, small ones: the attempt's projection of its lease is whole or absent,
-- and a lease's version is at least 1.
--
-- Each function tests all its rules in one expression, and only when that fails tests
-- them one by one to name the broken one, so every rule is written twice: PL/pgSQL
-- prepares each expression once per transaction, every ACK is a transaction of its own,
-- and one IF per rule cost more than the CHECKs had.
--
-- A row that breaks a rule is refused as before: SQLSTATE 23514 (check_violation), with
-- the table and the name the CHECK had; text that must be JSON and is not fails its cast
-- (22P02), as it did inside the CHECK. Functions and the pattern operator are named in
-- pg_catalog, so no other schema on a caller's search path can stand in for them (the
-- runtime roles create nothing anywhere anyway). Like every trigger, these do not fire
-- for a superuser who sets session_replication_role to replica or disables them; the
-- roles ql-control runs as can do neither.

ALTER TABLE sessions
    DROP CONSTRAINT sessions_generation_check,
    DROP CONSTRAINT sessions_capacity_check,
    DROP CONSTRAINT sessions_labels_check,
    DROP CONSTRAINT sessions_state_check;

CREATE FUNCTION sessions_checked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One expression on the way of every row; the rule it broke is found only then.
    IF NOT (
        (NEW.generation >= 1)
        AND (NEW.capacity >= 0)
        AND (NEW.state IN ('online', 'draining', 'replaced', 'expired', 'closed'))
        AND (NOT (TG_OP = 'INSERT' OR NEW.labels IS DISTINCT FROM OLD.labels) OR pg_catalog.jsonb_typeof(NEW.labels)
            = 'object')
    ) THEN
        IF NOT (NEW.generation >= 1) THEN
            RAISE EXCEPTION 'sessions: generation must be at least 1'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'sessions_generation_check', TABLE = 'sessions';
        END IF;
        IF NOT (NEW.capacity >= 0) THEN
            RAISE EXCEPTION 'sessions: capacity must not be negative'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'sessions_capacity_check', TABLE = 'sessions';
        END IF;
        IF NOT (NEW.state IN ('online', 'draining', 'replaced', 'expired', 'closed')) THEN
            RAISE EXCEPTION 'sessions: unknown state'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'sessions_state_check', TABLE = 'sessions';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.labels IS DISTINCT FROM OLD.labels) AND NOT (pg_catalog.jsonb_typeof(NEW.labels)
            = 'object') THEN
            RAISE EXCEPTION 'sessions: labels must be a JSON object'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'sessions_labels_check', TABLE = 'sessions';
        END IF;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER sessions_checked
    BEFORE INSERT OR UPDATE OF generation, capacity, state, labels ON sessions
    FOR EACH ROW EXECUTE FUNCTION sessions_checked();

-- spec must be JSON: its cast refuses anything else (22P02), as inside the CHECK.
ALTER TABLE runs
    DROP CONSTRAINT runs_spec_check,
    DROP CONSTRAINT runs_labels_check,
    DROP CONSTRAINT runs_agent_labels_check,
    DROP CONSTRAINT runs_status_check,
    DROP CONSTRAINT runs_stop_check,
    DROP CONSTRAINT runs_retry_budget_check,
    DROP CONSTRAINT runs_retries_used_check,
    DROP CONSTRAINT runs_attempts_check,
    DROP CONSTRAINT runs_lease_generations_check;

CREATE FUNCTION runs_checked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One expression on the way of every row; the rule it broke is found only then.
    IF NOT (
        (NEW.status IN ('queued', 'dispatching', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out'))
        AND (NEW.stop IN ('cancel', 'timeout'))
        AND (NEW.retry_budget >= 0)
        AND (NEW.retries_used >= 0)
        AND (NEW.attempts >= 0)
        AND (NEW.lease_generations >= 0)
        AND (NOT (TG_OP = 'INSERT' OR NEW.labels IS DISTINCT FROM OLD.labels) OR pg_catalog.jsonb_typeof(NEW.labels)
            = 'object')
        AND (NOT (TG_OP = 'INSERT' OR NEW.agent_labels IS DISTINCT FROM OLD.agent_labels) OR
            pg_catalog.jsonb_typeof(NEW.agent_labels) = 'object')
    ) THEN
        IF NOT (NEW.status IN ('queued', 'dispatching', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out'))
            THEN
            RAISE EXCEPTION 'runs: unknown status'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_status_check', TABLE = 'runs';
        END IF;
        IF NOT (NEW.stop IN ('cancel', 'timeout')) THEN
            RAISE EXCEPTION 'runs: unknown stop'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_stop_check', TABLE = 'runs';
        END IF;
        IF NOT (NEW.retry_budget >= 0) THEN
            RAISE EXCEPTION 'runs: retry_budget is negative'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_retry_budget_check', TABLE = 'runs';
        END IF;
        IF NOT (NEW.retries_used >= 0) THEN
            RAISE EXCEPTION 'runs: retries_used is negative'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_retries_used_check', TABLE = 'runs';
        END IF;
        IF NOT (NEW.attempts >= 0) THEN
            RAISE EXCEPTION 'runs: attempts is negative'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_attempts_check', TABLE = 'runs';
        END IF;
        IF NOT (NEW.lease_generations >= 0) THEN
            RAISE EXCEPTION 'runs: lease_generations is negative'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_lease_generations_check', TABLE = 'runs';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.labels IS DISTINCT FROM OLD.labels) AND NOT (pg_catalog.jsonb_typeof(NEW.labels)
            = 'object') THEN
            RAISE EXCEPTION 'runs: labels must be a JSON object'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_labels_check', TABLE = 'runs';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.agent_labels IS DISTINCT FROM OLD.agent_labels) AND NOT
            (pg_catalog.jsonb_typeof(NEW.agent_labels) = 'object') THEN
            RAISE EXCEPTION 'runs: agent_labels must be a JSON object'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_agent_labels_check', TABLE = 'runs';
        END IF;
    END IF;
    IF TG_OP = 'INSERT' OR NEW.spec IS DISTINCT FROM OLD.spec THEN
        PERFORM NEW.spec::jsonb;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER runs_checked
    BEFORE INSERT OR UPDATE OF status, stop, retry_budget, retries_used, attempts,
    lease_generations, spec, labels, agent_labels ON runs
    FOR EACH ROW EXECUTE FUNCTION runs_checked();

-- attempts_check (the projection of the lease is whole or absent) stays a CHECK: a
-- renewal sets two of its columns.
ALTER TABLE attempts
    DROP CONSTRAINT attempts_number_check,
    DROP CONSTRAINT attempts_status_check,
    DROP CONSTRAINT attempts_end_kind_check,
    DROP CONSTRAINT attempts_lease_token_digest_check,
    DROP CONSTRAINT attempts_callback_digest_check,
    DROP CONSTRAINT attempts_artifact_check,
    DROP CONSTRAINT attempts_claimed_artifact_check,
    DROP CONSTRAINT attempts_log_acked_check,
    DROP CONSTRAINT attempts_log_sealed_check;

CREATE FUNCTION attempts_checked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One expression on the way of every row; the rule it broke is found only then.
    IF NOT (
        (NEW.number >= 1)
        AND (NEW.status IN ('offered', 'claimed', 'starting', 'running', 'succeeded', 'failed', 'cancelled',
            'timed_out', 'lost'))
        AND (NEW.end_kind IN ('start_failure', 'completion', 'lease_lost', 'offer_expired', 'withdrawn'))
        AND (NEW.log_acked >= 0)
        AND (NEW.log_sealed IN (0, 1))
        AND (NOT (TG_OP = 'INSERT' OR NEW.lease_token_digest IS DISTINCT FROM OLD.lease_token_digest) OR
            NEW.lease_token_digest OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$')
        AND (NOT (TG_OP = 'INSERT' OR NEW.callback_digest IS DISTINCT FROM OLD.callback_digest) OR
            NEW.callback_digest OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$')
    ) THEN
        IF NOT (NEW.number >= 1) THEN
            RAISE EXCEPTION 'attempts: number must be at least 1'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_number_check', TABLE = 'attempts';
        END IF;
        IF NOT (NEW.status IN ('offered', 'claimed', 'starting', 'running', 'succeeded', 'failed', 'cancelled',
            'timed_out', 'lost')) THEN
            RAISE EXCEPTION 'attempts: unknown status'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_status_check', TABLE = 'attempts';
        END IF;
        IF NOT (NEW.end_kind IN ('start_failure', 'completion', 'lease_lost', 'offer_expired', 'withdrawn')) THEN
            RAISE EXCEPTION 'attempts: unknown end kind'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_end_kind_check', TABLE = 'attempts';
        END IF;
        IF NOT (NEW.log_acked >= 0) THEN
            RAISE EXCEPTION 'attempts: log_acked is negative'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_log_acked_check', TABLE = 'attempts';
        END IF;
        IF NOT (NEW.log_sealed IN (0, 1)) THEN
            RAISE EXCEPTION 'attempts: log_sealed is neither 0 nor 1'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_log_sealed_check', TABLE = 'attempts';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.lease_token_digest IS DISTINCT FROM OLD.lease_token_digest) AND NOT
            (NEW.lease_token_digest OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$') THEN
            RAISE EXCEPTION 'attempts: lease_token_digest is not a digest'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_lease_token_digest_check', TABLE =
                    'attempts';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.callback_digest IS DISTINCT FROM OLD.callback_digest) AND NOT
            (NEW.callback_digest OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$') THEN
            RAISE EXCEPTION 'attempts: callback_digest is not a digest'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_callback_digest_check', TABLE =
                    'attempts';
        END IF;
    END IF;
    IF TG_OP = 'INSERT' OR NEW.artifact IS DISTINCT FROM OLD.artifact THEN
        PERFORM NEW.artifact::jsonb;
    END IF;
    IF TG_OP = 'INSERT' OR NEW.claimed_artifact IS DISTINCT FROM OLD.claimed_artifact THEN
        PERFORM NEW.claimed_artifact::jsonb;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER attempts_checked
    BEFORE INSERT OR UPDATE OF number, status, end_kind, log_acked, log_sealed, lease_token_digest,
    callback_digest, artifact, claimed_artifact ON attempts
    FOR EACH ROW EXECUTE FUNCTION attempts_checked();

ALTER TABLE offers
    DROP CONSTRAINT offers_check,
    DROP CONSTRAINT offers_state_check,
    DROP CONSTRAINT offers_claim_token_digest_check;

CREATE FUNCTION offers_checked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One expression on the way of every row; the rule it broke is found only then.
    IF NOT (
        (NEW.state IN ('open', 'claimed', 'expired', 'withdrawn'))
        AND (pg_catalog.num_nulls(NEW.claim_token_digest, NEW.claim_lease_generation, NEW.claim_lease_expires_at,
            NEW.claim_lease_ttl_ms) IN (0, 4))
        AND (NOT (TG_OP = 'INSERT' OR NEW.claim_token_digest IS DISTINCT FROM OLD.claim_token_digest) OR
            NEW.claim_token_digest OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$')
    ) THEN
        IF NOT (NEW.state IN ('open', 'claimed', 'expired', 'withdrawn')) THEN
            RAISE EXCEPTION 'offers: unknown state'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'offers_state_check', TABLE = 'offers';
        END IF;
        IF NOT (pg_catalog.num_nulls(NEW.claim_token_digest, NEW.claim_lease_generation, NEW.claim_lease_expires_at,
            NEW.claim_lease_ttl_ms) IN (0, 4)) THEN
            RAISE EXCEPTION 'offers: the claim is partly set'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'offers_check', TABLE = 'offers';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.claim_token_digest IS DISTINCT FROM OLD.claim_token_digest) AND NOT
            (NEW.claim_token_digest OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$') THEN
            RAISE EXCEPTION 'offers: claim_token_digest is not a digest'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'offers_claim_token_digest_check', TABLE = 'offers';
        END IF;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER offers_checked
    BEFORE INSERT OR UPDATE OF state, claim_token_digest, claim_lease_generation,
    claim_lease_expires_at, claim_lease_ttl_ms ON offers
    FOR EACH ROW EXECUTE FUNCTION offers_checked();

-- leases_version_check stays a CHECK: a renewal sets the version.
ALTER TABLE leases
    DROP CONSTRAINT leases_state_check,
    DROP CONSTRAINT leases_token_digest_check;

CREATE FUNCTION leases_checked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One expression on the way of every row; the rule it broke is found only then.
    IF NOT (
        (NEW.state IN ('leased', 'completed', 'expired'))
        AND (NOT (TG_OP = 'INSERT' OR NEW.token_digest IS DISTINCT FROM OLD.token_digest) OR NEW.token_digest
            OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$')
    ) THEN
        IF NOT (NEW.state IN ('leased', 'completed', 'expired')) THEN
            RAISE EXCEPTION 'leases: unknown state'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'leases_state_check', TABLE = 'leases';
        END IF;
        IF (TG_OP = 'INSERT' OR NEW.token_digest IS DISTINCT FROM OLD.token_digest) AND NOT (NEW.token_digest
            OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$') THEN
            RAISE EXCEPTION 'leases: token_digest is not a digest'
                USING ERRCODE = 'check_violation', CONSTRAINT = 'leases_token_digest_check', TABLE = 'leases';
        END IF;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER leases_checked
    BEFORE INSERT OR UPDATE OF state, token_digest ON leases
    FOR EACH ROW EXECUTE FUNCTION leases_checked();
