//! A machine's hardware inventory, as the deploy and first-boot agents (in band) and
//! the BMC (out of band) report it, and the difference between two of them.
//!
//! Pure data and pure functions: collection lives in the agents and the BMC drivers,
//! storage in the store, the decision to quarantine in the lifecycle. Devices are
//! keyed by what stays put across reinstalls (PCI address, MAC, disk serial), so a
//! diff names the device that went away or changed, not a position in a list.

pub mod gate;
pub mod lldp;
pub mod lspci;
pub mod nvidia;
pub mod profile;
pub mod redfish;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::model::Arch;

/// One machine's hardware, as far as the reporting side could see it. Every field
/// defaults to "not reported", so a partial report (an out-of-band one without PCI
/// links, an old agent) still parses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Inventory {
    pub arch: Option<Arch>,
    pub system: System,
    pub cpu: Cpu,
    /// NUMA nodes with memory or CPUs.
    pub numa_nodes: u32,
    pub memory_mib: u64,
    /// Every PCI function, keyed by address.
    pub pci: Vec<PciDevice>,
    /// GPUs and accelerators, with what the vendor tool adds where the driver runs.
    pub gpus: Vec<Gpu>,
    pub nics: Vec<Nic>,
    pub disks: Vec<Disk>,
    /// Firmware versions by component (`bios`, `bmc`, `gpu:<pci address>`,
    /// `nic:<mac>`, or the names the BMC's `FirmwareInventory` gives).
    pub firmware: BTreeMap<String, String>,
}

/// What the machine says it is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct System {
    pub vendor: String,
    pub model: String,
    pub serial: String,
}

/// Processors, summed over sockets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Cpu {
    pub model: String,
    pub sockets: u32,
    pub cores: u32,
    pub threads: u32,
}

/// A PCIe link: speed in GT/s and width in lanes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub speed_gts: f32,
    pub width: u32,
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} GT/s x{}", self.speed_gts, self.width)
    }
}

/// One PCI function.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PciDevice {
    /// `0000:4f:00.0`.
    pub address: String,
    /// Class, subclass and programming interface (`030200` for a 3D controller).
    #[serde(with = "hex")]
    pub class: u32,
    #[serde(with = "hex")]
    pub vendor_id: u16,
    #[serde(with = "hex")]
    pub device_id: u16,
    #[serde(with = "hex")]
    pub subsystem_vendor_id: u16,
    #[serde(with = "hex")]
    pub subsystem_device_id: u16,
    /// Names from the PCI ID database where the reporter had it.
    pub vendor: String,
    pub device: String,
    pub numa_node: Option<u32>,
    /// The link as trained now, and the most the device and slot can do.
    pub link: Option<Link>,
    pub max_link: Option<Link>,
    /// Revision ID (sysfs `revision`, lspci `Rev`), where the reporter read it.
    pub revision: Option<u8>,
}

impl PciDevice {
    /// `vendor device [vvvv:dddd]`: what rules match their globs against.
    pub fn identifier(&self) -> String {
        let ids = format!("[{:04x}:{:04x}]", self.vendor_id, self.device_id);
        [self.vendor.as_str(), self.device.as_str(), &ids]
            .iter()
            .filter(|p| !p.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Display (0x03xx) and processing accelerators (0x12xx): GPUs, NPUs.
    pub fn is_accelerator(&self) -> bool {
        matches!(self.class >> 16, 0x03 | 0x12)
    }
}

/// PCI IDs as lspci writes them (`10de`, class `030200`); numbers are read too.
mod hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub trait Id: Copy + Into<u64> + TryFrom<u64> {
        const DIGITS: usize;
    }
    impl Id for u16 {
        const DIGITS: usize = 4;
    }
    impl Id for u32 {
        const DIGITS: usize = 6;
    }

    pub fn serialize<T: Id, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        let n: u64 = (*v).into();
        s.collect_str(&format_args!("{n:0w$x}", w = T::DIGITS))
    }

