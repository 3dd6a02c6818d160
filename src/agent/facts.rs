//! Hardware facts from sysfs and procfs, read under a root directory (`/` on the node, a
//! temp tree in tests). A probe that finds nothing reports 0 or "": facts never fail.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::wire::{AgentFacts, DiskFact, NicFact};

/// Block devices that are never disks to report or deploy to.
const SKIP_BLOCK: &[&str] = &["loop", "ram", "sr", "zram", "dm-", "md", "nbd", "fd"];

/// Everything [`AgentFacts`] holds, read under `root`.
pub fn collect(root: &Path) -> AgentFacts {
    let sys = root.join("sys");
    let cpus = read_trim(&sys.join("devices/system/cpu/online"))
        .and_then(|s| count_cpu_list(&s))
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() as u64)
        })
        .unwrap_or(0);
    let mem_kb = read_trim(&root.join("proc/meminfo"))
        .and_then(|s| mem_total_kb(&s))
        .unwrap_or(0);
    AgentFacts {
        cpus,
        mem_kb,
        machine: machine(),
        product: read_trim(&sys.join("class/dmi/id/product_name")).unwrap_or_default(),
        disks: disks(&sys),
        nics: nics(&sys),
        ..AgentFacts::default()
    }
}

/// `uname -m`.
fn machine() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.machine().to_string_lossy().into_owned())
        .unwrap_or_else(|_| std::env::consts::ARCH.to_string())
}

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// Counts a kernel CPU list (`0-3,6,8-9` → 7).
fn count_cpu_list(s: &str) -> Option<u64> {
    let mut n = 0;
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<u64>().ok()?.checked_sub(a.parse().ok()?)? + 1,
            None => part.parse::<u64>().map(|_| 1).ok()?,
        };
    }
    (n > 0).then_some(n)
}

