//! Provisioning: what a node is told to boot, the install configs it reads and the
//! deploy plan its deploy agent follows.
//!
//! The boot decision is committed before it is served: for a node in a reinstall,
//! `installer_served` is applied first and the installer goes out only if that
//! transition accepted it, so a node quarantined, failed or superseded between the
//! read and the answer gets local boot, never an installer whose token was revoked.

use std::net::IpAddr;

use crate::credential;
use crate::images::{Arch, Family, ImageError, StoredImage};
use crate::install::{InstallContext, InstallError};
use crate::lifecycle::apply::{ApplyError, Hooks};
use crate::lifecycle::transition::{Event, State, TransitionError};
use crate::model::{Mac, NodeArch};
use crate::script::{Action, ArchBoot};
use crate::state::AppState;
use crate::store::StoreError;
use crate::store::nodes::NodeRow;
use crate::wire::{DeployPlan, DiskImageRef, PlanFile, WipePolicy};

/// Why a config or plan cannot be produced.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    #[error("node {0} has no image")]
    NoImage(i64),
    #[error("node {0} has no agent token (its reinstall predates them: request a new one)")]
    NoAgentToken(i64),
    #[error("image {0} is not imported")]
    NotImported(String),
    #[error("image {image} has no media for architecture {arch}")]
    NoArch { image: String, arch: NodeArch },
    #[error("image {0} has media for no architecture")]
    NoMedia(String),
    #[error("config {file} does not exist for a {family} image")]
    NoSuchConfig { file: String, family: &'static str },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Install(#[from] InstallError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ProvisionError {
    /// Whether the request named something that is not there (404), rather than pxed
    /// failing to produce it (500).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            ProvisionError::NoImage(_)
                | ProvisionError::NotImported(_)
                | ProvisionError::NoArch { .. }
                | ProvisionError::NoMedia(_)
                | ProvisionError::NoSuchConfig { .. }
        )
    }
}

/// The node's image, as imported.
async fn node_image<'n>(
    st: &AppState,
    node: &'n NodeRow,
) -> Result<(&'n str, StoredImage), ProvisionError> {
    let name = node
        .image
        .as_deref()
        .ok_or(ProvisionError::NoImage(node.id))?;
    let row = st
        .store
        .image(name)
        .await?
        .ok_or_else(|| ProvisionError::NotImported(name.to_string()))?;
    Ok((name, StoredImage::decode(name, &row.definition)?))
}

fn mirror(st: &AppState, base: &str) -> String {
    st.cfg
        .mirror_base
        .clone()
        .unwrap_or_else(|| format!("{base}/images/"))
}

/// What `/boot/{mac}.ipxe` tells this node to do, and why. Serving the installer
/// to a `netbooting` node moves it to `installing`; once the installer called back,
/// the node gets local boot, so firmware that keeps PXE first never loops.
pub async fn boot_action(
    st: &AppState,
    mac: Mac,
    base: &str,
    client: Option<IpAddr>,
) -> (Action, String) {
    st.stats.scripts.inc();
    match st.store.node_by_mac(mac).await {
        Ok(Some(n)) => boot_action_for(st, n, base, client).await,
        Ok(None) => {
            st.stats.unknown_scripts.inc();
            (
                Action::Discovery,
                "unknown machine (pxed registers machines it sees netboot over DHCP)".into(),
            )
        }
        Err(e) => {
            tracing::error!(%mac, error = %e, "loading node for boot script");
            (
                Action::LocalBoot,
                "store unavailable: booting local disk".into(),
            )
        }
    }
}

