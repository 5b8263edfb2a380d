-- Hosts' roles' rights on templates: postgres only (see
-- migrations/postgres/0012); an SQLite database has no roles.
SELECT 1;
