-- Each host's own identity, postgres flavour. Keep in step with the other
-- flavour: same tables, columns, names and indexes.

-- One-time tokens an operator issues (`shoal host join-token`); an agent
-- spends one to join and gets a credential of its own. Only hashes stored.
CREATE TABLE join_tokens (
    hash           TEXT    PRIMARY KEY,
    created_at     DOUBLE PRECISION NOT NULL,
    expires_at     DOUBLE PRECISION NOT NULL,
    -- The host that spent it, and when.
    used_by        TEXT,
    used_at        DOUBLE PRECISION
);

-- The credential of a joined host: every heartbeat and config read is made
-- with it, and it speaks only for its own host id.
CREATE TABLE host_credentials (
    host_id        TEXT    PRIMARY KEY,
    secret_hash    TEXT    NOT NULL UNIQUE,
    joined_at      DOUBLE PRECISION NOT NULL,
    -- Set by `shoal host revoke`: the credential no longer authenticates.
    revoked_at     DOUBLE PRECISION
);
