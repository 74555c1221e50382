-- Run retention: the sweeper removes ended runs older than `run_retention_ms`, with their
-- attempts, offers, leases, events, live-log chunks and webhook deliveries, oldest first
-- (their stored logs first, from the artifact store). This index holds the ended runs by
-- when they ended, so finding the oldest reads only them.
CREATE INDEX IF NOT EXISTS runs_ended ON runs (finished_at) WHERE status IN ('succeeded', 'failed', 'cancelled', 'timed_out');
