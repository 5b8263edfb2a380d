-- An operator's `shoal snapshot rm ID`: when it was asked. The snapshot's
-- files are on its host, so the host removes them (and then the record)
-- at its next lifecycle tick; meanwhile its account no longer sees it.
ALTER TABLE snapshots ADD COLUMN removal_requested_at DOUBLE PRECISION;
