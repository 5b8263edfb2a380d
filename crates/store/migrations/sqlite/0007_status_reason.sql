-- Why a sandbox ended up `failed` (e.g. "out of memory" when the kernel
-- killed its VM for memory), sqlite flavour. Keep in step with the other
-- flavour.
ALTER TABLE sandboxes ADD COLUMN status_reason TEXT;
