//! Installer telemetry: who sent a line (a node being installed, found by address), the
//! last lines per node generation (bounded), and the milestones on the timeline.

use super::nodes::{Audit, append_event, now};
use super::{Store, StoreError};
use crate::model::{AgentToken, BootToken, State};

/// A node whose installer may be talking: what the recorder needs to store a line and
/// act on it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LogTarget {
    pub node_id: i64,
    pub generation: i64,
    pub state: State,
    /// `images.family` of the node's image (`None`: no image or not imported).
    pub family: Option<String>,
    /// Redacted from every line (an installer may echo its command line).
    pub boot_token: Option<BootToken>,
    pub agent_token: Option<AgentToken>,
}

/// One line to store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogWrite {
    pub node_id: i64,
    pub generation: i64,
    pub at: String,
    pub source: &'static str,
    pub line: String,
}

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
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The same for a node known by id (the reporting webhook proved it by token).
    pub async fn log_target(&self, node_id: i64) -> Result<Option<LogTarget>, StoreError> {
        Ok(sqlx::query_as!(
            LogTarget,
            r#"SELECT n.id AS node_id, n.generation, n.state AS "state: _", i.family AS "family?",
                      n.boot_token AS "boot_token: _", n.agent_token AS "agent_token: _"
               FROM nodes n LEFT JOIN images i ON i.name = n.image
               WHERE n.id = ?"#,
            node_id
        )
        .fetch_optional(&self.pool)
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
        let mut tx = self.pool.begin().await?;
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
        let mut rows = sqlx::query_as!(
            LogLine,
            r#"SELECT at, source, line FROM install_log WHERE node_id = ? AND generation = ?
               ORDER BY id DESC LIMIT ?"#,
            node_id,
            generation,
            limit
        )
        .fetch_all(&self.pool)
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
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
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
        Ok(sqlx::query!(
            r#"SELECT generation, detail FROM node_events
               WHERE node_id = ? AND generation < ? AND event = 'install_failed'
               ORDER BY id DESC LIMIT 1"#,
            node_id,
            generation
        )
        .fetch_optional(&self.pool)
        .await?
        .and_then(|r| r.detail.map(|d| (r.generation, d))))
    }
}

/// Current time as stored, for [`LogWrite::at`].
pub fn received_at() -> String {
    now()
}
