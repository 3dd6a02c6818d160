//! Hardware inventories per node and generation, and each node's profile, baseline and
//! last acceptance verdict (migration 0013).
//!
//! Inventories are stored as the JSON of [`Inventory`]; a row that no longer parses (a
//! future field type) is skipped with a warning rather than failing a page.

use serde::{Deserialize, Serialize};

use super::nodes::{Audit, append_event, now};
use super::{Db, Store, StoreError};
use crate::inventory::Inventory;
use crate::inventory::gate::Verdict;
use crate::model::{InventorySource, State};

/// One stored inventory.
#[derive(Debug, Clone, Serialize)]
pub struct InventoryRow {
    pub generation: i64,
    pub source: InventorySource,
    pub collected_at: String,
    /// How long the collection took where the reporter said.
    pub took_ms: Option<i64>,
    pub inventory: Inventory,
}

/// A node's hardware class and acceptance state.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Hardware {
    pub profile: Option<String>,
    pub baseline_generation: Option<i64>,
    pub checked_generation: Option<i64>,
    pub passed: Option<bool>,
    pub drifted: bool,
    pub verdict: Option<Verdict>,
    pub checked_at: Option<String>,
}

// One row of `node_hardware` as stored (the verdict as JSON): one type for both backends.
use store_pg::hardware::HardwareRow as HardwareRecord;

/// A stored row as (node, what it says).
fn into_parts(r: HardwareRecord) -> (i64, Hardware) {
    (
        r.node_id,
        Hardware {
            profile: r.profile,
            baseline_generation: r.baseline_generation,
            checked_generation: r.checked_generation,
            passed: r.passed,
            drifted: r.drifted,
            verdict: r.verdict.and_then(|v| serde_json::from_str(&v).ok()),
            checked_at: r.checked_at,
        },
    )
}

/// Most inventories kept per node (oldest generations go first; the baseline's stay).
/// The audit detail of a verdict.
fn gate_detail(v: &Verdict) -> String {
    if v.passed() {
        let changes = v.changes.len();
        format!(
            "passed (profile {}, {changes} change(s) since the baseline){}",
            v.profile.as_deref().unwrap_or("none"),
            v.note
                .as_deref()
                .map_or_else(String::new, |n| format!("; {n}"))
        )
    } else {
        v.reason()
    }
}

const KEEP_GENERATIONS: i64 = 20;

fn parse(body: &str, node_id: i64, generation: i64) -> Option<Inventory> {
    match serde_json::from_str(body) {
        Ok(i) => Some(i),
        Err(e) => {
            tracing::warn!(node_id, generation, "stored inventory does not parse: {e}");
            None
        }
    }
}

impl Store {
    /// Stores what `source` reported for the node's `generation` (replacing an earlier
    /// report of the same source and generation), and prunes old generations.
    pub async fn put_inventory(
        &self,
        node_id: i64,
        generation: i64,
        source: InventorySource,
        took_ms: Option<i64>,
        inv: &Inventory,
    ) -> Result<(), StoreError> {
        let body = serde_json::to_string(inv).unwrap_or_else(|_| "{}".into());
        let at = now();
        if let Db::Postgres(pg) = &self.db {
            let key = (node_id, generation, source);
            return Ok(pg
                .put_inventory(key, took_ms, &body, &at, KEEP_GENERATIONS)
                .await?);
        }
        let mut tx = self.write().await?;
        sqlx::query!(
            "INSERT INTO node_inventory (node_id, generation, source, collected_at, took_ms, body)
             VALUES (?, ?, ?, ?, ?, ?)
             ON CONFLICT (node_id, generation, source) DO UPDATE SET
                 collected_at = excluded.collected_at, took_ms = excluded.took_ms,
                 body = excluded.body",
            node_id,
            generation,
            source,
            at,
            took_ms,
            body
        )
        .execute(&mut *tx)
        .await?;
        let oldest = generation - KEEP_GENERATIONS;
        sqlx::query!(
            "DELETE FROM node_inventory WHERE node_id = ? AND generation < ?
               AND generation IS NOT (SELECT baseline_generation FROM node_hardware
                                      WHERE node_id = ?)",
            node_id,
            oldest,
            node_id
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Every stored inventory of a node, newest generation first, in-band before
    /// out-of-band within a generation.
    pub async fn inventories(&self, node_id: i64) -> Result<Vec<InventoryRow>, StoreError> {
        let rows: Vec<store_pg::hardware::InventoryText> = match &self.db {
            Db::Postgres(pg) => pg.inventories(node_id).await?,
            Db::Sqlite(_) => sqlx::query!(
            r#"SELECT generation, source AS "source: InventorySource", collected_at, took_ms, body
               FROM node_inventory WHERE node_id = ?
               ORDER BY generation DESC,
                 CASE source WHEN 'deploy' THEN 0 WHEN 'first_boot' THEN 1
                             WHEN 'redfish' THEN 2 ELSE 3 END"#,
            node_id
        )
        .fetch_all(self.pool()?)
        .await?
        .into_iter()
        .map(|r| (r.generation, r.source, r.collected_at, r.took_ms, r.body))
        .collect(),
        };
        Ok(rows
            .into_iter()
            .filter_map(|(generation, source, collected_at, took_ms, body)| {
                Some(InventoryRow {
                    inventory: parse(&body, node_id, generation)?,
                    generation,
                    source,
                    collected_at,
                    took_ms,
                })
            })
            .collect())
    }

    /// The node's profile, baseline and last verdict (default: none yet).
    pub async fn hardware(&self, node_id: i64) -> Result<Hardware, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            let r = pg.hardware(Some(node_id)).await?.into_iter().next();
            return Ok(r.map(|r| into_parts(r).1).unwrap_or_default());
        }
        let r = sqlx::query_as!(
            HardwareRecord,
            r#"SELECT node_id, profile, baseline_generation, checked_generation,
                      passed AS "passed: bool", drifted AS "drifted: bool", verdict, checked_at
               FROM node_hardware WHERE node_id = ?"#,
            node_id
        )
        .fetch_optional(self.pool()?)
        .await?;
        Ok(r.map(|r| into_parts(r).1).unwrap_or_default())
    }

