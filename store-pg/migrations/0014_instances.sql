-- What several pxed instances on one database share (see migrations/0014_instances.sql).
CREATE TABLE node_owners (
    node_id    BIGINT PRIMARY KEY NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    owner      TEXT NOT NULL,
    fence      BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);

-- Every instance keeps the leases in memory (DHCP answers from it) and shows the
-- audit log live on its board: each committed change is announced to the others
-- (NOTIFY is delivered at COMMIT, and not at all on ROLLBACK). Payloads: the address,
-- and `node_id:event_id`.
CREATE FUNCTION pxed_notify_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pxed_leases', COALESCE(NEW.ip, OLD.ip));
    RETURN NULL;
END;
$$;
CREATE TRIGGER leases_notify AFTER INSERT OR UPDATE OR DELETE ON leases
    FOR EACH ROW EXECUTE FUNCTION pxed_notify_lease();

CREATE FUNCTION pxed_notify_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pxed_events', NEW.node_id || ':' || NEW.id);
    RETURN NULL;
END;
$$;
CREATE TRIGGER node_events_notify AFTER INSERT ON node_events
    FOR EACH ROW EXECUTE FUNCTION pxed_notify_event();
