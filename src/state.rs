//! The state shared by the HTTP handlers, the discovery task and the workers.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::credential::Whereabouts;
use crate::discovery::Discovery;
use crate::lifecycle::transition::Policy;
use crate::lifecycle::worker::{BmcConnector, Lifecycle};
use crate::metrics::{Counter, Render, sample};
use crate::store::nodes::NodeRow;
use crate::store::{Store, StoreError};

/// Counters of the HTTP side.
#[derive(Debug, Default)]
pub struct AppStats {
    pub stale_tokens: Counter,
    pub scripts: Counter,
    pub installers_served: Counter,
    /// Installers not served because the node changed between the read and the
    /// `installer_served` transition (quarantined, failed, superseded).
    pub installers_refused: Counter,
    /// Script fetches from MACs pxed does not know (answered, never stored).
    pub unknown_scripts: Counter,
    pub deploy_plans: Counter,
    /// A node's token from an address it is not bound to.
    pub wrong_address_tokens: Counter,
    /// A node's token used for another stage's call (boot token for first-boot, ...).
    pub wrong_stage_tokens: Counter,
    /// Installers not served: the script was fetched from an address the boot token
    /// could not be bound to.
    pub installers_wrong_address: Counter,
}

/// State shared by the HTTP handlers and workers.
#[derive(Debug)]
pub struct AppState {
    pub cfg: Arc<Config>,
    pub store: Store,
    pub lifecycle: Arc<Lifecycle>,
    pub api_token: String,
    pub stats: AppStats,
    pub renders: Mutex<Vec<Arc<dyn Render>>>,
    /// Fires when pxed shuts down (long-lived responses such as `/events` end on it).
    pub shutdown: CancellationToken,
    /// Unknown netboot clients seen by DHCP become `discovered` nodes.
    pub discovery: Discovery,
    /// What the last leftovers check found (`GET /api/v1/leftovers`).
    pub leftovers: Arc<crate::leftovers::Leftovers>,
    /// Status-page event streams open at once (bounded).
    pub subscribers: Arc<tokio::sync::Semaphore>,
    /// HTTP connection limits (from the open-files limit at start).
    pub conn_limits: crate::net::ConnLimits,
    /// Installer telemetry: counters, the recorder's queue, the syslog address.
    pub telemetry: Arc<crate::telemetry::Telemetry>,
    /// Stages from the wire: the recorder's queue, expected durations, histograms.
    pub stages: Arc<crate::stages::Stages>,
    /// Refusals already in a node's audit log, by node, generation, event and detail
    /// (which names the call and the addresses): one row each however often a request
    /// is repeated (cleared when full).
    refusals: Mutex<HashSet<(i64, i64, String)>>,
    /// The mirror check before each reinstall.
    pub mirror_gate: crate::images::MirrorGate,
    /// Transfer slots in use (TFTP, HTTP files), read by DHCP pacing.
    pub slots: Arc<crate::pacing::Slots>,
}

/// Most distinct refusals remembered before the memory is cleared.
const MAX_REFUSALS: usize = 4096;

