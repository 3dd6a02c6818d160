//! What NVIDIA's driver tool says about its GPUs, and how that lands in an
//! [`Inventory`].
//!
//! Two outputs, both pure text in and facts out:
//! - `nvidia-smi -q -x`: per GPU the PCI bus id, product name, UUID, serial, VBIOS and
//!   the PCIe link (generation and width, as trained and at most), plus the driver and
//!   CUDA versions. The XML carries no NVLink state (that is `nvidia-smi nvlink -s`);
//!   NVLink widths come from the topology matrix.
//! - `nvidia-smi topo -m`: the matrix of GPUs and NICs with the legend's relations
//!   (`X`, `NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`), the `NIC Legend` naming `NIC<n>`
//!   columns, and the `CPU Affinity` / `NUMA Affinity` columns.
//!
//! [`merge`] joins both to the inventory by PCI address. `topo -m` names GPUs by NVML
//! index only; NVML numbers GPUs in PCI bus order, the order `-q -x` lists them in, so
//! index `n` is the `n`-th GPU of the XML (or, without it, the `n`-th NVIDIA display or
//! 3D controller by address).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{Gpu, Inventory, Link};

/// Why an `nvidia-smi` output could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NvidiaError {
    #[error("nvidia-smi -q -x: {0}")]
    Xml(#[from] quick_xml::DeError),
    #[error("nvidia-smi -q -x: gpu {index} has no PCI bus id ({raw:?})")]
    BusId { index: usize, raw: String },
    #[error("nvidia-smi topo -m: no header line naming GPU0")]
    NoTopoHeader,
    #[error("nvidia-smi topo -m: row {row:?} has {cells} cells for {columns} device columns")]
    ShortRow {
        row: String,
        cells: usize,
        columns: usize,
    },
}

/// `nvidia-smi -q -x`, reduced to what an inventory keeps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Smi {
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// In NVML index order (PCI bus order).
    pub gpus: Vec<SmiGpu>,
}

/// One `<gpu>` of `nvidia-smi -q -x`. `N/A` fields are `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SmiGpu {
    /// As sysfs writes it: `0000:4f:00.0`.
    pub pci_address: String,
    pub product_name: String,
    pub uuid: Option<String>,
    pub serial: Option<String>,
    pub vbios: Option<String>,
    /// The link as trained now (GPUs drop to gen 1 when idle), and the most the GPU and
    /// its slot can do.
    pub link: Option<PcieLink>,
    pub max_link: Option<PcieLink>,
}

/// A PCIe link as `nvidia-smi` gives it: generation and lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PcieLink {
    pub generation: u32,
    pub width: u32,
}

impl PcieLink {
    /// The same link in sysfs terms (GT/s per lane), for generations 1 to 6.
    pub fn to_link(self) -> Option<Link> {
        let speed_gts = match self.generation {
            1 => 2.5,
            2 => 5.0,
            3 => 8.0,
            4 => 16.0,
            5 => 32.0,
            6 => 64.0,
            _ => return None,
        };
        Some(Link {
            speed_gts,
            width: self.width,
        })
    }
}

