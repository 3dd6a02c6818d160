//! Rows both store backends return (SQLite in pxed's `store`, PostgreSQL in
//! `store-pg`): decoded by sqlx into the domain's types on either.

use serde::{Deserialize, Serialize};

use crate::{AgentToken, BootToken, Driver, Mac, NodeArch, Stage, State, Step};

/// A node as stored (no secrets: those live in `bmc_secrets`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct NodeRow {
    pub id: i64,
    pub name: Option<String>,
    pub hostname: Option<String>,
    pub arch: NodeArch,
    pub state: State,
    pub state_since: String,
    pub version: i64,
    pub generation: i64,
    pub attempt: i64,
    pub image: Option<String>,
    #[serde(skip)]
    pub boot_token: Option<BootToken>,
    /// The first-boot agent's credential for this generation (see [`AgentToken`]).
    #[serde(skip)]
    pub agent_token: Option<AgentToken>,
    /// The address the installer was served to: the only one the boot token is
    /// accepted from (`None` until then, and whenever the boot token changes).
    pub boot_ip: Option<String>,
    pub failed_step: Option<Step>,
    pub failed_reason: Option<String>,
    pub facts: Option<String>,
    pub created_at: String,
    /// The site of the instance that last saw the node netboot (`None`: none with a
    /// site has).
    pub site: Option<String>,
}

/// A node found by its boot MAC (see `Store::nodes_by_boot_macs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootMacNode {
    pub mac: Mac,
    pub id: i64,
    pub state: State,
    pub generation: i64,
    /// The power cycle of the current reclaim attempt was recorded as sent.
    pub cycle_sent: bool,
    /// The current generation's netboot was observed already (`netboot_progress`): a
    /// further DHCP from the machine changes nothing.
    pub netboot_observed: bool,
}

/// A network interface of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct InterfaceRow {
    pub mac: Mac,
    pub node_id: i64,
    pub is_boot: bool,
}

/// A BMC endpoint as shown to operators (the password is never part of it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct BmcRow {
    pub node_id: i64,
    pub driver: Driver,
    pub address: String,
    pub username: String,
    pub system_id: Option<String>,
    pub tls_pin: Option<String>,
    pub tls_insecure: bool,
}

/// One row of a node's audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventView {
    pub id: i64,
    pub node_id: i64,
    pub generation: i64,
    pub from_state: Option<State>,
    pub event: String,
    pub to_state: State,
    pub at: String,
    pub actor: String,
    pub detail: Option<String>,
}

/// One row of the audit log, as written.
#[derive(Debug, Clone, Copy)]
pub struct Audit<'a> {
    pub node_id: i64,
    pub generation: i64,
    /// The state before (`None` for a registration).
    pub from: Option<State>,
    pub event: &'a str,
    pub to: State,
    pub actor: &'a str,
    pub detail: Option<&'a str>,
}

impl<'a> Audit<'a> {
    /// An entry with no `from` state and no detail.
    pub fn new(node_id: i64, generation: i64, event: &'a str, to: State, actor: &'a str) -> Self {
        Audit {
            node_id,
            generation,
            from: None,
            event,
            to,
            actor,
            detail: None,
        }
    }
}

/// An imported image as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct ImageRow {
    pub name: String,
    pub family: String,
    pub definition: String,
    pub imported_at: String,
}

/// One stage to store (the first time a generation reaches it wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageWrite {
    pub node_id: i64,
    pub generation: i64,
    pub stage: Stage,
    /// RFC 3339, UTC, milliseconds.
    pub at: String,
    pub bytes: Option<i64>,
    pub took_ms: Option<i64>,
    pub detail: Option<String>,
}

/// A stored stage.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StageRow {
    pub generation: i64,
    pub stage: Stage,
    pub at: String,
    pub bytes: Option<i64>,
    pub took_ms: Option<i64>,
    pub detail: Option<String>,
}

/// A node in a reinstall or failed, with its current generation's stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracked {
    pub node_id: i64,
    pub name: Option<String>,
    pub state: State,
    pub state_since: String,
    pub failed_reason: Option<String>,
    pub stages: Vec<StageRow>,
}

/// A reinstall request and how its generation ended, from the audit log.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ReinstallRow {
    pub node_id: i64,
    pub generation: i64,
    pub requested_at: String,
    pub ended_at: Option<String>,
    pub outcome: Option<State>,
    pub end_event: Option<String>,
    pub end_from: Option<State>,
    pub end_detail: Option<String>,
}

/// Adds one row of a nodes-with-stages join (ordered by node) to `out`: `node` starts
/// a new entry unless it is the last one's, and `stage`, if any, joins it.
pub fn push_tracked(out: &mut Vec<Tracked>, node: Tracked, stage: Option<StageRow>) {
    if out.last().is_none_or(|t| t.node_id != node.node_id) {
        out.push(node);
    }
    if let (Some(s), Some(t)) = (stage, out.last_mut()) {
        t.stages.push(s);
    }
}

/// One line an installer sent (syslog or reporting webhook), secrets redacted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstallLogLine {
    /// When pxed received it (RFC 3339, UTC).
    pub at: String,
    /// `syslog` or `webhook`.
    pub source: String,
    pub line: String,
}

/// A node whose installer may be talking: what the recorder needs to store a line and
/// act on it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct LogTarget {
    pub node_id: i64,
    pub generation: i64,
    pub state: State,
    /// `images.family` of the node's image (`None`: no image or not imported).
    pub family: Option<String>,
    /// Redacted from every line (an installer may echo its command line).
    pub boot_token: Option<BootToken>,
    pub agent_token: Option<AgentToken>,
}

/// One line to store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogWrite {
    pub node_id: i64,
    pub generation: i64,
    pub at: String,
    pub source: &'static str,
    pub line: String,
}
