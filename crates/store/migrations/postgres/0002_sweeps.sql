-- Sweeps, PostgreSQL flavour. Keep in step with migrations/sqlite/0002_sweeps.sql:
-- same tables, columns, names and indexes; only the column types differ.
-- JSON is stored as TEXT. Times are unix epoch seconds as floating point.

-- One command run over many cells (POST /v1/sweeps).
CREATE TABLE sweeps (
    id               TEXT    PRIMARY KEY,
    account_id       BIGINT  NOT NULL REFERENCES accounts (id),
    name             TEXT    NOT NULL,
    template         TEXT    NOT NULL,
    command          TEXT    NOT NULL,
    -- JSON object of strings: the environment of every cell's command.
    env              TEXT    NOT NULL DEFAULT '{}',
    -- JSON array of strings: the cell values in order (copied to sweep_cells).
    cells            TEXT    NOT NULL,
    -- At most this many cells running at once; changed live.
    throttle         BIGINT  NOT NULL,
    timeout_seconds  BIGINT  NOT NULL,
    max_attempts     BIGINT  NOT NULL,
    -- JSON array of the paths to collect from each sandbox.
    collect          TEXT    NOT NULL DEFAULT '[]',
    -- JSON, or NULL: how cells fork from a set-up sandbox.
    fork_from        TEXT,
    -- active, cancelled or done.
    state            TEXT    NOT NULL,
    created_at       DOUBLE PRECISION NOT NULL,
    finished_at      DOUBLE PRECISION
);
CREATE INDEX sweeps_account_created ON sweeps (account_id, created_at);
-- Claiming from every sweep: the active ones.
CREATE INDEX sweeps_active ON sweeps (created_at) WHERE state = 'active';

-- One row per cell. claim_id and lease_expires_at are set exactly while the
-- cell is running; every write about an attempt names its claim_id (fencing).
CREATE TABLE sweep_cells (
    sweep_id         TEXT    NOT NULL REFERENCES sweeps (id) ON DELETE CASCADE,
    idx              BIGINT  NOT NULL,
    value            TEXT    NOT NULL,
    -- pending, running, succeeded, failed, timeout or cancelled.
    state            TEXT    NOT NULL DEFAULT 'pending',
    attempts         BIGINT  NOT NULL DEFAULT 0,
    claim_id         TEXT,
    -- Raised by every claim, never reset.
    claim_epoch      BIGINT  NOT NULL DEFAULT 0,
    lease_expires_at DOUBLE PRECISION,
    claimed_by       TEXT,
    started_at       DOUBLE PRECISION,
    finished_at      DOUBLE PRECISION,
    -- The last finished attempt.
    exit_code        BIGINT,
    elapsed_ms       BIGINT,
    stdout_tail      TEXT,
    stderr_tail      TEXT,
    collected        TEXT,
    sandbox_id       TEXT,
    error            TEXT,
    -- Summed over every attempt.
    cpu_seconds      DOUBLE PRECISION NOT NULL DEFAULT 0,
    gib_seconds      DOUBLE PRECISION NOT NULL DEFAULT 0,
    cost_usd         DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (sweep_id, idx)
);
-- Claiming: a sweep's pending cells in order.
CREATE INDEX sweep_cells_pending ON sweep_cells (sweep_id, idx) WHERE state = 'pending';
-- The running cells: the throttle's count, the fenced writes of a claim
-- (on idx, so that a planner preferring this index to the primary key still
-- finds one row), and lease expiry.
CREATE INDEX sweep_cells_running ON sweep_cells (sweep_id, idx) WHERE state = 'running';
