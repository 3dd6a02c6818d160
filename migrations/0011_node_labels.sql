-- Operator labels on nodes (`rack=r12`, `row=b`): what the technicians' board filters on.
CREATE TABLE node_labels (
    node_id INTEGER NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    key     TEXT NOT NULL CHECK (length(key) BETWEEN 1 AND 64),
    value   TEXT NOT NULL CHECK (length(value) <= 128),
    PRIMARY KEY (node_id, key)
) STRICT;
CREATE INDEX node_labels_key_value ON node_labels (key, value);
