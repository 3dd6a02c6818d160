-- Fast netboot-failure detection with fallback (issue 12).
--
-- Where each node's current reinstall is in its plan of netboot methods: the method in
-- use, those tried in this generation (comma-separated, in order) and whether a DHCP
-- packet from a boot MAC was seen since the last power action. Read and written with
-- the node in `lifecycle::apply`'s transaction; the worker re-arms the observe window
-- from it on restart.
CREATE TABLE netboot_progress (
    node_id    INTEGER PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation INTEGER NOT NULL,
    method     TEXT NOT NULL,
    tried      TEXT NOT NULL,
    observed   INTEGER NOT NULL DEFAULT 0 CHECK (observed IN (0, 1))
) STRICT;

-- What a node's BMC says it is (Redfish Manufacturer/Model/BIOS version, IPMI device
-- id), learned when the worker sets the boot override.
CREATE TABLE bmc_models (
    node_id INTEGER PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    model   TEXT NOT NULL,
    seen_at TEXT NOT NULL
) STRICT;

-- Which netboot method made a machine of a BMC model netboot: the latest success is
-- tried first at the next reinstall of any node of that model.
CREATE TABLE netboot_methods (
    model        TEXT NOT NULL,
    method       TEXT NOT NULL,
    successes    INTEGER NOT NULL DEFAULT 0,
    last_success TEXT NOT NULL,
    PRIMARY KEY (model, method)
) STRICT;