fn mem_total_kb(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Directory entry names under `dir`, sorted; empty when `dir` is missing.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Disks under `<sys>/block`, by name; loops, ramdisks, optical drives and mapped devices
/// are left out.
pub fn disks(sys: &Path) -> Vec<DiskFact> {
    let block = sys.join("block");
    names(&block)
        .into_iter()
        .filter(|n| !SKIP_BLOCK.iter().any(|p| n.starts_with(p)))
        .map(|name| {
            let d = block.join(&name);
            let sectors: u64 = read_trim(&d.join("size"))
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            DiskFact {
                size: sectors * 512,
                model: read_trim(&d.join("device/model")).unwrap_or_default(),
                serial: read_trim(&d.join("device/serial"))
                    .or_else(|| read_trim(&d.join("serial")))
                    .unwrap_or_default(),
                removable: read_trim(&d.join("removable")).as_deref() == Some("1"),
                name,
            }
        })
        .collect()
}

/// Partitions of `disk` (`vda1`, `nvme0n1p2`): the entries of `<sys>/block/<disk>` that
/// have a `partition` file.
pub fn partitions(sys: &Path, disk: &str) -> Vec<String> {
    let d = sys.join("block").join(disk);
    names(&d)
        .into_iter()
        .filter(|n| d.join(n).join("partition").is_file())
        .collect()
}

/// Network interfaces under `<sys>/class/net` except `lo` and non-Ethernet links
/// (`type` other than 1: sit, tunnels).
pub fn nics(sys: &Path) -> Vec<NicFact> {
    let net = sys.join("class/net");
    names(&net)
        .into_iter()
        .filter(|n| n != "lo")
        .filter(|n| read_trim(&net.join(n).join("type")).is_none_or(|t| t == "1"))
        .map(|name| {
            let d = net.join(&name);
            NicFact {
                mac: read_trim(&d.join("address")).unwrap_or_default(),
                driver: fs::read_link(d.join("device/driver"))
                    .ok()
                    .and_then(|l| l.file_name().map(|f| f.to_string_lossy().into_owned()))
                    .unwrap_or_default(),
                // Reading `carrier` of a down link fails (EINVAL): no carrier.
                carrier: read_trim(&d.join("carrier")).as_deref() == Some("1"),
                name,
            }
        })
        .collect()
}

/// The machine's [`Inventory`](crate::inventory::Inventory) as the deploy agent sees
/// it from sysfs and procfs under `root`: system identity and BIOS version (DMI),
/// CPU sockets/cores/threads (topology), NUMA nodes, memory, every PCI function with
/// its link, NICs with speed, PCI address and NUMA node, disks. What the kernel does
/// not expose stays empty.
///
/// Under the real root (`/`) the running kernel and network are asked too: GPUs through
/// `nvidia-smi` when it is on `PATH` (see [`nvidia`]), each NIC's driver and firmware
/// through the ethtool ioctl (see [`nic_drivers`]), and each NIC with a link listens
/// for an LLDP neighbour for [`super::lldp::WINDOW`] (all at once). Another root is a
/// captured tree, where asking the host would describe the wrong machine.
pub fn inventory(root: &Path) -> crate::inventory::Inventory {
    let mut inv = sysfs_inventory(root);
    if root == Path::new("/") {
        nvidia(&mut inv, NVIDIA_SMI_TIMEOUT);
        nic_drivers(&mut inv);
        nic_neighbors(&mut inv, super::lldp::WINDOW);
    }
    inv
}

/// Fills each NIC's firmware version (and its driver where sysfs had none: virtual
/// NICs without a `device/driver` link) from ETHTOOL_GDRVINFO, and records the
/// firmware as `nic:<mac>` in the inventory's firmware map so a change shows in the
/// diff. A NIC the ioctl fails on keeps what sysfs said.
pub fn nic_drivers(inv: &mut crate::inventory::Inventory) {
    for nic in &mut inv.nics {
        let info = match ethtool_drvinfo(&nic.name) {
            Ok(info) => info,
            Err(e) => {
                eprintln!("pxed-agent: ethtool {}: {e}", nic.name);
                continue;
            }
        };
        if nic.driver.is_empty() {
            nic.driver = info.driver;
        }
        // Drivers without firmware say "" or "N/A".
        if !info.firmware.is_empty() && info.firmware != "N/A" {
            nic.firmware = info.firmware;
            if !nic.mac.is_empty() {
                inv.firmware
                    .insert(format!("nic:{}", nic.mac), nic.firmware.clone());
            }
        }
    }
}

/// Listens for LLDP on every NIC whose link is up, for `window` in total, and puts
/// what was heard into the NICs' `lldp`.
pub fn nic_neighbors(inv: &mut crate::inventory::Inventory, window: Duration) {
    let up: Vec<String> = inv
        .nics
        .iter()
        .filter(|n| n.link_up)
        .map(|n| n.name.clone())
        .collect();
    if up.is_empty() {
        return;
    }
    let mut heard = super::lldp::listen(&up, window);
    for nic in &mut inv.nics {
        if let Some(n) = heard.remove(&nic.name) {
            nic.lldp = Some(n);
        }
    }
}

/// What ETHTOOL_GDRVINFO says about a NIC.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrvInfo {
    pub driver: String,
    pub version: String,
    pub firmware: String,
    pub bus_info: String,
}

/// `struct ethtool_drvinfo` from `<linux/ethtool.h>` (libc does not carry it).
#[repr(C)]
struct EthtoolDrvinfo {
    cmd: u32,
    driver: [u8; 32],
    version: [u8; 32],
    fw_version: [u8; 32],
    bus_info: [u8; 32],
    erom_version: [u8; 32],
    reserved2: [u8; 12],
    n_priv_flags: u32,
    n_stats: u32,
    testinfo_len: u32,
    eedump_len: u32,
    regdump_len: u32,
}

const ETHTOOL_GDRVINFO: u32 = 0x0000_0003;

nix::ioctl_readwrite_bad!(siocethtool, libc::SIOCETHTOOL, libc::ifreq);

