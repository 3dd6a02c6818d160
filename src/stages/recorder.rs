//! The stage recorder: attributes queued sightings and lifecycle changes to node
//! generations, stores them in batches (the first time a generation reaches a stage
//! wins), feeds the stage histograms and failure counters, and refreshes the node
//! gauges.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::{Sighting, Who, ordered, reason_kind};
use crate::lifecycle::worker::NodeChange;
use crate::model::{Mac, Stage, State};
use crate::state::AppState;
use crate::store::nodes::NodeRow;
use crate::store::stages::StageWrite;

/// How the recorder batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// A batch is written at least this often while sightings arrive.
    pub flush_every: Duration,
    /// ... or as soon as it holds this many.
    pub max_batch: usize,
    /// How often the node gauges (by state, stuck) are recomputed.
    pub gauges_every: Duration,
    /// Generations of stages kept per node.
    pub keep_generations: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            flush_every: Duration::from_millis(500),
            max_batch: 1024,
            gauges_every: Duration::from_secs(10),
            keep_generations: 5,
        }
    }
}

/// Most client addresses remembered (from DHCP REQUESTs) to attribute transfers.
const ADDRESSES_CAP: usize = 65_536;

/// The sightings a committed lifecycle change stands for.
pub fn of_change(c: &NodeChange) -> Vec<Sighting> {
    let at = |stage| Sighting {
        at: c.at.clone(),
        ..Sighting::now(Who::Node(c.node_id), stage)
    };
    let mut out = Vec::new();
    if let Some(s) = Stage::of_event(&c.event) {
        out.push(at(s));
    }
    match (c.state, c.event.as_str()) {
        (_, "registered" | "deleted") => {}
        (State::Available, _) => out.push(at(Stage::Available)),
        // The detail carries the kind of reason until the node's own words are read.
        (State::Failed, e) => out.push(at(Stage::Failed).detail(reason_kind(e))),
        _ => {}
    }
    out
}

/// Runs until `cancel` fires (writing what it holds) or the queue closes.
pub async fn run(
    st: Arc<AppState>,
    mut rx: mpsc::Receiver<Sighting>,
    mut changes: broadcast::Receiver<NodeChange>,
    settings: Settings,
    cancel: CancellationToken,
) {
    let mut batch: Vec<Sighting> = Vec::new();
    let mut addresses: HashMap<Ipv4Addr, Mac> = HashMap::new();
    let mut tick = tokio::time::interval(settings.flush_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut gauges = tokio::time::interval(settings.gauges_every);
    gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changes_open = true;
    loop {
        tokio::select! {
            biased;
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => break,
            // CANCEL-SAFETY: tick is cancel-safe.
            _ = tick.tick() => {
                if !batch.is_empty() {
                    flush(&st, std::mem::take(&mut batch), settings, &mut addresses).await;
                }
            }
            // CANCEL-SAFETY: tick is cancel-safe.
            _ = gauges.tick() => refresh_gauges(&st).await,
            // CANCEL-SAFETY: broadcast recv is cancel-safe.
            c = changes.recv(), if changes_open => match c {
                // Another instance's change: that instance records its stages.
                Ok(c) if c.remote => {}
                Ok(c) => batch.extend(of_change(&c)),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    st.stages.stats.dropped.add(n);
                    tracing::warn!(missed = n, "stage recorder lagged behind lifecycle changes");
                }
                Err(broadcast::error::RecvError::Closed) => changes_open = false,
            },
            // CANCEL-SAFETY: recv is cancel-safe.
            r = rx.recv() => match r {
                Some(s) => {
                    batch.push(s);
                    if batch.len() >= settings.max_batch {
                        flush(&st, std::mem::take(&mut batch), settings, &mut addresses).await;
                    }
                }
                None => break,
            },
        }
    }
    while let Ok(s) = rx.try_recv() {
        batch.push(s);
    }
    while let Ok(c) = changes.try_recv() {
        batch.extend(of_change(&c));
    }
    flush(&st, batch, settings, &mut addresses).await;
}

/// Looks nodes up once per batch.
#[derive(Default)]
struct Lookups {
    by_id: HashMap<i64, Option<NodeRow>>,
    by_mac: HashMap<Mac, Option<NodeRow>>,
    by_ip: HashMap<IpAddr, Option<NodeRow>>,
}

