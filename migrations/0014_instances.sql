-- What several pxed instances on one database share (issue 15). PostgreSQL's version
-- of this migration also announces lease changes and audit-log rows to the other
-- instances (LISTEN/NOTIFY); one SQLite file has one pxed, which needs neither.
--
-- node_owners: which instance runs a node's lifecycle effects (BMC calls, deadlines).
-- A claim expires unless its holder renews it, so a survivor takes over the nodes of
-- an instance that died; `fence` grows with each change of holder, and a step recorded
-- under an older fence is refused, so a BMC step never runs from two instances at once. Times are the database's clock
-- (milliseconds since the epoch), never an instance's.
CREATE TABLE node_owners (
    node_id    INTEGER PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    owner      TEXT NOT NULL,
    fence      INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
) STRICT;
