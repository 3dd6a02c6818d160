//! Nodes, their interfaces, BMC endpoints, the audit log and idempotency keys.

use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::SqliteConnection;

use super::{Db, Store, StoreError};
use crate::model::{Arch, Driver, Mac, NodeArch, State};

/// One row of the append-only audit log: the API's view of it, field for field.
pub type EventRow = crate::wire::EventView;

pub use crate::model::rows::{Audit, BmcRow, BootMacNode, InterfaceRow, NodeRow};

/// What registering a node needs.
#[derive(Debug, Clone)]
pub struct NewNode {
    pub name: Option<String>,
    pub arch: NodeArch,
    pub state: State,
    /// The first is the boot NIC unless `boot_mac` says otherwise.
    pub macs: Vec<Mac>,
    pub boot_mac: Option<Mac>,
    pub bmc: Option<(BmcRow, String)>,
    /// Public keys for root on this node's installed systems (checked by the caller).
    pub ssh_authorized_keys: Vec<String>,
}

/// Current time as stored (RFC 3339, UTC, milliseconds).
pub fn now() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses a stored timestamp.
pub fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

impl Store {
    /// Registers a node with its interfaces and BMC in one transaction.
    pub async fn create_node(&self, n: &NewNode, actor: &str) -> Result<i64, StoreError> {
        let mut tx = self.begin_node_tx().await?;
        let id = tx.insert_node(n.name.as_deref(), n.arch, n.state).await?;
        let boot = n.boot_mac.or_else(|| n.macs.first().copied());
        for mac in &n.macs {
            tx.insert_interface(*mac, id, Some(*mac) == boot).await?;
        }
        if let Some((b, password)) = &n.bmc {
            let sealed = self.key.seal(id, password);
            tx.set_bmc(
                &BmcRow {
                    node_id: id,
                    ..b.clone()
                },
                Some(&sealed),
            )
            .await?;
        }
        tx.set_ssh_keys(id, &n.ssh_authorized_keys).await?;
        let e = Audit::new(id, 0, "registered", n.state, actor);
        tx.append_event(&e).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// The node's own SSH authorized keys, in the order they were given.
    pub async fn node_ssh_keys(&self, node_id: i64) -> Result<Vec<String>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.node_ssh_keys(node_id).await?);
        }
        Ok(sqlx::query_scalar!(
            "SELECT key FROM node_ssh_keys WHERE node_id = ? ORDER BY position",
            node_id
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// Replaces the node's own SSH authorized keys, with an audit row naming how many
    /// (keys are public, but the audit log need not repeat them). `false`: no such node.
    pub async fn set_node_ssh_keys(
        &self,
        node_id: i64,
        keys: &[String],
        actor: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_node_tx().await?;
        let Some(row) = tx.node(node_id).await? else {
            return Ok(false);
        };
        tx.set_ssh_keys(node_id, keys).await?;
        let detail = format!("{} key(s); they reach the next install", keys.len());
        let mut e = Audit::new(node_id, row.generation, "ssh_keys_set", row.state, actor);
        e.from = Some(row.state);
        e.detail = Some(&detail);
        tx.append_event(&e).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// One node by id.
    pub async fn node(&self, id: i64) -> Result<Option<NodeRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.node(id).await?);
        }
        Ok(
            sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id = ?"#, id)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// Resolves an operator's reference: numeric id, name, hostname or MAC.
    pub async fn find_node(&self, reference: &str) -> Result<Option<NodeRow>, StoreError> {
        if let Ok(id) = reference.parse::<i64>() {
            return self.node(id).await;
        }
        if let Ok(mac) = reference.parse::<Mac>()
            && let Some(n) = self.node_by_mac(mac).await?
        {
            return Ok(Some(n));
        }
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.node_by_name(reference).await?);
        }
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE name = ? OR hostname = ? LIMIT 1"#,
            reference,
            reference
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// The node owning `mac` (normalized).
    pub async fn node_by_mac(&self, mac: Mac) -> Result<Option<NodeRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.node_by_mac(mac).await?);
        }
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id = (SELECT node_id FROM interfaces WHERE mac = ?)"#,
            mac
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// The nodes among `ids` that exist (one statement on SQLite, for a batch of
    /// sightings: see `stages::recorder`).
    pub async fn nodes_by_ids(&self, ids: &[i64]) -> Result<Vec<NodeRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let mut out = Vec::with_capacity(ids.len());
            for &id in ids {
                out.extend(pg.node(id).await?);
            }
            return Ok(out);
        }
        let list = serde_json::json!(ids).to_string();
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id IN (SELECT value FROM json_each(?))"#,
            list
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// The nodes owning any of `macs`, with the MAC each was found by (two statements
    /// on SQLite, whatever the number of MACs).
    pub async fn nodes_by_macs(&self, macs: &[Mac]) -> Result<Vec<(Mac, NodeRow)>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let mut out = Vec::with_capacity(macs.len());
            for &mac in macs {
                out.extend(pg.node_by_mac(mac).await?.map(|n| (mac, n)));
            }
            return Ok(out);
        }
        let list = serde_json::json!(macs).to_string();
        let owners = sqlx::query!(
            r#"SELECT mac AS "mac: Mac", node_id FROM interfaces
               WHERE mac IN (SELECT value FROM json_each(?))"#,
            list
        )
        .fetch_all(self.pool()?)
        .await?;
        let ids: Vec<i64> = owners.iter().map(|o| o.node_id).collect();
        let nodes: std::collections::HashMap<i64, NodeRow> = self
            .nodes_by_ids(&ids)
            .await?
            .into_iter()
            .map(|n| (n.id, n))
            .collect();
        Ok(owners
            .into_iter()
            .filter_map(|o| Some((o.mac, nodes.get(&o.node_id)?.clone())))
            .collect())
    }

    /// The node whose current boot token or agent token is `token` (the caller tells
    /// which by comparing; both are unique and random, so at most one node matches).
    pub async fn node_by_credential(&self, token: &str) -> Result<Option<NodeRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.node_by_credential(token).await?);
        }
        Ok(
            sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE boot_token = ? OR agent_token = ?"#, token, token)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// All nodes, by id.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.nodes().await?);
        }
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes ORDER BY id"#)
            .fetch_all(self.pool()?)
            .await?)
    }

    /// Nodes in any of `states` (those with deadlines are re-armed on start).
    pub async fn nodes_in_states(&self, states: &[State]) -> Result<Vec<NodeRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.nodes_in_states(states).await?);
        }
        let states = serde_json::json!(states).to_string();
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE state IN (SELECT value FROM json_each(?)) ORDER BY id"#,
            states
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// One page of a node listing with each node's MACs (boot MAC first), in two
    /// queries whatever the page size: the first `limit` nodes with an id above
    /// `after`, in id order, optionally only those in `state`.
    pub async fn nodes_page(
        &self,
        after: i64,
        limit: u32,
        state: Option<State>,
    ) -> Result<Vec<(NodeRow, Vec<Mac>)>, StoreError> {
        let limit = i64::from(limit);
        if let Db::Postgres(pg) = &self.db {
            let nodes = pg.nodes_after(after, limit, state).await?;
            let Some(last) = nodes.last().map(|n| n.id) else {
                return Ok(vec![]);
            };
            let ifaces = pg.interfaces_between(after, last).await?;
            return Ok(with_macs(nodes, ifaces));
        }
        let nodes = sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id > ? AND (? IS NULL OR state = ?) ORDER BY id LIMIT ?"#, after, state, state, limit)
            .fetch_all(self.pool()?)
            .await?;
        let Some(last) = nodes.last().map(|n| n.id) else {
            return Ok(vec![]);
        };
        let ifaces = sqlx::query_as!(
            InterfaceRow,
            r#"SELECT mac AS "mac: _", node_id, is_boot AS "is_boot: _" FROM interfaces WHERE node_id > ? AND node_id <= ? ORDER BY node_id, is_boot DESC, mac"#,
            after,
            last
        )
        .fetch_all(self.pool()?)
        .await?;
        Ok(with_macs(nodes, ifaces))
    }

    /// How many nodes are in each state (states with none left out).
    pub async fn state_counts(&self) -> Result<Vec<(State, i64)>, StoreError> {
        let mut counts: Vec<(State, i64)> = match &self.db {
            Db::Postgres(pg) => pg.state_counts().await?,
            Db::Sqlite(_) => sqlx::query!(
                r#"SELECT state AS "state: State", COUNT(*) AS "n!: i64" FROM nodes GROUP BY state"#
            )
            .fetch_all(self.pool()?)
            .await?
            .into_iter()
            .map(|r| (r.state, r.n))
            .collect(),
        };
        counts.sort_by_key(|(s, _)| State::ALL.iter().position(|x| x == s));
        Ok(counts)
    }

    /// The MACs of a node, boot MAC first.
    pub async fn macs(&self, node_id: i64) -> Result<Vec<Mac>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.macs(node_id).await?);
        }
        Ok(sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE node_id = ? ORDER BY is_boot DESC, mac"#,
            node_id
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// The boot NIC of a node.
    pub async fn boot_mac(&self, node_id: i64) -> Result<Option<Mac>, StoreError> {
        Ok(self.macs(node_id).await?.into_iter().next())
    }

    /// The audit log of a node, oldest first.
    pub async fn events(&self, node_id: i64) -> Result<Vec<EventRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.events(node_id).await?);
        }
        Ok(sqlx::query_as!(
            EventRow,
            r#"SELECT id, node_id, generation, from_state AS "from_state: _", event, to_state AS "to_state: _", at, actor, detail FROM node_events WHERE node_id = ? ORDER BY id"#,
            node_id
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// The BMC endpoint of a node (without secret).
    pub async fn bmc(&self, node_id: i64) -> Result<Option<BmcRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.bmc(node_id).await?);
        }
        Ok(
            sqlx::query_as!(BmcRow, r#"SELECT node_id, driver AS "driver: _", address, username, system_id, tls_pin, tls_insecure AS "tls_insecure: _" FROM bmcs WHERE node_id = ?"#, node_id)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// What connecting to a node's BMC takes: its endpoint, its password (opened with
    /// the secret key) and its boot MAC, in one statement on SQLite (the BMC worker
    /// reads them at every step of every reinstall). Only the BMC worker calls this.
    pub async fn bmc_connection(
        &self,
        node_id: i64,
    ) -> Result<Option<(BmcRow, Option<String>, Option<Mac>)>, StoreError> {
        if let Db::Postgres(_) = &self.db {
            let Some(row) = self.bmc(node_id).await? else {
                return Ok(None);
            };
            let password = self.bmc_secret(node_id).await?;
            return Ok(Some((row, password, self.boot_mac(node_id).await?)));
        }
        let Some(r) = sqlx::query!(
            r#"SELECT b.node_id, b.driver AS "driver: Driver", b.address, b.username, b.system_id,
                      b.tls_pin, b.tls_insecure AS "tls_insecure: bool",
                      s.password AS "password?",
                      (SELECT mac FROM interfaces WHERE node_id = b.node_id
                       ORDER BY is_boot DESC, mac LIMIT 1) AS "boot_mac?: Mac"
               FROM bmcs b LEFT JOIN bmc_secrets s ON s.node_id = b.node_id
               WHERE b.node_id = ?"#,
            node_id
        )
        .fetch_optional(self.pool()?)
        .await?
        else {
            return Ok(None);
        };
        let password = r.password.map(|p| self.key.open(node_id, &p)).transpose()?;
        let row = BmcRow {
            node_id: r.node_id,
            driver: r.driver,
            address: r.address,
            username: r.username,
            system_id: r.system_id,
            tls_pin: r.tls_pin,
            tls_insecure: r.tls_insecure,
        };
        Ok(Some((row, password, r.boot_mac)))
    }

    /// The BMC password of a node, opened with the secret key. Only the BMC worker
    /// calls this.
    pub async fn bmc_secret(&self, node_id: i64) -> Result<Option<String>, StoreError> {
        let stored = match &self.db {
            Db::Postgres(pg) => pg.bmc_secret(node_id).await?,
            Db::Sqlite(_) => {
                sqlx::query_scalar!(
                    "SELECT password FROM bmc_secrets WHERE node_id = ?",
                    node_id
                )
                .fetch_optional(self.pool()?)
                .await?
            }
        };
        Ok(stored.map(|s| self.key.open(node_id, &s)).transpose()?)
    }

    /// Seals passwords stored in plain text by a pxed from before sealing.
    pub(super) async fn seal_plaintext_secrets(&self) -> Result<(), StoreError> {
        let rows = sqlx::query!("SELECT node_id, password FROM bmc_secrets")
            .fetch_all(self.pool()?)
            .await?;
        let mut sealed = 0;
        for r in rows {
            if super::secrets::SecretKey::is_sealed(&r.password) {
                continue;
            }
            let s = self.key.seal(r.node_id, &r.password);
            self.write_one(sqlx::query!(
                "UPDATE bmc_secrets SET password = ? WHERE node_id = ?",
                s,
                r.node_id
            ))
            .await?;
            sealed += 1;
        }
        if sealed > 0 {
            tracing::info!(sealed, "sealed BMC passwords stored in plain text");
        }
        Ok(())
    }

    /// Stores the TLS fingerprint pinned on first use.
    pub async fn pin_bmc_cert(&self, node_id: i64, pin: &str) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.pin_bmc_cert(node_id, pin).await?);
        }
        self.write_one(sqlx::query!(
            "UPDATE bmcs SET tls_pin = ? WHERE node_id = ?",
            pin,
            node_id
        ))
        .await?;
        Ok(())
    }

    /// Deletes a node (its interfaces, BMC and secrets go with it; the audit log stays).
    pub async fn delete_node(&self, id: i64, actor: &str) -> Result<bool, StoreError> {
        let mut tx = self.begin_node_tx().await?;
        let Some(n) = tx.node(id).await? else {
            return Ok(false);
        };
        tx.delete_node(id).await?;
        let e = Audit {
            from: Some(n.state),
            ..Audit::new(id, n.generation, "deleted", n.state, actor)
        };
        tx.append_event(&e).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Whether a hostname is used by any node.
    pub async fn hostname_taken(&self, hostname: &str) -> Result<bool, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.hostname_taken(hostname).await?);
        }
        Ok(
            sqlx::query_scalar!("SELECT COUNT(*) FROM nodes WHERE hostname = ?", hostname)
                .fetch_one(self.pool()?)
                .await?
                > 0,
        )
    }

    /// All hostnames in use.
    pub async fn hostnames(&self) -> Result<Vec<String>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.hostnames().await?);
        }
        Ok(
            sqlx::query_scalar!("SELECT hostname FROM nodes WHERE hostname IS NOT NULL")
                .fetch_all(self.pool()?)
                .await?
                .into_iter()
                .flatten()
                .collect(),
        )
    }

    /// A stored idempotent answer.
    pub async fn idempotent(&self, key: &str) -> Result<Option<(i64, String)>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.idempotent(key).await?);
        }
        Ok(sqlx::query!(
            "SELECT node_id, response FROM idempotency WHERE key = ?",
            key
        )
        .fetch_optional(self.pool()?)
        .await?
        .map(|r| (r.node_id, r.response)))
    }
}