/// Driver, version, firmware and bus of `nic` through the SIOCETHTOOL ioctl on a
/// datagram socket (no privilege needed). Hand-written over nix's ioctl macro: the
/// `ethtool` crate speaks the generic-netlink family on an async runtime, a lot of
/// machinery for one fixed-size struct that every kernel answers.
pub fn ethtool_drvinfo(nic: &str) -> std::io::Result<DrvInfo> {
    use std::os::fd::AsRawFd;
    let name = nic.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let sock =
        std::net::UdpSocket::bind("0.0.0.0:0").or_else(|_| std::net::UdpSocket::bind("[::]:0"))?;
    let mut info = EthtoolDrvinfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        version: [0; 32],
        fw_version: [0; 32],
        bus_info: [0; 32],
        erom_version: [0; 32],
        reserved2: [0; 12],
        n_priv_flags: 0,
        n_stats: 0,
        testinfo_len: 0,
        eedump_len: 0,
        regdump_len: 0,
    };
    // SAFETY: ifreq is plain data (a name and a union of plain data); all-zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    req.ifr_ifru.ifru_data = (&raw mut info).cast();
    // SAFETY: `req` names the NIC (NUL-terminated: zeroed, name shorter than IFNAMSIZ)
    // and points at `info`, which outlives the call and has the kernel's layout.
    unsafe { siocethtool(sock.as_raw_fd(), &raw mut req) }.map_err(std::io::Error::from)?;
    let text = |b: &[u8]| {
        let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).trim().to_string()
    };
    Ok(DrvInfo {
        driver: text(&info.driver),
        version: text(&info.version),
        firmware: text(&info.fw_version),
        bus_info: text(&info.bus_info),
    })
}

/// How long each `nvidia-smi` call may take before it is killed: a wedged GPU makes it
/// hang, and the inventory must never hold up a deploy.
pub const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(5);

/// Adds what `nvidia-smi -q -x` and `nvidia-smi topo -m` say, when `nvidia-smi` is on
/// `PATH`; each call is killed after `timeout`. A missing tool, a failed or slow call
/// or unreadable output leaves the inventory as sysfs gave it (and says so on stderr).
pub fn nvidia(inv: &mut crate::inventory::Inventory, timeout: Duration) {
    use crate::inventory::nvidia as nv;
    let Some(tool) = on_path("nvidia-smi") else {
        return;
    };
    let smi = run_with_timeout(&tool, &["-q", "-x"], timeout).and_then(|xml| {
        nv::parse_smi(&xml)
            .map_err(|e| eprintln!("pxed-agent: {e}"))
            .ok()
    });
    let topo = run_with_timeout(&tool, &["topo", "-m"], timeout).and_then(|text| {
        nv::parse_topo(&text)
            .map_err(|e| eprintln!("pxed-agent: {e}"))
            .ok()
    });
    nv::merge(inv, smi.as_ref(), topo.as_ref());
}

