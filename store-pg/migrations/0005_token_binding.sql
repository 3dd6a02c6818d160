-- Boot-time secrets bound to the machine (see migrations/0005_token_binding.sql).
ALTER TABLE nodes ADD COLUMN boot_ip TEXT;
ALTER TABLE nodes ADD COLUMN agent_token TEXT;
CREATE UNIQUE INDEX nodes_agent_token ON nodes (agent_token);
