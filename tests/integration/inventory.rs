//! Inventory collection against a real peer: what the deploy agent reads from this
//! machine's sysfs agrees with pciutils' `lspci -vmm -nn -D` on the same machine.

use std::process::Command;

use crate::common::{need, pxed_bin, run};

/// `pxed agent inventory`: what the deploy agent reports for this machine.
fn agent_inventory() -> serde_json::Value {
    let (ok, out, err) = run(Command::new(pxed_bin()).args(["agent", "inventory"]));
    assert!(ok, "pxed agent inventory: {err}");
    serde_json::from_str(&out).unwrap()
}

/// `lspci -vmm -nn -D` on this machine, read by pxed's own lspci parser (the one the
/// server uses for an installer node's report).
fn lspci() -> Vec<pxed::inventory::PciDevice> {
    need("lspci");
    let (ok, out, err) = run(Command::new("lspci").args(["-vmm", "-nn", "-D"]));
    assert!(ok, "lspci: {err}");
    pxed::inventory::lspci::parse(&out).unwrap()
}

#[test]
fn sysfs_pci_agrees_with_lspci() {
    let want = lspci();
    let inv: pxed::inventory::Inventory = serde_json::from_value(agent_inventory()).unwrap();
    let got = &inv.pci;
    assert!(!got.is_empty(), "no PCI functions in /sys");
    let mut want_addrs: Vec<String> = want.iter().map(|d| d.address.clone()).collect();
    want_addrs.sort();
    assert_eq!(
        got.iter().map(|d| d.address.clone()).collect::<Vec<_>>(),
        want_addrs
    );
    for d in got {
        let l = want.iter().find(|l| l.address == d.address).unwrap();
        let ids = |d: &pxed::inventory::PciDevice| {
            (
                d.class,
                d.vendor_id,
                d.device_id,
                d.subsystem_vendor_id,
                d.subsystem_device_id,
            )
        };
        assert_eq!(ids(d), ids(l), "{}", d.address);
        // lspci leaves out Rev 00 and NUMANode where the platform has none.
        if l.revision.is_some() {
            assert_eq!(d.revision, l.revision, "{}", d.address);
        }
        if l.numa_node.is_some() {
            assert_eq!(d.numa_node, l.numa_node, "{}", d.address);
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
