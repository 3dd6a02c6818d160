//! Stages from the wire and the reinstall report's reads on PostgreSQL: the queries
//! behind pxed's `store::stages`.

use pxed_model::rows::{ReinstallRow, StageRow, StageWrite, Tracked, push_tracked};
use pxed_model::{Stage, State};

use super::{PgError, PgStore};

impl PgStore {
    /// Stores a batch in one transaction; the writes that were new (a stage a
    /// generation reached already keeps its first time). Generations older than the
    /// last `keep` of each node written to are deleted.
    pub async fn record_stages(
        &self,
        writes: &[StageWrite],
        keep: i64,
    ) -> Result<Vec<StageWrite>, PgError> {
        let mut new = Vec::new();
        let mut tx = self.pool.begin().await?;
        let mut touched = std::collections::BTreeMap::new();
        for w in writes {
            let done = sqlx::query!(
                "INSERT INTO node_stages (node_id, generation, stage, at, bytes, took_ms, detail)
                 SELECT $1, $2, $3, $4, $5, $6, $7 WHERE EXISTS (SELECT 1 FROM nodes WHERE id = $1)
                 ON CONFLICT DO NOTHING",
                w.node_id,
                w.generation,
                w.stage as Stage,
                w.at,
                w.bytes,
                w.took_ms,
                w.detail
            )
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() > 0 {
                new.push(w.clone());
                let g = touched.entry(w.node_id).or_insert(w.generation);
                *g = (*g).max(w.generation);
            }
        }
        for (node, newest) in touched {
            sqlx::query!(
                "DELETE FROM node_stages WHERE node_id = $1 AND generation < $2",
                node,
                newest - keep + 1
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(new)
    }

    /// Every stage kept of a node, by generation then time.
    pub async fn stages(&self, node_id: i64) -> Result<Vec<StageRow>, PgError> {
        Ok(sqlx::query_as!(
            StageRow,
            r#"SELECT generation, stage AS "stage: _", at, bytes, took_ms, detail
                 FROM node_stages WHERE node_id = $1 ORDER BY generation, at"#,
            node_id
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The stages of one generation of a node, by time.
    pub async fn generation_stages(
        &self,
        node_id: i64,
        generation: i64,
    ) -> Result<Vec<StageRow>, PgError> {
        Ok(sqlx::query_as!(
            StageRow,
            r#"SELECT generation, stage AS "stage: _", at, bytes, took_ms, detail
                 FROM node_stages WHERE node_id = $1 AND generation = $2 ORDER BY at"#,
            node_id,
            generation
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Every stage of the current generation of each node in a reinstall:
    /// (node, stage, at).
    pub async fn current_stage_rows(&self) -> Result<Vec<(i64, Stage, String)>, PgError> {
        Ok(sqlx::query!(
            r#"SELECT s.node_id, s.stage AS "stage: Stage", s.at
                 FROM node_stages s JOIN nodes n
                   ON n.id = s.node_id AND s.generation = n.generation
                WHERE n.state IN ('reclaiming', 'netbooting', 'installing', 'first_boot')"#
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.node_id, r.stage, r.at))
        .collect())
    }

    /// Nodes in a reinstall or failed, each with its current generation's stages.
    pub async fn tracked_nodes(&self) -> Result<Vec<Tracked>, PgError> {
        let rows = sqlx::query!(
            r#"SELECT n.id AS "node_id!", n.name, n.state AS "state!: State",
                      n.state_since AS "state_since!", n.failed_reason,
                      s.generation AS "generation?", s.stage AS "stage?: Stage",
                      s.at AS "at?", s.bytes, s.took_ms, s.detail
                 FROM nodes n LEFT JOIN node_stages s
                   ON s.node_id = n.id AND s.generation = n.generation
                WHERE n.state IN ('reclaiming', 'netbooting', 'installing', 'first_boot', 'failed')
                ORDER BY n.id, s.at"#
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out = Vec::new();
        for r in rows {
            let stage = match (r.generation, r.stage, r.at) {
                (Some(generation), Some(stage), Some(at)) => Some(StageRow {
                    generation,
                    stage,
                    at,
                    bytes: r.bytes,
                    took_ms: r.took_ms,
                    detail: r.detail,
                }),
                _ => None,
            };
            let node = Tracked {
                node_id: r.node_id,
                name: r.name,
                state: r.state,
                state_since: r.state_since,
                failed_reason: r.failed_reason,
                stages: Vec::new(),
            };
            push_tracked(&mut out, node, stage);
        }
        Ok(out)
    }

    /// Reinstalls requested at or after `since`, each with how its generation ended.
    pub async fn reinstalls_since(&self, since: &str) -> Result<Vec<ReinstallRow>, PgError> {
        Ok(sqlx::query_as!(
            ReinstallRow,
            r#"SELECT r.node_id, r.generation, r.at AS requested_at, e.at AS "ended_at?",
                      e.to_state AS "outcome?: State", e.event AS "end_event?",
                      e.from_state AS "end_from?: State", e.detail AS "end_detail?"
                 FROM node_events r
                 LEFT JOIN node_events e ON e.id = (
                     SELECT x.id FROM node_events x
                      WHERE x.node_id = r.node_id AND x.generation = r.generation AND x.id > r.id
                        AND x.to_state IN ('available', 'failed')
                      ORDER BY x.id LIMIT 1)
                WHERE r.event = 'reinstall_requested' AND r.at >= $1
                ORDER BY r.id"#,
            since
        )
        .fetch_all(&self.pool)
        .await?)
    }
}
