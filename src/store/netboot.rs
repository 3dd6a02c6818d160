//! Netboot methods (migration 0010): where a node is in its plan, what its BMC says it
//! is, and which method worked for each BMC model.

use super::nodes::{NodeTx, Tx, now};
use super::{Db, Store, StoreError};
use crate::lifecycle::transition::{Netboot, NetbootMethod};
use crate::model::rows::NodeRow;
use crate::model::{AgentToken, BootToken, NodeArch, State, Step};

/// Parses the `tried` column (comma-separated method names; unknown names dropped).
/// A stored progress row (method, tried, observed), or the default for none.
fn progress(row: Option<(String, String, bool)>) -> Netboot {
    row.map(|(method, tried, observed)| Netboot {
        method: NetbootMethod::parse(&method).unwrap_or(NetbootMethod::Standard),
        tried: parse_tried(&tried),
        observed,
    })
    .unwrap_or_default()
}

fn parse_tried(s: &str) -> Vec<NetbootMethod> {
    s.split(',').filter_map(NetbootMethod::parse).collect()
}

fn tried_column(n: &Netboot) -> String {
    n.tried
        .iter()
        .map(|m| m.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// A method that worked for a model, as listed on the node page and the API.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MethodRecord {
    pub model: String,
    pub method: String,
    pub successes: i64,
    pub last_success: String,
}

impl NodeTx {
    /// The node as this transaction sees it, with what a lifecycle step decides by
    /// beside it: whether its first boot of the current generation was reported, and
    /// its netboot progress. One statement on SQLite (every statement is a round trip
    /// to sqlx's worker thread, and every event a node goes through reads these).
    pub async fn lifecycle_node(
        &mut self,
        id: i64,
    ) -> Result<Option<(NodeRow, bool, Netboot)>, StoreError> {
        let w = match &mut self.tx {
            Tx::Lite(w) => w,
            Tx::Pg(_) => {
                let Some(row) = self.node(id).await? else {
                    return Ok(None);
                };
                let reported = self.first_boot_reported(id, row.generation).await?;
                let netboot = self.netboot(id, row.generation).await?;
                return Ok(Some((row, reported, netboot)));
            }
        };
        let Some(r) = sqlx::query!(
            r#"SELECT n.id, n.name, n.hostname, n.arch AS "arch: NodeArch", n.state AS "state: State",
                      n.state_since, n.version, n.generation, n.attempt, n.image,
                      n.boot_token AS "boot_token: BootToken", n.agent_token AS "agent_token: AgentToken",
                      n.boot_ip, n.failed_step AS "failed_step: Step", n.failed_reason, n.facts,
                      n.created_at, n.site,
                      EXISTS (SELECT 1 FROM node_events e WHERE e.node_id = n.id
                              AND e.generation = n.generation
                              AND e.event = 'first_boot_reported') AS "reported!: bool",
                      p.method AS "p_method?", p.tried AS "p_tried?", p.observed AS "p_observed?"
               FROM nodes n
               LEFT JOIN netboot_progress p ON p.node_id = n.id AND p.generation = n.generation
               WHERE n.id = ?"#,
            id
        )
        .fetch_optional(&mut **w)
        .await?
        else {
            return Ok(None);
        };
        let netboot = match (r.p_method, r.p_tried, r.p_observed) {
            (Some(m), Some(t), Some(o)) => Some((m, t, o != 0)),
            _ => None,
        };
        let row = NodeRow {
            id: r.id,
            name: r.name,
            hostname: r.hostname,
            arch: r.arch,
            state: r.state,
            state_since: r.state_since,
            version: r.version,
            generation: r.generation,
            attempt: r.attempt,
            image: r.image,
            boot_token: r.boot_token,
            agent_token: r.agent_token,
            boot_ip: r.boot_ip,
            failed_step: r.failed_step,
            failed_reason: r.failed_reason,
            facts: r.facts,
            created_at: r.created_at,
            site: r.site,
        };
        Ok(Some((row, r.reported, progress(netboot))))
    }

    /// Node `id`'s netboot progress for `generation` (the default when none is stored
    /// for that generation).
    pub async fn netboot(&mut self, id: i64, generation: i64) -> Result<Netboot, StoreError> {
        if let Tx::Pg(p) = &mut self.tx {
            return Ok(progress(p.netboot(id, generation).await?));
        }
        let row = sqlx::query!(
            "SELECT method, tried, observed FROM netboot_progress WHERE node_id = ? AND generation = ?",
            id,
            generation
        )
        .fetch_optional(self.lite("this lifecycle step")?)
        .await?;
        Ok(progress(row.map(|r| (r.method, r.tried, r.observed != 0))))
    }

    /// Writes node `id`'s netboot progress.
    pub async fn put_netboot(
        &mut self,
        id: i64,
        generation: i64,
        n: &Netboot,
    ) -> Result<(), StoreError> {
        let method = n.method.as_str();
        let tried = tried_column(n);
        if let Tx::Pg(p) = &mut self.tx {
            return Ok(p
                .put_netboot(id, generation, (method, &tried, n.observed))
                .await?);
        }
        sqlx::query!(
            "INSERT INTO netboot_progress (node_id, generation, method, tried, observed) VALUES (?, ?, ?, ?, ?)
             ON CONFLICT (node_id) DO UPDATE SET generation = excluded.generation,
               method = excluded.method, tried = excluded.tried, observed = excluded.observed",
            id,
            generation,
            method,
            tried,
            n.observed
        )
        .execute(self.lite("this lifecycle step")?)
        .await?;
        Ok(())
    }

    /// The order to try netboot methods in for node `id`: the methods that worked for
    /// its BMC model, latest success first, then the default order.
    pub async fn netboot_plan(&mut self, id: i64) -> Result<Vec<NetbootMethod>, StoreError> {
        let worked = match &mut self.tx {
            Tx::Pg(p) => p.netboot_worked(id).await?,
            Tx::Lite(_) => {
                sqlx::query_scalar!(
                    "SELECT m.method FROM netboot_methods m JOIN bmc_models b ON b.model = m.model
             WHERE b.node_id = ? ORDER BY m.last_success DESC, m.successes DESC",
                    id
                )
                .fetch_all(self.lite("this lifecycle step")?)
                .await?
            }
        };
        let preferred: Vec<NetbootMethod> = worked
            .iter()
            .filter_map(|m| NetbootMethod::parse(m))
            .collect();
        Ok(NetbootMethod::plan(&preferred))
    }
}

impl Store {
    /// Node `id`'s netboot progress for `generation`.
    pub async fn netboot(&self, id: i64, generation: i64) -> Result<Netboot, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(progress(pg.netboot(id, generation).await?));
        }
        let row = sqlx::query!(
            "SELECT method, tried, observed FROM netboot_progress WHERE node_id = ? AND generation = ?",
            id,
            generation
        )
        .fetch_optional(self.pool()?)
        .await?;
        Ok(progress(row.map(|r| (r.method, r.tried, r.observed != 0))))
    }

    /// Records what node `id`'s BMC says it is.
    pub async fn set_bmc_model(&self, id: i64, model: &str) -> Result<(), StoreError> {
        let at = now();
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.set_bmc_model(id, model, &at).await?);
        }
        self.write_one(sqlx::query!(
            "INSERT INTO bmc_models (node_id, model, seen_at) VALUES (?, ?, ?)
             ON CONFLICT (node_id) DO UPDATE SET model = excluded.model, seen_at = excluded.seen_at",
            id,
            model,
            at
        ))
