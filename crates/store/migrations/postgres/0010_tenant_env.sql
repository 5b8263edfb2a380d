-- Tenants' environments are secrets a host reads only for the work it runs,
-- postgres only (SQLite's 0010 does nothing; see 0009 for the roles).
--
-- Hosts' roles lose SELECT on sweeps.env and apps.env (every other column
-- stays readable: any agent answers an account's listings). The store reads
-- env through the functions below, which give the column to a session that
-- may read it anyway (the fronts' role, an operator), to a host for a sweep
-- it has claimed a cell of or an app it drives, and '{}' otherwise; a
-- front fills the real env into the views an agent answers. A column added
-- to either table later must be granted to shoal_hosts by its migration.
REVOKE SELECT ON sweeps, apps FROM shoal_hosts;
DO $$
DECLARE
    col RECORD;
BEGIN
    FOR col IN
        SELECT table_name, column_name FROM information_schema.columns
        WHERE table_schema = current_schema() AND table_name IN ('sweeps', 'apps')
          AND column_name <> 'env'
    LOOP
        EXECUTE format('GRANT SELECT (%I) ON %I TO shoal_hosts', col.column_name, col.table_name);
    END LOOP;
END $$;

-- A host may not take over another host's app (and with it the app's env):
-- its role makes and changes only apps of its own host.
ALTER TABLE apps ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON apps FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON apps FOR INSERT TO shoal_hosts
    WITH CHECK (host = shoal_current_host());
CREATE POLICY hosts_update_own ON apps FOR UPDATE TO shoal_hosts
    USING (host = shoal_current_host()) WITH CHECK (host = shoal_current_host());

CREATE FUNCTION shoal_sweep_env(sweep TEXT) RETURNS TEXT
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public
    AS $$
        SELECT CASE
            WHEN has_column_privilege(session_user, 'public.sweeps', 'env', 'SELECT') THEN s.env
            WHEN EXISTS (SELECT 1 FROM public.sweep_cells c
                         WHERE c.sweep_id = s.id AND c.claimed_by = public.shoal_current_host())
                THEN s.env
            ELSE '{}'
        END
        FROM public.sweeps s WHERE s.id = sweep
    $$;
REVOKE ALL ON FUNCTION shoal_sweep_env(TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION shoal_sweep_env(TEXT) TO shoal_hosts;

CREATE FUNCTION shoal_app_env(app TEXT) RETURNS TEXT
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public
    AS $$
        SELECT CASE
            WHEN has_column_privilege(session_user, 'public.apps', 'env', 'SELECT') THEN a.env
            WHEN a.host = public.shoal_current_host() THEN a.env
            ELSE '{}'
        END
        FROM public.apps a WHERE a.id = app
    $$;
REVOKE ALL ON FUNCTION shoal_app_env(TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION shoal_app_env(TEXT) TO shoal_hosts;
