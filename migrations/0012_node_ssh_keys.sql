-- Per-node SSH authorized keys (issue 11): public keys that reach root on this node's
-- installed system, after the config's (every node) and the image's. Public keys are
-- not secrets: the API shows them.
CREATE TABLE node_ssh_keys (
    node_id  INTEGER NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    key      TEXT NOT NULL,
    PRIMARY KEY (node_id, position)
) STRICT;
