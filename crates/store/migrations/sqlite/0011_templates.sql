-- An account's own templates (issue 21), sqlite flavour. Keep in step with the
-- other flavour: same tables, columns, names and indexes.
--
-- A template is a name for a snapshot the account holds: new sandboxes
-- restore from it. `base` is the first-party template its memory image
-- derives from (its size and kernel). The snapshot cannot be deleted while
-- a template names it.
CREATE TABLE templates (
    account_id   INTEGER NOT NULL REFERENCES accounts (id),
    name         TEXT    NOT NULL,
    snapshot_id  TEXT    NOT NULL REFERENCES snapshots (id),
    base         TEXT    NOT NULL,
    created_at   REAL NOT NULL,
    PRIMARY KEY (account_id, name)
);
CREATE INDEX templates_snapshot ON templates (snapshot_id);