/// [`boot_action`] for a node row read a moment ago (it may be stale by now), asked
/// by `client` (`None`: unknown, and then no installer is served).
pub async fn boot_action_for(
    st: &AppState,
    node: NodeRow,
    base: &str,
    client: Option<IpAddr>,
) -> (Action, String) {
    if node.state == State::Discovered {
        return (
            Action::Discovery,
            format!("node {} was discovered and is not enrolled", node.id),
        );
    }
    // A `reclaiming` node may be past its reset already (see `transition`: the
    // transition decides, from the node as committed).
    let (true, Some(token)) = (
        node.state.serves_installer() || node.state == State::Reclaiming,
        node.boot_token.as_ref().map(|t| t.as_str()),
    ) else {
        return (
            Action::LocalBoot,
            format!("node {} is {}", node.id, node.state),
        );
    };
    // The boot token goes out only to an address it can be bound to.
    let bound = match st.whereabouts(&node).await {
        Ok(w) => match credential::bind(&w, client) {
            Ok(ip) => ip,
            Err(why) => {
                st.stats.installers_wrong_address.inc();
                tracing::warn!(node = node.id, client = ?client, reason = %why, "installer not served");
                st.audit_refusal(&node, "installer_refused", &why.to_string())
                    .await;
                return (Action::LocalBoot, format!("installer not served: {why}"));
            }
        },
        Err(e) => {
            tracing::error!(node = node.id, error = %e, "loading where the node may be");
            return (
                Action::LocalBoot,
                "store unavailable: booting local disk".into(),
            );
        }
    };
    let action = match install_action(st, &node, base, token).await {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(node = node.id, error = %e, "cannot build the install script");
            return (Action::LocalBoot, format!("install media unavailable: {e}"));
        }
    };
    // Commit first, serve second: the transition reads the node as it is now.
    let ev = Event::InstallerServed {
        generation: node.generation,
    };
    let hooks = Hooks {
        boot_ip: Some(bound),
        ..Hooks::default()
    };
    let mut result = st.lifecycle.apply_with(node.id, &ev, "script", hooks).await;
    if node.state == State::Reclaiming
        && matches!(
            result,
            Err(ApplyError::Transition(TransitionError::NotAllowed { .. }))
        )
        && netboot_seen_by_script(st, &node).await
    {
        result = st.lifecycle.apply_with(node.id, &ev, "script", hooks).await;
    }
    match result {
        Ok(applied)
            if applied.node.state == State::Installing
                && applied.node.generation == node.generation =>
        {
            // Bound to this client now or by an earlier fetch from the same address; a
            // concurrent fetch from elsewhere that won the binding leaves this one out.
            if applied.node.boot_ip.as_deref() != Some(bound.to_string().as_str()) {
                st.stats.installers_wrong_address.inc();
                return (
                    Action::LocalBoot,
                    format!(
                        "installer not served: this install was served to {} meanwhile",
                        applied.node.boot_ip.as_deref().unwrap_or("no address")
                    ),
                );
            }
            st.stats.installers_served.inc();
            (
                action,
                format!(
                    "reinstall generation {} of node {}",
                    node.generation, node.id
                ),
            )
        }
        Ok(applied) => {
            st.stats.installers_refused.inc();
            (
                Action::LocalBoot,
                format!("node {} is {}", node.id, applied.node.state),
            )
        }
        Err(ApplyError::Transition(TransitionError::NotAllowed { .. }))
            if node.state == State::Reclaiming =>
        {
            // Its reset was not sent yet, or no DHCP since: the machine's earlier boot.
            st.stats.installers_refused.inc();
            (
                Action::LocalBoot,
                format!("node {} is {}", node.id, node.state),
            )
        }
        Err(e) => {
            st.stats.installers_refused.inc();
            tracing::warn!(node = node.id, error = %e, "installer not served");
            (
                Action::LocalBoot,
                format!("node {}: installer not served: {e}", node.id),
            )
        }
    }
}

/// A `reclaiming` node's iPXE asking for its script once the power cycle of this
/// attempt was sent is the netboot pxed waits for, as its DHCP would be: applies
/// `NetbootObserved` and tells whether it holds. DHCP sightings reach the lifecycle in
/// batches, and in the 1,000-node storm 9 machines were in iPXE asking for their
/// script before their DHCP had been applied; they were sent to their old disk and
/// their reinstalls left to a deadline.
async fn netboot_seen_by_script(st: &AppState, node: &NodeRow) -> bool {
    let sent = match st.store.bmc_intent(node.id).await {
        Ok(i) => i.is_some_and(|i| i.is_cycle_of(node.generation, node.attempt)),
        Err(e) => {
            tracing::warn!(node = node.id, error = %e, "reading the node's power cycle");
            false
        }
    };
    if !sent {
        return false;
    }
    let ev = Event::NetbootObserved {
        generation: node.generation,
        after_reset: true,
    };
    match st.lifecycle.apply(node.id, &ev, "script").await {
        Ok(_) => true,
        Err(e) => {
            tracing::debug!(node = node.id, error = %e, "netboot seen by the script, not applied");
            false
        }
    }
}