// The XML as nvidia-smi writes it (schemas v10 to v13 agree on these elements); every
// element defaults so an older or trimmed log still reads.
#[derive(Deserialize, Default)]
#[serde(default)]
struct XmlLog {
    driver_version: String,
    cuda_version: String,
    gpu: Vec<XmlGpu>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct XmlGpu {
    #[serde(rename = "@id")]
    id: String,
    product_name: String,
    serial: String,
    uuid: String,
    vbios_version: String,
    pci: XmlPci,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct XmlPci {
    pci_bus_id: String,
    pci_gpu_link_info: XmlLinkInfo,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct XmlLinkInfo {
    pcie_gen: XmlGen,
    link_widths: XmlWidths,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct XmlGen {
    max_link_gen: String,
    current_link_gen: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct XmlWidths {
    max_link_width: String,
    current_link_width: String,
}

/// `N/A`, `Not Supported` and empty values are absent.
fn known(s: &str) -> Option<String> {
    let s = s.trim();
    let absent = s.is_empty()
        || s.eq_ignore_ascii_case("N/A")
        || s.eq_ignore_ascii_case("Not Supported")
        || s.eq_ignore_ascii_case("Unknown Error");
    (!absent).then(|| s.to_string())
}

/// `16x` or `16` lanes; generation `4`.
fn number(s: &str) -> Option<u32> {
    s.trim().trim_end_matches(['x', 'X']).parse().ok()
}

fn pcie(generation: &str, width: &str) -> Option<PcieLink> {
    Some(PcieLink {
        generation: number(generation)?,
        width: number(width)?,
    })
}

/// `00000000:4F:00.0` (NVML's 32-bit domain, upper case) or `0000:4f:00.0` as sysfs
/// writes it: `0000:4f:00.0`. `None` for anything that is not `domain:bus:device.fn`.
pub fn normalize_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim();
    let (rest, function) = raw.rsplit_once('.')?;
    let mut parts = rest.rsplitn(3, ':');
    let device = u8::from_str_radix(parts.next()?, 16).ok()?;
    let bus = u8::from_str_radix(parts.next()?, 16).ok()?;
    let domain = match parts.next() {
        Some(d) => u32::from_str_radix(d, 16).ok()?,
        None => 0,
    };
    let function = u8::from_str_radix(function, 16).ok()?;
    if device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// Parses `nvidia-smi -q -x`.
pub fn parse_smi(xml: &str) -> Result<Smi, NvidiaError> {
    let log: XmlLog = quick_xml::de::from_str(xml)?;
    let gpus = log
        .gpu
        .into_iter()
        .enumerate()
        .map(|(index, g)| {
            let pci_address = normalize_bus_id(&g.pci.pci_bus_id)
                .or_else(|| normalize_bus_id(&g.id))
                .ok_or_else(|| NvidiaError::BusId {
                    index,
                    raw: g.pci.pci_bus_id.clone(),
                })?;
            let l = &g.pci.pci_gpu_link_info;
            Ok(SmiGpu {
                pci_address,
                product_name: g.product_name.trim().to_string(),
                uuid: known(&g.uuid),
                serial: known(&g.serial),
                vbios: known(&g.vbios_version),
                link: pcie(
                    &l.pcie_gen.current_link_gen,
                    &l.link_widths.current_link_width,
                ),
                max_link: pcie(&l.pcie_gen.max_link_gen, &l.link_widths.max_link_width),
            })
        })
        .collect::<Result<Vec<_>, NvidiaError>>()?;
    Ok(Smi {
        driver_version: known(&log.driver_version),
        cuda_version: known(&log.cuda_version),
        gpus,
    })
}

/// `nvidia-smi topo -m`, one entry per GPU row in index order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Topo {
    pub gpus: Vec<TopoGpu>,
}

/// One `GPU<n>` row of the matrix.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopoGpu {
    /// `n` of `GPU<n>`: the NVML index.
    pub index: u32,
    /// The relation to every other GPU by index (`NV12`, `SYS`, ...).
    pub peers: BTreeMap<u32, String>,
    /// How this GPU reaches each NIC, by the NIC's name (`mlx5_2`; the `NIC Legend`
    /// resolves `NIC<n>` columns).
    pub nics: BTreeMap<String, String>,
    /// `0-47,96-143`, where reported.
    pub cpu_affinity: Option<String>,
    pub numa_node: Option<u32>,
}

impl TopoGpu {
    /// NVLinks to each peer GPU that is reached over NVLink (`NV<count>`).
    pub fn nvlink_peers(&self) -> BTreeMap<u32, u32> {
        self.peers
            .iter()
            .filter_map(|(i, rel)| Some((*i, rel.strip_prefix("NV")?.parse().ok()?)))
            .collect()
    }

    /// The widest bonded set of NVLinks to any peer; `None` without NVLink. Behind
    /// NVSwitches every peer shows the GPU's full width, so this is the GPU's active
    /// link count there and drops when one of its links goes down.
    pub fn nvlinks(&self) -> Option<u32> {
        self.nvlink_peers().into_values().max()
    }
}

/// Drops ANSI escapes (`nvidia-smi` underlines the header on a terminal).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte(@..~)
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `GPU12` -> 12.
fn gpu_index(token: &str) -> Option<u32> {
    token.strip_prefix("GPU")?.parse().ok()
}

/// Parses `nvidia-smi topo -m`, tab-separated as printed or with the tabs expanded to
/// spaces as it is usually pasted.
pub fn parse_topo(text: &str) -> Result<Topo, NvidiaError> {
    let lines: Vec<String> = text.lines().map(strip_ansi).collect();
    // The header is the first line starting with GPU0 that is not GPU0's own row.
    let (at, header) = lines
        .iter()
        .enumerate()
        .find_map(|(i, l)| {
            // Multi-word column titles become one token each.
            let l = l
                .replace("GPU NUMA ID", "GPU_NUMA_ID")
                .replace("CPU Affinity", "CPU_Affinity")
                .replace("NUMA Affinity", "NUMA_Affinity");
            let t: Vec<String> = l.split_whitespace().map(str::to_string).collect();
            (t.first().map(String::as_str) == Some("GPU0")
                && t.get(1).map(String::as_str) != Some("X"))
            .then_some((i, t))
        })
        .ok_or(NvidiaError::NoTopoHeader)?;
    let devices = header
        .iter()
        .take_while(|c| !c.ends_with("_Affinity") && *c != "GPU_NUMA_ID")
        .count();
    let extra = &header[devices..];

    // `NIC Legend:` then `  NIC0: mlx5_0` lines.
    let mut legend = BTreeMap::new();
    if let Some(start) = lines.iter().position(|l| l.trim() == "NIC Legend:") {
        for l in &lines[start + 1..] {
            if let Some((k, v)) = l.trim().split_once(':') {
                legend.insert(k.trim().to_string(), v.trim().to_string());
            }
        }
    }

    let mut gpus = Vec::new();
    for line in &lines[at + 1..] {
        let line = line.trim();
        if line.starts_with("Legend:") {
            break;
        }
        let cells: Vec<&str> = line.split_whitespace().collect();
        let Some((label, cells)) = cells.split_first() else {
            continue;
        };
        // NIC rows repeat what the GPU rows say.
        let Some(index) = gpu_index(label) else {
            continue;
        };
        if cells.len() < devices {
            return Err(NvidiaError::ShortRow {
                row: (*label).to_string(),
                cells: cells.len(),
                columns: devices,
            });
        }
        let mut g = TopoGpu {
            index,
            ..TopoGpu::default()
        };
        for (column, cell) in header[..devices].iter().zip(cells) {
            if *cell == "X" {
                continue;
            }
            match gpu_index(column) {
                Some(peer) => {
                    g.peers.insert(peer, (*cell).to_string());
                }
                None => {
                    let nic = legend.get(column).unwrap_or(column);
                    g.nics.insert(nic.clone(), (*cell).to_string());
                }
            }
        }
        for (column, cell) in extra.iter().zip(&cells[devices..]) {
            match column.as_str() {
                "CPU_Affinity" => g.cpu_affinity = known(cell),
                "NUMA_Affinity" => g.numa_node = cell.parse().ok(),
                _ => {}
            }
        }
        gpus.push(g);
    }
    Ok(Topo { gpus })
}

/// Fills and extends `inv.gpus` from the vendor tool: identity, VBIOS, serial and
/// driver from `smi`, NUMA node, NVLinks and NIC relations from `topo`, matched by PCI
/// address. A GPU's VBIOS also becomes firmware `gpu:<pci address>`, so a pinned
/// version in a profile and the generation diff both see it. Where sysfs gave no link
/// for the GPU's PCI function, the one nvidia-smi reports fills it.
pub fn merge(inv: &mut Inventory, smi: Option<&Smi>, topo: Option<&Topo>) {
    let order: Vec<String> = match smi {
        Some(s) => s.gpus.iter().map(|g| g.pci_address.clone()).collect(),
        None => {
            let mut v: Vec<String> = inv
                .pci
                .iter()
                .filter(|d| d.vendor_id == 0x10de && matches!(d.class >> 8, 0x0300 | 0x0302))
                .map(|d| d.address.to_ascii_lowercase())
                .collect();
            v.sort();
            v
        }
    };
    fn entry<'a>(gpus: &'a mut Vec<Gpu>, address: &str) -> &'a mut Gpu {
        let at = match gpus
            .iter()
            .position(|g| g.pci_address.eq_ignore_ascii_case(address))
        {
            Some(i) => i,
            None => {
                gpus.push(Gpu {
                    pci_address: address.to_string(),
                    ..Gpu::default()
                });
                gpus.len() - 1
            }
        };
        &mut gpus[at]
    }
    if let Some(smi) = smi {
        for s in &smi.gpus {
            let g = entry(&mut inv.gpus, &s.pci_address);
            g.pci_address = s.pci_address.clone();
            if !s.product_name.is_empty() {
                g.model = s.product_name.clone();
            }
            if let Some(u) = &s.uuid {
                g.uuid = u.clone();
            }
            if let Some(v) = &s.vbios {
                g.vbios = v.clone();
                inv.firmware
                    .insert(format!("gpu:{}", s.pci_address), v.clone());
            }
            if let Some(n) = &s.serial {
                g.serial = n.clone();
            }
            if let Some(d) = &smi.driver_version {
                g.driver = d.clone();
            }
            if let Some(d) = inv
                .pci
                .iter_mut()
                .find(|d| d.address.eq_ignore_ascii_case(&s.pci_address))
            {
                if d.link.is_none() {
                    d.link = s.link.and_then(PcieLink::to_link);
                }
                if d.max_link.is_none() {
                    d.max_link = s.max_link.and_then(PcieLink::to_link);
                }
            }
        }
    }
    if let Some(topo) = topo {
        let address = |i: u32| order.get(i as usize).cloned();
        for t in &topo.gpus {
            let Some(addr) = address(t.index) else {
                continue;
            };
            let g = entry(&mut inv.gpus, &addr);
            if t.numa_node.is_some() {
                g.numa_node = t.numa_node;
            }
            g.nvlinks = t.nvlinks();
            g.nvlink_peers = t
                .nvlink_peers()
                .into_iter()
                .map(|(i, n)| (address(i).unwrap_or_else(|| format!("GPU{i}")), n))
                .collect();
            g.nic_affinity = t.nics.clone();
        }
    }
    // A GPU the tool saw without a NUMA node still has its PCI function's.
    for g in &mut inv.gpus {
        if g.numa_node.is_none() {
            g.numa_node = inv
                .pci
                .iter()
                .find(|d| d.address.eq_ignore_ascii_case(&g.pci_address))
                .and_then(|d| d.numa_node);
        }
    }
    inv.gpus.sort_by(|a, b| a.pci_address.cmp(&b.pci_address));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::PciDevice;

    fn fixture(name: &str) -> String {
        crate::inventory::tests::fixture("nvidia", name)
    }

    #[test]
    fn bus_ids_as_sysfs_writes_them() {
        for (raw, want) in [
            ("00000000:4F:00.0", Some("0000:4f:00.0")),
            ("0000:4f:00.0", Some("0000:4f:00.0")),
            ("00000001:C1:00.0", Some("0001:c1:00.0")),
            ("4F:00.0", Some("0000:4f:00.0")),
            ("N/A", None),
            ("00000000:4F:20.0", None),
            ("00000000:4F:00.9", None),
        ] {
            assert_eq!(normalize_bus_id(raw).as_deref(), want, "{raw}");
        }
    }

    #[test]
    fn a100_sxm4_xml() {
        let smi = parse_smi(&fixture("a100-sxm4-smi-q-x.xml")).unwrap();
        assert_eq!(smi.driver_version.as_deref(), Some("535.54.03"));
        assert_eq!(smi.cuda_version.as_deref(), Some("12.2"));
        // Telegraf kept one of the four GPUs; its MIG devices must not read as GPUs.
        assert_eq!(smi.gpus.len(), 1);
        let g = &smi.gpus[0];
        assert_eq!(g.pci_address, "0000:01:00.0");
        assert_eq!(g.product_name, "NVIDIA A100-SXM4-80GB");
        assert_eq!(
            g.uuid.as_deref(),
            Some("GPU-513536b6-7d19-9063-b049-1e69664bb298")
        );
        assert_eq!(g.serial.as_deref(), Some("1650522003820"));
        assert_eq!(g.vbios.as_deref(), Some("92.00.36.00.02"));
        let want = PcieLink {
            generation: 4,
            width: 16,
        };
        assert_eq!((g.link, g.max_link), (Some(want), Some(want)));
        assert_eq!(want.to_link().unwrap().to_string(), "16 GT/s x16");
    }

    #[test]
    fn dual_a5000_v13_xml() {
        let smi = parse_smi(&fixture("dual-a5000-smi-q-x.xml")).unwrap();
        assert_eq!(smi.driver_version.as_deref(), Some("590.44.01"));
        assert_eq!(smi.cuda_version.as_deref(), Some("13.1"));
        let addrs: Vec<&str> = smi.gpus.iter().map(|g| g.pci_address.as_str()).collect();
        assert_eq!(addrs, ["0000:81:00.0", "0000:c1:00.0"]);
        let g = &smi.gpus[1];
        assert_eq!(g.product_name, "NVIDIA RTX A5000");
        assert_eq!(g.vbios.as_deref(), Some("94.02.6D.00.0D"));
        assert_eq!(g.serial.as_deref(), Some("1234567890123"));
        assert_eq!(
            g.uuid.as_deref(),
            Some("GPU-12345678-aaaa-bbbb-cccc-0123456789cd")
        );
        // Idle: trained at gen 1, capable of gen 4, full width either way.
        assert_eq!(
            g.link,
            Some(PcieLink {
                generation: 1,
                width: 16
            })
        );
        assert_eq!(
            g.max_link.unwrap().to_link().unwrap().to_string(),
            "16 GT/s x16"
        );
    }

    #[test]
    fn dual_2080_xml_shows_links_at_half_width_and_no_serial() {
        let smi = parse_smi(&fixture("dual-2080-smi-q-x.xml")).unwrap();
        assert_eq!(smi.gpus.len(), 2);
        for g in &smi.gpus {
            assert_eq!(g.link.unwrap().width, 8);
            assert_eq!(g.max_link.unwrap().width, 16);
            assert_eq!(g.max_link.unwrap().generation, 3);
            assert_eq!(g.serial, None, "N/A is no serial");
            assert_eq!(g.vbios.as_deref(), Some("90.04.0B.00.8F"));
        }
        assert_eq!(smi.gpus[1].pci_address, "0000:02:00.0");
    }

    #[test]
    fn xml_that_is_not_nvidia_smi_is_an_error_not_a_panic() {
        assert!(parse_smi("<nvidia_smi_log><gpu>").is_err());
        let e = parse_smi("<nvidia_smi_log><gpu id=\"x\"><pci><pci_bus_id>N/A</pci_bus_id></pci></gpu></nvidia_smi_log>")
            .unwrap_err();
        assert!(matches!(e, NvidiaError::BusId { index: 0, .. }), "{e}");
        assert_eq!(parse_smi("<nvidia_smi_log/>").unwrap(), Smi::default());
    }

    #[test]
    fn a100x8_topology_with_nic_legend() {
        let t = parse_topo(&fixture("a100x8-topo-m.txt")).unwrap();
        assert_eq!(t.gpus.len(), 8);
        let g0 = &t.gpus[0];
        assert_eq!(g0.index, 0);
        assert_eq!(g0.nvlinks(), Some(12));
        assert_eq!(g0.nvlink_peers().len(), 7);
        assert_eq!(g0.numa_node, Some(0));
        assert_eq!(g0.cpu_affinity.as_deref(), Some("0-103"));
        // NIC0..NIC16 resolved through the legend: NIC0 is mlx5_2.
        assert_eq!(g0.nics.len(), 17);
        assert_eq!(g0.nics["mlx5_2"], "PXB");
        assert_eq!(g0.nics["mlx5_6"], "SYS");
        assert_eq!(g0.nics["mlx5_bond_0"], "SYS");
        let g7 = &t.gpus[7];
        assert_eq!(g7.nics["mlx5_17"], "PXB");
        assert_eq!(g7.nics["mlx5_2"], "SYS");
        assert_eq!(g7.peers[&3], "NV12");
    }

    #[test]
    fn a10x4_topology_without_nvlink() {
        let t = parse_topo(&fixture("a10x4-topo-m.txt")).unwrap();
        assert_eq!(t.gpus.len(), 4);
        for g in &t.gpus {
            assert_eq!(g.nvlinks(), None);
            assert_eq!(g.numa_node, Some(0));
            assert_eq!(g.nics["mlx5_0"], "SYS");
            assert_eq!(g.nics["mlx5_1"], "SYS");
            assert_eq!(g.peers.values().filter(|r| *r == "SYS").count(), 3);
        }
    }

    #[test]
    fn desktop_topology_without_numa() {
        let t = parse_topo(&fixture("gtx1080ti-x2-topo-m.txt")).unwrap();
        assert_eq!(t.gpus.len(), 2);
        assert_eq!(t.gpus[1].peers[&0], "PHB");
        assert_eq!(t.gpus[1].numa_node, None);
        assert_eq!(t.gpus[1].cpu_affinity.as_deref(), Some("0-11"));
        assert!(t.gpus[1].nics.is_empty());
    }

    #[test]
    fn topology_errors() {
        assert!(matches!(
            parse_topo("No devices were found"),
            Err(NvidiaError::NoTopoHeader)
        ));
        let short = fixture("a10x4-topo-m.txt").replace(
            "GPU2    SYS     SYS      X      SYS     SYS     SYS",
            "GPU2 SYS",
        );
        assert!(matches!(
            parse_topo(&short),
            Err(NvidiaError::ShortRow {
                cells: 4,
                columns: 6,
                ..
            })
        ));
    }

    #[test]
    fn tab_separated_and_underlined_header_reads_the_same() {
        // nvidia-smi itself writes tabs and, on a terminal, an underlined header.
        let spaced = fixture("a10x4-topo-m.txt");
        let tabbed: String = spaced
            .lines()
            .enumerate()
            .map(|(i, l)| {
                let l = l
                    .split("  ")
                    .filter(|c| !c.trim().is_empty())
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join("\t");
                if i == 0 {
                    format!("\u{1b}[4m\t{l}\u{1b}[0m\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        assert_eq!(parse_topo(&tabbed).unwrap(), parse_topo(&spaced).unwrap());
    }

    fn nvidia_fn(address: &str, numa: Option<u32>) -> PciDevice {
        PciDevice {
            address: address.into(),
            class: 0x030200,
            vendor_id: 0x10de,
            device_id: 0x20b2,
            numa_node: numa,
            ..PciDevice::default()
        }
    }

    #[test]
    fn merge_by_pci_address() {
        let smi = parse_smi(&fixture("dual-a5000-smi-q-x.xml")).unwrap();
        let topo = parse_topo(&fixture("gtx1080ti-x2-topo-m.txt")).unwrap();
        let mut inv = Inventory {
            // sysfs saw the link of the first GPU only, and a NUMA node for the second.
            pci: vec![
                PciDevice {
                    link: Some(Link {
                        speed_gts: 2.5,
                        width: 16,
                    }),
                    ..nvidia_fn("0000:81:00.0", None)
                },
                nvidia_fn("0000:c1:00.0", Some(1)),
            ],
            // An earlier report knew one GPU by its PCI name only.
            gpus: vec![Gpu {
                pci_address: "0000:C1:00.0".into(),
                model: "GA102GL [RTX A5000]".into(),
                ..Gpu::default()
            }],
            ..Inventory::default()
        };
        merge(&mut inv, Some(&smi), Some(&topo));
        assert_eq!(inv.gpus.len(), 2, "{:#?}", inv.gpus);
        let g = &inv.gpus[1];
        assert_eq!(g.pci_address, "0000:c1:00.0");
        assert_eq!(g.model, "NVIDIA RTX A5000");
        assert_eq!(g.vbios, "94.02.6D.00.0D");
        assert_eq!(g.serial, "1234567890123");
        assert_eq!(g.driver, "590.44.01");
        // topo -m has no NUMA node for it; the PCI function has.
        assert_eq!(g.numa_node, Some(1));
        assert_eq!(g.nvlinks, None);
        assert_eq!(inv.firmware["gpu:0000:81:00.0"], "94.02.6D.00.0D");
        // sysfs's link stays; the missing one comes from nvidia-smi.
        assert_eq!(inv.pci[0].link.unwrap().speed_gts, 2.5);
        assert_eq!(inv.pci[1].link.unwrap().to_string(), "2.5 GT/s x16");
        assert_eq!(inv.pci[1].max_link.unwrap().to_string(), "16 GT/s x16");
    }

    #[test]
    fn merge_topology_alone_orders_gpus_by_pci_address() {
        let topo = parse_topo(&fixture("a100x8-topo-m.txt")).unwrap();
        let addrs = [
            "0000:0f:00.0",
            "0000:07:00.0",
            "0000:47:00.0",
            "0000:4e:00.0",
            "0000:87:00.0",
            "0000:90:00.0",
            "0000:b7:00.0",
            "0000:bd:00.0",
        ];
        let mut inv = Inventory {
            pci: addrs.iter().map(|a| nvidia_fn(a, Some(0))).collect(),
            ..Inventory::default()
        };
        merge(&mut inv, None, Some(&topo));
        assert_eq!(inv.gpus.len(), 8);
        // GPU0 is the lowest address, not the first listed.
        let g0 = &inv.gpus[0];
        assert_eq!(g0.pci_address, "0000:07:00.0");
        assert_eq!(g0.nvlinks, Some(12));
        assert_eq!(g0.nvlink_peers.len(), 7);
        assert_eq!(g0.nvlink_peers["0000:bd:00.0"], 12);
        assert_eq!(g0.nic_affinity["mlx5_3"], "PXB");
        assert_eq!(inv.gpus[7].nic_affinity["mlx5_16"], "PXB");
        assert!(inv.firmware.is_empty());
    }

    #[test]
    fn merged_facts_reach_the_profile_gate() {
        use crate::inventory::profile::{Profile, check};
        #[derive(Deserialize)]
        struct F {
            profiles: Vec<Profile>,
        }
        let profile = |toml_text: &str| toml::from_str::<F>(toml_text).unwrap().profiles.remove(0);
        // The 2080 host: VBIOS pinned, full width asked of links trained at x8.
        let smi = parse_smi(&fixture("dual-2080-smi-q-x.xml")).unwrap();
        let mut inv = Inventory {
            pci: ["0000:01:00.0", "0000:02:00.0"]
                .iter()
                .map(|a| nvidia_fn(a, Some(0)))
                .collect(),
            ..Inventory::default()
        };
        merge(&mut inv, Some(&smi), None);
        let pinned = profile(
            r#"
[[profiles]]
name = "desk"
gpus = [{ model = "*RTX 2080*", count = 2 }]
firmware = { "gpu:*" = "=90.04.0B.00.8F" }
"#,
        );
        assert_eq!(check(&pinned, &inv), vec![]);
        let wide = profile(
            r#"
[[profiles]]
name = "desk"
gpus = [{ model = "*RTX 2080*", count = 2, min_link_width = 16 }]
firmware = { "gpu:*" = "=90.04.0B.00.90" }
"#,
        );
        let misses: Vec<String> = check(&wide, &inv).iter().map(|m| m.to_string()).collect();
        assert_eq!(misses.len(), 4, "{misses:#?}");
        assert!(
            misses
                .iter()
                .any(|m| m.contains("0000:02:00.0") && m.contains("x8")),
            "{misses:#?}"
        );
        assert!(
            misses
                .iter()
                .any(|m| m.contains("gpu:0000:01:00.0") && m.contains("90.04.0B.00.8F")),
            "{misses:#?}"
        );

        // The A100 host's NV12 meets 12 and fails 18.
        let topo = parse_topo(&fixture("a100x8-topo-m.txt")).unwrap();
        let mut inv = Inventory {
            pci: (0..8)
                .map(|i| nvidia_fn(&format!("0000:{:02x}:00.0", 0x10 + i), Some(0)))
                .collect(),
            ..Inventory::default()
        };
        merge(&mut inv, None, Some(&topo));
        let nv = |n: u32| {
            profile(&format!(
                "[[profiles]]\nname = \"hgx\"\nnvlinks_per_gpu = {n}\n"
            ))
        };
        assert_eq!(check(&nv(12), &inv), vec![]);
        assert_eq!(check(&nv(18), &inv).len(), 8);
    }
}
