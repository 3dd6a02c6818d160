-- Several sites, one control plane (issue 15): instances serving different
-- provisioning VLANs or rooms share one database. `site` is the `site` setting of the
-- instance whose DHCP server last saw the node netboot (NULL: never seen by an
-- instance with a site); the API and the status page show and filter on it.
ALTER TABLE nodes ADD COLUMN site TEXT;
CREATE INDEX nodes_site ON nodes (site) WHERE site IS NOT NULL;