async fn install_action(
    st: &AppState,
    node: &NodeRow,
    base: &str,
    token: &str,
) -> Result<Action, ProvisionError> {
    let (name, img) = node_image(st, node).await?;
    let hostname = node.hostname.clone().unwrap_or_default();
    let mirror = mirror(st, base);
    let config_base = format!("{base}/cfg/{token}");
    let syslog = syslog_target(st, base);
    let mut arches = Vec::new();
    for arch in Arch::ALL {
        if !img.imported.arches.contains_key(&arch) {
            continue;
        }
        let cmdline = crate::images::kernel_cmdline(
            &img.def,
            arch,
            &mirror,
            &config_base,
            &hostname,
            syslog.as_deref(),
        )?;
        for &ipxe_arch in arch.ipxe_buildarches() {
            arches.push(ArchBoot {
                ipxe_arch,
                label: ipxe_arch,
                kernel_url: format!("{base}/images/{name}/{}/kernel", arch.as_str()),
                initrd_url: format!("{base}/images/{name}/{}/initrd", arch.as_str()),
                cmdline: cmdline.clone(),
            });
        }
    }
    if arches.is_empty() {
        return Err(ProvisionError::NoMedia(name.to_string()));
    }
    Ok(Action::Install(arches))
}

/// pxed's syslog receiver as the installer reaches it, `host:port`: the host of the
/// URLs the node is given (`base`, `http://host[:port]`) and the port the receiver
/// listens on. `None` when the receiver does not run.
fn syslog_target(st: &AppState, base: &str) -> Option<String> {
    let port = st.telemetry.listening()?.port();
    let rest = base.split_once("://").map_or(base, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = match authority.strip_prefix('[') {
        // An IPv6 literal: `[addr]:port`.
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    (!host.is_empty()).then(|| format!("{host}:{port}"))
}

/// The architecture to install on `node`: its own where the image has it, else the
/// image's first.
fn node_arch(node: &NodeRow, img: &StoredImage) -> Result<Arch, ProvisionError> {
    node.arch
        .known()
        .filter(|a| img.imported.arches.contains_key(a))
        .or_else(|| img.imported.arches.keys().next().copied())
        .ok_or_else(|| ProvisionError::NoArch {
            image: img.def.name.clone(),
            arch: node.arch,
        })
}

fn hostname_of(node: &NodeRow) -> String {
    node.hostname
        .clone()
        .unwrap_or_else(|| format!("node-{}", node.id))
}

/// The install context of `node` (hostname, URLs, keys) for `img`.
async fn context<'a>(
    st: &AppState,
    node: &NodeRow,
    img: &'a StoredImage,
    base: &str,
    token: &str,
) -> Result<InstallContext<'a>, ProvisionError> {
    let arch = node_arch(node, img)?;
    // A disk image has no install source; `mirror_base` may then be a plain directory
    // (it is where import read the image from), which an installer could not use.
    let mirror = match img.def.family {
        Family::Disk => format!("{base}/images/"),
        _ => mirror(st, base),
    };
    let agent_token = node
        .agent_token
        .as_ref()
        .ok_or(ProvisionError::NoAgentToken(node.id))?;
    let mut ctx = InstallContext::new(
        &img.def,
        arch,
        &mirror,
        base,
        token,
        agent_token.as_str(),
        &hostname_of(node),
    )?;
    ctx.ntp_servers = st.cfg.ntp_servers.clone();
    ctx.syslog = syslog_target(st, base);
    if let Some(p) = st.store.hardware(node.id).await?.profile
        && let Some(p) = st.cfg.profiles.iter().find(|x| x.name == p)
    {
        ctx.health_checks = p.health.clone();
    }
    let own = st.store.node_ssh_keys(node.id).await?;
    ctx.ssh_authorized_keys = authorized_keys(&st.cfg.ssh_authorized_keys, &img.def, &own);
    Ok(ctx)
}

/// The keys an installed system trusts: the config's (every node), then the image's
/// (its catalog entry), then the node's own, each once, in that order.
pub fn authorized_keys(
    config: &[String],
    image: &crate::images::ImageDef,
    node: &[String],
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for k in config.iter().chain(&image.ssh_authorized_keys).chain(node) {
        if !out.contains(k) {
            out.push(k.clone());
        }
    }
    out
}

