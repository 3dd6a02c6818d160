-- DHCP leases and static reservations (PostgreSQL dialect of migrations/0001_dhcp.sql).
CREATE TABLE reservations (
    mac      TEXT PRIMARY KEY NOT NULL,
    ip       TEXT NOT NULL UNIQUE,
    hostname TEXT
);

CREATE TABLE leases (
    ip         TEXT PRIMARY KEY NOT NULL,
    mac        TEXT NOT NULL,
    client_id  TEXT,
    hostname   TEXT,
    state      TEXT NOT NULL CHECK (state IN ('bound', 'declined')),
    expires_at BIGINT NOT NULL
);
CREATE INDEX leases_mac ON leases (mac);
CREATE INDEX leases_expires ON leases (expires_at);
