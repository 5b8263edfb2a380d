-- The fleet's hosts and the placements made on them, sqlite flavour. Keep in
-- step with the other flavour: same tables, columns, names and indexes.

-- One row per host agent, written only on that agent's behalf (register and
-- heartbeat); the control planes read it to place sandboxes.
CREATE TABLE hosts (
    id             TEXT    PRIMARY KEY,
    -- Where the control plane reaches the agent.
    url            TEXT    NOT NULL,
    vcpus          INTEGER NOT NULL,
    -- Fraction of CPU time busy over the last heartbeat period.
    cpu_busy       REAL NOT NULL,
    memory_mib     INTEGER NOT NULL,
    available_mib  INTEGER NOT NULL,
    reserve_mib    INTEGER NOT NULL,
    sandboxes      INTEGER NOT NULL,
    max_sandboxes  INTEGER,
    pss_mib        INTEGER NOT NULL,
    draining       BOOLEAN NOT NULL DEFAULT FALSE,
    registered_at  REAL NOT NULL,
    heartbeat_at   REAL NOT NULL
);

-- A create placed on a host: counted against the host's last heartbeat
-- until the create is done and a heartbeat came after it.
CREATE TABLE placements (
    id             TEXT    PRIMARY KEY,
    host_id        TEXT    NOT NULL REFERENCES hosts (id) ON DELETE CASCADE,
    memory_mib     INTEGER NOT NULL,
    cpu_share      REAL NOT NULL,
    created_at     REAL NOT NULL,
    -- When the create finished (succeeded; a failed one is deleted).
    done_at        REAL
);
CREATE INDEX placements_host ON placements (host_id, done_at);