    pub fn deserialize<'de, T: Id, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        let n = match Raw::deserialize(d)? {
            Raw::N(n) => n,
            Raw::S(s) => u64::from_str_radix(s.trim_start_matches("0x"), 16)
                .map_err(|_| serde::de::Error::custom(format!("{s:?} is not a hex PCI id")))?,
        };
        T::try_from(n).map_err(|_| serde::de::Error::custom(format!("PCI id {n:x} too large")))
    }
}

/// A GPU or accelerator.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Gpu {
    pub pci_address: String,
    /// `NVIDIA H100 80GB HBM3`, or the PCI device name without a vendor tool.
    pub model: String,
    pub uuid: String,
    pub vbios: String,
    /// Active NVLinks, where the tool reports them: the widest bonded set to any peer
    /// in `nvidia-smi topo -m` (`NV18` on an HGX H100, whose NVSwitches give every peer
    /// the GPU's full width; on a point-to-point mesh such as a DGX-1 the per-peer
    /// counts are in `nvlink_peers`).
    pub nvlinks: Option<u32>,
    pub numa_node: Option<u32>,
    /// Board serial from `nvidia-smi` (empty where it says `N/A`).
    pub serial: String,
    /// Driver version that reported this GPU.
    pub driver: String,
    /// NVLinks to each peer GPU, by the peer's PCI address.
    pub nvlink_peers: BTreeMap<String, u32>,
    /// How this GPU reaches each NIC, by RDMA device name as `topo -m` names it
    /// (`mlx5_0`): `PIX` (one PCIe bridge), `PXB`, `PHB`, `NODE` (same NUMA node) or
    /// `SYS` (across sockets).
    pub nic_affinity: BTreeMap<String, String>,
}

/// A network port.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Nic {
    pub name: String,
    pub mac: String,
    pub driver: String,
    pub firmware: String,
    pub speed_mbps: Option<u64>,
    pub link_up: bool,
    pub pci_address: String,
    pub numa_node: Option<u32>,
    /// The switch port at the other end, when an LLDP frame arrived while the agent
    /// listened (a short window: most switches send every 30 s).
    #[serde(default)]
    pub lldp: Option<lldp::Neighbor>,
}

/// A disk or NVMe namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Disk {
    pub name: String,
    pub model: String,
    pub serial: String,
    pub size_bytes: u64,
}

/// One difference between two inventories, in words an operator can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// What it is about: `pci 0000:4f:00.0 (NVIDIA H100 [10de:2330])`, `memory`.
    pub what: String,
    /// `removed`, `added` or `changed`.
    pub kind: ChangeKind,
    /// Before and after, for `changed` (and the one side for added/removed).
    pub before: String,
    pub after: String,
    /// The machine lost something: a device went away, a link, a speed, a size or a
    /// count went down, a device changed identity. What gates a reinstall; an added
    /// device, a new firmware version or a swapped GPU serial is reported, not gated.
    #[serde(default)]
    pub degraded: bool,
}

/// Kinds of [`Change`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Removed,
    Added,
    Changed,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ChangeKind::Removed => write!(f, "{} removed (was {})", self.what, self.before),
            ChangeKind::Added => write!(f, "{} added ({})", self.what, self.after),
            ChangeKind::Changed => {
                write!(
                    f,
                    "{} changed: {} -> {}",
                    self.what, self.before, self.after
                )
            }
        }
    }
}

/// Adds a `changed` entry when `before != after`.
fn field(out: &mut Vec<Change>, what: String, before: String, after: String) {
    worse(out, what, before, after, false);
}

/// [`field`] for a change that is a loss when `degraded`.
fn worse(out: &mut Vec<Change>, what: String, before: String, after: String, degraded: bool) {
    if before != after {
        out.push(Change {
            what,
            kind: ChangeKind::Changed,
            before,
            after,
            degraded,
        });
    }
}

