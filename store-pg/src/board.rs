//! Filtered node listings and operator labels on PostgreSQL: the queries behind
//! pxed's `store::board`.

use pxed_model::rows::{InterfaceRow, NodeRow};
use pxed_model::{NodeArch, State};

use super::{PgError, PgStore};

/// A listing's filter as SQL parameters (`None`: any). The `*_like` patterns escape
/// with `\` and match case-insensitively, as SQLite's `LIKE` does.
#[derive(Debug, Clone, Default)]
pub struct Filter<'a> {
    pub state: Option<State>,
    pub arch: Option<NodeArch>,
    pub label_key: Option<&'a str>,
    pub label_value: Option<&'a str>,
    pub name_like: Option<String>,
    pub mac_like: Option<String>,
    pub profile: Option<&'a str>,
    pub drifted: Option<bool>,
    pub site: Option<&'a str>,
}

impl PgStore {
    /// Up to `limit` nodes with an id above `after` that match `f`, by id.
    pub async fn nodes_filtered(
        &self,
        after: i64,
        limit: i64,
        f: &Filter<'_>,
    ) -> Result<Vec<NodeRow>, PgError> {
        Ok(sqlx::query_as!(
            NodeRow,
            r#"SELECT id, name, hostname, arch AS "arch: _", state AS "state: _", state_since, version, generation, attempt, image, boot_token AS "boot_token: _", agent_token AS "agent_token: _", boot_ip, failed_step AS "failed_step: _", failed_reason, facts, created_at, site
                 FROM nodes
                WHERE id > $1
                  AND ($2::text IS NULL OR state = $2)
                  AND ($3::text IS NULL OR arch = $3)
                  AND ($4::text IS NULL OR EXISTS (SELECT 1 FROM node_labels l WHERE l.node_id = nodes.id AND l.key = $4 AND ($5::text IS NULL OR l.value = $5)))
                  AND ($6::text IS NULL
                       OR name ILIKE $6 ESCAPE '\' OR hostname ILIKE $6 ESCAPE '\'
                       OR ($7::text IS NOT NULL AND EXISTS (SELECT 1 FROM interfaces i WHERE i.node_id = nodes.id AND replace(i.mac, ':', '') ILIKE $7 ESCAPE '\')))
                  AND ($9::text IS NULL OR EXISTS (SELECT 1 FROM node_hardware h WHERE h.node_id = nodes.id AND h.profile = $9))
                  AND ($10::boolean IS NULL OR COALESCE((SELECT h.drifted FROM node_hardware h WHERE h.node_id = nodes.id), FALSE) = $10)
                  AND ($11::text IS NULL OR site = $11)
                ORDER BY id LIMIT $8"#,
            after,
            f.state.map(|s| s.to_string()),
            f.arch.map(|a| a.to_string()),
            f.label_key,
            f.label_value,
            f.name_like,
            f.mac_like,
            limit,
            f.profile,
            f.drifted,
            f.site
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The interfaces of nodes `ids`, by node, boot NIC first.
    pub async fn interfaces_of(&self, ids: &[i64]) -> Result<Vec<InterfaceRow>, PgError> {
        Ok(sqlx::query_as!(
            InterfaceRow,
            r#"SELECT mac AS "mac: _", node_id, is_boot FROM interfaces WHERE node_id = ANY($1)
                ORDER BY node_id, is_boot DESC, mac COLLATE "C""#,
            ids
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The labels of nodes `ids`: (node, key, value) by node and key.
    pub async fn labels_of(&self, ids: &[i64]) -> Result<Vec<(i64, String, String)>, PgError> {
        Ok(sqlx::query!(
            r#"SELECT node_id, key, value FROM node_labels WHERE node_id = ANY($1)
                ORDER BY node_id, key COLLATE "C""#,
            ids
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.node_id, r.key, r.value))
        .collect())
    }

    /// Replaces the labels of a node.
    pub async fn set_labels(&self, node_id: i64, labels: &[(&str, &str)]) -> Result<(), PgError> {
        let keys: Vec<String> = labels.iter().map(|(k, _)| (*k).to_owned()).collect();
        let values: Vec<String> = labels.iter().map(|(_, v)| (*v).to_owned()).collect();
        let mut tx = self.pool.begin().await?;
        sqlx::query!("DELETE FROM node_labels WHERE node_id = $1", node_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query!(
            "INSERT INTO node_labels (node_id, key, value)
             SELECT $1, k, v FROM UNNEST($2::text[], $3::text[]) AS t(k, v)",
            node_id,
            &keys,
            &values
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Marks nodes `ids` as served by `site`; how many changed.
    pub async fn set_sites(&self, site: &str, ids: &[i64]) -> Result<u64, PgError> {
        let done = sqlx::query!(
            "UPDATE nodes SET site = $1 WHERE id = ANY($2) AND site IS DISTINCT FROM $1",
            site,
            ids
        )
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
