-- The size of the VM a snapshot restores (issue 21), sqlite flavour. Keep in
-- step with the other flavour.
--
-- Recorded so that any host of a fleet shows a template's size, not only
-- the host whose disk holds its snapshot. NULL for snapshots from before.
ALTER TABLE snapshots ADD COLUMN vcpus INTEGER;
ALTER TABLE snapshots ADD COLUMN memory_mib INTEGER;
