//! Installer telemetry on PostgreSQL: the queries behind pxed's `store::install_log`.

use pxed_model::rows::{Audit, InstallLogLine, LogTarget, LogWrite};

use super::{PgError, PgStore};

impl PgStore {
    /// The node being installed that `ip` belongs to (see pxed's `log_target_by_ip`).
    pub async fn log_target_by_ip(&self, ip: &str, now: i64) -> Result<Option<LogTarget>, PgError> {
        Ok(sqlx::query_as!(
            LogTarget,
            r#"SELECT n.id AS node_id, n.generation, n.state AS "state: _", i.family AS "family?",
                      n.boot_token AS "boot_token: _", n.agent_token AS "agent_token: _"
                 FROM nodes n LEFT JOIN images i ON i.name = n.image
                WHERE n.boot_token IS NOT NULL
                  AND (n.boot_ip = $1
                       OR n.id IN (SELECT f.node_id FROM interfaces f JOIN leases l ON l.mac = f.mac
                                    WHERE l.ip = $1 AND l.state = 'bound' AND l.expires_at > $2))
                ORDER BY (n.boot_ip IS NOT DISTINCT FROM $1) DESC, n.id
                LIMIT 1"#,
            ip,
            now
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The same for a node known by id.
    pub async fn log_target(&self, node_id: i64) -> Result<Option<LogTarget>, PgError> {
        Ok(sqlx::query_as!(
            LogTarget,
            r#"SELECT n.id AS node_id, n.generation, n.state AS "state: _", i.family AS "family?",
                      n.boot_token AS "boot_token: _", n.agent_token AS "agent_token: _"
                 FROM nodes n LEFT JOIN images i ON i.name = n.image
                WHERE n.id = $1"#,
            node_id
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Stores a batch in one transaction, then keeps the newest `keep` lines of each
    /// generation written to, and only generations from `generation - older + 1` on.
    pub async fn append_install_log(
        &self,
        writes: &[LogWrite],
        keep: i64,
        generations: i64,
    ) -> Result<(), PgError> {
        let mut tx = self.pool.begin().await?;
        let mut touched = std::collections::BTreeSet::new();
        for w in writes {
            sqlx::query!(
                "INSERT INTO install_log (node_id, generation, at, source, line)
                 VALUES ($1, $2, $3, $4, $5)",
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
        for (node, generation) in touched {
            sqlx::query!(
                "DELETE FROM install_log WHERE node_id = $1 AND generation = $2 AND id <=
                   (SELECT id FROM install_log WHERE node_id = $1 AND generation = $2
                     ORDER BY id DESC LIMIT 1 OFFSET $3)",
                node,
                generation,
                keep
            )
            .execute(&mut *tx)
            .await?;
            sqlx::query!(
                "DELETE FROM install_log WHERE node_id = $1 AND generation < $2",
                node,
                generation - generations + 1
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The last `limit` lines of a node's `generation`, newest first.
    pub async fn install_log_newest(
        &self,
        node_id: i64,
        generation: i64,
        limit: i64,
    ) -> Result<Vec<InstallLogLine>, PgError> {
        Ok(sqlx::query_as!(
            InstallLogLine,
            "SELECT at, source, line FROM install_log WHERE node_id = $1 AND generation = $2
              ORDER BY id DESC LIMIT $3",
            node_id,
            generation,
            limit
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Appends `e` at `at` unless the node's generation has an `e.event` row already
    /// (the node's row locked meanwhile, so two instances write it once); true when
    /// written.
    pub async fn note_once(&self, e: &Audit<'_>, at: &str) -> Result<bool, PgError> {
        let mut tx = self.begin().await?;
        tx.lock_node(e.node_id).await?;
        let seen = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM node_events
                               WHERE node_id = $1 AND generation = $2 AND event = $3) AS "seen!""#,
            e.node_id,
            e.generation,
            e.event
        )
        .fetch_one(tx.conn())
        .await?;
        if seen {
            return Ok(false);
        }
        tx.append_event(e, at).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// The latest `install_failed` detail of a generation before `generation`.
    pub async fn previous_install_failure(
        &self,
        node_id: i64,
        generation: i64,
    ) -> Result<Option<(i64, String)>, PgError> {
        Ok(sqlx::query!(
            "SELECT generation, detail FROM node_events
              WHERE node_id = $1 AND generation < $2 AND event = 'install_failed'
              ORDER BY id DESC LIMIT 1",
            node_id,
            generation
        )
        .fetch_optional(&self.pool)
        .await?
        .and_then(|r| r.detail.map(|d| (r.generation, d))))
    }
}
