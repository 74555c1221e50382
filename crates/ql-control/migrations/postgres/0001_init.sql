-- QingLong Edge control plane, PostgreSQL schema version 1.
--
-- Applied by the migration owner (the role that owns every object here), in one
-- transaction, by `ql-control migrate`. Columns mirror `src/model.rs` one for one, exactly
-- as the SQLite schema does: times are BIGINT milliseconds of DB time, ids are TEXT, the
-- execution spec, artifact receipts and event payloads are JSON text (kept byte for byte,
-- so a replay compares the very payload it stored), and labels are JSONB so placement can
-- match them with `@>`. Token columns hold lowercase hex SHA-256 digests only.
--
-- Foreign keys are DEFERRABLE INITIALLY DEFERRED because a decision writes rows that
-- point at each other in one transaction; what must hold is the committed state.
--
-- Three roles (ADR-0109 §5), created by the cluster administrator beforehand:
--   ql_owner           owns the schema and applies migrations (this file);
--   ql_runtime         performs the state transitions: SELECT, INSERT, UPDATE, never DELETE;
--   ql_worker_ingress  writes security audit records and nothing else: no privilege at all
--                      on runs, attempts, leases, offers, sessions or events, so a bug or a
--                      compromise in the transport cannot bypass the fenced transactions.

CREATE TABLE sessions (
    id            TEXT    NOT NULL PRIMARY KEY,
    worker        TEXT    NOT NULL,
    generation    BIGINT  NOT NULL CHECK (generation >= 1),
    state         TEXT    NOT NULL CHECK (state IN ('online', 'draining', 'replaced', 'expired')),
    capacity      BIGINT  NOT NULL CHECK (capacity >= 0),
    labels        JSONB   NOT NULL CHECK (jsonb_typeof(labels) = 'object'),
    agent_version TEXT    NOT NULL,
    arch          TEXT    NOT NULL,
    created_at    BIGINT  NOT NULL,
    seen_at       BIGINT  NOT NULL,
    expires_at    BIGINT  NOT NULL,
    UNIQUE (worker, generation)
);
CREATE INDEX sessions_lapse ON sessions (expires_at) WHERE state IN ('online', 'draining');

