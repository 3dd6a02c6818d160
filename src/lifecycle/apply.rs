//! Applying an event: load the node, call the pure [`transition`], write the result with
//! an optimistic version check and append the audit row, all in one transaction. Effects
//! are handed to the worker only after the commit.

use super::transition::{
    Effect, Event, Failure, Node, Outcome, Policy, State, TransitionError, transition,
};
use crate::model::AgentToken;
use crate::store::nodes::{self, Audit, NodeRow, NodeTx};
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

/// The lifecycle fields of a stored row, for [`transition`] (netboot progress and plan
/// left at their defaults: [`apply`] loads them).
pub fn to_node(row: &NodeRow, first_boot_reported: bool) -> Node {
    Node {
        state: row.state,
        generation: row.generation,
        attempt: u32::try_from(row.attempt).unwrap_or(0),
        image: row.image.clone(),
        token: row.boot_token.clone(),
        failure: row.failed_step.map(|step| Failure {
            step,
            reason: row.failed_reason.clone().unwrap_or_default(),
        }),
        first_boot_reported,
        netboot: Default::default(),
        plan: Vec::new(),
    }
}

/// Applies `event` to node `id` in one transaction.
///
/// `hooks` may adjust the row inside the transaction before the write (assign a
/// hostname, bind the boot address) and record the answer under an idempotency key in
/// the same transaction. `webhook`: queue a change of state in the webhook outbox (off
/// when the daemon has no webhook URL).
pub async fn apply(
    store: &Store,
    policy: &Policy,
    id: i64,
    event: &Event,
    actor: &str,
    hooks: Hooks<'_>,
    webhook: bool,
) -> Result<(Applied, Vec<Effect>), ApplyError> {
    let mut tx = store.begin_node_tx().await?;
    let (row, reported, netboot) = tx
        .lifecycle_node(id)
        .await?
        .ok_or(ApplyError::NotFound(id))?;
    let mut node = to_node(&row, reported);
    node.netboot = netboot;
    if matches!(
        event,
        Event::ReinstallRequested { .. } | Event::NetbootNotObserved { .. }
    ) {
        node.plan = tx.netboot_plan(id).await?;
    }
    let outcome = transition(&node, event, policy)?;
    let Outcome::Changed(t) = &outcome else {
        tracing::debug!(
            node = id,
            event = event.name(),
            ?outcome,
            "event changes nothing"
        );
        if let (Some(key), Some(answer)) = (hooks.idempotency_key, hooks.answer) {
            let text = answer(&row, &outcome);
            tx.put_idempotent(key, id, &text).await?;
            tx.commit().await?;
        }
        return Ok((Applied { node: row, outcome }, Vec::new()));
    };
    let mut new = row.clone();
    new.state = t.node.state;
    if t.entered {
        new.state_since = nodes::now();
    }
    new.generation = t.node.generation;
    new.attempt = i64::from(t.node.attempt);
    new.image = t.node.image.clone();
    new.boot_token = t.node.token.clone();
    // The agent token and the bound address belong to the boot token: a new one (a
    // reinstall) brings a fresh agent token and no address yet; none (the node came to
    // rest or failed) takes both away.
    if new.boot_token != row.boot_token {
        new.agent_token = new.boot_token.as_ref().map(|_| AgentToken::random());
        new.boot_ip = None;
    }
    // A retried reclaim power-cycles the machine: the next netboot binds afresh, so
    // whoever fetched the last attempt's script keeps nothing.
    if t.entered && new.state == State::Reclaiming {
        new.boot_ip = None;
    }
    if let Some(ip) = hooks.boot_ip {
        new.boot_ip = Some(ip.to_string());
    }
    new.failed_step = t.node.failure.as_ref().map(|f| f.step);
    new.failed_reason = t.node.failure.as_ref().map(|f| f.reason.clone());
    if let Some(r) = &t.report {
        new.facts = Some(r.facts.clone());
    }
    if let Some(prefix) = hooks.hostname_prefix {
        assign_hostname(&mut tx, &mut new, prefix).await?;
    }
    let detail = event.detail();
    let audit = Audit {
        from: Some(row.state),
        detail: detail.as_deref(),
        ..Audit::new(id, new.generation, event.name(), new.state, actor)
    };
    if !tx.update_node_with_event(&new, row.version, &audit).await? {
        return Err(ApplyError::Conflict(id));
    }
    if t.node.netboot != node.netboot || t.node.generation != node.generation {
        tx.put_netboot(id, t.node.generation, &t.node.netboot)
            .await?;
    }
    new.version += 1;
    // Schedulers hear of every change of state, queued with the change itself.
    let queued = webhook && new.state != row.state;
    if queued {
        let macs = tx.macs(id).await?;
        let reason = match new.state {
            State::Failed | State::Quarantined => new.failed_reason.clone(),
            _ => None,
        }
        .or(detail);
        let make = |eid| crate::webhook::WebhookEvent {
            id: eid,
            event: event.name().to_string(),
            node: crate::webhook::WebhookNode {
                id,
                name: new.name.clone(),
                hostname: new.hostname.clone(),
                macs,
            },
            generation: new.generation,
            from: row.state,
            to: new.state,
            reason,
            at: nodes::now(),
        };
        tx.enqueue_webhook(id, new.state, |eid| make(eid).body())
            .await?;
    }
    if let (Some(key), Some(answer)) = (hooks.idempotency_key, hooks.answer) {
        let text = answer(&new, &outcome);
        tx.put_idempotent(key, id, &text).await?;
    }
    tx.commit().await?;
    if queued {
        crate::webhook::wake();
    }
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
    /// Bind the boot token to this address (the installer is being served to it);
    /// written only if the event changes the node.
    pub boot_ip: Option<std::net::IpAddr>,
}

/// Gives a node its hostname if it has none: prefix + the boot NIC's last MAC digits,
/// extended until unique (see [`crate::hostname::hostname_for`]).
async fn assign_hostname(
    tx: &mut NodeTx,
    row: &mut NodeRow,
    prefix: &str,
) -> Result<(), StoreError> {
    if row.hostname.is_some() {
        return Ok(());
    }
    let Some(mac) = tx.boot_mac(row.id).await? else {
        return Ok(());
    };
    let mac = mac.to_string();
    let (exact, stem) = crate::hostname::hostname_candidates(prefix, &mac);
    let taken: std::collections::HashSet<String> = tx
        .hostnames_among(&exact, &stem)
        .await?
        .into_iter()
        .collect();
    row.hostname = Some(crate::hostname::hostname_for(prefix, &mac, |h| {
        taken.contains(h)
    }));
    Ok(())
}