impl AppState {
    /// Builds the state; `bmcs` is the BMC connector (tests pass a recording double).
    pub fn new(
        cfg: Arc<Config>,
        store: Store,
        bmcs: Arc<dyn BmcConnector>,
        api_token: String,
        cancel: CancellationToken,
    ) -> Arc<AppState> {
        let policy = Policy::from_config(&cfg.lifecycle);
        let lifecycle = Lifecycle::new(store.clone(), policy, bmcs, cancel.clone());
        lifecycle.set_waves(crate::lifecycle::pacing::Waves::from_config(&cfg.pacing));
        let conn_limits = crate::net::ConnLimits::for_fd_limit(crate::net::fd_limit());
        lifecycle.set_max_booting(cfg.pacing.max_booting_within(conn_limits));
        lifecycle.set_owner_ttl(cfg.lifecycle.owner_ttl);
        lifecycle.set_queue_webhooks(!cfg.webhooks.targets.is_empty());
        let pacing_stats: Arc<dyn Render> = lifecycle.pacing.clone();
        let store_health: Arc<dyn Render> = store.health();
        let discovery = cfg.discovery;
        let telemetry = Arc::new(crate::telemetry::Telemetry::default());
        let telemetry_stats: Arc<dyn Render> = telemetry.stats.clone();
        let stages = Arc::new(crate::stages::Stages::new(
            cfg.stages.expected.clone(),
            lifecycle.subscribe(),
        ));
        let stage_stats: Arc<dyn Render> = stages.stats.clone();
        let leftovers = Arc::new(crate::leftovers::Leftovers::default());
        let leftovers_render: Arc<dyn Render> = leftovers.clone();
        let slots = crate::pacing::Slots::new();
        let slots_render: Arc<dyn Render> = slots.clone();
        Arc::new(AppState {
            cfg,
            store,
            lifecycle,
            api_token,
            stats: AppStats::default(),
            renders: Mutex::new(vec![
                store_health,
                telemetry_stats,
                stage_stats,
                leftovers_render,
                slots_render,
                pacing_stats,
            ]),
            shutdown: cancel,
            discovery: {
                let d = Discovery::new(discovery);
                let _ = d.stages.set(stages.clone());
                d
            },
            leftovers,
            conn_limits,
            subscribers: Arc::new(tokio::sync::Semaphore::new(
                crate::http::status::MAX_SUBSCRIBERS,
            )),
            refusals: Mutex::new(HashSet::new()),
            mirror_gate: crate::images::MirrorGate::default(),
            telemetry,
            stages,
            slots,
        })
    }

