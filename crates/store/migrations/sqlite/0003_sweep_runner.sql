-- What the sweep runner and the Slurm bridge need, sqlite flavour. Keep in
-- step with migrations/postgres/0003_sweep_runner.sql: same tables, columns,
-- names and indexes; only the column types differ.

-- Counters handed out in blocks. 'job_id': every sweep takes as many job ids
-- as it has cells (at least one), by one UPDATE of this row inside the
-- transaction that inserts the sweep, so ids are unique and increasing even
-- with several control planes on one database.
CREATE TABLE counters (
    name             TEXT    PRIMARY KEY,
    next_value       INTEGER NOT NULL
);

-- Slurm's spelling of the sweep: its first job id (the array's job id).
ALTER TABLE sweeps ADD COLUMN job_id INTEGER;
-- Why the sweep is where it is (held: 'Dependency'; cancelled because a
-- dependency failed: 'DependencyNeverSatisfied'), or NULL.
ALTER TABLE sweeps ADD COLUMN reason TEXT;
-- Working directory of every cell's command, or NULL for the default.
ALTER TABLE sweeps ADD COLUMN workdir TEXT;
-- JSON object: path -> base64 content written into each sandbox.
ALTER TABLE sweeps ADD COLUMN files TEXT NOT NULL DEFAULT '{}';
-- JSON array of the sweep ids of after_ok, as sweep_deps holds them (kept
-- here too so that a sweep reads back in one row).
ALTER TABLE sweeps ADD COLUMN after_ok TEXT NOT NULL DEFAULT '[]';
-- JSON, or NULL: what the Slurm bridge said of the job (opaque to the store).
ALTER TABLE sweeps ADD COLUMN slurm TEXT;
-- When the first cell was claimed.
ALTER TABLE sweeps ADD COLUMN started_at REAL;

-- Existing sweeps get job ids in creation order, blocks of cells + 1.
UPDATE sweeps SET job_id = 1000
    + (SELECT COUNT(*) FROM sweep_cells c JOIN sweeps p ON p.id = c.sweep_id
       WHERE p.created_at < sweeps.created_at OR (p.created_at = sweeps.created_at AND p.id < sweeps.id))
    + (SELECT COUNT(*) FROM sweeps p
       WHERE p.created_at < sweeps.created_at OR (p.created_at = sweeps.created_at AND p.id < sweeps.id));
INSERT INTO counters (name, next_value)
    VALUES ('job_id', 1000 + (SELECT COUNT(*) FROM sweep_cells) + (SELECT COUNT(*) FROM sweeps));
CREATE UNIQUE INDEX sweeps_job_id ON sweeps (job_id);
-- The runner's pass over held sweeps.
CREATE INDEX sweeps_held ON sweeps (created_at) WHERE state = 'held';

-- after_ok: the sweep stays held until every sweep it names is done with
-- every cell succeeded.
CREATE TABLE sweep_deps (
    sweep_id         TEXT    NOT NULL REFERENCES sweeps (id) ON DELETE CASCADE,
    after_id         TEXT    NOT NULL REFERENCES sweeps (id),
    PRIMARY KEY (sweep_id, after_id)
);

-- The signal that ended the last attempt's command, if one did.
ALTER TABLE sweep_cells ADD COLUMN signal INTEGER;
-- stdout_tail / stderr_tail hold at most 1 MiB each (the end); true when
-- either was cut.
ALTER TABLE sweep_cells ADD COLUMN output_truncated BOOLEAN NOT NULL DEFAULT FALSE;
-- JSON object: the last attempt's phases in milliseconds (create, exec,
-- run, collect, delete).
ALTER TABLE sweep_cells ADD COLUMN timings TEXT;
-- Set by cancelling this cell alone; the runner holding it learns it when
-- renewing its lease. Cleared by a requeue.
ALTER TABLE sweep_cells ADD COLUMN cancel_requested BOOLEAN NOT NULL DEFAULT FALSE;
-- Releasing a dead runner's claims at its restart.
CREATE INDEX sweep_cells_claimed_by ON sweep_cells (claimed_by) WHERE state = 'running';
