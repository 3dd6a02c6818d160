//! Installer telemetry: who sent a line (a node being installed, found by address), the
//! last lines per node generation (bounded), and the milestones on the timeline.

use super::nodes::{Audit, append_event, now};
use super::{Db, Store, StoreError};
use crate::model::State;

pub use crate::model::rows::{LogTarget, LogWrite};

/// One stored line, as the API returns it.
pub type LogLine = crate::wire::InstallLogLine;

/// Generations of a node whose lines are kept (the current one and the one before:
/// a repeated failure can be compared by eye).
const KEEP_GENERATIONS: i64 = 2;

impl Store {
    /// The node being installed (it holds a boot token) that `ip` belongs to: the
    /// address its installer was served to, or else an address pxed's DHCP server has
    /// bound to one of its MACs at `now` (Unix seconds).
    pub async fn log_target_by_ip(
        &self,
        ip: &str,
        now: i64,
    ) -> Result<Option<LogTarget>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.log_target_by_ip(ip, now).await?);
        }
        Ok(sqlx::query_as!(
            LogTarget,
            r#"SELECT n.id AS node_id, n.generation, n.state AS "state: _", i.family AS "family?",
                      n.boot_token AS "boot_token: _", n.agent_token AS "agent_token: _"
               FROM nodes n LEFT JOIN images i ON i.name = n.image
               WHERE n.boot_token IS NOT NULL
                 AND (n.boot_ip = ?
                      OR n.id IN (SELECT f.node_id FROM interfaces f JOIN leases l ON l.mac = f.mac
                                  WHERE l.ip = ? AND l.state = 'bound' AND l.expires_at > ?))
               ORDER BY (n.boot_ip = ?) DESC, n.id
               LIMIT 1"#,
            ip,
            ip,
            now,
            ip
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// The same for a node known by id (the reporting webhook proved it by token).
    pub async fn log_target(&self, node_id: i64) -> Result<Option<LogTarget>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.log_target(node_id).await?);
        }
        Ok(sqlx::query_as!(
            LogTarget,
            r#"SELECT n.id AS node_id, n.generation, n.state AS "state: _", i.family AS "family?",
                      n.boot_token AS "boot_token: _", n.agent_token AS "agent_token: _"
               FROM nodes n LEFT JOIN images i ON i.name = n.image
               WHERE n.id = ?"#,
            node_id
        )
        .fetch_optional(self.pool()?)
        .await?)
    }

    /// Stores a batch in one transaction, then keeps only the newest `keep` lines of
    /// each generation written to and only the last generations of each node.
    pub async fn append_install_log(
        &self,
        writes: &[LogWrite],
        keep: u32,
    ) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg
                .append_install_log(writes, i64::from(keep), KEEP_GENERATIONS)
                .await?);
        }
        let mut tx = self.write().await?;
        let mut touched = std::collections::BTreeSet::new();
        for w in writes {
            sqlx::query!(
                "INSERT INTO install_log (node_id, generation, at, source, line) VALUES (?, ?, ?, ?, ?)",
                w.node_id,
                w.generation,
                w.at,
                w.source,
                w.line
            )
            .execute(&mut *tx)
            .await?;
            touched.insert((w.node_id, w.generation));
        }
        let keep = i64::from(keep);
        for (node, generation) in touched {
            sqlx::query!(
                r#"DELETE FROM install_log WHERE node_id = ? AND generation = ? AND id <=
                     (SELECT id FROM install_log WHERE node_id = ? AND generation = ?
                      ORDER BY id DESC LIMIT 1 OFFSET ?)"#,
                node,
                generation,
                node,
                generation,
                keep
            )
            .execute(&mut *tx)
            .await?;
            let oldest = generation - KEEP_GENERATIONS + 1;
            sqlx::query!(
                "DELETE FROM install_log WHERE node_id = ? AND generation < ?",
                node,
                oldest
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The last `limit` lines of a node's `generation`, oldest first.
    pub async fn install_log(
        &self,
        node_id: i64,
        generation: i64,
        limit: u32,
    ) -> Result<Vec<LogLine>, StoreError> {
        let limit = i64::from(limit);
        if let Db::Postgres(pg) = &self.db {
            let mut rows = pg.install_log_newest(node_id, generation, limit).await?;
            rows.reverse();
            return Ok(rows);
        }
        let mut rows = sqlx::query_as!(
            LogLine,
            r#"SELECT at, source, line FROM install_log WHERE node_id = ? AND generation = ?
               ORDER BY id DESC LIMIT ?"#,
            node_id,
            generation,
            limit
        )
        .fetch_all(self.pool()?)
        .await?;
        rows.reverse();
        Ok(rows)
    }

    /// Appends a note (`from` = `to` = `state`) unless the node's `generation` has an
    /// `event` row already; true when it was written. Milestones go on the timeline once.
    pub async fn note_once(
        &self,
        node_id: i64,
        generation: i64,
        state: State,
        event: &str,
        actor: &str,
        detail: &str,
    ) -> Result<bool, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let e = Audit {
                from: Some(state),
                detail: Some(detail),
                ..Audit::new(node_id, generation, event, state, actor)
            };
            return Ok(pg.note_once(&e, &now()).await?);
        }
        let mut tx = self.write().await?;
        let seen = sqlx::query_scalar!(
            "SELECT COUNT(*) FROM node_events WHERE node_id = ? AND generation = ? AND event = ?",
            node_id,
            generation,
            event
        )
        .fetch_one(&mut *tx)
        .await?;
        if seen > 0 {
            return Ok(false);
        }
        let e = Audit {
            from: Some(state),
            detail: Some(detail),
            ..Audit::new(node_id, generation, event, state, actor)
        };
        append_event(&mut tx, &e).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The latest `install_failed` detail of a generation before `generation`, with its
    /// generation.
    pub async fn previous_install_failure(
        &self,
        node_id: i64,
        generation: i64,
    ) -> Result<Option<(i64, String)>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.previous_install_failure(node_id, generation).await?);
        }
        Ok(sqlx::query!(
            r#"SELECT generation, detail FROM node_events
               WHERE node_id = ? AND generation < ? AND event = 'install_failed'
               ORDER BY id DESC LIMIT 1"#,
            node_id,
            generation
        )
        .fetch_optional(self.pool()?)
        .await?
        .and_then(|r| r.detail.map(|d| (r.generation, d))))
    }
}

