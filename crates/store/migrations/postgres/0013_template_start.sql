-- What an account's template starts before its capture, postgres flavour. Keep
-- in step with the other flavour.
--
-- The command is started (detached) in the sandbox being named as the
-- template, and the ready command run until it succeeds, before the
-- capture: every sandbox restored from the template has the process
-- running already. Kept to show them.
ALTER TABLE templates ADD COLUMN start_cmd TEXT;
ALTER TABLE templates ADD COLUMN ready_cmd TEXT;
