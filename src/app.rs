//! Wiring: binds the configured sockets, starts every server on one runtime, and
//! shuts them down in order when the root cancellation token fires.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::http::error::ApiError;
use crate::images::{Arch, Family, ImageDef};
use crate::lifecycle::transition::{Event, Policy, State};
use crate::lifecycle::worker::{BmcConnector, Lifecycle, StoreBmcs};
use crate::metrics::{Counter, Render, sample};
use crate::script::{Action, ArchBoot};
use crate::store::nodes::NodeRow;
use crate::store::{Store, StoreError};

/// Counters of the HTTP side.
#[derive(Debug, Default)]
pub struct AppStats {
    pub stale_tokens: Counter,
    pub scripts: Counter,
    pub installers_served: Counter,
    pub discovered: Counter,
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
    known_macs: Mutex<HashSet<String>>,
}

/// What an image row's `definition` column holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct StoredImage {
    pub def: ImageDef,
    pub imported: crate::images::ImportedImage,
}

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
        let lifecycle = Lifecycle::new(store.clone(), policy, bmcs, cancel);
        Arc::new(AppState {
            cfg,
            store,
            lifecycle,
            api_token,
            stats: AppStats::default(),
            renders: Mutex::new(Vec::new()),
            known_macs: Mutex::new(HashSet::new()),
        })
    }

    /// Prometheus text for every component.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        let s = &self.stats;
        sample(
            &mut out,
            "pxed_http_boot_scripts_total",
            "Per-node iPXE scripts served",
            "counter",
            s.scripts.get(),
        );
        sample(
            &mut out,
            "pxed_http_installers_served_total",
            "Scripts that started an install",
            "counter",
            s.installers_served.get(),
        );
        sample(
            &mut out,
            "pxed_callbacks_stale_token_total",
            "Callbacks and configs refused for an unknown or stale token",
            "counter",
            s.stale_tokens.get(),
        );
        sample(
            &mut out,
            "pxed_nodes_discovered_total",
            "Unknown machines registered as discovered",
            "counter",
            s.discovered.get(),
        );
        for r in self.renders.lock().expect("lock").iter() {
            r.render(&mut out);
        }
        out
    }

    /// `http://server_ip[:port]` when the request did not say which host it reached.
    pub fn default_base_url(&self) -> String {
        let ip = self
            .cfg
            .server_ip
            .map(|i| i.to_string())
            .unwrap_or_else(|| self.cfg.http.ip().to_string());
        match self.cfg.http.port() {
            80 => format!("http://{ip}"),
            p => format!("http://{ip}:{p}"),
        }
    }

    /// Whether an image has been imported.
    pub async fn image_exists(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.store.image(name).await?.is_some())
    }

    async fn stored_image(&self, name: &str) -> Result<Option<StoredImage>, StoreError> {
        Ok(self
            .store
            .image(name)
            .await?
            .and_then(|r| serde_json::from_str(&r.definition).ok()))
    }

    /// Registers an unknown MAC as a `discovered` node (a script fetch saw it).
    pub async fn discover(&self, mac: &str, arch: Option<&str>) -> Result<(), StoreError> {
        if self.known_macs.lock().expect("lock").contains(mac) {
            return Ok(());
        }
        let created = self
            .store
            .discover_many(&[(mac.to_string(), arch.map(String::from))])
            .await?;
        self.registered(&created);
        self.known_macs
            .lock()
            .expect("lock")
            .insert(mac.to_string());
        Ok(())
    }

    /// Drops MACs from the discovery cache (their node was deleted).
    pub fn forget_macs(&self, macs: &[String]) {
        let mut known = self.known_macs.lock().expect("lock");
        for m in macs {
            known.remove(m);
        }
    }

    fn registered(&self, created: &[(i64, String)]) {
        for (id, mac) in created {
            self.stats.discovered.inc();
            self.lifecycle.notify(*id, "registered", "discovered");
            tracing::info!(node = id, %mac, "discovered a new machine");
        }
    }

    /// What `/boot/{mac}.ipxe` tells this node to do, and why. Serving the installer
    /// to a `netbooting` node moves it to `installing`; once the installer called back,
    /// the node gets local boot, so firmware that keeps PXE first never loops.
    pub async fn boot_action(&self, mac: &str, base: &str) -> (Action, String) {
        self.stats.scripts.inc();
        let node = match self.store.node_by_mac(mac).await {
            Ok(Some(n)) => n,
            Ok(None) => {
                if let Err(e) = self.discover(mac, None).await {
                    tracing::warn!(%mac, error = %e, "registering discovered machine");
                }
                return (
                    Action::Discovery,
                    "unknown machine, registered as discovered".into(),
                );
            }
            Err(e) => {
                tracing::error!(%mac, error = %e, "loading node for boot script");
                return (
                    Action::LocalBoot,
                    "store unavailable: booting local disk".into(),
                );
            }
        };
        let state = node.state.as_str();
        if state == State::Discovered.as_str() {
            return (
                Action::Discovery,
                format!("node {} was discovered and is not enrolled", node.id),
            );
        }
        let installing = state == State::Netbooting.as_str() || state == State::Installing.as_str();
        let (true, Some(token)) = (installing, node.boot_token.as_deref()) else {
            return (Action::LocalBoot, format!("node {} is {state}", node.id));
        };
        match self.install_action(&node, base, token).await {
            Ok(action) => {
                if state == State::Netbooting.as_str() {
                    let ev = Event::InstallerServed {
                        generation: node.generation,
                    };
                    if let Err(e) = self.lifecycle.apply(node.id, &ev, "script").await {
                        tracing::warn!(node = node.id, error = %e, "recording installer_served");
                    }
                }
                self.stats.installers_served.inc();
                (
                    action,
                    format!(
                        "reinstall generation {} of node {}",
                        node.generation, node.id
                    ),
                )
            }
            Err(e) => {
                tracing::error!(node = node.id, error = %e, "cannot build the install script");
                (Action::LocalBoot, format!("install media unavailable: {e}"))
            }
        }
    }

    async fn install_action(
        &self,
        node: &NodeRow,
        base: &str,
        token: &str,
    ) -> Result<Action, String> {
        let name = node.image.as_deref().ok_or("node has no image")?;
        let img = self
            .stored_image(name)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("image {name} is not imported"))?;
        let hostname = node.hostname.clone().unwrap_or_default();
        let mirror = self
            .cfg
            .mirror_base
            .clone()
            .unwrap_or_else(|| format!("{base}/images/"));
        let config_base = format!("{base}/cfg/{token}");
        let mut arches = Vec::new();
        for arch in Arch::ALL {
            if !img.imported.arches.contains_key(&arch) {
                continue;
            }
            let cmdline =
                crate::images::kernel_cmdline(&img.def, arch, &mirror, &config_base, &hostname)
                    .map_err(|e| e.to_string())?;
            arches.push(ArchBoot {
                ipxe_arch: arch.as_str(),
                label: arch.as_str(),
                kernel_url: format!("{base}/images/{name}/{}/kernel", arch.as_str()),
                initrd_url: format!("{base}/images/{name}/{}/initrd", arch.as_str()),
                cmdline,
            });
        }
        if arches.is_empty() {
            return Err(format!("image {name} has no imported architecture"));
        }
        Ok(Action::Install(arches))
    }

    /// Renders `/cfg/{token}/{file}` for a node.
    pub async fn render_config(
        &self,
        node: &NodeRow,
        file: &str,
        base: &str,
        token: &str,
    ) -> Result<String, ApiError> {
        let name = node
            .image
            .as_deref()
            .ok_or_else(|| ApiError::not_found("image for this node"))?;
        let img = self
            .stored_image(name)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("image {name}")))?;
        let arch = Arch::parse(&node.arch)
            .filter(|a| img.def.arches.contains_key(a))
            .or_else(|| img.def.arches.keys().next().copied())
            .ok_or_else(|| ApiError::not_found(format!("architecture in image {name}")))?;
        let mirror = self
            .cfg
            .mirror_base
            .clone()
            .unwrap_or_else(|| format!("{base}/images/"));
        let hostname = node
            .hostname
            .clone()
            .unwrap_or_else(|| format!("node-{}", node.id));
        let ctx =
            crate::install::InstallContext::new(&img.def, arch, &mirror, base, token, &hostname)
                .map_err(|e| ApiError::not_found(e.to_string()))?;
        let r = match (img.def.family, file) {
            (Family::Kickstart, "kickstart" | "ks.cfg") => crate::install::render_kickstart(&ctx),
            (Family::Autoinstall, "user-data") => crate::install::render_user_data(&ctx),
            (Family::Autoinstall, "meta-data") => crate::install::render_meta_data(&ctx),
            (Family::Autoinstall, "vendor-data") => Ok(String::new()),
            (Family::Preseed, "preseed" | "preseed.cfg") => crate::install::render_preseed(&ctx),
            _ => {
                return Err(ApiError::not_found(format!(
                    "config {file} for a {:?} image",
                    img.def.family
                )));
            }
        };
        r.map_err(|e| {
            tracing::error!(node = node.id, error = %e, "rendering install config");
            ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "render",
                e.to_string(),
            )
        })
    }
}

