-- The certificates' pages (`workers certificates`, `/v1/certificates`) are read by worker,
-- then newest first: this index holds them in that order, so a page reads its own rows
-- from the cursor on, not every certificate of the workers after it.
CREATE INDEX IF NOT EXISTS certificates_page ON certificates (worker, issued_at DESC, serial DESC);
