//! An out-of-band [`Inventory`] built from Redfish resources the BMC driver already
//! fetched (see `crate::bmc::redfish` for the walk). Pure: no I/O, no errors. Every
//! field may be missing, null or of the wrong type on some BMC; what cannot be read is
//! left "not reported" (empty, 0, `None`) so that [`super::diff`] skips it.
//!
//! Vendor quirks seen in real captures (fixtures under `tests/fixtures/redfish/`):
//! - HPE iLO 5 writes PCI ids as decimal strings (`"VendorId": "32902"` for 8086) and
//!   `ClassCode` as the base class alone in decimal (`"3"`); the schema says
//!   `"0x8086"` / `"0x030000"`. Ids with `0x` are hex, bare digits are decimal.
//! - Cisco CIMC lists each PCIe device twice (under the system and under the chassis)
//!   and gives no class code: a function without a class whose vendor is NVIDIA
//!   (10de) is taken for a GPU.
//! - Redfish has no PCI address: devices are keyed by the function's `@odata.id`,
//!   which is stable for one BMC, so an out-of-band baseline diffs against the next
//!   out-of-band report, not against an in-band one.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{Cpu, Disk, Gpu, Inventory, Link, Nic, PciDevice, System};
use crate::model::Arch;

/// The Redfish resources an inventory is built from, each the JSON body of one GET.
/// Collections are already expanded into their members.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    /// The ComputerSystem.
    pub system: Value,
    /// `Processor` members (CPUs, and GPUs/accelerators where the BMC lists them).
    pub processors: Vec<Value>,
    /// `Memory` members (DIMMs).
    pub memory: Vec<Value>,
    /// `PCIeDevice` resources.
    pub pcie_devices: Vec<Value>,
    /// `PCIeFunction` resources.
    pub pcie_functions: Vec<Value>,
    /// `EthernetInterface` members of the system.
    pub ethernet: Vec<Value>,
    /// `NetworkPort` / `Port` members of the chassis' network adapters.
    pub network_ports: Vec<Value>,
    /// `Storage` resources (their controllers carry a PCIe link on some BMCs).
    pub storage: Vec<Value>,
    /// `Drive` resources.
    pub drives: Vec<Value>,
    /// `SoftwareInventory` members of `UpdateService/FirmwareInventory`.
    pub firmware: Vec<Value>,
    /// The system's (first) Chassis.
    pub chassis: Option<Value>,
}

/// A trimmed string field; `None` when missing, null, not a string, or blank.
fn text(v: &Value, key: &str) -> Option<String> {
    v.get(key)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

/// A non-negative integer field, also from a float or a numeric string.
fn uint(v: &Value, key: &str) -> Option<u64> {
    match v.get(key)? {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64)),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn u32_of(v: &Value, key: &str) -> Option<u32> {
    uint(v, key).and_then(|n| u32::try_from(n).ok())
}

fn odata_id(v: &Value) -> Option<&str> {
    v.get("@odata.id").and_then(Value::as_str)
}

/// `Status.State == "Absent"`: an empty slot the BMC lists anyway.
fn absent(v: &Value) -> bool {
    v.pointer("/Status/State").and_then(Value::as_str) == Some("Absent")
}

/// A PCI id as Redfish writes it: `"0x10de"` (schema), `"32902"` (HPE iLO 5: decimal),
/// or a JSON number.
fn pci_id(v: &Value, key: &str) -> Option<u64> {
    match v.get(key)? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => {
            let s = s.trim();
            if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                u64::from_str_radix(h, 16).ok()
            } else if s.chars().all(|c| c.is_ascii_digit()) {
                s.parse().ok()
            } else {
                u64::from_str_radix(s, 16).ok()
            }
        }
        _ => None,
    }
}

fn pci_id16(v: &Value, key: &str) -> u16 {
    pci_id(v, key)
        .and_then(|n| u16::try_from(n).ok())
        .unwrap_or(0)
}