/// The iPXE dir exists; every named interface exists and has an address; a full-mode
/// pool lies in the subnet of the interface it is served on.
fn preflight(cfg: &Config) -> anyhow::Result<()> {
    if let Some(reclaim) = cfg.lifecycle.deadlines.get("reclaiming")
        && cfg.bmc.power_deadline >= *reclaim
    {
        tracing::warn!(
            power_deadline = ?cfg.bmc.power_deadline,
            reclaiming = ?reclaim,
            "bmc.power_deadline is not shorter than the reclaiming deadline: a stuck power action will show as a deadline, not as the BMC's error"
        );
    }
    if !cfg.ipxe_dir.is_dir() {
        anyhow::bail!(
            "iPXE dir {} does not exist (fetch the binaries with ipxe/fetch.sh {0}, or set --ipxe-dir)",
            cfg.ipxe_dir.display()
        );
    }
    for name in &cfg.interfaces {
        let iface = crate::net::interface(name)?;
        if cfg.dhcp.mode == crate::config::DhcpMode::Full
            && let Some(sub) = &cfg.dhcp.local
            && !(iface.contains(sub.pool.start) && iface.contains(sub.pool.end))
        {
            anyhow::bail!(
                "pool {}-{} is outside the subnet of {name} ({}/{})",
                sub.pool.start,
                sub.pool.end,
                iface.addr,
                iface.netmask
            );
        }
    }
    Ok(())
}

