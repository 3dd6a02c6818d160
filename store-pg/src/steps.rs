//! What a reinstall records on its way on PostgreSQL: BMC steps before they are sent
//! (`bmc_intents`), the netboot method being tried (`netboot_progress`), which
//! methods worked per BMC model, and the webhook outbox row of each state change.
//! The queries behind pxed's `store::{intents, netboot, webhooks}`.

use pxed_model::{BmcStep, Mac, State};

use super::nodes::PgTx;
use super::{PgError, PgStore};

/// What recording a BMC step found (see [`PgStore::record_bmc_step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// Recorded: send it.
    Send,
    /// This power cycle was recorded already, at this time.
    AlreadySent { at: String },
    /// The node is not in `reclaiming` at this generation and attempt.
    NotCurrent,
    /// The instance asking does not answer for the node (another took it over, or its
    /// claim would lapse within the margin): it must not send the step.
    NotHeld,
}

/// Who asks to record a step, with several instances on the database: the step is
/// recorded only while `owner`'s claim on the node lasts at least `margin` more.
#[derive(Debug, Clone, Copy)]
pub struct Holder<'a> {
    pub owner: &'a str,
    pub margin: std::time::Duration,
}

/// The last BMC step recorded for a node: (generation, attempt, step, sent at).
pub type Intent = (i64, i64, BmcStep, String);

/// A node's netboot progress: (method, methods tried as stored, observed).
pub type Progress = (String, String, bool);

impl PgStore {
    /// Records `step` of attempt (`generation`, `attempt`) at `at`, in one transaction
    /// with the check that the node is reclaiming at that attempt (its row locked).
    pub async fn record_bmc_step(
        &self,
        node_id: i64,
        generation: i64,
        attempt: i64,
        step: BmcStep,
        at: &str,
        holder: Option<Holder<'_>>,
    ) -> Result<Recorded, PgError> {
        let mut tx = self.pool.begin().await?;
        if let Some(h) = holder {
            // The claim's row stays locked until the record commits, so a takeover
            // cannot slip between this check and the record.
            let margin = i64::try_from(h.margin.as_millis()).unwrap_or(i64::MAX);
            let held = sqlx::query_scalar!(
                r#"SELECT node_id FROM node_owners
                    WHERE node_id = $1 AND owner = $2
                      AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint + $3
                    FOR UPDATE"#,
                node_id,
                h.owner,
                margin
            )
            .fetch_optional(&mut *tx)
            .await?;
            if held.is_none() {
                return Ok(Recorded::NotHeld);
            }
        }
        let current = sqlx::query!(
            r#"SELECT state AS "state: State", generation, attempt FROM nodes
                WHERE id = $1 FOR UPDATE"#,
            node_id
        )
        .fetch_optional(&mut *tx)
        .await?;
        match current {
            Some(n)
                if n.state == State::Reclaiming
                    && n.generation == generation
                    && n.attempt == attempt => {}
            _ => return Ok(Recorded::NotCurrent),
        }
        let step = step.to_string();
        if step == BmcStep::PowerCycle.as_str() {
            let sent = sqlx::query_scalar!(
                "SELECT sent_at FROM bmc_intents
                  WHERE node_id = $1 AND generation = $2 AND attempt = $3 AND step = $4",
                node_id,
                generation,
                attempt,
                step
            )
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(at) = sent {
                return Ok(Recorded::AlreadySent { at });
            }
        }
        sqlx::query!(
            "INSERT INTO bmc_intents (node_id, generation, attempt, step, sent_at)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (node_id) DO UPDATE SET generation = EXCLUDED.generation,
               attempt = EXCLUDED.attempt, step = EXCLUDED.step, sent_at = EXCLUDED.sent_at",
            node_id,
            generation,
            attempt,
            step,
            at
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Recorded::Send)
    }

    /// The last BMC step recorded for a node.
    pub async fn bmc_intent(&self, node_id: i64) -> Result<Option<Intent>, PgError> {
        Ok(sqlx::query!(
            r#"SELECT generation, attempt, step AS "step: BmcStep", sent_at
                 FROM bmc_intents WHERE node_id = $1"#,
            node_id
        )
        .fetch_optional(&self.pool)
        .await?
        .map(|r| (r.generation, r.attempt, r.step, r.sent_at)))
    }

    /// The netboot progress of a node's `generation`.
    pub async fn netboot(&self, id: i64, generation: i64) -> Result<Option<Progress>, PgError> {
        Ok(sqlx::query!(
            "SELECT method, tried, observed FROM netboot_progress
              WHERE node_id = $1 AND generation = $2",
            id,
            generation
        )
        .fetch_optional(&self.pool)
        .await?
        .map(|r| (r.method, r.tried, r.observed)))
    }