.await?;
        Ok(())
    }

    /// What node `id`'s BMC said it is, last time it was asked.
    pub async fn bmc_model(&self, id: i64) -> Result<Option<String>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.bmc_model(id).await?);
        }
        Ok(
            sqlx::query_scalar!("SELECT model FROM bmc_models WHERE node_id = ?", id)
                .fetch_optional(self.pool()?)
                .await?,
        )
    }

    /// Records that `method` made node `id` netboot, for its BMC model. Returns the
    /// model it was recorded for (`None` when the model is not known yet).
    pub async fn record_netboot_method(
        &self,
        id: i64,
        method: NetbootMethod,
    ) -> Result<Option<String>, StoreError> {
        let Some(model) = self.bmc_model(id).await? else {
            return Ok(None);
        };
        let (m, at) = (method.as_str(), now());
        if let Db::Postgres(pg) = &self.db {
            pg.record_netboot_method(&model, m, &at).await?;
            return Ok(Some(model));
        }
        self.write_one(sqlx::query!(
            "INSERT INTO netboot_methods (model, method, successes, last_success) VALUES (?, ?, 1, ?)
             ON CONFLICT (model, method) DO UPDATE SET successes = successes + 1,
               last_success = excluded.last_success",
            model,
            m,
            at
        ))
.await?;
        Ok(Some(model))
    }

    /// Every recorded method, by model.
    pub async fn netboot_methods(&self) -> Result<Vec<MethodRecord>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg
                .netboot_methods()
                .await?
                .into_iter()
                .map(|(model, method, successes, last_success)| MethodRecord {
                    model,
                    method,
                    successes,
                    last_success,
                })
                .collect());
        }
        Ok(sqlx::query_as!(
            MethodRecord,
            "SELECT model, method, successes, last_success FROM netboot_methods ORDER BY model, last_success DESC"
        )
        .fetch_all(self.pool()?)
        .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tried_round_trips_and_drops_unknown_names() {
        let n = Netboot {
            method: NetbootMethod::OffOn,
            tried: vec![NetbootMethod::Standard, NetbootMethod::OffOn],
            observed: false,
        };
        assert_eq!(tried_column(&n), "standard,off_on");
        assert_eq!(parse_tried("standard,bogus,off_on"), n.tried);
        assert_eq!(parse_tried(""), vec![]);
    }
}