    /// Every node's hardware row, by node id (nodes without one are absent).
    pub async fn hardware_all(&self) -> Result<Vec<(i64, Hardware)>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg
                .hardware(None)
                .await?
                .into_iter()
                .map(into_parts)
                .collect());
        }
        let rows = sqlx::query_as!(
            HardwareRecord,
            r#"SELECT node_id, profile, baseline_generation, checked_generation,
                      passed AS "passed: bool", drifted AS "drifted: bool", verdict, checked_at
               FROM node_hardware ORDER BY node_id"#
        )
        .fetch_all(self.pool()?)
        .await?;
        Ok(rows.into_iter().map(into_parts).collect())
    }

    /// Records the gate's verdict for `generation`. A pass makes that generation the
    /// baseline; the verdict's profile is assigned when the node had none (the only
    /// profile its inventory matched). One audit row, `inventory_checked`.
    pub async fn record_gate(
        &self,
        node_id: i64,
        generation: i64,
        state: State,
        v: &Verdict,
    ) -> Result<(), StoreError> {
        let body = serde_json::to_string(v).unwrap_or_default();
        let (passed, drifted, at) = (v.passed(), v.drifted(), now());
        let detail = gate_detail(v);
        let mut e = Audit::new(node_id, generation, "inventory_checked", state, "pxed");
        e.from = Some(state);
        e.detail = Some(&detail);
        if let Db::Postgres(pg) = &self.db {
            let profile = v.profile.as_deref();
            return Ok(pg
                .record_gate(&e, profile, (passed, drifted), &body, &at)
                .await?);
        }
        let mut tx = self.write().await?;
        sqlx::query!(
            "INSERT INTO node_hardware (node_id, profile, baseline_generation,
                 checked_generation, passed, drifted, verdict, checked_at)
             VALUES (?1, ?2, CASE WHEN ?4 THEN ?3 END, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (node_id) DO UPDATE SET
                 profile = COALESCE(node_hardware.profile, excluded.profile),
                 baseline_generation = CASE WHEN ?4 THEN ?3
                                            ELSE node_hardware.baseline_generation END,
                 checked_generation = ?3, passed = ?4, drifted = ?5, verdict = ?6,
                 checked_at = ?7",
            node_id,
            v.profile,
            generation,
            passed,
            drifted,
            body,
            at
        )
        .execute(&mut *tx)
        .await?;
        append_event(&mut tx, &e).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Accepts the inventory of `generation` as the node's baseline (re-baseline),
    /// optionally under another profile (`Some(None)` unassigns it). Audited as
    /// `inventory_accepted`. `false`: no such node.
    pub async fn accept_inventory(
        &self,
        node_id: i64,
        generation: i64,
        state: State,
        profile: Option<Option<&str>>,
        actor: &str,
    ) -> Result<(), StoreError> {
        let keep = profile.is_none();
        let new_profile = profile.flatten();
        let detail = match profile {
            None => format!("generation {generation} is the new baseline"),
            Some(p) => format!(
                "generation {generation} is the new baseline; profile {}",
                p.unwrap_or("none")
            ),
        };
        let mut e = Audit::new(node_id, generation, "inventory_accepted", state, actor);
        e.from = Some(state);
        e.detail = Some(&detail);
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.accept_inventory(&e, new_profile, keep, &now()).await?);
        }
        let mut tx = self.write().await?;
        sqlx::query!(
            "INSERT INTO node_hardware (node_id, profile, baseline_generation, passed, drifted)
             VALUES (?1, ?2, ?3, 1, 0)
             ON CONFLICT (node_id) DO UPDATE SET
                 profile = CASE WHEN ?4 THEN node_hardware.profile ELSE ?2 END,
                 baseline_generation = ?3, passed = 1, drifted = 0",
            node_id,
            new_profile,
            generation,
            keep
        )
        .execute(&mut *tx)
        .await?;
        append_event(&mut tx, &e).await?;
        tx.commit().await?;
        Ok(())
    }
}
