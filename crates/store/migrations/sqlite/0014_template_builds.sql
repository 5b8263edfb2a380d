-- Template builds (issue 21), sqlite flavour. Keep in step with the other
-- flavour: same tables, columns, names and indexes.
--
-- A build turns a Dockerfile into an account's template: queued, then
-- building on one host, then done (its snapshot named as the template) or
-- failed (error says why, naming the Dockerfile's line). `log` is what the
-- build printed, kept to its last 256 KiB. `cache_key` digests the base
-- and every instruction with the context files they read: a later build
-- with the same key reuses `snapshot_id` (if that snapshot still exists)
-- instead of running again, and is marked `cache_hit`. `host` is the host
-- whose process accepted the build: it holds the live log and runs it.
CREATE TABLE template_builds (
    id           TEXT    PRIMARY KEY,
    account_id   INTEGER NOT NULL REFERENCES accounts (id),
    name         TEXT    NOT NULL,
    status       TEXT    NOT NULL,
    error        TEXT,
    cache_key    TEXT,
    snapshot_id  TEXT,
    host         TEXT,
    cache_hit    BOOLEAN NOT NULL DEFAULT FALSE,
    log          TEXT    NOT NULL DEFAULT '',
    created_at   REAL NOT NULL,
    started_at   REAL,
    ended_at     REAL
);
CREATE INDEX template_builds_account ON template_builds (account_id, created_at);
CREATE INDEX template_builds_cache ON template_builds (account_id, cache_key);