/// The first executable `name` in the directories of `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Runs `cmd args`, killing it after `timeout`; its stdout when it exits 0 in time.
/// Stdout is drained on a thread so a large report cannot block the child on a full
/// pipe while we wait.
fn run_with_timeout(cmd: &Path, args: &[&str], timeout: Duration) -> Option<String> {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| eprintln!("pxed-agent: {}: {e}", cmd.display()))
        .ok()?;
    let mut stdout = child.stdout.take()?;
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).map(|_| out)
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) | Err(_) => {
                eprintln!(
                    "pxed-agent: {} {} gave no answer within {timeout:?}; killed",
                    cmd.display(),
                    args.join(" ")
                );
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    };
    let out = reader.join().ok()?.ok()?;
    if !status.success() {
        eprintln!("pxed-agent: {} {}: {status}", cmd.display(), args.join(" "));
        return None;
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// [`inventory`] from sysfs and procfs alone.
pub fn sysfs_inventory(root: &Path) -> crate::inventory::Inventory {
    use crate::inventory::{Cpu, Disk, Inventory, Nic, System};
    let sys = root.join("sys");
    let facts = collect(root);
    let dmi = |f: &str| read_trim(&sys.join("class/dmi/id").join(f)).unwrap_or_default();
    let cpu_dir = sys.join("devices/system/cpu");
    let mut packages = std::collections::BTreeSet::new();
    let mut cores = std::collections::BTreeSet::new();
    let mut threads = 0;
    for n in names(&cpu_dir).into_iter().filter(|n| {
        n.strip_prefix("cpu")
            .is_some_and(|i| i.parse::<u32>().is_ok())
    }) {
        let topo = cpu_dir.join(&n).join("topology");
        let Some(pkg) = read_trim(&topo.join("physical_package_id")) else {
            continue;
        };
        let core = read_trim(&topo.join("core_id")).unwrap_or_default();
        threads += 1;
        cores.insert((pkg.clone(), core));
        packages.insert(pkg);
    }
    let model = read_trim(&root.join("proc/cpuinfo"))
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let numa_nodes = names(&sys.join("devices/system/node"))
        .iter()
        .filter(|n| {
            n.strip_prefix("node")
                .is_some_and(|i| i.parse::<u32>().is_ok())
        })
        .count() as u32;
    let net = sys.join("class/net");
    let nics = facts
        .nics
        .iter()
        .map(|n| {
            let d = net.join(&n.name);
            Nic {
                name: n.name.clone(),
                mac: n.mac.clone(),
                driver: n.driver.clone(),
                firmware: String::new(),
                // -1 or unreadable when the link is down.
                speed_mbps: read_trim(&d.join("speed"))
                    .and_then(|s| s.parse::<u64>().ok())
                    .filter(|s| *s > 0),
                link_up: n.carrier,
                pci_address: fs::read_link(d.join("device"))
                    .ok()
                    .and_then(|l| l.file_name().map(|f| f.to_string_lossy().into_owned()))
                    .filter(|a| a.contains(':'))
                    .unwrap_or_default(),
                numa_node: read_trim(&d.join("device/numa_node"))
                    .and_then(|s| s.parse::<u32>().ok()),
                lldp: None,
            }
        })
        .collect();
    let mut firmware = std::collections::BTreeMap::new();
    let bios = dmi("bios_version");
    if !bios.is_empty() {
        firmware.insert("bios".to_string(), bios);
    }
    Inventory {
        arch: crate::model::Arch::parse(&facts.machine),
        system: System {
            vendor: dmi("sys_vendor"),
            model: facts.product.clone(),
            serial: dmi("product_serial"),
        },
        cpu: Cpu {
            model,
            sockets: packages.len() as u32,
            cores: cores.len() as u32,
            threads,
        },
        numa_nodes,
        memory_mib: facts.mem_kb / 1024,
        pci: pci(&sys),
        gpus: Vec::new(),
        nics,
        disks: facts
            .disks
            .iter()
            .filter(|d| !d.removable)
            .map(|d| Disk {
                name: d.name.clone(),
                model: d.model.clone(),
                serial: d.serial.clone(),
                size_bytes: d.size,
            })
            .collect(),
        firmware,
    }
}

/// Every PCI function under `<sys>/bus/pci/devices`: IDs, class, NUMA node, and the
/// PCIe link as trained and at most (`current_link_*`, `max_link_*`; absent on
/// conventional PCI). Names are left empty: the deploy ramdisk carries no PCI ID
/// database, and rules match the numeric IDs too (`[10de:2330]`).
pub fn pci(sys: &Path) -> Vec<crate::inventory::PciDevice> {
    let dir = sys.join("bus/pci/devices");
    let hex = |d: &Path, f: &str| {
        read_trim(&d.join(f)).and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
    };
    names(&dir)
        .into_iter()
        .map(|address| {
            let d = dir.join(&address);
            let id = |f: &str| hex(&d, f).and_then(|v| u16::try_from(v).ok()).unwrap_or(0);
            crate::inventory::PciDevice {
                class: hex(&d, "class").unwrap_or(0),
                vendor_id: id("vendor"),
                device_id: id("device"),
                subsystem_vendor_id: id("subsystem_vendor"),
                subsystem_device_id: id("subsystem_device"),
                // -1: the platform has no NUMA information for the device.
                numa_node: read_trim(&d.join("numa_node")).and_then(|s| s.parse::<u32>().ok()),
                link: link(&d, "current"),
                max_link: link(&d, "max"),
                revision: hex(&d, "revision").and_then(|v| u8::try_from(v).ok()),
                address,
                ..Default::default()
            }
        })
        .collect()
}

/// `<dev>/{current,max}_link_{speed,width}`: `16.0 GT/s PCIe` and `16`. A link that is
/// down or unknown (`Unknown`, width 0) is `None`.
fn link(dev: &Path, which: &str) -> Option<crate::inventory::Link> {
    let speed = read_trim(&dev.join(format!("{which}_link_speed")))?;
    let width: u32 = read_trim(&dev.join(format!("{which}_link_width")))?
        .parse()
        .ok()?;
    let speed_gts: f32 = speed.split_whitespace().next()?.parse().ok()?;
    (width > 0 && speed_gts > 0.0).then_some(crate::inventory::Link { speed_gts, width })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    #[test]
    fn cpu_lists_and_meminfo() {
        assert_eq!(count_cpu_list("0-3,6,8-9\n"), Some(7));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("x"), None);
        assert_eq!(
            mem_total_kb("MemTotal:        2030104 kB\nMemFree: 1 kB\n"),
            Some(2030104)
        );
        assert_eq!(mem_total_kb("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn collects_from_a_sysfs_tree() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        put(r, "sys/devices/system/cpu/online", "0-3\n");
        put(r, "proc/meminfo", "MemTotal:        4000000 kB\n");
        put(
            r,
            "sys/class/dmi/id/product_name",
            "Standard PC (Q35 + ICH9, 2009)\n",
        );
        put(r, "sys/block/vda/size", "41943040\n");
        put(r, "sys/block/vda/removable", "0\n");
        put(r, "sys/block/vda/serial", "disk-a\n");
        put(r, "sys/block/vda/vda1/partition", "1\n");
        put(r, "sys/block/vda/vda2/partition", "2\n");
        put(r, "sys/block/nvme0n1/size", "2048\n");
        put(r, "sys/block/nvme0n1/removable", "0\n");
        put(r, "sys/block/nvme0n1/device/model", "QEMU NVMe Ctrl  \n");
        put(r, "sys/block/nvme0n1/device/serial", "nv1\n");
        put(r, "sys/block/sr0/size", "100\n");
        put(r, "sys/block/loop0/size", "100\n");
        put(r, "sys/block/zram0/size", "100\n");
        put(r, "sys/block/sdb/size", "100\n");
        put(r, "sys/block/sdb/removable", "1\n");
        put(r, "sys/class/net/lo/address", "00:00:00:00:00:00\n");
        put(r, "sys/class/net/eth0/address", "52:54:00:12:34:56\n");
        put(r, "sys/class/net/eth0/type", "1\n");
        put(r, "sys/class/net/eth0/carrier", "1\n");
        put(r, "sys/bus/virtio/drivers/virtio_net/bind", "");
        fs::create_dir_all(r.join("sys/class/net/eth0/device")).unwrap();
        std::os::unix::fs::symlink(
            r.join("sys/bus/virtio/drivers/virtio_net"),
            r.join("sys/class/net/eth0/device/driver"),
        )
        .unwrap();
        put(r, "sys/class/net/eth1/address", "52:54:00:00:00:02\n");
        put(r, "sys/class/net/sit0/type", "776\n");

        let f = collect(r);
        assert_eq!(f.cpus, 4);
        assert_eq!(f.mem_kb, 4_000_000);
        assert_eq!(f.product, "Standard PC (Q35 + ICH9, 2009)");
        assert!(!f.machine.is_empty());
        let want_disks = vec![
            DiskFact {
                name: "nvme0n1".into(),
                size: 2048 * 512,
                model: "QEMU NVMe Ctrl".into(),
                serial: "nv1".into(),
                removable: false,
            },
            DiskFact {
                name: "sdb".into(),
                size: 100 * 512,
                removable: true,
                ..Default::default()
            },
            DiskFact {
                name: "vda".into(),
                size: 41943040 * 512,
                serial: "disk-a".into(),
                ..Default::default()
            },
        ];
        assert_eq!(f.disks, want_disks);
        assert_eq!(
            f.nics,
            vec![
                NicFact {
                    name: "eth0".into(),
                    mac: "52:54:00:12:34:56".into(),
                    driver: "virtio_net".into(),
                    carrier: true,
                },
                NicFact {
                    name: "eth1".into(),
                    mac: "52:54:00:00:00:02".into(),
                    ..Default::default()
                },
            ]
        );
        assert_eq!(partitions(&r.join("sys"), "vda"), vec!["vda1", "vda2"]);
        assert!(partitions(&r.join("sys"), "nvme0n1").is_empty());
    }

    #[test]
    fn empty_root_reports_zeros_not_errors() {
        let t = tempfile::tempdir().unwrap();
        let f = collect(t.path());
        assert_eq!(f.mem_kb, 0);
        assert!(f.disks.is_empty() && f.nics.is_empty());
    }

    #[test]
    fn pci_functions_and_links_from_sysfs() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        let gpu = "sys/bus/pci/devices/0000:18:00.0";
        put(r, &format!("{gpu}/class"), "0x030200\n");
        put(r, &format!("{gpu}/vendor"), "0x10de\n");
        put(r, &format!("{gpu}/device"), "0x2330\n");
        put(r, &format!("{gpu}/subsystem_vendor"), "0x10de\n");
        put(r, &format!("{gpu}/subsystem_device"), "0x16c1\n");
        put(r, &format!("{gpu}/numa_node"), "1\n");
        put(r, &format!("{gpu}/current_link_speed"), "32.0 GT/s PCIe\n");
        put(r, &format!("{gpu}/current_link_width"), "4\n");
        put(r, &format!("{gpu}/max_link_speed"), "32.0 GT/s PCIe\n");
        put(r, &format!("{gpu}/max_link_width"), "16\n");
        let bridge = "sys/bus/pci/devices/0000:00:00.0";
        put(r, &format!("{bridge}/class"), "0x060000\n");
        put(r, &format!("{bridge}/vendor"), "0x8086\n");
        put(r, &format!("{bridge}/device"), "0x29c0\n");
        put(r, &format!("{bridge}/numa_node"), "-1\n");
        put(r, &format!("{bridge}/current_link_speed"), "Unknown\n");
        put(r, &format!("{bridge}/current_link_width"), "0\n");
        let v = pci(&r.join("sys"));
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].address, "0000:00:00.0");
        assert_eq!((v[0].numa_node, v[0].link), (None, None));
        let g = &v[1];
        assert_eq!(
            (g.class, g.vendor_id, g.device_id),
            (0x030200, 0x10de, 0x2330)
        );
        assert_eq!(g.subsystem_device_id, 0x16c1);
        assert_eq!(g.numa_node, Some(1));
        assert_eq!(g.link.unwrap().to_string(), "32 GT/s x4");
        assert_eq!(g.max_link.unwrap().width, 16);
        assert!(g.is_accelerator() && !v[0].is_accelerator());
    }

    /// Unpacks a ttar archive (prometheus/procfs's text format for sysfs trees:
    /// `Directory:`, `Path:` with `Lines:` or `SymlinkTo:`, `Mode:`; `#` lines between
    /// entries) under `root`, dropping the archive's leading `fixtures/`.
    fn untar_ttar(text: &str, root: &Path) {
        let mut lines = text.lines();
        let rel = |p: &str| root.join(p.strip_prefix("fixtures/").unwrap_or(p));
        while let Some(line) = lines.next() {
            if let Some(d) = line.strip_prefix("Directory: ") {
                fs::create_dir_all(rel(d)).unwrap();
            } else if let Some(p) = line.strip_prefix("Path: ") {
                let path = rel(p);
                fs::create_dir_all(path.parent().unwrap()).unwrap();
                let next = lines.next().unwrap();
                if let Some(target) = next.strip_prefix("SymlinkTo: ") {
                    std::os::unix::fs::symlink(target, &path).unwrap();
                } else {
                    let n: usize = next.strip_prefix("Lines: ").unwrap().parse().unwrap();
                    let mut content = String::new();
                    for l in lines.by_ref().take(n) {
                        // `EOF` marks a last line without a newline.
                        match l.strip_suffix("EOF") {
                            Some(l) => content.push_str(l),
                            None => {
                                content.push_str(l);
                                content.push('\n');
                            }
                        }
                    }
                    fs::write(&path, content.replace("NULLBYTE", "\0")).unwrap();
                }
            }
        }
    }

    #[test]
    fn pci_from_a_real_sysfs_tree() {
        let text = fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sysfs/procfs-pci.ttar"
        ))
        .unwrap();
        let t = tempfile::tempdir().unwrap();
        untar_ttar(&text, t.path());
        let v = pci(&t.path().join("sys"));
        let addrs: Vec<&str> = v.iter().map(|d| d.address.as_str()).collect();
        assert_eq!(addrs, ["0000:00:02.1", "0000:01:00.0", "0000:a2:00.0"]);
        // An AMD root port whose link trained at x4 of x8: what a width gate catches.
        let port = &v[0];
        assert_eq!(
            (port.class, port.vendor_id, port.device_id),
            (0x060400, 0x1022, 0x1634)
        );
        assert_eq!(port.link.unwrap().to_string(), "8 GT/s x4");
        assert_eq!(port.max_link.unwrap().width, 8);
        assert_eq!(port.numa_node, None, "numa_node -1 is no node");
        assert_eq!(port.revision, Some(0));
        // The NVMe drive behind it.
        let nvme = &v[1];
        assert_eq!(
            (nvme.class, nvme.vendor_id, nvme.device_id),
            (0x010802, 0xc0a9, 0x540a)
        );
        assert_eq!(
            (nvme.subsystem_vendor_id, nvme.subsystem_device_id),
            (0xc0a9, 0x5021)
        );
        assert_eq!(nvme.link, nvme.max_link);
        assert_eq!(nvme.revision, Some(1));
        // An Intel E810 on the second socket.
        let nic = &v[2];
        assert_eq!(
            (nic.class, nic.vendor_id, nic.device_id),
            (0x020000, 0x8086, 0x159b)
        );
        assert_eq!(nic.numa_node, Some(1));
        assert_eq!(nic.link.unwrap().to_string(), "16 GT/s x8");
        assert_eq!(nic.revision, Some(2));
        assert!(!v.iter().any(|d| d.is_accelerator()));
    }

    #[test]
    fn slow_or_failing_tools_are_cut_off() {
        let sh = Path::new("/bin/sh");
        assert_eq!(
            run_with_timeout(sh, &["-c", "echo topo"], Duration::from_secs(5)).as_deref(),
            Some("topo\n")
        );
        assert_eq!(
            run_with_timeout(sh, &["-c", "echo x; exit 3"], Duration::from_secs(5)),
            None
        );
        let start = Instant::now();
        assert_eq!(
            run_with_timeout(sh, &["-c", "sleep 30"], Duration::from_millis(200)),
            None
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        // More than a pipe buffer of output does not wedge the wait.
        let big = run_with_timeout(
            sh,
            &["-c", "head -c 1000000 /dev/zero | tr '\\0' a"],
            Duration::from_secs(10),
        );
        assert_eq!(big.map(|s| s.len()), Some(1_000_000));
        assert_eq!(
            run_with_timeout(
                Path::new("/nonexistent/nvidia-smi"),
                &[],
                Duration::from_secs(1)
            ),
            None
        );
    }

    #[test]
    fn a_captured_root_does_not_run_the_hosts_tools() {
        // The test host may well have nvidia-smi; a tree under a temp root must not
        // pick up its GPUs.
        let t = tempfile::tempdir().unwrap();
        assert!(inventory(t.path()).gpus.is_empty());
        assert_eq!(on_path("surely-not-a-command-pxed"), None);
        assert!(on_path("sh").is_some());
    }
}
