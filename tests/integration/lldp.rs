//! LLDP against a real peer: lldpd sends on one end of a veth pair from its own
//! namespace, and the deploy agent's inventory, run in the other namespace, reports
//! lldpd's system name and port on that NIC (and the NIC's driver through ethtool).

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::{need, pxed_bin, run, wait_for};
use crate::netns::Netns;

/// The deploy agent's LLDP window (`pxed::agent::lldp::WINDOW`, crate-private).
const WINDOW: Duration = Duration::from_secs(2);
use pxed::inventory::Inventory;

/// `lldpd -d` in a namespace; stopped with SIGTERM (which also stops its privsep
/// child) on drop.
struct Lldpd {
    child: Child,
    ctl: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Lldpd {
    /// lldpd sending every second on `iface` only, as `hostname`, with the port ID
    /// being the interface name.
    fn start(ns: &Netns, iface: &str, hostname: &str) -> Lldpd {
        need("lldpd");
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("lldpd.conf");
        std::fs::write(
            &conf,
            format!(
                "configure system hostname {hostname}\n\
                 configure lldp tx-interval 1\n\
                 configure lldp portidsubtype ifname\n"
            ),
        )
        .unwrap();
        let ctl = dir.path().join("lldpd.socket");
        let child = ns
            .std_command("lldpd")
            .arg("-d")
            .arg("-u")
            .arg(&ctl)
            .arg("-p")
            .arg(dir.path().join("lldpd.pid"))
            .arg("-O")
            .arg(&conf)
            .args(["-I", iface])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start lldpd");
        Lldpd {
            child,
            ctl,
            _dir: dir,
        }
    }
}

impl Drop for Lldpd {
    fn drop(&mut self) {
        // `ip netns exec` execs lldpd, so the child's pid is lldpd's monitor.
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

/// `pxed agent inventory` run inside `ns` (`ip netns exec` mounts the namespace's own
/// /sys, so the agent sees the namespace's NICs as the real root's), and how long it
/// took.
fn inventory_in(ns: &Netns) -> (Inventory, Duration) {
    let started = Instant::now();
    let (ok, out, err) = run(ns.std_command(pxed_bin()).args(["agent", "inventory"]));
    let took = started.elapsed();
    assert!(ok, "pxed agent inventory: {err}");
    (serde_json::from_str(&out).unwrap(), took)
}

#[test]
fn agent_inventory_reports_lldpds_system_name_and_port() {
    let switch = Netns::new("lldpsw");
    let node = Netns::new("lldpnode");
    node.ip(&[
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        "swp7",
        "netns",
        switch.name(),
    ]);
    node.ip(&["link", "set", "eth0", "up"]);
    switch.ip(&["link", "set", "swp7", "up"]);
    let switch_mac = switch.mac("swp7");
    let lldpd = Lldpd::start(&switch, "swp7", "pxed-test-switch");
    // lldpd is up and has applied its configuration once lldpcli shows the name.
    wait_for(
        "lldpd to take its configuration",
        Duration::from_secs(15),
        || {
            let (ok, out, _) = run(switch
                .std_command("lldpcli")
                .arg("-u")
                .arg(&lldpd.ctl)
                .args(["show", "chassis"]));
            (ok && out.contains("pxed-test-switch")).then_some(())
        },
    );

    let (inv, took) = inventory_in(&node);
    let nic = inv
        .nics
        .iter()
        .find(|n| n.name == "eth0")
        .unwrap_or_else(|| panic!("no eth0 in {:?}", inv.nics));
    // sysfs has no driver link for a veth: the name came from ETHTOOL_GDRVINFO.
    assert_eq!(nic.driver, "veth");
    let n = nic
        .lldp
        .as_ref()
        .unwrap_or_else(|| panic!("no LLDP neighbour on eth0 within {WINDOW:?}"));
    assert_eq!(n.system_name.as_deref(), Some("pxed-test-switch"));
    assert_eq!(n.port_id, "swp7");
    assert_eq!(n.port_description.as_deref(), Some("swp7"));
    assert_eq!(n.chassis_id, switch_mac);
    assert!(n.ttl_secs > 0);
    // Every up NIC heard its neighbour, so the agent stopped listening early.
    eprintln!("inventory with an LLDP neighbour took {took:?}");
    assert!(took < WINDOW + Duration::from_secs(3), "{took:?}");
}

#[test]
fn listening_without_a_neighbour_costs_the_window_once() {
    // The same machine twice: its NICs down (nothing to listen on), then up with no
    // LLDP sender behind them. The difference is what LLDP adds to collection.
    let node = Netns::new("lldpquiet");
    node.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
    ]);
    let (down, baseline) = inventory_in(&node);
    assert!(down.nics.iter().all(|n| !n.link_up), "{:?}", down.nics);
    node.ip(&["link", "set", "eth0", "up"]);
    node.ip(&["link", "set", "eth1", "up"]);
    wait_for("carrier on both veths", Duration::from_secs(5), || {
        let out = node.ip(&["-o", "link", "show", "up"]);
        (out.matches("LOWER_UP").count() >= 2).then_some(())
    });
    let (up, quiet) = inventory_in(&node);
    assert_eq!(
        up.nics.iter().filter(|n| n.link_up).count(),
        2,
        "{:?}",
        up.nics
    );
    assert!(up.nics.iter().all(|n| n.lldp.is_none()), "{:?}", up.nics);
    let extra = quiet.saturating_sub(baseline);
    eprintln!("inventory: {baseline:?} without up NICs, {quiet:?} with 2 quiet up NICs");
    // Two NICs, one window: the wait is not per NIC.
    assert!(quiet >= WINDOW, "{quiet:?}");
    assert!(extra < WINDOW + Duration::from_secs(1), "{extra:?}");
}

/// The firmware (and, where sysfs has no driver link, the driver) the agent reads with
/// ETHTOOL_GDRVINFO agrees with `ethtool -i` for every NIC of this machine.
#[test]
fn nic_driver_and_firmware_agree_with_ethtool() {
    need("ethtool");
    let (ok, out, err) = run(std::process::Command::new(pxed_bin()).args(["agent", "inventory"]));
    assert!(ok, "pxed agent inventory: {err}");
    let inv: Inventory = serde_json::from_str(&out).unwrap();
    assert!(!inv.nics.is_empty(), "no NICs");
    for nic in &inv.nics {
        let (ok, out, err) = run(std::process::Command::new("ethtool").args(["-i", &nic.name]));
        if !ok {
            // No ethtool driver info (some virtual links): the agent left it empty.
            assert_eq!(nic.firmware, "", "{}: {err}", nic.name);
            continue;
        }
        let field = |k: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        let firmware = field("firmware-version:");
        let want = if firmware == "N/A" {
            String::new()
        } else {
            firmware
        };
        assert_eq!(nic.firmware, want, "{} firmware", nic.name);
        assert_eq!(nic.driver, field("driver:"), "{} driver", nic.name);
        if !want.is_empty() {
            assert_eq!(inv.firmware.get(&format!("nic:{}", nic.mac)), Some(&want));
        }
    }
}
