-- Apps: long-running services, each on a persistent sandbox of its own,
-- postgres flavour. Keep in step with the other flavour: same tables,
-- columns, names and indexes.
--
-- (Version 6: version 5 is another branch's; the migrator applies missing
-- versions in any order and does not need them contiguous.)

CREATE TABLE apps (
    id               TEXT    PRIMARY KEY,
    account_id       BIGINT  NOT NULL REFERENCES accounts (id),
    name             TEXT    NOT NULL,
    template         TEXT    NOT NULL,
    start_cmd        TEXT    NOT NULL,
    port             BIGINT  NOT NULL,
    -- JSON object of strings: the start command's environment.
    env              TEXT    NOT NULL DEFAULT '{}',
    -- No proxied request for this long: the sandbox is hibernated.
    idle_seconds     BIGINT  NOT NULL,
    -- deploying, running, hibernated, waking, waiting_capacity, failed, deleted
    status           TEXT    NOT NULL,
    sandbox_id       TEXT,
    -- The host whose control plane drives the app (its sandbox's host).
    host             TEXT,
    -- Refused attempts (capacity, quota) of the current deploy or wake.
    attempts         BIGINT  NOT NULL DEFAULT 0,
    next_attempt_at  DOUBLE PRECISION,
    last_error       TEXT,
    created_at       DOUBLE PRECISION NOT NULL,
    -- When status last changed.
    status_at        DOUBLE PRECISION NOT NULL,
    last_request_at  DOUBLE PRECISION,
    deleted_at       DOUBLE PRECISION
);
-- A name is taken while its app is not deleted.
CREATE UNIQUE INDEX apps_account_name ON apps (account_id, name) WHERE status <> 'deleted';
-- The reconciler's query: the apps a host drives.
CREATE INDEX apps_host_live ON apps (host) WHERE status NOT IN ('deleted', 'failed');
