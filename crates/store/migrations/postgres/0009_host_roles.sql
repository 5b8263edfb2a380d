-- Hosts reach the fleet's database as roles of their own, postgres only
-- (SQLite serves one host and has no roles: its 0009 does nothing).
--
-- The front makes a LOGIN role for each host that joins (see
-- `Store::ensure_host_role`), a member of `shoal_hosts`, and hands the host
-- a URL with that role instead of its own. What the group may do is set
-- here: nothing on credentials (tokens, join tokens, host credentials, the
-- role map), read the rest, and write sandbox, snapshot, volume, usage and
-- attachment rows only of its own host (row-level security; the table
-- owner, the fronts' role, is not subject to it).
--
-- Roles belong to the cluster, not the database, so the group is made once
-- per cluster; grants and policies are this database's.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'shoal_hosts') THEN
        CREATE ROLE shoal_hosts NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'the fleet database role % cannot create roles: grant it CREATEROLE (ALTER ROLE % CREATEROLE), which the front needs to give each host a role of its own', current_user, current_user;
END $$;

-- Which host each login role speaks for.
CREATE TABLE host_roles (
    role_name      TEXT    PRIMARY KEY,
    host_id        TEXT    NOT NULL UNIQUE
);

-- The host the session's role speaks for, or NULL (the front, an operator).
-- SECURITY DEFINER so the policies can read host_roles, which the hosts
-- cannot; session_user because inside the function current_user is its
-- owner.
CREATE FUNCTION shoal_current_host() RETURNS TEXT
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public
    AS $$ SELECT host_id FROM public.host_roles WHERE role_name = session_user $$;
REVOKE ALL ON FUNCTION shoal_current_host() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION shoal_current_host() TO shoal_hosts;

GRANT SELECT ON _sqlx_migrations, accounts, sandboxes, usage_samples, snapshots, sweeps,
    sweep_cells, sweep_deps, counters, hosts, placements, volumes, volume_attachments, apps
    TO shoal_hosts;
GRANT INSERT, UPDATE, DELETE ON sandboxes, usage_samples, snapshots, volumes,
    volume_attachments, sweeps, sweep_cells, sweep_deps TO shoal_hosts;
GRANT INSERT, UPDATE ON apps TO shoal_hosts;
GRANT UPDATE ON counters TO shoal_hosts;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO shoal_hosts;

ALTER TABLE sandboxes ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON sandboxes FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON sandboxes FOR INSERT TO shoal_hosts
    WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_update_own ON sandboxes FOR UPDATE TO shoal_hosts
    USING (host = shoal_current_host()) WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_delete_own ON sandboxes FOR DELETE TO shoal_hosts
    USING (host = shoal_current_host());

ALTER TABLE snapshots ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON snapshots FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON snapshots FOR INSERT TO shoal_hosts
    WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_update_own ON snapshots FOR UPDATE TO shoal_hosts
    USING (host = shoal_current_host()) WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_delete_own ON snapshots FOR DELETE TO shoal_hosts
    USING (host = shoal_current_host());

ALTER TABLE volumes ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON volumes FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON volumes FOR INSERT TO shoal_hosts
    WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_update_own ON volumes FOR UPDATE TO shoal_hosts
    USING (host = shoal_current_host()) WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_delete_own ON volumes FOR DELETE TO shoal_hosts
    USING (host = shoal_current_host());

-- Usage samples and attachments belong to the host of their sandbox.
ALTER TABLE usage_samples ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON usage_samples FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON usage_samples FOR INSERT TO shoal_hosts
    WITH CHECK (EXISTS (SELECT 1 FROM sandboxes s
                        WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
CREATE POLICY hosts_update_own ON usage_samples FOR UPDATE TO shoal_hosts
    USING (EXISTS (SELECT 1 FROM sandboxes s
                   WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
CREATE POLICY hosts_delete_own ON usage_samples FOR DELETE TO shoal_hosts
    USING (EXISTS (SELECT 1 FROM sandboxes s
                   WHERE s.id = sandbox_id AND s.host = shoal_current_host()));

ALTER TABLE volume_attachments ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON volume_attachments FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON volume_attachments FOR INSERT TO shoal_hosts
    WITH CHECK (EXISTS (SELECT 1 FROM sandboxes s
                        WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
CREATE POLICY hosts_update_own ON volume_attachments FOR UPDATE TO shoal_hosts
    USING (EXISTS (SELECT 1 FROM sandboxes s
                   WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
CREATE POLICY hosts_delete_own ON volume_attachments FOR DELETE TO shoal_hosts
    USING (EXISTS (SELECT 1 FROM sandboxes s
                   WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
