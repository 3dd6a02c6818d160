-- Stages from the wire (issue 12): when each node generation first reached each stage
-- of a reinstall (power, DHCP, first stage, script, kernel, initrd, installer or
-- deploy-agent milestones, callbacks, available or failed). One row per node,
-- generation and stage (the first time it was seen); the recorder keeps only the last
-- `stages.keep_generations` generations of a node.
CREATE TABLE node_stages (
    node_id    INTEGER NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation INTEGER NOT NULL,
    -- A `model::Stage` name.
    stage      TEXT NOT NULL,
    -- When pxed saw it (RFC 3339, UTC, milliseconds).
    at         TEXT NOT NULL,
    -- Bytes and transfer time of a served file; what a script served; a failure reason.
    bytes      INTEGER,
    took_ms    INTEGER,
    detail     TEXT,
    PRIMARY KEY (node_id, generation, stage)
) STRICT, WITHOUT ROWID;
