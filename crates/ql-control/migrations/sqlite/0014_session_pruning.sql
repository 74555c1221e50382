-- Ended sessions pruned: a worker holding one valid certificate could open sessions in a
-- loop and leave a row each, for ever. A session on which work was placed is marked
-- `offered` in the placement's transaction (an offer, an attempt, a lease may name it);
-- the sweeper removes ended sessions never offered anything that are more than a number
-- of generations behind their worker's newest. Sessions recorded before count as offered.
ALTER TABLE sessions ADD COLUMN offered INTEGER NOT NULL DEFAULT 1 CHECK (offered IN (0, 1));
CREATE INDEX sessions_prunable ON sessions (worker, generation)
    WHERE offered = 0 AND state IN ('closed', 'expired', 'replaced');
