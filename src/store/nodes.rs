//! Nodes, their interfaces, BMC endpoints, the audit log and idempotency keys.

use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::SqliteConnection;

use super::{Store, StoreError};
use crate::model::{Arch, Mac, NodeArch, State};

/// One row of the append-only audit log: the API's view of it, field for field.
pub type EventRow = crate::wire::EventView;

pub use crate::model::rows::{BmcRow, BootMacNode, InterfaceRow, NodeRow};

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
        let mut tx = self.write().await?;
        let t = now();
        let id = sqlx::query_scalar!(
            r#"INSERT INTO nodes (name, arch, state, state_since, created_at)
               VALUES (?, ?, ?, ?, ?) RETURNING id"#,
            n.name,
            n.arch,
            n.state,
            t,
            t
        )
        .fetch_one(&mut *tx)
        .await?;
        let boot = n.boot_mac.or_else(|| n.macs.first().copied());
        for mac in &n.macs {
            let is_boot = Some(*mac) == boot;
            sqlx::query!(
                "INSERT INTO interfaces (mac, node_id, is_boot) VALUES (?, ?, ?)",
                mac,
                id,
                is_boot
            )
            .execute(&mut *tx)
            .await?;
        }
        if let Some((b, password)) = &n.bmc {
            set_bmc_tx(&mut tx, &self.key, id, b, Some(password)).await?;
        }
        set_ssh_keys_tx(&mut tx, id, &n.ssh_authorized_keys).await?;
        let e = Audit::new(id, 0, "registered", n.state, actor);
        append_event(&mut tx, &e).await?;
        tx.commit().await?;
        Ok(id)
    }

    /// The node's own SSH authorized keys, in the order they were given.
    pub async fn node_ssh_keys(&self, node_id: i64) -> Result<Vec<String>, StoreError> {
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
        let mut tx = self.write().await?;
        let Some(row) = sqlx::query!(
            r#"SELECT state AS "state: State", generation FROM nodes WHERE id = ?"#,
            node_id
        )
        .fetch_optional(&mut *tx)
        .await?
        else {
            return Ok(false);
        };
        set_ssh_keys_tx(&mut tx, node_id, keys).await?;
        let detail = format!("{} key(s); they reach the next install", keys.len());
        let mut e = Audit::new(node_id, row.generation, "ssh_keys_set", row.state, actor);
        e.from = Some(row.state);
        e.detail = Some(&detail);
        append_event(&mut tx, &e).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// One node by id.
    pub async fn node(&self, id: i64) -> Result<Option<NodeRow>, StoreError> {
        Ok(
            sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE id = ?"#, id)
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
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE name = ? OR hostname = ? LIMIT 1"#,
            reference,
            reference
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// The node owning `mac` (normalized).
    pub async fn node_by_mac(&self, mac: Mac) -> Result<Option<NodeRow>, StoreError> {
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE id = (SELECT node_id FROM interfaces WHERE mac = ?)"#,
            mac
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// The node whose current boot token or agent token is `token` (the caller tells
    /// which by comparing; both are unique and random, so at most one node matches).
    pub async fn node_by_credential(&self, token: &str) -> Result<Option<NodeRow>, StoreError> {
        Ok(
            sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE boot_token = ? OR agent_token = ?"#, token, token)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// All nodes, by id.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes ORDER BY id"#)
            .fetch_all(self.pool()?)
            .await?)
    }

    /// Nodes in any of `states` (those with deadlines are re-armed on start).
    pub async fn nodes_in_states(&self, states: &[State]) -> Result<Vec<NodeRow>, StoreError> {
        let states = serde_json::json!(states).to_string();
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE state IN (SELECT value FROM json_each(?)) ORDER BY id"#,
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
        let nodes = sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE id > ? AND (? IS NULL OR state = ?) ORDER BY id LIMIT ?"#, after, state, state, limit)
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
        let mut macs: std::collections::HashMap<i64, Vec<Mac>> = Default::default();
        for i in ifaces {
            macs.entry(i.node_id).or_default().push(i.mac);
        }
        Ok(nodes
            .into_iter()
            .map(|n| {
                let m = macs.remove(&n.id).unwrap_or_default();
                (n, m)
            })
            .collect())
    }

    /// How many nodes are in each state (states with none left out).
    pub async fn state_counts(&self) -> Result<Vec<(State, i64)>, StoreError> {
        let rows = sqlx::query!(
            r#"SELECT state AS "state: State", COUNT(*) AS "n!: i64" FROM nodes GROUP BY state"#
        )
        .fetch_all(self.pool()?)
        .await?;
        let mut counts: Vec<(State, i64)> = rows.into_iter().map(|r| (r.state, r.n)).collect();
        counts.sort_by_key(|(s, _)| State::ALL.iter().position(|x| x == s));
        Ok(counts)
    }

    /// The MACs of a node, boot MAC first.
    pub async fn macs(&self, node_id: i64) -> Result<Vec<Mac>, StoreError> {
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
        Ok(
            sqlx::query_as!(BmcRow, r#"SELECT node_id, driver AS "driver: _", address, username, system_id, tls_pin, tls_insecure AS "tls_insecure: _" FROM bmcs WHERE node_id = ?"#, node_id)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// The BMC password of a node, opened with the secret key. Only the BMC worker
    /// calls this.
    pub async fn bmc_secret(&self, node_id: i64) -> Result<Option<String>, StoreError> {
        let stored = sqlx::query_scalar!(
            "SELECT password FROM bmc_secrets WHERE node_id = ?",
            node_id
        )
        .fetch_optional(self.pool()?)
        .await?;
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
        let mut tx = self.write().await?;
        let Some(n) = sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE id = ?"#, id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        sqlx::query!("DELETE FROM nodes WHERE id = ?", id)
            .execute(&mut *tx)
            .await?;
        let e = Audit {
            from: Some(n.state),
            ..Audit::new(id, n.generation, "deleted", n.state, actor)
        };
        append_event(&mut tx, &e).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Whether a hostname is used by any node.
    pub async fn hostname_taken(&self, hostname: &str) -> Result<bool, StoreError> {
        Ok(
            sqlx::query_scalar!("SELECT COUNT(*) FROM nodes WHERE hostname = ?", hostname)
                .fetch_one(self.pool()?)
                .await?
                > 0,
        )
    }

    /// All hostnames in use.
    pub async fn hostnames(&self) -> Result<Vec<String>, StoreError> {
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
    pub(super) tx: super::Write,
}

impl Store {
    /// Starts a lifecycle write transaction.
    pub async fn begin_node_tx(&self) -> Result<NodeTx, StoreError> {
        Ok(NodeTx {
            tx: self.write().await?,
        })
    }
}

impl NodeTx {
    /// The node, as this transaction sees it.
    pub async fn node(&mut self, id: i64) -> Result<Option<NodeRow>, StoreError> {
        node_tx(&mut self.tx, id).await
    }

    /// Whether the node's first boot of `generation` was reported already.
    pub async fn first_boot_reported(
        &mut self,
        id: i64,
        generation: i64,
    ) -> Result<bool, StoreError> {
        let n = sqlx::query_scalar!(
            r#"SELECT COUNT(*) FROM node_events
               WHERE node_id = ? AND generation = ? AND event = 'first_boot_reported'"#,
            id,
            generation
        )
        .fetch_one(&mut *self.tx)
        .await?;
        Ok(n > 0)
    }

    /// Writes `n`'s lifecycle fields if its version is still `expected_version`;
    /// false when another writer got there first.
    pub async fn update_node(
        &mut self,
        n: &NodeRow,
        expected_version: i64,
    ) -> Result<bool, StoreError> {
        update_node_tx(&mut self.tx, n, expected_version).await
    }

    /// Appends one audit row.
    pub async fn append_event(&mut self, e: &Audit<'_>) -> Result<(), StoreError> {
        append_event(&mut self.tx, e).await
    }

    /// Records an idempotency key's answer with the change that produced it.
    pub async fn put_idempotent(
        &mut self,
        key: &str,
        node_id: i64,
        response: &str,
    ) -> Result<(), StoreError> {
        put_idempotent(&mut self.tx, key, node_id, response).await
    }

    /// The node's boot NIC.
    pub async fn boot_mac(&mut self, id: i64) -> Result<Option<Mac>, StoreError> {
        boot_mac_tx(&mut self.tx, id).await
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
        .fetch_all(&mut *self.tx)
        .await?
        .into_iter()
        .flatten()
        .collect())
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await
    }
}

/// Loads a node inside a transaction.
async fn node_tx(conn: &mut SqliteConnection, id: i64) -> Result<Option<NodeRow>, StoreError> {
    Ok(
        sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at FROM nodes WHERE id = ?"#, id)
            .fetch_optional(conn)
            .await?,
    )
}

/// Writes a node's lifecycle fields if its version is still `expected`; returns false
/// when another writer got there first (the caller retries or reports a conflict).
async fn update_node_tx(
    conn: &mut SqliteConnection,
    n: &NodeRow,
    expected_version: i64,
) -> Result<bool, StoreError> {
    let r = sqlx::query!(
        r#"UPDATE nodes SET state = ?, state_since = ?, version = version + 1, generation = ?,
               attempt = ?, image = ?, boot_token = ?, agent_token = ?, boot_ip = ?,
               failed_step = ?, failed_reason = ?, facts = ?, hostname = ?, arch = ?
           WHERE id = ? AND version = ?"#,
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
        expected_version
    )
    .execute(conn)
    .await?;
    Ok(r.rows_affected() == 1)
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
        let mut w = self.write().await?;
        let e = Audit {
            from: Some(state),
            detail: Some(detail),
            ..Audit::new(node_id, generation, event, state, actor)
        };
        append_event(&mut w, &e).await?;
        w.commit().await
    }
}

/// One row of the audit log, as written.
#[derive(Debug, Clone, Copy)]
pub struct Audit<'a> {
    pub node_id: i64,
    pub generation: i64,
    /// The state before (`None` for a registration).
    pub from: Option<State>,
    pub event: &'a str,
    pub to: State,
    pub actor: &'a str,
    pub detail: Option<&'a str>,
}

impl<'a> Audit<'a> {
    /// An entry with no `from` state and no detail.
    pub fn new(node_id: i64, generation: i64, event: &'a str, to: State, actor: &'a str) -> Self {
        Audit {
            node_id,
            generation,
            from: None,
            event,
            to,
            actor,
            detail: None,
        }
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
    key: &super::secrets::SecretKey,
    node_id: i64,
    b: &BmcRow,
    password: Option<&String>,
) -> Result<(), StoreError> {
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
    if let Some(p) = password {
        let p = key.seal(node_id, p);
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
        let mut tx = self.write().await?;
        let mut created = Vec::new();
        let t = now();
        for (mac, arch) in seen {
            let known = sqlx::query_scalar!("SELECT node_id FROM interfaces WHERE mac = ?", mac)
                .fetch_optional(&mut *tx)
                .await?;
            if known.is_some() {
                continue;
            }
            let arch = NodeArch(*arch);
            let state = State::Discovered;
            let id = sqlx::query_scalar!(
                r#"INSERT INTO nodes (arch, state, state_since, created_at)
                   VALUES (?, ?, ?, ?) RETURNING id"#,
                arch,
                state,
                t,
                t
            )
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query!(
                "INSERT INTO interfaces (mac, node_id, is_boot) VALUES (?, ?, 1)",
                mac,
                id
            )
            .execute(&mut *tx)
            .await?;
            let e = Audit {
                detail: Some(arch.as_str()),
                ..Audit::new(id, 0, "registered", state, "discovery")
            };
            append_event(&mut tx, &e).await?;
            created.push((id, *mac));
        }
        tx.commit().await?;
        Ok(created)
    }

    /// Which of `macs` belong to no node.
    pub async fn unknown_macs(&self, macs: &[Mac]) -> Result<Vec<Mac>, StoreError> {
        let list = serde_json::json!(macs).to_string();
        let known: std::collections::HashSet<Mac> = sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE mac IN (SELECT value FROM json_each(?))"#,
            list
        )
        .fetch_all(self.pool()?)
        .await?
        .into_iter()
        .collect();
        Ok(macs
            .iter()
            .copied()
            .filter(|m| !known.contains(m))
            .collect())
    }

    /// The nodes whose boot MAC is one of `macs`, and whether the power cycle of their
    /// current reclaim attempt was sent already (`bmc_intents`).
    pub async fn nodes_by_boot_macs(&self, macs: &[Mac]) -> Result<Vec<BootMacNode>, StoreError> {
        let list = serde_json::json!(macs).to_string();
        let cycle = crate::model::BmcStep::PowerCycle;
        let rows = sqlx::query!(
            r#"SELECT i.mac AS "mac: Mac", n.id, n.state AS "state: State", n.generation,
                      EXISTS (SELECT 1 FROM bmc_intents b WHERE b.node_id = n.id
                              AND b.generation = n.generation AND b.attempt = n.attempt
                              AND b.step = ?) AS "cycle_sent!: bool"
               FROM interfaces i JOIN nodes n ON n.id = i.node_id
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
            })
            .collect())
    }

    /// How many nodes are `discovered` (seen, not enrolled).
    pub async fn pending_discovered(&self) -> Result<u64, StoreError> {
        let state = State::Discovered;
        let n = sqlx::query_scalar!("SELECT COUNT(*) FROM nodes WHERE state = ?", state)
            .fetch_one(self.pool()?)
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Records the architecture a node reported (DHCP option 93 or the agent).
    pub async fn set_arch(&self, id: i64, arch: Arch) -> Result<(), StoreError> {
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
        let store = Store::open(dir.path()).await.unwrap();
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
