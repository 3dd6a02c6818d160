//! Wire types shared by the server, the CLI and the agents: one definition of every
//! JSON body that crosses a process boundary.
//!
//! Agents authenticate with one of the node's per-generation tokens, which is part of
//! every URL below (`/cb/{token}/...`): the installer and the deploy agent with the
//! boot token, the installed system's first-boot agent with its agent token (see
//! [`crate::credential`] for which is accepted where, and from which address).
//!
//! | call | token | body |
//! |---|---|---|
//! | `GET /cb/{token}/deploy` | boot | answer: [`DeployPlan`] (disk images only) |
//! | `POST /cb/{token}/deploy/facts` | boot | [`AgentFacts`] |
//! | `POST /cb/{token}/deploy/progress` | boot | [`DeployProgress`] |
//! | `POST /cb/{token}/failure` | boot | [`FailedReport`] (deploy agent, installers) |
//! | `POST /cb/{token}/installed` | boot | [`InstalledReport`] |
//! | `POST /cb/{token}/first-boot` | agent | [`FirstBootReport`] |
//! | `POST /cb/{token}/health` | agent | [`HealthReport`] |

use serde::{Deserialize, Serialize};

use crate::model::{Arch, Driver, Mac, NodeArch, State, Step};

/// Sent by the installer or the deploy agent to `<callback_base>/installed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstalledReport {
    /// The hostname the config set.
    pub hostname: String,
    /// The architecture the config was rendered for.
    pub arch: Arch,
}

/// Hardware facts in a [`FirstBootReport`]; a probe that found nothing reports 0 or "".
/// Fields the server does not know are kept (`extra`), so a newer agent loses nothing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Facts {
    /// Online CPUs.
    #[serde(default)]
    pub cpus: u64,
    /// `MemTotal` from /proc/meminfo.
    #[serde(default)]
    pub mem_kb: u64,
    /// GPUs: `nvidia-smi -L` lines, else PCI class 0302 (3D controller) devices.
    #[serde(default)]
    pub gpus: u64,
    /// `uname -r`.
    #[serde(default)]
    pub kernel: String,
    /// /etc/machine-id.
    #[serde(default)]
    pub machine_id: String,
    /// Anything else the agent reported.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Sent by the first-boot agent to `<agent_base>/first-boot` (its agent token).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FirstBootReport {
    /// `uname -n` of the booted system.
    pub hostname: String,
    /// `uname -m` (`x86_64`, `aarch64`).
    #[serde(default)]
    pub arch: Option<String>,
    /// Hardware facts.
    #[serde(default)]
    pub facts: Facts,
    /// The hardware inventory as the installed system sees it (PCI functions with
    /// their links, NICs), for the acceptance gate; `None` from an older agent.
    #[serde(default)]
    pub inventory: Option<crate::inventory::Inventory>,
}

/// Outcome of the agent's health check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    /// Every check held.
    Pass,
    /// At least one check failed; `detail` says which.
    Fail,
}

/// Sent by the first-boot agent to `<agent_base>/health` (its agent token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthReport {
    /// Pass or fail.
    pub status: HealthStatus,
    /// `all checks passed`, or `check: reason` items joined by `; `.
    #[serde(default)]
    pub detail: String,
}

/// A step of an image deploy, as the deploy agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeployStage {
    /// Fetching the plan from pxed.
    Plan,
    /// Collecting and reporting hardware facts.
    Facts,
    /// Choosing the target disk.
    Disk,
    /// Wiping filesystem, RAID and LVM signatures.
    Wipe,
    /// Streaming the image to the disk.
    Write,
    /// Checking size and SHA-256 of what was written.
    Verify,
    /// Growing the root partition and filesystem to the disk.
    Grow,
    /// Writing hostname, SSH keys and the first-boot agent into the new root.
    Configure,
    /// Rebooting into the deployed system.
    Reboot,
}

