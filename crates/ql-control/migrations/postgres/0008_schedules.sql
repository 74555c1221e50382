-- Schedules: a run submitted at each time a cron expression names. A fire is one row per
-- (schedule, fire time), written in the transaction of its run, so no time fires twice on
-- any number of replicas.
CREATE TABLE schedules (
    name            TEXT    NOT NULL PRIMARY KEY,
    cron            TEXT    NOT NULL,
    tz              TEXT    NOT NULL,
    random_delay_ms BIGINT  NOT NULL CHECK (random_delay_ms >= 0),
    overlap         TEXT    NOT NULL CHECK (overlap IN ('skip', 'queue', 'allow')),
    catch_up        TEXT    NOT NULL CHECK (catch_up IN ('none', 'once')),
    project         TEXT    NOT NULL,
    spec            TEXT    NOT NULL CHECK (spec::jsonb IS NOT NULL),
    labels          JSONB   NOT NULL CHECK (jsonb_typeof(labels) = 'object'),
    agent_labels    JSONB   NOT NULL CHECK (jsonb_typeof(agent_labels) = 'object'),
    retry_budget    BIGINT  NOT NULL CHECK (retry_budget >= 0),
    paused          BIGINT  NOT NULL CHECK (paused IN (0, 1)),
    next_fire_at    BIGINT  NOT NULL,
    due_at          BIGINT  NOT NULL,
    last_run_id     TEXT,
    created_at      BIGINT  NOT NULL,
    updated_at      BIGINT  NOT NULL
);
CREATE INDEX schedules_due ON schedules (due_at) WHERE paused = 0;
REVOKE ALL ON schedules FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON schedules TO ql_runtime;
CREATE TABLE fires (
    schedule TEXT    NOT NULL,
    fire_at  BIGINT  NOT NULL,
    outcome  TEXT    NOT NULL CHECK (outcome IN ('queued', 'skipped', 'missed')),
    run_id   TEXT,
    at       BIGINT  NOT NULL,
    PRIMARY KEY (schedule, fire_at)
);
REVOKE ALL ON fires FROM PUBLIC;
GRANT SELECT, INSERT ON fires TO ql_runtime;
ALTER TABLE runs ADD COLUMN schedule TEXT;
CREATE INDEX runs_schedule ON runs (schedule, created_at) WHERE schedule IS NOT NULL;
