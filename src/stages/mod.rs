//! Stages from the wire (issue 12): for each node and generation, when it reached each
//! stage of a reinstall, as pxed saw it on DHCP, TFTP and HTTP and in the lifecycle.
//!
//! The servers only queue what they saw ([`Stages::saw`]: a bounded channel, dropped
//! and counted when full); the [`recorder`] attributes each sighting to a node (by
//! MAC, client address or id), stores it in batches, and feeds the stage histograms.
//! Which stage a node is in, and whether it is past the expected duration of that
//! stage ("stuck"), is computed on read by the pure functions below.

pub mod http;
pub mod recorder;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use crate::metrics::{Counter, CounterFamily, Histogram, HistogramFamily, Render, STAGE_BUCKETS};
use crate::model::{Mac, Stage, State};
use crate::store::nodes::parse_time;
use crate::store::stages::{ReinstallRow, StageRow, Tracked};
use crate::wire::{
    FailureCount, GenerationStages, Leftover, Report, StageDuration, StageNow, StageView,
};

/// Sightings queued for the recorder before new ones are dropped.
pub const QUEUE: usize = 4096;

/// The lifecycle's stream of committed changes.
pub type Changes = tokio::sync::broadcast::Receiver<crate::lifecycle::worker::NodeChange>;

/// Who a sighting is about, as the server that saw it knows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Who {
    /// A node by id (lifecycle events).
    Node(i64),
    /// A MAC (DHCP, the script URL).
    Mac(Mac),
    /// A client address (TFTP and HTTP transfers).
    Ip(IpAddr),
}

/// One thing a server saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sighting {
    pub who: Who,
    pub stage: Stage,
    /// RFC 3339, UTC, milliseconds.
    pub at: String,
    pub bytes: Option<u64>,
    pub took: Option<Duration>,
    pub detail: Option<String>,
    /// An IPv4 address a MAC asked for in DHCP: later transfers from it are that MAC's.
    pub address: Option<std::net::Ipv4Addr>,
}

impl Sighting {
    /// `stage` of `who`, now.
    pub fn now(who: Who, stage: Stage) -> Sighting {
        Sighting {
            who,
            stage,
            at: crate::store::nodes::now(),
            bytes: None,
            took: None,
            detail: None,
            address: None,
        }
    }

    /// With a detail.
    pub fn detail(mut self, d: impl Into<String>) -> Sighting {
        self.detail = Some(d.into());
        self
    }
}

/// The stage a DHCP packet from a netboot client marks: iPXE's own DHCP, a REQUEST
/// (the lease), or else a DISCOVER.
pub fn dhcp_stage(seen: &crate::dhcp::DhcpSeen) -> Stage {
    if seen.user_class_ipxe {
        Stage::IpxeDhcp
    } else if seen.address.is_some() {
        Stage::Lease
    } else {
        Stage::DhcpDiscover
    }
}

/// The stage an HTTP path marks: iPXE binaries are the first stage over HTTP (UEFI
/// HTTP boot), an image's `kernel` and `initrd` the installer's.
pub fn http_stage(path: &str) -> Option<Stage> {
    if path.starts_with("/ipxe/") {
        return Some(Stage::FirstStage);
    }
    let rest = path.strip_prefix("/images/")?;
    match rest.rsplit('/').next()? {
        "kernel" => Some(Stage::Kernel),
        "initrd" => Some(Stage::Initrd),
        _ => None,
    }
}

/// What serving the per-node script to `mac` marks: local boot, or the script stage
/// with the action it served (installer, deploy agent, discovery).
pub fn script_sighting(mac: Mac, action: &crate::script::Action) -> Sighting {
    use crate::script::Action;
    let who = Who::Mac(mac);
    match action {
        Action::LocalBoot => Sighting::now(who, Stage::LocalBoot),
        Action::Discovery => Sighting::now(who, Stage::Script).detail("discovery"),
        Action::Install(arches) => {
            let deploy = arches.iter().any(|a| a.cmdline.contains("pxed.token="));
            Sighting::now(who, Stage::Script).detail(if deploy { "deploy" } else { "installer" })
        }
    }
}