impl DeployStage {
    /// The snake_case name used on the wire and on the status page.
    pub fn as_str(self) -> &'static str {
        match self {
            DeployStage::Plan => "plan",
            DeployStage::Facts => "facts",
            DeployStage::Disk => "disk",
            DeployStage::Wipe => "wipe",
            DeployStage::Write => "write",
            DeployStage::Verify => "verify",
            DeployStage::Grow => "grow",
            DeployStage::Configure => "configure",
            DeployStage::Reboot => "reboot",
        }
    }
}

impl std::fmt::Display for DeployStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the image file is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// A raw disk image.
    None,
    /// A zstd frame (or frames) around the raw disk image.
    Zstd,
}

/// What is wiped before the image is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WipePolicy {
    /// Filesystem, RAID and LVM signatures and partition tables on every disk, read
    /// back to verify none is left.
    Signatures,
}

/// The disk image a deploy writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskImageRef {
    /// Catalog name.
    pub name: String,
    /// Where to GET the (compressed) file; the server answers Range requests.
    pub url: String,
    /// How `url` is compressed.
    pub compression: Compression,
    /// Size in bytes of the raw (uncompressed) disk image.
    pub size: u64,
    /// SHA-256 (hex) of the raw (uncompressed) disk image.
    pub sha256: String,
    /// Partition number (1-based) of the root filesystem; it is grown to fill the disk.
    pub root_partition: u32,
}

/// A file the deploy agent writes into the deployed root filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanFile {
    /// Absolute path inside the deployed system.
    pub path: String,
    /// Unix permission bits.
    pub mode: u32,
    /// File content.
    pub content: String,
}

/// `GET /cb/{token}/deploy`: everything the deploy agent needs for one node and generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployPlan {
    /// The node being deployed.
    pub node_id: i64,
    /// The reinstall generation this plan belongs to.
    pub generation: i64,
    /// The hostname to write (`/etc/hostname`, `/etc/hosts`).
    pub hostname: String,
    /// The architecture pxed booted the ramdisk for.
    pub arch: Arch,
    /// What to write.
    pub image: DiskImageRef,
    /// What to wipe first.
    pub wipe: WipePolicy,
    /// The target disk (`/dev/vda`); `None`: the agent picks the first non-removable disk.
    pub target_disk: Option<String>,
    /// Lines for root's `~/.ssh/authorized_keys`.
    pub ssh_authorized_keys: Vec<String>,
    /// Files to write into the deployed system (the first-boot agent among them).
    pub files: Vec<PlanFile>,
    /// systemd units to enable (linked into `multi-user.target.wants`).
    pub enable_units: Vec<String>,
}

/// A disk the deploy agent saw.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskFact {
    /// Kernel name (`vda`, `nvme0n1`).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// `device/model`, where the kernel has one.
    #[serde(default)]
    pub model: String,
    /// `device/serial` or `serial`, where the kernel has one.
    #[serde(default)]
    pub serial: String,
    /// Removable media (never a deploy target).
    #[serde(default)]
    pub removable: bool,
}

/// A network interface the deploy agent saw.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicFact {
    /// Kernel name.
    pub name: String,
    /// MAC address.
    pub mac: String,
    /// Kernel driver.
    #[serde(default)]
    pub driver: String,
    /// Link up.
    #[serde(default)]
    pub carrier: bool,
}

/// `POST /cb/{token}/deploy/facts`: what the deploy ramdisk found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentFacts {
    /// Online CPUs.
    pub cpus: u64,
    /// `MemTotal` in kB.
    pub mem_kb: u64,
    /// `uname -m`.
    pub machine: String,
    /// `/sys/class/dmi/id/product_name`, where present.
    #[serde(default)]
    pub product: String,
    /// Block devices (no partitions, loops or ramdisks).
    pub disks: Vec<DiskFact>,
    /// Ethernet interfaces.
    pub nics: Vec<NicFact>,
    /// The whole hardware inventory (PCI functions and links, NUMA, firmware), for
    /// the acceptance gate. `None` from an agent older than issue 13.
    #[serde(default)]
    pub inventory: Option<crate::inventory::Inventory>,
    /// How long collecting `inventory` took, in milliseconds.
    #[serde(default)]
    pub inventory_ms: Option<u64>,
}