/// The base class a `DeviceClass` name stands for (PCIeFunction schema).
fn device_class_base(name: &str) -> Option<u32> {
    Some(match name {
        "MassStorageController" => 0x01,
        "NetworkController" => 0x02,
        "DisplayController" => 0x03,
        "MultimediaController" => 0x04,
        "MemoryController" => 0x05,
        "Bridge" => 0x06,
        "CommunicationController" => 0x07,
        "GenericSystemPeripheral" => 0x08,
        "InputDeviceController" => 0x09,
        "DockingStation" => 0x0a,
        "Processor" => 0x0b,
        "SerialBusController" => 0x0c,
        "WirelessController" => 0x0d,
        "IntelligentController" => 0x0e,
        "SatelliteCommunicationsController" => 0x0f,
        "EncryptionController" => 0x10,
        "SignalProcessingController" => 0x11,
        "ProcessingAccelerators" => 0x12,
        "NonEssentialInstrumentation" => 0x13,
        "Coprocessor" => 0x40,
        _ => return None,
    })
}

/// Class, subclass and prog-if: `"0x030200"` as written, a bare base class (HPE's
/// decimal `"3"`) shifted into place, else the base class of `DeviceClass`.
fn class_code(f: &Value) -> u32 {
    let raw = f.get("ClassCode").and_then(Value::as_str).map(str::trim);
    let parsed = match raw {
        Some(s) if s.starts_with("0x") || s.starts_with("0X") => {
            u32::from_str_radix(&s[2..], 16).ok()
        }
        Some(s) if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) => s
            .parse::<u32>()
            .ok()
            .filter(|n| *n <= 0xff)
            .map(|n| n << 16),
        _ => None,
    };
    parsed
        .filter(|c| *c <= 0xff_ffff && *c != 0)
        .or_else(|| {
            f.get("DeviceClass")
                .and_then(Value::as_str)
                .and_then(device_class_base)
                .map(|b| b << 16)
        })
        .unwrap_or(0)
}

/// GT/s per lane of a `PCIeType` (`Gen1` .. `Gen6`).
pub fn gen_speed_gts(pcie_type: &str) -> Option<f32> {
    Some(match pcie_type {
        "Gen1" => 2.5,
        "Gen2" => 5.0,
        "Gen3" => 8.0,
        "Gen4" => 16.0,
        "Gen5" => 32.0,
        "Gen6" => 64.0,
        _ => return None,
    })
}

/// The current and maximum link of a `PCIeInterface` object; each needs both its
/// generation and its lane count.
fn links(iface: Option<&Value>) -> (Option<Link>, Option<Link>) {
    let Some(i) = iface.filter(|i| i.is_object()) else {
        return (None, None);
    };
    let link = |gen_key: &str, lanes_key: &str| {
        let speed = i
            .get(gen_key)
            .and_then(Value::as_str)
            .and_then(gen_speed_gts)?;
        let width = u32_of(i, lanes_key).filter(|w| *w > 0)?;
        Some(Link {
            speed_gts: speed,
            width,
        })
    };
    (
        link("PCIeType", "LanesInUse"),
        link("MaxPCIeType", "MaxLanes"),
    )
}

/// Builds the out-of-band inventory. Never panics; what a BMC did not send stays
/// "not reported".
pub fn from_resources(r: &Resources) -> Inventory {
    let sys = &r.system;
    let mut inv = Inventory {
        system: System {
            vendor: text(sys, "Manufacturer").unwrap_or_default(),
            model: text(sys, "Model").unwrap_or_default(),
            serial: text(sys, "SerialNumber").unwrap_or_default(),
        },
        ..Inventory::default()
    };
    // Systems that leave these out (sushy-tools, some blades) have them on the chassis.
    if let Some(c) = &r.chassis {
        for (field, key) in [
            (&mut inv.system.vendor, "Manufacturer"),
            (&mut inv.system.model, "Model"),
            (&mut inv.system.serial, "SerialNumber"),
        ] {
            if field.is_empty() {
                *field = text(c, key).unwrap_or_default();
            }
        }
    }
    processors(r, &mut inv);
    inv.memory_mib = memory_mib(r);
    pci(r, &mut inv);
    inv.nics = nics(r);
    inv.disks = r
        .drives
        .iter()
        .filter(|d| d.is_object() && !absent(d))
        .map(|d| Disk {
            name: text(d, "Id")
                .or_else(|| text(d, "Name"))
                .unwrap_or_default(),
            model: text(d, "Model").unwrap_or_default(),
            serial: text(d, "SerialNumber").unwrap_or_default(),
            size_bytes: uint(d, "CapacityBytes").unwrap_or(0),
        })
        .filter(|d| d.size_bytes > 0 || !d.serial.is_empty() || !d.model.is_empty())
        .collect();
    inv.firmware = firmware(r);
    inv
}