/// A write transaction on node lifecycle fields (`BEGIN IMMEDIATE`, so two writers
/// never both read a version and then race to write it): the lifecycle's only way into
/// the store. Dropped without [`NodeTx::commit`], it rolls back.
pub struct NodeTx {
    pub(super) tx: Tx,
}

/// A [`NodeTx`] on its backend.
pub(super) enum Tx {
    Lite(super::Write),
    Pg(store_pg::nodes::PgTx),
}

impl Store {
    /// Starts a lifecycle write transaction.
    pub async fn begin_node_tx(&self) -> Result<NodeTx, StoreError> {
        let tx = match &self.db {
            Db::Postgres(pg) => Tx::Pg(pg.begin().await?),
            Db::Sqlite(_) => Tx::Lite(self.write().await?),
        };
        Ok(NodeTx { tx })
    }
}

impl NodeTx {
    /// The SQLite connection of this transaction, or an error naming what is not
    /// available on PostgreSQL yet.
    pub(super) fn lite(&mut self, what: &'static str) -> Result<&mut SqliteConnection, StoreError> {
        match &mut self.tx {
            Tx::Lite(w) => Ok(w),
            Tx::Pg(_) => Err(StoreError::NotOnPostgres(what)),
        }
    }

    /// The node, as this transaction sees it.
    pub async fn node(&mut self, id: i64) -> Result<Option<NodeRow>, StoreError> {
        match &mut self.tx {
            Tx::Lite(w) => node_tx(w, id).await,
            Tx::Pg(t) => Ok(t.node(id).await?),
        }
    }