/// The API token: configured, or generated once into `<data_dir>/api-token` (0600).
fn api_token(cfg: &Config) -> anyhow::Result<String> {
    if let Some(t) = &cfg.api_token {
        return Ok(t.clone());
    }
    let path = cfg.data_dir.join("api-token");
    if let Ok(t) = std::fs::read_to_string(&path)
        && !t.trim().is_empty()
    {
        tracing::info!(file = %path.display(), "API token read from file");
        return Ok(t.trim().to_string());
    }
    let t = crate::http::api::random_token();
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        f.write_all(t.as_bytes())?;
    }
    tracing::info!(file = %path.display(), "generated an API token (set PXED_API_TOKEN or --api-token-file to choose one)");
    Ok(t)
}

/// Registers every netboot client the DHCP server sees that pxed does not know yet as
/// a `discovered` node, with the architecture its option 93 implies. Batched: a burst
/// of new machines is one transaction, so discovery never holds up lease commits.
async fn discovery(st: Arc<AppState>, mut rx: tokio::sync::mpsc::Receiver<crate::dhcp::DhcpSeen>) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, 256).await > 0 {
        let mut new: Vec<(String, Option<String>)> = Vec::new();
        {
            let known = st.known_macs.lock().expect("lock");
            for seen in batch.drain(..) {
                let Some(mac) = crate::config::normalize_mac(&seen.mac) else {
                    continue;
                };
                if !known.contains(&mac) && !new.iter().any(|(m, _)| *m == mac) {
                    let arch = seen.arch.and_then(crate::boot::arch_name).map(String::from);
                    new.push((mac, arch));
                }
            }
        }
        if new.is_empty() {
            continue;
        }
        match st.store.discover_many(&new).await {
            Ok(created) => {
                st.registered(&created);
                st.known_macs
                    .lock()
                    .expect("lock")
                    .extend(new.into_iter().map(|(m, _)| m));
            }
            Err(e) => tracing::warn!(error = %e, n = new.len(), "registering discovered machines"),
        }
    }
}