    /// Prometheus text for every component.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        let s = &self.stats;
        for (name, help, c) in [
            (
                "pxed_http_boot_scripts_total",
                "Per-node iPXE scripts served",
                &s.scripts,
            ),
            (
                "pxed_http_installers_served_total",
                "Scripts that started an install",
                &s.installers_served,
            ),
            (
                "pxed_http_installers_refused_total",
                "Installers not served because the node changed meanwhile",
                &s.installers_refused,
            ),
            (
                "pxed_http_unknown_scripts_total",
                "Script fetches from unknown MACs (answered, not stored)",
                &s.unknown_scripts,
            ),
            (
                "pxed_deploy_plans_total",
                "Deploy plans handed to deploy agents",
                &s.deploy_plans,
            ),
            (
                "pxed_callbacks_stale_token_total",
                "Callbacks and configs refused for an unknown or stale token",
                &s.stale_tokens,
            ),
            (
                "pxed_callbacks_wrong_address_total",
                "Callbacks and configs refused: the token came from an address it is not bound to",
                &s.wrong_address_tokens,
            ),
            (
                "pxed_callbacks_wrong_stage_total",
                "Callbacks and configs refused: the boot token for the agent's calls or the reverse",
                &s.wrong_stage_tokens,
            ),
            (
                "pxed_http_installers_wrong_address_total",
                "Installers not served: the script was fetched from an address the token cannot be bound to",
                &s.installers_wrong_address,
            ),
            (
                "pxed_nodes_discovered_total",
                "Unknown machines registered as discovered",
                &self.discovery.discovered,
            ),
            (
                "pxed_discovery_refused_cap_total",
                "Unknown netboot clients not stored: discovery.max_pending nodes wait already",
                &self.discovery.refused_cap,
            ),
            (
                "pxed_discovery_refused_rate_total",
                "Unknown netboot clients not stored: over discovery.per_minute",
                &self.discovery.refused_rate,
            ),
            (
                "pxed_mirror_checks_total",
                "Mirror checks before a reinstall that went to the mirror",
                &self.mirror_gate.checks,
            ),
            (
                "pxed_reinstalls_refused_mirror_total",
                "Reinstalls refused before any change: the mirror lacked what the installer needs",
                &self.mirror_gate.refused,
            ),
        ] {
            sample(&mut out, name, help, "counter", c.get());
        }
        self.lifecycle.bmc_failures.render(&mut out);
        self.lifecycle.netboot_not_observed.render(&mut out);
        self.lifecycle.netboot_observed.render(&mut out);
        sample(
            &mut out,
            "pxed_boot_loops_total",
            "Nodes stopped because the installer was served twice in one attempt",
            "counter",
            self.lifecycle.boot_loops.get(),
        );
        sample(
            &mut out,
            "pxed_nodes_taken_over_total",
            "Nodes in progress this instance took over because the instance running them stopped answering for them (several pxed on one PostgreSQL database)",
            "counter",
            self.lifecycle.taken_over.get(),
        );
        for r in self.renders.lock().expect("lock").iter() {
            r.render(&mut out);
        }
        out
    }

    /// `http://server_ip[:port]` from the configuration alone.
    pub fn default_base_url(&self) -> String {
        self.base_url_at(None)
    }

    /// The base of the URLs pxed hands out on a connection that arrived on `local`:
    /// `server_ip` when configured, else the address the client connected to (pxed's
    /// own, whatever the client claims in `Host`); the port the connection arrived on
    /// (the configured one, or the real one when the configured port was 0). Without a
    /// connection, the configured HTTP address.
    pub fn base_url_at(&self, local: Option<std::net::SocketAddr>) -> String {
        let (ip, port) = match local {
            Some(l) => (l.ip().to_canonical(), l.port()),
            None => (self.cfg.http.ip(), self.cfg.http.port()),
        };
        let ip = self.cfg.server_ip.map_or(ip, std::net::IpAddr::V4);
        let host = match ip {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        };
        match port {
            80 => format!("http://{host}"),
            p => format!("http://{host}:{p}"),
        }
    }

    /// Where `node` may be, for [`crate::credential`]: the address its boot token is
    /// bound to, and in full DHCP mode the addresses leased to its MACs now.
    pub async fn whereabouts(&self, node: &NodeRow) -> Result<Whereabouts, StoreError> {
        let leases_known = self.cfg.dhcp.mode == crate::config::DhcpMode::Full;
        let leased = if leases_known {
            let now = i64::try_from(crate::dhcp::unix_now()).unwrap_or(i64::MAX);
            self.store
                .leased_ips(node.id, now)
                .await?
                .iter()
                .filter_map(|ip| ip.parse().ok())
                .collect()
        } else {
            // Proxy mode: the site's DHCP server leases; the address the node asked it
            // for (seen in its broadcast DHCPREQUEST) stands in for the lease.
            self.discovery.sighted(&self.store.macs(node.id).await?)
        };
        Ok(Whereabouts {
            boot_ip: node.boot_ip.as_deref().and_then(|ip| ip.parse().ok()),
            leased,
            leases_known,
        })
    }

    /// Writes a refusal (`event`, with `detail`: the call and the addresses, never a
    /// token) to the node's audit log, once per node, generation, event and detail.
    pub async fn audit_refusal(&self, node: &NodeRow, event: &str, detail: &str) {
        let first = {
            let mut seen = self.refusals.lock().expect("lock");
            if seen.len() >= MAX_REFUSALS {
                seen.clear();
            }
            seen.insert((node.id, node.generation, format!("{event} {detail}")))
        };
        if !first {
            return;
        }
        if let Err(e) = self
            .store
            .note(node.id, node.generation, node.state, event, "http", detail)
            .await
        {
            tracing::warn!(node = node.id, error = %e, "recording a refusal in the audit log");
        }
    }

    /// Whether an image has been imported.
    pub async fn image_exists(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.store.image(name).await?.is_some())
    }

    /// Drops MACs from the discovery cache (their node was deleted).
    pub fn forget_macs(&self, macs: &[crate::model::Mac]) {
        self.discovery.forget(macs);
    }
}
