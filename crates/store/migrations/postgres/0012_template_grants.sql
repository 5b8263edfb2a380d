-- Hosts' roles and templates, postgres only (SQLite's 0012 does nothing):
-- any agent reads and deletes an account's templates, and the host that
-- holds a snapshot names it as a template. Not confined to a host: a
-- template is an account's, like a sweep (see 0009).
GRANT SELECT, INSERT, DELETE ON templates TO shoal_hosts;
