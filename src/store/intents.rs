//! BMC steps recorded before they are sent, so that a restart does not repeat a power
//! cycle that already reached the BMC (see migration 0006).

use super::{Db, Store, StoreError};
use crate::model::{BmcStep, State};

/// What the store says about a BMC step the worker is about to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Recorded as sent: send it now.
    Send,
    /// This power cycle was recorded as sent at `at` (RFC 3339) by an earlier run of
    /// the daemon: check the machine instead of cycling it again.
    AlreadySent { at: String },
    /// The node has moved on (another state, generation or attempt): skip the step.
    NotCurrent,
    /// Another instance on the database answers for the node now (or this one's
    /// claim is about to lapse): do not send the step.
    NotHeld,
}

/// The last BMC step recorded for a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BmcIntent {
    pub generation: i64,
    pub attempt: i64,
    pub step: BmcStep,
    pub sent_at: String,
}

impl BmcIntent {
    /// Whether this is the power cycle of reclaim attempt (`generation`, `attempt`):
    /// once it is, a netboot from the node is the one that attempt waits for.
    pub fn is_cycle_of(&self, generation: i64, attempt: i64) -> bool {
        self.step == BmcStep::PowerCycle && self.generation == generation && self.attempt == attempt
    }
}

impl Store {
    /// Records that `step` of reclaim attempt (`generation`, `attempt`) is about to be
    /// sent, in one transaction with the check that the node is still in `reclaiming`
    /// at that generation and attempt. A power cycle already recorded for the same
    /// attempt is [`Claim::AlreadySent`] (the earlier run may have sent it).
    pub async fn claim_bmc_step(
        &self,
        node_id: i64,
        generation: i64,
        attempt: u32,
        step: BmcStep,
        holder: Option<store_pg::steps::Holder<'_>>,
    ) -> Result<Claim, StoreError> {
        let attempt = i64::from(attempt);
        if let Db::Postgres(pg) = &self.db {
            use store_pg::steps::Recorded;
            let at = super::nodes::now();
            return Ok(
                match pg
                    .record_bmc_step(node_id, generation, attempt, step, &at, holder)
                    .await?
                {
                    Recorded::Send => Claim::Send,
                    Recorded::AlreadySent { at } => Claim::AlreadySent { at },
                    Recorded::NotCurrent => Claim::NotCurrent,
                    Recorded::NotHeld => Claim::NotHeld,
                },
            );
        }
        let mut tx = self.write().await?;
        let current = sqlx::query!(
            r#"SELECT state AS "state: State", generation, attempt FROM nodes WHERE id = ?"#,
            node_id
        )
        .fetch_optional(&mut *tx)
        .await?;
        match current {
            Some(n)
                if n.state == State::Reclaiming
                    && n.generation == generation
                    && n.attempt == attempt => {}
            _ => return Ok(Claim::NotCurrent),
        }
        if step == BmcStep::PowerCycle {
            let sent = sqlx::query_scalar!(
                "SELECT sent_at FROM bmc_intents WHERE node_id = ? AND generation = ? AND attempt = ? AND step = ?",
                node_id,
                generation,
                attempt,
                step
            )
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(at) = sent {
                return Ok(Claim::AlreadySent { at });
            }
        }
        let now = super::nodes::now();
        sqlx::query!(
            "INSERT INTO bmc_intents (node_id, generation, attempt, step, sent_at) VALUES (?, ?, ?, ?, ?)
             ON CONFLICT (node_id) DO UPDATE SET generation = excluded.generation,
               attempt = excluded.attempt, step = excluded.step, sent_at = excluded.sent_at",
            node_id,
            generation,
            attempt,
            step,
            now
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Claim::Send)
    }

    /// The last BMC step recorded for node `id`.
    pub async fn bmc_intent(&self, node_id: i64) -> Result<Option<BmcIntent>, StoreError> {
        if let Db::Postgres(pg) = &self.db {
            return Ok(pg.bmc_intent(node_id).await?.map(
                |(generation, attempt, step, sent_at)| BmcIntent {
                    generation,
                    attempt,
                    step,
                    sent_at,
                },
            ));
        }
        Ok(sqlx::query_as!(
            BmcIntent,
            r#"SELECT generation, attempt, step AS "step: BmcStep", sent_at FROM bmc_intents WHERE node_id = ?"#,
            node_id
        )
        .fetch_optional(self.pool()?)
        .await?)
    }
}
