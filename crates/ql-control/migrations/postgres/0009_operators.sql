-- Operator credentials for the operator API: a bearer token known only by its SHA-256,
-- with the role it grants (read: look; admin: also change).
CREATE TABLE operators (
    name         TEXT    NOT NULL PRIMARY KEY,
    role         TEXT    NOT NULL CHECK (role IN ('read', 'admin')),
    token_digest TEXT    NOT NULL UNIQUE,
    created_at   BIGINT  NOT NULL
);
REVOKE ALL ON operators FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON operators TO ql_runtime;