    /// Inserts a node row (created now); its id.
    async fn insert_node(
        &mut self,
        name: Option<&str>,
        arch: NodeArch,
        state: State,
    ) -> Result<i64, StoreError> {
        let t = now();
        match &mut self.tx {
            Tx::Pg(p) => Ok(p.insert_node(name, arch, state, &t).await?),
            Tx::Lite(w) => Ok(sqlx::query_scalar!(
                r#"INSERT INTO nodes (name, arch, state, state_since, created_at)
                   VALUES (?, ?, ?, ?, ?) RETURNING id"#,
                name,
                arch,
                state,
                t,
                t
            )
            .fetch_one(&mut **w)
            .await?),
        }
    }

    /// Inserts an interface of `node_id`.
    async fn insert_interface(
        &mut self,
        mac: Mac,
        node_id: i64,
        is_boot: bool,
    ) -> Result<(), StoreError> {
        match &mut self.tx {
            Tx::Pg(p) => Ok(p.insert_interface(mac, node_id, is_boot).await?),
            Tx::Lite(w) => {
                sqlx::query!(
                    "INSERT INTO interfaces (mac, node_id, is_boot) VALUES (?, ?, ?)",
                    mac,
                    node_id,
                    is_boot
                )
                .execute(&mut **w)
                .await?;
                Ok(())
            }
        }
    }

    /// The node that has `mac`, if any.
    async fn node_of_mac(&mut self, mac: Mac) -> Result<Option<i64>, StoreError> {
        match &mut self.tx {
            Tx::Pg(p) => Ok(p.node_of_mac(mac).await?),
            Tx::Lite(w) => Ok(sqlx::query_scalar!(
                "SELECT node_id FROM interfaces WHERE mac = ?",
                mac
            )
            .fetch_optional(&mut **w)
            .await?),
        }
    }

