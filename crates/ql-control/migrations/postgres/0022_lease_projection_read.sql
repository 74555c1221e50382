-- An attempt's projection of its lease's version and expiry is read from the lease: a
-- renewal updates the lease row alone, and the store completes every attempt it reads
-- from its lease (store/postgres/projection.rs). From this version on, no write after an
-- attempt's claim touches these two columns. No data changes; the schema version moves
-- so that a replica of an earlier build, which would read them as the projection,
-- refuses this database when it starts (one still serving must be stopped first).
COMMENT ON COLUMN attempts.lease_version IS
    'not kept current (written at the claim): the attempt''s lease row holds its version';
COMMENT ON COLUMN attempts.lease_expires_at IS
    'not kept current (written at the claim): the attempt''s lease row holds its expiry';
