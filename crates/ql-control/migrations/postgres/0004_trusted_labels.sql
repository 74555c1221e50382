-- Labels an operator can trust. `workers` holds what the operator says of a worker
-- identity (its labels), whatever its agents declare; a run's `labels` must be among
-- them, and its new `agent_labels` among what the session declared. Runs queued before
-- this migration asked for declared labels: they keep asking for those.
CREATE TABLE workers (
    id         TEXT    NOT NULL PRIMARY KEY,
    labels     JSONB   NOT NULL CHECK (jsonb_typeof(labels) = 'object'),
    created_at BIGINT  NOT NULL,
    updated_at BIGINT  NOT NULL
);
REVOKE ALL ON workers FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON workers TO ql_runtime;
ALTER TABLE runs ADD COLUMN agent_labels JSONB NOT NULL DEFAULT '{}'
    CHECK (jsonb_typeof(agent_labels) = 'object');
-- The runs table has no append-only trigger: the owner may move the labels over.
UPDATE runs SET agent_labels = labels, labels = '{}' WHERE labels <> '{}';
