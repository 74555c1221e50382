-- A session an agent closed on a clean exit ends `closed`.
ALTER TABLE sessions DROP CONSTRAINT sessions_state_check;
ALTER TABLE sessions ADD CONSTRAINT sessions_state_check
    CHECK (state IN ('online', 'draining', 'replaced', 'expired', 'closed'));
