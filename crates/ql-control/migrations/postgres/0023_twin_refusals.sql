-- The workers' list counts each worker's session opens refused as a twin's over the last
-- hour. Found through `audit_at`, that read every audit record of the hour: at 10,000
-- idle agents as many as the default `audit_max_records` keeps, a million. Refusals are
-- few, and this index holds only them.
CREATE INDEX IF NOT EXISTS audit_twins ON audit (at, principal) WHERE route = 'session.open' AND outcome = 'session_conflict';
