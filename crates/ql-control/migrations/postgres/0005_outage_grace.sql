-- Outage grace: when a replica last swept, in DB time. A sweep that finds it older than
-- the outage threshold gives the absence back to live leases and sessions first. Every
-- sweep locks this one row first (and nothing else ever does), so two replicas starting
-- together give the grace once.
CREATE TABLE authority (
    id       INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    alive_at BIGINT  NOT NULL
);
REVOKE ALL ON authority FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON authority TO ql_runtime;
