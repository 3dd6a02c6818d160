-- Per-node SSH authorized keys (see migrations/0012_node_ssh_keys.sql).
CREATE TABLE node_ssh_keys (
    node_id  BIGINT NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    position BIGINT NOT NULL,
    key      TEXT NOT NULL,
    PRIMARY KEY (node_id, position)
);
