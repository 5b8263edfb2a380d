-- Hosts' roles' rights on sandboxes' event logs: postgres only (see
-- migrations/postgres/0019); an SQLite database has no roles.
SELECT 1;