impl Lookups {
    /// Looks up every node id and MAC of a batch at once (a node shows up in a batch
    /// every half second of its reinstall: one query per node each time was most of
    /// the store's reads in a boot storm). What is not found is remembered as such;
    /// after an error the lookups below go one by one.
    async fn prefetch(&mut self, st: &AppState, batch: &[Sighting]) {
        let mut ids = BTreeSet::new();
        let mut macs = BTreeSet::new();
        for s in batch {
            match s.who {
                Who::Node(id) => {
                    ids.insert(id);
                }
                Who::Mac(mac) => {
                    macs.insert(mac);
                }
                Who::Ip(_) => {}
            }
        }
        if !ids.is_empty() {
            let ids: Vec<i64> = ids.into_iter().collect();
            match st.store.nodes_by_ids(&ids).await {
                Ok(rows) => {
                    self.by_id.extend(ids.iter().map(|&id| (id, None)));
                    self.by_id.extend(rows.into_iter().map(|n| (n.id, Some(n))));
                }
                Err(e) => {
                    tracing::warn!(nodes = ids.len(), error = %e, "looking up nodes for their stages")
                }
            }
        }
        if !macs.is_empty() {
            let macs: Vec<Mac> = macs.into_iter().collect();
            match st.store.nodes_by_macs(&macs).await {
                Ok(rows) => {
                    self.by_mac.extend(macs.iter().map(|&m| (m, None)));
                    self.by_mac
                        .extend(rows.into_iter().map(|(m, n)| (m, Some(n))));
                }
                Err(e) => {
                    tracing::warn!(macs = macs.len(), error = %e, "looking up MACs for their stages")
                }
            }
        }
    }

    async fn node(&mut self, st: &AppState, id: i64) -> Option<NodeRow> {
        if let Some(n) = self.by_id.get(&id) {
            return n.clone();
        }
        let n = st.store.node(id).await.unwrap_or_else(|e| {
            tracing::warn!(node = id, error = %e, "looking up a node for its stages");
            None
        });
        self.by_id.insert(id, n.clone());
        n
    }

    async fn by_mac(&mut self, st: &AppState, mac: Mac) -> Option<NodeRow> {
        if let Some(n) = self.by_mac.get(&mac) {
            return n.clone();
        }
        let n = st.store.node_by_mac(mac).await.unwrap_or_else(|e| {
            tracing::warn!(%mac, error = %e, "looking up a MAC for its stages");
            None
        });
        self.by_mac.insert(mac, n.clone());
        n
    }

    async fn by_ip(
        &mut self,
        st: &AppState,
        ip: IpAddr,
        addresses: &HashMap<Ipv4Addr, Mac>,
    ) -> Option<NodeRow> {
        if let Some(n) = self.by_ip.get(&ip) {
            return n.clone();
        }
        let mac = match ip {
            IpAddr::V4(v4) => addresses.get(&v4).copied(),
            IpAddr::V6(_) => None,
        };
        let n = match mac {
            Some(mac) => self.by_mac(st, mac).await,
            None => {
                // The address its installer was served to, or a lease pxed gave it.
                let now = i64::try_from(crate::dhcp::unix_now()).unwrap_or(i64::MAX);
                match st.store.log_target_by_ip(&ip.to_string(), now).await {
                    Ok(Some(t)) => self.node(st, t.node_id).await,
                    Ok(None) => None,
                    Err(e) => {
                        tracing::warn!(%ip, error = %e, "looking up an address for its stages");
                        None
                    }
                }
            }
        };
        self.by_ip.insert(ip, n.clone());
        n
    }
}

