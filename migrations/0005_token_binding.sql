-- Boot-time secrets bound to the machine (issue 10, finding 2).
-- boot_ip: the address the installer was served to (the `installer_served` transition);
--   the boot token is accepted only from there. NULL until the installer is served, and
--   again whenever the boot token changes. A node caught mid-install by this migration
--   has none: its installer's calls are refused and the installing deadline retries the
--   reclaim, which binds the address afresh.
-- agent_token: the first-boot agent's own credential, minted with each generation's
--   boot token and dropped with it; written only into the installed system, never into
--   a boot script or kernel command line.
ALTER TABLE nodes ADD COLUMN boot_ip TEXT;
ALTER TABLE nodes ADD COLUMN agent_token TEXT;
CREATE UNIQUE INDEX nodes_agent_token ON nodes (agent_token);