fn processors(r: &Resources, inv: &mut Inventory) {
    let mut cpu = Cpu::default();
    for p in r.processors.iter().filter(|p| p.is_object() && !absent(p)) {
        let kind = text(p, "ProcessorType");
        match kind.as_deref() {
            // Older schemas have no ProcessorType: everything listed was a CPU.
            None | Some("CPU") => {
                cpu.sockets += 1;
                cpu.cores += u32_of(p, "TotalCores").unwrap_or(0);
                cpu.threads += u32_of(p, "TotalThreads").unwrap_or(0);
                if cpu.model.is_empty() {
                    cpu.model = text(p, "Model").unwrap_or_default();
                }
                if inv.arch.is_none() {
                    inv.arch = arch(p);
                }
            }
            Some("GPU" | "Accelerator") => inv.gpus.push(Gpu {
                pci_address: odata_id(p)
                    .map(String::from)
                    .or_else(|| text(p, "Id"))
                    .unwrap_or_default(),
                model: text(p, "Model")
                    .or_else(|| text(p, "Name"))
                    .unwrap_or_default(),
                uuid: text(p, "UUID").unwrap_or_default(),
                vbios: text(p, "FirmwareVersion").unwrap_or_default(),
                ..Gpu::default()
            }),
            _ => {}
        }
    }
    // No Processor resources: the system's summary still counts sockets and cores.
    if cpu.sockets == 0 {
        let s = &r.system["ProcessorSummary"];
        cpu.sockets = u32_of(s, "Count").unwrap_or(0);
        cpu.cores = u32_of(s, "CoreCount").unwrap_or(0);
        cpu.threads = u32_of(s, "LogicalProcessorCount").unwrap_or(0);
        cpu.model = text(s, "Model").unwrap_or_default();
    }
    inv.cpu = cpu;
}

/// `InstructionSet` (`x86-64`, `ARM-A64`), else `ProcessorArchitecture` when it is
/// unambiguous (`x86` and `ARM` cover 32-bit parts too).
fn arch(p: &Value) -> Option<Arch> {
    match text(p, "InstructionSet").as_deref() {
        Some("x86-64") => Some(Arch::X86_64),
        Some("ARM-A64") => Some(Arch::Arm64),
        _ => None,
    }
}

fn memory_mib(r: &Resources) -> u64 {
    if let Some(gib) = r.system["MemorySummary"]
        .get("TotalSystemMemoryGiB")
        .and_then(Value::as_f64)
        .filter(|g| *g > 0.0)
    {
        return (gib * 1024.0).round() as u64;
    }
    r.memory
        .iter()
        .filter(|m| m.is_object() && !absent(m))
        // GPU HBM is listed as Memory on HGX BMCs; it is not system memory.
        .filter(|m| {
            !text(m, "MemoryDeviceType")
                .or_else(|| text(m, "MemoryType"))
                .is_some_and(|t| t.starts_with("HBM"))
        })
        .filter_map(|m| uint(m, "CapacityMiB"))
        .sum()
}