CREATE TABLE runs (
    id                 TEXT    NOT NULL PRIMARY KEY,
    project            TEXT    NOT NULL,
    spec               TEXT    NOT NULL CHECK (spec::jsonb IS NOT NULL),
    labels             JSONB   NOT NULL CHECK (jsonb_typeof(labels) = 'object'),
    status             TEXT    NOT NULL CHECK (status IN
                           ('queued', 'dispatching', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out')),
    stop               TEXT    CHECK (stop IN ('cancel', 'timeout')),
    retry_budget       BIGINT  NOT NULL CHECK (retry_budget >= 0),
    retries_used       BIGINT  NOT NULL CHECK (retries_used >= 0),
    attempts           BIGINT  NOT NULL CHECK (attempts >= 0),
    lease_generations  BIGINT  NOT NULL CHECK (lease_generations >= 0),
    current_attempt_id TEXT,
    deadline_at        BIGINT,
    created_at         BIGINT  NOT NULL,
    started_at         BIGINT,
    finished_at        BIGINT,
    error_code         TEXT,
    summary            TEXT
);
CREATE INDEX runs_queue ON runs (created_at, id) WHERE status = 'queued';
CREATE INDEX runs_deadline ON runs (deadline_at)
    WHERE deadline_at IS NOT NULL AND status IN ('queued', 'dispatching', 'running');
CREATE INDEX runs_recent ON runs (created_at DESC, id DESC);

CREATE TABLE attempts (
    id                       TEXT    NOT NULL PRIMARY KEY,
    run_id                   TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    number                   BIGINT  NOT NULL CHECK (number >= 1),
    executor_type            TEXT    NOT NULL,
    status                   TEXT    NOT NULL CHECK (status IN
                                 ('offered', 'claimed', 'starting', 'running',
                                  'succeeded', 'failed', 'cancelled', 'timed_out', 'lost')),
    offer_id                 TEXT    NOT NULL,
    session_id               TEXT    NOT NULL REFERENCES sessions (id) DEFERRABLE INITIALLY DEFERRED,
    worker                   TEXT    NOT NULL,
    -- The projection of the attempt's lease: all NULL before the claim, all set after.
    lease_worker             TEXT,
    lease_session_id         TEXT,
    lease_session_generation BIGINT,
    lease_offer_id           TEXT,
    lease_generation         BIGINT,
    lease_token_digest       TEXT    CHECK (lease_token_digest ~ '^[0-9a-f]{64}$'),
    lease_version            BIGINT,
    lease_expires_at         BIGINT,
    executor_handle          TEXT,
    log_artifact_id          TEXT,
    callback_sequence        BIGINT,
    callback_digest          TEXT    CHECK (callback_digest ~ '^[0-9a-f]{64}$'),
    exit_code                BIGINT,
    signal                   BIGINT,
    worker_finished_at       BIGINT,
    artifact                 TEXT    CHECK (artifact IS NULL OR artifact::jsonb IS NOT NULL),
    end_kind                 TEXT    CHECK (end_kind IN
                                 ('start_failure', 'completion', 'lease_lost', 'offer_expired', 'withdrawn')),
    created_at               BIGINT  NOT NULL,
    started_at               BIGINT,
    ended_at                 BIGINT,
    error_code               TEXT,
    summary                  TEXT,
    UNIQUE (run_id, number),
    CHECK (num_nulls(lease_worker, lease_session_id, lease_session_generation, lease_offer_id,
                     lease_generation, lease_token_digest, lease_version, lease_expires_at) IN (0, 8))
);
CREATE INDEX attempts_active ON attempts (session_id) WHERE status IN ('offered', 'claimed', 'starting', 'running');

ALTER TABLE runs ADD FOREIGN KEY (current_attempt_id) REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED;

CREATE TABLE offers (
    id                     TEXT    NOT NULL PRIMARY KEY,
    run_id                 TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    attempt_id             TEXT    NOT NULL UNIQUE REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    worker                 TEXT    NOT NULL,
    session_id             TEXT    NOT NULL REFERENCES sessions (id) DEFERRABLE INITIALLY DEFERRED,
    session_generation     BIGINT  NOT NULL,
    state                  TEXT    NOT NULL CHECK (state IN ('open', 'claimed', 'expired', 'withdrawn')),
    expires_at             BIGINT  NOT NULL,
    -- What the claim answered: all NULL until claimed, all set after.
    claim_token_digest     TEXT    CHECK (claim_token_digest ~ '^[0-9a-f]{64}$'),
    claim_lease_generation BIGINT,
    claim_lease_expires_at BIGINT,
    claim_lease_ttl_ms     BIGINT,
    CHECK (num_nulls(claim_token_digest, claim_lease_generation, claim_lease_expires_at, claim_lease_ttl_ms) IN (0, 4))
);
CREATE INDEX offers_open ON offers (session_id) WHERE state = 'open';
CREATE INDEX offers_lapse ON offers (expires_at) WHERE state = 'open';

ALTER TABLE attempts ADD FOREIGN KEY (offer_id) REFERENCES offers (id) DEFERRABLE INITIALLY DEFERRED;

CREATE TABLE leases (
    attempt_id         TEXT    NOT NULL PRIMARY KEY REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    run_id             TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    state              TEXT    NOT NULL CHECK (state IN ('leased', 'completed', 'expired')),
    worker             TEXT    NOT NULL,
    session_id         TEXT    NOT NULL,
    session_generation BIGINT  NOT NULL,
    offer_id           TEXT    NOT NULL,
    lease_generation   BIGINT  NOT NULL,
    token_digest       TEXT    NOT NULL CHECK (token_digest ~ '^[0-9a-f]{64}$'),
    version            BIGINT  NOT NULL CHECK (version >= 1),
    expires_at         BIGINT  NOT NULL,
    ttl_ms             BIGINT  NOT NULL,
    UNIQUE (run_id, lease_generation)
);
CREATE INDEX leases_run ON leases (run_id);
CREATE INDEX leases_lapse ON leases (expires_at) WHERE state = 'leased';

-- `seq` is the append order (per run it is the commit order: a run's events are only
-- appended under that run's row lock); `id` is the server-made event id.
CREATE TABLE events (
    seq         BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id          TEXT    NOT NULL UNIQUE,
    run_id      TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    attempt_id  TEXT    REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    kind        TEXT    NOT NULL,
    from_status TEXT,
    to_status   TEXT,
    payload     TEXT    NOT NULL CHECK (payload::jsonb IS NOT NULL),
    at          BIGINT  NOT NULL
);
-- No event type is ever appended twice for the same attempt (or, for run-level events,
-- twice for the run).
CREATE UNIQUE INDEX events_once ON events (run_id, COALESCE(attempt_id, ''), kind);
CREATE INDEX events_attempt ON events (attempt_id, kind);

CREATE TABLE audit (
    seq       BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        BIGINT  NOT NULL,
    principal TEXT,
    route     TEXT    NOT NULL,
    outcome   TEXT    NOT NULL
);

-- History is append-only, whoever asks: an event or audit record, once committed, is
-- never rewritten or removed (the grants below already refuse it to both runtime roles;
-- the trigger refuses it to the owner too).
CREATE FUNCTION append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';
END
$$;
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION append_only();
CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON audit
    FOR EACH ROW EXECUTE FUNCTION append_only();

-- Nobody but the owner gets anything by default.
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC;

-- The runtime role: state transitions, reads for operators; no DELETE anywhere, and
-- history only appended.
GRANT SELECT, INSERT, UPDATE ON sessions, runs, attempts, offers, leases TO ql_runtime;
GRANT SELECT, INSERT ON events, audit TO ql_runtime;

-- The worker-ingress role: it may append audit records, and that is all.
GRANT INSERT ON audit TO ql_worker_ingress;
