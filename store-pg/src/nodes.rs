//! Nodes, interfaces, BMC endpoints, the audit log and idempotency keys on
//! PostgreSQL: the queries behind pxed's `store::nodes`. Rows decode into the same
//! types as on SQLite (`pxed_model::rows`); timestamps are written as the caller
//! gives them (pxed's store owns their format).

use pxed_model::rows::{Audit, BmcRow, BootMacNode, EventView, InterfaceRow, NodeRow};
use pxed_model::{Arch, BmcStep, Mac, NodeArch, State};
use sqlx::{Postgres, Transaction};

use super::{PgError, PgStore};

/// A write transaction (READ COMMITTED; the lifecycle's version check makes a lost
/// race an `update_node` that changes nothing). Dropped without `commit`, it rolls
/// back.
#[derive(Debug)]
pub struct PgTx(Transaction<'static, Postgres>);

impl PgStore {
    /// Begins a write transaction.
    pub async fn begin(&self) -> Result<PgTx, PgError> {
        Ok(PgTx(self.pool.begin().await?))
    }

    /// One node by id.
    pub async fn node(&self, id: i64) -> Result<Option<NodeRow>, PgError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id = $1"#, id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The first node (by id) named or with the hostname `reference`.
    pub async fn node_by_name(&self, reference: &str) -> Result<Option<NodeRow>, PgError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE name = $1 OR hostname = $1 ORDER BY id LIMIT 1"#, reference)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The node owning `mac`.
    pub async fn node_by_mac(&self, mac: Mac) -> Result<Option<NodeRow>, PgError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id = (SELECT node_id FROM interfaces WHERE mac = $1)"#, mac as Mac)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The node whose boot token or agent token is `token`.
    pub async fn node_by_credential(&self, token: &str) -> Result<Option<NodeRow>, PgError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE boot_token = $1 OR agent_token = $1"#, token)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// All nodes, by id.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, PgError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes ORDER BY nodes.id"#)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Nodes in any of `states`, by id.
    pub async fn nodes_in_states(&self, states: &[State]) -> Result<Vec<NodeRow>, PgError> {
        let states: Vec<String> = states.iter().map(ToString::to_string).collect();
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE state = ANY($1) ORDER BY id"#, &states)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Up to `limit` nodes with an id above `after` (only those in `state` if given).
    pub async fn nodes_after(
        &self,
        after: i64,
        limit: i64,
        state: Option<State>,
    ) -> Result<Vec<NodeRow>, PgError> {
        let state = state.map(|s| s.to_string());
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id > $1 AND ($2::text IS NULL OR state = $2) ORDER BY id LIMIT $3"#, after, state, limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// The interfaces of nodes with ids in `(after, last]`, by node, boot NIC first.
    pub async fn interfaces_between(
        &self,
        after: i64,
        last: i64,
    ) -> Result<Vec<InterfaceRow>, PgError> {
        Ok(sqlx::query_as!(
            InterfaceRow,
            r#"SELECT mac AS "mac: _", node_id, is_boot FROM interfaces
                WHERE node_id > $1 AND node_id <= $2
                ORDER BY node_id, is_boot DESC, mac COLLATE "C""#,
            after,
            last
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// How many nodes are in each state that has any.
    pub async fn state_counts(&self) -> Result<Vec<(State, i64)>, PgError> {
        let rows = sqlx::query!(
            r#"SELECT state AS "state: State", COUNT(*) AS "n!" FROM nodes GROUP BY state"#
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|r| (r.state, r.n)).collect())
    }

    /// The MACs of a node, boot MAC first.
    pub async fn macs(&self, node_id: i64) -> Result<Vec<Mac>, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE node_id = $1
                ORDER BY is_boot DESC, mac COLLATE "C""#,
            node_id
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The audit log of a node, oldest first.
    pub async fn events(&self, node_id: i64) -> Result<Vec<EventView>, PgError> {
        Ok(sqlx::query_as!(
            EventView,
            r#"SELECT id, node_id, generation, from_state AS "from_state: _", event,
                      to_state AS "to_state: _", at, actor, detail
                 FROM node_events WHERE node_id = $1 ORDER BY id"#,
            node_id
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// One audit row, by its id (announced by another instance).
    pub async fn event(&self, id: i64) -> Result<Option<EventView>, PgError> {
        Ok(sqlx::query_as!(
            EventView,
            r#"SELECT id, node_id, generation, from_state AS "from_state: _", event,
                      to_state AS "to_state: _", at, actor, detail
                 FROM node_events WHERE id = $1"#,
            id
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The BMC endpoint of a node (without secret).
    pub async fn bmc(&self, node_id: i64) -> Result<Option<BmcRow>, PgError> {
        Ok(sqlx::query_as!(BmcRow, r#"SELECT node_id, driver AS "driver: _", address, username, system_id, tls_pin, tls_insecure FROM bmcs WHERE node_id = $1"#, node_id)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The stored (sealed) BMC password of a node.
    pub async fn bmc_secret(&self, node_id: i64) -> Result<Option<String>, PgError> {
        Ok(sqlx::query_scalar!(
            "SELECT password FROM bmc_secrets WHERE node_id = $1",
            node_id
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Stores the TLS fingerprint pinned on first use.
    pub async fn pin_bmc_cert(&self, node_id: i64, pin: &str) -> Result<(), PgError> {
        sqlx::query!(
            "UPDATE bmcs SET tls_pin = $1 WHERE node_id = $2",
            pin,
            node_id
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The node's own SSH keys, in order.
    pub async fn node_ssh_keys(&self, node_id: i64) -> Result<Vec<String>, PgError> {
        Ok(sqlx::query_scalar!(
            "SELECT key FROM node_ssh_keys WHERE node_id = $1 ORDER BY position",
            node_id
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Whether any node has `hostname`.
    pub async fn hostname_taken(&self, hostname: &str) -> Result<bool, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM nodes WHERE hostname = $1) AS "taken!""#,
            hostname
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// All hostnames in use.
    pub async fn hostnames(&self) -> Result<Vec<String>, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT hostname AS "hostname!" FROM nodes WHERE hostname IS NOT NULL"#
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// A stored idempotent answer: (node, response).
    pub async fn idempotent(&self, key: &str) -> Result<Option<(i64, String)>, PgError> {
        Ok(sqlx::query!(
            "SELECT node_id, response FROM idempotency WHERE key = $1",
            key
        )
        .fetch_optional(&self.pool)
        .await?
        .map(|r| (r.node_id, r.response)))
    }

    /// Those of `macs` that belong to a node.
    pub async fn known_macs(&self, macs: &[Mac]) -> Result<Vec<Mac>, PgError> {
        let list: Vec<String> = macs.iter().map(ToString::to_string).collect();
        Ok(sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE mac = ANY($1)"#,
            &list
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The nodes whose boot MAC is one of `macs`, and whether their current attempt's
    /// power cycle was recorded as sent.
    pub async fn nodes_by_boot_macs(&self, macs: &[Mac]) -> Result<Vec<BootMacNode>, PgError> {
        let list: Vec<String> = macs.iter().map(ToString::to_string).collect();
        let cycle = BmcStep::PowerCycle.to_string();
        Ok(sqlx::query_as!(
            BootMacNode,
            r#"SELECT i.mac AS "mac: Mac", n.id, n.state AS "state: State", n.generation,
                      EXISTS (SELECT 1 FROM bmc_intents b WHERE b.node_id = n.id
                              AND b.generation = n.generation AND b.attempt = n.attempt
                              AND b.step = $1) AS "cycle_sent!",
                      COALESCE(p.observed, FALSE) AS "netboot_observed!"
                 FROM interfaces i JOIN nodes n ON n.id = i.node_id
                 LEFT JOIN netboot_progress p ON p.node_id = n.id AND p.generation = n.generation
                WHERE i.is_boot AND i.mac = ANY($2)"#,
            cycle,
            &list
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// How many nodes are in `state`.
    pub async fn count_in_state(&self, state: State) -> Result<i64, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT COUNT(*) AS "n!" FROM nodes WHERE state = $1"#,
            state as State
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Records the architecture a node reported.
    pub async fn set_arch(&self, id: i64, arch: Arch) -> Result<(), PgError> {
        sqlx::query!("UPDATE nodes SET arch = $1 WHERE id = $2", arch as Arch, id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

impl PgTx {
    /// The transaction's connection.
    pub(crate) fn conn(&mut self) -> &mut sqlx::PgConnection {
        &mut self.0
    }

    /// Commits.
    pub async fn commit(self) -> Result<(), PgError> {
        Ok(self.0.commit().await?)
    }

    /// The node, as this transaction sees it, locked until the transaction ends (so
    /// two writers of one node take turns instead of one losing its version check).
    pub async fn node(&mut self, id: i64) -> Result<Option<NodeRow>, PgError> {
        Ok(sqlx::query_as!(NodeRow, r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site FROM nodes WHERE id = $1 FOR UPDATE"#, id)
            .fetch_optional(&mut *self.0)
            .await?)
    }

    /// Waits for, then holds until the transaction ends, the lock (ASCII "pxeddd")
    /// that makes registrations by discovery one at a time across instances: two
    /// instances that see the same new MAC at once would otherwise both insert it, and
    /// the second's whole batch would fail on the MAC's key.
    pub async fn lock_discovery(&mut self) -> Result<(), PgError> {
        sqlx::query!("SELECT pg_advisory_xact_lock(123662399464548)")
            .fetch_one(&mut *self.0)
            .await?;
        Ok(())
    }

    /// Locks the node's row until the transaction ends (whether or not it exists).
    pub async fn lock_node(&mut self, id: i64) -> Result<(), PgError> {
        sqlx::query!("SELECT id FROM nodes WHERE id = $1 FOR UPDATE", id)
            .fetch_optional(&mut *self.0)
            .await?;
        Ok(())
    }

    /// Inserts a node row; its id.
    pub async fn insert_node(
        &mut self,
        name: Option<&str>,
        arch: NodeArch,
        state: State,
        at: &str,
    ) -> Result<i64, PgError> {
        Ok(sqlx::query_scalar!(
            "INSERT INTO nodes (name, arch, state, state_since, created_at)
             VALUES ($1, $2, $3, $4, $4) RETURNING id",
            name,
            arch as NodeArch,
            state as State,
            at
        )
        .fetch_one(&mut *self.0)
        .await?)
    }

    /// Inserts an interface.
    pub async fn insert_interface(
        &mut self,
        mac: Mac,
        node_id: i64,
        is_boot: bool,
    ) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO interfaces (mac, node_id, is_boot) VALUES ($1, $2, $3)",
            mac as Mac,
            node_id,
            is_boot
        )
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    /// The node that has `mac`, if any.
    pub async fn node_of_mac(&mut self, mac: Mac) -> Result<Option<i64>, PgError> {
        Ok(
            sqlx::query_scalar!("SELECT node_id FROM interfaces WHERE mac = $1", mac as Mac)
                .fetch_optional(&mut *self.0)
                .await?,
        )
    }

    /// Sets the BMC endpoint; and the password (already sealed) if given.
    pub async fn set_bmc(&mut self, b: &BmcRow, sealed: Option<&str>) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO bmcs (node_id, driver, address, username, system_id, tls_pin, tls_insecure)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (node_id) DO UPDATE SET driver = EXCLUDED.driver,
               address = EXCLUDED.address, username = EXCLUDED.username,
               system_id = EXCLUDED.system_id, tls_pin = EXCLUDED.tls_pin,
               tls_insecure = EXCLUDED.tls_insecure",
            b.node_id,
            b.driver.to_string(),
            b.address,
            b.username,
            b.system_id,
            b.tls_pin,
            b.tls_insecure
        )
        .execute(&mut *self.0)
        .await?;
        if let Some(p) = sealed {
            sqlx::query!(
                "INSERT INTO bmc_secrets (node_id, password) VALUES ($1, $2)
                 ON CONFLICT (node_id) DO UPDATE SET password = EXCLUDED.password",
                b.node_id,
                p
            )
            .execute(&mut *self.0)
            .await?;
        }
        Ok(())
    }

    /// Replaces the node's own SSH keys.
    pub async fn set_ssh_keys(&mut self, node_id: i64, keys: &[String]) -> Result<(), PgError> {
        sqlx::query!("DELETE FROM node_ssh_keys WHERE node_id = $1", node_id)
            .execute(&mut *self.0)
            .await?;
        sqlx::query!(
            "INSERT INTO node_ssh_keys (node_id, position, key)
             SELECT $1, p - 1, k FROM UNNEST($2::text[]) WITH ORDINALITY AS t(k, p)",
            node_id,
            keys
        )
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    /// Appends one audit row at `at`.
    pub async fn append_event(&mut self, e: &Audit<'_>, at: &str) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO node_events (node_id, generation, from_state, event, to_state, at, actor, detail)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            e.node_id,
            e.generation,
            e.from.map(|s| s.to_string()),
            e.event,
            e.to.to_string(),
            at,
            e.actor,
            e.detail
        )
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    /// Writes `n`'s lifecycle fields if its version is still `expected_version`.
    pub async fn update_node(
        &mut self,
        n: &NodeRow,
        expected_version: i64,
    ) -> Result<bool, PgError> {
        let r = sqlx::query!(
            "UPDATE nodes SET state = $1, state_since = $2, version = version + 1,
                 generation = $3, attempt = $4, image = $5, boot_token = $6, agent_token = $7,
                 boot_ip = $8, failed_step = $9, failed_reason = $10, facts = $11,
                 hostname = $12, arch = $13
             WHERE id = $14 AND version = $15",
            n.state.to_string(),
            n.state_since,
            n.generation,
            n.attempt,
            n.image,
            n.boot_token.as_ref().map(|t| t.0.clone()),
            n.agent_token.as_ref().map(|t| t.0.clone()),
            n.boot_ip,
            n.failed_step.map(|s| s.to_string()),
            n.failed_reason,
            n.facts,
            n.hostname,
            n.arch.to_string(),
            n.id,
            expected_version
        )
        .execute(&mut *self.0)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Deletes a node (its interfaces, BMC and secrets cascade).
    pub async fn delete_node(&mut self, id: i64) -> Result<(), PgError> {
        sqlx::query!("DELETE FROM nodes WHERE id = $1", id)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    /// Records an idempotency key's answer.
    pub async fn put_idempotent(
        &mut self,
        key: &str,
        node_id: i64,
        response: &str,
        at: &str,
    ) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO idempotency (key, node_id, response, created_at) VALUES ($1, $2, $3, $4)",
            key,
            node_id,
            response,
            at
        )
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    /// The node's boot NIC.
    pub async fn boot_mac(&mut self, id: i64) -> Result<Option<Mac>, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE node_id = $1
                ORDER BY is_boot DESC, mac COLLATE "C" LIMIT 1"#,
            id
        )
        .fetch_optional(&mut *self.0)
        .await?)
    }

    /// Whether the first boot of `generation` was reported already.
    pub async fn first_boot_reported(&mut self, id: i64, generation: i64) -> Result<bool, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM node_events WHERE node_id = $1 AND generation = $2
                              AND event = 'first_boot_reported') AS "reported!""#,
            id,
            generation
        )
        .fetch_one(&mut *self.0)
        .await?)
    }

    /// The hostnames in use among `exact`, and those starting with `stem`.
    pub async fn hostnames_among(
        &mut self,
        exact: &[String; 3],
        stem: &str,
    ) -> Result<Vec<String>, PgError> {
        let upper = format!("{stem}~");
        Ok(sqlx::query_scalar!(
            r#"SELECT hostname AS "hostname!" FROM nodes
                WHERE hostname = ANY($1)
                   OR (hostname COLLATE "C" >= $2 AND hostname COLLATE "C" < $3)"#,
            exact.as_slice(),
            stem,
            upper
        )
        .fetch_all(&mut *self.0)
        .await?)
    }
}
