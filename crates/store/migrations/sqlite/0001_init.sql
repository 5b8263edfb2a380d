-- Shoal control-plane schema, SQLite flavour. Keep in step with
-- migrations/postgres/0001_init.sql: same tables, columns, names and indexes;
-- only the column types differ (INTEGER/REAL here, BIGINT/DOUBLE PRECISION there).
-- Times are unix epoch seconds as floating point.

CREATE TABLE accounts (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT    NOT NULL UNIQUE,
    tier        TEXT    NOT NULL,
    created_at  REAL    NOT NULL
);

-- Only the SHA-256 (hex) of a token is stored, never the token.
CREATE TABLE tokens (
    hash        TEXT    PRIMARY KEY,
    account_id  INTEGER NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    created_at  REAL    NOT NULL
);
CREATE INDEX tokens_account ON tokens (account_id);

CREATE TABLE sandboxes (
    id                   TEXT    PRIMARY KEY,
    account_id           INTEGER NOT NULL REFERENCES accounts (id),
    template             TEXT    NOT NULL,
    cpu                  INTEGER NOT NULL,
    memory_mb            INTEGER NOT NULL,
    metadata             TEXT    NOT NULL DEFAULT '{}',
    status               TEXT    NOT NULL,
    -- The host the sandbox runs on (room for multi-host placement).
    host                 TEXT,
    guest_ip             TEXT,
    ttl_seconds          INTEGER NOT NULL,
    persistent           BOOLEAN NOT NULL DEFAULT FALSE,
    max_lifetime_seconds INTEGER,
    from_snapshot        TEXT,
    parent_id            TEXT,
    tree_id              TEXT,
    created_at           REAL    NOT NULL,
    last_activity_at     REAL    NOT NULL,
    running_execs        INTEGER NOT NULL DEFAULT 0,
    boot_ms              REAL,
    boot_mode            TEXT,
    deleted_at           REAL
);
-- Hourly create quota: creates of one account since a time.
CREATE INDEX sandboxes_account_created ON sandboxes (account_id, created_at);
-- Concurrency quota, listing and reaping: the live sandboxes.
CREATE INDEX sandboxes_live ON sandboxes (account_id) WHERE status NOT IN ('deleted', 'failed');

-- One row per metering interval of one sandbox.
CREATE TABLE usage_samples (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id   TEXT    NOT NULL REFERENCES sandboxes (id),
    at           REAL    NOT NULL,
    cpu_seconds  REAL    NOT NULL,
    gib_seconds  REAL    NOT NULL,
    interval_s   REAL    NOT NULL
);
CREATE INDEX usage_samples_sandbox_at ON usage_samples (sandbox_id, at);

CREATE TABLE snapshots (
    id          TEXT    PRIMARY KEY,
    account_id  INTEGER NOT NULL REFERENCES accounts (id),
    sandbox_id  TEXT,
    template    TEXT    NOT NULL,
    size_bytes  INTEGER,
    host        TEXT,
    created_at  REAL    NOT NULL
);
CREATE INDEX snapshots_account_created ON snapshots (account_id, created_at);
