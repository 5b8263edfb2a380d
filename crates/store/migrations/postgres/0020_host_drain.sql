-- An operator's drain (`shoal host drain NAME`): the host takes no new
-- sandboxes until `shoal host resume NAME`; its sandboxes run on until
-- they end. Kept apart from `draining`, which the host's own heartbeat
-- writes, so a heartbeat never undoes it.
ALTER TABLE hosts ADD COLUMN drained BOOLEAN NOT NULL DEFAULT FALSE;
