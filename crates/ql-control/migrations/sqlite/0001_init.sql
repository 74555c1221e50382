-- QingLong Edge control plane, SQLite schema version 1.
--
-- Columns mirror the structs of `src/model.rs`, one column per field (nested lease and
-- claim facts are flattened with a prefix). Times are INTEGER milliseconds of DB time;
-- ids are TEXT; the execution spec, labels and artifact receipts are JSON TEXT. Token
-- columns hold lowercase hex SHA-256 digests: no column ever holds a raw token.
--
-- Foreign keys are DEFERRABLE INITIALLY DEFERRED because a decision writes rows that
-- point at each other (a run's current attempt, an attempt's offer, the offer's attempt)
-- in one transaction; what must hold is the committed state, not each statement.
-- CHECK constraints keep every status column inside its known values, and the unique
-- index on events makes "no event type twice per attempt" a fact of the database.

CREATE TABLE sessions (
    id            TEXT    NOT NULL PRIMARY KEY,
    worker        TEXT    NOT NULL,
    generation    INTEGER NOT NULL CHECK (generation >= 1),
    state         TEXT    NOT NULL CHECK (state IN ('online', 'draining', 'replaced', 'expired')),
    capacity      INTEGER NOT NULL CHECK (capacity >= 0),
    labels        TEXT    NOT NULL CHECK (json_valid(labels)),
    agent_version TEXT    NOT NULL,
    arch          TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    seen_at       INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL,
    UNIQUE (worker, generation)
);
CREATE INDEX sessions_lapse ON sessions (state, expires_at);

CREATE TABLE runs (
    id                 TEXT    NOT NULL PRIMARY KEY,
    project            TEXT    NOT NULL,
    spec               TEXT    NOT NULL CHECK (json_valid(spec)),
    labels             TEXT    NOT NULL CHECK (json_valid(labels)),
    status             TEXT    NOT NULL CHECK (status IN
                           ('queued', 'dispatching', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out')),
    stop               TEXT    CHECK (stop IN ('cancel', 'timeout')),
    retry_budget       INTEGER NOT NULL CHECK (retry_budget >= 0),
    retries_used       INTEGER NOT NULL CHECK (retries_used >= 0),
    attempts           INTEGER NOT NULL CHECK (attempts >= 0),
    lease_generations  INTEGER NOT NULL CHECK (lease_generations >= 0),
    current_attempt_id TEXT    REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    deadline_at        INTEGER,
    created_at         INTEGER NOT NULL,
    started_at         INTEGER,
    finished_at        INTEGER,
    error_code         TEXT,
    summary            TEXT
);
CREATE INDEX runs_queue ON runs (status, created_at, id);
CREATE INDEX runs_deadline ON runs (deadline_at) WHERE deadline_at IS NOT NULL;

CREATE TABLE attempts (
    id                       TEXT    NOT NULL PRIMARY KEY,
    run_id                   TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    number                   INTEGER NOT NULL CHECK (number >= 1),
    executor_type            TEXT    NOT NULL,
    status                   TEXT    NOT NULL CHECK (status IN
                                 ('offered', 'claimed', 'starting', 'running',
                                  'succeeded', 'failed', 'cancelled', 'timed_out', 'lost')),
    offer_id                 TEXT    NOT NULL REFERENCES offers (id) DEFERRABLE INITIALLY DEFERRED,
    session_id               TEXT    NOT NULL REFERENCES sessions (id) DEFERRABLE INITIALLY DEFERRED,
    worker                   TEXT    NOT NULL,
    -- The projection of the attempt's lease: all NULL before the claim, all set after.
    lease_worker             TEXT,
    lease_session_id         TEXT,
    lease_session_generation INTEGER,
    lease_offer_id           TEXT,
    lease_generation         INTEGER,
    lease_token_digest       TEXT,
    lease_version            INTEGER,
    lease_expires_at         INTEGER,
    executor_handle          TEXT,
    log_artifact_id          TEXT,
    callback_sequence        INTEGER,
    callback_digest          TEXT,
    exit_code                INTEGER,
    signal                   INTEGER,
    worker_finished_at       INTEGER,
    artifact                 TEXT    CHECK (artifact IS NULL OR json_valid(artifact)),
    end_kind                 TEXT    CHECK (end_kind IN
                                 ('start_failure', 'completion', 'lease_lost', 'offer_expired', 'withdrawn')),
    created_at               INTEGER NOT NULL,
    started_at               INTEGER,
    ended_at                 INTEGER,
    error_code               TEXT,
    summary                  TEXT,
    UNIQUE (run_id, number),
    CHECK ((lease_worker IS NULL) = (lease_session_id IS NULL)
       AND (lease_worker IS NULL) = (lease_session_generation IS NULL)
       AND (lease_worker IS NULL) = (lease_offer_id IS NULL)
       AND (lease_worker IS NULL) = (lease_generation IS NULL)
       AND (lease_worker IS NULL) = (lease_token_digest IS NULL)
       AND (lease_worker IS NULL) = (lease_version IS NULL)
       AND (lease_worker IS NULL) = (lease_expires_at IS NULL)),
    CHECK (lease_token_digest IS NULL OR (length(lease_token_digest) = 64
                                          AND lease_token_digest NOT GLOB '*[^0-9a-f]*')),
    CHECK (callback_digest IS NULL OR (length(callback_digest) = 64
                                       AND callback_digest NOT GLOB '*[^0-9a-f]*'))
);
CREATE INDEX attempts_session ON attempts (session_id, status);

CREATE TABLE offers (
    id                     TEXT    NOT NULL PRIMARY KEY,
    run_id                 TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    attempt_id             TEXT    NOT NULL UNIQUE REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    worker                 TEXT    NOT NULL,
    session_id             TEXT    NOT NULL REFERENCES sessions (id) DEFERRABLE INITIALLY DEFERRED,
    session_generation     INTEGER NOT NULL,
    state                  TEXT    NOT NULL CHECK (state IN ('open', 'claimed', 'expired', 'withdrawn')),
    expires_at             INTEGER NOT NULL,
    -- What the claim answered: all NULL until claimed, all set after.
    claim_token_digest     TEXT    CHECK (claim_token_digest IS NULL OR (length(claim_token_digest) = 64
                                          AND claim_token_digest NOT GLOB '*[^0-9a-f]*')),
    claim_lease_generation INTEGER,
    claim_lease_expires_at INTEGER,
    claim_lease_ttl_ms     INTEGER,
    CHECK ((claim_token_digest IS NULL) = (claim_lease_generation IS NULL)
       AND (claim_token_digest IS NULL) = (claim_lease_expires_at IS NULL)
       AND (claim_token_digest IS NULL) = (claim_lease_ttl_ms IS NULL))
);
CREATE INDEX offers_session ON offers (session_id, state);
CREATE INDEX offers_lapse ON offers (state, expires_at);

CREATE TABLE leases (
    attempt_id         TEXT    NOT NULL PRIMARY KEY REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    run_id             TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    state              TEXT    NOT NULL CHECK (state IN ('leased', 'completed', 'expired')),
    worker             TEXT    NOT NULL,
    session_id         TEXT    NOT NULL,
    session_generation INTEGER NOT NULL,
    offer_id           TEXT    NOT NULL,
    lease_generation   INTEGER NOT NULL,
    token_digest       TEXT    NOT NULL CHECK (length(token_digest) = 64 AND token_digest NOT GLOB '*[^0-9a-f]*'),
    version            INTEGER NOT NULL CHECK (version >= 1),
    expires_at         INTEGER NOT NULL,
    ttl_ms             INTEGER NOT NULL,
    UNIQUE (run_id, lease_generation)
);
CREATE INDEX leases_lapse ON leases (state, expires_at);

-- `seq` is the commit order; `id` is the server-made event id.
CREATE TABLE events (
    seq         INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    id          TEXT    NOT NULL UNIQUE,
    run_id      TEXT    NOT NULL REFERENCES runs (id) DEFERRABLE INITIALLY DEFERRED,
    attempt_id  TEXT    REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    kind        TEXT    NOT NULL,
    from_status TEXT,
    to_status   TEXT,
    payload     TEXT    NOT NULL CHECK (json_valid(payload)),
    at          INTEGER NOT NULL
);
-- No event type is ever appended twice for the same attempt (or, for run-level events,
-- twice for the run).
CREATE UNIQUE INDEX events_once ON events (run_id, COALESCE(attempt_id, ''), kind);
CREATE INDEX events_attempt ON events (attempt_id, kind);

-- History is append-only: an event, once committed, is never rewritten.
CREATE TRIGGER events_append_only BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only');
END;

CREATE TABLE audit (
    seq       INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    at        INTEGER NOT NULL,
    principal TEXT,
    route     TEXT    NOT NULL,
    outcome   TEXT    NOT NULL
);
CREATE TRIGGER audit_append_only BEFORE UPDATE ON audit
BEGIN
    SELECT RAISE(ABORT, 'audit records are append-only');
END;