/// `POST /cb/{token}/deploy/progress`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployProgress {
    /// The stage now running or just finished.
    pub stage: DeployStage,
    /// What happened, for the node's timeline.
    pub message: String,
    /// Bytes written so far (write stage).
    #[serde(default)]
    pub bytes: Option<u64>,
}

/// `POST /cb/{token}/failure`: an install or deploy failed; the node fails at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedReport {
    /// Where it failed (a [`DeployStage`] name for the deploy agent).
    pub stage: String,
    /// The real reason, in the failing tool's own words where there are any.
    pub reason: String,
}

// ---- The operators' API (`/api/v1`): answered by the server, read by `pxed node ...`.

/// An API error body: a short machine-readable code and a human reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    /// `not_found`, `bad_request`, `conflict`, ...
    pub error: String,
    /// What went wrong, for a person.
    #[serde(default)]
    pub detail: String,
}

/// A node as the API shows it (no token, no BMC secret).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub id: i64,
    pub name: Option<String>,
    pub hostname: Option<String>,
    pub arch: NodeArch,
    pub state: State,
    pub since: String,
    pub generation: i64,
    pub attempt: i64,
    pub image: Option<String>,
    pub failed_step: Option<Step>,
    pub failed_reason: Option<String>,
    pub macs: Vec<Mac>,
    pub facts: Option<serde_json::Value>,
    /// The site whose instance last saw the node netboot (`site` in its config).
    #[serde(default)]
    pub site: Option<String>,
}

pub use crate::model::rows::{EventView, InstallLogLine};

/// `GET /api/v1/nodes/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeDetail {
    #[serde(flatten)]
    pub node: NodeView,
    pub boot_mac: Option<Mac>,
    pub bmc: Option<BmcView>,
    /// The node's own SSH authorized keys (public; the config's and the image's are
    /// added at install).
    #[serde(default)]
    pub ssh_authorized_keys: Vec<String>,
    pub events: Vec<EventView>,
    /// Where the current generation's reinstall is (stages from the wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<StageNow>,
}

// ---- Stages from the wire (issue 12): `GET /api/v1/nodes/{id}/stages`, `GET /api/v1/report`.

/// The stage a node is in now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageNow {
    pub stage: crate::model::Stage,
    /// When it was reached (RFC 3339).
    pub since: String,
    /// How long it may last (`None`: a final stage).
    pub expected_ms: Option<u64>,
    /// In a reinstall and past the expected duration.
    pub stuck: bool,
}

/// One stage a node generation reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageView {
    pub stage: crate::model::Stage,
    /// When pxed first saw it (RFC 3339).
    pub at: String,
    /// Bytes of a served file.
    pub bytes: Option<u64>,
    /// Transfer time of a served file.
    pub took_ms: Option<u64>,
    /// What was served, which action a script served, why the node failed.
    pub detail: Option<String>,
    /// Until the next stage (`None`: the current one).
    pub lasted_ms: Option<u64>,
    pub expected_ms: Option<u64>,
}

/// A stage's duration in an earlier generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageDuration {
    pub stage: crate::model::Stage,
    pub ms: u64,
}

/// An earlier generation: how long each stage lasted, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationStages {
    pub generation: i64,
    pub durations: Vec<StageDuration>,
    /// `reinstall` to `available` or `failed`.
    pub total_ms: Option<u64>,
    /// `available`, `failed`, or the last stage reached.
    pub last: Option<crate::model::Stage>,
}

/// `GET /api/v1/nodes/{id}/stages`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagesView {
    pub node_id: i64,
    pub generation: i64,
    pub state: State,
    pub current: Option<StageNow>,
    /// The current generation's stages, in order.
    pub stages: Vec<StageView>,
    /// Earlier generations kept, newest first.
    pub previous: Vec<GenerationStages>,
}