/// Pairs items of two lists by key: removed, added, and both.
fn keyed<'a, T>(
    out: &mut Vec<Change>,
    label: &str,
    old: &'a [T],
    new: &'a [T],
    key: impl Fn(&T) -> String,
    show: impl Fn(&T) -> String,
    mut both: impl FnMut(&mut Vec<Change>, String, &'a T, &'a T),
) {
    let old_by: BTreeMap<String, &T> = old.iter().map(|x| (key(x), x)).collect();
    let new_by: BTreeMap<String, &T> = new.iter().map(|x| (key(x), x)).collect();
    for (k, o) in &old_by {
        let what = format!("{label} {k}");
        match new_by.get(k) {
            None => out.push(Change {
                what,
                kind: ChangeKind::Removed,
                before: show(o),
                after: String::new(),
                degraded: true,
            }),
            Some(n) => both(out, what, o, n),
        }
    }
    for (k, n) in &new_by {
        if !old_by.contains_key(k) {
            out.push(Change {
                what: format!("{label} {k}"),
                kind: ChangeKind::Added,
                before: String::new(),
                after: show(n),
                degraded: false,
            });
        }
    }
}

fn dash<T: fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".into(), T::to_string)
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

/// Lines summarising an inventory, for `pxed node inventory` and the node page.
pub fn summary(inv: &Inventory) -> Vec<String> {
    let mut out = vec![format!(
        "system: {} {} serial {}",
        inv.system.vendor, inv.system.model, inv.system.serial
    )];
    // A BMC's inventory may leave out what only the OS sees (sushy's fake systems
    // report no processors): say "not reported" rather than "0 cores".
    let c = &inv.cpu;
    out.push(
        if c.sockets == 0 && c.cores == 0 && c.threads == 0 && c.model.is_empty() {
            format!(
                "cpu: not reported, {} NUMA nodes, {} MiB",
                inv.numa_nodes, inv.memory_mib
            )
        } else {
            format!(
                "cpu: {} ({} sockets, {} cores, {} threads), {} NUMA nodes, {} MiB",
                or_dash(&c.model),
                c.sockets,
                c.cores,
                c.threads,
                inv.numa_nodes,
                inv.memory_mib
            )
        },
    );
    for d in inv.pci.iter().filter(|d| d.is_accelerator()) {
        out.push(format!(
            "accelerator {} {} numa {} link {} (max {})",
            d.address,
            d.identifier(),
            dash(&d.numa_node),
            dash(&d.link),
            dash(&d.max_link)
        ));
    }
    for g in &inv.gpus {
        out.push(format!(
            "gpu {} {} uuid {} vbios {} nvlinks {}",
            g.pci_address,
            g.model,
            g.uuid,
            g.vbios,
            dash(&g.nvlinks)
        ));
    }
    for n in &inv.nics {
        out.push(format!(
            "nic {} {} {} firmware {} {} Mb/s link {} numa {}{}",
            n.name,
            n.mac,
            or_dash(&n.driver),
            or_dash(&n.firmware),
            dash(&n.speed_mbps),
            if n.link_up { "up" } else { "down" },
            dash(&n.numa_node),
            n.lldp.as_ref().map_or_else(String::new, |l| format!(
                "; switch {} port {}",
                l.system_name.as_deref().unwrap_or(&l.chassis_id),
                l.port_id
            ))
        ));
    }
    for d in &inv.disks {
        out.push(format!(
            "disk {} {} serial {} {} bytes",
            d.name, d.model, d.serial, d.size_bytes
        ));
    }
    for (k, v) in &inv.firmware {
        out.push(format!("firmware {k} {v}"));
    }
    out.push(format!("{} PCI functions", inv.pci.len()));
    out
}

