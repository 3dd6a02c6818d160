-- Which pxed instance runs a node's lifecycle effects (see migrations/0014_node_owners.sql).
CREATE TABLE node_owners (
    node_id    BIGINT PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    owner      TEXT NOT NULL,
    fence      BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);
