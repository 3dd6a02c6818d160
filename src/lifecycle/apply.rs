//! Applying an event: load the node, call the pure [`transition`], write the result with
//! an optimistic version check and append the audit row, all in one transaction. Effects
//! are handed to the worker only after the commit.

use std::str::FromStr;

use sqlx::SqliteConnection;

use super::transition::{
    BootToken, Effect, Event, Failure, Node, Outcome, Policy, State, Step, TransitionError,
    transition,
};
use crate::store::nodes::{self, NodeRow};
use crate::store::{Store, StoreError};

/// Errors from applying an event.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("node {0} not found")]
    NotFound(i64),
    #[error(transparent)]
    Transition(#[from] TransitionError),
    #[error("node {0} was changed concurrently; try again")]
    Conflict(i64),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for ApplyError {
    fn from(e: sqlx::Error) -> Self {
        ApplyError::Store(StoreError::Db(e))
    }
}

/// The result of one applied event.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The node as it is after the event (unchanged for `InProgress`/`Ignored`).
    pub node: NodeRow,
    /// What `transition` decided.
    pub outcome: Outcome,
}

/// The lifecycle fields of a stored row, for [`transition`].
pub fn to_node(row: &NodeRow, first_boot_reported: bool) -> Result<Node, TransitionError> {
    let state = State::from_str(&row.state)?;
    let failure = match (&row.failed_step, &row.failed_reason) {
        (Some(step), reason) => Some(Failure {
            step: Step::from_str(step)?,
            reason: reason.clone().unwrap_or_default(),
        }),
        (None, _) => None,
    };
    Ok(Node {
        state,
        generation: row.generation,
        attempt: u32::try_from(row.attempt).unwrap_or(0),
        image: row.image.clone(),
        token: row.boot_token.clone().map(BootToken),
        failure,
        first_boot_reported,
    })
}

async fn first_boot_reported(
    conn: &mut SqliteConnection,
    id: i64,
    generation: i64,
) -> Result<bool, StoreError> {
    let n = sqlx::query_scalar!(
        r#"SELECT COUNT(*) FROM node_events
           WHERE node_id = ? AND generation = ? AND event = 'first_boot_reported'"#,
        id,
        generation
    )
    .fetch_one(conn)
    .await?;
    Ok(n > 0)
}

/// Applies `event` to node `id` in one transaction.
///
/// `prepare` may adjust the row inside the transaction before the write (e.g. assign a
/// hostname on reinstall) and `idempotency` records the answer under a key in the same
/// transaction.
pub async fn apply(
    store: &Store,
    policy: &Policy,
    id: i64,
    event: &Event,
    actor: &str,
    hooks: Hooks<'_>,
) -> Result<(Applied, Vec<Effect>), ApplyError> {
    let mut tx = store.pool.begin_with("BEGIN IMMEDIATE").await?;
    let row = nodes::node_tx(&mut tx, id)
        .await?
        .ok_or(ApplyError::NotFound(id))?;
    let reported = first_boot_reported(&mut tx, id, row.generation).await?;
    let node = to_node(&row, reported)?;
    let outcome = transition(&node, event, policy)?;
    let Outcome::Changed(t) = &outcome else {
        if let (Some(key), Some(answer)) = (hooks.idempotency_key, hooks.answer) {
            let text = answer(&row, &outcome);
            nodes::put_idempotent(&mut tx, key, id, &text).await?;
            tx.commit().await?;
        }
        return Ok((Applied { node: row, outcome }, Vec::new()));
    };
    let mut new = row.clone();
    new.state = t.node.state.as_str().to_string();
    if t.entered {
        new.state_since = nodes::now();
    }
    new.generation = t.node.generation;
    new.attempt = i64::from(t.node.attempt);
    new.image = t.node.image.clone();
    new.boot_token = t.node.token.as_ref().map(|t| t.as_str().to_string());
    new.failed_step = t.node.failure.as_ref().map(|f| f.step.to_string());
    new.failed_reason = t.node.failure.as_ref().map(|f| f.reason.clone());
    if let Some(r) = &t.report {
        new.facts = Some(r.facts.clone());
    }
    if let Some(prefix) = hooks.hostname_prefix {
        assign_hostname(&mut tx, &mut new, prefix).await?;
    }
    if !nodes::update_node_tx(&mut tx, &new, row.version).await? {
        return Err(ApplyError::Conflict(id));
    }
    new.version += 1;
    let detail = event.detail();
    nodes::append_event(
        &mut tx,
        id,
        new.generation,
        Some(&row.state),
        event.name(),
        &new.state,
        actor,
        detail.as_deref(),
    )
    .await?;
    if let (Some(key), Some(answer)) = (hooks.idempotency_key, hooks.answer) {
        let text = answer(&new, &outcome);
        nodes::put_idempotent(&mut tx, key, id, &text).await?;
    }
    tx.commit().await?;
    let effects = t.effects.clone();
    Ok((Applied { node: new, outcome }, effects))
}

/// Renders the answer stored under an idempotency key.
pub type Answer = dyn Fn(&NodeRow, &Outcome) -> String + Send + Sync;

/// Optional extras for [`apply`].
#[derive(Default, Clone, Copy)]
pub struct Hooks<'a> {
    /// Give the node a hostname (this prefix + boot-NIC MAC digits) if it has none.
    pub hostname_prefix: Option<&'a str>,
    /// Record the answer under this idempotency key in the same transaction.
    pub idempotency_key: Option<&'a str>,
    pub answer: Option<&'a Answer>,
}

/// Gives a node its hostname if it has none: prefix + the boot NIC's last MAC digits,
/// extended until unique (see [`crate::hostname::hostname_for`]).
async fn assign_hostname(
    conn: &mut SqliteConnection,
    row: &mut NodeRow,
    prefix: &str,
) -> Result<(), StoreError> {
    if row.hostname.is_some() {
        return Ok(());
    }
    let Some(mac) = nodes::boot_mac_tx(conn, row.id).await? else {
        return Ok(());
    };
    let taken: std::collections::HashSet<String> =
        nodes::hostnames_tx(conn).await?.into_iter().collect();
    row.hostname = Some(crate::hostname::hostname_for(prefix, &mac, |h| {
        taken.contains(h)
    }));
    Ok(())
}
