//! Hardware inventories and each node's profile, baseline and verdict on PostgreSQL:
//! the queries behind pxed's `store::hardware`. Inventories and verdicts are JSON
//! text, as on SQLite; pxed's store parses them.

use pxed_model::InventorySource;
use pxed_model::rows::Audit;

use super::{PgError, PgStore};

/// One row of `node_hardware` (also what pxed's SQLite queries decode into).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HardwareRow {
    pub node_id: i64,
    pub profile: Option<String>,
    pub baseline_generation: Option<i64>,
    pub checked_generation: Option<i64>,
    pub passed: Option<bool>,
    pub drifted: bool,
    /// The verdict's JSON.
    pub verdict: Option<String>,
    pub checked_at: Option<String>,
}

/// One stored inventory: (generation, source, collected at, took ms, JSON body).
pub type InventoryText = (i64, InventorySource, String, Option<i64>, String);

impl PgStore {
    /// Stores a node's inventory from `source` for `generation` (collected at `at`),
    /// then drops generations older than `generation - keep`, but the baseline's.
    pub async fn put_inventory(
        &self,
        (node_id, generation, source): (i64, i64, InventorySource),
        took_ms: Option<i64>,
        body: &str,
        at: &str,
        keep: i64,
    ) -> Result<(), PgError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query!(
            "INSERT INTO node_inventory (node_id, generation, source, collected_at, took_ms, body)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (node_id, generation, source) DO UPDATE SET
                 collected_at = EXCLUDED.collected_at, took_ms = EXCLUDED.took_ms,
                 body = EXCLUDED.body",
            node_id,
            generation,
            source as InventorySource,
            at,
            took_ms,
            body
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query!(
            "DELETE FROM node_inventory WHERE node_id = $1 AND generation < $2
               AND generation IS DISTINCT FROM (SELECT baseline_generation FROM node_hardware
                                                 WHERE node_id = $1)",
            node_id,
            generation - keep
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// A node's inventories, newest generation first, then by source.
    pub async fn inventories(&self, node_id: i64) -> Result<Vec<InventoryText>, PgError> {
        Ok(sqlx::query!(
            r#"SELECT generation, source AS "source: InventorySource", collected_at, took_ms, body
                 FROM node_inventory WHERE node_id = $1
                ORDER BY generation DESC,
                  CASE source WHEN 'deploy' THEN 0 WHEN 'first_boot' THEN 1
                              WHEN 'redfish' THEN 2 ELSE 3 END"#,
            node_id
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.generation, r.source, r.collected_at, r.took_ms, r.body))
        .collect())
    }

    /// `node_hardware` of one node, or of every node (by id) with `None`.
    pub async fn hardware(&self, node_id: Option<i64>) -> Result<Vec<HardwareRow>, PgError> {
        Ok(sqlx::query_as!(
            HardwareRow,
            r#"SELECT node_id, profile, baseline_generation, checked_generation, passed,
                      drifted, verdict, checked_at
                 FROM node_hardware WHERE $1::bigint IS NULL OR node_id = $1 ORDER BY node_id"#,
            node_id
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Records a verdict (JSON `verdict`) on `generation` with its audit row `e`: a
    /// pass makes the generation the baseline; the first profile seen stays.
    pub async fn record_gate(
        &self,
        e: &Audit<'_>,
        profile: Option<&str>,
        (passed, drifted): (bool, bool),
        verdict: &str,
        at: &str,
    ) -> Result<(), PgError> {
        let mut tx = self.begin().await?;
        sqlx::query!(
            "INSERT INTO node_hardware (node_id, profile, baseline_generation,
                 checked_generation, passed, drifted, verdict, checked_at)
             VALUES ($1, $2, CASE WHEN $4 THEN $3::bigint END, $3, $4, $5, $6, $7)
             ON CONFLICT (node_id) DO UPDATE SET
                 profile = COALESCE(node_hardware.profile, EXCLUDED.profile),
                 baseline_generation = CASE WHEN $4 THEN $3::bigint
                                            ELSE node_hardware.baseline_generation END,
                 checked_generation = $3, passed = $4, drifted = $5, verdict = $6,
                 checked_at = $7",
            e.node_id,
            profile,
            e.generation,
            passed,
            drifted,
            verdict,
            at
        )
        .execute(tx.conn())
        .await?;
        tx.append_event(e, at).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Makes `e.generation` the node's baseline (passed, not drifted) with its audit
    /// row `e`; the profile becomes `profile` unless `keep`.
    pub async fn accept_inventory(
        &self,
        e: &Audit<'_>,
        profile: Option<&str>,
        keep: bool,
        at: &str,
    ) -> Result<(), PgError> {
        let mut tx = self.begin().await?;
        sqlx::query!(
            "INSERT INTO node_hardware (node_id, profile, baseline_generation, passed, drifted)
             VALUES ($1, $2, $3, TRUE, FALSE)
             ON CONFLICT (node_id) DO UPDATE SET
                 profile = CASE WHEN $4 THEN node_hardware.profile ELSE $2 END,
                 baseline_generation = $3, passed = TRUE, drifted = FALSE",
            e.node_id,
            profile,
            e.generation,
            keep
        )
        .execute(tx.conn())
        .await?;
        tx.append_event(e, at).await?;
        tx.commit().await?;
        Ok(())
    }
}
