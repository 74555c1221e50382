-- The live log (PROTOCOL §13): how much of an attempt's log is acknowledged, whether it
-- was sealed into the artifact, and the acknowledged chunks, whose bytes live in the
-- artifact store under (attempt, offset, digest).
ALTER TABLE attempts ADD COLUMN log_acked INTEGER NOT NULL DEFAULT 0 CHECK (log_acked >= 0);
ALTER TABLE attempts ADD COLUMN log_sealed INTEGER NOT NULL DEFAULT 0 CHECK (log_sealed IN (0, 1));

CREATE TABLE log_chunks (
    attempt_id  TEXT    NOT NULL REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    byte_offset INTEGER NOT NULL CHECK (byte_offset >= 0),
    length      INTEGER NOT NULL CHECK (length BETWEEN 1 AND 262144),
    sha256      TEXT    NOT NULL,
    PRIMARY KEY (attempt_id, byte_offset)
);