/// How long in-flight work may take to drain after cancellation.
pub const DRAIN: Duration = Duration::from_millis(1500);

/// Runs pxed until `cancel` fires.
pub async fn run(cfg: Config, cancel: CancellationToken) -> anyhow::Result<()> {
    let cfg = Arc::new(cfg);
    preflight(&cfg)?;
    let store = Store::open(&cfg.data_dir)
        .await
        .with_context(|| format!("opening the store in {}", cfg.data_dir.display()))?;
    let token = api_token(&cfg)?;
    let state = AppState::new(
        cfg.clone(),
        store.clone(),
        Arc::new(StoreBmcs {
            policy: cfg.bmc.call_policy(),
        }),
        token,
        cancel.child_token(),
    );
    let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();

    let http = crate::net::bind_tcp(cfg.http).context("HTTP")?;
    tracing::info!(addr = %http.local_addr()?, "HTTP listening");
    {
        let (st, c) = (state.clone(), cancel.clone());
        tasks.spawn(async move { Ok(crate::http::serve(http, st, c).await?) });
    }

    let tftp = crate::net::bind_udp(cfg.tftp, None, false).context("TFTP")?;
    {
        let (root, settings, c) = (
            cfg.ipxe_dir.clone(),
            cfg.tftp_server.clone(),
            cancel.clone(),
        );
        let stats = Arc::new(crate::tftp::TftpStats::default());
        state.renders.lock().expect("lock").push(stats.clone());
        tasks.spawn(async move { Ok(crate::tftp::serve(tftp, root, settings, stats, c).await?) });
    }

    if cfg.dhcp.mode != crate::config::DhcpMode::Off {
        let sockets = crate::dhcp::bind(&cfg)?;
        let (seen, rx) = tokio::sync::mpsc::channel(1024);
        let stats = Arc::new(crate::dhcp::DhcpStats::default());
        state.renders.lock().expect("lock").push(stats.clone());
        let ctx = crate::dhcp::DhcpContext::new(&cfg, store.clone(), seen, stats);
        let c = cancel.clone();
        tasks.spawn(async move { Ok(crate::dhcp::serve(sockets, ctx, c).await?) });
        let st = state.clone();
        tokio::spawn(discovery(st, rx));
    }

    let resumed = state.lifecycle.resume().await?;
    if resumed > 0 {
        tracing::info!(nodes = resumed, "resumed in-progress nodes from the store");
    }

    let result = tokio::select! {
        // Servers return Ok as soon as they see the cancel; without `biased` a
        // clean SIGTERM could be reported as "a server stopped unexpectedly".
        biased;
        // CANCEL-SAFETY: only waits; nothing is lost when the other branch wins.
        _ = cancel.cancelled() => Ok(()),
        // CANCEL-SAFETY: join_next is cancel-safe.
        Some(r) = tasks.join_next() => {
            let shutting_down = cancel.is_cancelled();
            cancel.cancel();
            match r {
                Ok(Ok(())) if shutting_down => Ok(()),
                Ok(Ok(())) => Err(anyhow::anyhow!("a server stopped unexpectedly")),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(anyhow::anyhow!("a server panicked: {e}")),
            }
        }
    };
    let drained = tokio::time::timeout(DRAIN, async {
        while let Some(r) = tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "server ended with an error during shutdown");
            }
        }
        state.lifecycle.drain().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!("drain deadline passed; aborting remaining tasks");
        tasks.abort_all();
    }
    store.close().await;
    tracing::info!("stopped");
    result
}