    /// Sets a BMC endpoint (`b.node_id`'s) and, if given, its sealed password.
    async fn set_bmc(&mut self, b: &BmcRow, sealed: Option<&str>) -> Result<(), StoreError> {
        match &mut self.tx {
            Tx::Pg(p) => Ok(p.set_bmc(b, sealed).await?),
            Tx::Lite(w) => set_bmc_tx(w, b, sealed).await,
        }
    }

    /// Replaces the node's own SSH keys.
    async fn set_ssh_keys(&mut self, node_id: i64, keys: &[String]) -> Result<(), StoreError> {
        match &mut self.tx {
            Tx::Pg(p) => Ok(p.set_ssh_keys(node_id, keys).await?),
            Tx::Lite(w) => set_ssh_keys_tx(w, node_id, keys).await,
        }
    }

    /// Deletes a node (its interfaces, BMC and secrets go with it).
    async fn delete_node(&mut self, id: i64) -> Result<(), StoreError> {
        match &mut self.tx {
            Tx::Pg(p) => Ok(p.delete_node(id).await?),
            Tx::Lite(w) => {
                sqlx::query!("DELETE FROM nodes WHERE id = ?", id)
                    .execute(&mut **w)
                    .await?;
                Ok(())
            }
        }
    }

    /// Whether the node's first boot of `generation` was reported already.
    pub async fn first_boot_reported(
        &mut self,
        id: i64,
        generation: i64,
    ) -> Result<bool, StoreError> {
        let w = match &mut self.tx {
            Tx::Pg(p) => return Ok(p.first_boot_reported(id, generation).await?),
            Tx::Lite(w) => w,
        };
        let n = sqlx::query_scalar!(
            r#"SELECT COUNT(*) FROM node_events
               WHERE node_id = ? AND generation = ? AND event = 'first_boot_reported'"#,
            id,
            generation
        )
        .fetch_one(&mut **w)
        .await?;
        Ok(n > 0)
    }

    /// Writes `n`'s lifecycle fields if its version is still `expected_version` and
    /// appends the audit row `e`; false, and neither written, when another writer got
    /// there first.
    ///
    /// On SQLite both statements go to sqlx's worker thread in one round trip: every
    /// lifecycle step takes this path, and under a boot storm the single writer's time
    /// is mostly those round trips (waits for a core), not SQLite's work.
    pub async fn update_node_with_event(
        &mut self,
        n: &NodeRow,
        expected_version: i64,
        e: &Audit<'_>,
    ) -> Result<bool, StoreError> {
        let w = match &mut self.tx {
            Tx::Lite(w) => w,
            Tx::Pg(p) => {
                if !p.update_node(n, expected_version).await? {
                    return Ok(false);
                }
                p.append_event(e, &now()).await?;
                return Ok(true);
            }
        };
        let at = now();
        let r = sqlx::query!(
            r#"UPDATE nodes SET state = ?, state_since = ?, version = version + 1, generation = ?,
                   attempt = ?, image = ?, boot_token = ?, agent_token = ?, boot_ip = ?,
                   failed_step = ?, failed_reason = ?, facts = ?, hostname = ?, arch = ?
               WHERE id = ? AND version = ?;
               INSERT INTO node_events (node_id, generation, from_state, event, to_state, at, actor, detail)
               SELECT ?, ?, ?, ?, ?, ?, ?, ? WHERE changes() = 1"#,
            n.state,
            n.state_since,
            n.generation,
            n.attempt,
            n.image,
            n.boot_token,
            n.agent_token,
            n.boot_ip,
            n.failed_step,
            n.failed_reason,
            n.facts,
            n.hostname,
            n.arch,
            n.id,
            expected_version,
            e.node_id,
            e.generation,
            e.from,
            e.event,
            e.to,
            at,
            e.actor,
            e.detail
        )
        .execute(&mut **w)
        .await?;
        // One row updated and one inserted; an update that matched nothing (`changes()`
        // is the last statement's) inserts nothing either.
        Ok(r.rows_affected() == 2)
    }

    /// Appends one audit row.
    pub async fn append_event(&mut self, e: &Audit<'_>) -> Result<(), StoreError> {
        match &mut self.tx {
            Tx::Lite(w) => append_event(w, e).await,
            Tx::Pg(p) => Ok(p.append_event(e, &now()).await?),
        }
    }

    /// Records an idempotency key's answer with the change that produced it.
    pub async fn put_idempotent(
        &mut self,
        key: &str,
        node_id: i64,
        response: &str,
    ) -> Result<(), StoreError> {
        match &mut self.tx {
            Tx::Lite(w) => put_idempotent(w, key, node_id, response).await,
            Tx::Pg(p) => Ok(p.put_idempotent(key, node_id, response, &now()).await?),
        }
    }

    /// The node's boot NIC.
    pub async fn boot_mac(&mut self, id: i64) -> Result<Option<Mac>, StoreError> {
        match &mut self.tx {
            Tx::Lite(w) => boot_mac_tx(w, id).await,
            Tx::Pg(p) => Ok(p.boot_mac(id).await?),
        }
    }

    /// The hostnames in use among `exact`, and those starting with `stem` (one
    /// index lookup each, not a read of every hostname: a 5,000-node reclaim names
    /// 5,000 nodes).
    pub async fn hostnames_among(
        &mut self,
        exact: &[String; 3],
        stem: &str,
    ) -> Result<Vec<String>, StoreError> {
        // Generated names are [a-z0-9-]; every name starting with `stem` sorts below
        // `stem` + '~'.
        let w = match &mut self.tx {
            Tx::Pg(p) => return Ok(p.hostnames_among(exact, stem).await?),
            Tx::Lite(w) => w,
        };
        let upper = format!("{stem}~");
        Ok(sqlx::query_scalar!(
            "SELECT hostname FROM nodes WHERE hostname IN (?, ?, ?) \
             OR (hostname >= ? AND hostname < ?)",
            exact[0],
            exact[1],
            exact[2],
            stem,
            upper
        )
        .fetch_all(&mut **w)
        .await?
        .into_iter()
        .flatten()
        .collect())
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), StoreError> {
        match self.tx {
            Tx::Lite(w) => w.commit().await,
            Tx::Pg(p) => Ok(p.commit().await?),
        }
    }
}

