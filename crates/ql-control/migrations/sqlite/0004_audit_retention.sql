-- Audit retention: the sweeper prunes the oldest audit records by age (this index) and by
-- count (the sequence). Records are still never rewritten.
CREATE INDEX audit_at ON audit (at);
