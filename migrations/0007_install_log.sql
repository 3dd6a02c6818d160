-- Installer telemetry (issue 11): the last lines each node's installer sent to pxed's
-- syslog receiver or reporting webhook, per generation. Bounded: the receiver keeps the
-- newest `syslog.lines_per_node` rows of a generation and only the last few generations
-- of a node (older rows are deleted in the same transaction as each batch).
CREATE TABLE install_log (
    id         INTEGER PRIMARY KEY NOT NULL,
    node_id    INTEGER NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    generation INTEGER NOT NULL,
    -- When pxed received it (RFC 3339, UTC).
    at         TEXT NOT NULL,
    -- 'syslog' or 'webhook'.
    source     TEXT NOT NULL CHECK (source IN ('syslog', 'webhook')),
    -- One line, secrets redacted, at most a few KiB.
    line       TEXT NOT NULL
) STRICT;
CREATE INDEX install_log_node ON install_log (node_id, generation, id);