/// Current time as stored, for [`LogWrite::at`].
pub fn received_at() -> String {
    now()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Mac, NodeArch};
    use crate::store::nodes::NewNode;

    async fn installing_node(store: &Store, mac: u8) -> i64 {
        let n = NewNode {
            name: None,
            arch: NodeArch::UNKNOWN,
            state: State::Available,
            macs: vec![Mac([0x52, 0x54, 0, 0, 0, mac])],
            boot_mac: None,
            bmc: None,
            ssh_authorized_keys: vec![],
        };
        let id = store.create_node(&n, "test").await.unwrap();
        let mut tx = store.begin_node_tx().await.unwrap();
        let mut node = tx.node(id).await.unwrap().unwrap();
        let version = node.version;
        node.state = State::Installing;
        node.generation = 1;
        node.boot_token = Some(crate::model::BootToken(format!("boot-token-{mac}")));
        node.boot_ip = Some(format!("10.0.0.{mac}"));
        let audit = Audit::new(node.id, node.generation, "test", node.state, "test");
        assert!(
            tx.update_node_with_event(&node, version, &audit)
                .await
                .unwrap()
        );
        tx.commit().await.unwrap();
        id
    }

    /// A line's sender is the node whose installer was served to that address, or whose
    /// MAC holds a live lease on it; never a node at rest.
    #[tokio::test]
    async fn senders_are_found_by_boot_address_or_lease() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let a = installing_node(&store, 5).await;
        let t = store
            .log_target_by_ip("10.0.0.5", 100)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (t.node_id, t.generation, t.state),
            (a, 1, State::Installing)
        );
        assert_eq!(
            t.boot_token.as_ref().map(|t| t.as_str()),
            Some("boot-token-5")
        );
        assert!(
            store
                .log_target_by_ip("10.0.0.6", 100)
                .await
                .unwrap()
                .is_none()
        );
        // The installer's own DHCP got another address from pxed: found by the lease
        // while it lasts.
        let mac = store.boot_mac(a).await.unwrap().unwrap();
        let lease = crate::store::leases::LeaseRow {
            ip: "10.0.0.6".parse().unwrap(),
            mac: mac.to_string(),
            client_id: None,
            hostname: None,
            state: "bound".into(),
            expires_at: 200,
        };
        store
            .commit_leases(&[crate::store::leases::LeaseWrite::Upsert(lease)])
            .await
            .unwrap();
        let t = store.log_target_by_ip("10.0.0.6", 100).await.unwrap();
        assert_eq!(t.map(|t| t.node_id), Some(a));
        assert!(
            store
                .log_target_by_ip("10.0.0.6", 300)
                .await
                .unwrap()
                .is_none()
        );
        // At rest (no boot token): nobody's installer.
        let mut tx = store.begin_node_tx().await.unwrap();
        let mut node = tx.node(a).await.unwrap().unwrap();
        let version = node.version;
        node.state = State::Available;
        node.boot_token = None;
        let audit = Audit::new(node.id, node.generation, "test", node.state, "test");
        assert!(
            tx.update_node_with_event(&node, version, &audit)
                .await
                .unwrap()
        );
        tx.commit().await.unwrap();
        assert!(
            store
                .log_target_by_ip("10.0.0.5", 100)
                .await
                .unwrap()
                .is_none()
        );
    }

    /// The newest `keep` lines of a generation stay, and the last two generations.
    #[tokio::test]
    async fn storage_is_bounded_per_generation() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let id = installing_node(&store, 7).await;
        let w = |generation: i64, i: usize| LogWrite {
            node_id: id,
            generation,
            at: received_at(),
            source: "syslog",
            line: format!("line {i}"),
        };
        for chunk in (0..30).collect::<Vec<_>>().chunks(7) {
            let batch: Vec<LogWrite> = chunk.iter().map(|i| w(1, *i)).collect();
            store.append_install_log(&batch, 20).await.unwrap();
        }
        let lines = store.install_log(id, 1, 1000).await.unwrap();
        assert_eq!(lines.len(), 20);
        assert_eq!(lines.first().unwrap().line, "line 10");
        assert_eq!(lines.last().unwrap().line, "line 29");
        assert_eq!(store.install_log(id, 1, 3).await.unwrap().len(), 3);
        store.append_install_log(&[w(2, 0)], 20).await.unwrap();
        assert_eq!(store.install_log(id, 1, 1000).await.unwrap().len(), 20);
        store.append_install_log(&[w(3, 0)], 20).await.unwrap();
        assert!(store.install_log(id, 1, 1000).await.unwrap().is_empty());
        assert_eq!(store.install_log(id, 2, 1000).await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn milestones_once_and_the_previous_failure() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let id = installing_node(&store, 9).await;
        let note = |g| {
            store.note_once(
                id,
                g,
                State::Installing,
                "installer_config_loaded",
                "installer",
                "config_loaded",
            )
        };
        assert!(note(1).await.unwrap());
        assert!(!note(1).await.unwrap());
        assert!(note(2).await.unwrap());
        assert_eq!(store.previous_install_failure(id, 2).await.unwrap(), None);
        store
            .note(
                id,
                1,
                State::Installing,
                "install_failed",
                "installer",
                "installing: boom",
            )
            .await
            .unwrap();
        assert_eq!(
            store.previous_install_failure(id, 2).await.unwrap(),
            Some((1, "installing: boom".to_string()))
        );
        assert_eq!(store.previous_install_failure(id, 1).await.unwrap(), None);
    }
}
