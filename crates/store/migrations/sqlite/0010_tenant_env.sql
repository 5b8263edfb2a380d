-- Hosts' access to tenants' environments: postgres only (see
-- migrations/postgres/0010); an SQLite database has no roles to confine.
SELECT 1;
