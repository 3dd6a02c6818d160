-- DHCP leases and static reservations.
CREATE TABLE reservations (
    mac      TEXT PRIMARY KEY NOT NULL,
    ip       TEXT NOT NULL UNIQUE,
    hostname TEXT
) STRICT;

CREATE TABLE leases (
    ip         TEXT PRIMARY KEY NOT NULL,
    mac        TEXT NOT NULL,
    client_id  TEXT,
    hostname   TEXT,
    state      TEXT NOT NULL CHECK (state IN ('bound', 'declined')),
    expires_at INTEGER NOT NULL
) STRICT;
CREATE INDEX leases_mac ON leases (mac);
CREATE INDEX leases_expires ON leases (expires_at);
