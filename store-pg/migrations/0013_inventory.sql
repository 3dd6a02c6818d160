-- Hardware inventory per node and generation (see migrations/0013_inventory.sql).
CREATE TABLE node_inventory (
    node_id      BIGINT NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation   BIGINT NOT NULL,
    source       TEXT NOT NULL CHECK (source IN ('redfish', 'ipmi', 'deploy', 'first_boot')),
    collected_at TEXT NOT NULL,
    took_ms      BIGINT,
    body         TEXT NOT NULL,
    PRIMARY KEY (node_id, generation, source)
);

CREATE TABLE node_hardware (
    node_id             BIGINT PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    profile             TEXT,
    baseline_generation BIGINT,
    checked_generation  BIGINT,
    passed              BOOLEAN,
    drifted             BOOLEAN NOT NULL DEFAULT FALSE,
    verdict             TEXT,
    checked_at          TEXT
);
CREATE INDEX node_hardware_profile ON node_hardware (profile);
