-- Fast netboot-failure detection with fallback (see migrations/0010_netboot_methods.sql).
CREATE TABLE netboot_progress (
    node_id    BIGINT PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation BIGINT NOT NULL,
    method     TEXT NOT NULL,
    tried      TEXT NOT NULL,
    observed   BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE TABLE bmc_models (
    node_id BIGINT PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    model   TEXT NOT NULL,
    seen_at TEXT NOT NULL
);

CREATE TABLE netboot_methods (
    model        TEXT NOT NULL,
    method       TEXT NOT NULL,
    successes    BIGINT NOT NULL DEFAULT 0,
    last_success TEXT NOT NULL,
    PRIMARY KEY (model, method)
);
