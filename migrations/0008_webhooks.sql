-- Outgoing webhooks (issue 12): every node state change, written in the same
-- transaction as the change itself, so a transition never exists without its event and
-- a restart loses nothing. One row per event (not per URL): each configured URL keeps a
-- cursor in `webhook_cursors`, and rows every cursor has passed are deleted. Bounded:
-- past `webhooks.queue_cap` rows the oldest are dropped (counted and logged per URL).
CREATE TABLE webhook_outbox (
    -- The event id receivers see: monotonic (AUTOINCREMENT never reuses an id).
    id         INTEGER PRIMARY KEY AUTOINCREMENT NOT NULL,
    node_id    INTEGER NOT NULL,
    -- The state the node entered (URLs filter on it without parsing the body).
    to_state   TEXT NOT NULL,
    -- The exact JSON body that is signed and sent.
    body       TEXT NOT NULL,
    created_at TEXT NOT NULL
) STRICT;

-- Per URL: the last event id delivered (or skipped by its filter, or dropped).
CREATE TABLE webhook_cursors (
    url     TEXT PRIMARY KEY NOT NULL,
    last_id INTEGER NOT NULL
) STRICT;
