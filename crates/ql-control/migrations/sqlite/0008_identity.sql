-- A worker identity's life: the operator may disable a worker (reversible) or revoke it
-- (every certificate issued until then, recorded or not), and every certificate the
-- authority issues is recorded by serial number so one can be revoked alone. A request
-- is admitted only while its certificate and its worker are neither.
ALTER TABLE workers ADD COLUMN disabled_at INTEGER;
ALTER TABLE workers ADD COLUMN revoked_at INTEGER;
CREATE TABLE certificates (
    serial     TEXT    NOT NULL PRIMARY KEY,
    worker     TEXT    NOT NULL,
    issued_at  INTEGER NOT NULL,
    not_after  INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE INDEX certificates_worker ON certificates (worker, not_after);
-- One-time enrolment tokens, by digest only: an agent that holds one may have a
-- certificate issued for its own key, once, before the token expires.
CREATE TABLE enrolments (
    token_digest TEXT    NOT NULL PRIMARY KEY,
    worker       TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    used_at      INTEGER,
    serial       TEXT
);
CREATE INDEX enrolments_expiry ON enrolments (expires_at);