/// `in_band` (what the machine's OS saw) completed with what only the BMC reported:
/// system identity the OS left empty, and firmware components the OS cannot read
/// (BMC, NIC, GPU firmware as `UpdateService` lists them). The OS's own values win.
pub fn merge_out_of_band(in_band: &Inventory, oob: &Inventory) -> Inventory {
    let mut m = in_band.clone();
    let fill = |a: &mut String, b: &String| {
        if a.is_empty() {
            a.clone_from(b);
        }
    };
    fill(&mut m.system.vendor, &oob.system.vendor);
    fill(&mut m.system.model, &oob.system.model);
    fill(&mut m.system.serial, &oob.system.serial);
    if m.arch.is_none() {
        m.arch = oob.arch;
    }
    for (k, v) in &oob.firmware {
        m.firmware.entry(k.clone()).or_insert_with(|| v.clone());
    }
    m
}

/// What changed from `old` (the baseline) to `new`: devices by their stable keys,
/// PCIe links, firmware versions, sizes. Fields a side did not report (empty, `None`,
/// 0) are not compared, so an out-of-band baseline and an in-band report compare on
/// what both saw.
pub fn diff(old: &Inventory, new: &Inventory) -> Vec<Change> {
    let mut out = Vec::new();
    let known = |a: u64, b: u64| a != 0 && b != 0;
    if known(old.memory_mib, new.memory_mib) {
        worse(
            &mut out,
            "memory".into(),
            format!("{} MiB", old.memory_mib),
            format!("{} MiB", new.memory_mib),
            // MemTotal moves by a few MiB between kernels and boots (reservations):
            // a loss is more than 2%, a DIMM's worth on any real machine.
            new.memory_mib < old.memory_mib - old.memory_mib / 50,
        );
    }
    if known(old.cpu.cores.into(), new.cpu.cores.into()) {
        worse(
            &mut out,
            "cpu cores".into(),
            old.cpu.cores.to_string(),
            new.cpu.cores.to_string(),
            new.cpu.cores < old.cpu.cores,
        );
    }
    if known(old.numa_nodes.into(), new.numa_nodes.into()) {
        worse(
            &mut out,
            "numa nodes".into(),
            old.numa_nodes.to_string(),
            new.numa_nodes.to_string(),
            new.numa_nodes < old.numa_nodes,
        );
    }
    if !old.pci.is_empty() && !new.pci.is_empty() {
        keyed(
            &mut out,
            "pci",
            &old.pci,
            &new.pci,
            |d| d.address.clone(),
            PciDevice::identifier,
            |out, what, o, n| {
                let what = format!("{what} ({})", n.identifier());
                if (o.vendor_id, o.device_id) != (n.vendor_id, n.device_id) {
                    worse(
                        out,
                        format!("{what} id"),
                        o.identifier(),
                        n.identifier(),
                        true,
                    );
                }
                // Fewer lanes is a loss (a bad riser, a card half out of its slot). A
                // lower current speed is only reported: GPUs and NICs lower their link
                // speed when idle (ASPM), so it differs from boot to boot on healthy
                // machines. A lower maximum (the device's own capability) is a
                // different card.
                if let (Some(ol), Some(nl)) = (o.link, n.link) {
                    worse(
                        out,
                        format!("{what} link"),
                        ol.to_string(),
                        nl.to_string(),
                        nl.width < ol.width,
                    );
                }
                if let (Some(ol), Some(nl)) = (o.max_link, n.max_link) {
                    let lower = nl.width < ol.width || nl.speed_gts < ol.speed_gts;
                    worse(
                        out,
                        format!("{what} max link"),
                        ol.to_string(),
                        nl.to_string(),
                        lower,
                    );
                }
            },
        );
    }
    if !old.gpus.is_empty() || !new.gpus.is_empty() {
        keyed(
            &mut out,
            "gpu",
            &old.gpus,
            &new.gpus,
            |g| g.pci_address.clone(),
            |g| g.model.clone(),
            |out, what, o, n| {
                let what = format!("{what} ({})", n.model);
                if !o.uuid.is_empty() && !n.uuid.is_empty() {
                    field(out, format!("{what} uuid"), o.uuid.clone(), n.uuid.clone());
                }
                if let (Some(ol), Some(nl)) = (o.nvlinks, n.nvlinks) {
                    worse(
                        out,
                        format!("{what} nvlinks"),
                        ol.to_string(),
                        nl.to_string(),
                        nl < ol,
                    );
                }
            },
        );
    }
    if !old.nics.is_empty() && !new.nics.is_empty() {
        keyed(
            &mut out,
            "nic",
            &old.nics,
            &new.nics,
            |n| n.mac.clone(),
            |n| format!("{} {}", n.name, n.driver),
            |out, what, o, n| {
                if let (Some(os), Some(ns)) = (o.speed_mbps, n.speed_mbps) {
                    worse(
                        out,
                        format!("{what} speed"),
                        format!("{os} Mb/s"),
                        format!("{ns} Mb/s"),
                        ns < os,
                    );
                }
            },
        );
    }
    if !old.disks.is_empty() && !new.disks.is_empty() {
        keyed(
            &mut out,
            "disk",
            &old.disks,
            &new.disks,
            |d| {
                if d.serial.is_empty() {
                    d.name.clone()
                } else {
                    d.serial.clone()
                }
            },
            |d| format!("{} {} bytes", d.model, d.size_bytes),
            |out, what, o, n| {
                worse(
                    out,
                    format!("{what} size"),
                    o.size_bytes.to_string(),
                    n.size_bytes.to_string(),
                    true,
                );
            },
        );
    }
    for (k, v) in &old.firmware {
        if let Some(n) = new.firmware.get(k) {
            field(&mut out, format!("firmware {k}"), v.clone(), n.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a BMC left out reads as not reported, not as zero or blank.
    #[test]
    fn summary_says_what_was_not_reported() {
        let inv = Inventory {
            memory_mib: 32768,
            nics: vec![Nic {
                name: "eth0".into(),
                mac: "52:54:00:12:34:56".into(),
                ..Nic::default()
            }],
            ..Inventory::default()
        };
        let lines = summary(&inv);
        assert_eq!(lines[1], "cpu: not reported, 0 NUMA nodes, 32768 MiB");
        assert_eq!(
            lines[2],
            "nic eth0 52:54:00:12:34:56 - firmware - - Mb/s link down numa -"
        );
        let inv = Inventory {
            cpu: Cpu {
                cores: 72,
                ..Cpu::default()
            },
            ..inv
        };
        assert!(summary(&inv)[1].starts_with("cpu: - (0 sockets, 72 cores"));
    }

    /// A capture under `tests/fixtures/{dir}/`, without the leading `#` lines that
    /// name its source.
    pub(crate) fn fixture(dir: &str, name: &str) -> String {
        let path = format!("{}/tests/fixtures/{dir}/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        text.lines()
            .skip_while(|l| l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub(crate) fn h100(address: &str, width: u32) -> PciDevice {
        PciDevice {
            address: address.into(),
            class: 0x030200,
            vendor_id: 0x10de,
            device_id: 0x2330,
            vendor: "NVIDIA Corporation".into(),
            device: "GH100 [H100 SXM5 80GB]".into(),
            numa_node: Some(0),
            link: Some(Link {
                speed_gts: 32.0,
                width,
            }),
            max_link: Some(Link {
                speed_gts: 32.0,
                width: 16,
            }),
            ..PciDevice::default()
        }
    }

    #[test]
    fn a_diff_names_the_device_that_went_and_the_link_that_narrowed() {
        let old = Inventory {
            memory_mib: 2_097_152,
            pci: vec![h100("0000:18:00.0", 16), h100("0000:2a:00.0", 16)],
            firmware: BTreeMap::from([("bios".into(), "1.4.2".into())]),
            ..Inventory::default()
        };
        let mut new = old.clone();
        assert!(diff(&old, &new).is_empty());
        new.pci.remove(0);
        new.pci[0].link = Some(Link {
            speed_gts: 32.0,
            width: 4,
        });
        new.firmware.insert("bios".into(), "1.5.0".into());
        let d: Vec<String> = diff(&old, &new).iter().map(ToString::to_string).collect();
        assert_eq!(
            d,
            [
                "pci 0000:18:00.0 removed (was NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330])",
                "pci 0000:2a:00.0 (NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330]) link changed: 32 GT/s x16 -> 32 GT/s x4",
                "firmware bios changed: 1.4.2 -> 1.5.0",
            ]
        );
        // The removal and the narrower link are losses; a firmware update is not.
        let losses: Vec<bool> = diff(&old, &new).iter().map(|c| c.degraded).collect();
        assert_eq!(losses, [true, true, false]);
        // A wider link and an added device are not losses either.
        let (narrow, wide) = (new.clone(), old.clone());
        assert!(
            diff(&narrow, &wide).iter().all(|c| !c.degraded),
            "{:?}",
            diff(&narrow, &wide)
        );
    }

    #[test]
    fn pci_ids_read_and_write_as_lspci_does() {
        let d = h100("0000:18:00.0", 16);
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(
            (
                &v["class"],
                &v["vendor_id"],
                &v["device_id"],
                &v["subsystem_vendor_id"]
            ),
            (
                &"030200".into(),
                &"10de".into(),
                &"2330".into(),
                &"0000".into()
            )
        );
        assert_eq!(serde_json::from_value::<PciDevice>(v).unwrap(), d);
        let n: PciDevice =
            serde_json::from_str(r#"{"vendor_id": 4318, "device_id": "0x2330"}"#).unwrap();
        assert_eq!((n.vendor_id, n.device_id), (0x10de, 0x2330));
        assert!(serde_json::from_str::<PciDevice>(r#"{"vendor_id": "10000"}"#).is_err());
    }

    #[test]
    fn memory_that_moved_by_a_few_mib_is_reported_a_lost_dimm_is_a_loss() {
        let old = Inventory {
            memory_mib: 15_990,
            ..Inventory::default()
        };
        let mut new = old.clone();
        new.memory_mib = 15_950;
        let d = diff(&old, &new);
        assert_eq!((d.len(), d[0].degraded), (1, false), "{d:?}");
        new.memory_mib = 11_990;
        assert!(diff(&old, &new)[0].degraded);
    }

    #[test]
    fn out_of_band_fills_only_what_the_os_did_not_see() {
        let os = Inventory {
            system: System {
                model: "OS model".into(),
                ..System::default()
            },
            firmware: BTreeMap::from([("bios".into(), "1.0".into())]),
            ..Inventory::default()
        };
        let bmc = Inventory {
            system: System {
                model: "BMC model".into(),
                serial: "SN1".into(),
                ..System::default()
            },
            firmware: BTreeMap::from([("bios".into(), "0.9".into()), ("bmc".into(), "2.3".into())]),
            ..Inventory::default()
        };
        let m = merge_out_of_band(&os, &bmc);
        assert_eq!(
            (m.system.model.as_str(), m.system.serial.as_str()),
            ("OS model", "SN1")
        );
        assert_eq!(m.firmware["bios"], "1.0");
        assert_eq!(m.firmware["bmc"], "2.3");
    }

    #[test]
    fn what_one_side_did_not_report_is_not_a_change() {
        let old = Inventory {
            pci: vec![h100("0000:18:00.0", 16)],
            ..Inventory::default()
        };
        // An out-of-band report: no PCI list, memory only.
        let new = Inventory {
            memory_mib: 1024,
            ..Inventory::default()
        };
        assert!(diff(&old, &new).is_empty(), "{:?}", diff(&old, &new));
    }
}