/// Each node with its MACs (`ifaces` ordered by node, boot NIC first).
fn with_macs(nodes: Vec<NodeRow>, ifaces: Vec<InterfaceRow>) -> Vec<(NodeRow, Vec<Mac>)> {
    let mut macs: std::collections::HashMap<i64, Vec<Mac>> = Default::default();
    for i in ifaces {
        macs.entry(i.node_id).or_default().push(i.mac);
    }
    nodes
        .into_iter()
        .map(|n| {
            let m = macs.remove(&n.id).unwrap_or_default();
            (n, m)
        })
        .collect()
}

/// Loads a node inside a transaction.
async fn node_tx(conn: &mut SqliteConnection, id: i64) -> Result<Option<NodeRow>, StoreError> {
    Ok(
        sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id = ?"#, id)
            .fetch_optional(conn)
            .await?,
    )
}

impl Store {
    /// Appends an audit row that records something the node reported without
    /// changing its state (deploy progress and facts): `from` and `to` are `state`.
    pub async fn note(
        &self,
        node_id: i64,
        generation: i64,
        state: State,
        event: &str,
        actor: &str,
        detail: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_node_tx().await?;
        let e = Audit {
            from: Some(state),
            detail: Some(detail),
            ..Audit::new(node_id, generation, event, state, actor)
        };
        tx.append_event(&e).await?;
        tx.commit().await
    }
}

/// Appends one audit row.
pub(super) async fn append_event(
    conn: &mut SqliteConnection,
    e: &Audit<'_>,
) -> Result<(), StoreError> {
    let Audit {
        node_id,
        generation,
        from,
        event,
        to,
        actor,
        detail,
    } = *e;
    let at = now();
    sqlx::query!(
        r#"INSERT INTO node_events (node_id, generation, from_state, event, to_state, at, actor, detail)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?)"#,
        node_id,
        generation,
        from,
        event,
        to,
        at,
        actor,
        detail
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Records an idempotency key's answer inside the transaction that produced it.
async fn put_idempotent(
    conn: &mut SqliteConnection,
    key: &str,
    node_id: i64,
    response: &str,
) -> Result<(), StoreError> {
    let at = now();
    sqlx::query!(
        "INSERT INTO idempotency (key, node_id, response, created_at) VALUES (?, ?, ?, ?)",
        key,
        node_id,
        response,
        at
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Replaces a node's own SSH keys inside `tx`.
async fn set_ssh_keys_tx(
    tx: &mut SqliteConnection,
    node_id: i64,
    keys: &[String],
) -> Result<(), StoreError> {
    sqlx::query!("DELETE FROM node_ssh_keys WHERE node_id = ?", node_id)
        .execute(&mut *tx)
        .await?;
    for (position, key) in (0_i64..).zip(keys) {
        sqlx::query!(
            "INSERT INTO node_ssh_keys (node_id, position, key) VALUES (?, ?, ?)",
            node_id,
            position,
            key
        )
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

async fn set_bmc_tx(
    tx: &mut SqliteConnection,
    b: &BmcRow,
    sealed: Option<&str>,
) -> Result<(), StoreError> {
    let node_id = b.node_id;
    sqlx::query!(
        r#"INSERT INTO bmcs (node_id, driver, address, username, system_id, tls_pin, tls_insecure)
           VALUES (?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT (node_id) DO UPDATE SET driver = excluded.driver, address = excluded.address,
             username = excluded.username, system_id = excluded.system_id,
             tls_pin = excluded.tls_pin, tls_insecure = excluded.tls_insecure"#,
        node_id,
        b.driver,
        b.address,
        b.username,
        b.system_id,
        b.tls_pin,
        b.tls_insecure
    )
    .execute(&mut *tx)
    .await?;
    if let Some(p) = sealed {
        sqlx::query!(
            r#"INSERT INTO bmc_secrets (node_id, password) VALUES (?, ?)
               ON CONFLICT (node_id) DO UPDATE SET password = excluded.password"#,
            node_id,
            p
        )
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

impl Store {
    /// Registers the MACs not known yet as `discovered` nodes, all in one transaction
    /// (a rack powering on at once costs one commit, not one per machine). Returns the
    /// new nodes' ids.
    pub async fn discover_many(
        &self,
        seen: &[(Mac, Option<Arch>)],
    ) -> Result<Vec<(i64, Mac)>, StoreError> {
        let mut tx = self.begin_node_tx().await?;
        if let Tx::Pg(p) = &mut tx.tx {
            p.lock_discovery().await?;
        }
        let mut created = Vec::new();
        for (mac, arch) in seen {
            if tx.node_of_mac(*mac).await?.is_some() {
                continue;
            }
            let arch = NodeArch(*arch);
            let state = State::Discovered;
            let id = tx.insert_node(None, arch, state).await?;
            tx.insert_interface(*mac, id, true).await?;
            let e = Audit {
                detail: Some(arch.as_str()),
                ..Audit::new(id, 0, "registered", state, "discovery")
            };
            tx.append_event(&e).await?;
            created.push((id, *mac));
        }
        tx.commit().await?;
        Ok(created)
    }

    /// Which of `macs` belong to no node.
    pub async fn unknown_macs(&self, macs: &[Mac]) -> Result<Vec<Mac>, StoreError> {
        let known: std::collections::HashSet<Mac> = match &self.db {
            Db::Postgres(pg) => pg.known_macs(macs).await?.into_iter().collect(),
            Db::Sqlite(_) => {
                let list = serde_json::json!(macs).to_string();
                sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE mac IN (SELECT value FROM json_each(?))"#,
            list
        )
        .fetch_all(self.pool()?)
        .await?
        .into_iter()
        .collect()
            }
        };
        Ok(macs
            .iter()
            .copied()
            .filter(|m| !known.contains(m))
            .collect())
    }

    /// The nodes whose boot MAC is one of `macs`, and whether the power cycle of their
    /// current reclaim attempt was sent already (`bmc_intents`).
    pub async fn nodes_by_boot_macs(&self, macs: &[Mac]) -> Result<Vec<BootMacNode>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.nodes_by_boot_macs(macs).await?);
        }
        let list = serde_json::json!(macs).to_string();
        let cycle = crate::model::BmcStep::PowerCycle;
        let rows = sqlx::query!(
            r#"SELECT i.mac AS "mac: Mac", n.id, n.state AS "state: State", n.generation,
                      EXISTS (SELECT 1 FROM bmc_intents b WHERE b.node_id = n.id
                              AND b.generation = n.generation AND b.attempt = n.attempt
                              AND b.step = ?) AS "cycle_sent!: bool",
                      COALESCE(p.observed, 0) AS "netboot_observed!: bool"
               FROM interfaces i JOIN nodes n ON n.id = i.node_id
               LEFT JOIN netboot_progress p ON p.node_id = n.id AND p.generation = n.generation
               WHERE i.is_boot = 1 AND i.mac IN (SELECT value FROM json_each(?))"#,
            cycle,
            list
        )
        .fetch_all(self.pool()?)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| BootMacNode {
                mac: r.mac,
                id: r.id,
                state: r.state,
                generation: r.generation,
                cycle_sent: r.cycle_sent,
                netboot_observed: r.netboot_observed,
            })
            .collect())
    }

    /// How many nodes are `discovered` (seen, not enrolled).
    pub async fn pending_discovered(&self) -> Result<u64, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(u64::try_from(pg.count_in_state(State::Discovered).await?).unwrap_or(0));
        }
        let state = State::Discovered;
        let n = sqlx::query_scalar!("SELECT COUNT(*) FROM nodes WHERE state = ?", state)
            .fetch_one(self.pool()?)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Records the architecture a node reported (DHCP option 93 or the agent).
    pub async fn set_arch(&self, id: i64, arch: Arch) -> Result<(), StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.set_arch(id, arch).await?);
        }
        self.write_one(sqlx::query!(
            "UPDATE nodes SET arch = ? WHERE id = ?",
            arch,
            id
        ))
        .await?;
        Ok(())
    }
}

