-- A job's data path (issue 22), sqlite flavour. Keep in step with the other
-- flavour: same tables, columns, names and indexes.
--
-- `blobs`: content-addressed files of one account (a submit directory's
-- inputs, a task's results), stored as `blob_chunks` of at most 1 MiB.
-- A blob's row is written only once every chunk is in and its digest
-- checked; until then its chunks are kept under a staging name
-- (`staging:<unix seconds, 12 digits>:<random>`) that the digest replaces.
-- Blobs are per account: knowing a digest gives no access to another
-- account's bytes. `used_at` is the last job that named it.
CREATE TABLE blobs (
    account_id  INTEGER NOT NULL REFERENCES accounts (id),
    digest      TEXT    NOT NULL,
    size        INTEGER NOT NULL,
    created_at  REAL    NOT NULL,
    used_at     REAL    NOT NULL,
    PRIMARY KEY (account_id, digest)
);
CREATE INDEX blobs_used ON blobs (used_at);
CREATE TABLE blob_chunks (
    account_id  INTEGER NOT NULL,
    digest      TEXT    NOT NULL,
    seq         INTEGER NOT NULL,
    data        BLOB    NOT NULL,
    PRIMARY KEY (account_id, digest, seq)
);
-- What a running task printed, as it printed it: one row per flush
-- (about every half second), numbered in order across both streams, for
-- the attempt `epoch` (the cell's claim_epoch). A new attempt's first row
-- removes the earlier attempts'.
CREATE TABLE cell_output (
    sweep_id  TEXT    NOT NULL,
    idx       INTEGER NOT NULL,
    epoch     INTEGER NOT NULL,
    seq       INTEGER NOT NULL,
    stream    TEXT    NOT NULL,
    data      BLOB    NOT NULL,
    PRIMARY KEY (sweep_id, idx, epoch, seq)
);
-- The job's inputs (path, digest, size, mode) and the directories whose
-- new and changed files come back as blobs; NULL for a sweep without.
ALTER TABLE sweeps ADD COLUMN data_path TEXT;
-- `--hold` (until released) and `--begin` (not before; epoch seconds): a
-- sweep with either is created `held` and activated once neither holds it
-- and its dependencies are met.
ALTER TABLE sweeps ADD COLUMN user_hold BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE sweeps ADD COLUMN begin_at REAL;
-- How long a fork_from setup (a Slurm job's prelude) took, once it ran:
-- what every forked task did not have to run again.
ALTER TABLE sweeps ADD COLUMN prelude_seconds REAL;
-- What a task's process used (the guest agent's wait4 rusage): peak
-- resident KiB and CPU milliseconds, for sacct's MaxRSS and TotalCPU.
ALTER TABLE sweep_cells ADD COLUMN max_rss_kib INTEGER;
ALTER TABLE sweep_cells ADD COLUMN task_cpu_ms INTEGER;
