-- Webhooks: a run's delivery of its end, written with the run, claimed and retried by
-- the notifier of any replica; and the webhook a schedule gives each of its runs.
CREATE TABLE deliveries (
    run_id      TEXT    NOT NULL PRIMARY KEY,
    url         TEXT    NOT NULL,
    notify_on   TEXT    NOT NULL CHECK (notify_on IN ('all', 'failure')),
    state       TEXT    NOT NULL CHECK (state IN ('waiting', 'pending', 'delivered', 'failed', 'skipped')),
    attempts    INTEGER NOT NULL CHECK (attempts >= 0),
    next_at     INTEGER NOT NULL,
    last_error  TEXT,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL
);
CREATE INDEX deliveries_due ON deliveries (next_at) WHERE state IN ('waiting', 'pending');
ALTER TABLE schedules ADD COLUMN notify_url TEXT;
ALTER TABLE schedules ADD COLUMN notify_on TEXT CHECK (notify_on IN ('all', 'failure'));
