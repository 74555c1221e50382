-- A session an agent closed on a clean exit ends `closed`. SQLite cannot change a CHECK
-- constraint in place: the table is rebuilt (the documented procedure, run by the
-- migrator with foreign keys off and checked before the commit).
CREATE TABLE sessions_new (
    id            TEXT    NOT NULL PRIMARY KEY,
    worker        TEXT    NOT NULL,
    generation    INTEGER NOT NULL CHECK (generation >= 1),
    state         TEXT    NOT NULL CHECK (state IN ('online', 'draining', 'replaced', 'expired', 'closed')),
    capacity      INTEGER NOT NULL CHECK (capacity >= 0),
    labels        TEXT    NOT NULL CHECK (json_valid(labels)),
    agent_version TEXT    NOT NULL,
    arch          TEXT    NOT NULL,
    created_at    INTEGER NOT NULL,
    seen_at       INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL,
    UNIQUE (worker, generation)
);
INSERT INTO sessions_new (id, worker, generation, state, capacity, labels, agent_version, arch, created_at, seen_at,
                          expires_at)
    SELECT id, worker, generation, state, capacity, labels, agent_version, arch, created_at, seen_at, expires_at
    FROM sessions;
DROP TABLE sessions;
ALTER TABLE sessions_new RENAME TO sessions;
CREATE INDEX sessions_lapse ON sessions (state, expires_at);
