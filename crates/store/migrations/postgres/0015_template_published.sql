-- Templates an operator publishes to every account (issue 21), postgres
-- flavour. Keep in step with the other flavour.
--
-- A published template stays its account's (only it may change or delete
-- it); every other account may create sandboxes from it by name, after its
-- own templates of that name. One published template per name.
ALTER TABLE templates ADD COLUMN published BOOLEAN NOT NULL DEFAULT FALSE;
CREATE UNIQUE INDEX templates_published_name ON templates (name) WHERE published;
