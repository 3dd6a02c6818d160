-- Operator labels on nodes (see migrations/0011_node_labels.sql).
CREATE TABLE node_labels (
    node_id BIGINT NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    key     TEXT NOT NULL CHECK (length(key) BETWEEN 1 AND 64),
    value   TEXT NOT NULL CHECK (length(value) <= 128),
    PRIMARY KEY (node_id, key)
);
CREATE INDEX node_labels_key_value ON node_labels (key, value);