/// Counters and histograms of the stage recorder, rendered at `/metrics`.
#[derive(Debug)]
pub struct StageStats {
    pub queued: Counter,
    /// Sightings dropped: the queue was full, or the lifecycle stream lagged.
    pub dropped: Counter,
    pub stored: Counter,
    /// Sightings of no node in a reinstall (an installed machine's PXE, a stranger).
    pub unattributed: Counter,
    pub store_errors: Counter,
    /// How long each stage lasted (reached until the next stage was).
    pub durations: HistogramFamily,
    /// Reinstall request to `available`.
    pub reinstalls: Histogram,
    /// Failures by the stage the node was in and the kind of reason.
    pub failures: CounterFamily<2>,
    /// Nodes by state and nodes stuck, as of the recorder's last look.
    gauges: Mutex<(BTreeMap<State, i64>, i64)>,
}

impl Default for StageStats {
    fn default() -> Self {
        StageStats {
            queued: Counter::default(),
            dropped: Counter::default(),
            stored: Counter::default(),
            unattributed: Counter::default(),
            store_errors: Counter::default(),
            durations: HistogramFamily::new(
                "pxed_stage_duration_seconds",
                "How long each stage of a reinstall lasted (until the next stage was reached)",
                "stage",
                STAGE_BUCKETS,
            ),
            reinstalls: Histogram::new(
                "pxed_reinstall_duration_seconds",
                "Reinstall request to available",
                STAGE_BUCKETS,
            ),
            failures: CounterFamily::new(
                "pxed_stage_failures_total",
                "Reinstalls failed, by the stage the node was in and the kind of reason",
                ["stage", "reason"],
            ),
            gauges: Mutex::new((BTreeMap::new(), 0)),
        }
    }
}

impl StageStats {
    /// Replaces the node gauges.
    pub fn set_gauges(&self, by_state: BTreeMap<State, i64>, stuck: i64) {
        *self.gauges.lock().unwrap_or_else(|e| e.into_inner()) = (by_state, stuck);
    }
}

impl Render for StageStats {
    fn render(&self, out: &mut String) {
        use crate::metrics::sample;
        use std::fmt::Write;
        for (name, help, c) in [
            (
                "pxed_stage_sightings_total",
                "Stage sightings queued by the servers",
                &self.queued,
            ),
            (
                "pxed_stage_sightings_dropped_total",
                "Stage sightings dropped (queue full or lifecycle stream lagged)",
                &self.dropped,
            ),
            (
                "pxed_stage_stored_total",
                "Stages stored (first time a generation reached them)",
                &self.stored,
            ),
            (
                "pxed_stage_unattributed_total",
                "Sightings of no node in a reinstall",
                &self.unattributed,
            ),
            (
                "pxed_stage_store_errors_total",
                "Batches of stages the store refused",
                &self.store_errors,
            ),
        ] {
            sample(out, name, help, "counter", c.get());
        }
        self.durations.render(out);
        self.reinstalls.render(out);
        self.failures.render(out);
        let g = self.gauges.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(
            out,
            "# HELP pxed_nodes Nodes by state\n# TYPE pxed_nodes gauge"
        );
        for s in State::ALL {
            let _ = writeln!(
                out,
                "pxed_nodes{{state=\"{s}\"}} {}",
                g.0.get(&s).unwrap_or(&0)
            );
        }
        sample(
            out,
            "pxed_nodes_stuck",
            "Nodes in a reinstall past the expected duration of their stage",
            "gauge",
            g.1,
        );
    }
}

/// The handle servers queue sightings through.
#[derive(Debug)]
pub struct Stages {
    tx: mpsc::Sender<Sighting>,
    rx: Mutex<Option<mpsc::Receiver<Sighting>>>,
    /// The lifecycle's changes, subscribed before anything can change.
    changes: Mutex<Option<Changes>>,
    pub stats: std::sync::Arc<StageStats>,
    /// Expected duration per stage (`[stages] expected`).
    pub expected: BTreeMap<Stage, Duration>,
}

