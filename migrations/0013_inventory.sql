-- Hardware inventory per node and generation (issue 13): what the BMC (out of band)
-- and the deploy and first-boot agents (in band) reported, as `inventory::Inventory`
-- JSON. One row per source per generation; a later report of the same source in the
-- same generation replaces it.
CREATE TABLE node_inventory (
    node_id     INTEGER NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation  INTEGER NOT NULL,
    source      TEXT NOT NULL CHECK (source IN ('redfish', 'ipmi', 'deploy', 'first_boot')),
    collected_at TEXT NOT NULL,
    -- How long the collection took on the reporting side, when it said.
    took_ms     INTEGER,
    body        TEXT NOT NULL,
    PRIMARY KEY (node_id, generation, source)
) STRICT;

-- A node's hardware class and acceptance state: the profile it is held to (NULL:
-- none yet; the first inventory that matches exactly one profile assigns it), the
-- generation whose inventory is the accepted baseline, and the last gate's verdict.
CREATE TABLE node_hardware (
    node_id             INTEGER PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    profile             TEXT,
    baseline_generation INTEGER,
    -- The last gate: its generation, whether it passed, and its verdict (JSON).
    checked_generation  INTEGER,
    passed              INTEGER CHECK (passed IN (0, 1)),
    drifted             INTEGER NOT NULL DEFAULT 0 CHECK (drifted IN (0, 1)),
    verdict             TEXT,
    checked_at          TEXT
) STRICT;
CREATE INDEX node_hardware_profile ON node_hardware (profile);