fn pci(r: &Resources, inv: &mut Inventory) {
    let devices: BTreeMap<&str, &Value> = r
        .pcie_devices
        .iter()
        .filter_map(|d| odata_id(d).map(|id| (id, d)))
        .collect();
    let mut with_functions = BTreeSet::new();
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for f in r.pcie_functions.iter().filter(|f| f.is_object()) {
        let Some(id) = odata_id(f) else { continue };
        if !seen.insert(id) {
            continue;
        }
        let dev_id = f
            .pointer("/Links/PCIeDevice/@odata.id")
            .and_then(Value::as_str)
            .or_else(|| id.find("/PCIeFunctions/").map(|i| &id[..i]));
        let dev = dev_id.and_then(|d| devices.get(d).copied());
        if let Some(d) = dev_id {
            with_functions.insert(d);
        }
        let (link, max_link) = links(dev.and_then(|d| d.get("PCIeInterface")));
        out.push(PciDevice {
            address: id.to_string(),
            class: class_code(f),
            vendor_id: pci_id16(f, "VendorId"),
            device_id: pci_id16(f, "DeviceId"),
            subsystem_vendor_id: pci_id16(f, "SubsystemVendorId"),
            subsystem_device_id: pci_id16(f, "SubsystemId"),
            vendor: dev
                .and_then(|d| text(d, "Manufacturer"))
                .unwrap_or_default(),
            device: dev
                .and_then(|d| text(d, "Name").or_else(|| text(d, "Model")))
                .or_else(|| text(f, "Name"))
                .unwrap_or_default(),
            link,
            max_link,
            ..PciDevice::default()
        });
    }
    // Devices whose functions the BMC does not list still count (and carry the link).
    for (id, d) in &devices {
        if with_functions.contains(id) || absent(d) {
            continue;
        }
        let (link, max_link) = links(d.get("PCIeInterface"));
        out.push(PciDevice {
            address: (*id).to_string(),
            vendor: text(d, "Manufacturer").unwrap_or_default(),
            device: text(d, "Name")
                .or_else(|| text(d, "Model"))
                .unwrap_or_default(),
            link,
            max_link,
            ..PciDevice::default()
        });
    }
    // Storage controllers carry their PCIe link on some BMCs (HPE) where the
    // PCIeDevice does not: match by model name.
    for s in &r.storage {
        for c in s["StorageControllers"].as_array().into_iter().flatten() {
            let (link, max_link) = links(c.get("PCIeInterface"));
            if link.is_none() && max_link.is_none() {
                continue;
            }
            let names: Vec<String> = ["Model", "Name"]
                .iter()
                .filter_map(|k| text(c, k))
                .collect();
            for p in out.iter_mut().filter(|p| p.link.is_none()) {
                if names.contains(&p.device) {
                    p.link = link;
                    p.max_link = max_link;
                }
            }
        }
    }
    inv.pci = out;
    if inv.gpus.is_empty() {
        inv.gpus = inv
            .pci
            .iter()
            // The BMC's own VGA (Matrox, ASPEED) is a display controller, not a GPU.
            .filter(|p| !matches!(p.vendor_id, 0x102b | 0x1a03))
            .filter(|p| p.is_accelerator() || (p.class == 0 && p.vendor_id == 0x10de))
            .map(|p| Gpu {
                pci_address: p.address.clone(),
                model: p.device.clone(),
                ..Gpu::default()
            })
            .collect();
    }
}

fn nics(r: &Resources) -> Vec<Nic> {
    let mut out: Vec<Nic> = Vec::new();
    for e in r.ethernet.iter().filter(|e| e.is_object()) {
        let Some(mac) = ["MACAddress", "PermanentMACAddress"]
            .iter()
            .filter_map(|k| text(e, k))
            .find_map(|m| crate::model::normalize_mac(&m))
        else {
            continue;
        };
        out.push(Nic {
            name: text(e, "Id")
                .or_else(|| text(e, "Name"))
                .unwrap_or_default(),
            mac,
            speed_mbps: uint(e, "SpeedMbps").filter(|s| *s > 0),
            link_up: text(e, "LinkStatus").as_deref() == Some("LinkUp"),
            ..Nic::default()
        });
    }
    // Adapter ports (NetworkPort: AssociatedNetworkAddresses; Port:
    // Ethernet.AssociatedMACAddresses) add what the system's interfaces lack.
    for p in r.network_ports.iter().filter(|p| p.is_object()) {
        let macs = p
            .get("AssociatedNetworkAddresses")
            .or_else(|| p.pointer("/Ethernet/AssociatedMACAddresses"))
            .and_then(Value::as_array);
        let Some(mac) = macs
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .find_map(crate::model::normalize_mac)
        else {
            continue;
        };
        let speed = uint(p, "CurrentLinkSpeedMbps").or_else(|| {
            p.get("CurrentSpeedGbps")
                .and_then(Value::as_f64)
                .map(|g| (g * 1000.0).round() as u64)
        });
        let up = matches!(text(p, "LinkStatus").as_deref(), Some("Up" | "LinkUp"));
        match out.iter_mut().find(|n| n.mac == mac) {
            Some(n) => {
                n.speed_mbps = n.speed_mbps.or(speed.filter(|s| *s > 0));
                n.link_up |= up;
            }
            None => out.push(Nic {
                name: text(p, "Id").unwrap_or_default(),
                mac,
                speed_mbps: speed.filter(|s| *s > 0),
                link_up: up,
                ..Nic::default()
            }),
        }
    }
    out
}