impl Stages {
    /// A queue of [`QUEUE`] sightings, for the expected durations `expected`; the
    /// recorder will also read `changes`.
    pub fn new(expected: BTreeMap<Stage, Duration>, changes: Changes) -> Stages {
        let (tx, rx) = mpsc::channel(QUEUE);
        Stages {
            tx,
            rx: Mutex::new(Some(rx)),
            changes: Mutex::new(Some(changes)),
            stats: Default::default(),
            expected,
        }
    }

    /// Queues a sighting; never waits (dropped and counted when the queue is full).
    pub fn saw(&self, s: Sighting) {
        match self.tx.try_send(s) {
            Ok(()) => self.stats.queued.inc(),
            Err(_) => self.stats.dropped.inc(),
        }
    }

    /// What DHCP saw from a netboot client.
    pub fn dhcp_seen(&self, seen: &crate::dhcp::DhcpSeen) {
        let mut s = Sighting::now(Who::Mac(seen.mac), dhcp_stage(seen));
        s.address = seen.address;
        self.saw(s);
    }

    /// The recorder's ends of the queue and of the lifecycle's changes (once).
    pub fn take_receivers(&self) -> Option<(mpsc::Receiver<Sighting>, Changes)> {
        let rx = self.rx.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        let changes = self
            .changes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        Some((rx, changes))
    }

    /// The expected duration of `stage` (`None`: final).
    pub fn expected(&self, stage: Stage) -> Option<Duration> {
        self.expected.get(&stage).copied()
    }
}

impl crate::tftp::TransferObserver for Stages {
    fn completed(&self, peer: IpAddr, file: &str, bytes: u64, took: Duration) {
        let mut s = Sighting::now(
            Who::Ip(crate::credential::canonical(peer)),
            Stage::FirstStage,
        )
        .detail(format!("tftp {file}"));
        s.bytes = Some(bytes);
        s.took = Some(took);
        self.saw(s);
    }
}

/// A generation's stages in the order they were reached (time, then the order of a
/// successful reinstall for equal times).
pub fn ordered(mut rows: Vec<StageRow>) -> Vec<StageRow> {
    rows.sort_by(|a, b| {
        let (ta, tb) = (parse_time(&a.at), parse_time(&b.at));
        ta.cmp(&tb).then(a.stage.index().cmp(&b.stage.index()))
    });
    rows
}

fn ms_between(a: &str, b: &str) -> Option<u64> {
    let (a, b) = (parse_time(a)?, parse_time(b)?);
    u64::try_from((b - a).num_milliseconds()).ok()
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whether a node in `state`, in `stage` since `since`, is past `expected` at `now`:
/// only a reinstall in progress can be stuck.
pub fn is_stuck(
    state: State,
    stage: Stage,
    since: &str,
    expected: Option<Duration>,
    now: DateTime<Utc>,
) -> bool {
    let (Some(expected), Some(since)) = (expected, parse_time(since)) else {
        return false;
    };
    state.in_progress() && !stage.is_final() && (now - since).to_std().is_ok_and(|d| d > expected)
}

/// The stage a generation is in: the last one reached (`rows` ordered).
pub fn current(
    state: State,
    rows: &[StageRow],
    expected: &BTreeMap<Stage, Duration>,
    now: DateTime<Utc>,
) -> Option<StageNow> {
    let last = rows.last()?;
    let exp = expected.get(&last.stage).copied();
    Some(StageNow {
        stage: last.stage,
        since: last.at.clone(),
        expected_ms: exp.map(ms),
        stuck: is_stuck(state, last.stage, &last.at, exp, now),
    })
}

/// The views of a generation's stages (`rows` ordered): each lasted until the next.
pub fn views(rows: &[StageRow], expected: &BTreeMap<Stage, Duration>) -> Vec<StageView> {
    rows.iter()
        .enumerate()
        .map(|(i, r)| StageView {
            stage: r.stage,
            at: r.at.clone(),
            bytes: r.bytes.and_then(|b| u64::try_from(b).ok()),
            took_ms: r.took_ms.and_then(|b| u64::try_from(b).ok()),
            detail: r.detail.clone(),
            lasted_ms: rows.get(i + 1).and_then(|n| ms_between(&r.at, &n.at)),
            expected_ms: expected.get(&r.stage).copied().map(ms),
        })
        .collect()
}

/// An earlier generation's durations (`rows` ordered).
pub fn generation_summary(generation: i64, rows: &[StageRow]) -> GenerationStages {
    let durations = rows
        .windows(2)
        .filter_map(|w| {
            Some(StageDuration {
                stage: w[0].stage,
                ms: ms_between(&w[0].at, &w[1].at)?,
            })
        })
        .collect();
    let start = rows.iter().find(|r| r.stage == Stage::Reinstall);
    let end = rows.iter().find(|r| r.stage.is_final());
    GenerationStages {
        generation,
        durations,
        total_ms: start.zip(end).and_then(|(s, e)| ms_between(&s.at, &e.at)),
        last: rows.last().map(|r| r.stage),
    }
}

/// The bounded label for why a node failed, from the lifecycle event that failed it.
pub fn reason_kind(event: &str) -> &'static str {
    match event {
        "deadline_expired" => "timeout",
        "bmc_step_failed" => "bmc",
        "install_failed" => "installer",
        "health_failed" => "health",
        "marked_failed" => "operator",
        _ => "other",
    }
}

