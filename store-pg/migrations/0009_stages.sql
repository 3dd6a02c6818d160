-- Stages from the wire (see migrations/0009_stages.sql).
CREATE TABLE node_stages (
    node_id    BIGINT NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation BIGINT NOT NULL,
    stage      TEXT NOT NULL,
    at         TEXT NOT NULL,
    bytes      BIGINT,
    took_ms    BIGINT,
    detail     TEXT,
    PRIMARY KEY (node_id, generation, stage)
);