/// The component a `FirmwareInventory` entry is, when it is one pxed's rules name:
/// the host firmware (`bios`) or the BMC's own (`bmc`).
fn well_known(entry: &Value, name: &str) -> Option<&'static str> {
    let id = text(entry, "Id").unwrap_or_default().to_ascii_lowercase();
    let desc = text(entry, "Description")
        .unwrap_or_default()
        .to_ascii_lowercase();
    let is = |words: &[&str]| words.iter().any(|w| *w == name || *w == id || *w == desc);
    if is(&[
        "bios",
        "system rom",
        "systemromactive",
        "bios_active",
        "host_bios",
    ]) {
        Some("bios")
    } else if is(&[
        "bmc",
        "bmc_active",
        "systembmc",
        "cimc",
        "xcc-primary",
        "idrac",
    ]) || name.starts_with("ilo ")
        || name.starts_with("integrated dell remote access controller")
    {
        Some("bmc")
    } else {
        None
    }
}

fn firmware(r: &Resources) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in r.firmware.iter().filter(|e| e.is_object()) {
        let Some(version) = text(e, "Version") else {
            continue;
        };
        let Some(name) = text(e, "Name")
            .or_else(|| text(e, "Id"))
            .map(|n| n.to_ascii_lowercase())
        else {
            continue;
        };
        // Dell lists the previous image too (`Previous-...`): only what runs counts.
        if text(e, "Id").is_some_and(|i| i.starts_with("Previous")) {
            continue;
        }
        if let Some(k) = well_known(e, &name) {
            out.entry(k.to_string()).or_insert_with(|| version.clone());
        }
        // Several entries may share a name (one per drive): key the later ones by Id.
        let key = match out.get(&name) {
            Some(v) if *v != version => match text(e, "Id") {
                Some(id) => format!("{name} ({})", id.to_ascii_lowercase()),
                None => continue,
            },
            _ => name,
        };
        out.insert(key, version);
    }
    if let Some(b) = text(&r.system, "BiosVersion") {
        out.insert("bios".into(), b);
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A capture as stored under `tests/fixtures/redfish/<name>/resources.json`:
    /// one object mapping each resource's path to its body.
    pub(crate) fn capture(name: &str) -> BTreeMap<String, Value> {
        let path = format!(
            "{}/tests/fixtures/redfish/{name}/resources.json",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    /// The resources of a capture whose paths match `pattern` (`*` matches one path
    /// segment), in path order.
    pub(crate) fn matching(c: &BTreeMap<String, Value>, pattern: &str) -> Vec<Value> {
        let want: Vec<&str> = pattern.split('/').collect();
        c.iter()
            .filter(|(k, _)| {
                let got: Vec<&str> = k.split('/').collect();
                got.len() == want.len() && got.iter().zip(&want).all(|(g, w)| *w == "*" || g == w)
            })
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Resources picked from a capture by path, independently of the driver's walk:
    /// the system's collections, the chassis' PCIe devices where the system lists none.
    pub(crate) fn resources(c: &BTreeMap<String, Value>, system: &str) -> Resources {
        let s = system;
        let mut pcie_devices = matching(c, &format!("{s}/PCIeDevices/*"));
        let mut pcie_functions = matching(c, &format!("{s}/PCIeDevices/*/PCIeFunctions/*"));
        if pcie_devices.is_empty() {
            pcie_devices = matching(c, "/redfish/v1/Chassis/1/PCIeDevices/*");
            pcie_functions = matching(c, "/redfish/v1/Chassis/1/PCIeDevices/*/PCIeFunctions/*");
        }
        Resources {
            system: c[system].clone(),
            processors: matching(c, &format!("{s}/Processors/*")),
            memory: matching(c, &format!("{s}/Memory/*")),
            pcie_devices,
            pcie_functions,
            ethernet: matching(c, &format!("{s}/EthernetInterfaces/*")),
            network_ports: vec![],
            storage: matching(c, &format!("{s}/Storage/*")),
            drives: matching(c, &format!("{s}/Storage/*/Drives/*")),
            firmware: matching(c, "/redfish/v1/UpdateService/FirmwareInventory/*"),
            chassis: c.get("/redfish/v1/Chassis/1").cloned(),
        }
    }

    #[test]
    fn cisco_c225_m6s_with_an_nvidia_t4() {
        let c = capture("cisco-ucsc-c225-m6s");
        let inv = from_resources(&resources(&c, "/redfish/v1/Systems/WZP262207W0"));
        assert_eq!(
            inv.system,
            System {
                vendor: "Cisco Systems Inc".into(),
                model: "UCSC-C225-M6S".into(),
                serial: "WZP262207W0".into(),
            }
        );
        assert_eq!(inv.arch, Some(Arch::X86_64));
        assert_eq!(
            inv.cpu,
            Cpu {
                model: "AMD EPYC 7763 64-Core Processor".into(),
                sockets: 1,
                cores: 64,
                threads: 128,
            }
        );
        assert_eq!(inv.memory_mib, 512 * 1024);
        assert_eq!(inv.firmware["bios"], "C225M6.4.2.2b.0.0509222122");
        assert_eq!(inv.firmware["bmc"], "4.2(2a)");
        assert_eq!(inv.firmware["cimc"], "4.2(2a)");
        assert_eq!(inv.firmware["ucsc-m-v100-04-slot-mlom"], "5.2(2b)");
        // The T4 has a FirmwareInventory entry but no version: not reported.
        assert!(!inv.firmware.contains_key("ucsc-gpu-t4-16-slot-3"));
        assert_eq!(inv.pci.len(), 5, "{:#?}", inv.pci);
        let t4 = inv
            .pci
            .iter()
            .find(|p| p.device_id == 0x1eb8)
            .expect("T4 function");
        assert_eq!(
            (t4.vendor_id, t4.subsystem_vendor_id, t4.subsystem_device_id),
            (0x10de, 0x10de, 0x12a2)
        );
        assert_eq!(t4.device, "NVIDIA T4 PCIe 16GB 70W");
        assert_eq!(t4.link, None, "CIMC reports no PCIeInterface");
        assert_eq!(inv.gpus.len(), 1);
        assert_eq!(inv.gpus[0].model, "NVIDIA T4 PCIe 16GB 70W");
        assert_eq!(
            inv.gpus[0].pci_address,
            "/redfish/v1/Systems/WZP262207W0/PCIeDevices/3/PCIeFunctions/0"
        );
        let mlom = inv
            .pci
            .iter()
            .find(|p| p.address.ends_with("/PCIeDevices/MLOM/PCIeFunctions/0"))
            .unwrap();
        assert_eq!(
            (mlom.device.as_str(), mlom.vendor_id, mlom.device_id),
            ("Cisco UCS VIC 1477 MLOM", 0x1137, 0x0042)
        );
        assert_eq!(inv.nics.len(), 6);
        assert!(inv.nics.iter().any(|n| n.mac == "3c:8b:7f:f3:29:cc"));
        let d1 = inv.disks.iter().find(|d| d.name == "1").unwrap();
        assert_eq!(
            (d1.model.as_str(), d1.size_bytes),
            ("UCS-SD19T61X-EV", 1_920_383_057_920)
        );
    }

    #[test]
    fn hpe_dl360_gen10_plus_decimal_ids_and_a_controller_link() {
        let c = capture("hpe-proliant-dl360-gen10-plus");
        let inv = from_resources(&resources(&c, "/redfish/v1/Systems/1"));
        assert_eq!(
            (
                inv.system.vendor.as_str(),
                inv.system.model.as_str(),
                inv.system.serial.as_str()
            ),
            ("HPE", "ProLiant DL360 Gen10 Plus", "VYRBX9UJ4S")
        );
        assert_eq!(inv.arch, Some(Arch::X86_64));
        assert_eq!(inv.cpu.sockets, 2);
        assert_eq!(inv.cpu.model, "Intel(R) Xeon(R) Gold 6330 CPU @ 2.00GHz");
        assert_eq!(inv.cpu.cores, 56);
        assert_eq!(inv.memory_mib, 32 * 1024);
        assert_eq!(inv.firmware["bios"], "U46 v1.56 (11/29/2021)");
        assert_eq!(inv.firmware["bmc"], "2.55 Oct 01 2021");
        assert_eq!(inv.firmware["ilo 5"], "2.55 Oct 01 2021");
        assert_eq!(inv.firmware["hpe mr416i-p gen10+"], "52.16.3-3913");
        assert_eq!(
            inv.firmware["redundant system rom"],
            "U46 v1.42 (05/26/2021)"
        );
        assert!(inv.gpus.is_empty());
        assert!(inv.disks.iter().any(|d| d.serial == "SS0AN9970I010BC3W"
            && d.size_bytes == 960_197_124_096
            && d.model == "VO000960KXAVL"));
        let nic = inv
            .nics
            .iter()
            .find(|n| n.mac == "68:05:ca:e1:36:7c")
            .unwrap();
        assert_eq!((nic.speed_mbps, nic.link_up), (Some(1000), true));
        // iLO lists PCIe devices under the chassis, with decimal ids and a bare class.
        let nic = inv.pci.iter().find(|p| p.device_id == 0x1521).unwrap();
        assert_eq!((nic.vendor_id, nic.class), (0x8086, 0x020000));
        assert_eq!(nic.vendor, "Intel Corporation");
        let vga = inv.pci.iter().find(|p| p.vendor_id == 0x102b).unwrap();
        assert_eq!((vga.device_id, vga.class), (0x0538, 0x030000));
        // The boot controller's link comes from its StorageController entry.
        let boot = inv
            .pci
            .iter()
            .find(|p| p.device == "HPE NS204i-r Gen10+ Boot Controller")
            .unwrap();
        let gen3x4 = Link {
            speed_gts: 8.0,
            width: 4,
        };
        assert_eq!((boot.link, boot.max_link), (Some(gen3x4), Some(gen3x4)));
    }

    #[test]
    fn pci_ids_and_classes_in_every_spelling() {
        let f = serde_json::json!({"VendorId": "32902", "DeviceId": "0x1eb8",
            "SubsystemId": 163, "ClassCode": "3", "SubsystemVendorId": null});
        assert_eq!(pci_id16(&f, "VendorId"), 0x8086);
        assert_eq!(pci_id16(&f, "DeviceId"), 0x1eb8);
        assert_eq!(pci_id16(&f, "SubsystemId"), 163);
        assert_eq!(pci_id16(&f, "SubsystemVendorId"), 0);
        assert_eq!(class_code(&f), 0x030000);
        assert_eq!(
            class_code(&serde_json::json!({"ClassCode": "0x030200"})),
            0x030200
        );
        assert_eq!(
            class_code(
                &serde_json::json!({"ClassCode": "0x000000", "DeviceClass": "ProcessingAccelerators"})
            ),
            0x120000
        );
        assert_eq!(class_code(&serde_json::json!({"ClassCode": 7})), 0);
        assert_eq!(gen_speed_gts("Gen5"), Some(32.0));
        assert_eq!(gen_speed_gts("Gen7"), None);
    }

    /// The mapping of fields neither capture has (GPU processors, a PCIeInterface on
    /// the device, Arm): a table test of the rules, not a capture.
    #[test]
    fn gpu_processors_links_and_arm() {
        let r = Resources {
            system: serde_json::json!({"MemorySummary": {"TotalSystemMemoryGiB": null}}),
            processors: vec![
                serde_json::json!({"ProcessorType": "CPU", "InstructionSet": "ARM-A64",
                    "TotalCores": 72, "TotalThreads": 72, "Model": "Grace"}),
                serde_json::json!({"@odata.id": "/p/GPU_0", "ProcessorType": "GPU",
                    "Model": "B200", "UUID": "u-0", "FirmwareVersion": "97.00"}),
                serde_json::json!({"ProcessorType": "FPGA", "Model": "HMC"}),
                serde_json::json!({"ProcessorType": "CPU", "Status": {"State": "Absent"}}),
            ],
            memory: vec![
                serde_json::json!({"CapacityMiB": 491520, "MemoryDeviceType": "LPDDR5"}),
                serde_json::json!({"CapacityMiB": 183359, "MemoryType": "HBM3e"}),
            ],
            pcie_devices: vec![serde_json::json!({"@odata.id": "/d/0", "Name": "NIC",
                "PCIeInterface": {"PCIeType": "Gen5", "LanesInUse": 8,
                    "MaxPCIeType": "Gen5", "MaxLanes": 16}})],
            pcie_functions: vec![serde_json::json!({"@odata.id": "/d/0/PCIeFunctions/0",
                "VendorId": "0x15b3", "DeviceId": "0x1021", "ClassCode": "0x020000"})],
            ..Resources::default()
        };
        let inv = from_resources(&r);
        assert_eq!(inv.arch, Some(Arch::Arm64));
        assert_eq!((inv.cpu.sockets, inv.cpu.cores), (1, 72));
        assert_eq!(inv.memory_mib, 491520, "HBM is not system memory");
        assert_eq!(inv.gpus.len(), 1, "GPU processors only, no FPGA");
        assert_eq!(
            (
                inv.gpus[0].model.as_str(),
                inv.gpus[0].uuid.as_str(),
                inv.gpus[0].vbios.as_str()
            ),
            ("B200", "u-0", "97.00")
        );
        let nic = &inv.pci[0];
        assert_eq!(
            nic.link.map(|l| l.to_string()).as_deref(),
            Some("32 GT/s x8")
        );
        assert_eq!(nic.max_link.map(|l| l.width), Some(16));
        assert_eq!((nic.vendor_id, nic.class), (0x15b3, 0x020000));
    }

    #[test]
    fn odd_json_never_panics_and_reports_nothing() {
        let odd = [
            Value::Null,
            serde_json::json!([]),
            serde_json::json!("x"),
            serde_json::json!({"Manufacturer": 5, "MemorySummary": {"TotalSystemMemoryGiB": "lots"},
                "ProcessorSummary": null, "Model": null}),
        ];
        for v in odd {
            let r = Resources {
                system: v.clone(),
                processors: vec![v.clone(), serde_json::json!({"TotalCores": -4})],
                memory: vec![v.clone(), serde_json::json!({"CapacityMiB": "x"})],
                pcie_devices: vec![v.clone(), serde_json::json!({"@odata.id": 3})],
                pcie_functions: vec![
                    v.clone(),
                    serde_json::json!({"@odata.id": "/f", "VendorId": "0x1ffff", "ClassCode": "0xzz"}),
                ],
                ethernet: vec![v.clone(), serde_json::json!({"MACAddress": "nope"})],
                network_ports: vec![v.clone()],
                storage: vec![
                    v.clone(),
                    serde_json::json!({"StorageControllers": [{"PCIeInterface": 1}]}),
                ],
                drives: vec![v.clone()],
                firmware: vec![v.clone(), serde_json::json!({"Name": "x", "Version": 1})],
                chassis: Some(v),
            };
            let inv = from_resources(&r);
            assert!(inv.firmware.is_empty() && inv.nics.is_empty() && inv.disks.is_empty());
            assert_eq!(inv.memory_mib, 0);
        }
    }
}