/// The value at quantile `q` of `sorted` (nearest rank).
pub fn quantile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Most example reasons kept per failure row.
const EXAMPLES: usize = 3;

/// The report over `reinstalls` (from the audit log), with the stages each failed
/// generation reached (`failed_stages`: node and generation to the last stage before
/// `failed`) and the nodes in a reinstall or failed now.
pub fn report(
    since: &str,
    until: DateTime<Utc>,
    reinstalls: &[ReinstallRow],
    failed_stages: &BTreeMap<(i64, i64), Stage>,
    tracked: &[Tracked],
    expected: &BTreeMap<Stage, Duration>,
) -> Report {
    let mut durations = Vec::new();
    let (mut succeeded, mut failed) = (0, 0);
    let mut failures: BTreeMap<(String, &'static str), (u64, Vec<String>)> = BTreeMap::new();
    for r in reinstalls.iter().rev() {
        match r.outcome {
            Some(State::Available) => {
                succeeded += 1;
                if let Some(d) = r
                    .ended_at
                    .as_deref()
                    .and_then(|e| ms_between(&r.requested_at, e))
                {
                    durations.push(d);
                }
            }
            Some(_) => {
                failed += 1;
                let stage = failed_stages
                    .get(&(r.node_id, r.generation))
                    .map(|s| s.to_string())
                    .or_else(|| r.end_from.map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown".into());
                let kind = reason_kind(r.end_event.as_deref().unwrap_or(""));
                let e = failures.entry((stage, kind)).or_default();
                e.0 += 1;
                if let Some(d) = &r.end_detail
                    && e.1.len() < EXAMPLES
                    && !e.1.contains(d)
                {
                    e.1.push(d.clone());
                }
            }
            None => {}
        }
    }
    durations.sort_unstable();
    let mut failures: Vec<FailureCount> = failures
        .into_iter()
        .map(|((stage, reason), (count, examples))| FailureCount {
            stage,
            reason: reason.into(),
            count,
            examples,
        })
        .collect();
    failures.sort_by_key(|f| std::cmp::Reverse(f.count));
    let leftovers = tracked
        .iter()
        .filter_map(|t| {
            let rows = ordered(t.stages.clone());
            let now = current(t.state, &rows, expected, until);
            let stuck = now.as_ref().is_some_and(|n| n.stuck);
            (t.state == State::Failed || stuck).then(|| Leftover {
                node_id: t.node_id,
                name: t.name.clone(),
                state: t.state,
                stage: now.as_ref().map(|n| n.stage),
                since: now.map_or_else(|| t.state_since.clone(), |n| n.since),
                stuck,
                reason: t.failed_reason.clone(),
            })
        })
        .collect();
    Report {
        since: since.to_string(),
        until: until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        reinstalls: reinstalls.len() as u64,
        succeeded,
        failed,
        unfinished: reinstalls.len() as u64 - succeeded - failed,
        p50_ms: quantile(&durations, 0.5),
        p95_ms: quantile(&durations, 0.95),
        failures,
        leftovers,
    }
}

#[cfg(test)]
mod tests;