/// Failures of one stage for one kind of reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureCount {
    /// The stage the node was in (a `Stage` name, else its lifecycle state).
    pub stage: String,
    /// `timeout`, `bmc`, `installer`, `health`, `operator` or `other`.
    pub reason: String,
    pub count: u64,
    /// A few of the reasons in words, most recent first.
    pub examples: Vec<String>,
}

/// A node left over: failed, or stuck past its stage's expected duration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leftover {
    pub node_id: i64,
    pub name: Option<String>,
    pub state: State,
    pub stage: Option<crate::model::Stage>,
    pub since: String,
    pub stuck: bool,
    pub reason: Option<String>,
}

/// `GET /api/v1/report?since=7d`: reinstalls requested over a period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub since: String,
    pub until: String,
    pub reinstalls: u64,
    pub succeeded: u64,
    pub failed: u64,
    /// Neither yet (or superseded by a later reinstall).
    pub unfinished: u64,
    /// Request to `available`, of the successful ones.
    pub p50_ms: Option<u64>,
    pub p95_ms: Option<u64>,
    pub failures: Vec<FailureCount>,
    pub leftovers: Vec<Leftover>,
}

/// A BMC endpoint without its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcView {
    pub driver: Driver,
    pub address: String,
    pub username: String,
    pub system_id: Option<String>,
    pub tls_pin: Option<String>,
    pub tls_insecure: bool,
}

/// `POST /api/v1/nodes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateNode {
    pub name: Option<String>,
    #[serde(default)]
    pub arch: Option<NodeArch>,
    pub macs: Vec<Mac>,
    #[serde(default)]
    pub boot_mac: Option<Mac>,
    /// `available` (default) or `discovered`.
    #[serde(default)]
    pub state: Option<State>,
    #[serde(default)]
    pub bmc: Option<CreateBmc>,
    /// Labels the board filters on (`{"rack": "r12"}`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// OpenSSH public keys for root on this node's installed systems (added to the
    /// config's and the image's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_authorized_keys: Vec<String>,
}

/// `PUT /api/v1/nodes/{id}/ssh-keys`: the node's own keys, replacing the old ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshKeys {
    pub ssh_authorized_keys: Vec<String>,
}

/// A BMC in a registration request. Its `Debug` masks the password.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBmc {
    pub driver: Driver,
    pub address: String,
    pub username: String,
    pub password: String,
    #[serde(default)]
    pub system_id: Option<String>,
    #[serde(default)]
    pub tls_insecure: bool,
}

impl std::fmt::Debug for CreateBmc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateBmc")
            .field("driver", &self.driver)
            .field("address", &self.address)
            .field("username", &self.username)
            .field("password", &"********")
            .finish()
    }
}

/// `POST /api/v1/nodes/{id}/reinstall` body (optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReinstallRequest {
    pub image: Option<String>,
}

/// The answer to a reinstall: the operation and the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Operation {
    pub node_id: i64,
    pub generation: i64,
    pub state: State,
    pub since: String,
    pub image: Option<String>,
    /// True when a reinstall was already running: this is that operation, not a new one.
    pub already_in_progress: bool,
}

/// `POST /api/v1/nodes/{id}/bmc/check`: the server connected to the node's BMC as its
/// worker would, and reports what the BMC offers and whether the credentials work.
/// It never carries the BMC password.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BmcCheck {
    /// The node whose BMC was checked.
    pub node_id: i64,
    /// The BMC as registered.
    pub bmc: BmcView,
    /// What the BMC answered.
    pub report: crate::bmc::CheckReport,
}

/// `GET /api/v1/nodes/{id}/log`: the last lines of one generation's install, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstallLog {
    pub node_id: i64,
    pub generation: i64,
    pub lines: Vec<InstallLogLine>,
}
