-- Image family `disk`: whole-disk images written by pxed's deploy agent.
-- SQLite cannot change a CHECK constraint in place: rebuild the table (nothing
-- references it by foreign key; nodes.image holds the name as plain text).
CREATE TABLE images_new (
    name        TEXT PRIMARY KEY NOT NULL,
    family      TEXT NOT NULL CHECK (family IN ('kickstart', 'autoinstall', 'preseed', 'disk')),
    -- JSON: the catalog entry and what import fetched (files, sizes, SHA-256).
    definition  TEXT NOT NULL,
    imported_at TEXT NOT NULL
) STRICT;
INSERT INTO images_new (name, family, definition, imported_at)
    SELECT name, family, definition, imported_at FROM images;
DROP TABLE images;
ALTER TABLE images_new RENAME TO images;
