-- Placement looks queued runs up by their declared-label requirement: one index probe
-- per subset of the polling session's labels, each in age order (the store's
-- `queued_for`), instead of a scan of every queued run's labels per poll.
CREATE INDEX runs_queue_fit ON runs (agent_labels, created_at, id) WHERE status = 'queued';
