-- BMC steps recorded before they are sent (see migrations/0006_bmc_intents.sql).
CREATE TABLE bmc_intents (
    node_id BIGINT PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    generation BIGINT NOT NULL,
    attempt BIGINT NOT NULL,
    step TEXT NOT NULL,
    sent_at TEXT NOT NULL
);
