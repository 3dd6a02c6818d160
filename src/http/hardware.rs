//! `/api/v1` hardware: a node's inventories and acceptance verdict, re-baselining,
//! profile matching, and inventory queries across the fleet (issue 13).
//!
//! | route | what |
//! |---|---|
//! | `GET /nodes/{id}/inventory[?generation=N]` | stored inventories, the generation's diff against the baseline, the gate's verdict under the current config, every profile's match |
//! | `POST /nodes/{id}/inventory/accept` | the generation's inventory becomes the baseline (optionally under another profile); a node the gate quarantined returns to `available` |
//! | `GET /profiles` | the configured profiles and the pairs that overlap |
//! | `GET /inventory/query?gpu=*H100*&gpus=8..&numa_local=true&min_link_width=16&profile=&drifted=` | nodes whose latest inventory matches |

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::api::{find, view};
use super::error::{ApiError, QueryParams};
use crate::inventory::gate::Verdict;
use crate::inventory::profile::{self, Count, DeviceRule, Glob, Miss, Profile};
use crate::inventory::{Change, Inventory};
use crate::lifecycle::transition::Event;
use crate::model::{InventorySource, State as NodeState};
use crate::state::AppState;
use crate::store::hardware::Hardware;
use crate::wire::NodeView;

/// Routes, merged under `/api/v1` (auth applied there).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/nodes/{id}/inventory", get(node_inventory))
        .route("/nodes/{id}/inventory/accept", post(accept))
        .route("/profiles", get(profiles))
        .route("/inventory/query", get(query))
}

/// One stored report, without its body.
#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    pub generation: i64,
    pub source: InventorySource,
    pub collected_at: String,
    pub took_ms: Option<i64>,
}

/// How one profile fits the generation's inventory.
#[derive(Debug, Serialize, Deserialize)]
pub struct ProfileMatch {
    pub profile: String,
    pub matches: bool,
    pub misses: Vec<Miss>,
}

/// `GET /api/v1/nodes/{id}/inventory`.
#[derive(Debug, Serialize, Deserialize)]
pub struct NodeInventory {
    pub node_id: i64,
    pub name: Option<String>,
    pub state: NodeState,
    pub hardware: Hardware,
    /// The generation shown (the newest with an inventory, or the one asked for).
    pub generation: Option<i64>,
    pub reports: Vec<Report>,
    /// The generation's inventory (in-band, completed from the BMC's).
    pub inventory: Option<Inventory>,
    /// Its differences from the baseline.
    pub changes: Vec<Change>,
    /// The gate under the current config (the recorded one is in `hardware.verdict`).
    pub verdict: Option<Verdict>,
    /// Every configured profile against the inventory.
    pub profiles: Vec<ProfileMatch>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationQuery {
    generation: Option<i64>,
}

fn matches(profiles: &[Profile], inv: &Inventory) -> Vec<ProfileMatch> {
    profile::explain(profiles, inv)
        .into_iter()
        .map(|(name, misses)| ProfileMatch {
            profile: name.to_string(),
            matches: misses.is_empty(),
            misses,
        })
        .collect()
}

async fn node_inventory(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<GenerationQuery>,
) -> Result<Json<NodeInventory>, ApiError> {
    let n = find(&st, &id).await?;
    let hardware = st.store.hardware(n.id).await?;
    let rows = st.store.inventories(n.id).await?;
    let generation = q.generation.or_else(|| crate::hardware::newest(&rows));
    let inventory = generation.and_then(|g| crate::hardware::shown(&rows, g));
    let verdict =
        generation.and_then(|g| crate::hardware::verdict(&st.cfg.profiles, &hardware, &rows, g));
    Ok(Json(NodeInventory {
        node_id: n.id,
        name: n.name.clone(),
        state: n.state,
        generation,
        reports: rows
            .iter()
            .map(|r| Report {
                generation: r.generation,
                source: r.source,
                collected_at: r.collected_at.clone(),
                took_ms: r.took_ms,
            })
            .collect(),
        changes: verdict
            .as_ref()
            .map(|v| v.changes.clone())
            .unwrap_or_default(),
        profiles: inventory
            .as_ref()
            .map(|i| matches(&st.cfg.profiles, i))
            .unwrap_or_default(),
        inventory,
        verdict,
        hardware,
    }))
}

/// `POST /api/v1/nodes/{id}/inventory/accept`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Accept {
    /// The generation to accept (default: the newest with an in-band inventory).
    #[serde(default)]
    pub generation: Option<i64>,
    /// Hold the node to this profile from now on; `""` for none. Absent: keep it.
    #[serde(default)]
    pub profile: Option<String>,
}

/// The answer: the node, and the verdict it was accepted under.
#[derive(Debug, Serialize, Deserialize)]
pub struct Accepted {
    pub node: NodeView,
    pub generation: i64,
    pub profile: Option<String>,
    pub changes_accepted: Vec<Change>,
}

