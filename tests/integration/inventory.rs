//! Inventory collection against a real peer: what the deploy agent reads from this
//! machine's sysfs agrees with pciutils' `lspci -vmm -nn -D` on the same machine.

use std::collections::BTreeMap;
use std::process::Command;

use crate::common::{need, pxed_bin, run};

/// `pxed agent inventory`: what the deploy agent reports for this machine.
fn agent_inventory() -> serde_json::Value {
    let (ok, out, err) = run(Command::new(pxed_bin()).args(["agent", "inventory"]));
    assert!(ok, "pxed agent inventory: {err}");
    serde_json::from_str(&out).unwrap()
}

/// `lspci -vmm -nn -D` records by slot: field name to the `[hex]` at the end of its
/// value (`Class: 3D controller [0302]` → `0302`), or the whole value without one.
fn lspci() -> BTreeMap<String, BTreeMap<String, String>> {
    need("lspci");
    let (ok, out, err) = run(Command::new("lspci").args(["-vmm", "-nn", "-D"]));
    assert!(ok, "lspci: {err}");
    let mut all = BTreeMap::new();
    for rec in out.split("\n\n").filter(|r| !r.trim().is_empty()) {
        let mut f = BTreeMap::new();
        for line in rec.lines() {
            let Some((k, v)) = line.split_once(":\t") else {
                continue;
            };
            let v = v.trim();
            let id = v
                .rsplit_once('[')
                .and_then(|(_, t)| t.strip_suffix(']'))
                .unwrap_or(v);
            f.insert(k.to_string(), id.to_string());
        }
        all.insert(f["Slot"].clone(), f);
    }
    all
}

#[test]
fn sysfs_pci_agrees_with_lspci() {
    let want = lspci();
    let inv: pxed::inventory::Inventory = serde_json::from_value(agent_inventory()).unwrap();
    let got = &inv.pci;
    assert!(!got.is_empty(), "no PCI functions in /sys");
    assert_eq!(
        got.iter().map(|d| d.address.clone()).collect::<Vec<_>>(),
        want.keys().cloned().collect::<Vec<_>>()
    );
    for d in got {
        let l = &want[&d.address];
        let hex = |k: &str| u32::from_str_radix(&l[k], 16).unwrap();
        assert_eq!(d.class >> 8, hex("Class"), "{}", d.address);
        assert_eq!(u32::from(d.vendor_id), hex("Vendor"), "{}", d.address);
        assert_eq!(u32::from(d.device_id), hex("Device"), "{}", d.address);
        assert_eq!(d.class & 0xff, hex("ProgIf"), "{}", d.address);
        if l.contains_key("SVendor") {
            assert_eq!(
                u32::from(d.subsystem_vendor_id),
                hex("SVendor"),
                "{}",
                d.address
            );
            assert_eq!(
                u32::from(d.subsystem_device_id),
                hex("SDevice"),
                "{}",
                d.address
            );
        }
        if let Some(n) = l.get("NUMANode") {
            assert_eq!(d.numa_node, n.parse().ok(), "{}", d.address);
        }
    }
}

/// The rest of the inventory against the kernel's own tools: memory against `free`,
/// CPU threads against `nproc`, NUMA nodes against sysfs, NIC MACs against `ip`.
#[test]
fn the_agents_inventory_agrees_with_the_systems_tools() {
    let inv: pxed::inventory::Inventory = serde_json::from_value(agent_inventory()).unwrap();
    let (_, nproc, _) = run(Command::new("nproc").arg("--all"));
    assert_eq!(inv.cpu.threads.to_string(), nproc.trim());
    assert!(inv.cpu.cores >= 1 && inv.cpu.sockets >= 1, "{:?}", inv.cpu);
    let (_, free, _) = run(Command::new("free").arg("-m"));
    let total: u64 = free
        .lines()
        .find(|l| l.starts_with("Mem:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(
        inv.memory_mib.abs_diff(total) <= 1,
        "{} vs free {total}",
        inv.memory_mib
    );
    assert!(inv.numa_nodes >= 1);
    let (_, links, _) = run(Command::new("ip").args(["-o", "link", "show"]));
    for n in &inv.nics {
        assert!(
            links.contains(&n.mac),
            "{} {} not in ip link:\n{links}",
            n.name,
            n.mac
        );
    }
    assert_eq!(inv.arch, pxed::model::Arch::parse(std::env::consts::ARCH));
}
