-- Inventory, lifecycle and audit log.
CREATE TABLE images (
    name        TEXT PRIMARY KEY NOT NULL,
    family      TEXT NOT NULL CHECK (family IN ('kickstart', 'autoinstall', 'preseed')),
    -- JSON: per-arch kernel/initrd/cmdline/repo and the SHA-256 of each imported file.
    definition  TEXT NOT NULL,
    imported_at TEXT NOT NULL
) STRICT;

CREATE TABLE nodes (
    id            INTEGER PRIMARY KEY NOT NULL,
    name          TEXT UNIQUE,
    hostname      TEXT UNIQUE,
    arch          TEXT NOT NULL DEFAULT 'unknown' CHECK (arch IN ('x86_64', 'arm64', 'unknown')),
    state         TEXT NOT NULL CHECK (state IN ('discovered', 'available', 'allocated', 'reclaiming',
                      'netbooting', 'installing', 'first_boot', 'failed', 'quarantined')),
    state_since   TEXT NOT NULL,
    version       INTEGER NOT NULL DEFAULT 0,
    generation    INTEGER NOT NULL DEFAULT 0,
    attempt       INTEGER NOT NULL DEFAULT 0,
    image         TEXT,
    boot_token    TEXT UNIQUE,
    failed_step   TEXT,
    failed_reason TEXT,
    -- JSON reported by the first-boot agent.
    facts         TEXT,
    created_at    TEXT NOT NULL
) STRICT;

CREATE TABLE interfaces (
    mac     TEXT PRIMARY KEY NOT NULL,
    node_id INTEGER NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    is_boot INTEGER NOT NULL DEFAULT 0 CHECK (is_boot IN (0, 1))
) STRICT;
CREATE INDEX interfaces_node ON interfaces (node_id);

-- BMC endpoint: nothing secret here; this row may be shown.
CREATE TABLE bmcs (
    node_id      INTEGER PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    driver       TEXT NOT NULL CHECK (driver IN ('redfish', 'ipmi')),
    address      TEXT NOT NULL,
    username     TEXT NOT NULL,
    system_id    TEXT,
    -- SHA-256 of the BMC's TLS certificate, pinned on first use.
    tls_pin      TEXT,
    tls_insecure INTEGER NOT NULL DEFAULT 0 CHECK (tls_insecure IN (0, 1))
) STRICT;

-- BMC secrets, apart from everything the API and pages read.
CREATE TABLE bmc_secrets (
    node_id  INTEGER PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    password TEXT NOT NULL
) STRICT;

-- Append-only audit log; rows outlive their node.
CREATE TABLE node_events (
    id         INTEGER PRIMARY KEY NOT NULL,
    node_id    INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    from_state TEXT,
    event      TEXT NOT NULL,
    to_state   TEXT NOT NULL,
    at         TEXT NOT NULL,
    actor      TEXT NOT NULL,
    detail     TEXT
) STRICT;
CREATE INDEX node_events_node ON node_events (node_id, id);
CREATE TRIGGER node_events_append_only_update BEFORE UPDATE ON node_events
BEGIN SELECT RAISE(ABORT, 'node_events is append-only'); END;
CREATE TRIGGER node_events_append_only_delete BEFORE DELETE ON node_events
BEGIN SELECT RAISE(ABORT, 'node_events is append-only'); END;

-- Idempotency keys of reinstall requests: the same key returns the same answer.
CREATE TABLE idempotency (
    key        TEXT PRIMARY KEY NOT NULL,
    node_id    INTEGER NOT NULL,
    response   TEXT NOT NULL,
    created_at TEXT NOT NULL
) STRICT;
