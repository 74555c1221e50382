-- Labels an operator can trust. `workers` holds what the operator says of a worker
-- identity (its labels), whatever its agents declare; a run's `labels` must be among
-- them, and its new `agent_labels` among what the session declared. Runs queued before
-- this migration asked for declared labels: they keep asking for those.
CREATE TABLE workers (
    id         TEXT    NOT NULL PRIMARY KEY,
    labels     TEXT    NOT NULL CHECK (json_valid(labels)),
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
ALTER TABLE runs ADD COLUMN agent_labels TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(agent_labels));
UPDATE runs SET agent_labels = labels, labels = '{}' WHERE labels <> '{}';
