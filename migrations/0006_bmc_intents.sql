-- BMC steps recorded before they are sent (issue 10, finding 8): a crash between a
-- power cycle reaching the BMC and its answer being applied must not make the restarted
-- daemon cycle the machine again. One row per node: the last step the worker was about
-- to send, for which generation and attempt, and when. On start, a node in
-- `reclaiming` whose row says its power cycle was already sent for the current attempt
-- is checked (power state) instead of cycled again.
CREATE TABLE bmc_intents (
    node_id INTEGER PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    generation INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    step TEXT NOT NULL,
    sent_at TEXT NOT NULL
);