async fn flush(
    st: &AppState,
    batch: Vec<Sighting>,
    settings: Settings,
    addresses: &mut HashMap<Ipv4Addr, Mac>,
) {
    if batch.is_empty() {
        return;
    }
    let stats = &st.stages.stats;
    let mut lookups = Lookups::default();
    lookups.prefetch(st, &batch).await;
    let mut writes = Vec::new();
    // Failure kinds by node generation, for the failure counter.
    let mut kinds: HashMap<(i64, i64), &'static str> = HashMap::new();
    // Nodes seen netbooting here (DHCP, the script URL), in or out of a reinstall:
    // served by this instance's site.
    let mut here: BTreeSet<i64> = BTreeSet::new();
    for s in batch {
        if let (Who::Mac(mac), Some(ip)) = (s.who, s.address) {
            if addresses.len() >= ADDRESSES_CAP && !addresses.contains_key(&ip) {
                addresses.clear();
            }
            addresses.insert(ip, mac);
        }
        let node = match s.who {
            Who::Node(id) => lookups.node(st, id).await,
            Who::Mac(mac) => lookups.by_mac(st, mac).await,
            Who::Ip(ip) => lookups.by_ip(st, ip, addresses).await,
        };
        if let (Who::Mac(_), Some(n)) = (s.who, &node)
            && st.cfg.site.is_some()
            && n.site != st.cfg.site
        {
            here.insert(n.id);
        }
        // What the servers see counts only for a node in a reinstall: an installed
        // machine's PXE boot is not a stage of anything.
        let Some(node) = node.filter(|n| matches!(s.who, Who::Node(_)) || in_reinstall(n, &s.at))
        else {
            stats.unattributed.inc();
            continue;
        };
        let mut detail = s.detail;
        if s.stage == Stage::Failed {
            let kind = match detail.as_deref() {
                Some("timeout") => "timeout",
                Some("bmc") => "bmc",
                Some("installer") => "installer",
                Some("health") => "health",
                Some("operator") => "operator",
                _ => "other",
            };
            kinds.insert((node.id, node.generation), kind);
            // Worded as the board and the node page word it.
            detail = Some(match &node.failed_reason {
                Some(r) => crate::model::failure_text(node.failed_step, Some(r))
                    .unwrap_or_else(|| r.clone()),
                None => kind.to_string(),
            });
        }
        writes.push(StageWrite {
            node_id: node.id,
            generation: node.generation,
            stage: s.stage,
            at: s.at,
            bytes: s.bytes.and_then(|b| i64::try_from(b).ok()),
            took_ms: s.took.and_then(|t| i64::try_from(t.as_millis()).ok()),
            detail,
        });
    }
    if let Some(site) = &st.cfg.site
        && !here.is_empty()
    {
        let ids: Vec<i64> = here.into_iter().collect();
        if let Err(e) = st.store.set_sites(site, &ids).await {
            stats.store_errors.inc();
            tracing::warn!(nodes = ids.len(), error = %e, "recording the site of nodes");
        }
    }
    let new = match st
        .store
        .record_stages(&writes, settings.keep_generations)
        .await
    {
        Ok(new) => new,
        Err(e) => {
            stats.store_errors.inc();
            tracing::warn!(stages = writes.len(), error = %e, "storing stages");
            return;
        }
    };
    stats.stored.add(new.len() as u64);
    let mut by_generation: BTreeMap<(i64, i64), Vec<Stage>> = BTreeMap::new();
    for w in &new {
        by_generation
            .entry((w.node_id, w.generation))
            .or_default()
            .push(w.stage);
    }
    for ((node, generation), stages) in by_generation {
        let rows = match st.store.generation_stages(node, generation).await {
            Ok(r) => ordered(r),
            Err(e) => {
                tracing::warn!(node, error = %e, "reading stages back");
                continue;
            }
        };
        for stage in stages {
            let Some(i) = rows.iter().position(|r| r.stage == stage) else {
                continue;
            };
            let before = i.checked_sub(1).map(|p| &rows[p]);
            if let Some(prev) = before
                && let Some(secs) = seconds(&prev.at, &rows[i].at)
            {
                stats.durations.observe(prev.stage.as_str(), secs);
            }
            match stage {
                Stage::Available => {
                    if let Some(start) = rows.iter().find(|r| r.stage == Stage::Reinstall)
                        && let Some(secs) = seconds(&start.at, &rows[i].at)
                    {
                        stats.reinstalls.observe(secs);
                    }
                }
                Stage::Failed => {
                    let kind = kinds.get(&(node, generation)).copied().unwrap_or("other");
                    let at = before.map_or("unknown", |p| p.stage.as_str());
                    stats.failures.inc([at, kind]);
                }
                _ => {}
            }
        }
    }
}

/// Whether `node` was in a reinstall when a server saw it at `at`: it is now, or the
/// reinstall ended (available or failed) after `at` (the recorder reads the node a
/// moment later than the server saw it).
fn in_reinstall(node: &NodeRow, at: &str) -> bool {
    use crate::store::nodes::parse_time;
    node.state.in_progress()
        || (matches!(node.state, State::Available | State::Failed)
            && node.generation > 0
            && parse_time(at)
                .zip(parse_time(&node.state_since))
                .is_some_and(|(at, since)| at <= since))
}

fn seconds(a: &str, b: &str) -> Option<f64> {
    let (a, b) = (
        crate::store::nodes::parse_time(a)?,
        crate::store::nodes::parse_time(b)?,
    );
    let ms = (b - a).num_milliseconds();
    (ms >= 0).then(|| ms as f64 / 1000.0)
}

/// Recomputes nodes by state and stuck nodes.
async fn refresh_gauges(st: &AppState) {
    let (counts, tracked) =
        match tokio::try_join!(st.store.state_counts(), st.store.tracked_nodes()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "counting nodes for the stage gauges");
                return;
            }
        };
    let now = chrono::Utc::now();
    let stuck = tracked
        .into_iter()
        .filter(|t| {
            let rows = ordered(t.stages.clone());
            super::current(t.state, &rows, &st.stages.expected, now).is_some_and(|c| c.stuck)
        })
        .count();
    st.stages
        .stats
        .set_gauges(counts.into_iter().collect(), stuck as i64);
}
