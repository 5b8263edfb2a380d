-- Durable volumes and their attachments, sqlite flavour. Keep in step with
-- the other flavour: same tables, columns, names and indexes.

-- One ext4 image on one host (the host agent owns the file,
-- <state>/volumes/<account_id>/<name>.ext4); it outlives sandboxes.
CREATE TABLE volumes (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id  INTEGER NOT NULL REFERENCES accounts (id),
    name        TEXT    NOT NULL,
    size_mb     INTEGER NOT NULL,
    -- The host whose disk holds the image: sandboxes using it run there.
    host        TEXT    NOT NULL,
    created_at  REAL    NOT NULL,
    UNIQUE (account_id, name)
);

-- A volume attached to a sandbox, recorded with the sandbox's admission. It
-- holds while the sandbox is live (status not 'deleted' or 'failed'): every
-- way a sandbox ends releases it without touching this table.
CREATE TABLE volume_attachments (
    volume_id   INTEGER NOT NULL REFERENCES volumes (id) ON DELETE CASCADE,
    sandbox_id  TEXT    NOT NULL REFERENCES sandboxes (id),
    read_only   BOOLEAN NOT NULL,
    PRIMARY KEY (volume_id, sandbox_id)
);
CREATE INDEX volume_attachments_sandbox ON volume_attachments (sandbox_id);
