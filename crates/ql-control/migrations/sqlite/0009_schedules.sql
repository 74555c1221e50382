-- Schedules: a run submitted at each time a cron expression names. A fire is one row per
-- (schedule, fire time), written in the transaction of its run, so no time fires twice.
CREATE TABLE schedules (
    name            TEXT    NOT NULL PRIMARY KEY,
    cron            TEXT    NOT NULL,
    tz              TEXT    NOT NULL,
    random_delay_ms INTEGER NOT NULL CHECK (random_delay_ms >= 0),
    overlap         TEXT    NOT NULL CHECK (overlap IN ('skip', 'queue', 'allow')),
    catch_up        TEXT    NOT NULL CHECK (catch_up IN ('none', 'once')),
    project         TEXT    NOT NULL,
    spec            TEXT    NOT NULL CHECK (json_valid(spec)),
    labels          TEXT    NOT NULL CHECK (json_valid(labels)),
    agent_labels    TEXT    NOT NULL CHECK (json_valid(agent_labels)),
    retry_budget    INTEGER NOT NULL CHECK (retry_budget >= 0),
    paused          INTEGER NOT NULL CHECK (paused IN (0, 1)),
    next_fire_at    INTEGER NOT NULL,
    due_at          INTEGER NOT NULL,
    last_run_id     TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX schedules_due ON schedules (due_at) WHERE paused = 0;
CREATE TABLE fires (
    schedule TEXT    NOT NULL,
    fire_at  INTEGER NOT NULL,
    outcome  TEXT    NOT NULL CHECK (outcome IN ('queued', 'skipped', 'missed')),
    run_id   TEXT,
    at       INTEGER NOT NULL,
    PRIMARY KEY (schedule, fire_at)
);
ALTER TABLE runs ADD COLUMN schedule TEXT;
CREATE INDEX runs_schedule ON runs (schedule, created_at) WHERE schedule IS NOT NULL;
