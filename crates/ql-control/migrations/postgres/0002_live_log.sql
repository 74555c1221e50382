-- The live log (PROTOCOL §13): how much of an attempt's log is acknowledged, whether it
-- was sealed into the artifact, and the acknowledged chunks, whose bytes live in the
-- artifact store under (attempt, offset, digest). Chunks are history: the runtime role
-- may add them, never change or remove them.
ALTER TABLE attempts ADD COLUMN log_acked BIGINT NOT NULL DEFAULT 0 CHECK (log_acked >= 0);
ALTER TABLE attempts ADD COLUMN log_sealed BIGINT NOT NULL DEFAULT 0 CHECK (log_sealed IN (0, 1));

CREATE TABLE log_chunks (
    attempt_id  TEXT   NOT NULL REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED,
    byte_offset BIGINT NOT NULL CHECK (byte_offset >= 0),
    length      BIGINT NOT NULL CHECK (length BETWEEN 1 AND 262144),
    sha256      TEXT   NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    PRIMARY KEY (attempt_id, byte_offset)
);
REVOKE ALL ON log_chunks FROM PUBLIC;
GRANT SELECT, INSERT ON log_chunks TO ql_runtime;
CREATE TRIGGER log_chunks_append_only BEFORE UPDATE OR DELETE ON log_chunks
    FOR EACH ROW EXECUTE FUNCTION append_only();
