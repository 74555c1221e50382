-- Outage grace: when a replica last swept, in DB time. A sweep that finds it older than
-- the outage threshold gives the absence back to live leases and sessions first.
CREATE TABLE authority (
    id       INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    alive_at INTEGER NOT NULL
);