/// The boot NIC's MAC of a node, inside a transaction.
async fn boot_mac_tx(conn: &mut SqliteConnection, id: i64) -> Result<Option<Mac>, StoreError> {
    Ok(sqlx::query_scalar!(
        r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE node_id = ? ORDER BY is_boot DESC, mac LIMIT 1"#,
        id
    )
    .fetch_optional(conn)
    .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything a node's registration, lookups, lifecycle writes, discovery and
    /// deletion return, with the clock's fields blanked: the same on both backends.
    async fn node_transcript(s: &Store) -> Vec<String> {
        use crate::model::Driver;
        let mut out = Vec::new();
        let mut log = |what: &str, v: &dyn std::fmt::Debug| out.push(format!("{what}: {v:?}"));
        let mac = |n: u8| Mac([0x52, 0x54, 0, 0, 0, n]);
        let bmc = BmcRow {
            node_id: 0,
            driver: Driver::Redfish,
            address: "https://10.0.0.9".into(),
            username: "root".into(),
            system_id: Some("1".into()),
            tls_pin: None,
            tls_insecure: true,
        };
        let new = NewNode {
            name: Some("rack1-a".into()),
            arch: NodeArch(Some(Arch::Arm64)),
            state: State::Available,
            macs: vec![mac(2), mac(1)],
            boot_mac: Some(mac(1)),
            bmc: Some((bmc, "s3cret-pw".into())),
            ssh_authorized_keys: vec!["ssh-ed25519 AAAA a@b".into(), "ssh-ed25519 BBBB c@d".into()],
        };
        let id = s.create_node(&new, "test").await.unwrap();
        let other = s
            .create_node(
                &NewNode {
                    name: None,
                    macs: vec![mac(3)],
                    boot_mac: None,
                    bmc: None,
                    ssh_authorized_keys: vec![],
                    ..new.clone()
                },
                "test",
            )
            .await
            .unwrap();
        let blank = |mut n: NodeRow| {
            n.state_since.clear();
            n.created_at.clear();
            n
        };
        log("node", &s.node(id).await.unwrap().map(blank));
        log("no node", &s.node(999).await.unwrap());
        for r in [
            id.to_string(),
            "rack1-a".into(),
            mac(2).to_string(),
            "nope".into(),
        ] {
            log("find", &s.find_node(&r).await.unwrap().map(|n| n.id));
        }
        log(
            "by mac",
            &s.node_by_mac(mac(3)).await.unwrap().map(|n| n.id),
        );
        // The batch lookups answer what the single ones do, and leave out the unknown.
        let mut by_ids = s.nodes_by_ids(&[other, id, 999]).await.unwrap();
        by_ids.sort_by_key(|n| n.id);
        let mut singles = vec![
            s.node(id).await.unwrap().unwrap(),
            s.node(other).await.unwrap().unwrap(),
        ];
        singles.sort_by_key(|n| n.id);
        assert_eq!(by_ids, singles);
        let mut by_macs = s
            .nodes_by_macs(&[mac(1), mac(2), mac(3), mac(77)])
            .await
            .unwrap();
        by_macs.sort_by_key(|(m, _)| *m);
        log(
            "by macs",
            &by_macs
                .iter()
                .map(|(m, n)| (m.to_string(), n.id))
                .collect::<Vec<_>>(),
        );
        for (m, n) in &by_macs {
            assert_eq!(Some(n), s.node_by_mac(*m).await.unwrap().as_ref());
        }
        assert_eq!(by_macs.len(), 3);
        log("macs", &s.macs(id).await.unwrap());
        log("boot mac", &s.boot_mac(id).await.unwrap());
        log("bmc", &s.bmc(id).await.unwrap());
        log("secret", &s.bmc_secret(id).await.unwrap());
        // The BMC worker's one read is the three reads in one.
        assert_eq!(
            s.bmc_connection(id).await.unwrap(),
            Some((
                s.bmc(id).await.unwrap().unwrap(),
                s.bmc_secret(id).await.unwrap(),
                s.boot_mac(id).await.unwrap()
            ))
        );
        assert_eq!(s.bmc_connection(other).await.unwrap(), None);
        s.pin_bmc_cert(id, "sha256:ab").await.unwrap();
        log("pinned", &s.bmc(id).await.unwrap().map(|b| b.tls_pin));
        log("keys", &s.node_ssh_keys(id).await.unwrap());
        log(
            "set keys",
            &s.set_node_ssh_keys(id, &["k1".into()], "op").await.unwrap(),
        );
        log(
            "set keys, no node",
            &s.set_node_ssh_keys(999, &[], "op").await.unwrap(),
        );
        log("keys after", &s.node_ssh_keys(id).await.unwrap());

        // A lifecycle write under the version check: the stale one changes nothing.
        let mut tx = s.begin_node_tx().await.unwrap();
        let mut n = tx.node(id).await.unwrap().unwrap();
        let v = n.version;
        n.state = State::Reclaiming;
        n.hostname = Some("node-525400000001".into());
        n.generation += 1;
        n.boot_token = Some(crate::model::BootToken("t0k".into()));
        let reinstall = Audit {
            from: Some(State::Available),
            detail: Some("why"),
            ..Audit::new(id, n.generation, "reinstall", State::Reclaiming, "op")
        };
        log(
            "update",
            &tx.update_node_with_event(&n, v, &reinstall).await.unwrap(),
        );
        log(
            "stale update",
            &tx.update_node_with_event(&n, v, &reinstall).await.unwrap(),
        );
        tx.put_idempotent("key-1", id, "{}").await.unwrap();
        log(
            "first boot",
            &tx.first_boot_reported(id, n.generation).await.unwrap(),
        );
        // The lifecycle read is the three reads in one, before and after a first boot
        // and a netboot progress are recorded.
        {
            use crate::lifecycle::transition::{Netboot, NetbootMethod};
            for _ in 0..2 {
                let parts = (
                    tx.node(id).await.unwrap(),
                    tx.first_boot_reported(id, n.generation).await.unwrap(),
                    tx.netboot(id, n.generation).await.unwrap(),
                );
                let (row, reported, netboot) = tx.lifecycle_node(id).await.unwrap().unwrap();
                assert_eq!((Some(row), reported, netboot), parts);
                tx.append_event(&Audit::new(
                    id,
                    n.generation,
                    "first_boot_reported",
                    State::Reclaiming,
                    "op",
                ))
                .await
                .unwrap();
                let nb = Netboot {
                    method: NetbootMethod::OffOn,
                    tried: vec![NetbootMethod::Standard, NetbootMethod::OffOn],
                    observed: true,
                };
                tx.put_netboot(id, n.generation, &nb).await.unwrap();
            }
            let (_, reported, netboot) = tx.lifecycle_node(id).await.unwrap().unwrap();
            log("lifecycle", &(reported, &netboot));
            assert!(reported);
            assert_eq!(netboot.method, NetbootMethod::OffOn);
            assert!(tx.lifecycle_node(999).await.unwrap().is_none());
        }
        log("tx boot mac", &tx.boot_mac(id).await.unwrap());
        let exact = ["node-x".to_string(), "node-525400000001".into(), "y".into()];
        log(
            "among",
            &tx.hostnames_among(&exact, "node-5254").await.unwrap(),
        );
        tx.commit().await.unwrap();
        // Dropped without commit: rolled back.
        let mut tx = s.begin_node_tx().await.unwrap();
        let mut n2 = tx.node(id).await.unwrap().unwrap();
        let v2 = n2.version;
        n2.state = State::Failed;
        let failed = Audit::new(id, n2.generation, "failed", State::Failed, "op");
        tx.update_node_with_event(&n2, v2, &failed).await.unwrap();
        drop(tx);
        log(
            "after rollback",
            &s.node(id).await.unwrap().map(|n| (n.state, n.version)),
        );
        // The update and its audit row together (one round trip on SQLite): a stale
        // version writes neither, even in a transaction that commits; a fresh one both.
        let events_before = s.events(id).await.unwrap().len();
        let audit = Audit {
            from: Some(State::Reclaiming),
            detail: Some("both"),
            ..Audit::new(id, n.generation, "power_cycled", State::Netbooting, "op")
        };
        let mut tx = s.begin_node_tx().await.unwrap();
        let mut n3 = tx.node(id).await.unwrap().unwrap();
        let v3 = n3.version;
        n3.state = State::Netbooting;
        log(
            "stale update with event",
            &tx.update_node_with_event(&n3, v3 - 1, &audit)
                .await
                .unwrap(),
        );
        log(
            "update with event",
            &tx.update_node_with_event(&n3, v3, &audit).await.unwrap(),
        );
        tx.commit().await.unwrap();
        let after = s.node(id).await.unwrap().unwrap();
        log(
            "after update with event",
            &(after.state, after.version - v3),
        );
        let events = s.events(id).await.unwrap();
        assert_eq!(events.len(), events_before + 1);
        log(
            "its event",
            &events
                .iter()
                .find(|e| e.detail.as_deref() == Some("both"))
                .map(|e| (&e.event, e.from_state, e.to_state, &e.actor)),
        );
        log(
            "by token",
            &s.node_by_credential("t0k").await.unwrap().map(|n| n.id),
        );
        log("idempotent", &s.idempotent("key-1").await.unwrap());
        log("hostnames", &s.hostnames().await.unwrap());
        log(
            "taken",
            &s.hostname_taken("node-525400000001").await.unwrap(),
        );
        log(
            "in states",
            &s.nodes_in_states(&[State::Reclaiming]).await.unwrap().len(),
        );
        log("counts", &s.state_counts().await.unwrap());

        // Discovery: a known MAC is skipped, a new one registered once.
        let seen = [(mac(1), None), (mac(9), Some(Arch::X86_64)), (mac(9), None)];
        log("discovered", &s.discover_many(&seen).await.unwrap().len());
        log(
            "unknown",
            &s.unknown_macs(&[mac(1), mac(9), mac(10)]).await.unwrap(),
        );
        let mut boot = s
            .nodes_by_boot_macs(&[mac(1), mac(2), mac(3)])
            .await
            .unwrap();
        boot.sort_by_key(|b| b.id);
        log("boot macs", &boot);
        log("pending", &s.pending_discovered().await.unwrap());
        s.set_arch(other, Arch::X86_64).await.unwrap();
        let page = s.nodes_page(0, 2, None).await.unwrap();
        log(
            "page",
            &page
                .iter()
                .map(|(n, m)| (n.id, n.arch, m.clone()))
                .collect::<Vec<_>>(),
        );
        let page = s.nodes_page(id, 5, Some(State::Discovered)).await.unwrap();
        log(
            "page 2",
            &page
                .iter()
                .map(|(n, m)| (n.id, m.clone()))
                .collect::<Vec<_>>(),
        );

        log("deleted", &s.delete_node(other, "op").await.unwrap());
        log("deleted again", &s.delete_node(other, "op").await.unwrap());
        log(
            "nodes",
            &s.nodes()
                .await
                .unwrap()
                .iter()
                .map(|n| n.id)
                .collect::<Vec<_>>(),
        );
        for node in [id, other] {
            let events: Vec<_> = s
                .events(node)
                .await
                .unwrap()
                .into_iter()
                .map(|e| {
                    (
                        e.generation,
                        e.from_state,
                        e.event,
                        e.to_state,
                        e.actor,
                        e.detail,
                    )
                })
                .collect();
            log("events", &events);
        }
        out
    }

    #[tokio::test]
    async fn nodes_behave_the_same_on_both_backends() {
        let dir = tempfile::tempdir().unwrap();
        let [lite, pg] = crate::store::test_stores(dir.path()).await;
        let a = node_transcript(&lite).await;
        let b = node_transcript(&pg).await;
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x, y, "sqlite, then postgresql");
        }
        assert_eq!(a.len(), b.len());
        // And what both say is right (a few that matter).
        let has = |line: &str| assert!(a.iter().any(|l| l == line), "{line} in {a:#?}");
        has("secret: Some(\"s3cret-pw\")");
        has("update: true");
        has("stale update: false");
        has("after rollback: Some((Reclaiming, 1))");
        has("stale update with event: false");
        has("update with event: true");
        has("after update with event: (Netbooting, 1)");
        has("its event: Some((\"power_cycled\", Some(Reclaiming), Netbooting, \"op\"))");
        has("discovered: 1");
        has("deleted again: false");
        has("boot mac: Some(Mac([82, 84, 0, 0, 0, 1]))");
    }
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, OnceLock};

    /// Counts the statements sqlx runs whose text contains each needle. sqlx logs every
    /// statement as a `sqlx::query` event, from the SQLite worker thread, so the
    /// subscriber must be global (one per test binary: this is the only test that sets
    /// one).
    struct StatementCounter {
        needles: Vec<(&'static str, AtomicUsize)>,
    }

    impl StatementCounter {
        fn get(&self, needle: &str) -> usize {
            self.needles
                .iter()
                .find(|(n, _)| *n == needle)
                .map(|(_, c)| c.load(Ordering::SeqCst))
                .unwrap_or(0)
        }
    }

    struct Layer(Arc<StatementCounter>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Layer {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if event.metadata().target() != "sqlx::query" {
                return;
            }
            struct Text(String);
            impl tracing::field::Visit for Text {
                fn record_debug(&mut self, _: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    self.0.push_str(&format!("{v:?} "));
                }
                fn record_str(&mut self, _: &tracing::field::Field, v: &str) {
                    self.0.push_str(v);
                    self.0.push(' ');
                }
            }
            let mut t = Text(String::new());
            event.record(&mut t);
            let text = t.0.split_whitespace().collect::<Vec<_>>().join(" ");
            for (needle, count) in &self.0.needles {
                if text.contains(needle) {
                    count.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }

    fn counter() -> Arc<StatementCounter> {
        static C: OnceLock<Arc<StatementCounter>> = OnceLock::new();
        C.get_or_init(|| {
            use tracing_subscriber::layer::SubscriberExt;
            let c = Arc::new(StatementCounter {
                needles: vec![
                    ("FROM interfaces WHERE node_id = ?", AtomicUsize::new(0)),
                    ("FROM interfaces WHERE node_id > ?", AtomicUsize::new(0)),
                ],
            });
            let sub = tracing_subscriber::registry()
                .with(
                    tracing_subscriber::filter::Targets::new()
                        .with_target("sqlx::query", tracing::Level::DEBUG),
                )
                .with(Layer(c.clone()));
            tracing::subscriber::set_global_default(sub).expect("one global subscriber");
            c
        })
        .clone()
    }

    /// Listing N nodes with their MACs is two statements, not one per node (the API
    /// listing and the status page once ran an interfaces query per node).
    #[tokio::test]
    async fn listing_nodes_is_not_one_query_per_node() {
        let counter = counter();
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(dir.path()).await.unwrap();
        for i in 0..40u8 {
            let n = NewNode {
                name: None,
                arch: Arch::X86_64.into(),
                state: State::Available,
                macs: vec![
                    Mac([0x52, 0x54, 0, 0, 0x10, i]),
                    Mac([0x52, 0x54, 0, 0, 0x11, i]),
                ],
                boot_mac: None,
                bmc: None,
                ssh_authorized_keys: vec![],
            };
            store.create_node(&n, "test").await.unwrap();
        }
        let per_node = counter.get("FROM interfaces WHERE node_id = ?");
        let batch = counter.get("FROM interfaces WHERE node_id > ?");
        let listed = store.nodes_page(0, 1000, None).await.unwrap();
        assert_eq!(listed.len(), 40);
        assert!(listed.iter().all(|(_, m)| m.len() == 2));
        assert_eq!(
            listed[3].1,
            [
                "52:54:00:00:10:03".parse::<Mac>().unwrap(),
                "52:54:00:00:11:03".parse().unwrap()
            ],
            "boot MAC first"
        );
        assert_eq!(
            counter.get("FROM interfaces WHERE node_id = ?") - per_node,
            0
        );
        assert_eq!(counter.get("FROM interfaces WHERE node_id > ?") - batch, 1);
        // Pages follow each other by id, and a state filter is SQL too.
        let first = store.nodes_page(0, 15, None).await.unwrap();
        let second = store.nodes_page(first[14].0.id, 15, None).await.unwrap();
        assert_eq!(first.len() + second.len(), 30);
        assert_eq!(second[0].0.id, first[14].0.id + 1);
        assert_eq!(second[0].1.len(), 2);
        assert!(
            store
                .nodes_page(0, 10, Some(State::Failed))
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            store.state_counts().await.unwrap(),
            vec![(State::Available, 40)]
        );
        // The counter does see per-node queries: one for one node.
        store.macs(listed[0].0.id).await.unwrap();
        assert_eq!(
            counter.get("FROM interfaces WHERE node_id = ?") - per_node,
            1
        );
        // And filtering by state happens in SQL.
        let some = store.nodes_in_states(&[State::Available]).await.unwrap();
        assert_eq!(some.len(), 40);
        assert!(
            store
                .nodes_in_states(&[State::Failed])
                .await
                .unwrap()
                .is_empty()
        );
    }
}
