-- Hosts' database roles: postgres only (see migrations/postgres/0009). An
-- SQLite database serves the one host that opens it, so there is nothing
-- to confine; the version exists so that both flavours count the same.
SELECT 1;
