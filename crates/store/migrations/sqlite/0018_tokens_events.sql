-- Users' own tokens and sandboxes' event logs (issue 23), sqlite flavour.
-- Keep in step with the other flavour: same tables, columns, names and
-- indexes.
--
-- A token's `prefix` is its first characters (`sk_` and 8 more), shown in
-- lists and used to revoke it; tokens from before this migration have none
-- and are listed by the first 12 characters of their hash instead. `label`
-- is the user's name for it; `expires_at` (epoch seconds) ends it.
ALTER TABLE tokens ADD COLUMN prefix TEXT;
ALTER TABLE tokens ADD COLUMN label TEXT NOT NULL DEFAULT '';
ALTER TABLE tokens ADD COLUMN expires_at REAL;

-- A sandbox's lifecycle log (`GET /v1/sandboxes/{id}/events`): what
-- happened to it, in order; the newest 1000 rows of a sandbox are kept.
-- No foreign key: a host writes its own sandboxes' events in batches and a
-- front may delete a gone host's sandbox rows.
CREATE TABLE sandbox_events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id  TEXT    NOT NULL,
    at          REAL    NOT NULL,
    type        TEXT    NOT NULL,
    payload     TEXT    NOT NULL
);
CREATE INDEX sandbox_events_sandbox ON sandbox_events (sandbox_id, id);