    /// Records the BMC model a node reported, at `at`.
    pub async fn set_bmc_model(&self, id: i64, model: &str, at: &str) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO bmc_models (node_id, model, seen_at) VALUES ($1, $2, $3)
             ON CONFLICT (node_id) DO UPDATE SET model = EXCLUDED.model, seen_at = EXCLUDED.seen_at",
            id,
            model,
            at
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The BMC model of a node.
    pub async fn bmc_model(&self, id: i64) -> Result<Option<String>, PgError> {
        Ok(
            sqlx::query_scalar!("SELECT model FROM bmc_models WHERE node_id = $1", id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// Counts a success of `method` on BMC `model`, at `at`.
    pub async fn record_netboot_method(
        &self,
        model: &str,
        method: &str,
        at: &str,
    ) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO netboot_methods (model, method, successes, last_success) VALUES ($1, $2, 1, $3)
             ON CONFLICT (model, method) DO UPDATE SET successes = netboot_methods.successes + 1,
               last_success = EXCLUDED.last_success",
            model,
            method,
            at
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Every (model, method, successes, last success), by model then newest success.
    pub async fn netboot_methods(&self) -> Result<Vec<(String, String, i64, String)>, PgError> {
        Ok(sqlx::query!(
            r#"SELECT model, method, successes, last_success FROM netboot_methods
                ORDER BY model COLLATE "C", last_success DESC"#
        )
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|r| (r.model, r.method, r.successes, r.last_success))
        .collect())
    }
}

impl PgTx {
    /// The netboot progress of a node's `generation`, in this transaction.
    pub async fn netboot(&mut self, id: i64, generation: i64) -> Result<Option<Progress>, PgError> {
        Ok(sqlx::query!(
            "SELECT method, tried, observed FROM netboot_progress
              WHERE node_id = $1 AND generation = $2",
            id,
            generation
        )
        .fetch_optional(self.conn())
        .await?
        .map(|r| (r.method, r.tried, r.observed)))
    }

    /// Stores a node's netboot progress.
    pub async fn put_netboot(
        &mut self,
        id: i64,
        generation: i64,
        (method, tried, observed): (&str, &str, bool),
    ) -> Result<(), PgError> {
        sqlx::query!(
            "INSERT INTO netboot_progress (node_id, generation, method, tried, observed)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (node_id) DO UPDATE SET generation = EXCLUDED.generation,
               method = EXCLUDED.method, tried = EXCLUDED.tried, observed = EXCLUDED.observed",
            id,
            generation,
            method,
            tried,
            observed
        )
        .execute(self.conn())
        .await?;
        Ok(())
    }

    /// The methods that worked on the node's BMC model, best first.
    pub async fn netboot_worked(&mut self, id: i64) -> Result<Vec<String>, PgError> {
        Ok(sqlx::query_scalar!(
            "SELECT m.method FROM netboot_methods m JOIN bmc_models b ON b.model = m.model
              WHERE b.node_id = $1 ORDER BY m.last_success DESC, m.successes DESC",
            id
        )
        .fetch_all(self.conn())
        .await?)
    }

    /// Queues a state-change event at `at`; `body` gets the event id.
    pub async fn enqueue_webhook(
        &mut self,
        node_id: i64,
        to_state: State,
        at: &str,
        body: impl FnOnce(i64) -> String,
    ) -> Result<i64, PgError> {
        let id = sqlx::query_scalar!(
            "INSERT INTO webhook_outbox (node_id, to_state, body, created_at)
             VALUES ($1, $2, '', $3) RETURNING id",
            node_id,
            to_state as State,
            at
        )
        .fetch_one(self.conn())
        .await?;
        let text = body(id);
        sqlx::query!(
            "UPDATE webhook_outbox SET body = $1 WHERE id = $2",
            text,
            id
        )
        .execute(self.conn())
        .await?;
        Ok(id)
    }

    /// Every MAC of the node, the boot NIC first.
    pub async fn macs(&mut self, node_id: i64) -> Result<Vec<Mac>, PgError> {
        Ok(sqlx::query_scalar!(
            r#"SELECT mac AS "mac: Mac" FROM interfaces WHERE node_id = $1
                ORDER BY is_boot DESC, mac COLLATE "C""#,
            node_id
        )
        .fetch_all(self.conn())
        .await?)
    }
}
