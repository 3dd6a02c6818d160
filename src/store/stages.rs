//! Stages from the wire: when each node generation first reached each stage, bounded
//! to the last few generations of a node; and what the reinstall report reads.

use super::{Db, Store, StoreError};
use crate::model::rows::push_tracked;
use crate::model::{Stage, State};

pub use crate::model::rows::{ReinstallRow, StageRow, StageWrite, Tracked};

impl Store {
    /// Stores a batch in one transaction; returns the writes that were new (a stage a
    /// generation had already reached keeps its first time). Generations older than
    /// the last `keep` of each node written to are deleted.
    pub async fn record_stages(
        &self,
        writes: &[StageWrite],
        keep: u32,
    ) -> Result<Vec<StageWrite>, StoreError> {
        let mut new = Vec::new();
        if writes.is_empty() {
            return Ok(new);
        }
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.record_stages(writes, i64::from(keep)).await?);
        }
        // Two statements for the whole batch (rows as JSON through `json_each`), not
        // two per stage: every statement is a round trip to sqlx's SQLite thread, and
        // the writer is shared with every lifecycle step.
        let rows: Vec<_> = writes
            .iter()
            .map(|w| {
                serde_json::json!({
                    "node_id": w.node_id, "generation": w.generation, "stage": w.stage.as_str(),
                    "at": w.at, "bytes": w.bytes, "took_ms": w.took_ms, "detail": w.detail,
                })
            })
            .collect();
        let rows = serde_json::Value::from(rows).to_string();
        let mut tx = self.write().await?;
        // In the batch's order (`key` is the array index): of two writes of one stage,
        // the first is kept, as a stage keeps its first time. `WHERE` skips a node
        // deleted meanwhile; RETURNING names the rows inserted, not those ignored.
        let inserted = sqlx::query!(
            r#"INSERT OR IGNORE INTO node_stages (node_id, generation, stage, at, bytes, took_ms, detail)
               SELECT value ->> '$.node_id', value ->> '$.generation', value ->> '$.stage',
                      value ->> '$.at', value ->> '$.bytes', value ->> '$.took_ms',
                      value ->> '$.detail'
               FROM json_each(?1)
               WHERE EXISTS (SELECT 1 FROM nodes WHERE id = value ->> '$.node_id')
               ORDER BY key
               RETURNING node_id AS "node_id!: i64", generation AS "generation!: i64",
                         stage AS "stage!: Stage""#,
            rows
        )
        .fetch_all(&mut *tx)
        .await?;
        let mut fresh: std::collections::HashSet<(i64, i64, Stage)> = inserted
            .into_iter()
            .map(|r| (r.node_id, r.generation, r.stage))
            .collect();
        let mut touched = std::collections::BTreeMap::new();
        for w in writes {
            if fresh.remove(&(w.node_id, w.generation, w.stage)) {
                new.push(w.clone());
                let g = touched.entry(w.node_id).or_insert(w.generation);
                *g = (*g).max(w.generation);
            }
        }
        if !touched.is_empty() {
            let keep = i64::from(keep);
            let oldest: Vec<(i64, i64)> = touched
                .into_iter()
                .map(|(node, newest)| (node, newest - keep + 1))
                .collect();
            let oldest = serde_json::to_string(&oldest).expect("integers serialize");
            // A join, each pair read once: a subquery per row that searched the pairs
            // (as this was) costs rows × pairs, and with the few hundred nodes a storm
            // touches per batch that held the one writer for most of a second.
            sqlx::query!(
                r#"DELETE FROM node_stages
                   WHERE (node_id, generation) IN (
                     SELECT s.node_id, s.generation
                       FROM json_each(?1) AS o
                       JOIN node_stages AS s
                         ON s.node_id = o.value ->> 0 AND s.generation < o.value ->> 1)"#,
                oldest
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(new)
    }

    /// Every stage kept of a node, by generation then time.
    pub async fn stages(&self, node_id: i64) -> Result<Vec<StageRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.stages(node_id).await?);
        }
        Ok(sqlx::query_as!(
            StageRow,
            r#"SELECT generation, stage AS "stage: _", at, bytes, took_ms, detail
               FROM node_stages WHERE node_id = ? ORDER BY generation, at"#,
            node_id
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// The stages of one generation of a node.
    pub async fn generation_stages(
        &self,
        node_id: i64,
        generation: i64,
    ) -> Result<Vec<StageRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.generation_stages(node_id, generation).await?);
        }
        Ok(sqlx::query_as!(
            StageRow,
            r#"SELECT generation, stage AS "stage: _", at, bytes, took_ms, detail
               FROM node_stages WHERE node_id = ? AND generation = ? ORDER BY at"#,
            node_id,
            generation
        )
        .fetch_all(self.pool()?)
        .await?)
    }

    /// The last stage each node in a reinstall reached in its current generation, and
    /// when: what the board shows. One query for the whole fleet (only nodes in a
    /// reinstall have rows here).
    pub async fn current_stages(
        &self,
    ) -> Result<std::collections::HashMap<i64, (Stage, String)>, StoreError> {
        let rows: Vec<(i64, Stage, String)> = match &self.db {
            Db::Postgres(pg) => pg.current_stage_rows().await?,
            Db::Sqlite(_) => sqlx::query!(
                r#"SELECT s.node_id AS "node_id!", s.stage AS "stage!: Stage", s.at AS "at!"
               FROM node_stages s JOIN nodes n
                 ON n.id = s.node_id AND s.generation = n.generation
               WHERE n.state IN ('reclaiming', 'netbooting', 'installing', 'first_boot')"#
            )
            .fetch_all(self.pool()?)
            .await?
            .into_iter()
            .map(|r| (r.node_id, r.stage, r.at))
            .collect(),
        };
        let mut out: std::collections::HashMap<i64, (Stage, String)> = Default::default();
        for (node_id, stage, at) in rows {
            let later = out
                .get(&node_id)
                .is_none_or(|(s, t)| (at.as_str(), stage.index()) > (t.as_str(), s.index()));
            if later {
                out.insert(node_id, (stage, at));
            }
        }
        Ok(out)
    }

    /// Nodes in a reinstall or failed, each with its current generation's stages.
    pub async fn tracked_nodes(&self) -> Result<Vec<Tracked>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.tracked_nodes().await?);
        }
        let rows = sqlx::query!(
            r#"SELECT n.id AS "node_id!", n.name, n.state AS "state: State", n.state_since,
                      n.failed_reason, s.generation AS "generation?", s.stage AS "stage?: Stage",
                      s.at AS "at?", s.bytes, s.took_ms, s.detail
               FROM nodes n LEFT JOIN node_stages s
                 ON s.node_id = n.id AND s.generation = n.generation
               WHERE n.state IN ('reclaiming', 'netbooting', 'installing', 'first_boot', 'failed')
               ORDER BY n.id, s.at"#
        )
        .fetch_all(self.pool()?)
        .await?;
        let mut out: Vec<Tracked> = Vec::new();
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
            push_tracked(
                &mut out,
                Tracked {
                    node_id: r.node_id,
                    name: r.name,
                    state: r.state,
                    state_since: r.state_since,
                    failed_reason: r.failed_reason,
                    stages: Vec::new(),
                },
                stage,
            );
        }
        Ok(out)
    }

    /// Reinstalls requested at or after `since` (RFC 3339), each with the first
    /// `available` or `failed` of its generation after the request.
    pub async fn reinstalls_since(&self, since: &str) -> Result<Vec<ReinstallRow>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.reinstalls_since(since).await?);
        }
        Ok(sqlx::query_as!(
            ReinstallRow,
            r#"SELECT r.node_id, r.generation, r.at AS requested_at, e.at AS "ended_at?",
                      e.to_state AS "outcome?: State", e.event AS "end_event?",
                      e.from_state AS "end_from?: State", e.detail AS end_detail
               FROM node_events r
               LEFT JOIN node_events e ON e.id = (
                   SELECT x.id FROM node_events x
                   WHERE x.node_id = r.node_id AND x.generation = r.generation AND x.id > r.id
                     AND x.to_state IN ('available', 'failed')
                   ORDER BY x.id LIMIT 1)
               WHERE r.event = 'reinstall_requested' AND r.at >= ?
               ORDER BY r.id"#,
            since
        )
        .fetch_all(self.pool()?)
        .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Mac, NodeArch};
    use crate::store::nodes::NewNode;

    fn w(node_id: i64, generation: i64, stage: Stage, at: &str) -> StageWrite {
        StageWrite {
            node_id,
            generation,
            stage,
            at: at.into(),
            bytes: None,
            took_ms: None,
            detail: None,
        }
    }

    /// The first time a generation reaches a stage wins; only the last `keep`
    /// generations of a node stay; a deleted node takes its stages with it and a
    /// sighting of a node that is gone is not stored.
    #[tokio::test]
    async fn first_sighting_wins_and_generations_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).await.unwrap();
        let n = NewNode {
            name: None,
            arch: NodeArch::UNKNOWN,
            state: State::Available,
            macs: vec![Mac([0x52, 0x54, 0, 0, 0, 9])],
            boot_mac: None,
            bmc: None,
            ssh_authorized_keys: vec![],
        };
        let id = store.create_node(&n, "test").await.unwrap();
        let a = "2026-01-01T00:00:00.000Z";
        let b = "2026-01-01T00:00:05.000Z";
        let new = store
            .record_stages(
                &[
                    w(id, 1, Stage::DhcpDiscover, a),
                    w(id, 1, Stage::DhcpDiscover, b),
                    w(id + 1, 1, Stage::Power, a),
                ],
                3,
            )
            .await
            .unwrap();
        assert_eq!(new, vec![w(id, 1, Stage::DhcpDiscover, a)]);
        let again = store
            .record_stages(&[w(id, 1, Stage::DhcpDiscover, b)], 3)
            .await
            .unwrap();
        assert!(again.is_empty());
        for g in 2..=5 {
            store
                .record_stages(&[w(id, g, Stage::Reinstall, b)], 3)
                .await
                .unwrap();
        }
        let gens: Vec<i64> = store
            .stages(id)
            .await
            .unwrap()
            .iter()
            .map(|r| r.generation)
            .collect();
        assert_eq!(gens, vec![3, 4, 5]);
        assert_eq!(store.generation_stages(id, 5).await.unwrap().len(), 1);
        // One batch over two nodes bounds each by its own newest generation.
        let id2 = store
            .create_node(
                &NewNode {
                    macs: vec![Mac([0x52, 0x54, 0, 0, 0, 10])],
                    ..n.clone()
                },
                "test",
            )
            .await
            .unwrap();
        for g in 1..=2 {
            store
                .record_stages(&[w(id2, g, Stage::Reinstall, a)], 3)
                .await
                .unwrap();
        }
        let new = store
            .record_stages(
                &[
                    w(id, 6, Stage::Reinstall, b),
                    w(id2, 4, Stage::Reinstall, b),
                    w(id2, 4, Stage::Power, b),
                ],
                2,
            )
            .await
            .unwrap();
        assert_eq!(new.len(), 3);
        let gens = |rows: Vec<StageRow>| rows.iter().map(|r| r.generation).collect::<Vec<_>>();
        assert_eq!(gens(store.stages(id).await.unwrap()), vec![5, 6]);
        assert_eq!(gens(store.stages(id2).await.unwrap()), vec![4, 4]);
        assert!(store.delete_node(id, "test").await.unwrap());
        assert!(store.stages(id).await.unwrap().is_empty());
    }
}
