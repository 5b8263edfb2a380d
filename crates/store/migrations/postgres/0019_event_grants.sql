-- Hosts' roles' rights on sandboxes' event logs (migration 18): postgres
-- only; an SQLite database has no roles (its 0019 is a no-op).
--
-- Hosts read every sandbox's events (the API answers from any agent) and
-- write only their own sandboxes'.
GRANT SELECT, INSERT, DELETE ON sandbox_events TO shoal_hosts;
ALTER TABLE sandbox_events ENABLE ROW LEVEL SECURITY;
CREATE POLICY hosts_read ON sandbox_events FOR SELECT TO shoal_hosts USING (true);
CREATE POLICY hosts_insert_own ON sandbox_events FOR INSERT TO shoal_hosts
    WITH CHECK (EXISTS (SELECT 1 FROM sandboxes s
                        WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
CREATE POLICY hosts_delete_own ON sandbox_events FOR DELETE TO shoal_hosts
    USING (EXISTS (SELECT 1 FROM sandboxes s
                   WHERE s.id = sandbox_id AND s.host = shoal_current_host()));
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO shoal_hosts;