/// Renders `/cfg/{token}/{file}` for a node.
pub async fn render_config(
    st: &AppState,
    node: &NodeRow,
    file: &str,
    base: &str,
    token: &str,
) -> Result<String, ProvisionError> {
    let (_, img) = node_image(st, node).await?;
    let ctx = context(st, node, &img, base, token).await?;
    let r = match (img.def.family, file) {
        (Family::Kickstart, "kickstart" | "ks.cfg") => crate::install::render_kickstart(&ctx),
        (Family::Autoinstall, "user-data") => crate::install::render_user_data(&ctx),
        (Family::Autoinstall, "meta-data") => crate::install::render_meta_data(&ctx),
        (Family::Autoinstall, "vendor-data") => Ok(String::new()),
        (Family::Preseed, "preseed" | "preseed.cfg") => crate::install::render_preseed(&ctx),
        (family, _) => {
            return Err(ProvisionError::NoSuchConfig {
                file: file.to_string(),
                family: family.as_str(),
            });
        }
    };
    Ok(r?)
}

/// The deploy agent's plan for `node` (a `disk` image), for `GET /cb/{token}/deploy`.
pub async fn deploy_plan(
    st: &AppState,
    node: &NodeRow,
    base: &str,
    token: &str,
) -> Result<DeployPlan, ProvisionError> {
    let (name, img) = node_image(st, node).await?;
    if img.def.family != Family::Disk {
        return Err(ProvisionError::NoSuchConfig {
            file: "deploy".into(),
            family: img.def.family.as_str(),
        });
    }
    let ctx = context(st, node, &img, base, token).await?;
    let arch = ctx.arch;
    let disk = img
        .imported
        .arches
        .get(&arch)
        .and_then(|a| a.disk.as_ref())
        .ok_or_else(|| ProvisionError::NoArch {
            image: name.to_string(),
            arch: arch.into(),
        })?;
    let agent = crate::install::firstboot_files(&ctx)?;
    st.stats.deploy_plans.inc();
    Ok(DeployPlan {
        node_id: node.id,
        generation: node.generation,
        hostname: ctx.hostname.clone(),
        arch,
        image: DiskImageRef {
            name: name.to_string(),
            url: format!("{base}/images/{name}/{arch}/disk.raw.zst"),
            compression: crate::wire::Compression::Zstd,
            size: disk.raw_size,
            sha256: disk.raw_sha256.clone(),
            root_partition: disk.root_partition,
        },
        wipe: WipePolicy::Signatures,
        target_disk: None,
        ssh_authorized_keys: ctx.ssh_authorized_keys.clone(),
        files: vec![
            PlanFile {
                path: crate::install::AGENT_SCRIPT_PATH.into(),
                // Root only: it holds the agent token.
                mode: 0o700,
                content: format!("{}\n", agent.script),
            },
            PlanFile {
                path: crate::install::AGENT_UNIT_PATH.into(),
                mode: 0o644,
                content: format!("{}\n", agent.unit),
            },
            PlanFile {
                path: crate::install::SSHD_POLICY_PATH.into(),
                mode: 0o600,
                content: crate::install::SSHD_POLICY.into(),
            },
        ],
        enable_units: vec!["pxed-firstboot.service".into()],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_then_image_then_node_keys_each_once() {
        let cat = crate::images::load_catalog(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("images"),
        )
        .unwrap();
        let mut img = cat.into_iter().find(|d| d.name == "rocky-9").unwrap();
        img.ssh_authorized_keys = vec!["ssh-ed25519 B image".into(), "ssh-ed25519 A ops".into()];
        let cfg = vec!["ssh-ed25519 A ops".to_string()];
        assert_eq!(
            authorized_keys(&cfg, &img, &[]),
            ["ssh-ed25519 A ops", "ssh-ed25519 B image"]
        );
        let own = vec!["ssh-ed25519 C node".to_string(), "ssh-ed25519 A ops".into()];
        assert_eq!(
            authorized_keys(&cfg, &img, &own),
            [
                "ssh-ed25519 A ops",
                "ssh-ed25519 B image",
                "ssh-ed25519 C node"
            ]
        );
        assert!(
            authorized_keys(
                &[],
                &crate::images::ImageDef {
                    ssh_authorized_keys: vec![],
                    ..img
                },
                &[]
            )
            .is_empty()
        );
    }
}
