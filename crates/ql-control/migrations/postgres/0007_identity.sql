-- A worker identity's life: the operator may disable a worker (reversible) or revoke it
-- (every certificate issued until then, recorded or not), and every certificate the
-- authority issues is recorded by serial number so one can be revoked alone. A request
-- is admitted only while its certificate and its worker are neither: the worker-ingress
-- role reads both before it records the admission.
ALTER TABLE workers ADD COLUMN disabled_at BIGINT;
ALTER TABLE workers ADD COLUMN revoked_at BIGINT;
CREATE TABLE certificates (
    serial     TEXT    NOT NULL PRIMARY KEY,
    worker     TEXT    NOT NULL,
    issued_at  BIGINT  NOT NULL,
    not_after  BIGINT  NOT NULL,
    revoked_at BIGINT
);
CREATE INDEX certificates_worker ON certificates (worker, not_after);
REVOKE ALL ON certificates FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON certificates TO ql_runtime;
GRANT SELECT ON certificates TO ql_worker_ingress;
GRANT SELECT (id, disabled_at, revoked_at) ON workers TO ql_worker_ingress;
-- One-time enrolment tokens, by digest only: an agent that holds one may have a
-- certificate issued for its own key, once, before the token expires.
CREATE TABLE enrolments (
    token_digest TEXT    NOT NULL PRIMARY KEY,
    worker       TEXT    NOT NULL,
    created_at   BIGINT  NOT NULL,
    expires_at   BIGINT  NOT NULL,
    used_at      BIGINT,
    serial       TEXT
);
CREATE INDEX enrolments_expiry ON enrolments (expires_at);
REVOKE ALL ON enrolments FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON enrolments TO ql_runtime;