async fn accept(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Accepted>, ApiError> {
    // An empty body (the board's button) accepts the newest under the same profile.
    let a: Accept = if body.is_empty() {
        Accept::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?
    };
    let n = find(&st, &id).await?;
    let mut hw = st.store.hardware(n.id).await?;
    let rows = st.store.inventories(n.id).await?;
    let generation = a
        .generation
        .or_else(|| {
            rows.iter()
                .find(|r| r.source.in_band())
                .map(|r| r.generation)
        })
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::CONFLICT,
                "no_inventory",
                "no agent has reported an inventory for this node yet",
            )
        })?;
    let Some(inv) = crate::hardware::of_generation(&rows, generation) else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_inventory",
            format!("no in-band inventory for generation {generation}"),
        ));
    };
    let profile = match a.profile.as_deref() {
        None => None,
        Some("") => Some(None),
        Some(p) => {
            if !st.cfg.profiles.iter().any(|x| x.name == p) {
                return Err(ApiError::bad_request(format!(
                    "profile {p} is not configured (pxed profile list)"
                )));
            }
            Some(Some(p))
        }
    };
    // What is being accepted: the changes against the old baseline. The new profile (or
    // the kept one) must hold for the inventory, or the next reinstall would quarantine
    // the node again.
    let changes = crate::hardware::verdict(&st.cfg.profiles, &hw, &rows, generation)
        .map(|v| v.changes)
        .unwrap_or_default();
    if let Some(p) = profile {
        hw.profile = p.map(str::to_string);
    }
    let under = crate::inventory::gate::gate(&st.cfg.profiles, hw.profile.as_deref(), None, &inv);
    if !under.misses.is_empty() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "profile_not_met",
            format!(
                "{}; accept under another profile (\"profile\": \"name\", or \"\" for none)",
                under.reason()
            ),
        ));
    }
    st.store
        .accept_inventory(n.id, generation, n.state, profile, "api")
        .await?;
    let gated = n.state == NodeState::Quarantined
        && n.failed_reason
            .as_deref()
            .is_some_and(|r| r.starts_with("inventory:"));
    let node = if gated {
        st.lifecycle
            .apply(n.id, &Event::Restored, "api")
            .await?
            .node
    } else {
        n
    };
    Ok(Json(Accepted {
        node: view(&st, node).await?,
        generation,
        profile: under.profile.or(hw.profile),
        changes_accepted: changes,
    }))
}

/// `GET /api/v1/profiles`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Profiles {
    pub profiles: Vec<Profile>,
    /// Pairs of profiles one machine could match both of.
    pub overlaps: Vec<String>,
}

async fn profiles(State(st): State<Arc<AppState>>) -> Json<Profiles> {
    Json(Profiles {
        profiles: st.cfg.profiles.clone(),
        overlaps: profile::overlaps(&st.cfg.profiles),
    })
}

/// `GET /api/v1/inventory/query`: an ad-hoc profile over every node's newest inventory.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Query {
    /// GPUs/accelerators whose identifier matches (default `*`).
    gpu: Option<Glob>,
    /// How many of them (default `1..` when `gpu` is given).
    gpus: Option<Count>,
    /// Each matched GPU's PCIe link at least this wide.
    min_link_width: Option<u32>,
    /// Every GPU has a NIC on its NUMA node.
    numa_local: Option<bool>,
    /// Held to this profile.
    profile: Option<String>,
    /// Lost something since its baseline (`true`) or not (`false`).
    drifted: Option<bool>,
    state: Option<NodeState>,
}

/// One node that matched a query.
#[derive(Debug, Serialize, Deserialize)]
pub struct QueryHit {
    pub node_id: i64,
    pub name: Option<String>,
    pub state: NodeState,
    pub profile: Option<String>,
    pub drifted: bool,
    pub generation: i64,
    pub gpus: usize,
    pub system: String,
}

async fn query(
    State(st): State<Arc<AppState>>,
    QueryParams(q): QueryParams<Query>,
) -> Result<Json<Vec<QueryHit>>, ApiError> {
    let rule =
        (q.gpu.is_some() || q.gpus.is_some() || q.min_link_width.is_some()).then(|| DeviceRule {
            model: q.gpu.clone().unwrap_or_else(Glob::any),
            count: q.gpus.unwrap_or(Count { min: 1, max: None }),
            min_link_width: q.min_link_width,
            min_link_speed_gts: None,
        });
    let adhoc = Profile {
        gpus: rule.into_iter().collect(),
        gpu_nic_numa_local: q.numa_local.unwrap_or(false),
        ..Profile::named("query")
    };
    let hardware: std::collections::HashMap<i64, Hardware> =
        st.store.hardware_all().await?.into_iter().collect();
    let mut hits = Vec::new();
    for n in st.store.nodes().await? {
        let hw = hardware.get(&n.id).cloned().unwrap_or_default();
        if q.state.is_some_and(|s| s != n.state)
            || q.drifted.is_some_and(|d| d != hw.drifted)
            || q.profile
                .as_deref()
                .is_some_and(|p| hw.profile.as_deref() != Some(p))
        {
            continue;
        }
        let rows = st.store.inventories(n.id).await?;
        let Some(generation) = rows
            .iter()
            .find(|r| r.source.in_band())
            .map(|r| r.generation)
        else {
            continue;
        };
        let Some(inv) = crate::hardware::of_generation(&rows, generation) else {
            continue;
        };
        if !profile::check(&adhoc, &inv).is_empty() {
            continue;
        }
        hits.push(QueryHit {
            node_id: n.id,
            name: n.name.clone(),
            state: n.state,
            profile: hw.profile.clone(),
            drifted: hw.drifted,
            generation,
            gpus: profile::accelerator_count(&inv),
            system: format!("{} {}", inv.system.vendor, inv.system.model)
                .trim()
                .to_string(),
        });
    }
    Ok(Json(hits))
}
